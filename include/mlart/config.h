/* Run configuration: INI files, MLART_* environment, command line.
 *
 * A config file has four sections; every key is optional unless marked
 * required, an unknown section or key, a bad value, a duplicate, or a missing
 * required key is MLART_ECONFIG with a message naming the key and where it
 * was set (file:line, environment variable or command-line option).
 *
 *   [model]     heads (required, total over all TP ranks), qk_nope_dim (P, required),
 *               rope_dim (R, required), kv_lora_rank (L, required),
 *               v_head_dim (V, required), topk (required), page_size (64),
 *               softmax_scale (1/sqrt(P+R)), kv_format (bf16 | fp8_ds_mla; bf16)
 *   [runtime]   backend (name; empty: the device's default), device (cpu | cuda | auto; auto),
 *               graph_sizes (comma list, increasing; 1,2,4,8,16,32,64), layers (1),
 *               early_weights (0 | 1; 0: mlart_layer_desc.early_weights, the caller's
 *               promise that no kernel it enqueues writes the layers' weights),
 *               validate_indices (0 | 1; 0: mlart_layer_desc.validate_indices)
 *   [parallel]  tp_size (1), dcp_size (1), dcp_routing (ag_rs | a2a; ag_rs),
 *               dcp_interleave (1)
 *   [run]       batch (4), context (2048), steps (16), seed (1): what mlart-decode runs;
 *               seed is decimal ("010" is ten, never octal) or hexadecimal after 0x/0X
 *
 * Lines may be indented (spaces or tabs): an indented key, section or comment
 * reads as an unindented one.  No value continues onto the next line.  Only a
 * comment (';' or '#') may follow a section's ']' on its line; a NUL byte
 * anywhere is an error.
 *
 * Precedence: command line > environment > file.  Every key has an
 * environment variable MLART_<KEY in upper case>: MLART_HEADS, MLART_QK_NOPE_DIM,
 * MLART_ROPE_DIM, MLART_KV_LORA_RANK, MLART_V_HEAD_DIM, MLART_TOPK,
 * MLART_PAGE_SIZE, MLART_SOFTMAX_SCALE, MLART_KV_FORMAT, MLART_BACKEND,
 * MLART_DEVICE, MLART_GRAPH_SIZES, MLART_LAYERS, MLART_EARLY_WEIGHTS,
 * MLART_VALIDATE_INDICES, MLART_TP_SIZE,
 * MLART_DCP_SIZE,
 * MLART_DCP_ROUTING, MLART_DCP_INTERLEAVE, MLART_BATCH, MLART_CONTEXT,
 * MLART_STEPS, MLART_SEED.  An empty variable counts as unset.
 *
 * Use: mlart_config_init, then mlart_config_read_file, mlart_config_read_env,
 * mlart_config_set for each command-line option, then mlart_config_finish;
 * or mlart_config_load for file + environment in one call.
 */
#ifndef MLART_CONFIG_H
#define MLART_CONFIG_H

#include "mlart/mlart.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MLART_CONFIG_MAX_GRAPH_SIZES 32
#define MLART_CONFIG_MAX_KEYS 32

typedef enum mlart_device_kind {
    MLART_DEVICE_AUTO = 0, /* cuda when a device is usable, else cpu */
    MLART_DEVICE_CPU = 1,
    MLART_DEVICE_CUDA = 2
} mlart_device_kind;


typedef struct mlart_config {
    mlart_geometry geom;   /* per rank: geom.heads = heads_total / tp_size (after finish) */
    int32_t heads_total;   /* [model] heads */
    char backend[64];      /* "" = default for the device */
    mlart_device_kind device;
    int32_t graph_sizes[MLART_CONFIG_MAX_GRAPH_SIZES];
    int32_t num_graph_sizes;
    int32_t layers;
    int32_t early_weights; /* [runtime] early_weights: for mlart_layer_desc.early_weights */
    int32_t validate_indices; /* [runtime] validate_indices: for
                                 mlart_layer_desc.validate_indices */
    int32_t tp_size, dcp_size;
    mlart_dcp_routing dcp_routing;
    int32_t dcp_interleave;
    int32_t batch, context, steps;
    uint64_t seed;
    char path[512];        /* file read last ("" if none) */
    /* where each key was set: read it with mlart_config_origin */
    char origin[MLART_CONFIG_MAX_KEYS][560];
} mlart_config;

/* Defaults, nothing required set yet. */
MLART_API void mlart_config_init(mlart_config *cfg);
/* Read an INI file over cfg.  MLART_EIO if it cannot be opened, is not a
 * regular file or FIFO (e.g. a directory) or a read fails, naming the file;
 * MLART_ECONFIG (naming key and file:line) on anything wrong inside, a line
 * of more than 198 characters (comments too: inih's buffer) among it.  On
 * error cfg is left untouched. */
MLART_API int mlart_config_read_file(mlart_config *cfg, const char *path);
/* Apply every set MLART_<KEY> environment variable. */
MLART_API int mlart_config_read_env(mlart_config *cfg);
/* Set one key (name as in the file, e.g. "backend") from `origin`
 * (e.g. "--backend"); same value rules as the file, blanks around the
 * value ignored. */
MLART_API int mlart_config_set(mlart_config *cfg, const char *key, const char *value,
                               const char *origin);
/* Check required keys and the relations between keys (heads % tp_size,
 * tp_size % dcp_size, geometry), then derive geom.heads and a default
 * softmax_scale.  MLART_ECONFIG naming the key and its origin. */
MLART_API int mlart_config_finish(mlart_config *cfg);
/* init + read_file + read_env + finish. */
MLART_API int mlart_config_load(const char *path, mlart_config *out);

/* Where `key` was set: "" for its default, else "file:line", "environment
 * MLART_X" or the command-line origin; NULL for an unknown key. */
MLART_API const char *mlart_config_origin(const mlart_config *cfg, const char *key);

MLART_API const char *mlart_device_kind_name(mlart_device_kind d);
MLART_API const char *mlart_dcp_routing_name(mlart_dcp_routing r);

#ifdef __cplusplus
}
#endif
#endif /* MLART_CONFIG_H */
