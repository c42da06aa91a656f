/* The reference vectors of tests/data: the reference backend (through its
 * vtable, on a hand-built step) and the float64 oracle against the
 * independent float64 expectations, and the fp8_ds_mla quantiser against
 * the stored records, bit for bit. */
#include <check.h>
#include <stddef.h>

#include "check_run.h"
#include "ops/ops.h"
#include "tests/reference/ref_step.h"

static const char *const cases[] = {"tiny-bf16", "small-bf16", "small-fp8", "glm5h4-fp8"};
#define NCASES 4

/* Bound on o's relative L2 error against the float64 expectation: three
 * bf16 roundings (q_mqa, attn_out, o) of RMS ~2^-8/sqrt(3) each, about 4e-3
 * together (docs/reference.md).  The oracle itself must agree to f32
 * storage precision of the expectation files. */
#define VEC_O_BOUND 5e-3
#define VEC_LSE_BOUND 2e-3 /* absolute, natural log units */
#define ORACLE_BOUND 1e-6

/* ---- manifest --------------------------------------------------------- */
static const char *json_key(const char *js, const char *key)
{
    char pat[64];
    const char *p;
    snprintf(pat, sizeof pat, "\"%s\"", key);
    p = strstr(js, pat);
    if (!p)
        return NULL;
    p = strchr(p + strlen(pat), ':');
    return p ? p + 1 : NULL;
}

static double json_num(const char *js, const char *key)
{
    const char *p = json_key(js, key);
    ck_assert_msg(p != NULL, "manifest lacks %s", key);
    return strtod(p, NULL);
}

/* All integers of the (possibly nested) array after key, in order. */
static int64_t json_ints(const char *js, const char *key, int32_t *out, int64_t max)
{
    const char *p = json_key(js, key);
    int depth = 0;
    int64_t n = 0;
    ck_assert_msg(p != NULL, "manifest lacks %s", key);
    while (*p && *p != '[')
        p++;
    do {
        if (*p == '[')
            depth++, p++;
        else if (*p == ']')
            depth--, p++;
        else if (*p == '-' || (*p >= '0' && *p <= '9')) {
            char *end;
            long v = strtol(p, &end, 10);
            ck_assert(n < max);
            out[n++] = (int32_t)v;
            p = end;
        } else
            p++;
    } while (depth > 0 && *p);
    return n;
}

typedef struct vec_case {
    char dir[512];
    char *manifest;
    ref_problem p;
    int32_t *req_of_token, *seq_lens, *block_table;
    void *q, *kv_latent, *kv_fp8, *idx, *kv_b_proj, *expect_o, *expect_lse;
    size_t q_len, lat_len, fp8_len, idx_len, kvb_len, o_len, lse_len;
} vec_case;

static void *must_read(const vec_case *c, const char *name, size_t *len)
{
    void *p = ref_read_file(c->dir, name, len);
    ck_assert_msg(p != NULL, "cannot read %s/%s", c->dir, name);
    return p;
}

static void load_case(vec_case *c, const char *name)
{
    size_t n;
    const char *fmt;
    ref_problem *p = &c->p;
    memset(c, 0, sizeof *c);
    snprintf(c->dir, sizeof c->dir, "%s/%s", MLART_TEST_DATA, name);
    c->manifest = must_read(c, "manifest.json", &n);
    p->g.heads = (int32_t)json_num(c->manifest, "H");
    p->g.qk_nope = (int32_t)json_num(c->manifest, "P");
    p->g.rope = (int32_t)json_num(c->manifest, "R");
    p->g.kv_lora = (int32_t)json_num(c->manifest, "L");
    p->g.v_head = (int32_t)json_num(c->manifest, "V");
    p->g.topk = (int32_t)json_num(c->manifest, "topk");
    p->g.page_size = (int32_t)json_num(c->manifest, "page");
    p->g.softmax_scale = (float)json_num(c->manifest, "softmax_scale");
    fmt = json_key(c->manifest, "kv_format");
    ck_assert(fmt != NULL);
    {
        char fname[32] = {0};
        const char *q0 = strchr(fmt, '"'), *q1 = q0 ? strchr(q0 + 1, '"') : NULL;
        ck_assert(q1 != NULL && q1 - q0 - 1 < (ptrdiff_t)sizeof fname);
        memcpy(fname, q0 + 1, (size_t)(q1 - q0 - 1));
        ck_assert_msg(mlart_kv_format_parse(fname, &p->g.kv_format) == 0, "kv_format %s", fname);
    }
    p->T = (int32_t)json_num(c->manifest, "T");
    p->B = (int32_t)json_num(c->manifest, "B");
    p->num_slots = (int64_t)json_num(c->manifest, "num_slots");
    c->req_of_token = malloc(sizeof(int32_t) * (size_t)p->T);
    c->seq_lens = malloc(sizeof(int32_t) * (size_t)p->B);
    c->block_table = malloc(sizeof(int32_t) * 65536);
    ck_assert(json_ints(c->manifest, "req_of_token", c->req_of_token, p->T) == p->T);
    ck_assert(json_ints(c->manifest, "seq_lens", c->seq_lens, p->B) == p->B);
    n = (size_t)json_ints(c->manifest, "block_table", c->block_table, 65536);
    ck_assert(n % (size_t)p->B == 0);
    p->max_blocks = (int32_t)(n / (size_t)p->B);
    ck_assert_int_eq(mlart_geometry_check(&p->g), 0);

    c->q = must_read(c, "q.bin", &c->q_len);
    c->kv_latent = must_read(c, "kv_latent.bin", &c->lat_len);
    c->idx = must_read(c, "idx.bin", &c->idx_len);
    c->kv_b_proj = must_read(c, "kv_b_proj.bin", &c->kvb_len);
    c->expect_o = must_read(c, "expect_o.bin", &c->o_len);
    c->expect_lse = must_read(c, "expect_lse.bin", &c->lse_len);
    if (p->g.kv_format == MLART_KV_FP8_DS_MLA)
        c->kv_fp8 = must_read(c, "kv_fp8.bin", &c->fp8_len);
    {
        int64_t H = p->g.heads, P = p->g.qk_nope, R = p->g.rope, L = p->g.kv_lora, V = p->g.v_head;
        ck_assert(c->q_len == (size_t)(p->T * H * (P + R)) * 2);
        ck_assert(c->lat_len == (size_t)(p->num_slots * (L + R)) * 2);
        ck_assert(c->idx_len == (size_t)((int64_t)p->T * p->g.topk) * 4);
        ck_assert(c->kvb_len == (size_t)(H * (P + V) * L) * 2);
        ck_assert(c->o_len == (size_t)(p->T * H * V) * 4);
        ck_assert(c->lse_len == (size_t)(H * p->T) * 4);
        if (c->kv_fp8)
            ck_assert(c->fp8_len == (size_t)p->num_slots * mlart_kv_bytes_per_token(&p->g));
    }
}

static void free_case(vec_case *c)
{
    void *ps[] = {c->manifest, c->req_of_token, c->seq_lens, c->block_table, c->q, c->kv_latent,
                  c->kv_fp8, c->idx, c->kv_b_proj, c->expect_o, c->expect_lse};
    for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++)
        free(ps[i]);
}

/* Fill the problem's buffers from the case: W_UK_T / W_UV derived from
 * kv_b_proj (views, then dense copies as the contract asks), cache rows in
 * the case's format. */
static void fill_problem(vec_case *c)
{
    ref_problem *p = &c->p;
    const mlart_geometry *g = &p->g;
    int64_t H = g->heads, P = g->qk_nope, L = g->kv_lora, V = g->v_head;
    int64_t sh[2] = {H * (P + V), L};
    mlart_tensor kvb = mlart_tensor_dense(c->kv_b_proj, MLART_DTYPE_BF16, -1, 2, sh), wk, wv;
    ref_problem_alloc(p);
    ck_assert_msg(mlart_weights_from_kv_b_proj(g, &kvb, &wk, &wv) == 0, "%s", mlart_last_error());
    for (int64_t h = 0; h < H; h++)
        for (int64_t i = 0; i < P; i++)
            for (int64_t l = 0; l < L; l++)
                ((uint16_t *)p->wk.p)[(h * P + i) * L + l] =
                    ((uint16_t *)wk.data)[h * wk.stride[0] + i * wk.stride[1] + l * wk.stride[2]];
    for (int64_t h = 0; h < H; h++)
        for (int64_t l = 0; l < L; l++)
            for (int64_t v = 0; v < V; v++)
                ((uint16_t *)p->wv.p)[(h * L + l) * V + v] =
                    ((uint16_t *)wv.data)[h * wv.stride[0] + l * wv.stride[1] + v * wv.stride[2]];
    memcpy(p->q.p, c->q, c->q_len);
    memcpy(p->idx.p, c->idx, c->idx_len);
    memcpy(p->req.p, c->req_of_token, sizeof(int32_t) * (size_t)p->T);
    memcpy(p->lens.p, c->seq_lens, sizeof(int32_t) * (size_t)p->B);
    memcpy(p->bt.p, c->block_table, sizeof(int32_t) * (size_t)p->B * (size_t)p->max_blocks);
    if (g->kv_format == MLART_KV_FP8_DS_MLA)
        memcpy(p->cache.p, c->kv_fp8, c->fp8_len);
    else
        memcpy(p->cache.p, c->kv_latent, c->lat_len); /* a bf16 row is L+R bf16 values */
}

static double lse_abs_err(const float *got, const float *want, int64_t n, int64_t *inf_bad, int64_t *n_inf)
{
    double worst = 0.0;
    for (int64_t i = 0; i < n; i++) {
        if (isinf(want[i])) {
            (*n_inf)++;
            if (!(isinf(got[i]) && got[i] < 0))
                (*inf_bad)++;
            continue;
        }
        if (!isfinite(got[i])) {
            (*inf_bad)++;
            continue;
        }
        if (fabs((double)got[i] - want[i]) > worst)
            worst = fabs((double)got[i] - want[i]);
    }
    return worst;
}

START_TEST(vectors_reference_and_oracle)
{
    vec_case c;
    ref_problem *p = &c.p;
    mlart_step s;
    mlart_oracle_problem op;
    mlart_oracle_error e_ref, e_orc;
    int64_t HT, TOUT, inf_bad = 0, n_inf = 0, inf_bad_o = 0, n_inf_o = 0;
    double *expect_o, *oracle_o, *oracle_lse, lse_err, lse_err_orc;
    float *oracle_lse_f;
    mlart_tensor o;
    load_case(&c, cases[_i]);
    fill_problem(&c);
    HT = (int64_t)p->g.heads * p->T;
    TOUT = (int64_t)p->T * p->g.heads * p->g.v_head;
    ref_problem_poison(p);
    ck_assert_msg(ref_run_reference(p, &s) == 0, "%s: %s", cases[_i], mlart_last_error());

    expect_o = malloc(sizeof(double) * (size_t)TOUT);
    for (int64_t i = 0; i < TOUT; i++)
        expect_o[i] = ((const float *)c.expect_o)[i];
    o = ref_problem_o_view(p);
    ck_assert(mlart_oracle_compare(&o, expect_o, &e_ref) == 0);
    lse_err = lse_abs_err((const float *)p->lse.p, (const float *)c.expect_lse, HT, &inf_bad, &n_inf);

    /* the oracle from the original inputs: q, kv_b_proj, cache, indices */
    ref_problem_oracle(p, &op);
    {
        int64_t sh[2] = {(int64_t)p->g.heads * (p->g.qk_nope + p->g.v_head), p->g.kv_lora};
        op.kv_b_proj = mlart_tensor_dense(c.kv_b_proj, MLART_DTYPE_BF16, -1, 2, sh);
        memset(&op.w_uk_t, 0, sizeof op.w_uk_t);
        memset(&op.w_uv, 0, sizeof op.w_uv);
    }
    oracle_o = malloc(sizeof(double) * (size_t)TOUT);
    oracle_lse = malloc(sizeof(double) * (size_t)HT);
    oracle_lse_f = malloc(sizeof(float) * (size_t)HT);
    ck_assert_msg(mlart_oracle_decode_f64(&op, oracle_o, oracle_lse) == 0, "%s", mlart_last_error());
    {
        int64_t sh[1] = {TOUT};
        float *of = malloc(sizeof(float) * (size_t)TOUT);
        mlart_tensor ot;
        for (int64_t i = 0; i < TOUT; i++)
            of[i] = (float)oracle_o[i];
        ot = mlart_tensor_dense(of, MLART_DTYPE_F32, -1, 1, sh);
        ck_assert(mlart_oracle_compare(&ot, expect_o, &e_orc) == 0);
        free(of);
    }
    for (int64_t i = 0; i < HT; i++)
        oracle_lse_f[i] = (float)oracle_lse[i];
    lse_err_orc = lse_abs_err(oracle_lse_f, (const float *)c.expect_lse, HT, &inf_bad_o, &n_inf_o);

    printf("%-11s %-10s T=%d H=%d topk=%d: reference o rel L2 %.3e max abs %.3e, lse max abs err %.3e, "
           "-inf rows %lld; oracle o rel L2 %.3e, lse %.3e\n",
           cases[_i], mlart_kv_format_name(p->g.kv_format), p->T, p->g.heads, p->g.topk, e_ref.rel_l2,
           e_ref.max_abs, lse_err, (long long)n_inf, e_orc.rel_l2, lse_err_orc);
    ck_assert_msg(e_ref.nonfinite == 0 && e_ref.inf_mismatch == 0, "%s: non-finite o", cases[_i]);
    ck_assert_msg(e_ref.rel_l2 <= VEC_O_BOUND, "%s: reference o rel L2 %.3e > %.0e", cases[_i],
                  e_ref.rel_l2, VEC_O_BOUND);
    ck_assert_msg(inf_bad == 0, "%s: %lld lse entries differ in -inf-ness", cases[_i], (long long)inf_bad);
    ck_assert_msg(lse_err <= VEC_LSE_BOUND, "%s: lse error %.3e", cases[_i], lse_err);
    ck_assert_msg(e_orc.rel_l2 <= ORACLE_BOUND && inf_bad_o == 0 && lse_err_orc <= 1e-5,
                  "%s: oracle disagrees with the expectation (o rel %.3e, lse %.3e)", cases[_i],
                  e_orc.rel_l2, lse_err_orc);
    free(expect_o);
    free(oracle_o);
    free(oracle_lse);
    free(oracle_lse_f);
    ref_problem_free(p);
    free_case(&c);
}
END_TEST

/* The CPU writer quantises kv_latent.bin into exactly kv_fp8.bin. */
START_TEST(quantiser_bit_exact)
{
    int checked = 0;
    for (int ci = 0; ci < NCASES; ci++) {
        vec_case c;
        ref_problem *p = &c.p;
        ref_buf cb, sb;
        mlart_tensor cache, lat, slots;
        int64_t N, diff = 0, first = -1, bpt;
        load_case(&c, cases[ci]);
        if (p->g.kv_format != MLART_KV_FP8_DS_MLA) {
            free_case(&c);
            continue;
        }
        N = p->num_slots;
        bpt = (int64_t)mlart_kv_bytes_per_token(&p->g);
        cb = ref_buf_new((size_t)(N * bpt));
        sb = ref_buf_new((size_t)N * 4);
        for (int64_t i = 0; i < N; i++) /* rows written in reverse slot order */
            ((int32_t *)sb.p)[i] = (int32_t)(N - 1 - i);
        {
            int64_t sh[2] = {N, bpt}, st[2] = {bpt, 1};
            int64_t lsh[2] = {N, (int64_t)p->g.kv_lora + p->g.rope};
            int64_t s1[1] = {N}, t1[1] = {1};
            cache = ref_view(&cb, MLART_DTYPE_U8, 0, 2, sh, st);
            slots = ref_view(&sb, MLART_DTYPE_I32, 0, 1, s1, t1);
            lat = mlart_tensor_dense(c.kv_latent, MLART_DTYPE_BF16, -1, 2, lsh);
        }
        /* row i of latent goes to slot N-1-i: feed the rows reversed too */
        {
            uint16_t *rev = malloc(c.lat_len);
            int64_t D = (int64_t)p->g.kv_lora + p->g.rope;
            for (int64_t i = 0; i < N; i++)
                memcpy(rev + i * D, (uint16_t *)c.kv_latent + (N - 1 - i) * D, (size_t)D * 2);
            lat.data = rev, lat.base = rev;
            ck_assert_msg(mlart_kv_write_cpu(&p->g, &cache, &lat, &slots) == 0, "%s", mlart_last_error());
            free(rev);
        }
        for (int64_t i = 0; i < N * bpt; i++)
            if (cb.p[i] != ((uint8_t *)c.kv_fp8)[i]) {
                if (first < 0)
                    first = i;
                diff++;
            }
        printf("%-11s quantiser: %lld records, %lld bytes differ from kv_fp8.bin\n", cases[ci],
               (long long)N, (long long)diff);
        ck_assert_msg(diff == 0, "%s: %lld bytes differ, first at record %lld byte %lld", cases[ci],
                      (long long)diff, (long long)(first / bpt), (long long)(first % bpt));
        /* and the header's encoder alone, record by record */
        for (int64_t i = 0; i < N; i++) {
            uint8_t rec[4096];
            mlart_fp8_ds_mla_encode((const uint16_t *)c.kv_latent + i * (p->g.kv_lora + p->g.rope),
                                    p->g.kv_lora, p->g.rope, rec);
            ck_assert(memcmp(rec, (uint8_t *)c.kv_fp8 + i * bpt, (size_t)bpt) == 0);
        }
        checked++;
        ref_buf_free(&cb);
        ref_buf_free(&sb);
        free_case(&c);
    }
    ck_assert_int_eq(checked, 2);
}
END_TEST

int main(void)
{
    Suite *su = suite_create("reference_vectors");
    TCase *tc = tcase_create("vectors");
    printf("test_ref_vectors: data %s (fixed vectors, no random input)\n", MLART_TEST_DATA);
    tcase_set_timeout(tc, 240);
    tcase_add_loop_test(tc, vectors_reference_and_oracle, 0, NCASES);
    tcase_add_test(tc, quantiser_bit_exact);
    suite_add_tcase(su, tc);
    return check_run(su, CK_FORK_GETENV);
}
