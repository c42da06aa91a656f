/* mlart — a CUDA graph of a layer's step for each batch bucket (docs/embedding.md).
 *
 * A serving loop whose steps carry a varying number of tokens T runs each
 * step in the smallest bucket >= T: rows T..bucket-1 are padding (every
 * index -1, request 0, query zeros, no cache write), and their output rows
 * are zeros.  The cache owns every buffer a step reads and writes, sized for
 * the largest bucket and the layer's max_requests, on the layer's device, at
 * addresses that never change: before each run the caller fills rows 0..T-1
 * of the token inputs and the first B requests' lengths and block-table
 * rows, and the bucket's graph reads them there.  Graphs are captured once,
 * at create, each after one warm-up step on empty inputs (on a stream of the
 * cache's own), so a run is one graph launch, after one small padding
 * kernel when T is not a bucket.
 *
 * A layer that cannot be captured (on the host; a backend that is not
 * graph-safe; validate_indices; a local DCP communicator) runs the same
 * padded step with its kernels launched directly, so the two give the same
 * bytes for the same inputs (on a device it too runs one warm-up step a
 * bucket at create).  A token's output depends on its bucket, not on T (a
 * backend may choose its kernels by the step's token count;
 * mlart_layer_decode).  With a DCP communicator the warm-up steps at create
 * are collectives: every rank of the group creates its cache at the same
 * point, with the same buckets.
 */
#ifndef MLART_GRAPHS_H
#define MLART_GRAPHS_H

#include "mlart/mlart.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mlart_graph_cache mlart_graph_cache;

#define MLART_GRAPH_MAX_BUCKETS 64

/* The cache's buffers, on the layer's device, shaped for the largest bucket
 * (Tmax tokens) and max_requests (Bmax).  Fill rows 0..T-1 of q, idx,
 * req_of_token (each in [0, B)), rows and slots, and entries 0..B-1 of
 * seq_lens and block_table; read rows 0..T-1 of o (and with MLART_GRAPH_LSE
 * columns 0..T-1 of lse) after a run.  Rows past T and entries past B are
 * the cache's: a run overwrites the rows, and a graph (which takes every
 * request) zeroes the lengths a run of more requests left, so a token that
 * names a request >= B reads nothing, as in a step of B requests on a
 * device (the host refuses it; req_of_token must stay below B). */
typedef struct mlart_graph_bufs {
    mlart_step_io io;  /* T = Tmax, B = Bmax; q [Tmax,H,P+R] bf16, idx [Tmax,topk],
                          req_of_token [Tmax], seq_lens [Bmax], block_table
                          [Bmax,max_blocks_per_req] i32; o [Tmax,H*V] bf16;
                          lse [H,Tmax] f32 (MLART_GRAPH_LSE; else data NULL) */
    mlart_tensor rows;  /* [Tmax,L+R] bf16: each token's new latent+rope row
                           (MLART_GRAPH_WRITE_KV only; else empty) */
    mlart_tensor slots; /* [Tmax] i32: its cache slot, -1 = none (MLART_GRAPH_WRITE_KV) */
} mlart_graph_bufs;

/* create's flags */
#define MLART_GRAPH_WRITE_KV 1u   /* a run first writes each token's row into its slot
                                     (mlart_layer_write_kv), then decodes; else it only decodes */
#define MLART_GRAPH_NO_CAPTURE 2u /* capture nothing: every run launches the padded step
                                     directly (for comparisons) */
#define MLART_GRAPH_LSE 4u        /* keep each row's LSE in bufs.io.lse (a copy node in each
                                     graph but the largest); else io.lse is empty */

/* A cache for `layer` (which must outlive it) with num_sizes buckets
 * (1..MLART_GRAPH_MAX_BUCKETS, increasing, each in 1..the layer's
 * max_tokens).  stream: where the buffers are cleared and the warm-up steps
 * run (NULL: the legacy stream); create returns once they have ended (with
 * an NCCL communicator the warm-ups are waited for by mlart_comm_wait).
 * Every buffer is made on the layer's device, with the backend's tail_pad
 * of readable bytes after it.
 * MLART_EINVAL for bad sizes or unknown flags, MLART_ERANGE when the
 * buffers' bytes pass the address space, MLART_ENOMEM, MLART_ECUDA
 * naming the bucket whose capture failed, or what a warm-up step returned. */
MLART_API int mlart_graph_cache_create(mlart_layer *layer, const int32_t *sizes, int num_sizes,
                                       unsigned flags, void *stream, mlart_graph_cache **out);
/* Accepts NULL.  Waits for nothing: the caller's stream must have ended its
 * runs. */
MLART_API void mlart_graph_cache_destroy(mlart_graph_cache *gc);
/* The buffers (owned by the cache, valid while it lives). */
MLART_API const mlart_graph_bufs *mlart_graph_cache_bufs(const mlart_graph_cache *gc);
/* The bucket a step of T tokens runs in (the smallest size >= T), or
 * MLART_ERANGE naming the largest when T exceeds it (or T < 1). */
MLART_API int mlart_graph_cache_bucket(const mlart_graph_cache *gc, int32_t T);
/* Run a step of T tokens from B requests on `stream` (cudaStream_t, or
 * NULL): pad rows T..bucket-1 (a kernel on a device, none when T is a
 * bucket), then replay the bucket's graph (or run the step directly, see
 * above).  Neither allocates nor synchronises on CUDA (but a layer with
 * validate_indices, never captured, synchronises to check its indices, as
 * its steps do).  MLART_ECOMM once the layer's DCP communicator was aborted
 * (mlart_comm_wait): its graphs hold that communicator's kernels.  One run at a time
 * per cache: its buffers are the step's, so the caller orders its copies
 * into them after the previous run's reads (one stream does).  Returns the bucket,
 * or MLART_ERANGE for T outside 1..the largest bucket or B outside
 * 1..max_requests (nothing runs), or what a launch returned. */
MLART_API int mlart_graph_cache_run(mlart_graph_cache *gc, int32_t T, int32_t B, void *stream);
/* How many buckets run as captured graphs: all of them, or 0 when the
 * layer cannot be captured or MLART_GRAPH_NO_CAPTURE was given. */
MLART_API int mlart_graph_cache_graphs(const mlart_graph_cache *gc);

#ifdef __cplusplus
}
#endif
#endif /* MLART_GRAPHS_H */
