/* Internal: the graph cache's padding kernel (graph_pad.cu), called from
 * graph_cache.c. */
#ifndef MLART_GRAPHS_GRAPH_PAD_H
#define MLART_GRAPHS_GRAPH_PAD_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Rows T..Tp-1 of the token inputs become padding (q zeros, every index -1,
 * request 0, slot -1 where slots is not NULL), and lens[B0..B1-1] 0. */
typedef struct mlart_graph_pad_args {
    uint16_t *q;
    int64_t q_row; /* elements of a q row */
    int32_t *idx;
    int64_t idx_row; /* top-k */
    int32_t *req, *slots, *lens;
    int32_t T, Tp, B0, B1;
} mlart_graph_pad_args;

/* Launch the kernel on `stream` (cudaStream_t); a cudaError_t. */
int mlart_graph_pad_launch(const mlart_graph_pad_args *a, void *stream);

#ifdef __cplusplus
}
#endif
#endif
