/* What the test host backend saw, read back by the runtime tests through
 * dlsym(handle, "testhost_record"). */
#ifndef MLART_TESTS_PLUGINS_TESTHOST_H
#define MLART_TESTS_PLUGINS_TESTHOST_H

#include "mlart/backend.h"

#define TESTHOST_MAX_Q 65536 /* bf16 elements of q_nope kept */

typedef struct testhost_record {
    int creates, destroys, plans, attends;
    mlart_backend_init init;
    mlart_plan plan;
    mlart_step step;            /* the last step attend() received */
    uint16_t q_nope[TESTHOST_MAX_Q]; /* its q_nope, gathered through the view's strides */
    int64_t q_nope_count;
} testhost_record;

typedef testhost_record *(*testhost_record_fn)(void);

#endif
