/*
 * The Open MPI peer of kungfu-bench: the same ops (allreduce, broadcast,
 * allgather), f32, out of place, the same iteration rule and columns, so
 * that benches/peers/compare.py can set the two side by side.
 *
 *   mpirun -np N mpi_bench OP [-b MIN] [-e MAX] [-f F] [-n ITERS] [-w WARMUP] [-c 0|1]
 *
 * Rule (as kungfu-bench): per size, WARMUP untimed ops, then ITERS timed
 * ops back to back; time = the slowest rank's mean time per op; algbw =
 * size / time; busbw = algbw * 2(n-1)/n (allreduce), (n-1)/n (allgather),
 * 1 (broadcast). size is the per-rank buffer for allreduce and broadcast,
 * the whole n-block buffer for allgather. -c 1 checks the last op exactly.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

enum op { ALLREDUCE, BROADCAST, ALLGATHER };

static size_t parse_size(const char *s) {
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    switch (*end) {
    case 'K': case 'k': v <<= 10; break;
    case 'M': case 'm': v <<= 20; break;
    case 'G': case 'g': v <<= 30; break;
    default: break;
    }
    return (size_t)v;
}

static float value(int rank, size_t i) { return (float)((rank * 7 + i * 3) % 11 + 1); }

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    if (argc < 2) {
        if (rank == 0) fprintf(stderr, "usage: mpi_bench allreduce|broadcast|allgather [-b MIN] [-e MAX] [-f F] [-n ITERS] [-w WARMUP] [-c 0|1] [-p 0|1]\n");
        MPI_Finalize();
        return 2;
    }
    enum op op;
    if (!strcmp(argv[1], "allreduce")) op = ALLREDUCE;
    else if (!strcmp(argv[1], "broadcast")) op = BROADCAST;
    else if (!strcmp(argv[1], "allgather")) op = ALLGATHER;
    else {
        if (rank == 0) fprintf(stderr, "mpi_bench: unknown op %s\n", argv[1]);
        MPI_Finalize();
        return 2;
    }
    size_t min = 1024, max = 64 << 20, factor = 2;
    int iters = 20, warmup = 5, check = 1, in_place = 0;
    for (int i = 2; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-b")) min = parse_size(argv[i + 1]);
        else if (!strcmp(argv[i], "-e")) max = parse_size(argv[i + 1]);
        else if (!strcmp(argv[i], "-f")) factor = parse_size(argv[i + 1]);
        else if (!strcmp(argv[i], "-n")) iters = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-w")) warmup = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-c")) check = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-p")) in_place = atoi(argv[i + 1]);
    }
    if (factor < 2 || iters < 1) {
        if (rank == 0) fprintf(stderr, "mpi_bench: -f must be >= 2 and -n >= 1\n");
        MPI_Finalize();
        return 2;
    }
    double factor_bw = op == ALLREDUCE ? 2.0 * (n - 1) / n : op == ALLGATHER ? (double)(n - 1) / n : 1.0;
    if (rank == 0) {
        printf("# mpi_bench %s: %d ranks, iters %d, warmup %d, check %d\n", argv[1], n, iters, warmup, check);
        printf("# %10s %12s %8s %6s %6s %9s %7s %7s %6s\n", "size", "count", "type", "redop", "root", "time",
               "algbw", "busbw", "#wrong");
    }
    long long total_wrong = 0;
    for (size_t size = min ? min : 4; size <= max; size *= factor) {
        size_t total = size / sizeof(float);
        size_t count = op == ALLGATHER ? total / n : total; /* per rank */
        size_t shown = op == ALLGATHER ? count * n : count;
        if (shown == 0) continue;
        size_t in_len = count, out_len = op == ALLGATHER ? count * n : count;
        float *in = malloc(in_len * sizeof(float)), *out = malloc(out_len * sizeof(float));
        if (!in || !out) {
            fprintf(stderr, "mpi_bench: out of memory\n");
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        for (size_t i = 0; i < in_len; i++) in[i] = value(rank, i);
        if (op == BROADCAST && in_place && rank == 0) memcpy(out, in, count * sizeof(float));
        double t = 0;
        for (int it = 0; it < warmup + iters; it++) {
            if (it == warmup) t = MPI_Wtime();
            switch (op) {
            case ALLREDUCE: MPI_Allreduce(in, out, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); break;
            case BROADCAST:
                /* out of place: the root sends from in, everyone receives into out;
                   -p 1: the root sends out as it is (no copy, as kungfu-bench --in-place 1) */
                if (rank == 0 && !in_place) memcpy(out, in, count * sizeof(float));
                MPI_Bcast(out, (int)count, MPI_FLOAT, 0, MPI_COMM_WORLD);
                break;
            case ALLGATHER: MPI_Allgather(in, (int)count, MPI_FLOAT, out, (int)count, MPI_FLOAT, MPI_COMM_WORLD); break;
            }
        }
        double mean = (MPI_Wtime() - t) / iters, slowest;
        MPI_Allreduce(&mean, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        long long wrong = 0, all_wrong = 0;
        if (check) {
            for (size_t i = 0; i < out_len; i++) {
                float want = 0;
                if (op == ALLREDUCE)
                    for (int r = 0; r < n; r++) want += value(r, i);
                else if (op == BROADCAST)
                    want = value(0, i);
                else
                    want = value((int)(i / count), i % count);
                wrong += out[i] != want;
            }
        }
        MPI_Allreduce(&wrong, &all_wrong, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
        total_wrong += all_wrong;
        double algbw = (double)(shown * sizeof(float)) / slowest / 1e9;
        if (rank == 0)
            printf("  %10zu %12zu %8s %6s %6d %9.2f %7.2f %7.2f %6lld\n", shown * sizeof(float), shown, "float",
                   op == ALLREDUCE ? "sum" : "none", op == BROADCAST ? 0 : -1, slowest * 1e6, algbw, algbw * factor_bw,
                   all_wrong);
        free(in);
        free(out);
        if (size > max / factor) break;
    }
    if (rank == 0) printf("# Out of bounds values : %lld %s\n", total_wrong, total_wrong ? "FAILED" : "OK");
    /* every rank's peak resident set (KiB on Linux), as kungfu-bench prints it */
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    long mine = ru.ru_maxrss, most = 0;
    MPI_Reduce(&mine, &most, 1, MPI_LONG, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) printf("# Peak RSS (largest rank): %.1f MiB\n", most / 1024.0);
    MPI_Finalize();
    return total_wrong ? 1 : 0;
}
