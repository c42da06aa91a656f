/* The reference backend (through its vtable) against the float64 oracle on
 * fresh random problems: holes, all -1 rows, duplicates, page boundaries,
 * requests shorter than topk, both cache formats, odd geometries; and bad
 * steps refused with clear errors and untouched outputs. */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS, MAP_NORESERVE */
#include <check.h>
#include <stddef.h>
#include <sys/mman.h>

#include "check_run.h"
#include "ops/ops.h"
#include "tests/reference/ref_step.h"

/* Bound on the relative L2 error of o against the float64 oracle.  The
 * reference rounds three times to bf16 (q_mqa, attn_out, o), each with
 * relative error at most 2^-8 and RMS about 2^-8/sqrt(3) ~ 2.3e-3 (uniform
 * position inside the half-ulp); independent, they add up in RMS to about
 * 4e-3, and softmax weights move by the score error, which is the q_mqa
 * rounding again, scaled by the score spread (about 1 here).  1e-2 leaves
 * room for that and still fails on any real mistake (a wrong slot, a
 * missing rope term or a wrong scale gives errors of order 1e-1..1). */
#define O_REL_L2_BOUND 1e-2

static double worst_o_rel = 0.0, worst_lse_ratio = 0.0;

/* Fill a random problem in p (geometry chosen by the caller). */
static void make_problem(ref_problem *p, int64_t max_len)
{
    const mlart_geometry *g = &p->g;
    int64_t H = g->heads, P = g->qk_nope, R = g->rope, L = g->kv_lora, V = g->v_head;
    int32_t page = g->page_size, topk = g->topk;
    int32_t *lens, *req, *bt, *idx;
    int64_t nblocks, *perm;
    mlart_tensor cache, lat, slots;
    ref_buf latb, slotb;
    p->max_blocks = (int32_t)((max_len + page - 1) / page) + 1;
    nblocks = (int64_t)p->B * p->max_blocks + 2;
    p->num_slots = nblocks * page;
    p->q_mqa_pad = ref_rand_int(3) * 7;
    p->o_pad = ref_rand_int(3) * 5;
    ref_problem_alloc(p);
    for (int64_t i = 0; i < p->T * H * (P + R); i++)
        ((uint16_t *)p->q.p)[i] = ref_rand_bf16(1.0);
    for (int64_t i = 0; i < H * P * L; i++)
        ((uint16_t *)p->wk.p)[i] = ref_rand_bf16(1.0 / sqrt((double)P));
    for (int64_t i = 0; i < H * L * V; i++)
        ((uint16_t *)p->wv.p)[i] = ref_rand_bf16(1.0 / sqrt((double)L));
    /* cache: random latent rows through the CPU writer (quantised for fp8) */
    latb = ref_buf_new((size_t)(p->num_slots * (L + R)) * 2);
    slotb = ref_buf_new((size_t)p->num_slots * 4);
    for (int64_t i = 0; i < p->num_slots * (L + R); i++)
        ((uint16_t *)latb.p)[i] = ref_rand_bf16(2.0);
    for (int64_t i = 0; i < p->num_slots; i++)
        ((int32_t *)slotb.p)[i] = (int32_t)i;
    {
        int64_t sh[2] = {p->num_slots, L + R}, st[2] = {L + R, 1}, s1[1] = {p->num_slots}, t1[1] = {1};
        lat = ref_view(&latb, MLART_DTYPE_BF16, 0, 2, sh, st);
        slots = ref_view(&slotb, MLART_DTYPE_I32, 0, 1, s1, t1);
    }
    cache = ref_problem_cache_view(p);
    ck_assert_msg(mlart_kv_write_cpu(g, &cache, &lat, &slots) == 0, "%s", mlart_last_error());
    ref_buf_free(&latb);
    ref_buf_free(&slotb);

    lens = (int32_t *)p->lens.p;
    req = (int32_t *)p->req.p;
    bt = (int32_t *)p->bt.p;
    idx = (int32_t *)p->idx.p;
    for (int32_t b = 0; b < p->B; b++) /* some shorter than topk, one possibly empty */
        lens[b] = (int32_t)(b == 0 ? ref_rand_int(topk + 1) : ref_rand_int(max_len + 1));
    perm = malloc(sizeof *perm * (size_t)nblocks);
    for (int64_t i = 0; i < nblocks; i++)
        perm[i] = i;
    for (int64_t i = nblocks - 1; i > 0; i--) {
        int64_t j = ref_rand_int(i + 1), x = perm[i];
        perm[i] = perm[j], perm[j] = x;
    }
    for (int64_t i = 0; i < (int64_t)p->B * p->max_blocks; i++)
        bt[i] = (int32_t)perm[i];
    free(perm);
    for (int32_t t = 0; t < p->T; t++) {
        int32_t b = (int32_t)ref_rand_int(p->B), len;
        int mode = t % 5;
        req[t] = b;
        len = lens[b];
        for (int32_t k = 0; k < topk; k++) {
            int32_t v = -1;
            if (len > 0) {
                switch (mode) {
                case 0: /* all -1 */
                    break;
                case 1: /* holes */
                    v = ref_rand_int(10) < 3 ? -1 : (int32_t)ref_rand_int(len);
                    break;
                case 2: /* duplicates from a small set */
                    v = (int32_t)ref_rand_int(len < 3 ? len : 3);
                    break;
                case 3: /* page boundaries: the last and first of a page */
                    v = (int32_t)(((ref_rand_int((len + page - 1) / page + 1)) * page) -
                                  (int32_t)ref_rand_int(2));
                    if (v < 0 || v >= len)
                        v = len - 1;
                    break;
                default: /* a permutation prefix: distinct positions, tail -1 */
                    v = k < len ? (int32_t)((k * 7919) % len) : -1;
                    break;
                }
            }
            idx[t * topk + k] = v;
        }
    }
}

/* Compare the backend's o and lse with the oracle; returns o's rel L2. */
static double compare_with_oracle(const ref_problem *p, const char *what)
{
    const mlart_geometry *g = &p->g;
    int64_t H = g->heads, T = p->T, V = g->v_head, L = g->kv_lora, P = g->qk_nope;
    double *o_ref = malloc(sizeof(double) * (size_t)(T * H * V + 1));
    double *lse_ref = malloc(sizeof(double) * (size_t)(H * T + 1));
    mlart_oracle_problem op;
    mlart_oracle_error e;
    mlart_tensor o = ref_problem_o_view(p);
    double kvmax = 0.0;
    ref_problem_oracle(p, &op);
    ck_assert_msg(mlart_oracle_decode_f64(&op, o_ref, lse_ref) == 0, "oracle: %s", mlart_last_error());
    ck_assert(mlart_oracle_compare(&o, o_ref, &e) == 0);
    ck_assert_msg(e.nonfinite == 0 && e.inf_mismatch == 0, "%s: %lld non-finite o values", what,
                  (long long)e.nonfinite);
    ck_assert_msg(e.rel_l2 <= O_REL_L2_BOUND, "%s: o rel L2 %.3e > %.1e (max abs %.3e)", what, e.rel_l2,
                  O_REL_L2_BOUND, e.max_abs);
    if (e.rel_l2 > worst_o_rel)
        worst_o_rel = e.rel_l2;
    /* lse: rounding q_mqa to bf16 (after FP32 accumulation: relative error
     * below 2^-7 per entry) moves each score by at most
     * 2^-7 * scale * sum_l |qlat_l| * max|kv|, so lse moves by no more. */
    for (int64_t i = 0; i < p->num_slots; i++) {
        float row[4096];
        const uint8_t *rec = p->cache.p + (size_t)i * mlart_kv_bytes_per_token(g);
        if (g->kv_format == MLART_KV_FP8_DS_MLA)
            mlart_fp8_ds_mla_decode(rec, (int)L, g->rope, row);
        else
            for (int64_t d = 0; d < L; d++) {
                uint16_t h;
                memcpy(&h, rec + 2 * d, 2);
                row[d] = mlart_bf16_to_f32(h);
            }
        for (int64_t d = 0; d < L; d++)
            kvmax = fmax(kvmax, fabs(row[d]));
    }
    for (int64_t h = 0; h < H; h++)
        for (int64_t t = 0; t < T; t++) {
            double ref = lse_ref[h * T + t], got = ((float *)p->lse.p)[h * T + t], ql1 = 0.0, bound;
            if (isinf(ref)) {
                ck_assert_msg(isinf(got) && got < 0, "%s: lse[%lld][%lld] = %g, want -inf", what,
                              (long long)h, (long long)t, got);
                for (int64_t v = 0; v < V; v++) /* and o is exactly zero there */
                    ck_assert(((uint16_t *)p->o.p)[t * (H * V + p->o_pad) + h * V + v] == 0);
                continue;
            }
            for (int64_t l = 0; l < L; l++) {
                double a = 0.0;
                for (int64_t pp = 0; pp < P; pp++)
                    a += (double)mlart_bf16_to_f32(((uint16_t *)p->q.p)[(t * H + h) * (P + g->rope) + pp]) *
                         (double)mlart_bf16_to_f32(((uint16_t *)p->wk.p)[(h * P + pp) * L + l]);
                ql1 += fabs(a);
            }
            bound = 0x1p-7 * g->softmax_scale * ql1 * kvmax + 1e-6 * (1.0 + fabs(ref));
            ck_assert_msg(!isnan(got) && fabs(got - ref) <= bound, "%s: lse[%lld][%lld] %.9g vs %.9g (bound %.3g)",
                          what, (long long)h, (long long)t, got, ref, bound);
            if (fabs(got - ref) / bound > worst_lse_ratio)
                worst_lse_ratio = fabs(got - ref) / bound;
        }
    free(o_ref);
    free(lse_ref);
    return e.rel_l2;
}

START_TEST(reference_vs_oracle_random)
{
    static const int32_t Hs[] = {1, 3, 11, 16}, Ps[] = {16, 32, 48}, Rs[] = {8, 16, 64},
                         Vs[] = {16, 32, 24}, pages[] = {1, 4, 16, 64}, topks[] = {1, 5, 12, 40, 64},
                         Ts[] = {1, 3, 9};
    int n = 0;
    for (int it = 0; it < 24; it++) {
        ref_problem p;
        mlart_step s;
        char what[160];
        int rc;
        memset(&p, 0, sizeof p);
        p.g.heads = Hs[ref_rand_int(4)];
        p.g.qk_nope = Ps[ref_rand_int(3)];
        p.g.rope = Rs[ref_rand_int(3)];
        p.g.kv_format = it % 2 ? MLART_KV_FP8_DS_MLA : MLART_KV_BF16;
        p.g.kv_lora = p.g.kv_format == MLART_KV_FP8_DS_MLA ? 128 * (int32_t)(1 + ref_rand_int(2))
                                                           : (int32_t[]){32, 40, 128}[ref_rand_int(3)];
        p.g.v_head = Vs[ref_rand_int(3)];
        p.g.page_size = pages[ref_rand_int(4)];
        p.g.topk = topks[ref_rand_int(5)];
        p.g.softmax_scale = (float)(1.0 / sqrt((double)(p.g.qk_nope + p.g.rope)));
        p.T = Ts[it % 3];
        p.B = (int32_t)(1 + ref_rand_int(p.T < 3 ? p.T : 3));
        make_problem(&p, 150);
        snprintf(what, sizeof what, "%s H=%d P=%d R=%d L=%d V=%d page=%d topk=%d T=%d B=%d",
                 mlart_kv_format_name(p.g.kv_format), p.g.heads, p.g.qk_nope, p.g.rope, p.g.kv_lora,
                 p.g.v_head, p.g.page_size, p.g.topk, p.T, p.B);
        ref_problem_poison(&p);
        rc = ref_run_reference(&p, &s);
        ck_assert_msg(rc == 0, "%s: %s", what, mlart_last_error());
        {
            /* bytes of o's storage outside its elements stay poisoned */
            uint8_t *mask = calloc(p.o.bytes + 2 * p.o.guard, 1);
            mlart_tensor o = ref_problem_o_view(&p);
            ref_mark_elements(&p.o, &o, mask);
            ck_assert_msg(ref_count_stray(&p.o, mask) == 0, "%s: o row padding written", what);
            free(mask);
        }
        compare_with_oracle(&p, what);
        ref_problem_free(&p);
        n++;
    }
    printf("reference vs float64 oracle: %d random problems (both formats, holes, all -1 rows, duplicates, "
           "page boundaries, seq_len < topk): worst o rel L2 %.3e (bound %.0e), worst lse error %.2f of "
           "its bound\n",
           n, worst_o_rel, O_REL_L2_BOUND, worst_lse_ratio);
}
END_TEST

/* A small fixed problem used by the bad-input tests. */
static void small_problem(ref_problem *p, mlart_kv_format fmt)
{
    memset(p, 0, sizeof *p);
    p->g = (mlart_geometry){3, 16, 8, fmt == MLART_KV_FP8_DS_MLA ? 128 : 32, 16, 6, 4, fmt, 0.25f};
    p->T = 3;
    p->B = 2;
    make_problem(p, 20);
    for (int t = 0; t < 3; t++) /* every token with at least one valid index */
        ((int32_t *)p->idx.p)[t * 6] = 0;
    ((int32_t *)p->lens.p)[0] = ((int32_t *)p->lens.p)[0] > 0 ? ((int32_t *)p->lens.p)[0] : 1;
    ((int32_t *)p->lens.p)[1] = ((int32_t *)p->lens.p)[1] > 0 ? ((int32_t *)p->lens.p)[1] : 1;
}

#define EXPECT_STEP_FAIL(call, status, needle)                                                    \
    do {                                                                                          \
        int rc_;                                                                                  \
        ref_problem_poison(&p);                                                                   \
        rc_ = (call);                                                                             \
        ck_assert_msg(rc_ == (status), "%s: returned %s, want %s; detail: %s", #call,             \
                      mlart_status_name(rc_), mlart_status_name(status), mlart_last_error());      \
        ck_assert_msg(strstr(mlart_last_error(), (needle)) != NULL,                               \
                      "message \"%s\" does not mention \"%s\"", mlart_last_error(), (needle));     \
        n_bad++;                                                                                  \
    } while (0)

static int all_poisoned(const ref_buf *b)
{
    for (size_t i = 0; i < b->bytes + 2 * b->guard; i++)
        if (b->alloc[i] != REF_POISON)
            return 0;
    return 1;
}

START_TEST(bad_steps_refused)
{
    ref_problem p;
    mlart_step s;
    mlart_oracle_problem op;
    int32_t *idx, *req, *bt, *lens, save;
    int n_bad = 0;
    double o_ref[3 * 3 * 16];
    small_problem(&p, MLART_KV_FP8_DS_MLA);
    idx = (int32_t *)p.idx.p, req = (int32_t *)p.req.p, bt = (int32_t *)p.bt.p;
    lens = (int32_t *)p.lens.p;
    ref_problem_step(&p, &s);
    ck_assert_msg(ref_run_reference(&p, &s) == 0, "%s", mlart_last_error());

    /* index == seq_len: the attend stage refuses it, writes nothing */
    save = idx[1 * 6 + 2];
    idx[1 * 6 + 2] = lens[req[1]];
    EXPECT_STEP_FAIL(mlart_reference_attend_cpu(&s), MLART_ERANGE, "idx[1][2]");
    ck_assert_msg(all_poisoned(&p.attn) && all_poisoned(&p.lse), "refused attend wrote its outputs");
    ref_problem_oracle(&p, &op);
    EXPECT_STEP_FAIL(mlart_oracle_decode_f64(&op, o_ref, NULL), MLART_ERANGE, "idx[1][2]");
    EXPECT_STEP_FAIL(ref_run_reference(&p, &s), MLART_ERANGE, "seq_lens[");
    idx[1 * 6 + 2] = save;
    /* a negative length: both refuse it, even where every index is -1 */
    {
        int32_t keep = lens[0];
        lens[0] = -1;
        EXPECT_STEP_FAIL(mlart_reference_attend_cpu(&s), MLART_ERANGE, "seq_lens[0] = -1 is negative");
        ref_problem_oracle(&p, &op);
        EXPECT_STEP_FAIL(mlart_oracle_decode_f64(&op, o_ref, NULL), MLART_ERANGE,
                         "seq_lens[0] = -1 is negative");
        lens[0] = keep;
    }
    idx[1 * 6 + 2] = -2;
    EXPECT_STEP_FAIL(mlart_reference_attend_cpu(&s), MLART_ERANGE, "= -2");
    idx[1 * 6 + 2] = save;
    /* request id out of range */
    save = req[2];
    req[2] = p.B;
    EXPECT_STEP_FAIL(mlart_reference_attend_cpu(&s), MLART_ERANGE, "req_of_token[2]");
    req[2] = save;
    /* block table entry pointing past the cache */
    save = bt[req[0] * p.max_blocks];
    bt[req[0] * p.max_blocks] = (int32_t)(p.num_slots / p.g.page_size);
    EXPECT_STEP_FAIL(mlart_reference_attend_cpu(&s), MLART_ERANGE, "block_table[");
    bt[req[0] * p.max_blocks] = -1;
    EXPECT_STEP_FAIL(mlart_reference_attend_cpu(&s), MLART_ERANGE, "block_table[");
    bt[req[0] * p.max_blocks] = save;
    ck_assert_msg(mlart_reference_attend_cpu(&s) == 0, "%s", mlart_last_error());

    /* views */
    {
        mlart_step b = s;
        b.q_mqa.shape[2] -= 1;
        EXPECT_STEP_FAIL(mlart_reference_attend_cpu(&b), MLART_ESHAPE, "q_mqa");
        b = s, b.kv_cache.dtype = MLART_DTYPE_BF16;
        EXPECT_STEP_FAIL(mlart_reference_attend_cpu(&b), MLART_EDTYPE, "kv_cache");
        b = s, b.kv_cache.shape[1] = 1152, b.kv_cache.stride[0] = 1152;
        EXPECT_STEP_FAIL(mlart_reference_attend_cpu(&b), MLART_ESHAPE, "kv_cache");
        b = s, b.attn_out.extent -= 2; /* last element one byte short */
        EXPECT_STEP_FAIL(mlart_reference_attend_cpu(&b), MLART_ELAYOUT, "attn_out");
        b = s, b.idx.shape[1] = p.g.topk + 1;
        EXPECT_STEP_FAIL(mlart_reference_attend_cpu(&b), MLART_ESHAPE, "idx");
        b = s, b.lse.dtype = MLART_DTYPE_BF16;
        EXPECT_STEP_FAIL(mlart_reference_attend_cpu(&b), MLART_EDTYPE, "lse");
        b = s, b.seq_lens.shape[0] = p.B + 1;
        EXPECT_STEP_FAIL(mlart_reference_attend_cpu(&b), MLART_ESHAPE, "seq_lens");
        b = s, b.block_table.extent = 4;
        EXPECT_STEP_FAIL(mlart_reference_attend_cpu(&b), MLART_ELAYOUT, "block_table");
        /* outputs over each other or over an input */
        b = s, b.lse.base = b.lse.data = s.attn_out.data, b.lse.extent = s.attn_out.extent;
        EXPECT_STEP_FAIL(mlart_reference_attend_cpu(&b), MLART_ELAYOUT, "attn_out and lse overlap");
        b = s, b.lse.base = b.lse.data = s.idx.data, b.lse.extent = s.idx.extent;
        EXPECT_STEP_FAIL(mlart_reference_attend_cpu(&b), MLART_ELAYOUT, "lse overlaps input idx");
        /* an output whose elements fold onto each other */
        ref_problem_poison(&p);
        b = s, b.attn_out.stride[1] = 0;
        EXPECT_STEP_FAIL(mlart_reference_attend_cpu(&b), MLART_ELAYOUT, "attn_out has overlapping elements");
        b = s, b.lse.stride[0] = 1; /* [H,T]: head h + 1 starts at token 1 of head h */
        EXPECT_STEP_FAIL(mlart_reference_attend_cpu(&b), MLART_ELAYOUT, "lse has overlapping elements");
        ck_assert_msg(all_poisoned(&p.attn) && all_poisoned(&p.lse), "refused attend wrote its outputs");
        b = s, b.lse.data = NULL, b.lse.base = NULL, b.lse.extent = 0; /* no lse: nothing to overlap */
        ck_assert_msg(mlart_reference_attend_cpu(&b) == 0, "%s", mlart_last_error());
        b = s, b.attn_out.device = 0, b.device = 0;
        EXPECT_STEP_FAIL(mlart_reference_attend_cpu(&b), MLART_EINVAL, "device");
        b = s, b.q_nope.stride[2] = 2, b.q_nope.shape[2] = p.g.qk_nope / 2; /* inner stride 1 needed */
        {
            const mlart_backend_vtable *vt = mlart_backend_reference_vtable();
            mlart_backend_init init;
            void *st = NULL;
            memset(&init, 0, sizeof init);
            init.struct_size = sizeof init, init.device = -1, init.geom = p.g, init.error = mlart_set_error;
            ck_assert(vt->create(&init, &st) == 0);
            EXPECT_STEP_FAIL(vt->absorb_query(st, &b, NULL), MLART_ELAYOUT, "inner stride");
            b = s, b.o.shape[1] += 1;
            EXPECT_STEP_FAIL(vt->v_up(st, &b, NULL), MLART_ESHAPE, "o [T,H*V]");
            b = s, b.w_uv.stride[1] = 1, b.w_uv.stride[2] = p.g.kv_lora; /* strided, not dense */
            EXPECT_STEP_FAIL(vt->v_up(st, &b, NULL), MLART_ELAYOUT, "w [H,L,V]");
            b = s, b.geom.heads += 1;
            EXPECT_STEP_FAIL(vt->attend(st, &b, NULL), MLART_EINVAL, "geometry");
            b = s, b.struct_size = 8;
            EXPECT_STEP_FAIL(vt->attend(st, &b, NULL), MLART_EABI, "mlart_step");
            vt->destroy(st);
            vt->destroy(NULL);
            /* an older struct that ends before its error field: not called */
            init.struct_size = (uint32_t)offsetof(mlart_backend_init, error);
            init.error = (mlart_error_fn)(uintptr_t)16;
            st = NULL;
            EXPECT_STEP_FAIL(vt->create(&init, &st), MLART_EABI, "mlart_backend_init");
            ck_assert(st == NULL);
            init.struct_size = sizeof init, init.error = mlart_set_error;
            init.geom.kv_lora = 100; /* fp8 needs L % 128 == 0 */
            st = NULL;
            EXPECT_STEP_FAIL(vt->create(&init, &st), MLART_EINVAL, "128");
            ck_assert(st == NULL);
#ifndef MLART_WITH_CUDA
            init.geom = p.g, init.device = 0;
            EXPECT_STEP_FAIL(vt->create(&init, &st), MLART_ENOTSUP, "without CUDA");
            ck_assert(st == NULL);
#endif
        }
    }
    ref_problem_free(&p);
    printf("bad steps: %d refused with the right status and a message naming the index or view; "
           "refused attend leaves attn_out and lse untouched\n",
           n_bad);
}
END_TEST

START_TEST(contract)
{
    const mlart_backend_vtable *vt = mlart_backend_reference_vtable();
    ck_assert_uint_eq(vt->abi_version, MLART_BACKEND_ABI_VERSION);
    ck_assert_uint_eq(vt->struct_size, sizeof(mlart_backend_vtable));
    ck_assert_str_eq(vt->name, "reference");
    ck_assert_uint_eq(vt->contract.query_bmm, MLART_QBMM_SAFE_OP);
    ck_assert_uint_eq(vt->contract.weights, MLART_W_DENSE);
    ck_assert_uint_eq(vt->contract.output, MLART_OUT_HEAD_MAJOR);
    ck_assert_uint_eq(vt->contract.kv_formats,
                      MLART_KV_FORMAT_BIT(MLART_KV_BF16) | MLART_KV_FORMAT_BIT(MLART_KV_FP8_DS_MLA));
    ck_assert_uint_eq(vt->contract.max_heads, 0);
    ck_assert_uint_eq(vt->contract.max_topk, 0);
    ck_assert_uint_eq(vt->contract.head_multiple, 1);
    ck_assert_uint_eq(vt->contract.tail_pad, 0);
    ck_assert_uint_eq(vt->contract.graph_safe, 1);
#ifdef MLART_WITH_CUDA
    ck_assert_uint_eq(vt->contract.devices, MLART_DEV_HOST | MLART_DEV_CUDA);
#else
    ck_assert_uint_eq(vt->contract.devices, MLART_DEV_HOST);
#endif
    ck_assert(vt->create && vt->destroy && vt->plan && vt->absorb_query && vt->attend && vt->v_up);
    printf("contract: safe-op query, dense weights, head-major output, bf16+fp8_ds_mla, no limits, "
           "tail_pad 0, graph_safe\n");
}
END_TEST

/* Address space for a view that must never be read: any access faults. */
static void *no_access(size_t bytes)
{
    void *p = mmap(NULL, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    ck_assert(p != MAP_FAILED);
    return p;
}

/* A host view of `extent` bytes at p. */
static mlart_tensor host_view(void *p, size_t extent, mlart_dtype dt, int ndim,
                              const int64_t *shape, const int64_t *stride)
{
    mlart_tensor t;
    memset(&t, 0, sizeof t);
    t.data = p, t.base = p, t.extent = extent, t.dtype = dt, t.ndim = ndim, t.device = -1;
    for (int i = 0; i < ndim; i++)
        t.shape[i] = shape[i], t.stride[i] = stride[i];
    return t;
}

/* A host step of T = B = 1 over g whose q_mqa and one-row cache are
 * `region` (never read) and whose idx entries are all 0 (stride 0). */
static void huge_step(const mlart_geometry *g, void *region, mlart_step *s)
{
    static int32_t zero = 0, one = 1;
    static uint16_t attn[128];
    static float lse;
    const int64_t D = (int64_t)g->kv_lora + g->rope, L = g->kv_lora;
    const int64_t bpt = (int64_t)mlart_kv_bytes_per_token(g);
    int64_t sh[3], st[3] = {0, 0, 0};
    memset(s, 0, sizeof *s);
    s->struct_size = sizeof *s, s->geom = *g, s->device = -1, s->T = 1, s->B = 1;
    sh[0] = sh[1] = 1, sh[2] = D, st[0] = st[1] = D, st[2] = 1;
    s->q_mqa = host_view(region, (size_t)D * 2, MLART_DTYPE_BF16, 3, sh, st);
    sh[1] = bpt, st[0] = bpt, st[1] = 1;
    s->kv_cache = host_view(region, (size_t)bpt, MLART_DTYPE_U8, 2, sh, st);
    sh[1] = g->topk, st[0] = st[1] = 0;
    s->idx = host_view(&zero, 4, MLART_DTYPE_I32, 2, sh, st);
    s->req_of_token = host_view(&zero, 4, MLART_DTYPE_I32, 1, sh, st);
    s->seq_lens = host_view(&one, 4, MLART_DTYPE_I32, 1, sh, st);
    sh[1] = 1;
    s->block_table = host_view(&zero, 4, MLART_DTYPE_I32, 2, sh, st);
    s->lse = host_view(&lse, 4, MLART_DTYPE_F32, 2, sh, st);
    sh[2] = L, st[0] = st[1] = L, st[2] = 1;
    s->attn_out = host_view(attn, sizeof attn, MLART_DTYPE_BF16, 3, sh, st);
}

/* Geometries the checks accept whose scratch is past SIZE_MAX: the host
 * path's 8*(topk+L) + 4*(topk+1)*(L+R) bytes at top-k 2^31-1 and L+R = 2^31
 * (it wrapped to 16 GiB, and the gathered rows ran past it), the oracle's
 * 8*topk*(L+R) at top-k*(L+R) = 2^61 + 8 (it wrapped to 64 bytes).  plan,
 * attend and the oracle refuse them before reading a tensor. */
START_TEST(scratch_past_size_max)
{
    int n_bad = 0;
    ref_problem p; /* for EXPECT_STEP_FAIL's poisoning: a tiny problem */
    mlart_geometry g = {1, 16, (int32_t)((1u << 31) - 128), 128, 16, INT32_MAX, 1, MLART_KV_BF16,
                        0.125f};
    const mlart_backend_vtable *vt = mlart_backend_reference_vtable();
    mlart_backend_init init;
    mlart_plan plan;
    mlart_step s;
    mlart_oracle_problem op;
    void *st = NULL, *region = no_access((size_t)1 << 32);
    size_t ws = 12345;
    double o[16];
    small_problem(&p, MLART_KV_BF16);
    ck_assert_uint_eq(mlart_reference_attend_cpu_workspace(&g), 0);
    memset(&init, 0, sizeof init);
    init.struct_size = sizeof init, init.device = -1, init.geom = g, init.error = mlart_set_error;
    ck_assert_msg(vt->create(&init, &st) == 0, "%s", mlart_last_error());
    memset(&plan, 0, sizeof plan);
    plan.struct_size = sizeof plan, plan.geom = g, plan.device = -1;
    plan.max_tokens = plan.max_requests = plan.max_blocks_per_req = 1, plan.num_slots = 1;
    EXPECT_STEP_FAIL(vt->plan(st, &plan, &ws), MLART_ERANGE, "SIZE_MAX");
    ck_assert_uint_eq(ws, 12345); /* out-parameter untouched */
    huge_step(&g, region, &s);
    EXPECT_STEP_FAIL(vt->attend(st, &s, NULL), MLART_ERANGE, "top-k 2147483647");
    vt->destroy(st);

    g.topk = 1073807362, g.rope = 2147352580 - 128; /* topk*(L+R) = 2^61 + 8 */
    huge_step(&g, region, &s);
    memset(&op, 0, sizeof op);
    op.geom = g, op.T = 1, op.B = 1, op.q = s.q_mqa, op.kv_cache = s.kv_cache, op.idx = s.idx;
    op.q.shape[2] = (int64_t)g.qk_nope + g.rope; /* [1,1,P+R] inside the same region */
    op.req_of_token = s.req_of_token, op.seq_lens = s.seq_lens, op.block_table = s.block_table;
    {
        int64_t sh[3] = {1, 16, 128}, sd[3] = {0, 0, 0}; /* one value, broadcast */
        op.w_uk_t = host_view(s.attn_out.data, 2, MLART_DTYPE_BF16, 3, sh, sd);
        sh[1] = 128, sh[2] = 16;
        op.w_uv = host_view(s.attn_out.data, 2, MLART_DTYPE_BF16, 3, sh, sd);
    }
    EXPECT_STEP_FAIL(mlart_oracle_decode_f64(&op, o, NULL), MLART_ERANGE, "SIZE_MAX");
    munmap(region, (size_t)1 << 32);
    ref_problem_free(&p);
}
END_TEST

int main(void)
{
    Suite *su = suite_create("reference_backend");
    TCase *tc = tcase_create("backend");
    ref_seed_init("test_ref_backend");
    tcase_set_timeout(tc, 240);
    tcase_add_test(tc, contract);
    tcase_add_test(tc, reference_vs_oracle_random);
    tcase_add_test(tc, bad_steps_refused);
    tcase_add_test(tc, scratch_past_size_max);
    suite_add_tcase(su, tc);
    return check_run(su, CK_FORK_GETENV);
}
