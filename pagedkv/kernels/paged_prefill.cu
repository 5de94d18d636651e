// Paged prefill attention: the CUDA source of pagedkv/kernels/paged_prefill.py.
// It uses the helpers of paged_decode.cu's header section (cp.async, ldmatrix) and
// paged_decode.cu's pass2 to merge the splits; this file adds the rest.

// @section header
// Four 8x8 b16 matrices from shared memory, transposed (V as the B operand of P . V).
__device__ __forceinline__ void load_matrices_x4_trans(const void* row, unsigned int* r) {
    const unsigned int a = static_cast<unsigned int>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
// c += A . B for one m16n8k16 tile; a in PTX order (a0..a3), f32 accumulators.
template <typename T> __device__ __forceinline__ void mma_m16n8k16(
        float* c, const unsigned int* a, unsigned int b0, unsigned int b1) {
    if constexpr (same_type<T, __half>::value) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}
// Two floats as one register of two T (the A operand of P . V).
template <typename T> __device__ __forceinline__ unsigned int pack2(float x, float y) {
    if constexpr (same_type<T, __half>::value) {
        const __half2 h = __floats2half2_rn(x, y);
        return *reinterpret_cast<const unsigned int*>(&h);
    } else {
        const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
        return *reinterpret_cast<const unsigned int*>(&h);
    }
}

// @section prefill
    // One block per (row b, KV head h, query tile qt, split s); see paged_prefill.py.
    // Runtime sizes: splits, queries per row, table width, pool rows per head, window (0: none).
    const int S = dims[0], L = dims[1], W = dims[2], P = dims[3], WIN = dims[4];
    constexpr int ROWS = 16 * MT;            // query rows per warp (MT m16 tiles)
    constexpr int BM = WARPS * ROWS;         // query rows per block
    const int QT = (L * REP + BM - 1) / BM;
    constexpr int LPT = D / 8;               // 16-byte pieces per token row
    constexpr int TILE = BN * LPT;           // pieces of one K (or V) tile
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3; // m16n8k16 fragment coordinates
    int blk = blockIdx.x;
    const int s = blk % S; blk /= S;
    const int qt = blk % QT; blk /= QT;
    const int h = blk % HKV;
    const int b = blk / HKV;
    const int length = lengths[b], start = starts[b];
    const float qscale = scale[0] * 1.4426950408889634f;   // log2(e): exp2 below

    // Rows m of the block are (query i, head r) = divmod(qt * BM + m, REP): a warp's
    // rows are consecutive queries' whole GQA groups, so K/V bytes serve every head.
    // Query i of row b sits at key position length - L + i.
    const int row0 = qt * BM;
    const int i_lo = row0 / REP;
    const int i_hi = min(L - 1, (row0 + BM - 1) / REP);
    const int k1 = length - L + i_hi + 1;    // the block's keys: [k0, k1)
    const int k0 = WIN > 0 ? max(start, length - L + i_lo - WIN + 1) : start;
    const int per = k1 > k0 ? (k1 - k0 + S - 1) / S : 0;
    const int t0 = k0 + s * per;
    const int t1 = min(k1, t0 + per);
    // This warp's queries: a key tile all of whose keys every one of its rows sees
    // skips the per-element mask.
    const int wrow0 = row0 + warp * ROWS;
    const bool wfull = (wrow0 + ROWS - 1) / REP < L;
    const int wpos_lo = length - L + wrow0 / REP;
    const int wpos_hi = length - L + min(L - 1, (wrow0 + ROWS - 1) / REP);

    // This lane's rows (g and g + 8 of each of the warp's m16 tiles): query position,
    // or -1 past L, and the row's offset in queries / partials.
    int qpos[MT][2];
    long long qoff[MT][2];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int m = wrow0 + mt * 16 + g + 8 * hf;
            const int i = m / REP, r = m % REP;
            const bool ok = i < L;
            qpos[mt][hf] = ok ? length - L + i : -1;
            qoff[mt][hf] = ok ? (((long long)b * HKV * REP + h * REP + r) * L + i) : -1;
        }
    }
    // Q as A fragments, unscaled (a0: row g cols 2tig.., a1: row g+8, a2/a3: cols +8).
    unsigned int qa[MT][D / 16][4];
    {
        const unsigned int* q32 = reinterpret_cast<const unsigned int*>(queries);
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            #pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) {
                #pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const long long base = qoff[mt][hf] * (D / 2) + ks * 8 + tig;
                    qa[mt][ks][hf] = qoff[mt][hf] >= 0 ? q32[base] : 0u;
                    qa[mt][ks][2 + hf] = qoff[mt][hf] >= 0 ? q32[base + 4] : 0u;
                }
            }
        }
    }
    float m_run[MT][2], l_run[MT][2];
    float o[MT][D / 8][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        m_run[mt][0] = m_run[mt][1] = -INFINITY;
        l_run[mt][0] = l_run[mt][1] = 0.f;
        #pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.f;
        }
    }

    // Shared memory: 2 stages of [K tile | V tile], each [BN tokens][LPT pieces], piece c
    // of token j at j * LPT + (c ^ (j & 7)) so ldmatrix's 8 rows hit distinct banks.
    extern __shared__ uint4 smem[];
    const int tiles = t1 > t0 ? (t1 - t0 + BN - 1) / BN : 0;
    auto stage = [&](int it) {
        if (it < tiles) {
            uint4* dst = smem + (it & 1) * 2 * TILE;
            #pragma unroll
            for (int idx = threadIdx.x; idx < TILE; idx += WARPS * 32) {
                const int j = idx / LPT, c = idx % LPT;
                const int t = t0 + it * BN + j;
                long long off = 0;
                if (t < t1) {
                    const int page = table[(long long)b * W + t / PS];
                    off = (((long long)h * P + page) * PS + (t % PS)) * D + c * 8;
                }
                const int at = j * LPT + (c ^ (j & 7));
                copy16_async(dst + at, kpool + off, t < t1 ? 16 : 0);
                copy16_async(dst + TILE + at, vpool + off, t < t1 ? 16 : 0);
            }
        }
        copies_commit();
    };
    stage(0);
    for (int it = 0; it < tiles; ++it) {
        stage(it + 1);
        copies_wait<1>();
        __syncthreads();
        const uint4* kt = smem + (it & 1) * 2 * TILE;
        const uint4* vt = kt + TILE;
        const int tbase = t0 + it * BN;
        if (tbase <= wpos_hi) {              // else causal: none of this warp's rows sees these keys
            // S[ROWS x BN] = Q . K^T: ldmatrix.x4 gives pieces 4qd..4qd+3 of 8 tokens' K rows,
            // i.e. the B operands of two k-steps, used by every m16 tile of the warp.
            float sc[MT][BN / 8][4];
            #pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) {
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) sc[mt][nt][e] = 0.f;
                }
                #pragma unroll
                for (int qd = 0; qd < D / 32; ++qd) {
                    unsigned int kb[4];
                    const int j = nt * 8 + (lane & 7), piece = 4 * qd + (lane >> 3);
                    load_matrices_x4(kt + j * LPT + (piece ^ (j & 7)), kb);
                    #pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_m16n8k16<T>(sc[mt][nt], qa[mt][2 * qd], kb[0], kb[1]);
                        mma_m16n8k16<T>(sc[mt][nt], qa[mt][2 * qd + 1], kb[2], kb[3]);
                    }
                }
            }
            // Mask (only where some key of the tile is hidden from some row) and online
            // softmax on rows g (e = 0, 1) and g + 8 (e = 2, 3) of each m16 tile.
            const bool full = wfull && tbase + BN <= t1 && tbase + BN - 1 <= wpos_lo
                              && (WIN == 0 || tbase > wpos_hi - WIN);
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                #pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int lo_key = WIN > 0 ? qpos[mt][hf] - WIN + 1 : -1;
                    float mc = -INFINITY;
                    #pragma unroll
                    for (int nt = 0; nt < BN / 8; ++nt) {
                        #pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            float& x = sc[mt][nt][2 * hf + e];
                            if (full) {
                                x *= qscale;
                            } else {
                                const int t = tbase + nt * 8 + 2 * tig + e;
                                x = (t < t1 && t <= qpos[mt][hf] && t >= lo_key) ? x * qscale : -INFINITY;
                            }
                            mc = fmaxf(mc, x);
                        }
                    }
                    mc = fmaxf(mc, __shfl_xor_sync(0xffffffffu, mc, 1));
                    mc = fmaxf(mc, __shfl_xor_sync(0xffffffffu, mc, 2));
                    const float mn = fmaxf(m_run[mt][hf], mc);
                    const float corr = mn == -INFINITY ? 1.f : exp2f(m_run[mt][hf] - mn);
                    const float base = mn == -INFINITY ? 0.f : mn;   // exp2(-inf - base) = 0
                    float sum = 0.f;
                    #pragma unroll
                    for (int nt = 0; nt < BN / 8; ++nt) {
                        #pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            float& x = sc[mt][nt][2 * hf + e];
                            x = exp2f(x - base);
                            sum += x;
                        }
                    }
                    l_run[mt][hf] = l_run[mt][hf] * corr + sum;
                    m_run[mt][hf] = mn;
                    #pragma unroll
                    for (int dt = 0; dt < D / 8; ++dt) {
                        o[mt][dt][2 * hf] *= corr;
                        o[mt][dt][2 * hf + 1] *= corr;
                    }
                }
            }
            // O += P . V: two n-tiles of scores are one A operand (16 tokens); ldmatrix.x4.trans
            // of V gives the B operands of two 8-column output tiles, used by every m16 tile.
            #pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                unsigned int pa[MT][4];
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    pa[mt][0] = pack2<T>(sc[mt][2 * kk][0], sc[mt][2 * kk][1]);
                    pa[mt][1] = pack2<T>(sc[mt][2 * kk][2], sc[mt][2 * kk][3]);
                    pa[mt][2] = pack2<T>(sc[mt][2 * kk + 1][0], sc[mt][2 * kk + 1][1]);
                    pa[mt][3] = pack2<T>(sc[mt][2 * kk + 1][2], sc[mt][2 * kk + 1][3]);
                }
                #pragma unroll
                for (int dp = 0; dp < D / 16; ++dp) {
                    unsigned int vb[4];
                    const int j = kk * 16 + (lane & 15), piece = 2 * dp + (lane >> 4);
                    load_matrices_x4_trans(vt + j * LPT + (piece ^ (j & 7)), vb);
                    #pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_m16n8k16<T>(o[mt][2 * dp], pa[mt], vb[0], vb[1]);
                        mma_m16n8k16<T>(o[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
                    }
                }
            }
        }
        __syncthreads();                     // the next stage() overwrites this buffer
    }
    copies_wait<0>();

    // This split's partials per (row, head, query): acc[D] unnormalised, then (m, l).
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            float l = l_run[mt][hf];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            if (qoff[mt][hf] < 0) continue;
            const long long row = qoff[mt][hf] * S + s;
            #pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) {
                *reinterpret_cast<float2*>(part_acc + row * D + dt * 8 + 2 * tig) =
                    make_float2(o[mt][dt][2 * hf], o[mt][dt][2 * hf + 1]);
            }
            if (tig == 0) { part_ml[row * 2] = m_run[mt][hf]; part_ml[row * 2 + 1] = l; }
        }
    }
