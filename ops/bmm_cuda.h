/* Internal: the batched BF16 product shared by the query absorption and the
 * V up-projection, c[h,t,n] = sum_k a[h,t,k] * w[h,k,n] (FP32 accumulate,
 * BF16 round-to-nearest-even out), with an optional copy of a [T,H,R] side
 * tensor (q_pe) in the same launch.  Every kernel reads only elements of the
 * views and writes only elements of the output views.
 *
 * Not part of the public API: ops/query_bmm.cu and ops/v_up_bmm.cu call it
 * after their *_check, and mlart-bench calls it with explicit configs to
 * compare kernel variants. */
#ifndef MLART_OPS_BMM_CUDA_H
#define MLART_OPS_BMM_CUDA_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mlart_bmm_desc {
    int64_t H, T, K, N;
    const void *a; /* a[h,t,k] at a + h*a_sh + t*a_st + k (elements, bf16) */
    int64_t a_sh, a_st;
    const void *w; /* w[h,k,n] at w + h*w_sh + k*w_sk + n */
    int64_t w_sh, w_sk;
    void *c; /* c[h,t,n] at c + h*c_sh + t*c_st + n */
    int64_t c_sh, c_st;
    /* optional side copy pe_out[t,h,r] = pe_in[t,h,r], r < R; pe_in NULL: none */
    const void *pe_in;
    void *pe_out;
    int64_t R, pi_st, pi_sh, po_st, po_sh;
} mlart_bmm_desc;

enum {
    MLART_BMM_AUTO = 0,
    MLART_BMM_GENERIC = 1, /* any sizes and alignments, CUDA cores, slow */
    MLART_BMM_STREAM = 2,  /* decode: W streamed once through registers, mma.sync */
    MLART_BMM_TILED = 3,   /* larger T: 64 or 128 x 128 shared-memory tiles, cp.async + mma.sync */
    MLART_BMM_PSTREAM = 4, /* decode: STREAM on a persistent grid that prefetches its next item */
    MLART_BMM_DIRECT = 5,  /* decode: W and a straight into registers, no shared-memory staging */
    MLART_BMM_WGMMA = 6,   /* prefill (sm_90a): persistent wgmma, weight slice resident in shared memory (K <= 192, or 512) */
    MLART_BMM_RING = 7,    /* decode (sm_90a): wgmma per (head, row tile, slice) item through a ring of stages */
    MLART_BMM_SWAP = 8,    /* decode (sm_90a): weights streamed by the TMA as wgmma's A operand, tokens as N */
    MLART_BMM_SLICE = 9    /* decode, T <= 16, K 128, 192 or 512: a block per (head, 64 columns), weights by cp.async */
};

typedef struct mlart_bmm_config {
    int path;  /* MLART_BMM_*; AUTO picks by shape and alignment */
    int mt;    /* STREAM: 16-row tiles per block (1..4; PSTREAM 1..2), 0 = auto */
    int warps; /* (P)STREAM: warps splitting K (must divide K/16; PSTREAM: <= 4 steps each), 0 = auto */
    int bm;    /* TILED: rows per tile, 64 or 128, 0 = auto */
    /* DIRECT: `warps` split K (1, 2, 4, 8), `mt` 16-row tiles per warp
     * (loop, >= 1), `cols` columns per warp (16, 32 or 64), `groups` column
     * groups per block; 0 = auto for each; `bm` 1 stages the block's rows
     * of a in shared memory (else each warp loads its own fragments) */
    int cols;
    int groups;
    /* WGMMA: `mt` row-tile chunks per (head, column slice), 0 = auto;
     * `warps` warpgroups per block (1 or 2, 0 = 2); `cols` columns per
     * slice (128 or 256, 0 = 256).  At K = 512 (the V up-projection):
     * two warpgroups (`warps` 0 or 2) and a TMA-fed ring of K blocks,
     * `cols` 64 or 128 (0 = 128), no q_pe copy */
    /* RING: `cols` columns per slice (64 or 128, 0 = 128); `mt` stages of
     * the ring (1, 2, 3, 4 or 6; 0 = as many as fit); `groups` blocks an
     * SM (1 to 4, 0 = 1); `warps` 1: one item a block, its K blocks in
     * copy groups of their own (`mt` and `groups` then unused), 2: the
     * same with the two halves of K summed apart and added at the end,
     * as the direct kernel sums with two warps splitting K (`cols` 64
     * only), 0: the ring */
    /* SWAP: `cols` columns a block (64, 128, 256 or 512, 0 = 256); `mt`
     * token rows a tile (8, 16 or 64, not 64 with 512 columns; 0 = 8 up to
     * T = 8, else 16) */
    /* SLICE: `warps` chains of K summed at the end (1 or 2, and 4 at
     * K = 512; 0 = as the kernel the other launch of the shape takes, so
     * the bytes agree, and 2 at K = 512); `cols` columns a block (64, or
     * 32 at K = 512 with 2 or 4 chains; 0 = 64) */
    /* DIRECT, RING, SWAP and SLICE: 1 launches with programmatic dependent
     * launch (the direct kernel issues its weight loads, the slice kernel
     * its weight copies and the swap kernel the weights of its first
     * stages, then wait for the previous kernel of
     * the stream before they read `a` or write, so the weights must not be
     * written by that kernel; the ring waits before any load); 0 (default)
     * a plain launch.  Either way the kernel lets the next kernel of the
     * stream start once it is past that wait.  Also honoured with path
     * AUTO when it picks DIRECT, RING, SWAP or SLICE. */
    int pdl;
} mlart_bmm_config;

/* Launch on `stream` (cudaStream_t).  cfg NULL = auto.  Returns 0,
 * MLART_ENOTSUP when a forced path cannot serve the shape or alignment, or
 * MLART_ECUDA with the detail set.  Describes nothing itself: callers have
 * validated the views. */
int mlart_bmm_cuda_run(const mlart_bmm_desc *d, const mlart_bmm_config *cfg, void *stream);

/* The path AUTO (or cfg) would take for d, without launching; < 0 if none. */
int mlart_bmm_cuda_path(const mlart_bmm_desc *d, const mlart_bmm_config *cfg);

/* Whether mlart_query_bmm_cuda_pdl launches the query absorption of H heads,
 * T token rows, K = P and N = L with programmatic dependent launch, given
 * the path the automatic choice takes (mlart_bmm_cuda_path): not where the
 * direct or the slice kernel would load more than 4 MiB of weights before
 * its wait (the automatic choice takes the slice kernel with PDL only
 * below that), nor
 * at 64-127 heads with P = 192 and 33-64 rows (both measured slower than
 * the plain launch in the layer step; docs/ops.md, "PDL entry for the
 * query absorption").  The path matters only above
 * MLART_QUERY_PDL_DIRECT_MAX bytes of weights, so a caller may pass
 * MLART_BMM_AUTO below that and skip working it out.  Host code, checked
 * without a device by test_ref_ops. */
#define MLART_QUERY_PDL_DIRECT_MAX ((int64_t)4 << 20)
static inline int mlart_query_pdl_launch(int64_t H, int64_t T, int64_t K, int64_t N, int path)
{
    if ((path == MLART_BMM_DIRECT || path == MLART_BMM_SLICE) && H * K * N * 2 > MLART_QUERY_PDL_DIRECT_MAX)
        return 0;
    if (K == 192 && H >= 64 && H < 128 && T > 32 && T <= 64)
        return 0;
    return 1;
}

/* WGMMA path (ops/query_bmm_wgmma.cu), used by the launcher above: whether
 * it serves d with nwg warpgroups a block and bn-column slices (0 = the
 * defaults, 2 and 256), and the launch (splits 0 = auto; returns a
 * cudaError_t). */
int mlart_bmm_wgmma_ok(const mlart_bmm_desc *d, int nwg, int bn);
int mlart_bmm_wgmma_run(const mlart_bmm_desc *d, int splits, int nwg, int bn, void *stream);

/* RING path (same file): whether it serves d with bn-column slices, that
 * many stages and blocks an SM (0 = defaults), and the launch (`one` 1:
 * the one-item form, 2: the same with K in two halves (bn 64), stages and
 * blocks an SM ignored; pdl as in mlart_bmm_config; returns a
 * cudaError_t). */
int mlart_bmm_ring_ok(const mlart_bmm_desc *d, int bn, int stages, int per_sm);
int mlart_bmm_ring_run(const mlart_bmm_desc *d, int bn, int stages, int per_sm, int one, int pdl, void *stream);

/* SWAP path (same file): whether it serves d with bm columns a block and nt
 * token rows a tile (0 = defaults), and the launch (returns a cudaError_t). */
int mlart_bmm_swap_ok(const mlart_bmm_desc *d, int bm, int nt);
int mlart_bmm_swap_run(const mlart_bmm_desc *d, int bm, int nt, int pdl, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* MLART_OPS_BMM_CUDA_H */
