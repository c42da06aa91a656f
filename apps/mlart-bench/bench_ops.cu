/* Suite "ops": the query absorption and the V up-projection against cuBLAS
 * strided-batched GEMM on the same views, measured in the same run:
 *   cublas    CUBLAS_COMPUTE_32F on the strided q_nope view
 *   pedantic  CUBLAS_COMPUTE_32F_PEDANTIC on the same view
 *   copy+cb   cudaMemcpy2DAsync of q_nope into a dense [T,H,P] buffer, then cublas
 *   fused     our op writing q_mqa and copying q_pe in one launch, against
 *             cublas into q_mqa plus a cudaMemcpy2DAsync of q_pe
 *   pdl       our op launched with programmatic dependent launch
 *             (mlart_bmm_config.pdl): its weight loads start before it
 *             waits for the previous kernel, and in a rotation of our own
 *             launches (each lets the next start once past its wait) it
 *             overlaps its predecessor
 *   floor     the fastest of five kernels that only move the op's unique
 *             bytes (move_kernel, bulk_move_kernel), in the same rotation;
 *             cb/floor (cublas / floor) bounds the speedup over cuBLAS that
 *             a plainly launched kernel can show if it moves the bytes no
 *             faster than they do; the summary gives the bounds that
 *             follow for the targets
 * The "after a producer" table measures what a decode step sees instead:
 * each launch follows a kernel that rewrites the query (as the projection
 * producing it would; it does not let dependents start early), and an op's
 * cost is time(producer + op) - time(producer), for ours and every peer
 * alike.
 * Unique bytes: weights + activation in + result out (docs/ops.md). */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"
#include "ops/bmm_cuda.h"
#include "ops/numerics.h"
#include "ops/ops.h"
#include "runtime/cuda_async.h"

namespace {

const int64_t kL = 512, kR = 64;

struct Set {
    __nv_bfloat16 *a;  /* query: q [T,H,P+R]; v_up: x [H,T,L] */
    __nv_bfloat16 *w;  /* [H,K,N] */
    __nv_bfloat16 *c;  /* query: q_mqa [T,H,L+R]; v_up: o [T,H*V] */
    __nv_bfloat16 *ac; /* query: dense copy of q_nope [T,H,P] */
};

struct Ctx {
    int vup;
    int64_t H, T, K, N; /* query: K=P, N=L; v_up: K=L, N=V */
    int nsets;
    Set *sets;
    cublasHandle_t hb;
    cublasComputeType_t ct;
    int pe;                 /* fused q_pe copy */
    const mlart_bmm_config *cfg; /* NULL: public entry */
    int method;
    int pdl;      /* ours: launched with programmatic dependent launch */
    int producer; /* each launch follows producer_kernel on its set */
    int sms;      /* multiprocessors: bulk_move_kernel's grid */
    int item;     /* M_ITEM: index into kItems */
};

enum {
    M_OURS,
    M_CUBLAS,
    M_COPY_CUBLAS,
    M_CUBLAS_CONCAT,
    M_READ_W,
    M_EMPTY,
    M_NOTHING,
    M_MOVE2,
    M_MOVE4,
    M_MOVE8,
    M_MOVE16,
    M_MOVE_BULK,
    M_ITEM /* item_read_kernel: Ctx.item picks the pattern */
};

/* The producer of the "after a producer" table: rewrites the set's query
 * [T,H,P+R] in place (16 bytes a thread, grid-stride), as a projection
 * writing q would, without triggering its dependents early. */
__global__ void producer_kernel(uint4 *q, size_t n)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v = q[i];
        q[i] = v;
    }
}

/* Floors for the variants table, in the same graphs: a kernel that only
 * reads the weights once (16-byte loads, four in flight per thread, all
 * issued at once) and an empty kernel. */
__global__ void read_w_kernel(const uint4 *__restrict__ w, size_t n, unsigned *sink)
{
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    uint4 v[4];
    unsigned x = 0;
#pragma unroll
    for (int u = 0; u < 4; u++)
        v[u] = i + u * stride < n ? w[i + u * stride] : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < 4; u++)
        x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    if (x == 0x9E3779B9u) /* data-dependent: the loads stay */
        *sink = x;
}

__global__ void empty_kernel() {}

/* The floor column of the decode table: kernels that move the op's unique
 * bytes and do nothing else.  move_kernel reads the weights (U 16-byte
 * loads a thread, all issued at once) and the activation rows of the
 * strided view, then writes the result rows of the output view (values
 * from its loads); bulk_move_kernel reads the weights with the copy
 * engine's bulk copies instead.  The fastest of U = 2, 4, 8, 16 and the
 * bulk copies is the column. */
template <int U>
__global__ void move_kernel(const uint4 *__restrict__ w, size_t nw, const uint4 *__restrict__ a, size_t rows,
                            int a_pieces, size_t a_stride, uint4 *c, int c_pieces, size_t c_stride)
{
    const size_t stride = (size_t)gridDim.x * blockDim.x, tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    uint4 v[U];
    unsigned x = 0;
#pragma unroll
    for (int u = 0; u < U; u++)
        v[u] = tid + u * stride < nw ? __ldg(w + tid + u * stride) : make_uint4(0, 0, 0, 0);
    for (size_t i = tid; i < rows * a_pieces; i += stride) {
        const uint4 q = __ldg(a + i / a_pieces * a_stride + i % a_pieces);
        x ^= q.x ^ q.y ^ q.z ^ q.w;
    }
#pragma unroll
    for (int u = 0; u < U; u++)
        x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    for (size_t i = tid; i < rows * c_pieces; i += stride)
        c[i / c_pieces * c_stride + i % c_pieces] = make_uint4(x, x, x, x);
}

/* One block a multiprocessor; thread 0 moves the block's share of the
 * weights (whole 16-byte pieces) into shared memory with bulk copies of
 * kBulkChunk bytes, kBulkStages in flight (each stage reused once its copy
 * has landed), while the block's threads read their share of the
 * activation rows; then every thread writes its share of the result rows
 * with values from both. */
constexpr int kBulkChunk = 16384, kBulkStages = 12;

__global__ void __launch_bounds__(256) bulk_move_kernel(const char *w, size_t wbytes, size_t share, const uint4 *a,
                                                        size_t rows, int a_pieces, size_t a_stride, uint4 *c,
                                                        int c_pieces, size_t c_stride)
{
    extern __shared__ __align__(128) unsigned char stage[];
    __shared__ __align__(8) unsigned long long bar[kBulkStages];
    const size_t begin = (size_t)blockIdx.x * share, end = begin + share < wbytes ? begin + share : wbytes;
    const int chunks = begin < end ? (int)((end - begin + kBulkChunk - 1) / kBulkChunk) : 0;
    const uint32_t bar0 = (uint32_t)__cvta_generic_to_shared(bar), st0 = (uint32_t)__cvta_generic_to_shared(stage);
    if (threadIdx.x == 0) {
        for (int s = 0; s < kBulkStages; s++)
            mlart_sm90::mbar_init(bar0 + 8 * s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (int i = 0; i < chunks; i++) {
            const int s = i % kBulkStages;
            const size_t off = begin + (size_t)i * kBulkChunk;
            const uint32_t len = (uint32_t)(end - off < (size_t)kBulkChunk ? end - off : kBulkChunk);
            if (i >= kBulkStages)
                mlart_sm90::mbar_wait(bar0 + 8 * s, (uint32_t)(i / kBulkStages - 1) & 1);
            mlart_sm90::mbar_expect_tx(bar0 + 8 * s, len);
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         ::"r"(st0 + s * kBulkChunk), "l"(w + off), "r"(len), "r"(bar0 + 8 * s)
                         : "memory");
        }
        for (int i = chunks > kBulkStages ? chunks - kBulkStages : 0; i < chunks; i++)
            mlart_sm90::mbar_wait(bar0 + 8 * (i % kBulkStages), (uint32_t)(i / kBulkStages) & 1);
    }
    const size_t stride = (size_t)gridDim.x * blockDim.x, tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned x = 0;
    for (size_t i = tid; i < rows * a_pieces; i += stride) {
        const uint4 q = __ldg(a + i / a_pieces * a_stride + i % a_pieces);
        x ^= q.x ^ q.y ^ q.z ^ q.w;
    }
    __syncthreads();
    x ^= ((const unsigned *)stage)[threadIdx.x];
    for (size_t i = tid; i < rows * c_pieces; i += stride)
        c[i / c_pieces * c_stride + i % c_pieces] = make_uint4(x, x, x, x);
}

unsigned *g_sink;

/* Weights-only floors in the access pattern of an item decomposition
 * (variants table): one block of 256 threads per item of `rows` weight
 * rows x `cols` columns of one head, every 16-byte piece of it issued at
 * once, into shared memory (cp.async) or into registers (PER pieces a
 * thread).  Items run column slice fastest, then row slice, then head.
 * Against `floor read W` (the weights in address order, several waves)
 * they show what the pattern alone costs. */
struct ItemPattern {
    const char *name;
    int rows; /* 0: all K rows; < 0: K / -rows */
    int cols;
    int ldg;
};
const ItemPattern kItems[] = {{"cols64 smem", 0, 64, 0},    {"cols64 regs", 0, 64, 1},   {"cols256 smem", 0, 256, 0},
                              {"rows K/8 smem", -8, 512, 0}, {"rows K/8 regs", -8, 512, 1}, {"rows64 smem", 64, 512, 0}};

template <int PER, bool LDG>
__global__ void __launch_bounds__(256) item_read_kernel(const uint4 *__restrict__ w, int K, int N, int rows, int cols,
                                                        unsigned *sink)
{
    extern __shared__ __align__(16) uint4 item_smem[];
    const int nb = N / cols, kb = K / rows;
    const int h = blockIdx.x / (nb * kb), r = blockIdx.x % (nb * kb), k0 = r / nb * rows, n0 = r % nb * cols;
    const int pr = cols / 8; /* pieces a row */
    const uint4 *base = w + ((size_t)h * K * N + (size_t)k0 * N + n0) / 8;
    unsigned x = 0;
    if (LDG) {
        uint4 v[PER];
#pragma unroll
        for (int u = 0; u < PER; u++) {
            const int p = threadIdx.x + 256 * u;
            v[u] = __ldg(base + (size_t)(p / pr) * (N / 8) + p % pr);
        }
#pragma unroll
        for (int u = 0; u < PER; u++)
            x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    } else {
#pragma unroll
        for (int u = 0; u < PER; u++) {
            const int p = threadIdx.x + 256 * u;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(
                             (uint32_t)__cvta_generic_to_shared(item_smem + p)),
                         "l"(base + (size_t)(p / pr) * (N / 8) + p % pr)
                         : "memory");
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
        __syncthreads();
        const uint4 q = item_smem[(threadIdx.x * 7) % (256 * PER)];
        x = q.x ^ q.w;
    }
    if (x == 0x9E3779B9u) /* data-dependent: the loads stay */
        *sink = x;
}

template <int PER>
int launch_item(const uint4 *w, int K, int N, int rows, int cols, int ldg, unsigned blocks, cudaStream_t st)
{
    const size_t smem = ldg ? 0 : (size_t)rows * cols * 2;
    if (ldg)
        item_read_kernel<PER, true><<<blocks, 256, 0, st>>>(w, K, N, rows, cols, g_sink);
    else
        item_read_kernel<PER, false><<<blocks, 256, smem, st>>>(w, K, N, rows, cols, g_sink);
    return cudaGetLastError() != cudaSuccess;
}

int run_item(const Ctx &c, const Set &s, cudaStream_t st)
{
    const ItemPattern &ip = kItems[c.item];
    const int K = (int)c.K, N = (int)c.N, rows = ip.rows > 0 ? ip.rows : ip.rows < 0 ? K / -ip.rows : K;
    const int per = rows * ip.cols / 8 / 256;
    const unsigned blocks = (unsigned)(c.H * (K / rows) * (N / ip.cols));
    const uint4 *w = (const uint4 *)s.w;
    if (K % rows || N % ip.cols || per * 256 * 8 != rows * ip.cols)
        return 1;
    switch (per) {
    case 4: return launch_item<4>(w, K, N, rows, ip.cols, ip.ldg, blocks, st);
    case 6: return launch_item<6>(w, K, N, rows, ip.cols, ip.ldg, blocks, st);
    case 16: return launch_item<16>(w, K, N, rows, ip.cols, ip.ldg, blocks, st);
    case 24: return launch_item<24>(w, K, N, rows, ip.cols, ip.ldg, blocks, st);
    }
    return 1;
}

int64_t as_of(const Ctx &c) { return c.vup ? c.K : c.K + kR; }
size_t a_elems(const Ctx &c) { return (size_t)(c.T * c.H * as_of(c)); }
size_t w_elems(const Ctx &c) { return (size_t)(c.H * c.K * c.N); }
size_t c_elems(const Ctx &c) { return c.vup ? (size_t)(c.T * c.H * c.N) : (size_t)(c.T * c.H * (c.N + kR)); }


/* a [H,T,K], w [H,K,N], c [H,T,N] views of set s; pe_in/pe_out for query */
void views(const Ctx &c, const Set &s, mlart_tensor *a, mlart_tensor *w, mlart_tensor *o, mlart_tensor *pi,
           mlart_tensor *po)
{
    const size_t ab = a_elems(c) * 2, wb = w_elems(c) * 2, cb = c_elems(c) * 2;
    *w = mlart_bench_view3(s.w, s.w, wb, c.H, c.K, c.N, c.K * c.N, c.N);
    if (c.vup) {
        *a = mlart_bench_view3(s.a, s.a, ab, c.H, c.T, c.K, c.T * c.K, c.K);
        *o = mlart_bench_view3(s.c, s.c, cb, c.H, c.T, c.N, c.N, c.H * c.N);
        return;
    }
    const int64_t AS = c.K + kR, CS = c.N + kR;
    *a = mlart_bench_view3(s.a, s.a, ab, c.H, c.T, c.K, AS, c.H * AS);
    *o = mlart_bench_view3(s.c, s.c, cb, c.H, c.T, c.N, CS, c.H * CS);
    *pi = mlart_bench_view3(s.a + c.K, s.a, ab, c.T, c.H, kR, c.H * AS, AS);
    *po = mlart_bench_view3(s.c + c.N, s.c, cb, c.T, c.H, kR, c.H * CS, CS);
}

int run_ours(const Ctx &c, const Set &s, cudaStream_t st)
{
    mlart_tensor a, w, o, pi, po;
    static const mlart_bmm_config pdl_cfg = {MLART_BMM_AUTO, 0, 0, 0, 0, 0, 1};
    views(c, s, &a, &w, &o, &pi, &po);
    if (c.cfg || c.pdl) {
        mlart_bmm_desc d;
        memset(&d, 0, sizeof d);
        d.H = c.H;
        d.T = c.T;
        d.K = c.K;
        d.N = c.N;
        d.a = a.data;
        d.a_sh = a.stride[0];
        d.a_st = a.stride[1];
        d.w = w.data;
        d.w_sh = w.stride[0];
        d.w_sk = w.stride[1];
        d.c = o.data;
        d.c_sh = o.stride[0];
        d.c_st = o.stride[1];
        return mlart_bmm_cuda_run(&d, c.cfg ? c.cfg : &pdl_cfg, st);
    }
    if (c.vup)
        return mlart_v_up_bmm_cuda(&a, &w, &o, st);
    return mlart_query_bmm_cuda(&a, &w, &o, c.pe ? &pi : NULL, c.pe ? &po : NULL, st);
}

/* cuBLAS column-major: C^T[N x T] = W^T[N x K] * A^T[K x T] per head. */
int run_cublas(const Ctx &c, const __nv_bfloat16 *a, int64_t lda_t, int64_t stride_h, const Set &s,
               cudaStream_t st)
{
    const float alpha = 1.f, beta = 0.f;
    const int64_t ldc = c.vup ? c.H * c.N : c.H * (c.N + kR), sc = c.vup ? c.N : c.N + kR;
    if (cublasSetStream(c.hb, st) != CUBLAS_STATUS_SUCCESS)
        return 1;
    return cublasGemmStridedBatchedEx(c.hb, CUBLAS_OP_N, CUBLAS_OP_N, (int)c.N, (int)c.T, (int)c.K, &alpha, s.w,
                                      CUDA_R_16BF, (int)c.N, c.K * c.N, a, CUDA_R_16BF, (int)lda_t, stride_h, &beta,
                                      s.c, CUDA_R_16BF, (int)ldc, sc, (int)c.H, c.ct, CUBLAS_GEMM_DEFAULT) !=
           CUBLAS_STATUS_SUCCESS;
}

int enqueue(void *vctx, int set, cudaStream_t st)
{
    const Ctx &c = *(const Ctx *)vctx;
    const Set &s = c.sets[set];
    const int64_t AS = as_of(c);
    if (c.producer) {
        const size_t n = a_elems(c) * 2 / 16;
        const unsigned blocks = (unsigned)((n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024);
        producer_kernel<<<blocks, 256, 0, st>>>((uint4 *)s.a, n);
        if (cudaGetLastError() != cudaSuccess)
            return 1;
    }
    switch (c.method) {
    case M_NOTHING:
        return 0;
    case M_OURS:
        return run_ours(c, s, st);
    case M_CUBLAS:
        return c.vup ? run_cublas(c, s.a, c.K, c.T * c.K, s, st) : run_cublas(c, s.a, c.H * AS, AS, s, st);
    case M_COPY_CUBLAS:
        if (cudaMemcpy2DAsync(s.ac, (size_t)c.K * 2, s.a, (size_t)AS * 2, (size_t)c.K * 2, (size_t)(c.T * c.H),
                              cudaMemcpyDeviceToDevice, st) != cudaSuccess)
            return 1;
        return run_cublas(c, s.ac, c.H * c.K, c.K, s, st);
    case M_READ_W: {
        const size_t n = w_elems(c) * 2 / 16;
        const unsigned blocks = (unsigned)((n + 4 * 256 - 1) / (4 * 256));
        read_w_kernel<<<blocks, 256, 0, st>>>((const uint4 *)s.w, n, g_sink);
        return cudaGetLastError() != cudaSuccess;
    }
    case M_ITEM:
        return run_item(c, s, st);
    case M_EMPTY:
        empty_kernel<<<1, 32, 0, st>>>();
        return cudaGetLastError() != cudaSuccess;
    case M_MOVE2:
    case M_MOVE4:
    case M_MOVE8:
    case M_MOVE16:
    case M_MOVE_BULK: {
        /* the query's views only: a [T,H,P] in q [T,H,P+R], c [T,H,N] in q_mqa [T,H,N+R] */
        const int u = c.method == M_MOVE2 ? 2 : c.method == M_MOVE4 ? 4 : c.method == M_MOVE8 ? 8 : 16;
        const size_t n = w_elems(c) * 2 / 16, rows = (size_t)(c.T * c.H);
        const unsigned blocks = (unsigned)((n + (size_t)u * 256 - 1) / ((size_t)u * 256));
        const uint4 *w = (const uint4 *)s.w, *a = (const uint4 *)s.a;
        uint4 *o = (uint4 *)s.c;
        const int ap = (int)(c.K / 8), cp = (int)(c.N / 8);
        const size_t as = (size_t)(AS / 8), cs = (size_t)((c.N + kR) / 8);
        if (c.method == M_MOVE_BULK) {
            const size_t share = (n + c.sms - 1) / c.sms * 16;
            bulk_move_kernel<<<c.sms, 256, (size_t)kBulkChunk * kBulkStages, st>>>((const char *)s.w, n * 16, share, a,
                                                                                 rows, ap, as, o, cp, cs);
        } else if (u == 2) {
            move_kernel<2><<<blocks, 256, 0, st>>>(w, n, a, rows, ap, as, o, cp, cs);
        } else if (u == 4) {
            move_kernel<4><<<blocks, 256, 0, st>>>(w, n, a, rows, ap, as, o, cp, cs);
        } else if (u == 8) {
            move_kernel<8><<<blocks, 256, 0, st>>>(w, n, a, rows, ap, as, o, cp, cs);
        } else {
            move_kernel<16><<<blocks, 256, 0, st>>>(w, n, a, rows, ap, as, o, cp, cs);
        }
        return cudaGetLastError() != cudaSuccess;
    }
    case M_CUBLAS_CONCAT:
        if (run_cublas(c, s.a, c.H * AS, AS, s, st))
            return 1;
        return cudaMemcpy2DAsync(s.c + c.N, (size_t)(c.N + kR) * 2, s.a + c.K, (size_t)AS * 2, (size_t)kR * 2,
                                 (size_t)(c.T * c.H), cudaMemcpyDeviceToDevice, st) != cudaSuccess;
    }
    return 1;
}

int alloc_sets(Ctx &c, const mlart_bench_opts *o)
{
    const size_t per = (a_elems(c) + w_elems(c) + c_elems(c)) * 2;
    c.nsets = mlart_bench_sets(o, per, c.T >= 256 ? 2 : 8);
    c.sets = (Set *)calloc((size_t)c.nsets, sizeof(Set));
    if (!c.sets)
        return -1;
    for (int i = 0; i < c.nsets; i++) {
        Set &s = c.sets[i];
        if (cudaMalloc(&s.a, a_elems(c) * 2) || cudaMalloc(&s.w, w_elems(c) * 2) || cudaMalloc(&s.c, c_elems(c) * 2))
            return -1;
        if (!c.vup && cudaMalloc(&s.ac, (size_t)(c.T * c.H * c.K) * 2))
            return -1;
        if (mlart_bench_fill_bf16(s.a, a_elems(c), 3 * i + 1, 0) || mlart_bench_fill_bf16(s.w, w_elems(c), 3 * i + 2, 0) ||
            mlart_bench_fill_bf16(s.c, c_elems(c), 3 * i + 3, 0))
            return -1;
    }
    return cudaDeviceSynchronize() == cudaSuccess ? 0 : -1;
}

void free_sets(Ctx &c)
{
    for (int i = 0; c.sets && i < c.nsets; i++) {
        cudaFree(c.sets[i].a);
        cudaFree(c.sets[i].w);
        cudaFree(c.sets[i].c);
        cudaFree(c.sets[i].ac);
    }
    free(c.sets);
    c.sets = NULL;
}

double time_method(Ctx &c, const mlart_bench_opts *o, int method, cublasComputeType_t ct, int pe)
{
    double us = NAN;
    c.method = method;
    c.ct = ct;
    c.pe = pe;
    if (mlart_bench_time(o, enqueue, &c, c.nsets, &us))
        return NAN;
    return us;
}

/* Our result against cuBLAS COMPUTE_32F on set 0 (first rows): max |diff| /
 * max |cublas|.  Both round one FP32 sum to bf16, so they differ by at most
 * about one bf16 step of the largest values. */
double check_vs_cublas(Ctx &c, const mlart_bench_opts *o)
{
    const size_t n = c_elems(c) < ((size_t)1 << 22) ? c_elems(c) : ((size_t)1 << 22);
    uint16_t *h1 = (uint16_t *)malloc(n * 2), *h2 = (uint16_t *)malloc(n * 2);
    double md = 0, mx = 0;
    (void)o;
    if (!h1 || !h2)
        goto fail;
    c.method = M_OURS;
    c.pe = 0;
    /* poison the output first (0xffff is a bf16 NaN): the timings before
     * left cuBLAS's result in it, which an op that skips writes would pass */
    if (cudaMemset(c.sets[0].c, 0xff, c_elems(c) * 2) || enqueue(&c, 0, 0) || cudaDeviceSynchronize() || cudaMemcpy(h1, c.sets[0].c, n * 2, cudaMemcpyDeviceToHost))
        goto fail;
    c.method = M_CUBLAS;
    c.ct = CUBLAS_COMPUTE_32F;
    if (cudaMemset(c.sets[0].c, 0xff, c_elems(c) * 2) || enqueue(&c, 0, 0) || cudaDeviceSynchronize() || cudaMemcpy(h2, c.sets[0].c, n * 2, cudaMemcpyDeviceToHost))
        goto fail;
    for (size_t i = 0; i < n; i++) {
        const int64_t row = c.vup ? c.H * c.N : c.N + kR;
        if ((int64_t)(i % (size_t)row) >= (c.vup ? row : c.N))
            continue; /* q_pe columns: not written by either */
        double x = mlart_bf16_to_f32(h1[i]), y = mlart_bf16_to_f32(h2[i]);
        if (isnan(x) || isnan(y)) {
            md = INFINITY;
            break;
        }
        md = fmax(md, fabs(x - y));
        mx = fmax(mx, fabs(y));
    }
    free(h1);
    free(h2);
    return md / (mx > 0 ? mx : 1);
fail:
    free(h1);
    free(h2);
    return INFINITY;
}

const double kTolerance = 1.0 / 128; /* two bf16 steps relative to the largest value */

double geomean(const double *v, int n)
{
    double s = 0;
    int k = 0;
    for (int i = 0; i < n; i++)
        if (v[i] > 0 && isfinite(v[i])) {
            s += log(v[i]);
            k++;
        }
    return k ? exp(s / k) : NAN;
}

const int64_t kDecH[] = {16, 32, 64, 128};
const int64_t kDecT[] = {1, 4, 16, 64};

/* Targets of the decode grid (issue 3) over n shapes: x_* speedups per
 * shape, bw the unique-bytes GB/s of H = 128, T <= 16 shapes (NAN: none). */
void decode_summary(const mlart_bench_opts *o, const char *table, const char *what, const double *x_cb,
                    const double *x_ped, const double *x_cc, int n, double min_bw128, const char *extra)
{
    char line[1280];
    double min_cb = INFINITY, min_cc = INFINITY;
    for (int i = 0; i < n; i++) {
        min_cb = fmin(min_cb, x_cb[i]);
        min_cc = fmin(min_cc, x_cc[i]);
    }
    const double g_cb = geomean(x_cb, n), g_ped = geomean(x_ped, n), g_cc = geomean(x_cc, n);
    snprintf(line, sizeof line,
             "%s, %d shapes: geomean speedup vs cublas %.2fx (target >= 1.3: %s), vs pedantic %.2fx "
             "(>= 2: %s), vs copy+cublas %.2fx; min vs cublas %.3fx (>= 1: %s), min vs copy+cublas %.2fx (>= 1.5: %s); "
             "H=128 T<=16 min %.0f GB/s (>= 3000: %s)%s",
             what, n, g_cb, g_cb >= 1.3 ? "met" : "MISSED", g_ped, g_ped >= 2 ? "met" : "MISSED", g_cc, min_cb,
             min_cb >= 1 ? "met" : "MISSED", min_cc, min_cc >= 1.5 ? "met" : "MISSED", min_bw128,
             isinf(min_bw128) ? "n/a" : min_bw128 >= 3000 ? "met" : "MISSED", extra);
    mlart_bench_summary(o, table, line);
}

int bench_query_decode(const mlart_bench_opts *o, cublasHandle_t hb)
{
    static const mlart_bench_col cols[] = {
        {"time", "us", 8, 2},      {"GB/s", "unique", 8, 0},  {"%copy", "%", 6, 1},     {"cublas", "us", 8, 2},
        {"pedantic", "us", 9, 2},  {"copy+cb", "us", 8, 2},   {"x_cublas", "x", 8, 2},  {"x_pedant", "x", 8, 2},
        {"x_copycb", "x", 8, 2},   {"fused", "us", 8, 2},     {"cb+cat", "us", 8, 2},   {"x_fused", "x", 7, 2},
        {"err", "rel", 8, 5},      {"pdl", "us", 8, 2},       {"x_cb_pdl", "x", 8, 2},  {"floor", "us", 8, 2},
        {"cb/floor", "x", 8, 2}};
    const mlart_bench_table t = {"query_bmm decode: q_nope[H,T,P] view x W_UK_T[H,P,L] -> q_mqa[T,H,L+R], L=512 R=64",
                                 "shape", 20, cols, (int)(sizeof cols / sizeof cols[0])};
    static const mlart_bench_col pcols[] = {
        {"producer", "us", 8, 2}, {"ours", "+us", 8, 2},    {"pdl", "+us", 8, 2},    {"cublas", "+us", 8, 2},
        {"pedantic", "+us", 9, 2}, {"copy+cb", "+us", 8, 2}, {"GB/s", "unique", 8, 0}, {"x_cublas", "x", 8, 2},
        {"x_pedant", "x", 8, 2},   {"x_copycb", "x", 8, 2},  {"x_cb_pdl", "x", 8, 2}};
    const mlart_bench_table pt = {"query_bmm decode after a producer kernel: op time = time(producer + op) - "
                                  "time(producer)",
                                  "shape", 20, pcols, (int)(sizeof pcols / sizeof pcols[0])};
    enum { NMAX = 64 };
    static double prow[NMAX][11];
    static char pname[NMAX][64];
    double xs_cb[NMAX], xs_ped[NMAX], xs_cc[NMAX], xs_f[NMAX], xs_pdl[NMAX];
    /* bounds from the floor column: cublas / floor, copy+cublas / floor,
     * ours / floor; unique bytes / floor at H = 128, T <= 16 */
    double fx_cb[NMAX], fx_cc[NMAX], fx_ours[NMAX], fmin_bw128 = INFINITY;
    int floor_of[5] = {0, 0, 0, 0, 0}; /* shapes whose floor each move kernel set (U 2..16, bulk) */
    double px_cb[NMAX], px_ped[NMAX], px_cc[NMAX], px_pdl[NMAX];
    double min_bw128 = INFINITY, pmin_bw128 = INFINITY;
    int n = 0, wrong = 0;
    char extra[512];
    if (cudaFuncSetAttribute(bulk_move_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             kBulkChunk * kBulkStages) != cudaSuccess) {
        fprintf(stderr, "mlart-bench: bulk_move_kernel: shared memory attribute refused\n");
        return -1;
    }
    mlart_bench_table_head(o, &t);
    for (int p = 0; p < 2; p++)
        for (int ih = 0; ih < 4; ih++)
            for (int it = 0; it < 4; it++) {
                Ctx c;
                char name[64];
                memset(&c, 0, sizeof c);
                c.H = kDecH[ih];
                c.T = kDecT[it];
                c.K = p ? 192 : 128;
                c.N = kL;
                c.hb = hb;
                c.sms = o->sms;
                snprintf(name, sizeof name, "qbmm H%lld T%lld P%lld", (long long)c.H, (long long)c.T, (long long)c.K);
                if (!mlart_bench_match(o, name) || n >= NMAX)
                    continue;
                if (alloc_sets(c, o)) {
                    fprintf(stderr, "mlart-bench: %s: allocation failed\n", name);
                    free_sets(c);
                    return -1;
                }
                double v[17];
                const double bytes = (double)(c.H * c.K * c.N + c.H * c.T * c.K + c.H * c.T * c.N) * 2;
                v[0] = time_method(c, o, M_OURS, CUBLAS_COMPUTE_32F, 0);
                v[1] = bytes / (v[0] * 1e3);
                v[2] = 100.0 * v[1] / o->copy_gbs;
                v[3] = time_method(c, o, M_CUBLAS, CUBLAS_COMPUTE_32F, 0);
                v[4] = time_method(c, o, M_CUBLAS, CUBLAS_COMPUTE_32F_PEDANTIC, 0);
                v[5] = time_method(c, o, M_COPY_CUBLAS, CUBLAS_COMPUTE_32F, 0);
                v[6] = v[3] / v[0];
                v[7] = v[4] / v[0];
                v[8] = v[5] / v[0];
                v[9] = time_method(c, o, M_OURS, CUBLAS_COMPUTE_32F, 1);
                v[10] = time_method(c, o, M_CUBLAS_CONCAT, CUBLAS_COMPUTE_32F, 0);
                v[11] = v[10] / v[9];
                v[12] = check_vs_cublas(c, o);
                c.pdl = 1;
                v[13] = time_method(c, o, M_OURS, CUBLAS_COMPUTE_32F, 0);
                c.pdl = 0;
                v[14] = v[3] / v[13];
                v[15] = INFINITY;
                int best = 0;
                for (int m = M_MOVE2; m <= M_MOVE_BULK; m++) {
                    const double us = time_method(c, o, m, CUBLAS_COMPUTE_32F, 0);
                    if (us < v[15]) {
                        v[15] = us;
                        best = m - M_MOVE2;
                    }
                }
                if (isinf(v[15]))
                    v[15] = NAN; /* no move kernel could be timed */
                else
                    floor_of[best]++;
                v[16] = v[3] / v[15];
                fx_cb[n] = v[16];
                fx_cc[n] = v[5] / v[15];
                fx_ours[n] = v[0] / v[15];
                if (c.H == 128 && c.T <= 16)
                    fmin_bw128 = fmin(fmin_bw128, bytes / (v[15] * 1e3));
                wrong += !(v[12] <= kTolerance);
                /* a candidate that could not be timed would drop out of the geomean and min silently */
                wrong += isnan(v[0]) || isnan(v[3]) || isnan(v[4]) || isnan(v[5]) || isnan(v[9]) || isnan(v[10]);
                mlart_bench_table_row(o, &t, name, v);
                xs_cb[n] = v[6];
                xs_ped[n] = v[7];
                xs_cc[n] = v[8];
                xs_f[n] = v[11];
                xs_pdl[n] = v[14];
                if (c.H == 128 && c.T <= 16)
                    min_bw128 = fmin(min_bw128, v[1]);

                /* the same candidates, each after the producer */
                double *r = prow[n];
                c.producer = 1;
                r[0] = time_method(c, o, M_NOTHING, CUBLAS_COMPUTE_32F, 0);
                r[1] = time_method(c, o, M_OURS, CUBLAS_COMPUTE_32F, 0) - r[0];
                c.pdl = 1;
                r[2] = time_method(c, o, M_OURS, CUBLAS_COMPUTE_32F, 0) - r[0];
                c.pdl = 0;
                r[3] = time_method(c, o, M_CUBLAS, CUBLAS_COMPUTE_32F, 0) - r[0];
                r[4] = time_method(c, o, M_CUBLAS, CUBLAS_COMPUTE_32F_PEDANTIC, 0) - r[0];
                r[5] = time_method(c, o, M_COPY_CUBLAS, CUBLAS_COMPUTE_32F, 0) - r[0];
                c.producer = 0;
                r[6] = bytes / (r[1] * 1e3);
                r[7] = r[3] / r[1];
                r[8] = r[4] / r[1];
                r[9] = r[5] / r[1];
                r[10] = r[3] / r[2];
                px_cb[n] = r[7];
                px_ped[n] = r[8];
                px_cc[n] = r[9];
                px_pdl[n] = r[10];
                if (c.H == 128 && c.T <= 16)
                    pmin_bw128 = fmin(pmin_bw128, r[6]);
                snprintf(pname[n], sizeof pname[n], "%s", name);
                n++;
                free_sets(c);
            }
    if (n) {
        double fmin_cc = INFINITY;
        int under = 0;
        for (int i = 0; i < n; i++) {
            fmin_cc = fmin(fmin_cc, fx_cc[i]);
            under += fx_cc[i] < 1.5;
        }
        snprintf(extra, sizeof extra,
                 "; fused vs cublas+concat geomean %.2fx; PDL launch: geomean vs cublas %.2fx; bounds at the floor "
                 "(a kernel that only moves the unique bytes): geomean cublas/floor %.2fx, min copy+cublas/floor "
                 "%.2fx (%d shapes under 1.5), H=128 T<=16 min %.0f GB/s; ours/floor geomean %.2fx (floor set by "
                 "U=2/4/8/16/bulk at %d/%d/%d/%d/%d shapes)",
                 geomean(xs_f, n), geomean(xs_pdl, n), geomean(fx_cb, n), fmin_cc, under, fmin_bw128,
                 geomean(fx_ours, n), floor_of[0], floor_of[1], floor_of[2], floor_of[3], floor_of[4]);
        decode_summary(o, t.title, "query_bmm decode", xs_cb, xs_ped, xs_cc, n, min_bw128, extra);
        mlart_bench_table_head(o, &pt);
        for (int i = 0; i < n; i++)
            mlart_bench_table_row(o, &pt, pname[i], prow[i]);
        snprintf(extra, sizeof extra, "; PDL launch: geomean vs cublas %.2fx", geomean(px_pdl, n));
        decode_summary(o, pt.title, "query_bmm decode after a producer", px_cb, px_ped, px_cc, n, pmin_bw128,
                       extra);
    }
    return wrong;
}

int bench_query_prefill(const mlart_bench_opts *o, cublasHandle_t hb)
{
    static const mlart_bench_col cols[] = {{"time", "us", 9, 1},    {"TFLOP/s", "", 8, 1},  {"GB/s", "unique", 8, 0},
                                           {"cublas", "us", 9, 1},  {"ratio", "ours/cb", 8, 3}, {"copy+cb", "us", 9, 1},
                                           {"err", "rel", 8, 5}};
    const mlart_bench_table t = {"query_bmm prefill-sized T (auto path: wgmma), L=512 R=64", "shape", 22, cols,
                                 (int)(sizeof cols / sizeof cols[0])};
    static const int64_t Ts[] = {256, 1024, 8192};
    static const int64_t Hs[] = {16, 128};
    double worst = 0;
    int wrong = 0, n = 0;
    char line[256];
    mlart_bench_table_head(o, &t);
    for (int p = 0; p < 2; p++)
        for (int ih = 0; ih < 2; ih++)
            for (int it = 0; it < 3; it++) {
                Ctx c;
                char name[64];
                memset(&c, 0, sizeof c);
                c.H = Hs[ih];
                c.T = Ts[it];
                c.K = p ? 192 : 128;
                c.N = kL;
                c.hb = hb;
                snprintf(name, sizeof name, "qbmm H%lld T%lld P%lld", (long long)c.H, (long long)c.T, (long long)c.K);
                if (!mlart_bench_match(o, name))
                    continue;
                if (alloc_sets(c, o)) {
                    fprintf(stderr, "mlart-bench: %s: allocation failed\n", name);
                    free_sets(c);
                    return -1;
                }
                double v[7];
                const double bytes = (double)(c.H * c.K * c.N + c.H * c.T * c.K + c.H * c.T * c.N) * 2;
                v[0] = time_method(c, o, M_OURS, CUBLAS_COMPUTE_32F, 0);
                v[1] = 2.0 * c.H * c.T * c.K * c.N / (v[0] * 1e6);
                v[2] = bytes / (v[0] * 1e3);
                v[3] = time_method(c, o, M_CUBLAS, CUBLAS_COMPUTE_32F, 0);
                v[4] = v[0] / v[3];
                v[5] = time_method(c, o, M_COPY_CUBLAS, CUBLAS_COMPUTE_32F, 0);
                v[6] = check_vs_cublas(c, o);
                wrong += !(v[6] <= kTolerance);
                worst = fmax(worst, v[4]);
                n++;
                mlart_bench_table_row(o, &t, name, v);
                free_sets(c);
            }
    if (n) {
        snprintf(line, sizeof line, "query_bmm T>=256, %d shapes: worst time ratio ours/cublas %.3f (target <= 1.25: %s)",
                 n, worst, worst <= 1.25 ? "met" : "MISSED");
        mlart_bench_summary(o, t.title, line);
    }
    return wrong;
}

int bench_vup(const mlart_bench_opts *o, cublasHandle_t hb)
{
    static const mlart_bench_col cols[] = {{"time", "us", 9, 2},     {"GB/s", "unique", 8, 0}, {"%copy", "%", 6, 1},
                                           {"cublas", "us", 9, 2},   {"pedantic", "us", 9, 2}, {"x_cublas", "x", 8, 2},
                                           {"x_pedant", "x", 8, 2},  {"err", "rel", 8, 5}};
    const mlart_bench_table t = {"v_up_bmm: out[H,T,L] x W_UV[H,L,V] -> o[T,H*V], L=512", "shape", 22, cols,
                                 (int)(sizeof cols / sizeof cols[0])};
    static const int64_t Ts[] = {1, 4, 16, 64, 256, 8192};
    double xs[64], worst_pre = 0; /* worst_pre: ours / cuBLAS at T >= 256 */
    int wrong = 0, n = 0, npre = 0;
    char line[256];
    mlart_bench_table_head(o, &t);
    for (int vv = 0; vv < 2; vv++)
        for (int ih = 0; ih < 4; ih++)
            for (int it = 0; it < 6; it++) {
                Ctx c;
                char name[64];
                memset(&c, 0, sizeof c);
                c.vup = 1;
                c.H = kDecH[ih];
                c.T = Ts[it];
                c.K = kL;
                c.N = vv ? 256 : 128;
                c.hb = hb;
                if (c.T == 8192 && c.H != 16 && c.H != 128)
                    continue;
                snprintf(name, sizeof name, "v_up H%lld T%lld V%lld", (long long)c.H, (long long)c.T, (long long)c.N);
                if (!mlart_bench_match(o, name))
                    continue;
                if (alloc_sets(c, o)) {
                    fprintf(stderr, "mlart-bench: %s: allocation failed\n", name);
                    free_sets(c);
                    return -1;
                }
                double v[8];
                const double bytes = (double)(c.H * c.K * c.N + c.H * c.T * c.K + c.H * c.T * c.N) * 2;
                v[0] = time_method(c, o, M_OURS, CUBLAS_COMPUTE_32F, 0);
                v[1] = bytes / (v[0] * 1e3);
                v[2] = 100.0 * v[1] / o->copy_gbs;
                v[3] = time_method(c, o, M_CUBLAS, CUBLAS_COMPUTE_32F, 0);
                v[4] = time_method(c, o, M_CUBLAS, CUBLAS_COMPUTE_32F_PEDANTIC, 0);
                v[5] = v[3] / v[0];
                v[6] = v[4] / v[0];
                v[7] = check_vs_cublas(c, o);
                wrong += !(v[7] <= kTolerance);
                if (c.T <= 64 && n < 64)
                    xs[n++] = v[5];
                if (c.T >= 256) {
                    worst_pre = fmax(worst_pre, v[0] / v[3]);
                    npre++;
                }
                mlart_bench_table_row(o, &t, name, v);
                free_sets(c);
            }
    if (n) {
        snprintf(line, sizeof line, "v_up_bmm decode (T<=64), %d shapes: geomean speedup vs cublas %.2fx", n,
                 geomean(xs, n));
        mlart_bench_summary(o, t.title, line);
    }
    if (npre) {
        snprintf(line, sizeof line, "v_up_bmm prefill-sized (T>=256), %d shapes: worst ours/cublas %.3f", npre,
                 worst_pre);
        mlart_bench_summary(o, t.title, line);
    }
    return wrong;
}

/* Tuning table: the query on the decode shapes with every direct-kernel
 * configuration (columns per warp, warps splitting K, column groups per
 * block, row tiles per warp), the ring and wgmma kernels' configurations,
 * the older stream and tiled kernels, and two
 * floors measured the same way (a kernel that only reads the weights, an
 * empty kernel); then the V up-projection's stream/tiled variants. */
int bench_variants(const mlart_bench_opts *o, cublasHandle_t hb)
{
    static const mlart_bench_col cols[] = {{"time", "us", 9, 2}, {"GB/s", "unique", 8, 0}, {"err", "rel", 8, 5}};
    int wrong = 0;
    const mlart_bench_table t = {"variants: floors, direct [staged a] (cols, split, groups, mt), ring (cols, stages, blocks/SM), stream (mt, warps), tiled (bm)",
                                 "shape variant", 40, cols, 3};
    static const int64_t Ts[] = {1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 1024, 8192};
    static const int64_t Hs[] = {16, 32, 64, 128};
    mlart_bench_table_head(o, &t);
    if (cudaFuncSetAttribute(item_read_kernel<16, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536) ||
        cudaFuncSetAttribute(item_read_kernel<24, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 98304))
        fprintf(stderr, "mlart-bench: item_read_kernel: shared memory attribute refused\n");
    for (int vup = 0; vup < 2; vup++)
        for (int p = 0; p < 2; p++)
            for (int ih = 0; ih < 4; ih++)
                for (int it = 0; it < (int)(sizeof Ts / sizeof Ts[0]); it++) {
                    Ctx c;
                    memset(&c, 0, sizeof c);
                    if (vup && Ts[it] > 64 && Ts[it] < 128)
                        continue;
                    c.vup = vup;
                    c.hb = hb;
                    c.H = Hs[ih];
                    c.T = Ts[it];
                    c.K = vup ? kL : (p ? 192 : 128);
                    c.N = vup ? (p ? 256 : 128) : kL;
                    char base[48];
                    snprintf(base, sizeof base, "%s H%lld T%lld %c%lld", vup ? "v_up" : "qbmm", (long long)c.H,
                             (long long)c.T, vup ? 'V' : 'P', (long long)(vup ? c.N : c.K));
                    if (!mlart_bench_match(o, base))
                        continue;
                    if (alloc_sets(c, o)) {
                        free_sets(c);
                        return -1;
                    }
                    const double bytes = (double)(c.H * c.K * c.N + c.H * c.T * c.K + c.H * c.T * c.N) * 2;
                    const int ks = (int)(c.K / 16);
                    mlart_bmm_config cfgs[96];
                    int ncfg = 0;
                    memset(cfgs, 0, sizeof cfgs);
                    cfgs[ncfg++].path = MLART_BMM_AUTO;
                    if (c.T >= 16)
                        cfgs[ncfg++] = (mlart_bmm_config){MLART_BMM_TILED, 0, 0, 64, 0, 0};
                    if (c.T >= 256)
                        cfgs[ncfg++] = (mlart_bmm_config){MLART_BMM_TILED, 0, 0, 128, 0, 0};
                    if (c.T >= 256 && !vup) { /* prefill: the staged direct kernel with many row tiles a block */
                        static const int pv[][4] = {{32, 1, 4, 4}, {32, 1, 4, 8}, {32, 1, 4, 16}, {64, 2, 2, 4},
                                                    {64, 2, 2, 8}, {32, 2, 2, 8}, {32, 2, 2, 16}, {64, 1, 4, 8}};
                        for (unsigned k = 0; k < sizeof pv / sizeof pv[0]; k++) {
                            const int kss = ks % pv[k][1] ? 0 : ks / pv[k][1];
                            if (2 * kss * pv[k][0] / 8 > 128)
                                continue;
                            cfgs[ncfg++] = (mlart_bmm_config){MLART_BMM_DIRECT, pv[k][3], pv[k][1], 1, pv[k][0], pv[k][2]};
                        }
                    }
                    if (!vup && c.T >= 64) { /* wgmma: {row chunks per (head, slice), warpgroups, columns a slice} */
                        static const int wv[][3] = {{0, 2, 256}, {1, 2, 256}, {2, 2, 256}, {0, 1, 256},
                                                    {0, 2, 128}, {0, 1, 128}, {1, 1, 128}, {4, 1, 128}};
                        for (unsigned k = 0; k < sizeof wv / sizeof wv[0]; k++)
                            cfgs[ncfg++] = (mlart_bmm_config){MLART_BMM_WGMMA, wv[k][0], wv[k][1], 0, wv[k][2], 0};
                    }
                    if (vup && c.T >= 128) { /* wgmma at K = 512: {row chunks, columns a slice} */
                        static const int wv[][2] = {{0, 128}, {0, 64}, {1, 128}, {2, 128}, {1, 64}, {2, 64}};
                        for (unsigned k = 0; k < sizeof wv / sizeof wv[0]; k++)
                            cfgs[ncfg++] = (mlart_bmm_config){MLART_BMM_WGMMA, wv[k][0], 2, 0, wv[k][1], 0};
                    }
                    if (!vup && c.T <= 256) { /* ring: {columns a slice, stages (0: as many as fit), blocks an SM} */
                        static const int rv[][3] = {{128, 0, 1}, {64, 0, 1}, {128, 2, 2}, {64, 2, 2},
                                                    {64, 3, 2}, {128, 1, 3}, {128, 1, 4}, {64, 1, 4},
                                                    {64, 2, 3}, {64, 1, 3}};
                        for (unsigned k = 0; k < sizeof rv / sizeof rv[0]; k++)
                            cfgs[ncfg++] = (mlart_bmm_config){MLART_BMM_RING, rv[k][1], 0, 0, rv[k][0], rv[k][2]};
                    }
                    if (!vup) { /* the one-item form, 64- and 128-column slices, at
                                 * every T; and launched with PDL, against the
                                 * automatic choice so */
                        cfgs[ncfg++] = (mlart_bmm_config){MLART_BMM_RING, 0, 1, 0, 64, 0};
                        cfgs[ncfg++] = (mlart_bmm_config){MLART_BMM_RING, 0, 1, 0, 128, 0};
                        if (c.K == 192 && c.T <= 16) /* K in halves, the direct kernel's sum */
                            cfgs[ncfg++] = (mlart_bmm_config){MLART_BMM_RING, 0, 2, 0, 64, 0};
                        if (c.T <= 128) {
                            cfgs[ncfg++] = (mlart_bmm_config){MLART_BMM_RING, 0, 1, 0, 64, 0, 1};
                            cfgs[ncfg++] = (mlart_bmm_config){MLART_BMM_RING, 0, 1, 0, 128, 0, 1};
                            if (c.K == 192 && c.T <= 16)
                                cfgs[ncfg++] = (mlart_bmm_config){MLART_BMM_RING, 0, 2, 0, 64, 0, 1};
                            cfgs[ncfg++] = (mlart_bmm_config){MLART_BMM_AUTO, 0, 0, 0, 0, 0, 1};
                        }
                    }
                    if (c.T <= 64) { /* swap: {columns a block, token rows a tile} */
                        static const int sv[][2] = {{256, 0},  {128, 0},  {512, 0}, {256, 16},
                                                    {128, 16}, {256, 64}, {128, 64}, {64, 64}};
                        for (unsigned k = 0; k < sizeof sv / sizeof sv[0]; k++)
                            if (sv[k][1] == 0 || (sv[k][1] == 16 && c.T < 16) || (sv[k][1] == 64 && c.T > 16))
                                cfgs[ncfg++] = (mlart_bmm_config){MLART_BMM_SWAP, sv[k][1], 0, 0, sv[k][0], 0};
                        if (!vup && c.T <= 16) /* with PDL, against the one-item form so */
                            cfgs[ncfg++] = (mlart_bmm_config){MLART_BMM_SWAP, 0, 0, 0, 256, 0, 1};
                    }
                    if (!vup && c.T <= 16) { /* slice: one and two chains of K, plainly and with PDL */
                        for (int k = 0; k < 4; k++)
                            cfgs[ncfg++] = (mlart_bmm_config){MLART_BMM_SLICE, 0, 1 + (k & 1), 0, 0, 0, k >> 1};
                    }
                    if (vup && c.T <= 16) { /* slice at K = 512: {chains, columns}, plainly and with PDL */
                        static const int lv[][2] = {{1, 64}, {2, 64}, {4, 64}, {2, 32}, {4, 32}};
                        for (int k = 0; k < 10; k++)
                            cfgs[ncfg++] = (mlart_bmm_config){MLART_BMM_SLICE, 0, lv[k % 5][0], 0, lv[k % 5][1], 0, k / 5};
                    }
                    if (c.T <= 16)
                        cfgs[ncfg++] = (mlart_bmm_config){MLART_BMM_STREAM, 1, c.H >= 64 ? 2 : 4, 0, 0, 0};
                    /* direct: {cols, split, groups, stage}; split 8 for K = 512 */
                    static const int dv[][4] = {{16, 1, 2, 0}, {32, 1, 1, 0}, {32, 1, 2, 0}, {32, 2, 1, 0},
                                                {32, 3, 1, 0}, {64, 1, 1, 0}, {64, 2, 1, 0}, {32, 8, 1, 0},
                                                {16, 1, 4, 1}, {32, 1, 2, 1}, {32, 1, 4, 1}, {32, 2, 1, 1},
                                                {32, 2, 2, 1}, {32, 3, 1, 1}, {64, 1, 2, 1}, {64, 1, 4, 1},
                                                {64, 2, 1, 1}, {64, 2, 2, 1}, {32, 8, 1, 1}, {64, 4, 1, 1},
                                                {32, 2, 4, 0}, {32, 2, 4, 1}, {64, 3, 1, 0}, {64, 3, 2, 0},
                                                {64, 3, 1, 1}};
                    for (unsigned k = 0; c.T <= 64 && k < sizeof dv / sizeof dv[0]; k++) {
                        const int cw = dv[k][0], sp = dv[k][1], gr = dv[k][2], stage = dv[k][3];
                        const int kss = ks % sp ? 0 : ks / sp;
                        if (!kss || (kss != 4 && kss != 6 && kss != 8 && kss != 12) || 2 * kss * cw / 8 > 128 ||
                            sp * gr > 8 || c.N % (cw * gr) || ncfg >= 90 || (stage && c.T < 16) ||
                            (c.T == 1 && !(sp == 3 || (cw == 16 && !stage))))
                            continue;
                        cfgs[ncfg++] = (mlart_bmm_config){MLART_BMM_DIRECT, 0, sp, stage, cw, gr};
                        if (c.T == 64 && stage)
                            cfgs[ncfg++] = (mlart_bmm_config){MLART_BMM_DIRECT, 2, sp, stage, cw, gr};
                    }
                    /* the automatic choice again, last: rows of one
                     * configuration spread by up to 0.1 us within a table
                     * (H128 T4 P192, docs/PERF.md, 2026-12-02), so a
                     * variant is faster only by more than both auto rows */
                    cfgs[ncfg++].path = MLART_BMM_AUTO;
                    for (int i = -2; i < ncfg; i++) {
                        char name[96];
                        double v[3] = {NAN, NAN, NAN};
                        if (i < 0) {
                            if (c.T != 1) /* floors depend on the weights only */
                                continue;
                            snprintf(name, sizeof name, "%s %s", base, i == -2 ? "floor empty kernel" : "floor read W");
                            v[0] = time_method(c, o, i == -2 ? M_EMPTY : M_READ_W, CUBLAS_COMPUTE_32F, 0);
                            v[1] = (double)(c.H * c.K * c.N) * 2 / (v[0] * 1e3);
                            if (!isnan(v[0]))
                                mlart_bench_table_row(o, &t, name, v);
                            for (int k = 0; i == -1 && !vup && k < (int)(sizeof kItems / sizeof kItems[0]); k++) {
                                c.item = k;
                                snprintf(name, sizeof name, "%s floor item %s", base, kItems[k].name);
                                v[0] = time_method(c, o, M_ITEM, CUBLAS_COMPUTE_32F, 0);
                                v[1] = (double)(c.H * c.K * c.N) * 2 / (v[0] * 1e3);
                                if (!isnan(v[0]))
                                    mlart_bench_table_row(o, &t, name, v);
                            }
                            continue;
                        }
                        const mlart_bmm_config *f = &cfgs[i];
                        if (f->path == MLART_BMM_AUTO && f->pdl)
                            snprintf(name, sizeof name, "%s auto pdl", base);
                        else if (f->path == MLART_BMM_AUTO)
                            snprintf(name, sizeof name, "%s auto%s", base, i ? " (again, last)" : "");
                        else if (f->path == MLART_BMM_TILED)
                            snprintf(name, sizeof name, "%s tiled bm%d", base, f->bm);
                        else if (f->path == MLART_BMM_WGMMA)
                            snprintf(name, sizeof name, "%s wgmma n%d wg%d chunks %d", base, f->cols, f->warps, f->mt);
                        else if (f->path == MLART_BMM_RING && f->warps)
                            snprintf(name, sizeof name, "%s ring one-item n%d%s%s", base, f->cols,
                                     f->warps == 2 ? " halves" : "", f->pdl ? " pdl" : "");
                        else if (f->path == MLART_BMM_RING)
                            snprintf(name, sizeof name, "%s ring n%d st%d b%d", base, f->cols, f->mt, f->groups);
                        else if (f->path == MLART_BMM_SWAP)
                            snprintf(name, sizeof name, "%s swap n%d t%d%s", base, f->cols, f->mt, f->pdl ? " pdl" : "");
                        else if (f->path == MLART_BMM_SLICE)
                            snprintf(name, sizeof name, "%s slice k%d%s%s", base, f->warps,
                                     f->cols == 32 ? " n32" : "", f->pdl ? " pdl" : "");
                        else if (f->path == MLART_BMM_STREAM)
                            snprintf(name, sizeof name, "%s stream mt%d w%d", base, f->mt, f->warps);
                        else
                            snprintf(name, sizeof name, "%s direct%s c%d s%d g%d mt%d", base, f->bm ? " staged" : "",
                                     f->cols, f->warps, f->groups, f->mt);
                        c.cfg = f->path == MLART_BMM_AUTO && !f->pdl ? NULL : f;
                        v[0] = time_method(c, o, M_OURS, CUBLAS_COMPUTE_32F, 0);
                        v[1] = bytes / (v[0] * 1e3);
                        if (!isnan(v[0])) { /* against cuBLAS on set 0, as the decode table */
                            v[2] = check_vs_cublas(c, o);
                            wrong += !(v[2] <= kTolerance);
                        }
                        c.cfg = NULL;
                        if (!isnan(v[0]))
                            mlart_bench_table_row(o, &t, name, v);
                    }
                    free_sets(c);
                }
    return wrong;
}

} // namespace

extern "C" int mlart_bench_ops(const mlart_bench_opts *o)
{
    cublasHandle_t hb;
    void *ws = NULL;
    int wrong = 0, rc;
    if (cublasCreate(&hb) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "mlart-bench: cublasCreate failed\n");
        return -1;
    }
    /* a fixed workspace: no allocation inside graph capture */
    if (cudaMalloc(&ws, (size_t)64 << 20) == cudaSuccess)
        cublasSetWorkspace(hb, ws, (size_t)64 << 20);
    if (cudaMalloc(&g_sink, 64) != cudaSuccess)
        g_sink = NULL;
    rc = bench_query_decode(o, hb);
    wrong += rc < 0 ? 1 : rc;
    rc = bench_query_prefill(o, hb);
    wrong += rc < 0 ? 1 : rc;
    rc = bench_vup(o, hb);
    wrong += rc < 0 ? 1 : rc;
    if (o->variants) {
        rc = bench_variants(o, hb);
        wrong += rc < 0 ? 1 : rc;
    }
    cublasDestroy(hb);
    cudaFree(ws);
    cudaFree(g_sink);
    g_sink = NULL;
    return wrong;
}
