/* A naive float64 oracle of the whole decode step (docs/reference.md), from
 * the original inputs, with no intermediate rounding: the latent query, the
 * scores, the softmax, the attention output and the V up-projection are all
 * kept in double.  Slow and obviously right; for tests and for
 * `mlart-decode --verify`.  Host memory only. */
#ifndef MLART_BACKENDS_REFERENCE_ORACLE_H
#define MLART_BACKENDS_REFERENCE_ORACLE_H

#include <stdint.h>

#include "mlart/mlart.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mlart_oracle_problem {
    mlart_geometry geom;
    int32_t T, B;
    mlart_tensor q;            /* [T,H,P+R] bf16, any strides */
    mlart_tensor kv_b_proj;    /* [H*(P+V), L] bf16 checkpoint layout; used when data != NULL */
    mlart_tensor w_uk_t;       /* [H,P,L] bf16, any strides (when kv_b_proj.data == NULL) */
    mlart_tensor w_uv;         /* [H,L,V] bf16, any strides (when kv_b_proj.data == NULL) */
    mlart_tensor kv_cache;     /* u8 [num_slots, bytes_per_token] in geom.kv_format; fp8
                                  records are dequantised (e4m3 * tile scale) */
    mlart_tensor idx;          /* [T,topk] i32 logical positions, -1 = empty */
    mlart_tensor req_of_token; /* [T] i32 */
    mlart_tensor seq_lens;     /* [B] i32 */
    mlart_tensor block_table;  /* [B,max_blocks] i32 */
} mlart_oracle_problem;

/* o[t*H*V + h*V + v] and, when lse != NULL, lse[h*T + t] (natural log,
 * -INFINITY for a row with no valid slot, whose o is 0).  Duplicated indices
 * count once per occurrence.  An index < -1 or >= its request's seq_len, a
 * request id outside [0,B) or a block that maps outside the cache gives
 * MLART_ERANGE naming it, and so does a problem whose scratch (top-k rows
 * of L+R doubles, T*H*V outputs) is past SIZE_MAX bytes; bad views give
 * the usual shape/dtype/layout errors.  Nothing is written on failure. */
int mlart_oracle_decode_f64(const mlart_oracle_problem *p, double *o, double *lse);

/* Error of `got` (a 1- or 2-D host view of bf16 or f32 values, dense
 * row-major order of its elements) against ref[numel].  Infinite reference
 * entries must be matched exactly (same sign of infinity) and are left out of
 * the norms; anything else non-finite in `got` counts in `nonfinite`. */
typedef struct mlart_oracle_error {
    int64_t count;      /* elements compared */
    int64_t nonfinite;  /* NaN/inf in got where ref is finite */
    int64_t inf_mismatch; /* ref infinite but got differs */
    double max_abs;     /* max |got - ref| over finite pairs */
    double rel_l2;      /* ||got - ref|| / ||ref|| over finite pairs (0/0 = 0) */
    double nmse;        /* rel_l2^2 */
} mlart_oracle_error;

int mlart_oracle_compare(const mlart_tensor *got, const double *ref, mlart_oracle_error *err);

#ifdef __cplusplus
}
#endif
#endif
