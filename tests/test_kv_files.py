"""Saved caches (``save_cache`` / ``load_cache``) and the page-file format under them:
round trips continue generation exactly; truncated, corrupted, other-version and
other-layout files raise typed errors and leave the pool exactly as it was."""

from __future__ import annotations

import json
import struct

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import kv_dims, make_model

from pagedkv import AffineQuant, PagePool, PoolExhausted, make_paged_cache
from pagedkv.cache_file import load_cache, save_cache
from pagedkv.errors import CorruptKvFileError, KvFileError, KvFileMismatchError, KvFileVersionError
from pagedkv.generation import generate, prefill
from pagedkv.page_file import meta_checksum
from pagedkv.safetensors_file import encode, parse

PROMPT = list(range(1, 23))  # 22 tokens: 5 full pages of 4 and a partial one


@pytest.fixture(scope="module")
def model():
    return make_model("llama")


def make_pool(num_pages=40, page_size=4, dtype=mx.float32, codec=None, head_dim=None):
    L, H, D = kv_dims("llama")
    kw = dict(k_codec=codec, v_codec=codec) if codec else {}
    return PagePool(num_layers=L, num_kv_heads=H, head_dim=head_dim or D, page_size=page_size,
                    num_pages=num_pages, dtype=dtype, **kw)


def continue_greedy(model, cache, last_token, n):
    out, tok = [], last_token
    for _ in range(n):
        tok = int(mx.argmax(model(mx.array([[tok]]), cache=cache)[0, -1]).item())
        out.append(tok)
    return out


def saved(model, pool, path, model_id="tiny"):
    with make_paged_cache(model, pool) as c:
        prefill(model, c, PROMPT[:-1])
        return save_cache(path, c, tokens=PROMPT[:-1], model_id=model_id)


def pool_state(pool):
    return pool.allocator.stats(), {k: v.copy() for k, v in pool.read_pages(range(1, pool.num_pages)).items()}


def same_state(a, b):
    return a[0] == b[0] and all(np.array_equal(a[1][k], b[1][k]) for k in a[1])


@pytest.mark.parametrize("pages", ["fp32", "bf16", "affine8"])
def test_a_saved_cache_loads_into_a_fresh_pool_and_continues_exactly(model, tmp_path, pages):
    dtype = mx.bfloat16 if pages == "bf16" else mx.float32
    codec = AffineQuant(8, 64) if pages == "affine8" else None
    if pages == "bf16":  # (bfloat16 pages travel as their 16-bit patterns)
        model = make_model("llama")
        model.set_dtype(mx.bfloat16)
    path = tmp_path / "c.safetensors"
    saved(model, make_pool(dtype=dtype, codec=codec), path)
    pool = make_pool(dtype=dtype, codec=codec)
    with make_paged_cache(model, pool) as ref:
        prefill(model, ref, PROMPT[:-1])
        want = continue_greedy(model, ref, PROMPT[-1], 6)
    cache, tokens = load_cache(path, model, pool, model_id="tiny")
    assert tokens == PROMPT[:-1] and cache.tables[0].num_tokens == 21
    assert continue_greedy(model, cache, PROMPT[-1], 6) == want
    cache.release()
    assert pool.allocator.num_in_use() == 0
    if pages == "fp32":  # and the same as mlx-lm's own cache
        assert want == list(generate(model, make_prompt_cache(model), PROMPT, max_tokens=6))


def test_the_file_opens_in_mx_load_and_names_its_layout(model, tmp_path):
    path = tmp_path / "c.safetensors"
    saved(model, make_pool(), path)
    arrays, meta = mx.load(str(path), return_metadata=True)
    assert arrays["L0.K0"].shape == (6, kv_dims("llama")[1], 4, kv_dims("llama")[2])
    assert meta["format"] == "pagedkv.pages" and json.loads(meta["layout"])["page_size"] == "4"


def each_refused(model, tmp_path, files, error=KvFileError) -> None:
    """``load_cache`` refuses each of ``files`` (bytes) with ``error``, and the pool it
    was asked to load into is left exactly as it was."""
    pool = make_pool()
    before = pool_state(pool)
    for data in files:
        (tmp_path / "bad").write_bytes(data)
        with pytest.raises(error):
            load_cache(tmp_path / "bad", model, pool, model_id="tiny")
    assert same_state(pool_state(pool), before)


def flipped(data: bytes, pos: int, bits: int) -> bytes:
    bad = bytearray(data)
    bad[pos] ^= bits
    return bytes(bad)


def test_truncated_files_are_refused_and_the_pool_is_unchanged(model, tmp_path):
    path = tmp_path / "c.safetensors"
    saved(model, make_pool(), path)
    data = path.read_bytes()
    each_refused(model, tmp_path, (data[:cut] for cut in (0, 5, 8, 40, len(data) // 2, len(data) - 1)),
                 CorruptKvFileError)


def test_flipped_bytes_are_caught_by_the_header_checks_or_the_page_checksums(model, tmp_path):
    path = tmp_path / "c.safetensors"
    saved(model, make_pool(), path)
    data = path.read_bytes()
    header = 8 + struct.unpack("<Q", data[:8])[0]
    rng = np.random.default_rng(0)
    each_refused(model, tmp_path, (flipped(data, pos, 0x5A) for pos in
                                   [header + 3, len(data) - 5, *rng.integers(header, len(data), 20), 20, 60]))


def rewrite_meta(path, out, resign=True, **changes):
    """``path`` with metadata ``changes`` (an entry given as None is removed), written
    to ``out``; re-signed (a fresh metadata checksum) unless ``resign`` is False, so that
    a test reaches the check it is about."""
    tensors, meta, kinds = parse(path.read_bytes())
    meta = {k: v for k, v in {**meta, **changes}.items() if v is not None}
    if resign and "meta_checksum" in meta:
        meta["meta_checksum"] = meta_checksum(meta)
    out.write_bytes(b"".join(bytes(p) for p in encode(tensors, meta, {k: v for k, v in kinds.items() if v == "BF16"})))


def test_another_format_version_is_refused(model, tmp_path):
    path = tmp_path / "c.safetensors"
    saved(model, make_pool(), path)
    rewrite_meta(path, tmp_path / "v", version="3")
    with pytest.raises(KvFileVersionError):
        load_cache(tmp_path / "v", model, make_pool(), model_id="tiny")
    rewrite_meta(path, tmp_path / "w", format="something.else")
    with pytest.raises(KvFileVersionError):
        load_cache(tmp_path / "w", model, make_pool(), model_id="tiny")


@pytest.mark.parametrize("other", [
    dict(page_size=8), dict(dtype=mx.float16), dict(codec=AffineQuant(8, 64)), dict(head_dim=32),
])
def test_a_file_of_another_layout_is_refused(model, tmp_path, other):
    path = tmp_path / "c.safetensors"
    saved(model, make_pool(), path)
    pool = make_pool(**other)
    before = pool.allocator.stats()
    with pytest.raises(KvFileMismatchError):
        load_cache(path, model, pool, model_id="tiny")
    assert pool.allocator.stats() == before


def test_a_file_of_another_model_is_refused(model, tmp_path):
    path = tmp_path / "c.safetensors"
    saved(model, make_pool(), path, model_id="model-a")
    with pytest.raises(KvFileMismatchError, match="model-a"):
        load_cache(path, model, make_pool(), model_id="model-b")


def test_a_full_pool_refuses_a_load_and_keeps_its_pages(model, tmp_path):
    path = tmp_path / "c.safetensors"
    saved(model, make_pool(), path)
    pool = make_pool(num_pages=6)  # 5 usable pages, the file holds 6
    before = pool_state(pool)
    with pytest.raises(PoolExhausted):
        load_cache(path, model, pool, model_id="tiny")
    assert same_state(pool_state(pool), before)


def test_inconsistent_lengths_are_refused(model, tmp_path):
    path = tmp_path / "c.safetensors"
    saved(model, make_pool(), path)
    for change in (dict(num_tokens="40"), dict(num_tokens="x"), dict(tokens="[1, 2]"), dict(kind="tier")):
        rewrite_meta(path, tmp_path / "m", **change)
        with pytest.raises(CorruptKvFileError):
            load_cache(tmp_path / "m", model, make_pool(), model_id="tiny")


def test_a_flipped_bit_anywhere_in_the_metadata_is_caught(model, tmp_path):
    """Page bytes have their CRCs; the metadata has one too. Without it, the lowest bit
    of a token id's digit flipped ("1" to "0") loaded as another token, silently."""
    path = tmp_path / "c.safetensors"
    saved(model, make_pool(), path)
    data = path.read_bytes()
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    start = data.index(b'"__metadata__"')
    each_refused(model, tmp_path, (flipped(data, pos, bit) for pos in range(start, header_end, 3)
                                   for bit in (0x01, 0x04)))


def test_a_version_1_file_without_a_metadata_checksum_still_loads(model, tmp_path):
    path = tmp_path / "c.safetensors"
    saved(model, make_pool(), path)
    rewrite_meta(path, tmp_path / "v1", version="1", meta_checksum=None)
    cache, tokens = load_cache(tmp_path / "v1", model, make_pool(), model_id="tiny")
    assert tokens == PROMPT[:-1]
    cache.release()
    rewrite_meta(path, tmp_path / "v2", meta_checksum=None)  # version 2 needs it
    with pytest.raises(CorruptKvFileError, match="checksum"):
        load_cache(tmp_path / "v2", model, make_pool(), model_id="tiny")


def safetensors_bytes(header: dict, body: bytes, declared: int | None = None) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text) if declared is None else declared) + text + body


@pytest.mark.parametrize("entry, why", [
    ({"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}, "malformed"),  # float offsets
    ({"dtype": "F32", "shape": [2], "data_offsets": [False, 8]}, "malformed"),  # a bool is no offset
    ({"dtype": "F32", "shape": [-2, -1], "data_offsets": [0, 8]}, "malformed"),  # negative sizes, product 2
    ({"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}, "malformed"),
    ({"dtype": "F31", "shape": [2], "data_offsets": [0, 8]}, "malformed"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, "do not hold"),  # a range backwards
    ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "do not hold"),
])
def test_a_malformed_tensor_entry_is_a_corrupt_file_error(entry, why):
    with pytest.raises(CorruptKvFileError, match=why):
        parse(safetensors_bytes({"t": entry}, bytes(8)))


def test_a_header_longer_than_the_file_is_refused_before_it_is_parsed():
    header = {"t": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}
    data = safetensors_bytes(header, b"")
    parse(data)  # (a valid file: one empty tensor)
    for declared in (len(data) - 7, 1 << 40):  # the header as declared runs past the end
        with pytest.raises(CorruptKvFileError, match="header of"):
            parse(safetensors_bytes(header, b"", declared=declared))


def test_empty_tensors_round_trip_beside_others():
    tensors = {"a": np.arange(3, dtype=np.float32), "z": np.zeros((0, 4), np.int32), "b": np.ones(2, np.int64)}
    got, meta, _ = parse(b"".join(bytes(p) for p in encode(tensors, {"k": "v"})))
    assert meta == {"k": "v"} and list(got) == ["a", "z", "b"]
    assert all(got[k].dtype == v.dtype and got[k].shape == v.shape and np.array_equal(got[k], v)
               for k, v in tensors.items())
