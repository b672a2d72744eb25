// Paged decode attention over an FP8 (e4m3) KV cache, for NVIDIA sm_89+ (compiled at run time by
// NVRTC through `kernels.cuda_decode`, which defines HEAD_DIM, GROUP, PAGE_SIZE, STAGES, WARPS and
// Q_BF16 before this text).
//
// The same contract and split-partial layout as `attention_jit.decode_kernel` with KV_FP8 (its
// merge kernel combines the splits): one program per (grid row, WARPS KV heads, split), one warp
// per KV head; grid row r is token r of a decode batch (or, with by_seq, sequence r of a mixed
// batch, skipped unless it has exactly one new token).
//
// Why CUDA: every Triton loop tried moved FP8 bytes at <= 0.74x of the bf16 kernel's rate
// (README, FP8). Here each warp owns a private cp.async pipeline of STAGES units (16 keys of K and
// V: 4 KB), so loads stay in flight while the warp computes, and no barrier spans warps. A warp
// takes all of its head's keys in the split and writes the result from its registers: on the H200
// that moved 3-8% more bytes per second at the large K1 shapes than 4 warps per head merging
// through shared memory (up to 3% more than 2), whose programs ended sooner, so each paid its
// pipeline's ramp-up and the merge more often.
//
// The products run on mma.sync m16n8k16 transposed (keys and head_dim are the 16-row side, the
// query heads of the group the 8-column side), so the FP8 bytes become operands with one
// cvt.rn.f16x2.e4m3x2 per two values straight from the words each thread reads, with no
// shared-memory round trip: the head_dim order of the first product and the output rows of the
// second are permuted so that each thread's operand bytes are contiguous in the cache.
//
// Operand maps (lane = 4 * g + t; mma fragments as in the PTX ISA):
//   scores^T[key][head] = K[key][d] q^T[d][head]: k-step s, A column 2t + 8h + e is
//     d = 32 t + 4 s + 2 h + e, so A rows g and g + 8 come from word s of bytes 32t .. 32t + 31 of
//     keys g and g + 8; q^T (B) uses the same d order.
//   out^T[d][head] = V^T[d][key] p^T[key][head]: m-tile i, A row g + 8 h is d = 16 g + 2 i + h, so
//     each thread reads bytes 16g .. 16g + 15 of keys 2t, 2t + 1, 2t + 8, 2t + 9 and interleaves
//     key pairs with prmt; p^T (B) is the scores' C fragment transposed by movmatrix.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

#define UNIT 16                      // keys per warp step
#define CHUNKS (HEAD_DIM / 16)       // 16-byte chunks per key row
#define UNIT_BYTES (UNIT * HEAD_DIM) // one unit of K (or V)
#define STAGE_BYTES (2 * UNIT_BYTES)
#define KSTEPS (HEAD_DIM / 16)       // k-steps of the first product
#define MTILES (HEAD_DIM / 16)       // m-tiles of the second
#define NEG_INF (-__int_as_float(0x7f800000))

static_assert(HEAD_DIM == 128, "the operand maps assume head_dim 128");
static_assert(GROUP >= 1 && GROUP <= 8, "query heads per KV head: 1..8 (the 8-column side)");
static_assert(PAGE_SIZE % UNIT == 0, "pages must hold whole units of 16 keys");
static_assert(STAGES >= 2, "a stage in flight while the warp computes on another");

__device__ __forceinline__ u32 shared_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void lds128(u32 addr, u32* w) {
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                 : "r"(addr));
}

// Two e4m3 values (a 16-bit half of w) -> float16x2: low half of w -> lo, high half -> hi.
__device__ __forceinline__ void widen4(u32 w, u32& lo, u32& hi) {
    asm("{ .reg .b16 a, b; mov.b32 {a, b}, %2; cvt.rn.f16x2.e4m3x2 %0, a; cvt.rn.f16x2.e4m3x2 %1, b; }"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
}

// 16 bytes from global memory, not cached in L1 (q is read once).
__device__ __forceinline__ void ldg128(const void* p, u32* w) {
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                 : "l"(p));
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

__device__ __forceinline__ u32 transpose8x8(u32 x) {
    u32 d;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(x));
    return d;
}

__device__ __forceinline__ float exp2f_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ void mma16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float q_to_float(u16 x) {
#if Q_BF16
    return __int_as_float(((u32)x) << 16);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
#endif
}

__device__ __forceinline__ u16 float_to_out(float x) {
    u16 h;
#if Q_BF16
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
#endif
    return h;
}

// Largest s in [0, num_seqs - 1] with cu_seqlens_q[s] <= token.
__device__ int find_seq(const int* cu_seqlens_q, int token, int num_seqs) {
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (cu_seqlens_q[mid] <= token) lo = mid; else hi = mid - 1;
    }
    return lo;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) fp8_paged_decode(
    const u16* __restrict__ q, const u8* __restrict__ k_cache, const u8* __restrict__ v_cache,
    u16* __restrict__ out, float* __restrict__ part, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, const int* __restrict__ cu_seqlens_q, const float* __restrict__ k_scale,
    const float* __restrict__ v_scale, double qk_scale_arg, int num_seqs, int num_splits, int tokens_per_split,
    int part_rows, int stride_qt, int stride_qh, int stride_kb, int stride_kt, int stride_kh, int stride_vb,
    int stride_vt, int stride_vh, int stride_ot, int stride_oh, int stride_bt, int table_width, int by_seq,
    int num_kv_heads) {
    extern __shared__ __align__(128) u8 smem[];
    const int row = blockIdx.x, split = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int kv_head = blockIdx.y * WARPS + warp;
    int kv_start = split * tokens_per_split;  // FIT_SPLITS may move it once the context is known
    if (kv_head >= num_kv_heads) return;  // no barrier follows

    // Loads that do not wait for each other: the row's sequence data and, assuming that the row's
    // token and sequence are the row's own (always in a decode batch; with by_seq the sequence is),
    // the first block ids and q. The assumption is checked below and the loads redone in the rare
    // case it was wrong, so a warp waits one memory round trip, not three, before its first K/V
    // copies. Block ids: 32 units at a time (lane l holds unit 32 J + l), the next batch in flight;
    // units past the table are never copied.
    int q_start = cu_seqlens_q[row], q_end = cu_seqlens_q[row + 1], seq_len = seq_lens[row];
    const int* table = block_tables + (i64)row * stride_bt;
    auto load_ids = [&](int batch) -> int {
        const int page = (kv_start + (32 * batch + lane) * UNIT) / PAGE_SIZE;
        return page < table_width ? table[page] : 0;
    };
    int ids_now = load_ids(0), ids_next = load_ids(1);
    // q: head g of the group, elements 32 t .. 32 t + 31 (zeros for padding heads).
    u32 qw[16];
    auto load_q = [&](int tok) {
        const u16* src = q + (i64)tok * stride_qt + (i64)(kv_head * GROUP + g) * stride_qh + 32 * t;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (g < GROUP) ldg128(src + 8 * i, qw + 4 * i);
            else qw[4 * i] = qw[4 * i + 1] = qw[4 * i + 2] = qw[4 * i + 3] = 0u;
        }
    };
    int token = row;
    if (by_seq) {
        if (q_end - q_start != 1) return;
        token = q_start;
    } else {
        load_q(token);
        if (q_start != token || q_end != token + 1) {
            const int seq = find_seq(cu_seqlens_q, token, num_seqs);
            q_start = cu_seqlens_q[seq];
            q_end = cu_seqlens_q[seq + 1];
            seq_len = seq_lens[seq];
            table = block_tables + (i64)seq * stride_bt;
            ids_now = load_ids(0);
            ids_next = load_ids(1);
        }
    }
    if (by_seq) load_q(token);
    const int context_end = seq_len - (q_end - token) + 1;
#if FIT_SPLITS
    // The splits partition this token's context, not the table's (tokens_per_split is the most a
    // split takes: `attention_jit.decode_kernel`'s FIT_SPLITS): whole 64-key tiles, as few per
    // split as fill num_splits. Where that moves the split, its first block ids are loaded again.
    if (num_splits > 1) {
        tokens_per_split = ((context_end + num_splits - 1) / num_splits + 63) / 64 * 64;
        if (split * tokens_per_split != kv_start) {
            kv_start = split * tokens_per_split;
            ids_now = load_ids(0);
            ids_next = load_ids(1);
        }
    }
#endif
    const int kv_end = min(kv_start + tokens_per_split, context_end);
    const int num_units = kv_end > kv_start ? (kv_end - kv_start + UNIT - 1) / UNIT : 0;

    // The warp's pipeline: unit j in stage j % STAGES.
    const u32 stage_base = shared_addr(smem + warp * STAGES * STAGE_BYTES);
    const i64 k_head_off = (i64)kv_head * stride_kh, v_head_off = (i64)kv_head * stride_vh;
    auto issue = [&](int j) {
        if (j < num_units) {
            if ((j & 31) == 0 && j > 0) {
                ids_now = ids_next;
                ids_next = load_ids(j / 32 + 1);
            }
            const i64 block = __shfl_sync(0xffffffffu, ids_now, j & 31);
            const int key0 = kv_start + j * UNIT;
            const int in_page = key0 % PAGE_SIZE;
            const u32 dst = stage_base + (j % STAGES) * STAGE_BYTES;
#pragma unroll
            for (int p = 0; p < UNIT * CHUNKS / 32; ++p) {
                const int idx = lane + 32 * p, r = idx / CHUNKS, ch = idx % CHUNKS;
                const int bytes = key0 + r < kv_end ? 16 : 0;  // zero-fill keys past the end
                const u32 off = r * HEAD_DIM + ((ch ^ (r & 7)) * 16);
                const i64 row_k = block * stride_kb + (i64)(in_page + r) * stride_kt + k_head_off + ch * 16;
                const i64 row_v = block * stride_vb + (i64)(in_page + r) * stride_vt + v_head_off + ch * 16;
                cp_async16(dst + off, k_cache + row_k, bytes);
                cp_async16(dst + UNIT_BYTES + off, v_cache + row_v, bytes);
            }
        }
        asm volatile("cp.async.commit_group;");
    };
#pragma unroll
    for (int j = 0; j < STAGES - 1; ++j) issue(j);

    // q^T fragments (while the first copies fly): d = 32 t + 4 s + {0, 1} (b0) and {2, 3} (b1), as
    // float16 (exact for bf16 in float16's normal range; clamped to +-65504).
    const float qk_scale = (float)qk_scale_arg * k_scale[0];
    u32 qf[KSTEPS][2];
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
        float x[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const u16 bits = (u16)(qw[2 * s + (e >> 1)] >> (16 * (e & 1)));
            x[e] = fminf(fmaxf(q_to_float(bits), -65504.0f), 65504.0f);
        }
        qf[s][0] = pack_f16x2(x[0], x[1]);
        qf[s][1] = pack_f16x2(x[2], x[3]);
    }

    float acc[MTILES][4];
#pragma unroll
    for (int i = 0; i < MTILES; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;  // heads 2t, 2t + 1

    for (int j = 0; j < num_units; ++j) {
        __syncwarp();  // every lane is done with the stage the next issue overwrites
        issue(j + STAGES - 1);
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1));
        __syncwarp();  // ... and every lane's copies into stage j have landed
        const u32 k_base = stage_base + (j % STAGES) * STAGE_BYTES, v_base = k_base + UNIT_BYTES;

        // scores^T: keys g, g + 8 x heads 2t, 2t + 1.
        u32 kw[2][8];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = g + 8 * h;
            lds128(k_base + r * HEAD_DIM + (((2 * t) ^ (r & 7)) * 16), kw[h]);
            lds128(k_base + r * HEAD_DIM + (((2 * t + 1) ^ (r & 7)) * 16), kw[h] + 4);
        }
        float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int s = 0; s < KSTEPS; ++s) {
            u32 a0, a1, a2, a3;
            widen4(kw[0][s], a0, a2);
            widen4(kw[1][s], a1, a3);
            mma16816(sc, a0, a1, a2, a3, qf[s][0], qf[s][1]);
        }
        const int key0 = kv_start + j * UNIT;
        float x0 = sc[0] * qk_scale, x1 = sc[1] * qk_scale, x2 = sc[2] * qk_scale, x3 = sc[3] * qk_scale;
        if (key0 + UNIT > kv_end) {
            if (key0 + g >= kv_end) x0 = x1 = NEG_INF;
            if (key0 + g + 8 >= kv_end) x2 = x3 = NEG_INF;
        }
        float mx0 = fmaxf(x0, x2), mx1 = fmaxf(x1, x3);
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
        }
        const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
        const float alpha0 = exp2f_approx(m0 - n0), alpha1 = exp2f_approx(m1 - n1);
        const float p0 = exp2f_approx(x0 - n0), p1 = exp2f_approx(x1 - n1);
        const float p2 = exp2f_approx(x2 - n0), p3 = exp2f_approx(x3 - n1);
        l0 = l0 * alpha0 + p0 + p2;
        l1 = l1 * alpha1 + p1 + p3;
        m0 = n0;
        m1 = n1;
        const u32 b0 = transpose8x8(pack_f16x2(p0, p1)), b1 = transpose8x8(pack_f16x2(p2, p3));

        // out^T += V^T p^T: rows d = 16 g + 2 i + h of keys 2t, 2t + 1 (a0, a1) and 2t + 8, 2t + 9 (a2, a3).
        u32 vw[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const int r = 2 * t + (kk & 1) + 8 * (kk >> 1);
            lds128(v_base + r * HEAD_DIM + ((g ^ (r & 7)) * 16), vw[kk]);
        }
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            u32 lo01, hi01, lo23, hi23, lo01b, hi01b, lo23b, hi23b;
            widen4(prmt(vw[0][w], vw[1][w], 0x5140), lo01, hi01);   // d = 16g + 4w + {0, 1}
            widen4(prmt(vw[0][w], vw[1][w], 0x7362), lo01b, hi01b); // d = 16g + 4w + {2, 3}
            widen4(prmt(vw[2][w], vw[3][w], 0x5140), lo23, hi23);
            widen4(prmt(vw[2][w], vw[3][w], 0x7362), lo23b, hi23b);
            float* c0 = acc[2 * w];
            float* c1 = acc[2 * w + 1];
            c0[0] *= alpha0; c0[1] *= alpha1; c0[2] *= alpha0; c0[3] *= alpha1;
            c1[0] *= alpha0; c1[1] *= alpha1; c1[2] *= alpha0; c1[3] *= alpha1;
            mma16816(c0, lo01, hi01, lo23, hi23, b0, b1);
            mma16816(c1, lo01b, hi01b, lo23b, hi23b, b0, b1);
        }
    }
    asm volatile("cp.async.wait_group 0;");

    // Denominators over the warp's keys (lanes of one t share heads).
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, o);
        l1 += __shfl_xor_sync(0xffffffffu, l1, o);
    }
    // The warp holds its query heads' whole result: head 2t + h has rows d = 16 g + 2 i and d + 1
    // in acc[i][h] and acc[i][2 + h]. Split: the partial, its max and denominator (the merge kernel
    // divides); unsplit: the output.
    const float vs = v_scale[0];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (2 * t + h >= GROUP) continue;
        const int q_head = kv_head * GROUP + 2 * t + h;
        const float m = h ? m1 : m0, l = h ? l1 : l0;
        if (num_splits > 1) {
            const i64 prow = ((i64)row * num_kv_heads * GROUP + q_head) * num_splits + split;
            float* dst = part + prow * HEAD_DIM;
#pragma unroll
            for (int i = 0; i < MTILES; ++i) {
                const int d = 16 * g + 2 * i;
                dst[d] = acc[i][h] * vs;
                dst[d + 1] = acc[i][2 + h] * vs;
            }
            if (g == 0) {
                part[(i64)part_rows * HEAD_DIM + prow] = m;
                part[(i64)part_rows * (HEAD_DIM + 1) + prow] = l;
            }
        } else {
            u16* dst = out + (i64)token * stride_ot + (i64)q_head * stride_oh;
            const float s = vs / l;
#pragma unroll
            for (int i = 0; i < MTILES; ++i) {
                const int d = 16 * g + 2 * i;
                dst[d] = float_to_out(acc[i][h] * s);
                dst[d + 1] = float_to_out(acc[i][2 + h] * s);
            }
        }
    }
}
