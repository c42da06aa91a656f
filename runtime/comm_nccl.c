/* The NCCL communicator: one rank a process, collectives enqueued on the
 * caller's stream (capturable).  libnccl.so.2 is opened at run time, not
 * linked.  Rank 0's unique id reaches the other ranks by any transport the
 * caller has: mlart_comm_nccl_join (libmlart_rendezvous) hands it out over TCP. */
#define _POSIX_C_SOURCE 200809L
#include "runtime/comm_impl.h"
#include "runtime/status.h"

#include <stdlib.h>

#ifdef MLART_WITH_CUDA
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <nccl.h>
#pragma GCC diagnostic pop

_Static_assert(sizeof(ncclUniqueId) == MLART_NCCL_ID_BYTES, "NCCL unique id size");

#define NCCL_MIN_VERSION 21800
/* A call NCCL leaves in progress (not set-up, which takes create's timeout,
 * the time left of a rendezvous from mlart_comm_nccl_join) */
#define NCCL_WAIT_MS 60000

/* The entry points used, looked up in libnccl.so.2. */
typedef struct nccl_api {
    ncclResult_t (*GetVersion)(int *version);
    ncclResult_t (*GetUniqueId)(ncclUniqueId *id);
    ncclResult_t (*CommInitRankConfig)(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                       ncclConfig_t *config);
    ncclResult_t (*CommGetAsyncError)(ncclComm_t comm, ncclResult_t *state);
    ncclResult_t (*CommFinalize)(ncclComm_t comm);
    ncclResult_t (*CommDestroy)(ncclComm_t comm);
    ncclResult_t (*CommAbort)(ncclComm_t comm);
    const char *(*GetErrorString)(ncclResult_t result);
    const char *(*GetLastError)(ncclComm_t comm);
    ncclResult_t (*AllGather)(const void *send, void *recv, size_t count, ncclDataType_t type,
                              ncclComm_t comm, cudaStream_t stream);
    ncclResult_t (*ReduceScatter)(const void *send, void *recv, size_t count,
                                  ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                  cudaStream_t stream);
    ncclResult_t (*Send)(const void *send, size_t count, ncclDataType_t type, int peer,
                         ncclComm_t comm, cudaStream_t stream);
    ncclResult_t (*Recv)(void *recv, size_t count, ncclDataType_t type, int peer,
                         ncclComm_t comm, cudaStream_t stream);
    ncclResult_t (*GroupStart)(void);
    ncclResult_t (*GroupEnd)(void);
} nccl_api;

static nccl_api api;
static int api_version;
static char api_error[512]; /* set once when loading failed */
static pthread_once_t api_once = PTHREAD_ONCE_INIT;

static void api_load(void)
{
    static const struct {
        const char *name;
        size_t offset;
        int optional;
    } syms[] = {
        {"ncclGetVersion", offsetof(nccl_api, GetVersion), 0},
        {"ncclGetUniqueId", offsetof(nccl_api, GetUniqueId), 0},
        {"ncclCommInitRankConfig", offsetof(nccl_api, CommInitRankConfig), 0},
        {"ncclCommGetAsyncError", offsetof(nccl_api, CommGetAsyncError), 0},
        {"ncclCommFinalize", offsetof(nccl_api, CommFinalize), 0},
        {"ncclCommDestroy", offsetof(nccl_api, CommDestroy), 0},
        {"ncclCommAbort", offsetof(nccl_api, CommAbort), 0},
        {"ncclGetErrorString", offsetof(nccl_api, GetErrorString), 0},
        {"ncclGetLastError", offsetof(nccl_api, GetLastError), 1},
        {"ncclAllGather", offsetof(nccl_api, AllGather), 0},
        {"ncclReduceScatter", offsetof(nccl_api, ReduceScatter), 0},
        {"ncclSend", offsetof(nccl_api, Send), 0},
        {"ncclRecv", offsetof(nccl_api, Recv), 0},
        {"ncclGroupStart", offsetof(nccl_api, GroupStart), 0},
        {"ncclGroupEnd", offsetof(nccl_api, GroupEnd), 0},
    };
    nccl_api a;
    void *h;
    memset(&a, 0, sizeof a);
    dlerror();
    h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        snprintf(api_error, sizeof api_error, "libnccl.so.2 cannot be opened: %s",
                 e ? e : "unknown dlopen error");
        return;
    }
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        void *p = dlsym(h, syms[i].name);
        if (!p && !syms[i].optional) {
            snprintf(api_error, sizeof api_error, "libnccl.so.2 has no %s()", syms[i].name);
            dlclose(h);
            return;
        }
        memcpy((char *)&a + syms[i].offset, &p, sizeof p);
    }
    if (a.GetVersion(&api_version) != ncclSuccess) {
        snprintf(api_error, sizeof api_error, "ncclGetVersion failed");
        dlclose(h);
        return;
    }
    if (api_version < NCCL_MIN_VERSION) {
        snprintf(api_error, sizeof api_error,
                 "libnccl.so.2 is NCCL %d.%d.%d; mlart needs 2.18 or newer", api_version / 10000,
                 api_version / 100 % 100, api_version % 100);
        dlclose(h);
        return;
    }
    api = a; /* the library stays loaded for the process lifetime */
}

static int64_t now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

typedef struct nccl_impl {
    ncclComm_t comm; /* NULL once aborted */
    char aborted[256]; /* why it was aborted */
} nccl_impl;

static int nccl_error(const mlart_comm *c, ncclResult_t r, ncclComm_t comm, const char *what)
{
    const char *last = api.GetLastError ? api.GetLastError(comm) : NULL;
    return mlart_set_error(MLART_ECOMM, "%s failed on rank %d of %d: %s (%d)%s%s", what, c->rank,
                           c->size, api.GetErrorString(r), (int)r, last && *last ? ": " : "",
                           last && *last ? last : "");
}

/* Poll a non-blocking communicator until its pending operation ends, at
 * most timeout_ms. */
static int nccl_wait(const mlart_comm *c, ncclComm_t comm, int64_t timeout_ms, const char *what)
{
    int64_t deadline = now_ms() + timeout_ms;
    for (;;) {
        ncclResult_t state = ncclInProgress, r = api.CommGetAsyncError(comm, &state);
        struct timespec ms = {0, 1000000};
        if (r != ncclSuccess)
            return nccl_error(c, r, comm, "ncclCommGetAsyncError");
        if (state == ncclSuccess)
            return 0;
        if (state != ncclInProgress)
            return nccl_error(c, state, comm, what);
        if (now_ms() >= deadline)
            return mlart_set_error(MLART_ETIMEDOUT, "%s on rank %d of %d still in progress after "
                                   "%lld ms", what, c->rank, c->size, (long long)timeout_ms);
        nanosleep(&ms, NULL);
    }
}

/* A communicator that mlart_comm_wait aborted takes no more work. */
static int nccl_live(const mlart_comm *c)
{
    const nccl_impl *m = c->impl;
    if (m->comm)
        return 0;
    return mlart_set_error(MLART_ECOMM, "NCCL communicator rank %d of %d was aborted (%s); "
                           "destroy it", c->rank, c->size, m->aborted);
}

/* What a call returned: done, an error, or in progress (then wait for it). */
static int nccl_done(mlart_comm *c, ncclResult_t r, const char *what)
{
    nccl_impl *m = c->impl;
    if (r == ncclSuccess)
        return 0;
    if (r == ncclInProgress)
        return nccl_wait(c, m->comm, NCCL_WAIT_MS, what);
    return nccl_error(c, r, m->comm, what);
}

static int nccl_all_gather(mlart_comm *c, const void *send, void *recv, size_t bytes,
                           void *stream)
{
    nccl_impl *m = c->impl;
    MLART_CHECK(nccl_live(c));
    return nccl_done(c, api.AllGather(send, recv, bytes, ncclUint8, m->comm,
                                      (cudaStream_t)stream), "ncclAllGather");
}

/* Every array's sends and receives in one group: one launch.  A call of a
 * non-blocking communicator that returns ncclInProgress inside the group
 * has been accepted; the group's end is what is waited for. */
static int nccl_all_to_all(mlart_comm *c, int n, const void *const *send, void *const *recv,
                           const size_t *bytes, void *stream)
{
#define NCCL_ACCEPTED(r) ((r) == ncclSuccess || (r) == ncclInProgress)
    nccl_impl *m = c->impl;
    ncclResult_t r, end;
    const char *what = "ncclGroupStart";
    MLART_CHECK(nccl_live(c));
    r = api.GroupStart();
    if (r != ncclSuccess)
        return nccl_done(c, r, what);
    for (int p = 0; p < c->size && NCCL_ACCEPTED(r); p++)
        for (int i = 0; i < n && NCCL_ACCEPTED(r); i++) {
            what = "ncclSend";
            r = api.Send((const char *)send[i] + (size_t)p * bytes[i], bytes[i], ncclUint8, p,
                         m->comm, (cudaStream_t)stream);
            if (NCCL_ACCEPTED(r)) {
                what = "ncclRecv";
                r = api.Recv((char *)recv[i] + (size_t)p * bytes[i], bytes[i], ncclUint8, p,
                             m->comm, (cudaStream_t)stream);
            }
        }
    end = api.GroupEnd();
    if (!NCCL_ACCEPTED(r)) {
        if (end == ncclInProgress)
            nccl_wait(c, m->comm, NCCL_WAIT_MS, "ncclGroupEnd");
        return nccl_done(c, r, what);
    }
    return nccl_done(c, end, "ncclGroupEnd (all_to_all)");
#undef NCCL_ACCEPTED
}

static int nccl_reduce_scatter_f32(mlart_comm *c, const float *send, float *recv, size_t n,
                                   void *stream)
{
    nccl_impl *m = c->impl;
    MLART_CHECK(nccl_live(c));
    return nccl_done(c, api.ReduceScatter(send, recv, n, ncclFloat32, ncclSum, m->comm,
                                          (cudaStream_t)stream), "ncclReduceScatter");
}

/* mlart_comm_poll_stream's stop: an error NCCL met on its own (a peer that
 * closed its connection, a network error), which leaves the kernels of the
 * stream waiting for ever. */
static int nccl_async_error(mlart_comm *c)
{
    nccl_impl *m = c->impl;
    ncclResult_t state = ncclSuccess, r = api.CommGetAsyncError(m->comm, &state);
    if (r != ncclSuccess)
        return nccl_error(c, r, m->comm, "ncclCommGetAsyncError");
    if (state != ncclSuccess && state != ncclInProgress)
        return nccl_error(c, state, m->comm, "an NCCL operation on the stream");
    return 0;
}

/* Wait for the stream against the deadline and NCCL's error state; past the
 * one or on the other, abort the communicator: ncclCommAbort ends its
 * kernels, so the stream can drain, and every later call is refused. */
static int nccl_wait_stream(mlart_comm *c, void *stream, int timeout_ms)
{
    nccl_impl *m = c->impl;
    char why[sizeof m->aborted];
    ncclResult_t r;
    int rc;
    MLART_CHECK(nccl_live(c));
    rc = mlart_comm_poll_stream(c, stream, timeout_ms, nccl_async_error);
    if (rc == 0 || rc == MLART_ECUDA)
        return rc;
    if (rc == 1)
        rc = mlart_set_error(MLART_ETIMEDOUT, "NCCL communicator rank %d of %d: the stream's "
                             "work did not end within %d ms (is every rank running?)", c->rank,
                             c->size, timeout_ms);
    snprintf(why, sizeof why, "%s", mlart_last_error());
    snprintf(m->aborted, sizeof m->aborted, "%s", why);
    mlart_log(MLART_LOG_WARN, "%s; aborting the communicator", why);
    if ((r = api.CommAbort(m->comm)) != ncclSuccess)
        mlart_log(MLART_LOG_WARN, "nccl communicator rank %d of %d: ncclCommAbort: %s", c->rank,
                  c->size, api.GetErrorString(r));
    m->comm = NULL;
    c->aborted = 1;
    return mlart_set_error(rc, "%s; the communicator was aborted", why);
}

/* Finalize then destroy; abort when the communicator is in error or does not
 * finish its work in time. */
static void nccl_destroy(mlart_comm *c)
{
    nccl_impl *m = c->impl;
    ncclResult_t state = ncclSuccess;
    int bad;
    if (!m->comm) { /* aborted by mlart_comm_wait */
        free(m);
        free(c);
        return;
    }
    bad = api.CommGetAsyncError(m->comm, &state) != ncclSuccess || state != ncclSuccess;
    if (!bad) {
        ncclResult_t r = api.CommFinalize(m->comm);
        bad = r == ncclInProgress ? nccl_wait(c, m->comm, NCCL_WAIT_MS, "ncclCommFinalize") < 0
                                  : r != ncclSuccess;
    }
    if (bad) {
        mlart_log(MLART_LOG_WARN, "nccl communicator rank %d of %d: %s, aborting it", c->rank,
                  c->size, state != ncclSuccess ? api.GetErrorString(state)
                                                : "finalize did not complete");
        if ((state = api.CommAbort(m->comm)) != ncclSuccess)
            mlart_log(MLART_LOG_WARN, "nccl communicator rank %d of %d: ncclCommAbort: %s",
                      c->rank, c->size, api.GetErrorString(state));
    } else if ((state = api.CommDestroy(m->comm)) != ncclSuccess) {
        mlart_log(MLART_LOG_WARN, "nccl communicator rank %d of %d: ncclCommDestroy: %s", c->rank,
                  c->size, api.GetErrorString(state));
    }
    free(m);
    free(c);
}

static const mlart_comm_ops nccl_ops = {
    .kind = "nccl",
    .all_gather = nccl_all_gather,
    .all_to_all = nccl_all_to_all,
    .reduce_scatter_f32 = nccl_reduce_scatter_f32,
    .wait = nccl_wait_stream,
    .destroy = nccl_destroy,
};

/* Open libnccl once; MLART_ECOMM with the reason when it cannot be used. */
static int api_ready(void)
{
    pthread_once(&api_once, api_load);
    if (!api.GetVersion)
        return mlart_set_error(MLART_ECOMM, "NCCL communicator: %s", api_error);
    return 0;
}
#endif /* MLART_WITH_CUDA */

int mlart_comm_nccl_unique_id(void *id, size_t bytes)
{
    if (!id || bytes != MLART_NCCL_ID_BYTES)
        return mlart_set_error(MLART_EINVAL, "mlart_comm_nccl_unique_id: %zu bytes at %p, want "
                               "%d", bytes, id, MLART_NCCL_ID_BYTES);
#ifndef MLART_WITH_CUDA
    return mlart_set_error(MLART_ENOTSUP, "mlart_comm_nccl_unique_id: this build of mlart has no "
                           "CUDA, so no NCCL");
#else
    {
        ncclUniqueId u;
        ncclResult_t r;
        MLART_CHECK(api_ready());
        if ((r = api.GetUniqueId(&u)) != ncclSuccess)
            return mlart_set_error(MLART_ECOMM, "ncclGetUniqueId: %s", api.GetErrorString(r));
        memcpy(id, &u, sizeof u);
        return 0;
    }
#endif
}

int mlart_comm_nccl_create(int rank, int size, int device, const void *id_bytes, size_t id_len,
                           int timeout_ms, mlart_comm **out)
{
    if (!out)
        return mlart_set_error(MLART_EINVAL, "mlart_comm_nccl_create: NULL out");
    if (size < 1 || rank < 0 || rank >= size)
        return mlart_set_error(MLART_EINVAL, "mlart_comm_nccl_create: rank %d of %d (want 0 <= "
                               "rank < size)", rank, size);
    if (device < 0)
        return mlart_set_error(MLART_EINVAL, "mlart_comm_nccl_create: device %d (want a CUDA "
                               "ordinal)", device);
    if (timeout_ms < 0)
        return mlart_set_error(MLART_EINVAL, "mlart_comm_nccl_create: timeout %d ms", timeout_ms);
    if (!id_bytes || id_len != MLART_NCCL_ID_BYTES)
        return mlart_set_error(MLART_EINVAL, "mlart_comm_nccl_create: unique id of %zu bytes at "
                               "%p, want %d bytes", id_len, id_bytes, MLART_NCCL_ID_BYTES);
#ifndef MLART_WITH_CUDA
    return mlart_set_error(MLART_ENOTSUP, "mlart_comm_nccl_create: this build of mlart has no "
                           "CUDA, so no NCCL communicator (rank %d of %d, device %d)",
                           rank, size, device);
#else
    {
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        ncclUniqueId id;
        ncclComm_t comm = NULL;
        ncclResult_t r;
        mlart_comm *c;
        nccl_impl *m;
        cudaError_t err;
        int n, rc;
        MLART_CHECK(mlart_cuda_device_count(&n));
        if (device >= n)
            return mlart_set_error(MLART_EINVAL, "mlart_comm_nccl_create: CUDA device %d "
                                   "requested but %d device%s usable", device, n,
                                   n == 1 ? " is" : "s are");
        MLART_CHECK(api_ready());
        timeout_ms = timeout_ms ? timeout_ms : 60000;
        if ((err = cudaSetDevice(device)) != cudaSuccess)
            return mlart_set_error(MLART_ECUDA, "NCCL communicator rank %d: cudaSetDevice(%d): %s",
                                   rank, device, cudaGetErrorString(err));
        c = calloc(1, sizeof *c);
        m = calloc(1, sizeof *m);
        if (!c || !m) {
            free(c);
            free(m);
            return mlart_set_error(MLART_ENOMEM, "mlart_comm_nccl_create: out of memory");
        }
        c->ops = &nccl_ops;
        c->rank = rank;
        c->size = size;
        c->device = device;
        c->graph_safe = 1;
        c->impl = m;
        memcpy(&id, id_bytes, sizeof id);
        config.blocking = 0;
        r = api.CommInitRankConfig(&comm, size, id, rank, &config);
        if (r == ncclInProgress || (r == ncclSuccess && comm))
            rc = nccl_wait(c, comm, timeout_ms, "ncclCommInitRankConfig");
        else
            rc = nccl_error(c, r, comm, "ncclCommInitRankConfig");
        if (rc == MLART_ETIMEDOUT)
            rc = mlart_set_error(MLART_ETIMEDOUT, "NCCL communicator rank %d of %d on device %d: "
                                 "ncclCommInitRankConfig did not finish within %d ms (is every "
                                 "rank running?)", rank, size, device, timeout_ms);
        if (rc) {
            if (comm)
                api.CommAbort(comm);
            free(m);
            free(c);
            return rc;
        }
        m->comm = comm;
        mlart_log(MLART_LOG_INFO, "NCCL %d.%d.%d communicator: rank %d of %d on device %d",
                  api_version / 10000, api_version / 100 % 100, api_version % 100, rank, size,
                  device);
        *out = c;
        return 0;
    }
#endif
}
