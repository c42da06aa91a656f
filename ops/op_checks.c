/* Plan-time checks of the ops' operands (ops/ops.h): ndim, dtype, shapes
 * that agree, inner stride 1 where the kernels need it, spans inside their
 * storage, one device, outputs that neither alias themselves, nor overlap
 * an input, nor share an element with each other.  Shared by the CPU twins
 * and the CUDA entry points, so both refuse exactly the same views. */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>

#include "ops/ops.h"
#include "runtime/status.h"

/* One operand: present, rank, dtype, span in its extent, inner stride 1. */
static int check_operand(const char *op, const char *name, const mlart_tensor *t, int ndim,
                         mlart_dtype dtype, int inner_unit)
{
    char what[96];
    if (!t)
        return mlart_set_error(MLART_EINVAL, "%s: operand %s is NULL", op, name);
    if (t->ndim != ndim)
        return mlart_set_error(MLART_ESHAPE, "%s: %s must have %d dims, has %d", op, name, ndim,
                               t->ndim);
    if (t->dtype != dtype)
        return mlart_set_error(MLART_EDTYPE, "%s: %s must be %s, is %s", op, name,
                               mlart_dtype_name(dtype), mlart_dtype_name(t->dtype));
    snprintf(what, sizeof what, "%s: %s", op, name);
    MLART_CHECK(mlart_tensor_check(t, what));
    if (inner_unit && t->stride[ndim - 1] != 1)
        return mlart_set_error(MLART_ELAYOUT,
                               "%s: %s must have inner stride 1 (contiguous last dim), has %" PRId64,
                               op, name, t->stride[ndim - 1]);
    return 0;
}

static void shape_str(const mlart_tensor *t, char *buf, size_t n)
{
    size_t k = 0;
    k += (size_t)snprintf(buf + k, n - k, "[");
    for (int d = 0; d < t->ndim && k < n; d++)
        k += (size_t)snprintf(buf + k, n - k, d ? ",%" PRId64 : "%" PRId64, t->shape[d]);
    if (k < n)
        snprintf(buf + k, n - k, "]");
}

/* Absolute byte range [lo, hi) of a checked view. */
static void abs_span(const mlart_tensor *t, uintptr_t *lo, uintptr_t *hi)
{
    size_t l = 0, h = 0;
    (void)mlart_tensor_span(t, &l, &h); /* already validated by check_operand */
    *lo = (uintptr_t)t->base + l;
    *hi = (uintptr_t)t->base + h;
}

/* An output must not overlap an input's bytes: the ops read inputs while
 * writing outputs. */
static int check_no_overlap(const char *op, const char *oname, const mlart_tensor *o,
                            const char *iname, const mlart_tensor *in)
{
    uintptr_t olo, ohi, ilo, ihi;
    int rc = mlart_tensor_overlap(o, in);
    if (rc <= 0)
        return rc;
    abs_span(o, &olo, &ohi);
    abs_span(in, &ilo, &ihi);
    return mlart_set_error(MLART_ELAYOUT,
                           "%s: output %s (bytes %#" PRIxPTR "..%#" PRIxPTR
                           ") overlaps input %s (bytes %#" PRIxPTR "..%#" PRIxPTR ")",
                           op, oname, olo, ohi, iname, ilo, ihi);
}

static int check_no_self_alias(const char *op, const char *name, const mlart_tensor *t)
{
    int d;
    int64_t covered;
    const int rc = mlart_tensor_self_overlap(t, &d, &covered);
    if (rc <= 0)
        return rc;
    if (covered < 0)
        return mlart_set_error(MLART_ELAYOUT,
                               "%s: output %s has overlapping elements (dim %d: the smaller dims "
                               "cover more than %" PRId64 " elements)",
                               op, name, d, INT64_MAX);
    return mlart_set_error(MLART_ELAYOUT,
                           "%s: output %s has overlapping elements (dim %d: stride %" PRId64
                           " < %" PRId64 " elements covered by the smaller dims)",
                           op, name, d, t->stride[d], covered);
}

/* The dims of size > 1 but the last, as (stride, shape) pairs sorted. */
static int outer_dims(const mlart_tensor *t, int64_t out[][2])
{
    int n = 0;
    for (int d = 0; d < t->ndim - 1; d++)
        if (t->shape[d] > 1) {
            int j = n++;
            for (; j > 0 && (out[j - 1][0] > t->stride[d] ||
                             (out[j - 1][0] == t->stride[d] && out[j - 1][1] > t->shape[d]));
                 j--) {
                out[j][0] = out[j - 1][0];
                out[j][1] = out[j - 1][1];
            }
            out[j][0] = t->stride[d], out[j][1] = t->shape[d];
        }
    return n;
}

/* Sufficient test that two checked views share no element: their spans
 * are apart, or they are two column ranges of one view that does not alias
 * itself.  The second: the same dtype, inner stride 1, the same outer dims
 * (size and stride, in any order), b's first element k elements from a's
 * with columns [0, la) and [k, k + lb) apart, and the view of those outer
 * dims over columns min(0, k)..max(la, k + lb) passing mlart_tensor_self_overlap.  So
 * out = q_mqa[.., 0:L) as [H,T,L] and pe_out = q_mqa[.., L:L+R) as
 * [T,H,R], whose spans interleave, are apart for any q_mqa [T,H,L+R] whose
 * elements are. */
static int views_disjoint(const mlart_tensor *a, const mlart_tensor *b)
{
    uintptr_t alo, ahi, blo, bhi;
    int64_t oa[MLART_MAX_DIMS][2], ob[MLART_MAX_DIMS][2], la, lb, k, c0, c1, covered;
    intptr_t diff;
    int n, in = a->ndim - 1, d;
    size_t es = mlart_dtype_size(a->dtype);
    mlart_tensor parent;
    abs_span(a, &alo, &ahi);
    abs_span(b, &blo, &bhi);
    if (alo == ahi || blo == bhi || ahi <= blo || bhi <= alo)
        return 1;
    if (a->dtype != b->dtype || a->ndim != b->ndim || a->stride[in] != 1 || b->stride[in] != 1)
        return 0;
    n = outer_dims(a, oa);
    if (outer_dims(b, ob) != n)
        return 0;
    for (int i = 0; i < n; i++)
        if (oa[i][0] != ob[i][0] || oa[i][1] != ob[i][1])
            return 0;
    diff = (intptr_t)((uintptr_t)b->data - (uintptr_t)a->data); /* signed distance */
    if (diff % (intptr_t)es)
        return 0;
    k = (int64_t)(diff / (intptr_t)es);
    la = a->shape[in], lb = b->shape[in];
    if (__builtin_add_overflow(k, lb, &c1) || (k < la && c1 > 0))
        return 0;
    c0 = k < 0 ? k : 0;
    if (c1 < la)
        c1 = la;
    parent = *a;
    if (__builtin_sub_overflow(c1, c0, &parent.shape[in]))
        return 0;
    return mlart_tensor_self_overlap(&parent, &d, &covered) == 0;
}

/* Two outputs of one op must not share an element: the CUDA kernels write
 * them from different threads. */
static int check_outputs_apart(const char *op, const char *aname, const mlart_tensor *a,
                               const char *bname, const mlart_tensor *b)
{
    uintptr_t alo, ahi, blo, bhi;
    if (views_disjoint(a, b))
        return 0;
    abs_span(a, &alo, &ahi);
    abs_span(b, &blo, &bhi);
    return mlart_set_error(MLART_ELAYOUT,
                           "%s: outputs %s (bytes %#" PRIxPTR "..%#" PRIxPTR ") and %s (bytes %#" PRIxPTR
                           "..%#" PRIxPTR ") may share elements (spans meet, and they are not "
                           "separate columns of one view)",
                           op, aname, alo, ahi, bname, blo, bhi);
}

static int check_same_device(const char *op, const mlart_tensor *const *ts, const char *const *names,
                             int n)
{
    for (int i = 1; i < n; i++)
        if (ts[i]->device != ts[0]->device)
            return mlart_set_error(MLART_EINVAL, "%s: operands on different devices (%s on %d, %s on %d)",
                                   op, names[0], ts[0]->device, names[i], ts[i]->device);
    return 0;
}

/* A batched product x [H,T,K] . w [H,K,N] -> out [H,T,N] (the names and
 * dims as the op's messages call them): operands, shapes that agree, one
 * device, an output that neither aliases itself nor overlaps an input. */
static int check_bmm(const char *op, const char *const name[3], const char *const dims[3],
                     const mlart_tensor *x, const mlart_tensor *w, const mlart_tensor *out)
{
    const mlart_tensor *ts[3] = {x, w, out};
    char label[3][32], shp[3][64];
    for (int i = 0; i < 3; i++) {
        snprintf(label[i], sizeof label[i], "%s %s", name[i], dims[i]);
        MLART_CHECK(check_operand(op, label[i], ts[i], 3, MLART_DTYPE_BF16, 1));
    }
    if (x->shape[0] != w->shape[0] || x->shape[0] != out->shape[0] || x->shape[1] != out->shape[1] ||
        x->shape[2] != w->shape[1] || w->shape[2] != out->shape[2]) {
        for (int i = 0; i < 3; i++)
            shape_str(ts[i], shp[i], sizeof shp[i]);
        return mlart_set_error(MLART_ESHAPE, "%s: shapes disagree: %s %s, %s %s, %s %s (want %s, %s, %s)",
                               op, name[0], shp[0], name[1], shp[1], name[2], shp[2], label[0], label[1],
                               label[2]);
    }
    MLART_CHECK(check_same_device(op, ts, name, 3));
    MLART_CHECK(check_no_self_alias(op, name[2], out));
    MLART_CHECK(check_no_overlap(op, name[2], out, name[0], x));
    MLART_CHECK(check_no_overlap(op, name[2], out, name[1], w));
    return 0;
}

int mlart_query_bmm_check(const mlart_tensor *a, const mlart_tensor *w, const mlart_tensor *out,
                          const mlart_tensor *pe_in, const mlart_tensor *pe_out)
{
    static const char op[] = "query_bmm";
    static const char *const name[3] = {"a", "w", "out"}, *const dims[3] = {"[H,T,P]", "[H,P,L]", "[H,T,L]"};
    char sa[64], sw[64], so[64];
    MLART_CHECK(check_bmm(op, name, dims, a, w, out));
    if ((pe_in == NULL) != (pe_out == NULL))
        return mlart_set_error(MLART_EINVAL, "%s: pe_in and pe_out must both be given or both be NULL",
                               op);
    if (pe_in) {
        MLART_CHECK(check_operand(op, "pe_in [T,H,R]", pe_in, 3, MLART_DTYPE_BF16, 1));
        MLART_CHECK(check_operand(op, "pe_out [T,H,R]", pe_out, 3, MLART_DTYPE_BF16, 1));
        if (pe_in->shape[0] != a->shape[1] || pe_in->shape[1] != a->shape[0] ||
            pe_out->shape[0] != pe_in->shape[0] || pe_out->shape[1] != pe_in->shape[1] ||
            pe_out->shape[2] != pe_in->shape[2]) {
            shape_str(pe_in, sa, sizeof sa);
            shape_str(pe_out, sw, sizeof sw);
            shape_str(a, so, sizeof so);
            return mlart_set_error(MLART_ESHAPE,
                                   "%s: shapes disagree: pe_in %s, pe_out %s, a %s (want pe_in = "
                                   "pe_out = [T,H,R] with a [H,T,P])",
                                   op, sa, sw, so);
        }
        {
            const mlart_tensor *ts[3] = {a, pe_in, pe_out};
            const char *names[3] = {"a", "pe_in", "pe_out"};
            MLART_CHECK(check_same_device(op, ts, names, 3));
        }
        MLART_CHECK(check_no_self_alias(op, "pe_out", pe_out));
        MLART_CHECK(check_no_overlap(op, "pe_out", pe_out, "pe_in", pe_in));
        MLART_CHECK(check_no_overlap(op, "pe_out", pe_out, "a", a));
        MLART_CHECK(check_no_overlap(op, "pe_out", pe_out, "w", w));
        MLART_CHECK(check_no_overlap(op, "out", out, "pe_in", pe_in));
        MLART_CHECK(check_outputs_apart(op, "out", out, "pe_out", pe_out));
    }
    return 0;
}

int mlart_v_up_bmm_check(const mlart_tensor *x, const mlart_tensor *w, const mlart_tensor *o)
{
    static const char *const name[3] = {"x", "w", "o"}, *const dims[3] = {"[H,T,L]", "[H,L,V]", "[H,T,V]"};
    return check_bmm("v_up_bmm", name, dims, x, w, o);
}

int mlart_kv_write_check(const mlart_geometry *g, const mlart_tensor *cache,
                         const mlart_tensor *latent, const mlart_tensor *slots)
{
    static const char op[] = "kv_write";
    size_t bpt;
    char sc[64], sl[64], ss[64];
    if (!g)
        return mlart_set_error(MLART_EINVAL, "%s: geometry is NULL", op);
    MLART_CHECK(mlart_geometry_check(g));
    bpt = mlart_kv_bytes_per_token(g);
    MLART_CHECK(check_operand(op, "cache [num_slots,bytes_per_token]", cache, 2, MLART_DTYPE_U8, 1));
    MLART_CHECK(check_operand(op, "latent [N,L+R]", latent, 2, MLART_DTYPE_BF16, 1));
    MLART_CHECK(check_operand(op, "slots [N]", slots, 1, MLART_DTYPE_I32, 0));
    if (cache->shape[1] != (int64_t)bpt) {
        shape_str(cache, sc, sizeof sc);
        return mlart_set_error(MLART_ESHAPE,
                               "%s: cache %s rows must be %zu bytes (%s, L=%d, R=%d), are %" PRId64,
                               op, sc, bpt, mlart_kv_format_name(g->kv_format), (int)g->kv_lora,
                               (int)g->rope, cache->shape[1]);
    }
    if (latent->shape[1] != (int64_t)g->kv_lora + g->rope || slots->shape[0] != latent->shape[0]) {
        shape_str(latent, sl, sizeof sl);
        shape_str(slots, ss, sizeof ss);
        return mlart_set_error(MLART_ESHAPE,
                               "%s: shapes disagree: latent %s, slots %s (want latent [N,%" PRId64
                               "], slots [N])",
                               op, sl, ss, (int64_t)g->kv_lora + g->rope);
    }
    {
        const mlart_tensor *ts[3] = {cache, latent, slots};
        const char *names[3] = {"cache", "latent", "slots"};
        MLART_CHECK(check_same_device(op, ts, names, 3));
    }
    MLART_CHECK(check_no_self_alias(op, "cache", cache));
    MLART_CHECK(check_no_overlap(op, "cache", cache, "latent", latent));
    MLART_CHECK(check_no_overlap(op, "cache", cache, "slots", slots));
    return 0;
}
