/* The functions Weft exports for compatibility with newer NCCL but does not
 * implement yet (one process, host mode): each returns ncclInvalidUsage, names
 * itself in ncclGetLastError and writes no output; windows come back NULL so
 * callers fall back; nccl<Collective>Config with a NULL or hints-only config
 * is the plain collective. The device API's team helpers (declared in NCCL's
 * nccl_device headers, not nccl.h) return an empty team. */
#include "common.h"

typedef struct {
  int nRanks, rank, stride;
} team_t; /* NCCL's struct ncclTeam */
team_t ncclTeamWorld(ncclComm_t comm);
int ncclTeamRankToWorld(ncclComm_t comm, team_t team, int rank);
ncclResult_t ncclDevCommCreate(ncclComm_t comm, const void* reqs, void* outDevComm);
ncclResult_t pncclDevCommDestroy(ncclComm_t comm, const void* devComm);

#define UNSUPPORTED(call, name) EXPECT_ERR(call, ncclInvalidUsage, name ": not supported by Weft yet")

int main(void) {
  ncclComm_t comm;
  NCCLCHECK(ncclCommInitAll(&comm, 1, NULL));

  /* Windows: NULL window, success; deregistering NULL succeeds. */
  float buf[4] = {1, 2, 3, 4}, out[4] = {0};
  ncclWindow_t win = (ncclWindow_t)(uintptr_t)0x1234;
  NCCLCHECK(ncclCommWindowRegister(comm, buf, sizeof buf, &win, NCCL_WIN_COLL_SYMMETRIC));
  ASSERT(win == NULL, "window %p, expected NULL", (void*)win);
  ASSERT(strstr(ncclGetLastError(comm), "NULL window") != NULL, "last error: %s", ncclGetLastError(comm));
  NCCLCHECK(ncclCommWindowDeregister(comm, NULL));
  NCCLCHECK(pncclCommWindowDeregister(comm, win));
  EXPECT_ERR(ncclCommWindowDeregister(comm, (ncclWindow_t)(uintptr_t)0x1234), ncclInvalidArgument,
             "not registered by Weft");
  EXPECT_ERR(ncclCommWindowRegister(comm, buf, sizeof buf, NULL, 0), ncclInvalidArgument, "win is NULL");

  /* Unsupported: exact code, named in the last error, outputs untouched. */
  UNSUPPORTED(ncclCommSuspend(comm, NCCL_SUSPEND_MEM), "ncclCommSuspend");
  UNSUPPORTED(ncclCommResume(comm), "ncclCommResume");
  uint64_t stat = 77;
  UNSUPPORTED(ncclCommMemStats(comm, ncclStatGpuMemTotal, &stat), "ncclCommMemStats");
  ASSERT(stat == 77, "ncclCommMemStats wrote its output");
  void* user = (void*)buf;
  UNSUPPORTED(ncclWinGetUserPtr(comm, NULL, &user), "ncclWinGetUserPtr");
  ASSERT(user == (void*)buf, "ncclWinGetUserPtr wrote its output");
  UNSUPPORTED(ncclSignal(0, 0, 0, 0, comm, NULL), "ncclSignal");
  UNSUPPORTED(ncclPutSignal(buf, 4, ncclFloat32, 0, NULL, 0, 0, 0, 0, comm, NULL), "ncclPutSignal");
  ncclWaitSignalDesc_t desc = {1, 0, 0, 0};
  UNSUPPORTED(ncclWaitSignal(1, &desc, comm, NULL), "ncclWaitSignal");
  ncclEncryptionConfig_t enc = NCCL_ENCRYPTION_CONFIG_INITIALIZER;
  UNSUPPORTED(ncclSetEncryption(&enc), "ncclSetEncryption");
  ncclParamHandle_t ph = NULL;
  UNSUPPORTED(ncclParamBind(&ph, "NCCL_DEBUG"), "ncclParamBind");
  ASSERT(ph == NULL, "ncclParamBind wrote its output");
  const char* value = NULL;
  int len = -3;
  UNSUPPORTED(ncclParamGetParameter("NCCL_DEBUG", &value, &len), "ncclParamGetParameter");
  ASSERT(value == NULL && len == -3, "ncclParamGetParameter wrote its output");
  UNSUPPORTED(ncclDevCommCreate(comm, NULL, NULL), "ncclDevCommCreate");
  UNSUPPORTED(pncclDevCommDestroy(comm, NULL), "ncclDevCommDestroy");
  ncclParamDumpAll();
  ASSERT(strstr(ncclGetLastError(NULL), "ncclParamDumpAll: not supported by Weft yet"), "%s",
         ncclGetLastError(NULL));
  ncclResetDebugInit();

  /* Device-API team helpers: an empty team, -1 ranks, last error set. */
  team_t t = ncclTeamWorld(comm);
  ASSERT(t.nRanks == 0 && t.rank == 0 && t.stride == 0, "team {%d,%d,%d}", t.nRanks, t.rank, t.stride);
  ASSERT(strstr(ncclGetLastError(NULL), "ncclTeamWorld: not supported by Weft yet"), "%s", ncclGetLastError(NULL));
  ASSERT(ncclTeamRankToWorld(comm, t, 0) == -1, "ncclTeamRankToWorld");

  /* nccl<Collective>Config: NULL and hints-only configs run the collective. */
  NCCLCHECK(ncclAllReduceConfig(buf, out, 4, ncclFloat32, ncclSum, comm, NULL, NULL));
  ASSERT(out[0] == 1 && out[3] == 4, "allreduce(config NULL) gave %g..%g", out[0], out[3]);
  ncclCollConfig_t cfg = NCCL_COLLCONFIG_INITIALIZER;
  cfg.maxCTAs = 4;
  cfg.userProfilerTag = 9;
  memset(out, 0, sizeof out);
  NCCLCHECK(pncclAllGatherConfig(buf, out, 4, ncclFloat32, comm, NULL, &cfg));
  ASSERT(out[0] == 1 && out[3] == 4, "allgather(config hints) gave %g..%g", out[0], out[3]);
  cfg.algSelection = "ring";
  EXPECT_ERR(ncclBroadcastConfig(buf, out, 4, ncclFloat32, 0, comm, NULL, &cfg), ncclInvalidUsage,
             "ncclBroadcastConfig: config.algSelection is not supported by Weft yet");
  cfg.algSelection = NULL;
  cfg.magic = 1;
  EXPECT_ERR(ncclReduceConfig(buf, out, 4, ncclFloat32, ncclSum, 0, comm, NULL, &cfg), ncclInvalidArgument,
             "NCCL_COLLCONFIG_INITIALIZER");
  /* Plain errors pass through the Config variant. */
  EXPECT_ERR(ncclAllReduceConfig(buf, out, 4, (ncclDataType_t)99, ncclSum, comm, NULL, NULL), ncclInvalidArgument,
             "ncclAllReduce");

  NCCLCHECK(ncclCommDestroy(comm));
  printf("unsupported ok\n");
  return 0;
}
