/* Runs a Check suite and turns its count of failures into main()'s exit
 * status (0 or 1).  fork: CK_FORK_GETENV (Check's own default: forks each
 * test unless CK_FORK=no is in the environment), CK_FORK (always, ignoring
 * the environment) or CK_NOFORK (never). */
#ifndef MLART_TESTS_CHECK_RUN_H
#define MLART_TESTS_CHECK_RUN_H

#include <check.h>

static inline int check_run(Suite *s, enum fork_status fork)
{
    SRunner *sr = srunner_create(s);
    int failed;
    srunner_set_fork_status(sr, fork);
    srunner_run_all(sr, CK_NORMAL);
    failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}

#endif
