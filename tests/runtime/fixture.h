/* Host fixtures for the runtime tests: a seeded generator and one decode
 * step's worth of random inputs (query, weights in dense and kv_b_proj form,
 * bf16 cache, paged block table with permuted blocks, top-k indices with
 * holes and an all-empty row). */
#ifndef MLART_TESTS_RUNTIME_FIXTURE_H
#define MLART_TESTS_RUNTIME_FIXTURE_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mlart/mlart.h"
#include "ops/numerics.h"

typedef struct fx_rng {
    uint64_t s;
} fx_rng;

static inline uint64_t fx_next(fx_rng *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull); /* splitmix64 */
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline float fx_uniform(fx_rng *r) /* [-1, 1) */
{
    return (float)((double)(fx_next(r) >> 11) * 0x1.0p-52 - 1.0);
}

/* MLART_TEST_SEED if set, else fresh from the clock. */
static inline uint64_t fx_seed(void)
{
    const char *s = getenv("MLART_TEST_SEED");
    if (s && *s)
        return strtoull(s, NULL, 0);
    return (uint64_t)time(NULL) ^ ((uint64_t)clock() << 32);
}

typedef struct fx {
    mlart_geometry g;
    int32_t T, B, MB;
    int64_t num_slots;
    uint64_t seed;
    uint16_t *q;         /* [T,H,P+R] */
    int32_t *idx;        /* [T,topk] */
    int32_t *req, *lens; /* [T], [B] */
    int32_t *bt;         /* [B,MB] */
    uint16_t *w_uk_t;    /* dense [H,P,L] */
    uint16_t *w_uv;      /* dense [H,L,V] */
    uint16_t *kv_b_proj; /* [H*(P+V),L], holding the same values as w_uk_t / w_uv */
    uint8_t *cache;      /* bf16 rows [num_slots, L+R] */
    uint16_t *o;         /* [T,H*V] */
    float *lse;          /* [H,T] */
} fx;

static inline void fx_free(fx *f)
{
    free(f->q), free(f->idx), free(f->req), free(f->lens), free(f->bt);
    free(f->w_uk_t), free(f->w_uv), free(f->kv_b_proj), free(f->cache), free(f->o), free(f->lse);
    memset(f, 0, sizeof *f);
}

static inline void fx_init(fx *f, int H, int P, int R, int L, int V, int topk, int page, int T,
                           int B, int MB, uint64_t seed)
{
    fx_rng r = {seed};
    const int64_t nb = (int64_t)B * MB;
    int32_t *perm;
    memset(f, 0, sizeof *f);
    f->g = (mlart_geometry){H, P, R, L, V, topk, page, MLART_KV_BF16,
                            1.0f / sqrtf((float)(P + R))};
    f->T = T, f->B = B, f->MB = MB, f->seed = seed;
    f->num_slots = nb * page;
    f->q = malloc(sizeof(uint16_t) * (size_t)T * H * (P + R));
    f->idx = malloc(sizeof(int32_t) * (size_t)T * topk);
    f->req = malloc(sizeof(int32_t) * (size_t)T);
    f->lens = malloc(sizeof(int32_t) * (size_t)B);
    f->bt = malloc(sizeof(int32_t) * (size_t)nb);
    f->w_uk_t = malloc(sizeof(uint16_t) * (size_t)H * P * L);
    f->w_uv = malloc(sizeof(uint16_t) * (size_t)H * L * V);
    f->kv_b_proj = malloc(sizeof(uint16_t) * (size_t)H * (P + V) * L);
    f->cache = malloc((size_t)f->num_slots * (size_t)(L + R) * 2);
    f->o = malloc(sizeof(uint16_t) * (size_t)T * H * V);
    f->lse = malloc(sizeof(float) * (size_t)H * T);
    perm = malloc(sizeof(int32_t) * (size_t)nb);
    for (int64_t i = 0; i < (int64_t)T * H * (P + R); i++)
        f->q[i] = mlart_f32_to_bf16(fx_uniform(&r));
    for (int64_t i = 0; i < (int64_t)f->num_slots * (L + R); i++)
        ((uint16_t *)f->cache)[i] = mlart_f32_to_bf16(fx_uniform(&r));
    for (int h = 0; h < H; h++)
        for (int l = 0; l < L; l++) {
            for (int p = 0; p < P; p++) {
                uint16_t w = mlart_f32_to_bf16(0.1f * fx_uniform(&r));
                f->w_uk_t[((size_t)h * P + p) * L + l] = w;
                f->kv_b_proj[((size_t)h * (P + V) + p) * L + l] = w;
            }
            for (int v = 0; v < V; v++) {
                uint16_t w = mlart_f32_to_bf16(0.1f * fx_uniform(&r));
                f->w_uv[((size_t)h * L + l) * V + v] = w;
                f->kv_b_proj[((size_t)h * (P + V) + P + v) * L + l] = w;
            }
        }
    for (int64_t i = 0; i < nb; i++)
        perm[i] = (int32_t)i;
    for (int64_t i = nb - 1; i > 0; i--) { /* physical blocks in random order */
        int64_t j = (int64_t)(fx_next(&r) % (uint64_t)(i + 1));
        int32_t x = perm[i];
        perm[i] = perm[j], perm[j] = x;
    }
    memcpy(f->bt, perm, sizeof(int32_t) * (size_t)nb);
    for (int b = 0; b < B; b++)
        f->lens[b] = 1 + (int32_t)(fx_next(&r) % (uint64_t)(MB * page));
    for (int t = 0; t < T; t++) {
        int b = t % B;
        f->req[t] = b;
        for (int k = 0; k < topk; k++) {
            int32_t v = (int32_t)(fx_next(&r) % (uint64_t)f->lens[b]);
            if (fx_next(&r) % 5 == 0 || (T > 2 && t == T - 1))
                v = -1; /* holes, and the last token has no valid slot at all */
            f->idx[(size_t)t * topk + k] = v;
        }
    }
    free(perm);
}

static inline mlart_tensor fx_view(void *data, mlart_dtype dt, int ndim, int64_t d0, int64_t d1,
                                   int64_t d2)
{
    int64_t shape[3] = {d0, d1, d2};
    return mlart_tensor_dense(data, dt, -1, ndim, shape);
}

/* Step views over the fixture (q with its natural strides). */
static inline mlart_step_io fx_io(fx *f)
{
    const mlart_geometry *g = &f->g;
    mlart_step_io io;
    memset(&io, 0, sizeof io);
    io.T = f->T, io.B = f->B;
    io.q = fx_view(f->q, MLART_DTYPE_BF16, 3, f->T, g->heads, g->qk_nope + g->rope);
    io.idx = fx_view(f->idx, MLART_DTYPE_I32, 2, f->T, g->topk, 0);
    io.req_of_token = fx_view(f->req, MLART_DTYPE_I32, 1, f->T, 0, 0);
    io.seq_lens = fx_view(f->lens, MLART_DTYPE_I32, 1, f->B, 0, 0);
    io.block_table = fx_view(f->bt, MLART_DTYPE_I32, 2, f->B, f->MB, 0);
    io.o = fx_view(f->o, MLART_DTYPE_BF16, 2, f->T, (int64_t)g->heads * g->v_head, 0);
    io.lse = fx_view(f->lse, MLART_DTYPE_F32, 2, g->heads, f->T, 0);
    return io;
}

/* Layer description with dense weights and the fixture's cache. */
static inline mlart_layer_desc fx_desc(fx *f, const char *backend)
{
    const mlart_geometry *g = &f->g;
    mlart_layer_desc d;
    memset(&d, 0, sizeof d);
    d.geom = *g;
    d.backend = backend;
    d.max_tokens = f->T;
    d.max_requests = f->B;
    d.max_blocks_per_req = f->MB;
    d.num_slots = f->num_slots;
    d.w_uk_t = fx_view(f->w_uk_t, MLART_DTYPE_BF16, 3, g->heads, g->qk_nope, g->kv_lora);
    d.w_uv = fx_view(f->w_uv, MLART_DTYPE_BF16, 3, g->heads, g->kv_lora, g->v_head);
    d.kv_cache = fx_view(f->cache, MLART_DTYPE_U8, 2, f->num_slots,
                         (int64_t)mlart_kv_bytes_per_token(g), 0);
    return d;
}

#endif
