/* Group semantics: one thread drives several ranks, as nccl-tests does.
 * Each process (of P started by weft run) creates G ranks of one
 * communicator of P*G ranks with ncclCommInitRank inside
 * ncclGroupStart/ncclGroupEnd, then runs collectives on all of them in one
 * group, send/recv rings in a group in both orders, a nested group, a
 * simulated group, splits inside a group, ncclCommInitRankScalable, and
 * ncclCommInitAll. */
#include "common.h"

#define G 2

static int P, N;
static ncclComm_t comms[G];

static int grank(int g) { return g_rank * G + g; }

static void allreduce_all(ncclComm_t* cs, int ncomm, int total, const char* what) {
  int vals[G * 2], sums[G * 2];
  NCCLCHECK(ncclGroupStart());
  for (int g = 0; g < ncomm; g++) {
    int r = -1;
    NCCLCHECK(ncclCommUserRank(cs[g], &r));
    vals[g] = r + 1;
    sums[g] = 0;
    NCCLCHECK(ncclAllReduce(&vals[g], &sums[g], 1, ncclInt32, ncclSum, cs[g], NULL));
  }
  NCCLCHECK(ncclGroupEnd());
  for (int g = 0; g < ncomm; g++)
    ASSERT(sums[g] == total * (total + 1) / 2, "%s: comm %d sum %d", what, g, sums[g]);
}

static void ring(int recv_first) {
  enum { C = 5000 };
  static float s[G][C], r[G][C];
  for (int g = 0; g < G; g++)
    for (int i = 0; i < C; i++) { s[g][i] = (float)(grank(g) * 10000 + i); r[g][i] = -1; }
  NCCLCHECK(ncclGroupStart());
  for (int g = 0; g < G; g++) {
    int me = grank(g), next = (me + 1) % N, prev = (me + N - 1) % N;
    if (recv_first) {
      NCCLCHECK(ncclRecv(r[g], C, ncclFloat32, prev, comms[g], NULL));
      NCCLCHECK(ncclSend(s[g], C, ncclFloat32, next, comms[g], NULL));
    } else {
      NCCLCHECK(ncclSend(s[g], C, ncclFloat32, next, comms[g], NULL));
      NCCLCHECK(ncclRecv(r[g], C, ncclFloat32, prev, comms[g], NULL));
    }
  }
  NCCLCHECK(ncclGroupEnd());
  for (int g = 0; g < G; g++) {
    int prev = (grank(g) + N - 1) % N;
    for (int i = 0; i < C; i++)
      ASSERT(r[g][i] == (float)(prev * 10000 + i), "ring(%d) comm %d elem %d: %f", recv_first, g, i, r[g][i]);
  }
}

int main(void) {
  g_rank = env_int("WEFT_RANK", "RANK", -1);
  P = env_int("WEFT_WORLD_SIZE", "WORLD_SIZE", -1);
  ASSERT(g_rank >= 0 && P > 0, "run me with weft run");
  N = P * G;
  ncclUniqueId id;
  NCCLCHECK(ncclGetUniqueId(&id));

  /* One thread, several ranks: init inside a group. */
  NCCLCHECK(ncclGroupStart());
  for (int g = 0; g < G; g++) NCCLCHECK(ncclCommInitRank(&comms[g], N, id, grank(g)));
  NCCLCHECK(ncclGroupEnd());
  for (int g = 0; g < G; g++) {
    int n, r;
    NCCLCHECK(ncclCommCount(comms[g], &n));
    NCCLCHECK(ncclCommUserRank(comms[g], &r));
    ASSERT(n == N && r == grank(g), "comm %d: count %d rank %d", g, n, r);
  }

  /* Collectives on several communicators in one group. */
  allreduce_all(comms, G, N, "group allreduce");

  /* Several collectives per communicator in one group, in order. */
  {
    enum { C = 1000 };
    static double b[G][C], gathered[G][C * 16];
    ASSERT(N <= 16, "too many ranks");
    for (int g = 0; g < G; g++)
      for (int i = 0; i < C; i++) b[g][i] = grank(g) == 1 ? i * 0.5 : -1;
    NCCLCHECK(ncclGroupStart());
    for (int g = 0; g < G; g++) {
      NCCLCHECK(ncclBroadcast(b[g], b[g], C, ncclFloat64, 1, comms[g], NULL));
      NCCLCHECK(ncclAllGather(b[g], gathered[g], C, ncclFloat64, comms[g], NULL));
    }
    NCCLCHECK(ncclGroupEnd());
    for (int g = 0; g < G; g++)
      for (int q = 0; q < N; q++)
        for (int i = 0; i < C; i++)
          ASSERT(gathered[g][q * C + i] == i * 0.5, "broadcast+allgather comm %d from %d elem %d", g, q, i);
  }

  /* Send/recv in a group, both orders. */
  ring(0);
  ring(1);

  /* Nested groups: only the outermost end runs them. */
  NCCLCHECK(ncclGroupStart());
  NCCLCHECK(ncclGroupStart());
  int v[G], s[G];
  for (int g = 0; g < G; g++) {
    v[g] = 1;
    s[g] = 0;
    NCCLCHECK(ncclAllReduce(&v[g], &s[g], 1, ncclInt32, ncclSum, comms[g], NULL));
  }
  NCCLCHECK(ncclGroupEnd());
  for (int g = 0; g < G; g++) ASSERT(s[g] == 0, "inner ncclGroupEnd ran the operations");
  NCCLCHECK(ncclGroupEnd());
  for (int g = 0; g < G; g++) ASSERT(s[g] == N, "nested group result %d", s[g]);

  /* Simulated group: an estimate, and nothing runs. */
  ncclSimInfo_t sim = NCCL_SIM_INFO_INITIALIZER;
  NCCLCHECK(ncclGroupStart());
  for (int g = 0; g < G; g++) {
    s[g] = -7;
    NCCLCHECK(ncclAllReduce(&v[g], &s[g], 1, ncclInt32, ncclSum, comms[g], NULL));
  }
  NCCLCHECK(ncclGroupSimulateEnd(&sim));
  ASSERT(sim.estimatedTime > 0, "estimatedTime %f", sim.estimatedTime);
  for (int g = 0; g < G; g++) ASSERT(s[g] == -7, "simulated group ran");

  /* Splits inside a group: even and odd global ranks. */
  ncclComm_t halves[G];
  NCCLCHECK(ncclGroupStart());
  for (int g = 0; g < G; g++) NCCLCHECK(ncclCommSplit(comms[g], grank(g) % 2, grank(g), &halves[g], NULL));
  NCCLCHECK(ncclGroupEnd());
  for (int g = 0; g < G; g++) {
    int n, r;
    NCCLCHECK(ncclCommCount(halves[g], &n));
    NCCLCHECK(ncclCommUserRank(halves[g], &r));
    ASSERT(n == N / 2 && r == grank(g) / 2, "half %d: count %d rank %d", g, n, r);
  }
  allreduce_all(halves, G, N / 2, "halves allreduce");
  for (int g = 0; g < G; g++) NCCLCHECK(ncclCommDestroy(halves[g]));

  for (int g = 0; g < G; g++) NCCLCHECK(ncclCommDestroy(comms[g]));

  /* ncclCommInitRankScalable with one id, inside a group, blocking config. */
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 1;
  cfg.commName = "scalable";
  NCCLCHECK(ncclGetUniqueId(&id));
  NCCLCHECK(ncclGroupStart());
  for (int g = 0; g < G; g++) NCCLCHECK(ncclCommInitRankScalable(&comms[g], N, grank(g), 1, &id, &cfg));
  NCCLCHECK(ncclGroupEnd());
  allreduce_all(comms, G, N, "scalable allreduce");
  for (int g = 0; g < G; g++) NCCLCHECK(ncclCommDestroy(comms[g]));

  /* Non-blocking inits inside a group: ncclGroupEnd may return ncclInProgress;
   * each communicator is then polled with ncclCommGetAsyncError. */
  {
    ncclConfig_t nb = NCCL_CONFIG_INITIALIZER;
    nb.blocking = 0;
    NCCLCHECK(ncclGetUniqueId(&id));
    NCCLCHECK(ncclGroupStart());
    for (int g = 0; g < G; g++) NCCLCHECK(ncclCommInitRankConfig(&comms[g], N, id, grank(g), &nb));
    ncclResult_t r = ncclGroupEnd();
    ASSERT(r == ncclSuccess || r == ncclInProgress, "non-blocking group init: %d %s", (int)r,
           ncclGetLastError(NULL));
    for (int g = 0; g < G; g++) wait_comm(comms[g]);
    allreduce_all(comms, G, N, "non-blocking group init allreduce");
    for (int g = 0; g < G; g++) NCCLCHECK(ncclCommDestroy(comms[g]));
  }

  /* ncclCommInitAll: G ranks in this process alone (host mode ignores devlist). */
  ncclComm_t all[G];
  int devs[G] = {0, 1};
  NCCLCHECK(ncclCommInitAll(all, G, devs));
  allreduce_all(all, G, G, "initall allreduce");
  for (int g = 0; g < G; g++) NCCLCHECK(ncclCommDestroy(all[g]));

  printf("rank %d: groups ok\n", g_rank);
  return 0;
}
