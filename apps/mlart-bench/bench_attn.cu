/* mlart-bench suite "attn": the b12x_mla_sparse sparse decode kernel against
 * the plain CUDA reference, in the same run.
 *
 * Shapes: DeepSeek-V3.2 TP8 (16 heads), GLM-5 TP4/DCP4 (64 kernel heads),
 * 128 heads; T = 1..64 query tokens, each its own request, so no two tokens
 * share a cache row; topk 2048, every index valid and distinct; both cache
 * formats.  Columns:
 *   time     median us of one call (graph replays of a rotation of input
 *            sets larger than 3x L2, so the rows come from HBM)
 *   GB/s     unique cache bytes (T x 2048 x bytes per row) over time
 *   TFLOP/s  2 x H x 2048 x (576 + 512) per token over time
 *   floor    the larger of unique bytes / copy roofline and FLOPs / the
 *            bf16 tensor-core rate measured here (cuBLAS 8192^3 GEMM)
 *   %roof    floor / time
 *   ref      the plain CUDA reference on input set 0 (it rereads each row
 *            per head, so its inputs sit in L2 either way), median of 3
 *            replays; x_ref = ref / time
 *   err      output NMSE of b12x against the reference (checked <= 1e-4)
 *   qbmm     the query absorption that writes q_mqa in a layer step
 *            (the model's P: 192 for GLM-5, else 128; q_pe copied,
 *            weights rotating with the sets)
 *   in_layer attend() right after it, as in a layer step: time(qbmm +
 *            attend) - time(qbmm).  The time column follows another
 *            attend() instead, whose combine lets it start early (at 16
 *            heads before the combine's own wait); here the predecessor
 *            is the absorption, which lets it start once past its own
 *            wait
 *   v_up     the V up-projection (the model's V: 256 for GLM-5, else 128;
 *            weights rotating with the sets)
 *            after them, launched plainly: time(qbmm + attend + v_up) -
 *            time(qbmm + attend)
 *   v_up_pdl the same launched as the layer step launches it, with
 *            programmatic dependent launch (mlart_v_up_bmm_cuda_pdl: its
 *            first weight copies start while attend() ends)
 *   step     the whole layer step as the runtime launches it by default
 *            (KV write of T rows, absorption, attend(), V up-projection
 *            with PDL), us a step in the rotation, measured at once
 *   early    the same with mlart_layer_desc.early_weights: the absorption
 *            launched with PDL too (mlart_query_bmm_cuda_pdl), so it
 *            starts while the KV write before it ends; the
 *            bench compares its output with the step's byte for byte
 *   inplace  the same step with the in-place combine forced (b12x_tune
 *            inplace = 1), where b12x_attend_inplace_ok takes it; checked
 *            like err.  The time column is the backend's default launch.
 *   chain    at <= 16 heads, the memory work of a call with nothing else:
 *            the indices, the block-table entries, the rows' bytes, a load
 *            of the query and the output rows written
 *            (chain_floor_kernel), in the same
 *            rotation as `time`, launched plainly: the least a plainly
 *            launched call can take if it moves its bytes no faster
 *   chain_pdl the same launched with programmatic dependent launch, every
 *            gather before its wait and the query's load after it (the most
 *            of it a design can hide behind the previous kernel)
 *   split_pdl at <= 16 heads, the same loads spread over chunks of a
 *            token's slots, each chunk's partial written and a combine
 *            kernel after them, both with PDL (split_floor_main and
 *            split_floor_combine): the least a design that combines its
 *            chunks in global memory can take
 * `step` and `early` put the layer's KV write of T rows in front of the
 * absorption, as the layer's step (mlart-decode's) does: the rows are slots
 * 0..8191's own, rewritten with the same bytes, so no input of any set
 * changes.  The v_up columns stay without it, and a line after each row
 * gives its step and early without the write (MLART_BENCH_ATTN_KVW=0 in the
 * environment: no write, the columns as before 2026-12-02 14:30).
 * With --variants (or MLART_BENCH_ATTN_VARIANTS=1 in the environment) a
 * tuning table follows (bench_attn_variants).  Then the partial head tiles' table
 * (bench_attn_choice): 32, 40, 48 and 56 heads on the launch's kernel, the
 * general, the wgmma and the small-head kernel; and the same four columns
 * for whole steps of 64..128 heads at small T (the `attn tiles` table,
 * where the 16-row tiles' bound lies).  Last the `attn short` table
 * (bench_attn_short): requests shorter than top-k, whose lists are mostly
 * -1, against the step on their valid entries alone. */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "backends/b12x_mla_sparse/b12x.h"
#include "backends/b12x_mla_sparse/b12x_attend.h"
#include "backends/reference/reference.h"
#include "bench_common.h"
#include "ops/numerics.h"
#include "ops/ops.h"
#include "runtime/cuda_launch.h"

namespace {

constexpr int kTopk = 2048;
constexpr int kSeq = 4096;              /* positions per request; 2048 of them selected */
constexpr int kPage = 64;
constexpr int kPagesPerReq = kSeq / kPage;
constexpr int64_t kSlots = 1 << 20;     /* cache rows (1.2 GB bf16, 688 MB fp8): 16384 pages, so that
                                           a rotation's sets never share a page (alloc_sets) */
constexpr int kMaxT = 64;
constexpr int kKvwRows = 8192;          /* MLART_BENCH_ATTN_KVW: the KV write's slots 0..kKvwRows-1 */
constexpr double kNmseMax = 1e-4;

#define ATT_CUDA(stmt) MLART_BENCH_CHECK("mlart-bench attn", stmt)

uint64_t mix(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

int bench_err(int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "mlart-bench attn: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    return status;
}

void bench_log(int level, const char *fmt, ...)
{
    (void)level;
    (void)fmt;
}

/* One input set: its own query, indices and pages; outputs per backend;
 * for the "in layer" columns the query absorption's inputs (qin [T,H,P+64]:
 * q_nope and q_pe, wuk [H,P,512]) that write q, and the V up-projection's
 * weights (wuv [H,512,V]) and output (o [T,H*V]); P and V are the
 * model's (Ctx). */
struct Set {
    void *q, *idx, *req, *seq, *bt, *out, *lse, *ref_out, *ref_lse;
    void *qin, *wuk, *wuv, *o;
    void *didx; /* Ctx.valid > 0: the lists' valid entries alone, [T, valid] */
};

struct Ctx {
    mlart_geometry g;
    int T, nsets;
    int valid; /* 0: every list 2048 distinct positions; else short requests of `valid` tokens (alloc_sets) */
    int64_t P, V; /* the absorption's P and the V up-projection's V (the model's) */
    void *kv;
    void *kvw_src, *kvw_slots; /* MLART_BENCH_ATTN_KVW: slots 0..kKvwRows-1's bf16 rows, and 0..kKvwRows-1 */
    Set sets[128];
    void *ws;
    size_t ws_bytes;
    const mlart_backend_vtable *vt;
    void *state;
};

mlart_tensor dense(void *p, mlart_dtype dt, int n, int64_t a, int64_t b, int64_t c)
{
    int64_t shape[3] = {a, b, c};
    return mlart_tensor_dense(p, dt, 0, n, shape);
}

/* peer: the list of the valid entries alone (Ctx.valid > 0), a step of
 * top-k `valid`. */
mlart_step make_step(const Ctx &c, int set, bool ref, bool peer = false)
{
    const Set &s = c.sets[set];
    const int T = c.T, H = c.g.heads;
    mlart_step st;
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    st.geom = c.g;
    st.device = 0;
    st.T = T;
    st.B = T;
    st.q_mqa = dense(s.q, MLART_DTYPE_BF16, 3, T, H, 576);
    st.kv_cache = dense(c.kv, MLART_DTYPE_U8, 2, kSlots, (int64_t)mlart_kv_bytes_per_token(&c.g), 0);
    st.idx = peer ? dense(s.didx, MLART_DTYPE_I32, 2, T, c.valid, 0) : dense(s.idx, MLART_DTYPE_I32, 2, T, kTopk, 0);
    if (peer)
        st.geom.topk = c.valid;
    st.req_of_token = dense(s.req, MLART_DTYPE_I32, 1, T, 0, 0);
    st.seq_lens = dense(s.seq, MLART_DTYPE_I32, 1, T, 0, 0);
    st.block_table = dense(s.bt, MLART_DTYPE_I32, 2, T, kPagesPerReq, 0);
    st.attn_out = dense(ref ? s.ref_out : s.out, MLART_DTYPE_BF16, 3, H, T, 512);
    st.lse = dense(ref ? s.ref_lse : s.lse, MLART_DTYPE_F32, 2, H, T, 0);
    st.workspace = c.ws;
    st.workspace_bytes = c.ws_bytes;
    return st;
}

/* The query absorption of a layer step writing set `set`'s q_mqa: q_nope
 * view x W_UK_T into columns 0..511, q_pe copied into 512..575 (the op
 * the runtime runs right before attend()). */
static int qbmm_run(void *ctx, int set, int pdl, cudaStream_t stream)
{
    Ctx *c = (Ctx *)ctx;
    const Set &s = c->sets[set];
    const int64_t T = c->T, H = c->g.heads, P = c->P, qrow = P + 64; /* q row: q_nope, q_pe */
    const size_t qin_b = (size_t)(T * H * qrow) * 2, w_b = (size_t)(H * P * 512) * 2, q_b = (size_t)(T * H * 576) * 2;
    uint16_t *qin = (uint16_t *)s.qin, *q = (uint16_t *)s.q;
    mlart_tensor a = mlart_bench_view3(qin, qin, qin_b, H, T, P, qrow, H * qrow);
    mlart_tensor w = mlart_bench_view3(s.wuk, s.wuk, w_b, H, P, 512, P * 512, 512);
    mlart_tensor o = mlart_bench_view3(q, q, q_b, H, T, 512, 576, H * 576);
    mlart_tensor pi = mlart_bench_view3(qin + P, qin, qin_b, T, H, 64, H * qrow, qrow);
    mlart_tensor po = mlart_bench_view3(q + 512, q, q_b, T, H, 64, H * 576, 576);
    if ((pdl ? mlart_query_bmm_cuda_pdl : mlart_query_bmm_cuda)(&a, &w, &o, &pi, &po, stream) != 0) {
        fprintf(stderr, "mlart-bench attn: query absorption: %s\n", mlart_last_error());
        return 1;
    }
    return 0;
}

int enqueue_qbmm(void *ctx, int set, cudaStream_t stream)
{
    return qbmm_run(ctx, set, 0, stream);
}

int enqueue_b12x(void *ctx, int set, cudaStream_t stream);

/* The absorption, then attend() on what it wrote. */
int enqueue_layer(void *ctx, int set, cudaStream_t stream)
{
    return enqueue_qbmm(ctx, set, stream) || enqueue_b12x(ctx, set, stream);
}

/* The V up-projection of set `set`'s attention output into its o, plainly
 * or as the layer step launches it (pdl). */
int enqueue_v_up(const Ctx &c, int set, int pdl, cudaStream_t stream)
{
    const Set &s = c.sets[set];
    const int64_t T = c.T, H = c.g.heads, V = c.V;
    const size_t x_b = (size_t)(H * T * 512) * 2, w_b = (size_t)(H * 512 * V) * 2, o_b = (size_t)(T * H * V) * 2;
    mlart_tensor x = mlart_bench_view3(s.out, s.out, x_b, H, T, 512, T * 512, 512);
    mlart_tensor w = mlart_bench_view3(s.wuv, s.wuv, w_b, H, 512, V, 512 * V, V);
    mlart_tensor o = mlart_bench_view3(s.o, s.o, o_b, H, T, V, V, H * V);
    if ((pdl ? mlart_v_up_bmm_cuda_pdl : mlart_v_up_bmm_cuda)(&x, &w, &o, stream) != 0) {
        fprintf(stderr, "mlart-bench attn: V up-projection: %s\n", mlart_last_error());
        return 1;
    }
    return 0;
}

/* A whole layer step: absorption, attend(), V up-projection. */
int enqueue_step(void *ctx, int set, cudaStream_t stream)
{
    return enqueue_layer(ctx, set, stream) || enqueue_v_up(*(Ctx *)ctx, set, 0, stream);
}

int enqueue_step_pdl(void *ctx, int set, cudaStream_t stream)
{
    return enqueue_layer(ctx, set, stream) || enqueue_v_up(*(Ctx *)ctx, set, 1, stream);
}

/* A whole layer step with early_weights: the absorption launched with PDL. */
int enqueue_step_early(void *ctx, int set, cudaStream_t stream)
{
    return qbmm_run(ctx, set, 1, stream) || enqueue_b12x(ctx, set, stream) ||
           enqueue_v_up(*(Ctx *)ctx, set, 1, stream);
}

/* The layer's KV write of T rows (MLART_BENCH_ATTN_KVW): rows base..base+T-1
 * of slots 0..kKvwRows-1 rewritten with their own bytes (the cache's rows
 * are mlart_bench_fill_bf16(seed 0xCAC4E) element for element, written by
 * the same op for fp8), so the cache, and every set's result, stay as
 * they are.  Launched as the op launches it (with PDL). */
int enqueue_kvw(const Ctx &c, int set, cudaStream_t stream)
{
    int64_t base = (int64_t)set * c.T % kKvwRows;
    if (base + c.T > kKvwRows)
        base = 0;
    mlart_tensor cache = dense(c.kv, MLART_DTYPE_U8, 2, kSlots, (int64_t)mlart_kv_bytes_per_token(&c.g), 0);
    mlart_tensor lat = dense((uint16_t *)c.kvw_src + base * 576, MLART_DTYPE_BF16, 2, c.T, 576, 0);
    mlart_tensor sl = dense((int32_t *)c.kvw_slots + base, MLART_DTYPE_I32, 1, c.T, 0, 0);
    if (mlart_kv_write_cuda(&c.g, &cache, &lat, &sl, stream) != 0) {
        fprintf(stderr, "mlart-bench attn: kv_write: %s\n", mlart_last_error());
        return 1;
    }
    return 0;
}

int enqueue_kvw_step(void *ctx, int set, cudaStream_t stream)
{
    return enqueue_kvw(*(Ctx *)ctx, set, stream) || enqueue_step_pdl(ctx, set, stream);
}

int enqueue_kvw_early(void *ctx, int set, cudaStream_t stream)
{
    return enqueue_kvw(*(Ctx *)ctx, set, stream) || enqueue_step_early(ctx, set, stream);
}

/* The KV write's sources: slots 0..kKvwRows-1's bf16 rows and their slot
 * numbers, on the device. */
int kvw_setup(void **src, void **slots)
{
    int32_t *hs = (int32_t *)malloc(sizeof(int32_t) * kKvwRows);
    int rc = -1;
    *src = *slots = NULL;
    if (!hs)
        return -1;
    for (int i = 0; i < kKvwRows; i++)
        hs[i] = i;
    if (cudaMalloc(src, (size_t)kKvwRows * 576 * 2) == cudaSuccess &&
        cudaMalloc(slots, sizeof(int32_t) * kKvwRows) == cudaSuccess &&
        cudaMemcpy(*slots, hs, sizeof(int32_t) * kKvwRows, cudaMemcpyHostToDevice) == cudaSuccess &&
        !mlart_bench_fill_bf16(*src, (size_t)kKvwRows * 576, 0xCAC4E, 0) && cudaDeviceSynchronize() == cudaSuccess)
        rc = 0;
    free(hs);
    return rc;
}

int enqueue_b12x(void *ctx, int set, cudaStream_t stream)
{
    Ctx *c = (Ctx *)ctx;
    mlart_step st = make_step(*c, set, false);
    return c->vt->attend(c->state, &st, stream) != 0;
}

int enqueue_ref(void *ctx, int set, cudaStream_t stream)
{
    Ctx *c = (Ctx *)ctx;
    mlart_step st = make_step(*c, set, true);
    if (mlart_reference_attend_cuda(&st, stream) != 0) {
        fprintf(stderr, "mlart-bench attn: reference: %s\n", mlart_last_error());
        return 1;
    }
    return 0;
}

/* The memory work every sparse decode call has to do, with nothing else
 * (columns `chain` and `chain_pdl`, rows of <= 16 heads): per token the
 * request and the top-k indices, then the sequence length and the
 * block-table entries, then every selected row's bytes (16-byte loads, TPR
 * threads a row, all of a thread's pieces in flight at once); no math, no
 * partials, no combine.  Each thread also reads 16 bytes of its token's
 * query, which the previous kernel may write, and the first chunk of each
 * token writes its output rows [H,512] and LSEs once its own loads have
 * landed.  Launched plainly, or with programmatic dependent launch: then
 * the gathers come before griddepcontrol.wait (they read nothing the
 * previous kernel writes: the stream contract, docs/attention.md) and
 * only the query's load and the writes after it, the most any design can
 * hide behind the previous kernel.  The column is the
 * fastest of kFloorShapes (slots a block x threads a row). */
struct FloorArgs {
    const int32_t *idx, *req, *seq, *bt;
    const uint4 *kv, *q;
    uint4 *out;
    float *lse;
    int T, H, topk, page, max_blocks;
};

__device__ unsigned g_floor_sink;

template <int SLOTS, int TPR, bool FP8, bool PDL>
__global__ void __launch_bounds__(SLOTS *TPR) chain_floor_kernel(const FloorArgs a)
{
    constexpr int PIECES = FP8 ? 656 / 16 : 1152 / 16, PER = (PIECES + TPR - 1) / TPR;
    if (PDL)
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const int t = blockIdx.y, k = blockIdx.x * SLOTS + threadIdx.x / TPR, l = threadIdx.x % TPR;
    const int req = a.req[t], pos = a.idx[(size_t)t * a.topk + k];
    const bool in_table = pos >= 0 && pos < a.max_blocks * a.page;
    const int seq = a.seq[req];
    const int blk = in_table ? a.bt[(size_t)req * a.max_blocks + pos / a.page] : 0;
    const bool ok = in_table && pos < seq;
    const uint4 *row = a.kv + ((size_t)blk * a.page + (in_table ? pos % a.page : 0)) * PIECES;
    uint4 v[PER];
#pragma unroll
    for (int j = 0; j < PER; j++)
        v[j] = ok && l + TPR * j < PIECES ? __ldg(row + l + TPR * j) : make_uint4(0, 0, 0, 0);
    unsigned x = 0;
#pragma unroll
    for (int j = 0; j < PER; j++)
        x ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    if (PDL)
        asm volatile("griddepcontrol.wait;" ::: "memory");
    { /* one piece of the token's query [H,576] (72 pieces a head), through L2 */
        const uint4 qv = __ldcg(a.q + (size_t)t * a.H * 72 + (blockIdx.x * blockDim.x + threadIdx.x) % (a.H * 72));
        x ^= qv.x ^ qv.y ^ qv.z ^ qv.w;
    }
    if (blockIdx.x == 0) { /* out [H,T,512] bf16: 64 pieces a row */
        for (int i = threadIdx.x; i < a.H * 64; i += blockDim.x)
            a.out[((size_t)(i / 64) * a.T + t) * 64 + i % 64] = make_uint4(x, x, x, x);
        for (int h = threadIdx.x; h < a.H; h += blockDim.x)
            a.lse[(size_t)h * a.T + t] = __uint_as_float(x & 0x3fffffffu);
    } else if (x == 0x9E3779B9u) { /* data-dependent: the loads stay */
        g_floor_sink = x;
    }
}

/* {slots a block, threads a row} */
constexpr int kFloorShapes[][2] = {{8, 8}, {32, 8}, {4, 16}, {2, 32}};
constexpr int kNumFloorShapes = (int)(sizeof kFloorShapes / sizeof kFloorShapes[0]);

typedef void (*FloorKernel)(FloorArgs);

template <bool FP8, bool PDL> FloorKernel floor_kernel(int shape)
{
    switch (shape) {
    case 0:
        return chain_floor_kernel<kFloorShapes[0][0], kFloorShapes[0][1], FP8, PDL>;
    case 1:
        return chain_floor_kernel<kFloorShapes[1][0], kFloorShapes[1][1], FP8, PDL>;
    case 2:
        return chain_floor_kernel<kFloorShapes[2][0], kFloorShapes[2][1], FP8, PDL>;
    default:
        return chain_floor_kernel<kFloorShapes[3][0], kFloorShapes[3][1], FP8, PDL>;
    }
}

struct FloorCtx {
    Ctx *c;
    int fp8, pdl, shape;
};

int enqueue_floor(void *ctx, int set, cudaStream_t stream)
{
    const FloorCtx *f = (const FloorCtx *)ctx;
    const Ctx &c = *f->c;
    const Set &s = c.sets[set];
    const FloorArgs a = {(const int32_t *)s.idx, (const int32_t *)s.req, (const int32_t *)s.seq,
                         (const int32_t *)s.bt,  (const uint4 *)c.kv,    (const uint4 *)s.q,
                         (uint4 *)s.out,         (float *)s.lse,         c.T,
                         c.g.heads,              kTopk,                  kPage,
                         kPagesPerReq};
    const int slots = kFloorShapes[f->shape][0], tpr = kFloorShapes[f->shape][1];
    const FloorKernel k = f->fp8 ? (f->pdl ? floor_kernel<true, true>(f->shape) : floor_kernel<true, false>(f->shape))
                                 : (f->pdl ? floor_kernel<false, true>(f->shape) : floor_kernel<false, false>(f->shape));
    cudaLaunchAttribute at[1];
    const cudaLaunchConfig_t lc = mlart_launch_cfg(dim3(kTopk / slots, c.T), dim3(slots * tpr), 0, stream, f->pdl, at);
    return cudaLaunchKernelEx(&lc, k, a) != cudaSuccess;
}

/* The chain floor of a row: the fastest of kFloorShapes, plainly (pdl 0)
 * or with PDL; NAN if a timing failed.  *best_shape: its index. */
double chain_floor_us(const mlart_bench_opts *o, Ctx *c, bool fp8, int pdl, int *best_shape)
{
    double best = NAN;
    for (int shape = 0; shape < kNumFloorShapes; shape++) {
        FloorCtx f = {c, fp8, pdl, shape};
        double us;
        if (mlart_bench_time(o, enqueue_floor, &f, c->nsets, &us))
            return NAN;
        if (isnan(best) || us < best) {
            best = us;
            *best_shape = shape;
        }
    }
    return best;
}

/* The split floor (column `split_pdl`, rows of <= 16 heads): the least a
 * call can take that spreads a token's slots over chunks of blocks and
 * combines their partials in global memory, as every split design does
 * (the small-head kernel with its combine kernel; a combine fused through
 * counters only adds to it, docs/attention.md).  Two kernels, each launched
 * with programmatic dependent launch:
 *   split_floor_main: grid (splits, T), 256 threads, a chunk of topk /
 *     splits slots a block; the same loads as the chain floor, all of them
 *     before griddepcontrol.wait (U passes of 256 / TPR rows in flight at
 *     once), then the query's load and the chunk's partial: H x 512 bf16 and
 *     H fp32 LSEs, the size the small-head kernel writes;
 *   split_floor_combine: one block per (token, head), after its wait: the
 *     splits' LSEs, their maximum and weights, the weighted sum of the
 *     splits' partials (8 columns a thread, eight loads in flight at a
 *     time; one group of 64 threads, or eight summed over shared memory:
 *     the faster of the two, which depends on the split count), the output
 *     row and the LSE.
 * No math on the rows: what is left over the chain floor is the partial
 * write, the kernel boundary and the combine's round trips.  The column
 * is the fastest of the split counts kSplitCounts with T x splits <= 1024. */
constexpr int kSplitMaxChunks = 1024, kSplitMax = 128; /* T x splits, splits */

struct SplitArgs {
    FloorArgs f;
    uint4 *part; /* [T, splits, H, 64] bf16 x 8 */
    float *plse; /* [T, splits, H] */
    int splits;
};

template <int TPR, int U, bool FP8> __global__ void __launch_bounds__(256) split_floor_main(const SplitArgs s)
{
    constexpr int PIECES = FP8 ? 656 / 16 : 1152 / 16, PER = (PIECES + TPR - 1) / TPR, ROWS = 256 / TPR;
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const FloorArgs &a = s.f;
    const int t = blockIdx.y, chunk = a.topk / s.splits, l = threadIdx.x % TPR;
    const int req = a.req[t];
    const int seq = a.seq[req];
    unsigned x = 0;
    for (int p0 = 0; p0 < chunk; p0 += ROWS * U) {
        uint4 v[U][PER];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int r = p0 + u * ROWS + threadIdx.x / TPR;
            const int pos = r < chunk ? a.idx[(size_t)t * a.topk + blockIdx.x * chunk + r] : -1;
            const bool in_table = pos >= 0 && pos < a.max_blocks * a.page;
            const int blk = in_table ? a.bt[(size_t)req * a.max_blocks + pos / a.page] : 0;
            const bool ok = in_table && pos < seq;
            const uint4 *row = a.kv + ((size_t)blk * a.page + (in_table ? pos % a.page : 0)) * PIECES;
#pragma unroll
            for (int j = 0; j < PER; j++)
                v[u][j] = ok && l + TPR * j < PIECES ? __ldg(row + l + TPR * j) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int j = 0; j < PER; j++)
                x ^= v[u][j].x ^ v[u][j].y ^ v[u][j].z ^ v[u][j].w;
    }
    asm volatile("griddepcontrol.wait;" ::: "memory");
    {
        const uint4 qv = __ldcg(a.q + (size_t)t * a.H * 72 + threadIdx.x % (a.H * 72));
        x ^= qv.x ^ qv.y ^ qv.z ^ qv.w;
    }
    /* the partial: a bf16 value of x's low bits, so the combine's sums stay finite */
    const unsigned b = 0x3f80u | (x & 0x3fu), w = b | b << 16;
    const size_t base = ((size_t)t * s.splits + blockIdx.x) * a.H;
    for (int i = threadIdx.x; i < a.H * 64; i += 256)
        s.part[base * 64 + i] = make_uint4(w, w, w, w);
    for (int h = threadIdx.x; h < a.H; h += 256)
        s.plse[base + h] = (float)(x & 0xffu) * 0.01f;
}

template <int G> __global__ void __launch_bounds__(64 * G) split_floor_combine(const SplitArgs s)
{
    __shared__ float lse_s[kSplitMax];
    __shared__ float4 acc_s[G][64][2];
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const FloorArgs &a = s.f;
    const int h = blockIdx.x, t = blockIdx.y, c = threadIdx.x % 64, g = threadIdx.x / 64, S = s.splits;
    const float *ls = s.plse + (size_t)t * S * a.H + h;
    for (int i = threadIdx.x; i < S; i += 64 * G)
        lse_s[i] = __ldcg(ls + (size_t)i * a.H);
    __syncthreads();
    float m = -INFINITY;
    for (int i = 0; i < S; i++)
        m = fmaxf(m, lse_s[i]);
    /* group g sums splits g, g + G, ..., eight loads in flight at a time */
    const uint4 *p = s.part + ((size_t)t * S * a.H + h) * 64 + c;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int i0 = g; i0 < S; i0 += 8 * G) {
        uint4 v[8];
#pragma unroll
        for (int j = 0; j < 8; j++)
            v[j] = i0 + G * j < S ? __ldcg(p + (size_t)(i0 + G * j) * a.H * 64) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            if (i0 + G * j >= S)
                break;
            const float wgt = __expf(lse_s[i0 + G * j] - m);
            const __nv_bfloat162 *e = (const __nv_bfloat162 *)&v[j];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const float2 f = __bfloat1622float2(e[k]);
                acc[2 * k] += wgt * f.x;
                acc[2 * k + 1] += wgt * f.y;
            }
        }
    }
    if (G > 1) {
        acc_s[g][c][0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        acc_s[g][c][1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
        __syncthreads();
        if (g != 0)
            return;
        for (int q = 1; q < G; q++) {
            const float4 x0 = acc_s[q][c][0], x1 = acc_s[q][c][1];
            acc[0] += x0.x, acc[1] += x0.y, acc[2] += x0.z, acc[3] += x0.w;
            acc[4] += x1.x, acc[5] += x1.y, acc[6] += x1.z, acc[7] += x1.w;
        }
    }
    float sum = 0;
    for (int i = 0; i < S; i++)
        sum += __expf(lse_s[i] - m);
    const float inv = 1.0f / sum;
    uint4 o;
    __nv_bfloat162 *e = (__nv_bfloat162 *)&o;
#pragma unroll
    for (int k = 0; k < 4; k++)
        e[k] = __floats2bfloat162_rn(acc[2 * k] * inv, acc[2 * k + 1] * inv);
    a.out[((size_t)h * a.T + t) * 64 + c] = o;
    if (c == 0)
        a.lse[(size_t)h * a.T + t] = m + __logf(sum);
}

constexpr int kSplitCounts[] = {2, 4, 8, 16, 32, 64, 128};
constexpr int kNumSplitCounts = (int)(sizeof kSplitCounts / sizeof kSplitCounts[0]);
constexpr int kSplitTPR = 8, kSplitU = 4;

struct SplitCtx {
    Ctx *c;
    int fp8, splits, groups; /* groups: the combine's, 1 or 8 */
    void *ws; /* the partials and their LSEs, for T x splits <= kSplitMaxChunks */
};

int enqueue_split_floor(void *ctx, int set, cudaStream_t stream)
{
    const SplitCtx *f = (const SplitCtx *)ctx;
    const Ctx &c = *f->c;
    const Set &st = c.sets[set];
    const int H = c.g.heads;
    SplitArgs a;
    a.f = {(const int32_t *)st.idx, (const int32_t *)st.req, (const int32_t *)st.seq,
           (const int32_t *)st.bt,  (const uint4 *)c.kv,     (const uint4 *)st.q,
           (uint4 *)st.out,         (float *)st.lse,         c.T,
           H,                       kTopk,                   kPage,
           kPagesPerReq};
    a.part = (uint4 *)f->ws;
    a.plse = (float *)((char *)f->ws + (size_t)c.T * f->splits * H * 1024);
    a.splits = f->splits;
    cudaLaunchAttribute at[2][1];
    const cudaLaunchConfig_t lm = mlart_launch_cfg(dim3(f->splits, c.T), dim3(256), 0, stream, 1, at[0]);
    const cudaLaunchConfig_t lc = mlart_launch_cfg(dim3(H, c.T), dim3(64 * f->groups), 0, stream, 1, at[1]);
    const cudaError_t e =
        cudaLaunchKernelEx(&lm, f->fp8 ? split_floor_main<kSplitTPR, kSplitU, true> : split_floor_main<kSplitTPR, kSplitU, false>, a);
    return e != cudaSuccess ||
           cudaLaunchKernelEx(&lc, f->groups == 1 ? split_floor_combine<1> : split_floor_combine<8>, a) != cudaSuccess;
}

/* The split floor of a row: the fastest of kSplitCounts (T x splits <=
 * kSplitMaxChunks) and the two combine shapes; NAN if a timing failed.
 * *best: that split count; each[i]: kSplitCounts[i]'s time (the faster
 * combine), NAN where not timed. */
double split_floor_us(const mlart_bench_opts *o, Ctx *c, bool fp8, int *best, double each[kNumSplitCounts])
{
    double fastest = NAN;
    void *ws = NULL;
    if (cudaMalloc(&ws, (size_t)kSplitMaxChunks * c->g.heads * (1024 + 4)) != cudaSuccess)
        return NAN;
    for (int i = 0; i < kNumSplitCounts; i++)
        each[i] = NAN;
    for (int i = 0; i < kNumSplitCounts; i++) {
        if (c->T * kSplitCounts[i] > kSplitMaxChunks)
            break;
        double us = NAN;
        for (int groups = 1; groups <= 8; groups += 7) {
            SplitCtx f = {c, fp8, kSplitCounts[i], groups, ws};
            double g_us;
            if (mlart_bench_time(o, enqueue_split_floor, &f, c->nsets, &g_us)) {
                us = NAN;
                break;
            }
            us = isnan(us) ? g_us : fmin(us, g_us);
        }
        if (isnan(us)) {
            fastest = NAN;
            break;
        }
        each[i] = us;
        if (isnan(fastest) || us < fastest) {
            fastest = us;
            *best = kSplitCounts[i];
        }
    }
    cudaFree(ws);
    return fastest;
}

/* Random cache rows; fp8 records written through mlart_kv_write_cuda. */
int fill_cache(void *kv, mlart_kv_format fmt, const mlart_geometry &g0)
{
    const int64_t chunk = 1 << 16;
    void *lat = NULL, *slots = NULL;
    int32_t *hs = (int32_t *)malloc(sizeof(int32_t) * chunk);
    int rc = -1;
    mlart_geometry g = g0;
    g.kv_format = fmt;
    if (fmt == MLART_KV_BF16) {
        free(hs);
        return mlart_bench_fill_bf16(kv, (size_t)kSlots * 576, 0xCAC4E, 0) ? -1 : 0;
    }
    ATT_CUDA(cudaMalloc(&lat, (size_t)chunk * 576 * 2));
    ATT_CUDA(cudaMalloc(&slots, (size_t)chunk * 4));
    for (int64_t s0 = 0; s0 < kSlots; s0 += chunk) {
        for (int64_t i = 0; i < chunk; i++)
            hs[i] = (int32_t)(s0 + i);
        ATT_CUDA(cudaMemcpy(slots, hs, sizeof(int32_t) * chunk, cudaMemcpyHostToDevice));
        if (mlart_bench_fill_bf16(lat, (size_t)chunk * 576, 0xCAC4E + (uint64_t)s0, 0))
            goto fail;
        mlart_tensor cache = dense(kv, MLART_DTYPE_U8, 2, kSlots, 656, 0);
        mlart_tensor l = dense(lat, MLART_DTYPE_BF16, 2, chunk, 576, 0);
        mlart_tensor sl = dense(slots, MLART_DTYPE_I32, 1, chunk, 0, 0);
        if (mlart_kv_write_cuda(&g, &cache, &l, &sl, NULL)) {
            fprintf(stderr, "mlart-bench attn: kv_write: %s\n", mlart_last_error());
            goto fail;
        }
    }
    ATT_CUDA(cudaDeviceSynchronize());
    rc = 0;
fail:
    cudaFree(lat);
    cudaFree(slots);
    free(hs);
    return rc;
}

void free_sets(Ctx &c)
{
    for (int s = 0; s < c.nsets; s++) {
        Set &x = c.sets[s];
        cudaFree(x.q);
        cudaFree(x.idx);
        cudaFree(x.req);
        cudaFree(x.seq);
        cudaFree(x.bt);
        cudaFree(x.out);
        cudaFree(x.lse);
        cudaFree(x.ref_out);
        cudaFree(x.ref_lse);
        cudaFree(x.qin);
        cudaFree(x.wuk);
        cudaFree(x.wuv);
        cudaFree(x.o);
        cudaFree(x.didx);
    }
    memset(c.sets, 0, sizeof c.sets);
    c.nsets = 0;
}

/* nsets sets of T tokens: token t of set s is request t with its own 64
 * pages (page p of the rotation), 2048 distinct positions of 4096.  With
 * c.valid > 0 each request is `valid` tokens long and its list, as an
 * indexer gives it for a request shorter than top-k, holds every position
 * 0..valid-1 in a shuffled order, then -1s; didx holds the same positions
 * alone. */
int alloc_sets(Ctx &c, int nsets, uint64_t seed)
{
    const int T = c.T, H = c.g.heads;
    const int64_t pages = kSlots / kPage, P = c.P, qrow = P + 64, V = c.V;
    int32_t *idx = (int32_t *)malloc(sizeof(int32_t) * T * kTopk);
    int32_t *bt = (int32_t *)malloc(sizeof(int32_t) * T * kPagesPerReq);
    int32_t *req = (int32_t *)malloc(sizeof(int32_t) * T);
    int32_t *seq = (int32_t *)malloc(sizeof(int32_t) * T);
    int rc = -1;
    int64_t next_page = 0;
    c.nsets = nsets;
    for (int s = 0; s < nsets; s++) {
        Set &x = c.sets[s];
        ATT_CUDA(cudaMalloc(&x.q, (size_t)T * H * 576 * 2));
        ATT_CUDA(cudaMalloc(&x.idx, sizeof(int32_t) * T * kTopk));
        ATT_CUDA(cudaMalloc(&x.req, sizeof(int32_t) * T));
        ATT_CUDA(cudaMalloc(&x.seq, sizeof(int32_t) * T));
        ATT_CUDA(cudaMalloc(&x.bt, sizeof(int32_t) * T * kPagesPerReq));
        ATT_CUDA(cudaMalloc(&x.out, (size_t)H * T * 512 * 2));
        ATT_CUDA(cudaMalloc(&x.lse, (size_t)H * T * 4));
        ATT_CUDA(cudaMalloc(&x.ref_out, (size_t)H * T * 512 * 2));
        ATT_CUDA(cudaMalloc(&x.ref_lse, (size_t)H * T * 4));
        ATT_CUDA(cudaMalloc(&x.qin, (size_t)T * H * qrow * 2));
        ATT_CUDA(cudaMalloc(&x.wuk, (size_t)H * P * 512 * 2));
        ATT_CUDA(cudaMalloc(&x.wuv, (size_t)H * 512 * V * 2));
        ATT_CUDA(cudaMalloc(&x.o, (size_t)T * H * V * 2));
        if (c.valid)
            ATT_CUDA(cudaMalloc(&x.didx, sizeof(int32_t) * T * c.valid));
        if (mlart_bench_fill_bf16(x.q, (size_t)T * H * 576, seed * 977 + s, 0) ||
            mlart_bench_fill_bf16(x.qin, (size_t)T * H * qrow, seed * 977 + s + 500, 0) ||
            mlart_bench_fill_bf16(x.wuk, (size_t)H * P * 512, seed * 977 + s + 900, 0) ||
            mlart_bench_fill_bf16(x.wuv, (size_t)H * 512 * V, seed * 977 + s + 1300, 0))
            goto fail;
        for (int t = 0; t < T; t++) {
            req[t] = t;
            seq[t] = c.valid ? c.valid : kSeq;
            /* fresh pages only for the positions the list can name (a short
             * request touches ceil(valid / kPage) of them); the rest of the
             * table points at page 0 and is never read */
            const int used = c.valid ? (c.valid + kPage - 1) / kPage : kPagesPerReq;
            for (int p = 0; p < kPagesPerReq; p++)
                bt[t * kPagesPerReq + p] = p < used ? (int32_t)(next_page++ % pages) : 0;
            int32_t *row = idx + (size_t)t * kTopk;
            if (c.valid) {
                for (int k = 0; k < kTopk; k++)
                    row[k] = k < c.valid ? k : -1;
                for (int k = c.valid - 1; k > 0; k--) { /* Fisher-Yates over the valid entries */
                    const int j = (int)(mix(seed ^ ((uint64_t)s << 40) ^ ((uint64_t)t << 20) ^ k) % (uint64_t)(k + 1));
                    const int32_t v = row[k];
                    row[k] = row[j];
                    row[j] = v;
                }
                continue;
            }
            for (int k = 0; k < kTopk; k++) /* position 2k or 2k+1: distinct, spread over the request */
                row[k] = 2 * k + (int)(mix(seed ^ ((uint64_t)s << 40) ^ ((uint64_t)t << 20) ^ k) & 1);
        }
        if (c.valid)
            for (int t = 0; t < T; t++)
                ATT_CUDA(cudaMemcpy((int32_t *)x.didx + (size_t)t * c.valid, idx + (size_t)t * kTopk,
                                    sizeof(int32_t) * c.valid, cudaMemcpyHostToDevice));
        ATT_CUDA(cudaMemcpy(x.idx, idx, sizeof(int32_t) * T * kTopk, cudaMemcpyHostToDevice));
        ATT_CUDA(cudaMemcpy(x.req, req, sizeof(int32_t) * T, cudaMemcpyHostToDevice));
        ATT_CUDA(cudaMemcpy(x.seq, seq, sizeof(int32_t) * T, cudaMemcpyHostToDevice));
        ATT_CUDA(cudaMemcpy(x.bt, bt, sizeof(int32_t) * T * kPagesPerReq, cudaMemcpyHostToDevice));
    }
    if (next_page > pages) /* pages reused: some sets' rows were read shortly before (L2) */
        fprintf(stderr, "mlart-bench attn: T=%d x %d sets need %lld pages of %lld: pages reused\n", T, nsets,
                (long long)next_page, (long long)pages);
    ATT_CUDA(cudaDeviceSynchronize());
    rc = 0;
fail:
    free(idx);
    free(bt);
    free(req);
    free(seq);
    return rc;
}

/* NMSE of set 0's b12x output against the reference's; LSE must agree to
 * 2.5e-3 relative (the tests' bound, docs/attention.md).  Returns NaN when
 * the outputs hold NaN or LSEs disagree. */
double check_set0(const Ctx &c)
{
    const size_t n = (size_t)c.g.heads * c.T;
    uint16_t *a = (uint16_t *)malloc(n * 512 * 2), *b = (uint16_t *)malloc(n * 512 * 2);
    float *la = (float *)malloc(n * 4), *lb = (float *)malloc(n * 4);
    double num = 0, den = 0, r = NAN;
    if (cudaMemcpy(a, c.sets[0].out, n * 1024, cudaMemcpyDeviceToHost) != cudaSuccess ||
        cudaMemcpy(b, c.sets[0].ref_out, n * 1024, cudaMemcpyDeviceToHost) != cudaSuccess ||
        cudaMemcpy(la, c.sets[0].lse, n * 4, cudaMemcpyDeviceToHost) != cudaSuccess ||
        cudaMemcpy(lb, c.sets[0].ref_lse, n * 4, cudaMemcpyDeviceToHost) != cudaSuccess)
        goto done;
    for (size_t i = 0; i < n * 512; i++) {
        double x = mlart_bf16_to_f32(a[i]), y = mlart_bf16_to_f32(b[i]);
        if (isnan(x))
            goto done;
        num += (x - y) * (x - y);
        den += y * y;
    }
    for (size_t i = 0; i < n; i++)
        if (!(fabs((double)la[i] - lb[i]) <= 2.5e-3 * (1.0 + fabs((double)lb[i]))))
            goto done;
    r = den > 0 ? num / den : num;
done:
    free(a);
    free(b);
    free(la);
    free(lb);
    return r;
}

/* bf16 tensor-core rate of this device, TFLOP/s: cuBLAS 8192^3, fp32
 * accumulate, random data, median of 5 after 2 warm-ups. */
double measure_tc_peak(void)
{
    const int n = 8192;
    void *A = NULL, *B = NULL, *C = NULL;
    cublasHandle_t h = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    double best[5], r = NAN;
    const float one = 1.0f, zero = 0.0f;
    ATT_CUDA(cudaMalloc(&A, (size_t)n * n * 2));
    ATT_CUDA(cudaMalloc(&B, (size_t)n * n * 2));
    ATT_CUDA(cudaMalloc(&C, (size_t)n * n * 2));
    if (mlart_bench_fill_bf16(A, (size_t)n * n, 1, 0) || mlart_bench_fill_bf16(B, (size_t)n * n, 2, 0))
        goto fail;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS)
        goto fail;
    ATT_CUDA(cudaEventCreate(&e0));
    ATT_CUDA(cudaEventCreate(&e1));
    for (int i = 0; i < 7; i++) {
        float ms = 0;
        ATT_CUDA(cudaEventRecord(e0, 0));
        if (cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, A, CUDA_R_16BF, n, B, CUDA_R_16BF, n,
                         &zero, C, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) !=
            CUBLAS_STATUS_SUCCESS)
            goto fail;
        ATT_CUDA(cudaEventRecord(e1, 0));
        ATT_CUDA(cudaEventSynchronize(e1));
        ATT_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 2)
            best[i - 2] = 2.0 * n * (double)n * n / (ms * 1e9);
    }
    for (int i = 0; i < 5; i++) /* median of 5 by insertion sort */
        for (int j = i + 1; j < 5; j++)
            if (best[j] < best[i]) {
                double t = best[i];
                best[i] = best[j];
                best[j] = t;
            }
    r = best[2];
fail:
    if (h)
        cublasDestroy(h);
    if (e0)
        cudaEventDestroy(e0);
    if (e1)
        cudaEventDestroy(e1);
    cudaFree(A);
    cudaFree(B);
    cudaFree(C);
    return r;
}

struct Model {
    const char *name;
    int heads;
    int64_t P, V; /* qk_nope and v_head: the layer step's absorption and V up-projection */
    int apart;    /* 1: its layer-step columns are summed apart from the others' */
};

#ifdef B12X_PROFILE
extern "C" void b12x_profile_dump(FILE *f, const char *label);
extern "C" void b12x_profile_reset(void); /* before a timing: the two-call stamps count from here */
#endif

/* The benchmark's geometry (heads set per row) and a cache of kSlots rows
 * in that format, filled with random records; NULL (with a message) on
 * failure. */
void *open_cache(mlart_kv_format fmt, mlart_geometry *g0)
{
    void *kv = NULL;
    memset(g0, 0, sizeof *g0);
    g0->heads = 16;
    g0->qk_nope = 128;
    g0->rope = 64;
    g0->kv_lora = 512;
    g0->v_head = 128;
    g0->topk = kTopk;
    g0->page_size = kPage;
    g0->kv_format = fmt;
    g0->softmax_scale = 0.0417f;
    const size_t row_bytes = fmt == MLART_KV_BF16 ? 1152 : 656;
    if (cudaMalloc(&kv, row_bytes * kSlots) != cudaSuccess || fill_cache(kv, fmt, *g0)) {
        fprintf(stderr, "mlart-bench attn: cache setup failed\n");
        cudaFree(kv);
        return NULL;
    }
    return kv;
}

/* The create() arguments of the b12x backend for a Ctx. */
void backend_init(const mlart_bench_opts *o, const Ctx *c, mlart_backend_init *init)
{
    memset(init, 0, sizeof *init);
    init->struct_size = sizeof *init;
    init->device = o->device;
    init->geom = c->g;
    init->error = bench_err;
    init->log = bench_log;
}

/* One variant of the launch (b12x_tune) on a Ctx, for the tuning table. */
struct Variant {
    Ctx *c;
    b12x_tune tune;
    const b12x_dev *dev;
    bool peer; /* make_step's peer: the valid entries alone */
};

int enqueue_variant(void *ctx, int set, cudaStream_t stream)
{
    Variant *v = (Variant *)ctx;
    mlart_step st = make_step(*v->c, set, false, v->peer);
    return b12x_attend_launch_tuned(&st, v->dev, &v->tune, stream, bench_err) != 0;
}

/* A table over both cache formats, head counts and token counts; row
 * "<prefix> H<heads> <bf16|fp8> T<T>".  Head count m's token counts start
 * at Ts + m * ts_stride and end at a 0. */
struct Grid {
    const char *prefix;
    int nh;
    const int *Hs;
    const int *Ts;
    int ts_stride;
    uint64_t seed; /* of the input sets: seed + 131 * (T index) + 7 * m + f */
    int valid;     /* Ctx.valid of its rows (0: full lists) */
};

void grid_name(char *name, size_t n, const Grid &g, int f, int m, int it)
{
    snprintf(name, n, "%s H%d %s T%d", g.prefix, g.Hs[m], f == 0 ? "bf16" : "fp8", g.Ts[m * g.ts_stride + it]);
}

/* Whether --filter selects any row of the grid. */
int grid_match(const mlart_bench_opts *o, const Grid &g)
{
    for (int f = 0; f < 2; f++)
        for (int m = 0; m < g.nh; m++)
            for (int it = 0; g.Ts[m * g.ts_stride + it]; it++) {
                char name[80];
                grid_name(name, sizeof name, g, f, m, it);
                if (mlart_bench_match(o, name))
                    return 1;
            }
    return 0;
}

/* One selected row: c holds its T and nsets input sets, set 0 with the
 * CUDA reference's output and LSE; dev is the attend launch's device.
 * Returns how many results were wrong. */
typedef int (*GridRow)(void *arg, Ctx &c, const b12x_dev &dev, const char *name, int nsets);

/* Runs row() at every row of g that --filter selects: per format a cache
 * of random records, per head count a Ctx whose workspace holds 64 splits
 * of the grid's largest T, per row fresh input sets and the reference.
 * Returns the wrong results, or -1 when the setup failed. */
int grid_run(const mlart_bench_opts *o, const Grid &g, GridRow row, void *arg)
{
    static const mlart_kv_format fmts[] = {MLART_KV_BF16, MLART_KV_FP8_DS_MLA};
    mlart_bench_opts ref_opts = *o;
    ref_opts.reps = 1;
    ref_opts.warmup = 0;
    int max_t = 0, wrong = 0;
    for (int m = 0; m < g.nh; m++)
        for (int it = 0; g.Ts[m * g.ts_stride + it]; it++)
            if (g.Ts[m * g.ts_stride + it] > max_t)
                max_t = g.Ts[m * g.ts_stride + it];
    b12x_dev dev;
    if (b12x_attend_setup(&dev, bench_err))
        return -1;
    for (int f = 0; f < 2; f++) {
        mlart_geometry g0;
        void *kv = open_cache(fmts[f], &g0);
        if (!kv) {
            b12x_attend_teardown(&dev);
            return -1;
        }
        const size_t row_bytes = fmts[f] == MLART_KV_BF16 ? 1152 : 656;
        for (int m = 0; m < g.nh; m++) {
            Ctx *c = (Ctx *)calloc(1, sizeof(Ctx));
            if (c) {
                c->g = g0;
                c->g.heads = g.Hs[m];
                c->P = c->V = 128;
                c->valid = g.valid;
                c->kv = kv;
                c->ws_bytes = (size_t)64 * max_t * g.Hs[m] * (512 * 2 + 4); /* 64 splits */
            }
            if (!c || cudaMalloc(&c->ws, c->ws_bytes) != cudaSuccess) {
                free(c);
                cudaFree(kv);
                b12x_attend_teardown(&dev);
                return -1;
            }
            for (int it = 0; g.Ts[m * g.ts_stride + it]; it++) {
                c->T = g.Ts[m * g.ts_stride + it];
                char name[80];
                grid_name(name, sizeof name, g, f, m, it);
                if (!mlart_bench_match(o, name))
                    continue;
                const int nsets = mlart_bench_sets(o, (size_t)c->T * (g.valid ? g.valid : kTopk) * row_bytes, 2);
                double ref_us;
                if (alloc_sets(*c, nsets, g.seed + 131 * it + 7 * m + f) ||
                    mlart_bench_time(&ref_opts, enqueue_ref, c, 1, &ref_us))
                    wrong++;
                else
                    wrong += row(arg, *c, dev, name, nsets);
                free_sets(*c);
            }
            cudaFree(c->ws);
            free(c);
        }
        cudaFree(kv);
    }
    b12x_attend_teardown(&dev);
    return wrong;
}

/* Tuning table (--variants, or MLART_BENCH_ATTN_VARIANTS=1): where the time of
 * a small-T call goes.  Per shape: the call as shipped; without
 * programmatic dependent launch; the main kernel alone; each combine alone
 * (whole-row and quarter-row blocks, on the partials the main kernel left
 * in the workspace); forced split counts (1..64; `s22`, `s13`, `s11` are
 * counts that leave multiprocessors free beside the main grid for the
 * combine at T = 2..8, also with whole-row combine blocks); the combine capped at two
 * blocks a multiprocessor or not; the in-place combine (`inplace`, and
 * with forced split counts `s64i` .. `s2i`, where the launch takes it);
 * the full call with whole-row or quarter-row combine blocks (`cb-row`,
 * `cb-quarter`; `cb-row-packed` uncapped), and with the combine letting
 * the next call launch before its wait or after it (`cb-early`,
 * `cb-late`).  In a build with -DB12X_PROFILE each row is followed by the
 * phase stamps of its last call and by where that call's blocks started
 * against the call before (b12x_profile_dump).
 * 16 heads T = 1..300, 64 and 128 heads T = 1..16 and two larger T each;
 * steps of a full and a partial 64-head tile (80, 96, 112 heads) at
 * T = 4..32, where the 16-row tiles hand over to two launches.  Rows
 * that produce the output are checked against the reference like the main
 * table (err, NMSE <= 1e-4). */
const int kVarHs[6] = {16, 64, 128, 80, 96, 112};
const int kVarTs[6][20] = {{1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 48, 64, 75, 100, 128, 150, 200, 256, 300, 0},
                           {1, 2, 4, 8, 16, 48, 96, 0},
                           {1, 2, 4, 8, 16, 24, 47, 0},
                           {4, 6, 7, 8, 12, 16, 24, 32, 0},
                           {4, 6, 7, 8, 12, 16, 24, 32, 0},
                           {4, 6, 7, 8, 12, 16, 24, 32, 0}};
const Grid kVarGrid = {"attn", 6, kVarHs, kVarTs[0], 20, 0xA11};

const mlart_bench_col kVarCols[] = {{"time", "us", 8, 2}, {"splits", "", 6, 0}, {"err", "nmse", 9, 7}};
const mlart_bench_table kVarTable = {
    "attn variants: b12x_mla_sparse pieces and split counts (bf16/fp8 cache, topk 2048)", "shape variant", 40,
    kVarCols, 3};

/* One shape of the variants table: every variant's row. */
int variants_row(void *arg, Ctx &c, const b12x_dev &dev, const char *base, int nsets)
{
    const mlart_bench_opts *o = (const mlart_bench_opts *)arg;
    struct V {
        const char *name;
        b12x_tune tune;
    };
    static const V vars[] = {
        {"auto", {0, 0, 0, 1}},     {"nopdl", {0, 0, 0, 0}},        {"main", {0, 1, 0, 1}},
        {"comb-row", {0, 2, 1, 1}}, {"comb-quarter", {0, 2, 2, 1}}, {"s16", {16, 0, 0, 1}},
        {"s32", {32, 0, 0, 1}},     {"s64", {64, 0, 0, 1}},         {"s8", {8, 0, 0, 1}},
        {"s4", {4, 0, 0, 1}},       {"s3", {3, 0, 0, 1}},           {"s2", {2, 0, 0, 1}},
        {"s1", {1, 0, 0, 1}},       {"s5", {5, 0, 0, 1}},           {"cb-spread", {0, 0, 0, 1, 1}},
        {"cb-packed", {0, 0, 0, 1, -1}}, {"inplace", {0, 0, 0, 1, 0, 1}}, {"s64i", {64, 0, 0, 1, 0, 1}},
        {"s32i", {32, 0, 0, 1, 0, 1}},  {"s16i", {16, 0, 0, 1, 0, 1}},  {"s8i", {8, 0, 0, 1, 0, 1}},
        {"s4i", {4, 0, 0, 1, 0, 1}},    {"s2i", {2, 0, 0, 1, 0, 1}},    {"cb-row", {0, 0, 1, 1}},
        {"cb-quarter", {0, 0, 2, 1}},   {"cb-row-packed", {0, 0, 1, 1, -1}},
        {"cb-early", {0, 0, 0, 1, 0, 0, 1}}, {"cb-late", {0, 0, 0, 1, 0, 0, -1}},
        {"s16 cb-row-packed", {16, 0, 1, 1, -1}}, {"s32 cb-row-packed", {32, 0, 1, 1, -1}},
        {"s64 cb-row-packed", {64, 0, 1, 1, -1}}, {"s32 cb-packed", {32, 0, 0, 1, -1}},
        {"s64 cb-packed", {64, 0, 0, 1, -1}},    {"s16 cb-packed", {16, 0, 0, 1, -1}},
        {"s22", {22, 0, 0, 1}},               {"s13", {13, 0, 0, 1}},
        {"s11", {11, 0, 0, 1}},               {"s22 cb-row", {22, 0, 1, 1}},
        {"s13 cb-row", {13, 0, 1, 1}},        {"s11 cb-row", {11, 0, 1, 1}},
    };
    const int H = c.g.heads, fp8 = c.g.kv_format == MLART_KV_FP8_DS_MLA;
    int wrong = 0;
    for (size_t vi = 0; vi < sizeof vars / sizeof vars[0]; vi++) {
        Variant v = {&c, vars[vi].tune, &dev};
        char name[128];
        double vals[3];
        snprintf(name, sizeof name, "%s %s", base, vars[vi].name);
        const b12x_split sp = b12x_attend_split(c.T, H, kTopk, fp8, dev.num_sms);
        const int nblk = kTopk / 32;
        int splits = sp.splits;
        if (v.tune.splits) {
            const int bps = (nblk + v.tune.splits - 1) / v.tune.splits;
            splits = (nblk + bps - 1) / bps;
        }
        /* the in-place combine only where the launch can take it */
        if (v.tune.inplace > 0 && !b12x_attend_inplace_ok(&dev, c.T, H, splits))
            continue;
#ifdef B12X_PROFILE
        b12x_profile_reset();
#endif
        if (cudaMemset(c.sets[0].out, 0xff, (size_t)H * c.T * 1024) != cudaSuccess ||
            mlart_bench_time(o, enqueue_variant, &v, nsets, &vals[0])) {
            wrong++;
            continue;
        }
#ifdef B12X_PROFILE
        /* the last replay's stamps (a variant without the main
         * kernel leaves its columns stale; its combine's are fresh) */
        b12x_profile_dump(stdout, name);
#endif
        vals[1] = splits;
        vals[2] = NAN;
        if ((v.tune.parts == 0 || v.tune.parts == 3) && splits > 1) {
            vals[2] = check_set0(c);
            if (!(vals[2] <= kNmseMax))
                wrong++;
        }
        mlart_bench_table_row(o, &kVarTable, name, vals);
    }
    return wrong;
}

int bench_attn_variants(const mlart_bench_opts *o)
{
    mlart_bench_table_head(o, &kVarTable);
    return grid_run(o, kVarGrid, variants_row, (void *)o);
}

/* Partial head tiles (17..63 heads, e.g. DeepSeek-V3.2 at tensor parallel
 * 4: 32 heads a rank): the launch's pick (`time`; b12x_tune zero) against
 * the same step forced onto the general mma.sync kernel (`general`, tune
 * tile = 1), onto the wgmma kernel (`wgmma`, tile = 2) and onto the
 * small-head kernel in 16-row tiles (`small`, tile = 3), each checked
 * against the reference (err: the largest NMSE of the four).  The rule is
 * b12x_attend.cu's part_kernel. */
const int kPartHs[4] = {32, 40, 48, 56};
const int kPartTs[7] = {1, 2, 4, 8, 16, 64, 0};
const Grid kPartGrid = {"attn partial", 4, kPartHs, kPartTs, 0, 0x9A27};

const mlart_bench_col kPartCols[] = {{"time", "us", 8, 2},  {"general", "us", 8, 2}, {"wgmma", "us", 8, 2},
                                     {"small", "us", 8, 2}, {"x_gen", "x", 6, 2},    {"x_best", "x", 6, 2},
                                     {"err", "nmse", 9, 7}};
const mlart_bench_table kPartTable = {"attn partial head tiles: the launch's kernel against the general, the "
                                      "wgmma and the small-head kernel (topk 2048, each token its own request)",
                                      "shape", 34, kPartCols, 7};

/* Whole steps of 64..128 heads at small T, the same columns: where the
 * 16-row tiles on the small-head kernel (step_tiled in b12x_attend.cu:
 * at most 12 tiles over the step's tokens) stop beating the wgmma kernel
 * and, for the partial tile of 80..100 heads, the general one. */
const int kTileHs[7] = {64, 72, 80, 96, 100, 112, 128};
const int kTileTs[11] = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 0};
const Grid kTileGrid = {"attn tiles", 7, kTileHs, kTileTs, 0, 0x71E5};
const mlart_bench_table kTileTable = {"attn tiles: steps of 64..128 heads, the launch's kernel against the general, "
                                      "the wgmma and the small-head kernel in 16-row tiles (topk 2048, each token its "
                                      "own request)",
                                      "shape", 34, kPartCols, 7};

/* A kernel-choice table's running figures for its summary line. */
struct PartStats {
    const mlart_bench_opts *o;
    const mlart_bench_table *table;
    size_t prefix; /* of the row names, left out of worst_name */
    int rows;
    double worst_best, log_gen[2];
    int n_gen[2];
    char worst_name[64];
};

int partial_row(void *arg, Ctx &c, const b12x_dev &dev, const char *name, int nsets)
{
    PartStats *ps = (PartStats *)arg;
    double vals[7], err = 0;
    for (int k = 0; k < 4; k++) {
        Variant v = {&c, {0, 0, 0, 1, 0, 0, 0, k}, &dev};
        if (cudaMemset(c.sets[0].out, 0xff, (size_t)c.g.heads * c.T * 1024) != cudaSuccess ||
            mlart_bench_time(ps->o, enqueue_variant, &v, nsets, &vals[k])) {
            err = NAN;
            break;
        }
        const double e = check_set0(c);
        err = e > err || isnan(e) ? e : err;
        if (!(e <= kNmseMax))
            break;
    }
    if (!(err <= kNmseMax)) {
        fprintf(stderr, "mlart-bench attn: %s: a kernel failed or disagreed with the reference (nmse %g)\n", name,
                err);
        return 1;
    }
    vals[4] = vals[1] / vals[0];
    vals[5] = fmin(fmin(vals[1], vals[2]), vals[3]) / vals[0];
    vals[6] = err;
    mlart_bench_table_row(ps->o, ps->table, name, vals);
    if (++ps->rows == 1 || vals[5] < ps->worst_best) {
        ps->worst_best = vals[5];
        snprintf(ps->worst_name, sizeof ps->worst_name, "%s", name + ps->prefix);
    }
    ps->log_gen[c.T >= 4] += log(vals[4]);
    ps->n_gen[c.T >= 4]++;
    return 0;
}

/* One kernel-choice table (partial tiles or whole tiled steps) over the
 * rows of g that --filter selects. */
int bench_attn_choice(const mlart_bench_opts *o, const Grid &g, const mlart_bench_table *table)
{
    PartStats ps = {o, table, strlen(g.prefix) + 1, 0, 0, {0, 0}, {0, 0}, ""};
    if (!grid_match(o, g))
        return 0;
    mlart_bench_table_head(o, table);
    const int wrong = grid_run(o, g, partial_row, &ps);
    if (ps.rows) {
        char line[320];
        snprintf(line, sizeof line,
                 "%d rows: the launch's pick against the fastest of the three kernels worst %.3fx (%s); speedup over "
                 "the general kernel geomean %.2fx at T < 4, %.2fx at T >= 4",
                 ps.rows, ps.worst_best, ps.worst_name, ps.n_gen[0] ? exp(ps.log_gen[0] / ps.n_gen[0]) : NAN,
                 ps.n_gen[1] ? exp(ps.log_gen[1] / ps.n_gen[1]) : NAN);
        mlart_bench_summary(o, table->title, line);
    }
    return wrong;
}

/* Short requests (the `attn short` table): each token's request is 512
 * tokens long, so its 2048-entry list holds those 512 positions, shuffled,
 * then 1536 -1s, as an indexer pads a list for a request shorter than
 * top-k.  `time` is the launch on that list; `dense` the same step with
 * the 512 valid entries as the whole list (a step of top-k 512: the least
 * work the padded call can come down to, as the chunks take the list's
 * blocks interleaved and compact their slots, docs/attention.md "Sparse
 * lists" and "Chunks interleave"); x_dense = time / dense; GB/s
 * the unique bytes of the valid rows over `time`; err the larger NMSE of
 * the two against the CUDA reference on the padded list.  At T = 1 the
 * rotation's 128 sets hold less than 3x L2 (their rows are under 0.6 MB
 * a set), so those rows read partly from L2; `time` and `dense` alike. */
const int kShortValid = 512;
const int kShortHs[2] = {16, 64};
const int kShortTs[5] = {1, 4, 16, 64, 0};
const Grid kShortGrid = {"attn short", 2, kShortHs, kShortTs, 0, 0x5407, kShortValid};
const mlart_bench_col kShortCols[] = {{"time", "us", 8, 2},  {"dense", "us", 8, 2}, {"x_dense", "x", 7, 2},
                                      {"GB/s", "", 7, 0},    {"err", "nmse", 9, 7}};
const mlart_bench_table kShortTable = {"attn short: requests of 512 tokens, their top-k 2048 lists padded with -1, "
                                       "against the same step on the 512 valid entries alone",
                                       "shape", 32, kShortCols, 5};

struct ShortStats {
    const mlart_bench_opts *o;
    int rows;
    double worst, log_sum;
    char worst_name[64];
};

int short_row(void *arg, Ctx &c, const b12x_dev &dev, const char *name, int nsets)
{
    ShortStats *ss = (ShortStats *)arg;
    const size_t out_b = (size_t)c.g.heads * c.T * 1024;
    const double row_bytes = c.g.kv_format == MLART_KV_BF16 ? 1152 : 656;
    double vals[5], err = 0;
    for (int k = 0; k < 2; k++) {
        Variant v = {&c, {0, 0, 0, 1}, &dev, k == 1};
        double e = NAN;
        if (cudaMemset(c.sets[0].out, 0xff, out_b) != cudaSuccess ||
            cudaMemset(c.sets[0].lse, 0xff, (size_t)c.g.heads * c.T * 4) != cudaSuccess ||
            mlart_bench_time(ss->o, enqueue_variant, &v, nsets, &vals[k]) || !((e = check_set0(c)) <= kNmseMax)) {
            fprintf(stderr, "mlart-bench attn: %s: %s call failed or disagreed with the reference (nmse %g)\n", name,
                    k ? "the dense" : "the padded", e);
            return 1;
        }
        err = fmax(err, e);
    }
    vals[2] = vals[0] / vals[1];
    vals[3] = (double)c.T * c.valid * row_bytes / (vals[0] * 1e3);
    vals[4] = err;
    mlart_bench_table_row(ss->o, &kShortTable, name, vals);
    if (++ss->rows == 1 || vals[2] > ss->worst) {
        ss->worst = vals[2];
        snprintf(ss->worst_name, sizeof ss->worst_name, "%s", name + strlen(kShortGrid.prefix) + 1);
    }
    ss->log_sum += log(vals[2]);
    return 0;
}

int bench_attn_short(const mlart_bench_opts *o)
{
    ShortStats ss = {o, 0, 0, 0, ""};
    if (!grid_match(o, kShortGrid))
        return 0;
    mlart_bench_table_head(o, &kShortTable);
    const int wrong = grid_run(o, kShortGrid, short_row, &ss);
    if (ss.rows) {
        char line[200];
        snprintf(line, sizeof line, "%d rows: padded list / valid entries alone worst %.2fx (%s), geomean %.2fx",
                 ss.rows, ss.worst, ss.worst_name, exp(ss.log_sum / ss.rows));
        mlart_bench_summary(o, kShortTable.title, line);
    }
    return wrong;
}

} /* namespace */

extern "C" int mlart_bench_attn(const mlart_bench_opts *o)
{
    static const mlart_bench_col cols[] = {
        {"time", "us", 8, 2},    {"GB/s", "unique", 7, 0}, {"TFLOP/s", "", 8, 1}, {"floor", "us", 7, 2},
        {"%roof", "%", 6, 1},    {"ref", "us", 9, 1},      {"x_ref", "x", 7, 1},  {"err", "nmse", 9, 7},
        {"qbmm", "us", 7, 2},    {"in_layer", "+us", 8, 2}, {"inplace", "us", 8, 2}, {"v_up", "+us", 7, 2},
        {"v_up_pdl", "+us", 8, 2}, {"step", "us", 7, 2},      {"early", "us", 7, 2},  {"chain", "us", 7, 2},
        {"chain_pdl", "us", 9, 2}, {"split_pdl", "us", 9, 2}};
    const mlart_bench_table t = {"attn decode: b12x_mla_sparse, topk 2048, each token its own request, "
                                 "q_mqa[T,H,576] x paged cache -> out[H,T,512] + lse",
                                 "shape", 34, cols, (int)(sizeof cols / sizeof cols[0])};
    /* GLM5-TP2DCP4 (GLM-5 at tensor parallel 2, 32 heads a rank, times 4
     * decode-context ranks) runs the same attention as H128; it is here for
     * the layer step's absorption at 128 heads and P = 192, and its step
     * columns are summed apart so that the sums stay comparable with runs
     * before it was added. */
    static const Model models[] = {{"DSv3.2-TP8", 16, 128, 128, 0},
                                   {"GLM5-TP4DCP4", 64, 192, 256, 0},
                                   {"H128", 128, 128, 128, 0},
                                   {"GLM5-TP2DCP4", 128, 192, 256, 1}};
    const int nmodels = (int)(sizeof models / sizeof models[0]);
    static const int Ts[] = {1, 2, 4, 8, 16, 32, 64};
    static const mlart_kv_format fmts[] = {MLART_KV_BF16, MLART_KV_FP8_DS_MLA};
    int wrong = 0, any = 0;
    double worst_mem_ratio = 0, worst_small_us = 0, h128_fp8_t64 = NAN, worst_layer_mem = 0, worst_layer_small = 0;
    double ip_mem_ratio = 0, ip_small_us = 0; /* the in-place combine's column, where it runs */
    double step_plain_sum = 0, step_pdl_sum = 0; /* the v_up columns, summed over the rows */
    double whole_sum = 0, early_sum = 0;         /* the step and early columns, summed */
    double apart_whole = 0, apart_early = 0;     /* the same for the rows summed apart */
    double bare_sum[4] = {0, 0, 0, 0};           /* with the KV write: the same four sums without it */
    double chain_mem_ratio[2] = {0, 0}, chain_small_us[2] = {0, 0}; /* the chain floor, plain and PDL */
    double split_mem_ratio = 0, split_small_us = 0;                  /* the split floor */
    char line[2048];
    mlart_bench_opts ref_opts = *o;
    ref_opts.reps = o->reps < 3 ? o->reps : 3;
    ref_opts.warmup = 1;

    for (int f = 0; f < 2 && !any; f++)
        for (int m = 0; m < nmodels && !any; m++)
            for (int it = 0; it < 7 && !any; it++) {
                char name[64];
                snprintf(name, sizeof name, "attn %s H%d %s T%d", models[m].name, models[m].heads,
                         fmts[f] == MLART_KV_BF16 ? "bf16" : "fp8", Ts[it]);
                any = mlart_bench_match(o, name);
            }
    const char *ev = getenv("MLART_BENCH_ATTN_VARIANTS");
    const int variants = o->variants || (ev && *ev && strcmp(ev, "0"));
    const char *kv_env = getenv("MLART_BENCH_ATTN_KVW");
    const int kvw = !(kv_env && !strcmp(kv_env, "0"));
    const int partial = grid_match(o, kPartGrid) || grid_match(o, kTileGrid);
    if (!any && !partial && !grid_match(o, kShortGrid) && !(variants && grid_match(o, kVarGrid)))
        return 0;

    const double tc_peak = measure_tc_peak();
    if (isnan(tc_peak)) {
        fprintf(stderr, "mlart-bench attn: could not measure the bf16 tensor-core rate\n");
        return -1;
    }
    printf("\n# bf16 tensor-core rate, cuBLAS 8192^3 (median of 5): %.0f TFLOP/s; copy roofline %.0f GB/s\n",
           tc_peak, o->copy_gbs);
    if (!kvw)
        printf("# MLART_BENCH_ATTN_KVW=0: step and early without the KV write in front of the absorption\n");
    /* For the `inplace` column: the launch with the in-place combine forced
     * (b12x_tune.inplace = 1), wherever the step can take it. */
    b12x_dev dev;
    if (b12x_attend_setup(&dev, bench_err))
        return -1;
    mlart_bench_table_head(o, &t);
    for (int f = 0; f < 2; f++) {
        mlart_geometry g0;
        void *kv = open_cache(fmts[f], &g0), *kvw_src = NULL, *kvw_slots = NULL;
        if (!kv || (kvw && kvw_setup(&kvw_src, &kvw_slots))) {
            if (kv)
                fprintf(stderr, "mlart-bench attn: the KV write's rows could not be set up\n");
            cudaFree(kv);
            cudaFree(kvw_src);
            cudaFree(kvw_slots);
            b12x_attend_teardown(&dev);
            return -1;
        }
        const size_t row_bytes = fmts[f] == MLART_KV_BF16 ? 1152 : 656;
        for (int m = 0; m < nmodels; m++) {
            Ctx *c = (Ctx *)calloc(1, sizeof(Ctx));
            mlart_backend_init init;
            mlart_plan plan;
            c->g = g0;
            c->g.heads = models[m].heads;
            c->P = models[m].P;
            c->V = models[m].V;
            c->kv = kv;
            c->kvw_src = kvw_src;
            c->kvw_slots = kvw_slots;
            c->vt = mlart_backend_b12x_mla_sparse_vtable();
            backend_init(o, c, &init);
            memset(&plan, 0, sizeof plan);
            plan.struct_size = sizeof plan;
            plan.geom = c->g;
            plan.device = o->device;
            plan.max_tokens = kMaxT;
            plan.max_requests = kMaxT;
            plan.max_blocks_per_req = kPagesPerReq;
            plan.num_slots = kSlots;
            if (c->vt->create(&init, &c->state) || c->vt->plan(c->state, &plan, &c->ws_bytes) ||
                (c->ws_bytes && cudaMalloc(&c->ws, c->ws_bytes) != cudaSuccess)) {
                fprintf(stderr, "mlart-bench attn: backend setup failed\n");
                if (c->state)
                    c->vt->destroy(c->state);
                free(c);
                cudaFree(kv);
                b12x_attend_teardown(&dev);
                return -1;
            }
            for (int it = 0; it < 7; it++) {
                char name[64];
                double v[18], ref_us = NAN, pair_us = NAN, step_us = NAN;
                char kvw_line[256] = ""; /* MLART_BENCH_ATTN_KVW: the row's step and early without the write */
                char floor_line[384] = "";
                c->T = Ts[it];
                snprintf(name, sizeof name, "attn %s H%d %s T%d", models[m].name, models[m].heads,
                         fmts[f] == MLART_KV_BF16 ? "bf16" : "fp8", c->T);
                if (!mlart_bench_match(o, name))
                    continue;
                const double bytes = (double)c->T * kTopk * row_bytes;
                const double flops = 2.0 * c->g.heads * kTopk * (576.0 + 512.0) * c->T;
                const int nsets = mlart_bench_sets(o, (size_t)bytes, 2);
                if (alloc_sets(*c, nsets, 0x5EED + 131 * it + 7 * m + f)) {
                    free_sets(*c);
                    wrong++;
                    continue;
                }
#ifdef B12X_PROFILE
                b12x_profile_reset();
#endif
                /* poison set 0's outputs: a call that writes nothing fails the check */
                int bad = cudaMemset(c->sets[0].out, 0xff, (size_t)c->g.heads * c->T * 1024) != cudaSuccess ||
                          cudaMemset(c->sets[0].lse, 0xff, (size_t)c->g.heads * c->T * 4) != cudaSuccess;
                bad = bad || mlart_bench_time(o, enqueue_b12x, c, nsets, &v[0]);
#ifdef B12X_PROFILE
                b12x_profile_dump(stdout, name); /* the last graph replay's stamps */
#endif
                if (bad || mlart_bench_time(&ref_opts, enqueue_ref, c, 1, &ref_us)) {
                    fprintf(stderr, "mlart-bench attn: %s: timing failed\n", name);
                    free_sets(*c);
                    wrong++;
                    continue;
                }
                v[1] = bytes / (v[0] * 1e3);
                v[2] = flops / (v[0] * 1e6);
                v[3] = fmax(bytes / (o->copy_gbs * 1e3), flops / (tc_peak * 1e6));
                v[4] = 100.0 * v[3] / v[0];
                v[5] = ref_us;
                v[6] = ref_us / v[0];
                v[7] = check_set0(*c);
                if (!(v[7] <= kNmseMax))
                    wrong++;
                /* The same step with the in-place combine (checked like the
                 * main column), before the layer timing overwrites q. */
                v[10] = NAN;
                const b12x_split sp =
                    b12x_attend_split(c->T, c->g.heads, kTopk, fmts[f] == MLART_KV_FP8_DS_MLA, dev.num_sms);
                if (b12x_attend_inplace_ok(&dev, c->T, c->g.heads, sp.splits)) {
                    Variant ip = {c, {0, 0, 0, 1, 0, 1}, &dev};
                    double ip_err = NAN;
                    if (cudaMemset(c->sets[0].out, 0xff, (size_t)c->g.heads * c->T * 1024) != cudaSuccess ||
                        cudaMemset(c->sets[0].lse, 0xff, (size_t)c->g.heads * c->T * 4) != cudaSuccess ||
                        mlart_bench_time(o, enqueue_variant, &ip, nsets, &v[10]) ||
                        !((ip_err = check_set0(*c)) <= kNmseMax)) {
                        fprintf(stderr, "mlart-bench attn: %s: in-place combine failed (nmse %g)\n", name, ip_err);
                        v[10] = NAN;
                        wrong++;
                    } else if (c->g.heads <= 16 && c->T >= 8) {
                        ip_mem_ratio = fmax(ip_mem_ratio, v[10] / (bytes / (o->copy_gbs * 1e3)));
                    } else if (c->g.heads <= 16) {
                        ip_small_us = fmax(ip_small_us, v[10]);
                    }
                }
                /* In a layer step: after the absorption that writes q (it lets
                 * attend() start once past its own wait); the cost is
                 * time(absorption + attend) - time(absorption).  Last, as it
                 * overwrites the queries. */
                v[8] = v[9] = v[11] = v[12] = v[13] = v[14] = NAN;
                if (mlart_bench_time(o, enqueue_qbmm, c, nsets, &v[8]) ||
                    mlart_bench_time(o, enqueue_layer, c, nsets, &pair_us)) {
                    fprintf(stderr, "mlart-bench attn: %s: layer timing failed\n", name);
                    wrong++;
                } else {
                    v[9] = pair_us - v[8];
                    /* and the V up-projection after them, both launches */
                    const size_t o_b = (size_t)c->T * c->g.heads * c->V * 2;
                    void *o_plain = malloc(o_b), *o_pdl = malloc(o_b), *o_early = malloc(o_b);
                    /* the three launches must give the same bytes (set 0's o after each) */
                    const bool timed = o_plain && o_pdl && o_early &&
                                       !mlart_bench_time(o, enqueue_step, c, nsets, &step_us) &&
                                       cudaMemcpy(o_plain, c->sets[0].o, o_b, cudaMemcpyDeviceToHost) == cudaSuccess &&
                                       cudaMemset(c->sets[0].o, 0xff, o_b) == cudaSuccess &&
                                       !mlart_bench_time(o, enqueue_step_pdl, c, nsets, &v[12]) &&
                                       cudaMemcpy(o_pdl, c->sets[0].o, o_b, cudaMemcpyDeviceToHost) == cudaSuccess &&
                                       cudaMemset(c->sets[0].o, 0xff, o_b) == cudaSuccess &&
                                       !mlart_bench_time(o, enqueue_step_early, c, nsets, &v[14]) &&
                                       cudaMemcpy(o_early, c->sets[0].o, o_b, cudaMemcpyDeviceToHost) == cudaSuccess;
                    bool same = timed && memcmp(o_plain, o_pdl, o_b) == 0 && memcmp(o_plain, o_early, o_b) == 0;
                    double kvw_step = NAN, kvw_early = NAN;
                    /* with the KV write in front: the same bytes again (o_pdl reused) */
                    if (same && kvw)
                        same = cudaMemset(c->sets[0].o, 0xff, o_b) == cudaSuccess &&
                               !mlart_bench_time(o, enqueue_kvw_step, c, nsets, &kvw_step) &&
                               cudaMemcpy(o_pdl, c->sets[0].o, o_b, cudaMemcpyDeviceToHost) == cudaSuccess &&
                               memcmp(o_plain, o_pdl, o_b) == 0 &&
                               cudaMemset(c->sets[0].o, 0xff, o_b) == cudaSuccess &&
                               !mlart_bench_time(o, enqueue_kvw_early, c, nsets, &kvw_early) &&
                               cudaMemcpy(o_pdl, c->sets[0].o, o_b, cudaMemcpyDeviceToHost) == cudaSuccess &&
                               memcmp(o_plain, o_pdl, o_b) == 0;
                    free(o_plain);
                    free(o_pdl);
                    free(o_early);
                    if (!same) {
                        fprintf(stderr, "mlart-bench attn: %s: step timing failed or the launches of the step "
                                        "differ\n", name);
                        v[12] = v[14] = NAN;
                        wrong++;
                    } else {
                        v[13] = kvw ? kvw_step : v[12];
                        if (kvw) {
                            /* the columns without the write, for the same run's comparison */
                            snprintf(kvw_line, sizeof kvw_line,
                                     "#   %s without -> with the KV write: step %.2f -> %.2f, "
                                     "early %.2f -> %.2f us\n",
                                     name, v[12], kvw_step, v[14], kvw_early);
                            bare_sum[2 * models[m].apart] += v[12];
                            bare_sum[2 * models[m].apart + 1] += v[14];
                            v[14] = kvw_early;
                        }
                        v[11] = step_us - pair_us;
                        v[12] -= pair_us;
                        if (models[m].apart) {
                            apart_whole += v[13];
                            apart_early += v[14];
                        } else {
                            step_plain_sum += v[11];
                            step_pdl_sum += v[12];
                            whole_sum += v[13];
                            early_sum += v[14];
                        }
                    }
                }
                /* the chain floor (chain_floor_kernel), at <= 16 heads */
                v[15] = v[16] = v[17] = NAN;
                if (c->g.heads <= 16) {
                    int sh[2] = {0, 0}, splits = 0;
                    double each[kNumSplitCounts];
                    const bool fp8 = fmts[f] == MLART_KV_FP8_DS_MLA;
                    v[15] = chain_floor_us(o, c, fp8, 0, &sh[0]);
                    v[16] = chain_floor_us(o, c, fp8, 1, &sh[1]);
                    v[17] = split_floor_us(o, c, fp8, &splits, each);
                    if (!isnan(v[15]) && !isnan(v[16]) && !isnan(v[17])) {
                        int n = snprintf(floor_line, sizeof floor_line,
                                         "#   %s chain floor's fastest shape (slots a block x threads a row): plain "
                                         "%dx%d, with PDL %dx%d; split floor by split count (us):",
                                         name, kFloorShapes[sh[0]][0], kFloorShapes[sh[0]][1],
                                         kFloorShapes[sh[1]][0], kFloorShapes[sh[1]][1]);
                        for (int i = 0; i < kNumSplitCounts && !isnan(each[i]); i++)
                            n += snprintf(floor_line + n, sizeof floor_line - n, " %d %.2f%s", kSplitCounts[i],
                                          each[i], kSplitCounts[i] == splits ? "*" : "");
                        snprintf(floor_line + n, sizeof floor_line - n, "\n");
                    }
                    if (isnan(v[15]) || isnan(v[16]) || isnan(v[17])) {
                        fprintf(stderr, "mlart-bench attn: %s: chain or split floor timing failed\n", name);
                        wrong++;
                    } else if (c->T >= 8) {
                        chain_mem_ratio[0] = fmax(chain_mem_ratio[0], v[15] / (bytes / (o->copy_gbs * 1e3)));
                        chain_mem_ratio[1] = fmax(chain_mem_ratio[1], v[16] / (bytes / (o->copy_gbs * 1e3)));
                        split_mem_ratio = fmax(split_mem_ratio, v[17] / (bytes / (o->copy_gbs * 1e3)));
                    } else {
                        chain_small_us[0] = fmax(chain_small_us[0], v[15]);
                        chain_small_us[1] = fmax(chain_small_us[1], v[16]);
                        split_small_us = fmax(split_small_us, v[17]);
                    }
                }
                mlart_bench_table_row(o, &t, name, v);
                if (kvw_line[0])
                    fputs(kvw_line, stdout);
                if (floor_line[0])
                    fputs(floor_line, stdout);
                if (c->g.heads <= 16 && c->T >= 8) {
                    worst_mem_ratio = fmax(worst_mem_ratio, v[0] / (bytes / (o->copy_gbs * 1e3)));
                    worst_layer_mem = fmax(worst_layer_mem, v[9] / (bytes / (o->copy_gbs * 1e3)));
                }
                if (c->g.heads <= 16 && c->T < 8) {
                    worst_small_us = fmax(worst_small_us, v[0]);
                    worst_layer_small = fmax(worst_layer_small, v[9]);
                }
                if (c->g.heads == 128 && !models[m].apart && fmts[f] == MLART_KV_FP8_DS_MLA && c->T == 64)
                    h128_fp8_t64 = v[2];
                free_sets(*c);
            }
            c->vt->destroy(c->state);
            cudaFree(c->ws);
            free(c);
        }
        cudaFree(kv);
        cudaFree(kvw_src);
        cudaFree(kvw_slots);
    }
    b12x_attend_teardown(&dev);
    if (variants) {
        const int rc = bench_attn_variants(o);
        wrong += rc < 0 ? 1 : rc;
    }
    if (partial) {
        const int rc = bench_attn_choice(o, kPartGrid, &kPartTable), rt = bench_attn_choice(o, kTileGrid, &kTileTable);
        wrong += (rc < 0 ? 1 : rc) + (rt < 0 ? 1 : rt);
    }
    {
        const int rs = bench_attn_short(o);
        wrong += rs < 0 ? 1 : rs;
    }
    char bare[160] = "";
    if (kvw)
        snprintf(bare, sizeof bare, "; without the KV write %.1f / %.1f us (apart: %.1f / %.1f us)", bare_sum[0],
                 bare_sum[1], bare_sum[2], bare_sum[3]);
    snprintf(line, sizeof line,
             "attn targets: 16 heads T>=8 worst time/bandwidth-floor %.2fx (target <= 2: %s); 16 heads T<8 "
             "worst %.2f us (target < 5: %s); 128 heads fp8 T=64 %.1f TFLOP/s (target >= 250: %s); in a layer "
             "step (after the absorption): 16 heads T>=8 worst %.2fx, T<8 worst %.2f us; with the in-place "
             "combine (opt-in, where it runs; 0 = no such row): 16 heads T>=8 worst %.2fx, T<8 worst %.2f us; "
             "V up-projection after attend(), summed over the rows: plain %.1f us, as the layer launches it %.1f us; "
             "whole layer step%s summed over the rows: %.1f us, with early_weights %.1f us (GLM5-TP2DCP4 rows "
             "summed apart: %.1f / %.1f us)%s",
             worst_mem_ratio, worst_mem_ratio == 0 ? "n/a" : worst_mem_ratio <= 2 ? "met" : "MISSED",
             worst_small_us, worst_small_us == 0 ? "n/a" : worst_small_us < 5 ? "met" : "MISSED", h128_fp8_t64,
             isnan(h128_fp8_t64) ? "n/a" : h128_fp8_t64 >= 250 ? "met" : "MISSED", worst_layer_mem,
             worst_layer_small, ip_mem_ratio, ip_small_us, step_plain_sum, step_pdl_sum,
             kvw ? " (KV write of T rows, absorption, attend, V up-projection)" : " without the KV write", whole_sum,
             early_sum, apart_whole, apart_early, bare);
    if (chain_small_us[0] > 0 || chain_mem_ratio[0] > 0) {
        const size_t used = strlen(line);
        snprintf(line + used, sizeof line - used,
                 "; chain floor (the loads alone: indices, block table, rows; plain / with PDL): 16 heads T>=8 "
                 "worst %.2fx / %.2fx the bandwidth floor, T<8 worst %.2f / %.2f us",
                 chain_mem_ratio[0], chain_mem_ratio[1], chain_small_us[0], chain_small_us[1]);
    }
    if (split_small_us > 0 || split_mem_ratio > 0) {
        const size_t used = strlen(line);
        snprintf(line + used, sizeof line - used,
                 "; split floor (the loads, a bf16 partial a chunk, the combine; PDL): 16 heads T>=8 worst %.2fx "
                 "the bandwidth floor, T<8 worst %.2f us",
                 split_mem_ratio, split_small_us);
    }
    mlart_bench_summary(o, t.title, line);
    return wrong;
}
