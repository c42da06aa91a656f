/* The reference backend's table: the oracle every other backend is compared
 * with.  Host steps run the CPU twins of ops/ plus mlart_reference_attend_cpu;
 * CUDA steps run the plain kernels of reference_cuda.cu, after the same view
 * checks (which read no tensor data, so they cost nothing on the device).  It accepts any
 * geometry, both cache formats and the strided query view, and needs no
 * padding past any span. */
#include <stdlib.h>

#include "backends/reference/reference.h"
#include "ops/ops.h"
#include "runtime/status.h"

typedef struct reference_state {
    int device;
    mlart_geometry geom;
    mlart_error_fn error;
} reference_state;

static int reference_create(const mlart_backend_init *init, void **state)
{
    reference_state *st;
    mlart_error_fn err;
    if (!init || !state)
        return mlart_set_error(MLART_EINVAL, "reference: create needs init and state");
    if (init->struct_size < sizeof *init) /* its error field may lie past its end */
        return mlart_set_error(MLART_EABI, "reference: mlart_backend_init is %u bytes, need %zu",
                               (unsigned)init->struct_size, sizeof *init);
    err = init->error ? init->error : mlart_set_error;
#ifndef MLART_WITH_CUDA
    if (init->device >= 0)
        return err(MLART_ENOTSUP, "reference: built without CUDA, cannot run on device %d",
                   init->device);
#endif
    if (init->device < -1)
        return err(MLART_EINVAL, "reference: device %d is neither host (-1) nor a CUDA ordinal",
                   init->device);
    MLART_CHECK(mlart_geometry_check(&init->geom));
    st = calloc(1, sizeof *st);
    if (!st)
        return err(MLART_ENOMEM, "reference: state");
    st->device = init->device;
    st->geom = init->geom;
    st->error = err;
    *state = st;
    return 0;
}

static void reference_destroy(void *state)
{
    free(state);
}

static int check_step(const reference_state *st, const mlart_step *s, const char *stage)
{
    if (!s)
        return st->error(MLART_EINVAL, "reference %s: step is NULL", stage);
    if (s->struct_size < sizeof *s)
        return st->error(MLART_EABI, "reference %s: mlart_step is %u bytes, need %zu", stage,
                         (unsigned)s->struct_size, sizeof *s);
    if (s->device != st->device)
        return st->error(MLART_EINVAL, "reference %s: step on device %d, backend created for %d",
                         stage, s->device, st->device);
    if (!mlart_geometry_same(&s->geom, &st->geom))
        return st->error(MLART_EINVAL, "reference %s: step geometry differs from the created one",
                         stage);
    return 0;
}

static int reference_plan(void *state, const mlart_plan *plan, size_t *workspace_bytes)
{
    reference_state *st = state;
    size_t ws;
    if (!st || !plan || !workspace_bytes)
        return mlart_set_error(MLART_EINVAL, "reference plan: NULL argument");
    if (plan->struct_size < sizeof *plan)
        return st->error(MLART_EABI, "reference plan: mlart_plan is %u bytes, need %zu",
                         (unsigned)plan->struct_size, sizeof *plan);
    if (plan->device != st->device || !mlart_geometry_same(&plan->geom, &st->geom))
        return st->error(MLART_EINVAL, "reference plan: device or geometry differs from create");
    if (plan->max_tokens < 0 || plan->max_requests < 0 || plan->max_blocks_per_req < 0 ||
        plan->num_slots < 0)
        return st->error(MLART_EINVAL, "reference plan: negative size");
    /* The CUDA kernels keep their scratch on chip; the host path gathers one
     * token's rows at a time. */
    if (st->device >= 0) {
        *workspace_bytes = 0;
        return 0;
    }
    ws = mlart_reference_attend_cpu_workspace(&st->geom);
    if (!ws)
        return st->error(MLART_ERANGE,
                         "reference plan: host scratch for top-k %d rows of L+R = %lld values is "
                         "past SIZE_MAX bytes",
                         (int)st->geom.topk, (long long)st->geom.kv_lora + st->geom.rope);
    *workspace_bytes = ws;
    return 0;
}

static int reference_absorb(void *state, const mlart_step *s, void *stream)
{
    reference_state *st = state;
    const mlart_geometry *g;
    int64_t shape[3];
    mlart_tensor out, pe_out;
    if (!st)
        return mlart_set_error(MLART_EINVAL, "reference absorb: NULL state");
    MLART_CHECK(check_step(st, s, "absorb"));
    g = &s->geom;
    shape[0] = s->T, shape[1] = g->heads, shape[2] = (int64_t)g->kv_lora + g->rope;
    MLART_CHECK(mlart_reference_check_view("reference absorb", "q_mqa [T,H,L+R]", &s->q_mqa, 3,
                                           MLART_DTYPE_BF16, shape, 1));
    /* q_mqa[t,h,0:L) as [H,T,L] and q_mqa[t,h,L:L+R) as [T,H,R]: both inside
     * q_mqa's storage, so they inherit its base and extent. */
    out = s->q_mqa;
    out.shape[0] = g->heads, out.shape[1] = s->T, out.shape[2] = g->kv_lora;
    out.stride[0] = s->q_mqa.stride[1], out.stride[1] = s->q_mqa.stride[0], out.stride[2] = 1;
    pe_out = s->q_mqa;
    pe_out.data = (uint16_t *)s->q_mqa.data + g->kv_lora;
    pe_out.shape[2] = g->rope;
    MLART_CHECK(mlart_query_bmm_check(&s->q_nope, &s->w_uk_t, &out, &s->q_pe, &pe_out));
#ifdef MLART_WITH_CUDA
    if (st->device >= 0)
        return mlart_reference_absorb_cuda(s, stream);
#endif
    return mlart_query_bmm_cpu(&s->q_nope, &s->w_uk_t, &out, &s->q_pe, &pe_out);
}

static int reference_attend(void *state, const mlart_step *s, void *stream)
{
    reference_state *st = state;
    if (!st)
        return mlart_set_error(MLART_EINVAL, "reference attend: NULL state");
    MLART_CHECK(check_step(st, s, "attend"));
    MLART_CHECK(mlart_reference_attend_check(s));
#ifdef MLART_WITH_CUDA
    if (st->device >= 0)
        return mlart_reference_attend_cuda(s, stream);
#endif
    return mlart_reference_attend_cpu(s);
}

static int reference_v_up(void *state, const mlart_step *s, void *stream)
{
    reference_state *st = state;
    const mlart_geometry *g;
    int64_t shape[2];
    mlart_tensor o;
    if (!st)
        return mlart_set_error(MLART_EINVAL, "reference v_up: NULL state");
    MLART_CHECK(check_step(st, s, "v_up"));
    g = &s->geom;
    shape[0] = s->T, shape[1] = (int64_t)g->heads * g->v_head;
    MLART_CHECK(mlart_reference_check_view("reference v_up", "o [T,H*V]", &s->o, 2, MLART_DTYPE_BF16,
                                           shape, 1));
    /* o[t, h*V + v] as [H,T,V]: strides V, row stride, 1. */
    o = s->o;
    o.ndim = 3;
    o.shape[0] = g->heads, o.shape[1] = s->T, o.shape[2] = g->v_head;
    o.stride[0] = g->v_head, o.stride[1] = s->o.stride[0], o.stride[2] = 1;
    MLART_CHECK(mlart_v_up_bmm_check(&s->attn_out, &s->w_uv, &o));
#ifdef MLART_WITH_CUDA
    if (st->device >= 0)
        return mlart_reference_v_up_cuda(s, stream);
#endif
    return mlart_v_up_bmm_cpu(&s->attn_out, &s->w_uv, &o);
}

static const mlart_backend_vtable reference_vtable = {
    .abi_version = MLART_BACKEND_ABI_VERSION,
    .struct_size = sizeof(mlart_backend_vtable),
    .name = "reference",
    .contract =
        {
            .query_bmm = MLART_QBMM_SAFE_OP,
            .weights = MLART_W_DENSE,
            .output = MLART_OUT_HEAD_MAJOR,
            .kv_formats = MLART_KV_FORMAT_BIT(MLART_KV_BF16) | MLART_KV_FORMAT_BIT(MLART_KV_FP8_DS_MLA),
            .max_heads = 0,
            .head_multiple = 1,
            .max_topk = 0,
            .tail_pad = 0,
            .graph_safe = 1,
#ifdef MLART_WITH_CUDA
            .devices = MLART_DEV_HOST | MLART_DEV_CUDA,
#else
            .devices = MLART_DEV_HOST,
#endif
        },
    .create = reference_create,
    .destroy = reference_destroy,
    .plan = reference_plan,
    .absorb_query = reference_absorb,
    .attend = reference_attend,
    .v_up = reference_v_up,
};

const mlart_backend_vtable *mlart_backend_reference_vtable(void)
{
    return &reference_vtable;
}
