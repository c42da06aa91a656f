/* The graph cache's padding kernel: one launch writes every padding row of
 * a step and empties the requests a graph must not see (graph_cache.c),
 * before the bucket's graph or step. */
#include "graphs/graph_pad.h"

#include <cuda_runtime.h>

namespace {

constexpr int PAD_BLOCKS = 32, PAD_THREADS = 256;

__global__ void __launch_bounds__(PAD_THREADS) graph_pad_kernel(mlart_graph_pad_args a)
{
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t rows = a.Tp > a.T ? a.Tp - a.T : 0;
    for (int64_t i = first; i < rows * a.q_row; i += stride)
        a.q[(int64_t)a.T * a.q_row + i] = 0;
    for (int64_t i = first; i < rows * a.idx_row; i += stride)
        a.idx[(int64_t)a.T * a.idx_row + i] = -1;
    for (int64_t i = first; i < rows; i += stride) {
        a.req[a.T + i] = 0;
        if (a.slots)
            a.slots[a.T + i] = -1;
    }
    for (int64_t i = first; i < (int64_t)a.B1 - a.B0; i += stride)
        a.lens[a.B0 + i] = 0;
}

} // namespace

int mlart_graph_pad_launch(const mlart_graph_pad_args *a, void *stream)
{
    graph_pad_kernel<<<PAD_BLOCKS, PAD_THREADS, 0, (cudaStream_t)stream>>>(*a);
    return (int)cudaGetLastError();
}
