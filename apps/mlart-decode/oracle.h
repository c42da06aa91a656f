/* Naive float64 oracle of one decode step (docs/reference.md), written
 * straight from the formula and independent of every backend and op. */
#ifndef MLART_APPS_DECODE_ORACLE_H
#define MLART_APPS_DECODE_ORACLE_H

#include <stdint.h>

#include "mlart/mlart.h"

/* One step on host data:
 *   q [T,H,P+R] bf16; kv_b_proj [H*(P+V),L] bf16 (per head P rows of W_UK, V rows of W_UV);
 *   cache u8 [num_slots, bytes_per_token] in g->kv_format (fp8 records dequantised exactly);
 *   idx [T,topk], req_of_token [T], seq_lens [B], block_table [B,max_blocks] i32.
 * Writes o [T,H*V] and lse [H,T] (natural log, -inf for a row without a valid
 * slot; such rows give o = 0).  Indices outside [0, seq_len) other than -1
 * are skipped.  Returns 0, or MLART_ENOMEM. */
int mlart_decode_oracle(const mlart_geometry *g, int32_t T, const uint16_t *q,
                        const uint16_t *kv_b_proj, const uint8_t *cache, int64_t num_slots,
                        const int32_t *idx, const int32_t *req_of_token, const int32_t *seq_lens,
                        const int32_t *block_table, int32_t max_blocks, double *o, double *lse);

#endif
