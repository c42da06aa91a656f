/* The b12x kernels' fp8_ds_mla dequantisation (e4m3 x tile scale -> bf16,
 * b12x_common.cuh) and the KV write's quantisation (f32 -> e4m3,
 * ops/e4m3_cuda.cuh) run on the device for the GPU tests, so they can
 * check them value by value against the host numerics (ops/numerics.h). */
#ifndef MLART_TESTS_FP8_PROBE_H
#define MLART_TESTS_FP8_PROBE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* n pieces of 16 e4m3 bytes (host memory, 16 * n bytes), piece i times
 * scales[i] -> out[16 * i .. 16 * i + 15] (bf16 bits, host memory).
 * Returns a cudaError_t (0 on success). */
int fp8_probe_dequant(const uint8_t *pieces, const float *scales, int n, uint16_t *out);

/* The KV write's f32 -> e4m3 conversion (ops/e4m3_cuda.cuh) of in[0..n)
 * on the device into out (host memory).  Returns a cudaError_t. */
int fp8_probe_quant(const float *in, size_t n, uint8_t *out);

#ifdef __cplusplus
}
#endif

#endif
