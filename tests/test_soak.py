"""The seeded soak of bench/soak.py, short: mixed operations with exhaustion and bad
input end with no invariant violation, no state changed by a failed call, no untyped
error and no leaked page (the full 10^6-operation run is in bench/RESULTS.md)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))

import pytest  # noqa: E402
import soak  # noqa: E402


@pytest.mark.slow
def test_a_short_seeded_soak_finds_no_violation_and_no_leak(capsys):
    assert soak.main(["--ops", "6000", "--seed", "7", "--check-every", "50", "--debug"]) == 0
    assert "leaked pages 0" in capsys.readouterr().out
