/* CPU twins of ops/ against naive double loops, on awkward shapes and strided
 * views, with every byte outside the output elements checked untouched; the
 * cache writer against a brute-force e4m3 encoder; the CUDA ops' host-side
 * choices (the KV write's path, the query absorption's PDL launch); and the
 * operand checks against bad views. */
#include <check.h>

#include "check_run.h"
#include "ops/bmm_cuda.h"
#include "ops/kv_write_cuda.h"
#include "ops/ops.h"
#include "tests/reference/ref_util.h"

static const int64_t Ts[] = {1, 3, 9, 75};
static const int64_t Hs[] = {1, 11, 16};

/* |y - exact| bound for an FP32 sum of n exact products then one bf16 RNE:
 * gamma_n * S for the sum, then 2^-8 relative for the rounding. */
static double bmm_bound(double exact, double S, int64_t n)
{
    double u = 0x1p-24, g = (double)n * u / (1.0 - (double)n * u);
    return g * S + 0x1p-8 * (fabs(exact) + g * S) + 1e-30;
}

static void run_query_bmm(int64_t H, int64_t T, int64_t P, int64_t L, int64_t R, int pad, int *worst_ok)
{
    /* q [T,H,P+R] with padded rows; q_mqa [T,H,L+R] with padded rows, so
     * the output views have gaps that must stay poisoned. */
    int64_t qrow = P + R + pad, mrow = L + R + pad;
    ref_buf qb = ref_buf_new((size_t)(T * H * qrow) * 2);
    ref_buf wb = ref_buf_new((size_t)(H * P * L) * 2);
    ref_buf mb = ref_buf_new((size_t)(T * H * mrow) * 2);
    uint8_t *mask = calloc(mb.bytes + 2 * mb.guard, 1);
    int64_t sh[3], st[3];
    mlart_tensor a, w, out, pe_in, pe_out;
    int64_t exact_round = 0, total = 0;
    uint16_t *q = (uint16_t *)qb.p, *wp = (uint16_t *)wb.p;
    for (int64_t i = 0; i < T * H * qrow; i++)
        q[i] = ref_rand_bf16(2.0);
    for (int64_t i = 0; i < H * P * L; i++)
        wp[i] = ref_rand_bf16(0.5);
    sh[0] = H, sh[1] = T, sh[2] = P, st[0] = qrow, st[1] = H * qrow, st[2] = 1;
    a = ref_view(&qb, MLART_DTYPE_BF16, 0, 3, sh, st);
    sh[0] = T, sh[1] = H, sh[2] = R, st[0] = H * qrow, st[1] = qrow, st[2] = 1;
    pe_in = ref_view(&qb, MLART_DTYPE_BF16, P, 3, sh, st);
    sh[0] = H, sh[1] = P, sh[2] = L, st[0] = P * L, st[1] = L, st[2] = 1;
    w = ref_view(&wb, MLART_DTYPE_BF16, 0, 3, sh, st);
    sh[0] = H, sh[1] = T, sh[2] = L, st[0] = mrow, st[1] = H * mrow, st[2] = 1;
    out = ref_view(&mb, MLART_DTYPE_BF16, 0, 3, sh, st);
    sh[0] = T, sh[1] = H, sh[2] = R, st[0] = H * mrow, st[1] = mrow, st[2] = 1;
    pe_out = ref_view(&mb, MLART_DTYPE_BF16, L, 3, sh, st);
    ref_mark_elements(&mb, &out, mask);
    ref_mark_elements(&mb, &pe_out, mask);

    ck_assert_msg(mlart_query_bmm_cpu(&a, &w, &out, &pe_in, &pe_out) == 0, "query_bmm_cpu: %s",
                  mlart_last_error());
    ck_assert_msg(ref_count_stray(&mb, mask) == 0,
                  "query_bmm H=%lld T=%lld: %zu bytes outside the outputs changed", (long long)H,
                  (long long)T, ref_count_stray(&mb, mask));
    for (int64_t h = 0; h < H; h++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t l = 0; l < L; l++) {
                double ex = 0.0, S = 0.0;
                uint16_t yb = ((uint16_t *)mb.p)[t * H * mrow + h * mrow + l];
                double y = mlart_bf16_to_f32(yb);
                for (int64_t p = 0; p < P; p++) {
                    double x = (double)mlart_bf16_to_f32(q[t * H * qrow + h * qrow + p]) *
                               (double)mlart_bf16_to_f32(wp[h * P * L + p * L + l]);
                    ex += x;
                    S += fabs(x);
                }
                ck_assert_msg(!isnan(y), "NaN in query_bmm output");
                ck_assert_msg(fabs(y - ex) <= bmm_bound(ex, S, P),
                              "query_bmm [%lld,%lld,%lld]: %.9g vs exact %.9g", (long long)h,
                              (long long)t, (long long)l, y, ex);
                exact_round += yb == mlart_f64_to_bf16(ex);
                total++;
            }
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++)
            ck_assert(memcmp((uint16_t *)mb.p + t * H * mrow + h * mrow + L,
                             q + t * H * qrow + h * qrow + P, (size_t)R * 2) == 0);
    /* FP32 accumulation moves the result off the correctly rounded value
     * only near a rounding tie: rare. */
    ck_assert_msg(exact_round * 100 >= total * 99, "query_bmm: only %lld of %lld correctly rounded",
                  (long long)exact_round, (long long)total);
    *worst_ok += 1;
    free(mask);
    ref_buf_free(&qb);
    ref_buf_free(&wb);
    ref_buf_free(&mb);
}

START_TEST(query_bmm_vs_naive)
{
    int n = 0;
    for (size_t i = 0; i < sizeof Ts / sizeof Ts[0]; i++)
        for (size_t j = 0; j < sizeof Hs / sizeof Hs[0]; j++) {
            int64_t P = (int64_t[]){16, 24, 128}[ref_rand_int(3)];
            int64_t L = (int64_t[]){32, 40, 512}[ref_rand_int(3)];
            int64_t R = (int64_t[]){8, 64}[ref_rand_int(2)];
            run_query_bmm(Hs[j], Ts[i], P, L, R, (int)ref_rand_int(3) * 5, &n);
        }
    printf("query_bmm_cpu: %d shapes (T 1,3,9,75 x H 1,11,16, strided q/q_mqa views) within the FP32+bf16 "
           "bound of the exact sum, pe copied, no stray byte\n",
           n);
}
END_TEST

static void run_v_up(int64_t H, int64_t T, int64_t L, int64_t V, int pad)
{
    /* x head-major [H,T,L] with padded rows; o [T,H*V] with padded rows */
    int64_t xrow = L + pad, orow = H * V + pad;
    ref_buf xb = ref_buf_new((size_t)(H * T * xrow) * 2);
    ref_buf wb = ref_buf_new((size_t)(H * L * V) * 2);
    ref_buf ob = ref_buf_new((size_t)(T * orow) * 2);
    uint8_t *mask = calloc(ob.bytes + 2 * ob.guard, 1);
    int64_t sh[3], st[3];
    mlart_tensor x, w, o;
    uint16_t *xp = (uint16_t *)xb.p, *wp = (uint16_t *)wb.p;
    for (int64_t i = 0; i < H * T * xrow; i++)
        xp[i] = ref_rand_bf16(1.0);
    for (int64_t i = 0; i < H * L * V; i++)
        wp[i] = ref_rand_bf16(0.3);
    sh[0] = H, sh[1] = T, sh[2] = L, st[0] = T * xrow, st[1] = xrow, st[2] = 1;
    x = ref_view(&xb, MLART_DTYPE_BF16, 0, 3, sh, st);
    sh[0] = H, sh[1] = L, sh[2] = V, st[0] = L * V, st[1] = V, st[2] = 1;
    w = ref_view(&wb, MLART_DTYPE_BF16, 0, 3, sh, st);
    sh[0] = H, sh[1] = T, sh[2] = V, st[0] = V, st[1] = orow, st[2] = 1;
    o = ref_view(&ob, MLART_DTYPE_BF16, 0, 3, sh, st);
    ref_mark_elements(&ob, &o, mask);
    ck_assert_msg(mlart_v_up_bmm_cpu(&x, &w, &o) == 0, "v_up_bmm_cpu: %s", mlart_last_error());
    ck_assert_msg(ref_count_stray(&ob, mask) == 0, "v_up H=%lld T=%lld: stray bytes", (long long)H,
                  (long long)T);
    for (int64_t h = 0; h < H; h++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t v = 0; v < V; v++) {
                double ex = 0.0, S = 0.0, y;
                for (int64_t l = 0; l < L; l++) {
                    double p = (double)mlart_bf16_to_f32(xp[h * T * xrow + t * xrow + l]) *
                               (double)mlart_bf16_to_f32(wp[h * L * V + l * V + v]);
                    ex += p;
                    S += fabs(p);
                }
                y = mlart_bf16_to_f32(((uint16_t *)ob.p)[t * orow + h * V + v]);
                ck_assert_msg(!isnan(y) && fabs(y - ex) <= bmm_bound(ex, S, L),
                              "v_up [%lld,%lld,%lld]: %.9g vs exact %.9g", (long long)h, (long long)t,
                              (long long)v, y, ex);
            }
    free(mask);
    ref_buf_free(&xb);
    ref_buf_free(&wb);
    ref_buf_free(&ob);
}

START_TEST(v_up_vs_naive)
{
    int n = 0;
    for (size_t i = 0; i < sizeof Ts / sizeof Ts[0]; i++)
        for (size_t j = 0; j < sizeof Hs / sizeof Hs[0]; j++, n++)
            run_v_up(Hs[j], Ts[i], (int64_t[]){32, 96, 512}[ref_rand_int(3)],
                     (int64_t[]){16, 24, 128}[ref_rand_int(3)], (int)ref_rand_int(3) * 3);
    printf("v_up_bmm_cpu: %d shapes into strided o[T,H*V] within the FP32+bf16 bound, no stray byte\n", n);
}
END_TEST

/* Brute force: the finite e4m3 code nearest to x, ties to the even code. */
static uint8_t e4m3_brute(float x)
{
    int best = -1;
    double bd = INFINITY;
    for (int c = 0; c < 256; c++) {
        double v, d;
        if ((c & 0x7f) == 0x7f)
            continue;
        v = mlart_e4m3_to_f32((uint8_t)c);
        if ((c & 0x80) != (signbit(x) ? 0x80 : 0))
            continue; /* keep the sign, so -0 stays -0 */
        d = fabs(v - (double)x);
        if (d < bd || (d == bd && !(c & 1))) {
            bd = d;
            best = c;
        }
    }
    return (uint8_t)best;
}

/* The smallest power of two s with 448*s >= amax, by walking exponents. */
static double scale_brute(double amax)
{
    if (amax == 0.0)
        return 1.0;
    for (int e = -160; e < 140; e++)
        if (ldexp(448.0, e) >= amax)
            return ldexp(1.0, e);
    return NAN;
}

static void run_kv_write(mlart_kv_format fmt, int L, int R, int64_t N, int64_t num_slots)
{
    mlart_geometry g = {1, 16, R, L, 16, 8, 4, fmt, 0.125f};
    size_t bpt = mlart_kv_bytes_per_token(&g);
    int64_t lrow = L + R + 3; /* padded latent rows */
    ref_buf cb = ref_buf_new((size_t)num_slots * bpt);
    ref_buf lb = ref_buf_new((size_t)(N * lrow) * 2);
    ref_buf sb = ref_buf_new((size_t)N * 8);
    uint8_t *mask = calloc(cb.bytes + 2 * cb.guard, 1);
    int64_t sh[2], st[2];
    mlart_tensor cache, lat, slots;
    uint16_t *lp = (uint16_t *)lb.p;
    int32_t *sp = (int32_t *)sb.p;
    int64_t *perm = malloc(sizeof *perm * (size_t)num_slots);
    for (int64_t i = 0; i < num_slots; i++)
        perm[i] = i;
    for (int64_t i = num_slots - 1; i > 0; i--) {
        int64_t j = ref_rand_int(i + 1), x = perm[i];
        perm[i] = perm[j], perm[j] = x;
    }
    for (int64_t n = 0; n < N; n++) {
        int kind = (int)ref_rand_int(5);
        for (int i = 0; i < L + R; i++) {
            double amp = kind == 0 ? 1e-3 : kind == 1 ? 3e3 : 4.0;
            lp[n * lrow + i] = ref_rand_bf16(amp);
        }
        if (kind == 2 && L >= 128) /* an all-zero tile, with a negative zero in it */
            for (int i = 0; i < 128; i++)
                lp[n * lrow + 128 * (n % (L / 128)) + i] = i == 5 ? 0x8000 : 0;
        if (kind == 3) /* values exactly at 448 * 2^k */
            lp[n * lrow + 7] = mlart_f32_to_bf16(448.0f * 0.25f);
        /* every 7th row skipped with -1; the others to distinct slots */
        sp[2 * n] = (n % 7 == 3) ? -1 : (int32_t)perm[n % num_slots];
    }
    sh[0] = num_slots, sh[1] = (int64_t)bpt, st[0] = (int64_t)bpt, st[1] = 1;
    cache = ref_view(&cb, MLART_DTYPE_U8, 0, 2, sh, st);
    sh[0] = N, sh[1] = L + R, st[0] = lrow, st[1] = 1;
    lat = ref_view(&lb, MLART_DTYPE_BF16, 0, 2, sh, st);
    sh[0] = N, st[0] = 2; /* strided slots */
    slots = ref_view(&sb, MLART_DTYPE_I32, 0, 1, sh, st);
    for (int64_t n = 0; n < N; n++)
        if (sp[2 * n] >= 0)
            memset(mask + cb.guard + (size_t)sp[2 * n] * bpt, 1, bpt);
    ck_assert_msg(mlart_kv_write_cpu(&g, &cache, &lat, &slots) == 0, "kv_write_cpu: %s",
                  mlart_last_error());
    ck_assert_msg(ref_count_stray(&cb, mask) == 0, "kv_write: bytes outside the written rows changed");
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *row = lp + n * lrow;
        const uint8_t *rec;
        if (sp[2 * n] < 0)
            continue;
        rec = cb.p + (size_t)sp[2 * n] * bpt;
        if (fmt == MLART_KV_BF16) {
            ck_assert(memcmp(rec, row, bpt) == 0);
            continue;
        }
        for (int tile = 0; tile < L / 128; tile++) {
            double amax = 0.0, s;
            float got;
            for (int i = 0; i < 128; i++)
                amax = fmax(amax, fabs(mlart_bf16_to_f32(row[tile * 128 + i])));
            s = scale_brute(amax);
            memcpy(&got, rec + L + 4 * tile, 4);
            ck_assert_msg((double)got == s, "tile scale %g, want %g (amax %g)", (double)got, s, amax);
            for (int i = 0; i < 128; i++) {
                uint8_t want = e4m3_brute((float)((double)mlart_bf16_to_f32(row[tile * 128 + i]) / s));
                ck_assert_msg(rec[tile * 128 + i] == want, "e4m3 byte %#x, want %#x (value %g, scale %g)",
                              rec[tile * 128 + i], want, (double)mlart_bf16_to_f32(row[tile * 128 + i]), s);
            }
        }
        ck_assert(memcmp(rec + L + 4 * (L / 128), row + L, (size_t)R * 2) == 0);
    }
    free(perm);
    free(mask);
    ref_buf_free(&cb);
    ref_buf_free(&lb);
    ref_buf_free(&sb);
}

START_TEST(kv_write_vs_brute_force)
{
    run_kv_write(MLART_KV_FP8_DS_MLA, 512, 64, 75, 80);
    run_kv_write(MLART_KV_FP8_DS_MLA, 256, 8, 9, 9);
    run_kv_write(MLART_KV_BF16, 32, 8, 11, 16);
    run_kv_write(MLART_KV_BF16, 512, 64, 3, 5);
    printf("kv_write_cpu: fp8_ds_mla records equal a brute-force encoder (scales by exponent walk, "
           "nearest-even e4m3 by search, zero tiles scale 1.0); bf16 rows copied; -1 skipped; no stray byte\n");
}
END_TEST

/* The CUDA cache write's path by row count, alignment and the device's
 * cooperative launch (ops/kv_write_cuda.h; the choice is host code, so it
 * is checked here, without a device). */
START_TEST(kv_write_cuda_path_choice)
{
    /* a decode step's rows: the scan kernel, whatever the device */
    ck_assert_int_eq(mlart_kvw_pick(MLART_KVW_AUTO, 1, 1, 1, 1), MLART_KVW_SCAN);
    ck_assert_int_eq(mlart_kvw_pick(MLART_KVW_AUTO, MLART_KVW_SCAN_MAX_FP8, 1, 1, 1), MLART_KVW_SCAN);
    ck_assert_int_eq(mlart_kvw_pick(MLART_KVW_AUTO, MLART_KVW_SCAN_MAX_BF16, 0, 1, 1), MLART_KVW_SCAN);
    /* above the limits the claim kernel, with aligned rows and cooperative launch */
    ck_assert_int_eq(mlart_kvw_pick(MLART_KVW_AUTO, MLART_KVW_SCAN_MAX_FP8 + 1, 1, 1, 1), MLART_KVW_CLAIM);
    ck_assert_int_eq(mlart_kvw_pick(MLART_KVW_AUTO, MLART_KVW_SCAN_MAX_BF16 + 1, 0, 1, 1), MLART_KVW_CLAIM);
    ck_assert_int_eq(mlart_kvw_pick(MLART_KVW_AUTO, MLART_KVW_SCAN_MAX_BF16 + 1, 1, 1, 1), MLART_KVW_SCAN);
    /* else the scan kernel, at any row count */
    ck_assert_int_eq(mlart_kvw_pick(MLART_KVW_AUTO, 1 << 20, 0, 0, 1), MLART_KVW_SCAN);
    ck_assert_int_eq(mlart_kvw_pick(MLART_KVW_AUTO, 1 << 20, 0, 1, 0), MLART_KVW_SCAN);
    ck_assert_int_eq(mlart_kvw_pick(MLART_KVW_AUTO, 1 << 20, 1, 1, 0), MLART_KVW_SCAN);
    /* asked for by name: taken as asked, or refused where it cannot run */
    ck_assert_int_eq(mlart_kvw_pick(MLART_KVW_SCAN, 1 << 20, 0, 1, 1), MLART_KVW_SCAN);
    ck_assert_int_eq(mlart_kvw_pick(MLART_KVW_CLAIM, 1, 0, 1, 1), MLART_KVW_CLAIM);
    ck_assert_int_eq(mlart_kvw_pick(MLART_KVW_CLAIM, 1 << 20, 0, 1, 0), -1);
    ck_assert_int_eq(mlart_kvw_pick(MLART_KVW_CLAIM, 1 << 20, 0, 0, 1), -1);
}
END_TEST

START_TEST(query_pdl_launch_choice)
{
    /* N = L = 512; the direct kernel up to 4 MiB of weights: with PDL */
    ck_assert_int_eq(mlart_query_pdl_launch(16, 1, 128, 512, MLART_BMM_DIRECT), 1);
    ck_assert_int_eq(mlart_query_pdl_launch(16, 16, 192, 512, MLART_BMM_DIRECT), 1);
    ck_assert_int_eq(mlart_query_pdl_launch(32, 1, 128, 512, MLART_BMM_DIRECT), 1); /* exactly 4 MiB */
    ck_assert_int_eq(mlart_query_pdl_launch(16, 1, 128, 512, MLART_BMM_AUTO), 1);   /* path not worked out */
    /* above: plainly */
    ck_assert_int_eq(mlart_query_pdl_launch(33, 1, 128, 512, MLART_BMM_DIRECT), 0);
    ck_assert_int_eq(mlart_query_pdl_launch(128, 4, 128, 512, MLART_BMM_DIRECT), 0);
    /* the slice kernel alike */
    ck_assert_int_eq(mlart_query_pdl_launch(32, 4, 128, 512, MLART_BMM_SLICE), 1);
    ck_assert_int_eq(mlart_query_pdl_launch(16, 1, 192, 512, MLART_BMM_SLICE), 1);
    ck_assert_int_eq(mlart_query_pdl_launch(128, 1, 192, 512, MLART_BMM_SLICE), 0);
    /* other paths over 4 MiB: with PDL */
    ck_assert_int_eq(mlart_query_pdl_launch(128, 4, 128, 512, MLART_BMM_RING), 1);
    ck_assert_int_eq(mlart_query_pdl_launch(128, 1, 192, 512, MLART_BMM_SWAP), 1);
    /* 64-127 heads, P = 192, 33-64 rows: plainly, whatever the path */
    for (int64_t h = 64; h < 128; h += 21)
        for (int64_t t = 33; t <= 64; t += 31) {
            ck_assert_int_eq(mlart_query_pdl_launch(h, t, 192, 512, MLART_BMM_SWAP), 0);
            ck_assert_int_eq(mlart_query_pdl_launch(h, t, 192, 512, MLART_BMM_RING), 0);
        }
    /* just outside that box: with PDL */
    ck_assert_int_eq(mlart_query_pdl_launch(64, 32, 192, 512, MLART_BMM_RING), 1);
    ck_assert_int_eq(mlart_query_pdl_launch(64, 65, 192, 512, MLART_BMM_RING), 1);
    ck_assert_int_eq(mlart_query_pdl_launch(63, 64, 192, 512, MLART_BMM_RING), 1);
    ck_assert_int_eq(mlart_query_pdl_launch(128, 64, 192, 512, MLART_BMM_SWAP), 1);
    ck_assert_int_eq(mlart_query_pdl_launch(64, 64, 128, 512, MLART_BMM_SWAP), 1);
}
END_TEST

START_TEST(tile_scale_exact)
{
    /* exact powers of 448 and their neighbours, subnormal bf16 amax, big amax */
    for (int k = -141; k <= 119; k++) {
        float a = ldexpf(448.0f, k);
        float up = nextafterf(a, INFINITY), dn = nextafterf(a, 0.0f);
        if (!isfinite(a) || a == 0.0f)
            continue;
        ck_assert_msg(mlart_fp8_ds_mla_tile_scale(a) == (float)scale_brute(a), "scale(448*2^%d)", k);
        ck_assert_msg(mlart_fp8_ds_mla_tile_scale(up) == (float)scale_brute(up), "scale(448*2^%d+)", k);
        ck_assert_msg(mlart_fp8_ds_mla_tile_scale(dn) == (float)scale_brute(dn), "scale(448*2^%d-)", k);
    }
    for (int i = 0; i < 20000; i++) {
        uint16_t h = (uint16_t)(ref_rand_u64() & 0x7f7f); /* finite positive bf16 */
        float a = mlart_bf16_to_f32(h);
        ck_assert_msg(mlart_fp8_ds_mla_tile_scale(a) == (float)scale_brute(a), "scale(%a)", (double)a);
    }
    ck_assert(mlart_fp8_ds_mla_tile_scale(0.0f) == 1.0f);
    ck_assert(isnan(mlart_fp8_ds_mla_tile_scale(INFINITY)));
    printf("tile scale: exact at 448*2^k and its float neighbours (k -141..119) and on 20000 random "
           "bf16 amax; amax 0 -> 1.0\n");
}
END_TEST

/* ---- bad input -------------------------------------------------------------- */

#define EXPECT_FAIL(call, status, needle)                                                        \
    do {                                                                                         \
        int rc_ = (call);                                                                        \
        ck_assert_msg(rc_ == (status), "%s returned %d (%s), want %d; detail: %s", #call, rc_,    \
                      mlart_status_name(rc_), (status), mlart_last_error());                      \
        ck_assert_msg(strstr(mlart_last_error(), (needle)) != NULL,                              \
                      "%s: message \"%s\" does not mention \"%s\"", #call, mlart_last_error(),     \
                      (needle));                                                                 \
        n_bad++;                                                                                 \
    } while (0)

/* The query absorption's inputs over a dense q [T,H,P+R] and weight
 * [H,P,L]: the strided [H,T,P] view, the rope part [T,H,R], the weight. */
static void qabs_inputs(ref_buf *qb, ref_buf *wb, int64_t H, int64_t T, int64_t P, int64_t L,
                        int64_t R, mlart_tensor *a, mlart_tensor *pe_in, mlart_tensor *w)
{
    int64_t sh[3] = {H, T, P}, st[3] = {P + R, H * (P + R), 1};
    *a = ref_view(qb, MLART_DTYPE_BF16, 0, 3, sh, st);
    sh[0] = T, sh[1] = H, sh[2] = R, st[0] = H * (P + R), st[1] = P + R, st[2] = 1;
    *pe_in = ref_view(qb, MLART_DTYPE_BF16, P, 3, sh, st);
    sh[0] = H, sh[1] = P, sh[2] = L, st[0] = P * L, st[1] = L, st[2] = 1;
    *w = ref_view(wb, MLART_DTYPE_BF16, 0, 3, sh, st);
}

START_TEST(checks_refuse_bad_views)
{
    enum { H = 2, T = 3, P = 16, L = 32, R = 8, V = 16 };
    int n_bad = 0;
    ref_buf qb = ref_buf_new(T * H * (P + R) * 2), wb = ref_buf_new(H * P * L * 2),
            mb = ref_buf_new(T * H * (L + R) * 2), xb = ref_buf_new(H * T * L * 2),
            vb = ref_buf_new(H * L * V * 2), ob = ref_buf_new(T * H * V * 2);
    int64_t sh[3], st[3];
    mlart_tensor a, w, out, pe_in, pe_out, bad, x, wv, o;
    qabs_inputs(&qb, &wb, H, T, P, L, R, &a, &pe_in, &w);
    sh[0] = H, sh[1] = T, sh[2] = L, st[0] = L + R, st[1] = H * (L + R), st[2] = 1;
    out = ref_view(&mb, MLART_DTYPE_BF16, 0, 3, sh, st);
    sh[0] = T, sh[1] = H, sh[2] = R, st[0] = H * (L + R), st[1] = L + R, st[2] = 1;
    pe_out = ref_view(&mb, MLART_DTYPE_BF16, L, 3, sh, st);
    ck_assert_msg(mlart_query_bmm_check(&a, &w, &out, &pe_in, &pe_out) == 0, "%s", mlart_last_error());
    ck_assert_msg(mlart_query_bmm_check(&a, &w, &out, NULL, NULL) == 0, "%s", mlart_last_error());

    EXPECT_FAIL(mlart_query_bmm_check(NULL, &w, &out, NULL, NULL), MLART_EINVAL, "a [H,T,P]");
    bad = a, bad.ndim = 2;
    EXPECT_FAIL(mlart_query_bmm_check(&bad, &w, &out, NULL, NULL), MLART_ESHAPE, "a [H,T,P]");
    bad = w, bad.dtype = MLART_DTYPE_F32;
    EXPECT_FAIL(mlart_query_bmm_check(&a, &bad, &out, NULL, NULL), MLART_EDTYPE, "w [H,P,L]");
    bad = w, bad.shape[1] = P + 1, bad.stride[0] = (P + 1) * L;
    EXPECT_FAIL(mlart_query_bmm_check(&a, &bad, &out, NULL, NULL), MLART_ELAYOUT, "w [H,P,L]");
    bad.base = bad.data, bad.extent = (size_t)(H * (P + 1) * L) * 2; /* span fits: now a shape error */
    {
        ref_buf big = ref_buf_new(bad.extent);
        bad.data = big.p, bad.base = big.p;
        EXPECT_FAIL(mlart_query_bmm_check(&a, &bad, &out, NULL, NULL), MLART_ESHAPE, "shapes disagree");
        ref_buf_free(&big);
    }
    {
        size_t lo, hi; /* storage ending one byte before the span does */
        ck_assert(mlart_tensor_span(&out, &lo, &hi) == 0);
        bad = out, bad.extent = hi - 1;
    }
    EXPECT_FAIL(mlart_query_bmm_check(&a, &w, &bad, NULL, NULL), MLART_ELAYOUT, "out [H,T,L]");
    bad = a, bad.stride[2] = 2, bad.shape[2] = P / 2;
    EXPECT_FAIL(mlart_query_bmm_check(&bad, &w, &out, NULL, NULL), MLART_ELAYOUT, "inner stride");
    EXPECT_FAIL(mlart_query_bmm_check(&a, &w, &out, &pe_in, NULL), MLART_EINVAL, "pe_in");
    bad = pe_out, bad.shape[2] = R - 1;
    EXPECT_FAIL(mlart_query_bmm_check(&a, &w, &out, &pe_in, &bad), MLART_ESHAPE, "pe_out");
    bad = pe_in, bad.dtype = MLART_DTYPE_I32;
    EXPECT_FAIL(mlart_query_bmm_check(&a, &w, &out, &bad, &pe_out), MLART_EDTYPE, "pe_in");
    bad = out, bad.device = 0;
    EXPECT_FAIL(mlart_query_bmm_check(&a, &w, &bad, NULL, NULL), MLART_EINVAL, "different devices");
    bad = out, bad.stride[1] = 0; /* every token writes the same row */
    EXPECT_FAIL(mlart_query_bmm_check(&a, &w, &bad, NULL, NULL), MLART_ELAYOUT, "overlapping elements");
    /* output over the input's bytes: a and out in one storage, out starting
     * inside a's span */
    {
        ref_buf sbuf = ref_buf_new((size_t)(H * T * (P + L)) * 2);
        mlart_tensor a2, o2;
        sh[0] = H, sh[1] = T, sh[2] = P, st[0] = P, st[1] = H * P, st[2] = 1;
        a2 = ref_view(&sbuf, MLART_DTYPE_BF16, 0, 3, sh, st);
        sh[0] = H, sh[1] = T, sh[2] = L, st[0] = L, st[1] = H * L, st[2] = 1;
        o2 = ref_view(&sbuf, MLART_DTYPE_BF16, H * T * P - 1, 3, sh, st);
        EXPECT_FAIL(mlart_query_bmm_check(&a2, &w, &o2, NULL, NULL), MLART_ELAYOUT, "overlaps input a");
        o2 = ref_view(&sbuf, MLART_DTYPE_BF16, H * T * P, 3, sh, st); /* adjacent: fine */
        ck_assert_msg(mlart_query_bmm_check(&a2, &w, &o2, NULL, NULL) == 0, "%s", mlart_last_error());
        ref_buf_free(&sbuf);
    }
    /* the CPU twin refuses device memory */
    {
        mlart_tensor a2 = a, w2 = w, o2 = out;
        a2.device = w2.device = o2.device = 0;
        EXPECT_FAIL(mlart_query_bmm_cpu(&a2, &w2, &o2, NULL, NULL), MLART_EINVAL, "host");
    }

    sh[0] = H, sh[1] = T, sh[2] = L, st[0] = T * L, st[1] = L, st[2] = 1;
    x = ref_view(&xb, MLART_DTYPE_BF16, 0, 3, sh, st);
    sh[0] = H, sh[1] = L, sh[2] = V, st[0] = L * V, st[1] = V, st[2] = 1;
    wv = ref_view(&vb, MLART_DTYPE_BF16, 0, 3, sh, st);
    sh[0] = H, sh[1] = T, sh[2] = V, st[0] = V, st[1] = H * V, st[2] = 1;
    o = ref_view(&ob, MLART_DTYPE_BF16, 0, 3, sh, st);
    ck_assert_msg(mlart_v_up_bmm_check(&x, &wv, &o) == 0, "%s", mlart_last_error());
    bad = o, bad.shape[2] = V + 1;
    EXPECT_FAIL(mlart_v_up_bmm_check(&x, &wv, &bad), MLART_ELAYOUT, "o [H,T,V]");
    bad.extent += 64;
    EXPECT_FAIL(mlart_v_up_bmm_check(&x, &wv, &bad), MLART_ESHAPE, "shapes disagree");
    bad = wv, bad.stride[1] = 1, bad.stride[2] = L; /* a transposed (checkpoint) view */
    EXPECT_FAIL(mlart_v_up_bmm_check(&x, &bad, &o), MLART_ELAYOUT, "inner stride");
    bad = x, bad.dtype = MLART_DTYPE_FP8_E4M3;
    EXPECT_FAIL(mlart_v_up_bmm_check(&bad, &wv, &o), MLART_EDTYPE, "x [H,T,L]");
    bad = o, bad.ndim = 2;
    EXPECT_FAIL(mlart_v_up_bmm_check(&x, &wv, &bad), MLART_ESHAPE, "o [H,T,V]");
    bad = o, bad.data = (uint16_t *)o.data - 1; /* starts before its base */
    EXPECT_FAIL(mlart_v_up_bmm_check(&x, &wv, &bad), MLART_EINVAL, "o [H,T,V]");

    /* cache writer */
    {
        mlart_geometry g = {H, P, R, 128, V, 8, 4, MLART_KV_FP8_DS_MLA, 0.125f};
        size_t bpt = mlart_kv_bytes_per_token(&g);
        ref_buf cb = ref_buf_new(4 * bpt), lb = ref_buf_new(2 * (128 + R) * 2), sb = ref_buf_new(8);
        mlart_tensor cache, lat, slots;
        int32_t *sp = (int32_t *)sb.p;
        uint8_t *snapshot = malloc(cb.bytes);
        int64_t s2[2], t2[2];
        s2[0] = 4, s2[1] = (int64_t)bpt, t2[0] = (int64_t)bpt, t2[1] = 1;
        cache = ref_view(&cb, MLART_DTYPE_U8, 0, 2, s2, t2);
        s2[0] = 2, s2[1] = 128 + R, t2[0] = 128 + R, t2[1] = 1;
        lat = ref_view(&lb, MLART_DTYPE_BF16, 0, 2, s2, t2);
        s2[0] = 2, t2[0] = 1;
        slots = ref_view(&sb, MLART_DTYPE_I32, 0, 1, s2, t2);
        for (int i = 0; i < 2 * (128 + R); i++)
            ((uint16_t *)lb.p)[i] = ref_rand_bf16(1.0);
        sp[0] = 1, sp[1] = 4; /* 4 is past the 4 slots */
        memcpy(snapshot, cb.p, cb.bytes);
        EXPECT_FAIL(mlart_kv_write_cpu(&g, &cache, &lat, &slots), MLART_ERANGE, "slots[1] = 4");
        ck_assert_msg(memcmp(snapshot, cb.p, cb.bytes) == 0, "refused write changed the cache");
        sp[1] = -2;
        EXPECT_FAIL(mlart_kv_write_cpu(&g, &cache, &lat, &slots), MLART_ERANGE, "slots[1] = -2");
        sp[1] = 2;
        ((uint16_t *)lb.p)[128 + R + 9] = 0x7f80; /* +inf in row 1 */
        EXPECT_FAIL(mlart_kv_write_cpu(&g, &cache, &lat, &slots), MLART_ERANGE, "latent[1][9]");
        ck_assert_msg(memcmp(snapshot, cb.p, cb.bytes) == 0, "refused write changed the cache");
        bad = cache, bad.shape[1] = (int64_t)bpt - 4, bad.stride[0] = (int64_t)bpt - 4;
        EXPECT_FAIL(mlart_kv_write_check(&g, &bad, &lat, &slots), MLART_ESHAPE, "rows must be");
        bad = lat, bad.shape[1] = 128 + R - 1;
        EXPECT_FAIL(mlart_kv_write_check(&g, &cache, &bad, &slots), MLART_ESHAPE, "latent");
        bad = slots, bad.dtype = MLART_DTYPE_I64;
        EXPECT_FAIL(mlart_kv_write_check(&g, &cache, &lat, &bad), MLART_EDTYPE, "slots [N]");
        bad = slots, bad.shape[0] = 3;
        EXPECT_FAIL(mlart_kv_write_check(&g, &cache, &lat, &bad), MLART_ELAYOUT, "slots [N]");
        bad = cache, bad.stride[0] = 1; /* rows overlapping each other */
        EXPECT_FAIL(mlart_kv_write_check(&g, &bad, &lat, &slots), MLART_ELAYOUT, "overlapping");
        g.kv_lora = 100; /* fp8 needs L % 128 == 0 */
        EXPECT_FAIL(mlart_kv_write_check(&g, &cache, &lat, &slots), MLART_EINVAL, "128");
        free(snapshot);
        ref_buf_free(&cb);
        ref_buf_free(&lb);
        ref_buf_free(&sb);
    }
    printf("op checks: %d bad views/values refused with the right status and a message naming the "
           "operand\n",
           n_bad);
    ref_buf_free(&qb);
    ref_buf_free(&wb);
    ref_buf_free(&mb);
    ref_buf_free(&xb);
    ref_buf_free(&vb);
    ref_buf_free(&ob);
}
END_TEST

/* Slot -1 rows on a cache of no slots and no storage: nothing is written
 * and no record address is formed. */
START_TEST(kv_write_skip_on_empty_cache)
{
    mlart_geometry g = {1, 16, 8, 32, 16, 8, 4, MLART_KV_BF16, 0.125f};
    const int64_t bpt = (int64_t)mlart_kv_bytes_per_token(&g);
    ref_buf lb = ref_buf_new((32 + 8) * 2), sb = ref_buf_new(4);
    int64_t s2[2], t2[2];
    mlart_tensor cache, lat, slots;
    memset(&cache, 0, sizeof cache);
    cache.dtype = MLART_DTYPE_U8, cache.ndim = 2, cache.device = -1;
    cache.shape[0] = 0, cache.shape[1] = bpt, cache.stride[0] = bpt, cache.stride[1] = 1;
    s2[0] = 1, s2[1] = 32 + 8, t2[0] = 32 + 8, t2[1] = 1;
    lat = ref_view(&lb, MLART_DTYPE_BF16, 0, 2, s2, t2);
    s2[0] = 1, t2[0] = 1;
    slots = ref_view(&sb, MLART_DTYPE_I32, 0, 1, s2, t2);
    ((int32_t *)sb.p)[0] = -1;
    ck_assert_msg(mlart_kv_write_cpu(&g, &cache, &lat, &slots) == 0, "%s", mlart_last_error());
    ref_buf_free(&lb);
    ref_buf_free(&sb);
}
END_TEST

/* L + R past INT32_MAX in the shape message (a geometry the checks accept;
 * the cache view is never read). */
START_TEST(kv_write_check_wide_rows)
{
    int n_bad = 0;
    mlart_geometry g = {1, 16, 1 << 30, 1 << 30, 16, 8, 4, MLART_KV_BF16, 0.125f};
    ref_buf cb = ref_buf_new(64), lb = ref_buf_new(64), sb = ref_buf_new(4);
    int64_t s2[2], t2[2];
    mlart_tensor cache, lat, slots;
    s2[0] = 1, s2[1] = (int64_t)mlart_kv_bytes_per_token(&g), t2[0] = s2[1], t2[1] = 1;
    cache = ref_view(&cb, MLART_DTYPE_U8, 0, 2, s2, t2);
    cache.extent = (size_t)s2[1];
    s2[0] = 1, s2[1] = 4, t2[0] = 4, t2[1] = 1;
    lat = ref_view(&lb, MLART_DTYPE_BF16, 0, 2, s2, t2);
    s2[0] = 1, t2[0] = 1;
    slots = ref_view(&sb, MLART_DTYPE_I32, 0, 1, s2, t2);
    EXPECT_FAIL(mlart_kv_write_check(&g, &cache, &lat, &slots), MLART_ESHAPE,
                "want latent [N,2147483648]");
    ck_assert_int_eq(n_bad, 1);
    ref_buf_free(&cb);
    ref_buf_free(&lb);
    ref_buf_free(&sb);
}
END_TEST

/* Three cache records 2^62 bytes apart within a claimed extent: they cover
 * 2^63 + bpt bytes, past INT64_MAX, and share none (latent and slots lie
 * below them; nothing is read). */
START_TEST(kv_write_check_huge_stride)
{
    int n_bad = 0;
    mlart_geometry g = {1, 16, 8, 32, 16, 8, 4, MLART_KV_BF16, 0.125f};
    const int64_t bpt = (int64_t)mlart_kv_bytes_per_token(&g);
    ref_buf b = ref_buf_new((size_t)(2 * (32 + 8) * 2 + 8 + bpt));
    int64_t s2[2], t2[2];
    mlart_tensor cache, lat, slots;
    s2[0] = 2, s2[1] = 32 + 8, t2[0] = 32 + 8, t2[1] = 1;
    lat = ref_view(&b, MLART_DTYPE_BF16, 0, 2, s2, t2);
    s2[0] = 2, t2[0] = 1;
    slots = ref_view(&b, MLART_DTYPE_I32, (2 * (32 + 8) * 2) / 4, 1, s2, t2);
    s2[0] = 3, s2[1] = bpt, t2[0] = INT64_C(1) << 62, t2[1] = 1;
    cache = ref_view(&b, MLART_DTYPE_U8, 2 * (32 + 8) * 2 + 8, 2, s2, t2);
    cache.base = cache.data;
    cache.extent = ((size_t)1 << 63) + (size_t)bpt;
    ck_assert_msg(mlart_kv_write_check(&g, &cache, &lat, &slots) == 0, "%s", mlart_last_error());
    cache.stride[0] = 1; /* the same records overlapping: still refused */
    EXPECT_FAIL(mlart_kv_write_check(&g, &cache, &lat, &slots), MLART_ELAYOUT, "overlapping");
    ck_assert_int_eq(n_bad, 1);
    ref_buf_free(&b);
}
END_TEST

/* query_bmm's two outputs: columns 0..L-1 and L..L+R-1 of one q_mqa
 * [T,H,L+R] (the layer's views, spans interleaved; token rows padded or
 * not) or separate storage are accepted; any shared element is refused. */
START_TEST(query_bmm_outputs_apart)
{
    enum { P = 16, L = 32, R = 8 };
    int n_bad = 0;
    static const int64_t hts[][2] = {{2, 3}, {1, 1}, {1, 4}, {5, 1}};
    for (size_t c = 0; c < 2 * sizeof hts / sizeof hts[0]; c++) {
        const int64_t H = hts[c / 2][0], T = hts[c / 2][1], pad = c % 2 ? 7 : 0;
        const int64_t tok = H * (L + R) + pad; /* q_mqa's token stride */
        /* one spare row past q_mqa, for a view one row on */
        ref_buf qb = ref_buf_new((size_t)(T * H * (P + R)) * 2), wb = ref_buf_new((size_t)(H * P * L) * 2),
                mb = ref_buf_new((size_t)(T * tok + L + R) * 2), pb = ref_buf_new((size_t)(T * H * R) * 2);
        int64_t sh[3], st[3], pst[3] = {tok, L + R, 1};
        mlart_tensor a, w, out, pe_in, pe_out, sep;
        uint8_t *snapshot = malloc(mb.bytes);
        qabs_inputs(&qb, &wb, H, T, P, L, R, &a, &pe_in, &w);
        sh[0] = H, sh[1] = T, sh[2] = L, st[0] = L + R, st[1] = tok, st[2] = 1;
        out = ref_view(&mb, MLART_DTYPE_BF16, 0, 3, sh, st);
        sh[0] = T, sh[1] = H, sh[2] = R;
        pe_out = ref_view(&mb, MLART_DTYPE_BF16, L, 3, sh, pst);
        st[0] = H * R, st[1] = R, st[2] = 1;
        sep = ref_view(&pb, MLART_DTYPE_BF16, 0, 3, sh, st);
        for (int64_t i = 0; i < T * H * (P + R); i++)
            ((uint16_t *)qb.p)[i] = ref_rand_bf16(1.0);
        for (int64_t i = 0; i < H * P * L; i++)
            ((uint16_t *)wb.p)[i] = ref_rand_bf16(1.0);
        ck_assert_msg(mlart_query_bmm_check(&a, &w, &out, &pe_in, &pe_out) == 0,
                      "H=%lld T=%lld pad=%lld: %s", (long long)H, (long long)T, (long long)pad,
                      mlart_last_error());
        ck_assert_msg(mlart_query_bmm_check(&a, &w, &out, &pe_in, &sep) == 0, "H=%lld T=%lld: %s",
                      (long long)H, (long long)T, mlart_last_error());
        ck_assert_msg(mlart_query_bmm_cpu(&a, &w, &out, &pe_in, &pe_out) == 0, "%s", mlart_last_error());
        for (int64_t t = 0; t < T; t++) /* the rope columns are pe_in's, not overwritten */
            for (int64_t h = 0; h < H; h++)
                ck_assert(memcmp((uint16_t *)mb.p + t * tok + h * (L + R) + L,
                                 (uint16_t *)qb.p + (t * H + h) * (P + R) + P, R * 2) == 0);
        memcpy(snapshot, mb.p, mb.bytes);
        /* pe_out one column left: its first column is out's last */
        pe_out = ref_view(&mb, MLART_DTYPE_BF16, L - 1, 3, sh, pst);
        EXPECT_FAIL(mlart_query_bmm_check(&a, &w, &out, &pe_in, &pe_out), MLART_ELAYOUT,
                    "outputs out");
        EXPECT_FAIL(mlart_query_bmm_cpu(&a, &w, &out, &pe_in, &pe_out), MLART_ELAYOUT, "pe_out");
        /* pe_out over out's first R columns */
        pe_out = ref_view(&mb, MLART_DTYPE_BF16, 0, 3, sh, pst);
        EXPECT_FAIL(mlart_query_bmm_check(&a, &w, &out, &pe_in, &pe_out), MLART_ELAYOUT,
                    "may share elements");
        /* pe_out one row on: past out's columns of its own row, over the
         * next row's (with one row, over nothing of out's) */
        pe_out = ref_view(&mb, MLART_DTYPE_BF16, L + R, 3, sh, pst);
        if (H * T > 1)
            EXPECT_FAIL(mlart_query_bmm_check(&a, &w, &out, &pe_in, &pe_out), MLART_ELAYOUT,
                        "may share elements");
        else
            ck_assert_msg(mlart_query_bmm_check(&a, &w, &out, &pe_in, &pe_out) == 0, "%s",
                          mlart_last_error());
        ck_assert_msg(memcmp(snapshot, mb.p, mb.bytes) == 0, "a refused call wrote q_mqa");
        free(snapshot);
        ref_buf_free(&qb);
        ref_buf_free(&wb);
        ref_buf_free(&mb);
        ref_buf_free(&pb);
    }
    printf("query_bmm outputs: interleaved columns (token rows padded or not) and separate "
           "storage accepted, %d shared elements refused\n",
           n_bad);
}
END_TEST

/* The ag_rs scale of a rank outside [0, D) is refused before lse_all is
 * read (it holds D ranks' LSEs and no more). */
START_TEST(dcp_scale_rank_range)
{
    enum { D = 2, H = 2, T = 3, L = 8 };
    int n_bad = 0;
    uint16_t *attn = calloc(D * H * T * L, sizeof *attn);
    float *lse_all = calloc(D * D * H * T, sizeof *lse_all), *scaled = malloc(sizeof(float) * D * H * T * L),
          *lse_out = malloc(sizeof(float) * H * T);
    ck_assert(attn && lse_all && scaled && lse_out);
    for (int i = 0; i < D * H * T * L; i++)
        attn[i] = ref_rand_bf16(1.0);
    for (int32_t rank = 0; rank < D; rank++)
        ck_assert_msg(mlart_dcp_scale_cpu(attn, lse_all, D, rank, H, T, L, scaled, lse_out) == 0,
                      "%s", mlart_last_error());
    EXPECT_FAIL(mlart_dcp_scale_cpu(attn, lse_all, D, D, H, T, L, scaled, lse_out), MLART_EINVAL,
                "rank 2 outside [0, 2)");
    EXPECT_FAIL(mlart_dcp_scale_cpu(attn, lse_all, D, -1, H, T, L, scaled, lse_out), MLART_EINVAL,
                "rank -1");
    free(attn);
    free(lse_all);
    free(scaled);
    free(lse_out);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("reference_ops");
    TCase *tc = tcase_create("ops");
    ref_seed_init("test_ref_ops");
    tcase_set_timeout(tc, 240);
    tcase_add_test(tc, query_bmm_vs_naive);
    tcase_add_test(tc, v_up_vs_naive);
    tcase_add_test(tc, kv_write_vs_brute_force);
    tcase_add_test(tc, tile_scale_exact);
    tcase_add_test(tc, kv_write_cuda_path_choice);
    tcase_add_test(tc, query_pdl_launch_choice);
    tcase_add_test(tc, checks_refuse_bad_views);
    tcase_add_test(tc, kv_write_skip_on_empty_cache);
    tcase_add_test(tc, kv_write_check_wide_rows);
    tcase_add_test(tc, kv_write_check_huge_stride);
    tcase_add_test(tc, query_bmm_outputs_apart);
    tcase_add_test(tc, dcp_scale_rank_range);
    suite_add_tcase(s, tc);
    return check_run(s, CK_FORK_GETENV);
}
