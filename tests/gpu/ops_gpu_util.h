/* Shared by the ops GPU tests (with gpu_test_util.h): seeded random bf16
 * data, and the layouts of the query absorption and V up-projection test
 * cases with their fp64 reference. */
#ifndef MLART_TESTS_GPU_OPS_GPU_UTIL_H
#define MLART_TESTS_GPU_OPS_GPU_UTIL_H

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_test_util.h"
#include "mlart/mlart.h"
#include "ops/numerics.h"

/* uniform in [-1, 1), rounded to bf16 */
static inline uint16_t ops_rand_bf16(uint64_t *s)
{
    double u = (double)(gpu_rand(s) >> 11) / 9007199254740992.0;
    return mlart_f32_to_bf16((float)(2.0 * u - 1.0));
}

static inline void ops_fill_bf16(uint16_t *p, size_t n, uint64_t *s)
{
    for (size_t i = 0; i < n; i++)
        p[i] = ops_rand_bf16(s);
}

/* An assertion for inner loops: Check's ck_assert_msg reports every passing
 * check to the parent process (a pipe write each), far too slow per element. */
#define OPS_REQUIRE(cond, ...)                                                                     \
    do {                                                                                           \
        if (!(cond))                                                                               \
            ck_abort_msg(__VA_ARGS__);                                                             \
    } while (0)

/* One test case of either op, in the layouts the runtime uses.
 *   query: a = q [T][H][AS] (AS = K+R+apad), its q_nope view [H,T,K];
 *          c = q_mqa [T][H][CS] (CS = N+R+cpad), view [H,T,N]; pe beside.
 *   v_up:  a = x [H][T][AS] (AS = K+apad); c = o [T][H][CS] (CS = N+cpad).
 * w is always dense [H][K][N]. */
typedef struct ops_case {
    int vup;
    int64_t H, T, K, N, R;
    int pe, apad, cpad;
} ops_case;

/* Case c's inputs: fresh random a and w on the host (ha, hw), their
 * copies on the device (da, dw), and a device buffer of c_elems output
 * elements (dc), not initialised. */
typedef struct ops_bufs {
    uint16_t *ha, *hw, *da, *dw, *dc;
} ops_bufs;

static inline int64_t ops_as(const ops_case *c) { return c->K + (c->vup ? 0 : c->R) + c->apad; }
static inline int64_t ops_cs(const ops_case *c) { return c->N + (c->vup ? 0 : c->R) + c->cpad; }
static inline size_t ops_a_elems(const ops_case *c) { return (size_t)(c->T * c->H * ops_as(c)); }
static inline size_t ops_w_elems(const ops_case *c) { return (size_t)(c->H * c->K * c->N); }
static inline size_t ops_c_elems(const ops_case *c) { return (size_t)(c->T * c->H * ops_cs(c)); }
static inline ops_bufs ops_upload(const ops_case *c, uint64_t *rng, size_t c_elems)
{
    const size_t na = ops_a_elems(c), nw = ops_w_elems(c);
    ops_bufs b = {malloc(na * 2), malloc(nw * 2), NULL, NULL, NULL};
    ck_assert(b.ha && b.hw);
    ops_fill_bf16(b.ha, na, rng);
    ops_fill_bf16(b.hw, nw, rng);
    GPU_CUDA(cudaMalloc((void **)&b.da, na * 2));
    GPU_CUDA(cudaMalloc((void **)&b.dw, nw * 2));
    GPU_CUDA(cudaMalloc((void **)&b.dc, c_elems * 2));
    GPU_CUDA(cudaMemcpy(b.da, b.ha, na * 2, cudaMemcpyHostToDevice));
    GPU_CUDA(cudaMemcpy(b.dw, b.hw, nw * 2, cudaMemcpyHostToDevice));
    return b;
}
static inline void ops_bufs_free(ops_bufs *b)
{
    cudaFree(b->da);
    cudaFree(b->dw);
    cudaFree(b->dc);
    free(b->ha);
    free(b->hw);
}
static inline int64_t ops_a_sh(const ops_case *c) { return c->vup ? c->T * ops_as(c) : ops_as(c); }
static inline int64_t ops_a_st(const ops_case *c) { return c->vup ? ops_as(c) : c->H * ops_as(c); }
static inline int64_t ops_c_sh(const ops_case *c) { return ops_cs(c); }
static inline int64_t ops_c_st(const ops_case *c) { return c->H * ops_cs(c); }

static inline mlart_tensor ops_view3(void *data, const void *base, size_t extent, int dev, int64_t d0,
                                     int64_t d1, int64_t d2, int64_t s0, int64_t s1)
{
    mlart_tensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.dtype = MLART_DTYPE_BF16;
    t.ndim = 3;
    t.shape[0] = d0;
    t.shape[1] = d1;
    t.shape[2] = d2;
    t.stride[0] = s0;
    t.stride[1] = s1;
    t.stride[2] = 1;
    t.base = base;
    t.extent = extent;
    t.device = dev;
    return t;
}

/* The op's views over storage a/w/c (host or device) with the given extents. */
typedef struct ops_views {
    mlart_tensor a, w, c, pe_in, pe_out;
} ops_views;

static inline ops_views ops_make_views(const ops_case *c, int dev, void *a, size_t a_ext, void *w,
                                       size_t w_ext, void *cc, size_t c_ext)
{
    ops_views v;
    uint16_t *a16 = a, *c16 = cc;
    v.a = ops_view3(a, a, a_ext, dev, c->H, c->T, c->K, ops_a_sh(c), ops_a_st(c));
    v.w = ops_view3(w, w, w_ext, dev, c->H, c->K, c->N, c->K * c->N, c->N);
    v.c = ops_view3(cc, cc, c_ext, dev, c->H, c->T, c->N, ops_c_sh(c), ops_c_st(c));
    v.pe_in = ops_view3(a16 + c->K, a, a_ext, dev, c->T, c->H, c->R, c->H * ops_as(c), ops_as(c));
    v.pe_out = ops_view3(c16 + c->N, cc, c_ext, dev, c->T, c->H, c->R, c->H * ops_cs(c), ops_cs(c));
    return v;
}

/* fp64 reference of row (h,t): ref[n] and sum_k |a w| into mag[n]. */
static inline void ops_ref_row(const ops_case *c, const uint16_t *a, const uint16_t *w, int64_t h,
                               int64_t t, double *ref, double *mag)
{
    const uint16_t *ar = a + h * ops_a_sh(c) + t * ops_a_st(c);
    for (int64_t n = 0; n < c->N; n++)
        ref[n] = mag[n] = 0.0;
    for (int64_t k = 0; k < c->K; k++) {
        double av = mlart_bf16_to_f32(ar[k]);
        const uint16_t *wr = w + (h * c->K + k) * c->N;
        for (int64_t n = 0; n < c->N; n++) {
            double p = av * mlart_bf16_to_f32(wr[n]);
            ref[n] += p;
            mag[n] += fabs(p);
        }
    }
}

/* Element bound: bf16 rounding of the result (2^-8 relative) plus FP32
 * accumulation slack K * 2^-22 * sum|a w| (twice the textbook K*u32 bound,
 * room for the tensor cores' internal ordering). */
static inline double ops_bound(const ops_case *c, double ref, double mag)
{
    return ldexp(fabs(ref), -8) + (double)c->K * ldexp(mag, -22) + 1e-30;
}

#endif /* MLART_TESTS_GPU_OPS_GPU_UTIL_H */
