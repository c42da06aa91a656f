/* mlart-bench suite "graphs": a serving loop's decode step through the graph
 * cache (include/mlart/graphs.h) against the same step launched directly.
 * DeepSeek-V3.2 at TP8 (16 heads, P 128, R 64, L 512, V 128, top-k 2048) on
 * a bf16 cache of 2^20 slots, each token its own request of 2^20 positions,
 * every index valid; the default backend; buckets 1, 2, 4, ..., 64, and T
 * from 1 to 64 with sizes between the buckets.  Each step first copies one
 * of 64 index sets into the step's index rows (device to device, as a
 * serving loop uploads its inputs; the same copy in every column), so the
 * cache rows read rotate over more than 3x L2.  Columns, us a step:
 *   graph   the bucket's graph replayed by mlart_graph_cache_run (a padding
 *           kernel when T is not a bucket, then one graph launch), 200 steps
 *           back to back between two events (host launch included), median
 *           of 5 rounds
 *   padded  the same padded step with its kernels launched directly
 *           (MLART_GRAPH_NO_CAPTURE), timed the same way
 *   exact   mlart_layer_decode of the T tokens alone, launched directly
 *   graph1, exact1  one step at a time: launch, then cudaStreamSynchronize,
 *           host clock, median of 100
 * The graph's output rows equal the padded direct step's byte for byte
 * (checked on every row; a difference counts as a wrong result). */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <vector>

#include "bench_common.h"
#include "mlart/graphs.h"

namespace {

const char *const WHO = "mlart-bench graphs";

enum { H = 16, P = 128, R = 64, L = 512, V = 128, K = 2048, PAGE = 64, TM = 64, NSETS = 64 };
const int64_t SLOTS = (int64_t)1 << 20;

struct GraphsCtx {
    mlart_layer *ly;
    mlart_graph_cache *gc, *direct; /* captured; MLART_GRAPH_NO_CAPTURE */
    int32_t *pool;                  /* [NSETS][TM][K] index sets */
    int32_t *h_req, *h_lens;
};

double now_us()
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return 1e6 * (double)t.tv_sec + 1e-3 * (double)t.tv_nsec;
}

/* One step of T tokens on `st`, variant 0 graph, 1 padded, 2 exact. */
int step(GraphsCtx *c, int variant, int T, int set, cudaStream_t st)
{
    mlart_graph_cache *gc = variant == 0 ? c->gc : c->direct;
    const mlart_graph_bufs *b = mlart_graph_cache_bufs(gc);
    if (cudaMemcpyAsync(b->io.idx.data, c->pool + (size_t)set * TM * K, (size_t)T * K * 4,
                        cudaMemcpyDeviceToDevice, st) != cudaSuccess)
        return -1;
    if (variant < 2)
        return mlart_graph_cache_run(gc, T, T, st) < 0 ? -1 : 0;
    mlart_step_io io = b->io;
    io.T = io.B = T;
    io.q.shape[0] = io.idx.shape[0] = io.req_of_token.shape[0] = io.o.shape[0] = T;
    io.seq_lens.shape[0] = io.block_table.shape[0] = T;
    memset(&io.lse, 0, sizeof io.lse);
    return mlart_layer_decode(c->ly, &io, st) ? -1 : 0;
}

/* Requests and lengths back in both caches' buffers (a run empties the
 * requests past its B and pads the rows past its T). */
int reset_inputs(GraphsCtx *c)
{
    for (mlart_graph_cache *gc : {c->gc, c->direct}) {
        const mlart_graph_bufs *b = mlart_graph_cache_bufs(gc);
        if (cudaMemcpy(b->io.req_of_token.data, c->h_req, TM * 4, cudaMemcpyHostToDevice) ||
            cudaMemcpy(b->io.seq_lens.data, c->h_lens, TM * 4, cudaMemcpyHostToDevice))
            return -1;
    }
    return 0;
}

/* us a step: back to back (sync 0) or one at a time (sync 1). */
int time_steps(GraphsCtx *c, int variant, int T, int sync, cudaStream_t st, double *us)
{
    std::vector<double> v;
    int set = 0;
    for (int w = 0; w < 10; w++)
        if (step(c, variant, T, set++ % NSETS, st))
            return -1;
    if (cudaStreamSynchronize(st) != cudaSuccess)
        return -1;
    if (sync) {
        for (int i = 0; i < 100; i++) {
            const double t0 = now_us();
            if (step(c, variant, T, set++ % NSETS, st) || cudaStreamSynchronize(st) != cudaSuccess)
                return -1;
            v.push_back(now_us() - t0);
        }
    } else {
        cudaEvent_t e0, e1;
        float ms = 0.0f;
        if (cudaEventCreate(&e0) || cudaEventCreate(&e1))
            return -1;
        for (int round = 0; round < 5; round++) {
            cudaEventRecord(e0, st);
            for (int i = 0; i < 200; i++)
                if (step(c, variant, T, set++ % NSETS, st))
                    return -1;
            cudaEventRecord(e1, st);
            if (cudaEventSynchronize(e1) != cudaSuccess)
                return -1;
            cudaEventElapsedTime(&ms, e0, e1);
            v.push_back(1e3 * ms / 200.0);
        }
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
    }
    std::sort(v.begin(), v.end());
    *us = v[v.size() / 2];
    return 0;
}

} // namespace

int mlart_bench_graphs(const mlart_bench_opts *o)
{
    static const int Ts[] = {1, 2, 3, 4, 6, 8, 13, 16, 24, 32, 48, 64};
    static const int32_t sizes[] = {1, 2, 4, 8, 16, 32, 64};
    static const mlart_bench_col cols[] = {
        {"T", "", 4, 0},          {"bucket", "", 7, 0},   {"graph", "us", 9, 2},
        {"padded", "us", 9, 2},   {"exact", "us", 9, 2},  {"graph1", "us", 9, 2},
        {"exact1", "us", 9, 2},   {"exact/graph", "x", 12, 2},
    };
    static const mlart_bench_table tab = {"graphs: a decode step through the graph cache vs "
                                          "launched directly (DSv3.2 TP8, bf16 cache)",
                                          "shape", 18, cols, (int)(sizeof cols / sizeof cols[0])};
    int any = 0, wrong = 0;
    for (int T : Ts) {
        char name[64];
        snprintf(name, sizeof name, "graphs H16 T%d", T);
        any |= mlart_bench_match(o, name);
    }
    if (!any)
        return 0;

    GraphsCtx c;
    memset(&c, 0, sizeof c);
    mlart_context *ctx = NULL;
    cudaStream_t st = NULL;
    void *wuk = NULL, *wuv = NULL, *cache = NULL;
    int32_t *h_bt = NULL;
    std::vector<int32_t> h_pool((size_t)NSETS * TM * K);
    mlart_geometry g = {H, P, R, L, V, K, PAGE, MLART_KV_BF16, 0.0721687836f};
    const int64_t MB = SLOTS / PAGE;
    mlart_layer_desc d;
    uint64_t seed = 0x6a09e667f3bcc909ull;
    uint16_t *o1 = (uint16_t *)malloc((size_t)TM * H * V * 2), *o2 = (uint16_t *)malloc((size_t)TM * H * V * 2);
    c.h_req = (int32_t *)malloc(TM * 4);
    c.h_lens = (int32_t *)malloc(TM * 4);
    h_bt = (int32_t *)malloc((size_t)TM * MB * 4);
    if (!o1 || !o2 || !c.h_req || !c.h_lens || !h_bt) {
        fprintf(stderr, "%s: out of host memory\n", WHO);
        wrong = -1;
        goto out;
    }
    if (mlart_context_create(o->device, &ctx)) {
        fprintf(stderr, "%s: %s\n", WHO, mlart_last_error());
        wrong = -1;
        goto out;
    }
    MLART_BENCH_CHECK(WHO, cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    MLART_BENCH_CHECK(WHO, cudaMalloc(&wuk, (size_t)H * P * L * 2));
    MLART_BENCH_CHECK(WHO, cudaMalloc(&wuv, (size_t)H * L * V * 2));
    MLART_BENCH_CHECK(WHO, cudaMalloc(&cache, (size_t)SLOTS * (L + R) * 2));
    MLART_BENCH_CHECK(WHO, cudaMalloc((void **)&c.pool, h_pool.size() * 4));
    if (mlart_bench_fill_bf16(wuk, (size_t)H * P * L, 1, st) ||
        mlart_bench_fill_bf16(wuv, (size_t)H * L * V, 2, st) ||
        mlart_bench_fill_bf16(cache, (size_t)SLOTS * (L + R), 3, st)) {
        fprintf(stderr, "%s: filling the inputs failed\n", WHO);
        wrong = -1;
        goto out;
    }
    for (auto &x : h_pool)
        x = (int32_t)(mlart_bench_rand(&seed) % (uint64_t)SLOTS);
    MLART_BENCH_CHECK(WHO, cudaMemcpy(c.pool, h_pool.data(), h_pool.size() * 4, cudaMemcpyHostToDevice));
    for (int t = 0; t < TM; t++)
        c.h_req[t] = t, c.h_lens[t] = (int32_t)SLOTS;
    for (int64_t i = 0; i < (int64_t)TM * MB; i++)
        h_bt[i] = (int32_t)(i % MB);

    memset(&d, 0, sizeof d);
    d.geom = g;
    d.max_tokens = TM;
    d.max_requests = TM;
    d.max_blocks_per_req = (int32_t)MB;
    d.num_slots = SLOTS;
    {
        int64_t ws[3] = {H, P, L}, vs[3] = {H, L, V}, cs[2] = {SLOTS, (L + R) * 2};
        d.w_uk_t = mlart_tensor_dense(wuk, MLART_DTYPE_BF16, o->device, 3, ws);
        d.w_uv = mlart_tensor_dense(wuv, MLART_DTYPE_BF16, o->device, 3, vs);
        d.kv_cache = mlart_tensor_dense(cache, MLART_DTYPE_U8, o->device, 2, cs);
    }
    if (mlart_layer_create(ctx, &d, &c.ly) ||
        mlart_graph_cache_create(c.ly, sizes, 7, 0, st, &c.gc) ||
        mlart_graph_cache_create(c.ly, sizes, 7, MLART_GRAPH_NO_CAPTURE, st, &c.direct)) {
        fprintf(stderr, "%s: %s\n", WHO, mlart_last_error());
        wrong = -1;
        goto out;
    }
    for (mlart_graph_cache *gc : {c.gc, c.direct}) {
        const mlart_graph_bufs *b = mlart_graph_cache_bufs(gc);
        if (mlart_bench_fill_bf16(b->io.q.data, (size_t)TM * H * (P + R), 4, st)) {
            wrong = -1;
            goto out;
        }
        MLART_BENCH_CHECK(WHO, cudaMemcpy(b->io.block_table.data, h_bt, (size_t)TM * MB * 4,
                                          cudaMemcpyHostToDevice));
    }
    printf("\n# graph cache: %s, buckets 1..64 (%d captured); each step copies one of %d index "
           "sets into its rows first\n", mlart_layer_backend_name(c.ly),
           mlart_graph_cache_graphs(c.gc), NSETS);
    mlart_bench_table_head(o, &tab);
    for (int T : Ts) {
        char name[64];
        double v[8];
        snprintf(name, sizeof name, "graphs H16 T%d", T);
        if (!mlart_bench_match(o, name))
            continue;
        v[0] = T;
        v[1] = mlart_graph_cache_bucket(c.gc, T);
        if (reset_inputs(&c) || time_steps(&c, 0, T, 0, st, &v[2]) ||
            time_steps(&c, 1, T, 0, st, &v[3]) || reset_inputs(&c) ||
            time_steps(&c, 2, T, 0, st, &v[4]) || reset_inputs(&c) ||
            time_steps(&c, 0, T, 1, st, &v[5]) || reset_inputs(&c) ||
            time_steps(&c, 2, T, 1, st, &v[6])) {
            fprintf(stderr, "%s: T = %d: %s\n", WHO, T, mlart_last_error());
            wrong = -1;
            goto out;
        }
        v[7] = v[4] / v[2];
        /* the replay against the padded direct step on the same set */
        if (reset_inputs(&c) || step(&c, 0, T, 5, st) || step(&c, 1, T, 5, st) ||
            cudaStreamSynchronize(st) != cudaSuccess ||
            cudaMemcpy(o1, mlart_graph_cache_bufs(c.gc)->io.o.data, (size_t)T * H * V * 2,
                       cudaMemcpyDeviceToHost) != cudaSuccess ||
            cudaMemcpy(o2, mlart_graph_cache_bufs(c.direct)->io.o.data, (size_t)T * H * V * 2,
                       cudaMemcpyDeviceToHost) != cudaSuccess) {
            fprintf(stderr, "%s: T = %d: the check failed to run\n", WHO, T);
            wrong = -1;
            goto out;
        }
        if (memcmp(o1, o2, (size_t)T * H * V * 2)) {
            fprintf(stderr, "%s: T = %d: the replay's output differs from the direct step's\n", WHO, T);
            wrong++;
        }
        mlart_bench_table_row(o, &tab, name, v);
    }
    goto out;
fail:
    wrong = -1;
out:
    if (st)
        cudaStreamSynchronize(st);
    mlart_graph_cache_destroy(c.gc);
    mlart_graph_cache_destroy(c.direct);
    mlart_layer_destroy(c.ly);
    cudaFree(wuk), cudaFree(wuv), cudaFree(cache), cudaFree(c.pool);
    if (st)
        cudaStreamDestroy(st);
    mlart_context_destroy(ctx);
    free(o1), free(o2), free(c.h_req), free(c.h_lens), free(h_bt);
    return wrong;
}
