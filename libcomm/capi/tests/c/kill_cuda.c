/* A rank dies in the middle of device collectives: every survivor must get
 * an error, not a hang. Plain NCCL API, so the same binary runs on NVIDIA's
 * NCCL (which hangs here: that is the gap Weft closes).
 *
 * The program is its own launcher (a launcher such as `weft run` stops the
 * other ranks as soon as one dies, which would hide what the survivors do):
 * the parent makes the unique id and forks NRANKS ranks; rank r uses GPU
 * r % (GPUs visible), so with one GPU all ranks share it. Every rank loops
 * ncclAllReduce (or ncclSend/ncclRecv to its ring neighbours, grouped
 * all-to-all, ncclBroadcast or ncclReduce from/to rank 0, by --op; large
 * broadcasts and reduces run as chains) of COUNT floats on one stream, synchronizing the
 * stream after every call, as a training loop does. At iteration 20 the
 * last rank dies (--how kill: SIGKILL; exit: _exit(1); stop: SIGSTOP, a
 * frozen peer). A survivor then sees the failure as an error of a call, of
 * the stream synchronization returning with ncclCommGetAsyncError set, or of
 * the next call; it prints one line
 *
 *   rank R: error after T ms (seen by WHAT): LAST_ERROR; abort took A ms
 *
 * where T counts from the victim's death, then aborts the communicator
 * (ncclCommAbort, timed). The parent waits for every survivor for --bound
 * seconds (default 10), kills any still running and prints "kill_cuda FAIL"
 * (exit 1), else "kill_cuda ok" (exit 0). Build on the GPU machine:
 *
 *   nvcc -O2 -I libcomm/include libcomm/capi/tests/c/kill_cuda.c \
 *        -L target/release -l:libnccl.so.2 -o /tmp/kill_cuda
 *   /tmp/kill_cuda 3 --count 1000000 --how kill      (LD_LIBRARY_PATH: ours)
 *
 * WEFT_CUDA_ALGO and the count pick the device algorithm. */
#include <cuda_runtime.h>
#include <nccl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define KILL_AT 20
#define MAX_ITERS 100000

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* Shared with every rank (MAP_SHARED before fork). */
struct Shared {
  volatile double died_at;
  volatile int ready;
};

static int rank_main(int rank, int nranks, ncclUniqueId id, long count, const char* op,
                     const char* how, struct Shared* sh) {
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    printf("rank %d: no CUDA device\n", rank);
    return 2;
  }
  cudaSetDevice(rank % ndev);
  ncclComm_t comm;
  ncclResult_t r = ncclCommInitRank(&comm, nranks, id, rank);
  if (r != ncclSuccess) {
    printf("rank %d: ncclCommInitRank: %s: %s\n", rank, ncclGetErrorString(r), ncclGetLastError(comm));
    return 2;
  }
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  float *in, *out;
  size_t bytes = (size_t)count * sizeof(float) * (strcmp(op, "alltoall") == 0 ? nranks : 1);
  cudaMalloc((void**)&in, bytes);
  cudaMalloc((void**)&out, bytes);
  cudaMemset(in, 0, bytes);
  int victim = nranks - 1;
  int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;
  const char* seen = NULL;
  for (int i = 0; i < MAX_ITERS; i++) {
    if (rank == victim && i == KILL_AT) {
      sh->died_at = now_ms();
      __sync_synchronize();
      if (strcmp(how, "exit") == 0) _exit(1);
      if (strcmp(how, "stop") == 0) {
        raise(SIGSTOP);
        _exit(1); /* after SIGCONT: leave without destroying */
      }
      raise(SIGKILL);
    }
    if (strcmp(op, "allreduce") == 0) {
      r = ncclAllReduce(in, out, count, ncclFloat, ncclSum, comm, s);
    } else if (strcmp(op, "p2p") == 0) {
      r = ncclGroupStart();
      if (r == ncclSuccess) r = ncclSend(in, count, ncclFloat, next, comm, s);
      if (r == ncclSuccess) r = ncclRecv(out, count, ncclFloat, prev, comm, s);
      ncclResult_t e = ncclGroupEnd();
      if (r == ncclSuccess) r = e;
    } else if (strcmp(op, "broadcast") == 0) {
      r = ncclBroadcast(in, out, count, ncclFloat, 0, comm, s);
    } else if (strcmp(op, "reduce") == 0) {
      r = ncclReduce(in, out, count, ncclFloat, ncclSum, 0, comm, s);
    } else { /* alltoall */
      r = ncclGroupStart();
      for (int p = 0; p < nranks && r == ncclSuccess; p++) {
        r = ncclSend(in + p * count, count, ncclFloat, p, comm, s);
        if (r == ncclSuccess) r = ncclRecv(out + p * count, count, ncclFloat, p, comm, s);
      }
      ncclResult_t e = ncclGroupEnd();
      if (r == ncclSuccess) r = e;
    }
    if (r != ncclSuccess && r != ncclInProgress) {
      seen = "the call";
      break;
    }
    cudaError_t ce = cudaStreamSynchronize(s);
    ncclResult_t ae = ncclSuccess;
    ncclCommGetAsyncError(comm, &ae);
    if (ce != cudaSuccess) {
      seen = "cudaStreamSynchronize";
      break;
    }
    if (ae != ncclSuccess && ae != ncclInProgress) {
      seen = "ncclCommGetAsyncError after the stream drained";
      r = ae;
      break;
    }
  }
  if (seen == NULL) {
    printf("rank %d: no error in %d iterations\n", rank, MAX_ITERS);
    return 1;
  }
  double t = sh->died_at > 0 ? now_ms() - sh->died_at : -1;
  const char* msg = ncclGetLastError(comm);
  char copy[600];
  snprintf(copy, sizeof copy, "%s", msg ? msg : "(none)");
  double a0 = now_ms();
  ncclResult_t ar = ncclCommAbort(comm);
  double a = now_ms() - a0;
  printf("rank %d: error after %.1f ms (seen by %s): %s [%s]; abort took %.1f ms (%s)\n", rank, t,
         seen, ncclGetErrorString(r), copy, a, ncclGetErrorString(ar));
  fflush(stdout);
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: kill_cuda NRANKS [--count N] [--op allreduce|p2p|alltoall|broadcast|reduce] [--how kill|exit|stop] [--bound S]\n");
    return 2;
  }
  int nranks = atoi(argv[1]);
  long count = 1 << 20;
  const char* op = "allreduce";
  const char* how = "kill";
  double bound = 10;
  for (int i = 2; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--count")) count = atol(argv[i + 1]);
    else if (!strcmp(argv[i], "--op")) op = argv[i + 1];
    else if (!strcmp(argv[i], "--how")) how = argv[i + 1];
    else if (!strcmp(argv[i], "--bound")) bound = atof(argv[i + 1]);
  }
  if (nranks < 2 || count < 1) {
    fprintf(stderr, "kill_cuda: needs NRANKS >= 2 and COUNT >= 1\n");
    return 2;
  }
  struct Shared* sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  memset((void*)sh, 0, sizeof *sh);
  ncclUniqueId id;
  if (ncclGetUniqueId(&id) != ncclSuccess) {
    fprintf(stderr, "kill_cuda: ncclGetUniqueId failed\n");
    return 2;
  }
  pid_t pids[64];
  for (int r = 0; r < nranks && r < 64; r++) {
    pids[r] = fork();
    if (pids[r] == 0) _exit(rank_main(r, nranks, id, count, op, how, sh));
  }
  printf("kill_cuda: %d ranks, op %s, %ld floats, victim rank %d (%s at iteration %d), bound %.0f s\n",
         nranks, op, count, nranks - 1, how, KILL_AT, bound);
  fflush(stdout);
  int ok = 1, left = nranks - 1;
  int done[64] = {0};
  double start = now_ms();
  while (left > 0) {
    for (int r = 0; r < nranks - 1; r++) {
      int st;
      if (!done[r] && waitpid(pids[r], &st, WNOHANG) == pids[r]) {
        done[r] = 1;
        left--;
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
          printf("kill_cuda: rank %d ended badly (status %d)\n", r, st);
          ok = 0;
        }
      }
    }
    double since = sh->died_at > 0 ? now_ms() - sh->died_at : now_ms() - start;
    if (left > 0 && since > bound * 1e3) {
      for (int r = 0; r < nranks - 1; r++)
        if (!done[r]) {
          printf("kill_cuda: rank %d still running %.0f s after the victim died (a hang); killing it\n", r, bound);
          kill(pids[r], SIGKILL);
          waitpid(pids[r], NULL, 0);
        }
      ok = 0;
      break;
    }
    usleep(10000);
  }
  kill(pids[nranks - 1], SIGKILL);
  if (strcmp(how, "stop") == 0) kill(pids[nranks - 1], SIGCONT);
  waitpid(pids[nranks - 1], NULL, 0);
  printf("kill_cuda %s\n", ok ? "ok" : "FAIL");
  return ok ? 0 : 1;
}
