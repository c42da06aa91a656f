/* Shared helpers of the reference tests: a seeded generator, poisoned
 * storage with sentinel checks, views over it, and file loading. */
#ifndef MLART_TESTS_REF_UTIL_H
#define MLART_TESTS_REF_UTIL_H

#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mlart/mlart.h"
#include "ops/numerics.h"

#define REF_POISON 0xA5u

/* ---- random numbers (splitmix64) ---------------------------------------- */
static uint64_t ref_rng_state;

static inline uint64_t ref_rand_u64(void)
{
    uint64_t z = (ref_rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
/* uniform in [0, n) */
static inline int64_t ref_rand_int(int64_t n)
{
    return n > 0 ? (int64_t)(ref_rand_u64() % (uint64_t)n) : 0;
}
/* uniform in [-1, 1) */
static inline double ref_rand_sym(void)
{
    return (double)(ref_rand_u64() >> 11) * 0x1p-52 - 1.0;
}
static inline uint16_t ref_rand_bf16(double amp)
{
    return mlart_f32_to_bf16((float)(amp * ref_rand_sym()));
}

/* Seed from MLART_TEST_SEED or the clock; printed so a failure can be rerun. */
static inline uint64_t ref_seed_init(const char *test)
{
    const char *e = getenv("MLART_TEST_SEED");
    uint64_t seed = e ? strtoull(e, NULL, 0) : (uint64_t)time(NULL) ^ ((uint64_t)clock() << 20);
    ref_rng_state = seed;
    printf("%s: seed %" PRIu64 " (rerun with MLART_TEST_SEED=%" PRIu64 ")\n", test, seed, seed);
    fflush(stdout);
    return seed;
}

/* ---- poisoned storage ---------------------------------------------------- */
/* A storage block of `bytes` plus guard bytes on both sides, all poisoned. */
typedef struct ref_buf {
    uint8_t *alloc;
    uint8_t *p; /* start of the usable storage */
    size_t bytes, guard;
} ref_buf;

static inline ref_buf ref_buf_new(size_t bytes)
{
    ref_buf b;
    b.guard = 64;
    b.bytes = bytes;
    b.alloc = malloc(bytes + 2 * b.guard);
    if (!b.alloc) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    memset(b.alloc, REF_POISON, bytes + 2 * b.guard);
    b.p = b.alloc + b.guard;
    return b;
}
static inline void ref_buf_free(ref_buf *b)
{
    free(b->alloc);
    b->alloc = b->p = NULL;
}

/* A view into b at element offset `off` (of dtype), base/extent = the whole storage. */
static inline mlart_tensor ref_view(const ref_buf *b, mlart_dtype dt, int64_t off, int ndim,
                                    const int64_t *shape, const int64_t *stride)
{
    mlart_tensor t;
    memset(&t, 0, sizeof t);
    t.data = b->p + (size_t)off * mlart_dtype_size(dt);
    t.dtype = dt;
    t.ndim = ndim;
    for (int i = 0; i < ndim; i++) {
        t.shape[i] = shape[i];
        t.stride[i] = stride[i];
    }
    t.base = b->p;
    t.extent = b->bytes;
    t.device = -1;
    return t;
}

/* Mark in `mask` (one byte per storage byte, guards included) the bytes of
 * every element of view t over buffer b. */
static inline void ref_mark_elements(const ref_buf *b, const mlart_tensor *t, uint8_t *mask)
{
    int64_t idx[MLART_MAX_DIMS] = {0}, n = mlart_tensor_numel(t);
    size_t es = mlart_dtype_size(t->dtype);
    for (int64_t e = 0; e < n; e++) {
        int64_t off = 0;
        for (int d = 0; d < t->ndim; d++)
            off += idx[d] * t->stride[d];
        memset(mask + ((uint8_t *)t->data - b->alloc) + (size_t)off * es, 1, es);
        for (int d = t->ndim - 1; d >= 0; d--) {
            if (++idx[d] < t->shape[d])
                break;
            idx[d] = 0;
        }
    }
}

/* Number of bytes of b (guards included) outside the marked elements that
 * lost their poison. */
static inline size_t ref_count_stray(const ref_buf *b, const uint8_t *mask)
{
    size_t n = 0, total = b->bytes + 2 * b->guard;
    for (size_t i = 0; i < total; i++)
        if (!mask[i] && b->alloc[i] != REF_POISON)
            n++;
    return n;
}

/* ---- files ----------------------------------------------------------------- */
static inline void *ref_read_file(const char *dir, const char *name, size_t *len)
{
    char path[1024];
    FILE *f;
    long n;
    void *p;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    p = malloc((size_t)n + 1);
    if (p && fread(p, 1, (size_t)n, f) != (size_t)n) {
        free(p);
        p = NULL;
    }
    fclose(f);
    if (p) {
        ((char *)p)[n] = 0;
        *len = (size_t)n;
    }
    return p;
}

#endif
