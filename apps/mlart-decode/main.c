/* mlart-decode: run the MLA sparse-attention decode step of a config on
 * synthetic (or checkpoint) weights and a synthetic KV cache, time it, print
 * a fixed-width summary (a column widens for a value that outgrows it) and
 * an output checksum, and optionally verify the output against a float64
 * oracle and the reference backend. */
#define _POSIX_C_SOURCE 200809L
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "apps/mlart-decode/oracle.h"
#include "mlart/backend.h"
#include "mlart/comm.h"
#include "mlart/config.h"
#include "mlart/rendezvous.h"
#include "mlart/mlart.h"
#include "mlart/weights.h"
#include "ops/numerics.h"
#include "ops/ops.h"

#ifdef MLART_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#ifndef MLART_SOURCE_DIR
#define MLART_SOURCE_DIR "."
#endif
#define DEFAULT_CONFIG "configs/tiny-cpu.ini"
/* NMSE bound against the float64 oracle and the reference backend: a BF16
 * pipeline (q_mqa and attention output rounded to bf16) lands near 1e-5. */
#define VERIFY_NMSE 1e-4

static void usage(FILE *f)
{
    fprintf(f,
            "usage: mlart-decode [options]\n"
            "  --config FILE      INI config, at most once (default %s, looked up in\n"
            "                     the current directory, then in %s)\n"
            "  --backend NAME     attention backend (built-in or libmlart-backend-NAME.so\n"
            "                     in MLART_BACKEND_PATH)\n"
            "  --device D         cpu | cuda | auto (auto: cuda when a device is usable)\n"
            "  --kv-format F      bf16 | fp8_ds_mla\n"
            "  --batch N          requests per step (one new token each)\n"
            "  --context N        tokens cached per request before the first step\n"
            "  --steps N          decode steps to run\n"
            "  --seed N           seed of the synthetic weights, cache, queries, indices\n"
            "                     (decimal, or hexadecimal after 0x)\n"
            "  --set KEY=VALUE    any other config key\n"
            "  --weights FILE     take kv_b_proj from a .safetensors checkpoint of the\n"
            "                     config's heads; each rank loads its TP rank's heads ...\n"
            "  --layer N          ... from its layer N (default 0; needs --weights)\n"
            "  --verify           compare the output with a float64 oracle and, for another\n"
            "                     backend, with the reference backend; exit 1 on a mismatch\n"
            "  --dcp-local        run the dcp_size ranks of the DCP group as threads of this\n"
            "                     process, each with its shard of the cache (default: one\n"
            "                     rank's heads over the whole cache); under mpirun, a world\n"
            "                     of more than one rank, each process is one rank and NCCL\n"
            "                     joins each group of dcp_size ranks\n"
            "  --no-graph         CUDA: launch every step's kernels directly (default: from\n"
            "                     the second step on, replay one captured CUDA graph of the\n"
            "                     step; --graph asks for that explicitly)\n"
            "  --help             this text\n"
            "Precedence: command line > MLART_* environment > config file.\n",
            DEFAULT_CONFIG, MLART_SOURCE_DIR);
}

/* ---- small helpers ------------------------------------------------------ */

/* splitmix64: the k-th draw after state s is mix(s + k * RNG_GAMMA), so a
 * long fill can be cut into pieces that start anywhere in the sequence. */
#define RNG_GAMMA 0x9e3779b97f4a7c15ull

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += RNG_GAMMA);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float rng_uniform(uint64_t *s) /* [-1, 1) */
{
    return (float)((double)(rng_next(s) >> 11) * 0x1.0p-52 - 1.0);
}

typedef struct fill_piece {
    uint16_t *dst;
    int64_t n;
    uint64_t s; /* the state before the piece's first draw */
    float a;
} fill_piece;

static void *fill_piece_run(void *arg)
{
    fill_piece *f = arg;
    uint64_t s = f->s;
    for (int64_t i = 0; i < f->n; i++)
        f->dst[i] = mlart_f32_to_bf16(f->a * rng_uniform(&s));
    return NULL;
}

/* dst[i] = bf16(a * uniform) for n draws from *s, which it advances by n
 * draws: the bytes of one loop over rng_uniform, cut into pieces on up to
 * one thread per online CPU (the synthetic cache of a large run is billions
 * of draws).  A piece whose thread cannot be started runs here. */
static void fill_uniform_bf16(uint16_t *dst, int64_t n, float a, uint64_t *s)
{
    enum { MAX_THREADS = 64, MIN_PIECE = 1 << 18 };
    fill_piece piece[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS];
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int64_t nt = n / MIN_PIECE;
    if (nt > ncpu)
        nt = ncpu;
    if (nt > MAX_THREADS)
        nt = MAX_THREADS;
    if (nt < 1)
        nt = 1;
    for (int64_t t = 0, at = 0; t < nt; t++) {
        const int64_t len = n / nt + (t < n % nt);
        piece[t] = (fill_piece){dst + at, len, *s + (uint64_t)at * RNG_GAMMA, a};
        at += len;
    }
    for (int64_t t = 1; t < nt; t++)
        started[t] = pthread_create(&tid[t], NULL, fill_piece_run, &piece[t]) == 0;
    fill_piece_run(&piece[0]);
    for (int64_t t = 1; t < nt; t++) {
        if (started[t])
            pthread_join(tid[t], NULL);
        else
            fill_piece_run(&piece[t]);
    }
    *s += (uint64_t)n * RNG_GAMMA;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Detail of a failure of this program's own (an allocation), which the
 * library's mlart_last_error() does not hold; per thread, since the ranks
 * of --dcp-local are threads.  Cleared by fail(). */
static _Thread_local char app_detail[256];

static int app_error(int rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(app_detail, sizeof app_detail, fmt, ap);
    va_end(ap);
    return rc;
}

/* Report a failed step of the run: this program's detail when it set one,
 * else the library's. */
static int fail(int rc, const char *what)
{
    const char *detail = app_detail[0] ? app_detail : mlart_last_error();
    fprintf(stderr, "mlart-decode: %s failed: %s%s%s\n", what, mlart_status_name(rc), detail[0] ? ": " : "",
            detail);
    app_detail[0] = 0;
    return rc;
}

static int out_of_host_memory(void)
{
    return app_error(MLART_ENOMEM, "out of host memory");
}

/* Memory on the run's device: host malloc, or cudaMalloc. */
static int dev_alloc(int dev, size_t bytes, void **out)
{
    *out = NULL;
    if (bytes == 0)
        bytes = 1;
    if (dev < 0) {
        *out = calloc(1, bytes);
        return *out ? 0
                    : app_error(MLART_ENOMEM, "%zu bytes (%.2f GiB) of host memory are not available", bytes,
                                (double)bytes / (1u << 30));
    }
#ifdef MLART_WITH_CUDA
    {
        cudaError_t e = cudaMalloc(out, bytes);
        if (e == cudaSuccess && (e = cudaMemset(*out, 0, bytes)) != cudaSuccess) {
            cudaFree(*out);
            *out = NULL;
        }
        if (e != cudaSuccess)
            return app_error(MLART_ENOMEM, "%zu bytes (%.2f GiB) on CUDA device %d: %s", bytes,
                             (double)bytes / (1u << 30), dev, cudaGetErrorString(e));
    }
    return 0;
#else
    return app_error(MLART_ENODEV, "this build has no CUDA");
#endif
}

static void dev_free(int dev, void *p)
{
    if (!p)
        return;
    if (dev < 0)
        free(p);
#ifdef MLART_WITH_CUDA
    else
        cudaFree(p);
#endif
}

static int dev_copy(int dev, void *dst, const void *src, size_t bytes, int to_device)
{
    if (dev < 0) {
        if (dst != src)
            memcpy(dst, src, bytes);
        return 0;
    }
#ifdef MLART_WITH_CUDA
    const cudaError_t e =
        cudaMemcpy(dst, src, bytes, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost);
    if (e != cudaSuccess)
        return app_error(MLART_ECUDA, "cudaMemcpy of %zu bytes: %s", bytes, cudaGetErrorString(e));
    return 0;
#else
    (void)dst, (void)src, (void)bytes, (void)to_device;
    return app_error(MLART_ENODEV, "this build has no CUDA");
#endif
}

static int dev_sync(int dev)
{
#ifdef MLART_WITH_CUDA
    if (dev >= 0 && cudaDeviceSynchronize() != cudaSuccess) {
        fprintf(stderr, "mlart-decode: CUDA error: %s\n", cudaGetErrorString(cudaGetLastError()));
        return MLART_ECUDA;
    }
#else
    (void)dev;
#endif
    return 0;
}

static mlart_tensor view(void *data, mlart_dtype dt, int dev, int ndim, int64_t d0, int64_t d1,
                         int64_t d2)
{
    int64_t shape[3] = {d0, d1, d2};
    return mlart_tensor_dense(data, dt, dev, ndim, shape);
}

/* ---- one layer's state --------------------------------------------------- */

typedef struct layer_run {
    mlart_layer *layer, *ref; /* ref: reference backend on the same cache (--verify) */
    uint16_t *h_kv_b_proj;    /* host copy, for the oracle */
    void *d_kv_b_proj, *d_cache, *d_o, *d_o_ref;
    uint8_t *h_cache;         /* host image of the cache (the cache itself on the CPU) */
    uint16_t *h_o, *h_o_ref;
} layer_run;

typedef struct run {
    mlart_config cfg;
    int dev;             /* -1 host */
    mlart_context *ctx;
    int verify;
    int graph; /* CUDA: replay one captured graph of the step (default; 0: --no-graph) */
    const char *weights;
    int layer0;
    const char *config_path;
    int32_t B, MB;
    int64_t num_slots;
    size_t bpt;
    layer_run *layers;
    /* per-step host inputs and their device copies */
    uint16_t *h_q, *h_new;
    int32_t *h_idx, *h_req, *h_lens, *h_bt, *h_slots, *pool;
    void *d_q, *d_new, *d_idx, *d_req, *d_lens, *d_bt, *d_slots, *d_lse;
    double *oracle_o, *oracle_lse;
    double setup_s; /* wall time of setup(): weights, every layer's context rows, backends */
    /* decode-context parallel: comm NULL for none.  This rank's shard of
     * every request: MBl blocks (block table h_bt_l) in num_slots_l slots;
     * h_bt, MB and num_slots are then the whole cache's, for the oracle. */
    mlart_comm *comm;
    int rank;            /* world rank (its heads' weights and queries); 0 without ranks */
    int world;           /* ranks of the launch (mpirun); 1 alone or under --dcp-local */
    int dcp_rank, dcp_size;
    int32_t MBl;
    int64_t num_slots_l;
    int32_t *h_bt_l, *h_slots_l;
    int quiet;           /* a rank other than 0 prints only its result lines */
} run;

/* kv_b_proj of layer `li`: from the checkpoint, or uniform in +-4/sqrt(P). */
static int make_weights(run *r, int li, uint16_t *dst)
{
    const mlart_geometry *g = &r->cfg.geom;
    const size_t n = (size_t)g->heads * (size_t)(g->qk_nope + g->v_head) * (size_t)g->kv_lora;
    if (r->weights) {
        /* world (or --dcp-local) rank k holds TP rank k's heads [k*H, (k+1)*H) of a
         * checkpoint that must hold all heads_total of them */
        int64_t total = 0;
        int rc = mlart_safetensors_kv_b_proj_heads(r->weights, r->layer0 + li, g, &total);
        if (rc < 0)
            return fail(rc, "reading kv_b_proj's shape");
        if (total != r->cfg.heads_total) {
            return fail(app_error(MLART_ESHAPE, "%s: layer %d's kv_b_proj holds %lld heads, the "
                                  "config has heads = %d", r->weights, r->layer0 + li,
                                  (long long)total, r->cfg.heads_total),
                        "checking kv_b_proj");
        }
        rc = mlart_safetensors_load_kv_b_proj(r->weights, r->layer0 + li, g, r->rank * g->heads,
                                              dst, n * 2);
        return rc < 0 ? fail(rc, "loading kv_b_proj") : 0;
    }
    {
        uint64_t s = r->cfg.seed * 1000003u + (uint64_t)li * 7919u + 1 + (uint64_t)r->rank * 104729u;
        fill_uniform_bf16(dst, (int64_t)n, 4.0f / sqrtf((float)g->qk_nope), &s);
    }
    return 0;
}

/* Views of n new rows and their slots on the run's device; on CUDA the host
 * rows are uploaded first (into d_new / d_slots). */
static int kv_views(run *r, const uint16_t *rows, const int32_t *slots, int64_t n,
                    mlart_tensor *lat, mlart_tensor *sl)
{
    const mlart_geometry *g = &r->cfg.geom;
    int rc;
    if (r->dev < 0) {
        *lat = view((void *)rows, MLART_DTYPE_BF16, -1, 2, n, g->kv_lora + g->rope, 0);
        *sl = view((void *)slots, MLART_DTYPE_I32, -1, 1, n, 0, 0);
        return 0;
    }
    if ((rc = dev_copy(r->dev, r->d_new, rows, (size_t)n * (size_t)(g->kv_lora + g->rope) * 2,
                       1)) < 0 ||
        (rc = dev_copy(r->dev, r->d_slots, slots, (size_t)n * 4, 1)) < 0)
        return fail(rc, "uploading the new rows and their slots");
    *lat = view(r->d_new, MLART_DTYPE_BF16, r->dev, 2, n, g->kv_lora + g->rope, 0);
    *sl = view(r->d_slots, MLART_DTYPE_I32, r->dev, 1, n, 0, 0);
    return 0;
}

/* --verify on CUDA or under DCP: the same rows into the host image of layer
 * li's whole cache, by the CPU quantiser, for the oracle. */
static int mirror_rows(run *r, int li, const uint16_t *rows, const int32_t *slots, int64_t n)
{
    const mlart_geometry *g = &r->cfg.geom;
    layer_run *lr = &r->layers[li];
    mlart_tensor cache, lat, sl;
    int rc;
    if (!lr->h_cache || lr->h_cache == lr->d_cache)
        return 0;
    cache = view(lr->h_cache, MLART_DTYPE_U8, -1, 2, r->num_slots, (int64_t)r->bpt, 0);
    lat = view((void *)rows, MLART_DTYPE_BF16, -1, 2, n, g->kv_lora + g->rope, 0);
    sl = view((void *)slots, MLART_DTYPE_I32, -1, 1, n, 0, 0);
    rc = mlart_kv_write_cpu(g, &cache, &lat, &sl);
    return rc < 0 ? fail(rc, "mlart_kv_write_cpu") : 0;
}

/* Write rows [n, L+R] (host) into slots (host) of layer li's cache: under
 * DCP the shard's slots (-1 where another rank holds the position), the
 * whole cache's for the host image. */
static int write_rows(run *r, int li, const uint16_t *rows, const int32_t *slots,
                      const int32_t *slots_l, int64_t n)
{
    mlart_tensor lat, sl;
    int rc;
    if ((rc = kv_views(r, rows, r->comm ? slots_l : slots, n, &lat, &sl)) < 0)
        return rc;
    rc = mlart_layer_write_kv(r->layers[li].layer, &lat, &sl, NULL);
    if (rc < 0)
        return fail(rc, "mlart_layer_write_kv");
    return mirror_rows(r, li, rows, slots, n);
}

static int32_t slot_of(const run *r, int32_t req, int32_t pos)
{
    const int32_t page = r->cfg.geom.page_size;
    /* below num_slots, which setup() keeps within int32 */
    return (int32_t)((int64_t)r->h_bt[(int64_t)req * r->MB + pos / page] * page + pos % page);
}

/* Under DCP: the slot of position pos in this rank's shard, -1 on another rank. */
static int32_t local_slot_of(const run *r, int32_t req, int32_t pos)
{
    const int32_t page = r->cfg.geom.page_size, il = r->cfg.dcp_interleave;
    int64_t lp;
    if (!r->comm)
        return slot_of(r, req, pos);
    if (mlart_dcp_owner(pos, r->dcp_size, il) != r->dcp_rank)
        return -1;
    lp = mlart_dcp_local_pos(pos, r->dcp_size, il);
    return (int32_t)((int64_t)r->h_bt_l[(int64_t)req * r->MBl + lp / page] * page + lp % page);
}

/* Fresh synthetic latent+rope rows. */
static void fill_rows(uint16_t *rows, int64_t n, int width, uint64_t *s)
{
    fill_uniform_bf16(rows, n * width, 1.0f, s);
}

static int setup_layer(run *r, int li)
{
    const mlart_geometry *g = &r->cfg.geom;
    layer_run *lr = &r->layers[li];
    const int64_t H = g->heads, P = g->qk_nope, V = g->v_head, L = g->kv_lora, R = g->rope;
    const size_t wbytes = (size_t)(H * (P + V) * L) * 2, cbytes = (size_t)r->num_slots * r->bpt,
                 cbytes_l = r->comm ? (size_t)r->num_slots_l * r->bpt : cbytes;
    mlart_layer_desc d;
    mlart_tensor kvb;
    mlart_context *ctx = r->ctx;
    int rc;
    lr->h_kv_b_proj = malloc(wbytes);
    lr->h_o = malloc((size_t)r->B * (size_t)(H * V) * 2);
    if (!lr->h_kv_b_proj || !lr->h_o)
        return fail(out_of_host_memory(), "allocating host buffers");
    if ((rc = make_weights(r, li, lr->h_kv_b_proj)) < 0)
        return rc;
    if (r->dev < 0) {
        lr->d_kv_b_proj = lr->h_kv_b_proj;
    } else if ((rc = dev_alloc(r->dev, wbytes, &lr->d_kv_b_proj)) < 0 ||
               (rc = dev_copy(r->dev, lr->d_kv_b_proj, lr->h_kv_b_proj, wbytes, 1)) < 0) {
        return fail(rc, "uploading kv_b_proj");
    }
    if ((rc = dev_alloc(r->dev, cbytes_l, &lr->d_cache)) < 0 ||
        (rc = dev_alloc(r->dev, (size_t)r->B * (size_t)(H * V) * 2, &lr->d_o)) < 0)
        return fail(rc, "allocating the KV cache");
    if (r->dev < 0 && !r->comm)
        lr->h_cache = lr->d_cache;
    else if (r->verify && !(lr->h_cache = calloc(1, cbytes)))
        return fail(out_of_host_memory(), "allocating the host cache image");

    memset(&d, 0, sizeof d);
    d.geom = *g;
    d.backend = r->cfg.backend[0] ? r->cfg.backend : NULL;
    d.max_tokens = r->B;
    d.max_requests = r->B;
    d.max_blocks_per_req = r->comm ? r->MBl : r->MB;
    d.num_slots = r->comm ? r->num_slots_l : r->num_slots;
    d.dcp = r->comm;
    d.dcp_interleave = r->cfg.dcp_interleave;
    d.dcp_routing = r->cfg.dcp_routing;
    /* [runtime] early_weights: this program writes the weights once, before
     * the first step, so it may make the promise */
    d.early_weights = r->cfg.early_weights;
    /* [runtime] validate_indices: each step's indices checked on the host
     * first (and under DCP the ranks' steps compared), no CUDA graph */
    d.validate_indices = r->cfg.validate_indices;
    /* checkpoint layout: strided views, which the layer makes dense once */
    kvb = view(lr->d_kv_b_proj, MLART_DTYPE_BF16, r->dev, 2, H * (P + V), L, 0);
    if ((rc = mlart_weights_from_kv_b_proj(g, &kvb, &d.w_uk_t, &d.w_uv)) < 0)
        return fail(rc, "mlart_weights_from_kv_b_proj");
    d.kv_cache = view(lr->d_cache, MLART_DTYPE_U8, r->dev, 2, d.num_slots, (int64_t)r->bpt, 0);
    rc = mlart_layer_create(ctx, &d, &lr->layer);
    /* under DCP the float64 oracle over the whole cache is the check */
    if (rc == 0 && r->verify && !r->comm &&
        strcmp(mlart_layer_backend_name(lr->layer), "reference")) {
        d.backend = "reference";
        rc = mlart_layer_create(ctx, &d, &lr->ref);
        if (rc == 0)
            rc = dev_alloc(r->dev, (size_t)r->B * (size_t)(H * V) * 2, &lr->d_o_ref);
        if (rc == 0 && !(lr->h_o_ref = malloc((size_t)r->B * (size_t)(H * V) * 2)))
            rc = out_of_host_memory();
        if (rc < 0)
            return fail(rc, "creating the reference layer for --verify");
    }
    if (rc < 0)
        return fail(rc, "mlart_layer_create");

    /* the context: every request's first `context` tokens, in chunks */
    {
        const int64_t chunk = 4096, W = L + R;
        uint64_t s = r->cfg.seed * 2654435761u + (uint64_t)li * 97u + 3;
        for (int32_t b = 0; b < r->B; b++)
            for (int64_t p0 = 0; p0 < r->cfg.context; p0 += chunk) {
                int64_t n = r->cfg.context - p0 < chunk ? r->cfg.context - p0 : chunk;
                fill_rows(r->h_new, n, (int)W, &s);
                for (int64_t i = 0; i < n; i++) {
                    r->h_slots[i] = slot_of(r, b, (int32_t)(p0 + i));
                    r->h_slots_l[i] = local_slot_of(r, b, (int32_t)(p0 + i));
                }
                if ((rc = write_rows(r, li, r->h_new, r->h_slots, r->h_slots_l, n)) < 0)
                    return rc;
            }
    }
    return dev_sync(r->dev);
}

static void destroy_run(run *r)
{
    for (int li = 0; r->layers && li < r->cfg.layers; li++) {
        layer_run *lr = &r->layers[li];
        mlart_layer_destroy(lr->layer);
        mlart_layer_destroy(lr->ref);
        if (r->dev >= 0) /* on the CPU d_kv_b_proj is h_kv_b_proj, freed below */
            dev_free(r->dev, lr->d_kv_b_proj);
        if (lr->h_cache != lr->d_cache) /* on the CPU without DCP h_cache is d_cache */
            free(lr->h_cache);
        dev_free(r->dev, lr->d_cache);
        dev_free(r->dev, lr->d_o);
        dev_free(r->dev, lr->d_o_ref);
        free(lr->h_kv_b_proj);
        free(lr->h_o);
        free(lr->h_o_ref);
    }
    free(r->layers);
    mlart_context_destroy(r->ctx);
    if (r->dev >= 0) {
        dev_free(r->dev, r->d_q), dev_free(r->dev, r->d_new), dev_free(r->dev, r->d_idx);
        dev_free(r->dev, r->d_req), dev_free(r->dev, r->d_lens), dev_free(r->dev, r->d_bt);
        dev_free(r->dev, r->d_slots), dev_free(r->dev, r->d_lse);
    } else {
        free(r->d_lse);
    }
    free(r->h_q), free(r->h_new), free(r->h_idx), free(r->h_req), free(r->h_lens);
    free(r->h_bt), free(r->h_slots), free(r->pool), free(r->oracle_o), free(r->oracle_lse);
    free(r->h_bt_l), free(r->h_slots_l);
    mlart_comm_destroy(r->comm);
}

/* Fresh query rows and top-k positions for step `step`. */
static void make_step_inputs(run *r, int step)
{
    const mlart_geometry *g = &r->cfg.geom;
    const int64_t H = g->heads, P = g->qk_nope, R = g->rope, K = g->topk;
    const int64_t nq = (int64_t)r->B * H * (P + R);
    uint64_t s = r->cfg.seed * 0x9e3779b1u + (uint64_t)step * 131u + 5;
    /* each rank its own heads' queries; the positions the same on every rank */
    uint64_t sq = s + (uint64_t)r->rank * 104729u;
    fill_uniform_bf16(r->h_q, nq, 1.0f, &sq);
    s += (uint64_t)nq * RNG_GAMMA;
    for (int32_t b = 0; b < r->B; b++) {
        const int32_t len = r->h_lens[b];
        int32_t *out = r->h_idx + (int64_t)b * K;
        /* partial Fisher-Yates: K distinct positions of [0, len), -1 beyond len */
        for (int32_t i = 0; i < len; i++)
            r->pool[i] = i;
        for (int64_t k = 0; k < K; k++) {
            if (k < len) {
                int64_t j = k + (int64_t)(rng_next(&s) % (uint64_t)(len - k));
                int32_t x = r->pool[k];
                r->pool[k] = r->pool[j], r->pool[j] = x;
                out[k] = r->pool[k];
            } else {
                out[k] = -1;
            }
        }
    }
}

/* NMSE and max |a-b| of a (bf16) against b (double); nan counts as failure. */
static void compare(const uint16_t *a, const double *b, int64_t n, double *max_abs, double *nmse,
                    int *nan)
{
    double num = 0.0, den = 0.0, mx = 0.0;
    *nan = 0;
    for (int64_t i = 0; i < n; i++) {
        double x = mlart_bf16_to_f32(a[i]), d = x - b[i];
        if (isnan(x) || isinf(x))
            *nan = 1;
        num += d * d;
        den += b[i] * b[i];
        if (fabs(d) > mx)
            mx = fabs(d);
    }
    *max_abs = mx;
    *nmse = den > 0.0 ? num / den : num;
}

typedef struct verify_stats {
    double max_abs, nmse, ref_max_abs, ref_nmse;
    int nan, lse_bad, compared_ref;
} verify_stats;

static int verify_layer(run *r, int li, verify_stats *vs)
{
    const mlart_geometry *g = &r->cfg.geom;
    layer_run *lr = &r->layers[li];
    const int64_t n = (int64_t)r->B * g->heads * g->v_head;
    double mx, nm;
    int nan, rc;
    float *lse = malloc(sizeof(float) * (size_t)g->heads * (size_t)r->B);
    if (!lse)
        return fail(out_of_host_memory(), "verify");
    rc = mlart_decode_oracle(g, r->B, r->h_q, lr->h_kv_b_proj, lr->h_cache, r->num_slots,
                             r->h_idx, r->h_req, r->h_lens, r->h_bt, r->MB, r->oracle_o,
                             r->oracle_lse);
    if (rc < 0) /* it sets no detail of its own */
        rc = app_error(rc, "the float64 oracle: %s", mlart_strerror(rc));
    if (rc == 0)
        rc = dev_copy(r->dev, lse, r->d_lse, sizeof(float) * (size_t)(g->heads * r->B), 0);
    if (rc < 0) {
        free(lse);
        return fail(rc, "verify");
    }
    compare(lr->h_o, r->oracle_o, n, &mx, &nm, &nan);
    vs->max_abs = fmax(vs->max_abs, mx);
    vs->nmse = fmax(vs->nmse, nm);
    vs->nan |= nan;
    for (int64_t i = 0; li == r->cfg.layers - 1 && i < (int64_t)g->heads * r->B; i++) {
        double want = r->oracle_lse[i]; /* the lse buffer holds the last layer's */
        if (isinf(want) ? !(isinf(lse[i]) && lse[i] < 0)
                        : !(fabs(lse[i] - want) <= 1e-2 * (1.0 + fabs(want))))
            vs->lse_bad++;
    }
    free(lse);
    if (lr->ref) {
        double *ro = malloc(sizeof(double) * (size_t)n);
        if (!ro)
            return fail(out_of_host_memory(), "verify");
        for (int64_t i = 0; i < n; i++)
            ro[i] = mlart_bf16_to_f32(lr->h_o_ref[i]);
        compare(lr->h_o, ro, n, &mx, &nm, &nan);
        free(ro);
        vs->ref_max_abs = fmax(vs->ref_max_abs, mx);
        vs->ref_nmse = fmax(vs->ref_nmse, nm);
        vs->nan |= nan;
        vs->compared_ref = 1;
    }
    return 0;
}

/* One step's work on `stream`: the new tokens' KV rows, then the decode of
 * every layer (io->o set per layer). */
static int enqueue_step(run *r, mlart_step_io *io, const mlart_tensor *lat,
                        const mlart_tensor *slots, void *stream)
{
    const mlart_geometry *g = &r->cfg.geom;
    int rc;
    for (int li = 0; li < r->cfg.layers; li++) {
        layer_run *lr = &r->layers[li];
        rc = mlart_layer_write_kv(lr->layer, lat, slots, stream);
        if (rc < 0)
            return fail(rc, "mlart_layer_write_kv");
        io->o = view(lr->d_o, MLART_DTYPE_BF16, r->dev, 2, r->B, (int64_t)g->heads * g->v_head, 0);
        rc = mlart_layer_decode(lr->layer, io, stream);
        if (rc < 0)
            return fail(rc, "mlart_layer_decode");
    }
    return 0;
}

/* Whether every layer's backend may be captured in a CUDA graph. */
static int graph_safe(const run *r)
{
    for (int li = 0; li < r->cfg.layers; li++) {
        const mlart_layout_contract *c = mlart_layer_contract(r->layers[li].layer);
        if (!c || !c->graph_safe)
            return 0;
    }
    return 1;
}

#ifdef MLART_WITH_CUDA
/* Capture one step (enqueue_step) on `st` and instantiate it.  Every
 * pointer the step reads or writes is the same at every step (the inputs
 * are uploaded into the same device buffers), so the graph replays any
 * step of the run. */
static int capture_step(run *r, mlart_step_io *io, const mlart_tensor *lat,
                        const mlart_tensor *slots, cudaStream_t st, cudaGraphExec_t *exec)
{
    cudaGraph_t graph = NULL;
    cudaError_t e = cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal);
    int rc;
    if (e != cudaSuccess) {
        fprintf(stderr, "mlart-decode: cudaStreamBeginCapture: %s\n", cudaGetErrorString(e));
        return MLART_ECUDA;
    }
    rc = enqueue_step(r, io, lat, slots, st);
    e = cudaStreamEndCapture(st, &graph); /* always: it ends the capture mode */
    if (rc < 0) {
        if (graph)
            cudaGraphDestroy(graph);
        return rc;
    }
    if (e == cudaSuccess)
        e = cudaGraphInstantiate(exec, graph, 0);
    if (graph)
        cudaGraphDestroy(graph);
    if (e != cudaSuccess) {
        fprintf(stderr, "mlart-decode: capturing the step in a CUDA graph failed: %s (the "
                        "backend declares itself graph-safe; with --no-graph the kernels are "
                        "launched directly)\n",
                cudaGetErrorString(e));
        return MLART_ECUDA;
    }
    return 0;
}
#endif

/* The summary table: a header line and one line of values.  A column is as
 * wide as the widest of its usual width, its header and its value, so that
 * an absurd size (a batch of a million, a topk of ten digits) or a long
 * backend name widens its column and the two lines stay aligned instead of
 * pushing every later value out of place; the first three columns are
 * aligned left, the numbers right. */
enum { TABLE_COLS = 16 };

static void print_table(const char *const cell[TABLE_COLS])
{
    static const char *const head[TABLE_COLS] = {
        "backend", "device", "kv_format", "heads", "P", "R", "L", "V", "topk", "batch",
        "context", "steps", "layers", "tokens", "ms/step", "tokens/s"};
    static const int usual[TABLE_COLS] = {16, 6, 10, 5, 4, 3, 4, 4, 5, 5, 8, 6, 6, 8, 10, 12};
    int w[TABLE_COLS];
    for (int c = 0; c < TABLE_COLS; c++) {
        /* every text is short: a number, or a name of under 64 characters */
        const int hl = (int)strlen(head[c]), vl = (int)strlen(cell[c]);
        w[c] = usual[c] > hl ? usual[c] : hl;
        if (w[c] < vl)
            w[c] = vl;
    }
    for (int line = 0; line < 2; line++) {
        const char *const *text = line ? cell : head;
        for (int c = 0; c < TABLE_COLS; c++)
            printf(c < 3 ? "%s%-*s" : "%s%*s", c ? " " : "", w[c], text[c]);
        putchar('\n');
    }
}

static int run_decode(run *r)
{
    const mlart_geometry *g = &r->cfg.geom;
    const int64_t H = g->heads, P = g->qk_nope, R = g->rope, L = g->kv_lora, V = g->v_head;
    const int64_t K = g->topk;
    const int dev = r->dev;
    mlart_step_io io;
    uint64_t fnv = 0xcbf29ce484222325ull;
    /* step 0 is timed apart: it carries one-time work (the first launch of
     * each kernel loads its module, backends set kernel attributes), so
     * ms/step and tokens/s cover steps 1.. when there are at least two */
    double t_decode = 0.0, t_first = 0.0, t_capture = 0.0, t_start = now_s(), t_progress = 0.0;
    /* CUDA: the steps run on a stream of their own (ordered with the legacy
     * stream of the uploads) and from step 1 on as the replay of one CUDA
     * graph of the step, captured at step 1, unless a backend is not
     * graph-safe; with --no-graph on the legacy stream, launched directly */
    void *stream = NULL;
    const int use_graph = r->dev >= 0 && r->graph && graph_safe(r) &&
                          (!r->comm || mlart_comm_graph_safe(r->comm));
    const int32_t *bt = r->comm ? r->h_bt_l : r->h_bt;
    const int32_t mb = r->comm ? r->MBl : r->MB;
#ifdef MLART_WITH_CUDA
    cudaGraphExec_t exec = NULL;
    if (use_graph) {
        cudaStream_t st;
        if (cudaStreamCreate(&st) != cudaSuccess) {
            fprintf(stderr, "mlart-decode: cudaStreamCreate failed\n");
            return MLART_ECUDA;
        }
        stream = st;
    }
#endif
    int progress = 0, rc;
    verify_stats vs;
    uint64_t s_new = r->cfg.seed * 40503u + 11;
    memset(&vs, 0, sizeof vs);

    memset(&io, 0, sizeof io);
    io.T = r->B;
    io.B = r->B;
    io.q = view(dev < 0 ? (void *)r->h_q : r->d_q, MLART_DTYPE_BF16, dev, 3, r->B, H, P + R);
    io.idx = view(dev < 0 ? (void *)r->h_idx : r->d_idx, MLART_DTYPE_I32, dev, 2, r->B, K, 0);
    io.req_of_token = view(dev < 0 ? (void *)r->h_req : r->d_req, MLART_DTYPE_I32, dev, 1, r->B,
                           0, 0);
    io.seq_lens = view(dev < 0 ? (void *)r->h_lens : r->d_lens, MLART_DTYPE_I32, dev, 1, r->B, 0,
                       0);
    io.block_table = view(dev < 0 ? (void *)bt : r->d_bt, MLART_DTYPE_I32, dev, 2, r->B, mb, 0);
    io.lse = view(r->d_lse, MLART_DTYPE_F32, dev, 2, H, r->B, 0);
    if (dev >= 0 && (rc = dev_copy(dev, r->d_bt, bt, (size_t)r->B * mb * 4, 1)) < 0)
        return fail(rc, "uploading the block table");
    if (dev >= 0 && (rc = dev_copy(dev, r->d_req, r->h_req, (size_t)r->B * 4, 1)) < 0)
        return fail(rc, "uploading the requests of the tokens");

    for (int step = 0; step < r->cfg.steps; step++) {
        mlart_tensor new_lat, new_slots;
        double t0;
        /* this step's new token of each request lands at position context + step */
        for (int32_t b = 0; b < r->B; b++) {
            r->h_lens[b] = r->cfg.context + step + 1;
            r->h_slots[b] = slot_of(r, b, r->cfg.context + step);
            r->h_slots_l[b] = local_slot_of(r, b, r->cfg.context + step);
        }
        fill_rows(r->h_new, r->B, (int)(L + R), &s_new);
        make_step_inputs(r, step);
        if (dev >= 0 &&
            ((rc = dev_copy(dev, r->d_q, r->h_q, (size_t)r->B * H * (P + R) * 2, 1)) < 0 ||
             (rc = dev_copy(dev, r->d_idx, r->h_idx, (size_t)r->B * K * 4, 1)) < 0 ||
             (rc = dev_copy(dev, r->d_lens, r->h_lens, (size_t)r->B * 4, 1)) < 0))
            return fail(rc, "uploading the step's queries, indices and lengths");
        if ((rc = kv_views(r, r->h_new, r->comm ? r->h_slots_l : r->h_slots, r->B, &new_lat,
                           &new_slots)) < 0)
            return rc;
        t0 = now_s();
        if (use_graph && step > 0) {
#ifdef MLART_WITH_CUDA
            cudaError_t e;
            if (!exec) {
                if ((rc = capture_step(r, &io, &new_lat, &new_slots, (cudaStream_t)stream,
                                       &exec)) < 0)
                    return rc;
                t_capture = now_s() - t0;
                t0 = now_s();
            }
            if ((e = cudaGraphLaunch(exec, (cudaStream_t)stream)) != cudaSuccess) {
                fprintf(stderr, "mlart-decode: cudaGraphLaunch: %s\n", cudaGetErrorString(e));
                return MLART_ECUDA;
            }
#endif
        } else if ((rc = enqueue_step(r, &io, &new_lat, &new_slots, stream)) < 0) {
            return rc;
        }
        /* a step with NCCL collectives: a dead or hung peer ends in an error
         * (the communicator aborted), not in a synchronise that never returns */
        if (r->comm && dev >= 0 && (rc = mlart_comm_wait(r->comm, stream, 0)) < 0)
            return fail(rc, "waiting for the step");
        if ((rc = dev_sync(dev)) < 0)
            return rc;
        if (step == 0)
            t_first = now_s() - t0;
        else
            t_decode += now_s() - t0;
        for (int li = 0; li < r->cfg.layers; li++)
            if ((rc = mirror_rows(r, li, r->h_new, r->h_slots, r->B)) < 0)
                return rc;

        /* outside the timed region: checksum, verification, progress */
        for (int li = 0; li < r->cfg.layers; li++) {
            layer_run *lr = &r->layers[li];
            const unsigned char *p;
            if ((rc = dev_copy(dev, lr->h_o, lr->d_o, (size_t)(r->B * H * V) * 2, 0)) < 0)
                return fail(rc, "reading the step's output");
            p = (const unsigned char *)lr->h_o;
            for (size_t i = 0; i < (size_t)(r->B * H * V) * 2; i++)
                fnv = (fnv ^ p[i]) * 0x100000001b3ull;
            if (r->verify) {
                if (lr->ref) {
                    mlart_step_io ref_io = io; /* same inputs; the backend's lse is kept */
                    memset(&ref_io.lse, 0, sizeof ref_io.lse);
                    ref_io.o = view(lr->d_o_ref, MLART_DTYPE_BF16, dev, 2, r->B, H * V, 0);
                    rc = mlart_layer_decode(lr->ref, &ref_io, NULL);
                    if (rc < 0)
                        return fail(rc, "reference decode for --verify");
                    if ((rc = dev_copy(dev, lr->h_o_ref, lr->d_o_ref, (size_t)(r->B * H * V) * 2,
                                       0)) < 0)
                        return fail(rc, "reading the reference layer's output");
                }
                if ((rc = verify_layer(r, li, &vs)) < 0)
                    return rc;
            }
        }
        if (!r->quiet && now_s() - t_start > 2.0 && now_s() - t_progress > 0.5) {
            fprintf(stderr, "\rmlart-decode: step %d/%d, %.3f ms/step", step + 1, r->cfg.steps,
                    step ? 1e3 * t_decode / step : 1e3 * t_first);
            t_progress = now_s();
            progress = 1;
        }
    }
    if (progress)
        fputc('\n', stderr);
#ifdef MLART_WITH_CUDA
    if (exec)
        cudaGraphExecDestroy(exec);
    if (stream)
        cudaStreamDestroy((cudaStream_t)stream);
#endif

    {
        const int timed = r->cfg.steps > 1 ? r->cfg.steps - 1 : 1;
        const long long tokens = (long long)r->B * r->cfg.steps;
        const double t_timed = r->cfg.steps > 1 ? t_decode : t_first;
        const double ms = 1e3 * t_timed / timed;
        const char *bname = mlart_layer_backend_name(r->layers[0].layer);
        const char *dname = dev < 0 ? "cpu" : "cuda";
        int ok = 1;
        char who[32] = "";
        if (r->comm || r->world > 1)
            snprintf(who, sizeof who, "rank %d: ", r->rank);
        if (r->quiet)
            goto results;
        printf("# mlart-decode  config %s\n", r->config_path ? r->config_path : "(none)");
        if (r->weights)
            printf("# weights: kv_b_proj of layers %d..%d from %s\n", r->layer0,
                   r->layer0 + r->cfg.layers - 1, r->weights);
        else
            printf("# weights: synthetic kv_b_proj, seed %llu\n", (unsigned long long)r->cfg.seed);
        printf("# heads are per rank (total %d / tp_size %d); ms/step covers the KV write of the "
               "new tokens and the decode step of every layer\n",
               r->cfg.heads_total, r->cfg.tp_size);
        printf("# setup took %.3f s (weights, the context's rows written into every layer's cache, "
               "backends), outside the timing\n", r->setup_s);
        if (r->cfg.steps > 1)
            printf("# ms/step and tokens/s over steps 2..%d%s; step 1 took %.3f ms (one-time "
                   "work falls in it: on CUDA each kernel's first launch loads its module)\n",
                   r->cfg.steps,
                   use_graph ? ", each the replay of one CUDA graph of the step"
                   : r->dev >= 0 ? ", kernels launched directly" : "",
                   1e3 * t_first);
        else
            printf("# ms/step and tokens/s are those of the only step, one-time work included "
                   "(on CUDA each kernel's first launch loads its module)\n");
        if (use_graph && r->cfg.steps > 1)
            printf("# the graph (KV write and decode of every layer) was captured and instantiated "
                   "once in %.3f ms, outside the timing\n", 1e3 * t_capture);
        else if (r->dev >= 0 && r->graph && r->cfg.steps > 1)
            printf("# no CUDA graph: %s\n",
                   r->cfg.validate_indices ? "validate_indices = 1 (each step copies its indices "
                                             "to the host and checks them first)"
                   : graph_safe(r)         ? "the local communicator's collectives synchronise (a "
                                             "local DCP group is not capturable)"
                                           : "a backend does not declare itself graph-safe");
        if (r->comm)
            printf("# dcp: %d ranks (%s communicator), interleave %d, routing %s; each rank "
                   "holds its shard of every request's cache and attends its group's %d heads "
                   "over it; the table and checksum are rank 0's\n", r->dcp_size,
                   mlart_comm_kind(r->comm), r->cfg.dcp_interleave,
                   mlart_dcp_routing_name(r->cfg.dcp_routing), r->dcp_size * g->heads);
        if (r->dev >= 0 && r->cfg.early_weights)
            printf("# early_weights = 1: each layer's query absorption may start, and read its "
                   "weights, while the kernel before it ends\n");
        {
            char num[TABLE_COLS][32];
            const char *cell[TABLE_COLS] = {bname, dname, mlart_kv_format_name(g->kv_format)};
            snprintf(num[3], sizeof num[3], "%d", g->heads);
            snprintf(num[4], sizeof num[4], "%d", g->qk_nope);
            snprintf(num[5], sizeof num[5], "%d", g->rope);
            snprintf(num[6], sizeof num[6], "%d", g->kv_lora);
            snprintf(num[7], sizeof num[7], "%d", g->v_head);
            snprintf(num[8], sizeof num[8], "%d", g->topk);
            snprintf(num[9], sizeof num[9], "%d", r->B);
            snprintf(num[10], sizeof num[10], "%d", r->cfg.context);
            snprintf(num[11], sizeof num[11], "%d", r->cfg.steps);
            snprintf(num[12], sizeof num[12], "%d", r->cfg.layers);
            snprintf(num[13], sizeof num[13], "%lld", tokens);
            snprintf(num[14], sizeof num[14], "%.3f", ms);
            snprintf(num[15], sizeof num[15], "%.1f",
                     t_timed > 0 ? (double)r->B * timed / t_timed : 0.0);
            for (int c = 3; c < TABLE_COLS; c++)
                cell[c] = num[c];
            print_table(cell);
        }
    results:
        printf("%schecksum 0x%016llx (FNV-1a 64 over every step's output o, bf16 bytes)\n", who,
               (unsigned long long)fnv);
        if (r->verify) {
            int o_ok = !vs.nan && vs.nmse <= VERIFY_NMSE;
            printf("%sverify vs float64 oracle: max_abs_err %.3e  nmse %.3e  lse mismatches %d  %s\n",
                   who, vs.max_abs, vs.nmse, vs.lse_bad, o_ok && !vs.lse_bad ? "PASS" : "FAIL");
            ok = o_ok && !vs.lse_bad;
            if (vs.compared_ref) {
                int r_ok = !vs.nan && vs.ref_nmse <= VERIFY_NMSE;
                printf("%sverify vs reference backend: max_abs_err %.3e  nmse %.3e  %s\n",
                       who, vs.ref_max_abs, vs.ref_nmse, r_ok ? "PASS" : "FAIL");
                ok = ok && r_ok;
            }
            if (vs.nan)
                printf("%sverify: NaN or Inf in the output\n", who);
        }
        printf("%sresult: backend=%s device=%s kv=%s verify=%s\n", who, bname, dname,
               mlart_kv_format_name(g->kv_format),
               r->verify ? (ok ? "PASS" : "FAIL") : "off");
        return ok ? 0 : 1;
    }
}

/* bt[0..n) = a seeded permutation of 0..n-1: blocks in no particular order. */
static void scatter_blocks(int32_t *bt, int64_t n, uint64_t s)
{
    for (int64_t i = 0; i < n; i++)
        bt[i] = (int32_t)i;
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)(rng_next(&s) % (uint64_t)(i + 1));
        int32_t x = bt[i];
        bt[i] = bt[j], bt[j] = x;
    }
}

static int setup(run *r)
{
    const mlart_geometry *g = &r->cfg.geom;
    const int64_t H = g->heads, P = g->qk_nope, R = g->rope, L = g->kv_lora, K = g->topk;
    const int64_t total = (int64_t)r->cfg.context + r->cfg.steps;
    /* chunk of cache rows written at once, and a step's new rows: at least B */
    const int64_t rows = 4096 > r->cfg.batch ? 4096 : r->cfg.batch;
    int64_t nb;
    int rc;
    r->B = r->cfg.batch;
    /* positions, sequence lengths and cache slots are int32 in the step */
    if (total > INT32_MAX)
        return fail(app_error(MLART_ERANGE, "context %d + steps %d pass the int32 positions of "
                              "a step", r->cfg.context, r->cfg.steps),
                    "sizing the run");
    r->MB = (int32_t)((total + g->page_size - 1) / g->page_size);
    nb = (int64_t)r->B * r->MB;
    r->num_slots = nb * g->page_size;
    if (r->num_slots - 1 > INT32_MAX) /* slot numbers 0..num_slots-1 */
        return fail(app_error(MLART_ERANGE, "the cache would have %lld slots (batch %d x %d "
                              "blocks x page_size %d), past the int32 slot numbers of a step; "
                              "lower batch, context or page_size",
                              (long long)r->num_slots, r->B, r->MB, (int)g->page_size),
                    "sizing the run");
    if ((rc = mlart_context_create(r->dev, &r->ctx)) < 0)
        return fail(rc, "mlart_context_create");
    r->bpt = mlart_kv_bytes_per_token(g);
    r->layers = calloc((size_t)r->cfg.layers, sizeof *r->layers);
    r->h_q = malloc((size_t)(r->B * H * (P + R)) * 2);
    r->h_new = malloc((size_t)(rows * (L + R)) * 2);
    r->h_idx = malloc((size_t)(r->B * K) * 4);
    r->h_req = malloc((size_t)r->B * 4);
    r->h_lens = malloc((size_t)r->B * 4);
    r->h_bt = malloc((size_t)nb * 4);
    r->h_slots = malloc((size_t)rows * 4);
    r->h_slots_l = malloc((size_t)rows * 4);
    r->pool = malloc((size_t)total * 4);
    if (r->verify) {
        r->oracle_o = malloc(sizeof(double) * (size_t)(r->B * H * g->v_head));
        r->oracle_lse = malloc(sizeof(double) * (size_t)(H * r->B));
    }
    if (!r->layers || !r->h_q || !r->h_new || !r->h_idx || !r->h_req || !r->h_lens || !r->h_bt ||
        !r->h_slots || !r->h_slots_l || !r->pool ||
        (r->verify && (!r->oracle_o || !r->oracle_lse)))
        return fail(app_error(MLART_ENOMEM, "out of host memory for a step's queries (batch %d x "
                              "heads %lld x (P+R) %lld: %lld bytes) and indices (batch x topk %lld: "
                              "%lld bytes), or the cache's block table (%lld bytes); lower batch, "
                              "heads, topk or context", r->B, (long long)H, (long long)(P + R),
                              (long long)(r->B * H * (P + R)) * 2, (long long)K,
                              (long long)(r->B * K) * 4, (long long)nb * 4),
                    "allocating host buffers");
    if (r->comm) {
        /* this rank's shard: its positions of each request, on blocks of its own */
        const int64_t mine = mlart_dcp_local_len(total, r->dcp_rank, r->dcp_size,
                                                 r->cfg.dcp_interleave);
        r->MBl = (int32_t)((mine + g->page_size - 1) / g->page_size);
        if (r->MBl < 1)
            r->MBl = 1;
        r->num_slots_l = (int64_t)r->B * r->MBl * g->page_size;
        if (!(r->h_bt_l = malloc((size_t)(r->B * r->MBl) * 4)))
            return fail(out_of_host_memory(), "allocating host buffers");
        scatter_blocks(r->h_bt_l, (int64_t)r->B * r->MBl,
                       r->cfg.seed * 69069u + 23 + (uint64_t)r->dcp_rank * 104729u);
    }
    /* each request's blocks scattered over the cache in a seeded order */
    scatter_blocks(r->h_bt, nb, r->cfg.seed * 48271u + 17);
    for (int32_t b = 0; b < r->B; b++) {
        r->h_req[b] = b;
        r->h_lens[b] = r->cfg.context;
    }
    if (r->dev >= 0) {
        if ((rc = dev_alloc(r->dev, (size_t)(r->B * H * (P + R)) * 2, &r->d_q)) < 0 ||
            (rc = dev_alloc(r->dev, (size_t)(rows * (L + R)) * 2, &r->d_new)) < 0 ||
            (rc = dev_alloc(r->dev, (size_t)(r->B * K) * 4, &r->d_idx)) < 0 ||
            (rc = dev_alloc(r->dev, (size_t)r->B * 4, &r->d_req)) < 0 ||
            (rc = dev_alloc(r->dev, (size_t)r->B * 4, &r->d_lens)) < 0 ||
            (rc = dev_alloc(r->dev, (size_t)nb * 4, &r->d_bt)) < 0 ||
            (rc = dev_alloc(r->dev, (size_t)rows * 4, &r->d_slots)) < 0)
            return fail(rc, "allocating device buffers");
    }
    if ((rc = dev_alloc(r->dev, sizeof(float) * (size_t)(H * r->B), &r->d_lse)) < 0)
        return fail(rc, "allocating the lse buffer");
    for (int li = 0; li < r->cfg.layers; li++)
        if ((rc = setup_layer(r, li)) < 0)
            return rc;
    return 0;
}

/* ---- ranks ------------------------------------------------------------------ */

/* One rank's whole run: set-up, the steps, clean-up; 0, 1 (verify failed) or
 * a negative status.  Consumes r (its communicator too). */
static int run_rank(run *r)
{
    int rc;
    r->setup_s = now_s();
    rc = setup(r);
    r->setup_s = now_s() - r->setup_s;
    if (rc == 0)
        rc = run_decode(r);
    destroy_run(r);
    return rc;
}

static void *run_rank_thread(void *arg)
{
    run *r = arg;
    r->dcp_rank = run_rank(r); /* the rank's result, read after the join */
    return NULL;
}

/* --dcp-local: the dcp_size ranks of one group as threads of this process,
 * joined by a local communicator, on this process's device. */
static int run_local_group(const run *base)
{
    const int D = base->cfg.dcp_size;
    mlart_comm_group *g = NULL;
    run *rs = calloc((size_t)D, sizeof *rs);
    pthread_t *th = calloc((size_t)D, sizeof *th);
    int rc = 0, bad = 0, started = 0;
    if (!rs || !th || mlart_comm_group_create(D, base->dev, 0, &g) < 0) {
        fprintf(stderr, "mlart-decode: %s\n", rs && th ? mlart_last_error() : "out of memory");
        free(rs), free(th);
        return 1;
    }
    for (int k = 0; k < D && rc == 0; k++) {
        rs[k] = *base;
        rs[k].rank = k, rs[k].dcp_rank = k, rs[k].dcp_size = D, rs[k].quiet = k != 0;
        if ((rc = mlart_comm_local_create(g, k, &rs[k].comm)) < 0)
            fprintf(stderr, "mlart-decode: %s\n", mlart_last_error());
    }
    for (int k = 0; k < D && rc == 0; k++, started++)
        if (pthread_create(&th[k], NULL, run_rank_thread, &rs[k]) != 0) {
            fprintf(stderr, "mlart-decode: cannot start the thread of rank %d\n", k);
            rc = 1;
            break;
        }
    /* a rank that did not start leaves the group now, so that the started
     * ones fail their next collective at once instead of waiting for it */
    for (int k = started; k < D; k++) {
        mlart_comm_destroy(rs[k].comm);
        rs[k].comm = NULL;
    }
    for (int k = 0; k < started; k++) {
        pthread_join(th[k], NULL);
        bad |= rs[k].dcp_rank != 0;
    }
    mlart_comm_group_destroy(g);
    free(rs), free(th);
    return rc || bad ? 1 : 0;
}

/* Under mpirun: this process is world rank ri->rank, with the heads of that
 * TP rank; groups of dcp_size consecutive ranks share an NCCL communicator,
 * whose unique id rank 0 of the group serves at MLART_MASTER_ADDR
 * (127.0.0.1) : MLART_MASTER_PORT (29500) + the group's index. */
static int run_world(run *r, const mlart_rank_info *ri, int n_dev)
{
    const int D = r->cfg.dcp_size;
    const char *addr = getenv("MLART_MASTER_ADDR"), *port_s = getenv("MLART_MASTER_PORT");
    /* group g's rendezvous is at port + g, so the last group's at port + last
     * (without DCP there is none, and the port goes unused) */
    const int last = D > 1 ? ri->size / D - 1 : 0;
    long port = 29500;
    int rc;
    if (ri->size != r->cfg.tp_size) {
        fprintf(stderr, "mlart-decode: %d ranks (%s) for tp_size %d: launch one process per TP "
                        "rank\n", ri->size, ri->source, r->cfg.tp_size);
        return 2;
    }
    if (D > 1 && port_s && *port_s) { /* without DCP no rendezvous reads it */
        char *end;
        port = strtol(port_s, &end, 10);
        if (*end || port < 1 || port > 65535 - last) {
            fprintf(stderr, "mlart-decode: MLART_MASTER_PORT '%s' is not a port of 1..%d (the "
                            "DCP groups take ports PORT..PORT+%d)\n", port_s, 65535 - last, last);
            return 2;
        }
    }
    r->rank = ri->rank;
    r->world = ri->size;
    r->quiet = ri->rank != 0;
    if (r->dev >= 0)
        r->dev = n_dev > 0 ? ri->local_rank % n_dev : 0;
    if (D > 1) {
        if (r->dev < 0) {
            fprintf(stderr, "mlart-decode: rank %d: a DCP group across processes needs CUDA "
                            "devices (NCCL); on the CPU run the group in one process, without a launcher, "
                            "with --dcp-local\n",
                    ri->rank);
            return 1;
        }
        r->dcp_rank = ri->rank % D;
        r->dcp_size = D;
        rc = mlart_comm_nccl_join(r->dcp_rank, D, r->dev, addr && *addr ? addr : "127.0.0.1",
                                  (int)port + ri->rank / D, 0, &r->comm);
        if (rc < 0) {
            fprintf(stderr, "mlart-decode: rank %d: %s\n", ri->rank, mlart_last_error());
            return 1;
        }
    }
    return run_rank(r) == 0 ? 0 : 1;
}

/* ---- command line ---------------------------------------------------------- */

static const char *find_default_config(char *buf, size_t n)
{
    if (access(DEFAULT_CONFIG, R_OK) == 0)
        return DEFAULT_CONFIG;
    snprintf(buf, n, "%s/%s", MLART_SOURCE_DIR, DEFAULT_CONFIG);
    if (access(buf, R_OK) == 0)
        return buf;
    return NULL;
}

static int decode_main(int argc, char **argv);

/* The exit status also says whether stdout took every byte (a full disk, a
 * closed pipe): a run whose table or result line was lost has failed. */
int main(int argc, char **argv)
{
    int rc = decode_main(argc, argv);
    errno = 0;
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "mlart-decode: writing the output failed%s%s\n", errno ? ": " : "",
                errno ? strerror(errno) : "");
        return rc ? rc : 1;
    }
    return rc;
}

static int decode_main(int argc, char **argv)
{
    static const struct {
        const char *flag, *key;
    } keyed[] = {{"--backend", "backend"}, {"--device", "device"},   {"--kv-format", "kv_format"},
                 {"--batch", "batch"},     {"--context", "context"}, {"--steps", "steps"},
                 {"--seed", "seed"}};
    run r;
    char defpath[1024];
    const char *config = NULL;
    int rc, n_dev = 0, dcp_local = 0, layer_given = 0;
    mlart_rank_info ri;
    memset(&r, 0, sizeof r);
    r.graph = 1;
    mlart_config_init(&r.cfg);
    /* first pass: the config file, so flags can override it */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(argv[i], "--config")) {
            if (i + 1 >= argc) {
                fprintf(stderr, "mlart-decode: --config needs a file\n");
                return 2;
            }
            /* one file: a second would silently replace the first */
            if (config) {
                fprintf(stderr, "mlart-decode: --config given twice ('%s', then '%s'): a run "
                                "reads one config file; change its keys with --set KEY=VALUE or "
                                "MLART_* variables\n", config, argv[i + 1]);
                return 2;
            }
            config = argv[++i];
        }
    }
    if (!config && !(config = find_default_config(defpath, sizeof defpath))) {
        fprintf(stderr, "mlart-decode: no --config given and %s not found in the current "
                        "directory or in %s\n", DEFAULT_CONFIG, MLART_SOURCE_DIR);
        return 2;
    }
    r.config_path = config;
    if ((rc = mlart_config_read_file(&r.cfg, config)) < 0 ||
        (rc = mlart_config_read_env(&r.cfg)) < 0) {
        fprintf(stderr, "mlart-decode: %s: %s\n", mlart_status_name(rc), mlart_last_error());
        return 2;
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        size_t k;
        if (!strcmp(a, "--config")) {
            i++;
            continue;
        }
        if (!strcmp(a, "--verify")) {
            r.verify = 1;
            continue;
        }
        if (!strcmp(a, "--dcp-local")) {
            dcp_local = 1;
            continue;
        }
        if (!strcmp(a, "--graph") || !strcmp(a, "--no-graph")) {
            r.graph = a[2] == 'g';
            continue;
        }
        for (k = 0; k < sizeof keyed / sizeof keyed[0]; k++)
            if (!strcmp(a, keyed[k].flag))
                break;
        if (k < sizeof keyed / sizeof keyed[0] || !strcmp(a, "--set") ||
            !strcmp(a, "--weights") || !strcmp(a, "--layer")) {
            const char *v;
            if (i + 1 >= argc) {
                fprintf(stderr, "mlart-decode: %s needs a value (see --help)\n", a);
                return 2;
            }
            v = argv[++i];
            if (!strcmp(a, "--weights")) {
                r.weights = v;
            } else if (!strcmp(a, "--layer")) {
                char *end;
                long n = strtol(v, &end, 10);
                if (*end || end == v || n < 0 || n > 100000) {
                    fprintf(stderr, "mlart-decode: --layer: bad value '%s'\n", v);
                    return 2;
                }
                r.layer0 = (int)n;
                layer_given = 1;
            } else if (!strcmp(a, "--set")) {
                char key[64];
                const char *eq = strchr(v, '='), *kb = v, *ke = eq;
                if (eq) { /* "key = value", spelled as in a config file */
                    while (kb < ke && isspace((unsigned char)*kb))
                        kb++;
                    while (ke > kb && isspace((unsigned char)ke[-1]))
                        ke--;
                }
                if (!eq || (size_t)(ke - kb) >= sizeof key) {
                    fprintf(stderr, "mlart-decode: --set wants KEY=VALUE, got '%s'\n", v);
                    return 2;
                }
                memcpy(key, kb, (size_t)(ke - kb));
                key[ke - kb] = 0;
                rc = mlart_config_set(&r.cfg, key, eq + 1, "--set");
            } else {
                rc = mlart_config_set(&r.cfg, keyed[k].key, v, a);
            }
            if (rc < 0) {
                fprintf(stderr, "mlart-decode: %s: %s\n", mlart_status_name(rc), mlart_last_error());
                return 2;
            }
            continue;
        }
        fprintf(stderr, "mlart-decode: unknown option '%s' (see --help)\n", a);
        return 2;
    }
    if (layer_given && !r.weights) {
        fprintf(stderr, "mlart-decode: --layer picks the checkpoint's first layer; it needs "
                        "--weights FILE\n");
        return 2;
    }
    if ((rc = mlart_config_finish(&r.cfg)) < 0) {
        fprintf(stderr, "mlart-decode: %s: %s\n", mlart_status_name(rc), mlart_last_error());
        return 2;
    }
    if ((rc = mlart_cuda_device_count(&n_dev)) < 0)
    {
        fail(rc, "mlart_cuda_device_count");
        return 1;
    }
    switch (r.cfg.device) {
    case MLART_DEVICE_CPU:
        r.dev = -1;
        break;
    case MLART_DEVICE_CUDA:
        if (n_dev == 0) {
            fprintf(stderr, "mlart-decode: device = cuda but no usable CUDA device%s\n",
#ifdef MLART_WITH_CUDA
                    ""
#else
                    " (this build has no CUDA)"
#endif
            );
            return 1;
        }
        r.dev = 0;
        break;
    case MLART_DEVICE_AUTO:
        r.dev = n_dev > 0 ? 0 : -1;
        break;
    }
    if ((rc = mlart_rank_from_env(&ri)) < 0) {
        fprintf(stderr, "mlart-decode: %s: %s\n", mlart_status_name(rc), mlart_last_error());
        return 2;
    }
    if (ri.size > 1 && dcp_local) {
        fprintf(stderr, "mlart-decode: --dcp-local runs a DCP group as threads of one process, but "
                        "this process is rank %d of %d (%s): drop --dcp-local, or start one "
                        "process without a launcher\n",
                ri.rank, ri.size, ri.source);
        return 2;
    }
    if (ri.size > 1)
        return run_world(&r, &ri, n_dev);
    if (dcp_local && r.cfg.dcp_size > 1)
        return run_local_group(&r);
    if (r.cfg.tp_size > 1 || r.cfg.dcp_size > 1)
        fprintf(stderr, "mlart-decode: running one rank's share in this process: %d of %d heads, "
                        "whole KV cache (tp_size %d, dcp_size %d; --dcp-local runs the DCP group "
                        "as threads)\n",
                r.cfg.geom.heads, r.cfg.heads_total, r.cfg.tp_size, r.cfg.dcp_size);
    return run_rank(&r) == 0 ? 0 : 1;
}
