/* Checks that our nccl.h has NCCL 2.28's ABI: sizes, offsets, enum values,
 * initializers, and that the library reports the same version. */
#include <stddef.h>
#include "common.h"

#define SA(cond) _Static_assert(cond, #cond)

SA(sizeof(ncclUniqueId) == 128);
SA(NCCL_UNIQUE_ID_BYTES == 128);
SA(sizeof(ncclComm_t) == sizeof(void*));
SA(sizeof(ncclResult_t) == 4 && sizeof(ncclDataType_t) == 4 && sizeof(ncclRedOp_t) == 4);

SA(ncclSuccess == 0 && ncclUnhandledCudaError == 1 && ncclSystemError == 2 &&
   ncclInternalError == 3 && ncclInvalidArgument == 4 && ncclInvalidUsage == 5 &&
   ncclRemoteError == 6 && ncclInProgress == 7 && ncclTimeout == 8 &&
   ncclNumResults == 9);

SA(ncclInt8 == 0 && ncclChar == 0 && ncclUint8 == 1 && ncclInt32 == 2 && ncclInt == 2 &&
   ncclUint32 == 3 && ncclInt64 == 4 && ncclUint64 == 5 && ncclFloat16 == 6 && ncclHalf == 6 &&
   ncclFloat32 == 7 && ncclFloat == 7 && ncclFloat64 == 8 && ncclDouble == 8 &&
   ncclBfloat16 == 9 && ncclFloat8e4m3 == 10 && ncclFloat8e5m2 == 11 && ncclNumTypes == 12);

SA(ncclSum == 0 && ncclProd == 1 && ncclMax == 2 && ncclMin == 3 && ncclAvg == 4 &&
   ncclNumOps == 5 && ncclMaxRedOp == 0x7fffffff);
SA(ncclScalarDevice == 0 && ncclScalarHostImmediate == 1);

SA(NCCL_SPLIT_NOCOLOR == -1);
SA(NCCL_VERSION_CODE == 22803);
SA(NCCL_VERSION(2, 28, 3) == 22803);
SA(NCCL_MAJOR == 2 && NCCL_MINOR == 28);
SA(NCCL_CONFIG_UNDEF_INT == INT_MIN);
SA(NCCL_API_MAGIC == 0xcafebeef);
SA(NCCL_SHRINK_DEFAULT == 0 && NCCL_SHRINK_ABORT == 1);

/* ncclConfig_t v22800 on LP64. */
SA(offsetof(ncclConfig_t, size) == 0);
SA(offsetof(ncclConfig_t, magic) == 8);
SA(offsetof(ncclConfig_t, version) == 12);
SA(offsetof(ncclConfig_t, blocking) == 16);
SA(offsetof(ncclConfig_t, cgaClusterSize) == 20);
SA(offsetof(ncclConfig_t, minCTAs) == 24);
SA(offsetof(ncclConfig_t, maxCTAs) == 28);
SA(offsetof(ncclConfig_t, netName) == 32);
SA(offsetof(ncclConfig_t, splitShare) == 40);
SA(offsetof(ncclConfig_t, trafficClass) == 44);
SA(offsetof(ncclConfig_t, commName) == 48);
SA(offsetof(ncclConfig_t, collnetEnable) == 56);
SA(offsetof(ncclConfig_t, CTAPolicy) == 60);
SA(offsetof(ncclConfig_t, shrinkShare) == 64);
SA(offsetof(ncclConfig_t, nvlsCTAs) == 68);
SA(offsetof(ncclConfig_t, nChannelsPerNetPeer) == 72);
SA(offsetof(ncclConfig_t, nvlinkCentricSched) == 76);
SA(sizeof(ncclConfig_t) == 80);

SA(offsetof(ncclSimInfo_t, magic) == 8);
SA(offsetof(ncclSimInfo_t, version) == 12);
SA(offsetof(ncclSimInfo_t, estimatedTime) == 16);
SA(sizeof(ncclSimInfo_t) == 24);

int main(void) {
  ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
  ASSERT(c.size == sizeof(ncclConfig_t), "config size %zu", c.size);
  ASSERT(c.magic == 0xcafebeef, "config magic %x", c.magic);
  ASSERT(c.version == 22803, "config version %u", c.version);
  int* ints[] = {&c.blocking,   &c.cgaClusterSize, &c.minCTAs,   &c.maxCTAs,
                 &c.splitShare, &c.trafficClass,   &c.collnetEnable, &c.CTAPolicy,
                 &c.shrinkShare, &c.nvlsCTAs,      &c.nChannelsPerNetPeer, &c.nvlinkCentricSched};
  for (size_t i = 0; i < sizeof(ints) / sizeof(ints[0]); i++)
    ASSERT(*ints[i] == NCCL_CONFIG_UNDEF_INT, "config int field %zu is %d", i, *ints[i]);
  ASSERT(c.netName == NULL && c.commName == NULL, "config pointers not NULL");

  ncclSimInfo_t s = NCCL_SIM_INFO_INITIALIZER;
  ASSERT(s.size == sizeof(ncclSimInfo_t) && s.magic == 0x74685283 && s.version == 22803 &&
             s.estimatedTime == -1.0f,
         "sim info initializer");

  int v = 0;
  NCCLCHECK(ncclGetVersion(&v));
  ASSERT(v == NCCL_VERSION_CODE, "library version %d, header %d", v, NCCL_VERSION_CODE);
  NCCLCHECK(pncclGetVersion(&v));
  ASSERT(v == NCCL_VERSION_CODE, "pncclGetVersion %d", v);

  for (int r = 0; r <= ncclNumResults; r++) {
    const char* s1 = ncclGetErrorString((ncclResult_t)r);
    ASSERT(s1 != NULL && s1[0] != 0, "no error string for %d", r);
  }
  ASSERT(strcmp(ncclGetErrorString(ncclSuccess), "no error") == 0, "success string");
  ASSERT(strstr(ncclGetErrorString(ncclInProgress), "progress") != NULL, "in-progress string");
  printf("abi ok\n");
  return 0;
}
