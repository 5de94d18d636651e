"""Paged decode attention on CUDA: reads K/V straight from the page pool, no gather.

Two kernels through ``mx.fast.cuda_kernel`` (flash-decoding style split-K):

  pass 1  one thread block per (row b, KV head h, split s). The split covers pages
          [s * PPS, (s + 1) * PPS) of row b's page table. D/8 lanes hold one token (8
          elements each: one 16-byte load for K, one for V), so a warp covers 32/(D/8)
          tokens at once; it issues four such groups' loads (kept packed) before any
          math, takes the chunk's max, and rescales its accumulators once per chunk. Every
          lane keeps its 8 elements of each query head of the GQA group (REP query heads
          share KV head h), so one K load serves REP dot products (for fp16 as half2
          FMAs, widened to float before the shuffle sum). Online softmax (exp2,
          scores pre-scaled by log2 e) keeps a running max m, sum l and accumulator per
          query head; token groups merge by shuffles, warps in shared memory, and the
          block writes (acc[D], m, l) per query head.
  pass 2  one block per (row, query head): merges the splits' partials and writes the
          output in the query's dtype.

Pool layout (see PagePool): per layer, [kv_heads * P, page_size, D], row h * P + page.
Rows may be ragged; tokens outside [start_b, length_b) are skipped. Query length 1.
Costs: every valid K/V byte is read once; partials are B * Hq * S * (D + 2) floats.
"""

from __future__ import annotations

import math

import mlx.core as mx

WARPS = 4

_HEADER = """
#include <cuda_fp16.h>
#include <cuda_bf16.h>
// 8 consecutive 16-bit values in one 16-byte load, widened to float.
template <typename A, typename B> struct same_type { static constexpr bool value = false; };
template <typename A> struct same_type<A, A> { static constexpr bool value = true; };
template <typename T> __device__ __forceinline__ void load8(const T* p, float* f) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* h = reinterpret_cast<const T*>(&raw);
    #pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(h[i]);
}
"""

_PASS1 = """
    // LPT lanes hold one token's D values (8 per lane, one 16-byte load each for K and
    // V); a warp covers TPW = 32 / LPT tokens at once and two such groups per iteration.
    constexpr int LPT = D / 8;
    constexpr int TPW = 32 / LPT;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int sub = lane / LPT;              // which token of the warp's group
    const int col = (lane % LPT) * 8;        // first of this lane's 8 elements
    const int blk = blockIdx.x;
    const int s = blk % S;
    const int h = (blk / S) % HKV;
    const int b = blk / (S * HKV);
    const int length = lengths[b];
    const int start = starts[b];
    const float qscale = scale[0] * 1.4426950408889634f;   // log2(e): exp2 below

    // fp16: the q.k partial products run as half2 FMAs (4 per lane instead of 8 widening
    // conversions and 8 float FMAs); the per-lane partial is widened before the shuffles.
    constexpr bool HALF_DOT = same_type<T, __half>::value;
    float q[REP][8];
    __half2 qh[REP][4];
    #pragma unroll
    for (int r = 0; r < REP; ++r) {
        load8(queries + ((long long)b * HKV * REP + h * REP + r) * D + col, q[r]);
        #pragma unroll
        for (int i = 0; i < 8; ++i) q[r][i] *= qscale;
        #pragma unroll
        for (int i = 0; i < 4; ++i) qh[r][i] = __floats2half2_rn(q[r][2 * i], q[r][2 * i + 1]);
    }
    float m[REP], l[REP], acc[REP][8];
    #pragma unroll
    for (int r = 0; r < REP; ++r) {
        m[r] = -INFINITY; l[r] = 0.f;
        #pragma unroll
        for (int i = 0; i < 8; ++i) acc[r][i] = 0.f;
    }
    const int t0 = max(s * PPS * PS, start);
    const int t1 = min((s + 1) * PPS * PS, length);
    constexpr int U = 4;                     // token groups per warp iteration
    constexpr int STEP = WARPS * TPW;
    // The loop bound is warp-uniform: every lane runs every iteration, because the
    // shuffles below need the whole warp; tokens past the end are masked by ok[].
    for (int wbase = t0 + warp * TPW; wbase < t1; wbase += U * STEP) {
        uint4 kraw[U], vraw[U];
        bool ok[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) {        // all K and V loads first, kept packed
            const int t = wbase + sub + u * STEP;
            ok[u] = t < t1;
            kraw[u] = vraw[u] = make_uint4(0u, 0u, 0u, 0u);  // masked tokens: 0, never NaN
            if (ok[u]) {
                const int page = table[(long long)b * W + t / PS];
                const long long off = (((long long)h * P + page) * PS + (t % PS)) * D + col;
                kraw[u] = *reinterpret_cast<const uint4*>(kpool + off);
                vraw[u] = *reinterpret_cast<const uint4*>(vpool + off);
            }
        }
        float sc[U][REP];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const T* kh = reinterpret_cast<const T*>(&kraw[u]);
            const __half2* k2 = reinterpret_cast<const __half2*>(&kraw[u]);
            float kf[8];
            if constexpr (!HALF_DOT) {
                #pragma unroll
                for (int i = 0; i < 8; ++i) kf[i] = static_cast<float>(kh[i]);
            }
            #pragma unroll
            for (int r = 0; r < REP; ++r) {
                float dot = 0.f;
                if constexpr (HALF_DOT) {
                    __half2 d2 = __hmul2(qh[r][0], k2[0]);
                    #pragma unroll
                    for (int i = 1; i < 4; ++i) d2 = __hfma2(qh[r][i], k2[i], d2);
                    const float2 df = __half22float2(d2);
                    dot = df.x + df.y;
                } else {
                    #pragma unroll
                    for (int i = 0; i < 8; ++i) dot = fmaf(q[r][i], kf[i], dot);
                }
                #pragma unroll
                for (int o = LPT / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
                sc[u][r] = ok[u] ? dot : -INFINITY;
            }
        }
        #pragma unroll
        for (int r = 0; r < REP; ++r) {      // one rescale per chunk, not per token
            float mc = sc[0][r];
            #pragma unroll
            for (int u = 1; u < U; ++u) mc = fmaxf(mc, sc[u][r]);
            const float mn = fmaxf(m[r], mc);
            if (mn == -INFINITY) continue;
            const float corr = exp2f(m[r] - mn);
            l[r] *= corr;
            #pragma unroll
            for (int i = 0; i < 8; ++i) acc[r][i] *= corr;
            m[r] = mn;
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const T* vh = reinterpret_cast<const T*>(&vraw[u]);
            float vf[8];
            #pragma unroll
            for (int i = 0; i < 8; ++i) vf[i] = static_cast<float>(vh[i]);
            #pragma unroll
            for (int r = 0; r < REP; ++r) {
                const float p = ok[u] ? exp2f(sc[u][r] - m[r]) : 0.f;
                l[r] += p;
                #pragma unroll
                for (int i = 0; i < 8; ++i) acc[r][i] = fmaf(p, vf[i], acc[r][i]);
            }
        }
    }
    // merge the TPW token groups of each warp (lanes differing by multiples of LPT)
    #pragma unroll
    for (int o = LPT; o < 32; o <<= 1) {
        #pragma unroll
        for (int r = 0; r < REP; ++r) {
            const float mo = __shfl_xor_sync(0xffffffffu, m[r], o);
            const float lo = __shfl_xor_sync(0xffffffffu, l[r], o);
            const float mn = fmaxf(m[r], mo);
            const float c1 = (m[r] == -INFINITY) ? 0.f : exp2f(m[r] - mn);
            const float c2 = (mo == -INFINITY) ? 0.f : exp2f(mo - mn);
            l[r] = l[r] * c1 + lo * c2;
            #pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float ao = __shfl_xor_sync(0xffffffffu, acc[r][i], o);
                acc[r][i] = acc[r][i] * c1 + ao * c2;
            }
            m[r] = mn;
        }
    }
    // merge the warps: shared [WARPS][REP][D + 2]
    __shared__ float sh[WARPS * REP * (D + 2)];
    if (lane < LPT) {
        #pragma unroll
        for (int r = 0; r < REP; ++r) {
            float* row = sh + (warp * REP + r) * (D + 2);
            #pragma unroll
            for (int i = 0; i < 8; ++i) row[col + i] = acc[r][i];
            if (lane == 0) { row[D] = m[r]; row[D + 1] = l[r]; }
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < REP * D; idx += WARPS * 32) {
        const int r = idx / D, d = idx % D;
        float mm = -INFINITY;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, sh[(w * REP + r) * (D + 2) + D]);
        float a = 0.f, ll = 0.f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float* row = sh + (w * REP + r) * (D + 2);
            const float c = (row[D] == -INFINITY) ? 0.f : exp2f(row[D] - mm);
            a += row[d] * c;
            ll += row[D + 1] * c;
        }
        const long long o = (((long long)b * HKV * REP + h * REP + r) * S + s);
        part_acc[o * D + d] = a;
        if (d == 0) { part_ml[o * 2] = mm; part_ml[o * 2 + 1] = ll; }
    }
"""

_PASS2 = """
    const int bq = blockIdx.x;               // row * HQ + query head
    const long long base = (long long)bq * S;
    float mm = -INFINITY;
    for (int s = 0; s < S; ++s) mm = fmaxf(mm, part_ml[(base + s) * 2]);
    float ll = 0.f;
    for (int s = 0; s < S; ++s) {
        const float ms = part_ml[(base + s) * 2];
        if (ms != -INFINITY) ll += part_ml[(base + s) * 2 + 1] * exp2f(ms - mm);
    }
    const float inv = ll > 0.f ? 1.f / ll : 0.f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float a = 0.f;
        for (int s = 0; s < S; ++s) {
            const float ms = part_ml[(base + s) * 2];
            if (ms != -INFINITY) a += part_acc[(base + s) * D + d] * exp2f(ms - mm);
        }
        out[(long long)bq * D + d] = static_cast<T>(a * inv);
    }
"""

_KERNELS: dict[str, object] = {}


def available() -> bool:
    """True when MLX runs on a CUDA GPU here (the kernel's only backend)."""
    try:
        return mx.cuda.is_available() and mx.default_device() == mx.gpu
    except AttributeError:
        return False


def usable(q: mx.array, mask, pool) -> bool:
    """Whether a view's attention can take the kernel path (else: exact gather + SDPA)."""
    from pagedkv.codec import FullPrecision

    return (
        q.shape[2] == 1 and mask is None and available()
        and isinstance(pool.k_codec, FullPrecision) and isinstance(pool.v_codec, FullPrecision)
        and pool.dtype in (mx.float16, mx.bfloat16) and q.dtype == pool.dtype
        and pool.head_dim == pool.v_head_dim and pool.head_dim in (64, 128, 256)
    )


def _kernel(name: str):
    k = _KERNELS.get(name)
    if k is None:
        if name == "pass1":
            k = mx.fast.cuda_kernel(
                name="pagedkv_decode_pass1",
                input_names=["queries", "kpool", "vpool", "table", "lengths", "starts", "scale"],
                output_names=["part_acc", "part_ml"], source=_PASS1, header=_HEADER,
            )
        else:
            k = mx.fast.cuda_kernel(
                name="pagedkv_decode_pass2", input_names=["part_acc", "part_ml"],
                output_names=["out"], source=_PASS2, header=_HEADER,
            )
        _KERNELS[name] = k
    return k


def choose_splits(batch: int, kv_heads: int, width_pages: int, sms: int = 132) -> int:
    """Splits per (row, KV head) so that the grid fills the GPU about four times over."""
    want = math.ceil(4 * sms / max(1, batch * kv_heads))
    return max(1, min(want, width_pages))


def paged_decode(q: mx.array, k_pool: mx.array, v_pool: mx.array, table: mx.array, lengths: mx.array,
                 starts: mx.array, scale: float, *, num_pages: int, page_size: int,
                 splits: int | None = None, poison: bool = False) -> mx.array:
    """Attention of ``q`` [B, Hq, 1, D] over paged K/V; returns [B, Hq, 1, D].

    ``k_pool``/``v_pool``: one layer's pool arrays [kv_heads * num_pages, page_size, D];
    ``table``: int32 [B, W] page ids; ``lengths``/``starts``: int32 [B] visible token range.
    ``poison`` fills the outputs with NaN before the kernels run (tests: every element
    must be written).
    """
    init = {"init_value": float("nan")} if poison else {}
    b, hq, lq, d = q.shape
    if lq != 1:
        raise ValueError("the paged decode kernel takes one query per row")
    hkv = k_pool.shape[0] // num_pages
    if hq % hkv or d not in (64, 128, 256) or k_pool.dtype not in (mx.float16, mx.bfloat16):
        raise ValueError(f"unsupported shape/dtype: Hq={hq}, Hkv={hkv}, D={d}, {k_pool.dtype}")
    w = table.shape[1]
    s = splits or choose_splits(b, hkv, w)
    pps = -(-w // s)
    s = -(-w // pps)
    rep = hq // hkv
    template = [("T", q.dtype), ("D", d), ("PS", page_size), ("P", num_pages), ("W", w), ("S", s),
                ("PPS", pps), ("HKV", hkv), ("REP", rep), ("WARPS", WARPS)]
    part_acc, part_ml = _kernel("pass1")(
        inputs=[q.reshape(b * hq, d), k_pool, v_pool, table, lengths, starts,
                mx.array([scale], dtype=mx.float32)],
        template=template, grid=(b * hkv * s * WARPS * 32, 1, 1), threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(b * hq * s * d,), (b * hq * s * 2,)], output_dtypes=[mx.float32, mx.float32],
        **init,
    )
    (out,) = _kernel("pass2")(
        inputs=[part_acc, part_ml], template=[("T", q.dtype), ("D", d), ("S", s)],
        grid=(b * hq * min(d, 128), 1, 1), threadgroup=(min(d, 128), 1, 1),
        output_shapes=[(b * hq * d,)], output_dtypes=[q.dtype], **init,
    )
    return out.reshape(b, hq, 1, d)
