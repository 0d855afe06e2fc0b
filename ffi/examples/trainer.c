// The complete example of docs/c-api.md (scripts/doc-commands.py checks
// that the two stay the same, and runs the commands that build and run it).
#include <kungfu.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(call)                                                              \
    do {                                                                         \
        kf_status s_ = (call);                                                   \
        if (s_ != KF_OK) {                                                       \
            fprintf(stderr, "%s: %s (%s)\n", #call, kf_status_string(s_), kf_last_error()); \
            exit(1);                                                             \
        }                                                                        \
    } while (0)

static void done(kf_handle h, kf_status s, void *user) {
    (void)h;
    if (s == KF_OK) printf("%s reduced\n", (const char *)user);
}

int main(void) {
    CHECK(kf_init());
    int rank = kf_rank(), size = kf_size();

    enum { N = 1 << 20 };
    float *grad = malloc(N * sizeof(float)), *bias = malloc(16 * sizeof(float));
    for (int i = 0; i < N; i++) grad[i] = (float)rank;
    for (int i = 0; i < 16; i++) bias[i] = 1.0f;

    /* two named ops in flight at once; the second in place, with a callback */
    kf_handle hg, hb;
    CHECK(kf_allreduce(grad, grad, N, KF_FLOAT32, KF_AVG, "grad/fc1", NULL, NULL, &hg));
    CHECK(kf_allreduce(bias, bias, 16, KF_FLOAT32, KF_SUM, "grad/bias", done, "bias", &hb));
    CHECK(kf_wait(hb, -1));
    CHECK(kf_wait(hg, -1));
    CHECK(kf_release(hg));
    CHECK(kf_release(hb));
    printf("rank %d of %d: grad %g (expect %g), bias %g (expect %d)\n", rank, size, grad[0],
           (size - 1) / 2.0, bias[0], size);

    /* many small tensors fused into one message */
    float small[8][4];
    kf_handle hs[8];
    CHECK(kf_group_start());
    for (int t = 0; t < 8; t++) {
        char name[32];
        snprintf(name, sizeof name, "small/%d", t);
        for (int i = 0; i < 4; i++) small[t][i] = (float)t;
        CHECK(kf_allreduce(small[t], small[t], 4, KF_FLOAT32, KF_MAX, name, NULL, NULL, &hs[t]));
    }
    CHECK(kf_group_end());
    for (int t = 0; t < 8; t++) {
        CHECK(kf_wait(hs[t], -1));
        CHECK(kf_release(hs[t]));
    }

    /* the same initial weights everywhere */
    CHECK(kf_broadcast(grad, grad, N, KF_FLOAT32, 0, "init/weights", NULL, NULL, &hg));
    CHECK(kf_wait(hg, -1));
    CHECK(kf_release(hg));

    free(grad);
    free(bias);
    CHECK(kf_finalize());
    return 0;
}
