/* Internal: the cache write's two CUDA paths, for the tests and
 * mlart-bench to run each one (mlart_kv_write_cuda picks by row count).
 * Not part of the public API. */
#ifndef MLART_OPS_KV_WRITE_CUDA_H
#define MLART_OPS_KV_WRITE_CUDA_H

#include "mlart/mlart.h"

#ifdef __cplusplus
extern "C" {
#endif

enum {
    MLART_KVW_AUTO = 0,  /* what mlart_kv_write_cuda does */
    MLART_KVW_SCAN = 1,  /* each row scans the later rows' slots (N^2 work; few rows) */
    MLART_KVW_CLAIM = 2, /* claims in the records' first words, cooperative grid (linear) */
};

/* mlart_kv_write_cuda on the given path.  MLART_KVW_CLAIM needs 4-byte
 * aligned cache rows (MLART_ELAYOUT otherwise) and launches without
 * programmatic dependent launch. */
int mlart_kv_write_cuda_path(const mlart_geometry *g, const mlart_tensor *cache,
                             const mlart_tensor *latent, const mlart_tensor *slots, void *stream,
                             int path);

#ifdef __cplusplus
}
#endif
#endif /* MLART_OPS_KV_WRITE_CUDA_H */
