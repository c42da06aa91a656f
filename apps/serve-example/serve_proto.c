#include "serve_proto.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *serve_err_code(serve_err e)
{
    switch (e) {
    case SERVE_OK: return "ok";
    case SERVE_EJSON: return "bad_json";
    case SERVE_EREQUEST: return "bad_request";
    case SERVE_ERANGE: return "out_of_range";
    case SERVE_ETOOLONG: return "too_long";
    case SERVE_EBUSY: return "busy";
    case SERVE_ESHUTDOWN: return "shutting_down";
    case SERVE_EINTERNAL: return "internal";
    case SERVE_ECONNS: return "too_many_connections";
    }
    return "internal";
}

typedef struct scan {
    const char *p, *end;
    char *msg;
    size_t msg_cap;
} scan;

static serve_err fail(scan *s, serve_err e, const char *what)
{
    if (s->msg_cap)
        snprintf(s->msg, s->msg_cap, "%s", what);
    return e;
}

static void ws(scan *s)
{
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\r' || *s->p == '\n'))
        s->p++;
}

static int peek(scan *s, char c)
{
    ws(s);
    return s->p < s->end && *s->p == c;
}

/* Length of the UTF-8 sequence at p (below end), 0 when it is not one:
 * RFC 3629, no overlong forms, no surrogates, nothing past U+10FFFF. */
static int utf8_len(const unsigned char *p, const unsigned char *end)
{
    int n;
    unsigned lo = 0x80, hi = 0xbf;
    if (p[0] < 0x80)
        return 1;
    if (p[0] >= 0xc2 && p[0] <= 0xdf)
        n = 2;
    else if (p[0] >= 0xe0 && p[0] <= 0xef)
        n = 3, lo = p[0] == 0xe0 ? 0xa0 : 0x80, hi = p[0] == 0xed ? 0x9f : 0xbf;
    else if (p[0] >= 0xf0 && p[0] <= 0xf4)
        n = 4, lo = p[0] == 0xf0 ? 0x90 : 0x80, hi = p[0] == 0xf4 ? 0x8f : 0xbf;
    else
        return 0;
    if (end - p < n || p[1] < lo || p[1] > hi)
        return 0;
    for (int i = 2; i < n; i++)
        if (p[i] < 0x80 || p[i] > 0xbf)
            return 0;
    return n;
}

/* The value of the 4 hex digits at p (below end), -1 when they are not. */
static long hex4(const char *p, const char *end)
{
    long v = 0;
    if (end - p < 4)
        return -1;
    for (int i = 0; i < 4; i++) {
        const char c = p[i];
        int d;
        if (c >= '0' && c <= '9')
            d = c - '0';
        else if (c >= 'a' && c <= 'f')
            d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F')
            d = c - 'A' + 10;
        else
            return -1;
        v = v * 16 + d;
    }
    return v;
}

/* A JSON string; *b and *e get its raw span, quotes included. */
static serve_err string(scan *s, const char **b, const char **e)
{
    ws(s);
    if (s->p >= s->end || *s->p != '"')
        return fail(s, SERVE_EJSON, "expected a string");
    *b = s->p++;
    while (s->p < s->end && *s->p != '"') {
        unsigned char c = (unsigned char)*s->p;
        if (c < 0x20)
            return fail(s, SERVE_EJSON, "control character in a string");
        if (c >= 0x80) { /* the id is echoed: a reply must stay UTF-8 */
            int n = utf8_len((const unsigned char *)s->p, (const unsigned char *)s->end);
            if (!n)
                return fail(s, SERVE_EJSON, "invalid UTF-8 in a string");
            s->p += n;
            continue;
        }
        if (c == '\\') {
            if (++s->p >= s->end)
                break;
            if (*s->p == 'u') {
                const long u = hex4(s->p + 1, s->end);
                if (u < 0)
                    return fail(s, SERVE_EJSON, "bad \\u escape");
                s->p += 4;
                /* UTF-16 in escapes: a high surrogate counts only with a low
                 * one escaped right after it; alone, either is no character,
                 * and an echoed id must decode to UTF-8 */
                if (u >= 0xdc00 && u <= 0xdfff)
                    return fail(s, SERVE_EJSON, "lone surrogate in a \\u escape");
                if (u >= 0xd800 && u <= 0xdbff) {
                    const long lo = s->end - s->p > 2 && s->p[1] == '\\' && s->p[2] == 'u'
                                        ? hex4(s->p + 3, s->end)
                                        : -1;
                    if (lo < 0xdc00 || lo > 0xdfff)
                        return fail(s, SERVE_EJSON, "lone surrogate in a \\u escape");
                    s->p += 6;
                }
            } else if (!strchr("\"\\/bfnrt", *s->p) || *s->p == '\0') {
                return fail(s, SERVE_EJSON, "bad escape");
            }
        }
        s->p++;
    }
    if (s->p >= s->end)
        return fail(s, SERVE_EJSON, "unterminated string");
    *e = ++s->p;
    return SERVE_OK;
}

/* A JSON number; *is_int set when it is written as an integer (no fraction,
 * no exponent), *v then its value, saturated to the int64 range: a huge
 * integer is still an integer, just out of any range. */
static serve_err number(scan *s, int *is_int, int64_t *v)
{
    const char *p = s->p;
    int neg = 0, over = 0, frac = 0;
    uint64_t x = 0;
    if (p < s->end && *p == '-')
        neg = 1, p++;
    if (p >= s->end || *p < '0' || *p > '9')
        return fail(s, SERVE_EJSON, "bad number");
    if (*p == '0' && p + 1 < s->end && p[1] >= '0' && p[1] <= '9')
        return fail(s, SERVE_EJSON, "leading zero");
    while (p < s->end && *p >= '0' && *p <= '9') {
        if (x > (UINT64_MAX - 9) / 10)
            over = 1;
        else
            x = x * 10 + (uint64_t)(*p - '0');
        p++;
    }
    if (p < s->end && *p == '.') {
        frac = 1;
        if (++p >= s->end || *p < '0' || *p > '9')
            return fail(s, SERVE_EJSON, "bad fraction");
        while (p < s->end && *p >= '0' && *p <= '9')
            p++;
    }
    if (p < s->end && (*p == 'e' || *p == 'E')) {
        frac = 1;
        p++;
        if (p < s->end && (*p == '+' || *p == '-'))
            p++;
        if (p >= s->end || *p < '0' || *p > '9')
            return fail(s, SERVE_EJSON, "bad exponent");
        while (p < s->end && *p >= '0' && *p <= '9')
            p++;
    }
    s->p = p;
    *is_int = !frac;
    if (frac)
        *v = 0;
    else if (over || x > (uint64_t)INT64_MAX)
        *v = neg ? INT64_MIN : INT64_MAX;
    else
        *v = neg ? -(int64_t)x : (int64_t)x;
    return SERVE_OK;
}

/* Arrays and objects nested deeper than this inside the request are
 * refused (bad_json): skip recurses once per level. */
#define NEST_MAX 16

/* A JSON value at the given depth (the request's own values are at 1). */
static serve_err skip(scan *s, int depth)
{
    const char *b, *e;
    int is_int;
    int64_t v;
    serve_err rc;
    ws(s);
    if (s->p >= s->end)
        return fail(s, SERVE_EJSON, "unexpected end");
    switch (*s->p) {
    case '"':
        return string(s, &b, &e);
    case '{':
    case '[': {
        char close = *s->p == '{' ? '}' : ']';
        int obj = close == '}';
        if (depth > NEST_MAX)
            return fail(s, SERVE_EJSON, "arrays and objects nested more than 16 deep");
        s->p++;
        if (peek(s, close)) {
            s->p++;
            return SERVE_OK;
        }
        for (;;) {
            if (obj) {
                if ((rc = string(s, &b, &e)))
                    return rc;
                if (!peek(s, ':'))
                    return fail(s, SERVE_EJSON, "expected ':'");
                s->p++;
            }
            if ((rc = skip(s, depth + 1)))
                return rc;
            if (peek(s, ',')) {
                s->p++;
                continue;
            }
            if (!peek(s, close))
                return fail(s, SERVE_EJSON, obj ? "expected ',' or '}'" : "expected ',' or ']'");
            s->p++;
            return SERVE_OK;
        }
    }
    case 't':
        if (s->end - s->p >= 4 && !memcmp(s->p, "true", 4))
            return s->p += 4, SERVE_OK;
        return fail(s, SERVE_EJSON, "bad literal");
    case 'f':
        if (s->end - s->p >= 5 && !memcmp(s->p, "false", 5))
            return s->p += 5, SERVE_OK;
        return fail(s, SERVE_EJSON, "bad literal");
    case 'n':
        if (s->end - s->p >= 4 && !memcmp(s->p, "null", 4))
            return s->p += 4, SERVE_OK;
        return fail(s, SERVE_EJSON, "bad literal");
    default:
        return number(s, &is_int, &v);
    }
}

static int starts_number(const scan *s)
{
    return s->p < s->end && (*s->p == '-' || (*s->p >= '0' && *s->p <= '9'));
}

/* A value of the wrong type for a known field: still valid JSON (else
 * bad_json), so the request is a bad_request (docs/serve.md). */
static serve_err wrong_type(scan *s, int depth, const char *what)
{
    serve_err rc = skip(s, depth);
    return rc ? rc : fail(s, SERVE_EREQUEST, what);
}

/* The text of a string that string() accepted (b..e: inside its quotes),
 * unescaped into out as UTF-8.  Returns its length, or cap + 1 when it is
 * longer than cap (keys are read into a few bytes: no field's name is
 * longer). */
static size_t unescape(const char *b, const char *e, char *out, size_t cap)
{
    size_t n = 0;
    while (b < e) {
        unsigned long u = (unsigned char)*b++;
        unsigned char t[4];
        size_t m = 1;
        if (u == '\\') {
            const char c = *b++;
            if (c == 'u') {
                u = (unsigned long)hex4(b, e);
                b += 4;
                if (u >= 0xd800 && u <= 0xdbff) { /* string() saw its low half */
                    u = 0x10000 + ((u - 0xd800) << 10) + ((unsigned long)hex4(b + 2, e) - 0xdc00);
                    b += 6;
                }
            } else {
                u = c == 'b' ? '\b' : c == 'f' ? '\f' : c == 'n' ? '\n' : c == 'r' ? '\r'
                  : c == 't' ? '\t' : (unsigned char)c;
            }
            if (u >= 0x10000)
                m = 4, t[0] = (unsigned char)(0xf0 | u >> 18);
            else if (u >= 0x800)
                m = 3, t[0] = (unsigned char)(0xe0 | u >> 12);
            else if (u >= 0x80)
                m = 2, t[0] = (unsigned char)(0xc0 | u >> 6);
            else
                t[0] = (unsigned char)u;
            for (size_t i = 1; i < m; i++)
                t[i] = (unsigned char)(0x80 | ((u >> (6 * (m - 1 - i))) & 0x3f));
        } else {
            t[0] = (unsigned char)u; /* UTF-8 already */
        }
        if (n + m > cap)
            return cap + 1;
        memcpy(out + n, t, m);
        n += m;
    }
    return n;
}

/* Whether a key, unescaped (JSON allows "\u0069d" for "id"), is k. */
static int key_is(const char *key, size_t len, const char *k)
{
    return len == strlen(k) && !memcmp(key, k, len);
}

static serve_err parse(const char *line, size_t len, const serve_limits *lim,
                       serve_request *out, char *msg, size_t msg_cap)
{
    scan s = {line, line + len, msg, msg_cap};
    serve_request r;
    int have_id = 0, have_tokens = 0, npos = -1;
    int64_t tokens = 0;
    int pos_range = 0;
    const char *bad_pos = NULL, *tok_text = "";
    int bad_pos_len = 0, tok_len = 0;
    serve_err rc;

    memset(&r, 0, sizeof r);
    out->id[0] = '\0';
    if (msg_cap)
        msg[0] = '\0';
    if (!peek(&s, '{'))
        return fail(&s, SERVE_EJSON, "a request is a JSON object");
    s.p++;
    if (peek(&s, '}'))
        return fail(&s, SERVE_EREQUEST, "empty request: needs id, tokens, positions");
    for (;;) {
        const char *kb, *ke;
        char key[16];
        size_t klen;
        if ((rc = string(&s, &kb, &ke)))
            return rc;
        klen = unescape(kb + 1, ke - 1, key, sizeof key);
        if (!peek(&s, ':'))
            return fail(&s, SERVE_EJSON, "expected ':'");
        s.p++;
        ws(&s);
        if (key_is(key, klen, "id")) {
            const char *vb = s.p, *ve;
            int is_int;
            int64_t v;
            if (have_id++)
                return fail(&s, SERVE_EREQUEST, "duplicate id");
            if (s.p < s.end && *s.p == '"') {
                if ((rc = string(&s, &vb, &ve)))
                    return rc;
            } else if (!starts_number(&s)) {
                return wrong_type(&s, 1, "id must be a string or an integer");
            } else {
                if ((rc = number(&s, &is_int, &v)))
                    return rc;
                ve = s.p;
                if (!is_int)
                    return fail(&s, SERVE_EREQUEST, "id must be a string or an integer");
            }
            if ((size_t)(ve - vb) > SERVE_ID_MAX)
                return fail(&s, SERVE_EREQUEST, "id longer than 64 bytes");
            memcpy(r.id, vb, (size_t)(ve - vb));
            r.id[ve - vb] = '\0';
            memcpy(out->id, r.id, sizeof r.id);
        } else if (key_is(key, klen, "tokens")) {
            int is_int;
            if (have_tokens++)
                return fail(&s, SERVE_EREQUEST, "duplicate tokens");
            if (!starts_number(&s))
                return wrong_type(&s, 1, "tokens must be an integer");
            tok_text = s.p;
            if ((rc = number(&s, &is_int, &tokens)))
                return rc;
            tok_len = (int)(s.p - tok_text < 40 ? s.p - tok_text : 40);
            if (!is_int)
                return fail(&s, SERVE_EREQUEST, "tokens must be an integer");
        } else if (key_is(key, klen, "positions")) {
            if (npos >= 0)
                return fail(&s, SERVE_EREQUEST, "duplicate positions");
            if (!peek(&s, '['))
                return fail(&s, SERVE_EREQUEST, "positions must be an array of integers");
            s.p++;
            npos = 0;
            if (peek(&s, ']')) {
                s.p++;
            } else {
                for (;;) {
                    int is_int;
                    int64_t v;
                    const char *vb;
                    ws(&s);
                    if (!starts_number(&s))
                        return wrong_type(&s, 2, "positions must be integers");
                    vb = s.p;
                    if ((rc = number(&s, &is_int, &v)))
                        return rc;
                    if (!is_int)
                        return fail(&s, SERVE_EREQUEST, "positions must be integers");
                    if (npos >= SERVE_MAX_TOKENS)
                        return fail(&s, SERVE_ERANGE, "more than 64 positions");
                    if ((v < 0 || v >= lim->context) && !pos_range) /* quoted as written */
                        pos_range = 1, bad_pos = vb,
                        bad_pos_len = (int)(s.p - vb < 40 ? s.p - vb : 40);
                    r.positions[npos++] = (int32_t)(v < 0 ? -1 : v > INT32_MAX ? INT32_MAX : v);
                    if (peek(&s, ',')) {
                        s.p++;
                        continue;
                    }
                    if (!peek(&s, ']'))
                        return fail(&s, SERVE_EJSON, "expected ',' or ']' in positions");
                    s.p++;
                    break;
                }
            }
        } else if ((rc = skip(&s, 1))) {
            return rc;
        }
        if (peek(&s, ',')) {
            s.p++;
            continue;
        }
        if (!peek(&s, '}'))
            return fail(&s, SERVE_EJSON, "expected ',' or '}'");
        s.p++;
        break;
    }
    ws(&s);
    if (s.p != s.end)
        return fail(&s, SERVE_EJSON, "bytes after the request object");
    if (!have_id)
        return fail(&s, SERVE_EREQUEST, "missing id");
    if (!have_tokens || npos < 0)
        return fail(&s, SERVE_EREQUEST, "missing tokens or positions");
    if (tokens < 1 || tokens > lim->max_tokens) {
        if (msg_cap)
            snprintf(msg, msg_cap, "tokens = %.*s, this server takes 1..%d per request",
                     tok_len, tok_text, lim->max_tokens);
        return SERVE_ERANGE;
    }
    if (npos != tokens) {
        if (msg_cap)
            snprintf(msg, msg_cap, "tokens = %lld but %d positions", (long long)tokens, npos);
        return SERVE_EREQUEST;
    }
    if (pos_range) {
        if (msg_cap)
            snprintf(msg, msg_cap, "position %.*s outside [0, %d) (the server's context)",
                     bad_pos_len, bad_pos, lim->context);
        return SERVE_ERANGE;
    }
    r.tokens = (int32_t)tokens;
    *out = r;
    return SERVE_OK;
}

/* parse() returns at the first field it refuses, before it has read the
 * rest of the line; docs/serve.md promises bad_json for every line that is
 * not one JSON object, so a refused line is read again, as plain JSON,
 * before it is answered bad_request or out_of_range.  Only refused lines
 * pay for the second pass. */
serve_err serve_parse_request(const char *line, size_t len, const serve_limits *lim,
                              serve_request *out, char *msg, size_t msg_cap)
{
    serve_err e = parse(line, len, lim, out, msg, msg_cap);
    if (e == SERVE_EREQUEST || e == SERVE_ERANGE) {
        scan s = {line, line + len, msg, msg_cap};
        serve_err rc = skip(&s, 0); /* parse() saw that it starts with '{' */
        if (rc)
            return rc;
        ws(&s);
        if (s.p != s.end)
            return fail(&s, SERVE_EJSON, "bytes after the request object");
    }
    return e;
}

size_t serve_format_ok(char *buf, size_t cap, const serve_request *r, const serve_result *res)
{
    int n = snprintf(buf, cap,
                     "{\"id\":%s,\"ok\":true,\"tokens\":%d,\"batch_tokens\":%d,"
                     "\"batch_requests\":%d,\"queue_us\":%llu,\"compute_us\":%llu,"
                     "\"total_us\":%llu,\"checksum\":\"%016llx\"}\n",
                     r->id[0] ? r->id : "null", r->tokens, res->batch_tokens, res->batch_requests,
                     (unsigned long long)res->queue_us, (unsigned long long)res->compute_us,
                     (unsigned long long)res->total_us, (unsigned long long)res->checksum);
    return n > 0 && (size_t)n < cap ? (size_t)n : 0;
}

size_t serve_format_error(char *buf, size_t cap, const char *id, serve_err e, const char *msg)
{
    size_t n;
    int k = snprintf(buf, cap, "{\"id\":%s,\"ok\":false,\"error\":{\"code\":\"%s\",\"message\":\"",
                     id && id[0] ? id : "null", serve_err_code(e));
    if (k < 0 || (size_t)k >= cap)
        return 0;
    n = (size_t)k;
    for (const unsigned char *p = (const unsigned char *)msg; p && *p; p++) {
        char esc[8];
        size_t m;
        if (*p == '"' || *p == '\\')
            esc[0] = '\\', esc[1] = (char)*p, m = 2;
        else if (*p < 0x20 || *p >= 0x7f) /* keep replies ASCII: messages may quote input */
            m = (size_t)snprintf(esc, sizeof esc, "\\u%04x", *p);
        else
            esc[0] = (char)*p, m = 1;
        if (n + m + 5 > cap)
            return 0;
        memcpy(buf + n, esc, m);
        n += m;
    }
    if (n + 5 > cap)
        return 0;
    memcpy(buf + n, "\"}}\n", 5); /* with its NUL */
    return n + 4;
}

int serve_framer_init(serve_framer *f, size_t cap)
{
    f->buf = malloc(cap + 1); /* a line of cap bytes, and the '\r' of its "\r\n" */
    f->len = 0;
    f->cap = cap;
    f->discarding = 0;
    return f->buf ? 0 : -1;
}

void serve_framer_free(serve_framer *f)
{
    free(f->buf);
    f->buf = NULL;
}

static void emit(const char *line, size_t len, serve_line_fn fn, void *ctx)
{
    size_t i;
    if (len && line[len - 1] == '\r')
        len--;
    for (i = 0; i < len; i++)
        if (line[i] != ' ' && line[i] != '\t')
            break;
    if (i < len)
        fn(ctx, line, len, 0);
}

/* The last byte of the line that ends with this chunk (0 for an empty line). */
static char line_end(const serve_framer *f, const char *data, size_t chunk)
{
    return chunk ? data[chunk - 1] : f->len ? f->buf[f->len - 1] : 0;
}

void serve_framer_finish(serve_framer *f, serve_line_fn fn, void *ctx)
{
    if (f->discarding)
        fn(ctx, NULL, 0, 1);
    else if (f->len && f->len - (f->buf[f->len - 1] == '\r') > f->cap) /* len is at most cap + 1 */
        fn(ctx, NULL, 0, 1);
    else if (f->len)
        emit(f->buf, f->len, fn, ctx);
    f->len = 0;
    f->discarding = 0;
}

size_t serve_framer_feed(serve_framer *f, const char *data, size_t n, serve_line_fn fn, void *ctx)
{
    const size_t all = n;
    f->pause = 0;
    while (n) {
        const char *nl = memchr(data, '\n', n);
        size_t chunk = nl ? (size_t)(nl - data) : n;
        if (f->discarding) {
            if (nl) {
                f->discarding = 0;
                fn(ctx, NULL, 0, 1);
            }
        } else if (f->len + chunk > f->cap + 1 ||
                   (nl && f->len + chunk - (line_end(f, data, chunk) == '\r') > f->cap)) {
            /* past the cap: a line holds at most cap bytes before its "\n"
             * or "\r\n" (cap + 1 may be buffered while a '\r' waits for
             * its newline) */
            f->len = 0;
            if (nl)
                fn(ctx, NULL, 0, 1);
            else
                f->discarding = 1;
        } else if (nl && f->len == 0) {
            emit(data, chunk, fn, ctx); /* whole line in this read: no copy */
        } else {
            memcpy(f->buf + f->len, data, chunk);
            f->len += chunk;
            if (nl) {
                emit(f->buf, f->len, fn, ctx);
                f->len = 0;
            }
        }
        if (!nl)
            return all;
        data = nl + 1;
        n -= chunk + 1;
        if (f->pause) {
            f->pause = 0;
            return all - n;
        }
    }
    return all;
}

uint64_t serve_fnv1a(uint64_t h, const void *data, size_t n)
{
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}
