/* Query absorption on sm_90 and the batched BF16 product it shares with the
 * V up-projection (ops/bmm_cuda.h).  Byte and FLOP counts: docs/ops.md.
 *
 * Nine kernels, all read-exact (they load only elements of the views, so no
 * load can cross the end of an operand's storage) and all writing only
 * elements of the output view; auto_config picks one per shape from the
 * measured variants (docs/PERF.md):
 *   slice   decode (the query at T <= 8 with 128 heads, and launched with
 *           PDL where the weights are at most 4 MiB or at 128 heads with
 *           P = 128; the V up-projection up to 4 MiB of weights at
 *           T <= 8, and at T <= 16 with V = 128): a block per (head,
 *           64 columns) copies its whole weight slice into shared memory
 *           with cp.async, so all slices are in flight in one wave, then
 *           mma.sync with K summed as the kernel of the other launch sums.
 *   direct  decode (the query at T <= 16 where swap is not chosen): each
 *           warp issues all its weight loads at kernel start straight into
 *           registers, takes its activation rows with plain 8-byte loads
 *           (or, staged, from one cp.async copy per block in shared memory)
 *           in a K order permuted to match, and stores its own results from
 *           registers: no barrier and no shared memory unless K is split.
 *   stream  every weight byte is loaded once per 16*MT rows of T, 16 bytes
 *           per load into registers, fed to mma.sync with the columns
 *           permuted; K split across the warps of a block and reduced in
 *           shared memory (V up-projection where swap does not serve).
 *   pstream the stream tile on a persistent grid that prefetches its next
 *           item (V up-projection at few heads where swap does not serve).
 *   tiled   64 or 128 x 128 output tiles, K in steps of 32 through a
 *           4-stage cp.async pipeline, ldmatrix (.trans for the weights) and
 *           mma.sync.  Rows past T are zero-filled with src-size 0 copies
 *           (no byte is read) at a clamped, valid address.
 *   generic any size or alignment: one thread per output element.
 * and, in ops/query_bmm_wgmma.cu,
 *   wgmma   the query at T >= 256: a persistent grid that keeps each head's
 *           weight slice in shared memory and streams 64-row activation
 *           tiles through wgmma;
 *   ring    (head, tile, slice) items, wgmma, results from registers; in
 *           its one-item form (a block per item, the item's K blocks in
 *           copy groups of their own) the query at 17 <= T <= 255 but
 *           where auto_config keeps the swap path; the ring of
 *           shared-memory stages itself where that form and the swap path
 *           are not taken;
 *   swap    the query at T <= 16 with many heads and at 17 <= T <= 64 at
 *           128 heads fused at P = 192 or launched with PDL, the V
 *           up-projection at T <= 64 (auto_config says exactly where): the
 *           TMA streams the weights through a ring of stages as wgmma's A
 *           operand, the token rows are its N.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "ops/bmm_cuda.h"
#include "ops/ops.h"
#include "runtime/cuda_launch.h"
#include "runtime/status.h"

namespace {

struct Desc {
    int64_t H, T, K, N;
    const __nv_bfloat16 *a;
    int64_t a_sh, a_st;
    const __nv_bfloat16 *w;
    int64_t w_sh, w_sk;
    __nv_bfloat16 *c;
    int64_t c_sh, c_st;
    const __nv_bfloat16 *pe_in;
    __nv_bfloat16 *pe_out;
    int64_t R, pi_st, pi_sh, po_st, po_sh;
    int a_vec;  /* a rows may be read 16 bytes at a time */
    int c_vec;  /* c rows may be written 16 bytes at a time */
    int a_vec8; /* a rows may be read 8 bytes at a time */
    int c_vec8; /* c rows may be written 8 bytes at a time */
    int pe_vec; /* pe rows copied 16 bytes at a time */
};

__device__ __forceinline__ uint4 ldg_stream(const void *p)
{
    uint4 v;
    /* weights are used once per launch: keep them out of L1 */
    /* volatile: stays where it is issued, ahead of the work it overlaps */
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ void mma_bf16(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void *smem)
{
    uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void *smem)
{
    uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

/* 16-byte async copy; src_bytes 0 reads nothing and fills zeros */
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, int src_bytes)
{
    uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

/* N mma.sync accumulator fragments set to zero. */
template <int N> __device__ __forceinline__ void zero_frags(float (&acc)[N][4])
{
#pragma unroll
    for (int j = 0; j < N; j++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            acc[j][e] = 0.f;
}

/* Eight bf16 at dst: one 16-byte store when the output rows allow it
 * (Desc.c_vec), else element stores. */
__device__ __forceinline__ void store8(__nv_bfloat16 *dst, uint4 v, int vec)
{
    if (vec) {
        *(uint4 *)dst = v;
    } else {
        const __nv_bfloat16 *b = (const __nv_bfloat16 *)&v;
#pragma unroll
        for (int e = 0; e < 8; e++)
            dst[e] = b[e];
    }
}

/* Copy pe_in[t,h,:] to pe_out[t,h,:] for t in [t0,t1): one block's share.
 * Four 16-byte loads per thread are issued before their stores, so a block
 * waits about one round trip, not one per chunk. */
__device__ void pe_copy_rows(const Desc &d, int64_t h, int64_t t0, int64_t t1)
{
    if (t1 > d.T)
        t1 = d.T;
    if (d.pe_vec) {
        const int64_t chunks = d.R / 8, total = (t1 - t0) * chunks;
        for (int64_t base = threadIdx.x; base < total; base += 4 * (int64_t)blockDim.x) {
            uint4 v[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int64_t i = base + u * (int64_t)blockDim.x;
                if (i < total) {
                    const int64_t t = t0 + i / chunks, r = (i % chunks) * 8;
                    v[u] = *(const uint4 *)(d.pe_in + t * d.pi_st + h * d.pi_sh + r);
                }
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int64_t i = base + u * (int64_t)blockDim.x;
                if (i < total) {
                    const int64_t t = t0 + i / chunks, r = (i % chunks) * 8;
                    *(uint4 *)(d.pe_out + t * d.po_st + h * d.po_sh + r) = v[u];
                }
            }
        }
    } else {
        for (int64_t i = threadIdx.x; i < (t1 - t0) * d.R; i += blockDim.x) {
            int64_t t = t0 + i / d.R, r = i % d.R;
            d.pe_out[t * d.po_st + h * d.po_sh + r] = d.pe_in[t * d.pi_st + h * d.pi_sh + r];
        }
    }
}

/* Rows [t0, t0 + rows) of a[h] (K columns) into shared memory with row
 * stride lds.  16-byte cp.async when rows are aligned (the caller commits
 * and waits), else plain loads; rows t >= T are zero and never read. */
__device__ __forceinline__ void load_a_tile(const Desc &d, __nv_bfloat16 *As, int lds, int64_t h, int64_t t0,
                                            int rows)
{
    const __nv_bfloat16 *ah = d.a + h * d.a_sh;
    const int chunks = (int)(d.K / 8);
    for (int i = threadIdx.x; i < rows * chunks; i += blockDim.x) {
        const int r = i / chunks, k = (i % chunks) * 8;
        const int64_t t = t0 + r;
        const bool ok = t < d.T;
        if (d.a_vec) {
            /* src-size 0 reads nothing; the address stays a valid element */
            cp_async16(As + r * lds + k, ok ? ah + t * d.a_st + k : ah + k, ok ? 16 : 0);
        } else {
            union {
                uint4 u;
                __nv_bfloat16 b[8];
            } tmp;
            tmp.u = make_uint4(0, 0, 0, 0);
            if (ok) {
                const __nv_bfloat16 *src = ah + t * d.a_st + k;
#pragma unroll
                for (int e = 0; e < 8; e++)
                    tmp.b[e] = src[e];
            }
            *(uint4 *)(As + r * lds + k) = tmp.u;
        }
    }
}

/* ---- stream kernel ------------------------------------------------------
 * Block (n-chunk of 64 columns, head, m-chunk of 16*MT rows), nw warps;
 * warp w owns k-steps [w*kpw, (w+1)*kpw) of 16 rows of K, loaded KB steps at
 * a time.  Lane (g = lane/4, q = lane%4) loads rows 2q, 2q+1, 2q+8, 2q+9 of a
 * step at columns n0 + 8g .. n0 + 8g + 7 (four 16-byte loads; eight lanes
 * make a 128-byte line).  mma j (0..7) uses column j of each lane's eight:
 * its logical column g is physical column n0 + 8g + j, which is exactly the
 * B fragment layout once two rows are interleaved with one byte permute. */
/* The stream tile's pieces, shared by the stream and persistent-stream
 * kernels.  A lane (g = lane / 4, q = lane % 4) holds weight rows 2q,
 * 2q + 1, 2q + 8, 2q + 9 of a 16-row k-step at the 8 consecutive columns
 * n0 + 8g .. n0 + 8g + 7; mma j computes physical columns n0 + 8g + j. */
__device__ __forceinline__ void stream_load_w(uint4 (&w)[4], const __nv_bfloat16 *wh, int64_t sk, int step)
{
    const int q = threadIdx.x & 3;
    const __nv_bfloat16 *p = wh + (int64_t)(step * 16 + 2 * q) * sk;
    w[0] = ldg_stream(p);
    w[1] = ldg_stream(p + sk);
    w[2] = ldg_stream(p + 8 * sk);
    w[3] = ldg_stream(p + 9 * sk);
}

/* One k-step (k0) of the MT row tiles staged in As against the lane's
 * weight rows w: one byte permute per register pair builds a B fragment. */
template <int MT>
__device__ __forceinline__ void stream_step(float (&acc)[MT][8][4], const __nv_bfloat16 *As, int lds, int k0,
                                            const uint4 (&w)[4])
{
    const int lane = threadIdx.x & 31;
    uint32_t af[MT][4];
#pragma unroll
    for (int m = 0; m < MT; m++)
        ldmatrix_x4(af[m], As + (m * 16 + (lane & 15)) * lds + k0 + (lane >> 4) * 8);
    const uint32_t *r0 = (const uint32_t *)&w[0];
    const uint32_t *r1 = (const uint32_t *)&w[1];
    const uint32_t *r8 = (const uint32_t *)&w[2];
    const uint32_t *r9 = (const uint32_t *)&w[3];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const uint32_t sel = (j & 1) ? 0x7632u : 0x5410u;
        const uint32_t b0 = __byte_perm(r0[j >> 1], r1[j >> 1], sel);
        const uint32_t b1 = __byte_perm(r8[j >> 1], r9[j >> 1], sel);
#pragma unroll
        for (int m = 0; m < MT; m++)
            mma_bf16(acc[m][j], af[m], b0, b1);
    }
}

/* This warp's partial sums into red in fragment order,
 * red[w][m][e][j][lane]: conflict-free. */
template <int MT>
__device__ __forceinline__ void stream_put_partial(float *red, const float (&acc)[MT][8][4])
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int e = 0; e < 4; e++)
#pragma unroll
            for (int j = 0; j < 8; j++)
                red[((((warp * MT + m) * 4 + e) * 8 + j) << 5) + lane] = acc[m][j][e];
}

/* After a barrier: the block sums every warp's partials and writes the
 * tile.  Item (m, e, lane): row t0 + m*16 + g + 8*(e>>1), columns
 * n0 + 8*(2q + (e&1)) + 0..7, one 16-byte store when aligned. */
template <int MT>
__device__ __forceinline__ void stream_sum_store(const Desc &d, const float *red, int64_t h, int64_t n0, int64_t t0)
{
    const int nw = blockDim.x >> 5;
    for (int it = threadIdx.x; it < MT * 4 * 32; it += blockDim.x) {
        const int ln = it & 31, e = (it >> 5) & 3, m = it >> 7;
        const int64_t t = t0 + m * 16 + (ln >> 2) + 8 * (e >> 1);
        if (t >= d.T)
            continue;
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; j++)
            v[j] = 0.f;
        for (int w = 0; w < nw; w++) {
            const float *src = red + ((((w * MT + m) * 4 + e) * 8) << 5) + ln;
#pragma unroll
            for (int j = 0; j < 8; j++)
                v[j] += src[j << 5];
        }
        const int64_t col = n0 + 8 * (2 * (ln & 3) + (e & 1));
        __nv_bfloat16 *dst = d.c + h * d.c_sh + t * d.c_st + col;
        if (d.c_vec) {
            uint4 o;
            o.x = pack_bf16(v[0], v[1]);
            o.y = pack_bf16(v[2], v[3]);
            o.z = pack_bf16(v[4], v[5]);
            o.w = pack_bf16(v[6], v[7]);
            *(uint4 *)dst = o;
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++)
                dst[j] = __float2bfloat16_rn(v[j]);
        }
    }
}

template <int MT> struct StreamBounds {
    static constexpr int threads = MT == 1 ? 512 : 256;
};

template <int MT, int KB>
__global__ void __launch_bounds__(StreamBounds<MT>::threads) bmm_stream_kernel(Desc d, int kpw)
{
    extern __shared__ __align__(16) unsigned char smem[];
    const int K = (int)d.K;
    const int lds = K + 8; /* bf16 per A row: 16-byte pad keeps ldmatrix conflict-free */
    __nv_bfloat16 *As = (__nv_bfloat16 *)smem;
    float *red = (float *)smem; /* reused after the products */

    const int warp = threadIdx.x >> 5;
    const int g = (threadIdx.x & 31) >> 2;
    const int64_t h = blockIdx.y;
    const int64_t n0 = (int64_t)blockIdx.x * 64;
    const int64_t t0 = (int64_t)blockIdx.z * 16 * MT;
    const int rows = 16 * MT;

    float acc[MT][8][4];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                acc[m][j][e] = 0.f;

    const int s_begin = warp * kpw, s_end = s_begin + kpw;
    const __nv_bfloat16 *wh = d.w + h * d.w_sh + n0 + 8 * g;
    const int64_t sk = d.w_sk;

    uint4 wv[KB][4];
    auto load_batch = [&](int s0) {
#pragma unroll
        for (int i = 0; i < KB; i++)
            if (s0 + i < s_end)
                stream_load_w(wv[i], wh, sk, s0 + i);
    };
    load_batch(s_begin); /* weights first: the A tile loads overlap them */
    load_a_tile(d, As, lds, h, t0, rows);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    for (int s0 = s_begin; s0 < s_end; s0 += KB) {
#pragma unroll
        for (int i = 0; i < KB; i++)
            if (s0 + i < s_end)
                stream_step<MT>(acc, As, lds, (s0 + i) * 16, wv[i]);
        if (s0 + KB < s_end)
            load_batch(s0 + KB);
    }

    __syncthreads(); /* A tile no longer needed: its space becomes red */
    stream_put_partial<MT>(red, acc);
    __syncthreads();
    stream_sum_store<MT>(d, red, h, n0, t0);

    if (d.pe_in && blockIdx.x == 0)
        pe_copy_rows(d, h, t0, t0 + rows);
}

/* ---- direct kernel --------------------------------------------------------
 * Decode with one short dependency chain per warp: every weight load of the
 * warp is issued at kernel start, the activation rows go straight from
 * global memory into mma A fragments (no shared memory, no barrier), and
 * each warp writes its own results, so with split = 1 no warp ever waits
 * for another.
 *
 * Warp = (column group of 8*CW columns, K slice of KS k-steps).  K inside a
 * 16-step is permuted, identically for A and B, so that both come from
 * plain row loads: lane (g = lane/4, q = lane%4) holds physical k
 * k0+4q .. k0+4q+3 (mma k slots 2q, 2q+1, 2q+8, 2q+9).  For B that is four
 * consecutive weight rows at the lane's CW consecutive columns
 * n0 + CW*g + j, one load each; mma j uses column j of every lane, i.e.
 * logical column g is physical n0 + CW*g + j, and one byte permute per
 * register pair builds the fragment.  For A it is one 8-byte load of row g
 * (and one of row g + 8).  The accumulators of lane (g, q) then hold the
 * 2*CW consecutive physical columns n0 + 2*CW*q + 0 .. 2*CW-1 of rows g and
 * g + 8: one or two 16-byte stores per row, straight from registers.
 *
 * split > 1 warps share a column group and cut K; the partial sums meet in
 * shared memory (fragment order, conflict-free, double-buffered by row
 * tile: one barrier per tile).  mtiles row tiles of 16 are walked with the
 * weights held in registers; the next tile's A rows load while the current
 * one multiplies. */
template <int CW> struct WLoad;
template <> struct WLoad<2> {
    static __device__ __forceinline__ void ld(uint32_t (&r)[1], const void *p)
    {
        asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r[0]) : "l"(p));
    }
};
template <> struct WLoad<4> {
    static __device__ __forceinline__ void ld(uint32_t (&r)[2], const void *p)
    {
        asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "l"(p));
    }
};
template <> struct WLoad<8> {
    static __device__ __forceinline__ void ld(uint32_t (&r)[4], const void *p)
    {
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "l"(p));
    }
};

/* a[h, t, kb + s*16 + 0..3] for s < KS, zeros for t >= T (nothing read) */
template <int KS>
__device__ __forceinline__ void direct_load_a(const Desc &d, const __nv_bfloat16 *ap, int64_t t, uint2 (&v)[KS])
{
    if (t < d.T) {
        const __nv_bfloat16 *p = ap + t * d.a_st;
        if (d.a_vec8) {
#pragma unroll
            for (int s = 0; s < KS; s++)
                asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(v[s].x), "=r"(v[s].y) : "l"(p + s * 16));
        } else {
            const unsigned short *u = (const unsigned short *)p;
#pragma unroll
            for (int s = 0; s < KS; s++) {
                v[s].x = (uint32_t)__ldg(u + s * 16) | ((uint32_t)__ldg(u + s * 16 + 1) << 16);
                v[s].y = (uint32_t)__ldg(u + s * 16 + 2) | ((uint32_t)__ldg(u + s * 16 + 3) << 16);
            }
        }
    } else {
#pragma unroll
        for (int s = 0; s < KS; s++)
            v[s] = make_uint2(0, 0);
    }
}

/* Row t of the lane's 2*CW columns from accumulator halves e0, e0 + 1. */
template <int CW>
__device__ __forceinline__ void direct_store_row(const Desc &d, int64_t h, int64_t t, int64_t col,
                                                 const float (&acc)[CW][4], int e0)
{
    if (t >= d.T)
        return;
    __nv_bfloat16 *dst = d.c + h * d.c_sh + t * d.c_st + col;
    uint32_t wds[CW];
#pragma unroll
    for (int i = 0; i < CW; i++) {
        /* column 2i, 2i+1 of the lane's 2*CW: acc[j][e0] for j < CW, then acc[j][e0+1] */
        const int c0 = 2 * i, c1 = 2 * i + 1;
        const float lo = c0 < CW ? acc[c0][e0] : acc[c0 - CW][e0 + 1];
        const float hi = c1 < CW ? acc[c1][e0] : acc[c1 - CW][e0 + 1];
        wds[i] = pack_bf16(lo, hi);
    }
    if (CW == 2 && d.c_vec8) {
        *(uint2 *)dst = make_uint2(wds[0], wds[CW > 1 ? 1 : 0]);
    } else if (CW >= 4 && d.c_vec) {
#pragma unroll
        for (int i = 0; i < CW; i += 4)
            *(uint4 *)(dst + 2 * i) = make_uint4(wds[i], wds[(i + 1) % CW], wds[(i + 2) % CW], wds[(i + 3) % CW]);
    } else {
#pragma unroll
        for (int i = 0; i < CW; i++) {
            __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162 *>(&wds[i]);
            dst[2 * i] = v.x;
            dst[2 * i + 1] = v.y;
        }
    }
}

/* MODE 0: one row tile with at most 8 rows (T <= 8); 1: one row tile;
 * 2: mtiles row tiles, the next tile's A rows loaded during the current;
 * 3: mtiles row tiles, the block's A rows staged once in shared memory
 *    (cp.async, issued behind the weight loads), fragments read from there:
 *    no global round trip per tile and one read of a per block. */
constexpr int DIRECT_APAD = 16; /* row pitch = 32 bytes mod 128: conflict-free 8-byte fragment reads */
template <int KS, int CW, int MODE>
__global__ void __launch_bounds__(256) bmm_direct_kernel(Desc d, int split, int mtiles)
{
    extern __shared__ __align__(16) unsigned char smem[];
    float *red = (float *)smem;
    constexpr int NWD = CW / 2; /* 32-bit words per weight row and lane */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int groups = (int)(blockDim.x >> 5) / split;
    const int sp = warp % split, grp = warp / split;
    const int g = lane >> 2, q = lane & 3;
    const int64_t h = blockIdx.y;
    const int64_t n0 = ((int64_t)blockIdx.x * groups + grp) * (8 * CW);
    const int kb = sp * KS * 16 + 4 * q;

    /* all of this warp's weights, first */
    uint32_t wr[KS][4][NWD];
    {
        const int64_t sk = d.w_sk;
        const __nv_bfloat16 *wp = d.w + h * d.w_sh + (int64_t)kb * sk + n0 + CW * g;
#pragma unroll
        for (int s = 0; s < KS; s++) {
            const __nv_bfloat16 *p = wp + (int64_t)(s * 16) * sk;
#pragma unroll
            for (int r = 0; r < 4; r++)
                WLoad<CW>::ld(wr[s][r], p + r * sk);
        }
    }
    /* With programmatic dependent launch (mlart_bmm_config.pdl) the
     * weights, which no kernel of a step writes, are in flight while the
     * previous kernel of the stream finishes; wait for it and its memory
     * before reading a or writing anything (a no-op for a plain launch).
     * Then let the next kernel of the stream be scheduled: the attention
     * kernels resolve their slots while this one runs.  The trigger comes
     * after the wait, so whatever the next kernel reads before its own wait
     * was complete before this kernel started. */
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const int64_t tb = (int64_t)blockIdx.z * mtiles * 16;
    const __nv_bfloat16 *ap = d.a + h * d.a_sh + kb;
    uint2 alo[KS], ahi[KS];
    const int lda = (int)d.K + DIRECT_APAD;
    __nv_bfloat16 *As = (__nv_bfloat16 *)(smem + (split > 1 ? (size_t)2 * groups * (split - 1) * CW * 4 * 32 * 4 : 0));
    if (MODE == 3) {
        int64_t rows = d.T - tb;
        rows = rows < 16 * mtiles ? rows : 16 * mtiles;
        const __nv_bfloat16 *ah = d.a + h * d.a_sh + tb * d.a_st;
        const int chunks = (int)(d.K / 8);
        for (int i = threadIdx.x; i < (int)rows * chunks; i += blockDim.x) {
            const int r = i / chunks, k = (i % chunks) * 8;
            if (d.a_vec) {
                cp_async16(As + r * lda + k, ah + r * d.a_st + k, 16);
            } else {
#pragma unroll
                for (int e = 0; e < 8; e++)
                    As[r * lda + k + e] = ah[r * d.a_st + k + e];
            }
        }
        cp_async_commit();
    } else {
        direct_load_a<KS>(d, ap, tb + g, alo);
        if (MODE != 0)
            direct_load_a<KS>(d, ap, tb + g + 8, ahi);
        else
#pragma unroll
            for (int s = 0; s < KS; s++)
                ahi[s] = make_uint2(0, 0);
    }
    if (d.pe_in && blockIdx.x == 0)
        pe_copy_rows(d, h, tb, tb + 16 * (int64_t)mtiles);

    if (MODE == 3) {
        cp_async_wait<0>();
        __syncthreads();
    }
    const int tiles = MODE >= 2 ? mtiles : 1;
    for (int m = 0; m < tiles; m++) {
        const int64_t t0 = tb + 16 * m;
        if (t0 >= d.T) /* uniform over the block */
            break;
        if (MODE == 3) { /* rows past T are zeros, never read */
            const bool lo_ok = t0 + g < d.T, hi_ok = t0 + g + 8 < d.T;
            const __nv_bfloat16 *r0 = As + (16 * m + g) * lda + kb;
#pragma unroll
            for (int s = 0; s < KS; s++) {
                alo[s] = lo_ok ? *(const uint2 *)(r0 + s * 16) : make_uint2(0, 0);
                ahi[s] = hi_ok ? *(const uint2 *)(r0 + 8 * lda + s * 16) : make_uint2(0, 0);
            }
        }
        const bool more = MODE == 2 && m + 1 < tiles && t0 + 16 < d.T;
        uint2 nlo[MODE == 2 ? KS : 1], nhi[MODE == 2 ? KS : 1];
        if (MODE == 2 && more) {
            direct_load_a<(MODE == 2 ? KS : 1)>(d, ap, t0 + 16 + g, nlo);
            direct_load_a<(MODE == 2 ? KS : 1)>(d, ap, t0 + 24 + g, nhi);
        }
        float acc[CW][4];
        zero_frags(acc);
#pragma unroll
        for (int s = 0; s < KS; s++) {
            const uint32_t af[4] = {alo[s].x, ahi[s].x, alo[s].y, ahi[s].y};
#pragma unroll
            for (int j = 0; j < CW; j++) {
                const uint32_t sel = (j & 1) ? 0x7632u : 0x5410u;
                const uint32_t b0 = __byte_perm(wr[s][0][j >> 1], wr[s][1][j >> 1], sel);
                const uint32_t b1 = __byte_perm(wr[s][2][j >> 1], wr[s][3][j >> 1], sel);
                mma_bf16(acc[j], af, b0, b1);
            }
        }
        if (split > 1) {
            float *buf = red + (size_t)(((m & 1) * groups + grp) * (split - 1)) * (CW * 4 * 32);
            if (sp > 0) {
#pragma unroll
                for (int j = 0; j < CW; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        buf[((sp - 1) * CW * 4 + j * 4 + e) * 32 + lane] = acc[j][e];
            }
            __syncthreads();
            if (sp == 0)
                for (int o = 0; o < split - 1; o++)
#pragma unroll
                    for (int j = 0; j < CW; j++)
#pragma unroll
                        for (int e = 0; e < 4; e++)
                            acc[j][e] += buf[(o * CW * 4 + j * 4 + e) * 32 + lane];
        }
        if (sp == 0) {
            const int64_t col = n0 + 2 * CW * q;
            direct_store_row<CW>(d, h, t0 + g, col, acc, 0);
            if (MODE != 0)
                direct_store_row<CW>(d, h, t0 + g + 8, col, acc, 2);
        }
        if (MODE == 2 && more) {
#pragma unroll
            for (int s = 0; s < KS; s++) {
                alo[s] = nlo[MODE == 2 ? s : 0];
                ahi[s] = nhi[MODE == 2 ? s : 0];
            }
        }
    }
}

/* ---- slice kernel ----------------------------------------------------------
 * Decode at T <= 16: a block of four warps per (head, slice of NC = 64 or
 * 32 columns).  Every thread first copies its K * NC / 1024 16-byte pieces
 * of the slice's weights (K rows of 2 NC bytes) into shared memory with
 * cp.async, the whole slice in flight at once and no registers held for
 * it, so that at 128 heads all 1024 slices of the query are resident
 * together (24 KB each at K = 192, eight blocks an SM) and the weights
 * stream in one wave.  Rows are stored swizzled (slice_addr) so the
 * ldmatrix.trans reads of the B fragments are conflict-free.  Then
 * griddepcontrol.wait, the token rows copied behind them (TR = 8: the A
 * fragments' rows g, rows g + 8 are zeros, never read; TR = 16, for 9-16
 * rows: rows g and g + 8; rows >= T are zeros), and mma.sync.  SPLIT
 * chains of K / SPLIT rows each, summed once at the end (p0 + p1), as the
 * kernel the other launch of the same shape takes sums (so that the plain
 * and the PDL launch give the same bytes): warp w takes k-steps of chain
 * w / (4 / SPLIT) over NC / 8 * SPLIT / 4 8-column tiles.  The partial
 * TR x NC tiles meet in the same shared memory (rows padded to NC + 8
 * floats: conflict-free 8-byte stores); a thread sums one (token row, 8
 * columns) piece and stores it (16 bytes when aligned).  At K = 512 (the V
 * up-projection) a 64-column slice is 64 KB, three blocks an SM, a
 * 32-column one 32 KB, five. */
/* Shared address of piece c (8 columns) of weight row k in a slice of NC
 * columns at sb: with 64 columns (128-byte rows) piece c ^ (k & 7); with
 * 32 (64-byte rows, two a 128-byte line) piece c ^ ((k >> 1) & 3).  Either
 * way the eight rows of one ldmatrix matrix fall on eight distinct
 * 16-byte bank groups. */
template <int NC> __device__ __forceinline__ uint32_t slice_addr(uint32_t sb, int k, int c)
{
    static_assert(NC == 64 || NC == 32, "slice width");
    return NC == 64 ? sb + k * 128 + ((c ^ (k & 7)) << 4) : sb + k * 64 + ((c ^ ((k >> 1) & 3)) << 4);
}

template <int KS, int SPLIT, int NC, int TR>
__global__ void __launch_bounds__(128, 8) bmm_slice_kernel(Desc d)
{
    extern __shared__ __align__(128) unsigned char slice_smem[];
    unsigned char *const smem = slice_smem;
    constexpr int K = KS * 16, RS = NC == 64 ? 3 : 2, RP = 1 << RS; /* 16-byte pieces a weight row */
    constexpr int PIECES = K * RP / 128;                              /* a thread's */
    constexpr int NG = 4 / SPLIT, TPW = RP / NG, KPW = KS / SPLIT, LDP = NC + 8;
    static_assert(TPW >= 2 && TPW % 2 == 0 && KS % SPLIT == 0 && K * RP % 128 == 0 && (TR == 8 || TR == 16),
                  "slice shape");
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, q = lane & 3, sp = warp / NG, grp = warp % NG;
    const int64_t h = blockIdx.y, n0 = (int64_t)blockIdx.x * NC;
    const uint32_t sb = (uint32_t)__cvta_generic_to_shared(smem);
    {
        const __nv_bfloat16 *wh = d.w + h * d.w_sh + n0;
#pragma unroll
        for (int i = 0; i < PIECES; i++) {
            const int p = tid + 128 * i, k = p >> RS, c = p & (RP - 1);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(slice_addr<NC>(sb, k, c)),
                         "l"(wh + k * d.w_sk + c * 8)
                         : "memory");
        }
        cp_async_commit();
    }
    /* as the direct kernel: the weights (written by no kernel of a step)
     * are in flight before the wait; a and the outputs only after it */
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    /* the token rows (T <= TR) behind the weights, row pitch K + 8
     * elements: conflict-free 4-byte fragment reads */
    constexpr int LDA = K + 8;
    __nv_bfloat16 *As = (__nv_bfloat16 *)(smem + K * NC * 2);
    load_a_tile(d, As, LDA, h, 0, (int)d.T);
    cp_async_commit();
    if (d.pe_in && blockIdx.x == 0)
        pe_copy_rows(d, h, 0, d.T);
    float acc[TPW][4];
    zero_frags(acc);
    cp_async_wait<0>();
    __syncthreads();
    {
        const int m = lane >> 3, r = lane & 7, kw = sp * KPW * 16;
        /* rows >= T are zeros, and rows g + 8 unless TR = 16 */
        const bool r0 = g < d.T, r1 = TR == 16 && g + 8 < d.T;
        const __nv_bfloat16 *ar = As + g * LDA + kw + 2 * q;
#pragma unroll
        for (int s = 0; s < KPW; s++) {
            const int k = kw + 16 * s + (m & 1) * 8 + r;
            const uint32_t a[4] = {r0 ? *(const uint32_t *)(ar + 16 * s) : 0u,
                                   r1 ? *(const uint32_t *)(ar + 8 * LDA + 16 * s) : 0u,
                                   r0 ? *(const uint32_t *)(ar + 16 * s + 8) : 0u,
                                   r1 ? *(const uint32_t *)(ar + 8 * LDA + 16 * s + 8) : 0u};
#pragma unroll
            for (int jp = 0; jp < TPW / 2; jp++) {
                uint32_t b[4];
                const int c = grp * TPW + 2 * jp + (m >> 1);
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                             : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
                             : "r"(slice_addr<NC>(sb, k, c)));
                mma_bf16(acc[2 * jp], a, b[0], b[1]);
                mma_bf16(acc[2 * jp + 1], a, b[2], b[3]);
            }
        }
    }
    __syncthreads(); /* the weights are read: the partials take their place */
    const int T = (int)d.T;
    {
        float *red = (float *)smem + sp * TR * LDP + g * LDP + grp * TPW * 8 + 2 * q;
        if (g < T)
#pragma unroll
            for (int j = 0; j < TPW; j++)
                *(float2 *)(red + 8 * j) = make_float2(acc[j][0], acc[j][1]);
        if (TR == 16 && g + 8 < T)
#pragma unroll
            for (int j = 0; j < TPW; j++)
                *(float2 *)(red + 8 * LDP + 8 * j) = make_float2(acc[j][2], acc[j][3]);
    }
    __syncthreads();
    if (tid < RP * T) {
        const int t = tid >> RS, c8 = tid & (RP - 1);
        const float4 *p0 = (const float4 *)((const float *)smem + t * LDP + 8 * c8);
        float4 x = p0[0], y = p0[1];
#pragma unroll
        for (int o = 1; o < SPLIT; o++) { /* SPLIT 2: one addition, as the direct kernel's */
            const float4 *p1 = (const float4 *)((const float *)p0 + o * TR * LDP);
            const float4 x1 = p1[0], y1 = p1[1];
            x.x += x1.x, x.y += x1.y, x.z += x1.z, x.w += x1.w;
            y.x += y1.x, y.y += y1.y, y.z += y1.z, y.w += y1.w;
        }
        store8(d.c + h * d.c_sh + t * d.c_st + n0 + 8 * c8,
               make_uint4(pack_bf16(x.x, x.y), pack_bf16(x.z, x.w), pack_bf16(y.x, y.y), pack_bf16(y.z, y.w)),
               d.c_vec);
    }
}

/* ---- persistent stream kernel --------------------------------------------
 * The stream kernel's tile (64 columns x 16*MT rows of one head, K split
 * over the warps), but each block walks items it, it + gridDim.x, ... and
 * issues the next item's weight loads (registers) and A tile (cp.async,
 * second shared buffer) before computing the current one, so the memory
 * pipe stays full across items instead of draining at every block
 * boundary.  Needs 16-byte aligned a rows (cp.async). */
template <int MT, int KPW> struct PStream {
    static __device__ __forceinline__ void coords(const Desc &d, int it, int nch, int64_t &h, int64_t &n0,
                                                  int64_t &t0)
    {
        const int n = it % nch, r = it / nch;
        h = r % d.H;
        t0 = (int64_t)(r / d.H) * 16 * MT;
        n0 = (int64_t)n * 64;
    }

    static __device__ __forceinline__ void issue(const Desc &d, int it, int nch, uint4 (&wv)[KPW][4],
                                                 __nv_bfloat16 *As, int lds)
    {
        const int warp = threadIdx.x >> 5;
        int64_t h, n0, t0;
        coords(d, it, nch, h, n0, t0);
        const __nv_bfloat16 *wh = d.w + h * d.w_sh + n0 + 8 * ((threadIdx.x & 31) >> 2);
#pragma unroll
        for (int i = 0; i < KPW; i++)
            stream_load_w(wv[i], wh, d.w_sk, warp * KPW + i);
        load_a_tile(d, As, lds, h, t0, 16 * MT);
        cp_async_commit();
    }

    static __device__ __forceinline__ void compute(const Desc &d, int it, int nch, const uint4 (&wv)[KPW][4],
                                                   const __nv_bfloat16 *As, int lds, float *red)
    {
        const int warp = threadIdx.x >> 5;
        int64_t h, n0, t0;
        coords(d, it, nch, h, n0, t0);
        float acc[MT][8][4];
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    acc[m][j][e] = 0.f;
#pragma unroll
        for (int i = 0; i < KPW; i++)
            stream_step<MT>(acc, As, lds, (warp * KPW + i) * 16, wv[i]);
        stream_put_partial<MT>(red, acc);
        __syncthreads();
        stream_sum_store<MT>(d, red, h, n0, t0);
        if (d.pe_in && n0 == 0)
            pe_copy_rows(d, h, t0, t0 + 16 * MT);
        __syncthreads(); /* red and this item's A buffer are free again */
    }
};

template <int MT, int KPW>
__global__ void __launch_bounds__(256) bmm_pstream_kernel(Desc d, int total, int nch)
{
    extern __shared__ __align__(16) unsigned char smem[];
    const int lds = (int)d.K + 8, rows = 16 * MT;
    __nv_bfloat16 *As0 = (__nv_bfloat16 *)smem;
    __nv_bfloat16 *As1 = As0 + rows * lds;
    float *red = (float *)(As1 + rows * lds);
    uint4 wv0[KPW][4], wv1[KPW][4];
    typedef PStream<MT, KPW> P;
    int it = blockIdx.x;
    if (it >= total)
        return;
    P::issue(d, it, nch, wv0, As0, lds);
    for (;;) { /* unrolled by two: the register buffers need constant indices */
        int nx = it + (int)gridDim.x;
        if (nx < total)
            P::issue(d, nx, nch, wv1, As1, lds);
        else
            cp_async_commit(); /* an empty group keeps the wait count uniform */
        cp_async_wait<1>();
        __syncthreads();
        P::compute(d, it, nch, wv0, As0, lds, red);
        it = nx;
        if (it >= total)
            break;
        nx = it + (int)gridDim.x;
        if (nx < total)
            P::issue(d, nx, nch, wv0, As0, lds);
        else
            cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        P::compute(d, it, nch, wv1, As1, lds, red);
        it = nx;
        if (it >= total)
            break;
    }
    cp_async_wait<0>();
}

/* ---- tiled kernel --------------------------------------------------------
 * BM x 128 tile of c per block, 8 warps as 2 (rows) x 4 (columns), warp tile
 * (BM/2) x 32; K in steps of 32 through TSTAGES cp.async stages.  The tile
 * is staged in shared memory and written as full 16-byte row chunks, so
 * every 32-byte sector of the output is written whole. */
constexpr int TBN = 128, TBK = 32, TSTAGES = 4;
constexpr int TLDA = TBK + 8, TLDB = TBN + 8, TLDC = TBN + 8; /* padded rows: conflict-free */
template <int BM> struct Tiled {
    static constexpr int SMEM = TSTAGES * (BM * TLDA + TBK * TLDB) * 2;
    static_assert(BM * TLDC * 2 <= SMEM, "C staging fits in the pipeline buffers");
};

template <int BM>
__global__ void __launch_bounds__(256, 2) bmm_tiled_kernel(Desc d)
{
    constexpr int MI = BM / 32; /* m16 tiles per warp */
    extern __shared__ __align__(16) unsigned char smem[];
    __nv_bfloat16 *As = (__nv_bfloat16 *)smem;
    __nv_bfloat16 *Bs = As + TSTAGES * BM * TLDA;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2, wn = warp & 3;
    const int64_t n0 = (int64_t)blockIdx.x * TBN;
    const int64_t t0 = (int64_t)blockIdx.y * BM;
    const int64_t h = blockIdx.z;
    const int KT = (int)(d.K / TBK);
    const __nv_bfloat16 *ah = d.a + h * d.a_sh;
    const __nv_bfloat16 *wh = d.w + h * d.w_sh + n0;

    auto load_stage = [&](int kt, int st) {
        const int k0 = kt * TBK;
#pragma unroll
        for (int i = 0; i < BM / 64; i++) { /* A: BM rows x 4 chunks of 8 */
            int idx = tid + i * 256, r = idx >> 2, ck = (idx & 3) * 8;
            int64_t t = t0 + r;
            bool ok = t < d.T;
            const __nv_bfloat16 *src = ok ? ah + t * d.a_st + k0 + ck : ah + k0 + ck;
            cp_async16(As + (st * BM + r) * TLDA + ck, src, ok ? 16 : 0);
        }
#pragma unroll
        for (int i = 0; i < 2; i++) { /* W: 32 rows x 16 chunks of 8 */
            int idx = tid + i * 256, r = idx >> 4, cn = (idx & 15) * 8;
            cp_async16(Bs + (st * TBK + r) * TLDB + cn, wh + (int64_t)(k0 + r) * d.w_sk + cn, 16);
        }
    };

    float acc[MI][4][4];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                acc[i][j][e] = 0.f;

#pragma unroll
    for (int s = 0; s < TSTAGES - 1; s++) {
        if (s < KT)
            load_stage(s, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < KT; kt++) {
        cp_async_wait<TSTAGES - 2>();
        __syncthreads();
        if (kt + TSTAGES - 1 < KT)
            load_stage(kt + TSTAGES - 1, (kt + TSTAGES - 1) % TSTAGES);
        cp_async_commit();
        const int st = kt % TSTAGES;
#pragma unroll
        for (int kk = 0; kk < TBK; kk += 16) {
            uint32_t af[MI][4], bf[4][2];
#pragma unroll
            for (int i = 0; i < MI; i++)
                ldmatrix_x4(af[i], As + (st * BM + wm * (BM / 2) + i * 16 + (lane & 15)) * TLDA + kk + (lane >> 4) * 8);
#pragma unroll
            for (int jj = 0; jj < 2; jj++) {
                uint32_t r[4];
                ldmatrix_x4_trans(r, Bs + (st * TBK + kk + (lane & 15)) * TLDB + wn * 32 + jj * 16 + (lane >> 4) * 8);
                bf[2 * jj][0] = r[0];
                bf[2 * jj][1] = r[1];
                bf[2 * jj + 1][0] = r[2];
                bf[2 * jj + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < MI; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    mma_bf16(acc[i][j], af[i], bf[j][0], bf[j][1]);
        }
    }
    cp_async_wait<0>();
    __syncthreads(); /* pipeline buffers become the C staging tile */

    const int g = lane >> 2, q = lane & 3;
    __nv_bfloat16 *Cs = (__nv_bfloat16 *)smem;
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int r = wm * (BM / 2) + i * 16 + g + half * 8;
#pragma unroll
            for (int j = 0; j < 4; j++)
                *(uint32_t *)(Cs + r * TLDC + wn * 32 + j * 8 + 2 * q) =
                    pack_bf16(acc[i][j][2 * half], acc[i][j][2 * half + 1]);
        }
    __syncthreads();
    __nv_bfloat16 *ch = d.c + h * d.c_sh;
    for (int idx = tid; idx < BM * (TBN / 8); idx += 256) {
        const int r = idx / (TBN / 8), cn = (idx % (TBN / 8)) * 8;
        const int64_t t = t0 + r;
        if (t >= d.T)
            continue;
        __nv_bfloat16 *dst = ch + t * d.c_st + n0 + cn;
        const uint4 v = *(const uint4 *)(Cs + r * TLDC + cn);
        if (d.c_vec) {
            *(uint4 *)dst = v;
        } else {
            const __nv_bfloat16 *b = (const __nv_bfloat16 *)&v;
#pragma unroll
            for (int e = 0; e < 8; e++)
                dst[e] = b[e];
        }
    }

    if (d.pe_in && blockIdx.x == 0)
        pe_copy_rows(d, h, t0, t0 + BM);
}

/* ---- generic kernel: one thread per output element ---------------------- */
__global__ void bmm_generic_kernel(Desc d)
{
    const int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t t = blockIdx.y, h = blockIdx.z;
    if (n < d.N) {
        const __nv_bfloat16 *a = d.a + h * d.a_sh + t * d.a_st;
        const __nv_bfloat16 *w = d.w + h * d.w_sh + n;
        float acc = 0.f;
        for (int64_t k = 0; k < d.K; k++)
            acc += __bfloat162float(a[k]) * __bfloat162float(w[k * d.w_sk]);
        d.c[h * d.c_sh + t * d.c_st + n] = __float2bfloat16_rn(acc);
    }
    if (d.pe_in && blockIdx.x == 0)
        for (int64_t r = threadIdx.x; r < d.R; r += blockDim.x)
            d.pe_out[t * d.po_st + h * d.po_sh + r] = d.pe_in[t * d.pi_st + h * d.pi_sh + r];
}

bool aligned(const void *p, int64_t s0, int64_t s1, int bytes)
{
    return ((uintptr_t)p % bytes) == 0 && (s0 * 2) % bytes == 0 && (s1 * 2) % bytes == 0;
}

Desc make_desc(const mlart_bmm_desc *s)
{
    Desc d;
    d.H = s->H;
    d.T = s->T;
    d.K = s->K;
    d.N = s->N;
    d.a = (const __nv_bfloat16 *)s->a;
    d.a_sh = s->a_sh;
    d.a_st = s->a_st;
    d.w = (const __nv_bfloat16 *)s->w;
    d.w_sh = s->w_sh;
    d.w_sk = s->w_sk;
    d.c = (__nv_bfloat16 *)s->c;
    d.c_sh = s->c_sh;
    d.c_st = s->c_st;
    d.pe_in = (const __nv_bfloat16 *)s->pe_in;
    d.pe_out = (__nv_bfloat16 *)(s->pe_in ? s->pe_out : nullptr);
    d.R = s->pe_in ? s->R : 0;
    d.pi_st = s->pi_st;
    d.pi_sh = s->pi_sh;
    d.po_st = s->po_st;
    d.po_sh = s->po_sh;
    d.a_vec = aligned(s->a, s->a_sh, s->a_st, 16) && s->K % 8 == 0;
    d.c_vec = aligned(s->c, s->c_sh, s->c_st, 16);
    d.a_vec8 = aligned(s->a, s->a_sh, s->a_st, 8) && s->K % 4 == 0;
    d.c_vec8 = aligned(s->c, s->c_sh, s->c_st, 8);
    d.pe_vec = s->pe_in && d.R % 8 == 0 && aligned(s->pe_in, s->pi_st, s->pi_sh, 16) &&
               aligned(s->pe_out, s->po_st, s->po_sh, 16);
    return d;
}

bool stream_ok(const Desc &d)
{
    return d.K % 16 == 0 && d.N % 64 == 0 && aligned(d.w, d.w_sh, d.w_sk, 16) && d.H <= 65535;
}

bool pstream_ok(const Desc &d)
{
    /* items are counted in int */
    return stream_ok(d) && d.a_vec && (d.N / 64) * d.H * ((d.T + 15) / 16) < (1ll << 30);
}

bool tiled_ok(const Desc &d)
{
    return d.K % TBK == 0 && d.N % TBN == 0 && d.a_vec && aligned(d.w, d.w_sh, d.w_sk, 16) &&
           d.H <= 65535 && (d.T + 63) / 64 <= 65535;
}

bool slice_ok(const Desc &d)
{
    return (d.K == 128 || d.K == 192 || d.K == 512) && d.N % 64 == 0 && d.T <= 16 &&
           aligned(d.w, d.w_sh, d.w_sk, 16) && d.H <= 65535 && d.N / 32 <= 65535;
}

/* The slice kernel's chains of K: two at K = 192 below 128 heads, as the
 * direct kernel (its plain partner there) splits K over two warps; two at
 * K = 512 (the V up-projection: of one, two and four chains and 32- or
 * 64-column blocks, within 0.07 us of the fastest at every shape up to
 * 4 MiB, plainly and with PDL; variants of 2026-12-02 18:58 UTC); one
 * elsewhere, as the swap path and the ring's one-item form
 * sum K (its partners at 128 heads and at K = 128).
 * mlart_bmm_config.warps forces it (1 or 2, and 4 at K = 512). */
int slice_split(const Desc &d, const mlart_bmm_config *cfg)
{
    if (cfg && (cfg->warps == 1 || cfg->warps == 2 || (cfg->warps == 4 && d.K == 512)))
        return cfg->warps;
    return d.K == 512 || (d.K == 192 && d.H < 128) ? 2 : 1;
}

/* Columns a slice: 64, or 32 where forced (K = 512 with two or four
 * chains only). */
int slice_cols(const Desc &d, const mlart_bmm_config *cfg, int split)
{
    return cfg && cfg->cols == 32 && d.K == 512 && split >= 2 ? 32 : 64;
}

template <int KS, int SPLIT, int NC, int TR> cudaError_t launch_slice_k(const Desc &d, int pdl, cudaStream_t st)
{
    const size_t smem = (size_t)KS * 16 * NC * 2 + (size_t)TR * (KS * 16 + 8) * 2;
    /* eight 24 KB blocks an SM need the largest shared-memory carveout;
     * K = 512 needs more than the default 48 KB a block */
    static const cudaError_t set =
        cudaFuncSetAttribute(bmm_slice_kernel<KS, SPLIT, NC, TR>, cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared) != cudaSuccess
            ? cudaErrorInvalidValue
            : cudaFuncSetAttribute(bmm_slice_kernel<KS, SPLIT, NC, TR>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)smem);
    if (set != cudaSuccess)
        return set;
    cudaLaunchAttribute at[1];
    const cudaLaunchConfig_t lc =
        mlart_launch_cfg(dim3((unsigned)(d.N / NC), (unsigned)d.H), dim3(128), smem, st, pdl, at);
    return cudaLaunchKernelEx(&lc, bmm_slice_kernel<KS, SPLIT, NC, TR>, d);
}

template <int TR> cudaError_t launch_slice_tr(const Desc &d, int split, int cols, int pdl, cudaStream_t st)
{
    if (d.K == 128)
        return split == 2 ? launch_slice_k<8, 2, 64, TR>(d, pdl, st) : launch_slice_k<8, 1, 64, TR>(d, pdl, st);
    if (d.K == 192)
        return split == 2 ? launch_slice_k<12, 2, 64, TR>(d, pdl, st) : launch_slice_k<12, 1, 64, TR>(d, pdl, st);
    if (cols == 32)
        return split == 2 ? launch_slice_k<32, 2, 32, TR>(d, pdl, st) : launch_slice_k<32, 4, 32, TR>(d, pdl, st);
    return split == 1   ? launch_slice_k<32, 1, 64, TR>(d, pdl, st)
           : split == 2 ? launch_slice_k<32, 2, 64, TR>(d, pdl, st)
                        : launch_slice_k<32, 4, 64, TR>(d, pdl, st);
}

/* T <= 8 token rows as the A fragments' rows g, 9 <= T <= 16 also as
 * rows g + 8 (twice the token rows' shared memory) */
cudaError_t launch_slice(const Desc &d, int split, int cols, int pdl, cudaStream_t st)
{
    return d.T <= 8 ? launch_slice_tr<8>(d, split, cols, pdl, st) : launch_slice_tr<16>(d, split, cols, pdl, st);
}

/* The wgmma path (ops/query_bmm_wgmma.cu) takes the caller's descriptor
 * `pub`, which d was made from. */
bool wgmma_ok(const mlart_bmm_desc *pub, int nwg, int bn)
{
    return mlart_bmm_wgmma_ok(pub, nwg, bn) != 0;
}

/* Warps splitting K for the stream kernels: 2 to 4 k-steps of 16 per warp
 * keep 8 to 16 loads of 16 bytes in flight per thread at a register count
 * that leaves room for several blocks per SM. */
int stream_warps(int ks, int mt, int persistent)
{
    const int cap = persistent ? 8 : (ks > 16 ? 8 : 4);
    const int kpw_max = persistent ? 4 : 1 << 30;
    int best = 0;
    for (int nw = 1; nw <= cap && nw <= ks; nw++)
        if (ks % nw == 0 && ks / nw <= kpw_max && (best == 0 || !persistent || ks / nw >= 2))
            best = nw;
    return best;
}

/* DIRECT: the kernel shape a config resolves to (zeros filled in). */
struct DirectShape {
    int cw, split, mt, groups, stage;
    int pdl; /* programmatic dependent launch (mlart_bmm_config.pdl) */
};

size_t direct_smem(const Desc &d, const DirectShape &s)
{
    size_t b = s.split > 1 ? (size_t)2 * s.groups * (s.split - 1) * s.cw * 4 * 32 * 4 : 0;
    if (s.stage)
        b += (size_t)16 * s.mt * (d.K + DIRECT_APAD) * 2;
    return b;
}

bool direct_ks_ok(int ks) { return ks == 4 || ks == 6 || ks == 8 || ks == 12; }

/* Weight registers per lane: 2*KS*CW words; at most 96 keeps the kernel
 * under 168 registers for the K = 192 query (twelve warps per SM). */
bool direct_fits(int ks, int cw) { return direct_ks_ok(ks) && 2 * ks * cw <= 128; }

bool resolve_direct(const Desc &d, const mlart_bmm_config *cfg, DirectShape *o)
{
    if (d.K % 16 != 0 || d.H > 65535)
        return false;
    const int ks = (int)(d.K / 16);
    int cw = cfg && cfg->cols ? cfg->cols / 8 : 4;
    int split = cfg && cfg->warps ? cfg->warps : 0;
    if (cw != 2 && cw != 4 && cw != 8)
        return false;
    if (!split) /* the fewest warps per column group whose weights fit */
        for (int s = 1; s <= 8 && !split; s *= 2)
            if (ks % s == 0 && direct_fits(ks / s, cw) && 2 * (ks / s) * cw <= 96)
                split = s;
    if (split < 1 || split > 8 || ks % split != 0 || !direct_fits(ks / split, cw))
        return false;
    int groups = cfg && cfg->groups ? cfg->groups : (split >= 4 ? 1 : 4 / split);
    if (groups < 1 || split * groups > 8 || d.N % (8 * cw * groups) != 0)
        return false;
    int mt = cfg && cfg->mt ? cfg->mt : (int)((d.T + 15) / 16);
    if (!(cfg && cfg->mt))
        mt = mt > 4 ? 4 : mt < 1 ? 1 : mt;
    if (mt < 1 || (d.T + 16 * mt - 1) / (16 * mt) > 65535)
        return false;
    if (!aligned(d.w, d.w_sh, d.w_sk, 2 * cw))
        return false;
    o->cw = cw;
    o->split = split;
    o->mt = mt;
    o->groups = groups;
    o->stage = cfg && cfg->bm == 1;
    o->pdl = 0;
    return direct_smem(d, *o) <= 160 * 1024;
}

int device_sms()
{
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) !=
                                                   cudaSuccess || sms < 1)
        return 132;
    return sms;
}

/* `want` warps if they split the k-steps under the kernel's limits, else the
 * default split. */
int warps_or_default(int ks, int want, int mt, int persistent)
{
    const int limit = persistent ? 256 : (mt == 1 ? 512 : 256);
    if (want >= 1 && ks % want == 0 && want * 32 <= limit && (!persistent || ks / want <= 4))
        return want;
    return stream_warps(ks, mt, persistent);
}

/* The automatic choice, from the variants tables of mlart-bench on an H200
 * (docs/PERF.md).  The query (K <= 256) takes the direct kernel at T <= 16
 * and, at few heads, T <= 64.  For the rest (the V up-projection, larger T)
 * "small" means no more 64-column tiles over all heads than SMs, where more
 * warps per block shorten the one round trip that dominates; with many
 * tiles, fewer warps leave room for more resident blocks. */
void auto_config(const Desc &d, const mlart_bmm_desc *pub, mlart_bmm_config *c, bool pdl)
{
    const int sms = device_sms();
    const int ks = (int)(d.K / 16);
    const bool small = (d.N / 64) * d.H <= sms;
    const bool wide_k = d.K > 256; /* v_up: K = L = 512 */
    const int64_t blocks128 = (d.N / TBN) * ((d.T + 127) / 128) * d.H;
    c->path = MLART_BMM_GENERIC;
    c->mt = c->warps = c->bm = c->cols = c->groups = 0;
    DirectShape ds;
    /* with PDL at 64-127 heads and P = 192 the swap path stays: it loads
     * its first weights before its wait, where the direct kernel over
     * more than 4 MiB of weights launches plainly (query_run).  At 128
     * heads and P = 192 from T = 1 (variants of 2026-12-02 11:36 UTC: with
     * PDL 7.67 against 8.94 us for the direct kernel at T = 1, plainly
     * 9.16 against 9.18), both launches, so that they sum alike. */
    const bool few = (d.T > 8 && d.T <= 16 && (d.K == 192 && pdl ? d.H >= 64 : d.H >= 128)) ||
                     (d.T <= 8 && d.K == 192 && d.H >= 128);
    const bool wide = (d.T > 16 && d.T <= 32) || (d.T > 32 && d.T <= 64 && (d.K == 192 || d.H >= 128));
    /* with the fused q_pe copy (column block 0 copies after its result) only
     * at 128 heads and T >= 9: fused H128 T16 P192 10.9 against 12.0 us
     * direct, T64 P192 14.1 against 16.0 on the ring, T16 P128 8.8 against
     * 9.3, T64 P128 13.0 against 13.3; fused H16-H64 T64 P192 and H64 T16
     * P192, H128 T4 P192 were 0.2-0.4 us slower than before */
    const bool pe_ok = !d.pe_in || (d.H >= 128 && d.T > 8);
    /* The ring's one-item form at 17 <= T <= 255 (variants of 2026-12-02
     * 09:08-09:27 UTC, docs/ops.md): 64-column slices, 128 past T = 64
     * once the 64-column items are over four an SM.  Not where it lost at
     * T <= 64: the fused q_pe copy at 128 heads and P = 192 (H128 T64 14.5
     * against 13.9 us on the swap path); with PDL at 128 heads, and at 64
     * heads, P = 192 past T = 32, where the swap path copies its first
     * weights before its wait (H128 T64 P128 10.8 against 9.0 us, H128 T32
     * P192 10.3 against 9.4, H64 T64 P192 7.0 against 6.5): measured in a
     * rotation of our own launches.  In the layer step the 64-head case
     * was slower than the plain launch, so mlart_query_bmm_cuda_pdl
     * launches that one plainly (mlart_query_pdl_launch). */
    const bool pdl_swap = pdl && d.T <= 64 && (d.H >= 128 || (d.H >= 64 && d.K == 192 && d.T > 32));
    /* At T <= 16 with P = 128 (variants of 2026-12-02 10:08 UTC,
     * docs/ops.md): launched with PDL below 128 heads, and at 128 heads up
     * to T = 8, where every item's weights are copied before the wait (H64
     * T1 3.6 against 4.5 us for the direct kernel; H128 T1 6.1 against 6.3,
     * 128-column slices so that the 512 items are resident at once; the
     * swap path with PDL took 5.6 there alone, but in the layer step after
     * attend() it was 0.5-1.0 us slower at T <= 8, mlart-bench attn, 11:53,
     * and with the layer's KV write in front slower at T = 2-8 in
     * mlart-decode and at T = 8 in the bench, 14:32);
     * launched plainly at 9-16 rows from 64 heads (H128 T16 7.65 against
     * 7.9 on the swap path, H64 5.3 against 5.4 on the direct kernel).
     * With PDL at P = 192 (H64 T1 4.7 against 5.4 us) with K in two halves
     * summed apart: there the plain launch's direct kernel splits K over
     * two warps, and the layer's early_weights must not change a byte
     * (ops_bmm_gpu pdl_same_bytes, tests/runtime/gpu-run.sh); so not at
     * 9-16 rows from 64 heads, where the plain launch sums K in one warp
     * and the PDL launch takes the swap path, nor at 128 heads.  At
     * T = 256 at <= 32 heads with P = 128 and at 128 heads with P = 192
     * (two runs: H32 7.2 against 9.4 us, H16 5.3 against 5.7, H128 P192
     * 29.5 against 30.8; slower or level at the other T = 256 shapes and at
     * every shape of T = 1024 and 8192). */
    const bool one_small = d.T <= 16 && d.K == 128 && (pdl ? !(d.H >= 128 && d.T > 8) : d.T > 8 && d.H >= 64);
    const bool one_halves = pdl && d.T <= 16 && d.K == 192 && d.H < 128 && (d.T <= 8 || d.H < 64);
    const bool one_256 = d.T == 256 && ((d.K == 128 && d.H <= 32) || (d.K == 192 && d.H >= 128));
    const bool one_mid = d.T > 16 && d.T < 256 && !(d.pe_in && d.H >= 128 && d.K == 192 && d.T <= 64) && !pdl_swap;
    /* The slice kernel (variants of 2026-12-02 17:15-17:50 UTC,
     * docs/ops.md): launched plainly at 128 heads and T <= 8 (H128 T1
     * P192 8.66 against 9.13 us on the swap path, T4 9.19 against 9.34, T8
     * 9.32 against 9.48; P128 T1 6.58 against 6.78 for the direct kernel,
     * T4 6.96 against 7.07, T8 7.07 against 7.28; level or slower below
     * 128 heads, and a first form slower from T = 16); with PDL at T <= 8
     * where the weights are at most 4 MiB (H16 T1 P128 1.77 against 2.0
     * us for the one-item form, H32 T1 P128 2.28 against 2.6, H16 T1 P192
     * 1.97 against 2.3, H32 T8 P128 2.56 against 2.68), the size up to
     * which mlart_query_pdl_launch lets a kernel copy all its weights
     * before its wait; and with PDL at 128 heads and P = 128 (H128 T1
     * 5.62 against 6.06 us for the one-item form, T4 5.92 against 6.29,
     * T8 6.20 against 6.35), where mlart_query_pdl_launch then launches it
     * plainly (in the layer step, bench runs of 17:54 and 17:59, that
     * took bf16 steps at T <= 4 0.4-0.5 us below the one-item form with
     * PDL, fp8 within 0.2 us); not at P = 192, where the swap path with
     * PDL was faster (T4 7.68 against 8.12). */
    const bool slice =
        d.T <= 8 && (pdl ? d.H * d.K * d.N * 2 <= MLART_QUERY_PDL_DIRECT_MAX || (d.H >= 128 && d.K == 128)
                         : d.H >= 128);
    /* The V up-projection at T <= 8 (variants of 2026-12-02 18:58 UTC,
     * docs/ops.md): the slice kernel with two chains of K up to 4 MiB of
     * weights (H16 T1 V128 3.08 against 3.91 us on the swap path, cuBLAS
     * 3.75; H32 T1 V128 3.62 against 4.22; H16 T1 V256 3.61 against
     * 4.20), plainly and with PDL alike: the layer step launches it with
     * PDL and the plain launch must give the same bytes (ops_bmm_gpu
     * pdl_same_bytes), and over 4 MiB a kernel that copies all its
     * weights before its wait is not launched with PDL (as the query's
     * PDL entry bounds it).  Past 4 MiB it was faster plainly too (H64
     * T1 V128 4.70 against 5.07 us, H128 T1 V128 6.86 against 7.04), but
     * its PDL launch would then have to be a plain one (slower in the
     * layer step, below) or give other bytes. */
    /* 9-16 rows (variants of 19:43 and 20:08 UTC): H16 T16 V128 3.67
     * against 4.12 us, cuBLAS 3.86; H32 3.97 against 4.57, cuBLAS 4.32;
     * H16 T16 V256 3.93 against 4.49, cuBLAS 4.30.  Over 4 MiB launched
     * plainly by the PDL entry (so that both entries give the same bytes)
     * the layer step was 1.0-1.4 us slower than with the swap path and PDL
     * at 64 and 128 heads, T <= 8 (mlart-bench attn, 2026-12-02 21:46,
     * docs/PERF.md), though the plain launch alone was 0.1-0.4 us faster. */
    const bool vup_slice = wide_k && d.T <= 16 && d.H * d.K * d.N * 2 <= MLART_QUERY_PDL_DIRECT_MAX;
    if ((vup_slice || (!wide_k && slice)) && slice_ok(d)) {
        const mlart_bmm_config lc = {MLART_BMM_SLICE, 0, 0, 0, 0, 0, 0};
        *c = lc;
        return;
    }
    if (!wide_k && (one_small || one_halves || one_mid || one_256)) {
        const int64_t items64 = d.H * (d.N / 64) * ((d.T + 63) / 64);
        const bool wide_slices = (d.T > 64 || (pdl && d.T <= 16)) && items64 > 4 * sms && !one_halves;
        const mlart_bmm_config oc = {MLART_BMM_RING, 0, one_halves ? 2 : 1, 0, wide_slices ? 128 : 64, 0, 0};
        if (mlart_bmm_ring_ok(pub, oc.cols, 0, 0)) {
            *c = oc;
            return;
        }
    }
    /* The swap path: the weights streamed by the TMA (variants tables,
     * docs/ops.md; past T = 16 the query takes it only where the one-item
     * form above is not taken).  One 64-row token tile past T = 16, else
     * 8- or 16-row tiles.
     *   The query: T <= 16 256 columns a block (H128 T16 P192 9.9 us
     *   against 11.0 for the direct kernel, P128 8.0 against 8.1; H64 P192
     *   6.6 against 6.7-6.9; H128 T4 P192 9.34-9.41 against 9.43-9.64,
     *   equal at T = 1).  33 <= T <= 64: 64 columns a block at 16 heads,
     *   128 up to 64 heads or at P = 128, else 256 (P192 against the ring:
     *   H16 4.5 against 4.65 us, H32 5.7 against 5.8, H64 8.0 against 8.4,
     *   H128 12.5-12.7 against 13.2; H128 P128 10.4-10.6 against 10.7);
     *   17 <= T <= 32 the same blocks at every head count (variants of
     *   19:48 UTC at T = 32: H128 P192 11.0 against 13.7 us, P128 9.1
     *   against 11.0, H32 P192 5.1 against 5.6; H16 P128 3.90 either way).
     *   Elsewhere (T = 1, fewer heads, P = 128 below 128 heads at T > 32)
     *   the kernels below.
     *   The V up-projection (K = L = 512), variants of 19:37 UTC: T <= 16
     *   128 columns a block (H128 T1 V256 11.0 against 12.1 us, V128 7.0
     *   against 8.0; 0.1 us slower at H64 T16 V128 and H32 T16 V256);
     *   17 <= T <= 64 128 columns once there are 256 64-column blocks,
     *   else 64 (H64 T64 V128 6.4 against 10.9, H128 V256 14.4 against
     *   16.1; at T = 32, 19:48 UTC, H64 V128 5.8 against 8.9, H32 V256 5.6
     *   against 8.7). */
    int swap_bm = 0;
    if (!wide_k && (few || wide) && pe_ok)
        swap_bm = !wide ? 256 : d.H <= 16 ? 64 : d.H <= 64 || d.K == 128 ? 128 : 256;
    else if (wide_k && d.T <= 64 && !d.pe_in)
        swap_bm = d.T <= 16 || d.H * (d.N / 64) >= 256 ? 128 : 64;
    if (swap_bm) {
        mlart_bmm_config sc = {MLART_BMM_SWAP, d.T > 16 ? 64 : d.T <= 8 ? 8 : 16, 0, 0, swap_bm, 0, 0};
        if (mlart_bmm_swap_ok(pub, sc.cols, sc.mt)) {
            *c = sc;
            return;
        }
    }
    if (!wide_k && d.T <= 16) {
        /* variants table (docs/PERF.md): 32 columns a warp; K = 192 split
         * over two warps (96 weight registers a lane otherwise); two column
         * groups a block once the grid is several waves deep */
        mlart_bmm_config dc = {MLART_BMM_DIRECT, 0, ks % 2 == 0 && ks > 8 ? 2 : 1, 0, 32, 1};
        if (dc.warps == 1 && (d.N / 32) * d.H > 4 * sms && (d.T <= 8 || d.pe_in))
            dc.groups = 2;
        /* 9 <= T <= 16 below 128 heads: at K = 128 without the q_pe copy
         * one column group (variants of 2026-12-02 01:41, five rounds, H64
         * T16 P128 5.32-5.41 us against 5.46-5.54 with two; bench of 08:04
         * 5.30 against 5.48), with it two (6.39 against 7.01); at K = 192
         * the token rows staged, K in one warp, two column groups (H64 T16
         * P192 6.47-6.59 against 6.61-6.69 on the swap path, with the copy
         * 7.22 against 7.65 for the kernel before).  Measured at 64 heads;
         * the other head counts below 128 follow. */
        if (d.T > 8 && d.K == 192 && d.H >= 64 && !pdl) {
            dc.warps = 1;
            dc.bm = 1;
            dc.groups = 2;
        }
        if (resolve_direct(d, &dc, &ds)) {
            *c = dc;
            return;
        }
    }
    if (!wide_k && d.T > 32 && d.T <= 64) {
        /* Where neither the one-item form nor the swap path was taken
         * above (the swap path refused the view): the ring proper, from
         * its variants table (docs/ops.md): 64-column slices; one stage
         * and four blocks an SM once there are three items an SM (H64 T64
         * 6.9/8.4 us against 7.2/8.7 for the kernels below, P128/P192;
         * H128 10.8/13.1 against 12.6/14.7), else two stages and two
         * blocks (H32 5.0/5.8 against 5.1/6.1; H16 4.2/4.8 against
         * 4.2/4.9).  The two choices below remain for what the ring
         * refuses: K other than 128 or 192, rows not 16-byte aligned. */
        const bool deep = d.H * (d.N / 64) * ((d.T + 63) / 64) >= 3 * (int64_t)sms;
        mlart_bmm_config rc = {MLART_BMM_RING, deep ? 1 : 2, 0, 0, 64, deep ? 4 : 2, 0};
        if (mlart_bmm_ring_ok(pub, rc.cols, rc.mt, rc.groups)) {
            *c = rc;
            return;
        }
    }
    if (!wide_k && d.T > 32 && d.T <= 64 && (d.N / 64) * d.H <= sms) {
        /* few heads: the 64-row tiled grid leaves SMs idle (H16 T64: 4.2
         * against 4.6 us); a staged in shared memory, 32 rows a block.  At
         * H32 the tiled grid fills the chip and wins (5.1 against 6.0 us). */
        mlart_bmm_config dc = {MLART_BMM_DIRECT, 2, 1, 1, 32, 2};
        if (resolve_direct(d, &dc, &ds)) {
            *c = dc;
            return;
        }
    }
    if (!wide_k && d.T > 32 && d.T <= 64 && d.H >= 128 && (!d.pe_in || d.K > 128)) {
        /* many heads: wgmma, one warpgroup on 128-column slices (H128 T64:
         * 12.4/14.7 us against 13.1/16.0 tiled, P128/P192; with the fused
         * q_pe copy 17.1 against 17.7 at P192, but 16.0 against 14.7 at
         * P128, where the copy rides on a quarter of the blocks) */
        mlart_bmm_config wc = {MLART_BMM_WGMMA, 0, 1, 0, 128, 0};
        if (wgmma_ok(pub, wc.warps, wc.cols)) {
            *c = wc;
            return;
        }
    }
    if (wide_k && d.T > 64) {
        /* The V up-projection past 64 token rows: the wgmma path at K =
         * 512 (bmm_kstream_kernel in ops/query_bmm_wgmma.cu), row-tile
         * chunks filling every SM.  64-column slices while the 128-column
         * ones number at most a quarter of the SMs and, at V = 256, their
         * row tiles at most one an SM; past that each of the four
         * 64-column slices of a head reads the activation again and the
         * L2 bound shows (variants of 2026-12-03 01:02-03:30 UTC,
         * docs/ops.md: H16 T256 V128 5.7 us against 6.4 with 128 columns,
         * H16 T8192 V128 45.7 against 46.9; H16 T1024 V256 13.3 against
         * 14.0 with 64, H16 T8192 V256 70.0 against 77.8). */
        const int64_t s128 = d.H * (d.N / 128);
        const int cols = s128 <= sms / 4 && (d.N == 128 || s128 * ((d.T + 63) / 64) <= sms) ? 64 : 128;
        if (wgmma_ok(pub, 0, cols)) {
            const mlart_bmm_config wc = {MLART_BMM_WGMMA, 0, 0, 0, cols, 0, 0};
            *c = wc;
            return;
        }
    }
    if (!stream_ok(d))
        return;
    c->path = MLART_BMM_STREAM;
    if (d.T <= 16 && wide_k && (d.N / 64) * d.H > 2 * sms && tiled_ok(d)) {
        c->path = MLART_BMM_TILED; /* v_up H128 V256: 11.9 us against 13.4 streamed */
        c->bm = 64;
        return;
    }
    if (d.T <= 16) {
        c->mt = 1;
        c->warps = warps_or_default(ks, wide_k ? 8 : small ? 4 : 2, 1, 0);
        return;
    }
    if (wide_k && small && d.T <= 128 && pstream_ok(d)) {
        c->path = MLART_BMM_PSTREAM;
        c->mt = d.T <= 32 ? 1 : 2;
        c->warps = warps_or_default(ks, 8, c->mt, 1);
        return;
    }
    if (!wide_k && small && d.T <= 32) {
        c->mt = 2;
        c->warps = warps_or_default(ks, 4, 2, 0);
        return;
    }
    if (!wide_k && d.T >= 256) {
        /* wgmma variants table (docs/ops.md, H200): up to 8192 rows (T*H)
         * one warpgroup a block on 128-column slices, two blocks an SM (H16
         * T256: 5.8/6.5 us against 6.3/7.6 tiled); at K = 128 up to 131072
         * rows one warpgroup on 256-column slices (H128 T1024 P128: 67.5
         * against 71.4 us with two); else two warpgroups, 256 columns. */
        const int64_t rows = d.T * d.H;
        mlart_bmm_config wc = {MLART_BMM_WGMMA, 0, 2, 0, 256, 0};
        if (rows <= 8192) {
            wc.warps = 1;
            wc.cols = 128;
        } else if (d.K <= 128 && rows <= 131072) {
            wc.warps = 1;
        }
        if (wgmma_ok(pub, wc.warps, wc.cols)) {
            *c = wc;
            return;
        }
    }
    if (tiled_ok(d)) {
        c->path = MLART_BMM_TILED;
        c->bm = d.T <= 64 || blocks128 < 2 * sms ? 64 : 128;
    }
}

int pick_path(const Desc &d, const mlart_bmm_desc *pub, const mlart_bmm_config *cfg)
{
    mlart_bmm_config ac;
    int path = cfg ? cfg->path : MLART_BMM_AUTO;
    if (path == MLART_BMM_AUTO) {
        auto_config(d, pub, &ac, cfg && cfg->pdl);
        return ac.path;
    }
    if (path < MLART_BMM_GENERIC || path > MLART_BMM_SLICE)
        return -1;
    if (path == MLART_BMM_SLICE &&
        (!slice_ok(d) || (cfg->warps != 0 && cfg->warps != 1 && cfg->warps != 2 && cfg->warps != 4) ||
         (cfg->warps == 4 && d.K != 512) || (cfg->cols != 0 && cfg->cols != 64 && cfg->cols != 32) ||
         (cfg->cols == 32 && (d.K != 512 || slice_split(d, cfg) < 2))))
        return -1;
    if (path == MLART_BMM_SWAP && !mlart_bmm_swap_ok(pub, cfg->cols, cfg->mt))
        return -1;
    if (path == MLART_BMM_RING &&
        (cfg->warps < 0 || cfg->warps > 2 || (cfg->warps == 2 && cfg->cols != 64) ||
         !mlart_bmm_ring_ok(pub, cfg->cols, cfg->warps ? 0 : cfg->mt, cfg->warps ? 0 : cfg->groups)))
        return -1;
    if (path == MLART_BMM_WGMMA && !wgmma_ok(pub, cfg->warps, cfg->cols))
        return -1;
    DirectShape ds;
    if (path == MLART_BMM_DIRECT && !resolve_direct(d, cfg, &ds))
        return -1;
    if (path == MLART_BMM_STREAM && !stream_ok(d))
        return -1;
    if (path == MLART_BMM_PSTREAM && !pstream_ok(d))
        return -1;
    if (path == MLART_BMM_TILED && !tiled_ok(d))
        return -1;
    return path;
}

template <int MT, int KB> cudaError_t launch_stream_kb(const Desc &d, int nw, int kpw, size_t smem, cudaStream_t st)
{
    if (nw * 32 > StreamBounds<MT>::threads)
        return cudaErrorInvalidConfiguration;
    cudaError_t e = cudaFuncSetAttribute(bmm_stream_kernel<MT, KB>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)smem);
    if (e != cudaSuccess)
        return e;
    dim3 grid((unsigned)(d.N / 64), (unsigned)d.H, (unsigned)((d.T + 16 * MT - 1) / (16 * MT)));
    bmm_stream_kernel<MT, KB><<<grid, nw * 32, smem, st>>>(d, kpw);
    return cudaGetLastError();
}

template <int MT> cudaError_t launch_stream_mt(const Desc &d, int nw, int kpw, size_t smem, cudaStream_t st)
{
    /* registers: MT*32 accumulators + KB*16 weight words */
    const int kbmax = MT >= 3 ? 3 : 4;
    int kb = kpw < kbmax ? kpw : kbmax;
    switch (kb) {
    case 1: return launch_stream_kb<MT, 1>(d, nw, kpw, smem, st);
    case 2: return launch_stream_kb<MT, 2>(d, nw, kpw, smem, st);
    case 3: return launch_stream_kb<MT, 3>(d, nw, kpw, smem, st);
    default: return launch_stream_kb<MT, 4>(d, nw, kpw, smem, st);
    }
}

/* Persistent grid: as many blocks as fit on the device at once, at most one
 * per item. */
template <int MT, int KPW> cudaError_t launch_pstream_k(const Desc &d, int nw, cudaStream_t st)
{
    const int lds = (int)d.K + 8, rows = 16 * MT;
    const size_t smem = (size_t)2 * rows * lds * 2 + (size_t)nw * MT * 4 * 8 * 32 * 4;
    const int nch = (int)(d.N / 64);
    const int total = nch * (int)d.H * (int)((d.T + rows - 1) / rows);
    int dev = 0, sms = 0, per_sm = 0;
    cudaError_t e;
    if (nw * 32 > 256 || smem > 220 * 1024)
        return cudaErrorInvalidConfiguration;
    if ((e = cudaFuncSetAttribute(bmm_pstream_kernel<MT, KPW>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  (int)smem)) != cudaSuccess ||
        (e = cudaGetDevice(&dev)) != cudaSuccess ||
        (e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess ||
        (e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, bmm_pstream_kernel<MT, KPW>, nw * 32, smem)) !=
            cudaSuccess)
        return e;
    if (per_sm < 1)
        return cudaErrorInvalidConfiguration;
    const int blocks = total < sms * per_sm ? total : sms * per_sm;
    bmm_pstream_kernel<MT, KPW><<<blocks, nw * 32, smem, st>>>(d, total, nch);
    return cudaGetLastError();
}

template <int MT> cudaError_t launch_pstream_mt(const Desc &d, int nw, int kpw, cudaStream_t st)
{
    switch (kpw) {
    case 1: return launch_pstream_k<MT, 1>(d, nw, st);
    case 2: return launch_pstream_k<MT, 2>(d, nw, st);
    case 3: return launch_pstream_k<MT, 3>(d, nw, st);
    case 4: return launch_pstream_k<MT, 4>(d, nw, st);
    default: return cudaErrorInvalidConfiguration;
    }
}

template <int BM> cudaError_t launch_tiled(const Desc &d, cudaStream_t st)
{
    cudaError_t e = cudaFuncSetAttribute(bmm_tiled_kernel<BM>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         Tiled<BM>::SMEM);
    if (e != cudaSuccess)
        return e;
    dim3 grid((unsigned)(d.N / TBN), (unsigned)((d.T + BM - 1) / BM), (unsigned)d.H);
    bmm_tiled_kernel<BM><<<grid, 256, Tiled<BM>::SMEM, st>>>(d);
    return cudaGetLastError();
}

template <int KS, int CW, int MODE>
cudaError_t launch_direct_m(const Desc &d, const DirectShape &s, size_t smem, dim3 grid, cudaStream_t st)
{
    if (smem > 48 * 1024) {
        cudaError_t e = cudaFuncSetAttribute(bmm_direct_kernel<KS, CW, MODE>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess)
            return e;
    }
    cudaLaunchAttribute at[1];
    const cudaLaunchConfig_t lc =
        mlart_launch_cfg(grid, dim3((unsigned)(s.split * s.groups * 32)), smem, st, s.pdl, at);
    return cudaLaunchKernelEx(&lc, bmm_direct_kernel<KS, CW, MODE>, d, s.split, s.mt);
}

template <int KS, int CW> cudaError_t launch_direct_k(const Desc &d, const DirectShape &s, cudaStream_t st)
{
    const size_t smem = direct_smem(d, s);
    dim3 grid((unsigned)(d.N / (8 * CW * s.groups)), (unsigned)d.H,
              (unsigned)((d.T + 16 * s.mt - 1) / (16 * s.mt)));
    if (s.stage)
        return launch_direct_m<KS, CW, 3>(d, s, smem, grid, st);
    if (s.mt > 1 && d.T > 16)
        return launch_direct_m<KS, CW, 2>(d, s, smem, grid, st);
    return d.T <= 8 ? launch_direct_m<KS, CW, 0>(d, s, smem, grid, st)
                    : launch_direct_m<KS, CW, 1>(d, s, smem, grid, st);
}

template <int CW> cudaError_t launch_direct_cw(const Desc &d, const DirectShape &s, cudaStream_t st)
{
    switch ((int)(d.K / 16) / s.split) {
    case 4: return launch_direct_k<4, CW>(d, s, st);
    case 6: return launch_direct_k<6, CW>(d, s, st);
    case 8: return launch_direct_k<8, CW>(d, s, st);
    case 12:
        if constexpr (CW <= 4)
            return launch_direct_k<12, CW>(d, s, st);
        return cudaErrorInvalidConfiguration; /* 12 x 8: direct_fits refuses it */
    default: return cudaErrorInvalidConfiguration;
    }
}

cudaError_t launch_direct(const Desc &d, const DirectShape &s, cudaStream_t st)
{
    switch (s.cw) {
    case 2: return launch_direct_cw<2>(d, s, st);
    case 4: return launch_direct_cw<4>(d, s, st);
    case 8: return launch_direct_cw<8>(d, s, st);
    default: return cudaErrorInvalidConfiguration;
    }
}

int run(const Desc &d, const mlart_bmm_desc *pub, const mlart_bmm_config *cfg, cudaStream_t st)
{
    mlart_bmm_config ac;
    cudaError_t e;
    const int pdl = cfg && cfg->pdl;
    if (!cfg || cfg->path == MLART_BMM_AUTO) {
        auto_config(d, pub, &ac, pdl);
        cfg = &ac;
    }
    const int path = pick_path(d, pub, cfg);
    if (path < 0)
        return mlart_set_error(MLART_ENOTSUP, "bmm: forced path %d cannot serve K=%lld N=%lld with these alignments",
                               cfg ? cfg->path : 0, (long long)d.K, (long long)d.N);
    if (d.H == 0 || d.T == 0 || (d.N == 0 && !d.pe_in))
        return 0;
    if (path == MLART_BMM_DIRECT) {
        DirectShape ds;
        if (!resolve_direct(d, cfg, &ds))
            return mlart_set_error(MLART_ENOTSUP, "bmm: direct kernel cannot serve K=%lld N=%lld here", (long long)d.K,
                                   (long long)d.N);
        ds.pdl = pdl;
        e = launch_direct(d, ds, st);
    } else if (path == MLART_BMM_STREAM || path == MLART_BMM_PSTREAM) {
        const int pers = path == MLART_BMM_PSTREAM;
        const int mtmax = pers ? 2 : 4;
        int mt = cfg && cfg->mt ? cfg->mt : (int)((d.T + 15) / 16);
        mt = mt < 1 ? 1 : mt > mtmax ? mtmax : mt;
        const int ks = (int)(d.K / 16);
        const int nw = cfg && cfg->warps ? cfg->warps : stream_warps(ks, mt, pers);
        if (nw < 1 || nw > 16 || ks % nw != 0 || (pers && ks / nw > 4))
            return mlart_set_error(MLART_ENOTSUP, "bmm: %d warps cannot split %d k-steps here", nw, ks);
        if (pers) {
            e = mt == 1 ? launch_pstream_mt<1>(d, nw, ks / nw, st) : launch_pstream_mt<2>(d, nw, ks / nw, st);
        } else {
            const size_t a_bytes = (size_t)16 * mt * (d.K + 8) * 2;
            const size_t r_bytes = (size_t)nw * mt * 4 * 8 * 32 * 4;
            const size_t smem = a_bytes > r_bytes ? a_bytes : r_bytes;
            if (smem > 200 * 1024)
                return mlart_set_error(MLART_ENOTSUP, "bmm: K=%lld needs %zu bytes of shared memory", (long long)d.K,
                                       smem);
            switch (mt) {
            case 1: e = launch_stream_mt<1>(d, nw, ks / nw, smem, st); break;
            case 2: e = launch_stream_mt<2>(d, nw, ks / nw, smem, st); break;
            case 3: e = launch_stream_mt<3>(d, nw, ks / nw, smem, st); break;
            default: e = launch_stream_mt<4>(d, nw, ks / nw, smem, st); break;
            }
        }
        if (e == cudaErrorInvalidConfiguration)
            return mlart_set_error(MLART_ENOTSUP, "bmm: %d warps x %d row tiles do not fit a block here", nw, mt);
    } else if (path == MLART_BMM_WGMMA) {
        e = (cudaError_t)mlart_bmm_wgmma_run(pub, cfg->mt, cfg->warps, cfg->cols, st);
    } else if (path == MLART_BMM_RING) {
        e = (cudaError_t)mlart_bmm_ring_run(pub, cfg->cols, cfg->mt, cfg->groups, cfg->warps, pdl, st);
    } else if (path == MLART_BMM_SWAP) {
        e = (cudaError_t)mlart_bmm_swap_run(pub, cfg->cols, cfg->mt, pdl, st);
    } else if (path == MLART_BMM_SLICE) {
        const int split = slice_split(d, cfg);
        e = launch_slice(d, split, slice_cols(d, cfg, split), pdl, st);
    } else if (path == MLART_BMM_TILED) {
        const int bm = cfg && cfg->bm ? cfg->bm : (d.T <= 64 ? 64 : 128);
        if (bm != 64 && bm != 128)
            return mlart_set_error(MLART_ENOTSUP, "bmm: tiled rows %d (64 or 128)", bm);
        e = bm == 64 ? launch_tiled<64>(d, st) : launch_tiled<128>(d, st);
    } else {
        if (d.T > 65535 || d.H > 65535)
            return mlart_set_error(MLART_ENOTSUP, "bmm: generic path limited to T, H <= 65535");
        dim3 grid((unsigned)((d.N + 127) / 128 > 0 ? (d.N + 127) / 128 : 1), (unsigned)d.T, (unsigned)d.H);
        bmm_generic_kernel<<<grid, 128, 0, st>>>(d);
        e = cudaGetLastError();
    }
    if (e != cudaSuccess)
        return mlart_set_error(MLART_ECUDA, "bmm launch (path %d): %s", path, cudaGetErrorString(e));
    return 0;
}

} // namespace

extern "C" int mlart_bmm_cuda_path(const mlart_bmm_desc *s, const mlart_bmm_config *cfg)
{
    Desc d = make_desc(s);
    return pick_path(d, s, cfg);
}

extern "C" int mlart_bmm_cuda_run(const mlart_bmm_desc *s, const mlart_bmm_config *cfg, void *stream)
{
    Desc d = make_desc(s);
    return run(d, s, cfg, (cudaStream_t)stream);
}

static int query_run(const mlart_tensor *a, const mlart_tensor *w, const mlart_tensor *out, const mlart_tensor *pe_in,
                     const mlart_tensor *pe_out, int pdl, void *stream)
{
    mlart_bmm_desc s;
    mlart_bmm_config cfg = {};
    MLART_CHECK(mlart_query_bmm_check(a, w, out, pe_in, pe_out));
    if (a->device < 0 || w->device < 0 || out->device < 0 || (pe_in && (pe_in->device < 0 || pe_out->device < 0)))
        return mlart_set_error(MLART_EINVAL, "query_bmm_cuda: every tensor must be on a CUDA device");
    s.H = a->shape[0];
    s.T = a->shape[1];
    s.K = a->shape[2];
    s.N = w->shape[2];
    s.a = a->data;
    s.a_sh = a->stride[0];
    s.a_st = a->stride[1];
    s.w = w->data;
    s.w_sh = w->stride[0];
    s.w_sk = w->stride[1];
    s.c = out->data;
    s.c_sh = out->stride[0];
    s.c_st = out->stride[1];
    s.pe_in = NULL;
    s.pe_out = NULL;
    s.R = s.pi_st = s.pi_sh = s.po_st = s.po_sh = 0;
    if (pe_in && pe_in->data) {
        s.pe_in = pe_in->data;
        s.pe_out = pe_out->data;
        s.R = pe_in->shape[2];
        s.pi_st = pe_in->stride[0];
        s.pi_sh = pe_in->stride[1];
        s.po_st = pe_out->stride[0];
        s.po_sh = pe_out->stride[1];
    }
    cfg.path = MLART_BMM_AUTO;
    cfg.pdl = pdl;
    /* Where the PDL launch was measured slower than the plain one in the
     * layer step (mlart-bench attn, `step` and `early` columns; docs/PERF.md,
     * 2026-12-02), it launches plainly (mlart_query_pdl_launch):
     *  - the direct kernel over 4 MiB of weights, which loads them all
     *    before its wait: 16 heads 0.4-0.9 us less a step with PDL, 128
     *    heads (16.8 MiB) up to 1.7 us more, where those loads meet the
     *    previous kernel's traffic;
     *  - 64-127 heads with P = 192 past 32 token rows, where the PDL choice
     *    is the swap path with its first stages before the wait: GLM-5's
     *    64-head step at T = 64 1.1-3.3 us more (three runs, 12:57-13:09
     *    UTC).  At 128 heads there the bench and mlart-decode disagreed, so
     *    the early launch stays. */
    if (pdl) {
        /* the path (a second pass of the choice) only where it matters */
        const int path =
            s.H * s.K * s.N * 2 > MLART_QUERY_PDL_DIRECT_MAX ? mlart_bmm_cuda_path(&s, &cfg) : MLART_BMM_AUTO;
        if (!mlart_query_pdl_launch(s.H, s.T, s.K, s.N, path))
            cfg.pdl = 0;
    }
    return mlart_bmm_cuda_run(&s, &cfg, stream);
}

extern "C" int mlart_query_bmm_cuda(const mlart_tensor *a, const mlart_tensor *w, const mlart_tensor *out,
                                    const mlart_tensor *pe_in, const mlart_tensor *pe_out, void *stream)
{
    return query_run(a, w, out, pe_in, pe_out, 0, stream);
}

extern "C" int mlart_query_bmm_cuda_pdl(const mlart_tensor *a, const mlart_tensor *w, const mlart_tensor *out,
                                        const mlart_tensor *pe_in, const mlart_tensor *pe_out, void *stream)
{
    return query_run(a, w, out, pe_in, pe_out, 1, stream);
}
