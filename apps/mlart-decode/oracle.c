/* Float64 oracle: absorbed query, softmax over the top-k cache rows, V-up.
 * No rounding anywhere except the inputs themselves (bf16 / fp8 records). */
#include "apps/mlart-decode/oracle.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ops/numerics.h"

/* One cache row as L+R doubles. */
static void decode_row(const mlart_geometry *g, const uint8_t *rec, double *out)
{
    const int L = g->kv_lora, R = g->rope;
    if (g->kv_format == MLART_KV_BF16) {
        const uint16_t *v = (const uint16_t *)rec;
        for (int j = 0; j < L + R; j++)
            out[j] = mlart_bf16_to_f32(v[j]);
        return;
    }
    for (int j = 0; j < L; j++) {
        float scale; /* L/128 fp32 tile scales follow the e4m3 bytes */
        memcpy(&scale, rec + L + (j / 128) * 4, sizeof scale);
        out[j] = (double)mlart_e4m3_to_f32(rec[j]) * (double)scale;
    }
    for (int j = 0; j < R; j++) { /* then R bf16 rope values */
        uint16_t pe;
        memcpy(&pe, rec + L + (L / 128) * 4 + j * 2, sizeof pe);
        out[L + j] = mlart_bf16_to_f32(pe);
    }
}

int mlart_decode_oracle(const mlart_geometry *g, int32_t T, const uint16_t *q,
                        const uint16_t *kv_b_proj, const uint8_t *cache, int64_t num_slots,
                        const int32_t *idx, const int32_t *req_of_token, const int32_t *seq_lens,
                        const int32_t *block_table, int32_t max_blocks, double *o, double *lse)
{
    const int64_t H = g->heads, P = g->qk_nope, R = g->rope, L = g->kv_lora, V = g->v_head;
    const int64_t K = g->topk, page = g->page_size;
    const size_t bpt = mlart_kv_bytes_per_token(g);
    double *rows = malloc(sizeof(double) * (size_t)(K * (L + R)));
    double *qlat = malloc(sizeof(double) * (size_t)(L + R));
    double *score = malloc(sizeof(double) * (size_t)K);
    double *olat = malloc(sizeof(double) * (size_t)L);
    int *valid = malloc(sizeof(int) * (size_t)K);
    if (!rows || !qlat || !score || !olat || !valid) {
        free(rows), free(qlat), free(score), free(olat), free(valid);
        return MLART_ENOMEM;
    }
    for (int64_t t = 0; t < T; t++) {
        const int32_t r = req_of_token[t];
        for (int64_t k = 0; k < K; k++) { /* gather this token's rows once for all heads */
            int32_t i = idx[t * K + k];
            int64_t slot;
            valid[k] = 0;
            if (i < 0 || i >= seq_lens[r])
                continue;
            slot = (int64_t)block_table[(int64_t)r * max_blocks + i / page] * page + i % page;
            if (slot < 0 || slot >= num_slots)
                continue;
            decode_row(g, cache + (size_t)slot * bpt, rows + k * (L + R));
            valid[k] = 1;
        }
        for (int64_t h = 0; h < H; h++) {
            const uint16_t *qh = q + (t * H + h) * (P + R);
            const uint16_t *w = kv_b_proj + h * (P + V) * L;
            double m = -INFINITY, sum = 0.0;
            /* absorbed query: q_nope . W_UK (P x L), then q_pe */
            for (int64_t l = 0; l < L; l++)
                qlat[l] = 0.0;
            for (int64_t p = 0; p < P; p++) {
                double a = mlart_bf16_to_f32(qh[p]);
                for (int64_t l = 0; l < L; l++)
                    qlat[l] += a * mlart_bf16_to_f32(w[p * L + l]);
            }
            for (int64_t j = 0; j < R; j++)
                qlat[L + j] = mlart_bf16_to_f32(qh[P + j]);
            for (int64_t k = 0; k < K; k++) {
                double d = 0.0;
                if (!valid[k])
                    continue;
                for (int64_t j = 0; j < L + R; j++)
                    d += qlat[j] * rows[k * (L + R) + j];
                score[k] = d * (double)g->softmax_scale;
                if (score[k] > m)
                    m = score[k];
            }
            for (int64_t l = 0; l < L; l++)
                olat[l] = 0.0;
            if (m > -INFINITY) {
                for (int64_t k = 0; k < K; k++)
                    if (valid[k])
                        sum += exp(score[k] - m);
                for (int64_t k = 0; k < K; k++) {
                    double p;
                    if (!valid[k])
                        continue;
                    p = exp(score[k] - m) / sum;
                    for (int64_t l = 0; l < L; l++)
                        olat[l] += p * rows[k * (L + R) + l];
                }
                lse[h * T + t] = m + log(sum);
            } else {
                lse[h * T + t] = -INFINITY;
            }
            /* V-up: olat (1 x L) . W_UV (L x V); W_UV[l][v] = kv_b_proj[h*(P+V)+P+v][l] */
            for (int64_t v = 0; v < V; v++) {
                const uint16_t *wv = w + (P + v) * L;
                double acc = 0.0;
                for (int64_t l = 0; l < L; l++)
                    acc += olat[l] * mlart_bf16_to_f32(wv[l]);
                o[t * H * V + h * V + v] = acc;
            }
        }
    }
    free(rows), free(qlat), free(score), free(olat), free(valid);
    return 0;
}
