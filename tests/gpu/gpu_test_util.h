/* What every GPU test shares: the device count asked without touching CUDA
 * in the calling process, the seed (MLART_SEED or the clock), a xorshift
 * generator, the CUDA-call assertion and the start of main() (its end:
 * check_run.h). */
#ifndef MLART_TESTS_GPU_TEST_UTIL_H
#define MLART_TESTS_GPU_TEST_UTIL_H

#include <check.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check_run.h"

#define GPU_CUDA(stmt)                                                                             \
    do {                                                                                           \
        cudaError_t e_ = (stmt);                                                                   \
        ck_assert_msg(e_ == cudaSuccess, "%s: %s", #stmt, cudaGetErrorString(e_));                 \
    } while (0)

/* Number of CUDA devices, asked in a child process: a process that has
 * initialised CUDA cannot use it in the children that Check forks. */
static inline int gpu_count(void)
{
    int status = 0;
    pid_t pid = fork();
    if (pid == 0) {
        int n = 0;
        if (cudaGetDeviceCount(&n) != cudaSuccess)
            n = 0;
        _exit(n > 100 ? 100 : n);
    }
    if (pid < 0 || waitpid(pid, &status, 0) < 0 || !WIFEXITED(status))
        return 0;
    return WEXITSTATUS(status);
}

/* Seed from MLART_SEED or the clock; printed by the caller. */
static inline uint64_t gpu_seed(void)
{
    const char *s = getenv("MLART_SEED");
    if (s && *s)
        return strtoull(s, NULL, 0);
    return (uint64_t)time(NULL) * 2654435761u ^ (uint64_t)getpid();
}

static inline uint64_t gpu_rand(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *s = x;
    return x;
}

/* The start of a GPU test's main(): 77 (skipped) without a device, else 0
 * with *seed set and printed. */
static inline int gpu_test_begin(const char *name, uint64_t *seed)
{
    if (gpu_count() < 1) {
        printf("%s: no CUDA device, skipped\n", name);
        return 77;
    }
    *seed = gpu_seed();
    printf("%s: seed %#llx (set MLART_SEED to repeat)\n", name, (unsigned long long)*seed);
    return 0;
}

#endif
