/* The TCP rendezvous that hands rank 0's blob to the other ranks, on libuv,
 * and the NCCL communicator joined through it (include/mlart/rendezvous.h).
 * A static library of its own: Debian's libuv archive is not
 * position-independent, so it cannot go into libmlart.so. */
#define _POSIX_C_SOURCE 200809L
#include "mlart/rendezvous.h"

#include "runtime/status.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <uv.h>

/* ---- rendezvous ---------------------------------------------------------- */

/* The messages, every field little-endian:
 *   hello   peer -> rank 0, 24 bytes: magic, version, rank, group size (u32
 *           each), the blob size the peer expects (u64); the first 16
 *           bytes are those of every version's hello (version 2's whole)
 *   answer  rank 0 -> peer, 28 bytes: magic, status (u32), rank 0's blob
 *           size (u64; RDV_BAD_VERSION: rank 0's version), and with
 *           RDV_ABORTED the rank whose blob size differs (u32) and that
 *           size (u64), else zeros; then the blob when the status is RDV_OK
 *   ack     peer -> rank 0, 16 bytes: magic, RDV_ACK (u32 each), the
 *           FNV-1a 64 of the blob as the peer received it (u64)
 * Versions: 2: a peer acknowledges the blob, and rank 0 counts it served
 * only then; 3: the hello carries the peer's blob size, so that rank 0
 * sees a size that differs from its own, refuses that peer and then every
 * other (RDV_ABORTED, naming the rank and its size) instead of waiting out
 * its deadline; rank 0 answers a peer of another version (RDV_BAD_VERSION)
 * rather than closing on it; the acknowledgement carries the checksum of
 * the blob received, and rank 0 counts only one whose checksum is its
 * blob's, so an acknowledgement sent without reading the blob counts for
 * nothing.  The checksum is no authentication: it catches a peer that
 * acknowledges what it did not read (a bug), not one that lies. */
#define RDV_MAGIC 0x4d4c5254u /* 'MLRT' */
#define RDV_VERSION 3u
#define RDV_ACK 0x41434b21u /* 'ACK!', after RDV_MAGIC in a peer's acknowledgement */
#define RDV_HELLO_COMMON 16 /* magic, version, rank, size: read before the rest */
#define RDV_HELLO 24
#define RDV_HEAD 28
#define RDV_ACK_BYTES 16
#define RDV_MAX_BYTES ((size_t)1 << 20)
#define RDV_RETRY_MS 50

enum {
    RDV_OK,
    RDV_SIZE_MISMATCH,
    RDV_DUPLICATE,
    RDV_BAD_RANK,
    RDV_BUSY,
    RDV_BLOB_MISMATCH, /* this peer's blob size differs from rank 0's */
    RDV_ABORTED,       /* another peer's did: rank 0 serves nobody any more */
    RDV_BAD_VERSION
};

/* Rank 0's view of each rank: pending from an admitted hello until the
 * acknowledgement (then served) or the end of that connection (then free);
 * told once it has been answered RDV_BLOB_MISMATCH or RDV_ABORTED. */
enum { RANK_FREE, RANK_PENDING, RANK_SERVED, RANK_TOLD };

static const char *refusal(uint32_t status)
{
    switch (status) {
    case RDV_SIZE_MISMATCH:
        return "its group size differs from rank 0's";
    case RDV_DUPLICATE:
        return "another peer already joined with that rank (or it is rank 0, the server's own)";
    case RDV_BAD_RANK:
        return "the rank is outside the group";
    case RDV_BUSY:
        return "another connection holds that rank and has not acknowledged yet";
    case RDV_BLOB_MISMATCH:
        return "its blob size differs from rank 0's";
    case RDV_ABORTED:
        return "rank 0 gave up on the group: a rank's blob size differs from rank 0's";
    case RDV_BAD_VERSION:
        return "it speaks another rendezvous version than rank 0";
    }
    return "unknown refusal";
}

static void put_u32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static void put_u64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static uint32_t get_u32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t get_u64(const unsigned char *p)
{
    return (uint64_t)get_u32(p) | (uint64_t)get_u32(p + 4) << 32;
}

/* FNV-1a 64 of n bytes: one pass over a blob of at most 1 MiB, and enough
 * to tell the blob from bytes that were never read into the buffer. */
static uint64_t blob_sum(const unsigned char *p, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

typedef struct rdv rdv;

/* One accepted connection on rank 0. */
typedef struct peer {
    uv_tcp_t tcp; /* data: this peer */
    uv_write_t w;
    struct peer *next;
    unsigned char in[RDV_HELLO], out[RDV_HEAD], ack[RDV_ACK_BYTES];
    size_t got, want, ack_got; /* want: the hello's common part, then all of it */
    int rank; /* >= 1 once admitted, that is while its rank is pending on it */
    int told; /* answered RDV_BLOB_MISMATCH or RDV_ABORTED: the rank it said */
    char name[64];
} peer;

struct rdv {
    uv_loop_t loop; /* data: this rdv */
    uv_timer_t deadline, retry;
    uv_tcp_t tcp; /* the listener on rank 0, the connection elsewhere */
    uv_connect_t conn;
    uv_write_t w, ack_w;
    const char *addr;
    struct sockaddr_in sa;
    int port, rank, size, timeout_ms;
    unsigned char *blob;
    size_t bytes;
    int done, rc;
    /* rank 0 */
    peer *peers;
    unsigned char *state; /* RANK_* per rank */
    int served, told;
    uint64_t sum;         /* blob_sum of the blob, which an acknowledgement must carry */
    int bad_rank;         /* the first rank whose blob size differs (0: none yet) */
    uint64_t bad_bytes;   /* and that size */
    /* ranks 1.. */
    unsigned char hello[RDV_HELLO], head[RDV_HEAD], ack[RDV_ACK_BYTES];
    size_t got;
    int connected, attempts, busy, last_err, self_connects;
};

static void on_close(uv_handle_t *h)
{
    peer *p = h->data, **pp;
    if (!p)
        return;
    for (pp = &((rdv *)h->loop->data)->peers; *pp; pp = &(*pp)->next)
        if (*pp == p) {
            *pp = p->next;
            break;
        }
    free(p);
}

static void close_one(uv_handle_t *h, void *arg)
{
    (void)arg;
    if (!uv_is_closing(h))
        uv_close(h, on_close);
}

/* Record the outcome (the first one wins) and close every handle. */
static void finish(rdv *r, int rc)
{
    if (r->done)
        return;
    r->done = 1;
    r->rc = rc;
    uv_walk(&r->loop, close_one, NULL);
}

/* The peer ranks neither served nor told (only the pending ones if
 * `pending`), as "2, 5, 7" into buf, cut with ", ..." when it is full;
 * returns how many. */
static int list_ranks(const rdv *r, int pending, char *buf, size_t cap)
{
    size_t n = 0;
    int count = 0, cut = 0;
    buf[0] = 0;
    for (int i = 1; i < r->size; i++) {
        if (r->state[i] == RANK_SERVED || r->state[i] == RANK_TOLD ||
            (pending && r->state[i] != RANK_PENDING))
            continue;
        count++;
        if (n + 24 < cap) /* room for ", " + 10 digits, then for ", ..." */
            n += (size_t)snprintf(buf + n, cap - n, "%s%d", n ? ", " : "", i);
        else if (!cut++)
            n += (size_t)snprintf(buf + n, cap - n, ", ...");
    }
    return count;
}

/* Rank 0's error once a peer's blob size differed: the rank, its size and
 * rank 0's; with `deadline`, also the ranks it could not tell in time. */
static int gave_up(const rdv *r, int deadline)
{
    char untold[256], tail[320] = "";
    if (deadline && list_ranks(r, 0, untold, sizeof untold))
        snprintf(tail, sizeof tail, "; neither served nor told within %d ms: ranks %s",
                 r->timeout_ms, untold);
    return mlart_set_error(MLART_ECOMM,
                           "rendezvous on %s:%d: rank %d expects a blob of %llu bytes, rank 0 "
                           "hands out %zu (every rank must pass the same size: one build and "
                           "config on all); rank 0 gave up: %d of %d peers served, %d told "
                           "why%s", r->addr, r->port, r->bad_rank,
                           (unsigned long long)r->bad_bytes, r->bytes, r->served, r->size - 1,
                           r->told, tail);
}

/* Rank 0 is done once every peer is served, or, after a blob size that
 * differed, once every peer is served or told. */
static void maybe_done(rdv *r)
{
    if (r->served + r->told < r->size - 1)
        return;
    finish(r, r->bad_rank ? gave_up(r, 0) : 0);
}

static void on_deadline(uv_timer_t *t)
{
    rdv *r = t->loop->data;
    int rc;
    if (r->rank == 0 && r->bad_rank) {
        rc = gave_up(r, 1);
    } else if (r->rank == 0) {
        char missing[256], pending[256];
        list_ranks(r, 0, missing, sizeof missing);
        rc = mlart_set_error(MLART_ETIMEDOUT,
                             "rendezvous on %s:%d: rank 0 gave up after %d ms with %d of %d "
                             "peers served (missing ranks: %s%s%s)",
                             r->addr, r->port, r->timeout_ms, r->served, r->size - 1, missing,
                             list_ranks(r, 1, pending, sizeof pending) ?
                             "; admitted, blob not acknowledged: " : "", pending);
    } else if (!r->connected && r->busy && !r->last_err) {
        rc = mlart_set_error(MLART_ETIMEDOUT,
                             "rendezvous: rank 0 at %s:%d answered rank %d busy %d times within "
                             "%d ms: %s", r->addr, r->port, r->rank, r->busy, r->timeout_ms,
                             refusal(RDV_BUSY));
    } else if (!r->connected) {
        char also[96] = "";
        if (r->busy)
            snprintf(also, sizeof also, "; rank 0 answered busy %d times before", r->busy);
        if (r->self_connects)
            snprintf(also + strlen(also), sizeof also - strlen(also),
                     "; %d connects met themselves", r->self_connects);
        rc = mlart_set_error(MLART_ETIMEDOUT,
                             "rendezvous: rank %d could not reach rank 0 at %s:%d within %d ms "
                             "(%d attempts, last: %s%s)",
                             r->rank, r->addr, r->port, r->timeout_ms, r->attempts,
                             r->last_err ? uv_strerror(r->last_err) : "no answer", also);
    } else if (r->got == sizeof r->head + r->bytes) {
        rc = mlart_set_error(MLART_ETIMEDOUT,
                             "rendezvous: rank %d got the blob from rank 0 at %s:%d but could "
                             "not send its acknowledgement within %d ms",
                             r->rank, r->addr, r->port, r->timeout_ms);
    } else {
        size_t want = sizeof r->head + r->bytes;
        rc = mlart_set_error(MLART_ETIMEDOUT,
                             "rendezvous: rank %d connected to rank 0 at %s:%d but got only %zu "
                             "of %zu bytes within %d ms",
                             r->rank, r->addr, r->port, r->got, want, r->timeout_ms);
    }
    finish(r, rc);
}

/* ---- rank 0: serve each rank once, counted when its peer acknowledges ---- */

static void peer_close(peer *p)
{
    if (!uv_is_closing((uv_handle_t *)&p->tcp))
        uv_close((uv_handle_t *)&p->tcp, on_close);
}

/* The admitted peer went away (or misbehaved) before acknowledging: it may
 * have been a process that crashed, restarted or gave up, so its rank must
 * not stay taken; the real one is still to come. */
static void peer_drop(rdv *r, peer *p, const char *what, const char *detail)
{
    mlart_log(MLART_LOG_WARN, "rendezvous on %s:%d: %s did not acknowledge rank %d: %s (%s); "
              "the rank is free for another connection", r->addr, r->port, p->name, p->rank,
              what, detail);
    r->state[p->rank] = RANK_FREE;
    p->rank = 0;
    peer_close(p);
}

static void on_ack_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf)
{
    peer *p = h->data;
    (void)hint;
    *buf = uv_buf_init((char *)p->ack + p->ack_got, (unsigned)(sizeof p->ack - p->ack_got));
}

static void on_ack_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf)
{
    peer *p = s->data;
    rdv *r = s->loop->data;
    uint32_t magic, word;
    uint64_t sum;
    (void)buf;
    if (n == 0)
        return;
    if (n < 0) {
        peer_drop(r, p, "the connection ended first",
                  n == UV_EOF ? "closed by the peer" : uv_strerror((int)n));
        return;
    }
    p->ack_got += (size_t)n;
    if (p->ack_got < sizeof p->ack)
        return;
    uv_read_stop(s);
    magic = get_u32(p->ack);
    word = get_u32(p->ack + 4);
    sum = get_u64(p->ack + 8);
    if (magic != RDV_MAGIC || word != RDV_ACK) {
        char detail[64];
        snprintf(detail, sizeof detail, "0x%08x 0x%08x, want 0x%08x 0x%08x", magic, word,
                 RDV_MAGIC, RDV_ACK);
        peer_drop(r, p, "malformed acknowledgement", detail);
        return;
    }
    if (sum != r->sum) {
        char detail[64];
        snprintf(detail, sizeof detail, "0x%016llx, want 0x%016llx", (unsigned long long)sum,
                 (unsigned long long)r->sum);
        peer_drop(r, p, "its acknowledgement's checksum is not that of the blob sent", detail);
        return;
    }
    mlart_log(MLART_LOG_DEBUG, "rendezvous on %s:%d: served rank %d (%s)", r->addr, r->port,
              p->rank, p->name);
    r->state[p->rank] = RANK_SERVED;
    r->served++;
    peer_close(p);
    maybe_done(r);
}

static void on_peer_written(uv_write_t *w, int status)
{
    peer *p = w->data;
    rdv *r = w->handle->loop->data;
    int rc;
    if (status == UV_ECANCELED)
        return;
    if (p->rank == 0) { /* a refusal: the answer is all it gets */
        peer_close(p);
        if (status == 0 && p->told && r->state[p->told] == RANK_FREE) {
            r->state[p->told] = RANK_TOLD;
            r->told++;
            maybe_done(r);
        }
        return;
    }
    /* in the socket buffer is not in the peer: wait for it to say so */
    if (status < 0)
        peer_drop(r, p, "sending the blob failed", uv_strerror(status));
    else if ((rc = uv_read_start((uv_stream_t *)&p->tcp, on_ack_alloc, on_ack_read)) < 0)
        peer_drop(r, p, "cannot read from it", uv_strerror(rc));
}

/* RDV_OK (and the rank now pending on p) or why the hello is refused.  A
 * rank of the group whose blob size differs is no stray to ignore: the
 * launch is inconsistent, so rank 0 refuses it, then refuses every later
 * peer too (RDV_ABORTED, naming it), and returns its error once every peer
 * is served or told. */
static uint32_t admit(rdv *r, peer *p, uint32_t rank, uint32_t size, uint64_t bytes)
{
    uint32_t status = RDV_OK;
    if (size != (uint32_t)r->size)
        status = RDV_SIZE_MISMATCH;
    else if (rank >= size)
        status = RDV_BAD_RANK;
    else if (rank == 0 || r->state[rank] == RANK_SERVED)
        status = RDV_DUPLICATE;
    else if (bytes != (uint64_t)r->bytes)
        status = RDV_BLOB_MISMATCH;
    else if (r->bad_rank)
        status = RDV_ABORTED;
    else if (r->state[rank] == RANK_PENDING)
        status = RDV_BUSY;
    if (status == RDV_BLOB_MISMATCH || status == RDV_ABORTED)
        p->told = (int)rank;
    if (status == RDV_BLOB_MISMATCH && !r->bad_rank) {
        r->bad_rank = (int)rank;
        r->bad_bytes = bytes;
        mlart_log(MLART_LOG_WARN, "rendezvous on %s:%d: %s says rank %u expects a blob of %llu "
                  "bytes, rank 0 hands out %zu: rank 0 serves no other peer and tells each "
                  "so", r->addr, r->port, p->name, rank, (unsigned long long)bytes, r->bytes);
    } else if (status == RDV_ABORTED) {
        mlart_log(MLART_LOG_DEBUG, "rendezvous on %s:%d: told %s (rank %u) that rank %d's blob "
                  "size differs", r->addr, r->port, p->name, rank, r->bad_rank);
    } else if (status == RDV_BUSY) {
        /* not an error: the holder may yet leave, and this peer comes again */
        mlart_log(MLART_LOG_DEBUG, "rendezvous on %s:%d: %s says rank %u, pending on another "
                  "connection; told it to retry", r->addr, r->port, p->name, rank);
    } else if (status != RDV_OK) {
        mlart_log(MLART_LOG_WARN, "rendezvous on %s:%d: refused %s saying rank %u of %u "
                  "(group of %d), blob of %llu bytes: %s", r->addr, r->port, p->name, rank,
                  size, r->size, (unsigned long long)bytes, refusal(status));
    } else {
        p->rank = (int)rank;
        r->state[rank] = RANK_PENDING;
    }
    return status;
}

static void on_peer_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf)
{
    peer *p = h->data;
    (void)hint;
    *buf = uv_buf_init((char *)p->in + p->got, (unsigned)(p->want - p->got));
}

/* Answer a hello: the head (with rank 0's blob size, and after a blob size
 * that differed the rank that had it), then the blob if admitted. */
static void answer(rdv *r, peer *p, uint32_t status)
{
    uv_buf_t out[2];
    int rc;
    memset(p->out, 0, sizeof p->out);
    put_u32(p->out, RDV_MAGIC);
    put_u32(p->out + 4, status);
    put_u64(p->out + 8, status == RDV_BAD_VERSION ? RDV_VERSION : (uint64_t)r->bytes);
    if (status == RDV_ABORTED) {
        put_u32(p->out + 16, (uint32_t)r->bad_rank);
        put_u64(p->out + 20, r->bad_bytes);
    }
    out[0] = uv_buf_init((char *)p->out, sizeof p->out);
    out[1] = uv_buf_init((char *)r->blob, (unsigned)r->bytes);
    p->w.data = p;
    rc = uv_write(&p->w, (uv_stream_t *)&p->tcp, out, status == RDV_OK && r->bytes ? 2 : 1,
                  on_peer_written);
    if (rc < 0 && p->rank > 0)
        peer_drop(r, p, "sending the blob failed", uv_strerror(rc));
    else if (rc < 0)
        peer_close(p);
}

static void on_peer_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf)
{
    peer *p = s->data;
    rdv *r = s->loop->data;
    uint32_t magic, version;
    (void)buf;
    if (n == 0)
        return;
    if (n < 0) {
        mlart_log(MLART_LOG_WARN, "rendezvous on %s:%d: %s left after %zu of %d bytes: %s",
                  r->addr, r->port, p->name, p->got, RDV_HELLO, uv_strerror((int)n));
        peer_close(p);
        return;
    }
    p->got += (size_t)n;
    if (p->got < p->want)
        return;
    if (p->want == RDV_HELLO) {
        uv_read_stop(s);
        answer(r, p, admit(r, p, get_u32(p->in + 8), get_u32(p->in + 12), get_u64(p->in + 16)));
        return;
    }
    /* the part every version's hello has: is the rest of this version's? */
    magic = get_u32(p->in);
    version = get_u32(p->in + 4);
    if (magic != RDV_MAGIC) {
        mlart_log(MLART_LOG_WARN, "rendezvous on %s:%d: %s is not an mlart rank (magic 0x%08x; "
                  "want 0x%08x)", r->addr, r->port, p->name, magic, RDV_MAGIC);
        peer_close(p);
        return;
    }
    if (version != RDV_VERSION) {
        /* answered, not just closed on: every version reads the status at
         * the same place (version 2 calls this one an unknown refusal), and
         * from 3 on the count after it, here this rank 0's version */
        mlart_log(MLART_LOG_WARN, "rendezvous on %s:%d: %s speaks rendezvous version %u, this "
                  "rank 0 version %u: run one build of mlart on every rank", r->addr, r->port,
                  p->name, version, RDV_VERSION);
        uv_read_stop(s);
        answer(r, p, RDV_BAD_VERSION);
        return;
    }
    p->want = RDV_HELLO;
}

static void on_connection(uv_stream_t *l, int status)
{
    rdv *r = l->loop->data;
    struct sockaddr_storage ss;
    int len = sizeof ss;
    peer *p;
    if (status < 0) {
        mlart_log(MLART_LOG_WARN, "rendezvous on %s:%d: accept failed: %s", r->addr, r->port,
                  uv_strerror(status));
        return;
    }
    p = calloc(1, sizeof *p);
    if (!p) {
        finish(r, mlart_set_error(MLART_ENOMEM, "rendezvous on %s:%d: out of memory", r->addr,
                                  r->port));
        return;
    }
    uv_tcp_init(&r->loop, &p->tcp);
    p->tcp.data = p;
    p->next = r->peers;
    r->peers = p;
    snprintf(p->name, sizeof p->name, "a peer");
    p->want = RDV_HELLO_COMMON;
    if (uv_accept(l, (uv_stream_t *)&p->tcp) < 0) {
        peer_close(p);
        return;
    }
    if (uv_tcp_getpeername(&p->tcp, (struct sockaddr *)&ss, &len) == 0 &&
        ss.ss_family == AF_INET) {
        char ip[INET_ADDRSTRLEN] = "?";
        const struct sockaddr_in *in = (const struct sockaddr_in *)&ss;
        uv_ip4_name(in, ip, sizeof ip);
        snprintf(p->name, sizeof p->name, "peer %s:%d", ip, ntohs(in->sin_port));
    }
    uv_tcp_nodelay(&p->tcp, 1);
    if (uv_read_start((uv_stream_t *)&p->tcp, on_peer_alloc, on_peer_read) < 0)
        peer_close(p);
}

static int serve(rdv *r)
{
    int rc;
    r->state = calloc((size_t)r->size, 1);
    if (!r->state)
        return mlart_set_error(MLART_ENOMEM, "rendezvous: out of memory");
    r->sum = blob_sum(r->blob, r->bytes);
    uv_tcp_init(&r->loop, &r->tcp);
    if ((rc = uv_tcp_bind(&r->tcp, (const struct sockaddr *)&r->sa, 0)) < 0 ||
        (rc = uv_listen((uv_stream_t *)&r->tcp, 128, on_connection)) < 0)
        return mlart_set_error(MLART_ECOMM, "rendezvous: rank 0 cannot listen on %s:%d: %s (%s)",
                               r->addr, r->port, uv_strerror(rc), uv_err_name(rc));
    mlart_log(MLART_LOG_DEBUG, "rendezvous: rank 0 listening on %s:%d for %d peers", r->addr,
              r->port, r->size - 1);
    return 0;
}

/* ---- ranks 1..: connect, say who we are, read the blob, acknowledge ---- */

static void try_connect(rdv *r);

static void on_retry(uv_timer_t *t)
{
    try_connect(t->loop->data);
}

static void on_conn_closed(uv_handle_t *h)
{
    rdv *r = h->loop->data;
    if (!r->done)
        uv_timer_start(&r->retry, on_retry, RDV_RETRY_MS, 0);
}

/* Rank 0 holds our rank for another connection that has not acknowledged
 * (a process before us that may yet leave): start over, as when rank 0 is
 * not listening yet. */
static void retry_busy(rdv *r)
{
    r->busy++;
    r->last_err = 0; /* the last answer was rank 0's, not a failed connect */
    r->connected = 0;
    r->got = 0;
    mlart_log(MLART_LOG_DEBUG, "rendezvous: rank 0 at %s:%d has rank %d pending on another "
              "connection; rank %d retries in %d ms", r->addr, r->port, r->rank, r->rank,
              RDV_RETRY_MS);
    uv_close((uv_handle_t *)&r->tcp, on_conn_closed);
}

static int unacknowledged(rdv *r, int err)
{
    return mlart_set_error(MLART_ECOMM, "rendezvous: rank %d got the blob from rank 0 at %s:%d "
                           "but could not acknowledge it: %s (rank 0 counts rank %d as not "
                           "come)", r->rank, r->addr, r->port, uv_strerror(err), r->rank);
}

static void on_ack_written(uv_write_t *w, int status)
{
    rdv *r = w->handle->loop->data;
    if (status == UV_ECANCELED)
        return;
    finish(r, status < 0 ? unacknowledged(r, status) : 0);
}

/* Only an acknowledged blob counts on rank 0, so finishing (which closes
 * the connection and cancels pending writes) waits for this write. */
static void acknowledge(rdv *r)
{
    uv_buf_t b = uv_buf_init((char *)r->ack, sizeof r->ack);
    int rc;
    uv_read_stop((uv_stream_t *)&r->tcp);
    put_u32(r->ack, RDV_MAGIC);
    put_u32(r->ack + 4, RDV_ACK);
    put_u64(r->ack + 8, blob_sum(r->blob, r->bytes));
    if ((rc = uv_write(&r->ack_w, (uv_stream_t *)&r->tcp, &b, 1, on_ack_written)) < 0)
        finish(r, unacknowledged(r, rc));
}

static int broken(rdv *r, const char *what)
{
    return mlart_set_error(MLART_ECOMM,
                           "rendezvous: rank %d lost rank 0 at %s:%d after %zu of %zu bytes: %s",
                           r->rank, r->addr, r->port, r->got, sizeof r->head + r->bytes, what);
}

static void on_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf)
{
    rdv *r = h->loop->data;
    (void)hint;
    if (r->got < sizeof r->head)
        *buf = uv_buf_init((char *)r->head + r->got, (unsigned)(sizeof r->head - r->got));
    else
        *buf = uv_buf_init((char *)r->blob + (r->got - sizeof r->head),
                           (unsigned)(sizeof r->head + r->bytes - r->got));
}

static void on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf)
{
    rdv *r = s->loop->data;
    (void)buf;
    if (n == 0)
        return;
    if (n < 0) {
        char what[192];
        snprintf(what, sizeof what, "%s%s", n == UV_EOF ? "connection closed" : uv_strerror((int)n),
                 r->got ? "" : " before any answer (a rank 0 of rendezvous version 2 closes so "
                               "on a peer of a later version)");
        finish(r, broken(r, what));
        return;
    }
    if (r->got < sizeof r->head && r->got + (size_t)n >= sizeof r->head) {
        uint32_t magic = get_u32(r->head), status = get_u32(r->head + 4);
        uint64_t count = get_u64(r->head + 8);
        if (magic != RDV_MAGIC) {
            finish(r, mlart_set_error(MLART_ECOMM, "rendezvous: %s:%d answered rank %d with "
                                      "magic 0x%08x: not an mlart rank 0", r->addr, r->port,
                                      r->rank, magic));
            return;
        }
        if (status == RDV_BUSY) {
            retry_busy(r);
            return;
        }
        if (status == RDV_BLOB_MISMATCH) {
            finish(r, mlart_set_error(MLART_ECOMM, "rendezvous: rank 0 at %s:%d hands out a "
                                      "blob of %llu bytes, rank %d expects %zu (every rank must "
                                      "pass the same size: one build and config on all)",
                                      r->addr, r->port, (unsigned long long)count, r->rank,
                                      r->bytes));
            return;
        }
        if (status == RDV_ABORTED) {
            finish(r, mlart_set_error(MLART_ECOMM, "rendezvous: rank 0 at %s:%d gave up before "
                                      "serving rank %d: rank %u expects a blob of %llu bytes, "
                                      "rank 0 hands out %llu (every rank must pass the same "
                                      "size: one build and config on all)", r->addr, r->port,
                                      r->rank, get_u32(r->head + 16),
                                      (unsigned long long)get_u64(r->head + 20),
                                      (unsigned long long)count));
            return;
        }
        if (status == RDV_BAD_VERSION) {
            finish(r, mlart_set_error(MLART_ECOMM, "rendezvous: rank 0 at %s:%d speaks "
                                      "rendezvous version %llu, rank %d version %u: run one "
                                      "build of mlart on every rank", r->addr, r->port,
                                      (unsigned long long)count, r->rank, RDV_VERSION));
            return;
        }
        if (status != RDV_OK) {
            finish(r, mlart_set_error(MLART_ECOMM, "rendezvous: rank 0 at %s:%d refused rank %d "
                                      "of a group of %d (status %u): %s", r->addr, r->port,
                                      r->rank, r->size, status, refusal(status)));
            return;
        }
        if (count != r->bytes) {
            finish(r, mlart_set_error(MLART_ECOMM, "rendezvous: rank 0 at %s:%d sends %llu "
                                      "bytes, rank %d expects %zu", r->addr, r->port,
                                      (unsigned long long)count, r->rank, r->bytes));
            return;
        }
    }
    r->got += (size_t)n;
    if (r->got == sizeof r->head + r->bytes)
        acknowledge(r);
}

/* Whether the connection's two ends are one address: while nothing listens
 * on a port of the local ephemeral range, a connect to it from the same
 * host may be given that port as its own and meet itself (TCP's
 * simultaneous open); it would then read its own hello as rank 0's answer. */
static int connected_to_self(uv_tcp_t *t)
{
    struct sockaddr_in me, them;
    int ml = (int)sizeof me, tl = (int)sizeof them;
    if (uv_tcp_getsockname(t, (struct sockaddr *)&me, &ml) < 0 ||
        uv_tcp_getpeername(t, (struct sockaddr *)&them, &tl) < 0)
        return 0;
    return me.sin_family == AF_INET && them.sin_family == AF_INET &&
           me.sin_port == them.sin_port && me.sin_addr.s_addr == them.sin_addr.s_addr;
}

static void on_connect(uv_connect_t *c, int status)
{
    rdv *r = c->handle->loop->data;
    uv_buf_t b;
    int rc;
    if (status == UV_ECANCELED || r->done)
        return;
    if (status == 0 && connected_to_self(&r->tcp)) {
        /* not rank 0: count it as refused, and try again */
        r->self_connects++;
        status = UV_ECONNREFUSED;
    }
    if (status < 0) {
        r->last_err = status;
        uv_close((uv_handle_t *)&r->tcp, on_conn_closed);
        return;
    }
    r->connected = 1;
    uv_tcp_nodelay(&r->tcp, 1);
    b = uv_buf_init((char *)r->hello, sizeof r->hello);
    if ((rc = uv_write(&r->w, (uv_stream_t *)&r->tcp, &b, 1, NULL)) < 0 ||
        (rc = uv_read_start((uv_stream_t *)&r->tcp, on_alloc, on_read)) < 0)
        finish(r, broken(r, uv_strerror(rc)));
}

static void try_connect(rdv *r)
{
    int rc;
    uv_os_fd_t fd;
    r->attempts++;
    /* SO_REUSEADDR on the connecting socket too: a connect that met itself
     * leaves its port (rank 0's) in TIME_WAIT, which would keep rank 0 from
     * listening there for a minute unless both sockets allow the reuse */
    rc = uv_tcp_init_ex(&r->loop, &r->tcp, AF_INET);
    if (rc < 0) {
        r->last_err = rc;
        uv_tcp_init(&r->loop, &r->tcp);
        uv_close((uv_handle_t *)&r->tcp, on_conn_closed);
        return;
    }
    if (uv_fileno((uv_handle_t *)&r->tcp, &fd) == 0) {
        int on = 1;
        (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    }
    rc = uv_tcp_connect(&r->conn, &r->tcp, (const struct sockaddr *)&r->sa, on_connect);
    if (rc < 0) {
        r->last_err = rc;
        uv_close((uv_handle_t *)&r->tcp, on_conn_closed);
    }
}

static int run(rdv *r)
{
    int rc = 0;
    uv_timer_init(&r->loop, &r->deadline);
    uv_timer_init(&r->loop, &r->retry);
    uv_timer_start(&r->deadline, on_deadline, (uint64_t)r->timeout_ms, 0);
    if (r->rank == 0) {
        rc = serve(r);
    } else {
        put_u32(r->hello, RDV_MAGIC);
        put_u32(r->hello + 4, RDV_VERSION);
        put_u32(r->hello + 8, (uint32_t)r->rank);
        put_u32(r->hello + 12, (uint32_t)r->size);
        put_u64(r->hello + 16, (uint64_t)r->bytes);
        try_connect(r);
    }
    if (rc < 0)
        finish(r, rc);
    uv_run(&r->loop, UV_RUN_DEFAULT);
    /* every handle is closed by now; this only guards uv_loop_close */
    uv_walk(&r->loop, close_one, NULL);
    uv_run(&r->loop, UV_RUN_DEFAULT);
    return r->rc;
}

int mlart_rendezvous(const char *addr, int port, int rank, int size, void *blob, size_t bytes,
                     int timeout_ms)
{
    rdv r;
    sigset_t pipe_set, old_mask, pending;
    int rc;
    if (!addr)
        return mlart_set_error(MLART_EINVAL, "mlart_rendezvous: NULL address");
    if (port < 1 || port > 65535)
        return mlart_set_error(MLART_EINVAL, "mlart_rendezvous: port %d (want 1..65535)", port);
    if (size < 1 || size > MLART_RENDEZVOUS_MAX_RANKS || rank < 0 || rank >= size)
        return mlart_set_error(MLART_EINVAL, "mlart_rendezvous: rank %d of %d (want 0 <= rank "
                               "< size <= %d)", rank, size, MLART_RENDEZVOUS_MAX_RANKS);
    if (bytes > RDV_MAX_BYTES || (!blob && bytes))
        return mlart_set_error(MLART_EINVAL, "mlart_rendezvous: %zu bytes at %p (want a blob of "
                               "at most %zu bytes)", bytes, blob, RDV_MAX_BYTES);
    if (timeout_ms < 0)
        return mlart_set_error(MLART_EINVAL, "mlart_rendezvous: timeout %d ms", timeout_ms);
    if (size == 1)
        return 0;
    memset(&r, 0, sizeof r);
    if (uv_ip4_addr(addr, port, &r.sa) < 0)
        return mlart_set_error(MLART_EINVAL, "mlart_rendezvous: '%s' is not a numeric IPv4 "
                               "address", addr);
    r.addr = addr;
    r.port = port;
    r.rank = rank;
    r.size = size;
    r.blob = blob;
    r.bytes = bytes;
    r.timeout_ms = timeout_ms ? timeout_ms : 60000;
    if ((rc = uv_loop_init(&r.loop)) < 0)
        return mlart_set_error(MLART_ECOMM, "rendezvous: uv_loop_init: %s", uv_strerror(rc));
    r.loop.data = &r;
    /* a peer that vanishes mid-write costs an error code, not a SIGPIPE */
    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_set, &old_mask);
    rc = run(&r);
    if (!sigismember(&old_mask, SIGPIPE) && sigpending(&pending) == 0 &&
        sigismember(&pending, SIGPIPE)) {
        struct timespec zero = {0, 0};
        sigtimedwait(&pipe_set, NULL, &zero);
    }
    pthread_sigmask(SIG_SETMASK, &old_mask, NULL);
    if (uv_loop_close(&r.loop) < 0)
        mlart_log(MLART_LOG_ERROR, "rendezvous: a handle outlived its loop");
    free(r.state);
    return rc;
}

/* What rank 0 hands out in mlart_comm_nccl_join: the NCCL id, or why it has
 * none, so that the other ranks fail at once with rank 0's reason rather
 * than wait out the deadline for a rank 0 that never serves. */
typedef struct join_blob {
    unsigned char ok; /* 1: id holds the NCCL id; 0: why holds rank 0's error */
    unsigned char id[MLART_NCCL_ID_BYTES];
    char why[320];
} join_blob;

int mlart_comm_nccl_join(int rank, int size, int device, const char *addr, int port,
                         int timeout_ms, mlart_comm **out)
{
    join_blob b;
    char mine[256];
    uint64_t t0 = uv_hrtime();
    int64_t left;
    if (timeout_ms < 0)
        return mlart_set_error(MLART_EINVAL, "mlart_comm_nccl_join: timeout %d ms", timeout_ms);
    timeout_ms = timeout_ms ? timeout_ms : 60000;
    memset(&b, 0, sizeof b);
    if (rank == 0 && size >= 1) {
        const int rc = mlart_comm_nccl_unique_id(b.id, sizeof b.id);
        if (rc < 0) {
            /* tell the peers why, then give this rank's own error */
            int told;
            snprintf(mine, sizeof mine, "%s", mlart_last_error());
            snprintf(b.why, sizeof b.why, "%s: %s", mlart_status_name(rc), mine);
            told = mlart_rendezvous(addr, port, rank, size, &b, sizeof b, timeout_ms);
            return mlart_set_error(rc, "%s%s", mine,
                                   told < 0 ? " (and not every other rank could be told)" : "");
        }
        b.ok = 1;
    }
    MLART_CHECK(mlart_rendezvous(addr, port, rank, size, &b, sizeof b, timeout_ms));
    if (!b.ok) {
        b.why[sizeof b.why - 1] = 0;
        return mlart_set_error(MLART_ECOMM, "mlart_comm_nccl_join: rank 0 at %s:%d has no NCCL "
                               "id for the group (%s)", addr, port, b.why);
    }
    left = timeout_ms - (int64_t)((uv_hrtime() - t0) / 1000000u);
    return mlart_comm_nccl_create(rank, size, device, b.id, sizeof b.id,
                                  left > 1000 ? (int)left : 1000, out);
}
