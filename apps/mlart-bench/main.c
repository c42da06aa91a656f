/* mlart-bench: benchmarks of the mlart ops and attention backends on one GPU.
 *
 *   mlart-bench [--filter STR] [--json FILE] [--reps N] [--warmup N]
 *               [--variants] [--device N] [--sets N]
 *
 * Suites: the ops against cuBLAS (bench_ops.cu), the cache write on each of
 * its paths (bench_kvw.cu), the attention backends
 * (bench_attn.cu) and the latencies a decode step is made of (bench_lat.cu).
 * Prints one fixed-width table per suite (units row under the header), a
 * summary line per table, and with --json the same rows as a JSON array.
 * Exit code: 0 when every result checked out, 1 when some value was wrong
 * or the table or the JSON file could not be written, 2 on a usage or device
 * error or when --filter left no row to measure. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_common.h"

/* Bounds of the numeric options; --help prints them. */
#define BENCH_REPS_MAX 100000
#define BENCH_WARMUP_MAX 100000
#define BENCH_SETS_MAX 128

static void usage(FILE *f)
{
    fprintf(f, "usage: mlart-bench [--filter STR] [--json FILE] [--reps N] [--warmup N] [--variants] [--device N]\n"
               "                   [--sets N]\n"
               "  --filter STR  only rows whose name contains STR (e.g. 'qbmm H128', 'v_up', 'latency'); alternatives\n"
               "                separated by '|', one ending in '$' matches the end of a name ('H16 bf16 T1$')\n"
               "  --json FILE   also write every row as JSON\n"
               "  --reps N      timed graph replays per measurement, median reported (1..%d, default 25)\n"
               "  --warmup N    untimed replays first (0..%d, default 3)\n"
               "  --variants    also time kernel variants (the ops' and the attention's tuning tables)\n"
               "  --device N    CUDA device (0..%d, default 0)\n"
               "  --sets N      rotate over exactly N input sets (1..%d) instead of enough to exceed\n"
               "                3x the L2 cache; small shapes then stay in L2 (for comparing with\n"
               "                numbers measured that way, not for the tables in docs/PERF.md)\n"
               "An option's value may not begin with '--'.\n",
            BENCH_REPS_MAX, BENCH_WARMUP_MAX, INT_MAX - 1, BENCH_SETS_MAX);
}

/* The value of `opt` as an int in lo..hi: a whole decimal number, nothing
 * after it.  0, or -1 with a message naming the option and the value. */
static int parse_int(const char *opt, const char *v, long lo, long hi, int *out)
{
    char *end;
    long n;
    errno = 0;
    n = strtol(v, &end, 10);
    /* strtol would skip leading blanks and take a '+': the value must start with the number */
    if (((*v < '0' || *v > '9') && *v != '-') || end == v || *end || errno == ERANGE || n < lo || n > hi) {
        fprintf(stderr, "mlart-bench: %s '%s': expected a whole number in %ld..%ld\n", opt, v, lo, hi);
        return -1;
    }
    *out = (int)n;
    return 0;
}

/* Write the closing bracket and close the JSON file; every exit after the
 * file is opened goes through here, so the file is always a complete array
 * (holding the rows measured so far).  0, or -1 with a message when some
 * write failed. */
static int json_close(FILE *f, const char *path)
{
    int bad;
    errno = 0;
    fprintf(f, "\n]\n");
    bad = ferror(f);
    if (fclose(f) != 0 || bad) {
        fprintf(stderr, "mlart-bench: writing %s failed%s%s\n", path, errno ? ": " : "", errno ? strerror(errno) : "");
        return -1;
    }
    return 0;
}

/* Flush stdout before exiting with rc: a table that was not written makes
 * a run that would have passed fail (1). */
static int finish(int rc)
{
    errno = 0;
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "mlart-bench: writing the output failed%s%s\n", errno ? ": " : "", errno ? strerror(errno) : "");
        return rc ? rc : 1;
    }
    return rc;
}

int main(int argc, char **argv)
{
    mlart_bench_opts o;
    struct cudaDeviceProp prop;
    const char *json_path = NULL;
    int ndev = 0, wrong = 0, rc, drv = 0, rt = 0, json_bad = 0;
    char stamp[64];
    time_t now = time(NULL);
    memset(&o, 0, sizeof o);
    o.reps = 25;
    o.warmup = 3;
    /* every argument is checked here, before the first CUDA call */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int takes = !strcmp(a, "--filter") || !strcmp(a, "--json") || !strcmp(a, "--reps") ||
                    !strcmp(a, "--warmup") || !strcmp(a, "--device") || !strcmp(a, "--sets");
        if (takes && (!v || !strncmp(v, "--", 2))) {
            /* "--filter --variants" is a forgotten value, not a filter */
            if (v)
                fprintf(stderr, "mlart-bench: %s needs a value, got the option '%s'\n", a, v);
            else
                fprintf(stderr, "mlart-bench: %s needs a value\n", a);
            usage(stderr);
            return 2;
        }
        if (!strcmp(a, "--filter")) {
            o.filter = v;
            i++;
        } else if (!strcmp(a, "--json")) {
            json_path = v;
            i++;
        } else if (!strcmp(a, "--reps")) {
            if (parse_int(a, v, 1, BENCH_REPS_MAX, &o.reps))
                return 2;
            i++;
        } else if (!strcmp(a, "--warmup")) {
            if (parse_int(a, v, 0, BENCH_WARMUP_MAX, &o.warmup))
                return 2;
            i++;
        } else if (!strcmp(a, "--device")) {
            if (parse_int(a, v, 0, INT_MAX - 1, &o.device))
                return 2;
            i++;
        } else if (!strcmp(a, "--sets")) {
            if (parse_int(a, v, 1, BENCH_SETS_MAX, &o.sets))
                return 2;
            i++;
        } else if (!strcmp(a, "--variants")) {
            o.variants = 1;
        } else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return finish(0);
        } else {
            fprintf(stderr, "mlart-bench: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev <= o.device) {
        fprintf(stderr, "mlart-bench: no CUDA device %d\n", o.device);
        return 2;
    }
    if (cudaSetDevice(o.device) != cudaSuccess || cudaGetDeviceProperties(&prop, o.device) != cudaSuccess) {
        fprintf(stderr, "mlart-bench: cannot use device %d\n", o.device);
        return 2;
    }
    snprintf(o.gpu, sizeof o.gpu, "%s", prop.name);
    o.sms = prop.multiProcessorCount;
    o.l2_bytes = (size_t)prop.l2CacheSize;
    cudaDriverGetVersion(&drv);
    cudaRuntimeGetVersion(&rt);
    strftime(stamp, sizeof stamp, "%Y-%m-%d %H:%M:%S UTC", gmtime(&now));
    printf("# mlart-bench %s\n# %s, %d SMs, L2 %zu MiB, sm_%d%d, driver %d, runtime %d\n# command:", stamp, o.gpu,
           o.sms, o.l2_bytes >> 20, prop.major, prop.minor, drv, rt);
    for (int i = 0; i < argc; i++)
        printf(" %s", argv[i]);
    if (o.sets)
        printf("\n# timing: CUDA events around graph replays of a rotation of %d input sets (--sets: small "
               "shapes stay in L2); median of %d\n",
               o.sets, o.reps);
    else
        printf("\n# timing: CUDA events around graph replays of a rotation of input sets larger than L2; median of "
               "%d\n",
               o.reps);
    if (json_path) {
        o.json = fopen(json_path, "w");
        if (!o.json) {
            fprintf(stderr, "mlart-bench: cannot write %s: %s\n", json_path, strerror(errno));
            return finish(2);
        }
        fprintf(o.json, "[\n  {\"date\": \"%s\", \"gpu\": ", stamp);
        mlart_bench_json_str(o.json, o.gpu);
        fprintf(o.json, ", \"sms\": %d, \"l2_bytes\": %zu, \"reps\": %d, \"sets\": %d}", o.sms,
                o.l2_bytes, o.reps, o.sets);
    }
    if (mlart_bench_copy_roofline(&o)) {
        fprintf(stderr, "mlart-bench: copy roofline failed\n");
        if (o.json)
            json_close(o.json, json_path);
        return finish(2);
    }
    printf("# device-to-device copy roofline: %.0f GB/s (1 GiB, best of cudaMemcpyAsync and an SM copy kernel, bytes read + written)\n", o.copy_gbs);
    if (o.json)
        fprintf(o.json, ",\n  {\"copy_roofline_gbs\": %.1f}", o.copy_gbs);

    rc = mlart_bench_ops(&o);
    wrong += rc > 0 ? rc : 0;
    if (rc < 0)
        wrong++;
    rc = mlart_bench_kvw(&o);
    wrong += rc > 0 ? rc : 0;
    if (rc < 0)
        wrong++;
#ifdef MLART_BENCH_ATTN
    rc = mlart_bench_attn(&o);
    wrong += rc > 0 ? rc : 0;
    if (rc < 0)
        wrong++;
#endif
    rc = mlart_bench_lat(&o);
    wrong += rc > 0 ? rc : 0;
    if (rc < 0)
        wrong++;
    rc = mlart_bench_dcp(&o);
    wrong += rc > 0 ? rc : 0;
    if (rc < 0)
        wrong++;
    rc = mlart_bench_graphs(&o);
    wrong += rc > 0 ? rc : 0;
    if (rc < 0)
        wrong++;
    if (o.json && json_close(o.json, json_path))
        json_bad = 1;
    printf("\n# wrong results: %d\n", wrong);
    if (mlart_bench_rows() == 0) {
        /* nothing measured: a filter that names no row (the tuning tables'
         * rows exist only with --variants) must not pass for a clean run */
        fprintf(stderr, "mlart-bench: no row matched --filter '%s'%s\n", o.filter ? o.filter : "",
                o.variants ? "" : " (the tuning tables' rows need --variants)");
        return finish(2);
    }
    return finish(wrong || json_bad ? 1 : 0);
}
