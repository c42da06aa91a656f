/* Ops shared by the runtime and the backends.  Each op has a CPU twin (the
 * oracle, plain C) and a CUDA implementation with the same arguments plus a
 * stream.  Every op reads and writes only the bytes of its views' spans.
 * The *_check functions validate shapes, dtypes and spans; callers run them
 * once at plan/bind time, and the CUDA entry points run them again only
 * where it is free (no host reads of device memory). */
#ifndef MLART_OPS_H
#define MLART_OPS_H

#include "mlart/mlart.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Query absorption: out[h,t,:] = a[h,t,:] (1xP) x w[h] (PxL), FP32 accumulate.
 *   a   [H,T,P] bf16, inner stride 1, any other strides (e.g. the q_nope view
 *       of q[T,H,P+R]: strides P+R, H*(P+R), 1)
 *   w   [H,P,L] bf16, inner stride 1
 *   out [H,T,L] bf16, inner stride 1, any other strides (e.g. into
 *       q_mqa[T,H,L+R]: strides L+R, H*(L+R), 1)
 *   pe_in/pe_out [T,H,R] bf16 or both NULL: copy pe_in into pe_out in the
 *       same launch (q_pe beside the absorbed columns of q_mqa). */
int mlart_query_bmm_check(const mlart_tensor *a, const mlart_tensor *w, const mlart_tensor *out,
                          const mlart_tensor *pe_in, const mlart_tensor *pe_out);
int mlart_query_bmm_cpu(const mlart_tensor *a, const mlart_tensor *w, const mlart_tensor *out,
                        const mlart_tensor *pe_in, const mlart_tensor *pe_out);
int mlart_query_bmm_cuda(const mlart_tensor *a, const mlart_tensor *w, const mlart_tensor *out,
                         const mlart_tensor *pe_in, const mlart_tensor *pe_out, void *stream);
/* The same, launched with programmatic dependent launch: the kernel may be
 * scheduled while the previous kernel of the stream still runs and read w
 * then; it reads a and pe_in and writes out and pe_out only once that
 * kernel and its writes are complete.  For a caller whose previous kernel
 * never writes w (the layer step with mlart_layer_desc.early_weights).
 * It launches plainly where the automatic choice is the direct kernel and w
 * is over 4 MiB, and at 64-127 heads with P = 192 and 33-64 token rows
 * (both measured slower with PDL in the layer step). */
int mlart_query_bmm_cuda_pdl(const mlart_tensor *a, const mlart_tensor *w, const mlart_tensor *out,
                             const mlart_tensor *pe_in, const mlart_tensor *pe_out, void *stream);

/* V up-projection: o[h,t,:] = x[h,t,:] (1xL) x w[h] (LxV), FP32 accumulate.
 *   x [H,T,L] bf16 (head-major attention output), inner stride 1
 *   w [H,L,V] bf16, inner stride 1
 *   o [H,T,V] bf16 view, inner stride 1 (e.g. of o[T,H*V]: strides V, H*V, 1) */
int mlart_v_up_bmm_check(const mlart_tensor *x, const mlart_tensor *w, const mlart_tensor *o);
int mlart_v_up_bmm_cpu(const mlart_tensor *x, const mlart_tensor *w, const mlart_tensor *o);
int mlart_v_up_bmm_cuda(const mlart_tensor *x, const mlart_tensor *w, const mlart_tensor *o,
                        void *stream);
/* The same, launched with programmatic dependent launch: the kernel may be
 * scheduled while the previous kernel of the stream still runs and read w
 * then; it reads x and writes o only once that kernel and its writes are
 * complete.  For a caller whose previous kernel never writes w (the layer
 * step, after the backend's attend). */
int mlart_v_up_bmm_cuda_pdl(const mlart_tensor *x, const mlart_tensor *w, const mlart_tensor *o,
                            void *stream);

/* Cache write: rows latent[N, L+R] bf16 into cache u8 [num_slots, bytes_per_token]
 * at slots[N] (i32 physical slot; -1 = skip), in the geometry's kv format
 * (fp8_ds_mla: per 128-value tile scale = 2^ceil(log2(amax/448)), e4m3 RNE,
 * then the L/128 fp32 scales, then the R bf16 rope values). */
int mlart_kv_write_check(const mlart_geometry *g, const mlart_tensor *cache,
                         const mlart_tensor *latent, const mlart_tensor *slots);
int mlart_kv_write_cpu(const mlart_geometry *g, const mlart_tensor *cache,
                       const mlart_tensor *latent, const mlart_tensor *slots);
/* CUDA: L and R each at most 1536 (MLART_ENOTSUP beyond).  Up to 1024 rows
 * (bf16; fp8_ds_mla 2048) one kernel launched with programmatic dependent launch, which touches
 * memory only after the previous kernel of the stream is complete; more
 * rows on 4-byte aligned cache rows, one cooperative kernel launched
 * plainly, whose work is linear in N (it uses each named record's first
 * word as scratch before it writes the record), where the device allows
 * it (cudaDevAttrCooperativeLaunch, and the launch not refused as too
 * large outside a graph capture; else the first kernel, N^2 work). */
int mlart_kv_write_cuda(const mlart_geometry *g, const mlart_tensor *cache,
                        const mlart_tensor *latent, const mlart_tensor *slots, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* MLART_OPS_H */
