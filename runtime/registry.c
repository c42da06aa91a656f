/* Backend registry: built-in tables, then modules from MLART_BACKEND_PATH. */
#include "runtime/registry.h"

#include "runtime/status.h"

#include <ctype.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef MLART_HAVE_REFERENCE
#include "backends/reference/reference.h"
#endif
#ifdef MLART_HAVE_B12X_MLA_SPARSE
#include "backends/b12x_mla_sparse/b12x.h"
#endif

typedef const mlart_backend_vtable *(*builtin_fn)(void);

typedef struct builtin {
    const char *name;
    builtin_fn table;
} builtin;

static const builtin builtins[] = {
#ifdef MLART_HAVE_REFERENCE
    {"reference", mlart_backend_reference_vtable},
#endif
#ifdef MLART_HAVE_B12X_MLA_SPARSE
    {"b12x_mla_sparse", mlart_backend_b12x_mla_sparse_vtable},
#endif
    {NULL, NULL},
};

static const char *const builtin_names[] = {
#ifdef MLART_HAVE_REFERENCE
    "reference",
#endif
#ifdef MLART_HAVE_B12X_MLA_SPARSE
    "b12x_mla_sparse",
#endif
    NULL,
};

const char *const *mlart_backend_builtins(void)
{
    return builtin_names;
}

/* Modules stay loaded for the process lifetime: layers hold their tables. */
typedef struct module {
    struct module *next;
    char name[64];
    void *handle;
    const mlart_backend_vtable *vt;
} module;

static pthread_mutex_t modules_lock = PTHREAD_MUTEX_INITIALIZER;
static module *modules;
/* The module this thread is loading, holding modules_lock: a lookup from its
 * constructors or entry point would wait for that lock forever. */
static _Thread_local const char *loading;

/* A table's name for a message, read no further than a valid name can be
 * long (63 bytes and its NUL): a longer or unterminated one is cut and
 * marked "...", bytes outside printable ASCII are shown as '?'. */
static void table_name_text(const char *s, char out[68])
{
    size_t i = 0;
    for (; i < 63 && s[i]; i++)
        out[i] = s[i] >= 0x20 && s[i] < 0x7f ? s[i] : '?';
    if (i == 63 && s[i])
        out[i++] = '.', out[i++] = '.', out[i++] = '.';
    out[i] = '\0';
}

int mlart_backend_validate(const mlart_backend_vtable *vt, const char *name, const char *where)
{
    if (!vt)
        return mlart_set_error(MLART_EABI, "%s: entry point returned a NULL backend table", where);
    if (vt->abi_version != MLART_BACKEND_ABI_VERSION)
        return mlart_set_error(MLART_EABI,
                               "%s: built for backend ABI version %u, this runtime speaks "
                               "version %u; rebuild the backend against this mlart",
                               where, vt->abi_version, MLART_BACKEND_ABI_VERSION);
    if (vt->struct_size < MLART_BACKEND_VTABLE_V1_SIZE)
        return mlart_set_error(MLART_EABI,
                               "%s: backend table declares struct_size %u bytes, an ABI v1 table "
                               "has at least %zu",
                               where, vt->struct_size, (size_t)MLART_BACKEND_VTABLE_V1_SIZE);
    if (!vt->name)
        return mlart_set_error(MLART_EABI, "%s: backend table has no name", where);
    if (name && strcmp(vt->name, name)) {
        char got[68];
        table_name_text(vt->name, got);
        return mlart_set_error(MLART_EABI, "%s: backend table calls itself '%s', expected '%s'",
                               where, got, name);
    }
#define REQUIRED_(slot)                                                                       \
    if (!vt->slot)                                                                            \
        return mlart_set_error(MLART_EABI, "%s: backend '%s' has no %s() (a required slot)", \
                               where, vt->name, #slot);
    REQUIRED_(create)
    REQUIRED_(destroy)
    REQUIRED_(plan)
    REQUIRED_(attend)
#undef REQUIRED_
    return 0;
}

static int valid_name(const char *name)
{
    size_t n = strlen(name);
    if (n == 0 || n >= 64)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (!isalnum((unsigned char)name[i]) && name[i] != '_' && name[i] != '-')
            return 0;
    return 1;
}

/* Open one module file; on success *out holds a validated table. */
static int load_module(const char *path, const char *name, module **out)
{
    void *h;
    mlart_backend_entry_v1_fn entry;
    const mlart_backend_vtable *vt;
    module *m;
    int rc;
    dlerror();
    h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        return mlart_set_error(MLART_EABI, "backend module %s cannot be loaded: %s", path,
                               e ? e : "unknown dlopen error");
    }
    dlerror();
    *(void **)&entry = dlsym(h, MLART_BACKEND_ENTRY_V1_SYMBOL);
    if (!entry) {
        dlclose(h);
        return mlart_set_error(MLART_EABI,
                               "%s is not an mlart backend module: it does not export %s()",
                               path, MLART_BACKEND_ENTRY_V1_SYMBOL);
    }
    vt = entry();
    rc = mlart_backend_validate(vt, name, path);
    if (rc < 0) {
        dlclose(h);
        return rc;
    }
    m = calloc(1, sizeof *m);
    if (!m) {
        dlclose(h);
        return mlart_set_error(MLART_ENOMEM, "backend registry: out of memory");
    }
    snprintf(m->name, sizeof m->name, "%s", name);
    m->handle = h;
    m->vt = vt;
    *out = m;
    return 0;
}

static int lookup_module(const char *name, const mlart_backend_vtable **out)
{
    const char *env = getenv("MLART_BACKEND_PATH");
    char looked[600] = "", more[96] = "";
    size_t used = 0;
    int unlisted = 0, too_long = 0;
    const char *p;
    for (module *m = modules; m; m = m->next)
        if (!strcmp(m->name, name)) {
            *out = m->vt;
            return 0;
        }
    for (p = env; p && *p;) {
        const char *colon = strchr(p, ':');
        size_t len = colon ? (size_t)(colon - p) : strlen(p);
        char path[4096];
        if (len > 0 && len + strlen(name) + 32 < sizeof path) {
            module *m = NULL;
            int rc;
            snprintf(path, sizeof path, "%.*s/libmlart-backend-%s.so", (int)len, p, name);
            if (access(path, F_OK) == 0) {
                loading = name;
                rc = load_module(path, name, &m);
                loading = NULL;
                if (rc < 0)
                    return rc;
                m->next = modules;
                modules = m;
                mlart_log(MLART_LOG_INFO, "loaded backend '%s' from %s", name, path);
                *out = m->vt;
                return 0;
            }
            if (used + 2 + len < sizeof looked) /* whole, or counted below */
                used += (size_t)snprintf(looked + used, sizeof looked - used, "%s%.*s",
                                         used ? ", " : "", (int)len, p);
            else
                unlisted++;
        } else if (len > 0) {
            too_long++; /* no path fits: not searched */
        }
        p = colon ? colon + 1 : NULL;
    }
    if (unlisted)
        snprintf(more, sizeof more, " and %d more", unlisted);
    if (too_long)
        snprintf(more + strlen(more), sizeof more - strlen(more),
                 "; not searched: %d entr%s too long for a path", too_long,
                 too_long == 1 ? "y" : "ies");
    {
        char names[256] = "";
        size_t n = 0;
        for (const builtin *b = builtins; b->name; b++)
            if (n < sizeof names)
                n += (size_t)snprintf(names + n, sizeof names - n, "%s%s", n ? ", " : "",
                                      b->name);
        if (!env || !*env)
            return mlart_set_error(MLART_ENOBACKEND,
                                   "unknown backend '%s': built-ins are [%s], and "
                                   "MLART_BACKEND_PATH is not set, so no module "
                                   "libmlart-backend-%s.so was searched for",
                                   name, names, name);
        return mlart_set_error(MLART_ENOBACKEND,
                               "unknown backend '%s': built-ins are [%s]; looked for "
                               "libmlart-backend-%s.so in MLART_BACKEND_PATH directories: %s%s",
                               name, names, name, looked[0] || unlisted ? looked : "(none)", more);
    }
}

int mlart_backend_lookup(const char *name, const mlart_backend_vtable **out)
{
    const mlart_backend_vtable *vt = NULL;
    int rc;
    if (!name || !out)
        return mlart_set_error(MLART_EINVAL, "mlart_backend_lookup: NULL argument");
    if (!valid_name(name))
        return mlart_set_error(MLART_ENOBACKEND, "invalid backend name '%s' (want 1-63 letters, "
                               "digits, '_' or '-')", name);
    for (const builtin *b = builtins; b->name; b++)
        if (!strcmp(b->name, name)) {
            char where[96];
            vt = b->table();
            snprintf(where, sizeof where, "built-in backend '%s'", name);
            MLART_CHECK(mlart_backend_validate(vt, name, where));
            *out = vt;
            return 0;
        }
    if (loading)
        return mlart_set_error(MLART_EABI, "backend '%s' looked up while module '%s' is being "
                               "loaded (from its entry point or a constructor): look it up "
                               "later, e.g. in create()", name, loading);
    pthread_mutex_lock(&modules_lock);
    rc = lookup_module(name, &vt);
    pthread_mutex_unlock(&modules_lock);
    if (rc == 0)
        *out = vt;
    return rc;
}
