/* The DCP step over NCCL on CUDA devices, the layer's whole step with the
 * default backend: every rank holds its shard of the cache and its 16
 * heads, and its output must match one rank's plain step over the whole
 * cache (the same bytes in a group of one, NMSE <= 1e-4 otherwise, as in
 * tests/runtime/test_dcp.c); the step captured in a CUDA graph and replayed
 * gives the eager step's bytes, and so does the step through the graph
 * cache (include/mlart/graphs.h).  Both routings, both cache formats.  Alone
 * it is a group of one on one device (the DCP path with its NCCL
 * collectives, the mpirun -np 1 check); under `mpirun -np N` each process is
 * one rank on device local_rank % devices (tests/gpu/nccl_rank.h; port
 * 29512 by default).  One PASS/FAIL line a check; exit 0, 1 on a failure,
 * 77 without a device or without libnccl.so.2. */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime_api.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mlart/comm.h"
#include "mlart/graphs.h"
#include "mlart/mlart.h"
#include "nccl_rank.h"
#include "tests/runtime/fixture.h"

enum { H_ = 16, P_ = 192, R_ = 64, L_ = 512, V_ = 256, K_ = 256, PAGE_ = 64, T_ = 5, B_ = 3,
       MB_ = 4 };
#define NMSE_BOUND 1e-4
#define LSE_BOUND 1e-4

#define MLART_OR_DIE(call)                                                                    \
    do {                                                                                      \
        int rc_ = (call);                                                                     \
        if (rc_ < 0) {                                                                        \
            check(0, "%s: %s: %s", #call, mlart_status_name(rc_), mlart_last_error());       \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

static int device;

/* A dense device copy of n host bytes, viewed with `shape`. */
static mlart_tensor up(const void *h, mlart_dtype dt, int ndim, int64_t d0, int64_t d1,
                       int64_t d2)
{
    int64_t shape[3] = {d0, d1, d2};
    mlart_tensor t = mlart_tensor_dense(NULL, dt, device, ndim, shape);
    void *p = NULL;
    CUDA_OR_DIE(cudaMalloc(&p, t.extent));
    if (h)
        CUDA_OR_DIE(cudaMemcpy(p, h, t.extent, cudaMemcpyHostToDevice));
    t.data = p;
    t.base = p;
    return t;
}

typedef struct dcp_case {
    mlart_dcp_routing routing;
    int interleave;
    mlart_kv_format fmt;
} dcp_case;

static const dcp_case cases[] = {
    {MLART_DCP_A2A, 1, MLART_KV_FP8_DS_MLA},
    {MLART_DCP_AG_RS, 1, MLART_KV_BF16},
    {MLART_DCP_A2A, 64, MLART_KV_BF16},
    {MLART_DCP_AG_RS, 3, MLART_KV_FP8_DS_MLA},
};

/* The whole cache in format g->kv_format, written on the host by the
 * reference layer's cache write (bf16 rows: the fixture's as they are). */
static uint8_t *whole_cache(fx *f, mlart_context *host, const mlart_geometry *g)
{
    const size_t bpt = mlart_kv_bytes_per_token(g);
    uint8_t *c = calloc((size_t)f->num_slots, bpt);
    int32_t *slots = malloc(sizeof(int32_t) * (size_t)f->num_slots);
    mlart_layer_desc d = fx_desc(f, "reference");
    mlart_layer *ly = NULL;
    mlart_tensor lat = fx_view(f->cache, MLART_DTYPE_BF16, 2, f->num_slots, L_ + R_, 0),
                 sl = fx_view(slots, MLART_DTYPE_I32, 1, f->num_slots, 0, 0);
    for (int64_t i = 0; i < f->num_slots; i++)
        slots[i] = (int32_t)i;
    d.geom = *g;
    d.geom.heads = H_;
    d.w_uk_t = fx_view(f->w_uk_t, MLART_DTYPE_BF16, 3, H_, P_, L_);
    d.w_uv = fx_view(f->w_uv, MLART_DTYPE_BF16, 3, H_, L_, V_);
    d.kv_cache = fx_view(c, MLART_DTYPE_U8, 2, f->num_slots, (int64_t)bpt, 0);
    MLART_OR_DIE(mlart_layer_create(host, &d, &ly));
    MLART_OR_DIE(mlart_layer_write_kv(ly, &lat, &sl, NULL));
    mlart_layer_destroy(ly);
    free(slots);
    return c;
}

typedef struct rank_io {
    mlart_step_io io;
    mlart_tensor w_uk_t, w_uv, cache;
} rank_io;

/* This rank's step on the device: its heads of q (a strided view of the
 * whole q), its weights, `cache` rows of bpt bytes, block table bt [B,mb]. */
static rank_io rank_step(fx *f, int G, const uint8_t *cache, int64_t slots, size_t bpt,
                         const int32_t *bt, int64_t mb)
{
    rank_io r;
    const int64_t qrow = P_ + R_;
    memset(&r, 0, sizeof r);
    r.io.T = T_, r.io.B = B_;
    r.io.q = up(f->q, MLART_DTYPE_BF16, 3, T_, G, qrow);
    r.io.q.data = (uint16_t *)r.io.q.data + (size_t)me.rank * H_ * qrow;
    r.io.q.shape[1] = H_;
    r.io.idx = up(f->idx, MLART_DTYPE_I32, 2, T_, K_, 0);
    r.io.req_of_token = up(f->req, MLART_DTYPE_I32, 1, T_, 0, 0);
    r.io.seq_lens = up(f->lens, MLART_DTYPE_I32, 1, B_, 0, 0);
    r.io.block_table = up(bt, MLART_DTYPE_I32, 2, B_, mb, 0);
    r.io.o = up(NULL, MLART_DTYPE_BF16, 2, T_, (int64_t)H_ * V_, 0);
    r.io.lse = up(NULL, MLART_DTYPE_F32, 2, H_, T_, 0);
    r.w_uk_t = up(f->w_uk_t + (size_t)me.rank * H_ * P_ * L_, MLART_DTYPE_BF16, 3, H_, P_, L_);
    r.w_uv = up(f->w_uv + (size_t)me.rank * H_ * L_ * V_, MLART_DTYPE_BF16, 3, H_, L_, V_);
    r.cache = up(cache, MLART_DTYPE_U8, 2, slots, (int64_t)bpt, 0);
    return r;
}

static void rank_free(rank_io *r)
{
    const void *p[] = {r->io.q.base,  r->io.idx.base, r->io.req_of_token.base,
                       r->io.seq_lens.base, r->io.block_table.base, r->io.o.base,
                       r->io.lse.base, r->w_uk_t.base, r->w_uv.base, r->cache.base};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        cudaFree((void *)p[i]);
}

static mlart_layer *make_layer(mlart_context *ctx, const mlart_geometry *g, const rank_io *r,
                               int64_t slots, int64_t mb, mlart_comm *comm, const dcp_case *c,
                               int validate)
{
    mlart_layer_desc d;
    mlart_layer *ly = NULL;
    memset(&d, 0, sizeof d);
    d.geom = *g;
    d.geom.heads = H_;
    d.max_tokens = T_;
    d.max_requests = B_;
    d.max_blocks_per_req = (int32_t)mb;
    d.num_slots = slots;
    d.w_uk_t = r->w_uk_t;
    d.w_uv = r->w_uv;
    d.kv_cache = r->cache;
    d.dcp = comm;
    d.dcp_interleave = c->interleave;
    d.dcp_routing = c->routing;
    d.validate_indices = validate;
    MLART_OR_DIE(mlart_layer_create(ctx, &d, &ly));
    return ly;
}

/* Run a step (eagerly, or as two replays of its captured graph) with
 * poisoned outputs, wait for it (through the communicator when the step
 * has one) and bring o and lse to the host. */
static void run_step(mlart_layer *ly, mlart_comm *comm, rank_io *r, cudaStream_t s, int graph,
                     uint16_t *o, float *lse)
{
    const size_t ob = sizeof(uint16_t) * T_ * H_ * V_, lb = sizeof(float) * H_ * T_;
    CUDA_OR_DIE(cudaMemset(r->io.o.data, 0xff, ob));
    CUDA_OR_DIE(cudaMemset(r->io.lse.data, 0xff, lb));
    if (!graph) {
        MLART_OR_DIE(mlart_layer_decode(ly, &r->io, s));
    } else {
        cudaGraph_t gr;
        cudaGraphExec_t ex;
        int rc;
        CUDA_OR_DIE(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        rc = mlart_layer_decode(ly, &r->io, s);
        CUDA_OR_DIE(cudaStreamEndCapture(s, &gr));
        MLART_OR_DIE(rc);
        CUDA_OR_DIE(cudaGraphInstantiateWithFlags(&ex, gr, 0));
        for (int i = 0; i < 2; i++)
            CUDA_OR_DIE(cudaGraphLaunch(ex, s));
        CUDA_OR_DIE(cudaGraphExecDestroy(ex));
        CUDA_OR_DIE(cudaGraphDestroy(gr));
    }
    if (comm)
        MLART_OR_DIE(mlart_comm_wait(comm, s, 0));
    else
        CUDA_OR_DIE(cudaStreamSynchronize(s));
    CUDA_OR_DIE(cudaMemcpy(o, r->io.o.data, ob, cudaMemcpyDeviceToHost));
    CUDA_OR_DIE(cudaMemcpy(lse, r->io.lse.data, lb, cudaMemcpyDeviceToHost));
}

static double nmse(const uint16_t *a, const uint16_t *b, size_t n, int *nan)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double x = mlart_bf16_to_f32(a[i]), y = mlart_bf16_to_f32(b[i]);
        *nan |= isnan(x) != 0;
        num += (x - y) * (x - y);
        den += y * y;
    }
    return den > 0 ? num / den : num;
}

static void run_case(const dcp_case *c, mlart_comm *comm, mlart_context *ctx,
                     mlart_context *host, uint64_t seed, cudaStream_t s)
{
    const int D = me.size, G = D * H_, il = c->interleave;
    const size_t on = (size_t)T_ * H_ * V_, ln = (size_t)H_ * T_;
    const char *route = c->routing == MLART_DCP_A2A ? "a2a" : "ag_rs";
    fx f;
    mlart_geometry g;
    size_t bpt;
    uint8_t *whole, *shard;
    int32_t *bt_l;
    int64_t cap, mbl, slots_l;
    rank_io one, mine;
    mlart_layer *ly_one, *ly;
    uint16_t *o_one = malloc(on * 2), *o_eager = malloc(on * 2), *o_graph = malloc(on * 2);
    float *l_one = malloc(ln * 4), *l_eager = malloc(ln * 4), *l_graph = malloc(ln * 4);
    double e;
    int nan = 0, lse_ok = 1;

    fx_init(&f, G, P_, R_, L_, V_, K_, PAGE_, T_, B_, MB_, seed);
    g = f.g;
    g.kv_format = c->fmt;
    bpt = mlart_kv_bytes_per_token(&g);
    whole = whole_cache(&f, host, &g);

    /* one rank, its heads, the whole cache */
    one = rank_step(&f, G, whole, f.num_slots, bpt, f.bt, MB_);
    ly_one = make_layer(ctx, &g, &one, f.num_slots, MB_, NULL, c, 0);
    run_step(ly_one, NULL, &one, s, 0, o_one, l_one);

    /* this rank's shard, on blocks in reverse order */
    cap = mlart_dcp_local_len((int64_t)MB_ * PAGE_, 0, D, il); /* rank 0 holds the most */
    mbl = (cap + PAGE_ - 1) / PAGE_;
    slots_l = (int64_t)B_ * mbl * PAGE_;
    bt_l = malloc(sizeof(int32_t) * (size_t)(B_ * mbl));
    shard = calloc((size_t)slots_l, bpt);
    for (int64_t i = 0; i < B_ * mbl; i++)
        bt_l[i] = (int32_t)(B_ * mbl - 1 - i);
    for (int b = 0; b < B_; b++)
        for (int64_t p = 0; p < (int64_t)MB_ * PAGE_; p++) {
            int64_t lp = mlart_dcp_local_pos(p, D, il), src, dst;
            if (mlart_dcp_owner(p, D, il) != me.rank)
                continue;
            src = (int64_t)f.bt[b * MB_ + p / PAGE_] * PAGE_ + p % PAGE_;
            dst = (int64_t)bt_l[b * mbl + lp / PAGE_] * PAGE_ + lp % PAGE_;
            memcpy(shard + (size_t)dst * bpt, whole + (size_t)src * bpt, bpt);
        }
    mine = rank_step(&f, G, shard, slots_l, bpt, bt_l, mbl);
    ly = make_layer(ctx, &g, &mine, slots_l, mbl, comm, c, 0);
    run_step(ly, comm, &mine, s, 0, o_eager, l_eager);
    { /* validate_indices: the ranks' records agree (layer.c, dcp_check_agree) */
        mlart_layer *lyv = make_layer(ctx, &g, &mine, slots_l, mbl, comm, c, 1);
        run_step(lyv, comm, &mine, s, 0, o_graph, l_graph);
        check(!memcmp(o_eager, o_graph, on * 2) && !memcmp(l_eager, l_graph, ln * 4),
              "%s %s interleave %d: with validate_indices the step gives the eager step's bytes",
              route, mlart_kv_format_name(c->fmt), il);
        mlart_layer_destroy(lyv);
    }
    run_step(ly, comm, &mine, s, 1, o_graph, l_graph);

    check(!memcmp(o_eager, o_graph, on * 2) && !memcmp(l_eager, l_graph, ln * 4),
          "%s %s interleave %d: graph replay gives the eager step's bytes", route,
          mlart_kv_format_name(c->fmt), il);
    { /* the same step through the graph cache (its warm-ups and replays are
       * collectives: every rank creates it here) */
        static const int32_t sizes[] = {4, T_};
        const int64_t qrow = (int64_t)H_ * (P_ + R_);
        mlart_graph_cache *gc = NULL;
        const mlart_graph_bufs *b;
        int rc;
        MLART_OR_DIE(mlart_graph_cache_create(ly, sizes, 2, 0, s, &gc));
        b = mlart_graph_cache_bufs(gc);
        CUDA_OR_DIE(cudaMemcpy2D(b->io.q.data, (size_t)qrow * 2, mine.io.q.data,
                                 (size_t)mine.io.q.stride[0] * 2, (size_t)qrow * 2, T_,
                                 cudaMemcpyDeviceToDevice));
        CUDA_OR_DIE(cudaMemcpy(b->io.idx.data, mine.io.idx.data, (size_t)T_ * K_ * 4,
                               cudaMemcpyDeviceToDevice));
        CUDA_OR_DIE(cudaMemcpy(b->io.req_of_token.data, mine.io.req_of_token.data, T_ * 4,
                               cudaMemcpyDeviceToDevice));
        CUDA_OR_DIE(cudaMemcpy(b->io.seq_lens.data, mine.io.seq_lens.data, B_ * 4,
                               cudaMemcpyDeviceToDevice));
        CUDA_OR_DIE(cudaMemcpy(b->io.block_table.data, mine.io.block_table.data,
                               (size_t)B_ * mbl * 4, cudaMemcpyDeviceToDevice));
        CUDA_OR_DIE(cudaMemset(b->io.o.data, 0xff, on * 2));
        rc = mlart_graph_cache_run(gc, T_, B_, s);
        if (rc == T_)
            rc = mlart_comm_wait(comm, s, 0);
        CUDA_OR_DIE(cudaMemcpy(o_graph, b->io.o.data, on * 2, cudaMemcpyDeviceToHost));
        check(rc == 0 && mlart_graph_cache_graphs(gc) == 2 && !memcmp(o_eager, o_graph, on * 2),
              "%s %s interleave %d: the graph cache (%d graphs) gives the eager step's bytes "
              "(%s)", route, mlart_kv_format_name(c->fmt), il, mlart_graph_cache_graphs(gc),
              rc ? mlart_last_error() : "ok");
        mlart_graph_cache_destroy(gc);
    }
    e = nmse(o_eager, o_one, on, &nan);
    for (size_t i = 0; i < ln; i++)
        lse_ok &= isinf(l_one[i]) ? isinf(l_eager[i]) && l_eager[i] < 0
                                  : fabsf(l_eager[i] - l_one[i]) <= LSE_BOUND;
    if (D == 1)
        check(!memcmp(o_eager, o_one, on * 2) && !memcmp(l_eager, l_one, ln * 4),
              "%s %s: a group of one gives the plain step's bytes (NMSE %.3e)", route,
              mlart_kv_format_name(c->fmt), e);
    else
        check(!nan && e <= NMSE_BOUND && lse_ok,
              "%s %s interleave %d: against one rank over the whole cache NMSE %.3e (bound "
              "%.0e), lse %s", route, mlart_kv_format_name(c->fmt), il, e, NMSE_BOUND,
              lse_ok ? "within 1e-4" : "OFF");
    mlart_layer_destroy(ly_one);
    mlart_layer_destroy(ly);
    rank_free(&one);
    rank_free(&mine);
    free(whole), free(shard), free(bt_l);
    free(o_one), free(o_eager), free(o_graph), free(l_one), free(l_eager), free(l_graph);
    fx_free(&f);
}

/* validate_indices over a local group of two on this device, each rank a
 * thread with its own stream and layer over the same cache and heads:
 * with the same step both run it; with one entry of rank 1's idx emptied
 * both refuse it with MLART_ECOMM, well within the group's timeout (the
 * device side of layer.c's dcp_check_agree; the same records go over
 * NCCL). */
typedef struct pair_rank {
    mlart_layer *ly;
    rank_io r;
    int rc;
    char err[512];
} pair_rank;

static void *pair_run(void *arg)
{
    pair_rank *p = arg;
    cudaStream_t s;
    if (cudaSetDevice(device) != cudaSuccess ||
        cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
        p->rc = MLART_ECUDA;
        snprintf(p->err, sizeof p->err, "stream: %s", cudaGetErrorString(cudaGetLastError()));
        return NULL;
    }
    p->rc = mlart_layer_decode(p->ly, &p->r.io, s);
    if (p->rc < 0)
        snprintf(p->err, sizeof p->err, "%s", mlart_last_error());
    else if (cudaStreamSynchronize(s) != cudaSuccess)
        p->rc = MLART_ECUDA;
    cudaStreamDestroy(s);
    return NULL;
}

static void local_pair(mlart_context *ctx, mlart_context *host, uint64_t seed)
{
    static const dcp_case c = {MLART_DCP_A2A, 1, MLART_KV_BF16};
    fx f;
    mlart_geometry g;
    uint8_t *whole;
    size_t bpt;
    mlart_comm_group *grp = NULL;
    mlart_comm *lc[2] = {NULL, NULL};
    pair_rank p[2];
    fx_init(&f, H_, P_, R_, L_, V_, K_, PAGE_, T_, B_, MB_, seed);
    g = f.g;
    bpt = mlart_kv_bytes_per_token(&g);
    whole = whole_cache(&f, host, &g);
    for (int differ = 0; differ < 2; differ++) {
        double t0, secs;
        pthread_t th[2];
        struct timespec a, b;
        /* a group each: a rank whose communicator is destroyed has left it */
        MLART_OR_DIE(mlart_comm_group_create(2, device, 10000, &grp));
        for (int k = 0; k < 2; k++) {
            int64_t i = 0;
            memset(&p[k], 0, sizeof p[k]);
            MLART_OR_DIE(mlart_comm_local_create(grp, k, &lc[k]));
            while (differ && k == 1 && f.idx[i] < 0)
                i++;
            {
                const int32_t keep = f.idx[i];
                if (differ && k == 1)
                    f.idx[i] = -1; /* one valid entry emptied, on rank 1 only */
                p[k].r = rank_step(&f, H_, whole, f.num_slots, bpt, f.bt, MB_);
                f.idx[i] = keep;
            }
            p[k].ly = make_layer(ctx, &g, &p[k].r, f.num_slots, MB_, lc[k], &c, 1);
        }
        clock_gettime(CLOCK_MONOTONIC, &a);
        for (int k = 0; k < 2; k++)
            pthread_create(&th[k], NULL, pair_run, &p[k]);
        for (int k = 0; k < 2; k++)
            pthread_join(th[k], NULL);
        clock_gettime(CLOCK_MONOTONIC, &b);
        t0 = (double)a.tv_sec + 1e-9 * (double)a.tv_nsec;
        secs = (double)b.tv_sec + 1e-9 * (double)b.tv_nsec - t0;
        if (!differ)
            check(p[0].rc == 0 && p[1].rc == 0, "local pair on device %d, the same step: rank 0 "
                  "%s, rank 1 %s (%s%s)", device, mlart_status_name(p[0].rc),
                  mlart_status_name(p[1].rc), p[0].err, p[1].err);
        else
            check(p[0].rc == MLART_ECOMM && p[1].rc == MLART_ECOMM &&
                      strstr(p[0].err, "rank 1's idx is not rank 0's") &&
                      strstr(p[1].err, "rank 1's idx is not rank 0's") && secs < 5.0,
                  "local pair on device %d, rank 1's idx differs: rank 0 %s, rank 1 %s after "
                  "%.3f s (%s)", device, mlart_status_name(p[0].rc), mlart_status_name(p[1].rc),
                  secs, p[0].err);
        for (int k = 0; k < 2; k++) {
            mlart_layer_destroy(p[k].ly);
            rank_free(&p[k].r);
            mlart_comm_destroy(lc[k]);
        }
        mlart_comm_group_destroy(grp);
    }
    free(whole);
    fx_free(&f);
}

int main(void)
{
    mlart_comm *comm = NULL;
    mlart_context *ctx = NULL, *host = NULL;
    cudaStream_t s;
    uint64_t seed = fx_seed(), *d_seed = NULL, *seeds;
    int rc;
    if ((rc = nccl_rank_join(29512, &me, &device, &comm)) != 0)
        return rc;
    MLART_OR_DIE(mlart_context_create(device, &ctx));
    MLART_OR_DIE(mlart_context_create(-1, &host));
    CUDA_OR_DIE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    /* every rank takes rank 0's seed */
    seeds = calloc((size_t)me.size, sizeof *seeds);
    CUDA_OR_DIE(cudaMalloc((void **)&d_seed, sizeof(uint64_t) * (size_t)(me.size + 1)));
    CUDA_OR_DIE(cudaMemcpy(d_seed, &seed, sizeof seed, cudaMemcpyHostToDevice));
    MLART_OR_DIE(mlart_comm_all_gather(comm, d_seed, d_seed + 1, sizeof seed, s));
    MLART_OR_DIE(mlart_comm_wait(comm, s, 0));
    CUDA_OR_DIE(cudaMemcpy(seeds, d_seed + 1, sizeof(uint64_t) * (size_t)me.size,
                           cudaMemcpyDeviceToHost));
    seed = seeds[0];
    printf("seed %llu\n", (unsigned long long)seed);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(&cases[i], comm, ctx, host, seed + 7919u * i, s);
    if (me.rank == 0)
        local_pair(ctx, host, seed + 104729u);
    cudaFree(d_seed);
    free(seeds);
    cudaStreamDestroy(s);
    mlart_comm_destroy(comm);
    mlart_context_destroy(host);
    mlart_context_destroy(ctx);
    printf("%s: rank %d of %d, %d failures\n", failures ? "FAIL" : "PASS", me.rank, me.size,
           failures);
    return failures ? 1 : 0;
}
