// Weft's CUDA collectives: one kernel per (collective family, type, op),
// compiled at run time with NVRTC for the device's architecture.
//
// Header-free on purpose (no cuda_fp16.h / cuda_bf16.h / cuda_fp8.h): the
// narrow float conversions are single PTX instructions, so the source compiles
// with any NVRTC that knows the target, on machines with no CUDA toolkit.
//
// Protocol (see libcomm/src/cuda/mod.rs): every rank owns a peer-visible
// scratch area (two parity buffers of `chunk_bytes` each, times `parts`) and a
// flag array flags[block][rank]. A collective is cut into chunks; chunk c has
// sequence number s = seq_base + c, uses parity buffer s & 1 and two barrier
// values 2s and 2s+1. Block b of every rank handles the same element range of
// every chunk, so block b only ever waits on block b of its peers: a barrier is
// "store my value into each peer's flags[b][me], wait until flags[b][peer] has
// reached it on mine". Values only grow, so a stale flag can never satisfy a
// wait. The parity double buffer makes reuse safe without an exit barrier:
// rank r overwrites parity p again only at chunk s+2, after passing the entry
// barrier of s+1, which each peer's block b reaches only after finishing s.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

#define WEFT_MAX_RANKS 8
#define WEFT_MAX_BLOCKS 128

// Collective kinds (keep in sync with cuda/mod.rs).
#define K_ALLREDUCE 0
#define K_ALLREDUCE_2SHOT 1
#define K_REDUCE 2
#define K_REDUCESCATTER 3
#define K_ALLGATHER 4
#define K_BROADCAST 5
#define K_ALLTOALL 6

struct Args {
    u64 scratch[WEFT_MAX_RANKS];  // each rank's scratch base (peer-mapped here)
    u64 flags[WEFT_MAX_RANKS];    // each rank's flag array (peer-mapped here)
    u64 in;                       // caller's send buffer (elements)
    u64 out;                      // caller's receive buffer
    u64 count;                    // elements per rank-part (NCCL's count)
    u64 chunk;                    // elements per part per chunk
    u64 seq_base;                 // sequence number of chunk 0
    i32 rank;
    i32 nranks;
    i32 kind;
    i32 root;
    u64 parity_bytes;             // bytes between the two parity buffers
    i32 direct;                   // 1: read peers' user buffers (same process)
    i32 pad;
};

// Direct mode: each block publishes its rank's {in, out} pointers here (in its
// own flag area) before the entry barrier; peers read them after it.
#define WEFT_PTR_OFF (32 << 10)
// Direct broadcast: per-block progress counters of the ring pipeline.
#define WEFT_PROG_OFF (48 << 10)
// Broadcasts of at least this many bytes use the pipelined ring.
#define WEFT_BCAST_RING_MIN (256 << 10)

// ---------------------------------------------------------------- memory model
__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void barrier(const Args& a, u64 value) {
    __threadfence_system();
    __syncthreads();
    int r = threadIdx.x;
    if (r < a.nranks) {
        u64* theirs = (u64*)a.flags[r] + blockIdx.x * WEFT_MAX_RANKS + a.rank;
        st_release_sys(theirs, value);
        const u64* mine = (const u64*)a.flags[a.rank] + blockIdx.x * WEFT_MAX_RANKS + r;
        while (ld_acquire_sys(mine) < value) {
        }
    }
    __syncthreads();
}

// Peer (and own scratch) reads bypass L1: the same addresses are rewritten
// between chunks by other GPUs.
template <int N> struct Bits;
template <> struct Bits<1> { typedef u8 type; };
template <> struct Bits<2> { typedef u16 type; };
template <> struct Bits<4> { typedef u32 type; };
template <> struct Bits<8> { typedef u64 type; };
template <typename T>
__device__ __forceinline__ T ld_cv(const T* p) {
    typedef typename Bits<sizeof(T)>::type B;
    B b = *(const volatile B*)p;
    T t;
    memcpy(&t, &b, sizeof(T));
    return t;
}
__device__ __forceinline__ uint4 ld_cv4(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.cv.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// ---------------------------------------------------------------- types
struct Half { u16 v; };
struct Bf16 { u16 v; };
struct E4M3 { u8 v; };
struct E5M2 { u8 v; };

template <typename T> struct Acc { typedef T type; };
template <> struct Acc<Half> { typedef float type; };
template <> struct Acc<Bf16> { typedef float type; };
template <> struct Acc<E4M3> { typedef float type; };
template <> struct Acc<E5M2> { typedef float type; };

template <typename T> __device__ __forceinline__ typename Acc<T>::type load(T x) { return x; }
template <typename T> __device__ __forceinline__ T store(typename Acc<T>::type x) { return x; }

template <> __device__ __forceinline__ float load<Half>(Half x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.v));
    return f;
}
template <> __device__ __forceinline__ Half store<Half>(float f) {
    Half h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.v) : "f"(f));
    return h;
}
template <> __device__ __forceinline__ float load<Bf16>(Bf16 x) {
    return __uint_as_float(((u32)x.v) << 16);
}
template <> __device__ __forceinline__ Bf16 store<Bf16>(float f) {
    Bf16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.v) : "f"(f));
    return h;
}
#if __CUDA_ARCH__ >= 890
template <> __device__ __forceinline__ float load<E4M3>(E4M3 x) {
    u32 h2;
    u16 in = x.v;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
    Half h;
    h.v = (u16)(h2 & 0xffff);
    return load<Half>(h);
}
template <> __device__ __forceinline__ E4M3 store<E4M3>(float f) {
    u16 out;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(out) : "f"(0.0f), "f"(f));
    E4M3 r;
    r.v = (u8)(out & 0xff);
    return r;
}
template <> __device__ __forceinline__ float load<E5M2>(E5M2 x) {
    u32 h2;
    u16 in = x.v;
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h2) : "h"(in));
    Half h;
    h.v = (u16)(h2 & 0xffff);
    return load<Half>(h);
}
template <> __device__ __forceinline__ E5M2 store<E5M2>(float f) {
    u16 out;
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(out) : "f"(0.0f), "f"(f));
    E5M2 r;
    r.v = (u8)(out & 0xff);
    return r;
}
#endif

// ---------------------------------------------------------------- ops
struct OpSum { template <typename A> __device__ static A f(A a, A b) { return a + b; } };
struct OpProd { template <typename A> __device__ static A f(A a, A b) { return a * b; } };
struct OpMax { template <typename A> __device__ static A f(A a, A b) { return a > b ? a : b; } };
struct OpMin { template <typename A> __device__ static A f(A a, A b) { return a < b ? a : b; } };
struct OpAvg { template <typename A> __device__ static A f(A a, A b) { return a + b; } };
// NaN propagates through max/min like the host kernels (fmaxf would drop it).
template <> __device__ float OpMax::f<float>(float a, float b) { return (a != a || a > b) ? a : b; }
template <> __device__ float OpMin::f<float>(float a, float b) { return (a != a || a < b) ? a : b; }
template <> __device__ double OpMax::f<double>(double a, double b) { return (a != a || a > b) ? a : b; }
template <> __device__ double OpMin::f<double>(double a, double b) { return (a != a || a < b) ? a : b; }

template <typename Op, typename A> struct Finish { __device__ static A f(A a, int) { return a; } };
template <typename A> struct Finish<OpAvg, A> { __device__ static A f(A a, int n) { return a / (A)n; } };

// ---------------------------------------------------------------- kernels
// This block's slice [lo, hi) of n elements: slices are whole 16-byte vectors
// (V elements), the last block takes the tail.
template <typename T>
__device__ __forceinline__ void slice(u64 n, u64& lo, u64& hi) {
    const u64 V = 16 / sizeof(T);
    u64 vecs = (n + V - 1) / V;
    u64 per = (vecs + gridDim.x - 1) / gridDim.x;
    lo = blockIdx.x * per * V;
    hi = lo + per * V;
    if (lo > n) lo = n;
    if (hi > n) hi = n;
}

__device__ __forceinline__ void copy_bytes(u8* dst, const u8* src, u64 bytes, bool cv) {
    // 16-byte path when both ends are aligned, else bytes.
    if ((((u64)dst | (u64)src) & 15) == 0) {
        u64 nv = bytes / 16;
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        // Four independent 16-byte loads in flight per thread before the stores.
        const u64 B = blockDim.x;
        u64 i = threadIdx.x;
        for (; i + 3 * B < nv; i += 4 * B) {
            uint4 t[4];
#pragma unroll
            for (int u = 0; u < 4; u++) t[u] = cv ? ld_cv4(s + i + u * B) : s[i + u * B];
#pragma unroll
            for (int u = 0; u < 4; u++) d[i + u * B] = t[u];
        }
        for (; i < nv; i += B) d[i] = cv ? ld_cv4(s + i) : s[i];
        for (u64 i = nv * 16 + threadIdx.x; i < bytes; i += blockDim.x) dst[i] = cv ? ld_cv(src + i) : src[i];
    } else {
        for (u64 i = threadIdx.x; i < bytes; i += blockDim.x) dst[i] = cv ? ld_cv(src + i) : src[i];
    }
}

// out[i] = finish(op over r of src_r[i]) for i in [lo, hi); src_r = base_r + off (bytes).
template <typename T, typename Op>
__device__ __forceinline__ void reduce_src(const u64* src, const int n, u64 off_bytes, T* out, u64 lo, u64 hi) {
    typedef typename Acc<T>::type A;
    const u64 V = 16 / sizeof(T);
    bool aligned = ((u64)(out + lo) & 15) == 0;
    for (int r = 0; r < n; r++) aligned = aligned && ((src[r] + off_bytes + lo * sizeof(T)) & 15) == 0;
    u64 vlo = lo, vhi = aligned ? lo + (hi - lo) / V * V : lo;
    // Vector part: each thread handles whole 16-byte groups from every rank.
    for (u64 i = vlo + threadIdx.x * V; i < vhi; i += (u64)blockDim.x * V) {
        // Every rank's vector in flight at once, then the reduction.
        uint4 v[WEFT_MAX_RANKS];
#pragma unroll
        for (int r = 0; r < WEFT_MAX_RANKS; r++)
            if (r < n) v[r] = ld_cv4((const uint4*)((const u8*)src[r] + off_bytes) + i / V);
        A acc[16 / sizeof(T)];
        {
            const T* t = (const T*)&v[0];
#pragma unroll
            for (int k = 0; k < (int)(16 / sizeof(T)); k++) acc[k] = load<T>(t[k]);
        }
#pragma unroll
        for (int r = 1; r < WEFT_MAX_RANKS; r++) {
            if (r >= n) break;
            const T* t = (const T*)&v[r];
#pragma unroll
            for (int k = 0; k < (int)(16 / sizeof(T)); k++) acc[k] = Op::f(acc[k], load<T>(t[k]));
        }
        uint4 o;
        T* ot = (T*)&o;
#pragma unroll
        for (int k = 0; k < (int)(16 / sizeof(T)); k++) ot[k] = store<T>(Finish<Op, A>::f(acc[k], n));
        *(uint4*)(out + i) = o;
    }
    for (u64 i = vhi + threadIdx.x; i < hi; i += blockDim.x) {
        A acc = load<T>(ld_cv((const T*)((const u8*)src[0] + off_bytes) + i));
        for (int r = 1; r < n; r++) acc = Op::f(acc, load<T>(ld_cv((const T*)((const u8*)src[r] + off_bytes) + i)));
        out[i] = store<T>(Finish<Op, A>::f(acc, n));
    }
}

template <typename T, typename Op>
__device__ void collective_direct(const Args& a);

template <typename T, typename Op>
__device__ void collective(const Args& a) {
    if (a.direct && a.kind != K_ALLREDUCE) {
        collective_direct<T, Op>(a);
        return;
    }
    const u64 E = sizeof(T);
    const int n = a.nranks;
    __shared__ u64 scr[WEFT_MAX_RANKS];
    if (threadIdx.x < WEFT_MAX_RANKS) scr[threadIdx.x] = a.scratch[threadIdx.x];
    __syncthreads();
    const u64 count = a.count;
    const u8* in = (const u8*)a.in;
    u8* out = (u8*)a.out;
    // Parts per chunk in scratch: RS and A2A stage one part per destination.
    const bool per_dest = a.kind == K_REDUCESCATTER || a.kind == K_ALLTOALL;
    for (u64 c = 0, base = 0; base < count; c++, base += a.chunk) {
        const u64 m = (count - base < a.chunk) ? count - base : a.chunk;
        const u64 s = a.seq_base + c;
        const u64 par = (s & 1) * a.parity_bytes;
        u8* mine = (u8*)a.scratch[a.rank] + par;
        u64 lo, hi;
        slice<T>(m, lo, hi);
        // 1. Stage my input for this chunk into my scratch.
        if (per_dest) {
            for (int r = 0; r < n; r++)
                copy_bytes(mine + (r * a.chunk + lo) * E, in + (r * count + base + lo) * E, (hi - lo) * E, false);
        } else if (a.kind != K_BROADCAST || a.rank == a.root) {
            copy_bytes(mine + lo * E, in + (base + lo) * E, (hi - lo) * E, false);
        }
        barrier(a, 2 * s);
        // 2. Read what this rank needs from every peer.
        switch (a.kind) {
        case K_ALLREDUCE:
            reduce_src<T, Op>(scr, n, par, (T*)(out + base * E), lo, hi);
            break;
        case K_REDUCE:
            if (a.rank == a.root) reduce_src<T, Op>(scr, n, par, (T*)(out + base * E), lo, hi);
            break;
        case K_REDUCESCATTER:
            reduce_src<T, Op>(scr, n, par + a.rank * a.chunk * E, (T*)(out + base * E), lo, hi);
            break;
        case K_ALLGATHER:
            for (int k = 0; k < n; k++) {
                int r = (a.rank + k) % n;
                copy_bytes(out + (r * count + base + lo) * E, (const u8*)a.scratch[r] + par + lo * E, (hi - lo) * E, true);
            }
            break;
        case K_BROADCAST:
            copy_bytes(out + (base + lo) * E, (const u8*)a.scratch[a.root] + par + lo * E, (hi - lo) * E, true);
            break;
        case K_ALLTOALL:
            for (int k = 0; k < n; k++) {
                int r = (a.rank + k) % n;
                copy_bytes(out + (r * count + base + lo) * E,
                           (const u8*)a.scratch[r] + par + (a.rank * a.chunk + lo) * E, (hi - lo) * E, true);
            }
            break;
        case K_ALLREDUCE_2SHOT: {
            // Reduce my 1/n of the slice into my own scratch (only I read that
            // part before the next barrier's all-gather), then gather.
            u64 len = hi - lo;
            const u64 V = 16 / sizeof(T);
            u64 part = ((len + n - 1) / n + V - 1) / V * V;
            u64 plo = lo + a.rank * part, phi = plo + part;
            if (plo > hi) plo = hi;
            if (phi > hi) phi = hi;
            // Reduce into a temporary place: the second parity half is busy
            // with the previous chunk's reads, so reduce straight into out,
            // then publish by copying into my scratch.
            reduce_src<T, Op>(scr, n, par, (T*)(out + base * E), plo, phi);
            __syncthreads();
            copy_bytes(mine + plo * E, out + (base + plo) * E, (phi - plo) * E, false);
            barrier(a, 2 * s + 1);
            for (int k = 1; k < n; k++) {
                int r = (a.rank + k) % n;
                u64 qlo = lo + r * part, qhi = qlo + part;
                if (qlo > hi) qlo = hi;
                if (qhi > hi) qhi = hi;
                copy_bytes(out + (base + qlo) * E, (const u8*)a.scratch[r] + par + qlo * E, (qhi - qlo) * E, true);
            }
            break;
        }
        }
    }
}

// Direct mode (ranks in one process): no staging copy and no chunking; peers'
// user buffers are read in place. Barriers: 2s (pointers published, inputs
// ready), 2s+1 (two-shot: reduced parts ready), 2s+2 (exit: nobody reads my
// buffers any more, so the caller may reuse them). Consumes two sequence numbers.
template <typename T, typename Op>
__device__ void collective_direct(const Args& a) {
    const u64 E = sizeof(T);
    const int n = a.nranks;
    const u64 count = a.count;
    const u64 s = a.seq_base;
    __shared__ u64 pin[WEFT_MAX_RANKS], pout[WEFT_MAX_RANKS];
    if (threadIdx.x == 0) {
        volatile u64* slot = (volatile u64*)(a.flags[a.rank] + WEFT_PTR_OFF) + blockIdx.x * 2;
        slot[0] = a.in;
        slot[1] = a.out;
    }
    barrier(a, 2 * s);
    if (threadIdx.x < n) {
        const u64* slot = (const u64*)(a.flags[threadIdx.x] + WEFT_PTR_OFF) + blockIdx.x * 2;
        pin[threadIdx.x] = ld_cv(slot);
        pout[threadIdx.x] = ld_cv(slot + 1);
    }
    __syncthreads();
    u8* out = (u8*)a.out;
    u64 lo, hi;
    slice<T>(count, lo, hi);
    switch (a.kind) {
    case K_REDUCE: {
        // Reduce-scatter straight into the root's output: rank k reduces part
        // k of every input and stores it remotely (no rank reads a part it
        // does not reduce, so in place is safe), so every link carries about
        // (n-1)/n of the data instead of the root pulling n buffers.
        const u64 V = 16 / sizeof(T);
        u64 len = hi - lo;
        u64 part = ((len + n - 1) / n + V - 1) / V * V;
        u64 plo = lo + a.rank * part, phi = plo + part;
        if (plo > hi) plo = hi;
        if (phi > hi) phi = hi;
        reduce_src<T, Op>(pin, n, 0, (T*)pout[a.root], plo, phi);
        break;
    }
    case K_REDUCESCATTER:
        reduce_src<T, Op>(pin, n, a.rank * count * E, (T*)out, lo, hi);
        break;
    case K_ALLGATHER:
        for (int k = 0; k < n; k++) {
            int r = (a.rank + k) % n;
            u8* dst = out + (r * count + lo) * E;
            const u8* src = (const u8*)pin[r] + lo * E;
            if (dst != src) copy_bytes(dst, src, (hi - lo) * E, true);
        }
        break;
    case K_BROADCAST: {
        // Pipelined ring from the root: the rank at ring position p pulls each
        // step of this block's slice from position p-1's output once p-1's
        // progress flag for this block says the step is there (values
        // (s << 32) | step: they only grow). Every link carries the data once.
        const int pos = (a.rank - a.root + n) % n;
        const int pred = (a.rank - 1 + n) % n;
        const u64 bytes = (hi - lo) * E;
        if (count * E < WEFT_BCAST_RING_MIN) {
            // Small: one hop, everyone pulls from the root (latency over bandwidth).
            const u8* src = (const u8*)pin[a.root] + lo * E;
            if (out + lo * E != src) copy_bytes(out + lo * E, src, bytes, true);
            break;
        }
        if (pos == 0) {
            const u8* src = (const u8*)pin[a.root] + lo * E;
            if (out + lo * E != src) copy_bytes(out + lo * E, src, bytes, false);
            break;
        }
        const u8* src = (pos == 1 ? (const u8*)pin[a.root] : (const u8*)pout[pred]) + lo * E;
        const u64 STEP = 128 << 10;
        const u64 nsteps = (bytes + STEP - 1) / STEP;
        u64* mine = (u64*)(a.flags[a.rank] + WEFT_PROG_OFF) + blockIdx.x;
        const u64* theirs = (const u64*)(a.flags[pred] + WEFT_PROG_OFF) + blockIdx.x;
        for (u64 j = 0; j < nsteps; j++) {
            if (pos > 1) {
                if (threadIdx.x == 0)
                    while (ld_acquire_sys(theirs) < ((s << 32) | (j + 1))) {
                    }
                __syncthreads();
            }
            u64 off = j * STEP, len = bytes - off < STEP ? bytes - off : STEP;
            copy_bytes(out + lo * E + off, src + off, len, true);
            if (pos < n - 1) {
                __threadfence_system();
                __syncthreads();
                if (threadIdx.x == 0) st_release_sys(mine, (s << 32) | (j + 1));
            }
        }
        break;
    }
    case K_ALLTOALL:
        for (int k = 0; k < n; k++) {
            int r = (a.rank + k) % n;
            copy_bytes(out + (r * count + lo) * E, (const u8*)pin[r] + (a.rank * count + lo) * E, (hi - lo) * E, true);
        }
        break;
    case K_ALLREDUCE_2SHOT: {
        u64 len = hi - lo;
        const u64 V = 16 / sizeof(T);
        u64 part = ((len + n - 1) / n + V - 1) / V * V;
        u64 plo = lo + a.rank * part, phi = plo + part;
        if (plo > hi) plo = hi;
        if (phi > hi) phi = hi;
        // My part of every input -> my output (in place: only I read my part).
        reduce_src<T, Op>(pin, n, 0, (T*)out, plo, phi);
        barrier(a, 2 * s + 1);
        for (int k = 1; k < n; k++) {
            int r = (a.rank + k) % n;
            u64 qlo = lo + r * part, qhi = qlo + part;
            if (qlo > hi) qlo = hi;
            if (qhi > hi) qhi = hi;
            copy_bytes(out + qlo * E, (const u8*)pout[r] + qlo * E, (qhi - qlo) * E, true);
        }
        break;
    }
    }
    barrier(a, 2 * s + 2);
}

#define WEFT_KERNEL(TN, T, ON, OP) \
    extern "C" __global__ void __launch_bounds__(512) weft_coll_##TN##_##ON(Args a) { collective<T, OP>(a); }

#define WEFT_ALL_OPS(TN, T)         \
    WEFT_KERNEL(TN, T, sum, OpSum)   \
    WEFT_KERNEL(TN, T, prod, OpProd) \
    WEFT_KERNEL(TN, T, max, OpMax)   \
    WEFT_KERNEL(TN, T, min, OpMin)   \
    WEFT_KERNEL(TN, T, avg, OpAvg)

// The runtime compiles one kernel at a time (-DWEFT_SINGLE plus one
// WEFT_KERNEL line appended): NVRTC and the driver's JIT then take a fraction
// of a second on first use instead of seconds for all of them.
#ifndef WEFT_SINGLE
WEFT_ALL_OPS(i8, i8)
WEFT_ALL_OPS(u8, u8)
WEFT_ALL_OPS(i32, i32)
WEFT_ALL_OPS(u32, u32)
WEFT_ALL_OPS(i64, i64)
WEFT_ALL_OPS(u64, u64)
WEFT_ALL_OPS(f16, Half)
WEFT_ALL_OPS(f32, float)
WEFT_ALL_OPS(f64, double)
WEFT_ALL_OPS(bf16, Bf16)
#if __CUDA_ARCH__ >= 890
WEFT_ALL_OPS(f8e4m3, E4M3)
WEFT_ALL_OPS(f8e5m2, E5M2)
#endif
#endif
