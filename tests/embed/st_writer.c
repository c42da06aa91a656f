#define _POSIX_C_SOURCE 200809L
#include "st_writer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct sb {
    char *s;
    size_t n, cap;
    int oom;
} sb;

static void sb_add(sb *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#include <stdarg.h>
static void sb_add(sb *b, const char *fmt, ...)
{
    va_list ap;
    int k;
    if (b->oom)
        return;
    for (;;) {
        va_start(ap, fmt);
        k = vsnprintf(b->s ? b->s + b->n : NULL, b->s ? b->cap - b->n : 0, fmt, ap);
        va_end(ap);
        if (k < 0) {
            b->oom = 1;
            return;
        }
        if (b->s && (size_t)k < b->cap - b->n) {
            b->n += (size_t)k;
            return;
        }
        size_t ncap = (b->cap + (size_t)k + 1) * 2;
        char *ns = realloc(b->s, ncap);
        if (!ns) {
            b->oom = 1;
            return;
        }
        b->s = ns;
        b->cap = ncap;
    }
}

int st_build_raw(const char *header, size_t hlen, const void *data, size_t dlen, st_buf *out)
{
    unsigned char *p = malloc(8 + hlen + dlen + 1);
    if (!p)
        return -1;
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    memcpy(p + 8, header, hlen);
    if (dlen)
        memcpy(p + 8 + hlen, data, dlen);
    out->data = p;
    out->len = 8 + hlen + dlen;
    return 0;
}

int st_build(const st_tensor *t, int n, int meta, st_buf *out)
{
    sb h = {0};
    uint64_t off = 0;
    size_t dlen = 0;
    unsigned char *data;
    int rc;
    sb_add(&h, "{");
    if (meta)
        sb_add(&h, "\"__metadata__\":{\"format\":\"pt\",\"note\":\"written by \\\"st_writer\\\"\"}%s",
               n ? "," : "");
    for (int i = 0; i < n; i++) {
        uint64_t b = t[i].lie_offsets ? t[i].begin : off;
        uint64_t e = t[i].lie_offsets ? t[i].end : off + t[i].bytes;
        sb_add(&h, "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[", i ? "," : "", t[i].name, t[i].dtype);
        for (int d = 0; d < t[i].ndim; d++)
            sb_add(&h, "%s%lld", d ? "," : "", (long long)t[i].shape[d]);
        sb_add(&h, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)b,
               (unsigned long long)e);
        off += t[i].bytes;
        dlen += t[i].bytes;
    }
    sb_add(&h, "}");
    while (!h.oom && h.n % 8)
        sb_add(&h, " ");
    if (h.oom) {
        free(h.s);
        return -1;
    }
    data = malloc(dlen ? dlen : 1);
    if (!data) {
        free(h.s);
        return -1;
    }
    dlen = 0;
    for (int i = 0; i < n; i++) {
        memcpy(data + dlen, t[i].data, t[i].bytes);
        dlen += t[i].bytes;
    }
    rc = st_build_raw(h.s, h.n, data, dlen, out);
    free(h.s);
    free(data);
    return rc;
}

int st_write_file(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    int rc = 0;
    if (!f)
        return -1;
    if (len && fwrite(data, 1, len, f) != len)
        rc = -1;
    if (fclose(f))
        rc = -1;
    return rc;
}

void st_buf_free(st_buf *b)
{
    free(b->data);
    b->data = NULL;
    b->len = 0;
}

double st_ref_e4m3(uint8_t b)
{
    /* table of the e4m3fn format: exponent bias 7, subnormal quantum 2^-9 */
    int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    double v = e ? (8.0 + m) * pow(2.0, e - 10) : m * pow(2.0, -9);
    return s ? -v : v;
}

uint16_t st_ref_bf16(double d)
{
    uint64_t u, keep, rest, half = (uint64_t)1 << 44;
    memcpy(&u, &d, sizeof u);
    if (d == 0.0)
        return (uint16_t)((u >> 63) << 15);
    /* double: 52 mantissa bits; bf16 keeps 7 -> drop 45 bits */
    keep = u >> 45;
    rest = u & ((half << 1) - 1);
    if (rest > half || (rest == half && (keep & 1)))
        keep++;
    /* re-bias exponent from 1023 to 127: bf16 bits = sign | exp8 | mant7 */
    {
        uint64_t sign = keep >> 18, exp11 = (keep >> 7) & 0x7ff, mant = keep & 0x7f;
        /* a mantissa carry already bumped exp11 through `keep++` */
        return (uint16_t)((sign << 15) | ((exp11 - 1023 + 127) << 7) | mant);
    }
}
