/* Sparse MLA decode on sm_90a for head tiles of 64: the products on wgmma.
 *
 * The mma.sync kernel (b12x_attend.cu) re-reads the query and every K/V
 * fragment from shared memory once per warp; at 64 heads that holds it at
 * about twice its shared-memory bound (docs/attention.md).  Here a
 * warpgroup issues each product once for all 64 heads (M = 64), reading
 * the query and the gathered rows straight from shared memory through
 * matrix descriptors.
 *
 * One thread block (256 threads, two warpgroups) = one token x one tile of
 * 64 heads (fewer in a last tile: padding rows are zeros in shared memory
 * only) x one chunk of the top-k list, the same grid and split-k chunks as
 * the mma.sync kernel (blocks of 32 slots), so the partials and the
 * combine kernel are shared.
 *
 *   warpgroup 0 ("math"): S = Q K^T of a block (64 x 32 over 576 dims,
 *       36 wgmma m64n32k16, Q and K from shared memory), the online softmax
 *       on the accumulators, P (bf16) to shared memory for the other
 *       warpgroup, then O[:, 0:256] += P V with P from registers.
 *   warpgroup 1 ("load"): the gather ahead of the math (bf16 rows:
 *       cp.async 16-byte pieces straight into the swizzled layout; fp8
 *       rows: one bulk copy per 656-byte row into a raw stage, completed on
 *       an mbarrier, then converted to bf16 in shared memory), then
 *       O[:, 256:512] += P V with P from shared memory.
 *
 * Each row of 576 bf16 is stored as nine 128-byte pieces, piece c of every
 * row of a block contiguous ([c][row][128 B], 16-byte units XOR-swizzled
 * by row % 8): the same bytes are the K-major B operand of Q K^T (rows =
 * N, 64 dims per piece) and the MN-major B operand of P V (rows = K, 64
 * output columns per piece).
 *
 * The warpgroups hand blocks over with named barriers (bar.arrive on one
 * side, bar.sync on the other; each producer arrives at most once per
 * phase because it waits for the matching "free" barrier first):
 *   FULL(s)   block in stage s converted/landed    load -> math
 *   EMPTY(s)  math done reading stage s             math -> load
 *   PFULL(b)  P and the rescale factors of a block  math -> load
 *   PEMPTY(b) load done with P buffer b             load -> math
 * Ordinary shared-memory stores that wgmma reads are followed by
 * fence.proxy.async in the writing thread before its barrier.
 *
 * Also here, opt-in (MLART_B12X_SWG=1 when the backend is created): a
 * prototype for one tile of <= 16 heads with the slots as the M dimension
 * (b12x_swg_kernel, below).  It is correct on every test shape and slower
 * than b12x_small_kernel (docs/attention.md), so it is not the default. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "backends/b12x_mla_sparse/b12x_attend.h"
#include "backends/b12x_mla_sparse/b12x_common.cuh"
#include "runtime/cuda_async.h"
#include "runtime/cuda_launch.h"

namespace {

constexpr int KV_L = B12X_KV_LORA;
constexpr int KV_D = B12X_KV_LORA + B12X_ROPE;  /* 576 */
constexpr int ROW_BYTES = KV_D * 2;              /* 1152: one bf16 row */
constexpr int ROW_CHUNKS = ROW_BYTES / 16;       /* 72 pieces of 16 bytes */
constexpr int FP8_BYTES = KV_L + 4 * (KV_L / 128) + 2 * B12X_ROPE; /* 656 */
constexpr int BN = b12x::BLOCK_SLOTS;            /* slots per block (as the mma.sync kernel) */
constexpr int HT = 64;                           /* heads per tile = wgmma M */
constexpr int NTHREADS = 256;
constexpr int KSTEPS = KV_D / 16;                /* 36 k-steps of Q K^T */
constexpr float LN2 = 0.69314718055994530942f;

using WgArgs = b12x::AttendArgs;

/* Shared-memory map (byte offsets from a 1024-aligned base; the 128-byte
 * swizzle repeats every 1024 bytes and the descriptors assume it starts on
 * one).  bf16: three gathered stages.  fp8: two converted stages and three
 * raw ones (a raw block is issued two blocks ahead of its conversion).
 * 16-byte cp.async pieces issue at about one per cycle per multiprocessor
 * (measured: 1340 cycles per 32-row fp8 block, on the load warpgroup's
 * path), hence the bulk copies for fp8 rows. */
template <bool FP8> struct WgSmem {
    static constexpr int NS = FP8 ? 2 : 3;
    static constexpr int NR = FP8 ? 3 : 0;
    static constexpr int NRM = FP8 ? NR : 1; /* modulus (bf16: unused) */
    static constexpr int Q_BYTES = HT * ROW_BYTES;   /* 73728 */
    static constexpr int KV_STAGE = BN * ROW_BYTES;  /* 36864 */
    static constexpr int RAW_STAGE = BN * FP8_BYTES; /* 20992 */
    static constexpr int P_BUF = HT * BN * 2;        /* 4096: bf16 P, 64-byte rows */
    static constexpr int OFF_Q = 0;
    static constexpr int OFF_KV = OFF_Q + Q_BYTES;
    static constexpr int OFF_RAW = OFF_KV + NS * KV_STAGE;
    static constexpr int OFF_P = (OFF_RAW + NR * RAW_STAGE + 1023) / 1024 * 1024;
    static constexpr int OFF_ALPHA = OFF_P + 2 * P_BUF; /* [2][64] fp32 */
    static constexpr int OFF_INV = OFF_ALPHA + 2 * HT * 4;
    static constexpr int OFF_MBAR = OFF_INV + HT * 4; /* fp8: one mbarrier per raw stage */
    static constexpr int OFF_SLOT = OFF_MBAR + 8 * 4;
    /* resolve_slots' scan words: the row weights, first written in the loop */
    static constexpr int OFF_SCAN = OFF_ALPHA;
    static_assert(2 * HT * 4 >= b12x::SCAN_BYTES, "scan words fit");
    /* + 1024: the dynamic window is aligned up to 1024 in the kernel */
    static constexpr size_t bytes(int chunk_slots) { return (size_t)OFF_SLOT + 4u * chunk_slots + 1024; }
    static_assert(bytes(B12X_MAX_TOPK) <= 232448, "over the sm_90 shared memory per block");
    static_assert(Q_BYTES >= b12x::combine_smem(NTHREADS), "the in-place combine's scratch fits in the query's");
    static_assert(OFF_KV % 1024 == 0 && KV_STAGE % 1024 == 0, "stages start on swizzle atoms");
};

/* Named barriers (0 is __syncthreads). */
enum { BAR_FULL = 1, BAR_EMPTY = 4, BAR_PFULL = 7, BAR_PEMPTY = 9, BAR_LOAD = 11, BAR_MATH = 12 };

using b12x::bar_arrive;
using b12x::bar_sync;
using b12x::cp_async16;
using b12x::cp_async_commit;
using b12x::cp_async_wait;
using b12x::grid_dep_launch;
using b12x::grid_dep_wait;
using b12x::smem_u32;
using b12x::st_shared16;
using b12x::store_row16;
using mlart_sm90::fence_proxy_async;
using mlart_sm90::mbar_expect_tx;
using mlart_sm90::mbar_init;
using mlart_sm90::mbar_wait;
using mlart_sm90::reg_fence;

__device__ __forceinline__ void st_shared32(uint32_t addr, uint32_t v)
{
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

/* One contiguous copy global -> shared by the copy engine (16-byte
 * multiples), counted on mbarrier `bar`. */
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
                 "[%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

__device__ __forceinline__ void wgmma_fence()
{
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit()
{
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int N> __device__ __forceinline__ void wgmma_wait()
{
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/* Shared-memory matrix descriptor: start address, leading and stride byte
 * offsets (16-byte units), swizzle mode (1 = 128 B, 2 = 64 B). */
__device__ __forceinline__ uint64_t make_desc(uint32_t addr, uint32_t lbo, uint32_t sbo, uint32_t swz)
{
    return (uint64_t)((addr & 0x3ffffu) >> 4) | (uint64_t)((lbo & 0x3ffffu) >> 4) << 16 |
           (uint64_t)((sbo & 0x3ffffu) >> 4) << 32 | (uint64_t)swz << 62;
}

/* D[64x32] (+)= A[64x16] B[16x32], A and B K-major in shared memory. */
__device__ __forceinline__ void wgmma_ss_n32(float (&d)[16], uint64_t da, uint64_t db, int acc)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "l"(da), "l"(db), "r"(acc));
}

/* D[64x256] += A[64x16] B[16x256]: A in registers (the m16n8k16 A fragment
 * of each warp's 16 rows), B MN-major in shared memory. */
__device__ __forceinline__ void wgmma_rs_n256(float (&d)[128], const uint32_t (&a)[4], uint64_t db)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
                 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
                 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
                 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
                 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
                 "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
                   "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
                   "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
                   "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
                   "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
                   "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
                   "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
                   "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
                   "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
}

/* D[64x256] += A[64x16] B[16x256]: A K-major, B MN-major, both in shared
 * memory. */
__device__ __forceinline__ void wgmma_ss_n256(float (&d)[128], uint64_t da, uint64_t db)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
                 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
                 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
                 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
                 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
                 "}, %128, %129, p, 1, 1, 0, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
                   "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
                   "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
                   "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
                   "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
                   "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
                   "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
                   "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
                   "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
                 : "l"(da), "l"(db), "n"(1));
}

using b12x::bf16_hi;
using b12x::bf16_lo;
using b12x::e4m3x16_to_bf16;
using b12x::pack_bf16;

/* 2^x on the special-function unit (subnormal results flush to 0, far
 * below what a bf16 probability resolves next to the row maximum's 1). */
__device__ __forceinline__ float fast_exp2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* Byte offset of 16-byte piece c (0..71) of row r in a tile of R rows
 * stored as [c / 8][R][128 B] with the 128-byte swizzle (16-byte unit
 * c % 8 XOR r % 8): the canonical K-major layout of a 64-wide K slice, and
 * read with K and N swapped, the MN-major one of a 64-wide N slice. */
__device__ __forceinline__ uint32_t tile_off(int r, int c, int R)
{
    return (uint32_t)((c >> 3) * R * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

/* The query rows [h0, h0 + rows) of token t as an R-row tile at `dst`
 * (tile_off layout), rows past `rows` zeros in shared memory only; threads
 * first, first + n, ..; one commit group. */
template <int R>
__device__ __forceinline__ void load_query_tiled(const WgArgs &a, uint32_t dst, int t, int h0, int rows, int first,
                                                 int n)
{
    for (int u = first; u < R * ROW_CHUNKS; u += n) {
        const int r = u / ROW_CHUNKS, c = u - r * ROW_CHUNKS;
        const uint32_t d = dst + tile_off(r, c, R);
        if (r < rows)
            cp_async16(d, a.q + (int64_t)t * a.q_st + (int64_t)(h0 + r) * a.q_sh + c * 8, 16);
        else
            st_shared16(d, make_uint4(0, 0, 0, 0));
    }
    cp_async_commit();
}

#ifdef B12X_WGMMA_PROF
/* Diagnostic build: SM cycles per phase of block (0, 0, 0), summed over
 * its loop, printed by the launcher after an eager call at T = 64. */
__device__ uint32_t g_prof[2][12];
#define PROF(k)                                                                                    \
    do {                                                                                           \
        const uint32_t now_ = (uint32_t)clock();                                                   \
        prof[k] += now_ - tl_;                                                                     \
        tl_ = now_;                                                                                \
    } while (0)
#else
#define PROF(k) ((void)0)
#endif

/* IP: the instantiation that combines in place (a.bar set, splits > 1;
 * b12x_common.cuh). */
template <bool FP8, bool IP>
__global__ void __launch_bounds__(NTHREADS, 1) b12x_wgmma_kernel(const WgArgs a)
{
#ifdef B12X_WGMMA_PROF
    uint32_t prof[10] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    uint32_t tl_ = (uint32_t)clock(), t_start = tl_;
#endif
    using S = WgSmem<FP8>;
    constexpr int NS = S::NS;
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const uint32_t sraw = smem_u32(smem_raw);
    const uint32_t pad = (1024u - (sraw & 1023u)) & 1023u;
    uint8_t *const smem = smem_raw + pad;
    const uint32_t sb = sraw + pad;

    const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127, lane = tid & 31;
    const int wr = (wt >> 5) * 16 + (lane >> 2); /* first of this thread's two head rows */
    const int q4 = lane & 3;
    const b12x::Chunk ck = b12x::chunk_of(a, HT, HT);
    const int t = ck.t, h0 = ck.h0, rows = ck.rows, split = ck.split;
    int32_t *const s_slot = reinterpret_cast<int32_t *>(smem + S::OFF_SLOT);
    float *const s_alpha = reinterpret_cast<float *>(smem + S::OFF_ALPHA);
    float *const s_inv = reinterpret_cast<float *>(smem + S::OFF_INV);

    /* Programmatic dependent launch, as the mma.sync kernel: the slots
     * (inputs the previous kernel does not write) before the wait, the
     * query after it. */
    const int nblk = b12x::resolve_slots<NTHREADS>(a, t, split, ck.nblk * BN, s_slot,
                                                   reinterpret_cast<int32_t *>(smem + S::OFF_SCAN));
    if (FP8 && tid == 0) {
        for (int i = 0; i < S::NR; i++)
            mbar_init(sb + S::OFF_MBAR + 8 * i, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    grid_dep_wait();
    grid_dep_launch();

    /* Query rows of the tile; padding rows are zeros in shared memory only. */
    load_query_tiled<HT>(a, sb + S::OFF_Q, t, h0, rows, tid, NTHREADS);
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; i++)
        o[i] = 0.0f;

    if (wg == 0) {
        /* ---- math warpgroup: S, softmax, P, O[:, 0:256] ---- */
        float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
        const uint64_t dq = make_desc(sb + S::OFF_Q, 16, 1024, 1);
        for (int j = 0; j < nblk; j++) {
            const int st = j % NS;
            const uint32_t kvs = sb + S::OFF_KV + st * S::KV_STAGE;
            /* The previous P V done: the stage of block j - 1 is free for
             * the load side (it refills it while this block's S runs).
             * (Waiting for it after issuing S, with one group left, makes
             * ptxas serialise every wgmma: C7514.) */
            PROF(9);
            wgmma_wait<0>();
            reg_fence(o);
            PROF(0);
            if (j >= 1 && j - 1 + NS < nblk)
                bar_arrive(BAR_EMPTY + (j - 1) % NS, NTHREADS);
            bar_sync(BAR_FULL + st, NTHREADS); /* its writers fenced (async proxy) */
            PROF(1);

            /* S[64 x 32] = Q K^T over 576 dims: 36 k-steps, nine 64-dim
             * pieces of 4 steps (32 bytes apart inside the swizzled rows). */
            /* Which of this thread's 8 score columns hold a slot (read
             * before the products, off the path after them). */
            const int32_t *sl = s_slot + j * BN;
            bool okc[8];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int e = 0; e < 2; e++)
                    okc[2 * i + e] = sl[8 * i + 2 * q4 + e] >= 0;
            float s[16];
#pragma unroll
            for (int i = 0; i < 16; i++)
                s[i] = 0.0f;
            const uint64_t dk = make_desc(kvs, 16, 1024, 1);
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ks++) {
                const int kc = ks >> 2, kb = (ks & 3) * 32;
                wgmma_ss_n32(s, dq + (uint64_t)((kc * HT * 128 + kb) >> 4),
                             dk + (uint64_t)((kc * BN * 128 + kb) >> 4), ks > 0);
            }
            wgmma_commit();
            PROF(2);
            wgmma_wait<0>();
            reg_fence(s);
            PROF(3);

            /* Mask empty slots, log2 units, row maxima (a row's 32 columns
             * sit in the 4 lanes of a quad). */
            float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float v = okc[2 * i + (e & 1)] ? s[4 * i + e] * a.scale_log2 : -INFINITY;
                    s[4 * i + e] = v;
                    mx[e >> 1] = fmaxf(mx[e >> 1], v);
                }
            float base[2], alpha[2];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
                mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
                const float mnew = fmaxf(m_run[i], mx[i]);
                base[i] = mnew == -INFINITY ? 0.0f : mnew;
                alpha[i] = fast_exp2(m_run[i] - base[i]);
                m_run[i] = mnew;
            }
            /* P in bf16 (the row sums use the rounded values), as the A
             * fragments of the two k-steps of P V: n-tiles 2kk and 2kk+1. */
            uint32_t pr[8];
            float rs[2] = {0.0f, 0.0f};
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const uint32_t p = pack_bf16(fast_exp2(s[4 * i + 2 * h] - base[h]),
                                                 fast_exp2(s[4 * i + 2 * h + 1] - base[h]));
                    pr[2 * i + h] = p;
                    rs[h] += bf16_lo(p) + bf16_hi(p);
                }
#pragma unroll
            for (int h = 0; h < 2; h++)
                l_run[h] = l_run[h] * alpha[h] + rs[h];

            /* P and the rescale factors to the load side (buffer j % 2, free
             * once it has finished block j - 2). P: 64 rows of 64 bytes,
             * 64-byte swizzle (16-byte unit XOR (row / 2) % 4). */
            const int pbuf = j & 1;
            PROF(4);
            if (j >= 2)
                bar_sync(BAR_PEMPTY + pbuf, NTHREADS);
            PROF(5);
            const uint32_t pbase = sb + S::OFF_P + pbuf * S::P_BUF;
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int r = wr + 8 * h;
                    st_shared32(pbase + r * 64 + ((i ^ ((r >> 1) & 3)) << 4) + q4 * 4, pr[2 * i + h]);
                }
            if (q4 == 0) {
                s_alpha[pbuf * HT + wr] = alpha[0];
                s_alpha[pbuf * HT + wr + 8] = alpha[1];
            }
#ifdef B12X_RACECHECK
            /* racecheck orders a thread's shared-memory writes, too, only up
             * to its last bar.sync: without this barrier of warpgroup 0
             * alone it reports these s_alpha writes against warpgroup 1's
             * reads after PFULL as RAW hazards (docs/attention.md, Checking) */
            bar_sync(BAR_MATH, 128);
#endif
            fence_proxy_async();
            bar_arrive(BAR_PFULL + pbuf, NTHREADS);
            PROF(6);

            /* O[:, 0:256] = alpha O + P V (P from registers, V = the same
             * rows as an MN-major operand: pieces 0..3, 16 rows per k-step). */
#pragma unroll
            for (int i = 0; i < 32; i++) {
                o[4 * i + 0] *= alpha[0];
                o[4 * i + 1] *= alpha[0];
                o[4 * i + 2] *= alpha[1];
                o[4 * i + 3] *= alpha[1];
            }
            const uint64_t dv = make_desc(kvs, BN * 128, 1024, 1);
            const uint32_t pa0[4] = {pr[0], pr[1], pr[2], pr[3]};
            const uint32_t pa1[4] = {pr[4], pr[5], pr[6], pr[7]};
            wgmma_fence();
            wgmma_rs_n256(o, pa0, dv);
            wgmma_rs_n256(o, pa1, dv + (uint64_t)(2048 >> 4));
            wgmma_commit();
            PROF(7);
        }
        wgmma_wait<0>();
        reg_fence(o);

        float inv[2], lse[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
            l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
            inv[h] = l_run[h] > 0.0f ? 1.0f / l_run[h] : 0.0f;
            lse[h] = l_run[h] > 0.0f ? (m_run[h] + log2f(l_run[h])) * LN2 : -INFINITY;
        }
        if (q4 == 0) {
            s_inv[wr] = inv[0];
            s_inv[wr + 8] = inv[1];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int hr = wr + 8 * h;
                if (hr >= rows)
                    continue;
                if (a.splits == 1) {
                    if (a.lse)
                        a.lse[(int64_t)(h0 + hr) * a.l_sh + (int64_t)t * a.l_st] = lse[h];
                } else {
                    a.ws_lse[((int64_t)split * a.T + t) * a.H + h0 + hr] = lse[h];
                }
            }
        }
#ifdef B12X_RACECHECK
        /* Orders nothing the __syncthreads() below does not, yet without
         * it racecheck reports these s_inv writes against the reads after
         * that __syncthreads() as RAW hazards (docs/attention.md, Checking) */
        bar_sync(BAR_MATH, 128);
#endif
    } else {
        /* ---- load warpgroup: gather (+ fp8 conversion), O[:, 256:512] ---- */
        /* Gather block j (one commit group per call, empty past the end). */
        auto issue = [&](int j) {
            if (j < nblk) {
                if constexpr (!FP8) {
                    const uint32_t st = sb + S::OFF_KV + (j % NS) * S::KV_STAGE;
#pragma unroll 2
                    for (int i = 0; i < BN * ROW_CHUNKS / 128; i++) {
                        const int u = wt + i * 128;
                        const int r = u / ROW_CHUNKS, c = u - r * ROW_CHUNKS;
                        const int slot = s_slot[j * BN + r];
                        const uint8_t *src = a.kv + (slot >= 0 ? slot * a.kv_row + c * 16 : 0);
                        cp_async16(st + tile_off(r, c, BN), src, slot >= 0 ? 16 : 0);
                    }
                } else {
                    /* One bulk copy per row (656 contiguous bytes) by the
                     * lanes of the first warp; the stage's mbarrier expects
                     * the bytes of the valid rows.  Empty rows are left as
                     * they are and zeroed by convert(). */
                    if (wt < 32) {
                        const int slot = s_slot[j * BN + lane];
                        const unsigned valid = __ballot_sync(0xffffffffu, slot >= 0);
                        const uint32_t bar = sb + S::OFF_MBAR + (j % S::NRM) * 8;
                        if (lane == 0)
                            mbar_expect_tx(bar, (uint32_t)__popc(valid) * FP8_BYTES);
                        __syncwarp();
                        if (slot >= 0)
                            bulk_g2s(sb + S::OFF_RAW + (j % S::NRM) * S::RAW_STAGE + lane * FP8_BYTES,
                                     a.kv + (int64_t)slot * a.kv_row, FP8_BYTES, bar);
                    }
                    return;
                }
            }
            cp_async_commit();
        };
        /* fp8 block j: raw stage -> bf16 stage, after its bulk copies have
         * landed.  Thread = (row lane, warp w): data pieces w, w+4, .., w+28
         * (16 e4m3 each, two bf16 pieces) and rope pieces w, w+4; all loads
         * first (independent), so the conversion is not latency-bound.  A
         * warp's 32 rows make its shared-memory reads and writes
         * conflict-free.  Empty rows become zeros (their raw bytes are
         * stale). */
        auto convert = [&](int j) {
            mbar_wait(sb + S::OFF_MBAR + (j % S::NRM) * 8, (uint32_t)(j / S::NRM) & 1u);
            const uint8_t *rrow = smem + S::OFF_RAW + (j % S::NRM) * S::RAW_STAGE + lane * FP8_BYTES;
            const uint32_t dst = sb + S::OFF_KV + (j % NS) * S::KV_STAGE;
            const int w = wt >> 5;
            const bool ok = s_slot[j * BN + lane] >= 0;
            uint4 v[8], rp[2];
            float sc[4];
#pragma unroll
            for (int i = 0; i < 8; i++)
                v[i] = *reinterpret_cast<const uint4 *>(rrow + (w + 4 * i) * 16);
#pragma unroll
            for (int t = 0; t < 4; t++)
                sc[t] = ok ? *reinterpret_cast<const float *>(rrow + KV_L + 4 * t) : 0.0f;
#pragma unroll
            for (int k = 0; k < 2; k++) {
                rp[k] = *reinterpret_cast<const uint4 *>(rrow + KV_L + 16 + (w + 4 * k) * 16);
                if (!ok)
                    rp[k] = make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const int c = w + 4 * i;
                const float f = sc[i >> 1]; /* tile (w + 4i) / 8 = i / 2 */
                uint4 x = v[i], lo, hi;
                if (!ok)
                    x = make_uint4(0, 0, 0, 0);
                e4m3x16_to_bf16(x, f, lo, hi);
                st_shared16(dst + tile_off(lane, 2 * c, BN), lo);
                st_shared16(dst + tile_off(lane, 2 * c + 1, BN), hi);
            }
#pragma unroll
            for (int k = 0; k < 2; k++)
                st_shared16(dst + tile_off(lane, 64 + w + 4 * k, BN), rp[k]);
        };

        /* Prologue: block 0 ready for the math side; blocks 1 (bf16) or
         * 1, 2 (fp8 raw) in flight. */
        if constexpr (FP8) {
            issue(0);
            issue(1);
            issue(2);
            convert(0);
            fence_proxy_async();
        } else {
            issue(0);
            issue(1);
            cp_async_wait<1>();
            fence_proxy_async();
        }
        bar_arrive(BAR_FULL + 0, NTHREADS);

        for (int j = 0; j < nblk; j++) {
            if constexpr (FP8) {
                /* Every thread has converted block j: its raw stage takes
                 * block j + 3. */
                PROF(9);
                bar_sync(BAR_LOAD, 128);
                PROF(0);
                issue(j + 3);
                PROF(1);
            }
            /* Own P V of block j - 1 done: its P buffer and (with the math
             * side's EMPTY) its stage are free. */
            wgmma_wait<0>();
            reg_fence(o);
            PROF(2);
            if (j >= 1 && j + 1 < nblk)
                bar_arrive(BAR_PEMPTY + ((j - 1) & 1), NTHREADS);
            if constexpr (FP8) {
                if (j + 1 < nblk) {
                    if (j >= 1)
                        bar_sync(BAR_EMPTY + (j - 1) % NS, NTHREADS);
                    PROF(3);
                    convert(j + 1);
                    fence_proxy_async();
                    bar_arrive(BAR_FULL + (j + 1) % NS, NTHREADS);
                    PROF(4);
                }
            } else {
                if (j >= 1 && j + 2 < nblk)
                    bar_sync(BAR_EMPTY + (j - 1) % NS, NTHREADS);
                PROF(3);
                issue(j + 2);
                PROF(1);
                if (j + 1 < nblk) {
                    cp_async_wait<1>();
                    fence_proxy_async();
                    bar_arrive(BAR_FULL + (j + 1) % NS, NTHREADS);
                }
                PROF(4);
            }

            /* O[:, 256:512] = alpha O + P V, P from shared memory. */
            const int pbuf = j & 1;
            const uint32_t kvs = sb + S::OFF_KV + (j % NS) * S::KV_STAGE;
            PROF(9);
            bar_sync(BAR_PFULL + pbuf, NTHREADS); /* its writers fenced (async proxy) */
            PROF(5);
            const float al0 = s_alpha[pbuf * HT + wr], al1 = s_alpha[pbuf * HT + wr + 8];
#pragma unroll
            for (int i = 0; i < 32; i++) {
                o[4 * i + 0] *= al0;
                o[4 * i + 1] *= al0;
                o[4 * i + 2] *= al1;
                o[4 * i + 3] *= al1;
            }
            const uint64_t dp = make_desc(sb + S::OFF_P + pbuf * S::P_BUF, 16, 512, 2);
            const uint64_t dv = make_desc(kvs + 4 * BN * 128, BN * 128, 1024, 1);
            wgmma_fence();
            wgmma_ss_n256(o, dp, dv);
            wgmma_ss_n256(o, dp + (uint64_t)(32 >> 4), dv + (uint64_t)(2048 >> 4));
            wgmma_commit();
            PROF(6);
        }
        wgmma_wait<0>();
        reg_fence(o);
        cp_async_wait<0>();
    }
    __syncthreads(); /* s_inv */
#ifdef B12X_WGMMA_PROF
    if (wt == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
        g_prof[wg][0] = nblk;
        g_prof[wg][1] = (uint32_t)clock() - t_start;
        for (int k = 0; k < 10; k++)
            g_prof[wg][2 + k] = prof[k];
    }
#endif

    /* Output: this warpgroup's 256 columns of its thread's two head rows.
     * A row past the tile's heads still takes part in store_row16's
     * shuffles (the whole warp does), but stores nothing. */
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int hr = wr + 8 * h;
        const bool ok = hr < rows;
        const int hc = ok ? hr : rows - 1;
        const float inv = s_inv[hc];
        const int hh = h0 + hc;
        if (a.splits == 1) {
            __nv_bfloat16 *orow = a.out + (int64_t)hh * a.o_sh + (int64_t)t * a.o_st + wg * 256;
#pragma unroll
            for (int k = 0; k < 16; k++)
                store_row16(orow + 16 * k, pack_bf16(o[8 * k + 2 * h] * inv, o[8 * k + 2 * h + 1] * inv),
                            pack_bf16(o[8 * k + 4 + 2 * h] * inv, o[8 * k + 4 + 2 * h + 1] * inv), ok);
        } else {
            const int64_t row = ((int64_t)split * a.T + t) * a.H + hh;
            __nv_bfloat16 *orow = a.ws_o + row * KV_L + wg * 256;
#pragma unroll
            for (int k = 0; k < 16; k++)
                store_row16(orow + 16 * k, pack_bf16(o[8 * k + 2 * h] * inv, o[8 * k + 2 * h + 1] * inv),
                            pack_bf16(o[8 * k + 4 + 2 * h] * inv, o[8 * k + 4 + 2 * h + 1] * inv), ok);
        }
    }
    if constexpr (IP)
        b12x::combine_in_kernel<NTHREADS, HT>(a, t, h0, rows, split, tid, [] { __syncthreads(); }, [] {},
                                              reinterpret_cast<float *>(smem + S::OFF_Q));
}


/* ---- Prototype (MLART_B12X_SWG=1): one tile of <= 16 heads, both
 * formats, the slots as the wgmma M dimension.  S^T[64 slots x 16 heads] = K Q^T (m64n16k16, K
 * K-major from the gathered stage, Q the 16-row B operand); softmax per
 * head column; O^T[512 x 16] += V^T P^T (eight m64n16k16 dim tiles, V^T
 * the same stage read MN-major, P^T a [16 heads][64 slots] B operand).
 * Warpgroup 0 computes, warpgroups 1-2 gather 64-slot blocks into two
 * stages (fp8: 32-row halves land raw in two raw stages and are converted
 * into them).  Same chunks (pairs of 32-slot blocks, the second half of an
 * odd count masked and zeroed), partials and combine as the other kernels.
 * Measured slower than b12x_small_kernel (docs/attention.md): two 64-row
 * stages keep too few bytes in flight. */
constexpr int SW_THREADS = 384;
constexpr int SW_BS = 64;                        /* slots a block */
template <bool FP8> struct SwSmem {
    static constexpr int Q_BYTES = 16 * ROW_BYTES;     /* [9][16][128] */
    static constexpr int STAGE = SW_BS * ROW_BYTES;    /* [9][64][128] = 73728 */
    static constexpr int PIECE = SW_BS * 128;          /* one 64-dim piece of a stage */
    static constexpr int NR = FP8 ? 2 : 0;             /* fp8: raw stages of 32 rows */
    static constexpr int RAW = BN * FP8_BYTES;         /* 20992 */
    static constexpr int OFF_Q = 0;
    static constexpr int OFF_KV = Q_BYTES;             /* 18432 */
    static constexpr int OFF_RAW = OFF_KV + 2 * STAGE;
    static constexpr int OFF_P = (OFF_RAW + NR * RAW + 1023) / 1024 * 1024; /* [16][128]: P^T, 128-byte swizzle */
    static constexpr int OFF_CMAX = OFF_P + 2048;      /* [4 warps][16] */
    static constexpr int OFF_L = OFF_CMAX + 256;       /* [4 warps][16] */
    static constexpr int OFF_SLOT = OFF_L + 256;
    /* resolve_slots' scan words and the block count (word 31): the column
     * maxima, first written in the loop */
    static constexpr int OFF_SCAN = OFF_CMAX;
    static_assert(OFF_L - OFF_CMAX >= b12x::SCAN_BYTES, "scan words and word 31 fit");
    static constexpr int O_LD = KV_L + 8;
    static constexpr size_t bytes(int chunk_slots)
    {
        return (size_t)OFF_SLOT + 4u * (size_t)((chunk_slots + SW_BS - 1) / SW_BS * SW_BS) + 1024;
    }
    static_assert(OFF_KV % 1024 == 0 && STAGE % 1024 == 0 && OFF_P % 1024 == 0, "swizzle atoms");
    static_assert(16 * O_LD * 2 <= 2 * STAGE, "output staging fits in the stages");
};
static_assert(SwSmem<false>::bytes(B12X_MAX_TOPK) <= 232448 && SwSmem<true>::bytes(B12X_MAX_TOPK) <= 232448,
              "over the sm_90 shared memory per block");
enum { SW_FULL = 1, SW_EMPTY = 3, SW_MATH = 5, SW_LOAD = 6 };

template <int TA> __device__ __forceinline__ void wgmma_ss_n16(float (&d)[8], uint64_t da, uint64_t db, int acc)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, %11, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "l"(da), "l"(db), "r"(acc), "n"(TA));
}

template <bool FP8> __global__ void __launch_bounds__(SW_THREADS, 1) b12x_swg_kernel(const WgArgs a)
{
    using S = SwSmem<FP8>;
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const uint32_t sraw = smem_u32(smem_raw);
    const uint32_t pad = (1024u - (sraw & 1023u)) & 1023u;
    uint8_t *const smem = smem_raw + pad;
    const uint32_t sb = sraw + pad;
    const int tid = threadIdx.x, lane = tid & 31;
    b12x::Chunk ck = b12x::chunk_of(a, HT, 16);
    const int t = ck.t, h0 = ck.h0, rows = ck.rows, split = ck.split;
    int32_t *const s_slot = reinterpret_cast<int32_t *>(smem + S::OFF_SLOT);
    int32_t *const s_scan = reinterpret_cast<int32_t *>(smem + S::OFF_SCAN);

    /* The first two warpgroups resolve (named barrier 1; the third waits
     * at the block barrier) and hand the compacted block count over in
     * scan word 31. */
    if (tid < NTHREADS) {
        const int nbc = b12x::resolve_slots<NTHREADS, 1>(a, t, ck.split, ck.nblk * BN, s_slot, s_scan);
        if (tid == 0)
            s_scan[31] = nbc;
        if (tid < BN && (nbc & 1))
            s_slot[nbc * BN + tid] = -1; /* the absent half of the last block */
    }
    __syncthreads();
    ck.nblk = b12x::uniform(s_scan[31]);
    const int nb = (ck.nblk + 1) / 2; /* 64-slot blocks */

    if (tid >= 128) {
        /* ---- load warpgroups: block jb into stage jb % 2, 8 lanes a row ---- */
        const int pt = tid - 128, q = pt & 7;
        if constexpr (FP8) {
            /* 32-row halves h (block h / 2) land raw in raw stage h % 2, then
             * are converted into rows 32 (h % 2).. of stage (h / 2) % 2 */
            const int nh = ck.nblk;
            auto issue_raw = [&](int h) {
                if (h < nh) {
                    const int r = pt >> 3;
                    const int slot = s_slot[h * BN + r];
                    const uint8_t *src = a.kv + (slot >= 0 ? (int64_t)slot * a.kv_row + q * 16 : 0);
                    const uint32_t dst = sb + S::OFF_RAW + (h % S::NR) * S::RAW + r * FP8_BYTES + q * 16;
#pragma unroll
                    for (int i = 0; i < 6; i++)
                        if (q + 8 * i < FP8_BYTES / 16)
                            cp_async16(dst + 128 * i, src + (slot >= 0 ? 128 * i : 0), slot >= 0 ? 16 : 0);
                }
                cp_async_commit();
            };
            issue_raw(0);
            issue_raw(1);
            const int lr = pt & 31, w8 = pt >> 5;
            for (int h = 0; h < nh; h++) {
                const int jb = h >> 1;
                cp_async_wait<1>();
                bar_sync(SW_LOAD, 256); /* half h landed for all */
                if ((h & 1) == 0 && jb >= 2)
                    bar_sync(SW_EMPTY + (jb & 1), SW_THREADS); /* block jb - 2 done */
                const uint32_t dst = sb + S::OFF_KV + (jb & 1) * S::STAGE;
                const int rr = 32 * (h & 1) + lr;
                b12x::convert_fp8_pieces(smem + S::OFF_RAW + (h % S::NR) * S::RAW, lr, dst, w8,
                                         [rr](int c) { return tile_off(rr, c, SW_BS); });
                if ((h & 1) == 0 && h + 1 == nh) {
                    /* the absent second half of the last block: zeros (its
                     * slots are masked; stale or unset bytes could be NaN) */
                    const uint4 z = make_uint4(0, 0, 0, 0);
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        st_shared16(dst + tile_off(32 + lr, 2 * (w8 + 8 * i), SW_BS), z);
                        st_shared16(dst + tile_off(32 + lr, 2 * (w8 + 8 * i) + 1, SW_BS), z);
                    }
                    st_shared16(dst + tile_off(32 + lr, 64 + w8, SW_BS), z);
                }
                bar_sync(SW_LOAD, 256); /* raw stage h % 2 read by all */
                issue_raw(h + 2);
                if ((h & 1) || h + 1 == nh) {
                    fence_proxy_async();
                    bar_arrive(SW_FULL + (jb & 1), SW_THREADS);
                }
            }
            cp_async_wait<0>();
            return;
        }
        auto issue = [&](int jb) {
            if (jb < nb) {
                const uint32_t st = sb + S::OFF_KV + (jb & 1) * S::STAGE;
#pragma unroll
                for (int pass = 0; pass < 2; pass++) {
                    const int r = pass * 32 + (pt >> 3);
                    const int slot = s_slot[jb * SW_BS + r];
                    const uint8_t *src = a.kv + (slot >= 0 ? (int64_t)slot * a.kv_row + q * 16 : 0);
                    const uint32_t dst = st + r * 128 + ((q ^ (r & 7)) << 4);
#pragma unroll
                    for (int i = 0; i < 9; i++)
                        cp_async16(dst + i * S::PIECE, src + (slot >= 0 ? 128 * i : 0), slot >= 0 ? 16 : 0);
                }
            }
            cp_async_commit();
        };
        issue(0);
        issue(1);
        for (int jb = 0; jb < nb; jb++) {
            cp_async_wait<1>();
            fence_proxy_async();
            bar_arrive(SW_FULL + (jb & 1), SW_THREADS);
            if (jb + 2 < nb)
                bar_sync(SW_EMPTY + (jb & 1), SW_THREADS);
            issue(jb + 2);
        }
        cp_async_wait<0>();
        return;
    }

    /* ---- math warpgroup ---- */
    const int w = tid >> 5, g = lane >> 2, t4 = lane & 3;
    grid_dep_wait();
    grid_dep_launch();
    load_query_tiled<16>(a, sb + S::OFF_Q, t, h0, rows, tid, 128);
    cp_async_wait<0>();
    fence_proxy_async();
    bar_sync(SW_MATH, 128);

    float *const s_cmax = reinterpret_cast<float *>(smem + S::OFF_CMAX);
    float *const s_l = reinterpret_cast<float *>(smem + S::OFF_L);
    /* A warp's value per head column (column 8 jc + 2 t4 + e at index
     * 2 jc + e, the same in every g) to dst[warp][16], then the math
     * warpgroup's barrier. */
    auto put_cols = [&](float *dst, const float (&v)[4]) {
        if (g == 0) {
#pragma unroll
            for (int jc = 0; jc < 2; jc++)
#pragma unroll
                for (int e = 0; e < 2; e++)
                    dst[w * 16 + 8 * jc + 2 * t4 + e] = v[2 * jc + e];
        }
        bar_sync(SW_MATH, 128);
    };
    float oacc[8][8];
#pragma unroll
    for (int d = 0; d < 8; d++)
#pragma unroll
        for (int i = 0; i < 8; i++)
            oacc[d][i] = 0.0f;
    /* this thread's 4 head columns: 8 jc + 2 t4 + e, index 2 jc + e */
    float m_run[4], l_part[4];
#pragma unroll
    for (int c = 0; c < 4; c++) {
        m_run[c] = -INFINITY;
        l_part[c] = 0.0f;
    }
    const uint64_t dq = make_desc(sb + S::OFF_Q, 16, 1024, 1);
    const uint32_t pb = sb + S::OFF_P;
    for (int jb = 0; jb < nb; jb++) {
        const uint32_t kvs = sb + S::OFF_KV + (jb & 1) * S::STAGE;
        bar_sync(SW_FULL + (jb & 1), SW_THREADS);
        const int r0 = 16 * w + g;
        const bool ok0 = s_slot[jb * SW_BS + r0] >= 0, ok1 = s_slot[jb * SW_BS + r0 + 8] >= 0;
        float s[8];
        const uint64_t dk = make_desc(kvs, 16, 1024, 1);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ks++) {
            const int kc = ks >> 2, kb = (ks & 3) * 32;
            wgmma_ss_n16<0>(s, dk + (uint64_t)((kc * SW_BS * 128 + kb) >> 4),
                            dq + (uint64_t)((kc * 16 * 128 + kb) >> 4), ks > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence(s);
        /* s[4 jc + 2 rh + e]: slot r0 + 8 rh, head 8 jc + 2 t4 + e */
        float cm[4];
#pragma unroll
        for (int jc = 0; jc < 2; jc++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float v0 = ok0 ? s[4 * jc + e] * a.scale_log2 : -INFINITY;
                float v1 = ok1 ? s[4 * jc + 2 + e] * a.scale_log2 : -INFINITY;
                s[4 * jc + e] = v0;
                s[4 * jc + 2 + e] = v1;
                float m = fmaxf(v0, v1);
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
                cm[2 * jc + e] = m;
            }
        put_cols(s_cmax, cm);
        float alpha[4], base[4];
#pragma unroll
        for (int jc = 0; jc < 2; jc++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int c = 2 * jc + e, col = 8 * jc + 2 * t4 + e;
                const float bm = fmaxf(fmaxf(s_cmax[col], s_cmax[16 + col]), fmaxf(s_cmax[32 + col], s_cmax[48 + col]));
                const float mnew = fmaxf(m_run[c], bm);
                base[c] = mnew == -INFINITY ? 0.0f : mnew;
                alpha[c] = fast_exp2(m_run[c] - base[c]);
                m_run[c] = mnew;
                l_part[c] *= alpha[c];
            }
        /* P^T[head][slot] as bf16, 128-byte rows, unit XOR head % 8 */
#pragma unroll
        for (int jc = 0; jc < 2; jc++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int c = 2 * jc + e, col = 8 * jc + 2 * t4 + e;
#pragma unroll
                for (int rh = 0; rh < 2; rh++) {
                    const int slot = r0 + 8 * rh;
                    const __nv_bfloat16 p = __float2bfloat16_rn(fast_exp2(s[4 * jc + 2 * rh + e] - base[c]));
                    l_part[c] += __bfloat162float(p);
                    const uint32_t addr = pb + col * 128 + ((((slot >> 3) ^ (col & 7))) << 4) + (slot & 7) * 2;
                    asm volatile("st.shared.b16 [%0], %1;\n" ::"r"(addr), "h"(*reinterpret_cast<const unsigned short *>(&p)) : "memory");
                }
            }
        fence_proxy_async();
        bar_sync(SW_MATH, 128);
        /* O^T = alpha O^T + V^T P^T */
#pragma unroll
        for (int d = 0; d < 8; d++)
#pragma unroll
            for (int i = 0; i < 8; i++)
                oacc[d][i] *= alpha[2 * (i >> 2) + (i & 1)];
        const uint64_t dp = make_desc(pb, 16, 1024, 1);
        wgmma_fence();
#pragma unroll
        for (int d = 0; d < 8; d++) {
            const uint64_t dv = make_desc(kvs + d * SW_BS * 128, SW_BS * 128, 1024, 1);
#pragma unroll
            for (int ks = 0; ks < 4; ks++)
                wgmma_ss_n16<1>(oacc[d], dv + (uint64_t)((ks * 2048) >> 4), dp + (uint64_t)((ks * 32) >> 4), 1);
        }
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int d = 0; d < 8; d++)
            reg_fence(oacc[d]);
        if (jb + 2 < nb)
            bar_arrive(SW_EMPTY + (jb & 1), SW_THREADS);
    }
    /* row sums per head: over g, then over the warps */
    float inv[4], lse[4];
#pragma unroll
    for (int c = 0; c < 4; c++) {
        float l = l_part[c];
        l += __shfl_xor_sync(0xffffffffu, l, 4);
        l += __shfl_xor_sync(0xffffffffu, l, 8);
        l += __shfl_xor_sync(0xffffffffu, l, 16);
        l_part[c] = l;
    }
    put_cols(s_l, l_part);
#pragma unroll
    for (int jc = 0; jc < 2; jc++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int c = 2 * jc + e, col = 8 * jc + 2 * t4 + e;
            const float l = s_l[col] + s_l[16 + col] + s_l[32 + col] + s_l[48 + col];
            inv[c] = l > 0.0f ? 1.0f / l : 0.0f;
            lse[c] = l > 0.0f ? (m_run[c] + log2f(l)) * LN2 : -INFINITY;
            if (w == 0 && g == 0 && col < rows) {
                if (a.splits == 1) {
                    if (a.lse)
                        a.lse[(int64_t)(h0 + col) * a.l_sh + (int64_t)t * a.l_st] = lse[c];
                } else {
                    a.ws_lse[((int64_t)split * a.T + t) * a.H + h0 + col] = lse[c];
                }
            }
        }
    /* O^T -> [16 heads][512] bf16 in the (idle) stages, then whole rows */
    __nv_bfloat16 *stg = reinterpret_cast<__nv_bfloat16 *>(smem + S::OFF_KV);
#pragma unroll
    for (int d = 0; d < 8; d++)
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int c = 2 * (i >> 2) + (i & 1), col = 8 * (i >> 2) + 2 * t4 + (i & 1);
            const int dim = 64 * d + 16 * w + g + 8 * ((i >> 1) & 1);
            stg[col * S::O_LD + dim] = __float2bfloat16_rn(oacc[d][i] * inv[c]);
        }
    bar_sync(SW_MATH, 128);
    for (int u = tid; u < rows * (KV_L / 4); u += 128) {
        const int r = u / (KV_L / 4), cc = (u - r * (KV_L / 4)) * 4;
        const uint2 v = *reinterpret_cast<const uint2 *>(stg + r * S::O_LD + cc);
        if (a.splits == 1)
            *reinterpret_cast<uint2 *>(a.out + (int64_t)(h0 + r) * a.o_sh + (int64_t)t * a.o_st + cc) = v;
        else
            *reinterpret_cast<uint2 *>(a.ws_o + (((int64_t)split * a.T + t) * a.H + h0 + r) * KV_L + cc) = v;
    }
}

int g_mode = 1; /* b12x_wgmma_mode() */
int g_swg = 0; /* MLART_B12X_SWG */

} /* namespace */

extern "C" int b12x_wgmma_setup(const char **bad_env)
{
    g_mode = b12x_env_choice("MLART_B12X_WGMMA", 1, 0, 2, bad_env);
    g_swg = b12x_env_choice("MLART_B12X_SWG", 0, 0, 1, bad_env);
    cudaError_t e = cudaFuncSetAttribute((const void *)b12x_swg_kernel<false>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)SwSmem<false>::bytes(B12X_MAX_TOPK));
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute((const void *)b12x_swg_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)SwSmem<true>::bytes(B12X_MAX_TOPK));
    const void *fns[4] = {(const void *)b12x_wgmma_kernel<false, false>, (const void *)b12x_wgmma_kernel<true, false>,
                          (const void *)b12x_wgmma_kernel<false, true>, (const void *)b12x_wgmma_kernel<true, true>};
    for (int k = 0; k < 4 && e == cudaSuccess; k++)
        e = cudaFuncSetAttribute(fns[k], cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)((k & 1) ? WgSmem<true>::bytes(B12X_MAX_TOPK) : WgSmem<false>::bytes(B12X_MAX_TOPK)));
    return (int)e;
}

extern "C" int b12x_wgmma_resident(int *per_sm)
{
    /* the in-place instantiations, at the largest chunk; the fewest of both formats */
    int a = 0, b = 0;
    cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&a, b12x_wgmma_kernel<false, true>, NTHREADS,
                                                                  WgSmem<false>::bytes(B12X_MAX_TOPK));
    if (e == cudaSuccess)
        e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, b12x_wgmma_kernel<true, true>, NTHREADS,
                                                          WgSmem<true>::bytes(B12X_MAX_TOPK));
    *per_sm = a < b ? a : b;
    return (int)e;
}

extern "C" int b12x_wgmma_mode(void)
{
    return g_mode;
}

extern "C" size_t b12x_wgmma_smem(void)
{
    return WgSmem<true>::bytes(B12X_MAX_TOPK) > WgSmem<false>::bytes(B12X_MAX_TOPK)
               ? WgSmem<true>::bytes(B12X_MAX_TOPK)
               : WgSmem<false>::bytes(B12X_MAX_TOPK);
}

namespace {

/* The kernels' arguments for a step and its split, and a launch of T x
 * tiles x splits blocks with programmatic stream serialization when `pdl`
 * (`at` must outlive the launch). */
WgArgs split_args(const mlart_step *s, int splits, int tile_base, uint16_t *ws_o, float *ws_lse)
{
    WgArgs a;
    b12x::args_from_step(&a, s);
    a.ws_o = reinterpret_cast<__nv_bfloat16 *>(ws_o);
    a.ws_lse = ws_lse;
    a.tile_base = tile_base;
    b12x::set_splits(&a, splits);
    return a;
}

cudaLaunchConfig_t split_cfg(const WgArgs &a, int tiles, unsigned threads, size_t smem, int pdl, void *stream,
                             cudaLaunchAttribute *at)
{
    return mlart_launch_cfg(dim3((unsigned)a.T, (unsigned)tiles, (unsigned)a.splits), dim3(threads), smem,
                            (cudaStream_t)stream, pdl, at);
}

} /* namespace */

extern "C" int b12x_wgmma_launch(const mlart_step *s, int splits, int blocks_per_split,
                                 int tile_base, int tiles, uint16_t *ws_o, float *ws_lse, unsigned *bar,
                                 int pdl, void *stream)
{
    const bool fp8 = s->geom.kv_format == MLART_KV_FP8_DS_MLA;
    /* every chunk must own at least one block of slots: the kernel's
     * pipelines wait for their first stage unconditionally (with fp8 on a
     * raw-stage barrier that an empty chunk never arms) */
    if (splits < 1 || blocks_per_split < 1 || tiles < 1 ||
        (int64_t)(splits - 1) * blocks_per_split * BN >= (int64_t)s->geom.topk)
        return (int)cudaErrorInvalidValue;
    WgArgs a = split_args(s, splits, tile_base, ws_o, ws_lse);
    a.bar = bar;
    const int chunk = blocks_per_split * BN;
    cudaLaunchAttribute at[1];
    const cudaLaunchConfig_t cfg =
        split_cfg(a, tiles, NTHREADS, fp8 ? WgSmem<true>::bytes(chunk) : WgSmem<false>::bytes(chunk), pdl, stream, at);
    void (*fn)(WgArgs) = fp8 ? (bar ? b12x_wgmma_kernel<true, true> : b12x_wgmma_kernel<true, false>)
                             : (bar ? b12x_wgmma_kernel<false, true> : b12x_wgmma_kernel<false, false>);
    cudaError_t e = cudaLaunchKernelEx(&cfg, fn, a);
#ifdef B12X_WGMMA_PROF
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    cudaStreamIsCapturing((cudaStream_t)stream, &cs);
    if (getenv("B12X_PROF") && s->T == 64 && cs == cudaStreamCaptureStatusNone) {
        uint32_t h[2][12];
        cudaDeviceSynchronize();
        cudaMemcpyFromSymbol(h, g_prof, sizeof h);
        for (int w = 0; w < 2; w++) {
            fprintf(stderr, "PROF fp8=%d wg=%d nblk=%u total=%u", (int)fp8, w, h[w][0], h[w][1]);
            for (int k = 0; k < 10; k++) fprintf(stderr, " p%d=%u", k, h[w][2 + k]);
            fprintf(stderr, "\n");
        }
    }
#endif
    return (int)e;
}

extern "C" int b12x_swg_mode(void)
{
    return g_swg;
}

extern "C" int b12x_swg_launch(const mlart_step *s, int splits, int blocks_per_split, int tile_base,
                               uint16_t *ws_o, float *ws_lse, int pdl, void *stream)
{
    const bool fp8 = s->geom.kv_format == MLART_KV_FP8_DS_MLA;
    const WgArgs a = split_args(s, splits, tile_base, ws_o, ws_lse);
    const int chunk = blocks_per_split * BN;
    cudaLaunchAttribute at[1];
    const cudaLaunchConfig_t cfg =
        split_cfg(a, 1, SW_THREADS, fp8 ? SwSmem<true>::bytes(chunk) : SwSmem<false>::bytes(chunk), pdl, stream, at);
    return (int)(fp8 ? cudaLaunchKernelEx(&cfg, b12x_swg_kernel<true>, a)
                     : cudaLaunchKernelEx(&cfg, b12x_swg_kernel<false>, a));
}
