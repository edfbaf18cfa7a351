/* Survive a lost rank through the C ABI (NCCL 2.27-2.29 semantics), as
 * processes started by the launcher: the last rank dies without destroying
 * its communicator; the survivors see ncclRemoteError, shrink without it
 * (NCCL_SHRINK_ABORT, survivors only), check the smaller communicator, then
 * grow back to the full size with a new rank (a thread of rank 0, joining
 * with ncclCommGrow(NULL, ..., &id, rank)), revoke the shrunk one and
 * split it by parity after the revoke. */
#include <pthread.h>
#include <unistd.h>

#include "common.h"

static int nranks;
static ncclUniqueId grow_id;

static void check_sum(ncclComm_t c, int n, const char* what) {
  int me = -1;
  NCCLCHECK(ncclCommUserRank(c, &me));
  int v = me + 1, sum = 0;
  NCCLCHECK(ncclAllReduce(&v, &sum, 1, ncclInt32, ncclSum, c, NULL));
  ASSERT(sum == n * (n + 1) / 2, "%s: sum %d over %d ranks", what, sum, n);
}

static void* new_rank(void* arg) {
  (void)arg;
  ncclComm_t g = NULL;
  NCCLCHECK(ncclCommGrow(NULL, nranks, &grow_id, nranks - 1, &g, NULL));
  int c = 0, r = -1;
  NCCLCHECK(ncclCommCount(g, &c));
  NCCLCHECK(ncclCommUserRank(g, &r));
  ASSERT(c == nranks && r == nranks - 1, "new rank: count %d rank %d", c, r);
  check_sum(g, nranks, "grown (new rank)");
  NCCLCHECK(ncclCommDestroy(g));
  return NULL;
}

int main(void) {
  g_rank = env_int("WEFT_RANK", "RANK", 0);
  nranks = env_int("WEFT_WORLD_SIZE", "WORLD_SIZE", 1);
  ncclUniqueId id;
  NCCLCHECK(ncclGetUniqueId(&id));
  ncclComm_t world;
  NCCLCHECK(ncclCommInitRank(&world, nranks, id, g_rank));
  check_sum(world, nranks, "world");
  int dead = nranks - 1;
  if (g_rank == dead) {
    fflush(stdout);
    _exit(0); /* dies without destroying anything */
  }
  /* Survivors: the lost rank fails the next collective. */
  int v = 1, out = 0;
  ncclResult_t r = ncclAllReduce(&v, &out, 1, ncclInt32, ncclSum, world, NULL);
  ASSERT(r == ncclRemoteError, "allreduce with a dead rank: %d (%s)", (int)r, ncclGetLastError(world));
  /* A non-blocking shrink: ncclInProgress or ncclSuccess, then poll. */
  ncclComm_t small = NULL;
  ncclConfig_t nb = NCCL_CONFIG_INITIALIZER;
  nb.blocking = 0;
  ncclResult_t sr = ncclCommShrink(world, &dead, 1, &small, &nb, NCCL_SHRINK_ABORT);
  ASSERT(sr == ncclSuccess || sr == ncclInProgress, "non-blocking shrink: %d (%s)", (int)sr,
         ncclGetLastError(world));
  wait_comm(small);
  int c = 0, me = -1;
  NCCLCHECK(ncclCommCount(small, &c));
  NCCLCHECK(ncclCommUserRank(small, &me));
  ASSERT(c == nranks - 1 && me == g_rank, "shrunk: count %d rank %d", c, me);
  check_sum(small, nranks - 1, "shrunk");
  /* The parent is revoked by NCCL_SHRINK_ABORT: quiescent, so success. */
  ncclResult_t st = ncclInProgress;
  NCCLCHECK(ncclCommGetAsyncError(world, &st));
  ASSERT(st == ncclSuccess, "revoked parent's async error %d", (int)st);
  /* Finalize then destroy, as torch's shrink_group tears the parent down:
     a failed, revoked parent has nothing to flush, so finalize succeeds. */
  NCCLCHECK(ncclCommFinalize(world));
  NCCLCHECK(ncclCommDestroy(world));

  /* Grow back: rank 0 makes the id and also hosts the new rank (a thread). */
  pthread_t t;
  ncclComm_t grown = NULL;
  ncclConfig_t blk = NCCL_CONFIG_INITIALIZER;
  blk.blocking = 1; /* as the new rank's NULL config: every rank makes the same choice */
  if (me == 0) {
    NCCLCHECK(ncclCommGetUniqueId(small, &grow_id));
    ncclUniqueId again;
    EXPECT_ERR(ncclCommGetUniqueId(small, &again), ncclInvalidUsage, "not consumed");
    ASSERT(pthread_create(&t, NULL, new_rank, NULL) == 0, "pthread_create");
    NCCLCHECK(ncclCommGrow(small, nranks, &grow_id, -1, &grown, &blk));
  } else {
    EXPECT_ERR(ncclCommGrow(small, nranks, NULL, 2, &grown, &blk), ncclInvalidArgument, "rank -1");
    NCCLCHECK(ncclCommGrow(small, nranks, NULL, -1, &grown, &blk));
  }
  NCCLCHECK(ncclCommCount(grown, &c));
  int gr = -1;
  NCCLCHECK(ncclCommUserRank(grown, &gr));
  ASSERT(c == nranks && gr == me, "grown: count %d rank %d", c, gr);
  check_sum(grown, nranks, "grown");
  if (me == 0) pthread_join(t, NULL);

  /* Revoke: operations refused afterwards, destroy allowed. */
  ncclResult_t rv = ncclCommRevoke(small, NCCL_REVOKE_DEFAULT);
  ASSERT(rv == ncclSuccess || rv == ncclInProgress, "revoke: %d (%s)", (int)rv, ncclGetLastError(small));
  st = ncclInProgress;
  for (int i = 0; i < 100000 && st == ncclInProgress; i++) NCCLCHECK(ncclCommGetAsyncError(small, &st));
  ASSERT(st == ncclSuccess, "revoked async error %d", (int)st);
  EXPECT_ERR(ncclAllReduce(&v, &out, 1, ncclInt32, ncclSum, small, NULL), ncclInvalidUsage, "revoked");
  /* Split after revoke (NCCL allows it; every rank of small calls it): by
   * parity, each half checked on random data. */
  int m = nranks - 1;
  ncclComm_t half = NULL;
  NCCLCHECK(ncclCommSplit(small, me % 2, me, &half, &blk));
  int hn = 0, hr = -1;
  NCCLCHECK(ncclCommCount(half, &hn));
  NCCLCHECK(ncclCommUserRank(half, &hr));
  ASSERT(hn == (me % 2 ? m / 2 : (m + 1) / 2) && hr == me / 2, "half after revoke: count %d rank %d", hn,
         hr);
  check_random_sum(&half, 1, 17, "split after revoke");
  NCCLCHECK(ncclCommDestroy(half));
  NCCLCHECK(ncclCommDestroy(small));
  NCCLCHECK(ncclCommDestroy(grown));
  printf("rank %d: shrink_grow ok\n", g_rank);
  return 0;
}
