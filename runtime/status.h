/* Internal: error recording and logging used across the library. */
#ifndef MLART_RUNTIME_STATUS_H
#define MLART_RUNTIME_STATUS_H

#include "mlart/backend.h" /* MLART_LOG_* levels */
#include "mlart/mlart.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define MLART_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define MLART_PRINTF(a, b)
#endif

/* Exported from libmlart.so although no public header declares them: the
 * companion archive libmlart_rendezvous.a records its errors through them,
 * linked against either libmlart. */
/* Record the detail for mlart_last_error() on this thread; returns status. */
MLART_API int mlart_set_error(int status, const char *fmt, ...) MLART_PRINTF(2, 3);
/* Log to stderr if level >= MLART_LOG (default warn). */
MLART_API void mlart_log(int level, const char *fmt, ...) MLART_PRINTF(2, 3);

/* How many details this thread has recorded: a caller that compares it
 * before and after a backend call knows whether the backend's failure came
 * with a detail of its own. */
unsigned mlart_error_serial(void);

/* Return on error; the failing call has already recorded its detail. */
#define MLART_CHECK(call)                                                               \
    do {                                                                                \
        int mlart_rc_ = (call);                                                         \
        if (mlart_rc_ < 0) {                                                            \
            mlart_log(MLART_LOG_DEBUG, "%s:%d: %s -> %s", __FILE__, __LINE__, #call,    \
                      mlart_status_name(mlart_rc_));                                    \
            return mlart_rc_;                                                           \
        }                                                                               \
    } while (0)

#ifdef __cplusplus
}
#endif
#endif /* MLART_RUNTIME_STATUS_H */
