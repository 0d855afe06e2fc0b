/* Shrink and continue through the C ABI, under `kungfu-run -np 4
 * --on-failure shrink`: a training loop of exact int32 gradients (a sum
 * checked element by element, a model agreed by consensus at every step).
 * The worker that started as rank DIES exits at step AT; each survivor's
 * op fails with KF_ERR_PEER_LOST naming it, the survivors call kf_recover,
 * find themselves renumbered in a cluster of 3 at version 1, call
 * kf_sync_state, run the failed step again and go on to the end, every
 * value still exact.
 *
 *   recover [DIES AT STEPS]   (defaults 2 15 40)
 *
 * Each survivor ends with "start rank S: ... all C checks passed";
 * ffi/tests/c_recover.rs checks those lines. */
#include <kungfu.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N 1024

static int start_rank = -1;
#define WHO_FMT "start rank %d"
#define WHO start_rank
#include "check.h"

/* The detail of the last failed op (kf_release overwrites kf_last_error). */
static char detail[1024];

/* Waits for an op and releases it; keeps the detail of a failure. */
static kf_status finish(kf_handle h) {
    kf_status s = kf_wait(h, -1);
    if (s != KF_OK) snprintf(detail, sizeof detail, "%s", kf_last_error());
    MUST(kf_release(h));
    return s;
}

/* Rank r's gradient at `step`: small integers, so every sum is exact. */
static int32_t grad_of(int r, uint64_t step, int j) {
    return (int32_t)((r + j + (int)(step % 7)) % 5);
}

/* One step: the sum of every rank's gradient, checked exactly, added to
 * the model, which every rank must hold alike. The model changes only
 * once the whole step succeeded, so a failed step leaves a consistent
 * state (the step and the model before it) for kf_sync_state. Returns
 * the first failed op's status. */
static kf_status train(int32_t *model, uint64_t step) {
    static int32_t grad[N], next[N];
    int n = kf_size(), me = kf_rank();
    for (int j = 0; j < N; j++) grad[j] = grad_of(me, step, j);
    kf_handle h;
    MUST(kf_allreduce(grad, grad, N, KF_INT32, KF_SUM, "grad", NULL, NULL, &h));
    kf_status s = finish(h);
    if (s != KF_OK) return s;
    for (int j = 0; j < N; j++) {
        int32_t want = 0;
        for (int r = 0; r < n; r++) want += grad_of(r, step, j);
        if (grad[j] != want) {
            fprintf(stderr, "start rank %d: step %llu: sum[%d] = %d, expected %d\n", start_rank,
                    (unsigned long long)step, j, (int)grad[j], (int)want);
            exit(4); /* a wrong value is never recovered from */
        }
        next[j] = (model[j] + grad[j]) % 65536;
    }
    int agreed = -1;
    MUST(kf_consensus(next, sizeof next, "model", &agreed, NULL, NULL, &h));
    s = finish(h);
    if (s != KF_OK) return s;
    CHECK(agreed == 1, "step %llu: the workers' models differ", (unsigned long long)step);
    memcpy(model, next, sizeof next);
    return KF_OK;
}

/* What a survivor checks once it recovered from the loss of the worker
 * that started as rank `dies` (the first loss: its rank was its start
 * rank) at step `failed_at`, from a cluster of `size` at `version`. */
static void check_recovery(int dies, int size, int64_t version, uint64_t failed_at,
                           uint64_t step) {
    char needs[32];
    snprintf(needs, sizeof needs, "needs rank %d", dies);
    CHECK(strstr(detail, needs) != NULL, "the error names rank %d: %s", dies, detail);
    int want_rank = start_rank < dies ? start_rank : start_rank - 1;
    CHECK(kf_size() == size - 1, "size %d after the recovery", kf_size());
    CHECK(kf_rank() == want_rank, "rank %d after the recovery, expected %d", kf_rank(), want_rank);
    CHECK(kf_version() == version + 1, "version %lld after the recovery", (long long)kf_version());
    CHECK(step == failed_at, "step %llu after kf_sync_state, expected %llu",
          (unsigned long long)step, (unsigned long long)failed_at);
    printf("start rank %d: recovered at step %llu: rank %d/%d at version %lld\n", start_rank,
           (unsigned long long)step, kf_rank(), kf_size(), (long long)kf_version());
}

int main(int argc, char **argv) {
    int dies = argc > 1 ? atoi(argv[1]) : 2;
    uint64_t at = argc > 2 ? strtoull(argv[2], NULL, 10) : 15;
    uint64_t steps = argc > 3 ? strtoull(argv[3], NULL, 10) : 40;
    MUST(kf_init());
    start_rank = kf_rank();
    static int32_t model[N];
    const char *names[] = {"model"};
    void *bufs[] = {model};
    uint64_t bytes[] = {sizeof model};
    uint64_t step = 0;
    MUST(kf_sync_state(&step, names, bufs, bytes, 1));
    int recovered = 0;

    while (step < steps) {
        if (start_rank == dies && step == at) {
            printf("start rank %d: exiting at step %llu\n", start_rank, (unsigned long long)step);
            fflush(stdout);
            exit(3);
        }
        int size = kf_size();
        int64_t version = kf_version();
        kf_status s = train(model, step);
        if (s == KF_ERR_PEER_LOST) {
            /* `detail` is kf_last_error() of the op that failed: it names
             * the lost rank and where it ran (`op "grad" (epoch 0) needs
             * rank 2: rank 2 is lost: ... (the worker at HOST:PORT)`) */
            printf("start rank %d: step %llu: KF_ERR_PEER_LOST: %s\n", start_rank,
                   (unsigned long long)step, detail);
            kf_status r = kf_recover();
            if (r != KF_OK) {
                /* KF_ERR_MEMBERSHIP_CHANGED: the others went on without
                 * this worker (it was frozen, or cut off) */
                fprintf(stderr, "kf_recover: %s (%s)\n", kf_status_string(r), kf_last_error());
                kf_finalize();
                return 1;
            }
            /* kf_rank(), kf_size() and kf_version() describe the new
             * cluster; every survivor goes on from one state */
            uint64_t failed_at = step;
            MUST(kf_sync_state(&step, names, bufs, bytes, 1));
            check_recovery(dies, size, version, failed_at, step);
            recovered++;
            continue; /* the failed step runs again */
        }
        MUST(s);
        step++;
    }
    CHECK(recovered == 1, "recovered %d times", recovered);
    printf("start rank %d: %llu steps, now rank %d/%d at version %lld; all C checks %s\n",
           start_rank, (unsigned long long)step, kf_rank(), kf_size(), (long long)kf_version(),
           failures ? "FAILED" : "passed");
    fflush(stdout);
    kf_finalize();
    return failures ? 1 : 0;
}
