/*
 * Weft's NCCL-compatible C API (libnccl.so.2 built from libcomm/capi).
 *
 * Written for Weft; ABI-compatible with NCCL 2.28's public header: the same
 * function names and signatures, the same enum values, the same struct layouts
 * (ncclUniqueId of 128 bytes, ncclConfig_t v22800, ncclSimInfo_t v22200).
 * Layout facts were checked against NCCL's public header template
 * (https://github.com/NVIDIA/nccl, src/nccl.h.in, 2.28 series).
 *
 * Host mode: without a GPU, every buffer is host memory and `stream` may be
 * NULL. Every function is also exported as p<name> (profiling interposition).
 */
#ifndef NCCL_H_
#define NCCL_H_

#include <limits.h>
#include <stddef.h>
#include <stdint.h>

#define NCCL_MAJOR 2
#define NCCL_MINOR 28
#define NCCL_PATCH 3
#define NCCL_SUFFIX ""

#define NCCL_VERSION_CODE 22803
#define NCCL_VERSION(X, Y, Z) \
  (((X) <= 2 && (Y) <= 8) ? (X) * 1000 + (Y) * 100 + (Z) : (X) * 10000 + (Y) * 100 + (Z))

/* The CUDA stream type, without requiring the CUDA headers. When a CUDA
 * runtime header was included first it already declared cudaStream_t as the
 * same pointer type, and we leave it alone. */
#if !defined(__CUDA_RUNTIME_H__) && !defined(__CUDA_RUNTIME_API_H__) && !defined(__DRIVER_TYPES_H__)
typedef struct CUstream_st* cudaStream_t;
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Opaque communicator handle. In Weft it is a checked handle (registry index
 * and generation), never a pointer: do not dereference it. */
typedef struct ncclComm* ncclComm_t;
typedef struct ncclWindow_vidmem* ncclWindow_t;
#define NCCL_COMM_NULL NULL

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
  /* NCCL 2.29+. Weft reports 2.28 and returns ncclRemoteError for a peer
   * that stops answering within the timeout (the message says "timed out"),
   * so programs built against 2.28 headers see only codes they know. */
  ncclTimeout = 8,
  ncclNumResults = 9
} ncclResult_t;

#define NCCL_CONFIG_UNDEF_INT INT_MIN
#define NCCL_CONFIG_UNDEF_PTR NULL
#define NCCL_SPLIT_NOCOLOR -1
#define NCCL_UNDEF_FLOAT -1.0f

/* Magic of ncclConfig_t. */
#define NCCL_API_MAGIC 0xcafebeef

/* Window registration flags. Weft has no symmetric-memory windows yet:
 * ncclCommWindowRegister returns a NULL window (see the README). */
#define NCCL_WIN_DEFAULT 0x00
#define NCCL_WIN_COLL_SYMMETRIC 0x01
#define NCCL_WIN_STRICT_ORDERING 0x02
#define NCCL_WIN_GIN_ONLY 0x04
#define NCCL_WIN_CFT_COUNTED 0x08
#define NCCL_WIN_REQUIRED_ALIGNMENT 4096

#define NCCL_CTA_POLICY_DEFAULT 0x00
#define NCCL_CTA_POLICY_EFFICIENCY 0x01
#define NCCL_CTA_POLICY_ZERO 0x02

/* ncclCommShrink flags. */
#define NCCL_SHRINK_DEFAULT 0x00
#define NCCL_SHRINK_ABORT 0x01

/* ncclCommRevoke flags. */
#define NCCL_REVOKE_DEFAULT 0x00

/* ncclCommSuspend flags. */
#define NCCL_SUSPEND_MEM 0x01

/* Communicator configuration (layout of NCCL 2.28, version 22800). Older,
 * smaller versions of this struct are accepted: only `size` bytes are read. */
typedef struct ncclConfig_v22800 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char* netName;
  int splitShare;
  int trafficClass;
  const char* commName;
  int collnetEnable;
  int CTAPolicy;
  int shrinkShare;
  int nvlsCTAs;
  int nChannelsPerNetPeer;
  int nvlinkCentricSched;
} ncclConfig_t;

#define NCCL_CONFIG_INITIALIZER {                                  \
  sizeof(ncclConfig_t),  /* size */                                \
  NCCL_API_MAGIC,        /* magic */                               \
  NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH), /* version */  \
  NCCL_CONFIG_UNDEF_INT, /* blocking */                            \
  NCCL_CONFIG_UNDEF_INT, /* cgaClusterSize */                      \
  NCCL_CONFIG_UNDEF_INT, /* minCTAs */                             \
  NCCL_CONFIG_UNDEF_INT, /* maxCTAs */                             \
  NCCL_CONFIG_UNDEF_PTR, /* netName */                             \
  NCCL_CONFIG_UNDEF_INT, /* splitShare */                          \
  NCCL_CONFIG_UNDEF_INT, /* trafficClass */                        \
  NCCL_CONFIG_UNDEF_PTR, /* commName */                            \
  NCCL_CONFIG_UNDEF_INT, /* collnetEnable */                       \
  NCCL_CONFIG_UNDEF_INT, /* CTAPolicy */                           \
  NCCL_CONFIG_UNDEF_INT, /* shrinkShare */                         \
  NCCL_CONFIG_UNDEF_INT, /* nvlsCTAs */                            \
  NCCL_CONFIG_UNDEF_INT, /* nChannelsPerNetPeer */                 \
  NCCL_CONFIG_UNDEF_INT, /* nvlinkCentricSched */                  \
}

/* Filled by ncclGroupSimulateEnd. */
typedef struct ncclSimInfo_v22200 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  float estimatedTime; /* microseconds */
} ncclSimInfo_t;

#define NCCL_SIM_INFO_MAGIC 0x74685283
#define NCCL_SIM_INFO_INITIALIZER {                                \
  sizeof(ncclSimInfo_t), /* size */                                \
  NCCL_SIM_INFO_MAGIC,   /* magic */                               \
  NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH), /* version */  \
  NCCL_UNDEF_FLOAT       /* estimatedTime */                       \
}

/* Reduction operations. Values from ncclNumOps up are created per
 * communicator by ncclRedOpCreatePreMulSum. */
typedef enum { ncclNumOps_dummy = 5 } ncclRedOp_dummy_t;
typedef enum {
  ncclSum = 0,
  ncclProd = 1,
  ncclMax = 2,
  ncclMin = 3,
  ncclAvg = 4,
  ncclNumOps = 5,
  ncclMaxRedOp = 0x7fffffff >> (32 - 8 * sizeof(ncclRedOp_dummy_t))
} ncclRedOp_t;

typedef enum {
  ncclInt8 = 0,
  ncclChar = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclInt = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclHalf = 6,
  ncclFloat32 = 7,
  ncclFloat = 7,
  ncclFloat64 = 8,
  ncclDouble = 8,
  ncclBfloat16 = 9,
  ncclFloat8e4m3 = 10,
  ncclFloat8e5m2 = 11,
  ncclNumTypes = 12
} ncclDataType_t;

/* Where the scalar of ncclRedOpCreatePreMulSum lives. */
typedef enum {
  ncclScalarDevice = 0,        /* read when each collective runs */
  ncclScalarHostImmediate = 1  /* read before ncclRedOpCreatePreMulSum returns */
} ncclScalarResidence_t;

/* Per-collective configuration of the nccl<Collective>Config calls (NCCL
 * 2.32, v23200 layout). Weft ignores the tuning hints (CTA counts and policy,
 * profiler tag, vendor extensions); an algSelection or a
 * launchCompletionEvent gives ncclInvalidUsage (not supported yet). */
typedef struct ncclConfigExt {
  struct ncclConfigExt* next;
  struct {
    int vendorId;
    int optionId;
  } key;
  union {
    int i;
    const char* s;
    void* raw;
  } val;
} ncclConfigExt_t;

typedef struct ncclCollConfig_v23200 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  ncclConfigExt_t* ext;
  int minCTAs;
  int maxCTAs;
  int nvlsCTAs;
  int cgaClusterSize;
  const char* algSelection;
  int forceAlgSelection;
  int CTAPolicy;
  uint64_t userProfilerTag;
  struct CUevent_st* launchCompletionEvent; /* a cudaEvent_t */
} ncclCollConfig_t;

#define NCCL_COLLCONFIG_INITIALIZER {                              \
  sizeof(ncclCollConfig_t), /* size */                             \
  NCCL_API_MAGIC,           /* magic */                            \
  23200,                    /* version */                          \
  NCCL_CONFIG_UNDEF_PTR,    /* ext */                              \
  NCCL_CONFIG_UNDEF_INT,    /* minCTAs */                          \
  NCCL_CONFIG_UNDEF_INT,    /* maxCTAs */                          \
  NCCL_CONFIG_UNDEF_INT,    /* nvlsCTAs */                         \
  NCCL_CONFIG_UNDEF_INT,    /* cgaClusterSize */                   \
  NCCL_CONFIG_UNDEF_PTR,    /* algSelection */                     \
  1,                        /* forceAlgSelection */                \
  NCCL_CONFIG_UNDEF_INT,    /* CTAPolicy */                        \
  0,                        /* userProfilerTag */                  \
  NCCL_CONFIG_UNDEF_PTR,    /* launchCompletionEvent */            \
}

/* ncclCommMemStats (not supported by Weft yet). */
typedef enum {
  ncclStatGpuMemSuspend = 0,
  ncclStatGpuMemSuspended = 1,
  ncclStatGpuMemPersist = 2,
  ncclStatGpuMemTotal = 3
} ncclCommMemStat_t;

/* ncclWaitSignal (not supported by Weft yet). */
typedef struct {
  int opCnt;
  int peer;
  int sigIdx;
  int ctx;
} ncclWaitSignalDesc_t;

/* ncclSetEncryption (not supported by Weft yet; Weft authenticates its
 * bootstrap with WEFT_JOB_SECRET). */
typedef enum {
  NCCL_ENCRYPTION_MODE_NONE = 0,
  NCCL_ENCRYPTION_MODE_PSK = 1
} ncclEncryptionMode_t;

typedef struct ncclEncryptionConfig_v23200 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int mode;
  const char* psk;
} ncclEncryptionConfig_t;

#define NCCL_ENCRYPTION_CONFIG_INITIALIZER {                       \
  sizeof(ncclEncryptionConfig_t), /* size */                       \
  NCCL_API_MAGIC,                 /* magic */                      \
  23200,                          /* version */                    \
  NCCL_ENCRYPTION_MODE_NONE,      /* mode */                       \
  NCCL_CONFIG_UNDEF_PTR,          /* psk */                        \
}

/* Parameter access handle (ncclParam*: not supported by Weft yet). */
typedef struct ncclParamHandle* ncclParamHandle_t;

/* Declares f and its profiling twin pf with the same signature. */
#define WEFT_NCCL_API(ret, name, args) ret name args; ret p##name args

/* Memory: page-aligned host memory in host mode. */
WEFT_NCCL_API(ncclResult_t, ncclMemAlloc, (void** ptr, size_t size));
WEFT_NCCL_API(ncclResult_t, ncclMemFree, (void* ptr));

WEFT_NCCL_API(ncclResult_t, ncclGetVersion, (int* version));
/* With NCCL_COMM_ID (or WEFT_BOOTSTRAP) set, every rank gets the same id and
 * rank 0 serves the bootstrap at that address. */
WEFT_NCCL_API(ncclResult_t, ncclGetUniqueId, (ncclUniqueId * uniqueId));

WEFT_NCCL_API(ncclResult_t, ncclCommInitRankConfig,
              (ncclComm_t * comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t* config));
WEFT_NCCL_API(ncclResult_t, ncclCommInitRank, (ncclComm_t * comm, int nranks, ncclUniqueId commId, int rank));
WEFT_NCCL_API(ncclResult_t, ncclCommInitAll, (ncclComm_t * comm, int ndev, const int* devlist));
WEFT_NCCL_API(ncclResult_t, ncclCommInitRankScalable,
              (ncclComm_t * newcomm, int nranks, int myrank, int nId, ncclUniqueId* commIds,
               ncclConfig_t* config));
WEFT_NCCL_API(ncclResult_t, ncclCommFinalize, (ncclComm_t comm));
WEFT_NCCL_API(ncclResult_t, ncclCommDestroy, (ncclComm_t comm));
WEFT_NCCL_API(ncclResult_t, ncclCommAbort, (ncclComm_t comm));
WEFT_NCCL_API(ncclResult_t, ncclCommSplit,
              (ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config));
/* Called by the survivors only (excluded ranks never call it); survivors are
 * renumbered in order. NCCL_SHRINK_ABORT revokes the parent first. */
WEFT_NCCL_API(ncclResult_t, ncclCommShrink,
              (ncclComm_t comm, int* excludeRanksList, int excludeRanksCount, ncclComm_t* newcomm,
               ncclConfig_t* config, int shrinkFlags));
/* Stops in-flight operations on every rank; ncclInProgress until quiescent,
 * then only split, shrink and destroy are allowed. revokeFlags must be 0. */
WEFT_NCCL_API(ncclResult_t, ncclCommRevoke, (ncclComm_t comm, int revokeFlags));
/* Grow: the existing root calls ncclCommGetUniqueId, then every existing rank
 * ncclCommGrow(comm, nRanks, root ? &id : NULL, -1, ...); new ranks
 * ncclCommGrow(NULL, nRanks, &id, rank, ...). */
WEFT_NCCL_API(ncclResult_t, ncclCommGetUniqueId, (ncclComm_t comm, ncclUniqueId * uniqueId));
WEFT_NCCL_API(ncclResult_t, ncclCommGrow,
              (ncclComm_t comm, int nRanks, const ncclUniqueId* uniqueId, int rank, ncclComm_t* newcomm,
               ncclConfig_t* config));

WEFT_NCCL_API(const char*, ncclGetErrorString, (ncclResult_t result));
WEFT_NCCL_API(const char*, ncclGetLastError, (ncclComm_t comm));

WEFT_NCCL_API(ncclResult_t, ncclCommGetAsyncError, (ncclComm_t comm, ncclResult_t * asyncError));
WEFT_NCCL_API(ncclResult_t, ncclCommCount, (const ncclComm_t comm, int* count));
/* Host mode: no CUDA device, returns ncclInvalidUsage. */
WEFT_NCCL_API(ncclResult_t, ncclCommCuDevice, (const ncclComm_t comm, int* device));
WEFT_NCCL_API(ncclResult_t, ncclCommUserRank, (const ncclComm_t comm, int* rank));

WEFT_NCCL_API(ncclResult_t, ncclCommRegister, (const ncclComm_t comm, void* buff, size_t size, void** handle));
WEFT_NCCL_API(ncclResult_t, ncclCommDeregister, (const ncclComm_t comm, void* handle));

WEFT_NCCL_API(ncclResult_t, ncclRedOpCreatePreMulSum,
              (ncclRedOp_t * op, void* scalar, ncclDataType_t datatype, ncclScalarResidence_t residence,
               ncclComm_t comm));
WEFT_NCCL_API(ncclResult_t, ncclRedOpDestroy, (ncclRedOp_t op, ncclComm_t comm));

WEFT_NCCL_API(ncclResult_t, ncclReduce,
              (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
               int root, ncclComm_t comm, cudaStream_t stream));
WEFT_NCCL_API(ncclResult_t, ncclBcast,
              (void* buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
               cudaStream_t stream));
WEFT_NCCL_API(ncclResult_t, ncclBroadcast,
              (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
               ncclComm_t comm, cudaStream_t stream));
WEFT_NCCL_API(ncclResult_t, ncclAllReduce,
              (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
               ncclComm_t comm, cudaStream_t stream));
WEFT_NCCL_API(ncclResult_t, ncclReduceScatter,
              (const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype,
               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream));
WEFT_NCCL_API(ncclResult_t, ncclAllGather,
              (const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
               ncclComm_t comm, cudaStream_t stream));
WEFT_NCCL_API(ncclResult_t, ncclAlltoAll,
              (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclComm_t comm,
               cudaStream_t stream));
WEFT_NCCL_API(ncclResult_t, ncclGather,
              (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
               ncclComm_t comm, cudaStream_t stream));
WEFT_NCCL_API(ncclResult_t, ncclScatter,
              (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
               ncclComm_t comm, cudaStream_t stream));
WEFT_NCCL_API(ncclResult_t, ncclSend,
              (const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
               cudaStream_t stream));
WEFT_NCCL_API(ncclResult_t, ncclRecv,
              (void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
               cudaStream_t stream));

WEFT_NCCL_API(ncclResult_t, ncclGroupStart, (void));
WEFT_NCCL_API(ncclResult_t, ncclGroupEnd, (void));
WEFT_NCCL_API(ncclResult_t, ncclGroupSimulateEnd, (ncclSimInfo_t * simInfo));

/* The nccl<Collective>Config variants: the plain collective when config is
 * NULL or holds only tuning hints. */
WEFT_NCCL_API(ncclResult_t, ncclAllReduceConfig,
              (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
               ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config));
WEFT_NCCL_API(ncclResult_t, ncclBroadcastConfig,
              (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
               ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config));
WEFT_NCCL_API(ncclResult_t, ncclReduceConfig,
              (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
               int root, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config));
WEFT_NCCL_API(ncclResult_t, ncclAllGatherConfig,
              (const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
               ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config));
WEFT_NCCL_API(ncclResult_t, ncclReduceScatterConfig,
              (const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype,
               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config));
WEFT_NCCL_API(ncclResult_t, ncclAlltoAllConfig,
              (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclComm_t comm,
               cudaStream_t stream, const ncclCollConfig_t* config));
WEFT_NCCL_API(ncclResult_t, ncclGatherConfig,
              (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
               ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config));
WEFT_NCCL_API(ncclResult_t, ncclScatterConfig,
              (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
               ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config));

/* Symmetric-memory windows: Weft has none yet. ncclCommWindowRegister sets
 * *win = NULL and returns ncclSuccess (as NCCL does where symmetric memory is
 * unavailable), so callers fall back; ncclCommWindowDeregister(comm, NULL)
 * succeeds. */
WEFT_NCCL_API(ncclResult_t, ncclCommWindowRegister,
              (ncclComm_t comm, void* buff, size_t size, ncclWindow_t* win, int winFlags));
WEFT_NCCL_API(ncclResult_t, ncclCommWindowDeregister, (ncclComm_t comm, ncclWindow_t win));

/* Exported for compatibility, NOT SUPPORTED by Weft yet: each returns
 * ncclInvalidUsage, sets ncclGetLastError and writes no output argument. */
WEFT_NCCL_API(ncclResult_t, ncclWinGetUserPtr, (ncclComm_t comm, ncclWindow_t win, void** outUserPtr));
WEFT_NCCL_API(ncclResult_t, ncclCommSuspend, (ncclComm_t comm, int flags));
WEFT_NCCL_API(ncclResult_t, ncclCommResume, (ncclComm_t comm));
WEFT_NCCL_API(ncclResult_t, ncclCommMemStats, (ncclComm_t comm, ncclCommMemStat_t stat, uint64_t* value));
WEFT_NCCL_API(ncclResult_t, ncclPutSignal,
              (const void* localbuff, size_t count, ncclDataType_t datatype, int peer, ncclWindow_t peerWin,
               size_t peerWinOffset, int sigIdx, int ctx, unsigned int flags, ncclComm_t comm,
               cudaStream_t stream));
WEFT_NCCL_API(ncclResult_t, ncclSignal,
              (int peer, int sigIdx, int ctx, unsigned int flags, ncclComm_t comm, cudaStream_t stream));
WEFT_NCCL_API(ncclResult_t, ncclWaitSignal,
              (int nDesc, ncclWaitSignalDesc_t* signalDescs, ncclComm_t comm, cudaStream_t stream));
WEFT_NCCL_API(ncclResult_t, ncclSetEncryption, (const ncclEncryptionConfig_t* config));
WEFT_NCCL_API(ncclResult_t, ncclParamBind, (ncclParamHandle_t * out, const char* key));
WEFT_NCCL_API(ncclResult_t, ncclParamGetI8, (ncclParamHandle_t h, int8_t* out));
WEFT_NCCL_API(ncclResult_t, ncclParamGetI16, (ncclParamHandle_t h, int16_t* out));
WEFT_NCCL_API(ncclResult_t, ncclParamGetI32, (ncclParamHandle_t h, int32_t* out));
WEFT_NCCL_API(ncclResult_t, ncclParamGetI64, (ncclParamHandle_t h, int64_t* out));
WEFT_NCCL_API(ncclResult_t, ncclParamGetU8, (ncclParamHandle_t h, uint8_t* out));
WEFT_NCCL_API(ncclResult_t, ncclParamGetU16, (ncclParamHandle_t h, uint16_t* out));
WEFT_NCCL_API(ncclResult_t, ncclParamGetU32, (ncclParamHandle_t h, uint32_t* out));
WEFT_NCCL_API(ncclResult_t, ncclParamGetU64, (ncclParamHandle_t h, uint64_t* out));
WEFT_NCCL_API(ncclResult_t, ncclParamGetStr, (ncclParamHandle_t h, const char** out));
WEFT_NCCL_API(ncclResult_t, ncclParamGet, (ncclParamHandle_t h, void* out, int maxLen, int* len));
WEFT_NCCL_API(ncclResult_t, ncclParamGetParameter, (const char* key, const char** value, int* valueLen));
WEFT_NCCL_API(ncclResult_t, ncclParamGetAllParameterKeys, (const char*** table, int* tableLen));
/* Not supported yet: prints nothing, sets ncclGetLastError. */
WEFT_NCCL_API(void, ncclParamDumpAll, (void));
/* Deprecated in NCCL; a no-op here (Weft reads NCCL_DEBUG/WEFT_DEBUG once). */
WEFT_NCCL_API(void, ncclResetDebugInit, (void));

#undef WEFT_NCCL_API

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* NCCL_H_ */
