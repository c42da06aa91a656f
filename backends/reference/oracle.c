/* Float64 oracle of the decode step: every intermediate in double, the
 * plainest loops that state the formula.  Kept apart from the reference
 * backend (which rounds q_mqa, attn_out and o to bf16 like every backend
 * does) so the two check each other. */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backends/reference/oracle.h"
#include "backends/reference/reference.h"
#include "ops/numerics.h"
#include "runtime/status.h"

static const char who[] = "oracle";

static double bf16_at(const mlart_tensor *t, int64_t i, int64_t j, int64_t k)
{
    const uint16_t *p = (const uint16_t *)t->data;
    int64_t off = i * t->stride[0] + j * t->stride[1] + (t->ndim > 2 ? k * t->stride[2] : 0);
    return (double)mlart_bf16_to_f32(p[off]);
}

static int32_t i32_at(const mlart_tensor *t, int64_t i, int64_t j)
{
    const int32_t *p = (const int32_t *)t->data;
    return p[i * t->stride[0] + (t->ndim > 1 ? j * t->stride[1] : 0)];
}

/* Cache row `slot` as L+R doubles. */
static void load_row(const mlart_geometry *g, const mlart_tensor *cache, int64_t slot, double *out)
{
    const uint8_t *rec = (const uint8_t *)cache->data + slot * cache->stride[0];
    int64_t L = g->kv_lora, R = g->rope; /* L + R may pass INT32_MAX */
    if (g->kv_format == MLART_KV_FP8_DS_MLA) {
        for (int tile = 0; tile < L / MLART_FP8_DS_MLA_TILE; tile++) {
            float scale;
            memcpy(&scale, rec + L + sizeof(float) * (size_t)tile, sizeof scale);
            for (int i = 0; i < MLART_FP8_DS_MLA_TILE; i++) {
                int64_t l = (int64_t)tile * MLART_FP8_DS_MLA_TILE + i;
                out[l] = (double)mlart_e4m3_to_f32(rec[l]) * (double)scale;
            }
        }
        for (int64_t r = 0; r < R; r++) {
            uint16_t h;
            memcpy(&h, rec + L + sizeof(float) * (size_t)(L / MLART_FP8_DS_MLA_TILE) + 2 * (size_t)r,
                   sizeof h);
            out[L + r] = (double)mlart_bf16_to_f32(h);
        }
    } else {
        for (int64_t d = 0; d < L + R; d++) {
            uint16_t h;
            memcpy(&h, rec + 2 * (size_t)d, sizeof h);
            out[d] = (double)mlart_bf16_to_f32(h);
        }
    }
}

static int check_views(const mlart_oracle_problem *p, mlart_tensor *wk, mlart_tensor *wv)
{
    const mlart_geometry *g = &p->geom;
    int64_t H = g->heads, P = g->qk_nope, R = g->rope, L = g->kv_lora, V = g->v_head;
    int64_t sh[3];
    sh[0] = p->T, sh[1] = H, sh[2] = P + R;
    MLART_CHECK(mlart_reference_check_view(who, "q [T,H,P+R]", &p->q, 3, MLART_DTYPE_BF16, sh, 0));
    if (p->kv_b_proj.data) {
        MLART_CHECK(mlart_weights_from_kv_b_proj(g, &p->kv_b_proj, wk, wv));
    } else {
        *wk = p->w_uk_t;
        *wv = p->w_uv;
    }
    sh[0] = H, sh[1] = P, sh[2] = L;
    MLART_CHECK(mlart_reference_check_view(who, "w_uk_t [H,P,L]", wk, 3, MLART_DTYPE_BF16, sh, 0));
    sh[0] = H, sh[1] = L, sh[2] = V;
    MLART_CHECK(mlart_reference_check_view(who, "w_uv [H,L,V]", wv, 3, MLART_DTYPE_BF16, sh, 0));
    sh[0] = -1, sh[1] = (int64_t)mlart_kv_bytes_per_token(g);
    MLART_CHECK(mlart_reference_check_view(who, "kv_cache [num_slots,bytes_per_token]", &p->kv_cache, 2,
                                           MLART_DTYPE_U8, sh, 1));
    sh[0] = p->T, sh[1] = g->topk;
    MLART_CHECK(mlart_reference_check_view(who, "idx [T,topk]", &p->idx, 2, MLART_DTYPE_I32, sh, 0));
    sh[0] = p->T;
    MLART_CHECK(mlart_reference_check_view(who, "req_of_token [T]", &p->req_of_token, 1,
                                           MLART_DTYPE_I32, sh, 0));
    sh[0] = p->B;
    MLART_CHECK(mlart_reference_check_view(who, "seq_lens [B]", &p->seq_lens, 1, MLART_DTYPE_I32, sh, 0));
    for (int64_t b = 0; b < p->B; b++)
        if (i32_at(&p->seq_lens, b, 0) < 0)
            return mlart_set_error(MLART_ERANGE, "%s: seq_lens[%" PRId64 "] = %d is negative", who, b,
                                   (int)i32_at(&p->seq_lens, b, 0));
    sh[0] = p->B, sh[1] = -1;
    MLART_CHECK(mlart_reference_check_view(who, "block_table [B,max_blocks]", &p->block_table, 2,
                                           MLART_DTYPE_I32, sh, 0));
    {
        const mlart_tensor *ts[] = {&p->q, wk, wv, &p->kv_cache, &p->idx, &p->req_of_token,
                                    &p->seq_lens, &p->block_table};
        for (int i = 0; i < 8; i++)
            if (ts[i]->device != -1)
                return mlart_set_error(MLART_EINVAL, "%s: inputs must be in host memory", who);
    }
    return 0;
}

/* *bytes = a * b * c doubles; 1 when that is past SIZE_MAX. */
static int f64_bytes(int64_t a, int64_t b, int64_t c, size_t *bytes)
{
    return __builtin_mul_overflow((size_t)a, (size_t)b, bytes) ||
           __builtin_mul_overflow(*bytes, (size_t)c, bytes) ||
           __builtin_mul_overflow(*bytes, sizeof(double), bytes);
}

/* Slot of index k of token t, -1 for an empty entry, or an error. */
static int slot_for(const mlart_oracle_problem *p, int64_t t, int64_t k, int64_t *slot)
{
    int32_t b = i32_at(&p->req_of_token, t, 0), i, len, page = p->geom.page_size, blk;
    if (b < 0 || b >= p->B)
        return mlart_set_error(MLART_ERANGE, "%s: req_of_token[%" PRId64 "] = %d outside [0, %d)", who, t,
                               (int)b, (int)p->B);
    i = i32_at(&p->idx, t, k);
    len = i32_at(&p->seq_lens, b, 0);
    if (i == -1) {
        *slot = -1;
        return 0;
    }
    if (i < -1 || i >= len)
        return mlart_set_error(MLART_ERANGE,
                               "%s: idx[%" PRId64 "][%" PRId64 "] = %d: must be -1 or in [0, seq_lens[%d] = %d)",
                               who, t, k, (int)i, (int)b, (int)len);
    if (i / page >= p->block_table.shape[1])
        return mlart_set_error(MLART_ERANGE, "%s: idx[%" PRId64 "][%" PRId64 "] = %d is past the block table",
                               who, t, k, (int)i);
    blk = i32_at(&p->block_table, b, i / page);
    *slot = (int64_t)blk * page + i % page;
    if (blk < 0 || *slot >= p->kv_cache.shape[0])
        return mlart_set_error(MLART_ERANGE,
                               "%s: block_table[%d][%d] = %d puts idx[%" PRId64 "][%" PRId64 "] outside the cache",
                               who, (int)b, (int)(i / page), (int)blk, t, k);
    return 0;
}

int mlart_oracle_decode_f64(const mlart_oracle_problem *p, double *o, double *lse)
{
    const mlart_geometry *g;
    mlart_tensor wk, wv;
    int64_t T, H, P, R, L, V, D, topk;
    double *qlat = NULL, *rows = NULL, *w = NULL, *lat = NULL, *o_new = NULL, *lse_new = NULL;
    size_t rows_bytes, o_bytes, lse_bytes;
    int rc = 0;
    if (!p || !o)
        return mlart_set_error(MLART_EINVAL, "%s: problem and o are required", who);
    g = &p->geom;
    MLART_CHECK(mlart_geometry_check(g));
    if (p->T < 0 || p->B < 0)
        return mlart_set_error(MLART_EINVAL, "%s: T and B must be >= 0", who);
    MLART_CHECK(check_views(p, &wk, &wv));
    T = p->T, H = g->heads, P = g->qk_nope, R = g->rope, L = g->kv_lora, V = g->v_head;
    D = L + R, topk = g->topk;
    /* T*H*V and H*T count outputs the caller holds; top-k rows of L+R may
     * not fit even so.  Sizes that wrap would give buffers too small. */
    if (f64_bytes(topk, D, 1, &rows_bytes) || f64_bytes(T, H, V, &o_bytes) ||
        f64_bytes(H, T, 1, &lse_bytes) || o_bytes > SIZE_MAX - sizeof(double) ||
        lse_bytes > SIZE_MAX - sizeof(double))
        return mlart_set_error(MLART_ERANGE,
                               "%s: scratch for top-k %" PRId64 " rows of L+R = %" PRId64
                               " values and T*H*V = %" PRId64 "*%" PRId64 "*%" PRId64
                               " outputs is past SIZE_MAX bytes",
                               who, topk, D, T, H, V);
    for (int64_t t = 0; t < T; t++) /* all errors before any output */
        for (int64_t k = 0; k < topk; k++) {
            int64_t sl;
            MLART_CHECK(slot_for(p, t, k, &sl));
        }
    qlat = malloc(sizeof *qlat * (size_t)D);
    rows = malloc(rows_bytes);
    w = malloc(sizeof *w * (size_t)topk);
    lat = malloc(sizeof *lat * (size_t)L);
    o_new = malloc(o_bytes + sizeof *o_new);
    lse_new = malloc(lse_bytes + sizeof *lse_new);
    if (!qlat || !rows || !w || !lat || !o_new || !lse_new) {
        rc = mlart_set_error(MLART_ENOMEM, "%s: scratch for topk=%" PRId64 " rows", who, topk);
        goto done;
    }
    for (int64_t t = 0; t < T; t++) {
        int64_t n = 0;
        for (int64_t k = 0; k < topk; k++) {
            int64_t sl;
            (void)slot_for(p, t, k, &sl);
            if (sl >= 0)
                load_row(g, &p->kv_cache, sl, rows + (n++) * D);
        }
        for (int64_t h = 0; h < H; h++) {
            double m = -INFINITY, sum = 0.0;
            /* q_mqa = [q_nope . W_UK_T[h], q_pe], unrounded */
            for (int64_t l = 0; l < L; l++)
                qlat[l] = 0.0;
            for (int64_t pp = 0; pp < P; pp++) {
                double qv = bf16_at(&p->q, t, h, pp);
                for (int64_t l = 0; l < L; l++)
                    qlat[l] += qv * bf16_at(&wk, h, pp, l);
            }
            for (int64_t r = 0; r < R; r++)
                qlat[L + r] = bf16_at(&p->q, t, h, P + r);
            for (int64_t j = 0; j < n; j++) {
                double dot = 0.0;
                for (int64_t d = 0; d < D; d++)
                    dot += qlat[d] * rows[j * D + d];
                w[j] = (double)g->softmax_scale * dot;
                if (w[j] > m)
                    m = w[j];
            }
            for (int64_t j = 0; j < n; j++) {
                w[j] = exp(w[j] - m);
                sum += w[j];
            }
            for (int64_t l = 0; l < L; l++)
                lat[l] = 0.0;
            for (int64_t j = 0; j < n; j++)
                for (int64_t l = 0; l < L; l++)
                    lat[l] += w[j] * rows[j * D + l];
            for (int64_t l = 0; l < L; l++)
                lat[l] = n ? lat[l] / sum : 0.0;
            for (int64_t v = 0; v < V; v++) {
                double a = 0.0;
                for (int64_t l = 0; l < L; l++)
                    a += lat[l] * bf16_at(&wv, h, l, v);
                o_new[t * H * V + h * V + v] = a;
            }
            lse_new[h * T + t] = n ? m + log(sum) : -INFINITY;
        }
    }
    memcpy(o, o_new, o_bytes);
    if (lse)
        memcpy(lse, lse_new, lse_bytes);
done:
    free(qlat);
    free(rows);
    free(w);
    free(lat);
    free(o_new);
    free(lse_new);
    return rc;
}

int mlart_oracle_compare(const mlart_tensor *got, const double *ref, mlart_oracle_error *err)
{
    mlart_oracle_error e;
    double num = 0.0, den = 0.0;
    int64_t rows, cols;
    if (!got || !ref || !err)
        return mlart_set_error(MLART_EINVAL, "oracle compare: NULL argument");
    if (got->ndim < 1 || got->ndim > 2 ||
        (got->dtype != MLART_DTYPE_BF16 && got->dtype != MLART_DTYPE_F32))
        return mlart_set_error(MLART_EINVAL, "oracle compare: got must be a 1-D or 2-D bf16/f32 view");
    MLART_CHECK(mlart_tensor_check(got, "oracle compare: got"));
    if (got->device != -1)
        return mlart_set_error(MLART_EINVAL, "oracle compare: got must be in host memory");
    rows = got->ndim == 2 ? got->shape[0] : 1;
    cols = got->ndim == 2 ? got->shape[1] : got->shape[0];
    memset(&e, 0, sizeof e);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) {
            int64_t off = got->ndim == 2 ? i * got->stride[0] + j * got->stride[1] : j * got->stride[0];
            double x = got->dtype == MLART_DTYPE_BF16
                           ? (double)mlart_bf16_to_f32(((const uint16_t *)got->data)[off])
                           : (double)((const float *)got->data)[off];
            double r = ref[i * cols + j];
            e.count++;
            if (isinf(r)) {
                if (x != r)
                    e.inf_mismatch++;
                continue;
            }
            if (!isfinite(x)) {
                e.nonfinite++;
                continue;
            }
            if (fabs(x - r) > e.max_abs)
                e.max_abs = fabs(x - r);
            num += (x - r) * (x - r);
            den += r * r;
        }
    e.rel_l2 = den > 0.0 ? sqrt(num / den) : (num > 0.0 ? INFINITY : 0.0);
    e.nmse = e.rel_l2 * e.rel_l2;
    *err = e;
    return 0;
}
