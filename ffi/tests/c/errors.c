/* The error statuses a C caller can only meet in a job of several
 * processes, one scenario per run (`errors SCENARIO` under kungfu-run):
 *
 *   mismatch        ranks pass different counts; kf_set_strategy disagrees
 *   timeout         rank 2 never joins an op: rank 0 (a short op timeout)
 *                   times out, rank 1 is told and sees the op aborted
 *   peer-lost       rank 1 _exit()s without kf_finalize
 *   duplicate-name  two live ops whose names hash alike (FNV-1a 64)
 *   pending         kf_wait's timeout passes before the peer joins
 *   transport       rank 1 cuts ops into other chunks than rank 0: a
 *                   protocol violation that rank 0 detects
 *   fork            a child forked after the runtime started
 *   finalize        kf_finalize with ops in flight (their callbacks run)
 *   bootstrap       rank 0's environment is bad (kf_init fails); rank 1
 *                   cannot reach rank 0 (its runtime does not start)
 *   stall           rank 1 posts an op late: both ranks' kf_stall_report
 *                   names it meanwhile, and is empty once the op is done
 *
 * Each rank prints what it saw, "rank R: SCENARIO: WHAT -> STATUS" (the
 * status by its name in kungfu.h), and "rank R: SCENARIO: done" at the end;
 * ffi/tests/c_errors.rs checks those lines. Every op is waited for with
 * kf_wait(h, -1), which the op timeout bounds. A call that must succeed
 * and does not exits non-zero (and kungfu-run stops the job); a rank that
 * dies on purpose exits 0, which kungfu-run lets the others outlive. */
#define _POSIX_C_SOURCE 200809L
#include <kungfu.h>

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int rank_ = -1;
static const char *scenario_ = "?";

#define FAIL(...)                                                        \
    do {                                                                 \
        fprintf(stderr, "rank %d: %s: %s:%d: ", rank_, scenario_, __FILE__, \
                __LINE__);                                               \
        fprintf(stderr, __VA_ARGS__);                                    \
        fprintf(stderr, "\n");                                           \
        exit(1);                                                         \
    } while (0)

#define CHECK(call)                                                         \
    do {                                                                    \
        kf_status s_ = (call);                                              \
        if (s_ != KF_OK)                                                    \
            FAIL("%s -> %s (%s)", #call, status_name(s_), kf_last_error()); \
    } while (0)

static const char *status_name(kf_status s) {
    switch (s) {
    case KF_OK: return "KF_OK";
    case KF_ERR_INVALID_ARGUMENT: return "KF_ERR_INVALID_ARGUMENT";
    case KF_ERR_NOT_INITIALIZED: return "KF_ERR_NOT_INITIALIZED";
    case KF_ERR_MISMATCH: return "KF_ERR_MISMATCH";
    case KF_ERR_PEER_LOST: return "KF_ERR_PEER_LOST";
    case KF_ERR_TIMEOUT: return "KF_ERR_TIMEOUT";
    case KF_ERR_ABORTED: return "KF_ERR_ABORTED";
    case KF_ERR_DUPLICATE_NAME: return "KF_ERR_DUPLICATE_NAME";
    case KF_ERR_MEMBERSHIP_CHANGED: return "KF_ERR_MEMBERSHIP_CHANGED";
    case KF_ERR_INTERNAL: return "KF_ERR_INTERNAL";
    case KF_ERR_FINALIZED: return "KF_ERR_FINALIZED";
    case KF_ERR_BOOTSTRAP: return "KF_ERR_BOOTSTRAP";
    case KF_ERR_TRANSPORT: return "KF_ERR_TRANSPORT";
    case KF_PENDING: return "KF_PENDING";
    default: return "(not a kf_status)";
    }
}

/* The detail of the last failure that finish() saw (kf_release would
 * overwrite kf_last_error's). */
static char detail_[1024];

/* Prints what a call returned and, for an error, its detail: the one
 * finish() kept, else kf_last_error (read before any other call). */
static void report(const char *what, kf_status s) {
    const char *detail = detail_[0] ? detail_ : kf_last_error();
    printf("rank %d: %s: %s -> %s\n", rank_, scenario_, what, status_name(s));
    if (s != KF_OK) printf("rank %d: %s: %s: detail: %s\n", rank_, scenario_, what, detail);
    detail_[0] = 0;
    fflush(stdout);
}

/* The rank kungfu-run gave this process, before kf_init (to set per-rank
 * settings, which kf_init reads). */
static int launcher_rank(void) {
    const char *r = getenv("KUNGFU_RANK");
    if (!r) FAIL("KUNGFU_RANK is not set: run under kungfu-run");
    return atoi(r);
}

static void set_env(const char *k, const char *v) {
    if (setenv(k, v, 1) != 0) FAIL("setenv %s: %s", k, strerror(errno));
}

/* Starts `name`, an in-place sum of `n` floats. */
static kf_handle start_sum(float *buf, size_t n, const char *name) {
    kf_handle h = 0;
    CHECK(kf_allreduce(buf, buf, n, KF_FLOAT32, KF_SUM, name, NULL, NULL, &h));
    return h;
}

/* Waits for an op, releases its handle, returns its status. */
static kf_status finish(kf_handle h) {
    kf_status s = kf_wait(h, -1);
    detail_[0] = 0;
    if (s != KF_OK) snprintf(detail_, sizeof detail_, "%s", kf_last_error());
    CHECK(kf_release(h));
    return s;
}

/* A sum of ones that must succeed: every rank gets the cluster size. */
static void sum_ok(const char *name) {
    float v[3] = {1, 1, 1};
    kf_status s = finish(start_sum(v, 3, name));
    if (s != KF_OK) FAIL("%s -> %s", name, status_name(s));
    for (int i = 0; i < 3; i++)
        if (v[i] != (float)kf_size()) FAIL("%s: %g, expected %d", name, v[i], kf_size());
}

static void barrier(void) {
    kf_handle h = 0;
    CHECK(kf_barrier(NULL, NULL, &h));
    CHECK(kf_wait(h, -1));
    CHECK(kf_release(h));
}

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* What one op's callback saw. */
typedef struct {
    pthread_mutex_t mu;
    int calls;
    kf_status status;
    kf_handle handle;
} record;

static void on_done(kf_handle h, kf_status s, void *user) {
    record *r = user;
    pthread_mutex_lock(&r->mu);
    r->calls++;
    r->status = s;
    r->handle = h;
    pthread_mutex_unlock(&r->mu);
}

static void report_callback(const char *what, record *r) {
    pthread_mutex_lock(&r->mu);
    printf("rank %d: %s: callback of %s -> %s, %d call(s)\n", rank_, scenario_, what,
           r->calls ? status_name(r->status) : "(not called)", r->calls);
    pthread_mutex_unlock(&r->mu);
    fflush(stdout);
}

static void mismatch(void) {
    barrier();
    float v[2] = {1, 1};
    report("allreduce with another count on each rank",
           finish(start_sum(v, (size_t)rank_ + 1, "mismatch/count")));
    report("kf_set_strategy to another strategy on each rank",
           kf_set_strategy(rank_ == 0 ? KF_STRATEGY_RING : KF_STRATEGY_STAR));
    /* one count, another check (a shape [2] against [1, 2]) */
    CHECK(kf_set_check(0x5a5a0000u + (uint64_t)rank_));
    report("allreduce with another check on each rank", finish(start_sum(v, 2, "mismatch/check")));
    CHECK(kf_set_check(77));
    sum_ok("mismatch/same-check");
    report("allreduce with the same check", KF_OK);
    /* a call that fails takes the check too: the next op has none */
    CHECK(kf_set_check(0xbad0 + (uint64_t)rank_));
    if (kf_allreduce(v, v, 2, KF_FLOAT32, KF_SUM, NULL, NULL, NULL, NULL) != KF_ERR_INVALID_ARGUMENT)
        FAIL("an allreduce without a name was not refused");
    sum_ok("mismatch/check-taken");
    report("allreduce after a refused call took the check", KF_OK);
    /* a fused member's check */
    float a[2] = {1, 1}, b[2] = {1, 1};
    kf_handle ha = 0, hb = 0;
    CHECK(kf_group_start());
    CHECK(kf_allreduce(a, a, 2, KF_FLOAT32, KF_SUM, "mismatch/member-a", NULL, NULL, &ha));
    CHECK(kf_set_check(0x77 + (uint64_t)rank_));
    CHECK(kf_allreduce(b, b, 2, KF_FLOAT32, KF_SUM, "mismatch/member-b", NULL, NULL, &hb));
    CHECK(kf_group_end());
    kf_status sa = finish(ha);
    report("fused allreduce whose member has another check on each rank", finish(hb));
    if (sa != KF_ERR_MISMATCH) FAIL("the other member of the fused op: %s", status_name(sa));
    /* neither failure poisons the session */
    sum_ok("mismatch/after");
    report("allreduce after the mismatches", KF_OK);
}

static void timeout(void) {
    barrier();
    if (rank_ < 2) {
        float v[16] = {0};
        report("allreduce that rank 2 never joins", finish(start_sum(v, 16, "timeout/lonely")));
    }
    /* rank 2 waits here for the others (its op timeout is long) */
    sum_ok("timeout/after");
    report("allreduce after the timeout", KF_OK);
}

static void peer_lost(void) {
    barrier();
    if (rank_ == 1) {
        printf("rank 1: %s: exiting without kf_finalize\n", scenario_);
        fflush(stdout);
        _exit(0);
    }
    float v[4] = {0};
    report("allreduce that needs the lost rank", finish(start_sum(v, 4, "peer-lost/a")));
    report("a later allreduce that needs it", finish(start_sum(v, 4, "peer-lost/b")));
}

/* FNV-1a 64, as the library hashes op names into ids. */
static uint64_t op_id(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 0x100000001b3ull;
    }
    return h;
}

static void duplicate_name(void) {
    /* Two names with one id, found with ffi/tests/c/fnv_collision.py. */
    const char *a = "dup/AABAQBABDHAA", *b = "dup/LVpGCRNV9HXB";
    if (op_id(a) != op_id(b)) FAIL("%s and %s do not collide: find another pair", a, b);
    barrier();
    float va[2] = {1, 1}, vb[2] = {1, 1};
    if (rank_ == 0) {
        /* a cannot complete before rank 1 joins it, which it does only
         * after dup/signal, which this rank starts once b has failed */
        kf_handle ha = start_sum(va, 2, a);
        report("allreduce while one whose name hashes alike runs", finish(start_sum(vb, 2, b)));
        sum_ok("dup/signal");
        report("the first allreduce", finish(ha));
    } else {
        sum_ok("dup/signal");
        report("the first allreduce", finish(start_sum(va, 2, a)));
    }
    if (va[0] != (float)kf_size()) FAIL("%s: %g", a, va[0]);
    /* once the first is over, its twin may run */
    vb[0] = vb[1] = 1;
    report("the second name once the first completed", finish(start_sum(vb, 2, b)));
}

static void pending(void) {
    barrier();
    float v[2] = {1, 1};
    if (rank_ == 0) {
        kf_handle h = start_sum(v, 2, "pending/late");
        report("kf_wait(h, 0) on an op rank 1 has not joined", kf_wait(h, 0));
        double t0 = now_ms();
        report("kf_wait(h, 100) on it", kf_wait(h, 100));
        double took = now_ms() - t0;
        if (took < 100) FAIL("kf_wait(h, 100) returned after %.1f ms", took);
        int done = -1;
        report("kf_test on it", kf_test(h, &done));
        if (done != 0) FAIL("kf_test: done = %d", done);
        sum_ok("pending/signal");
        report("kf_wait(h, -1) once rank 1 joined", finish(h));
    } else {
        sum_ok("pending/signal");
        report("the late allreduce", finish(start_sum(v, 2, "pending/late")));
    }
    if (v[0] != (float)kf_size()) FAIL("pending/late: %g", v[0]);
}

/* Polls kf_stall_report (for 10 s at most) until its text contains
 * `want` (or, with want NULL, is empty); reports the last status. */
static void stall_until(const char *what, const char *want) {
    char text[4096];
    int32_t len = -1;
    kf_status s = KF_OK;
    for (int i = 0; i < 1000; i++) {
        s = kf_stall_report(text, sizeof text, &len);
        if (s != KF_OK || (want ? strstr(text, want) != NULL : len == 0)) break;
        struct timespec ten_ms = {0, 10 * 1000 * 1000};
        nanosleep(&ten_ms, NULL);
    }
    if (s == KF_OK && (want ? strstr(text, want) == NULL : len != 0))
        FAIL("%s: never; last report: %s", what, text);
    report(what, s);
    if (want) {
        /* a short buffer: cut, NUL-terminated, with the whole length */
        char cut[8];
        int32_t whole = -1;
        CHECK(kf_stall_report(cut, sizeof cut, &whole));
        if (whole < (int32_t)sizeof cut || strlen(cut) != sizeof cut - 1)
            FAIL("short buffer: len %d, text %s", whole, cut);
    }
}

static void stall(void) {
    barrier();
    int v[2] = {1, 1};
    const char *named = "rank 1 has not posted it (posted by 0)";
    if (rank_ == 0) {
        kf_handle h = 0;
        CHECK(kf_allreduce(v, v, 2, KF_INT32, KF_SUM, "stall/late", NULL, NULL, &h));
        stall_until("kf_stall_report while rank 1 has not posted", named);
        sum_ok("stall/signal");
        report("the late op once rank 1 posted it", finish(h));
    } else {
        stall_until("kf_stall_report while rank 1 has not posted", named);
        sum_ok("stall/signal");
        kf_handle h = 0;
        CHECK(kf_allreduce(v, v, 2, KF_INT32, KF_SUM, "stall/late", NULL, NULL, &h));
        report("the late op", finish(h));
    }
    if (v[0] != 2 || v[1] != 2) FAIL("stall/late: %d %d", v[0], v[1]);
    stall_until("kf_stall_report once the op is done", NULL);
}

static void transport(void) {
    barrier();
    /* 64 KiB: one chunk on rank 0, sixteen of 4 KiB on rank 1 */
    enum { N = 16384 };
    static float v[N];
    report("allreduce cut into other chunks on rank 1", finish(start_sum(v, N, "transport/chunks")));
}

static void fork_child(void) {
    float v[2] = {1, 1};
    kf_handle h = 0;
    kf_status s = kf_allreduce(v, v, 2, KF_FLOAT32, KF_SUM, "fork/child", NULL, NULL, &h);
    report("child: allreduce", s);
    if (s != KF_OK && !strstr(kf_last_error(), "forked")) FAIL("last error: %s", kf_last_error());
    report("child: barrier", kf_barrier(NULL, NULL, &h));
    /* the parent's threads are not the child's to stop: returns at once */
    report("child: finalize", kf_finalize());
    fflush(stdout);
    _exit(0);
}

static void wait_child(pid_t pid) {
    int st = 0;
    if (waitpid(pid, &st, 0) != pid) FAIL("waitpid: %s", strerror(errno));
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) FAIL("the child ended with status %#x", st);
}

static void fork_scenario(void) {
    /* before the runtime started: the child has nothing of it */
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) FAIL("fork: %s", strerror(errno));
    if (pid == 0) _exit(kf_rank() == rank_ ? 0 : 3);
    wait_child(pid);
    sum_ok("fork/before");
    report("allreduce after a fork before the runtime started", KF_OK);
    /* after: the child gets an error, and the parent goes on */
    fflush(stdout);
    pid = fork();
    if (pid < 0) FAIL("fork: %s", strerror(errno));
    if (pid == 0) fork_child();
    wait_child(pid);
    sum_ok("fork/after");
    report("allreduce after the child", KF_OK);
}

static void finalize_scenario(void) {
    barrier();
    if (rank_ == 0) {
        /* rank 1 joins none of these: they are in flight at kf_finalize */
        static record rec[3] = {{PTHREAD_MUTEX_INITIALIZER, 0, 0, 0},
                                {PTHREAD_MUTEX_INITIALIZER, 0, 0, 0},
                                {PTHREAD_MUTEX_INITIALIZER, 0, 0, 0}};
        float a[4] = {0}, b[4] = {0}, c[4] = {0};
        kf_handle h = 0, hg = 0;
        CHECK(kf_allreduce(a, a, 4, KF_FLOAT32, KF_SUM, "finalize/held", on_done, &rec[0], &h));
        CHECK(kf_allreduce(b, b, 4, KF_FLOAT32, KF_SUM, "finalize/forgotten", on_done, &rec[1],
                           NULL));
        CHECK(kf_group_start());
        CHECK(kf_allreduce(c, c, 4, KF_FLOAT32, KF_SUM, "finalize/grouped", on_done, &rec[2], &hg));
        CHECK(kf_group_end());
        report("kf_wait(h, 0) before finalize", kf_wait(h, 0));
        report("kf_finalize with three ops in flight", kf_finalize());
        /* read at once: kf_finalize returns after the callbacks ran */
        report_callback("an op with a handle", &rec[0]);
        report_callback("an op without a handle", &rec[1]);
        report_callback("a grouped op", &rec[2]);
        report("kf_wait on the op after finalize", kf_wait(h, -1));
        report("kf_finalize again", kf_finalize());
        /* nothing runs a callback twice */
        report_callback("an op with a handle, later", &rec[0]);
    } else {
        float v[4] = {0};
        report("allreduce while rank 0 finalizes", finish(start_sum(v, 4, "finalize/gone")));
    }
}

/* Runs instead of the usual kf_init: rank 0's fails, so it never
 * listens, and rank 1's runtime (connect timeout 500 ms) cannot start. */
static void bootstrap(int r) {
    rank_ = r;
    float v[2] = {1, 1};
    kf_handle h = 0;
    if (r == 0) {
        set_env("KUNGFU_OP_TIMEOUT_MS", "soon");
        report("kf_init with KUNGFU_OP_TIMEOUT_MS=soon", kf_init());
        report("allreduce after it",
               kf_allreduce(v, v, 2, KF_FLOAT32, KF_SUM, "bootstrap", NULL, NULL, &h));
    } else {
        set_env("KUNGFU_CONNECT_TIMEOUT_MS", "500");
        report("kf_init", kf_init());
        report("allreduce with a peer that never listens",
               kf_allreduce(v, v, 2, KF_FLOAT32, KF_SUM, "bootstrap", NULL, NULL, &h));
        /* the failure sticks: no second attempt */
        report("allreduce again",
               kf_allreduce(v, v, 2, KF_FLOAT32, KF_SUM, "bootstrap", NULL, NULL, &h));
    }
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: errors SCENARIO\n");
        return 2;
    }
    scenario_ = argv[1];
    int r = launcher_rank();
    /* per-rank settings, read by kf_init */
    if (!strcmp(scenario_, "timeout")) set_env("KUNGFU_OP_TIMEOUT_MS", r == 0 ? "2000" : "60000");
    if (!strcmp(scenario_, "stall")) set_env("KUNGFU_STALL_TIMEOUT_MS", "300");
    if (!strcmp(scenario_, "transport")) {
        /* the message path, whose chunks the ranks cut differently (the
         * host fast path has none) */
        set_env("KUNGFU_FAST_MAX_BYTES", "0");
        set_env("KUNGFU_FAST_LARGE", "0");
        set_env("KUNGFU_STRATEGY", "STAR");
        if (r == 1) set_env("KUNGFU_CHUNK_BYTES", "4096");
    }
    if (!strcmp(scenario_, "bootstrap")) {
        bootstrap(r);
        CHECK(kf_finalize());
        printf("rank %d: %s: done\n", rank_, scenario_);
        return 0;
    }
    CHECK(kf_init());
    rank_ = kf_rank();
    if (rank_ != r) FAIL("kf_rank %d, KUNGFU_RANK %d", rank_, r);

    if (!strcmp(scenario_, "mismatch")) mismatch();
    else if (!strcmp(scenario_, "timeout")) timeout();
    else if (!strcmp(scenario_, "peer-lost")) peer_lost();
    else if (!strcmp(scenario_, "duplicate-name")) duplicate_name();
    else if (!strcmp(scenario_, "pending")) pending();
    else if (!strcmp(scenario_, "transport")) transport();
    else if (!strcmp(scenario_, "fork")) fork_scenario();
    else if (!strcmp(scenario_, "finalize")) finalize_scenario();
    else if (!strcmp(scenario_, "stall")) stall();
    else FAIL("unknown scenario");

    if (strcmp(scenario_, "finalize") != 0 || rank_ != 0) CHECK(kf_finalize());
    printf("rank %d: %s: done\n", rank_, scenario_);
    return 0;
}
