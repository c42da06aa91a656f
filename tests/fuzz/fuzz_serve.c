/* libFuzzer harness: the serving example's wire protocol on arbitrary bytes
 * (what a client sends): byte 0 sets the framer's line cap and (its low
 * bit) whether the stream ends with a newline or just ends, byte 1 where
 * the rest is cut in two feeds; the framer cuts the rest into lines (none
 * longer than the cap), every
 * line is parsed, what a request the parser accepts holds is checked
 * against the limits, and the reply is formatted as the server would. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "serve_proto.h"

static size_t line_cap;

static void on_line(void *ctx, const char *line, size_t len, int too_long)
{
    const serve_limits lim = {SERVE_MAX_TOKENS, 100};
    serve_request r;
    char msg[256], reply[1024];
    serve_err e;
    (void)ctx;
    if (too_long) {
        if (serve_format_error(reply, sizeof reply, "", SERVE_ETOOLONG, "line too long") == 0)
            abort();
        return;
    }
    if (len > line_cap)
        abort();
    memset(&r, 0, sizeof r);
    e = serve_parse_request(line, len, &lim, &r, msg, sizeof msg);
    if (e == SERVE_OK) {
        const serve_result res = {1, 1, 2, 3, 4, 0x1234};
        if (r.tokens < 1 || r.tokens > lim.max_tokens)
            abort();
        for (int32_t i = 0; i < r.tokens; i++)
            if (r.positions[i] < 0 || r.positions[i] >= lim.context)
                abort();
        if (serve_format_ok(reply, sizeof reply, &r, &res) == 0)
            abort();
    } else if (serve_format_error(reply, sizeof reply, r.id, e, msg) == 0) {
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    serve_framer f;
    const char *text = (const char *)data + 2;
    size_t n, cut;
    if (size < 2)
        return 0;
    n = size - 2;
    cut = n ? data[1] % (n + 1) : 0;
    line_cap = 16 + (size_t)data[0] * 8;
    if (serve_framer_init(&f, line_cap) != 0)
        return 0;
    /* fed in two pieces, cut where the second byte says, then a newline or
     * the end of the stream */
    serve_framer_feed(&f, text, cut, on_line, NULL);
    serve_framer_feed(&f, text + cut, n - cut, on_line, NULL);
    if (data[0] & 1)
        serve_framer_finish(&f, on_line, NULL);
    else
        serve_framer_feed(&f, "\n", 1, on_line, NULL);
    serve_framer_free(&f);
    return 0;
}
