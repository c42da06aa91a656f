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
 * fence.proxy.async in the writing thread before its barrier. */
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
    /* + 1024: the dynamic window is aligned up to 1024 in the kernel */
    static constexpr size_t bytes(int chunk_slots) { return (size_t)OFF_SLOT + 4u * chunk_slots + 1024; }
    static_assert(bytes(B12X_MAX_TOPK) <= 232448, "over the sm_90 shared memory per block");
    static_assert(OFF_KV % 1024 == 0 && KV_STAGE % 1024 == 0, "stages start on swizzle atoms");
};

/* Named barriers (0 is __syncthreads). */
enum { BAR_FULL = 1, BAR_EMPTY = 4, BAR_PFULL = 7, BAR_PEMPTY = 9, BAR_LOAD = 11 };

using b12x::cp_async16;
using b12x::cp_async_commit;
using b12x::cp_async_wait;
using b12x::smem_u32;
using b12x::st_shared16;
using b12x::store_row16;

__device__ __forceinline__ void st_shared32(uint32_t addr, uint32_t v)
{
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ void bar_sync(int id, int n)
{
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

__device__ __forceinline__ void bar_arrive(int id, int n)
{
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

/* Ordinary shared-memory writes (and cp.async data) of this thread become
 * visible to the tensor cores' (async proxy) reads that follow a barrier. */
__device__ __forceinline__ void fence_proxy_async()
{
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* mbarrier of the fp8 raw stages: one arrival (with the expected bytes)
 * per phase, completed by the bulk copies' byte counts. */
__device__ __forceinline__ void mbar_init(uint32_t bar, int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity)
{
    asm volatile("{\n.reg .pred done;\nWAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT;\n}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
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

__device__ __forceinline__ void grid_dep_wait()
{
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

__device__ __forceinline__ void grid_dep_launch()
{
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
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

/* Keeps the compiler from moving reads or writes of an accumulator across
 * the wgmma issue/wait points (the registers belong to the tensor cores in
 * between). */
template <int N> __device__ __forceinline__ void reg_fence(float (&d)[N])
{
#pragma unroll
    for (int i = 0; i < N; i++)
        asm volatile("" : "+f"(d[i])::"memory");
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

template <bool FP8>
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
    const int k0 = ck.k0, kend = ck.kend, nblk = ck.nblk;
    int32_t *const s_slot = reinterpret_cast<int32_t *>(smem + S::OFF_SLOT);
    float *const s_alpha = reinterpret_cast<float *>(smem + S::OFF_ALPHA);
    float *const s_inv = reinterpret_cast<float *>(smem + S::OFF_INV);

    /* Programmatic dependent launch, as the mma.sync kernel: the slots
     * (inputs the previous kernel does not write) before the wait, the
     * query after it. */
    b12x::resolve_slots<NTHREADS>(a, t, k0, kend, nblk * BN, s_slot);
    if (FP8 && tid == 0) {
        for (int i = 0; i < S::NR; i++)
            mbar_init(sb + S::OFF_MBAR + 8 * i, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    grid_dep_wait();
    grid_dep_launch();

    /* Query rows of the tile; padding rows are zeros in shared memory only. */
    for (int u = tid; u < HT * ROW_CHUNKS; u += NTHREADS) {
        const int r = u / ROW_CHUNKS, c = u - r * ROW_CHUNKS;
        const uint32_t dst = sb + S::OFF_Q + tile_off(r, c, HT);
        if (r < rows)
            cp_async16(dst, a.q + (int64_t)t * a.q_st + (int64_t)(h0 + r) * a.q_sh + c * 8, 16);
        else
            st_shared16(dst, make_uint4(0, 0, 0, 0));
    }
    cp_async_commit();
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
}

int g_mode = 1; /* b12x_wgmma_mode() */

} /* namespace */

extern "C" int b12x_wgmma_setup(void)
{
    const char *env = getenv("MLART_B12X_WGMMA");
    g_mode = env && *env ? atoi(env) : 1;
    if (g_mode < 0 || g_mode > 2)
        g_mode = 1;
    cudaError_t e = cudaFuncSetAttribute((const void *)b12x_wgmma_kernel<false>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)WgSmem<false>::bytes(B12X_MAX_TOPK));
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute((const void *)b12x_wgmma_kernel<true>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)WgSmem<true>::bytes(B12X_MAX_TOPK));
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

extern "C" int b12x_wgmma_launch(const mlart_step *s, int splits, int blocks_per_split,
                                 int tile_base, int tiles, uint16_t *ws_o, float *ws_lse, int pdl,
                                 void *stream)
{
    const mlart_geometry *g = &s->geom;
    const bool fp8 = g->kv_format == MLART_KV_FP8_DS_MLA;
    WgArgs a;
    b12x::args_from_step(&a, s);
    a.ws_o = reinterpret_cast<__nv_bfloat16 *>(ws_o);
    a.ws_lse = ws_lse;
    a.tile_base = tile_base;
    a.blocks_per_split = blocks_per_split;
    a.splits = splits;

    const int chunk = blocks_per_split * BN;
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute at[1];
    cfg.gridDim = dim3((unsigned)s->T, (unsigned)tiles, (unsigned)splits);
    cfg.blockDim = dim3(NTHREADS);
    cfg.dynamicSmemBytes = fp8 ? WgSmem<true>::bytes(chunk) : WgSmem<false>::bytes(chunk);
    cfg.stream = (cudaStream_t)stream;
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = pdl ? 1 : 0;
    cudaError_t e = fp8 ? cudaLaunchKernelEx(&cfg, b12x_wgmma_kernel<true>, a)
                        : cudaLaunchKernelEx(&cfg, b12x_wgmma_kernel<false>, a);
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
