/* Reconfigure through the C ABI, under `kungfu-run -np 3` (workers that
 * the launcher connected, which torch's reconfigure can then move): the
 * workers trade handles (kf_reconfigure_handle, then an allgather),
 * reconfigure to the reversed order, refuse a reused uuid and a list
 * without themselves, shrink by the last one (which goes on alone), merge
 * again, abort and come back, every sum exact and every rank where the
 * list puts it.
 *
 * Each worker ends with "start rank S: ... all C checks passed";
 * ffi/tests/c_reconfigure.rs checks those lines. */
#include <kungfu.h>

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define HMAX 512

static int start_rank = -1;
#define WHO_FMT "start rank %d"
#define WHO start_rank
#include "check.h"

static int ops = 0;

/* The sum over the cluster of (rank + 1), or -1 after the status of a
 * failed op (in *status). */
static int32_t sum_of_ranks(kf_status *status) {
    char name[32];
    snprintf(name, sizeof name, "sum/%d", ops++);
    int32_t mine = kf_rank() + 1, sum = -1;
    kf_handle h = 0;
    kf_status s = kf_allreduce(&mine, &sum, 1, KF_INT32, KF_SUM, name, NULL, NULL, &h);
    if (s == KF_OK) {
        s = kf_wait(h, -1);
        kf_release(h);
    }
    if (status) *status = s;
    return s == KF_OK ? sum : -1;
}

static void expect_sum(const char *when) {
    int n = kf_size();
    kf_status s = KF_OK;
    int32_t got = sum_of_ranks(&s);
    CHECK(got == n * (n + 1) / 2, "%s: sum %d over %d ranks (%s: %s)", when, got, n,
          kf_status_string(s), kf_last_error());
}

int main(void) {
    MUST(kf_init());
    start_rank = kf_rank();
    int n = kf_size();
    CHECK(n == 3, "size %d", n);
    static char mine[HMAX], all[3][HMAX];
    int32_t len = -1;
    MUST(kf_reconfigure_handle(NULL, 0, &len));
    CHECK(len > 0 && len < HMAX, "handle of %d bytes", len);
    MUST(kf_reconfigure_handle(mine, HMAX, &len));
    CHECK((int32_t)strlen(mine) == len, "handle %s of %d bytes", mine, len);
    kf_handle h = 0;
    MUST(kf_allgather(mine, all, HMAX, KF_UINT8, "handles", NULL, NULL, &h));
    MUST(kf_wait(h, -1));
    MUST(kf_release(h));
    const char *reversed[3] = {all[2], all[1], all[0]};
    const char *in_order[3] = {all[0], all[1], all[2]};

    MUST(kf_reconfigure(1, reversed, 3, 20000));
    CHECK(kf_rank() == 2 - start_rank && kf_size() == 3, "reversed: rank %d of %d",
          kf_rank(), kf_size());
    expect_sum("reversed");

    kf_status s = kf_reconfigure(1, reversed, 3, 20000);
    CHECK(s == KF_ERR_INVALID_ARGUMENT && strstr(kf_last_error(), "already used"),
          "reused uuid: %s: %s", kf_status_string(s), kf_last_error());
    const char *others[2];
    for (int i = 0, k = 0; i < 3; i++)
        if (i != start_rank) others[k++] = all[i];
    s = kf_reconfigure(2, others, 2, 20000);
    CHECK(s == KF_ERR_INVALID_ARGUMENT && strstr(kf_last_error(), "not among"),
          "a list without me: %s: %s", kf_status_string(s), kf_last_error());
    expect_sum("after the refusals");

    if (start_rank < 2) {
        MUST(kf_reconfigure(3, in_order, 2, 20000));
        CHECK(kf_rank() == start_rank && kf_size() == 2, "shrunk: rank %d of %d", kf_rank(),
              kf_size());
    } else {
        MUST(kf_reconfigure(4, in_order + 2, 1, 20000));
        CHECK(kf_rank() == 0 && kf_size() == 1, "alone: rank %d of %d", kf_rank(), kf_size());
    }
    expect_sum("shrunk");
    MUST(kf_reconfigure(5, in_order, 3, 20000));
    CHECK(kf_rank() == start_rank && kf_size() == 3, "merged: rank %d of %d", kf_rank(),
          kf_size());
    expect_sum("merged");

    MUST(kf_abort());
    sum_of_ranks(&s);
    CHECK(s == KF_ERR_MEMBERSHIP_CHANGED && strstr(kf_last_error(), "kf_abort"),
          "an op after kf_abort: %s: %s", kf_status_string(s), kf_last_error());
    MUST(kf_reconfigure(6, in_order, 3, 20000));
    expect_sum("after the abort");

    s = kf_set_job_secret("not this job's secret");
    CHECK(s == KF_ERR_INVALID_ARGUMENT, "another secret once started: %s",
          kf_status_string(s));
    printf("start rank %d: now rank %d/%d; %s\n", start_rank, kf_rank(), kf_size(),
           failures ? "C checks FAILED" : "all C checks passed");
    MUST(kf_finalize());
    return failures ? 1 : 0;
}
