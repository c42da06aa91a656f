/* The serving example's wire protocol (docs/serve.md): newline-delimited JSON
 * requests {"id": ..., "tokens": N, "positions": [...]}, one JSON reply per
 * request.  Pure functions, no I/O, so the tests can drive them directly. */
#ifndef MLART_SERVE_PROTO_H
#define MLART_SERVE_PROTO_H

#include <stddef.h>
#include <stdint.h>

#define SERVE_ID_MAX 64        /* bytes of an id as written on the wire */
#define SERVE_MAX_TOKENS 64    /* hard cap on tokens per request */

/* Error codes of an error reply ("code" field). */
typedef enum serve_err {
    SERVE_OK = 0,
    SERVE_EJSON,      /* "bad_json": the line is not a JSON object */
    SERVE_EREQUEST,   /* "bad_request": a field missing, of the wrong type, or inconsistent */
    SERVE_ERANGE,     /* "out_of_range": tokens or a position outside the server's limits */
    SERVE_ETOOLONG,   /* "too_long": the line exceeds the server's line cap */
    SERVE_EBUSY,      /* "busy": the request queue is full */
    SERVE_ESHUTDOWN,  /* "shutting_down": arrived after SIGINT/SIGTERM */
    SERVE_EINTERNAL,  /* "internal": the decode step failed */
    SERVE_ECONNS      /* "too_many_connections": --max-conns are open; the connection is closed */
} serve_err;

const char *serve_err_code(serve_err e);

typedef struct serve_limits {
    int32_t max_tokens; /* per request, 1..SERVE_MAX_TOKENS */
    int32_t context;    /* positions must be in [0, context) */
} serve_limits;

typedef struct serve_request {
    char id[SERVE_ID_MAX + 1]; /* the id's JSON text, echoed verbatim; "" if none was read */
    int32_t tokens;
    int32_t positions[SERVE_MAX_TOKENS];
} serve_request;

/* Parse one line (without its newline).  On failure returns the error and
 * writes a message; out->id holds the id if it was read before the error.
 * A line that is not one JSON object is SERVE_EJSON whatever else is wrong
 * with it: SERVE_EREQUEST and SERVE_ERANGE only come for valid JSON.  Keys
 * are compared unescaped; a \u escape of a lone UTF-16 surrogate, in any
 * string, is SERVE_EJSON. */
serve_err serve_parse_request(const char *line, size_t len, const serve_limits *lim,
                              serve_request *out, char *msg, size_t msg_cap);

typedef struct serve_result {
    int32_t batch_tokens, batch_requests;
    uint64_t queue_us, compute_us, total_us;
    uint64_t checksum;
} serve_result;

/* Replies, newline-terminated.  Return the length, or 0 if cap is too small. */
size_t serve_format_ok(char *buf, size_t cap, const serve_request *r, const serve_result *res);
size_t serve_format_error(char *buf, size_t cap, const char *id, serve_err e, const char *msg);

/* Line framing with a length cap.  Lines longer than cap bytes (not
 * counting their "\n" or "\r\n") are consumed up to their newline and
 * reported once as too long, so the stream stays in sync. */
typedef struct serve_framer {
    char *buf;
    size_t len, cap;
    int discarding;
    int pause; /* set by the line callback: feed returns after that line */
} serve_framer;

typedef void (*serve_line_fn)(void *ctx, const char *line, size_t len, int too_long);

int serve_framer_init(serve_framer *f, size_t cap);
void serve_framer_free(serve_framer *f);
/* Feed bytes; calls fn for each complete line ("\r\n" accepted; blank lines
 * skipped).  Returns the bytes consumed: n, or fewer when fn set f->pause
 * (which feed then clears), the bytes after that line left for a later
 * feed. */
size_t serve_framer_feed(serve_framer *f, const char *data, size_t n, serve_line_fn fn, void *ctx);
/* The stream ended: a last line without its newline is a line too (or too
 * long); the framer is empty after. */
void serve_framer_finish(serve_framer *f, serve_line_fn fn, void *ctx);

/* FNV-1a 64 of bytes, chained from h (start with SERVE_FNV_INIT). */
#define SERVE_FNV_INIT 0xcbf29ce484222325ull
uint64_t serve_fnv1a(uint64_t h, const void *data, size_t n);

#endif
