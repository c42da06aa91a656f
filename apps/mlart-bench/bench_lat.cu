/* mlart-bench suite "latency": the dependent latencies that a split decode
 * step's critical path is made of, measured on this GPU in the same run, so
 * that a per-call target can be set against what the hardware allows.
 *
 * Loads: one thread per multiprocessor (a cooperative launch of one 32-thread
 * block per multiprocessor, all resident) follows a chain of HOPS dependent
 * 4-byte loads, each to a different 128-byte line that holds the index of the
 * next; the time of the chain (SM clock and global timer) over HOPS.  The
 * lines are written by whole warps (128 bytes) before they are read, in one
 * of these ways:
 *   DRAM          by an earlier kernel, then evicted (3x L2 of memset);
 *                 also with each line on its own 2 MiB page, first touched
 *                 by the reading multiprocessor (a translation miss)
 *   L2 clean      as DRAM, then read once by another kernel
 *   L2 dirty      by an earlier kernel, never evicted (also a page a line)
 *   own SM        by the reading block, earlier in the same kernel
 *   other SMs     by the other blocks, earlier in the same kernel, then a
 *                 grid barrier (acquire-release add, acquiring polls): what a
 *                 combine reads after the chunks of a token have written;
 *                 also with the lines evicted from L2 before that kernel
 *                 (as a workspace is between calls), written whole or only
 *                 the first half of each 32-byte sector
 *   hot           as other SMs, but every block follows the same chain (the
 *                 lines of block 0): each line read by all multiprocessors
 *                 at once
 * `other SMs` runs with three load kinds: ld.global.cg (every other row),
 * the default ld.global and ld.relaxed.gpu.
 * Barrier: from the last block's arrival to each block seeing the release
 * (global timer; median over blocks).
 * Kernel edges (graph replays of two kernels of one block per
 * multiprocessor): from the first kernel's last block exit to the second's
 * first block start, launched plainly or with programmatic dependent launch
 * (then to its first block past griddepcontrol.wait); and the time per node
 * of a graph of empty kernels.
 * Timer: the median step of the global timer (%globaltimer), which the
 * barrier and edge rows and the kernels' diagnostic stamps read.
 * Code: one warp a multiprocessor runs 32 KiB of straight-line independent
 * FFMAs twice (a loop of two passes over the same code), on the second of
 * two launches (so the code is in L2): SM cycles per 128 bytes of code in
 * the first pass (the code not yet in the multiprocessor's instruction
 * caches, unless they kept it from the first launch) and in the second
 * (cached, where 32 KiB fit: one FFMA a cycle at best, 8 a line).
 * Columns: ns (median over blocks, or over replays for the kernel rows), max
 * ns over blocks, and SM cycles where they apply. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"
#include "runtime/cuda_clock.h"
#include "runtime/cuda_launch.h"

namespace {

constexpr int HOPS = 64;       /* dependent loads per chain */
constexpr int LINE_WORDS = 32; /* 128-byte lines */
constexpr int EDGE_REPS = 15;  /* graph replays of each kernel edge */

enum { MAP_NONE = -1, MAP_OTHER = 0, MAP_OWN = 1, MAP_HOT = 2 };
enum { LD_CG = 0, LD_DEFAULT = 1, LD_RELAXED = 2 };

__device__ __forceinline__ unsigned long long gtimer()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    return t;
}

__device__ __forceinline__ unsigned long long sm_clock()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
    return t;
}

template <int KIND> __device__ __forceinline__ unsigned ld_line(const unsigned *p)
{
    unsigned v;
    if (KIND == LD_CG)
        asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    else if (KIND == LD_DEFAULT)
        asm volatile("ld.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    else
        asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

/* Shift of hop j in the `other` map: 1..n-1, so a block never reads its own
 * line and, for each j, block b -> (b + shift) mod n is a bijection (every
 * line is read by exactly one block). */
__host__ __device__ inline int other_shift(int j, int n)
{
    return 1 + (7 * j) % (n - 1);
}

/* Line read by block b at hop j. */
__host__ __device__ inline unsigned chain_line(int map, int b, int j, int n)
{
    const int w = map == MAP_OTHER ? (b + other_shift(j, n)) % n : map == MAP_OWN ? b : 0;
    return (unsigned)(w * HOPS + j);
}

struct LatArgs {
    unsigned *lines;         /* n * HOPS lines, `stride` words apart */
    size_t stride;           /* LINE_WORDS, or a 2 MiB page and a line (one page a line) */
    unsigned *bar;           /* grid barrier word (zeroed before the launch) */
    unsigned long long *out; /* 4 a block: cycles, ns of the chain, arrival and release time */
    int n;                   /* blocks = multiprocessors */
    int write_map;           /* MAP_NONE: no writes; else the chain the written lines encode */
    int read_map;            /* MAP_NONE: no chase */
    int barrier;             /* grid barrier between the writes and the chase */
    int half;                /* write only the first 16 bytes of each 32-byte sector */
};

template <int KIND> __global__ void __launch_bounds__(32) lat_chain_kernel(LatArgs a)
{
    __shared__ unsigned s_sink;
    const int b = blockIdx.x, lane = threadIdx.x, n = a.n;
    if (a.write_map != MAP_NONE) {
        const int wmap = a.write_map == MAP_HOT ? MAP_OWN : a.write_map;
        for (int j = 0; j < HOPS; j++) {
            /* the block that reads this line at hop j, and its next line */
            const int r = wmap == MAP_OTHER ? (b - other_shift(j, n) + n) % n : b;
            const unsigned line = (unsigned)(b * HOPS + j);
            const unsigned next = j + 1 < HOPS ? chain_line(wmap, r, j + 1, n) : 0u;
            if (!a.half || lane % 8 < 4)
                a.lines[(size_t)line * a.stride + lane] = lane == 0 ? next : line;
        }
    }
    __syncwarp();
    if (a.barrier && lane == 0) {
        const unsigned long long t_arr = gtimer();
        unsigned old;
        asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;" : "=r"(old) : "l"(a.bar) : "memory");
        unsigned seen = old + 1;
        while (seen < (unsigned)n)
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(a.bar) : "memory");
        const unsigned long long t_rel = gtimer();
        a.out[4 * b + 2] = t_arr;
        a.out[4 * b + 3] = t_rel;
    }
    __syncwarp();
    if (a.read_map != MAP_NONE && lane == 0) {
        unsigned idx = chain_line(a.read_map, b, 0, n);
        const unsigned long long c0 = sm_clock(), g0 = gtimer();
        for (int j = 0; j < HOPS; j++)
            idx = ld_line<KIND>(a.lines + (size_t)idx * a.stride);
        /* the store cannot issue before the last load has landed, and the
         * timer reads after it are issued in order */
        asm volatile("st.volatile.shared.u32 [%0], %1;" ::"r"((unsigned)__cvta_generic_to_shared(&s_sink)), "r"(idx)
                     : "memory");
        const unsigned long long c1 = sm_clock(), g1 = gtimer();
        a.out[4 * b + 0] = c1 - c0;
        a.out[4 * b + 1] = g1 - g0;
    }
}

/* Every line read once (brings DRAM lines into L2 clean). */
__global__ void lat_touch_kernel(const unsigned *lines, size_t nlines, size_t stride, unsigned *sink)
{
    unsigned acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < nlines; i += (size_t)gridDim.x * blockDim.x)
        acc += __ldcg(lines + i * stride);
    if (acc == 0x9e3779b9u)
        *sink = acc;
}

/* Kernel edges: st[0] the first kernel's last block exit (max), st[1] the
 * second's first block start (min), st[2] its first block past the
 * dependency wait (min). */
__global__ void lat_edge_first(unsigned long long *st, unsigned spin_ns)
{
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const unsigned long long t0 = gtimer();
    while (gtimer() - t0 < spin_ns) {
    }
    __syncthreads();
    if (threadIdx.x == 0)
        atomicMax(st, gtimer());
}

__global__ void lat_edge_second(unsigned long long *st)
{
    const unsigned long long t0 = gtimer();
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const unsigned long long t1 = gtimer();
    if (threadIdx.x == 0) {
        atomicMin(st + 1, t0);
        atomicMin(st + 2, t1);
    }
}

__global__ void lat_empty_kernel() {}

/* Instruction fetch: one warp a multiprocessor runs CODE_FMAS independent
 * FFMAs (eight chains, so that a warp can issue one a cycle once the code
 * is cached) straight through, twice (the same code: a loop of two
 * passes), and stamps the SM clock before and after each pass:
 * out[2 b + 0, 1] the first pass's cycles and the second's. */
constexpr int CODE_FMAS = 2048; /* 16 bytes each: 32 KiB of code */
__global__ void __launch_bounds__(32) lat_code_kernel(float c, float d, float *sink, unsigned long long *out)
{
    float x[8];
#pragma unroll
    for (int k = 0; k < 8; k++)
        x[k] = (float)(threadIdx.x + k) * 1e-3f;
    unsigned long long prev = sm_clock(), d0 = 0, d1 = 0;
#pragma unroll 1
    for (int pass = 0; pass < 2; pass++) {
#pragma unroll
        for (int i = 0; i < CODE_FMAS; i++)
            x[i & 7] = fmaf(x[i & 7], c, d);
        float acc = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; k++)
            acc += x[k];
        const unsigned long long now = mlart_clock_after(acc); /* once every FFMA has run */
        if (pass == 0)
            d0 = now - prev;
        else
            d1 = now - prev;
        prev = now;
        if (acc == 12345.0f) /* never: keeps the FFMAs */
            *sink = acc;
    }
    if (threadIdx.x == 0) {
        out[2 * blockIdx.x + 0] = d0;
        out[2 * blockIdx.x + 1] = d1;
    }
}

/* The global timer's steps: the first GT_STEPS nonzero differences between
 * consecutive reads of one thread. */
constexpr int GT_STEPS = 255;
__global__ void lat_gtimer_kernel(unsigned long long *out)
{
    unsigned long long prev = gtimer();
    int k = 0;
    for (long it = 0; it < (1l << 24) && k < GT_STEPS; it++) {
        const unsigned long long now = gtimer();
        if (now != prev)
            out[k++] = now - prev;
        prev = now;
    }
    out[GT_STEPS] = (unsigned long long)k;
}

#define LAT_CUDA(stmt) MLART_BENCH_CHECK("mlart-bench latency", stmt)

int cmp_u64(const void *x, const void *y)
{
    const unsigned long long a = *(const unsigned long long *)x, b = *(const unsigned long long *)y;
    return a < b ? -1 : a > b;
}

double median_u64(unsigned long long *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_u64);
    return n % 2 ? (double)v[n / 2] : 0.5 * ((double)v[n / 2 - 1] + (double)v[n / 2]);
}

struct Chain {
    const char *name;
    int kind;      /* LD_* */
    int prep;      /* 0: written in the same kernel; 1: dirty; 2: DRAM; 3: clean;
                    * 4: as 0, the lines evicted from L2 before the kernel */
    int map;       /* MAP_* read */
    int half;      /* the writes cover half of each sector */
    int spread;    /* 1, 2: each line on its own 2 MiB page, in page set 1 or 2 (each row
                    * its own pages, first touched by this row's kernels); 0: dense */
};

/* A line a page: 2 MiB and 128 bytes apart, so that the lines also fall in
 * different L2 sets. */
constexpr size_t SPREAD_WORDS = ((size_t)2 << 20) / 4 + LINE_WORDS;

const Chain CHAINS[] = {
    {"latency load DRAM", LD_CG, 2, MAP_OTHER, 0, 0},
    {"latency load L2 clean", LD_CG, 3, MAP_OTHER, 0, 0},
    {"latency load L2 dirty (earlier kernel)", LD_CG, 1, MAP_OTHER, 0, 0},
    {"latency load own SM wrote it", LD_CG, 0, MAP_OWN, 0, 0},
    {"latency load other SMs wrote it", LD_CG, 0, MAP_OTHER, 0, 0},
    {"latency load other SMs wrote it ld.global", LD_DEFAULT, 0, MAP_OTHER, 0, 0},
    {"latency load other SMs wrote it ld.relaxed", LD_RELAXED, 0, MAP_OTHER, 0, 0},
    {"latency load hot (all SMs one chain)", LD_CG, 0, MAP_HOT, 0, 0},
    {"latency load other SMs wrote it, not in L2", LD_CG, 4, MAP_OTHER, 0, 0},
    {"latency load other SMs wrote half, not in L2", LD_CG, 4, MAP_OTHER, 1, 0},
    {"latency load DRAM, a new 2 MiB page each", LD_CG, 2, MAP_OTHER, 0, 1},
    {"latency load L2 dirty, a new 2 MiB page each", LD_CG, 1, MAP_OTHER, 0, 2},
};
constexpr int CHAIN_FRESH = 4; /* the row whose kernel also times the barrier */

int launch_chain(int kind, const LatArgs &a, cudaStream_t st)
{
    void *args[] = {(void *)&a};
    const void *fn = kind == LD_CG ? (const void *)lat_chain_kernel<LD_CG>
                     : kind == LD_DEFAULT ? (const void *)lat_chain_kernel<LD_DEFAULT>
                                          : (const void *)lat_chain_kernel<LD_RELAXED>;
    return cudaLaunchCooperativeKernel(fn, dim3((unsigned)a.n), dim3(32), args, 0, st) == cudaSuccess ? 0 : -1;
}

/* One chain measurement: lines prepared as c->prep says, then the chase.
 * out_ns / out_cyc / out_max: median and maximum over blocks.  bar_ns: the
 * barrier's median release delay when the chase kernel had one. */
int run_chain(const Chain *c, int n, unsigned *lines, unsigned *bar, unsigned long long *d_out,
              unsigned long long *h_out, void *evict, size_t evict_bytes, unsigned *sink, cudaStream_t st,
              double *out_ns, double *out_cyc, double *out_max, double *bar_ns)
{
    LatArgs a;
    unsigned long long *ns = NULL, *cy = NULL, *rel = NULL, last = 0;
    int rc = -1;
    a.lines = lines;
    a.stride = c->spread ? SPREAD_WORDS : LINE_WORDS;
    a.bar = bar;
    a.out = d_out;
    a.n = n;
    a.barrier = 0;
    a.half = c->half;
    LAT_CUDA(cudaMemsetAsync(d_out, 0, sizeof(unsigned long long) * 4 * (size_t)n, st));
    if (c->prep > 0 && c->prep < 4) {
        a.write_map = MAP_OTHER;
        a.read_map = MAP_NONE;
        if (launch_chain(LD_CG, a, st))
            goto fail;
        if (c->prep >= 2)
            LAT_CUDA(cudaMemsetAsync(evict, c->prep, evict_bytes, st));
        if (c->prep == 3)
            lat_touch_kernel<<<n, 128, 0, st>>>(lines, (size_t)n * HOPS, a.stride, sink);
        a.write_map = MAP_NONE;
    } else {
        if (c->prep == 4)
            LAT_CUDA(cudaMemsetAsync(evict, c->prep, evict_bytes, st));
        a.write_map = c->map;
        a.barrier = 1;
        LAT_CUDA(cudaMemsetAsync(bar, 0, sizeof(unsigned), st));
    }
    a.read_map = c->map;
    if (launch_chain(c->kind, a, st))
        goto fail;
    LAT_CUDA(cudaGetLastError());
    LAT_CUDA(cudaMemcpyAsync(h_out, d_out, sizeof(unsigned long long) * 4 * (size_t)n, cudaMemcpyDeviceToHost, st));
    LAT_CUDA(cudaStreamSynchronize(st));
    ns = (unsigned long long *)malloc(sizeof *ns * (size_t)n);
    cy = (unsigned long long *)malloc(sizeof *cy * (size_t)n);
    rel = (unsigned long long *)malloc(sizeof *rel * (size_t)n);
    if (!ns || !cy || !rel)
        goto fail;
    for (int b = 0; b < n; b++) {
        cy[b] = h_out[4 * b + 0];
        ns[b] = h_out[4 * b + 1];
        if (h_out[4 * b + 2] > last)
            last = h_out[4 * b + 2];
    }
    for (int b = 0; b < n; b++)
        rel[b] = h_out[4 * b + 3] > last ? h_out[4 * b + 3] - last : 0;
    *out_ns = median_u64(ns, n) / HOPS;
    *out_cyc = median_u64(cy, n) / HOPS;
    *out_max = (double)ns[n - 1] / HOPS; /* sorted by median_u64 */
    *bar_ns = a.barrier ? median_u64(rel, n) : NAN;
    rc = 0;
fail:
    free(ns);
    free(cy);
    free(rel);
    return rc;
}

/* Kernel edges: medians over EDGE_REPS graph replays of the gap between the
 * first kernel's last exit and the second's first start (plain launch) or
 * first pass of its dependency wait (pdl). */
int run_edge(int n, int pdl, unsigned long long *st_d, cudaStream_t st, double *gap_ns)
{
    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    cudaLaunchAttribute at[1];
    unsigned long long gaps[EDGE_REPS], h[3];
    int rc = -1, capturing = 0;
    cudaLaunchConfig_t lc = mlart_launch_cfg(dim3((unsigned)n), dim3(128), 0, st, pdl, at);
    LAT_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    capturing = 1;
    LAT_CUDA(cudaMemsetAsync(st_d, 0, sizeof(unsigned long long), st));
    LAT_CUDA(cudaMemsetAsync(st_d + 1, 0xff, 2 * sizeof(unsigned long long), st));
    lat_edge_first<<<n, 128, 0, st>>>(st_d, 2000u);
    LAT_CUDA(cudaLaunchKernelEx(&lc, lat_edge_second, st_d));
    capturing = 0;
    LAT_CUDA(cudaStreamEndCapture(st, &g));
    LAT_CUDA(cudaGraphInstantiate(&ge, g, 0));
    LAT_CUDA(cudaGraphLaunch(ge, st)); /* warm-up */
    for (int r = 0; r < EDGE_REPS; r++) {
        LAT_CUDA(cudaGraphLaunch(ge, st));
        LAT_CUDA(cudaMemcpyAsync(h, st_d, sizeof h, cudaMemcpyDeviceToHost, st));
        LAT_CUDA(cudaStreamSynchronize(st));
        const unsigned long long end = pdl ? h[2] : h[1];
        gaps[r] = end > h[0] ? end - h[0] : 0;
    }
    *gap_ns = median_u64(gaps, EDGE_REPS);
    rc = 0;
fail:
    mlart_bench_graph_release(st, capturing, g, ge);
    return rc;
}

int enqueue_empty(void *ctx, int set, cudaStream_t st)
{
    (void)ctx;
    (void)set;
    lat_empty_kernel<<<1, 32, 0, st>>>();
    return cudaGetLastError() == cudaSuccess ? 0 : -1;
}

} // namespace

extern "C" int mlart_bench_lat(const mlart_bench_opts *o)
{
    static const mlart_bench_col cols[] = {{"ns", "median", 9, 0}, {"max", "ns", 9, 0}, {"cycles", "SM", 9, 0}};
    const mlart_bench_table t = {"latency: dependent loads, barrier, kernel edges (one H200-wide run)", "row", 48,
                                 cols, 3};
    const int n = o->sms;
    const size_t nlines = (size_t)n * HOPS, evict_bytes = 3 * o->l2_bytes;
    unsigned *lines = NULL, *spread = NULL, *bar = NULL, *sink = NULL;
    unsigned long long *d_out = NULL, *h_out = NULL, *edge = NULL;
    void *evict = NULL;
    cudaStream_t st = NULL;
    double vals[3], bar_ns = NAN, dram = NAN, fresh = NAN, node_us = NAN, pdl_gap = NAN;
    int any = 0, rc = -1, coop = 0;
    for (size_t i = 0; i < sizeof CHAINS / sizeof CHAINS[0]; i++)
        any |= mlart_bench_match(o, CHAINS[i].name);
    any |= mlart_bench_match(o, "latency barrier release") | mlart_bench_match(o, "latency kernel edge") |
           mlart_bench_match(o, "latency empty kernel node") | mlart_bench_match(o, "latency globaltimer step") |
           mlart_bench_match(o, "latency code");
    if (!any)
        return 0;
    if (cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, o->device) != cudaSuccess || !coop || n < 2) {
        fprintf(stderr, "mlart-bench: latency suite needs cooperative launch and >= 2 multiprocessors\n");
        return -1;
    }
    LAT_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    LAT_CUDA(cudaMalloc((void **)&lines, nlines * LINE_WORDS * sizeof(unsigned)));
    LAT_CUDA(cudaMalloc((void **)&bar, 128));
    LAT_CUDA(cudaMalloc((void **)&sink, 128));
    LAT_CUDA(cudaMalloc((void **)&d_out, sizeof(unsigned long long) * (4 * (size_t)n > GT_STEPS + 1 ? 4 * (size_t)n : GT_STEPS + 1)));
    LAT_CUDA(cudaMalloc((void **)&edge, 3 * sizeof(unsigned long long)));
    LAT_CUDA(cudaMalloc(&evict, evict_bytes));
    /* two sets of 8448 pages on an H200 (35 GB), only when a row that needs
     * them is selected; those rows are left out if they do not fit */
    for (size_t i = 0; i < sizeof CHAINS / sizeof CHAINS[0] && !spread; i++)
        if (CHAINS[i].spread && mlart_bench_match(o, CHAINS[i].name) &&
            cudaMalloc((void **)&spread, 2 * nlines * SPREAD_WORDS * sizeof(unsigned)) != cudaSuccess) {
            cudaGetLastError();
            spread = NULL;
            break;
        }
    h_out = (unsigned long long *)malloc(sizeof(unsigned long long) * 4 * (size_t)n);
    if (!h_out)
        goto fail;
    mlart_bench_table_head(o, &t);
    for (size_t i = 0; i < sizeof CHAINS / sizeof CHAINS[0]; i++) {
        const Chain *c = &CHAINS[i];
        double ns = 0, cyc = 0, mx = 0, b = NAN;
        unsigned *buf = !c->spread ? lines : spread ? spread + (size_t)(c->spread - 1) * nlines * SPREAD_WORDS : NULL;
        if (!mlart_bench_match(o, c->name) && !(i == CHAIN_FRESH && mlart_bench_match(o, "latency barrier release")))
            continue;
        if (!buf) {
            printf("# %s: left out (no room for %zu pages)\n", c->name, nlines);
            continue;
        }
        /* dense rows: the first run warms the code, the second is reported;
         * page rows run once (a second run would find its pages' translations
         * cached), after the dense rows have warmed the code */
        if ((!c->spread && run_chain(c, n, buf, bar, d_out, h_out, evict, evict_bytes, sink, st, &ns, &cyc, &mx, &b)) ||
            run_chain(c, n, buf, bar, d_out, h_out, evict, evict_bytes, sink, st, &ns, &cyc, &mx, &b))
            goto fail;
        if (c->prep == 2 && !c->spread)
            dram = ns;
        if (i == CHAIN_FRESH) {
            fresh = ns;
            bar_ns = b;
        }
        if (mlart_bench_match(o, c->name)) {
            vals[0] = ns;
            vals[1] = mx;
            vals[2] = cyc;
            mlart_bench_table_row(o, &t, c->name, vals);
        }
    }
    if (mlart_bench_match(o, "latency barrier release") && !isnan(bar_ns)) {
        vals[0] = bar_ns;
        vals[1] = vals[2] = NAN;
        mlart_bench_table_row(o, &t, "latency barrier release (last arrival to seen)", vals);
    }
    for (int pdl = 0; pdl < 2; pdl++) {
        const char *name = pdl ? "latency kernel edge, PDL (exit to past the wait)" : "latency kernel edge (exit to start)";
        double gap = 0;
        if (!mlart_bench_match(o, name))
            continue;
        if (run_edge(n, pdl, edge, st, &gap))
            goto fail;
        if (pdl)
            pdl_gap = gap;
        vals[0] = gap;
        vals[1] = vals[2] = NAN;
        mlart_bench_table_row(o, &t, name, vals);
    }
    if (mlart_bench_match(o, "latency empty kernel node")) {
        if (mlart_bench_time(o, enqueue_empty, NULL, 16, &node_us))
            goto fail;
        vals[0] = node_us * 1000.0;
        vals[1] = vals[2] = NAN;
        mlart_bench_table_row(o, &t, "latency empty kernel node (graph of 16)", vals);
    }
    if (mlart_bench_match(o, "latency globaltimer step")) {
        unsigned long long steps[GT_STEPS + 1];
        double gmed = NAN, gmax = NAN;
        LAT_CUDA(cudaMemsetAsync(d_out, 0, sizeof steps, st));
        lat_gtimer_kernel<<<1, 1, 0, st>>>(d_out);
        LAT_CUDA(cudaGetLastError());
        LAT_CUDA(cudaMemcpyAsync(steps, d_out, sizeof steps, cudaMemcpyDeviceToHost, st));
        LAT_CUDA(cudaStreamSynchronize(st));
        const int k = (int)steps[GT_STEPS];
        if (k > 0) {
            gmed = median_u64(steps, k);
            gmax = (double)steps[k - 1];
        }
        vals[0] = gmed;
        vals[1] = gmax;
        vals[2] = NAN;
        mlart_bench_table_row(o, &t, "latency globaltimer step", vals);
    }
    if (mlart_bench_match(o, "latency code")) {
        /* the first launch brings the code into L2, the second is reported */
        int khz = 0;
        LAT_CUDA(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, o->device));
        for (int run = 0; run < 2; run++) {
            lat_code_kernel<<<n, 32, 0, st>>>(0.999f, 1e-4f, (float *)sink, d_out);
            LAT_CUDA(cudaGetLastError());
        }
        LAT_CUDA(cudaMemcpyAsync(h_out, d_out, 2 * (size_t)n * sizeof *h_out, cudaMemcpyDeviceToHost, st));
        LAT_CUDA(cudaStreamSynchronize(st));
        const double lines_per_pass = CODE_FMAS * 16.0 / 128.0, ns_per_cyc = 1e6 / (khz > 0 ? khz : 1980000);
        for (int pass = 0; pass < 2; pass++) {
            unsigned long long *v = h_out + 2 * (size_t)n;
            for (int b = 0; b < n; b++)
                v[b] = h_out[2 * b + pass];
            const double med = median_u64(v, n) / lines_per_pass; /* sorted now */
            vals[0] = med * ns_per_cyc;
            vals[1] = (double)v[n - 1] / lines_per_pass * ns_per_cyc;
            vals[2] = med;
            mlart_bench_table_row(o, &t,
                                  pass ? "latency code run again, per 128 B (8 FFMAs)"
                                       : "latency code run once, per 128 B (8 FFMAs)",
                                  vals);
        }
    }
    if (!isnan(dram) && !isnan(fresh) && !isnan(pdl_gap) && !isnan(node_us)) {
        char line[320];
        snprintf(line, sizeof line,
                 "a split step's dependent chain, T = 1: node %.2f + 3 DRAM loads (indices, block table, rows) "
                 "%.2f + PDL edge %.2f + fresh partials %.2f = %.2f us before any transfer or math",
                 node_us, 3 * dram / 1000.0, pdl_gap / 1000.0, fresh / 1000.0,
                 node_us + (3 * dram + pdl_gap + fresh) / 1000.0);
        mlart_bench_summary(o, "latency", line);
    }
    rc = 0;
fail:
    cudaFree(lines);
    cudaFree(spread);
    cudaFree(bar);
    cudaFree(sink);
    cudaFree(d_out);
    cudaFree(edge);
    cudaFree(evict);
    free(h_out);
    if (st)
        cudaStreamDestroy(st);
    return rc;
}
