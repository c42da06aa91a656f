/* The kernels' fp8 dequantisation on the device: see fp8_probe.h. */
#include "fp8_probe.h"

#include <cuda_runtime.h>

#include "backends/b12x_mla_sparse/b12x_common.cuh"

namespace {

__global__ void dequant_kernel(const uint4 *pieces, const float *scales, int n, uint4 *out)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        uint4 lo, hi;
        b12x::e4m3x16_to_bf16(pieces[i], scales[i], lo, hi);
        out[2 * i] = lo;
        out[2 * i + 1] = hi;
    }
}

} // namespace

extern "C" int fp8_probe_dequant(const uint8_t *pieces, const float *scales, int n, uint16_t *out)
{
    void *dp = NULL, *ds = NULL, *dout = NULL;
    cudaError_t e = cudaSuccess;
    if (n <= 0)
        return (int)cudaErrorInvalidValue;
    if ((e = cudaMalloc(&dp, (size_t)n * 16)) != cudaSuccess || (e = cudaMalloc(&ds, (size_t)n * 4)) != cudaSuccess ||
        (e = cudaMalloc(&dout, (size_t)n * 32)) != cudaSuccess)
        goto done;
    if ((e = cudaMemcpy(dp, pieces, (size_t)n * 16, cudaMemcpyHostToDevice)) != cudaSuccess ||
        (e = cudaMemcpy(ds, scales, (size_t)n * 4, cudaMemcpyHostToDevice)) != cudaSuccess ||
        (e = cudaMemset(dout, 0xff, (size_t)n * 32)) != cudaSuccess)
        goto done;
    dequant_kernel<<<(n + 127) / 128, 128>>>((const uint4 *)dp, (const float *)ds, n, (uint4 *)dout);
    if ((e = cudaGetLastError()) != cudaSuccess)
        goto done;
    e = cudaMemcpy(out, dout, (size_t)n * 32, cudaMemcpyDeviceToHost);
done:
    cudaFree(dp);
    cudaFree(ds);
    cudaFree(dout);
    return (int)e;
}
