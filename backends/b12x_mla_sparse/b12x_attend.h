/* Internal interface between the b12x backend's table (b12x_backend.c) and
 * its kernels (b12x_attend.cu).  Nothing outside this folder includes it. */
#ifndef MLART_BACKENDS_B12X_ATTEND_H
#define MLART_BACKENDS_B12X_ATTEND_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "mlart/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The kernels are written for these latent and rope widths (DeepSeek-V3.2
 * and GLM-5 both use them). */
#define B12X_KV_LORA 512
#define B12X_ROPE 64
/* Largest head count and top-k the kernels serve. */
#define B12X_MAX_HEADS 128
#define B12X_MAX_TOPK 2048

/* How one step is cut into thread blocks: `splits` chunks of top-k per
 * (token, head tile), each `blocks_per_split` blocks of 32 slots long. */
typedef struct b12x_split {
    int splits;
    int blocks_per_split;
} b12x_split;

/* The kernel choices read from MLART_B12X_WGMMA, _SWG, _RC and _HALF at
 * create.  They are process-wide (the launch rules read them), so a backend
 * keeps the values its create read and refuses plan and steps once a later
 * create has read others: its workspace was sized by the old rules. */
typedef struct b12x_modes {
    int wgmma, swg, rc, half;
} b12x_modes;
void b12x_modes_now(b12x_modes *m);

/* An MLART_B12X_* value: unset or empty gives def, otherwise the whole
 * value must be a decimal in [lo, hi]; if not, def, and *bad names the
 * variable (when it names none yet) for the create to refuse. */
static inline int b12x_env_choice(const char *name, int def, int lo, int hi, const char **bad)
{
    const char *v = getenv(name);
    char *end;
    long x;
    if (!v || !*v)
        return def;
    x = strtol(v, &end, 10);
    if (*end || x < lo || x > hi) {
        if (!*bad)
            *bad = name;
        return def;
    }
    return (int)x;
}

/* What the launches need to know of the device, from b12x_attend_setup:
 * its multiprocessor count, how many blocks of the small-head kernels
 * (`resident`), of the 64-head wgmma kernel (`resident_wg`) and of the
 * general mma.sync kernel (`resident_gen`) it holds at once, the barrier
 * array of the in-place combine (device memory, the largest of the three
 * counts in words 128 bytes apart, zeroed once), and whether steps use it
 * by default (`inplace`: MLART_B12X_INPLACE=1 when the backend is created;
 * otherwise split steps run the combine kernel), and the most dependent L2
 * round trips its combine may take (`max_trips`: 2, or
 * MLART_B12X_INPLACE_TRIPS); and the kernel choices create read (`modes`). */
typedef struct b12x_dev {
    b12x_modes modes; /* as create read them */
    int num_sms;
    int resident;
    int resident_wg;
    int resident_gen;
    unsigned *bar;
    int inplace;
    int max_trips;
    /* when set (the backend hands over its init's log), every launch is
     * reported at MLART_LOG_DEBUG: the kernel by name, its grid and the
     * split (b12x_attend_launch_tuned); setup leaves it NULL */
    mlart_log_fn log;
} b12x_dev;

/* Prepare the kernels on the current device (shared-memory limits), fill
 * *dev and allocate its barrier array.  Returns 0 or a negative status;
 * b12x_attend_teardown frees what setup allocated (accepts a zeroed dev). */
int b12x_attend_setup(b12x_dev *dev, mlart_error_fn err);
void b12x_attend_teardown(b12x_dev *dev);
/* Whether a step of T tokens, `heads` heads and `splits` chunks can
 * combine in place: the grid of each of its launches (the full 64-head
 * tiles, then the last partial tile) fits on the device at once, none of
 * them is the slots-as-M prototype, each tile's combine takes at most
 * dev->max_trips dependent L2 round trips (few splits of many rows take
 * more), and setup allocated the barriers.  1 or 0. */
int b12x_attend_inplace_ok(const b12x_dev *dev, int T, int heads, int splits);
/* Whether the launch runs the chunks of a step of T tokens, `heads` heads
 * and `splits` chunks in column halves (two blocks a chunk, each with half
 * of the 512 output columns): a small-head step (<= 16 heads) that splits,
 * combines with the combine kernel (`inplace` 0), has at most 8 tokens and
 * is not on the fp8 register-conversion kernel, whose doubled grid fits
 * dev->num_sms, unless MLART_B12X_HALF=0 when setup ran.  1 or 0. */
int b12x_attend_halves(const b12x_dev *dev, int T, int heads, int splits, int fp8, int inplace);
/* The split chosen for T tokens: a function of T, heads, topk, the cache
 * format (`fp8`: fp8_ds_mla, else bf16) and the multiprocessor count
 * only, so plan() and attend() agree. */
b12x_split b12x_attend_split(int T, int heads, int topk, int fp8, int num_sms);
/* Workspace bytes attend() needs for T tokens (0 when it does not split). */
size_t b12x_attend_workspace(int T, int heads, int topk, int fp8, int num_sms);
/* The sparse attention of one step on `stream`.  Views were validated by
 * the runtime; this checks only what the kernels assume about alignment. */
int b12x_attend_launch(const mlart_step *s, const b12x_dev *dev, void *stream, mlart_error_fn err);

/* Tuning hook (mlart-bench's attention variants table; zeros select what
 * b12x_attend_launch does): `splits` forces the chunk count (<= 64, the
 * workspace must hold it: splits x T x H x (512 bf16 + 1 float)); `parts`
 * 1 = the main kernel only (no combine of either kind), 2 = the combine
 * kernel only, 3 = both; `combine` 1 = whole-row combine blocks, 2 =
 * quarter-row blocks; `pdl` 0 launches without programmatic dependent
 * launch; `combine_spread` 1 caps the combine at two blocks a
 * multiprocessor, -1 leaves it uncapped; `inplace` 1 combines inside the
 * attention kernels (an error where b12x_attend_inplace_ok refuses the
 * step, or with parts = 2), -1 runs the combine kernel, 0 follows
 * b12x_dev.inplace; `cb_trigger` 1 lets the combine kernel's dependents
 * launch before its dependency wait, -1 after it, 0 as the launch
 * decides (before, where the combine is capped); `tile` 1 runs a partial
 * head tile of 17..63 heads on the general mma.sync kernel, 2 on the wgmma
 * kernel (1 and 2: the full 64-head tiles on their kernel, never in 16-row
 * tiles), 3 the whole step of more than 16 heads on the small-head kernel
 * in 16-row tiles (split as a step of <= 16 heads and T x tiles tokens), 0
 * as the launch decides (with 1..3 the step runs the combine kernel, never
 * the in-place one). */
typedef struct b12x_tune {
    int splits;
    int parts;
    int combine;
    int pdl;
    int combine_spread;
    int inplace;
    int cb_trigger;
    int tile;
} b12x_tune;
int b12x_attend_launch_tuned(const mlart_step *s, const b12x_dev *dev, const b12x_tune *tune, void *stream,
                             mlart_error_fn err);

/* The wgmma kernel (b12x_wgmma.cu, sm_90a) for tiles of up to 64 heads.
 * Setup raises its shared-memory limit and reads MLART_B12X_WGMMA (0: never
 * used, 1: full 64-head tiles, partial tiles of 17..32 heads and, in steps
 * of at least 4 tokens, of 33..63 heads, unless the step (more than 16
 * heads) runs whole in 16-row tiles on the small-head kernel (at most 12
 * such tiles over its tokens, or two tiles and at most 64 tokens, or 65..127
 * heads and at most 6 tokens; only in mode 1), 2: every tile; default 1) for
 * b12x_wgmma_mode().  Launch covers head tiles [tile_base, tile_base +
 * tiles) of the step with the given split (bf16 partials, as bits, into
 * ws_o and their fp32 LSEs into ws_lse, in the mma.sync kernel's layout,
 * when splits > 1; the caller runs the combine kernel unless `bar`).  They
 * return a cudaError_t. */
int b12x_wgmma_setup(const char **bad_env);
int b12x_wgmma_mode(void);
size_t b12x_wgmma_smem(void);
/* Blocks of its in-place instantiations a multiprocessor holds at once. */
int b12x_wgmma_resident(int *per_sm);
/* `bar` non-NULL: the instantiation that combines in place (the caller
 * checked that the grid is resident at once and runs no combine kernel). */
int b12x_wgmma_launch(const mlart_step *s, int splits, int blocks_per_split, int tile_base,
                      int tiles, uint16_t *ws_o, float *ws_lse, unsigned *bar, int pdl, void *stream);
/* Prototype, opt-in (MLART_B12X_SWG=1 when the backend is created, read
 * by b12x_wgmma_setup): one tile of <= 16 heads, both formats, on the
 * slots-as-M wgmma kernel (b12x_wgmma.cu); same split, partials and
 * combine.  Launch returns a cudaError_t. */
int b12x_swg_mode(void);
int b12x_swg_launch(const mlart_step *s, int splits, int blocks_per_split, int tile_base,
                    uint16_t *ws_o, float *ws_lse, int pdl, void *stream);

#ifdef __cplusplus
}
#endif
#endif
