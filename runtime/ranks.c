/* Where this process is in its launch: the rank variables of the common
 * launchers (include/mlart/comm.h). */
#define _POSIX_C_SOURCE 200809L
#include "mlart/comm.h"

#include "runtime/status.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>

/* ---- rank variables ----------------------------------------------------- */

typedef struct rank_family {
    const char *source, *rank, *size, *local;
} rank_family;

static const rank_family families[] = {
    {"MLART", "MLART_RANK", "MLART_WORLD_SIZE", "MLART_LOCAL_RANK"},
    {"OMPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
    {"PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"},
    {"RANK", "RANK", "WORLD_SIZE", "LOCAL_RANK"},
};

/* The value of `name` as an integer >= min; *out untouched when unset. */
static int env_int(const char *name, int32_t min, int32_t *out)
{
    const char *s = getenv(name);
    char *end;
    long v;
    if (!s)
        return 0;
    errno = 0;
    v = strtol(s, &end, 10);
    if (end == s || *end || errno == ERANGE || v > INT32_MAX || v < INT32_MIN)
        return mlart_set_error(MLART_ECONFIG, "%s='%s' is not a number", name, s);
    if (v < min)
        return mlart_set_error(MLART_ECONFIG, "%s=%ld: want an integer >= %d", name, v,
                               (int)min);
    *out = (int32_t)v;
    return 0;
}

/* 1 with the value of `name` when it is set and a whole number, else 0;
 * records no error (for a variable that is only compared). */
static int quiet_long(const char *name, long *out)
{
    const char *s = getenv(name);
    char *end;
    if (!s)
        return 0;
    errno = 0;
    *out = strtol(s, &end, 10);
    return end != s && !*end && errno != ERANGE;
}

int mlart_rank_from_env(mlart_rank_info *out)
{
    mlart_rank_info r = {0, 1, 0, ""};
    if (!out)
        return mlart_set_error(MLART_EINVAL, "mlart_rank_from_env: NULL out");
    for (size_t i = 0; i < sizeof families / sizeof families[0]; i++) {
        const rank_family *f = &families[i];
        if (!getenv(f->rank) && !getenv(f->size))
            continue;
        if (!getenv(f->rank) || !getenv(f->size))
            return mlart_set_error(MLART_ECONFIG, "%s is set but %s is not", getenv(f->rank) ?
                                   f->rank : f->size, getenv(f->rank) ? f->size : f->rank);
        MLART_CHECK(env_int(f->rank, 0, &r.rank));
        MLART_CHECK(env_int(f->size, 1, &r.size));
        MLART_CHECK(env_int(f->local, 0, &r.local_rank));
        if (r.rank >= r.size)
            return mlart_set_error(MLART_ECONFIG, "%s=%d is not below %s=%d", f->rank,
                                   (int)r.rank, f->size, (int)r.size);
        if (r.local_rank >= r.size) /* it picks the device; no node holds more ranks than the world */
            return mlart_set_error(MLART_ECONFIG, "%s=%d is not below %s=%d", f->local,
                                   (int)r.local_rank, f->size, (int)r.size);
        snprintf(r.source, sizeof r.source, "%s", f->source);
        /* a later family that says otherwise is most likely left over from
         * another launch (an exported MLART_RANK under mpirun, say): the
         * order decides, but say so */
        for (size_t j = i + 1; j < sizeof families / sizeof families[0]; j++) {
            const rank_family *o = &families[j];
            long orank, osize;
            if (!quiet_long(o->rank, &orank) || !quiet_long(o->size, &osize))
                continue;
            if (orank != r.rank || osize != r.size)
                mlart_log(MLART_LOG_WARN, "rank %d of %d from %s/%s, which come first; %s/%s say "
                          "%ld of %ld (unset the variables of the launch that is not this one)",
                          (int)r.rank, (int)r.size, f->rank, f->size, o->rank, o->size,
                          orank, osize);
        }
        break;
    }
    *out = r;
    return 0;
}
