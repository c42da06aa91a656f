#include "runtime/status.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static _Thread_local char last_error[1024];
static _Thread_local unsigned error_serial; /* mlart_set_error calls on this thread */

const char *mlart_strerror(int status)
{
    switch (status) {
#define MLART_STATUS_TEXT_(name, value, text) \
    case value:                             \
        return text;
        MLART_STATUS_MAP(MLART_STATUS_TEXT_)
#undef MLART_STATUS_TEXT_
    }
    return "unknown status";
}

const char *mlart_status_name(int status)
{
    switch (status) {
#define MLART_STATUS_NAME_(name, value, text) \
    case value:                             \
        return "MLART_" #name;
        MLART_STATUS_MAP(MLART_STATUS_NAME_)
#undef MLART_STATUS_NAME_
    }
    return "MLART_UNKNOWN";
}

const char *mlart_last_error(void)
{
    return last_error;
}

unsigned mlart_error_serial(void)
{
    return error_serial;
}

int mlart_set_error(int status, const char *fmt, ...)
{
    char msg[sizeof last_error];
    va_list ap;
    va_start(ap, fmt);
    if (vsnprintf(msg, sizeof msg, fmt, ap) >= (int)sizeof msg) /* fmt may use last_error itself */
        memcpy(msg + sizeof msg - 4, "...", 4); /* cut: say so */
    va_end(ap);
    memcpy(last_error, msg, sizeof msg);
    error_serial++;
    mlart_log(MLART_LOG_DEBUG, "%s: %s", mlart_status_name(status), msg);
    return status;
}

static int log_threshold(void)
{
    /* read once; threads may race to compute it, all to the same value, so
     * relaxed atomics suffice (a plain int here is a C11 data race) */
    static _Atomic int level_ = -1;
    int level = atomic_load_explicit(&level_, memory_order_relaxed);
    if (level < 0) {
        const char *s = getenv("MLART_LOG");
        int l = MLART_LOG_WARN;
        if (s) {
            if (!strcmp(s, "debug"))
                l = MLART_LOG_DEBUG;
            else if (!strcmp(s, "info"))
                l = MLART_LOG_INFO;
            else if (!strcmp(s, "warn"))
                l = MLART_LOG_WARN;
            else if (!strcmp(s, "error"))
                l = MLART_LOG_ERROR;
        }
        level = l;
        atomic_store_explicit(&level_, level, memory_order_relaxed);
    }
    return level;
}

void mlart_log(int level, const char *fmt, ...)
{
    static const char *const names[] = {"debug", "info", "warn", "error"};
    va_list ap;
    if (level < log_threshold())
        return;
    fprintf(stderr, "mlart %s: ", names[level < 0 ? 0 : level > 3 ? 3 : level]);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}
