/* Tensor views, span checks, geometry, kv formats, kv_b_proj weight views,
 * device count and contexts. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_run.h"
#include "mlart/mlart.h"
#include "tests/runtime/fixture.h"

START_TEST(dtypes)
{
    ck_assert_uint_eq(mlart_dtype_size(MLART_DTYPE_BF16), 2);
    ck_assert_uint_eq(mlart_dtype_size(MLART_DTYPE_FP8_E4M3), 1);
    ck_assert_uint_eq(mlart_dtype_size(MLART_DTYPE_F32), 4);
    ck_assert_uint_eq(mlart_dtype_size(MLART_DTYPE_I32), 4);
    ck_assert_uint_eq(mlart_dtype_size(MLART_DTYPE_U8), 1);
    ck_assert_uint_eq(mlart_dtype_size(MLART_DTYPE_I64), 8);
    ck_assert_uint_eq(mlart_dtype_size(MLART_DTYPE_INVALID), 0);
    ck_assert_uint_eq(mlart_dtype_size((mlart_dtype)99), 0);
    ck_assert_str_eq(mlart_dtype_name(MLART_DTYPE_FP8_E4M3), "fp8_e4m3");
    ck_assert_str_eq(mlart_dtype_name((mlart_dtype)99), "invalid");
    ck_assert_str_eq(mlart_status_name(MLART_ELAYOUT), "MLART_ELAYOUT");
    ck_assert_str_eq(mlart_strerror(MLART_EABI), "backend ABI mismatch");
}
END_TEST

START_TEST(dense_and_span)
{
    uint16_t buf[2 * 3 * 4];
    int64_t shape[3] = {2, 3, 4};
    size_t lo = 99, hi = 99;
    mlart_tensor t = mlart_tensor_dense(buf, MLART_DTYPE_BF16, -1, 3, shape);
    ck_assert_ptr_eq(t.base, buf);
    ck_assert_uint_eq(t.extent, sizeof buf);
    ck_assert_int_eq(t.stride[0], 12);
    ck_assert_int_eq(t.stride[1], 4);
    ck_assert_int_eq(t.stride[2], 1);
    ck_assert_int_eq(mlart_tensor_numel(&t), 24);
    ck_assert_int_eq(mlart_tensor_is_dense(&t), 1);
    ck_assert_int_eq(mlart_tensor_span(&t, &lo, &hi), 0);
    ck_assert_uint_eq(lo, 0);
    ck_assert_uint_eq(hi, sizeof buf);
    ck_assert_int_eq(mlart_tensor_check(&t, "t"), 0);

    /* a view at offset: elements [1..] of the last dim */
    t.data = buf + 1;
    t.shape[2] = 3;
    ck_assert_int_eq(mlart_tensor_is_dense(&t), 0);
    ck_assert_int_eq(mlart_tensor_span(&t, &lo, &hi), 0);
    ck_assert_uint_eq(lo, 2);
    ck_assert_uint_eq(hi, sizeof buf); /* last element is buf[23] */
    ck_assert_int_eq(mlart_tensor_check(&t, "t"), 0);
    /* one element past the end */
    t.shape[2] = 4;
    ck_assert_int_eq(mlart_tensor_check(&t, "q_nope"), MLART_ELAYOUT);
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "q_nope"));
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "[2, 50)"));
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "extent of 48"));
    printf("span error: %s\n", mlart_last_error());

    /* broadcast and empty */
    t.data = buf;
    t.stride[0] = 0;
    ck_assert_int_eq(mlart_tensor_span(&t, &lo, &hi), 0);
    ck_assert_uint_eq(hi, 24);
    t.shape[1] = 0;
    ck_assert_int_eq(mlart_tensor_span(&t, &lo, &hi), 0);
    ck_assert_uint_eq(lo, hi);
    ck_assert_int_eq(mlart_tensor_check(&t, "empty"), 0);
}
END_TEST

START_TEST(overlap)
{
    uint16_t buf[32];
    int64_t s8[1] = {8}, s2x4[2] = {2, 4};
    mlart_tensor a = mlart_tensor_dense(buf, MLART_DTYPE_BF16, -1, 1, s8);      /* [0, 16) */
    mlart_tensor b = mlart_tensor_dense(buf + 8, MLART_DTYPE_BF16, -1, 1, s8);  /* [16, 32) */
    mlart_tensor c = mlart_tensor_dense(buf + 7, MLART_DTYPE_BF16, -1, 1, s8);  /* [14, 30) */
    mlart_tensor m = mlart_tensor_dense(buf, MLART_DTYPE_BF16, -1, 2, s2x4);
    mlart_tensor e = a, d = a;
    ck_assert_int_eq(mlart_tensor_overlap(&a, &b), 0); /* touching ends */
    ck_assert_int_eq(mlart_tensor_overlap(&b, &a), 0);
    ck_assert_int_eq(mlart_tensor_overlap(&a, &c), 1); /* one element shared */
    ck_assert_int_eq(mlart_tensor_overlap(&c, &b), 1);
    ck_assert_int_eq(mlart_tensor_overlap(&a, &a), 1);
    /* rows of one period S = 16 bytes: m's rows take bytes [0, 4) of each,
     * e's [4, 8), then [2, 6) (sharing), then [14, 18) (wrapping into the
     * next row's [0, 2)) */
    m.stride[0] = 8, m.shape[1] = 2;
    e = m, e.data = buf + 2;
    ck_assert_int_eq(mlart_tensor_overlap(&m, &e), 0);
    ck_assert_int_eq(mlart_tensor_overlap(&e, &m), 0);
    e.data = buf + 1;
    ck_assert_int_eq(mlart_tensor_overlap(&m, &e), 1);
    e.data = buf + 7, e.shape[0] = 1; /* a single row: bytes [14, 18) */
    ck_assert_int_eq(mlart_tensor_overlap(&m, &e), 1);
    e.data = buf + 6; /* [12, 16): in the gap */
    ck_assert_int_eq(mlart_tensor_overlap(&m, &e), 0);
    ck_assert_int_eq(mlart_tensor_overlap(&e, &m), 0);
    /* a leading dim of one index does not hide the period, and a view
     * whose whole span fits the gap of the other's rows is apart: m3
     * [1,2,2] rows every 16 bytes, e a dense [2,2] block in bytes [4, 12) */
    {
        mlart_tensor m3 = m;
        int64_t s22[2] = {2, 2};
        m3.ndim = 3, m3.shape[0] = 1, m3.shape[1] = 2, m3.shape[2] = 2;
        m3.stride[0] = 16, m3.stride[1] = 8, m3.stride[2] = 1;
        e = mlart_tensor_dense(buf + 2, MLART_DTYPE_BF16, -1, 2, s22);
        ck_assert_int_eq(mlart_tensor_overlap(&m3, &e), 0);
        ck_assert_int_eq(mlart_tensor_overlap(&e, &m3), 0);
        e.data = buf + 3; /* [6, 14): still in the gap */
        ck_assert_int_eq(mlart_tensor_overlap(&m3, &e), 0);
        e.data = buf + 5; /* [10, 18): meets row 1's [16, 20) */
        ck_assert_int_eq(mlart_tensor_overlap(&m3, &e), 1);
        ck_assert_int_eq(mlart_tensor_overlap(&e, &m3), 1);
    }
    /* another period: the ranges meet, counted */
    e = m, e.data = buf + 2, e.stride[0] = 9;
    ck_assert_int_eq(mlart_tensor_overlap(&m, &e), 1);
    /* a row wider than the period (rows overlapping each other) */
    e = m, e.data = buf + 2, e.shape[1] = 9, e.extent = 0; /* its extent is not looked at */
    ck_assert_int_eq(mlart_tensor_overlap(&m, &e), 1);
    /* an empty view overlaps nothing; another device is another memory */
    e = a, e.shape[0] = 0;
    ck_assert_int_eq(mlart_tensor_overlap(&e, &a), 0);
    d.device = 0;
    ck_assert_int_eq(mlart_tensor_overlap(&d, &a), 0);
    /* a view that mlart_tensor_span refuses */
    e = a, e.stride[0] = -1;
    ck_assert_int_eq(mlart_tensor_overlap(&a, &e), MLART_EINVAL);
    ck_assert_int_eq(mlart_tensor_overlap(NULL, &a), MLART_EINVAL);
}
END_TEST

/* a dense view without a shape is refused by the check, not empty */
START_TEST(dense_without_shape)
{
    uint16_t buf[4];
    mlart_tensor t = mlart_tensor_dense(buf, MLART_DTYPE_BF16, -1, 2, NULL);
    ck_assert_int_eq(mlart_tensor_check(&t, "t"), MLART_EINVAL);
}
END_TEST

/* mlart_tensor_self_overlap: elements of one view on one address */
START_TEST(self_overlap)
{
    uint16_t buf[64];
    int64_t s34[2] = {3, 4}, s234[3] = {2, 3, 4}, covered = 7;
    int dim = 7;
    mlart_tensor m = mlart_tensor_dense(buf, MLART_DTYPE_BF16, -1, 2, s34), t;
    ck_assert_int_eq(mlart_tensor_self_overlap(&m, &dim, &covered), 0);
    ck_assert_int_eq(dim, 7); /* untouched when apart */
    ck_assert_int_eq(covered, 7);
    t = m, t.stride[0] = 5; /* rows with a gap */
    ck_assert_int_eq(mlart_tensor_self_overlap(&t, NULL, NULL), 0);
    t = m, t.stride[0] = 3; /* row 1 starts on row 0's last element */
    ck_assert_int_eq(mlart_tensor_self_overlap(&t, &dim, &covered), 1);
    ck_assert_int_eq(dim, 0);
    ck_assert_int_eq(covered, 4);
    t = m, t.stride[0] = 0; /* every row on the first */
    ck_assert_int_eq(mlart_tensor_self_overlap(&t, NULL, NULL), 1);
    t = m, t.shape[0] = 1, t.stride[0] = 0; /* a dim of one index steps nowhere */
    ck_assert_int_eq(mlart_tensor_self_overlap(&t, NULL, NULL), 0);
    /* transposed: column-major [4,3] over the same bytes is apart */
    t = m, t.shape[0] = 4, t.shape[1] = 3, t.stride[0] = 1, t.stride[1] = 4;
    ck_assert_int_eq(mlart_tensor_self_overlap(&t, NULL, NULL), 0);
    t.stride[1] = 2, t.stride[0] = 1; /* columns two apart, four long */
    ck_assert_int_eq(mlart_tensor_self_overlap(&t, &dim, &covered), 1);
    ck_assert_int_eq(dim, 1);
    /* the middle dim of three short of what the inner one covers */
    t = mlart_tensor_dense(buf, MLART_DTYPE_BF16, -1, 3, s234);
    ck_assert_int_eq(mlart_tensor_self_overlap(&t, NULL, NULL), 0);
    t.stride[1] = 2;
    ck_assert_int_eq(mlart_tensor_self_overlap(&t, &dim, &covered), 1);
    ck_assert_int_eq(dim, 1);
    ck_assert_int_eq(covered, 4);
    /* a cover past INT64_MAX: no stride steps past it */
    t = m, t.stride[1] = INT64_MAX / 2, t.stride[0] = INT64_MAX; /* 3 x INT64_MAX / 2 */
    ck_assert_int_eq(mlart_tensor_self_overlap(&t, &dim, &covered), 1);
    ck_assert_int_eq(covered, -1);
    ck_assert_int_eq(dim, 0);
    t = m, t.ndim = 0;
    ck_assert_int_eq(mlart_tensor_self_overlap(&t, NULL, NULL), MLART_EINVAL);
    ck_assert_int_eq(mlart_tensor_self_overlap(NULL, NULL, NULL), MLART_EINVAL);
}
END_TEST

START_TEST(bad_views)
{
    uint16_t buf[16];
    int64_t shape[2] = {4, 4};
    mlart_tensor t = mlart_tensor_dense(buf, MLART_DTYPE_BF16, -1, 2, shape), u;
    size_t lo = 7, hi = 7;
    u = t;
    u.ndim = 0;
    ck_assert_int_eq(mlart_tensor_check(&u, "u"), MLART_EINVAL);
    u = t;
    u.ndim = 5;
    ck_assert_int_eq(mlart_tensor_check(&u, "u"), MLART_EINVAL);
    u = t;
    u.dtype = MLART_DTYPE_INVALID;
    ck_assert_int_eq(mlart_tensor_check(&u, "u"), MLART_EINVAL);
    u = t;
    u.shape[1] = -1;
    ck_assert_int_eq(mlart_tensor_check(&u, "u"), MLART_EINVAL);
    u = t;
    u.stride[0] = -4;
    ck_assert_int_eq(mlart_tensor_check(&u, "u"), MLART_EINVAL);
    u = t;
    u.base = buf + 1; /* data below base */
    ck_assert_int_eq(mlart_tensor_span(&u, &lo, &hi), MLART_EINVAL);
    ck_assert_uint_eq(lo, 7); /* out-params untouched */
    u = t;
    u.stride[0] = INT64_MAX / 2; /* overflowing span */
    ck_assert_int_eq(mlart_tensor_check(&u, "u"), MLART_EINVAL);
    u = t;
    u.extent = sizeof buf - 1;
    ck_assert_int_eq(mlart_tensor_check(&u, "tight"), MLART_ELAYOUT);
    ck_assert_int_eq(mlart_tensor_check(NULL, "x"), MLART_EINVAL);
}
END_TEST

/* Shapes past what int64_t counts or size_t addresses: numel says so (-1),
 * the view is not dense, and a dense view of such a shape is refused by
 * its check instead of getting a wrapped extent. */
START_TEST(huge_shapes)
{
    uint16_t buf[16];
    const int64_t g = (int64_t)1 << 32;
    int64_t fits[2] = {(int64_t)1 << 31, (int64_t)1 << 31}, over[3] = {g, g, 2},
            bytes_over[2] = {(int64_t)1 << 31, (int64_t)1 << 32}, with_zero[3] = {g, g, 0};
    mlart_tensor t = mlart_tensor_dense(buf, MLART_DTYPE_BF16, -1, 2, fits);
    ck_assert_int_eq(mlart_tensor_numel(&t), (int64_t)1 << 62);
    ck_assert_uint_eq(t.extent, (size_t)1 << 63);
    ck_assert_int_eq(mlart_tensor_is_dense(&t), 1);

    t = mlart_tensor_dense(buf, MLART_DTYPE_BF16, -1, 3, over);
    ck_assert_int_eq(mlart_tensor_numel(&t), -1);
    ck_assert_uint_eq(t.extent, 0);
    ck_assert_int_eq(mlart_tensor_is_dense(&t), 0);
    ck_assert_int_eq(mlart_tensor_check(&t, "huge"), MLART_EINVAL); /* its span overflows */

    /* 2^63 elements fit no int64_t; 2^63 bf16 bytes fit no size_t either */
    t = mlart_tensor_dense(buf, MLART_DTYPE_BF16, -1, 2, bytes_over);
    ck_assert_int_eq(mlart_tensor_numel(&t), -1);
    ck_assert_uint_eq(t.extent, 0);
    ck_assert_int_ne(mlart_tensor_check(&t, "huge"), 0);

    /* 2^62 f32 elements: the count fits, the bytes do not */
    t = mlart_tensor_dense(buf, MLART_DTYPE_F32, -1, 2, fits);
    ck_assert_int_eq(mlart_tensor_numel(&t), (int64_t)1 << 62);
    ck_assert_uint_eq(t.extent, 0);
    ck_assert_int_ne(mlart_tensor_check(&t, "huge"), 0);

    /* an empty dim wins over the overflow of the others */
    t = mlart_tensor_dense(buf, MLART_DTYPE_BF16, -1, 3, with_zero);
    ck_assert_int_eq(mlart_tensor_numel(&t), 0);
    ck_assert_uint_eq(t.extent, 0);
    ck_assert_int_eq(mlart_tensor_check(&t, "empty"), 0);
}
END_TEST

START_TEST(geometry)
{
    mlart_geometry g = {4, 128, 64, 512, 128, 256, 64, MLART_KV_BF16, 0.0625f}, b;
    mlart_kv_format f = MLART_KV_BF16;
    ck_assert_int_eq(mlart_geometry_check(&g), 0);
    ck_assert_uint_eq(mlart_kv_bytes_per_token(&g), 1152);
    g.kv_format = MLART_KV_FP8_DS_MLA;
    ck_assert_uint_eq(mlart_kv_bytes_per_token(&g), 656);
    ck_assert_int_eq(mlart_geometry_check(&g), 0);
    b = g;
    b.kv_lora = 96;
    ck_assert_int_eq(mlart_geometry_check(&b), MLART_EINVAL);
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "128"));
    ck_assert_uint_eq(mlart_kv_bytes_per_token(&b), 0);
    b = g;
    b.heads = 0;
    ck_assert_int_eq(mlart_geometry_check(&b), MLART_EINVAL);
    b = g;
    b.softmax_scale = NAN;
    ck_assert_int_eq(mlart_geometry_check(&b), MLART_EINVAL);
    b = g;
    b.kv_format = (mlart_kv_format)7;
    ck_assert_int_eq(mlart_geometry_check(&b), MLART_EINVAL);
    ck_assert_int_eq(mlart_kv_format_parse("fp8_ds_mla", &f), 0);
    ck_assert_int_eq(f, MLART_KV_FP8_DS_MLA);
    ck_assert_int_eq(mlart_kv_format_parse("fp8", &f), MLART_EINVAL);
    ck_assert_int_eq(f, MLART_KV_FP8_DS_MLA);
    ck_assert_int_eq(mlart_kv_format_parse("bf16", NULL), MLART_EINVAL); /* crashed before */
    ck_assert_str_eq(mlart_kv_format_name(MLART_KV_BF16), "bf16");
}
END_TEST

START_TEST(kv_b_proj_views)
{
    const int64_t H = 3, P = 5, V = 4, L = 7;
    mlart_geometry g = {3, 5, 2, 7, 4, 8, 4, MLART_KV_BF16, 0.5f};
    int64_t shape[2] = {H * (P + V), L};
    uint16_t *kv = malloc(sizeof(uint16_t) * (size_t)(H * (P + V) * L));
    mlart_tensor t, uk, uv, keep;
    uint64_t seed = fx_seed();
    fx_rng rng = {seed};
    for (int64_t i = 0; i < H * (P + V) * L; i++)
        kv[i] = (uint16_t)fx_next(&rng);
    t = mlart_tensor_dense(kv, MLART_DTYPE_BF16, -1, 2, shape);
    ck_assert_int_eq(mlart_weights_from_kv_b_proj(&g, &t, &uk, &uv), 0);
    ck_assert_int_eq(uk.ndim, 3);
    ck_assert_int_eq(uk.shape[0], H);
    ck_assert_int_eq(uk.shape[1], P);
    ck_assert_int_eq(uk.shape[2], L);
    ck_assert_int_eq(uk.stride[0], (P + V) * L);
    ck_assert_int_eq(uk.stride[1], L);
    ck_assert_int_eq(uk.stride[2], 1);
    ck_assert_ptr_eq(uk.data, kv);
    ck_assert_int_eq(uv.shape[0], H);
    ck_assert_int_eq(uv.shape[1], L);
    ck_assert_int_eq(uv.shape[2], V);
    ck_assert_int_eq(uv.stride[0], (P + V) * L);
    ck_assert_int_eq(uv.stride[1], 1);
    ck_assert_int_eq(uv.stride[2], L);
    ck_assert_ptr_eq(uv.data, kv + P * L);
    ck_assert_ptr_eq(uv.base, kv);
    ck_assert_uint_eq(uv.extent, t.extent);
    ck_assert_int_eq(mlart_tensor_check(&uk, "w_uk_t"), 0);
    ck_assert_int_eq(mlart_tensor_check(&uv, "w_uv"), 0);
    ck_assert_int_eq(mlart_tensor_is_dense(&uk), 0);
    /* element identities: W_UK_T[h,p,l] = kv[h*(P+V)+p, l]; W_UV[h,l,v] = kv[h*(P+V)+P+v, l] */
    for (int64_t h = 0; h < H; h++)
        for (int64_t l = 0; l < L; l++) {
            for (int64_t p = 0; p < P; p++)
                ck_assert_uint_eq(((uint16_t *)uk.data)[h * uk.stride[0] + p * uk.stride[1] + l],
                                  kv[(h * (P + V) + p) * L + l]);
            for (int64_t v = 0; v < V; v++)
                ck_assert_uint_eq(((uint16_t *)uv.data)[h * uv.stride[0] + l + v * uv.stride[2]],
                                  kv[(h * (P + V) + P + v) * L + l]);
        }
    /* bad input leaves the outputs untouched */
    keep = uk;
    t.shape[0]--;
    ck_assert_int_eq(mlart_weights_from_kv_b_proj(&g, &t, &uk, &uv), MLART_ESHAPE);
    ck_assert_mem_eq(&keep, &uk, sizeof keep);
    t.shape[0]++;
    t.dtype = MLART_DTYPE_F32;
    ck_assert_int_eq(mlart_weights_from_kv_b_proj(&g, &t, &uk, &uv), MLART_EDTYPE);
    t.dtype = MLART_DTYPE_BF16;
    t.extent -= 2;
    ck_assert_int_eq(mlart_weights_from_kv_b_proj(&g, &t, &uk, &uv), MLART_ELAYOUT);
    t.extent += 2;
    t.ndim = 3, t.shape[2] = 1, t.stride[2] = 1;
    ck_assert_int_eq(mlart_weights_from_kv_b_proj(&g, &t, &uk, &uv), MLART_ESHAPE);
    ck_assert_msg(strstr(mlart_last_error(), "3 dims, want 2"), "%s", mlart_last_error());
    t.ndim = 2;
    {
        /* one head, a row stride whose (P+V) rows pass 2^63 elements, with an
         * extent claimed to match: refused, not wrapped (UBSan saw the wrap) */
        mlart_geometry g1 = g;
        mlart_tensor w = t;
        g1.heads = 1, g1.qk_nope = 1, g1.v_head = 1; /* two rows: their span fits */
        w.shape[0] = 2, w.stride[0] = ((int64_t)1 << 62) + 1, w.extent = SIZE_MAX;
        ck_assert_int_eq(mlart_weights_from_kv_b_proj(&g1, &w, &uk, &uv), MLART_ELAYOUT);
        ck_assert_msg(strstr(mlart_last_error(), "row stride"), "%s", mlart_last_error());
    }
    ck_assert_mem_eq(&keep, &uk, sizeof keep);
    printf("kv_b_proj views checked elementwise (seed %llu)\n", (unsigned long long)seed);
    free(kv);
}
END_TEST

START_TEST(context)
{
    int n = -5;
    mlart_context *ctx = NULL, *keep;
    ck_assert_int_eq(mlart_cuda_device_count(&n), 0);
    ck_assert_int_ge(n, 0);
    ck_assert_int_eq(mlart_cuda_device_count(NULL), MLART_EINVAL);
    ck_assert_int_eq(mlart_context_create(-1, &ctx), 0);
    ck_assert_int_eq(mlart_context_device(ctx), -1);
    keep = ctx;
    ck_assert_int_eq(mlart_context_create(-2, &ctx), MLART_EINVAL);
    ck_assert_ptr_eq(ctx, keep);
    ck_assert_int_eq(mlart_context_create(n, &ctx), MLART_ENODEV);
    ck_assert_ptr_eq(ctx, keep);
    printf("cuda devices: %d; device %d refused: %s\n", n, n, mlart_last_error());
    mlart_context_destroy(ctx);
    mlart_context_destroy(NULL);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("runtime_tensor");
    TCase *tc = tcase_create("tensor");
    tcase_add_test(tc, dtypes);
    tcase_add_test(tc, dense_and_span);
    tcase_add_test(tc, overlap);
    tcase_add_test(tc, self_overlap);
    tcase_add_test(tc, dense_without_shape);
    tcase_add_test(tc, bad_views);
    tcase_add_test(tc, huge_shapes);
    tcase_add_test(tc, geometry);
    tcase_add_test(tc, kv_b_proj_views);
    tcase_add_test(tc, context);
    suite_add_tcase(s, tc);
    return check_run(s, CK_FORK_GETENV);
}
