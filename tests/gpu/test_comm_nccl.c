/* The NCCL communicator on CUDA devices: all_gather, all_to_all,
 * reduce_scatter_f32 and a two-array all_to_all_n against results computed
 * on the host, first called
 * directly, then captured in a CUDA graph on a non-default stream and
 * replayed twice with new inputs.  Alone it is rank 0 of 1; under
 * `mpirun -np N` (or any launcher mlart_rank_from_env knows) it is one of N
 * ranks on device local_rank % devices, meeting at MLART_MASTER_ADDR
 * (127.0.0.1) : MLART_MASTER_PORT (29511).  One PASS/FAIL line a check;
 * exit 0, 1 on a failure, 77 without a device or without libnccl.so.2. */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime_api.h>
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

int main(void)
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
    local_copies_end(device);

    /* called directly, on the default stream then on our own */
    upload(&b, 0);
    if (collectives(comm, &b, NULL) == 0) {
        CUDA_OR_DIE(cudaDeviceSynchronize());
        verify(&b, 0, "on the default stream");
    }
    upload(&b, 1);
    if (collectives(comm, &b, stream) == 0) {
        CUDA_OR_DIE(cudaStreamSynchronize(stream));
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
        CUDA_OR_DIE(cudaStreamSynchronize(stream));
        verify(&b, round, "in a graph replay");
    }
    CUDA_OR_DIE(cudaGraphExecDestroy(exec));
    CUDA_OR_DIE(cudaGraphDestroy(graph));

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
