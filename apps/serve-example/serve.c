/* mlart-serve-example: a small serving binary that embeds libmlart.
 *
 * A libuv loop accepts newline-delimited JSON decode requests on 127.0.0.1
 * (protocol: docs/serve.md), batches the pending ones into one decode step,
 * runs the step on a worker thread (one step in flight at a time: the layer
 * owns one set of buffers), and answers each request with its timing and a
 * checksum of its output.  At most --max-conns connections; one idle for
 * --idle-timeout-s is closed.  SIGINT/SIGTERM: stop accepting, answer every
 * request already received, refuse new ones, close, exit 0; a drain that
 * takes longer than --drain-timeout closes what is left and exits 1; during
 * the start-up, exit 0 once the step in progress is done, without
 * listening. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <uv.h>

#include <mlart/config.h>
#include <mlart/mlart.h>

#include "engine.h"
#include "serve_proto.h"

#define REPLY_MAX 1024
/* Stop reading from a client whose unread replies pile up past this. */
#define WRITE_HIGH_WATER (1u << 20)
/* ... or past this many replies, each a write of its own (a short error
 * reply costs the server several times its bytes). */
#define WRITE_HIGH_COUNT 4096
/* Open files the server needs besides its connections' (the standard
 * streams, the listener, libuv's, a GPU driver's), for the open-file limit
 * that --max-conns needs. */
#define FD_SPARE 64

typedef struct server server;
typedef struct conn conn;

typedef struct pending {
    struct pending *next;
    conn *c;
    serve_request req;
    uint64_t t_arrival;   /* ns, uv_hrtime */
    uint64_t checksum;
} pending;

struct conn {
    uv_tcp_t tcp;
    server *srv;
    serve_framer fr;
    int refs;             /* 1 while the handle is open, + 1 per request in the queue or step */
    int closing;
    int reading;
    int eof;              /* the client half-closed: answer what it sent, then close */
    int shut;             /* uv_shutdown issued */
    int pending;          /* its requests queued or in the running step */
    int writes;           /* its replies written but not yet sent */
    char *held;           /* bytes read but not framed yet: it was paused mid-read */
    size_t held_len, held_off;
    uint64_t active_ms;   /* uv_now at its last read or its last reply sent (idle timeout) */
    conn *prev, *next;    /* the server's list of open connections */
};

typedef struct write_req {
    uv_write_t w;
    conn *c;
    size_t len;
    char data[];
} write_req;

struct server {
    uv_loop_t *loop;
    uv_tcp_t listener;
    uv_tcp_t spare;  /* a connection refused for want of memory (reject) */
    int rejecting;   /* spare is closing */
    int reject_waiting; /* a connection came while spare was closing: the
                           listener is paused until it is accepted */
    long test_refuse;   /* MLART_SERVE_TEST_REFUSE: refuse that many
                           connections as if out of memory (tests) */
    size_t nconns;      /* open connections (in conns), closing ones too */
    size_t max_conns;   /* --max-conns: past it, one error line and closed */
    uv_signal_t sig[2];
    uv_work_t work;
    serve_engine *eng;
    serve_limits lim;
    int32_t max_batch_tokens, max_batch_requests;
    size_t max_line, max_queue;
    int max_conn_queue; /* a connection's requests queued or in a step, at most */
    pending *qhead, *qtail;
    size_t qlen;
    /* the step in flight */
    int busy;
    pending **batch;
    int nbatch;
    int batch_tokens;
    uint64_t t_step0, t_step1;
    int step_rc;
    char step_err[256];
    /* shutdown */
    int stopping;
    conn *conns;
    uv_timer_t idle;         /* --idle-timeout-s: the sweep over conns */
    long idle_timeout_s;     /* 0: none */
    uv_timer_t drain;        /* --drain-timeout, started by the signal */
    long drain_timeout_s;    /* 0: no limit */
    int drain_timed_out;
    uint64_t drain_dropped;  /* queued requests dropped at the timeout */
    uint64_t drain_unsent;   /* replies written but never sent (cancelled) */
    uint64_t drain_closed;   /* connections closed at the timeout */
    /* counters */
    uint64_t served, errors, steps, step_tokens, step_requests, step_ns;
};

static uint64_t now_ns(void)
{
    return uv_hrtime();
}

/* ---- connections and writes ------------------------------------------- */

static void conn_unref(conn *c)
{
    if (--c->refs == 0) {
        serve_framer_free(&c->fr);
        free(c->held);
        free(c);
    }
}

static void on_closed(uv_handle_t *h)
{
    conn *c = h->data;
    server *s = c->srv;
    s->nconns--;
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    conn_unref(c);
}

static void conn_close(conn *c)
{
    if (c->closing)
        return;
    c->closing = 1;
    uv_close((uv_handle_t *)&c->tcp, on_closed);
}

static void on_read(uv_stream_t *st, ssize_t n, const uv_buf_t *buf);
static void on_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf);

static void on_line(void *ctx, const char *line, size_t len, int too_long);
static void start_step(server *s);

/* Go on with a client once neither reason to pause it holds: its unread
 * replies (WRITE_HIGH_WATER) and its requests in the queue or the step
 * (max_conn_queue, which keeps one fast client from holding the queue that
 * every client shares).  First the lines it sent that were read but not
 * framed when it was paused, then reading again. */
static void maybe_resume(conn *c)
{
    server *s = c->srv;
    if (c->closing || c->reading || c->eof || c->shut || c->pending >= s->max_conn_queue ||
        uv_stream_get_write_queue_size((uv_stream_t *)&c->tcp) >= WRITE_HIGH_WATER / 2 ||
        c->writes >= WRITE_HIGH_COUNT / 2)
        return;
    if (c->held) {
        const size_t left = c->held_len - c->held_off;
        const size_t used = serve_framer_feed(&c->fr, c->held + c->held_off, left, on_line, c);
        c->held_off += used;
        start_step(s);
        if (used < left)
            return; /* paused again */
        free(c->held);
        c->held = NULL;
        c->held_len = c->held_off = 0;
    }
    if (!s->stopping && !c->closing && !c->reading &&
        uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) == 0)
        c->reading = 1;
}

static void on_written(uv_write_t *w, int status)
{
    write_req *wr = (write_req *)w;
    conn *c = wr->c;
    c->writes--;
    c->active_ms = uv_now(c->srv->loop);
    if (status == UV_ECANCELED && c->srv->drain_timed_out)
        c->srv->drain_unsent++;
    if (status < 0 && !c->closing)
        conn_close(c);
    maybe_resume(c);
    free(wr);
    conn_unref(c);
}

static void send_reply(conn *c, const char *text, size_t len)
{
    write_req *wr;
    uv_buf_t b;
    if (c->closing || !len)
        return;
    wr = malloc(sizeof *wr + len);
    if (!wr) {
        conn_close(c); /* cannot answer: closing tells the client so */
        return;
    }
    memcpy(wr->data, text, len);
    wr->len = len;
    wr->c = c;
    c->refs++;
    b = uv_buf_init(wr->data, (unsigned)len);
    if (uv_write(&wr->w, (uv_stream_t *)&c->tcp, &b, 1, on_written) < 0) {
        c->refs--;
        free(wr);
        conn_close(c);
        return;
    }
    c->writes++;
    if (uv_stream_get_write_queue_size((uv_stream_t *)&c->tcp) > WRITE_HIGH_WATER ||
        c->writes > WRITE_HIGH_COUNT) {
        c->fr.pause = 1; /* the rest of the read in progress waits too */
        if (c->reading) {
            uv_read_stop((uv_stream_t *)&c->tcp);
            c->reading = 0;
        }
    }
}

static void send_error(conn *c, const char *id, serve_err e, const char *msg)
{
    char buf[REPLY_MAX];
    c->srv->errors++;
    send_reply(c, buf, serve_format_error(buf, sizeof buf, id, e, msg));
}

static void on_shutdown(uv_shutdown_t *r, int status)
{
    conn *c = r->data;
    (void)status;
    free(r);
    conn_close(c);
    conn_unref(c);
}

/* Flush the replies already written, then close. */
static void conn_shutdown(conn *c)
{
    uv_shutdown_t *r;
    if (c->closing || c->shut)
        return;
    c->shut = 1;
    if (c->reading)
        uv_read_stop((uv_stream_t *)&c->tcp);
    c->reading = 0;
    r = malloc(sizeof *r);
    if (!r) {
        conn_close(c);
        return;
    }
    r->data = c;
    c->refs++;
    if (uv_shutdown(r, (uv_stream_t *)&c->tcp, on_shutdown) < 0) {
        free(r);
        c->refs--;
        conn_close(c);
    }
}

/* ---- steps ------------------------------------------------------------- */

static void maybe_finish(server *s);
static void start_step(server *s);

static void work_cb(uv_work_t *w)
{
    server *s = w->data;
    const serve_request *reqs[256];
    uint64_t sums[256];
    s->t_step0 = now_ns();
    for (int i = 0; i < s->nbatch; i++)
        reqs[i] = &s->batch[i]->req;
    s->step_rc = serve_engine_step(s->eng, reqs, s->nbatch, sums, s->step_err,
                                   sizeof s->step_err);
    for (int i = 0; i < s->nbatch; i++)
        s->batch[i]->checksum = sums[i];
    s->t_step1 = now_ns();
}

static void after_work_cb(uv_work_t *w, int status)
{
    server *s = w->data;
    uint64_t t = now_ns();
    s->steps++;
    s->step_tokens += (uint64_t)s->batch_tokens;
    s->step_requests += (uint64_t)s->nbatch;
    s->step_ns += s->t_step1 - s->t_step0;
    for (int i = 0; i < s->nbatch; i++) {
        pending *p = s->batch[i];
        if (p->c->closing) {
            /* the client went, or the drain timed out: nothing to answer */
            s->drain_dropped += (uint64_t)s->drain_timed_out;
        } else if (status < 0 || s->step_rc) {
            send_error(p->c, p->req.id, SERVE_EINTERNAL,
                       status < 0 ? "step cancelled" : s->step_err);
        } else {
            char buf[REPLY_MAX];
            serve_result r;
            r.batch_tokens = s->batch_tokens;
            r.batch_requests = s->nbatch;
            r.queue_us = (s->t_step0 - p->t_arrival) / 1000;
            r.compute_us = (s->t_step1 - s->t_step0) / 1000;
            r.total_us = (t - p->t_arrival) / 1000;
            r.checksum = p->checksum;
            s->served++;
            send_reply(p->c, buf, serve_format_ok(buf, sizeof buf, &p->req, &r));
        }
        if (--p->c->pending == 0 && p->c->eof)
            conn_shutdown(p->c);
        else
            maybe_resume(p->c);
        conn_unref(p->c);
        free(p);
    }
    s->nbatch = 0;
    s->busy = 0;
    if (s->qhead)
        start_step(s);
    else
        maybe_finish(s);
}

/* Take whole requests from the queue head while they fit one step. */
static void start_step(server *s)
{
    int tokens = 0;
    if (s->busy || !s->qhead)
        return;
    while (s->qhead && s->nbatch < s->max_batch_requests &&
           tokens + s->qhead->req.tokens <= s->max_batch_tokens) {
        pending *p = s->qhead;
        s->qhead = p->next;
        if (!s->qhead)
            s->qtail = NULL;
        s->qlen--;
        tokens += p->req.tokens;
        s->batch[s->nbatch++] = p;
    }
    s->batch_tokens = tokens;
    s->busy = 1;
    s->work.data = s;
    if (uv_queue_work(s->loop, &s->work, work_cb, after_work_cb) < 0) {
        s->step_rc = -1;
        snprintf(s->step_err, sizeof s->step_err, "cannot queue the step");
        after_work_cb(&s->work, -1);
    }
}

/* ---- requests ---------------------------------------------------------- */

static void on_line(void *ctx, const char *line, size_t len, int too_long)
{
    conn *c = ctx;
    server *s = c->srv;
    serve_request req;
    char msg[200];
    serve_err e;
    pending *p;
    if (c->closing)
        return;
    if (too_long) {
        snprintf(msg, sizeof msg, "request line longer than %zu bytes", s->max_line);
        send_error(c, NULL, SERVE_ETOOLONG, msg);
        return;
    }
    e = serve_parse_request(line, len, &s->lim, &req, msg, sizeof msg);
    if (e != SERVE_OK) {
        send_error(c, req.id, e, msg);
        return;
    }
    if (s->stopping) {
        send_error(c, req.id, SERVE_ESHUTDOWN, "the server is shutting down");
        return;
    }
    if (c->pending >= s->max_conn_queue) {
        /* past the connection's share: the framer pauses at the share, so
         * only a line that ends the stream (framer_finish) can come here */
        snprintf(msg, sizeof msg, "%d requests of this connection already queued", c->pending);
        send_error(c, req.id, SERVE_EBUSY, msg);
        return;
    }
    if (s->qlen >= s->max_queue) {
        snprintf(msg, sizeof msg, "%zu requests already queued", s->qlen);
        send_error(c, req.id, SERVE_EBUSY, msg);
        return;
    }
    p = malloc(sizeof *p);
    if (!p) {
        send_error(c, req.id, SERVE_EINTERNAL, "out of memory");
        return;
    }
    p->next = NULL;
    p->c = c;
    p->req = req;
    p->t_arrival = now_ns();
    c->refs++;
    if (++c->pending >= s->max_conn_queue) {
        c->fr.pause = 1; /* the rest of the read in progress waits for a reply */
        if (c->reading) {
            uv_read_stop((uv_stream_t *)&c->tcp);
            c->reading = 0;
        }
    }
    if (s->qtail)
        s->qtail->next = p;
    else
        s->qhead = p;
    s->qtail = p;
    s->qlen++;
}

static void on_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf)
{
    static char slab[65536]; /* one loop thread, and on_read consumes it before returning */
    (void)h;
    (void)hint;
    *buf = uv_buf_init(slab, sizeof slab);
}

static void on_read(uv_stream_t *st, ssize_t n, const uv_buf_t *buf)
{
    conn *c = st->data;
    if (n == UV_EOF) {
        /* half-close: the client may still read; answer what it sent, a
         * last line without its newline too */
        uv_read_stop(st);
        c->reading = 0;
        c->eof = 1;
        serve_framer_finish(&c->fr, on_line, c);
        start_step(c->srv);
        if (c->pending == 0)
            conn_shutdown(c);
        return;
    }
    if (n < 0) {
        conn_close(c); /* reset or error: its queued requests are dropped at reply time */
        return;
    }
    c->active_ms = uv_now(c->srv->loop);
    {
        const size_t used = serve_framer_feed(&c->fr, buf->base, (size_t)n, on_line, c);
        if (used < (size_t)n && !c->closing) {
            /* paused mid-read: keep the rest (the slab is reused) */
            c->held_len = (size_t)n - used;
            c->held_off = 0;
            c->held = malloc(c->held_len);
            if (!c->held)
                conn_close(c); /* cannot keep what it sent: closing tells it so */
            else
                memcpy(c->held, buf->base + used, c->held_len);
        }
    }
    start_step(c->srv);
}

static void on_connection(uv_stream_t *l, int status);

static void reject_closed(uv_handle_t *h)
{
    server *s = h->data;
    s->rejecting = 0;
    if (s->reject_waiting && !uv_is_closing((uv_handle_t *)&s->listener)) {
        s->reject_waiting = 0;
        on_connection((uv_stream_t *)&s->listener, 0); /* serve it now, or refuse it */
    }
}

/* A connection that cannot be served (out of memory): accept it into the
 * server's spare handle and close it at once.  Left unaccepted, it would
 * make libuv stop watching the listening socket for good; so one that comes
 * while the spare is still closing waits for reject_closed, which offers it
 * to on_connection again.  Returns 1 when it was closed, 0 when it waits. */
static int reject(server *s, uv_stream_t *l)
{
    if (s->rejecting) {
        s->reject_waiting = 1;
        return 0;
    }
    if (uv_tcp_init(s->loop, &s->spare) < 0)
        return 0;
    s->spare.data = s;
    s->rejecting = 1;
    uv_accept(l, (uv_stream_t *)&s->spare);
    uv_close((uv_handle_t *)&s->spare, reject_closed);
    return 1;
}

/* A connection past --max-conns: accepted into a handle of its own, told
 * so in one line, and closed once the line is sent; it never counts as one
 * of the server's connections, and holds only this until it is closed. */
typedef struct refusal {
    uv_tcp_t tcp;
    uv_write_t w;
    uv_shutdown_t sh;
    char line[256];
} refusal;

static void refusal_closed(uv_handle_t *h)
{
    free(h->data);
}

static void refusal_written(uv_write_t *w, int status)
{
    (void)w, (void)status; /* the shutdown queued after it closes */
}

static void refusal_shut(uv_shutdown_t *sh, int status)
{
    (void)status;
    uv_close((uv_handle_t *)sh->handle, refusal_closed);
}

static void refuse_full(server *s, uv_stream_t *l)
{
    refusal *r = malloc(sizeof *r);
    char msg[96];
    uv_buf_t b;
    if (!r || uv_tcp_init(s->loop, &r->tcp) < 0) {
        free(r);
        reject(s, l); /* no memory for the line: closed without it */
        return;
    }
    r->tcp.data = r;
    if (uv_accept(l, (uv_stream_t *)&r->tcp) < 0) {
        uv_close((uv_handle_t *)&r->tcp, refusal_closed);
        return;
    }
    snprintf(msg, sizeof msg, "%zu connections already open (--max-conns)", s->nconns);
    b = uv_buf_init(r->line,
                    (unsigned)serve_format_error(r->line, sizeof r->line, NULL, SERVE_ECONNS, msg));
    s->errors++;
    if (uv_write(&r->w, (uv_stream_t *)&r->tcp, &b, 1, refusal_written) < 0 ||
        uv_shutdown(&r->sh, (uv_stream_t *)&r->tcp, refusal_shut) < 0)
        uv_close((uv_handle_t *)&r->tcp, refusal_closed);
}

static void on_connection(uv_stream_t *l, int status)
{
    server *s = l->data;
    conn *c;
    if (status < 0 || s->stopping)
        return;
    if (s->nconns >= s->max_conns) {
        refuse_full(s, l);
        return;
    }
    if (s->test_refuse > 0) {
        /* counted when the connection is closed: one that waits comes
         * back here, and is the same attempt */
        s->test_refuse -= reject(s, l);
        return;
    }
    c = calloc(1, sizeof *c);
    if (!c) {
        reject(s, l);
        return;
    }
    c->srv = s;
    c->refs = 1;
    if (serve_framer_init(&c->fr, s->max_line)) {
        free(c);
        reject(s, l);
        return;
    }
    if (uv_tcp_init(s->loop, &c->tcp) < 0) {
        serve_framer_free(&c->fr);
        free(c);
        reject(s, l);
        return;
    }
    c->tcp.data = c;
    c->next = s->conns;
    if (s->conns)
        s->conns->prev = c;
    s->conns = c;
    s->nconns++;
    if (uv_accept(l, (uv_stream_t *)&c->tcp) < 0 ||
        uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) < 0) {
        conn_close(c);
        return;
    }
    uv_tcp_nodelay(&c->tcp, 1);
    c->reading = 1;
    c->active_ms = uv_now(s->loop);
}

/* --idle-timeout-s.  One sweep timer for all the connections rather than a
 * timer each: a timer per connection would be a second handle whose close
 * the connection's free waits for, re-armed on every read; a walk over the
 * list (at most --max-conns) every quarter of the timeout, at most every
 * second, is cheap, and closes an idle connection at most one tick late.
 * Idle: nothing queued, running or unsent, no bytes held back, and nothing
 * read nor sent for the timeout; it is shut down like a drained one. */
static void on_idle_sweep(uv_timer_t *t)
{
    server *s = t->data;
    const uint64_t now = uv_now(s->loop), limit = (uint64_t)s->idle_timeout_s * 1000;
    for (conn *c = s->conns; c; c = c->next)
        if (!c->closing && !c->shut && !c->pending && !c->writes && !c->held &&
            now - c->active_ms >= limit)
            conn_shutdown(c);
}

/* ---- shutdown ---------------------------------------------------------- */

/* Once nothing is queued or running: flush every connection, then close. */
static void maybe_finish(server *s)
{
    if (!s->stopping || s->busy || s->qhead)
        return;
    for (conn *c = s->conns; c; c = c->next)
        conn_shutdown(c);
    for (int i = 0; i < 2; i++)
        if (!uv_is_closing((uv_handle_t *)&s->sig[i]))
            uv_close((uv_handle_t *)&s->sig[i], NULL);
}

/* The drain took longer than --drain-timeout (a client that does not read
 * its replies holds its connection's flush for ever): drop what is queued,
 * close every connection (libuv cancels their unsent writes), and let the
 * step in flight, if any, end without replies. */
static void on_drain_timeout(uv_timer_t *t)
{
    server *s = t->data;
    while (s->qhead) {
        pending *p = s->qhead;
        s->qhead = p->next;
        p->c->pending--;
        conn_unref(p->c);
        free(p);
        s->drain_dropped++;
    }
    s->qtail = NULL;
    s->qlen = 0;
    s->drain_timed_out = 1;
    for (conn *c = s->conns; c; c = c->next)
        if (!c->closing) {
            conn_close(c);
            s->drain_closed++;
        }
    for (int i = 0; i < 2; i++)
        if (!uv_is_closing((uv_handle_t *)&s->sig[i]))
            uv_close((uv_handle_t *)&s->sig[i], NULL);
    fprintf(stderr, "mlart-serve-example: drain not done after %ld s (--drain-timeout): closing "
                    "%llu connection(s), %llu queued request(s) dropped%s\n",
            s->drain_timeout_s, (unsigned long long)s->drain_closed,
            (unsigned long long)s->drain_dropped,
            s->busy ? ", the running step's replies dropped" : "");
}

static void on_signal(uv_signal_t *h, int signum)
{
    server *s = h->data;
    if (s->stopping)
        return;
    s->stopping = 1;
    /* with no watcher left, libuv restores the default action: a second
     * signal ends the process at once, for when a drain takes too long */
    uv_signal_stop(&s->sig[0]);
    uv_signal_stop(&s->sig[1]);
    fprintf(stderr, "mlart-serve-example: signal %d: answering %zu queued%s request(s), then "
                    "exiting\n",
            signum, s->qlen, s->busy ? " + running" : "");
    uv_close((uv_handle_t *)&s->listener, NULL);
    if (s->drain_timeout_s > 0 &&
        uv_timer_start(&s->drain, on_drain_timeout, (uint64_t)s->drain_timeout_s * 1000, 0) == 0)
        uv_unref((uv_handle_t *)&s->drain); /* the loop ends when the drain does */
    maybe_finish(s);
}

/* ---- main -------------------------------------------------------------- */

/* Room for --max-conns connections in the open-file limit: a connection
 * past that limit never reaches the server (libuv closes it without a
 * word), so the soft limit is raised as far as the hard one allows, and
 * when that is not enough the server says how many fit. */
static void fd_room(size_t max_conns)
{
    struct rlimit rl;
    const rlim_t want = (rlim_t)max_conns + FD_SPARE;
    if (getrlimit(RLIMIT_NOFILE, &rl) || rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= want)
        return;
    rl.rlim_cur = rl.rlim_max == RLIM_INFINITY || rl.rlim_max >= want ? want : rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur >= want)
        return;
    getrlimit(RLIMIT_NOFILE, &rl);
    fprintf(stderr, "mlart-serve-example: --max-conns %zu needs about %llu open files, the "
                    "limit is %llu: past about %llu connections they are closed without a "
                    "reply\n",
            max_conns, (unsigned long long)want, (unsigned long long)rl.rlim_cur,
            (unsigned long long)(rl.rlim_cur > FD_SPARE ? rl.rlim_cur - FD_SPARE : 0));
}

/* SIGINT/SIGTERM that came before the loop watches them (the start-up:
 * the config, the weights, the engine, which can take seconds on a GPU). */
static volatile sig_atomic_t start_signal;

static void on_start_signal(int sig)
{
    start_signal = sig;
    /* a second one gets the default action, as during a drain */
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
}

/* A signal during the start-up: nothing was received, so there is nothing
 * to answer; exit as a drain that is done does. */
static int start_stopped(void)
{
    fprintf(stderr, "mlart-serve-example: signal %d during start-up: exiting\n",
            (int)start_signal);
    return 0;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: mlart-serve-example [options]\n"
            "  --port N               TCP port on 127.0.0.1 (0: any free port; default 0)\n"
            "  --device auto|cpu|cuda where steps run (default auto: cuda if present)\n"
            "  --backend NAME         attention backend (default: the device's default)\n"
            "  --config FILE          model geometry from an mlart config file\n"
            "  --heads N --topk N     geometry overrides (default H=4 P=64 R=64 L=256 V=64\n"
            "                         topk=64 page=64 bf16 cache)\n"
            "  --kv-format bf16|fp8_ds_mla\n"
            "  --context N            positions per request: [0, N) (default 1024)\n"
            "  --max-request-tokens N tokens per request, <= 64 (default 8)\n"
            "  --max-batch-tokens N   tokens per step (default 32)\n"
            "  --max-batch-requests N requests per step (default 16, <= 256)\n"
            "  --max-line N           request line cap in bytes (default 4096)\n"
            "  --max-queue N          queued requests before 'busy' replies (default 4096)\n"
            "  --max-conn-queue N     one connection's requests queued or in a step; past it\n"
            "                         the server stops reading from it (default 64)\n"
            "  --max-conns N          open connections; one more is answered\n"
            "                         'too_many_connections' and closed (default 1024)\n"
            "  --idle-timeout-s N     close a connection with nothing queued, running or\n"
            "                         unsent after N seconds without input (default 300;\n"
            "                         0: never)\n"
            "  --drain-timeout S      after SIGINT/SIGTERM, close what is left after S seconds\n"
            "                         and exit 1 (default 30; 0: no limit)\n"
            "  --no-graph             launch each step's kernels directly instead of\n"
            "                         replaying its bucket's CUDA graph\n"
            "  --weights FILE --layer N  W_UK_T/W_UV from a .safetensors kv_b_proj\n"
            "  --seed N               synthetic weights and cache (default 1)\n");
}

static int parse_int(const char *s, long lo, long hi, long *out)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (!*s || *end || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

int main(int argc, char **argv)
{
    server s;
    serve_engine_opts eo;
    struct sockaddr_in addr;
    struct sockaddr_storage bound;
    int namelen = sizeof bound, rc, port = 0;
    long v;
    const char *config = NULL;
    long heads = -1, topk = -1;
    const char *kvfmt = NULL;
    char err[512], backend_buf[64];
    int32_t graph_sizes[MLART_CONFIG_MAX_GRAPH_SIZES];

    {
        /* SA_RESTART: a config read from a FIFO goes on after the signal */
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_start_signal;
        sa.sa_flags = SA_RESTART;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGINT, &sa, NULL);
        sigaction(SIGTERM, &sa, NULL);
    }
    memset(&s, 0, sizeof s);
    memset(&eo, 0, sizeof eo);
    eo.device = SERVE_DEVICE_AUTO;
    eo.geom.heads = 4, eo.geom.qk_nope = 64, eo.geom.rope = 64, eo.geom.kv_lora = 256;
    eo.geom.v_head = 64, eo.geom.topk = 64, eo.geom.page_size = 64;
    eo.geom.kv_format = MLART_KV_BF16;
    eo.geom.softmax_scale = 0.0f; /* 1/sqrt(P+R) below */
    eo.context = 1024;
    eo.seed = 1;
    s.lim.max_tokens = 8;
    s.max_batch_tokens = 32;
    s.max_batch_requests = 16;
    s.max_line = 4096;
    s.max_queue = 4096;
    s.max_conn_queue = 64;
    s.max_conns = 1024;
    s.idle_timeout_s = 300;
    s.drain_timeout_s = 30;
    if (getenv("MLART_SERVE_TEST_REFUSE"))
        s.test_refuse = strtol(getenv("MLART_SERVE_TEST_REFUSE"), NULL, 10);

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        int ok = 1;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--no-graph")) {
            eo.no_graph = 1;
            continue;
        }
        if (!val) {
            fprintf(stderr, "mlart-serve-example: %s needs a value\n", a);
            usage(stderr);
            return 2;
        }
        i++;
        if (!strcmp(a, "--port"))
            ok = !parse_int(val, 0, 65535, &v) && ((port = (int)v), 1);
        else if (!strcmp(a, "--device"))
            ok = !strcmp(val, "auto") ? (eo.device = SERVE_DEVICE_AUTO, 1)
                 : !strcmp(val, "cpu") ? (eo.device = -1, 1)
                 : !strcmp(val, "cuda") ? (eo.device = 0, 1)
                                        : 0;
        else if (!strcmp(a, "--backend"))
            eo.backend = val;
        else if (!strcmp(a, "--config"))
            config = val;
        else if (!strcmp(a, "--heads"))
            ok = !parse_int(val, 1, 1024, &heads);
        else if (!strcmp(a, "--topk"))
            ok = !parse_int(val, 1, 65536, &topk);
        else if (!strcmp(a, "--kv-format"))
            kvfmt = val;
        else if (!strcmp(a, "--context"))
            ok = !parse_int(val, 1, 1 << 24, &v) && ((eo.context = (int32_t)v), 1);
        else if (!strcmp(a, "--max-request-tokens"))
            ok = !parse_int(val, 1, SERVE_MAX_TOKENS, &v) && ((s.lim.max_tokens = (int32_t)v), 1);
        else if (!strcmp(a, "--max-batch-tokens"))
            ok = !parse_int(val, 1, 1 << 16, &v) && ((s.max_batch_tokens = (int32_t)v), 1);
        else if (!strcmp(a, "--max-batch-requests"))
            ok = !parse_int(val, 1, 256, &v) && ((s.max_batch_requests = (int32_t)v), 1);
        else if (!strcmp(a, "--max-line"))
            ok = !parse_int(val, 64, 1 << 24, &v) && ((s.max_line = (size_t)v), 1);
        else if (!strcmp(a, "--max-queue"))
            ok = !parse_int(val, 1, 1 << 24, &v) && ((s.max_queue = (size_t)v), 1);
        else if (!strcmp(a, "--max-conn-queue"))
            ok = !parse_int(val, 1, 1 << 24, &v) && ((s.max_conn_queue = (int)v), 1);
        else if (!strcmp(a, "--max-conns"))
            ok = !parse_int(val, 1, 1 << 20, &v) && ((s.max_conns = (size_t)v), 1);
        else if (!strcmp(a, "--idle-timeout-s"))
            ok = !parse_int(val, 0, 86400, &s.idle_timeout_s);
        else if (!strcmp(a, "--drain-timeout"))
            ok = !parse_int(val, 0, 86400, &s.drain_timeout_s);
        else if (!strcmp(a, "--weights"))
            eo.weights = val;
        else if (!strcmp(a, "--layer"))
            ok = !parse_int(val, 0, 1 << 20, &v) && ((eo.layer = (int)v), 1);
        else if (!strcmp(a, "--seed"))
            ok = !parse_int(val, 0, 0x7fffffffL, &v) && ((eo.seed = (uint64_t)v), 1);
        else {
            fprintf(stderr, "mlart-serve-example: unknown option %s\n", a);
            usage(stderr);
            return 2;
        }
        if (!ok) {
            fprintf(stderr, "mlart-serve-example: bad value '%s' for %s\n", val, a);
            return 2;
        }
    }
    if (config) {
        mlart_config cfg;
        if ((rc = mlart_config_load(config, &cfg))) {
            fprintf(stderr, "mlart-serve-example: %s\n", mlart_last_error());
            return 1;
        }
        eo.geom = cfg.geom;
        memcpy(graph_sizes, cfg.graph_sizes, sizeof graph_sizes);
        eo.graph_sizes = graph_sizes;
        eo.num_graph_sizes = cfg.num_graph_sizes;
        if (!eo.backend && cfg.backend[0]) {
            snprintf(backend_buf, sizeof backend_buf, "%s", cfg.backend);
            eo.backend = backend_buf;
        }
    }
    if (heads > 0)
        eo.geom.heads = (int32_t)heads;
    if (topk > 0)
        eo.geom.topk = (int32_t)topk;
    if (kvfmt && mlart_kv_format_parse(kvfmt, &eo.geom.kv_format)) {
        fprintf(stderr, "mlart-serve-example: --kv-format %s: %s\n", kvfmt, mlart_last_error());
        return 2;
    }
    if (!(eo.geom.softmax_scale > 0.0f))
        eo.geom.softmax_scale = 1.0f / sqrtf((float)(eo.geom.qk_nope + eo.geom.rope));
    if (s.lim.max_tokens > s.max_batch_tokens) {
        fprintf(stderr, "mlart-serve-example: --max-request-tokens %d exceeds "
                        "--max-batch-tokens %d\n",
                s.lim.max_tokens, s.max_batch_tokens);
        return 2;
    }
    s.lim.context = eo.context;
    eo.max_batch_tokens = s.max_batch_tokens;
    eo.max_batch_requests = s.max_batch_requests;

    /* a client that vanishes mid-reply must cost an error code, not the process */
    signal(SIGPIPE, SIG_IGN);
    if (start_signal)
        return start_stopped();
    rc = serve_engine_create(&eo, &s.eng, err, sizeof err);
    if (rc) {
        fprintf(stderr, "mlart-serve-example: %s: %s\n", mlart_status_name(rc), err);
        return 1;
    }
    if (start_signal) {
        serve_engine_destroy(s.eng);
        return start_stopped();
    }
    fd_room(s.max_conns);
    s.batch = calloc((size_t)s.max_batch_requests, sizeof *s.batch);
    s.loop = uv_default_loop();
    if (!s.batch || !s.loop) {
        fprintf(stderr, "mlart-serve-example: %s\n",
                s.batch ? "cannot create the event loop" : "out of memory");
        serve_engine_destroy(s.eng);
        free(s.batch);
        return 1;
    }
    uv_ip4_addr("127.0.0.1", port, &addr);
    if ((rc = uv_tcp_init(s.loop, &s.listener)) < 0) {
        fprintf(stderr, "mlart-serve-example: cannot create a socket: %s\n", uv_strerror(rc));
        serve_engine_destroy(s.eng);
        free(s.batch);
        return 1;
    }
    s.listener.data = &s;
    if ((rc = uv_tcp_bind(&s.listener, (const struct sockaddr *)&addr, 0)) < 0 ||
        (rc = uv_listen((uv_stream_t *)&s.listener, 511, on_connection)) < 0 ||
        (rc = uv_tcp_getsockname(&s.listener, (struct sockaddr *)&bound, &namelen)) < 0) {
        fprintf(stderr, "mlart-serve-example: cannot listen on 127.0.0.1:%d: %s\n", port,
                uv_strerror(rc));
        serve_engine_destroy(s.eng);
        free(s.batch);
        return 1;
    }
    uv_timer_init(s.loop, &s.drain); /* cannot fail */
    s.drain.data = &s;
    uv_timer_init(s.loop, &s.idle);
    s.idle.data = &s;
    if (s.idle_timeout_s > 0) {
        const uint64_t ms = (uint64_t)s.idle_timeout_s * 1000 / 4;
        uv_timer_start(&s.idle, on_idle_sweep, ms < 1000 ? ms : 1000, ms < 1000 ? ms : 1000);
        uv_unref((uv_handle_t *)&s.idle); /* the connections hold the loop, not the sweep */
    }
    for (int i = 0; i < 2; i++) {
        /* neither fails on a working loop; if one did, the server could
         * not drain on a signal, so it would rather not start */
        rc = uv_signal_init(s.loop, &s.sig[i]);
        s.sig[i].data = &s;
        if (rc == 0)
            rc = uv_signal_start(&s.sig[i], on_signal, i ? SIGTERM : SIGINT);
        if (rc < 0) {
            fprintf(stderr, "mlart-serve-example: cannot watch %s: %s\n", i ? "SIGTERM" : "SIGINT",
                    uv_strerror(rc));
            serve_engine_destroy(s.eng);
            free(s.batch);
            return 1;
        }
    }
    if (start_signal) {
        /* it came after the check above, before libuv took the signals
         * over: the same drain as after it, with nothing to answer */
        on_signal(&s.sig[start_signal == SIGTERM], start_signal);
    } else {
        printf("mlart-serve-example listening on 127.0.0.1:%d (%s)\n",
               ntohs(((struct sockaddr_in *)&bound)->sin_port), serve_engine_describe(s.eng));
        fflush(stdout);
    }

    uv_run(s.loop, UV_RUN_DEFAULT);
    uv_close((uv_handle_t *)&s.drain, NULL); /* the drain ended before it, or it fired */
    uv_close((uv_handle_t *)&s.idle, NULL);
    uv_run(s.loop, UV_RUN_DEFAULT);

    fprintf(stderr,
            "mlart-serve-example: %llu requests answered, %llu error replies, %llu steps "
            "(mean %.2f tokens, %.2f requests, %.0f us per step)\n",
            (unsigned long long)s.served, (unsigned long long)s.errors,
            (unsigned long long)s.steps, s.steps ? (double)s.step_tokens / (double)s.steps : 0.0,
            s.steps ? (double)s.step_requests / (double)s.steps : 0.0,
            s.steps ? (double)s.step_ns / 1e3 / (double)s.steps : 0.0);
    if (s.drain_timed_out)
        fprintf(stderr,
                "mlart-serve-example: drain cut at %ld s: %llu connection(s) closed, %llu queued "
                "request(s) dropped, %llu reply/replies written but not sent\n",
                s.drain_timeout_s, (unsigned long long)s.drain_closed,
                (unsigned long long)s.drain_dropped, (unsigned long long)s.drain_unsent);
    rc = uv_loop_close(s.loop);
    serve_engine_destroy(s.eng);
    free(s.batch);
    return rc == 0 && !s.drain_timed_out ? 0 : 1;
}
