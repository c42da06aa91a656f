/* Loading absorbed-attention weights from checkpoints. */
#ifndef MLART_WEIGHTS_H
#define MLART_WEIGHTS_H

#include "mlart/mlart.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Read layer `layer`'s kv_b_proj weight ("model.layers.<layer>.self_attn.kv_b_proj.weight",
 * shape [H_total*(P+V), L]) from a .safetensors file and write heads
 * [head_offset, head_offset + g->heads) as dense bf16 [g->heads*(P+V), L] into
 * dst (dst_bytes must be at least that size).  BF16 tensors are copied; FP8
 * e4m3 tensors are dequantised with their 128x128 block "weight_scale_inv"
 * (f32) companion.  Truncated files, headers that lie about offsets or sizes,
 * wrong dtypes or shapes are refused with MLART_EIO / MLART_ESHAPE /
 * MLART_EDTYPE and a message; nothing is read outside the file.  Also:
 * MLART_EINVAL for bad arguments or a file without that tensor, MLART_ERANGE
 * for NaN/infinite weights or scales, negative scales, or a dequantised value
 * past the bf16 range.  dst is written only on success.  FP8 values are
 * dequantised as e4m3 x scale in exact arithmetic, then rounded once to bf16
 * (nearest-even). */
MLART_API int mlart_safetensors_load_kv_b_proj(const char *path, int layer,
                                               const mlart_geometry *g, int head_offset,
                                               void *dst, size_t dst_bytes);

/* The number of heads H_total that layer `layer`'s kv_b_proj holds, from the
 * file's header alone (nothing else is read), after the same name and shape
 * checks as mlart_safetensors_load_kv_b_proj for geometry g (g->heads may be
 * any positive count).  A program sharding heads over ranks compares it with
 * its total head count before loading [rank*H, (rank+1)*H).  *heads_total is
 * written only on success. */
MLART_API int mlart_safetensors_kv_b_proj_heads(const char *path, int layer,
                                                const mlart_geometry *g, int64_t *heads_total);

#ifdef __cplusplus
}
#endif
#endif
