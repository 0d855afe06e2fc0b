/* The checks the C test programs share. A program defines WHO_FMT and WHO
 * (how its lines name the worker, e.g. "rank %d" and its rank variable)
 * before including this, and reads `failures` at its end:
 *
 *   CHECK(cond, fmt, ...)   counts a failed check and says where
 *   MUST(call)              a kf_* call that must return KF_OK, or exit 1 */
#ifndef KUNGFU_TEST_CHECK_H
#define KUNGFU_TEST_CHECK_H

#include <kungfu.h>

#include <stdio.h>
#include <stdlib.h>

static int failures = 0;

#define CHECK(cond, ...)                                                      \
    do {                                                                      \
        if (!(cond)) {                                                        \
            fprintf(stderr, WHO_FMT ": check failed at %s:%d: ", WHO,         \
                    __FILE__, __LINE__);                                      \
            fprintf(stderr, __VA_ARGS__);                                     \
            fprintf(stderr, "\n");                                            \
            failures++;                                                       \
        }                                                                     \
    } while (0)

#define MUST(call)                                                            \
    do {                                                                      \
        kf_status s_ = (call);                                                \
        if (s_ != KF_OK) {                                                    \
            fprintf(stderr, WHO_FMT ": %s -> %s (%s)\n", WHO, #call,          \
                    kf_status_string(s_), kf_last_error());                   \
            exit(1);                                                          \
        }                                                                     \
    } while (0)

#endif
