/* Host-side invariants of the b12x_mla_sparse work split (no device
 * needed): for every T, head count and top-k the backend serves, the chunks
 * cover the top-k list exactly, stay within the kernel's limits, and the
 * workspace the launch needs never exceeds what plan() sized for a larger
 * max_tokens; the model picks the split counts measured fastest; and the
 * in-place combine's rule (b12x_attend_inplace_ok) takes a step only when
 * each launch's grid is resident at once and its combine takes at most
 * max_trips L2 round trips, within the barrier words setup allocates; and
 * the column-halves rule (b12x_attend_halves). */
#include <check.h>
#include <stdio.h>

#include "check_run.h"
#include "backends/b12x_mla_sparse/b12x_attend.h"

START_TEST(test_split_covers_topk)
{
    static const int sms[] = {1, 78, 132, 144};
    static const int heads[] = {1, 11, 16, 17, 32, 40, 63, 64, 65, 100, 128};
    static const int topks[] = {1, 31, 32, 64, 100, 576, 2047, 2048};
    int checked = 0;
    for (int fp8 = 0; fp8 < 2; fp8++)
    for (size_t a = 0; a < sizeof sms / sizeof sms[0]; a++)
        for (size_t b = 0; b < sizeof heads / sizeof heads[0]; b++)
            for (size_t c = 0; c < sizeof topks / sizeof topks[0]; c++) {
                const int nblk = (topks[c] + 31) / 32;
                size_t most = 0;
                for (int T = 1; T <= 96; T++) {
                    b12x_split sp = b12x_attend_split(T, heads[b], topks[c], fp8, sms[a]);
                    ck_assert_int_ge(sp.splits, 1);
                    ck_assert_int_le(sp.splits, 64);
                    ck_assert_int_ge(sp.blocks_per_split, 1);
                    /* every block in exactly one chunk, no empty chunk */
                    ck_assert_int_ge(sp.splits * sp.blocks_per_split, nblk);
                    ck_assert_int_lt((sp.splits - 1) * sp.blocks_per_split, nblk);
                    ck_assert_int_le(sp.blocks_per_split * 32, B12X_MAX_TOPK);
                    size_t ws = b12x_attend_workspace(T, heads[b], topks[c], fp8, sms[a]);
                    if (sp.splits == 1)
                        ck_assert_uint_eq(ws, 0);
                    else
                        ck_assert_uint_eq(ws, (size_t)sp.splits * T * heads[b] * (512 * 2 + 4));
                    if (ws > most)
                        most = ws;
                    checked++;
                }
                ck_assert_msg(most < ((size_t)1 << 31), "workspace %zu bytes", most);
            }
    printf("attn split: %d (format, T, heads, topk, SMs) cases cover the top-k list exactly within limits\n",
           checked);
}
END_TEST

/* The shapes of the bench and the issue: no split where one wave is full,
 * enough blocks to fill the GPU where T is small. */
START_TEST(test_split_choices)
{
    for (int fp8 = 0; fp8 < 2; fp8++) {
        b12x_split sp = b12x_attend_split(64, 128, 2048, fp8, 132);
        ck_assert_int_eq(sp.splits, 1); /* 128 blocks already fill 132 SMs */
        for (int T = 1; T <= 8; T *= 2) {
            sp = b12x_attend_split(T, 16, 2048, fp8, 132);
            ck_assert_msg(T * sp.splits >= 64, "T=%d: %d splits leave the GPU idle", T, sp.splits);
            ck_assert_msg(T * sp.splits <= 264, "T=%d: %d splits, more than two waves", T, sp.splits);
        }
    }
    printf("attn split: 128 heads x 64 tokens in one pass, small T split to fill the GPU\n");
}
END_TEST

/* The split counts that were clearly fastest on the H200 (132 SMs, topk
 * 2048, the next best at least 2% slower): forced 1-5, 8, 16, 32 and 64
 * splits in mlart-bench's variants table (docs/PERF.md, attention).
 * Both formats agreed at the first 21 shapes (runs of 2026-12-01
 * 13:15-13:17 UTC); the 16-head rows for one format only are from the run
 * of 15:07 UTC (T = 1..300), where the formats disagree.  A change to the
 * kernels or the model that moves one of these should be measured again,
 * and this table with it. */
START_TEST(test_split_measured_best)
{
    enum { BOTH = -1, BF16 = 0, FP8 = 1 };
    static const struct {
        int fmt, heads, T, splits;
    } best[] = {
        {BOTH, 16, 1, 64},  {BOTH, 16, 2, 64},  {BOTH, 16, 4, 32},  {BOTH, 16, 8, 16},  {BOTH, 16, 16, 8},
        {BOTH, 16, 32, 4},  {BOTH, 16, 64, 2},  {BOTH, 64, 1, 64},  {BOTH, 64, 2, 32},  {BOTH, 64, 4, 32},
        {BOTH, 64, 8, 16},  {BOTH, 64, 16, 8},  {BOTH, 64, 48, 5},  {BOTH, 64, 96, 4},  {BOTH, 128, 1, 32},
        {BOTH, 128, 2, 32}, {BOTH, 128, 4, 16}, {BOTH, 128, 8, 8},  {BOTH, 128, 16, 4}, {BOTH, 128, 24, 5},
        {BOTH, 128, 47, 4}, {BF16, 16, 48, 2},  {BF16, 16, 75, 3},  {BF16, 16, 200, 1}, {FP8, 16, 48, 5},
        {FP8, 16, 200, 3},
    };
    int checked = 0;
    for (size_t i = 0; i < sizeof best / sizeof best[0]; i++)
        for (int fp8 = 0; fp8 < 2; fp8++) {
            if (best[i].fmt != BOTH && best[i].fmt != fp8)
                continue;
            /* the 64- and 128-head rows at T = 1..3 and 1 were measured on the
             * wgmma kernel; the launch now runs those steps in 16-row tiles
             * (test_split_small_tiles) */
            if (best[i].heads > 16 && best[i].T * ((best[i].heads + 15) / 16) <= 12)
                continue;
            const b12x_split sp = b12x_attend_split(best[i].T, best[i].heads, 2048, fp8, 132);
            ck_assert_msg(sp.splits == best[i].splits, "%s %d heads T=%d: model takes %d splits, measured best %d",
                          fp8 ? "fp8" : "bf16", best[i].heads, best[i].T, sp.splits, best[i].splits);
            checked++;
        }
    printf("attn split: the model takes the measured best count at %d (format, shape) points\n", checked);
}
END_TEST

/* A step of more than 16 heads whose 16-row tiles number at most 12 over
 * its tokens, or that has two of them and at most 64 tokens, or that has
 * 65..127 heads and at most 6 tokens, runs on the small-head kernel in
 * those tiles, and the split is then the one of a step of 16 heads and T x
 * tiles tokens; other steps keep the model of their 64-head tiles (default
 * kernel modes). */
START_TEST(test_split_small_tiles)
{
    int small = 0, other = 0;
    for (int fp8 = 0; fp8 < 2; fp8++)
        for (int H = 17; H <= 128; H++)
            for (int T = 1; T <= 80; T++) {
                const int rt = (H + 15) / 16;
                const b12x_split a = b12x_attend_split(T, H, 2048, fp8, 132);
                if (T * rt <= 12 || (rt == 2 && T <= 64) || (H > 64 && H < 128 && T <= 6)) {
                    const b12x_split b = b12x_attend_split(T * rt, 16, 2048, fp8, 132);
                    ck_assert_msg(a.splits == b.splits && a.blocks_per_split == b.blocks_per_split,
                                  "H=%d T=%d: %d splits, a 16-head step of %d tokens %d", H, T, a.splits, T * rt,
                                  b.splits);
                    small++;
                } else {
                    other++;
                }
            }
    /* 32 heads at one token: two tiles, the split of 16 heads at T = 2 (64) */
    ck_assert_int_eq(b12x_attend_split(1, 32, 2048, 0, 132).splits, 64);
    ck_assert_int_eq(b12x_attend_split(1, 32, 2048, 1, 132).splits, 64);
    /* 64 heads at one token: four tiles, the split of 16 heads at T = 4 (32) */
    ck_assert_int_eq(b12x_attend_split(1, 64, 2048, 0, 132).splits, 32);
    /* 80 heads at 6 tokens: five tiles, the split of 16 heads at T = 30 */
    ck_assert_int_eq(b12x_attend_split(6, 80, 2048, 0, 132).splits, b12x_attend_split(30, 16, 2048, 0, 132).splits);
    ck_assert_int_eq(b12x_attend_split(6, 80, 2048, 1, 132).splits, b12x_attend_split(30, 16, 2048, 1, 132).splits);
    /* at 7 tokens two launches, each split for its own 7 pairs: 16 splits,
     * 112 blocks a launch (the same as 64 heads at 7 tokens) */
    ck_assert_int_eq(b12x_attend_split(7, 80, 2048, 0, 132).splits, b12x_attend_split(7, 64, 2048, 0, 132).splits);
    ck_assert_int_eq(b12x_attend_split(7, 100, 2048, 1, 132).splits, b12x_attend_split(7, 64, 2048, 1, 132).splits);
    printf("attn split: %d steps of 17..128 heads split as 16-row tiles, %d as 64-head tiles\n", small, other);
}
END_TEST

/* The rule on a device like the H200 (132 multiprocessors, one block of
 * each kernel on each), with the default kernel modes (setup not run:
 * MLART_B12X_WGMMA=1, no slots-as-M prototype).  The barrier array is
 * never dereferenced here. */
START_TEST(test_inplace_rule)
{
    static unsigned words[132 * 32];
    b12x_dev dev = {.num_sms = 132, .resident = 132, .resident_wg = 132, .resident_gen = 132, .bar = words,
                    .inplace = 1, .max_trips = 2};
    /* <= 16 heads: one small-head launch, T x splits blocks */
    ck_assert(b12x_attend_inplace_ok(&dev, 1, 16, 64));
    ck_assert(b12x_attend_inplace_ok(&dev, 2, 16, 64));  /* 128 blocks */
    ck_assert(!b12x_attend_inplace_ok(&dev, 3, 16, 64)); /* 192 blocks */
    ck_assert(b12x_attend_inplace_ok(&dev, 4, 11, 33));  /* 132: exactly one wave */
    ck_assert(!b12x_attend_inplace_ok(&dev, 1, 16, 1));  /* nothing to combine */
    ck_assert(b12x_attend_inplace_ok(&dev, 66, 1, 2));
    /* multiples of 64 heads past the 16-row tiles' rule (more than 12 tiles
     * over the tokens): the wgmma kernel, T x tiles x splits blocks */
    ck_assert(b12x_attend_inplace_ok(&dev, 4, 64, 32));   /* 128 blocks */
    ck_assert(!b12x_attend_inplace_ok(&dev, 4, 64, 64));  /* 256 */
    ck_assert(b12x_attend_inplace_ok(&dev, 2, 128, 32));  /* 128 */
    ck_assert(!b12x_attend_inplace_ok(&dev, 2, 128, 64)); /* 256 */
    ck_assert(!b12x_attend_inplace_ok(&dev, 75, 128, 2));
    /* a full and a partial tile past the 16-row tiles' rule (more than 16
     * tokens): two launches, each grid resident by itself; so few splits
     * combine in more round trips than the default cap, lifted here */
    dev.max_trips = 64;
    ck_assert(b12x_attend_inplace_ok(&dev, 17, 80, 7));   /* 119 + 119 blocks */
    ck_assert(b12x_attend_inplace_ok(&dev, 17, 127, 7));  /* the same, wgmma twice */
    ck_assert(!b12x_attend_inplace_ok(&dev, 17, 100, 8)); /* 136 + 136 */
    ck_assert(b12x_attend_inplace_ok(&dev, 16, 80, 7));   /* 112 + 112 */
    ck_assert(!b12x_attend_inplace_ok(&dev, 6, 80, 7));   /* 6 tokens: 16-row tiles */
    dev.max_trips = 2;
    ck_assert(!b12x_attend_inplace_ok(&dev, 17, 80, 7)); /* the 64-head launch's combine: too many trips */
    /* few splits of many rows: a combine of more than two L2 round trips, refused */
    ck_assert(b12x_attend_inplace_ok(&dev, 1, 16, 4));   /* 512 units a block: 2 passes */
    ck_assert(!b12x_attend_inplace_ok(&dev, 1, 16, 2));  /* 1024: 4 */
    ck_assert(b12x_attend_inplace_ok(&dev, 4, 64, 16));  /* 512: 2 */
    ck_assert(!b12x_attend_inplace_ok(&dev, 4, 64, 8));  /* 1024: 4 */
    ck_assert(!b12x_attend_inplace_ok(&dev, 60, 64, 2)); /* resident, but 16 passes */
    ck_assert(b12x_attend_inplace_ok(&dev, 4, 11, 33));  /* 1 pass, 9 splits a lane: 2 batches of 8 */
    dev.max_trips = 1;
    ck_assert(!b12x_attend_inplace_ok(&dev, 4, 11, 33));
    ck_assert(!b12x_attend_inplace_ok(&dev, 1, 16, 4));
    ck_assert(b12x_attend_inplace_ok(&dev, 1, 16, 64));
    dev.max_trips = 16;
    ck_assert(b12x_attend_inplace_ok(&dev, 60, 64, 2)); /* MLART_B12X_INPLACE_TRIPS lifts the cap */
    dev.max_trips = 2;
    /* a kernel without room: every step that has a launch on it */
    dev.resident = 0;
    ck_assert(!b12x_attend_inplace_ok(&dev, 1, 16, 16));
    ck_assert(b12x_attend_inplace_ok(&dev, 4, 64, 16));
    dev.max_trips = 64;
    ck_assert(!b12x_attend_inplace_ok(&dev, 17, 80, 7)); /* 16 heads on a small-head kernel */
    ck_assert(b12x_attend_inplace_ok(&dev, 17, 127, 7)); /* 63 on the wgmma kernel */
    dev.max_trips = 2;
    dev.resident = 132;
    /* the general kernel takes no tile in this mode: partial tiles of
     * 17..32 heads, and of 33..63 from 4 tokens on, run on the wgmma
     * kernel, and the rest in 16-row tiles */
    dev.resident_gen = 0;
    ck_assert(b12x_attend_inplace_ok(&dev, 5, 40, 16));
    ck_assert(b12x_attend_inplace_ok(&dev, 4, 56, 16));
    ck_assert(b12x_attend_inplace_ok(&dev, 4, 64, 16));
    dev.max_trips = 64;
    ck_assert(b12x_attend_inplace_ok(&dev, 17, 100, 7));
    ck_assert(b12x_attend_inplace_ok(&dev, 17, 90, 7));
    dev.max_trips = 2;
    dev.resident_gen = 132;
    dev.resident_wg = 0;
    ck_assert(!b12x_attend_inplace_ok(&dev, 5, 40, 16));
    ck_assert(!b12x_attend_inplace_ok(&dev, 4, 56, 16));
    ck_assert(!b12x_attend_inplace_ok(&dev, 4, 64, 16));
    ck_assert(b12x_attend_inplace_ok(&dev, 4, 16, 16));
    dev.max_trips = 64;
    ck_assert(!b12x_attend_inplace_ok(&dev, 17, 80, 7));
    dev.max_trips = 2;
    dev.resident_wg = 132;
    /* except steps of more than 16 heads whose 16-row tiles number at most
     * 12 over the tokens, or two tiles up to 64 tokens, or 65..127 heads up
     * to 6 tokens: the small-head kernel
     * in tiles, which never combines in place (a token's tiles would share
     * barrier words), whatever room there is */
    ck_assert(!b12x_attend_inplace_ok(&dev, 1, 17, 16));
    ck_assert(!b12x_attend_inplace_ok(&dev, 1, 32, 16));
    ck_assert(!b12x_attend_inplace_ok(&dev, 2, 40, 16));
    ck_assert(!b12x_attend_inplace_ok(&dev, 4, 40, 16));
    ck_assert(!b12x_attend_inplace_ok(&dev, 3, 36, 16));
    ck_assert(!b12x_attend_inplace_ok(&dev, 3, 63, 16));
    ck_assert(!b12x_attend_inplace_ok(&dev, 8, 32, 8));
    ck_assert(!b12x_attend_inplace_ok(&dev, 1, 64, 64));
    ck_assert(!b12x_attend_inplace_ok(&dev, 3, 64, 16));
    ck_assert(!b12x_attend_inplace_ok(&dev, 2, 80, 32));
    ck_assert(!b12x_attend_inplace_ok(&dev, 1, 100, 64));
    ck_assert(!b12x_attend_inplace_ok(&dev, 2, 100, 32));
    ck_assert(!b12x_attend_inplace_ok(&dev, 3, 80, 32));
    ck_assert(!b12x_attend_inplace_ok(&dev, 2, 127, 64));
    ck_assert(!b12x_attend_inplace_ok(&dev, 4, 100, 16));
    ck_assert(!b12x_attend_inplace_ok(&dev, 1, 128, 32));
    /* no barriers: never */
    dev.bar = NULL;
    ck_assert(!b12x_attend_inplace_ok(&dev, 1, 16, 64));
    dev.bar = words;
    /* The largest barrier index a taken step uses, (tile x T + t) x 32,
     * stays inside the words setup allocates (the largest resident count). */
    for (int H = 1; H <= 128; H++)
        for (int T = 1; T <= 132; T++)
            for (int S = 2; S <= 64; S++)
                if (b12x_attend_inplace_ok(&dev, T, H, S)) {
                    const int tiles = (H + 63) / 64;
                    ck_assert_int_le(tiles * T, 132);
                }
    printf("in-place rule: every launch's grid resident at once, at most max_trips combine round trips, barrier words in range\n");
}
END_TEST

/* The column-halves rule (b12x_attend_halves) on a device like the H200,
 * setup not run (MLART_B12X_HALF and MLART_B12X_RC at their defaults):
 * small-head steps that split, at most 8 tokens, the doubled grid within
 * the multiprocessors, never with the in-place combine or on the fp8
 * register-conversion kernel (>= 8 tokens). */
START_TEST(test_halves_rule)
{
    b12x_dev dev = {.num_sms = 132};
    ck_assert(b12x_attend_halves(&dev, 1, 16, 64, 0, 0)); /* 128 blocks */
    ck_assert(b12x_attend_halves(&dev, 1, 16, 64, 1, 0));
    ck_assert(b12x_attend_halves(&dev, 1, 1, 66, 0, 0));  /* 132: exactly one wave */
    ck_assert(!b12x_attend_halves(&dev, 1, 1, 67, 0, 0)); /* 134 */
    ck_assert(!b12x_attend_halves(&dev, 2, 16, 64, 0, 0)); /* 256 */
    ck_assert(b12x_attend_halves(&dev, 2, 16, 32, 0, 0));
    ck_assert(b12x_attend_halves(&dev, 8, 16, 8, 0, 0));
    ck_assert(!b12x_attend_halves(&dev, 8, 16, 8, 1, 0));  /* fp8 >= 8 tokens: the register-conversion kernel */
    ck_assert(b12x_attend_halves(&dev, 7, 16, 8, 1, 0));
    ck_assert(!b12x_attend_halves(&dev, 9, 16, 4, 0, 0));  /* past the short kernel */
    ck_assert(!b12x_attend_halves(&dev, 1, 16, 64, 0, 1)); /* in-place combine */
    ck_assert(!b12x_attend_halves(&dev, 1, 16, 1, 0, 0));  /* no split */
    ck_assert(!b12x_attend_halves(&dev, 1, 17, 64, 0, 0)); /* 16-row tiles of a partial tile: never halves */
    ck_assert(!b12x_attend_halves(&dev, 1, 40, 16, 0, 0));
    ck_assert(!b12x_attend_halves(&dev, 1, 64, 64, 0, 0)); /* 16-row tiles */
    ck_assert(!b12x_attend_halves(&dev, 4, 64, 16, 0, 0)); /* the wgmma kernel */
    ck_assert(!b12x_attend_halves(&dev, 3, 80, 16, 0, 0)); /* 80 heads: 16-row tiles */
    dev.num_sms = 78;
    ck_assert(!b12x_attend_halves(&dev, 1, 16, 64, 0, 0));
    ck_assert(b12x_attend_halves(&dev, 1, 16, 32, 0, 0));
    /* the split the model takes for one token of <= 16 heads and top-k
     * 2048 runs in halves on 132 multiprocessors, not on 78 */
    for (int fp8 = 0; fp8 < 2; fp8++)
        for (int H = 1; H <= 16; H++) {
            const b12x_split a = b12x_attend_split(1, H, 2048, fp8, 132), b = b12x_attend_split(1, H, 2048, fp8, 78);
            dev.num_sms = 132;
            ck_assert_msg(b12x_attend_halves(&dev, 1, H, a.splits, fp8, 0), "H=%d fp8=%d: %d splits", H, fp8, a.splits);
            dev.num_sms = 78;
            ck_assert_int_eq(b12x_attend_halves(&dev, 1, H, b.splits, fp8, 0), 2 * b.splits <= 78);
        }
    printf("halves rule: small-head split steps of <= 8 tokens whose doubled grid fits, none in place or on the fp8 "
           "register-conversion kernel\n");
}
END_TEST

int main(void)
{
    Suite *s = suite_create("attn_split");
    TCase *tc = tcase_create("split");
    tcase_add_test(tc, test_split_covers_topk);
    tcase_add_test(tc, test_split_choices);
    tcase_add_test(tc, test_split_measured_best);
    tcase_add_test(tc, test_split_small_tiles);
    tcase_add_test(tc, test_inplace_rule);
    tcase_add_test(tc, test_halves_rule);
    suite_add_tcase(s, tc);
    return check_run(s, CK_FORK_GETENV);
}
