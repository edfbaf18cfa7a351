/* Misuse through the C ABI: each case asserts the exact ncclResult_t and that
 * ncclGetLastError() names what happened. Nothing may crash, and the world
 * communicator must keep working afterwards (no other communicator affected). */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include "common.h"

static int nranks;
static ncclComm_t world;

static ncclComm_t split_all(ncclComm_t parent) {
  ncclComm_t c = NULL;
  NCCLCHECK(ncclCommSplit(parent, 0, g_rank, &c, NULL));
  ASSERT(c != NULL, "split gave NULL");
  return c;
}

static void world_still_works(void) {
  int v = g_rank + 1, sum = 0;
  NCCLCHECK(ncclAllReduce(&v, &sum, 1, ncclInt32, ncclSum, world, NULL));
  ASSERT(sum == nranks * (nranks + 1) / 2, "world allreduce %d", sum);
}

/* Threads hammering a handle while another thread destroys it: every call
 * returns ncclSuccess or ncclInvalidArgument, never crashes. */
static ncclComm_t hammered;
static volatile int destroyed;
static void* hammer(void* arg) {
  (void)arg;
  for (int i = 0; i < 2000; i++) {
    int was_destroyed = destroyed;
    int n;
    ncclResult_t st, r1 = ncclCommCount(hammered, &n), r2 = ncclCommGetAsyncError(hammered, &st);
    if (r1 != ncclSuccess && r1 != ncclInvalidArgument) FAILF("ncclCommCount during destroy: %d", (int)r1);
    if (r2 != ncclSuccess && r2 != ncclInvalidArgument) FAILF("GetAsyncError during destroy: %d", (int)r2);
    if (was_destroyed && (r1 != ncclInvalidArgument || r2 != ncclInvalidArgument))
      FAILF("a destroyed handle was accepted");
  }
  return NULL;
}

static void destroy_while_in_use(void) {
  ncclComm_t pair[2];
  NCCLCHECK(ncclCommInitAll(pair, 2, NULL));
  hammered = pair[0];
  pthread_t th[4];
  for (int t = 0; t < 4; t++) ASSERT(pthread_create(&th[t], NULL, hammer, NULL) == 0, "thread");
  for (volatile int spin = 0; spin < 20000; spin++) {
  }
  NCCLCHECK(ncclCommDestroy(pair[0]));
  destroyed = 1;
  for (int t = 0; t < 4; t++) pthread_join(th[t], NULL);
  /* The other communicator of the pair is unaffected. */
  int n = 0;
  NCCLCHECK(ncclCommCount(pair[1], &n));
  ASSERT(n == 2, "count %d", n);
  NCCLCHECK(ncclCommDestroy(pair[1]));
}

int main(void) {
  g_rank = env_int("WEFT_RANK", "RANK", -1);
  nranks = env_int("WEFT_WORLD_SIZE", "WORLD_SIZE", -1);
  ASSERT(g_rank >= 0 && nranks > 1, "run me with weft run -n 2 or more");
  ncclUniqueId id;
  NCCLCHECK(ncclGetUniqueId(&id));

  /* Bad init arguments (refused locally, before any bootstrap). */
  ncclComm_t bad = (ncclComm_t)0x1;
  EXPECT_ERR(ncclCommInitRank(&bad, nranks, id, nranks), ncclInvalidArgument, "out of range");
  ASSERT(bad == NULL, "failed init left a handle");
  EXPECT_ERR(ncclCommInitRank(&bad, nranks, id, -1), ncclInvalidArgument, "rank -1");
  EXPECT_ERR(ncclCommInitRank(&bad, 0, id, 0), ncclInvalidArgument, "nranks");
  EXPECT_ERR(ncclCommInitRank(NULL, nranks, id, g_rank), ncclInvalidArgument, "NULL");
  ncclUniqueId junk;
  memset(&junk, 0, sizeof junk);
  EXPECT_ERR(ncclCommInitRank(&bad, nranks, junk, g_rank), ncclInvalidArgument, "unique id");
  ncclConfig_t badcfg = NCCL_CONFIG_INITIALIZER;
  badcfg.magic = 0;
  EXPECT_ERR(ncclCommInitRankConfig(&bad, nranks, id, g_rank, &badcfg), ncclInvalidArgument,
             "NCCL_CONFIG_INITIALIZER");
  ncclConfig_t badblk = NCCL_CONFIG_INITIALIZER;
  badblk.blocking = 7;
  EXPECT_ERR(ncclCommInitRankConfig(&bad, nranks, id, g_rank, &badblk), ncclInvalidArgument, "blocking");

  /* The real world communicator, with an older (smaller) config struct:
   * only the fields up to maxCTAs exist for such a caller. */
  ncclConfig_t old = NCCL_CONFIG_INITIALIZER;
  old.size = offsetof(ncclConfig_t, netName);
  old.blocking = 1;
  old.commName = (const char*)0x1; /* beyond `size`: must never be read */
  NCCLCHECK(ncclCommInitRankConfig(&world, nranks, id, g_rank, &old));
  world_still_works();

  /* NULL and forged handles. */
  int n;
  EXPECT_ERR(ncclCommCount(NULL, &n), ncclInvalidArgument, "NULL");
  EXPECT_ERR(ncclCommCount((ncclComm_t)(uintptr_t)0x12345678, &n), ncclInvalidArgument,
             "not a communicator handle");
  EXPECT_ERR(ncclAllReduce(&n, &n, 1, ncclInt32, ncclSum, (ncclComm_t)&n, NULL), ncclInvalidArgument,
             "not a communicator handle");
  EXPECT_ERR(ncclCommDestroy(NULL), ncclInvalidArgument, "NULL");
  EXPECT_ERR(ncclCommAbort((ncclComm_t)(uintptr_t)0xdeadbeef), ncclInvalidArgument, "not a communicator");
  EXPECT_ERR(ncclCommCount(world, NULL), ncclInvalidArgument, "count is NULL");
  EXPECT_ERR(ncclCommGetAsyncError(world, NULL), ncclInvalidArgument, "asyncError is NULL");

  /* NULL buffers with count > 0. */
  float f[64] = {0};
  EXPECT_ERR(ncclAllReduce(NULL, f, 10, ncclFloat32, ncclSum, world, NULL), ncclInvalidArgument, "NULL");
  EXPECT_ERR(ncclAllReduce(f, NULL, 10, ncclFloat32, ncclSum, world, NULL), ncclInvalidArgument, "NULL");
  EXPECT_ERR(ncclSend(NULL, 1, ncclFloat32, 0, world, NULL), ncclInvalidArgument, "NULL");
  EXPECT_ERR(ncclAllGather(NULL, f, 1, ncclFloat32, world, NULL), ncclInvalidArgument, "NULL");
  const char* m = ncclGetLastError(world);
  ASSERT(strstr(m, "ncclAllGather") && strstr(m, "communicator") && strstr(m, "rank"),
         "last error lacks function/communicator/rank: %s", m);

  /* Unknown types and ops. */
  EXPECT_ERR(ncclAllReduce(f, f, 1, (ncclDataType_t)12, ncclSum, world, NULL), ncclInvalidArgument,
             "unknown data type 12");
  EXPECT_ERR(ncclAllReduce(f, f, 1, (ncclDataType_t)-1, ncclSum, world, NULL), ncclInvalidArgument,
             "unknown data type");
  EXPECT_ERR(ncclBroadcast(f, f, 1, (ncclDataType_t)99, 0, world, NULL), ncclInvalidArgument, "data type");
  EXPECT_ERR(ncclAllReduce(f, f, 1, ncclFloat32, ncclNumOps, world, NULL), ncclInvalidArgument,
             "unknown reduction op 5");
  EXPECT_ERR(ncclAllReduce(f, f, 1, ncclFloat32, (ncclRedOp_t)-3, world, NULL), ncclInvalidArgument,
             "reduction op");
  EXPECT_ERR(ncclReduceScatter(f, f, 1, ncclFloat32, (ncclRedOp_t)1000, world, NULL), ncclInvalidArgument,
             "reduction op");

  /* Out-of-range roots and peers. */
  EXPECT_ERR(ncclBroadcast(f, f, 1, ncclFloat32, nranks, world, NULL), ncclInvalidArgument, "root");
  EXPECT_ERR(ncclBcast(f, 1, ncclFloat32, -1, world, NULL), ncclInvalidArgument, "root -1");
  EXPECT_ERR(ncclReduce(f, f, 1, ncclFloat32, ncclSum, nranks + 5, world, NULL), ncclInvalidArgument, "root");
  EXPECT_ERR(ncclGather(f, f, 1, ncclFloat32, nranks, world, NULL), ncclInvalidArgument, "root");
  EXPECT_ERR(ncclScatter(f, f, 1, ncclFloat32, -2, world, NULL), ncclInvalidArgument, "root");
  EXPECT_ERR(ncclSend(f, 1, ncclFloat32, nranks, world, NULL), ncclInvalidArgument, "peer");
  EXPECT_ERR(ncclRecv(f, 1, ncclFloat32, -1, world, NULL), ncclInvalidArgument, "peer -1");

  /* Counts whose byte size overflows. */
  EXPECT_ERR(ncclAllReduce(f, f, SIZE_MAX / 2, ncclFloat32, ncclSum, world, NULL), ncclInvalidArgument,
             "overflow");
  EXPECT_ERR(ncclAllGather(f, f, SIZE_MAX / 3, ncclInt8, world, NULL), ncclInvalidArgument, "overflow");
  EXPECT_ERR(ncclAlltoAll(f, f, SIZE_MAX / 2, ncclInt8, world, NULL), ncclInvalidArgument, "overflow");

  /* Bad split/shrink arguments. */
  ncclComm_t child = NULL;
  EXPECT_ERR(ncclCommSplit(world, -2, 0, &child, NULL), ncclInvalidArgument, "color -2");
  EXPECT_ERR(ncclCommSplit(world, 0, 0, NULL, NULL), ncclInvalidArgument, "newcomm is NULL");
  int ex = nranks;
  EXPECT_ERR(ncclCommShrink(world, &ex, 1, &child, NULL, NCCL_SHRINK_DEFAULT), ncclInvalidArgument,
             "out of range");
  /* Excluded ranks never call shrink: a rank that excludes itself is refused. */
  ex = g_rank;
  EXPECT_ERR(ncclCommShrink(world, &ex, 1, &child, NULL, NCCL_SHRINK_ABORT), ncclInvalidUsage,
             "excluded ranks do not call");
  EXPECT_ERR(ncclCommShrink(world, &ex, 1, &child, NULL, 0x40), ncclInvalidArgument, "shrinkFlags");
  EXPECT_ERR(ncclCommRevoke(world, 0x2), ncclInvalidArgument, "revokeFlags");

  /* Host mode has no CUDA device: a documented error, not a fake number. */
  int dev = 12345;
  EXPECT_ERR(ncclCommCuDevice(world, &dev), ncclInvalidUsage, "host mode");
  ASSERT(dev == 12345, "device written");

  /* Group misuse; an error inside a group fails the whole group. */
  EXPECT_ERR(ncclGroupEnd(), ncclInvalidUsage, "without a matching ncclGroupStart");
  NCCLCHECK(ncclGroupStart());
  EXPECT_ERR(ncclAllReduce(NULL, f, 4, ncclFloat32, ncclSum, world, NULL), ncclInvalidArgument, "NULL");
  EXPECT_ERR(ncclGroupEnd(), ncclInvalidArgument, "discarded");
  ncclSimInfo_t sim = NCCL_SIM_INFO_INITIALIZER;
  sim.magic = 1;
  NCCLCHECK(ncclGroupStart());
  EXPECT_ERR(ncclGroupSimulateEnd(&sim), ncclInvalidArgument, "NCCL_SIM_INFO_INITIALIZER");
  NCCLCHECK(ncclGroupEnd());

  /* Memory and registration misuse. */
  void* p = NULL;
  NCCLCHECK(ncclMemAlloc(&p, 100));
  NCCLCHECK(ncclMemFree(p));
  EXPECT_ERR(ncclMemFree(p), ncclInvalidArgument, "not allocated by ncclMemAlloc");
  EXPECT_ERR(ncclMemFree(NULL), ncclInvalidArgument, "NULL");
  EXPECT_ERR(ncclMemFree(f), ncclInvalidArgument, "not allocated");
  EXPECT_ERR(ncclMemAlloc(NULL, 10), ncclInvalidArgument, "NULL");
  void* reg = NULL;
  NCCLCHECK(ncclCommRegister(world, f, sizeof f, &reg));
  NCCLCHECK(ncclCommDeregister(world, reg));
  EXPECT_ERR(ncclCommDeregister(world, reg), ncclInvalidArgument, "not a registration");

  /* Reduction operator misuse. */
  ncclRedOp_t op;
  float two = 2;
  EXPECT_ERR(ncclRedOpCreatePreMulSum(&op, &two, ncclFloat32, (ncclScalarResidence_t)5, world),
             ncclInvalidArgument, "residence");
  EXPECT_ERR(ncclRedOpCreatePreMulSum(&op, NULL, ncclFloat32, ncclScalarHostImmediate, world),
             ncclInvalidArgument, "scalar is NULL");
  NCCLCHECK(ncclRedOpCreatePreMulSum(&op, &two, ncclFloat32, ncclScalarHostImmediate, world));
  EXPECT_ERR(ncclAllReduce(f, f, 1, ncclFloat64, op, world, NULL), ncclInvalidArgument, "created for");
  NCCLCHECK(ncclRedOpDestroy(op, world));
  EXPECT_ERR(ncclRedOpDestroy(op, world), ncclInvalidArgument, "already destroyed");
  EXPECT_ERR(ncclRedOpDestroy(ncclSum, world), ncclInvalidArgument, "built-in");
  EXPECT_ERR(ncclAllReduce(f, f, 1, ncclFloat32, op, world, NULL), ncclInvalidArgument, "reduction op");
  world_still_works();

  /* Double destroy and use after destroy. */
  ncclComm_t c1 = split_all(world);
  NCCLCHECK(ncclCommDestroy(c1));
  EXPECT_ERR(ncclCommDestroy(c1), ncclInvalidArgument, "second destroy");
  m = ncclGetLastError(c1);
  ASSERT(strstr(m, "communicator") && strstr(m, "destroyed at") && strstr(m, "job") &&
             strstr(m, "rank"),
         "double destroy message not informative: %s", m);
  EXPECT_ERR(ncclAllReduce(f, f, 1, ncclFloat32, ncclSum, c1, NULL), ncclInvalidArgument,
             "use after destroy");
  EXPECT_ERR(ncclCommCount(c1, &n), ncclInvalidArgument, "destroyed at");
  EXPECT_ERR(ncclCommSplit(c1, 0, 0, &child, NULL), ncclInvalidArgument, "destroyed");
  EXPECT_ERR(ncclCommAbort(c1), ncclInvalidArgument, "destroyed");
  ncclResult_t st;
  EXPECT_ERR(ncclCommGetAsyncError(c1, &st), ncclInvalidArgument, "destroyed");
  world_still_works();

  /* Use after abort. */
  ncclComm_t c2 = split_all(world);
  /* Abort breaks whatever is still in flight on the communicator anywhere: make
   * sure every rank has left the split (and its end-of-init barrier) first. */
  world_still_works();
  NCCLCHECK(ncclCommAbort(c2));
  EXPECT_ERR(ncclAllReduce(f, f, 1, ncclFloat32, ncclSum, c2, NULL), ncclInvalidArgument, "use after abort");
  EXPECT_ERR(ncclCommDestroy(c2), ncclInvalidArgument, "aborted");
  EXPECT_ERR(ncclCommAbort(c2), ncclInvalidArgument, "aborted");
  world_still_works();

  /* A peer's abort reaches the others: their async error and their next
   * operation report ncclRemoteError (no hang), and destroy still works. */
  ncclComm_t c4 = split_all(world);
  world_still_works();
  if (g_rank == 0) {
    NCCLCHECK(ncclCommAbort(c4));
  } else {
    ncclResult_t ae = ncclSuccess;
    for (long i = 0; i < 100000000L && ae == ncclSuccess; i++) NCCLCHECK(ncclCommGetAsyncError(c4, &ae));
    ASSERT(ae == ncclRemoteError, "async error after a peer's abort: %d", (int)ae);
    m = ncclGetLastError(c4);
    ASSERT(strstr(m, "abort") != NULL, "async error message: %s", m);
    ncclResult_t r = ncclAllReduce(f, f, 1, ncclFloat32, ncclSum, c4, NULL);
    ASSERT(r == ncclRemoteError || r == ncclInvalidUsage, "allreduce after a peer's abort: %d (%s)", (int)r,
           ncclGetLastError(c4));
    NCCLCHECK(ncclCommDestroy(c4));
  }
  world_still_works();

  /* Finalize, then use: refused; destroy: fine. */
  ncclComm_t c3 = split_all(world);
  NCCLCHECK(ncclCommFinalize(c3));
  EXPECT_ERR(ncclAllReduce(f, f, 1, ncclFloat32, ncclSum, c3, NULL), ncclInvalidUsage, "finalized");
  EXPECT_ERR(ncclCommFinalize(c3), ncclInvalidUsage, "already finalized");
  NCCLCHECK(ncclCommDestroy(c3));

  /* Shrink: every rank but 0, called by the survivors only (rank 0 never
   * calls it, as a dead rank could not). */
  ex = 0;
  ncclComm_t s = (ncclComm_t)0x1;
  if (g_rank != 0) {
    NCCLCHECK(ncclCommShrink(world, &ex, 1, &s, NULL, NCCL_SHRINK_DEFAULT));
    int sc = 0, sr = -1;
    NCCLCHECK(ncclCommCount(s, &sc));
    NCCLCHECK(ncclCommUserRank(s, &sr));
    ASSERT(sc == nranks - 1 && sr == g_rank - 1, "shrunk count %d rank %d", sc, sr);
    int v = g_rank, sum = 0;
    NCCLCHECK(ncclAllReduce(&v, &sum, 1, ncclInt32, ncclSum, s, NULL));
    ASSERT(sum == nranks * (nranks - 1) / 2, "shrunk allreduce %d", sum);
    NCCLCHECK(ncclCommDestroy(s));
  }

  /* NOCOLOR: NULL communicator. */
  ncclComm_t nc = (ncclComm_t)0x1;
  NCCLCHECK(ncclCommSplit(world, g_rank == 0 ? NCCL_SPLIT_NOCOLOR : 1, 0, &nc, NULL));
  if (g_rank == 0) ASSERT(nc == NULL, "NOCOLOR gave a communicator");
  else NCCLCHECK(ncclCommDestroy(nc));

  destroy_while_in_use();
  world_still_works();
  NCCLCHECK(ncclCommGetAsyncError(world, &st));
  ASSERT(st == ncclSuccess, "world async error %d", (int)st);
  NCCLCHECK(ncclCommDestroy(world));
  EXPECT_ERR(ncclCommDestroy(world), ncclInvalidArgument, "second destroy");
  printf("rank %d: errors ok\n", g_rank);
  return 0;
}
