/* Shrink, grow and split-after-revoke inside ncclGroupStart/ncclGroupEnd,
 * one thread holding several ranks of one communicator (NCCL 2.27-2.29
 * semantics: they run at ncclGroupEnd, which writes the new handles). Each
 * process (of P started by weft run) holds G ranks of a communicator of
 * N = P*G ranks, made with ncclCommInitRank in a group. Then, each step in
 * one group per process:
 *   - a BLOCKING shrink without the last rank (a thread that ran its ranks'
 *     shrinks one after the other would wait for itself until the init
 *     timeout);
 *   - a blocking grow back to N ranks: process 0 makes the id and also
 *     holds the new rank (ncclCommGrow with a NULL communicator);
 *   - a non-blocking shrink without the new rank (ncclGroupEnd returns
 *     ncclSuccess or ncclInProgress; each child polled with
 *     ncclCommGetAsyncError);
 *   - revoke of the grown communicator on every rank, then a split by parity
 *     of the revoked communicator.
 * Every new communicator is checked with an all-reduce of random data. */
#include "common.h"

#define G 2

static int P, N;

static int grank(int g) { return g_rank * G + g; }

static void expect(ncclComm_t c, int n, int r, const char* what) {
  int cn = -1, cr = -1;
  NCCLCHECK(ncclCommCount(c, &cn));
  NCCLCHECK(ncclCommUserRank(c, &cr));
  ASSERT(cn == n && cr == r, "%s: count %d rank %d, want %d and %d", what, cn, cr, n, r);
}

int main(void) {
  g_rank = env_int("WEFT_RANK", "RANK", -1);
  P = env_int("WEFT_WORLD_SIZE", "WORLD_SIZE", -1);
  ASSERT(g_rank >= 0 && P > 0, "run me with weft run");
  N = P * G;
  ncclConfig_t blk = NCCL_CONFIG_INITIALIZER;
  blk.blocking = 1;
  ncclConfig_t nb = NCCL_CONFIG_INITIALIZER;
  nb.blocking = 0;

  ncclUniqueId id;
  NCCLCHECK(ncclGetUniqueId(&id));
  ncclComm_t comms[G];
  NCCLCHECK(ncclGroupStart());
  for (int g = 0; g < G; g++) NCCLCHECK(ncclCommInitRankConfig(&comms[g], N, id, grank(g), &blk));
  NCCLCHECK(ncclGroupEnd());
  check_random_sum(comms, G, 1, "world");

  /* 1. Blocking shrink without rank N-1 (process P-1's last rank, which
   *    departs: it never calls shrink). */
  int ex = N - 1;
  ncclComm_t small[G];
  int sg[G], ns = 0;
  NCCLCHECK(ncclGroupStart());
  for (int g = 0; g < G; g++) {
    if (grank(g) == ex) continue;
    small[ns] = (ncclComm_t)&small; /* overwritten: NULL at once, the handle at ncclGroupEnd */
    NCCLCHECK(ncclCommShrink(comms[g], &ex, 1, &small[ns], &blk, NCCL_SHRINK_DEFAULT));
    ASSERT(small[ns] == NULL, "shrink in a group wrote a handle before ncclGroupEnd");
    sg[ns++] = grank(g);
  }
  NCCLCHECK(ncclGroupEnd());
  for (int j = 0; j < ns; j++) expect(small[j], N - 1, sg[j], "shrunk in a group");
  check_random_sum(small, ns, 2, "shrunk in a group");

  /* 2. Blocking grow back to N ranks in one group; process 0 holds the new
   *    rank N-1 as well. */
  ncclUniqueId gid;
  if (g_rank == 0) NCCLCHECK(ncclCommGetUniqueId(small[0], &gid));
  ncclComm_t grown[G + 1];
  int gr[G + 1], ng = 0;
  NCCLCHECK(ncclGroupStart());
  for (int j = 0; j < ns; j++) {
    NCCLCHECK(ncclCommGrow(small[j], N, g_rank == 0 && j == 0 ? &gid : NULL, -1, &grown[ng], &blk));
    ASSERT(grown[ng] == NULL, "grow in a group wrote a handle before ncclGroupEnd");
    gr[ng++] = sg[j];
  }
  if (g_rank == 0) {
    NCCLCHECK(ncclCommGrow(NULL, N, &gid, N - 1, &grown[ng], &blk));
    gr[ng++] = N - 1;
  }
  NCCLCHECK(ncclGroupEnd());
  for (int j = 0; j < ng; j++) expect(grown[j], N, gr[j], "grown in a group");
  check_random_sum(grown, ng, 3, "grown in a group");

  /* 3. Non-blocking shrink without the new rank, in one group. */
  ncclComm_t small2[G];
  int s2g[G], ns2 = 0;
  NCCLCHECK(ncclGroupStart());
  for (int j = 0; j < ng; j++) {
    if (gr[j] == ex) continue;
    NCCLCHECK(ncclCommShrink(grown[j], &ex, 1, &small2[ns2], &nb, NCCL_SHRINK_DEFAULT));
    s2g[ns2++] = gr[j];
  }
  ncclResult_t r = ncclGroupEnd();
  ASSERT(r == ncclSuccess || r == ncclInProgress, "non-blocking shrink group: %d (%s)", (int)r,
         ncclGetLastError(NULL));
  for (int j = 0; j < ns2; j++) {
    ASSERT(small2[j] != NULL, "non-blocking shrink in a group: no handle after ncclGroupEnd");
    wait_comm(small2[j]);
    expect(small2[j], N - 1, s2g[j], "non-blocking shrink in a group");
  }
  check_random_sum(small2, ns2, 4, "non-blocking shrink in a group");

  /* 4. Revoke the grown communicator on every rank, then split it by parity
   *    in one group (NCCL allows split after revoke). */
  for (int j = 0; j < ng; j++) {
    ncclResult_t rv = ncclCommRevoke(grown[j], NCCL_REVOKE_DEFAULT);
    ASSERT(rv == ncclSuccess || rv == ncclInProgress, "revoke: %d (%s)", (int)rv,
           ncclGetLastError(grown[j]));
  }
  for (int j = 0; j < ng; j++) {
    ncclResult_t st = ncclInProgress;
    for (long i = 0; i < 100000000L && st == ncclInProgress; i++)
      NCCLCHECK(ncclCommGetAsyncError(grown[j], &st));
    ASSERT(st == ncclSuccess, "revoked async error %d", (int)st);
  }
  ncclComm_t half[G + 1];
  NCCLCHECK(ncclGroupStart());
  for (int j = 0; j < ng; j++) NCCLCHECK(ncclCommSplit(grown[j], gr[j] % 2, gr[j], &half[j], &blk));
  NCCLCHECK(ncclGroupEnd());
  for (int j = 0; j < ng; j++) expect(half[j], N / 2, gr[j] / 2, "split after revoke in a group");
  check_random_sum(half, ng, 5, "split after revoke in a group");

  for (int j = 0; j < ng; j++) NCCLCHECK(ncclCommDestroy(half[j]));
  for (int j = 0; j < ns2; j++) NCCLCHECK(ncclCommDestroy(small2[j]));
  for (int j = 0; j < ng; j++) NCCLCHECK(ncclCommDestroy(grown[j]));
  for (int j = 0; j < ns; j++) NCCLCHECK(ncclCommDestroy(small[j]));
  for (int g = 0; g < G; g++) NCCLCHECK(ncclCommDestroy(comms[g]));
  printf("rank %d: group_reconf ok\n", g_rank);
  return 0;
}
