/* Kernels for the programmatic-dependent-launch tests: see pdl_probe.h. */
#include "pdl_probe.h"

#include <stdlib.h>

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
    cudaLaunchConfig_t lc;
    cudaLaunchAttribute at[1];
    if (bytes % 16)
        return (int)cudaErrorInvalidValue;
    lc.gridDim = dim3(8);
    lc.blockDim = dim3(256);
    lc.dynamicSmemBytes = 0;
    lc.stream = st;
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    lc.attrs = at;
    lc.numAttrs = 1;
    return (int)cudaLaunchKernelEx(&lc, nowait_copy_kernel, (uint4 *)dst, (const uint4 *)src, bytes / 16);
}

extern "C" int pdl_control(cudaStream_t st, int graph)
{
    const size_t bytes = (size_t)1 << 20;
    unsigned char *dst = nullptr, *src = nullptr, *probe = nullptr, *h = nullptr;
    cudaGraph_t g = nullptr;
    cudaGraphExec_t ge = nullptr;
    cudaError_t e;
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
