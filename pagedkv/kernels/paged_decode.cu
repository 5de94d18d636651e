// Paged decode attention: the CUDA source of pagedkv/kernels/paged_decode.py.
// mx.fast.cuda_kernel takes a header and a kernel body; paged_decode.py cuts this file
// at the '// @section NAME' lines and joins the bodies it needs (see its module doc).

// @section header
#include <cuda_fp16.h>
#include <cuda_bf16.h>
template <typename A, typename B> struct same_type { static constexpr bool value = false; };
template <typename A> struct same_type<A, A> { static constexpr bool value = true; };
// 8 consecutive 16-bit values in one 16-byte load, widened to float.
template <typename T> __device__ __forceinline__ void load8(const T* p, float* f) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* h = reinterpret_cast<const T*>(&raw);
    #pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(h[i]);
}
// Asynchronous 16-byte global -> shared copy (sm_80+); src_bytes = 0 writes zeros.
__device__ __forceinline__ void copy16_async(void* dst, const void* src, int src_bytes) {
    const unsigned int d = static_cast<unsigned int>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(d), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void copies_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void copies_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}
// Tensor-core helpers (sm_80+): four 8x8 b16 matrices from shared memory, one
// m16n8k16 multiply-accumulate with f32 accumulators.
__device__ __forceinline__ void load_matrices_x4(const void* row, unsigned int* r) {
    const unsigned int a = static_cast<unsigned int>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
// a: this lane's A fragment as (a0, a2[, a1, a3]); with ROWS == 1 the rows g + 8 are zero.
template <typename T, int ROWS> __device__ __forceinline__ void mma_16x8x16(
        float* c, const unsigned int* a, unsigned int b0, unsigned int b1) {
    const unsigned int a1 = ROWS > 1 ? a[2] : 0u, a3 = ROWS > 1 ? a[3] : 0u;
    if constexpr (same_type<T, __half>::value) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a1), "r"(a[1]), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a1), "r"(a[1]), "r"(a3), "r"(b0), "r"(b1));
    }
}

// @section block
    // This block's (row b, KV head h, split s), the row's visible tokens [start, length),
    // and this thread's lane and warp.
    // Runtime sizes (one compiled kernel serves every batch, width and split count):
    // splits per (row, KV head), pages per split, page-table width, pool rows per head.
    const int S = dims[0], PPS = dims[1], W = dims[2], P = dims[3];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int blk = blockIdx.x;
    const int s = blk % S;
    const int h = (blk / S) % HKV;
    const int b = blk / (S * HKV);
    const int length = lengths[b];
    const int start = starts[b];
    const float qscale = scale[0] * 1.4426950408889634f;   // log2(e): exp2 below

// @section pass1_fma
    // LPT lanes hold one token's D values (8 per lane: one 16-byte piece each of K and
    // V); a warp covers TPW = 32 / LPT tokens at once, U such groups per iteration.
    constexpr int LPT = D / 8;
    constexpr int TPW = 32 / LPT;
    constexpr int STEP = WARPS * TPW;        // tokens one group of the whole block covers
    constexpr int CHUNK = U * STEP;          // tokens per iteration of the block
    constexpr int SLOTS = U * 2 * 32;        // 16-byte pieces one warp stages per iteration
    const int sub = lane / LPT;              // which token of the warp's group
    const int col = (lane % LPT) * 8;        // first of this lane's 8 elements

    // Dynamic shared memory: [WARPS][STAGES][SLOTS] staged pieces, then the split's PPS
    // page ids (read once per block, so no page-table load sits in front of a K/V load).
    // After the loop the same bytes hold the warps' partials for the final merge.
    extern __shared__ uint4 smem[];
    uint4* staged = smem + warp * (STAGES * SLOTS);
    int* pages = reinterpret_cast<int*>(smem + WARPS * STAGES * SLOTS);
    const int first_page = s * PPS;
    for (int i = threadIdx.x; i < PPS && first_page + i < W; i += WARPS * 32)
        pages[i] = table[(long long)b * W + first_page + i];
    __syncthreads();

    constexpr bool HALF_DOT = same_type<T, __half>::value;   // fp16: q.k as half2 FMAs
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
    const int t0 = max(first_page * PS, start);
    const int t1 = min((first_page + PPS) * PS, length);
    const int wfirst = t0 + warp * TPW;      // this warp's first token group
    const int iters = t1 > wfirst ? (t1 - wfirst + CHUNK - 1) / CHUNK : 0;   // warp-uniform

    // Each lane copies its own pieces and later reads back only those, so the pipeline
    // needs no barrier: iteration it + STAGES - 1 is in flight while iteration it computes.
    auto stage_copies = [&](int it) {
        if (it < iters) {
            uint4* dst = staged + (it % STAGES) * SLOTS;
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const int t = wfirst + it * CHUNK + u * STEP + sub;
                long long off = 0;
                if (t < t1) {
                    const int page = pages[t / PS - first_page];
                    off = (((long long)h * P + page) * PS + (t % PS)) * D + col;
                }
                copy16_async(dst + (2 * u) * 32 + lane, kpool + off, t < t1 ? 16 : 0);
                copy16_async(dst + (2 * u + 1) * 32 + lane, vpool + off, t < t1 ? 16 : 0);
            }
        }
        copies_commit();                     // an empty group keeps the count uniform
    };
    #pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) stage_copies(i);
    for (int it = 0; it < iters; ++it) {
        stage_copies(it + STAGES - 1);
        copies_wait<STAGES - 1>();
        const uint4* cur = staged + (it % STAGES) * SLOTS;
        const int tfirst = wfirst + it * CHUNK + sub;
        float sc[U][REP];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint4 kraw = cur[(2 * u) * 32 + lane];
            const T* kh = reinterpret_cast<const T*>(&kraw);
            const __half2* k2 = reinterpret_cast<const __half2*>(&kraw);
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
                sc[u][r] = tfirst + u * STEP < t1 ? dot : -INFINITY;
            }
        }
        #pragma unroll
        for (int r = 0; r < REP; ++r) {      // one rescale per iteration, not per token
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
            const uint4 vraw = cur[(2 * u + 1) * 32 + lane];
            const T* vh = reinterpret_cast<const T*>(&vraw);
            float vf[8];
            #pragma unroll
            for (int i = 0; i < 8; ++i) vf[i] = static_cast<float>(vh[i]);
            #pragma unroll
            for (int r = 0; r < REP; ++r) {
                const float p = sc[u][r] == -INFINITY ? 0.f : exp2f(sc[u][r] - m[r]);
                l[r] += p;
                #pragma unroll
                for (int i = 0; i < 8; ++i) acc[r][i] = fmaf(p, vf[i], acc[r][i]);
            }
        }
    }
    copies_wait<0>();
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
    auto store_ml = [&](float* sh) {        // every lane holds the warp's m, l per head
        if (lane == 0) {
            #pragma unroll
            for (int r = 0; r < REP; ++r) {
                float* row = sh + (warp * REP + r) * (D + 2);
                row[D] = m[r]; row[D + 1] = l[r];
            }
        }
    };

// @section pass1_mma
    // Each warp takes 8 tokens per iteration. Their K rows go global -> shared by
    // cp.async (STAGES - 1 iterations ahead), then the scores of all REP query heads
    // come from tensor cores: S[16 x 8] = Q[16 heads (REP used) x D] . K[8 tokens x D]^T,
    // D/16 m16n8k16 steps. In that fragment layout lane (g = lane / 4, tig = lane % 4)
    // holds the scores of heads g and g + 8 for tokens 2 tig and 2 tig + 1; it runs the
    // online softmax there (quad shuffles), and hands p and the rescale factors to the
    // V accumulation through a small per-warp buffer. V accumulates on the CUDA cores:
    // LPT = D / 8 lanes hold one token's V (8 elements each), TPW = 32 / LPT tokens at
    // once, U = 8 / TPW groups per iteration, each lane owning acc[REP][8].
    constexpr int LPT = D / 8;
    constexpr int TPW = 32 / LPT;
    constexpr int U = 8 / TPW;
    constexpr int STEP = WARPS * TPW;        // tokens one group of the whole block covers
    constexpr int CHUNK = U * STEP;          // tokens per iteration of the block
    constexpr int SLOTS = 16 * LPT;          // 16-byte pieces per warp per stage: 8 tokens' K and V
    constexpr int ROWS = REP > 8 ? 2 : 1;    // score rows g (and g + 8) this lane keeps
    const int sub = lane / LPT;              // V side: which token of the warp's group
    const int c = lane % LPT;                // V side: which 16-byte piece of the row
    const int g = lane >> 2, tig = lane & 3; // score side: fragment coordinates

    // Dynamic shared memory: [WARPS][STAGES][SLOTS] staged pieces (per stage: K rows
    // [8][LPT] with piece c of token j at j * LPT + (c ^ j), so ldmatrix's 8 rows hit
    // distinct banks; then V rows [8][LPT]), [WARPS][2][REP][9] floats handing p (8
    // tokens) and the rescale factor per head to the V side (two buffers: one warp
    // barrier per iteration), then the split's PPS page ids. After the loop the first
    // bytes hold the warps' partials for the final merge.
    extern __shared__ uint4 smem[];
    uint4* staged = smem + warp * (STAGES * SLOTS);
    float* hand = reinterpret_cast<float*>(smem + WARPS * STAGES * SLOTS) + warp * (2 * REP * 9);
    int* pages = reinterpret_cast<int*>(smem + WARPS * STAGES * SLOTS) + WARPS * 2 * REP * 9;
    const int first_page = s * PPS;
    for (int i = threadIdx.x; i < PPS && first_page + i < W; i += WARPS * 32)
        pages[i] = table[(long long)b * W + first_page + i];
    __syncthreads();

    // Q as m16n8k16 A fragments (rows = query heads, zero past REP), unscaled: the
    // tensor cores see the query exactly as given, the f32 scores are scaled after.
    unsigned int qa[D / 16][2 * ROWS];       // a0, a2 (rows g); a1, a3 (rows g + 8) if REP > 8
    {
        const unsigned int* qrow = reinterpret_cast<const unsigned int*>(queries);
        const long long base = ((long long)b * HKV * REP + h * REP) * (D / 2);
        #pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            const int k2 = ks * 8 + tig;     // column pair 2 * tig of this k-step, in pairs
            #pragma unroll
            for (int hf = 0; hf < ROWS; ++hf) {
                const int r = g + 8 * hf;
                qa[ks][2 * hf] = r < REP ? qrow[base + r * (D / 2) + k2] : 0u;
                qa[ks][2 * hf + 1] = r < REP ? qrow[base + r * (D / 2) + k2 + 4] : 0u;
            }
        }
    }
    float m[ROWS], lp[ROWS];                 // score side: running max, this lane's part of the sum
    #pragma unroll
    for (int hf = 0; hf < ROWS; ++hf) { m[hf] = -INFINITY; lp[hf] = 0.f; }
    float acc[REP][8];                       // V side
    #pragma unroll
    for (int r = 0; r < REP; ++r) {
        #pragma unroll
        for (int i = 0; i < 8; ++i) acc[r][i] = 0.f;
    }
    const int t0 = max(first_page * PS, start);
    const int t1 = min((first_page + PPS) * PS, length);
    const int wfirst = t0 + warp * TPW;      // this warp's first token group
    const int iters = t1 > wfirst ? (t1 - wfirst + CHUNK - 1) / CHUNK : 0;   // warp-uniform

    // Token j (0..7) of iteration it is t = wfirst + it * CHUNK + (j / TPW) * STEP + j % TPW.
    auto stage_copies = [&](int it) {
        if (it < iters) {
            uint4* dst = staged + (it % STAGES) * SLOTS;
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const int j = u * TPW + sub;
                const int t = wfirst + it * CHUNK + u * STEP + sub;
                long long off = 0;
                if (t < t1) {
                    const int page = pages[t / PS - first_page];
                    off = (((long long)h * P + page) * PS + (t % PS)) * D + c * 8;
                }
                copy16_async(dst + j * LPT + (c ^ j), kpool + off, t < t1 ? 16 : 0);
                copy16_async(dst + 8 * LPT + j * LPT + c, vpool + off, t < t1 ? 16 : 0);
            }
        }
        copies_commit();                     // an empty group keeps the count uniform
    };
    #pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) stage_copies(i);
    for (int it = 0; it < iters; ++it) {
        stage_copies(it + STAGES - 1);
        copies_wait<STAGES - 1>();
        __syncwarp();                        // every lane's pieces of this stage are in
        const uint4* cur = staged + (it % STAGES) * SLOTS;
        const int tbase = wfirst + it * CHUNK;

        // scores: ldmatrix.x4 gives 4 consecutive 8-column pieces of the 8 K rows
        // (lanes 8i..8i+7 address piece 4q + i of rows 0..7), i.e. two k-steps' B.
        float sc[4] = {0.f, 0.f, 0.f, 0.f};
        #pragma unroll
        for (int qd = 0; qd < D / 32; ++qd) {
            unsigned int kb[4];
            const int row = lane & 7, piece = 4 * qd + (lane >> 3);
            load_matrices_x4(cur + row * LPT + (piece ^ row), kb);
            mma_16x8x16<T, ROWS>(sc, qa[2 * qd], kb[0], kb[1]);
            mma_16x8x16<T, ROWS>(sc, qa[2 * qd + 1], kb[2], kb[3]);
        }
        float* hb = hand + (it & 1) * (REP * 9);
        #pragma unroll
        for (int hf = 0; hf < ROWS; ++hf) {
            const int r = g + 8 * hf;
            float p[2];
            float mc = -INFINITY;
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int j = 2 * tig + e;
                const bool ok = tbase + (j / TPW) * STEP + j % TPW < t1;
                p[e] = ok ? sc[2 * hf + e] * qscale : -INFINITY;
                mc = fmaxf(mc, p[e]);
            }
            mc = fmaxf(mc, __shfl_xor_sync(0xffffffffu, mc, 1));
            mc = fmaxf(mc, __shfl_xor_sync(0xffffffffu, mc, 2));
            const float mn = fmaxf(m[hf], mc);
            const float corr = mn == -INFINITY ? 1.f : exp2f(m[hf] - mn);
            #pragma unroll
            for (int e = 0; e < 2; ++e) p[e] = p[e] == -INFINITY ? 0.f : exp2f(p[e] - mn);
            lp[hf] = lp[hf] * corr + p[0] + p[1];
            m[hf] = mn;
            if (r < REP) {
                // token j = u * TPW + sub goes to hb[r * 9 + sub * U + u]: the V side
                // reads its U tokens as one run
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int j = 2 * tig + e;
                    hb[r * 9 + (j % TPW) * U + j / TPW] = p[e];
                }
                if (tig == 0) hb[r * 9 + 8] = corr;
            }
        }
        __syncwarp();                        // p and the factors are in hb

        #pragma unroll
        for (int r = 0; r < REP; ++r) {
            const float corr = hb[r * 9 + 8];
            #pragma unroll
            for (int i = 0; i < 8; ++i) acc[r][i] *= corr;
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint4 vraw = cur[8 * LPT + (u * TPW + sub) * LPT + c];
            const T* vh = reinterpret_cast<const T*>(&vraw);
            float vf[8];
            #pragma unroll
            for (int i = 0; i < 8; ++i) vf[i] = static_cast<float>(vh[i]);
            #pragma unroll
            for (int r = 0; r < REP; ++r) {
                const float p = hb[r * 9 + sub * U + u];
                #pragma unroll
                for (int i = 0; i < 8; ++i) acc[r][i] = fmaf(p, vf[i], acc[r][i]);
            }
        }
    }
    copies_wait<0>();
    // One max per head for the whole warp, so the token groups' accumulators just add.
    #pragma unroll
    for (int o = LPT; o < 32; o <<= 1) {
        #pragma unroll
        for (int r = 0; r < REP; ++r) {
            #pragma unroll
            for (int i = 0; i < 8; ++i) acc[r][i] += __shfl_xor_sync(0xffffffffu, acc[r][i], o);
        }
    }
    #pragma unroll
    for (int hf = 0; hf < ROWS; ++hf) {
        lp[hf] += __shfl_xor_sync(0xffffffffu, lp[hf], 1);
        lp[hf] += __shfl_xor_sync(0xffffffffu, lp[hf], 2);
    }
    auto store_ml = [&](float* sh) {        // lanes (g, tig = 0) hold heads g and g + 8
        #pragma unroll
        for (int hf = 0; hf < ROWS; ++hf) {
            const int r = g + 8 * hf;
            if (tig == 0 && r < REP) {
                float* row = sh + (warp * REP + r) * (D + 2);
                row[D] = m[hf]; row[D + 1] = lp[hf];
            }
        }
    };

// @section write_partials
    // Merge the warps through shared [WARPS][REP][D + 2] (reusing the staging bytes):
    // lanes 0..LPT-1 hold the warp's acc (8 columns each), store_ml writes its m and l.
    __syncthreads();
    float* sh = reinterpret_cast<float*>(smem);
    if (lane < LPT) {
        #pragma unroll
        for (int r = 0; r < REP; ++r) {
            float* row = sh + (warp * REP + r) * (D + 2);
            #pragma unroll
            for (int i = 0; i < 8; ++i) row[(lane % LPT) * 8 + i] = acc[r][i];
        }
    }
    store_ml(sh);
    __syncthreads();
    // the block's partials: per query head, acc[D] and (m, l) of its split
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

// @section pass2
    const int bq = blockIdx.x;               // row * HQ + query head
    const int S = dims[0];                   // splits per row and head (runtime)
    const long long base = (long long)bq * S;
    float mm = -INFINITY;
    for (int s = 0; s < S; ++s) mm = fmaxf(mm, part_ml[(base + s) * 2]);
    // attention sinks (SINKS = 1, gpt_oss): one more logit per query head that no value
    // goes with; it joins the max and the sum, so every weight shrinks by the sink's share
    const float sink = SINKS ? sinks[(bq / LQ) % HQ] * 1.4426950408889634f : -INFINITY;
    mm = fmaxf(mm, sink);
    float ll = SINKS ? exp2f(sink - mm) : 0.f;
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
