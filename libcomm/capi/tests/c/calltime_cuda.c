/* The calling thread's time inside one large ncclAllReduce across hosts
 * (issue 32: a 256 MiB all-reduce returns within 100 us), through the plain
 * NCCL API so that the same binary runs on Weft and on NCCL
 * (LD_LIBRARY_PATH picks libnccl.so.2) and the two are compared in one run.
 *
 * Each rank: COUNT floats (default 64 Mi: 256 MiB), 2 warm-up calls, then
 * ITERS calls, each timed alone on the host clock around the call only,
 * with a cudaStreamSynchronize after it and a pause of GAP_US before the
 * next (default 0): the stream is idle when each call starts, as in the
 * project's GPU test (`a_256_mib_all_reduce_across_hosts_returns_within_100_us`).
 * Prints per rank:
 *
 *   calltime rank R bytes B gap G: p50 P p90 Q max M us (ok|SLOW)
 *
 * (ok: p50 under 100 us) and checks the last call's result (inputs are the
 * rank plus one, the sum is known; a wrong value prints WRONG, exit 1).
 * One process per GPU under a launcher that sets RANK, WORLD_SIZE,
 * LOCAL_RANK and NCCL_COMM_ID; put ranks on different simulated hosts with
 * WEFT_HOSTNAME (Weft) or NCCL_HOSTID + NCCL_SOCKET_IFNAME=lo (NCCL):
 * bench/gpu/calltime.sh does it for both. */
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static long env_long(const char* a, long dflt) {
  const char* v = getenv(a);
  return v ? atol(v) : dflt;
}

static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

#define CHECK(call)                                                     \
  do {                                                                  \
    ncclResult_t r_ = (call);                                           \
    if (r_ != ncclSuccess) {                                            \
      printf("rank %d: %s: %s\n", rank, #call, ncclGetErrorString(r_)); \
      return 2;                                                         \
    }                                                                   \
  } while (0)

int main(int argc, char** argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 20;
  int rank = (int)env_long("RANK", 0), n = (int)env_long("WORLD_SIZE", 1);
  int local = (int)env_long("LOCAL_RANK", rank), ndev = 0;
  size_t count = (size_t)env_long("COUNT", 64L << 20);
  long gap = env_long("GAP_US", 0);
  if (iters < 1 || count == 0 || cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    printf("rank %d: no CUDA device (or bad ITERS / COUNT)\n", rank);
    return 2;
  }
  cudaSetDevice(local % ndev);
  ncclUniqueId id;
  ncclComm_t comm;
  CHECK(ncclGetUniqueId(&id)); /* NCCL_COMM_ID: every rank gets the same id */
  CHECK(ncclCommInitRank(&comm, n, id, rank));
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  float *buf, *host = malloc(count * sizeof(float));
  double* lat = malloc(iters * sizeof(double));
  if (!host || !lat || cudaMalloc((void**)&buf, count * sizeof(float)) != cudaSuccess) {
    printf("rank %d: out of memory for %zu floats\n", rank, count);
    return 2;
  }
  for (int it = -2; it < iters; it++) {
    /* Fresh inputs each call (the sum is checked after the last). */
    for (size_t i = 0; i < count; i++) host[i] = (float)(rank + 1);
    cudaMemcpy(buf, host, count * sizeof(float), cudaMemcpyHostToDevice);
    if (gap > 0) usleep((useconds_t)gap);
    double t0 = now_us();
    CHECK(ncclAllReduce(buf, buf, count, ncclFloat32, ncclSum, comm, s));
    double t1 = now_us();
    if (cudaStreamSynchronize(s) != cudaSuccess) {
      printf("rank %d: the stream failed\n", rank);
      return 2;
    }
    if (it >= 0) lat[it] = t1 - t0;
  }
  cudaMemcpy(host, buf, count * sizeof(float), cudaMemcpyDeviceToHost);
  int wrong = 0;
  float want = (float)(n * (n + 1) / 2);
  for (size_t i = 0; i < count; i += 4099) {
    if (host[i] != want) {
      printf("rank %d: WRONG at %zu: %g, want %g\n", rank, i, host[i], want);
      wrong = 1;
      break;
    }
  }
  qsort(lat, iters, sizeof(double), cmp_double);
  double p50 = lat[iters / 2], p90 = lat[(iters * 9) / 10], max = lat[iters - 1];
  printf("calltime rank %d bytes %zu gap %ld: p50 %.1f p90 %.1f max %.1f us (%s)\n", rank,
         count * sizeof(float), gap, p50, p90, max, p50 < 100 ? "ok" : "SLOW");
  CHECK(ncclCommDestroy(comm));
  return wrong;
}
