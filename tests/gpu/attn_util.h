/* Shared by the attention GPU tests: random sparse-decode steps (paged
 * cache, top-k lists with holes, duplicates, page-boundary positions, empty
 * rows, short requests), their host and device copies, and the comparisons. */
#ifndef MLART_TESTS_GPU_ATTN_UTIL_H
#define MLART_TESTS_GPU_ATTN_UTIL_H

#include <cuda_runtime.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_test_util.h"
#include "mlart/backend.h"
#include "ops/numerics.h"

/* uniform in [-1, 1) */
static inline float attn_uniform(uint64_t *s)
{
    return (float)((double)(gpu_rand(s) >> 11) / 4503599627370496.0 - 1.0);
}

/* Error callback of mlart_backend_init for tests: keeps the last message. */
static char attn_last_msg[512];
static inline int attn_error_cb(int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(attn_last_msg, sizeof attn_last_msg, fmt, ap);
    va_end(ap);
    return status;
}
static inline void attn_log_cb(int level, const char *fmt, ...)
{
    (void)level;
    (void)fmt;
}

/* Shape and input patterns of one step. */
typedef struct attn_shape {
    int T, H, topk;
    mlart_kv_format fmt;
    int tokens_per_req; /* tokens sharing one request (1 = each its own) */
    int empty_rows;     /* every 5th token (t % 5 == 3) has only -1 indices */
    int out_of_range;   /* also draw indices >= seq_len and < -1 (GPU: read as empty) */
    float scale;
    int lead_empty;     /* each token's first lead_empty indices are -1 (0: none) */
    int thin;           /* > 1: keep about one index in `thin`, the rest -1 (a DCP rank's share) */
    int keep_head;      /* > 0: only each list's first keep_head entries, the rest -1 (an indexer's
                         * list for a request shorter than top-k) */
} attn_shape;

/* Host copy of one step's inputs.  The cache is shared by the requests:
 * block tables map pages at random, with repeats (prefix sharing). */
typedef struct attn_host {
    attn_shape sh;
    mlart_geometry g;
    int B, max_blocks;
    int64_t num_slots;
    size_t row_bytes;
    uint16_t *q;   /* [T,H,576] */
    const uint8_t *kv; /* [num_slots,row_bytes], shared by the steps of a test (not owned) */
    int32_t *idx;  /* [T,topk] */
    int32_t *req;  /* [T] */
    int32_t *seq;  /* [B] */
    int32_t *bt;   /* [B,max_blocks] */
} attn_host;

#define ATTN_PHYS_BLOCKS 320

static inline void attn_host_free(attn_host *h)
{
    free(h->q);
    free(h->idx);
    free(h->req);
    free(h->seq);
    free(h->bt);
    memset(h, 0, sizeof *h);
}

/* One latent+rope row with per-128-tile magnitudes between 2^-4 and 2^3, so
 * fp8 tiles get different scales; tile 4 of row 7 mod 97 is all zero. */
static inline void attn_fill_row(uint16_t *row, int64_t n, uint64_t *rng)
{
    for (int t = 0; t < 5; t++) {
        int lo = t * 128, hi = t < 4 ? lo + 128 : 576;
        float mag = ldexpf(1.0f, (int)(gpu_rand(rng) % 8) - 4);
        for (int i = lo; i < hi; i++)
            row[i] = mlart_f32_to_bf16(n % 97 == 7 && t == 3 ? 0.0f : mag * attn_uniform(rng));
    }
}

#define ATTN_NUM_SLOTS ((int64_t)ATTN_PHYS_BLOCKS * 64)

/* A random cache of ATTN_NUM_SLOTS rows in format fmt (malloc'd). */
static inline uint8_t *attn_cache_make(mlart_kv_format fmt, uint64_t *rng)
{
    const size_t rb = fmt == MLART_KV_FP8_DS_MLA ? 656 : 1152;
    uint8_t *kv = malloc(rb * (size_t)ATTN_NUM_SLOTS);
    uint16_t lat[576];
    for (int64_t n = 0; n < ATTN_NUM_SLOTS; n++) {
        attn_fill_row(lat, n, rng);
        if (fmt == MLART_KV_FP8_DS_MLA)
            mlart_fp8_ds_mla_encode(lat, 512, 64, kv + (size_t)n * rb);
        else
            memcpy(kv + (size_t)n * rb, lat, sizeof lat);
    }
    return kv;
}

/* A step over the cache `kv` (from attn_cache_make with sh->fmt). */
static inline void attn_host_make(attn_host *h, const attn_shape *sh, const uint8_t *kv,
                                  uint64_t *rng)
{
    const int T = sh->T, H = sh->H, topk = sh->topk, page = 64;
    memset(h, 0, sizeof *h);
    h->sh = *sh;
    h->g.heads = H;
    h->g.qk_nope = 128;
    h->g.rope = 64;
    h->g.kv_lora = 512;
    h->g.v_head = 128;
    h->g.topk = topk;
    h->g.page_size = page;
    h->g.kv_format = sh->fmt;
    h->g.softmax_scale = sh->scale;
    h->B = (T + sh->tokens_per_req - 1) / sh->tokens_per_req;
    h->num_slots = ATTN_NUM_SLOTS;
    h->row_bytes = mlart_kv_bytes_per_token(&h->g);
    h->q = malloc(sizeof(uint16_t) * (size_t)T * H * 576);
    h->kv = kv;
    h->idx = malloc(sizeof(int32_t) * (size_t)T * topk);
    h->req = malloc(sizeof(int32_t) * (size_t)T);
    h->seq = malloc(sizeof(int32_t) * (size_t)h->B);
    /* Requests: lengths from 0 to topk + 300, several shorter than topk. */
    int maxlen = 1;
    for (int b = 0; b < h->B; b++) {
        int len = (int)(gpu_rand(rng) % (uint64_t)(topk + 300));
        if (b % 4 == 1)
            len = (int)(gpu_rand(rng) % 100); /* much shorter than topk */
        if (b % 11 == 5)
            len = 0;
        h->seq[b] = len;
        if (len > maxlen)
            maxlen = len;
    }
    h->max_blocks = (maxlen + page - 1) / page;
    h->bt = malloc(sizeof(int32_t) * (size_t)h->B * h->max_blocks);
    for (int64_t i = 0; i < (int64_t)h->B * h->max_blocks; i++)
        h->bt[i] = (int32_t)(gpu_rand(rng) % ATTN_PHYS_BLOCKS);
    for (int t = 0; t < T; t++)
        h->req[t] = t / sh->tokens_per_req;
    for (int t = 0; t < T; t++) {
        int32_t *row = h->idx + (size_t)t * topk;
        const int len = h->seq[h->req[t]];
        for (int k = 0; k < topk; k++) {
            int r = (int)(gpu_rand(rng) % 100), v;
            if (len == 0 || r < 10) {
                v = -1;
            } else if (r < 16 && k > 0) {
                v = row[gpu_rand(rng) % (uint64_t)k]; /* duplicate of an earlier entry */
            } else if (r < 26) {
                static const int edge[] = {0, 63, 64, 127, 128, 191, 192};
                v = edge[gpu_rand(rng) % 7];
                if (r < 18)
                    v = len - 1;
                if (v >= len)
                    v = len - 1;
            } else if (sh->out_of_range && r < 32) {
                v = r < 29 ? len + (int)(gpu_rand(rng) % 70) : -2 - (int)(gpu_rand(rng) % 5);
            } else {
                v = (int)(gpu_rand(rng) % (uint64_t)len);
            }
            row[k] = v;
        }
        for (int k = 0; k < sh->lead_empty && k < topk; k++)
            row[k] = -1;
        for (int k = 0; sh->thin > 1 && k < topk; k++)
            if (gpu_rand(rng) % (uint64_t)sh->thin)
                row[k] = -1;
        for (int k = sh->keep_head > 0 ? sh->keep_head : topk; k < topk; k++)
            row[k] = -1;
        if (sh->empty_rows && t % 5 == 3)
            for (int k = 0; k < topk; k++)
                row[k] = -1;
    }
    for (size_t i = 0; i < (size_t)T * H * 576; i++)
        h->q[i] = mlart_f32_to_bf16(attn_uniform(rng));
}

/* Device buffers of one step plus outputs. */
typedef struct attn_dev {
    void *q, *kv, *idx, *req, *seq, *bt, *out, *lse, *ws;
    size_t ws_bytes;
} attn_dev; /* kv is the device copy of the shared cache (not owned) */

static inline void attn_dev_upload(attn_dev *d, const attn_host *h, void *kv_dev)
{
    const size_t T = (size_t)h->sh.T, H = (size_t)h->sh.H, topk = (size_t)h->sh.topk;
    memset(d, 0, sizeof *d);
    GPU_CUDA(cudaMalloc(&d->q, T * H * 576 * 2));
    d->kv = kv_dev;
    GPU_CUDA(cudaMalloc(&d->idx, T * topk * 4));
    GPU_CUDA(cudaMalloc(&d->req, T * 4));
    GPU_CUDA(cudaMalloc(&d->seq, (size_t)h->B * 4));
    GPU_CUDA(cudaMalloc(&d->bt, (size_t)h->B * h->max_blocks * 4));
    GPU_CUDA(cudaMalloc(&d->out, H * T * 512 * 2));
    GPU_CUDA(cudaMalloc(&d->lse, H * T * 4));
    GPU_CUDA(cudaMemcpy(d->q, h->q, T * H * 576 * 2, cudaMemcpyHostToDevice));
    GPU_CUDA(cudaMemcpy(d->idx, h->idx, T * topk * 4, cudaMemcpyHostToDevice));
    GPU_CUDA(cudaMemcpy(d->req, h->req, T * 4, cudaMemcpyHostToDevice));
    GPU_CUDA(cudaMemcpy(d->seq, h->seq, (size_t)h->B * 4, cudaMemcpyHostToDevice));
    GPU_CUDA(cudaMemcpy(d->bt, h->bt, (size_t)h->B * h->max_blocks * 4, cudaMemcpyHostToDevice));
}

static inline void attn_dev_free(attn_dev *d)
{
    cudaFree(d->q);
    cudaFree(d->idx);
    cudaFree(d->req);
    cudaFree(d->seq);
    cudaFree(d->bt);
    cudaFree(d->out);
    cudaFree(d->lse);
    cudaFree(d->ws);
    memset(d, 0, sizeof *d);
}

static inline mlart_tensor attn_t(void *p, mlart_dtype dt, int dev, int n, int64_t a, int64_t b,
                                  int64_t c)
{
    int64_t shape[3] = {a, b, c};
    return mlart_tensor_dense(p, dt, dev, n, shape);
}

/* The step over host (dev = -1) or device pointers. */
static inline mlart_step attn_step(const attn_host *h, int dev, void *q, void *kv, void *idx,
                                   void *req, void *seq, void *bt, void *out, void *lse, void *ws,
                                   size_t ws_bytes)
{
    mlart_step s;
    const int T = h->sh.T, H = h->sh.H;
    memset(&s, 0, sizeof s);
    s.struct_size = sizeof s;
    s.geom = h->g;
    s.device = dev;
    s.T = T;
    s.B = h->B;
    s.q_mqa = attn_t(q, MLART_DTYPE_BF16, dev, 3, T, H, 576);
    s.kv_cache = attn_t(kv, MLART_DTYPE_U8, dev, 2, h->num_slots, (int64_t)h->row_bytes, 0);
    s.idx = attn_t(idx, MLART_DTYPE_I32, dev, 2, T, h->sh.topk, 0);
    s.req_of_token = attn_t(req, MLART_DTYPE_I32, dev, 1, T, 0, 0);
    s.seq_lens = attn_t(seq, MLART_DTYPE_I32, dev, 1, h->B, 0, 0);
    s.block_table = attn_t(bt, MLART_DTYPE_I32, dev, 2, h->B, h->max_blocks, 0);
    s.attn_out = attn_t(out, MLART_DTYPE_BF16, dev, 3, H, T, 512);
    s.lse = attn_t(lse, MLART_DTYPE_F32, dev, 2, H, T, 0);
    s.workspace = ws;
    s.workspace_bytes = ws_bytes;
    return s;
}

static inline mlart_step attn_dev_step(const attn_host *h, attn_dev *d)
{
    return attn_step(h, 0, d->q, d->kv, d->idx, d->req, d->seq, d->bt, d->out, d->lse, d->ws,
                     d->ws_bytes);
}

/* Poison outputs: 0xffff is a bf16 NaN, 0xffffffff an f32 NaN. */
static inline void attn_poison(attn_dev *d, const attn_host *h)
{
    const size_t n = (size_t)h->sh.H * h->sh.T;
    GPU_CUDA(cudaMemset(d->out, 0xff, n * 512 * 2));
    GPU_CUDA(cudaMemset(d->lse, 0xff, n * 4));
}

/* Results on the host. */
typedef struct attn_result {
    uint16_t *out; /* [H,T,512] */
    float *lse;    /* [H,T] */
} attn_result;

static inline void attn_fetch(attn_result *r, const attn_dev *d, const attn_host *h)
{
    const size_t n = (size_t)h->sh.H * h->sh.T;
    r->out = malloc(n * 512 * 2);
    r->lse = malloc(n * 4);
    GPU_CUDA(cudaMemcpy(r->out, d->out, n * 512 * 2, cudaMemcpyDeviceToHost));
    GPU_CUDA(cudaMemcpy(r->lse, d->lse, n * 4, cudaMemcpyDeviceToHost));
}

static inline void attn_result_free(attn_result *r)
{
    free(r->out);
    free(r->lse);
    r->out = NULL;
    r->lse = NULL;
}

/* Whether any valid index selects something for token t (host view). */
static inline int attn_row_empty(const attn_host *h, int t)
{
    const int len = h->seq[h->req[t]];
    for (int k = 0; k < h->sh.topk; k++) {
        int i = h->idx[(size_t)t * h->sh.topk + k];
        if (i >= 0 && i < len)
            return 0;
    }
    return 1;
}

/* Compare `got` against `want`: NaN-free, NMSE of the output at most
 * nmse_max over all rows and 10 * nmse_max in the worst (head, token) row, LSE within lse_tol (absolute + relative), -inf exactly where
 * want has it, and rows with no valid slot exactly zero.  Writes a short
 * summary; returns 0 when all hold. */
static inline int attn_compare(const attn_host *h, const attn_result *got, const attn_result *want,
                               double nmse_max, double lse_tol, char *msg, size_t msg_len)
{
    const int T = h->sh.T, H = h->sh.H;
    double num = 0.0, den = 0.0, lse_err = 0.0, row_worst = 0.0;
    for (int hh = 0; hh < H; hh++)
        for (int t = 0; t < T; t++) {
            const size_t row = (size_t)hh * T + t;
            const int empty = attn_row_empty(h, t);
            double rn = 0.0, rd = 0.0;
            for (int c = 0; c < 512; c++) {
                float a = mlart_bf16_to_f32(got->out[row * 512 + c]);
                float b = mlart_bf16_to_f32(want->out[row * 512 + c]);
                if (isnan(a)) {
                    snprintf(msg, msg_len, "NaN at out[h=%d][t=%d][%d]", hh, t, c);
                    return -1;
                }
                if (empty && a != 0.0f) {
                    snprintf(msg, msg_len, "empty row out[h=%d][t=%d][%d] = %g, want 0", hh, t, c, a);
                    return -1;
                }
                rn += ((double)a - b) * ((double)a - b);
                rd += (double)b * b;
            }
            num += rn;
            den += rd;
            if (rd > 0.0 && rn / rd > row_worst)
                row_worst = rn / rd;
            if (rd == 0.0 && rn > 0.0)
                row_worst = INFINITY;
            float la = got->lse[row], lb = want->lse[row];
            if (isnan(la) || (isinf(la) != isinf(lb)) || (empty && !(isinf(la) && la < 0))) {
                snprintf(msg, msg_len, "lse[h=%d][t=%d] = %g, want %g (row %s)", hh, t, la, lb,
                         empty ? "empty" : "non-empty");
                return -1;
            }
            if (!isinf(lb)) {
                double e = fabs((double)la - lb) / (1.0 + fabs((double)lb));
                if (e > lse_err)
                    lse_err = e;
            }
        }
    double nmse = den > 0.0 ? num / den : num;
    snprintf(msg, msg_len, "nmse %.3g (max %.1g), worst row %.3g (max %.1g), lse rel err %.3g (max %.1g)",
             nmse, nmse_max, row_worst, 10 * nmse_max, lse_err, lse_tol);
    return nmse <= nmse_max && row_worst <= 10 * nmse_max && lse_err <= lse_tol ? 0 : -1;
}

#endif /* MLART_TESTS_GPU_ATTN_UTIL_H */
