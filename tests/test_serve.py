"""The continuous-batching example: every request's output equals decoding it alone."""

import importlib.util
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import LOGITS_ATOL, ON_CPU

from pagedkv import PagePool

spec = importlib.util.spec_from_file_location("serve", Path(__file__).parents[1] / "examples" / "serve.py")
serve = importlib.util.module_from_spec(spec)
sys.modules["serve"] = serve  # dataclasses look their module up
spec.loader.exec_module(serve)


def solo(model, tokens, n):
    """Greedy tokens of ``tokens`` decoded alone on mlx-lm's KVCache, and at each step the
    gap between the two best logits."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(tokens)[None], cache=cache)[0, -1]
    out, gaps = [], []
    for _ in range(n):
        out.append(int(mx.argmax(logits).item()))
        top = mx.sort(logits)[-2:]
        gaps.append((top[1] - top[0]).item())
        logits = model(mx.array([[out[-1]]]), cache=cache)[0, -1]
    return out, gaps


def assert_same_greedy(served, model, prompt, rid):
    """The served tokens are the solo ones. On a GPU, float32 matmuls of other shapes
    round differently (LOGITS_ATOL), so a step whose two best solo logits lie closer than
    that may flip, and the tokens after it differ; the CPU is held to every token."""
    want, gaps = solo(model, prompt, len(served))
    if served != want:
        first = next(i for i, (a, b) in enumerate(zip(served, want)) if a != b)
        assert not ON_CPU and gaps[first] < LOGITS_ATOL, (rid, first, gaps[first])


@pytest.mark.slow  # (tests/test_serving_engine.py covers the engine in the fast loop)
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_served_outputs_equal_solo_greedy_even_with_preemption(prefix_caching):
    model, layers, kv_heads, head_dim, dtype, vocab = serve.load_model("random")
    pool = PagePool(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, page_size=8,
                    num_pages=48, dtype=dtype)
    trace = serve.make_trace(14, vocab, seed=3, rate=3.0, max_prompt=96, max_new=24, system_len=40)
    report = serve.serve(model, pool, trace, max_batch=8, prefix_caching=prefix_caching, progress=False)
    assert report.preemptions > 0  # the pool really ran out
    for req in trace:
        assert req.done
        assert_same_greedy(req.generated, model, req.prompt, req.rid)
    if prefix_caching:
        assert report.prefix_hit_rate > 0
    assert pool.allocator.num_in_use() == 0
    pool.allocator.check()


@pytest.mark.slow
def test_serve_example_runs_and_saves_a_plot(tmp_path):
    import subprocess

    out = subprocess.run([sys.executable, "examples/serve.py", "--requests", "10", "--plot",
                          str(tmp_path / "pool.png")], cwd=Path(__file__).parents[1],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "prefix cache hit rate" in out.stdout and "preemptions" in out.stdout
    assert (tmp_path / "pool.png").stat().st_size > 1000


def test_a_request_that_can_never_fit_is_rejected_and_the_loop_ends():
    model, layers, kv_heads, head_dim, dtype, vocab = serve.load_model("random")
    pool = PagePool(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, page_size=8,
                    num_pages=6, dtype=dtype)  # 5 usable pages: 40 tokens
    trace = [serve.Request(0, 0, list(range(10)), 8), serve.Request(1, 0, list(range(60)), 4),
             serve.Request(2, 1, list(range(12)), 30)]  # 60 + 4 and 12 + 30 tokens never fit
    report = serve.serve(model, pool, trace, max_batch=4, progress=False)
    assert sorted(report.rejected) == [1, 2]
    assert trace[0].done and trace[0].generated == solo(model, trace[0].prompt, 8)[0]
    assert pool.allocator.num_in_use() == 0
