/* Layer on a CUDA device: the CONTIGUOUS query operand materialised on the
 * device is the exact split-and-transpose of q (both copy paths: one 2-d
 * copy per token when T <= H, per head otherwise); dense device weights keep
 * their address, strided ones are replaced by dense copies staged once; the
 * reference backend on CUDA agrees with the host reference; a strided lse is
 * filled by the device copy; validate_indices refuses an index >= seq_len;
 * with early_weights a step after a kernel that writes q late still reads
 * the new q; how far a token's output moves with the size of its step; the
 * graph cache: every bucket captured, a replay equal to the step launched
 * directly on the same (padded) inputs, bit for bit, padding rows zero
 * whatever an earlier step left there, the rows near the reference backend.
 * Exits 77 without a usable device. */
#define _POSIX_C_SOURCE 200809L
#include <check.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_run.h"
#include "mlart/backend.h"
#include "mlart/graphs.h"
#include "pdl_probe.h"
#include "plugins/testhost.h"
#include "tests/runtime/fixture.h"

enum { H_ = 4, P_ = 16, R_ = 8, L_ = 32, V_ = 16, K_ = 24, PAGE_ = 4, T_ = 5, B_ = 3, MB_ = 6 };

static fx f;
static mlart_context *ctx, *host;

/* Device copy of a host view (same shape and strides, dense storage). */
static mlart_tensor up(const mlart_tensor *h)
{
    mlart_tensor d = *h;
    void *p = NULL;
    ck_assert_int_eq(cudaMalloc(&p, h->extent), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(p, h->base, h->extent, cudaMemcpyHostToDevice), cudaSuccess);
    d.data = (char *)p + ((const char *)h->data - (const char *)h->base);
    d.base = p;
    d.device = 0;
    return d;
}

static void down(void *dst, const mlart_tensor *d)
{
    ck_assert_int_eq(cudaMemcpy(dst, d->base, d->extent, cudaMemcpyDeviceToHost), cudaSuccess);
}

static mlart_step_io io_up(const mlart_step_io *h)
{
    mlart_step_io d = *h;
    d.q = up(&h->q), d.idx = up(&h->idx), d.req_of_token = up(&h->req_of_token);
    d.seq_lens = up(&h->seq_lens), d.block_table = up(&h->block_table);
    d.o = up(&h->o), d.lse = up(&h->lse);
    return d;
}

static void io_free(mlart_step_io *d)
{
    cudaFree((void *)d->q.base), cudaFree((void *)d->idx.base);
    cudaFree((void *)d->req_of_token.base), cudaFree((void *)d->seq_lens.base);
    cudaFree((void *)d->block_table.base), cudaFree((void *)d->o.base);
    cudaFree((void *)d->lse.base);
}

static mlart_layer_desc desc_up(const char *backend)
{
    mlart_layer_desc d = fx_desc(&f, backend);
    d.w_uk_t = up(&d.w_uk_t), d.w_uv = up(&d.w_uv), d.kv_cache = up(&d.kv_cache);
    return d;
}

static void desc_free(mlart_layer_desc *d)
{
    cudaFree((void *)d->w_uk_t.base), cudaFree((void *)d->w_uv.base);
    cudaFree((void *)d->kv_cache.base);
}

static void setup(void)
{
    uint64_t seed = fx_seed();
    setenv("MLART_BACKEND_PATH", MLART_TEST_PLUGIN_DIR, 1);
    fx_init(&f, H_, P_, R_, L_, V_, K_, PAGE_, T_, B_, MB_, seed);
    printf("seed %llu\n", (unsigned long long)seed);
    ck_assert_int_eq(mlart_context_create(0, &ctx), 0);
    ck_assert_int_eq(mlart_context_create(-1, &host), 0);
}

static void teardown(void)
{
    mlart_context_destroy(ctx);
    mlart_context_destroy(host);
    fx_free(&f);
}

static testhost_record *record_of(const char *name)
{
    char path[512];
    void *h;
    testhost_record_fn get;
    snprintf(path, sizeof path, "%s/libmlart-backend-%s.so", MLART_TEST_PLUGIN_DIR, name);
    h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    ck_assert_msg(h != NULL, "module %s not loaded", name);
    *(void **)&get = dlsym(h, "testhost_record_get");
    ck_assert_ptr_nonnull(get);
    dlclose(h);
    return get();
}

START_TEST(contiguous_query_on_device)
{
    mlart_layer_desc d = desc_up("testcuda");
    mlart_layer *ly = NULL;
    mlart_tensor uk, uv;
    mlart_step_io hio = fx_io(&f), io = io_up(&hio);
    testhost_record *rec;
    ck_assert_msg(mlart_layer_create(ctx, &d, &ly) == 0, "%s", mlart_last_error());
    rec = record_of("testcuda");
    ck_assert_int_eq(mlart_layer_weights(ly, &uk, &uv), 0);
    ck_assert_ptr_eq(uk.data, d.w_uk_t.data); /* dense device weights kept */
    ck_assert_ptr_eq(uv.data, d.w_uv.data);
    for (int T = T_; T >= 1; T -= 2) { /* T=5 > H: per-head copies; T=3,1 <= H: per-token */
        io.T = T;
        io.q.shape[0] = T, io.idx.shape[0] = T, io.req_of_token.shape[0] = T;
        io.o.shape[0] = T, io.lse.shape[1] = T, io.lse.stride[0] = T;
        memset(rec->q_nope, 0xff, sizeof rec->q_nope);
        ck_assert_msg(mlart_layer_decode(ly, &io, NULL) == 0, "%s", mlart_last_error());
        ck_assert_int_eq(cudaDeviceSynchronize(), cudaSuccess);
        ck_assert_int_eq(rec->q_nope_count, H_ * T * P_);
        for (int h = 0; h < H_; h++)
            for (int t = 0; t < T; t++)
                ck_assert_mem_eq(rec->q_nope + (h * T + t) * P_, f.q + (t * H_ + h) * (P_ + R_),
                                 P_ * sizeof(uint16_t));
        printf("CUDA CONTIGUOUS: q_nope [%d,%d,%d] byte-exact\n", H_, T, P_);
    }
    mlart_layer_destroy(ly);
    io_free(&io);
    desc_free(&d);
}
END_TEST

START_TEST(reference_on_device)
{
    mlart_layer_desc d = desc_up("reference"), hd = fx_desc(&f, "reference");
    mlart_tensor kvb_h = fx_view(f.kv_b_proj, MLART_DTYPE_BF16, 2, H_ * (P_ + V_), L_, 0);
    mlart_tensor kvb = up(&kvb_h), uk, uv;
    mlart_layer *ly = NULL, *hl = NULL;
    mlart_step_io hio = fx_io(&f), io = io_up(&hio);
    uint16_t *o_host = malloc(sizeof(uint16_t) * T_ * H_ * V_), *w = malloc(sizeof(uint16_t) *
                                                                               H_ * L_ * V_);
    float *lse_host = malloc(sizeof(float) * H_ * T_), *wide = malloc(sizeof(float) * H_ * (T_ + 3));
    double num = 0.0, den = 0.0;
    mlart_tensor wide_h = fx_view(wide, MLART_DTYPE_F32, 2, H_, T_ + 3, 0), wide_d;
    /* strided device views of kv_b_proj: replaced by dense copies */
    cudaFree((void *)d.w_uk_t.base), cudaFree((void *)d.w_uv.base);
    ck_assert_int_eq(mlart_weights_from_kv_b_proj(&f.g, &kvb, &d.w_uk_t, &d.w_uv), 0);
    ck_assert_msg(mlart_layer_create(ctx, &d, &ly) == 0, "%s", mlart_last_error());
    ck_assert_int_eq(mlart_layer_weights(ly, &uk, &uv), 0);
    ck_assert_ptr_ne(uv.data, d.w_uv.data);
    ck_assert_int_eq(mlart_tensor_is_dense(&uv), 1);
    ck_assert_int_eq(uv.device, 0);
    ck_assert_int_eq(cudaMemcpy(w, uv.data, sizeof(uint16_t) * H_ * L_ * V_,
                                cudaMemcpyDeviceToHost), cudaSuccess);
    ck_assert_mem_eq(w, f.w_uv, sizeof(uint16_t) * H_ * L_ * V_);
    ck_assert_int_eq(cudaMemcpy(w, uk.data, sizeof(uint16_t) * H_ * P_ * L_,
                                cudaMemcpyDeviceToHost), cudaSuccess);
    ck_assert_mem_eq(w, f.w_uk_t, sizeof(uint16_t) * H_ * P_ * L_);
    /* the same step on the host reference */
    ck_assert_int_eq(mlart_layer_create(host, &hd, &hl), 0);
    ck_assert_int_eq(mlart_layer_decode(hl, &hio, NULL), 0);
    memcpy(o_host, f.o, sizeof(uint16_t) * T_ * H_ * V_);
    memcpy(lse_host, f.lse, sizeof(float) * H_ * T_);
    /* on the device, lse into a strided buffer */
    for (int i = 0; i < H_ * (T_ + 3); i++)
        wide[i] = 12345.0f;
    wide_h.shape[1] = T_;
    wide_d = up(&wide_h);
    cudaFree((void *)io.lse.base);
    io.lse = wide_d;
    ck_assert_msg(mlart_layer_decode(ly, &io, NULL) == 0, "%s", mlart_last_error());
    ck_assert_int_eq(cudaDeviceSynchronize(), cudaSuccess);
    memset(f.o, 0xff, sizeof(uint16_t) * T_ * H_ * V_);
    down(f.o, &io.o);
    down(wide, &wide_d);
    for (int i = 0; i < T_ * H_ * V_; i++) {
        double a = mlart_bf16_to_f32(f.o[i]), b = mlart_bf16_to_f32(o_host[i]);
        ck_assert(!isnan(a));
        num += (a - b) * (a - b);
        den += b * b;
    }
    printf("reference CUDA vs host: nmse %.3e\n", num / den);
    ck_assert(num / den < 1e-4);
    for (int h = 0; h < H_; h++) {
        for (int t = 0; t < T_; t++) {
            float a = wide[h * (T_ + 3) + t], b = lse_host[h * T_ + t];
            ck_assert(isinf(b) ? isinf(a) && a < 0 : fabsf(a - b) <= 1e-3f * (1.0f + fabsf(b)));
        }
        ck_assert(wide[h * (T_ + 3) + T_] == 12345.0f);
    }
    /* validate_indices: an index >= seq_len is refused before anything runs */
    mlart_layer_destroy(ly);
    ly = NULL;
    d.validate_indices = 1;
    ck_assert_int_eq(mlart_layer_create(ctx, &d, &ly), 0);
    f.idx[K_ + 1] = f.lens[f.req[1]];
    cudaFree((void *)io.idx.base);
    io.idx = up(&hio.idx);
    ck_assert_int_eq(mlart_layer_decode(ly, &io, NULL), MLART_ERANGE);
    printf("validate_indices: %s\n", mlart_last_error());
    mlart_layer_destroy(ly);
    mlart_layer_destroy(hl);
    cudaFree((void *)kvb.base);
    cudaFree((void *)d.kv_cache.base);
    io_free(&io);
    free(o_host), free(w), free(lse_host), free(wide);
}
END_TEST

/* early_weights: the query absorption launches with programmatic dependent
 * launch and reads its weights before it waits for the kernel before it.
 * After a kernel that lets dependents start at once and writes q 200 us
 * late (tests/gpu/pdl_probe.h), a step of the sm_90 backend at DeepSeek
 * sizes (16 heads, P 128, L 512: the direct kernel of the absorption) must
 * give the bytes of the same step on q written beforehand without the
 * option, eagerly and from a captured graph.  The control shows that a
 * dependent that does not wait does start early here. */
START_TEST(early_weights_after_late_writer)
{
    enum { T = 4, B = 2, MB = 4, TOPK = 64, PAGE = 64 };
    fx big;
    mlart_layer *ly0 = NULL, *ly1 = NULL;
    cudaStream_t st;
    void *q_new = NULL;
    int early;
    fx_init(&big, 16, 128, 64, 512, 128, TOPK, PAGE, T, B, MB, fx_seed() ^ 0xea51ull);
    mlart_layer_desc d = fx_desc(&big, "b12x_mla_sparse");
    d.w_uk_t = up(&d.w_uk_t), d.w_uv = up(&d.w_uv), d.kv_cache = up(&d.kv_cache);
    mlart_step_io hio = fx_io(&big), io = io_up(&hio);
    const size_t qb = (size_t)io.q.extent, ob = (size_t)io.o.extent;
    uint8_t *want = malloc(ob), *got = malloc(ob), *junk = malloc(qb);
    ck_assert(want && got && junk);
    for (size_t i = 0; i < qb; i++)
        junk[i] = (uint8_t)(i * 37u + 11u);
    ck_assert_int_eq(qb % 16, 0);
    ck_assert_int_eq(cudaMalloc(&q_new, qb), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(q_new, io.q.base, qb, cudaMemcpyDeviceToDevice), cudaSuccess);
    ck_assert_int_eq(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
    early = pdl_control(st, 1);
    ck_assert_int_ge(early, 0);
    /* compute-sanitizer runs kernels one after the other: there the test
     * checks the step's accesses, not its order (tests/gpu/sanitize.sh) */
    ck_assert_msg(early == 1 || getenv("MLART_TEST_UNDER_SANITIZER"),
                  "control: a dependent that does not wait saw only the new bytes; "
                  "this device did not start it early, so the test could not fail");
    /* expected: without the option, q in place before the step */
    ck_assert_msg(mlart_layer_create(ctx, &d, &ly0) == 0, "%s", mlart_last_error());
    ck_assert_msg(mlart_layer_decode(ly0, &io, st) == 0, "%s", mlart_last_error());
    ck_assert_int_eq(cudaStreamSynchronize(st), cudaSuccess);
    down(want, &io.o);
    d.early_weights = 1;
    ck_assert_msg(mlart_layer_create(ctx, &d, &ly1) == 0, "%s", mlart_last_error());
    for (int graph = 0; graph < 2; graph++) {
        cudaGraph_t g = NULL;
        cudaGraphExec_t ge = NULL;
        ck_assert_int_eq(cudaMemcpy((void *)io.q.base, junk, qb, cudaMemcpyHostToDevice), cudaSuccess);
        ck_assert_int_eq(cudaMemset((void *)io.o.base, 0xff, ob), cudaSuccess);
        if (graph)
            ck_assert_int_eq(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
        ck_assert_int_eq(pdl_late_copy((void *)io.q.base, q_new, qb, 200, st), 0);
        ck_assert_msg(mlart_layer_decode(ly1, &io, st) == 0, "%s", mlart_last_error());
        if (graph) {
            ck_assert_int_eq(cudaStreamEndCapture(st, &g), cudaSuccess);
            ck_assert_int_eq(cudaGraphInstantiate(&ge, g, 0), cudaSuccess);
            ck_assert_int_eq(cudaGraphLaunch(ge, st), cudaSuccess);
            cudaGraphDestroy(g);
        }
        ck_assert_int_eq(cudaStreamSynchronize(st), cudaSuccess);
        if (ge)
            cudaGraphExecDestroy(ge);
        down(got, &io.o);
        ck_assert_msg(memcmp(want, got, ob) == 0, "early_weights (%s): the output differs from the step on q "
                      "written beforehand", graph ? "graph" : "eager");
    }
    if (early)
        printf("early_weights: b12x step after a writer of q 200 us late gives the bytes of the plain step "
               "(eager and graph)\n");
    else
        printf("early_weights: no dependent started early (MLART_TEST_UNDER_SANITIZER): the step ran after "
               "the late writer, eager and graph, and gave the plain step's bytes; its order is not shown\n");
    mlart_layer_destroy(ly0);
    mlart_layer_destroy(ly1);
    cudaStreamDestroy(st);
    cudaFree(q_new);
    io_free(&io);
    desc_free(&d);
    fx_free(&big);
    free(want), free(got), free(junk);
}
END_TEST

/* Fork and join on the device (tests/gpu/pdl_probe.h): a kernel launched
 * with PDL after an event join must not start before the joined stream's
 * kernel ends, eagerly and from a graph; whether it still starts early
 * with respect to its own stream's previous kernel is printed.  What a
 * layer would rely on to write the step's cache rows on a second stream
 * beside the query absorption, joined before attend(). */
START_TEST(fork_join_probe)
{
    static const char *const mode[] = {"eager", "graph", "graph, edges set by hand"};
    cudaStream_t st;
    ck_assert_int_eq(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
    for (int m = 0; m < 3; m++) {
        int em = -1, es = -1, em2 = -1, es2 = -1, pe = -1, pe2 = -1;
        /* the joined writer late: the dependent must wait for it */
        ck_assert_int_eq(pdl_fork_join(st, m, 0, 200, &em, &es, &pe), 0);
        ck_assert_msg(es == 0, "%s: the dependent read the joined stream's old bytes", mode[m]);
        /* the same-stream writer late: does the dependent still start early? */
        ck_assert_int_eq(pdl_fork_join(st, m, 200, 0, &em2, &es2, &pe2), 0);
        ck_assert_int_eq(es2, 0);
        printf("fork/join (%s): the dependent waited for the joined kernel; after its own stream's "
               "kernel it started %s; %d programmatic edge(s) in the graph\n",
               mode[m], em2 ? "early (the programmatic edge survives the join)" : "only after it ended",
               pe2);
    }
    cudaStreamDestroy(st);
}
END_TEST

/* A token's output in steps of different sizes.  The sm_90 backend picks
 * its kernels per step (the absorption's and V up-projection's path, the
 * attention's top-k split), so the same token can come out differently in a
 * step of T tokens than alone; this measures by how much, at DeepSeek-V3.2
 * TP8 sizes (16 heads, top-k 2048), both cache formats.  Asserted: a step
 * repeated gives the same bytes, and every token's output in a step of any
 * size stays within the backend's output bound (NMSE 1e-4, docs/attention.md)
 * of its output in the full step of 64. */
START_TEST(batch_drift)
{
    enum { T = 64, B = 16, MB = 32, TOPK = 2048, PAGE = 64, H = 16, V = 128 };
    static const int sizes[] = {1, 2, 3, 4, 8, 9, 16, 32};
    fx big;
    fx_init(&big, H, 128, 64, 512, V, TOPK, PAGE, T, B, MB, fx_seed() ^ 0xd21f7ull);
    const size_t row = (size_t)H * V, ob = (size_t)T * row * 2;
    uint16_t *full = malloc(ob), *again = malloc(ob), *part = malloc(ob);
    ck_assert(full && again && part);
    for (int fmt = 0; fmt < 2; fmt++) {
        mlart_layer_desc d = fx_desc(&big, "b12x_mla_sparse");
        mlart_tensor lat = fx_view(big.cache, MLART_DTYPE_BF16, 2, big.num_slots, 576, 0), slots;
        mlart_layer *ly = NULL;
        int32_t *sl = malloc(sizeof(int32_t) * (size_t)big.num_slots);
        mlart_step_io hio = fx_io(&big), io = io_up(&hio);
        double worst = 0.0;
        ck_assert_ptr_nonnull(sl);
        for (int64_t i = 0; i < big.num_slots; i++)
            sl[i] = (int32_t)i;
        slots = fx_view(sl, MLART_DTYPE_I32, 1, big.num_slots, 0, 0);
        d.geom.kv_format = fmt ? MLART_KV_FP8_DS_MLA : MLART_KV_BF16;
        d.kv_cache = fx_view(NULL, MLART_DTYPE_U8, 2, big.num_slots,
                             (int64_t)mlart_kv_bytes_per_token(&d.geom), 0);
        ck_assert_int_eq(cudaMalloc((void **)&d.kv_cache.data, d.kv_cache.extent), cudaSuccess);
        d.kv_cache.base = d.kv_cache.data, d.kv_cache.device = 0;
        d.w_uk_t = up(&d.w_uk_t), d.w_uv = up(&d.w_uv);
        lat = up(&lat), slots = up(&slots);
        ck_assert_msg(mlart_layer_create(ctx, &d, &ly) == 0, "%s", mlart_last_error());
        ck_assert_msg(mlart_layer_write_kv(ly, &lat, &slots, NULL) == 0, "%s", mlart_last_error());
        ck_assert_int_eq(cudaDeviceSynchronize(), cudaSuccess);
        for (int rep = 0; rep < 2; rep++) {
            ck_assert_int_eq(cudaMemset((void *)io.o.base, 0xff, ob), cudaSuccess);
            ck_assert_int_eq(cudaDeviceSynchronize(), cudaSuccess);
            ck_assert_msg(mlart_layer_decode(ly, &io, NULL) == 0, "%s", mlart_last_error());
            ck_assert_int_eq(cudaDeviceSynchronize(), cudaSuccess);
            down(rep ? again : full, &io.o);
        }
        ck_assert_msg(memcmp(full, again, ob) == 0, "%s: the step of %d tokens repeated gave other bytes",
                      fmt ? "fp8" : "bf16", T);
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
            const int n = sizes[si];
            size_t differ = 0;
            double err = 0.0, ref = 0.0, row_worst = 0.0;
            ck_assert_int_eq(cudaMemset((void *)io.o.base, 0xff, ob), cudaSuccess);
            ck_assert_int_eq(cudaDeviceSynchronize(), cudaSuccess);
            for (int c = 0; c < T; c += n) {
                const int m = T - c < n ? T - c : n;
                mlart_step_io sub = io;
                sub.T = m;
                sub.q.data = (char *)io.q.data + (size_t)c * io.q.stride[0] * 2;
                sub.q.shape[0] = m;
                sub.idx.data = (char *)io.idx.data + (size_t)c * TOPK * 4;
                sub.idx.shape[0] = m;
                sub.req_of_token.data = (char *)io.req_of_token.data + (size_t)c * 4;
                sub.req_of_token.shape[0] = m;
                sub.o.data = (char *)io.o.data + (size_t)c * row * 2;
                sub.o.shape[0] = m;
                sub.lse.data = NULL;
                ck_assert_msg(mlart_layer_decode(ly, &sub, NULL) == 0, "%s", mlart_last_error());
            }
            ck_assert_int_eq(cudaDeviceSynchronize(), cudaSuccess);
            down(part, &io.o);
            for (int t = 0; t < T; t++) {
                double e = 0.0, r = 0.0;
                for (size_t i = (size_t)t * row; i < (size_t)(t + 1) * row; i++) {
                    const double a = mlart_bf16_to_f32(part[i]), b = mlart_bf16_to_f32(full[i]);
                    ck_assert_msg(a == a, "%s T=%d: NaN at token %d", fmt ? "fp8" : "bf16", n, t);
                    differ += part[i] != full[i];
                    e += (a - b) * (a - b), r += b * b;
                }
                err += e, ref += r;
                if (r > 0.0 && e / r > row_worst)
                    row_worst = e / r;
            }
            printf("batch drift %s: steps of %2d tokens against one of %d: %5.2f%% of outputs differ, NMSE "
                   "%.2e, worst token %.2e\n",
                   fmt ? "fp8 " : "bf16", n, T, 100.0 * (double)differ / (double)(T * row),
                   ref > 0.0 ? err / ref : 0.0, row_worst);
            ck_assert_msg(ref > 0.0 && err / ref <= 1e-4 && row_worst <= 1e-3,
                          "%s T=%d: NMSE %.3e (worst token %.3e) against the step of %d",
                          fmt ? "fp8" : "bf16", n, err / ref, row_worst, T);
            worst = worst > err / ref ? worst : err / ref;
        }
        printf("batch drift %s: worst NMSE %.2e; the step of %d repeated: the same bytes\n",
               fmt ? "fp8 " : "bf16", worst, T);
        mlart_layer_destroy(ly);
        cudaFree((void *)lat.base), cudaFree((void *)slots.base);
        cudaFree((void *)d.kv_cache.base);
        cudaFree((void *)d.w_uk_t.base), cudaFree((void *)d.w_uv.base);
        io_free(&io);
        free(sl);
    }
    free(full), free(again), free(part);
    fx_free(&big);
}
END_TEST

/* The graph cache on the b12x backend (16 heads, top-k 256, both formats):
 * buckets 1, 2, 4, 8, 16, each step with fresh indices, lengths, queries and
 * new cache rows.  A replay must give the bytes of the step launched
 * directly on the same padded inputs (the cache's own buffers, read after
 * the replay), its padding rows zeros with LSE -inf, and its rows within
 * NMSE 1e-4 of the reference backend's plain step of the T tokens. */
START_TEST(graph_cache_replays)
{
    enum { H = 16, P = 128, R = 64, L = 512, V = 128, K = 256, PAGE = 64, MB = 8, BM = 8, TM = 16 };
    enum { W = L + R, SLOTS = BM * MB * PAGE };
    static const int32_t sizes[] = {1, 2, 4, 8, 16};
    static const int steps[] = {16, 3, 1, 9, 5, 2, 16};
    const size_t row = (size_t)H * V;
    fx big;
    fx_init(&big, H, P, R, L, V, K, PAGE, TM, BM, MB, fx_seed() ^ 0x9a7cull);
    for (int fmt = 0; fmt < 2; fmt++) {
        mlart_layer_desc d = fx_desc(&big, "b12x_mla_sparse");
        mlart_layer *ly = NULL, *ref = NULL;
        mlart_graph_cache *gc = NULL;
        const mlart_graph_bufs *b;
        cudaStream_t st;
        fx_rng r = {big.seed * 31u + (uint64_t)fmt};
        int32_t *h_idx = malloc(sizeof(int32_t) * TM * K), h_req[TM], h_lens[BM], h_slots[TM];
        int32_t *h_bt = malloc(sizeof(int32_t) * BM * MB);
        uint16_t *h_q = malloc(sizeof(uint16_t) * TM * H * (P + R));
        uint16_t *h_rows = malloc(sizeof(uint16_t) * TM * W);
        uint16_t *g_o = malloc(sizeof(uint16_t) * TM * row), *e_o = malloc(sizeof(uint16_t) * TM * row);
        uint16_t *r_o = malloc(sizeof(uint16_t) * TM * row);
        float *g_lse = malloc(sizeof(float) * H * TM), *e_lse = malloc(sizeof(float) * H * TM);
        void *d_eo = NULL, *d_el = NULL, *d_ro = NULL;
        ck_assert(h_idx && h_bt && h_q && h_rows && g_o && e_o && r_o && g_lse && e_lse);
        d.geom.kv_format = fmt ? MLART_KV_FP8_DS_MLA : MLART_KV_BF16;
        d.num_slots = SLOTS;
        d.kv_cache = fx_view(NULL, MLART_DTYPE_U8, 2, SLOTS,
                             (int64_t)mlart_kv_bytes_per_token(&d.geom), 0);
        ck_assert_int_eq(cudaMalloc((void **)&d.kv_cache.data, d.kv_cache.extent), cudaSuccess);
        d.kv_cache.base = d.kv_cache.data, d.kv_cache.device = 0;
        d.w_uk_t = up(&d.w_uk_t), d.w_uv = up(&d.w_uv);
        ck_assert_msg(mlart_layer_create(ctx, &d, &ly) == 0, "%s", mlart_last_error());
        d.backend = "reference";
        ck_assert_msg(mlart_layer_create(ctx, &d, &ref) == 0, "%s", mlart_last_error());
        ck_assert_int_eq(cudaMalloc(&d_eo, sizeof(uint16_t) * TM * row), cudaSuccess);
        ck_assert_int_eq(cudaMalloc(&d_ro, sizeof(uint16_t) * TM * row), cudaSuccess);
        ck_assert_int_eq(cudaMalloc(&d_el, sizeof(float) * H * TM), cudaSuccess);
        ck_assert_int_eq(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
        { /* every slot a random row first */
            uint16_t *all = malloc(sizeof(uint16_t) * SLOTS * W);
            int32_t *sl = malloc(sizeof(int32_t) * SLOTS);
            mlart_tensor lat, slv;
            ck_assert(all && sl);
            for (size_t i = 0; i < (size_t)SLOTS * W; i++)
                all[i] = mlart_f32_to_bf16(fx_uniform(&r));
            for (int i = 0; i < SLOTS; i++)
                sl[i] = i;
            lat = fx_view(all, MLART_DTYPE_BF16, 2, SLOTS, W, 0);
            slv = fx_view(sl, MLART_DTYPE_I32, 1, SLOTS, 0, 0);
            lat = up(&lat), slv = up(&slv);
            ck_assert_msg(mlart_layer_write_kv(ly, &lat, &slv, NULL) == 0, "%s", mlart_last_error());
            ck_assert_int_eq(cudaDeviceSynchronize(), cudaSuccess);
            cudaFree((void *)lat.base), cudaFree((void *)slv.base);
            free(all), free(sl);
        }
        ck_assert_msg(mlart_graph_cache_create(ly, sizes, 5, MLART_GRAPH_WRITE_KV | MLART_GRAPH_LSE, st, &gc) == 0, "%s",
                      mlart_last_error());
        ck_assert_int_eq(mlart_graph_cache_graphs(gc), 5);
        b = mlart_graph_cache_bufs(gc);
        for (int bt = 0; bt < BM * MB; bt++) /* physical blocks in reverse */
            h_bt[bt] = BM * MB - 1 - bt;
        for (size_t si = 0; si < sizeof steps / sizeof steps[0]; si++) {
            const int T = steps[si], Bq = T < BM ? T : BM, Tb = mlart_graph_cache_bucket(gc, T);
            mlart_step_io e, rio;
            double err = 0.0, den = 0.0;
            int rc;
            /* fresh inputs; past row T rows that would give output if the
             * padding left them (valid indices of request 0, slot 0) */
            for (int q = 0; q < Bq; q++)
                h_lens[q] = K / 2 + (int32_t)(fx_next(&r) % (uint64_t)(MB * PAGE - K / 2));
            for (int t = 0; t < TM; t++) {
                const int q = t % Bq, pos = h_lens[q] - 1 - t / Bq;
                h_req[t] = t < T ? q : 0;
                h_slots[t] = t < T ? h_bt[q * MB + pos / PAGE] * PAGE + pos % PAGE : 0;
                for (int k = 0; k < K; k++)
                    h_idx[t * K + k] = t >= T ? k % h_lens[0]
                                      : fx_next(&r) % 10 == 0 ? -1
                                                              : (int32_t)(fx_next(&r) % (uint64_t)h_lens[q]);
                for (int i = 0; i < H * (P + R); i++)
                    h_q[(size_t)t * H * (P + R) + i] = mlart_f32_to_bf16(fx_uniform(&r));
                for (int i = 0; i < W; i++)
                    h_rows[(size_t)t * W + i] = mlart_f32_to_bf16(fx_uniform(&r));
            }
            ck_assert_int_eq(cudaMemcpy(b->io.q.data, h_q, sizeof(uint16_t) * TM * H * (P + R), cudaMemcpyHostToDevice), cudaSuccess);
            ck_assert_int_eq(cudaMemcpy(b->io.idx.data, h_idx, sizeof(int32_t) * TM * K, cudaMemcpyHostToDevice), cudaSuccess);
            ck_assert_int_eq(cudaMemcpy(b->io.req_of_token.data, h_req, sizeof h_req, cudaMemcpyHostToDevice), cudaSuccess);
            ck_assert_int_eq(cudaMemcpy(b->io.seq_lens.data, h_lens, sizeof(int32_t) * (size_t)Bq, cudaMemcpyHostToDevice), cudaSuccess);
            ck_assert_int_eq(cudaMemcpy(b->io.block_table.data, h_bt, sizeof(int32_t) * BM * MB, cudaMemcpyHostToDevice), cudaSuccess);
            ck_assert_int_eq(cudaMemcpy(b->rows.data, h_rows, sizeof(uint16_t) * TM * W, cudaMemcpyHostToDevice), cudaSuccess);
            ck_assert_int_eq(cudaMemcpy(b->slots.data, h_slots, sizeof h_slots, cudaMemcpyHostToDevice), cudaSuccess);
            ck_assert_int_eq(cudaMemset(b->io.o.data, 0xff, b->io.o.extent), cudaSuccess);
            ck_assert_int_eq(cudaMemset(b->io.lse.data, 0xff, b->io.lse.extent), cudaSuccess);
            ck_assert_int_eq(cudaDeviceSynchronize(), cudaSuccess);

            rc = mlart_graph_cache_run(gc, T, Bq, st);
            ck_assert_msg(rc == Tb, "T = %d: %d (%s)", T, rc, mlart_last_error());
            ck_assert_int_eq(cudaStreamSynchronize(st), cudaSuccess);
            ck_assert_int_eq(cudaMemcpy(g_o, b->io.o.data, sizeof(uint16_t) * (size_t)Tb * row, cudaMemcpyDeviceToHost), cudaSuccess);
            ck_assert_int_eq(cudaMemcpy(g_lse, b->io.lse.data, sizeof(float) * H * TM, cudaMemcpyDeviceToHost), cudaSuccess);
            { /* the padding the run wrote */
                int32_t pi[TM * K], pr[TM], ps[TM], pl[BM];
                uint16_t *pq = malloc(sizeof(uint16_t) * TM * H * (P + R));
                ck_assert_ptr_nonnull(pq);
                ck_assert_int_eq(cudaMemcpy(pi, b->io.idx.data, sizeof pi, cudaMemcpyDeviceToHost), cudaSuccess);
                ck_assert_int_eq(cudaMemcpy(pr, b->io.req_of_token.data, sizeof pr, cudaMemcpyDeviceToHost), cudaSuccess);
                ck_assert_int_eq(cudaMemcpy(ps, b->slots.data, sizeof ps, cudaMemcpyDeviceToHost), cudaSuccess);
                ck_assert_int_eq(cudaMemcpy(pl, b->io.seq_lens.data, sizeof pl, cudaMemcpyDeviceToHost), cudaSuccess);
                ck_assert_int_eq(cudaMemcpy(pq, b->io.q.data, sizeof(uint16_t) * TM * H * (P + R), cudaMemcpyDeviceToHost), cudaSuccess);
                for (int t = 0; t < TM; t++) {
                    const int padded = t >= T && t < Tb;
                    ck_assert_msg(!padded || (pr[t] == 0 && ps[t] == -1 && pi[t * K] == -1 &&
                                              pi[t * K + K - 1] == -1 && pq[(size_t)t * H * (P + R)] == 0 &&
                                              pq[(size_t)(t + 1) * H * (P + R) - 1] == 0),
                                  "T = %d: row %d not padded (req %d, slot %d, idx %d)", T, t, pr[t], ps[t], pi[t * K]);
                    ck_assert_msg(t < Tb || ps[t] == 0, "T = %d: row %d past bucket %d changed", T, t, Tb);
                    ck_assert_msg(t >= T || ps[t] == h_slots[t], "T = %d: row %d's slot changed", T, t);
                }
                /* a graph takes every request: the lengths an earlier step of
                 * more requests left are zeroed */
                for (int q = 0; q < BM; q++)
                    ck_assert_msg(q < Bq ? pl[q] == h_lens[q] : pl[q] == 0,
                                  "T = %d: seq_lens[%d] = %d", T, q, pl[q]);
                free(pq);
            }

            /* the same step launched directly on the padded buffers (the
             * rows are in the cache already: writing them again changes
             * nothing) */
            e = b->io;
            e.T = Tb;
            e.q.shape[0] = e.idx.shape[0] = e.req_of_token.shape[0] = Tb;
            e.o = mlart_tensor_dense(d_eo, MLART_DTYPE_BF16, 0, 2, (int64_t[]){Tb, (int64_t)row});
            e.lse = mlart_tensor_dense(d_el, MLART_DTYPE_F32, 0, 2, (int64_t[]){H, Tb});
            ck_assert_msg(mlart_layer_decode(ly, &e, st) == 0, "%s", mlart_last_error());
            rio = e;
            rio.T = T;
            rio.B = Bq;
            rio.seq_lens.shape[0] = rio.block_table.shape[0] = Bq;
            rio.q.shape[0] = rio.idx.shape[0] = rio.req_of_token.shape[0] = T;
            rio.o = mlart_tensor_dense(d_ro, MLART_DTYPE_BF16, 0, 2, (int64_t[]){T, (int64_t)row});
            memset(&rio.lse, 0, sizeof rio.lse);
            ck_assert_msg(mlart_layer_decode(ref, &rio, st) == 0, "%s", mlart_last_error());
            ck_assert_int_eq(cudaStreamSynchronize(st), cudaSuccess);
            ck_assert_int_eq(cudaMemcpy(e_o, d_eo, sizeof(uint16_t) * (size_t)Tb * row, cudaMemcpyDeviceToHost), cudaSuccess);
            ck_assert_int_eq(cudaMemcpy(e_lse, d_el, sizeof(float) * H * (size_t)Tb, cudaMemcpyDeviceToHost), cudaSuccess);
            ck_assert_int_eq(cudaMemcpy(r_o, d_ro, sizeof(uint16_t) * (size_t)T * row, cudaMemcpyDeviceToHost), cudaSuccess);

            ck_assert_msg(memcmp(g_o, e_o, sizeof(uint16_t) * (size_t)Tb * row) == 0,
                          "%s T = %d: the replay of bucket %d differs from the direct step",
                          fmt ? "fp8" : "bf16", T, Tb);
            for (int h = 0; h < H; h++)
                for (int t = 0; t < Tb; t++) {
                    const float gv = g_lse[h * TM + t], ev = e_lse[h * Tb + t];
                    ck_assert_msg(memcmp(&gv, &ev, 4) == 0, "%s T = %d: lse[%d][%d] %g, direct %g",
                                  fmt ? "fp8" : "bf16", T, h, t, gv, ev);
                    if (t >= T)
                        ck_assert_msg(isinf(gv) && gv < 0, "T = %d: padding lse %g", T, gv);
                }
            for (size_t i = (size_t)T * row; i < (size_t)Tb * row; i++)
                ck_assert_msg(g_o[i] == 0, "%s T = %d: padding output [%zu] = 0x%04x",
                              fmt ? "fp8" : "bf16", T, i, g_o[i]);
            for (size_t i = 0; i < (size_t)T * row; i++) {
                const double a = mlart_bf16_to_f32(g_o[i]), c = mlart_bf16_to_f32(r_o[i]);
                ck_assert_msg(a == a, "T = %d: NaN at %zu", T, i);
                err += (a - c) * (a - c), den += c * c;
            }
            printf("graph cache %s: T = %2d in bucket %2d: replay = direct step, NMSE %.2e against "
                   "the reference\n", fmt ? "fp8 " : "bf16", T, Tb, den > 0 ? err / den : 0.0);
            ck_assert_msg(den > 0 && err / den <= 1e-4, "%s T = %d: NMSE %.3e against the reference",
                          fmt ? "fp8" : "bf16", T, den > 0 ? err / den : 0.0);
        }
        mlart_graph_cache_destroy(gc);
        mlart_layer_destroy(ly);
        mlart_layer_destroy(ref);
        cudaStreamDestroy(st);
        cudaFree(d_eo), cudaFree(d_el), cudaFree(d_ro);
        cudaFree((void *)d.kv_cache.base), cudaFree((void *)d.w_uk_t.base), cudaFree((void *)d.w_uv.base);
        free(h_idx), free(h_bt), free(h_q), free(h_rows), free(g_o), free(e_o), free(r_o);
        free(g_lse), free(e_lse);
    }
    fx_free(&big);
}
END_TEST

int main(void)
{
    Suite *s;
    TCase *tc;
    int n = 0;
    if (mlart_cuda_device_count(&n) < 0 || n == 0) {
        printf("no usable CUDA device: skipped\n");
        return 77;
    }
    s = suite_create("runtime_layer_gpu");
    tc = tcase_create("layer_gpu");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_test(tc, contiguous_query_on_device);
    tcase_add_test(tc, reference_on_device);
    tcase_add_test(tc, early_weights_after_late_writer);
    tcase_add_test(tc, batch_drift);
    tcase_add_test(tc, fork_join_probe);
    tcase_add_test(tc, graph_cache_replays);
    tcase_set_timeout(tc, 120);
    suite_add_tcase(s, tc);
    return check_run(s, CK_NOFORK); /* CUDA does not survive fork() */
}
