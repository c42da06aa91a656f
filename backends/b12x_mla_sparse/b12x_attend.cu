/* Sparse MLA decode on sm_90: q_mqa [T,H,576] against the top-k rows of the
 * paged latent cache, bf16 or fp8_ds_mla.  docs/attention.md gives the byte
 * and FLOP counts this design is built around.
 *
 * One thread block = one token x one tile of up to 64 heads x one chunk of
 * the token's top-k list (split-k when T is small, so that the grid fills
 * the multiprocessors).  The block gathers each selected cache row ONCE into
 * shared memory (cp.async, 16-byte pieces, 3-6 stages), converts fp8 rows
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
 * With 17-32 heads two pairs share the rows and split the slots, merged at
 * the end.  One tile of <= 16 heads runs b12x_small_kernel instead: eight
 * math warps on each block of slots (the scores split between them by
 * slots and dims, then the output columns) and eight load warps that
 * gather and convert the next blocks meanwhile.
 *
 * Splits write bf16 partial outputs and natural-log LSEs to the workspace;
 * a small kernel combines them (LSE-weighted), blocks of one (token, head)
 * row or a quarter of it, so the combine's reads spread over the GPU.
 * (Combining in the last-finishing chunk instead was measured 2-7x slower
 * at T <= 4: one block then reads every partial of 64 heads;
 * docs/attention.md.)  Opt-in (b12x_dev.inplace), every kernel here and
 * the wgmma kernel combine in place instead when the whole grid is
 * resident: the chunks of a token meet at a barrier and each combines a
 * slice of its rows (b12x::combine_in_kernel, b12x_common.cuh).  Both
 * kernels are launched with programmatic dependent launch: each becomes
 * resident while the previous kernel of the stream finishes.  The main
 * kernel resolves its slots and issues its first gathers meanwhile (inputs
 * that kernel does not write: the stream contract in docs/attention.md),
 * and both wait for it (griddepcontrol.wait) before they read what it
 * wrote or write anything.  No allocation, no host read, no
 * synchronisation: the launches can be captured in a graph. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/b12x_mla_sparse/b12x_attend.h"
#include "backends/b12x_mla_sparse/b12x_common.cuh"
#include "runtime/cuda_clock.h"
#include "runtime/cuda_launch.h"

namespace {

using b12x::AttendArgs;

constexpr int KV_L = B12X_KV_LORA;
constexpr int KV_D = B12X_KV_LORA + B12X_ROPE;  /* 576 */
constexpr int ROW_BYTES = KV_D * 2;              /* one bf16 row in shared memory */
constexpr int ROW_CHUNKS = ROW_BYTES / 16;       /* 72 pieces of 16 bytes */
constexpr int FP8_BYTES = KV_L + 4 * (KV_L / 128) + 2 * B12X_ROPE; /* 656 */
constexpr int BN = b12x::BLOCK_SLOTS;            /* slots per pipeline block */
constexpr int NTHREADS = 256;
constexpr int HEAD_TILE = 64;
constexpr int MAX_SPLITS = 64;
constexpr float LN2 = 0.69314718055994530942f;

static_assert(FP8_BYTES % 16 == 0, "fp8 records must be whole 16-byte pieces");

#ifdef B12X_PROFILE
/* Phase stamps of the last launch (a diagnostic build only: -DB12X_PROFILE).
 * Main kernel, per block: [0] global timer at entry, [1..5] SM clock after
 * the slot resolution and the first gathers' issue, the dependency wait
 * (and the query's issue), the first block landing, the loop and the
 * writes, [6] SM clock at entry, [7] global timer at exit, and with the
 * in-place combine [8] SM clock after its barrier and [9] after it; the
 * small-head kernel also [10] once the combine's LSE loads have landed,
 * [11] its partials, [12] after its groups' barrier; without the in-place
 * combine the small-head kernels stamp their tail instead: [10] once the
 * last P.V has landed, [11] once the row sums' inverses are ready.
 * Combine kernel, per block: global timer at [0] entry, [1] exit and [2]
 * past its dependency wait; SM clock [3] past the wait, [4] once its loads
 * have landed and been summed, [5] before its exit, [6] past its groups'
 * barrier (0 with one group), [7] once its loads have landed (before any
 * use of them). */
constexpr int PROF_BLOCKS = 4096;
__device__ unsigned long long b12x_prof_main[PROF_BLOCKS][13];
__device__ unsigned long long b12x_prof_cb[PROF_BLOCKS][8];
/* Combine kernel, per warp (lane 0): SM clock [0] once its loads have
 * landed, [1] once they have been summed, as [7] and [4] of its block's
 * thread 0. */
constexpr int PROF_CB_WARPS = 32;
__device__ unsigned long long b12x_prof_cbw[PROF_BLOCKS][PROF_CB_WARPS][2];
/* Loop phases of the small-head kernel, SM cycles summed over the blocks
 * of 32 slots: as the first math thread sees them, [0] the wait for a
 * stage, [3] the scores, [4] the barrier, softmax and barrier, [5] P.V;
 * as the first load thread sees them, [1] the fp8 conversion, [2] the
 * gather issue, [6] the wait for its data, [7] the wait for a free
 * stage. */
constexpr int PROF_LOOP = 8;
__device__ unsigned long long b12x_prof_loop[PROF_BLOCKS][PROF_LOOP];
int prof_main_blocks, prof_cb_blocks, prof_inplace; /* of the last launch */
int prof_inner; /* its in-place launches all stamp inside the combine ([10..12]) */
int prof_rc;    /* it ran the register-conversion kernel (no first-block stamp [3]) */
int prof_cb_groups; /* groups in its combine blocks (one: no groups' barrier stamp [6]) */
int prof_tail;      /* every main kernel it ran stamps its tail ([10], [11]) */
int prof_cb_warps;  /* warps in its combine blocks */
__device__ __forceinline__ unsigned long long prof_gt()
{
    unsigned long long v;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(v));
    return v;
}
#define B12X_PROF_BLK() \
    ((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x)
#define B12X_PROF_MAIN(k, v)                                                  \
    do {                                                                      \
        if (threadIdx.x == 0 && B12X_PROF_BLK() < PROF_BLOCKS)                \
            b12x_prof_main[B12X_PROF_BLK()][k] = (v);                         \
    } while (0)
/* Without the in-place combine (which stamps [10..12] itself): the SM
 * clock once v has arrived, into [k]. */
#define B12X_PROF_TAIL(k, v)                                                  \
    do {                                                                      \
        if constexpr (!IP)                                                    \
            B12X_PROF_MAIN(k, mlart_clock_after(v));                          \
    } while (0)
#define B12X_PROF_CBW(k, v)                                                   \
    do {                                                                      \
        if ((threadIdx.x & 31) == 0 && B12X_PROF_BLK() < PROF_BLOCKS)         \
            b12x_prof_cbw[B12X_PROF_BLK()][threadIdx.x / 32][k] = (v);        \
    } while (0)
#define B12X_PROF_CB(k) B12X_PROF_CB_AT(k, prof_gt())
#define B12X_PROF_CB_AT(k, v)                                                 \
    do {                                                                      \
        if (threadIdx.x == 0 && B12X_PROF_BLK() < PROF_BLOCKS)                \
            b12x_prof_cb[B12X_PROF_BLK()][k] = (v);                           \
    } while (0)
/* Two calls in a row: per block of the main kernel (k = 0; not the wgmma
 * kernel) and of the combine (k = 1), in slot (n / blocks of the launch)
 * & 1 of the n-th block to enter since b12x_profile_reset: the global
 * timer at [0] entry, [1] past the dependency wait, [2] exit, and [3] the
 * SM it ran on.  The block's slot stays in shared memory from its entry to
 * its exit (blocks of two calls of the main kernel may overlap, since the
 * capped combine lets the next call launch before its wait). */
__device__ unsigned long long b12x_prof_seq[2][2][PROF_BLOCKS][4];
__device__ unsigned int b12x_prof_seq_n[2];
__shared__ int b12x_prof_seq_slot;
__device__ __forceinline__ void prof_seq_enter(int k)
{
    const unsigned b = B12X_PROF_BLK();
    if (threadIdx.x == 0) {
        unsigned sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        const unsigned long long t = prof_gt();
        const unsigned n = atomicAdd(&b12x_prof_seq_n[k], 1u);
        const int slot = (int)((n / (gridDim.x * gridDim.y * gridDim.z)) & 1u);
        b12x_prof_seq_slot = slot;
        if (b >= PROF_BLOCKS)
            return;
        b12x_prof_seq[k][slot][b][0] = t;
        b12x_prof_seq[k][slot][b][3] = sm;
    }
}
__device__ __forceinline__ void prof_seq(int k, int i)
{
    const unsigned b = B12X_PROF_BLK();
    if (threadIdx.x == 0 && b < PROF_BLOCKS)
        b12x_prof_seq[k][b12x_prof_seq_slot][b][i] = prof_gt();
}
#define B12X_PROF_SEQ_ENTER(k) prof_seq_enter(k)
#define B12X_PROF_SEQ(k, i) prof_seq(k, i)
/* Add the cycles since the last tick to loop phase k (thread 0). */
#define B12X_PROF_TICK(acc, tick, k)                                          \
    do {                                                                      \
        const unsigned long long now_ = clock64();                            \
        (acc)[k] += now_ - (tick);                                            \
        (tick) = now_;                                                        \
    } while (0)
#else
#define B12X_PROF_TICK(acc, tick, k) ((void)0)
#define B12X_PROF_MAIN(k, v) ((void)0)
#define B12X_PROF_TAIL(k, v) ((void)0)
#define B12X_PROF_CB(k) ((void)0)
#define B12X_PROF_CB_AT(k, v) ((void)0)
#define B12X_PROF_CBW(k, v) ((void)0)
#define B12X_PROF_SEQ_ENTER(k) ((void)0)
#define B12X_PROF_SEQ(k, i) ((void)0)
#endif
static_assert(BN * ROW_CHUNKS % NTHREADS == 0, "bf16 gather assumes whole rounds");

/* Shared-memory map of one thread block (byte offsets, all 16-aligned). */
template <bool FP8, int RT> struct Smem {
    static_assert(RT >= 2 && RT <= 4, "one row tile runs b12x_small_kernel");
    static constexpr int KS = RT <= 2 ? 2 : 1; /* pairs that split one block's slots */
    static constexpr int GROUPS = KS;          /* pairs that share a row tile */
    /* Stages: bf16 3 gathered; fp8 3 raw + 2 converted. */
    static constexpr int KV_STAGES = FP8 ? 2 : 3;
    static constexpr int RAW_STAGES = FP8 ? 3 : 1; /* 1: unused */
    static constexpr int Q_BYTES = RT * 16 * ROW_BYTES;
    static constexpr int KV_STAGE = BN * ROW_BYTES;
    static constexpr int RAW_STAGE = BN * FP8_BYTES;
    static constexpr int OFF_KV = Q_BYTES;
    static constexpr int OFF_RAW = OFF_KV + KV_STAGES * KV_STAGE;
    static constexpr int OFF_P = OFF_RAW + (FP8 ? RAW_STAGES * RAW_STAGE : 0);
    static constexpr int P_PAIR = 16 * BN * 2;
    static constexpr int OFF_MAX = OFF_P + 4 * P_PAIR;
    static constexpr int OFF_SLOT = OFF_MAX + 4 * 2 * 16 * 4;
    /* resolve_slots' scan words: the row maxima, first written in the loop */
    static constexpr int OFF_SCAN = OFF_MAX;
    static_assert(4 * 2 * 16 * 4 >= b12x::SCAN_BYTES, "scan words fit");
    /* End-of-loop merge of the groups (GROUPS > 1): per (row tile, group
     * past the first, column half) one warp's 128 accumulators + 2 maxima +
     * 2 sums per lane, in the (then idle) KV and raw stages. */
    static constexpr int MERGE_FLOATS = 132 * 32;
    static_assert(RT * (GROUPS - 1) * 2 * MERGE_FLOATS * 4 <= OFF_P - OFF_KV,
                  "merge buffer must fit in the stages");
    static constexpr size_t bytes(int chunk_slots) { return (size_t)OFF_SLOT + 4u * chunk_slots; }
    static_assert(bytes(B12X_MAX_TOPK) <= 232448, "over the sm_90 shared memory per block");
};

using b12x::bar_arrive;
using b12x::bar_sync;
using b12x::cp_async16;
using b12x::cp_async_commit;
using b12x::cp_async_wait;
using b12x::grid_dep_launch;
using b12x::grid_dep_wait;
using b12x::smem_u32;
using b12x::st_shared16;

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

/* Barrier of the two warps of pair p (ids 1..4; 0 is __syncthreads).  The
 * "memory" clobber keeps the compiler from moving the shared-memory
 * exchanges (row maxima, P tiles) across it, as in b12x::bar_sync. */
__device__ __forceinline__ void pair_sync(int p)
{
    asm volatile("bar.sync %0, 64;\n" ::"r"(p + 1) : "memory");
}

using b12x::bf16_hi;
using b12x::bf16_lo;
using b12x::e4m3x16_to_bf16;
using b12x::pack_bf16;
using b12x::store_row16;

/* Byte offset of 16-byte piece c of row r in a swizzled 1152-byte-row
 * matrix: the XOR spreads the 8 rows an ldmatrix phase reads over all 32
 * banks (rows are a multiple of 128 bytes apart, and 72 = 9 * 8 keeps the
 * piece inside its row). */
__device__ __forceinline__ uint32_t sw_off(int r, int c)
{
    return (uint32_t)(r * ROW_BYTES + ((c ^ (r & 7)) << 4));
}

/* Gather the 32 rows of one pipeline block (slots[0..31]) into a stage
 * with 16-byte cp.async pieces, empty slots zero-filled without reading.
 * Thread = (row tid / 8, q = tid % 8): pieces q, q + 8, .. of its row, so
 * a thread reads its slot once and eight lanes copy 128 contiguous bytes.
 * bf16 rows are swizzled (sw_off: piece q + 8i lands at 128 i + 16 (q ^
 * (row & 7)) of its row), fp8 records stored as they are (41 pieces). */
__device__ __forceinline__ void gather_bf16(const AttendArgs &a, const int32_t *slots, uint32_t st, int pt)
{
    static_assert(NTHREADS == 8 * BN && ROW_CHUNKS % 8 == 0, "eight threads per row");
    const int r = pt >> 3, q = pt & 7;
    const int slot = slots[r];
    const uint8_t *src = a.kv + (slot >= 0 ? (int64_t)slot * a.kv_row + q * 16 : 0);
    const uint32_t dst = st + sw_off(r, q);
    const int n = slot >= 0 ? 16 : 0;
#pragma unroll
    for (int i = 0; i < ROW_CHUNKS / 8; i++)
        cp_async16(dst + 128 * i, src + (slot >= 0 ? 128 * i : 0), n);
}

__device__ __forceinline__ void gather_fp8(const AttendArgs &a, const int32_t *slots, uint32_t st, int pt)
{
    constexpr int PIECES = FP8_BYTES / 16; /* 41 */
    static_assert(NTHREADS == 8 * BN && PIECES > 40 && PIECES <= 48, "eight threads per row, 5-6 pieces each");
    const int r = pt >> 3, q = pt & 7;
    const int slot = slots[r];
    const uint8_t *src = a.kv + (slot >= 0 ? (int64_t)slot * a.kv_row + q * 16 : 0);
    const uint32_t dst = st + r * FP8_BYTES + q * 16;
    const int n = slot >= 0 ? 16 : 0;
#pragma unroll
    for (int i = 0; i < 6; i++)
        if (q + 8 * i < PIECES)
            cp_async16(dst + 128 * i, src + (slot >= 0 ? 128 * i : 0), n);
}

/* fp8 block: raw records -> swizzled bf16 rows.  Thread = (row lane, warp
 * w of 8): e4m3 pieces w, w + 8, w + 16, w + 24 (16 values each, scale
 * tile i for piece w + 8i; each becomes two bf16 pieces) and rope piece w.
 * All loads first, so the conversion is not bound by their latency.  A
 * warp's 32 rows (656 bytes apart) make its reads conflict-free, and the
 * swizzle its writes.  Empty rows are zero-filled records (scale 0). */
__device__ __forceinline__ void convert_fp8(const uint8_t *raw, uint32_t dst, int pt)
{
    static_assert(NTHREADS == 8 * BN && KV_L / 16 == 4 * 8 && B12X_ROPE * 2 / 16 == 8,
                  "one thread per (row, warp)");
    const int r = pt & 31, w = pt >> 5;
    b12x::convert_fp8_pieces(raw, r, dst, w, [r](int c) { return sw_off(r, c); });
}

/* The start of the mma.sync kernels, in two halves around the dependency
 * wait.  Before it: the chunk's physical slots and the gathers of the
 * first blocks (start_block; in the small-head kernel its load warps, which
 * go on gathering without waiting).  These read only the indices,
 * the request's block table and length and the cache, which the stream's
 * previous kernel does not write (the stream contract, docs/attention.md:
 * in a layer step that kernel is the query absorption); the loads go
 * through L2 only (ld.cg, cp.async.cg), so no stale L1 line of an earlier
 * step can be read.  After it (load_query): the query rows of the head
 * tile, padding rows up to `padded` zeros in shared memory only, as the
 * newest commit group (the pipeline's first step waits for every group). */
__device__ __forceinline__ void load_query(const AttendArgs &a, uint32_t sbase, int t, int h0,
                                           int rows, int padded)
{
    for (int u = threadIdx.x; u < padded * ROW_CHUNKS; u += NTHREADS) {
        const int r = u / ROW_CHUNKS, c = u - r * ROW_CHUNKS;
        if (r < rows)
            cp_async16(sbase + sw_off(r, c),
                       a.q + (int64_t)t * a.q_st + (int64_t)(h0 + r) * a.q_sh + c * 8, 16);
        else
            st_shared16(sbase + sw_off(r, c), make_uint4(0, 0, 0, 0));
    }
    cp_async_commit();
}

/* The general kernel's gather pipeline, over a shared-memory map S (one
 * commit group per issue; the query's group comes after the prefetched
 * blocks' and before the rest):
 *   bf16: NS stages; block j+NS-1 is issued once block j has landed and
 *         every warp is past step j-1, whose stage it reuses.
 *   fp8: NR raw stages and two converted ones; at step j block j+1 is
 *        converted (its raw stage is then free for block j+NR) while block
 *        j is computed from the other converted stage. */
template <bool FP8, class S> struct Pipeline {
    const AttendArgs &a;
    uint8_t *smem;
    uint32_t sbase;
    const int32_t *s_slot;
    int nblk;

    /* Gather block j (one commit group, empty past the end). */
    __device__ __forceinline__ void issue(int j) const
    {
        if (j < nblk) {
            if constexpr (!FP8)
                gather_bf16(a, s_slot + j * BN, sbase + S::OFF_KV + (j % S::KV_STAGES) * S::KV_STAGE, threadIdx.x);
            else
                gather_fp8(a, s_slot + j * BN, sbase + S::OFF_RAW + (j % S::RAW_STAGES) * S::RAW_STAGE,
                           threadIdx.x);
        }
        cp_async_commit();
    }
    /* fp8 block j: raw stage j % NR -> bf16 stage j % 2. */
    __device__ __forceinline__ void convert(int j) const
    {
        convert_fp8(smem + S::OFF_RAW + (j % S::RAW_STAGES) * S::RAW_STAGE, sbase + S::OFF_KV + (j % 2) * S::KV_STAGE,
                    threadIdx.x);
    }
    /* Before the dependency wait: the first blocks' gathers. */
    __device__ __forceinline__ void prefetch() const
    {
        constexpr int N = FP8 ? S::RAW_STAGES : S::KV_STAGES - 1;
#pragma unroll
        for (int i = 0; i < N; i++)
            issue(i);
    }
    /* After it and the query's group: fp8 converts block 0 (every group,
     * the query's included, has landed after this or after step 0). */
    __device__ __forceinline__ void start() const
    {
        if constexpr (FP8) {
            cp_async_wait<0>();
            __syncthreads();
            convert(0);
        }
    }
    /* Step j: block j is in shared memory (bf16) for every thread, the next
     * gathers are issued; returns the stage holding block j. */
    __device__ __forceinline__ uint32_t step(int j) const
    {
        if constexpr (FP8) {
            cp_async_wait<S::RAW_STAGES - 2>();
            __syncthreads();
            if (j + 1 < nblk)
                convert(j + 1);
            issue(j + S::RAW_STAGES);
            return sbase + S::OFF_KV + (j % 2) * S::KV_STAGE;
        } else {
            if (j == 0)
                cp_async_wait<0>(); /* the query's group is the newest */
            else
                cp_async_wait<S::KV_STAGES - 2>();
            __syncthreads();
            issue(j + S::KV_STAGES - 1);
            return sbase + S::OFF_KV + (j % S::KV_STAGES) * S::KV_STAGE;
        }
    }
};

/* The general kernel's start.  Programmatic dependent launch: the block
 * may be resident before the previous kernel of the stream has finished.
 * It resolves its slots and starts its first gathers meanwhile
 * (load_query's comment says why that is safe), then waits for that
 * kernel and its memory before it reads the query or writes anything, and
 * lets the combine be scheduled (it waits for this whole grid the same
 * way).  The wait and the trigger are no-ops for a plain launch.  Returns
 * the block's pipeline with the first gathers in flight. */
template <bool FP8, class S>
__device__ __forceinline__ Pipeline<FP8, S> start_block(const AttendArgs &a, uint8_t *smem, uint32_t sbase,
                                                        int32_t *s_slot, int t, int h0, int rows, int padded,
                                                        int split, int nblk)
{
    B12X_PROF_SEQ_ENTER(0);
    B12X_PROF_MAIN(0, prof_gt());
    B12X_PROF_MAIN(6, clock64());
    const int nbc = b12x::resolve_slots<NTHREADS>(a, t, split, nblk * BN, s_slot,
                                                  reinterpret_cast<int32_t *>(smem + S::OFF_SCAN));
    const Pipeline<FP8, S> pipe{a, smem, sbase, s_slot, nbc};
    pipe.prefetch();
    B12X_PROF_MAIN(1, clock64());
    grid_dep_wait();
    B12X_PROF_SEQ(0, 1);
    grid_dep_launch();
    load_query(a, sbase, t, h0, rows, padded);
    B12X_PROF_MAIN(2, clock64());
    return pipe;
}

/* IP: the form that combines in place (a.bar set, splits > 1). */
template <bool FP8, int RT, bool IP> __device__ __forceinline__ void attend_body(const AttendArgs &a)
{
    using S = Smem<FP8, RT>;
    constexpr int KS = S::KS, GROUPS = S::GROUPS;
    constexpr int SUB = BN / KS;   /* slots of a block per pair */
    constexpr int SN = SUB / 2;    /* score columns per warp */
    constexpr int NTS = SN / 8;    /* n-tiles of scores per warp */
    constexpr int PV_K = SUB / 16; /* k-steps of P.V per block */
    constexpr int QCH = NTS == 1 ? 4 : 2; /* independent score accumulators per n-tile */
    static_assert((KV_D / 32) % 2 == 0, "score loop steps two k-pairs at a time");
    extern __shared__ __align__(128) uint8_t smem[];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const b12x::Chunk ck = b12x::chunk_of(a, HEAD_TILE, HEAD_TILE);
    const int t = ck.t, h0 = ck.h0, rows = ck.rows, split = ck.split;
    const uint32_t sbase = smem_u32(smem);
    int32_t *s_slot = reinterpret_cast<int32_t *>(smem + S::OFF_SLOT);

    const Pipeline<FP8, S> pipe =
        start_block<FP8, S>(a, smem, sbase, s_slot, t, h0, rows, RT * 16, split, ck.nblk);
    const int nblk = pipe.nblk; /* after compaction */

    const int pair = warp >> 1, ch = warp & 1;
    /* gi: the pair's group within its row tile, g: its slot half */
    const int rt = pair / GROUPS, gi = pair % GROUPS, g = gi;
    const bool active = rt < RT;
    const int r4 = lane >> 2, q4 = lane & 3, sw = lane & 7;

    float o[32][4];
#pragma unroll
    for (int i = 0; i < 32; i++)
        o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};

    pipe.start();
    for (int j = 0; j < nblk; j++) {
        const uint32_t kvb = pipe.step(j);
        if (j == 0)
            B12X_PROF_MAIN(3, clock64());
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
    B12X_PROF_MAIN(4, clock64());

    if constexpr (GROUPS > 1) {
        /* The other groups hand their state to the first through the (now
         * idle) stages; it merges them one after the other. */
        float *const mb0 = reinterpret_cast<float *>(smem + S::OFF_KV) +
                           (rt * (GROUPS - 1) * 2 + ch) * S::MERGE_FLOATS;
        if (active && gi > 0) {
            float *mb = mb0 + (gi - 1) * 2 * S::MERGE_FLOATS;
#pragma unroll
            for (int i = 0; i < 128; i++)
                mb[i * 32 + lane] = o[i >> 2][i & 3];
            mb[128 * 32 + lane] = m_run[0];
            mb[129 * 32 + lane] = m_run[1];
            mb[130 * 32 + lane] = l_run[0];
            mb[131 * 32 + lane] = l_run[1];
        }
        __syncthreads();
        if (active && gi == 0) {
#pragma unroll 1
            for (int q = 1; q < GROUPS; q++) {
                const float *mb = mb0 + (q - 1) * 2 * S::MERGE_FLOATS;
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
                    o[i >> 2][i & 3] =
                        o[i >> 2][i & 3] * f0[(i & 3) >> 1] + mb[i * 32 + lane] * f1[(i & 3) >> 1];
            }
        }
    }
    const bool writer = active && gi == 0;
    if (writer) {
        float inv[2], lse[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            inv[i] = l_run[i] > 0.0f ? 1.0f / l_run[i] : 0.0f;
            lse[i] = l_run[i] > 0.0f ? (m_run[i] + log2f(l_run[i])) * LN2 : -INFINITY;
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            /* a row past the tile's heads: its lanes still shuffle (the
             * whole warp takes part in store_row16), but store nothing */
            const int hr = rt * 16 + r4 + 8 * i;
            const bool ok = hr < rows;
            const int h = h0 + (ok ? hr : rows - 1);
            if (a.splits == 1) {
                __nv_bfloat16 *orow = a.out + (int64_t)h * a.o_sh + (int64_t)t * a.o_st + ch * 256;
#pragma unroll
                for (int k = 0; k < 16; k++)
                    store_row16(orow + 16 * k, pack_bf16(o[2 * k][2 * i] * inv[i], o[2 * k][2 * i + 1] * inv[i]),
                                pack_bf16(o[2 * k + 1][2 * i] * inv[i], o[2 * k + 1][2 * i + 1] * inv[i]), ok);
                if (ok && ch == 0 && q4 == 0 && a.lse)
                    a.lse[(int64_t)h * a.l_sh + (int64_t)t * a.l_st] = lse[i];
            } else {
                const int64_t row = ((int64_t)split * a.T + t) * a.H + h;
                __nv_bfloat16 *orow = a.ws_o + row * KV_L + ch * 256;
#pragma unroll
                for (int k = 0; k < 16; k++)
                    store_row16(orow + 16 * k, pack_bf16(o[2 * k][2 * i] * inv[i], o[2 * k][2 * i + 1] * inv[i]),
                                pack_bf16(o[2 * k + 1][2 * i] * inv[i], o[2 * k + 1][2 * i + 1] * inv[i]), ok);
                if (ok && ch == 0 && q4 == 0)
                    a.ws_lse[row] = lse[i];
            }
        }
    }
    B12X_PROF_MAIN(5, clock64());
    if constexpr (IP)
        b12x::combine_in_kernel<NTHREADS, 16 * RT>(a, t, h0, rows, split, tid, [] { __syncthreads(); },
                                                   [&] { B12X_PROF_MAIN(8, clock64()); },
                                                   reinterpret_cast<float *>(smem)); /* the query's */
    B12X_PROF_MAIN(9, clock64());
    B12X_PROF_MAIN(7, prof_gt());
    B12X_PROF_SEQ(0, 2);
}

/* The general kernel without and with the in-place combine. */
template <bool FP8, int RT> __global__ void __launch_bounds__(NTHREADS, 1) b12x_attend_kernel(const AttendArgs a)
{
    attend_body<FP8, RT, false>(a);
}

template <bool FP8, int RT>
__global__ void __launch_bounds__(NTHREADS, 1) b12x_attend_ip_kernel(const AttendArgs a)
{
    attend_body<FP8, RT, true>(a);
}

/* <= 16 heads (one 16-row tile): the eight math warps on one block of 32
 * slots at a time, so the per-block math is short and the fp32 state
 * small (the load warps: above b12x_small_kernel).
 *   scores: warp w takes 16 of the 32 slots (w % 2) over 9 of the 36 k16
 *           steps of the 576 dims (w / 2), its query fragments held in
 *           registers from the start; the four partial 16 x 32 score
 *           tiles meet in shared memory;
 *   softmax: a half-warp per head row (2 slots a lane), running max and
 *           sum in registers, bf16 probabilities into a 16 x 32 tile; the
 *           maximum is lazy (taken only when a score passes the running
 *           one by 2^8) and each lane keeps its own part of the sum, so
 *           most blocks need no shuffle;
 *   P.V:    warp w owns output columns [64w, 64w + 64), a 16 x 64 fp32
 *           accumulator (32 registers).
 * Two math-warp barriers and one hand-over per block of slots.  The bf16
 * output is staged in shared memory and written with wide coalesced
 * stores; the bf16 partial goes straight from the accumulators. */
/* Stages: bf16 gathered (3 for steps of <= 8 tokens, `SHORT`, 4 above);
 * fp8 converted (2) and raw (5 for short steps, 4 above).  Measured with
 * the register splits of SmallRegs (docs/PERF.md, run of 14:41 UTC):
 * bf16 T = 8 5% faster with 3 stages, T >= 16 0.5-1.5% slower; fp8
 * T >= 16 0.4-1.5% faster with 4 raw stages, T <= 8 within 0.6%. */
template <bool FP8, bool SHORT> struct SmallSmem {
    static constexpr int KV_STAGES = FP8 ? 2 : (SHORT ? 3 : 4);
    static constexpr int RAW_STAGES = FP8 ? (SHORT ? 5 : 4) : 1; /* 1: unused */
    static constexpr int Q_BYTES = 16 * ROW_BYTES;
    static constexpr int KV_STAGE = BN * ROW_BYTES;
    static constexpr int RAW_STAGE = BN * FP8_BYTES;
    static constexpr int S_LD = BN + 8; /* floats per partial-score row: conflict-free float2 */
    static constexpr int OFF_KV = Q_BYTES;
    static constexpr int OFF_RAW = OFF_KV + KV_STAGES * KV_STAGE;
    static constexpr int OFF_S = OFF_RAW + (FP8 ? RAW_STAGES * RAW_STAGE : 0);
    static constexpr int OFF_P = OFF_S + 4 * 16 * S_LD * 4; /* four partial score tiles */
    static constexpr int OFF_STAT = OFF_P + 16 * BN * 2; /* alpha, m, l per row */
    static constexpr int OFF_SLOT = OFF_STAT + 3 * 16 * 4;
    /* resolve_slots' scan words (16 warps): the row statistics, first
     * written in the loop */
    static constexpr int OFF_SCAN = OFF_STAT;
    static_assert(3 * 16 * 4 >= 2 * NTHREADS / 32 * 4, "scan words fit");
    static constexpr int O_LD = KV_L + 8; /* staged output row, in elements */
    static_assert(16 * O_LD * 4 <= KV_STAGES * KV_STAGE, "output stage fits in the KV stages");
    static constexpr size_t bytes(int chunk_slots) { return (size_t)OFF_SLOT + 4u * chunk_slots; }
    static_assert(bytes(B12X_MAX_TOPK) <= 232448, "over the sm_90 shared memory per block");
};

/* The small-head kernel runs 16 warps: 8 math warps (threads 0-255) and 8
 * load warps (256-511) that gather, and for fp8 convert, the blocks ahead
 * of the math; they hand the stages over by named barriers (bar.arrive on
 * one side, bar.sync on the other, 512 threads each):
 *   SB_FULL + s   block in stage s ready           load -> math
 *   SB_EMPTY + s  math done with stage s            math -> load
 * A side arrives on stage s again only after it has waited for the other
 * side's arrival on it, so no barrier sees two phases at once.  SB_MATH
 * and SB_LOAD are the barriers of each side alone (256 threads). */
constexpr int SMALL_THREADS = 2 * NTHREADS;
/* Registers a thread: the block launches with `launch` (the mean of the
 * two sides, rounded up to the allocation unit of 8), then the load warps
 * give some back (setmaxnreg) and the math warps take them.  A block
 * holds 512 x launch of the multiprocessor's 65536 and leaves the rest to
 * another kernel's block (the combine, the query absorption).  Chosen
 * from a sweep of seven splits (docs/PERF.md, attention, run of 14:26
 * UTC): bf16 96 / 128; fp8 72 / 128, and at T <= 8 (`SHORT`) 64 / 144,
 * 2.4-4.9% faster there than 64 / 128 but slower at T >= 32.  The math
 * warps' increase waits until the load warps' decrease has freed enough:
 * that holds because launch >= the mean and ptxas gives a kernel with
 * setmaxnreg exactly its __maxnreg__ count (-Xptxas -v: 112, 104, 104). */
template <bool FP8, bool SHORT> struct SmallRegs {
    static constexpr int load = FP8 ? (SHORT ? 64 : 72) : 96, math = FP8 && SHORT ? 144 : 128,
                         launch = (load + math + 15) / 16 * 8;
};
constexpr int SMALL_SHORT_T = 8; /* steps of at most this many tokens take SHORT */
constexpr int SMALL_RC_T = 8;    /* fp8 steps of at least this many tokens: b12x_small_rc_kernel */
enum { SB_MATH = 1, SB_LOAD = 2, SB_FULL = 3, SB_EMPTY = 7 }; /* FULL/EMPTY + stage, stage < 4 */

__device__ __forceinline__ void math_sync()
{
    bar_sync(SB_MATH, NTHREADS);
}

__device__ __forceinline__ void load_sync()
{
    bar_sync(SB_LOAD, NTHREADS);
}

/* The start of both small-head kernels: the block's chunk, and its
 * physical slots resolved into s_slot by all 512 threads (before the
 * dependency wait: load_query's comment says why that is safe), the
 * chunk's block count that of the compacted slots (resolve_slots, its
 * scan words at s_scan).  The
 * block's 16 head rows start 16 x blockIdx.y rows into head tile
 * a.tile_base: a step of more than 16 heads can run as several 16-row
 * tiles (step_tiled), one of <= 16 heads runs as one. */
__device__ __forceinline__ b12x::Chunk small_start(const AttendArgs &a, int32_t *s_slot, int32_t *s_scan)
{
    b12x::Chunk ck = b12x::chunk_of(a, HEAD_TILE, 16);
    ck.h0 = a.tile_base * HEAD_TILE + 16 * (int)blockIdx.y;
    ck.rows = min(16, a.H - ck.h0);
    B12X_PROF_SEQ_ENTER(0);
    B12X_PROF_MAIN(0, prof_gt());
    B12X_PROF_MAIN(6, clock64());
    ck.nblk = b12x::resolve_slots<SMALL_THREADS>(a, ck.t, ck.split, ck.nblk * BN, s_slot, s_scan);
    B12X_PROF_MAIN(1, clock64());
    return ck;
}

/* The natural-log LSE of head row h of token t from its running maximum
 * m (log2 units) and sum l: to the output, or with splits to the
 * workspace row of chunk `split`. */
__device__ __forceinline__ void store_row_lse(const AttendArgs &a, int t, int h, int split, float m, float l)
{
    const float lse = l > 0.0f ? (m + log2f(l)) * LN2 : -INFINITY;
    if (a.splits == 1) {
        if (a.lse)
            a.lse[(int64_t)h * a.l_sh + (int64_t)t * a.l_st] = lse;
    } else {
        a.ws_lse[((int64_t)split * a.T + t) * a.H + h] = lse;
    }
}

/* One block's softmax step of the small-head kernels for row srow, slots
 * sc2 and sc2 + 1 (a half-warp per row): the NP partial score tiles at
 * `part` (rows of s_ld floats) summed, empty slots -inf, e0 and e1 the
 * exp2 of the scores against the running maximum m_run; returns alpha, the
 * factor for what came before.  Lazy maximum: the row keeps its running
 * maximum until a score passes it by more than 2^8 (then the whole warp
 * takes the row maxima), so the probabilities stay <= 256 and most blocks
 * need no reduction; each lane sums its own probabilities, reduced once
 * after the loop. */
template <int NP>
__device__ __forceinline__ float lazy_softmax(const float *part, int s_ld, int srow, int sc2, const int32_t *slots,
                                              float scale_log2, float &m_run, float &e0, float &e1)
{
    float v0 = 0.0f, v1 = 0.0f;
#pragma unroll
    for (int w = 0; w < NP; w++) {
        const float2 p = *reinterpret_cast<const float2 *>(part + (w * 16 + srow) * s_ld + sc2);
        v0 += p.x;
        v1 += p.y;
    }
    v0 = slots[sc2] >= 0 ? v0 * scale_log2 : -INFINITY;
    v1 = slots[sc2 + 1] >= 0 ? v1 * scale_log2 : -INFINITY;
    float alpha = 1.0f;
    if (__any_sync(0xffffffffu, fmaxf(v0, v1) > m_run + 8.0f)) {
        float mx = fmaxf(v0, v1);
#pragma unroll
        for (int d = 8; d >= 1; d >>= 1)
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, d));
        const float mnew = fmaxf(m_run, mx);
        alpha = exp2f(m_run - (mnew == -INFINITY ? 0.0f : mnew));
        m_run = mnew;
    }
    const float base = m_run == -INFINITY ? 0.0f : m_run;
    e0 = exp2f(v0 - base);
    e1 = exp2f(v1 - base);
    return alpha;
}

/* IP: the instantiation that combines in place (a.bar set, splits > 1);
 * the others are the kernels without that tail.  The fp8 SHORT one
 * launches with 112 registers a thread instead of 104 (still one block a
 * multiprocessor; the setmaxnreg split is unchanged): at 104 ptxas
 * spilled 4 bytes with the tail. */
template <bool FP8, bool SHORT, bool IP, bool HALF = false>
__global__ void __maxnreg__((SmallRegs<FP8, SHORT>::launch + (IP && FP8 && SHORT ? 8 : 0)))
    b12x_small_kernel(const AttendArgs a)
{
    static_assert(!HALF || (SHORT && !IP), "column halves: short steps, combine kernel");
    using S = SmallSmem<FP8, SHORT>;
    extern __shared__ __align__(128) uint8_t smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint32_t sbase = smem_u32(smem);
    int32_t *s_slot = reinterpret_cast<int32_t *>(smem + S::OFF_SLOT);
    float *s_part = reinterpret_cast<float *>(smem + S::OFF_S);
    float *s_stat = reinterpret_cast<float *>(smem + S::OFF_STAT);
    b12x::Chunk ck = small_start(a, s_slot, reinterpret_cast<int32_t *>(smem + S::OFF_SCAN));
    /* HALF: the block's y index picks half `half` of the 512 output
     * columns (one tile of <= 16 heads from tile_base): the scores and
     * the softmax of both halves are the same, P.V and the partial write
     * are the half's */
    const int half = HALF ? (int)blockIdx.y : 0;
    if constexpr (HALF) {
        ck.h0 = a.tile_base * HEAD_TILE;
        ck.rows = min(16, a.H - ck.h0);
    }
    const int t = ck.t, h0 = ck.h0, rows = ck.rows, split = ck.split, nblk = ck.nblk;
    /* n-tiles of 8 output columns a math warp: columns [8 NC warp, 8 NC
     * warp + 8 NC) of the block's (HALF: of half `half`) */
    constexpr int NC = HALF ? 4 : 8;

    constexpr int NS = S::KV_STAGES;
#ifdef B12X_PROFILE
    unsigned long long pacc[PROF_LOOP] = {}, ptick = 0;
#endif

    if (tid >= NTHREADS) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(SmallRegs<FP8, SHORT>::load));
        /* Load warps: the gathers (and fp8 conversions) ahead of the math.
         * They never wait for the previous kernel: they read only what
         * the stream contract lets a block read early and write only
         * shared memory. */
        const int pt = tid - NTHREADS;
#ifdef B12X_PROFILE
        ptick = clock64();
#endif
        /* fp8: raw block j in raw stage j % NR, NR - 1 blocks ahead of the
         * conversion into stage j % NS; bf16: block j in stage j % NS,
         * NS - 1 blocks ahead of the math.  One commit group a block. */
        constexpr int N = FP8 ? S::RAW_STAGES : NS;
        auto issue = [&](int j) {
#if defined(B12X_PROBE) && B12X_PROBE == 1
            /* probe (wrong values, timing only): no gathers past the first
             * stages, so the loop runs on stale data without DRAM traffic */
            if (j < nblk && j < N) {
#else
            if (j < nblk) {
#endif
                if constexpr (FP8)
                    gather_fp8(a, s_slot + j * BN, sbase + S::OFF_RAW + (j % N) * S::RAW_STAGE, pt);
                else
                    gather_bf16(a, s_slot + j * BN, sbase + S::OFF_KV + (j % N) * S::KV_STAGE, pt);
            }
            cp_async_commit();
        };
#pragma unroll
        for (int i = 0; i < N; i++)
            issue(i);
        for (int j = 0; j < nblk; j++) {
            if (j == 0)
                cp_async_wait<N - 1>();
            else
                cp_async_wait<N - 2>();
            load_sync(); /* block j landed for all (fp8: and block j - 1 converted by all) */
            B12X_PROF_TICK(pacc, ptick, 6);
            if constexpr (FP8) {
                if (j >= 1)
                    issue(j - 1 + N); /* into block j - 1's raw stage */
                B12X_PROF_TICK(pacc, ptick, 2);
                if (j >= NS)
                    bar_sync(SB_EMPTY + j % NS, SMALL_THREADS); /* block j - NS done */
                B12X_PROF_TICK(pacc, ptick, 7);
                convert_fp8(smem + S::OFF_RAW + (j % N) * S::RAW_STAGE, sbase + S::OFF_KV + (j % NS) * S::KV_STAGE,
                            pt);
                bar_arrive(SB_FULL + j % NS, SMALL_THREADS);
                B12X_PROF_TICK(pacc, ptick, 1);
            } else {
                bar_arrive(SB_FULL + j % NS, SMALL_THREADS);
                if (j >= 1 && j - 1 + NS < nblk)
                    bar_sync(SB_EMPTY + (j - 1) % NS, SMALL_THREADS); /* block j - 1 done */
                B12X_PROF_TICK(pacc, ptick, 7);
                if (j >= 1)
                    issue(j - 1 + NS); /* into block j - 1's stage (empty past the end) */
                B12X_PROF_TICK(pacc, ptick, 2);
            }
        }
#ifdef B12X_PROFILE
        if (pt == 0 && B12X_PROF_BLK() < PROF_BLOCKS)
            for (int k = 1; k < PROF_LOOP; k++)
                if (k == 1 || k == 2 || k >= 6)
                    b12x_prof_loop[B12X_PROF_BLK()][k] = pacc[k];
#endif
        return;
    }

    /* Math warps: the query after the dependency wait, then the blocks as
     * the load warps hand them over. */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(SmallRegs<FP8, SHORT>::math));
    grid_dep_wait();
    grid_dep_launch();
    B12X_PROF_SEQ(0, 1);
    load_query(a, sbase, t, h0, rows, 16);
    B12X_PROF_MAIN(2, clock64());

    /* This warp's share of the scores: slots [16 sg, 16 sg + 16) over the
     * nine k16 steps [9 kq, 9 kq + 9) of the 576 dims. */
    const int sg = warp & 1, kq = warp >> 1, ks0 = 9 * kq;
    const int r4 = lane >> 2, q4 = lane & 3, sw = lane & 7;
    uint32_t qa[9][4];
    float o[NC][4];
#pragma unroll
    for (int i = 0; i < NC; i++)
        o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    /* Softmax state of row srow: the running maximum (the same in the 16
     * lanes of a half-warp) and this lane's part of the row sum. */
    const int srow = tid >> 4, sc2 = (tid & 15) * 2;
    float m_run = -INFINITY, l_run = 0.0f;

    cp_async_wait<0>();
    math_sync(); /* the query, from every math thread's copies */
#ifdef B12X_PROFILE
    ptick = clock64();
#endif
    for (int j = 0; j < nblk; j++) {
        bar_sync(SB_FULL + j % NS, SMALL_THREADS);
        B12X_PROF_TICK(pacc, ptick, 0);
        const uint32_t kvb = sbase + S::OFF_KV + (j % NS) * S::KV_STAGE;
#if defined(B12X_PROBE) && B12X_PROBE == 2
        /* probe (wrong values, timing only): no math, the stages are
         * handed straight back: the data supply alone */
        if (j + NS < nblk)
            bar_arrive(SB_EMPTY + j % NS, SMALL_THREADS);
        continue;
#endif
        if (j == 0) {
            const uint32_t qrow = sbase + (lane & 15) * ROW_BYTES;
#pragma unroll
            for (int s = 0; s < 9; s++)
                ldsm_x4(qa[s], qrow + (((2 * (ks0 + s) + (lane >> 4)) ^ sw) << 4));
            B12X_PROF_MAIN(3, clock64());
        }

        /* Partial scores over this warp's dims: 16 rows x 16 slots, two
         * accumulators per n-tile (even and odd k-steps) so the chains of
         * dependent mma are short. */
        float sacc[2][2][4];
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 2; e++)
                sacc[nt][e][0] = sacc[nt][e][1] = sacc[nt][e][2] = sacc[nt][e][3] = 0.0f;
        {
            const uint32_t krow = kvb + (16 * sg + (lane & 7) + ((lane >> 4) << 3)) * ROW_BYTES;
#pragma unroll
            for (int s = 0; s < 9; s++) {
                const int piece = 2 * (ks0 + s) + ((lane >> 3) & 1);
                uint32_t b[4];
                ldsm_x4(b, krow + ((piece ^ sw) << 4));
                mma_bf16(sacc[0][s & 1], qa[s], b[0], b[1]);
                mma_bf16(sacc[1][s & 1], qa[s], b[2], b[3]);
            }
        }
        {
            float *sp = s_part + kq * 16 * S::S_LD + 16 * sg;
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
#pragma unroll
                for (int i = 0; i < 4; i++)
                    sacc[nt][0][i] += sacc[nt][1][i];
                const int c = nt * 8 + 2 * q4;
                *reinterpret_cast<float2 *>(sp + r4 * S::S_LD + c) =
                    make_float2(sacc[nt][0][0], sacc[nt][0][1]);
                *reinterpret_cast<float2 *>(sp + (r4 + 8) * S::S_LD + c) =
                    make_float2(sacc[nt][0][2], sacc[nt][0][3]);
            }
        }
        B12X_PROF_TICK(pacc, ptick, 3);
        math_sync();

        /* Softmax: row srow, slots sc2 and sc2 + 1. */
        {
            float e0, e1;
            const float alpha =
                lazy_softmax<4>(s_part, S::S_LD, srow, sc2, s_slot + j * BN, a.scale_log2, m_run, e0, e1);
            const uint32_t p = pack_bf16(e0, e1);
            l_run = l_run * alpha + (bf16_lo(p) + bf16_hi(p));
            *reinterpret_cast<uint32_t *>(smem + S::OFF_P + srow * 64 +
                                          (((sc2 >> 3) ^ ((srow >> 1) & 3)) << 4) + (sc2 & 7) * 2) = p;
            if ((tid & 15) == 0)
                s_stat[srow] = alpha;
        }
        math_sync();
        B12X_PROF_TICK(pacc, ptick, 4);

        /* O[16 x 8NC] (this warp's columns) = alpha * O + P[16 x 32] . V[32 x 8NC]. */
        {
            const float al0 = s_stat[r4], al1 = s_stat[r4 + 8];
#pragma unroll
            for (int nt = 0; nt < NC; nt++) {
                o[nt][0] *= al0;
                o[nt][1] *= al0;
                o[nt][2] *= al1;
                o[nt][3] *= al1;
            }
            const int prow = lane & 15;
            const uint32_t pbase = sbase + S::OFF_P + prow * 64;
#pragma unroll
            for (int ks = 0; ks < 2; ks++) {
                uint32_t pa[4];
                ldsm_x4(pa, pbase + (((2 * ks + (lane >> 4)) ^ ((prow >> 1) & 3)) << 4));
                const uint32_t vrow = kvb + (16 * ks + (lane & 7) + (lane & 8)) * ROW_BYTES;
#pragma unroll
                for (int np = 0; np < NC / 2; np++) {
                    uint32_t b[4];
                    ldsm_x4_trans(b, vrow + ((((HALF ? KV_L / 16 * half + NC * warp : 8 * warp) + 2 * np +
                                               (lane >> 4)) ^ sw) << 4));
                    mma_bf16(o[2 * np], pa, b[0], b[1]);
                    mma_bf16(o[2 * np + 1], pa, b[2], b[3]);
                }
            }
        }
        if (j + NS < nblk) {
#ifdef B12X_RACECHECK
            /* compute-sanitizer racecheck orders a thread's shared-memory
             * reads only up to its last bar.sync, not up to its bar.arrive,
             * and reports the P.V reads against the next block's writes
             * into this stage (docs/attention.md); this barrier makes a
             * build for racecheck clean.  It costs fp8 2-3% at T >= 16. */
            math_sync();
#endif
            bar_arrive(SB_EMPTY + j % NS, SMALL_THREADS); /* the load warps reuse the stage */
        }
        B12X_PROF_TICK(pacc, ptick, 5);
    }
#ifdef B12X_PROFILE
    if (tid == 0 && B12X_PROF_BLK() < PROF_BLOCKS)
        for (int k = 0; k < 6; k++)
            if (k == 0 || k >= 3)
                b12x_prof_loop[B12X_PROF_BLK()][k] = pacc[k];
#endif

#pragma unroll
    for (int d = 8; d >= 1; d >>= 1) /* the row sum over its 16 lanes */
        l_run += __shfl_xor_sync(0xffffffffu, l_run, d);
    if ((tid & 15) == 0) {
        s_stat[16 + srow] = m_run;
        s_stat[32 + srow] = l_run;
    }
    math_sync(); /* also: every warp is done with the last block's stage */
    B12X_PROF_MAIN(4, clock64());
    B12X_PROF_TAIL(10, o[NC - 1][3]);

    /* Normalise; the bf16 output is staged in the (idle) KV stages and
     * written as whole rows, 8 bytes a lane. */
    const float l0 = s_stat[32 + r4], l1 = s_stat[32 + r4 + 8];
    const float inv0 = l0 > 0.0f ? b12x::rcp_approx(l0) : 0.0f, inv1 = l1 > 0.0f ? b12x::rcp_approx(l1) : 0.0f;
    B12X_PROF_TAIL(11, inv0 + inv1);
    const int col0 = 64 * warp + 2 * q4;
    if (!HALF && a.splits == 1) {
        __nv_bfloat16 *st = reinterpret_cast<__nv_bfloat16 *>(smem + S::OFF_KV);
#pragma unroll
        for (int nt = 0; nt < NC; nt++) {
            *reinterpret_cast<uint32_t *>(st + r4 * S::O_LD + col0 + nt * 8) =
                pack_bf16(o[nt][0] * inv0, o[nt][1] * inv0);
            *reinterpret_cast<uint32_t *>(st + (r4 + 8) * S::O_LD + col0 + nt * 8) =
                pack_bf16(o[nt][2] * inv1, o[nt][3] * inv1);
        }
        math_sync();
        for (int u = tid; u < rows * (KV_L / 4); u += NTHREADS) {
            const int r = u / (KV_L / 4), c = (u - r * (KV_L / 4)) * 4;
            *reinterpret_cast<uint2 *>(a.out + (int64_t)(h0 + r) * a.o_sh + (int64_t)t * a.o_st + c) =
                *reinterpret_cast<const uint2 *>(st + r * S::O_LD + c);
        }
    } else {
        /* bf16 partial straight from the accumulators (store_row16: four
         * lanes write a whole sector of a row), no staging */
        const int64_t row0 = ((int64_t)split * a.T + t) * a.H + h0;
        __nv_bfloat16 *p0 = a.ws_o + (row0 + r4) * KV_L + (HALF ? KV_L / 2 * half + 8 * NC * warp : 64 * warp),
                      *p1 = p0 + 8 * KV_L;
#pragma unroll
        for (int k = 0; k < NC / 2; k++) {
            store_row16(p0 + 16 * k, pack_bf16(o[2 * k][0] * inv0, o[2 * k][1] * inv0),
                        pack_bf16(o[2 * k + 1][0] * inv0, o[2 * k + 1][1] * inv0), r4 < rows);
            store_row16(p1 + 16 * k, pack_bf16(o[2 * k][2] * inv1, o[2 * k][3] * inv1),
                        pack_bf16(o[2 * k + 1][2] * inv1, o[2 * k + 1][3] * inv1), r4 + 8 < rows);
        }
    }
    if (tid < rows && half == 0)
        store_row_lse(a, t, h0 + tid, split, s_stat[16 + tid], s_stat[32 + tid]);
    B12X_PROF_MAIN(5, clock64());
    if constexpr (IP)
        b12x::combine_in_kernel<NTHREADS, 16>(a, t, h0, rows, split, tid, [] { math_sync(); },
                                              [&] { B12X_PROF_MAIN(8, clock64()); },
                                              reinterpret_cast<float *>(smem), /* the query's */
                                              [&](int k, float v) {
                                                  B12X_PROF_MAIN(10 + k, mlart_clock_after(v));
                                              });
    B12X_PROF_MAIN(9, clock64());
    B12X_PROF_MAIN(7, prof_gt());
    B12X_PROF_SEQ(0, 2);
}

/* ---- fp8 at <= 16 heads, steps of >= SMALL_RC_T tokens -----------------
 * b12x_small_rc_kernel: the small-head kernel's 16 warps, rearranged so
 * that each e4m3 value is converted once, in registers, and never written
 * back to shared memory, and so that the softmax of one block overlaps the
 * scores of the next.  Math warp w owns dims [64w, 64w + 64) (half of scale
 * tile w / 2) for both products:
 *   scores: the warp's partial 16 x 32 scores over its 64 dims, K straight
 *           from the raw stage (one 16-byte load per slot a lane, e4m3 ->
 *           bf16 without the scale, which multiplies the fp32 partial per
 *           slot), plus a quarter of the rope (k16 step w / 2, 16 of the
 *           slots); the eight partial tiles go to shared memory;
 *   softmax: on the load warps (they only gather besides), as in
 *           b12x_small_kernel, and P' = P x scale(slot, tile) for each of
 *           the four scale tiles;
 *   P.V:    O[16 x 64 dims] += P'(tile w / 2) . V, V's fragments the
 *           scores' K fragments transposed in registers (movmatrix).
 * The math warps run scores(j + 1) while the load warps take softmax(j),
 * then P.V(j): partial tiles, P' tiles and alphas are double-buffered.
 * Inside a 16-dim k-step the dims are permuted (the same for the query):
 * lane q's k slots 2q, 2q + 1, 2q + 8, 2q + 9 of k-step s are dims 16q +
 * 4s + 0..3, so a lane's 16-byte load covers its four k-steps, and after
 * the transposition lane q holds the output dims 16q + 0..15 of its rows.
 * Stages hold raw records, swizzled for those loads: e4m3 rows of 512
 * bytes (16-byte piece c of row r at c ^ rc_esw(r)), the four scales a
 * row, the rope rows of 128 bytes (piece c at c ^ (r & 7)).  Slower than
 * b12x_small_kernel at T <= 4 (one or two blocks a chunk: the hand-over to
 * the load warps' softmax adds latency), hence SMALL_RC_T. */
constexpr int RC_STAGES = 6;
/* Named barriers: FULL + stage (load -> math: block landed), PR + buffer
 * (math -> load: scores stored, and the stage read), PP + buffer (load ->
 * math: P' and alpha stored, the scores read), END (load -> math: row
 * maxima and sums). */
enum { RC_FULL = 3, RC_PR = RC_FULL + RC_STAGES, RC_PP = RC_PR + 2, RC_END = RC_PP + 2 };
struct RcSmem {
    static constexpr int Q_BYTES = 16 * ROW_BYTES;
    static constexpr int SC_OFF = BN * KV_L;                     /* e4m3 rows first */
    static constexpr int ROPE_OFF = SC_OFF + BN * 16;            /* four fp32 scales a row */
    static constexpr int STAGE = ROPE_OFF + BN * 2 * B12X_ROPE;  /* = BN * FP8_BYTES */
    static constexpr int S_LD = BN + 8;
    static constexpr int S_BUF = 8 * 16 * S_LD * 4;              /* eight partial score tiles */
    static constexpr int P_BUF = 4 * 16 * BN * 2;                /* four P' tiles */
    static constexpr int OFF_ST = Q_BYTES;
    static constexpr int OFF_S = OFF_ST + RC_STAGES * STAGE;     /* two buffers each */
    static constexpr int OFF_P = OFF_S + 2 * S_BUF;
    static constexpr int OFF_PST = OFF_P + 2 * P_BUF;            /* alpha per row */
    static constexpr int OFF_STAT = OFF_PST + 2 * 16 * 4;        /* final m, l per row */
    static constexpr int OFF_SLOT = OFF_STAT + 32 * 4;
    /* resolve_slots' scan words (16 warps): the final row statistics */
    static constexpr int OFF_SCAN = OFF_STAT;
    static_assert(32 * 4 >= 2 * NTHREADS / 32 * 4, "scan words fit");
    static constexpr size_t bytes(int chunk_slots) { return (size_t)OFF_SLOT + 4u * chunk_slots; }
    static_assert(STAGE == BN * FP8_BYTES, "a stage holds a block's records");
};
static_assert(RcSmem::bytes(B12X_MAX_TOPK) <= 232448, "over the sm_90 shared memory per block");
/* The in-place combine takes the query's shared memory (all three kernels
 * keep it at offset 0 and have read it for the last time by then). */
static_assert(RcSmem::Q_BYTES >= b12x::combine_smem(NTHREADS) &&
                  SmallSmem<false, false>::Q_BYTES >= b12x::combine_smem(NTHREADS) &&
                  Smem<false, 2>::Q_BYTES >= b12x::combine_smem(NTHREADS),
              "the in-place combine's scratch fits in the query's shared memory");
static_assert(RC_END <= 15, "named barriers");
struct RcRegs {
    static constexpr int load = 72, math = 176, launch = (load + math + 15) / 16 * 8;
};

/* e4m3 row swizzle: rows 2p and 2p + 1 land their four-piece groups in
 * different halves of the 128 bytes, so a quarter-warp's two rows do not
 * share banks. */
__device__ __forceinline__ int rc_esw(int r)
{
    return ((r & 1) << 2) | ((r >> 1) & 3);
}

__device__ __forceinline__ void gather_rc(const AttendArgs &a, const int32_t *slots, uint32_t st, int pt)
{
    constexpr int PIECES = FP8_BYTES / 16; /* 41: 32 e4m3, 1 scales, 8 rope */
    const int r = pt >> 3, q = pt & 7;
    const int slot = slots[r];
    const uint8_t *src = a.kv + (slot >= 0 ? (int64_t)slot * a.kv_row + q * 16 : 0);
    const int n = slot >= 0 ? 16 : 0;
#pragma unroll
    for (int i = 0; i < 6; i++) {
        const int p = q + 8 * i;
        if (p < PIECES) {
            uint32_t dst;
            if (p < 32)
                dst = st + r * KV_L + ((p ^ rc_esw(r)) << 4);
            else if (p == 32)
                dst = st + RcSmem::SC_OFF + r * 16;
            else
                dst = st + RcSmem::ROPE_OFF + r * 128 + (((p - 33) ^ (r & 7)) << 4);
            cp_async16(dst, src + (slot >= 0 ? 128 * i : 0), n);
        }
    }
}

__device__ __forceinline__ uint4 lds128(uint32_t addr)
{
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr));
    return v;
}

__device__ __forceinline__ float lds32f(uint32_t addr)
{
    float v;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
    return v;
}

__device__ __forceinline__ uint32_t movm_t(uint32_t x)
{
    uint32_t y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

template <bool IP> __device__ __forceinline__ void small_rc(const AttendArgs &a)
{
    using S = RcSmem;
    extern __shared__ __align__(128) uint8_t smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint32_t sbase = smem_u32(smem);
    int32_t *s_slot = reinterpret_cast<int32_t *>(smem + S::OFF_SLOT);
    float *s_stat = reinterpret_cast<float *>(smem + S::OFF_STAT);
    const b12x::Chunk ck = small_start(a, s_slot, reinterpret_cast<int32_t *>(smem + S::OFF_SCAN));
    const int t = ck.t, h0 = ck.h0, rows = ck.rows, split = ck.split, nblk = ck.nblk;
    constexpr int R = RC_STAGES;

    if (tid >= NTHREADS) {
        /* Load warps: the gathers R blocks ahead, and the softmax of each
         * block once the math warps have its scores. */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(RcRegs::load));
        const int pt = tid - NTHREADS;
        const int srow = pt >> 4, sc2 = (pt & 15) * 2;
        float m_run = -INFINITY, l_run = 0.0f;
        auto issue = [&](int j) {
#if defined(B12X_PROBE) && B12X_PROBE == 1
            if (j < nblk && j < R) /* probe: no gathers past the first stages */
#else
            if (j < nblk)
#endif
                gather_rc(a, s_slot + j * BN, sbase + S::OFF_ST + (j % R) * S::STAGE, pt);
            cp_async_commit();
        };
#pragma unroll
        for (int i = 0; i < R; i++)
            issue(i);
        cp_async_wait<R - 1>();
        load_sync(); /* block 0 landed for all */
        bar_arrive(RC_FULL, SMALL_THREADS);
        for (int j = 0; j < nblk; j++) {
            const uint32_t stb = sbase + S::OFF_ST + (j % R) * S::STAGE;
            /* Block j + 1 to the math warps first, so that its scores
             * overlap this softmax; then block j - 1 + R into the stage of
             * block j - 1, which every thread is done with: the math warps
             * before the scores barrier of j - 1, the load warps (its
             * softmax) before load_sync. */
            if (j + 1 < nblk) {
                if (j == 0)
                    cp_async_wait<R - 2>();
                else
                    cp_async_wait<R - 3>();
                load_sync(); /* block j + 1 landed for all */
                bar_arrive(RC_FULL + (j + 1) % R, SMALL_THREADS);
            } else if (j >= 1) {
                load_sync();
            }
            if (j >= 1)
                issue(j - 1 + R);
            /* Softmax of block j: row srow, slots sc2 and sc2 + 1 (the
             * lazy maximum of b12x_small_kernel), P' = P x scale for each
             * scale tile, alpha for the math warps. */
            bar_sync(RC_PR + (j & 1), SMALL_THREADS);
            const float *sp = reinterpret_cast<const float *>(smem + S::OFF_S + (j & 1) * S::S_BUF);
            float e0, e1;
            const float alpha = lazy_softmax<8>(sp, S::S_LD, srow, sc2, s_slot + j * BN, a.scale_log2, m_run, e0, e1);
            l_run = l_run * alpha + (e0 + e1);
            const uint4 ps0 = lds128(stb + S::SC_OFF + sc2 * 16), ps1 = lds128(stb + S::SC_OFF + (sc2 + 1) * 16);
            const float s0[4] = {__uint_as_float(ps0.x), __uint_as_float(ps0.y), __uint_as_float(ps0.z),
                                 __uint_as_float(ps0.w)};
            const float s1[4] = {__uint_as_float(ps1.x), __uint_as_float(ps1.y), __uint_as_float(ps1.z),
                                 __uint_as_float(ps1.w)};
            uint8_t *pp = smem + S::OFF_P + (j & 1) * S::P_BUF + srow * 64 +
                          (((sc2 >> 3) ^ ((srow >> 1) & 3)) << 4) + (sc2 & 7) * 2;
#pragma unroll
            for (int i = 0; i < 4; i++)
                *reinterpret_cast<uint32_t *>(pp + i * 16 * BN * 2) = pack_bf16(e0 * s0[i], e1 * s1[i]);
            if ((pt & 15) == 0)
                reinterpret_cast<float *>(smem + S::OFF_PST)[(j & 1) * 16 + srow] = alpha;
#ifdef B12X_RACECHECK
            load_sync();
#endif
            bar_arrive(RC_PP + (j & 1), SMALL_THREADS);
        }
#pragma unroll
        for (int d = 8; d >= 1; d >>= 1) /* the row sum over its 16 lanes */
            l_run += __shfl_xor_sync(0xffffffffu, l_run, d);
        if ((pt & 15) == 0) {
            s_stat[srow] = m_run;
            s_stat[16 + srow] = l_run;
        }
        bar_arrive(RC_END, SMALL_THREADS); /* to the math warps' epilogue */
        return;
    }

    /* Math warps: the scores of block j + 1 while the load warps take the
     * softmax of block j, then P.V of block j. */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(RcRegs::math));
    grid_dep_wait();
    grid_dep_launch();
    B12X_PROF_SEQ(0, 1);
    load_query(a, sbase, t, h0, rows, 16);
    B12X_PROF_MAIN(2, clock64());

    const int g = lane >> 2, q4 = lane & 3, tile = warp >> 1;
    const int esw = rc_esw(g); /* rows 8 nt + g */
    float o[4][2][4];
#pragma unroll
    for (int s = 0; s < 4; s++)
#pragma unroll
        for (int h = 0; h < 2; h++)
            o[s][h][0] = o[s][h][1] = o[s][h][2] = o[s][h][3] = 0.0f;

    cp_async_wait<0>();
    math_sync(); /* the query, from every math thread's copies */
    /* The query's fragments for the warp's dims (permuted as above) and
     * for its rope step. */
    uint32_t qa[4][4], qr[4];
    {
        const int c0 = 8 * warp + 2 * q4;
        const uint4 l0 = lds128(sbase + sw_off(g, c0)), l1 = lds128(sbase + sw_off(g, c0 + 1));
        const uint4 u0 = lds128(sbase + sw_off(g + 8, c0)), u1 = lds128(sbase + sw_off(g + 8, c0 + 1));
        const uint32_t wl[8] = {l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, l1.z, l1.w};
        const uint32_t wu[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
#pragma unroll
        for (int s = 0; s < 4; s++) {
            qa[s][0] = wl[2 * s];
            qa[s][1] = wu[2 * s];
            qa[s][2] = wl[2 * s + 1];
            qa[s][3] = wu[2 * s + 1];
        }
        ldsm_x4(qr, sbase + (lane & 15) * ROW_BYTES + (((2 * (32 + tile) + (lane >> 4)) ^ (lane & 7)) << 4));
    }

    /* Block j's stage: the K fragments (e4m3 -> bf16, kept for its P.V),
     * the scales of the accumulator's slots, the rope fragments. */
    struct Frag {
        uint32_t kf[4][4][2];
        float sc[4][2];
        uint32_t rb[4];
    };
    auto sload = [&](int j, Frag &f) {
        bar_sync(RC_FULL + j % R, SMALL_THREADS);
        const uint32_t stb = sbase + S::OFF_ST + (j % R) * S::STAGE;
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            const uint4 x = lds128(stb + (8 * nt + g) * KV_L + (((4 * warp + q4) ^ esw) << 4));
            const uint32_t xw[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int s = 0; s < 4; s++) {
                f.kf[nt][s][0] = b12x::e4m3x2_to_bf16x2(xw[s] & 0xffffu, 1.0f); /* exact */
                f.kf[nt][s][1] = b12x::e4m3x2_to_bf16x2(xw[s] >> 16, 1.0f);
            }
            f.sc[nt][0] = lds32f(stb + S::SC_OFF + (8 * nt + 2 * q4) * 16 + 4 * tile);
            f.sc[nt][1] = lds32f(stb + S::SC_OFF + (8 * nt + 2 * q4 + 1) * 16 + 4 * tile);
        }
        const int r = 16 * (warp & 1) + (lane & 7) + ((lane >> 4) << 3);
        ldsm_x4(f.rb, stb + S::ROPE_OFF + r * 128 + (((2 * tile + ((lane >> 3) & 1)) ^ (lane & 7)) << 4));
    };
    /* Block j's partial scores over the warp's dims into buffer j & 1. */
    auto smma = [&](int j, const Frag &f) {
        float sacc[4][4], racc[2][4];
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
            sacc[nt][0] = sacc[nt][1] = sacc[nt][2] = sacc[nt][3] = 0.0f;
#pragma unroll
        for (int i = 0; i < 2; i++)
            racc[i][0] = racc[i][1] = racc[i][2] = racc[i][3] = 0.0f;
#pragma unroll
        for (int s = 0; s < 4; s++)
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
                mma_bf16(sacc[nt], qa[s], f.kf[nt][s][0], f.kf[nt][s][1]);
        mma_bf16(racc[0], qr, f.rb[0], f.rb[1]);
        mma_bf16(racc[1], qr, f.rb[2], f.rb[3]);
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            sacc[nt][0] *= f.sc[nt][0];
            sacc[nt][1] *= f.sc[nt][1];
            sacc[nt][2] *= f.sc[nt][0];
            sacc[nt][3] *= f.sc[nt][1];
        }
        if (warp & 1) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                sacc[2][e] += racc[0][e];
                sacc[3][e] += racc[1][e];
            }
        } else {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                sacc[0][e] += racc[0][e];
                sacc[1][e] += racc[1][e];
            }
        }
        float *sp = reinterpret_cast<float *>(smem + S::OFF_S + (j & 1) * S::S_BUF) + warp * 16 * S::S_LD;
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            const int c = nt * 8 + 2 * q4;
            *reinterpret_cast<float2 *>(sp + g * S::S_LD + c) = make_float2(sacc[nt][0], sacc[nt][1]);
            *reinterpret_cast<float2 *>(sp + (g + 8) * S::S_LD + c) = make_float2(sacc[nt][2], sacc[nt][3]);
        }
    };
    /* O[16 x 64 dims] = alpha * O + P'(tile) . V of block j, V = K
     * transposed (movmatrix); after the load warps' barrier PP of j. */
    auto pv = [&](int j, const Frag &f) {
        const float *pst = reinterpret_cast<const float *>(smem + S::OFF_PST) + (j & 1) * 16;
        const float al0 = pst[g], al1 = pst[g + 8];
        if (__any_sync(0xffffffffu, al0 != 1.0f || al1 != 1.0f)) {
#pragma unroll
            for (int s = 0; s < 4; s++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    o[s][h][0] *= al0;
                    o[s][h][1] *= al0;
                    o[s][h][2] *= al1;
                    o[s][h][3] *= al1;
                }
        }
        const int prow = lane & 15;
        const uint32_t pbase = sbase + S::OFF_P + (j & 1) * S::P_BUF + tile * 16 * BN * 2 + prow * 64;
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            uint32_t pa[4];
            ldsm_x4(pa, pbase + (((2 * kk + (lane >> 4)) ^ ((prow >> 1) & 3)) << 4));
#pragma unroll
            for (int s = 0; s < 4; s++)
#pragma unroll
                for (int h = 0; h < 2; h++)
                    mma_bf16(o[s][h], pa, movm_t(f.kf[2 * kk][s][h]), movm_t(f.kf[2 * kk + 1][s][h]));
        }
    };
    /* The scores barrier of block j.  compute-sanitizer racecheck orders
     * a thread's shared-memory reads only up to its last bar.sync, not up
     * to its bar.arrive (docs/attention.md), so a build for racecheck
     * (-DB12X_RACECHECK) adds a barrier of the math warps first; likewise
     * on the load warps' side. */
    auto pr_arrive = [&](int j) {
#ifdef B12X_RACECHECK
        math_sync();
#endif
        bar_arrive(RC_PR + (j & 1), SMALL_THREADS);
    };
    /* The scores of block j + 1 while the load warps take the softmax of
     * block j, then P.V of block j after their barrier. */
    Frag fa, fb;
    for (int j = 0; j < nblk; j += 2) {
        sload(j, fa);
        smma(j, fa);
        pr_arrive(j);
        if (j >= 1) {
            bar_sync(RC_PP + ((j - 1) & 1), SMALL_THREADS);
            pv(j - 1, fb);
        }
        if (j + 1 < nblk) {
            sload(j + 1, fb);
            smma(j + 1, fb);
            pr_arrive(j + 1);
        }
        bar_sync(RC_PP + (j & 1), SMALL_THREADS);
        pv(j, fa);
    }
    if (nblk > 0 && nblk % 2 == 0) {
        bar_sync(RC_PP + ((nblk - 1) & 1), SMALL_THREADS);
        pv(nblk - 1, fb);
    }

    bar_sync(RC_END, SMALL_THREADS); /* the load warps' row maxima and sums */
    B12X_PROF_MAIN(4, clock64());
    B12X_PROF_TAIL(10, o[3][1][3]);

    /* Lane (g, q4) holds dims 64 warp + 16 q4 + 4 s + 2 h + i of rows g
     * and g + 8: o[s][h][i] and o[s][h][2 + i]. */
    const float l0 = s_stat[16 + g], l1 = s_stat[16 + g + 8];
    const float inv0 = l0 > 0.0f ? b12x::rcp_approx(l0) : 0.0f, inv1 = l1 > 0.0f ? b12x::rcp_approx(l1) : 0.0f;
    B12X_PROF_TAIL(11, inv0 + inv1);
    uint32_t w0[8], w1[8];
#pragma unroll
    for (int s = 0; s < 4; s++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            w0[2 * s + h] = pack_bf16(o[s][h][0] * inv0, o[s][h][1] * inv0);
            w1[2 * s + h] = pack_bf16(o[s][h][2] * inv1, o[s][h][3] * inv1);
        }
    const int col = 64 * warp + 16 * q4;
    if (a.splits == 1) {
        if (g < rows) {
            __nv_bfloat16 *d = a.out + (int64_t)(h0 + g) * a.o_sh + (int64_t)t * a.o_st + col;
#pragma unroll
            for (int k = 0; k < 4; k++)
                *reinterpret_cast<uint2 *>(d + 4 * k) = make_uint2(w0[2 * k], w0[2 * k + 1]);
        }
        if (g + 8 < rows) {
            __nv_bfloat16 *d = a.out + (int64_t)(h0 + g + 8) * a.o_sh + (int64_t)t * a.o_st + col;
#pragma unroll
            for (int k = 0; k < 4; k++)
                *reinterpret_cast<uint2 *>(d + 4 * k) = make_uint2(w1[2 * k], w1[2 * k + 1]);
        }
    } else {
        const int64_t row0 = ((int64_t)split * a.T + t) * a.H + h0;
        if (g < rows) {
            uint4 *d = reinterpret_cast<uint4 *>(a.ws_o + (row0 + g) * KV_L + col);
            d[0] = make_uint4(w0[0], w0[1], w0[2], w0[3]);
            d[1] = make_uint4(w0[4], w0[5], w0[6], w0[7]);
        }
        if (g + 8 < rows) {
            uint4 *d = reinterpret_cast<uint4 *>(a.ws_o + (row0 + g + 8) * KV_L + col);
            d[0] = make_uint4(w1[0], w1[1], w1[2], w1[3]);
            d[1] = make_uint4(w1[4], w1[5], w1[6], w1[7]);
        }
    }
    if (tid < rows)
        store_row_lse(a, t, h0 + tid, split, s_stat[tid], s_stat[16 + tid]);
    B12X_PROF_MAIN(5, clock64());
    if constexpr (IP)
        b12x::combine_in_kernel<NTHREADS, 16>(a, t, h0, rows, split, tid, [] { math_sync(); },
                                              [&] { B12X_PROF_MAIN(8, clock64()); },
                                              reinterpret_cast<float *>(smem)); /* the query's */
    B12X_PROF_MAIN(9, clock64());
    B12X_PROF_MAIN(7, prof_gt());
    B12X_PROF_SEQ(0, 2);
}

/* The kernel without and with the in-place combine. */
__global__ void __maxnreg__(RcRegs::launch) b12x_small_rc_kernel(const AttendArgs a)
{
    small_rc<false>(a);
}

__global__ void __maxnreg__(RcRegs::launch) b12x_small_rc_ip_kernel(const AttendArgs a)
{
    small_rc<true>(a);
}

/* out[h,t,:] = sum_z w_z * part_z / sum_z w_z with w_z = exp(lse_z - M).
 * One block per (token, head, 4L columns): groups of L lanes (4 columns
 * each) take every G-th split (G = groups of the block); each lane issues
 * all its loads (<= CB_Z partials and their LSEs, and two of the LSE row:
 * every warp reads all splits' LSEs) before it uses any, so a block costs
 * one round trip to L2.  L = 128: M is the maximum; every warp reduces it
 * and the weight sum over all splits itself (shuffles), so the groups
 * share one scale and are merged by a plain sum through shared memory.
 * L = 32: M is split 0's LSE (one broadcast word instead of the LSE row),
 * no shuffle: each thread sums its own splits' weights and the groups
 * merge those sums with their columns; a thread whose sum or columns
 * overflow (an LSE more than ~88 above split 0's) or whose split 0 is
 * empty (M = -inf makes every weight +inf) recomputes its four columns
 * with the maximum, reading every split again.  The weights are
 * independent ex2 (no branch, no chain from one split to the next).  The
 * serial form before it (a maximum per group, expf weights skipped when
 * zero, the groups rescaled one after another) took 0.9-1.0 us after its
 * loads and the call 0.2-0.9 us longer (docs/PERF.md, 2026-12-01 22:55-23:00).  The
 * launch picks L = 32 (a quarter row per block, up to 8 groups) when there
 * are few (token, head) rows, so that even one token spreads its partial
 * reads over 4 x H multiprocessors, and L = 128 (a whole row, as few groups
 * as cover the splits) otherwise, so that blocks stay few and full.  Empty
 * partials (lse -inf) weigh 0 and are never read as numbers, so 0 * NaN
 * cannot occur.  EARLY: it lets the next kernel of the stream launch
 * before its own dependency wait instead of after it (when, in
 * b12x_attend_launch_tuned). */
constexpr int CB_MAX_GROUPS = 8;
constexpr int CB_Z = MAX_SPLITS / CB_MAX_GROUPS;
static_assert(CB_MAX_GROUPS * CB_Z >= MAX_SPLITS, "combine covers every split");

/* 2^x, approximate (MUFU.EX2; subnormal results flushed; 2^-inf = 0). */
__device__ __forceinline__ float ex2_approx(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

template <int L, bool EARLY>
__global__ void __launch_bounds__(L *CB_MAX_GROUPS) b12x_combine_kernel(const AttendArgs a)
{
    static_assert(MAX_SPLITS <= 64, "a warp holds every split's LSE, two a lane");
    /* M = split 0's LSE (L = 32: measured faster there, docs/PERF.md,
     * 2026-12-02) or the maximum (L = 128: the reference form was slower) */
    constexpr bool REF = L == 32;
    __shared__ float4 s_acc[CB_MAX_GROUPS][L];
    __shared__ float s_sum[REF ? CB_MAX_GROUPS : 1];
    B12X_PROF_CB(0);
    B12X_PROF_SEQ_ENTER(1);
    /* The launch's parameters and this thread's addresses before the
     * dependency wait: a multiprocessor's first reads of the parameters
     * miss its constant cache, and here they overlap the previous kernel
     * instead of adding a round trip after it (the empty asm keeps them
     * above the wait). */
    const int t = blockIdx.x, h = blockIdx.y, S = a.splits;
    const int lane = threadIdx.x % L, grp = threadIdx.x / L, ng = blockDim.x / L, wl = threadIdx.x & 31;
    const int c = blockIdx.z * 4 * L + lane * 4;
    const int64_t zstride = (int64_t)a.T * a.H, base = (int64_t)t * a.H + h;
    const float *lse = a.ws_lse + base;
    const __nv_bfloat16 *part = a.ws_o + base * KV_L + c;
    __nv_bfloat16 *out = a.out + (int64_t)h * a.o_sh + (int64_t)t * a.o_st + c;
    float *out_lse = a.lse ? a.lse + (int64_t)h * a.l_sh + (int64_t)t * a.l_st : nullptr;
    asm volatile("" ::"l"(lse), "l"(part), "l"(out), "l"(out_lse), "l"(zstride), "r"(S));
    if constexpr (EARLY)
        grid_dep_launch(); /* the next kernel may start now: see b12x_attend_launch_tuned */
    grid_dep_wait();
    B12X_PROF_CB(2);
    B12X_PROF_SEQ(1, 1);
    B12X_PROF_CB_AT(3, clock64());
    if constexpr (!EARLY)
        grid_dep_launch();
    /* Every load first: each warp the LSEs of all splits (lane l: l and
     * l + 32) or, REF, split 0's, and each thread its splits' LSEs and
     * four columns of their partials. */
    const float la = REF ? lse[0] : wl < S ? lse[wl * zstride] : -INFINITY;
    const float lb = !REF && wl + 32 < S ? lse[(wl + 32) * zstride] : -INFINITY;
    float lz[CB_Z];
    uint2 v[CB_Z];
#pragma unroll
    for (int i = 0; i < CB_Z; i++) {
        const int z = grp + i * ng;
        lz[i] = -INFINITY;
        v[i] = make_uint2(0, 0);
        if (z < S) {
            lz[i] = lse[z * zstride];
            v[i] = *reinterpret_cast<const uint2 *>(part + z * zstride * KV_L);
        }
    }
#ifdef B12X_PROFILE
    {
        /* a finite value that depends on every load */
        unsigned dep = __float_as_uint(la) ^ __float_as_uint(lb);
#pragma unroll
        for (int i = 0; i < CB_Z; i++)
            dep ^= __float_as_uint(lz[i]) ^ v[i].x ^ v[i].y;
        const unsigned long long landed = mlart_clock_after(__uint_as_float(dep & 0x3f800000u));
        B12X_PROF_CB_AT(7, landed);
        B12X_PROF_CBW(0, landed);
    }
#endif
    /* The maximum M and the weight sum over all splits, in every warp
     * alike (no exchange between groups before the sum of their
     * columns); weights 2^(lse log2e - M log2e), all independent.  REF:
     * M = split 0's LSE, the thread's own weights summed in the loop. */
    float m = fmaxf(la, lb), sum = 0.0f;
    if constexpr (!REF) {
#pragma unroll
        for (int d = 16; d >= 1; d >>= 1)
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
    }
    const float mb = REF ? m * b12x::LOG2E : m == -INFINITY ? 0.0f : m * b12x::LOG2E;
    if constexpr (!REF) {
        sum = ex2_approx(fmaf(la, b12x::LOG2E, -mb)) + ex2_approx(fmaf(lb, b12x::LOG2E, -mb));
#pragma unroll
        for (int d = 16; d >= 1; d >>= 1)
            sum += __shfl_xor_sync(0xffffffffu, sum, d);
    }
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int i = 0; i < CB_Z; i++) {
        const bool ok = lz[i] != -INFINITY; /* an empty partial is never read as a number */
        const float w = ok ? ex2_approx(fmaf(lz[i], b12x::LOG2E, -mb)) : 0.0f;
        if constexpr (REF)
            sum += w;
        acc.x = fmaf(w, ok ? bf16_lo(v[i].x) : 0.0f, acc.x);
        acc.y = fmaf(w, ok ? bf16_hi(v[i].x) : 0.0f, acc.y);
        acc.z = fmaf(w, ok ? bf16_lo(v[i].y) : 0.0f, acc.z);
        acc.w = fmaf(w, ok ? bf16_hi(v[i].y) : 0.0f, acc.w);
    }
#ifdef B12X_PROFILE
    {
        const unsigned long long summed = mlart_clock_after(acc.x + acc.w + sum);
        B12X_PROF_CB_AT(4, summed);
        B12X_PROF_CBW(1, summed);
    }
#endif
    if (ng > 1) {
        s_acc[grp][lane] = acc;
        if (REF && lane == 0)
            s_sum[grp] = sum;
        __syncthreads();
        B12X_PROF_CB_AT(6, clock64());
        if (grp > 0)
            return;
#pragma unroll
        for (int q = 1; q < CB_MAX_GROUPS; q++)
            if (q < ng) {
                const float4 o = s_acc[q][lane];
                acc.x += o.x;
                acc.y += o.y;
                acc.z += o.z;
                acc.w += o.w;
                if constexpr (REF)
                    sum += s_sum[q];
            }
    }
    if (REF && !(fabsf(acc.x) + fabsf(acc.y) + fabsf(acc.z) + fabsf(acc.w) + sum < INFINITY)) {
        /* the exact form: the maximum over every split, then the sum */
        m = -INFINITY;
        for (int z = 0; z < S; z++)
            m = fmaxf(m, lse[z * zstride]);
        const float eb = m * b12x::LOG2E;
        sum = 0.0f;
        acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int z = 0; z < S; z++) {
            const float l = lse[z * zstride];
            if (l == -INFINITY)
                continue;
            const float w = ex2_approx(fmaf(l, b12x::LOG2E, -eb));
            const uint2 p = *reinterpret_cast<const uint2 *>(part + z * zstride * KV_L);
            sum += w;
            acc.x = fmaf(w, bf16_lo(p.x), acc.x);
            acc.y = fmaf(w, bf16_hi(p.x), acc.y);
            acc.z = fmaf(w, bf16_lo(p.y), acc.z);
            acc.w = fmaf(w, bf16_hi(p.y), acc.w);
        }
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    *reinterpret_cast<uint2 *>(out) =
        make_uint2(pack_bf16(acc.x * inv, acc.y * inv), pack_bf16(acc.z * inv, acc.w * inv));
    if (blockIdx.z == 0 && lane == 0 && out_lse)
        *out_lse = sum > 0.0f ? m + logf(sum) : -INFINITY;
    B12X_PROF_CB_AT(5, clock64());
    B12X_PROF_CB(1);
    B12X_PROF_SEQ(1, 2);
}

typedef void (*attend_kernel_fn)(AttendArgs);

/* The kernel for a format and row-tile count, with the in-place combine or
 * not, and its shared-memory bytes for a chunk of `chunk_slots`. */
attend_kernel_fn pick_kernel(bool fp8, int rt, bool ip, int chunk_slots, size_t *smem)
{
#define B12X_PICK_(F, R, IP)                                \
    if (fp8 == F && rt == R && ip == IP) {                  \
        *smem = Smem<F, R>::bytes(chunk_slots);             \
        return IP ? b12x_attend_ip_kernel<F, R> : b12x_attend_kernel<F, R>; \
    }
    B12X_PICK_(false, 2, false)
    B12X_PICK_(false, 3, false)
    B12X_PICK_(false, 4, false)
    B12X_PICK_(true, 2, false)
    B12X_PICK_(true, 3, false)
    B12X_PICK_(true, 4, false)
    B12X_PICK_(false, 2, true)
    B12X_PICK_(false, 3, true)
    B12X_PICK_(false, 4, true)
    B12X_PICK_(true, 2, true)
    B12X_PICK_(true, 3, true)
    B12X_PICK_(true, 4, true)
#undef B12X_PICK_
    *smem = 0;
    return nullptr;
}

/* The small-head kernel for a format and step size (`short_t`: at most
 * SMALL_SHORT_T tokens), with the in-place combine or not, and its
 * shared-memory bytes for a chunk of `chunk_slots`. */
attend_kernel_fn pick_small(bool fp8, bool short_t, bool ip, int chunk_slots, size_t *smem)
{
#define B12X_PICK_(F, SH, IP)                                 \
    if (fp8 == F && short_t == SH && ip == IP) {              \
        *smem = SmallSmem<F, SH>::bytes(chunk_slots);         \
        return b12x_small_kernel<F, SH, IP>;                  \
    }
    B12X_PICK_(false, false, false)
    B12X_PICK_(false, true, false)
    B12X_PICK_(true, false, false)
    B12X_PICK_(true, true, false)
    B12X_PICK_(false, false, true)
    B12X_PICK_(false, true, true)
    B12X_PICK_(true, false, true)
    B12X_PICK_(true, true, true)
#undef B12X_PICK_
    *smem = 0;
    return nullptr;
}

/* The small-head kernel of short steps in column halves (grid y = the
 * half), and its shared-memory bytes: b12x_attend_launch_tuned. */
attend_kernel_fn pick_small_half(bool fp8, int chunk_slots, size_t *smem)
{
    *smem = fp8 ? SmallSmem<true, true>::bytes(chunk_slots) : SmallSmem<false, true>::bytes(chunk_slots);
    return fp8 ? b12x_small_kernel<true, true, false, true> : b12x_small_kernel<false, true, false, true>;
}

/* The register-conversion kernel, with the in-place combine or not. */
attend_kernel_fn pick_rc(bool ip)
{
    return ip ? b12x_small_rc_ip_kernel : b12x_small_rc_kernel;
}

/* A launch, with programmatic stream serialization when `pdl` (the kernel
 * may start while the previous one in the stream finishes; it waits with
 * griddepcontrol.wait).  Capturable in a graph. */
cudaError_t launch(attend_kernel_fn fn, dim3 grid, unsigned threads, size_t smem, cudaStream_t st,
                   bool pdl, const AttendArgs &a)
{
    cudaLaunchAttribute at[1];
    const cudaLaunchConfig_t cfg = mlart_launch_cfg(grid, dim3(threads), smem, st, pdl, at);
    return cudaLaunchKernelEx(&cfg, fn, a);
}

/* Dynamic shared memory the combine asks for (it uses none) when its blocks
 * should spread over the multiprocessors, at most two on one: a third of a
 * multiprocessor's shared memory.  Set by b12x_attend_setup. */
int g_cb_spread_smem = 0;

/* fp8 steps of at least SMALL_RC_T tokens at <= 16 heads on
 * b12x_small_rc_kernel, unless MLART_B12X_RC=0 when the backend is created
 * (for comparisons).  Set by b12x_attend_setup. */
int g_rc = 1;

/* A split step of <= 16 heads whose doubled grid still fits one wave
 * (in practice one token: 64 chunks, 128 blocks) in column halves, two
 * blocks a chunk, unless MLART_B12X_HALF=0 when the backend is created
 * (for comparisons).  In a layer step, where the V up-projection follows
 * attend(), it was faster (mlart-decode at batch 1, 32 layers: 3.7-5.5% a
 * step); back to back, where another attend() follows, slower
 * (docs/attention.md, column halves).  Set by b12x_attend_setup. */
int g_half = 1;

int cuda_fail(mlart_error_fn err, const char *what, cudaError_t e)
{
    return err(MLART_ECUDA, "b12x_mla_sparse: %s: %s", what, cudaGetErrorString(e));
}

/* Let kernel fn launch with `bytes` of dynamic shared memory, when device
 * dev (which allows `optin` per block) has them. */
int allow_smem(const void *fn, size_t bytes, int optin, int dev, mlart_error_fn err)
{
    if ((size_t)optin < bytes)
        return err(MLART_ENOTSUP,
                   "b12x_mla_sparse: kernels need %zu bytes of shared memory per block, "
                   "device %d allows %d",
                   bytes, dev, optin);
    const cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
    return e == cudaSuccess ? 0 : cuda_fail(err, "cudaFuncSetAttribute", e);
}

} /* namespace */

extern "C" int b12x_attend_setup(b12x_dev *out, mlart_error_fn err)
{
    int dev = 0, sms = 0, optin = 0;
    memset(out, 0, sizeof *out);
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
    {
        /* every choice checked before any is taken: a refused create
         * changes nothing for the backends that live */
        const char *bad = nullptr;
        b12x_env_choice("MLART_B12X_WGMMA", 1, 0, 2, &bad);
        b12x_env_choice("MLART_B12X_SWG", 0, 0, 1, &bad);
        b12x_env_choice("MLART_B12X_RC", 1, 0, 1, &bad);
        b12x_env_choice("MLART_B12X_HALF", 1, 0, 1, &bad);
        b12x_env_choice("MLART_B12X_INPLACE", 0, 0, 1, &bad);
        b12x_env_choice("MLART_B12X_INPLACE_TRIPS", 2, 1, 64, &bad);
        if (bad)
            return err(MLART_EINVAL,
                       "b12x_mla_sparse: %s='%s' is not one of its values (docs/attention.md: "
                       "WGMMA 0..2, INPLACE_TRIPS 1..64, the others 0 or 1)",
                       bad, getenv(bad));
    }
    int rc = 0;
    for (int f = 0; f < 2 && rc == 0; f++)
        for (int rt = 2; rt <= 4 && rc == 0; rt++)
            for (int ip = 0; ip < 2 && rc == 0; ip++) {
                size_t bytes;
                attend_kernel_fn fn = pick_kernel(f != 0, rt, ip != 0, B12X_MAX_TOPK, &bytes);
                rc = allow_smem((const void *)fn, bytes, optin, dev, err);
            }
    for (int k = 0; k < 8 && rc == 0; k++) {
        size_t bytes;
        attend_kernel_fn fn = pick_small((k & 1) != 0, (k & 2) != 0, (k & 4) != 0, B12X_MAX_TOPK, &bytes);
        rc = allow_smem((const void *)fn, bytes, optin, dev, err);
    }
    for (int ip = 0; ip < 2 && rc == 0; ip++)
        rc = allow_smem((const void *)pick_rc(ip != 0), RcSmem::bytes(B12X_MAX_TOPK), optin, dev, err);
    for (int f = 0; f < 2 && rc == 0; f++) {
        size_t bytes;
        attend_kernel_fn fn = pick_small_half(f != 0, B12X_MAX_TOPK, &bytes);
        rc = allow_smem((const void *)fn, bytes, optin, dev, err);
    }
    if (rc != 0)
        return rc;
    const char *bad_env = nullptr; /* checked above */
    g_rc = b12x_env_choice("MLART_B12X_RC", 1, 0, 1, &bad_env);
    g_half = b12x_env_choice("MLART_B12X_HALF", 1, 0, 1, &bad_env);
    int per_sm = 0;
    e = cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
    if (e != cudaSuccess)
        return cuda_fail(err, "device query", e);
    g_cb_spread_smem = per_sm / 3;
    rc = allow_smem((const void *)b12x_combine_kernel<32, false>, (size_t)g_cb_spread_smem, optin, dev, err);
    if (rc == 0)
        rc = allow_smem((const void *)b12x_combine_kernel<128, false>, (size_t)g_cb_spread_smem, optin, dev, err);
    if (rc == 0)
        rc = allow_smem((const void *)b12x_combine_kernel<32, true>, (size_t)g_cb_spread_smem, optin, dev, err);
    if (rc == 0)
        rc = allow_smem((const void *)b12x_combine_kernel<128, true>, (size_t)g_cb_spread_smem, optin, dev, err);

    if (rc != 0)
        return rc;
    e = (cudaError_t)b12x_wgmma_setup(&bad_env); /* b12x_wgmma.cu: its shared memory, MLART_B12X_WGMMA */
    if (e != cudaSuccess)
        return cuda_fail(err, "wgmma kernel setup", e);
    /* Blocks of the in-place small-head kernels the device holds at once
     * (the fewest of any of them, at the largest chunk): the in-place
     * combine needs every block of the grid resident together. */
    int resident = 0;
    for (int k = 0; k < 5; k++) {
        size_t bytes = RcSmem::bytes(B12X_MAX_TOPK);
        attend_kernel_fn fn =
            k == 4 ? pick_rc(true) : pick_small((k & 1) != 0, (k & 2) != 0, true, B12X_MAX_TOPK, &bytes);
        int n = 0;
        e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, SMALL_THREADS, bytes);
        if (e != cudaSuccess)
            return cuda_fail(err, "occupancy query", e);
        resident = k == 0 || n < resident ? n : resident;
    }
    int gen = 0; /* the general kernel's in-place instantiations */
    for (int k = 0; k < 6; k++) {
        size_t bytes;
        attend_kernel_fn fn = pick_kernel(k >= 3, 2 + k % 3, true, B12X_MAX_TOPK, &bytes);
        int n = 0;
        e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, NTHREADS, bytes);
        if (e != cudaSuccess)
            return cuda_fail(err, "occupancy query", e);
        gen = k == 0 || n < gen ? n : gen;
    }
    int wg_per_sm = 0;
    e = (cudaError_t)b12x_wgmma_resident(&wg_per_sm);
    if (e != cudaSuccess)
        return cuda_fail(err, "occupancy query", e);
    out->log = nullptr;
    out->num_sms = sms;
    out->resident = resident * sms;
    out->resident_gen = gen * sms;
    out->resident_wg = wg_per_sm * sms;
    out->inplace = b12x_env_choice("MLART_B12X_INPLACE", 0, 0, 1, &bad_env);
    /* Longest in-place combine taken, in dependent L2 round trips: with few
     * splits a block combines many units, where the combine kernel spreads
     * them over the GPU.  2 is a first guess; MLART_B12X_INPLACE_TRIPS
     * (1..64) sets it, e.g. for the variants table (s2i .. s64i). */
    out->max_trips = b12x_env_choice("MLART_B12X_INPLACE_TRIPS", 2, 1, 64, &bad_env);
    b12x_modes_now(&out->modes);
    int words = out->resident > out->resident_wg ? out->resident : out->resident_wg;
    words = words > out->resident_gen ? words : out->resident_gen;
    if (words > 0) {
        /* zeroed on a stream of its own and waited for, so that no stream
         * of the caller's can use the array before, and nothing else waits */
        const size_t bytes = (size_t)words * 32 * sizeof(unsigned);
        cudaStream_t zs = nullptr;
        e = cudaMalloc((void **)&out->bar, bytes);
        if (e == cudaSuccess)
            e = cudaStreamCreateWithFlags(&zs, cudaStreamNonBlocking);
        if (e == cudaSuccess)
            e = cudaMemsetAsync(out->bar, 0, bytes, zs);
        if (e == cudaSuccess)
            e = cudaStreamSynchronize(zs);
        if (zs)
            cudaStreamDestroy(zs);
        if (e != cudaSuccess) {
            (void)cudaGetLastError(); /* not left for the next launch to report */
            b12x_attend_teardown(out);
            return cuda_fail(err, "barrier array", e);
        }
    }
    return 0;
}

/* The kernel that runs part `part` of a step of T tokens and `heads`
 * heads (0: the full 64-head tiles, 1: the last partial tile), as
 * b12x_attend_launch_tuned launches it and b12x_attend_inplace_ok checks
 * it.  `tile` (b12x_tune.tile) puts a partial tile of 17..63 heads on the
 * general kernel (1) or the wgmma kernel (2), or the whole step in 16-row
 * tiles on the small-head kernel (3); 0 lets the rule decide. */
namespace {
enum PartKernel { PK_WGMMA, PK_SWG, PK_SMALL, PK_GENERAL };

/* Partial tiles of 17..32 heads, and of 33..63 heads in steps of at least
 * WG_PARTIAL_T tokens, run on the wgmma kernel (MLART_B12X_WGMMA=1): from
 * T = 4 it beats the general kernel at 24 to 56 heads in both formats
 * (6-41% a call in the bench, 2-32% a decode step); at T = 1 and 2 it is
 * 1-6% faster at 32 heads and level in a decode step at 24 and 32, but
 * 5-7% slower at 48 (docs/attention.md, the wgmma kernel).  Before any
 * of that, a step of more than 16 heads runs whole as 16-row tiles on the
 * small-head kernel (step_tiled) where those tiles number at most
 * SMALL_TILES_T over its T tokens, or where there are two of them (17..32
 * heads) and T <= SMALL_PAIR_T, or where the step has a full 64-head
 * tile and a partial one (65..127 heads, not 128) and T <= SMALL_PART_T:
 * the step is then one of <= 16 heads and T x tiles tokens to the split
 * model and the kernel.  In the bench (docs/PERF.md, "16-row tiles",
 * 2026-12-03) that took 32 heads at T = 1 from 9.4 to 6.2 us, and was the
 * fastest of the three kernels at every such row but one (fp8 T = 16,
 * 0.4% behind); at three tiles and T = 8 it is 16% slower than wgmma, at
 * four and T = 4 level.  At 72..112 heads, against the two launches of a
 * full and a partial tile (each split for one launch's T pairs, split_for)
 * the tiles are 1.1-2.3x faster at T <= 4, from 1% slower to 7% faster
 * at T = 6, and 4-30% slower from T = 8 (the `attn tiles` table,
 * docs/PERF.md, 2026-12-03 17:40 UTC). */
constexpr int WG_PARTIAL_T = 4;
constexpr int WG_PARTIAL_ROWS = 32;
constexpr int SMALL_TILES_T = 12;
constexpr int SMALL_PAIR_T = 64;
constexpr int SMALL_PART_T = 6;

bool step_tiled(int T, int heads, int tile)
{
    if (heads <= 16)
        return false; /* one tile: the small-head kernel's own case */
    if (tile)
        return tile == 3;
    const int tiles = (heads + 15) / 16;
    return b12x_wgmma_mode() == 1 && ((int64_t)T * tiles <= SMALL_TILES_T || (tiles == 2 && T <= SMALL_PAIR_T) ||
                                      (heads > HEAD_TILE && heads % HEAD_TILE && T <= SMALL_PART_T));
}

PartKernel part_kernel(int T, int heads, int part, int tile = 0)
{
    const int wmode = b12x_wgmma_mode(), rt = part == 0 ? 4 : (heads % HEAD_TILE + 15) / 16;
    if (step_tiled(T, heads, tile))
        return PK_SMALL;
    if (part == 1 && rt > 1 && tile)
        return tile == 2 ? PK_WGMMA : PK_GENERAL;
    if (wmode == 2 || (wmode == 1 && part == 0))
        return PK_WGMMA;
    if (rt == 1)
        return b12x_swg_mode() ? PK_SWG : PK_SMALL;
    return wmode == 1 && (heads % HEAD_TILE <= WG_PARTIAL_ROWS || T >= WG_PARTIAL_T) ? PK_WGMMA : PK_GENERAL;
}

/* The tiles of part `part`'s launch: a tiled step is one launch of all its
 * 16-row tiles (part 0, from head 0). */
int part_tiles(int T, int heads, int part, int tile)
{
    if (step_tiled(T, heads, tile))
        return part == 0 ? (heads + 15) / 16 : 0;
    return part == 0 ? heads / HEAD_TILE : (heads % HEAD_TILE ? 1 : 0);
}
} /* namespace */

extern "C" int b12x_attend_inplace_ok(const b12x_dev *dev, int T, int heads, int splits)
{
    if (!dev->bar || splits < 2)
        return 0;
    /* The launches of b12x_attend_launch_tuned: the full 64-head tiles (the
     * wgmma kernel, or with MLART_B12X_WGMMA=0 the general one), then the
     * last partial tile (a small-head kernel at <= 16 heads, the general
     * kernel, or the wgmma kernel: at 17..32 heads, from 4 tokens on at
     * 33..63, at any head count with MLART_B12X_WGMMA=2).  Each grid
     * must be resident at once by itself: the second launch's blocks
     * start only once every block of the first has passed its
     * launch_dependents, i.e. is resident, and they wait for the first to
     * complete before they arrive at a barrier. */
    const int full = heads / HEAD_TILE, rem = heads % HEAD_TILE;
    for (int part = 0; part < 2; part++) {
        const int tiles = part == 0 ? full : (rem ? 1 : 0), rows = part == 0 ? HEAD_TILE : rem;
        if (tiles == 0)
            continue;
        if (step_tiled(T, heads, 0)) /* 16-row tiles: a token's tiles would share barrier words */
            return 0;
        /* each kind's residency and the ZB of its combine (the kernel's
         * largest tile: wgmma 64 rows, general 16 x RT, small-head 16) */
        int cap, zb;
        switch (part_kernel(T, heads, part)) {
        case PK_WGMMA:
            cap = dev->resident_wg, zb = b12x::combine_zb(HEAD_TILE, NTHREADS);
            break;
        case PK_SMALL:
            cap = dev->resident, zb = b12x::combine_zb(16, NTHREADS);
            break;
        case PK_GENERAL:
            cap = dev->resident_gen, zb = b12x::combine_zb(16 * ((rows + 15) / 16), NTHREADS);
            break;
        default: /* the slots-as-M prototype has no in-place form */
            return 0;
        }
        if ((int64_t)T * tiles * splits > cap || b12x::combine_trips(rows, splits, NTHREADS, zb) > dev->max_trips)
            return 0;
    }
    return 1;
}

extern "C" int b12x_attend_halves(const b12x_dev *dev, int T, int heads, int splits, int fp8, int inplace)
{
    return g_half && heads <= 16 && part_kernel(T, heads, 1) == PK_SMALL && splits > 1 && !inplace &&
           T <= SMALL_SHORT_T && !(fp8 && g_rc && T >= SMALL_RC_T) && 2 * (int64_t)T * splits <= dev->num_sms;
}

extern "C" void b12x_modes_now(b12x_modes *m)
{
    m->wgmma = b12x_wgmma_mode();
    m->swg = b12x_swg_mode();
    m->rc = g_rc;
    m->half = g_half;
}

extern "C" void b12x_attend_teardown(b12x_dev *dev)
{
    if (dev->bar)
        cudaFree(dev->bar);
    dev->bar = NULL;
}

namespace {
/* The split of `work` (token, head tile) pairs, tiles of r16 16-row
 * tiles, `small_bf16` on the small-head kernel's bf16 fit. */
b12x_split split_model(int64_t work, int r16, bool small_bf16, int topk, int num_sms)
{
    b12x_split best = {1, (topk + BN - 1) / BN};
    const int nblk = (topk + BN - 1) / BN;
    int64_t best_cost = -1;
    if (num_sms < 1)
        num_sms = 1;
    /* Time, in eighths of a block: waves x (blocks per chunk + about two
     * blocks of prologue, + `part` for the partial write when it splits) +
     * the combine, `comb`/8 of a block per multiprocessor-load of chunks
     * for every 16 head rows of a tile.  Ties keep fewer splits.  Fitted
     * to the best of nine forced split counts (bf16 partials; docs/PERF.md,
     * attention):
     *   - part 8, comb 5: 64 and 128 heads T = 1..96 and the small-head
     *     kernel's fp8 (runs of 2026-12-01 13:15-13:17 UTC; fp8 at 16
     *     heads again at 15:07 UTC, T = 1..300: within 1.4% everywhere);
     *   - part 24, comb 12: the small-head kernel's bf16 (run of 15:07 UTC,
     *     T = 1..300: the best count at all 15 points; with 8 / 5 it took
     *     5 splits at T = 48 and 75 and 3 at T = 200, 4-7% slower than the
     *     best).  Where the last wave is partly empty bf16 prefers fewer
     *     splits and fp8 more (T = 48: bf16 2, fp8 5), probably because
     *     an fp8 block is longer, so a split's fixed costs weigh less.
     *     The fit is not sharp: prologue + part = 40 with comb 8..16, or
     *     44 with comb 4..16, takes the same counts at the 15 points. */
    const int64_t part = small_bf16 ? 24 : 8, comb = small_bf16 ? 12 : 5;
    for (int s = 1; s <= nblk && s <= MAX_SPLITS; s++) {
        const int bps = (nblk + s - 1) / s;
        if ((nblk + bps - 1) / bps != s)
            continue;
        const int64_t waves = (work * s + num_sms - 1) / num_sms;
        const int64_t cost = waves * (8 * bps + 16 + (s > 1 ? part : 0)) * num_sms +
                             (s > 1 ? comb * (int64_t)r16 * s * work : 0);
        if (best_cost < 0 || cost < best_cost) {
            best_cost = cost;
            best.splits = s;
            best.blocks_per_split = bps;
        }
    }
    return best;
}

/* The split of a step as launched with b12x_tune.tile `tile`: the model
 * over the (token, head tile) pairs of one launch; a step in 16-row tiles
 * on the small-head kernel counts as one of <= 16 heads and T x tiles
 * tokens.  A step of a full and a partial 64-head tile (65..127 heads)
 * runs them as two launches, one after the other, with the same split:
 * each must fill the GPU by itself, so the model sees T pairs (until
 * 2026-12-03 it saw 2T, and at 96 heads T = 32 took 2 splits, 64 blocks a
 * launch on 132 multiprocessors: 131 us, against 64 us at T = 24 with 5). */
b12x_split split_for(int T, int heads, int topk, int fp8, int num_sms, int tile)
{
    if (step_tiled(T, heads, tile))
        return split_model((int64_t)T * ((heads + 15) / 16), 1, !fp8, topk, num_sms);
    const int tiles = (heads + HEAD_TILE - 1) / HEAD_TILE, per_launch = heads % HEAD_TILE ? 1 : tiles;
    return split_model((int64_t)T * per_launch, ((heads + tiles - 1) / tiles + 15) / 16, heads <= 16 && !fp8, topk,
                       num_sms);
}
} /* namespace */

extern "C" b12x_split b12x_attend_split(int T, int heads, int topk, int fp8, int num_sms)
{
    return split_for(T, heads, topk, fp8, num_sms, 0);
}

extern "C" size_t b12x_attend_workspace(int T, int heads, int topk, int fp8, int num_sms)
{
    b12x_split sp = b12x_attend_split(T, heads, topk, fp8, num_sms);
    if (sp.splits <= 1)
        return 0;
    const size_t rows = (size_t)sp.splits * T * heads;
    return rows * KV_L * sizeof(__nv_bfloat16) + rows * sizeof(float);
}

namespace {
/* One launch of a step at MLART_LOG_DEBUG, when the backend handed over
 * its log (b12x_dev.log): the kernel's name as the profilers and
 * compute-sanitizer's --kernel-name see it, its grid, and the step's
 * split.  Tests grep these lines to know which kernel a shape ran. */
void trace_launch(const b12x_dev *dev, const mlart_step *s, int fp8, b12x_split sp, const char *kernel,
                  const char *what, unsigned gx, unsigned gy, unsigned gz, bool in_place)
{
    if (!dev->log)
        return;
    dev->log(MLART_LOG_DEBUG,
             "b12x_mla_sparse launch: T=%d heads=%d kv=%s splits=%d (%d slots each) kernel=%s (%s) grid %ux%ux%u%s",
             s->T, (int)s->geom.heads, fp8 ? "fp8_ds_mla" : "bf16", sp.splits,
             sp.blocks_per_split * BN, kernel, what, gx, gy, gz, in_place ? " in place" : "");
}
} /* namespace */

extern "C" int b12x_attend_launch_tuned(const mlart_step *s, const b12x_dev *dev, const b12x_tune *tune,
                                        void *stream, mlart_error_fn err)
{
    const int num_sms = dev->num_sms;
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

    if (tune && (tune->combine < 0 || tune->combine > 2 || tune->parts < 0 || tune->parts > 3 ||
                 tune->combine_spread < -1 || tune->combine_spread > 1 || tune->inplace < -1 ||
                 tune->inplace > 1 || tune->cb_trigger < -1 || tune->cb_trigger > 1 || tune->tile < 0 ||
                 tune->tile > 3))
        return err(MLART_EINVAL, "b12x_mla_sparse: tuning values out of range");
    const int tile = tune ? tune->tile : 0;
    const bool small_tiles = step_tiled(T, H, tile);
    b12x_split sp = split_for(T, H, g->topk, fp8, num_sms, tile);
    if (tune && tune->splits > 0) {
        const int nblk = (g->topk + BN - 1) / BN;
        /* more splits than blocks is one block each (and no overflow) */
        const int want = tune->splits < nblk ? tune->splits : nblk;
        sp.blocks_per_split = (nblk + want - 1) / want;
        sp.splits = (nblk + sp.blocks_per_split - 1) / sp.blocks_per_split;
        if (sp.splits > MAX_SPLITS)
            return err(MLART_EINVAL, "b12x_mla_sparse: at most %d splits", MAX_SPLITS);
    }
    const int parts = tune && tune->parts ? tune->parts : 3;
    /* Quarter-row combine blocks while the (token, head) rows are at most
     * half the multiprocessors (measured: docs/PERF.md, attention). */
    const int combine =
        tune && tune->combine ? tune->combine : (2 * (int64_t)T * H <= num_sms ? 2 : 1);
    const bool pdl = tune ? tune->pdl != 0 : true;
    AttendArgs a;
    b12x::args_from_step(&a, s);
    b12x::set_splits(&a, sp.splits);
    if (sp.splits > 1) {
        const size_t rows = (size_t)sp.splits * T * H;
        const size_t need = rows * KV_L * sizeof(__nv_bfloat16) + rows * sizeof(float);
        if (!s->workspace || s->workspace_bytes < need || ((uintptr_t)s->workspace & 15))
            return err(MLART_EINVAL,
                       "b12x_mla_sparse: step of %d tokens needs %zu bytes of 16-aligned "
                       "workspace, has %zu (plan for max_tokens >= %d)",
                       T, need, s->workspace ? s->workspace_bytes : (size_t)0, T);
        a.ws_o = (__nv_bfloat16 *)s->workspace;
        a.ws_lse = reinterpret_cast<float *>(a.ws_o + rows * KV_L);
    }

    const int full = H / HEAD_TILE, rem = H % HEAD_TILE;
    const int chunk = sp.blocks_per_split * BN;
    /* The combine inside the kernels: every launch of the step can do it
     * and its whole grid fits on the device at once, so no block waits at
     * a barrier for one that cannot start. */
    const bool inplace_ok = b12x_attend_inplace_ok(dev, T, H, sp.splits) != 0 && !(tune && tune->tile);
    if (tune && tune->inplace > 0 && (!inplace_ok || tune->parts == 2))
        return err(MLART_EINVAL, "b12x_mla_sparse: no in-place combine for this step%s",
                   tune->parts == 2   ? " (parts = 2 runs the combine kernel)"
                   : tune->tile != 0 ? " (a forced tile kernel runs the combine kernel)"
                                     : "");
    const bool inplace = inplace_ok && (tune && tune->inplace ? tune->inplace > 0 : dev->inplace != 0) &&
                         !(tune && tune->parts == 2);
    if (inplace && !(tune && tune->parts == 1))
        a.bar = dev->bar;
#ifdef B12X_PROFILE
    prof_main_blocks = T * (part_tiles(T, H, 0, tile) + part_tiles(T, H, 1, tile)) * sp.splits; /* tile 0 first */
    prof_cb_blocks = sp.splits > 1 && !inplace ? T * H * (combine == 1 ? 1 : KV_L / 128) : 0;
    prof_inplace = 0; /* set below when a kernel of this file (they stamp) combines in place */
    prof_inner = 1;   /* cleared below by an in-place launch of another kernel */
    prof_rc = 0;
    prof_tail = 1; /* cleared below by a launch of a kernel without the tail stamps */
#endif
    cudaStream_t st = (cudaStream_t)stream;
    cudaError_t e = cudaSuccess;
    for (int part = 0; part < 2 && (parts & 1) && e == cudaSuccess; part++) {
        const PartKernel kind = part_kernel(T, H, part, tile);
        const int tiles = part_tiles(T, H, part, tile);
        if (tiles == 0)
            continue;
        const int rt = part == 0 ? 4 : (rem + 15) / 16;
        const char *what = small_tiles ? "16-row tiles" : part == 0 ? "64-head tiles" : full ? "last tile" : "one tile";
        /* the tokens the small-head kernel counts as: T x its 16-row tiles */
        const int64_t ts = (int64_t)T * tiles;
        /* fp8 steps of many tokens on the small-head path: the register-conversion kernel */
        const bool rc_kernel = kind == PK_SMALL && fp8 && g_rc && ts >= SMALL_RC_T;
        size_t smem;
#ifdef B12X_PROFILE
        if (a.bar && !(kind == PK_SMALL && !(fp8 && g_rc && ts >= SMALL_RC_T)))
            prof_inner = 0; /* only the small-head kernel stamps inside its combine */
#endif
        /* 64-head tiles (every tile with MLART_B12X_WGMMA=2) on the wgmma
         * kernel, b12x_wgmma.cu */
        if (kind == PK_WGMMA) {
            trace_launch(dev, s, fp8, sp, "b12x_wgmma_kernel", what, (unsigned)T, (unsigned)tiles,
                         (unsigned)sp.splits, a.bar != nullptr);
            e = (cudaError_t)b12x_wgmma_launch(s, sp.splits, sp.blocks_per_split,
                                               part == 0 ? 0 : full, tiles,
                                               reinterpret_cast<uint16_t *>(a.ws_o), a.ws_lse,
                                               a.bar, pdl, stream);
            continue;
        }
        if (kind == PK_SWG) {
            trace_launch(dev, s, fp8, sp, "b12x_swg_kernel", "one tile, slots as M", (unsigned)T, 1,
                         (unsigned)sp.splits, false);
            e = (cudaError_t)b12x_swg_launch(s, sp.splits, sp.blocks_per_split, part == 0 ? 0 : full,
                                             reinterpret_cast<uint16_t *>(a.ws_o), a.ws_lse, pdl, stream);
            continue;
        }
        attend_kernel_fn fn;
        int threads = NTHREADS;
        if (b12x_attend_halves(dev, T, H, sp.splits, fp8, a.bar != nullptr)) {
            /* column halves: two blocks a chunk (b12x_small_kernel, HALF) */
            fn = pick_small_half(fp8, chunk, &smem);
            a.tile_base = full;
#ifdef B12X_PROFILE
            prof_main_blocks *= 2;
#endif
            trace_launch(dev, s, fp8, sp, "b12x_small_kernel", "one tile, column halves", (unsigned)T, 2,
                         (unsigned)sp.splits, false);
            e = launch(fn, dim3((unsigned)T, 2, (unsigned)sp.splits), SMALL_THREADS, smem, st, pdl, a);
            continue;
        }
        if (kind == PK_SMALL) {
            /* 16-row tiles (one, or a tiled step's): eight math warps on
             * each block, eight load warps ahead of them (b12x_small_kernel) */
            fn = pick_small(fp8, ts <= SMALL_SHORT_T, a.bar != nullptr, chunk, &smem);
            if (rc_kernel) {
                fn = pick_rc(a.bar != nullptr);
                smem = RcSmem::bytes(chunk);
#ifdef B12X_PROFILE
                prof_rc = 1;
#endif
            }
            threads = SMALL_THREADS;
        } else {
            fn = pick_kernel(fp8, rt, a.bar != nullptr, chunk, &smem);
        }
        a.tile_base = part == 0 ? 0 : full;
#ifdef B12X_PROFILE
        prof_inplace |= a.bar != nullptr;
        if (kind != PK_SMALL)
            prof_tail = 0;
#endif
        trace_launch(dev, s, fp8, sp,
                     kind == PK_SMALL ? (rc_kernel ? (a.bar ? "b12x_small_rc_ip_kernel" : "b12x_small_rc_kernel")
                                                   : "b12x_small_kernel")
                                      : (a.bar ? "b12x_attend_ip_kernel" : "b12x_attend_kernel"),
                     what, (unsigned)T,
                     (unsigned)tiles, (unsigned)sp.splits, a.bar != nullptr);
        e = launch(fn, dim3((unsigned)T, (unsigned)tiles, (unsigned)sp.splits), threads, smem, st,
                   pdl, a);
    }
    if (sp.splits > 1 && !inplace && (parts & 2) && e == cudaSuccess) {
        const int ng1 = (sp.splits + CB_Z - 1) / CB_Z;
        const int ng2 = sp.splits < CB_MAX_GROUPS ? sp.splits : CB_MAX_GROUPS;
#ifdef B12X_PROFILE
        prof_cb_groups = combine == 1 ? ng1 : ng2;
        prof_cb_warps = (combine == 1 ? 128 * ng1 : 32 * ng2) / 32;
#endif
        /* After the small-head kernel, and unless the combine has more than
         * four blocks a multiprocessor, at most two combine blocks share a
         * multiprocessor (an occupancy cap through shared memory it does not
         * use): packed six deep on the first multiprocessors the main kernel
         * frees, they made 16-head calls slower at T = 4..32 (capped:
         * bf16 T = 8 14.1 -> 12.8 us); at 64 and 128 heads the cap was
         * slower (measured: docs/PERF.md, attention, run of 13:22 UTC). */
        const int64_t cb_blocks = (int64_t)T * H * (combine == 1 ? 1 : KV_L / 128);
        const bool small = (H <= 16 || small_tiles) && cb_blocks <= 4 * (int64_t)num_sms;
        const size_t cb_smem =
            tune && tune->combine_spread ? (tune->combine_spread > 0 ? g_cb_spread_smem : 0)
            : (small ? g_cb_spread_smem : 0);
        /* Where the cap applies (after the small-head kernel, its blocks
         * resident at once), the combine lets the next kernel launch before
         * its own dependency wait: a following attention call's blocks
         * then resolve their slots and start their gathers while this call
         * ends, instead of after (16 heads T = 1 5.87 -> 5.12 us, T = 8
         * 11.40 -> 10.51, bf16, in back-to-back calls; with 64 and 128
         * heads, whose combines take several waves, up to 2.7% slower:
         * docs/PERF.md, attention, 2026-12-02).  Whatever launches early
         * still waits for this grid, which waits for the main kernel, before
         * it reads anything the step writes; what it may read before its
         * wait (a following call's indices, block table, lengths and cache,
         * the weights of the op kernels) no kernel of the step writes. */
        const bool early = tune && tune->cb_trigger ? tune->cb_trigger > 0 : small;
        trace_launch(dev, s, fp8, sp, "b12x_combine_kernel", combine == 1 ? "whole rows" : "quarter rows",
                     (unsigned)T, (unsigned)H, combine == 1 ? 1u : (unsigned)(KV_L / 128), false);
        if (combine == 1)
            e = launch(early ? b12x_combine_kernel<128, true> : b12x_combine_kernel<128, false>,
                       dim3((unsigned)T, (unsigned)H, 1), 128 * ng1, cb_smem, st, pdl, a);
        else
            e = launch(early ? b12x_combine_kernel<32, true> : b12x_combine_kernel<32, false>,
                       dim3((unsigned)T, (unsigned)H, KV_L / 128), 32 * ng2, cb_smem, st, pdl, a);
    }
    if (e == cudaSuccess)
        e = cudaGetLastError();
    if (e != cudaSuccess)
        return cuda_fail(err, "launch", e);
    return 0;
}

#ifdef B12X_PROFILE
static double prof_pick(double *v, int n, double q)
{
    for (int i = 1; i < n; i++) /* insertion sort: a few thousand values */
        for (int j = i; j > 0 && v[j - 1] > v[j]; j--) {
            const double x = v[j];
            v[j] = v[j - 1];
            v[j - 1] = x;
        }
    return n ? v[(int)(q * (n - 1) + 0.5)] : 0.0;
}

/* " name min/median/max" of v[0..n) (sorted in place). */
static void prof_print3(FILE *f, const char *name, double *v, int n)
{
    fprintf(f, " %s %.2f/%.2f/%.2f", name, prof_pick(v, n, 0.0), prof_pick(v, n, 0.5), prof_pick(v, n, 1.0));
}

/* The last call against the one before it (b12x_prof_seq): where the
 * main kernel's blocks start, pass their wait and end, and where the
 * combine's do, in us from the previous call's last combine exit; the
 * main blocks split by whether their SM ran a block of that combine.
 * Only when the last launches were one main and one combine grid of nm and
 * nc blocks, repeated since b12x_profile_reset. */

static void prof_seq_dump(FILE *f, const char *label, int nm, int nc)
{
    static unsigned long long q[2][2][PROF_BLOCKS][4];
    unsigned int n[2] = {0, 0};
    if (nm < 1 || nc < 1 || nm > PROF_BLOCKS || nc > PROF_BLOCKS ||
        cudaMemcpyFromSymbol(n, b12x_prof_seq_n, sizeof n) != cudaSuccess ||
        cudaMemcpyFromSymbol(q, b12x_prof_seq, sizeof q) != cudaSuccess || n[0] % nm || n[1] % nc ||
        n[0] / nm < 2 || n[1] / nc < 2)
        return;
    const int lm = (int)((n[0] / nm - 1) & 1), lc = (int)((n[1] / nc - 1) & 1), pc = lc ^ 1;
    unsigned long long e = 0;
    static int on_cb[1024];
    memset(on_cb, 0, sizeof on_cb);
    for (int b = 0; b < nc; b++) {
        e = q[1][pc][b][2] > e ? q[1][pc][b][2] : e;
        on_cb[q[1][pc][b][3] & 1023]++;
    }
    static double v[3][PROF_BLOCKS], w[2][3][PROF_BLOCKS];
    int cnt[2] = {0, 0}, sms = 0, deep = 0, late = 0;
    static int per_sm[1024];
    memset(per_sm, 0, sizeof per_sm);
    for (int b = 0; b < nc; b++)
        v[0][b] = ((double)q[1][pc][b][2] - (double)e) * 1e-3;
    fprintf(f, "# profile %s: two calls, us from the previous combine's last exit: its exits %.2f..%.2f (median %.2f) on",
            label, prof_pick(v[0], nc, 0.0), 0.0, prof_pick(v[0], nc, 0.5));
    for (int i = 0; i < 1024; i++)
        sms += on_cb[i] > 0;
    fprintf(f, " %d SMs;", sms);
    for (int b = 0; b < nm; b++) {
        for (int k = 0; k < 3; k++)
            v[k][b] = ((double)q[0][lm][b][k] - (double)e) * 1e-3;
        const int g = on_cb[q[0][lm][b][3] & 1023] > 0;
        for (int k = 0; k < 3; k++)
            w[g][k][cnt[g]] = v[k][b];
        cnt[g]++;
        late += v[0][b] > 0;
        if (++per_sm[q[0][lm][b][3] & 1023] == 2)
            deep++;
    }
    static const char *const phase[3] = {"entry", "past-wait", "exit"};
    fprintf(f, " main %d blocks:", nm);
    for (int k = 0; k < 3; k++)
        prof_print3(f, phase[k], v[k], nm);
    fprintf(f, " (min/median/max; %d entered after it, %d SMs ran two);", late, deep);
    for (int g = 0; g < 2; g++)
        if (cnt[g])
            fprintf(f, " on SMs %s the combine: %d, entry %.2f/%.2f past-wait %.2f/%.2f exit %.2f/%.2f;",
                    g ? "with" : "without", cnt[g], prof_pick(w[g][0], cnt[g], 0.5), prof_pick(w[g][0], cnt[g], 1.0),
                    prof_pick(w[g][1], cnt[g], 0.5), prof_pick(w[g][1], cnt[g], 1.0),
                    prof_pick(w[g][2], cnt[g], 0.5), prof_pick(w[g][2], cnt[g], 1.0));
    for (int b = 0; b < nc; b++)
        for (int k = 0; k < 3; k++)
            v[k][b] = ((double)q[1][lc][b][k] - (double)e) * 1e-3;
    fprintf(f, " its combine %d blocks:", nc);
    for (int k = 0; k < 3; k++)
        prof_print3(f, phase[k], v[k], nc);
    fprintf(f, "\n");
}

/* Phase profile of the last launch of the diagnostic build: us from the
 * first block's entry (global timer) and per-block phase lengths (SM
 * clock), median / max over blocks. */
extern "C" void b12x_profile_dump(FILE *f, const char *label)
{
    static unsigned long long m[PROF_BLOCKS][13], c[PROF_BLOCKS][8], lp[PROF_BLOCKS][PROF_LOOP];
    int clk_khz = 0;
    if (cudaDeviceSynchronize() != cudaSuccess ||
        cudaMemcpyFromSymbol(m, b12x_prof_main, sizeof m) != cudaSuccess ||
        cudaMemcpyFromSymbol(c, b12x_prof_cb, sizeof c) != cudaSuccess ||
        cudaMemcpyFromSymbol(lp, b12x_prof_loop, sizeof lp) != cudaSuccess)
        return;
    cudaDeviceGetAttribute(&clk_khz, cudaDevAttrClockRate, 0);
    const double cyc_us = 1e3 / (clk_khz > 0 ? clk_khz : 1980000);
    const int nm = prof_main_blocks < PROF_BLOCKS ? prof_main_blocks : PROF_BLOCKS;
    const int nc = prof_cb_blocks < PROF_BLOCKS ? prof_cb_blocks : PROF_BLOCKS;
    static double v[12][PROF_BLOCKS];
    unsigned long long e0 = ~0ull;
    for (int b = 0; b < nm; b++)
        e0 = m[b][0] < e0 ? m[b][0] : e0;
    for (int b = 0; b < nm; b++) {
        v[0][b] = (m[b][0] - e0) * 1e-3;
        v[1][b] = (m[b][7] - e0) * 1e-3;
        v[2][b] = (double)(m[b][1] - m[b][6]) * cyc_us;
        v[3][b] = (double)(m[b][2] - m[b][1]) * cyc_us;
        /* the register-conversion kernel stamps no first block: its
         * first-blk column is left out and loop covers both */
        v[4][b] = (double)(m[b][3] - m[b][2]) * cyc_us;
        v[5][b] = (double)(m[b][4] - m[b][prof_rc ? 2 : 3]) * cyc_us;
        v[6][b] = (double)(m[b][5] - m[b][4]) * cyc_us;
        v[7][b] = m[b][8] >= m[b][5] ? (double)(m[b][8] - m[b][5]) * cyc_us : NAN;
        v[8][b] = m[b][9] >= m[b][8] ? (double)(m[b][9] - m[b][8]) * cyc_us : NAN;
        /* the small-head kernel's combine, inside: LSEs landed, partials
         * landed, groups' barrier passed (0 where not stamped) */
        v[9][b] = m[b][10] >= m[b][8] ? (double)(m[b][10] - m[b][8]) * cyc_us : NAN;
        v[10][b] = m[b][11] >= m[b][10] ? (double)(m[b][11] - m[b][10]) * cyc_us : NAN;
        v[11][b] = m[b][12] >= m[b][11] ? (double)(m[b][12] - m[b][11]) * cyc_us : NAN;
    }
    static const char *names[] = {"entry", "exit", "slots+issue", "dep-wait", "first-blk", "loop", "tail",
                                  "in-place barrier", "in-place combine", "(lse", "part", "merge-bar)"};
    fprintf(f, "# profile %s: main %d blocks:", label, nm);
    for (int k = 0; k < (prof_inplace ? (prof_inner ? 12 : 9) : 7); k++) {
        if (k == 4 && prof_rc)
            continue;
        const double mx = prof_pick(v[k], nm, 1.0), md = prof_pick(v[k], nm, 0.5);
        fprintf(f, " %s %.2f/%.2f", k == 5 && prof_rc ? "first-blk+loop" : names[k], md, mx);
    }
    if (!prof_inplace && prof_tail) {
        /* the small-head kernels' tail from its start: the last P.V
         * landed, the inverses ready (medians; only those kernels stamp) */
        for (int b = 0; b < nm; b++) {
            v[9][b] = m[b][10] >= m[b][4] ? (double)(m[b][10] - m[b][4]) * cyc_us : NAN;
            v[10][b] = m[b][11] >= m[b][4] ? (double)(m[b][11] - m[b][4]) * cyc_us : NAN;
        }
        fprintf(f, " (tail: pv landed %.2f, inverses %.2f)", prof_pick(v[9], nm, 0.5), prof_pick(v[10], nm, 0.5));
    }
    if (nc) {
        /* us from the main kernel's first entry (global timer): entry
         * (first..last), past the dependency wait, exit; then phase
         * lengths (SM clock): past the wait to the loads landed and
         * summed (in parentheses: only landed), from there to the exit
         * (median/max) */
        static double cv[7][PROF_BLOCKS];
        for (int b = 0; b < nc; b++) {
            for (int k = 0; k < 3; k++)
                cv[k][b] = ((double)c[b][k] - (double)e0) * 1e-3;
            cv[3][b] = (double)(c[b][4] - c[b][3]) * cyc_us;
            cv[4][b] = (double)(c[b][5] - c[b][4]) * cyc_us;
            cv[5][b] = prof_cb_groups > 1 ? (double)(c[b][6] - c[b][4]) * cyc_us : 0.0;
            cv[6][b] = (double)(c[b][7] - c[b][3]) * cyc_us;
        }
        fprintf(f, "; combine %d blocks: entry %.2f..%.2f", nc, prof_pick(cv[0], nc, 0.0), prof_pick(cv[0], nc, 1.0));
        fprintf(f, " past-wait %.2f/%.2f", prof_pick(cv[2], nc, 0.5), prof_pick(cv[2], nc, 1.0));
        fprintf(f, " loads %.2f/%.2f (landed %.2f/%.2f)", prof_pick(cv[3], nc, 0.5), prof_pick(cv[3], nc, 1.0),
                prof_pick(cv[6], nc, 0.5), prof_pick(cv[6], nc, 1.0));
        fprintf(f, " rest %.2f/%.2f", prof_pick(cv[4], nc, 0.5), prof_pick(cv[4], nc, 1.0));
        fprintf(f, " (groups' barrier %.2f/%.2f)", prof_pick(cv[5], nc, 0.5), prof_pick(cv[5], nc, 1.0));
        fprintf(f, " exit %.2f/%.2f", prof_pick(cv[1], nc, 0.5), prof_pick(cv[1], nc, 1.0));
        /* each block's slowest warp, from its thread 0 past the wait:
         * loads landed and summed (the warps share the SM clock) */
        static unsigned long long w[PROF_BLOCKS][PROF_CB_WARPS][2];
        const int nw = prof_cb_warps < PROF_CB_WARPS ? prof_cb_warps : PROF_CB_WARPS;
        if (nw > 0 && cudaMemcpyFromSymbol(w, b12x_prof_cbw, sizeof w) == cudaSuccess) {
            for (int b = 0; b < nc; b++) {
                unsigned long long l = 0, u = 0;
                for (int k = 0; k < nw; k++) {
                    l = w[b][k][0] > l ? w[b][k][0] : l;
                    u = w[b][k][1] > u ? w[b][k][1] : u;
                }
                cv[3][b] = l >= c[b][3] ? (double)(l - c[b][3]) * cyc_us : NAN;
                cv[6][b] = u >= c[b][3] ? (double)(u - c[b][3]) * cyc_us : NAN;
            }
            fprintf(f, "; slowest of %d warps: landed %.2f/%.2f summed %.2f/%.2f", nw, prof_pick(cv[3], nc, 0.5),
                    prof_pick(cv[3], nc, 1.0), prof_pick(cv[6], nc, 0.5), prof_pick(cv[6], nc, 1.0));
        }
    }
    fprintf(f, " (us, median/max)\n");
    /* small-head kernel only (the others leave these zero or stale) */
    static const char *lnames[] = {"wait", "convert", "issue", "scores", "softmax", "pv", "load-wait", "load-empty"};
    fprintf(f, "# profile %s: small-kernel loop, us summed over a block's steps (median over blocks):", label);
    for (int k = 0; k < PROF_LOOP; k++) {
        for (int b = 0; b < nm; b++)
            v[0][b] = (double)lp[b][k] * cyc_us;
        fprintf(f, " %s %.2f", lnames[k], prof_pick(v[0], nm, 0.5));
    }
    fprintf(f, "\n");
    prof_seq_dump(f, label, nm, nc);
}

extern "C" void b12x_profile_reset(void)
{
    static const unsigned int zero[2] = {0, 0};
    (void)cudaMemcpyToSymbol(b12x_prof_seq_n, zero, sizeof zero);
}
#endif

extern "C" int b12x_attend_launch(const mlart_step *s, const b12x_dev *dev, void *stream,
                                  mlart_error_fn err)
{
    return b12x_attend_launch_tuned(s, dev, NULL, stream, err);
}
