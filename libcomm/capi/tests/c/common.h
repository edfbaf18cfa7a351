/* Shared helpers for Weft's C ABI tests (host mode, started by `weft run`). */
#ifndef WEFT_TEST_COMMON_H
#define WEFT_TEST_COMMON_H

#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_rank = 0;

#define FAILF(...)                                         \
  do {                                                     \
    fprintf(stderr, "[rank %d] FAIL %s:%d: ", g_rank,      \
            __FILE__, __LINE__);                           \
    fprintf(stderr, __VA_ARGS__);                          \
    fprintf(stderr, "\n");                                 \
    exit(1);                                               \
  } while (0)

/* A call that must succeed. */
#define NCCLCHECK(call)                                                      \
  do {                                                                       \
    ncclResult_t r_ = (call);                                                \
    if (r_ != ncclSuccess)                                                   \
      FAILF("%s returned %d (%s): %s", #call, (int)r_, ncclGetErrorString(r_), \
            ncclGetLastError(NULL));                                         \
  } while (0)

/* A call that must fail with exactly `code`, and whose last error mentions `word`. */
#define EXPECT_ERR(call, code, word)                                              \
  do {                                                                            \
    ncclResult_t r_ = (call);                                                     \
    const char* m_ = ncclGetLastError(NULL);                                      \
    if (r_ != (code))                                                             \
      FAILF("%s returned %d, expected %d (last error: %s)", #call, (int)r_,       \
            (int)(code), m_);                                                     \
    if (m_ == NULL || strstr(m_, (word)) == NULL)                                 \
      FAILF("%s: last error \"%s\" does not mention \"%s\"", #call,               \
            m_ ? m_ : "(null)", (word));                                          \
  } while (0)

#define ASSERT(cond, ...)              \
  do {                                 \
    if (!(cond)) FAILF(__VA_ARGS__);   \
  } while (0)

static inline int env_int(const char* a, const char* b, int dflt) {
  const char* v = getenv(a);
  if (!v) v = getenv(b);
  return v ? atoi(v) : dflt;
}

/* Waits for a non-blocking communicator: polls ncclCommGetAsyncError. */
static inline void wait_comm(ncclComm_t comm) {
  ncclResult_t st = ncclInProgress;
  long polls = 0;
  while (st == ncclInProgress) {
    NCCLCHECK(ncclCommGetAsyncError(comm, &st));
    if (++polls > 200000000L) FAILF("communicator never left ncclInProgress");
  }
  if (st != ncclSuccess)
    FAILF("async error %d (%s): %s", (int)st, ncclGetErrorString(st), ncclGetLastError(comm));
}

#endif
