// Weft's CUDA collectives, in two families of kernels: a reducing kernel
// per (type, op), weft_coll_<type>_<op>, runs the collectives that combine
// values (all-reduce, reduce, reduce-scatter); a moving kernel per element
// size, weft_move_<bytes>, runs those that only move them (all-gather,
// broadcast, all-to-all); weft_p2p runs point-to-point rounds. Each family
// compiles only its own kinds' code (see `Family`), which keeps the library's
// precompiled machine code small. Compiled ahead of time for the GPUs the
// build targets (libcomm/build.rs), else at run time with NVRTC for the
// device's architecture (libcomm/src/cuda/kernels.rs).
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

// Collective kinds (keep in sync with cuda/abi.rs).
#define K_ALLREDUCE 0
#define K_ALLREDUCE_2SHOT 1
#define K_REDUCE 2
#define K_REDUCESCATTER 3
#define K_ALLGATHER 4
#define K_BROADCAST 5
#define K_ALLTOALL 6
// A local reduction, no peers: out = op over r < nranks of scratch[r]
// (device or host-mapped pinned addresses): the cross-host path's
// reduce-scatter, which reduces on the GPU what its pinned buffer received
// from the other hosts (libcomm/src/cuda/pinned_copy.rs).
#define K_LOCAL_REDUCE 7

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
    i32 push;                     // 1: direct copies write into peers (else read from them)
    u64 status;                   // host-mapped Status (abort word): 0 = none
    i32 exit_barrier;             // scratch mode: end with a barrier (ranks in other processes)
    i32 bcast;                    // direct broadcast algorithm: WEFT_BCAST_*
    u64 step;                     // direct broadcast: pipeline step; reduce: chunk; chain: slot (bytes, multiple of 16)
    i32 chain;                    // broadcast/reduce as a chain: WEFT_CHAIN_FIFO or WEFT_CHAIN_LINES
    u64 slots;                    // chain: slots per block in every rank's scratch; lines: window per warp (iterations)
    u64 ll;                       // LL one-shot: this op's flag (never 0); 0 = another algorithm
    u64 ll_off;                   // LL one-shot: offset of this op's parity half of the LL area from scratch
    u64 ll_check;                 // LL one-shot: ranks (bits) to ask whether they are done with this half
    u64 ll_need;                  // LL one-shot: their WEFT_LL_COUNT once they are
};

// Args.chain (keep in sync with cuda/abi.rs): 0 none, else the chain's
// protocol: FIFO slots with a fence and a flag per step (chain_fifo), or
// lines that carry their own flags (lines_chain).
#define WEFT_CHAIN_FIFO 1
#define WEFT_CHAIN_LINES 2

// Direct broadcast algorithms (keep in sync with cuda/abi.rs).
#define WEFT_BCAST_RING 0
#define WEFT_BCAST_SCATTER 1

// Host-mapped per communicator (pinned host memory): the host sets `abort`
// (ncclCommAbort, the device watch), every spin loop polls it and the kernel
// returns; kernels report asynchronous errors (a send/recv size mismatch) in
// `error`. With `timeout_ms` set (WEFT_TIMEOUT_MS), a wait that polled one
// address that long without its value arriving writes the address into
// `stalled`; the host's device watch (libcomm/src/watch.rs) then fails the
// communicator, naming the peer it maps the address to, and raises `abort`.
// `abort` and `timeout_ms` share one 8-byte word: one PCIe read fetches both.
// Keep in sync with cuda/abi.rs.
struct Status {
    u32 abort;
    u32 timeout_ms;
    u32 error;
    u32 pad;
    u64 detail;
    u64 stalled;
};
#define WEFT_ERR_P2P_SIZE 1       // detail: peer << 56 | the bytes the sender sent
#define WEFT_ERR_P2P_SIZE_SEND 2  // detail: peer << 56 | the bytes the receiver expects

// Direct mode: each block publishes its rank's {in, out} pointers here (in its
// own flag area) before the entry barrier; peers read them after it.
#define WEFT_PTR_OFF (32 << 10)
// Direct broadcasts of at least this many bytes are pipelined (scatter +
// forward or ring, see broadcast_direct); below, every rank reads the root's
// buffer, one hop.
#define WEFT_BCAST_PIPELINE_MIN (256 << 10)
// Direct reduce of at most this many bytes: the root alone reduces.
#define WEFT_REDUCE_AT_ROOT_MAX (64 << 10)
// Direct broadcast: per-block progress counters of the pipelines.
#define WEFT_PROG_OFF (48 << 10)
// Chain (see chain_fifo), one u64 per block: tails (steps the predecessor
// has filled, written by it) and credits (steps the successor has drained,
// written by it).
#define WEFT_CHAIN_TAIL_OFF (50 << 10)
#define WEFT_CHAIN_CRED_OFF (52 << 10)
// Lines chain (see lines_chain): one u64 credit per warp, at most
// WEFT_LINES_MAX_WARPS (written by the successor): 64 - 80 KiB of the
// 128 KiB area (FLAG_AREA in cuda/abi.rs).
#define WEFT_LINES_CRED_OFF (64 << 10)
#define WEFT_LINES_MAX_WARPS 2048
// Point-to-point (see weft_p2p): on the receiver, ready[sender] = sequence
// number of the sender's last posted send and {ptr, bytes}[sender] of that
// send (written by the sender, so the receiver reads them locally: one NVLink
// round trip less per message); on the sender, done[receiver] = last
// completed sequence.
#define WEFT_P2P_READY (8 << 10)
#define WEFT_P2P_PTR (9 << 10)
#define WEFT_P2P_DONE (10 << 10)
// On the receiver: blocks finished per sender (monotonic), to find the last one.
#define WEFT_P2P_COUNT (11 << 10)
// Point-to-point across processes (see p2p_send_fifo): on the receiver,
// tails [sender][block] and the sender's byte count [sender] (sent when the
// sizes differ); on the sender, credits [receiver][block], and per receiver
// the sequence number of its posted receive and the bytes it expects.
#define WEFT_P2P_FIFO_MAXB 64
#define WEFT_P2P_TAIL (12 << 10)
#define WEFT_P2P_CRED (16 << 10)
#define WEFT_P2P_RREADY (20 << 10)
#define WEFT_P2P_RBYTES ((20 << 10) + 256)
#define WEFT_P2P_SBYTES ((20 << 10) + 512)
// Low 32 bits of a tail that says "sizes differ, no data follows".
#define WEFT_P2P_SIZE_MARK 0xffffffffull
// LL one-shot (see ll_oneshot): blocks of LL kernels finished on this rank.
#define WEFT_LL_COUNT (24 << 10)

// ---------------------------------------------------------------- memory model
__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ u64 globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// What every spin loop does once per 1024 unsuccessful polls (the host word
// is a PCIe round trip away): returns WEFT_ABORTED when the communicator was
// aborted, else the wait's new `since`. With a timeout set, `since` is when
// this wait first got here (globaltimer, ns; 0 = not yet) and a wait older
// than the timeout reports the address it polls in Status.stalled (again
// each timeout after), then keeps waiting for the host to raise `abort`.
// Nothing here runs while waits succeed: the timeout costs nothing on the
// fast path (and `since` stays in a register: no reference is passed).
#define WEFT_ABORTED (~0ull)
__device__ __noinline__ u64 still_waiting(u64 status, const void* at, u64 since) {
    if (status == 0) return since;
    const u64 w = *(const volatile u64*)status;  // abort | timeout_ms << 32
    if ((u32)w != 0) return WEFT_ABORTED;
    const u64 ms = w >> 32;
    if (ms == 0) return since;
    const u64 now = globaltimer();
    if (since == 0) return now;
    if (now - since < ms * 1000000ull) return since;
    ((volatile Status*)status)->stalled = (u64)at;
    return now;
}

// Spins until *p >= v; false if the communicator was aborted meanwhile.
__device__ __forceinline__ bool wait_geq(const u64* p, u64 v, u64 status) {
    u32 n = 0;
    u64 since = 0;
    while (ld_acquire_sys(p) < v) {
        if (++n == 1024) {
            n = 0;
            since = still_waiting(status, p, since);
            if (since == WEFT_ABORTED) return false;
        }
    }
    return true;
}

// False: aborted (every thread of the block returns false; the caller returns).
// The block agrees through __syncthreads_or, not a shared flag: a thread
// that aborts the next wait cannot overwrite a verdict another thread has
// not read yet (the abort model in libcomm/src/cuda/abort_model.rs found
// that race), and no thread leaves while others wait at a block barrier.
__device__ __forceinline__ bool barrier(const Args& a, u64 value) {
    __threadfence_system();
    __syncthreads();
    int r = threadIdx.x;
    int stop = 0;
    if (r < a.nranks) {
        u64* theirs = (u64*)a.flags[r] + blockIdx.x * WEFT_MAX_RANKS + a.rank;
        st_release_sys(theirs, value);
        const u64* mine = (const u64*)a.flags[a.rank] + blockIdx.x * WEFT_MAX_RANKS + r;
        stop = !wait_geq(mine, value, a.status);
    }
    return __syncthreads_or(stop) == 0;
}
#define BARRIER(a, v) \
    if (!barrier(a, v)) return

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
// fp8 <-> float through f16, one PTX conversion each way; E4M3 and E5M2
// differ only in the format named in the instruction.
#define WEFT_FP8(T, FMT)                                                                    \
    template <> __device__ __forceinline__ float load<T>(T x) {                             \
        u32 h2;                                                                             \
        u16 in = x.v;                                                                       \
        asm("cvt.rn.f16x2." FMT "x2 %0, %1;" : "=r"(h2) : "h"(in));                         \
        Half h;                                                                             \
        h.v = (u16)(h2 & 0xffff);                                                           \
        return load<Half>(h);                                                               \
    }                                                                                       \
    template <> __device__ __forceinline__ T store<T>(float f) {                            \
        u16 out;                                                                            \
        asm("cvt.rn.satfinite." FMT "x2.f32 %0, %1, %2;" : "=h"(out) : "f"(0.0f), "f"(f));  \
        T r;                                                                                \
        r.v = (u8)(out & 0xff);                                                             \
        return r;                                                                           \
    }
WEFT_FP8(E4M3, "e4m3")
WEFT_FP8(E5M2, "e5m2")
#endif

// ---------------------------------------------------------------- ops
// `reduces`: the kernel family an op makes (see `Family`). OpMove makes the
// moving kernels: nothing is combined, so its `f` is never called.
struct Reducing { static constexpr bool reduces = true; };
struct OpSum : Reducing { template <typename A> __device__ static A f(A a, A b) { return a + b; } };
struct OpProd : Reducing { template <typename A> __device__ static A f(A a, A b) { return a * b; } };
struct OpMax : Reducing { template <typename A> __device__ static A f(A a, A b) { return a > b ? a : b; } };
struct OpMin : Reducing { template <typename A> __device__ static A f(A a, A b) { return a < b ? a : b; } };
struct OpAvg : Reducing { template <typename A> __device__ static A f(A a, A b) { return a + b; } };
struct OpMove { static constexpr bool reduces = false; template <typename A> __device__ static A f(A a, A) { return a; } };
// NaN propagates through max/min like the host kernels (fmaxf would drop it).
template <> __device__ float OpMax::f<float>(float a, float b) { return (a != a || a > b) ? a : b; }
template <> __device__ float OpMin::f<float>(float a, float b) { return (a != a || a < b) ? a : b; }
template <> __device__ double OpMax::f<double>(double a, double b) { return (a != a || a > b) ? a : b; }
template <> __device__ double OpMin::f<double>(double a, double b) { return (a != a || a < b) ? a : b; }

template <typename Op, typename A> struct Finish { __device__ static A f(A a, int) { return a; } };
template <typename A> struct Finish<OpAvg, A> { __device__ static A f(A a, int n) { return a / (A)n; } };

// The kinds a kernel family runs. Every branch for a kind is guarded by
// `Family<Op>::reduce` or `Family<Op>::move`, compile-time constants, so a
// family's kernels hold no code for the other family's kinds. The host
// launches each kind on its family's kernels only (cuda/plan.rs).
template <typename Op> struct Family {
    static constexpr bool reduce = Op::reduces;
    static constexpr bool move = !Op::reduces;
    __device__ static bool runs(int kind) {
        const bool reducing =
            kind == K_ALLREDUCE || kind == K_ALLREDUCE_2SHOT || kind == K_REDUCE || kind == K_REDUCESCATTER ||
            kind == K_LOCAL_REDUCE;
        return reducing == Op::reduces;
    }
};

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

// src's bytes into dst and, unless null, also into dst2 (one load, two
// stores: a chain hop's output and successor's slot).
template <int U>
__device__ __forceinline__ void copy_bytes_u(u8* dst, u8* dst2, const u8* src, u64 bytes, bool cv) {
    // 16-byte path when every end is aligned (null is), else bytes: the
    // caller's buffers need not be (nccl-tests -u).
    if ((((u64)dst | (u64)dst2 | (u64)src) & 15) == 0) {
        u64 nv = bytes / 16;
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        uint4* d2 = (uint4*)dst2;
        // U independent 16-byte loads in flight per thread before the stores.
        const u64 B = blockDim.x;
        u64 i = threadIdx.x;
        for (; i + (U - 1) * B < nv; i += U * B) {
            uint4 t[U];
#pragma unroll
            for (int u = 0; u < U; u++) t[u] = cv ? ld_cv4(s + i + u * B) : s[i + u * B];
#pragma unroll
            for (int u = 0; u < U; u++) d[i + u * B] = t[u];
            if (d2) {
#pragma unroll
                for (int u = 0; u < U; u++) d2[i + u * B] = t[u];
            }
        }
        for (; i < nv; i += B) {
            uint4 t = cv ? ld_cv4(s + i) : s[i];
            d[i] = t;
            if (d2) d2[i] = t;
        }
        for (u64 i = nv * 16 + threadIdx.x; i < bytes; i += B) {
            u8 t = cv ? ld_cv(src + i) : src[i];
            dst[i] = t;
            if (dst2) dst2[i] = t;
        }
    } else {
        for (u64 i = threadIdx.x; i < bytes; i += blockDim.x) {
            u8 t = cv ? ld_cv(src + i) : src[i];
            dst[i] = t;
            if (dst2) dst2[i] = t;
        }
    }
}

__device__ __forceinline__ void copy_bytes(u8* dst, const u8* src, u64 bytes, bool cv, bool wide = false) {
    if (wide)
        copy_bytes_u<8>(dst, nullptr, src, bytes, cv);
    else
        copy_bytes_u<4>(dst, nullptr, src, bytes, cv);
}

// out[i] = finish(op over r of src_r[i]) for i in [lo, hi); src_r = base_r + off (bytes).
// (Two vectors per source in flight measured no faster on 4 x H200.)
// Out of line: a kernel calls it from eight places, once per block slice,
// and one copy instead of eight halves the machine code and the compile
// time of every reducing kernel (the loop inside is the same).
template <typename T, typename Op>
__device__ __noinline__ void reduce_src(const u64* src, const int n, u64 off_bytes, T* out, u64 lo, u64 hi) {
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
__device__ void chain_fifo(const Args& a);
template <typename T, typename Op>
__device__ void lines_chain(const Args& a);
template <typename T, typename Op>
__device__ void ll_oneshot(const Args& a);

template <typename T, typename Op>
__device__ void collective(const Args& a) {
    typedef Family<Op> F;
    // A kind launched on the other family's kernel is a host bug: fail the
    // launch loudly rather than leave the output unwritten.
    if (!F::runs(a.kind)) __trap();
    if (a.kind == K_LOCAL_REDUCE) {
        if (F::move) return;
        __shared__ u64 src[WEFT_MAX_RANKS];
        if (threadIdx.x < WEFT_MAX_RANKS) src[threadIdx.x] = a.scratch[threadIdx.x];
        __syncthreads();
        u64 lo, hi;
        slice<T>(a.count, lo, hi);
        if (hi > lo) reduce_src<T, Op>(src, a.nranks, 0, (T*)a.out, lo, hi);
        return;
    }
    if (a.ll) {
        ll_oneshot<T, Op>(a);
        return;
    }
    if (a.chain == WEFT_CHAIN_LINES) {
        lines_chain<T, Op>(a);
        return;
    }
    if (a.chain) {
        chain_fifo<T, Op>(a);
        return;
    }
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
        // 1. Stage my input for this chunk into my scratch. Per destination:
        // only the peers' parts (they read nothing else of mine); my own
        // part is read from my input in place below.
        if (per_dest) {
            for (int r = 0; r < n; r++)
                if (r != a.rank)
                    copy_bytes(mine + (r * a.chunk + lo) * E, in + (r * count + base + lo) * E, (hi - lo) * E, false);
        } else if (a.kind != K_BROADCAST || a.rank == a.root) {
            copy_bytes(mine + lo * E, in + (base + lo) * E, (hi - lo) * E, false);
        }
        BARRIER(a, 2 * s);
        // 2. Read what this rank needs from every peer.
        switch (a.kind) {
        // (Each case first leaves kernels of the other family: see Family.)
        case K_ALLREDUCE:
            if (F::move) break;
            reduce_src<T, Op>(scr, n, par, (T*)(out + base * E), lo, hi);
            break;
        case K_REDUCE:
            if (F::move) break;
            if (a.rank == a.root) reduce_src<T, Op>(scr, n, par, (T*)(out + base * E), lo, hi);
            break;
        case K_REDUCESCATTER: {
            if (F::move) break;
            // Every peer's part for me from its scratch, mine from my input
            // (in place, that input is this output: each element is read by
            // the thread that then writes it).
            u64 src[WEFT_MAX_RANKS];
            for (int r = 0; r < n; r++)
                src[r] = r == a.rank ? (u64)(in + (a.rank * count + base) * E) : scr[r] + par + a.rank * a.chunk * E;
            reduce_src<T, Op>(src, n, 0, (T*)(out + base * E), lo, hi);
            break;
        }
        case K_ALLGATHER:
            if (F::reduce) break;
            for (int k = 0; k < n; k++) {
                int r = (a.rank + k) % n;
                copy_bytes(out + (r * count + base + lo) * E, (const u8*)a.scratch[r] + par + lo * E, (hi - lo) * E, true);
            }
            break;
        case K_BROADCAST:
            if (F::reduce) break;
            copy_bytes(out + (base + lo) * E, (const u8*)a.scratch[a.root] + par + lo * E, (hi - lo) * E, true);
            break;
        case K_ALLTOALL:
            if (F::reduce) break;
            for (int k = 0; k < n; k++) {
                int r = (a.rank + k) % n;
                if (r == a.rank)
                    copy_bytes(out + (r * count + base + lo) * E, in + (r * count + base + lo) * E, (hi - lo) * E, false);
                else
                    copy_bytes(out + (r * count + base + lo) * E,
                               (const u8*)a.scratch[r] + par + (a.rank * a.chunk + lo) * E, (hi - lo) * E, true);
            }
            break;
        case K_ALLREDUCE_2SHOT: {
            if (F::move) break;
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
            BARRIER(a, 2 * s + 1);
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
    // Ranks in other processes read my scratch until they pass this: after it,
    // my memory is free to reuse or release once my stream is done.
    if (a.exit_barrier) {
        u64 chunks = (count + a.chunk - 1) / a.chunk;
        barrier(a, 2 * (a.seq_base + chunks));
    }
}

// Part k of m of the block slice [lo, hi): whole 16-byte vectors, the last
// part takes the tail.
template <typename T>
__device__ __forceinline__ void part(u64 lo, u64 hi, int k, int m, u64& plo, u64& phi) {
    const u64 V = 16 / sizeof(T);
    u64 per = ((hi - lo + m - 1) / m + V - 1) / V * V;
    plo = lo + k * per;
    phi = plo + per;
    if (plo > hi) plo = hi;
    if (phi > hi) phi = hi;
}

// Pipeline progress of a direct broadcast, a chain or a point-to-point
// FIFO, one counter per block in the flags of the rank that waits (written by the rank it waits for, so
// every wait polls local memory). Values (s << 32) | steps done only grow, so
// a stale value never satisfies a wait. Thread 0 waits for *p >= v and, when
// p2 is not null, *p2 >= v2; false: aborted.
// (__syncthreads_or, as in `barrier`: a shared flag could be overwritten by
// thread 0's next wait before a slower thread read it, where no block
// barrier comes between two calls, as in the last rank of a broadcast ring.)
__device__ __forceinline__ bool wait_progress(u64 status, const u64* p, u64 v, const u64* p2 = nullptr, u64 v2 = 0) {
    int quit = 0;
    if (threadIdx.x == 0) quit = (p && !wait_geq(p, v, status)) || (p2 && !wait_geq(p2, v2, status));
    return __syncthreads_or(quit) == 0;
}
// Publishes the block's writes so far, then the progress value v in *p (if
// not null): one thread fences after the block barrier (which orders every
// thread's writes before it; the system-scope fence is cumulative), so the
// other threads go on copying instead of each waiting for its own writes to
// land. `credit`, if not null, gets v too, without a fence: it only says
// the block's reads are done.
__device__ __forceinline__ void signal_progress(u64* p, u64 v, u64* credit = nullptr) {
    __syncthreads();
    if (threadIdx.x == 0) {
        if (p) {
            __threadfence_system();
            st_release_sys(p, v);
        }
        if (credit) st_release_sys(credit, v);
    }
}

// Broadcast with every rank in this process, this block's slice [lo, hi).
// Small messages: one hop, everyone reads the root's buffer. Otherwise a
// pipeline of `a.step`-byte steps (the host picks the algorithm by size):
// - SCATTER: the root writes piece j of the slice into non-root rank j's
//   output, step by step, raising j's counter; rank j forwards each step of
//   its piece into the other non-root ranks' outputs. Two hops, so the
//   pipeline fills fast: the faster one up to a few hundred MB.
// - RING: ring position p reads each step from p-1's output once p-1 has
//   raised p's counter. One peer in, one out per rank: the faster one for
//   large messages.
// All writes into peers are complete when they pass the exit barrier.
template <typename T>
__device__ bool broadcast_direct(const Args& a, const u64* pin, const u64* pout, u64 lo, u64 hi) {
    const u64 E = sizeof(T);
    const int n = a.nranks;
    const u64 tag = a.seq_base << 32;
    u8* out = (u8*)a.out;
    const int pos = (a.rank - a.root + n) % n;
    const u64 bytes = (hi - lo) * E;
    const u8* root_in = (const u8*)pin[a.root];
    if (n == 1 || a.count * E < WEFT_BCAST_PIPELINE_MIN) {
        if (out + lo * E != root_in + lo * E) copy_bytes(out + lo * E, root_in + lo * E, bytes, pos != 0);
        return true;
    }
    const u64 STEP = a.step;
    const u64* mine = (const u64*)(a.flags[a.rank] + WEFT_PROG_OFF) + blockIdx.x;
    // The root's own output, when the call is not in place.
    if (pos == 0 && out != root_in) copy_bytes(out + lo * E, root_in + lo * E, bytes, false, true);
    if (a.bcast == WEFT_BCAST_SCATTER) {
        const int m = n - 1;
        if (pos == 0) {
            for (u64 j = 0;; j++) {
                const u64 off = j * STEP;
                bool any = false;
                for (int h = 0; h < m; h++) {
                    u64 plo, phi;
                    part<T>(lo, hi, h, m, plo, phi);
                    const u64 pb = (phi - plo) * E;
                    if (off >= pb) continue;
                    any = true;
                    const int r = (a.root + 1 + h) % n;
                    copy_bytes((u8*)pout[r] + plo * E + off, root_in + plo * E + off, pb - off < STEP ? pb - off : STEP,
                               false, true);
                }
                if (!any) break;
                __syncthreads();
                if (threadIdx.x < m) {
                    u64 plo, phi;
                    part<T>(lo, hi, threadIdx.x, m, plo, phi);
                    if (off < (phi - plo) * E) {
                        __threadfence_system();
                        st_release_sys((u64*)(a.flags[(a.root + 1 + threadIdx.x) % n] + WEFT_PROG_OFF) + blockIdx.x,
                                       tag | (j + 1));
                    }
                }
            }
            return true;
        }
        const int h = pos - 1;
        u64 plo, phi;
        part<T>(lo, hi, h, m, plo, phi);
        const u64 pb = (phi - plo) * E;
        for (u64 j = 0, off = 0; off < pb; j++, off += STEP) {
            if (!wait_progress(a.status, mine, tag | (j + 1))) return false;
            const u64 len = pb - off < STEP ? pb - off : STEP;
            for (int k = 1; k < m; k++) {
                const int r = (a.root + 1 + (h + k) % m) % n;
                copy_bytes((u8*)pout[r] + plo * E + off, out + plo * E + off, len, true, true);
            }
        }
        return true;
    }
    // RING.
    if (pos == 0) return true;
    const u64 nsteps = (bytes + STEP - 1) / STEP;
    const int pred = (a.rank - 1 + n) % n, succ = (a.rank + 1) % n;
    const u8* src = (pos == 1 ? root_in : (const u8*)pout[pred]) + lo * E;
    u64* theirs = (u64*)(a.flags[succ] + WEFT_PROG_OFF) + blockIdx.x;
    for (u64 j = 0; j < nsteps; j++) {
        if (pos > 1 && !wait_progress(a.status, mine, tag | (j + 1))) return false;
        const u64 off = j * STEP, len = bytes - off < STEP ? bytes - off : STEP;
        copy_bytes(out + lo * E + off, src + off, len, true, true);
        if (pos < n - 1) signal_progress(theirs, tag | (j + 1));
    }
    return true;
}

// Direct mode (ranks in one process): no staging copy and no chunking; peers'
// user buffers are read (or, with `push`, written) in place. Barriers: 2s
// (pointers published, inputs ready), 2s+1 (second phase: first-phase results
// ready), 2s+2 (exit: nobody touches my buffers any more, so the caller may
// reuse them). Consumes two sequence numbers.
template <typename T, typename Op>
__device__ void collective_direct(const Args& a) {
    typedef Family<Op> F;
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
    BARRIER(a, 2 * s);
    if (threadIdx.x < n) {
        const u64* slot = (const u64*)(a.flags[threadIdx.x] + WEFT_PTR_OFF) + blockIdx.x * 2;
        pin[threadIdx.x] = ld_cv(slot);
        pout[threadIdx.x] = ld_cv(slot + 1);
    }
    __syncthreads();
    u8* out = (u8*)a.out;
    u64 lo, hi;
    slice<T>(count, lo, hi);
    // Non-root ranks are numbered 0..n-2 ("helpers") for reduce and broadcast.
    const int helper = (a.rank - a.root - 1 + n) % n;
    switch (a.kind) {
    // (Each case first leaves kernels of the other family: see Family.)
    case K_REDUCE: {
        if (F::move) break;
        // The n-1 non-root ranks share the range; a chunk's helper reduces it
        // from every input (the root's included) and stores it straight into
        // the root's output. Every link then carries about the message size
        // once (the root only receives), like a ring but without pipeline
        // fill. In place is safe: only one helper reads or writes a chunk.
        if (n == 1) {
            if (out != (const u8*)a.in) copy_bytes(out + lo * E, (const u8*)a.in + lo * E, (hi - lo) * E, false);
            break;
        }
        // Small messages: the root reads every input itself and writes only
        // locally, one link crossing instead of a read and a remote write
        // that the helper must fence before the exit barrier.
        if (count * E <= WEFT_REDUCE_AT_ROOT_MAX) {
            if (a.rank == a.root) reduce_src<T, Op>(pin, n, 0, (T*)out, lo, hi);
            break;
        }
        if (a.rank == a.root) break;
        // Chunk k (a.step bytes) is helper k % m's, in its block (k / m) % G:
        // all blocks stream through neighbouring memory (one far-apart slice
        // per block measured 3-5% slower at 512 MB - 2 GB).
        const u64 C = a.step / E, m = n - 1, nch = (count + C - 1) / C;
        for (u64 k = helper + m * blockIdx.x; k < nch; k += m * gridDim.x)
            reduce_src<T, Op>(pin, n, 0, (T*)pout[a.root], k * C, (k + 1) * C < count ? (k + 1) * C : count);
        break;
    }
    case K_REDUCESCATTER:
        if (F::move) break;
        reduce_src<T, Op>(pin, n, a.rank * count * E, (T*)out, lo, hi);
        break;
    case K_ALLGATHER:
        if (F::reduce) break;
        // Block b starts at peer rank + b: at any time some blocks copy
        // locally (HBM) while the others use the links, instead of every
        // block doing its local copy first with the links idle.
        for (int k = 0; k < n; k++) {
            int r = (a.rank + k + blockIdx.x) % n;
            if (a.push) {
                // My input into everyone's output, at my block of it.
                u8* dst = (u8*)pout[r] + (a.rank * count + lo) * E;
                const u8* src = (const u8*)a.in + lo * E;
                if (dst != src) copy_bytes(dst, src, (hi - lo) * E, false, true);
            } else {
                u8* dst = out + (r * count + lo) * E;
                const u8* src = (const u8*)pin[r] + lo * E;
                if (dst != src) copy_bytes(dst, src, (hi - lo) * E, true, true);
            }
        }
        break;
    case K_BROADCAST:
        if (F::reduce) break;
        if (!broadcast_direct<T>(a, pin, pout, lo, hi)) return;
        break;
    case K_ALLTOALL:
        if (F::reduce) break;
        for (int k = 0; k < n; k++) {
            int r = (a.rank + k + blockIdx.x) % n;  // staggered as all-gather's
            if (a.push)
                copy_bytes((u8*)pout[r] + (a.rank * count + lo) * E, (const u8*)a.in + (r * count + lo) * E, (hi - lo) * E,
                           false, true);
            else
                copy_bytes(out + (r * count + lo) * E, (const u8*)pin[r] + (a.rank * count + lo) * E, (hi - lo) * E, true, true);
        }
        break;
    case K_ALLREDUCE_2SHOT: {
        if (F::move) break;
        u64 plo, phi;
        part<T>(lo, hi, a.rank, n, plo, phi);
        // My part of every input -> my output (in place: only I read my part).
        reduce_src<T, Op>(pin, n, 0, (T*)out, plo, phi);
        BARRIER(a, 2 * s + 1);
        for (int k = 1; k < n; k++) {
            int r = (a.rank + k) % n;
            u64 qlo, qhi;
            part<T>(lo, hi, r, n, qlo, qhi);
            copy_bytes(out + qlo * E, (const u8*)pout[r] + qlo * E, (qhi - qlo) * E, true);
        }
        break;
    }
    }
    barrier(a, 2 * s + 2);
}

// ---------------------------------------------------------------- chain
// op(got, mine) element by element (got absent: mine), finished (avg: / n)
// on the chain's last rank; the partial result is stored in T at every hop,
// as NCCL does. 16 bytes: 16 / sizeof(T) elements.
template <typename T, typename Op>
__device__ __forceinline__ uint4 vec_reduce(uint4 mine, uint4 got, bool has_got, bool finish, int n) {
    typedef typename Acc<T>::type A;
    const T* xt = (const T*)&mine;
    const T* yt = (const T*)&got;
    uint4 o;
    T* ot = (T*)&o;
#pragma unroll
    for (int k = 0; k < (int)(16 / sizeof(T)); k++) {
        A acc = load<T>(xt[k]);
        if (has_got) acc = Op::f(load<T>(yt[k]), acc);
        ot[k] = store<T>(finish ? Finish<Op, A>::f(acc, n) : acc);
    }
    return o;
}

// One step of a reduce chain: dst[i] = op(mine[i], slot[i]) for `elems`
// elements (slot null: the first rank, mine alone), finished (avg: / n) on
// the last rank. `slot` was written by the predecessor (cv loads).
template <typename T, typename Op>
__device__ __forceinline__ void reduce_step(T* dst, const T* mine, const T* slot, u64 elems, bool finish, int n) {
    typedef typename Acc<T>::type A;
    const u64 V = 16 / sizeof(T);
    if (!slot && !finish) {
        copy_bytes((u8*)dst, (const u8*)mine, elems * sizeof(T), false, true);
        return;
    }
    u64 vend = ((((u64)dst | (u64)mine | (u64)slot) & 15) == 0) ? elems / V * V : 0;
    for (u64 i = threadIdx.x * V; i < vend; i += (u64)blockDim.x * V) {
        uint4 x = *(const uint4*)(mine + i);
        uint4 y = slot ? ld_cv4((const uint4*)(slot + i)) : x;
        *(uint4*)(dst + i) = vec_reduce<T, Op>(x, y, slot != nullptr, finish, n);
    }
    for (u64 i = vend + threadIdx.x; i < elems; i += blockDim.x) {
        A acc = load<T>(mine[i]);
        if (slot) acc = Op::f(load<T>(ld_cv(slot + i)), acc);
        dst[i] = store<T>(finish ? Finish<Op, A>::f(acc, n) : acc);
    }
}

// Broadcast and reduce as NCCL shapes them: a pipelined chain r -> r+1 in
// rank order, from the root (broadcast) or to the root (reduce), through
// `a.slots` slots of `a.step` bytes per block in every rank's scratch. A
// rank reads a step from its own slot (local memory: the predecessor wrote
// it over NVLink), stores it into its output and/or its successor's slot,
// then raises the successor's tail and gives the predecessor a credit. Every
// link carries the message once, in one direction, as remote writes into a
// small window, and no rank touches another rank's user buffers: the same
// kernel serves ranks in one process and in several (CUDA IPC), and a rank's
// buffers are free when its own kernel ends. (One pipeline per warp instead
// of per block, and fence.acq_rel instead of fence.sc, measured no faster.)
//
// Tails and credits carry (seq << 32) | steps, so values of earlier
// operations never satisfy a wait. The entry barrier means every rank has
// finished its previous operation: nobody reads my scratch any more, so my
// slots are free. No exit barrier: a rank ends after its predecessor's last
// step reached it and its successor drained its last step, and the next
// operation's entry barrier waits for everyone.
// Reduce partial results are stored in T at every hop (as NCCL does).
template <typename T, typename Op>
__device__ void chain_fifo(const Args& a) {
    const u64 E = sizeof(T);
    const int n = a.nranks;
    const u64 s = a.seq_base;
    BARRIER(a, 2 * s);
    // Broadcast (moving kernels) or reduce (reducing kernels).
    const bool bcast = Family<Op>::move;
    const int first = bcast ? a.root : (a.root + 1) % n;
    const int pos = (a.rank - first + n) % n;
    const int pred = (a.rank - 1 + n) % n, succ = (a.rank + 1) % n;
    const bool has_pred = pos > 0, has_succ = pos < n - 1;
    u64 lo, hi;
    slice<T>(a.count, lo, hi);
    const u64 bytes = (hi - lo) * E;
    const u64 STEP = a.step, SLOTS = a.slots, tag = s << 32;
    const u8* my_fifo = (const u8*)a.scratch[a.rank] + blockIdx.x * SLOTS * STEP;
    u8* succ_fifo = (u8*)a.scratch[succ] + blockIdx.x * SLOTS * STEP;
    const u64* tail = (const u64*)(a.flags[a.rank] + WEFT_CHAIN_TAIL_OFF) + blockIdx.x;
    const u64* credit = (const u64*)(a.flags[a.rank] + WEFT_CHAIN_CRED_OFF) + blockIdx.x;
    u64* succ_tail = (u64*)(a.flags[succ] + WEFT_CHAIN_TAIL_OFF) + blockIdx.x;
    u64* pred_credit = (u64*)(a.flags[pred] + WEFT_CHAIN_CRED_OFF) + blockIdx.x;
    const u8* in = (const u8*)a.in + lo * E;
    u8* out = (u8*)a.out + lo * E;
    for (u64 j = 0, off = 0; off < bytes; j++, off += STEP) {
        const u64 len = bytes - off < STEP ? bytes - off : STEP;
        const u64 at = (j % SLOTS) * STEP;
        // My slot holds step j; my successor has drained step j - SLOTS.
        if (!wait_progress(a.status, has_pred ? tail : nullptr, tag | (j + 1),
                           has_succ && j >= SLOTS ? credit : nullptr, tag | (j + 1 - SLOTS)))
            return;
        if (bcast) {
            u8* local = (has_pred || out != in) ? out + off : nullptr;
            const u8* src = has_pred ? my_fifo + at : in + off;
            if (has_succ)
                copy_bytes_u<8>(succ_fifo + at, local, src, len, has_pred);
            else
                copy_bytes(local, src, len, true, true);
        } else {
            reduce_step<T, Op>((T*)(has_succ ? succ_fifo + at : out + off), (const T*)(in + off),
                               has_pred ? (const T*)(my_fifo + at) : nullptr, len / E, !has_succ, n);
        }
        signal_progress(has_succ ? succ_tail : nullptr, tag | (j + 1), has_pred ? pred_credit : nullptr);
    }
    // Until my successor has drained every step: then none of its writes
    // (credits) reaches my memory after this kernel, so the memory may be
    // freed once my stream is idle (as the exit barrier of the other kernels
    // guarantees).
    if (has_succ && bytes > 0 && threadIdx.x == 0) wait_geq(credit, tag | ((bytes + STEP - 1) / STEP), a.status);
}

// ---------------------------------------------------------------- lines
// The chain again (same order, same roles: broadcast from the root, reduce
// to it), but without a fence and a flag hand-off per step: the data carries
// its own flags, as NCCL's LL128 protocol does. A 128-byte line is written
// by 8 lanes of one warp store (16 bytes each); the last lane's second word
// is the flag, so a line holds 120 bytes of data. Over NVLink a warp's
// 128-byte store lands whole, so a receiver that sees the flag sees the
// line: it polls its own memory and forwards line by line, with no step to
// fill and no fence on the way. The host uses lines only where every link
// is NVLink (see DevComm::connect) and on sm_80 and newer.
//
// Each warp is its own pipeline: warp g of every rank handles iterations
// g, g + G, ... (G warps in all) of LINES_U groups each; a group is two
// 512-byte wire rows carrying 60 16-byte data vectors (lane l: vector l,
// and 32 + l - l/8 unless l is a flag lane, whose second half rides in the
// second row's first word). Iteration k of warp g sits in slot k % W of the
// warp's window in the successor's lines area (scratch + 2 * parity_bytes,
// written only by the predecessor r - 1); flags are (seq << 32) | (k + 1),
// so a line of an earlier operation or an earlier lap never matches. The
// successor credits iterations back (one u64 per warp in my flags area);
// at the end every sender waits for its last credit, so when a kernel has
// ended no peer still reads what it wrote or writes into its memory, and the
// next operation (stream-ordered after it) may refill the windows without an
// entry barrier.
#define LINES_U 4
#define LINES_GROUP_VECS 60
#define LINES_ROW_WORDS 64
#define LINES_ITER_WORDS (LINES_U * 2 * LINES_ROW_WORDS)

__device__ __forceinline__ void st_vol2(u64* p, u64 x, u64 y) {
    asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(x), "l"(y) : "memory");
}
__device__ __forceinline__ void ld_vol2(const u64* p, u64& x, u64& y) {
    asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(x), "=l"(y) : "l"(p) : "memory");
}
__device__ __forceinline__ u64 lo64(uint4 v) { return (u64)v.x | ((u64)v.y << 32); }
__device__ __forceinline__ u64 hi64(uint4 v) { return (u64)v.z | ((u64)v.w << 32); }
__device__ __forceinline__ uint4 vec2(u64 lo, u64 hi) {
    return make_uint4((u32)lo, (u32)(lo >> 32), (u32)hi, (u32)(hi >> 32));
}

// The rare path of load_vec / store_vec (a buffer that is not 16-byte
// aligned, or the partial last vector): out of line, so that the many
// inlined copies of the fast path stay small.
__device__ __noinline__ uint4 load_vec_bytes(const u8* base, u64 off, u64 bytes) {
    u8 b[16];
#pragma unroll
    for (int i = 0; i < 16; i++) b[i] = off + i < bytes ? base[off + i] : 0;
    uint4 r;
    memcpy(&r, b, 16);
    return r;
}
__device__ __noinline__ void store_vec_bytes(u8* base, u64 off, u64 bytes, uint4 x) {
    u8 b[16];
    memcpy(b, &x, 16);
#pragma unroll
    for (int i = 0; i < 16; i++)
        if (off + i < bytes) base[off + i] = b[i];
}

// 16-byte vector v of a user buffer of `bytes` bytes (zeros past the end);
// byte by byte where the buffer is not 16-byte aligned (nccl-tests -u) or
// the vector is the partial last one.
__device__ __forceinline__ uint4 load_vec(const u8* base, u64 v, u64 bytes) {
    const u64 off = v * 16;
    if (off + 16 <= bytes && ((u64)base & 15) == 0) return *(const uint4*)(base + off);
    return load_vec_bytes(base, off, bytes);
}
__device__ __forceinline__ void store_vec(u8* base, u64 v, u64 bytes, uint4 x) {
    const u64 off = v * 16;
    if (off + 16 <= bytes && ((u64)base & 15) == 0) {
        *(uint4*)(base + off) = x;
        return;
    }
    store_vec_bytes(base, off, bytes, x);
}

// Lane 0 waits until *p >= need (its value then in `seen` for the whole
// warp); false: aborted.
__device__ __forceinline__ bool warp_wait_geq(const u64* p, u64 need, u64& seen, u64 status) {
    int ok = 1;
    if ((threadIdx.x & 31) == 0) {
        ok = wait_geq(p, need, status);
        seen = ld_acquire_sys(p);
    }
    seen = __shfl_sync(0xffffffffu, seen, 0);
    return __shfl_sync(0xffffffffu, ok, 0) != 0;
}

// Waits until every line of this lane's rows (row r at rows + r * 64 words)
// carries `flag`, then reads them whole. Only the flag lanes poll, and only
// their flag words (a quarter of the L2 traffic of polling whole lines
// while NVLink writes land in them); once the warp agreed that every line
// has landed, every lane reads its words, so it sees whole lines whatever
// order the line's parts landed in. False: aborted.
__device__ __forceinline__ bool lines_recv(const u64* rows, u64 flag, u64 (&w)[2 * LINES_U][2], u64 status) {
    const bool flag_lane = (threadIdx.x & 7) == 7;
    u32 spins = 0;
    u64 since = 0;
    while (true) {
        bool missing = false;
        if (flag_lane) {
#pragma unroll
            for (int r = 0; r < 2 * LINES_U; r++) missing |= *(const volatile u64*)(rows + r * LINES_ROW_WORDS + 1) != flag;
        }
        if (!__any_sync(0xffffffffu, missing)) break;
        if (++spins == 1024) {
            spins = 0;
            bool stop = false;
            if ((threadIdx.x & 31) == 0) {
                since = still_waiting(status, rows, since);
                stop = since == WEFT_ABORTED;
            }
            if (__any_sync(0xffffffffu, stop)) return false;
        }
    }
#pragma unroll
    for (int r = 0; r < 2 * LINES_U; r++) ld_vol2(rows + r * LINES_ROW_WORDS, w[r][0], w[r][1]);
    return true;
}

template <typename T, typename Op>
__device__ void lines_chain(const Args& a) {
    const int n = a.nranks;
    // Broadcast (moving kernels) or reduce (reducing kernels).
    const bool bcast = Family<Op>::move;
    const int first = bcast ? a.root : (a.root + 1) % n;
    const int pos = (a.rank - first + n) % n;
    const int pred = (a.rank - 1 + n) % n, succ = (a.rank + 1) % n;
    const bool has_pred = pos > 0, has_succ = pos < n - 1;
    const int lane = threadIdx.x & 31;
    const bool flag_lane = (lane & 7) == 7;
    // This lane's second vector of a group (flag lanes have none).
    const u64 second = 32 + lane - lane / 8;
    const u64 warps = blockDim.x / 32;
    const u64 G = gridDim.x * warps;
    const u64 g = blockIdx.x * warps + threadIdx.x / 32;
    const u64 bytes = a.count * sizeof(T);
    const u64 vecs = (bytes + 15) / 16;
    const u64 iter_vecs = (u64)LINES_U * LINES_GROUP_VECS;
    const u64 iters = (vecs + iter_vecs - 1) / iter_vecs;
    const u64 mine = iters > g ? (iters - g + G - 1) / G : 0;
    const u64 W = a.slots;
    const u64 every = W / 2 > 0 ? W / 2 : 1;  // credit every `every` iterations
    const u64 tag = a.seq_base << 32;
    const u64 lines_off = 2 * a.parity_bytes + g * W * LINES_ITER_WORDS * 8;
    const u64* my_rows = (const u64*)(a.scratch[a.rank] + lines_off) + 2 * lane;
    u64* succ_rows = (u64*)(a.scratch[succ] + lines_off) + 2 * lane;
    const u64* credit = (const u64*)(a.flags[a.rank] + WEFT_LINES_CRED_OFF) + g;
    u64* pred_credit = (u64*)(a.flags[pred] + WEFT_LINES_CRED_OFF) + g;
    const u8* in = (const u8*)a.in;
    u8* out = (u8*)a.out;
    const bool copy_out = bcast ? (has_pred || out != in) : !has_succ;
    const bool own_input = !bcast || !has_pred;
    u64 seen = 0;
    for (u64 k = 0; k < mine; k++) {
        const u64 v0 = (g + k * G) * iter_vecs;
        const u64 flag = tag | (k + 1);
        const u64 slot = (k % W) * LINES_ITER_WORDS;
        // Room in the successor's window: it has drained iteration k - W.
        if (has_succ && k >= W && seen < (tag | (k + 1 - W)))
            if (!warp_wait_geq(credit, tag | (k + 1 - W), seen, a.status)) return;
        // My own input first (the root's data, or my term of the reduce),
        // so its loads are in flight while the predecessor's lines land.
        uint4 x[2 * LINES_U];
        if (own_input) {
#pragma unroll
            for (int q = 0; q < LINES_U; q++) {
                const u64 gv = v0 + q * LINES_GROUP_VECS;
                x[2 * q] = load_vec(in, gv + lane, bytes);
                x[2 * q + 1] = flag_lane ? make_uint4(0, 0, 0, 0) : load_vec(in, gv + second, bytes);
            }
        }
        u64 w[2 * LINES_U][2];
        if (has_pred && !lines_recv(my_rows + slot, flag, w, a.status)) return;
#pragma unroll
        for (int q = 0; q < LINES_U; q++) {
            // This lane's two vectors of group q (a flag lane's one: r0).
            uint4 r0 = make_uint4(0, 0, 0, 0), r1 = r0;
            if (has_pred) {
                r0 = flag_lane ? vec2(w[2 * q][0], w[2 * q + 1][0]) : vec2(w[2 * q][0], w[2 * q][1]);
                r1 = vec2(w[2 * q + 1][0], w[2 * q + 1][1]);
            }
            if (!bcast) {
                r0 = vec_reduce<T, Op>(x[2 * q], r0, has_pred, !has_succ, n);
                r1 = vec_reduce<T, Op>(x[2 * q + 1], r1, has_pred, !has_succ, n);
            } else if (!has_pred) {
                r0 = x[2 * q];
                r1 = x[2 * q + 1];
            }
            if (has_succ) {
                u64* row = succ_rows + slot + 2 * q * LINES_ROW_WORDS;
                if (bcast && has_pred) {
                    // Forwarded as received: the successor's flag is mine.
                    st_vol2(row, w[2 * q][0], w[2 * q][1]);
                    st_vol2(row + LINES_ROW_WORDS, w[2 * q + 1][0], w[2 * q + 1][1]);
                } else {
                    st_vol2(row, lo64(r0), flag_lane ? flag : hi64(r0));
                    st_vol2(row + LINES_ROW_WORDS, flag_lane ? hi64(r0) : lo64(r1), flag_lane ? flag : hi64(r1));
                }
            }
            if (copy_out) {
                const u64 gv = v0 + q * LINES_GROUP_VECS;
                store_vec(out, gv + lane, bytes, r0);
                if (!flag_lane) store_vec(out, gv + second, bytes, r1);
            }
        }
        // Credit the predecessor: this warp's reads of the slot are done
        // (their values were used above).
        if (has_pred && ((k + 1) % every == 0 || k + 1 == mine)) {
            __syncwarp();
            if (lane == 0) st_release_sys(pred_credit, tag | (k + 1));
        }
    }
    // Until my successor has drained every iteration (see above).
    if (has_succ && mine > 0) warp_wait_geq(credit, tag | mine, seen, a.status);
}

// ---------------------------------------------------------------- LL one-shot
// Small collectives in one hop, for ranks in other processes (NCCL's LL
// protocol): a 16-byte line carries 8 data bytes and the operation's flag
// twice ({d0, f, d1, f}); 8-byte halves land whole, so a receiver whose
// 16-byte load sees both flags has the data. Every rank pushes what each
// peer needs into that peer's LL area (the slot of its parity half for this
// sender) and then waits on its own memory only: no fence, no barrier, no
// data read across the link (only the count below, where needed), and one
// transfer where the staged path has a barrier round, a remote read and an
// exit barrier.
//
// Reuse: the flag is the host's count of LL operations modulo 2^32 - 1,
// plus 1 (never 0, so never the area's initial zeros; a line could match a
// stale one only after 2 * (2^32 - 1) operations, hours of back-to-back
// 5 us operations, and only where no operation in between rewrote it), and
// consecutive operations use opposite parity halves. A sender may write a receiver's half again once the receiver has
// finished the LL operation two before (the last one to read it). Usually
// the operation in between proves it: the sender received the receiver's
// data of that one, pushed only after the receiver's earlier kernel had
// ended (stream order). Where it did not (a broadcast root, a reduce's
// senders), the host sets the receiver in `ll_check` and the sender reads
// the receiver's WEFT_LL_COUNT (blocks of LL kernels finished, raised by
// each block at its end) until it reaches `ll_need`. Only LL kernels touch
// the area, and all they write into a peer's memory is data the peer waits
// for, so there is no exit barrier and nothing lands after a kernel ends.
//
// Thread t handles 16-byte vector v of every part (two lines): it loads all
// it sends before it stores any output, so in-place calls are safe (the
// vectors of other threads are other addresses). Reductions go in rank
// order with the accumulator in Acc<T>, as the staged one-shot (reduce_src):
// every rank gets the same bits.
#define WEFT_LL_SLOT (512 << 10)  // wire bytes per sender per parity half: 256 KiB of data

__device__ __forceinline__ void st_ll(u32* p, uint4 x, u32 f) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(x.x), "r"(f), "r"(x.y), "r"(f)
                 : "memory");
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p + 4), "r"(x.z), "r"(f), "r"(x.w), "r"(f)
                 : "memory");
}

// Waits until both lines at p carry flag f, then returns their data in x;
// false: aborted.
__device__ __forceinline__ bool ld_ll(const u32* p, u32 f, uint4& x, u64 status) {
    u32 spins = 0;
    u64 since = 0;
    while (true) {
        u32 a0, a1, a2, a3, b0, b1, b2, b3;
        asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3)
                     : "l"(p)
                     : "memory");
        asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                     : "l"(p + 4)
                     : "memory");
        if (a1 == f && a3 == f && b1 == f && b3 == f) {
            x = make_uint4(a0, a2, b0, b2);
            return true;
        }
        if (++spins == 1024) {
            spins = 0;
            since = still_waiting(status, p, since);
            if (since == WEFT_ABORTED) return false;
        }
    }
}

// A 16-byte vector's elements reduced in Acc<T>.
template <typename T, typename Op>
struct VecAcc {
    typedef typename Acc<T>::type A;
    A v[16 / sizeof(T)];
    __device__ __forceinline__ void set(uint4 x) {
        const T* t = (const T*)&x;
#pragma unroll
        for (int k = 0; k < (int)(16 / sizeof(T)); k++) v[k] = load<T>(t[k]);
    }
    __device__ __forceinline__ void add(uint4 x) {
        const T* t = (const T*)&x;
#pragma unroll
        for (int k = 0; k < (int)(16 / sizeof(T)); k++) v[k] = Op::f(v[k], load<T>(t[k]));
    }
    __device__ __forceinline__ uint4 finish(int n) const {
        uint4 o;
        T* t = (T*)&o;
#pragma unroll
        for (int k = 0; k < (int)(16 / sizeof(T)); k++) t[k] = store<T>(Finish<Op, A>::f(v[k], n));
        return o;
    }
};

template <typename T, typename Op>
__device__ void ll_oneshot(const Args& a) {
    const int n = a.nranks, me = a.rank, root = a.root, kind = a.kind;
    const u32 f = (u32)a.ll;
    const u64 B = a.count * sizeof(T);  // bytes of one part (NCCL's count)
    const u64 nv = (B + 15) / 16;
    const u8* in = (const u8*)a.in;
    u8* out = (u8*)a.out;
    const bool per_dest = kind == K_REDUCESCATTER || kind == K_ALLTOALL;
    const bool reduces = Family<Op>::reduce;  // else broadcast, all-gather or all-to-all
    const bool sends = kind == K_BROADCAST ? me == root : kind == K_REDUCE ? me != root : true;
    const bool receives = kind == K_BROADCAST ? me != root : kind == K_REDUCE ? me == root : true;
    // My slot in each peer's area, and each peer's slot in mine.
    __shared__ u32* to[WEFT_MAX_RANKS];
    __shared__ const u32* from[WEFT_MAX_RANKS];
    if (threadIdx.x < WEFT_MAX_RANKS && threadIdx.x < n) {
        const int r = threadIdx.x;
        to[r] = (u32*)(a.scratch[r] + a.ll_off + (u64)me * WEFT_LL_SLOT);
        from[r] = (const u32*)(a.scratch[me] + a.ll_off + (u64)r * WEFT_LL_SLOT);
    }
    __syncthreads();
    // The block agrees through __syncthreads_or (see `barrier`).
    const int quit = sends && threadIdx.x < n && ((a.ll_check >> threadIdx.x) & 1) &&
                     !wait_geq((const u64*)(a.flags[threadIdx.x] + WEFT_LL_COUNT), a.ll_need, a.status);
    if (__syncthreads_or(quit)) return;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    // False once a wait of this thread was aborted: it stops, and still
    // meets the others at the block barrier below (every thread reaches it,
    // each leaving its own waits on the abort), so nothing depends on how
    // a barrier treats threads that have exited.
    bool ok = true;
    for (u64 v = (u64)blockIdx.x * blockDim.x + threadIdx.x; ok && v < nv; v += stride) {
        // 1. Push: the whole input (or my part d of it) to every peer that
        // needs it.
        uint4 own = make_uint4(0, 0, 0, 0);
        if (sends) {
            if (per_dest) {
                for (int k = 1; k < n; k++) {
                    const int d = (me + k) % n;
                    st_ll(to[d] + v * 8, load_vec(in + d * B, v, B), f);
                }
            } else {
                own = load_vec(in, v, B);
                if (kind == K_REDUCE) {
                    st_ll(to[root] + v * 8, own, f);
                } else {
                    for (int k = 1; k < n; k++) st_ll(to[(me + k) % n] + v * 8, own, f);
                }
            }
        }
        if (!receives) {
            // The broadcast root's own output (no peer sends it anything).
            if (kind == K_BROADCAST && out != in) store_vec(out, v, B, own);
            continue;
        }
        // 2. Receive from my own memory.
        if (reduces) {
            if (kind == K_REDUCESCATTER) own = load_vec(in + me * B, v, B);
            else if (!sends) own = load_vec(in, v, B);
            VecAcc<T, Op> acc;
            for (int r = 0; ok && r < n; r++) {
                uint4 x = own;
                if (r != me) ok = ld_ll(from[r] + v * 8, f, x, a.status);
                if (r == 0) acc.set(x);
                else acc.add(x);
            }
            if (ok) store_vec(out, v, B, acc.finish(n));
        } else if (kind == K_BROADCAST) {
            uint4 x;
            ok = ld_ll(from[root] + v * 8, f, x, a.status);
            if (ok) store_vec(out, v, B, x);
        } else {
            // All-gather, all-to-all: part r of my output from rank r.
            for (int k = 0; ok && k < n; k++) {
                const int r = (me + k) % n;
                uint4 x;
                if (r == me) x = per_dest ? load_vec(in + me * B, v, B) : own;
                else ok = ld_ll(from[r] + v * 8, f, x, a.status);
                if (ok) store_vec(out + r * B, v, B, x);
            }
        }
    }
    // This block is done with my half: count it (not after an abort: the
    // communicator is dead). Its reads are complete (their values were
    // stored before the block barrier), so a GPU-scope fence before the
    // count suffices in practice, as in NCCL's LL; the reader on another GPU
    // acquires it with system scope.
    const int broke = __syncthreads_or(!ok);
    if (threadIdx.x == 0 && !broke) {
        __threadfence();
        atomicAdd((unsigned long long*)(a.flags[me] + WEFT_LL_COUNT), 1ull);
    }
}

// ---------------------------------------------------------------- point to point
// Sends, receives and local copies of one group round on one communicator, in
// one kernel (ranks in one process: the receiver reads the sender's buffer in
// place). A round holds at most one send and one receive per peer, so the
// {ptr, bytes} slot of a sender on its receiver is never overwritten before
// the receiver is done; every rank fuses its rounds the same way, so the
// i-th kernels of all ranks only wait on each other and rounds cannot
// deadlock.
//
// Ranks in other processes stream through the receiver's scratch instead
// (p2p_send_fifo). In one process, per op: a send is one block: write
// {ptr, bytes} into my slot on the receiver, raise ready[me] there to the
// pair's sequence number, wait for done[receiver] on mine.
// A receive is `nblocks` blocks: wait for ready, read the slot (local), copy
// a slice; the last block to finish (a local counter) raises done[me] on the
// sender. Sizes that differ are reported in Status.error and both sides finish.
// A send first waits for done >= seq - 1 (the previous send to that peer was
// received): sends to one peer may run in two kernels at once since sends
// can be eager (a side stream; libcomm/src/cuda/eager.rs has the argument).
// Across processes the sender already waits for rready >= seq, which the
// receiver raises only after its previous receive from us drained.
#define WEFT_MAX_P2P 16
#define P2P_SEND 0
#define P2P_RECV 1
#define P2P_COPY 2
// The cross-host path's copies between device buffers and pinned host
// memory (libcomm/src/cuda/pinned_copy.rs), as the first op of a launch:
// every block copies its part of every op in order (so the first op's
// bytes are all there first), with cache-bypassing loads where `peer` is 1
// (pinned memory the CPU wrote); where `base` is set, the block then
// writes `seq` into word b of the u32 array at `base` (the job's pinned
// header: its copies are done once every block's word reached `seq`).
// Where `wait` is set, the block first waits until that u32 word (the job's
// `done`, which the host's progress thread raises, also on abort) reaches
// `seq`: every job's copies out are one launch of a few blocks, or ride at
// the end of the launch of the copies in on its first `nblocks` blocks
// (the others end there): one launch for the whole call.
#define P2P_COPY_SEQ 3
struct P2pOp {
    u64 ptr;      // send: source; recv: destination; copy: destination
    u64 src;      // copy: source
    u64 bytes;
    u64 seq;      // send/recv: the pair's sequence number (from 1)
    u64 base;     // recv: blocks finished from this sender before this op
    i32 peer;
    i32 kind;
    i32 block0;   // first block of this op
    i32 nblocks;
    u64 wait;     // copy-seq: a u32 word the block waits on (>= seq, cyclic) first; 0: none
};
struct P2pArgs {
    u64 flags[WEFT_MAX_RANKS];
    u64 status;
    i32 rank;
    i32 nops;
    P2pOp ops[WEFT_MAX_P2P];
    // Ranks in other processes (direct == 0): each receiver's scratch holds
    // a region of `region` bytes per sender, `slots` slots of `step` bytes
    // per block of an op.
    u64 scratch[WEFT_MAX_RANKS];
    u64 region;
    u64 step;
    u64 slots;
    i32 direct;
};

// The slice [lo, hi) of an op's bytes that block b of nb moves (16-byte
// multiples, so every block's copies stay aligned where the buffer is).
__device__ __forceinline__ void p2p_slice(u64 bytes, int b, int nb, u64& lo, u64& hi) {
    u64 per = ((bytes + nb - 1) / nb + 15) / 16 * 16;
    lo = b * per;
    hi = lo + per;
    if (lo > bytes) lo = bytes;
    if (hi > bytes) hi = bytes;
}

__device__ __forceinline__ void report(u64 status, u32 code, int peer, u64 bytes) {
    volatile Status* st = (volatile Status*)status;
    if (st) {
        st->detail = ((u64)peer << 56) | (bytes & ((1ull << 56) - 1));
        st->error = code;
    }
}

// Point-to-point across processes: the receiver cannot read the sender's
// buffer, so block b of a send streams its slice through `slots` slots in
// the receiver's scratch (its region for this sender), as a chain hop does:
// copy a step into a slot, fence, raise the receiver's tail; reuse a slot
// once the receiver's credit says it drained it. The receiver first posts
// the bytes it expects and its sequence number on the sender (its kernel
// running means its earlier kernels, which used its scratch, are done);
// a sender whose size differs reports it, tells the receiver's blocks with
// a marked tail, and both sides finish. Tags (seq << 32) | steps keep
// earlier operations' values from satisfying a wait.
__device__ void p2p_send_fifo(const P2pArgs& a, const P2pOp& op, int b) {
    const u64 me = a.flags[a.rank], them = a.flags[op.peer];
    const u64 tag = op.seq << 32, STEP = a.step, SLOTS = a.slots;
    __shared__ u64 rbytes;
    if (!wait_progress(a.status, (const u64*)(me + WEFT_P2P_RREADY) + op.peer, op.seq)) return;
    if (threadIdx.x == 0) rbytes = ld_cv((const u64*)(me + WEFT_P2P_RBYTES) + op.peer);
    __syncthreads();
    u64* tail = (u64*)(them + WEFT_P2P_TAIL) + a.rank * WEFT_P2P_FIFO_MAXB + b;
    if (rbytes != op.bytes) {
        if (threadIdx.x == 0) {
            if (b == 0) report(a.status, WEFT_ERR_P2P_SIZE_SEND, op.peer, rbytes);
            *((volatile u64*)(them + WEFT_P2P_SBYTES) + a.rank) = op.bytes;
            __threadfence_system();
            st_release_sys(tail, tag | WEFT_P2P_SIZE_MARK);
        }
        return;
    }
    u64 lo, hi;
    p2p_slice(op.bytes, b, op.nblocks, lo, hi);
    u8* fifo = (u8*)a.scratch[op.peer] + a.rank * a.region + b * SLOTS * STEP;
    const u64* credit = (const u64*)(me + WEFT_P2P_CRED) + op.peer * WEFT_P2P_FIFO_MAXB + b;
    u64 j = 0;
    for (u64 off = lo; off < hi; j++, off += STEP) {
        if (j >= SLOTS && !wait_progress(a.status, credit, tag | (j + 1 - SLOTS))) return;
        copy_bytes(fifo + (j % SLOTS) * STEP, (const u8*)op.ptr + off, hi - off < STEP ? hi - off : STEP, false, true);
        signal_progress(tail, tag | (j + 1));
    }
    // Until the receiver has drained every step (no credit of this op
    // reaches my memory after the kernel).
    if (j > 0 && threadIdx.x == 0) wait_geq(credit, tag | j, a.status);
}

__device__ void p2p_recv_fifo(const P2pArgs& a, const P2pOp& op, int b) {
    const u64 me = a.flags[a.rank], them = a.flags[op.peer];
    const u64 tag = op.seq << 32, STEP = a.step, SLOTS = a.slots;
    if (threadIdx.x == 0 && b == 0) {
        *((volatile u64*)(them + WEFT_P2P_RBYTES) + a.rank) = op.bytes;
        __threadfence_system();
        st_release_sys((u64*)(them + WEFT_P2P_RREADY) + a.rank, op.seq);
    }
    u64 lo, hi;
    p2p_slice(op.bytes, b, op.nblocks, lo, hi);
    const u8* fifo = (const u8*)a.scratch[a.rank] + op.peer * a.region + b * SLOTS * STEP;
    const u64* tail = (const u64*)(me + WEFT_P2P_TAIL) + op.peer * WEFT_P2P_FIFO_MAXB + b;
    u64* credit = (u64*)(them + WEFT_P2P_CRED) + a.rank * WEFT_P2P_FIFO_MAXB + b;
    __shared__ int stop;
    for (u64 j = 0, off = lo; off < hi; j++, off += STEP) {
        if (threadIdx.x == 0) {
            stop = !wait_geq(tail, tag | (j + 1), a.status);
            if (!stop && (ld_acquire_sys(tail) & WEFT_P2P_SIZE_MARK) == WEFT_P2P_SIZE_MARK) {
                stop = 1;
                report(a.status, WEFT_ERR_P2P_SIZE, op.peer, ld_cv((const u64*)(me + WEFT_P2P_SBYTES) + op.peer));
            }
        }
        __syncthreads();
        if (stop) return;
        copy_bytes((u8*)op.ptr + off, fifo + (j % SLOTS) * STEP, hi - off < STEP ? hi - off : STEP, true, true);
        signal_progress(nullptr, tag | (j + 1), credit);
    }
}

// See P2P_COPY_SEQ. Eight loads in flight per thread (wide): a read across
// PCIe takes about a microsecond.
__device__ __forceinline__ u32 ld_acquire_sys_u32(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ void p2p_copy_seq(const P2pArgs& a) {
    const int b = blockIdx.x;
    for (int k = 0; k < a.nops; k++) {
        const P2pOp& op = a.ops[k];
        // An op may take only the launch's first nblocks blocks (a call's
        // copies back, in the launch of its copies in: the other blocks
        // end after the copies in).
        const int nb = op.nblocks > 0 && op.nblocks < (int)gridDim.x ? op.nblocks : (int)gridDim.x;
        if (b >= nb) continue;
        if (op.wait) {
            if (threadIdx.x == 0)
                while ((int)(ld_acquire_sys_u32((const u32*)op.wait) - (u32)op.seq) < 0) __nanosleep(256);
            __syncthreads();
        }
        u64 lo, hi;
        p2p_slice(op.bytes, b, nb, lo, hi);
        if (hi > lo) copy_bytes((u8*)op.ptr + lo, (const u8*)op.src + lo, hi - lo, op.peer != 0, true);
        if (op.base) {
            __syncthreads();
            if (threadIdx.x == 0) {
                __threadfence_system();
                *((volatile u32*)op.base + b) = (u32)op.seq;
            }
        }
    }
}

__device__ void p2p_round(const P2pArgs& a) {
    if (a.nops > 0 && a.ops[0].kind == P2P_COPY_SEQ) {
        p2p_copy_seq(a);
        return;
    }
    int k = 0;
    while (k + 1 < a.nops && (int)blockIdx.x >= a.ops[k + 1].block0) k++;
    const P2pOp& op = a.ops[k];
    const int b = blockIdx.x - op.block0;
    const u64 me = a.flags[a.rank];
    __shared__ u64 src, sbytes;
    __shared__ int stop;
    if (!a.direct && op.kind == P2P_SEND) {
        p2p_send_fifo(a, op, b);
        return;
    }
    if (!a.direct && op.kind == P2P_RECV) {
        p2p_recv_fifo(a, op, b);
        return;
    }
    if (op.kind == P2P_SEND) {
        if (threadIdx.x == 0) {
            // Two sends to one peer may run at once (an eager one on the
            // side stream, see libcomm/src/cuda/eager.rs, and a later one on
            // the caller's stream): write the slot only once the receiver is
            // done with the previous send's (done >= seq - 1), so it is never
            // overwritten while read and ready never skips a send.
            if (op.seq > 1 && !wait_geq((const u64*)(me + WEFT_P2P_DONE) + op.peer, op.seq - 1, a.status)) return;
            volatile u64* slot = (volatile u64*)(a.flags[op.peer] + WEFT_P2P_PTR) + a.rank * 2;
            slot[0] = op.ptr;
            slot[1] = op.bytes;
            __threadfence_system();
            st_release_sys((u64*)(a.flags[op.peer] + WEFT_P2P_READY) + a.rank, op.seq);
            wait_geq((const u64*)(me + WEFT_P2P_DONE) + op.peer, op.seq, a.status);
        }
        return;
    }
    if (op.kind == P2P_COPY) {
        u64 lo, hi;
        p2p_slice(op.bytes, b, op.nblocks, lo, hi);
        if (op.ptr != op.src) copy_bytes((u8*)op.ptr + lo, (const u8*)op.src + lo, hi - lo, false);
        return;
    }

    // Receive.
    if (threadIdx.x == 0) {
        stop = !wait_geq((const u64*)(me + WEFT_P2P_READY) + op.peer, op.seq, a.status);
        if (!stop) {
            const u64* slot = (const u64*)(me + WEFT_P2P_PTR) + op.peer * 2;
            src = ld_cv(slot);
            sbytes = ld_cv(slot + 1);
        }
    }
    __syncthreads();
    if (stop) return;
    if (sbytes != op.bytes) {
        if (threadIdx.x == 0 && b == 0) report(a.status, WEFT_ERR_P2P_SIZE, op.peer, sbytes);
    } else {
        u64 lo, hi;
        p2p_slice(op.bytes, b, op.nblocks, lo, hi);
        copy_bytes((u8*)op.ptr + lo, (const u8*)src + lo, hi - lo, true);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        u64 prev = atomicAdd((unsigned long long*)(me + WEFT_P2P_COUNT) + op.peer, 1ull);
        if (prev + 1 == op.base + op.nblocks) {
            __threadfence_system();
            st_release_sys((u64*)(a.flags[op.peer] + WEFT_P2P_DONE) + a.rank, op.seq);
        }
    }
}

// The kernels. Each compilation appends one instantiation line to this
// file, so that each kernel is its own small program (libcomm's build
// compiles them in parallel, and the run-time fallback compiles only what a
// process uses): WEFT_KERNEL(type name, type, op name, op) makes
// weft_coll_<type>_<op>, WEFT_MOVE(bytes, unsigned type) weft_move_<bytes>,
// WEFT_P2P() weft_p2p. The list of kernels and their lines is
// libcomm/src/cuda/kernel_set.rs; fp8 types need sm_89 or newer.
#define WEFT_KERNEL(TN, T, ON, OP) \
    extern "C" __global__ void __launch_bounds__(512) weft_coll_##TN##_##ON(Args a) { collective<T, OP>(a); }
#define WEFT_MOVE(N, T) \
    extern "C" __global__ void __launch_bounds__(512) weft_move_##N(Args a) { collective<T, OpMove>(a); }
#define WEFT_P2P() \
    extern "C" __global__ void __launch_bounds__(512) weft_p2p(P2pArgs a) { p2p_round(a); }
