/* The graph cache (include/mlart/graphs.h): the step's buffers at fixed
 * addresses, one captured CUDA graph a bucket, padding of the rows past a
 * step's tokens. */
#define _POSIX_C_SOURCE 200809L
#include "mlart/graphs.h"

#include "runtime/comm_impl.h"
#include "runtime/layer_info.h"
#include "runtime/status.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef MLART_WITH_CUDA
#include <cuda_runtime_api.h>

#include "graphs/graph_pad.h"
#endif

struct mlart_graph_cache {
    mlart_layer *layer;
    mlart_layer_info info;
    int write_kv;
    int nb;
    int32_t sizes[MLART_GRAPH_MAX_BUCKETS];
    mlart_graph_bufs bufs; /* the largest bucket's views */
    void *mem;             /* every buffer, one allocation */
    size_t mem_bytes;
    int graphs; /* buckets captured (all or none) */
    /* graphs take every request: lengths [0, lens_top) may hold a caller's
     * values, the rest are 0 (a run of B requests zeroes [B, lens_top)) */
    int32_t lens_top;
#ifdef MLART_WITH_CUDA
    cudaGraphExec_t exec[MLART_GRAPH_MAX_BUCKETS];
#endif
};

/* The buffers in one allocation: offsets of each, 256-byte aligned. */
enum { B_Q, B_IDX, B_REQ, B_LENS, B_BT, B_O, B_LSE, B_ROWS, B_SLOTS, B_COUNT };

static size_t align_up(size_t x)
{
    return (x + 255) & ~(size_t)255;
}

/* Offsets and byte sizes of the buffers (each with the backend's tail_pad
 * of readable bytes past it), the total; 0 on overflow of size_t. */
static size_t layout(const mlart_layer_info *in, int64_t Tm, int write_kv, int lse,
                     size_t off[B_COUNT], size_t bytes[B_COUNT])
{
    const mlart_geometry *g = &in->geom;
    const int64_t H = g->heads, Bm = in->max_requests;
    const double est = (double)Tm * H * (g->qk_nope + g->rope) * 2 + (double)Tm * g->topk * 4 +
                       (double)Bm * in->max_blocks * 4 + (double)Tm * H * g->v_head * 2 +
                       (double)H * Tm * 4 + (double)Tm * (g->kv_lora + g->rope) * 2 +
                       (double)Tm * 8 + (double)Bm * 4 + 16.0 * 256 +
                       (double)B_COUNT * (double)in->tail_pad;
    size_t total = 0;
    if (est >= (double)SIZE_MAX / 2)
        return 0;
    bytes[B_Q] = (size_t)(Tm * H * (g->qk_nope + g->rope) * 2);
    bytes[B_IDX] = (size_t)(Tm * g->topk * 4);
    bytes[B_REQ] = (size_t)(Tm * 4);
    bytes[B_LENS] = (size_t)(Bm * 4);
    bytes[B_BT] = (size_t)(Bm * in->max_blocks * 4);
    bytes[B_O] = (size_t)(Tm * H * g->v_head * 2);
    bytes[B_LSE] = lse ? (size_t)(H * Tm * 4) : 0;
    bytes[B_ROWS] = write_kv ? (size_t)(Tm * (g->kv_lora + g->rope) * 2) : 0;
    bytes[B_SLOTS] = write_kv ? (size_t)(Tm * 4) : 0;
    for (int i = 0; i < B_COUNT; i++) {
        if (bytes[i])
            bytes[i] += in->tail_pad;
        off[i] = total;
        total += align_up(bytes[i]);
    }
    return total;
}

static mlart_tensor view(void *data, mlart_dtype dt, int dev, int ndim, int64_t d0, int64_t d1,
                         int64_t d2)
{
    const int64_t shape[3] = {d0, d1, d2};
    return mlart_tensor_dense(data, dt, dev, ndim, shape);
}

/* A view of the first rows of a buffer: readable to the buffer's end. */
static mlart_tensor within(mlart_tensor v, const mlart_tensor *whole)
{
    v.base = whole->base;
    v.extent = whole->extent;
    return v;
}

/* The views of a step of T tokens and B requests over the buffers (rows
 * 0..T-1 of each token buffer, entries 0..B-1 of the requests'; lse rows
 * Tmax apart). */
static void step_views(const mlart_graph_cache *gc, int32_t T, int32_t B, mlart_step_io *io,
                       mlart_tensor *rows, mlart_tensor *slots)
{
    const mlart_graph_bufs *b = &gc->bufs;
    const mlart_geometry *g = &gc->info.geom;
    const int dev = gc->info.device;
    const int64_t H = g->heads;
    *io = b->io;
    io->T = T;
    io->B = B;
    io->seq_lens = within(view(b->io.seq_lens.data, MLART_DTYPE_I32, dev, 1, B, 0, 0),
                          &b->io.seq_lens);
    io->block_table = within(view(b->io.block_table.data, MLART_DTYPE_I32, dev, 2, B,
                                  gc->info.max_blocks, 0), &b->io.block_table);
    io->q = within(view(b->io.q.data, MLART_DTYPE_BF16, dev, 3, T, H, g->qk_nope + g->rope),
                   &b->io.q);
    io->idx = within(view(b->io.idx.data, MLART_DTYPE_I32, dev, 2, T, g->topk, 0), &b->io.idx);
    io->req_of_token = within(view(b->io.req_of_token.data, MLART_DTYPE_I32, dev, 1, T, 0, 0),
                              &b->io.req_of_token);
    io->o = within(view(b->io.o.data, MLART_DTYPE_BF16, dev, 2, T, H * g->v_head, 0), &b->io.o);
    if (io->lse.data)
        io->lse.shape[1] = T; /* rows stay Tmax apart */
    *rows = within(view(b->rows.data, MLART_DTYPE_BF16, dev, 2, T, g->kv_lora + g->rope, 0),
                   &b->rows);
    *slots = within(view(b->slots.data, MLART_DTYPE_I32, dev, 1, T, 0, 0), &b->slots);
}

/* The step of bucket `T` and B requests on `stream`: the cache write
 * (write_kv), then the decode. */
static int enqueue(mlart_graph_cache *gc, int32_t T, int32_t B, void *stream)
{
    mlart_step_io io;
    mlart_tensor rows, slots;
    step_views(gc, T, B, &io, &rows, &slots);
    if (gc->write_kv)
        MLART_CHECK(mlart_layer_write_kv(gc->layer, &rows, &slots, stream));
    return mlart_layer_decode(gc->layer, &io, stream);
}

/* Fill bytes [off, off + n) of the allocation with `byte`, on the stream. */
static int fill(mlart_graph_cache *gc, size_t off, size_t n, int byte, void *stream)
{
    char *p = (char *)gc->mem + off;
    if (!n)
        return 0;
    if (gc->info.device < 0) {
        memset(p, byte, n);
        return 0;
    }
#ifdef MLART_WITH_CUDA
    {
        const cudaError_t e = cudaMemsetAsync(p, byte, n, (cudaStream_t)stream);
        if (e != cudaSuccess)
            return mlart_set_error(MLART_ECUDA, "graph cache: cudaMemsetAsync of %zu bytes: %s", n,
                                   cudaGetErrorString(e));
        return 0;
    }
#else
    (void)stream;
    return mlart_set_error(MLART_ENODEV, "this build has no CUDA");
#endif
}

/* Rows T..Tp-1 become padding and lengths B0..B1-1 zero: one kernel on a
 * device, memsets on the host. */
static int pad(mlart_graph_cache *gc, int32_t T, int32_t Tp, int32_t B0, int32_t B1,
               void *stream)
{
    const mlart_graph_bufs *b = &gc->bufs;
    const mlart_geometry *g = &gc->info.geom;
    const size_t n = (size_t)(Tp - T);
    const size_t qrow = (size_t)g->heads * (size_t)(g->qk_nope + g->rope) * 2;
    const size_t irow = (size_t)g->topk * 4;
    if (B1 < B0)
        B1 = B0;
    if (!n && B1 == B0)
        return 0;
#ifdef MLART_WITH_CUDA
    if (gc->info.device >= 0) {
        mlart_graph_pad_args a;
        int e;
        a.q = b->io.q.data;
        a.q_row = (int64_t)g->heads * (g->qk_nope + g->rope);
        a.idx = b->io.idx.data;
        a.idx_row = g->topk;
        a.req = b->io.req_of_token.data;
        a.slots = gc->write_kv ? b->slots.data : NULL;
        a.lens = b->io.seq_lens.data;
        a.T = T, a.Tp = Tp, a.B0 = B0, a.B1 = B1;
        if ((e = mlart_graph_pad_launch(&a, stream)) != 0)
            return mlart_set_error(MLART_ECUDA, "graph cache: the padding kernel: %s",
                                   cudaGetErrorString((cudaError_t)e));
        return 0;
    }
#endif
#define OFF(ptr) ((size_t)((char *)(ptr) - (char *)gc->mem))
    MLART_CHECK(fill(gc, OFF(b->io.q.data) + (size_t)T * qrow, n * qrow, 0, stream));
    MLART_CHECK(fill(gc, OFF(b->io.idx.data) + (size_t)T * irow, n * irow, 0xff, stream));
    MLART_CHECK(fill(gc, OFF(b->io.req_of_token.data) + (size_t)T * 4, n * 4, 0, stream));
    if (gc->write_kv)
        MLART_CHECK(fill(gc, OFF(b->slots.data) + (size_t)T * 4, n * 4, 0xff, stream));
    MLART_CHECK(fill(gc, OFF(b->io.seq_lens.data) + (size_t)B0 * 4, (size_t)(B1 - B0) * 4, 0,
                     stream));
#undef OFF
    return 0;
}

static int check_sizes(const mlart_layer_info *in, const int32_t *sizes, int n)
{
    if (n < 1 || n > MLART_GRAPH_MAX_BUCKETS)
        return mlart_set_error(MLART_EINVAL, "mlart_graph_cache_create: %d buckets (want 1..%d)",
                               n, MLART_GRAPH_MAX_BUCKETS);
    if (!sizes)
        return mlart_set_error(MLART_EINVAL, "mlart_graph_cache_create: NULL sizes");
    for (int i = 0; i < n; i++) {
        if (sizes[i] < 1 || sizes[i] > in->max_tokens)
            return mlart_set_error(MLART_EINVAL, "mlart_graph_cache_create: bucket %d is %d "
                                   "tokens (want 1..%d, the layer's max_tokens)", i, sizes[i],
                                   in->max_tokens);
        if (i && sizes[i] <= sizes[i - 1])
            return mlart_set_error(MLART_EINVAL, "mlart_graph_cache_create: buckets must "
                                   "increase (%d after %d)", sizes[i], sizes[i - 1]);
    }
    return 0;
}

#ifdef MLART_WITH_CUDA
/* Warm up every bucket on the cache's own stream (each kernel's first
 * launch loads its module and sets its attributes: not in a step), then
 * capture it when `capture`. */
static int warm_and_capture(mlart_graph_cache *gc, void *stream, int capture)
{
    cudaStream_t cs;
    cudaError_t e;
    int rc = 0;
    if ((e = cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking)) != cudaSuccess)
        return mlart_set_error(MLART_ECUDA, "graph cache: cudaStreamCreate: %s",
                               cudaGetErrorString(e));
    /* the buffers were cleared on the caller's stream */
    if ((e = cudaStreamSynchronize((cudaStream_t)stream)) != cudaSuccess)
        rc = mlart_set_error(MLART_ECUDA, "graph cache: clearing the buffers: %s",
                             cudaGetErrorString(e));
    for (int i = 0; i < gc->nb && rc == 0; i++) {
        cudaGraph_t graph = NULL;
        const int32_t T = gc->sizes[i];
        /* the warm-up: each kernel's first launch (module load, attributes)
         * happens outside the capture */
        if ((rc = enqueue(gc, T, gc->info.max_requests, cs)) < 0)
            break;
        if (gc->info.dcp) { /* NCCL collectives: a dead peer ends in an error */
            if ((rc = mlart_comm_wait(gc->info.dcp, cs, 0)) < 0)
                break;
        } else if ((e = cudaStreamSynchronize(cs)) != cudaSuccess) {
            rc = mlart_set_error(MLART_ECUDA, "graph cache: warm-up step of bucket %d: %s", T,
                                 cudaGetErrorString(e));
            break;
        }
        if (!capture)
            continue;
        if ((e = cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal)) != cudaSuccess) {
            rc = mlart_set_error(MLART_ECUDA, "graph cache: cudaStreamBeginCapture: %s",
                                 cudaGetErrorString(e));
            break;
        }
        rc = enqueue(gc, T, gc->info.max_requests, cs); /* every request: B varies by run */
        e = cudaStreamEndCapture(cs, &graph); /* always: it ends the capture */
        if (rc == 0 && e == cudaSuccess)
            e = cudaGraphInstantiate(&gc->exec[i], graph, 0);
        if (graph)
            cudaGraphDestroy(graph);
        if (rc == 0 && e != cudaSuccess) {
            gc->exec[i] = NULL;
            rc = mlart_set_error(MLART_ECUDA, "graph cache: capturing the step of bucket %d "
                                 "(backend '%s', which declares itself graph-safe): %s", T,
                                 mlart_layer_backend_name(gc->layer), cudaGetErrorString(e));
        }
    }
    cudaStreamDestroy(cs);
    (void)cudaGetLastError();
    if (rc == 0 && capture)
        gc->graphs = gc->nb;
    return rc;
}
#endif

int mlart_graph_cache_create(mlart_layer *layer, const int32_t *sizes, int num_sizes,
                             unsigned flags, void *stream, mlart_graph_cache **out)
{
    const int write_kv = (flags & MLART_GRAPH_WRITE_KV) != 0, lse = (flags & MLART_GRAPH_LSE) != 0;
    const unsigned known = MLART_GRAPH_WRITE_KV | MLART_GRAPH_NO_CAPTURE | MLART_GRAPH_LSE;
    mlart_graph_cache *gc;
    size_t off[B_COUNT];
    int rc = 0;
    if (!layer || !out)
        return mlart_set_error(MLART_EINVAL, "mlart_graph_cache_create: NULL %s",
                               layer ? "out" : "layer");
    if (flags & ~known)
        return mlart_set_error(MLART_EINVAL, "mlart_graph_cache_create: unknown flags 0x%x",
                               flags & ~known);
    gc = calloc(1, sizeof *gc);
    if (!gc)
        return mlart_set_error(MLART_ENOMEM, "mlart_graph_cache_create: out of memory");
    gc->layer = layer;
    gc->write_kv = write_kv;
    mlart_layer_info_get(layer, &gc->info);
    if ((rc = check_sizes(&gc->info, sizes, num_sizes)) < 0) {
        free(gc);
        return rc;
    }
    gc->nb = num_sizes;
    memcpy(gc->sizes, sizes, sizeof sizes[0] * (size_t)num_sizes);
    {
        const mlart_layer_info *in = &gc->info;
        const mlart_geometry *g = &in->geom;
        const int64_t Tm = sizes[num_sizes - 1], H = g->heads, Bm = in->max_requests;
        const int dev = in->device;
        char *m;
        size_t bytes[B_COUNT];
        gc->mem_bytes = layout(in, Tm, write_kv, lse, off, bytes);
        if (!gc->mem_bytes) {
            rc = mlart_set_error(MLART_ERANGE, "mlart_graph_cache_create: buffers for %lld "
                                 "tokens of %lld heads, %lld requests and %lld blocks a request "
                                 "(the layer's max_requests and max_blocks_per_req) pass the "
                                 "address space: lower those or the largest bucket",
                                 (long long)Tm, (long long)H, (long long)Bm,
                                 (long long)in->max_blocks);
            free(gc);
            return rc;
        }
        if (dev < 0) {
            gc->mem = calloc(1, gc->mem_bytes);
            if (!gc->mem)
                rc = mlart_set_error(MLART_ENOMEM, "mlart_graph_cache_create: %zu bytes of host "
                                     "memory", gc->mem_bytes);
        } else {
#ifdef MLART_WITH_CUDA
            cudaError_t e = cudaSetDevice(dev); /* the layer's, whatever is current */
            if (e == cudaSuccess)
                e = cudaMalloc(&gc->mem, gc->mem_bytes);
            if (e != cudaSuccess) {
                gc->mem = NULL;
                rc = mlart_set_error(MLART_ENOMEM, "mlart_graph_cache_create: cudaMalloc of %zu "
                                     "bytes on device %d: %s", gc->mem_bytes, dev,
                                     cudaGetErrorString(e));
            }
#else
            rc = mlart_set_error(MLART_ENODEV, "this build has no CUDA");
#endif
        }
        if (rc < 0) {
            free(gc);
            return rc;
        }
        m = gc->mem;
        gc->bufs.io.T = (int32_t)Tm;
        gc->bufs.io.B = (int32_t)Bm;
        gc->bufs.io.q = view(m + off[B_Q], MLART_DTYPE_BF16, dev, 3, Tm, H, g->qk_nope + g->rope);
        gc->bufs.io.idx = view(m + off[B_IDX], MLART_DTYPE_I32, dev, 2, Tm, g->topk, 0);
        gc->bufs.io.req_of_token = view(m + off[B_REQ], MLART_DTYPE_I32, dev, 1, Tm, 0, 0);
        gc->bufs.io.seq_lens = view(m + off[B_LENS], MLART_DTYPE_I32, dev, 1, Bm, 0, 0);
        gc->bufs.io.block_table = view(m + off[B_BT], MLART_DTYPE_I32, dev, 2, Bm,
                                       in->max_blocks, 0);
        gc->bufs.io.o = view(m + off[B_O], MLART_DTYPE_BF16, dev, 2, Tm, H * g->v_head, 0);
        if (lse)
            gc->bufs.io.lse = view(m + off[B_LSE], MLART_DTYPE_F32, dev, 2, H, Tm, 0);
        if (write_kv) {
            gc->bufs.rows = view(m + off[B_ROWS], MLART_DTYPE_BF16, dev, 2, Tm,
                                 g->kv_lora + g->rope, 0);
            gc->bufs.slots = view(m + off[B_SLOTS], MLART_DTYPE_I32, dev, 1, Tm, 0, 0);
        }
        { /* each view readable to its buffer's end: the backend's tail_pad */
            mlart_tensor *v[B_COUNT] = {&gc->bufs.io.q, &gc->bufs.io.idx,
                                        &gc->bufs.io.req_of_token, &gc->bufs.io.seq_lens,
                                        &gc->bufs.io.block_table, &gc->bufs.io.o,
                                        &gc->bufs.io.lse, &gc->bufs.rows, &gc->bufs.slots};
            for (int k = 0; k < B_COUNT; k++)
                if (v[k]->data)
                    v[k]->extent = bytes[k];
        }
    }
    /* every row padding, every request empty: a valid step of any bucket */
    if ((rc = pad(gc, 0, gc->sizes[gc->nb - 1], 0, gc->info.max_requests, stream)) == 0 &&
        (rc = fill(gc, (size_t)((char *)gc->bufs.io.block_table.data - (char *)gc->mem),
                   (size_t)gc->info.max_requests * (size_t)gc->info.max_blocks * 4, 0,
                   stream)) == 0 &&
        gc->info.device >= 0) {
#ifdef MLART_WITH_CUDA
        rc = warm_and_capture(gc, stream,
                              gc->info.graph_safe && !(flags & MLART_GRAPH_NO_CAPTURE));
#endif
    }
#ifdef MLART_WITH_CUDA
    if (rc == 0 && gc->info.device >= 0) { /* what create enqueued has ended */
        const cudaError_t e = cudaStreamSynchronize((cudaStream_t)stream);
        if (e != cudaSuccess)
            rc = mlart_set_error(MLART_ECUDA, "graph cache: clearing the buffers: %s",
                                 cudaGetErrorString(e));
    }
#endif
    if (rc < 0) {
        mlart_graph_cache_destroy(gc);
        return rc;
    }
    *out = gc;
    return 0;
}

void mlart_graph_cache_destroy(mlart_graph_cache *gc)
{
    if (!gc)
        return;
    if (gc->info.device < 0) {
        free(gc->mem);
    } else {
#ifdef MLART_WITH_CUDA
        for (int i = 0; i < gc->nb; i++)
            if (gc->exec[i])
                cudaGraphExecDestroy(gc->exec[i]);
        cudaFree(gc->mem);
#endif
    }
    free(gc);
}

const mlart_graph_bufs *mlart_graph_cache_bufs(const mlart_graph_cache *gc)
{
    return gc ? &gc->bufs : NULL;
}

static int bucket_index(const mlart_graph_cache *gc, int32_t T)
{
    if (!gc)
        return mlart_set_error(MLART_EINVAL, "graph cache: NULL cache");
    if (T >= 1)
        for (int i = 0; i < gc->nb; i++)
            if (gc->sizes[i] >= T)
                return i;
    return mlart_set_error(MLART_ERANGE, "graph cache: a step of %d tokens (want 1..%d, the "
                           "largest bucket)", T, gc->sizes[gc->nb - 1]);
}

int mlart_graph_cache_bucket(const mlart_graph_cache *gc, int32_t T)
{
    const int i = bucket_index(gc, T);
    return i < 0 ? i : gc->sizes[i];
}

int mlart_graph_cache_run(mlart_graph_cache *gc, int32_t T, int32_t B, void *stream)
{
    const int i = bucket_index(gc, T);
    int32_t Tp;
    if (i < 0)
        return i;
    if (B < 1 || B > gc->info.max_requests)
        return mlart_set_error(MLART_ERANGE, "graph cache: a step of %d requests (want 1..%d, "
                               "the layer's max_requests)", B, gc->info.max_requests);
    if (gc->info.dcp && gc->info.dcp->aborted)
        return mlart_set_error(MLART_ECOMM, "graph cache: the layer's communicator was aborted "
                               "(mlart_comm_wait); its graphs would run its freed kernels");
    Tp = gc->sizes[i];
#ifdef MLART_WITH_CUDA
    if (gc->graphs) {
        /* a graph takes every request: zero the lengths a caller may have
         * left past B, so a token naming such a request reads none (as in a
         * step of B requests) */
        cudaError_t e;
        MLART_CHECK(pad(gc, T, Tp, B, gc->lens_top, stream));
        gc->lens_top = B;
        e = cudaGraphLaunch(gc->exec[i], (cudaStream_t)stream);
        if (e != cudaSuccess)
            return mlart_set_error(MLART_ECUDA, "graph cache: replaying bucket %d: %s", Tp,
                                   cudaGetErrorString(e));
        return Tp;
    }
#endif
    MLART_CHECK(pad(gc, T, Tp, 0, 0, stream));
    MLART_CHECK(enqueue(gc, Tp, B, stream));
    return Tp;
}

int mlart_graph_cache_graphs(const mlart_graph_cache *gc)
{
    return gc ? gc->graphs : 0;
}
