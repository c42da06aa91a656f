/* The graph cache on the host (reference backend; steps launched directly,
 * no graphs): a step of T tokens runs in the smallest bucket >= T, its
 * rows equal a plain step of the T tokens bit for bit, the padding rows
 * come out zero with LSE -inf whatever the caller left past row T (indices
 * past seq_len), a negative length of an unused request is not read, the
 * cache write
 * reaches the given slots and none from the padding, and bad sizes, token
 * and request counts are refused before anything runs. */
#define _POSIX_C_SOURCE 200809L
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_run.h"
#include "mlart/graphs.h"
#include "tests/runtime/fixture.h"

enum { H_ = 4, P_ = 16, R_ = 8, L_ = 32, V_ = 16, K_ = 24, PAGE_ = 4, T_ = 8, B_ = 3, MB_ = 6 };
enum { BMAX = 4 }; /* the layer's max_requests: one more than the fixture's requests */

static const int32_t sizes[] = {1, 2, 4, 8};
static fx f;
static mlart_context *host;
static mlart_layer *ly;

static void setup(void)
{
    uint64_t seed = fx_seed();
    mlart_layer_desc d;
    setenv("MLART_BACKEND_PATH", MLART_TEST_PLUGIN_DIR, 1);
    fx_init(&f, H_, P_, R_, L_, V_, K_, PAGE_, T_, B_, MB_, seed);
    printf("seed %llu\n", (unsigned long long)seed);
    ck_assert_int_eq(mlart_context_create(-1, &host), 0);
    d = fx_desc(&f, "reference");
    d.max_requests = BMAX;
    ck_assert_msg(mlart_layer_create(host, &d, &ly) == 0, "%s", mlart_last_error());
}

static void teardown(void)
{
    mlart_layer_destroy(ly);
    mlart_context_destroy(host);
    fx_free(&f);
}

/* The fixture's first T tokens and its requests into the cache's buffers,
 * and junk everywhere a run must overwrite or ignore. */
static void load(const mlart_graph_bufs *b, int T)
{
    const size_t qrow = (size_t)H_ * (P_ + R_) * 2, irow = (size_t)K_ * 4;
    const int Tm = (int)b->io.T;
    memset(b->io.q.data, 0x7f, (size_t)Tm * qrow);
    memset(b->io.idx.data, 0x7f, (size_t)Tm * irow); /* 0x7f7f7f7f: past every seq_len */
    for (int t = 0; t < Tm; t++)
        ((int32_t *)b->io.req_of_token.data)[t] = B_ - 1;
    for (int r = 0; r < BMAX; r++)
        ((int32_t *)b->io.seq_lens.data)[r] = -5; /* refused if a run read it */
    memset(b->io.o.data, 0xff, b->io.o.extent);
    if (b->io.lse.data)
        memset(b->io.lse.data, 0xff, b->io.lse.extent);
    memcpy(b->io.q.data, f.q, (size_t)T * qrow);
    memcpy(b->io.idx.data, f.idx, (size_t)T * irow);
    memcpy(b->io.req_of_token.data, f.req, (size_t)T * 4);
    memcpy(b->io.seq_lens.data, f.lens, (size_t)B_ * 4);
    memcpy(b->io.block_table.data, f.bt, (size_t)B_ * MB_ * 4);
}

START_TEST(buckets_pad_and_match_a_plain_step)
{
    static const int steps[] = {1, 3, 5, 8, 2};
    static const int want_bucket[] = {1, 4, 8, 8, 2};
    mlart_graph_cache *gc = NULL;
    const mlart_graph_bufs *b;
    ck_assert_msg(mlart_graph_cache_create(ly, sizes, 4, MLART_GRAPH_LSE, NULL, &gc) == 0,
                  "%s", mlart_last_error());
    ck_assert_int_eq(mlart_graph_cache_graphs(gc), 0); /* host: launched directly */
    b = mlart_graph_cache_bufs(gc);
    ck_assert_int_eq(b->io.T, 8);
    ck_assert_int_eq(b->io.B, BMAX);
    ck_assert_ptr_null(b->rows.data);
    for (size_t s = 0; s < sizeof steps / sizeof steps[0]; s++) {
        const int T = steps[s], Tb = want_bucket[s];
        const size_t row = (size_t)H_ * V_;
        uint16_t *o = malloc(sizeof(uint16_t) * (size_t)T * row);
        float *lse = malloc(sizeof(float) * (size_t)H_ * T);
        mlart_step_io io = fx_io(&f);
        const uint16_t *go = b->io.o.data;
        const float *gl = b->io.lse.data;
        int rc;
        ck_assert(o && lse);
        /* the plain step of the same T tokens */
        io.T = T;
        io.q.shape[0] = io.idx.shape[0] = io.req_of_token.shape[0] = T;
        io.o = fx_view(o, MLART_DTYPE_BF16, 2, T, (int64_t)row, 0);
        io.lse = fx_view(lse, MLART_DTYPE_F32, 2, H_, T, 0);
        ck_assert_msg(mlart_layer_decode(ly, &io, NULL) == 0, "%s", mlart_last_error());
        ck_assert_int_eq(mlart_graph_cache_bucket(gc, T), Tb);

        load(b, T);
        rc = mlart_graph_cache_run(gc, T, B_, NULL);
        ck_assert_msg(rc == Tb, "T = %d: run returned %d, want bucket %d: %s", T, rc, Tb,
                      mlart_last_error());
        ck_assert_msg(memcmp(go, o, sizeof(uint16_t) * (size_t)T * row) == 0,
                      "T = %d: the cache's rows differ from the plain step's", T);
        for (int h = 0; h < H_; h++)
            for (int t = 0; t < 8; t++) {
                const float v = gl[(size_t)h * 8 + t];
                if (t < T)
                    ck_assert_msg(memcmp(&v, &lse[(size_t)h * T + t], 4) == 0,
                                  "T = %d: lse[%d][%d] %g, plain step %g", T, h, t, v,
                                  lse[(size_t)h * T + t]);
                else if (t < Tb)
                    ck_assert_msg(isinf(v) && v < 0, "T = %d: padding lse[%d][%d] = %g", T, h,
                                  t, v);
            }
        for (int t = T; t < 8; t++)
            for (size_t i = 0; i < row; i++) {
                const uint16_t v = go[(size_t)t * row + i];
                if (t < Tb)
                    ck_assert_msg(v == 0, "T = %d: padding row %d [%zu] = 0x%04x", T, t, i, v);
                else
                    ck_assert_msg(v == 0xffff, "T = %d: row %d past bucket %d written", T, t, Tb);
            }
        /* the padding the run left in place */
        for (int t = T; t < Tb; t++) {
            ck_assert_int_eq(((int32_t *)b->io.req_of_token.data)[t], 0);
            ck_assert_int_eq(((int32_t *)b->io.idx.data)[(size_t)t * K_ + K_ - 1], -1);
        }
        /* a request past B is not read (the reference refuses a length of -5) */
        ck_assert_int_eq(((int32_t *)b->io.seq_lens.data)[BMAX - 1], -5);
        free(o);
        free(lse);
    }
    mlart_graph_cache_destroy(gc);
}
END_TEST

START_TEST(cache_write_only_from_real_rows)
{
    enum { W = L_ + R_, T = 3 };
    const int32_t slots[T] = {5, 9, (B_ * MB_ * PAGE_) - 1};
    const size_t rb = (size_t)W * 2;
    uint8_t *before = malloc((size_t)f.num_slots * rb);
    mlart_graph_cache *gc = NULL;
    const mlart_graph_bufs *b;
    fx_rng r = {f.seed ^ 0x5eedull};
    ck_assert_ptr_nonnull(before);
    ck_assert_msg(mlart_graph_cache_create(ly, sizes, 4, MLART_GRAPH_WRITE_KV, NULL, &gc) == 0, "%s",
                  mlart_last_error());
    b = mlart_graph_cache_bufs(gc);
    ck_assert_int_eq(b->rows.shape[0], 8);
    ck_assert_int_eq(b->rows.shape[1], W);
    memcpy(before, f.cache, (size_t)f.num_slots * rb);
    load(b, T);
    for (int t = 0; t < 8; t++) {
        for (int i = 0; i < W; i++)
            ((uint16_t *)b->rows.data)[(size_t)t * W + i] = mlart_f32_to_bf16(fx_uniform(&r));
        /* rows past T name slot 0: the padding must drop them */
        ((int32_t *)b->slots.data)[t] = t < T ? slots[t] : 0;
    }
    ck_assert_msg(mlart_graph_cache_run(gc, T, B_, NULL) == 4, "%s", mlart_last_error());
    for (int64_t s = 0; s < f.num_slots; s++) {
        int t = -1;
        for (int k = 0; k < T; k++)
            if (slots[k] == s)
                t = k;
        if (t >= 0)
            ck_assert_msg(memcmp(f.cache + (size_t)s * rb, (uint8_t *)b->rows.data + (size_t)t * rb,
                                 rb) == 0, "slot %lld: not token %d's row", (long long)s, t);
        else
            ck_assert_msg(memcmp(f.cache + (size_t)s * rb, before + (size_t)s * rb, rb) == 0,
                          "slot %lld written by no token's row changed", (long long)s);
    }
    ck_assert_int_eq(((int32_t *)b->slots.data)[T], -1);
    mlart_graph_cache_destroy(gc);
    free(before);
}
END_TEST

START_TEST(bad_input_refused)
{
    static const int32_t down[] = {1, 4, 2}, zero[] = {0, 2}, big[] = {1, 9}, one[] = {4};
    int32_t many[MLART_GRAPH_MAX_BUCKETS + 1];
    mlart_graph_cache *gc = (mlart_graph_cache *)&gc; /* must stay untouched */
    mlart_graph_cache *const sentinel = gc;
    for (int i = 0; i <= MLART_GRAPH_MAX_BUCKETS; i++)
        many[i] = i + 1;
    ck_assert_int_eq(mlart_graph_cache_create(NULL, sizes, 4, 0, NULL, &gc), MLART_EINVAL);
    ck_assert_int_eq(mlart_graph_cache_create(ly, sizes, 4, 0, NULL, NULL), MLART_EINVAL);
    ck_assert_int_eq(mlart_graph_cache_create(ly, NULL, 4, 0, NULL, &gc), MLART_EINVAL);
    ck_assert_int_eq(mlart_graph_cache_create(ly, sizes, 0, 0, NULL, &gc), MLART_EINVAL);
    ck_assert_int_eq(mlart_graph_cache_create(ly, many, MLART_GRAPH_MAX_BUCKETS + 1, 0, NULL, &gc),
                     MLART_EINVAL);
    ck_assert_int_eq(mlart_graph_cache_create(ly, down, 3, 0, NULL, &gc), MLART_EINVAL);
    ck_assert_msg(strstr(mlart_last_error(), "must increase (2 after 4)"), "%s",
                  mlart_last_error());
    ck_assert_int_eq(mlart_graph_cache_create(ly, zero, 2, 0, NULL, &gc), MLART_EINVAL);
    ck_assert_int_eq(mlart_graph_cache_create(ly, big, 2, 0, NULL, &gc), MLART_EINVAL);
    ck_assert_msg(strstr(mlart_last_error(), "bucket 1 is 9 tokens (want 1..8"), "%s",
                  mlart_last_error());
    ck_assert_int_eq(mlart_graph_cache_create(ly, sizes, 4, 8, NULL, &gc), MLART_EINVAL);
    ck_assert_msg(strstr(mlart_last_error(), "unknown flags 0x8"), "%s", mlart_last_error());
    ck_assert_ptr_eq(gc, sentinel);

    ck_assert_int_eq(mlart_graph_cache_create(ly, one, 1, 0, NULL, &gc), 0);
    ck_assert_ptr_null(mlart_graph_cache_bufs(gc)->io.lse.data); /* no MLART_GRAPH_LSE */
    load(mlart_graph_cache_bufs(gc), 4);
    ck_assert_int_eq(mlart_graph_cache_bucket(gc, 1), 4);
    ck_assert_int_eq(mlart_graph_cache_bucket(gc, 5), MLART_ERANGE);
    ck_assert_int_eq(mlart_graph_cache_bucket(NULL, 1), MLART_EINVAL);
    ck_assert_int_eq(mlart_graph_cache_run(gc, 0, B_, NULL), MLART_ERANGE);
    ck_assert_int_eq(mlart_graph_cache_run(gc, 5, B_, NULL), MLART_ERANGE);
    ck_assert_msg(strstr(mlart_last_error(), "a step of 5 tokens (want 1..4"), "%s",
                  mlart_last_error());
    ck_assert_int_eq(mlart_graph_cache_run(gc, 4, 0, NULL), MLART_ERANGE);
    ck_assert_int_eq(mlart_graph_cache_run(gc, 4, BMAX + 1, NULL), MLART_ERANGE);
    ck_assert_msg(strstr(mlart_last_error(), "a step of 5 requests (want 1..4"), "%s",
                  mlart_last_error());
    ck_assert_int_eq(mlart_graph_cache_run(NULL, 1, 1, NULL), MLART_EINVAL);
    /* a token naming a request >= B: refused on the host */
    ((int32_t *)mlart_graph_cache_bufs(gc)->io.req_of_token.data)[1] = B_;
    ck_assert_int_eq(mlart_graph_cache_run(gc, 4, B_, NULL), MLART_ERANGE);
    ck_assert_msg(strstr(mlart_last_error(), "req_of_token[1] = 3"), "%s", mlart_last_error());
    ((int32_t *)mlart_graph_cache_bufs(gc)->io.req_of_token.data)[1] = f.req[1];
    /* nothing ran: the outputs keep load()'s poison */
    ck_assert_int_eq(((uint16_t *)mlart_graph_cache_bufs(gc)->io.o.data)[0], 0xffff);
    ck_assert_int_eq(mlart_graph_cache_run(gc, 4, B_, NULL), 4);
    ck_assert_ptr_null(mlart_graph_cache_bufs(NULL));
    ck_assert_int_eq(mlart_graph_cache_graphs(NULL), 0);
    mlart_graph_cache_destroy(gc);
    mlart_graph_cache_destroy(NULL);
    {
        /* a layer planned for more requests and blocks than any buffer holds:
         * the refusal names both limits */
        mlart_layer *huge = NULL;
        mlart_layer_desc d = fx_desc(&f, "reference");
        d.max_requests = INT32_MAX, d.max_blocks_per_req = INT32_MAX;
        ck_assert_msg(mlart_layer_create(host, &d, &huge) == 0, "%s", mlart_last_error());
        gc = sentinel;
        ck_assert_int_eq(mlart_graph_cache_create(huge, one, 1, 0, NULL, &gc), MLART_ERANGE);
        ck_assert_msg(strstr(mlart_last_error(), "2147483647 requests and 2147483647 blocks a request") &&
                          strstr(mlart_last_error(), "max_requests and max_blocks_per_req"),
                      "%s", mlart_last_error());
        ck_assert_ptr_eq(gc, sentinel);
        mlart_layer_destroy(huge);
    }
}
END_TEST

/* A backend whose contract asks for readable bytes past every input
 * (the testpad plugin: 256): the cache's buffers carry them, and its
 * steps run (they were refused, the views ending at their rows). */
START_TEST(backend_tail_pad)
{
    const size_t pad = 256, cb = (size_t)f.num_slots * (L_ + R_) * 2;
    mlart_layer_desc d = fx_desc(&f, "testpad");
    mlart_layer *lp = NULL;
    mlart_graph_cache *gc = NULL;
    const mlart_graph_bufs *b;
    void *cache = calloc(1, cb + pad);
    ck_assert_ptr_nonnull(cache);
    memcpy(cache, f.cache, cb);
    d.kv_cache.data = cache;
    d.kv_cache.base = cache;
    d.kv_cache.extent = cb + pad;
    ck_assert_msg(mlart_layer_create(host, &d, &lp) == 0, "%s", mlart_last_error());
    ck_assert_msg(mlart_graph_cache_create(lp, sizes, 4, MLART_GRAPH_WRITE_KV | MLART_GRAPH_LSE,
                                           NULL, &gc) == 0, "%s", mlart_last_error());
    b = mlart_graph_cache_bufs(gc);
    ck_assert_uint_ge(b->io.q.extent, (size_t)8 * H_ * (P_ + R_) * 2 + pad);
    ck_assert_uint_ge(b->io.block_table.extent, (size_t)B_ * MB_ * 4 + pad);
    ck_assert_uint_ge(b->slots.extent, 8 * 4 + pad);
    load(b, 3);
    for (int t = 0; t < 8; t++)
        ((int32_t *)b->slots.data)[t] = -1;
    memset(b->rows.data, 0, b->rows.extent);
    ck_assert_msg(mlart_graph_cache_run(gc, 3, B_, NULL) == 4, "%s", mlart_last_error());
    load(b, 8);
    ck_assert_msg(mlart_graph_cache_run(gc, 8, B_, NULL) == 8, "%s", mlart_last_error());
    mlart_graph_cache_destroy(gc);
    mlart_layer_destroy(lp);
    free(cache);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("graphs");
    TCase *tc = tcase_create("graphs");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_test(tc, buckets_pad_and_match_a_plain_step);
    tcase_add_test(tc, cache_write_only_from_real_rows);
    tcase_add_test(tc, bad_input_refused);
    tcase_add_test(tc, backend_tail_pad);
    suite_add_tcase(s, tc);
    return check_run(s, CK_FORK_GETENV);
}
