/* CPU twin of the cache write (ops/ops.h).  Every slot and, for fp8_ds_mla,
 * every value is validated before the first byte is written, so a refused
 * call leaves the cache as it was.  Slot -1 skips the row; when two rows name
 * the same slot the later row wins. */
#include <inttypes.h>
#include <string.h>

#include "ops/numerics.h"
#include "ops/ops.h"
#include "runtime/status.h"

int mlart_kv_write_cpu(const mlart_geometry *g, const mlart_tensor *cache,
                       const mlart_tensor *latent, const mlart_tensor *slots)
{
    int64_t N, num_slots;
    int L, R;
    size_t bpt;
    MLART_CHECK(mlart_kv_write_check(g, cache, latent, slots));
    if (cache->device != -1) /* the check made all operands share a device */
        return mlart_set_error(MLART_EINVAL,
                               "kv_write_cpu: cache is on device %d; the CPU twin needs host memory",
                               cache->device);
    N = latent->shape[0];
    num_slots = cache->shape[0];
    L = g->kv_lora;
    R = g->rope;
    bpt = (size_t)cache->shape[1];
    for (int64_t n = 0; n < N; n++) {
        int32_t s = ((const int32_t *)slots->data)[n * slots->stride[0]];
        if (s < -1 || s >= num_slots)
            return mlart_set_error(MLART_ERANGE,
                                   "kv_write: slots[%" PRId64 "] = %d outside [-1, %" PRId64
                                   ") (num_slots of the cache)",
                                   n, (int)s, num_slots);
        if (s >= 0 && g->kv_format == MLART_KV_FP8_DS_MLA) {
            const uint16_t *row = (const uint16_t *)latent->data + n * latent->stride[0];
            for (int i = 0; i < L; i++)
                if (!isfinite(mlart_bf16_to_f32(row[i])))
                    return mlart_set_error(MLART_ERANGE,
                                           "kv_write: latent[%" PRId64 "][%d] is not finite; "
                                           "fp8_ds_mla cannot encode it",
                                           n, i);
        }
    }
    for (int64_t n = 0; n < N; n++) {
        int32_t s = ((const int32_t *)slots->data)[n * slots->stride[0]];
        const uint16_t *row;
        uint8_t *rec;
        if (s < 0)
            continue;
        row = (const uint16_t *)latent->data + n * latent->stride[0];
        rec = (uint8_t *)cache->data + (int64_t)s * cache->stride[0];
        if (g->kv_format == MLART_KV_FP8_DS_MLA)
            mlart_fp8_ds_mla_encode(row, L, R, rec);
        else
            memcpy(rec, row, bpt);
    }
    return 0;
}
