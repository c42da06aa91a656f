/* mlart — decode step of MLA sparse attention (DeepSeek-V3.2 / GLM-5 style).
 *
 * Public runtime API: what a serving binary includes.  Every function returns
 * an int: 0 on success, a negative mlart_status on failure, with the detail in
 * mlart_last_error().  A failing call leaves its out-parameters untouched and
 * leaks nothing.  *_destroy functions accept NULL.  Dimensions are int64_t,
 * byte sizes size_t.  The library never calls exit() or abort() on user input
 * and prints nothing except through MLART_LOG (debug|info|warn|error, stderr).
 */
#ifndef MLART_MLART_H
#define MLART_MLART_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define MLART_API
#else
#define MLART_API __attribute__((visibility("default")))
#endif

#define MLART_VERSION_MAJOR 0
#define MLART_VERSION_MINOR 2
#define MLART_VERSION_PATCH 0

/* ---- status ----------------------------------------------------------- */

/* One list makes the enum, mlart_strerror and mlart_status_name. */
#define MLART_STATUS_MAP(X)                                              \
    X(OK, 0, "success")                                                 \
    X(EINVAL, -1, "invalid argument")                                   \
    X(ENOMEM, -2, "out of memory")                                      \
    X(ESHAPE, -3, "shape mismatch")                                     \
    X(EDTYPE, -4, "dtype mismatch")                                     \
    X(ELAYOUT, -5, "layout or storage-span violation")                  \
    X(ERANGE, -6, "value out of range")                                 \
    X(ENOTSUP, -7, "not supported")                                     \
    X(ENOBACKEND, -8, "unknown backend")                                \
    X(EABI, -9, "backend ABI mismatch")                                 \
    X(ECONFIG, -10, "configuration error")                              \
    X(EIO, -11, "I/O error")                                            \
    X(ECUDA, -12, "CUDA error")                                         \
    X(ENODEV, -13, "no usable device")                                  \
    X(ECOMM, -14, "communication error")                                \
    X(ETIMEDOUT, -15, "timed out")                                      \
    X(EINTERNAL, -16, "internal error")

typedef enum mlart_status {
#define MLART_STATUS_ENUM_(name, value, text) MLART_##name = value,
    MLART_STATUS_MAP(MLART_STATUS_ENUM_)
#undef MLART_STATUS_ENUM_
} mlart_status;

/* Static text for a status ("invalid argument"); "unknown status" otherwise. */
MLART_API const char *mlart_strerror(int status);
/* Static name of a status ("MLART_EINVAL"); "MLART_UNKNOWN" otherwise. */
MLART_API const char *mlart_status_name(int status);
/* Detail of the last failure on this thread ("" if none).  Valid until the
 * next failing call on the same thread.  At most 1023 characters: a longer
 * detail is cut and ends in "...". */
MLART_API const char *mlart_last_error(void);

/* ---- dtypes ----------------------------------------------------------- */

typedef enum mlart_dtype {
    MLART_DTYPE_INVALID = 0,
    MLART_DTYPE_BF16 = 1,
    MLART_DTYPE_FP8_E4M3 = 2,
    MLART_DTYPE_F32 = 3,
    MLART_DTYPE_I32 = 4,
    MLART_DTYPE_U8 = 5, /* raw bytes, e.g. fp8_ds_mla cache records */
    MLART_DTYPE_I64 = 6
} mlart_dtype;

/* Bytes per element; 0 for an unknown dtype. */
MLART_API size_t mlart_dtype_size(mlart_dtype dtype);
/* "bf16", "fp8_e4m3", "f32", "i32", "u8", "i64"; "invalid" otherwise. */
MLART_API const char *mlart_dtype_name(mlart_dtype dtype);

/* ---- tensor views ----------------------------------------------------- */

#define MLART_MAX_DIMS 4

/* A strided view that carries the bounds of the storage holding it.
 * The view's span (lowest..highest byte any element touches) must lie in
 * [base, base + extent): ops check this at plan/bind time and refuse with
 * MLART_ELAYOUT otherwise.  Strides are in elements and may be any value
 * >= 0 (0 = broadcast).  A view with a zero-sized dimension touches nothing. */
typedef struct mlart_tensor {
    void *data;            /* address of element [0,...,0] */
    mlart_dtype dtype;
    int ndim;              /* 1..MLART_MAX_DIMS */
    int64_t shape[MLART_MAX_DIMS];
    int64_t stride[MLART_MAX_DIMS]; /* in elements */
    const void *base;      /* start of the readable storage holding the view */
    size_t extent;         /* bytes readable from base */
    int device;            /* -1 = host, else CUDA ordinal */
} mlart_tensor;

/* A dense row-major view over [data, data + numel*size): base = data,
 * extent = exact byte size (0 when that size does not fit in size_t, so
 * that mlart_tensor_check refuses the view).  ndim in 1..MLART_MAX_DIMS. */
MLART_API mlart_tensor mlart_tensor_dense(void *data, mlart_dtype dtype, int device,
                                          int ndim, const int64_t *shape);
/* Number of elements (product of shape): 0 for a bad ndim or any dim <= 0,
 * -1 when the product does not fit in int64_t. */
MLART_API int64_t mlart_tensor_numel(const mlart_tensor *t);
/* Byte span of the view relative to its base: elements touch [*lo, *hi).
 * Empty views give lo == hi == offset of data.  Returns MLART_EINVAL on
 * negative shapes/strides, bad ndim or dtype, or data below base. */
MLART_API int mlart_tensor_span(const mlart_tensor *t, size_t *lo, size_t *hi);
/* Whether views a and b may share a byte: 0 when they live on different
 * devices, either is empty, their byte spans (base + [lo, hi) above) do
 * not meet, or one view's rows (along its outermost dim of more than one
 * index, S bytes apart, each spanning at most S) and the other view (its
 * rows S bytes apart too, or its whole span, at most S) sit at offsets
 * modulo S whose bytes are apart: e.g. the rows of two matrices
 * interleaved in one buffer, or a block in the gaps of a matrix's rows.
 * 1 otherwise, which may include views that interleave more finely
 * without sharing a byte; MLART_EINVAL for a view that mlart_tensor_span
 * refuses. */
MLART_API int mlart_tensor_overlap(const mlart_tensor *a, const mlart_tensor *b);
/* Whether two elements of one view may share an address (an output such a
 * view would be written twice over).  A sufficient test: taking the dims of
 * more than one index by increasing stride, each stride must step past all
 * that the smaller dims cover.  0 when it holds; 1 when it does not, with
 * the dim whose stride falls short in *dim and the elements the smaller
 * dims cover in *covered (-1 when that count is past INT64_MAX), either
 * pointer may be NULL; MLART_EINVAL for a NULL view or a bad ndim. */
MLART_API int mlart_tensor_self_overlap(const mlart_tensor *t, int *dim, int64_t *covered);
/* Validate a view: ndim, dtype, non-negative shape and strides, and the span
 * inside [base, base + extent).  On failure the message names `name`, the
 * span and the extent.  Returns 0, MLART_EINVAL or MLART_ELAYOUT. */
MLART_API int mlart_tensor_check(const mlart_tensor *t, const char *name);
/* 1 when the view is dense row-major (strides match its shape), else 0
 * (also for a shape of more elements than int64_t counts). */
MLART_API int mlart_tensor_is_dense(const mlart_tensor *t);

/* ---- model geometry --------------------------------------------------- */

typedef enum mlart_kv_format {
    MLART_KV_BF16 = 0,       /* L+R bf16 values per token (1152 B at 512+64) */
    MLART_KV_FP8_DS_MLA = 1  /* L e4m3, L/128 fp32 pow2 scales, R bf16 (656 B) */
} mlart_kv_format;
#define MLART_KV_FORMAT_BIT(f) (1u << (unsigned)(f))

/* "bf16" / "fp8_ds_mla"; parse returns MLART_EINVAL on anything else. */
MLART_API const char *mlart_kv_format_name(mlart_kv_format f);
MLART_API int mlart_kv_format_parse(const char *s, mlart_kv_format *out);

typedef struct mlart_geometry {
    int32_t heads;      /* H: heads on this rank */
    int32_t qk_nope;    /* P */
    int32_t rope;       /* R */
    int32_t kv_lora;    /* L */
    int32_t v_head;     /* V */
    int32_t topk;       /* index slots per query token */
    int32_t page_size;  /* tokens per cache block */
    mlart_kv_format kv_format;
    float softmax_scale;
} mlart_geometry;

/* Check every field (positive sizes, fp8 needs L % 128 == 0, finite scale > 0). */
MLART_API int mlart_geometry_check(const mlart_geometry *g);
/* Bytes of one cached token in the geometry's format (0 if invalid). */
MLART_API size_t mlart_kv_bytes_per_token(const mlart_geometry *g);

/* Views of W_UK_T [H,P,L] and W_UV [H,L,V] inside a checkpoint-style
 * kv_b_proj [H*(P+V), L] (per head: P rows of W_UK, then V rows of W_UV).
 * No copy: the views are strided; a layer replaces them by dense copies when
 * its backend's contract asks for dense weights. */
MLART_API int mlart_weights_from_kv_b_proj(const mlart_geometry *g, const mlart_tensor *kv_b_proj,
                                           mlart_tensor *w_uk_t, mlart_tensor *w_uv);

/* ---- context ---------------------------------------------------------- */

typedef struct mlart_context mlart_context;

/* Number of usable CUDA devices; 0 (and success) on a machine without a
 * driver or device, or a build without CUDA. */
MLART_API int mlart_cuda_device_count(int *count);
/* device = -1: host (CPU).  device >= 0: that CUDA ordinal (MLART_ENODEV if
 * absent). */
MLART_API int mlart_context_create(int device, mlart_context **out);
MLART_API void mlart_context_destroy(mlart_context *ctx);
MLART_API int mlart_context_device(const mlart_context *ctx);

/* ---- backends --------------------------------------------------------- */

struct mlart_backend_vtable; /* include/mlart/backend.h */

/* Find backend `name` (letters, digits, '_', '-'): the built-ins first, then
 * libmlart-backend-<name>.so in each directory of the colon-separated
 * MLART_BACKEND_PATH, entered through mlart_backend_entry_v1.  A loaded module
 * stays loaded for the life of the process.  MLART_ENOBACKEND when no such
 * backend exists (the message lists where it looked); MLART_EABI for a module
 * that is not a usable v1 backend (other major ABI, struct_size too small,
 * missing symbol or required slot, name mismatch), with the reason.  Safe
 * from several threads; a module's constructors and entry point may look up
 * only built-ins (another module: MLART_EABI; do it in create()). */
MLART_API int mlart_backend_lookup(const char *name, const struct mlart_backend_vtable **out);
/* NULL-terminated list of the built-in backend names (static storage). */
MLART_API const char *const *mlart_backend_builtins(void);

/* ---- layer ------------------------------------------------------------ */

struct mlart_layout_contract; /* include/mlart/backend.h */
struct mlart_comm;            /* include/mlart/comm.h */
typedef struct mlart_layer mlart_layer;

/* How the ranks of a DCP group bring each head's partial outputs together. */
typedef enum mlart_dcp_routing {
    MLART_DCP_AG_RS = 0, /* all-gather the LSEs, scale the partials, reduce-scatter (f32) heads */
    MLART_DCP_A2A = 1    /* all-to-all partials (bf16) + LSEs, combine locally */
} mlart_dcp_routing;

typedef struct mlart_layer_desc {
    mlart_geometry geom;
    const char *backend;        /* NULL: "b12x_mla_sparse" on CUDA, "reference" on host */
    int32_t max_tokens;         /* largest T of a step (largest graph bucket) */
    int32_t max_requests;       /* largest B of a step */
    int32_t max_blocks_per_req; /* columns of the block table */
    int64_t num_slots;          /* cache rows (tokens) */
    mlart_tensor w_uk_t;        /* [H,P,L] bf16, any strides, on the context's device */
    mlart_tensor w_uv;          /* [H,L,V] bf16, any strides, on the context's device */
    mlart_tensor kv_cache;      /* u8 [num_slots, mlart_kv_bytes_per_token], dense; no byte
                                   shared with the weights (MLART_ELAYOUT) */
    int validate_indices;       /* CUDA: copy indices to host and check them before each
                                   step (not graph-safe; for debugging). Host: always on.
                                   With dcp, also makes the ranks agree on the step first
                                   (below). */
    int early_weights;          /* CUDA: 1 = the caller promises that no kernel it enqueues
                                   writes w_uk_t or w_uv while the layer lives.  A step's
                                   first kernel (the query absorption) then launches with
                                   programmatic dependent launch: it may start while the
                                   caller's previous kernel on the stream ends and read its
                                   weights then (it reads q only after that kernel).
                                   0: it starts after that kernel. */
    /* Decode-context parallel (docs/dcp.md).  NULL: none.  A communicator of
     * D ranks: kv_cache, num_slots, block_table and the
     * cache writes hold this rank's shard of each request (logical position
     * p lives on rank mlart_dcp_owner(p, D, dcp_interleave) at position
     * mlart_dcp_local_pos(p, D, dcp_interleave) of the shard), while idx and
     * seq_lens stay global (positions in the whole sequence).  Every rank of
     * the group calls mlart_layer_decode with the same T, B, idx,
     * req_of_token and seq_lens, each with its own q (its H heads); over a
     * local communicator a step whose T differs between ranks fails on
     * every rank with MLART_ECOMM, over NCCL it is undefined.  With
     * validate_indices (always on the host) the ranks first all-gather T, B,
     * a hash of each of those arrays and the result of their own index
     * checks (one collective of 48 bytes a rank), over either communicator:
     * a step where they differ, or that one rank refuses, fails on every
     * rank with MLART_ECOMM naming the rank (the refusing rank returns its
     * own error), before any collective whose size depends on them.  A step
     * all-gathers the D ranks' absorbed queries, attends all D*H heads over
     * the local shard, brings each head's D partial outputs and LSEs to the
     * head's rank by dcp_routing and combines them there.  The comm's device
     * must be the context's; the backend must give head-major output.  With
     * a local communicator a step synchronises its stream (not capturable).
     * D = 1 runs the same path (every position on the one rank), giving the
     * plain step's bytes; it exists for tests of the path on one device.
     * The communicator must outlive the layer. */
    struct mlart_comm *dcp;
    int32_t dcp_interleave;         /* tokens per round-robin turn; 0 = 1 */
    mlart_dcp_routing dcp_routing;
} mlart_layer_desc;

/* One decode step: T query tokens from B requests. */
typedef struct mlart_step_io {
    int32_t T, B;
    mlart_tensor q;            /* [T,H,P+R] bf16 (rope applied to the last R); inner stride 1 */
    mlart_tensor idx;          /* [T,topk] i32 logical positions, -1 = empty; dense */
    mlart_tensor req_of_token; /* [T] i32, request of each token, in [0,B); dense */
    mlart_tensor seq_lens;     /* [B] i32; dense */
    mlart_tensor block_table;  /* [B,max_blocks_per_req] i32; dense (a strided view of these
                                  four is MLART_ELAYOUT) */
    mlart_tensor o;            /* out [T,H*V] bf16, inner stride 1, rows apart */
    mlart_tensor lse;          /* optional out [H,T] f32, natural log; data == NULL: not wanted;
                                  inner stride 1, rows apart, no byte shared with o */
} mlart_step_io;

/* Bind a layer to a backend, enforce the backend's layout contract (dense
 * weights copied once here when given strided; compliant ones keep their
 * address), plan and allocate every buffer for the largest step.
 * MLART_ERANGE when the dimensions would make a buffer past 2^63 bytes. */
MLART_API int mlart_layer_create(mlart_context *ctx, const mlart_layer_desc *desc,
                                 mlart_layer **out);
MLART_API void mlart_layer_destroy(mlart_layer *layer);
/* Run one decode step on `stream` (cudaStream_t, or NULL).  On CUDA this
 * neither allocates nor synchronises and may be captured in a CUDA graph
 * (unless validate_indices is set).  A step repeated gives the same bytes.
 * A backend may choose its kernels by the step's token count T, and then a
 * token's output in a step of another T differs in low-order bits: the
 * reference backend computes each token by itself; b12x_mla_sparse does not
 * (16 heads, top-k 2048: NMSE 1.2e-5 to 1.4e-5 between steps of 1..32 and
 * 64 tokens; docs/serve.md).  Every view is checked before anything runs:
 * a refused step leaves o and lse untouched.  MLART_ELAYOUT, naming both,
 * when o or lse (if given) may share a byte with the other or with anything
 * the step reads: q, idx, req_of_token, seq_lens, block_table, the layer's
 * kv_cache, or the weights it reads (mlart_layer_weights); the test is
 * mlart_tensor_overlap's, so the rows of o and q may interleave in one
 * buffer. */
MLART_API int mlart_layer_decode(mlart_layer *layer, const mlart_step_io *io, void *stream);
/* Write N new tokens' latent+rope rows [N,L+R] bf16 into cache slots [N]
 * (i32 physical slot = block*page + offset, -1 = skip), quantising to the
 * layer's format; where two rows name one slot the later one wins.  On
 * CUDA, up to 1024 rows (fp8_ds_mla: 2048) its kernel launches with
 * programmatic dependent launch: it may start while the previous kernel
 * on the stream ends, and touches memory only after that kernel and its
 * writes are complete.  More rows (a prefill chunk, a cache fill) take a
 * cooperative kernel, launched plainly, whose time grows linearly with N;
 * where the device does not allow a cooperative launch of that size (its
 * attribute, or a share of it as under MPS, outside a graph capture) they
 * take the first kernel too, whose time grows with N squared.  Neither
 * allocates or synchronises; both may be captured in a graph. */
MLART_API int mlart_layer_write_kv(mlart_layer *layer, const mlart_tensor *latent,
                                   const mlart_tensor *slots, void *stream);
MLART_API const char *mlart_layer_backend_name(const mlart_layer *layer);
MLART_API const struct mlart_layout_contract *mlart_layer_contract(const mlart_layer *layer);
/* The weights the backend actually sees (after contract enforcement). */
MLART_API int mlart_layer_weights(const mlart_layer *layer, mlart_tensor *w_uk_t,
                                  mlart_tensor *w_uv);

#ifdef __cplusplus
}
#endif
#endif /* MLART_MLART_H */
