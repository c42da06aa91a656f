/* Internal interface of the reference backend: the oracle.  The host path is
 * plain C (reference_cpu.c); the CUDA path is plain, obviously-right kernels
 * (reference_cuda.cu) for comparisons at sizes the CPU is too slow for. */
#ifndef MLART_BACKENDS_REFERENCE_H
#define MLART_BACKENDS_REFERENCE_H

#include "mlart/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The reference vtable (built in; devices = host | cuda when built with CUDA). */
const mlart_backend_vtable *mlart_backend_reference_vtable(void);

/* Host: sparse attention of one step (q_mqa, cache, idx -> attn_out, lse).
 * attn_out is head-major [H,T,L]; lse (skipped when its data is NULL) is
 * [H,T].  Validates every view and every index first (MLART_ERANGE names
 * the first bad one) and writes nothing on failure.  Uses s->workspace when
 * it holds mlart_reference_attend_cpu_workspace() bytes (8-aligned), else
 * allocates its own scratch. */
int mlart_reference_attend_cpu(const mlart_step *s);
/* The view checks of the attend stage alone (shapes, dtypes, spans, one
 * device); reads no tensor data, so the CUDA path runs it too. */
int mlart_reference_attend_check(const mlart_step *s);
/* Scratch bytes mlart_reference_attend_cpu needs for geometry g; 0 when
 * past SIZE_MAX (plan and the host path then refuse with MLART_ERANGE). */
size_t mlart_reference_attend_cpu_workspace(const mlart_geometry *g);

/* Validate one view of a step for `who`: rank, dtype, shape (entries of
 * `shape` < 0 match any size), span inside its extent, inner stride 1 when
 * inner_unit.  Messages name who and name.  Returns 0 or a negative status. */
int mlart_reference_check_view(const char *who, const char *name, const mlart_tensor *t, int ndim,
                               mlart_dtype dtype, const int64_t *shape, int inner_unit);

#ifdef MLART_WITH_CUDA
/* CUDA: plain kernels for the three stages of a step. */
int mlart_reference_absorb_cuda(const mlart_step *s, void *stream);
int mlart_reference_attend_cuda(const mlart_step *s, void *stream);
int mlart_reference_v_up_cuda(const mlart_step *s, void *stream);
#endif

#ifdef __cplusplus
}
#endif
#endif
