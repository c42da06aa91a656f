/* Cache write on CUDA (ops/ops.h): the same bytes as mlart_kv_write_cpu.
 * Four warps a row, a warp a 128-value tile (kvw_kernel).  The fp8_ds_mla
 * encoder repeats the CPU twin's steps (ops/numerics.h) operation for
 * operation, with the same exact-power-of-two scale and the same
 * round-to-nearest-even e4m3 conversion, so the records match bit for
 * bit.
 *
 * What the host twin refuses by reading the inputs (slots outside
 * [-1, num_slots), non-finite latent values) this op cannot see without a
 * host read: out-of-range slots are skipped, and non-finite values give
 * unspecified record bytes.  Callers validate on the host when they need
 * the error.  When two rows name one slot the later row wins, as on the
 * host: a row is written only if no later row names its slot. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "ops/ops.h"
#include "runtime/cuda_launch.h"
#include "runtime/status.h"

namespace {


__device__ float kvw_bf16(uint16_t h)
{
    return __uint_as_float((uint32_t)h << 16);
}

/* mlart_f32_to_e4m3 of ops/numerics.h, line for line. */
__device__ uint8_t kvw_f32_to_e4m3(float x)
{
    uint8_t sign = signbit(x) ? 0x80 : 0;
    float a = fabsf(x);
    int e, m, E;
    if (isnan(x))
        return (uint8_t)(sign | 0x7f);
    if (a >= 464.0f)
        return (uint8_t)(sign | 0x7e);
    if (a < 0.015625f) {
        m = (int)rintf(a * 512.0f);
        return (uint8_t)(sign | m);
    }
    (void)frexpf(a, &e);
    m = (int)rintf((ldexpf(a, 1 - e) - 1.0f) * 8.0f);
    E = e + 6;
    if (m == 8) {
        m = 0;
        E++;
    }
    return (uint8_t)(sign | (E << 3) | m);
}

/* mlart_fp8_ds_mla_tile_scale of ops/numerics.h. */
__device__ float kvw_tile_scale(float amax)
{
    int e, k;
    if (!isfinite(amax))
        return __int_as_float(0x7fc00000);
    if (!(amax > 0.0f))
        return 1.0f;
    (void)frexpf(amax, &e);
    k = e - 9;
    if (ldexp(448.0, k) < (double)amax)
        k++;
    if (k < -149)
        k = -149;
    return ldexpf(1.0f, k);
}

/* Four warps a row, two rows a block.  Warp w of a row takes the 128-value
 * tiles t = w, w + 4, w + 8 of the latent part (value 128 t + lane + 32 j
 * in v[4 (t / 4) + j]) and the rope values L + 128 m + 32 w + lane (in
 * r[m]); for fp8, L % 128 == 0, so a warp's tile is whole and its scale
 * is the warp's own maximum.  TW tiles and RM rope rounds a warp at most:
 * <1, 1> takes L <= 512 and R <= 128, <3, 12> L and R up to 1536. */
constexpr int KVW_ROWS = 2;

template <int TW, int RM>
__global__ void kvw_kernel(uint8_t *__restrict__ cache, int64_t cache_row, int64_t num_slots,
                           const uint16_t *__restrict__ latent, int64_t lat_row,
                           const int32_t *__restrict__ slots, int64_t slot_stride, int64_t N, int L,
                           int R, int fp8)
{
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3;
    const int64_t n = (int64_t)blockIdx.x * KVW_ROWS + (threadIdx.x >> 7);
#if __CUDA_ARCH__ >= 900
    /* Launched with programmatic dependent launch: wait for the previous
     * kernel of the stream and its memory before reading the rows and the
     * slots or writing the cache (no global access comes before this), then
     * let the next kernel be scheduled. */
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    if (n >= N)
        return;
    /* Every load first (this warp's values, the slot, the next 32 rows'
     * slots), so a row costs one memory round trip before its writes. */
    const uint16_t *row = latent + n * lat_row;
    uint16_t v[4 * TW], r[RM];
#pragma unroll
    for (int k = 0; k < 4 * TW; k++) {
        const int i = 128 * (w + 4 * (k / 4)) + lane + 32 * (k % 4);
        v[k] = i < L ? row[i] : (uint16_t)0;
    }
#pragma unroll
    for (int m = 0; m < RM; m++) {
        const int i = 128 * m + 32 * w + lane;
        r[m] = i < R ? row[L + i] : (uint16_t)0;
    }
    const int32_t s = slots[n * slot_stride];
    const int64_t j0 = n + 1 + lane;
    const int32_t s_after = j0 < N ? slots[j0 * slot_stride] : -1;
    if (s < 0 || s >= num_slots)
        return;
    /* The later row wins: skip this one if any later row names the same
     * slot (every warp of the row finds the same answer). */
    int later = s_after == s;
    for (int64_t j = j0 + 32; j < N && !later; j += 32)
        later = slots[j * slot_stride] == s;
    if (__any_sync(0xffffffffu, later))
        return;

    uint8_t *rec = cache + (int64_t)s * cache_row;
    if (!fp8) {
        uint16_t *dst = (uint16_t *)rec;
#pragma unroll
        for (int k = 0; k < 4 * TW; k++) {
            const int i = 128 * (w + 4 * (k / 4)) + lane + 32 * (k % 4);
            if (i < L)
                dst[i] = v[k];
        }
#pragma unroll
        for (int m = 0; m < RM; m++) {
            const int i = 128 * m + 32 * w + lane;
            if (i < R)
                dst[L + i] = r[m];
        }
        return;
    }
    const int tiles = L / 128;
#pragma unroll
    for (int q = 0; q < TW; q++) {
        const int t = w + 4 * q;
        if (t >= tiles)
            break;
        float amax = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float a = fabsf(kvw_bf16(v[4 * q + j]));
            if (a > amax)
                amax = a;
        }
        for (int off = 16; off > 0; off >>= 1)
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        const float scale = kvw_tile_scale(amax);
        int e;
        (void)frexpf(scale, &e);
#pragma unroll
        for (int j = 0; j < 4; j++)
            rec[t * 128 + lane + 32 * j] = kvw_f32_to_e4m3(ldexpf(kvw_bf16(v[4 * q + j]), 1 - e));
        if (lane == 0)
            *(float *)(rec + L + 4 * t) = scale;
    }
    uint16_t *rope = (uint16_t *)(rec + L + 4 * tiles);
#pragma unroll
    for (int m = 0; m < RM; m++) {
        const int i = 128 * m + 32 * w + lane;
        if (i < R)
            rope[i] = r[m];
    }
}

} /* namespace */

extern "C" int mlart_kv_write_cuda(const mlart_geometry *g, const mlart_tensor *cache,
                                   const mlart_tensor *latent, const mlart_tensor *slots,
                                   void *stream)
{
    MLART_CHECK(mlart_kv_write_check(g, cache, latent, slots));
    if (cache->device < 0)
        return mlart_set_error(MLART_EINVAL,
                               "kv_write_cuda: cache is in host memory; use mlart_kv_write_cpu");
    const int64_t N = latent->shape[0];
    if (N == 0)
        return 0;
    /* Records hold fp32 scales and bf16 values: rows must keep their alignment. */
    if (g->kv_format == MLART_KV_FP8_DS_MLA && (((uintptr_t)cache->data | cache->stride[0]) & 3))
        return mlart_set_error(MLART_ELAYOUT,
                               "kv_write_cuda: fp8_ds_mla cache rows must be 4-byte aligned");
    if ((((uintptr_t)cache->data | cache->stride[0]) & 1) || ((uintptr_t)latent->data & 1))
        return mlart_set_error(MLART_ELAYOUT, "kv_write_cuda: rows must be 2-byte aligned");
    const unsigned blocks = (unsigned)((N + KVW_ROWS - 1) / KVW_ROWS);
    /* With programmatic dependent launch: the kernel waits before any
     * global access, so it may start while the previous kernel ends whatever
     * that kernel writes, and the next kernel may start once it is past
     * that wait. */
    cudaLaunchAttribute at[1];
    const cudaLaunchConfig_t lc =
        mlart_launch_cfg(dim3(blocks), dim3(128 * KVW_ROWS), 0, (cudaStream_t)stream, 1, at);
    if (g->kv_lora > 1536 || g->rope > 1536)
        return mlart_set_error(MLART_ENOTSUP, "kv_write_cuda: L = %d, R = %d (each at most 1536 "
                               "on CUDA)", g->kv_lora, g->rope);
    const bool small = g->kv_lora <= 512 && g->rope <= 128;
    cudaError_t e = cudaLaunchKernelEx(
        &lc, small ? kvw_kernel<1, 1> : kvw_kernel<3, 12>, (uint8_t *)cache->data,
        (int64_t)cache->stride[0], (int64_t)cache->shape[0], (const uint16_t *)latent->data,
        (int64_t)latent->stride[0], (const int32_t *)slots->data, (int64_t)slots->stride[0],
        (int64_t)N, (int)g->kv_lora, (int)g->rope, (int)(g->kv_format == MLART_KV_FP8_DS_MLA));
    if (e == cudaSuccess)
        e = cudaGetLastError();
    if (e != cudaSuccess)
        return mlart_set_error(MLART_ECUDA, "kv_write_cuda: launch: %s", cudaGetErrorString(e));
    return 0;
}
