/* Device all-reduces in a loop until the communicator fails: for checking
 * that something outside the ranks (the pod's sidecar getting SIGTERM, an
 * abort) stops ranks that are inside device kernels. Plain NCCL API; run
 * under a launcher that sets RANK, WORLD_SIZE and NCCL_COMM_ID (LOCAL_RANK
 * picks the GPU), e.g. on the GPU machine:
 *
 *   nvcc -O2 -I libcomm/include libcomm/capi/tests/c/loop_cuda.c \
 *        -L target/release -l:libnccl.so.2 -o /tmp/loop_cuda
 *   weft run --sidecar -n 2 -- /tmp/loop_cuda 1048576 &
 *   sleep 5; kill -TERM <the weft sidecar's pid>
 *
 * Each rank prints, when a call, the stream or ncclCommGetAsyncError
 * reports the failure, "rank R: failed at unix time T (seen by WHAT): ERROR
 * [LAST_ERROR]" (T in seconds with microseconds, to compare with the time
 * of the signal) and exits 3; after 120 s without a failure it prints
 * "rank R: no failure" and exits 0. */
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static double unix_now(void) {
  struct timeval tv;
  gettimeofday(&tv, NULL);
  return tv.tv_sec + tv.tv_usec / 1e6;
}

static int env_int(const char* a, const char* b, int dflt) {
  const char* v = getenv(a);
  if (!v) v = getenv(b);
  return v ? atoi(v) : dflt;
}

int main(int argc, char** argv) {
  long count = argc > 1 ? atol(argv[1]) : 1 << 20;
  int rank = env_int("RANK", "WEFT_RANK", 0);
  int nranks = env_int("WORLD_SIZE", "WEFT_WORLD_SIZE", 1);
  int local = env_int("LOCAL_RANK", "WEFT_LOCAL_RANK", rank);
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    printf("rank %d: no CUDA device\n", rank);
    return 2;
  }
  cudaSetDevice(local % ndev);
  ncclUniqueId id;
  ncclResult_t r = ncclGetUniqueId(&id); /* NCCL_COMM_ID: every rank gets the same id */
  ncclComm_t comm;
  if (r == ncclSuccess) r = ncclCommInitRank(&comm, nranks, id, rank);
  if (r != ncclSuccess) {
    printf("rank %d: init: %s\n", rank, ncclGetErrorString(r));
    return 2;
  }
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  float *in, *out;
  cudaMalloc((void**)&in, count * sizeof(float));
  cudaMalloc((void**)&out, count * sizeof(float));
  cudaMemset(in, 0, count * sizeof(float));
  printf("rank %d: looping all_reduce of %ld floats\n", rank, count);
  fflush(stdout);
  double start = unix_now();
  const char* seen = NULL;
  while (unix_now() - start < 120) {
    r = ncclAllReduce(in, out, count, ncclFloat, ncclSum, comm, s);
    if (r != ncclSuccess && r != ncclInProgress) {
      seen = "the call";
      break;
    }
    if (cudaStreamSynchronize(s) != cudaSuccess) {
      seen = "cudaStreamSynchronize";
      break;
    }
    ncclResult_t ae = ncclSuccess;
    ncclCommGetAsyncError(comm, &ae);
    if (ae != ncclSuccess && ae != ncclInProgress) {
      seen = "ncclCommGetAsyncError";
      r = ae;
      break;
    }
  }
  if (!seen) {
    printf("rank %d: no failure\n", rank);
    ncclCommDestroy(comm);
    return 0;
  }
  printf("rank %d: failed at unix time %.6f (seen by %s): %s [%s]\n", rank, unix_now(), seen,
         ncclGetErrorString(r), ncclGetLastError(comm));
  fflush(stdout);
  ncclCommAbort(comm);
  return 3;
}
