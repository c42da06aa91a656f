/* mlart-bench suite "kv_write": the cache write (mlart_kv_write_cuda) for
 * decode-sized and prefill-sized row counts, both formats, each path:
 *   auto   what mlart_kv_write_cuda does (the scan path up to 1024 bf16
 *          or 2048 fp8 rows, the claim path above)
 *   scan   each row scans the later rows' slots (work grows as N^2)
 *   claim  claims in the records' first words, a cooperative grid
 *   copy   cudaMemcpyAsync of the same latent rows to a scratch buffer:
 *          what moving the row bytes alone costs at this size
 * Rows name distinct slots, drawn at random from twice as many (no repeats:
 * the scan path's longest case, every row scans to the end).  Unique
 * bytes: latent rows read + slots read + records written.  Each path's
 * records are checked against the CPU twin (mlart_kv_write_cpu) byte for
 * byte on set 0. */
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"
#include "ops/kv_write_cuda.h"
#include "ops/ops.h"

namespace {

struct KvSet {
    void *lat, *slots, *cache, *scratch;
};

struct KvCtx {
    mlart_geometry g;
    int64_t N, num_slots;
    size_t rb; /* record bytes */
    int path;  /* MLART_KVW_*, or -1: the copy */
    KvSet *sets;
};

mlart_tensor kv_view(void *p, mlart_dtype dt, int ndim, int64_t d0, int64_t d1)
{
    int64_t shape[2] = {d0, d1};
    return mlart_tensor_dense(p, dt, 0, ndim, shape);
}

int kv_enqueue(void *vctx, int set, cudaStream_t stream)
{
    KvCtx *c = (KvCtx *)vctx;
    KvSet *s = &c->sets[set];
    const int64_t W = c->g.kv_lora + c->g.rope;
    if (c->path < 0)
        return cudaMemcpyAsync(s->scratch, s->lat, (size_t)(c->N * W) * 2, cudaMemcpyDeviceToDevice,
                               stream) == cudaSuccess
                   ? 0
                   : -1;
    mlart_tensor cache = kv_view(s->cache, MLART_DTYPE_U8, 2, c->num_slots, (int64_t)c->rb);
    mlart_tensor lat = kv_view(s->lat, MLART_DTYPE_BF16, 2, c->N, W);
    mlart_tensor sl = kv_view(s->slots, MLART_DTYPE_I32, 1, c->N, 0);
    if (mlart_kv_write_cuda_path(&c->g, &cache, &lat, &sl, stream, c->path)) {
        fprintf(stderr, "mlart-bench kv_write: %s\n", mlart_last_error());
        return -1;
    }
    return 0;
}

/* Set 0 on `path` from a zeroed cache, against the CPU twin: records that
 * differ (0 = all equal), or -1 if it could not run. */
int kv_check(KvCtx *c, int path, const int32_t *h_slots, const uint8_t *want)
{
    const size_t bytes = c->rb * (size_t)c->num_slots;
    uint8_t *back = (uint8_t *)malloc(bytes);
    int bad = 0;
    KvCtx one = *c;
    if (!back)
        return -1;
    one.path = path;
    if (cudaMemset(c->sets[0].cache, 0, bytes) != cudaSuccess || kv_enqueue(&one, 0, 0) ||
        cudaDeviceSynchronize() != cudaSuccess ||
        cudaMemcpy(back, c->sets[0].cache, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
        free(back);
        return -1;
    }
    for (int64_t n = 0; n < c->N; n++) {
        const size_t off = (size_t)h_slots[n] * c->rb;
        if (memcmp(back + off, want + off, c->rb))
            bad++;
    }
    free(back);
    return bad;
}

} /* namespace */

extern "C" int mlart_bench_kvw(const mlart_bench_opts *o)
{
    static const int64_t Ns[] = {1, 4, 16, 64, 256, 512, 1024, 2048, 4096, 16384, 65536};
    static const mlart_bench_col cols[] = {
        {"auto", "us", 9, 2},  {"GB/s", "GB/s", 8, 0}, {"%copy", "%", 6, 1}, {"scan", "us", 10, 2},
        {"claim", "us", 9, 2}, {"copy", "us", 8, 2},   {"x_scan", "x", 7, 2}, {"wrong", "", 6, 0},
    };
    static const mlart_bench_table tab = {"kv_write: cache write, distinct slots", "rows", 26, cols,
                                          (int)(sizeof cols / sizeof cols[0])};
    int wrong = 0, head = 0;
    for (int f = 0; f < 2; f++)
        for (size_t i = 0; i < sizeof Ns / sizeof Ns[0]; i++) {
            char name[64];
            KvCtx c;
            memset(&c, 0, sizeof c);
            c.g.heads = 16;
            c.g.qk_nope = 128;
            c.g.rope = 64;
            c.g.kv_lora = 512;
            c.g.v_head = 128;
            c.g.topk = 2048;
            c.g.page_size = 64;
            c.g.softmax_scale = 0.0417f;
            c.g.kv_format = f ? MLART_KV_FP8_DS_MLA : MLART_KV_BF16;
            c.N = Ns[i];
            c.num_slots = 2 * c.N < 4096 ? 4096 : 2 * c.N;
            c.rb = mlart_kv_bytes_per_token(&c.g);
            snprintf(name, sizeof name, "kv_write %s N%lld", mlart_kv_format_name(c.g.kv_format),
                     (long long)c.N);
            if (!mlart_bench_match(o, name))
                continue;
            if (!head++)
                mlart_bench_table_head(o, &tab);
            const int64_t W = c.g.kv_lora + c.g.rope;
            const size_t lat_b = (size_t)(c.N * W) * 2, slot_b = (size_t)c.N * 4,
                         cache_b = c.rb * (size_t)c.num_slots;
            const int nsets = mlart_bench_sets(o, lat_b + slot_b + c.rb * (size_t)c.N, 2);
            uint16_t *h_lat = (uint16_t *)malloc(lat_b);
            int32_t *h_slots = (int32_t *)malloc(slot_b), *perm = NULL;
            uint8_t *want = (uint8_t *)calloc(1, cache_b);
            double vals[8], t[4] = {NAN, NAN, NAN, NAN};
            int bad = 0, rc = -1;
            uint64_t rng = 0x4B5657ull + (uint64_t)c.N * 31 + (uint64_t)f;
            c.sets = (KvSet *)calloc((size_t)nsets, sizeof(KvSet));
            perm = (int32_t *)malloc((size_t)c.num_slots * 4);
            if (!h_lat || !h_slots || !want || !c.sets || !perm)
                goto done;
            for (int s = 0; s < nsets; s++) {
                KvSet *ks = &c.sets[s];
                MLART_BENCH_CHECK("mlart-bench kv_write", cudaMalloc(&ks->lat, lat_b));
                MLART_BENCH_CHECK("mlart-bench kv_write", cudaMalloc(&ks->slots, slot_b));
                MLART_BENCH_CHECK("mlart-bench kv_write", cudaMalloc(&ks->cache, cache_b));
                MLART_BENCH_CHECK("mlart-bench kv_write", cudaMalloc(&ks->scratch, lat_b));
                if (mlart_bench_fill_bf16(ks->lat, (size_t)(c.N * W), 0x4B56ull + (uint64_t)s, 0))
                    goto fail;
                /* distinct slots: the first N of a random permutation */
                for (int64_t k = 0; k < c.num_slots; k++)
                    perm[k] = (int32_t)k;
                for (int64_t k = 0; k < c.N; k++) {
                    const int64_t j = k + (int64_t)(mlart_bench_rand(&rng) % (uint64_t)(c.num_slots - k));
                    const int32_t x = perm[k];
                    perm[k] = perm[j];
                    perm[j] = x;
                }
                if (s == 0)
                    memcpy(h_slots, perm, slot_b);
                MLART_BENCH_CHECK("mlart-bench kv_write",
                                  cudaMemcpy(ks->slots, perm, slot_b, cudaMemcpyHostToDevice));
            }
            /* the CPU twin's records of set 0 */
            MLART_BENCH_CHECK("mlart-bench kv_write", cudaDeviceSynchronize());
            MLART_BENCH_CHECK("mlart-bench kv_write",
                              cudaMemcpy(h_lat, c.sets[0].lat, lat_b, cudaMemcpyDeviceToHost));
            {
                int64_t cs[2] = {c.num_slots, (int64_t)c.rb}, ls[2] = {c.N, W}, ss[1] = {c.N};
                mlart_tensor hc = mlart_tensor_dense(want, MLART_DTYPE_U8, -1, 2, cs);
                mlart_tensor hl = mlart_tensor_dense(h_lat, MLART_DTYPE_BF16, -1, 2, ls);
                mlart_tensor hs = mlart_tensor_dense(h_slots, MLART_DTYPE_I32, -1, 1, ss);
                if (mlart_kv_write_cpu(&c.g, &hc, &hl, &hs)) {
                    fprintf(stderr, "mlart-bench kv_write: cpu: %s\n", mlart_last_error());
                    goto fail;
                }
            }
            {
                static const int paths[4] = {MLART_KVW_AUTO, MLART_KVW_SCAN, MLART_KVW_CLAIM, -1};
                for (int k = 0; k < 4; k++) {
                    c.path = paths[k];
                    if (mlart_bench_time(o, kv_enqueue, &c, nsets, &t[k]))
                        goto fail;
                    if (k < 3) {
                        const int b = kv_check(&c, paths[k], h_slots, want);
                        if (b < 0)
                            goto fail;
                        if (b)
                            fprintf(stderr, "mlart-bench %s: path %d: %d records differ from the CPU twin\n",
                                    name, paths[k], b);
                        bad += b;
                    }
                }
            }
            {
                const double bytes = (double)(lat_b + slot_b + c.rb * (size_t)c.N);
                vals[0] = t[0];
                vals[1] = bytes / (t[0] * 1e3);
                vals[2] = 100.0 * vals[1] / o->copy_gbs;
                vals[3] = t[1];
                vals[4] = t[2];
                vals[5] = t[3];
                vals[6] = t[1] / t[0];
                vals[7] = bad;
                mlart_bench_table_row(o, &tab, name, vals);
            }
            rc = 0;
        fail:
        done:
            if (c.sets)
                for (int s = 0; s < nsets; s++) {
                    cudaFree(c.sets[s].lat);
                    cudaFree(c.sets[s].slots);
                    cudaFree(c.sets[s].cache);
                    cudaFree(c.sets[s].scratch);
                }
            free(c.sets);
            free(perm);
            free(h_lat);
            free(h_slots);
            free(want);
            if (rc < 0) {
                fprintf(stderr, "mlart-bench %s: could not run\n", name);
                wrong++;
            }
            wrong += bad;
        }
    if (head)
        mlart_bench_summary(o, "kv_write",
                            "kv_write: auto = the scan path up to 1024 bf16 / 2048 fp8 rows, the claim path above; "
                            "x_scan = scan / auto");
    return wrong;
}
