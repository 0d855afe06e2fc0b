/* Adaptation through the C ABI, under `kungfu-run -w -np 2`: a training
 * loop of allreduces whose model is checked at every step; the monitors
 * (noise scale, gradient variance, per-peer and per-strategy statistics);
 * proposals and agreement (a strategy swap, a custom action, a resize
 * proposed by one worker and agreed by all); the cluster grows 2 -> 3 and
 * shrinks 3 -> 2, new workers learning the step and the model through
 * kf_sync_state, the removed one told it is detached. */
#include <kungfu.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N 4096
#define STEPS 30

static int failures = 0;

#define CHECK(cond, ...)                                                  \
    do {                                                                  \
        if (!(cond)) {                                                    \
            fprintf(stderr, "rank %d: check failed at %s:%d: ", kf_rank(), \
                    __FILE__, __LINE__);                                  \
            fprintf(stderr, __VA_ARGS__);                                 \
            fprintf(stderr, " (%s)\n", kf_last_error());                  \
            failures++;                                                   \
        }                                                                 \
    } while (0)

#define OK(call) CHECK((call) == KF_OK, "%s", #call)

/* the model after `step` steps: each adds the mean gradient, 1 + j % 5 */
static float model_at(uint64_t step, int j) { return (float)step * (float)(1 + j % 5); }

static int check_model(const float *m, uint64_t step) {
    for (int j = 0; j < N; j++) {
        if (m[j] != model_at(step, j)) {
            fprintf(stderr, "rank %d: model[%d] = %g at step %llu, expected %g\n", kf_rank(), j,
                    m[j], (unsigned long long)step, model_at(step, j));
            return 0;
        }
    }
    return 1;
}

int main(void) {
    OK(kf_init());
    static float model[N], grad[N];
    uint64_t step = 0;
    const char *names[] = {"model"};
    void *bufs[] = {model};
    uint64_t bytes[] = {sizeof model};
    /* new workers learn the step and the model; the first ones agree */
    OK(kf_sync_state(&step, names, bufs, bytes, 1));
    CHECK(check_model(model, step), "model after the first sync");
    int64_t joined_at = kf_version();

    while (step < STEPS) {
        int n = kf_size(), me = kf_rank();
        for (int j = 0; j < N; j++) grad[j] = (float)(1 + j % 5) + (float)me - (float)(n - 1) / 2;
        double local_sq = 0;
        OK(kf_sq_norm(grad, N, &local_sq));
        kf_handle h;
        OK(kf_allreduce(grad, grad, N, KF_FLOAT32, KF_SUM, "grad", NULL, NULL, &h));
        OK(kf_wait(h, 60000));
        for (int j = 0; j < N; j++) model[j] += grad[j] / (float)n;
        step++;
        CHECK(check_model(model, step), "model at step %llu", (unsigned long long)step);

        /* monitors: the mean gradient's norm against a worker's */
        double big_sq = 0, b = 0;
        for (int j = 0; j < N; j++) grad[j] /= (float)n;
        OK(kf_sq_norm(grad, N, &big_sq));
        if (n > 1) {
            OK(kf_noise_scale("grad", 0.5, local_sq, big_sq, 32, 32.0 * n, &b));
            CHECK(!isnan(b), "a noise scale estimate");
        }
        CHECK(kf_gradient_variance(local_sq, big_sq) >= 0, "variance");

        /* proposals: worker 1 asks for RING at step 5 and a custom action;
         * worker 0 the resizes at steps 10 and 20 */
        if (me == 1 && step == 5) {
            kf_action a = {KF_ACTION_SET_STRATEGY, 0, KF_STRATEGY_RING};
            OK(kf_propose(&a));
            kf_action c = {KF_ACTION_CUSTOM, 7, 42};
            OK(kf_propose(&c));
        }
        if (me == 0 && (step == 10 || step == 20)) {
            kf_action a = {KF_ACTION_RESIZE, 0, step == 10 ? 3 : 2};
            OK(kf_propose(&a));
        }
        kf_action agreed[4];
        int32_t na = -1;
        OK(kf_agree(step, agreed, 4, &na));
        CHECK(na >= 0 && na <= 4, "agreed count %d", na);
        for (int i = 0; i < na; i++) {
            if (agreed[i].kind == KF_ACTION_SET_STRATEGY) {
                CHECK(step == 5 && agreed[i].value == KF_STRATEGY_RING, "the strategy swap");
            } else if (agreed[i].kind == KF_ACTION_CUSTOM) {
                CHECK(step == 5 && agreed[i].custom_kind == 7 && agreed[i].value == 42, "custom");
            } else if (agreed[i].kind == KF_ACTION_RESIZE) {
                int32_t changed = -1, detached = -1;
                OK(kf_resize((int32_t)agreed[i].value, &changed, &detached));
                CHECK(changed == 1, "the cluster changed");
                if (detached) {
                    printf("rank %d: detached at step %llu; all C checks %s\n", me,
                           (unsigned long long)step, failures ? "FAILED" : "passed");
                    kf_finalize();
                    return failures ? 1 : 0;
                }
                uint64_t s = step;
                OK(kf_sync_state(&s, names, bufs, bytes, 1));
                CHECK(s == step, "step after the resize");
                CHECK(kf_size() == (int)agreed[i].value, "size %d", kf_size());
            } else {
                CHECK(0, "unexpected action kind %d", agreed[i].kind);
            }
        }
    }

    /* per-peer and per-strategy statistics of what ran */
    kf_peer_stats ps[8];
    int32_t np = 0;
    OK(kf_get_peer_stats(ps, 8, &np));
    CHECK(np == kf_size(), "peer stats for %d ranks", np);
    kf_strategy_stats ss[16];
    int32_t ns = 0;
    OK(kf_get_strategy_stats(ss, 16, &ns));
    CHECK(ns >= 1, "strategy stats");
    /* bad input is refused, not trusted */
    kf_action bad = {99, 0, 0};
    CHECK(kf_propose(&bad) == KF_ERR_INVALID_ARGUMENT, "unknown action kind");
    kf_action bad_strategy = {KF_ACTION_SET_STRATEGY, 0, 77};
    CHECK(kf_propose(&bad_strategy) == KF_ERR_INVALID_ARGUMENT, "unknown strategy");
    CHECK(kf_propose(NULL) == KF_ERR_INVALID_ARGUMENT, "NULL action");
    int32_t na = 0;
    CHECK(kf_agree(step, NULL, 4, &na) == KF_ERR_INVALID_ARGUMENT, "NULL out");
    CHECK(kf_resize(0, NULL, NULL) == KF_ERR_INVALID_ARGUMENT, "size 0");
    CHECK(kf_noise_scale("x", 0.5, 1, 1, 8, 4, &(double){0}) == KF_ERR_INVALID_ARGUMENT,
          "b_big < b_small");
    OK(kf_reset_stats());

    printf("rank %d: joined at version %lld, %d workers at step %llu, version %lld; all C checks %s\n",
           kf_rank(), (long long)joined_at, kf_size(), (unsigned long long)step,
           (long long)kf_version(), failures ? "FAILED" : "passed");
    OK(kf_finalize());
    return failures ? 1 : 0;
}
