/* The reference backend on CUDA: plain kernels, one thread block per output
 * row, FP32 arithmetic, no tensor cores and no tiling, so that each one can
 * be checked by reading it.  Same semantics as the host reference
 * (reference_cpu.c): docs/reference.md, "Numerics, stage by stage".  Slow
 * by design; used to compare the fast backend at sizes the CPU cannot
 * reach in a test. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "backends/reference/reference.h"
#include "runtime/status.h"

namespace {

__device__ float ref_e4m3_to_f32(uint8_t b)
{
    int e = (b >> 3) & 15, m = b & 7;
    float v;
    if (e == 15 && m == 7)
        return __int_as_float(0x7fc00000);
    v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + (float)m / 8.0f, e - 7);
    return (b & 0x80) ? -v : v;
}

__device__ float ref_bf16(const uint16_t *p)
{
    return __uint_as_float((uint32_t)*p << 16);
}

/* Value d (0 <= d < L+R) of one cache row. */
__device__ float ref_kv_value(const uint8_t *row, int d, int L, int fp8)
{
    if (!fp8)
        return ref_bf16((const uint16_t *)row + d);
    if (d < L) {
        float scale;
        memcpy(&scale, row + L + 4 * (d / 128), 4);
        return ref_e4m3_to_f32(row[d]) * scale;
    }
    return ref_bf16((const uint16_t *)(row + L + 4 * (L / 128)) + (d - L));
}

struct ref_attend_args {
    const uint16_t *q;  /* q_mqa [T,H,L+R] */
    int64_t q_st, q_sh; /* strides (elements) of t, h; inner stride 1 */
    const uint8_t *kv;
    int64_t kv_row;     /* bytes per row (the cache's row stride) */
    int64_t num_slots;
    const int32_t *idx;
    int64_t idx_st, idx_sk;
    const int32_t *req;
    int64_t req_s;
    const int32_t *seq;
    int64_t seq_s;
    const int32_t *bt;
    int64_t bt_sb, bt_sk, max_blocks;
    uint16_t *out;      /* [H,T,L] */
    int64_t o_sh, o_st;
    float *lse;         /* [H,T] */
    int64_t l_sh, l_st;
    int T, H, L, R, topk, page, B, fp8;
    float scale;
};

/* Physical slot of index k of token t, or -1 when the index selects nothing. */
__device__ int64_t ref_slot(const ref_attend_args &a, int t, int k)
{
    int b = a.req[(int64_t)t * a.req_s];
    if (b < 0 || b >= a.B)
        return -1;
    int32_t i = a.idx[(int64_t)t * a.idx_st + (int64_t)k * a.idx_sk];
    if (i < 0 || i >= a.seq[(int64_t)b * a.seq_s])
        return -1;
    int64_t blk = i / a.page;
    if (blk >= a.max_blocks)
        return -1;
    int64_t phys = (int64_t)a.bt[(int64_t)b * a.bt_sb + blk * a.bt_sk] * a.page + i % a.page;
    if (phys < 0 || phys >= a.num_slots)
        return -1;
    return phys;
}

/* One block per (t, h).  Shared memory: q row (L+R floats), then topk
 * scores that become the probabilities, then a small reduction buffer. */
__global__ void ref_attend_kernel(ref_attend_args a)
{
    extern __shared__ float sh[];
    const int t = blockIdx.x, h = blockIdx.y, D = a.L + a.R;
    float *q = sh, *p = sh + D, *red = p + a.topk;
    const uint16_t *qrow = a.q + (int64_t)t * a.q_st + (int64_t)h * a.q_sh;

    for (int d = threadIdx.x; d < D; d += blockDim.x)
        q[d] = ref_bf16(qrow + d);
    __syncthreads();

    float mymax = -INFINITY;
    for (int k = threadIdx.x; k < a.topk; k += blockDim.x) {
        int64_t slot = ref_slot(a, t, k);
        float s = -INFINITY;
        if (slot >= 0) {
            const uint8_t *row = a.kv + slot * a.kv_row;
            float acc = 0.0f;
            for (int d = 0; d < D; d++)
                acc += q[d] * ref_kv_value(row, d, a.L, a.fp8);
            s = acc * a.scale;
        }
        p[k] = s;
        mymax = fmaxf(mymax, s);
    }
    red[threadIdx.x] = mymax;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w /= 2) {
        if ((int)threadIdx.x < w)
            red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + w]);
        __syncthreads();
    }
    const float m = red[0];
    __syncthreads();

    float mysum = 0.0f;
    for (int k = threadIdx.x; k < a.topk; k += blockDim.x) {
        float e = m == -INFINITY ? 0.0f : expf(p[k] - m);
        p[k] = e;
        mysum += e;
    }
    red[threadIdx.x] = mysum;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w /= 2) {
        if ((int)threadIdx.x < w)
            red[threadIdx.x] += red[threadIdx.x + w];
        __syncthreads();
    }
    const float l = red[0];

    uint16_t *orow = a.out + (int64_t)h * a.o_sh + (int64_t)t * a.o_st;
    for (int d = threadIdx.x; d < a.L; d += blockDim.x) {
        float acc = 0.0f;
        for (int k = 0; k < a.topk; k++) {
            if (p[k] == 0.0f)
                continue; /* empty slot, or underflow: adds nothing */
            int64_t slot = ref_slot(a, t, k);
            acc += p[k] * ref_kv_value(a.kv + slot * a.kv_row, d, a.L, a.fp8);
        }
        __nv_bfloat16 v = __float2bfloat16_rn(l > 0.0f ? acc / l : 0.0f);
        orow[d] = *(uint16_t *)&v;
    }
    if (threadIdx.x == 0 && a.lse) /* lse is optional (data NULL) */
        a.lse[(int64_t)h * a.l_sh + (int64_t)t * a.l_st] = l > 0.0f ? m + logf(l) : -INFINITY;
}

/* out[h,t,l] = bf16(sum_p a[h,t,p] * w[h,p,l]); one block per (h,t).  The
 * q_pe copy is done by the same block for its (t,h) row. */
__global__ void ref_absorb_kernel(const uint16_t *a, int64_t a_sh, int64_t a_st,
                                  const uint16_t *w, int64_t w_sh, int64_t w_sp,
                                  uint16_t *out, int64_t o_st, int64_t o_sh,
                                  const uint16_t *pe, int64_t pe_st, int64_t pe_sh,
                                  int P, int L, int R)
{
    const int h = blockIdx.x, t = blockIdx.y;
    const uint16_t *arow = a + (int64_t)h * a_sh + (int64_t)t * a_st;
    uint16_t *orow = out + (int64_t)t * o_st + (int64_t)h * o_sh;
    for (int l = threadIdx.x; l < L; l += blockDim.x) {
        float acc = 0.0f;
        for (int p = 0; p < P; p++)
            acc += ref_bf16(arow + p) * ref_bf16(w + (int64_t)h * w_sh + (int64_t)p * w_sp + l);
        __nv_bfloat16 v = __float2bfloat16_rn(acc);
        orow[l] = *(uint16_t *)&v;
    }
    const uint16_t *perow = pe + (int64_t)t * pe_st + (int64_t)h * pe_sh;
    for (int r = threadIdx.x; r < R; r += blockDim.x)
        orow[L + r] = perow[r];
}

/* o[t, h*V + v] = bf16(sum_l x[h,t,l] * w[h,l,v]); one block per (h,t). */
__global__ void ref_v_up_kernel(const uint16_t *x, int64_t x_sh, int64_t x_st,
                                const uint16_t *w, int64_t w_sh, int64_t w_sl,
                                uint16_t *o, int64_t o_st, int L, int V)
{
    const int h = blockIdx.x, t = blockIdx.y;
    const uint16_t *xrow = x + (int64_t)h * x_sh + (int64_t)t * x_st;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        float acc = 0.0f;
        for (int l = 0; l < L; l++)
            acc += ref_bf16(xrow + l) * ref_bf16(w + (int64_t)h * w_sh + (int64_t)l * w_sl + v);
        __nv_bfloat16 r = __float2bfloat16_rn(acc);
        o[(int64_t)t * o_st + (int64_t)h * V + v] = *(uint16_t *)&r;
    }
}

int ref_launch_status(const char *what)
{
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return mlart_set_error(MLART_ECUDA, "%s: %s", what, cudaGetErrorString(e));
    return 0;
}

int ref_inner_dense(const mlart_tensor *t, const char *name)
{
    if (t->data == NULL || t->stride[t->ndim - 1] != 1)
        return mlart_set_error(MLART_ELAYOUT, "%s: needs data and inner stride 1", name);
    return 0;
}

} /* namespace */

extern "C" int mlart_reference_attend_cuda(const mlart_step *s, void *stream)
{
    const mlart_geometry *g = &s->geom;
    ref_attend_args a;
    size_t shmem;

    if (s->T == 0)
        return 0;
    if (ref_inner_dense(&s->q_mqa, "q_mqa") < 0 || ref_inner_dense(&s->attn_out, "attn_out") < 0)
        return MLART_ELAYOUT;
    if (g->kv_format == MLART_KV_FP8_DS_MLA && g->kv_lora % 128 != 0)
        return mlart_set_error(MLART_EINVAL, "fp8_ds_mla needs kv_lora %% 128 == 0");
    a.q = (const uint16_t *)s->q_mqa.data;
    a.q_st = s->q_mqa.stride[0];
    a.q_sh = s->q_mqa.stride[1];
    a.kv = (const uint8_t *)s->kv_cache.data;
    a.kv_row = s->kv_cache.stride[0];
    a.num_slots = s->kv_cache.shape[0];
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
    a.out = (uint16_t *)s->attn_out.data;
    a.o_sh = s->attn_out.stride[0];
    a.o_st = s->attn_out.stride[1];
    a.lse = (float *)s->lse.data;
    a.l_sh = s->lse.stride[0];
    a.l_st = s->lse.stride[1];
    a.T = s->T;
    a.H = g->heads;
    a.L = g->kv_lora;
    a.R = g->rope;
    a.topk = g->topk;
    a.page = g->page_size;
    a.B = s->B;
    a.fp8 = g->kv_format == MLART_KV_FP8_DS_MLA;
    a.scale = g->softmax_scale;

    const int threads = 128;
    shmem = sizeof(float) * ((size_t)g->kv_lora + g->rope + g->topk + threads);
    if (shmem > 48 * 1024)
        return mlart_set_error(MLART_ENOTSUP, "reference attend (CUDA): topk %d too large",
                               (int)g->topk);
    dim3 grid((unsigned)s->T, (unsigned)g->heads);
    ref_attend_kernel<<<grid, threads, shmem, (cudaStream_t)stream>>>(a);
    return ref_launch_status("reference attend (CUDA)");
}

extern "C" int mlart_reference_absorb_cuda(const mlart_step *s, void *stream)
{
    const mlart_geometry *g = &s->geom;
    if (s->T == 0)
        return 0;
    if (ref_inner_dense(&s->q_nope, "q_nope") < 0 || ref_inner_dense(&s->w_uk_t, "w_uk_t") < 0 ||
        ref_inner_dense(&s->q_mqa, "q_mqa") < 0 || ref_inner_dense(&s->q_pe, "q_pe") < 0)
        return MLART_ELAYOUT;
    dim3 grid((unsigned)g->heads, (unsigned)s->T);
    ref_absorb_kernel<<<grid, 128, 0, (cudaStream_t)stream>>>(
        (const uint16_t *)s->q_nope.data, s->q_nope.stride[0], s->q_nope.stride[1],
        (const uint16_t *)s->w_uk_t.data, s->w_uk_t.stride[0], s->w_uk_t.stride[1],
        (uint16_t *)s->q_mqa.data, s->q_mqa.stride[0], s->q_mqa.stride[1],
        (const uint16_t *)s->q_pe.data, s->q_pe.stride[0], s->q_pe.stride[1], g->qk_nope,
        g->kv_lora, g->rope);
    return ref_launch_status("reference absorb (CUDA)");
}

extern "C" int mlart_reference_v_up_cuda(const mlart_step *s, void *stream)
{
    const mlart_geometry *g = &s->geom;
    if (s->T == 0)
        return 0;
    if (ref_inner_dense(&s->attn_out, "attn_out") < 0 || ref_inner_dense(&s->w_uv, "w_uv") < 0 ||
        ref_inner_dense(&s->o, "o") < 0)
        return MLART_ELAYOUT;
    dim3 grid((unsigned)g->heads, (unsigned)s->T);
    ref_v_up_kernel<<<grid, 128, 0, (cudaStream_t)stream>>>(
        (const uint16_t *)s->attn_out.data, s->attn_out.stride[0], s->attn_out.stride[1],
        (const uint16_t *)s->w_uv.data, s->w_uv.stride[0], s->w_uv.stride[1],
        (uint16_t *)s->o.data, s->o.stride[0], g->kv_lora, g->v_head);
    return ref_launch_status("reference v_up (CUDA)");
}
