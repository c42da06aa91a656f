#include "engine.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mlart/graphs.h>
#include <mlart/weights.h>

#ifdef MLART_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

/* up to MLART_GRAPH_MAX_BUCKETS sizes of 6 digits and a comma */
#define BUCKET_LIST (MLART_GRAPH_MAX_BUCKETS * 7)

struct serve_engine {
    mlart_context *ctx;
    mlart_layer *layer;
    mlart_geometry g;
    int device;
    int32_t context, blocks, max_t, max_b;
    int64_t num_slots;
    void *kv_cache, *w_uk_t, *w_uv, *kv_b_proj; /* on the device */
    /* step inputs/outputs: host staging (page-locked on CUDA), copied into
     * the graph cache's buffers, where the bucket's graph reads them */
    uint16_t *h_q, *h_o;
    int32_t *h_idx, *h_req, *h_lens, *h_bt;
    mlart_graph_cache *gc;
    const mlart_graph_bufs *gb;
    uint16_t *q_table; /* [context, H*(P+R)]: each position's query, made once
                          (NULL when larger than Q_TABLE_MAX: made per step) */
    void *stream;      /* CUDA: the steps' stream (cudaStream_t) */
    char bucket_list[BUCKET_LIST]; /* "1,2,4,..." */
    char describe[BUCKET_LIST + 256];
};

#define Q_TABLE_MAX ((size_t)64 << 20)

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Deterministic bf16 in [-amp, amp) from a key. */
static uint16_t val_bf16(uint64_t key, float amp)
{
    float f = ((float)(mix(key) >> 40) / 16777216.0f * 2.0f - 1.0f) * amp;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static int dev_alloc(serve_engine *e, size_t bytes, void **out)
{
    if (e->device < 0) {
        *out = calloc(1, bytes ? bytes : 1);
        return *out ? 0 : MLART_ENOMEM;
    }
#ifdef MLART_WITH_CUDA
    if (cudaMalloc(out, bytes ? bytes : 1) != cudaSuccess)
        return MLART_ENOMEM;
    return 0;
#else
    return MLART_ENODEV;
#endif
}

static void dev_free(const serve_engine *e, void *p)
{
    if (!p)
        return;
    if (e->device < 0)
        free(p);
#ifdef MLART_WITH_CUDA
    else
        cudaFree(p);
#endif
}

/* The synthetic query of the token at position p: n bf16 values. */
static void make_query(uint16_t *q, int32_t p, int64_t n)
{
    for (int64_t j = 0; j < n; j++)
        q[j] = val_bf16(((uint64_t)p << 32) ^ (uint64_t)j ^ 0x5eed000000000000ull, 1.0f);
}

/* Host staging for the steps: page-locked on CUDA, so that the copies are
 * asynchronous on the engine's stream. */
static int host_alloc(const serve_engine *e, size_t bytes, void **out)
{
#ifdef MLART_WITH_CUDA
    if (e->device >= 0)
        return cudaMallocHost(out, bytes ? bytes : 1) == cudaSuccess ? 0 : MLART_ENOMEM;
#endif
    (void)e;
    *out = malloc(bytes ? bytes : 1);
    return *out ? 0 : MLART_ENOMEM;
}

static void host_free(const serve_engine *e, void *p)
{
    if (!p)
        return;
#ifdef MLART_WITH_CUDA
    if (e->device >= 0) {
        cudaFreeHost(p);
        return;
    }
#endif
    (void)e;
    free(p);
}

/* A copy between the host and the engine's device (a plain copy on the
 * CPU): on `stream` (a cudaStream_t) when given, else synchronously. */
static int copy(const serve_engine *e, void *dst, const void *src, size_t bytes, int to_device,
                void *stream)
{
    if (e->device < 0) {
        if (dst != src)
            memcpy(dst, src, bytes);
        return 0;
    }
#ifdef MLART_WITH_CUDA
    {
        const enum cudaMemcpyKind k = to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
        cudaError_t ce = stream ? cudaMemcpyAsync(dst, src, bytes, k, (cudaStream_t)stream)
                                : cudaMemcpy(dst, src, bytes, k);
        return ce == cudaSuccess ? 0 : MLART_ECUDA;
    }
#else
    (void)to_device, (void)stream;
    return MLART_ENODEV;
#endif
}

static int to_dev(const serve_engine *e, void *dst, const void *src, size_t bytes)
{
    return copy(e, dst, src, bytes, 1, NULL);
}

void serve_engine_destroy(serve_engine *e)
{
    if (!e)
        return;
    mlart_graph_cache_destroy(e->gc);
    mlart_layer_destroy(e->layer);
    dev_free(e, e->kv_cache);
    dev_free(e, e->w_uk_t);
    dev_free(e, e->w_uv);
    dev_free(e, e->kv_b_proj);
    {
        void *h[] = {e->h_q, e->h_o, e->h_idx, e->h_req, e->h_lens, e->h_bt};
        for (size_t i = 0; i < sizeof h / sizeof h[0]; i++)
            host_free(e, h[i]);
    }
    free(e->q_table);
#ifdef MLART_WITH_CUDA
    if (e->stream)
        cudaStreamDestroy((cudaStream_t)e->stream);
#endif
    mlart_context_destroy(e->ctx);
    free(e);
}

const char *serve_engine_describe(const serve_engine *e)
{
    return e->describe;
}

/* Weights: random, or layer N's kv_b_proj from a checkpoint viewed as
 * W_UK_T / W_UV (the layer makes dense copies if its backend wants them). */
static int load_weights(serve_engine *e, const serve_engine_opts *o, mlart_tensor *uk,
                        mlart_tensor *uv, char *err, size_t err_cap)
{
    const mlart_geometry *g = &e->g;
    int64_t H = g->heads, P = g->qk_nope, L = g->kv_lora, V = g->v_head;
    int rc;
    if (o->weights) {
        int64_t shape[2] = {H * (P + V), L}, total = 0;
        size_t bytes = (size_t)(H * (P + V) * L) * 2;
        uint16_t *h;
        mlart_tensor kv;
        if (err_cap)
            err[0] = '\0'; /* written below only for the head count */
        /* one server holds every head: the checkpoint must hold no more */
        if ((rc = mlart_safetensors_kv_b_proj_heads(o->weights, o->layer, g, &total)))
            return rc;
        if (total != H) {
            if (err_cap)
                snprintf(err, err_cap, "%s: layer %d's kv_b_proj holds %lld heads, the server "
                         "has heads = %lld", o->weights, o->layer, (long long)total, (long long)H);
            return MLART_ESHAPE;
        }
        if (!(h = malloc(bytes)))
            return MLART_ENOMEM;
        rc = mlart_safetensors_load_kv_b_proj(o->weights, o->layer, g, 0, h, bytes);
        if (rc == 0 && (rc = dev_alloc(e, bytes, &e->kv_b_proj)) == 0)
            rc = to_dev(e, e->kv_b_proj, h, bytes);
        free(h);
        if (rc)
            return rc;
        kv = mlart_tensor_dense(e->kv_b_proj, MLART_DTYPE_BF16, e->device, 2, shape);
        return mlart_weights_from_kv_b_proj(g, &kv, uk, uv);
    } else {
        int64_t uks[3] = {H, P, L}, uvs[3] = {H, L, V};
        size_t nuk = (size_t)(H * P * L), nuv = (size_t)(H * L * V);
        uint16_t *h = malloc((nuk > nuv ? nuk : nuv) * 2);
        float amp_uk = 1.0f / sqrtf((float)P), amp_uv = 1.0f / sqrtf((float)L);
        if (!h)
            return MLART_ENOMEM;
        rc = dev_alloc(e, nuk * 2, &e->w_uk_t);
        if (!rc) {
            for (size_t i = 0; i < nuk; i++)
                h[i] = val_bf16(o->seed * 0x100000001b3ull ^ (0x1000000000ull + i), amp_uk);
            rc = to_dev(e, e->w_uk_t, h, nuk * 2);
        }
        if (!rc)
            rc = dev_alloc(e, nuv * 2, &e->w_uv);
        if (!rc) {
            for (size_t i = 0; i < nuv; i++)
                h[i] = val_bf16(o->seed * 0x100000001b3ull ^ (0x2000000000ull + i), amp_uv);
            rc = to_dev(e, e->w_uv, h, nuv * 2);
        }
        free(h);
        if (rc)
            return rc;
        *uk = mlart_tensor_dense(e->w_uk_t, MLART_DTYPE_BF16, e->device, 3, uks);
        *uv = mlart_tensor_dense(e->w_uv, MLART_DTYPE_BF16, e->device, 3, uvs);
        return 0;
    }
}

/* Fill the cache through the layer, so it is encoded in the layer's format. */
static int fill_cache(serve_engine *e, uint64_t seed)
{
    const mlart_geometry *g = &e->g;
    int64_t row = g->kv_lora + g->rope, n = e->num_slots;
    int64_t ls[2] = {n, row}, ss[1] = {n};
    uint16_t *lat = malloc((size_t)(n * row) * 2);
    int32_t *slots = malloc((size_t)n * 4);
    void *d_lat = NULL, *d_slots = NULL;
    mlart_tensor tl, ts;
    int rc = (!lat || !slots) ? MLART_ENOMEM : 0;
    for (int64_t i = 0; !rc && i < n * row; i++)
        lat[i] = val_bf16(seed * 0x100000001b3ull ^ (0x3000000000ull + (uint64_t)i), 1.0f);
    for (int64_t i = 0; !rc && i < n; i++)
        slots[i] = (int32_t)i;
    if (!rc && e->device >= 0) {
        if (!(rc = dev_alloc(e, (size_t)(n * row) * 2, &d_lat)) &&
            !(rc = dev_alloc(e, (size_t)n * 4, &d_slots)) &&
            !(rc = to_dev(e, d_lat, lat, (size_t)(n * row) * 2)))
            rc = to_dev(e, d_slots, slots, (size_t)n * 4);
    }
    if (!rc) {
        tl = mlart_tensor_dense(d_lat ? d_lat : lat, MLART_DTYPE_BF16, e->device, 2, ls);
        ts = mlart_tensor_dense(d_slots ? d_slots : slots, MLART_DTYPE_I32, e->device, 1, ss);
        rc = mlart_layer_write_kv(e->layer, &tl, &ts, NULL);
    }
#ifdef MLART_WITH_CUDA
    if (!rc && e->device >= 0 && cudaDeviceSynchronize() != cudaSuccess)
        rc = MLART_ECUDA;
#endif
    if (e->device >= 0) {
        dev_free(e, d_lat);
        dev_free(e, d_slots);
    }
    free(lat);
    free(slots);
    return rc;
}

/* Library failures carry their detail in mlart_last_error(); the engine's
 * own (allocation, copies) do not, so name the status instead. */
static void note_error(int rc, char *err, size_t cap)
{
    const char *m = mlart_last_error();
    if (!cap)
        return;
    if (rc == MLART_ENOMEM || rc == MLART_ECUDA || !m[0])
        snprintf(err, cap, "%s (%s)", mlart_strerror(rc), m[0] ? m : "allocation or copy failed");
    else
        snprintf(err, cap, "%s", m);
}

/* The steps' buckets: the given sizes below max_t, then the powers of two
 * past the last of them (all of them without sizes) below max_t, then
 * max_t. */
static int buckets(const serve_engine_opts *o, int32_t max_t, int32_t *out)
{
    int n = 0;
    int64_t s = 1;
    for (int i = 0; o->graph_sizes && i < o->num_graph_sizes; i++)
        if (o->graph_sizes[i] >= 1 && o->graph_sizes[i] < max_t &&
            (!n || o->graph_sizes[i] > out[n - 1]) && n < MLART_GRAPH_MAX_BUCKETS - 1)
            out[n++] = o->graph_sizes[i];
    while (n && s <= out[n - 1])
        s *= 2;
    for (; s < max_t && n < MLART_GRAPH_MAX_BUCKETS - 1; s *= 2)
        out[n++] = (int32_t)s;
    out[n++] = max_t;
    return n;
}

int serve_engine_create(const serve_engine_opts *o, serve_engine **out, char *err,
                        size_t err_cap)
{
    serve_engine *e = calloc(1, sizeof *e);
    mlart_layer_desc d;
    mlart_tensor uk, uv;
    const mlart_geometry *g;
    size_t bpt;
    int rc, ndev = 0;
    if (!e) {
        if (err_cap)
            snprintf(err, err_cap, "out of host memory");
        return MLART_ENOMEM;
    }
    e->g = o->geom;
    g = &e->g;
    if ((rc = mlart_geometry_check(g)))
        goto fail;
    e->device = o->device;
    if (e->device == SERVE_DEVICE_AUTO) {
        if ((rc = mlart_cuda_device_count(&ndev)))
            goto fail;
        e->device = ndev > 0 ? 0 : -1;
    }
    if ((rc = mlart_context_create(e->device, &e->ctx)))
        goto fail;
    e->context = o->context;
    e->max_t = o->max_batch_tokens;
    e->max_b = o->max_batch_requests;
    e->blocks = (o->context + g->page_size - 1) / g->page_size;
    e->num_slots = (int64_t)e->blocks * g->page_size;
    bpt = mlart_kv_bytes_per_token(g);
    if ((rc = dev_alloc(e, (size_t)e->num_slots * bpt, &e->kv_cache)))
        goto fail;
    if ((rc = load_weights(e, o, &uk, &uv, err, err_cap))) {
        if (rc == MLART_ESHAPE && err_cap && err[0]) { /* the message is written */
            serve_engine_destroy(e);
            return rc;
        }
        goto fail;
    }

    memset(&d, 0, sizeof d);
    d.geom = *g;
    d.backend = o->backend;
    d.max_tokens = e->max_t;
    d.max_requests = e->max_b;
    d.max_blocks_per_req = e->blocks;
    d.num_slots = e->num_slots;
    d.w_uk_t = uk;
    d.w_uv = uv;
    {
        int64_t cs[2] = {e->num_slots, (int64_t)bpt};
        d.kv_cache = mlart_tensor_dense(e->kv_cache, MLART_DTYPE_U8, e->device, 2, cs);
    }
    rc = mlart_layer_create(e->ctx, &d, &e->layer);
    if ((rc == MLART_ENOTSUP || rc == MLART_ENOBACKEND) && !o->backend && e->device >= 0) {
        /* No backend named: the device's fast default cannot serve this
         * geometry, so say so and take the reference kernels. */
        fprintf(stderr, "mlart-serve-example: default backend: %s; using 'reference'\n",
                mlart_last_error());
        d.backend = "reference";
        rc = mlart_layer_create(e->ctx, &d, &e->layer);
    }
    if (rc)
        goto fail;
    if ((rc = fill_cache(e, o->seed)))
        goto fail;

    {
        size_t T = (size_t)e->max_t, B = (size_t)e->max_b;
        size_t H = (size_t)g->heads;
        const size_t qrow = H * (size_t)(g->qk_nope + g->rope);
        if ((rc = host_alloc(e, T * qrow * 2, (void **)&e->h_q)) ||
            (rc = host_alloc(e, T * H * (size_t)g->v_head * 2, (void **)&e->h_o)) ||
            (rc = host_alloc(e, T * (size_t)g->topk * 4, (void **)&e->h_idx)) ||
            (rc = host_alloc(e, T * 4, (void **)&e->h_req)) ||
            (rc = host_alloc(e, B * 4, (void **)&e->h_lens)) ||
            (rc = host_alloc(e, B * (size_t)e->blocks * 4, (void **)&e->h_bt)))
            goto fail;
        if ((size_t)e->context * qrow * 2 <= Q_TABLE_MAX &&
            (e->q_table = malloc((size_t)e->context * qrow * 2))) {
            for (int32_t p = 0; p < e->context; p++)
                make_query(e->q_table + (size_t)p * qrow, p, (int64_t)qrow);
        }
#ifdef MLART_WITH_CUDA
        if (e->device >= 0 &&
            cudaStreamCreateWithFlags((cudaStream_t *)&e->stream, cudaStreamNonBlocking) != cudaSuccess) {
            rc = MLART_ECUDA;
            goto fail;
        }
#endif
    }
    {
        int32_t sizes[MLART_GRAPH_MAX_BUCKETS];
        const int n = buckets(o, e->max_t, sizes);
        if ((rc = mlart_graph_cache_create(e->layer, sizes, n,
                                           o->no_graph ? MLART_GRAPH_NO_CAPTURE : 0, e->stream,
                                           &e->gc)))
            goto fail;
        e->gb = mlart_graph_cache_bufs(e->gc);
        for (int i = 0, at = 0; i < n && at < (int)sizeof e->bucket_list; i++)
            at += snprintf(e->bucket_list + at, sizeof e->bucket_list - (size_t)at, "%s%d",
                           i ? "," : "", sizes[i]);
    }
    {
        char dev[24];
        if (e->device < 0)
            snprintf(dev, sizeof dev, "cpu");
        else
            snprintf(dev, sizeof dev, "cuda:%d", e->device);
        snprintf(e->describe, sizeof e->describe,
             "backend %s on %s, H=%d P=%d R=%d L=%d V=%d topk=%d kv=%s, %s weights, steps in "
             "buckets of %s tokens %s",
             mlart_layer_backend_name(e->layer), dev,
             g->heads, g->qk_nope, g->rope, g->kv_lora, g->v_head, g->topk,
             mlart_kv_format_name(g->kv_format), o->weights ? "checkpoint" : "random",
             e->bucket_list,
             mlart_graph_cache_graphs(e->gc) ? "replayed as CUDA graphs" : "launched directly");
    }
    *out = e;
    return 0;
fail:
    note_error(rc, err, err_cap);
    serve_engine_destroy(e);
    return rc;
}

static int step(serve_engine *e, const serve_request *const *reqs, int n, uint64_t *checksums)
{
    const mlart_geometry *g = &e->g;
    int64_t H = g->heads, PR = g->qk_nope + g->rope, V = g->v_head, K = g->topk;
    const mlart_step_io *io = &e->gb->io;
    int32_t T = 0;
    int rc;
    for (int r = 0; r < n; r++)
        T += reqs[r]->tokens;
    if (n < 1 || n > e->max_b || T > e->max_t)
        return MLART_ERANGE;
#ifdef MLART_WITH_CUDA
    /* steps run on pool threads, and the current device is per thread */
    if (e->device >= 0 && cudaSetDevice(e->device) != cudaSuccess)
        return MLART_ECUDA;
#endif
    for (int r = 0, t = 0; r < n; r++) {
        int32_t maxp = 0;
        for (int i = 0; i < reqs[r]->tokens; i++, t++) {
            int32_t p = reqs[r]->positions[i];
            uint16_t *q = e->h_q + (size_t)t * (size_t)(H * PR);
            int32_t *idx = e->h_idx + (size_t)t * (size_t)K;
            maxp = p > maxp ? p : maxp;
            /* the query depends only on the position, so a request's
             * inputs do not depend on what it was batched with (its
             * output may, within the backend's bound: docs/serve.md) */
            if (e->q_table)
                memcpy(q, e->q_table + (size_t)p * (size_t)(H * PR), (size_t)(H * PR) * 2);
            else
                make_query(q, p, H * PR);
            for (int64_t k = 0; k < K; k++)
                idx[k] = p - k >= 0 ? (int32_t)(p - k) : -1;
            e->h_req[t] = r;
        }
        e->h_lens[r] = maxp + 1;
        for (int32_t b = 0; b < e->blocks; b++)
            e->h_bt[(size_t)r * (size_t)e->blocks + (size_t)b] = b; /* one shared cache */
    }
    /* on CUDA everything below is queued on the engine's stream, from
     * page-locked staging, and waited for once after the copy back; the
     * step runs in the smallest bucket of at least T tokens */
    if ((rc = copy(e, io->q.data, e->h_q, (size_t)(T * H * PR) * 2, 1, e->stream)) ||
        (rc = copy(e, io->idx.data, e->h_idx, (size_t)(T * K) * 4, 1, e->stream)) ||
        (rc = copy(e, io->req_of_token.data, e->h_req, (size_t)T * 4, 1, e->stream)) ||
        (rc = copy(e, io->seq_lens.data, e->h_lens, (size_t)n * 4, 1, e->stream)) ||
        (rc = copy(e, io->block_table.data, e->h_bt, (size_t)n * (size_t)e->blocks * 4, 1,
                   e->stream)))
        return rc;
    if ((rc = mlart_graph_cache_run(e->gc, T, n, e->stream)) < 0 ||
        (rc = copy(e, e->h_o, io->o.data, (size_t)(T * H * V) * 2, 0, e->stream)))
        return rc;
#ifdef MLART_WITH_CUDA
    if (e->stream && cudaStreamSynchronize((cudaStream_t)e->stream) != cudaSuccess)
        return MLART_ECUDA;
#endif
    for (int r = 0, t = 0; r < n; r++) {
        size_t row = (size_t)(H * V) * 2;
        checksums[r] = serve_fnv1a(SERVE_FNV_INIT, (const char *)e->h_o + (size_t)t * row,
                                   (size_t)reqs[r]->tokens * row);
        t += reqs[r]->tokens;
    }
    return 0;
}

int serve_engine_step(serve_engine *e, const serve_request *const *reqs, int n,
                      uint64_t *checksums, char *err, size_t err_cap)
{
    int rc = step(e, reqs, n, checksums);
    if (rc)
        note_error(rc, err, err_cap);
    return rc;
}
