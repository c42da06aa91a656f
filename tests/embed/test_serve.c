/* The serving example: protocol unit tests, then the real binary on loopback:
 * a bounded load test (many concurrent clients, a fixed number of requests,
 * malformed / oversized / out-of-range ones mixed in, a time limit: every
 * request answered, none lost, equal inputs give equal checksums, per step
 * size on the sm_90 backend), requests alone against batched, and shutdown
 * on SIGTERM and SIGINT with requests still queued.  Arguments after the
 * server's path go on every server's command line (the GPU runs). */
#define _POSIX_C_SOURCE 200809L
#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
#include <math.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check_run.h"
#include "mlart/mlart.h"
#include "serve_proto.h"
#include "st_writer.h"

static const char *server_path;
/* Appended to every server's command line: the arguments after the server's
 * path (e.g. "--device cuda --config configs/deepseek-v32-tp8.ini"). */
static char *const *server_extra;

/* ---- protocol ---------------------------------------------------------- */

/* 64 array elements and a comma; 16 arrays opened, and closed */
#define Z8 "0,0,0,0,0,0,0,0,"
#define Z64 Z8 Z8 Z8 Z8 Z8 Z8 Z8 Z8
#define OPEN16 "[[[[[[[[[[[[[[[["
#define CLOSE16 "]]]]]]]]]]]]]]]]"

START_TEST(test_parse)
{
    serve_limits lim = {8, 100};
    serve_request r;
    char msg[200];
    static const struct {
        const char *line;
        serve_err want;
        const char *id, *in_msg; /* in_msg, when given: a part of the message */
    } cases[] = {
        {"{\"id\":7,\"tokens\":2,\"positions\":[0,99]}", SERVE_OK, "7", NULL},
        {" {\"positions\":[3],\"x\":{\"a\":[1,2.5e3,null,true]},\"tokens\":1,\"id\":\"q\\\"1\"} ",
         SERVE_OK, "\"q\\\"1\"", NULL},
        {"{\"id\":-3,\"tokens\":1,\"positions\":[1]}", SERVE_OK, "-3", NULL},
        /* strings are UTF-8: "r\u00e9" and U+10FFFF kept; a lone continuation
         * byte, an overlong form, a surrogate and a cut sequence refused */
        {"{\"id\":\"r\xc3\xa9\",\"tokens\":1,\"positions\":[1]}", SERVE_OK, "\"r\xc3\xa9\"", NULL},
        {"{\"id\":\"\xf4\x8f\xbf\xbf\",\"tokens\":1,\"positions\":[1]}", SERVE_OK,
         "\"\xf4\x8f\xbf\xbf\"", NULL},
        {"{\"id\":\"\xff\xfe\",\"tokens\":1,\"positions\":[1]}", SERVE_EJSON, "", NULL},
        {"{\"id\":\"\x80\",\"tokens\":1,\"positions\":[1]}", SERVE_EJSON, "", NULL},
        {"{\"id\":\"\xc0\xaf\",\"tokens\":1,\"positions\":[1]}", SERVE_EJSON, "", NULL},
        {"{\"id\":\"\xed\xa0\x80\",\"tokens\":1,\"positions\":[1]}", SERVE_EJSON, "", NULL},
        {"{\"id\":1,\"x\":\"\xe2\x82\",\"tokens\":1,\"positions\":[1]}", SERVE_EJSON, "1", NULL},
        /* \u escapes: a surrogate pair is one character, kept as written; a
         * lone surrogate (high without its low, a low alone, a pair the
         * wrong way round) is no character at all, so no reply can echo it */
        {"{\"id\":\"\\ud83d\\ude00\",\"tokens\":1,\"positions\":[1]}", SERVE_OK,
         "\"\\ud83d\\ude00\"", NULL},
        {"{\"id\":\"\\uD83D\\uDE00\\u00e9\",\"tokens\":1,\"positions\":[1]}", SERVE_OK,
         "\"\\uD83D\\uDE00\\u00e9\"", NULL},
        {"{\"id\":\"\\ud800\",\"tokens\":1,\"positions\":[1]}", SERVE_EJSON, "", "surrogate"},
        {"{\"id\":\"\\udc00\",\"tokens\":1,\"positions\":[1]}", SERVE_EJSON, "", "surrogate"},
        {"{\"id\":\"\\uDBFFx\",\"tokens\":1,\"positions\":[1]}", SERVE_EJSON, "", "surrogate"},
        {"{\"id\":\"\\ud800\\u0041\",\"tokens\":1,\"positions\":[1]}", SERVE_EJSON, "",
         "surrogate"},
        {"{\"id\":\"\\ud800\\ud800\",\"tokens\":1,\"positions\":[1]}", SERVE_EJSON, "",
         "surrogate"},
        {"{\"id\":\"\\ude00\\ud83d\",\"tokens\":1,\"positions\":[1]}", SERVE_EJSON, "",
         "surrogate"},
        {"{\"id\":\"\\ud800\\n\",\"tokens\":1,\"positions\":[1]}", SERVE_EJSON, "",
         "surrogate"},
        {"{\"id\":1,\"x\":\"\\udfff\",\"tokens\":1,\"positions\":[1]}", SERVE_EJSON, "1",
         "surrogate"},
        {"{\"id\":\"\\ud800", SERVE_EJSON, "", NULL},
        /* keys are compared unescaped: "\u0069d" is the key "id" */
        {"{\"\\u0069d\":5,\"tokens\":1,\"positions\":[1]}", SERVE_OK, "5", NULL},
        {"{\"\\u0069\\u0064\":\"a\",\"\\u0074okens\":2,\"posi\\u0074ions\":[1,2]}", SERVE_OK,
         "\"a\"", NULL},
        {"{\"id\":1,\"\\u0069d\":2,\"tokens\":1,\"positions\":[1]}", SERVE_EREQUEST, "1",
         "duplicate id"},
        {"{\"id\":1,\"tokens\":1,\"positions\":[1],\"po\\u0073itions\":[2]}", SERVE_EREQUEST,
         "1", "duplicate positions"},
        /* ... and only what unescapes to exactly a field's name is that field */
        {"{\"id\\u0000\":1,\"tokens\":1,\"positions\":[1]}", SERVE_EREQUEST, "", "missing id"},
        {"{\"\\u0069d \":1,\"tokens\":1,\"positions\":[1]}", SERVE_EREQUEST, "", "missing id"},
        {"{\"\\u0049D\":1,\"tokens\":1,\"positions\":[1]}", SERVE_EREQUEST, "", "missing id"},
        {"{\"id\":1,\"tokens\":1,\"positions\":[1],\"positions\\ud83d\\ude00\":[2]}",
         SERVE_OK, "1", NULL},
        {"", SERVE_EJSON, "", NULL},
        {"[1,2]", SERVE_EJSON, "", NULL},
        {"{\"id\":1,\"tokens\":1,\"positions\":[1]", SERVE_EJSON, "1", NULL},
        {"{\"id\":1,\"tokens\":1,\"positions\":[1]} x", SERVE_EJSON, "1", NULL},
        {"{\"id\":1,\"tokens\":1,\"positions\":[01]}", SERVE_EJSON, "1", NULL},
        {"{\"id\":1,\"tokens\":1,\"positions\":[\"1\"]}", SERVE_EREQUEST, "1", NULL},
        {"{\"id\":\"a\\q\",\"tokens\":1,\"positions\":[1]}", SERVE_EJSON, "", NULL},
        {"{\"id\":1.5,\"tokens\":1,\"positions\":[1]}", SERVE_EREQUEST, "", NULL},
        {"{\"id\":1,\"id\":2,\"tokens\":1,\"positions\":[1]}", SERVE_EREQUEST, "1", NULL},
        {"{\"tokens\":1,\"positions\":[1]}", SERVE_EREQUEST, "", NULL},
        {"{\"id\":1,\"positions\":[1]}", SERVE_EREQUEST, "1", NULL},
        {"{\"id\":1,\"tokens\":2,\"positions\":[1]}", SERVE_EREQUEST, "1", NULL},
        {"{\"id\":1,\"tokens\":1.0,\"positions\":[1]}", SERVE_EREQUEST, "1", NULL},
        {"{\"id\":1,\"tokens\":1,\"positions\":{}}", SERVE_EREQUEST, "1", NULL},
        {"{\"id\":1,\"tokens\":1,\"positions\":[100]}", SERVE_ERANGE, "1", NULL},
        {"{\"id\":1,\"tokens\":1,\"positions\":[-1]}", SERVE_ERANGE, "1", NULL},
        {"{\"id\":1,\"tokens\":1,\"positions\":[99999999999999999999]}", SERVE_ERANGE, "1", NULL},
        {"{\"id\":1,\"tokens\":0,\"positions\":[]}", SERVE_ERANGE, "1", NULL},
        {"{\"id\":1,\"tokens\":9,\"positions\":[1,1,1,1,1,1,1,1,1]}", SERVE_ERANGE, "1", NULL},
        {"{\"id\":\"01234567890123456789012345678901234567890123456789012345678901234\","
         "\"tokens\":1,\"positions\":[1]}",
         SERVE_EREQUEST, "", NULL},
        /* docs/serve.md: a known field of the wrong JSON type is bad_request
         * (the line is valid JSON), an integer too large for any range is
         * out_of_range (it is still an integer), quoted as written */
        {"{\"id\":true,\"tokens\":1,\"positions\":[1]}", SERVE_EREQUEST, "", "id must"},
        {"{\"id\":null,\"tokens\":1,\"positions\":[1]}", SERVE_EREQUEST, "", "id must"},
        {"{\"id\":{\"a\":1},\"tokens\":1,\"positions\":[1]}", SERVE_EREQUEST, "", "id must"},
        {"{\"id\":1,\"tokens\":\"1\",\"positions\":[1]}", SERVE_EREQUEST, "1", "tokens must"},
        {"{\"id\":1,\"tokens\":[1],\"positions\":[1]}", SERVE_EREQUEST, "1", "tokens must"},
        {"{\"id\":1,\"tokens\":1,\"positions\":[null]}", SERVE_EREQUEST, "1", "positions must"},
        {"{\"id\":1,\"tokens\":1,\"positions\":[[1]]}", SERVE_EREQUEST, "1", "positions must"},
        /* still bad_json when the value itself is not JSON */
        {"{\"id\":tru,\"tokens\":1,\"positions\":[1]}", SERVE_EJSON, "", ""},
        {"{\"id\":1,\"tokens\":1,\"positions\":[\"1]}", SERVE_EJSON, "1", ""},
        {"{\"id\":1,\"tokens\":-,\"positions\":[1]}", SERVE_EJSON, "1", ""},
        /* integers beyond int64: out of range, quoted as written */
        {"{\"id\":1,\"tokens\":99999999999999999999,\"positions\":[1]}", SERVE_ERANGE, "1",
         "tokens = 99999999999999999999,"},
        {"{\"id\":1,\"tokens\":-99999999999999999999,\"positions\":[1]}", SERVE_ERANGE, "1",
         "tokens = -99999999999999999999,"},
        {"{\"id\":1,\"tokens\":1,\"positions\":[-9223372036854775809]}", SERVE_ERANGE, "1",
         "position -9223372036854775809 outside"},
        {"{\"id\":1,\"tokens\":2,\"positions\":[1,18446744073709551616]}", SERVE_ERANGE, "1",
         "position 18446744073709551616 outside"},
        {"{\"id\":1,\"tokens\":4294967297,\"positions\":[1]}", SERVE_ERANGE, "1",
         "tokens = 4294967297,"},
        /* a line that is not JSON is bad_json whatever else is wrong with
         * it (docs/serve.md): cut short, bytes after the object, a
         * malformed value where a field is refused */
        {"{\"id\":1,\"id\":2", SERVE_EJSON, "1", NULL},
        {"{\"id\":1.5,\"tokens\":1,\"positions\":[1]} x", SERVE_EJSON, "", "after"},
        {"{} x", SERVE_EJSON, "", "after"},
        {"{}}", SERVE_EJSON, "", "after"},
        {"{\"id\":1,\"tokens\":\"1\"", SERVE_EJSON, "1", NULL},
        {"{\"id\":1,\"tokens\":true,\"positions\":[1]}]", SERVE_EJSON, "1", NULL},
        {"{\"id\":1,\"tokens\":1,\"positions\":{]}", SERVE_EJSON, "1", NULL},
        {"{\"id\":1,\"tokens\":1,\"positions\":[null", SERVE_EJSON, "1", NULL},
        {"{\"id\":1,\"tokens\":1,\"positions\":[1,2],\"positions\":", SERVE_EJSON, "1", NULL},
        {"{\"id\":1,\"tokens\":1,\"positions\":[" Z64 "0", SERVE_EJSON, "1", NULL},
        {"{\"id\":1,\"tokens\":0,\"positions\":[]", SERVE_EJSON, "1", NULL},
        {"{\"id\":\"01234567890123456789012345678901234567890123456789012345678901234\"",
         SERVE_EJSON, "", NULL},
        /* ... and a top-level value that is not an object */
        {"\"x\"", SERVE_EJSON, "", NULL},
        {"5", SERVE_EJSON, "", NULL},
        {"null", SERVE_EJSON, "", NULL},
        {"{", SERVE_EJSON, "", NULL},
        /* the same fields valid JSON: refused for what they hold */
        {"{\"id\":1,\"tokens\":1,\"positions\":[" Z64 "0]}", SERVE_ERANGE, "1", "64"},
        {"{} ", SERVE_EREQUEST, "", NULL},
        /* arrays and objects nest at most 16 deep inside the request */
        {"{\"x\":" OPEN16 "1" CLOSE16 ",\"id\":1,\"tokens\":1,\"positions\":[1]}", SERVE_OK,
         "1", NULL},
        {"{\"x\":" OPEN16 "[1]" CLOSE16 ",\"id\":1,\"tokens\":1,\"positions\":[1]}",
         SERVE_EJSON, "", "nested more than 16"},
        {"{\"id\":1,\"x\":" OPEN16 "{}" CLOSE16 ",\"tokens\":1,\"positions\":[1]}",
         SERVE_EJSON, "1", "nested more than 16"},
        /* an integer id is echoed as written, however large */
        {"{\"id\":123456789012345678901234567890,\"tokens\":1,\"positions\":[1]}", SERVE_OK,
         "123456789012345678901234567890", ""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        serve_err e = serve_parse_request(cases[i].line, strlen(cases[i].line), &lim, &r, msg,
                                          sizeof msg);
        ck_assert_msg(e == cases[i].want, "case %zu (%s): got %s want %s (%s)", i, cases[i].line,
                      serve_err_code(e), serve_err_code(cases[i].want), msg);
        ck_assert_msg(!strcmp(r.id, cases[i].id), "case %zu: id '%s' want '%s'", i, r.id,
                      cases[i].id);
        if (e != SERVE_OK)
            ck_assert_msg(msg[0], "case %zu: no message", i);
        if (cases[i].in_msg)
            ck_assert_msg(strstr(msg, cases[i].in_msg), "case %zu: message '%s' lacks '%s'", i,
                          msg, cases[i].in_msg);
    }
    ck_assert_int_eq(serve_parse_request(cases[0].line, strlen(cases[0].line), &lim, &r, msg,
                                         sizeof msg),
                     SERVE_OK);
    ck_assert_int_eq(r.tokens, 2);
    ck_assert_int_eq(r.positions[1], 99);
    printf("protocol: %zu request lines parsed or refused with the right code\n",
           sizeof cases / sizeof cases[0]);
}
END_TEST

typedef struct lines {
    char got[16][128];
    int too_long[16];
    int n;
} lines;

static void collect(void *ctx, const char *line, size_t len, int too_long)
{
    lines *l = ctx;
    ck_assert_int_lt(l->n, 16);
    l->too_long[l->n] = too_long;
    snprintf(l->got[l->n], sizeof l->got[0], "%.*s", (int)len, line ? line : "");
    l->n++;
}

/* collect, and ask the framer to pause after every line (a paused server) */
static serve_framer *pausing;
static void collect_pause(void *ctx, const char *line, size_t len, int too_long)
{
    collect(ctx, line, len, too_long);
    pausing->pause = 1;
}

/* Fed with a pause after every line, each feed returning what it used and
 * the rest fed again, the framer gives the lines of one plain feed. */
START_TEST(test_framer_pause)
{
    static const char text[] = "a\r\n\nbb\n0123456789abcdefgh\nccc\r\nd\ne";
    const size_t n = sizeof text - 1;
    serve_framer f, g;
    lines plain, paused;
    size_t off = 0;
    int feeds = 0;
    memset(&plain, 0, sizeof plain);
    memset(&paused, 0, sizeof paused);
    ck_assert_int_eq(serve_framer_init(&f, 16), 0);
    ck_assert_uint_eq(serve_framer_feed(&f, text, n, collect, &plain), n);
    serve_framer_finish(&f, collect, &plain);
    ck_assert_int_eq(serve_framer_init(&g, 16), 0);
    pausing = &g;
    while (off < n) {
        size_t used = serve_framer_feed(&g, text + off, n - off, collect_pause, &paused);
        ck_assert_uint_gt(used, 0);
        ck_assert_int_eq(g.pause, 0); /* cleared by feed */
        off += used;
        feeds++;
    }
    serve_framer_finish(&g, collect, &paused);
    ck_assert_int_eq(paused.n, plain.n);
    for (int i = 0; i < plain.n; i++) {
        ck_assert_str_eq(paused.got[i], plain.got[i]);
        ck_assert_int_eq(paused.too_long[i], plain.too_long[i]);
    }
    ck_assert_int_ge(feeds, plain.n - 1); /* it did stop after the lines */
    printf("framer pause: %d lines in %d feeds, as in one\n", plain.n, feeds);
    serve_framer_free(&f);
    serve_framer_free(&g);
}
END_TEST

START_TEST(test_framer_and_replies)
{
    serve_framer f;
    lines l;
    char big[100], buf[256];
    serve_request r = {"\"x\"", 1, {0}};
    serve_result res = {3, 2, 10, 20, 30, 0xabcdefull};
    memset(&l, 0, sizeof l);
    memset(big, 'x', sizeof big);
    ck_assert_int_eq(serve_framer_init(&f, 16), 0);
    /* split lines, CRLF, blank lines, a too-long line split over feeds, then in sync */
    serve_framer_feed(&f, "ab", 2, collect, &l);
    serve_framer_feed(&f, "c\r\n\n  \nd\n", 9, collect, &l);
    serve_framer_feed(&f, big, 10, collect, &l);
    serve_framer_feed(&f, big, 10, collect, &l);
    serve_framer_feed(&f, big, 50, collect, &l);
    serve_framer_feed(&f, "\ne\n0123456789abcdef\n0123456789abcdefg\nz", 40, collect, &l);
    ck_assert_int_eq(l.n, 6);
    ck_assert_str_eq(l.got[0], "abc");
    ck_assert_str_eq(l.got[1], "d");
    ck_assert_int_eq(l.too_long[2], 1);
    ck_assert_str_eq(l.got[3], "e");
    ck_assert_str_eq(l.got[4], "0123456789abcdef"); /* exactly the cap */
    ck_assert_int_eq(l.too_long[5], 1);
    serve_framer_free(&f);
    /* the cap counts a line's bytes without its "\r\n" (the '\r' may come in
     * one read and the '\n' in the next), and the end of the stream ends a
     * last line that has no newline */
    memset(&l, 0, sizeof l);
    ck_assert_int_eq(serve_framer_init(&f, 16), 0);
    serve_framer_feed(&f, "0123456789abcdef\r\n", 18, collect, &l);
    serve_framer_feed(&f, "0123456789abcdef\r", 17, collect, &l);
    serve_framer_feed(&f, "\n", 1, collect, &l);
    serve_framer_feed(&f, "0123456789abcdefg\r\n", 19, collect, &l);
    serve_framer_feed(&f, "0123456789abcdefx", 17, collect, &l);
    serve_framer_feed(&f, "\n", 1, collect, &l);
    serve_framer_feed(&f, "tail", 4, collect, &l);
    serve_framer_finish(&f, collect, &l);
    serve_framer_finish(&f, collect, &l); /* nothing left */
    serve_framer_feed(&f, big, 30, collect, &l);
    serve_framer_finish(&f, collect, &l);
    serve_framer_feed(&f, "0123456789abcdef\r", 17, collect, &l);
    serve_framer_finish(&f, collect, &l);
    ck_assert_int_eq(l.n, 7);
    ck_assert_str_eq(l.got[0], "0123456789abcdef");
    ck_assert_str_eq(l.got[1], "0123456789abcdef");
    ck_assert_int_eq(l.too_long[2], 1);
    ck_assert_int_eq(l.too_long[3], 1);
    ck_assert_str_eq(l.got[4], "tail");
    ck_assert_int_eq(l.too_long[4], 0);
    ck_assert_int_eq(l.too_long[5], 1);
    ck_assert_str_eq(l.got[6], "0123456789abcdef");
    ck_assert_int_eq(l.too_long[6], 0);
    serve_framer_free(&f);

    ck_assert_uint_gt(serve_format_ok(buf, sizeof buf, &r, &res), 0);
    ck_assert_str_eq(buf, "{\"id\":\"x\",\"ok\":true,\"tokens\":1,\"batch_tokens\":3,"
                          "\"batch_requests\":2,\"queue_us\":10,\"compute_us\":20,"
                          "\"total_us\":30,\"checksum\":\"0000000000abcdef\"}\n");
    ck_assert_uint_gt(serve_format_error(buf, sizeof buf, NULL, SERVE_EJSON, "a \"q\"\n\x01"), 0);
    ck_assert_str_eq(buf, "{\"id\":null,\"ok\":false,\"error\":{\"code\":\"bad_json\","
                          "\"message\":\"a \\\"q\\\"\\u000a\\u0001\"}}\n");
    ck_assert_uint_eq(serve_format_error(buf, 20, NULL, SERVE_EJSON, "long message"), 0);
    printf("framer: split/CRLF/blank/too-long lines, stays in sync; replies formatted\n");
}
END_TEST

/* ---- the server process ------------------------------------------------ */

typedef struct proc {
    pid_t pid;
    int port;
    int by_step; /* checksums compared per step size (see load.by_step) */
    FILE *out;
} proc;

static const char *spawn_stderr; /* if set, the next server's stderr goes to this file */

static void spawn(proc *p, const char *const *extra)
{
    int fds[2];
    char line[512];
    const char *argv[32];
    int n = 0;
    ck_assert_int_eq(pipe(fds), 0);
    argv[n++] = server_path;
    argv[n++] = "--port";
    argv[n++] = "0";
    for (int i = 0; extra && extra[i]; i++)
        argv[n++] = extra[i];
    for (int i = 0; server_extra && server_extra[i] && n < 31; i++)
        argv[n++] = server_extra[i];
    argv[n] = NULL;
    p->pid = fork();
    ck_assert_int_ge(p->pid, 0);
    if (p->pid == 0) {
        signal(SIGINT, SIG_DFL); /* a background shell may have left these ignored */
        signal(SIGTERM, SIG_DFL);
        signal(SIGPIPE, SIG_DFL); /* the server must handle it itself */
        if (spawn_stderr) {
            int e = open(spawn_stderr, O_WRONLY | O_CREAT | O_TRUNC, 0600);
            if (e < 0 || dup2(e, 2) < 0)
                _exit(126);
        }
        dup2(fds[1], 1);
        close(fds[0]);
        close(fds[1]);
        execv(server_path, (char *const *)argv);
        _exit(127);
    }
    close(fds[1]);
    p->out = fdopen(fds[0], "r");
    ck_assert_ptr_nonnull(fgets(line, sizeof line, p->out));
    ck_assert_msg(sscanf(strstr(line, "127.0.0.1:") ? strstr(line, "127.0.0.1:") : "",
                         "127.0.0.1:%d", &p->port) == 1,
                  "no port in: %s", line);
    /* The reference backend computes each token alone; the sm_90 one picks
     * its kernels per step size (docs/serve.md) */
    p->by_step = strstr(line, "backend reference ") == NULL;
    printf("server: %s", line);
}

static int finish(proc *p, int sig, double limit_s)
{
    int status = -1;
    struct timespec t0, t1;
    if (sig)
        kill(p->pid, sig);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        pid_t r = waitpid(p->pid, &status, WNOHANG);
        if (r == p->pid)
            break;
        clock_gettime(CLOCK_MONOTONIC, &t1);
        if ((double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9 > limit_s) {
            kill(p->pid, SIGKILL);
            waitpid(p->pid, &status, 0);
            fclose(p->out);
            return -1;
        }
        nanosleep(&(struct timespec){0, 10000000}, NULL);
    }
    fclose(p->out);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* A non-blocking connection; rcvbuf > 0 sets SO_RCVBUF before connecting. */
static int connect_buf(int port, int rcvbuf)
{
    struct sockaddr_in a;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    ck_assert_int_ge(fd, 0);
    if (rcvbuf > 0)
        ck_assert_int_eq(setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf), 0);
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
        close(fd);
        return -1;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    return fd;
}

static int connect_to(int port)
{
    return connect_buf(port, 0);
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Read one line (its newline dropped) from a non-blocking fd within
 * limit_s: its length, or -1 at EOF, an error or the time limit. */
static int read_line(int fd, char *buf, size_t cap, double limit_s)
{
    size_t n = 0;
    const double t0 = now_s();
    while (n + 1 < cap && now_s() - t0 < limit_s) {
        struct pollfd pf = {fd, POLLIN, 0};
        ssize_t r;
        if (poll(&pf, 1, 50) <= 0)
            continue;
        r = recv(fd, buf + n, 1, 0);
        if (r <= 0)
            return -1;
        if (buf[n] == '\n') {
            buf[n] = '\0';
            return (int)n;
        }
        n++;
    }
    return -1;
}

/* Whether the server closed fd (EOF or a reset) within limit_s, reading
 * and dropping whatever came before. */
static int closed_within(int fd, double limit_s)
{
    const double t0 = now_s();
    while (now_s() - t0 < limit_s) {
        struct pollfd pf = {fd, POLLIN, 0};
        char sink[4096];
        ssize_t r;
        if (poll(&pf, 1, 20) <= 0)
            continue;
        r = recv(fd, sink, sizeof sink, 0);
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK))
            return 1;
    }
    return 0;
}

/* Send one request line and read its reply. */
static void ask(int fd, const char *req, char *reply, size_t cap)
{
    ck_assert_int_eq(send(fd, req, strlen(req), MSG_NOSIGNAL), (ssize_t)strlen(req));
    ck_assert_msg(read_line(fd, reply, cap, 10.0) > 0, "no reply to %s", req);
}

/* ---- load test client -------------------------------------------------- */

enum kind { K_OK, K_BADJSON, K_TOOLONG, K_RANGE, K_MISMATCH, K_NKINDS };
static const char *const kind_code[] = {"", "bad_json", "too_long", "out_of_range", "bad_request"};

#define NLISTS 16
#define MAX_STEP 64 /* largest --max-batch-tokens of these tests */
typedef struct client {
    int fd, id;
    char *out;
    size_t out_len, out_off, out_cap;
    char in[1 << 16];
    size_t in_len;
    int next, sent, answered, eof;
} client;

typedef struct load {
    int nclients, per_client, window;
    int total, answered, ok, errors_expected, errors_got, dup, unexpected, mism;
    int got_kind[K_NKINDS], want_kind[K_NKINDS];
    unsigned char *seen;               /* [client][request] */
    /* checksum seen for each positions list, per step size ([0]: any size,
     * unless by_step) */
    char sums[NLISTS][MAX_STEP + 1][17];
    int by_step;
    long batch_requests_sum;
    int after_signal;
    int shutting_down;
} load;

static enum kind kind_of(int k)
{
    return k % 13 == 5 ? (enum kind)(1 + (k / 13) % 4) : K_OK;
}

static int list_tokens(int li)
{
    return 1 + li % 4;
}

static void list_positions(int li, int i, char *buf, size_t cap)
{
    snprintf(buf, cap, "%d", (li * 61 + i * 17) % 1024);
}

static void out_add(client *c, const char *s, size_t n)
{
    if (c->out_len + n > c->out_cap) {
        c->out_cap = (c->out_len + n) * 2;
        c->out = realloc(c->out, c->out_cap);
        ck_assert_ptr_nonnull(c->out);
    }
    memcpy(c->out + c->out_len, s, n);
    c->out_len += n;
}

static void queue_request(load *L, client *c)
{
    int k = c->next++;
    enum kind kd = kind_of(k);
    char line[6000], pos[32];
    int li = (c->id * 7 + k) % NLISTS, n, t = list_tokens(li);
    L->want_kind[kd]++;
    switch (kd) {
    case K_BADJSON:
        n = snprintf(line, sizeof line, "{\"id\":\"c%d-%d\",\"tokens\":1,\"positions\":[1}\n",
                     c->id, k);
        break;
    case K_TOOLONG:
        n = snprintf(line, sizeof line, "{\"id\":\"c%d-%d\",\"pad\":\"%5000d\"}\n", c->id, k, 0);
        break;
    case K_RANGE:
        n = snprintf(line, sizeof line, "{\"id\":\"c%d-%d\",\"tokens\":1,\"positions\":[1024]}\n",
                     c->id, k);
        break;
    case K_MISMATCH:
        n = snprintf(line, sizeof line, "{\"id\":\"c%d-%d\",\"tokens\":3,\"positions\":[1]}\n",
                     c->id, k);
        break;
    default:
        n = snprintf(line, sizeof line, "{\"id\":\"c%d-%d\",\"tokens\":%d,\"positions\":[", c->id,
                     k, t);
        for (int i = 0; i < t; i++) {
            list_positions(li, i, pos, sizeof pos);
            n += snprintf(line + n, sizeof line - (size_t)n, "%s%s", i ? "," : "", pos);
        }
        n += snprintf(line + n, sizeof line - (size_t)n, "]}\n");
        break;
    }
    out_add(c, line, (size_t)n);
    c->sent++;
}

/* One reply line: match it to its request. */
static void on_reply(load *L, client *c, const char *line)
{
    int cid = -1, k = -1;
    const char *idp = strstr(line, "\"id\":");
    int ok = strstr(line, "\"ok\":true") != NULL;
    c->answered++;
    L->answered++;
    if (idp && sscanf(idp, "\"id\":\"c%d-%d\"", &cid, &k) == 2 && cid == c->id && k >= 0 &&
        k < L->per_client) {
        if (L->seen[(size_t)cid * (size_t)L->per_client + (size_t)k]++)
            L->dup++;
    } else if (!(idp && !strncmp(idp, "\"id\":null", 9))) {
        L->unexpected++;
        fprintf(stderr, "unexpected reply: %s\n", line);
        return;
    }
    if (ok) {
        const char *cs = strstr(line, "\"checksum\":\"");
        const char *br = strstr(line, "\"batch_requests\":");
        const char *bt = strstr(line, "\"batch_tokens\":");
        int li = (cid * 7 + k) % NLISTS, step = L->by_step && bt ? atoi(bt + 15) : 0;
        char *sum;
        if (k < 0 || kind_of(k) != K_OK || !cs) {
            L->unexpected++;
            return;
        }
        L->ok++;
        if (br)
            L->batch_requests_sum += atol(br + 17);
        cs += 12;
        if (step < 0 || step > MAX_STEP) {
            L->unexpected++;
            return;
        }
        sum = L->sums[li][step];
        if (!sum[0])
            memcpy(sum, cs, 16);
        else if (memcmp(sum, cs, 16))
            L->mism++;
    } else {
        const char *code = strstr(line, "\"code\":\"");
        enum kind want = k >= 0 ? kind_of(k) : K_NKINDS;
        int matched = 0;
        L->errors_got++;
        if (code && L->shutting_down && !strncmp(code + 8, "shutting_down", 13)) {
            L->got_kind[0]++;
            return;
        }
        for (int kd = 1; kd < K_NKINDS && code; kd++) {
            if (!strncmp(code + 8, kind_code[kd], strlen(kind_code[kd]))) {
                /* null-id errors (bad_json, too_long) are matched by count */
                if (k < 0 || (int)want == kd)
                    L->got_kind[kd]++, matched = 1;
            }
        }
        if (!matched) {
            L->unexpected++;
            fprintf(stderr, "unexpected error reply: %s\n", line);
        }
    }
}

/* Drive all clients until every request is answered (or EOF after a signal,
 * or the deadline). signal_after: send `sig` to pid after that many replies. */
static double run_clients(load *L, client *cl, double limit_s, pid_t pid, int sig,
                          int signal_after)
{
    struct pollfd *pf = calloc((size_t)L->nclients, sizeof *pf);
    double t0 = now_s();
    int signalled = 0;
    ck_assert_ptr_nonnull(pf);
    for (;;) {
        int active = 0;
        if (now_s() - t0 > limit_s)
            break;
        if (sig && !signalled && L->answered >= signal_after) {
            kill(pid, sig);
            signalled = 1;
            L->shutting_down = 1;
            L->after_signal = -L->answered;
        }
        for (int i = 0; i < L->nclients; i++) {
            client *c = &cl[i];
            while (c->next < L->per_client && c->sent - c->answered < L->window)
                queue_request(L, c);
            pf[i].fd = c->eof ? -1 : c->fd;
            pf[i].events = POLLIN | (c->out_off < c->out_len ? POLLOUT : 0);
            pf[i].revents = 0;
            if (!c->eof && (c->answered < L->per_client || signalled))
                active++;
        }
        if (!active)
            break;
        if (poll(pf, (nfds_t)L->nclients, 50) < 0 && errno != EINTR)
            break;
        for (int i = 0; i < L->nclients; i++) {
            client *c = &cl[i];
            if (pf[i].revents & POLLOUT) {
                ssize_t w = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
                if (w > 0)
                    c->out_off += (size_t)w;
                if (c->out_off == c->out_len)
                    c->out_off = c->out_len = 0;
            }
            if (pf[i].revents & (POLLIN | POLLHUP | POLLERR)) {
                ssize_t r = recv(c->fd, c->in + c->in_len, sizeof c->in - c->in_len - 1, 0);
                char *nl, *p;
                if (r <= 0) {
                    if (r == 0 || (errno != EAGAIN && errno != EINTR))
                        c->eof = 1;
                    continue;
                }
                c->in_len += (size_t)r;
                c->in[c->in_len] = '\0';
                p = c->in;
                while ((nl = strchr(p, '\n'))) {
                    *nl = '\0';
                    on_reply(L, c, p);
                    p = nl + 1;
                }
                c->in_len -= (size_t)(p - c->in);
                memmove(c->in, p, c->in_len);
            }
        }
    }
    if (signalled)
        L->after_signal += L->answered;
    free(pf);
    return now_s() - t0;
}

static client *clients_open(load *L, int port)
{
    client *cl = calloc((size_t)L->nclients, sizeof *cl);
    ck_assert_ptr_nonnull(cl);
    L->seen = calloc((size_t)L->nclients * (size_t)L->per_client, 1);
    ck_assert_ptr_nonnull(L->seen);
    for (int i = 0; i < L->nclients; i++) {
        cl[i].id = i;
        cl[i].fd = connect_to(port);
        ck_assert_int_ge(cl[i].fd, 0);
    }
    return cl;
}

static void clients_close(load *L, client *cl)
{
    for (int i = 0; i < L->nclients; i++) {
        close(cl[i].fd);
        free(cl[i].out);
    }
    free(cl);
    free(L->seen);
}

/* Spawn a server with args and open nclients connections to it, each to
 * send per_client requests with at most window outstanding. */
static client *load_start(load *L, proc *p, const char *const *args, int nclients, int per_client,
                          int window)
{
    memset(L, 0, sizeof *L);
    L->nclients = nclients;
    L->per_client = per_client;
    L->window = window;
    L->total = nclients * per_client;
    spawn(p, args);
    L->by_step = p->by_step;
    return clients_open(L, p->port);
}

START_TEST(test_load)
{
    static const char *const args[] = {"--max-batch-tokens", "32", "--max-request-tokens", "8",
                                       "--context", "1024", NULL};
    proc p;
    load L;
    client *cl;
    double secs;
    int want_ok, rc;
    cl = load_start(&L, &p, args, 48, 64, 6);
    secs = run_clients(&L, cl, 120.0, 0, 0, 0);
    want_ok = L.want_kind[K_OK];
    printf("load: %d clients x %d requests (%d well-formed, %d bad) in %.2f s = %.0f requests/s; "
           "answered %d, ok %d, errors %d, mean %.2f requests per step\n",
           L.nclients, L.per_client, want_ok, L.total - want_ok, secs, L.total / secs, L.answered,
           L.ok, L.errors_got, L.ok ? (double)L.batch_requests_sum / L.ok : 0.0);
    ck_assert_int_eq(L.answered, L.total); /* none lost */
    ck_assert_int_eq(L.ok, want_ok);
    ck_assert_int_eq(L.dup, 0);
    ck_assert_int_eq(L.unexpected, 0);
    ck_assert_int_eq(L.mism, 0); /* same positions, same checksum, whatever the batch */
    for (int kd = 1; kd < K_NKINDS; kd++)
        ck_assert_msg(L.got_kind[kd] == L.want_kind[kd], "%s: got %d want %d", kind_code[kd],
                      L.got_kind[kd], L.want_kind[kd]);
    ck_assert_msg(L.batch_requests_sum > L.ok, "no step ever batched two requests");
    clients_close(&L, cl);
    rc = finish(&p, SIGTERM, 20.0);
    ck_assert_int_eq(rc, 0);
}
END_TEST

/* SIGTERM / SIGINT with most requests still queued: all answered, then EOF,
 * exit 0, and the port no longer accepts. */
static void shutdown_case(int sig)
{
    static const char *const args[] = {"--max-batch-tokens", "8", "--max-request-tokens", "8",
                                       NULL};
    proc p;
    load L;
    client *cl;
    int rc, fd, shut;
    cl = load_start(&L, &p, args, 8, 24, 24); /* everything at once */
    run_clients(&L, cl, 60.0, p.pid, sig, 1);
    rc = finish(&p, 0, 20.0);
    shut = L.got_kind[0];
    printf("shutdown on signal %d: %d of %d answered (%d ok, %d shutting_down), %d of them after "
           "the signal; exit %d\n",
           sig, L.answered, L.total, L.ok, shut, L.after_signal, rc);
    ck_assert_int_eq(rc, 0);
    ck_assert_int_eq(L.answered, L.total);
    ck_assert_int_eq(L.dup, 0);
    ck_assert_int_eq(L.unexpected, 0);
    ck_assert_int_eq(L.mism, 0);
    ck_assert_int_gt(L.after_signal, 0); /* requests really were in flight */
    for (int i = 0; i < L.nclients; i++)
        ck_assert_msg(cl[i].eof, "client %d not closed by the server", i);
    fd = connect_to(p.port);
    ck_assert_int_lt(fd, 0);
    clients_close(&L, cl);
}

START_TEST(test_sigterm)
{
    shutdown_case(SIGTERM);
}
END_TEST

START_TEST(test_sigint)
{
    shutdown_case(SIGINT);
}
END_TEST

/* Request i of query(): two tokens at positions 37i and 37i + 300. */
static int pair_line(int i, char *line, size_t cap)
{
    return snprintf(line, cap, "{\"id\":\"w%d\",\"tokens\":2,\"positions\":[%d,%d]}\n", i,
                    37 * i, 37 * i + 300);
}

/* pair_line, but the last of `bare_n` lines without its newline. */
static int bare_n;
static int pair_line_bare_last(int i, char *line, size_t cap)
{
    int n = pair_line(i, line, cap);
    if (i == bare_n - 1)
        line[--n] = '\0';
    return n;
}

/* A request with id "w<id>" for positions list li of the load test. */
static int list_req(int id, int li, char *line, size_t cap)
{
    char pos[32];
    int n = snprintf(line, cap, "{\"id\":\"w%d\",\"tokens\":%d,\"positions\":[", id,
                     list_tokens(li));
    for (int k = 0; k < list_tokens(li); k++) {
        list_positions(li, k, pos, sizeof pos);
        n += snprintf(line + n, cap - (size_t)n, "%s%s", k ? "," : "", pos);
    }
    return n + snprintf(line + n, cap - (size_t)n, "]}\n");
}

/* Request i of query(): positions list i. */
static int list_line(int i, char *line, size_t cap)
{
    return list_req(i, i, line, cap);
}

/* Request i of query(): positions list one_list. */
static int one_list;
static int one_line(int i, char *line, size_t cap)
{
    return list_req(i, one_list, line, cap);
}

/* Send n request lines (make_line(i): request i, id "w<i>") on one
 * connection, half-close it, and collect each reply's checksum until the
 * server closes. */
static void query(int port, int n, int (*make_line)(int, char *, size_t), char sums[][17])
{
    int fd = connect_to(port), got = 0;
    char buf[1 << 16];
    size_t len = 0;
    double t0 = now_s();
    ck_assert_int_ge(fd, 0);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    /* a server that stopped answering fails the case, rather than block it */
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &(struct timeval){30, 0}, sizeof(struct timeval));
    for (int i = 0; i < n; i++) {
        char line[256];
        int k = make_line(i, line, sizeof line);
        ck_assert_int_eq(send(fd, line, (size_t)k, MSG_NOSIGNAL), k);
    }
    /* half-close, as a batch client does: the replies must still come, then EOF */
    ck_assert_int_eq(shutdown(fd, SHUT_WR), 0);
    while (now_s() - t0 < 30.0) {
        ssize_t r = recv(fd, buf + len, sizeof buf - len - 1, 0);
        char *p, *nl;
        ck_assert_int_ge(r, 0);
        if (r == 0)
            break;
        len += (size_t)r;
        buf[len] = '\0';
        p = buf;
        while ((nl = strchr(p, '\n'))) {
            int i = -1;
            const char *cs = strstr(p, "\"checksum\":\"");
            *nl = '\0';
            ck_assert_msg(cs && sscanf(p, "{\"id\":\"w%d\"", &i) == 1 && i >= 0 && i < n,
                          "bad reply: %s", p);
            memcpy(sums[i], cs + 12, 16);
            sums[i][16] = '\0';
            got++;
            p = nl + 1;
        }
        len -= (size_t)(p - buf);
        memmove(buf, p, len);
    }
    close(fd);
    ck_assert_int_eq(got, n);
}

/* A request's checksum does not depend on what it is batched with: each
 * positions list served alone (one request a step) gives the checksum that
 * the same list gets batched with others under load.  On the sm_90 backend,
 * whose kernels depend on the step's token count, that holds for steps of
 * the same count (the alone runs are such steps, and each list is sent
 * alone to the batching server too); the lists whose checksum moved in
 * larger steps are counted. */
START_TEST(test_batch_invariance)
{
    static const char *const alone[] = {"--max-batch-requests", "1", NULL};
    static const char *const batched[] = {"--max-batch-tokens", "32", "--max-request-tokens", "8",
                                          NULL};
    char sums[NLISTS][17];
    proc p;
    load L;
    client *cl;
    int differ = 0, compared = 0, moved = 0;
    spawn(&p, alone);
    query(p.port, NLISTS, list_line, sums);
    ck_assert_int_eq(finish(&p, SIGTERM, 20.0), 0);
    cl = load_start(&L, &p, batched, 16, 32, 6);
    run_clients(&L, cl, 120.0, 0, 0, 0);
    ck_assert_int_eq(L.answered, L.total);
    ck_assert_int_eq(L.unexpected, 0);
    ck_assert_int_eq(L.mism, 0);
    ck_assert_msg(L.batch_requests_sum > L.ok, "no step ever batched two requests");
    for (one_list = 0; one_list < NLISTS; one_list++) { /* each alone on this server too */
        char one[1][17];
        query(p.port, 1, one_line, one);
        ck_assert_msg(!strcmp(one[0], sums[one_list]), "list %d alone: %s on one server, %s on another",
                      one_list, sums[one_list], one[0]);
    }
    for (int li = 0; li < NLISTS; li++) {
        int lm = 0;
        for (int st = 0; st <= MAX_STEP; st++) {
            const char *b = L.sums[li][st];
            if (!b[0])
                continue;
            if (!L.by_step || st == list_tokens(li)) {
                compared++;
                if (strcmp(b, sums[li])) {
                    differ++;
                    fprintf(stderr, "list %d (%d tokens), steps of %d: alone %s, batched %s\n", li,
                            list_tokens(li), st, sums[li], b);
                }
            } else if (strcmp(b, sums[li])) {
                lm = 1;
            }
        }
        moved += lm;
    }
    printf("batch invariance (%s): %d lists alone on two servers agree; under load %d checksums "
           "compared with the lone ones, %d differ; %d of %d lists had another checksum in a step "
           "of another size; "
           "%.2f requests a step\n",
           L.by_step ? "per step size" : "any step", NLISTS, compared, differ, moved, NLISTS,
           L.ok ? (double)L.batch_requests_sum / L.ok : 0.0);
    clients_close(&L, cl);
    ck_assert_int_eq(finish(&p, SIGTERM, 20.0), 0);
    ck_assert_int_eq(differ, 0);
    if (!L.by_step) {
        ck_assert_int_eq(compared, NLISTS);
        ck_assert_int_eq(moved, 0);
    }
}
END_TEST

/* One client that pipelines as fast as it can (bursts of 64 one-token
 * requests, reading whatever replies have come) must not keep another
 * client's lone requests waiting behind its own: without a per-connection
 * cap it holds the shared queue (thousands of requests, so a lone request
 * waits hundreds of steps, or is answered `busy` when the queue is full);
 * --max-conn-queue 8 holds it to 8 requests queued or running, so a lone
 * request waits a step or two.  Each lone reply must be `ok` and its
 * queue_us at most 32 times its step's compute_us (both from the reply, so
 * the bound does not depend on the machine's speed).  The greedy client is
 * a child process that runs for 4 s. */
START_TEST(test_fair_share)
{
    static const char *const args[] = {"--max-conn-queue", "8", NULL};
    proc p;
    pid_t greedy;
    int ok = 0, busy = 0, fd;
    double worst = 0.0, worst_ratio = 0.0;
    spawn(&p, args);
    greedy = fork();
    ck_assert_int_ge(greedy, 0);
    if (greedy == 0) {
        int g = connect_to(p.port);
        char burst[64 * 48], sink[1 << 16];
        size_t n = 0;
        double t0 = now_s();
        if (g < 0)
            _exit(3);
        for (int i = 0; i < 64; i++)
            n += (size_t)snprintf(burst + n, sizeof burst - n,
                                  "{\"id\":\"g%d\",\"tokens\":1,\"positions\":[5]}\n", i);
        while (now_s() - t0 < 4.0) {
            size_t off = 0;
            while (off < n && now_s() - t0 < 4.0) {
                ssize_t w = send(g, burst + off, n - off, MSG_NOSIGNAL);
                if (w > 0)
                    off += (size_t)w;
                while (recv(g, sink, sizeof sink, 0) > 0) {
                }
                if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
                    _exit(4);
            }
        }
        _exit(0);
    }
    nanosleep(&(struct timespec){0, 500000000}, NULL); /* the greedy client in full flow */
    fd = connect_to(p.port);
    ck_assert_int_ge(fd, 0);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &(struct timeval){20, 0}, sizeof(struct timeval));
    for (int i = 0; i < 6; i++) {
        char line[128], buf[1024];
        int k = snprintf(line, sizeof line, "{\"id\":\"p%d\",\"tokens\":1,\"positions\":[7]}\n", i);
        double t0 = now_s();
        ssize_t r;
        ck_assert_int_eq(send(fd, line, (size_t)k, MSG_NOSIGNAL), k);
        r = recv(fd, buf, sizeof buf - 1, 0); /* one short reply line */
        ck_assert_msg(r > 0, "no reply to p%d within 20 s", i);
        buf[r] = '\0';
        ok += strstr(buf, "\"ok\":true") != NULL;
        busy += strstr(buf, "\"busy\"") != NULL;
        {
            const char *qs = strstr(buf, "\"queue_us\":"), *cs = strstr(buf, "\"compute_us\":");
            long q = -1, cu = -1;
            if (qs && cs && sscanf(qs, "\"queue_us\":%ld", &q) == 1 &&
                sscanf(cs, "\"compute_us\":%ld", &cu) == 1) {
                const double ratio = (double)q / (double)(cu > 0 ? cu : 1);
                ck_assert_msg(ratio <= 32.0, "p%d waited %ld us in the queue, its step took %ld us: %s",
                              i, q, cu, buf);
                if (ratio > worst_ratio)
                    worst_ratio = ratio;
            }
        }
        if (now_s() - t0 > worst)
            worst = now_s() - t0;
    }
    close(fd);
    {
        int st = -1;
        ck_assert_int_eq(waitpid(greedy, &st, 0), greedy);
        ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "greedy client status %d", st);
    }
    printf("fair share: beside a client pipelining 1-token requests, 6 lone requests: %d ok, %d "
           "busy, the slowest answered after %.3f s, queue time at most %.1f times the step\n", ok,
           busy, worst, worst_ratio);
    ck_assert_int_eq(finish(&p, SIGTERM, 20.0), 0);
    ck_assert_int_eq(ok, 6);
}
END_TEST

/* Checkpoint weights through the server: a BF16 and an FP8 (128x128 block
 * scales) kv_b_proj holding the same values must serve identical outputs. */
START_TEST(test_weights)
{
    /* the server's default geometry: H=4, P=64, V=64, L=256 */
    enum { H = 4, P = 64, V = 64, L = 256, ROWS = H * (P + V) };
    static uint8_t q8[ROWS * L];
    static uint16_t bf[ROWS * L];
    static float scale[(ROWS / 128) * (L / 128)];
    static char s_bf[8][17], s_f8[8][17], s_rand[8][17];
    char dir[] = "/tmp/mlart-serve-w-XXXXXX", pbf[64], pf8[64];
    const char *args[] = {"--weights", pbf, "--layer", "2", "--device", "cpu", NULL};
    uint64_t x = (uint64_t)time(NULL) | 1;
    st_buf f;
    proc p;
    int differ = 0;
    printf("weights seed %llu\n", (unsigned long long)x);
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(pbf, sizeof pbf, "%s/bf16.safetensors", dir);
    snprintf(pf8, sizeof pf8, "%s/fp8.safetensors", dir);
    for (int i = 0; i < (ROWS / 128) * (L / 128); i++)
        scale[i] = ldexpf(1.0f, -8 - i % 3); /* powers of two: fp8 x scale is exact in bf16 */
    for (int r = 0; r < ROWS; r++) {
        for (int c = 0; c < L; c++) {
            uint8_t b;
            do {
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                b = (uint8_t)(x >> 24);
            } while ((b & 0x7f) == 0x7f);
            q8[r * L + c] = b;
            bf[r * L + c] = st_ref_bf16(st_ref_e4m3(b) * scale[(r / 128) * (L / 128) + c / 128]);
        }
    }
    {
        st_tensor t = {"model.layers.2.self_attn.kv_b_proj.weight", "BF16", 2, {ROWS, L}, bf,
                       sizeof bf, 0, 0, 0};
        ck_assert_int_eq(st_build(&t, 1, 1, &f), 0);
        ck_assert_int_eq(st_write_file(pbf, f.data, f.len), 0);
        st_buf_free(&f);
    }
    {
        st_tensor t[2] = {
            {"model.layers.2.self_attn.kv_b_proj.weight", "F8_E4M3", 2, {ROWS, L}, q8,
             sizeof q8, 0, 0, 0},
            {"model.layers.2.self_attn.kv_b_proj.weight_scale_inv", "F32", 2,
             {ROWS / 128, L / 128}, scale, sizeof scale, 0, 0, 0},
        };
        ck_assert_int_eq(st_build(t, 2, 0, &f), 0);
        ck_assert_int_eq(st_write_file(pf8, f.data, f.len), 0);
        st_buf_free(&f);
    }
    spawn(&p, args);
    query(p.port, 8, pair_line, s_bf);
    ck_assert_int_eq(finish(&p, SIGTERM, 20.0), 0);
    snprintf(pbf, sizeof pbf, "%s", pf8);
    spawn(&p, args);
    query(p.port, 8, pair_line, s_f8);
    ck_assert_int_eq(finish(&p, SIGTERM, 20.0), 0);
    args[0] = "--seed", args[1] = "1"; /* random weights */
    spawn(&p, args);
    query(p.port, 8, pair_line, s_rand);
    ck_assert_int_eq(finish(&p, SIGTERM, 20.0), 0);
    for (int i = 0; i < 8; i++) {
        ck_assert_msg(!strcmp(s_bf[i], s_f8[i]), "request %d: bf16 %s fp8 %s", i, s_bf[i],
                      s_f8[i]);
        differ += strcmp(s_bf[i], s_rand[i]) != 0;
    }
    ck_assert_int_eq(differ, 8);
    unlink(pf8);
    snprintf(pbf, sizeof pbf, "%s/bf16.safetensors", dir);
    unlink(pbf);
    rmdir(dir);
    printf("weights: 8 requests give identical checksums from a BF16 and an FP8 checkpoint of "
           "the same values, different from random weights\n");
}
END_TEST

/* Clients that send requests and vanish (close, or reset) before their
 * replies: the server drops those replies and keeps serving. */
START_TEST(test_clients_vanish)
{
    static const char *const args[] = {"--max-batch-tokens", "8", NULL};
    char sums[4][17];
    proc p;
    spawn(&p, args);
    for (int i = 0; i < 16; i++) {
        int fd = connect_to(p.port);
        char line[128];
        ck_assert_int_ge(fd, 0);
        for (int k = 0; k < 8; k++) {
            int n = snprintf(line, sizeof line, "{\"id\":%d,\"tokens\":8,\"positions\":"
                             "[1,2,3,4,5,6,7,8]}\n", k);
            ck_assert_int_eq(send(fd, line, (size_t)n, MSG_NOSIGNAL), n);
        }
        if (i % 2) { /* reset instead of a clean close */
            struct linger lg = {1, 0};
            setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
        }
        close(fd);
    }
    query(p.port, 4, pair_line, sums); /* still serving */
    {
        /* a last line without its newline, then the half-close: answered
         * too (query() wants an ok reply with a checksum for each of the
         * three; the checksums are not compared with those above, since on
         * the sm_90 backend they depend on the step's token count) */
        char bare[3][17];
        bare_n = 3;
        query(p.port, 3, pair_line_bare_last, bare);
    }
    ck_assert_int_eq(finish(&p, SIGTERM, 30.0), 0);
    printf("16 clients vanished with 128 requests queued: server kept serving, exit 0\n");
}
END_TEST

/* Connections the server cannot take (out of memory for their state,
 * simulated by MLART_SERVE_TEST_REFUSE: that many refusals) that arrive
 * together: each is accepted and closed, or served once memory is back, and
 * the server goes on accepting (docs/serve.md); none is left hanging.  The
 * server is stopped while they connect, so that they wait in the backlog
 * and reach it in one accept round: all but the first then wait for the
 * one before to be closed, and each of the 4 refusals is one connection
 * closed (a connection that waited once counted twice, so 2 were closed
 * and 4 served). */
START_TEST(test_refused_connections)
{
    enum { N = 6 };
    static const char req[] = "{\"id\":1,\"tokens\":1,\"positions\":[5]}\n";
    proc p;
    int fds[N], done[N] = {0}, closed = 0, served = 0;
    char sums[2][17];
    double t0;
    setenv("MLART_SERVE_TEST_REFUSE", "4", 1);
    spawn(&p, NULL);
    unsetenv("MLART_SERVE_TEST_REFUSE");
    kill(p.pid, SIGSTOP);
    for (int i = 0; i < N; i++) {
        fds[i] = connect_to(p.port);
        ck_assert_int_ge(fds[i], 0);
        ck_assert_int_eq(send(fds[i], req, sizeof req - 1, MSG_NOSIGNAL), (ssize_t)sizeof req - 1);
    }
    kill(p.pid, SIGCONT);
    t0 = now_s();
    while (closed + served < N && now_s() - t0 < 10.0) {
        for (int i = 0; i < N; i++) {
            char buf[512];
            ssize_t r;
            if (done[i])
                continue;
            r = recv(fds[i], buf, sizeof buf, 0);
            if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK))
                done[i] = 1, closed++;
            else if (r > 0 && memchr(buf, '\n', (size_t)r))
                done[i] = 1, served++;
        }
        nanosleep(&(struct timespec){0, 10000000}, NULL);
    }
    for (int i = 0; i < N; i++)
        close(fds[i]);
    printf("%d connections while %d refusals were due: %d closed by the server, %d served, %d "
           "left hanging\n",
           N, 4, closed, served, N - closed - served);
    ck_assert_int_eq(closed, 4);
    ck_assert_int_eq(served, N - 4);
    query(p.port, 2, pair_line, sums); /* and it still accepts */
    ck_assert_int_eq(finish(&p, SIGTERM, 20.0), 0);
}
END_TEST

/* A second signal during a long drain ends the process at once. */
START_TEST(test_second_signal)
{
    /* every request of the one connection queued at once */
    static const char *const args[] = {"--max-batch-tokens", "8", "--max-request-tokens", "8",
                                       "--max-conn-queue", "4096", NULL};
    proc p;
    int fd, rc;
    char c;
    double t0;
    spawn(&p, args);
    fd = connect_to(p.port);
    ck_assert_int_ge(fd, 0);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    for (int i = 0; i < 1000; i++) { /* one request per step: about a second of work */
        char line[128];
        int n = snprintf(line, sizeof line,
                         "{\"id\":%d,\"tokens\":8,\"positions\":[1,2,3,4,5,6,7,8]}\n", i);
        ck_assert_int_eq(send(fd, line, (size_t)n, MSG_NOSIGNAL), n);
    }
    ck_assert_int_eq(recv(fd, &c, 1, 0), 1); /* the server is working */
    t0 = now_s();
    kill(p.pid, SIGTERM);
    nanosleep(&(struct timespec){0, 100000000}, NULL);
    rc = finish(&p, SIGTERM, 20.0);
    close(fd);
    printf("second SIGTERM during the drain: status %d after %.2f s\n", rc, now_s() - t0);
    ck_assert_int_eq(rc, 128 + SIGTERM);
}
END_TEST

/* A client that never reads its replies: once 1 MiB of them wait, the
 * server stops reading from it, and after a signal the flush of its
 * connection would never end.  --drain-timeout 1 cuts the drain: the
 * connection is closed, and the server says so and exits 1 within about a
 * second of the signal. */
START_TEST(test_drain_timeout)
{
    /* the only pause is for the unread replies (no per-connection cap, which
     * would stop reading while the steps catch up) */
    static const char *const args[] = {"--max-batch-tokens", "32", "--max-batch-requests", "32",
                                       "--drain-timeout", "1", "--max-conn-queue", "16777216",
                                       NULL};
    static const char req[] = "{\"id\":\"never-read\",\"tokens\":1,\"positions\":[5]}\n";
    char dir[] = "/tmp/mlart-serve-d-XXXXXX", errp[80], msg[4096] = "";
    proc p;
    int fd, rc, efd;
    long nsent = 0;
    size_t off = 0;
    double t0, t_stall = -1.0, secs;
    ssize_t n;
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(errp, sizeof errp, "%s/stderr", dir);
    spawn_stderr = errp;
    spawn(&p, args);
    spawn_stderr = NULL;
    fd = connect_buf(p.port, 4096);
    ck_assert_int_ge(fd, 0);
    /* send until the server has stopped reading: sends refused for 0.5 s */
    t0 = now_s();
    while (now_s() - t0 < 60.0) {
        ssize_t w = send(fd, req + off, sizeof req - 1 - off, MSG_NOSIGNAL);
        if (w > 0) {
            off += (size_t)w;
            if (off == sizeof req - 1)
                nsent++, off = 0;
            t_stall = -1.0;
            continue;
        }
        ck_assert_msg(w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK), "send: %zd, %s", w,
                      strerror(errno));
        if (t_stall < 0)
            t_stall = now_s();
        else if (now_s() - t_stall > 0.5)
            break;
        nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
    ck_assert_msg(t_stall >= 0 && now_s() - t_stall > 0.5, "the server kept reading %ld requests",
                  nsent);
    t0 = now_s();
    kill(p.pid, SIGTERM);
    rc = finish(&p, 0, 20.0);
    secs = now_s() - t0;
    close(fd);
    efd = open(errp, O_RDONLY);
    ck_assert_int_ge(efd, 0);
    n = read(efd, msg, sizeof msg - 1);
    close(efd);
    msg[n > 0 ? n : 0] = '\0';
    unlink(errp);
    rmdir(dir);
    printf("drain timeout: %ld requests sent, never read; after SIGTERM exit %d in %.2f s; "
           "stderr:\n%s",
           nsent, rc, secs, msg);
    ck_assert_int_eq(rc, 1);
    ck_assert_msg(secs >= 0.9 && secs < 10.0, "exit %.2f s after the signal", secs);
    ck_assert_msg(strstr(msg, "drain not done after 1 s") && strstr(msg, "drain cut at 1 s: 1 "
                                                                         "connection(s) closed"),
                  "stderr: %s", msg);
}
END_TEST

/* --max-conns 2: with two connections open, a third gets one
 * too_many_connections line and is closed (also one that sent a request
 * first), while the two are served; once one of them closes, a new
 * connection is served. */
START_TEST(test_max_conns)
{
    static const char *const args[] = {"--max-conns", "2", NULL};
    static const char req[] = "{\"id\":\"m\",\"tokens\":1,\"positions\":[5]}\n";
    char line[1024];
    proc p;
    int a, b, d = -1, served = 0, refused = 0;
    double t0;
    spawn(&p, args);
    a = connect_to(p.port);
    b = connect_to(p.port);
    ck_assert_int_ge(a, 0);
    ck_assert_int_ge(b, 0);
    ask(a, req, line, sizeof line); /* both accepted and counted */
    ask(b, req, line, sizeof line);
    for (int k = 0; k < 2; k++) {
        int c = connect_to(p.port);
        ck_assert_int_ge(c, 0);
        if (k) { /* a client that does not wait to be greeted */
            const ssize_t w = send(c, req, sizeof req - 1, MSG_NOSIGNAL);
            ck_assert_int_eq(w, (ssize_t)sizeof req - 1);
        }
        ck_assert_msg(read_line(c, line, sizeof line, 10.0) > 0, "connection %d: no line", k);
        printf("max-conns 2, a third connection%s: %s\n", k ? " that sent a request" : "", line);
        ck_assert_msg(strstr(line, "\"id\":null,\"ok\":false") &&
                          strstr(line, "\"code\":\"too_many_connections\"") &&
                          strstr(line, "2 connections"),
                      "reply: %s", line);
        ck_assert_msg(closed_within(c, 5.0), "connection %d past the cap not closed", k);
        close(c);
    }
    ask(a, req, line, sizeof line); /* the two are still served */
    ck_assert_msg(strstr(line, "\"ok\":true"), "reply: %s", line);
    ask(b, req, line, sizeof line);
    ck_assert_msg(strstr(line, "\"ok\":true"), "reply: %s", line);
    close(a); /* room for one more, once the server has seen it go */
    t0 = now_s();
    while (!served && now_s() - t0 < 5.0) {
        d = connect_to(p.port);
        ck_assert_int_ge(d, 0);
        ck_assert_int_eq(send(d, req, sizeof req - 1, MSG_NOSIGNAL), (ssize_t)sizeof req - 1);
        ck_assert_int_gt(read_line(d, line, sizeof line, 10.0), 0);
        served = strstr(line, "\"ok\":true") != NULL;
        refused += !served;
        close(d);
        if (!served)
            nanosleep(&(struct timespec){0, 20000000}, NULL);
    }
    printf("max-conns 2: a connection after one of the two closed served after %d refusal(s)\n",
           refused);
    ck_assert_msg(served, "no connection served after one of the two closed: %s", line);
    close(b);
    ck_assert_int_eq(finish(&p, SIGTERM, 20.0), 0);
}
END_TEST

/* For secs seconds, or until all are closed, note when the server closes
 * each of fds[0..n) (its time in t[i]; t[i] < 0 while open, and a closed
 * one is not read again). */
static void watch_close(const int *fds, double *t, int n, double secs)
{
    const double t0 = now_s();
    do {
        int open = 0;
        for (int i = 0; i < n; i++) {
            char sink[512];
            ssize_t r;
            if (t[i] >= 0)
                continue;
            r = recv(fds[i], sink, sizeof sink, 0);
            if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK))
                t[i] = now_s();
            else
                open++;
        }
        if (!open)
            return;
        nanosleep(&(struct timespec){0, 2000000}, NULL);
    } while (now_s() - t0 < secs);
}

/* --idle-timeout-s 1 (a sweep every 0.25 s): a connection that sends
 * nothing, and one that sent half a line, are closed about a second after
 * they connected; one that sends a request every 0.4 s stays open while it
 * does, and is closed about a second after its last reply; one whose
 * replies wait unsent (it sent lines and reads nothing, until the server
 * stops reading from it) stays open well past the timeout, then gets every
 * reply when it reads, is still served, and is closed about a second
 * later. */
START_TEST(test_idle_timeout)
{
    enum { L = 1000 }; /* bytes of a bad line: each answered bad_json at once */
    static const char *const args[] = {"--idle-timeout-s", "1", NULL};
    static const char req[] = "{\"id\":\"i\",\"tokens\":1,\"positions\":[5]}\n";
    static char junk[64 * L];
    char line[1024];
    proc p;
    int fds[4]; /* a: silent, b: half a line, c: a request every 0.4 s, d: does not read */
    double t[4] = {-1, -1, -1, -1}, t0, t_stall = -1, t_c, t_d;
    size_t sent = 0;
    long got = 0;
    for (size_t i = 0; i < sizeof junk; i++)
        junk[i] = i % L == L - 1 ? '\n' : 'x';
    spawn(&p, args);
    t0 = now_s();
    fds[0] = connect_to(p.port);
    fds[1] = connect_to(p.port);
    fds[3] = connect_buf(p.port, 4096);
    ck_assert_int_ge(fds[0], 0);
    ck_assert_int_ge(fds[1], 0);
    ck_assert_int_ge(fds[3], 0);
    ck_assert_int_eq(send(fds[1], req, 6, MSG_NOSIGNAL), 6);
    /* d: lines until the server stops reading from it (sends refused for
     * 0.3 s): its replies then wait unsent */
    while (now_s() - t0 < 20.0) {
        const size_t off = sent % L;
        ssize_t w = send(fds[3], junk + off, sizeof junk - off, MSG_NOSIGNAL);
        if (w > 0) {
            sent += (size_t)w;
            t_stall = -1;
        } else {
            ck_assert_msg(errno == EAGAIN || errno == EWOULDBLOCK, "send: %s", strerror(errno));
            if (t_stall < 0)
                t_stall = now_s();
            else if (now_s() - t_stall > 0.3)
                break;
        }
        watch_close(fds, t, 2, 0.0);
    }
    ck_assert_msg(t_stall >= 0 && now_s() - t_stall > 0.3, "the server kept reading");
    /* c: four requests 0.4 s apart, all answered, meanwhile */
    fds[2] = connect_to(p.port);
    ck_assert_int_ge(fds[2], 0);
    for (int i = 0; i < 4; i++) {
        if (i)
            watch_close(fds, t, 2, 0.4);
        ask(fds[2], req, line, sizeof line);
        ck_assert_msg(strstr(line, "\"ok\":true"), "c, request %d: %s", i, line);
    }
    t_c = now_s();
    /* d, unread for longer than the timeout: every reply, then served */
    while (now_s() - t_stall < 1.6)
        watch_close(fds, t, 3, 0.05);
    {
        /* read in bulk: byte by byte, megabytes of replies take longer than
         * the timeout, and once the system holds the last of them the
         * connection is idle again */
        static char buf[1 << 16];
        const double t1 = now_s();
        while (got < (long)(sent / L) && now_s() - t1 < 10.0) {
            struct pollfd pf = {fds[3], POLLIN, 0};
            ssize_t r;
            if (poll(&pf, 1, 50) <= 0)
                continue;
            r = recv(fds[3], buf, sizeof buf, 0);
            ck_assert_msg(r > 0, "d closed after %ld of %zu replies", got, sent / L);
            for (ssize_t i = 0; i < r; i++)
                got += buf[i] == '\n';
        }
    }
    ck_assert_int_eq(got, (long)(sent / L));
    if (sent % L) { /* the line cut by the stall */
        const ssize_t w = send(fds[3], junk + sent % L, L - sent % L, MSG_NOSIGNAL);
        ck_assert_int_eq(w, (ssize_t)(L - sent % L));
        ck_assert_int_gt(read_line(fds[3], line, sizeof line, 10.0), 0);
    }
    ask(fds[3], req, line, sizeof line);
    ck_assert_msg(strstr(line, "\"ok\":true"), "d, after its replies: %s", line);
    t_d = now_s();
    watch_close(fds, t, 4, 3.0);
    printf("idle timeout 1 s (%.2f s in all): silent connection closed after %.2f s, half a "
           "line after %.2f s; "
           "after their last replies, a client that sent every 0.4 s after %.2f s, one that left "
           "%zu lines' replies unread for %.2f s after %.2f s\n",
           now_s() - t0, t[0] - t0, t[1] - t0, t[2] - t_c, sent / L, t_d - t_stall, t[3] - t_d);
    ck_assert_msg(t[0] - t0 > 0.9 && t[0] - t0 < 3.0, "silent: closed at %.2f s", t[0] - t0);
    ck_assert_msg(t[1] - t0 > 0.9 && t[1] - t0 < 3.0, "half a line: closed at %.2f s",
                  t[1] - t0);
    ck_assert_msg(t[2] - t_c > 0.9 && t[2] >= 0, "c: closed %.2f s after its last reply",
                  t[2] - t_c);
    ck_assert_msg(t[3] - t_d > 0.9 && t[3] >= 0, "d: closed %.2f s after its last reply",
                  t[3] - t_d);
    for (int i = 0; i < 4; i++)
        close(fds[i]);
    ck_assert_int_eq(finish(&p, SIGTERM, 20.0), 0);
}
END_TEST

/* --idle-timeout-s 0: no timeout; a silent connection is still open and
 * served after 1.5 s. */
START_TEST(test_idle_timeout_off)
{
    static const char *const args[] = {"--idle-timeout-s", "0", NULL};
    static const char req[] = "{\"id\":\"i\",\"tokens\":1,\"positions\":[5]}\n";
    char line[1024];
    proc p;
    int fd;
    double t = -1;
    spawn(&p, args);
    fd = connect_to(p.port);
    ck_assert_int_ge(fd, 0);
    watch_close(&fd, &t, 1, 1.5);
    ck_assert_msg(t < 0, "closed without a timeout");
    ask(fd, req, line, sizeof line);
    ck_assert_msg(strstr(line, "\"ok\":true"), "reply: %s", line);
    close(fd);
    ck_assert_int_eq(finish(&p, SIGTERM, 20.0), 0);
    printf("idle timeout 0: a silent connection still open and served after 1.5 s\n");
}
END_TEST

/* A checkpoint holding more heads than the server's geometry: refused at
 * start with a message naming both counts (the server has no TP ranks to
 * take the other heads). */
START_TEST(test_weights_head_count)
{
    enum { H = 8, P = 64, V = 64, L = 256, ROWS = H * (P + V) }; /* the server has 4 heads */
    static uint16_t bf[ROWS * L];
    char dir[] = "/tmp/mlart-serve-h-XXXXXX", path[64], errp[80], msg[512] = "";
    st_buf f;
    pid_t pid;
    int status, fd;
    ssize_t n;
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/w.safetensors", dir);
    snprintf(errp, sizeof errp, "%s/stderr", dir);
    for (int i = 0; i < ROWS * L; i++)
        bf[i] = 0x3c00; /* 2^-7 */
    {
        st_tensor t = {"model.layers.0.self_attn.kv_b_proj.weight", "BF16", 2, {ROWS, L}, bf,
                       sizeof bf, 0, 0, 0};
        ck_assert_int_eq(st_build(&t, 1, 1, &f), 0);
        ck_assert_int_eq(st_write_file(path, f.data, f.len), 0);
        st_buf_free(&f);
    }
    pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        int e = open(errp, O_WRONLY | O_CREAT | O_TRUNC, 0600), devnull = open("/dev/null", O_WRONLY);
        dup2(devnull, 1);
        dup2(e, 2);
        execl(server_path, server_path, "--port", "0", "--device", "cpu", "--weights", path,
              "--layer", "0", (char *)NULL);
        _exit(127);
    }
    waitpid(pid, &status, 0);
    fd = open(errp, O_RDONLY);
    ck_assert_int_ge(fd, 0);
    n = read(fd, msg, sizeof msg - 1);
    close(fd);
    msg[n > 0 ? n : 0] = '\0';
    printf("checkpoint of 8 heads for a 4-head server: status %d, %s", status, msg);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 1, "status %d", status);
    ck_assert_msg(strstr(msg, "holds 8 heads") && strstr(msg, "heads = 4"), "message: %s", msg);
    unlink(errp);
    unlink(path);
    rmdir(dir);
}
END_TEST

/* SIGTERM or SIGINT while the server starts (here while it reads its config
 * from a FIFO, which waits for the writer): it ends the start-up step in
 * progress, says so and exits 0 without listening, as a drain with nothing
 * to answer does (before, the signal's default action killed it: 143 or
 * 130). */
START_TEST(test_signal_at_start)
{
    static const char cfg[] = "[model]\nheads = 4\nqk_nope_dim = 64\nrope_dim = 64\n"
                              "kv_lora_rank = 256\nv_head_dim = 64\ntopk = 64\n";
    static const int sigs[] = {SIGTERM, SIGINT};
    char dir[] = "/tmp/mlart-serve-s-XXXXXX", fifo[64], errp[80];
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(fifo, sizeof fifo, "%s/config.ini", dir);
    snprintf(errp, sizeof errp, "%s/stderr", dir);
    ck_assert_int_eq(mkfifo(fifo, 0600), 0);
    for (int k = 0; k < 2; k++) {
        char msg[1024], out[256], want[64];
        int outp[2], fd = -1, status = -1, efd;
        ssize_t n, r;
        double t0;
        pid_t pid;
        ck_assert_int_eq(pipe(outp), 0);
        pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
            int e = open(errp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
            signal(SIGINT, SIG_DFL);
            signal(SIGTERM, SIG_DFL);
            if (e < 0 || dup2(e, 2) < 0 || dup2(outp[1], 1) < 0)
                _exit(126);
            close(outp[0]);
            execl(server_path, server_path, "--port", "0", "--device", "cpu", "--config", fifo,
                  (char *)NULL);
            _exit(127);
        }
        close(outp[1]);
        /* the server has opened the config once a writer can open it */
        t0 = now_s();
        while ((fd = open(fifo, O_WRONLY | O_NONBLOCK)) < 0 && now_s() - t0 < 10.0)
            nanosleep(&(struct timespec){0, 5000000}, NULL);
        ck_assert_msg(fd >= 0, "the server never opened its config: %s", strerror(errno));
        kill(pid, sigs[k]); /* before it can have read a byte of it */
        nanosleep(&(struct timespec){0, 50000000}, NULL);
        n = write(fd, cfg, sizeof cfg - 1);
        close(fd);
        t0 = now_s();
        while (waitpid(pid, &status, WNOHANG) != pid) {
            if (now_s() - t0 > 20.0) {
                kill(pid, SIGKILL);
                waitpid(pid, &status, 0);
                break;
            }
            nanosleep(&(struct timespec){0, 10000000}, NULL);
        }
        r = read(outp[0], out, sizeof out - 1);
        out[r > 0 ? r : 0] = '\0';
        close(outp[0]);
        efd = open(errp, O_RDONLY);
        ck_assert_int_ge(efd, 0);
        r = read(efd, msg, sizeof msg - 1);
        msg[r > 0 ? r : 0] = '\0';
        close(efd);
        printf("signal %d during start-up (config %zd bytes after it): status %d, stdout '%s', "
               "stderr: %s",
               sigs[k], n, status, out, msg);
        ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "status %d (%s)", status,
                      WIFSIGNALED(status) ? "killed by its signal" : "exited");
        ck_assert_msg(!strstr(out, "listening"), "it listened: %s", out);
        snprintf(want, sizeof want, "signal %d during start-up", sigs[k]);
        ck_assert_msg(strstr(msg, want), "stderr: %s", msg);
    }
    unlink(errp);
    unlink(fifo);
    rmdir(dir);
}
END_TEST

/* Bad command lines: exit 2 with a message naming the option and the value
 * (a start-up failure, such as a missing weights file, exits 1). */
START_TEST(test_bad_options)
{
    static const struct {
        const char *opt, *val; /* val NULL: the option comes last, without it */
        int status;
        const char *said; /* a part of the message, when given */
    } bad[] = {
        {"--port", "70000", 2, "bad value '70000' for --port"},
        {"--device", "tpu", 2, NULL},
        {"--bogus", "1", 2, "unknown option --bogus"},
        {"--max-request-tokens", "65", 2, NULL},
        {"--weights", "/nonexistent.safetensors", 1, NULL},
        {"--drain-timeout", "-1", 2, NULL},
        {"--max-conns", "0", 2, "bad value '0' for --max-conns"},
        {"--max-conns", "1048577", 2, "bad value '1048577' for --max-conns"},
        {"--max-conns", "8x", 2, "bad value '8x' for --max-conns"},
        {"--max-conns", "", 2, "bad value '' for --max-conns"},
        {"--max-conns", NULL, 2, "--max-conns needs a value"},
        {"--idle-timeout-s", "-1", 2, "bad value '-1' for --idle-timeout-s"},
        {"--idle-timeout-s", "86401", 2, "bad value '86401' for --idle-timeout-s"},
        {"--idle-timeout-s", "1.5", 2, "bad value '1.5' for --idle-timeout-s"},
        {"--idle-timeout-s", NULL, 2, "--idle-timeout-s needs a value"},
    };
    char dir[] = "/tmp/mlart-serve-o-XXXXXX", errp[80];
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(errp, sizeof errp, "%s/stderr", dir);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        pid_t pid = fork();
        int status, fd;
        char msg[4096];
        ssize_t n;
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
            int devnull = open("/dev/null", O_WRONLY);
            int e = open(errp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
            dup2(devnull, 1);
            dup2(e, 2);
            execl(server_path, server_path, bad[i].opt, bad[i].val, (char *)NULL);
            _exit(127);
        }
        waitpid(pid, &status, 0);
        fd = open(errp, O_RDONLY);
        ck_assert_int_ge(fd, 0);
        n = read(fd, msg, sizeof msg - 1);
        close(fd);
        msg[n > 0 ? n : 0] = '\0';
        ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == bad[i].status,
                      "%s %s: status %d, want exit %d; stderr: %s", bad[i].opt,
                      bad[i].val ? bad[i].val : "(none)", status, bad[i].status, msg);
        ck_assert_msg(!bad[i].said || strstr(msg, bad[i].said), "%s %s: stderr lacks '%s': %s",
                      bad[i].opt, bad[i].val ? bad[i].val : "(none)", bad[i].said, msg);
    }
    unlink(errp);
    rmdir(dir);
    printf("bad options: exit 2 naming them; a missing weights file: exit 1\n");
}
END_TEST

/* test_serve SERVER [ARGS...]: ARGS go on every server's command line (the
 * GPU runs: "--device cuda --config FILE"); with them the suite leaves out
 * the cases that fix their own device or count on slow steps, and exits 77
 * when "--device cuda" is asked for on a machine without a device. */
int main(int argc, char **argv)
{
    Suite *s;
    TCase *proto, *live;
    if (argc < 2) {
        fprintf(stderr, "usage: %s PATH-TO-mlart-serve-example [SERVER-ARGS...]\n", argv[0]);
        return 2;
    }
    server_path = argv[1];
    server_extra = argc > 2 ? argv + 2 : NULL;
    for (int i = 2; i + 1 < argc; i++) {
        int ndev = 0;
        if (!strcmp(argv[i], "--device") && !strcmp(argv[i + 1], "cuda") &&
            (mlart_cuda_device_count(&ndev) || ndev < 1)) {
            printf("no CUDA device: skipped\n");
            return 77;
        }
    }
    signal(SIGPIPE, SIG_IGN);
    s = suite_create("serve");
    proto = tcase_create("protocol");
    live = tcase_create("server");
    tcase_add_test(proto, test_parse);
    tcase_add_test(proto, test_framer_and_replies);
    tcase_add_test(proto, test_framer_pause);
    tcase_set_timeout(live, 180);
    tcase_add_test(live, test_load);
    tcase_add_test(live, test_batch_invariance);
    tcase_add_test(live, test_fair_share);
    tcase_add_test(live, test_sigterm);
    tcase_add_test(live, test_sigint);
    tcase_add_test(live, test_clients_vanish);
    tcase_add_test(live, test_refused_connections);
    tcase_add_test(live, test_bad_options);
    tcase_add_test(live, test_signal_at_start);
    tcase_add_test(live, test_max_conns);
    tcase_add_test(live, test_idle_timeout);
    tcase_add_test(live, test_idle_timeout_off);
    tcase_add_test(live, test_drain_timeout);
    if (!server_extra) {
        tcase_add_test(live, test_second_signal); /* needs about a second of CPU steps */
        tcase_add_test(live, test_weights);       /* runs its servers on the CPU */
        tcase_add_test(live, test_weights_head_count); /* the CPU too */
    }
    suite_add_tcase(s, proto);
    suite_add_tcase(s, live);
    return check_run(s, CK_FORK_GETENV);
}
