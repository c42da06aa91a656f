/* The rank of a GPU test run alone or under a launcher, its PASS/FAIL
 * lines, and its NCCL communicator: rank and size from mlart_rank_from_env (alone: 0 of 1),
 * device local_rank % devices, rendezvous at MLART_MASTER_ADDR (127.0.0.1)
 * : MLART_MASTER_PORT (the test's default).  nccl_rank_join returns 0, or
 * the exit status the test should end with: 77 without a device or without
 * libnccl.so.2, 1 on any other failure (after printing why). */
#ifndef MLART_TESTS_GPU_NCCL_RANK_H
#define MLART_TESTS_GPU_NCCL_RANK_H

#include <cuda_runtime_api.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mlart/mlart.h"
#include "mlart/rendezvous.h"

static int failures;
static mlart_rank_info me;

/* One PASS/FAIL line, naming the rank. */
static void check(int ok, const char *fmt, ...)
{
    va_list ap;
    printf("%s: rank %d of %d: ", ok ? "PASS" : "FAIL", me.rank, me.size);
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    putchar('\n');
    fflush(stdout);
    failures += !ok;
}

#define CUDA_OR_DIE(call)                                                                     \
    do {                                                                                      \
        cudaError_t e_ = (call);                                                              \
        if (e_ != cudaSuccess) {                                                              \
            check(0, "%s: %s", #call, cudaGetErrorString(e_));                                \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

static inline int nccl_rank_join(long port, mlart_rank_info *who, int *device, mlart_comm **comm)
{
    const char *addr = getenv("MLART_MASTER_ADDR"), *port_s = getenv("MLART_MASTER_PORT");
    int ndev = 0, rc;
    if (mlart_cuda_device_count(&ndev) < 0 || ndev == 0) {
        printf("SKIP: no CUDA device (%s)\n", mlart_last_error());
        return 77;
    }
    if (mlart_rank_from_env(who) < 0) {
        printf("FAIL: %s\n", mlart_last_error());
        return 1;
    }
    if (port_s) {
        char *end;
        errno = 0;
        port = strtol(port_s, &end, 10);
        if (end == port_s || *end || errno || port < 1 || port > 65535) {
            printf("FAIL: MLART_MASTER_PORT='%s' is not a port\n", port_s);
            return 1;
        }
    }
    if (!addr || !*addr)
        addr = "127.0.0.1";
    *device = who->local_rank % ndev;
    printf("rank %d of %d (%s), local rank %d, device %d of %d, rendezvous %s:%ld\n", who->rank,
           who->size, who->source[0] ? who->source : "no launcher", who->local_rank, *device, ndev,
           addr, port);
    rc = mlart_comm_nccl_join(who->rank, who->size, *device, addr, (int)port, 60000, comm);
    if (rc == MLART_ECOMM && strstr(mlart_last_error(), "cannot be opened")) {
        printf("SKIP: %s\n", mlart_last_error());
        return 77;
    }
    if (rc < 0) {
        printf("FAIL: rank %d of %d: mlart_comm_nccl_join: %s: %s\n", who->rank, who->size,
               mlart_status_name(rc), mlart_last_error());
        return 1;
    }
    return 0;
}

#endif
