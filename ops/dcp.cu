/* Decode-context parallel ops on CUDA (ops/ops.h): the formulas of the twins
 * in ops/dcp_cpu.c, the sums in the same order (the device's expf and logf
 * may differ from the host's in the last bits; translate is exact).
 * Plain launches, one thread an element or a row: these move a step's
 * partial outputs once (kilobytes to a few MiB) and are not tuned.  The
 * kernels that come right before a kernel launched with programmatic
 * dependent launch in the layer's DCP step (the head gather before
 * attend(), the combine and the f32-to-bf16 copy before the V
 * up-projection) let it launch at their start: that kernel reads what
 * they write only after its griddepcontrol.wait (backend.h), and its work
 * before the wait (attend's slot rounds and first gathers, the weight
 * copies of the V up-projection) then overlaps them. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "ops/ops.h"
#include "runtime/status.h"

namespace {

/* The next kernel of the stream may launch now (no effect when it was
 * launched without programmatic dependent launch). */
__device__ __forceinline__ void let_next_start()
{
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ int32_t owner(int64_t p, int32_t size, int32_t il)
{
    return (int32_t)((p / il) % size);
}

__global__ void translate_kernel(const int32_t *idx, int64_t n, const int32_t *lens, int32_t B,
                                 int32_t rank, int32_t size, int32_t il, int32_t *idx_local,
                                 int32_t *lens_local)
{
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        int32_t p = idx[i];
        idx_local[i] = p >= 0 && owner(p, size, il) == rank
                           ? (int32_t)(p / ((int64_t)il * size) * il + p % il)
                           : -1;
    } else if (i < n + B) {
        int32_t b = (int32_t)(i - n);
        int64_t len = lens[b] < 0 ? 0 : lens[b], round = (int64_t)il * size;
        int64_t rest = len % round - (int64_t)rank * il;
        lens_local[b] = (int32_t)(len / round * il + (rest < 0 ? 0 : rest > il ? il : rest));
    }
}

__device__ __forceinline__ float bf16f(uint16_t h)
{
    return __uint_as_float((uint32_t)h << 16);
}

__device__ __forceinline__ uint16_t f2bf16(float f)
{
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* 16 bytes a thread: dst row (t, d) is src row (d, t), rows of H*C values */
__global__ void gather_heads_kernel(const uint4 *src, int32_t D, int64_t T, int64_t row16,
                                    uint4 *dst)
{
    const int64_t n = (int64_t)D * T * row16;
    let_next_start();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t k = i % row16, r = i / row16, t = r / D, d = r % D;
        dst[i] = src[(d * T + t) * row16 + k];
    }
}

/* max and sum of exp(lse - max) over D LSEs `step` apart, in the twin's order */
__device__ __forceinline__ float2 lse_stats(const float *lse, int32_t D, int64_t step)
{
    float m = -INFINITY, z = 0.0f;
    for (int32_t s = 0; s < D; s++)
        m = fmaxf(m, lse[s * step]);
    if (m != -INFINITY)
        for (int32_t s = 0; s < D; s++)
            z += expf(lse[s * step] - m);
    return make_float2(m, z);
}

/* one block a (head, token) row; threads over the columns */
__global__ void combine_kernel(const uint16_t *parts, const float *lses, int32_t D, int64_t rows,
                               int64_t L, uint16_t *out, float *lse_out)
{
    int64_t r = blockIdx.x;
    let_next_start();
    float2 mz = lse_stats(lses + r, D, rows);
    for (int64_t c = threadIdx.x; c < L; c += blockDim.x) {
        float acc = 0.0f;
        if (mz.x != -INFINITY)
            for (int32_t s = 0; s < D; s++)
                acc += expf(lses[s * rows + r] - mz.x) / mz.y * bf16f(parts[(s * rows + r) * L + c]);
        out[r * L + c] = mz.x == -INFINITY ? (uint16_t)0 : f2bf16(acc);
    }
    if (threadIdx.x == 0)
        lse_out[r] = mz.x == -INFINITY ? -INFINITY : mz.x + logf(mz.y);
}

__global__ void scale_kernel(const uint16_t *attn, const float *lse_all, int32_t D, int32_t rank,
                             int64_t H, int64_t T, int64_t L, float *scaled, float *lse_out)
{
    const int64_t rows = (int64_t)D * H * T, r = blockIdx.x;
    float2 mz = lse_stats(lse_all + r, D, rows);
    float w = mz.x == -INFINITY ? 0.0f : expf(lse_all[(int64_t)rank * rows + r] - mz.x) / mz.y;
    for (int64_t c = threadIdx.x; c < L; c += blockDim.x)
        scaled[r * L + c] = w * bf16f(attn[r * L + c]);
    if (threadIdx.x == 0 && r / T / H == rank)
        lse_out[r - (int64_t)rank * H * T] = mz.x == -INFINITY ? -INFINITY : mz.x + logf(mz.y);
}

__global__ void to_bf16_kernel(const float *in, int64_t n, uint16_t *out)
{
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    let_next_start();
    if (i < n)
        out[i] = f2bf16(in[i]);
}

int launched(const char *what)
{
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return mlart_set_error(MLART_ECUDA, "%s launch: %s", what, cudaGetErrorString(e));
    return 0;
}

unsigned blocks_for(int64_t n, unsigned threads)
{
    return (unsigned)((n + threads - 1) / threads);
}

} // namespace

int mlart_dcp_translate_cuda(const int32_t *idx, int64_t n_idx, const int32_t *seq_lens,
                             int32_t B, int32_t rank, int32_t size, int32_t interleave,
                             int32_t *idx_local, int32_t *lens_local, void *stream)
{
    /* As mlart_dcp_owner and friends: an interleave <= 0 counts as 1; a
     * size <= 1 makes every position rank 0's at its own index and every
     * rank's length the whole sequence, which the kernel gives with size
     * and interleave 1 and a rank other than 0 passed as 1 (it then owns
     * nothing, and its length is not cut). */
    if (interleave <= 0)
        interleave = 1;
    if (size <= 1) {
        size = 1;
        interleave = 1;
        rank = rank == 0 ? 0 : 1;
    }
    if (n_idx + B == 0)
        return 0;
    translate_kernel<<<blocks_for(n_idx + B, 256), 256, 0, (cudaStream_t)stream>>>(
        idx, n_idx, seq_lens, B, rank, size, interleave, idx_local, lens_local);
    return launched("dcp translate");
}

int mlart_dcp_gather_heads_cuda(const uint16_t *src, int32_t D, int64_t T, int64_t H, int64_t C,
                                uint16_t *dst, void *stream)
{
    const int64_t row16 = H * C / 8, n = (int64_t)D * T * row16;
    if (C % 8 || ((uintptr_t)src | (uintptr_t)dst) % 16)
        return mlart_set_error(MLART_EINVAL, "dcp gather_heads: C = %lld and the buffers must "
                               "give 16-byte rows", (long long)C);
    if (n == 0)
        return 0;
    gather_heads_kernel<<<blocks_for(n < 132 * 1024 ? n : 132 * 1024, 256), 256, 0,
                          (cudaStream_t)stream>>>((const uint4 *)src, D, T, row16, (uint4 *)dst);
    return launched("dcp gather_heads");
}

int mlart_dcp_combine_cuda(const uint16_t *parts, const float *lses, int32_t D, int64_t H,
                           int64_t T, int64_t L, uint16_t *out, float *lse_out, void *stream)
{
    if (H * T == 0)
        return 0;
    combine_kernel<<<(unsigned)(H * T), 128, 0, (cudaStream_t)stream>>>(parts, lses, D, H * T, L,
                                                                        out, lse_out);
    return launched("dcp combine");
}

int mlart_dcp_scale_cuda(const uint16_t *attn, const float *lse_all, int32_t D, int32_t rank,
                         int64_t H, int64_t T, int64_t L, float *scaled, float *lse_out,
                         void *stream)
{
    if (rank < 0 || rank >= D)
        return mlart_set_error(MLART_EINVAL, "dcp scale: rank %d outside [0, %d) (D ranks)",
                               (int)rank, (int)D);
    if (H * T == 0)
        return 0;
    scale_kernel<<<(unsigned)((int64_t)D * H * T), 128, 0, (cudaStream_t)stream>>>(
        attn, lse_all, D, rank, H, T, L, scaled, lse_out);
    return launched("dcp scale");
}

int mlart_f32_to_bf16_cuda(const float *in, int64_t n, uint16_t *out, void *stream)
{
    if (n == 0)
        return 0;
    to_bf16_kernel<<<blocks_for(n, 256), 256, 0, (cudaStream_t)stream>>>(in, n, out);
    return launched("f32 to bf16");
}
