/* Per-call latency of device collectives through the plain NCCL API, no
 * Python in the way (issue 33, item 3): all_reduce, all_gather and
 * reduce_scatter at 8 B, 4 KiB, 64 KiB and 1 MiB (the largest buffer's
 * bytes, float32), 100 warm-up calls, then ITERS calls each timed alone
 * (host clock around the call and a cudaStreamSynchronize). Each rank prints
 * one line per cell:
 *
 *   cell OP BYTES rank R: p50 P p99 Q max M enq_max E p90 N us (ok|STALL)
 *
 * where enq_max is the slowest enqueue (the call itself, before the
 * synchronize: a host-side stall shows there) and the verdict is issue 33's
 * bound (p99 <= 2 x p50 and max < 1,000 us). The same binary runs on Weft
 * and on NCCL (LD_LIBRARY_PATH picks libnccl.so.2). Plain NCCL API; run one
 * process per GPU under a launcher that sets RANK, WORLD_SIZE, LOCAL_RANK
 * and NCCL_COMM_ID, e.g. on the GPU machine (bench/gpu/stalls.sh does this
 * for both libraries):
 *
 *   nvcc -O2 -I libcomm/include libcomm/capi/tests/c/stalls_cuda.c \
 *        -L target/release -l:libnccl.so.2 -o /tmp/stalls_cuda
 *   for r in 0 1; do RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 \
 *     NCCL_COMM_ID=127.0.0.1:29611 /tmp/stalls_cuda 1000 & done; wait
 *
 * Before the collectives, a "floor" cell times a cudaMemsetAsync of 8 B and
 * the same synchronize, the library not involved: what launching and
 * synchronizing alone cost on this machine, and how its own tail (timer
 * interrupts, the driver) compares with the collectives' p99 (its verdict
 * is reported as for any cell; it is printed as "cell floor 8 ..."). A
 * second floor cell memsets 32 MiB instead (10-20 us on an H200, as long as
 * a small collective's call): a periodic interruption of the machine (a
 * timer tick, a virtual machine's exit) meets a call in proportion to its
 * length, so the tail of a call that long without the library is the
 * machine's share of the collectives' p99.
 *
 * With STALLS_SLOW=F (e.g. 1.6) each rank also prints every call slower
 * than F x its cell's p50, one line each:
 *
 *   slow OP BYTES rank R: at T us lat L enq E cpu C
 *
 * T on CLOCK_MONOTONIC (comparable between the ranks of one machine: a
 * slow call on both ranks at once is one rank's delay the other waited
 * for), E the enqueue's share, C the CPU the call ended on: whether the
 * slow calls come at a timer's period, on one rank, on one CPU.
 *
 * Every result of the last call of a cell is checked (inputs are the rank
 * plus one, so a sum, a gather and a scatter have known values); a wrong
 * one prints "WRONG" and the exit status is 1. */
#define _GNU_SOURCE /* sched_getcpu */
#include <cuda_runtime.h>
#include <nccl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int env_int(const char* a, int dflt) {
  const char* v = getenv(a);
  return v ? atoi(v) : dflt;
}

static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

#define CHECK(call)                                                             \
  do {                                                                          \
    ncclResult_t r_ = (call);                                                   \
    if (r_ != ncclSuccess) {                                                    \
      printf("rank %d: %s: %s\n", rank, #call, ncclGetErrorString(r_));         \
      exit(2);                                                                  \
    }                                                                           \
  } while (0)

/* One cell's calls, in order: start (CLOCK_MONOTONIC, us), latency,
 * enqueue time, the CPU each ended on. `sorted` is scratch for the
 * percentiles. */
struct calls {
  double *at, *lat, *enq, *sorted;
  int* cpu;
};

/* p50, p99 and max of the cell's calls, printed as a cell; with
 * STALLS_SLOW=F every call over F x p50 too. */
static void report(const char* name, size_t bytes, int rank, const struct calls* c, int iters,
                   double enq_max) {
  double* lat = c->sorted;
  memcpy(lat, c->lat, iters * sizeof(double));
  qsort(lat, iters, sizeof(double), cmp_double);
  double p50 = lat[iters / 2], p99 = lat[(iters * 99) / 100], max = lat[iters - 1];
  double p90 = lat[(iters * 9) / 10];
  printf("cell %s %zu rank %d: p50 %.1f p99 %.1f max %.1f enq_max %.1f p90 %.1f us (%s)\n", name,
         bytes, rank, p50, p99, max, enq_max, p90,
         p99 <= 2 * p50 && max < 1000 ? "ok" : "STALL");
  const char* slow = getenv("STALLS_SLOW");
  double f = slow ? atof(slow) : 0;
  for (int i = 0; f > 0 && i < iters; i++)
    if (c->lat[i] > f * p50)
      printf("slow %s %zu rank %d: at %.1f us lat %.1f enq %.1f cpu %d\n", name, bytes, rank,
             c->at[i], c->lat[i], c->enq[i], c->cpu[i]);
  fflush(stdout);
}

/* FLOOR: a memset of `count` bytes on the stream, no library call in it. */
enum { FLOOR, ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER };
static const char* NAMES[] = {"floor", "all_reduce", "all_gather", "reduce_scatter"};

/* One call of `op` enqueued on `s`. */
static ncclResult_t enqueue(int op, float* in, float* out, size_t count, ncclComm_t comm,
                            cudaStream_t s) {
  switch (op) {
    case FLOOR:
      return cudaMemsetAsync(out, 0, count, s) == cudaSuccess ? ncclSuccess
                                                              : ncclUnhandledCudaError;
    case ALL_REDUCE:
      return ncclAllReduce(in, out, count, ncclFloat32, ncclSum, comm, s);
    case ALL_GATHER:
      return ncclAllGather(in, out, count, ncclFloat32, comm, s);
    default:
      return ncclReduceScatter(in, out, count, ncclFloat32, ncclSum, comm, s);
  }
}

/* 100 warm-up calls, then `iters` calls each timed alone (the call and a
 * synchronize) into `c`; the slowest enqueue in `enq_max`. Exits on an
 * error. */
static void time_calls(int rank, int op, float* in, float* out, size_t count, ncclComm_t comm,
                       cudaStream_t s, int iters, struct calls* c, double* enq_max) {
  *enq_max = 0;
  for (int it = -100; it < iters; it++) {
    double t0 = now_us();
    CHECK(enqueue(op, in, out, count, comm, s));
    double t1 = now_us();
    if (cudaStreamSynchronize(s) != cudaSuccess) {
      printf("rank %d: %s: the stream failed\n", rank, NAMES[op]);
      exit(2);
    }
    double t2 = now_us();
    if (it >= 0) {
      c->at[it] = t0;
      c->lat[it] = t2 - t0;
      c->enq[it] = t1 - t0;
      c->cpu[it] = sched_getcpu();
      if (t1 - t0 > *enq_max) *enq_max = t1 - t0;
    }
  }
}

int main(int argc, char** argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 1000;
  int rank = env_int("RANK", 0), n = env_int("WORLD_SIZE", 1);
  int local = env_int("LOCAL_RANK", rank), ndev = 0;
  if (iters < 1 || cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    printf("rank %d: no CUDA device (or bad ITERS)\n", rank);
    return 2;
  }
  cudaSetDevice(local % ndev);
  ncclUniqueId id;
  ncclComm_t comm;
  CHECK(ncclGetUniqueId(&id)); /* NCCL_COMM_ID: every rank gets the same id */
  CHECK(ncclCommInitRank(&comm, n, id, rank));
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  const size_t sizes[] = {8, 4096, 65536, 1 << 20};
  size_t most = (1 << 20) / sizeof(float);
  float *in, *out, *host = malloc(most * sizeof(float));
  cudaMalloc((void**)&in, most * sizeof(float));
  cudaMalloc((void**)&out, most * sizeof(float));
  for (size_t i = 0; i < most; i++) host[i] = (float)(rank + 1);
  cudaMemcpy(in, host, most * sizeof(float), cudaMemcpyHostToDevice);
  struct calls calls = {malloc(iters * sizeof(double)), malloc(iters * sizeof(double)),
                        malloc(iters * sizeof(double)), malloc(iters * sizeof(double)),
                        malloc(iters * sizeof(int))};
  int wrong = 0;
  double enq_max;
  time_calls(rank, FLOOR, in, out, 8, comm, s, iters, &calls, &enq_max);
  report(NAMES[FLOOR], 8, rank, &calls, iters, enq_max);
  size_t long_floor = 32 << 20;
  void* big = NULL;
  if (cudaMalloc(&big, long_floor) != cudaSuccess) {
    printf("rank %d: cudaMalloc of the long floor's %zu B failed\n", rank, long_floor);
    return 2;
  }
  time_calls(rank, FLOOR, in, (float*)big, long_floor, comm, s, iters, &calls, &enq_max);
  report(NAMES[FLOOR], long_floor, rank, &calls, iters, enq_max);
  cudaFree(big);
  for (int op = ALL_REDUCE; op <= REDUCE_SCATTER; op++) {
    for (int si = 0; si < 4; si++) {
      /* The largest buffer holds `bytes`: the gathered output, the
       * scattered input. */
      size_t all = sizes[si] / sizeof(float);
      size_t count = op == ALL_REDUCE ? all : all / n;
      if (count == 0) count = 1;
      time_calls(rank, op, in, out, count, comm, s, iters, &calls, &enq_max);
      size_t outn = op == ALL_GATHER ? count * n : count;
      cudaMemcpy(host, out, outn * sizeof(float), cudaMemcpyDeviceToHost);
      for (size_t i = 0; i < outn; i++) {
        float want = op == ALL_GATHER ? (float)(i / count + 1) : (float)(n * (n + 1) / 2);
        if (host[i] != want) {
          printf("rank %d: %s %zu B: WRONG at %zu: %g, want %g\n", rank, NAMES[op], sizes[si], i,
                 host[i], want);
          wrong = 1;
          break;
        }
      }
      report(NAMES[op], sizes[si], rank, &calls, iters, enq_max);
    }
  }
  CHECK(ncclCommDestroy(comm));
  return wrong;
}
