/* Decode-context parallel on the host: the local communicator's collectives,
 * where a cached token lives, and a D-rank step (ranks as threads, each
 * with its shard of the cache) against one rank over the whole cache, for
 * both routings and both cache formats, and a group of one rank giving the
 * plain step's bytes; bad set-ups refused, a missing rank a timeout and not
 * a hang, a slow reader holding the others until it has read their buffers. */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "check_run.h"
#include "mlart/comm.h"
#include "tests/runtime/fixture.h"

enum { P_ = 16, R_ = 8, L_ = 128, V_ = 16, K_ = 40, PAGE_ = 4, T_ = 5, B_ = 3, MB_ = 8 };
enum { MAXD = 4 };

/* NMSE of a rank's output against the one-rank step.  The partial outputs
 * cross the ranks in bf16 (a2a) or are summed from bf16 partials (ag_rs),
 * so the combined output carries one more bf16 rounding (relative 2^-9)
 * than the one-rank step's, before the V up-projection; measured 6e-7 to
 * 3e-5 over these cases and 20 seeds.  A wrong weight or a lost shard gives
 * 1e-2 or more. */
#define DCP_NMSE_BOUND 1e-4
#define DCP_LSE_BOUND 1e-4 /* |lse - lse_one_rank|, natural log */

static uint64_t seed;

static void setup(void)
{
    seed = fx_seed();
    printf("seed %llu\n", (unsigned long long)seed);
}

/* ---- collectives ------------------------------------------------------- */

typedef struct rank_job {
    mlart_comm *comm;
    int rank, size;
    size_t n;
    unsigned char *send, *recv;
    float *fsend, *frecv;
    mlart_layer *ly;
    mlart_step_io io;
    int rc;
    char err[512];
} rank_job;

static void *run_collectives(void *arg)
{
    rank_job *j = arg;
    j->rc = mlart_comm_all_gather(j->comm, j->send, j->recv, j->n, NULL);
    if (j->rc == 0)
        j->rc = mlart_comm_all_to_all(j->comm, j->send + j->n, j->recv + j->size * j->n, j->n,
                                      NULL);
    if (j->rc == 0)
        j->rc = mlart_comm_reduce_scatter_f32(j->comm, j->fsend, j->frecv, j->n, NULL);
    if (j->rc < 0)
        snprintf(j->err, sizeof j->err, "%s", mlart_last_error());
    return NULL;
}

START_TEST(local_collectives)
{
    const int D = 1 + _i; /* 1..4 ranks */
    const size_t n = 37;
    fx_rng r = {seed + (uint64_t)_i};
    mlart_comm_group *g = NULL;
    rank_job j[MAXD];
    pthread_t th[MAXD];
    ck_assert_int_eq(mlart_comm_group_create(D, -1, 5000, &g), 0);
    for (int k = 0; k < D; k++) {
        memset(&j[k], 0, sizeof j[k]);
        ck_assert_int_eq(mlart_comm_local_create(g, k, &j[k].comm), 0);
        {
            mlart_comm *twice = (mlart_comm *)0x1; /* one communicator per rank */
            ck_assert_int_eq(mlart_comm_local_create(g, k, &twice), MLART_EINVAL);
            ck_assert_ptr_eq(twice, (mlart_comm *)0x1);
            ck_assert_ptr_nonnull(strstr(mlart_last_error(), "has a communicator already"));
        }
        ck_assert_int_eq(mlart_comm_rank(j[k].comm), k);
        ck_assert_int_eq(mlart_comm_size(j[k].comm), D);
        ck_assert_str_eq(mlart_comm_kind(j[k].comm), "local");
        ck_assert_int_eq(mlart_comm_graph_safe(j[k].comm), 0);
        j[k].rank = k, j[k].size = D, j[k].n = n;
        /* all_gather sends the first n bytes; all_to_all uses the D*n after them */
        j[k].send = malloc((size_t)(D + 1) * n);
        j[k].recv = malloc((size_t)(2 * D) * n);
        j[k].fsend = malloc(sizeof(float) * (size_t)D * n);
        j[k].frecv = malloc(sizeof(float) * n);
        for (size_t i = 0; i < (size_t)(D + 1) * n; i++)
            j[k].send[i] = (unsigned char)fx_next(&r);
        for (size_t i = 0; i < (size_t)D * n; i++)
            j[k].fsend[i] = (float)(int)(fx_next(&r) % 1000) - 500.0f; /* exact sums */
    }
    for (int k = 0; k < D; k++)
        pthread_create(&th[k], NULL, run_collectives, &j[k]);
    for (int k = 0; k < D; k++)
        pthread_join(th[k], NULL);
    for (int k = 0; k < D; k++) {
        ck_assert_msg(j[k].rc == 0, "rank %d: %s", k, j[k].err);
        for (int s = 0; s < D; s++) {
            ck_assert_int_eq(memcmp(j[k].recv + (size_t)s * n, j[s].send, n), 0);
            ck_assert_int_eq(memcmp(j[k].recv + (size_t)(D + s) * n,
                                    j[s].send + (size_t)(1 + k) * n, n), 0);
        }
        for (size_t i = 0; i < n; i++) {
            float want = 0.0f;
            for (int s = 0; s < D; s++)
                want += j[s].fsend[(size_t)k * n + i];
            ck_assert_float_eq(j[k].frecv[i], want);
        }
    }
    for (int k = 0; k < D; k++) {
        mlart_comm_destroy(j[k].comm);
        free(j[k].send), free(j[k].recv), free(j[k].fsend), free(j[k].frecv);
    }
    mlart_comm_group_destroy(g);
}
END_TEST

/* Rank k's all_gather of n + k * extra bytes, or (kind 1) rank 0 an
 * all_gather and the others a reduce_scatter of the same count. */
typedef struct odd_job {
    mlart_comm *comm;
    int rank, kind;
    size_t n;
    unsigned char send[64], recv[256];
    int rc;
    char err[512];
} odd_job;

static void *run_odd(void *arg)
{
    odd_job *j = arg;
    if (j->kind == 1 && j->rank > 0)
        j->rc = mlart_comm_reduce_scatter_f32(j->comm, (const float *)(void *)j->send,
                                              (float *)(void *)j->recv, j->n / 4, NULL);
    else
        j->rc = mlart_comm_all_gather(j->comm, j->send, j->recv, j->n, NULL);
    snprintf(j->err, sizeof j->err, "%s", j->rc ? mlart_last_error() : "");
    return NULL;
}

/* Ranks that make different calls (sizes, or another collective) are all
 * refused, and nothing is copied: before, a rank gathering more bytes than
 * its peers sent read past their buffers. */
START_TEST(local_calls_must_agree)
{
    for (int kind = 0; kind < 2; kind++) {
        mlart_comm_group *g = NULL;
        odd_job j[2];
        pthread_t th[2];
        ck_assert_int_eq(mlart_comm_group_create(2, -1, 5000, &g), 0);
        for (int k = 0; k < 2; k++) {
            memset(&j[k], 0, sizeof j[k]);
            ck_assert_int_eq(mlart_comm_local_create(g, k, &j[k].comm), 0);
            j[k].rank = k, j[k].kind = kind;
            j[k].n = kind ? 16 : 16 + (size_t)k * 16; /* all_gather: 16 and 32 bytes */
            memset(j[k].send, 0x11 * (k + 1), sizeof j[k].send);
            memset(j[k].recv, 0xee, sizeof j[k].recv);
        }
        for (int k = 0; k < 2; k++)
            pthread_create(&th[k], NULL, run_odd, &j[k]);
        for (int k = 0; k < 2; k++)
            pthread_join(th[k], NULL);
        for (int k = 0; k < 2; k++) {
            ck_assert_msg(j[k].rc == MLART_ECOMM, "case %d rank %d: rc %d %s", kind, k, j[k].rc,
                          j[k].err);
            ck_assert_msg(strstr(j[k].err, "made another call"), "%s", j[k].err);
            for (size_t i = 0; i < sizeof j[k].recv; i++)
                ck_assert_int_eq(j[k].recv[i], 0xee);
        }
        printf("calls that differ (%s): %s\n", kind ? "collectives" : "sizes", j[1].err);
        for (int k = 0; k < 2; k++)
            mlart_comm_destroy(j[k].comm);
        mlart_comm_group_destroy(g);
    }
}
END_TEST

/* A group destroyed before its communicators lives until the last of them
 * is destroyed (AddressSanitizer, tests/host-sanitizers.sh, saw the use
 * after free before); bad devices and a NULL out are refused at create. */
START_TEST(local_group_lifetime_and_args)
{
    mlart_comm_group *g = NULL, *keep = (mlart_comm_group *)0x1;
    mlart_comm *c0 = NULL, *c1 = NULL, *kc = (mlart_comm *)0x1;
    ck_assert_int_eq(mlart_comm_group_create(2, -1, 200, &g), 0);
    ck_assert_int_eq(mlart_comm_local_create(g, 0, &c0), 0);
    ck_assert_int_eq(mlart_comm_local_create(g, 1, &c1), 0);
    mlart_comm_group_destroy(g); /* warns; freed with the last communicator */
    mlart_comm_destroy(c1);
    ck_assert_int_eq(mlart_comm_all_gather(c0, "abcd", (char[8]){0}, 4, NULL), MLART_ECOMM);
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "rank 1 left the group"));
    mlart_comm_destroy(c0);
    ck_assert_int_eq(mlart_comm_group_create(2, -5, 0, &keep), MLART_EINVAL);
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "device -5"));
#ifndef MLART_WITH_CUDA
    ck_assert_int_eq(mlart_comm_group_create(2, 0, 0, &keep), MLART_ENOTSUP);
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "no CUDA"));
#endif
    ck_assert_ptr_eq(keep, (mlart_comm_group *)0x1);
    ck_assert_int_eq(mlart_comm_group_create(2, -1, 0, NULL), MLART_EINVAL);
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "NULL out"));
    ck_assert_int_eq(mlart_comm_group_create(2, -1, 0, &g), 0);
    ck_assert_int_eq(mlart_comm_local_create(g, 0, NULL), MLART_EINVAL);
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "NULL out"));
    ck_assert_int_eq(mlart_comm_local_create(NULL, 0, &kc), MLART_EINVAL);
    ck_assert_ptr_eq(kc, (mlart_comm *)0x1);
    mlart_comm_group_destroy(g);
}
END_TEST

/* In place, as NCCL allows it: reduce_scatter_f32 with recv = send + rank * n.
 * Before, the host group zeroed its sum in recv and so in its own block of
 * send before reading it: the rank's own contribution was lost (or doubled). */
static void *run_rs_in_place(void *arg)
{
    rank_job *j = arg;
    j->rc = mlart_comm_reduce_scatter_f32(j->comm, j->fsend, j->fsend + (size_t)j->rank * j->n,
                                          j->n, NULL);
    if (j->rc < 0)
        snprintf(j->err, sizeof j->err, "%s", mlart_last_error());
    return NULL;
}

START_TEST(local_reduce_scatter_in_place)
{
    const int D = 1 + _i; /* 1..4 ranks */
    const size_t n = 37;
    fx_rng r = {seed + 7u * (uint64_t)_i};
    mlart_comm_group *g = NULL;
    rank_job j[MAXD];
    pthread_t th[MAXD];
    float want[MAXD][37];
    ck_assert_int_eq(mlart_comm_group_create(D, -1, 5000, &g), 0);
    for (int k = 0; k < D; k++) {
        memset(&j[k], 0, sizeof j[k]);
        ck_assert_int_eq(mlart_comm_local_create(g, k, &j[k].comm), 0);
        j[k].rank = k, j[k].size = D, j[k].n = n;
        j[k].fsend = malloc(sizeof(float) * (size_t)D * n);
        for (size_t i = 0; i < (size_t)D * n; i++)
            j[k].fsend[i] = (float)(int)(fx_next(&r) % 1000) - 500.0f; /* exact sums */
    }
    for (int k = 0; k < D; k++)
        for (size_t i = 0; i < n; i++) {
            want[k][i] = 0.0f;
            for (int s = 0; s < D; s++)
                want[k][i] += j[s].fsend[(size_t)k * n + i];
        }
    for (int k = 0; k < D; k++)
        pthread_create(&th[k], NULL, run_rs_in_place, &j[k]);
    for (int k = 0; k < D; k++)
        pthread_join(th[k], NULL);
    for (int k = 0; k < D; k++) {
        ck_assert_msg(j[k].rc == 0, "rank %d: %s", k, j[k].err);
        for (size_t i = 0; i < n; i++)
            ck_assert_msg(j[k].fsend[(size_t)k * n + i] == want[k][i],
                          "D %d rank %d [%zu]: %g, want %g", D, k, i,
                          j[k].fsend[(size_t)k * n + i], want[k][i]);
    }
    for (int k = 0; k < D; k++) {
        mlart_comm_destroy(j[k].comm);
        free(j[k].fsend);
    }
    mlart_comm_group_destroy(g);
}
END_TEST

START_TEST(placement)
{
    /* every position has one owner; each rank's positions are 0..len-1, once each */
    static int seen[MAXD][512];
    for (int32_t D = 1; D <= MAXD; D++)
        for (int32_t il = 1; il <= 9; il += 4)
            for (int64_t len = 0; len <= 200; len += 7) {
                int64_t count[MAXD] = {0};
                memset(seen, 0, sizeof seen);
                for (int64_t p = 0; p < len; p++) {
                    int32_t o = mlart_dcp_owner(p, D, il);
                    int64_t lp = mlart_dcp_local_pos(p, D, il);
                    ck_assert(o >= 0 && o < D);
                    ck_assert(lp >= 0 && lp < 512);
                    ck_assert_msg(!seen[o][lp], "D %d il %d: local %lld twice", D, il,
                                  (long long)lp);
                    seen[o][lp] = 1;
                    count[o]++;
                }
                for (int32_t o = 0; o < D; o++) {
                    ck_assert_int_eq(mlart_dcp_local_len(len, o, D, il), count[o]);
                    for (int64_t lp = 0; lp < count[o]; lp++)
                        ck_assert(seen[o][lp]);
                }
            }
    ck_assert_int_eq(mlart_dcp_owner(5, 2, 1), 1);
    ck_assert_int_eq(mlart_dcp_local_pos(5, 2, 1), 2);
    ck_assert_int_eq(mlart_dcp_owner(5, 2, 4), 1);
    ck_assert_int_eq(mlart_dcp_local_pos(9, 2, 4), 5);
    /* interleave 0 (the descriptor's "1") and below count as 1, no division by zero */
    for (int32_t il = -1; il <= 0; il++)
        for (int64_t p = 0; p < 40; p++) {
            ck_assert_int_eq(mlart_dcp_owner(p, 3, il), mlart_dcp_owner(p, 3, 1));
            ck_assert_int_eq(mlart_dcp_local_pos(p, 3, il), mlart_dcp_local_pos(p, 3, 1));
            ck_assert_int_eq(mlart_dcp_local_len(p, 2, 3, il), mlart_dcp_local_len(p, 2, 3, 1));
        }
}
END_TEST

/* ---- a step -------------------------------------------------------------- */

typedef struct dcp_case {
    int D, H;
    mlart_dcp_routing routing;
    int interleave;
    mlart_kv_format fmt;
    int T; /* tokens of the step; 0 = T_ */
} dcp_case;

static const dcp_case cases[] = {
    {2, 2, MLART_DCP_A2A, 1, MLART_KV_BF16, 0},  {2, 2, MLART_DCP_AG_RS, 1, MLART_KV_BF16, 0},
    {4, 1, MLART_DCP_A2A, 3, MLART_KV_FP8_DS_MLA, 0}, {4, 2, MLART_DCP_AG_RS, 3, MLART_KV_FP8_DS_MLA, 0},
    {3, 2, MLART_DCP_A2A, 4, MLART_KV_BF16, 0},  {3, 1, MLART_DCP_AG_RS, 5, MLART_KV_BF16, 0},
    {4, 3, MLART_DCP_A2A, 8, MLART_KV_FP8_DS_MLA, 0}, {2, 3, MLART_DCP_AG_RS, 64, MLART_KV_FP8_DS_MLA, 0},
    /* one rank: the same path, the plain step's bytes */
    {1, 2, MLART_DCP_A2A, 1, MLART_KV_BF16, 0},  {1, 3, MLART_DCP_AG_RS, 3, MLART_KV_FP8_DS_MLA, 0},
    /* one token: attend reads the all-gather's buffer, no head gather */
    {4, 2, MLART_DCP_A2A, 1, MLART_KV_BF16, 1}, {3, 2, MLART_DCP_AG_RS, 2, MLART_KV_FP8_DS_MLA, 1},
    {1, 2, MLART_DCP_A2A, 1, MLART_KV_FP8_DS_MLA, 1},
};

/* The whole cache of a fixture in format fmt: bf16 rows as they are, fp8
 * records written by the layer's own cache write. */
static uint8_t *global_cache(fx *f, mlart_context *ctx, mlart_geometry *g)
{
    const size_t bpt = mlart_kv_bytes_per_token(g);
    uint8_t *c = calloc((size_t)f->num_slots, bpt);
    mlart_layer_desc d = fx_desc(f, "reference");
    mlart_layer *ly = NULL;
    int32_t *slots = malloc(sizeof(int32_t) * (size_t)f->num_slots);
    mlart_tensor lat = fx_view(f->cache, MLART_DTYPE_BF16, 2, f->num_slots, g->kv_lora + g->rope, 0),
                 sl = fx_view(slots, MLART_DTYPE_I32, 1, f->num_slots, 0, 0);
    d.geom = *g;
    d.kv_cache = fx_view(c, MLART_DTYPE_U8, 2, f->num_slots, (int64_t)bpt, 0);
    for (int64_t i = 0; i < f->num_slots; i++)
        slots[i] = (int32_t)i;
    ck_assert_msg(mlart_layer_create(ctx, &d, &ly) == 0, "%s", mlart_last_error());
    ck_assert_msg(mlart_layer_write_kv(ly, &lat, &sl, NULL) == 0, "%s", mlart_last_error());
    mlart_layer_destroy(ly);
    free(slots);
    return c;
}

static void *run_decode(void *arg)
{
    rank_job *j = arg;
    j->rc = mlart_layer_decode(j->ly, &j->io, NULL);
    if (j->rc < 0)
        snprintf(j->err, sizeof j->err, "%s", mlart_last_error());
    return NULL;
}

static double nmse(const uint16_t *got, const uint16_t *want, size_t n, size_t stride_got,
                   size_t stride_want, size_t rows)
{
    double num = 0.0, den = 0.0;
    for (size_t r = 0; r < rows; r++)
        for (size_t i = 0; i < n; i++) {
            double a = mlart_bf16_to_f32(got[r * stride_got + i]),
                   b = mlart_bf16_to_f32(want[r * stride_want + i]);
            ck_assert_msg(!isnan(a), "row %zu col %zu: NaN", r, i);
            num += (a - b) * (a - b);
            den += b * b;
        }
    return den > 0 ? num / den : num;
}

START_TEST(dcp_step_equals_one_rank)
{
    const dcp_case *c = &cases[_i];
    const int D = c->D, H = c->H, G = D * H, il = c->interleave, T = c->T ? c->T : T_;
    const size_t qrow = (size_t)(P_ + R_);
    fx f;
    mlart_context *ctx = NULL;
    mlart_geometry g;
    mlart_comm_group *grp = NULL;
    rank_job j[MAXD];
    pthread_t th[MAXD];
    uint8_t *whole, *shard[MAXD];
    int32_t *bt_l;
    int64_t MBl = 0, slots_l;
    size_t bpt;
    mlart_layer *one = NULL;
    mlart_layer_desc d1;
    mlart_step_io io1;
    fx_init(&f, G, P_, R_, L_, V_, K_, PAGE_, T, B_, MB_, seed + 101u * (uint64_t)_i);
    g = f.g;
    g.kv_format = c->fmt;
    bpt = mlart_kv_bytes_per_token(&g);
    ck_assert_int_eq(mlart_context_create(-1, &ctx), 0);
    whole = global_cache(&f, ctx, &g);

    /* one rank, every head, the whole cache */
    d1 = fx_desc(&f, "reference");
    d1.geom = g;
    d1.kv_cache = fx_view(whole, MLART_DTYPE_U8, 2, f.num_slots, (int64_t)bpt, 0);
    ck_assert_msg(mlart_layer_create(ctx, &d1, &one) == 0, "%s", mlart_last_error());
    io1 = fx_io(&f);
    ck_assert_msg(mlart_layer_decode(one, &io1, NULL) == 0, "%s", mlart_last_error());

    /* shards: position p of request b goes to its owner's local position,
     * through a block table of the shard's own (blocks in reverse order) */
    for (int o = 0; o < D; o++) {
        int64_t cap = mlart_dcp_local_len((int64_t)MB_ * PAGE_, o, D, il);
        int64_t mb = (cap + PAGE_ - 1) / PAGE_;
        MBl = mb > MBl ? mb : MBl;
    }
    slots_l = (int64_t)B_ * MBl * PAGE_;
    bt_l = malloc(sizeof(int32_t) * (size_t)(B_ * MBl));
    for (int64_t i = 0; i < B_ * MBl; i++)
        bt_l[i] = (int32_t)(B_ * MBl - 1 - i);
    for (int o = 0; o < D; o++)
        shard[o] = calloc((size_t)slots_l, bpt);
    for (int b = 0; b < B_; b++)
        for (int64_t p = 0; p < (int64_t)MB_ * PAGE_; p++) {
            int o = mlart_dcp_owner(p, D, il);
            int64_t lp = mlart_dcp_local_pos(p, D, il);
            int64_t src = (int64_t)f.bt[b * MB_ + p / PAGE_] * PAGE_ + p % PAGE_;
            int64_t dst = (int64_t)bt_l[b * MBl + lp / PAGE_] * PAGE_ + lp % PAGE_;
            memcpy(shard[o] + (size_t)dst * bpt, whole + (size_t)src * bpt, bpt);
        }

    ck_assert_int_eq(mlart_comm_group_create(D, -1, 10000, &grp), 0);
    for (int k = 0; k < D; k++) {
        mlart_layer_desc d = fx_desc(&f, "reference");
        int64_t qs[3] = {T, H, (int64_t)qrow};
        memset(&j[k], 0, sizeof j[k]);
        ck_assert_int_eq(mlart_comm_local_create(grp, k, &j[k].comm), 0);
        d.geom = g;
        d.geom.heads = H;
        d.w_uk_t = fx_view(f.w_uk_t + (size_t)k * H * P_ * L_, MLART_DTYPE_BF16, 3, H, P_, L_);
        d.w_uv = fx_view(f.w_uv + (size_t)k * H * L_ * V_, MLART_DTYPE_BF16, 3, H, L_, V_);
        d.kv_cache = fx_view(shard[k], MLART_DTYPE_U8, 2, slots_l, (int64_t)bpt, 0);
        d.num_slots = slots_l;
        d.max_blocks_per_req = (int32_t)MBl;
        d.dcp = j[k].comm;
        d.dcp_interleave = il;
        d.dcp_routing = c->routing;
        ck_assert_msg(mlart_layer_create(ctx, &d, &j[k].ly) == 0, "rank %d: %s", k,
                      mlart_last_error());
        j[k].io = fx_io(&f);
        /* this rank's heads of q: a strided view into the fixture's */
        j[k].io.q = mlart_tensor_dense(f.q, MLART_DTYPE_BF16, -1, 3, qs);
        j[k].io.q.data = f.q + (size_t)k * H * qrow;
        j[k].io.q.stride[0] = (int64_t)G * (int64_t)qrow;
        j[k].io.q.stride[1] = (int64_t)qrow;
        j[k].io.q.extent = sizeof(uint16_t) * (size_t)T * (size_t)G * qrow;
        j[k].io.block_table = fx_view(bt_l, MLART_DTYPE_I32, 2, B_, MBl, 0);
        j[k].io.o = fx_view(malloc(sizeof(uint16_t) * T * H * V_), MLART_DTYPE_BF16, 2, T,
                            (int64_t)H * V_, 0);
        j[k].io.lse = fx_view(malloc(sizeof(float) * H * T), MLART_DTYPE_F32, 2, H, T, 0);
        memset(j[k].io.o.data, 0xff, sizeof(uint16_t) * T * H * V_); /* NaN: must be written */
        memset(j[k].io.lse.data, 0xff, sizeof(float) * H * T);
    }
    for (int k = 0; k < D; k++)
        pthread_create(&th[k], NULL, run_decode, &j[k]);
    for (int k = 0; k < D; k++)
        pthread_join(th[k], NULL);

    for (int k = 0; k < D; k++) {
        const uint16_t *o = j[k].io.o.data;
        const float *lse = j[k].io.lse.data;
        double e;
        ck_assert_msg(j[k].rc == 0, "rank %d: %s", k, j[k].err);
        e = nmse(o, f.o + (size_t)k * H * V_, (size_t)H * V_, (size_t)H * V_, (size_t)G * V_, T);
        printf("D %d H %d %s interleave %d %s rank %d: NMSE %.2e\n", D, H,
               c->routing == MLART_DCP_A2A ? "a2a" : "ag_rs", il, mlart_kv_format_name(c->fmt), k,
               e);
        ck_assert_msg(e <= DCP_NMSE_BOUND, "rank %d: NMSE %.3e > %.1e", k, e, DCP_NMSE_BOUND);
        if (D == 1) /* nothing combined: the plain step's bytes */
            ck_assert_msg(e == 0.0 && !memcmp(lse, f.lse, sizeof(float) * H * T),
                          "one rank: output or lse differs from the plain step (NMSE %.3e)", e);
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) {
                float a = lse[h * T + t], b = f.lse[(k * H + h) * T + t];
                if (isinf(b)) {
                    ck_assert_msg(isinf(a) && a < 0, "rank %d head %d token %d: lse %g, want -inf",
                                  k, h, t, a);
                    for (int v = 0; v < V_; v++)
                        ck_assert_int_eq(o[(size_t)t * H * V_ + (size_t)h * V_ + v] & 0x7fff, 0);
                } else {
                    ck_assert_msg(fabsf(a - b) <= DCP_LSE_BOUND, "rank %d head %d token %d: lse "
                                  "%.7g, one rank %.7g", k, h, t, a, b);
                }
            }
    }
    for (int k = 0; k < D; k++) {
        mlart_layer_destroy(j[k].ly);
        mlart_comm_destroy(j[k].comm);
        free(j[k].io.o.data), free(j[k].io.lse.data), free(shard[k]);
    }
    mlart_comm_group_destroy(grp);
    mlart_layer_destroy(one);
    free(bt_l), free(whole);
    mlart_context_destroy(ctx);
    fx_free(&f);
}
END_TEST

/* ---- refused set-ups, a missing rank ------------------------------------ */

static int create_dcp(fx *f, mlart_context *ctx, mlart_comm *comm, const char *backend,
                      int interleave, int routing, mlart_layer **ly)
{
    mlart_layer_desc d = fx_desc(f, backend);
    d.dcp = comm;
    d.dcp_interleave = interleave;
    d.dcp_routing = (mlart_dcp_routing)routing;
    return mlart_layer_create(ctx, &d, ly);
}

START_TEST(bad_setups_refused)
{
    fx f;
    mlart_context *ctx = NULL;
    mlart_comm_group *host = NULL, *dev = NULL, *four = NULL;
    mlart_comm *c = NULL, *cd = NULL, *c4 = NULL;
    mlart_layer *ly = NULL;
    setenv("MLART_BACKEND_PATH", MLART_TEST_PLUGIN_DIR, 1);
    fx_init(&f, 4, P_, R_, L_, V_, K_, PAGE_, T_, B_, MB_, seed);
    ck_assert_int_eq(mlart_context_create(-1, &ctx), 0);
    ck_assert_int_eq(mlart_comm_group_create(2, -1, 1000, &host), 0);
#ifdef MLART_WITH_CUDA
    ck_assert_int_eq(mlart_comm_group_create(2, 0, 1000, &dev), 0);
    ck_assert_int_eq(mlart_comm_local_create(dev, 0, &cd), 0);
#endif
    ck_assert_int_eq(mlart_comm_group_create(4, -1, 1000, &four), 0);
    ck_assert_int_eq(mlart_comm_local_create(host, 0, &c), 0);
    ck_assert_int_eq(mlart_comm_local_create(four, 0, &c4), 0);
    {
        mlart_comm *bad = NULL;
        ck_assert_int_eq(mlart_comm_local_create(host, 2, &bad), MLART_EINVAL);
        ck_assert_ptr_null(bad);
    }

#ifdef MLART_WITH_CUDA /* without CUDA no group lives on a device (local_group_lifetime_and_args) */
    ck_assert_int_eq(create_dcp(&f, ctx, cd, "reference", 1, 0, &ly), MLART_EINVAL);
    ck_assert_msg(strstr(mlart_last_error(), "device 0") != NULL, "%s", mlart_last_error());
#endif
    ck_assert_int_eq(create_dcp(&f, ctx, c, "reference", -1, 0, &ly), MLART_EINVAL);
    ck_assert_int_eq(create_dcp(&f, ctx, c, "reference", 1, 7, &ly), MLART_EINVAL);
    ck_assert_int_eq(create_dcp(&f, ctx, c, "testsafe", 1, 0, &ly), MLART_ENOTSUP);
    ck_assert_msg(strstr(mlart_last_error(), "head-major") != NULL, "%s", mlart_last_error());
    /* testhost serves at most 8 heads: 4 ranks x 4 heads is 16 */
    ck_assert_int_eq(create_dcp(&f, ctx, c4, "testhost", 1, 0, &ly), MLART_ENOTSUP);
    ck_assert_msg(strstr(mlart_last_error(), "16 heads") != NULL, "%s", mlart_last_error());
    ck_assert_ptr_null(ly);
    mlart_comm_destroy(c), mlart_comm_destroy(cd), mlart_comm_destroy(c4);
    mlart_comm_group_destroy(host), mlart_comm_group_destroy(dev), mlart_comm_group_destroy(four);
    mlart_context_destroy(ctx);
    fx_free(&f);
}
END_TEST

/* Rank 0 of a local group of two on the host: its layer over the fixture
 * (2 heads) with the a2a routing; rank 1's communicator exists but no
 * thread runs it. */
typedef struct two_ranks {
    fx f;
    mlart_context *ctx;
    mlart_comm_group *grp;
    mlart_comm *c[2];
    mlart_layer *ly;
    mlart_step_io io;
} two_ranks;

static void two_open(two_ranks *t)
{
    memset(t, 0, sizeof *t);
    fx_init(&t->f, 2, P_, R_, L_, V_, K_, PAGE_, T_, B_, MB_, seed);
    ck_assert_int_eq(mlart_context_create(-1, &t->ctx), 0);
    ck_assert_int_eq(mlart_comm_group_create(2, -1, 300, &t->grp), 0);
    for (int k = 0; k < 2; k++)
        ck_assert_int_eq(mlart_comm_local_create(t->grp, k, &t->c[k]), 0);
    ck_assert_int_eq(create_dcp(&t->f, t->ctx, t->c[0], "reference", 1, MLART_DCP_A2A, &t->ly), 0);
    t->io = fx_io(&t->f);
}

static void two_close(two_ranks *t)
{
    mlart_layer_destroy(t->ly);
    mlart_comm_destroy(t->c[0]), mlart_comm_destroy(t->c[1]);
    mlart_comm_group_destroy(t->grp);
    mlart_context_destroy(t->ctx);
    fx_free(&t->f);
}

START_TEST(missing_rank_times_out)
{
    two_ranks t;
    struct timespec a, b;
    double secs;
    int rc;
    two_open(&t);
    /* rank 1 never comes */
    clock_gettime(CLOCK_MONOTONIC, &a);
    rc = mlart_layer_decode(t.ly, &t.io, NULL);
    clock_gettime(CLOCK_MONOTONIC, &b);
    secs = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
    ck_assert_msg(rc == MLART_ETIMEDOUT, "rc %d: %s", rc, mlart_last_error());
    ck_assert_msg(secs < 3.0, "took %.2f s", secs);
    ck_assert_msg(strstr(mlart_last_error(), "did not arrive") != NULL, "%s", mlart_last_error());
    /* the group stays failed: a late rank does not pair with a later collective */
    ck_assert_int_eq(mlart_comm_all_gather(t.c[1], t.f.q, t.f.o, 4, NULL), MLART_ETIMEDOUT);
    ck_assert_msg(strstr(mlart_last_error(), "rank 1 of 2: the group failed before this rank came"),
                  "%s", mlart_last_error());
    two_close(&t);
}
END_TEST

/* A rank that gives up (its communicator destroyed before the collective)
 * fails the others at once, not at the group's timeout. */
START_TEST(leaving_rank_fails_the_others)
{
    two_ranks t;
    struct timespec a, b;
    double secs;
    int rc;
    two_open(&t);
    /* reopen the group with a timeout a test would notice */
    mlart_layer_destroy(t.ly);
    mlart_comm_destroy(t.c[0]), mlart_comm_destroy(t.c[1]);
    mlart_comm_group_destroy(t.grp);
    ck_assert_int_eq(mlart_comm_group_create(2, -1, 20000, &t.grp), 0);
    for (int k = 0; k < 2; k++)
        ck_assert_int_eq(mlart_comm_local_create(t.grp, k, &t.c[k]), 0);
    ck_assert_int_eq(create_dcp(&t.f, t.ctx, t.c[0], "reference", 1, MLART_DCP_A2A, &t.ly), 0);
    mlart_comm_destroy(t.c[1]); /* rank 1 leaves */
    t.c[1] = NULL;
    clock_gettime(CLOCK_MONOTONIC, &a);
    rc = mlart_layer_decode(t.ly, &t.io, NULL);
    clock_gettime(CLOCK_MONOTONIC, &b);
    secs = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
    ck_assert_msg(rc == MLART_ECOMM, "rc %d: %s", rc, mlart_last_error());
    ck_assert_msg(strstr(mlart_last_error(), "rank 1 left the group") != NULL, "%s",
                  mlart_last_error());
    ck_assert_msg(secs < 1.0, "took %.2f s with a 20 s timeout", secs);
    printf("leaving rank: %s after %.3f s\n", mlart_last_error(), secs);
    two_close(&t);
}
END_TEST

/* ---- a slow reader holds the others ----------------------------------- */

/* AddressSanitizer handles SIGSEGV itself: the stalled copy below cannot be
 * staged under it. */
#if defined(__SANITIZE_ADDRESS__)
#define DCP_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DCP_ASAN 1
#endif
#endif

#ifndef DCP_ASAN
/* 64 KiB: past the sizes a memcpy loads whole before its first store, so
 * most of the copy reads its source after the stall */
enum { SLOW_BYTES = 1 << 16, SLOW_MS = 300, SLOW_TIMEOUT_MS = 50, POISON = 0xA5 };

/* rank 1's receive buffer, PROT_NONE until its first touch has slept */
static unsigned char *volatile slow_region;
static size_t slow_len;
static struct sigaction slow_saved;

/* A fault inside slow_region: sleep, open the region, return so the copy
 * resumes.  Any other fault: put back the previous handler and return, so
 * the access faults again under it. */
static void slow_fault(int sig, siginfo_t *si, void *uc)
{
    unsigned char *a = si->si_addr, *r = slow_region;
    struct timespec d = {SLOW_MS / 1000, (long)(SLOW_MS % 1000) * 1000000L};
    int e = errno;
    (void)sig, (void)uc;
    if (!r || a < r || a >= r + slow_len) {
        sigaction(SIGSEGV, &slow_saved, NULL);
    } else {
        while (nanosleep(&d, &d) != 0)
            ;
        mprotect(r, slow_len, PROT_READ | PROT_WRITE);
    }
    errno = e;
}

typedef struct slow_job {
    mlart_comm *comm;
    unsigned char *send, *recv;
    pthread_barrier_t *start;
    int rc;
    double secs;
    char err[512];
} slow_job;

static double since(const struct timespec *a)
{
    struct timespec b;
    clock_gettime(CLOCK_MONOTONIC, &b);
    return (double)(b.tv_sec - a->tv_sec) + 1e-9 * (double)(b.tv_nsec - a->tv_nsec);
}

/* One all_gather; then the send buffer is the caller's again, and rank 0
 * poisons it at once, as a caller reusing it would. */
static void *run_slow(void *arg)
{
    slow_job *j = arg;
    struct timespec a;
    pthread_barrier_wait(j->start); /* both call at once: the 50 ms is the test's, not the start's */
    clock_gettime(CLOCK_MONOTONIC, &a);
    j->rc = mlart_comm_all_gather(j->comm, j->send, j->recv, SLOW_BYTES, NULL);
    j->secs = since(&a);
    if (mlart_comm_rank(j->comm) == 0)
        memset(j->send, POISON, SLOW_BYTES);
    if (j->rc < 0)
        snprintf(j->err, sizeof j->err, "%s", mlart_last_error());
    return NULL;
}
#endif

START_TEST(slow_reader_holds_the_others)
{
#ifdef DCP_ASAN
    printf("slow_reader_holds_the_others: skipped under AddressSanitizer (it handles SIGSEGV)\n");
#else
    mlart_comm_group *g = NULL;
    pthread_barrier_t start;
    pthread_t th[2];
    slow_job j[2];
    unsigned char *want = malloc(2 * SLOW_BYTES), *mine = malloc(2 * SLOW_BYTES);
    struct sigaction sa;
    fx_rng r = {seed};
    for (size_t i = 0; i < 2 * SLOW_BYTES; i++) { /* never the poison byte */
        unsigned char b = (unsigned char)fx_next(&r);
        want[i] = b == POISON ? (unsigned char)~b : b;
    }
    slow_len = 2 * SLOW_BYTES;
    slow_region = mmap(NULL, slow_len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ck_assert(slow_region != MAP_FAILED);
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = slow_fault;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    ck_assert_int_eq(sigaction(SIGSEGV, &sa, &slow_saved), 0);

    ck_assert_int_eq(mlart_comm_group_create(2, -1, SLOW_TIMEOUT_MS, &g), 0);
    pthread_barrier_init(&start, NULL, 2);
    for (int k = 0; k < 2; k++) {
        memset(&j[k], 0, sizeof j[k]);
        ck_assert_int_eq(mlart_comm_local_create(g, k, &j[k].comm), 0);
        j[k].send = malloc(SLOW_BYTES);
        memcpy(j[k].send, want + (size_t)k * SLOW_BYTES, SLOW_BYTES);
        j[k].start = &start;
    }
    j[0].recv = mine;
    j[1].recv = slow_region;
    for (int k = 0; k < 2; k++)
        pthread_create(&th[k], NULL, run_slow, &j[k]);
    for (int k = 0; k < 2; k++)
        pthread_join(th[k], NULL);
    sigaction(SIGSEGV, &slow_saved, NULL);

    printf("slow reader: rank 0 returned %d after %.3f s, rank 1 %d after %.3f s\n", j[0].rc,
           j[0].secs, j[1].rc, j[1].secs);
    for (int k = 0; k < 2; k++)
        ck_assert_msg(j[k].rc == 0, "rank %d: %s", k, j[k].err);
    ck_assert_msg(!memcmp(j[1].recv, want, 2 * SLOW_BYTES),
                  "rank 1 received a buffer rank 0 had already reused");
    ck_assert_msg(!memcmp(j[0].recv, want, 2 * SLOW_BYTES), "rank 0 received wrong bytes");
    ck_assert_msg(j[0].secs >= 0.25, "rank 0 returned after %.3f s, before rank 1 had read its "
                  "buffer (%d ms)", j[0].secs, SLOW_MS);
    for (int k = 0; k < 2; k++) {
        mlart_comm_destroy(j[k].comm);
        free(j[k].send);
    }
    mlart_comm_group_destroy(g);
    pthread_barrier_destroy(&start);
    munmap(slow_region, slow_len);
    slow_region = NULL;
    free(want), free(mine);
#endif
}
END_TEST

START_TEST(index_past_seq_len_refused)
{
    two_ranks t;
    two_open(&t);
    t.f.idx[K_ + 3] = t.f.lens[t.f.req[1]]; /* global position == seq_len */
    ck_assert_int_eq(mlart_layer_decode(t.ly, &t.io, NULL), MLART_ERANGE);
    ck_assert_msg(strstr(mlart_last_error(), "idx[1][3]") != NULL, "%s", mlart_last_error());
    two_close(&t);
}
END_TEST

/* The ranks of a step must call it with the same T, B, idx, req_of_token
 * and seq_lens; with validate_indices (always on the host) a step where
 * they differ, or that one rank refuses on its own shard, fails on every
 * rank at once (layer.c, dcp_check_agree).  Each rank its own fixture of
 * 2 heads over the whole cache (the shards' contents do not matter here);
 * rank 1's differs from rank 0's as the case says. */
enum { AGREE_IDX, AGREE_T, AGREE_BT, AGREE_NONE };

START_TEST(ranks_must_agree_on_the_step)
{
    static const char *const want[] = {"rank 1's idx is not rank 0's", "rank 1 has T 4 and B 3",
                                       "rank 1 refused the step", NULL};
    const int kind = _i;
    fx f[2];
    mlart_context *ctx = NULL;
    mlart_comm_group *grp = NULL;
    rank_job j[2];
    pthread_t th[2];
    struct timespec a, b;
    double secs;
    ck_assert_int_eq(mlart_context_create(-1, &ctx), 0);
    /* a 10 s group timeout: a rank left waiting would show in `secs` */
    ck_assert_int_eq(mlart_comm_group_create(2, -1, 10000, &grp), 0);
    for (int k = 0; k < 2; k++) {
        const int T = k == 1 && kind == AGREE_T ? T_ - 1 : T_;
        mlart_layer_desc d;
        fx_init(&f[k], 2, P_, R_, L_, V_, K_, PAGE_, T, B_, MB_, seed);
        memset(&j[k], 0, sizeof j[k]);
        ck_assert_int_eq(mlart_comm_local_create(grp, k, &j[k].comm), 0);
        d = fx_desc(&f[k], "reference");
        d.max_tokens = T_;
        d.dcp = j[k].comm;
        ck_assert_msg(mlart_layer_create(ctx, &d, &j[k].ly) == 0, "%s", mlart_last_error());
    }
    if (kind == AGREE_IDX) { /* one valid entry emptied */
        int64_t i = 0;
        while (f[1].idx[i] < 0)
            i++;
        f[1].idx[i] = -1;
    } else if (kind == AGREE_BT) { /* a block past rank 1's cache */
        for (int i = 0; i < B_ * MB_; i++)
            f[1].bt[i] = (int32_t)(f[1].num_slots / PAGE_);
    }
    for (int k = 0; k < 2; k++)
        j[k].io = fx_io(&f[k]);
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int k = 0; k < 2; k++)
        pthread_create(&th[k], NULL, run_decode, &j[k]);
    for (int k = 0; k < 2; k++)
        pthread_join(th[k], NULL);
    clock_gettime(CLOCK_MONOTONIC, &b);
    secs = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
    for (int k = 0; k < 2; k++) {
        printf("case %d rank %d: rc %d %s\n", kind, k, j[k].rc, j[k].rc ? j[k].err : "");
        if (kind == AGREE_NONE) {
            ck_assert_msg(j[k].rc == 0, "rank %d: %s", k, j[k].err);
        } else if (kind == AGREE_BT && k == 1) { /* its own reason */
            ck_assert_msg(j[k].rc == MLART_ERANGE, "rank 1: rc %d %s", j[k].rc, j[k].err);
            ck_assert_msg(strstr(j[k].err, "block") != NULL, "rank 1: %s", j[k].err);
        } else {
            ck_assert_msg(j[k].rc == MLART_ECOMM, "case %d rank %d: rc %d %s", kind, k, j[k].rc,
                          j[k].err);
            ck_assert_msg(strstr(j[k].err, want[kind]) != NULL, "case %d rank %d: %s", kind, k,
                          j[k].err);
        }
    }
    ck_assert_msg(secs < 2.0, "case %d took %.2f s with a 10 s group timeout", kind, secs);
    for (int k = 0; k < 2; k++) {
        mlart_layer_destroy(j[k].ly);
        mlart_comm_destroy(j[k].comm);
        fx_free(&f[k]);
    }
    mlart_comm_group_destroy(grp);
    mlart_context_destroy(ctx);
}
END_TEST

/* mlart_comm_wait: a host group's collectives have ended when they return,
 * so it returns 0 at once; bad arguments are refused. */
START_TEST(wait_on_host)
{
    mlart_comm_group *g = NULL;
    mlart_comm *c = NULL;
    ck_assert_int_eq(mlart_comm_group_create(1, -1, 5000, &g), 0);
    ck_assert_int_eq(mlart_comm_local_create(g, 0, &c), 0);
    ck_assert_int_eq(mlart_comm_wait(c, NULL, 0), 0);
    ck_assert_int_eq(mlart_comm_wait(c, NULL, 1), 0);
    ck_assert_int_eq(mlart_comm_wait(c, NULL, -1), MLART_EINVAL);
    ck_assert_msg(strstr(mlart_last_error(), "timeout -1 ms") != NULL, "%s", mlart_last_error());
    ck_assert_int_eq(mlart_comm_wait(NULL, NULL, 0), MLART_EINVAL);
    ck_assert_msg(strstr(mlart_last_error(), "NULL communicator") != NULL, "%s",
                  mlart_last_error());
    mlart_comm_destroy(c);
    mlart_comm_group_destroy(g);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("dcp");
    TCase *tc = tcase_create("dcp");
    tcase_add_checked_fixture(tc, setup, NULL);
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, local_collectives, 0, MAXD);
    tcase_add_loop_test(tc, local_reduce_scatter_in_place, 0, MAXD);
    tcase_add_test(tc, local_calls_must_agree);
    tcase_add_test(tc, local_group_lifetime_and_args);
    tcase_add_test(tc, placement);
    tcase_add_loop_test(tc, dcp_step_equals_one_rank, 0, (int)(sizeof cases / sizeof cases[0]));
    tcase_add_test(tc, bad_setups_refused);
    tcase_add_test(tc, missing_rank_times_out);
    tcase_add_test(tc, leaving_rank_fails_the_others);
    tcase_add_test(tc, index_past_seq_len_refused);
    tcase_add_loop_test(tc, ranks_must_agree_on_the_step, AGREE_IDX, AGREE_NONE + 1);
    tcase_add_test(tc, slow_reader_holds_the_others);
    tcase_add_test(tc, wait_on_host);
    suite_add_tcase(s, tc);
    return check_run(s, CK_FORK_GETENV);
}
