/* A fake data-parallel trainer against the installed libkungfu, run under
 * kungfu-run: 40 named "gradients" of 1 element to 1 Mi elements (4 MiB),
 * allreduced asynchronously in a different order on every rank, waited for
 * in yet another order and checked exactly; a fused group; broadcast,
 * allgather, reduce, gather, reduce-scatter, alltoall, consensus, barrier;
 * and the error paths of the ABI. Exits non-zero on the first failure. */
#define _POSIX_C_SOURCE 200809L
#include <kungfu.h>

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NGRAD 40

static int rank_ = -1;

#define FAIL(...)                                                 \
    do {                                                          \
        fprintf(stderr, "rank %d: %s:%d: ", rank_, __FILE__, __LINE__); \
        fprintf(stderr, __VA_ARGS__);                             \
        fprintf(stderr, "\n");                                    \
        exit(1);                                                  \
    } while (0)

#define CHECK(call)                                                         \
    do {                                                                    \
        kf_status s_ = (call);                                              \
        if (s_ != KF_OK)                                                    \
            FAIL("%s -> %s (%s)", #call, kf_status_string(s_), kf_last_error()); \
    } while (0)

#define EXPECT(call, want)                                                  \
    do {                                                                    \
        kf_status s_ = (call);                                              \
        if (s_ != (want))                                                   \
            FAIL("%s -> %s, expected %s (%s)", #call, kf_status_string(s_), \
                 kf_status_string(want), kf_last_error());                  \
    } while (0)

static size_t grad_len(int i) {
    /* 1, 2, 4, ... up to 1 Mi elements, with odd sizes between */
    size_t n = (size_t)1 << (i / 2);
    if (n > ((size_t)1 << 20)) n = (size_t)1 << 20;
    return i % 2 ? n + (size_t)i : n;
}

static float grad_value(int r, int i, size_t j) {
    /* small integers: sums are exact in f32 whatever the order */
    return (float)((r + 1) * (int)(j % 7 + 1) + i);
}

/* a per-rank permutation of 0..n-1 */
static void shuffle(int *v, int n, unsigned seed) {
    for (int i = 0; i < n; i++) v[i] = i;
    for (int i = n - 1; i > 0; i--) {
        seed = seed * 1103515245u + 12345u;
        int k = (int)((seed >> 8) % (unsigned)(i + 1));
        int t = v[i];
        v[i] = v[k];
        v[k] = t;
    }
}

static int callback_status[NGRAD];
static int callback_calls = 0;

static void on_done(kf_handle h, kf_status s, void *user) {
    (void)h;
    int i = (int)(intptr_t)user;
    __atomic_store_n(&callback_status[i], s == KF_OK ? 1 : -1, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&callback_calls, 1, __ATOMIC_SEQ_CST);
}

/* Counts the calls of a callback that a failed call must not make. */
static void on_counted(kf_handle h, kf_status s, void *user) {
    (void)h;
    (void)s;
    __atomic_add_fetch((int *)user, 1, __ATOMIC_SEQ_CST);
}

/* What the callback of an op without a handle saw, and an event for it
 * (nothing else says when such an op completed). */
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int calls;
    kf_status status;
    kf_handle handle;
    float out; /* the output buffer, read in the callback */
} forgotten = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, -1, 0, -1.0f};

static void on_forgotten(kf_handle h, kf_status s, void *user) {
    pthread_mutex_lock(&forgotten.mu);
    forgotten.calls++;
    forgotten.status = s;
    forgotten.handle = h;
    forgotten.out = *(const float *)user;
    pthread_cond_broadcast(&forgotten.cv);
    pthread_mutex_unlock(&forgotten.mu);
}

int main(void) {
    float x = 1.0f, y = 0.0f;
    kf_handle h = 0;

    /* before init: errors, no crash */
    EXPECT(kf_allreduce(&x, &y, 1, KF_FLOAT32, KF_SUM, "early", NULL, NULL, &h),
           KF_ERR_NOT_INITIALIZED);
    if (kf_rank() != -1) FAIL("kf_rank before init");
    EXPECT(kf_wait(1, 0), KF_ERR_NOT_INITIALIZED);

    CHECK(kf_init());
    CHECK(kf_init()); /* idempotent */
    rank_ = kf_rank();
    int size = kf_size();
    if (size < 2) FAIL("needs at least 2 ranks, got %d", size);
    if (kf_local_size() != size || kf_local_rank() != rank_)
        FAIL("local rank %d/%d", kf_local_rank(), kf_local_size());
    if (kf_cluster_version() != 0) FAIL("cluster version");

    /* 40 gradients, issued in a per-rank order, half with callbacks, a
     * quarter in place */
    float *send[NGRAD], *recv[NGRAD];
    kf_handle hs[NGRAD];
    int order[NGRAD];
    shuffle(order, NGRAD, 7u + 13u * (unsigned)rank_);
    for (int i = 0; i < NGRAD; i++) {
        size_t n = grad_len(i);
        send[i] = malloc(n * sizeof(float));
        if (!send[i]) FAIL("out of memory");
        for (size_t j = 0; j < n; j++) send[i][j] = grad_value(rank_, i, j);
        recv[i] = i % 4 == 0 ? send[i] : malloc(n * sizeof(float));
        if (!recv[i]) FAIL("out of memory");
    }
    for (int k = 0; k < NGRAD; k++) {
        int i = order[k];
        char name[32];
        snprintf(name, sizeof name, "grad/%02d", i);
        kf_callback cb = i % 2 ? on_done : NULL;
        CHECK(kf_allreduce(send[i], recv[i], grad_len(i), KF_FLOAT32, KF_SUM, name, cb,
                           (void *)(intptr_t)i, &hs[i]));
    }
    shuffle(order, NGRAD, 1000u + (unsigned)rank_);
    for (int k = 0; k < NGRAD; k++) {
        int i = order[k];
        CHECK(kf_wait(hs[i], 60000));
        int done = 0;
        CHECK(kf_test(hs[i], &done));
        if (!done) FAIL("kf_test after kf_wait: not done");
        CHECK(kf_release(hs[i]));
        EXPECT(kf_wait(hs[i], 0), KF_ERR_INVALID_ARGUMENT); /* released */
        EXPECT(kf_release(hs[i]), KF_ERR_INVALID_ARGUMENT);
        size_t n = grad_len(i);
        for (size_t j = 0; j < n; j++) {
            float want = (float)(size * (size + 1) / 2 * (int)(j % 7 + 1) + size * i);
            if (recv[i][j] != want)
                FAIL("grad %d element %zu: %g, expected %g", i, j, recv[i][j], want);
        }
    }
    for (int i = 1; i < NGRAD; i += 2) {
        /* callbacks run before kf_wait returns: output and status are set */
        if (__atomic_load_n(&callback_status[i], __ATOMIC_SEQ_CST) != 1)
            FAIL("callback of grad %d: %d", i, callback_status[i]);
    }
    if (__atomic_load_n(&callback_calls, __ATOMIC_SEQ_CST) != NGRAD / 2)
        FAIL("%d callbacks, expected %d", callback_calls, NGRAD / 2);
    for (int i = 0; i < NGRAD; i++) {
        if (recv[i] != send[i]) free(recv[i]);
        free(send[i]);
    }

    /* a fused group of small tensors, issued in a per-rank order */
    {
        enum { G = 12 };
        double in[G][3], out[G][3];
        kf_handle gh[G];
        int gorder[G];
        shuffle(gorder, G, 99u + (unsigned)rank_);
        CHECK(kf_group_start());
        for (int k = 0; k < G; k++) {
            int i = gorder[k];
            char name[32];
            snprintf(name, sizeof name, "fused/%d", i);
            for (int j = 0; j < 3; j++) in[i][j] = rank_ * 10 + i + j;
            CHECK(kf_allreduce(in[i], out[i], 3, KF_FLOAT64, KF_MAX, name, NULL, NULL, &gh[i]));
        }
        int done = 1;
        CHECK(kf_test(gh[0], &done));
        if (done) FAIL("a grouped op completed before kf_group_end");
        CHECK(kf_group_end());
        for (int i = 0; i < G; i++) {
            CHECK(kf_wait(gh[i], 60000));
            CHECK(kf_release(gh[i]));
            for (int j = 0; j < 3; j++)
                if (out[i][j] != (size - 1) * 10 + i + j) FAIL("fused %d[%d] = %g", i, j, out[i][j]);
        }
        EXPECT(kf_group_end(), KF_ERR_INVALID_ARGUMENT);
    }

    /* broadcast from rank 1, non-roots passing no send buffer */
    {
        int32_t b[1000];
        for (int j = 0; j < 1000; j++) b[j] = rank_ == 1 ? j * 3 : -1;
        CHECK(kf_broadcast(rank_ == 1 ? b : NULL, b, 1000, KF_INT32, 1, "bcast", NULL, NULL, &h));
        CHECK(kf_wait(h, 60000));
        CHECK(kf_release(h));
        for (int j = 0; j < 1000; j++)
            if (b[j] != j * 3) FAIL("broadcast[%d] = %d", j, b[j]);
    }

    /* allgather, gather, reduce, reduce-scatter, alltoall */
    {
        double mine[3] = {rank_, rank_ + 0.5, -rank_};
        double *all = malloc(sizeof(double) * 3 * (size_t)size);
        CHECK(kf_allgather(mine, all, 3, KF_FLOAT64, "allgather", NULL, NULL, &h));
        CHECK(kf_wait(h, 60000));
        CHECK(kf_release(h));
        for (int r = 0; r < size; r++)
            if (all[3 * r] != r || all[3 * r + 1] != r + 0.5 || all[3 * r + 2] != -r)
                FAIL("allgather block %d", r);
        memset(all, 0, sizeof(double) * 3 * (size_t)size);
        CHECK(kf_gather(mine, rank_ == 0 ? all : NULL, 3, KF_FLOAT64, 0, "gather", NULL, NULL, &h));
        CHECK(kf_wait(h, 60000));
        CHECK(kf_release(h));
        if (rank_ == 0)
            for (int r = 0; r < size; r++)
                if (all[3 * r + 1] != r + 0.5) FAIL("gather block %d", r);
        free(all);

        int64_t v = 100 - rank_, m = 0;
        CHECK(kf_reduce(&v, rank_ == size - 1 ? &m : NULL, 1, KF_INT64, KF_MIN, size - 1, "reduce", NULL, NULL, &h));
        CHECK(kf_wait(h, 60000));
        CHECK(kf_release(h));
        if (rank_ == size - 1 && m != 100 - (size - 1)) FAIL("reduce min = %lld", (long long)m);

        /* every rank gets its block of the last rank's, whose send alone
         * is read */
        int32_t *parts = malloc(sizeof(int32_t) * 2 * (size_t)size);
        for (int r = 0; r < 2 * size; r++) parts[r] = 1000 * (r / 2) + r % 2 + 7;
        int32_t part[2] = {-1, -1};
        CHECK(kf_scatter(rank_ == size - 1 ? parts : NULL, part, 2, KF_INT32, size - 1, "scatter",
                         NULL, NULL, &h));
        CHECK(kf_wait(h, 60000));
        CHECK(kf_release(h));
        if (part[0] != 1000 * rank_ + 7 || part[1] != 1000 * rank_ + 8)
            FAIL("scatter: %d %d", part[0], part[1]);
        free(parts);

        /* point to point: round the ring, then every other rank to rank 0,
         * which receives from any rank */
        {
            int64_t sent[3] = {rank_, 10 * rank_, -rank_}, got3[3] = {0, 0, 0};
            int next = (rank_ + 1) % size, prev = (rank_ + size - 1) % size, src = -1;
            kf_handle hs, hr;
            CHECK(kf_send(next, 42, sent, sizeof sent, NULL, NULL, &hs));
            CHECK(kf_recv(prev, 42, got3, sizeof got3, &src, NULL, NULL, &hr));
            CHECK(kf_wait(hr, 60000));
            CHECK(kf_release(hr));
            CHECK(kf_wait(hs, 60000));
            CHECK(kf_release(hs));
            if (src != prev || got3[0] != prev || got3[1] != 10 * prev || got3[2] != -prev)
                FAIL("recv from %d: source %d, %lld", prev, src, (long long)got3[1]);
            if (rank_ == 0) {
                int seen = 0;
                for (int k = 1; k < size; k++) {
                    int32_t v = -1;
                    int who = -1;
                    CHECK(kf_recv(KF_ANY_SOURCE, 7, &v, sizeof v, &who, NULL, NULL, &hr));
                    CHECK(kf_wait(hr, 60000));
                    CHECK(kf_release(hr));
                    if (who < 1 || who >= size || v != 100 + who)
                        FAIL("from any rank: %d from %d", v, who);
                    else
                        seen |= 1 << who;
                }
                if (seen != (1 << size) - 2) FAIL("from any rank: senders %x", seen);
            } else {
                int32_t v = 100 + rank_;
                CHECK(kf_send(0, 7, &v, sizeof v, NULL, NULL, &hs));
                CHECK(kf_wait(hs, 60000));
                CHECK(kf_release(hs));
            }
        }

        uint32_t *blocks = malloc(sizeof(uint32_t) * 2 * (size_t)size);
        uint32_t got[2];
        for (int r = 0; r < size; r++) {
            blocks[2 * r] = (uint32_t)r;
            blocks[2 * r + 1] = (uint32_t)rank_;
        }
        CHECK(kf_reduce_scatter(blocks, got, 2, KF_UINT32, KF_SUM, "rs", NULL, NULL, &h));
        CHECK(kf_wait(h, 60000));
        CHECK(kf_release(h));
        if (got[0] != (uint32_t)(rank_ * size) || got[1] != (uint32_t)(size * (size - 1) / 2))
            FAIL("reduce-scatter: %u %u", got[0], got[1]);
        uint32_t *swapped = malloc(sizeof(uint32_t) * 2 * (size_t)size);
        CHECK(kf_alltoall(blocks, swapped, 2, KF_UINT32, "a2a", NULL, NULL, &h));
        CHECK(kf_wait(h, 60000));
        CHECK(kf_release(h));
        for (int r = 0; r < size; r++)
            if (swapped[2 * r] != (uint32_t)rank_ || swapped[2 * r + 1] != (uint32_t)r)
                FAIL("alltoall block %d", r);
        free(blocks);
        free(swapped);
    }

    /* consensus, barrier */
    {
        int agreed = -1;
        const char same[] = "model-v1";
        CHECK(kf_consensus(same, sizeof same, "consensus/same", &agreed, NULL, NULL, &h));
        CHECK(kf_wait(h, 60000));
        CHECK(kf_release(h));
        if (agreed != 1) FAIL("consensus on equal data: %d", agreed);
        int differ = rank_;
        CHECK(kf_consensus(&differ, sizeof differ, "consensus/differ", &agreed, NULL, NULL, &h));
        CHECK(kf_wait(h, 60000));
        CHECK(kf_release(h));
        if (agreed != 0) FAIL("consensus on different data: %d", agreed);
        CHECK(kf_barrier(NULL, NULL, &h));
        CHECK(kf_wait(h, 60000));
        CHECK(kf_release(h));
    }

    /* a buffer that is not aligned for its type */
    {
        unsigned char raw[4 * 5 + 1];
        float *odd = (float *)(void *)(raw + 1);
        for (int j = 0; j < 5; j++) {
            float v = (float)(rank_ + j);
            memcpy(raw + 1 + 4 * j, &v, 4);
        }
        CHECK(kf_allreduce(odd, odd, 5, KF_FLOAT32, KF_SUM, "unaligned", NULL, NULL, &h));
        CHECK(kf_wait(h, 60000));
        CHECK(kf_release(h));
        for (int j = 0; j < 5; j++) {
            float v;
            memcpy(&v, raw + 1 + 4 * j, 4);
            if (v != (float)(size * (size - 1) / 2 + size * j)) FAIL("unaligned[%d] = %g", j, v);
        }
    }

    /* strategy swap, then ops on the new strategy */
    CHECK(kf_set_strategy(KF_STRATEGY_RING));
    CHECK(kf_allreduce(&x, &y, 1, KF_FLOAT32, KF_SUM, "after-swap", NULL, NULL, &h));
    CHECK(kf_wait(h, 60000));
    CHECK(kf_release(h));
    if (y != (float)size) FAIL("after the swap: %g", y);

    /* error paths: a clear status, never a crash */
    EXPECT(kf_allreduce(&x, &y, 1, KF_FLOAT32, KF_SUM, NULL, NULL, NULL, &h), KF_ERR_INVALID_ARGUMENT);
    EXPECT(kf_allreduce(&x, &y, 1, (kf_dtype)99, KF_SUM, "bad-type", NULL, NULL, &h),
           KF_ERR_INVALID_ARGUMENT);
    if (!strstr(kf_last_error(), "99")) FAIL("last error: %s", kf_last_error());
    EXPECT(kf_allreduce(&x, &y, 1, KF_FLOAT32, (kf_op)42, "bad-op", NULL, NULL, &h),
           KF_ERR_INVALID_ARGUMENT);
    EXPECT(kf_allreduce(&x, NULL, 1, KF_FLOAT32, KF_SUM, "no-recv", NULL, NULL, &h),
           KF_ERR_INVALID_ARGUMENT);
    EXPECT(kf_allreduce(NULL, &y, 1, KF_FLOAT32, KF_SUM, "no-send", NULL, NULL, &h),
           KF_ERR_INVALID_ARGUMENT);
    EXPECT(kf_allreduce(&x, &y, 1, KF_INT32, KF_AVG, "int-avg", NULL, NULL, &h),
           KF_ERR_INVALID_ARGUMENT);
    EXPECT(kf_broadcast(&x, &y, 1, KF_FLOAT32, size, "bad-root", NULL, NULL, &h),
           KF_ERR_INVALID_ARGUMENT);
    EXPECT(kf_broadcast(&x, &y, 1, KF_FLOAT32, -1, "neg-root", NULL, NULL, &h),
           KF_ERR_INVALID_ARGUMENT);
    EXPECT(kf_wait(987654321, 0), KF_ERR_INVALID_ARGUMENT);
    EXPECT(kf_release(987654321), KF_ERR_INVALID_ARGUMENT);
    EXPECT(kf_test(987654321, NULL), KF_ERR_INVALID_ARGUMENT);
    EXPECT(kf_set_strategy((kf_strategy)77), KF_ERR_INVALID_ARGUMENT);
    EXPECT(kf_consensus(&x, 4, "c", NULL, NULL, NULL, &h), KF_ERR_INVALID_ARGUMENT);
    /* a call that fails runs no callback and leaves no handle (a caller
     * frees its callback's context on the error status) */
    {
        int calls = 0;
        kf_handle bad = 0;
        EXPECT(kf_allreduce(&x, NULL, 1, KF_FLOAT32, KF_SUM, "no-recv-cb", on_counted, &calls, &bad),
               KF_ERR_INVALID_ARGUMENT);
        EXPECT(kf_broadcast(&x, &y, 1, KF_FLOAT32, size, "bad-root-cb", on_counted, &calls, &bad),
               KF_ERR_INVALID_ARGUMENT);
        EXPECT(kf_wait(bad, 0), KF_ERR_INVALID_ARGUMENT); /* no such handle */
        EXPECT(kf_gather(NULL, &y, 1, KF_FLOAT32, 0, "no-send-cb", on_counted, &calls, &bad),
               KF_ERR_INVALID_ARGUMENT);
        struct timespec pause = {0, 50 * 1000 * 1000};
        nanosleep(&pause, NULL);
        if (__atomic_load_n(&calls, __ATOMIC_SEQ_CST) != 0)
            FAIL("failed calls ran %d callback(s)", calls);
    }
    if (strcmp(kf_status_string(9999), "unknown status") != 0) FAIL("status string");
    if (strcmp(kf_status_string(KF_OK), "ok") != 0) FAIL("status string");

    /* a handle nobody asked for: the op still runs, writes its output and
     * calls back, once, with KF_OK */
    {
        float in = (float)(rank_ + 1), out = 0.0f;
        CHECK(kf_allreduce(&in, &out, 1, KF_FLOAT32, KF_SUM, "fire-and-forget", on_forgotten,
                           &out, NULL));
        struct timespec deadline;
        clock_gettime(CLOCK_REALTIME, &deadline);
        deadline.tv_sec += 60;
        pthread_mutex_lock(&forgotten.mu);
        while (forgotten.calls == 0)
            if (pthread_cond_timedwait(&forgotten.cv, &forgotten.mu, &deadline) != 0) break;
        pthread_mutex_unlock(&forgotten.mu);
        float want = (float)(size * (size + 1) / 2);
        if (forgotten.calls != 1 || forgotten.status != KF_OK || forgotten.handle == 0 ||
            forgotten.out != want || out != want)
            FAIL("fire-and-forget: %d calls, status %d, handle %llu, output %g in the callback, "
                 "%g after, expected %g",
                 forgotten.calls, forgotten.status, (unsigned long long)forgotten.handle,
                 forgotten.out, out, want);
        CHECK(kf_barrier(NULL, NULL, &h));
        CHECK(kf_wait(h, 60000));
        CHECK(kf_release(h));
    }

    CHECK(kf_finalize());
    CHECK(kf_finalize()); /* idempotent */
    EXPECT(kf_allreduce(&x, &y, 1, KF_FLOAT32, KF_SUM, "late", NULL, NULL, &h), KF_ERR_FINALIZED);
    EXPECT(kf_init(), KF_ERR_FINALIZED);
    EXPECT(kf_barrier(NULL, NULL, &h), KF_ERR_FINALIZED);
    if (kf_rank() != -1) FAIL("kf_rank after finalize");
    pthread_mutex_lock(&forgotten.mu);
    if (forgotten.calls != 1) FAIL("fire-and-forget: %d calls after finalize", forgotten.calls);
    pthread_mutex_unlock(&forgotten.mu);
    printf("rank %d: all C checks passed\n", rank_);
    return 0;
}
