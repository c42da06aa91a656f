/* mlart_kv_write_cuda against mlart_kv_write_cpu, byte for byte: random rows
 * with per-tile magnitudes over many binades, an all-zero tile, tiles whose
 * amax sits exactly on 448 * 2^k, tiny (e4m3 subnormal) values, skipped (-1)
 * and repeated slots (the later row wins); then the reference records of
 * tests/data (kv_latent.bin -> kv_fp8.bin).  Both formats.  Also the
 * attention kernels' dequantisation of those records (e4m3 x tile scale ->
 * bf16 on the device) against the host numerics, for every e4m3 value; and
 * the op after a kernel that writes its inputs late (it launches with
 * programmatic dependent launch); other row widths (both kernels of the
 * op); many rows (100000, several rounds of the claim path) on each path;
 * each operand ending at unmapped memory (guard pages) on each path. */
#include <check.h>
#include <cuda_runtime.h>

#include "attn_util.h"
#include "fp8_probe.h"
#include "guard_alloc.h"
#include "pdl_probe.h"
#include "ops/kv_write_cuda.h"
#include "ops/numerics.h"
#include "ops/ops.h"

static uint64_t g_seed;

static void *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    void *p;
    long n;
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    p = malloc((size_t)n);
    if (fread(p, 1, (size_t)n, f) != (size_t)n) {
        free(p);
        p = NULL;
    }
    fclose(f);
    *len = (size_t)n;
    return p;
}

static mlart_geometry geom(mlart_kv_format fmt)
{
    mlart_geometry g;
    memset(&g, 0, sizeof g);
    g.heads = 16;
    g.qk_nope = 128;
    g.rope = 64;
    g.kv_lora = 512;
    g.v_head = 128;
    g.topk = 2048;
    g.page_size = 64;
    g.kv_format = fmt;
    g.softmax_scale = 0.0417f;
    return g;
}

/* A loop test's case _i: its format (0 bf16, 1 fp8_ds_mla), that
 * format's geometry, and a seed of its own (salt) in *rng. */
static mlart_geometry loop_geom(int i, int salt, uint64_t *rng)
{
    *rng = g_seed ^ (uint64_t)(i + salt) * 0x9E3779B97F4A7C15ull;
    return geom(i ? MLART_KV_FP8_DS_MLA : MLART_KV_BF16);
}

/* The first byte where a and b differ, or n: one check assert a buffer,
 * not one a byte (each passing assert sends the parent a message). */
static size_t first_diff(const uint8_t *a, const uint8_t *b, size_t n)
{
    size_t i = 0;
    if (!memcmp(a, b, n))
        return n;
    while (a[i] == b[i])
        i++;
    return i;
}

/* Wait for what was enqueued on st; with `graph`, st was capturing: end
 * the capture and replay the graph once first. */
static void finish(cudaStream_t st, int graph)
{
    cudaGraph_t gr;
    cudaGraphExec_t ge = NULL;
    if (graph) {
        GPU_CUDA(cudaStreamEndCapture(st, &gr));
        GPU_CUDA(cudaGraphInstantiate(&ge, gr, 0));
        GPU_CUDA(cudaGraphLaunch(ge, st));
        GPU_CUDA(cudaGraphDestroy(gr));
    }
    GPU_CUDA(cudaStreamSynchronize(st));
    if (ge)
        GPU_CUDA(cudaGraphExecDestroy(ge));
}

/* The paths compare_write runs: each of them, and the claim path once more
 * captured in a CUDA graph and replayed. */
enum { RUN_SCAN = 1, RUN_CLAIM = 2, RUN_AUTO = 4, RUN_CLAIM_GRAPH = 8, RUN_ALL = 15 };

/* Write rows into a cache that starts from the same random bytes on both
 * sides, with the CPU twin and with the CUDA op on every path in `runs`,
 * and compare the whole cache after each. */
static void compare_write(const mlart_geometry *g, const uint16_t *lat, const int32_t *slots,
                          int64_t N, int64_t num_slots, uint64_t *rng, int runs)
{
    static const char *names[] = {"scan", "claim", "auto", "claim in a graph"};
    const size_t rb = mlart_kv_bytes_per_token(g);
    const int64_t W = g->kv_lora + g->rope; /* values a row */
    const size_t cache_bytes = rb * (size_t)num_slots;
    uint8_t *init = malloc(cache_bytes), *host = malloc(cache_bytes), *back = malloc(cache_bytes);
    void *dcache, *dlat, *dslots;
    cudaStream_t st;
    ck_assert(init && host && back);
    for (size_t i = 0; i < cache_bytes; i++)
        init[i] = (uint8_t)gpu_rand(rng);
    memcpy(host, init, cache_bytes);
    GPU_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    GPU_CUDA(cudaMalloc(&dcache, cache_bytes));
    GPU_CUDA(cudaMalloc(&dlat, (size_t)(N * W) * 2));
    GPU_CUDA(cudaMalloc(&dslots, (size_t)N * 4));
    GPU_CUDA(cudaMemcpy(dlat, lat, (size_t)(N * W) * 2, cudaMemcpyHostToDevice));
    GPU_CUDA(cudaMemcpy(dslots, slots, (size_t)N * 4, cudaMemcpyHostToDevice));

    mlart_tensor hc = attn_t(host, MLART_DTYPE_U8, -1, 2, num_slots, (int64_t)rb, 0);
    mlart_tensor hl = attn_t((void *)lat, MLART_DTYPE_BF16, -1, 2, N, W, 0);
    mlart_tensor hs = attn_t((void *)slots, MLART_DTYPE_I32, -1, 1, N, 0, 0);
    mlart_tensor dc = attn_t(dcache, MLART_DTYPE_U8, 0, 2, num_slots, (int64_t)rb, 0);
    mlart_tensor dl = attn_t(dlat, MLART_DTYPE_BF16, 0, 2, N, W, 0);
    mlart_tensor ds = attn_t(dslots, MLART_DTYPE_I32, 0, 1, N, 0, 0);
    ck_assert_msg(mlart_kv_write_cpu(g, &hc, &hl, &hs) == 0, "cpu: %s", mlart_last_error());
    for (int k = 0; k < 4; k++) {
        static const int path[] = {MLART_KVW_SCAN, MLART_KVW_CLAIM, MLART_KVW_AUTO, MLART_KVW_CLAIM};
        if (!(runs & (1 << k)))
            continue;
        GPU_CUDA(cudaMemcpy(dcache, init, cache_bytes, cudaMemcpyHostToDevice));
        /* a copy from pageable memory may return before its DMA lands, and
         * st does not wait for the legacy stream */
        GPU_CUDA(cudaDeviceSynchronize());
        if (k == 3)
            GPU_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        ck_assert_msg(mlart_kv_write_cuda_path(g, &dc, &dl, &ds, st, path[k]) == 0, "cuda %s: %s",
                      names[k], mlart_last_error());
        finish(st, k == 3);
        GPU_CUDA(cudaMemcpy(back, dcache, cache_bytes, cudaMemcpyDeviceToHost));
        const size_t i = first_diff(host, back, cache_bytes);
        ck_assert_msg(i == cache_bytes,
                      "%s, %s path: cache byte %zu (slot %zu, offset %zu): cpu 0x%02x, cuda 0x%02x",
                      mlart_kv_format_name(g->kv_format), names[k], i, i / rb, i % rb, host[i],
                      back[i]);
    }
    free(init);
    free(host);
    free(back);
    GPU_CUDA(cudaStreamDestroy(st));
    cudaFree(dcache);
    cudaFree(dlat);
    cudaFree(dslots);
}

START_TEST(test_random_rows)
{
    uint64_t rng;
    const mlart_geometry g = loop_geom(_i, 1, &rng);
    const mlart_kv_format fmt = g.kv_format;
    const int64_t N = 1000, num_slots = 1536;
    uint16_t *lat = malloc((size_t)N * 576 * 2);
    int32_t *slots = malloc((size_t)N * 4);
    for (int64_t n = 0; n < N; n++) {
        uint16_t *row = lat + n * 576;
        for (int t = 0; t < 5; t++) {
            const int lo = t * 128, hi = t < 4 ? lo + 128 : 576;
            const int kind = (int)(gpu_rand(&rng) % 8);
            const float mag = ldexpf(1.0f, (int)(gpu_rand(&rng) % 40) - 20);
            for (int i = lo; i < hi; i++) {
                float v = mag * attn_uniform(&rng);
                if (kind == 0)
                    v = 0.0f; /* all-zero tile */
                else if (kind == 1 && i == lo + 5)
                    v = -448.0f * mag; /* amax exactly on a power-of-two boundary */
                else if (kind == 2)
                    v *= 1e-3f; /* lands in e4m3 subnormals after scaling */
                row[i] = mlart_f32_to_bf16(v);
            }
        }
        if (n == 0)
            for (int i = 0; i < 576; i++)
                row[i] = 0; /* one all-zero row */
        const int r = (int)(gpu_rand(&rng) % 20);
        slots[n] = r == 0 ? -1 : r == 1 && n > 0 ? slots[gpu_rand(&rng) % (uint64_t)n]
                                                 : (int32_t)(gpu_rand(&rng) % (uint64_t)num_slots);
    }
    compare_write(&g, lat, slots, N, num_slots, &rng, RUN_ALL);
    printf("kv_write %s: %lld random rows (zero tiles, pow2-boundary amax, subnormals, -1 and "
           "repeated slots): cuda == cpu byte for byte on the scan and claim paths, auto, and "
           "the claim path in a graph (seed 0x%llx)\n",
           mlart_kv_format_name(fmt), (long long)N, (unsigned long long)g_seed);
    free(lat);
    free(slots);
}
END_TEST

/* Other row widths: L <= 512 and R <= 128 take the kernel with one tile
 * and one rope round a warp (the lanes past the row masked), larger ones
 * the one with three tiles and twelve rope rounds (up to L = 1408 here,
 * R = 256), bf16 rows of any L; random rows with per-tile magnitudes over
 * many binades, -1 and repeated slots. */
START_TEST(test_other_widths)
{
    static const struct {
        int L, R;
        mlart_kv_format fmt;
    } cases[] = {{256, 32, MLART_KV_FP8_DS_MLA}, {256, 32, MLART_KV_BF16}, {1024, 64, MLART_KV_FP8_DS_MLA},
                 {1024, 256, MLART_KV_BF16}, {100, 20, MLART_KV_BF16}, {1408, 128, MLART_KV_FP8_DS_MLA},
                 {384, 192, MLART_KV_FP8_DS_MLA}, {1536, 200, MLART_KV_BF16}};
    uint64_t rng = g_seed ^ 0x3C6EF372FE94F82Bull;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        mlart_geometry g = geom(cases[c].fmt);
        g.kv_lora = cases[c].L;
        g.rope = cases[c].R;
        const int64_t N = 300, num_slots = 512, W = g.kv_lora + g.rope;
        uint16_t *lat = malloc((size_t)(N * W) * 2);
        int32_t *slots = malloc((size_t)N * 4);
        ck_assert(lat && slots);
        for (int64_t n = 0; n < N; n++) {
            for (int64_t i = 0; i < W; i++) {
                if (i % 128 == 0)
                    rng ^= gpu_rand(&rng) << 7;
                const float mag = ldexpf(1.0f, (int)((rng >> 3) % 40) - 20);
                lat[n * W + i] = mlart_f32_to_bf16(mag * attn_uniform(&rng));
            }
            const int r = (int)(gpu_rand(&rng) % 20);
            slots[n] = r == 0 ? -1 : r == 1 && n > 0 ? slots[gpu_rand(&rng) % (uint64_t)n]
                                                     : (int32_t)(gpu_rand(&rng) % (uint64_t)num_slots);
        }
        compare_write(&g, lat, slots, N, num_slots, &rng, RUN_SCAN | RUN_CLAIM);
        printf("kv_write %s L %d R %d: %lld random rows: cuda == cpu byte for byte, scan and "
               "claim paths\n",
               mlart_kv_format_name(g.kv_format), g.kv_lora, g.rope, (long long)N);
        free(lat);
        free(slots);
    }
}
END_TEST

/* Many rows: more than one round of the claim kernel (32 rows a worker),
 * slots drawn from fewer slots than rows, so most slots are named several
 * times and far apart (the first and the last row name one slot, rows of
 * different rounds name others), and -1 rows; every path against the CPU
 * twin. */
START_TEST(test_many_rows)
{
    uint64_t rng;
    const mlart_geometry g = loop_geom(_i, 11, &rng);
    const mlart_kv_format fmt = g.kv_format;
    const int64_t N = 100000, num_slots = 40000;
    uint16_t *lat = malloc((size_t)N * 576 * 2);
    int32_t *slots = malloc((size_t)N * 4);
    ck_assert(lat && slots);
    for (int64_t i = 0; i < N * 576; i++)
        lat[i] = mlart_f32_to_bf16(ldexpf(attn_uniform(&rng), (int)(i / 128 % 9) - 4));
    for (int64_t n = 0; n < N; n++)
        slots[n] = gpu_rand(&rng) % 16 == 0 ? -1 : (int32_t)(gpu_rand(&rng) % (uint64_t)num_slots);
    slots[N - 1] = slots[0] = 12345;
    slots[N / 2] = slots[1] = 777;
    compare_write(&g, lat, slots, N, num_slots, &rng, RUN_ALL);
    printf("kv_write %s: %lld rows into %lld slots (repeats across rounds, -1 rows): cuda == cpu "
           "byte for byte on the scan and claim paths, auto, and the claim path in a graph\n",
           mlart_kv_format_name(fmt), (long long)N, (long long)num_slots);
    free(lat);
    free(slots);
}
END_TEST

/* Read-exact: each operand in turn (the cache, the latent rows, the slots)
 * in a guard-page allocation whose span ends at the end of the mapped
 * memory (tests/gpu/guard_alloc.h), on both paths; a byte read or written
 * past it faults the launch.  The last slot and the last row are written
 * (slot num_slots - 1 is named), and the records must equal the CPU
 * twin's. */
START_TEST(test_guard_pages)
{
    static const char *place[] = {"cache", "latent rows", "slots"};
    static const int64_t Ns[] = {1, 33, 3000};
    uint64_t rng;
    const mlart_geometry g = loop_geom(_i, 21, &rng);
    const mlart_kv_format fmt = g.kv_format;
    const size_t rb = mlart_kv_bytes_per_token(&g);
    int runs = 0;
    ck_assert_msg(mlart_guard_init(0) == 0, "%s", mlart_guard_error());
    for (size_t in = 0; in < sizeof Ns / sizeof Ns[0]; in++) {
        const int64_t N = Ns[in], num_slots = N < 64 ? 64 : N + N / 2;
        const size_t cb = rb * (size_t)num_slots, lb = (size_t)N * 576 * 2, sb = (size_t)N * 4;
        uint16_t *lat = malloc(lb);
        int32_t *slots = malloc(sb);
        uint8_t *init = malloc(cb), *want = malloc(cb), *back = malloc(cb);
        ck_assert(lat && slots && init && want && back);
        for (int64_t i = 0; i < N * 576; i++)
            lat[i] = mlart_f32_to_bf16(attn_uniform(&rng));
        for (int64_t n = 0; n < N; n++)
            slots[n] = n % 7 == 3 ? -1 : (int32_t)(gpu_rand(&rng) % (uint64_t)num_slots);
        slots[N - 1] = (int32_t)(num_slots - 1);
        for (size_t i = 0; i < cb; i++)
            init[i] = (uint8_t)gpu_rand(&rng);
        memcpy(want, init, cb);
        {
            mlart_tensor hc = attn_t(want, MLART_DTYPE_U8, -1, 2, num_slots, (int64_t)rb, 0);
            mlart_tensor hl = attn_t(lat, MLART_DTYPE_BF16, -1, 2, N, 576, 0);
            mlart_tensor hs = attn_t(slots, MLART_DTYPE_I32, -1, 1, N, 0, 0);
            ck_assert_msg(mlart_kv_write_cpu(&g, &hc, &hl, &hs) == 0, "cpu: %s", mlart_last_error());
        }
        for (int path = MLART_KVW_SCAN; path <= MLART_KVW_CLAIM; path++)
            for (int pl = 0; pl < 3; pl++) {
                mlart_guard_buf gb = {0};
                void *dc = NULL, *dl = NULL, *ds = NULL;
                const size_t bytes = pl == 0 ? cb : pl == 1 ? lb : sb;
                ck_assert_msg(mlart_guard_alloc(&gb, bytes, 0) == 0, "%s", mlart_guard_error());
                ck_assert((uintptr_t)gb.ptr + gb.bytes == gb.va + gb.mapped);
                if (pl == 0)
                    dc = gb.ptr;
                else
                    GPU_CUDA(cudaMalloc(&dc, cb));
                if (pl == 1)
                    dl = gb.ptr;
                else
                    GPU_CUDA(cudaMalloc(&dl, lb));
                if (pl == 2)
                    ds = gb.ptr;
                else
                    GPU_CUDA(cudaMalloc(&ds, sb));
                GPU_CUDA(cudaMemcpy(dc, init, cb, cudaMemcpyHostToDevice));
                GPU_CUDA(cudaMemcpy(dl, lat, lb, cudaMemcpyHostToDevice));
                GPU_CUDA(cudaMemcpy(ds, slots, sb, cudaMemcpyHostToDevice));
                mlart_tensor tc = attn_t(dc, MLART_DTYPE_U8, 0, 2, num_slots, (int64_t)rb, 0);
                mlart_tensor tl = attn_t(dl, MLART_DTYPE_BF16, 0, 2, N, 576, 0);
                mlart_tensor ts = attn_t(ds, MLART_DTYPE_I32, 0, 1, N, 0, 0);
                ck_assert_msg(mlart_kv_write_cuda_path(&g, &tc, &tl, &ts, NULL, path) == 0, "%s",
                              mlart_last_error());
                GPU_CUDA(cudaDeviceSynchronize());
                GPU_CUDA(cudaMemcpy(back, dc, cb, cudaMemcpyDeviceToHost));
                const size_t i = first_diff(want, back, cb);
                ck_assert_msg(i == cb, "%s N %lld path %d, guarded %s: cache byte %zu: want 0x%02x, got 0x%02x",
                              mlart_kv_format_name(fmt), (long long)N, path, place[pl], i, want[i], back[i]);
                if (pl != 0)
                    cudaFree(dc);
                if (pl != 1)
                    cudaFree(dl);
                if (pl != 2)
                    cudaFree(ds);
                mlart_guard_free(&gb);
                runs++;
            }
        free(lat);
        free(slots);
        free(init);
        free(want);
        free(back);
    }
    printf("kv_write %s guard pages: %d runs (N 1, 33, 3000; scan and claim paths; the cache, the "
           "latent rows and the slots each ending at unmapped memory), 0 faults, records equal to "
           "the CPU twin's\n", mlart_kv_format_name(fmt), runs);
}
END_TEST

/* The independent records of tests/data: kv_latent.bin -> kv_fp8.bin. */
START_TEST(test_reference_records)
{
    static const char *cases[] = {"small-fp8", "glm5h4-fp8"};
    const mlart_geometry g = geom(MLART_KV_FP8_DS_MLA);
    char path[512];
    size_t lat_len = 0, rec_len = 0;
    snprintf(path, sizeof path, "%s/%s/kv_latent.bin", MLART_TEST_DATA, cases[_i]);
    uint16_t *lat = read_file(path, &lat_len);
    ck_assert_msg(lat != NULL, "cannot read %s", path);
    snprintf(path, sizeof path, "%s/%s/kv_fp8.bin", MLART_TEST_DATA, cases[_i]);
    uint8_t *rec = read_file(path, &rec_len);
    ck_assert_msg(rec != NULL, "cannot read %s", path);
    const int64_t N = (int64_t)(lat_len / (576 * 2));
    ck_assert_uint_eq(rec_len, (size_t)N * 656);
    void *dcache, *dlat, *dslots;
    int32_t *slots = malloc((size_t)N * 4);
    uint8_t *back = malloc(rec_len);
    for (int64_t n = 0; n < N; n++)
        slots[n] = (int32_t)n;
    GPU_CUDA(cudaMalloc(&dcache, rec_len));
    GPU_CUDA(cudaMalloc(&dlat, lat_len));
    GPU_CUDA(cudaMalloc(&dslots, (size_t)N * 4));
    GPU_CUDA(cudaMemset(dcache, 0xa5, rec_len));
    GPU_CUDA(cudaMemcpy(dlat, lat, lat_len, cudaMemcpyHostToDevice));
    GPU_CUDA(cudaMemcpy(dslots, slots, (size_t)N * 4, cudaMemcpyHostToDevice));
    mlart_tensor dc = attn_t(dcache, MLART_DTYPE_U8, 0, 2, N, 656, 0);
    mlart_tensor dl = attn_t(dlat, MLART_DTYPE_BF16, 0, 2, N, 576, 0);
    mlart_tensor ds = attn_t(dslots, MLART_DTYPE_I32, 0, 1, N, 0, 0);
    ck_assert_msg(mlart_kv_write_cuda(&g, &dc, &dl, &ds, NULL) == 0, "%s", mlart_last_error());
    GPU_CUDA(cudaDeviceSynchronize());
    GPU_CUDA(cudaMemcpy(back, dcache, rec_len, cudaMemcpyDeviceToHost));
    const size_t i = first_diff(back, rec, rec_len);
    ck_assert_msg(i == rec_len, "%s: record %zu byte %zu: 0x%02x, want 0x%02x", cases[_i], i / 656,
                  i % 656, back[i], rec[i]);
    printf("kv_write fp8_ds_mla: %lld rows of %s equal the reference records\n", (long long)N,
           cases[_i]);
    free(lat);
    free(rec);
    free(slots);
    free(back);
    cudaFree(dcache);
    cudaFree(dlat);
    cudaFree(dslots);
}
END_TEST

START_TEST(test_bad_input)
{
    const mlart_geometry g = geom(MLART_KV_FP8_DS_MLA);
    uint8_t host[656];
    uint16_t lat[576] = {0};
    int32_t slot = 0;
    void *dcache, *dlat, *dslots;
    GPU_CUDA(cudaMalloc(&dcache, 1280));
    GPU_CUDA(cudaMalloc(&dlat, sizeof lat));
    GPU_CUDA(cudaMalloc(&dslots, 4));
    mlart_tensor hc = attn_t(host, MLART_DTYPE_U8, -1, 2, 1, 656, 0);
    mlart_tensor hl = attn_t(lat, MLART_DTYPE_BF16, -1, 2, 1, 576, 0);
    mlart_tensor hs = attn_t(&slot, MLART_DTYPE_I32, -1, 1, 1, 0, 0);
    /* host operands to the CUDA op */
    ck_assert_int_eq(mlart_kv_write_cuda(&g, &hc, &hl, &hs, NULL), MLART_EINVAL);
    /* rows of the wrong size for the format */
    mlart_tensor dc = attn_t(dcache, MLART_DTYPE_U8, 0, 2, 1, 1152, 0);
    mlart_tensor dl = attn_t(dlat, MLART_DTYPE_BF16, 0, 2, 1, 576, 0);
    mlart_tensor ds = attn_t(dslots, MLART_DTYPE_I32, 0, 1, 1, 0, 0);
    ck_assert_int_eq(mlart_kv_write_cuda(&g, &dc, &dl, &ds, NULL), MLART_ESHAPE);
    /* a view whose span passes its extent */
    dc = attn_t(dcache, MLART_DTYPE_U8, 0, 2, 1, 656, 0);
    dc.extent = 600;
    ck_assert_int_eq(mlart_kv_write_cuda(&g, &dc, &dl, &ds, NULL), MLART_ELAYOUT);
    /* L over 1536: not on CUDA (the host twin takes it) */
    {
        mlart_geometry wide = g;
        wide.kv_lora = 1664;
        wide.rope = 64;
        const size_t rb = mlart_kv_bytes_per_token(&wide);
        void *wc, *wl;
        GPU_CUDA(cudaMalloc(&wc, rb));
        GPU_CUDA(cudaMalloc(&wl, 1728 * 2));
        mlart_tensor c1 = attn_t(wc, MLART_DTYPE_U8, 0, 2, 1, (int64_t)rb, 0);
        mlart_tensor l1 = attn_t(wl, MLART_DTYPE_BF16, 0, 2, 1, 1728, 0);
        ck_assert_int_eq(mlart_kv_write_cuda(&wide, &c1, &l1, &ds, NULL), MLART_ENOTSUP);
        cudaFree(wc);
        cudaFree(wl);
    }
    /* the claim path's claim words need 4-byte aligned rows */
    {
        const mlart_geometry gb = geom(MLART_KV_BF16);
        mlart_tensor c2 = attn_t((uint8_t *)dcache + 2, MLART_DTYPE_U8, 0, 2, 1, 1152, 0);
        mlart_tensor l2 = attn_t(dlat, MLART_DTYPE_BF16, 0, 2, 1, 576, 0);
        ck_assert_int_eq(mlart_kv_write_cuda_path(&gb, &c2, &l2, &ds, NULL, MLART_KVW_CLAIM),
                         MLART_ELAYOUT);
        ck_assert_int_eq(mlart_kv_write_cuda_path(&gb, &c2, &l2, &ds, NULL, 3), MLART_EINVAL);
    }
    printf("kv_write cuda: host operands, wrong row size, span past extent, L over 1536, the "
           "claim path on 2-byte aligned rows, an unknown path refused\n");
    cudaFree(dcache);
    cudaFree(dlat);
    cudaFree(dslots);
}
END_TEST

/* Every e4m3 byte but the two NaN codes (0x7f, 0xff, never written by the
 * quantiser), times power-of-two scales from 2^-100 to 2^100 (every tile
 * scale whose products stay normal bf16), through the kernels'
 * dequantisation on the device: bit for bit the host's e4m3 value times
 * the scale rounded to bf16 (exact: at most 4 significant bits). */
START_TEST(test_dequant_exact)
{
    static const int ks[] = {-100, -64, -20, -9, -7, -1, 0, 1, 3, 7, 8, 9, 20, 64, 100};
    const int nk = (int)(sizeof ks / sizeof ks[0]);
    const int n = 16 * nk; /* 16 pieces of 16 bytes = all 256 bytes per scale */
    uint8_t *pieces = malloc((size_t)n * 16);
    float *scales = malloc((size_t)n * sizeof(float));
    uint16_t *out = malloc((size_t)n * 16 * sizeof(uint16_t));
    int checked = 0;
    for (int k = 0; k < nk; k++)
        for (int p = 0; p < 16; p++) {
            for (int b = 0; b < 16; b++)
                pieces[(k * 16 + p) * 16 + b] = (uint8_t)(p * 16 + b);
            scales[k * 16 + p] = ldexpf(1.0f, ks[k]);
        }
    ck_assert_int_eq(fp8_probe_dequant(pieces, scales, n, out), 0);
    for (int i = 0; i < n * 16; i++) {
        const uint8_t b = pieces[i];
        if ((b & 0x7f) == 0x7f)
            continue;
        const float want = mlart_e4m3_to_f32(b) * scales[i / 16];
        const uint16_t wb = mlart_f32_to_bf16(want);
        ck_assert_msg(out[i] == wb, "e4m3 0x%02x x 2^%d: device bf16 0x%04x, host 0x%04x (%g)", b,
                      ks[i / 256], out[i], wb, (double)want);
        checked++;
    }
    printf("fp8 dequant: %d values (254 e4m3 codes x %d scales) exact on the device\n", checked, nk);
    free(pieces);
    free(scales);
    free(out);
}
END_TEST

/* The KV write's hardware f32 -> e4m3 conversion against the host's
 * (mlart_f32_to_e4m3): every float whose low 16 bits are zero (every bf16
 * value, so every scaled value the encoder converts but float
 * subnormals), every float subnormal, and 2^22 random floats; both
 * signs.  NaN inputs are left out (unspecified record bytes). */
START_TEST(test_e4m3_exhaustive)
{
    const size_t n_hi = 1u << 16, n_sub = 1u << 24, n_rand = 1u << 22;
    const size_t n = n_hi + n_sub + n_rand;
    float *in = malloc(n * sizeof(float));
    uint8_t *out = malloc(n);
    uint64_t rng = g_seed ^ 0xE4E3ull;
    size_t k = 0, checked = 0;
    ck_assert(in && out);
    for (uint32_t i = 0; i < n_hi; i++, k++) {
        const uint32_t u = i << 16;
        memcpy(&in[k], &u, 4);
    }
    for (uint32_t i = 0; i < n_sub; i++, k++) { /* exponent 0, both signs */
        const uint32_t u = (i & 0x7fffffu) | ((i >> 23) << 31);
        memcpy(&in[k], &u, 4);
    }
    for (size_t i = 0; i < n_rand; i++, k++) {
        const uint32_t u = (uint32_t)gpu_rand(&rng);
        memcpy(&in[k], &u, 4);
    }
    ck_assert_int_eq(fp8_probe_quant(in, n, out), 0);
    size_t bad = n;
    for (size_t i = 0; i < n; i++) {
        if (isnan(in[i]))
            continue;
        checked++;
        if (out[i] != mlart_f32_to_e4m3(in[i]) && bad == n)
            bad = i;
    }
    ck_assert_msg(bad == n, "f32 %a (0x%08x): device e4m3 0x%02x, host 0x%02x", (double)in[bad],
                  bad < n ? *(const uint32_t *)&in[bad] : 0u, bad < n ? out[bad] : 0,
                  bad < n ? mlart_f32_to_e4m3(in[bad]) : 0);
    printf("e4m3 quantisation: %zu non-NaN floats (every bf16 value, every subnormal, 2^22 "
           "random) equal on the device and the host\n", checked);
    free(in);
    free(out);
}
END_TEST

/* The op launches with programmatic dependent launch: after a kernel that
 * lets dependents start at once and writes the rows and the slots 200 us
 * late (tests/gpu/pdl_probe.h), it must still write the new rows, launched
 * eagerly and from a captured graph.  The control shows that a dependent
 * that does not wait does see the old bytes on this device. */
START_TEST(test_after_late_writer)
{
    uint64_t rng;
    const mlart_geometry g = loop_geom(_i, 7, &rng);
    const mlart_kv_format fmt = g.kv_format;
    const int64_t N = 64, num_slots = 256;
    const size_t rb = mlart_kv_bytes_per_token(&g), cache_bytes = rb * (size_t)num_slots;
    const size_t lat_b = (size_t)N * 576 * 2, slot_b = (size_t)N * 4;
    uint16_t *lat_old = malloc(lat_b), *lat_new = malloc(lat_b);
    int32_t *slots_old = malloc(slot_b), *slots_new = malloc(slot_b);
    uint8_t *cache0 = malloc(cache_bytes), *want = malloc(cache_bytes), *back = malloc(cache_bytes);
    void *dcache, *dlat, *dlat_new, *dslots, *dslots_new;
    cudaStream_t st;
    ck_assert(lat_old && lat_new && slots_old && slots_new && cache0 && want && back);
    for (int64_t i = 0; i < N * 576; i++) {
        lat_old[i] = mlart_f32_to_bf16(attn_uniform(&rng));
        lat_new[i] = mlart_f32_to_bf16(8.0f * attn_uniform(&rng));
    }
    for (int64_t n = 0; n < N; n++) { /* distinct slots, old and new apart */
        slots_old[n] = (int32_t)(2 * n);
        slots_new[n] = (int32_t)(2 * n + 1);
    }
    for (size_t i = 0; i < cache_bytes; i++)
        cache0[i] = (uint8_t)gpu_rand(&rng);
    memcpy(want, cache0, cache_bytes);
    {
        mlart_tensor hc = attn_t(want, MLART_DTYPE_U8, -1, 2, num_slots, (int64_t)rb, 0);
        mlart_tensor hl = attn_t(lat_new, MLART_DTYPE_BF16, -1, 2, N, 576, 0);
        mlart_tensor hs = attn_t(slots_new, MLART_DTYPE_I32, -1, 1, N, 0, 0);
        ck_assert_msg(mlart_kv_write_cpu(&g, &hc, &hl, &hs) == 0, "cpu: %s", mlart_last_error());
    }
    GPU_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    ck_assert_msg(pdl_control(st, 1) == 1, "control: a dependent that does not wait saw only the new bytes; "
                                           "this device did not start it early, so the test could not fail");
    GPU_CUDA(cudaMalloc(&dcache, cache_bytes));
    GPU_CUDA(cudaMalloc(&dlat, lat_b));
    GPU_CUDA(cudaMalloc(&dlat_new, lat_b));
    GPU_CUDA(cudaMalloc(&dslots, slot_b));
    GPU_CUDA(cudaMalloc(&dslots_new, slot_b));
    GPU_CUDA(cudaMemcpy(dlat_new, lat_new, lat_b, cudaMemcpyHostToDevice));
    GPU_CUDA(cudaMemcpy(dslots_new, slots_new, slot_b, cudaMemcpyHostToDevice));
    mlart_tensor dc = attn_t(dcache, MLART_DTYPE_U8, 0, 2, num_slots, (int64_t)rb, 0);
    mlart_tensor dl = attn_t(dlat, MLART_DTYPE_BF16, 0, 2, N, 576, 0);
    mlart_tensor ds = attn_t(dslots, MLART_DTYPE_I32, 0, 1, N, 0, 0);
    for (int graph = 0; graph < 2; graph++) {
        GPU_CUDA(cudaMemcpy(dcache, cache0, cache_bytes, cudaMemcpyHostToDevice));
        GPU_CUDA(cudaMemcpy(dlat, lat_old, lat_b, cudaMemcpyHostToDevice));
        GPU_CUDA(cudaMemcpy(dslots, slots_old, slot_b, cudaMemcpyHostToDevice));
        GPU_CUDA(cudaDeviceSynchronize()); /* the copies' DMA done before st's work */
        if (graph)
            GPU_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        /* the rows and the slots both arrive late: the slots in a second writer */
        GPU_CUDA((cudaError_t)pdl_late_copy(dslots, dslots_new, slot_b, 100, st));
        GPU_CUDA((cudaError_t)pdl_late_copy(dlat, dlat_new, lat_b, 200, st));
        ck_assert_msg(mlart_kv_write_cuda(&g, &dc, &dl, &ds, st) == 0, "cuda: %s", mlart_last_error());
        finish(st, graph);
        GPU_CUDA(cudaMemcpy(back, dcache, cache_bytes, cudaMemcpyDeviceToHost));
        const size_t i = first_diff(want, back, cache_bytes);
        ck_assert_msg(i == cache_bytes, "%s %s: cache byte %zu (slot %zu): want 0x%02x, got 0x%02x",
                      mlart_kv_format_name(fmt), graph ? "graph" : "eager", i, i / rb, want[i], back[i]);
    }
    printf("kv_write %s after a writer 100-200 us late (PDL launch): the new rows in the new slots, eager and "
           "from a graph\n", mlart_kv_format_name(fmt));
    GPU_CUDA(cudaStreamDestroy(st));
    cudaFree(dcache);
    cudaFree(dlat);
    cudaFree(dlat_new);
    cudaFree(dslots);
    cudaFree(dslots_new);
    free(lat_old);
    free(lat_new);
    free(slots_old);
    free(slots_new);
    free(cache0);
    free(want);
    free(back);
}
END_TEST

int main(void)
{
    Suite *s;
    TCase *tc;
    if (gpu_test_begin("attn_kv_write_gpu", &g_seed))
        return 77;
    s = suite_create("attn_kv_write_gpu");
    tc = tcase_create("kv_write");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, test_random_rows, 0, 2);
    tcase_add_loop_test(tc, test_reference_records, 0, 2);
    tcase_add_test(tc, test_bad_input);
    tcase_add_test(tc, test_dequant_exact);
    tcase_add_test(tc, test_e4m3_exhaustive);
    tcase_add_loop_test(tc, test_after_late_writer, 0, 2);
    tcase_add_test(tc, test_other_widths);
    tcase_add_loop_test(tc, test_many_rows, 0, 2);
    tcase_add_loop_test(tc, test_guard_pages, 0, 2);
    suite_add_tcase(s, tc);
    return check_run(s, CK_FORK);
}
