/* The serving example's compute side: one MLA decode layer with a synthetic
 * KV cache (or checkpoint weights), run one batched step at a time. */
#ifndef MLART_SERVE_ENGINE_H
#define MLART_SERVE_ENGINE_H

#include <mlart/mlart.h>

#include "serve_proto.h"

#define SERVE_DEVICE_AUTO (-2)

typedef struct serve_engine_opts {
    int device;              /* SERVE_DEVICE_AUTO, -1 = CPU, >= 0 = CUDA ordinal */
    const char *backend;     /* NULL: the device's default (reference on the CPU) */
    mlart_geometry geom;
    int32_t context;         /* cached tokens every request can attend to */
    int32_t max_batch_tokens;
    int32_t max_batch_requests;
    const char *weights;     /* .safetensors with kv_b_proj, or NULL for random weights */
    int layer;               /* which layer's kv_b_proj */
    uint64_t seed;
    /* steps run in CUDA graphs of these token counts (mlart/graphs.h): the
     * sizes below max_batch_tokens, then max_batch_tokens; NULL: powers of two */
    const int32_t *graph_sizes;
    int num_graph_sizes;
    int no_graph;            /* 1: the same padded steps, kernels launched directly */
} serve_engine_opts;

typedef struct serve_engine serve_engine;

/* Returns 0 or a negative mlart_status with a message in err. */
int serve_engine_create(const serve_engine_opts *o, serve_engine **out, char *err,
                        size_t err_cap);
void serve_engine_destroy(serve_engine *e);
/* "reference on cpu" etc. */
const char *serve_engine_describe(const serve_engine *e);

/* One decode step over n requests (their tokens together): token i of a
 * request at position p attends to positions max(0, p-topk+1)..p of the
 * cache.  checksums[r] = FNV-1a of request r's output rows [tokens, H*V]
 * bf16.  One caller at a time; any thread. */
int serve_engine_step(serve_engine *e, const serve_request *const *reqs, int n,
                      uint64_t *checksums, char *err, size_t err_cap);

#endif
