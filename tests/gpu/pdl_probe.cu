/* Kernels for the programmatic-dependent-launch tests: see pdl_probe.h. */
#include "pdl_probe.h"

#include "runtime/cuda_launch.h"

#include <stdlib.h>
#include <string.h>

namespace {

__device__ __forceinline__ unsigned long long now_ns()
{
    unsigned long long v;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(v));
    return v;
}

__global__ void late_copy_kernel(uint4 *dst, const uint4 *src, size_t n, unsigned long long spin_ns)
{
    /* every block triggers at once: the dependent grid may start now */
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const unsigned long long t0 = now_ns();
    while (now_ns() - t0 < spin_ns) {
    }
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

__global__ void nowait_copy_kernel(uint4 *dst, const uint4 *src, size_t n)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __ldcg(src + i);
}

/* A careless dependent of two writers: copies a -> pa and k -> pk without
 * waiting. */
__global__ void nowait_copy2_kernel(uint4 *pa, const uint4 *a, uint4 *pk, const uint4 *k, size_t n)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        pa[i] = __ldcg(a + i);
        pk[i] = __ldcg(k + i);
    }
}

} // namespace

extern "C" int pdl_late_copy(void *dst, const void *src, size_t bytes, unsigned spin_us, cudaStream_t st)
{
    if (bytes % 16)
        return (int)cudaErrorInvalidValue;
    late_copy_kernel<<<8, 256, 0, st>>>((uint4 *)dst, (const uint4 *)src, bytes / 16,
                                        (unsigned long long)spin_us * 1000ull);
    return (int)cudaGetLastError();
}

extern "C" int pdl_nowait_copy(void *dst, const void *src, size_t bytes, cudaStream_t st)
{
    cudaLaunchAttribute at[1];
    if (bytes % 16)
        return (int)cudaErrorInvalidValue;
    const cudaLaunchConfig_t lc = mlart_launch_cfg(dim3(8), dim3(256), 0, st, 1, at);
    return (int)cudaLaunchKernelEx(&lc, nowait_copy_kernel, (uint4 *)dst, (const uint4 *)src, bytes / 16);
}

extern "C" int pdl_control(cudaStream_t st, int graph)
{
    const size_t bytes = (size_t)1 << 20;
    unsigned char *dst = nullptr, *src = nullptr, *probe = nullptr, *h = nullptr;
    cudaGraph_t g = nullptr;
    cudaGraphExec_t ge = nullptr;
    cudaError_t e = cudaSuccess;
    int result = -1;
    h = (unsigned char *)malloc(bytes);
    if (!h)
        return -1;
    if ((e = cudaMalloc(&dst, bytes)) || (e = cudaMalloc(&src, bytes)) || (e = cudaMalloc(&probe, bytes)) ||
        (e = cudaMemsetAsync(dst, 0x00, bytes, st)) || (e = cudaMemsetAsync(src, 0x11, bytes, st)) ||
        (e = cudaMemsetAsync(probe, 0x22, bytes, st)) || (e = cudaStreamSynchronize(st)))
        goto out;
    if (graph && (e = cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal)))
        goto out;
    if ((e = (cudaError_t)pdl_late_copy(dst, src, bytes, 200, st)) ||
        (e = (cudaError_t)pdl_nowait_copy(probe, dst, bytes, st)))
        goto out;
    if (graph && ((e = cudaStreamEndCapture(st, &g)) || (e = cudaGraphInstantiate(&ge, g, 0)) ||
                  (e = cudaGraphLaunch(ge, st))))
        goto out;
    if ((e = cudaStreamSynchronize(st)) || (e = cudaMemcpy(h, probe, bytes, cudaMemcpyDeviceToHost)))
        goto out;
    result = 0;
    for (size_t i = 0; i < bytes; i++)
        if (h[i] == 0x00) {
            result = 1; /* some of the old bytes were read: it started early */
            break;
        }
out:
    if (e != cudaSuccess)
        result = -1;
    if (ge)
        cudaGraphExecDestroy(ge);
    if (g)
        cudaGraphDestroy(g);
    cudaFree(dst);
    cudaFree(src);
    cudaFree(probe);
    free(h);
    return result;
}

extern "C" int pdl_fork_join(cudaStream_t st, int graph, unsigned spin_main_us, unsigned spin_side_us,
                             int *early_main, int *early_side, int *prog_edges)
{
    cudaGraphNode_t a_node = nullptr;
    const size_t bytes = (size_t)1 << 20;
    unsigned char *buf = nullptr, *h = nullptr;
    cudaStream_t side = nullptr;
    cudaEvent_t fork = nullptr, join = nullptr;
    cudaGraph_t g = nullptr;
    cudaGraphExec_t ge = nullptr;
    cudaLaunchConfig_t lc;
    cudaLaunchAttribute at[1];
    cudaError_t e = cudaSuccess;
    int result = -1;
    unsigned char *a, *ka, *k, *kk, *pa, *pk;
    h = (unsigned char *)malloc(2 * bytes);
    if (!h)
        return -1;
    if ((e = cudaMalloc(&buf, 6 * bytes)) || (e = cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking)) ||
        (e = cudaEventCreateWithFlags(&fork, cudaEventDisableTiming)) ||
        (e = cudaEventCreateWithFlags(&join, cudaEventDisableTiming)))
        goto out;
    a = buf, ka = buf + bytes, k = buf + 2 * bytes, kk = buf + 3 * bytes, pa = buf + 4 * bytes,
    pk = buf + 5 * bytes;
    if ((e = cudaMemsetAsync(a, 0x00, bytes, st)) || (e = cudaMemsetAsync(ka, 0x11, bytes, st)) ||
        (e = cudaMemsetAsync(k, 0x00, bytes, st)) || (e = cudaMemsetAsync(kk, 0x11, bytes, st)) ||
        (e = cudaMemsetAsync(pa, 0x22, 2 * bytes, st)) || (e = cudaStreamSynchronize(st)))
        goto out;
    if (graph && (e = cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal)))
        goto out;
    /* fork: the side writer runs beside the main one; join before the
     * dependent, which is launched with PDL after the main writer */
    if ((e = cudaEventRecord(fork, st)) || (e = cudaStreamWaitEvent(side, fork, 0)) ||
        (e = (cudaError_t)pdl_late_copy(k, kk, bytes, spin_side_us, side)) || (e = cudaEventRecord(join, side)) ||
        (e = (cudaError_t)pdl_late_copy(a, ka, bytes, spin_main_us, st)))
        goto out;
    if (graph == 2) { /* the node just captured on st: the main writer */
        const cudaGraphNode_t *deps = nullptr;
        size_t n = 0;
        cudaStreamCaptureStatus cs;
        if ((e = cudaStreamGetCaptureInfo(st, &cs, nullptr, nullptr, &deps, nullptr, &n)))
            goto out;
        if (n != 1) {
            e = cudaErrorInvalidValue;
            goto out;
        }
        a_node = deps[0];
    }
    if ((e = cudaStreamWaitEvent(st, join, 0)))
        goto out;
    if (graph == 2) { /* the edge from the main writer programmatic, the join's a full one */
        const cudaGraphNode_t *deps = nullptr;
        cudaGraphNode_t nodes[8];
        cudaGraphEdgeData ed[8];
        size_t n = 0;
        cudaStreamCaptureStatus cs;
        if ((e = cudaStreamGetCaptureInfo(st, &cs, nullptr, nullptr, &deps, nullptr, &n)))
            goto out;
        if (n < 1 || n > 8) {
            e = cudaErrorInvalidValue;
            goto out;
        }
        for (size_t i = 0; i < n; i++) {
            nodes[i] = deps[i];
            memset(&ed[i], 0, sizeof ed[i]);
            if (deps[i] == a_node) {
                ed[i].from_port = cudaGraphKernelNodePortProgrammatic;
                ed[i].type = cudaGraphDependencyTypeProgrammatic;
            }
        }
        if ((e = cudaStreamUpdateCaptureDependencies(st, nodes, ed, n, cudaStreamSetCaptureDependencies)))
            goto out;
    }
    lc = mlart_launch_cfg(dim3(8), dim3(256), 0, st, graph != 2, at); /* 2: the edges say it */
    if ((e = cudaLaunchKernelEx(&lc, nowait_copy2_kernel, (uint4 *)pa, (const uint4 *)a, (uint4 *)pk,
                                (const uint4 *)k, bytes / 16)))
        goto out;
    if (graph && ((e = cudaStreamEndCapture(st, &g)) || (e = cudaGraphInstantiate(&ge, g, 0)) ||
                  (e = cudaGraphLaunch(ge, st))))
        goto out;
    *prog_edges = 0;
    if (g) {
        cudaGraphNode_t from[16], to[16];
        cudaGraphEdgeData ed[16];
        size_t n = 16;
        if ((e = cudaGraphGetEdges(g, from, to, ed, &n)))
            goto out;
        for (size_t i = 0; i < n && i < 16; i++)
            *prog_edges += ed[i].type == cudaGraphDependencyTypeProgrammatic;
    }
    if ((e = cudaStreamSynchronize(st)) || (e = cudaMemcpy(h, pa, 2 * bytes, cudaMemcpyDeviceToHost)))
        goto out;
    *early_main = *early_side = 0;
    for (size_t i = 0; i < bytes; i++) {
        *early_main |= h[i] == 0x00;
        *early_side |= h[bytes + i] == 0x00;
    }
    result = 0;
out:
    if (e != cudaSuccess)
        result = -1;
    if (graph && !g && st) { /* a failed capture: end it */
        cudaGraph_t dead = nullptr;
        cudaStreamEndCapture(st, &dead);
        if (dead)
            cudaGraphDestroy(dead);
    }
    if (ge)
        cudaGraphExecDestroy(ge);
    if (g)
        cudaGraphDestroy(g);
    if (fork)
        cudaEventDestroy(fork);
    if (join)
        cudaEventDestroy(join);
    if (side)
        cudaStreamDestroy(side);
    cudaFree(buf);
    free(h);
    return result;
}
