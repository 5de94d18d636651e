"""The paged decode kernel's launch planning (pure Python: runs without a GPU)."""

import pytest

from pagedkv.kernels.paged_decode import MAX_PAGES_PER_SPLIT, Pipeline, choose_splits


@pytest.mark.parametrize("batch", [1, 8, 32, 64, 128, 1000])
@pytest.mark.parametrize("width", [1, 7, 64, 256, 2048, 5000, 40000])
def test_splits_keep_page_ids_in_shared_memory_and_blocks_non_empty(batch, width):
    s = choose_splits(batch, 8, width)
    assert 1 <= s <= width
    assert -(-width // s) <= MAX_PAGES_PER_SPLIT


def test_small_batches_get_more_splits_than_large_ones():
    assert choose_splits(1, 8, 256) > choose_splits(8, 8, 256) > choose_splits(64, 8, 256)


def test_pipeline_shared_memory_covers_staging_page_ids_and_the_merge():
    fma = Pipeline(warps=4, groups=4, stages=2, tensor_cores=False)
    assert fma.shared_bytes(128, 4, 100) == 4 * 2 * 4 * 2 * 32 * 16 + 400
    assert fma.shared_bytes(256, 16, 1) == 4 * 16 * 258 * 4   # the warps' partials dominate
    mma = Pipeline(warps=4, stages=2)  # 8 tokens' K and V per warp and stage, plus p hand-over
    assert mma.shared_bytes(128, 4, 100) == 4 * 2 * 8 * 128 * 2 * 2 + 4 * 2 * 4 * 9 * 4 + 400


def test_tensor_cores_only_for_gqa_groups_up_to_16():
    assert Pipeline().uses_tensor_cores(16) and not Pipeline().uses_tensor_cores(17)
    assert not Pipeline(tensor_cores=False).uses_tensor_cores(4)


@pytest.mark.parametrize("bad", [dict(warps=3), dict(groups=16), dict(stages=1)])
def test_pipeline_rejects_shapes_the_kernel_does_not_support(bad):
    with pytest.raises(ValueError):
        Pipeline(**bad)


def test_any_batch_and_width_needs_one_of_a_few_shared_memory_sizes():
    """Width, splits and pool size are runtime arguments; only the shared-memory size
    picks a kernel object, so generation over any batch and width compiles a handful."""
    from pagedkv.kernels.paged_decode import shared_pages

    sizes = set()
    for batch in (1, 2, 3, 8, 31, 64, 128):
        for width in range(1, 4097, 7):
            s = choose_splits(batch, 8, width)
            pps = -(-width // s)
            sizes.add(shared_pages(pps))
            assert shared_pages(pps) >= pps
    assert sizes <= {64, 128, 256, 512, 1024, 2048} and len(sizes) <= 6


@pytest.mark.parametrize("dtype, fits", [("float16", True), ("bfloat16", True), ("float32", False)])
def test_the_prefill_kernel_claims_only_queries_it_can_run(monkeypatch, dtype, fits):
    import mlx.core as mx

    from pagedkv.kernels import paged_decode, paged_prefill

    monkeypatch.setattr(paged_decode, "available", lambda: True)  # the GPU check alone
    q = mx.zeros((1, 4, 8, 64), dtype=getattr(mx, dtype))
    assert paged_prefill.fits(q, 2, q.dtype) is fits
    assert not paged_prefill.fits(q[:, :, :1], 2, q.dtype)  # one query: the decode kernel's
    assert not paged_prefill.fits(mx.zeros((1, 4, 8, 96), dtype=q.dtype), 2, q.dtype)
