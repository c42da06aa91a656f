/* Registry and loader: built-ins, modules from MLART_BACKEND_PATH, and
 * modules refused with the reason (other ABI version, short table, missing
 * symbol, NULL table, missing slot, name mismatch, not found). */
#define _POSIX_C_SOURCE 200809L
#include <check.h>
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
    suite_add_tcase(s, tc);
    return check_run(s, CK_FORK_GETENV);
}
