/* Internal: what a communicator implementation fills in (include/mlart/comm.h). */
#ifndef MLART_RUNTIME_COMM_IMPL_H
#define MLART_RUNTIME_COMM_IMPL_H

#include "mlart/comm.h"

#include <stddef.h>

typedef struct mlart_comm_ops {
    const char *kind;
    int (*all_gather)(mlart_comm *c, const void *send, void *recv, size_t bytes, void *stream);
    /* n all-to-alls at once (one NCCL group): array i sends send[i], size
     * blocks of bytes[i], into recv[i]; n >= 1, every bytes[i] > 0 */
    int (*all_to_all)(mlart_comm *c, int n, const void *const *send, void *const *recv,
                      const size_t *bytes, void *stream);
    int (*reduce_scatter_f32)(mlart_comm *c, const float *send, float *recv, size_t n,
                              void *stream);
    void (*destroy)(mlart_comm *c); /* frees impl and c */
    /* optional (NULL: poll the stream, as mlart_comm_poll_stream with no stop):
     * mlart_comm_wait on a communicator of a CUDA device; timeout_ms > 0 */
    int (*wait)(mlart_comm *c, void *stream, int timeout_ms);
} mlart_comm_ops;

struct mlart_comm {
    const mlart_comm_ops *ops;
    int rank, size, device, graph_safe;
    int aborted; /* set when mlart_comm_wait aborted it: takes no more work */
    void *impl;
};

/* Poll `stream` until the work enqueued on it so far has ended (0), a CUDA
 * error (MLART_ECUDA, recorded), `stop` (NULL, or called about once a
 * millisecond) returns non-zero (that value), or timeout_ms has passed (1,
 * nothing recorded).  Spins (yielding) for the first milliseconds, then
 * sleeps 100 us between polls. */
int mlart_comm_poll_stream(mlart_comm *c, void *stream, int timeout_ms, int (*stop)(mlart_comm *c));

#endif
