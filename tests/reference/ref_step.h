/* One decode-step problem for the reference tests: poisoned host buffers,
 * the mlart_step the backend sees, the oracle's view of the same inputs, and
 * a run of the reference backend straight through its vtable. */
#ifndef MLART_TESTS_REF_STEP_H
#define MLART_TESTS_REF_STEP_H

#include "backends/reference/oracle.h"
#include "backends/reference/reference.h"
#include "runtime/status.h"
#include "tests/reference/ref_util.h"

typedef struct ref_problem {
    mlart_geometry g;
    int32_t T, B, max_blocks;
    int64_t num_slots;
    int64_t q_mqa_pad, o_pad; /* extra elements per token row of q_mqa and o */
    ref_buf q, wk, wv, cache, idx, req, lens, bt;
    ref_buf q_mqa, attn, lse, o;
} ref_problem;

static inline void ref_problem_alloc(ref_problem *p)
{
    const mlart_geometry *g = &p->g;
    int64_t H = g->heads, P = g->qk_nope, R = g->rope, L = g->kv_lora, V = g->v_head;
    int64_t T = p->T;
    p->q = ref_buf_new((size_t)(T * H * (P + R)) * 2);
    p->wk = ref_buf_new((size_t)(H * P * L) * 2);
    p->wv = ref_buf_new((size_t)(H * L * V) * 2);
    p->cache = ref_buf_new((size_t)p->num_slots * mlart_kv_bytes_per_token(g));
    p->idx = ref_buf_new((size_t)(T * g->topk) * 4);
    p->req = ref_buf_new((size_t)T * 4);
    p->lens = ref_buf_new((size_t)p->B * 4);
    p->bt = ref_buf_new((size_t)p->B * (size_t)p->max_blocks * 4);
    p->q_mqa = ref_buf_new((size_t)(T * (H * (L + R) + p->q_mqa_pad)) * 2);
    p->attn = ref_buf_new((size_t)(H * T * L) * 2);
    p->lse = ref_buf_new((size_t)(H * T) * 4);
    p->o = ref_buf_new((size_t)(T * (H * V + p->o_pad)) * 2);
}

static inline void ref_problem_free(ref_problem *p)
{
    ref_buf *bs[] = {&p->q, &p->wk, &p->wv, &p->cache, &p->idx, &p->req, &p->lens,
                     &p->bt, &p->q_mqa, &p->attn, &p->lse, &p->o};
    for (size_t i = 0; i < sizeof bs / sizeof bs[0]; i++)
        ref_buf_free(bs[i]);
}

/* Poison the outputs again (before a run). */
static inline void ref_problem_poison(ref_problem *p)
{
    ref_buf *bs[] = {&p->q_mqa, &p->attn, &p->lse, &p->o};
    for (size_t i = 0; i < 4; i++)
        memset(bs[i]->alloc, REF_POISON, bs[i]->bytes + 2 * bs[i]->guard);
}

static inline mlart_tensor ref_problem_cache_view(const ref_problem *p)
{
    int64_t bpt = (int64_t)mlart_kv_bytes_per_token(&p->g);
    int64_t sh[2] = {p->num_slots, bpt}, st[2] = {bpt, 1};
    return ref_view(&p->cache, MLART_DTYPE_U8, 0, 2, sh, st);
}

static inline mlart_tensor ref_problem_o_view(const ref_problem *p)
{
    int64_t HV = (int64_t)p->g.heads * p->g.v_head;
    int64_t sh[2] = {p->T, HV}, st[2] = {HV + p->o_pad, 1};
    return ref_view(&p->o, MLART_DTYPE_BF16, 0, 2, sh, st);
}

static inline mlart_tensor ref_problem_lse_view(const ref_problem *p)
{
    int64_t sh[2] = {p->g.heads, p->T}, st[2] = {p->T, 1};
    return ref_view(&p->lse, MLART_DTYPE_F32, 0, 2, sh, st);
}

static inline void ref_problem_step(const ref_problem *p, mlart_step *s)
{
    const mlart_geometry *g = &p->g;
    int64_t H = g->heads, P = g->qk_nope, R = g->rope, L = g->kv_lora, V = g->v_head, T = p->T;
    int64_t sh[3], st[3];
    memset(s, 0, sizeof *s);
    s->struct_size = sizeof *s;
    s->geom = *g;
    s->device = -1;
    s->T = p->T;
    s->B = p->B;
    /* q_nope and q_pe: the strided views of q[T,H,P+R] */
    sh[0] = H, sh[1] = T, sh[2] = P, st[0] = P + R, st[1] = H * (P + R), st[2] = 1;
    s->q_nope = ref_view(&p->q, MLART_DTYPE_BF16, 0, 3, sh, st);
    sh[0] = T, sh[1] = H, sh[2] = R, st[0] = H * (P + R), st[1] = P + R, st[2] = 1;
    s->q_pe = ref_view(&p->q, MLART_DTYPE_BF16, P, 3, sh, st);
    sh[0] = H, sh[1] = P, sh[2] = L, st[0] = P * L, st[1] = L, st[2] = 1;
    s->w_uk_t = ref_view(&p->wk, MLART_DTYPE_BF16, 0, 3, sh, st);
    sh[0] = H, sh[1] = L, sh[2] = V, st[0] = L * V, st[1] = V, st[2] = 1;
    s->w_uv = ref_view(&p->wv, MLART_DTYPE_BF16, 0, 3, sh, st);
    sh[0] = T, sh[1] = H, sh[2] = L + R, st[0] = H * (L + R) + p->q_mqa_pad, st[1] = L + R, st[2] = 1;
    s->q_mqa = ref_view(&p->q_mqa, MLART_DTYPE_BF16, 0, 3, sh, st);
    s->kv_cache = ref_problem_cache_view(p);
    sh[0] = T, sh[1] = g->topk, st[0] = g->topk, st[1] = 1;
    s->idx = ref_view(&p->idx, MLART_DTYPE_I32, 0, 2, sh, st);
    sh[0] = T, st[0] = 1;
    s->req_of_token = ref_view(&p->req, MLART_DTYPE_I32, 0, 1, sh, st);
    sh[0] = p->B;
    s->seq_lens = ref_view(&p->lens, MLART_DTYPE_I32, 0, 1, sh, st);
    sh[0] = p->B, sh[1] = p->max_blocks, st[0] = p->max_blocks, st[1] = 1;
    s->block_table = ref_view(&p->bt, MLART_DTYPE_I32, 0, 2, sh, st);
    sh[0] = H, sh[1] = T, sh[2] = L, st[0] = T * L, st[1] = L, st[2] = 1;
    s->attn_out = ref_view(&p->attn, MLART_DTYPE_BF16, 0, 3, sh, st);
    s->lse = ref_problem_lse_view(p);
    s->o = ref_problem_o_view(p);
}

static inline void ref_problem_oracle(const ref_problem *p, mlart_oracle_problem *op)
{
    mlart_step s;
    int64_t sh[3] = {p->T, p->g.heads, (int64_t)p->g.qk_nope + p->g.rope};
    int64_t st[3] = {(int64_t)p->g.heads * (p->g.qk_nope + p->g.rope), p->g.qk_nope + p->g.rope, 1};
    ref_problem_step(p, &s);
    memset(op, 0, sizeof *op);
    op->geom = p->g;
    op->T = p->T;
    op->B = p->B;
    op->q = ref_view(&p->q, MLART_DTYPE_BF16, 0, 3, sh, st);
    op->w_uk_t = s.w_uk_t;
    op->w_uv = s.w_uv;
    op->kv_cache = s.kv_cache;
    op->idx = s.idx;
    op->req_of_token = s.req_of_token;
    op->seq_lens = s.seq_lens;
    op->block_table = s.block_table;
}

/* Create, plan, absorb, attend, v_up through the vtable, as the runtime
 * would, with a workspace of exactly the planned size. */
static inline int ref_run_reference(const ref_problem *p, mlart_step *s)
{
    const mlart_backend_vtable *vt = mlart_backend_reference_vtable();
    mlart_backend_init init;
    mlart_plan plan;
    void *state = NULL, *ws = NULL;
    size_t ws_bytes = 0;
    int rc;
    memset(&init, 0, sizeof init);
    init.struct_size = sizeof init;
    init.device = -1;
    init.geom = p->g;
    init.error = mlart_set_error;
    init.log = mlart_log;
    memset(&plan, 0, sizeof plan);
    plan.struct_size = sizeof plan;
    plan.geom = p->g;
    plan.device = -1;
    plan.max_tokens = p->T;
    plan.max_requests = p->B;
    plan.max_blocks_per_req = p->max_blocks;
    plan.num_slots = p->num_slots;
    ref_problem_step(p, s);
    if ((rc = vt->create(&init, &state)) < 0)
        return rc;
    if ((rc = vt->plan(state, &plan, &ws_bytes)) < 0)
        goto out;
    ws = malloc(ws_bytes ? ws_bytes : 1);
    s->workspace = ws;
    s->workspace_bytes = ws_bytes;
    if ((rc = vt->absorb_query(state, s, NULL)) < 0 || (rc = vt->attend(state, s, NULL)) < 0 ||
        (rc = vt->v_up(state, s, NULL)) < 0)
        goto out;
out:
    vt->destroy(state);
    free(ws);
    s->workspace = NULL; /* later direct calls bring their own scratch */
    s->workspace_bytes = 0;
    return rc;
}

#endif
