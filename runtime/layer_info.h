/* Internal: what the graph cache (graphs/) needs to know of a layer. */
#ifndef MLART_RUNTIME_LAYER_INFO_H
#define MLART_RUNTIME_LAYER_INFO_H

#include "mlart/mlart.h"

typedef struct mlart_layer_info {
    int device; /* -1 host */
    mlart_geometry geom;
    int32_t max_tokens, max_requests, max_blocks;
    size_t tail_pad;        /* the backend's contract: readable bytes past every input */
    struct mlart_comm *dcp; /* the DCP communicator, or NULL */
    /* 1 when a step may be captured in a CUDA graph: on a device, a
     * graph-safe backend, no validate_indices, no communicator or a
     * capturable one */
    int graph_safe;
} mlart_layer_info;

void mlart_layer_info_get(const mlart_layer *layer, mlart_layer_info *out);

#endif
