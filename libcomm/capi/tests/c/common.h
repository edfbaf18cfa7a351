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

/* A deterministic pseudo-random int32 in [-1000, 1000] for rank q, element i. */
static inline int rand_val(unsigned seed, int q, int i) {
  unsigned long long z = (unsigned long long)seed * 0x9e3779b97f4a7c15ULL +
                         (unsigned long long)q * 0xbf58476d1ce4e5b9ULL + (unsigned long long)i;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return (int)(z % 2001) - 1000;
}

#define RAND_COUNT 3001

/* Sum all-reduces of random data (rand_val of each rank of its communicator)
 * on cs[0..k), in one group when k > 1 (one thread may hold several ranks of
 * one communicator), each checked against the sum computed here. */
static inline void check_random_sum(ncclComm_t* cs, int k, unsigned seed, const char* what) {
  enum { MAXC = 4 };
  static int in[MAXC][RAND_COUNT], out[MAXC][RAND_COUNT];
  int n[MAXC], me[MAXC];
  if (k > MAXC) FAILF("%s: at most %d communicators", what, MAXC);
  for (int j = 0; j < k; j++) {
    NCCLCHECK(ncclCommCount(cs[j], &n[j]));
    NCCLCHECK(ncclCommUserRank(cs[j], &me[j]));
    for (int i = 0; i < RAND_COUNT; i++) {
      in[j][i] = rand_val(seed, me[j], i);
      out[j][i] = 0;
    }
  }
  if (k > 1) NCCLCHECK(ncclGroupStart());
  for (int j = 0; j < k; j++)
    NCCLCHECK(ncclAllReduce(in[j], out[j], RAND_COUNT, ncclInt32, ncclSum, cs[j], NULL));
  if (k > 1) NCCLCHECK(ncclGroupEnd());
  for (int j = 0; j < k; j++)
    for (int i = 0; i < RAND_COUNT; i++) {
      int want = 0;
      for (int q = 0; q < n[j]; q++) want += rand_val(seed, q, i);
      if (out[j][i] != want)
        FAILF("%s: communicator %d (rank %d of %d) element %d: %d, want %d", what, j, me[j], n[j], i,
              out[j][i], want);
    }
}

#endif
