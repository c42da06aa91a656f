/* dtypes, tensor views and their span checks, model geometry, kv formats, and
 * the absorbed-weight views of a checkpoint's kv_b_proj. */
#include "runtime/status.h"

#include <math.h>
#include <string.h>

size_t mlart_dtype_size(mlart_dtype dtype)
{
    switch (dtype) {
    case MLART_DTYPE_BF16:
        return 2;
    case MLART_DTYPE_FP8_E4M3:
    case MLART_DTYPE_U8:
        return 1;
    case MLART_DTYPE_F32:
    case MLART_DTYPE_I32:
        return 4;
    case MLART_DTYPE_I64:
        return 8;
    case MLART_DTYPE_INVALID:
        break;
    }
    return 0;
}

const char *mlart_dtype_name(mlart_dtype dtype)
{
    switch (dtype) {
    case MLART_DTYPE_BF16:
        return "bf16";
    case MLART_DTYPE_FP8_E4M3:
        return "fp8_e4m3";
    case MLART_DTYPE_F32:
        return "f32";
    case MLART_DTYPE_I32:
        return "i32";
    case MLART_DTYPE_U8:
        return "u8";
    case MLART_DTYPE_I64:
        return "i64";
    case MLART_DTYPE_INVALID:
        break;
    }
    return "invalid";
}

mlart_tensor mlart_tensor_dense(void *data, mlart_dtype dtype, int device, int ndim,
                                const int64_t *shape)
{
    mlart_tensor t;
    int64_t stride = 1;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.base = data;
    t.dtype = dtype;
    t.device = device;
    t.ndim = ndim;
    if (!shape)
        t.ndim = 0; /* no shape: a view mlart_tensor_check refuses, not an empty one */
    if (ndim < 1 || ndim > MLART_MAX_DIMS || !shape)
        return t; /* mlart_tensor_check refuses the bad ndim */
    for (int i = ndim - 1; i >= 0; i--) {
        const int64_t d = shape[i] > 0 ? shape[i] : 1;
        t.shape[i] = shape[i];
        t.stride[i] = stride;
        /* past INT64_MAX elements the strides saturate; numel is then -1 */
        stride = stride > INT64_MAX / d ? INT64_MAX : stride * d;
    }
    {
        /* a shape whose bytes do not fit in size_t gets extent 0, which
         * mlart_tensor_check then refuses */
        const int64_t n = mlart_tensor_numel(&t);
        const size_t esize = mlart_dtype_size(dtype);
        t.extent = n > 0 && esize && (uint64_t)n <= SIZE_MAX / esize ? (size_t)n * esize : 0;
    }
    return t;
}

int64_t mlart_tensor_numel(const mlart_tensor *t)
{
    int64_t n = 1;
    if (!t || t->ndim < 1 || t->ndim > MLART_MAX_DIMS)
        return 0;
    for (int i = 0; i < t->ndim; i++)
        if (t->shape[i] <= 0)
            return 0;
    for (int i = 0; i < t->ndim; i++) {
        if (n > INT64_MAX / t->shape[i])
            return -1;
        n *= t->shape[i];
    }
    return n;
}

int mlart_tensor_span(const mlart_tensor *t, size_t *lo, size_t *hi)
{
    size_t esize, off, last = 0;
    int empty = 0;
    if (!t || !lo || !hi)
        return mlart_set_error(MLART_EINVAL, "mlart_tensor_span: NULL argument");
    if (t->ndim < 1 || t->ndim > MLART_MAX_DIMS)
        return mlart_set_error(MLART_EINVAL, "tensor has ndim %d (want 1..%d)", t->ndim,
                               MLART_MAX_DIMS);
    esize = mlart_dtype_size(t->dtype);
    if (!esize)
        return mlart_set_error(MLART_EINVAL, "tensor has invalid dtype %d", (int)t->dtype);
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] < 0 || t->stride[i] < 0)
            return mlart_set_error(MLART_EINVAL, "tensor dim %d has shape %lld stride %lld "
                                   "(both must be >= 0)", i, (long long)t->shape[i],
                                   (long long)t->stride[i]);
        if (t->shape[i] == 0)
            empty = 1;
    }
    if ((uintptr_t)t->data < (uintptr_t)t->base)
        return mlart_set_error(MLART_EINVAL, "tensor data %p lies below its base %p", t->data,
                               t->base);
    off = (size_t)((uintptr_t)t->data - (uintptr_t)t->base);
    if (empty) {
        *lo = *hi = off;
        return 0;
    }
    if (!t->data)
        return mlart_set_error(MLART_EINVAL, "non-empty tensor has NULL data");
    for (int i = 0; i < t->ndim; i++) {
        size_t term;
        if (__builtin_mul_overflow((size_t)(t->shape[i] - 1), (size_t)t->stride[i], &term) ||
            __builtin_add_overflow(last, term, &last))
            return mlart_set_error(MLART_EINVAL, "tensor span overflows size_t");
    }
    /* elements touch [off, off + (last + 1) * esize) */
    if (__builtin_add_overflow(last, (size_t)1, &last) ||
        __builtin_mul_overflow(last, esize, &last) || __builtin_add_overflow(last, off, &last))
        return mlart_set_error(MLART_EINVAL, "tensor span overflows size_t");
    *lo = off;
    *hi = last;
    return 0;
}

/* A view as rows along its outermost dim d of more than one index: its
 * bytes lie in [first + k*S, first + k*S + w) for whole k, where first is
 * its lowest byte, S the byte stride of dim d and w the bytes one index of
 * d spans; *n = shape[d], and 1 (S 0) when only the last dim has more than
 * one index.  Returns 0 or MLART_EINVAL. */
static int row_form(const mlart_tensor *t, uintptr_t *first, size_t *S, size_t *w, int64_t *n)
{
    mlart_tensor row = *t;
    size_t lo, hi;
    int d = 0;
    while (d < t->ndim - 1 && t->shape[d] <= 1)
        d++;
    *n = d < t->ndim - 1 ? t->shape[d] : 1;
    if (*n > 1)
        row.shape[d] = 1;
    MLART_CHECK(mlart_tensor_span(&row, &lo, &hi));
    *first = (uintptr_t)t->base + lo, *w = hi - lo;
    if (*n <= 1 || __builtin_mul_overflow((size_t)t->stride[d], mlart_dtype_size(t->dtype), S))
        *S = 0, *n = 1;
    return 0;
}

/* Whether pieces of w1 bytes from f1 and of w2 bytes from f2, both
 * repeating every S bytes, are apart: [0, w1) and [d, d + w2) modulo S. */
static int apart_mod(uintptr_t f1, size_t w1, uintptr_t f2, size_t w2, size_t S)
{
    size_t d;
    if (!S || w1 > S || w2 > S)
        return 0;
    d = f2 >= f1 ? (size_t)(f2 - f1) % S : (S - (size_t)(f1 - f2) % S) % S;
    return d >= w1 && d + w2 <= S;
}

int mlart_tensor_overlap(const mlart_tensor *a, const mlart_tensor *b)
{
    size_t alo, ahi, blo, bhi, Sa, Sb, wa, wb;
    uintptr_t a0, a1, b0, b1, af, bf;
    int64_t na, nb;
    if (!a || !b)
        return mlart_set_error(MLART_EINVAL, "mlart_tensor_overlap: NULL argument");
    MLART_CHECK(mlart_tensor_span(a, &alo, &ahi));
    MLART_CHECK(mlart_tensor_span(b, &blo, &bhi));
    if (a->device != b->device || alo == ahi || blo == bhi)
        return 0;
    a0 = (uintptr_t)a->base + alo, a1 = (uintptr_t)a->base + ahi;
    b0 = (uintptr_t)b->base + blo, b1 = (uintptr_t)b->base + bhi;
    if (!(a0 < b1 && b0 < a1))
        return 0;
    /* The ranges meet.  Take one view's rows, S bytes apart; the other
     * view as rows of the same S, or whole as one piece no longer than S.
     * Pieces at offsets of the period that do not meet share no byte. */
    MLART_CHECK(row_form(a, &af, &Sa, &wa, &na));
    MLART_CHECK(row_form(b, &bf, &Sb, &wb, &nb));
    if (na > 1 && apart_mod(af, wa, b0, nb > 1 && Sb == Sa ? wb : (size_t)(b1 - b0), Sa))
        return 0;
    if (nb > 1 && apart_mod(bf, wb, a0, na > 1 && Sa == Sb ? wa : (size_t)(a1 - a0), Sb))
        return 0;
    return 1;
}

int mlart_tensor_self_overlap(const mlart_tensor *t, int *dim, int64_t *covered)
{
    int order[MLART_MAX_DIMS], n = 0, d_out = 0;
    int64_t cov = 1, cov_out = 0; /* elements spanned by the dims taken so far */
    if (!t)
        return mlart_set_error(MLART_EINVAL, "mlart_tensor_self_overlap: NULL view");
    if (t->ndim < 1 || t->ndim > MLART_MAX_DIMS)
        return mlart_set_error(MLART_EINVAL, "mlart_tensor_self_overlap: ndim %d (want 1..%d)",
                               t->ndim, MLART_MAX_DIMS);
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] > 1)
            order[n++] = d;
    for (int i = 1; i < n; i++) /* insertion sort by stride */
        for (int j = i; j > 0 && t->stride[order[j]] < t->stride[order[j - 1]]; j--) {
            int x = order[j];
            order[j] = order[j - 1];
            order[j - 1] = x;
        }
    for (int i = 0; i < n; i++) {
        const int d = order[i];
        int64_t term;
        if (t->stride[d] < cov) {
            d_out = d, cov_out = cov;
            goto overlap;
        }
        if (i == n - 1)
            break; /* no larger dim needs the cover */
        if (__builtin_mul_overflow(t->stride[d], t->shape[d] - 1, &term) ||
            __builtin_add_overflow(term, cov, &cov)) {
            /* a stride near 2^63 within a claimed extent: nothing steps past */
            d_out = order[i + 1], cov_out = -1;
            goto overlap;
        }
    }
    return 0;
overlap:
    if (dim)
        *dim = d_out;
    if (covered)
        *covered = cov_out;
    return 1;
}

int mlart_tensor_check(const mlart_tensor *t, const char *name)
{
    size_t lo, hi;
    int rc;
    if (!name)
        name = "tensor";
    if (!t)
        return mlart_set_error(MLART_EINVAL, "%s: NULL tensor", name);
    rc = mlart_tensor_span(t, &lo, &hi);
    if (rc < 0)
        return mlart_set_error(rc, "%s: %s", name, mlart_last_error());
    if (hi > t->extent)
        return mlart_set_error(MLART_ELAYOUT,
                               "%s: span [%zu, %zu) bytes from its base exceeds its extent of "
                               "%zu bytes (by %zu bytes)",
                               name, lo, hi, t->extent, hi - t->extent);
    return 0;
}

int mlart_tensor_is_dense(const mlart_tensor *t)
{
    int64_t want = 1;
    if (!t || t->ndim < 1 || t->ndim > MLART_MAX_DIMS)
        return 0;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] < 0)
            return 0;
        if (t->shape[i] > 1 && t->stride[i] != want)
            return 0; /* a size-1 dim's stride addresses nothing */
        if (t->shape[i] > 1 && want > INT64_MAX / t->shape[i])
            return 0; /* more elements than int64_t counts: no storage holds it */
        want *= t->shape[i];
    }
    return 1;
}

/* ---- geometry ---------------------------------------------------------- */

const char *mlart_kv_format_name(mlart_kv_format f)
{
    switch (f) {
    case MLART_KV_BF16:
        return "bf16";
    case MLART_KV_FP8_DS_MLA:
        return "fp8_ds_mla";
    }
    return "invalid";
}

int mlart_kv_format_parse(const char *s, mlart_kv_format *out)
{
    if (!out)
        return mlart_set_error(MLART_EINVAL, "mlart_kv_format_parse: NULL out");
    if (s && !strcmp(s, "bf16")) {
        *out = MLART_KV_BF16;
        return 0;
    }
    if (s && !strcmp(s, "fp8_ds_mla")) {
        *out = MLART_KV_FP8_DS_MLA;
        return 0;
    }
    return mlart_set_error(MLART_EINVAL, "unknown kv format '%s' (want bf16 or fp8_ds_mla)",
                           s ? s : "(null)");
}

int mlart_geometry_check(const mlart_geometry *g)
{
    if (!g)
        return mlart_set_error(MLART_EINVAL, "geometry: NULL");
#define POSITIVE_(field, what)                                                              \
    if (g->field <= 0)                                                                      \
        return mlart_set_error(MLART_EINVAL, "geometry: %s (%s) is %d, must be > 0", #field, \
                               what, (int)g->field);
    POSITIVE_(heads, "heads on this rank")
    POSITIVE_(qk_nope, "P")
    POSITIVE_(rope, "R")
    POSITIVE_(kv_lora, "L")
    POSITIVE_(v_head, "V")
    POSITIVE_(topk, "index slots per token")
    POSITIVE_(page_size, "tokens per block")
#undef POSITIVE_
    if (g->kv_format != MLART_KV_BF16 && g->kv_format != MLART_KV_FP8_DS_MLA)
        return mlart_set_error(MLART_EINVAL, "geometry: kv_format %d is not a known format",
                               (int)g->kv_format);
    if (g->kv_format == MLART_KV_FP8_DS_MLA && g->kv_lora % 128)
        return mlart_set_error(MLART_EINVAL,
                               "geometry: fp8_ds_mla needs kv_lora (L) to be a multiple of 128 "
                               "(one scale per 128-value tile); L is %d",
                               (int)g->kv_lora);
    if (!isfinite(g->softmax_scale) || !(g->softmax_scale > 0.0f))
        return mlart_set_error(MLART_EINVAL, "geometry: softmax_scale %g must be finite and > 0",
                               (double)g->softmax_scale);
    return 0;
}

size_t mlart_kv_bytes_per_token(const mlart_geometry *g)
{
    if (!g || g->kv_lora <= 0 || g->rope <= 0)
        return 0;
    switch (g->kv_format) {
    case MLART_KV_BF16:
        return ((size_t)g->kv_lora + (size_t)g->rope) * 2;
    case MLART_KV_FP8_DS_MLA:
        if (g->kv_lora % 128)
            return 0;
        return (size_t)g->kv_lora + (size_t)(g->kv_lora / 128) * 4 + (size_t)g->rope * 2;
    }
    return 0;
}

int mlart_weights_from_kv_b_proj(const mlart_geometry *g, const mlart_tensor *kv_b_proj,
                                 mlart_tensor *w_uk_t, mlart_tensor *w_uv)
{
    mlart_tensor uk, uv;
    int64_t H, P, V, L, rs, cs;
    if (!g || !kv_b_proj || !w_uk_t || !w_uv)
        return mlart_set_error(MLART_EINVAL, "mlart_weights_from_kv_b_proj: NULL argument");
    MLART_CHECK(mlart_geometry_check(g));
    H = g->heads, P = g->qk_nope, V = g->v_head, L = g->kv_lora;
    if (kv_b_proj->dtype != MLART_DTYPE_BF16)
        return mlart_set_error(MLART_EDTYPE, "kv_b_proj: dtype %s, want bf16",
                               mlart_dtype_name(kv_b_proj->dtype));
    MLART_CHECK(mlart_tensor_check(kv_b_proj, "kv_b_proj"));
    if (kv_b_proj->ndim != 2)
        return mlart_set_error(MLART_ESHAPE, "kv_b_proj: %d dims, want 2: [H*(P+V), L] = "
                               "[%lld, %lld]", kv_b_proj->ndim, (long long)(H * (P + V)),
                               (long long)L);
    if (kv_b_proj->shape[0] != H * (P + V) || kv_b_proj->shape[1] != L)
        return mlart_set_error(MLART_ESHAPE,
                               "kv_b_proj: shape [%lld, %lld], want [H*(P+V), L] = [%lld, %lld]",
                               (long long)kv_b_proj->shape[0], (long long)kv_b_proj->shape[1],
                               (long long)(H * (P + V)), (long long)L);
    rs = kv_b_proj->stride[0];
    cs = kv_b_proj->stride[1];
    {
        /* the head stride (P+V) rows and W_UV's offset of P rows, in int64
         * elements and in bytes: a row stride past that is no real view */
        int64_t t;
        if (__builtin_mul_overflow(P + V, rs, &t) || __builtin_mul_overflow(P * 2, rs, &t))
            return mlart_set_error(MLART_ELAYOUT, "kv_b_proj: row stride %lld elements: (P+V) "
                                   "rows of it pass 2^63", (long long)rs);
    }
    /* per head h: rows h*(P+V) .. +P are W_UK [P,L]; the next V rows are W_UV^T [V,L] */
    uk = *kv_b_proj;
    uk.ndim = 3;
    uk.shape[0] = H, uk.shape[1] = P, uk.shape[2] = L;
    uk.stride[0] = (P + V) * rs, uk.stride[1] = rs, uk.stride[2] = cs;
    uv = *kv_b_proj;
    uv.ndim = 3;
    uv.data = (char *)kv_b_proj->data + (size_t)(P * rs) * 2;
    uv.shape[0] = H, uv.shape[1] = L, uv.shape[2] = V;
    uv.stride[0] = (P + V) * rs, uv.stride[1] = cs, uv.stride[2] = rs;
    uv.shape[3] = uk.shape[3] = 0;
    uv.stride[3] = uk.stride[3] = 0;
    *w_uk_t = uk;
    *w_uv = uv;
    return 0;
}
