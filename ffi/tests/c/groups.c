/* Groups of ranks (kf_group_t) from C, under kungfu-run -np 4:
 *
 *   mesh     the ranks as a 2x2 mesh: rows {0,1} {2,3} and columns {0,2}
 *            {1,3}; every rank allreduces in its row and its column, many
 *            rounds in flight, even ranks issuing row first and odd ranks
 *            column first, with world allreduces of the same names between
 *   every    every collective in the group of all four in reverse order
 *            (group rank i is rank 3 - i), checked value by value
 *   fused    kf_group_start/kf_group_end fuse allreduces of several groups
 *   p2p      kf_group_send/kf_group_recv in the row and the column at once
 *   errors   what a group refuses: a list without this rank, a bad root,
 *            a destroyed group, destroying KF_GROUP_WORLD
 *
 * Prints "rank R: groups: all checks passed"; exits non-zero otherwise. */
#include <kungfu.h>

#include <stdint.h>
#include <stdio.h>
#include <string.h>

static int rank_ = -1;
#define WHO_FMT "rank %d"
#define WHO rank_
#include "check.h"

#define ROUNDS 16

static kf_group_t make(const int *ranks, int n) {
    kf_group_t g = 0;
    MUST(kf_group_create(ranks, n, &g));
    CHECK(g != KF_GROUP_WORLD, "a made group is not the world");
    return g;
}

static void mesh(void) {
    int row_ranks[2] = {rank_ / 2 * 2, rank_ / 2 * 2 + 1};
    int col_ranks[2] = {rank_ % 2, rank_ % 2 + 2};
    /* even ranks make their row first, odd ones their column: groups of
     * different ranks are made in any order */
    kf_group_t row, col;
    if (rank_ % 2 == 0) {
        row = make(row_ranks, 2);
        col = make(col_ranks, 2);
    } else {
        col = make(col_ranks, 2);
        row = make(row_ranks, 2);
    }
    int r = -1, n = -1;
    MUST(kf_group_rank(row, &r));
    MUST(kf_group_size(row, &n));
    CHECK(r == rank_ % 2 && n == 2, "row rank %d size %d", r, n);
    MUST(kf_group_rank(col, &r));
    CHECK(r == rank_ / 2, "column rank %d", r);

    int64_t x[ROUNDS], in_row[ROUNDS], in_col[ROUNDS], in_all[ROUNDS];
    kf_handle h[ROUNDS][3];
    for (int k = 0; k < ROUNDS; k++) {
        x[k] = 1000 * rank_ + k;
        kf_group_t first = rank_ % 2 == 0 ? row : col;
        kf_group_t second = rank_ % 2 == 0 ? col : row;
        int64_t *out1 = rank_ % 2 == 0 ? &in_row[k] : &in_col[k];
        int64_t *out2 = rank_ % 2 == 0 ? &in_col[k] : &in_row[k];
        MUST(kf_group_allreduce(first, &x[k], out1, 1, KF_INT64, KF_SUM, "step", NULL, NULL,
                                &h[k][0]));
        MUST(kf_allreduce(&x[k], &in_all[k], 1, KF_INT64, KF_SUM, "step", NULL, NULL, &h[k][1]));
        MUST(kf_group_allreduce(second, &x[k], out2, 1, KF_INT64, KF_SUM, "step", NULL, NULL,
                                &h[k][2]));
    }
    for (int k = 0; k < ROUNDS; k++) {
        for (int j = 0; j < 3; j++) {
            MUST(kf_wait(h[k][j], 60000));
            MUST(kf_release(h[k][j]));
        }
        int64_t want_row = 1000 * (row_ranks[0] + row_ranks[1]) + 2 * k;
        int64_t want_col = 1000 * (col_ranks[0] + col_ranks[1]) + 2 * k;
        CHECK(in_row[k] == want_row, "row round %d: %lld, want %lld", k, (long long)in_row[k],
              (long long)want_row);
        CHECK(in_col[k] == want_col, "column round %d: %lld, want %lld", k,
              (long long)in_col[k], (long long)want_col);
        CHECK(in_all[k] == 6000 + 4 * k, "world round %d: %lld", k, (long long)in_all[k]);
    }

    /* fused: two row, one column and one world allreduce, each fused
     * with the others of its group */
    int32_t a = rank_, b = rank_, c = rank_, d = rank_;
    kf_handle hf[4];
    MUST(kf_group_start());
    MUST(kf_group_allreduce(row, &a, &a, 1, KF_INT32, KF_SUM, "fused/a", NULL, NULL, &hf[0]));
    MUST(kf_group_allreduce(col, &b, &b, 1, KF_INT32, KF_SUM, "fused/b", NULL, NULL, &hf[1]));
    MUST(kf_allreduce(&c, &c, 1, KF_INT32, KF_SUM, "fused/c", NULL, NULL, &hf[2]));
    MUST(kf_group_allreduce(row, &d, &d, 1, KF_INT32, KF_MAX, "fused/d", NULL, NULL, &hf[3]));
    MUST(kf_group_end());
    for (int j = 0; j < 4; j++) {
        MUST(kf_wait(hf[j], 60000));
        MUST(kf_release(hf[j]));
    }
    CHECK(a == row_ranks[0] + row_ranks[1], "fused row sum: %d", a);
    CHECK(b == col_ranks[0] + col_ranks[1], "fused column sum: %d", b);
    CHECK(c == 6, "fused world sum: %d", c);
    CHECK(d == row_ranks[1], "fused row max: %d", d);

    /* point to point in both groups under one tag: group rank 0 sends
     * its rank to group rank 1, which receives from any source; the
     * messages of the row and the column never meet */
    kf_handle hp[2];
    int32_t sent[2] = {rank_, rank_}, got[2] = {-1, -1};
    int from[2] = {-1, -1};
    kf_group_t both[2] = {row, col};
    for (int j = 0; j < 2; j++) {
        int me = -1;
        MUST(kf_group_rank(both[j], &me));
        if (me == 0) {
            MUST(kf_group_send(both[j], 1, 7, &sent[j], 4, NULL, NULL, &hp[j]));
        } else {
            MUST(kf_group_recv(both[j], KF_ANY_SOURCE, 7, &got[j], 4, &from[j], NULL, NULL,
                               &hp[j]));
        }
    }
    for (int j = 0; j < 2; j++) {
        MUST(kf_wait(hp[j], 60000));
        MUST(kf_release(hp[j]));
    }
    if (rank_ % 2 == 1) CHECK(got[0] == rank_ - 1 && from[0] == 0, "row message %d from %d",
                              got[0], from[0]);
    if (rank_ / 2 == 1) CHECK(got[1] == rank_ - 2 && from[1] == 0, "column message %d from %d",
                              got[1], from[1]);

    MUST(kf_group_destroy(row));
    MUST(kf_group_destroy(col));
}

static void every(void) {
    int rev[4] = {3, 2, 1, 0};
    kf_group_t g = make(rev, 4);
    int me = 3 - rank_; /* this rank in the group */
    int r = -1;
    MUST(kf_group_rank(g, &r));
    CHECK(r == me, "group rank %d, want %d", r, me);

    /* allreduce in place */
    int32_t v[3] = {rank_, 10 * rank_, 1};
    kf_handle h;
    MUST(kf_group_allreduce(g, v, v, 3, KF_INT32, KF_SUM, "e/ar", NULL, NULL, &h));
    MUST(kf_wait(h, 60000));
    MUST(kf_release(h));
    /* broadcast from group rank 0 (rank 3) */
    int32_t bc[2] = {rank_, rank_ + 100};
    MUST(kf_group_broadcast(g, bc, bc, 2, KF_INT32, 0, "e/bc", NULL, NULL, &h));
    MUST(kf_wait(h, 60000));
    MUST(kf_release(h));
    CHECK(bc[0] == 3 && bc[1] == 103, "broadcast: %d %d", bc[0], bc[1]);

    /* allgather: in group order, so ranks 3, 2, 1, 0 */
    int32_t mine = rank_, all[4];
    MUST(kf_group_allgather(g, &mine, all, 1, KF_INT32, "e/ag", NULL, NULL, &h));
    MUST(kf_wait(h, 60000));
    MUST(kf_release(h));
    for (int i = 0; i < 4; i++) CHECK(all[i] == 3 - i, "allgather[%d] = %d", i, all[i]);

    /* gather and reduce at group rank 1 (rank 2) */
    int32_t got[4] = {-1, -1, -1, -1}, sum = -1;
    MUST(kf_group_gather(g, &mine, got, 1, KF_INT32, 1, "e/gt", NULL, NULL, &h));
    MUST(kf_wait(h, 60000));
    MUST(kf_release(h));
    MUST(kf_group_reduce(g, &mine, &sum, 1, KF_INT32, KF_SUM, 1, "e/rd", NULL, NULL, &h));
    MUST(kf_wait(h, 60000));
    MUST(kf_release(h));
    if (me == 1) {
        for (int i = 0; i < 4; i++) CHECK(got[i] == 3 - i, "gather[%d] = %d", i, got[i]);
        CHECK(sum == 6, "reduce: %d", sum);
    }

    /* scatter from group rank 2 (rank 1): block i is 50 + i */
    int32_t blocks[4] = {50, 51, 52, 53}, one = -1;
    MUST(kf_group_scatter(g, blocks, &one, 1, KF_INT32, 2, "e/sc", NULL, NULL, &h));
    MUST(kf_wait(h, 60000));
    MUST(kf_release(h));
    CHECK(one == 50 + me, "scatter: %d, want %d", one, 50 + me);

    /* reduce-scatter: block i of every rank is rank + i; group rank i gets
     * the sum of block i, 6 + 4i */
    int32_t four[4], rs = -1;
    for (int i = 0; i < 4; i++) four[i] = rank_ + i;
    MUST(kf_group_reduce_scatter(g, four, &rs, 1, KF_INT32, KF_SUM, "e/rs", NULL, NULL, &h));
    MUST(kf_wait(h, 60000));
    MUST(kf_release(h));
    CHECK(rs == 6 + 4 * me, "reduce_scatter: %d", rs);

    /* alltoall: group rank i gets block i of every group rank, in group
     * order: rank 3 - j's block me is 3 - j + me */
    int32_t a2a[4];
    MUST(kf_group_alltoall(g, four, a2a, 1, KF_INT32, "e/a2a", NULL, NULL, &h));
    MUST(kf_wait(h, 60000));
    MUST(kf_release(h));
    for (int j = 0; j < 4; j++) CHECK(a2a[j] == 3 - j + me, "alltoall[%d] = %d", j, a2a[j]);

    int agreed = -1;
    MUST(kf_group_consensus(g, "same", 4, "e/cs", &agreed, NULL, NULL, &h));
    MUST(kf_wait(h, 60000));
    MUST(kf_release(h));
    CHECK(agreed == 1, "consensus: %d", agreed);
    MUST(kf_group_barrier(g, NULL, NULL, &h));
    MUST(kf_wait(h, 60000));
    MUST(kf_release(h));
    CHECK(v[0] == 6 && v[1] == 60 && v[2] == 4, "allreduce: %d %d %d", v[0], v[1], v[2]);

    /* a root out of the group's range */
    int32_t z = 0;
    kf_status s = kf_group_broadcast(g, &z, &z, 1, KF_INT32, 4, "e/bad", NULL, NULL, NULL);
    CHECK(s == KF_ERR_INVALID_ARGUMENT, "root 4 of 4: %s", kf_status_string(s));

    MUST(kf_group_destroy(g));
    s = kf_group_allreduce(g, &z, &z, 1, KF_INT32, KF_SUM, "e/gone", NULL, NULL, NULL);
    CHECK(s == KF_ERR_INVALID_ARGUMENT, "a destroyed group: %s", kf_status_string(s));
    CHECK(strstr(kf_last_error(), "destroyed") != NULL, "detail: %s", kf_last_error());
    s = kf_group_destroy(g);
    CHECK(s == KF_ERR_INVALID_ARGUMENT, "destroyed twice: %s", kf_status_string(s));
}

static void errors(void) {
    int others[2] = {(rank_ + 1) % 4, (rank_ + 2) % 4};
    kf_group_t g = 0;
    kf_status s = kf_group_create(others, 2, &g);
    CHECK(s == KF_ERR_INVALID_ARGUMENT, "a list without this rank: %s", kf_status_string(s));
    s = kf_group_destroy(KF_GROUP_WORLD);
    CHECK(s == KF_ERR_INVALID_ARGUMENT, "destroying the world: %s", kf_status_string(s));
    int n = -1;
    MUST(kf_group_size(KF_GROUP_WORLD, &n));
    CHECK(n == 4, "world size %d", n);
}

int main(void) {
    MUST(kf_init());
    rank_ = kf_rank();
    if (kf_size() != 4) {
        fprintf(stderr, "groups.c runs under -np 4\n");
        return 2;
    }
    mesh();
    every();
    errors();
    MUST(kf_finalize());
    if (failures) return 1;
    printf("rank %d: groups: all checks passed\n", rank_);
    return 0;
}
