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
 *       same launch (q_pe beside the absorbed columns of q_mqa).  out and
 *       pe_out must share no element (MLART_ELAYOUT): their spans apart, or
 *       columns 0..L-1 and L..L+R-1 of one view such as q_mqa[T,H,L+R]. */
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
/* CUDA: L and R each at most 1536 (MLART_ENOTSUP beyond), N at most
 * 2 * (2^31 - 1) rows (MLART_ERANGE beyond; the CPU twin has no bound).  Up to 1024 rows
 * (bf16; fp8_ds_mla 2048) one kernel launched with programmatic dependent launch, which touches
 * memory only after the previous kernel of the stream is complete; more
 * rows on 4-byte aligned cache rows, one cooperative kernel launched
 * plainly, whose work is linear in N (it uses each named record's first
 * word as scratch before it writes the record), where the device allows
 * it (cudaDevAttrCooperativeLaunch, and the launch not refused as too
 * large outside a graph capture; else the first kernel, N^2 work). */
int mlart_kv_write_cuda(const mlart_geometry *g, const mlart_tensor *cache,
                        const mlart_tensor *latent, const mlart_tensor *slots, void *stream);

/* Decode-context parallel (docs/dcp.md; include/mlart/comm.h for the placement).
 * Plain arrays, dense, on the host (_cpu) or the device (_cuda, on `stream`,
 * allocation- and sync-free).
 *
 * translate: this rank's view of a step.  idx [T,topk] global logical
 * positions (-1 empty) -> idx_local: mlart_dcp_local_pos where this rank owns
 * the position, else -1; seq_lens [B] -> lens_local: mlart_dcp_local_len. */
int mlart_dcp_translate_cpu(const int32_t *idx, int64_t n_idx, const int32_t *seq_lens, int32_t B,
                            int32_t rank, int32_t size, int32_t interleave, int32_t *idx_local,
                            int32_t *lens_local);
int mlart_dcp_translate_cuda(const int32_t *idx, int64_t n_idx, const int32_t *seq_lens,
                             int32_t B, int32_t rank, int32_t size, int32_t interleave,
                             int32_t *idx_local, int32_t *lens_local, void *stream);
/* gather_heads: every rank's absorbed queries src [D][T,H,C] (rank-major,
 * as an all-gather leaves them) -> dst [T,D*H,C] (head d*H+h of token t is
 * rank d's head h); C a multiple of 8. */
int mlart_dcp_gather_heads_cpu(const uint16_t *src, int32_t D, int64_t T, int64_t H, int64_t C,
                               uint16_t *dst);
int mlart_dcp_gather_heads_cuda(const uint16_t *src, int32_t D, int64_t T, int64_t H, int64_t C,
                                uint16_t *dst, void *stream);
/* combine (a2a): parts [D][H,T,L] bf16 and lses [D][H,T] f32 (natural log,
 * -inf = no slot) -> out [H,T,L] bf16 = sum_s w_s parts_s with w_s =
 * exp(lse_s - m) / sum_r exp(lse_r - m), m = max_s lse_s; lse_out [H,T] =
 * m + log sum_s exp(lse_s - m); a row with every lse -inf gives 0 and -inf. */
int mlart_dcp_combine_cpu(const uint16_t *parts, const float *lses, int32_t D, int64_t H,
                          int64_t T, int64_t L, uint16_t *out, float *lse_out);
int mlart_dcp_combine_cuda(const uint16_t *parts, const float *lses, int32_t D, int64_t H,
                           int64_t T, int64_t L, uint16_t *out, float *lse_out, void *stream);
/* scale (ag_rs): attn [G,T,L] bf16 (G = D*H heads of the group), lse_all
 * [D][G,T] f32 (every rank's LSEs) -> scaled [G,T,L] f32 = w_rank * attn
 * (w as above, so that the sum over ranks is the combined output), and the
 * combined lse_out [H,T] of this rank's heads rank*H..rank*H+H-1.  A rank
 * outside [0, D) is refused (MLART_EINVAL). */
int mlart_dcp_scale_cpu(const uint16_t *attn, const float *lse_all, int32_t D, int32_t rank,
                        int64_t H, int64_t T, int64_t L, float *scaled, float *lse_out);
int mlart_dcp_scale_cuda(const uint16_t *attn, const float *lse_all, int32_t D, int32_t rank,
                         int64_t H, int64_t T, int64_t L, float *scaled, float *lse_out,
                         void *stream);
/* n f32 -> bf16 (round to nearest even). */
int mlart_f32_to_bf16_cpu(const float *in, int64_t n, uint16_t *out);
int mlart_f32_to_bf16_cuda(const float *in, int64_t n, uint16_t *out, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* MLART_OPS_H */
