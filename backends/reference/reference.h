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

/* Host: sparse attention of one step (q_mqa, cache, idx -> attn_out, lse). */
int mlart_reference_attend_cpu(const mlart_step *s);

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
