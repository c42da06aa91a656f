/* mlart-bench suite "dcp": one rank's layer step (mlart_layer_decode: the
 * absorption, attention, V up-projection) under decode-context parallel,
 * GLM-5 at TP4/DCP4 (16 heads a rank, P 192, V 256, fp8_ds_mla, top-k
 * 2048 of 8192 cached tokens, each token its own request), against the
 * plain step in the same run:
 *   plain     the layer without DCP over the whole cache
 *   dcp1      the DCP path over an NCCL communicator of one rank: the plain
 *             step plus the path's own work (index translation, the
 *             gather's copy, the combine, NCCL's one-rank collectives);
 *             checked to give the plain step's bytes
 *   a2a4/ag4  rank 0 of a group of 4 with each collective replaced by
 *             device copies of this rank's own blocks, one an array (the peers' blocks are
 *             left as they are: the values are not a real group's): the
 *             rank's own work, 64 heads over its quarter of each top-k
 *             list, with the a2a or ag_rs combine, and about the least any
 *             exchange costs, one node an array; the exchange itself
 *             (NCCL's latency, the bytes over NVLink) needs one GPU a rank
 *             and is not in these columns, so they bound a rank's step from
 *             below
 * Each input set has requests of its own (block tables into one cache) and
 * weights of its own, so a column keeps one layer a set (as a model has one
 * a layer: W_UK and W_UV, 7.3 MB, do not stay in L2 from step to step); the
 * sets rotate as in every suite.  A column is NAN where it could not run
 * (no libnccl.so.2 for dcp1). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"
#include "mlart/comm.h"
#include "ops/ops.h"
#include "runtime/comm_impl.h"

namespace {

const int kH = 16, kP = 192, kR = 64, kL = 512, kV = 256, kTopk = 2048, kPage = 64,
          kCtxTokens = 8192, kD = 4;
const int kPages = kCtxTokens / kPage;             /* a request's pages */
const int kPagesL = kCtxTokens / kD / kPage;       /* rank 0's shard of them (interleave 1) */

/* ---- the loopback group: a collective copies this rank's own blocks -------- */

int lb_copy(void *dst, const void *src, size_t n, void *stream)
{
    if (cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, (cudaStream_t)stream) != cudaSuccess) {
        fprintf(stderr, "mlart-bench dcp: loopback copy failed\n");
        return -1;
    }
    return 0;
}

int lb_all_gather(mlart_comm *c, const void *send, void *recv, size_t bytes, void *stream)
{
    return lb_copy((char *)recv + (size_t)c->rank * bytes, send, bytes, stream);
}

int lb_all_to_all(mlart_comm *c, int n, const void *const *send, void *const *recv,
                  const size_t *bytes, void *stream)
{
    for (int i = 0; i < n; i++)
        if (lb_copy((char *)recv[i] + (size_t)c->rank * bytes[i],
                    (const char *)send[i] + (size_t)c->rank * bytes[i], bytes[i], stream))
            return -1;
    return 0;
}

int lb_reduce_scatter(mlart_comm *c, const float *send, float *recv, size_t n, void *stream)
{
    return lb_copy(recv, send + (size_t)c->rank * n, n * sizeof(float), stream);
}

void lb_destroy(mlart_comm *c)
{
    free(c);
}

const mlart_comm_ops lb_ops = {"loopback", lb_all_gather, lb_all_to_all, lb_reduce_scatter,
                               lb_destroy};

mlart_comm *loopback(int size)
{
    mlart_comm *c = (mlart_comm *)calloc(1, sizeof *c);
    if (c) {
        c->ops = &lb_ops;
        c->rank = 0;
        c->size = size;
        c->device = 0;
        c->graph_safe = 1;
    }
    return c;
}

/* ---- inputs ---------------------------------------------------------------- */

struct DSet {
    void *q, *idx, *req, *lens, *bt, *bt_l, *o, *lse;
    void *wuk, *wuv; /* this set's weights, [H,P,L] and [H,L,V] */
};

const size_t kWukBytes = (size_t)kH * kP * kL * 2, kWuvBytes = (size_t)kH * kL * kV * 2;

struct DCtx {
    int T, nsets;
    int shard; /* the step reads bt_l [T, kPagesL] (the DCP-of-4 rows) */
    mlart_layer **ly; /* one a set, on that set's weights */
    DSet *sets;
};

mlart_tensor dv(void *p, mlart_dtype dt, int n, int64_t a, int64_t b, int64_t c)
{
    int64_t shape[3] = {a, b, c};
    return mlart_tensor_dense(p, dt, 0, n, shape);
}

mlart_step_io dcp_io(const DCtx &c, int set)
{
    const DSet &s = c.sets[set];
    mlart_step_io io;
    memset(&io, 0, sizeof io);
    io.T = io.B = c.T;
    io.q = dv(s.q, MLART_DTYPE_BF16, 3, c.T, kH, kP + kR);
    io.idx = dv(s.idx, MLART_DTYPE_I32, 2, c.T, kTopk, 0);
    io.req_of_token = dv(s.req, MLART_DTYPE_I32, 1, c.T, 0, 0);
    io.seq_lens = dv(s.lens, MLART_DTYPE_I32, 1, c.T, 0, 0);
    io.block_table = c.shard ? dv(s.bt_l, MLART_DTYPE_I32, 2, c.T, kPagesL, 0)
                             : dv(s.bt, MLART_DTYPE_I32, 2, c.T, kPages, 0);
    io.o = dv(s.o, MLART_DTYPE_BF16, 2, c.T, (int64_t)kH * kV, 0);
    io.lse = dv(s.lse, MLART_DTYPE_F32, 2, kH, c.T, 0);
    return io;
}

int dcp_enqueue(void *ctx, int set, cudaStream_t stream)
{
    DCtx *c = (DCtx *)ctx;
    mlart_step_io io = dcp_io(*c, set);
    if (mlart_layer_decode(c->ly[set], &io, stream)) {
        fprintf(stderr, "mlart-bench dcp: %s\n", mlart_last_error());
        return -1;
    }
    return 0;
}

/* Every row of the cache written by the layer's own cache write, from
 * uniform bf16 rows, in chunks. */
int fill_cache(mlart_layer *ly, int64_t rows)
{
    const int64_t chunk = 65536, W = kL + kR;
    void *lat = NULL, *slots = NULL;
    int32_t *h = (int32_t *)malloc(sizeof(int32_t) * chunk);
    int rc = -1;
    if (!h || cudaMalloc(&lat, (size_t)(chunk * W) * 2) != cudaSuccess ||
        cudaMalloc(&slots, sizeof(int32_t) * chunk) != cudaSuccess)
        goto done;
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
        const int64_t n = rows - r0 < chunk ? rows - r0 : chunk;
        for (int64_t i = 0; i < n; i++)
            h[i] = (int32_t)(r0 + i);
        if (mlart_bench_fill_bf16(lat, (size_t)(n * W), 0xDC9ull + (uint64_t)r0, 0) ||
            cudaMemcpy(slots, h, sizeof(int32_t) * n, cudaMemcpyHostToDevice) != cudaSuccess)
            goto done;
        mlart_tensor l = dv(lat, MLART_DTYPE_BF16, 2, n, W, 0), s = dv(slots, MLART_DTYPE_I32, 1, n, 0, 0);
        if (mlart_layer_write_kv(ly, &l, &s, 0)) {
            fprintf(stderr, "mlart-bench dcp: cache write: %s\n", mlart_last_error());
            goto done;
        }
    }
    rc = cudaDeviceSynchronize() == cudaSuccess ? 0 : -1;
done:
    free(h);
    cudaFree(lat);
    cudaFree(slots);
    return rc;
}

int alloc_sets(DCtx &c, uint64_t seed)
{
    const int T = c.T;
    int32_t *h_idx = (int32_t *)malloc(sizeof(int32_t) * (size_t)T * kTopk),
            *h_req = (int32_t *)malloc(sizeof(int32_t) * (size_t)T),
            *h_lens = (int32_t *)malloc(sizeof(int32_t) * (size_t)T),
            *h_bt = (int32_t *)malloc(sizeof(int32_t) * (size_t)T * kPages),
            *h_btl = (int32_t *)malloc(sizeof(int32_t) * (size_t)T * kPagesL),
            *pool = (int32_t *)malloc(sizeof(int32_t) * kCtxTokens);
    int rc = -1;
    if (!h_idx || !h_req || !h_lens || !h_bt || !h_btl || !pool)
        goto done;
    for (int s = 0; s < c.nsets; s++) {
        DSet &d = c.sets[s];
        const size_t qb = (size_t)T * kH * (kP + kR) * 2;
        if (cudaMalloc(&d.q, qb) != cudaSuccess ||
            cudaMalloc(&d.idx, sizeof(int32_t) * (size_t)T * kTopk) != cudaSuccess ||
            cudaMalloc(&d.req, sizeof(int32_t) * (size_t)T) != cudaSuccess ||
            cudaMalloc(&d.lens, sizeof(int32_t) * (size_t)T) != cudaSuccess ||
            cudaMalloc(&d.bt, sizeof(int32_t) * (size_t)T * kPages) != cudaSuccess ||
            cudaMalloc(&d.bt_l, sizeof(int32_t) * (size_t)T * kPagesL) != cudaSuccess ||
            cudaMalloc(&d.o, (size_t)T * kH * kV * 2) != cudaSuccess ||
            cudaMalloc(&d.lse, sizeof(float) * (size_t)kH * T) != cudaSuccess ||
            cudaMalloc(&d.wuk, kWukBytes) != cudaSuccess || cudaMalloc(&d.wuv, kWuvBytes) != cudaSuccess ||
            mlart_bench_fill_bf16(d.q, qb / 2, seed + (uint64_t)s, 0) ||
            mlart_bench_fill_bf16(d.wuk, kWukBytes / 2, 0xDC1ull + 2 * (uint64_t)s, 0) ||
            mlart_bench_fill_bf16(d.wuv, kWuvBytes / 2, 0xDC2ull + 2 * (uint64_t)s, 0))
            goto done;
        for (int t = 0; t < T; t++) {
            const int64_t r = (int64_t)s * T + t; /* this set's requests */
            h_req[t] = t;
            h_lens[t] = kCtxTokens;
            for (int j = 0; j < kPages; j++)
                h_bt[(size_t)t * kPages + j] = (int32_t)(r * kPages + j);
            for (int j = 0; j < kPagesL; j++) /* the shard: the first quarter of its pages */
                h_btl[(size_t)t * kPagesL + j] = (int32_t)(r * kPages + j);
            for (int i = 0; i < kCtxTokens; i++)
                pool[i] = i;
            for (int k = 0; k < kTopk; k++) { /* distinct positions */
                const int j = k + (int)(mlart_bench_rand(&seed) % (uint64_t)(kCtxTokens - k));
                const int32_t x = pool[k];
                pool[k] = pool[j], pool[j] = x;
                h_idx[(size_t)t * kTopk + k] = pool[k];
            }
        }
        if (cudaMemcpy(d.idx, h_idx, sizeof(int32_t) * (size_t)T * kTopk, cudaMemcpyHostToDevice) ||
            cudaMemcpy(d.req, h_req, sizeof(int32_t) * (size_t)T, cudaMemcpyHostToDevice) ||
            cudaMemcpy(d.lens, h_lens, sizeof(int32_t) * (size_t)T, cudaMemcpyHostToDevice) ||
            cudaMemcpy(d.bt, h_bt, sizeof(int32_t) * (size_t)T * kPages, cudaMemcpyHostToDevice) ||
            cudaMemcpy(d.bt_l, h_btl, sizeof(int32_t) * (size_t)T * kPagesL, cudaMemcpyHostToDevice))
            goto done;
    }
    rc = 0;
done:
    free(h_idx), free(h_req), free(h_lens), free(h_bt), free(h_btl), free(pool);
    return rc;
}

void free_sets(DCtx &c)
{
    for (int s = 0; c.sets && s < c.nsets; s++) {
        DSet &d = c.sets[s];
        void *p[] = {d.q, d.idx, d.req, d.lens, d.bt, d.bt_l, d.o, d.lse, d.wuk, d.wuv};
        for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
            cudaFree(p[i]);
    }
    free(c.sets);
}

/* Set 0's output and LSE on the host, after one eager step on `ly[0]`. */
int run_once(DCtx &c, mlart_layer **ly, int shard, uint16_t *o, float *lse)
{
    DCtx one = c;
    one.ly = ly;
    one.shard = shard;
    const size_t ob = (size_t)c.T * kH * kV * 2, lb = sizeof(float) * (size_t)kH * c.T;
    if (cudaMemset(c.sets[0].o, 0xff, ob) || cudaMemset(c.sets[0].lse, 0xff, lb) ||
        dcp_enqueue(&one, 0, 0) || cudaDeviceSynchronize() ||
        cudaMemcpy(o, c.sets[0].o, ob, cudaMemcpyDeviceToHost) ||
        cudaMemcpy(lse, c.sets[0].lse, lb, cudaMemcpyDeviceToHost))
        return -1;
    return 0;
}

} // namespace

extern "C" int mlart_bench_dcp(const mlart_bench_opts *o)
{
    static const int Ts[] = {1, 2, 4, 8, 16, 32, 64};
    static const mlart_bench_col cols[] = {
        {"plain", "us", 8, 2},  {"dcp1", "us", 8, 2},   {"dcp1-plain", "us", 10, 2},
        {"a2a4", "us", 8, 2},   {"ag4", "us", 8, 2},    {"a2a4/plain", "x", 10, 2},
        {"KV/rank", "MB", 8, 2}, {"KV/rank4", "MB", 8, 2}, {"wrong", "", 6, 0},
    };
    static const mlart_bench_table tab = {
        "dcp: one rank's layer step, GLM-5 TP4/DCP4 (16 heads a rank, fp8_ds_mla, top-k 2048 of "
        "8192); a2a4/ag4 with the exchange replaced by local copies", "shape", 20, cols,
        (int)(sizeof cols / sizeof cols[0])};
    int wrong = 0, head = 0, nccl_ok = 0;
    mlart_comm *nccl1 = NULL, *lb4 = loopback(kD);
    if (!lb4)
        return -1;
    for (size_t i = 0; i < sizeof Ts / sizeof Ts[0]; i++) {
        char name[64];
        DCtx c;
        mlart_layer **ly[4] = {NULL, NULL, NULL, NULL}; /* plain, dcp1, a2a4, ag4; one a set */
        mlart_context *ctx = NULL;
        double t[4] = {NAN, NAN, NAN, NAN}, vals[9];
        void *cache = NULL;
        uint16_t *o0 = NULL, *o1 = NULL;
        float *l0 = NULL, *l1 = NULL;
        int bad = 0, rc = -1;
        int64_t rows;
        size_t bpt;
        mlart_geometry g;
        memset(&c, 0, sizeof c);
        c.T = Ts[i];
        snprintf(name, sizeof name, "dcp glm5 fp8 T%d", c.T);
        if (!mlart_bench_match(o, name))
            continue;
        if (!head++) {
            unsigned char id[MLART_NCCL_ID_BYTES];
            mlart_bench_table_head(o, &tab);
            nccl_ok = mlart_comm_nccl_unique_id(id, sizeof id) == 0 &&
                      mlart_comm_nccl_create(0, 1, o->device, id, sizeof id, 0, &nccl1) == 0;
            if (!nccl_ok)
                printf("# dcp1: no NCCL communicator (%s)\n", mlart_last_error());
        }
        memset(&g, 0, sizeof g);
        g.heads = kH, g.qk_nope = kP, g.rope = kR, g.kv_lora = kL, g.v_head = kV;
        g.topk = kTopk, g.page_size = kPage, g.kv_format = MLART_KV_FP8_DS_MLA;
        g.softmax_scale = 1.0f / sqrtf((float)(kP + kR));
        bpt = mlart_kv_bytes_per_token(&g);
        c.nsets = mlart_bench_sets(o, (size_t)c.T * kTopk * bpt + kWukBytes + kWuvBytes, 2);
        rows = (int64_t)c.nsets * c.T * kCtxTokens;
        c.sets = (DSet *)calloc((size_t)c.nsets, sizeof(DSet));
        o0 = (uint16_t *)malloc((size_t)c.T * kH * kV * 2), o1 = (uint16_t *)malloc((size_t)c.T * kH * kV * 2);
        l0 = (float *)malloc(sizeof(float) * (size_t)kH * c.T), l1 = (float *)malloc(sizeof(float) * (size_t)kH * c.T);
        for (int k = 0; k < 4; k++)
            ly[k] = (mlart_layer **)calloc((size_t)c.nsets, sizeof(mlart_layer *));
        if (!c.sets || !o0 || !o1 || !l0 || !l1 || !ly[0] || !ly[1] || !ly[2] || !ly[3] ||
            mlart_context_create(o->device, &ctx) || cudaMalloc(&cache, (size_t)rows * bpt) != cudaSuccess ||
            alloc_sets(c, 0xDC5ull + (uint64_t)c.T))
            goto fail;
        for (int k = 0; k < 4; k++)
            for (int st = 0; st < c.nsets; st++) {
                mlart_layer_desc d;
                memset(&d, 0, sizeof d);
                d.geom = g;
                d.max_tokens = c.T;
                d.max_requests = c.T;
                d.max_blocks_per_req = k >= 2 ? kPagesL : kPages;
                d.num_slots = rows;
                d.w_uk_t = dv(c.sets[st].wuk, MLART_DTYPE_BF16, 3, kH, kP, kL);
                d.w_uv = dv(c.sets[st].wuv, MLART_DTYPE_BF16, 3, kH, kL, kV);
                d.kv_cache = dv(cache, MLART_DTYPE_U8, 2, rows, (int64_t)bpt, 0);
                d.early_weights = 1; /* as the shipped GPU configs */
                d.dcp = k == 0 ? NULL : k == 1 ? nccl1 : lb4;
                d.dcp_routing = k == 3 ? MLART_DCP_AG_RS : MLART_DCP_A2A;
                if (k == 1 && !nccl_ok)
                    continue;
                if (mlart_layer_create(ctx, &d, &ly[k][st])) {
                    fprintf(stderr, "mlart-bench %s: layer %d of set %d: %s\n", name, k, st,
                            mlart_last_error());
                    goto fail;
                }
            }
        if (fill_cache(ly[0][0], rows))
            goto fail;
        for (int k = 0; k < 4; k++) {
            if (!ly[k][0])
                continue;
            c.ly = ly[k];
            c.shard = k >= 2;
            if (mlart_bench_time(o, dcp_enqueue, &c, c.nsets, &t[k]))
                goto fail;
        }
        /* dcp1 gives the plain step's bytes; the loopback steps finite values */
        if (run_once(c, ly[0], 0, o0, l0))
            goto fail;
        if (ly[1][0]) {
            if (run_once(c, ly[1], 0, o1, l1))
                goto fail;
            if (memcmp(o0, o1, (size_t)c.T * kH * kV * 2) || memcmp(l0, l1, sizeof(float) * (size_t)kH * c.T)) {
                fprintf(stderr, "mlart-bench %s: dcp1 differs from the plain step\n", name);
                bad++;
            }
        }
        for (int k = 2; k < 4; k++) {
            if (run_once(c, ly[k], 1, o1, l1))
                goto fail;
            for (int64_t e = 0; e < (int64_t)c.T * kH * kV; e++)
                if ((o1[e] & 0x7f80) == 0x7f80) { /* NaN, Inf or the poison */
                    fprintf(stderr, "mlart-bench %s: loopback %d: o[%lld] not finite\n", name, k, (long long)e);
                    bad++;
                    break;
                }
        }
        vals[0] = t[0];
        vals[1] = t[1];
        vals[2] = t[1] - t[0];
        vals[3] = t[2];
        vals[4] = t[3];
        vals[5] = t[2] / t[0];
        vals[6] = (double)c.T * kTopk * bpt / 1e6;
        vals[7] = vals[6] / kD;
        vals[8] = bad;
        mlart_bench_table_row(o, &tab, name, vals);
        wrong += bad;
        rc = 0;
    fail:
        for (int k = 0; k < 4; k++) {
            for (int st = 0; ly[k] && st < c.nsets; st++)
                mlart_layer_destroy(ly[k][st]);
            free(ly[k]);
        }
        free_sets(c);
        cudaFree(cache);
        mlart_context_destroy(ctx);
        free(o0), free(o1), free(l0), free(l1);
        if (rc) {
            wrong++;
            break;
        }
    }
    if (head)
        mlart_bench_summary(o, "dcp",
                            "dcp: plain and dcp1 are whole steps of one rank; a2a4/ag4 leave out the exchange "
                            "between ranks (NCCL latency and NVLink bytes) but one copy node an array, about "
                            "the least any exchange costs");
    mlart_comm_destroy(nccl1);
    free(lb4);
    return wrong;
}
