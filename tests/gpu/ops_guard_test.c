/* Read-exact proof: each operand in turn sits in a guard-page allocation
 * (tests/gpu/guard_alloc.h) with its span ending exactly at the end of the
 * mapped memory and the next granule unmapped.  Any byte read or written past
 * the span is an illegal address that fails the launch's synchronisation.
 * Every kernel path runs on every shape of the test matrix of the ops (the
 * T and H lists of ops_bmm_test.c, both P, both V), and the guarded result
 * must equal, bit for bit, the result with ordinary allocations. */
#define _DEFAULT_SOURCE /* fork, mmap flags */
#include <check.h>

#include "guard_alloc.h"
#include "ops/bmm_cuda.h"
#include "ops/ops.h"
#include "ops_gpu_util.h"

static uint64_t g_seed;

static const int64_t k_T[] = {1, 2, 3, 6, 9, 11, 16, 32, 64, 75, 256, 8192};
static const int64_t k_H[] = {1, 8, 11, 16, 32, 64, 128};

enum { PL_A, PL_W, PL_C, PL_FUSED, PL_COUNT };
static const char *const k_pl_name[] = {"a (q_nope view / x)", "w", "out view", "q and q_mqa (fused q_pe)"};

/* Bytes from an operand's first element to the end of its last one. */
static size_t span_a(const ops_case *c)
{
    return (size_t)((c->H - 1) * ops_a_sh(c) + (c->T - 1) * ops_a_st(c) + c->K) * 2;
}
static size_t span_c(const ops_case *c)
{
    return (size_t)((c->H - 1) * ops_c_sh(c) + (c->T - 1) * ops_c_st(c) + c->N) * 2;
}

static int launch(const ops_case *c, const ops_views *v, const mlart_bmm_config *cfg)
{
    if (cfg->path != MLART_BMM_AUTO) {
        mlart_bmm_desc d;
        memset(&d, 0, sizeof d);
        d.H = c->H;
        d.T = c->T;
        d.K = c->K;
        d.N = c->N;
        d.a = v->a.data;
        d.a_sh = v->a.stride[0];
        d.a_st = v->a.stride[1];
        d.w = v->w.data;
        d.w_sh = v->w.stride[0];
        d.w_sk = v->w.stride[1];
        d.c = v->c.data;
        d.c_sh = v->c.stride[0];
        d.c_st = v->c.stride[1];
        if (c->pe) {
            d.pe_in = v->pe_in.data;
            d.pe_out = v->pe_out.data;
            d.R = c->R;
            d.pi_st = v->pe_in.stride[0];
            d.pi_sh = v->pe_in.stride[1];
            d.po_st = v->pe_out.stride[0];
            d.po_sh = v->pe_out.stride[1];
        }
        return mlart_bmm_cuda_run(&d, cfg, 0);
    }
    if (c->vup)
        return mlart_v_up_bmm_cuda(&v->a, &v->w, &v->c, 0);
    return mlart_query_bmm_cuda(&v->a, &v->w, &v->c, c->pe ? &v->pe_in : NULL, c->pe ? &v->pe_out : NULL, 0);
}

/* Run once with the given storage; the output storage (nc elements at cbuf,
 * c_bytes of it in the view's extent) is poisoned first and copied back. */
static void run_into(const ops_case *c, const mlart_bmm_config *cfg, uint16_t *a, size_t a_bytes, uint16_t *w,
                     uint16_t *cbuf, size_t c_bytes, uint16_t *host_out, const char *tag)
{
    ops_views v = ops_make_views(c, 0, a, a_bytes, w, ops_w_elems(c) * 2, cbuf, c_bytes);
    int rc;
    cudaError_t e;
    GPU_CUDA(cudaMemset(cbuf, 0xFF, c_bytes));
    rc = launch(c, &v, cfg);
    ck_assert_msg(rc == 0, "%s: rc %d: %s", tag, rc, mlart_last_error());
    e = cudaDeviceSynchronize();
    ck_assert_msg(e == cudaSuccess, "%s: FAULT: %s", tag, cudaGetErrorString(e));
    GPU_CUDA(cudaMemcpy(host_out, cbuf, c_bytes, cudaMemcpyDeviceToHost));
}

static int g_runs;

static void guard_shape(const ops_case *c0, uint64_t *rng)
{
    static const mlart_bmm_config cfgs[] = {{MLART_BMM_AUTO, 0, 0, 0, 0, 0, 0},    {MLART_BMM_STREAM, 0, 0, 0, 0, 0, 0},
                                            {MLART_BMM_PSTREAM, 0, 0, 0, 0, 0, 0}, {MLART_BMM_TILED, 0, 0, 64, 0, 0, 0},
                                            {MLART_BMM_TILED, 0, 0, 128, 0, 0, 0}, {MLART_BMM_GENERIC, 0, 0, 0, 0, 0, 0},
                                            {MLART_BMM_DIRECT, 0, 0, 0, 0, 0, 0},
                                            {MLART_BMM_DIRECT, 0, 0, 0, 16, 2, 0},
                                            {MLART_BMM_DIRECT, 2, 0, 0, 64, 0, 0},
                                            {MLART_BMM_DIRECT, 4, 0, 1, 32, 0, 0},
                                            /* direct, launched with PDL */
                                            {MLART_BMM_DIRECT, 0, 0, 0, 0, 0, 1},
                                            /* wgmma: auto; one row chunk, one warpgroup,
                                             * 128-column slices (the query only); two
                                             * warpgroups, 128 */
                                            {MLART_BMM_WGMMA, 0, 0, 0, 0, 0, 0},
                                            {MLART_BMM_WGMMA, 1, 1, 0, 128, 0, 0},
                                            {MLART_BMM_WGMMA, 0, 2, 0, 128, 0, 0},
                                            /* ring (the query only): as many stages as fit; 64-column
                                             * slices, 2 stages, two blocks an SM; one stage, four;
                                             * the one-item form, plainly and with PDL (64- and
                                             * 128-column slices), with K in halves and PDL */
                                            {MLART_BMM_RING, 0, 0, 0, 0, 0, 0},
                                            {MLART_BMM_RING, 2, 0, 0, 64, 2, 0},
                                            {MLART_BMM_RING, 1, 0, 0, 64, 4, 0},
                                            {MLART_BMM_RING, 0, 1, 0, 64, 0, 0},
                                            {MLART_BMM_RING, 0, 1, 0, 128, 0, 1},
                                            {MLART_BMM_RING, 0, 1, 0, 64, 0, 1},
                                            {MLART_BMM_RING, 0, 2, 0, 64, 0, 1},
                                            /* swap: default (256-column blocks, not at V = 128);
                                             * 128-column blocks, 8-row token tiles */
                                            {MLART_BMM_SWAP, 0, 0, 0, 0, 0, 0},
                                            {MLART_BMM_SWAP, 8, 0, 0, 128, 0, 0},
                                            /* slice (T <= 16), plainly and with PDL; 32-column
                                             * blocks with two chains of K (the V up-projection) */
                                            {MLART_BMM_SLICE, 0, 0, 0, 0, 0, 0},
                                            {MLART_BMM_SLICE, 0, 0, 0, 0, 0, 1},
                                            {MLART_BMM_SLICE, 0, 2, 0, 32, 0, 0}};
    const size_t na = ops_a_elems(c0), nw = ops_w_elems(c0), nc = ops_c_elems(c0);
    uint16_t *o1 = malloc(nc * 2), *o2 = malloc(nc * 2);
    ck_assert(o1 && o2);
    ops_bufs bufs = ops_upload(c0, rng, nc);
    uint16_t *const ha = bufs.ha, *const hw = bufs.hw, *const da = bufs.da, *const dw = bufs.dw, *const dc = bufs.dc;
    for (int pl = 0; pl < PL_COUNT; pl++) {
        ops_case c = *c0;
        if (pl == PL_FUSED && c.vup)
            continue;
        c.pe = pl == PL_FUSED;
        for (unsigned ic = 0; ic < sizeof cfgs / sizeof cfgs[0]; ic++) {
            char tag[160];
            if (cfgs[ic].path == MLART_BMM_RING && c.vup)
                continue; /* K = 512 is not served (the weight slice would not fit shared memory) */
            if (cfgs[ic].path == MLART_BMM_WGMMA && c.vup && cfgs[ic].warps == 1)
                continue; /* K = 512: two warpgroups only */
            if (cfgs[ic].path == MLART_BMM_SWAP && c.N % (cfgs[ic].cols ? cfgs[ic].cols : 256))
                continue; /* V = 128: only the 128-column blocks */
            if (cfgs[ic].path == MLART_BMM_SLICE && (c.T > 16 || (cfgs[ic].cols == 32 && !c.vup)))
                continue; /* T <= 16 only; 32 columns at K = 512 only */
            mlart_guard_buf ga = {0}, gw = {0}, gc = {0};
            uint16_t *pa = da, *pw = dw, *pc = dc;
            size_t a_bytes = na * 2, c_bytes = nc * 2, cmp_bytes;
            snprintf(tag, sizeof tag, "%s H=%lld T=%lld K=%lld N=%lld guarded %s path %d", c.vup ? "v_up" : "query",
                     (long long)c.H, (long long)c.T, (long long)c.K, (long long)c.N, k_pl_name[pl], cfgs[ic].path);
            if (pl == PL_A || pl == PL_FUSED) {
                size_t bytes = pl == PL_A ? span_a(&c) : na * 2;
                ck_assert_msg(mlart_guard_alloc(&ga, bytes, 0) == 0, "%s", mlart_guard_error());
                pa = ga.ptr;
                a_bytes = bytes;
                GPU_CUDA(cudaMemcpy(pa, ha, bytes, cudaMemcpyHostToDevice));
            }
            if (pl == PL_W) {
                ck_assert_msg(mlart_guard_alloc(&gw, nw * 2, 0) == 0, "%s", mlart_guard_error());
                pw = gw.ptr;
                GPU_CUDA(cudaMemcpy(pw, hw, nw * 2, cudaMemcpyHostToDevice));
            }
            if (pl == PL_C || pl == PL_FUSED) {
                size_t bytes = pl == PL_C ? span_c(&c) : nc * 2;
                ck_assert_msg(mlart_guard_alloc(&gc, bytes, 0) == 0, "%s", mlart_guard_error());
                pc = gc.ptr;
                c_bytes = bytes;
            }
            ck_assert(ga.va == 0 || (uintptr_t)ga.ptr + ga.bytes == ga.va + ga.mapped);
            ck_assert(gc.va == 0 || (uintptr_t)gc.ptr + gc.bytes == gc.va + gc.mapped);
            /* same inputs, ordinary storage, same path: the expected bits */
            run_into(&c, &cfgs[ic], da, na * 2, dw, dc, c_bytes, o1, "ordinary allocation");
            run_into(&c, &cfgs[ic], pa, a_bytes, pw, pc, c_bytes, o2, tag);
            cmp_bytes = c_bytes;
            ck_assert_msg(memcmp(o1, o2, cmp_bytes) == 0, "%s: result differs from the ordinary allocation", tag);
            mlart_guard_free(&ga);
            mlart_guard_free(&gw);
            mlart_guard_free(&gc);
            g_runs++;
        }
    }
    ops_bufs_free(&bufs);
    free(o1);
    free(o2);
}

START_TEST(guard_matrix)
{
    uint64_t rng = g_seed ^ (uint64_t)(_i + 7) * 0x9E3779B97F4A7C15ull;
    ck_assert_msg(mlart_guard_init(0) == 0, "%s", mlart_guard_error());
    g_runs = 0;
    for (unsigned ih = 0; ih < sizeof k_H / sizeof k_H[0]; ih++)
        for (int v = 0; v < 2; v++) {
            ops_case q = {0, k_H[ih], k_T[_i], v ? 192 : 128, 512, 64, 0, 0, 0};
            ops_case x = {1, k_H[ih], k_T[_i], 512, v ? 256 : 128, 0, 0, 0, 0};
            guard_shape(&q, &rng);
            guard_shape(&x, &rng);
        }
    printf("guard pages, T=%lld, H in {1,8,11,16,32,64,128}, P in {128,192}, V in {128,256}: %d guarded runs "
           "(q_nope view, w, out view, fused q/q_mqa; paths auto/stream/persistent stream/tiled 64 and 128/generic/direct x5 (one PDL launch)/wgmma x3/ring x7 (four one-item, three PDL, one with K in halves)/swap x2/slice x3 (T <= 16, one PDL, one 32-column at V up)), 0 faults, "
           "bits equal to ordinary allocations (granularity %zu, seed %#llx)\n",
           (long long)k_T[_i], g_runs, mlart_guard_granularity(), (unsigned long long)g_seed);
}
END_TEST

/* The harness itself: weights placed 16 bytes too low, so their last 16
 * bytes lie in the unmapped granule (the view claims them anyway); the op
 * reads them and the launch must fail with an illegal address.  Runs in its
 * own process, as every test here: the fault ends that CUDA context. */
START_TEST(guard_catches_overread)
{
    ops_case c = {0, 4, 2, 128, 512, 64, 0, 0, 0};
    const size_t na = ops_a_elems(&c), nw = ops_w_elems(&c), nc = ops_c_elems(&c);
    mlart_guard_buf gw;
    uint16_t *da, *dc, *pw;
    ops_views v;
    cudaError_t e;
    int rc;
    ck_assert_msg(mlart_guard_init(0) == 0, "%s", mlart_guard_error());
    ck_assert_msg(mlart_guard_alloc(&gw, nw * 2 - 16, 0) == 0, "%s", mlart_guard_error());
    pw = gw.ptr;
    GPU_CUDA(cudaMalloc((void **)&da, na * 2));
    GPU_CUDA(cudaMalloc((void **)&dc, nc * 2));
    GPU_CUDA(cudaMemset(da, 0, na * 2));
    GPU_CUDA(cudaMemset(pw, 0, nw * 2 - 16));
    v = ops_make_views(&c, 0, da, na * 2, pw, nw * 2, dc, nc * 2);
    rc = mlart_query_bmm_cuda(&v.a, &v.w, &v.c, NULL, NULL, 0);
    ck_assert_msg(rc == 0, "launch refused: %s", mlart_last_error());
    e = cudaDeviceSynchronize();
    ck_assert_msg(e != cudaSuccess, "a read 16 bytes past the mapped end did not fault: the harness proves nothing");
    printf("harness check: a read past the mapped end fails with \"%s\"\n", cudaGetErrorString(e));
}
END_TEST

int main(void)
{
    Suite *s;
    TCase *tc;
    if (gpu_test_begin("ops_guard_gpu", &g_seed))
        return 77;
    s = suite_create("ops_guard_gpu");
    tc = tcase_create("guard");
    tcase_set_timeout(tc, 600); /* T = 8192: 1.2 GB outputs, every path, four placements */
    tcase_add_test(tc, guard_catches_overread);
    tcase_add_loop_test(tc, guard_matrix, 0, (int)(sizeof k_T / sizeof k_T[0]));
    suite_add_tcase(s, tc);
    return check_run(s, CK_FORK);
}
