/* .safetensors reading: a strict scanner for the header's JSON subset, bounded
 * reads, and the kv_b_proj loader of include/mlart/weights.h. */
#define _POSIX_C_SOURCE 200809L
#define _FILE_OFFSET_BITS 64

#include "runtime/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mlart/weights.h"
#include "ops/numerics.h"
#include "runtime/status.h"

/* ---- JSON scanner ------------------------------------------------------ */

/* Nesting limit for values we skip (unknown keys); real headers nest 3 deep. */
#define ST_MAX_DEPTH 64

typedef struct st_scan {
    const char *begin, *p, *end;
} st_scan;

static int st_fail(const st_scan *s, const char *what)
{
    return mlart_set_error(MLART_EIO, "safetensors header: %s at byte %zu of %zu", what,
                           (size_t)(s->p - s->begin), (size_t)(s->end - s->begin));
}

static void st_ws(st_scan *s)
{
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r'))
        s->p++;
}

/* Skip whitespace, then consume `c` if it comes next: 1 if it did. */
static int st_accept(st_scan *s, char c)
{
    st_ws(s);
    if (s->p < s->end && *s->p == c) {
        s->p++;
        return 1;
    }
    return 0;
}

/* Skip whitespace, then consume `c` or fail. */
static int st_expect(st_scan *s, char c)
{
    char what[32];
    if (st_accept(s, c))
        return 0;
    snprintf(what, sizeof what, "expected '%c'", c);
    return st_fail(s, s->p < s->end ? what : "unexpected end");
}

/* Whole-text UTF-8 check (the format requires UTF-8): rejects overlongs,
 * surrogates and code points past U+10FFFF. */
static int st_utf8_valid(const unsigned char *p, size_t n, size_t *bad)
{
    size_t i = 0;
    while (i < n) {
        unsigned c = p[i];
        size_t k;
        uint32_t cp, min;
        if (c < 0x80) {
            i++;
            continue;
        }
        if ((c & 0xe0) == 0xc0) {
            k = 1, cp = c & 0x1f, min = 0x80;
        } else if ((c & 0xf0) == 0xe0) {
            k = 2, cp = c & 0x0f, min = 0x800;
        } else if ((c & 0xf8) == 0xf0) {
            k = 3, cp = c & 0x07, min = 0x10000;
        } else {
            *bad = i;
            return 0;
        }
        if (n - i <= k) {
            *bad = i;
            return 0;
        }
        for (size_t j = 1; j <= k; j++) {
            if ((p[i + j] & 0xc0) != 0x80) {
                *bad = i;
                return 0;
            }
            cp = (cp << 6) | (p[i + j] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
            *bad = i;
            return 0;
        }
        i += k + 1;
    }
    return 1;
}

static int st_hex4(const char *p, uint32_t *v)
{
    uint32_t x = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        x <<= 4;
        if (c >= '0' && c <= '9')
            x |= (uint32_t)(c - '0');
        else if (c >= 'a' && c <= 'f')
            x |= (uint32_t)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F')
            x |= (uint32_t)(c - 'A' + 10);
        else
            return -1;
    }
    *v = x;
    return 0;
}

static size_t st_put_utf8(char *o, uint32_t cp)
{
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (char)(0xc0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xe0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        o[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    o[0] = (char)(0xf0 | (cp >> 18));
    o[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    o[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* Parse a string.  out == NULL: validate and skip.  Otherwise *out is a
 * malloc'd NUL-terminated copy (decoded is never longer than escaped, so the
 * raw length bounds the allocation).  Embedded NUL (\u0000) is refused: names
 * are C strings. */
static int st_string(st_scan *s, char **out, size_t *out_len)
{
    const char *q;
    char *buf = NULL;
    size_t n = 0;
    st_ws(s);
    if (s->p >= s->end || *s->p != '"')
        return st_fail(s, s->p < s->end ? "expected a string" : "unexpected end");
    q = ++s->p;
    /* find the closing quote first, so the copy is sized before decoding */
    while (q < s->end && *q != '"') {
        if (*q == '\\') {
            if (++q >= s->end)
                break;
        }
        q++;
    }
    if (q >= s->end)
        return st_fail(s, "unterminated string");
    if (out && !(buf = malloc((size_t)(q - s->p) + 1)))
        return mlart_set_error(MLART_ENOMEM, "safetensors header: out of memory");
    while (s->p < q) {
        unsigned char c = (unsigned char)*s->p;
        if (c < 0x20) {
            free(buf);
            return st_fail(s, "control character in string");
        }
        if (c != '\\') {
            if (buf)
                buf[n++] = (char)c;
            s->p++;
            continue;
        }
        s->p++; /* s->p < q holds: the scan above never ends on a backslash */
        switch (*s->p) {
        case '"': c = '"'; break;
        case '\\': c = '\\'; break;
        case '/': c = '/'; break;
        case 'b': c = '\b'; break;
        case 'f': c = '\f'; break;
        case 'n': c = '\n'; break;
        case 'r': c = '\r'; break;
        case 't': c = '\t'; break;
        case 'u': {
            uint32_t cp, lo;
            if (q - s->p < 5 || st_hex4(s->p + 1, &cp)) {
                free(buf);
                return st_fail(s, "bad \\u escape");
            }
            s->p += 5;
            if (cp >= 0xdc00 && cp <= 0xdfff) {
                free(buf);
                return st_fail(s, "lone low surrogate");
            }
            if (cp >= 0xd800 && cp <= 0xdbff) {
                if (q - s->p < 6 || s->p[0] != '\\' || s->p[1] != 'u' || st_hex4(s->p + 2, &lo) ||
                    lo < 0xdc00 || lo > 0xdfff) {
                    free(buf);
                    return st_fail(s, "unpaired high surrogate");
                }
                s->p += 6;
                cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            }
            if (cp == 0) {
                free(buf);
                return st_fail(s, "NUL character in string");
            }
            if (buf)
                n += st_put_utf8(buf + n, cp);
            continue;
        }
        default:
            free(buf);
            return st_fail(s, "bad escape in string");
        }
        if (buf)
            buf[n++] = (char)c;
        s->p++;
    }
    s->p = q + 1;
    if (buf) {
        buf[n] = '\0';
        *out = buf;
        if (out_len)
            *out_len = n;
    }
    return 0;
}

/* A non-negative JSON integer that fits in uint64_t (no fraction, no exponent). */
static int st_u64(st_scan *s, uint64_t *v)
{
    uint64_t x = 0;
    const char *start;
    st_ws(s);
    start = s->p;
    if (s->p < s->end && *s->p == '-')
        return st_fail(s, "negative integer");
    while (s->p < s->end && *s->p >= '0' && *s->p <= '9') {
        unsigned d = (unsigned)(*s->p - '0');
        if (x > (UINT64_MAX - d) / 10)
            return st_fail(s, "integer overflows 64 bits");
        x = x * 10 + d;
        s->p++;
    }
    if (s->p == start)
        return st_fail(s, s->p < s->end ? "expected an integer" : "unexpected end");
    if (s->p - start > 1 && *start == '0') {
        s->p = start;
        return st_fail(s, "leading zero in integer");
    }
    if (s->p < s->end && (*s->p == '.' || *s->p == 'e' || *s->p == 'E'))
        return st_fail(s, "expected an integer, got a fraction or exponent");
    *v = x;
    return 0;
}

/* Skip any JSON number (full grammar). */
static int st_skip_number(st_scan *s)
{
    const char *p = s->p, *e = s->end;
    if (p < e && *p == '-')
        p++;
    if (p < e && *p == '0')
        p++;
    else if (p < e && *p >= '1' && *p <= '9')
        while (p < e && *p >= '0' && *p <= '9')
            p++;
    else
        return st_fail(s, "bad number");
    if (p < e && *p == '.') {
        if (++p >= e || *p < '0' || *p > '9') {
            s->p = p;
            return st_fail(s, "bad fraction");
        }
        while (p < e && *p >= '0' && *p <= '9')
            p++;
    }
    if (p < e && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < e && (*p == '+' || *p == '-'))
            p++;
        if (p >= e || *p < '0' || *p > '9') {
            s->p = p;
            return st_fail(s, "bad exponent");
        }
        while (p < e && *p >= '0' && *p <= '9')
            p++;
    }
    s->p = p;
    return 0;
}

static int st_skip_value(st_scan *s, int depth)
{
    st_ws(s);
    if (s->p >= s->end)
        return st_fail(s, "unexpected end");
    if (depth > ST_MAX_DEPTH)
        return st_fail(s, "nesting too deep");
    switch (*s->p) {
    case '"':
        return st_string(s, NULL, NULL);
    case '{':
        s->p++;
        if (st_accept(s, '}'))
            return 0;
        for (;;) {
            MLART_CHECK(st_string(s, NULL, NULL));
            MLART_CHECK(st_expect(s, ':'));
            MLART_CHECK(st_skip_value(s, depth + 1));
            if (st_accept(s, ','))
                continue;
            return st_expect(s, '}');
        }
    case '[':
        s->p++;
        if (st_accept(s, ']'))
            return 0;
        for (;;) {
            MLART_CHECK(st_skip_value(s, depth + 1));
            if (st_accept(s, ','))
                continue;
            return st_expect(s, ']');
        }
    case 't':
    case 'f':
    case 'n': {
        static const char *const words[] = {"true", "false", "null"};
        for (int i = 0; i < 3; i++) {
            size_t n = strlen(words[i]);
            if ((size_t)(s->end - s->p) >= n && !memcmp(s->p, words[i], n)) {
                s->p += n;
                return 0;
            }
        }
        return st_fail(s, "bad literal");
    }
    default:
        return st_skip_number(s);
    }
}

/* [u64, ...] with at most `max` items; *count gets the number read. */
static int st_u64_array(st_scan *s, uint64_t *v, int max, int *count)
{
    int n = 0;
    MLART_CHECK(st_expect(s, '['));
    if (st_accept(s, ']')) {
        *count = 0;
        return 0;
    }
    for (;;) {
        if (n == max)
            return st_fail(s, "too many integers in array");
        MLART_CHECK(st_u64(s, &v[n++]));
        if (st_accept(s, ','))
            continue;
        MLART_CHECK(st_expect(s, ']'));
        *count = n;
        return 0;
    }
}

static const struct {
    const char *name;
    size_t size;
    mlart_dtype mdtype;
} st_dtypes[] = {
    {"BOOL", 1, MLART_DTYPE_INVALID},    {"U8", 1, MLART_DTYPE_U8},
    {"I8", 1, MLART_DTYPE_INVALID},      {"F8_E5M2", 1, MLART_DTYPE_INVALID},
    {"F8_E4M3", 1, MLART_DTYPE_FP8_E4M3}, {"I16", 2, MLART_DTYPE_INVALID},
    {"U16", 2, MLART_DTYPE_INVALID},     {"F16", 2, MLART_DTYPE_INVALID},
    {"BF16", 2, MLART_DTYPE_BF16},       {"I32", 4, MLART_DTYPE_I32},
    {"U32", 4, MLART_DTYPE_INVALID},     {"F32", 4, MLART_DTYPE_F32},
    {"F64", 8, MLART_DTYPE_INVALID},     {"I64", 8, MLART_DTYPE_I64},
    {"U64", 8, MLART_DTYPE_INVALID},
};

/* {"dtype": "...", "shape": [...], "data_offsets": [b, e], <other keys skipped>} */
static int st_tensor_info(st_scan *s, mlart_st_entry *e)
{
    int have_dtype = 0, have_shape = 0, have_offsets = 0;
    MLART_CHECK(st_expect(s, '{'));
    st_ws(s);
    if (s->p < s->end && *s->p == '}')
        return st_fail(s, "tensor entry without dtype, shape and data_offsets");
    for (;;) {
        char *key = NULL;
        const char *key_at;
        st_ws(s);
        key_at = s->p;
        MLART_CHECK(st_string(s, &key, NULL));
        if (st_expect(s, ':')) {
            free(key);
            return MLART_EIO;
        }
        if (!strcmp(key, "dtype")) {
            char *dt = NULL;
            size_t n = 0;
            free(key);
            if (have_dtype++) {
                s->p = key_at;
                return st_fail(s, "duplicate \"dtype\"");
            }
            MLART_CHECK(st_string(s, &dt, &n));
            if (n == 0 || n >= sizeof e->dtype) {
                free(dt);
                return st_fail(s, "dtype name empty or too long");
            }
            memcpy(e->dtype, dt, n + 1);
            free(dt);
        } else if (!strcmp(key, "shape")) {
            uint64_t v[MLART_ST_MAX_DIMS];
            int n;
            free(key);
            if (have_shape++) {
                s->p = key_at;
                return st_fail(s, "duplicate \"shape\"");
            }
            MLART_CHECK(st_u64_array(s, v, MLART_ST_MAX_DIMS, &n));
            e->ndim = n;
            for (int i = 0; i < n; i++) {
                if (v[i] > (uint64_t)INT64_MAX)
                    return st_fail(s, "dimension too large");
                e->shape[i] = (int64_t)v[i];
            }
        } else if (!strcmp(key, "data_offsets")) {
            uint64_t v[2];
            int n;
            free(key);
            if (have_offsets++) {
                s->p = key_at;
                return st_fail(s, "duplicate \"data_offsets\"");
            }
            MLART_CHECK(st_u64_array(s, v, 2, &n));
            if (n != 2)
                return st_fail(s, "data_offsets needs exactly 2 integers");
            e->begin = v[0];
            e->end = v[1];
        } else {
            free(key);
            MLART_CHECK(st_skip_value(s, 1));
        }
        if (st_accept(s, ','))
            continue;
        MLART_CHECK(st_expect(s, '}'));
        break;
    }
    if (!have_dtype || !have_shape || !have_offsets)
        return st_fail(s, "tensor entry lacks dtype, shape or data_offsets");
    return 0;
}

/* "__metadata__": an object whose values are all strings. */
static int st_metadata(st_scan *s, size_t *count)
{
    size_t n = 0;
    MLART_CHECK(st_expect(s, '{'));
    if (st_accept(s, '}')) {
        *count = 0;
        return 0;
    }
    for (;;) {
        MLART_CHECK(st_string(s, NULL, NULL));
        MLART_CHECK(st_expect(s, ':'));
        st_ws(s);
        if (s->p < s->end && *s->p != '"')
            return st_fail(s, "__metadata__ values must be strings");
        MLART_CHECK(st_string(s, NULL, NULL));
        n++;
        if (st_accept(s, ','))
            continue;
        MLART_CHECK(st_expect(s, '}'));
        *count = n;
        return 0;
    }
}

static int st_cmp_name(const void *a, const void *b)
{
    return strcmp(((const mlart_st_entry *)a)->name, ((const mlart_st_entry *)b)->name);
}

static int st_cmp_offsets(const void *a, const void *b)
{
    const mlart_st_entry *x = *(const mlart_st_entry *const *)a;
    const mlart_st_entry *y = *(const mlart_st_entry *const *)b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return 0;
}

/* Per-entry checks: dtype x shape = byte size, offsets inside the data. */
static int st_check_entry(mlart_st_entry *e, uint64_t data_bytes)
{
    uint64_t numel = 1, bytes;
    e->elem_size = 0;
    e->mdtype = MLART_DTYPE_INVALID;
    for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++) {
        if (!strcmp(e->dtype, st_dtypes[i].name)) {
            e->elem_size = st_dtypes[i].size;
            e->mdtype = st_dtypes[i].mdtype;
        }
    }
    for (int i = 0; i < e->ndim; i++) {
        uint64_t d = (uint64_t)e->shape[i];
        if (d != 0 && numel > (uint64_t)INT64_MAX / d)
            return mlart_set_error(MLART_EIO, "safetensors: tensor \"%s\": shape overflows",
                                   e->name);
        numel *= d;
    }
    e->numel = (int64_t)numel;
    if (e->begin > e->end || e->end > data_bytes)
        return mlart_set_error(MLART_EIO,
                               "safetensors: tensor \"%s\": data_offsets [%llu, %llu] outside the "
                               "%llu-byte data region",
                               e->name, (unsigned long long)e->begin, (unsigned long long)e->end,
                               (unsigned long long)data_bytes);
    /* An unknown dtype (a newer format revision) is kept with its bounds
     * checked; its size cannot be, and it is refused if anyone asks for it. */
    if (e->elem_size) {
        if (numel > UINT64_MAX / e->elem_size)
            return mlart_set_error(MLART_EIO, "safetensors: tensor \"%s\": size overflows",
                                   e->name);
        bytes = numel * e->elem_size;
        if (bytes != e->end - e->begin)
            return mlart_set_error(MLART_EIO,
                                   "safetensors: tensor \"%s\": %s x %d-d shape needs %llu bytes "
                                   "but data_offsets [%llu, %llu] hold %llu",
                                   e->name, e->dtype, e->ndim, (unsigned long long)bytes,
                                   (unsigned long long)e->begin, (unsigned long long)e->end,
                                   (unsigned long long)(e->end - e->begin));
    }
    return 0;
}

void mlart_st_header_free(mlart_st_header *h)
{
    if (!h)
        return;
    for (size_t i = 0; i < h->count; i++)
        free(h->entries[i].name);
    free(h->entries);
    h->entries = NULL;
    h->count = 0;
}

/* Tensors must tile [0, data_bytes) exactly: an overlap means two tensors
 * share bytes, a hole or tail means the header does not describe the file. */
static int st_check_tiling(const mlart_st_header *h, uint64_t data_bytes)
{
    const mlart_st_entry **by_off;
    uint64_t at = 0;
    int rc = 0;
    if (h->count == 0) {
        if (data_bytes)
            return mlart_set_error(MLART_EIO,
                                   "safetensors: %llu data bytes but no tensor in the header",
                                   (unsigned long long)data_bytes);
        return 0;
    }
    by_off = malloc(h->count * sizeof *by_off);
    if (!by_off)
        return mlart_set_error(MLART_ENOMEM, "safetensors: out of memory");
    for (size_t i = 0; i < h->count; i++)
        by_off[i] = &h->entries[i];
    qsort(by_off, h->count, sizeof *by_off, st_cmp_offsets);
    for (size_t i = 0; i < h->count && !rc; i++) {
        const mlart_st_entry *e = by_off[i];
        if (e->begin < at)
            rc = mlart_set_error(MLART_EIO,
                                 "safetensors: tensor \"%s\" [%llu, %llu) overlaps the tensor "
                                 "before it (ends at %llu)",
                                 e->name, (unsigned long long)e->begin,
                                 (unsigned long long)e->end, (unsigned long long)at);
        else if (e->begin > at)
            rc = mlart_set_error(MLART_EIO,
                                 "safetensors: bytes [%llu, %llu) of the data region belong to no "
                                 "tensor (next is \"%s\")",
                                 (unsigned long long)at, (unsigned long long)e->begin, e->name);
        else
            at = e->end;
    }
    if (!rc && at != data_bytes)
        rc = mlart_set_error(MLART_EIO,
                             "safetensors: data region is %llu bytes but the tensors end at %llu",
                             (unsigned long long)data_bytes, (unsigned long long)at);
    free(by_off);
    return rc;
}

int mlart_st_header_parse(const char *text, size_t len, uint64_t data_bytes,
                          mlart_st_header *out)
{
    st_scan s = {text, text, text + len};
    mlart_st_header h = {NULL, 0, 0};
    size_t cap = 0, bad = 0;
    int have_meta = 0, rc;

    if (!text || !out)
        return mlart_set_error(MLART_EINVAL, "safetensors: NULL argument");
    if (!st_utf8_valid((const unsigned char *)text, len, &bad)) {
        s.p = text + bad;
        return st_fail(&s, "invalid UTF-8");
    }
    if (len == 0 || text[0] != '{')
        return st_fail(&s, "header must start with '{'");
    s.p++;
    st_ws(&s);
    if (s.p < s.end && *s.p == '}') {
        s.p++;
    } else {
        for (;;) {
            char *name = NULL;
            const char *name_at;
            st_ws(&s);
            name_at = s.p;
            if ((rc = st_string(&s, &name, NULL)))
                goto fail;
            if ((rc = st_expect(&s, ':'))) {
                free(name);
                goto fail;
            }
            if (!strcmp(name, "__metadata__")) {
                free(name);
                if (have_meta++) {
                    s.p = name_at;
                    rc = st_fail(&s, "duplicate __metadata__");
                    goto fail;
                }
                if ((rc = st_metadata(&s, &h.metadata_count)))
                    goto fail;
            } else {
                mlart_st_entry *e;
                if (h.count == cap) {
                    size_t ncap = cap ? cap * 2 : 16;
                    mlart_st_entry *ne = realloc(h.entries, ncap * sizeof *ne);
                    if (!ne) {
                        free(name);
                        rc = mlart_set_error(MLART_ENOMEM, "safetensors: out of memory");
                        goto fail;
                    }
                    h.entries = ne;
                    cap = ncap;
                }
                e = &h.entries[h.count++];
                memset(e, 0, sizeof *e);
                e->name = name;
                if ((rc = st_tensor_info(&s, e)))
                    goto fail;
            }
            st_ws(&s);
            if (s.p < s.end && *s.p == ',') {
                s.p++;
                continue;
            }
            if ((rc = st_expect(&s, '}')))
                goto fail;
            break;
        }
    }
    /* the format pads the header with spaces so the data starts aligned */
    st_ws(&s);
    if (s.p != s.end) {
        rc = st_fail(&s, "trailing bytes after the header object");
        goto fail;
    }
    if (h.count) {
        qsort(h.entries, h.count, sizeof *h.entries, st_cmp_name);
        for (size_t i = 1; i < h.count; i++) {
            if (!strcmp(h.entries[i - 1].name, h.entries[i].name)) {
                rc = mlart_set_error(MLART_EIO, "safetensors: tensor \"%s\" listed twice",
                                     h.entries[i].name);
                goto fail;
            }
        }
    }
    for (size_t i = 0; i < h.count; i++)
        if ((rc = st_check_entry(&h.entries[i], data_bytes)))
            goto fail;
    if ((rc = st_check_tiling(&h, data_bytes)))
        goto fail;
    *out = h;
    return 0;
fail:
    mlart_st_header_free(&h);
    return rc;
}

const mlart_st_entry *mlart_st_header_find(const mlart_st_header *h, const char *name)
{
    mlart_st_entry key;
    if (!h || !name || !h->count)
        return NULL;
    key.name = (char *)name;
    return bsearch(&key, h->entries, h->count, sizeof key, st_cmp_name);
}

/* ---- file -------------------------------------------------------------- */

/* pread until done; a short count means the file shrank under us. */
static int st_pread_all(int fd, void *dst, uint64_t len, uint64_t off)
{
    unsigned char *p = dst;
    while (len) {
        size_t chunk = len > (uint64_t)(1u << 30) ? (size_t)1 << 30 : (size_t)len;
        ssize_t n;
        if (off > (uint64_t)INT64_MAX - chunk)
            return mlart_set_error(MLART_EIO, "safetensors: offset past the largest file");
        n = pread(fd, p, chunk, (off_t)off);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return mlart_set_error(MLART_EIO, "safetensors: read at %llu failed: %s",
                                   (unsigned long long)off, strerror(errno));
        }
        if (n == 0)
            return mlart_set_error(MLART_EIO,
                                   "safetensors: file ended at %llu while reading (truncated?)",
                                   (unsigned long long)off);
        p += n;
        off += (uint64_t)n;
        len -= (uint64_t)n;
    }
    return 0;
}

int mlart_st_open(const char *path, mlart_st_file *out)
{
    mlart_st_file f;
    struct stat st;
    unsigned char lenb[8];
    uint64_t hlen = 0;
    char *text = NULL;
    int rc;

    if (!path || !out)
        return mlart_set_error(MLART_EINVAL, "safetensors: NULL argument");
    memset(&f, 0, sizeof f);
    /* O_NONBLOCK: opening a FIFO for reading would otherwise wait for a
     * writer before the regular-file check below could refuse it (regular
     * files ignore the flag) */
    f.fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (f.fd < 0)
        return mlart_set_error(MLART_EIO, "safetensors: cannot open %s: %s", path,
                               strerror(errno));
    if (fstat(f.fd, &st) || !S_ISREG(st.st_mode)) {
        rc = mlart_set_error(MLART_EIO, "safetensors: %s is not a regular file", path);
        goto fail;
    }
    f.file_bytes = (uint64_t)st.st_size;
    if (f.file_bytes < 8) {
        rc = mlart_set_error(MLART_EIO, "safetensors: %s: %llu bytes, too short for the header "
                                        "length",
                             path, (unsigned long long)f.file_bytes);
        goto fail;
    }
    if ((rc = st_pread_all(f.fd, lenb, 8, 0)))
        goto fail;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | lenb[i];
    if (hlen > MLART_ST_MAX_HEADER || hlen > f.file_bytes - 8) {
        rc = mlart_set_error(MLART_EIO,
                             "safetensors: %s: header length %llu exceeds the file (%llu bytes) "
                             "or the %llu-byte limit",
                             path, (unsigned long long)hlen, (unsigned long long)f.file_bytes,
                             (unsigned long long)MLART_ST_MAX_HEADER);
        goto fail;
    }
    if (hlen < 2) {
        rc = mlart_set_error(MLART_EIO, "safetensors: %s: header length %llu is too short", path,
                             (unsigned long long)hlen);
        goto fail;
    }
    if (!(text = malloc((size_t)hlen))) {
        rc = mlart_set_error(MLART_ENOMEM, "safetensors: out of memory for a %llu-byte header",
                             (unsigned long long)hlen);
        goto fail;
    }
    if ((rc = st_pread_all(f.fd, text, hlen, 8)))
        goto fail;
    f.data_start = 8 + hlen;
    if ((rc = mlart_st_header_parse(text, (size_t)hlen, f.file_bytes - f.data_start, &f.header)))
        goto fail;
    free(text);
    *out = f;
    return 0;
fail:
    free(text);
    close(f.fd);
    return rc;
}

void mlart_st_close(mlart_st_file *f)
{
    if (!f)
        return;
    mlart_st_header_free(&f->header);
    if (f->fd >= 0)
        close(f->fd);
    f->fd = -1;
}

int mlart_st_read(const mlart_st_file *f, const mlart_st_entry *e, uint64_t off, uint64_t len,
                  void *dst)
{
    uint64_t size = e->end - e->begin;
    if (off > size || len > size - off)
        return mlart_set_error(MLART_EINTERNAL,
                               "safetensors: read [%llu, +%llu) outside tensor \"%s\" (%llu bytes)",
                               (unsigned long long)off, (unsigned long long)len, e->name,
                               (unsigned long long)size);
    return st_pread_all(f->fd, dst, len, f->data_start + e->begin + off);
}

/* ---- kv_b_proj loader --------------------------------------------------- */

#define ST_FP8_BLOCK 128

static uint16_t st_le16(const unsigned char *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static float st_lef32(const unsigned char *p)
{
    uint32_t u = (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
                 ((uint32_t)p[3] << 24);
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round an exact value to bf16, nearest-even, in one step: going through f32
 * first would round twice and can land on the wrong side of a tie.
 * Returns -1 past the largest finite bf16. */
static int st_bf16_rne(double d, uint16_t *out)
{
    double a = fabs(d), r;
    float f;
    uint32_t u;
    int e;
    if (a < 0x1p-126) { /* bf16 subnormals: quantum 2^-133 */
        r = rint(a * 0x1p133) * 0x1p-133;
    } else {
        (void)frexp(a, &e); /* a in [2^(e-1), 2^e): keep 8 significant bits */
        r = ldexp(rint(ldexp(a, 8 - e)), e - 8);
    }
    if (r > 0x1.fep127)
        return -1;
    f = (float)(signbit(d) ? -r : r); /* exact: r has at most 8 significant bits */
    memcpy(&u, &f, sizeof u);
    *out = (uint16_t)(u >> 16);
    return 0;
}

static int st_load_bf16(const mlart_st_file *f, const mlart_st_entry *e, int64_t row0,
                        int64_t rows, int64_t cols, uint16_t *out)
{
    uint64_t n = (uint64_t)rows * (uint64_t)cols;
    unsigned char *raw = malloc(n ? n * 2 : 1);
    int rc;
    if (!raw)
        return mlart_set_error(MLART_ENOMEM, "safetensors: out of memory");
    rc = mlart_st_read(f, e, (uint64_t)row0 * (uint64_t)cols * 2, n * 2, raw);
    for (uint64_t i = 0; !rc && i < n; i++) {
        uint16_t h = st_le16(raw + 2 * i);
        if ((h & 0x7f80) == 0x7f80)
            rc = mlart_set_error(MLART_ERANGE,
                                 "safetensors: \"%s\" holds a non-finite value at [%lld, %lld]",
                                 e->name, (long long)(row0 + (int64_t)(i / (uint64_t)cols)),
                                 (long long)(i % (uint64_t)cols));
        else
            out[i] = h;
    }
    free(raw);
    return rc;
}

static int st_load_fp8(const mlart_st_file *f, const mlart_st_entry *e, const char *scale_name,
                       int64_t row0, int64_t rows, int64_t cols, uint16_t *out)
{
    const mlart_st_entry *se = mlart_st_header_find(&f->header, scale_name);
    int64_t srows = (e->shape[0] + ST_FP8_BLOCK - 1) / ST_FP8_BLOCK;
    int64_t scols = (e->shape[1] + ST_FP8_BLOCK - 1) / ST_FP8_BLOCK;
    uint64_t n = (uint64_t)rows * (uint64_t)cols;
    unsigned char *raw = NULL, *sraw = NULL;
    int rc;

    if (!se)
        return mlart_set_error(MLART_EIO,
                               "safetensors: F8_E4M3 tensor \"%s\" has no block scales \"%s\"",
                               e->name, scale_name);
    if (strcmp(se->dtype, "F32"))
        return mlart_set_error(MLART_EDTYPE, "safetensors: \"%s\" is %s, expected F32",
                               scale_name, se->dtype);
    if (se->ndim != 2 || se->shape[0] != srows || se->shape[1] != scols)
        return mlart_set_error(MLART_ESHAPE,
                               "safetensors: \"%s\" must be [%lld, %lld] (128x128 blocks of a "
                               "[%lld, %lld] weight)",
                               scale_name, (long long)srows, (long long)scols,
                               (long long)e->shape[0], (long long)e->shape[1]);
    raw = malloc(n ? n : 1);
    sraw = malloc((size_t)(se->end - se->begin) + 1);
    if (!raw || !sraw) {
        rc = mlart_set_error(MLART_ENOMEM, "safetensors: out of memory");
        goto done;
    }
    if ((rc = mlart_st_read(f, se, 0, se->end - se->begin, sraw)))
        goto done;
    for (int64_t i = 0; i < srows * scols; i++) {
        float sc = st_lef32(sraw + 4 * i);
        if (!isfinite(sc) || sc < 0.0f) {
            rc = mlart_set_error(MLART_ERANGE,
                                 "safetensors: \"%s\" block [%lld, %lld] has scale %g (must be "
                                 "finite and >= 0)",
                                 scale_name, (long long)(i / scols), (long long)(i % scols),
                                 (double)sc);
            goto done;
        }
    }
    if ((rc = mlart_st_read(f, e, (uint64_t)row0 * (uint64_t)cols, n, raw)))
        goto done;
    for (uint64_t i = 0; i < n; i++) {
        if ((raw[i] & 0x7f) == 0x7f) {
            rc = mlart_set_error(MLART_ERANGE, "safetensors: \"%s\" holds NaN at [%lld, %lld]",
                                 e->name, (long long)(row0 + (int64_t)(i / (uint64_t)cols)),
                                 (long long)(i % (uint64_t)cols));
            goto done;
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const unsigned char *srow = sraw + 4 * ((row0 + r) / ST_FP8_BLOCK) * scols;
        for (int64_t c = 0; c < cols; c++) {
            /* 4-bit x 24-bit significands: the double product is exact */
            double v = (double)mlart_e4m3_to_f32(raw[r * cols + c]) *
                       (double)st_lef32(srow + 4 * (c / ST_FP8_BLOCK));
            if (st_bf16_rne(v, &out[r * cols + c])) {
                rc = mlart_set_error(MLART_ERANGE,
                                     "safetensors: \"%s\" [%lld, %lld] dequantises to %g, past "
                                     "the bf16 range",
                                     e->name, (long long)(row0 + r), (long long)c, v);
                goto done;
            }
        }
    }
done:
    free(raw);
    free(sraw);
    return rc;
}

/* A layer's kv_b_proj entry in an open file, its shape checked against g:
 * [H_total*(P+V), L]; *heads_total = H_total.  name holds the tensor's name. */
static int find_kv_b_proj(const mlart_st_file *f, const char *path, int layer,
                          const mlart_geometry *g, char *name, size_t name_cap,
                          const mlart_st_entry **out, int64_t *heads_total)
{
    const int64_t per_head = (int64_t)g->qk_nope + g->v_head, cols = g->kv_lora;
    const mlart_st_entry *e;
    snprintf(name, name_cap, "model.layers.%d.self_attn.kv_b_proj.weight", layer);
    if (!(e = mlart_st_header_find(&f->header, name)))
        return mlart_set_error(MLART_EINVAL, "safetensors: %s has no tensor \"%s\" (%zu tensors)",
                               path, name, f->header.count);
    if (e->ndim != 2 || e->shape[1] != cols || e->shape[0] % per_head) {
        char shape[160];
        size_t n = 0;
        shape[0] = 0;
        for (int d = 0; d < e->ndim && n < sizeof shape - 24; d++)
            n += (size_t)snprintf(shape + n, sizeof shape - n, "%s%lld", d ? ", " : "",
                                  (long long)e->shape[d]);
        return mlart_set_error(MLART_ESHAPE,
                               "safetensors: \"%s\" has %d-d shape [%s], expected "
                               "[heads*(qk_nope+v_head) = k*%lld, kv_lora = %lld]",
                               name, e->ndim, shape, (long long)per_head, (long long)cols);
    }
    *out = e;
    *heads_total = e->shape[0] / per_head;
    return 0;
}

static int check_kv_b_proj_args(const char *path, int layer, const mlart_geometry *g)
{
    if (!path || !g)
        return mlart_set_error(MLART_EINVAL, "safetensors: NULL path or geometry");
    if (layer < 0)
        return mlart_set_error(MLART_EINVAL, "safetensors: layer %d must be >= 0", layer);
    if (g->heads <= 0 || g->qk_nope <= 0 || g->v_head <= 0 || g->kv_lora <= 0)
        return mlart_set_error(MLART_EINVAL,
                               "safetensors: geometry needs heads, qk_nope, v_head, kv_lora > 0 "
                               "(got %d, %d, %d, %d)",
                               g->heads, g->qk_nope, g->v_head, g->kv_lora);
    return 0;
}

int mlart_safetensors_kv_b_proj_heads(const char *path, int layer, const mlart_geometry *g,
                                      int64_t *heads_total)
{
    char name[96];
    mlart_st_file f;
    const mlart_st_entry *e;
    int64_t n = 0;
    int rc;
    MLART_CHECK(check_kv_b_proj_args(path, layer, g));
    if (!heads_total)
        return mlart_set_error(MLART_EINVAL, "safetensors: NULL heads_total");
    MLART_CHECK(mlart_st_open(path, &f));
    rc = find_kv_b_proj(&f, path, layer, g, name, sizeof name, &e, &n);
    mlart_st_close(&f);
    if (!rc)
        *heads_total = n;
    return rc;
}

int mlart_safetensors_load_kv_b_proj(const char *path, int layer, const mlart_geometry *g,
                                     int head_offset, void *dst, size_t dst_bytes)
{
    char name[96], scale_name[112];
    mlart_st_file f;
    const mlart_st_entry *e;
    int64_t per_head, rows, cols, heads_total;
    uint64_t need;
    uint16_t *tmp = NULL;
    int rc;

    MLART_CHECK(check_kv_b_proj_args(path, layer, g));
    if (!dst)
        return mlart_set_error(MLART_EINVAL, "safetensors: NULL destination");
    if (head_offset < 0)
        return mlart_set_error(MLART_EINVAL, "safetensors: head_offset %d must be >= 0",
                               head_offset);
    per_head = (int64_t)g->qk_nope + g->v_head;
    rows = (int64_t)g->heads * per_head;
    cols = g->kv_lora;
    if ((uint64_t)cols > (uint64_t)(SIZE_MAX / 2) / (uint64_t)rows)
        return mlart_set_error(MLART_EINVAL, "safetensors: geometry too large for memory");
    need = (uint64_t)rows * (uint64_t)cols * 2;
    if (dst_bytes < need)
        return mlart_set_error(MLART_EINVAL,
                               "safetensors: destination holds %zu bytes, kv_b_proj slice needs "
                               "%llu",
                               dst_bytes, (unsigned long long)need);

    MLART_CHECK(mlart_st_open(path, &f));
    if ((rc = find_kv_b_proj(&f, path, layer, g, name, sizeof name, &e, &heads_total)))
        goto done;
    snprintf(scale_name, sizeof scale_name, "%s_scale_inv", name);
    if ((int64_t)head_offset + g->heads > heads_total) {
        rc = mlart_set_error(MLART_ESHAPE,
                             "safetensors: \"%s\" holds %lld heads; heads [%d, %lld) requested",
                             name, (long long)heads_total, head_offset,
                             (long long)head_offset + g->heads);
        goto done;
    }
    if (!(tmp = malloc((size_t)need))) {
        rc = mlart_set_error(MLART_ENOMEM, "safetensors: out of memory (%llu bytes)",
                             (unsigned long long)need);
        goto done;
    }
    /* heads are consecutive row blocks, so the slice is one contiguous range */
    if (!strcmp(e->dtype, "BF16"))
        rc = st_load_bf16(&f, e, (int64_t)head_offset * per_head, rows, cols, tmp);
    else if (!strcmp(e->dtype, "F8_E4M3"))
        rc = st_load_fp8(&f, e, scale_name, (int64_t)head_offset * per_head, rows, cols, tmp);
    else
        rc = mlart_set_error(MLART_EDTYPE,
                             "safetensors: \"%s\" is %s; supported: BF16, F8_E4M3 (with "
                             "\"..._scale_inv\" F32 128x128 block scales)",
                             name, e->dtype);
    if (!rc)
        memcpy(dst, tmp, (size_t)need);
done:
    free(tmp);
    mlart_st_close(&f);
    return rc;
}
