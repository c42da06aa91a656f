/* Query absorption on sm_90a with wgmma, both operands in shared memory
 * (ops/bmm_cuda.h; design and numbers in docs/ops.md): path MLART_BMM_WGMMA
 * for prefill-sized T, described here (at K = 512, the V up-projection's,
 * by bmm_kstream_kernel below), path MLART_BMM_RING for
 * 33 <= T <= 64, described at bmm_ring_kernel below, and path
 * MLART_BMM_SWAP for few token rows, described at bmm_swap_kernel.
 *
 * c[h,t,n0:n0+BN] = a[h,t,:] (1xK) x w[h][:, n0:n0+BN], K = 64*KB <= 192,
 * BN = 256 or 128 columns a slice.
 *
 * A persistent grid walks items (head h, BN-column slice, chunk of 64-row
 * tiles).  At an item's start the whole block copies the weight slice
 * (K x BN bf16, 16-96 KB) into shared memory once, in one cp.async group
 * per 64 rows of K, so the first tile's MMAs start on the first group; then
 * each of its NWG (1 or 2) warpgroups takes every NWG-th row tile of the
 * chunk on its own: the next tile's activation rows (64 x K) arrive by
 * cp.async into the warpgroup's second stage while the current one runs K/16
 * wgmma m64nBNk16 and its 64 x BN result leaves the registers.  The
 * warpgroups share nothing but the weights, so one computes while another's
 * stores drain: that is the overlap of the streaming tile (few MMAs, a 32 KB
 * result per 24 KB read).
 *
 * Shared-memory layouts (128-byte swizzle, every region 1024-byte aligned):
 *   weights, N-major: BN/64 blocks of 64 columns, K rows x 128 bytes each;
 *     chunk c (8 columns) of row k sits at block + 128k + 16*(c ^ (k & 7)).
 *     Descriptor: SBO 1024 (next 8 rows of K), LBO 128K (next 64 columns);
 *     k-step s starts 2048*s bytes in.
 *   activation, K-major: K/64 blocks of 64 rows x 128 bytes; chunk c of row
 *     r at block + 128r + 16*(c ^ (r & 7)).  Descriptor: SBO 1024 (next 8
 *     rows), LBO unused; k-step s starts at block s/4, 32*(s%4) bytes in.
 *
 * Read-exact: weight copies cover rows k < K and the slice's BN columns (N
 * is a multiple of BN); activation rows t >= T are cp.async with src-size 0
 * (no byte read, zeros written) at row 0 of the same head; nothing between
 * the rows of a strided view is touched.  Writes: t < T, n < N, and the q_pe
 * rows of the item's head (each column slice copies its share). */
#include <cuda.h> /* CUtensorMap and its enums only: cuTensorMapEncodeTiled comes through the runtime */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <type_traits>

#include "ops/bmm_cuda.h"
#include "runtime/cuda_async.h"
#include "runtime/cuda_launch.h"

namespace {

/* cp.async writes are generic-proxy writes and wgmma reads through the
 * async proxy: each writing thread runs fence_proxy_async before the
 * barrier that publishes its writes. */
using mlart_sm90::fence_proxy_async;
using mlart_sm90::mbar_arrive;
using mlart_sm90::mbar_expect_tx;
using mlart_sm90::mbar_init;
using mlart_sm90::mbar_wait;
using mlart_sm90::reg_fence;

constexpr int WG_BM = 64; /* rows per warpgroup tile (wgmma M) */

struct WParams {
    int64_t T;
    const __nv_bfloat16 *a;
    int64_t a_sh, a_st;
    const __nv_bfloat16 *w;
    int64_t w_sh, w_sk;
    __nv_bfloat16 *c;
    int64_t c_sh, c_st;
    const __nv_bfloat16 *pe_in;
    __nv_bfloat16 *pe_out;
    int64_t R, pi_st, pi_sh, po_st, po_sh;
    int c_vec8; /* c rows may be written 8 bytes at a time */
    int c_vec16; /* c rows may be written 16 bytes at a time */
    int pe_vec; /* q_pe rows copied 16 bytes at a time */
    int nslice; /* N / BN */
    int splits; /* row-tile chunks per (head, slice) */
    int rt;     /* 64-row tiles per head */
    int items;  /* H * splits * nslice */
};

__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
/* wait until at most n (0..3, folded at compile time) groups are pending */
__device__ __forceinline__ void cp_async_wait_upto(int n)
{
    switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    }
}

__device__ __forceinline__ void named_bar_sync(int id, int threads)
{
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo)
{
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
           ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62); /* 62-63: 128-byte swizzle */
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* d (+)= A[64 x 16] x B[16 x 256]; A K-major, B N-major (imm-trans-b 1). */
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t da, uint64_t db, int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7,"
                 "%8, %9, %10, %11, %12, %13, %14, %15,"
                 "%16, %17, %18, %19, %20, %21, %22, %23,"
                 "%24, %25, %26, %27, %28, %29, %30, %31,"
                 "%32, %33, %34, %35, %36, %37, %38, %39,"
                 "%40, %41, %42, %43, %44, %45, %46, %47,"
                 "%48, %49, %50, %51, %52, %53, %54, %55,"
                 "%56, %57, %58, %59, %60, %61, %62, %63,"
                 "%64, %65, %66, %67, %68, %69, %70, %71,"
                 "%72, %73, %74, %75, %76, %77, %78, %79,"
                 "%80, %81, %82, %83, %84, %85, %86, %87,"
                 "%88, %89, %90, %91, %92, %93, %94, %95,"
                 "%96, %97, %98, %99, %100, %101, %102, %103,"
                 "%104, %105, %106, %107, %108, %109, %110, %111,"
                 "%112, %113, %114, %115, %116, %117, %118, %119,"
                 "%120, %121, %122, %123, %124, %125, %126, %127"
                 "}, %128, %129, p, 1, 1, 0, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]),
                   "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
                   "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
                   "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
                   "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
                   "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]),
                   "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
                   "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
                   "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]),
                   "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
                   "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]),
                   "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
                   "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
                   "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
                   "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]),
                   "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
                   "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]),
                   "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
                   "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]),
                   "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
                   "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
                   "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
                   "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]),
                   "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
                 : "l"(da), "l"(db), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t da, uint64_t db, int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7,"
                 "%8, %9, %10, %11, %12, %13, %14, %15,"
                 "%16, %17, %18, %19, %20, %21, %22, %23,"
                 "%24, %25, %26, %27, %28, %29, %30, %31,"
                 "%32, %33, %34, %35, %36, %37, %38, %39,"
                 "%40, %41, %42, %43, %44, %45, %46, %47,"
                 "%48, %49, %50, %51, %52, %53, %54, %55,"
                 "%56, %57, %58, %59, %60, %61, %62, %63"
                 "}, %64, %65, p, 1, 1, 0, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]),
                   "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
                   "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
                   "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
                   "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
                   "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]),
                   "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
                   "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(da), "l"(db), "r"(accumulate));
}

/* TA, TB: imm-trans-a and imm-trans-b (the ring reads B N-major, the swap
 * path A M-major). */
template <int TA = 0, int TB = 1>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], uint64_t da, uint64_t db, int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7,"
                 "%8, %9, %10, %11, %12, %13, %14, %15,"
                 "%16, %17, %18, %19, %20, %21, %22, %23,"
                 "%24, %25, %26, %27, %28, %29, %30, %31"
                 "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]),
                   "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
                   "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
                   "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(da), "l"(db), "r"(accumulate), "n"(TA), "n"(TB));
}

__device__ __forceinline__ void wgmma_bn(float (&d)[128], uint64_t da, uint64_t db, int accumulate)
{
    wgmma_m64n256k16(d, da, db, accumulate);
}
__device__ __forceinline__ void wgmma_bn(float (&d)[64], uint64_t da, uint64_t db, int accumulate)
{
    wgmma_m64n128k16(d, da, db, accumulate);
}
__device__ __forceinline__ void wgmma_bn(float (&d)[32], uint64_t da, uint64_t db, int accumulate)
{
    wgmma_m64n64k16(d, da, db, accumulate);
}

/* acc = one 64-row activation stage at `as` (64 x K) times the weight slice
 * at `ws` (K x BN): all K/16 steps, issued and waited for. */
template <int KB, int BN> __device__ __forceinline__ void mma_tile(float (&acc)[BN / 2], uint32_t as, uint32_t ws)
{
    constexpr int K = 64 * KB;
    reg_fence(acc);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        const uint64_t da = smem_desc(as + (kk >> 2) * (WG_BM * 128) + (kk & 3) * 32, 16, 1024);
        const uint64_t db = smem_desc(ws + kk * 2048, K * 128, 1024);
        wgmma_bn(acc, da, db, kk > 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    reg_fence(acc);
}

/* K block b (64 rows of K) of a 64-row activation stage at `as` times the
 * weights at `ws`, once its copy group has landed: wait until at most
 * `pending` later groups are in flight, make every thread's copies visible
 * to the tensor cores, then issue its four wgmma (neither committed nor
 * waited for).  The k-steps from HALF on go to `hi`, which starts at zero
 * at step HALF (the sum of two warps splitting K, as the direct kernel
 * splits it; HALF = K/16: everything to `acc`). */
template <int KB, int BN, int HALF>
__device__ __forceinline__ void mma_kblock(float (&acc)[BN / 2], float (&hi)[BN / 2], uint32_t as, uint32_t ws, int b,
                                           int pending)
{
    constexpr int K = 64 * KB;
    cp_async_wait_upto(pending);
    fence_proxy_async();
    __syncthreads();
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int kk = 4 * b; kk < 4 * b + 4; kk++) {
        const uint64_t da = smem_desc(as + (kk >> 2) * (WG_BM * 128) + (kk & 3) * 32, 16, 1024);
        const uint64_t db = smem_desc(ws + kk * 2048, K * 128, 1024);
        if (kk < HALF)
            wgmma_bn(acc, da, db, kk > 0);
        else
            wgmma_bn(hi, da, db, kk > HALF);
    }
}
template <int KB, int BN>
__device__ __forceinline__ void mma_kblock(float (&acc)[BN / 2], uint32_t as, uint32_t ws, int b, int pending)
{
    mma_kblock<KB, BN, 4 * KB>(acc, acc, as, ws, b, pending);
}
#endif

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

/* Rows [t0, t0 + 64) of a[h] into one activation stage, by the 128 threads
 * of a warpgroup (wt = thread in the warpgroup); NB 64-column blocks of K
 * from block B0.  Consecutive threads take consecutive 16-byte chunks of a
 * row: each row's share is one contiguous run. */
template <int NB>
__device__ __forceinline__ void load_a_tile(const WParams &p, int64_t h, int64_t t0, uint32_t stage, int wt, int b0)
{
    constexpr int CH = 8 * NB; /* 16-byte chunks per row */
    const __nv_bfloat16 *ah = p.a + h * p.a_sh + b0 * 64;
    stage += b0 * (WG_BM * 128);
#pragma unroll
    for (int u = 0; u < WG_BM * CH / 128; u++) {
        const int i = wt + 128 * u, r = i / CH, kc = i % CH;
        const int64_t t = t0 + r;
        const bool ok = t < p.T;
        const uint32_t dst = stage + (kc >> 3) * (WG_BM * 128) + r * 128 + (((kc & 7) ^ (r & 7)) << 4);
        cp_async16(dst, ok ? ah + t * p.a_st + kc * 8 : ah + kc * 8, ok ? 16 : 0);
    }
}

/* q_pe rows [t0, t1) of head h, by the 128 threads of a warpgroup: four
 * 16-byte loads in flight per thread before their stores. */
__device__ __forceinline__ void pe_copy_wg(const WParams &p, int64_t h, int64_t t0, int64_t t1, int wt)
{
    if (t1 > p.T)
        t1 = p.T;
    if (p.pe_vec) {
        const int64_t chunks = p.R / 8, total = (t1 - t0) * chunks;
        for (int64_t base = wt; base < total; base += 4 * 128) {
            uint4 v[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int64_t i = base + u * 128;
                if (i < total) {
                    const int64_t t = t0 + i / chunks, r = (i % chunks) * 8;
                    v[u] = *(const uint4 *)(p.pe_in + t * p.pi_st + h * p.pi_sh + r);
                }
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int64_t i = base + u * 128;
                if (i < total) {
                    const int64_t t = t0 + i / chunks, r = (i % chunks) * 8;
                    *(uint4 *)(p.pe_out + t * p.po_st + h * p.po_sh + r) = v[u];
                }
            }
        }
    } else {
        for (int64_t i = wt; i < (t1 - t0) * p.R; i += 128) {
            const int64_t t = t0 + i / p.R, r = i % p.R;
            p.pe_out[t * p.po_st + h * p.po_sh + r] = p.pe_in[t * p.pi_st + h * p.pi_sh + r];
        }
    }
}

/* The 64 x BN result of a warpgroup's tile, rows t0.., columns n0..: to c
 * (rows t < T only), then this column slice's share of the tile's q_pe
 * rows (64 / nslice of them, rounded up). */
template <int BN>
__device__ __forceinline__ void store_tile(const WParams &p, const float (&acc)[BN / 2], int64_t h, int64_t t0,
                                           int64_t n0, int nh, int wt)
{
    const int warp = wt >> 5, lane = wt & 31, g = lane >> 2, q = lane & 3;
    const bool odd = (q & 1) != 0;
    /* Accumulator j*4+e of lane (g, q): row 16*warp + g (+8 for e >= 2),
     * column 8j + 2q + (e & 1).  Lanes q and q^1 swap one packed
     * pair so each lane holds four consecutive columns: a quad
     * writes 32 contiguous bytes of a row, one whole sector. */
    const int64_t rowa = t0 + warp * 16 + g;
    __nv_bfloat16 *cbase = p.c + h * p.c_sh + n0 + (odd ? 8 : 0) + (q >> 1) * 4;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int64_t row = rowa + 8 * hf;
        __nv_bfloat16 *crow = cbase + row * p.c_st;
        const bool ok = row < p.T;
#pragma unroll
        for (int jp = 0; jp < BN / 16; jp++) {
            const uint32_t w0 = pack_bf16(acc[8 * jp + 2 * hf], acc[8 * jp + 2 * hf + 1]);
            const uint32_t w1 = pack_bf16(acc[8 * jp + 4 + 2 * hf], acc[8 * jp + 5 + 2 * hf]);
            const uint32_t recv = __shfl_xor_sync(0xffffffffu, odd ? w0 : w1, 1);
            const uint32_t lo = odd ? recv : w0, hi = odd ? w1 : recv;
            if (ok) {
                __nv_bfloat16 *dst = crow + 16 * jp;
                if (p.c_vec8) {
                    *(uint2 *)dst = make_uint2(lo, hi);
                } else {
                    const __nv_bfloat16 *b = (const __nv_bfloat16 *)&lo;
                    const __nv_bfloat16 *e = (const __nv_bfloat16 *)&hi;
                    dst[0] = b[0];
                    dst[1] = b[1];
                    dst[2] = e[0];
                    dst[3] = e[1];
                }
            }
        }
    }
    if (p.pe_in) {
        /* column slice nh copies its share of the tile's q_pe rows */
        const int per = (WG_BM + p.nslice - 1) / p.nslice;
        const int64_t r0 = t0 + (int64_t)nh * per;
        if (r0 < t0 + WG_BM)
            pe_copy_wg(p, h, r0, r0 + per < t0 + WG_BM ? r0 + per : t0 + WG_BM, wt);
    }
}

template <int KB, int NWG, int BN>
__global__ void __launch_bounds__(128 * NWG, 1) bmm_wgmma_kernel(const __grid_constant__ WParams p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int K = 64 * KB, CPR = BN / 8; /* CPR: 16-byte chunks per weight row */
    constexpr uint32_t W_BYTES = (uint32_t)K * BN * 2, A_STAGE = (uint32_t)WG_BM * K * 2;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t ws = (smem_u32(smem_raw) + 1023u) & ~1023u; /* swizzle atoms start on 1024 */
    const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127;
    const uint32_t as0 = ws + W_BYTES + (uint32_t)wg * 2 * A_STAGE;
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; i++)
        acc[i] = 0.f;

    for (int item = blockIdx.x; item < p.items; item += gridDim.x) {
        const int nh = item % p.nslice, rest = item / p.nslice;
        const int s = rest % p.splits;
        const int64_t h = rest / p.splits;
        const int r0 = (int)((int64_t)s * p.rt / p.splits), r1 = (int)((int64_t)(s + 1) * p.rt / p.splits);
        const int64_t n0 = (int64_t)nh * BN;

        __syncthreads(); /* every MMA of the previous item is done: weights and stages are free */
        /* One cp.async group per 64-row block of K: the weight rows of the
         * block (the whole block copies) and the same K columns of each
         * warpgroup's first tile; then the second tiles.  The first tile's
         * MMAs on block b start as soon as group b has landed. */
        const __nv_bfloat16 *wh = p.w + h * p.w_sh + n0;
        const int tile0 = r0 + wg;
        const bool has0 = tile0 < r1;
#pragma unroll
        for (int b = 0; b < KB; b++) {
#pragma unroll 4
            for (int i = tid; i < 64 * CPR; i += 128 * NWG) {
                const int k = 64 * b + (int)((unsigned)i / CPR), cc = (int)((unsigned)i % CPR);
                const uint32_t dst = ws + (cc >> 3) * (uint32_t)(K * 128) + k * 128 + (((cc & 7) ^ (k & 7)) << 4);
                cp_async16(dst, wh + (int64_t)k * p.w_sk + cc * 8, 16);
            }
            if (has0)
                load_a_tile<1>(p, h, (int64_t)tile0 * WG_BM, as0, wt, b);
            cp_async_commit();
        }
        if (tile0 + NWG < r1)
            load_a_tile<KB>(p, h, (int64_t)(tile0 + NWG) * WG_BM, as0 + A_STAGE, wt, 0);
        cp_async_commit();

        /* First tile: every warpgroup issues the MMAs, with a tile or not
         * (without one it multiplies stale shared memory and stores
         * nothing), so no wgmma sits in a branch the compiler must treat as
         * divergent. */
        reg_fence(acc);
        /* blocks after b and the second tiles may still fly; the barrier
         * covers weight block b, copied by every warpgroup */
#pragma unroll
        for (int b = 0; b < KB; b++)
            mma_kblock<KB, BN>(acc, as0, ws, b, KB - b);
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        reg_fence(acc);
        if (has0)
            store_tile<BN>(p, acc, h, (int64_t)tile0 * WG_BM, n0, nh, wt);

        int idx = 1;
        for (int tile = tile0 + NWG; tile < r1; tile += NWG, idx++) {
            const uint32_t as = as0 + (uint32_t)(idx & 1) * A_STAGE;
            const int64_t t0 = (int64_t)tile * WG_BM;
            cp_async_wait_all();
            fence_proxy_async();
            named_bar_sync(1 + wg, 128); /* this stage landed; the other one is no longer read */
            if (tile + NWG < r1)
                load_a_tile<KB>(p, h, t0 + NWG * WG_BM, as0 + (uint32_t)((idx + 1) & 1) * A_STAGE, wt, 0);
            cp_async_commit();
            mma_tile<KB, BN>(acc, as, ws);
            store_tile<BN>(p, acc, h, t0, n0, nh, wt);
        }
    }
    cp_async_wait_all();
#else
    __trap(); /* built without sm_90a: mlart_bmm_wgmma_ok refuses the path */
#endif
}

/* Decode-sized shapes (33 <= T <= 64 by default): a ring of NST
 * shared-memory stages per block.
 *
 * Items are (head, 64-row tile, BN-column slice), slice fastest; each block
 * of one warpgroup takes a contiguous run of them.  A stage holds one item's
 * weight slice (K x BN, layout as above) and its activation tile (64 x K,
 * rows past T zero-filled without a read).  The copies of the next NST - 1
 * items are in flight while the current item runs its K/16 wgmma and its
 * result leaves the registers, so the loads of later items overlap the
 * stores of earlier ones; with NST = 1 that overlap comes from the other
 * blocks of the SM instead (up to four, each copying, multiplying and
 * storing one item after the other).  Every warp copies: a single producer
 * warp (cp.async, or one thread issuing TMA boxes) streamed slower in the
 * variants table, docs/ops.md. */
template <int N> __device__ __forceinline__ void cp_async_wait_n()
{
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

template <int KB, int BN>
__device__ __forceinline__ void ring_load(const WParams &p, int item, uint32_t stage, int tid)
{
    constexpr int K = 64 * KB, CPR = BN / 8;
    const int nh = item % p.nslice, rest = item / p.nslice;
    const int tile = rest % p.rt;
    const int64_t h = rest / p.rt;
    const __nv_bfloat16 *wh = p.w + h * p.w_sh + (int64_t)nh * BN;
#pragma unroll
    for (int u = 0; u < K * CPR / 128; u++) {
        const int i = tid + 128 * u, k = i / CPR, cc = i % CPR;
        const uint32_t dst = stage + (cc >> 3) * (uint32_t)(K * 128) + k * 128 + (((cc & 7) ^ (k & 7)) << 4);
        cp_async16(dst, wh + (int64_t)k * p.w_sk + cc * 8, 16);
    }
    load_a_tile<KB>(p, h, (int64_t)tile * WG_BM, stage + (uint32_t)(K * BN * 2), tid, 0);
}

/* Blocks an SM the registers are sized for: three or four one-stage
 * blocks (three at K = 192 with 128-column slices, whose stage is 72 KB),
 * two two-stage blocks, else one. */
constexpr int ring_min_blocks(int kb, int bn, int nst) { return nst == 1 ? (kb * bn > 256 ? 3 : 4) : nst == 2 ? 2 : 1; }

template <int KB, int BN, int NST>
__global__ void __launch_bounds__(128, ring_min_blocks(KB, BN, NST)) bmm_ring_kernel(const __grid_constant__ WParams p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int K = 64 * KB;
    constexpr uint32_t W_BYTES = (uint32_t)K * BN * 2, ST_BYTES = W_BYTES + (uint32_t)WG_BM * K * 2;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const int tid = threadIdx.x;
    const int i0 = (int)((int64_t)blockIdx.x * p.items / gridDim.x);
    const int i1 = (int)((int64_t)(blockIdx.x + 1) * p.items / gridDim.x);
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; i++)
        acc[i] = 0.f;
    /* Launched with programmatic dependent launch, wait for the previous
     * kernel of the stream and its memory before reading anything (a no-op
     * otherwise); then let the next kernel be scheduled, as the direct
     * kernel does (ops/query_bmm.cu): its own wait still covers all of this
     * kernel. */
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    /* one commit group per item, empty ones included, so that "all but the
     * newest NST - 2 groups" is always "up to the current item" */
#pragma unroll
    for (int j = 0; j < NST - 1; j++) {
        if (i0 + j < i1)
            ring_load<KB, BN>(p, i0 + j, base + (uint32_t)j * ST_BYTES, tid);
        cp_async_commit();
    }
    int cur = 0; /* stage of item `it` */
    for (int it = i0; it < i1; it++) {
        const uint32_t st = base + (uint32_t)cur * ST_BYTES;
        if constexpr (NST == 1) {
            /* one stage: every thread is past the previous item's wgmma
             * wait before the stage is refilled, then the item lands */
            __syncthreads();
            ring_load<KB, BN>(p, it, st, tid);
            cp_async_commit();
            cp_async_wait_all();
            fence_proxy_async();
            __syncthreads();
        } else {
            cp_async_wait_n<NST - 2>();
            fence_proxy_async();
            /* item it has landed (every thread's copies), and every thread
             * is past the previous item's wgmma wait: its stage may be
             * refilled */
            __syncthreads();
            const int prev = cur == 0 ? NST - 1 : cur - 1;
            if (it + NST - 1 < i1)
                ring_load<KB, BN>(p, it + NST - 1, base + (uint32_t)prev * ST_BYTES, tid);
            cp_async_commit();
        }
        mma_tile<KB, BN>(acc, st + W_BYTES, st);
        const int nh = it % p.nslice, rest = it / p.nslice;
        store_tile<BN>(p, acc, rest / p.rt, (int64_t)(rest % p.rt) * WG_BM, (int64_t)nh * BN, nh, tid);
        cur = cur == NST - 1 ? 0 : cur + 1;
    }
    cp_async_wait_all();
#else
    __trap(); /* built without sm_90a: mlart_bmm_ring_ok refuses the path */
#endif
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* Every K block of the one-item form as its copy group lands, committed
 * per block, then waited for: k-steps before HALF into acc, the rest into
 * hi (the same array where HALF = K/16). */
template <int KB, int BN, int HALF>
__device__ __forceinline__ void ring1_mma(float (&acc)[BN / 2], float (&hi)[BN / 2], uint32_t as, uint32_t ws)
{
    reg_fence(acc);
    reg_fence(hi);
#pragma unroll
    for (int b = 0; b < KB; b++) { /* block b landed, later ones may fly */
        mma_kblock<KB, BN, HALF>(acc, hi, as, ws, b, KB - 1 - b);
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    reg_fence(acc);
    reg_fence(hi);
}
#endif

/* The ring's one-item form (config `warps` = 1): a block per item, and the
 * item's K blocks in copy groups of their own (the weight rows of the block
 * and the same K columns of the activation tile), so the wgmma of block b
 * start as soon as it has landed while the later blocks still fly, as the
 * first tile of bmm_wgmma_kernel does.  Launched with programmatic
 * dependent launch (EARLY) the weight rows are copied before the wait, in
 * groups of their own, as the direct kernel and the swap path do (the
 * weights must not be written by the previous kernel); else nothing is
 * read before it.  HALVES (config `warps` = 2, 64-column slices): the two
 * halves of K summed apart and added at the end, the sum of the direct
 * kernel with two warps splitting K, so that the two give the same bytes
 * (a launch with PDL may take this form where a plain launch takes that
 * kernel; the layer's early_weights must not change a byte). */
template <int KB, int BN, bool EARLY, bool HALVES>
__global__ void __launch_bounds__(128, 4) bmm_ring1_kernel(const __grid_constant__ WParams p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int K = 64 * KB, CPR = BN / 8;
    constexpr uint32_t W_BYTES = (uint32_t)K * BN * 2;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t ws = (smem_u32(smem_raw) + 1023u) & ~1023u, as = ws + W_BYTES;
    const int tid = threadIdx.x, it = blockIdx.x;
    const int nh = it % p.nslice, rest = it / p.nslice;
    const int64_t h = rest / p.rt, t0 = (int64_t)(rest % p.rt) * WG_BM;
    const __nv_bfloat16 *wh = p.w + h * p.w_sh + (int64_t)nh * BN;
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; i++)
        acc[i] = 0.f;
    /* Copy groups: without EARLY one per K block b (its weight rows and
     * the tile's same K columns), waited for down to KB - 1 - b pending;
     * with EARLY the KB weight groups first, then the KB tile groups,
     * which the same count waits for (and every weight group with them). */
#pragma unroll
    for (int b = 0; b < KB; b++) {
        if (!EARLY && b == 0) {
            asm volatile("griddepcontrol.wait;" ::: "memory");
            asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
        }
#pragma unroll
        for (int u = 0; u < 64 * CPR / 128; u++) {
            const int i = tid + 128 * u, k = 64 * b + i / CPR, cc = i % CPR;
            const uint32_t dst = ws + (cc >> 3) * (uint32_t)(K * 128) + k * 128 + (((cc & 7) ^ (k & 7)) << 4);
            cp_async16(dst, wh + (int64_t)k * p.w_sk + cc * 8, 16);
        }
        if (!EARLY)
            load_a_tile<1>(p, h, t0, as, tid, b);
        cp_async_commit();
    }
    if (EARLY) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#pragma unroll
        for (int b = 0; b < KB; b++) {
            load_a_tile<1>(p, h, t0, as, tid, b);
            cp_async_commit();
        }
    }
    if constexpr (HALVES) {
        float hi[BN / 2];
#pragma unroll
        for (int i = 0; i < BN / 2; i++)
            hi[i] = 0.f;
        ring1_mma<KB, BN, 2 * KB>(acc, hi, as, ws);
#pragma unroll
        for (int i = 0; i < BN / 2; i++)
            acc[i] += hi[i];
    } else {
        ring1_mma<KB, BN, 4 * KB>(acc, acc, as, ws);
    }
    store_tile<BN>(p, acc, h, t0, (int64_t)nh * BN, nh, tid);
#else
    __trap(); /* built without sm_90a: mlart_bmm_ring_ok refuses the path */
#endif
}

/* Decode with few token rows (T <= 16 and 33 <= T <= 64 by the automatic
 * choice, at many heads or P = 192): the weight stream of the product, fed
 * by the tensor memory accelerator (TMA).
 *
 * Swap the operands: c[h]^T (N x T) = w[h]^T (N x K) x a[h]^T (K x T), so
 * the weights are wgmma's A operand (M = 64 columns of w a wgmma, read
 * M-major with imm-trans-a) and the few token rows its N = NT (8, 16 or 64):
 * no MMA row is padding however small T is.  Items are (head, tile of NT
 * token rows, BM-column block), block fastest; each block (one per SM)
 * takes a contiguous run of them and cuts each into K/64 units.  A unit is
 * one stage of the ring: one box of 64 weight rows x BM columns (the map
 * cuts N into 64-column blocks, so one copy fills BM/64 swizzle atoms) and
 * one box of NT token rows x 64 of K, both written by the TMA straight into
 * the 128-byte-swizzled layouts the descriptors read.  One thread (warp 4)
 * issues every copy, as far ahead as there are stages (NST x 34 KB at
 * BM = 256: about the whole share of an SM at 128 heads), so the weights
 * stream at the rate of the memory system instead of the registers a
 * thread can hold.  The warpgroup waits for a unit's `full` barrier, runs
 * its 4 x BM/64 wgmma, releases the stage on `empty` (one arrival a warp),
 * and after the item's last unit writes the NT x BM result transposed
 * into shared memory (stmatrix) and from there as 16-byte row chunks.
 *
 * Read-exact: the two tensor maps describe exactly the views' elements
 * (weights {64, K, N/64, H}, activation {K, H, T}, or {K, T, H} when the
 * view is head-major, as the V up-projection's); token rows t >= T lie outside
 * the map, where the TMA writes zeros and reads nothing.  Writes: t < T,
 * n < N, and the q_pe rows of the item's tile (by column block 0). */
constexpr int SWAP_THREADS = 160;

struct SwapParams {
    CUtensorMap tw; /* weights: dims {64, K, N / 64, H}, box {64, 64, BM / 64, 1} */
    CUtensorMap ta; /* activation view: dims {K, H, T}, box {64, 1, NT}; head-major views
                     * (the V up-projection's [H,T,L]) {K, T, H}, box {64, NT, 1} */
    WParams p;
    int nblk;       /* N / BM */
    int ntt;        /* token tiles of NT rows */
    int a_headmaj;  /* ta is {K, T, H} */
    int w_early;    /* launched with PDL: the weights of the first
                     * min(w_early, NST) units are copied before the
                     * dependency wait (0: none) */
};

/* Item `it` of the swap grid: column block nb, token tile tt, head h
 * (column block fastest). */
struct SwapItem {
    int nb, tt, h;
};
__device__ __forceinline__ SwapItem swap_item(const SwapParams &sp, int it)
{
    const int r = it / sp.nblk;
    return {it % sp.nblk, r % sp.ntt, r / sp.ntt};
}

__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2, uint32_t bar)
{
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst),
                 "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
                 : "memory");
}
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2, int c3,
                                            uint32_t bar)
{
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(dst),
                 "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
                 : "memory");
}

/* After K block b's wgmma are issued: commit them and, from the second
 * block on, wait until at most this group is in flight and release the
 * previous block's stage (`empty` counts one arrival a warp). */
__device__ __forceinline__ void wgmma_commit_release(int b, int lane, uint32_t prev_empty)
{
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    if (b > 0) {
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
        if (lane == 0)
            mbar_arrive(prev_empty); /* this warp no longer reads that stage */
    }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* d (+)= A[64 x 16] x B[16 x NT]: A M-major (imm-trans-a 1), B K-major. */
__device__ __forceinline__ void wgmma_swap(float (&d)[8], uint64_t da, uint64_t db, int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "l"(da), "l"(db), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_swap(float (&d)[32], uint64_t da, uint64_t db, int accumulate)
{
    wgmma_m64n64k16<1, 0>(d, da, db, accumulate);
}
__device__ __forceinline__ void wgmma_swap(float (&d)[4], uint64_t da, uint64_t db, int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3}, %4, %5, p, 1, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "l"(da), "l"(db), "r"(accumulate));
}
#endif

/* Shared memory of the swap kernel: NST stages of (BM x 64 weights + NT x
 * 64 activation), the NT x BM result (row pitch BM + 8 elements), the
 * alignment slack. */
__host__ __device__ constexpr size_t swap_stage(int bm, int nt) { return (size_t)128 * (bm + nt); }
__host__ __device__ constexpr size_t swap_smem(int bm, int nt, int nst)
{
    return (size_t)nst * swap_stage(bm, nt) + (size_t)nt * (bm + 8) * 2 + 1024;
}

template <int KB, int BM, int NT, int NST, bool EARLY>
__global__ void __launch_bounds__(SWAP_THREADS, 1) bmm_swap_kernel(const __grid_constant__ SwapParams sp)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int MW = BM / 64;                       /* wgmma M blocks an item */
    constexpr uint32_t ST = (uint32_t)swap_stage(BM, NT); /* a multiple of 1024 */
    constexpr int OP = BM + 8;                        /* result row pitch, elements */
    const WParams &p = sp.p;
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) uint64_t bars[2 * NST]; /* full[s], then empty[s] */
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    __nv_bfloat16 *outs = (__nv_bfloat16 *)(smem_raw + (base - smem_u32(smem_raw)) + NST * ST);
    const uint32_t full0 = smem_u32(&bars[0]), empty0 = smem_u32(&bars[NST]);
    const int tid = threadIdx.x;
    /* warp-uniform as far as the compiler can tell: the wgmma below are not
     * in a divergent branch */
    const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    const int i0 = (int)((int64_t)blockIdx.x * p.items / gridDim.x);
    const int i1 = (int)((int64_t)(blockIdx.x + 1) * p.items / gridDim.x);
    if (warp == 4) { /* the producer: one thread */
        if (tid == 128) {
            /* The producer initialises the barriers and starts copying at
             * once; the warpgroup waits on named barrier 2 for the
             * initialisation only.  The tensor maps are kernel parameters
             * and the barriers shared memory, so this much may run before
             * the previous kernel of the stream has finished. */
            asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&sp.tw) : "memory");
            asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&sp.ta) : "memory");
#pragma unroll
            for (int s = 0; s < NST; s++) {
                mbar_init(full0 + 8 * s, 1);
                mbar_init(empty0 + 8 * s, 4);
            }
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncwarp();
        asm volatile("bar.arrive 2, 160;" ::: "memory");
    }
    /* With programmatic dependent launch (EARLY, w_early), the producer
     * also copies the weights of its first units (up to one lap of the
     * ring) before the wait: no kernel of a step writes them (the caller's
     * promise, mlart_bmm_config.pdl), and so they stream in while the
     * previous kernel ends.  Each such stage expects its whole bytes at
     * once; the token rows follow after the wait.  A plain launch runs the
     * instantiation without EARLY, whose producer loop has no test per
     * unit (with the test it was 0.05-0.17 us slower; docs/PERF.md). */
    int early = 0;
    if (EARLY && tid == 128) {
        const int units = (i1 - i0) * KB;
        early = units < NST ? units : NST;
        early = early < sp.w_early ? early : sp.w_early;
        for (int u = 0; u < early; u++) {
            const SwapItem x = swap_item(sp, i0 + u / KB);
            const int b = u % KB;
            mbar_expect_tx(full0 + 8 * u, ST);
            tma_load_4d(base + (uint32_t)u * ST, &sp.tw, 0, 64 * b, x.nb * MW, x.h, full0 + 8 * u);
        }
    }
    /* Every thread waits for the previous kernel of the stream and its
     * memory before it reads or writes anything else in global memory (a
     * no-op for a plain launch), then lets the next kernel be scheduled,
     * as the ring does. */
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (warp == 4) {
        if (tid == 128) {
            int s = 0, u = 0;
            uint32_t ph = 0;
            for (int it = i0; it < i1; it++) {
                const auto [nb, tt, h] = swap_item(sp, it);
                for (int b = 0; b < KB; b++, u++) {
                    const uint32_t st = base + (uint32_t)s * ST, full = full0 + 8 * s;
                    if (!EARLY || u >= early) {
                        mbar_wait(empty0 + 8 * s, ph ^ 1); /* passes at once on the first lap */
                        mbar_expect_tx(full, ST);
                        tma_load_4d(st, &sp.tw, 0, 64 * b, nb * MW, h, full);
                    }
                    if (sp.a_headmaj)
                        tma_load_3d(st + (uint32_t)BM * 128, &sp.ta, 64 * b, tt * NT, h, full);
                    else
                        tma_load_3d(st + (uint32_t)BM * 128, &sp.ta, 64 * b, h, tt * NT, full);
                    if (++s == NST) {
                        s = 0;
                        ph ^= 1;
                    }
                }
            }
        }
        return;
    }
    named_bar_sync(2, 160); /* the barriers are initialised */
    const int lane = tid & 31;
    int s = 0;
    uint32_t ph = 0;
    for (int it = i0; it < i1; it++) {
        const auto [nb, tt, h] = swap_item(sp, it);
        float acc[MW][NT / 2];
        /* One unit's wgmma stay in flight while the warpgroup waits for the
         * next unit: a stage is released when the group after it has been
         * committed and its own has completed (wait_group 1), the last one
         * after wait_group 0. */
        int prev = 0;
#pragma unroll
        for (int b = 0; b < KB; b++) {
            const uint32_t st = base + (uint32_t)s * ST;
            mbar_wait(full0 + 8 * s, ph);
#pragma unroll
            for (int mw = 0; mw < MW; mw++)
                reg_fence(acc[mw]);
            asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                const uint64_t db = smem_desc(st + (uint32_t)BM * 128 + kk * 32, 16, 1024);
#pragma unroll
                for (int mw = 0; mw < MW; mw++)
                    wgmma_swap(acc[mw], smem_desc(st + (uint32_t)mw * 8192 + kk * 2048, 8192, 1024), db,
                               b > 0 || kk > 0);
            }
            wgmma_commit_release(b, lane, empty0 + 8 * prev);
            prev = s;
            if (++s == NST) {
                s = 0;
                ph ^= 1;
            }
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
        for (int mw = 0; mw < MW; mw++)
            reg_fence(acc[mw]);
        if (lane == 0)
            mbar_arrive(empty0 + 8 * prev);
        /* Accumulator 4j + e of lane (g, q) in M block mw: column
         * 64 mw + 16 warp + g (+8 for e >= 2) of the block, token row
         * 8j + 2q + (e & 1) of the tile.  Packed in pairs, that is the
         * fragment of the 8 x 8 matrices (columns 16 warp + 8 hi + 0..7,
         * tokens 8j + 0..7), which stmatrix.trans writes transposed: token
         * rows of 16 bytes (row pitch BM + 8 elements: the eight rows of a
         * matrix fall in different banks).  Then the rows leave as 16-byte
         * chunks. */
        {
            const uint32_t ob = smem_u32(outs);
            const int k = lane >> 3, i = lane & 7; /* lane gives row i of matrix k */
#pragma unroll
            for (int mw = 0; mw < MW; mw++) {
                if constexpr (NT == 8) {
                    const uint32_t a = ob + 2u * (uint32_t)(i * OP + 64 * mw + 16 * warp + 8 * (k & 1));
                    asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};" ::"r"(a),
                                 "r"(pack_bf16(acc[mw][0], acc[mw][1])), "r"(pack_bf16(acc[mw][2], acc[mw][3]))
                                 : "memory");
                } else {
#pragma unroll
                    for (int j = 0; j < NT / 8; j += 2) {
                        const uint32_t a =
                            ob + 2u * (uint32_t)((8 * (j + (k >> 1)) + i) * OP + 64 * mw + 16 * warp + 8 * (k & 1));
                        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(a),
                                     "r"(pack_bf16(acc[mw][4 * j], acc[mw][4 * j + 1])),
                                     "r"(pack_bf16(acc[mw][4 * j + 2], acc[mw][4 * j + 3])),
                                     "r"(pack_bf16(acc[mw][4 * j + 4], acc[mw][4 * j + 5])),
                                     "r"(pack_bf16(acc[mw][4 * j + 6], acc[mw][4 * j + 7]))
                                     : "memory");
                    }
                }
            }
        }
        named_bar_sync(1, 128);
        const int64_t t0 = (int64_t)tt * NT, n0 = (int64_t)nb * BM;
        const int rows = (int)(p.T - t0 < NT ? p.T - t0 : NT);
        __nv_bfloat16 *cb = p.c + h * p.c_sh + t0 * p.c_st + n0;
        if (p.c_vec16) {
            for (int i = tid; i < rows * (BM / 8); i += 128) {
                const int rr = i / (BM / 8), cc = (i % (BM / 8)) * 8;
                *(uint4 *)(cb + rr * p.c_st + cc) = *(const uint4 *)(outs + rr * OP + cc);
            }
        } else {
            for (int i = tid; i < rows * BM; i += 128) {
                const int rr = i / BM, cc = i % BM;
                cb[rr * p.c_st + cc] = outs[rr * OP + cc];
            }
        }
        if (p.pe_in && nb == 0)
            pe_copy_wg(p, h, t0, t0 + NT, tid);
        named_bar_sync(1, 128); /* the result buffer is free again */
    }
#else
    __trap(); /* built without sm_90a: mlart_bmm_swap_ok refuses the path */
#endif
}

/* K = 512 (the V up-projection's L) on the wgmma path, prefill-sized T.
 * The weight slice (512 x BN, 64 or 128 KB) stays in shared memory for a
 * whole item, as above, but a 64-row activation tile (64 KB at K = 512)
 * no longer fits twice beside it: the tiles come in K blocks (64 rows x 64
 * of K, 8 KB) copied by the TMA.  Warp 8 is the producer (one thread): for
 * each item the weight slice, then every K block of every row tile of the
 * item in order.  With WB the slice comes in 8 K blocks (BN/64 boxes of
 * 64 x 64 each, barrier `wfull[b]`), block b issued just before the
 * item's first row tile's activation block b, so that tile starts on the
 * first 8-16 KB of weights; without, it comes whole behind `wfull[0]`.
 * launch_kstream takes WB at 128 columns, and at 64 only when a block has
 * one row tile an item (measured: docs/ops.md).
 * With P2 warp 9 is a second producer: it copies warpgroup 1's row tiles
 * and warp 8 warpgroup 0's and the weights.  One producer issues an item's
 * tiles in order and waits for a free stage of warpgroup 0's ring before
 * it copies anything for warpgroup 1, so at every item's start warpgroup 1
 * waits about one tile's K blocks; that matters when an item is a few
 * tiles (launch_kstream takes P2 at 128 columns with 2-8 tiles a chunk
 * and at least half the SMs busy).
 * Warpgroups 0 and 1 take the item's row tiles in turn (tile r0 + wg, r0 +
 * wg + 2, ...), each through a ring of its own of NSW stages: the n-th K
 * block a warpgroup takes (counted over all its items) sits in its stage
 * n % NSW with parity (n / NSW) & 1.  (One ring shared by both would let a
 * warpgroup wait on a stage whose previous K block, the other's, has not
 * landed yet, and a parity wait cannot tell that phase from its own.)  Per
 * K block: wait `full`, four wgmma m64nBNk16, commit; the stage of the
 * previous block is released on `empty` (one arrival a warp) once at most
 * the current group is in flight.  The tile's result leaves the registers
 * as in store_tile while the other warpgroup multiplies.  With WB the
 * multiplies of K block b wait on `wfull[b]` (not on all eight first:
 * the producer issues weight block b + 1 only after a free stage for
 * activation block b, which with NSW < 8 needs the multiplies of an
 * earlier block); a warpgroup without a tile in an item still waits on
 * all eight, so that every phase of every weight barrier is waited for
 * before the item's end.  At an item's end every consumer warp arrives on
 * `wempty` (8 arrivals), and only then does the producer overwrite the
 * weights: a warpgroup's next arrival needs the next item's `wfull[0]`,
 * which needs this phase of `wempty` complete, so no warp can arrive
 * twice in one phase.
 *
 * Read-exact: both tensor maps describe exactly the views' elements
 * (encode_swap_maps: weights {64, K, N/64, H}, the activation {K, T, H}
 * or {K, H, T}); rows t >= T lie outside the map (zeros, nothing read).
 * Writes: t < T, n < N (store_tile); no q_pe (refused with K = 512). */
constexpr int KS_THREADS = 288;
__host__ __device__ constexpr int ks_threads(bool p2) { return p2 ? KS_THREADS + 32 : KS_THREADS; }
constexpr int KS_K = 512;
__host__ __device__ constexpr size_t kstream_smem(int bn, int nsw)
{
    return (size_t)KS_K * bn * 2 + (size_t)2 * nsw * 8192 + 1024;
}

template <int BN, int NSW, bool WB, bool P2>
__global__ void __launch_bounds__(ks_threads(P2), 1) bmm_kstream_kernel(const __grid_constant__ SwapParams sp)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int KB = KS_K / 64;
    constexpr uint32_t W_BYTES = (uint32_t)KS_K * BN * 2, ST = 8192;
    constexpr int NWB = WB ? KB : 1; /* weight barriers */
    const WParams &p = sp.p;
    extern __shared__ unsigned char smem_raw[];
    /* full[w][s], then empty[w][s], then wfull[b], wempty */
    __shared__ __align__(8) uint64_t bars[4 * NSW + NWB + 1];
    const uint32_t ws = (smem_u32(smem_raw) + 1023u) & ~1023u, as0 = ws + W_BYTES;
    const uint32_t full0 = smem_u32(&bars[0]), empty0 = smem_u32(&bars[2 * NSW]);
    const uint32_t wfull0 = smem_u32(&bars[4 * NSW]), wempty = smem_u32(&bars[4 * NSW + NWB]);
    const int tid = threadIdx.x;
    const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0); /* warp-uniform to the compiler */
    constexpr int NTH = ks_threads(P2);
    if (P2 ? warp >= 8 : warp == 8) {
        if (tid == 256) {
            asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&sp.tw) : "memory");
            asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&sp.ta) : "memory");
#pragma unroll
            for (int s = 0; s < 2 * NSW; s++) {
                mbar_init(full0 + 8 * s, 1);
                mbar_init(empty0 + 8 * s, 4);
            }
#pragma unroll
            for (int b = 0; b < NWB; b++)
                mbar_init(wfull0 + 8 * b, 1);
            mbar_init(wempty, 8);
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncwarp();
        asm volatile("bar.arrive 2, %0;" ::"n"(NTH) : "memory");
        if (tid == 256 || (P2 && tid == 288)) {
            /* pw: with P2, warp 9 copies warpgroup 1's row tiles and warp 8
             * warpgroup 0's and the weights; else warp 8 copies all */
            const int pw = P2 ? warp - 8 : 0;
            constexpr int TSTEP = P2 ? 2 : 1;
            uint32_t n0 = 0, n1 = 0, wph = 0; /* K blocks copied for warpgroups 0 and 1 */
            for (int item = blockIdx.x; item < p.items; item += gridDim.x, wph ^= 1) {
                const int nh = item % p.nslice, rest = item / p.nslice;
                const int s = rest % p.splits, h = rest / p.splits;
                const int r0 = (int)((int64_t)s * p.rt / p.splits), r1 = (int)((int64_t)(s + 1) * p.rt / p.splits);
                if (pw == 0)
                    mbar_wait(wempty, wph ^ 1); /* passes at once for the first item */
                /* one row tile's K blocks; with WB, the item's first (first:
                 * true) has the weights' K block b ahead of its block b.
                 * The later tiles' loop is a copy without that branch: a
                 * test per K block in this one thread's loop made the
                 * 64-column kernel 15-20% slower at T = 8192. */
                auto issue_tile = [&](auto first, int tile) {
                    const int w = (tile - r0) & 1;
                    uint32_t n = w ? n1 : n0;
                    for (int b = 0; b < KB; b++, n++) {
                        if constexpr (decltype(first)::value) {
                            mbar_expect_tx(wfull0 + 8 * b, W_BYTES / KB);
#pragma unroll
                            for (int cb = 0; cb < BN / 64; cb++)
                                tma_load_4d(ws + (uint32_t)cb * (KS_K * 128) + (uint32_t)b * 8192, &sp.tw, 0,
                                            64 * b, nh * (BN / 64) + cb, h, wfull0 + 8 * b);
                        }
                        const uint32_t st = (uint32_t)w * NSW + n % NSW, ph = (n / NSW) & 1;
                        mbar_wait(empty0 + 8 * st, ph ^ 1);
                        mbar_expect_tx(full0 + 8 * st, ST);
                        if (sp.a_headmaj)
                            tma_load_3d(as0 + st * ST, &sp.ta, 64 * b, tile * WG_BM, h, full0 + 8 * st);
                        else
                            tma_load_3d(as0 + st * ST, &sp.ta, 64 * b, h, tile * WG_BM, full0 + 8 * st);
                    }
                    (w ? n1 : n0) = n;
                };
                int tile = r0 + pw;
                if constexpr (WB) {
                    if (pw == 0 && tile < r1) {
                        issue_tile(std::true_type{}, tile);
                        tile += TSTEP;
                    }
                } else if (pw == 0) { /* the whole slice behind wfull[0] */
                    mbar_expect_tx(wfull0, W_BYTES);
#pragma unroll
                    for (int cb = 0; cb < BN / 64; cb++)
#pragma unroll
                        for (int b = 0; b < KB; b++)
                            tma_load_4d(ws + (uint32_t)cb * (KS_K * 128) + (uint32_t)b * 8192, &sp.tw, 0, 64 * b,
                                        nh * (BN / 64) + cb, h, wfull0);
                }
                for (; tile < r1; tile += TSTEP)
                    issue_tile(std::false_type{}, tile);
            }
        }
        return;
    }
    named_bar_sync(2, NTH); /* the barriers are initialised */
    const int wg = warp >> 2, wt = tid & 127, lane = tid & 31;
    uint32_t n = 0, wph = 0; /* n: K blocks this warpgroup has taken */
    float acc[BN / 2];
    for (int item = blockIdx.x; item < p.items; item += gridDim.x, wph ^= 1) {
        const int nh = item % p.nslice, rest = item / p.nslice;
        const int s = rest % p.splits, h = rest / p.splits;
        const int r0 = (int)((int64_t)s * p.rt / p.splits), r1 = (int)((int64_t)(s + 1) * p.rt / p.splits);
        /* with a tile in this item or not: so that a warpgroup without one
         * cannot arrive on wempty for two items in one of its phases */
        mbar_wait(wfull0, wph);
        if (WB && r0 + wg >= r1) {
#pragma unroll
            for (int b = 1; b < KB; b++)
                mbar_wait(wfull0 + 8 * b, wph);
        }
        /* one row tile; the warpgroup's first of the item (first: true)
         * also waits for each K block of the weights, the later ones find
         * them landed */
        auto mma_tile = [&](auto first, int tile) {
            uint32_t prev = 0;
#pragma unroll
            for (int b = 0; b < KB; b++, n++) {
                const uint32_t st = (uint32_t)wg * NSW + n % NSW;
                if constexpr (decltype(first)::value)
                    mbar_wait(wfull0 + 8 * b, wph);
                mbar_wait(full0 + 8 * st, (n / NSW) & 1);
                reg_fence(acc);
                asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
                for (int kk = 0; kk < 4; kk++)
                    wgmma_bn(acc, smem_desc(as0 + st * ST + kk * 32, 16, 1024),
                             smem_desc(ws + (uint32_t)(4 * b + kk) * 2048, KS_K * 128, 1024), b > 0 || kk > 0);
                wgmma_commit_release(b, lane, empty0 + 8 * prev);
                prev = st;
            }
            asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
            reg_fence(acc);
            if (lane == 0)
                mbar_arrive(empty0 + 8 * prev);
            store_tile<BN>(p, acc, h, (int64_t)tile * WG_BM, (int64_t)nh * BN, nh, wt);
        };
        int tile = r0 + wg;
        if constexpr (WB) {
            if (tile < r1)
                mma_tile(std::true_type{}, tile);
            tile += 2;
        }
        for (; tile < r1; tile += 2)
            mma_tile(std::false_type{}, tile);
        if (lane == 0)
            mbar_arrive(wempty); /* this warp's multiplies of the item's weights are done */
    }
#else
    __trap(); /* built without sm_90a: mlart_bmm_wgmma_ok refuses the path */
#endif
}

bool aligned16(const void *p, int64_t s0, int64_t s1)
{
    return ((uintptr_t)p % 16) == 0 && (s0 * 2) % 16 == 0 && (s1 * 2) % 16 == 0;
}

bool aligned8(const void *p, int64_t s0, int64_t s1)
{
    return ((uintptr_t)p % 8) == 0 && (s0 * 2) % 8 == 0 && (s1 * 2) % 8 == 0;
}

size_t wgmma_smem(int kb, int nwg, int bn) { return (size_t)64 * kb * (bn * 2 + nwg * 2 * WG_BM * 2) + 1024; }

template <int KB, int NWG, int BN> cudaError_t launch(WParams &p, int splits, int sms, cudaStream_t st)
{
    const size_t smem = wgmma_smem(KB, NWG, BN);
    int per_sm = 0;
    cudaError_t e;
    if ((e = cudaFuncSetAttribute(bmm_wgmma_kernel<KB, NWG, BN>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  (int)smem)) != cudaSuccess ||
        (e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, bmm_wgmma_kernel<KB, NWG, BN>, 128 * NWG,
                                                           smem)) != cudaSuccess)
        return e;
    if (per_sm < 1)
        return cudaErrorInvalidConfiguration;
    const int64_t slots = (int64_t)sms * per_sm;
    if (splits <= 0) {
        /* Chunks of row tiles per (head, slice): as many as fill every
         * resident block, down to one tile a chunk; more would only copy
         * the weights more often. */
        const int64_t pairs = (int64_t)p.items; /* H * nslice here */
        splits = (int)(slots / pairs < 1 ? 1 : slots / pairs);
    }
    if (splits > p.rt)
        splits = p.rt;
    p.splits = splits;
    p.items *= splits;
    const int grid = (int)(p.items < slots ? p.items : slots);
    bmm_wgmma_kernel<KB, NWG, BN><<<grid, 128 * NWG, smem, st>>>(p);
    return cudaGetLastError();
}

/* Shared memory of a ring: NST stages of (K x BN weights + 64 x K
 * activation), plus the alignment slack. */
size_t ring_smem(int kb, int bn, int nst) { return (size_t)nst * 64 * kb * (bn * 2 + WG_BM * 2) + 1024; }

/* Stages that fit `per_sm` blocks an SM (1..6, 5 rounded down to 4: the
 * instantiated counts), 0 if not one. */
int ring_stages_fit(int kb, int bn, int per_sm)
{
    int n = 6;
    while (n >= 1 && ring_smem(kb, bn, n) * (size_t)per_sm > (size_t)227 * 1024)
        n--;
    return n == 5 ? 4 : n < 1 ? 0 : n;
}

template <int KB, int BN, int NST>
cudaError_t launch_ring(WParams &p, int per_sm_want, int pdl, int sms, cudaStream_t st)
{
    const size_t smem = ring_smem(KB, BN, NST);
    int per_sm = 0;
    cudaError_t e;
    if ((e = cudaFuncSetAttribute(bmm_ring_kernel<KB, BN, NST>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  (int)smem)) != cudaSuccess ||
        (e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, bmm_ring_kernel<KB, BN, NST>, 128, smem)) !=
            cudaSuccess)
        return e;
    if (per_sm < 1)
        return cudaErrorInvalidConfiguration;
    if (per_sm > per_sm_want)
        per_sm = per_sm_want;
    const int64_t slots = (int64_t)sms * per_sm;
    cudaLaunchAttribute at[1];
    const cudaLaunchConfig_t lc =
        mlart_launch_cfg(dim3((unsigned)(p.items < slots ? p.items : slots)), dim3(128), smem, st, pdl, at);
    return cudaLaunchKernelEx(&lc, bmm_ring_kernel<KB, BN, NST>, p);
}

template <int KB, int BN>
cudaError_t launch_ring_n(WParams &p, int nst, int per_sm, int pdl, int sms, cudaStream_t st)
{
    if (nst < 0) { /* the one-item form: a block per item; -2 its K in halves (64-column slices) */
        const size_t smem = (size_t)64 * KB * (BN * 2 + WG_BM * 2) + 1024;
        constexpr bool H2 = BN == 64;
        void (*const kern)(WParams) = nst == -2 && H2 ? (pdl ? bmm_ring1_kernel<KB, BN, true, H2>
                                                             : bmm_ring1_kernel<KB, BN, false, H2>)
                                                      : pdl ? bmm_ring1_kernel<KB, BN, true, false>
                                                            : bmm_ring1_kernel<KB, BN, false, false>;
        if (nst == -2 && !H2)
            return cudaErrorInvalidConfiguration;
        cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess)
            return e;
        cudaLaunchAttribute at[1];
        const cudaLaunchConfig_t lc = mlart_launch_cfg(dim3((unsigned)p.items), dim3(128), smem, st, pdl, at);
        return cudaLaunchKernelEx(&lc, kern, p);
    }
    switch (nst) {
    case 1: return launch_ring<KB, BN, 1>(p, per_sm, pdl, sms, st);
    case 2: return launch_ring<KB, BN, 2>(p, per_sm, pdl, sms, st);
    case 3: return launch_ring<KB, BN, 3>(p, per_sm, pdl, sms, st);
    case 4: return launch_ring<KB, BN, 4>(p, per_sm, pdl, sms, st);
    case 6: return launch_ring<KB, BN, 6>(p, per_sm, pdl, sms, st);
    default: return cudaErrorInvalidConfiguration;
    }
}

/* Stages of the swap kernel: as many as fit beside the result buffer and
 * the static barriers, at most 12. */
constexpr int swap_nst(int bm, int nt)
{
    return (int)((232448 - 256 - (size_t)nt * (bm + 8) * 2 - 1024) / swap_stage(bm, nt)) > 12
               ? 12
               : (int)((232448 - 256 - (size_t)nt * (bm + 8) * 2 - 1024) / swap_stage(bm, nt));
}

template <int KB, int BM, int NT> cudaError_t launch_swap(const SwapParams &sp, int pdl, int sms, cudaStream_t st)
{
    constexpr int NST = swap_nst(BM, NT);
    const size_t smem = swap_smem(BM, NT, NST);
    void (*const kern)(SwapParams) =
        sp.w_early ? bmm_swap_kernel<KB, BM, NT, NST, true> : bmm_swap_kernel<KB, BM, NT, NST, false>;
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess)
        return e;
    cudaLaunchAttribute at[1];
    const cudaLaunchConfig_t lc =
        mlart_launch_cfg(dim3((unsigned)(sp.p.items < sms ? sp.p.items : sms)), dim3(SWAP_THREADS), smem, st, pdl, at);
    return cudaLaunchKernelEx(&lc, kern, sp);
}

template <int KB, int BM>
cudaError_t launch_swap_bm(const SwapParams &sp, int nt, int pdl, int sms, cudaStream_t st)
{
    switch (nt) {
    case 8: return launch_swap<KB, BM, 8>(sp, pdl, sms, st);
    case 16: return launch_swap<KB, BM, 16>(sp, pdl, sms, st);
    case 64: return launch_swap<KB, (BM < 512 ? BM : 256), 64>(sp, pdl, sms, st); /* 512 x 64: refused by _ok */
    default: return cudaErrorInvalidConfiguration;
    }
}

template <int KB>
cudaError_t launch_swap_kb(const SwapParams &sp, int bm, int nt, int pdl, int sms, cudaStream_t st)
{
    switch (bm) {
    case 64: return launch_swap_bm<KB, 64>(sp, nt, pdl, sms, st);
    case 128: return launch_swap_bm<KB, 128>(sp, nt, pdl, sms, st);
    case 256: return launch_swap_bm<KB, 256>(sp, nt, pdl, sms, st);
    case 512: return launch_swap_bm<KB, 512>(sp, nt, pdl, sms, st);
    default: return cudaErrorInvalidConfiguration;
    }
}

} // namespace

/* Compute capability major and multiprocessor count of the current device,
 * queried once per device (relaxed atomics: racing first calls store the
 * same values).  0 when the query fails. */
constexpr int WG_MAX_DEV = 64;
static std::atomic<int> g_major[WG_MAX_DEV], g_sms[WG_MAX_DEV];

static void device_facts(int *major, int *sms)
{
    int dev = 0;
    *major = *sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess)
        return;
    if (dev >= 0 && dev < WG_MAX_DEV && g_sms[dev].load(std::memory_order_relaxed) > 0) {
        *major = g_major[dev].load(std::memory_order_relaxed);
        *sms = g_sms[dev].load(std::memory_order_relaxed);
        return;
    }
    if (cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
        *major = *sms = 0;
        return;
    }
    if (dev >= 0 && dev < WG_MAX_DEV) {
        g_major[dev].store(*major, std::memory_order_relaxed);
        g_sms[dev].store(*sms, std::memory_order_relaxed);
    }
}

static int swap_maps_fit(const mlart_bmm_desc *d);
static int encode_swap_maps(const mlart_bmm_desc *d, int bm, int nt, SwapParams &sp);

extern "C" int mlart_bmm_wgmma_ok(const mlart_bmm_desc *d, int nwg, int bn)
{
    int major = 0, sms = 0;
    const bool wide = d->K == KS_K; /* bmm_kstream_kernel: two warpgroups, 64- or 128-column slices (0 = 128) */
    nwg = nwg ? nwg : 2;
    bn = bn ? bn : wide ? 128 : 256;
    if (wide ? nwg != 2 || (bn != 64 && bn != 128) || d->pe_in
             : nwg < 1 || nwg > 2 || (bn != 128 && bn != 256) || d->K < 64 || d->K > 192 || d->K % 64 != 0 ||
                   wgmma_smem((int)(d->K / 64), nwg, bn) > 227 * 1024)
        return 0;
    if (d->N < bn || d->N % bn != 0)
        return 0;
    if (!aligned16(d->a, d->a_sh, d->a_st) || !aligned16(d->w, d->w_sh, d->w_sk))
        return 0;
    if (d->T > ((int64_t)1 << 40) || d->H * (d->N / bn) * ((d->T + WG_BM - 1) / WG_BM) >= ((int64_t)1 << 31))
        return 0;
    /* wgmma exists on sm_90a only; at K = 512 the TMA must describe the views */
    device_facts(&major, &sms);
    return major == 9 && (!wide || swap_maps_fit(d));
}

/* The kernels' parameters for d with bn-column slices; items counts (head,
 * slice) pairs, times the row tiles or chunks in the launchers. */
static void make_params(const mlart_bmm_desc *d, int bn, WParams &p)
{
    p.T = d->T;
    p.a = (const __nv_bfloat16 *)d->a;
    p.a_sh = d->a_sh;
    p.a_st = d->a_st;
    p.w = (const __nv_bfloat16 *)d->w;
    p.w_sh = d->w_sh;
    p.w_sk = d->w_sk;
    p.c = (__nv_bfloat16 *)d->c;
    p.c_sh = d->c_sh;
    p.c_st = d->c_st;
    p.pe_in = (const __nv_bfloat16 *)d->pe_in;
    p.pe_out = (__nv_bfloat16 *)(d->pe_in ? d->pe_out : nullptr);
    p.R = d->pe_in ? d->R : 0;
    p.pi_st = d->pi_st;
    p.pi_sh = d->pi_sh;
    p.po_st = d->po_st;
    p.po_sh = d->po_sh;
    p.c_vec8 = aligned8(d->c, d->c_sh, d->c_st);
    p.c_vec16 = aligned16(d->c, d->c_sh, d->c_st);
    p.pe_vec = d->pe_in && p.R % 8 == 0 && aligned16(d->pe_in, d->pi_st, d->pi_sh) &&
               aligned16(d->pe_out, d->po_st, d->po_sh);
    p.nslice = (int)(d->N / bn);
    p.rt = (int)((d->T + WG_BM - 1) / WG_BM);
    p.splits = 1;
    p.items = (int)(d->H * p.nslice);
}

/* bmm_kstream_kernel over d: one block an SM (the weight slice and the
 * ring take 225 KB); `splits` row-tile chunks per (head, slice), 0: as
 * many as fill every SM, down to one tile a chunk.  The weights come by
 * K block (WB) at 128 columns, and at 64 when each chunk is one row tile;
 * else whole (docs/ops.md, "The wgmma path at K = 512"). */
template <int BN> cudaError_t launch_kstream(const mlart_bmm_desc *d, int splits, int sms, cudaStream_t st)
{
    constexpr int NSW = BN == 128 ? 6 : 10; /* stages a warpgroup: 96 or 160 KB of them in all */
    constexpr size_t smem = kstream_smem(BN, NSW);
    static_assert(smem + (4 * NSW + KS_K / 64 + 1) * 8 <= 227 * 1024, "bmm_kstream_kernel: shared memory");
    SwapParams sp;
    memset(&sp, 0, sizeof sp);
    if (!encode_swap_maps(d, 64, WG_BM, sp))
        return cudaErrorInvalidValue;
    make_params(d, BN, sp.p);
    const int64_t pairs = sp.p.items; /* H * nslice */
    if (splits <= 0)
        splits = (int)(sms / pairs < 1 ? 1 : sms / pairs);
    if (splits > sp.p.rt)
        splits = sp.p.rt;
    sp.p.splits = splits;
    sp.p.items *= splits;
    /* A second producer at 128 columns when a chunk is 2-8 row tiles and
     * the grid holds at least half the SMs; with fewer blocks a block's
     * own rate bounds the call, and the second producer slowed it
     * (measured: docs/ops.md, "The wgmma path at K = 512") */
    auto kern = bmm_kstream_kernel<BN, NSW, true, false>;
    bool p2 = false;
    if constexpr (BN == 64) {
        if (sp.p.rt > splits)
            kern = bmm_kstream_kernel<BN, NSW, false, false>;
    } else {
        const int tiles = (sp.p.rt + splits - 1) / splits;
        p2 = tiles >= 2 && tiles <= 8 && 2 * (int64_t)sp.p.items >= sms;
        if (p2)
            kern = bmm_kstream_kernel<BN, NSW, true, true>;
    }
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess)
        return e;
    kern<<<(unsigned)(sp.p.items < sms ? sp.p.items : sms), ks_threads(p2), smem, st>>>(sp);
    return cudaGetLastError();
}

extern "C" int mlart_bmm_wgmma_run(const mlart_bmm_desc *d, int splits, int nwg, int bn, void *stream)
{
    WParams p;
    int major = 0, sms = 0;
    const cudaStream_t st = (cudaStream_t)stream;
    nwg = nwg ? nwg : 2;
    bn = bn ? bn : 256;
    device_facts(&major, &sms);
    if (sms < 1)
        return (int)cudaErrorInvalidDevice;
    if (d->K == KS_K)
        return (int)(bn == 64 ? launch_kstream<64>(d, splits, sms, st) : launch_kstream<128>(d, splits, sms, st));
    make_params(d, bn, p); /* items times the splits in launch() */
    switch ((int)(d->K / 64) * 16 + nwg * 4 + (bn == 256)) {
    case 16 + 4: return (int)launch<1, 1, 128>(p, splits, sms, st);
    case 16 + 5: return (int)launch<1, 1, 256>(p, splits, sms, st);
    case 16 + 8: return (int)launch<1, 2, 128>(p, splits, sms, st);
    case 16 + 9: return (int)launch<1, 2, 256>(p, splits, sms, st);
    case 32 + 4: return (int)launch<2, 1, 128>(p, splits, sms, st);
    case 32 + 5: return (int)launch<2, 1, 256>(p, splits, sms, st);
    case 32 + 8: return (int)launch<2, 2, 128>(p, splits, sms, st);
    case 32 + 9: return (int)launch<2, 2, 256>(p, splits, sms, st);
    case 48 + 4: return (int)launch<3, 1, 128>(p, splits, sms, st);
    case 48 + 5: return (int)launch<3, 1, 256>(p, splits, sms, st);
    case 48 + 8: return (int)launch<3, 2, 128>(p, splits, sms, st);
    case 48 + 9: return (int)launch<3, 2, 256>(p, splits, sms, st);
    default: return (int)cudaErrorInvalidConfiguration;
    }
}

extern "C" int mlart_bmm_ring_ok(const mlart_bmm_desc *d, int bn, int stages, int per_sm)
{
    int major = 0, sms = 0;
    bn = bn ? bn : 128;
    per_sm = per_sm ? per_sm : 1;
    if ((bn != 64 && bn != 128) || (d->K != 128 && d->K != 192) || d->N < bn || d->N % bn != 0 || per_sm < 1 ||
        per_sm > 4)
        return 0;
    const int fit = ring_stages_fit((int)(d->K / 64), bn, per_sm);
    if (!fit || (stages && (stages < 1 || stages > fit || stages == 5)))
        return 0;
    if (!aligned16(d->a, d->a_sh, d->a_st) || !aligned16(d->w, d->w_sh, d->w_sk))
        return 0;
    if (d->T > ((int64_t)1 << 40) || d->H * (d->N / bn) * ((d->T + WG_BM - 1) / WG_BM) >= ((int64_t)1 << 31))
        return 0;
    device_facts(&major, &sms);
    return major == 9;
}

extern "C" int mlart_bmm_ring_run(const mlart_bmm_desc *d, int bn, int stages, int per_sm, int one, int pdl,
                                  void *stream)
{
    WParams p;
    int major = 0, sms = 0;
    const cudaStream_t st = (cudaStream_t)stream;
    bn = bn ? bn : 128;
    per_sm = per_sm ? per_sm : 1;
    device_facts(&major, &sms);
    if (sms < 1)
        return (int)cudaErrorInvalidDevice;
    const int kb = (int)(d->K / 64);
    if (one)
        stages = one == 2 ? -2 : -1;
    else if (!stages)
        stages = ring_stages_fit(kb, bn, per_sm);
    make_params(d, bn, p);
    p.items *= p.rt;
    switch (kb * 2 + (bn == 128)) {
    case 4: return (int)launch_ring_n<2, 64>(p, stages, per_sm, pdl, sms, st);
    case 5: return (int)launch_ring_n<2, 128>(p, stages, per_sm, pdl, sms, st);
    case 6: return (int)launch_ring_n<3, 64>(p, stages, per_sm, pdl, sms, st);
    case 7: return (int)launch_ring_n<3, 128>(p, stages, per_sm, pdl, sms, st);
    default: return (int)cudaErrorInvalidConfiguration;
    }
}

/* cuTensorMapEncodeTiled through the runtime's driver entry point (nothing
 * links libcuda), looked up once; NULL when the driver lacks it. */
typedef CUresult (*encode_tiled_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                    const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                    CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
static std::atomic<encode_tiled_fn> g_encode{nullptr};
static std::atomic<int> g_encode_looked{0};

static encode_tiled_fn encode_tiled()
{
    if (!g_encode_looked.load(std::memory_order_acquire)) {
        void *fn = nullptr;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) ==
                cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            g_encode.store((encode_tiled_fn)fn, std::memory_order_relaxed);
        else
            (void)cudaGetLastError();
        g_encode_looked.store(1, std::memory_order_release);
    }
    return g_encode.load(std::memory_order_relaxed);
}

/* The swap kernel's tensor maps for d: the weights as {64, K, N/64, H}
 * (box 64 columns x 64 rows x bm/64 column blocks x 1 head) and the activation view as {K, H, T} (box 64
 * of K x 1 head x nt token rows), or {K, T, H} for a head-major view (the
 * V up-projection's [H, T, L]), both 128-byte swizzled, zeros outside.
 * The maps describe exactly the views' elements, so no box reads outside
 * them.  0 when the TMA cannot describe the views (alignment, strides,
 * sizes). */
/* Whether the maps below can describe d's views (sizes, strides; the
 * 16-byte alignment is checked by the caller) and the driver has the
 * encoder: the checks of encoding without the encoding, so that choosing
 * the path costs no host work beyond comparisons. */
static int swap_a_headmaj(const mlart_bmm_desc *d)
{
    return !(d->a_sh >= d->K && d->a_st >= d->H * d->a_sh);
}

static int swap_maps_fit(const mlart_bmm_desc *d)
{
    const int64_t lim = (int64_t)1 << 32;
    const int a_ok = swap_a_headmaj(d) ? d->a_st >= d->K && d->a_sh >= d->T * d->a_st && d->a_sh < ((int64_t)1 << 39)
                                       : d->a_st < ((int64_t)1 << 39);
    return encode_tiled() && d->H >= 1 && d->T >= 1 && d->H < lim && d->T < lim && d->N < lim && d->N % 64 == 0 &&
           d->w_sk >= d->N && d->w_sh >= d->K * d->w_sk && d->w_sh < ((int64_t)1 << 39) && a_ok;
}

static int encode_swap_maps(const mlart_bmm_desc *d, int bm, int nt, SwapParams &sp)
{
    const encode_tiled_fn enc = encode_tiled();
    if (!swap_maps_fit(d))
        return 0;
    /* w[h, k, 64 c + x] as {x, k, c, h}: a box of BM/64 blocks is one copy */
    const cuuint64_t wdim[4] = {64, (cuuint64_t)d->K, (cuuint64_t)(d->N / 64), (cuuint64_t)d->H};
    const cuuint64_t wstr[3] = {(cuuint64_t)d->w_sk * 2, 128, (cuuint64_t)d->w_sh * 2};
    const cuuint32_t wbox[4] = {64, 64, (cuuint32_t)(bm / 64), 1};
    /* a[h, t, k] as {k, h, t} (the query's token-major view) or, for a
     * head-major view, {k, t, h}: the strides grow with the dimension */
    const int hm = swap_a_headmaj(d);
    const cuuint64_t adim[3] = {(cuuint64_t)d->K, (cuuint64_t)(hm ? d->T : d->H), (cuuint64_t)(hm ? d->H : d->T)};
    const cuuint64_t astr[2] = {(cuuint64_t)(hm ? d->a_st : d->a_sh) * 2, (cuuint64_t)(hm ? d->a_sh : d->a_st) * 2};
    const cuuint32_t abox[3] = {64, hm ? (cuuint32_t)nt : 1u, hm ? 1u : (cuuint32_t)nt};
    sp.a_headmaj = hm;
    const cuuint32_t one[4] = {1, 1, 1, 1};
    if (enc(&sp.tw, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, (void *)d->w, wdim, wstr, wbox, one,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
        return 0;
    if (enc(&sp.ta, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, (void *)d->a, adim, astr, abox, one,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
        return 0;
    return 1;
}

/* The swap path's defaults: 256 columns a block, 8 token rows a tile up to
 * T = 8, else 16. */
static void swap_defaults(const mlart_bmm_desc *d, int *bm, int *nt)
{
    *bm = *bm ? *bm : 256;
    *nt = *nt ? *nt : (d->T <= 8 ? 8 : 16);
}

extern "C" int mlart_bmm_swap_ok(const mlart_bmm_desc *d, int bm, int nt)
{
    int major = 0, sms = 0;
    swap_defaults(d, &bm, &nt);
    if ((bm != 64 && bm != 128 && bm != 256 && bm != 512) || (nt != 8 && nt != 16 && nt != 64) ||
        (bm == 512 && nt == 64) || (d->K != 128 && d->K != 192 && d->K != 512) || d->N < bm || d->N % bm != 0)
        return 0;
    if (!aligned16(d->a, d->a_sh, d->a_st) || !aligned16(d->w, d->w_sh, d->w_sk))
        return 0;
    if (d->H * (d->N / bm) * ((d->T + nt - 1) / nt) >= ((int64_t)1 << 31))
        return 0;
    device_facts(&major, &sms);
    return major == 9 && swap_maps_fit(d);
}

extern "C" int mlart_bmm_swap_run(const mlart_bmm_desc *d, int bm, int nt, int pdl, void *stream)
{
    SwapParams sp;
    int major = 0, sms = 0;
    const cudaStream_t st = (cudaStream_t)stream;
    swap_defaults(d, &bm, &nt);
    device_facts(&major, &sms);
    if (sms < 1)
        return (int)cudaErrorInvalidDevice;
    if (!encode_swap_maps(d, bm, nt, sp))
        return (int)cudaErrorInvalidValue;
    make_params(d, bm, sp.p);
    sp.nblk = sp.p.nslice;
    sp.ntt = (int)((d->T + nt - 1) / nt);
    sp.p.items = (int)(d->H * sp.ntt * sp.nblk);
    /* With PDL, the weights of the first stages go before the wait: the
     * whole first lap when all the weights are at most 2 MiB (16 heads of
     * the V up-projection at V = 128), else two stages.  Measured after
     * attend() (mlart-bench attn, the v_up_pdl column; docs/PERF.md, ops,
     * 2026-12-02): against two stages, the whole lap saved 0.3-0.5 us at
     * 16 heads T = 1, 2 and 8 and lost up to 0.15 us elsewhere there; at
     * 64 and 128 heads it saved 0.2-0.4 us at T = 2 and lost up to 1.2 us
     * from T = 4 on, where its traffic meets the previous kernel's. */
    const int64_t w_bytes = d->H * d->K * d->N * 2;
    sp.w_early = !pdl ? 0 : w_bytes <= ((int64_t)2 << 20) ? 1 << 30 : 2;
    return (int)(d->K == 128   ? launch_swap_kb<2>(sp, bm, nt, pdl, sms, st)
                 : d->K == 192 ? launch_swap_kb<3>(sp, bm, nt, pdl, sms, st)
                               : launch_swap_kb<8>(sp, bm, nt, pdl, sms, st));
}
