"""The in-place token-write kernel (pagedkv.kernels.page_write) against MLX's scatter (GPU only)."""

import mlx.core as mx
import numpy as np
import pytest

from pagedkv import AffineQuant, PagedKVCache, PagePool, PageTable
from pagedkv.kernels import page_write, paged_decode

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not page_write.available(), reason="needs MLX on a CUDA GPU")]


def host(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def random_writes(pool: PagePool, seed: int, writes: int = 12) -> None:
    """``writes`` writes of 1-40 tokens per head to distinct (row, slot)s of random layers."""
    rng = np.random.default_rng(seed)
    h, p, ps = pool.num_kv_heads, pool.num_pages, pool.page_size
    for _ in range(writes):
        t = int(rng.integers(1, 40))
        flat = rng.choice(h * p * ps, h * t, replace=False).reshape(h, t)
        rows, slots = mx.array((flat // ps).astype(np.int32)), mx.array((flat % ps).astype(np.int32))
        k = mx.array(rng.standard_normal((h, t, pool.head_dim)).astype(np.float32)).astype(pool.dtype)
        v = mx.array(rng.standard_normal((h, t, pool.v_head_dim)).astype(np.float32)).astype(pool.dtype)
        pool.write(int(rng.integers(0, pool.num_layers)), rows, slots, k, v)


@pytest.mark.parametrize("dtype,k_codec,v_head_dim", [
    (mx.float16, None, 128), (mx.bfloat16, None, 64), (mx.float32, None, 128),
    (mx.float16, AffineQuant(4, 32), 128), (mx.bfloat16, AffineQuant(8, 64), 128),
])
def test_kernel_writes_equal_scatter_writes_bit_for_bit(dtype, k_codec, v_head_dim):
    pools = [PagePool(num_layers=2, num_kv_heads=4, head_dim=128, v_head_dim=v_head_dim, page_size=16,
                      num_pages=64, dtype=dtype, k_codec=k_codec, write_kernel=kernel, cache_limit=None)
             for kernel in (True, False)]
    for pool in pools:
        random_writes(pool, seed=3)
        mx.eval([pool.written(layer) for layer in range(2)])  # (storage is read directly below)
    for layer in range(2):
        for a, b in zip(pools[0].storage(layer), pools[1].storage(layer)):
            assert a.dtype == b.dtype and np.array_equal(host(a), host(b))


def test_a_pool_array_written_by_several_layers_in_one_step_keeps_its_buffer():
    """Six layers share one pool array (as a layer group does), each writing its own page
    and then attending over it, all in one graph: with the kernel no write copies the
    array, however many kernels still read it (MLX's scatter copied it here). The kernel
    is asked for: by default a pool takes it only once ``layout_for`` lays it out in groups."""
    d, hkv, ps, pages = 128, 8, 16, 2048  # a 64 MiB pool array per side
    pool = PagePool(num_layers=1, num_kv_heads=hkv, head_dim=d, page_size=ps, num_pages=pages,
                    dtype=mx.float16, cache_limit=None, write_kernel=True)
    tables = [PageTable(pool) for _ in range(6)]
    caches = [PagedKVCache(t, 0) for t in tables]
    rng = np.random.default_rng(0)
    for c in caches:  # a few pages each, evaluated
        k = mx.array(rng.standard_normal((1, hkv, 40, d)).astype(np.float16))
        mx.eval(c.update_and_fetch(k, k))
    q = mx.array(rng.standard_normal((1, 4 * hkv, 1, d)).astype(np.float16))
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    for _ in range(4):
        x = q
        for c in caches:
            k = (x[:, :hkv] * 0.5).astype(mx.float16)
            c.update_and_fetch(k, k)
            kp, vp = pool.layer_arrays(0)
            table = mx.array(c.table.pages[None].astype(np.int32))
            n = c.table.num_tokens
            x = paged_decode.paged_decode(x, kp, vp, table, mx.array([n], mx.int32), mx.array([0], mx.int32),
                                          d ** -0.5, rows_per_head=pool.rows_per_head, page_size=ps,
                                          after=pool.write_order(0))
            del kp, vp
        mx.eval(x)
    growth = mx.get_peak_memory() - base
    assert growth < 8 << 20, f"peak rose {growth / 2**20:.1f} MiB over a 64 MiB pool array: a write copied it"


def test_reads_after_a_kernel_write_see_the_tokens_written():
    """A gather built after a write, in the same graph and unevaluated in between, reads
    the written values (the pool's arrays depend on the write)."""
    pool = PagePool(num_layers=1, num_kv_heads=2, head_dim=64, page_size=16, num_pages=8, dtype=mx.float16,
                    cache_limit=None)
    cache = PagedKVCache(PageTable(pool), 0)
    for step in range(40):
        k = mx.full((1, 2, 1, 64), step, mx.float16)
        keys, _ = cache.update_and_fetch(k, k + 1)
        assert keys.shape[2] == step + 1 and float(keys[0, 1, step, 5]) == step  # (lazy until here)


def test_a_steps_shared_write_index_writes_the_kernel_pool_as_the_scatter_writes_its_own():
    """Through a batch's row set, whose step builds one write index for every layer (flat
    for the kernel: ``PagePool.write_index``): three rows of different lengths, each
    prefilled in one write of several tokens, then decode steps, some crossing a page;
    keys and values are transposed views, as mlx-lm's attention makes them. The kernel's
    pool ends bit for bit as the scatter's."""
    from types import SimpleNamespace

    from pagedkv import PagedBatch, make_paged_cache

    def kv(rng, rows: int, tokens: int):
        return tuple(mx.array(rng.standard_normal((rows, tokens, 2, 64)).astype(np.float16)).transpose(0, 2, 1, 3)
                     for _ in range(2))

    def run(kernel: bool) -> list[np.ndarray]:
        pool = PagePool(num_layers=2, num_kv_heads=2, head_dim=64, page_size=8, num_pages=64, dtype=mx.float16,
                        write_kernel=kernel, cache_limit=None)
        rng = np.random.default_rng(5)
        batch = PagedBatch(pool, 2)
        for n in (3, 8, 13):
            c = make_paged_cache(SimpleNamespace(layers=[0, 0]), pool)
            for layer in range(2):
                c[layer].update_and_fetch(*kv(rng, 1, n))
            batch.extend(c)
        for _ in range(10):
            for layer in range(2):
                batch.caches[layer].update_and_fetch(*kv(rng, 3, 1))
        mx.eval([pool.written(layer) for layer in range(2)])
        return [host(x) for layer in range(2) for x in pool.storage(layer)]

    for a, b in zip(run(True), run(False)):
        assert np.array_equal(a, b)
