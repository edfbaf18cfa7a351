/* Non-blocking split from several threads at once (the field segfault in
 * DESIGN.md): each thread owns a parent communicator and, repeatedly, splits
 * it with a non-blocking config while the other threads do the same, polls
 * ncclCommGetAsyncError until the child is ready, runs collectives on the
 * child and the parent, and destroys the child.
 *
 * The parents themselves are created by the threads at the same time with
 * non-blocking ncclCommInitRankConfig, from ids broadcast over a world
 * communicator.
 *
 * Mode "config" (default): config.blocking = 0 on every init and split.
 * Mode "env": no config at all; NCCL_COMM_BLOCKING=0 in the environment makes
 * the world communicator's init non-blocking too. */
#include <pthread.h>
#include "common.h"

#define THREADS 3
#define ROUNDS 4

static int nranks;
static int use_env;
static ncclComm_t parents[THREADS];

static void poll_result(ncclResult_t r, ncclComm_t comm) {
  if (r == ncclInProgress) {
    if (comm) wait_comm(comm);
  } else if (r != ncclSuccess) {
    FAILF("returned %d: %s", (int)r, ncclGetLastError(comm));
  }
}

static ncclUniqueId parent_ids[THREADS];

static void* worker(void* arg) {
  int t = (int)(long)arg;
  /* Each thread creates its own parent, all threads at once, non-blocking. */
  ncclConfig_t nb = NCCL_CONFIG_INITIALIZER;
  nb.blocking = 0;
  ncclResult_t ir = ncclCommInitRankConfig(&parents[t], nranks, parent_ids[t], g_rank, use_env ? NULL : &nb);
  ASSERT(ir == ncclSuccess || ir == ncclInProgress, "thread %d init: %d %s", t, (int)ir, ncclGetLastError(NULL));
  ASSERT(parents[t] != NULL, "non-blocking init gave no handle");
  poll_result(ir, parents[t]);
  ncclComm_t parent = parents[t];
  for (int round = 0; round < ROUNDS; round++) {
    int color = (g_rank + round + t) % 2;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclComm_t child = NULL;
    ncclResult_t r = ncclCommSplit(parent, color, -g_rank, &child, use_env ? NULL : &cfg);
    ASSERT(r == ncclSuccess || r == ncclInProgress, "split: %d %s", (int)r, ncclGetLastError(parent));
    ASSERT(child != NULL, "split returned no communicator");
    poll_result(r, child);

    /* Expected membership: ranks with the same color, ordered by key = -rank. */
    int members = 0, higher = 0, sum_expect = 0;
    for (int q = 0; q < nranks; q++)
      if ((q + round + t) % 2 == color) {
        members++;
        sum_expect += q + 1;
        if (q > g_rank) higher++;
      }
    int n = -1, me = -1;
    NCCLCHECK(ncclCommCount(child, &n));
    NCCLCHECK(ncclCommUserRank(child, &me));
    ASSERT(n == members && me == higher, "thread %d round %d: child count %d rank %d, expected %d %d", t,
           round, n, me, members, higher);

    int v = g_rank + 1, sum = 0;
    r = ncclAllReduce(&v, &sum, 1, ncclInt32, ncclSum, child, NULL);
    poll_result(r, child);
    ASSERT(sum == sum_expect, "child allreduce %d, expected %d", sum, sum_expect);

    int pv = (t + 1) * (g_rank + 1), psum = 0;
    r = ncclAllReduce(&pv, &psum, 1, ncclInt32, ncclSum, parent, NULL);
    poll_result(r, parent);
    ASSERT(psum == (t + 1) * nranks * (nranks + 1) / 2, "parent allreduce %d", psum);

    r = ncclCommFinalize(child);
    poll_result(r, child);
    NCCLCHECK(ncclCommDestroy(child));
    EXPECT_ERR(ncclCommDestroy(child), ncclInvalidArgument, "second destroy");
  }
  return NULL;
}

int main(int argc, char** argv) {
  g_rank = env_int("WEFT_RANK", "RANK", -1);
  nranks = env_int("WEFT_WORLD_SIZE", "WORLD_SIZE", -1);
  use_env = argc > 1 && strcmp(argv[1], "env") == 0;
  ASSERT(g_rank >= 0 && nranks > 1, "run me with weft run");
  ncclUniqueId id;
  NCCLCHECK(ncclGetUniqueId(&id));
  ncclComm_t world;
  ncclResult_t r = ncclCommInitRank(&world, nranks, id, g_rank);
  if (use_env) {
    ASSERT(r == ncclSuccess || r == ncclInProgress, "non-blocking init: %d", (int)r);
    poll_result(r, world);
  } else {
    NCCLCHECK(r);
  }
  /* One parent per thread, from fresh ids that rank 0 makes (without
   * NCCL_COMM_ID, as a program with its own rendezvous would) and broadcasts
   * over the world communicator: the usual out-of-band path. */
  if (g_rank == 0) {
    unsetenv("NCCL_COMM_ID");
    unsetenv("WEFT_BOOTSTRAP");
    for (int t = 0; t < THREADS; t++) NCCLCHECK(ncclGetUniqueId(&parent_ids[t]));
  }
  r = ncclBroadcast(parent_ids, parent_ids, sizeof parent_ids, ncclUint8, 0, world, NULL);
  poll_result(r, world);

  pthread_t th[THREADS];
  for (int t = 0; t < THREADS; t++) ASSERT(pthread_create(&th[t], NULL, worker, (void*)(long)t) == 0, "thread");
  for (int t = 0; t < THREADS; t++) pthread_join(th[t], NULL);

  for (int t = 0; t < THREADS; t++) NCCLCHECK(ncclCommDestroy(parents[t]));
  NCCLCHECK(ncclCommDestroy(world));
  printf("rank %d: split_threads ok\n", g_rank);
  return 0;
}
