/* Run configuration from INI files (inih), MLART_* environment and the command line. */
#define _POSIX_C_SOURCE 200809L /* fileno */
#include "mlart/config.h"

#include "runtime/status.h"

#include <ctype.h>
#include <errno.h>
#include <ini.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

enum value_kind { V_INT, V_U64, V_FLOAT, V_STRING, V_KV_FORMAT, V_DEVICE, V_LIST, V_ROUTING };

typedef struct key_def {
    const char *name;
    const char *section;
    const char *env;
    enum value_kind kind;
    int required;
    int64_t min, max; /* V_INT range */
} key_def;

enum {
    K_HEADS, K_QK_NOPE, K_ROPE, K_KV_LORA, K_V_HEAD, K_TOPK, K_PAGE, K_SCALE, K_KV_FORMAT,
    K_BACKEND, K_DEVICE, K_GRAPH_SIZES, K_LAYERS, K_EARLY_WEIGHTS, K_VALIDATE,
    K_TP, K_DCP, K_ROUTING, K_INTERLEAVE,
    K_BATCH, K_CONTEXT, K_STEPS, K_SEED,
    K_COUNT
};

#define BIG_ (1 << 30)
static const key_def keys[K_COUNT] = {
    [K_HEADS] = {"heads", "model", "MLART_HEADS", V_INT, 1, 1, 65536},
    [K_QK_NOPE] = {"qk_nope_dim", "model", "MLART_QK_NOPE_DIM", V_INT, 1, 1, 65536},
    [K_ROPE] = {"rope_dim", "model", "MLART_ROPE_DIM", V_INT, 1, 1, 65536},
    [K_KV_LORA] = {"kv_lora_rank", "model", "MLART_KV_LORA_RANK", V_INT, 1, 1, 65536},
    [K_V_HEAD] = {"v_head_dim", "model", "MLART_V_HEAD_DIM", V_INT, 1, 1, 65536},
    [K_TOPK] = {"topk", "model", "MLART_TOPK", V_INT, 1, 1, BIG_},
    [K_PAGE] = {"page_size", "model", "MLART_PAGE_SIZE", V_INT, 0, 1, 65536},
    [K_SCALE] = {"softmax_scale", "model", "MLART_SOFTMAX_SCALE", V_FLOAT, 0, 0, 0},
    [K_KV_FORMAT] = {"kv_format", "model", "MLART_KV_FORMAT", V_KV_FORMAT, 0, 0, 0},
    [K_BACKEND] = {"backend", "runtime", "MLART_BACKEND", V_STRING, 0, 0, 0},
    [K_DEVICE] = {"device", "runtime", "MLART_DEVICE", V_DEVICE, 0, 0, 0},
    [K_GRAPH_SIZES] = {"graph_sizes", "runtime", "MLART_GRAPH_SIZES", V_LIST, 0, 1, 65536},
    [K_LAYERS] = {"layers", "runtime", "MLART_LAYERS", V_INT, 0, 1, 4096},
    [K_EARLY_WEIGHTS] = {"early_weights", "runtime", "MLART_EARLY_WEIGHTS", V_INT, 0, 0, 1},
    [K_VALIDATE] = {"validate_indices", "runtime", "MLART_VALIDATE_INDICES", V_INT, 0, 0, 1},
    [K_TP] = {"tp_size", "parallel", "MLART_TP_SIZE", V_INT, 0, 1, 4096},
    [K_DCP] = {"dcp_size", "parallel", "MLART_DCP_SIZE", V_INT, 0, 1, 4096},
    [K_ROUTING] = {"dcp_routing", "parallel", "MLART_DCP_ROUTING", V_ROUTING, 0, 0, 0},
    [K_INTERLEAVE] = {"dcp_interleave", "parallel", "MLART_DCP_INTERLEAVE", V_INT, 0, 1, 65536},
    [K_BATCH] = {"batch", "run", "MLART_BATCH", V_INT, 0, 1, 1 << 20},
    [K_CONTEXT] = {"context", "run", "MLART_CONTEXT", V_INT, 0, 1, BIG_},
    [K_STEPS] = {"steps", "run", "MLART_STEPS", V_INT, 0, 1, BIG_},
    [K_SEED] = {"seed", "run", "MLART_SEED", V_U64, 0, 0, 0},
};
_Static_assert(K_COUNT <= MLART_CONFIG_MAX_KEYS, "origin[] too small");

const char *mlart_device_kind_name(mlart_device_kind d)
{
    switch (d) {
    case MLART_DEVICE_AUTO:
        return "auto";
    case MLART_DEVICE_CPU:
        return "cpu";
    case MLART_DEVICE_CUDA:
        return "cuda";
    }
    return "invalid";
}

const char *mlart_dcp_routing_name(mlart_dcp_routing r)
{
    switch (r) {
    case MLART_DCP_AG_RS:
        return "ag_rs";
    case MLART_DCP_A2A:
        return "a2a";
    }
    return "invalid";
}

void mlart_config_init(mlart_config *cfg)
{
    static const int32_t sizes[] = {1, 2, 4, 8, 16, 32, 64};
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->geom.page_size = 64;
    cfg->geom.kv_format = MLART_KV_BF16;
    cfg->device = MLART_DEVICE_AUTO;
    memcpy(cfg->graph_sizes, sizes, sizeof sizes);
    cfg->num_graph_sizes = (int32_t)(sizeof sizes / sizeof sizes[0]);
    cfg->layers = 1;
    cfg->tp_size = 1;
    cfg->dcp_size = 1;
    cfg->dcp_routing = MLART_DCP_AG_RS;
    cfg->dcp_interleave = 1;
    cfg->batch = 4;
    cfg->context = 2048;
    cfg->steps = 16;
    cfg->seed = 1;
}

static int find_key(const char *name)
{
    for (int k = 0; k < K_COUNT; k++)
        if (!strcmp(keys[k].name, name))
            return k;
    return -1;
}

static int bad_value(int k, const char *value, const char *origin, const char *want)
{
    return mlart_set_error(MLART_ECONFIG, "%s: bad value '%s' for key '%s' (want %s)", origin,
                           value, keys[k].name, want);
}

static int parse_int64(const char *s, int64_t *out)
{
    char *end;
    long long v;
    errno = 0;
    while (isspace((unsigned char)*s))
        s++;
    if (!*s)
        return -1;
    v = strtoll(s, &end, 10);
    while (isspace((unsigned char)*end))
        end++;
    if (errno || *end)
        return -1;
    *out = v;
    return 0;
}

/* Decimal, or hexadecimal after 0x/0X because seeds are often printed in hex.
 * Never octal: a zero-padded "010" is ten, as whoever wrote it meant.  Digits
 * are read here rather than by strtoull, which would also take a sign, blanks
 * after the prefix and, in base 16, a second "0x". */
static int parse_seed(const char *s, uint64_t *out)
{
    unsigned base = 10;
    uint64_t v = 0;
    int digits = 0;
    while (isspace((unsigned char)*s))
        s++;
    if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
        base = 16;
        s += 2;
    }
    for (; *s && !isspace((unsigned char)*s); s++, digits++) {
        unsigned d;
        if (isdigit((unsigned char)*s))
            d = (unsigned)(*s - '0');
        else if (base == 16 && isxdigit((unsigned char)*s))
            d = (unsigned)(tolower((unsigned char)*s) - 'a' + 10);
        else
            return -1;
        if (v > (UINT64_MAX - d) / base)
            return -1; /* past 2^64 - 1 */
        v = v * base + d;
    }
    while (isspace((unsigned char)*s))
        s++;
    if (!digits || *s)
        return -1;
    *out = v;
    return 0;
}

static int set_value(mlart_config *cfg, int k, const char *value, const char *origin)
{
    const key_def *d = &keys[k];
    char want[96], trimmed[256];
    {
        /* blanks around a value are not part of it, from whichever origin
         * (an INI line's are already gone; --set and the environment keep
         * them); a value too long for the copy is refused as it is */
        const char *b = value, *e = value + strlen(value);
        while (isspace((unsigned char)*b))
            b++;
        while (e > b && isspace((unsigned char)e[-1]))
            e--;
        if ((b != value || *e) && (size_t)(e - b) < sizeof trimmed) {
            memcpy(trimmed, b, (size_t)(e - b));
            trimmed[e - b] = 0;
            value = trimmed;
        }
    }
    switch (d->kind) {
    case V_INT: {
        int64_t v;
        snprintf(want, sizeof want, "an integer in [%lld, %lld]", (long long)d->min,
                 (long long)d->max);
        if (parse_int64(value, &v) || v < d->min || v > d->max)
            return bad_value(k, value, origin, want);
        switch (k) {
        case K_HEADS: cfg->heads_total = (int32_t)v; break;
        case K_QK_NOPE: cfg->geom.qk_nope = (int32_t)v; break;
        case K_ROPE: cfg->geom.rope = (int32_t)v; break;
        case K_KV_LORA: cfg->geom.kv_lora = (int32_t)v; break;
        case K_V_HEAD: cfg->geom.v_head = (int32_t)v; break;
        case K_TOPK: cfg->geom.topk = (int32_t)v; break;
        case K_PAGE: cfg->geom.page_size = (int32_t)v; break;
        case K_LAYERS: cfg->layers = (int32_t)v; break;
        case K_EARLY_WEIGHTS: cfg->early_weights = (int32_t)v; break;
        case K_VALIDATE: cfg->validate_indices = (int32_t)v; break;
        case K_TP: cfg->tp_size = (int32_t)v; break;
        case K_DCP: cfg->dcp_size = (int32_t)v; break;
        case K_INTERLEAVE: cfg->dcp_interleave = (int32_t)v; break;
        case K_BATCH: cfg->batch = (int32_t)v; break;
        case K_CONTEXT: cfg->context = (int32_t)v; break;
        case K_STEPS: cfg->steps = (int32_t)v; break;
        default: return mlart_set_error(MLART_EINTERNAL, "config: key %s not wired", d->name);
        }
        break;
    }
    case V_U64: {
        uint64_t v;
        if (parse_seed(value, &v))
            return bad_value(k, value, origin,
                             "an unsigned 64-bit integer, decimal or 0x-prefixed hexadecimal");
        cfg->seed = v;
        break;
    }
    case V_FLOAT: {
        char *end;
        double v;
        errno = 0;
        v = strtod(value, &end);
        while (isspace((unsigned char)*end))
            end++;
        /* the value is kept as a float: one that rounds to 0 there is refused
         * here, naming the key, rather than by the geometry check at finish */
        if (end == value || errno || *end || !isfinite(v) || !(v > 0.0) || v > 1e30 ||
            !((float)v > 0.0f))
            return bad_value(k, value, origin, "a number in (0, 1e30], not 0 as a float");
        cfg->geom.softmax_scale = (float)v;
        break;
    }
    case V_STRING: {
        size_t n = strlen(value);
        if (n >= sizeof cfg->backend)
            return bad_value(k, value, origin, "a name shorter than 64 characters");
        for (size_t i = 0; i < n; i++)
            if (!isalnum((unsigned char)value[i]) && value[i] != '_' && value[i] != '-')
                return bad_value(k, value, origin, "a backend name of letters, digits, '_', '-'");
        memcpy(cfg->backend, value, n + 1);
        break;
    }
    case V_KV_FORMAT:
        if (!strcmp(value, "bf16"))
            cfg->geom.kv_format = MLART_KV_BF16;
        else if (!strcmp(value, "fp8_ds_mla"))
            cfg->geom.kv_format = MLART_KV_FP8_DS_MLA;
        else
            return bad_value(k, value, origin, "bf16 or fp8_ds_mla");
        break;
    case V_DEVICE:
        if (!strcmp(value, "cpu"))
            cfg->device = MLART_DEVICE_CPU;
        else if (!strcmp(value, "cuda"))
            cfg->device = MLART_DEVICE_CUDA;
        else if (!strcmp(value, "auto"))
            cfg->device = MLART_DEVICE_AUTO;
        else
            return bad_value(k, value, origin, "cpu, cuda or auto");
        break;
    case V_ROUTING:
        if (!strcmp(value, "ag_rs"))
            cfg->dcp_routing = MLART_DCP_AG_RS;
        else if (!strcmp(value, "a2a"))
            cfg->dcp_routing = MLART_DCP_A2A;
        else
            return bad_value(k, value, origin, "ag_rs or a2a");
        break;
    case V_LIST: {
        int32_t sizes[MLART_CONFIG_MAX_GRAPH_SIZES];
        int n = 0;
        const char *p = value;
        snprintf(want, sizeof want,
                 "a comma-separated increasing list of at most %d integers in [1, %lld]",
                 MLART_CONFIG_MAX_GRAPH_SIZES, (long long)d->max);
        for (;;) {
            char item[32];
            const char *comma = strchr(p, ',');
            size_t len = comma ? (size_t)(comma - p) : strlen(p);
            int64_t v;
            if (len >= sizeof item || n == MLART_CONFIG_MAX_GRAPH_SIZES)
                return bad_value(k, value, origin, want);
            memcpy(item, p, len);
            item[len] = 0;
            if (parse_int64(item, &v) || v < d->min || v > d->max ||
                (n > 0 && v <= sizes[n - 1]))
                return bad_value(k, value, origin, want);
            sizes[n++] = (int32_t)v;
            if (!comma)
                break;
            p = comma + 1;
        }
        memcpy(cfg->graph_sizes, sizes, sizeof sizes[0] * (size_t)n);
        cfg->num_graph_sizes = n;
        break;
    }
    }
    snprintf(cfg->origin[k], sizeof cfg->origin[k], "%s", origin);
    return 0;
}

int mlart_config_set(mlart_config *cfg, const char *key, const char *value, const char *origin)
{
    int k;
    if (!cfg || !key || !value)
        return mlart_set_error(MLART_EINVAL, "mlart_config_set: NULL argument");
    if (!origin)
        origin = "mlart_config_set";
    k = find_key(key);
    if (k < 0)
        return mlart_set_error(MLART_ECONFIG, "%s: unknown key '%s'", origin, key);
    return set_value(cfg, k, value, origin);
}

const char *mlart_config_origin(const mlart_config *cfg, const char *key)
{
    int k = cfg && key ? find_key(key) : -1;
    return k < 0 ? NULL : cfg->origin[k];
}

/* ---- file -------------------------------------------------------------- */

typedef struct file_reader {
    FILE *f;
    const char *path;
    int line;          /* line just handed to inih */
    int too_long_line; /* first line longer than inih's buffer, 0 if none */
    int nul_line;      /* first line holding a NUL byte, 0 if none */
    int read_errno;    /* errno of a failed read, 0 if none */
    int read_err_line; /* the line that read failed on */
    int rc;            /* first error of a key */
    int rc_line;       /* its line */
    int seen[K_COUNT]; /* line of each key in this file */
    mlart_config *cfg;
} file_reader;

/* Drop the line's leading white space.  Debian's inih is built with
 * INI_ALLOW_MULTILINE, which reads an indented line after a key as more of
 * that key's value; our keys have no multi-line values, so an indented key,
 * section or comment means the same as an unindented one. */
static void strip_indent(char *str)
{
    size_t n = 0;
    while (isspace((unsigned char)str[n]))
        n++;
    if (n)
        memmove(str, str + n, strlen(str + n) + 1);
}

/* A "[name]" line must name one of the four sections.  inih calls the key
 * handler only for keys, so an unknown section with no key under it would
 * otherwise pass unnoticed; and inih ignores whatever follows the ']', so
 * "[run] seed = 7" would drop the key: only a comment may follow.  inih skips
 * a UTF-8 byte order mark on the first line, so that line is read past it. */
static void check_section(file_reader *r, const char *str)
{
    static const char *const sections[] = {"model", "runtime", "parallel", "run"};
    const char *end, *rest;
    size_t n, rn;
    if (r->line == 1 && !strncmp(str, "\xEF\xBB\xBF", 3)) {
        str += 3;
        while (isspace((unsigned char)*str))
            str++;
    }
    if (r->rc < 0 || str[0] != '[' || !(end = strchr(str, ']')))
        return; /* not a section line, or inih reports its syntax */
    n = (size_t)(end - str - 1);
    for (rest = end + 1; isspace((unsigned char)*rest); rest++)
        ;
    if (*rest && *rest != ';' && *rest != '#') {
        for (rn = strlen(rest); isspace((unsigned char)rest[rn - 1]); rn--)
            ;
        r->rc = mlart_set_error(MLART_ECONFIG, "%s:%d: text '%.*s' after section [%.*s] (want "
                                "nothing or a comment)", r->path, r->line, (int)rn, rest, (int)n,
                                str + 1);
        return;
    }
    for (size_t i = 0; i < sizeof sections / sizeof sections[0]; i++)
        if (strlen(sections[i]) == n && !strncmp(str + 1, sections[i], n))
            return;
    r->rc = mlart_set_error(MLART_ECONFIG, "%s:%d: unknown section [%.*s] (want [model], "
                            "[runtime], [parallel] or [run])", r->path, r->line, (int)n, str + 1);
}

static char *read_failed(file_reader *r, int line)
{
    r->read_errno = errno ? errno : EIO;
    r->read_err_line = line;
    return NULL;
}

/* An fgets that counts lines, so the handler knows the line number (Debian's
 * inih is built without INI_HANDLER_LINENO).  A failed read ends the parse
 * like EOF does, but leaves errno in read_errno so the caller reports it
 * instead of taking the file as shorter than it is.  Read a byte at a time
 * rather than by fgets, whose caller cannot see a NUL byte: inih would take
 * the line as ending there and silently drop the rest of it. */
static char *read_line(char *str, int num, void *stream)
{
    file_reader *r = stream;
    size_t len = 0;
    int c = 0, nul = 0;
    errno = 0;
    while (len + 1 < (size_t)num && c != '\n' && (c = getc(r->f)) != EOF) {
        nul |= c == '\0';
        str[len++] = (char)c;
    }
    if (ferror(r->f))
        return read_failed(r, r->line + 1);
    if (!len)
        return NULL;
    str[len] = '\0';
    r->line++;
    if (c != '\n' && !feof(r->f)) {
        while ((c = getc(r->f)) != EOF && c != '\n')
            ;
        if (ferror(r->f))
            return read_failed(r, r->line);
        if (!r->too_long_line)
            r->too_long_line = r->line;
        str[0] = '\0'; /* parse nothing of it */
    } else if (nul) {
        if (!r->nul_line)
            r->nul_line = r->line;
        str[0] = '\0';
    }
    strip_indent(str);
    check_section(r, str);
    return str;
}

static int take_key(file_reader *r, const char *section, const char *name, const char *value)
{
    char origin[560];
    int k, rc;
    snprintf(origin, sizeof origin, "%s:%d", r->path, r->line);
    k = find_key(name);
    if (k < 0) {
        r->rc = mlart_set_error(MLART_ECONFIG, "%s: unknown key '%s' in [%s]", origin, name,
                                section);
        return 0;
    }
    if (strcmp(section, keys[k].section)) {
        r->rc = mlart_set_error(MLART_ECONFIG, "%s: key '%s' belongs in section [%s], found in "
                                "[%s]", origin, name, keys[k].section, section);
        return 0;
    }
    if (r->seen[k]) {
        r->rc = mlart_set_error(MLART_ECONFIG, "%s: duplicate key '%s' (first set at line %d)",
                                origin, name, r->seen[k]);
        return 0;
    }
    r->seen[k] = r->line;
    rc = set_value(r->cfg, k, value, origin);
    if (rc < 0) {
        r->rc = rc;
        return 0;
    }
    return 1;
}

static int on_key(void *user, const char *section, const char *name, const char *value)
{
    file_reader *r = user;
    int ok;
    if (r->rc < 0)
        return 1; /* report the first error only */
    ok = take_key(r, section, name, value);
    if (r->rc < 0)
        r->rc_line = r->line;
    return ok;
}

static const char *file_kind(mode_t mode)
{
    if (S_ISDIR(mode))
        return "a directory";
    if (S_ISCHR(mode))
        return "a character device";
    if (S_ISBLK(mode))
        return "a block device";
    if (S_ISSOCK(mode))
        return "a socket";
    return "of an unknown kind";
}

/* Open `path` for reading.  Only a regular file or a FIFO (a shell's
 * <(...)) is taken: on Linux fopen succeeds on a directory and only the
 * first read fails, which must not look like an empty config. */
static int open_config(const char *path, FILE **out)
{
    struct stat st;
    FILE *f = fopen(path, "r");
    if (!f)
        return mlart_set_error(MLART_EIO, "cannot open config file '%s': %s", path,
                               strerror(errno));
    if (fstat(fileno(f), &st)) {
        int e = errno;
        fclose(f);
        return mlart_set_error(MLART_EIO, "cannot stat config file '%s': %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode) && !S_ISFIFO(st.st_mode)) {
        fclose(f);
        return mlart_set_error(MLART_EIO, "config file '%s' is %s, not a regular file or FIFO",
                               path, file_kind(st.st_mode));
    }
    *out = f;
    return 0;
}

int mlart_config_read_file(mlart_config *cfg, const char *path)
{
    file_reader r;
    mlart_config tmp;
    int line;
    if (!cfg || !path)
        return mlart_set_error(MLART_EINVAL, "mlart_config_read_file: NULL argument");
    memset(&r, 0, sizeof r);
    r.path = path;
    MLART_CHECK(open_config(path, &r.f));
    tmp = *cfg; /* a failing read leaves cfg untouched */
    r.cfg = &tmp;
    line = ini_parse_stream(read_line, &r, on_key, &r);
    fclose(r.f);
    /* a line inih could not read, before the first bad key, is the cause to
     * name (an unclosed "[model" leaves the keys after it in no section) */
    if (r.rc < 0 && !(line > 0 && line < r.rc_line))
        return r.rc;
    if (r.read_errno)
        return mlart_set_error(MLART_EIO, "%s:%d: read error: %s", path, r.read_err_line,
                               strerror(r.read_errno));
    if (r.too_long_line)
        return mlart_set_error(MLART_ECONFIG, "%s:%d: line longer than %d characters", path,
                               r.too_long_line, INI_MAX_LINE - 2);
    if (r.nul_line)
        return mlart_set_error(MLART_ECONFIG, "%s:%d: NUL byte in line", path, r.nul_line);
    if (line > 0)
        return mlart_set_error(MLART_ECONFIG, "%s:%d: syntax error (want 'key = value', "
                               "'[section]' or a comment)", path, line);
    if (line < 0)
        return mlart_set_error(MLART_ENOMEM, "%s: out of memory while parsing", path);
    snprintf(tmp.path, sizeof tmp.path, "%s", path);
    *cfg = tmp;
    return 0;
}

int mlart_config_read_env(mlart_config *cfg)
{
    mlart_config tmp;
    if (!cfg)
        return mlart_set_error(MLART_EINVAL, "mlart_config_read_env: NULL config");
    tmp = *cfg;
    for (int k = 0; k < K_COUNT; k++) {
        const char *v = getenv(keys[k].env);
        char origin[64];
        if (!v || !*v)
            continue;
        snprintf(origin, sizeof origin, "environment %s", keys[k].env);
        MLART_CHECK(set_value(&tmp, k, v, origin));
    }
    *cfg = tmp;
    return 0;
}

/* "set at X" or "default" for messages about relations between keys */
static const char *where(const mlart_config *cfg, int k)
{
    return cfg->origin[k][0] ? cfg->origin[k] : "default";
}

int mlart_config_finish(mlart_config *cfg)
{
    mlart_geometry g;
    int rc;
    if (!cfg)
        return mlart_set_error(MLART_EINVAL, "mlart_config_finish: NULL config");
    for (int k = 0; k < K_COUNT; k++)
        if (keys[k].required && !cfg->origin[k][0])
            return mlart_set_error(MLART_ECONFIG, "missing required key '%s' in section [%s]%s%s",
                                   keys[k].name, keys[k].section, cfg->path[0] ? " of " : "",
                                   cfg->path);
    /* the fields are public: a caller may have set them past mlart_config_set's checks */
    if (cfg->tp_size < 1 || cfg->dcp_size < 1 || cfg->dcp_interleave < 1)
        return mlart_set_error(MLART_ECONFIG, "tp_size = %d, dcp_size = %d, dcp_interleave = %d: "
                               "each must be at least 1", cfg->tp_size, cfg->dcp_size,
                               cfg->dcp_interleave);
    if (cfg->heads_total % cfg->tp_size)
        return mlart_set_error(MLART_ECONFIG,
                               "heads = %d (%s) is not divisible by tp_size = %d (%s): every "
                               "tensor-parallel rank needs the same number of heads",
                               cfg->heads_total, where(cfg, K_HEADS), cfg->tp_size,
                               where(cfg, K_TP));
    if (cfg->tp_size % cfg->dcp_size)
        return mlart_set_error(MLART_ECONFIG,
                               "tp_size = %d (%s) is not divisible by dcp_size = %d (%s): the "
                               "decode-context-parallel group lies inside the TP group",
                               cfg->tp_size, where(cfg, K_TP), cfg->dcp_size, where(cfg, K_DCP));
    g = cfg->geom;
    g.heads = cfg->heads_total / cfg->tp_size;
    if (!cfg->origin[K_SCALE][0] && g.qk_nope + g.rope > 0)
        g.softmax_scale = (float)(1.0 / sqrt((double)(g.qk_nope + g.rope)));
    if (g.kv_format == MLART_KV_FP8_DS_MLA && g.kv_lora % 128)
        return mlart_set_error(MLART_ECONFIG,
                               "kv_format = fp8_ds_mla (%s) needs kv_lora_rank to be a multiple "
                               "of 128, got %d (%s)",
                               where(cfg, K_KV_FORMAT), g.kv_lora, where(cfg, K_KV_LORA));
    rc = mlart_geometry_check(&g);
    if (rc < 0)
        return mlart_set_error(MLART_ECONFIG, "%s%s%s", mlart_last_error(),
                               cfg->path[0] ? " in " : "", cfg->path);
    cfg->geom = g;
    return 0;
}

int mlart_config_load(const char *path, mlart_config *out)
{
    mlart_config *cfg;
    int rc;
    if (!out)
        return mlart_set_error(MLART_EINVAL, "mlart_config_load: NULL out");
    cfg = malloc(sizeof *cfg);
    if (!cfg)
        return mlart_set_error(MLART_ENOMEM, "mlart_config_load: out of memory");
    mlart_config_init(cfg);
    rc = path ? mlart_config_read_file(cfg, path) : 0;
    if (rc == 0)
        rc = mlart_config_read_env(cfg);
    if (rc == 0)
        rc = mlart_config_finish(cfg);
    if (rc == 0)
        *out = *cfg;
    free(cfg);
    return rc;
}
