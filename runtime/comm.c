/* Communicators: the common entry points, the local (threads) group, and
 * where a cached token lives under DCP.  The NCCL communicator is in
 * comm_nccl.c, the rank variables in ranks.c, the rendezvous in
 * rendezvous/rendezvous.c. */
#define _POSIX_C_SOURCE 200809L
#include "runtime/comm_impl.h"
#include "runtime/status.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef MLART_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

/* ---- common entry points ------------------------------------------------ */

void mlart_comm_destroy(mlart_comm *c)
{
    if (c)
        c->ops->destroy(c);
}

int mlart_comm_rank(const mlart_comm *c)
{
    return c ? c->rank : -1;
}

int mlart_comm_size(const mlart_comm *c)
{
    return c ? c->size : 0;
}

int mlart_comm_device(const mlart_comm *c)
{
    return c ? c->device : -1;
}

int mlart_comm_graph_safe(const mlart_comm *c)
{
    return c ? c->graph_safe : 0;
}

const char *mlart_comm_kind(const mlart_comm *c)
{
    return c ? c->ops->kind : "none";
}

static int check_args(const mlart_comm *c, const void *send, const void *recv, size_t bytes,
                      const char *what)
{
    if (!c)
        return mlart_set_error(MLART_EINVAL, "%s: NULL communicator", what);
    if (bytes && (!send || !recv))
        return mlart_set_error(MLART_EINVAL, "%s: NULL buffer for %zu bytes a rank", what, bytes);
    return 0;
}

int mlart_comm_all_gather(mlart_comm *c, const void *send, void *recv, size_t bytes, void *stream)
{
    MLART_CHECK(check_args(c, send, recv, bytes, "all_gather"));
    return bytes ? c->ops->all_gather(c, send, recv, bytes, stream) : 0;
}

int mlart_comm_all_to_all(mlart_comm *c, const void *send, void *recv, size_t bytes, void *stream)
{
    return mlart_comm_all_to_all_n(c, 1, &send, &recv, &bytes, stream);
}

int mlart_comm_all_to_all_n(mlart_comm *c, int n, const void *const *send, void *const *recv,
                            const size_t *bytes, void *stream)
{
    enum { MAX_N = 8 };
    const void *s[MAX_N];
    void *r[MAX_N];
    size_t b[MAX_N];
    int k = 0;
    if (n < 1 || n > MAX_N || !send || !recv || !bytes)
        return mlart_set_error(MLART_EINVAL, "all_to_all_n: %d arrays (want 1..%d) at %p %p %p",
                               n, MAX_N, (const void *)send, (const void *)recv,
                               (const void *)bytes);
    for (int i = 0; i < n; i++) {
        MLART_CHECK(check_args(c, send[i], recv[i], bytes[i], "all_to_all"));
        if (bytes[i])
            s[k] = send[i], r[k] = recv[i], b[k++] = bytes[i];
    }
    return k ? c->ops->all_to_all(c, k, s, r, b, stream) : 0;
}

int mlart_comm_reduce_scatter_f32(mlart_comm *c, const float *send, float *recv, size_t n,
                                  void *stream)
{
    MLART_CHECK(check_args(c, send, recv, n, "reduce_scatter_f32"));
    return n ? c->ops->reduce_scatter_f32(c, send, recv, n, stream) : 0;
}

int mlart_comm_wait(mlart_comm *c, void *stream, int timeout_ms)
{
    int rc;
    if (!c)
        return mlart_set_error(MLART_EINVAL, "mlart_comm_wait: NULL communicator");
    if (timeout_ms < 0)
        return mlart_set_error(MLART_EINVAL, "mlart_comm_wait: timeout %d ms", timeout_ms);
    if (c->device < 0)
        return 0; /* host collectives have ended when they return */
    timeout_ms = timeout_ms ? timeout_ms : 60000;
    if (c->ops->wait)
        return c->ops->wait(c, stream, timeout_ms);
    if ((rc = mlart_comm_poll_stream(c, stream, timeout_ms, NULL)) == 1)
        return mlart_set_error(MLART_ETIMEDOUT, "%s communicator rank %d of %d: the stream's work "
                               "did not end within %d ms", c->ops->kind, c->rank, c->size,
                               timeout_ms);
    return rc;
}

#ifdef MLART_WITH_CUDA
static int64_t mono_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000 + t.tv_nsec / 1000;
}
#endif

int mlart_comm_poll_stream(mlart_comm *c, void *stream, int timeout_ms, int (*stop)(mlart_comm *c))
{
#ifdef MLART_WITH_CUDA
    const int64_t start = mono_us(), deadline = start + (int64_t)timeout_ms * 1000;
    int64_t next_stop = start + 1000;
    for (;;) {
        const cudaError_t e = cudaStreamQuery((cudaStream_t)stream);
        int64_t now;
        if (e == cudaSuccess)
            return 0;
        if (e != cudaErrorNotReady) {
            (void)cudaGetLastError(); /* a sticky error stays; a plain one is consumed */
            return mlart_set_error(MLART_ECUDA, "%s communicator rank %d of %d: waiting for the "
                                   "stream: %s", c->ops->kind, c->rank, c->size,
                                   cudaGetErrorString(e));
        }
        now = mono_us();
        if (stop && now >= next_stop) {
            int rc = stop(c);
            if (rc)
                return rc;
            next_stop = now + 1000;
        }
        if (now >= deadline)
            return 1;
        if (now - start < 5000) {
            sched_yield();
        } else {
            struct timespec nap = {0, 100000};
            nanosleep(&nap, NULL);
        }
    }
#else
    (void)stream, (void)timeout_ms, (void)stop;
    return mlart_set_error(MLART_ENODEV, "%s communicator rank %d: this build has no CUDA",
                           c->ops->kind, c->rank);
#endif
}

/* ---- where a cached token lives ------------------------------------------ */

/* The layer descriptor's dcp_interleave 0 means 1, and so it does here (a
 * negative one too: these helpers have no error to return). */
static int64_t interleave_or_1(int32_t interleave)
{
    return interleave > 0 ? interleave : 1;
}

int32_t mlart_dcp_owner(int64_t pos, int32_t size, int32_t interleave)
{
    return size <= 1 ? 0 : (int32_t)((pos / interleave_or_1(interleave)) % size);
}

int64_t mlart_dcp_local_pos(int64_t pos, int32_t size, int32_t interleave)
{
    const int64_t I = interleave_or_1(interleave);
    if (size <= 1)
        return pos;
    return pos / (I * size) * I + pos % I;
}

int64_t mlart_dcp_local_len(int64_t seq_len, int32_t rank, int32_t size, int32_t interleave)
{
    int64_t round, rest, mine;
    if (size <= 1)
        return seq_len;
    interleave = (int32_t)interleave_or_1(interleave);
    round = (int64_t)interleave * size;
    rest = seq_len % round - (int64_t)rank * interleave;
    mine = rest < 0 ? 0 : rest > interleave ? interleave : rest;
    return seq_len / round * interleave + mine;
}

/* ---- local group: ranks as threads ---------------------------------------- */

struct mlart_comm_group {
    int size, device, timeout_ms;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrived;
    unsigned long generation;
    int failed;                /* a rank timed out or left: every later wait fails at once */
    int left;                  /* the first rank whose communicator was destroyed, else -1 */
    int finished;              /* ranks whose body of the collective under way is done */
    unsigned long drained;     /* collectives whose bodies all ranks have finished */
    const void **send;         /* each rank's send buffer of the collective under way */
    uint64_t *call;            /* each rank's collective and sizes, hashed: all must agree */
    size_t *call_n;            /* each rank's byte or element count, for the message */
    int members;               /* communicators alive */
    int orphaned;              /* destroyed while members lived: the last one frees it */
    unsigned char *joined;     /* per rank: 1 once its communicator was created */
};

typedef struct local_impl {
    mlart_comm_group *g;
    float *stage;              /* CUDA reduce-scatter: host staging, grown as needed */
    size_t stage_n;
} local_impl;

int mlart_comm_group_create(int size, int device, int timeout_ms, mlart_comm_group **out)
{
    mlart_comm_group *g;
    if (!out)
        return mlart_set_error(MLART_EINVAL, "comm group: NULL out");
    if (size < 1 || size > 4096 || timeout_ms < 0)
        return mlart_set_error(MLART_EINVAL, "comm group: size %d (want 1..4096), timeout %d ms",
                               size, timeout_ms);
    if (device < -1)
        return mlart_set_error(MLART_EINVAL, "comm group: device %d (want -1 for the host or a "
                               "CUDA ordinal)", device);
#ifndef MLART_WITH_CUDA
    if (device >= 0)
        return mlart_set_error(MLART_ENOTSUP, "comm group: device %d, but this build of mlart has "
                               "no CUDA (want -1, the host)", device);
#endif
    g = calloc(1, sizeof *g);
    if (!g || !(g->send = calloc((size_t)size, sizeof *g->send)) ||
        !(g->joined = calloc((size_t)size, 1)) ||
        !(g->call = calloc((size_t)size, sizeof *g->call)) ||
        !(g->call_n = calloc((size_t)size, sizeof *g->call_n))) {
        if (g) {
            free(g->send);
            free(g->joined);
            free(g->call);
        }
        free(g);
        return mlart_set_error(MLART_ENOMEM, "comm group: out of memory");
    }
    g->size = size;
    g->device = device;
    g->timeout_ms = timeout_ms ? timeout_ms : 60000;
    g->left = -1;
    pthread_mutex_init(&g->mu, NULL);
    {
        /* deadlines on the monotonic clock: a step of the wall clock must
         * not fail the group (or stretch its timeout) */
        pthread_condattr_t ca;
        pthread_condattr_init(&ca);
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        pthread_cond_init(&g->cv, &ca);
        pthread_condattr_destroy(&ca);
    }
    *out = g;
    return 0;
}

static void group_free(mlart_comm_group *g)
{
    pthread_cond_destroy(&g->cv);
    pthread_mutex_destroy(&g->mu);
    free(g->send);
    free(g->joined);
    free(g->call);
    free(g->call_n);
    free(g);
}

void mlart_comm_group_destroy(mlart_comm_group *g)
{
    int members;
    if (!g)
        return;
    pthread_mutex_lock(&g->mu);
    members = g->members;
    if (members)
        g->orphaned = 1; /* its communicators still point at it */
    pthread_mutex_unlock(&g->mu);
    if (members) {
        mlart_log(MLART_LOG_WARN, "comm group destroyed with %d communicators alive: it is freed "
                  "when the last of them is destroyed", members);
        return;
    }
    group_free(g);
}

/* Now plus the group's timeout, on the clock of g->cv. */
static struct timespec group_deadline(const mlart_comm_group *g)
{
    struct timespec dl;
    clock_gettime(CLOCK_MONOTONIC, &dl);
    dl.tv_sec += g->timeout_ms / 1000;
    dl.tv_nsec += (long)(g->timeout_ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L)
        dl.tv_sec++, dl.tv_nsec -= 1000000000L;
    return dl;
}

/* Wait for every rank of the group; MLART_ETIMEDOUT after the group's timeout,
 * after which the group stays failed (a peer that arrives late must not pair
 * with the next collective).  All or none: under the mutex either the last
 * rank opens the generation or a timeout fails it first, so when one rank
 * passes, every rank passes and will run its body. */
static int group_barrier(mlart_comm_group *g, int rank, const char *what)
{
    struct timespec dl = group_deadline(g);
    unsigned long gen;
    int rc = 0, left, failed_before;
    pthread_mutex_lock(&g->mu);
    gen = g->generation;
    failed_before = g->failed;
    if (!g->failed && ++g->arrived == g->size) {
        g->arrived = 0;
        g->generation++;
        pthread_cond_broadcast(&g->cv);
    } else {
        while (!g->failed && g->generation == gen) {
            int e = pthread_cond_timedwait(&g->cv, &g->mu, &dl);
            if (e == ETIMEDOUT && g->generation == gen) {
                g->failed = 1;
                pthread_cond_broadcast(&g->cv);
            }
        }
        if (g->failed && g->generation == gen)
            rc = -1;
    }
    left = g->left;
    pthread_mutex_unlock(&g->mu);
    if (rc < 0 && left >= 0)
        return mlart_set_error(MLART_ECOMM, "local comm %s: rank %d of %d: rank %d left the group "
                               "(destroyed its communicator) before this collective",
                               what, rank, g->size, left);
    if (rc < 0 && failed_before)
        return mlart_set_error(MLART_ETIMEDOUT, "local comm %s: rank %d of %d: the group failed "
                               "before this rank came (a rank did not arrive within %d ms, in "
                               "this collective or an earlier one)",
                               what, rank, g->size, g->timeout_ms);
    if (rc < 0)
        return mlart_set_error(MLART_ETIMEDOUT, "local comm %s: rank %d of %d: the other ranks did "
                               "not arrive within %d ms (or an earlier collective failed)",
                               what, rank, g->size, g->timeout_ms);
    return 0;
}

/* After this rank's body: wait until every rank has finished its own, since
 * until then a peer may still be reading this rank's send buffer.  No
 * timeout and no look at `failed`: every rank passed group_barrier, so every
 * body is running and is a bounded local copy that waits on nobody, and
 * returning earlier would hand the caller a buffer still being read.  A
 * later collective failing the group does not concern this one. */
static void group_drain(mlart_comm_group *g, int rank, const char *what)
{
    struct timespec dl = group_deadline(g);
    unsigned long gen;
    int warned = 0;
    pthread_mutex_lock(&g->mu);
    gen = g->drained;
    if (++g->finished == g->size) {
        g->finished = 0;
        g->drained++;
        pthread_cond_broadcast(&g->cv);
    }
    while (g->drained == gen) {
        if (warned) {
            pthread_cond_wait(&g->cv, &g->mu);
        } else if (pthread_cond_timedwait(&g->cv, &g->mu, &dl) == ETIMEDOUT &&
                   g->drained == gen) {
            warned = 1;
            mlart_log(MLART_LOG_WARN, "local comm %s: rank %d of %d: peers still read this "
                      "rank's buffers after %d ms; waiting for them", what, rank, g->size,
                      g->timeout_ms);
        }
    }
    pthread_mutex_unlock(&g->mu);
}

static int copy_bytes(int device, void *dst, const void *src, size_t n)
{
    if (device < 0) {
        memcpy(dst, src, n);
        return 0;
    }
#ifdef MLART_WITH_CUDA
    {
        /* a copy from device to device (or from pageable host memory)
         * returns before it has ended; the collective's promise that the
         * peers' buffers are free and recv is written on return (and the
         * caller's stream may be non-blocking) needs it ended */
        cudaError_t e = cudaMemcpy(dst, src, n, cudaMemcpyDefault);
        if (e == cudaSuccess)
            e = cudaStreamSynchronize(0); /* the stream cudaMemcpy ran on */
        if (e != cudaSuccess)
            return mlart_set_error(MLART_ECUDA, "local comm copy of %zu bytes: %s", n,
                                   cudaGetErrorString(e));
        return 0;
    }
#else
    return mlart_set_error(MLART_ENODEV, "this build has no CUDA");
#endif
}

/* Before a rank's buffers are published: its stream's work on them is done. */
static int settle(int device, void *stream)
{
    if (device < 0)
        return 0;
#ifdef MLART_WITH_CUDA
    {
        cudaError_t e = cudaStreamSynchronize((cudaStream_t)stream);
        if (e != cudaSuccess)
            return mlart_set_error(MLART_ECUDA, "local comm: cudaStreamSynchronize: %s (a local "
                                   "communicator cannot be captured in a CUDA graph)",
                                   cudaGetErrorString(e));
        return 0;
    }
#else
    return mlart_set_error(MLART_ENODEV, "this build has no CUDA");
#endif
}

/* One collective: publish `send`, wait for all, run `body` over the peers'
 * buffers, then wait for every peer's body so that nobody reuses a buffer a
 * peer still reads.  The timeout bounds only the first wait; a body that
 * failed here still lets the peers finish theirs, and this rank returns its
 * error. */
typedef int (*local_body)(mlart_comm *c, const void *const *peers, void *recv, size_t n);

static int local_run(mlart_comm *c, const void *send, void *recv, size_t n, uint64_t call,
                     void *stream, local_body body, const char *what)
{
    mlart_comm_group *g = ((local_impl *)c->impl)->g;
    int rc = 0;
    MLART_CHECK(settle(c->device, stream));
    g->send[c->rank] = send;
    g->call[c->rank] = call;
    g->call_n[c->rank] = n;
    MLART_CHECK(group_barrier(g, c->rank, what));
    /* every rank sees the same table, so all refuse a call that differs */
    for (int r = 0; r < c->size && rc == 0; r++)
        if (g->call[r] != call)
            rc = mlart_set_error(MLART_ECOMM, "local comm %s: rank %d of %d: rank %d made another "
                                 "call (another collective or other sizes: %zu there, %zu here); "
                                 "every rank must make the same one", what, c->rank, c->size, r,
                                 g->call_n[r], n);
    if (rc == 0)
        rc = body(c, g->send, recv, n);
    group_drain(g, c->rank, what);
    return rc;
}

/* A collective and its sizes as one number (FNV-1a over 64-bit words). */
static uint64_t call_mix(uint64_t h, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        h = (h ^ ((v >> (8 * i)) & 0xff)) * 0x100000001b3ull;
    return h;
}

static uint64_t call_of(int kind, size_t n)
{
    return call_mix(call_mix(0xcbf29ce484222325ull, (uint64_t)kind), (uint64_t)n);
}

static int body_all_gather(mlart_comm *c, const void *const *peers, void *recv, size_t bytes)
{
    for (int r = 0; r < c->size; r++)
        MLART_CHECK(copy_bytes(c->device, (char *)recv + (size_t)r * bytes, peers[r], bytes));
    return 0;
}

/* all_to_all_n: `peers` holds each rank's n send pointers, rank after rank;
 * `recv` this rank's n receive pointers, `n` packs the count and the sizes */
typedef struct a2a_args {
    int n;
    void *const *recv;
    const size_t *bytes;
} a2a_args;

static int body_all_to_all(mlart_comm *c, const void *const *peers, void *recv, size_t n)
{
    const a2a_args *a = recv;
    (void)n;
    for (int r = 0; r < c->size; r++)
        for (int i = 0; i < a->n; i++) {
            const char *src = ((const void *const *)peers[r])[i];
            MLART_CHECK(copy_bytes(c->device, (char *)a->recv[i] + (size_t)r * a->bytes[i],
                                   src + (size_t)c->rank * a->bytes[i], a->bytes[i]));
        }
    return 0;
}

static int body_reduce_scatter(mlart_comm *c, const void *const *peers, void *recv, size_t n)
{
    local_impl *li = c->impl;
    float *acc = recv;
    if (c->device >= 0) { /* sum on the host: this communicator is for tests and emulation */
        if (li->stage_n < 2 * n) {
            float *p = realloc(li->stage, 2 * n * sizeof *p);
            if (!p)
                return mlart_set_error(MLART_ENOMEM, "local comm: out of host memory");
            li->stage = p, li->stage_n = 2 * n;
        }
        acc = li->stage + n;
    }
    if (c->device < 0) {
        /* element by element: in place (recv = send + rank * n, as NCCL
         * allows) this rank's own block is read before it is written */
        for (size_t i = 0; i < n; i++) {
            float sum = 0.0f;
            for (int r = 0; r < c->size; r++)
                sum += ((const float *)peers[r])[(size_t)c->rank * n + i];
            acc[i] = sum;
        }
        return 0;
    }
    for (size_t i = 0; i < n; i++)
        acc[i] = 0.0f;
    for (int r = 0; r < c->size; r++) {
        const float *src = (const float *)peers[r] + (size_t)c->rank * n;
        MLART_CHECK(copy_bytes(c->device, li->stage, src, n * sizeof(float)));
        src = li->stage;
        for (size_t i = 0; i < n; i++)
            acc[i] += src[i];
    }
    MLART_CHECK(copy_bytes(c->device, recv, acc, n * sizeof(float)));
    return 0;
}

static int local_all_gather(mlart_comm *c, const void *send, void *recv, size_t bytes,
                            void *stream)
{
    return local_run(c, send, recv, bytes, call_of(1, bytes), stream, body_all_gather,
                     "all_gather");
}

static int local_all_to_all(mlart_comm *c, int n, const void *const *send, void *const *recv,
                            const size_t *bytes, void *stream)
{
    a2a_args a = {n, recv, bytes};
    uint64_t call = call_of(2, (size_t)n);
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        call = call_mix(call, bytes[i]);
        total += bytes[i];
    }
    /* what the peers read is this rank's array of send pointers */
    return local_run(c, (const void *)send, &a, total, call, stream, body_all_to_all,
                     "all_to_all");
}

static int local_reduce_scatter(mlart_comm *c, const float *send, float *recv, size_t n,
                                void *stream)
{
    return local_run(c, send, recv, n, call_of(3, n), stream, body_reduce_scatter,
                     "reduce_scatter_f32");
}

static void local_destroy(mlart_comm *c)
{
    local_impl *li = c->impl;
    mlart_comm_group *g = li->g;
    int last_of_orphan;
    pthread_mutex_lock(&g->mu);
    g->members--;
    /* a rank that leaves will never arrive: the others' collectives fail now,
     * not at the timeout (after the last collective nobody waits any more) */
    if (!g->failed) {
        g->failed = 1;
        g->left = c->rank;
        pthread_cond_broadcast(&g->cv);
    }
    last_of_orphan = g->orphaned && g->members == 0;
    pthread_mutex_unlock(&g->mu);
    if (last_of_orphan)
        group_free(g);
    free(li->stage);
    free(li);
    free(c);
}

static const mlart_comm_ops local_ops = {
    .kind = "local",
    .all_gather = local_all_gather,
    .all_to_all = local_all_to_all,
    .reduce_scatter_f32 = local_reduce_scatter,
    .destroy = local_destroy, /* no wait: its collectives end before they return */
};

int mlart_comm_local_create(mlart_comm_group *g, int rank, mlart_comm **out)
{
    mlart_comm *c;
    local_impl *li;
    if (!g || !out)
        return mlart_set_error(MLART_EINVAL, "local comm: NULL %s", g ? "out" : "group");
    if (rank < 0 || rank >= g->size)
        return mlart_set_error(MLART_EINVAL, "local comm: rank %d of a group of %d", rank, g->size);
    c = calloc(1, sizeof *c);
    li = calloc(1, sizeof *li);
    if (!c || !li) {
        free(c);
        free(li);
        return mlart_set_error(MLART_ENOMEM, "local comm: out of memory");
    }
    pthread_mutex_lock(&g->mu);
    if (g->joined[rank]) { /* two send buffers for one rank: a collective would take either */
        pthread_mutex_unlock(&g->mu);
        free(c);
        free(li);
        return mlart_set_error(MLART_EINVAL, "local comm: rank %d of the group has a "
                               "communicator already (one per rank, once)", rank);
    }
    g->joined[rank] = 1;
    g->members++;
    pthread_mutex_unlock(&g->mu);
    li->g = g;
    c->ops = &local_ops;
    c->rank = rank;
    c->size = g->size;
    c->device = g->device;
    c->graph_safe = 0;
    c->impl = li;
    *out = c;
    return 0;
}
