/* kv_b_proj from .safetensors: bf16 and fp8 checkpoints with known values,
 * and every way a file can lie.  Files are generated here, in a temp dir. */
#define _POSIX_C_SOURCE 200809L
#include <check.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "check_run.h"
#include "mlart/weights.h"
#include "runtime/safetensors.h"
#include "st_writer.h"

static char tmpdir[256];
static uint64_t seed;
static uint64_t rng;

static uint32_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}

static const char *tpath(const char *name)
{
    static char p[512];
    snprintf(p, sizeof p, "%s/%s", tmpdir, name);
    return p;
}

/* random finite bf16 in about [-2, 2] */
static uint16_t rnd_bf16(void)
{
    uint16_t h;
    do {
        h = (uint16_t)((rnd() & 0x8000u) | (0x3800u + (rnd() % 0x800u)));
    } while ((h & 0x7f80) == 0x7f80);
    return h;
}

static uint8_t rnd_e4m3(void)
{
    uint8_t b;
    do
        b = (uint8_t)rnd();
    while ((b & 0x7f) == 0x7f); /* NaN */
    return b;
}

static mlart_geometry geom(int heads, int P, int V, int L)
{
    mlart_geometry g;
    memset(&g, 0, sizeof g);
    g.heads = heads;
    g.qk_nope = P;
    g.rope = 64;
    g.kv_lora = L;
    g.v_head = V;
    g.topk = 64;
    g.page_size = 64;
    g.kv_format = MLART_KV_BF16;
    g.softmax_scale = 0.1f;
    return g;
}

#define POISON 0xA5

/* call the loader on a poisoned buffer; on failure, the buffer must be untouched */
static int load(const char *path, int layer, const mlart_geometry *g, int off, uint16_t *dst,
                size_t bytes)
{
    int rc;
    memset(dst, POISON, bytes);
    rc = mlart_safetensors_load_kv_b_proj(path, layer, g, off, dst, bytes);
    if (rc) {
        const unsigned char *p = (const unsigned char *)dst;
        for (size_t i = 0; i < bytes; i++)
            ck_assert_msg(p[i] == POISON, "failed load wrote dst[%zu]", i);
        ck_assert_msg(mlart_last_error()[0] != '\0', "failure without a message");
    }
    return rc;
}

#define EXPECT_FAIL(status, call)                                                               \
    do {                                                                                        \
        int rc_ = (call);                                                                       \
        ck_assert_msg(rc_ == (status), "%s: got %s, want %s (%s)", #call, mlart_status_name(rc_), \
                      mlart_status_name(status), mlart_last_error());                           \
    } while (0)

/* A bf16 checkpoint: layer `layer`'s kv_b_proj [H*(P+V), L] plus neighbours. */
typedef struct ckpt {
    int H, P, V, L;
    uint16_t *w;
    st_buf file;
} ckpt;

static void ckpt_bf16(ckpt *c, int layer, int H, int P, int V, int L)
{
    size_t n = (size_t)H * (P + V) * L;
    static uint16_t other[64];
    static uint8_t odd[6];
    char name[96];
    c->H = H, c->P = P, c->V = V, c->L = L;
    c->w = malloc(n * 2);
    ck_assert_ptr_nonnull(c->w);
    for (size_t i = 0; i < n; i++)
        c->w[i] = rnd_bf16();
    for (int i = 0; i < 64; i++)
        other[i] = rnd_bf16();
    snprintf(name, sizeof name, "model.layers.%d.self_attn.kv_b_proj.weight", layer);
    st_tensor t[3] = {
        {"model.layers.0.self_attn.q_a_proj.weight", "BF16", 2, {8, 8}, other, 128, 0, 0, 0},
        {name, "BF16", 2, {(int64_t)H * (P + V), L}, c->w, n * 2, 0, 0, 0},
        /* a dtype this reader does not know: kept, bounds still checked */
        {"model.layers.0.extra", "F6_FUTURE", 1, {8}, odd, 6, 0, 0, 0},
    };
    ck_assert_int_eq(st_build(t, 3, 1, &c->file), 0);
}

START_TEST(test_bf16_known_values)
{
    ckpt c;
    mlart_geometry g;
    uint16_t *dst;
    size_t rows, bytes;
    ckpt_bf16(&c, 3, 4, 16, 8, 32);
    ck_assert_int_eq(st_write_file(tpath("bf16.safetensors"), c.file.data, c.file.len), 0);

    /* heads [1, 3) of 4 */
    g = geom(2, 16, 8, 32);
    rows = 2 * 24;
    bytes = rows * 32 * 2;
    dst = malloc(bytes + 64);
    memset(dst, POISON, bytes + 64);
    ck_assert_int_eq(mlart_safetensors_load_kv_b_proj(tpath("bf16.safetensors"), 3, &g, 1, dst,
                                                      bytes + 64),
                     0);
    ck_assert_int_eq(memcmp(dst, c.w + 24 * 32, bytes), 0);
    for (size_t i = bytes; i < bytes + 64; i++)
        ck_assert_int_eq(((unsigned char *)dst)[i], POISON); /* nothing past the slice */
    free(dst);

    /* all heads */
    g = geom(4, 16, 8, 32);
    bytes = 4 * 24 * 32 * 2;
    dst = malloc(bytes);
    ck_assert_int_eq(load(tpath("bf16.safetensors"), 3, &g, 0, dst, bytes), 0);
    ck_assert_int_eq(memcmp(dst, c.w, bytes), 0);

    /* out of range heads, missing layer, small destination */
    g = geom(2, 16, 8, 32);
    EXPECT_FAIL(MLART_ESHAPE, load(tpath("bf16.safetensors"), 3, &g, 3, dst, bytes));
    EXPECT_FAIL(MLART_EINVAL, load(tpath("bf16.safetensors"), 2, &g, 0, dst, bytes));
    EXPECT_FAIL(MLART_EINVAL, load(tpath("bf16.safetensors"), 3, &g, 0, dst, 2 * 24 * 32 * 2 - 1));
    free(dst);
    free(c.w);
    st_buf_free(&c.file);
    printf("bf16: heads [1,3) and [0,4) of a [96,32] kv_b_proj bit-exact, bad ranges refused\n");
}
END_TEST

/* Find an (e4m3, f32 scale) pair whose product rounds differently to bf16
 * when rounded through f32 first: proves the loader rounds once. */
static void find_double_rounding_pair(uint8_t *b, float *s)
{
    for (;;) {
        uint8_t fb = (uint8_t)(0x30 + rnd() % 0x40); /* normal values around 1..256 */
        uint32_t su = 0x3c000000u | (rnd() & 0x7fffffu);
        float sc, pf;
        double exact;
        uint32_t pu;
        if ((fb & 0x7f) == 0x7f)
            continue;
        memcpy(&sc, &su, sizeof sc);
        exact = st_ref_e4m3(fb) * (double)sc;
        pf = (float)st_ref_e4m3(fb) * sc; /* rounded to f32 */
        memcpy(&pu, &pf, sizeof pu);
        pu += 0x7fffu + ((pu >> 16) & 1u);
        if ((uint16_t)(pu >> 16) != st_ref_bf16(exact)) {
            *b = fb;
            *s = sc;
            return;
        }
    }
}

START_TEST(test_fp8_known_values)
{
    /* rows 3*(48+40) = 264 -> 3 row blocks (last one 8 rows); cols 160 -> 2 col blocks */
    const int H = 3, P = 48, V = 40, L = 160, layer = 7;
    const int rows = H * (P + V), sr = (rows + 127) / 128, sc = (L + 127) / 128;
    uint8_t *w = malloc((size_t)rows * L);
    float *scale = malloc(sizeof(float) * sr * sc);
    uint16_t *dst = malloc((size_t)rows * L * 2);
    uint8_t db;
    float ds;
    st_buf f;
    mlart_geometry g;
    int mism = 0;
    for (int i = 0; i < rows * L; i++)
        w[i] = rnd_e4m3();
    for (int i = 0; i < sr * sc; i++)
        scale[i] = ldexpf(1.0f + (float)(rnd() & 0x7fffff) / 8388608.0f, -(int)(rnd() % 12));
    find_double_rounding_pair(&db, &ds);
    w[0] = db;
    scale[0] = ds;
    st_tensor t[2] = {
        {"model.layers.7.self_attn.kv_b_proj.weight", "F8_E4M3", 2, {rows, L}, w,
         (size_t)rows * L, 0, 0, 0},
        {"model.layers.7.self_attn.kv_b_proj.weight_scale_inv", "F32", 2, {sr, sc}, scale,
         sizeof(float) * sr * sc, 0, 0, 0},
    };
    ck_assert_int_eq(st_build(t, 2, 0, &f), 0);
    ck_assert_int_eq(st_write_file(tpath("fp8.safetensors"), f.data, f.len), 0);

    for (int off = 0; off < 2; off++) {
        int heads = H - off;
        g = geom(heads, P, V, L);
        ck_assert_int_eq(load(tpath("fp8.safetensors"), layer, &g, off, dst,
                              (size_t)heads * (P + V) * L * 2),
                         0);
        for (int r = 0; r < heads * (P + V); r++) {
            int ar = r + off * (P + V);
            for (int c = 0; c < L; c++) {
                double v = st_ref_e4m3(w[ar * L + c]) * (double)scale[(ar / 128) * sc + c / 128];
                uint16_t want = st_ref_bf16(v);
                if (dst[r * L + c] != want && mism++ < 5)
                    fprintf(stderr, "fp8 [%d,%d]: got %04x want %04x\n", ar, c, dst[r * L + c],
                            want);
            }
        }
    }
    ck_assert_int_eq(mism, 0);

    /* scale tensor wrong: dtype, shape, missing */
    {
        st_tensor bad[2] = {t[0], t[1]};
        st_buf b;
        g = geom(H, P, V, L);
        bad[1].dtype = "BF16";
        bad[1].shape[1] = sc * 2; /* keep byte size consistent: 2 bytes x twice the columns */
        ck_assert_int_eq(st_build(bad, 2, 0, &b), 0);
        st_write_file(tpath("fp8-bad.safetensors"), b.data, b.len);
        EXPECT_FAIL(MLART_EDTYPE, load(tpath("fp8-bad.safetensors"), layer, &g, 0, dst,
                                       (size_t)rows * L * 2));
        st_buf_free(&b);

        bad[1] = t[1];
        bad[1].shape[0] = 1;
        bad[1].shape[1] = sr * sc;
        ck_assert_int_eq(st_build(bad, 2, 0, &b), 0);
        st_write_file(tpath("fp8-bad.safetensors"), b.data, b.len);
        EXPECT_FAIL(MLART_ESHAPE, load(tpath("fp8-bad.safetensors"), layer, &g, 0, dst,
                                       (size_t)rows * L * 2));
        st_buf_free(&b);

        ck_assert_int_eq(st_build(bad, 1, 0, &b), 0);
        st_write_file(tpath("fp8-bad.safetensors"), b.data, b.len);
        EXPECT_FAIL(MLART_EIO, load(tpath("fp8-bad.safetensors"), layer, &g, 0, dst,
                                    (size_t)rows * L * 2));
        st_buf_free(&b);

        /* NaN weight, NaN / negative scale: refused, never propagated */
        bad[1] = t[1];
        w[5 * L + 3] = 0x7f;
        ck_assert_int_eq(st_build(bad, 2, 0, &b), 0);
        st_write_file(tpath("fp8-bad.safetensors"), b.data, b.len);
        EXPECT_FAIL(MLART_ERANGE, load(tpath("fp8-bad.safetensors"), layer, &g, 0, dst,
                                       (size_t)rows * L * 2));
        st_buf_free(&b);
        w[5 * L + 3] = 0x38;
        scale[sc] = NAN;
        ck_assert_int_eq(st_build(bad, 2, 0, &b), 0);
        st_write_file(tpath("fp8-bad.safetensors"), b.data, b.len);
        EXPECT_FAIL(MLART_ERANGE, load(tpath("fp8-bad.safetensors"), layer, &g, 0, dst,
                                       (size_t)rows * L * 2));
        st_buf_free(&b);
        scale[sc] = -1.0f;
        ck_assert_int_eq(st_build(bad, 2, 0, &b), 0);
        st_write_file(tpath("fp8-bad.safetensors"), b.data, b.len);
        EXPECT_FAIL(MLART_ERANGE, load(tpath("fp8-bad.safetensors"), layer, &g, 0, dst,
                                       (size_t)rows * L * 2));
        st_buf_free(&b);
        /* a finite product past the bf16 range */
        scale[sc] = 3e38f;
        w[128 * L] = 0x7e; /* 448 */
        ck_assert_int_eq(st_build(bad, 2, 0, &b), 0);
        st_write_file(tpath("fp8-bad.safetensors"), b.data, b.len);
        EXPECT_FAIL(MLART_ERANGE, load(tpath("fp8-bad.safetensors"), layer, &g, 0, dst,
                                       (size_t)rows * L * 2));
        st_buf_free(&b);
    }
    st_buf_free(&f);
    free(w);
    free(scale);
    free(dst);
    printf("fp8: [264,160] e4m3 x 128x128 block scales (partial blocks) bit-exact vs float64 RNE, "
           "single rounding (e4m3 0x%02x x %a); bad scales, NaN refused\n",
           db, (double)ds);
}
END_TEST

START_TEST(test_escaped_names)
{
    static uint16_t w[2 * 3 * 4];
    uint16_t dst[2 * 3 * 4];
    mlart_geometry g = geom(2, 2, 1, 4);
    st_buf f;
    for (int i = 0; i < 24; i++)
        w[i] = rnd_bf16();
    /* "kv_b" spelt with a \u escape, and a name holding a surrogate pair */
    st_tensor t[2] = {
        {"model.layers.0.self_attn.kv\\u005fb_proj.weight", "BF16", 2, {6, 4}, w, 48, 0, 0, 0},
        {"emoji\\ud83d\\ude00\\\"\\\\\\/\\b\\f\\n\\r\\t", "BF16", 1, {0}, w, 0, 0, 0, 0},
    };
    ck_assert_int_eq(st_build(t, 2, 1, &f), 0);
    st_write_file(tpath("esc.safetensors"), f.data, f.len);
    ck_assert_int_eq(load(tpath("esc.safetensors"), 0, &g, 0, dst, sizeof dst), 0);
    ck_assert_int_eq(memcmp(dst, w, sizeof dst), 0);
    {
        mlart_st_header h;
        const char *hdr = (const char *)f.data + 8;
        uint64_t hl = 0;
        for (int i = 7; i >= 0; i--)
            hl = (hl << 8) | f.data[i];
        ck_assert_int_eq(mlart_st_header_parse(hdr, hl, 48, &h), 0);
        ck_assert_ptr_nonnull(mlart_st_header_find(&h, "emoji\xf0\x9f\x98\x80\"\\/\b\f\n\r\t"));
        ck_assert_int_eq((int)h.metadata_count, 2);
        mlart_st_header_free(&h);
    }
    st_buf_free(&f);
    printf("escaped names (\\u005f, surrogate pair, all short escapes) decoded and found\n");
}
END_TEST

START_TEST(test_truncated)
{
    ckpt c;
    mlart_geometry g = geom(4, 16, 8, 32);
    size_t bytes = 4 * 24 * 32 * 2, hlen;
    uint16_t *dst = malloc(bytes);
    size_t cuts[8];
    ckpt_bf16(&c, 0, 4, 16, 8, 32);
    hlen = c.file.len - 128 - bytes - 6 - 8;
    cuts[0] = 0, cuts[1] = 4, cuts[2] = 7, cuts[3] = 8, cuts[4] = 8 + hlen / 2;
    cuts[5] = 8 + hlen, cuts[6] = c.file.len - 1, cuts[7] = c.file.len - 100;
    for (int i = 0; i < 8; i++) {
        st_write_file(tpath("trunc.safetensors"), c.file.data, cuts[i]);
        EXPECT_FAIL(MLART_EIO, load(tpath("trunc.safetensors"), 0, &g, 0, dst, bytes));
    }
    free(dst);
    free(c.w);
    st_buf_free(&c.file);
    printf("truncated at 8 points (0, 4, 7, 8, mid-header, end of header, -1, -100): all EIO\n");
}
END_TEST

/* A 2-tensor file (48 + 16 data bytes) whose header claims the given offsets. */
static int lie(uint64_t b, uint64_t e, const char *dtype, int64_t rows, uint64_t b2, uint64_t e2)
{
    static uint16_t w[6 * 4], x[8];
    uint16_t dst[6 * 4];
    mlart_geometry g = geom(2, 2, 1, 4);
    st_buf f;
    int rc;
    st_tensor t[2] = {
        {"model.layers.0.self_attn.kv_b_proj.weight", dtype, 2, {rows, 4}, w, 48, 1, b, e},
        {"other", "BF16", 1, {(int64_t)(e2 - b2) / 2}, x, 16, 1, b2, e2},
    };
    ck_assert_int_eq(st_build(t, 2, 0, &f), 0);
    st_write_file(tpath("lie.safetensors"), f.data, f.len);
    rc = load(tpath("lie.safetensors"), 0, &g, 0, dst, sizeof dst);
    st_buf_free(&f);
    return rc;
}

START_TEST(test_lying_headers)
{
    ck_assert_int_eq(lie(0, 48, "BF16", 6, 48, 64), 0); /* the honest version loads */
    EXPECT_FAIL(MLART_EIO, lie(0, 50, "BF16", 6, 48, 64));  /* size != dtype x shape */
    EXPECT_FAIL(MLART_EIO, lie(0, 48, "BF16", 6, 40, 56));  /* overlap */
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "overlaps"));
    EXPECT_FAIL(MLART_EIO, lie(0, 48, "BF16", 6, 0, 16));   /* overlap at the same start */
    EXPECT_FAIL(MLART_EIO, lie(0, 40, "BF16", 5, 48, 64));  /* consistent but leaves a hole */
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "belong to no"));
    EXPECT_FAIL(MLART_EIO, lie(0, 48, "BF16", 6, 48, 56));  /* trailing bytes */
    EXPECT_FAIL(MLART_EIO, lie(48, 0, "BF16", 6, 48, 64));  /* begin > end */
    EXPECT_FAIL(MLART_EIO, lie(64, 112, "BF16", 6, 0, 16)); /* past the data */
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "outside"));
    EXPECT_FAIL(MLART_EIO, lie(UINT64_MAX - 47, UINT64_MAX, "BF16", 6, 48, 64)); /* wraps */
    EXPECT_FAIL(MLART_EIO, lie(0, 48, "BF16", INT64_MAX, 48, 64)); /* numel overflows */
    EXPECT_FAIL(MLART_EIO, lie(0, 48, "F32", 6, 48, 64));   /* f32 size mismatch */
    EXPECT_FAIL(MLART_EDTYPE, lie(0, 48, "F16", 6, 48, 64)); /* consistent, wrong dtype */
    printf("lying offsets: size mismatch, overlap x2, hole, tail, begin>end, past end, wrap, "
           "overflow: EIO; F16: EDTYPE\n");
}
END_TEST

static int shape_case(int ndim, int64_t d0, int64_t d1, int64_t d2)
{
    static uint16_t w[64];
    uint16_t dst[6 * 4];
    mlart_geometry g = geom(2, 2, 1, 4);
    st_buf f;
    int rc;
    int64_t n = d0 * (ndim > 1 ? d1 : 1) * (ndim > 2 ? d2 : 1);
    st_tensor t = {"model.layers.0.self_attn.kv_b_proj.weight", "BF16", ndim, {d0, d1, d2},
                   w, (size_t)n * 2, 0, 0, 0};
    ck_assert_int_eq(st_build(&t, 1, 0, &f), 0);
    st_write_file(tpath("shape.safetensors"), f.data, f.len);
    rc = load(tpath("shape.safetensors"), 0, &g, 0, dst, sizeof dst);
    st_buf_free(&f);
    return rc;
}

START_TEST(test_wrong_shape)
{
    ck_assert_int_eq(shape_case(2, 6, 4, 0), 0);
    EXPECT_FAIL(MLART_ESHAPE, shape_case(2, 6, 5, 0));  /* cols != kv_lora */
    EXPECT_FAIL(MLART_ESHAPE, shape_case(2, 7, 4, 0));  /* rows not heads x (P+V) */
    EXPECT_FAIL(MLART_ESHAPE, shape_case(2, 3, 4, 0));  /* one head, two asked */
    EXPECT_FAIL(MLART_ESHAPE, shape_case(3, 6, 4, 1));  /* 3-d */
    EXPECT_FAIL(MLART_ESHAPE, shape_case(1, 24, 0, 0)); /* 1-d */
    printf("wrong shapes (cols, rows, too few heads, 3-d, 1-d): ESHAPE\n");
    /* the 3-d shape is named whole */
    EXPECT_FAIL(MLART_ESHAPE, shape_case(3, 6, 4, 1));
    ck_assert_msg(strstr(mlart_last_error(), "3-d shape [6, 4, 1]") != NULL, "%s",
                  mlart_last_error());
}
END_TEST

/* The head count from the header: what a sharding caller compares with its
 * total before loading its slice. */
START_TEST(test_heads_query)
{
    mlart_geometry g = geom(2, 2, 1, 4), one = geom(1, 2, 1, 4);
    int64_t n = -7;
    ck_assert_int_eq(shape_case(2, 6, 4, 0), 0); /* 6 rows of P+V = 3: two heads */
    ck_assert_int_eq(mlart_safetensors_kv_b_proj_heads(tpath("shape.safetensors"), 0, &g, &n), 0);
    ck_assert_int_eq(n, 2);
    n = -7; /* any per-rank head count: the file's total is what comes back */
    ck_assert_int_eq(mlart_safetensors_kv_b_proj_heads(tpath("shape.safetensors"), 0, &one, &n),
                     0);
    ck_assert_int_eq(n, 2);
    n = -7;
    EXPECT_FAIL(MLART_EINVAL,
                mlart_safetensors_kv_b_proj_heads(tpath("shape.safetensors"), 1, &g, &n));
    EXPECT_FAIL(MLART_EINVAL,
                mlart_safetensors_kv_b_proj_heads(tpath("shape.safetensors"), 0, &g, NULL));
    EXPECT_FAIL(MLART_EINVAL, mlart_safetensors_kv_b_proj_heads(NULL, 0, &g, &n));
    EXPECT_FAIL(MLART_EIO, mlart_safetensors_kv_b_proj_heads(tmpdir, 0, &g, &n));
    EXPECT_FAIL(MLART_ESHAPE, shape_case(2, 7, 4, 0)); /* leaves 7 rows: not whole heads */
    EXPECT_FAIL(MLART_ESHAPE,
                mlart_safetensors_kv_b_proj_heads(tpath("shape.safetensors"), 0, &g, &n));
    ck_assert_int_eq(n, -7); /* written only on success */
    printf("heads query: 2 heads for either per-rank count; missing layer, NULL, directory, "
           "partial heads refused\n");
}
END_TEST

/* A head_offset near INT_MAX: refused with the requested range named in
 * 64-bit, not computed in int (signed overflow, a negative end). */
START_TEST(test_head_offset_overflow)
{
    uint16_t dst[24];
    mlart_geometry g = geom(2, 2, 1, 4);
    ck_assert_int_eq(shape_case(2, 6, 4, 0), 0); /* two heads */
    EXPECT_FAIL(MLART_ESHAPE, load(tpath("shape.safetensors"), 0, &g, INT_MAX - 1, dst,
                                   sizeof dst));
    ck_assert_msg(strstr(mlart_last_error(), "heads [2147483646, 2147483648) requested") != NULL,
                  "%s", mlart_last_error());
    printf("head_offset INT_MAX - 1: ESHAPE naming [2147483646, 2147483648)\n");
}
END_TEST

/* A FIFO is refused at once, not after a writer comes (the open used to
 * block before the regular-file check could run). */
START_TEST(test_fifo)
{
    uint16_t dst[24];
    mlart_geometry g = geom(2, 2, 1, 4);
    int64_t n = 0;
    time_t t0 = time(NULL);
    ck_assert_int_eq(mkfifo(tpath("fifo"), 0600), 0);
    EXPECT_FAIL(MLART_EIO, load(tpath("fifo"), 0, &g, 0, dst, sizeof dst));
    ck_assert_msg(strstr(mlart_last_error(), "not a regular file") != NULL, "%s",
                  mlart_last_error());
    EXPECT_FAIL(MLART_EIO, mlart_safetensors_kv_b_proj_heads(tpath("fifo"), 0, &g, &n));
    ck_assert(time(NULL) - t0 < 5);
    unlink(tpath("fifo"));
    printf("FIFO refused without waiting: %s\n", mlart_last_error());
}
END_TEST

static int raw_case(const char *hdr, size_t hlen, size_t dlen)
{
    static unsigned char data[256];
    uint16_t dst[6 * 4];
    mlart_geometry g = geom(2, 2, 1, 4);
    st_buf f;
    int rc;
    ck_assert_int_eq(st_build_raw(hdr, hlen, data, dlen, &f), 0);
    st_write_file(tpath("raw.safetensors"), f.data, f.len);
    rc = load(tpath("raw.safetensors"), 0, &g, 0, dst, sizeof dst);
    st_buf_free(&f);
    return rc;
}

#define T48 "\"model.layers.0.self_attn.kv_b_proj.weight\""

START_TEST(test_garbage_headers)
{
    static const char *bad[] = {
        "hello world",
        "{",
        "{" T48 ":",
        "[]",
        "{}x",
        "{" T48 ":{\"dtype\":\"BF16\",\"shape\":[6,4],\"data_offsets\":[0,48]}} x",
        "{" T48 ":{\"dtype\":\"BF16\",\"shape\":[-6,4],\"data_offsets\":[0,48]}}",
        "{" T48 ":{\"dtype\":\"BF16\",\"shape\":[6.0,4],\"data_offsets\":[0,48]}}",
        "{" T48 ":{\"dtype\":\"BF16\",\"shape\":[06,4],\"data_offsets\":[0,48]}}",
        "{" T48 ":{\"dtype\":\"BF16\",\"shape\":[6,4],\"data_offsets\":[0,48,0]}}",
        "{" T48 ":{\"dtype\":\"BF16\",\"shape\":[6,4],\"data_offsets\":[48]}}",
        "{" T48 ":{\"dtype\":\"BF16\",\"shape\":[6,4]}}",
        "{" T48 ":{\"dtype\":\"BF16\",\"dtype\":\"BF16\",\"shape\":[6,4],\"data_offsets\":[0,48]}}",
        "{" T48 ":{\"dtype\":\"BF16\",\"shape\":[6,4],\"data_offsets\":[0,48]}," T48
        ":{\"dtype\":\"BF16\",\"shape\":[6,4],\"data_offsets\":[0,48]}}",
        "{\"__metadata__\":{},\"__metadata__\":{}}",
        "{\"__metadata__\":{\"a\":1}}",
        "{\"__metadata__\":{\"a\":\"\\x\"}}",
        "{\"__metadata__\":{\"a\":\"\\ud800\"}}",
        "{\"__metadata__\":{\"a\":\"\\udc00\"}}",
        "{\"__metadata__\":{\"a\":\"\\u0000\"}}",
        "{\"__metadata__\":{\"a\":\"\\u12G4\"}}",
        "{\"__metadata__\":{\"a\":\"tab\there\"}}",
        "{\"__metadata__\":{\"a\":\"unterminated}}",
        "{\"__metadata__\":{\"a\":\"\xc3\x28\"}}",     /* bad UTF-8 */
        "{\"__metadata__\":{\"a\":\"\xe0\x80\x80\"}}", /* overlong */
        "{\"x\":{\"dtype\":\"BF16\",\"shape\":[],\"data_offsets\":[0,2],\"k\":[[[[[[[[[[[[[[[[[[["
        "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]"
        "]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}}",
        "{\"x\":{\"dtype\":\"BF16\",\"shape\":[],\"data_offsets\":[0,2],\"k\":tru}}",
        "{\"x\":{\"dtype\":\"BF16\",\"shape\":[],\"data_offsets\":[0,2],\"k\":1.}}",
        "{\"x\":{\"dtype\":\"BF16\",\"shape\":[],\"data_offsets\":[0,2],\"k\":-}}",
        "{\"x\":{\"dtype\":\"\",\"shape\":[],\"data_offsets\":[0,2]}}",
        "{\"x\":{\"dtype\":\"BF16\",\"shape\":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1],"
        "\"data_offsets\":[0,2]}}",
        "{\"x\":{\"dtype\":\"BF16\",\"shape\":[18446744073709551616],\"data_offsets\":[0,2]}}",
        "{\"x\":{}}",
        "{\"x\":[]}",
        "{,}",
        "{\"x\":{\"dtype\":\"BF16\",\"shape\":[],\"data_offsets\":[0,2]},}",
    };
    static const char *good =
        " {\"__metadata__\":{\"a\":\"\\u00e9\\ud83d\\ude00\"}, \"x\" : {\"shape\":[], \"k\":"
        "{\"n\":[1,-2.5e-3,true,false,null,\"s\"]},\"dtype\":\"BF16\",\"data_offsets\":[0,2]}}";
    mlart_st_header h;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = raw_case(bad[i], strlen(bad[i]), 2);
        ck_assert_msg(rc == MLART_EIO, "case %zu: %s -> %s", i, bad[i], mlart_status_name(rc));
    }
    ck_assert_int_ne(mlart_st_header_parse(good, strlen(good), 2, &h), 0); /* leading space */
    ck_assert_int_eq(mlart_st_header_parse(good + 1, strlen(good) - 1, 2, &h), 0);
    ck_assert_int_eq((int)h.count, 1);
    ck_assert_int_eq((int)h.entries[0].ndim, 0);
    mlart_st_header_free(&h);
    printf("%zu malformed headers refused with EIO; a header with nested unknown keys parsed\n",
           sizeof bad / sizeof bad[0]);
}
END_TEST

START_TEST(test_header_length)
{
    static const uint64_t lens[] = {UINT64_MAX, (uint64_t)1 << 63, 1u << 20, 0, 1};
    uint16_t dst[24];
    mlart_geometry g = geom(2, 2, 1, 4);
    unsigned char f[64] = {0};
    FILE *fp;
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        for (int k = 0; k < 8; k++)
            f[k] = (unsigned char)(lens[i] >> (8 * k));
        f[8] = '{';
        f[9] = '}';
        st_write_file(tpath("hlen.safetensors"), f, sizeof f);
        EXPECT_FAIL(MLART_EIO, load(tpath("hlen.safetensors"), 0, &g, 0, dst, sizeof dst));
    }
    /* a sparse file large enough to hold a header just past the 100 MB cap */
    fp = fopen(tpath("sparse.safetensors"), "wb");
    ck_assert_ptr_nonnull(fp);
    {
        uint64_t hl = MLART_ST_MAX_HEADER + 1;
        for (int k = 0; k < 8; k++)
            f[k] = (unsigned char)(hl >> (8 * k));
        fwrite(f, 1, 8, fp);
        ck_assert_int_eq(ftruncate(fileno(fp), (off_t)(hl + 64)), 0);
    }
    fclose(fp);
    EXPECT_FAIL(MLART_EIO, load(tpath("sparse.safetensors"), 0, &g, 0, dst, sizeof dst));
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "limit"));
    unlink(tpath("sparse.safetensors"));
    printf("header lengths 2^64-1, 2^63, > file, 0, 1, cap+1 (sparse file): EIO\n");
}
END_TEST

START_TEST(test_bad_args)
{
    uint16_t dst[24];
    mlart_geometry g = geom(2, 2, 1, 4);
    mlart_geometry z = geom(0, 2, 1, 4);
    ck_assert_int_eq(shape_case(2, 6, 4, 0), 0); /* leaves a valid shape.safetensors */
    EXPECT_FAIL(MLART_EINVAL, mlart_safetensors_load_kv_b_proj(NULL, 0, &g, 0, dst, sizeof dst));
    EXPECT_FAIL(MLART_EINVAL, mlart_safetensors_load_kv_b_proj(tpath("shape.safetensors"), 0,
                                                               NULL, 0, dst, sizeof dst));
    EXPECT_FAIL(MLART_EINVAL, mlart_safetensors_load_kv_b_proj(tpath("shape.safetensors"), 0, &g,
                                                               0, NULL, sizeof dst));
    EXPECT_FAIL(MLART_EINVAL, load(tpath("shape.safetensors"), -1, &g, 0, dst, sizeof dst));
    EXPECT_FAIL(MLART_EINVAL, load(tpath("shape.safetensors"), 0, &g, -1, dst, sizeof dst));
    EXPECT_FAIL(MLART_EINVAL, load(tpath("shape.safetensors"), 0, &z, 0, dst, sizeof dst));
    EXPECT_FAIL(MLART_EIO, load(tpath("does-not-exist"), 0, &g, 0, dst, sizeof dst));
    EXPECT_FAIL(MLART_EIO, load(tmpdir, 0, &g, 0, dst, sizeof dst));
    printf("NULL arguments, negative layer/offset, zero heads: EINVAL; missing file, directory: "
           "EIO\n");
}
END_TEST

int main(void)
{
    const char *env = getenv("MLART_SEED");
    Suite *s = suite_create("safetensors");
    TCase *tc = tcase_create("load");
    int failed;
    const char *base = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    seed = env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) * 2654435761u;
    if (!seed)
        seed = 1;
    rng = seed;
    printf("seed %llu (MLART_SEED to repeat)\n", (unsigned long long)seed);
    snprintf(tmpdir, sizeof tmpdir, "%s/mlart-st-XXXXXX", base);
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_bf16_known_values);
    tcase_add_test(tc, test_fp8_known_values);
    tcase_add_test(tc, test_escaped_names);
    tcase_add_test(tc, test_truncated);
    tcase_add_test(tc, test_lying_headers);
    tcase_add_test(tc, test_wrong_shape);
    tcase_add_test(tc, test_garbage_headers);
    tcase_add_test(tc, test_header_length);
    tcase_add_test(tc, test_bad_args);
    tcase_add_test(tc, test_heads_query);
    tcase_add_test(tc, test_head_offset_overflow);
    tcase_add_test(tc, test_fifo);
    suite_add_tcase(s, tc);
    failed = check_run(s, CK_FORK_GETENV);
    {
        char cmd[300];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
        if (system(cmd)) {
        }
    }
    return failed ? 1 : 0;
}
