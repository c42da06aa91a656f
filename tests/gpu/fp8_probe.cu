/* The kernels' fp8 dequantisation on the device: see fp8_probe.h. */
#include "fp8_probe.h"

#include <cuda_runtime.h>

#include "backends/b12x_mla_sparse/b12x_common.cuh"
#include "ops/e4m3_cuda.cuh"

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

__global__ void quant_kernel(const float *in, size_t n, uint8_t *out)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        out[i] = mlart_e4m3_from_f32(in[i]);
}

} // namespace

extern "C" int fp8_probe_quant(const float *in, size_t n, uint8_t *out)
{
    void *din = NULL, *dout = NULL;
    cudaError_t e;
    if ((e = cudaMalloc(&din, n * 4)) != cudaSuccess || (e = cudaMalloc(&dout, n)) != cudaSuccess ||
        (e = cudaMemcpy(din, in, n * 4, cudaMemcpyHostToDevice)) != cudaSuccess ||
        (e = cudaMemset(dout, 0x55, n)) != cudaSuccess)
        goto done;
    quant_kernel<<<1024, 256>>>((const float *)din, n, (uint8_t *)dout);
    if ((e = cudaGetLastError()) != cudaSuccess)
        goto done;
    e = cudaMemcpy(out, dout, n, cudaMemcpyDeviceToHost);
done:
    cudaFree(din);
    cudaFree(dout);
    return (int)e;
}

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
