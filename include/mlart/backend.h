/* mlart backend plugin ABI: what an attention backend module includes.
 *
 * A backend is a versioned table of function pointers plus a layout contract.
 * A module (libmlart-backend-<name>.so) exports exactly one symbol,
 * mlart_backend_entry_v1, returning its table.  The runtime — never the
 * backend — enforces the contract: it validates every view at plan time,
 * materialises what the contract asks to be materialised, and refuses what
 * cannot be satisfied.  The table is append-only: new slots go at the end,
 * struct_size tells the runtime which slots exist, and _Static_asserts below
 * pin the offset of the last slot of each ABI version.
 *
 * A backend needs no symbol from libmlart: errors and logs go through the
 * callbacks in mlart_backend_init.
 */
#ifndef MLART_BACKEND_H
#define MLART_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "mlart/mlart.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MLART_BACKEND_ABI_VERSION 1u

/* How the query absorption q_nope[H,T,P] x W_UK_T[H,P,L] gets its operand. */
enum {
    MLART_QBMM_SAFE_OP = 1,    /* strided q_nope view (strides P+R, H*(P+R), 1) passed as is */
    MLART_QBMM_CONTIGUOUS = 2  /* runtime copies q_nope into a dense [H,T,P] buffer first */
};
/* Weight layout. */
enum {
    MLART_W_DENSE = 1 /* W_UK_T dense [H,P,L], W_UV dense [H,L,V]; strided ones are replaced */
};
/* Layout of the attention output handed to v_up. */
enum {
    MLART_OUT_HEAD_MAJOR = 1, /* [H,T,L] */
    MLART_OUT_TOKEN_MAJOR = 2 /* [T,H,L] */
};
/* Devices a backend runs on (bitmask). */
enum {
    MLART_DEV_HOST = 1u << 0,
    MLART_DEV_CUDA = 1u << 1
};

/* 1 when two geometries are field for field the same: a backend's plan()
 * and steps must carry the geometry it was created with (header-only, so a
 * backend module needs no symbol for it). */
static inline int mlart_geometry_same(const mlart_geometry *a, const mlart_geometry *b)
{
    return a->heads == b->heads && a->qk_nope == b->qk_nope && a->rope == b->rope &&
           a->kv_lora == b->kv_lora && a->v_head == b->v_head && a->topk == b->topk &&
           a->page_size == b->page_size && a->kv_format == b->kv_format &&
           a->softmax_scale == b->softmax_scale;
}

typedef struct mlart_layout_contract {
    uint32_t query_bmm;  /* MLART_QBMM_* */
    uint32_t weights;    /* MLART_W_* */
    uint32_t output;     /* MLART_OUT_* */
    uint32_t kv_formats; /* bitmask of MLART_KV_FORMAT_BIT(format) */
    uint32_t max_heads;  /* 0 = no limit */
    uint32_t head_multiple; /* heads must be a multiple of this (1 = any) */
    uint32_t max_topk;   /* 0 = no limit */
    size_t tail_pad;     /* readable bytes needed past every input span (0 for safe kernels) */
    uint32_t graph_safe; /* 1: absorb_query/attend/v_up may be captured in a CUDA graph */
    uint32_t devices;    /* MLART_DEV_* bitmask */
} mlart_layout_contract;

/* Host callbacks handed to a backend.  error() records the detail for
 * mlart_last_error() and returns `status`, so `return init->error(...)` works.
 * A negative status returned without it is reported by the layer as
 * "backend 'NAME': CALL returned STATUS without a detail". */
typedef int (*mlart_error_fn)(int status, const char *fmt, ...);
typedef void (*mlart_log_fn)(int level, const char *fmt, ...);
enum { MLART_LOG_DEBUG = 0, MLART_LOG_INFO = 1, MLART_LOG_WARN = 2, MLART_LOG_ERROR = 3 };

typedef struct mlart_backend_init {
    uint32_t struct_size;
    int device;            /* -1 host, else CUDA ordinal (already current) */
    mlart_geometry geom;
    mlart_error_fn error;
    mlart_log_fn log;
} mlart_backend_init;

/* Largest step the backend must serve; plan() sizes its workspace for it. */
typedef struct mlart_plan {
    uint32_t struct_size;
    mlart_geometry geom;
    int device;
    int32_t max_tokens;
    int32_t max_requests;
    int32_t max_blocks_per_req;
    int64_t num_slots;
} mlart_plan;

/* Everything one step reads and writes.  All views are validated by the
 * runtime before the call; pointers live on `device`. */
typedef struct mlart_step {
    uint32_t struct_size;
    mlart_geometry geom;
    int device;
    int32_t T, B;
    mlart_tensor q_nope;   /* [H,T,P] bf16: strided view of q (SAFE_OP) or dense copy (CONTIGUOUS) */
    mlart_tensor q_pe;     /* [T,H,R] bf16 view of q */
    mlart_tensor w_uk_t;   /* [H,P,L] bf16 dense */
    mlart_tensor w_uv;     /* [H,L,V] bf16 dense */
    mlart_tensor q_mqa;    /* [T,H,L+R] bf16: absorb_query writes [..,0:L) and copies q_pe to [..,L:L+R) */
    mlart_tensor kv_cache; /* u8 [num_slots, bytes_per_token] */
    mlart_tensor idx;      /* [T,topk] i32, -1 = empty */
    mlart_tensor req_of_token; /* [T] i32 */
    mlart_tensor seq_lens;     /* [B] i32 */
    mlart_tensor block_table;  /* [B,max_blocks] i32 */
    mlart_tensor attn_out; /* [H,T,L] or [T,H,L] bf16 per contract.output */
    mlart_tensor lse;      /* [H,T] f32 natural log; -inf for a row with no valid slot */
    mlart_tensor o;        /* [T,H*V] bf16 */
    void *workspace;       /* plan()'s bytes, owned by the runtime */
    size_t workspace_bytes;
} mlart_step;

typedef struct mlart_backend_vtable {
    uint32_t abi_version; /* MLART_BACKEND_ABI_VERSION; the loader rejects another major */
    uint32_t struct_size; /* sizeof the table the backend was built with */
    const char *name;
    mlart_layout_contract contract;
    int (*create)(const mlart_backend_init *init, void **state);
    void (*destroy)(void *state); /* accepts NULL */
    int (*plan)(void *state, const mlart_plan *plan, size_t *workspace_bytes);
    /* q_nope x W_UK_T into q_mqa[..,0:L), q_pe into q_mqa[..,L:L+R).  NULL: runtime op. */
    int (*absorb_query)(void *state, const mlart_step *s, void *stream);
    /* sparse attention: q_mqa, cache, idx -> attn_out, lse.  Required.  The
     * runtime calls it on the stream right after the query absorption
     * (absorb_query or its own op, whose kernels let dependents start only
     * once past their own griddepcontrol.wait; in a DCP step, after the
     * kernel that gathers the group's queries or the all-gather, launched
     * plainly, so everything before them has finished when they start): a
     * kernel launched with programmatic dependent launch may read the
     * step's other inputs (cache, idx, block table, lengths) before its
     * wait, q_mqa only after it.  Its
     * last kernel may let the next kernel of the stream start before its own
     * kernels have finished (b12x_mla_sparse does at <= 16 heads): a kernel
     * launched after attend() with programmatic dependent launch reads
     * attn_out, lse and the workspace only after its griddepcontrol.wait.
     * The runtime's V up-projection (v_up NULL) is launched that way and
     * reads W_UV before its wait: attend() must not write the weights. */
    int (*attend)(void *state, const mlart_step *s, void *stream);
    /* attn_out x W_UV -> o.  NULL: runtime op. */
    int (*v_up)(void *state, const mlart_step *s, void *stream);
    /* append-only below this line */
} mlart_backend_vtable;

/* Offset of the last slot of ABI v1: a table at least this large plus one
 * pointer holds every v1 slot. */
#define MLART_BACKEND_VTABLE_V1_SIZE (offsetof(mlart_backend_vtable, v_up) + sizeof(void *))
#ifndef __cplusplus
/* ABI v1 on LP64: pinned, so a slot inserted mid-table fails the build. */
_Static_assert(sizeof(mlart_layout_contract) == 48, "layout contract changed size");
_Static_assert(sizeof(void *) != 8 || offsetof(mlart_backend_vtable, create) == 64, "create slot moved");
_Static_assert(sizeof(void *) != 8 || offsetof(mlart_backend_vtable, v_up) == 104,
               "v1 slots moved: the vtable is append-only");
_Static_assert(sizeof(void *) != 8 || sizeof(mlart_backend_vtable) == 112, "append slots at the end only");
#endif

/* The one symbol a backend module exports. */
typedef const mlart_backend_vtable *(*mlart_backend_entry_v1_fn)(void);
#define MLART_BACKEND_ENTRY_V1_SYMBOL "mlart_backend_entry_v1"

#ifdef __cplusplus
}
#endif
#endif /* MLART_BACKEND_H */
