/* Deterministic random mutation of .safetensors files: thousands of damaged
 * headers and files go through the parser and the loader, built with
 * AddressSanitizer and UBSan, and none may crash, read out of bounds, leak,
 * or fail without a message.  The header text sits in a buffer of exactly
 * its length, so a read one byte past it is caught. */
#define _POSIX_C_SOURCE 200809L
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check_run.h"
#include "mlart/weights.h"
#include "runtime/safetensors.h"
#include "st_writer.h"

static uint64_t rng;
static char path[256];

static uint64_t rnd64(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static uint32_t rnd(uint32_t n)
{
    return n ? (uint32_t)((rnd64() >> 11) % n) : 0;
}

#define NBASE 3
static st_buf base[NBASE];

static int make_bases(void)
{
    static uint16_t w[2 * 24 * 32], x[16];
    static uint8_t q[264 * 160];
    static float sc[3 * 2];
    for (size_t i = 0; i < sizeof w / 2; i++)
        w[i] = (uint16_t)(0x3800 + rnd(0x800));
    for (size_t i = 0; i < sizeof q; i++)
        q[i] = (uint8_t)(rnd(0x7e) | (rnd(2) << 7));
    for (int i = 0; i < 6; i++)
        sc[i] = 0.01f * (float)(i + 1);
    st_tensor a[2] = {
        {"model.layers.0.self_attn.kv_b_proj.weight", "BF16", 2, {48, 32}, w, sizeof w, 0, 0, 0},
        {"model.layers.0.self_attn.q_b_proj.weight", "BF16", 2, {4, 4}, x, 32, 0, 0, 0},
    };
    st_tensor b[2] = {
        {"model.layers.0.self_attn.kv_b_proj.weight", "F8_E4M3", 2, {264, 160}, q, sizeof q, 0,
         0, 0},
        {"model.layers.0.self_attn.kv_b_proj.weight_scale_inv", "F32", 2, {3, 2}, sc, sizeof sc,
         0, 0, 0},
    };
    st_tensor c[3] = {
        {"model.layers.0.self_attn.kv\\u005fb_proj.weight", "BF16", 2, {24, 32}, w, 24 * 64, 0,
         0, 0},
        {"n\\ud83d\\ude00\\t", "U8", 1, {8}, x, 8, 0, 0, 0},
        {"z", "I64", 0, {0}, x, 8, 0, 0, 0},
    };
    return st_build(a, 2, 1, &base[0]) || st_build(b, 2, 0, &base[1]) ||
           st_build(c, 3, 1, &base[2]);
}

static const char interesting[] = "{}[]\":,\\-+0123456789.eEu tfn\x00\x7f\x80\xff\xc3";
static const char *const numbers[] = {"0", "-1", "18446744073709551615", "18446744073709551616",
                                      "9223372036854775807", "4294967296", "1e3", "00", "1.5",
                                      "99999999999999999999999"};

/* One random edit of buf (len bytes, capacity cap); returns the new length. */
static size_t mutate(unsigned char *buf, size_t len, size_t cap)
{
    size_t at = len ? rnd((uint32_t)len) : 0;
    switch (rnd(8)) {
    case 0: /* bit flip */
        if (len)
            buf[at] ^= (unsigned char)(1u << rnd(8));
        return len;
    case 1: /* structural character */
        if (len)
            buf[at] = (unsigned char)interesting[rnd(sizeof interesting - 1)];
        return len;
    case 2: { /* delete a range */
        size_t n = rnd(16) + 1;
        if (at + n > len)
            n = len - at;
        memmove(buf + at, buf + at + n, len - at - n);
        return len - n;
    }
    case 3: { /* copy a range from elsewhere over or into the buffer */
        size_t from = len ? rnd((uint32_t)len) : 0, n = rnd(24) + 1;
        if (from + n > len || len + n > cap)
            return len;
        memmove(buf + at + n, buf + at, len - at);
        memmove(buf + at, buf + (from >= at ? from + n : from), n);
        return len + n;
    }
    case 4: /* truncate */
        return at;
    case 5: { /* replace a digit run with an awkward number */
        size_t s = at, e;
        const char *num = numbers[rnd(sizeof numbers / sizeof numbers[0])];
        size_t k = strlen(num);
        while (s < len && (buf[s] < '0' || buf[s] > '9'))
            s++;
        e = s;
        while (e < len && buf[e] >= '0' && buf[e] <= '9')
            e++;
        if (s >= len || len - (e - s) + k > cap)
            return len;
        memmove(buf + s + k, buf + e, len - e);
        memcpy(buf + s, num, k);
        return len - (e - s) + k;
    }
    case 6: /* the 8-byte header length */
        if (len >= 8) {
            uint64_t v;
            switch (rnd(4)) {
            case 0: v = rnd64(); break;
            case 1: v = (uint64_t)len - 8 + rnd(5) - 2; break;
            case 2: v = rnd(64); break;
            default: v = (uint64_t)1 << rnd(64); break;
            }
            for (int i = 0; i < 8; i++)
                buf[i] = (unsigned char)(v >> (8 * i));
        }
        return len;
    default: /* random byte */
        if (len)
            buf[at] = (unsigned char)rnd(256);
        return len;
    }
}

static int known_status(int rc)
{
    return rc == 0 || strcmp(mlart_status_name(rc), "MLART_UNKNOWN") != 0;
}

START_TEST(test_mutated_headers)
{
    size_t ok = 0, refused = 0;
    for (int it = 0; it < 30000; it++) {
        const st_buf *b = &base[rnd(NBASE)];
        size_t cap = b->len + 256, len = b->len, hl;
        unsigned char *buf = malloc(cap);
        uint64_t h = 0;
        char *text;
        mlart_st_header hdr;
        int rc, n = 1 + (int)rnd(4);
        memcpy(buf, b->data, len);
        for (int k = 0; k < n; k++)
            len = mutate(buf, len, cap);
        if (len < 8) {
            free(buf);
            continue;
        }
        for (int i = 7; i >= 0; i--)
            h = (h << 8) | buf[i];
        hl = h > len - 8 ? len - 8 : (size_t)h;
        text = malloc(hl ? hl : 1); /* exact size: ASan sees any overrun */
        memcpy(text, buf + 8, hl);
        rc = mlart_st_header_parse(text, hl, (uint64_t)(len - 8 - hl), &hdr);
        ck_assert_msg(known_status(rc), "unknown status %d", rc);
        if (rc == 0) {
            ok++;
            for (size_t i = 0; i < hdr.count; i++) {
                const mlart_st_entry *e = &hdr.entries[i];
                ck_assert(e->begin <= e->end && e->end <= len - 8 - hl);
                ck_assert(mlart_st_header_find(&hdr, e->name) == e);
            }
            mlart_st_header_free(&hdr);
        } else {
            refused++;
            ck_assert(mlart_last_error()[0] != '\0');
        }
        free(text);
        free(buf);
    }
    printf("30000 mutated headers: %zu parsed, %zu refused, no crash\n", ok, refused);
    ck_assert_uint_gt(refused, 1000);
    ck_assert_uint_gt(ok, 10); /* some mutations (e.g. in names) leave a valid file */
}
END_TEST

START_TEST(test_mutated_files)
{
    static uint16_t dst[264 * 160];
    size_t loaded = 0, refused = 0;
    for (int it = 0; it < 4000; it++) {
        int which = (int)rnd(NBASE);
        const st_buf *b = &base[which];
        size_t cap = b->len + 256, len = b->len;
        unsigned char *buf = malloc(cap);
        mlart_geometry g;
        int rc, n = 1 + (int)rnd(3);
        memcpy(buf, b->data, len);
        for (int k = 0; k < n; k++)
            len = mutate(buf, len, cap);
        ck_assert_int_eq(st_write_file(path, buf, len), 0);
        memset(&g, 0, sizeof g);
        g.heads = which == 1 ? 3 : (which == 0 ? 2 : 1);
        g.qk_nope = which == 1 ? 48 : 16;
        g.v_head = which == 1 ? 40 : 8;
        g.kv_lora = which == 1 ? 160 : 32;
        rc = mlart_safetensors_load_kv_b_proj(path, 0, &g, (int)rnd(2), dst, sizeof dst);
        ck_assert_msg(known_status(rc), "unknown status %d", rc);
        if (rc)
            refused++, ck_assert(mlart_last_error()[0] != '\0');
        else
            loaded++;
        free(buf);
    }
    unlink(path);
    printf("4000 mutated files through the loader: %zu loaded, %zu refused, no crash\n", loaded,
           refused);
    ck_assert_uint_gt(refused, 1000);
}
END_TEST

int main(void)
{
    const char *env = getenv("MLART_SEED");
    uint64_t seed = env ? strtoull(env, NULL, 0) : 20261201u; /* fixed: a failure repeats */
    const char *tmp = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    Suite *s = suite_create("safetensors-mutation");
    TCase *tc = tcase_create("mutate");
    int failed;
    rng = seed ? seed : 1;
    printf("seed %llu (MLART_SEED to change)\n", (unsigned long long)seed);
    snprintf(path, sizeof path, "%s/mlart-st-mutate-%ld.safetensors", tmp, (long)getpid());
    if (make_bases()) {
        fprintf(stderr, "out of memory building the base files\n");
        return 1;
    }
    tcase_set_timeout(tc, 240);
    tcase_add_test(tc, test_mutated_headers);
    tcase_add_test(tc, test_mutated_files);
    suite_add_tcase(s, tc);
    failed = check_run(s, CK_FORK_GETENV);
    for (int i = 0; i < NBASE; i++)
        st_buf_free(&base[i]);
    return failed ? 1 : 0;
}
