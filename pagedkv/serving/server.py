"""``pagedkv serve``: an OpenAI-compatible HTTP server on pagedkv's engine.

    pagedkv serve [--model smollm2|tiny-random|PATH.gguf|MLX_LM_DIR] [--host 127.0.0.1] [--port 8080]
                  [--pool-bytes N] [--page-size 16] [--kv-bits B] [--max-batch N]
                  [--prefill-budget N] [--max-tokens N] [--no-prefix-caching]
                  [--compiled-decode auto|on|off] [--overlap-decode on|off]

The model, the pool and the engine are built on the engine's own thread (MLX streams
are thread-local); uvicorn serves the Starlette app on the main thread's event loop.
Ctrl-C (or SIGTERM) stops accepting, aborts what is in flight and releases every page.

An mlx-lm model directory (``config.json``, safetensors, a Hugging Face tokenizer) may be
any family pagedkv serves. A model with sliding-window layers runs without the prefix
cache (it cannot keep a prompt's pages: the window gives them back), as
``--no-prefix-caching``; a hybrid's recurrent layers get a state pool of ``2 x
--max-batch`` slots (running requests and prefix checkpoints).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pagedkv.cli import int_at_least, positive_int
from pagedkv.errors import InvalidValueError

DEFAULT_POOL_BYTES = 256 << 20
COMPILED_DECODE = {"auto": None, "on": True, "off": False}  # --compiled-decode -> Engine(compiled_decode=)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pagedkv serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2",
                    help="smollm2 (SmolLM2-135M-Instruct, the default), tiny-random (random weights "
                         "with SmolLM2's tokenizer, for testing the serving path), a llama GGUF path, or "
                         "an mlx-lm model directory (config.json, safetensors, tokenizer)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int_at_least(0), default=8080, help="0 picks a free port")
    ap.add_argument("--pool-bytes", type=int_at_least(1), default=DEFAULT_POOL_BYTES,
                    help=f"KV pool size in bytes, K + V of all layers (default {DEFAULT_POOL_BYTES >> 20} MiB)")
    ap.add_argument("--page-size", type=positive_int, default=16, help="tokens per KV page")
    ap.add_argument("--kv-bits", type=int, choices=[2, 3, 4, 8], default=None,
                    help="quantised K/V pages (8: affine; fewer: TurboQuant-style rotated)")
    ap.add_argument("--max-batch", type=positive_int, default=32, help="most requests decoded together")
    ap.add_argument("--prefill-budget", type=positive_int, default=512,
                    help="prompt tokens prefilled per engine step; a longer prompt is spread over "
                         "several steps while the running requests keep decoding (chunked prefill)")
    ap.add_argument("--max-tokens", type=positive_int, default=None,
                    help="max_tokens of a request that gives none (default: what its context allows)")
    ap.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    ap.add_argument("--compiled-decode", choices=["auto", "on", "off"], default="auto",
                    help="run decode steps under mx.compile (traced once per batch size and page-table "
                         "width, then replayed: less host work per token). auto (default): on with MLX "
                         "on a CUDA GPU, for the models it serves; on: refuse a model it cannot serve")
    ap.add_argument("--overlap-decode", choices=["on", "off"], default="on",
                    help="build each decode step while the device runs the previous one, reading its "
                         "tokens a step later (on, the default); off: read every step's tokens first")
    ap.add_argument("--disk-tier", metavar="DIR", default=None,
                    help="keep evicted prefix pages in DIR (and every cached page at shutdown), so "
                         "prefix hits survive eviction and restarts")
    ap.add_argument("--disk-tier-bytes", type=int_at_least(1), default=4 << 30,
                    help="most bytes the disk tier keeps (least recently used files go first; default 4 GiB)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return ap


def load_model(spec: str):
    """A ``LoadedModel`` for ``--model``; its ``name`` is what clients send as "model"."""
    import attrs

    from pagedkv.gguf_model import load_gguf_llama, smollm2_path, tiny_random_llama
    from pagedkv.mlx_lm_model import is_mlx_lm_dir, load_mlx_lm

    if spec == "smollm2":
        return attrs.evolve(load_gguf_llama(smollm2_path(install=True)), name="smollm2")
    if spec == "tiny-random":
        return tiny_random_llama(smollm2_path(install=True))
    if is_mlx_lm_dir(spec):
        return load_mlx_lm(spec)
    if not (os.path.isfile(spec) and spec.endswith(".gguf")):
        raise InvalidValueError(f"--model {spec!r} is not smollm2, tiny-random, a .gguf file or an mlx-lm "
                                "model directory")
    return load_gguf_llama(spec)


def build_engine(args: argparse.Namespace, loaded: list):
    """Load the model and make the engine (runs on the engine thread)."""
    from mlx_lm.models.cache import make_prompt_cache

    from pagedkv.cache import layout_for
    from pagedkv.mlx_lm_caches import flat_caches
    from pagedkv.pool_factory import pool_for
    from pagedkv.prefix import prefix_cache_serves
    from pagedkv.serving.engine import Engine
    from pagedkv.serving.metrics import ServingMetrics
    from pagedkv.state_pool import StatePool

    lm = load_model(args.model)
    loaded.append(lm)
    pool = pool_for(lm, page_size=args.page_size, max_bytes=args.pool_bytes, kv_bits=args.kv_bits)
    recurrent = any(type(c).__name__ == "ArraysCache" for c in flat_caches(make_prompt_cache(lm.model)))
    states = StatePool.for_model(lm.model, num_slots=2 * args.max_batch + 1) if recurrent else None
    prefix_caching = not args.no_prefix_caching
    layout = layout_for(lm.model, pool, state_pool=states)
    if prefix_caching and not prefix_cache_serves(layout, hybrid=states is not None):
        print("prefix caching off: the model's layers all slide, or it has recurrent ones beside sliding ones",
              file=sys.stderr, flush=True)
        prefix_caching = False
    disk = None
    if args.disk_tier and (not prefix_caching or states is not None):
        print("disk tier off: it keeps the prefix cache's K/V pages, of models without recurrent layers",
              file=sys.stderr, flush=True)
    elif args.disk_tier:
        from pagedkv.disk_tier import DiskTier

        disk = DiskTier(args.disk_tier, pool, max_bytes=args.disk_tier_bytes, model_id=model_fingerprint(lm))
    return Engine(lm.model, pool, decode=lm.decode, eos_token_ids=lm.eos_token_ids,
                  max_batch=args.max_batch, prefix_caching=prefix_caching, state_pool=states,
                  prefill_budget=args.prefill_budget, prefill_chunk=min(512, args.prefill_budget),
                  metrics=ServingMetrics(lm.name), disk_tier=disk,
                  compiled_decode=COMPILED_DECODE[args.compiled_decode],
                  overlap_decode=args.overlap_decode == "on")


def model_fingerprint(lm) -> str:
    """Names the weights a disk tier's pages were computed with: the model's name, its
    hyper-parameters and a digest of a sample of every weight tensor."""
    import hashlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    h = hashlib.blake2b(repr(lm.model.args).encode(), digest_size=16)
    for name, w in tree_flatten(lm.model.parameters()):
        flat = w.reshape(-1)
        sample = flat[:: max(1, flat.size // 64)][:64]
        h.update(name.encode() + bytes(memoryview(sample.view(mx.uint8))))  # (any dtype, bfloat16 too)
    return f"{lm.name}:{h.hexdigest()}"


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedkv.serving.app import create_app
    from pagedkv.serving.engine_thread import EngineThread

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    loaded: list = []
    thread = EngineThread(lambda: build_engine(args, loaded))
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    engine = thread.start()
    lm = loaded[0]
    pool = engine.pool
    print(f"model '{lm.name}': {lm.num_layers} layers, {lm.num_kv_heads} KV heads, head_dim {lm.head_dim}; "
          f"KV pool {pool.usable_pages} pages of {pool.page_size} tokens x {pool.num_layers} layers"
          f"{' (in layer groups)' if pool.num_layers < lm.num_layers else ''} ({pool.nbytes / 2**20:.1f} MiB, "
          f"K {pool.k_codec.label()}, V {pool.v_codec.label()})", file=sys.stderr, flush=True)
    app = create_app(thread, lm, default_max_tokens=args.max_tokens, on_shutdown=lambda: stop(thread))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run()  # (re-raises SIGINT/SIGTERM after shutting down)
    finally:
        stop(thread)
    return 0


def stop(thread) -> None:
    """Abort what is in flight, release every page and say so (once)."""
    if not thread.alive:
        return
    thread.stop()
    stats = thread.engine.pool.allocator.stats()
    print(f"engine stopped: {stats.in_use} KV pages in use, {stats.cached} cached, {stats.free} free",
          file=sys.stderr, flush=True)
