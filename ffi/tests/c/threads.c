/* The thread-safety claims of docs/c-api.md, from a C client with
 * several threads per rank (run under kungfu-run; every rank runs the same
 * threads with the same op names, so the ranks' ops meet by name whatever
 * order the threads interleave in):
 *
 *   ops      T threads issue named allreduces and barriers at once, wait
 *            for them (half have callbacks) and check every value
 *   errors   kf_last_error is per thread: threads failing at once each
 *            read their own detail
 *   handles  an op started on one thread is waited for on two threads at
 *            once, tested and released on another
 *   groups   groups open on some threads hold those threads' ops only
 *   cbs      callbacks of ops started on several threads: data a callback
 *            wrote is visible once kf_wait returned, with no other lock
 *   finalize kf_finalize while the other threads keep starting ops: every
 *            op accepted calls back exactly once, later ones are refused
 *
 * Prints "rank R: threads: all checks passed" (and the counts of the last
 * part); exits non-zero on the first failure. */
#define _POSIX_C_SOURCE 200809L
#include <kungfu.h>

#include <inttypes.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define T 4      /* threads */
#define ROUNDS 8 /* rounds of K ops per thread */
#define K 6
#define ERROR_ROUNDS 50

static int rank_ = -1, size_ = -1;

#define FAIL(...)                                                         \
    do {                                                                  \
        fprintf(stderr, "rank %d: %s:%d: ", rank_, __FILE__, __LINE__);   \
        fprintf(stderr, __VA_ARGS__);                                     \
        fprintf(stderr, "\n");                                            \
        exit(1);                                                          \
    } while (0)

#define CHECK(call)                                                         \
    do {                                                                    \
        kf_status s_ = (call);                                              \
        if (s_ != KF_OK)                                                    \
            FAIL("%s -> %s (%s)", #call, kf_status_string(s_), kf_last_error()); \
    } while (0)

static pthread_barrier_t all_; /* the T threads */

static void sync_threads(void) {
    int r = pthread_barrier_wait(&all_);
    if (r != 0 && r != PTHREAD_BARRIER_SERIAL_THREAD) FAIL("pthread_barrier_wait: %d", r);
}

/* element j of thread t's op k of round i, on rank r: small integers, so
 * sums are exact */
static int32_t value(int r, int t, int i, int k, int j) {
    return (int32_t)(r * 1000 + t * 100 + i * 10 + k + j % 3);
}

static int32_t sum_over_ranks(int t, int i, int k, int j) {
    int32_t s = 0;
    for (int r = 0; r < size_; r++) s += value(r, t, i, k, j);
    return s;
}

static size_t count_of(int t, int k) { return (size_t)(1 + 37 * k + 5 * t); }

/* What callbacks saw, written with no lock of the C side: kf_wait returns
 * only after the op's callback returned (the documented ordering). */
typedef struct {
    int calls;
    kf_status status;
    int32_t first; /* the output's first element, read in the callback */
    const int32_t *out;
} seen;

static void on_done(kf_handle h, kf_status s, void *user) {
    (void)h;
    seen *c = user;
    c->calls++;
    c->status = s;
    c->first = c->out[0];
}

/* ops: rounds of K allreduces per thread, waited for in reverse order */
static void ops(int t) {
    for (int i = 0; i < ROUNDS; i++) {
        int32_t *buf[K];
        kf_handle h[K];
        seen cbs[K];
        memset(cbs, 0, sizeof cbs);
        for (int k = 0; k < K; k++) {
            size_t n = count_of(t, k);
            buf[k] = malloc(n * sizeof(int32_t));
            if (!buf[k]) FAIL("out of memory");
            for (size_t j = 0; j < n; j++) buf[k][j] = value(rank_, t, i, k, (int)j);
            char name[64];
            snprintf(name, sizeof name, "ops/t%d/r%d/k%d", t, i, k);
            cbs[k].out = buf[k];
            CHECK(kf_allreduce(buf[k], buf[k], n, KF_INT32, KF_SUM, name, k % 2 ? on_done : NULL,
                               &cbs[k], &h[k]));
        }
        for (int k = K - 1; k >= 0; k--) {
            CHECK(kf_wait(h[k], -1));
            CHECK(kf_release(h[k]));
            size_t n = count_of(t, k);
            for (size_t j = 0; j < n; j++)
                if (buf[k][j] != sum_over_ranks(t, i, k, (int)j))
                    FAIL("ops t%d r%d k%d [%zu] = %" PRId32 ", expected %" PRId32, t, i, k, j,
                         buf[k][j], sum_over_ranks(t, i, k, (int)j));
            if (k % 2 && (cbs[k].calls != 1 || cbs[k].status != KF_OK ||
                          cbs[k].first != sum_over_ranks(t, i, k, 0)))
                FAIL("callback of ops t%d r%d k%d: %d calls, status %d, saw %" PRId32, t, i, k,
                     cbs[k].calls, cbs[k].status, cbs[k].first);
            free(buf[k]);
        }
        if (kf_rank() != rank_ || kf_size() != size_ || kf_cluster_version() != 0)
            FAIL("kf_rank/kf_size/kf_cluster_version on thread %d", t);
        /* barriers of different threads are interchangeable */
        kf_handle b = 0;
        CHECK(kf_barrier(NULL, NULL, &b));
        CHECK(kf_wait(b, -1));
        CHECK(kf_release(b));
    }
}

/* errors: every thread fails with its own unknown handle, and only once
 * all have failed does each read kf_last_error: it must be its own */
static void errors(int t) {
    for (int i = 0; i < ERROR_ROUNDS; i++) {
        kf_handle bogus = 1000000000ull * (uint64_t)(t + 1) + (uint64_t)i;
        sync_threads();
        if (kf_wait(bogus, 0) != KF_ERR_INVALID_ARGUMENT) FAIL("kf_wait(%" PRIu64 ")", bogus);
        sync_threads();
        char want[64];
        snprintf(want, sizeof want, "handle %" PRIu64, bogus);
        if (!strstr(kf_last_error(), want))
            FAIL("thread %d: last error \"%s\", expected its own (%s)", t, kf_last_error(), want);
    }
}

/* handles: thread t starts ops; t and its neighbour wait for them at
 * once; the neighbour tests them; t releases them */
enum { M = 8 };
static kf_handle shared_[T][M];
static float shared_buf_[T][M][4];

static void handles(int t) {
    for (int m = 0; m < M; m++) {
        char name[64];
        snprintf(name, sizeof name, "handles/t%d/%d", t, m);
        for (int j = 0; j < 4; j++) shared_buf_[t][m][j] = (float)(rank_ + m + j);
        CHECK(kf_allreduce(shared_buf_[t][m], shared_buf_[t][m], 4, KF_FLOAT32, KF_MAX, name, NULL,
                           NULL, &shared_[t][m]));
    }
    sync_threads();
    int other = (t + 1) % T;
    for (int m = M - 1; m >= 0; m--) CHECK(kf_wait(shared_[other][m], -1));
    for (int m = 0; m < M; m++) CHECK(kf_wait(shared_[t][m], -1));
    for (int m = 0; m < M; m++) {
        int done = 0;
        CHECK(kf_test(shared_[other][m], &done));
        if (!done) FAIL("kf_test after kf_wait: not done");
        for (int j = 0; j < 4; j++)
            if (shared_buf_[other][m][j] != (float)(size_ - 1 + m + j))
                FAIL("handles t%d/%d[%d] = %g", other, m, j, shared_buf_[other][m][j]);
    }
    sync_threads();
    for (int m = 0; m < M; m++) CHECK(kf_release(shared_[t][m]));
}

/* groups: open on the even threads at once; the odd threads' ops meanwhile
 * are not held (a group belongs to its thread) */
static void groups(int t) {
    enum { G = 6 };
    double v[G][3];
    kf_handle h[G];
    sync_threads();
    if (t % 2 == 0) {
        CHECK(kf_group_start());
        for (int g = 0; g < G; g++) {
            char name[64];
            snprintf(name, sizeof name, "groups/t%d/%d", t, g);
            for (int j = 0; j < 3; j++) v[g][j] = rank_ + t * 10 + g + j;
            CHECK(kf_allreduce(v[g], v[g], 3, KF_FLOAT64, KF_MIN, name, NULL, NULL, &h[g]));
        }
    }
    sync_threads();
    if (t % 2 == 1) {
        char name[64];
        snprintf(name, sizeof name, "groups/t%d/alone", t);
        double x = rank_;
        kf_handle hx = 0;
        CHECK(kf_allreduce(&x, &x, 1, KF_FLOAT64, KF_MAX, name, NULL, NULL, &hx));
        kf_status s = kf_wait(hx, 30000);
        if (s != KF_OK)
            FAIL("an op outside any group, while other threads hold groups: %s (%s)",
                 kf_status_string(s), kf_last_error());
        CHECK(kf_release(hx));
        if (x != size_ - 1) FAIL("groups t%d alone = %g", t, x);
    }
    sync_threads();
    if (t % 2 == 0) {
        int done = 1;
        CHECK(kf_test(h[0], &done));
        if (done) FAIL("a grouped op completed before kf_group_end");
        CHECK(kf_group_end());
        for (int g = 0; g < G; g++) {
            CHECK(kf_wait(h[g], -1));
            CHECK(kf_release(h[g]));
            for (int j = 0; j < 3; j++)
                if (v[g][j] != t * 10 + g + j) FAIL("groups t%d/%d[%d] = %g", t, g, j, v[g][j]);
        }
    }
}

/* finalize: threads start ops until they are refused */
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    long calls, ok, finalized, peer_lost, other;
} race_ = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0};
static long accepted_[T];
static float race_buf_[T][2];

static void on_race(kf_handle h, kf_status s, void *user) {
    (void)h;
    (void)user;
    pthread_mutex_lock(&race_.mu);
    race_.calls++;
    if (s == KF_OK) race_.ok++;
    else if (s == KF_ERR_FINALIZED) race_.finalized++;
    else if (s == KF_ERR_PEER_LOST) race_.peer_lost++;
    else race_.other++;
    pthread_cond_broadcast(&race_.cv);
    pthread_mutex_unlock(&race_.mu);
}

static void race(int t) {
    for (long i = 0;; i++) {
        char name[64];
        snprintf(name, sizeof name, "race/t%d/%ld", t, i);
        /* fire-and-forget: nothing else may touch the output until the
         * callback, so all ops of this thread share one buffer */
        kf_status s = kf_allreduce(race_buf_[t], race_buf_[t], 2, KF_FLOAT32, KF_SUM, name, on_race,
                                   NULL, NULL);
        if (s == KF_ERR_FINALIZED) break;
        if (s != KF_OK) FAIL("race: kf_allreduce -> %s (%s)", kf_status_string(s), kf_last_error());
        accepted_[t]++;
        if (i == 0) sync_threads(); /* every thread has one in flight */
    }
}

static void *thread_main(void *arg) {
    int t = (int)(intptr_t)arg;
    CHECK(kf_init()); /* idempotent, from any thread */
    ops(t);
    errors(t);
    handles(t);
    groups(t);
    sync_threads();
    race(t);
    return NULL;
}

int main(void) {
    CHECK(kf_init());
    rank_ = kf_rank();
    size_ = kf_size();
    /* the runtime starts on its first use, from whichever thread: here
     * from all at once (T threads plus this one for the finalize part) */
    if (pthread_barrier_init(&all_, NULL, T + 1) != 0) FAIL("pthread_barrier_init");
    pthread_t th[T];
    for (int t = 0; t < T; t++)
        if (pthread_create(&th[t], NULL, thread_main, (void *)(intptr_t)t) != 0)
            FAIL("pthread_create");
    /* the threads' barriers: errors (2 per round), handles (2), groups
     * (3), race start, and the first op of each in the race */
    for (int b = 0; b < 2 * ERROR_ROUNDS + 7; b++) sync_threads();
    CHECK(kf_finalize());
    for (int t = 0; t < T; t++)
        if (pthread_join(th[t], NULL) != 0) FAIL("pthread_join");
    long accepted = 0;
    for (int t = 0; t < T; t++) accepted += accepted_[t];
    /* every accepted op calls back once: by now, or (at most) a few
     * seconds later if its completion was running on a library thread */
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 30;
    pthread_mutex_lock(&race_.mu);
    while (race_.calls < accepted)
        if (pthread_cond_timedwait(&race_.cv, &race_.mu, &deadline) != 0) break;
    long calls = race_.calls, other = race_.other;
    printf("rank %d: threads: kf_finalize while %d threads start ops: %ld accepted, %ld callbacks "
           "(%ld ok, %ld finalized, %ld peer lost, %ld other)\n",
           rank_, T, accepted, calls, race_.ok, race_.finalized, race_.peer_lost, other);
    pthread_mutex_unlock(&race_.mu);
    if (calls != accepted) FAIL("%ld callbacks for %ld accepted ops", calls, accepted);
    if (other != 0) FAIL("%ld callbacks with an unexpected status", other);
    printf("rank %d: threads: all checks passed\n", rank_);
    return 0;
}
