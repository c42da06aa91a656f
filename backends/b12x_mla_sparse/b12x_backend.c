/* The b12x_mla_sparse backend table: the sm_90 sparse MLA decode kernels
 * (b12x_attend.cu) behind the backend ABI.  Query absorption and V
 * up-projection are the runtime's safe ops (absorb_query = v_up = NULL). */
#include "backends/b12x_mla_sparse/b12x.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "backends/b12x_mla_sparse/b12x_attend.h"

typedef struct b12x_state {
    mlart_backend_init init;
    b12x_dev dev;
} b12x_state;

static int b12x_create(const mlart_backend_init *init, void **state)
{
    const mlart_geometry *g;
    b12x_state *st;
    b12x_dev dev;
    int rc;
    if (!init)
        return MLART_EINVAL;
    /* an older, shorter struct may end before its error field: nothing to
     * report through then */
    if (init->struct_size < sizeof *init)
        return init->struct_size >= offsetof(mlart_backend_init, error) + sizeof init->error &&
                       init->error
                   ? init->error(MLART_EABI,
                                 "b12x_mla_sparse: mlart_backend_init is %u bytes, need %zu",
                                 (unsigned)init->struct_size, sizeof *init)
                   : MLART_EABI;
    if (!init->error) /* nothing to report through */
        return MLART_EINVAL;
    if (!state)
        return init->error(MLART_EINVAL, "b12x_mla_sparse: create needs a state pointer");
    g = &init->geom;
    if (init->device < 0)
        return init->error(MLART_ENOTSUP, "b12x_mla_sparse: runs on CUDA devices only (device %d)",
                           init->device);
    if (g->kv_lora != B12X_KV_LORA || g->rope != B12X_ROPE)
        return init->error(MLART_ENOTSUP,
                           "b12x_mla_sparse: kernels are built for kv_lora %d and rope %d, the "
                           "geometry has %d and %d; use backend = reference",
                           B12X_KV_LORA, B12X_ROPE, (int)g->kv_lora, (int)g->rope);
    if (g->heads < 1 || g->heads > B12X_MAX_HEADS)
        return init->error(MLART_ENOTSUP, "b12x_mla_sparse: serves 1..%d heads per rank, got %d",
                           B12X_MAX_HEADS, (int)g->heads);
    if (g->topk < 1 || g->topk > B12X_MAX_TOPK)
        return init->error(MLART_ENOTSUP, "b12x_mla_sparse: serves topk 1..%d, got %d",
                           B12X_MAX_TOPK, (int)g->topk);
    if (g->page_size < 1)
        return init->error(MLART_EINVAL, "b12x_mla_sparse: page_size %d", (int)g->page_size);
    if (g->kv_format != MLART_KV_BF16 && g->kv_format != MLART_KV_FP8_DS_MLA)
        return init->error(MLART_ENOTSUP, "b12x_mla_sparse: kv_format %d is neither bf16 nor "
                           "fp8_ds_mla", (int)g->kv_format);
    rc = b12x_attend_setup(&dev, init->error);
    if (rc < 0)
        return rc;
    st = calloc(1, sizeof *st);
    if (!st) {
        b12x_attend_teardown(&dev);
        return init->error(MLART_ENOMEM, "b12x_mla_sparse: out of host memory");
    }
    st->init = *init;
    st->dev = dev;
    st->dev.log = init->log; /* each launch's kernels at MLART_LOG=debug */
    *state = st;
    return 0;
}

static void b12x_destroy(void *state)
{
    b12x_state *st = state;
    if (st)
        b12x_attend_teardown(&st->dev);
    free(st);
}

/* The kernel choices this backend was created with still hold (b12x_modes). */
static int modes_hold(const b12x_state *st, const char *call)
{
    b12x_modes now;
    b12x_modes_now(&now);
    if (memcmp(&now, &st->dev.modes, sizeof now))
        return st->init.error(MLART_EINVAL,
                              "b12x_mla_sparse %s: a later create read other MLART_B12X_* kernel "
                              "choices (WGMMA %d, SWG %d, RC %d, HALF %d; this backend's: %d, %d, "
                              "%d, %d); they are process-wide: set them once, before the first create",
                              call, now.wgmma, now.swg, now.rc, now.half, st->dev.modes.wgmma,
                              st->dev.modes.swg, st->dev.modes.rc, st->dev.modes.half);
    return 0;
}

static int b12x_plan(void *state, const mlart_plan *plan, size_t *workspace_bytes)
{
    b12x_state *st = state;
    size_t most = 0;
    if (!st)
        return MLART_EINVAL;
    if (!plan || !workspace_bytes)
        return st->init.error(MLART_EINVAL, "b12x_mla_sparse plan: NULL argument");
    if (plan->struct_size < sizeof *plan)
        return st->init.error(MLART_EABI, "b12x_mla_sparse plan: mlart_plan is %u bytes, need %zu",
                              (unsigned)plan->struct_size, sizeof *plan);
    /* the workspace is sized for this geometry; steps are checked against
     * create's (b12x_attend), so the two must agree */
    if (plan->device != st->init.device || !mlart_geometry_same(&plan->geom, &st->init.geom))
        return st->init.error(MLART_EINVAL,
                              "b12x_mla_sparse plan: device or geometry differs from create");
    if (plan->max_tokens < 0)
        return st->init.error(MLART_EINVAL, "b12x_mla_sparse: max_tokens %d", (int)plan->max_tokens);
    if (modes_hold(st, "plan"))
        return MLART_EINVAL;
    /* The split depends on T, so size for the largest need over every T a
     * step may have, not just for max_tokens. */
    for (int64_t T = 1; T <= plan->max_tokens; T++) {
        size_t b = b12x_attend_workspace((int)T, plan->geom.heads, plan->geom.topk,
                                         plan->geom.kv_format == MLART_KV_FP8_DS_MLA, st->dev.num_sms);
        if (b > most)
            most = b;
    }
    *workspace_bytes = most;
    return 0;
}

static int b12x_attend(void *state, const mlart_step *s, void *stream)
{
    b12x_state *st = state;
    if (!st)
        return MLART_EINVAL;
    if (!s)
        return st->init.error(MLART_EINVAL, "b12x_mla_sparse: step is NULL");
    if (s->struct_size < sizeof *s)
        return st->init.error(MLART_EABI, "b12x_mla_sparse: mlart_step is %u bytes, need %zu",
                              (unsigned)s->struct_size, sizeof *s);
    /* the workspace and the launch rules were planned for create's
     * geometry on create's device */
    if (s->device != st->init.device || !mlart_geometry_same(&s->geom, &st->init.geom))
        return st->init.error(MLART_EINVAL,
                              "b12x_mla_sparse: step on device %d with %d heads, top-k %d, "
                              "kv_format %d; created for device %d with %d heads, top-k %d, "
                              "kv_format %d (or another geometry field differs)",
                              s->device, (int)s->geom.heads, (int)s->geom.topk,
                              (int)s->geom.kv_format, st->init.device, (int)st->init.geom.heads,
                              (int)st->init.geom.topk, (int)st->init.geom.kv_format);
    if (s->T < 0)
        return st->init.error(MLART_EINVAL, "b12x_mla_sparse: step of %d tokens", (int)s->T);
    if (modes_hold(st, "attend"))
        return MLART_EINVAL;
    return b12x_attend_launch(s, &st->dev, stream, st->init.error);
}

static const mlart_backend_vtable b12x_vtable = {
    .abi_version = MLART_BACKEND_ABI_VERSION,
    .struct_size = sizeof(mlart_backend_vtable),
    .name = "b12x_mla_sparse",
    .contract =
        {
            .query_bmm = MLART_QBMM_SAFE_OP,
            .weights = MLART_W_DENSE,
            .output = MLART_OUT_HEAD_MAJOR,
            .kv_formats = MLART_KV_FORMAT_BIT(MLART_KV_BF16) |
                          MLART_KV_FORMAT_BIT(MLART_KV_FP8_DS_MLA),
            .max_heads = B12X_MAX_HEADS,
            .head_multiple = 1,
            .max_topk = B12X_MAX_TOPK,
            .tail_pad = 0,
            .graph_safe = 1,
            .devices = MLART_DEV_CUDA,
        },
    .create = b12x_create,
    .destroy = b12x_destroy,
    .plan = b12x_plan,
    .absorb_query = NULL,
    .attend = b12x_attend,
    .v_up = NULL,
};

const mlart_backend_vtable *mlart_backend_b12x_mla_sparse_vtable(void)
{
    return &b12x_vtable;
}
