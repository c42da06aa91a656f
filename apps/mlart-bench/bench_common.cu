#include "bench_common.h"

#include <cuda_bf16.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>


static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

#define BENCH_CUDA(stmt) MLART_BENCH_CHECK("mlart-bench", stmt)

extern "C" void mlart_bench_graph_release(cudaStream_t stream, int capturing, cudaGraph_t graph,
                                          cudaGraphExec_t exec)
{
    if (capturing) {
        cudaGraph_t junk = NULL;
        cudaStreamEndCapture(stream, &junk);
        if (junk)
            cudaGraphDestroy(junk);
        cudaGetLastError();
    }
    if (exec)
        cudaGraphExecDestroy(exec);
    if (graph)
        cudaGraphDestroy(graph);
}

extern "C" int mlart_bench_time(const mlart_bench_opts *o, mlart_bench_enqueue_fn fn, void *ctx, int nsets,
                                double *us)
{
    cudaStream_t st = NULL;
    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    double *samples = (double *)malloc(sizeof(double) * (size_t)(o->reps > 0 ? o->reps : 1));
    int rc = -1, capturing = 0;
    if (!samples)
        return -1;
    BENCH_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    BENCH_CUDA(cudaEventCreate(&e0));
    BENCH_CUDA(cudaEventCreate(&e1));
    /* one eager pass first: lazy module loading and library setup stay out of the capture */
    for (int s = 0; s < nsets; s++)
        if (fn(ctx, s, st)) {
            fprintf(stderr, "mlart-bench: enqueue failed (set %d)\n", s);
            goto fail;
        }
    BENCH_CUDA(cudaStreamSynchronize(st));
    BENCH_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    capturing = 1;
    for (int s = 0; s < nsets; s++)
        if (fn(ctx, s, st)) {
            fprintf(stderr, "mlart-bench: enqueue failed during capture (set %d)\n", s);
            goto fail;
        }
    capturing = 0;
    BENCH_CUDA(cudaStreamEndCapture(st, &g));
    BENCH_CUDA(cudaGraphInstantiate(&ge, g, 0));
    for (int i = 0; i < o->warmup; i++)
        BENCH_CUDA(cudaGraphLaunch(ge, st));
    for (int i = 0; i < o->reps; i++) {
        float ms = 0;
        BENCH_CUDA(cudaEventRecord(e0, st));
        BENCH_CUDA(cudaGraphLaunch(ge, st));
        BENCH_CUDA(cudaEventRecord(e1, st));
        BENCH_CUDA(cudaEventSynchronize(e1));
        BENCH_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        samples[i] = ms * 1000.0 / nsets;
    }
    qsort(samples, (size_t)o->reps, sizeof(double), cmp_double);
    *us = o->reps % 2 ? samples[o->reps / 2] : 0.5 * (samples[o->reps / 2 - 1] + samples[o->reps / 2]);
    rc = 0;
fail:
    mlart_bench_graph_release(st, capturing, g, ge);
    if (e0)
        cudaEventDestroy(e0);
    if (e1)
        cudaEventDestroy(e1);
    if (st)
        cudaStreamDestroy(st);
    free(samples);
    return rc;
}

extern "C" int mlart_bench_sets(const mlart_bench_opts *o, size_t bytes_per_set, int min_sets)
{
    if (o->sets > 0)
        return o->sets;
    size_t want = 3 * o->l2_bytes;
    size_t n = bytes_per_set ? (want + bytes_per_set - 1) / bytes_per_set : 1;
    if (n < (size_t)min_sets)
        n = (size_t)min_sets;
    if (n > 128)
        n = 128;
    return (int)n;
}

typedef struct copy_ctx {
    void *src, *dst;
    size_t bytes;
} copy_ctx;

static int copy_enqueue(void *ctx, int set, cudaStream_t st)
{
    copy_ctx *c = (copy_ctx *)ctx;
    (void)set;
    return cudaMemcpyAsync(c->dst, c->src, c->bytes, cudaMemcpyDeviceToDevice, st) != cudaSuccess;
}

/* The same copy by the SMs: 16-byte loads and stores, four in flight per
 * thread.  A graph's memcpy node may run on a copy engine that moves less
 * than the SMs can, and every kernel here is measured against what SMs
 * reach. */
__global__ void copy16_kernel(uint4 *__restrict__ dst, const uint4 *__restrict__ src, size_t n)
{
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
        dst[i] = a;
        dst[i + stride] = b;
        dst[i + 2 * stride] = c;
        dst[i + 3 * stride] = d;
    }
    for (; i < n; i += stride)
        dst[i] = src[i];
}

static int copy_kernel_enqueue(void *ctx, int set, cudaStream_t st)
{
    copy_ctx *c = (copy_ctx *)ctx;
    (void)set;
    copy16_kernel<<<132 * 8, 512, 0, st>>>((uint4 *)c->dst, (const uint4 *)c->src, c->bytes / 16);
    return cudaGetLastError() != cudaSuccess;
}

extern "C" int mlart_bench_copy_roofline(mlart_bench_opts *o)
{
    copy_ctx c = {NULL, NULL, (size_t)1 << 30};
    double us = 0;
    int rc = -1;
    BENCH_CUDA(cudaMalloc(&c.src, c.bytes));
    BENCH_CUDA(cudaMalloc(&c.dst, c.bytes));
    if (mlart_bench_fill_bf16(c.src, c.bytes / 2, 1, 0))
        goto fail;
    /* memcpy node and SM copy kernel, twice each (the first pass also brings
     * the clocks up); keep the fastest */
    for (int pass = 0; pass < 4; pass++) {
        double gbs;
        if (mlart_bench_time(o, pass & 1 ? copy_kernel_enqueue : copy_enqueue, &c, 4, &us))
            goto fail;
        gbs = 2.0 * (double)c.bytes / (us * 1e3);
        if (gbs > o->copy_gbs)
            o->copy_gbs = gbs;
    }
    rc = 0;
fail:
    cudaFree(c.src);
    cudaFree(c.dst);
    return rc;
}

__global__ void fill_bf16_kernel(__nv_bfloat16 *p, size_t n, uint64_t seed)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
        x ^= x >> 31;
        x *= 0xBF58476D1CE4E5B9ull;
        x ^= x >> 29;
        p[i] = __float2bfloat16_rn((float)((double)(x >> 11) / 9007199254740992.0 * 2.0 - 1.0));
    }
}

extern "C" int mlart_bench_fill_bf16(void *p, size_t n, uint64_t seed, cudaStream_t stream)
{
    if (n == 0)
        return 0;
    fill_bf16_kernel<<<1024, 256, 0, stream>>>((__nv_bfloat16 *)p, n, seed * 0xD1B54A32D192ED03ull + 7);
    return cudaGetLastError() != cudaSuccess;
}

/* --filter: alternatives separated by '|'; a name matches one when it
 * contains it, or, for an alternative that ends in '$', ends with it. */
extern "C" int mlart_bench_match(const mlart_bench_opts *o, const char *name)
{
    if (!o->filter || !*o->filter)
        return 1;
    const size_t nl = strlen(name);
    for (const char *p = o->filter;;) {
        const char *bar = strchr(p, '|');
        size_t n = bar ? (size_t)(bar - p) : strlen(p);
        const int anchored = n > 0 && p[n - 1] == '$';
        if (anchored)
            n--;
        if (anchored) {
            if (nl >= n && !memcmp(name + nl - n, p, n))
                return 1;
        } else {
            for (const char *q = name; q + n <= name + nl; q++)
                if (!memcmp(q, p, n))
                    return 1;
        }
        if (!bar)
            return 0;
        p = bar + 1;
    }
}

extern "C" void mlart_bench_table_head(const mlart_bench_opts *o, const mlart_bench_table *t)
{
    (void)o;
    printf("\n# %s\n#\n# %-*s", t->title, t->name_width, t->name_head);
    for (int i = 0; i < t->ncols; i++)
        printf(" %*s", t->cols[i].width, t->cols[i].name);
    printf("\n# %-*s", t->name_width, "");
    for (int i = 0; i < t->ncols; i++)
        printf(" %*s", t->cols[i].width, t->cols[i].unit);
    printf("\n");
    fflush(stdout);
}

/* main.c writes the run's header objects first, so every row follows one */
static void json_sep(const mlart_bench_opts *o)
{
    fprintf(o->json, ",\n");
}

static int g_rows; /* printed by mlart_bench_table_row, for main's check */

extern "C" int mlart_bench_rows(void)
{
    return g_rows;
}

extern "C" void mlart_bench_json_str(FILE *f, const char *s)
{
    fputc('"', f);
    for (; s && *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c < 0x20)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
}

extern "C" void mlart_bench_table_row(const mlart_bench_opts *o, const mlart_bench_table *t, const char *name,
                                      const double *vals)
{
    g_rows++;
    printf("  %-*s", t->name_width, name);
    for (int i = 0; i < t->ncols; i++) {
        if (isnan(vals[i]))
            printf(" %*s", t->cols[i].width, "-");
        else
            printf(" %*.*f", t->cols[i].width, t->cols[i].prec, vals[i]);
    }
    printf("\n");
    fflush(stdout);
    if (o->json) {
        json_sep(o);
        fprintf(o->json, "  {\"table\": ");
        mlart_bench_json_str(o->json, t->title);
        fprintf(o->json, ", \"name\": ");
        mlart_bench_json_str(o->json, name);
        for (int i = 0; i < t->ncols; i++) {
            if (isnan(vals[i]) || isinf(vals[i]))
                fprintf(o->json, ", \"%s\": null", t->cols[i].name);
            else
                fprintf(o->json, ", \"%s\": %.6g", t->cols[i].name, vals[i]);
        }
        fprintf(o->json, "}");
        fflush(o->json);
    }
}

extern "C" void mlart_bench_summary(const mlart_bench_opts *o, const char *table, const char *line)
{
    printf("# %s\n", line);
    fflush(stdout);
    if (o->json) {
        json_sep(o);
        fprintf(o->json, "  {\"table\": ");
        mlart_bench_json_str(o->json, table);
        fprintf(o->json, ", \"summary\": ");
        mlart_bench_json_str(o->json, line);
        fprintf(o->json, "}");
        fflush(o->json);
    }
}

extern "C" mlart_tensor mlart_bench_view3(void *data, void *base, size_t extent, int64_t d0, int64_t d1,
                                          int64_t d2, int64_t s0, int64_t s1)
{
    mlart_tensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.dtype = MLART_DTYPE_BF16;
    t.ndim = 3;
    t.shape[0] = d0;
    t.shape[1] = d1;
    t.shape[2] = d2;
    t.stride[0] = s0;
    t.stride[1] = s1;
    t.stride[2] = 1;
    t.base = base;
    t.extent = extent;
    t.device = 0;
    return t;
}
