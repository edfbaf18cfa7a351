/* The standard ring of PyTorch's isend/irecv, issued unbatched on one stream
 * per rank: ncclSend(next) then ncclRecv(prev), on CUDA device memory, one
 * rank per process. Plain NCCL API (nothing Weft-specific), so the same
 * binary runs on NVIDIA's NCCL for comparison. Not built by the test suite
 * (it needs the CUDA runtime): the GPU machine builds it with nvcc, e.g.
 *
 *   nvcc -O2 -I libcomm/include libcomm/capi/tests/c/p2p_ring_cuda.c \
 *        -L target/release -lnccl -o /tmp/p2p_ring_cuda
 *   weft run -n 2 -- /tmp/p2p_ring_cuda            (LD_LIBRARY_PATH: ours)
 *
 * or under any launcher that sets RANK, WORLD_SIZE and NCCL_COMM_ID
 * (LOCAL_RANK picks the GPU: LOCAL_RANK % the GPUs visible; all ranks on
 * GPU 0 with one GPU). Without arguments the first operation between the
 * ranks of each fresh communicator (ncclCommSplit) is the unbatched ring;
 * with --connect-first a grouped exchange comes first (NCCL needs it: its
 * unbatched ring completes only once the pair is connected). Then, per size
 * (333 floats, 1 Mi, 16 Mi = 64 MiB): the unbatched ring, a grouped
 * exchange, the unbatched ring again, two unbatched sends before two
 * receives; every received buffer is checked against prev's random,
 * non-zero data. Exits 0 and prints "p2p_ring_cuda ok" on success; an alarm
 * ends a hang after 120 s with exit 3. */
#include <cuda_runtime.h>
#include <nccl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define NCCLCHECK(cmd)                                                                      \
  do {                                                                                      \
    ncclResult_t r_ = cmd;                                                                  \
    if (r_ != ncclSuccess) {                                                                \
      printf("rank %d: %s:%d '%s' failed: %s\n", rank, __FILE__, __LINE__, #cmd,           \
             ncclGetErrorString(r_));                                                       \
      exit(1);                                                                              \
    }                                                                                       \
  } while (0)
#define CUDACHECK(cmd)                                                                      \
  do {                                                                                      \
    cudaError_t e_ = cmd;                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      printf("rank %d: %s:%d '%s' failed: %s\n", rank, __FILE__, __LINE__, #cmd,           \
             cudaGetErrorString(e_));                                                       \
      exit(1);                                                                              \
    }                                                                                       \
  } while (0)

static int rank = -1, nranks = 0;
static const char* phase = "start";

static void on_alarm(int sig) {
  (void)sig;
  char msg[256];
  int n = snprintf(msg, sizeof msg, "rank %d: HANG: still in '%s' after 120 s\n", rank, phase);
  if (write(1, msg, n) < 0) {}
  _exit(3);
}

/* Random non-zero floats for (rank, step). */
static void fill(float* h, size_t count, int r, int step) {
  uint64_t x = 0x9e3779b97f4a7c15ull ^ ((uint64_t)r << 32) ^ ((uint64_t)step + 1) * 0x12345678ull;
  for (size_t i = 0; i < count; i++) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    h[i] = (float)(x % 1000000 + 1);
  }
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Checks recv buffer d (count floats) against prev's data of `step`. */
static void check(const float* d, size_t count, int step, const char* what) {
  float* got = malloc(count * sizeof(float));
  float* want = malloc(count * sizeof(float));
  CUDACHECK(cudaMemcpy(got, d, count * sizeof(float), cudaMemcpyDeviceToHost));
  fill(want, count, (rank + nranks - 1) % nranks, step);
  for (size_t i = 0; i < count; i++)
    if (memcmp(&got[i], &want[i], sizeof(float)) != 0) {
      printf("rank %d: %s, %zu floats: element %zu is %g, prev's is %g\n", rank, what, count, i,
             got[i], want[i]);
      exit(2);
    }
  free(got);
  free(want);
}

int main(int argc, char** argv) {
  int connect_first = argc > 1 && strcmp(argv[1], "--connect-first") == 0;
  const char* rs = getenv("RANK");
  const char* ws = getenv("WORLD_SIZE");
  if (!rs || !ws) {
    printf("p2p_ring_cuda: set RANK, WORLD_SIZE and NCCL_COMM_ID (or run under weft run)\n");
    return 1;
  }
  rank = atoi(rs);
  nranks = atoi(ws);
  const char* ls = getenv("LOCAL_RANK");
  int ngpu = 0;
  CUDACHECK(cudaGetDeviceCount(&ngpu));
  int dev = (ls ? atoi(ls) : rank) % ngpu;
  CUDACHECK(cudaSetDevice(dev));
  signal(SIGALRM, on_alarm);
  alarm(120);
  ncclUniqueId id;
  ncclComm_t world;
  phase = "init";
  NCCLCHECK(ncclGetUniqueId(&id));
  NCCLCHECK(ncclCommInitRank(&world, nranks, id, rank));
  cudaStream_t s;
  CUDACHECK(cudaStreamCreate(&s));
  const size_t sizes[3] = {333, 1u << 20, 16u << 20};
  const size_t maxc = 16u << 20;
  float* sendb[3];
  float* recvb[3];
  float* h = malloc(maxc * sizeof(float));
  for (int i = 0; i < 3; i++) {
    CUDACHECK(cudaMalloc((void**)&sendb[i], maxc * sizeof(float)));
    CUDACHECK(cudaMalloc((void**)&recvb[i], maxc * sizeof(float)));
  }
  int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;
  for (int k = 0; k < 3; k++) {
    size_t count = sizes[k];
    for (int i = 0; i < 3; i++) {
      fill(h, count, rank, i);
      CUDACHECK(cudaMemcpy(sendb[i], h, count * sizeof(float), cudaMemcpyHostToDevice));
      CUDACHECK(cudaMemset(recvb[i], 0, count * sizeof(float)));
    }
    /* A fresh communicator: no operation between its ranks yet. */
    ncclComm_t c;
    phase = "ncclCommSplit";
    NCCLCHECK(ncclCommSplit(world, 0, rank, &c, NULL));
    if (connect_first) {
      phase = "connecting grouped exchange";
      NCCLCHECK(ncclGroupStart());
      NCCLCHECK(ncclSend(sendb[2], count, ncclFloat, next, c, s));
      NCCLCHECK(ncclRecv(recvb[2], count, ncclFloat, prev, c, s));
      NCCLCHECK(ncclGroupEnd());
      CUDACHECK(cudaStreamSynchronize(s));
    }
    double t0 = now();
    phase = "unbatched ring, grouped exchange, unbatched ring";
    NCCLCHECK(ncclSend(sendb[0], count, ncclFloat, next, c, s));
    NCCLCHECK(ncclRecv(recvb[0], count, ncclFloat, prev, c, s));
    NCCLCHECK(ncclGroupStart());
    NCCLCHECK(ncclSend(sendb[1], count, ncclFloat, next, c, s));
    NCCLCHECK(ncclRecv(recvb[1], count, ncclFloat, prev, c, s));
    NCCLCHECK(ncclGroupEnd());
    NCCLCHECK(ncclSend(sendb[2], count, ncclFloat, next, c, s));
    NCCLCHECK(ncclRecv(recvb[2], count, ncclFloat, prev, c, s));
    CUDACHECK(cudaStreamSynchronize(s));
    double t1 = now();
    check(recvb[0], count, 0, connect_first ? "unbatched ring" : "unbatched ring as the first operation");
    check(recvb[1], count, 1, "grouped exchange after the ring");
    check(recvb[2], count, 2, "unbatched ring after the grouped exchange");
    for (int i = 0; i < 2; i++) CUDACHECK(cudaMemset(recvb[i], 0, count * sizeof(float)));
    phase = "two unbatched sends, then two receives";
    NCCLCHECK(ncclSend(sendb[0], count, ncclFloat, next, c, s));
    NCCLCHECK(ncclSend(sendb[1], count, ncclFloat, next, c, s));
    NCCLCHECK(ncclRecv(recvb[0], count, ncclFloat, prev, c, s));
    NCCLCHECK(ncclRecv(recvb[1], count, ncclFloat, prev, c, s));
    CUDACHECK(cudaStreamSynchronize(s));
    check(recvb[0], count, 0, "first of two unbatched sends");
    check(recvb[1], count, 1, "second of two unbatched sends");
    printf("rank %d GPU %d: %zu floats: correct (%.3f ms for ring, group, ring)\n", rank, dev, count,
           (t1 - t0) * 1e3);
    phase = "ncclCommDestroy";
    NCCLCHECK(ncclCommDestroy(c));
  }
  phase = "final";
  NCCLCHECK(ncclCommDestroy(world));
  for (int i = 0; i < 3; i++) {
    CUDACHECK(cudaFree(sendb[i]));
    CUDACHECK(cudaFree(recvb[i]));
  }
  free(h);
  printf("p2p_ring_cuda ok (rank %d of %d)\n", rank, nranks);
  return 0;
}
