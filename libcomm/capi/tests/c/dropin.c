/* A program written for NVIDIA's NCCL, nothing Weft-specific: it includes
 * <nccl.h>, links with plain -lnccl, and finds libnccl.so.2 at run time the
 * usual way (LD_LIBRARY_PATH). With RANK/WORLD_SIZE set (any launcher) it
 * runs one rank per process from ncclGetUniqueId + NCCL_COMM_ID; otherwise
 * it creates two ranks in-process with ncclCommInitAll. */
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>

#define NCCLCHECK(cmd)                                                            \
  do {                                                                            \
    ncclResult_t r = cmd;                                                         \
    if (r != ncclSuccess) {                                                       \
      printf("Failed, NCCL error %s:%d '%s'\n", __FILE__, __LINE__, ncclGetErrorString(r)); \
      exit(EXIT_FAILURE);                                                         \
    }                                                                             \
  } while (0)

int main(void) {
  int version;
  NCCLCHECK(ncclGetVersion(&version));
  const char* rs = getenv("RANK");
  const char* ws = getenv("WORLD_SIZE");
  float buf[256];
  if (rs && ws) {
    int rank = atoi(rs), nranks = atoi(ws);
    ncclUniqueId id;
    ncclComm_t comm;
    NCCLCHECK(ncclGetUniqueId(&id));
    NCCLCHECK(ncclCommInitRank(&comm, nranks, id, rank));
    for (int i = 0; i < 256; i++) buf[i] = (float)rank;
    NCCLCHECK(ncclAllReduce(buf, buf, 256, ncclFloat, ncclSum, comm, NULL));
    for (int i = 0; i < 256; i++)
      if (buf[i] != nranks * (nranks - 1) / 2.0f) { printf("wrong result\n"); return 1; }
    NCCLCHECK(ncclCommDestroy(comm));
  } else {
    ncclComm_t comms[2];
    float b2[2][256];
    NCCLCHECK(ncclCommInitAll(comms, 2, NULL));
    NCCLCHECK(ncclGroupStart());
    for (int d = 0; d < 2; d++) {
      for (int i = 0; i < 256; i++) b2[d][i] = (float)(d + 1);
      NCCLCHECK(ncclAllReduce(b2[d], b2[d], 256, ncclFloat, ncclSum, comms[d], NULL));
    }
    NCCLCHECK(ncclGroupEnd());
    for (int d = 0; d < 2; d++)
      for (int i = 0; i < 256; i++)
        if (b2[d][i] != 3.0f) { printf("wrong result\n"); return 1; }
    for (int d = 0; d < 2; d++) NCCLCHECK(ncclCommDestroy(comms[d]));
  }
  printf("dropin ok (NCCL version code %d)\n", version);
  return 0;
}
