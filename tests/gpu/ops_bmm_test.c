/* GPU correctness of the query absorption and the V up-projection against an
 * fp64 reference of the same bf16 inputs and against the CPU twins: fresh
 * random inputs (seed printed), outputs poisoned with 0xFFFF (bf16 NaN)
 * before every run, sentinels around the output storage, every kernel path,
 * graph replay equal to eager bit for bit, bad input refused. */
#define _DEFAULT_SOURCE /* fork, mmap flags */
#include <check.h>

#include "ops/bmm_cuda.h"
#include "ops/ops.h"
#include "ops_gpu_util.h"
#include "pdl_probe.h"

#define SENT 64           /* sentinel elements on each side of the output storage */
#define SENT_BITS 0xA5A5u /* a finite bf16 no kernel produces by accident here */
#define MAX_SAMPLED 48    /* (h,t) rows compared with the fp64 reference per case */
#define TWIN_MACS (1ll << 24) /* CPU twin run where H*T*K*N is at most this */

static uint64_t g_seed;

typedef struct ops_stats {
    double worst;   /* max |gpu - ref| / bound over compared elements */
    double nrm_err; /* sum (gpu - ref)^2 */
    double nrm_ref; /* sum ref^2 */
    long long compared, twin_diff, twin_elems;
} ops_stats;

static void desc_from_views(const ops_case *c, const ops_views *v, mlart_bmm_desc *d)
{
    memset(d, 0, sizeof *d);
    d->H = c->H;
    d->T = c->T;
    d->K = c->K;
    d->N = c->N;
    d->a = v->a.data;
    d->a_sh = v->a.stride[0];
    d->a_st = v->a.stride[1];
    d->w = v->w.data;
    d->w_sh = v->w.stride[0];
    d->w_sk = v->w.stride[1];
    d->c = v->c.data;
    d->c_sh = v->c.stride[0];
    d->c_st = v->c.stride[1];
    if (c->pe && !c->vup) {
        d->pe_in = v->pe_in.data;
        d->pe_out = v->pe_out.data;
        d->R = c->R;
        d->pi_st = v->pe_in.stride[0];
        d->pi_sh = v->pe_in.stride[1];
        d->po_st = v->pe_out.stride[0];
        d->po_sh = v->pe_out.stride[1];
    }
}

/* Run the op on views v (device or host) through the public entry (cfg NULL)
 * or a forced kernel path. */
static int run_op(const ops_case *c, const ops_views *v, const mlart_bmm_config *cfg, cudaStream_t st)
{
    if (cfg) {
        mlart_bmm_desc d;
        desc_from_views(c, v, &d);
        return mlart_bmm_cuda_run(&d, cfg, st);
    }
    if (c->vup)
        return v->a.device < 0 ? mlart_v_up_bmm_cpu(&v->a, &v->w, &v->c)
                               : mlart_v_up_bmm_cuda(&v->a, &v->w, &v->c, st);
    if (v->a.device < 0)
        return mlart_query_bmm_cpu(&v->a, &v->w, &v->c, c->pe ? &v->pe_in : NULL, c->pe ? &v->pe_out : NULL);
    return mlart_query_bmm_cuda(&v->a, &v->w, &v->c, c->pe ? &v->pe_in : NULL, c->pe ? &v->pe_out : NULL, st);
}

static void poison_device(uint16_t *dbuf, size_t nc)
{
    uint16_t sent[SENT];
    for (int i = 0; i < SENT; i++)
        sent[i] = SENT_BITS;
    GPU_CUDA(cudaMemset(dbuf, 0xFF, (nc + 2 * SENT) * 2));
    GPU_CUDA(cudaMemcpy(dbuf, sent, sizeof sent, cudaMemcpyHostToDevice));
    GPU_CUDA(cudaMemcpy(dbuf + SENT + nc, sent, sizeof sent, cudaMemcpyHostToDevice));
}

/* Every output element written and not NaN, every other element of the
 * output storage (q_pe when not fused, row padding) and the sentinels left
 * as they were; q_pe copied bit for bit when fused. */
static void check_untouched(const ops_case *c, const uint16_t *ha, const uint16_t *hc, const char *tag)
{
    const int64_t AS = ops_as(c), CS = ops_cs(c);
    const size_t nc = ops_c_elems(c);
    for (int i = 0; i < SENT; i++) {
        OPS_REQUIRE(hc[i] == SENT_BITS, "%s: sentinel before output changed at -%d", tag, SENT - i);
        OPS_REQUIRE(hc[SENT + nc + i] == SENT_BITS, "%s: sentinel after output changed at +%d", tag, i);
    }
    for (int64_t t = 0; t < c->T; t++)
        for (int64_t h = 0; h < c->H; h++) {
            const uint16_t *row = hc + SENT + (t * c->H + h) * CS;
            int64_t n = 0;
            for (; n < c->N; n++)
                OPS_REQUIRE(!isnan(mlart_bf16_to_f32(row[n])), "%s: out[h=%lld,t=%lld,n=%lld] unwritten or NaN",
                              tag, (long long)h, (long long)t, (long long)n);
            if (!c->vup)
                for (int64_t r = 0; r < c->R; r++, n++) {
                    uint16_t want = c->pe ? ha[(t * c->H + h) * AS + c->K + r] : 0xFFFFu;
                    OPS_REQUIRE(row[n] == want, "%s: q_pe column %lld of (t=%lld,h=%lld) is %#x, want %#x", tag,
                                  (long long)r, (long long)t, (long long)h, row[n], want);
                }
            for (; n < CS; n++)
                OPS_REQUIRE(row[n] == 0xFFFFu, "%s: padding element %lld of (t=%lld,h=%lld) written", tag,
                              (long long)n, (long long)t, (long long)h);
        }
}

/* Compare sampled rows of hc (output storage with sentinels) with fp64. */
static void check_vs_ref(const ops_case *c, const uint16_t *ha, const uint16_t *hw, const uint16_t *hc,
                         const uint16_t *htwin, uint64_t *rng, ops_stats *s, const char *tag)
{
    double *ref = malloc(sizeof(double) * (size_t)c->N), *mag = malloc(sizeof(double) * (size_t)c->N);
    const int64_t pairs = c->H * c->T;
    const int64_t nsamp = pairs <= MAX_SAMPLED ? pairs : MAX_SAMPLED;
    ck_assert(ref && mag);
    for (int64_t i = 0; i < nsamp; i++) {
        int64_t h, t;
        if (pairs <= MAX_SAMPLED) {
            h = i % c->H;
            t = i / c->H;
        } else if (i < 4) { /* the corners, then random rows */
            h = (i & 1) ? c->H - 1 : 0;
            t = (i & 2) ? c->T - 1 : 0;
        } else {
            h = (int64_t)(gpu_rand(rng) % (uint64_t)c->H);
            t = (int64_t)(gpu_rand(rng) % (uint64_t)c->T);
        }
        ops_ref_row(c, ha, hw, h, t, ref, mag);
        const int64_t off = SENT + (t * c->H + h) * ops_cs(c);
        for (int64_t n = 0; n < c->N; n++) {
            double g = mlart_bf16_to_f32(hc[off + n]);
            double b = ops_bound(c, ref[n], mag[n]);
            double e = fabs(g - ref[n]);
            OPS_REQUIRE(e <= b, "%s: out[h=%lld,t=%lld,n=%lld] = %.9g, fp64 %.9g, |err| %.3g > bound %.3g", tag,
                          (long long)h, (long long)t, (long long)n, g, ref[n], e, b);
            if (e / b > s->worst)
                s->worst = e / b;
            s->nrm_err += e * e;
            s->nrm_ref += ref[n] * ref[n];
            s->compared++;
            if (htwin) {
                double tw = mlart_bf16_to_f32(htwin[off + n]);
                OPS_REQUIRE(fabs(tw - ref[n]) <= b, "%s: CPU twin out[h=%lld,t=%lld,n=%lld] = %.9g, fp64 %.9g", tag,
                              (long long)h, (long long)t, (long long)n, tw, ref[n]);
            }
        }
    }
    free(ref);
    free(mag);
}

/* One case: fresh inputs, poisoned output, run, check everything. */
static void run_case(const ops_case *c, const mlart_bmm_config *cfg, uint64_t *rng, int twin, ops_stats *s)
{
    char tag[160];
    const size_t na = ops_a_elems(c), nw = ops_w_elems(c), nc = ops_c_elems(c);
    uint16_t *hc = malloc((nc + 2 * SENT) * 2), *ht = NULL;
    ops_views v;
    int rc;
    snprintf(tag, sizeof tag, "%s H=%lld T=%lld K=%lld N=%lld pe=%d apad=%d cpad=%d path=%d mt=%d warps=%d",
             c->vup ? "v_up" : "query", (long long)c->H, (long long)c->T, (long long)c->K, (long long)c->N, c->pe,
             c->apad, c->cpad, cfg ? cfg->path : 0, cfg ? cfg->mt : 0, cfg ? cfg->warps : 0);
    ck_assert(hc);
    ops_bufs b = ops_upload(c, rng, nc + 2 * SENT);
    uint16_t *const ha = b.ha, *const hw = b.hw, *const da = b.da, *const dw = b.dw, *const dc = b.dc;
    poison_device(dc, nc);
    v = ops_make_views(c, 0, da, na * 2, dw, nw * 2, dc + SENT, nc * 2);
    rc = run_op(c, &v, cfg, 0);
    ck_assert_msg(rc == 0, "%s: rc %d: %s", tag, rc, mlart_last_error());
    GPU_CUDA(cudaGetLastError());
    GPU_CUDA(cudaDeviceSynchronize());
    GPU_CUDA(cudaMemcpy(hc, dc, (nc + 2 * SENT) * 2, cudaMemcpyDeviceToHost));
    check_untouched(c, ha, hc, tag);

    if (twin && c->H * c->T * c->K * c->N <= TWIN_MACS) {
        ops_views hv;
        ht = malloc((nc + 2 * SENT) * 2);
        ck_assert(ht);
        for (size_t i = 0; i < nc + 2 * SENT; i++)
            ht[i] = (i < SENT || i >= SENT + nc) ? SENT_BITS : 0xFFFFu;
        hv = ops_make_views(c, -1, ha, na * 2, hw, nw * 2, ht + SENT, nc * 2);
        rc = run_op(c, &hv, NULL, 0);
        ck_assert_msg(rc == 0, "%s: CPU twin rc %d: %s", tag, rc, mlart_last_error());
        check_untouched(c, ha, ht, "CPU twin");
        for (size_t i = 0; i < nc + 2 * SENT; i++)
            s->twin_diff += ht[i] != hc[i];
        s->twin_elems += (long long)nc;
    }
    check_vs_ref(c, ha, hw, hc, ht, rng, s, tag);
    ops_bufs_free(&b);
    free(hc);
    free(ht);
}

static void print_stats(const char *what, const ops_stats *s)
{
    printf("%s: %lld elements vs fp64, worst |err|/bound %.3f, norm-wise rel err %.3g (bound 2^-8 = %.3g); "
           "CPU twin: %lld of %lld elements differ by bits (seed %#llx)\n",
           what, s->compared, s->worst, sqrt(s->nrm_err / (s->nrm_ref > 0 ? s->nrm_ref : 1)), ldexp(1, -8),
           s->twin_diff, s->twin_elems, (unsigned long long)g_seed);
}

static void check_norm(const ops_stats *s)
{
    ck_assert_msg(sqrt(s->nrm_err / s->nrm_ref) <= ldexp(1, -8), "norm-wise relative error %.3g > 2^-8",
                  sqrt(s->nrm_err / s->nrm_ref));
}

static const int64_t k_T[] = {1, 2, 3, 6, 9, 11, 16, 32, 64, 75, 256, 8192};
static const int64_t k_H[] = {1, 8, 11, 16, 32, 64, 128};

/* T = 8192 runs with H <= 16 only (H = 32..128 would take minutes of
 * host-side reference and data generation for no new code path). */
static int pruned(int64_t T, int64_t H)
{
    return T == 8192 && H > 16;
}

START_TEST(query_matrix)
{
    uint64_t rng = g_seed ^ (uint64_t)(_i + 1) * 0x9E3779B97F4A7C15ull;
    ops_stats s = {0};
    char what[64];
    for (unsigned ih = 0; ih < sizeof k_H / sizeof k_H[0]; ih++)
        for (int p = 0; p < 2; p++) {
            ops_case c = {0, k_H[ih], k_T[_i], p ? 192 : 128, 512, 64, (int)(ih % 2 == 0), 0, 0};
            if (pruned(c.T, c.H))
                continue;
            run_case(&c, NULL, &rng, 1, &s);
        }
    snprintf(what, sizeof what, "query_bmm T=%lld, H in {1..128}, P in {128,192}", (long long)k_T[_i]);
    print_stats(what, &s);
    check_norm(&s);
}
END_TEST

START_TEST(vup_matrix)
{
    uint64_t rng = g_seed ^ (uint64_t)(_i + 101) * 0x9E3779B97F4A7C15ull;
    ops_stats s = {0};
    char what[64];
    for (unsigned ih = 0; ih < sizeof k_H / sizeof k_H[0]; ih++)
        for (int vv = 0; vv < 2; vv++) {
            ops_case c = {1, k_H[ih], k_T[_i], 512, vv ? 256 : 128, 0, 0, 0, 0};
            if (pruned(c.T, c.H))
                continue;
            run_case(&c, NULL, &rng, 1, &s);
        }
    snprintf(what, sizeof what, "v_up_bmm T=%lld, H in {1..128}, V in {128,256}", (long long)k_T[_i]);
    print_stats(what, &s);
    check_norm(&s);
}
END_TEST

/* The wgmma path forced on the prefill-sized and decode-edge shapes: T in
 * {64, 75, 256, 8192} x H in {1, 11, 128} x P in {128, 192}, with and
 * without the fused q_pe copy, default configuration (two warpgroups,
 * 256-column slices, automatic row chunks); then, except at H = 128 and
 * T = 8192, one warpgroup a block with 128-column slices (one row chunk at
 * T = 8192) unfused, and two warpgroups with 128-column slices fused.
 * H = 128 at T = 8192 runs one case per P (fused at P = 192): 1.2 GB of
 * output per case on the host side. */
static const int64_t k_wT[] = {64, 75, 256, 8192};

/* One forced path over H in {1, 11, 128} x P in {128, 192} x (q_pe fused
 * or not) at one T, each case in the configurations cfgs_of gives (at
 * most 8), or where cfgs_of is NULL in the n configurations at `fixed`;
 * with `first` also output rows that are not 8-byte aligned (element
 * stores, q_pe out of 16-byte step) in the path's defaults. */
typedef int (*forced_cfgs_fn)(const ops_case *c, mlart_bmm_config cfgs[8]);

static void forced_matrix(const char *name, int path, int64_t T, int first, uint64_t rng, forced_cfgs_fn cfgs_of,
                          const mlart_bmm_config *fixed, int n_fixed)
{
    static const int64_t Hs[] = {1, 11, 128};
    ops_stats s = {0};
    char what[96];
    int cases = 0;
    for (unsigned ih = 0; ih < 3; ih++)
        for (int p = 0; p < 2; p++)
            for (int pe = 0; pe < 2; pe++) {
                ops_case c = {0, Hs[ih], T, p ? 192 : 128, 512, 64, pe, 0, 0};
                mlart_bmm_config cfgs[8];
                const int n = cfgs_of ? cfgs_of(&c, cfgs) : n_fixed;
                for (int i = 0; i < n; i++)
                    run_case(&c, cfgs_of ? &cfgs[i] : &fixed[i], &rng, 0, &s);
                cases += n;
            }
    if (first) {
        ops_case c = {0, 5, 37, 128, 512, 64, 1, 8, 3};
        mlart_bmm_config cfg = {path, 0, 0, 0, 0, 0, 0};
        run_case(&c, &cfg, &rng, 0, &s);
        cases++;
    }
    snprintf(what, sizeof what, "%s path T=%lld, H in {1,11,128}, P in {128,192}, %d cases", name, (long long)T,
             cases);
    print_stats(what, &s);
    check_norm(&s);
}

static int wgmma_cfgs(const ops_case *c, mlart_bmm_config cfgs[8])
{
    const int big = c->T == 8192 && c->H == 128;
    if (big && c->pe != (c->K == 192))
        return 0;
    cfgs[0] = (mlart_bmm_config){MLART_BMM_WGMMA, 0, 0, 0, 0, 0, 0};
    if (big)
        return 1;
    cfgs[1] = (mlart_bmm_config){MLART_BMM_WGMMA, !c->pe && c->T == 8192 ? 1 : 0, c->pe ? 2 : 1, 0, 128, 0, 0};
    return 2;
}

START_TEST(wgmma_matrix)
{
    forced_matrix("wgmma", MLART_BMM_WGMMA, k_wT[_i], _i == 0, g_seed ^ (uint64_t)(_i + 201) * 0x9E3779B97F4A7C15ull,
                  wgmma_cfgs, NULL, 0);
}
END_TEST

/* The ring path forced on T in {1, 4, 16, 64, 75} x H in {1, 11, 128} x P
 * in {128, 192}, with and without the fused q_pe copy: the default
 * configuration (128-column slices, as many stages as fit, one block an
 * SM), then 64-column slices with two blocks an SM (two or three stages)
 * unfused and 64-column slices with 3 stages fused, then one stage with
 * three blocks an SM, then the one-item form (a block per item, its K
 * blocks in copy groups of their own) with 64-column slices, and with
 * 128- and 64-column slices launched with PDL (the weights copied before
 * the wait), then with K in two halves summed apart, plainly and with
 * PDL.  At H = 128 a block takes several items, so the ring wraps
 * around. */
static const int64_t k_rT[] = {1, 4, 16, 64, 75};

static int ring_cfgs(const ops_case *c, mlart_bmm_config cfgs[8])
{
    cfgs[0] = (mlart_bmm_config){MLART_BMM_RING, 0, 0, 0, 0, 0, 0};
    cfgs[1] = (mlart_bmm_config){MLART_BMM_RING, c->pe ? 3 : 0, 0, 0, 64, c->pe ? 1 : 2, 0};
    cfgs[2] = (mlart_bmm_config){MLART_BMM_RING, 1, 0, 0, 128, 3, 0};
    cfgs[3] = (mlart_bmm_config){MLART_BMM_RING, 0, 1, 0, 64, 0, 0};
    cfgs[4] = (mlart_bmm_config){MLART_BMM_RING, 0, 1, 0, 128, 0, 1};
    cfgs[5] = (mlart_bmm_config){MLART_BMM_RING, 0, 1, 0, 64, 0, 1};
    cfgs[6] = (mlart_bmm_config){MLART_BMM_RING, 0, 2, 0, 64, 0, 0};
    cfgs[7] = (mlart_bmm_config){MLART_BMM_RING, 0, 2, 0, 64, 0, 1};
    return 8;
}

START_TEST(ring_matrix)
{
    forced_matrix("ring", MLART_BMM_RING, k_rT[_i], _i == 0, g_seed ^ (uint64_t)(_i + 301) * 0x9E3779B97F4A7C15ull,
                  ring_cfgs, NULL, 0);
}
END_TEST

/* The swap path forced on T in {1, 4, 8, 9, 16, 64, 75} x H in {1, 11,
 * 128} x P in {128, 192}, with and without the fused q_pe copy: the
 * default configuration (256-column blocks, 8 or 16 token rows a tile by
 * T), then 128-column blocks with 8-row tiles, 256-column blocks with
 * 16-row tiles, 512-column blocks, and 64-row tiles with 64- and
 * 256-column blocks.  T > 16 takes several token tiles per head; at H = 128 each
 * block takes several items, so the ring of stages wraps around. */
static const int64_t k_sT[] = {1, 4, 8, 9, 16, 64, 75};

static const mlart_bmm_config k_swap_cfgs[] = {
    {MLART_BMM_SWAP, 0, 0, 0, 0, 0, 0},   {MLART_BMM_SWAP, 8, 0, 0, 128, 0, 0}, {MLART_BMM_SWAP, 16, 0, 0, 256, 0, 0},
    {MLART_BMM_SWAP, 0, 0, 0, 512, 0, 0}, {MLART_BMM_SWAP, 64, 0, 0, 64, 0, 0}, {MLART_BMM_SWAP, 64, 0, 0, 256, 0, 0}};

START_TEST(swap_matrix)
{
    forced_matrix("swap", MLART_BMM_SWAP, k_sT[_i], _i == 0, g_seed ^ (uint64_t)(_i + 401) * 0x9E3779B97F4A7C15ull,
                  NULL, k_swap_cfgs, (int)(sizeof k_swap_cfgs / sizeof k_swap_cfgs[0]));
}
END_TEST

/* The slice path forced on T in {1, 2, 3, 4, 5, 8, 11, 16} x H in {1, 11, 128} x
 * P in {128, 192}, with and without the fused q_pe copy: plainly with its
 * default chains of K, with one and with two chains, and with PDL; at
 * T = 1 also rows of a and c that are not 16-byte aligned (the token rows
 * copied element by element, element stores) at T = 5, 7 and 13. */
static const int64_t k_slT[] = {1, 2, 3, 4, 5, 8, 11, 16};

static const mlart_bmm_config k_slice_cfgs[] = {{MLART_BMM_SLICE, 0, 0, 0, 0, 0, 0},
                                                 {MLART_BMM_SLICE, 0, 1, 0, 0, 0, 0},
                                                 {MLART_BMM_SLICE, 0, 2, 0, 0, 0, 0},
                                                 {MLART_BMM_SLICE, 0, 0, 0, 0, 0, 1}};

START_TEST(slice_matrix)
{
    forced_matrix("slice", MLART_BMM_SLICE, k_slT[_i], 0, g_seed ^ (uint64_t)(_i + 601) * 0x9E3779B97F4A7C15ull,
                  NULL, k_slice_cfgs, (int)(sizeof k_slice_cfgs / sizeof k_slice_cfgs[0]));
    if (_i == 0) {
        uint64_t rng = g_seed ^ 0x601ull;
        ops_stats s = {0};
        const mlart_bmm_config cfg = {MLART_BMM_SLICE, 0, 0, 0, 0, 0, 0};
        const ops_case odd[] = {{0, 5, 7, 192, 512, 64, 1, 1, 3}, {0, 3, 5, 128, 512, 64, 0, 3, 1},
                                {0, 5, 13, 192, 512, 64, 1, 1, 3}};
        for (unsigned i = 0; i < sizeof odd / sizeof odd[0]; i++)
            run_case(&odd[i], &cfg, &rng, 0, &s);
        print_stats("slice path, rows of a and c not 16-byte aligned, T in {5, 7, 13}", &s);
        check_norm(&s);
    }
}
END_TEST

/* The summary line and the norm-wise check of a forced V up-projection
 * matrix (vup_forced and its extra cases) on `path` at T. */
static void vup_report(const char *path, int64_t T, int cases, const ops_stats *s)
{
    char what[96];
    snprintf(what, sizeof what, "%s path, v_up T=%lld, H in {1,11,128}, V in {128,256}, %d cases", path, (long long)T,
             cases);
    print_stats(what, s);
    check_norm(s);
}

/* The V up-projection (K = 512) forced onto cfgs at T x H in {1, 11, 128}
 * x V in {128, 256}: the first n128 configurations at V = 128, the first
 * n256 at V = 256.  Returns the cases run. */
static int vup_forced(int64_t T, const mlart_bmm_config *cfgs, int n128, int n256, uint64_t *rng, ops_stats *s)
{
    static const int64_t Hs[] = {1, 11, 128};
    int cases = 0;
    for (unsigned ih = 0; ih < 3; ih++)
        for (int vv = 0; vv < 2; vv++) {
            const ops_case c = {1, Hs[ih], T, 512, vv ? 256 : 128, 0, 0, 0, 0};
            for (int i = 0; i < (vv ? n256 : n128); i++, cases++)
                run_case(&c, &cfgs[i], rng, 0, s);
        }
    return cases;
}

/* The wgmma path on the V up-projection (K = 512: the weight slice
 * resident, the activation through a TMA-fed ring of K blocks): T in {65,
 * 256, 1000, 8192} x H in {1, 11, 128} x V in {128, 256}: the default
 * (128-column slices, chunks filling every SM), 64-column slices in one
 * chunk a (head, slice), 128 columns in three chunks; at T = 8192 the
 * default only.  At T = 300 also output rows that are not 8-byte aligned
 * (element stores) and, automatically chosen, activation rows that are not
 * 16-byte aligned (the TMA cannot describe them: another path). */
static const int64_t k_vwT[] = {65, 256, 1000, 8192};

/* Every output element of c on the forced wgmma path with `cols`-column
 * slices (0: the default) and `splits` row-tile chunks per (head, slice)
 * (0: the default), twice, against the tiled path on the same
 * inputs: the two wgmma runs equal bit for bit (a race between the copies
 * and the multiplies would show as a difference somewhere in the output,
 * which a sample of elements can miss) and each element within two bf16
 * roundings of the tiled one (another summation order in fp32). */
static void vup_wgmma_whole(const ops_case *c, int cols, int splits, uint64_t *rng)
{
    const mlart_bmm_config wg = {MLART_BMM_WGMMA, splits, 0, 0, cols, 0, 0}, tiled = {MLART_BMM_TILED, 0, 0, 0, 0, 0, 0};
    const size_t na = ops_a_elems(c), nw = ops_w_elems(c), nc = ops_c_elems(c);
    ops_bufs b = ops_upload(c, rng, nc);
    uint16_t *h[3], *const dc = b.dc;
    long long bad = 0;
    const ops_views v = ops_make_views(c, 0, b.da, na * 2, b.dw, nw * 2, dc, nc * 2);
    for (int r = 0; r < 3; r++) {
        h[r] = malloc(nc * 2);
        ck_assert(h[r]);
        GPU_CUDA(cudaMemset(dc, 0xFF, nc * 2));
        ck_assert_int_eq(run_op(c, &v, r < 2 ? &wg : &tiled, 0), 0);
        GPU_CUDA(cudaDeviceSynchronize());
        GPU_CUDA(cudaMemcpy(h[r], dc, nc * 2, cudaMemcpyDeviceToHost));
    }
    ck_assert_msg(memcmp(h[0], h[1], nc * 2) == 0, "v_up H %lld T %lld V %lld n%d chunks %d: two wgmma runs differ",
                  (long long)c->H, (long long)c->T, (long long)c->N, cols, splits);
    for (size_t i = 0; i < nc; i++) {
        const double x = mlart_bf16_to_f32(h[0][i]), y = mlart_bf16_to_f32(h[2][i]);
        bad += !(fabs(x - y) <= ldexp(fmax(fabs(x), fabs(y)), -7) + 1e-30);
    }
    ck_assert_msg(bad == 0,
                  "v_up H %lld T %lld V %lld n%d chunks %d: %lld of %zu elements off the tiled path's by more than two "
                  "bf16 roundings",
                  (long long)c->H, (long long)c->T, (long long)c->N, cols, splits, bad, nc);
    printf("wgmma path n%d chunks %d, v_up H %lld T %lld V %lld: all %zu elements equal in two runs, within two bf16 "
           "roundings of the tiled path\n",
           cols ? cols : 128, splits, (long long)c->H, (long long)c->T, (long long)c->N, nc);
    for (int r = 0; r < 3; r++)
        free(h[r]);
    ops_bufs_free(&b);
}

START_TEST(vup_wgmma_matrix)
{
    static const mlart_bmm_config cfgs[] = {{MLART_BMM_WGMMA, 0, 0, 0, 0, 0, 0},
                                            {MLART_BMM_WGMMA, 1, 2, 0, 64, 0, 0},
                                            {MLART_BMM_WGMMA, 3, 0, 0, 128, 0, 0}};
    const int n = k_vwT[_i] == 8192 ? 1 : (int)(sizeof cfgs / sizeof cfgs[0]);
    uint64_t rng = g_seed ^ (uint64_t)(_i + 801) * 0x9E3779B97F4A7C15ull;
    ops_stats s = {0};
    int cases = vup_forced(k_vwT[_i], cfgs, n, n, &rng, &s);
    if (_i == 0) {
        const ops_case cpad = {1, 3, 300, 512, 128, 0, 0, 0, 3}, apad = {1, 3, 300, 512, 256, 0, 0, 1, 0};
        mlart_bmm_desc d;
        ops_views v;
        run_case(&cpad, &cfgs[0], &rng, 0, &s);
        run_case(&apad, NULL, &rng, 0, &s);
        cases += 2;
        v = ops_make_views(&apad, 0, (void *)(uintptr_t)256, ops_a_elems(&apad) * 2, (void *)(uintptr_t)256,
                           ops_w_elems(&apad) * 2, (void *)(uintptr_t)256, ops_c_elems(&apad) * 2);
        desc_from_views(&apad, &v, &d);
        ck_assert_int_ne(mlart_bmm_cuda_path(&d, NULL), MLART_BMM_WGMMA);
        ck_assert_int_eq(mlart_bmm_cuda_path(&d, &cfgs[0]), -1);
    }
    if (k_vwT[_i] == 8192) /* up to two items a block at 128 columns, four at 64 (V = 256: 512 slices over 132 SMs) */
        for (int vv = 0; vv < 4; vv++) {
            const ops_case big = {1, 128, 8192, 512, vv & 1 ? 256 : 128, 0, 0, 0, 0};
            vup_wgmma_whole(&big, vv < 2 ? 0 : 64, 0, &rng);
        }
    if (k_vwT[_i] == 256) { /* one row tile a chunk, so the weights by K block at 64 columns too, and up to 8
                               (128 columns) or 16 (64) items a block: H128 x V256 slices x 4 chunks over 132 SMs;
                               then the default, four tiles a chunk and two items a block: two producers */
        const ops_case big = {1, 128, 256, 512, 256, 0, 0, 0, 0};
        for (int vv = 0; vv < 2; vv++)
            vup_wgmma_whole(&big, vv ? 64 : 128, 4, &rng);
        vup_wgmma_whole(&big, 0, 0, &rng);
    }
    vup_report("wgmma", k_vwT[_i], cases, &s);
}
END_TEST

/* The slice path on the V up-projection: T in {1, 2, 3, 4, 5, 8, 11, 16}
 * x H in {1, 11, 128} x V in {128, 256}: plainly with its default (two
 * chains of K, 64 columns a block), with one and four chains, with 32
 * columns a block and two or four chains, and the default with PDL; at
 * T = 1 also rows of x and o that are not 16-byte aligned at T = 5, 7 and
 * 13. */
START_TEST(vup_slice_matrix)
{
    static const mlart_bmm_config cfgs[] = {
        {MLART_BMM_SLICE, 0, 0, 0, 0, 0, 0},  {MLART_BMM_SLICE, 0, 1, 0, 64, 0, 0}, {MLART_BMM_SLICE, 0, 4, 0, 0, 0, 0},
        {MLART_BMM_SLICE, 0, 2, 0, 32, 0, 0}, {MLART_BMM_SLICE, 0, 4, 0, 32, 0, 0}, {MLART_BMM_SLICE, 0, 0, 0, 0, 0, 1}};
    const int n = (int)(sizeof cfgs / sizeof cfgs[0]);
    uint64_t rng = g_seed ^ (uint64_t)(_i + 701) * 0x9E3779B97F4A7C15ull;
    ops_stats s = {0};
    int cases = vup_forced(k_slT[_i], cfgs, n, n, &rng, &s);
    if (_i == 0) {
        const ops_case odd[] = {{1, 5, 7, 512, 128, 0, 0, 1, 3}, {1, 3, 5, 512, 256, 0, 0, 3, 1},
                                {1, 5, 13, 512, 128, 0, 0, 1, 3}};
        for (unsigned i = 0; i < sizeof odd / sizeof odd[0]; i++, cases += 2) {
            run_case(&odd[i], &cfgs[0], &rng, 0, &s);
            run_case(&odd[i], &cfgs[3], &rng, 0, &s);
        }
    }
    vup_report("slice", k_slT[_i], cases, &s);
}
END_TEST

/* The swap path on the V up-projection (K = 512, a head-major activation
 * view {K, T, H}): T in {1, 4, 8, 9, 16, 64, 75} x H in {1, 11, 128} x V in
 * {128, 256}: 128-column blocks with the default token tiles and with
 * 64-row tiles, 64-column blocks with 16-row tiles, and at V = 256 the
 * default 256-column blocks. */
START_TEST(vup_swap_matrix)
{
    static const mlart_bmm_config cfgs[4] = {{MLART_BMM_SWAP, 0, 0, 0, 128, 0, 0},
                                             {MLART_BMM_SWAP, 64, 0, 0, 128, 0, 0},
                                             {MLART_BMM_SWAP, 16, 0, 0, 64, 0, 0},
                                             {MLART_BMM_SWAP, 0, 0, 0, 256, 0, 0}};
    uint64_t rng = g_seed ^ (uint64_t)(_i + 501) * 0x9E3779B97F4A7C15ull;
    ops_stats s = {0};
    const int cases = vup_forced(k_sT[_i], cfgs, 3, 4, &rng, &s);
    vup_report("swap", k_sT[_i], cases, &s);
}
END_TEST

/* Every kernel path forced on the same shapes, odd strides (no 16-byte
 * access possible), and sizes only the generic path serves. */
START_TEST(paths)
{
    uint64_t rng = g_seed ^ 0x5151ull;
    ops_stats s = {0};
    static const int64_t Ts[] = {1, 17, 75, 300};
    static const mlart_bmm_config cfgs[] = {
        {MLART_BMM_STREAM, 0, 0, 0, 0, 0, 0},  {MLART_BMM_STREAM, 1, 12, 0, 0, 0, 0}, {MLART_BMM_STREAM, 2, 6, 0, 0, 0, 0},
        {MLART_BMM_STREAM, 3, 2, 0, 0, 0, 0},  {MLART_BMM_STREAM, 4, 4, 0, 0, 0, 0},  {MLART_BMM_PSTREAM, 0, 0, 0, 0, 0, 0},
        {MLART_BMM_PSTREAM, 1, 4, 0, 0, 0, 0}, {MLART_BMM_PSTREAM, 2, 6, 0, 0, 0, 0}, {MLART_BMM_PSTREAM, 1, 3, 0, 0, 0, 0},
        {MLART_BMM_TILED, 0, 0, 64, 0, 0, 0},  {MLART_BMM_TILED, 0, 0, 128, 0, 0, 0}, {MLART_BMM_GENERIC, 0, 0, 0, 0, 0, 0},
        /* direct: auto; cols x split x groups x row tiles per warp */
        {MLART_BMM_DIRECT, 0, 0, 0, 0, 0, 0},  {MLART_BMM_DIRECT, 1, 1, 0, 32, 4, 0}, {MLART_BMM_DIRECT, 4, 2, 0, 64, 1, 0},
        {MLART_BMM_DIRECT, 2, 2, 0, 16, 2, 0}, {MLART_BMM_DIRECT, 3, 1, 0, 16, 1, 0}, {MLART_BMM_DIRECT, 0, 2, 0, 32, 2, 0},
        /* direct with a staged in shared memory (bm = 1) */
        {MLART_BMM_DIRECT, 4, 1, 1, 32, 4, 0}, {MLART_BMM_DIRECT, 2, 2, 1, 64, 1, 0},
        /* direct, launched with programmatic dependent launch */
        {MLART_BMM_DIRECT, 0, 0, 0, 0, 0, 1},
        /* wgmma: default; 2 row chunks, one warpgroup, 128-column slices */
        {MLART_BMM_WGMMA, 0, 0, 0, 0, 0, 0},   {MLART_BMM_WGMMA, 2, 1, 0, 128, 0, 0},
        /* ring: default; 64-column slices, 2 stages, two blocks an SM */
        {MLART_BMM_RING, 0, 0, 0, 0, 0, 0},    {MLART_BMM_RING, 2, 0, 0, 64, 2, 0},
        /* swap: default; 128-column blocks with 16-row token tiles, PDL */
        {MLART_BMM_SWAP, 0, 0, 0, 0, 0, 0},    {MLART_BMM_SWAP, 16, 0, 0, 128, 0, 1}};
    for (unsigned it = 0; it < 4; it++)
        for (unsigned ic = 0; ic < sizeof cfgs / sizeof cfgs[0]; ic++) {
            ops_case q = {0, 3, Ts[it], 192, 512, 64, 1, 0, 0};
            ops_case x = {1, 2, Ts[it], 512, 256, 0, 0, 0, 8};
            mlart_bmm_config cv = cfgs[ic];
            run_case(&q, &cfgs[ic], &rng, 0, &s);
            if (cv.path == MLART_BMM_RING || cv.path == MLART_BMM_SWAP)
                continue; /* K = 512 is not served */
            if (cv.path == MLART_BMM_WGMMA) { /* K = 512: two warpgroups, a ring of K blocks */
                cv.warps = 0;
                run_case(&x, &cv, &rng, 0, &s);
                continue;
            }
            if (cv.warps) /* K = 512: 32 k-steps; 8 warps suit every row tile */
                cv.warps = 8;
            if (cv.path == MLART_BMM_DIRECT && cv.groups) /* 8 warps split K: one column group a block */
                cv.groups = 1;
            run_case(&x, &cv, &rng, 0, &s);
        }
    {
        /* odd row strides: a and c rows not 16-byte aligned */
        ops_case q1 = {0, 5, 37, 128, 512, 64, 1, 1, 3};
        ops_case x1 = {1, 3, 29, 512, 128, 0, 0, 3, 1};
        ops_case g1 = {0, 3, 7, 40, 72, 64, 1, 0, 0}; /* P=40, L=72: generic only */
        mlart_bmm_config tiled = {MLART_BMM_TILED, 0, 0, 0, 0, 0, 0}, stream = {MLART_BMM_STREAM, 0, 0, 0, 0, 0, 0};
        mlart_bmm_config pstream = {MLART_BMM_PSTREAM, 0, 0, 0, 0, 0, 0};
        mlart_bmm_desc d;
        run_case(&q1, NULL, &rng, 1, &s);
        run_case(&q1, &stream, &rng, 0, &s);
        {
            mlart_bmm_config direct = {MLART_BMM_DIRECT, 2, 2, 0, 16, 2, 0};
            run_case(&q1, &direct, &rng, 0, &s); /* 2-byte loads of a, element stores of c */
            direct.bm = 1;
            run_case(&q1, &direct, &rng, 0, &s); /* element copies into shared memory */
        }
        run_case(&x1, NULL, &rng, 1, &s);
        run_case(&g1, NULL, &rng, 1, &s);
        memset(&d, 0, sizeof d);
        d.H = 1;
        d.T = 300;
        d.K = 128;
        d.N = 512;
        d.a = (const void *)(uintptr_t)2; /* misaligned: refused before any launch */
        d.w = (const void *)(uintptr_t)16;
        d.c = (void *)(uintptr_t)16;
        d.a_st = 131;
        d.w_sk = 512;
        d.c_st = 512;
        ck_assert_int_eq(mlart_bmm_cuda_run(&d, &tiled, 0), MLART_ENOTSUP);
        ck_assert_int_eq(mlart_bmm_cuda_run(&d, &pstream, 0), MLART_ENOTSUP);
        {
            mlart_bmm_config wg = {MLART_BMM_WGMMA, 0, 0, 0, 0, 0, 0};
            ck_assert_int_eq(mlart_bmm_cuda_run(&d, &wg, 0), MLART_ENOTSUP); /* a rows not 16-byte aligned */
            d.a = (const void *)(uintptr_t)16;
            d.a_st = 136;
            wg.warps = 3; /* one or two warpgroups */
            ck_assert_int_eq(mlart_bmm_cuda_run(&d, &wg, 0), MLART_ENOTSUP);
            wg.warps = 0;
            wg.cols = 192; /* 128- or 256-column slices */
            ck_assert_int_eq(mlart_bmm_cuda_run(&d, &wg, 0), MLART_ENOTSUP);
            wg.cols = 256;
            d.K = 512; /* the V up-projection's K: 64- or 128-column slices */
            ck_assert_int_eq(mlart_bmm_cuda_run(&d, &wg, 0), MLART_ENOTSUP);
            wg.cols = 0;
            wg.warps = 1; /* K = 512: two warpgroups */
            ck_assert_int_eq(mlart_bmm_cuda_run(&d, &wg, 0), MLART_ENOTSUP);
            wg.warps = 0;
            d.a = (const void *)(uintptr_t)2;
            d.a_st = 131;
            d.K = 128;
        }
        {
            mlart_bmm_config rg = {MLART_BMM_RING, 0, 0, 0, 0, 0, 0};
            ck_assert_int_eq(mlart_bmm_cuda_run(&d, &rg, 0), MLART_ENOTSUP); /* a rows not 16-byte aligned */
            d.a = (const void *)(uintptr_t)16;
            d.a_st = 136;
            rg.cols = 256; /* 64- or 128-column slices */
            ck_assert_int_eq(mlart_bmm_cuda_run(&d, &rg, 0), MLART_ENOTSUP);
            rg.cols = 128;
            rg.mt = 5; /* 1, 2, 3, 4 or 6 stages */
            ck_assert_int_eq(mlart_bmm_cuda_run(&d, &rg, 0), MLART_ENOTSUP);
            rg.mt = 0;
            rg.groups = 5; /* one to four blocks an SM */
            ck_assert_int_eq(mlart_bmm_cuda_run(&d, &rg, 0), MLART_ENOTSUP);
            rg.groups = 2;
            rg.mt = 3; /* three 48 KB stages do not fit twice in an SM */
            ck_assert_int_eq(mlart_bmm_cuda_run(&d, &rg, 0), MLART_ENOTSUP);
            rg.mt = 0;
            rg.groups = 4;
            d.K = 192; /* one 72 KB stage does not fit four times */
            ck_assert_int_eq(mlart_bmm_cuda_run(&d, &rg, 0), MLART_ENOTSUP);
            rg.warps = 1; /* the one-item form: stages and blocks an SM unused */
            ck_assert_int_eq(mlart_bmm_cuda_path(&d, &rg), MLART_BMM_RING);
            rg.warps = 2; /* K in halves: 64-column slices only */
            ck_assert_int_eq(mlart_bmm_cuda_run(&d, &rg, 0), MLART_ENOTSUP);
            rg.cols = 64;
            ck_assert_int_eq(mlart_bmm_cuda_path(&d, &rg), MLART_BMM_RING);
            rg.warps = 3; /* 0 (the ring), 1 (one item a block) or 2 (the same, K in halves) */
            ck_assert_int_eq(mlart_bmm_cuda_run(&d, &rg, 0), MLART_ENOTSUP);
            rg.cols = 128;
            rg.warps = 0;
            rg.groups = 0;
            d.K = 64; /* K = 128 or 192 */
            ck_assert_int_eq(mlart_bmm_cuda_run(&d, &rg, 0), MLART_ENOTSUP);
            d.a = (const void *)(uintptr_t)2;
            d.a_st = 131;
            d.K = 128;
        }
        {
            /* head strides the tensor maps can describe, so that each
             * refusal below has the one reason it names (the path is
             * checked to accept the view first) */
            mlart_bmm_config sw = {MLART_BMM_SWAP, 0, 0, 0, 0, 0, 0};
            d.a_sh = 131;
            d.w_sh = 128 * 512;
            ck_assert_int_eq(mlart_bmm_cuda_run(&d, &sw, 0), MLART_ENOTSUP); /* a rows not 16-byte aligned */
            d.a = (const void *)(uintptr_t)16;
            d.a_st = 136;
            d.a_sh = 136;
            ck_assert_int_eq(mlart_bmm_cuda_path(&d, &sw), MLART_BMM_SWAP);
            sw.cols = 96; /* 64, 128, 256 or 512 columns a block */
            ck_assert_int_eq(mlart_bmm_cuda_run(&d, &sw, 0), MLART_ENOTSUP);
            sw.cols = 512;
            sw.mt = 64; /* 64-row token tiles with at most 256 columns */
            ck_assert_int_eq(mlart_bmm_cuda_run(&d, &sw, 0), MLART_ENOTSUP);
            sw.cols = 0;
            sw.mt = 4; /* 8, 16 or 64 token rows a tile */
            ck_assert_int_eq(mlart_bmm_cuda_run(&d, &sw, 0), MLART_ENOTSUP);
            sw.mt = 0;
            d.w_sh = 128 * 512 - 8; /* heads of w overlap: no tensor map */
            ck_assert_int_eq(mlart_bmm_cuda_run(&d, &sw, 0), MLART_ENOTSUP);
            d.w_sh = 128 * 512;
            d.K = 512; /* K = 128 or 192 */
            ck_assert_int_eq(mlart_bmm_cuda_run(&d, &sw, 0), MLART_ENOTSUP);
            d.a = (const void *)(uintptr_t)2;
            d.a_st = 131;
            d.a_sh = 0;
            d.w_sh = 0;
            d.K = 128;
        }
        d.K = 40;
        ck_assert_int_eq(mlart_bmm_cuda_run(&d, &stream, 0), MLART_ENOTSUP);
        {
            mlart_bmm_config direct = {MLART_BMM_DIRECT, 0, 3, 0, 32, 1, 0}; /* 3 warps cannot split 8 k-steps */
            d.K = 128;
            ck_assert_int_eq(mlart_bmm_cuda_run(&d, &direct, 0), MLART_ENOTSUP);
            direct.warps = 1;
            direct.cols = 24;
            ck_assert_int_eq(mlart_bmm_cuda_run(&d, &direct, 0), MLART_ENOTSUP);
        }
    }
    print_stats("forced paths (stream MT 1-4, persistent stream, tiled 64/128, generic, direct 8 configs, wgmma 2 configs, ring 2 configs, swap 2 configs), odd strides, P=40/L=72", &s);
    check_norm(&s);
}
END_TEST

/* Capture the op in a CUDA graph, replay it into a poisoned buffer: the
 * bits equal those of an eager run, on every path. */
START_TEST(graph_replay)
{
    uint64_t rng = g_seed ^ 0x6161ull;
    static const int64_t Ts[] = {1, 40, 64, 100, 300};
    int cases = 0;
    for (unsigned it = 0; it < 5; it++)
        for (int op = 0; op < 2; op++)
            for (int gen = 0; gen < 4; gen++) {
                ops_case c = op ? (ops_case){1, 16, Ts[it], 512, 256, 0, 0, 0, 0}
                                : (ops_case){0, 16, Ts[it], 192, 512, 64, 1, 0, 0};
                mlart_bmm_config gcfg = {gen == 3   ? MLART_BMM_SWAP
                                         : gen == 2 ? MLART_BMM_RING
                                                    : MLART_BMM_GENERIC,
                                         0, 0, 0, 0, 0, 0};
                if (gen >= 2 && op) /* the ring and the swap path serve the query only */
                    continue;
                const size_t na = ops_a_elems(&c), nw = ops_w_elems(&c), nc = ops_c_elems(&c);
                uint16_t *ha = malloc(na * 2), *hw = malloc(nw * 2), *h1 = malloc(nc * 2), *h2 = malloc(nc * 2);
                uint16_t *da, *dw, *d1, *d2;
                cudaStream_t st;
                cudaGraph_t g;
                cudaGraphExec_t ge;
                ops_views v;
                ck_assert(ha && hw && h1 && h2);
                ops_fill_bf16(ha, na, &rng);
                ops_fill_bf16(hw, nw, &rng);
                GPU_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
                GPU_CUDA(cudaMalloc((void **)&da, na * 2));
                GPU_CUDA(cudaMalloc((void **)&dw, nw * 2));
                GPU_CUDA(cudaMalloc((void **)&d1, nc * 2));
                GPU_CUDA(cudaMalloc((void **)&d2, nc * 2));
                GPU_CUDA(cudaMemcpy(da, ha, na * 2, cudaMemcpyHostToDevice));
                GPU_CUDA(cudaMemcpy(dw, hw, nw * 2, cudaMemcpyHostToDevice));
                GPU_CUDA(cudaMemset(d1, 0xFF, nc * 2));
                GPU_CUDA(cudaMemset(d2, 0xFF, nc * 2));
                /* those ran on the legacy stream, which st does not wait for */
                GPU_CUDA(cudaDeviceSynchronize());
                v = ops_make_views(&c, 0, da, na * 2, dw, nw * 2, d1, nc * 2);
                ck_assert_int_eq(run_op(&c, &v, gen ? &gcfg : NULL, st), 0);
                GPU_CUDA(cudaStreamSynchronize(st));
                v = ops_make_views(&c, 0, da, na * 2, dw, nw * 2, d2, nc * 2);
                GPU_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
                ck_assert_int_eq(run_op(&c, &v, gen ? &gcfg : NULL, st), 0);
                GPU_CUDA(cudaStreamEndCapture(st, &g));
                GPU_CUDA(cudaGraphInstantiate(&ge, g, 0));
                for (int r = 0; r < 3; r++) {
                    GPU_CUDA(cudaMemsetAsync(d2, 0xFF, nc * 2, st));
                    GPU_CUDA(cudaGraphLaunch(ge, st));
                }
                GPU_CUDA(cudaStreamSynchronize(st));
                GPU_CUDA(cudaMemcpy(h1, d1, nc * 2, cudaMemcpyDeviceToHost));
                GPU_CUDA(cudaMemcpy(h2, d2, nc * 2, cudaMemcpyDeviceToHost));
                ck_assert_msg(memcmp(h1, h2, nc * 2) == 0, "graph replay differs from eager: op %d T %lld gen %d", op,
                              (long long)c.T, gen);
                for (size_t i = 0; i < nc; i++) {
                    int64_t n = (int64_t)(i % (size_t)ops_cs(&c));
                    if (n < c.N || (!c.vup && n < c.N + c.R))
                        OPS_REQUIRE(h1[i] != 0xFFFFu, "element %zu unwritten (op %d T %lld)", i, op, (long long)c.T);
                }
                cudaGraphExecDestroy(ge);
                cudaGraphDestroy(g);
                cudaStreamDestroy(st);
                cudaFree(da);
                cudaFree(dw);
                cudaFree(d1);
                cudaFree(d2);
                free(ha);
                free(hw);
                free(h1);
                free(h2);
                cases++;
            }
    printf("graph replay = eager bit for bit: %d cases (T in {1,40,64,100,300}, both ops, auto and generic, the query also on the ring and the swap path; seed %#llx)\n",
           cases, (unsigned long long)g_seed);
}
END_TEST

/* Programmatic dependent launch: the decode kernels may start while the
 * previous kernel of the stream still runs, and must wait for it before
 * they read the query (or the V up-projection's input); with PDL the
 * direct kernel and the swap path copy weights before that wait.  Cases:
 * the query at 16 heads on the automatic path (direct at T <= 16, but
 * launched with PDL the slice kernel at T <= 8 and the ring's one-item
 * form at T = 16, with K in halves at P = 192; the one-item form at
 * T = 64), the query forced onto the swap path,
 * and the V up-projection (the slice kernel at T <= 16, else the swap
 * path; what the layer step launches with PDL).  The
 * previous kernel here (pdl_late_copy) lets dependents start at once and
 * writes the new input only after 200 us; the op, eager and replayed from
 * a graph, must give exactly the output of the new input, with the op
 * launched plainly and with PDL.  Control: a PDL reader that does not wait
 * reads old bytes (required in a graph, printed for eager launches), so
 * this setup would catch a kernel that forgot to wait. */
START_TEST(pdl_order)
{
    uint64_t rng = g_seed ^ 0x7171ull;
    static const int64_t Ts[] = {1, 4, 16, 64};
    int cases = 0, early[2];
    cudaStream_t st;
    GPU_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    for (int gr = 0; gr < 2; gr++) {
        early[gr] = pdl_control(st, gr);
        ck_assert_msg(early[gr] >= 0, "control (%s): CUDA error", gr ? "graph" : "eager");
    }
    ck_assert_msg(early[1] == 1, "control: in a graph a dependent that does not wait saw only the new bytes; the "
                                 "device did not start it early, so this test could not catch a missing wait");
    for (int kind = 0; kind < 3; kind++) /* query auto, query on the swap path, V up-projection */
    for (unsigned it = 0; it < 4; it++)
        for (int p = 0; p < 2; p++)
            for (int pdl = 0; pdl < 2; pdl++) {
                ops_case c = {0, 16, Ts[it], p ? 192 : 128, 512, 64, 1, 0, 0};
                if (kind == 2)
                    c = (ops_case){1, 16, Ts[it], 512, p ? 256 : 128, 0, 0, 0, 0};
                const mlart_bmm_config cfg = {kind == 1 ? MLART_BMM_SWAP : MLART_BMM_AUTO, 0, 0, 0, 0, 0, pdl};
                const size_t na = ops_a_elems(&c), nw = ops_w_elems(&c), nc = ops_c_elems(&c);
                uint16_t *ha0 = malloc(na * 2), *ha1 = malloc(na * 2), *hw = malloc(nw * 2), *hx = malloc(nc * 2),
                         *hy = malloc(nc * 2);
                uint16_t *da, *dnew, *dw, *dc;
                cudaGraph_t g;
                cudaGraphExec_t ge;
                ops_views v;
                mlart_bmm_desc d;
                ck_assert(ha0 && ha1 && hw && hx && hy);
                ops_fill_bf16(ha0, na, &rng);
                ops_fill_bf16(ha1, na, &rng);
                ops_fill_bf16(hw, nw, &rng);
                GPU_CUDA(cudaMalloc((void **)&da, na * 2));
                GPU_CUDA(cudaMalloc((void **)&dnew, na * 2));
                GPU_CUDA(cudaMalloc((void **)&dw, nw * 2));
                GPU_CUDA(cudaMalloc((void **)&dc, nc * 2));
                GPU_CUDA(cudaMemcpyAsync(dnew, ha1, na * 2, cudaMemcpyHostToDevice, st));
                GPU_CUDA(cudaMemcpyAsync(dw, hw, nw * 2, cudaMemcpyHostToDevice, st));
                v = ops_make_views(&c, 0, da, na * 2, dw, nw * 2, dc, nc * 2);
                desc_from_views(&c, &v, &d);
                {
                    const int path = mlart_bmm_cuda_path(&d, &cfg);
                    const int want = kind == 2 && c.T <= 16 ? MLART_BMM_SLICE
                                     : kind          ? MLART_BMM_SWAP
                                     : c.T > 32        ? MLART_BMM_RING
                                     : pdl && c.T <= 8 ? MLART_BMM_SLICE
                                     : pdl             ? MLART_BMM_RING
                                                       : MLART_BMM_DIRECT;
                    ck_assert_msg(path == want,
                                  "kind %d T %lld: the choice is path %d, not the kernel this test expects (%d); "
                                  "update this test",
                                  kind, (long long)c.T, path, want);
                }

                /* expected: the op on the new query, nothing before it */
                GPU_CUDA(cudaMemcpyAsync(da, ha1, na * 2, cudaMemcpyHostToDevice, st));
                GPU_CUDA(cudaMemsetAsync(dc, 0xFF, nc * 2, st));
                ck_assert_int_eq(mlart_bmm_cuda_run(&d, &cfg, st), 0);
                GPU_CUDA(cudaMemcpyAsync(hx, dc, nc * 2, cudaMemcpyDeviceToHost, st));
                GPU_CUDA(cudaStreamSynchronize(st));

                /* eager: late writer, then the op */
                GPU_CUDA(cudaMemcpyAsync(da, ha0, na * 2, cudaMemcpyHostToDevice, st));
                GPU_CUDA(cudaMemsetAsync(dc, 0xFF, nc * 2, st));
                GPU_CUDA((cudaError_t)pdl_late_copy(da, dnew, na * 2, 200, st));
                ck_assert_int_eq(mlart_bmm_cuda_run(&d, &cfg, st), 0);
                GPU_CUDA(cudaMemcpyAsync(hy, dc, nc * 2, cudaMemcpyDeviceToHost, st));
                GPU_CUDA(cudaStreamSynchronize(st));
                ck_assert_msg(memcmp(hx, hy, nc * 2) == 0,
                              "eager after a late writer: kind %d T %lld K %lld pdl %d read the old input", kind,
                              (long long)c.T, (long long)c.K, pdl);

                /* the same two launches captured in a graph, replayed twice */
                GPU_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
                GPU_CUDA((cudaError_t)pdl_late_copy(da, dnew, na * 2, 200, st));
                ck_assert_int_eq(mlart_bmm_cuda_run(&d, &cfg, st), 0);
                GPU_CUDA(cudaStreamEndCapture(st, &g));
                GPU_CUDA(cudaGraphInstantiate(&ge, g, 0));
                for (int r = 0; r < 2; r++) {
                    GPU_CUDA(cudaMemcpyAsync(da, ha0, na * 2, cudaMemcpyHostToDevice, st));
                    GPU_CUDA(cudaMemsetAsync(dc, 0xFF, nc * 2, st));
                    GPU_CUDA(cudaGraphLaunch(ge, st));
                    GPU_CUDA(cudaMemcpyAsync(hy, dc, nc * 2, cudaMemcpyDeviceToHost, st));
                    GPU_CUDA(cudaStreamSynchronize(st));
                    ck_assert_msg(memcmp(hx, hy, nc * 2) == 0,
                                  "graph after a late writer: kind %d T %lld K %lld pdl %d read the old input",
                                  kind, (long long)c.T, (long long)c.K, pdl);
                }
                cudaGraphExecDestroy(ge);
                cudaGraphDestroy(g);
                cudaFree(da);
                cudaFree(dnew);
                cudaFree(dw);
                cudaFree(dc);
                free(ha0);
                free(ha1);
                free(hw);
                free(hx);
                free(hy);
                cases++;
            }
    cudaStreamDestroy(st);
    printf("pdl order: %d cases (H16, T in {1,4,16,64}, plain and PDL launch: the query with q_pe fused, both P, "
           "direct kernel at T <= 16 plainly, the slice kernel with PDL at T <= 8, the ring's one-item form at 64 and with PDL at T = 16 and 64 (K in halves at P = 192, T = 16), and on the swap path; the V up-projection, both V, the slice kernel at T <= 16, else the swap path): "
           "the op's output is that of an input written late by the previous kernel, eager and in a graph; "
           "control: a dependent that "
           "does not wait read old bytes in a graph %s, eagerly %s\n",
           cases, early[1] ? "yes" : "no", early[0] ? "yes" : "no");
}
END_TEST

/* The query absorption launched plainly and with PDL (the layer step with
 * early_weights) gives the same bytes: where the two launches take other
 * kernels, those must sum in the same order (the direct kernel with two
 * warps splitting K and the one-item form with K in halves, the swap path
 * and the one-item form).  Fresh random inputs, both P, with and without
 * the fused q_pe copy, H in {1, 16, 48, 64, 100, 128} x T in {1, 4, 8, 9,
 * 16, 17, 32, 33, 64}: every pair of paths the automatic choice makes. */
START_TEST(pdl_same_bytes)
{
    static const int64_t Hs[] = {1, 16, 48, 64, 100, 128}, Ts[] = {1, 4, 8, 9, 16, 17, 32, 33, 64};
    uint64_t rng = g_seed ^ 0x5151ull;
    int cases = 0, other = 0;
    cudaStream_t st;
    GPU_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    for (int vup = 0; vup < 2; vup++) /* the query, then the V up-projection (what the layer launches with PDL) */
    for (unsigned ih = 0; ih < sizeof Hs / sizeof Hs[0]; ih++)
        for (unsigned it = 0; it < sizeof Ts / sizeof Ts[0]; it++)
            for (int p = 0; p < 2; p++)
                for (int pe = 0; pe < 2 - vup; pe++) {
                    const ops_case c = vup ? (ops_case){1, Hs[ih], Ts[it], 512, p ? 256 : 128, 0, 0, 0, 0}
                                           : (ops_case){0, Hs[ih], Ts[it], p ? 192 : 128, 512, 64, pe, 0, 0};
                    const size_t na = ops_a_elems(&c), nw = ops_w_elems(&c), nc = ops_c_elems(&c);
                    uint16_t *ha = malloc(na * 2), *hw = malloc(nw * 2), *hx = malloc(nc * 2), *hy = malloc(nc * 2);
                    uint16_t *da, *dw, *dc;
                    mlart_bmm_desc d;
                    ck_assert(ha && hw && hx && hy);
                    ops_fill_bf16(ha, na, &rng);
                    ops_fill_bf16(hw, nw, &rng);
                    GPU_CUDA(cudaMalloc((void **)&da, na * 2));
                    GPU_CUDA(cudaMalloc((void **)&dw, nw * 2));
                    GPU_CUDA(cudaMalloc((void **)&dc, nc * 2));
                    GPU_CUDA(cudaMemcpyAsync(da, ha, na * 2, cudaMemcpyHostToDevice, st));
                    GPU_CUDA(cudaMemcpyAsync(dw, hw, nw * 2, cudaMemcpyHostToDevice, st));
                    const ops_views v = ops_make_views(&c, 0, da, na * 2, dw, nw * 2, dc, nc * 2);
                    desc_from_views(&c, &v, &d);
                    const mlart_bmm_config plain = {MLART_BMM_AUTO, 0, 0, 0, 0, 0, 0};
                    const mlart_bmm_config early = {MLART_BMM_AUTO, 0, 0, 0, 0, 0, 1};
                    const int p0 = mlart_bmm_cuda_path(&d, &plain), pe1 = mlart_bmm_cuda_path(&d, &early);
                    /* where the PDL entry launches plainly, it takes the plain launch's path */
                    const int p1 = vup || mlart_query_pdl_launch(c.H, c.T, c.K, c.N, pe1) ? pe1 : p0;
                    for (int pdl = 0; pdl < 2; pdl++) {
                        GPU_CUDA(cudaMemsetAsync(dc, 0xFF, nc * 2, st));
                        if (vup)
                            ck_assert_int_eq(
                                (pdl ? mlart_v_up_bmm_cuda_pdl : mlart_v_up_bmm_cuda)(&v.a, &v.w, &v.c, st), 0);
                        else
                            ck_assert_int_eq((pdl ? mlart_query_bmm_cuda_pdl : mlart_query_bmm_cuda)(
                                                 &v.a, &v.w, &v.c, pe ? &v.pe_in : NULL, pe ? &v.pe_out : NULL, st),
                                             0);
                        GPU_CUDA(cudaMemcpyAsync(pdl ? hy : hx, dc, nc * 2, cudaMemcpyDeviceToHost, st));
                    }
                    GPU_CUDA(cudaStreamSynchronize(st));
                    ck_assert_msg(memcmp(hx, hy, nc * 2) == 0,
                                  "%s H %lld T %lld K %lld N %lld q_pe %d: plain launch (path %d) and PDL launch "
                                  "(path %d) differ",
                                  vup ? "v_up" : "query", (long long)c.H, (long long)c.T, (long long)c.K,
                                  (long long)c.N, pe, p0, p1);
                    for (size_t i = 0; i < nc; i++) { /* equal because written, not because both left poisoned */
                        const int64_t n = (int64_t)(i % (size_t)ops_cs(&c));
                        if (n < c.N || (pe && n < c.N + c.R))
                            OPS_REQUIRE(hx[i] != 0xFFFFu, "H %lld T %lld P %lld q_pe %d: element %zu unwritten",
                                        (long long)c.H, (long long)c.T, (long long)c.K, pe, i);
                    }
                    other += p0 != p1;
                    cudaFree(da);
                    cudaFree(dw);
                    cudaFree(dc);
                    free(ha);
                    free(hw);
                    free(hx);
                    free(hy);
                    cases++;
                }
    cudaStreamDestroy(st);
    printf("plain = PDL launch bit for bit: %d cases (the query and the V up-projection, H in "
           "{1,16,48,64,100,128}, T in {1,4,8,9,16,17,32,33,64}, both P and V, the query with and without q_pe), "
           "%d of them on other paths; seed %#llx\n",
           cases, other, (unsigned long long)g_seed);
}
END_TEST

START_TEST(bad_input)
{
    ops_case c = {0, 2, 3, 128, 512, 64, 1, 0, 0};
    const size_t na = ops_a_elems(&c), nw = ops_w_elems(&c), nc = ops_c_elems(&c);
    uint16_t *da, *dw, *dc;
    ops_views v, bad;
    GPU_CUDA(cudaMalloc((void **)&da, na * 2));
    GPU_CUDA(cudaMalloc((void **)&dw, nw * 2));
    GPU_CUDA(cudaMalloc((void **)&dc, nc * 2));
    v = ops_make_views(&c, 0, da, na * 2, dw, nw * 2, dc, nc * 2);

    /* the query absorption's plain and PDL entries alike */
    int (*const qf[2])(const mlart_tensor *, const mlart_tensor *, const mlart_tensor *, const mlart_tensor *,
                       const mlart_tensor *, void *) = {mlart_query_bmm_cuda, mlart_query_bmm_cuda_pdl};
    for (int e = 0; e < 2; e++) {
        bad = v; /* host tensors handed to the CUDA entry */
        bad.a.device = bad.w.device = bad.c.device = bad.pe_in.device = bad.pe_out.device = -1;
        ck_assert_int_eq(qf[e](&bad.a, &bad.w, &bad.c, NULL, NULL, 0), MLART_EINVAL);
        bad = v; /* shapes disagree */
        bad.w.shape[1] = 192;
        ck_assert_int_lt(qf[e](&bad.a, &bad.w, &bad.c, NULL, NULL, 0), 0);
        bad = v; /* q_nope span past its extent */
        bad.a.extent /= 2;
        ck_assert_int_eq(qf[e](&bad.a, &bad.w, &bad.c, NULL, NULL, 0), MLART_ELAYOUT);
        bad = v; /* q_pe span one element past its extent */
        bad.pe_in.extent -= 2;
        ck_assert_int_eq(qf[e](&bad.a, &bad.w, &bad.c, &bad.pe_in, &bad.pe_out, 0), MLART_ELAYOUT);
        bad = v; /* only one of pe_in / pe_out */
        ck_assert_int_lt(qf[e](&bad.a, &bad.w, &bad.c, &bad.pe_in, NULL, 0), 0);
        bad = v; /* inner stride not 1 */
        bad.c.stride[2] = 2;
        ck_assert_int_lt(qf[e](&bad.a, &bad.w, &bad.c, NULL, NULL, 0), 0);
    }
    bad = v; /* wrong dtype */
    bad.w.dtype = MLART_DTYPE_F32;
    ck_assert_int_eq(mlart_v_up_bmm_cuda(&bad.a, &bad.w, &bad.c, 0), MLART_EDTYPE);
    ck_assert_int_eq(mlart_v_up_bmm_cuda_pdl(&bad.a, &bad.w, &bad.c, 0), MLART_EDTYPE);
    ck_assert_int_eq(mlart_v_up_bmm_cuda(NULL, &v.w, &v.c, 0), MLART_EINVAL);
    ck_assert_int_eq(mlart_v_up_bmm_cuda_pdl(NULL, &v.w, &v.c, 0), MLART_EINVAL);
    GPU_CUDA(cudaDeviceSynchronize());
    cudaFree(da);
    cudaFree(dw);
    cudaFree(dc);
    printf("bad input refused: host tensors, shape mismatch, span past extent, lone pe, inner stride, dtype, NULL "
           "(the plain and PDL entries of both ops alike)\n");
}
END_TEST

int main(void)
{
    Suite *s;
    TCase *tc;
    if (gpu_test_begin("ops_bmm_gpu", &g_seed))
        return 77;
    s = suite_create("ops_bmm_gpu");
    tc = tcase_create("bmm");
    tcase_set_timeout(tc, 240);
    tcase_add_test(tc, paths);
    tcase_add_test(tc, graph_replay);
    tcase_add_test(tc, pdl_order);
    tcase_add_test(tc, pdl_same_bytes);
    tcase_add_test(tc, bad_input);
    tcase_add_loop_test(tc, query_matrix, 0, (int)(sizeof k_T / sizeof k_T[0]));
    tcase_add_loop_test(tc, vup_matrix, 0, (int)(sizeof k_T / sizeof k_T[0]));
    tcase_add_loop_test(tc, wgmma_matrix, 0, (int)(sizeof k_wT / sizeof k_wT[0]));
    tcase_add_loop_test(tc, vup_wgmma_matrix, 0, (int)(sizeof k_vwT / sizeof k_vwT[0]));
    tcase_add_loop_test(tc, ring_matrix, 0, (int)(sizeof k_rT / sizeof k_rT[0]));
    tcase_add_loop_test(tc, swap_matrix, 0, (int)(sizeof k_sT / sizeof k_sT[0]));
    tcase_add_loop_test(tc, slice_matrix, 0, (int)(sizeof k_slT / sizeof k_slT[0]));
    tcase_add_loop_test(tc, vup_swap_matrix, 0, (int)(sizeof k_sT / sizeof k_sT[0]));
    tcase_add_loop_test(tc, vup_slice_matrix, 0, (int)(sizeof k_slT / sizeof k_slT[0]));
    suite_add_tcase(s, tc);
    return check_run(s, CK_FORK);
}
