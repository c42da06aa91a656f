/* A layer: one MLA attention layer bound to a backend, its weights and its KV
 * cache.  This is where the runtime enforces the backend's layout contract
 * (include/mlart/backend.h): weights made dense once at create, the query operand
 * materialised or passed as a strided view, buffers for q_mqa / attention
 * output / LSE / workspace preallocated for the largest step, and every view
 * of a step validated before the backend sees it. */
#include "runtime/comm_impl.h"
#include "runtime/layer_info.h"
#include "runtime/registry.h"
#include "runtime/status.h"

#include "ops/ops.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef MLART_WITH_CUDA
#include <cuda_runtime_api.h>
#define CUDA_TRY_(stmt)                                                                     \
    do {                                                                                    \
        cudaError_t e_ = (stmt);                                                            \
        if (e_ != cudaSuccess)                                                              \
            return mlart_set_error(MLART_ECUDA, "%s: %s (%s:%d)", #stmt,                    \
                                   cudaGetErrorString(e_), __FILE__, __LINE__);             \
    } while (0)
#endif

typedef struct dcp_buf {
    void *p;
    size_t bytes;
} dcp_buf;

struct mlart_layer {
    int device;
    mlart_geometry geom;
    const mlart_backend_vtable *vt;
    mlart_layout_contract contract;
    void *state;
    int32_t max_tokens, max_requests, max_blocks;
    int64_t num_slots;
    int validate_indices;
    int early_weights; /* CUDA: the query absorption launches with PDL (mlart_layer_desc) */
    mlart_tensor w_uk_t, w_uv; /* what the backend sees */
    void *w_uk_t_own, *w_uv_own; /* dense copies, NULL when the caller's were kept */
    mlart_tensor kv_cache;
    void *q_nope_buf; /* CONTIGUOUS: dense [H,max_T,P] */
    size_t q_nope_bytes;
    void *q_mqa_buf; /* [max_T,H,L+R] */
    size_t q_mqa_bytes;
    void *attn_buf; /* [H,max_T,L] or [max_T,H,L] */
    size_t attn_bytes;
    void *lse_buf; /* [H,max_T] f32 when the caller wants none or gives a strided one */
    size_t lse_bytes;
    void *workspace;
    size_t workspace_bytes;
    int32_t *h_meta; /* CUDA + validate_indices: host copies of idx, req_of_token, seq_lens, bt
                        (and under DCP the local idx and lengths) */
    /* decode-context parallel (mlart_layer_desc.dcp, a group of D >= 1 ranks), else dcp == NULL */
    mlart_comm *dcp;
    int32_t dcp_size, dcp_rank, dcp_interleave;
    mlart_dcp_routing dcp_routing;
    void *dstate;       /* the backend created and planned for D*H heads: attend only */
    dcp_buf dq_all;     /* [D][T,H,L+R] bf16: every rank's absorbed queries */
    dcp_buf dq_mqa;     /* [T,D*H,L+R] bf16: the same, token-major, for attend */
    dcp_buf didx;       /* [T,topk] i32: local positions, -1 elsewhere */
    dcp_buf dlens;      /* [B] i32: local lengths */
    dcp_buf dattn;      /* [D*H,T,L] bf16: partial outputs of the group's heads */
    dcp_buf dlse;       /* [D*H,T] f32 */
    dcp_buf drecv;      /* a2a: [D][H,T,L] bf16 received; ag_rs: [D*H,T,L] f32 scaled */
    dcp_buf drecv_lse;  /* a2a: [D][H,T] f32; ag_rs: [D][D*H,T] f32 every rank's LSEs */
    dcp_buf dsum;       /* ag_rs: [H,T,L] f32, the reduce-scatter's result */
    dcp_buf dwork;      /* the D*H-head backend's workspace */
    dcp_buf dagree;     /* validate_indices: [1 + D] step records (dcp_check_agree) */
    uint64_t *h_agree;  /* [D] step records, on the host */
    /* CUDA: the branch the index translation runs on, forked from the
     * caller's stream at the step's start and joined right after the
     * all-gather (dcp_fork_translate); cudaStream_t and cudaEvent_t, NULL
     * on the host */
    void *dside, *dfork, *djoin;
};

/* ---- memory on the layer's device --------------------------------------- */

static int mem_alloc(int device, size_t bytes, void **out)
{
    void *p = NULL;
    if (bytes == 0) {
        *out = NULL;
        return 0;
    }
    if (device < 0) {
        p = calloc(1, bytes);
        if (!p)
            return mlart_set_error(MLART_ENOMEM, "out of host memory allocating %zu bytes",
                                   bytes);
        *out = p;
        return 0;
    }
#ifdef MLART_WITH_CUDA
    {
        cudaError_t e = cudaMalloc(&p, bytes);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            return mlart_set_error(MLART_ENOMEM, "cudaMalloc(%zu bytes) on device %d: %s",
                                   bytes, device, cudaGetErrorString(e));
        }
        e = cudaMemset(p, 0, bytes);
        if (e != cudaSuccess) {
            cudaFree(p);
            return mlart_set_error(MLART_ECUDA, "cudaMemset: %s", cudaGetErrorString(e));
        }
        *out = p;
        return 0;
    }
#else
    return mlart_set_error(MLART_ENODEV, "device %d: this build has no CUDA", device);
#endif
}

static void mem_free(int device, void *p)
{
    if (!p)
        return;
    if (device < 0) {
        free(p);
        return;
    }
#ifdef MLART_WITH_CUDA
    cudaFree(p);
#endif
}

/* ---- view checks -------------------------------------------------------- */

static void shape_text(const int64_t *shape, int ndim, char *buf, size_t n)
{
    size_t k = (size_t)snprintf(buf, n, "[");
    for (int d = 0; d < ndim && k < n; d++)
        k += (size_t)snprintf(buf + k, n - k, d ? ", %" PRId64 : "%" PRId64, shape[d]);
    if (k < n)
        snprintf(buf + k, n - k, "]");
}

enum { INNER_ANY = 0, INNER_UNIT = 1, DENSE = 2 };

/* Check one caller view: dtype, shape, device, inner stride or density, span
 * inside its extent, and `tail` readable bytes past the span. */
static int check_view(const mlart_tensor *t, const char *name, mlart_dtype dtype, int ndim,
                      const int64_t *shape, int device, int layout, size_t tail)
{
    char got[96], want[96];
    size_t lo, hi;
    int same = t->ndim == ndim;
    for (int d = 0; same && d < ndim; d++)
        same = t->shape[d] == shape[d];
    if (!same) {
        shape_text(t->shape, t->ndim > 0 && t->ndim <= MLART_MAX_DIMS ? t->ndim : 0, got,
                   sizeof got);
        shape_text(shape, ndim, want, sizeof want);
        return mlart_set_error(MLART_ESHAPE, "%s: shape %s, want %s", name, got, want);
    }
    if (t->dtype != dtype)
        return mlart_set_error(MLART_EDTYPE, "%s: dtype %s, want %s", name,
                               mlart_dtype_name(t->dtype), mlart_dtype_name(dtype));
    if (t->device != device)
        return mlart_set_error(MLART_EINVAL, "%s: lives on device %d, the layer on device %d "
                               "(-1 = host)", name, t->device, device);
    if (layout == INNER_UNIT && t->shape[ndim - 1] > 1 && t->stride[ndim - 1] != 1)
        return mlart_set_error(MLART_ELAYOUT, "%s: inner stride %" PRId64 ", want 1", name,
                               t->stride[ndim - 1]);
    if (layout == DENSE && !mlart_tensor_is_dense(t))
        return mlart_set_error(MLART_ELAYOUT, "%s: must be dense row-major", name);
    MLART_CHECK(mlart_tensor_check(t, name));
    MLART_CHECK(mlart_tensor_span(t, &lo, &hi));
    if (tail && hi > lo && t->extent - hi < tail)
        return mlart_set_error(MLART_ELAYOUT,
                               "%s: the backend needs %zu readable bytes past the span [%zu, %zu), "
                               "the extent %zu leaves %zu",
                               name, tail, lo, hi, t->extent, t->extent - hi);
    return 0;
}

/* An output view [rows, cols] with inner stride 1 whose rows would share
 * elements (row stride under the row length) is refused before the step
 * writes anything: the failure would otherwise come from the op that writes
 * it last, after earlier ones wrote other outputs. */
static int check_rows_apart(const mlart_tensor *t, const char *name)
{
    if (t->shape[0] > 1 && t->shape[1] > 0 && t->stride[0] < t->shape[1])
        return mlart_set_error(MLART_ELAYOUT,
                               "%s: rows overlap (row stride %" PRId64 " < %" PRId64 " elements a row)",
                               name, t->stride[0], t->shape[1]);
    return 0;
}

/* rc of a backend call made when the thread's error serial was `serial`: a
 * failure the backend returned without recording a detail (through
 * init->error) gets one naming the backend and the call, instead of
 * leaving the thread's previous message to explain it. */
static int backend_rc(const mlart_layer *ly, const char *call, unsigned serial, int rc)
{
    if (rc < 0 && mlart_error_serial() == serial)
        return mlart_set_error(rc, "backend '%s': %s returned %s without a detail", ly->vt->name,
                               call, mlart_status_name(rc));
    return rc;
}

/* Views a and b must not share bytes (two outputs, or an output and an
 * input the step reads); `what` ends the message that names both. */
static int check_apart(const mlart_tensor *a, const char *an, const mlart_tensor *b, const char *bn,
                       const char *what)
{
    int rc = mlart_tensor_overlap(a, b);
    if (rc < 0)
        return rc;
    if (rc)
        return mlart_set_error(MLART_ELAYOUT, "%s and %s: %s", an, bn, what);
    return 0;
}

/* The layer sizes its buffers from these dimensions with plain products (a
 * weight H*P*L, a step's T*H*(L+R), a DCP rank's D*D*H*T, ...): refuse
 * dimensions whose largest products, at 8 bytes an element, would not fit
 * an int64, so that none of them wraps (a broadcast weight view passes the
 * span checks at any size). */
static int check_sizes_fit(const mlart_geometry *g, int64_t T, int64_t D)
{
    const int64_t H = g->heads, P = g->qk_nope, R = g->rope, L = g->kv_lora, V = g->v_head;
    const int64_t prods[][4] = {{H, P, L, 1}, {H, L, V, 1}, {T, H, L + R, D}, {T, H, P, 1},
                                {D, D, H, T}, {T, g->topk, D, 1}};
    for (size_t i = 0; i < sizeof prods / sizeof prods[0]; i++) {
        int64_t x = 8;
        for (int k = 0; k < 4; k++)
            if (__builtin_mul_overflow(x, prods[i][k], &x))
                return mlart_set_error(MLART_ERANGE,
                                       "layer: buffers for heads %d, P %d, R %d, L %d, V %d, top-k %d, "
                                       "max_tokens %" PRId64 " and a DCP group of %" PRId64
                                       " would be larger than 2^63 bytes",
                                       (int)H, (int)P, (int)R, (int)L, (int)V, (int)g->topk, T, D);
    }
    return 0;
}

/* ---- weights ------------------------------------------------------------ */

/* Gather a bf16 3-d view (strides in elements, any order) into dense dst. */
static void gather3(uint16_t *dst, const uint16_t *src, const int64_t *shape,
                    const int64_t *stride)
{
    size_t n = 0;
    for (int64_t i = 0; i < shape[0]; i++)
        for (int64_t j = 0; j < shape[1]; j++) {
            const uint16_t *row = src + i * stride[0] + j * stride[1];
            if (stride[2] == 1) {
                memcpy(dst + n, row, (size_t)shape[2] * 2);
                n += (size_t)shape[2];
            } else {
                for (int64_t k = 0; k < shape[2]; k++)
                    dst[n++] = row[k * stride[2]];
            }
        }
}

/* Keep a compliant dense weight at its address; copy anything else once into
 * a dense buffer (with the contract's tail padding) on the layer's device. */
static int enforce_weight(mlart_layer *ly, const mlart_tensor *w, const char *name,
                          const int64_t *shape, mlart_tensor *out, void **owned)
{
    size_t tail = ly->contract.tail_pad, bytes, lo, hi;
    mlart_tensor d;
    void *buf = NULL;
    int rc;
    MLART_CHECK(check_view(w, name, MLART_DTYPE_BF16, 3, shape, ly->device, INNER_ANY, 0));
    MLART_CHECK(mlart_tensor_span(w, &lo, &hi));
    if (mlart_tensor_is_dense(w) && w->extent - hi >= tail) {
        *out = *w;
        *owned = NULL;
        mlart_log(MLART_LOG_DEBUG, "%s: dense, kept at %p", name, w->data);
        return 0;
    }
    bytes = (size_t)(shape[0] * shape[1] * shape[2]) * 2;
    MLART_CHECK(mem_alloc(ly->device, bytes + tail, &buf));
    if (ly->device < 0) {
        gather3(buf, w->data, shape, w->stride);
        rc = 0;
    } else {
#ifdef MLART_WITH_CUDA
        /* Once per layer: stage the source span through the host, where any
         * strides (also the transposed W_UV view) are a plain gather. */
        unsigned char *span = malloc(hi - lo), *dense = malloc(bytes);
        cudaError_t e = cudaSuccess;
        rc = 0;
        if (!span || !dense)
            rc = mlart_set_error(MLART_ENOMEM, "%s: out of host memory staging %zu bytes", name,
                                 hi - lo + bytes);
        if (rc == 0)
            e = cudaMemcpy(span, (const char *)w->base + lo, hi - lo, cudaMemcpyDeviceToHost);
        if (rc == 0 && e == cudaSuccess) {
            gather3((uint16_t *)dense,
                    (const uint16_t *)(span + ((const char *)w->data - (const char *)w->base - lo)),
                    shape, w->stride);
            e = cudaMemcpy(buf, dense, bytes, cudaMemcpyHostToDevice);
        }
        if (rc == 0 && e != cudaSuccess)
            rc = mlart_set_error(MLART_ECUDA, "%s: copying to a dense buffer: %s", name,
                                 cudaGetErrorString(e));
        free(span);
        free(dense);
#else
        rc = mlart_set_error(MLART_ENODEV, "this build has no CUDA");
#endif
    }
    if (rc < 0) {
        mem_free(ly->device, buf);
        return rc;
    }
    d = mlart_tensor_dense(buf, MLART_DTYPE_BF16, ly->device, 3, shape);
    d.extent = bytes + tail;
    mlart_log(MLART_LOG_DEBUG, "%s: strided, replaced by a dense copy at %p", name, buf);
    *out = d;
    *owned = buf;
    return 0;
}

/* ---- create / destroy -------------------------------------------------- */

static int check_contract(const mlart_layer *ly, const char *name)
{
    const mlart_layout_contract *c = &ly->contract;
    const mlart_geometry *g = &ly->geom;
    uint32_t dev = ly->device < 0 ? MLART_DEV_HOST : MLART_DEV_CUDA;
    if (c->query_bmm != MLART_QBMM_SAFE_OP && c->query_bmm != MLART_QBMM_CONTIGUOUS)
        return mlart_set_error(MLART_EABI, "backend '%s': contract.query_bmm = %u is not "
                               "MLART_QBMM_SAFE_OP or MLART_QBMM_CONTIGUOUS", name, c->query_bmm);
    if (c->weights != MLART_W_DENSE)
        return mlart_set_error(MLART_EABI, "backend '%s': contract.weights = %u is not "
                               "MLART_W_DENSE", name, c->weights);
    if (c->output != MLART_OUT_HEAD_MAJOR && c->output != MLART_OUT_TOKEN_MAJOR)
        return mlart_set_error(MLART_EABI, "backend '%s': contract.output = %u is not "
                               "MLART_OUT_HEAD_MAJOR or MLART_OUT_TOKEN_MAJOR", name, c->output);
    if (!(c->devices & dev))
        return mlart_set_error(MLART_ENOTSUP, "backend '%s' does not run on %s (its contract "
                               "lists:%s%s); pick another backend or device", name,
                               ly->device < 0 ? "the host" : "CUDA",
                               c->devices & MLART_DEV_HOST ? " host" : "",
                               c->devices & MLART_DEV_CUDA ? " cuda" : "");
    if (!(c->kv_formats & MLART_KV_FORMAT_BIT(g->kv_format)))
        return mlart_set_error(MLART_ENOTSUP, "backend '%s' does not support kv_format %s "
                               "(supported:%s%s)", name, mlart_kv_format_name(g->kv_format),
                               c->kv_formats & MLART_KV_FORMAT_BIT(MLART_KV_BF16) ? " bf16" : "",
                               c->kv_formats & MLART_KV_FORMAT_BIT(MLART_KV_FP8_DS_MLA)
                                   ? " fp8_ds_mla" : "");
    if (c->max_heads && (uint32_t)g->heads > c->max_heads)
        return mlart_set_error(MLART_ENOTSUP, "backend '%s' serves at most %u heads per rank, "
                               "the layer has %d (raise tp_size or pick another backend)",
                               name, c->max_heads, g->heads);
    if (c->head_multiple > 1 && (uint32_t)g->heads % c->head_multiple)
        return mlart_set_error(MLART_ENOTSUP, "backend '%s' needs heads per rank to be a "
                               "multiple of %u, the layer has %d", name, c->head_multiple,
                               g->heads);
    if (c->max_topk && (uint32_t)g->topk > c->max_topk)
        return mlart_set_error(MLART_ENOTSUP, "backend '%s' serves topk <= %u, the layer has %d",
                               name, c->max_topk, g->topk);
    return 0;
}

void mlart_layer_destroy(mlart_layer *ly)
{
    if (!ly)
        return;
    if (ly->state)
        ly->vt->destroy(ly->state);
    if (ly->dstate)
        ly->vt->destroy(ly->dstate);
    {
        dcp_buf *bufs[] = {&ly->dq_all, &ly->dq_mqa,    &ly->didx, &ly->dlens, &ly->dattn, &ly->dlse,
                           &ly->drecv,  &ly->drecv_lse, &ly->dsum, &ly->dwork, &ly->dagree};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
            mem_free(ly->device, bufs[i]->p);
    }
#ifdef MLART_WITH_CUDA
    if (ly->dside)
        cudaStreamDestroy((cudaStream_t)ly->dside);
    if (ly->dfork)
        cudaEventDestroy((cudaEvent_t)ly->dfork);
    if (ly->djoin)
        cudaEventDestroy((cudaEvent_t)ly->djoin);
#endif
    mem_free(ly->device, ly->w_uk_t_own);
    mem_free(ly->device, ly->w_uv_own);
    mem_free(ly->device, ly->q_nope_buf);
    mem_free(ly->device, ly->q_mqa_buf);
    mem_free(ly->device, ly->attn_buf);
    mem_free(ly->device, ly->lse_buf);
    mem_free(ly->device, ly->workspace);
    free(ly->h_meta);
    free(ly->h_agree);
    free(ly);
}

/* ---- decode-context parallel: set-up ------------------------------------ */

static int dcp_alloc(mlart_layer *ly, dcp_buf *b, size_t bytes)
{
    b->bytes = bytes + ly->contract.tail_pad;
    return mem_alloc(ly->device, b->bytes, &b->p);
}

/* The words of a rank's step record (dcp_check_agree). */
enum { AGREE_WORDS = 6 };

/* A second backend state for the D*H heads every rank attends over its
 * shard, and the buffers of the exchange, sized for the largest step. */
static int dcp_setup(mlart_layer *ly, const mlart_layer_desc *desc, const char *name)
{
    const mlart_layout_contract *c = &ly->contract;
    mlart_comm *comm = desc->dcp;
    const int32_t D = mlart_comm_size(comm);
    const int64_t H = ly->geom.heads, G = (int64_t)D * H, L = ly->geom.kv_lora,
                  R = ly->geom.rope, T = ly->max_tokens, B = ly->max_requests;
    mlart_backend_init init;
    unsigned sn;
    mlart_plan plan;
    size_t wbytes = 0;
    if (mlart_comm_device(comm) != ly->device)
        return mlart_set_error(MLART_EINVAL, "dcp: the communicator's buffers live on device %d, "
                               "the layer's on device %d (-1 = host)", mlart_comm_device(comm),
                               ly->device);
    if (desc->dcp_interleave < 0)
        return mlart_set_error(MLART_EINVAL, "dcp_interleave %d, want >= 1 (0 = 1)",
                               desc->dcp_interleave);
    if (desc->dcp_routing != MLART_DCP_AG_RS && desc->dcp_routing != MLART_DCP_A2A)
        return mlart_set_error(MLART_EINVAL, "dcp_routing %d is neither MLART_DCP_AG_RS nor "
                               "MLART_DCP_A2A", (int)desc->dcp_routing);
    if (c->output != MLART_OUT_HEAD_MAJOR)
        return mlart_set_error(MLART_ENOTSUP, "dcp: backend '%s' gives token-major output; the "
                               "exchange of partial outputs needs head-major", name);
    if (c->max_heads && (uint64_t)G > c->max_heads)
        return mlart_set_error(MLART_ENOTSUP, "dcp: every rank attends the group's %" PRId64
                               " heads (%d ranks x %" PRId64 "), backend '%s' serves at most %u",
                               G, D, H, name, c->max_heads);
    ly->dcp = comm;
    ly->dcp_size = D;
    ly->dcp_rank = mlart_comm_rank(comm);
    ly->dcp_interleave = desc->dcp_interleave ? desc->dcp_interleave : 1;
    ly->dcp_routing = desc->dcp_routing;
    memset(&init, 0, sizeof init);
    init.struct_size = sizeof init;
    init.device = ly->device;
    init.geom = ly->geom;
    init.geom.heads = (int32_t)G;
    init.error = mlart_set_error;
    init.log = mlart_log;
    sn = mlart_error_serial();
    MLART_CHECK(backend_rc(ly, "create", sn, ly->vt->create(&init, &ly->dstate)));
    memset(&plan, 0, sizeof plan);
    plan.struct_size = sizeof plan;
    plan.geom = init.geom;
    plan.device = ly->device;
    plan.max_tokens = ly->max_tokens;
    plan.max_requests = ly->max_requests;
    plan.max_blocks_per_req = ly->max_blocks;
    plan.num_slots = ly->num_slots;
    sn = mlart_error_serial();
    MLART_CHECK(backend_rc(ly, "plan", sn, ly->vt->plan(ly->dstate, &plan, &wbytes)));
    MLART_CHECK(dcp_alloc(ly, &ly->dwork, wbytes));
    MLART_CHECK(dcp_alloc(ly, &ly->dq_all, (size_t)(G * T * (L + R)) * 2));
    MLART_CHECK(dcp_alloc(ly, &ly->dq_mqa, (size_t)(G * T * (L + R)) * 2));
    MLART_CHECK(dcp_alloc(ly, &ly->didx, (size_t)T * (size_t)ly->geom.topk * 4));
    MLART_CHECK(dcp_alloc(ly, &ly->dlens, (size_t)B * 4));
    MLART_CHECK(dcp_alloc(ly, &ly->dattn, (size_t)(G * T * L) * 2));
    MLART_CHECK(dcp_alloc(ly, &ly->dlse, (size_t)(G * T) * 4));
    MLART_CHECK(dcp_alloc(ly, &ly->dagree, (size_t)(1 + D) * AGREE_WORDS * 8));
    if (!(ly->h_agree = malloc((size_t)D * AGREE_WORDS * 8)))
        return mlart_set_error(MLART_ENOMEM, "layer: out of host memory");
    if (ly->dcp_routing == MLART_DCP_A2A) {
        MLART_CHECK(dcp_alloc(ly, &ly->drecv, (size_t)(G * T * L) * 2));
        MLART_CHECK(dcp_alloc(ly, &ly->drecv_lse, (size_t)(G * T) * 4));
    } else {
        MLART_CHECK(dcp_alloc(ly, &ly->drecv, (size_t)(G * T * L) * 4));
        MLART_CHECK(dcp_alloc(ly, &ly->drecv_lse, (size_t)(D * G * T) * 4));
        MLART_CHECK(dcp_alloc(ly, &ly->dsum, (size_t)(H * T * L) * 4));
    }
#ifdef MLART_WITH_CUDA
    if (ly->device >= 0) {
        cudaStream_t side = NULL;
        cudaEvent_t fork = NULL, join = NULL;
        CUDA_TRY_(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
        ly->dside = side;
        CUDA_TRY_(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
        ly->dfork = fork;
        CUDA_TRY_(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
        ly->djoin = join;
    }
#endif
    mlart_log(MLART_LOG_INFO, "layer: dcp rank %d of %d (%s comm), %" PRId64 " heads attended, "
              "interleave %d, routing %s", ly->dcp_rank, D, mlart_comm_kind(comm), G,
              ly->dcp_interleave, ly->dcp_routing == MLART_DCP_A2A ? "a2a" : "ag_rs");
    return 0;
}

int mlart_layer_create(mlart_context *ctx, const mlart_layer_desc *desc, mlart_layer **out)
{
    mlart_layer *ly;
    const mlart_geometry *g;
    const char *name;
    mlart_backend_init init;
    mlart_plan plan;
    unsigned sn;
    int64_t H, P, R, L, V, T;
    size_t tail;
    int rc;
    if (!ctx || !desc || !out)
        return mlart_set_error(MLART_EINVAL, "mlart_layer_create: NULL argument");
    g = &desc->geom;
    MLART_CHECK(mlart_geometry_check(g));
    if (desc->max_tokens <= 0 || desc->max_requests <= 0 || desc->max_blocks_per_req <= 0 ||
        desc->num_slots <= 0)
        return mlart_set_error(MLART_EINVAL, "layer: max_tokens %d, max_requests %d, "
                               "max_blocks_per_req %d, num_slots %" PRId64 " must all be > 0",
                               desc->max_tokens, desc->max_requests, desc->max_blocks_per_req,
                               desc->num_slots);
    MLART_CHECK(check_sizes_fit(g, desc->max_tokens, desc->dcp ? mlart_comm_size(desc->dcp) : 1));
    ly = calloc(1, sizeof *ly);
    if (!ly)
        return mlart_set_error(MLART_ENOMEM, "mlart_layer_create: out of memory");
    ly->device = mlart_context_device(ctx);
    ly->geom = *g;
    ly->max_tokens = desc->max_tokens;
    ly->max_requests = desc->max_requests;
    ly->max_blocks = desc->max_blocks_per_req;
    ly->num_slots = desc->num_slots;
    ly->validate_indices = ly->device < 0 ? 1 : desc->validate_indices;
    ly->early_weights = desc->early_weights != 0;
    name = desc->backend && desc->backend[0] ? desc->backend
                                             : ly->device >= 0 ? "b12x_mla_sparse" : "reference";
#ifdef MLART_WITH_CUDA
    if (ly->device >= 0) { /* buffers below belong to the context's device */
        cudaError_t e = cudaSetDevice(ly->device);
        if (e != cudaSuccess) {
            rc = mlart_set_error(MLART_ECUDA, "cudaSetDevice(%d): %s", ly->device,
                                 cudaGetErrorString(e));
            goto fail;
        }
    }
#endif
    rc = mlart_backend_lookup(name, &ly->vt);
    if (rc < 0)
        goto fail;
    ly->contract = ly->vt->contract;
    rc = check_contract(ly, name);
    if (rc < 0)
        goto fail;
    tail = ly->contract.tail_pad;
    H = g->heads, P = g->qk_nope, R = g->rope, L = g->kv_lora, V = g->v_head;
    T = desc->max_tokens;
    {
        int64_t cache_shape[2] = {desc->num_slots, (int64_t)mlart_kv_bytes_per_token(g)};
        rc = check_view(&desc->kv_cache, "kv_cache", MLART_DTYPE_U8, 2, cache_shape, ly->device,
                        DENSE, tail);
        if (rc < 0)
            goto fail;
        ly->kv_cache = desc->kv_cache;
    }
    {
        int64_t uk_shape[3] = {H, P, L}, uv_shape[3] = {H, L, V};
        rc = enforce_weight(ly, &desc->w_uk_t, "w_uk_t", uk_shape, &ly->w_uk_t, &ly->w_uk_t_own);
        if (rc == 0)
            rc = enforce_weight(ly, &desc->w_uv, "w_uv", uv_shape, &ly->w_uv, &ly->w_uv_own);
        /* a cache write would change the weights every step reads */
        if (rc == 0)
            rc = check_apart(&ly->kv_cache, "kv_cache", &ly->w_uk_t, "w_uk_t",
                             "the cache overlaps a weight the step reads");
        if (rc == 0)
            rc = check_apart(&ly->kv_cache, "kv_cache", &ly->w_uv, "w_uv",
                             "the cache overlaps a weight the step reads");
        if (rc < 0)
            goto fail;
    }
    /* activations, sized once for the largest step */
    ly->q_mqa_bytes = (size_t)(T * H * (L + R)) * 2 + tail;
    ly->attn_bytes = (size_t)(H * T * L) * 2 + tail;
    ly->lse_bytes = (size_t)(H * T) * 4 + tail;
    if (ly->contract.query_bmm == MLART_QBMM_CONTIGUOUS)
        ly->q_nope_bytes = (size_t)(H * T * P) * 2 + tail;
    if ((rc = mem_alloc(ly->device, ly->q_mqa_bytes, &ly->q_mqa_buf)) < 0 ||
        (rc = mem_alloc(ly->device, ly->attn_bytes, &ly->attn_buf)) < 0 ||
        (rc = mem_alloc(ly->device, ly->lse_bytes, &ly->lse_buf)) < 0 ||
        (rc = mem_alloc(ly->device, ly->q_nope_bytes, &ly->q_nope_buf)) < 0)
        goto fail;
    if (ly->device >= 0 && ly->validate_indices) {
        size_t n = (size_t)T * ((size_t)g->topk + 1) +
                   (size_t)desc->max_requests * ((size_t)desc->max_blocks_per_req + 1);
        if (desc->dcp)
            n += (size_t)T * (size_t)g->topk + (size_t)desc->max_requests;
        /* every term is below 2^62; their bytes may not be */
        ly->h_meta = n <= SIZE_MAX / sizeof(int32_t) ? malloc(n * sizeof(int32_t)) : NULL;
        if (!ly->h_meta) {
            rc = mlart_set_error(MLART_ENOMEM, "layer: out of host memory");
            goto fail;
        }
    }
    memset(&init, 0, sizeof init);
    init.struct_size = sizeof init;
    init.device = ly->device;
    init.geom = *g;
    init.error = mlart_set_error;
    init.log = mlart_log;
    sn = mlart_error_serial();
    rc = backend_rc(ly, "create", sn, ly->vt->create(&init, &ly->state));
    if (rc < 0)
        goto fail;
    memset(&plan, 0, sizeof plan);
    plan.struct_size = sizeof plan;
    plan.geom = *g;
    plan.device = ly->device;
    plan.max_tokens = desc->max_tokens;
    plan.max_requests = desc->max_requests;
    plan.max_blocks_per_req = desc->max_blocks_per_req;
    plan.num_slots = desc->num_slots;
    sn = mlart_error_serial();
    rc = backend_rc(ly, "plan", sn, ly->vt->plan(ly->state, &plan, &ly->workspace_bytes));
    if (rc < 0)
        goto fail;
    rc = mem_alloc(ly->device, ly->workspace_bytes, &ly->workspace);
    if (rc < 0)
        goto fail;
    if (desc->dcp && (rc = dcp_setup(ly, desc, name)) < 0)
        goto fail;
    mlart_log(MLART_LOG_INFO, "layer: backend '%s' on device %d, query %s, output %s, "
              "workspace %zu B", ly->vt->name, ly->device,
              ly->contract.query_bmm == MLART_QBMM_SAFE_OP ? "safe-op view" : "contiguous copy",
              ly->contract.output == MLART_OUT_HEAD_MAJOR ? "head-major" : "token-major",
              ly->workspace_bytes);
    *out = ly;
    return 0;
fail:
    mlart_layer_destroy(ly);
    return rc;
}

void mlart_layer_info_get(const mlart_layer *ly, mlart_layer_info *out)
{
    out->device = ly->device;
    out->geom = ly->geom;
    out->max_tokens = ly->max_tokens;
    out->max_requests = ly->max_requests;
    out->max_blocks = ly->max_blocks;
    out->tail_pad = ly->contract.tail_pad;
    out->dcp = ly->dcp;
    out->graph_safe = ly->device >= 0 && ly->contract.graph_safe && !ly->validate_indices &&
                      (!ly->dcp || mlart_comm_graph_safe(ly->dcp));
}

const char *mlart_layer_backend_name(const mlart_layer *ly)
{
    return ly ? ly->vt->name : NULL;
}

const struct mlart_layout_contract *mlart_layer_contract(const mlart_layer *ly)
{
    return ly ? &ly->contract : NULL;
}

int mlart_layer_weights(const mlart_layer *ly, mlart_tensor *w_uk_t, mlart_tensor *w_uv)
{
    if (!ly || !w_uk_t || !w_uv)
        return mlart_set_error(MLART_EINVAL, "mlart_layer_weights: NULL argument");
    *w_uk_t = ly->w_uk_t;
    *w_uv = ly->w_uv;
    return 0;
}

/* ---- decode ------------------------------------------------------------- */

/* Host values of the step's metadata: every index -1 or in [0, seq_len), and
 * (bt not NULL) the cache slot it maps to inside the cache. */
static int check_indices(const mlart_layer *ly, int32_t T, int32_t B, const int32_t *idx,
                         const int32_t *req, const int32_t *lens, const int32_t *bt)
{
    const int32_t K = ly->geom.topk, page = ly->geom.page_size, MB = ly->max_blocks;
    const int64_t capacity = (int64_t)MB * page;
    for (int32_t b = 0; b < B; b++)
        if (lens[b] < 0 || (bt && lens[b] > capacity))
            return mlart_set_error(MLART_ERANGE, "seq_lens[%d] = %d, want 0..%" PRId64
                                   " (max_blocks_per_req %d x page %d)", b, lens[b], capacity,
                                   MB, page);
    for (int32_t t = 0; t < T; t++) {
        int32_t r = req[t];
        if (r < 0 || r >= B)
            return mlart_set_error(MLART_ERANGE, "req_of_token[%d] = %d, want 0..%d", t, r,
                                   B - 1);
        for (int32_t k = 0; k < K; k++) {
            int32_t i = idx[(size_t)t * K + k];
            int64_t slot;
            if (i == -1)
                continue;
            if (i < -1 || i >= lens[r])
                return mlart_set_error(MLART_ERANGE, "idx[%d][%d] = %d, want -1 or 0..seq_len-1 "
                                       "(token %d belongs to request %d, seq_len %d)", t, k, i,
                                       t, r, lens[r]);
            if (!bt)
                continue;
            slot = (int64_t)bt[(size_t)r * MB + i / page] * page + i % page;
            if (slot < 0 || slot >= ly->num_slots)
                return mlart_set_error(MLART_ERANGE, "idx[%d][%d] = %d maps through "
                                       "block_table[%d][%d] = %d to cache slot %" PRId64
                                       ", outside 0..%" PRId64, t, k, i, r, i / page,
                                       bt[(size_t)r * MB + i / page], slot, ly->num_slots - 1);
        }
    }
    return 0;
}

static mlart_tensor view3(void *data, const mlart_tensor *storage, mlart_dtype dt, int64_t d0,
                          int64_t d1, int64_t d2, int64_t s0, int64_t s1, int64_t s2)
{
    mlart_tensor t = *storage;
    t.data = data;
    t.dtype = dt;
    t.ndim = 3;
    t.shape[0] = d0, t.shape[1] = d1, t.shape[2] = d2, t.shape[3] = 0;
    t.stride[0] = s0, t.stride[1] = s1, t.stride[2] = s2, t.stride[3] = 0;
    return t;
}

/* A view over one of the layer's own buffers. */
static mlart_tensor own_view(const mlart_layer *ly, void *buf, size_t bytes, mlart_dtype dt,
                             int ndim, const int64_t *shape)
{
    mlart_tensor t = mlart_tensor_dense(buf, dt, ly->device, ndim, shape);
    t.extent = bytes;
    return t;
}

/* q_nope [H,T,P] (strides P+R, H*(P+R), 1 in q) into dense [H,T,P]. */
static int materialise_q_nope(const mlart_layer *ly, const mlart_tensor *q, int32_t T,
                              void *stream)
{
    const int64_t H = ly->geom.heads, P = ly->geom.qk_nope;
    const uint16_t *src = q->data;
    uint16_t *dst = ly->q_nope_buf;
    if (ly->device < 0) {
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < T; t++)
                memcpy(dst + (h * T + t) * P, src + t * q->stride[0] + h * q->stride[1],
                       (size_t)P * 2);
        return 0;
    }
#ifdef MLART_WITH_CUDA
    /* 2-d copies, one per token or per head, whichever is fewer: async,
     * allocation-free and capturable. */
    if (T <= H) {
        for (int64_t t = 0; t < T; t++)
            CUDA_TRY_(cudaMemcpy2DAsync(dst + t * P, (size_t)(T * P) * 2,
                                        src + t * q->stride[0], (size_t)q->stride[1] * 2,
                                        (size_t)P * 2, (size_t)H, cudaMemcpyDeviceToDevice,
                                        (cudaStream_t)stream));
    } else {
        for (int64_t h = 0; h < H; h++)
            CUDA_TRY_(cudaMemcpy2DAsync(dst + h * T * P, (size_t)P * 2,
                                        src + h * q->stride[1], (size_t)q->stride[0] * 2,
                                        (size_t)P * 2, (size_t)T, cudaMemcpyDeviceToDevice,
                                        (cudaStream_t)stream));
    }
    return 0;
#else
    return mlart_set_error(MLART_ENODEV, "this build has no CUDA");
#endif
}

/* Bring the step's integer metadata to the host for check_indices. */
static int host_metadata(mlart_layer *ly, const mlart_step_io *io, void *stream,
                         const int32_t **idx, const int32_t **req, const int32_t **lens,
                         const int32_t **bt)
{
    if (ly->device < 0) {
        *idx = io->idx.data, *req = io->req_of_token.data, *lens = io->seq_lens.data;
        *bt = io->block_table.data;
        return 0;
    }
#ifdef MLART_WITH_CUDA
    {
        size_t nidx = (size_t)io->T * (size_t)ly->geom.topk, nbt = (size_t)io->B * ly->max_blocks;
        int32_t *h = ly->h_meta;
        cudaStream_t st = (cudaStream_t)stream;
        CUDA_TRY_(cudaMemcpyAsync(h, io->idx.data, nidx * 4, cudaMemcpyDeviceToHost, st));
        CUDA_TRY_(cudaMemcpyAsync(h + nidx, io->req_of_token.data, (size_t)io->T * 4,
                                  cudaMemcpyDeviceToHost, st));
        CUDA_TRY_(cudaMemcpyAsync(h + nidx + io->T, io->seq_lens.data, (size_t)io->B * 4,
                                  cudaMemcpyDeviceToHost, st));
        CUDA_TRY_(cudaMemcpyAsync(h + nidx + io->T + io->B, io->block_table.data, nbt * 4,
                                  cudaMemcpyDeviceToHost, st));
        CUDA_TRY_(cudaStreamSynchronize(st));
        *idx = h, *req = h + nidx, *lens = h + nidx + io->T, *bt = h + nidx + io->T + io->B;
        return 0;
    }
#else
    return mlart_set_error(MLART_ENODEV, "this build has no CUDA");
#endif
}

static int copy_lse(const mlart_layer *ly, const mlart_tensor *lse, int32_t T, void *stream)
{
    const int64_t H = ly->geom.heads;
    if (ly->device < 0) {
        for (int64_t h = 0; h < H; h++)
            memcpy((float *)lse->data + h * lse->stride[0], (const float *)ly->lse_buf + h * T,
                   (size_t)T * 4);
        return 0;
    }
#ifdef MLART_WITH_CUDA
    CUDA_TRY_(cudaMemcpy2DAsync(lse->data, (size_t)lse->stride[0] * 4, ly->lse_buf, (size_t)T * 4,
                                (size_t)T * 4, (size_t)H, cudaMemcpyDeviceToDevice,
                                (cudaStream_t)stream));
    return 0;
#else
    return mlart_set_error(MLART_ENODEV, "this build has no CUDA");
#endif
}

/* ---- decode-context parallel: a step ------------------------------------ */

/* The shard's view of the step's indices, checked like a plain step's: the
 * local positions map through this rank's block table into its cache. */
static int dcp_check_local(mlart_layer *ly, int32_t T, int32_t B, const int32_t *idx,
                           const int32_t *req, const int32_t *lens, const int32_t *bt)
{
    const int64_t n = (int64_t)T * ly->geom.topk;
    int32_t *lidx = ly->device < 0 ? (int32_t *)ly->didx.p
                                   : ly->h_meta + n + T + B + (size_t)B * ly->max_blocks;
    int32_t *llens = ly->device < 0 ? ly->dlens.p : lidx + n;
    MLART_CHECK(mlart_dcp_translate_cpu(idx, n, lens, B, ly->dcp_rank, ly->dcp_size,
                                        ly->dcp_interleave, lidx, llens));
    return check_indices(ly, T, B, lidx, req, llens, bt);
}

/* A 64-bit hash of n int32 words (an FNV-1a step a word, then a
 * finaliser): equal arrays give equal hashes on every rank. */
static uint64_t hash_words(const int32_t *w, int64_t n)
{
    uint64_t h = 0xcbf29ce484222325u;
    for (int64_t i = 0; i < n; i++)
        h = (h ^ (uint32_t)w[i]) * 0x100000001b3u;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdu;
    return h ^ h >> 33;
}

/* validate_indices with DCP: the ranks must call a step with the same T,
 * B, idx, req_of_token and seq_lens (mlart_layer_desc.dcp).  Each rank's
 * record of them (T, B and a hash of each array) and of its own checks'
 * result (`own`: check_indices on its shard) is all-gathered in one
 * collective of fixed size, so it pairs up whatever the ranks' steps are.
 * Every rank sees the same records, so all of them refuse the step when
 * one does, before any collective whose size depends on T (a rank that
 * refused alone would leave the others waiting in the exchange): a rank
 * whose own check failed returns that error, the others MLART_ECOMM naming
 * it.  Over NCCL a step that disagrees is otherwise undefined. */
static int dcp_check_agree(mlart_layer *ly, int32_t T, int32_t B, const int32_t *idx,
                           const int32_t *req, const int32_t *lens, int own, void *stream)
{
    static const char *const what[AGREE_WORDS] = {"T", "B", "idx", "req_of_token", "seq_lens"};
    const int D = ly->dcp_size;
    const uint64_t rec[AGREE_WORDS] = {(uint64_t)(uint32_t)T, (uint64_t)(uint32_t)B,
                                       hash_words(idx, (int64_t)T * ly->geom.topk),
                                       hash_words(req, T), hash_words(lens, B),
                                       (uint64_t)(int64_t)own};
    char why[512] = "";
    int rc;
    const size_t bytes = sizeof rec;
    uint64_t *send = ly->dagree.p, *recv = send + AGREE_WORDS;
    const uint64_t *r0 = ly->h_agree;
    if (own < 0) /* kept across the collective */
        snprintf(why, sizeof why, "%s", mlart_last_error());
    if (ly->device < 0) {
        memcpy(send, rec, bytes);
        if ((rc = mlart_comm_all_gather(ly->dcp, send, recv, bytes, stream)) < 0)
            return own < 0 ? mlart_set_error(own, "%s", why) : rc;
        memcpy(ly->h_agree, recv, bytes * (size_t)D);
    } else {
#ifdef MLART_WITH_CUDA
        cudaStream_t st = (cudaStream_t)stream;
        CUDA_TRY_(cudaMemcpyAsync(send, rec, bytes, cudaMemcpyHostToDevice, st));
        if ((rc = mlart_comm_all_gather(ly->dcp, send, recv, bytes, stream)) < 0)
            return own < 0 ? mlart_set_error(own, "%s", why) : rc;
        CUDA_TRY_(cudaMemcpyAsync(ly->h_agree, recv, bytes * (size_t)D, cudaMemcpyDeviceToHost,
                                  st));
        CUDA_TRY_(cudaStreamSynchronize(st));
#else
        return mlart_set_error(MLART_ENODEV, "this build has no CUDA");
#endif
    }
    if (own < 0)
        return mlart_set_error(own, "%s", why);
    for (int r = 1; r < D; r++) {
        const uint64_t *x = ly->h_agree + (size_t)r * AGREE_WORDS;
        if (x[0] != r0[0] || x[1] != r0[1])
            return mlart_set_error(MLART_ECOMM, "dcp: the ranks' steps differ: rank %d has T %u "
                                   "and B %u, rank 0 T %u and B %u (every rank must call a step "
                                   "with the same T, B, idx, req_of_token and seq_lens)",
                                   r, (unsigned)x[0], (unsigned)x[1], (unsigned)r0[0],
                                   (unsigned)r0[1]);
        for (int k = 2; k < AGREE_WORDS - 1; k++)
            if (x[k] != r0[k])
                return mlart_set_error(MLART_ECOMM, "dcp: the ranks' steps differ: rank %d's %s "
                                       "is not rank 0's (every rank must call a step with the "
                                       "same T, B, idx, req_of_token and seq_lens)", r, what[k]);
    }
    for (int r = 0; r < D; r++) {
        const int refused = (int)(int64_t)ly->h_agree[(size_t)r * AGREE_WORDS + AGREE_WORDS - 1];
        if (refused < 0)
            return mlart_set_error(MLART_ECOMM, "dcp: rank %d refused the step (%s; its own "
                                   "error says why), so every rank does", r,
                                   mlart_status_name(refused));
    }
    return 0;
}

static int dcp_join(mlart_layer *ly, void *stream);

/* Every rank's absorbed queries [D][T,H,C] -> [T,D*H,C], in *q.  One
 * token's [D][1,H,C] already is [1,D*H,C]: attend reads the all-gather's
 * buffer and no copy runs. */
static int dcp_gather_queries(mlart_layer *ly, int64_t T, const dcp_buf **q, void *stream)
{
    const int64_t D = ly->dcp_size, H = ly->geom.heads, C = ly->geom.kv_lora + ly->geom.rope;
    int rc = mlart_comm_all_gather(ly->dcp, ly->q_mqa_buf, ly->dq_all.p, (size_t)(T * H * C) * 2,
                                   stream);
    if (ly->device >= 0) { /* the translation's branch joins here (dcp_fork_translate) */
        const int jrc = dcp_join(ly, stream);
        rc = rc < 0 ? rc : jrc;
    }
    MLART_CHECK(rc);
    *q = T == 1 ? &ly->dq_all : &ly->dq_mqa;
    if (T == 1)
        return 0;
    if (ly->device < 0)
        return mlart_dcp_gather_heads_cpu(ly->dq_all.p, (int32_t)D, T, H, C, ly->dq_mqa.p);
#ifdef MLART_WITH_CUDA
    return mlart_dcp_gather_heads_cuda(ly->dq_all.p, (int32_t)D, T, H, C, ly->dq_mqa.p, stream);
#else
    return mlart_set_error(MLART_ENODEV, "this build has no CUDA");
#endif
}

/* CUDA: the step's index translation on the layer's side branch: forked
 * from `stream` before the query absorption (it reads only the step's
 * indices and lengths, which the caller wrote before the step) and joined
 * by dcp_join right after the all-gather, before the head gather (or, for
 * one token, before attend()), so it overlaps the absorption and the
 * all-gather instead of taking a node of its own on the step's path.
 * Measured (docs/PERF.md, "Decode-context parallel"): joined there, a
 * rank of a group of 4 (collectives as local copies) 0.4-2.4 us less a
 * step and the one-rank NCCL group level at T <= 8, 0.6-0.9 us less from
 * T = 16; joined before the all-gather instead, the NCCL group was
 * 0.8-1.8 us slower at T <= 8.  The kernel just before attend() is still
 * never the one that wrote the indices.  Whatever fails between the fork
 * and the join, the branch is joined before the error goes up, so a
 * capture never ends with it open. */
static int dcp_join(mlart_layer *ly, void *stream)
{
#ifdef MLART_WITH_CUDA
    CUDA_TRY_(cudaStreamWaitEvent((cudaStream_t)stream, (cudaEvent_t)ly->djoin, 0));
    return 0;
#else
    (void)ly, (void)stream;
    return mlart_set_error(MLART_ENODEV, "this build has no CUDA");
#endif
}

static int dcp_fork_translate(mlart_layer *ly, const mlart_step *s, void *stream)
{
#ifdef MLART_WITH_CUDA
    cudaStream_t side = (cudaStream_t)ly->dside;
    int rc;
    CUDA_TRY_(cudaEventRecord((cudaEvent_t)ly->dfork, (cudaStream_t)stream));
    CUDA_TRY_(cudaStreamWaitEvent(side, (cudaEvent_t)ly->dfork, 0));
    rc = mlart_dcp_translate_cuda(s->idx.data, (int64_t)s->T * ly->geom.topk, s->seq_lens.data, s->B,
                                  ly->dcp_rank, ly->dcp_size, ly->dcp_interleave, ly->didx.p, ly->dlens.p,
                                  side);
    {
        const cudaError_t e = cudaEventRecord((cudaEvent_t)ly->djoin, side);
        if (e != cudaSuccess) /* a capture fails with it */
            return mlart_set_error(MLART_ECUDA, "dcp: closing the translation's branch: %s",
                                   cudaGetErrorString(e));
        if (rc < 0)
            dcp_join(ly, stream);
        return rc;
    }
#else
    (void)ly, (void)s, (void)stream;
    return mlart_set_error(MLART_ENODEV, "this build has no CUDA");
#endif
}

/* A DCP step between the absorption and the V up-projection: gather the
 * group's queries, attend its D*H heads over the local shard, bring each
 * head's D partials to its rank and combine them into s->attn_out [H,T,L]
 * and lse_out [H,T]. */
static int dcp_attend(mlart_layer *ly, const mlart_step *s, void *lse_out, void *stream)
{
    const int32_t D = ly->dcp_size, rank = ly->dcp_rank, T = s->T, B = s->B;
    const int64_t H = ly->geom.heads, G = (int64_t)D * H, L = ly->geom.kv_lora,
                  C = L + ly->geom.rope, n_idx = (int64_t)T * ly->geom.topk;
    const int cpu = ly->device < 0;
    mlart_step a = *s;
    unsigned sn;
    /* the translation first: the kernel just before attend() is then not
     * the one that wrote the indices attend may read before its wait (on
     * CUDA it runs on the side branch, dcp_fork_translate, joined after
     * the all-gather) */
    if (cpu)
        MLART_CHECK(mlart_dcp_translate_cpu(s->idx.data, n_idx, s->seq_lens.data, B, rank, D,
                                            ly->dcp_interleave, ly->didx.p, ly->dlens.p));
    const dcp_buf *q;
    MLART_CHECK(dcp_gather_queries(ly, T, &q, stream));
    {
        int64_t q_shape[3] = {T, G, C}, idx_shape[2] = {T, ly->geom.topk}, b_shape[1] = {B},
                o_shape[3] = {G, T, L}, lse_shape[2] = {G, T};
        a.geom.heads = (int32_t)G;
        a.q_mqa = own_view(ly, q->p, q->bytes, MLART_DTYPE_BF16, 3, q_shape);
        a.idx = own_view(ly, ly->didx.p, ly->didx.bytes, MLART_DTYPE_I32, 2, idx_shape);
        a.seq_lens = own_view(ly, ly->dlens.p, ly->dlens.bytes, MLART_DTYPE_I32, 1, b_shape);
        a.attn_out = own_view(ly, ly->dattn.p, ly->dattn.bytes, MLART_DTYPE_BF16, 3, o_shape);
        a.lse = own_view(ly, ly->dlse.p, ly->dlse.bytes, MLART_DTYPE_F32, 2, lse_shape);
        a.workspace = ly->dwork.p;
        a.workspace_bytes = ly->dwork.bytes - ly->contract.tail_pad;
        memset(&a.q_nope, 0, sizeof a.q_nope); /* attend reads none of these */
        memset(&a.q_pe, 0, sizeof a.q_pe);
        memset(&a.w_uk_t, 0, sizeof a.w_uk_t);
        memset(&a.w_uv, 0, sizeof a.w_uv);
        memset(&a.o, 0, sizeof a.o);
    }
    sn = mlart_error_serial();
    MLART_CHECK(backend_rc(ly, "attend", sn, ly->vt->attend(ly->dstate, &a, stream)));
    if (ly->dcp_routing == MLART_DCP_A2A) {
        /* the partials and their LSEs in one operation */
        const void *send[2] = {ly->dattn.p, ly->dlse.p};
        void *recv[2] = {ly->drecv.p, ly->drecv_lse.p};
        const size_t bytes[2] = {(size_t)(H * T * L) * 2, (size_t)(H * T) * 4};
        MLART_CHECK(mlart_comm_all_to_all_n(ly->dcp, 2, send, recv, bytes, stream));
        if (cpu)
            return mlart_dcp_combine_cpu(ly->drecv.p, ly->drecv_lse.p, D, H, T, L,
                                         s->attn_out.data, lse_out);
#ifdef MLART_WITH_CUDA
        return mlart_dcp_combine_cuda(ly->drecv.p, ly->drecv_lse.p, D, H, T, L, s->attn_out.data,
                                      lse_out, stream);
#else
        return mlart_set_error(MLART_ENODEV, "this build has no CUDA");
#endif
    }
    MLART_CHECK(mlart_comm_all_gather(ly->dcp, ly->dlse.p, ly->drecv_lse.p, (size_t)(G * T) * 4,
                                      stream));
    if (cpu) {
        MLART_CHECK(mlart_dcp_scale_cpu(ly->dattn.p, ly->drecv_lse.p, D, rank, H, T, L,
                                        ly->drecv.p, lse_out));
        MLART_CHECK(mlart_comm_reduce_scatter_f32(ly->dcp, ly->drecv.p, ly->dsum.p,
                                                  (size_t)(H * T * L), stream));
        return mlart_f32_to_bf16_cpu(ly->dsum.p, H * T * L, s->attn_out.data);
    }
#ifdef MLART_WITH_CUDA
    MLART_CHECK(mlart_dcp_scale_cuda(ly->dattn.p, ly->drecv_lse.p, D, rank, H, T, L, ly->drecv.p,
                                     lse_out, stream));
    MLART_CHECK(mlart_comm_reduce_scatter_f32(ly->dcp, ly->drecv.p, ly->dsum.p,
                                              (size_t)(H * T * L), stream));
    return mlart_f32_to_bf16_cuda(ly->dsum.p, H * T * L, s->attn_out.data, stream);
#else
    return mlart_set_error(MLART_ENODEV, "this build has no CUDA");
#endif
}

/* The query absorption of a step: the backend's, else the runtime's op
 * (q_nope x W_UK_T into q_mqa[.., 0:L), q_pe copied into [.., L:L+R)). */
static int absorb(mlart_layer *ly, const mlart_step *s, void *stream)
{
    const int64_t H = ly->geom.heads, T = s->T, L = ly->geom.kv_lora, R = ly->geom.rope;
    mlart_tensor lat, pe;
    if (ly->vt->absorb_query) {
        unsigned sn = mlart_error_serial();
        return backend_rc(ly, "absorb_query", sn, ly->vt->absorb_query(ly->state, s, stream));
    }
    lat = view3(s->q_mqa.data, &s->q_mqa, MLART_DTYPE_BF16, H, T, L, L + R, H * (L + R), 1);
    pe = view3((uint16_t *)s->q_mqa.data + L, &s->q_mqa, MLART_DTYPE_BF16, T, H, R, H * (L + R), L + R, 1);
    if (ly->device < 0)
        return mlart_query_bmm_cpu(&s->q_nope, &s->w_uk_t, &lat, &s->q_pe, &pe);
#ifdef MLART_WITH_CUDA
    /* with early_weights, programmatic dependent launch: the caller
     * promised that the kernel before this one never writes W_UK_T */
    return (ly->early_weights ? mlart_query_bmm_cuda_pdl : mlart_query_bmm_cuda)(&s->q_nope, &s->w_uk_t, &lat,
                                                                                &s->q_pe, &pe, stream);
#else
    (void)stream;
    return mlart_set_error(MLART_ENODEV, "this build has no CUDA");
#endif
}

int mlart_layer_decode(mlart_layer *ly, const mlart_step_io *io, void *stream)
{
    const mlart_geometry *g;
    mlart_step s;
    int64_t H, P, R, L, V, T, B;
    size_t tail;
    int lse_direct = 0;
    unsigned sn;
    if (!ly || !io)
        return mlart_set_error(MLART_EINVAL, "mlart_layer_decode: NULL argument");
    g = &ly->geom;
    H = g->heads, P = g->qk_nope, R = g->rope, L = g->kv_lora, V = g->v_head;
    T = io->T, B = io->B;
    tail = ly->contract.tail_pad;
    if (T < 1 || T > ly->max_tokens)
        return mlart_set_error(MLART_ERANGE, "step: T = %" PRId64 " tokens, the layer was "
                               "planned for 1..%d (max_tokens)", T, ly->max_tokens);
    if (B < 1 || B > ly->max_requests)
        return mlart_set_error(MLART_ERANGE, "step: B = %" PRId64 " requests, the layer was "
                               "planned for 1..%d (max_requests)", B, ly->max_requests);
    {
        int64_t q_shape[3] = {T, H, P + R}, idx_shape[2] = {T, g->topk}, t_shape[1] = {T},
                b_shape[1] = {B}, bt_shape[2] = {B, ly->max_blocks}, o_shape[2] = {T, H * V},
                lse_shape[2] = {H, T};
        MLART_CHECK(check_view(&io->q, "q", MLART_DTYPE_BF16, 3, q_shape, ly->device, INNER_UNIT,
                               tail));
        MLART_CHECK(check_view(&io->idx, "idx", MLART_DTYPE_I32, 2, idx_shape, ly->device, DENSE,
                               tail));
        MLART_CHECK(check_view(&io->req_of_token, "req_of_token", MLART_DTYPE_I32, 1, t_shape,
                               ly->device, DENSE, tail));
        MLART_CHECK(check_view(&io->seq_lens, "seq_lens", MLART_DTYPE_I32, 1, b_shape, ly->device,
                               DENSE, tail));
        MLART_CHECK(check_view(&io->block_table, "block_table", MLART_DTYPE_I32, 2, bt_shape,
                               ly->device, DENSE, tail));
        MLART_CHECK(check_view(&io->o, "o", MLART_DTYPE_BF16, 2, o_shape, ly->device, INNER_UNIT,
                               0));
        MLART_CHECK(check_rows_apart(&io->o, "o"));
        if (io->lse.data) {
            MLART_CHECK(check_view(&io->lse, "lse", MLART_DTYPE_F32, 2, lse_shape, ly->device,
                                   INNER_UNIT, 0));
            MLART_CHECK(check_rows_apart(&io->lse, "lse"));
            MLART_CHECK(check_apart(&io->o, "o", &io->lse, "lse", "the outputs overlap"));
            lse_direct = io->lse.stride[0] == T || H == 1;
        }
    }
    {
        /* an output over anything the step reads: attend would overwrite
         * indices already validated, or the step would write the cache or
         * the weights (those the backend sees, mlart_layer_weights) */
        const mlart_tensor *in[] = {&io->q,        &io->idx,         &io->req_of_token,
                                    &io->seq_lens, &io->block_table, &ly->kv_cache,
                                    &ly->w_uk_t,   &ly->w_uv};
        static const char *const in_names[] = {"q",           "idx",      "req_of_token", "seq_lens",
                                               "block_table", "kv_cache", "w_uk_t",       "w_uv"};
        static const char overlap[] = "the output overlaps an input the step reads";
        for (size_t i = 0; i < sizeof in / sizeof in[0]; i++) {
            MLART_CHECK(check_apart(&io->o, "o", in[i], in_names[i], overlap));
            if (io->lse.data)
                MLART_CHECK(check_apart(&io->lse, "lse", in[i], in_names[i], overlap));
        }
        {
            /* the V up-projection (the runtime's op, or a backend's through
             * mlart_v_up_bmm_check) tests o as [H,T,V] against W_UV, after
             * attend() has run: make the same test before anything runs */
            mlart_tensor o3 = view3(io->o.data, &io->o, MLART_DTYPE_BF16, H, T, V, V,
                                    io->o.stride[0], 1);
            MLART_CHECK(check_apart(&o3, "o", &ly->w_uv, "w_uv", overlap));
        }
    }
    if (ly->validate_indices) {
        const int32_t *idx = NULL, *req = NULL, *lens = NULL, *bt = NULL;
        int own;
        MLART_CHECK(host_metadata(ly, io, stream, &idx, &req, &lens, &bt));
        own = check_indices(ly, (int32_t)T, (int32_t)B, idx, req, lens, ly->dcp ? NULL : bt);
        if (ly->dcp) {
            if (own >= 0)
                own = dcp_check_local(ly, (int32_t)T, (int32_t)B, idx, req, lens, bt);
            MLART_CHECK(dcp_check_agree(ly, (int32_t)T, (int32_t)B, idx, req, lens, own, stream));
        }
        MLART_CHECK(own);
    }

    memset(&s, 0, sizeof s);
    s.struct_size = sizeof s;
    s.geom = *g;
    s.device = ly->device;
    s.T = (int32_t)T;
    s.B = (int32_t)B;
    s.q_pe = view3((uint16_t *)io->q.data + P, &io->q, MLART_DTYPE_BF16, T, H, R, io->q.stride[0],
                   io->q.stride[1], 1);
    if (ly->contract.query_bmm == MLART_QBMM_CONTIGUOUS) {
        int64_t shape[3] = {H, T, P};
        MLART_CHECK(materialise_q_nope(ly, &io->q, (int32_t)T, stream));
        s.q_nope = own_view(ly, ly->q_nope_buf, ly->q_nope_bytes, MLART_DTYPE_BF16, 3, shape);
    } else {
        s.q_nope = view3(io->q.data, &io->q, MLART_DTYPE_BF16, H, T, P, io->q.stride[1],
                         io->q.stride[0], 1);
    }
    s.w_uk_t = ly->w_uk_t;
    s.w_uv = ly->w_uv;
    {
        int64_t shape[3] = {T, H, L + R};
        s.q_mqa = own_view(ly, ly->q_mqa_buf, ly->q_mqa_bytes, MLART_DTYPE_BF16, 3, shape);
    }
    s.kv_cache = ly->kv_cache;
    s.idx = io->idx;
    s.req_of_token = io->req_of_token;
    s.seq_lens = io->seq_lens;
    s.block_table = io->block_table;
    {
        int64_t head_major[3] = {H, T, L}, token_major[3] = {T, H, L}, lse_shape[2] = {H, T};
        s.attn_out = own_view(ly, ly->attn_buf, ly->attn_bytes, MLART_DTYPE_BF16, 3,
                              ly->contract.output == MLART_OUT_HEAD_MAJOR ? head_major
                                                                          : token_major);
        s.lse = lse_direct ? io->lse
                           : own_view(ly, ly->lse_buf, ly->lse_bytes, MLART_DTYPE_F32, 2,
                                      lse_shape);
    }
    s.o = io->o;
    s.workspace = ly->workspace;
    s.workspace_bytes = ly->workspace_bytes;

    if (ly->dcp && ly->device >= 0)
        MLART_CHECK(dcp_fork_translate(ly, &s, stream));
    {
        const int rc = absorb(ly, &s, stream);
        if (rc < 0) {
            if (ly->dcp && ly->device >= 0)
                dcp_join(ly, stream); /* close the branch */
            return rc;
        }
    }
    if (ly->dcp)
        MLART_CHECK(dcp_attend(ly, &s, lse_direct ? io->lse.data : ly->lse_buf, stream));
    else {
        sn = mlart_error_serial();
        MLART_CHECK(backend_rc(ly, "attend", sn, ly->vt->attend(ly->state, &s, stream)));
    }
    if (ly->vt->v_up) {
        sn = mlart_error_serial();
        MLART_CHECK(backend_rc(ly, "v_up", sn, ly->vt->v_up(ly->state, &s, stream)));
    } else {
        mlart_tensor x = ly->contract.output == MLART_OUT_HEAD_MAJOR
                             ? view3(s.attn_out.data, &s.attn_out, MLART_DTYPE_BF16, H, T, L,
                                     T * L, L, 1)
                             : view3(s.attn_out.data, &s.attn_out, MLART_DTYPE_BF16, H, T, L, L,
                                     H * L, 1);
        mlart_tensor o = view3(io->o.data, &io->o, MLART_DTYPE_BF16, H, T, V, V, io->o.stride[0],
                               1);
        if (ly->device < 0)
            MLART_CHECK(mlart_v_up_bmm_cpu(&x, &s.w_uv, &o));
        else
#ifdef MLART_WITH_CUDA
            /* with programmatic dependent launch: its weight copies start
             * while attend()'s last kernel ends (attend never writes W_UV,
             * backend.h); it reads attn_out only after that kernel */
            MLART_CHECK(mlart_v_up_bmm_cuda_pdl(&x, &s.w_uv, &o, stream));
#else
            return mlart_set_error(MLART_ENODEV, "this build has no CUDA");
#endif
    }
    if (io->lse.data && !lse_direct)
        MLART_CHECK(copy_lse(ly, &io->lse, (int32_t)T, stream));
    return 0;
}

int mlart_layer_write_kv(mlart_layer *ly, const mlart_tensor *latent, const mlart_tensor *slots,
                         void *stream)
{
    if (!ly || !latent || !slots)
        return mlart_set_error(MLART_EINVAL, "mlart_layer_write_kv: NULL argument");
    if (latent->device != ly->device || slots->device != ly->device)
        return mlart_set_error(MLART_EINVAL, "write_kv: latent on device %d, slots on device %d, "
                               "the layer on device %d (-1 = host)", latent->device,
                               slots->device, ly->device);
    MLART_CHECK(mlart_kv_write_check(&ly->geom, &ly->kv_cache, latent, slots));
    if (ly->device < 0)
        return mlart_kv_write_cpu(&ly->geom, &ly->kv_cache, latent, slots);
#ifdef MLART_WITH_CUDA
    return mlart_kv_write_cuda(&ly->geom, &ly->kv_cache, latent, slots, stream);
#else
    return mlart_set_error(MLART_ENODEV, "this build has no CUDA");
#endif
}
