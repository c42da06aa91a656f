/* Config: INI parsing with inih, errors that name key and file:line,
 * precedence command line > environment > file, relations between keys,
 * and the shipped configs. */
#define _POSIX_C_SOURCE 200809L
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_run.h"
#include "mlart/config.h"

static char path[256];

/* Write `text` into a fresh temporary .ini file; path[] holds its name.
 * The file of the previous call, if a test left it, is removed first, so
 * a test may chain several ini() calls and unlink only the last. */
/* A small [model] section, all keys but topk */
#define SMALL_MODEL                                                                  \
    "[model]\nheads = 2\nqk_nope_dim = 8\nrope_dim = 8\nkv_lora_rank = 16\nv_head_dim = 8\n"

static const char *ini(const char *text)
{
    int fd;
    FILE *f;
    if (path[0])
        unlink(path);
    snprintf(path, sizeof path, "/tmp/mlart-config-XXXXXX");
    fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    f = fdopen(fd, "w");
    fputs(text, f);
    fclose(f);
    return path;
}

static const char *good =
    "# comment\n"
    "[model]\n"
    "heads = 64\n"
    "qk_nope_dim = 192\n"
    "rope_dim = 64\n"
    "kv_lora_rank = 512\n"
    "v_head_dim = 256\n"
    "topk = 2048\n"
    "kv_format = fp8_ds_mla ; inline comment\n"
    "[runtime]\n"
    "backend = reference\n"
    "graph_sizes = 1, 2,4,8\n"
    "[parallel]\n"
    "tp_size = 4\n"
    "dcp_size = 2\n"
    "dcp_routing = a2a\n";

static void clear_env(void)
{
    static const char *vars[] = {"MLART_HEADS", "MLART_BACKEND", "MLART_KV_FORMAT", "MLART_DEVICE",
                                 "MLART_TOPK", "MLART_SEED", "MLART_GRAPH_SIZES", "MLART_TP_SIZE",
                                 "MLART_DCP_SIZE", "MLART_STEPS", "MLART_BATCH", "MLART_CONTEXT",
                                 "MLART_SOFTMAX_SCALE", "MLART_EARLY_WEIGHTS", "MLART_QK_NOPE_DIM",
                                 "MLART_ROPE_DIM", "MLART_KV_LORA_RANK", "MLART_V_HEAD_DIM",
                                 "MLART_VALIDATE_INDICES"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
        unsetenv(vars[i]);
}

START_TEST(parse_good)
{
    mlart_config c;
    clear_env();
    ck_assert_int_eq(mlart_config_load(ini(good), &c), 0);
    ck_assert_int_eq(c.heads_total, 64);
    ck_assert_int_eq(c.geom.heads, 16); /* per rank */
    ck_assert_int_eq(c.geom.qk_nope, 192);
    ck_assert_int_eq(c.geom.v_head, 256);
    ck_assert_int_eq(c.geom.page_size, 64);
    ck_assert_int_eq(c.geom.kv_format, MLART_KV_FP8_DS_MLA);
    ck_assert(fabsf(c.geom.softmax_scale - 1.0f / sqrtf(256.0f)) < 1e-7f);
    ck_assert_str_eq(c.backend, "reference");
    ck_assert_int_eq(c.num_graph_sizes, 4);
    ck_assert_int_eq(c.graph_sizes[3], 8);
    ck_assert_int_eq(c.tp_size, 4);
    ck_assert_int_eq(c.dcp_size, 2);
    ck_assert_int_eq(c.dcp_routing, MLART_DCP_A2A);
    ck_assert_int_eq(c.device, MLART_DEVICE_AUTO);
    ck_assert_int_eq(c.layers, 1);
    ck_assert_int_eq(c.early_weights, 0); /* default: no promise */
    ck_assert_int_eq(c.validate_indices, 0);
    ck_assert_ptr_nonnull(strstr(mlart_config_origin(&c, "heads"), ":3"));
    ck_assert_str_eq(mlart_config_origin(&c, "page_size"), ""); /* default */
    ck_assert_ptr_null(mlart_config_origin(&c, "nosuchkey"));
    unlink(path);
}
END_TEST

/* Load `text` and expect MLART_ECONFIG with every needle in the message. */
static void expect_error(const char *text, const char *n1, const char *n2)
{
    mlart_config c;
    char want_line[300];
    int rc;
    clear_env();
    rc = mlart_config_load(ini(text), &c);
    printf("  -> %s\n", mlart_last_error());
    ck_assert_int_eq(rc, MLART_ECONFIG);
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), n1));
    if (n2) {
        snprintf(want_line, sizeof want_line, "%s%s", path, n2);
        ck_assert_msg(strstr(mlart_last_error(), want_line), "want '%s' in '%s'", want_line,
                      mlart_last_error());
    }
    unlink(path);
}

START_TEST(errors_name_key_and_line)
{
    char buf[1024];
    expect_error("[model]\nheads = 4\nqk_nope = 128\n", "unknown key 'qk_nope'", ":3");
    expect_error("[model]\nheads = 4x\n", "'heads'", ":2");
    expect_error("[model]\nheads = -4\n", "'heads'", ":2");
    expect_error("[model]\nheads = 99999999999999999999\n", "'heads'", ":2");
    expect_error("[model]\n\nkv_format = fp16\n", "'kv_format'", ":3");
    expect_error("[runtime]\ndevice = gpu\n", "'device'", ":2");
    expect_error("[runtime]\ngraph_sizes = 1,4,2\n", "'graph_sizes'", ":2");
    expect_error("[runtime]\ngraph_sizes = 1,,2\n", "'graph_sizes'", ":2");
    expect_error("[runtime]\nbackend = ../evil\n", "'backend'", ":2");
    expect_error("[runtime]\nearly_weights = 2\n", "'early_weights'", ":2");
    expect_error("[runtime]\nvalidate_indices = -1\n", "'validate_indices'", ":2");
    expect_error("[parallel]\ndcp_routing = ring\n", "'dcp_routing'", ":2");
    expect_error("[model]\nsoftmax_scale = nan\n", "'softmax_scale'", ":2");
    expect_error("[runtime]\nheads = 4\n", "belongs in section [model]", ":2");
    /* an unknown section is an error even with no key under it */
    expect_error("[model]\nheads = 4\n[paralel]\n", "unknown section [paralel]", ":3");
    expect_error("[bogus]\nheads = 4\n", "unknown section [bogus]", ":1");
    expect_error("[model]\nheads = 4\nheads = 8\n", "duplicate key 'heads'", ":3");
    expect_error("[model]\nthis line has no equals sign\n", "syntax error", ":2");
    /* an unclosed section is the cause, not the keys after it */
    expect_error("[model\nheads = 4\n", "syntax error", ":1");
    /* a bad key before a syntax error is still the first error */
    expect_error("[model]\nhedas = 4\n[runtime\n", "unknown key 'hedas'", ":2");
    snprintf(buf, sizeof buf, "[model]\nheads = 4\n; %0300d\n", 0);
    expect_error(buf, "longer than", ":3");
    /* missing required key names the key and the file */
    expect_error("[model]\nheads = 4\nqk_nope_dim = 8\nrope_dim = 8\nkv_lora_rank = 128\n"
                 "v_head_dim = 8\n",
                 "missing required key 'topk'", "");
    /* relations name both keys with their lines */
    expect_error("[model]\nheads = 6\nqk_nope_dim = 8\nrope_dim = 8\nkv_lora_rank = 128\n"
                 "v_head_dim = 8\ntopk = 8\n[parallel]\ntp_size = 4\n",
                 "not divisible by tp_size", ":9");
    expect_error("[model]\nheads = 8\nqk_nope_dim = 8\nrope_dim = 8\nkv_lora_rank = 128\n"
                 "v_head_dim = 8\ntopk = 8\n[parallel]\ntp_size = 4\ndcp_size = 3\n",
                 "dcp_size = 3", ":10");
    expect_error("[model]\nheads = 8\nqk_nope_dim = 8\nrope_dim = 8\nkv_lora_rank = 96\n"
                 "v_head_dim = 8\ntopk = 8\nkv_format = fp8_ds_mla\n",
                 "multiple of 128", ":5");
}
END_TEST

START_TEST(missing_file)
{
    mlart_config c;
    ck_assert_int_eq(mlart_config_load("/nonexistent/x.ini", &c), MLART_EIO);
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "/nonexistent/x.ini"));
}
END_TEST

/* The model's required keys from the environment, so that a file adding
 * nothing still loads. */
static void model_env(void)
{
    setenv("MLART_HEADS", "4", 1);
    setenv("MLART_QK_NOPE_DIM", "8", 1);
    setenv("MLART_ROPE_DIM", "8", 1);
    setenv("MLART_KV_LORA_RANK", "16", 1);
    setenv("MLART_V_HEAD_DIM", "8", 1);
    setenv("MLART_TOPK", "8", 1);
}

/* A directory opens with fopen on Linux and fails only on read; it must not
 * pass for an empty file, with or without the other keys set elsewhere. */
START_TEST(directory_refused)
{
    char dir[] = "/tmp/mlart-config-dir-XXXXXX";
    mlart_config c, keep;
    ck_assert_ptr_nonnull(mkdtemp(dir));
    clear_env();
    mlart_config_init(&c);
    keep = c;
    ck_assert_int_eq(mlart_config_read_file(&c, dir), MLART_EIO);
    printf("  -> %s\n", mlart_last_error());
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), dir));
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "directory"));
    ck_assert_mem_eq(&keep, &c, sizeof c);
    model_env();
    ck_assert_int_eq(mlart_config_load(dir, &c), MLART_EIO);
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), dir));
    clear_env();
    rmdir(dir);
}
END_TEST

/* A regular file whose read fails: /proc/self/mem at offset 0 (never
 * mapped) gives EIO on the first read, where the kernel provides it. */
START_TEST(read_error_reported)
{
    const char *p = "/proc/self/mem";
    mlart_config c;
    FILE *f = fopen(p, "r");
    int fails = f && fgetc(f) == EOF && ferror(f);
    if (f)
        fclose(f);
    if (!fails) {
        printf("read_error_reported: reading %s does not fail here, skipped\n", p);
        return;
    }
    clear_env();
    model_env();
    ck_assert_int_eq(mlart_config_load(p, &c), MLART_EIO);
    printf("  -> %s\n", mlart_last_error());
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "/proc/self/mem:1: read error"));
    clear_env();
}
END_TEST

/* A FIFO (a shell's <(...)) is still read. */
START_TEST(fifo_read)
{
    char dir[] = "/tmp/mlart-config-fifo-XXXXXX";
    char fifo[64];
    mlart_config c;
    pid_t pid;
    int status;
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(fifo, sizeof fifo, "%s/in.ini", dir);
    ck_assert_int_eq(mkfifo(fifo, 0600), 0);
    pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        FILE *f = fopen(fifo, "w");
        if (f) {
            fputs(good, f);
            fclose(f);
        }
        _exit(f ? 0 : 1);
    }
    clear_env();
    ck_assert_msg(mlart_config_load(fifo, &c) == 0, "%s", mlart_last_error());
    ck_assert_int_eq(c.heads_total, 64);
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    unlink(fifo);
    rmdir(dir);
}
END_TEST

static void expect_seed(const char *value, uint64_t want)
{
    mlart_config c;
    mlart_config_init(&c);
    ck_assert_msg(mlart_config_set(&c, "seed", value, "--seed") == 0, "'%s': %s", value,
                  mlart_last_error());
    ck_assert_msg(c.seed == want, "'%s' -> %llu, want %llu", value, (unsigned long long)c.seed,
                  (unsigned long long)want);
}

static void expect_bad_seed(const char *value)
{
    mlart_config c;
    mlart_config_init(&c);
    ck_assert_msg(mlart_config_set(&c, "seed", value, "--seed") == MLART_ECONFIG,
                  "'%s' taken as %llu", value, (unsigned long long)c.seed);
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "--seed"));
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "'seed'"));
    ck_assert_int_eq(c.seed, 1);
}

/* seed: decimal (a leading zero is not octal) or 0x hexadecimal. */
/* SMALL_MODEL with topk 8 and `extra` loaded from a file into *file, then
 * again with `var` = `value` in the environment into *env; the variable is
 * unset and the file removed after. */
static void file_then_env(const char *extra, const char *var, const char *value, mlart_config *file,
                          mlart_config *env)
{
    char text[512];
    snprintf(text, sizeof text, "%stopk = 8\n%s", SMALL_MODEL, extra);
    ck_assert_int_eq(mlart_config_load(ini(text), file), 0);
    setenv(var, value, 1);
    ck_assert_int_eq(mlart_config_load(path, env), 0);
    unsetenv(var);
    unlink(path);
}

START_TEST(seed_decimal_or_hex)
{
    mlart_config c;
    expect_seed("010", 10);
    expect_seed("08", 8);
    expect_seed("0", 0);
    expect_seed(" 42 ", 42);
    expect_seed("0x10", 16);
    expect_seed("0XfF", 255);
    expect_seed("18446744073709551615", UINT64_MAX);
    expect_seed("0xffffffffffffffff", UINT64_MAX);
    expect_bad_seed("0x");
    expect_bad_seed("1x");
    expect_bad_seed("-1");
    expect_bad_seed("+1");
    expect_bad_seed("");
    expect_bad_seed("0x0x10");
    expect_bad_seed("0x 10");
    expect_bad_seed("1 2");
    expect_bad_seed("ff");
    expect_bad_seed("18446744073709551616");
    expect_bad_seed("0x10000000000000000");
    /* the same rules in a file and in the environment */
    clear_env();
    {
        mlart_config env;
        file_then_env("[run]\nseed = 010\n", "MLART_SEED", "0x10", &c, &env);
        ck_assert_int_eq(c.seed, 10);
        ck_assert_int_eq(env.seed, 16);
    }
}
END_TEST

/* Same values and same lines; origins compared past the file name. */
static void expect_same_config(const mlart_config *a, const char *pa, const mlart_config *b,
                               const char *pb)
{
    mlart_config x = *a, y = *b;
    for (int k = 0; k < MLART_CONFIG_MAX_KEYS; k++) {
        const char *oa = x.origin[k], *ob = y.origin[k];
        if (!strncmp(oa, pa, strlen(pa)) && !strncmp(ob, pb, strlen(pb)))
            ck_assert_str_eq(oa + strlen(pa), ob + strlen(pb));
        else
            ck_assert_str_eq(oa, ob);
    }
    memset(x.origin, 0, sizeof x.origin);
    memset(y.origin, 0, sizeof y.origin);
    memset(x.path, 0, sizeof x.path);
    memset(y.path, 0, sizeof y.path);
    ck_assert_mem_eq(&x, &y, sizeof x);
}

/* Indented keys, sections and comments (spaces, tabs) read as unindented:
 * the reader's inih would otherwise take an indented line after a key as a
 * continuation of that key's value. */
START_TEST(indented_lines)
{
    static const char *flat =
        "# comment\n"
        "[model]\n"
        "heads = 64\n"
        "qk_nope_dim = 192\n"
        "; a comment between keys\n"
        "rope_dim = 64\n"
        "\n"
        "kv_lora_rank = 512\n"
        "v_head_dim = 256\n"
        "topk = 2048\n"
        "[runtime]\n"
        "backend = reference\n"
        "[parallel]\n"
        "tp_size = 4\n"
        "dcp_size = 2\n"
        "[run]\n"
        "seed = 7\n";
    static const char *indented =
        "  # comment\n"
        "  [model]\n"
        "    heads = 64\n"
        "\tqk_nope_dim = 192\n"
        "    ; a comment between keys\n"
        " \t rope_dim = 64\n"
        "   \n"
        "    kv_lora_rank = 512\n"
        "    v_head_dim = 256\n"
        "    topk = 2048\n"
        "  [runtime]\n"
        "    backend = reference\n"
        "\t[parallel]\n"
        "\t\ttp_size = 4\n"
        "\t\tdcp_size = 2\n"
        " [run]\n"
        "  seed = 7\n";
    mlart_config a, b;
    char pa[256];
    clear_env();
    ck_assert_msg(mlart_config_load(ini(flat), &a) == 0, "%s", mlart_last_error());
    snprintf(pa, sizeof pa, "%s", path);
    ck_assert_msg(mlart_config_load(ini(indented), &b) == 0, "%s", mlart_last_error());
    expect_same_config(&a, pa, &b, path);
    ck_assert_int_eq(b.geom.qk_nope, 192);
    ck_assert_int_eq(b.dcp_size, 2);
    ck_assert_int_eq(b.seed, 7);
    ck_assert_str_eq(mlart_config_origin(&b, "rope_dim") + strlen(path), ":6");
    /* an indented duplicate is still a duplicate, on its own line */
    expect_error("[model]\nheads = 4\n  heads = 8\n", "duplicate key 'heads'", ":3");
    /* the too-long check still counts the indented line */
    {
        char buf[1024];
        snprintf(buf, sizeof buf, "[model]\n  heads = 4\n    ; %0300d\n  bad line\n", 0);
        expect_error(buf, "longer than", ":3");
    }
    expect_error("[model]\n  heads = 4\n  no equals sign\n", "syntax error", ":3");
    unlink(pa);
}
END_TEST

/* Lines inih would read without a word: text after a section's ']' (the
 * key on it was dropped), a NUL byte (the line ended there for inih, or was
 * skipped whole when it came first), an unknown section behind a UTF-8 byte
 * order mark; and a softmax_scale outside what its message promises. */
START_TEST(nothing_silently_dropped)
{
    static const char nul_first[] = "[run]\n\0seed = 7\n";
    static const char nul_mid[] = "[run]\nseed = 7\0junk\nbatch = 9\n";
    mlart_config c;
    char want[300];
    FILE *f;
    expect_error("[run] seed = 7\n", "text 'seed = 7' after section [run]", ":1");
    expect_error("[model]\nheads = 4\n[run]]\n", "after section [run]", ":3");
    expect_error("\xEF\xBB\xBF[bogus]\n[model]\n", "unknown section [bogus]", ":1");
    expect_error("[model]\nsoftmax_scale = 1e31\n", "(0, 1e30]", ":2");
    expect_error("[model]\nsoftmax_scale = 1e-50\n", "not 0 as a float", ":2");
    for (int i = 0; i < 2; i++) {
        const char *text = i ? nul_mid : nul_first;
        size_t len = i ? sizeof nul_mid - 1 : sizeof nul_first - 1;
        clear_env();
        ini("");
        f = fopen(path, "wb");
        ck_assert_ptr_nonnull(f);
        ck_assert_uint_eq(fwrite(text, 1, len, f), len);
        fclose(f);
        mlart_config_init(&c);
        ck_assert_int_eq(mlart_config_read_file(&c, path), MLART_ECONFIG);
        snprintf(want, sizeof want, "%s:2: NUL byte", path);
        ck_assert_msg(strstr(mlart_last_error(), want), "want '%s' in '%s'", want,
                      mlart_last_error());
        unlink(path);
    }
    /* what stays allowed: a comment after a section, a BOM before a known one */
    mlart_config_init(&c);
    ck_assert_msg(mlart_config_read_file(&c, ini("\xEF\xBB\xBF[run] ; seeds\nseed = 7\n"
                                                "[model]  # dims\nheads = 4\r\n[runtime]\r\n")) ==
                      0,
                  "%s", mlart_last_error());
    ck_assert_int_eq(c.seed, 7);
    ck_assert_int_eq(c.heads_total, 4);
    unlink(path);
}
END_TEST

START_TEST(precedence)
{
    mlart_config c, keep;
    clear_env();
    setenv("MLART_BACKEND", "from_env", 1);
    setenv("MLART_KV_FORMAT", "bf16", 1);
    setenv("MLART_SEED", "", 1); /* empty = unset */
    mlart_config_init(&c);
    ck_assert_int_eq(mlart_config_read_file(&c, ini(good)), 0);
    ck_assert_str_eq(c.backend, "reference");
    ck_assert_int_eq(mlart_config_read_env(&c), 0);
    ck_assert_str_eq(c.backend, "from_env"); /* environment beats the file */
    ck_assert_int_eq(c.geom.kv_format, MLART_KV_BF16);
    ck_assert_int_eq(c.seed, 1);
    ck_assert_int_eq(mlart_config_set(&c, "backend", "from_flag", "--backend"), 0);
    ck_assert_str_eq(c.backend, "from_flag"); /* command line beats both */
    ck_assert_int_eq(mlart_config_finish(&c), 0);
    /* mlart_config_load applies the environment over the file */
    ck_assert_int_eq(mlart_config_load(path, &c), 0);
    ck_assert_str_eq(c.backend, "from_env");
    /* a bad environment value names the variable and leaves cfg untouched */
    setenv("MLART_DEVICE", "tpu", 1);
    keep = c;
    ck_assert_int_eq(mlart_config_read_env(&c), MLART_ECONFIG);
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "MLART_DEVICE"));
    ck_assert_mem_eq(&keep, &c, sizeof c);
    /* a bad command-line value names the option */
    ck_assert_int_eq(mlart_config_set(&c, "steps", "0", "--steps"), MLART_ECONFIG);
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "--steps"));
    ck_assert_int_eq(mlart_config_set(&c, "stpes", "3", "--set"), MLART_ECONFIG);
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "'stpes'"));
    /* blanks around a value are not part of it, for names as for numbers */
    ck_assert_int_eq(mlart_config_set(&c, "device", " cpu\t", "--device"), 0);
    ck_assert_int_eq(c.device, MLART_DEVICE_CPU);
    ck_assert_int_eq(mlart_config_set(&c, "kv_format", "fp8_ds_mla ", "--kv-format"), 0);
    ck_assert_int_eq(c.geom.kv_format, MLART_KV_FP8_DS_MLA);
    ck_assert_int_eq(mlart_config_set(&c, "backend", "  ref ", "--backend"), 0);
    ck_assert_str_eq(c.backend, "ref");
    ck_assert_int_eq(mlart_config_set(&c, "dcp_routing", " a2a", "--set"), 0);
    ck_assert_int_eq(c.dcp_routing, MLART_DCP_A2A);
    ck_assert_int_eq(mlart_config_set(&c, "graph_sizes", " 1,2 ", "--set"), 0);
    ck_assert_int_eq(mlart_config_set(&c, "device", "c pu", "--device"), MLART_ECONFIG);
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "'c pu'"));
    ck_assert_int_eq(mlart_config_set(&c, "backend", " ", "--backend"), 0); /* empty: the default */
    ck_assert_str_eq(c.backend, "");
    /* the fields are public: finish refuses what set would have */
    {
        mlart_config z = c;
        z.tp_size = 0;
        ck_assert_int_eq(mlart_config_finish(&z), MLART_ECONFIG);
        ck_assert_ptr_nonnull(strstr(mlart_last_error(), "tp_size = 0"));
        z = c, z.dcp_size = -1;
        ck_assert_int_eq(mlart_config_finish(&z), MLART_ECONFIG);
    }
    /* environment can supply a required key the file lacks */
    unsetenv("MLART_DEVICE");
    setenv("MLART_TOPK", "16", 1);
    ck_assert_int_eq(mlart_config_load(ini(SMALL_MODEL), &c), 0);
    ck_assert_int_eq(c.geom.topk, 16);
    ck_assert_str_eq(mlart_config_origin(&c, "topk"), "environment MLART_TOPK");
    /* early_weights from the file, then the environment */
    unsetenv("MLART_TOPK");
    {
        mlart_config env;
        file_then_env("[runtime]\nearly_weights = 1\n", "MLART_EARLY_WEIGHTS", "0", &c, &env);
        ck_assert_int_eq(c.early_weights, 1);
        ck_assert_int_eq(env.early_weights, 0);
        ck_assert_str_eq(mlart_config_origin(&env, "early_weights"), "environment MLART_EARLY_WEIGHTS");
        file_then_env("[runtime]\nvalidate_indices = 0\n", "MLART_VALIDATE_INDICES", "1", &c, &env);
        ck_assert_int_eq(c.validate_indices, 0);
        ck_assert_int_eq(env.validate_indices, 1);
        ck_assert_str_eq(mlart_config_origin(&env, "validate_indices"),
                         "environment MLART_VALIDATE_INDICES");
    }
    printf("precedence: command line > environment > file\n");
}
END_TEST

START_TEST(shipped_configs)
{
    static const struct {
        const char *file;
        int heads, P, V;
        mlart_kv_format fmt;
    } want[] = {
        {"tiny-cpu.ini", 4, 128, 128, MLART_KV_BF16},
        {"glm5-tp4-dcp4.ini", 16, 192, 256, MLART_KV_FP8_DS_MLA},
        {"deepseek-v32-tp8.ini", 16, 128, 128, MLART_KV_FP8_DS_MLA},
        {"deepseek-v32-tp4.ini", 32, 128, 128, MLART_KV_FP8_DS_MLA},
    };
    clear_env();
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        char p[512];
        mlart_config c;
        snprintf(p, sizeof p, "%s/configs/%s", MLART_SOURCE_DIR, want[i].file);
        ck_assert_msg(mlart_config_load(p, &c) == 0, "%s: %s", p, mlart_last_error());
        ck_assert_int_eq(c.geom.heads, want[i].heads);
        ck_assert_int_eq(c.geom.qk_nope, want[i].P);
        ck_assert_int_eq(c.geom.v_head, want[i].V);
        ck_assert_int_eq(c.geom.rope, 64);
        ck_assert_int_eq(c.geom.kv_lora, 512);
        ck_assert_int_eq(c.geom.kv_format, want[i].fmt);
        printf("%s: H/rank=%d P=%d V=%d topk=%d %s tp=%d dcp=%d\n", want[i].file, c.geom.heads,
               c.geom.qk_nope, c.geom.v_head, c.geom.topk, mlart_kv_format_name(c.geom.kv_format),
               c.tp_size, c.dcp_size);
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("runtime_config");
    TCase *tc = tcase_create("config");
    tcase_add_test(tc, parse_good);
    tcase_add_test(tc, errors_name_key_and_line);
    tcase_add_test(tc, missing_file);
    tcase_add_test(tc, directory_refused);
    tcase_add_test(tc, read_error_reported);
    tcase_add_test(tc, fifo_read);
    tcase_add_test(tc, seed_decimal_or_hex);
    tcase_add_test(tc, indented_lines);
    tcase_add_test(tc, nothing_silently_dropped);
    tcase_add_test(tc, precedence);
    tcase_add_test(tc, shipped_configs);
    suite_add_tcase(s, tc);
    return check_run(s, CK_FORK_GETENV);
}
