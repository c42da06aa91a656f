/* The b12x_mla_sparse backend against the plain CUDA reference and, on
 * small shapes, the host reference: fresh random steps (seed printed),
 * poisoned outputs, both cache formats, awkward shapes, graph replay.
 *
 * Bounds (docs/attention.md): the fast kernel rounds the probabilities to
 * bf16 before P.V (the references keep them in fp32 / fp64), so the output
 * NMSE is bounded by 1e-4 over a step and 1e-3 in the worst (head, token)
 * row, for both formats (fp8 records are dequantised exactly, so the format
 * does not change the bound); LSE within 1e-3 relative; -inf and zero rows
 * exactly where no slot is valid. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <check.h>
#include <stddef.h>
#include <cuda_runtime.h>

#include "attn_util.h"
#include "pdl_probe.h"
#include "backends/b12x_mla_sparse/b12x.h"
#include "backends/b12x_mla_sparse/b12x_attend.h"
#include "backends/reference/reference.h"

#define NMSE_MAX 1e-4
/* The kernels sum bf16-rounded probabilities (docs/attention.md): ln of
 * the row sum is off by at most 2^-9 / (1 - 2^-9) = 1.96e-3, plus fp32
 * noise far below that. */
#define LSE_TOL 2.5e-3

static uint64_t g_seed;
static const mlart_kv_format g_fmts[2] = {MLART_KV_BF16, MLART_KV_FP8_DS_MLA};

typedef struct b12x_run {
    const mlart_backend_vtable *vt;
    void *state;
} b12x_run;

static void b12x_open(b12x_run *r, const attn_host *h, attn_dev *d, int plan_tokens)
{
    mlart_backend_init init;
    mlart_plan plan;
    size_t ws = 0;
    r->vt = mlart_backend_b12x_mla_sparse_vtable();
    memset(&init, 0, sizeof init);
    init.struct_size = sizeof init;
    init.device = 0;
    init.geom = h->g;
    init.error = attn_error_cb;
    init.log = attn_log_cb;
    ck_assert_msg(r->vt->create(&init, &r->state) == 0, "create: %s", attn_last_msg);
    memset(&plan, 0, sizeof plan);
    plan.struct_size = sizeof plan;
    plan.geom = h->g;
    plan.device = 0;
    plan.max_tokens = plan_tokens;
    plan.max_requests = h->B;
    plan.max_blocks_per_req = h->max_blocks;
    plan.num_slots = h->num_slots;
    ck_assert_msg(r->vt->plan(r->state, &plan, &ws) == 0, "plan: %s", attn_last_msg);
    if (ws > d->ws_bytes) {
        cudaFree(d->ws);
        d->ws = NULL;
        GPU_CUDA(cudaMalloc(&d->ws, ws));
        d->ws_bytes = ws;
    }
}

/* The workspace is poisoned too (0xff: NaN as bf16 and as fp32), so a
 * combine that read a partial before it was written would show. */
static void b12x_attend_sync(b12x_run *r, const attn_host *h, attn_dev *d, cudaStream_t st)
{
    mlart_step s = attn_dev_step(h, d);
    attn_poison(d, h);
    if (d->ws)
        GPU_CUDA(cudaMemset(d->ws, 0xff, d->ws_bytes));
    int rc = r->vt->attend(r->state, &s, st);
    ck_assert_msg(rc == 0, "attend: %s", attn_last_msg);
    GPU_CUDA(cudaStreamSynchronize(st));
    GPU_CUDA(cudaGetLastError());
}

/* The grid of the first kernel a step launches: the root of the step
 * captured into a graph (not launched). */
static dim3 b12x_first_grid(b12x_run *r, const attn_host *h, attn_dev *d, cudaStream_t st)
{
    mlart_step s = attn_dev_step(h, d);
    cudaGraph_t graph;
    cudaGraphNode_t root;
    size_t roots = 1;
    enum cudaGraphNodeType type;
    struct cudaKernelNodeParams p;
    GPU_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    int rc = r->vt->attend(r->state, &s, st);
    GPU_CUDA(cudaStreamEndCapture(st, &graph));
    ck_assert_msg(rc == 0, "attend under capture: %s", attn_last_msg);
    GPU_CUDA(cudaGraphGetRootNodes(graph, &root, &roots));
    ck_assert_uint_eq(roots, 1);
    GPU_CUDA(cudaGraphNodeGetType(root, &type));
    ck_assert_msg(type == cudaGraphNodeTypeKernel, "the step's first node is not a kernel (type %d)", (int)type);
    GPU_CUDA(cudaGraphKernelNodeGetParams(root, &p));
    GPU_CUDA(cudaGraphDestroy(graph));
    return p.gridDim;
}

static void ref_attend_sync(const attn_host *h, attn_dev *d, cudaStream_t st)
{
    mlart_step s = attn_dev_step(h, d);
    attn_poison(d, h);
    ck_assert_msg(mlart_reference_attend_cuda(&s, st) == 0, "reference attend: %s",
                  mlart_last_error());
    GPU_CUDA(cudaStreamSynchronize(st));
    GPU_CUDA(cudaGetLastError());
}

static void cpu_attend(const attn_host *h, attn_result *r)
{
    const size_t n = (size_t)h->sh.H * h->sh.T;
    r->out = malloc(n * 512 * 2);
    r->lse = malloc(n * 4);
    memset(r->out, 0xff, n * 512 * 2);
    memset(r->lse, 0xff, n * 4);
    mlart_step s = attn_step(h, -1, h->q, (void *)h->kv, h->idx, h->req, h->seq, h->bt, r->out,
                             r->lse, NULL, 0);
    ck_assert_msg(mlart_reference_attend_cpu(&s) == 0, "host reference: %s", mlart_last_error());
}

typedef struct shared_cache {
    uint8_t *host;
    void *dev;
} shared_cache;

static void cache_open(shared_cache *c, mlart_kv_format fmt, uint64_t *rng)
{
    const size_t bytes = (fmt == MLART_KV_FP8_DS_MLA ? 656 : 1152) * (size_t)ATTN_NUM_SLOTS;
    c->host = attn_cache_make(fmt, rng);
    GPU_CUDA(cudaMalloc(&c->dev, bytes));
    GPU_CUDA(cudaMemcpy(c->dev, c->host, bytes, cudaMemcpyHostToDevice));
}

static void cache_close(shared_cache *c)
{
    free(c->host);
    cudaFree(c->dev);
}

/* What most cases share: a stream of random numbers from the run's seed
 * (salted per case, so each case's steps are its own), one cache on both
 * sides and one stream. */
typedef struct case_env {
    uint64_t rng;
    shared_cache c;
    cudaStream_t st;
} case_env;

static void env_open(case_env *e, mlart_kv_format fmt, int salt)
{
    e->rng = g_seed ^ (uint64_t)salt * 0x9E3779B97F4A7C15ull;
    GPU_CUDA(cudaStreamCreate(&e->st));
    cache_open(&e->c, fmt, &e->rng);
}

static void env_close(case_env *e)
{
    cache_close(&e->c);
    cudaStreamDestroy(e->st);
}

/* b12x vs the CUDA reference (and both vs the host one when cheap), the
 * backend planned for `plan_tokens` >= sh->T tokens. */
static void check_step_planned(const attn_shape *sh, case_env *e, int plan_tokens)
{
    const uint8_t *kv = e->c.host;
    void *kv_dev = e->c.dev;
    uint64_t *rng = &e->rng;
    cudaStream_t st = e->st;
    attn_host h;
    attn_dev d;
    attn_result fast, ref, cpu;
    b12x_run run;
    char msg[256];
    attn_host_make(&h, sh, kv, rng);
    attn_dev_upload(&d, &h, kv_dev);
    b12x_open(&run, &h, &d, plan_tokens);
    b12x_attend_sync(&run, &h, &d, st);
    attn_fetch(&fast, &d, &h);
    ref_attend_sync(&h, &d, st);
    attn_fetch(&ref, &d, &h);
    int bad = attn_compare(&h, &fast, &ref, NMSE_MAX, LSE_TOL, msg, sizeof msg);
    printf("  %-10s T=%-3d H=%-3d topk=%-4d tok/req=%d oor=%d  b12x vs cuda-ref: %s\n",
           mlart_kv_format_name(sh->fmt), sh->T, sh->H, sh->topk, sh->tokens_per_req,
           sh->out_of_range, msg);
    ck_assert_msg(!bad, "b12x vs CUDA reference, %s T=%d H=%d topk=%d: %s",
                  mlart_kv_format_name(sh->fmt), sh->T, sh->H, sh->topk, msg);
    if (!sh->out_of_range && (int64_t)sh->T * sh->H * sh->topk <= 400000) {
        cpu_attend(&h, &cpu);
        bad = attn_compare(&h, &fast, &cpu, NMSE_MAX, LSE_TOL, msg, sizeof msg);
        printf("  %-10s T=%-3d H=%-3d topk=%-4d  b12x vs host-ref: %s\n",
               mlart_kv_format_name(sh->fmt), sh->T, sh->H, sh->topk, msg);
        ck_assert_msg(!bad, "b12x vs host reference: %s", msg);
        bad = attn_compare(&h, &ref, &cpu, NMSE_MAX, LSE_TOL, msg, sizeof msg);
        ck_assert_msg(!bad, "CUDA reference vs host reference: %s", msg);
        attn_result_free(&cpu);
    }
    attn_result_free(&fast);
    attn_result_free(&ref);
    run.vt->destroy(run.state);
    attn_dev_free(&d);
    attn_host_free(&h);
}

static void check_step(const attn_shape *sh, case_env *e)
{
    check_step_planned(sh, e, sh->T);
}

static void check_steps(case_env *e, const attn_shape *shapes, size_t n)
{
    for (size_t i = 0; i < n; i++)
        check_step(&shapes[i], e);
}

/* The sweep of the issue: T x H, topk rotating over {64, 576, 2048}. */
START_TEST(test_sweep)
{
    case_env e;
    static const int Ts[] = {1, 3, 9, 64, 75};
    static const int Hs[] = {1, 11, 16, 64, 128};
    static const int topks[] = {64, 576, 2048};
    env_open(&e, g_fmts[_i], _i + 1);
    for (int it = 0; it < 5; it++)
        for (int ih = 0; ih < 5; ih++) {
            attn_shape sh = {Ts[it], Hs[ih], topks[(it + ih + _i) % 3], g_fmts[_i], 1, 1, 0,
                             (it + ih) % 2 ? 0.0417f : 0.3f, 0, 0, 0};
            check_step(&sh, &e);
        }
    printf("sweep %s: 25 shapes match (seed 0x%llx)\n", mlart_kv_format_name(g_fmts[_i]),
           (unsigned long long)g_seed);
    env_close(&e);
}
END_TEST

/* Top-k not a multiple of the 32-slot block, head counts that leave a
 * partial second tile, several tokens per request, indices out of range. */
START_TEST(test_awkward)
{
    case_env e;
    env_open(&e, g_fmts[_i], _i + 11);
    const attn_shape shapes[] = {
        {5, 20, 100, g_fmts[_i], 1, 1, 0, 0.0417f, 0, 0, 0},   /* topk % 32 != 0, 20 heads */
        {4, 100, 576, g_fmts[_i], 1, 0, 0, 0.0417f, 0, 0, 0},  /* seven 16-row tiles, the last of 4 rows */
        {7, 80, 2048, g_fmts[_i], 1, 1, 0, 0.1f, 0, 0, 0},     /* 64 + 16 heads at 7 tokens: two launches */
        {17, 100, 576, g_fmts[_i], 1, 0, 0, 0.0417f, 0, 0, 0}, /* tiles of 64 + 36 heads (wgmma twice) */
        {18, 80, 2048, g_fmts[_i], 1, 1, 0, 0.1f, 0, 0, 0},    /* 64 + 16 heads: wgmma, then a small-head kernel */
        {12, 16, 2048, g_fmts[_i], 4, 1, 0, 0.0417f, 0, 0, 0}, /* 4 tokens per request */
        {9, 16, 2048, g_fmts[_i], 1, 1, 1, 0.0417f, 0, 0, 0},  /* out-of-range indices */
        {75, 128, 64, g_fmts[_i], 3, 1, 1, 0.5f, 0, 0, 0},
        {2, 33, 1, g_fmts[_i], 1, 0, 0, 0.0417f, 0, 0, 0},     /* topk 1 */
        /* the combine's extremes: chunks whose LSEs lie hundreds apart
         * (scale 30), the leading chunks empty, and both */
        {1, 16, 2048, g_fmts[_i], 1, 0, 0, 30.0f, 0, 0, 0},
        {2, 16, 2048, g_fmts[_i], 1, 0, 0, 0.0417f, 700, 0, 0},
        {1, 64, 2048, g_fmts[_i], 1, 0, 0, 30.0f, 100, 0, 0},
        {8, 16, 2048, g_fmts[_i], 1, 1, 0, 30.0f, 300, 0, 0},
    };
    check_steps(&e, shapes, sizeof shapes / sizeof shapes[0]);
    printf("awkward %s: %zu shapes match (seed 0x%llx)\n", mlart_kv_format_name(g_fmts[_i]),
           sizeof shapes / sizeof shapes[0], (unsigned long long)g_seed);
    env_close(&e);
}
END_TEST

/* Both kernels of 64-head tiles on the same shapes: the wgmma kernel
 * (b12x_wgmma.cu; MLART_B12X_WGMMA=1, the default, for full tiles, =2 also
 * for the last partial tile) and the mma.sync kernel (=0), each with the
 * combine kernel and (_i >= 6) with the in-place combine where the launch
 * takes it (T = 1 at 64 heads and the last three shapes).  The variables
 * are read when the backend is created; each test runs in its own process.
 * Holes, duplicates, page-boundary positions and seq_len < topk come with
 * every step (attn_host_make); empty rows, several tokens per request and
 * out-of-range indices per shape. */
START_TEST(test_wgmma)
{
    case_env e;
    static const char *modes[3] = {"1", "2", "0"};
    const mlart_kv_format fmt = g_fmts[_i % 2];
    setenv("MLART_B12X_WGMMA", modes[(_i / 2) % 3], 1);
    setenv("MLART_B12X_INPLACE", _i >= 6 ? "1" : "0", 1); /* every kernel mode with the in-place combine too */
    env_open(&e, fmt, _i + 31);
    const attn_shape shapes[] = {
        {1, 64, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},   /* split + combine */
        {3, 128, 576, fmt, 1, 1, 0, 0.3f, 0, 0, 0},
        {9, 64, 64, fmt, 1, 1, 0, 0.0417f, 0, 0, 0},
        {64, 128, 2048, fmt, 1, 1, 0, 0.0417f, 0, 0, 0}, /* one pass, two tiles */
        {64, 64, 576, fmt, 1, 1, 0, 0.3f, 0, 0, 0},
        {75, 128, 64, fmt, 3, 1, 1, 0.3f, 0, 0, 0},      /* shared requests, out of range */
        {16, 64, 2048, fmt, 4, 1, 1, 0.0417f, 0, 0, 0},
        {5, 100, 100, fmt, 1, 1, 0, 0.0417f, 0, 0, 0},   /* 64 + 36 heads, topk % 32 != 0 */
        {7, 80, 2048, fmt, 1, 1, 0, 0.1f, 0, 0, 0},      /* 64 + 16 heads */
        {2, 33, 1, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},      /* one partial tile, topk 1 (=1: three 16-row tiles) */
        {4, 127, 576, fmt, 1, 1, 0, 0.0417f, 0, 0, 0},   /* 64 + 63 heads */
        /* shapes the in-place combine takes (_i >= 6) in every mode */
        {2, 80, 2048, fmt, 1, 1, 0, 0.0417f, 0, 0, 0},   /* 64 + 16 */
        {2, 128, 576, fmt, 1, 0, 0, 0.3f, 0, 0, 0},      /* 18 splits, two passes */
        {4, 64, 2048, fmt, 4, 1, 1, 0.0417f, 0, 0, 0},   /* shared requests, out of range */
    };
    check_steps(&e, shapes, sizeof shapes / sizeof shapes[0]);
    printf("64-head tiles, MLART_B12X_WGMMA=%s, MLART_B12X_INPLACE=%d, %s: %zu shapes match (seed 0x%llx)\n",
           modes[(_i / 2) % 3], _i >= 6, mlart_kv_format_name(fmt), sizeof shapes / sizeof shapes[0],
           (unsigned long long)g_seed);
    env_close(&e);
}
END_TEST

/* The slots-as-M wgmma prototype for one tile of <= 16 heads
 * (b12x_wgmma.cu, MLART_B12X_SWG=1, read when the backend is created; each
 * test runs in its own process): 64-slot blocks, an absent half when a
 * chunk has an odd count of 32-slot blocks, the last 16-head tile of 80
 * heads, several tokens per request, out-of-range indices, empty rows. */
START_TEST(test_swg)
{
    case_env e;
    const mlart_kv_format fmt = g_fmts[_i];
    setenv("MLART_B12X_SWG", "1", 1);
    env_open(&e, fmt, _i + 41);
    const attn_shape shapes[] = {
        {1, 16, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},  /* 64 splits of one 32-slot block: absent halves */
        {3, 11, 576, fmt, 1, 1, 0, 0.3f, 0, 0, 0},
        {9, 1, 64, fmt, 1, 1, 0, 0.0417f, 0, 0, 0},
        {64, 16, 2048, fmt, 1, 1, 0, 0.0417f, 0, 0, 0}, /* two splits of 32 blocks */
        {75, 16, 576, fmt, 3, 1, 1, 0.3f, 0, 0, 0},     /* shared requests, out of range */
        {5, 16, 100, fmt, 1, 1, 0, 0.0417f, 0, 0, 0},   /* topk % 32 != 0 */
        {7, 80, 2048, fmt, 1, 1, 0, 0.1f, 0, 0, 0},     /* 64 + 16 heads */
        {16, 16, 576, fmt, 2, 1, 0, 0.0417f, 0, 0, 0},  /* 18 blocks, split */
    };
    check_steps(&e, shapes, sizeof shapes / sizeof shapes[0]);
    printf("slots-as-M prototype, %s: %zu shapes match (seed 0x%llx)\n", mlart_kv_format_name(fmt),
           sizeof shapes / sizeof shapes[0], (unsigned long long)g_seed);
    env_close(&e);
}
END_TEST

/* fp8 steps of >= 8 tokens at <= 16 heads: the register-conversion kernel
 * (b12x_small_rc_kernel, the default) and, with MLART_B12X_RC=0 (read when
 * the backend is created; each test runs in its own process), the
 * small-head kernel it replaces there.  Chunks of one block (no next block
 * to overlap), odd and even block counts, a partial last block, the last
 * 16-head tile of 80 heads, shared requests, out-of-range indices, empty
 * rows. */
START_TEST(test_rc)
{
    case_env e;
    const mlart_kv_format fmt = MLART_KV_FP8_DS_MLA;
    setenv("MLART_B12X_RC", _i == 0 ? "1" : "0", 1);
    env_open(&e, fmt, _i + 51);
    const attn_shape shapes[] = {
        {8, 16, 2048, fmt, 1, 1, 0, 0.0417f, 0, 0, 0},  /* the smallest step it takes, 16 splits */
        {64, 16, 2048, fmt, 1, 1, 0, 0.0417f, 0, 0, 0}, /* two splits of 32 blocks */
        {8, 16, 96, fmt, 1, 0, 0, 0.3f, 0, 0, 0},       /* three blocks, one chunk */
        {9, 1, 64, fmt, 1, 1, 0, 0.0417f, 0, 0, 0},
        {10, 11, 100, fmt, 1, 1, 0, 0.0417f, 0, 0, 0},  /* topk % 32 != 0 */
        {33, 16, 1, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},    /* topk 1: one block */
        {12, 16, 2048, fmt, 4, 1, 0, 0.0417f, 0, 0, 0}, /* 4 tokens per request */
        {75, 16, 576, fmt, 3, 1, 1, 0.3f, 0, 0, 0},     /* shared requests, out of range */
        {16, 16, 576, fmt, 2, 1, 0, 0.0417f, 0, 0, 0},  /* 18 blocks, split */
        {8, 80, 2048, fmt, 1, 1, 0, 0.1f, 0, 0, 0},     /* 64 + 16 heads */
    };
    check_steps(&e, shapes, sizeof shapes / sizeof shapes[0]);
    printf("fp8 <= 16 heads, T >= 8, MLART_B12X_RC=%d: %zu shapes match (seed 0x%llx)\n", _i == 0,
           sizeof shapes / sizeof shapes[0], (unsigned long long)g_seed);
    env_close(&e);
}
END_TEST

/* Sparse lists, as a DCP rank sees them (about one index in 4 or in 64
 * kept, the rest -1, spread over the list), and lists whose valid entries
 * all sit at the front (an indexer's list for a request shorter than
 * top-k; the chunks take the list's blocks interleaved, b12x::chunk_of):
 * every chunk compacts its valid slots to the front and computes only the
 * blocks they fill (b12x::resolve_slots).  Each kernel family on the same shapes, picked
 * by the variables read when the backend is created (each test runs in
 * its own process): _i / 2 = 0 the default launch (small-head kernels at
 * <= 16 heads, with column halves at T = 1 and the register-conversion
 * kernel at fp8 T >= 8; 16-row tiles and wgmma at 64 and 128 heads), 1
 * the mma.sync kernels for 64-head tiles and the small-head kernel for
 * fp8, 2 the slots-as-M prototype at <= 16 heads and the in-place
 * combine where the launch takes it. */
START_TEST(test_thin)
{
    case_env e;
    const mlart_kv_format fmt = g_fmts[_i % 2];
    const int mode = _i / 2;
    setenv("MLART_B12X_WGMMA", mode == 1 ? "0" : "1", 1);
    setenv("MLART_B12X_RC", mode == 1 ? "0" : "1", 1);
    setenv("MLART_B12X_SWG", mode == 2 ? "1" : "0", 1);
    setenv("MLART_B12X_INPLACE", mode == 2 ? "1" : "0", 1);
    env_open(&e, fmt, _i + 61);
    const attn_shape shapes[] = {
        /* T, H, topk, fmt, tokens/req, empty rows, out of range, scale, lead empty, thin, keep head */
        {1, 16, 2048, fmt, 1, 0, 0, 0.0417f, 0, 4, 0},
        {2, 16, 2048, fmt, 1, 0, 0, 0.3f, 0, 64, 0},
        {8, 16, 2048, fmt, 1, 1, 0, 0.0417f, 0, 4, 0},
        {64, 16, 2048, fmt, 1, 1, 0, 0.0417f, 0, 4, 0}, /* chunks of 32 blocks -> about 8 */
        {64, 16, 2048, fmt, 1, 1, 1, 0.0417f, 0, 64, 0},
        {9, 11, 576, fmt, 1, 1, 0, 0.3f, 0, 4, 0},
        {1, 64, 2048, fmt, 1, 0, 0, 0.0417f, 0, 4, 0},
        {4, 64, 2048, fmt, 4, 1, 1, 0.0417f, 0, 4, 0},
        {64, 64, 2048, fmt, 1, 1, 0, 0.0417f, 0, 4, 0},
        {16, 64, 2048, fmt, 1, 1, 0, 30.0f, 300, 64, 0},
        {3, 128, 2048, fmt, 1, 1, 0, 0.3f, 0, 4, 0},
        {64, 128, 576, fmt, 1, 1, 0, 0.0417f, 0, 4, 0},
        {7, 80, 2048, fmt, 1, 1, 0, 0.1f, 0, 4, 0},     /* 64 + 16 heads */
        {5, 100, 100, fmt, 1, 1, 0, 0.0417f, 0, 4, 0},  /* topk % 32 != 0 */
        /* valid entries at the front: 512, 300, 100, 33 of the list */
        {16, 16, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 512},
        {4, 64, 2048, fmt, 1, 1, 0, 0.0417f, 0, 0, 300},
        {64, 128, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 100},
        {9, 11, 576, fmt, 1, 0, 0, 0.3f, 0, 0, 33},
    };
    check_steps(&e, shapes, sizeof shapes / sizeof shapes[0]);
    printf("sparse lists, mode %d, %s: %zu shapes match (seed 0x%llx)\n", mode, mlart_kv_format_name(fmt),
           sizeof shapes / sizeof shapes[0], (unsigned long long)g_seed);
    env_close(&e);
}
END_TEST

/* A number in [lo, hi] from the case's generator. */
static int rand_in(uint64_t *rng, int lo, int hi)
{
    return lo + (int)(gpu_rand(rng) % (uint64_t)(hi - lo + 1));
}

/* Steps drawn at random from the whole space the launch dispatches on,
 * fresh every run (the seed printed repeats them): heads 1..128 (half of
 * the draws at the counts where the rules change: 16, 17, 32, 33, 63, 64,
 * 65, 127, 128), T 1..96 (most at <= 16), top-k 1..2048 (most at 2048,
 * 576 and 64), shared requests, empty rows, out-of-range indices, leading
 * empty entries, a DCP rank's thin lists and an indexer's short lists,
 * the backend planned for up to twice the step's tokens, and each step
 * under the default kernels or, for a third of them, under another mode
 * (the mma.sync kernels for 64-head tiles or wgmma for every tile, no
 * register-conversion kernel, no column halves, the in-place combine).
 * Every step against the CUDA reference (and the host one where cheap). */
START_TEST(test_random)
{
    case_env e;
    const mlart_kv_format fmt = g_fmts[_i];
    static const int edge_heads[] = {16, 17, 32, 33, 63, 64, 65, 127, 128};
    static const int common_topk[] = {2048, 2048, 2048, 576, 64};
    static const float scales[] = {0.0417f, 0.0417f, 0.1f, 0.3f, 30.0f};
    enum { N = 24 };
    env_open(&e, fmt, _i + 91);
    uint64_t *rng = &e.rng;
    for (int i = 0; i < N; i++) {
        attn_shape sh;
        memset(&sh, 0, sizeof sh);
        sh.fmt = fmt;
        sh.H = gpu_rand(rng) % 2 ? edge_heads[gpu_rand(rng) % 9] : rand_in(rng, 1, 128);
        const int tr = rand_in(rng, 0, 9);
        sh.T = tr < 6 ? rand_in(rng, 1, 8) : tr < 8 ? rand_in(rng, 9, 32) : rand_in(rng, 33, 96);
        sh.topk = gpu_rand(rng) % 3 ? common_topk[gpu_rand(rng) % 5] : rand_in(rng, 1, 2048);
        sh.tokens_per_req = gpu_rand(rng) % 3 ? 1 : rand_in(rng, 2, 4);
        sh.empty_rows = gpu_rand(rng) % 4 == 0;
        sh.out_of_range = gpu_rand(rng) % 5 == 0;
        sh.scale = scales[gpu_rand(rng) % 5];
        const int lists = rand_in(rng, 0, 9);
        if (lists == 0)
            sh.lead_empty = rand_in(rng, 1, sh.topk);
        else if (lists <= 2)
            sh.thin = (int[]){2, 4, 16, 64}[gpu_rand(rng) % 4];
        else if (lists <= 4)
            sh.keep_head = rand_in(rng, 1, sh.topk);
        const int plan_tokens = gpu_rand(rng) % 4 ? sh.T : rand_in(rng, sh.T, 2 * sh.T);
        /* the kernel modes, read when the backend is created */
        const int mode = gpu_rand(rng) % 3 ? 0 : rand_in(rng, 1, 5);
        setenv("MLART_B12X_WGMMA", mode == 1 ? "0" : mode == 2 ? "2" : "1", 1);
        setenv("MLART_B12X_RC", mode == 3 ? "0" : "1", 1);
        setenv("MLART_B12X_HALF", mode == 4 ? "0" : "1", 1);
        setenv("MLART_B12X_INPLACE", mode == 5 ? "1" : "0", 1);
        printf("  random step %d: mode %d, lead empty %d, thin %d, keep head %d, planned for %d tokens\n", i,
               mode, sh.lead_empty, sh.thin, sh.keep_head, plan_tokens);
        check_step_planned(&sh, &e, plan_tokens);
    }
    printf("random %s: %d steps match (seed 0x%llx)\n", mlart_kv_format_name(fmt), N,
           (unsigned long long)g_seed);
    env_close(&e);
}
END_TEST

/* One token at <= 16 heads: its chunks in column halves (two blocks a
 * chunk, b12x_small_kernel HALF; the default) against the same backend
 * created with MLART_B12X_HALF=0 (one block a chunk): bit for bit equal,
 * since each output column is computed the same way, and against the CUDA
 * reference.  Head counts 1, 11 and 16, top-k a multiple of 32 or not,
 * leading empty slots (chunks with no valid slot: LSE -inf partials). */
START_TEST(test_half)
{
    case_env e;
    const mlart_kv_format fmt = g_fmts[_i];
    env_open(&e, fmt, _i + 61);
    const attn_shape shapes[] = {
        {1, 16, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},
        {1, 11, 2048, fmt, 1, 0, 0, 0.3f, 0, 0, 0},
        {1, 1, 576, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},
        {1, 16, 100, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},    /* topk % 32 != 0 */
        {1, 16, 2048, fmt, 1, 0, 1, 0.0417f, 1500, 0, 0}, /* empty chunks, out-of-range indices */
    };
    int sms = 0, halves = 0;
    GPU_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        attn_host h;
        attn_dev d;
        attn_result one, two, ref;
        b12x_run run;
        char msg[256];
        attn_host_make(&h, &shapes[i], e.c.host, &e.rng);
        attn_dev_upload(&d, &h, e.c.dev);
        /* the launch's rule (b12x_attend_halves, as setup leaves
         * MLART_B12X_HALF=1), and what each backend launched: the main
         * kernel's grid is (T, 2, splits) in halves, (T, 1, splits) not */
        const int fp8 = fmt == MLART_KV_FP8_DS_MLA;
        const b12x_split sp = b12x_attend_split(1, h.sh.H, h.sh.topk, fp8, sms);
        const b12x_dev dv = {.num_sms = sms};
        const int half = b12x_attend_halves(&dv, 1, h.sh.H, sp.splits, fp8, 0);
        setenv("MLART_B12X_HALF", "0", 1);
        b12x_open(&run, &h, &d, 1);
        dim3 grid = b12x_first_grid(&run, &h, &d, e.st);
        ck_assert_msg(grid.x == 1 && grid.y == 1 && (int)grid.z == sp.splits, "MLART_B12X_HALF=0: grid %u x %u x %u",
                      grid.x, grid.y, grid.z);
        b12x_attend_sync(&run, &h, &d, e.st);
        attn_fetch(&one, &d, &h);
        run.vt->destroy(run.state);
        setenv("MLART_B12X_HALF", "1", 1);
        b12x_open(&run, &h, &d, 1);
        grid = b12x_first_grid(&run, &h, &d, e.st);
        ck_assert_msg(grid.x == 1 && (int)grid.y == 1 + half && (int)grid.z == sp.splits,
                      "H=%d: grid %u x %u x %u, the rule says %s", h.sh.H, grid.x, grid.y, grid.z,
                      half ? "halves" : "whole rows");
        b12x_attend_sync(&run, &h, &d, e.st);
        attn_fetch(&two, &d, &h);
        run.vt->destroy(run.state);
        halves += grid.y == 2;
        const size_t rows = (size_t)h.sh.H * h.sh.T;
        ck_assert_msg(memcmp(one.out, two.out, rows * 512 * 2) == 0 && memcmp(one.lse, two.lse, rows * 4) == 0,
                      "%s H=%d topk=%d: column halves differ from whole rows", mlart_kv_format_name(fmt),
                      h.sh.H, h.sh.topk);
        ref_attend_sync(&h, &d, e.st);
        attn_fetch(&ref, &d, &h);
        const int bad = attn_compare(&h, &two, &ref, NMSE_MAX, LSE_TOL, msg, sizeof msg);
        printf("  %-10s T=1 H=%-3d topk=%-4d %d chunks%s == whole rows, vs cuda-ref: %s\n",
               mlart_kv_format_name(fmt), h.sh.H, h.sh.topk, sp.splits, half ? " in column halves" : "", msg);
        ck_assert_msg(!bad, "column halves vs CUDA reference: %s", msg);
        attn_result_free(&one);
        attn_result_free(&two);
        attn_result_free(&ref);
        attn_dev_free(&d);
        attn_host_free(&h);
    }
    /* 64 chunks at 16 heads and top-k 2048 take 128 blocks: an H100 or
     * H200 (132 multiprocessors) runs at least those in halves */
    ck_assert_msg(sms < 128 || halves >= 2, "only %d shapes ran in column halves on %d multiprocessors", halves, sms);
    printf("%s T = 1, column halves: %zu shapes (%d of them in halves) equal to whole rows bit for bit and match "
           "(seed 0x%llx)\n",
           mlart_kv_format_name(fmt), sizeof shapes / sizeof shapes[0], halves, (unsigned long long)g_seed);
    env_close(&e);
}
END_TEST

/* A step of more than 16 heads whose 16-row tiles number at most 12 over
 * its tokens, or with two such tiles at most 64 tokens (DeepSeek-V3.2 at
 * tensor parallel 4: 32 heads a rank; GLM-5 at 64 heads, T <= 3), or of
 * 65..127 heads at most 6 tokens (a full and a partial 64-head tile), runs on
 * the small-head kernel in those tiles: the main kernel's grid is (T,
 * tiles, splits) with the split of b12x_attend_split, against (T, 64-head
 * tiles or 1, splits) on the wgmma kernel past the rule; every step
 * against the CUDA reference (and the host one where cheap).  The last tile short of 16 rows, top-k
 * not a multiple of 32, empty rows, shared requests, out-of-range indices,
 * chunks with no valid slot, and 8 or more (token, tile) pairs (fp8: the
 * register-conversion kernel). */
START_TEST(test_small_tiles)
{
    case_env e;
    const mlart_kv_format fmt = g_fmts[_i];
    const int fp8 = fmt == MLART_KV_FP8_DS_MLA;
    int sms = 0, tiled = 0;
    GPU_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    env_open(&e, fmt, _i + 71);
    const attn_shape shapes[] = {
        {1, 32, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},    /* two tiles */
        {1, 17, 2048, fmt, 1, 0, 0, 0.3f, 0, 0, 0},       /* the second tile of one row */
        {2, 48, 576, fmt, 1, 1, 0, 0.0417f, 0, 0, 0},     /* three tiles */
        {1, 63, 100, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},     /* four, the last of 15 rows; topk % 32 != 0 */
        {2, 56, 2048, fmt, 2, 1, 1, 0.0417f, 0, 0, 0},    /* eight pairs; a shared request, out of range */
        {4, 32, 2048, fmt, 1, 0, 1, 0.0417f, 1500, 0, 0}, /* eight pairs; chunks with no valid slot */
        {4, 40, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},    /* twelve pairs */
        {64, 24, 576, fmt, 4, 1, 0, 0.0417f, 0, 0, 0},    /* two tiles at 64 tokens */
        {5, 40, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},    /* fifteen pairs: the wgmma kernel */
        {4, 56, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},    /* sixteen: wgmma */
        {65, 24, 64, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},     /* two tiles past 64 tokens: wgmma */
        {1, 64, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},    /* 64 heads: four tiles */
        {3, 64, 576, fmt, 1, 1, 1, 0.0417f, 0, 0, 0},     /* twelve pairs */
        {1, 128, 2048, fmt, 2, 0, 0, 0.0417f, 0, 0, 0},   /* eight tiles; a shared request */
        {2, 80, 2048, fmt, 1, 0, 0, 0.3f, 0, 0, 0},       /* five tiles, the last of 16 rows */
        {4, 64, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},    /* sixteen pairs: wgmma */
        {2, 127, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},   /* sixteen pairs of 65..127 heads: tiles */
        {6, 100, 576, fmt, 3, 1, 1, 0.0417f, 0, 0, 0},    /* 42 pairs at 6 tokens: tiles */
        {7, 100, 576, fmt, 1, 1, 0, 0.0417f, 0, 0, 0},    /* 7 tokens: wgmma twice */
        {17, 72, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},   /* 17 tokens: wgmma, then a small-head kernel */
        {3, 128, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},   /* 24 pairs of 128 heads: wgmma */
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const attn_shape *sh = &shapes[i];
        attn_host h;
        attn_dev d;
        b12x_run run;
        const int rt = (sh->H + 15) / 16,
                  small = sh->T * rt <= 12 || (rt == 2 && sh->T <= 64) || (sh->H > 64 && sh->H < 128 && sh->T <= 6);
        const int first_y = small ? rt : sh->H >= 64 ? sh->H / 64 : 1; /* the first launch's tiles */
        const b12x_split sp = b12x_attend_split(sh->T, sh->H, sh->topk, fp8, sms);
        attn_host_make(&h, sh, e.c.host, &e.rng);
        attn_dev_upload(&d, &h, e.c.dev);
        b12x_open(&run, &h, &d, sh->T);
        const dim3 grid = b12x_first_grid(&run, &h, &d, e.st);
        run.vt->destroy(run.state);
        attn_dev_free(&d);
        attn_host_free(&h);
        ck_assert_msg((int)grid.x == sh->T && (int)grid.y == first_y && (int)grid.z == sp.splits,
                      "T=%d H=%d: grid %u x %u x %u, the rule says %d x %d x %d", sh->T, sh->H, grid.x, grid.y,
                      grid.z, sh->T, first_y, sp.splits);
        printf("  %s T=%d H=%d: grid %u x %u x %u (%s)\n", mlart_kv_format_name(fmt), sh->T, sh->H, grid.x, grid.y,
               grid.z, small ? "16-row tiles" : "one tile");
        tiled += small;
        check_step(sh, &e);
    }
    ck_assert_int_eq(tiled, 14);
    printf("%s partial tiles: %zu shapes match, %d of them in 16-row tiles (seed 0x%llx)\n",
           mlart_kv_format_name(fmt), sizeof shapes / sizeof shapes[0], tiled, (unsigned long long)g_seed);
    env_close(&e);
}
END_TEST

/* Split steps with MLART_B12X_INPLACE=1 (read when the backend is
 * created; each test runs in its own process): the combine inside the
 * small-head kernels (<= 16 heads), the wgmma kernel (64 heads at 4
 * tokens, 128 at 2; 40 heads at 5 tokens), never the 16-row tiles (32 and
 * 40 heads at 1 and 3 tokens, 64 at 1, 80, 100 and 127 heads at 2 and 3:
 * the combine kernel), wherever the launch rule takes it (both launches of
 * a step with a partial last tile: test_inplace_parts); with =0 the
 * combine kernel (the default).  64 chunks of one block
 * (T = 1, 2), 32 and 16 chunks, 11 heads and 1 head (slices that do not
 * divide evenly: 128 units over 18 chunks), a partial last block, shared
 * requests, out-of-range indices, empty rows; fp8 at T >= 8 on the
 * register-conversion kernel; two 64-head tiles (128 heads: one barrier
 * per tile); steps that split but are too large to be resident at once or
 * would combine in more than two L2 round trips (T = 24 at 80, 127 and 128
 * heads, T = 3 at 128 heads, T = 64 at 16 heads: the combine kernel either
 * way).  The workspace is poisoned before every call. */
START_TEST(test_inplace)
{
    case_env e;
    const mlart_kv_format fmt = g_fmts[_i % 2];
    const int inplace = _i < 2;
    setenv("MLART_B12X_INPLACE", inplace ? "1" : "0", 1);
    env_open(&e, fmt, _i + 61);
    const attn_shape shapes[] = {
        {1, 16, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},  /* 64 chunks of one block */
        {2, 16, 2048, fmt, 1, 0, 0, 0.3f, 0, 0, 0},
        {4, 11, 2048, fmt, 1, 1, 0, 0.0417f, 0, 0, 0},  /* 11 heads: 1408 units over 32 chunks */
        {3, 1, 576, fmt, 1, 1, 0, 0.0417f, 0, 0, 0},    /* one head */
        {8, 16, 2048, fmt, 1, 1, 0, 0.0417f, 0, 0, 0},  /* fp8: the register-conversion kernel */
        {12, 16, 2048, fmt, 4, 1, 0, 0.0417f, 0, 0, 0}, /* 4 tokens per request */
        {9, 16, 2048, fmt, 1, 1, 1, 0.0417f, 0, 0, 0},  /* out-of-range indices */
        {64, 16, 2048, fmt, 1, 1, 0, 0.0417f, 0, 0, 0}, /* two chunks: resident, but four round trips (kernel) */
        {5, 16, 100, fmt, 1, 1, 0, 0.0417f, 0, 0, 0},   /* topk % 32 != 0 */
        {1, 64, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},  /* four 16-row tiles: the combine kernel either way */
        {4, 64, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},  /* wgmma kernel */
        {2, 128, 2048, fmt, 1, 0, 0, 0.3f, 0, 0, 0},    /* two tiles */
        {4, 64, 2048, fmt, 4, 1, 1, 0.0417f, 0, 0, 0},  /* shared requests, out of range */
        {24, 128, 2048, fmt, 1, 1, 0, 0.0417f, 0, 0, 0}, /* splits, but not resident at once */
        {1, 32, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},  /* 16-row tiles: the combine kernel either way */
        {3, 40, 2048, fmt, 1, 1, 0, 0.3f, 0, 0, 0},
        {5, 40, 2048, fmt, 1, 1, 0, 0.0417f, 0, 0, 0},  /* a partial tile on the wgmma kernel */
        {2, 100, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0}, /* 16-row tiles: the combine kernel either way */
        {3, 80, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},
        {2, 127, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},
        {2, 100, 576, fmt, 1, 1, 1, 0.0417f, 0, 0, 0},  /* out-of-range indices */
        {3, 128, 576, fmt, 1, 1, 0, 0.0417f, 0, 0, 0},  /* 9 splits: four round trips (kernel) */
        {24, 80, 2048, fmt, 1, 1, 0, 0.0417f, 0, 0, 0}, /* two launches, 5 splits: the combine kernel */
        {24, 127, 2048, fmt, 1, 1, 0, 0.0417f, 0, 0, 0},
    };
    if (inplace) {
        /* the launch's own rule: the first shapes of each kernel do take the path */
        b12x_dev dev;
        const int fp8 = fmt == MLART_KV_FP8_DS_MLA;
        ck_assert_msg(b12x_attend_setup(&dev, attn_error_cb) == 0, "setup: %s", attn_last_msg);
        const b12x_split s16 = b12x_attend_split(1, 16, 2048, fp8, dev.num_sms);
        const b12x_split s64 = b12x_attend_split(4, 64, 2048, fp8, dev.num_sms);
        const b12x_split s24 = b12x_attend_split(24, 128, 2048, fp8, dev.num_sms);
        printf("in place: resident %d / %d blocks; T=1 H=16 %d chunks: %d; T=4 H=64 %d chunks: %d; T=24 H=128 "
               "%d chunks: %d\n",
               dev.resident, dev.resident_wg, s16.splits, b12x_attend_inplace_ok(&dev, 1, 16, s16.splits), s64.splits,
               b12x_attend_inplace_ok(&dev, 4, 64, s64.splits), s24.splits,
               b12x_attend_inplace_ok(&dev, 24, 128, s24.splits));
        ck_assert_msg(b12x_attend_inplace_ok(&dev, 1, 16, s16.splits) && b12x_attend_inplace_ok(&dev, 4, 64, s64.splits),
                      "T = 1 at 16 heads and T = 4 at 64 heads should combine in place");
        const b12x_split s40 = b12x_attend_split(5, 40, 2048, fp8, dev.num_sms);
        const b12x_split s80 = b12x_attend_split(3, 80, 2048, fp8, dev.num_sms);
        const b12x_split s127 = b12x_attend_split(2, 127, 2048, fp8, dev.num_sms);
        const b12x_split t40 = b12x_attend_split(1, 40, 2048, fp8, dev.num_sms);
        printf("in place: resident general %d; T=5 H=40 %d chunks: %d; T=3 H=80 %d: %d; T=2 H=127 %d: %d; T=1 "
               "H=40 (16-row tiles) %d: %d\n",
               dev.resident_gen, s40.splits, b12x_attend_inplace_ok(&dev, 5, 40, s40.splits), s80.splits,
               b12x_attend_inplace_ok(&dev, 3, 80, s80.splits), s127.splits,
               b12x_attend_inplace_ok(&dev, 2, 127, s127.splits), t40.splits,
               b12x_attend_inplace_ok(&dev, 1, 40, t40.splits));
        ck_assert_msg(b12x_attend_inplace_ok(&dev, 5, 40, s40.splits),
                      "T = 5 at 40 heads (a partial tile on the wgmma kernel) should combine in place");
        ck_assert_msg(!b12x_attend_inplace_ok(&dev, 3, 80, s80.splits) &&
                          !b12x_attend_inplace_ok(&dev, 2, 127, s127.splits),
                      "T = 3 at 80 and T = 2 at 127 heads run in 16-row tiles, never in place");
        ck_assert_msg(!b12x_attend_inplace_ok(&dev, 1, 40, t40.splits),
                      "T = 1 at 40 heads runs in 16-row tiles, never in place");
        ck_assert_msg(s24.splits > 1 && !b12x_attend_inplace_ok(&dev, 24, 128, s24.splits),
                      "T = 24 at 128 heads should split and not be resident at once");
        b12x_attend_teardown(&dev);
    }
    check_steps(&e, shapes, sizeof shapes / sizeof shapes[0]);
    printf("split steps, MLART_B12X_INPLACE=%d, %s: %zu shapes match (seed 0x%llx)\n", inplace,
           mlart_kv_format_name(fmt), sizeof shapes / sizeof shapes[0], (unsigned long long)g_seed);
    env_close(&e);
}
END_TEST

/* Both launches of a step with a full and a partial 64-head tile (80, 100,
 * 127 heads: the wgmma kernel, then a small-head kernel at 16 rows or the
 * wgmma kernel again) combining in place.  Such a step runs them only past
 * the 16-row tiles' rule (more than 6 tokens), here with 6 or 7 splits, where a
 * block's combine takes more L2 round trips (5 or 6) than the default cap
 * of 2; this case lifts it (MLART_B12X_INPLACE_TRIPS=16, read when the
 * backend is created; each test runs in its own process), and the launch's
 * own rule must take the path at every shape. */
START_TEST(test_inplace_parts)
{
    case_env e;
    const mlart_kv_format fmt = g_fmts[_i];
    const int fp8 = fmt == MLART_KV_FP8_DS_MLA;
    b12x_dev dev;
    setenv("MLART_B12X_INPLACE", "1", 1);
    setenv("MLART_B12X_INPLACE_TRIPS", "16", 1);
    env_open(&e, fmt, _i + 67);
    const attn_shape shapes[] = {
        {17, 80, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},  /* 64 heads on wgmma + 16 on a small-head kernel */
        {17, 127, 2048, fmt, 1, 1, 0, 0.0417f, 0, 0, 0}, /* 64 + 63, wgmma twice */
        {20, 100, 576, fmt, 1, 1, 1, 0.0417f, 0, 0, 0},  /* 64 + 36, out-of-range indices */
    };
    const size_t n = sizeof shapes / sizeof shapes[0];
    ck_assert_msg(b12x_attend_setup(&dev, attn_error_cb) == 0, "setup: %s", attn_last_msg);
    for (size_t i = 0; i < n; i++) {
        const b12x_split sp = b12x_attend_split(shapes[i].T, shapes[i].H, shapes[i].topk, fp8, dev.num_sms);
        ck_assert_msg(b12x_attend_inplace_ok(&dev, shapes[i].T, shapes[i].H, sp.splits),
                      "T=%d H=%d, %d splits: should combine in place", shapes[i].T, shapes[i].H, sp.splits);
    }
    b12x_attend_teardown(&dev);
    check_steps(&e, shapes, n);
    printf("both launches in place, %s: %zu shapes match (seed 0x%llx)\n", mlart_kv_format_name(fmt), n,
           (unsigned long long)g_seed);
    env_close(&e);
}
END_TEST

/* The in-place combine's barriers go back to their first state after
 * every use: 60 calls back to back on one stream, no synchronisation,
 * with 1..4 tokens (different split counts, so the barrier of token 0
 * counts to different totals), then, on a poisoned workspace, the full
 * step, which must equal the reference and a fresh backend's result bit
 * for bit.  16 heads (the small-head kernels) and 128 heads (the wgmma
 * kernel, two tiles, at 2..4 tokens; at one token eight 16-row tiles and
 * the combine kernel between them). */
START_TEST(test_inplace_repeat)
{
    case_env e;
    const mlart_kv_format fmt = g_fmts[_i % 2];
    attn_host h;
    attn_dev d;
    attn_result once, again, ref;
    b12x_run run, fresh;
    char msg[256];
    const attn_shape sh = {4, _i < 2 ? 16 : 128, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0};
    setenv("MLART_B12X_INPLACE", "1", 1);
    env_open(&e, fmt, _i + 71);
    attn_host_make(&h, &sh, e.c.host, &e.rng);
    attn_dev_upload(&d, &h, e.c.dev);
    b12x_open(&fresh, &h, &d, sh.T);
    b12x_attend_sync(&fresh, &h, &d, e.st);
    attn_fetch(&once, &d, &h);
    fresh.vt->destroy(fresh.state);

    b12x_open(&run, &h, &d, sh.T);
    attn_poison(&d, &h);
    mlart_step s = attn_dev_step(&h, &d);
    for (int k = 0; k < 60; k++) {
        s.T = 1 + (k + 1) % 4; /* the last is T = 1, not the step checked below */
        ck_assert_msg(run.vt->attend(run.state, &s, e.st) == 0, "attend %d: %s", k, attn_last_msg);
    }
    /* poisoned partials: a chunk that combined before the others wrote would read NaN */
    GPU_CUDA(cudaMemsetAsync(d.ws, 0xff, d.ws_bytes, e.st));
    s.T = sh.T;
    ck_assert_msg(run.vt->attend(run.state, &s, e.st) == 0, "attend: %s", attn_last_msg);
    GPU_CUDA(cudaStreamSynchronize(e.st));
    GPU_CUDA(cudaGetLastError());
    attn_fetch(&again, &d, &h);
    ck_assert_msg(memcmp(once.out, again.out, (size_t)sh.H * sh.T * 1024) == 0,
                  "after 60 calls the output differs from a fresh backend's");
    ck_assert_msg(memcmp(once.lse, again.lse, (size_t)sh.H * sh.T * 4) == 0,
                  "after 60 calls the LSE differs from a fresh backend's");
    ref_attend_sync(&h, &d, e.st);
    attn_fetch(&ref, &d, &h);
    ck_assert_msg(!attn_compare(&h, &again, &ref, NMSE_MAX, LSE_TOL, msg, sizeof msg), "vs reference: %s", msg);
    printf("%s, %d heads: 61 calls back to back (T = 1..4), then equal to a fresh backend bit for bit; %s\n",
           mlart_kv_format_name(fmt), sh.H, msg);
    attn_result_free(&once);
    attn_result_free(&again);
    attn_result_free(&ref);
    run.vt->destroy(run.state);
    attn_dev_free(&d);
    attn_host_free(&h);
    env_close(&e);
}
END_TEST

/* Calls back to back whose combine lets the next kernel launch before its
 * own dependency wait (16 heads: the small-head kernels and the capped
 * combine after them): four steps of T = 1, 4, 8 and 2 tokens, each with
 * its own query, indices and outputs over one cache and one workspace,
 * called three times round on one stream without synchronisation (so a
 * call's blocks resolve their slots while the call before ends, and its
 * partials go into the workspace the call before combines from).  Each
 * step's output and LSE, poisoned before the round, must equal its call
 * alone bit for bit, and the reference. */
START_TEST(test_back_to_back)
{
    case_env e;
    const mlart_kv_format fmt = g_fmts[_i];
    static const int Ts[4] = {1, 4, 8, 2};
    attn_host h[4];
    attn_dev d[4];
    attn_result alone[4], round[4], ref;
    b12x_run run;
    char msg[256];
    env_open(&e, fmt, _i + 81);
    for (int i = 0; i < 4; i++) {
        const attn_shape sh = {Ts[i], 16, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0};
        attn_host_make(&h[i], &sh, e.c.host, &e.rng);
        attn_dev_upload(&d[i], &h[i], e.c.dev);
    }
    {
        attn_host hp = h[2]; /* a plan that covers the four steps (T = 8 has the most requests) */
        for (int i = 0; i < 4; i++)
            hp.max_blocks = h[i].max_blocks > hp.max_blocks ? h[i].max_blocks : hp.max_blocks;
        b12x_open(&run, &hp, &d[2], 8); /* the workspace, shared (owned by d[2]) */
    }
    for (int i = 0; i < 4; i++) {
        d[i].ws = d[2].ws;
        d[i].ws_bytes = d[2].ws_bytes;
        b12x_attend_sync(&run, &h[i], &d[i], e.st);
        attn_fetch(&alone[i], &d[i], &h[i]);
    }
    for (int i = 0; i < 4; i++)
        attn_poison(&d[i], &h[i]);
    GPU_CUDA(cudaMemset(d[2].ws, 0xff, d[2].ws_bytes));
    for (int k = 0; k < 12; k++) {
        mlart_step s = attn_dev_step(&h[k % 4], &d[k % 4]);
        ck_assert_msg(run.vt->attend(run.state, &s, e.st) == 0, "attend %d: %s", k, attn_last_msg);
    }
    GPU_CUDA(cudaStreamSynchronize(e.st));
    GPU_CUDA(cudaGetLastError());
    for (int i = 0; i < 4; i++) {
        attn_fetch(&round[i], &d[i], &h[i]);
        const size_t n = (size_t)16 * Ts[i];
        ck_assert_msg(memcmp(alone[i].out, round[i].out, n * 1024) == 0,
                      "T = %d: the output back to back differs from the call alone", Ts[i]);
        ck_assert_msg(memcmp(alone[i].lse, round[i].lse, n * 4) == 0,
                      "T = %d: the LSE back to back differs from the call alone", Ts[i]);
        ref_attend_sync(&h[i], &d[i], e.st);
        attn_fetch(&ref, &d[i], &h[i]);
        ck_assert_msg(!attn_compare(&h[i], &round[i], &ref, NMSE_MAX, LSE_TOL, msg, sizeof msg),
                      "T = %d vs reference: %s", Ts[i], msg);
        attn_result_free(&ref);
        attn_result_free(&alone[i]);
        attn_result_free(&round[i]);
    }
    printf("%s, 16 heads: 12 calls back to back (T = 1, 4, 8, 2), one workspace, each equal to its call alone "
           "bit for bit and to the reference (last: %s)\n",
           mlart_kv_format_name(fmt), msg);
    run.vt->destroy(run.state);
    for (int i = 0; i < 4; i++) {
        if (i != 2)
            d[i].ws = NULL;
        attn_dev_free(&d[i]);
        attn_host_free(&h[i]);
    }
    env_close(&e);
}
END_TEST

/* Whether h's output depends on its query: some token has two different
 * valid indices.  With none (a request of length 0 or 1: every entry -1, or
 * every valid one the same row) any query gives the same output, and a
 * replay after new inputs could not be told from one that read the old. */
static int output_depends_on_query(const attn_host *h)
{
    for (int t = 0; t < h->sh.T; t++) {
        const int len = h->seq[h->req[t]];
        int32_t first = -1;
        for (int k = 0; k < h->sh.topk; k++) {
            const int32_t v = h->idx[(size_t)t * h->sh.topk + k];
            if (v < 0 || v >= len)
                continue;
            if (first >= 0 && v != first)
                return 1;
            first = v;
        }
    }
    return 0;
}

/* Output values still holding attn_poison's 0xffff, of n rows. */
static size_t count_poison(const attn_result *r, size_t n)
{
    size_t k = 0;
    for (size_t i = 0; i < n * 512; i++)
        k += r->out[i] == 0xffff;
    return k;
}

/* Graph capture + replay equals the eager call bit for bit, also after the
 * indices change in place (the graph reads the persistent buffers). */
START_TEST(test_graph)
{
    case_env e;
    const mlart_kv_format fmt = g_fmts[_i % 2];
    /* _i >= 2: the in-place combine (read when the backend is created; each test runs in its own process) */
    setenv("MLART_B12X_INPLACE", _i >= 2 ? "1" : "0", 1);
    env_open(&e, fmt, _i + 21);
    const attn_shape shapes[] = {
        {3, 16, 2048, fmt, 1, 1, 0, 0.0417f, 0, 0, 0},   /* split + combine */
        {64, 128, 2048, fmt, 1, 1, 0, 0.0417f, 0, 0, 0}, /* one pass, two head tiles */
        {16, 16, 2048, fmt, 1, 1, 0, 0.0417f, 0, 0, 0},  /* small-head kernel, 8 splits */
        {1, 128, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},  /* eight 16-row tiles, split */
        {2, 128, 2048, fmt, 1, 0, 0, 0.0417f, 0, 0, 0},  /* wgmma kernel, two tiles, split */
        /* sparse lists: the chunks compact their slots */
        {64, 64, 2048, fmt, 1, 1, 0, 0.0417f, 0, 4, 0},
        {8, 16, 2048, fmt, 1, 1, 0, 0.0417f, 0, 4, 0},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        attn_host h, h2;
        attn_dev d;
        attn_result eager, replay, ref;
        b12x_run run;
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        char msg[256];
        const attn_shape *sh = &shapes[i];
        const size_t n = (size_t)sh->H * sh->T;
        attn_host_make(&h, sh, e.c.host, &e.rng);
        while (!output_depends_on_query(&h)) { /* e.g. T = 1 and a request of length 0 or 1 */
            printf("graph %s T=%d H=%d: drawn again (the output would not depend on the query; "
                   "request lengths %d...)\n", mlart_kv_format_name(sh->fmt), sh->T, sh->H, h.seq[0]);
            attn_host_free(&h);
            attn_host_make(&h, sh, e.c.host, &e.rng);
        }
        attn_dev_upload(&d, &h, e.c.dev);
        b12x_open(&run, &h, &d, sh->T);
        b12x_attend_sync(&run, &h, &d, e.st);
        attn_fetch(&eager, &d, &h);
        ck_assert_msg(count_poison(&eager, n) < n * 512, "eager call left the poisoned output");

        mlart_step s = attn_dev_step(&h, &d);
        GPU_CUDA(cudaStreamBeginCapture(e.st, cudaStreamCaptureModeThreadLocal));
        int rc = run.vt->attend(run.state, &s, e.st);
        GPU_CUDA(cudaStreamEndCapture(e.st, &graph));
        ck_assert_msg(rc == 0, "attend under capture: %s", attn_last_msg);
        GPU_CUDA(cudaGraphInstantiate(&exec, graph, 0));
        attn_poison(&d, &h);
        GPU_CUDA(cudaGraphLaunch(exec, e.st));
        GPU_CUDA(cudaStreamSynchronize(e.st));
        attn_fetch(&replay, &d, &h);
        ck_assert_msg(memcmp(eager.out, replay.out, n * 512 * 2) == 0, "replay output != eager");
        ck_assert_msg(memcmp(eager.lse, replay.lse, n * 4) == 0, "replay lse != eager");
        attn_result_free(&replay);

        /* New indices and query in the same buffers; replay, compare. */
        attn_host_make(&h2, sh, e.c.host, &e.rng);
        GPU_CUDA(cudaMemcpy(d.idx, h2.idx, (size_t)sh->T * sh->topk * 4, cudaMemcpyHostToDevice));
        GPU_CUDA(cudaMemcpy(d.q, h2.q, n * 576 * 2, cudaMemcpyHostToDevice));
        memcpy(h.idx, h2.idx, (size_t)sh->T * sh->topk * 4);
        memcpy(h.q, h2.q, n * 576 * 2);
        attn_poison(&d, &h);
        GPU_CUDA(cudaGraphLaunch(exec, e.st));
        GPU_CUDA(cudaStreamSynchronize(e.st));
        attn_fetch(&replay, &d, &h);
        ck_assert_msg(memcmp(eager.out, replay.out, n * 512 * 2) != 0,
                      "replay with new indices gave the old output (%zu of %zu values poison)",
                      count_poison(&replay, n), n * 512);
        attn_result_free(&eager);
        b12x_attend_sync(&run, &h, &d, e.st);
        attn_fetch(&eager, &d, &h);
        ck_assert_msg(memcmp(eager.out, replay.out, n * 512 * 2) == 0,
                      "replay after new indices != eager");
        ck_assert_msg(memcmp(eager.lse, replay.lse, n * 4) == 0, "replay lse != eager");
        ref_attend_sync(&h, &d, e.st);
        attn_fetch(&ref, &d, &h);
        ck_assert_msg(!attn_compare(&h, &replay, &ref, NMSE_MAX, LSE_TOL, msg, sizeof msg),
                      "replay vs reference: %s", msg);
        printf("graph %s T=%d H=%d in-place %d: replay == eager bit for bit, also after new indices; %s\n",
               mlart_kv_format_name(sh->fmt), sh->T, sh->H, _i >= 2, msg);
        attn_result_free(&eager);
        attn_result_free(&replay);
        attn_result_free(&ref);
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        run.vt->destroy(run.state);
        attn_dev_free(&d);
        attn_host_free(&h);
        attn_host_free(&h2);
    }
    env_close(&e);
}
END_TEST

/* Programmatic dependent launch: the kernels start while the previous
 * kernel of the stream runs and resolve their slots and gather their first
 * rows meanwhile, but must read the query only after waiting for it.  The
 * previous kernel here (pdl_late_copy) lets dependents start at once and
 * writes the new query after 200 us; the output must be exactly that of the
 * new query, eager and replayed from a graph.  A control (a PDL reader that
 * does not wait reads old bytes; required in a graph, printed for eager
 * launches) shows the setup would catch a missing wait.  Shapes: small-head kernel with split, the same in
 * 16-row tiles (40 heads, 2 tokens), the general kernel (the 36-head tile of 100 heads, 2 tokens), the wgmma
 * kernel on 40 heads (5 tokens), with split and in one pass. */
START_TEST(test_pdl_order)
{
    case_env e;
    cudaStream_t ns;
    int early[2];
    env_open(&e, g_fmts[_i], _i + 31);                                /* e.st: setup and expected results */
    GPU_CUDA(cudaStreamCreateWithFlags(&ns, cudaStreamNonBlocking)); /* the launches under test */
    for (int gr = 0; gr < 2; gr++) {
        early[gr] = pdl_control(ns, gr);
        ck_assert_msg(early[gr] >= 0, "control (%s): CUDA error", gr ? "graph" : "eager");
    }
    ck_assert_msg(early[1] == 1, "control: in a graph a dependent that does not wait saw only the new bytes; the "
                                 "device did not start it early, so this test could not catch a missing wait");
    const attn_shape shapes[] = {
        {1, 16, 2048, g_fmts[_i], 1, 0, 0, 0.0417f, 0, 0, 0},
        {2, 40, 2048, g_fmts[_i], 1, 0, 0, 0.0417f, 0, 0, 0},  /* 16-row tiles on the small-head kernel */
        {2, 100, 2048, g_fmts[_i], 1, 0, 0, 0.0417f, 0, 0, 0}, /* wgmma, then the general kernel */
        {5, 40, 2048, g_fmts[_i], 1, 0, 0, 0.0417f, 0, 0, 0},  /* a partial tile on the wgmma kernel */
        {2, 64, 2048, g_fmts[_i], 1, 0, 0, 0.0417f, 0, 0, 0},
        {64, 128, 2048, g_fmts[_i], 1, 0, 0, 0.0417f, 0, 0, 0},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        attn_host h, h2;
        attn_dev d;
        attn_result want, got;
        b12x_run run;
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        const attn_shape *sh = &shapes[i];
        const size_t n = (size_t)sh->H * sh->T, qb = n * 576 * 2;
        void *qnew;
        attn_host_make(&h, sh, e.c.host, &e.rng);
        attn_host_make(&h2, sh, e.c.host, &e.rng); /* its query is the new one */
        attn_dev_upload(&d, &h, e.c.dev);
        GPU_CUDA(cudaMalloc(&qnew, qb));
        GPU_CUDA(cudaMemcpy(qnew, h2.q, qb, cudaMemcpyHostToDevice));
        b12x_open(&run, &h, &d, sh->T);

        /* expected: the new query, nothing before the call */
        GPU_CUDA(cudaMemcpy(d.q, h2.q, qb, cudaMemcpyHostToDevice));
        b12x_attend_sync(&run, &h, &d, e.st);
        attn_fetch(&want, &d, &h);
        GPU_CUDA(cudaDeviceSynchronize());

        /* eager, then a graph of the same two launches replayed twice */
        mlart_step s = attn_dev_step(&h, &d);
        for (int r = 0; r < 3; r++) {
            if (r == 1) {
                GPU_CUDA(cudaStreamBeginCapture(ns, cudaStreamCaptureModeThreadLocal));
                GPU_CUDA((cudaError_t)pdl_late_copy(d.q, qnew, qb, 200, ns));
                const int rc = run.vt->attend(run.state, &s, ns);
                GPU_CUDA(cudaStreamEndCapture(ns, &graph));
                ck_assert_msg(rc == 0, "attend under capture: %s", attn_last_msg);
                GPU_CUDA(cudaGraphInstantiate(&exec, graph, 0));
            }
            GPU_CUDA(cudaMemcpyAsync(d.q, h.q, qb, cudaMemcpyHostToDevice, ns));
            GPU_CUDA(cudaMemsetAsync(d.out, 0xff, n * 512 * 2, ns));
            GPU_CUDA(cudaMemsetAsync(d.lse, 0xff, n * 4, ns));
            if (r == 0) {
                GPU_CUDA((cudaError_t)pdl_late_copy(d.q, qnew, qb, 200, ns));
                ck_assert_msg(run.vt->attend(run.state, &s, ns) == 0, "attend: %s", attn_last_msg);
            } else {
                GPU_CUDA(cudaGraphLaunch(exec, ns));
            }
            GPU_CUDA(cudaStreamSynchronize(ns));
            attn_fetch(&got, &d, &h);
            ck_assert_msg(memcmp(want.out, got.out, n * 512 * 2) == 0 && memcmp(want.lse, got.lse, n * 4) == 0,
                          "%s after a late writer: T=%d H=%d read the old query", r ? "graph" : "eager", sh->T,
                          sh->H);
            attn_result_free(&got);
        }
        printf("pdl order %s T=%d H=%d: the output is that of a query written late by the previous kernel "
               "(eager, graph x2)\n", mlart_kv_format_name(sh->fmt), sh->T, sh->H);
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        attn_result_free(&want);
        run.vt->destroy(run.state);
        cudaFree(qnew);
        attn_dev_free(&d);
        attn_host_free(&h);
        attn_host_free(&h2);
    }
    printf("pdl order control: a dependent that does not wait read old bytes in a graph %s, eagerly %s\n",
           early[1] ? "yes" : "no", early[0] ? "yes" : "no");
    env_close(&e);
    cudaStreamDestroy(ns);
}
END_TEST

/* Refusals: geometry the kernels do not serve, missing workspace, views the
 * kernels cannot read; a refused call writes nothing. */
START_TEST(test_bad_input)
{
    uint64_t rng = g_seed ^ 0xbadull;
    shared_cache c;
    attn_host h;
    attn_dev d;
    b12x_run run;
    mlart_backend_init init;
    void *state = NULL;
    const mlart_backend_vtable *vt = mlart_backend_b12x_mla_sparse_vtable();
    const attn_shape sh = {1, 16, 2048, MLART_KV_BF16, 1, 0, 0, 0.0417f, 0, 0, 0};
    ck_assert_str_eq(vt->name, "b12x_mla_sparse");
    ck_assert_uint_eq(vt->contract.output, MLART_OUT_HEAD_MAJOR);
    ck_assert_uint_eq(vt->contract.graph_safe, 1);
    cache_open(&c, MLART_KV_BF16, &rng);
    attn_host_make(&h, &sh, c.host, &rng);
    attn_dev_upload(&d, &h, c.dev);

    memset(&init, 0, sizeof init);
    init.struct_size = sizeof init;
    init.geom = h.g;
    init.error = attn_error_cb;
    init.log = attn_log_cb;
    init.geom.kv_lora = 256;
    ck_assert_int_eq(vt->create(&init, &state), MLART_ENOTSUP);
    init.geom = h.g;
    init.geom.heads = 129;
    ck_assert_int_eq(vt->create(&init, &state), MLART_ENOTSUP);
    init.geom = h.g;
    init.device = -1;
    ck_assert_int_eq(vt->create(&init, &state), MLART_ENOTSUP);
    ck_assert_ptr_null(state);
    init.device = 0;
    ck_assert_int_eq(vt->create(NULL, &state), MLART_EINVAL);
    ck_assert_int_eq(vt->create(&init, NULL), MLART_EINVAL);
    init.struct_size = sizeof init - 1;
    ck_assert_int_eq(vt->create(&init, &state), MLART_EABI);
    /* an older struct that ends before its error field: that field is not
     * the caller's, so it must not be called */
    init.struct_size = (uint32_t)offsetof(mlart_backend_init, error);
    init.error = (mlart_error_fn)(uintptr_t)16;
    ck_assert_int_eq(vt->create(&init, &state), MLART_EABI);
    init.error = attn_error_cb;
    init.struct_size = sizeof init;
    init.error = NULL; /* nothing to report through */
    ck_assert_int_eq(vt->create(&init, &state), MLART_EINVAL);
    init.error = attn_error_cb;
    ck_assert_ptr_null(state);

    b12x_open(&run, &h, &d, 1);
    ck_assert_msg(d.ws_bytes > 0, "T=1 over 16 heads should split top-k");
    mlart_step s = attn_dev_step(&h, &d);
    uint16_t probe = 0;
    attn_poison(&d, &h);
    s.workspace = NULL;
    ck_assert_int_eq(run.vt->attend(run.state, &s, 0), MLART_EINVAL);
    s = attn_dev_step(&h, &d);
    s.workspace_bytes = d.ws_bytes - 4;
    ck_assert_int_eq(run.vt->attend(run.state, &s, 0), MLART_EINVAL);
    s = attn_dev_step(&h, &d);
    s.q_mqa.data = (uint16_t *)s.q_mqa.data + 1; /* rows no longer 16-byte aligned */
    ck_assert_int_eq(run.vt->attend(run.state, &s, 0), MLART_ELAYOUT);
    s = attn_dev_step(&h, &d);
    s.kv_cache.shape[1] = 656; /* fp8 rows under a bf16 geometry */
    ck_assert_int_eq(run.vt->attend(run.state, &s, 0), MLART_ELAYOUT);
    s = attn_dev_step(&h, &d);
    /* the wgmma kernel's entry with a split whose last chunk owns no block
     * of slots (65 chunks of one 32-slot block over top-k 2048), or none */
    ck_assert_int_eq(b12x_wgmma_launch(&s, 65, 1, 0, 1, NULL, NULL, NULL, 1, NULL), (int)cudaErrorInvalidValue);
    ck_assert_int_eq(b12x_wgmma_launch(&s, 0, 64, 0, 1, NULL, NULL, NULL, 1, NULL), (int)cudaErrorInvalidValue);
    ck_assert_int_eq(b12x_wgmma_launch(&s, 2, 0, 0, 1, NULL, NULL, NULL, 1, NULL), (int)cudaErrorInvalidValue);
    /* a step or plan that is not of create's geometry or device, or of an
     * older struct, and NULL arguments */
    s.geom.heads = 17;
    ck_assert_int_eq(run.vt->attend(run.state, &s, 0), MLART_EINVAL);
    ck_assert_ptr_nonnull(strstr(attn_last_msg, "17 heads"));
    s = attn_dev_step(&h, &d);
    s.geom.softmax_scale *= 2.0f;
    ck_assert_int_eq(run.vt->attend(run.state, &s, 0), MLART_EINVAL);
    s = attn_dev_step(&h, &d);
    s.device = 1;
    ck_assert_int_eq(run.vt->attend(run.state, &s, 0), MLART_EINVAL);
    s = attn_dev_step(&h, &d);
    s.struct_size = sizeof s - 8;
    ck_assert_int_eq(run.vt->attend(run.state, &s, 0), MLART_EABI);
    ck_assert_int_eq(run.vt->attend(run.state, NULL, 0), MLART_EINVAL);
    {
        mlart_plan plan;
        size_t ws = 0;
        memset(&plan, 0, sizeof plan);
        plan.struct_size = sizeof plan;
        plan.geom = h.g;
        plan.device = 0;
        plan.max_tokens = 1;
        ck_assert_int_eq(run.vt->plan(run.state, &plan, &ws), 0);
        ck_assert_uint_gt(ws, 0);
        ck_assert_int_eq(run.vt->plan(run.state, &plan, NULL), MLART_EINVAL);
        ck_assert_int_eq(run.vt->plan(run.state, NULL, &ws), MLART_EINVAL);
        plan.geom.topk = 1024; /* a smaller workspace than create's steps need */
        ck_assert_int_eq(run.vt->plan(run.state, &plan, &ws), MLART_EINVAL);
        plan.geom = h.g;
        plan.struct_size = sizeof plan - 4;
        ck_assert_int_eq(run.vt->plan(run.state, &plan, &ws), MLART_EABI);
    }
    s = attn_dev_step(&h, &d);
    s.T = -1;
    ck_assert_int_eq(run.vt->attend(run.state, &s, 0), MLART_EINVAL);
    ck_assert_ptr_nonnull(strstr(attn_last_msg, "step of -1 tokens"));
    s = attn_dev_step(&h, &d);
    s.T = 0;
    ck_assert_int_eq(run.vt->attend(run.state, &s, 0), 0);
    GPU_CUDA(cudaDeviceSynchronize());
    GPU_CUDA(cudaMemcpy(&probe, d.out, 2, cudaMemcpyDeviceToHost));
    ck_assert_msg(probe == 0xffff, "a refused call wrote its output");
    {
        /* kernel choices: a value that is not one of a variable's is
         * refused at create, changing nothing; a later create that reads
         * other choices leaves this backend refusing (its workspace was
         * sized by the old rules), not running on a wrong size */
        static const char *const bad[][2] = {{"MLART_B12X_WGMMA", "yes"}, {"MLART_B12X_WGMMA", "3"},
                                             {"MLART_B12X_RC", "off"},    {"MLART_B12X_HALF", "05"},
                                             {"MLART_B12X_INPLACE", "10"}, {"MLART_B12X_INPLACE_TRIPS", "16abc"}};
        void *other = NULL;
        mlart_plan plan;
        size_t ws = 0;
        init.geom = h.g;
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            setenv(bad[i][0], bad[i][1], 1);
            ck_assert_int_eq(vt->create(&init, &other), MLART_EINVAL);
            ck_assert_msg(strstr(attn_last_msg, bad[i][0]) && strstr(attn_last_msg, bad[i][1]), "%s",
                          attn_last_msg);
            unsetenv(bad[i][0]);
        }
        ck_assert_ptr_null(other);
        s = attn_dev_step(&h, &d);
        ck_assert_int_eq(run.vt->attend(run.state, &s, 0), 0); /* unchanged by the refusals */
        setenv("MLART_B12X_WGMMA", "0", 1);
        ck_assert_int_eq(vt->create(&init, &other), 0);
        GPU_CUDA(cudaDeviceSynchronize());
        attn_poison(&d, &h);
        ck_assert_int_eq(run.vt->attend(run.state, &s, 0), MLART_EINVAL);
        ck_assert_ptr_nonnull(strstr(attn_last_msg, "process-wide"));
        GPU_CUDA(cudaDeviceSynchronize());
        GPU_CUDA(cudaMemcpy(&probe, d.out, 2, cudaMemcpyDeviceToHost));
        ck_assert_msg(probe == 0xffff, "the refused step wrote its output");
        memset(&plan, 0, sizeof plan);
        plan.struct_size = sizeof plan, plan.geom = h.g, plan.device = 0, plan.max_tokens = 1;
        ck_assert_int_eq(run.vt->plan(run.state, &plan, &ws), MLART_EINVAL);
        ck_assert_int_eq(vt->plan(other, &plan, &ws), 0);
        vt->destroy(other);
        unsetenv("MLART_B12X_WGMMA");
        ck_assert_int_eq(vt->create(&init, &other), 0); /* the default choices again */
        vt->destroy(other);
        s = attn_dev_step(&h, &d);
        ck_assert_int_eq(run.vt->attend(run.state, &s, 0), 0);
        GPU_CUDA(cudaDeviceSynchronize());
    }
    printf("bad input: NULL or short create/plan/step structs, plan and steps of another "
           "geometry or device; wrong geometry/heads/device, missing or short workspace, misaligned "
           "q_mqa, wrong cache rows, a wgmma split with an empty chunk refused; nothing written\n");
    run.vt->destroy(run.state);
    run.vt->destroy(NULL);
    attn_dev_free(&d);
    attn_host_free(&h);
    cache_close(&c);
}
END_TEST

/* A case of one loop test, _i in [0, n), with the suite's timeout. */
static void add_case(Suite *s, const char *name, const TTest *test, int n)
{
    TCase *tc = tcase_create(name);
    tcase_set_timeout(tc, 240);
    tcase_add_loop_test(tc, test, 0, n);
    suite_add_tcase(s, tc);
}

int main(void)
{
    Suite *s;
    TCase *tc;
    if (gpu_test_begin("attn_backend_gpu", &g_seed))
        return 77;
    s = suite_create("attn_backend_gpu");
    tc = tcase_create("b12x");
    tcase_set_timeout(tc, 240);
    tcase_add_loop_test(tc, test_sweep, 0, 2);
    tcase_add_loop_test(tc, test_awkward, 0, 2);
    tcase_add_loop_test(tc, test_graph, 0, 4);
    tcase_add_loop_test(tc, test_pdl_order, 0, 2);
    tcase_add_loop_test(tc, test_back_to_back, 0, 2);
    tcase_add_test(tc, test_bad_input);
    suite_add_tcase(s, tc);
    add_case(s, "wgmma", test_wgmma, 12);
    add_case(s, "swg", test_swg, 2);
    add_case(s, "rc", test_rc, 2);
    add_case(s, "half", test_half, 2);
    add_case(s, "tiles", test_small_tiles, 2);
    add_case(s, "thin", test_thin, 6);
    add_case(s, "random", test_random, 2);
    tc = tcase_create("inplace");
    tcase_set_timeout(tc, 240);
    tcase_add_loop_test(tc, test_inplace, 0, 4);
    tcase_add_loop_test(tc, test_inplace_repeat, 0, 4);
    tcase_add_loop_test(tc, test_inplace_parts, 0, 2);
    suite_add_tcase(s, tc);
    return check_run(s, CK_FORK);
}
