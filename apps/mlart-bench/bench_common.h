/* mlart-bench: shared timing, roofline and table/JSON printing for the
 * benchmark suites (bench_*.cu).  A suite declares its rows, times each
 * candidate with mlart_bench_time and prints fixed-width rows
 * (nccl-tests style: a header, a units row, one line per shape).
 *
 * Timing: the enqueue callback is captured once per input set into one CUDA
 * graph (set 0, 1, ..., n-1 in order); each replay is timed with CUDA events
 * and divided by n; the result is the median over replays.  The sets rotate
 * so that their bytes exceed the L2 cache (mlart_bench_sets): each launch
 * streams its operands from HBM as it would in a decode step. */
#ifndef MLART_BENCH_COMMON_H
#define MLART_BENCH_COMMON_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "mlart/mlart.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mlart_bench_opts {
    const char *filter; /* run rows whose name contains this; NULL = all */
    FILE *json;         /* rows appended as JSON objects; NULL = none */
    int reps;           /* timed replays per measurement (median) */
    int warmup;         /* untimed replays first */
    int variants;       /* also time kernel variants (tuning tables) */
    int sets;           /* > 0: rotate over exactly this many input sets (--sets) */
    int device;
    int sms;            /* multiprocessors */
    size_t l2_bytes;    /* L2 cache size */
    double copy_gbs;    /* device-to-device copy, GB/s of bytes read + written, this run */
    char gpu[256];      /* device name */
} mlart_bench_opts;

/* Run a CUDA call; on failure print it with `who` ("mlart-bench attn") and
 * jump to the caller's `fail` label. */
#define MLART_BENCH_CHECK(who, stmt)                                                           \
    do {                                                                                       \
        cudaError_t e_ = (stmt);                                                               \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s: %s: %s\n", who, #stmt, cudaGetErrorString(e_));                \
            goto fail;                                                                         \
        }                                                                                      \
    } while (0)

/* Release what a graph measurement holds: end a capture still open on
 * `stream` (capturing nonzero) and drop its graph and the sticky error, then
 * destroy `exec` and `graph` where set. */
void mlart_bench_graph_release(cudaStream_t stream, int capturing, cudaGraph_t graph, cudaGraphExec_t exec);

/* Enqueue one operation on `stream` using input set `set`.  0 or nonzero. */
typedef int (*mlart_bench_enqueue_fn)(void *ctx, int set, cudaStream_t stream);

/* Median microseconds of one operation, over opts->reps graph replays of
 * the nsets-long rotation (see above).  0 on success; -1 with a message on
 * stderr if capture, launch or the callback failed. */
int mlart_bench_time(const mlart_bench_opts *o, mlart_bench_enqueue_fn fn, void *ctx, int nsets, double *us);

/* Input sets to rotate so that nsets * bytes_per_set >= 3 * L2: at least
 * min_sets, at most 128; opts->sets when that is set. */
int mlart_bench_sets(const mlart_bench_opts *o, size_t bytes_per_set, int min_sets);

/* Measure the device-to-device copy roofline (1 GiB cudaMemcpyAsync in a
 * graph, bytes read + written) into o->copy_gbs.  0 or -1. */
int mlart_bench_copy_roofline(mlart_bench_opts *o);

/* splitmix64: the next draw from state *s (host side). */
static inline uint64_t mlart_bench_rand(uint64_t *s)
{
    uint64_t x = (*s += 0x9E3779B97F4A7C15ull);
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* Fill n bf16 values at p with uniform [-1, 1) from a hash of seed and index. */
int mlart_bench_fill_bf16(void *p, size_t n, uint64_t seed, cudaStream_t stream);

/* A 3-d bf16 view on device 0: shape d0 x d1 x d2, strides s0, s1, 1
 * (elements), inside the allocation [base, base + extent bytes). */
mlart_tensor mlart_bench_view3(void *data, void *base, size_t extent, int64_t d0, int64_t d1, int64_t d2,
                               int64_t s0, int64_t s1);

/* 1 if `name` passes the --filter. */
int mlart_bench_match(const mlart_bench_opts *o, const char *name);

/* A fixed-width table: a name column, then numeric columns. */
typedef struct mlart_bench_col {
    const char *name; /* header and JSON key */
    const char *unit; /* units row ("us", "GB/s", "x", "") */
    int width;
    int prec;         /* digits after the point */
} mlart_bench_col;

typedef struct mlart_bench_table {
    const char *title;
    const char *name_head; /* header of the name column */
    int name_width;
    const mlart_bench_col *cols;
    int ncols;
} mlart_bench_table;

/* Title, header and units rows. */
void mlart_bench_table_head(const mlart_bench_opts *o, const mlart_bench_table *t);
/* One row: name and ncols values (NAN prints "-" and JSON null); appended
 * to the JSON file as {"table":..., "name":..., <col>: value, ...}. */
void mlart_bench_table_row(const mlart_bench_opts *o, const mlart_bench_table *t, const char *name,
                           const double *vals);
/* Rows printed so far by mlart_bench_table_row (every table's rows). */
int mlart_bench_rows(void);
/* A free-form summary line, also stored in the JSON as {"summary": line}. */
void mlart_bench_summary(const mlart_bench_opts *o, const char *table, const char *line);
/* Writes s to f as a JSON string, quotes included: double quotes and
 * backslashes escaped, control characters as backslash-u escapes (a GPU
 * name is written as the driver gives it). */
void mlart_bench_json_str(FILE *f, const char *s);

/* Suites: each returns the number of wrong results it found (0 = all
 * values checked out) or -1 if it could not run. */
int mlart_bench_ops(const mlart_bench_opts *o);
/* The cache write on each of its paths (bench_kvw.cu): rows "kv_write ...". */
int mlart_bench_kvw(const mlart_bench_opts *o);
/* The dependent latencies of a decode step (bench_lat.cu): rows "latency ...". */
int mlart_bench_lat(const mlart_bench_opts *o);
/* One rank's layer step under DCP against the plain step (bench_dcp.cu): rows "dcp ...". */
int mlart_bench_dcp(const mlart_bench_opts *o);
/* A decode step through the graph cache against direct launches (bench_graphs.cu): rows "graphs ...". */
int mlart_bench_graphs(const mlart_bench_opts *o);
#ifdef MLART_BENCH_ATTN
int mlart_bench_attn(const mlart_bench_opts *o);
#endif

#ifdef __cplusplus
}
#endif
#endif /* MLART_BENCH_COMMON_H */
