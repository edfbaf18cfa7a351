/* Every collective through the C ABI, on several types and ops, in place and
 * out of place, checked against a reference computed from the known inputs
 * of every rank. Started by `weft run -n N`: every rank calls ncclGetUniqueId
 * and gets the same id (NCCL_COMM_ID), so there is no out-of-band broadcast. */
#include <math.h>
#include <stdint.h>
#include "common.h"

static int nranks;
static ncclComm_t comm;

/* A profiling interposer, as tools do it: define ncclAllReduce, forward to
 * the library's pncclAllReduce. Every ncclAllReduce below goes through it. */
static int intercepted;
ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t c, cudaStream_t stream) {
  intercepted++;
  return pncclAllReduce(sendbuff, recvbuff, count, datatype, op, c, stream);
}

static size_t tsize(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    default: return 8;
  }
}
static int is_signed(ncclDataType_t t) { return t != ncclUint8 && t != ncclUint32 && t != ncclUint64; }
static int is_float(ncclDataType_t t) {
  return t == ncclFloat16 || t == ncclFloat32 || t == ncclFloat64 || t == ncclBfloat16;
}

static uint16_t f2h(float f) {
  uint32_t x; memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  if ((x & 0x7fffffff) == 0) return (uint16_t)sign;
  int e = (int)((x >> 23) & 0xff) - 127 + 15;
  uint32_t man = (x >> 13) & 0x3ff;
  if (e <= 0) return (uint16_t)sign;
  if (e >= 31) return (uint16_t)(sign | 0x7c00);
  return (uint16_t)(sign | ((uint32_t)e << 10) | man);
}
static float h2f(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  int e = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff, x;
  if (e == 0) { float f = ldexpf((float)man, -24); return sign ? -f : f; }
  if (e == 31) x = sign | 0x7f800000 | (man << 13);
  else x = sign | ((uint32_t)(e - 15 + 127) << 23) | (man << 13);
  float f; memcpy(&f, &x, 4); return f;
}
static uint16_t f2bf(float f) { uint32_t x; memcpy(&x, &f, 4); return (uint16_t)(x >> 16); }
static float bf2f(uint16_t b) { uint32_t x = (uint32_t)b << 16; float f; memcpy(&f, &x, 4); return f; }

static void setv(void* b, size_t i, ncclDataType_t t, double v) {
  switch (t) {
    case ncclInt8: ((int8_t*)b)[i] = (int8_t)v; break;
    case ncclUint8: ((uint8_t*)b)[i] = (uint8_t)v; break;
    case ncclInt32: ((int32_t*)b)[i] = (int32_t)v; break;
    case ncclUint32: ((uint32_t*)b)[i] = (uint32_t)v; break;
    case ncclInt64: ((int64_t*)b)[i] = (int64_t)v; break;
    case ncclUint64: ((uint64_t*)b)[i] = (uint64_t)v; break;
    case ncclFloat16: ((uint16_t*)b)[i] = f2h((float)v); break;
    case ncclBfloat16: ((uint16_t*)b)[i] = f2bf((float)v); break;
    case ncclFloat32: ((float*)b)[i] = (float)v; break;
    case ncclFloat64: ((double*)b)[i] = v; break;
    default: FAILF("type %d", (int)t);
  }
}
static double getv(const void* b, size_t i, ncclDataType_t t) {
  switch (t) {
    case ncclInt8: return ((const int8_t*)b)[i];
    case ncclUint8: return ((const uint8_t*)b)[i];
    case ncclInt32: return ((const int32_t*)b)[i];
    case ncclUint32: return ((const uint32_t*)b)[i];
    case ncclInt64: return (double)((const int64_t*)b)[i];
    case ncclUint64: return (double)((const uint64_t*)b)[i];
    case ncclFloat16: return h2f(((const uint16_t*)b)[i]);
    case ncclBfloat16: return bf2f(((const uint16_t*)b)[i]);
    case ncclFloat32: return ((const float*)b)[i];
    case ncclFloat64: return ((const double*)b)[i];
    default: FAILF("type %d", (int)t);
  }
  return 0;
}

/* Rank r's input element i (small integers: exact in every type). */
static double in(int r, size_t i, ncclDataType_t t, int op) {
  if (op == ncclProd) return 1 + (double)((r + i) % 2);
  double v = (double)((r + 1) * (int)(i % 5 + 1) + (int)(i % 3));
  if (is_signed(t) && i % 4 == 0) v = -v;
  return v;
}

static double scalar_of(int r) { return (double)(r + 1); }

/* The reduction of element i over all ranks. premul: op >= ncclNumOps with scalar rank+1. */
static double ref(size_t i, ncclDataType_t t, int op, double extra_scale) {
  double acc = 0;
  for (int r = 0; r < nranks; r++) {
    double v = in(r, i, t, op);
    if (r == 0) { acc = (op >= ncclNumOps) ? v * scalar_of(0) * extra_scale : v; continue; }
    switch (op) {
      case ncclSum: case ncclAvg: acc += v; break;
      case ncclProd: acc *= v; break;
      case ncclMax: acc = v > acc ? v : acc; break;
      case ncclMin: acc = v < acc ? v : acc; break;
      default: acc += v * scalar_of(r) * extra_scale; break;
    }
  }
  if (op == ncclAvg) acc /= nranks;
  return acc;
}

static void check(const char* what, double got, double want, ncclDataType_t t, size_t i) {
  double tol = 0;
  if (t == ncclFloat16 || t == ncclBfloat16) tol = 1e-2 * fmax(1.0, fabs(want));
  else if (t == ncclFloat32) tol = 1e-5 * fmax(1.0, fabs(want));
  else if (t == ncclFloat64) tol = 1e-12 * fmax(1.0, fabs(want));
  if (fabs(got - want) > tol)
    FAILF("%s type %d element %zu: got %g, expected %g", what, (int)t, i, got, want);
}

static void* buf(size_t count, ncclDataType_t t) {
  void* p = calloc(count ? count : 1, tsize(t));
  ASSERT(p, "out of memory");
  return p;
}

static void test_allreduce(ncclDataType_t t, int op, size_t count, int inplace, double extra) {
  int rank = g_rank;
  void* s = buf(count, t);
  void* r = inplace ? s : buf(count, t);
  int rop = op;
  for (size_t i = 0; i < count; i++) setv(s, i, t, in(rank, i, t, op));
  NCCLCHECK(ncclAllReduce(s, r, count, t, (ncclRedOp_t)rop, comm, NULL));
  for (size_t i = 0; i < count; i++) check("allreduce", getv(r, i, t), ref(i, t, op, extra), t, i);
  if (!inplace) free(r);
  free(s);
}

static void test_premulsum(ncclDataType_t t) {
  size_t count = 257;
  /* Host-immediate scalar: read at creation. */
  void* sc = buf(1, t);
  setv(sc, 0, t, scalar_of(g_rank));
  ncclRedOp_t op;
  NCCLCHECK(ncclRedOpCreatePreMulSum(&op, sc, t, ncclScalarHostImmediate, comm));
  ASSERT((int)op >= ncclNumOps, "premulsum op value %d", (int)op);
  setv(sc, 0, t, 100); /* must not matter: already read */
  void* s = buf(count, t), *r = buf(count, t);
  for (size_t i = 0; i < count; i++) setv(s, i, t, in(g_rank, i, t, ncclSum));
  NCCLCHECK(ncclAllReduce(s, r, count, t, op, comm, NULL));
  for (size_t i = 0; i < count; i++) check("premulsum", getv(r, i, t), ref(i, t, ncclNumOps, 1), t, i);
  NCCLCHECK(ncclRedOpDestroy(op, comm));
  /* "Device" scalar (host memory in host mode): read when each collective runs. */
  setv(sc, 0, t, scalar_of(g_rank));
  NCCLCHECK(ncclRedOpCreatePreMulSum(&op, sc, t, ncclScalarDevice, comm));
  setv(sc, 0, t, 2 * scalar_of(g_rank));
  NCCLCHECK(ncclAllReduce(s, r, count, t, op, comm, NULL));
  for (size_t i = 0; i < count; i++) check("premulsum(device)", getv(r, i, t), ref(i, t, ncclNumOps, 2), t, i);
  NCCLCHECK(ncclReduce(s, r, count, t, op, 0, comm, NULL));
  if (g_rank == 0)
    for (size_t i = 0; i < count; i++) check("reduce premulsum", getv(r, i, t), ref(i, t, ncclNumOps, 2), t, i);
  NCCLCHECK(ncclRedOpDestroy(op, comm));
  free(s); free(r); free(sc);
}

static void test_broadcast(ncclDataType_t t, size_t count, int root, int inplace, int bcast) {
  void* s = buf(count, t);
  void* r = inplace ? s : buf(count, t);
  for (size_t i = 0; i < count; i++) {
    setv(s, i, t, g_rank == root ? in(root, i, t, ncclSum) : 99);
    if (!inplace) setv(r, i, t, 77);
  }
  if (bcast) NCCLCHECK(ncclBcast(r, count, t, root, comm, NULL));
  else NCCLCHECK(ncclBroadcast(s, r, count, t, root, comm, NULL));
  for (size_t i = 0; i < count; i++) check("broadcast", getv(r, i, t), in(root, i, t, ncclSum), t, i);
  if (!inplace) free(r);
  free(s);
}

static void test_reduce(ncclDataType_t t, int op, size_t count, int root, int inplace) {
  void* s = buf(count, t);
  void* r = inplace ? s : buf(count, t);
  for (size_t i = 0; i < count; i++) setv(s, i, t, in(g_rank, i, t, op));
  NCCLCHECK(ncclReduce(s, r, count, t, (ncclRedOp_t)op, root, comm, NULL));
  if (g_rank == root)
    for (size_t i = 0; i < count; i++) check("reduce", getv(r, i, t), ref(i, t, op, 1), t, i);
  if (!inplace) free(r);
  free(s);
}

static void test_allgather(ncclDataType_t t, size_t c, int inplace) {
  void* r = buf(c * nranks, t);
  void* s = inplace ? (char*)r + (size_t)g_rank * c * tsize(t) : buf(c, t);
  for (size_t i = 0; i < c; i++) setv(s, i, t, in(g_rank, i, t, ncclSum));
  NCCLCHECK(ncclAllGather(s, r, c, t, comm, NULL));
  for (int q = 0; q < nranks; q++)
    for (size_t i = 0; i < c; i++) check("allgather", getv(r, q * c + i, t), in(q, i, t, ncclSum), t, i);
  if (!inplace) free(s);
  free(r);
}

static void test_reducescatter(ncclDataType_t t, int op, size_t c, int inplace) {
  void* s = buf(c * nranks, t);
  void* r = inplace ? (char*)s + (size_t)g_rank * c * tsize(t) : buf(c, t);
  for (size_t j = 0; j < c * nranks; j++) setv(s, j, t, in(g_rank, j, t, op));
  NCCLCHECK(ncclReduceScatter(s, r, c, t, (ncclRedOp_t)op, comm, NULL));
  for (size_t i = 0; i < c; i++)
    check("reducescatter", getv(r, i, t), ref((size_t)g_rank * c + i, t, op, 1), t, i);
  if (!inplace) free(r);
  free(s);
}

static void test_alltoall(ncclDataType_t t, size_t c) {
  void* s = buf(c * nranks, t), *r = buf(c * nranks, t);
  for (size_t j = 0; j < c * nranks; j++) setv(s, j, t, in(g_rank, j, t, ncclSum));
  NCCLCHECK(ncclAlltoAll(s, r, c, t, comm, NULL));
  for (int q = 0; q < nranks; q++)
    for (size_t i = 0; i < c; i++)
      check("alltoall", getv(r, q * c + i, t), in(q, (size_t)g_rank * c + i, t, ncclSum), t, i);
  free(s); free(r);
}

static void test_gather(ncclDataType_t t, size_t c, int root, int inplace) {
  void* r = buf(c * nranks, t);
  int ip = inplace && g_rank == root;
  void* s = ip ? (char*)r + (size_t)root * c * tsize(t) : buf(c, t);
  for (size_t i = 0; i < c; i++) setv(s, i, t, in(g_rank, i, t, ncclSum));
  NCCLCHECK(ncclGather(s, r, c, t, root, comm, NULL));
  if (g_rank == root)
    for (int q = 0; q < nranks; q++)
      for (size_t i = 0; i < c; i++) check("gather", getv(r, q * c + i, t), in(q, i, t, ncclSum), t, i);
  if (!ip) free(s);
  free(r);
}

static void test_scatter(ncclDataType_t t, size_t c, int root, int inplace) {
  void* s = buf(c * nranks, t);
  int ip = inplace && g_rank == root;
  void* r = ip ? (char*)s + (size_t)root * c * tsize(t) : buf(c, t);
  for (size_t j = 0; j < c * nranks; j++) setv(s, j, t, g_rank == root ? in(root, j, t, ncclSum) : 5);
  NCCLCHECK(ncclScatter(s, r, c, t, root, comm, NULL));
  for (size_t i = 0; i < c; i++)
    check("scatter", getv(r, i, t), in(root, (size_t)g_rank * c + i, t, ncclSum), t, i);
  if (!ip) free(r);
  free(s);
}

static void test_sendrecv(ncclDataType_t t, size_t c, int recv_first) {
  int next = (g_rank + 1) % nranks, prev = (g_rank + nranks - 1) % nranks;
  void* s = buf(c, t), *r = buf(c, t);
  for (size_t i = 0; i < c; i++) setv(s, i, t, in(g_rank, i, t, ncclSum));
  NCCLCHECK(ncclGroupStart());
  if (recv_first) {
    NCCLCHECK(ncclRecv(r, c, t, prev, comm, NULL));
    NCCLCHECK(ncclSend(s, c, t, next, comm, NULL));
  } else {
    NCCLCHECK(ncclSend(s, c, t, next, comm, NULL));
    NCCLCHECK(ncclRecv(r, c, t, prev, comm, NULL));
  }
  NCCLCHECK(ncclGroupEnd());
  for (size_t i = 0; i < c; i++) check("sendrecv", getv(r, i, t), in(prev, i, t, ncclSum), t, i);
  free(s); free(r);
}

int main(void) {
  g_rank = env_int("WEFT_RANK", "RANK", -1);
  nranks = env_int("WEFT_WORLD_SIZE", "WORLD_SIZE", -1);
  ASSERT(g_rank >= 0 && nranks > 0, "run me with weft run");
  ncclUniqueId id;
  NCCLCHECK(ncclGetUniqueId(&id));
  NCCLCHECK(ncclCommInitRank(&comm, nranks, id, g_rank));
  int n = -1, me = -1;
  NCCLCHECK(ncclCommCount(comm, &n));
  NCCLCHECK(ncclCommUserRank(comm, &me));
  ASSERT(n == nranks && me == g_rank, "count %d rank %d", n, me);

  const ncclDataType_t types[] = {ncclInt8,   ncclUint8,  ncclInt32,   ncclUint32,  ncclInt64,
                                  ncclUint64, ncclFloat16, ncclFloat32, ncclFloat64, ncclBfloat16};
  const int ntypes = sizeof(types) / sizeof(types[0]);
  for (int ti = 0; ti < ntypes; ti++) {
    ncclDataType_t t = types[ti];
    for (int op = ncclSum; op <= ncclAvg; op++) {
      if (op == ncclAvg && !is_float(t)) continue;
      test_allreduce(t, op, 1000, 0, 1);
      test_allreduce(t, op, 1000, 1, 1);
    }
    test_broadcast(t, 333, nranks - 1, 0, 0);
    test_reducescatter(t, ncclSum, 100, 0);
    test_allgather(t, 100, 0);
  }
  test_allreduce(ncclFloat32, ncclSum, 300000, 0, 1);
  test_allreduce(ncclInt64, ncclMax, 1, 1, 1);
  test_premulsum(ncclFloat32);
  test_premulsum(ncclFloat64);
  test_premulsum(ncclInt32);
  for (int inplace = 0; inplace < 2; inplace++) {
    test_broadcast(ncclFloat32, 1000, 0, inplace, 0);
    test_broadcast(ncclInt32, 77777, nranks - 1, inplace, 0);
    test_reduce(ncclFloat32, ncclSum, 1000, 1 % nranks, inplace);
    test_reduce(ncclInt32, ncclMax, 1000, 0, inplace);
    test_reduce(ncclFloat64, ncclMin, 1000, nranks - 1, inplace);
    test_allgather(ncclFloat32, 1000, inplace);
    test_allgather(ncclInt64, 4097, inplace);
    test_reducescatter(ncclFloat32, ncclSum, 1000, inplace);
    test_reducescatter(ncclInt32, ncclProd, 300, inplace);
    test_reducescatter(ncclFloat64, ncclAvg, 300, inplace);
    test_gather(ncclFloat32, 500, nranks - 1, inplace);
    test_gather(ncclInt8, 3, 0, inplace);
    test_scatter(ncclFloat64, 500, 0, inplace);
    test_scatter(ncclUint8, 7, nranks - 1, inplace);
  }
  test_broadcast(ncclFloat32, 100, 0, 1, 1);
  test_alltoall(ncclFloat32, 1000);
  test_alltoall(ncclInt8, 13);
  test_alltoall(ncclFloat64, 1);
  test_sendrecv(ncclFloat32, 1000, 0);
  test_sendrecv(ncclInt64, 100000, 1);
  /* Zero-count collectives are no-ops, even with NULL buffers. */
  NCCLCHECK(ncclAllReduce(NULL, NULL, 0, ncclFloat32, ncclSum, comm, NULL));
  NCCLCHECK(ncclAllGather(NULL, NULL, 0, ncclFloat32, comm, NULL));
  /* Buffers from ncclMemAlloc work like any host memory. */
  float* mb = NULL;
  NCCLCHECK(ncclMemAlloc((void**)&mb, 4096 * sizeof(float)));
  ASSERT(((uintptr_t)mb & 4095) == 0, "ncclMemAlloc memory not page-aligned");
  void* reg = NULL;
  NCCLCHECK(ncclCommRegister(comm, mb, 4096 * sizeof(float), &reg));
  for (int i = 0; i < 4096; i++) mb[i] = (float)(g_rank + i);
  NCCLCHECK(ncclAllReduce(mb, mb, 4096, ncclFloat32, ncclSum, comm, NULL));
  for (int i = 0; i < 4096; i++)
    check("memalloc allreduce", mb[i], (double)nranks * i + nranks * (nranks - 1) / 2.0, ncclFloat32, i);
  NCCLCHECK(ncclCommDeregister(comm, reg));
  NCCLCHECK(ncclMemFree(mb));

  ASSERT(intercepted > 50, "the interposed ncclAllReduce saw %d calls", intercepted);

  NCCLCHECK(ncclCommFinalize(comm));
  ncclResult_t st;
  NCCLCHECK(ncclCommGetAsyncError(comm, &st));
  ASSERT(st == ncclSuccess, "async error after finalize: %d", (int)st);
  NCCLCHECK(ncclCommDestroy(comm));
  printf("rank %d: collectives ok\n", g_rank);
  return 0;
}
