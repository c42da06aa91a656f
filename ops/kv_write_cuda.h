/* Internal: the cache write's two CUDA paths, for the tests and
 * mlart-bench to run each one (mlart_kv_write_cuda picks by row count).
 * Not part of the public API. */
#ifndef MLART_OPS_KV_WRITE_CUDA_H
#define MLART_OPS_KV_WRITE_CUDA_H

#include <stdint.h>

#include "mlart/mlart.h"

#ifdef __cplusplus
extern "C" {
#endif

enum {
    MLART_KVW_AUTO = 0,  /* what mlart_kv_write_cuda does */
    MLART_KVW_SCAN = 1,  /* each row scans the later rows' slots (N^2 work; few rows) */
    MLART_KVW_CLAIM = 2, /* claims in the records' first words, cooperative grid (linear) */
};

/* Up to this many rows the scan kernel, above it the claim kernel
 * (mlart-bench --filter kv_write, 2026-12-02 06:51 UTC: at 2048 rows the
 * claim kernel 11.1 us against 12.7 for bf16, 14.7 against 12.2 for
 * fp8). */
#define MLART_KVW_SCAN_MAX_BF16 1024
#define MLART_KVW_SCAN_MAX_FP8 2048

/* The path mlart_kv_write_cuda_path takes when asked for `path`, for n rows
 * in the given format, with cache rows 4-byte aligned or not (`claimable`:
 * the claim words are the records' first 4 bytes) on a device that can
 * launch cooperative kernels or not (`coop`: cudaDevAttrCooperativeLaunch).
 * MLART_KVW_AUTO falls back to the scan kernel, which is right for every
 * row count, where the claim kernel cannot run; a claim path asked for
 * where it cannot run gives -1 (the caller's error). */
static inline int mlart_kvw_pick(int path, int64_t n, int fp8, int claimable, int coop)
{
    if (path == MLART_KVW_AUTO)
        return n > (fp8 ? MLART_KVW_SCAN_MAX_FP8 : MLART_KVW_SCAN_MAX_BF16) && claimable && coop
                   ? MLART_KVW_CLAIM
                   : MLART_KVW_SCAN;
    if (path == MLART_KVW_CLAIM && !(claimable && coop))
        return -1;
    return path;
}

/* mlart_kv_write_cuda on the given path.  MLART_KVW_CLAIM needs 4-byte
 * aligned cache rows (MLART_ELAYOUT otherwise) and a device that launches
 * cooperative kernels (MLART_ENOTSUP otherwise), and launches without
 * programmatic dependent launch. */
int mlart_kv_write_cuda_path(const mlart_geometry *g, const mlart_tensor *cache,
                             const mlart_tensor *latent, const mlart_tensor *slots, void *stream,
                             int path);

#ifdef __cplusplus
}
#endif
#endif /* MLART_OPS_KV_WRITE_CUDA_H */
