/* What the two b12x kernel files share (b12x_attend.cu: the mma.sync
 * kernels and the combine; b12x_wgmma.cu: the wgmma kernel): the launch
 * arguments, filled from a step, the resolution of a chunk's indices to
 * physical cache slots, and small device helpers (bf16 packing, the fp8
 * dequantisation, whole-sector row stores).  CUDA C++; nothing outside
 * this folder includes it. */
#ifndef MLART_BACKENDS_B12X_COMMON_CUH
#define MLART_BACKENDS_B12X_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "backends/b12x_mla_sparse/b12x_attend.h"

namespace b12x {

constexpr float LOG2E = 1.44269504088896340736f;

/* One launch of a b12x kernel (passed by value). */
struct AttendArgs {
    const __nv_bfloat16 *q;
    int64_t q_st, q_sh;
    const uint8_t *kv;
    int64_t kv_row, num_slots;
    const int32_t *idx;
    int64_t idx_st, idx_sk;
    const int32_t *req;
    int64_t req_s;
    const int32_t *seq;
    int64_t seq_s;
    const int32_t *bt;
    int64_t bt_sb, bt_sk, max_blocks;
    __nv_bfloat16 *out;
    int64_t o_sh, o_st;
    float *lse;
    int64_t l_sh, l_st;
    __nv_bfloat16 *ws_o; /* [splits][T][H][512] when splits > 1 */
    float *ws_lse;       /* [splits][T][H] */
    int T, H, B, topk, page;
    int tile_base;        /* first head tile of this launch */
    int splits;
    int chunk_blocks, chunk_extra; /* chunk c owns chunk_blocks + (c < chunk_extra) blocks (set_splits) */
    float scale_log2;     /* softmax scale * log2(e) */
    unsigned *bar;        /* barriers of the in-place combine (its kernel instantiations), else NULL */
};

/* Slots per pipeline block, in every kernel: the split model, the chunks
 * and the partials count in these blocks. */
constexpr int BLOCK_SLOTS = 32;

/* What one thread block owns: token t, head rows [h0, h0 + rows) of its
 * tile (tiles of `tile` heads from a.tile_base, at most max_rows rows),
 * and chunk `split` of the top-k list: its nblk blocks of 32 indices are
 * the list's blocks split, split + splits, split + 2 splits, ... (block b
 * holds indices [32 b, 32 b + 32) below top-k).  Interleaved rather than
 * one run of the list: an indexer pads a request shorter than top-k with
 * -1s at the end of its list, and in runs its valid entries would all
 * fall to the first chunks while the others compute nothing; interleaved,
 * every chunk takes its share of them and compacts the rest away
 * (resolve_slots).  The host's split (b12x_split: splits x
 * blocks_per_split covers the list's blocks and splits - 1 of them do
 * not) gives each chunk at most blocks_per_split blocks (what its shared
 * memory holds) and at least one. */
struct Chunk {
    int t, h0, rows, split, nblk;
};

__device__ __forceinline__ Chunk chunk_of(const AttendArgs &a, int tile, int max_rows)
{
    Chunk c;
    c.t = blockIdx.x;
    c.h0 = (a.tile_base + (int)blockIdx.y) * tile;
    c.rows = min(max_rows, a.H - c.h0);
    c.split = blockIdx.z;
    c.nblk = a.chunk_blocks + (c.split < a.chunk_extra);
    return c;
}

/* The split of a launch into `splits` chunks, interleaved (Chunk): the
 * list's blocks over the chunks, counted here so that no kernel divides. */
inline void set_splits(AttendArgs *a, int splits)
{
    const int nb = (a->topk + BLOCK_SLOTS - 1) / BLOCK_SLOTS;
    a->splits = splits;
    a->chunk_blocks = nb / splits;
    a->chunk_extra = nb % splits;
}

/* Every field that comes from the step; the caller sets the split, the
 * tile base and the workspace pointers. */
inline void args_from_step(AttendArgs *a, const mlart_step *s)
{
    const mlart_geometry *g = &s->geom;
    const mlart_tensor *q = &s->q_mqa, *kv = &s->kv_cache, *out = &s->attn_out;
    a->q = (const __nv_bfloat16 *)q->data;
    a->q_st = q->stride[0];
    a->q_sh = q->stride[1];
    a->kv = (const uint8_t *)kv->data;
    a->kv_row = kv->stride[0];
    a->num_slots = kv->shape[0];
    a->idx = (const int32_t *)s->idx.data;
    a->idx_st = s->idx.stride[0];
    a->idx_sk = s->idx.stride[1];
    a->req = (const int32_t *)s->req_of_token.data;
    a->req_s = s->req_of_token.stride[0];
    a->seq = (const int32_t *)s->seq_lens.data;
    a->seq_s = s->seq_lens.stride[0];
    a->bt = (const int32_t *)s->block_table.data;
    a->bt_sb = s->block_table.stride[0];
    a->bt_sk = s->block_table.stride[1];
    a->max_blocks = s->block_table.shape[1];
    a->out = (__nv_bfloat16 *)out->data;
    a->o_sh = out->stride[0];
    a->o_st = out->stride[1];
    a->lse = (float *)s->lse.data;
    a->l_sh = s->lse.stride[0];
    a->l_st = s->lse.stride[1];
    a->ws_o = NULL;
    a->ws_lse = NULL;
    a->bar = NULL;
    a->T = s->T;
    a->H = g->heads;
    a->B = s->B;
    a->topk = g->topk;
    a->page = g->page_size;
    a->tile_base = 0;
    set_splits(a, 1);
    a->scale_log2 = g->softmax_scale * LOG2E; /* exp2 units */
}

/* Shared-memory address and the cp.async / store forms both use.  The
 * "memory" clobbers keep the compiler from moving shared-memory accesses
 * across a wait or a store it cannot see. */
__device__ __forceinline__ uint32_t smem_u32(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* Named barriers (bar.sync waits, bar.arrive signals; n threads take
 * part) and programmatic dependent launch: wait for the previous grid and
 * its memory, and let the next one start. */
__device__ __forceinline__ void bar_sync(int id, int n)
{
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

__device__ __forceinline__ void bar_arrive(int id, int n)
{
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

__device__ __forceinline__ void grid_dep_wait()
{
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

__device__ __forceinline__ void grid_dep_launch()
{
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit()
{
    asm volatile("cp.async.commit_group;\n" ::);
}

template <int N> __device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void st_shared16(uint32_t addr, uint4 v)
{
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w)
                 : "memory");
}

/* bf16x2 packing and unpacking (low half first), and two e4m3 values (low
 * byte first) times a power-of-two scale as bf16x2: exact, since e4m3 has
 * 3 mantissa bits and bf16 has 7. */
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

__device__ __forceinline__ float bf16_lo(uint32_t v)
{
    return __uint_as_float(v << 16);
}

__device__ __forceinline__ float bf16_hi(uint32_t v)
{
    return __uint_as_float(v & 0xffff0000u);
}

/* 1/x, approximate (MUFU.RCP, within 1 ulp of fp32; no branch to a slow
 * path, unlike an IEEE division): for a softmax row sum (>= 1 where it is
 * used) before bf16 rounding.  The IEEE division's branchy sequence sat on
 * the small-head kernels' tail. */
__device__ __forceinline__ float rcp_approx(float x)
{
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* One row's 16-column group of bf16 output (or split-k partial) from the
 * mma fragment layout: lane q (lane % 4) of the four lanes that share the
 * row holds pairs lo = columns 2q, 2q + 1 and hi = 2q + 8, 2q + 9.  Lanes
 * q and q ^ 1 trade one pair (even lanes keep lo, odd lanes hi), so each
 * lane holds four consecutive columns and the four write the group's 32
 * bytes as one whole sector, 8 bytes a lane (one pair a lane, half
 * sectors, was slower: docs/attention.md).  Every lane of the warp calls
 * it (a full-warp shuffle); a row's lanes store only when `store`. */
__device__ __forceinline__ void store_row16(__nv_bfloat16 *group, uint32_t lo, uint32_t hi, bool store)
{
    const int q = threadIdx.x & 3;
    const bool odd = (q & 1) != 0;
    const uint32_t recv = __shfl_xor_sync(0xffffffffu, odd ? lo : hi, 1);
    if (store)
        *reinterpret_cast<uint2 *>(group + (odd ? 2 * q + 6 : 2 * q)) =
            odd ? make_uint2(recv, hi) : make_uint2(lo, recv);
}

__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t two, float scale)
{
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)two, __NV_E4M3);
    float2 f = __half22float2(*reinterpret_cast<__half2 *>(&h));
    return pack_bf16(f.x * scale, f.y * scale);
}

/* 16 e4m3 values (one 16-byte piece of a record) times their tile's
 * scale as 16 bf16 (two 16-byte pieces, low values first). */
__device__ __forceinline__ void e4m3x16_to_bf16(uint4 x, float scale, uint4 &lo, uint4 &hi)
{
    lo.x = e4m3x2_to_bf16x2(x.x & 0xffff, scale);
    lo.y = e4m3x2_to_bf16x2(x.x >> 16, scale);
    lo.z = e4m3x2_to_bf16x2(x.y & 0xffff, scale);
    lo.w = e4m3x2_to_bf16x2(x.y >> 16, scale);
    hi.x = e4m3x2_to_bf16x2(x.z & 0xffff, scale);
    hi.y = e4m3x2_to_bf16x2(x.z >> 16, scale);
    hi.z = e4m3x2_to_bf16x2(x.w & 0xffff, scale);
    hi.w = e4m3x2_to_bf16x2(x.w >> 16, scale);
}

/* One thread's share of converting fp8_ds_mla record r (of the records at
 * `raw` in shared memory) into a bf16 row in shared memory: e4m3 pieces w, w + 8,
 * w + 16, w + 24 (16 values each, scale tile i for piece w + 8i; each
 * becomes two bf16 pieces) and rope piece w, every load before any
 * conversion so the conversion is not bound by their latency.  off(c) is
 * the byte offset of bf16 piece c (0..71) of the row from `dst`. */
template <class Off>
__device__ __forceinline__ void convert_fp8_pieces(const uint8_t *raw, int r, uint32_t dst, int w, Off off)
{
    constexpr int L = B12X_KV_LORA;
    const uint8_t *rrow = raw + r * (L + 4 * (L / 128) + 2 * B12X_ROPE);
    uint4 v[4];
    float sc[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        v[i] = *reinterpret_cast<const uint4 *>(rrow + (w + 8 * i) * 16);
        sc[i] = *reinterpret_cast<const float *>(rrow + L + 4 * i);
    }
    const uint4 rp = *reinterpret_cast<const uint4 *>(rrow + L + 16 + w * 16);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int c = w + 8 * i;
        uint4 lo, hi;
        e4m3x16_to_bf16(v[i], sc[i], lo, hi);
        st_shared16(dst + off(2 * c), lo);
        st_shared16(dst + off(2 * c + 1), hi);
    }
    st_shared16(dst + off(64 + w), rp);
}

/* Shared scratch of resolve_slots: one int a warp, 32 warps at most. */
constexpr int SCAN_BYTES = 128;

/* bar.red.or over the n threads of named barrier ID (ID 0 with the whole
 * block is __syncthreads_or). */
template <int ID, int N> __device__ __forceinline__ bool bar_red_or(bool p)
{
    uint32_t r;
    asm volatile("{\n\t.reg .pred p, q;\n\t"
                 "setp.ne.u32 p, %1, 0;\n\t"
                 "bar.red.or.pred q, %2, %3, p;\n\t"
                 "selp.u32 %0, 1, 0, q;\n\t}\n"
                 : "=r"(r)
                 : "r"((uint32_t)p), "n"(ID), "n"(N)
                 : "memory");
    return r != 0;
}

/* A value every lane of the warp holds, through a uniform register (the
 * warp reduction's result), so that the compiler knows it is uniform: a
 * loop bound from shared memory or a block barrier otherwise looks
 * divergent to it and costs the loops around wgmma and named barriers
 * their uniform branches. */
__device__ __forceinline__ int uniform(int v)
{
    return (int)__reduce_max_sync(0xffffffffu, (unsigned)v);
}

/* resolve_slots' compaction of a chunk with empty entries: slots[u] is
 * this thread's slot of index tid + u * NT (-1 empty), cnt how many of
 * them are valid, nb the chunk's blocks.  Returns the blocks the valid
 * slots fill (at least 1); rewrites s_slot only when that is fewer, and
 * then meets the other threads once more. */
template <int NT, int ID, int PER>
__device__ __forceinline__ int compact_slots(int32_t *s_slot, int32_t *s_scan, const int (&slots)[PER], int cnt,
                                             int nb)
{
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int incl = cnt;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d)
            incl += v;
    }
    if (lane == 31)
        s_scan[warp] = incl;
    bar_sync(ID, NT);
    int total = 0, pos = incl - cnt;
#pragma unroll
    for (int w = 0; w < NT / 32; w++) {
        const int v = s_scan[w];
        total += v;
        pos += w < warp ? v : 0;
    }
    const int nbc = total > 0 ? (total + BLOCK_SLOTS - 1) / BLOCK_SLOTS : 1;
    if (nbc == nb)
        return nb;
    /* Every in-place store came before the caller's first barrier. */
#pragma unroll
    for (int u = 0; u < PER; u++)
        if (slots[u] >= 0)
            s_slot[pos++] = slots[u];
    for (int k = total + tid; k < nbc * BLOCK_SLOTS; k += NT)
        s_slot[k] = -1;
    bar_sync(ID, NT);
    return nbc;
}

/* Physical slot of every index of chunk `split` (s_slot[k] for the k-th
 * index of its blocks, k < n, n a whole number of blocks: Chunk says which
 * indices), -1 where it selects nothing, by NT
 * threads of the block that meet at named barrier ID (0 when they are the
 * whole block).  Anything out of range reads as empty; the host validates
 * when asked.  The loads are ordered so that only two round trips to
 * memory are dependent: the request and every index of the chunk, then
 * its sequence length and every block-table entry (read for any index in
 * [0, max_blocks * page), the length check comes after).
 *
 * Returns the number of blocks to compute, the same in every lane.  A
 * chunk whose empty entries (-1 indices, positions past the length: a DCP
 * rank's list holds only its share of the slots) would fill at least one
 * whole block is compacted: its valid slots move to the front, thread by
 * thread in thread order and each thread's in index order (the same order
 * every call, so replays give the same bytes), the rest of the last block
 * is -1, and the block count drops to what they fill (at least 1).
 * Otherwise s_slot keeps index order.  The NT threads have met when it
 * returns: s_slot is ready to read.  A chunk of one block, or without
 * empty entries, costs that one barrier (a bar.red) and a warp reduction;
 * s_scan (SCAN_BYTES) must not be written until every thread has
 * returned. */
template <int NT, int ID = 0>
__device__ __forceinline__ int resolve_slots(const AttendArgs &a, int t, int split, int n, int32_t *s_slot,
                                             int32_t *s_scan)
{
    constexpr int PER = B12X_MAX_TOPK / NT;
    static_assert(NT % 32 == 0 && NT / 32 <= SCAN_BYTES / 4, "one scan word a warp");
    const int tid = threadIdx.x;
    const int b = __ldcg(a.req + (int64_t)t * a.req_s);
    int iv[PER];
#pragma unroll
    for (int u = 0; u < PER; u++) {
        const int k = tid + u * NT;
        /* block k / 32 of the chunk is block split + (k / 32) splits of the list */
        const int e = (split + (k / BLOCK_SLOTS) * a.splits) * BLOCK_SLOTS + k % BLOCK_SLOTS;
        iv[u] = k < n && e < a.topk ? __ldcg(a.idx + (int64_t)t * a.idx_st + (int64_t)e * a.idx_sk) : -1;
    }
    const bool b_ok = b >= 0 && b < a.B;
    const int len = b_ok ? __ldcg(a.seq + (int64_t)b * a.seq_s) : 0;
    int pb[PER];
#pragma unroll
    for (int u = 0; u < PER; u++) {
        const int i = iv[u];
        const int blk = i >= 0 ? i / a.page : 0;
        pb[u] = b_ok && i >= 0 && blk < a.max_blocks
                    ? __ldcg(a.bt + (int64_t)b * a.bt_sb + (int64_t)blk * a.bt_sk)
                    : -1;
    }
    bool hole = false;
    int cnt = 0;
#pragma unroll
    for (int u = 0; u < PER; u++) {
        const int k = tid + u * NT;
        const int i = iv[u];
        int slot = -1;
        if (i >= 0 && i < len && pb[u] >= 0) {
            const int64_t phys = (int64_t)pb[u] * a.page + (i - (i / a.page) * a.page);
            if (phys < a.num_slots)
                slot = (int)phys;
        }
        if (k < n)
            s_slot[k] = slot;
        iv[u] = slot;
        hole |= k < n && slot < 0;
        cnt += slot >= 0;
    }
    /* Empty entries anywhere (the last block's tail past top-k counts): a
     * full chunk goes no further. */
    const int nb = n / BLOCK_SLOTS;
    if (nb == 1) {
        bar_sync(ID, NT);
        return 1;
    }
    int nbc = nb;
    if (bar_red_or<ID, NT>(hole))
        nbc = compact_slots<NT, ID>(s_slot, s_scan, iv, cnt, nb);
    return uniform(nbc);
}

/* ---- the in-place combine (docs/attention.md, "In-place combine") -------
 * When the whole grid of a launch is resident at once (the host checks it
 * against b12x_dev), the chunks of a (token, head tile) meet at a barrier
 * after writing their partials, and each then combines its share of the
 * tile's rows: no combine kernel, no second launch.  The barrier is one
 * word of a.bar, 128 bytes apart: index (tile, token) = (tile_base +
 * blockIdx.y) x T + t.  Chunk 0 adds 2^31 - (splits - 1) and every other
 * chunk 1, so the arrivals add exactly 2^31: bit 31 flips when the last
 * one lands and the low bits are back where they started, whatever the
 * count.  A chunk waits until bit 31 differs from what its own atomic
 * returned (a half-counted barrier never flips it: the low bits stay
 * below 2^31).  The words need zeroing only once (setup), and consecutive
 * calls may use different split counts.  `sync` is a barrier of the NT
 * threads that take part; as in a grid-wide barrier, the block barrier,
 * then one thread's acquire-release arrival (atom_add_acq_rel_gpu) and
 * acquiring polls, then the block barrier again.  A wait of more than
 * BARRIER_MAX_POLLS polls faults. */
__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned *p)
{
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n"
                 : "=r"(v)
                 : "l"((unsigned long long)__cvta_generic_to_global(p))
                 : "memory");
    return v;
}

/* A barrier that has not completed after this many polls (each an L2 round
 * trip of at least ~0.3 us: seconds) cannot complete (the grid was not
 * resident at once after all: docs/attention.md): fault, so the launch
 * fails with an error instead of hanging the stream. */
constexpr unsigned BARRIER_MAX_POLLS = 1u << 24;

/* The error: a store to global address 0, which faults (an illegal
 * address, reported by the next synchronising call).  `trap` would do
 * the same, but with it ptxas spilled registers in the kernels' loops. */
__device__ __forceinline__ void barrier_fault()
{
    asm volatile("st.global.u32 [%0], %1;\n" ::"l"(0ull), "r"(0u) : "memory");
}

/* The arrival: an acquire-release add at gpu scope.  Release: the block's
 * partial stores, ordered before thread 0's by the block barrier, are
 * visible to whoever acquires the word after it; acquire: the last chunk
 * to arrive (which does not wait) sees every earlier chunk's.  Measured
 * against __threadfence() before the add and after the wait (fence.sc):
 * 0.2-0.3 us less a barrier (docs/PERF.md, 2026-12-01). */
__device__ __forceinline__ unsigned atom_add_acq_rel_gpu(unsigned *p, unsigned v)
{
    unsigned old;
    asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], %2;\n"
                 : "=r"(old)
                 : "l"((unsigned long long)__cvta_generic_to_global(p)), "r"(v)
                 : "memory");
    return old;
}

template <class Sync>
__device__ __forceinline__ void split_barrier(const AttendArgs &a, int t, int split, int tid, Sync sync)
{
    sync(); /* every thread's partial and LSE stores issued */
    if (tid == 0) {
        unsigned *w = a.bar + 32 * ((a.tile_base + (int)blockIdx.y) * a.T + t);
        const unsigned add = split == 0 ? 0x80000000u - (unsigned)(a.splits - 1) : 1u;
        const unsigned old = atom_add_acq_rel_gpu(w, add);
        if ((((old + add) ^ old) & 0x80000000u) == 0) {
            unsigned polls = 0;
            while (((ld_acquire_gpu(w) ^ old) & 0x80000000u) == 0)
                if (++polls == BARRIER_MAX_POLLS) {
                    barrier_fault();
                    break;
                }
        }
    }
    sync(); /* hands what thread 0 acquired to the block */
}

/* The threads that take one split's units in combine_slice (a group), for
 * n units a block, S splits and NT threads: a power of two from 32 (whole
 * warps, so that each warp reads whole sectors of one partial row) up to
 * NT, as many as cover the units and no more groups than splits. */
__host__ __device__ __forceinline__ int combine_group(int n, int S, int NT)
{
    int L = 32;
    while (L < NT && L < n)
        L <<= 1;
    while (L < NT && NT / L > S)
        L <<= 1;
    return L;
}

/* Dependent round trips to L2 of combine_slice<NT, ZB> for a tile of
 * `rows` head rows cut over S splits, at the block with the most units:
 * the passes of its unit loop times the batches of ZB splits in each. */
__host__ __device__ __forceinline__ int combine_trips(int rows, int S, int NT, int ZB)
{
    const int n = (rows * (B12X_KV_LORA / 4) + S - 1) / S;
    const int L = combine_group(n, S, NT), ng = NT / L;
    const int nz = (S + ng - 1) / ng; /* splits a thread takes of one unit */
    return (n + L - 1) / L * ((nz + ZB - 1) / ZB);
}

/* The ZB of combine_in_kernel<NT, ROWS>: a thread's share of a full tile. */
__host__ __device__ constexpr int combine_zb(int rows_max, int NT)
{
    return (rows_max * B12X_KV_LORA / 4 + NT - 1) / NT;
}

/* Shared memory combine_slice<NT, ...> takes: an accumulator, a maximum
 * and a sum per thread. */
__host__ __device__ constexpr int combine_smem(int NT)
{
    return NT * 6 * 4;
}

/* Chunk `split` of token t combines the columns-of-four units [u0, u1) of
 * the `rows` head rows from h0 (rows x 128 units, cut evenly over the
 * splits): out = sum_z w_z part_z / sum_z w_z, w_z = exp(lse_z - max), as
 * b12x_combine_kernel.  For one split the slice is one contiguous span of
 * the workspace (the rows of a (split, token) are consecutive), so the
 * threads form groups of L (combine_group: whole warps): thread `lane` of
 * a group takes unit u0 + lane (then + L, ... while units remain) and
 * group g every NG-th split from g, ZB at a time with all ZB loads first
 * (from L2: other multiprocessors wrote them) and a running maximum; a
 * warp's loads are 256 contiguous bytes of one partial row, and its LSE
 * loads one word.  The groups then merge through `sm` (combine_smem(NT)
 * bytes of shared memory the block no longer uses), and group 0 writes.
 * With many splits (those the split model takes at small T) a thread has
 * one unit and about rows x 128 / NT of its splits (16 heads: 8, 64: 32:
 * ZB), one round trip to L2; with few splits the block loops over units,
 * one round trip each (combine_trips; the launch takes the in-place path
 * only up to b12x_dev.max_trips, 2 unless MLART_B12X_INPLACE_TRIPS says
 * otherwise).  Every thread of the NT runs the same passes: `sync` is
 * their barrier. */
template <int NT, int ZB, class Sync, class Probe>
__device__ __forceinline__ void combine_slice(const AttendArgs &a, int t, int h0, int rows, int split, int tid,
                                              Sync sync, float *sm, Probe probe)
{
    static_assert(ZB >= 1 && ZB <= 32, "partials a thread holds at once");
    constexpr int KV_L = B12X_KV_LORA, UNITS = KV_L / 4;
    const int S = a.splits, U = rows * UNITS;
    const int u0 = split * U / S, u1 = (split + 1) * U / S;
    const int L = combine_group(u1 - u0, S, NT), NG = NT / L;
    const int g = tid / L, lane = tid - g * L;
    /* Row z T H + t H + h of the workspace; fewer than 2^31 / 512 rows
     * (splits x resident tokens x heads), so 32-bit offsets do. */
    const unsigned zrow = (unsigned)a.T * (unsigned)a.H, row0 = (unsigned)t * (unsigned)a.H + (unsigned)h0;
    const uint2 *wo = reinterpret_cast<const uint2 *>(a.ws_o) + row0 * UNITS;
    const float *wl = a.ws_lse + row0;
    float4 *s_acc = reinterpret_cast<float4 *>(sm);
    float *s_m = sm + 4 * NT, *s_l = sm + 5 * NT;
    for (int base = u0; base < u1; base += L) {
        const int u = base + lane;
        const bool act = u < u1;
        const int ur = act ? u : u0, hr = ur / UNITS;
        float m = -INFINITY, sum = 0.0f;
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int z0 = g; z0 < S; z0 += ZB * NG) {
            /* this round's splits: z0 + i NG for i < nz (a thread's count
             * can be far below ZB when there are few splits) */
            const int nz = min(ZB, (S - z0 + NG - 1) / NG);
            float lz[ZB];
            uint2 v[ZB];
#pragma unroll
            for (int i = 0; i < ZB; i++) {
                lz[i] = -INFINITY;
                v[i] = make_uint2(0, 0);
                if (i >= nz)
                    continue;
                const unsigned z = (unsigned)(z0 + i * NG);
                if (act) {
                    lz[i] = __ldcg(wl + z * zrow + hr);
                    v[i] = __ldcg(wo + z * zrow * UNITS + ur);
                }
            }
            float mn = m;
#pragma unroll
            for (int i = 0; i < ZB; i++)
                mn = fmaxf(mn, lz[i]);
            probe(0, mn); /* the LSE loads have landed */
            if (mn == -INFINITY)
                continue;
            const float f = expf(m - mn); /* 0 while m is -inf */
            sum *= f;
            acc.x *= f;
            acc.y *= f;
            acc.z *= f;
            acc.w *= f;
            m = mn;
#pragma unroll
            for (int i = 0; i < ZB; i++) {
                if (i >= nz)
                    break;
                const float wz = expf(lz[i] - m);
                if (wz == 0.0f)
                    continue;
                sum += wz;
                acc.x += wz * bf16_lo(v[i].x);
                acc.y += wz * bf16_hi(v[i].x);
                acc.z += wz * bf16_lo(v[i].y);
                acc.w += wz * bf16_hi(v[i].y);
            }
        }
        if (NG > 1) {
            s_acc[tid] = acc;
            s_m[tid] = m;
            s_l[tid] = sum;
            probe(1, sum); /* the partials have landed too */
            sync();
            probe(2, 0.0f);
            if (g == 0) {
                float M = -INFINITY;
                for (int q = 0; q < NG; q++)
                    M = fmaxf(M, s_m[q * L + lane]);
                acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                sum = 0.0f;
                if (M != -INFINITY)
                    for (int q = 0; q < NG; q++) {
                        const float f = expf(s_m[q * L + lane] - M); /* 0 for a group with no weight */
                        if (f == 0.0f)
                            continue;
                        const float4 o = s_acc[q * L + lane];
                        acc.x += f * o.x;
                        acc.y += f * o.y;
                        acc.z += f * o.z;
                        acc.w += f * o.w;
                        sum += f * s_l[q * L + lane];
                    }
                m = M;
            }
            if (base + L < u1)
                sync(); /* group 0 has read the entries the next pass writes */
        }
        if (act && g == 0) {
            const int h = h0 + hr, c = (ur - hr * UNITS) * 4;
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            *reinterpret_cast<uint2 *>(a.out + (int64_t)h * a.o_sh + (int64_t)t * a.o_st + c) =
                make_uint2(pack_bf16(acc.x * inv, acc.y * inv), pack_bf16(acc.z * inv, acc.w * inv));
            if (c == 0 && a.lse)
                a.lse[(int64_t)h * a.l_sh + (int64_t)t * a.l_st] = sum > 0.0f ? m + logf(sum) : -INFINITY;
        }
    }
}

/* The tail of a kernel that combines in place: NT threads (tid < NT, all
 * of them calling), `sync` their barrier, tiles of up to ROWS head rows,
 * `sm` combine_smem(NT) bytes of shared memory free by now (the query's:
 * every kernel has read it for the last time); `mark` runs between the
 * barrier and the combine, and `probe(k, v)` inside it once the LSEs (k =
 * 0) and the partials (1) of the first round have landed and after the
 * groups' barrier (2) (a diagnostic build's time stamps; v is a value
 * that depends on the loads, for the stamp to wait on). */
template <int NT, int ROWS, class Sync, class Mark, class Probe>
__device__ __forceinline__ void combine_in_kernel(const AttendArgs &a, int t, int h0, int rows, int split, int tid,
                                                  Sync sync, Mark mark, float *sm, Probe probe)
{
    if (a.splits <= 1)
        return;
    split_barrier(a, t, split, tid, sync);
    mark();
    combine_slice<NT, combine_zb(ROWS, NT)>(a, t, h0, rows, split, tid, sync, sm, probe);
}

/* combine_in_kernel without a probe. */
template <int NT, int ROWS, class Sync, class Mark>
__device__ __forceinline__ void combine_in_kernel(const AttendArgs &a, int t, int h0, int rows, int split, int tid,
                                                  Sync sync, Mark mark, float *sm)
{
    combine_in_kernel<NT, ROWS>(a, t, h0, rows, split, tid, sync, mark, sm, [](int, float) {});
}

} /* namespace b12x */

#endif
