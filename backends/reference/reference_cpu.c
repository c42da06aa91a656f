/* Reference backend, host path: sparse MLA attention of one decode step in
 * plain C.  Scores, softmax and the weighted sum run in double over exact
 * float copies of the bf16/fp8 inputs; only the outputs are rounded (attn_out
 * once to bf16, lse to f32), so this path sits within one bf16 rounding of
 * the exact result and serves as the oracle for the fast backends. */
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/reference/reference.h"
#include "ops/numerics.h"
#include "runtime/status.h"

static void shape_str(int ndim, const int64_t *shape, char *buf, size_t n)
{
    size_t k = (size_t)snprintf(buf, n, "[");
    for (int d = 0; d < ndim && k < n; d++) {
        if (shape[d] < 0)
            k += (size_t)snprintf(buf + k, n - k, d ? ",*" : "*");
        else
            k += (size_t)snprintf(buf + k, n - k, d ? ",%" PRId64 : "%" PRId64, shape[d]);
    }
    if (k < n)
        snprintf(buf + k, n - k, "]");
}

int mlart_reference_check_view(const char *who, const char *name, const mlart_tensor *t, int ndim,
                               mlart_dtype dtype, const int64_t *shape, int inner_unit)
{
    char what[96], want[80], got[80];
    if (!t)
        return mlart_set_error(MLART_EINVAL, "%s: %s is NULL", who, name);
    if (!t->data)
        return mlart_set_error(MLART_EINVAL, "%s: %s has no data", who, name);
    if (t->dtype != dtype)
        return mlart_set_error(MLART_EDTYPE, "%s: %s must be %s, is %s", who, name,
                               mlart_dtype_name(dtype), mlart_dtype_name(t->dtype));
    if (t->ndim != ndim)
        return mlart_set_error(MLART_ESHAPE, "%s: %s must have %d dims, has %d", who, name, ndim,
                               t->ndim);
    for (int d = 0; d < ndim; d++)
        if (shape[d] >= 0 && t->shape[d] != shape[d]) {
            shape_str(ndim, shape, want, sizeof want);
            shape_str(ndim, t->shape, got, sizeof got);
            return mlart_set_error(MLART_ESHAPE, "%s: %s must be %s, is %s", who, name, want, got);
        }
    snprintf(what, sizeof what, "%s: %s", who, name);
    MLART_CHECK(mlart_tensor_check(t, what));
    if (inner_unit && t->stride[ndim - 1] != 1)
        return mlart_set_error(MLART_ELAYOUT, "%s: %s must have inner stride 1, has %" PRId64, who,
                               name, t->stride[ndim - 1]);
    return 0;
}

/* Workspace: scores[topk] and acc[L] doubles, then rows[topk][L+R] and
 * q[L+R] floats.  0 when that is past SIZE_MAX (top-k near 2^31 with L+R
 * near 2^31): the sum would wrap to a buffer smaller than the rows. */
size_t mlart_reference_attend_cpu_workspace(const mlart_geometry *g)
{
    size_t topk, D, floats, bytes;
    if (!g || g->topk <= 0 || g->kv_lora <= 0 || g->rope < 0)
        return 0;
    topk = (size_t)g->topk;
    D = (size_t)g->kv_lora + (size_t)g->rope;
    if (__builtin_mul_overflow(topk + 1, D, &floats) ||
        __builtin_mul_overflow(floats, sizeof(float), &bytes) ||
        __builtin_add_overflow(bytes, sizeof(double) * (topk + (size_t)g->kv_lora), &bytes))
        return 0;
    return bytes;
}

/* An output must not share a byte with an input (both checked views on
 * one device): attend reads the inputs while it writes. */
static int check_apart(const char *who, const char *oname, const mlart_tensor *o,
                       const char *iname, const mlart_tensor *in)
{
    int rc = mlart_tensor_overlap(o, in);
    if (rc < 0)
        return rc;
    if (rc)
        return mlart_set_error(MLART_ELAYOUT, "%s: output %s overlaps input %s", who, oname,
                               iname);
    return 0;
}

/* An output none of whose elements share an address: attend writes each
 * once, and a view that folds two onto one byte would keep only the last. */
static int check_own_elements(const char *who, const char *name, const mlart_tensor *o)
{
    int dim;
    int64_t covered;
    int rc = mlart_tensor_self_overlap(o, &dim, &covered);
    if (rc <= 0)
        return rc;
    return mlart_set_error(MLART_ELAYOUT,
                           "%s: output %s has overlapping elements (dim %d, stride %" PRId64 ")",
                           who, name, dim, o->stride[dim]);
}

static inline int32_t i32_at(const mlart_tensor *t, int64_t i, int64_t j)
{
    const int32_t *p = (const int32_t *)t->data;
    return p[i * t->stride[0] + (t->ndim > 1 ? j * t->stride[1] : 0)];
}

/* Cache row of logical position `pos` of request `b`. */
static inline int64_t slot_of(const mlart_step *s, int32_t b, int32_t pos)
{
    int32_t page = s->geom.page_size;
    return (int64_t)i32_at(&s->block_table, b, pos / page) * page + pos % page;
}

static int check_indices(const char *who, const mlart_step *s)
{
    const int32_t topk = s->geom.topk, page = s->geom.page_size;
    const int64_t num_slots = s->kv_cache.shape[0], max_blocks = s->block_table.shape[1];
    for (int64_t b = 0; b < s->B; b++)
        if (i32_at(&s->seq_lens, b, 0) < 0)
            return mlart_set_error(MLART_ERANGE, "%s: seq_lens[%" PRId64 "] = %d is negative", who, b,
                                   (int)i32_at(&s->seq_lens, b, 0));
    for (int64_t t = 0; t < s->T; t++) {
        int32_t b = i32_at(&s->req_of_token, t, 0), len;
        if (b < 0 || b >= s->B)
            return mlart_set_error(MLART_ERANGE, "%s: req_of_token[%" PRId64 "] = %d outside [0, B=%d)",
                                   who, t, (int)b, (int)s->B);
        len = i32_at(&s->seq_lens, b, 0);
        for (int32_t k = 0; k < topk; k++) {
            int32_t i = i32_at(&s->idx, t, k);
            int64_t slot;
            if (i == -1)
                continue;
            if (i < -1 || i >= len)
                return mlart_set_error(MLART_ERANGE,
                                       "%s: idx[%" PRId64 "][%d] = %d: must be -1 or in [0, seq_lens[%d] "
                                       "= %d)",
                                       who, t, (int)k, (int)i, (int)b, (int)len);
            if (i / page >= max_blocks)
                return mlart_set_error(MLART_ERANGE,
                                       "%s: idx[%" PRId64 "][%d] = %d needs block %d of request %d, but "
                                       "block_table has %" PRId64 " columns",
                                       who, t, (int)k, (int)i, (int)(i / page), (int)b, max_blocks);
            slot = slot_of(s, b, i);
            if (i32_at(&s->block_table, b, i / page) < 0 || slot >= num_slots)
                return mlart_set_error(MLART_ERANGE,
                                       "%s: block_table[%d][%d] = %d maps idx[%" PRId64 "][%d] = %d to "
                                       "slot %" PRId64 ", outside the cache's %" PRId64 " slots",
                                       who, (int)b, (int)(i / page),
                                       (int)i32_at(&s->block_table, b, i / page), t, (int)k, (int)i,
                                       slot, num_slots);
        }
    }
    return 0;
}

int mlart_reference_attend_check(const mlart_step *s)
{
    static const char who[] = "reference attend";
    const mlart_geometry *g;
    int64_t T, H, L, R, D, topk, shape[3];
    size_t bpt;
    if (!s)
        return mlart_set_error(MLART_EINVAL, "%s: step is NULL", who);
    g = &s->geom;
    MLART_CHECK(mlart_geometry_check(g));
    if (s->T < 0 || s->B < 0)
        return mlart_set_error(MLART_EINVAL, "%s: T = %d and B = %d must be >= 0", who, (int)s->T,
                               (int)s->B);
    T = s->T;
    H = g->heads;
    L = g->kv_lora;
    R = g->rope;
    D = L + R;
    topk = g->topk;
    bpt = mlart_kv_bytes_per_token(g);

    shape[0] = T, shape[1] = H, shape[2] = D;
    MLART_CHECK(mlart_reference_check_view(who, "q_mqa [T,H,L+R]", &s->q_mqa, 3, MLART_DTYPE_BF16,
                                           shape, 1));
    shape[0] = -1, shape[1] = (int64_t)bpt;
    MLART_CHECK(mlart_reference_check_view(who, "kv_cache [num_slots,bytes_per_token]", &s->kv_cache, 2,
                                           MLART_DTYPE_U8, shape, 1));
    shape[0] = T, shape[1] = topk;
    MLART_CHECK(mlart_reference_check_view(who, "idx [T,topk]", &s->idx, 2, MLART_DTYPE_I32, shape, 0));
    shape[0] = T;
    MLART_CHECK(mlart_reference_check_view(who, "req_of_token [T]", &s->req_of_token, 1,
                                           MLART_DTYPE_I32, shape, 0));
    shape[0] = s->B;
    MLART_CHECK(mlart_reference_check_view(who, "seq_lens [B]", &s->seq_lens, 1, MLART_DTYPE_I32,
                                           shape, 0));
    shape[0] = s->B, shape[1] = -1;
    MLART_CHECK(mlart_reference_check_view(who, "block_table [B,max_blocks]", &s->block_table, 2,
                                           MLART_DTYPE_I32, shape, 0));
    shape[0] = H, shape[1] = T, shape[2] = L;
    MLART_CHECK(mlart_reference_check_view(who, "attn_out [H,T,L]", &s->attn_out, 3, MLART_DTYPE_BF16,
                                           shape, 1));
    if (s->lse.data) {
        shape[0] = H, shape[1] = T;
        MLART_CHECK(mlart_reference_check_view(who, "lse [H,T]", &s->lse, 2, MLART_DTYPE_F32, shape, 0));
    }
    {
        const mlart_tensor *ts[] = {&s->q_mqa, &s->kv_cache, &s->idx, &s->req_of_token,
                                    &s->seq_lens, &s->block_table, &s->attn_out, &s->lse};
        static const char *const names[] = {"q_mqa", "kv_cache", "idx", "req_of_token",
                                            "seq_lens", "block_table", "attn_out", "lse"};
        for (int i = 0; i < 8; i++)
            if (ts[i]->data && ts[i]->device != s->device)
                return mlart_set_error(MLART_EINVAL, "%s: %s is on device %d, the step on device %d",
                                       who, names[i], ts[i]->device, s->device);
        /* the first six are the inputs, the last two the outputs */
        MLART_CHECK(check_own_elements(who, names[6], &s->attn_out));
        if (s->lse.data)
            MLART_CHECK(check_own_elements(who, names[7], &s->lse));
        if (s->lse.data) {
            int rc = mlart_tensor_overlap(&s->attn_out, &s->lse);
            if (rc < 0)
                return rc;
            if (rc)
                return mlart_set_error(MLART_ELAYOUT, "%s: outputs attn_out and lse overlap", who);
        }
        for (int i = 0; i < 6; i++) {
            MLART_CHECK(check_apart(who, names[6], &s->attn_out, names[i], ts[i]));
            if (s->lse.data)
                MLART_CHECK(check_apart(who, names[7], &s->lse, names[i], ts[i]));
        }
    }
    return 0;
}

int mlart_reference_attend_cpu(const mlart_step *s)
{
    static const char who[] = "reference attend";
    const mlart_geometry *g;
    int64_t T, H, L, R, D, topk;
    size_t ws_need;
    double *scores, *acc;
    float *rows, *q;
    void *scratch = NULL;
    MLART_CHECK(mlart_reference_attend_check(s));
    if (s->device != -1)
        return mlart_set_error(MLART_EINVAL, "%s: the host path got a step on device %d", who,
                               s->device);
    ws_need = mlart_reference_attend_cpu_workspace(&s->geom);
    if (!ws_need)
        return mlart_set_error(MLART_ERANGE,
                               "%s: scratch for top-k %d rows of L+R = %" PRId64 " values is past "
                               "SIZE_MAX bytes",
                               who, (int)s->geom.topk, (int64_t)s->geom.kv_lora + s->geom.rope);
    MLART_CHECK(check_indices(who, s));
    g = &s->geom;
    T = s->T;
    H = g->heads;
    L = g->kv_lora;
    R = g->rope;
    D = L + R;
    topk = g->topk;

    if (s->workspace && s->workspace_bytes >= ws_need && ((uintptr_t)s->workspace % 8) == 0) {
        scores = (double *)s->workspace;
    } else {
        scratch = malloc(ws_need);
        if (!scratch)
            return mlart_set_error(MLART_ENOMEM, "%s: %zu bytes of scratch", who, ws_need);
        scores = (double *)scratch;
    }
    acc = scores + topk;
    rows = (float *)(acc + L);
    q = rows + topk * D;

    for (int64_t t = 0; t < T; t++) {
        int32_t b = i32_at(&s->req_of_token, t, 0);
        int64_t n = 0;
        /* Gather and dequantise the token's valid rows once for all heads;
         * duplicated indices stay separate rows. */
        for (int64_t k = 0; k < topk; k++) {
            int32_t i = i32_at(&s->idx, t, k);
            const uint8_t *rec;
            float *dst = rows + n * D;
            if (i < 0)
                continue;
            rec = (const uint8_t *)s->kv_cache.data + slot_of(s, b, i) * s->kv_cache.stride[0];
            if (g->kv_format == MLART_KV_FP8_DS_MLA) {
                mlart_fp8_ds_mla_decode(rec, (int)L, (int)R, dst);
            } else {
                for (int64_t d = 0; d < D; d++) {
                    uint16_t h16;
                    memcpy(&h16, rec + 2 * d, sizeof h16);
                    dst[d] = mlart_bf16_to_f32(h16);
                }
            }
            n++;
        }
        for (int64_t h = 0; h < H; h++) {
            const uint16_t *qr =
                (const uint16_t *)s->q_mqa.data + t * s->q_mqa.stride[0] + h * s->q_mqa.stride[1];
            uint16_t *out =
                (uint16_t *)s->attn_out.data + h * s->attn_out.stride[0] + t * s->attn_out.stride[1];
            double m = -INFINITY, sum = 0.0, lse;
            for (int64_t d = 0; d < D; d++)
                q[d] = mlart_bf16_to_f32(qr[d]);
            for (int64_t j = 0; j < n; j++) {
                const float *kv = rows + j * D;
                double dot = 0.0;
                for (int64_t d = 0; d < D; d++)
                    dot += (double)q[d] * (double)kv[d];
                scores[j] = (double)g->softmax_scale * dot;
                if (scores[j] > m)
                    m = scores[j];
            }
            for (int64_t l = 0; l < L; l++)
                acc[l] = 0.0;
            if (n == 0) {
                lse = -INFINITY; /* no valid slot: output 0, never NaN */
            } else {
                for (int64_t j = 0; j < n; j++) {
                    scores[j] = exp(scores[j] - m);
                    sum += scores[j];
                }
                for (int64_t j = 0; j < n; j++) {
                    const float *kv = rows + j * D;
                    double p = scores[j] / sum;
                    for (int64_t l = 0; l < L; l++)
                        acc[l] += p * (double)kv[l];
                }
                lse = m + log(sum);
            }
            for (int64_t l = 0; l < L; l++)
                out[l] = mlart_f64_to_bf16(acc[l]);
            if (s->lse.data)
                ((float *)s->lse.data)[h * s->lse.stride[0] + t * s->lse.stride[1]] = (float)lse;
        }
    }
    free(scratch);
    return 0;
}
