/* Sparse MLA decode on sm_90: q_mqa [T,H,576] against the top-k rows of the
 * paged latent cache, bf16 or fp8_ds_mla.  docs/attention.md gives the byte
 * and FLOP counts this design is built around.
 *
 * One thread block = one token x one tile of up to 64 heads x one chunk of
 * the token's top-k list (split-k when T is small, so that the grid fills
 * the multiprocessors).  The block gathers each selected cache row ONCE into
 * shared memory (cp.async, 16-byte pieces, three stages), converts fp8 rows
 * to bf16 there, and all its heads read it from shared memory: unique bytes
 * move through HBM once per head tile.  Heads map to the M dimension of
 * mma.sync m16n8k16 (bf16 in, fp32 accumulate); a tile of h heads is padded
 * to a multiple of 16 in shared memory only, never in a global read.
 *
 * Warps: pair p (warps 2p, 2p+1) owns 16 head rows and one sub-block of the
 * 32 slots of a block; within the pair each warp scores half the
 * sub-block's slots over all 576 dims and accumulates half of the 512
 * output columns (an fp32 16x256 accumulator, 128 registers).  The pair
 * exchanges row maxima and the bf16 probabilities through shared memory.
 * With <= 32 heads two pairs share the rows and split the slots, and are
 * merged at the end.
 *
 * Splits write fp32 partial outputs and natural-log LSEs to the workspace;
 * a small kernel combines them (LSE-weighted), one block per (token, head),
 * so the combine's reads spread over the whole GPU.  (Combining in the
 * last-finishing chunk instead was measured 2-7x slower at T <= 4: one
 * block then reads every partial of 64 heads; docs/attention.md.)  No
 * allocation, no host read, no synchronisation: the launches can be
 * captured in a graph. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "backends/b12x_mla_sparse/b12x_attend.h"

namespace {

constexpr int KV_L = B12X_KV_LORA;
constexpr int KV_D = B12X_KV_LORA + B12X_ROPE;  /* 576 */
constexpr int ROW_BYTES = KV_D * 2;              /* one bf16 row in shared memory */
constexpr int ROW_CHUNKS = ROW_BYTES / 16;       /* 72 pieces of 16 bytes */
constexpr int FP8_BYTES = KV_L + 4 * (KV_L / 128) + 2 * B12X_ROPE; /* 656 */
constexpr int FP8_CHUNKS = FP8_BYTES / 16;       /* 41 */
constexpr int BN = 32;                           /* slots per pipeline block */
constexpr int NTHREADS = 256;
constexpr int HEAD_TILE = 64;
constexpr int MAX_SPLITS = 64;
constexpr float LN2 = 0.69314718055994530942f;
constexpr float LOG2E = 1.44269504088896340736f;

static_assert(FP8_BYTES % 16 == 0, "fp8 records must be whole 16-byte pieces");
static_assert(BN * ROW_CHUNKS % NTHREADS == 0, "bf16 gather assumes whole rounds");

struct AttendArgs {
    const __nv_bfloat16 *q;
    int64_t q_st, q_sh;
    const uint8_t *kv;
    int64_t kv_row, num_slots;
    const int32_t *idx;
    int64_t idx_st, idx_sk;
    const int32_t *req;
    int64_t req_s;
    const int32_t *seq;
    int64_t seq_s;
    const int32_t *bt;
    int64_t bt_sb, bt_sk, max_blocks;
    __nv_bfloat16 *out;
    int64_t o_sh, o_st;
    float *lse;
    int64_t l_sh, l_st;
    float *ws_o;   /* [splits][T][H][512] when splits > 1 */
    float *ws_lse; /* [splits][T][H] */
    int T, H, B, topk, page;
    int tile_base;        /* first head tile of this launch */
    int blocks_per_split; /* pipeline blocks per chunk */
    int splits;
    float scale_log2;     /* softmax scale * log2(e) */
};

/* Shared-memory map of one thread block (byte offsets, all 16-aligned). */
template <bool FP8, int RT> struct Smem {
    static constexpr int KS = RT <= 2 ? 2 : 1; /* pairs that share a row tile */
    /* Stages: bf16 3 gathered; fp8 3 raw + 2 converted.  (Smaller head
     * tiles leave room for more; see docs/attention.md, next steps.) */
    static constexpr int KV_STAGES = FP8 ? 2 : 3;
    static constexpr int RAW_STAGES = FP8 ? 3 : 1; /* unused (1) for bf16 */
    static constexpr int Q_BYTES = RT * 16 * ROW_BYTES;
    static constexpr int KV_STAGE = BN * ROW_BYTES;
    static constexpr int RAW_STAGE = BN * FP8_BYTES;
    static constexpr int OFF_KV = Q_BYTES;
    static constexpr int OFF_RAW = OFF_KV + KV_STAGES * KV_STAGE;
    static constexpr int OFF_P = OFF_RAW + (FP8 ? RAW_STAGES * RAW_STAGE : 0);
    static constexpr int P_PAIR = 16 * BN * 2;
    static constexpr int OFF_MAX = OFF_P + 4 * P_PAIR;
    static constexpr int OFF_SLOT = OFF_MAX + 4 * 2 * 16 * 4;
    /* End-of-loop merge of the two slot halves (KS == 2): per (row tile,
     * column half) one warp's 128 accumulators + 2 maxima + 2 sums per lane. */
    static constexpr int MERGE_FLOATS = 132 * 32;
    static_assert(KS == 1 || 2 * 2 * MERGE_FLOATS * 4 <= KV_STAGES * KV_STAGE,
                  "merge buffer must fit in the KV stages");
    static constexpr size_t bytes(int chunk_slots) { return (size_t)OFF_SLOT + 4u * chunk_slots; }
    static_assert(bytes(B12X_MAX_TOPK) <= 232448, "over the sm_90 shared memory per block");
};

__device__ __forceinline__ uint32_t smem_u32(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit()
{
    asm volatile("cp.async.commit_group;\n" ::);
}

template <int N> __device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void st_shared16(uint32_t addr, uint4 v)
{
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w));
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Barrier of the two warps of pair p (ids 1..4; 0 is __syncthreads). */
__device__ __forceinline__ void pair_sync(int p)
{
    asm volatile("bar.sync %0, 64;\n" ::"r"(p + 1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

__device__ __forceinline__ float bf16_lo(uint32_t v)
{
    return __uint_as_float(v << 16);
}

__device__ __forceinline__ float bf16_hi(uint32_t v)
{
    return __uint_as_float(v & 0xffff0000u);
}

/* Two e4m3 values (low byte first) times a power-of-two scale, as bf16x2.
 * Exact: e4m3 has 3 mantissa bits, bf16 has 7. */
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t two, float scale)
{
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)two, __NV_E4M3);
    float2 f = __half22float2(*reinterpret_cast<__half2 *>(&h));
    return pack_bf16(f.x * scale, f.y * scale);
}

/* Byte offset of 16-byte piece c of row r in a swizzled 1152-byte-row
 * matrix: the XOR spreads the 8 rows an ldmatrix phase reads over all 32
 * banks (rows are a multiple of 128 bytes apart, and 72 = 9 * 8 keeps the
 * piece inside its row). */
__device__ __forceinline__ uint32_t sw_off(int r, int c)
{
    return (uint32_t)(r * ROW_BYTES + ((c ^ (r & 7)) << 4));
}

template <bool FP8, int RT>
__global__ void __launch_bounds__(NTHREADS, 1) b12x_attend_kernel(const AttendArgs a)
{
    using S = Smem<FP8, RT>;
    constexpr int KS = S::KS;
    constexpr int SUB = BN / KS;   /* slots of a block per pair */
    constexpr int SN = SUB / 2;    /* score columns per warp */
    constexpr int NTS = SN / 8;    /* n-tiles of scores per warp */
    constexpr int PV_K = SUB / 16; /* k-steps of P.V per block */
    constexpr int QCH = NTS == 1 ? 4 : 2; /* independent score accumulators per n-tile */
    static_assert((KV_D / 32) % 2 == 0, "score loop steps two k-pairs at a time");
    extern __shared__ __align__(128) uint8_t smem[];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int t = blockIdx.x;
    const int h0 = (a.tile_base + (int)blockIdx.y) * HEAD_TILE;
    const int rows = min(HEAD_TILE, a.H - h0);
    const int split = blockIdx.z;
    const int k0 = split * a.blocks_per_split * BN;
    const int kend = min(a.topk, k0 + a.blocks_per_split * BN);
    const int nblk = (kend - k0 + BN - 1) / BN;
    const uint32_t sbase = smem_u32(smem);
    int32_t *s_slot = reinterpret_cast<int32_t *>(smem + S::OFF_SLOT);

    /* Query rows of this head tile; padding rows are zeros in shared memory only. */
    for (int u = tid; u < RT * 16 * ROW_CHUNKS; u += NTHREADS) {
        const int r = u / ROW_CHUNKS, c = u - r * ROW_CHUNKS;
        if (r < rows)
            cp_async16(sbase + sw_off(r, c),
                       a.q + (int64_t)t * a.q_st + (int64_t)(h0 + r) * a.q_sh + c * 8, 16);
        else
            st_shared16(sbase + sw_off(r, c), make_uint4(0, 0, 0, 0));
    }
    cp_async_commit();

    /* Physical slot of every index of the chunk, -1 where it selects nothing.
     * Anything out of range reads as empty; the host validates when asked. */
    {
        const int b = a.req[(int64_t)t * a.req_s];
        const bool b_ok = b >= 0 && b < a.B;
        const int len = b_ok ? a.seq[(int64_t)b * a.seq_s] : 0;
        for (int k = tid; k < nblk * BN; k += NTHREADS) {
            const int gi = k0 + k;
            int slot = -1;
            if (gi < kend) {
                const int i = a.idx[(int64_t)t * a.idx_st + (int64_t)gi * a.idx_sk];
                if (i >= 0 && i < len) {
                    const int blk = i / a.page;
                    if (blk < a.max_blocks) {
                        const int64_t phys =
                            (int64_t)a.bt[(int64_t)b * a.bt_sb + (int64_t)blk * a.bt_sk] * a.page +
                            (i - blk * a.page);
                        if (phys >= 0 && phys < a.num_slots)
                            slot = (int)phys;
                    }
                }
            }
            s_slot[k] = slot;
        }
    }
    __syncthreads();

    /* Gather block j (one commit group per call, empty past the end). */
    auto issue = [&](int j) {
        if (j < nblk) {
            if constexpr (!FP8) {
                const uint32_t st = sbase + S::OFF_KV + (j % S::KV_STAGES) * S::KV_STAGE;
#pragma unroll
                for (int i = 0; i < BN * ROW_CHUNKS / NTHREADS; i++) {
                    const int u = tid + i * NTHREADS;
                    const int r = u / ROW_CHUNKS, c = u - r * ROW_CHUNKS;
                    const int slot = s_slot[j * BN + r];
                    const uint8_t *src = a.kv + (slot >= 0 ? slot * a.kv_row + c * 16 : 0);
                    cp_async16(st + sw_off(r, c), src, slot >= 0 ? 16 : 0);
                }
            } else {
                const uint32_t st = sbase + S::OFF_RAW + (j % S::RAW_STAGES) * S::RAW_STAGE;
                for (int u = tid; u < BN * FP8_CHUNKS; u += NTHREADS) {
                    const int r = u / FP8_CHUNKS, c = u - r * FP8_CHUNKS;
                    const int slot = s_slot[j * BN + r];
                    const uint8_t *src = a.kv + (slot >= 0 ? slot * a.kv_row + c * 16 : 0);
                    cp_async16(st + r * FP8_BYTES + c * 16, src, slot >= 0 ? 16 : 0);
                }
            }
        }
        cp_async_commit();
    };

    /* fp8 block j: raw stage j%3 -> bf16 stage j%2.  Per row: 32 pieces of
     * 16 e4m3 values (each becomes two bf16 pieces) and 8 rope pieces. */
    auto convert = [&](int j) {
        const uint8_t *raw = smem + S::OFF_RAW + (j % S::RAW_STAGES) * S::RAW_STAGE;
        const uint32_t dst = sbase + S::OFF_KV + (j % 2) * S::KV_STAGE;
        for (int u = tid; u < BN * 40; u += NTHREADS) {
            const int r = u / 40, c = u - r * 40;
            const uint8_t *rrow = raw + r * FP8_BYTES;
            if (c < 32) {
                const uint4 v = *reinterpret_cast<const uint4 *>(rrow + c * 16);
                const float sc = *reinterpret_cast<const float *>(rrow + KV_L + 4 * (c >> 3));
                uint4 lo, hi;
                lo.x = e4m3x2_to_bf16x2(v.x & 0xffff, sc);
                lo.y = e4m3x2_to_bf16x2(v.x >> 16, sc);
                lo.z = e4m3x2_to_bf16x2(v.y & 0xffff, sc);
                lo.w = e4m3x2_to_bf16x2(v.y >> 16, sc);
                hi.x = e4m3x2_to_bf16x2(v.z & 0xffff, sc);
                hi.y = e4m3x2_to_bf16x2(v.z >> 16, sc);
                hi.z = e4m3x2_to_bf16x2(v.w & 0xffff, sc);
                hi.w = e4m3x2_to_bf16x2(v.w >> 16, sc);
                st_shared16(dst + sw_off(r, 2 * c), lo);
                st_shared16(dst + sw_off(r, 2 * c + 1), hi);
            } else {
                const int cc = c - 32;
                const uint4 v = *reinterpret_cast<const uint4 *>(rrow + KV_L + 16 + cc * 16);
                st_shared16(dst + sw_off(r, 64 + cc), v);
            }
        }
    };

    const int pair = warp >> 1, ch = warp & 1;
    const int rt = pair / KS, g = pair % KS;
    const bool active = rt < RT;
    const int r4 = lane >> 2, q4 = lane & 3, sw = lane & 7;

    float o[32][4];
#pragma unroll
    for (int i = 0; i < 32; i++)
        o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};

    /* Pipeline (one commit group per issue):
     *   bf16: NS stages; block j+NS-1 is issued once block j has landed and
     *         every warp is past block j-1, whose stage it reuses.
     *   fp8:  NR raw stages and two converted ones; at step j block j+1 is
     *         converted (its raw stage is then free for block j+NR) while
     *         block j is computed from the other converted stage. */
    constexpr int NS = S::KV_STAGES, NR = S::RAW_STAGES;
    if constexpr (FP8) {
#pragma unroll
        for (int i = 0; i < NR; i++)
            issue(i);
        cp_async_wait<NR - 1>();
        __syncthreads();
        convert(0);
    } else {
#pragma unroll
        for (int i = 0; i < NS - 1; i++)
            issue(i);
    }

    for (int j = 0; j < nblk; j++) {
        uint32_t kvb;
        if constexpr (FP8) {
            cp_async_wait<NR - 2>();
            __syncthreads();
            if (j + 1 < nblk)
                convert(j + 1);
            issue(j + NR);
            kvb = sbase + S::OFF_KV + (j % 2) * S::KV_STAGE;
        } else {
            cp_async_wait<NS - 2>();
            __syncthreads();
            issue(j + NS - 1);
            kvb = sbase + S::OFF_KV + (j % NS) * S::KV_STAGE;
        }
        if (!active)
            continue;

        /* Scores: 16 head rows x SN slots over 576 dims.  QCH independent
         * accumulators per n-tile (alternating k-steps), summed after the
         * loop: one chain of 36 dependent mma would leave the tensor pipe
         * waiting on its latency. */
        const int scol = g * SUB + ch * SN;
        float sacc[NTS][4], qacc[NTS][QCH][4];
#pragma unroll
        for (int nt = 0; nt < NTS; nt++)
#pragma unroll
            for (int c = 0; c < QCH; c++)
                qacc[nt][c][0] = qacc[nt][c][1] = qacc[nt][c][2] = qacc[nt][c][3] = 0.0f;
        const uint32_t qrow = sbase + (rt * 16 + (lane & 15)) * ROW_BYTES;
#pragma unroll 3
        for (int kk = 0; kk < KV_D / 32; kk += 2) {
#pragma unroll
            for (int u = 0; u < 2; u++) {
                const int kc = kk + u;
                uint32_t a0[4], a1[4];
                ldsm_x4(a0, qrow + (((4 * kc + (lane >> 4)) ^ sw) << 4));
                ldsm_x4(a1, qrow + (((4 * kc + 2 + (lane >> 4)) ^ sw) << 4));
#pragma unroll
                for (int nt = 0; nt < NTS; nt++) {
                    uint32_t b[4];
                    ldsm_x4(b, kvb + (scol + nt * 8 + (lane & 7)) * ROW_BYTES +
                                   (((4 * kc + (lane >> 3)) ^ sw) << 4));
                    mma_bf16(qacc[nt][(2 * u) % QCH], a0, b[0], b[1]);
                    mma_bf16(qacc[nt][(2 * u + 1) % QCH], a1, b[2], b[3]);
                }
            }
        }
#pragma unroll
        for (int nt = 0; nt < NTS; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float v = 0.0f;
#pragma unroll
                for (int c = 0; c < QCH; c++)
                    v += qacc[nt][c][e];
                sacc[nt][e] = v;
            }

        /* Mask empty slots, scale into log2 units, row maxima over the pair. */
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < NTS; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int col = scol + nt * 8 + 2 * q4 + (e & 1);
                const float v = s_slot[j * BN + col] >= 0 ? sacc[nt][e] * a.scale_log2 : -INFINITY;
                sacc[nt][e] = v;
                mx[e >> 1] = fmaxf(mx[e >> 1], v);
            }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
        }
        float *s_max = reinterpret_cast<float *>(smem + S::OFF_MAX) + pair * 32;
        if (q4 == 0) {
            s_max[ch * 16 + r4] = mx[0];
            s_max[ch * 16 + r4 + 8] = mx[1];
        }
        pair_sync(pair);
        float base[2], alpha[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const float other = s_max[(ch ^ 1) * 16 + r4 + 8 * i];
            const float mnew = fmaxf(m_run[i], fmaxf(mx[i], other));
            base[i] = mnew == -INFINITY ? 0.0f : mnew;
            alpha[i] = exp2f(m_run[i] - base[i]);
            m_run[i] = mnew;
        }

        /* Probabilities (bf16) into the pair's P tile [16 rows][32 slots]. */
        uint8_t *s_p = smem + S::OFF_P + pair * S::P_PAIR;
#pragma unroll
        for (int nt = 0; nt < NTS; nt++) {
            const int pc = ch * SN + nt * 8 + 2 * q4;
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int r = r4 + 8 * i;
                const uint32_t p = pack_bf16(exp2f(sacc[nt][2 * i] - base[i]),
                                             exp2f(sacc[nt][2 * i + 1] - base[i]));
                *reinterpret_cast<uint32_t *>(s_p + r * 64 + (((pc >> 3) ^ ((r >> 1) & 3)) << 4) +
                                              (pc & 7) * 2) = p;
            }
        }
        pair_sync(pair);

#pragma unroll
        for (int nt = 0; nt < 32; nt++) {
            o[nt][0] *= alpha[0];
            o[nt][1] *= alpha[0];
            o[nt][2] *= alpha[1];
            o[nt][3] *= alpha[1];
        }

        /* O[16 x 256] += P[16 x SUB] . V[SUB x 256] (this warp's column half). */
        float rs[2] = {0.0f, 0.0f};
        const int prow = lane & 15;
        const uint32_t pbase = sbase + S::OFF_P + pair * S::P_PAIR + prow * 64;
#pragma unroll
        for (int ks = 0; ks < PV_K; ks++) {
            uint32_t pa[4];
            ldsm_x4(pa, pbase + (((2 * ks + (lane >> 4)) ^ ((prow >> 1) & 3)) << 4));
            rs[0] += bf16_lo(pa[0]) + bf16_hi(pa[0]) + bf16_lo(pa[2]) + bf16_hi(pa[2]);
            rs[1] += bf16_lo(pa[1]) + bf16_hi(pa[1]) + bf16_lo(pa[3]) + bf16_hi(pa[3]);
            const uint32_t vrow = kvb + (g * SUB + 16 * ks + (lane & 7) + (lane & 8)) * ROW_BYTES;
#pragma unroll
            for (int np = 0; np < 16; np++) {
                uint32_t b[4];
                ldsm_x4_trans(b, vrow + (((ch * 32 + 2 * np + (lane >> 4)) ^ sw) << 4));
                mma_bf16(o[2 * np], pa, b[0], b[1]);
                mma_bf16(o[2 * np + 1], pa, b[2], b[3]);
            }
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            rs[i] += __shfl_xor_sync(0xffffffffu, rs[i], 1);
            rs[i] += __shfl_xor_sync(0xffffffffu, rs[i], 2);
            l_run[i] = l_run[i] * alpha[i] + rs[i];
        }
    }

    cp_async_wait<0>();
    __syncthreads();

    if constexpr (KS == 2) {
        /* The second slot half hands its state to the first through the
         * (now idle) KV stages. */
        float *mb = reinterpret_cast<float *>(smem + S::OFF_KV) + (rt * 2 + ch) * S::MERGE_FLOATS;
        if (active && g == 1) {
#pragma unroll
            for (int i = 0; i < 128; i++)
                mb[i * 32 + lane] = o[i >> 2][i & 3];
            mb[128 * 32 + lane] = m_run[0];
            mb[129 * 32 + lane] = m_run[1];
            mb[130 * 32 + lane] = l_run[0];
            mb[131 * 32 + lane] = l_run[1];
        }
        __syncthreads();
        if (active && g == 0) {
            float f0[2], f1[2];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const float m1 = mb[(128 + i) * 32 + lane], l1 = mb[(130 + i) * 32 + lane];
                const float mn = fmaxf(m_run[i], m1);
                const float bs = mn == -INFINITY ? 0.0f : mn;
                f0[i] = exp2f(m_run[i] - bs);
                f1[i] = exp2f(m1 - bs);
                l_run[i] = l_run[i] * f0[i] + l1 * f1[i];
                m_run[i] = mn;
            }
#pragma unroll
            for (int i = 0; i < 128; i++)
                o[i >> 2][i & 3] = o[i >> 2][i & 3] * f0[(i & 3) >> 1] + mb[i * 32 + lane] * f1[(i & 3) >> 1];
        }
    }
    const bool writer = active && g == 0;
    if (writer) {
        float inv[2], lse[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            inv[i] = l_run[i] > 0.0f ? 1.0f / l_run[i] : 0.0f;
            lse[i] = l_run[i] > 0.0f ? (m_run[i] + log2f(l_run[i])) * LN2 : -INFINITY;
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int hr = rt * 16 + r4 + 8 * i;
            if (hr >= rows)
                continue;
            const int h = h0 + hr;
            if (a.splits == 1) {
                __nv_bfloat16 *orow =
                    a.out + (int64_t)h * a.o_sh + (int64_t)t * a.o_st + ch * 256 + 2 * q4;
#pragma unroll
                for (int nt = 0; nt < 32; nt++)
                    *reinterpret_cast<uint32_t *>(orow + nt * 8) =
                        pack_bf16(o[nt][2 * i] * inv[i], o[nt][2 * i + 1] * inv[i]);
                if (ch == 0 && q4 == 0 && a.lse)
                    a.lse[(int64_t)h * a.l_sh + (int64_t)t * a.l_st] = lse[i];
            } else {
                const int64_t row = ((int64_t)split * a.T + t) * a.H + h;
                float *orow = a.ws_o + row * KV_L + ch * 256 + 2 * q4;
#pragma unroll
                for (int nt = 0; nt < 32; nt++)
                    *reinterpret_cast<float2 *>(orow + nt * 8) =
                        make_float2(o[nt][2 * i] * inv[i], o[nt][2 * i + 1] * inv[i]);
                if (ch == 0 && q4 == 0)
                    a.ws_lse[row] = lse[i];
            }
        }
    }
}

/* out[h,t,:] = sum_z w_z * part_z / sum_z w_z with w_z = exp(lse_z - max):
 * one block per (t, h); COMBINE_GROUPS groups of 128 threads take every
 * COMBINE_GROUPS-th split, 4 columns per thread, COMBINE_UNROLL partials
 * loaded before any is used (at small T few blocks exist, so each thread
 * must keep several loads in flight), then the groups are summed through
 * shared memory.  Empty partials (lse -inf) weigh 0 and are never used, so
 * 0 * NaN cannot occur. */
constexpr int COMBINE_GROUPS = 4;
constexpr int COMBINE_UNROLL = 4;
constexpr int COMBINE_THREADS = 128 * COMBINE_GROUPS;

__global__ void __launch_bounds__(COMBINE_THREADS) b12x_combine_kernel(const AttendArgs a)
{
    __shared__ float4 s_acc[COMBINE_GROUPS - 1][128];
    __shared__ float s_sum[COMBINE_GROUPS - 1];
    const int t = blockIdx.x, h = blockIdx.y;
    const int lane = threadIdx.x & 127, grp = threadIdx.x >> 7, c = lane * 4;
    const int64_t zstride = (int64_t)a.T * a.H, base = (int64_t)t * a.H + h;
    float mx = -INFINITY;
#pragma unroll 8
    for (int z = 0; z < a.splits; z++)
        mx = fmaxf(mx, a.ws_lse[z * zstride + base]);
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float sum = 0.0f;
    if (mx != -INFINITY) {
        for (int z0 = grp; z0 < a.splits; z0 += COMBINE_GROUPS * COMBINE_UNROLL) {
            float w[COMBINE_UNROLL];
            float4 v[COMBINE_UNROLL];
#pragma unroll
            for (int i = 0; i < COMBINE_UNROLL; i++) {
                const int z = z0 + i * COMBINE_GROUPS;
                w[i] = 0.0f;
                if (z < a.splits) {
                    const int64_t row = z * zstride + base;
                    w[i] = expf(a.ws_lse[row] - mx);
                    if (w[i] != 0.0f)
                        v[i] = *reinterpret_cast<const float4 *>(a.ws_o + row * KV_L + c);
                }
            }
#pragma unroll
            for (int i = 0; i < COMBINE_UNROLL; i++) {
                if (w[i] == 0.0f)
                    continue;
                sum += w[i];
                acc.x += w[i] * v[i].x;
                acc.y += w[i] * v[i].y;
                acc.z += w[i] * v[i].z;
                acc.w += w[i] * v[i].w;
            }
        }
    }
    if (grp > 0) {
        s_acc[grp - 1][lane] = acc;
        if (lane == 0)
            s_sum[grp - 1] = sum;
    }
    __syncthreads();
    if (grp > 0)
        return;
#pragma unroll
    for (int g = 0; g < COMBINE_GROUPS - 1; g++) {
        const float4 o = s_acc[g][lane];
        acc.x += o.x;
        acc.y += o.y;
        acc.z += o.z;
        acc.w += o.w;
        sum += s_sum[g];
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    __nv_bfloat16 *orow = a.out + (int64_t)h * a.o_sh + (int64_t)t * a.o_st + c;
    reinterpret_cast<uint32_t *>(orow)[0] = pack_bf16(acc.x * inv, acc.y * inv);
    reinterpret_cast<uint32_t *>(orow)[1] = pack_bf16(acc.z * inv, acc.w * inv);
    if (lane == 0 && a.lse)
        a.lse[(int64_t)h * a.l_sh + (int64_t)t * a.l_st] = sum > 0.0f ? mx + logf(sum) : -INFINITY;
}

typedef void (*attend_kernel_fn)(AttendArgs);

/* The kernel for a format and row-tile count, and its shared-memory bytes
 * for a chunk of `chunk_slots`. */
attend_kernel_fn pick_kernel(bool fp8, int rt, int chunk_slots, size_t *smem)
{
#define B12X_PICK_(F, R)                                   \
    if (fp8 == F && rt == R) {                              \
        *smem = Smem<F, R>::bytes(chunk_slots);             \
        return b12x_attend_kernel<F, R>;                    \
    }
    B12X_PICK_(false, 1)
    B12X_PICK_(false, 2)
    B12X_PICK_(false, 3)
    B12X_PICK_(false, 4)
    B12X_PICK_(true, 1)
    B12X_PICK_(true, 2)
    B12X_PICK_(true, 3)
    B12X_PICK_(true, 4)
#undef B12X_PICK_
    *smem = 0;
    return nullptr;
}

int cuda_fail(mlart_error_fn err, const char *what, cudaError_t e)
{
    return err(MLART_ECUDA, "b12x_mla_sparse: %s: %s", what, cudaGetErrorString(e));
}

} /* namespace */

extern "C" int b12x_attend_setup(int *num_sms, mlart_error_fn err)
{
    int dev = 0, sms = 0, optin = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (e != cudaSuccess)
        return cuda_fail(err, "device query", e);
    int major = 0;
    e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (e != cudaSuccess)
        return cuda_fail(err, "device query", e);
    if (major < 9)
        return err(MLART_ENOTSUP,
                   "b12x_mla_sparse: device %d has compute capability %d.x; the kernels need sm_90",
                   dev, major);
    for (int f = 0; f < 2; f++)
        for (int rt = 1; rt <= 4; rt++) {
            size_t bytes;
            attend_kernel_fn fn = pick_kernel(f != 0, rt, B12X_MAX_TOPK, &bytes);
            if ((size_t)optin < bytes)
                return err(MLART_ENOTSUP,
                           "b12x_mla_sparse: kernels need %zu bytes of shared memory per block, "
                           "device %d allows %d",
                           bytes, dev, optin);
            e = cudaFuncSetAttribute((const void *)fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)bytes);
            if (e != cudaSuccess)
                return cuda_fail(err, "cudaFuncSetAttribute", e);
        }
    *num_sms = sms;
    return 0;
}

extern "C" b12x_split b12x_attend_split(int T, int heads, int topk, int num_sms)
{
    b12x_split best = {1, (topk + BN - 1) / BN};
    const int tiles = (heads + HEAD_TILE - 1) / HEAD_TILE;
    const int nblk = (topk + BN - 1) / BN;
    const int64_t work = (int64_t)T * tiles;
    int64_t best_cost = -1;
    if (num_sms < 1)
        num_sms = 1;
    /* Time ~ waves x (blocks per chunk + a fixed cost of about two blocks
     * for the prologue and the partial write).  Ties keep fewer splits. */
    for (int s = 1; s <= nblk && s <= MAX_SPLITS; s++) {
        const int bps = (nblk + s - 1) / s;
        if ((nblk + bps - 1) / bps != s)
            continue;
        const int64_t waves = (work * s + num_sms - 1) / num_sms;
        const int64_t cost = waves * (bps + 2);
        if (best_cost < 0 || cost < best_cost) {
            best_cost = cost;
            best.splits = s;
            best.blocks_per_split = bps;
        }
    }
    return best;
}

extern "C" size_t b12x_attend_workspace(int T, int heads, int topk, int num_sms)
{
    b12x_split sp = b12x_attend_split(T, heads, topk, num_sms);
    if (sp.splits <= 1)
        return 0;
    const size_t rows = (size_t)sp.splits * T * heads;
    return rows * KV_L * sizeof(float) + rows * sizeof(float);
}

extern "C" int b12x_attend_launch(const mlart_step *s, int num_sms, void *stream,
                                  mlart_error_fn err)
{
    const mlart_geometry *g = &s->geom;
    const int T = s->T, H = g->heads;
    if (T == 0)
        return 0;
    if (H < 1 || H > B12X_MAX_HEADS || g->topk < 1 || g->topk > B12X_MAX_TOPK ||
        g->kv_lora != B12X_KV_LORA || g->rope != B12X_ROPE || g->page_size < 1)
        return err(MLART_ENOTSUP,
                   "b12x_mla_sparse: serves heads 1..%d, topk 1..%d, kv_lora %d, rope %d "
                   "(got heads %d, topk %d, kv_lora %d, rope %d)",
                   B12X_MAX_HEADS, B12X_MAX_TOPK, B12X_KV_LORA, B12X_ROPE, H, g->topk,
                   g->kv_lora, g->rope);
    const bool fp8 = g->kv_format == MLART_KV_FP8_DS_MLA;
    const int64_t row_bytes = fp8 ? FP8_BYTES : ROW_BYTES;
    const mlart_tensor *q = &s->q_mqa, *kv = &s->kv_cache, *out = &s->attn_out;
    if (q->stride[2] != 1 || q->stride[0] % 8 || q->stride[1] % 8 || ((uintptr_t)q->data & 15))
        return err(MLART_ELAYOUT,
                   "b12x_mla_sparse: q_mqa rows must be 16-byte aligned with inner stride 1");
    if (kv->shape[1] != row_bytes || kv->stride[0] % 16 || ((uintptr_t)kv->data & 15) ||
        kv->shape[0] > INT32_MAX)
        return err(MLART_ELAYOUT,
                   "b12x_mla_sparse: cache rows must be %lld bytes, 16-byte aligned, and fewer "
                   "than 2^31 slots",
                   (long long)row_bytes);
    if (out->stride[2] != 1 || out->stride[0] % 4 || out->stride[1] % 4 ||
        ((uintptr_t)out->data & 7))
        return err(MLART_ELAYOUT,
                   "b12x_mla_sparse: attn_out rows must be 8-byte aligned with inner stride 1");

    const b12x_split sp = b12x_attend_split(T, H, g->topk, num_sms);
    AttendArgs a;
    a.q = (const __nv_bfloat16 *)q->data;
    a.q_st = q->stride[0];
    a.q_sh = q->stride[1];
    a.kv = (const uint8_t *)kv->data;
    a.kv_row = kv->stride[0];
    a.num_slots = kv->shape[0];
    a.idx = (const int32_t *)s->idx.data;
    a.idx_st = s->idx.stride[0];
    a.idx_sk = s->idx.stride[1];
    a.req = (const int32_t *)s->req_of_token.data;
    a.req_s = s->req_of_token.stride[0];
    a.seq = (const int32_t *)s->seq_lens.data;
    a.seq_s = s->seq_lens.stride[0];
    a.bt = (const int32_t *)s->block_table.data;
    a.bt_sb = s->block_table.stride[0];
    a.bt_sk = s->block_table.stride[1];
    a.max_blocks = s->block_table.shape[1];
    a.out = (__nv_bfloat16 *)out->data;
    a.o_sh = out->stride[0];
    a.o_st = out->stride[1];
    a.lse = (float *)s->lse.data;
    a.l_sh = s->lse.stride[0];
    a.l_st = s->lse.stride[1];
    a.ws_o = NULL;
    a.ws_lse = NULL;
    a.T = T;
    a.H = H;
    a.B = s->B;
    a.topk = g->topk;
    a.page = g->page_size;
    a.blocks_per_split = sp.blocks_per_split;
    a.splits = sp.splits;
    a.scale_log2 = g->softmax_scale * LOG2E;
    if (sp.splits > 1) {
        const size_t need = b12x_attend_workspace(T, H, g->topk, num_sms);
        if (!s->workspace || s->workspace_bytes < need || ((uintptr_t)s->workspace & 15))
            return err(MLART_EINVAL,
                       "b12x_mla_sparse: step of %d tokens needs %zu bytes of 16-aligned "
                       "workspace, has %zu (plan for max_tokens >= %d)",
                       T, need, s->workspace ? s->workspace_bytes : (size_t)0, T);
        a.ws_o = (float *)s->workspace;
        a.ws_lse = a.ws_o + (size_t)sp.splits * T * H * KV_L;
    }

    const int full = H / HEAD_TILE, rem = H % HEAD_TILE;
    const int chunk = sp.blocks_per_split * BN;
    cudaStream_t st = (cudaStream_t)stream;
    for (int part = 0; part < 2; part++) {
        const int tiles = part == 0 ? full : (rem ? 1 : 0);
        if (tiles == 0)
            continue;
        const int rt = part == 0 ? 4 : (rem + 15) / 16;
        size_t smem;
        attend_kernel_fn fn = pick_kernel(fp8, rt, chunk, &smem);
        a.tile_base = part == 0 ? 0 : full;
        dim3 grid((unsigned)T, (unsigned)tiles, (unsigned)sp.splits);
        fn<<<grid, NTHREADS, smem, st>>>(a);
    }
    if (sp.splits > 1) {
        dim3 grid((unsigned)T, (unsigned)H);
        b12x_combine_kernel<<<grid, COMBINE_THREADS, 0, st>>>(a);
    }
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return cuda_fail(err, "launch", e);
    return 0;
}
