/* Live transport swaps through the C ABI, under `kungfu-run --transport
 * tcp`: a training loop of exact int32 gradients (a sum checked element by
 * element, a model agreed by consensus every step) that swaps to shared
 * memory at step 10 and back to TCP at step 20 (kf_set_transport, every
 * rank at the same step), then at step 30 asks for libfabric, which rank 1
 * lacks (it names a provider no libfabric has): every rank must get an
 * error, and training goes on, exact, on TCP.
 *
 *   swap [STEPS]   (default 40)
 *
 * Each rank ends with "rank R: ... all C checks passed"; ffi/tests/c_swap.rs
 * checks the lines. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <kungfu.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N 4096

static int rank_ = -1;
#define WHO_FMT "rank %d"
#define WHO rank_
#include "check.h"

static int32_t grad_of(int r, uint64_t step, int j) {
    return (int32_t)((r * 3 + j + (int)(step % 11)) % 7);
}

/* One step: the exact sum of every rank's gradient, added to a model that
 * every rank must hold alike. */
static void train(int32_t *model, uint64_t step) {
    static int32_t grad[N];
    int n = kf_size(), me = kf_rank();
    for (int j = 0; j < N; j++) grad[j] = grad_of(me, step, j);
    kf_handle h;
    MUST(kf_allreduce(grad, grad, N, KF_INT32, KF_SUM, "grad", NULL, NULL, &h));
    MUST(kf_wait(h, -1));
    MUST(kf_release(h));
    for (int j = 0; j < N; j++) {
        int32_t want = 0;
        for (int r = 0; r < n; r++) want += grad_of(r, step, j);
        if (grad[j] != want) {
            fprintf(stderr, "rank %d: step %llu: sum[%d] = %d, expected %d\n", rank_,
                    (unsigned long long)step, j, (int)grad[j], (int)want);
            exit(4);
        }
        model[j] = (model[j] + grad[j]) % 65536;
    }
    int agreed = -1;
    MUST(kf_consensus(model, sizeof(int32_t) * N, "model", &agreed, NULL, NULL, &h));
    MUST(kf_wait(h, -1));
    MUST(kf_release(h));
    CHECK(agreed == 1, "step %llu: the models differ", (unsigned long long)step);
}

int main(int argc, char **argv) {
    uint64_t steps = argc > 1 ? strtoull(argv[1], NULL, 10) : 40;
    /* before kf_init, which reads it: rank 1 asks for a provider no
     * libfabric has, the others for the one this machine has */
    const char *r = getenv("KUNGFU_RANK");
    setenv("KUNGFU_FABRIC_PROVIDER", r && !strcmp(r, "1") ? "no-such-provider" : "tcp;ofi_rxm",
           1);
    MUST(kf_init());
    rank_ = kf_rank();
    static int32_t model[N];
    for (uint64_t step = 0; step < steps; step++) {
        if (step == 10 || step == 20) {
            kf_transport to = step == 10 ? KF_TRANSPORT_SHM : KF_TRANSPORT_TCP;
            kf_status s = kf_set_transport(to);
            CHECK(s == KF_OK, "step %llu: kf_set_transport(%d) -> %s (%s)",
                  (unsigned long long)step, (int)to, kf_status_string(s), kf_last_error());
            printf("rank %d: step %llu: swapped to %s\n", rank_, (unsigned long long)step,
                   to == KF_TRANSPORT_SHM ? "shm" : "tcp");
        }
        if (step == 30) {
            kf_status s = kf_set_transport(KF_TRANSPORT_FABRIC);
            CHECK(s != KF_OK, "step 30: a swap to a transport rank 1 lacks succeeded");
            printf("rank %d: step 30: fabric refused: %s\n", rank_, kf_status_string(s));
            if (rank_ == 1) printf("rank 1: why: %s\n", kf_last_error());
        }
        train(model, step);
    }
    if (failures == 0)
        printf("rank %d: %llu steps, every value exact; all C checks passed\n", rank_,
               (unsigned long long)steps);
    fflush(stdout);
    MUST(kf_finalize());
    return failures == 0 ? 0 : 1;
}
