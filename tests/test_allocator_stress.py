"""The stress harness at fixed seeds: 10^5 operations end with zero leaked pages."""

import pytest

from allocators import FreeListAllocator, SortedAllocator
from allocators.stress import LeakDetected, load_allocator, main, run_stress


@pytest.mark.slow
@pytest.mark.parametrize("cls", [FreeListAllocator, SortedAllocator])
def test_seeded_stress_of_100k_operations_leaks_nothing(cls):
    alloc = cls(2048)
    report = run_stress(alloc, "decode", ops=100_000, seed=1234, check_every=500)
    assert report.ops >= 100_000
    assert report.leaked == 0 and alloc.num_in_use() == 0
    assert report.exhausted > 0  # the pool really ran full
    alloc.check()


@pytest.mark.parametrize("workload", ["uniform", "bursty", "decode"])
def test_every_workload_runs_clean_on_a_small_pool(workload):
    alloc = FreeListAllocator(256, null_page=True)
    report = run_stress(alloc, workload, ops=5_000, seed=7, check_every=1)
    assert report.leaked == 0
    assert set(report.percentiles()) >= {"allocate", "free"}


def test_harness_detects_a_leaking_allocator():
    class Leaky(FreeListAllocator):
        def decref(self, ids):  # drops the release of the first page
            super().decref(list(ids)[1:])

    with pytest.raises(LeakDetected):
        run_stress(Leaky(256), "uniform", ops=2_000, seed=0, check_every=0)


def test_cli_runs_a_user_class_given_as_module_and_name(capsys):
    assert main(["--allocator", "allocators:SortedAllocator", "--workload", "bursty",
                 "--ops", "2000", "--pages", "128"]) == 0
    out = capsys.readouterr().out
    assert "leaked pages after releasing everything: 0" in out
    assert isinstance(load_allocator("free_list", 8), FreeListAllocator)
