/* Cache write on CUDA (ops/ops.h): the same bytes as mlart_kv_write_cpu.
 * Four warps a row, a warp a 128-value tile.  The fp8_ds_mla encoder
 * repeats the CPU twin's steps (ops/numerics.h): the same exact-power-of-two
 * scale, the same scaling, and the hardware's round-to-nearest-even e4m3
 * conversion, which equals the twin's for every finite float
 * (ops/e4m3_cuda.cuh), so the records match bit for bit.
 *
 * When two rows name one slot the later row wins, as on the host: a row is
 * written only if no later row names its slot.  Two kernels find those
 * rows: up to 1024 bf16 or 2048 fp8 rows (a decode step's) kvw_kernel,
 * where each row scans the slots after it (N^2 work, one launch with
 * programmatic dependent launch); above that kvw_claim_kernel, a
 * cooperative grid that claims each named slot by its last row in the
 * record's first word (linear work, three grid barriers a round).  mlart-bench --filter
 * kv_write times both: 1.1 us against 5.4 for one fp8 row, 5.6 ms against
 * 0.12 ms for 65536 (docs/PERF.md).
 *
 * What the host twin refuses by reading the inputs (slots outside
 * [-1, num_slots), non-finite latent values) this op cannot see without a
 * host read: out-of-range slots are skipped, and non-finite values give
 * unspecified record bytes.  Callers validate on the host when they need
 * the error. */
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "ops/e4m3_cuda.cuh"
#include "ops/kv_write_cuda.h"
#include "ops/ops.h"
#include "runtime/cuda_launch.h"
#include "runtime/status.h"

namespace {


__device__ float kvw_bf16(uint16_t h)
{
    return __uint_as_float((uint32_t)h << 16);
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

/* Warp w's values of row `row` into v and r (zeros past the row). */
template <int TW, int RM>
__device__ __forceinline__ void kvw_load(const uint16_t *__restrict__ row, int L, int R, int w,
                                         int lane, uint16_t (&v)[4 * TW], uint16_t (&r)[RM])
{
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
}

/* Warp w's part of record `rec` from the values kvw_load gave it. */
template <int TW, int RM>
__device__ __forceinline__ void kvw_store(uint8_t *__restrict__ rec, int L, int R, int fp8, int w,
                                          int lane, const uint16_t (&v)[4 * TW],
                                          const uint16_t (&r)[RM])
{
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
            rec[t * 128 + lane + 32 * j] = mlart_e4m3_from_f32(ldexpf(kvw_bf16(v[4 * q + j]), 1 - e));
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

/* Few rows (the decode step's): a row is written only if no later row
 * names its slot, which each row finds by scanning the slots after it,
 * so the kernel's work grows as N^2 (mlart_kv_write_cuda takes it up to
 * MLART_KVW_SCAN_MAX_* rows). */
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
    uint16_t v[4 * TW], r[RM];
    kvw_load<TW, RM>(latent + n * lat_row, L, R, w, lane, v, r);
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
    kvw_store<TW, RM>(cache + (int64_t)s * cache_row, L, R, fp8, w, lane, v, r);
}

/* Many rows: the last row naming each slot found in linear work, with the
 * first word of each named record as the claim (the record is rewritten
 * anyway).  A cooperative grid, all resident; in rounds of at most 32 rows
 * a worker (KVW_ROWS workers of four warps a block), each round:
 *   1. every named slot's claim word := 0;
 *   2. atomicMax(claim, index of the row in the round + 1);
 *   3. a row is its slot's last iff the claim holds its own index (a
 *      32-bit mask a worker, kept in registers);
 *   4. those rows write their records (the claim word with them).
 * A grid barrier between the steps: no claim is read while a record is
 * written, and a round's records are written before the next round's
 * claims, so a later round's rows win over an earlier one's. */
template <int TW, int RM>
__global__ void kvw_claim_kernel(uint8_t *__restrict__ cache, int64_t cache_row,
                                 int64_t num_slots, const uint16_t *__restrict__ latent,
                                 int64_t lat_row, const int32_t *__restrict__ slots,
                                 int64_t slot_stride, int64_t N, int L, int R, int fp8)
{
    cooperative_groups::grid_group grid = cooperative_groups::this_grid();
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3;
    const int64_t workers = (int64_t)gridDim.x * KVW_ROWS;
    const int64_t wid = (int64_t)blockIdx.x * KVW_ROWS + (threadIdx.x >> 7);
    const int64_t threads = (int64_t)gridDim.x * blockDim.x;
    const int64_t gt = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (int64_t c0 = 0; c0 < N; c0 += 32 * workers) {
        const int64_t c1 = N - c0 < 32 * workers ? N : c0 + 32 * workers;
        if (c0 > 0)
            grid.sync(); /* the previous round's records are written */
        for (int64_t n = c0 + gt; n < c1; n += threads) {
            const int32_t s = slots[n * slot_stride];
            if (s >= 0 && s < num_slots)
                *(uint32_t *)(cache + (int64_t)s * cache_row) = 0u;
        }
        grid.sync();
        for (int64_t n = c0 + gt; n < c1; n += threads) {
            const int32_t s = slots[n * slot_stride];
            if (s >= 0 && s < num_slots)
                atomicMax((unsigned int *)(cache + (int64_t)s * cache_row),
                          (unsigned int)(n - c0 + 1));
        }
        grid.sync();
        /* lane k of each warp of a worker tests the worker's k-th row */
        const int64_t nk = c0 + wid + lane * workers;
        int last = 0;
        if (nk < c1) {
            const int32_t s = slots[nk * slot_stride];
            last = s >= 0 && s < num_slots &&
                   __ldcg((const unsigned int *)(cache + (int64_t)s * cache_row)) ==
                       (unsigned int)(nk - c0 + 1);
        }
        uint32_t mask = __ballot_sync(0xffffffffu, last);
        grid.sync(); /* every claim is read before any record is written */
        while (mask) {
            const int k = __ffs(mask) - 1;
            mask &= mask - 1;
            const int64_t n = c0 + wid + (int64_t)k * workers;
            uint16_t v[4 * TW], r[RM];
            kvw_load<TW, RM>(latent + n * lat_row, L, R, w, lane, v, r);
            const int32_t s = slots[n * slot_stride];
            kvw_store<TW, RM>(cache + (int64_t)s * cache_row, L, R, fp8, w, lane, v, r);
        }
    }
}

} /* namespace */

extern "C" int mlart_kv_write_cuda_path(const mlart_geometry *g, const mlart_tensor *cache,
                                        const mlart_tensor *latent, const mlart_tensor *slots,
                                        void *stream, int path)
{
    MLART_CHECK(mlart_kv_write_check(g, cache, latent, slots));
    if (cache->device < 0)
        return mlart_set_error(MLART_EINVAL,
                               "kv_write_cuda: cache is in host memory; use mlart_kv_write_cpu");
    if (path < MLART_KVW_AUTO || path > MLART_KVW_CLAIM)
        return mlart_set_error(MLART_EINVAL, "kv_write_cuda: path %d", path);
    const int64_t N = latent->shape[0];
    if (N == 0)
        return 0;
    /* The scan kernel takes KVW_ROWS rows a block in a grid of at most
     * 2^31 - 1 blocks, and every path may end on it. */
    if (N > (int64_t)KVW_ROWS * INT32_MAX)
        return mlart_set_error(MLART_ERANGE, "kv_write_cuda: %lld rows (at most %lld on CUDA: "
                               "%d a block, 2^31 - 1 blocks)", (long long)N,
                               (long long)KVW_ROWS * INT32_MAX, KVW_ROWS);
    /* Records hold fp32 scales and bf16 values: rows must keep their alignment. */
    if (g->kv_format == MLART_KV_FP8_DS_MLA && (((uintptr_t)cache->data | cache->stride[0]) & 3))
        return mlart_set_error(MLART_ELAYOUT,
                               "kv_write_cuda: fp8_ds_mla cache rows must be 4-byte aligned");
    if ((((uintptr_t)cache->data | cache->stride[0]) & 1) || ((uintptr_t)latent->data & 1))
        return mlart_set_error(MLART_ELAYOUT, "kv_write_cuda: rows must be 2-byte aligned");
    if (g->kv_lora > 1536 || g->rope > 1536)
        return mlart_set_error(MLART_ENOTSUP, "kv_write_cuda: L = %d, R = %d (each at most 1536 "
                               "on CUDA)", g->kv_lora, g->rope);
    /* The claim words are the records' first 4 bytes; the claim kernel is
     * a cooperative launch, which some devices and some sharing setups do
     * not allow (the attribute says so). */
    const bool claimable = !(((uintptr_t)cache->data | cache->stride[0]) & 3);
    if (path == MLART_KVW_CLAIM && !claimable)
        return mlart_set_error(MLART_ELAYOUT, "kv_write_cuda: the claim path needs 4-byte "
                               "aligned cache rows");
    const int fp8 = g->kv_format == MLART_KV_FP8_DS_MLA;
    int coop = 0;
    if (mlart_kvw_pick(path, N, fp8, claimable, 1) == MLART_KVW_CLAIM) { /* asked only then */
        int dev = 0;
        cudaError_t e = cudaGetDevice(&dev);
        if (e == cudaSuccess)
            e = cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev);
        if (e != cudaSuccess)
            return mlart_set_error(MLART_ECUDA, "kv_write_cuda: device attributes: %s",
                                   cudaGetErrorString(e));
    }
    const int asked = path;
    path = mlart_kvw_pick(path, N, fp8, claimable, coop);
    if (path < 0)
        return mlart_set_error(MLART_ENOTSUP, "kv_write_cuda: the claim path needs cooperative "
                               "launch, which this device does not offer");
    const bool small = g->kv_lora <= 512 && g->rope <= 128;
    void *args[] = {(void *)&cache->data, (void *)&cache->stride[0], (void *)&cache->shape[0],
                    (void *)&latent->data, (void *)&latent->stride[0], (void *)&slots->data,
                    (void *)&slots->stride[0], (void *)&N, (void *)&g->kv_lora,
                    (void *)&g->rope, (void *)&fp8};
    cudaLaunchAttribute at[1];
    cudaLaunchConfig_t lc;
    const void *fn;
    if (path == MLART_KVW_SCAN) {
        /* With programmatic dependent launch: the kernel waits before any
         * global access, so it may start while the previous kernel ends
         * whatever that kernel writes, and the next kernel may start once
         * it is past that wait. */
        const unsigned blocks = (unsigned)((N + KVW_ROWS - 1) / KVW_ROWS);
        lc = mlart_launch_cfg(dim3(blocks), dim3(128 * KVW_ROWS), 0, (cudaStream_t)stream, 1, at);
        fn = small ? (const void *)kvw_kernel<1, 1> : (const void *)kvw_kernel<3, 12>;
    } else {
        /* Cooperative: every block resident at once, so a grid no larger
         * than the device holds (no more than one worker a row). */
        fn = small ? (const void *)kvw_claim_kernel<1, 1> : (const void *)kvw_claim_kernel<3, 12>;
        int dev = 0, sms = 0, per_sm = 0;
        cudaError_t e = cudaGetDevice(&dev);
        if (e == cudaSuccess)
            e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
        if (e == cudaSuccess)
            e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, 128 * KVW_ROWS, 0);
        if (e != cudaSuccess || per_sm < 1)
            return mlart_set_error(MLART_ECUDA, "kv_write_cuda: occupancy of the claim kernel: "
                                   "%s", e != cudaSuccess ? cudaGetErrorString(e) : "0 blocks");
        const int64_t want = (N + KVW_ROWS - 1) / KVW_ROWS, fit = (int64_t)sms * per_sm;
        lc = mlart_launch_cfg(dim3((unsigned)(want < fit ? want : fit)), dim3(128 * KVW_ROWS), 0,
                              (cudaStream_t)stream, 0, at);
        at[0].id = cudaLaunchAttributeCooperative;
        at[0].val.cooperative = 1;
        lc.numAttrs = 1;
    }
    cudaError_t e = cudaLaunchKernelExC(&lc, fn, args);
    if (e == cudaSuccess)
        e = cudaGetLastError();
    if (e == cudaErrorCooperativeLaunchTooLarge && asked == MLART_KVW_AUTO) {
        /* The device holds fewer blocks than its attributes said (a share
         * of it, as under MPS): the scan kernel is right for any row count.
         * Not while the stream is captured, where the failed launch may
         * have invalidated the capture: there the error goes to the
         * caller. */
        cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
        (void)cudaGetLastError(); /* the failed launch's error, not sticky */
        if (cudaStreamIsCapturing((cudaStream_t)stream, &cs) == cudaSuccess &&
            cs == cudaStreamCaptureStatusNone)
            return mlart_kv_write_cuda_path(g, cache, latent, slots, stream, MLART_KVW_SCAN);
    }
    if (e != cudaSuccess)
        return mlart_set_error(MLART_ECUDA, "kv_write_cuda: launch: %s", cudaGetErrorString(e));
    return 0;
}

extern "C" int mlart_kv_write_cuda(const mlart_geometry *g, const mlart_tensor *cache,
                                   const mlart_tensor *latent, const mlart_tensor *slots,
                                   void *stream)
{
    return mlart_kv_write_cuda_path(g, cache, latent, slots, stream, MLART_KVW_AUTO);
}
