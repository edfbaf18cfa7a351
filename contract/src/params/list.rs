//! The declarations: one entry per variable, in README order within each
//! group. The defaults are those of the code that reads each variable.

use super::DefaultValue::{Computed, Unset, Value};
use super::Kind::*;
use super::{Group, Param, ParamSpec, Part};

macro_rules! params {
    ($(
        $(#[$attr:meta])*
        $name:ident: $ty:ty = $kind:expr, $default:expr, $group:ident, [$($part:ident),*],
            $help:expr;
    )*) => {
        $(
            $(#[$attr])*
            #[doc = concat!("\n\n", $help)]
            pub const $name: Param<$ty> = Param {
                spec: &ParamSpec {
                    name: stringify!($name),
                    kind: $kind,
                    default: $default,
                    group: Group::$group,
                    parts: &[$(Part::$part),*],
                    help: $help,
                },
                _t: std::marker::PhantomData,
            };
        )*
        /// Every declared variable, in declaration order.
        pub static PARAMS: &[&ParamSpec] = &[$($name.spec()),*];
    };
}

/// The words `WEFT_CUDA_ALGO` (and a device algorithm named by `WEFT_ALGO`) accept.
pub const CUDA_ALGOS: &[&str] = &["oneshot", "twoshot", "ll", "staged"];

params! {
    // ---------------------------------------------------------------- Comm
    WEFT_ALGO: String = Str, Computed("tuner"), Comm, [Libcomm, Cuda],
        "algorithm override: `ring`, `rd`, `tree`, `direct`, `pairwise`, `ll` / `ll2` (host all-reduce through shared-memory latency slots, one / two shots, where every rank is on one host, up to 64 KiB), or per collective `allreduce:ring,broadcast:tree`; a device algorithm name (see `WEFT_CUDA_ALGO`) steers GPU memory";
    WEFT_TRANSPORT: String = Choice(&["auto", "shm", "tcp"]), Value("auto"), Comm, [Libcomm],
        "`auto` (shared memory within a host, TCP across), `shm`, `tcp` (also `socket`)";
    WEFT_PEER_TIMEOUT_MS: u64 = Ms, Value("10000"), Comm, [Libcomm],
        "how long a dead or unreachable peer may take to be noticed (100 at least)";
    WEFT_TIMEOUT_MS: u64 = Ms, Value("0"), Comm, [Libcomm],
        "fail a collective that makes no progress for this long (0 = never, like NCCL)";
    WEFT_INIT_TIMEOUT_MS: u64 = Ms, Value("120000"), Comm, [Libcomm],
        "bootstrap deadline (100 at least)";
    NCCL_COMM_BLOCKING: bool = OnUnless0, Value("1"), Comm, [Libcomm],
        "`0`: communicators initialise without blocking (NCCL's `blocking = 0`)";
    WEFT_SHM_RING_BYTES: usize = Bytes, Computed("1 MiB (less with many local ranks)"), Comm, [Libcomm],
        "capacity of each shared-memory ring (a power of two, 4096 - 1 GiB)";
    WEFT_HOSTNAME: String = Str, Computed("hostname + boot id + netns"), Comm, [Libcomm, Agent, Sidecar, Bench],
        "host identity override (places ranks on simulated hosts)";
    WEFT_LISTEN_ADDR: String = Str, Computed("loopback when the bootstrap address is loopback (every rank on this host), else the bootstrap address for rank 0's root and all interfaces for peer endpoints"), Comm, [Libcomm],
        "IP address the peer endpoint and the bootstrap root bind and advertise (`0.0.0.0`: every interface)";
    WEFT_NET_IF: String = Str, Unset(""), Comm, [Operator],
        "network interface named by the job (`spec.network.interface`); set by the operator, not read yet (bind with `WEFT_LISTEN_ADDR`)";
    WEFT_NET_SOCKETS: usize = Int, Value("4"), Comm, [Libcomm],
        "TCP sockets each connection of the cross-host byte mover stripes a message over (1-64; NCCL's `NCCL_NSOCKS_PERTHREAD` x `NCCL_SOCKET_NTHREADS`), one helper thread each";
    WEFT_NET_MIN_PIECE_BYTES: usize = Bytes, Value("65536"), Comm, [Libcomm],
        "smallest piece the cross-host byte mover cuts a message into across its `WEFT_NET_SOCKETS` sockets (a message of at most this many bytes goes whole on one socket, a larger one in pieces of at least this much but the last; 0: every message over every socket; the sender alone cuts, so ranks may differ)";
    WEFT_CROSSHOST_MIN_BYTES: usize = Bytes, Computed("1 MiB for device collectives (while `WEFT_CROSSHOST_MAX_PEERS` holds), 256 KiB for each device send and receive (an all-to-all's pieces), never for host memory"), Comm, [Libcomm],
        "all-reduce, all-gather, reduce-scatter and all-to-all (of device memory: broadcast and reduce too) of at least this many bytes (their whole data: an all-gather's output, a reduce-scatter's input) on a communicator whose ranks span hosts run on the cross-host engine: a host-local level and pipelined chunks over `WEFT_NET_SOCKETS` sockets per peer between hosts (for device collectives, the host part their progress thread runs, and device sends and receives of this many bytes each, an all-to-all's included, when the engine reaches every remote rank; built at the first device operation); set it the same on every rank; unset: 256 KiB for each device send and receive (an all-to-all's pieces: a 1 MiB all-to-all on 2 hosts moves two of 512 KiB) and 1 MiB for device collectives of a communicator whose ranks reach at most `WEFT_CROSSHOST_MAX_PEERS` ranks on other hosts each (all of them, or on hosts of equal size their rail or ring neighbours alone: the engine connects to them up front), and host-memory ones stay on the flat host algorithms; a value above every collective's size keeps all on the flat path";
    WEFT_CROSSHOST_MAX_PEERS: usize = Int, Value("8"), Comm, [Libcomm],
        "remote ranks the cross-host engine of a rank connects to at most (a connection each way, `WEFT_NET_SOCKETS` sockets and helper threads each): beyond it, on hosts with equal rank counts, it connects only to its rail (the ranks of the same local index on other hosts, one per host) and runs every collective on rails, and with more hosts than it plus one only to its two ring neighbours on the rail (all-to-all then on the flat path); on hosts of different sizes beyond it the engine is not built unless `WEFT_CROSSHOST_MIN_BYTES` is set, which then connects to all";
    WEFT_CROSSHOST_SLICE_BYTES: usize = Bytes, Value("67108864"), Comm, [Libcomm],
        "device all-reduces, broadcasts and reduces across hosts of at least twice this many bytes (all-gathers and reduce-scatters whose whole data is: the same slice of every rank's block a job), and sends and receives (an all-to-all's too) of at least twice this many bytes each, are cut into slices of at least this size (at most 8), each staged through its own pinned buffer, so the copies between GPU and host memory of one slice overlap the network of the next; 0: never cut; set it the same on every rank";
    WEFT_CROSSHOST_COPY: String = Choice(&["auto", "kernel", "engine"]), Value("auto"), Comm, [Libcomm],
        "what copies a device operation's buffers to and from the cross-host path's pinned host memory: `kernel`, the copy kernel (for a sliced call one launch for every slice's copies in and back, the copies back on 8 of its blocks, which wait for each slice's network part; a single job's copies back in a launch after the stream's wait; its blocks mark them done: the calling thread's cost does not grow with the size; 32 SMs while copies in last, 8 during a sliced call's network part); `engine`, the copy engines (no SMs; each copy costs the calling thread more the larger it is, 12-20 us per 64 MiB measured on an H200); `auto`, the kernel (on an H200 ahead of the engines at 1-4 MiB, about even at 64-256 KiB and from 16 MiB); without kernels in the library, always the engines (which leave the reduction of `WEFT_CROSSHOST_REDUCE=gpu` to the progress thread)";
    WEFT_CROSSHOST_PIPELINE: String = Choice(&["1", "0"]), Value("1"), Comm, [Libcomm],
        "whether a single device broadcast across hosts of 4 MiB or more (not cut in slices, copied by the copy kernel, its host part on the cross-host engine) overlaps its copies with its own network part: `1`, the copy kernel puts the root's buffer into pinned memory in pieces (at most 8, 512 KiB and up) that the progress thread sends as each lands, and the other ranks copy each piece out as soon as it has arrived (their copy-out blocks wait for the network meanwhile, as NCCL's kernels hold their SMs); `0`, copies in, network and copies out one after the other";
    WEFT_CROSSHOST_REDUCE: String = Choice(&["gpu", "host"]), Value("gpu"), Comm, [Libcomm],
        "where a device reduce-scatter, and an all-reduce of 2 MiB or more that is not cut in slices, across hosts (on at most 8 ranks) reduces what it receives from the other ranks: `gpu`, the job sends and receives the blocks as an all-to-all's pieces and its copy out reduces them with the rank's own block on the GPU (an all-reduce then gathers the reduced parts in a second job; a rank on the copy engines or without the type's kernel for its GPU reduces on its progress thread instead, with the same messages; not for PreMulSum and the fp8 types); `host`, in place on the pinned copy by the host algorithm, as it receives; set it the same on every rank: it changes what the ranks send each other";
    WEFT_CPU_AFFINITY: String = Choice(&["gpu", "none"]), Value("gpu"), Comm, [Libcomm],
        "where the cross-host path of device memory runs the threads it starts (progress thread, engine, socket helpers) and pins its host buffers: `gpu`, on the CPUs the kernel lists as near the GPU (`/sys/bus/pci/devices/*/local_cpulist`) within the mask of the thread that makes the communicator's first device call, as NCCL binds its proxy threads (a mask that shares none of them is left alone; the calling thread itself is not moved, but for the moment it pins a buffer); `none`, wherever that mask lets them";
    WEFT_CROSSHOST_HIER: String = Choice(&["1", "0"]), Value("1"), Comm, [Libcomm],
        "device all-reduce, all-gather, reduce-scatter, broadcast and reduce on a communicator spanning hosts, one of them with two ranks or more: `1`, hierarchically (within a host on the GPU kernels of a host-local communicator, between hosts on each rank's rail, 1/k of the data per rail; on hosts of different sizes through each host's first rank (all-gather and reduce-scatter when each host is a range of ranks, else staged)), and all-to-all and send/recv groups by host (this host's pieces on the host-local kernels; the hierarchy is built at the communicator's first device operation); `0`, the whole operation staged through pinned host memory; set it the same on every rank";
    WEFT_CROSSHOST_HIER_MIN_BYTES: usize = Bytes, Value("8388608"), Comm, [Libcomm],
        "the smallest device collective (its whole data: an all-gather's output, a reduce-scatter's input) that runs hierarchically when `WEFT_CROSSHOST_HIER` is on; smaller ones are staged whole; and the smallest piece of a send/recv group to a rank of the same host that goes over the host-local GPU kernels (smaller ones go through pinned host memory with the rest); measured on 2 hosts x 2 GPUs that both hosts share (their kernels' waits time-slice), the hierarchical path was 1.7-8.9x faster from 16 MiB and 1.2-10x slower up to 4 MiB (docs/PERFORMANCE-GPU.md): with a GPU a process, as pods run, a lower value may pay; set it the same on every rank";
    WEFT_CROSSHOST_NET: String = Choice(&["tcp", "proxy"]), Value("tcp"), Comm, [Libcomm],
        "the cross-host engine's byte mover: `tcp`, the rank's own connections (`WEFT_NET_SOCKETS` sockets each), or `proxy`, through the pod's sidecar proxy (its rings and one connection per host pair; needs the proxy, as `WEFT_PROXY`); set it the same on every rank";
    WEFT_EAGER_MAX_BYTES: usize = Bytes, Value("1073741824"), Comm, [Libcomm],
        "bytes of host sends a communicator may hold after the calls returned, before their peers received them (eager point-to-point); a send past it blocks until its peer has it";
    WEFT_SPIN_ITERS: u32 = Int, Computed("4000; 0 when ranks outnumber cores"), Comm, [Libcomm],
        "idle iterations a waiting rank spins before it yields";
    WEFT_YIELD_ITERS: u32 = Int, Computed("8; 32 when ranks outnumber cores"), Comm, [Libcomm],
        "idle iterations a waiting rank yields before it sleeps";
    WEFT_PROXY: String = Choice(&["0", "1", "off", "on", "false", "true", "no", "yes"]),
        Computed("used when the proxy socket exists"), Comm, [Libcomm],
        "the sidecar's network proxy for traffic to other hosts: `0`/`off` never, `1`/`on` required";
    WEFT_PROXY_SOCKET: String = Path, Computed("`$WEFT_SIDECAR_SOCKET.proxy`"), Comm, [Libcomm],
        "the sidecar's network proxy socket";
    WEFT_PROXY_RING_BYTES: usize = Bytes, Computed("8 MiB per rank shared by its remote peers, 64 KiB - 2 MiB per ring"), Comm, [Libcomm],
        "capacity of each proxy ring (a power of two, 4 KiB - 16 MiB)";

    // ---------------------------------------------------------------- Cuda
    WEFT_CUDA_ALGO: String = Choice(CUDA_ALGOS),
        Computed("by size (one-shot up to 256 KiB; LL up to 256 KiB per part across processes)"), Cuda, [Cuda],
        "device algorithm: `oneshot`, `twoshot` (all-reduce), `ll` (every collective as an LL one-shot where its parts fit 256 KiB); `staged` turns the kernel path off";
    WEFT_CUDA_LL_MAX_KB: usize = Kib, Computed("256 across processes, off in one process"), Cuda, [Cuda],
        "collectives whose parts are at most this many KiB run as an LL one-shot (256 at most; `0` off)";
    WEFT_CUDA_ONESHOT_MAX: usize = Bytes, Value("262144"), Cuda, [Cuda],
        "the one-shot all-reduce's largest size";
    WEFT_CUDA_THREADS: usize = Int, Value("512"), Cuda, [Cuda],
        "threads per block of the collective kernels (32 - 512)";
    WEFT_CUDA_BLOCKS: usize = Int, Value("0"), Cuda, [Cuda],
        "blocks per kernel at most (`0`: by collective; 128 at most)";
    WEFT_CUDA_P2P_BLOCKS: usize = Int, Value("32"), Cuda, [Cuda],
        "blocks per receive of a point-to-point kernel (1 - 128)";
    WEFT_CUDA_PUSH: bool = OnIf1, Computed("all-gather writes, the others read"), Cuda, [Cuda],
        "whether direct copies write into the peers (`1`) or read from them (`0`)";
    WEFT_CUDA_BCAST: String = Choice(&["scatter", "ring"]), Computed("by size"), Cuda, [Cuda],
        "device broadcast algorithm (see docs/ARCHITECTURE.md)";
    WEFT_CUDA_BCAST_RING_MB: usize = Mib, Value("256"), Cuda, [Cuda],
        "direct broadcasts from this size use the ring";
    WEFT_CUDA_BCAST_STEP: usize = Bytes, Value("0"), Cuda, [Cuda],
        "the device broadcast's pipeline step (`0`: by size)";
    WEFT_CUDA_REDUCE_CHUNK: usize = Bytes, Value("262144"), Cuda, [Cuda],
        "bytes per chunk of a direct reduce, at most (at least 512)";
    WEFT_CUDA_CHAIN_MIN_KB: usize = Kib,
        Computed("one process: broadcast from 64 MiB, reduce from 256 MiB; one process per GPU: from 8 MiB"), Cuda, [Cuda],
        "broadcast and reduce from this many KiB run as a chain through FIFO slots in scratch, where the lines chain is not taken (`0`: always)";
    WEFT_CUDA_CHAIN_STEP_KB: usize = Kib, Value("128"), Cuda, [Cuda],
        "largest chain slot";
    WEFT_CUDA_CHAIN_DEPTH: usize = Int, Value("8"), Cuda, [Cuda],
        "chain steps per block the slot size aims for";
    WEFT_CUDA_CHAIN_SLOTS: usize = Int, Value("8"), Cuda, [Cuda],
        "chain slots per block, at most (at least 2)";
    WEFT_CUDA_CHAIN_BLOCKS: usize = Int, Value("128"), Cuda, [Cuda],
        "blocks of a chain kernel (1 - 128)";
    WEFT_CUDA_LINES: bool = OnUnless0, Computed("on where every link is NVLink-class"), Cuda, [Cuda],
        "broadcast and reduce as a lines chain (data with its own flags, NVLink only); `0` turns it off";
    WEFT_CUDA_LINES_MIN_KB: usize = Kib, Computed("0"), Cuda, [Cuda],
        "smallest size the lines chain covers";
    WEFT_CUDA_LINES_MAX_KB: usize = Kib, Computed("256 MiB"), Cuda, [Cuda],
        "sizes the lines chain covers are below this";
    WEFT_CUDA_LINES_BLOCKS: usize = Int, Value("128"), Cuda, [Cuda],
        "blocks of a lines kernel at most (1 - 128)";
    WEFT_CUDA_LINES_WINDOW: usize = Int, Value("16"), Cuda, [Cuda],
        "lines iterations in flight per warp at most (2 - 16; 4 with 128 blocks)";
    WEFT_CUDA_SCRATCH_MB: usize = Mib, Value("32"), Cuda, [Cuda],
        "device scratch per communicator and parity (same on every rank)";
    WEFT_CUDA_DIRECT: bool = OnUnless0, Computed("on when every rank is in this process"), Cuda, [Cuda],
        "`0`: ranks in one process map each other's memory as if they were in separate processes";
    WEFT_KERNEL_SOURCE: String = Choice(&["auto", "ptx", "nvrtc"]), Value("auto"), Cuda, [Cuda],
        "where the CUDA kernels come from: `auto` (the machine code the build compiled for this GPU, else the build's PTX through the driver's JIT, else NVRTC at run time), `ptx` (skip the machine code), `nvrtc` (always compile at run time)";
    WEFT_KERNEL_CACHE: String = Path, Computed("`$XDG_CACHE_HOME/weft/kernels`, else `~/.cache/weft/kernels`"), Cuda, [Cuda],
        "where kernels compiled at run time by NVRTC are cached (set empty: no cache)";
    WEFT_NVRTC: String = Path, Computed("`.ci/nvrtc`, else LD_LIBRARY_PATH, else Python's site-packages, else the system's library path"), Cuda, [Build],
        "the NVRTC library (`libnvrtc.so.13`, or a folder holding it) the build compiles the CUDA kernels with ahead of time; `off`: none (the library then compiles them at run time)";

    // ------------------------------------------------------------- Observe
    WEFT_SIDECAR_SOCKET: String = Path, Unset("embedded engine"), Observe,
        [Libcomm, Capi, Agent, Sidecar, Bench, Operator],
        "the pod's sidecar (Unix socket); set by the operator and `weft run --sidecar`";
    WEFT_DEBUG: String = Choice(&["WARN", "INFO", "TRACE"]), Unset("off"), Observe, [Libcomm, Cuda, Capi],
        "`WARN`, `INFO`, `TRACE` logging to stderr";
    NCCL_DEBUG: String = Choice(&["WARN", "INFO", "TRACE"]), Unset("off"), Observe, [Libcomm, Capi],
        "as `WEFT_DEBUG`, which wins when both are set";
    WEFT_RAS_STUCK_MS: u64 = Ms, Value("10000"), Observe, [Sidecar],
        "a rank whose collective is in flight this long shows as `stuck` in RAS";
    WEFT_SPANS_PER_SEC: u64 = Int, Value("1000"), Observe, [Agent, Sidecar],
        "per rank process: collectives exported as their own span, on average per second (bursts of 10 s worth); beyond it, per communicator and op aggregates every second, plus every failure and slow call (docs/sidecar.md)";
    WEFT_EVENT_RING: u64 = Int, Value("32768"), Observe, [Agent],
        "records in a rank process's telemetry ring to its sidecar (a power of two, 64 - 262144); a full ring drops records and counts them";
    OTEL_EXPORTER_OTLP_ENDPOINT: String = Str, Unset("no export"), Observe, [Capi, Sidecar, Operator],
        "where spans go (standard OTel variables apply); set by the operator from `spec.telemetry`";
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: String = Str, Unset("no export"), Observe, [Capi, Sidecar],
        "where spans go, traces only (OTel)";
    OTEL_SDK_DISABLED: bool = Bool, Value("false"), Observe, [Capi, Sidecar],
        "`true` turns trace export off (OTel)";

    // -------------------------------------------------------------- Launch
    WEFT_JOB: String = Str, Computed("`anon`; `weft run`: `local-<pid>`"), Launch,
        [Libcomm, Capi, Agent, Sidecar, Run, Operator],
        "the job's name: shared-memory names, the bootstrap id, the sidecar's job";
    WEFT_JOB_NAMESPACE: String = Str, Unset(""), Launch, [Operator],
        "the job's namespace";
    WEFT_RANK: usize = Int, Unset(""), Launch, [Libcomm, Bench, Run],
        "this process's rank";
    WEFT_LOCAL_RANK: usize = Int, Unset(""), Launch, [Bench, Run],
        "this process's rank on its node (picks its GPU)";
    WEFT_WORLD_SIZE: usize = Int, Unset(""), Launch, [Libcomm, Run, Bench, Operator],
        "ranks in the job";
    WEFT_LOCAL_RANKS: usize = Int, Unset(""), Launch, [Run, Operator],
        "ranks on this node (pod)";
    WEFT_RANK_OFFSET: usize = Int, Unset(""), Launch, [Run, Operator],
        "the rank of this node's (pod's) first rank";
    WEFT_NNODES: usize = Int, Unset(""), Launch, [Run, Operator],
        "nodes (pods) in the job";
    WEFT_NODE_RANK: usize = Int, Unset(""), Launch, [Run, Operator],
        "this node's (pod's) index";
    WEFT_MPS: String = Choice(&["auto", "on", "off"]), Value("auto"), Launch, [Run, Bench],
        "`auto`: when more local ranks than GPUs, start a private CUDA MPS daemon for the job (kernels of ranks sharing a GPU then run side by side instead of time-slicing); `on`: fail if it cannot start; `off`";
    WEFT_PRELOAD: String = Path, Value("auto"), Launch, [Run],
        "`auto`: `weft run` preloads (`LD_PRELOAD`) the `libnccl.so.2` installed with `weft` (next to it, `../lib`, `../lib/weft`) into the ranks, so programs such as PyTorch that find another NCCL by `RPATH` bind to Weft; `off`; or the library's path";
    RANK: usize = Int, Unset(""), Launch, [Libcomm, Run],
        "PyTorch's name, read when `WEFT_RANK` is unset";
    WORLD_SIZE: usize = Int, Unset(""), Launch, [Libcomm, Run],
        "PyTorch's name, read when `WEFT_WORLD_SIZE` is unset";
    WEFT_BOOTSTRAP: String = Addr, Unset(""), Launch, [Libcomm, Capi, Run, Operator],
        "`host:port` where rank 0 serves the rendezvous";
    NCCL_COMM_ID: String = Addr, Unset(""), Launch, [Libcomm, Capi, Run],
        "NCCL's name for `WEFT_BOOTSTRAP`, read when that is unset";
    WEFT_JOB_SECRET: String = Str, Unset("unauthenticated (a warning)"), Launch, [Libcomm, Agent, Sidecar, Run],
        "the job secret that authenticates bootstrap, peers and sidecar attach; `weft run` makes one";
    WEFT_JOB_SECRET_FILE: String = Path, Unset(""), Launch, [Libcomm, Agent, Sidecar, Operator],
        "a file holding the job secret (read when `WEFT_JOB_SECRET` is unset); the operator mounts one";
    WEFT_RESTART_EPOCH: String = Str, Unset(""), Launch, [Libcomm, Operator],
        "the job's restart epoch (a fresh bootstrap id per restart)";
    WEFT_RECOVERY_DIR: String = Path, Unset(""), Launch, [Libcomm, Run, Operator],
        "the recovery board: the directory where the launcher (or, in pods, the sidecars) and the ranks meet to recover from a lost rank (deaths, replacements ready, grow ids); set by `weft run --replace-failed`, and by the operator under `onRankFailure: ReplaceRank` (each pod's own, relayed between pods by the sidecars); read by libcomm's `Resilient` (docs/FAULT-TOLERANCE.md)";
    WEFT_INCARNATION: u32 = Int, Value("0"), Launch, [Libcomm, Run, Operator],
        "how many times this rank's process (`weft run --replace-failed`) or pod (the operator, `failurePolicy.onRankFailure: ReplaceRank`, same epoch, same ranks) was replaced: 1 or more joins the running job by grow instead of the bootstrap";

    // ------------------------------------------------------------ Operator
    WEFT_SIDECAR_IMAGE: String = Str, Value("ghcr.io/weft-dev/weft:latest"), Operator, [Operator],
        "sidecar image for jobs that do not name one";
    WEFT_OPERATOR_HTTP_ADDR: String = Addr, Value("0.0.0.0:8080"), Operator, [Operator],
        "address of /metrics, /healthz and /readyz";
    WEFT_OTLP_ENDPOINT: String = Str, Unset("none"), Operator, [Operator],
        "OTLP endpoint for jobs that do not name one";
    WEFT_LEADER_ELECT: bool = Bool, Value("true"), Operator, [Operator],
        "elect a leader through a Lease (required with more than one replica)";
    WEFT_WATCH_SECRETS: bool = Bool, Value("true"), Operator, [Operator],
        "watch the job Secrets (needs list/watch on Secrets)";
    WEFT_LOG: String = Str, Value("info"), Operator, [Operator],
        "the operator's log filter (`RUST_LOG` syntax); each sidecar gets its job's `spec.sidecar.logLevel`";
    WEFT_LOG_JSON: bool = Bool, Value("false"), Operator, [Operator],
        "log as JSON lines";
    POD_NAMESPACE: String = Str, Value("weft-system"), Operator, [Operator],
        "namespace of the leader Lease (the Downward API gives the operator's own)";
    POD_NAME: String = Str, Unset(""), Operator, [Operator],
        "identity in the Lease and in events (the Downward API gives the pod name)";

    // -------------------------------------------------------------- System
    CUDA_VISIBLE_DEVICES: String = List, Unset(""), System, [Agent],
        "the GPUs a rank reports to its sidecar";
    XDG_CACHE_HOME: String = Path, Unset(""), System, [Cuda],
        "base of the kernel cache";
    HOME: String = Path, Unset(""), System, [Cuda],
        "base of the kernel cache without `XDG_CACHE_HOME`";

    // ------------------------------------------------------------ Internal
    WEFT_BENCH_RESULT: String = Path, Unset(""), Internal, [Bench],
        "set by `weft bench` for its ranks: where rank 0 writes the count of wrong elements";

    // ---------------------------------------------------------------- Test
    WEFT_BLESS: bool = OnIf1, Unset(""), Test, [Tests],
        "`1`: the README test rewrites README.md's configuration table";
    WEFT_REQUIRE_NVRTC: bool = OnIf1, Unset(""), Test, [Tests, Build],
        "`1`: a build that cannot compile the CUDA kernels ahead of time (no NVRTC) fails, and the NVRTC tests fail instead of skipping (CI)";
    WEFT_NVRTC_DIR: String = Path, Unset(""), Test, [Tests],
        "where kernels/ci-nvrtc.sh installs NVRTC";
    WEFT_TEST_SEED: u64 = Int, Unset(""), Test, [Tests],
        "seed of the randomised multi-process tests";
    WEFT_TEST_NETNS: String = Str, Unset(""), Test, [Tests],
        "network namespace the test sidecar helper enters";
    WEFT_TEST_VICTIM: String = Str, Unset(""), Test, [Tests],
        "the rank a failure test kills";
    WEFT_TEST_RELEASE: String = Str, Unset(""), Test, [Tests],
        "a failure test's release signal";
    WEFT_XHOST_SCENARIO: String = Str, Unset(""), Test, [Tests],
        "which scenario a rank process of the cross-host GPU test runs (set by the test for its children)";
    WEFT_XHOST_GPU_PER_HOST: String = Str, Unset(""), Test, [Tests],
        "`1`: the cross-host GPU test puts each simulated host on its own GPU (2 GPUs); `rank`: each rank on its own GPU (one process per GPU); else every rank on GPU 0";
    WEFT_XHOST_LOOP: String = Str, Unset(""), Test, [Tests],
        "`exchange`: the failure loop of the cross-host GPU test runs a reduce-scatter and a 2 MiB all-reduce in turn (the forms that exchange parts and reduce on the GPU) instead of 1 MiB all-reduces";
    WEFT_XHOST_HOSTS: String = Str, Unset(""), Test, [Tests],
        "`interleaved`: the cross-host GPU test places its ranks round-robin on the two simulated hosts (ranks 0, 2 on one) instead of half on each";
    WEFT_XHOST_NRANKS: u64 = Int, Unset(""), Test, [Tests],
        "ranks of a cross-host GPU test scenario (set by the test; default 4, half on each simulated host)";
    WEFT_XHOST_RANK: u64 = Int, Unset(""), Test, [Tests],
        "that rank process's rank (set by the cross-host GPU test)";
    WEFT_XHOST_ID: String = Str, Unset(""), Test, [Tests],
        "the communicator id the cross-host GPU test's rank processes share";
    WEFT_TEST_MISMATCH_BIG: bool = OnIf1, Unset(""), Test, [Tests],
        "`1`: the mismatch test's ranks differ enough to take different all-reduce algorithms";
    WEFT_TEST_INHERITED: String = Str, Unset(""), Test, [Tests],
        "checks that `weft run` passes its environment on";
    WEFT_TEST_CTL: String = Path, Unset(""), Test, [Tests],
        "directory through which the attack tests and their ranks meet";
    WEFT_TEST_WAIT_FILE: String = Str, Unset(""), Test, [Tests],
        "file (in `WEFT_TEST_CTL`) a test rank waits for before its init";
    WEFT_E2E_REQUIRED: bool = OnIf1, Unset(""), Test, [Tests],
        "`1`: e2e/run.sh fails when a tool is missing (CI)";
    WEFT_BIN: String = Path, Unset(""), Test, [Tests],
        "a prebuilt `weft` for the bench scripts";
    WEFT_DEFAULTS: String = Str, Unset(""), Test, [Tests],
        "marks the defaults row of bench/gpu/run.sh (read by nothing)";
    WEFT_REAL_NCCL_DIR: String = Path, Unset(""), Test, [Tests],
        "an unpacked nvidia-nccl-cu13 wheel for the symbol-coverage test (no download)";
}
