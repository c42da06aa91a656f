/* The NCCL communicator on CUDA devices: all_gather, all_to_all,
 * reduce_scatter_f32 and a two-array all_to_all_n against results computed
 * on the host, first called
 * directly, then captured in a CUDA graph on a non-default stream and
 * replayed twice with new inputs, each waited for by mlart_comm_wait; then
 * a stream that does not drain: the wait ends at its deadline and aborts the
 * communicator, which refuses every later call.  Alone it is rank 0 of 1;
 * under `mpirun -np N` (or any launcher mlart_rank_from_env knows) it is one
 * of N ranks on device local_rank % devices, meeting at MLART_MASTER_ADDR
 * (127.0.0.1) : MLART_MASTER_PORT (29511).  With `--dead-peer` (N >= 2) the
 * last rank leaves right after joining, and every other rank's all_gather
 * must end in an error within 90 s, not hang.  One PASS/FAIL line a check;
 * exit 0, 1 on a failure, 77 without a device or without libnccl.so.2. */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime_api.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mlart/mlart.h"
#include "nccl_rank.h"

#define BLOCK 4099 /* bytes a rank for all_gather / all_to_all: odd on purpose */
#define NF 1031    /* floats a rank for reduce_scatter_f32 */


/* Inputs that depend on the sending rank, the destination block, the index
 * and the round; reduce_scatter's are small integers, so any order of the
 * sum is exact. */
static uint8_t ag_val(int src, size_t i, int round)
{
    return (uint8_t)(src * 37 + (int)(i % 251) * 11 + round * 101 + 5);
}

static uint8_t a2a_val(int src, int dst, size_t i, int round)
{
    return (uint8_t)(src * 53 + dst * 29 + (int)(i % 241) * 3 + round * 7 + 1);
}

static float rs_val(int src, int blk, size_t i, int round)
{
    return (float)((src * 7 + blk * 3 + (int)(i % 17) + round * 5) % 17 - 8);
}

typedef struct bufs {
    uint8_t *ag_send, *ag_recv, *a2a_send, *a2a_recv; /* device */
    float *rs_send, *rs_recv;
    uint8_t *a2a_recv2; /* all_to_all_n: a2a_send again, and rs_send as bytes into rs_a2a */
    float *rs_a2a;
    uint8_t *h_ag, *h_a2a; /* host staging, size blocks */
    float *h_rs;
} bufs;

/* Fill the inputs of round `round` and clear the outputs. */
static void upload(bufs *b, int round)
{
    int R = me.size;
    for (size_t i = 0; i < BLOCK; i++)
        b->h_ag[i] = ag_val(me.rank, i, round);
    CUDA_OR_DIE(cudaMemcpy(b->ag_send, b->h_ag, BLOCK, cudaMemcpyHostToDevice));
    for (int d = 0; d < R; d++)
        for (size_t i = 0; i < BLOCK; i++)
            b->h_a2a[(size_t)d * BLOCK + i] = a2a_val(me.rank, d, i, round);
    CUDA_OR_DIE(cudaMemcpy(b->a2a_send, b->h_a2a, (size_t)R * BLOCK, cudaMemcpyHostToDevice));
    for (int k = 0; k < R; k++)
        for (size_t i = 0; i < NF; i++)
            b->h_rs[(size_t)k * NF + i] = rs_val(me.rank, k, i, round);
    CUDA_OR_DIE(cudaMemcpy(b->rs_send, b->h_rs, (size_t)R * NF * sizeof(float),
                           cudaMemcpyHostToDevice));
    CUDA_OR_DIE(cudaMemset(b->ag_recv, 0xee, (size_t)R * BLOCK));
    CUDA_OR_DIE(cudaMemset(b->a2a_recv, 0xee, (size_t)R * BLOCK));
    CUDA_OR_DIE(cudaMemset(b->rs_recv, 0xff, NF * sizeof(float)));
    CUDA_OR_DIE(cudaMemset(b->a2a_recv2, 0xee, (size_t)R * BLOCK));
    CUDA_OR_DIE(cudaMemset(b->rs_a2a, 0xff, (size_t)R * NF * sizeof(float)));
    CUDA_OR_DIE(cudaDeviceSynchronize());
}

static void report(size_t bad, size_t first, size_t total, const char *what, const char *how,
                   int round)
{
    if (bad)
        check(0, "%s %s, round %d: %zu of %zu values wrong, the first at %zu", what, how, round,
              bad, total, first);
    else
        check(1, "%s %s, round %d: %zu values right", what, how, round, total);
}

/* Mismatches of an all-to-all's received blocks (device recv) in round
 * `round`; *first gets the index of the first one. */
static size_t a2a_bad(bufs *b, const void *recv, int round, size_t *first)
{
    size_t bad = 0;
    CUDA_OR_DIE(cudaMemcpy(b->h_a2a, recv, (size_t)me.size * BLOCK, cudaMemcpyDeviceToHost));
    for (int s = 0; s < me.size; s++)
        for (size_t i = 0; i < BLOCK; i++)
            if (b->h_a2a[(size_t)s * BLOCK + i] != a2a_val(s, me.rank, i, round) && !bad++)
                *first = (size_t)s * BLOCK + i;
    return bad;
}

/* Compare the outputs of round `round` with the host's results. */
static void verify(bufs *b, int round, const char *how)
{
    int R = me.size;
    size_t bad = 0, first = 0;
    CUDA_OR_DIE(cudaMemcpy(b->h_ag, b->ag_recv, (size_t)R * BLOCK, cudaMemcpyDeviceToHost));
    for (int s = 0; s < R; s++)
        for (size_t i = 0; i < BLOCK; i++)
            if (b->h_ag[(size_t)s * BLOCK + i] != ag_val(s, i, round) && !bad++)
                first = (size_t)s * BLOCK + i;
    report(bad, first, (size_t)R * BLOCK, "all_gather", how, round);

    first = 0;
    bad = a2a_bad(b, b->a2a_recv, round, &first);
    report(bad, first, (size_t)R * BLOCK, "all_to_all", how, round);

    bad = first = 0;
    CUDA_OR_DIE(cudaMemcpy(b->h_rs, b->rs_recv, NF * sizeof(float), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < NF; i++) {
        float want = 0.0f;
        for (int s = 0; s < R; s++)
            want += rs_val(s, me.rank, i, round);
        if (b->h_rs[i] != want && !bad++)
            first = i;
    }
    report(bad, first, NF, "reduce_scatter_f32", how, round);

    /* all_to_all_n: the same blocks again, and every rank's reduce-scatter
     * inputs block by block, in one operation */
    first = 0;
    bad = a2a_bad(b, b->a2a_recv2, round, &first);
    CUDA_OR_DIE(cudaMemcpy(b->h_rs, b->rs_a2a, (size_t)R * NF * sizeof(float),
                           cudaMemcpyDeviceToHost));
    for (int s = 0; s < R; s++)
        for (size_t i = 0; i < NF; i++)
            if (b->h_rs[(size_t)s * NF + i] != rs_val(s, me.rank, i, round) && !bad++)
                first = (size_t)R * BLOCK + (size_t)s * NF + i;
    report(bad, first, (size_t)R * (BLOCK + NF), "all_to_all_n (2 arrays)", how, round);
}

static int collectives(mlart_comm *c, bufs *b, cudaStream_t s)
{
    int rc;
    if ((rc = mlart_comm_all_gather(c, b->ag_send, b->ag_recv, BLOCK, s)) < 0 ||
        (rc = mlart_comm_all_to_all(c, b->a2a_send, b->a2a_recv, BLOCK, s)) < 0 ||
        (rc = mlart_comm_reduce_scatter_f32(c, b->rs_send, b->rs_recv, NF, s)) < 0)
        check(0, "collective: %s: %s", mlart_status_name(rc), mlart_last_error());
    if (rc == 0) {
        const void *send[2] = {b->a2a_send, b->rs_send};
        void *recv[2] = {b->a2a_recv2, b->rs_a2a};
        const size_t bytes[2] = {BLOCK, NF * sizeof(float)};
        if ((rc = mlart_comm_all_to_all_n(c, 2, send, recv, bytes, s)) < 0)
            check(0, "all_to_all_n: %s: %s", mlart_status_name(rc), mlart_last_error());
    }
    return rc;
}

/* The local group on this device: a collective's copies have ended when it
 * returns (its promise that recv is written and the peers' buffers free,
 * whatever stream the caller uses next).  A device-to-device cudaMemcpy
 * returns before its copy ends (0.03 ms for 4 GiB on the H200): before the
 * fix, an event recorded on the default stream right after a 1 GiB
 * all_gather was not yet complete. */
static void local_copies_end(int dev)
{
    const size_t n = (size_t)1 << 30;
    mlart_comm_group *g = NULL;
    mlart_comm *lc = NULL;
    void *send = NULL, *recv = NULL;
    cudaEvent_t ev;
    cudaError_t q;
    int rc;
    if (mlart_comm_group_create(1, dev, 10000, &g) < 0 || mlart_comm_local_create(g, 0, &lc) < 0) {
        check(0, "local group on device %d: %s", dev, mlart_last_error());
        return;
    }
    CUDA_OR_DIE(cudaMalloc(&send, n));
    CUDA_OR_DIE(cudaMalloc(&recv, n));
    CUDA_OR_DIE(cudaMemset(send, 0x5a, n));
    CUDA_OR_DIE(cudaDeviceSynchronize());
    CUDA_OR_DIE(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    rc = mlart_comm_all_gather(lc, send, recv, n, NULL);
    CUDA_OR_DIE(cudaEventRecord(ev, 0));
    q = cudaEventQuery(ev);
    check(rc == 0 && q == cudaSuccess, "local all_gather of 1 GiB: returned %d, its copy %s on "
          "return", rc, q == cudaSuccess ? "ended" : "still running");
    CUDA_OR_DIE(cudaDeviceSynchronize());
    CUDA_OR_DIE(cudaEventDestroy(ev));
    cudaFree(send);
    cudaFree(recv);
    mlart_comm_destroy(lc);
    mlart_comm_group_destroy(g);
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void nap_ms(long ms)
{
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* A host function that holds its stream until `held` is cleared, and the
 * thread that clears it: ncclCommAbort may wait for the device, so the
 * stream must be released by someone other than the waiting thread. */
static atomic_int held;

static void CUDART_CB hold_stream(void *arg)
{
    (void)arg;
    while (atomic_load(&held))
        nap_ms(1);
}

static void *release_later(void *arg)
{
    nap_ms(*(const long *)arg);
    atomic_store(&held, 0);
    return NULL;
}

/* Hold `stream` for *release_ms (a host function, released by thread *th,
 * which the caller joins) and call mlart_comm_wait with deadline_ms;
 * *waited gets its seconds. */
static int wait_on_held(mlart_comm *c, cudaStream_t stream, const long *release_ms,
                        int deadline_ms, pthread_t *th, double *waited)
{
    double t0;
    int rc;
    atomic_store(&held, 1);
    CUDA_OR_DIE(cudaLaunchHostFunc(stream, hold_stream, NULL));
    if (pthread_create(th, NULL, release_later, (void *)release_ms) != 0) {
        check(0, "pthread_create");
        exit(1);
    }
    t0 = now_s();
    rc = mlart_comm_wait(c, stream, deadline_ms);
    *waited = now_s() - t0;
    return rc;
}

/* A stream that does not drain within the wait's deadline: MLART_ETIMEDOUT,
 * the communicator aborted (the message says so), and then every collective
 * and wait refused at once with MLART_ECOMM.  ncclCommAbort returns once
 * the device has drained, so the wait ends when the host function lets go
 * (1.5 s on the H200 with NCCL 2.28), not at its deadline: held by work
 * that is not NCCL's, only the release bounds it.  Leaves the communicator
 * aborted: run it last. */
static void stalled_stream(mlart_comm *comm, bufs *b, cudaStream_t stream)
{
    const int deadline_ms = 300;
    const long release_ms = 1500;
    pthread_t th;
    double t0, waited, refused;
    int rc, rc2, rc3;
    rc = wait_on_held(comm, stream, &release_ms, deadline_ms, &th, &waited);
    check(rc == MLART_ETIMEDOUT && waited >= 0.9 * deadline_ms / 1e3 &&
              waited < release_ms / 1e3 + 8.0 &&
              strstr(mlart_last_error(), "did not end within 300 ms") &&
              strstr(mlart_last_error(), "aborted"),
          "a stream held %ld ms, waited for at most %d ms: %s after %.3f s (%s)", release_ms,
          deadline_ms, mlart_status_name(rc), waited, mlart_last_error());
    t0 = now_s();
    rc = mlart_comm_all_gather(comm, b->ag_send, b->ag_recv, BLOCK, stream);
    rc2 = mlart_comm_reduce_scatter_f32(comm, b->rs_send, b->rs_recv, NF, stream);
    rc3 = mlart_comm_wait(comm, stream, 0);
    refused = now_s() - t0;
    check(rc == MLART_ECOMM && rc2 == MLART_ECOMM && rc3 == MLART_ECOMM && refused < 0.1 &&
              strstr(mlart_last_error(), "was aborted"),
          "after the abort: all_gather %s, reduce_scatter %s, wait %s in %.4f s (%s)",
          mlart_status_name(rc), mlart_status_name(rc2), mlart_status_name(rc3), refused,
          mlart_last_error());
    pthread_join(th, NULL);
    CUDA_OR_DIE(cudaStreamSynchronize(stream));
}

/* A local group on this device: mlart_comm_wait waits for the stream
 * against the deadline (MLART_ETIMEDOUT for a held one) and leaves the
 * group as it was (the next collective works). */
static void local_wait(int dev, cudaStream_t stream)
{
    const long release_ms = 800;
    mlart_comm_group *g = NULL;
    mlart_comm *lc = NULL;
    uint8_t *buf = NULL, h[64];
    pthread_t th;
    double waited;
    int rc, rc2;
    if (mlart_comm_group_create(1, dev, 10000, &g) < 0 || mlart_comm_local_create(g, 0, &lc) < 0) {
        check(0, "local group on device %d: %s", dev, mlart_last_error());
        return;
    }
    CUDA_OR_DIE(cudaMalloc((void **)&buf, 128));
    CUDA_OR_DIE(cudaMemset(buf, 0x3c, 64));
    rc = mlart_comm_wait(lc, stream, 0);
    check(rc == 0, "local group, a stream with nothing held: mlart_comm_wait %s",
          mlart_status_name(rc));
    rc = wait_on_held(lc, stream, &release_ms, 200, &th, &waited);
    check(rc == MLART_ETIMEDOUT && waited >= 0.18 && waited < 5.0 &&
              strstr(mlart_last_error(), "local communicator rank 0 of 1"),
          "local group, a stream held %ld ms, waited for at most 200 ms: %s after %.3f s (%s)",
          release_ms, mlart_status_name(rc), waited, mlart_last_error());
    pthread_join(th, NULL);
    rc = mlart_comm_wait(lc, stream, 0);
    rc2 = mlart_comm_all_gather(lc, buf, buf + 64, 64, stream);
    CUDA_OR_DIE(cudaMemcpy(h, buf + 64, 64, cudaMemcpyDeviceToHost));
    check(rc == 0 && rc2 == 0 && h[0] == 0x3c && h[63] == 0x3c,
          "local group after the timeout: wait %s, all_gather %s, received 0x%02x..0x%02x",
          mlart_status_name(rc), mlart_status_name(rc2), h[0], h[63]);
    cudaFree(buf);
    mlart_comm_destroy(lc);
    mlart_comm_group_destroy(g);
}

/* --dead-peer: the last rank leaves without a word; the others' all_gather
 * with it must end in MLART_ECOMM or MLART_ETIMEDOUT (from the call or from
 * the wait), not hang. */
static int dead_peer(mlart_comm *comm, bufs *b, cudaStream_t stream)
{
    double t0;
    int rc;
    if (me.size < 2) {
        printf("SKIP: --dead-peer needs at least two ranks\n");
        return 77;
    }
    if (me.rank == me.size - 1) {
        printf("rank %d of %d: leaving without a word\n", me.rank, me.size);
        fflush(stdout);
        _exit(0);
    }
    nap_ms(500);
    t0 = now_s();
    rc = mlart_comm_all_gather(comm, b->ag_send, b->ag_recv, BLOCK, stream);
    if (rc == 0)
        rc = mlart_comm_wait(comm, stream, 20000);
    check((rc == MLART_ECOMM || rc == MLART_ETIMEDOUT) && now_s() - t0 < 90.0,
          "all_gather with a rank gone: %s after %.1f s (%s)", mlart_status_name(rc),
          now_s() - t0, rc ? mlart_last_error() : "");
    mlart_comm_destroy(comm);
    printf("%s: rank %d of %d, %d failure%s\n", failures ? "FAIL" : "PASS", me.rank, me.size,
           failures, failures == 1 ? "" : "s");
    return failures ? 1 : 0;
}

int main(int argc, char **argv)
{
    mlart_comm *comm = NULL;
    cudaStream_t stream;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    bufs b;
    int device, rc;
    if ((rc = nccl_rank_join(29511, &me, &device, &comm)) != 0)
        return rc;
    check(1, "mlart_comm_nccl_join: MLART_OK");
    check(!strcmp(mlart_comm_kind(comm), "nccl") && mlart_comm_graph_safe(comm) == 1 &&
              mlart_comm_rank(comm) == me.rank && mlart_comm_size(comm) == me.size &&
              mlart_comm_device(comm) == device,
          "communicator says kind %s, graph_safe %d, rank %d of %d, device %d",
          mlart_comm_kind(comm), mlart_comm_graph_safe(comm), mlart_comm_rank(comm),
          mlart_comm_size(comm), mlart_comm_device(comm));

    memset(&b, 0, sizeof b);
    CUDA_OR_DIE(cudaSetDevice(device));
    CUDA_OR_DIE(cudaMalloc((void **)&b.ag_send, BLOCK));
    CUDA_OR_DIE(cudaMalloc((void **)&b.ag_recv, (size_t)me.size * BLOCK));
    CUDA_OR_DIE(cudaMalloc((void **)&b.a2a_send, (size_t)me.size * BLOCK));
    CUDA_OR_DIE(cudaMalloc((void **)&b.a2a_recv, (size_t)me.size * BLOCK));
    CUDA_OR_DIE(cudaMalloc((void **)&b.rs_send, (size_t)me.size * NF * sizeof(float)));
    CUDA_OR_DIE(cudaMalloc((void **)&b.rs_recv, NF * sizeof(float)));
    CUDA_OR_DIE(cudaMalloc((void **)&b.a2a_recv2, (size_t)me.size * BLOCK));
    CUDA_OR_DIE(cudaMalloc((void **)&b.rs_a2a, (size_t)me.size * NF * sizeof(float)));
    b.h_ag = malloc((size_t)me.size * BLOCK);
    b.h_a2a = malloc((size_t)me.size * BLOCK);
    b.h_rs = malloc((size_t)me.size * NF * sizeof(float));
    if (!b.h_ag || !b.h_a2a || !b.h_rs) {
        check(0, "out of host memory");
        return 1;
    }
    CUDA_OR_DIE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    if (argc > 1 && !strcmp(argv[1], "--dead-peer"))
        return dead_peer(comm, &b, stream);
    local_copies_end(device);
    local_wait(device, stream);

    /* called directly, on the default stream then on our own */
    upload(&b, 0);
    if (collectives(comm, &b, NULL) == 0) {
        CUDA_OR_DIE(cudaDeviceSynchronize());
        verify(&b, 0, "on the default stream");
    }
    upload(&b, 1);
    if (collectives(comm, &b, stream) == 0) {
        rc = mlart_comm_wait(comm, stream, 0);
        check(rc == 0, "mlart_comm_wait after the collectives: %s", rc ? mlart_last_error() : "0");
        verify(&b, 1, "on a stream");
    }

    /* captured once, replayed twice with new inputs */
    CUDA_OR_DIE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    rc = collectives(comm, &b, stream);
    {
        cudaError_t e = cudaStreamEndCapture(stream, &graph);
        check(rc == 0 && e == cudaSuccess, "capture of the three collectives: %s",
              e == cudaSuccess ? "ok" : cudaGetErrorString(e));
        if (rc || e != cudaSuccess)
            return 1;
    }
    CUDA_OR_DIE(cudaGraphInstantiateWithFlags(&exec, graph, 0));
    for (int round = 2; round < 4; round++) {
        upload(&b, round);
        CUDA_OR_DIE(cudaGraphLaunch(exec, stream));
        rc = mlart_comm_wait(comm, stream, 0);
        check(rc == 0, "mlart_comm_wait after a replay: %s", rc ? mlart_last_error() : "0");
        verify(&b, round, "in a graph replay");
    }
    CUDA_OR_DIE(cudaGraphExecDestroy(exec));
    CUDA_OR_DIE(cudaGraphDestroy(graph));
    stalled_stream(comm, &b, stream);

    mlart_comm_destroy(comm);
    CUDA_OR_DIE(cudaStreamDestroy(stream));
    cudaFree(b.ag_send);
    cudaFree(b.ag_recv);
    cudaFree(b.a2a_send);
    cudaFree(b.a2a_recv);
    cudaFree(b.rs_send);
    cudaFree(b.rs_recv);
    cudaFree(b.a2a_recv2);
    cudaFree(b.rs_a2a);
    free(b.h_ag);
    free(b.h_a2a);
    free(b.h_rs);
    printf("%s: rank %d of %d, %d failure%s\n", failures ? "FAIL" : "PASS", me.rank, me.size,
           failures, failures == 1 ? "" : "s");
    return failures ? 1 : 0;
}
