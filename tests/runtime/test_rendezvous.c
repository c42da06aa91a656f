/* Rank variables and the TCP rendezvous: each launcher's variables, bad
 * values named, argument checks, a group of ranks as threads on 127.0.0.1
 * receiving rank 0's blob (also 1 MiB, read in pieces), a refused peer
 * while the others are served, a rank whose blob size differs (refused,
 * the others told, rank 0 failing at once naming it), deadlines on both
 * sides, and peers written
 * by hand on plain sockets that take a rank and never acknowledge it:
 * leaving (after reading nothing, only the head, or the blob and then
 * sending a malformed acknowledgement) or acknowledging a blob it never
 * read (its checksum is not the blob's) frees the rank for the real one,
 * staying makes the real one retry until it leaves, and rank 0's timeout
 * names such a rank as pending; a peer whose connects meet themselves
 * (in a network namespace of its own, where that can be made to happen);
 * a peer of protocol version 2 answered; a warning when two launchers'
 * rank variables disagree. */
#define _GNU_SOURCE /* unshare, CLONE_NEWNET */
#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "check_run.h"
#include "mlart/rendezvous.h"
#include "tests/runtime/fixture.h"

static uint64_t seed;

/* ---- rank variables ------------------------------------------------------ */

static void clear_rank_env(void)
{
    static const char *vars[] = {"MLART_RANK", "MLART_WORLD_SIZE", "MLART_LOCAL_RANK",
                                 "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                 "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK", "PMI_SIZE",
                                 "MPI_LOCALRANKID", "RANK", "WORLD_SIZE", "LOCAL_RANK"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
        unsetenv(vars[i]);
}

START_TEST(rank_env_none)
{
    mlart_rank_info r;
    clear_rank_env();
    memset(&r, 0x55, sizeof r);
    ck_assert_int_eq(mlart_rank_from_env(&r), 0);
    ck_assert_int_eq(r.rank, 0);
    ck_assert_int_eq(r.size, 1);
    ck_assert_int_eq(r.local_rank, 0);
    ck_assert_str_eq(r.source, "");
    ck_assert_int_eq(mlart_rank_from_env(NULL), MLART_EINVAL);
}
END_TEST

START_TEST(rank_env_families)
{
    static const struct {
        const char *rank, *size, *local, *source;
    } fam[] = {
        {"MLART_RANK", "MLART_WORLD_SIZE", "MLART_LOCAL_RANK", "MLART"},
        {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI"},
        {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "PMI"},
        {"RANK", "WORLD_SIZE", "LOCAL_RANK", "RANK"},
    };
    for (size_t i = 0; i < sizeof fam / sizeof fam[0]; i++) {
        mlart_rank_info r;
        clear_rank_env();
        setenv(fam[i].rank, "5", 1);
        setenv(fam[i].size, "8", 1);
        setenv(fam[i].local, "1", 1);
        ck_assert_msg(mlart_rank_from_env(&r) == 0, "%s: %s", fam[i].source, mlart_last_error());
        ck_assert_int_eq(r.rank, 5);
        ck_assert_int_eq(r.size, 8);
        ck_assert_int_eq(r.local_rank, 1);
        ck_assert_str_eq(r.source, fam[i].source);
        unsetenv(fam[i].local); /* no local rank: 0 */
        ck_assert_int_eq(mlart_rank_from_env(&r), 0);
        ck_assert_int_eq(r.local_rank, 0);
        printf("%s: rank %d of %d\n", r.source, r.rank, r.size);
    }
    /* first found wins: MLART over OMPI over PMI over RANK */
    clear_rank_env();
    setenv("RANK", "3", 1);
    setenv("WORLD_SIZE", "4", 1);
    setenv("OMPI_COMM_WORLD_RANK", "1", 1);
    setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
    {
        mlart_rank_info r;
        ck_assert_int_eq(mlart_rank_from_env(&r), 0);
        ck_assert_str_eq(r.source, "OMPI");
        ck_assert_int_eq(r.rank, 1);
        ck_assert_int_eq(r.size, 2);
    }
}
END_TEST

/* mlart_rank_from_env, and what it logged on stderr into buf. */
static int rank_env_logged(mlart_rank_info *r, char *buf, size_t cap)
{
    FILE *tmp = tmpfile();
    int saved, rc;
    size_t n;
    ck_assert_ptr_nonnull(tmp);
    fflush(stderr);
    saved = dup(2);
    ck_assert_int_ge(saved, 0);
    ck_assert_int_ge(dup2(fileno(tmp), 2), 0);
    rc = mlart_rank_from_env(r);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    rewind(tmp);
    n = fread(buf, 1, cap - 1, tmp);
    buf[n] = 0;
    fclose(tmp);
    return rc;
}

/* Another launcher's variables that disagree with the ones taken are
 * named in a warning; ones that agree (or are not numbers) are not. */
START_TEST(rank_env_stale_family_named)
{
    mlart_rank_info r;
    char log[1024];
    clear_rank_env();
    unsetenv("MLART_LOG");
    setenv("MLART_RANK", "0", 1);
    setenv("MLART_WORLD_SIZE", "1", 1);
    setenv("OMPI_COMM_WORLD_RANK", "2", 1);
    setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
    ck_assert_int_eq(rank_env_logged(&r, log, sizeof log), 0);
    ck_assert_str_eq(r.source, "MLART");
    ck_assert_int_eq(r.size, 1);
    ck_assert_msg(strstr(log, "rank 0 of 1 from MLART_RANK/MLART_WORLD_SIZE") &&
                      strstr(log, "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE say 2 of 4"),
                  "log: '%s'", log);
    printf("stale family: %s", log);
    setenv("MLART_RANK", "2", 1);
    setenv("MLART_WORLD_SIZE", "4", 1);
    ck_assert_int_eq(rank_env_logged(&r, log, sizeof log), 0);
    ck_assert_msg(!log[0], "agreeing families logged '%s'", log);
    setenv("RANK", "x", 1);
    setenv("WORLD_SIZE", "4", 1);
    ck_assert_int_eq(rank_env_logged(&r, log, sizeof log), 0);
    ck_assert_msg(!log[0], "a family that is not read logged '%s'", log);
    clear_rank_env();
}
END_TEST

/* Expect MLART_ECONFIG naming `var`, and *out untouched. */
static void expect_env_error(const char *var)
{
    mlart_rank_info r;
    memset(&r, 0x55, sizeof r);
    ck_assert_int_eq(mlart_rank_from_env(&r), MLART_ECONFIG);
    printf("  -> %s\n", mlart_last_error());
    ck_assert_msg(strstr(mlart_last_error(), var), "want '%s' in '%s'", var, mlart_last_error());
    ck_assert_int_eq(r.rank, 0x55555555);
}

START_TEST(rank_env_refused)
{
    /* variables set (name, value; NULL ends), the name the error must give */
    static const struct {
        const char *set[6], *want;
    } bad[] = {
        {{"MLART_RANK", "4", "MLART_WORLD_SIZE", "4"}, "MLART_RANK=4"},
        {{"PMI_RANK", "7", "PMI_SIZE", "2"}, "PMI_RANK"},
        {{"OMPI_COMM_WORLD_RANK", "1", "OMPI_COMM_WORLD_SIZE", "4x"}, "OMPI_COMM_WORLD_SIZE"},
        {{"RANK", "one", "WORLD_SIZE", "2"}, "RANK"},
        {{"RANK", "", "WORLD_SIZE", "2"}, "RANK"},
        {{"MLART_RANK", "0", "MLART_WORLD_SIZE", "2", "MLART_LOCAL_RANK", "0.5"},
         "MLART_LOCAL_RANK"},
        {{"MLART_RANK", "-1", "MLART_WORLD_SIZE", "2"}, "MLART_RANK"},
        {{"MLART_RANK", "0", "MLART_WORLD_SIZE", "0"}, "MLART_WORLD_SIZE"},
        {{"MLART_RANK", "99999999999999999999", "MLART_WORLD_SIZE", "2"}, "MLART_RANK"},
        {{"WORLD_SIZE", "2"}, "RANK"}, /* size without rank */
        {{"MLART_RANK", "1", "MLART_WORLD_SIZE", "2", "MLART_LOCAL_RANK", "99"},
         "MLART_LOCAL_RANK=99"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        clear_rank_env();
        for (int k = 0; k < 6 && bad[i].set[k]; k += 2)
            setenv(bad[i].set[k], bad[i].set[k + 1], 1);
        expect_env_error(bad[i].want);
    }
}
END_TEST

/* ---- rendezvous ---------------------------------------------------------- */

typedef struct job {
    pthread_t thread;
    int port, rank, size, timeout_ms;
    unsigned char *blob;
    size_t bytes;
    int rc;
    atomic_int done; /* rc, secs and err are set */
    double secs;
    char err[1024];
} job;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void *job_main(void *arg)
{
    job *j = arg;
    double t0 = now();
    j->rc = mlart_rendezvous("127.0.0.1", j->port, j->rank, j->size, j->blob, j->bytes,
                             j->timeout_ms);
    j->secs = now() - t0;
    snprintf(j->err, sizeof j->err, "%s", mlart_last_error());
    atomic_store(&j->done, 1);
    return NULL;
}

static void start(job *j, int port, int rank, int size, unsigned char *blob, size_t bytes,
                  int timeout_ms)
{
    j->port = port;
    j->rank = rank;
    j->size = size;
    j->blob = blob;
    j->bytes = bytes;
    j->timeout_ms = timeout_ms;
    j->rc = 1;
    j->err[0] = 0;
    atomic_store(&j->done, 0);
    ck_assert_int_eq(pthread_create(&j->thread, NULL, job_main, j), 0);
}

static void join(job *j)
{
    ck_assert_int_eq(pthread_join(j->thread, NULL), 0);
    if (j->rc)
        printf("  rank %d of %d on port %d: %s: %s\n", j->rank, j->size, j->port,
               mlart_status_name(j->rc), j->err);
}

static int pick_port(fx_rng *rng)
{
    return 20000 + (int)(fx_next(rng) % 20001);
}

/* rank 0 could not listen because the port is taken: try another */
static int port_taken(const job *j)
{
    if (j->rc == MLART_ECOMM && strstr(j->err, "already in use")) {
        printf("  port %d is in use, picking another\n", j->port);
        return 1;
    }
    return 0;
}

static void fill(fx_rng *rng, unsigned char *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)fx_next(rng);
}

/* `size` ranks as threads; the peers start first, so they retry until
 * rank 0 listens.  Every rank ends with rank 0's `bytes`. */
static void group(fx_rng *rng, int size, size_t bytes)
{
    unsigned char *blobs = malloc((size_t)size * (bytes ? bytes : 1));
    job *jobs = calloc((size_t)size, sizeof *jobs);
    int port = 0;
    ck_assert(blobs && jobs);
    for (int attempt = 0; attempt < 8; attempt++) {
        struct timespec pause = {0, 100 * 1000 * 1000};
        port = pick_port(rng);
        fill(rng, blobs, bytes);
        memset(blobs + bytes, 0xa5, (size_t)(size - 1) * bytes);
        for (int r = size - 1; r >= 1; r--)
            start(&jobs[r], port, r, size, blobs + (size_t)r * bytes, bytes, 10000);
        nanosleep(&pause, NULL);
        start(&jobs[0], port, 0, size, blobs, bytes, 10000);
        for (int r = 0; r < size; r++)
            join(&jobs[r]);
        if (!port_taken(&jobs[0]))
            break;
    }
    for (int r = 0; r < size; r++) {
        ck_assert_msg(jobs[r].rc == 0, "rank %d: %s", r, jobs[r].err);
        ck_assert_msg(!bytes || !memcmp(blobs + (size_t)r * bytes, blobs, bytes),
                      "rank %d got other bytes", r);
    }
    printf("%d ranks on 127.0.0.1:%d got rank 0's %zu bytes (rank 0 took %.3f s)\n", size, port,
           bytes, jobs[0].secs);
    free(blobs);
    free(jobs);
}

START_TEST(rendezvous_args)
{
    unsigned char b[128];
    double t0 = now();
    memset(b, 7, sizeof b);
    /* one rank: nothing to hand out, no socket (the address is not even parsed) */
    ck_assert_int_eq(mlart_rendezvous("127.0.0.1", 1, 0, 1, b, sizeof b, 1), 0);
    ck_assert_int_eq(mlart_rendezvous("not-an-address", 65535, 0, 1, b, sizeof b, 1), 0);
    ck_assert_int_eq(mlart_rendezvous("127.0.0.1", 29999, 0, 1, NULL, 0, 0), 0);
    ck_assert(now() - t0 < 0.5);
    for (size_t i = 0; i < sizeof b; i++)
        ck_assert_int_eq(b[i], 7);
    ck_assert_int_eq(mlart_rendezvous(NULL, 29999, 0, 2, b, sizeof b, 100), MLART_EINVAL);
    ck_assert_int_eq(mlart_rendezvous("127.0.0.1", 0, 0, 2, b, sizeof b, 100), MLART_EINVAL);
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "port 0"));
    ck_assert_int_eq(mlart_rendezvous("127.0.0.1", 65536, 0, 2, b, sizeof b, 100), MLART_EINVAL);
    ck_assert_int_eq(mlart_rendezvous("127.0.0.1", 29999, -1, 2, b, sizeof b, 100),
                     MLART_EINVAL);
    ck_assert_int_eq(mlart_rendezvous("127.0.0.1", 29999, 2, 2, b, sizeof b, 100), MLART_EINVAL);
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "rank 2 of 2"));
    ck_assert_int_eq(mlart_rendezvous("127.0.0.1", 29999, 0, 0, b, sizeof b, 100), MLART_EINVAL);
    /* a group past the bound is refused at once, not sized */
    t0 = now();
    ck_assert_int_eq(mlart_rendezvous("127.0.0.1", 29999, 0, MLART_RENDEZVOUS_MAX_RANKS + 1, b,
                                      sizeof b, 100), MLART_EINVAL);
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "size <= 65536"));
    ck_assert_int_eq(mlart_rendezvous("127.0.0.1", 29999, 1, INT32_MAX, b, sizeof b, 100),
                     MLART_EINVAL);
    ck_assert(now() - t0 < 0.05);
    ck_assert_int_eq(mlart_rendezvous("127.0.0.1", 29999, 1, 2, NULL, 16, 100), MLART_EINVAL);
    ck_assert_int_eq(mlart_rendezvous("127.0.0.1", 29999, 1, 2, b, (1u << 20) + 1, 100),
                     MLART_EINVAL);
    ck_assert_int_eq(mlart_rendezvous("127.0.0.1", 29999, 1, 2, b, sizeof b, -5), MLART_EINVAL);
    ck_assert_int_eq(mlart_rendezvous("localhost", 29999, 1, 2, b, sizeof b, 100), MLART_EINVAL);
    printf("  -> %s\n", mlart_last_error());
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "'localhost'"));
}
END_TEST

START_TEST(rendezvous_four_ranks)
{
    fx_rng rng = {seed ^ 0x4a11};
    group(&rng, 4, 128);
}
END_TEST

START_TEST(rendezvous_big_and_empty)
{
    fx_rng rng = {seed ^ 0xb16};
    group(&rng, 3, (size_t)1 << 20);
    group(&rng, 2, 0);
}
END_TEST

START_TEST(rendezvous_refuses_other_size)
{
    fx_rng rng = {seed ^ 0x512e};
    unsigned char blobs[4][128], bad_blob[128];
    job jobs[4], bad;
    int refused = 0;
    for (int attempt = 0; attempt < 8 && !refused; attempt++) {
        int port = pick_port(&rng);
        fill(&rng, blobs[0], sizeof blobs[0]);
        memset(blobs[1], 0, 3 * sizeof blobs[0]);
        memset(bad_blob, 0x3c, sizeof bad_blob);
        start(&jobs[0], port, 0, 4, blobs[0], sizeof blobs[0], 10000);
        /* rank 1 of a group of 5: refused, and it must not take rank 1's place */
        start(&bad, port, 1, 5, bad_blob, sizeof bad_blob, 5000);
        join(&bad);
        refused = bad.rc == MLART_ECOMM && strstr(bad.err, "size") != NULL;
        if (!refused) {
            join(&jobs[0]);
            ck_assert_msg(port_taken(&jobs[0]), "bad peer: %s; rank 0: %s", bad.err,
                          jobs[0].err);
            continue;
        }
        for (int r = 1; r < 4; r++)
            start(&jobs[r], port, r, 4, blobs[r], sizeof blobs[r], 10000);
        for (int r = 0; r < 4; r++)
            join(&jobs[r]);
    }
    ck_assert(refused);
    printf("refused: %s\n", bad.err);
    ck_assert_ptr_nonnull(strstr(bad.err, "refused rank 1"));
    for (int r = 0; r < 4; r++) {
        ck_assert_msg(jobs[r].rc == 0, "rank %d: %s", r, jobs[r].err);
        ck_assert(!memcmp(blobs[r], blobs[0], sizeof blobs[0]));
    }
    for (size_t i = 0; i < sizeof bad_blob; i++)
        ck_assert_int_eq(bad_blob[i], 0x3c);
}
END_TEST

/* A rank whose blob size differs from rank 0's (another build or config):
 * it is refused naming both sizes; a rank that comes after is told why
 * rank 0 gave up rather than served; and rank 0 returns at once naming the
 * rank and both sizes, instead of a bare timeout at its deadline. */
START_TEST(rendezvous_blob_size_differs)
{
    fx_rng rng = {seed ^ 0xb10b};
    unsigned char blobs[3][128];
    job j[3];
    int refused = 0;
    for (int attempt = 0; attempt < 8 && !refused; attempt++) {
        int port = pick_port(&rng);
        fill(&rng, blobs[0], sizeof blobs[0]);
        memset(blobs[1], 0x3c, sizeof blobs[1]);
        memset(blobs[2], 0, sizeof blobs[2]);
        start(&j[0], port, 0, 3, blobs[0], 128, 5000);
        start(&j[1], port, 1, 3, blobs[1], 64, 5000);
        join(&j[1]);
        refused = j[1].rc == MLART_ECOMM && strstr(j[1].err, "hands out a blob") != NULL;
        if (!refused) {
            join(&j[0]);
            ck_assert_msg(port_taken(&j[0]), "rank 1: %s; rank 0: %s", j[1].err, j[0].err);
            continue;
        }
        start(&j[2], port, 2, 3, blobs[2], 128, 5000);
        join(&j[2]);
        join(&j[0]);
    }
    ck_assert(refused);
    printf("blob sizes differ: rank 0 %s after %.3f s, rank 1 after %.3f s, rank 2 after %.3f s\n",
           mlart_status_name(j[0].rc), j[0].secs, j[1].secs, j[2].secs);
    ck_assert_ptr_nonnull(strstr(j[1].err, "hands out a blob of 128 bytes, rank 1 expects 64"));
    ck_assert_int_eq(j[2].rc, MLART_ECOMM);
    ck_assert_ptr_nonnull(strstr(j[2].err, "gave up before serving rank 2: rank 1 expects a "
                                           "blob of 64 bytes, rank 0 hands out 128"));
    ck_assert_int_eq(j[0].rc, MLART_ECOMM);
    ck_assert_ptr_nonnull(strstr(j[0].err, "rank 1 expects a blob of 64 bytes, rank 0 hands "
                                           "out 128"));
    ck_assert_ptr_nonnull(strstr(j[0].err, "gave up: 0 of 2 peers served, 2 told why"));
    ck_assert(j[0].secs < 2 && j[1].secs < 2 && j[2].secs < 2);
    for (size_t i = 0; i < sizeof blobs[1]; i++) {
        ck_assert_int_eq(blobs[1][i], 0x3c);
        ck_assert_int_eq(blobs[2][i], 0);
    }
}
END_TEST

/* As above with no rank 2 ever coming: rank 0 waits at most its deadline to
 * tell it, then still names the blob sizes, and the rank it could not tell. */
START_TEST(rendezvous_blob_size_differs_untold)
{
    fx_rng rng = {seed ^ 0xb10c};
    unsigned char blobs[2][128];
    job j0, j1;
    for (int attempt = 0; attempt < 8; attempt++) {
        int port = pick_port(&rng);
        fill(&rng, blobs[0], sizeof blobs[0]);
        start(&j0, port, 0, 3, blobs[0], 128, 500);
        start(&j1, port, 1, 3, blobs[1], 64, 5000);
        join(&j0);
        join(&j1);
        if (!port_taken(&j0))
            break;
    }
    ck_assert_int_eq(j1.rc, MLART_ECOMM);
    ck_assert_int_eq(j0.rc, MLART_ECOMM);
    ck_assert_ptr_nonnull(strstr(j0.err, "rank 1 expects a blob of 64 bytes, rank 0 hands "
                                         "out 128"));
    ck_assert_ptr_nonnull(strstr(j0.err, "0 of 2 peers served, 1 told why; neither served nor "
                                         "told within 500 ms: ranks 2"));
    ck_assert(j0.secs >= 0.45 && j0.secs < 1.5);
}
END_TEST

START_TEST(rendezvous_peer_without_server)
{
    fx_rng rng = {seed ^ 0x9e3};
    unsigned char b[128];
    job j;
    start(&j, pick_port(&rng), 1, 2, b, sizeof b, 300);
    join(&j);
    printf("no server: %s after %.3f s\n", mlart_status_name(j.rc), j.secs);
    ck_assert_int_eq(j.rc, MLART_ETIMEDOUT);
    ck_assert_ptr_nonnull(strstr(j.err, "rank 1 could not reach rank 0 at 127.0.0.1"));
    ck_assert(j.secs >= 0.29 && j.secs < 0.9);
}
END_TEST

/* Bring the loopback interface of this network namespace up. */
static int loopback_up(void)
{
    struct ifreq ifr;
    int fd = socket(AF_INET, SOCK_DGRAM, 0), rc = -1;
    if (fd < 0)
        return -1;
    memset(&ifr, 0, sizeof ifr);
    snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "lo");
    if (ioctl(fd, SIOCGIFFLAGS, &ifr) == 0) {
        ifr.ifr_flags |= IFF_UP;
        rc = ioctl(fd, SIOCSIFFLAGS, &ifr);
    }
    close(fd);
    return rc;
}

/* A connect to a free port of the local ephemeral range may be given that
 * very port as its source and meet itself: with the range narrowed to
 * rank 0's port and the next, about every other attempt of the peer does,
 * until rank 0 listens a second later.  The peer must take that for "no
 * answer yet" (not read its own hello back as a refusal), and rank 0 must
 * then listen and serve it.  Needs a network namespace of its own (the
 * test's child process; as root), else it says so and checks nothing. */
START_TEST(rendezvous_peer_meets_itself)
{
    static const char range[] = "40000 40001\n";
    unsigned char b0[128], b1[128];
    job j0, j1;
    struct timespec pause = {1, 0};
    int fd;
    if (unshare(CLONE_NEWNET) != 0) {
        printf("self-connect: no network namespace here (%s): not checked\n", strerror(errno));
        return;
    }
    fd = open("/proc/sys/net/ipv4/ip_local_port_range", O_WRONLY);
    if (loopback_up() != 0 || fd < 0 || write(fd, range, sizeof range - 1) != (ssize_t)(sizeof range - 1)) {
        /* a container may give the namespace but not these */
        printf("self-connect: cannot bring lo up or narrow the port range here (%s): not checked\n",
               strerror(errno));
        if (fd >= 0)
            close(fd);
        return;
    }
    close(fd);
    memset(b0, 0x5a, sizeof b0);
    memset(b1, 0, sizeof b1);
    start(&j1, 40000, 1, 2, b1, sizeof b1, 5000);
    nanosleep(&pause, NULL);
    start(&j0, 40000, 0, 2, b0, sizeof b0, 5000);
    join(&j1);
    join(&j0);
    printf("self-connect: peer %s after %.3f s, rank 0 %s after %.3f s\n", mlart_status_name(j1.rc),
           j1.secs, mlart_status_name(j0.rc), j0.secs);
    ck_assert_msg(j1.rc == 0, "peer: %s", j1.err);
    ck_assert_msg(j0.rc == 0, "rank 0: %s", j0.err);
    ck_assert_mem_eq(b0, b1, sizeof b0);
    printf("self-connect: the peer retried past its own connects and got the blob after %.3f s\n",
           j1.secs);
}
END_TEST

typedef struct join_job {
    pthread_t thread;
    int rank, port, rc;
    double secs;
    char err[1024];
} join_job;

static void *join_main(void *arg)
{
    join_job *j = arg;
    mlart_comm *c = NULL;
    double t0 = now();
    j->rc = mlart_comm_nccl_join(j->rank, 2, 0, "127.0.0.1", j->port, 5000, &c);
    j->secs = now() - t0;
    snprintf(j->err, sizeof j->err, "%s", mlart_last_error());
    mlart_comm_destroy(c);
    return NULL;
}

/* mlart_comm_nccl_join where rank 0 cannot make the NCCL id (no NCCL in
 * this build or on this machine): rank 0 tells the others why, so every
 * rank fails at once with rank 0's reason instead of waiting out the
 * deadline for a rank 0 that never serves. */
START_TEST(join_rank0_without_nccl)
{
    unsigned char id[MLART_NCCL_ID_BYTES];
    fx_rng rng = {seed ^ 0x701};
    join_job j[2];
    if (mlart_comm_nccl_unique_id(id, sizeof id) == 0) {
        printf("join: NCCL is here, so rank 0 has an id: not checked\n");
        return;
    }
    for (int attempt = 0; attempt < 8; attempt++) {
        const int port = pick_port(&rng);
        for (int r = 1; r >= 0; r--) {
            j[r].rank = r, j[r].port = port, j[r].rc = 1;
            ck_assert_int_eq(pthread_create(&j[r].thread, NULL, join_main, &j[r]), 0);
        }
        for (int r = 0; r < 2; r++)
            ck_assert_int_eq(pthread_join(j[r].thread, NULL), 0);
        if (!(j[0].rc == MLART_ECOMM && strstr(j[0].err, "already in use")))
            break;
    }
    printf("join without NCCL: rank 0 %s after %.3f s (%s); rank 1 %s after %.3f s (%s)\n",
           mlart_status_name(j[0].rc), j[0].secs, j[0].err, mlart_status_name(j[1].rc), j[1].secs,
           j[1].err);
    ck_assert_int_lt(j[0].rc, 0);
    ck_assert_ptr_null(strstr(j[0].err, "not every other rank"));
    ck_assert_int_eq(j[1].rc, MLART_ECOMM);
    ck_assert_ptr_nonnull(strstr(j[1].err, "has no NCCL id for the group"));
    ck_assert_ptr_nonnull(strstr(j[1].err, mlart_status_name(j[0].rc)));
    ck_assert(j[0].secs < 2.0 && j[1].secs < 2.0);
}
END_TEST

START_TEST(rendezvous_rank0_missing_peer)
{
    fx_rng rng = {seed ^ 0x3155};
    unsigned char blobs[2][128];
    job j0, j1;
    for (int attempt = 0; attempt < 8; attempt++) {
        int port = pick_port(&rng);
        fill(&rng, blobs[0], sizeof blobs[0]);
        memset(blobs[1], 0, sizeof blobs[1]);
        start(&j0, port, 0, 3, blobs[0], sizeof blobs[0], 500);
        start(&j1, port, 1, 3, blobs[1], sizeof blobs[1], 5000);
        join(&j0);
        join(&j1);
        if (!port_taken(&j0))
            break;
    }
    ck_assert_int_eq(j0.rc, MLART_ETIMEDOUT);
    ck_assert_ptr_nonnull(strstr(j0.err, "1 of 2 peers"));
    ck_assert_ptr_nonnull(strstr(j0.err, "missing ranks: 2"));
    ck_assert(j0.secs >= 0.45 && j0.secs < 1.5);
    ck_assert_msg(j1.rc == 0, "rank 1: %s", j1.err);
    ck_assert(!memcmp(blobs[0], blobs[1], sizeof blobs[0]));
}
END_TEST

/* ---- a peer by hand, on plain sockets ------------------------------------ */

/* the wire format of runtime/rendezvous/rendezvous.c, version 3 */
#define WIRE_MAGIC 0x4d4c5254u
#define WIRE_VERSION 3u
#define WIRE_HELLO 24
#define WIRE_HEAD 28
#define WIRE_ACK 16
#define WIRE_ACK_WORD 0x41434b21u
#define WIRE_BAD_VERSION 7u

static void wire_put(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static uint32_t wire_get(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t wire_get64(const unsigned char *p)
{
    return (uint64_t)wire_get(p) | (uint64_t)wire_get(p + 4) << 32;
}

/* An acknowledgement whose checksum is the FNV-1a 64 of n bytes at p. */
static void wire_ack(unsigned char ack[WIRE_ACK], const unsigned char *p, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    wire_put(ack, WIRE_MAGIC);
    wire_put(ack + 4, WIRE_ACK_WORD);
    wire_put(ack + 8, (uint32_t)h);
    wire_put(ack + 12, (uint32_t)(h >> 32));
}

static void sleep_ms(int ms)
{
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* A connection to 127.0.0.1:port, tried every 20 ms until rank 0 listens;
 * -1 once `rank0` has returned (it could not listen) or after 5 s.  Reads
 * give up after 5 s, so a silent rank 0 fails the test instead of hanging. */
static int fake_connect(int port, job *rank0)
{
    struct sockaddr_in sa;
    struct timeval limit = {5, 0};
    double t0 = now();
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    for (;;) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        ck_assert_int_ge(fd, 0);
        if (connect(fd, (const struct sockaddr *)&sa, sizeof sa) == 0) {
            ck_assert_int_eq(setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit), 0);
            return fd;
        }
        close(fd);
        if (atomic_load(&rank0->done) || now() - t0 > 5)
            return -1;
        sleep_ms(20);
    }
}

/* Say rank `rank` of a group of `size` expecting `bytes`, as
 * mlart_rendezvous would. */
static void fake_hello(int fd, int rank, int size, size_t bytes)
{
    unsigned char hello[WIRE_HELLO];
    wire_put(hello, WIRE_MAGIC);
    wire_put(hello + 4, WIRE_VERSION);
    wire_put(hello + 8, (uint32_t)rank);
    wire_put(hello + 12, (uint32_t)size);
    wire_put(hello + 16, (uint32_t)bytes);
    wire_put(hello + 20, (uint32_t)((uint64_t)bytes >> 32));
    ck_assert_int_eq(send(fd, hello, sizeof hello, MSG_NOSIGNAL), (ssize_t)sizeof hello);
}

/* Read rank 0's head and check it admits us with `bytes` to come, then read
 * `keep` of those bytes into blob. */
static void fake_read(int fd, size_t bytes, unsigned char *blob, size_t keep)
{
    unsigned char head[WIRE_HEAD];
    size_t got = 0;
    while (got < sizeof head + keep) {
        ssize_t n = got < sizeof head ? recv(fd, head + got, sizeof head - got, 0)
                                      : recv(fd, blob + got - sizeof head,
                                             sizeof head + keep - got, 0);
        ck_assert_msg(n > 0, "rank 0 sent %zu of %zu bytes, then %zd", got,
                      sizeof head + keep, n);
        got += (size_t)n;
    }
    ck_assert_uint_eq(wire_get(head), WIRE_MAGIC);
    ck_assert_uint_eq(wire_get(head + 4), 0); /* admitted */
    ck_assert_uint_eq(wire_get64(head + 8), bytes);
    ck_assert_uint_eq(wire_get(head + 16), 0);
    ck_assert_uint_eq(wire_get64(head + 20), 0);
}

/* Rank 0 of a group of 2 and a peer that says rank 1, reads `keep` bytes
 * (none: -1; the head: 0; the blob too: 128), sends `junk` (WIRE_ACK bytes
 * where the acknowledgement goes) if not NULL, and either holds the connection
 * for `hold_ms` while the real rank 1 (`timeout_ms`; 0: none) starts, then
 * closes it, or (hold_ms 0) closes it first.  Retries on another port if
 * rank 0's is taken; the blobs are blobs[0] (rank 0's) and blobs[1]. */
static void fake_then_real(fx_rng *rng, unsigned char blobs[2][128], int keep,
                           const unsigned char *junk, int hold_ms, int rank0_ms, int timeout_ms,
                           job *j0, job *j1)
{
    memset(j1, 0, sizeof *j1);
    j1->rc = 1;
    for (int attempt = 0; attempt < 8; attempt++) {
        int port = pick_port(rng), fd;
        unsigned char seen[128];
        fill(rng, blobs[0], 128);
        memset(blobs[1], 0, 128);
        start(j0, port, 0, 2, blobs[0], 128, rank0_ms);
        fd = fake_connect(port, j0);
        if (fd < 0) {
            join(j0);
            ck_assert_msg(port_taken(j0), "rank 0 on port %d: %s", port, j0->err);
            continue;
        }
        fake_hello(fd, 1, 2, 128);
        if (keep >= 0)
            fake_read(fd, 128, seen, (size_t)keep);
        ck_assert(keep <= 0 || !memcmp(seen, blobs[0], (size_t)keep));
        if (junk)
            ck_assert_int_eq(send(fd, junk, WIRE_ACK, MSG_NOSIGNAL), WIRE_ACK);
        if (hold_ms == 0) {
            close(fd);
            sleep_ms(50); /* rank 0 reads this hello before the real rank 1's */
        }
        if (timeout_ms > 0)
            start(j1, port, 1, 2, blobs[1], 128, timeout_ms);
        if (hold_ms > 0) {
            sleep_ms(hold_ms);
            close(fd);
        }
        if (timeout_ms > 0)
            join(j1);
        join(j0);
        if (!port_taken(j0))
            break;
    }
}

START_TEST(rendezvous_peer_leaves_before_ack)
{
    fx_rng rng = {seed ^ 0x1ea7e};
    /* the magic, then 0 where the acknowledgement's word goes */
    static const unsigned char bad_ack[WIRE_ACK] = {0x54, 0x52, 0x4c, 0x4d};
    /* a well-formed acknowledgement of a blob never read: the checksum of
     * the buffer as it was, all zeros */
    static const unsigned char zeros[128];
    unsigned char unread_ack[WIRE_ACK];
    /* hold_ms: the last peer stays connected while the real rank 1 starts,
     * so that only its acknowledgement, not the end of its connection, can
     * tell rank 0 that it does not count */
    const struct {
        int keep;
        const unsigned char *junk;
        int hold_ms;
        const char *what;
    } how[] = {
        {-1, NULL, 0, "reading nothing"},
        {0, NULL, 0, "reading the head"},
        {128, bad_ack, 0, "a malformed acknowledgement"},
        {0, unread_ack, 200, "acknowledging the head without reading the blob"},
    };
    wire_ack(unread_ack, zeros, sizeof zeros);
    for (size_t i = 0; i < sizeof how / sizeof how[0]; i++) {
        unsigned char blobs[2][128];
        job j0, j1;
        fake_then_real(&rng, blobs, how[i].keep, how[i].junk, how[i].hold_ms, 10000, 3000, &j0,
                       &j1);
        printf("a peer left holding rank 1 after %s: rank 0 %s in %.3f s, the real rank 1 %s "
               "in %.3f s\n", how[i].what, mlart_status_name(j0.rc), j0.secs,
               mlart_status_name(j1.rc), j1.secs);
        ck_assert_msg(j0.rc == 0, "rank 0: %s", j0.err);
        ck_assert_msg(j1.rc == 0, "rank 1: %s", j1.err);
        ck_assert(!memcmp(blobs[0], blobs[1], sizeof blobs[0]));
        ck_assert(j0.secs < 2 && j1.secs < 2);
    }
}
END_TEST

START_TEST(rendezvous_pending_rank_retries)
{
    fx_rng rng = {seed ^ 0xb05e};
    unsigned char blobs[2][128];
    job j0, j1;
    /* the peer has the whole blob but never acknowledges it */
    fake_then_real(&rng, blobs, 128, NULL, 300, 10000, 5000, &j0, &j1);
    printf("rank 1 waited for a peer holding it: rank 0 %s in %.3f s, rank 1 %s in %.3f s\n",
           mlart_status_name(j0.rc), j0.secs, mlart_status_name(j1.rc), j1.secs);
    ck_assert_msg(j0.rc == 0, "rank 0: %s", j0.err);
    ck_assert_msg(j1.rc == 0, "rank 1: %s", j1.err);
    ck_assert(!memcmp(blobs[0], blobs[1], sizeof blobs[0]));
    ck_assert(j1.secs >= 0.25 && j1.secs < 2);
}
END_TEST

START_TEST(rendezvous_rank0_names_pending)
{
    fx_rng rng = {seed ^ 0x9e4d};
    unsigned char blobs[2][128];
    job j0, j1;
    /* no real rank 1: the peer holds the rank until rank 0 gives up */
    fake_then_real(&rng, blobs, 128, NULL, 700, 500, 0, &j0, &j1);
    printf("rank 0: %s\n", j0.err);
    ck_assert_int_eq(j0.rc, MLART_ETIMEDOUT);
    ck_assert_ptr_nonnull(strstr(j0.err, "0 of 1 peers served (missing ranks: 1; admitted, "
                                         "blob not acknowledged: 1)"));
    ck_assert(j0.secs >= 0.45 && j0.secs < 1.5);
}
END_TEST

/* A peer of rendezvous version 2 (a 16-byte hello) is answered, with the
 * status of another version and rank 0's version where the count goes,
 * rather than closed on; the real rank 1 is then served. */
START_TEST(rendezvous_other_version_answered)
{
    fx_rng rng = {seed ^ 0x7e2};
    unsigned char blobs[2][128], head[WIRE_HEAD];
    job j0, j1;
    size_t got = 0;
    int fd = -1;
    for (int attempt = 0; attempt < 8 && fd < 0; attempt++) {
        int port = pick_port(&rng);
        fill(&rng, blobs[0], sizeof blobs[0]);
        memset(blobs[1], 0, sizeof blobs[1]);
        start(&j0, port, 0, 2, blobs[0], 128, 5000);
        if ((fd = fake_connect(port, &j0)) < 0) {
            join(&j0);
            ck_assert_msg(port_taken(&j0), "rank 0 on port %d: %s", port, j0.err);
            continue;
        }
        {
            unsigned char hello[16];
            wire_put(hello, WIRE_MAGIC);
            wire_put(hello + 4, 2);
            wire_put(hello + 8, 1);
            wire_put(hello + 12, 2);
            ck_assert_int_eq(send(fd, hello, sizeof hello, MSG_NOSIGNAL), 16);
        }
        for (ssize_t n = 1; n > 0 && got < sizeof head; got += (size_t)n)
            if ((n = recv(fd, head + got, sizeof head - got, 0)) <= 0)
                break;
        close(fd);
        start(&j1, port, 1, 2, blobs[1], 128, 5000);
        join(&j1);
        join(&j0);
    }
    ck_assert_int_ge(fd, 0);
    ck_assert_uint_ge(got, 16); /* what a peer of version 2 reads */
    ck_assert_uint_eq(wire_get(head), WIRE_MAGIC);
    ck_assert_uint_eq(wire_get(head + 4), WIRE_BAD_VERSION);
    ck_assert_uint_eq(wire_get64(head + 8), WIRE_VERSION);
    ck_assert_msg(j0.rc == 0, "rank 0: %s", j0.err);
    ck_assert_msg(j1.rc == 0, "rank 1: %s", j1.err);
    ck_assert(!memcmp(blobs[0], blobs[1], sizeof blobs[0]));
}
END_TEST

int main(void)
{
    Suite *s = suite_create("runtime_rendezvous");
    TCase *env = tcase_create("rank_env");
    TCase *tc = tcase_create("rendezvous");
    seed = fx_seed();
    printf("seed %llu (MLART_TEST_SEED to repeat)\n", (unsigned long long)seed);
    tcase_add_test(env, rank_env_none);
    tcase_add_test(env, rank_env_families);
    tcase_add_test(env, rank_env_refused);
    tcase_add_test(env, rank_env_stale_family_named);
    tcase_add_test(tc, rendezvous_args);
    tcase_add_test(tc, rendezvous_four_ranks);
    tcase_add_test(tc, rendezvous_big_and_empty);
    tcase_add_test(tc, rendezvous_refuses_other_size);
    tcase_add_test(tc, rendezvous_blob_size_differs);
    tcase_add_test(tc, rendezvous_blob_size_differs_untold);
    tcase_add_test(tc, rendezvous_peer_without_server);
    tcase_add_test(tc, rendezvous_peer_meets_itself);
    tcase_add_test(tc, join_rank0_without_nccl);
    tcase_add_test(tc, rendezvous_rank0_missing_peer);
    tcase_add_test(tc, rendezvous_peer_leaves_before_ack);
    tcase_add_test(tc, rendezvous_pending_rank_retries);
    tcase_add_test(tc, rendezvous_rank0_names_pending);
    tcase_add_test(tc, rendezvous_other_version_answered);
    tcase_set_timeout(tc, 120);
    suite_add_tcase(s, env);
    suite_add_tcase(s, tc);
    return check_run(s, CK_FORK_GETENV);
}
