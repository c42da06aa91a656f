/* A small host backend built as a module in several variants (compile
 * definitions below) to exercise the loader and the contract enforcement:
 *
 *   PLUGIN_NAME      the module's name (the file is libmlart-backend-<name>.so)
 *   TABLE_NAME       the name in its table (default PLUGIN_NAME)
 *   QUERY_SAFE_OP    query contract SAFE_OP (default CONTIGUOUS)
 *   TOKEN_MAJOR      attention output [T,H,L] (default [H,T,L])
 *   MAX_HEADS, HEAD_MULTIPLE, MAX_TOPK, TAIL_PAD   contract bounds (default 0, 1, 0, 0)
 *   ABI_VERSION      abi_version to declare (default MLART_BACKEND_ABI_VERSION)
 *   STRUCT_SIZE      struct_size to declare (default sizeof the table)
 *   NO_ENTRY         export no mlart_backend_entry_v1
 *   NULL_TABLE       the entry point returns NULL
 *   NO_ATTEND        leave the required attend slot NULL
 *   UNTERMINATED_NAME  the table's name is 100 bytes of 'x' with no NUL,
 *                    right before an unreadable page
 *   LOOKUP_IN_ENTRY  its entry point looks up "testhost" through the function
 *                    handed to testhost_lookup_in_entry(), and keeps the status
 *   SILENT_PLAN_FAIL plan() returns MLART_ENOTSUP without a detail (it does
 *                    not call init->error)
 *
 * attend() is plain float attention over a bf16 cache, and it records what
 * it received so tests can compare the views byte for byte. */
#ifdef UNTERMINATED_NAME
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include <sys/mman.h>
#include <unistd.h>
#endif
#include "plugins/testhost.h"

#include "ops/numerics.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifndef PLUGIN_NAME
#define PLUGIN_NAME "testhost"
#endif
#ifndef TABLE_NAME
#define TABLE_NAME PLUGIN_NAME
#endif
#ifndef MAX_HEADS
#define MAX_HEADS 0
#endif
#ifndef HEAD_MULTIPLE
#define HEAD_MULTIPLE 1
#endif
#ifndef MAX_TOPK
#define MAX_TOPK 0
#endif
#ifndef TAIL_PAD
#define TAIL_PAD 0
#endif
#ifndef ABI_VERSION
#define ABI_VERSION MLART_BACKEND_ABI_VERSION
#endif
#ifndef STRUCT_SIZE
#define STRUCT_SIZE sizeof(mlart_backend_vtable)
#endif

static testhost_record rec;

MLART_API testhost_record *testhost_record_get(void);
testhost_record *testhost_record_get(void)
{
    return &rec;
}

typedef struct state {
    mlart_backend_init init;
    mlart_plan plan;
} state;

static int th_create(const mlart_backend_init *init, void **out)
{
    state *s = calloc(1, sizeof *s);
    if (!s)
        return init->error(MLART_ENOMEM, PLUGIN_NAME ": out of memory");
    s->init = *init;
    rec.init = *init;
    rec.creates++;
    *out = s;
    return 0;
}

static void th_destroy(void *st)
{
    if (!st)
        return;
    rec.destroys++;
    free(st);
}

static int th_plan(void *st, const mlart_plan *plan, size_t *ws)
{
    state *s = st;
    s->plan = *plan;
    rec.plan = *plan;
    rec.plans++;
    *ws = (size_t)plan->geom.topk * sizeof(float); /* scores of one row */
#ifdef SILENT_PLAN_FAIL
    return MLART_ENOTSUP;
#else
    return 0;
#endif
}

static const uint16_t *at2(const mlart_tensor *t, int64_t i, int64_t j)
{
    return (const uint16_t *)t->data + i * t->stride[0] + j * t->stride[1];
}

__attribute__((unused)) static int th_attend(void *st, const mlart_step *s, void *stream)
{
    const state *S = st;
    const mlart_geometry *g = &s->geom;
    const int64_t H = g->heads, P = g->qk_nope, L = g->kv_lora, R = g->rope, K = g->topk;
    const int64_t page = g->page_size, MB = s->block_table.shape[1];
    const int32_t *idx = s->idx.data, *req = s->req_of_token.data, *bt = s->block_table.data;
    const uint8_t *cache = s->kv_cache.data;
    float *score = s->workspace;
    int64_t n = 0;
    (void)stream;
    if (!score || s->workspace_bytes < (size_t)K * sizeof(float))
        return S->init.error(MLART_EINVAL, PLUGIN_NAME ": workspace %p of %zu bytes, planned %zu",
                             s->workspace, s->workspace_bytes, (size_t)K * sizeof(float));
    rec.step = *s;
    rec.attends++;
    for (int64_t h = 0; h < H; h++)
        for (int64_t t = 0; t < s->T; t++)
            for (int64_t p = 0; p < P && n < TESTHOST_MAX_Q; p++)
                rec.q_nope[n++] = ((const uint16_t *)s->q_nope.data)[h * s->q_nope.stride[0] +
                                                                     t * s->q_nope.stride[1] + p];
    rec.q_nope_count = n;
    for (int64_t t = 0; t < s->T; t++) {
        int32_t r = req[t];
        for (int64_t h = 0; h < H; h++) {
            const uint16_t *q = at2(&s->q_mqa, t, h);
            float mx = -INFINITY, sum = 0.0f;
            uint16_t *out;
            float *lse;
#ifdef TOKEN_MAJOR
            out = (uint16_t *)s->attn_out.data + t * s->attn_out.stride[0] + h * s->attn_out.stride[1];
#else
            out = (uint16_t *)s->attn_out.data + h * s->attn_out.stride[0] + t * s->attn_out.stride[1];
#endif
            lse = (float *)s->lse.data + h * s->lse.stride[0] + t * s->lse.stride[1];
            for (int64_t k = 0; k < K; k++) {
                int32_t i = idx[t * K + k];
                const uint16_t *kv;
                float d = 0.0f;
                if (i < 0) {
                    score[k] = -INFINITY;
                    continue;
                }
                kv = (const uint16_t *)(cache + (size_t)(bt[r * MB + i / page] * page + i % page) *
                                                    (size_t)s->kv_cache.stride[0]);
                for (int64_t j = 0; j < L + R; j++)
                    d += mlart_bf16_to_f32(q[j]) * mlart_bf16_to_f32(kv[j]);
                score[k] = d * g->softmax_scale;
                mx = fmaxf(mx, score[k]);
            }
            for (int64_t l = 0; l < L; l++)
                out[l] = 0;
            if (mx == -INFINITY) {
                *lse = -INFINITY;
                continue;
            }
            for (int64_t k = 0; k < K; k++)
                if (score[k] > -INFINITY)
                    sum += expf(score[k] - mx);
            for (int64_t l = 0; l < L; l++) {
                float acc = 0.0f;
                for (int64_t k = 0; k < K; k++) {
                    int32_t i = idx[t * K + k];
                    const uint16_t *kv;
                    if (i < 0)
                        continue;
                    kv = (const uint16_t *)(cache + (size_t)(bt[r * MB + i / page] * page +
                                                             i % page) *
                                                        (size_t)s->kv_cache.stride[0]);
                    acc += expf(score[k] - mx) / sum * mlart_bf16_to_f32(kv[l]);
                }
                out[l] = mlart_f32_to_bf16(acc);
            }
            *lse = mx + logf(sum);
        }
    }
    return 0;
}

static const mlart_backend_vtable table = {
    .abi_version = ABI_VERSION,
    .struct_size = (uint32_t)(STRUCT_SIZE),
    .name = TABLE_NAME,
    .contract =
        {
#ifdef QUERY_SAFE_OP
            .query_bmm = MLART_QBMM_SAFE_OP,
#else
            .query_bmm = MLART_QBMM_CONTIGUOUS,
#endif
            .weights = MLART_W_DENSE,
#ifdef TOKEN_MAJOR
            .output = MLART_OUT_TOKEN_MAJOR,
#else
            .output = MLART_OUT_HEAD_MAJOR,
#endif
            .kv_formats = MLART_KV_FORMAT_BIT(MLART_KV_BF16),
            .max_heads = MAX_HEADS,
            .head_multiple = HEAD_MULTIPLE,
            .max_topk = MAX_TOPK,
            .tail_pad = TAIL_PAD,
            .graph_safe = 0,
            .devices = MLART_DEV_HOST,
        },
    .create = th_create,
    .destroy = th_destroy,
    .plan = th_plan,
    .absorb_query = NULL, /* runtime op */
#ifdef NO_ATTEND
    .attend = NULL,
#else
    .attend = th_attend,
#endif
    .v_up = NULL, /* runtime op */
};

#ifdef LOOKUP_IN_ENTRY
typedef int (*lookup_fn)(const char *, const mlart_backend_vtable **);
static lookup_fn lookup_cb;
static int lookup_rc = 1; /* 1: not called */
MLART_API void testhost_lookup_in_entry(lookup_fn fn, int **rc);
void testhost_lookup_in_entry(lookup_fn fn, int **rc)
{
    lookup_cb = fn;
    *rc = &lookup_rc;
}
#endif

#ifndef NO_ENTRY
MLART_API const mlart_backend_vtable *mlart_backend_entry_v1(void);
const mlart_backend_vtable *mlart_backend_entry_v1(void)
{
#ifdef LOOKUP_IN_ENTRY
    if (lookup_cb) {
        const mlart_backend_vtable *other;
        lookup_rc = lookup_cb("testhost", &other);
    }
#endif
#ifdef NULL_TABLE
    (void)table;
    return NULL;
#elif defined(UNTERMINATED_NAME)
    static mlart_backend_vtable *copy;
    if (!copy) {
        size_t page = (size_t)sysconf(_SC_PAGESIZE);
        char *m = mmap(NULL, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED || mprotect(m + page, page, PROT_NONE))
            return NULL;
        memset(m + page - 100, 'x', 100);
        copy = (mlart_backend_vtable *)(void *)m;
        *copy = table;
        copy->name = m + page - 100;
    }
    return copy;
#else
    return &table;
#endif
}
#else
/* Something exported, just not the entry point. */
MLART_API const mlart_backend_vtable *mlart_backend_entry_v0(void);
const mlart_backend_vtable *mlart_backend_entry_v0(void)
{
    return &table;
}
#endif
