/* Registry and loader: built-ins, modules from MLART_BACKEND_PATH, and
 * modules refused with the reason (other ABI version, short table, missing
 * symbol, NULL table, missing slot, name mismatch, not found). */
#define _POSIX_C_SOURCE 200809L
#include <check.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check_run.h"
#include "mlart/backend.h"
#include "mlart/config.h"

static void use_plugins(void)
{
    setenv("MLART_BACKEND_PATH", "/nonexistent/dir:" MLART_TEST_PLUGIN_DIR, 1);
}

START_TEST(builtins)
{
    const char *const *names = mlart_backend_builtins();
    const mlart_backend_vtable *vt = NULL;
    int n = 0;
    ck_assert_ptr_nonnull(names);
    for (; names[n]; n++) {
        ck_assert_int_eq(mlart_backend_lookup(names[n], &vt), 0);
        ck_assert_str_eq(vt->name, names[n]);
        ck_assert_uint_eq(vt->abi_version, MLART_BACKEND_ABI_VERSION);
        printf("built-in backend: %s\n", names[n]);
    }
#ifdef MLART_HAVE_REFERENCE
    ck_assert_int_ge(n, 1);
    ck_assert_str_eq(names[0], "reference");
#endif
}
END_TEST

START_TEST(module_loads)
{
    const mlart_backend_vtable *vt = NULL, *again = NULL;
    use_plugins();
    ck_assert_int_eq(mlart_backend_lookup("testhost", &vt), 0);
    ck_assert_str_eq(vt->name, "testhost");
    ck_assert_uint_eq(vt->contract.query_bmm, MLART_QBMM_CONTIGUOUS);
    ck_assert_uint_eq(vt->contract.max_heads, 8);
    ck_assert_ptr_null(vt->absorb_query);
    ck_assert_int_eq(mlart_backend_lookup("testhost", &again), 0);
    ck_assert_ptr_eq(vt, again); /* loaded once */
    ck_assert_int_eq(mlart_backend_lookup("testsafe", &vt), 0);
    ck_assert_uint_eq(vt->contract.query_bmm, MLART_QBMM_SAFE_OP);
}
END_TEST

/* Expect `rc` from looking up `name`, a message holding both needles, and
 * the out-parameter untouched. */
static void refused(const char *name, int rc, const char *n1, const char *n2)
{
    const mlart_backend_vtable *keep = (const mlart_backend_vtable *)0x1, *vt = keep;
    ck_assert_int_eq(mlart_backend_lookup(name, &vt), rc);
    printf("%-12s -> %s: %s\n", name, mlart_status_name(rc), mlart_last_error());
    ck_assert_ptr_eq(vt, keep);
    ck_assert_msg(strstr(mlart_last_error(), n1), "want '%s' in '%s'", n1, mlart_last_error());
    if (n2)
        ck_assert_msg(strstr(mlart_last_error(), n2), "want '%s' in '%s'", n2,
                      mlart_last_error());
}

START_TEST(modules_refused)
{
    use_plugins();
    refused("badabi", MLART_EABI, "ABI version 2", "speaks version 1");
    refused("smallstruct", MLART_EABI, "struct_size 64", "at least 112");
    refused("nosym", MLART_EABI, "does not export mlart_backend_entry_v1", "libmlart-backend-nosym.so");
    refused("nulltable", MLART_EABI, "NULL backend table", NULL);
    refused("noattend", MLART_EABI, "attend()", "required");
    refused("wrongname", MLART_EABI, "'othername'", "expected 'wrongname'");
    /* a name with no NUL: the message reads no more than a valid name's 64 bytes */
    refused("untermname", MLART_EABI,
            "calls itself 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...'",
            "expected 'untermname'");
    refused("nosuch", MLART_ENOBACKEND, "unknown backend 'nosuch'", "/nonexistent/dir, "
            MLART_TEST_PLUGIN_DIR);
    refused("../testhost", MLART_ENOBACKEND, "invalid backend name", NULL);
    refused("", MLART_ENOBACKEND, "invalid backend name", NULL);
    /* a refused module stays refused, and good ones still load after it */
    refused("badabi", MLART_EABI, "ABI version 2", NULL);
    {
        const mlart_backend_vtable *vt;
        ck_assert_int_eq(mlart_backend_lookup("testhost", &vt), 0);
    }
}
END_TEST

START_TEST(no_path)
{
    unsetenv("MLART_BACKEND_PATH");
    refused("testpad", MLART_ENOBACKEND, "MLART_BACKEND_PATH is not set", NULL);
    ck_assert_int_eq(mlart_backend_lookup(NULL, NULL), MLART_EINVAL);
}
END_TEST

/* A long MLART_BACKEND_PATH: the message names every directory it searched
 * or counts those it has no room for, and says which entries it could not
 * search; a detail past mlart_last_error's 1023 characters says it is cut. */
START_TEST(long_messages)
{
    static char env[8192], big[2048];
    size_t n = 0;
    const mlart_backend_vtable *vt = NULL;
    for (int i = 0; i < 12; i++)
        n += (size_t)snprintf(env + n, sizeof env - n,
                              "/opt/some/fairly/long/installation/prefix/number/%02d/lib/mlart:", i);
    env[n++] = '/';
    memset(env + n, 'd', 4500); /* no path fits under it */
    n += 4500;
    snprintf(env + n, sizeof env - n, ":%s", MLART_TEST_PLUGIN_DIR);
    setenv("MLART_BACKEND_PATH", env, 1);
    refused("nosuch", MLART_ENOBACKEND, "/opt/some/fairly/long/installation/prefix/number/00/lib/mlart",
            "; not searched: 1 entry too long for a path");
    ck_assert_msg(strstr(mlart_last_error(), " more;"), "unlisted directories not counted: %s",
                  mlart_last_error());
    ck_assert_int_lt((int)strlen(mlart_last_error()), 1023);
    memset(big, 'x', sizeof big - 1);
    ck_assert_int_eq(mlart_backend_lookup(big, &vt), MLART_ENOBACKEND);
    ck_assert_int_eq((int)strlen(mlart_last_error()), 1023);
    ck_assert_str_eq(mlart_last_error() + 1020, "...");
}
END_TEST

/* A module whose entry point looks up another backend (one that wraps or
 * delegates) gets an error for that lookup, not a registry that waits for
 * its own lock forever; the module itself still loads. */
START_TEST(lookup_from_entry)
{
    void (*set)(int (*)(const char *, const mlart_backend_vtable **), int **);
    int *rc = NULL;
    const mlart_backend_vtable *vt = NULL;
    void *h = dlopen(MLART_TEST_PLUGIN_DIR "/libmlart-backend-reentrant.so", RTLD_NOW | RTLD_LOCAL);
    ck_assert_msg(h, "%s", dlerror());
    *(void **)&set = dlsym(h, "testhost_lookup_in_entry");
    ck_assert_ptr_nonnull(set);
    set(mlart_backend_lookup, &rc);
    use_plugins();
    ck_assert_int_eq(mlart_backend_lookup("reentrant", &vt), 0);
    ck_assert_str_eq(vt->name, "reentrant");
    ck_assert_int_eq(*rc, MLART_EABI);
    ck_assert_msg(strstr(mlart_last_error(), "while module 'reentrant' is being loaded"), "%s",
                  mlart_last_error());
    ck_assert_int_eq(mlart_backend_lookup("testhost", &vt), 0); /* the registry still works */
    dlclose(h);
}
END_TEST

/* Threads look backends up at once (a DCP group's local ranks each create
 * a layer): each module loads once and every thread gets its table, and
 * each thread's failure detail is its own.  Under ThreadSanitizer this also
 * covers the lazily read MLART_LOG level that every failure consults. */
enum { LOOKUP_THREADS = 8, LOOKUP_ROUNDS = 20 };
static pthread_barrier_t lookup_start;

typedef struct lookup_arg {
    int id;
    const mlart_backend_vtable *got;
} lookup_arg;

static void *lookup_thread(void *p)
{
    lookup_arg *arg = p;
    char name[32], want[64], bad[32], badwant[64];
    snprintf(name, sizeof name, "nosuch%d", arg->id);
    snprintf(want, sizeof want, "unknown backend '%s'", name);
    snprintf(bad, sizeof bad, "bad.name%d", arg->id); /* refused outside the registry's lock */
    snprintf(badwant, sizeof badwant, "invalid backend name '%s'", bad);
    pthread_barrier_wait(&lookup_start);
    for (int i = 0; i < LOOKUP_ROUNDS; i++) {
        const mlart_backend_vtable *vt = NULL;
        if (mlart_backend_lookup(bad, &vt) != MLART_ENOBACKEND || !strstr(mlart_last_error(), badwant))
            return (void *)"failure detail not this thread's";
        if (mlart_backend_lookup(name, &vt) != MLART_ENOBACKEND || !strstr(mlart_last_error(), want))
            return (void *)"failure detail not this thread's";
        if (mlart_backend_lookup(i % 2 ? "testhost" : "testsafe", &vt) != 0)
            return (void *)"lookup failed";
        if (i % 2)
            arg->got = vt;
    }
    return NULL;
}

START_TEST(concurrent_lookups)
{
    pthread_t th[LOOKUP_THREADS];
    lookup_arg arg[LOOKUP_THREADS];
    use_plugins();
    ck_assert_int_eq(pthread_barrier_init(&lookup_start, NULL, LOOKUP_THREADS), 0);
    for (int i = 0; i < LOOKUP_THREADS; i++) {
        arg[i] = (lookup_arg){i, NULL};
        ck_assert_int_eq(pthread_create(&th[i], NULL, lookup_thread, &arg[i]), 0);
    }
    for (int i = 0; i < LOOKUP_THREADS; i++) {
        void *err;
        ck_assert_int_eq(pthread_join(th[i], &err), 0);
        ck_assert_msg(!err, "thread %d: %s", i, (const char *)err);
        ck_assert_ptr_nonnull(arg[i].got);
        ck_assert_ptr_eq(arg[i].got, arg[0].got); /* testhost loaded once */
    }
    pthread_barrier_destroy(&lookup_start);
}
END_TEST

/* The backend named in a config file (or by MLART_BACKEND) is the one looked up. */
START_TEST(by_config_and_env)
{
    static const char text[] = "[model]\nheads = 2\nqk_nope_dim = 8\nrope_dim = 8\n"
                               "kv_lora_rank = 16\nv_head_dim = 8\ntopk = 4\n"
                               "[runtime]\nbackend = testhost\n";
    char path[] = "/tmp/mlart-registry-XXXXXX";
    int fd = mkstemp(path);
    FILE *f = fdopen(fd, "w");
    mlart_config c;
    const mlart_backend_vtable *vt;
    fputs(text, f);
    fclose(f);
    use_plugins();
    unsetenv("MLART_BACKEND");
    ck_assert_int_eq(mlart_config_load(path, &c), 0);
    ck_assert_int_eq(mlart_backend_lookup(c.backend, &vt), 0);
    ck_assert_str_eq(vt->name, "testhost");
    setenv("MLART_BACKEND", "testsafe", 1);
    ck_assert_int_eq(mlart_config_load(path, &c), 0);
    ck_assert_int_eq(mlart_backend_lookup(c.backend, &vt), 0);
    ck_assert_str_eq(vt->name, "testsafe");
    setenv("MLART_BACKEND", "badabi", 1);
    ck_assert_int_eq(mlart_config_load(path, &c), 0);
    ck_assert_int_eq(mlart_backend_lookup(c.backend, &vt), MLART_EABI);
    unlink(path);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("runtime_registry");
    TCase *tc = tcase_create("registry");
    tcase_add_test(tc, builtins);
    tcase_add_test(tc, module_loads);
    tcase_add_test(tc, modules_refused);
    tcase_add_test(tc, no_path);
    tcase_add_test(tc, by_config_and_env);
    tcase_add_test(tc, concurrent_lookups);
    tcase_add_test(tc, long_messages);
    tcase_add_test(tc, lookup_from_entry);
    suite_add_tcase(s, tc);
    return check_run(s, CK_FORK_GETENV);
}
