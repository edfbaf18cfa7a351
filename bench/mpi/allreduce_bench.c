/*
 * allreduce_bench: MPI_Allreduce(float, MPI_SUM) timed the way `weft bench`
 * times Weft, printing the same columns, so the two can be compared line by
 * line (bench/compare_mpi.sh). Written for Weft; not derived from nccl-tests.
 *
 * Method, per size and placement (out of place, then MPI_IN_PLACE):
 *   W warm-up calls; a barrier made of a one-element MPI_Allreduce (as weft
 *   bench does); I back-to-back calls timed with CLOCK_MONOTONIC; time per
 *   call = elapsed / I on each rank, averaged over ranks.
 *   algbw = size / time (GB/s = 1e9 B/s); busbw = algbw * 2(n-1)/n.
 *   With -c, one more call on random small integers is checked against the
 *   exact sum (the #wrong column, summed over ranks); else #wrong is N/A.
 *
 * Usage: mpirun -np N allreduce_bench [-b MIN] [-e MAX] [-f FACTOR]
 *                                     [-w WARMUP] [-i ITERS] [-c]
 * Sizes take K, M, G suffixes (powers of 1024).
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Same fixed-width rule as weft bench / nccl-tests: 2, 1, 0 decimals, then exponent. */
static void fixed(double v, int width, char *out) {
    for (int prec = 2; prec >= 0; prec--) {
        if (snprintf(out, (size_t)width + 1, "%*.*f", width, prec, v) <= width) return;
    }
    snprintf(out, (size_t)width + 1, width >= 7 ? "%*.1e" : "%*.0e", width, v);
}

static uint64_t mix(uint64_t z) {
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Non-zero small integer in -4..4: exact in float for any summation order. */
static float input(int rank, size_t i, uint64_t seed) {
    int k = (int)(mix(seed ^ mix(((uint64_t)rank << 40) ^ i)) % 8) - 4;
    return (float)(k >= 0 ? k + 1 : k);
}

static void barrier(void) {
    float x = 1.0f;
    MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
}

int main(int argc, char **argv) {
    size_t minb = 8, maxb = 32 << 20, factor = 2;
    int warmup = 5, iters = 20, check = 0, opt;
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    while ((opt = getopt(argc, argv, "b:e:f:w:i:c")) != -1) {
        switch (opt) {
        case 'b': minb = parse_size(optarg); break;
        case 'e': maxb = parse_size(optarg); break;
        case 'f': factor = (size_t)atol(optarg); break;
        case 'w': warmup = atoi(optarg); break;
        case 'i': iters = atoi(optarg); break;
        case 'c': check = 1; break;
        default:
            if (rank == 0)
                fprintf(stderr, "usage: %s [-b MIN] [-e MAX] [-f FACTOR] [-w WARMUP] [-i ITERS] [-c]\n", argv[0]);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
    }
    if (factor < 2 || iters < 1 || minb > maxb) {
        if (rank == 0) fprintf(stderr, "allreduce_bench: bad arguments\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    size_t maxcount = maxb / sizeof(float);
    float *send = NULL, *recv = NULL;
    if (posix_memalign((void **)&send, 64, maxcount * sizeof(float) + 64) ||
        posix_memalign((void **)&recv, 64, maxcount * sizeof(float) + 64)) {
        fprintf(stderr, "allreduce_bench: out of memory\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (size_t i = 0; i < maxcount; i++) send[i] = recv[i] = input(rank, i, 0);

    int version, subversion;
    MPI_Get_version(&version, &subversion);
    char lib[MPI_MAX_LIBRARY_VERSION_STRING];
    int liblen;
    MPI_Get_library_version(lib, &liblen);
    char *nl = strchr(lib, '\n');
    if (nl) *nl = 0;
    nl = strchr(lib, ',');
    if (nl) *nl = 0;
    if (rank == 0) {
        printf("# allreduce_bench (MPI_Allreduce, weft bench format), %s\n", lib);
        printf("# Collective test starting: all_reduce\n");
        printf("# nRanks %d minBytes %zu maxBytes %zu step: %zu(factor) warmup iters: %d iters: %d validation: %d device: host algo: mpi\n",
               n, minb, maxb, factor, warmup, iters, check);
        printf("#\n");
        printf("# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place          \n", "", "", "", "", "");
        printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s \n", "size", "count", "type",
               "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong");
        printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s \n", "(B)", "(elements)", "", "",
               "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "");
        fflush(stdout);
    }
    double bwsum = 0;
    int bwn = 0;
    long long total_wrong = 0;
    uint64_t seed = 0x5eed0000;
    for (size_t size = minb; size <= maxb; size *= factor) {
        size_t count = size / sizeof(float);
        if (rank == 0) printf("%12zu  %12zu  %8s  %6s  %6i", count * sizeof(float), count, "float", "sum", -1);
        for (int inplace = 0; inplace < 2; inplace++) {
            const void *sbuf = inplace ? MPI_IN_PLACE : (const void *)send;
            for (int i = 0; i < warmup; i++)
                MPI_Allreduce(sbuf, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            barrier();
            double t0 = now();
            for (int i = 0; i < iters; i++)
                MPI_Allreduce(sbuf, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            double secs = (now() - t0) / iters;
            MPI_Allreduce(MPI_IN_PLACE, &secs, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
            secs /= n;
            double algbw = secs > 0 ? (double)(count * sizeof(float)) / 1e9 / secs : 0;
            double busbw = algbw * 2.0 * (n - 1) / n;
            bwsum += busbw;
            bwn++;
            long long wrong = 0;
            if (check) {
                seed++;
                float *in = inplace ? recv : send;
                for (size_t i = 0; i < count; i++) in[i] = input(rank, i, seed);
                if (!inplace)
                    for (size_t i = 0; i < count; i++) recv[i] = 12345.0f;
                MPI_Allreduce(sbuf, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
                for (size_t i = 0; i < count; i++) {
                    float want = 0;
                    for (int r = 0; r < n; r++) want += input(r, i, seed);
                    if (recv[i] != want) wrong++;
                }
                MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
                total_wrong += wrong;
            }
            if (rank == 0) {
                char t[16], a[16], b[16];
                fixed(secs * 1e6, 7, t);
                fixed(algbw, 6, a);
                fixed(busbw, 6, b);
                if (check)
                    printf("  %7s  %6s  %6s  %6lld", t, a, b, wrong);
                else
                    printf("  %7s  %6s  %6s     N/A", t, a, b);
            }
        }
        if (rank == 0) {
            printf("\n");
            fflush(stdout);
        }
        if (size == 0) break;
    }
    if (rank == 0) {
        printf("# %-20s : %lld %s\n", "Out of bounds values", total_wrong, total_wrong ? "FAILED" : "OK");
        printf("# %-20s : %g \n", "Avg bus bandwidth", bwn ? bwsum / bwn : 0.0);
        printf("#\n# Collective test concluded: all_reduce\n");
    }
    free(send);
    free(recv);
    MPI_Finalize();
    return total_wrong ? 1 : 0;
}
