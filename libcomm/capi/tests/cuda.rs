//! The C ABI on CUDA device memory, checked against a host reference: every
//! collective and send/recv, in place and out of place, several types and
//! every op, odd counts, random data and poisoned outputs. Runs on a GPU
//! machine (all its GPUs up to 4, in one process, like nccl-tests -g N);
//! without a CUDA driver or device it prints why it skips.

use libcomm::cuda::{self, mem};
use nccl::api::*;
use std::ffi::c_void;
use weft_testkit::Rng;

const F32: i32 = 7;
const F16: i32 = 6;
const BF16: i32 = 9;
const F64: i32 = 8;
const I32: i32 = 2;
const U8: i32 = 1;

fn size_of(dt: i32) -> usize {
    match dt {
        F32 | I32 => 4,
        F16 | BF16 => 2,
        F64 => 8,
        _ => 1,
    }
}

fn encode(dt: i32, v: f64, out: &mut [u8]) {
    match dt {
        F32 => out.copy_from_slice(&(v as f32).to_le_bytes()),
        F64 => out.copy_from_slice(&v.to_le_bytes()),
        F16 => out.copy_from_slice(&half::f16::from_f64(v).to_le_bytes()),
        BF16 => out.copy_from_slice(&half::bf16::from_f64(v).to_le_bytes()),
        I32 => out.copy_from_slice(&(v as i32).to_le_bytes()),
        _ => out[0] = v as u8,
    }
}

/// `v` as f32 bytes.
fn f32_bytes(v: &[f64]) -> Vec<u8> {
    let mut b = vec![0u8; v.len() * 4];
    for (x, out) in v.iter().zip(b.chunks_exact_mut(4)) {
        encode(F32, *x, out);
    }
    b
}

fn decode(dt: i32, b: &[u8]) -> f64 {
    match dt {
        F32 => f32::from_le_bytes(b.try_into().unwrap()) as f64,
        F64 => f64::from_le_bytes(b.try_into().unwrap()),
        F16 => half::f16::from_le_bytes(b.try_into().unwrap()).to_f64(),
        BF16 => half::bf16::from_le_bytes(b.try_into().unwrap()).to_f64(),
        I32 => i32::from_le_bytes(b.try_into().unwrap()) as f64,
        _ => b[0] as f64,
    }
}

fn combine(op: i32, a: f64, b: f64) -> f64 {
    match op {
        1 => a * b,
        2 => a.max(b),
        3 => a.min(b),
        _ => a + b,
    }
}

/// A small integer of `rng`: exact in every type, products of 4 stay exact.
fn small_value(rng: &mut Rng, dt: i32) -> f64 {
    let v = (rng.next_u64() % 7) as f64;
    if dt == I32 || dt == U8 { v } else { v - 3.0 }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Coll {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    Reduce,
    AllToAll,
    SendRecv,
    Gather,
    Scatter,
    /// All-to-all from grouped sends and receives, oneself included.
    AllToAllP2p,
}

/// One communicator per device in `devs` (ncclCommInitAll), in order.
fn init_all(devs: &[i32]) -> Vec<ncclComm_t> {
    let mut comms: Vec<ncclComm_t> = vec![std::ptr::null_mut(); devs.len()];
    assert_eq!(
        unsafe { pncclCommInitAll(comms.as_mut_ptr(), devs.len() as i32, devs.as_ptr()) },
        0,
        "ncclCommInitAll over devices {devs:?}"
    );
    comms
}

/// The devices a test runs on (all, up to 4), or None after printing why it
/// skips: no driver or device, or fewer than `min`.
fn devices_or_skip(name: &str, min: i32) -> Option<i32> {
    if let Some(why) = skip_reason() {
        panic!("{name} needs a CUDA GPU: {why}");
    }
    let n = cuda::device_count().min(4);
    assert!(n >= min, "{name} needs {min} GPUs, found {n}");
    Some(n)
}

fn skip_reason() -> Option<String> {
    if let Err(e) = cuda::driver() {
        return Some(e.to_string());
    }
    if cuda::device_count() == 0 {
        return Some("the CUDA driver sees no device".into());
    }
    None
}

#[test]
#[ignore = "needs a CUDA GPU: on the GPU machine, cargo test -p weft-nccl --test cuda -- --ignored (bench/gpu/run.sh rtest)"]
fn cuda_collectives_match_host_reference() {
    if let Some(why) = skip_reason() {
        panic!("cuda_collectives_match_host_reference needs a CUDA GPU: {why}");
    }
    if !cuda::kernels::available() {
        eprintln!(
            "note: no kernels (built without NVRTC, and no libnvrtc): device collectives run on the host staging path only"
        );
    }
    let ndev = cuda::device_count().min(4);
    let mut sizes = vec![1];
    if ndev >= 2 {
        sizes.push(2);
    }
    if ndev > 2 {
        sizes.push(ndev);
    }
    let mut rng = Rng::new(0x9e3779b97f4a7c15);
    let mut failures = Vec::new();
    let mut cases = 0;
    for &n in &sizes {
        let nu = n as usize;
        let comms = init_all(&(0..n).collect::<Vec<i32>>());
        let max_count = 300_001usize;
        let cap = nu * max_count * 8 + 64;
        let send: Vec<u64> = (0..n).map(|d| mem::alloc(d, cap).unwrap()).collect();
        let recv: Vec<u64> = (0..n).map(|d| mem::alloc(d, cap).unwrap()).collect();
        for coll in [
            Coll::AllReduce,
            Coll::AllGather,
            Coll::ReduceScatter,
            Coll::Broadcast,
            Coll::Reduce,
            Coll::AllToAll,
            Coll::SendRecv,
            Coll::Gather,
            Coll::Scatter,
            Coll::AllToAllP2p,
        ] {
            let reduces = matches!(coll, Coll::AllReduce | Coll::ReduceScatter | Coll::Reduce);
            let ops: &[i32] = if reduces { &[0, 1, 2, 3, 4] } else { &[0] };
            for dt in [F32, F16, BF16, I32, U8, F64] {
                for &op in ops {
                    for count in [1usize, 7, 4099, max_count] {
                        if count == max_count && (op != 0 || dt == F64 || dt == U8) {
                            continue;
                        }
                        for inplace in [false, true] {
                            if inplace
                                && matches!(
                                    coll,
                                    Coll::AllToAll | Coll::SendRecv | Coll::AllToAllP2p
                                )
                            {
                                continue;
                            }
                            cases += 1;
                            if let Err(e) = one_case(
                                n, &comms, &send, &recv, coll, dt, op, count, inplace, &mut rng,
                            ) {
                                failures.push(format!(
                                    "n={n} {coll:?} dt={dt} op={op} count={count} inplace={inplace}: {e}"
                                ));
                            }
                        }
                    }
                }
            }
        }
        for c in comms {
            unsafe { pncclCommDestroy(c) };
        }
        for d in 0..n {
            mem::free(d, send[d as usize]).unwrap();
            mem::free(d, recv[d as usize]).unwrap();
        }
    }
    eprintln!(
        "{cases} cases on {sizes:?} GPUs, {} failures",
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{}",
        failures[..failures.len().min(20)].join("\n")
    );
}

#[allow(clippy::too_many_arguments)]
fn one_case(
    n: i32,
    comms: &[ncclComm_t],
    send: &[u64],
    recv: &[u64],
    coll: Coll,
    dt: i32,
    op: i32,
    count: usize,
    inplace: bool,
    rng: &mut Rng,
) -> Result<(), String> {
    let nu = n as usize;
    let e = size_of(dt);
    let (in_elems, out_elems) = match coll {
        Coll::AllGather => (count, count * nu),
        Coll::ReduceScatter => (count * nu, count),
        Coll::AllToAll | Coll::AllToAllP2p => (count * nu, count * nu),
        Coll::Gather => (count, count * nu),
        Coll::Scatter => (count * nu, count),
        _ => (count, count),
    };
    let root = match coll {
        Coll::Broadcast | Coll::Gather => 1 % nu,
        Coll::Reduce => nu - 1,
        _ => 0,
    };
    // Inputs, poisoned outputs.
    let inputs: Vec<Vec<f64>> = (0..nu)
        .map(|_| (0..in_elems).map(|_| small_value(rng, dt)).collect())
        .collect();
    let poison = vec![0xA5u8; out_elems.max(in_elems) * e];
    let mut bufs: Vec<(u64, u64)> = Vec::new();
    for r in 0..nu {
        let d = r as i32;
        mem::htod(d, recv[r], &poison).map_err(|x| x.to_string())?;
        let mut bytes = vec![0u8; in_elems * e];
        for (i, v) in inputs[r].iter().enumerate() {
            encode(dt, *v, &mut bytes[i * e..(i + 1) * e]);
        }
        let (s, o) = if !inplace {
            (send[r], recv[r])
        } else {
            match coll {
                Coll::AllGather => (recv[r] + (r * count * e) as u64, recv[r]),
                Coll::ReduceScatter => (recv[r], recv[r] + (r * count * e) as u64),
                Coll::Gather if r == root => (recv[r] + (r * count * e) as u64, recv[r]),
                Coll::Scatter if r == root => (recv[r], recv[r] + (r * count * e) as u64),
                _ => (recv[r], recv[r]),
            }
        };
        mem::htod(d, s, &bytes).map_err(|x| x.to_string())?;
        bufs.push((s, o));
    }
    let null = std::ptr::null_mut::<c_void>();
    unsafe {
        assert_eq!(pncclGroupStart(), 0);
        for r in 0..nu {
            let (s, o) = (bufs[r].0 as *const c_void, bufs[r].1 as *mut c_void);
            let c = comms[r];
            let rc = match coll {
                Coll::AllReduce => pncclAllReduce(s, o, count, dt, op, c, null),
                Coll::AllGather => pncclAllGather(s, o, count, dt, c, null),
                Coll::ReduceScatter => pncclReduceScatter(s, o, count, dt, op, c, null),
                Coll::Broadcast => pncclBroadcast(s, o, count, dt, root as i32, c, null),
                Coll::Reduce => pncclReduce(s, o, count, dt, op, root as i32, c, null),
                Coll::AllToAll => pncclAlltoAll(s, o, count, dt, c, null),
                Coll::SendRecv => {
                    let a = pncclSend(s, count, dt, ((r + 1) % nu) as i32, c, null);
                    let b = pncclRecv(o, count, dt, ((r + nu - 1) % nu) as i32, c, null);
                    a.max(b)
                }
                Coll::Gather => pncclGather(s, o, count, dt, root as i32, c, null),
                Coll::Scatter => pncclScatter(s, o, count, dt, root as i32, c, null),
                Coll::AllToAllP2p => {
                    let mut rc = 0;
                    for p in 0..nu {
                        let sp = (bufs[r].0 as usize + p * count * e) as *const c_void;
                        let rp = (bufs[r].1 as usize + p * count * e) as *mut c_void;
                        rc = rc.max(pncclSend(sp, count, dt, p as i32, c, null));
                        rc = rc.max(pncclRecv(rp, count, dt, p as i32, c, null));
                    }
                    rc
                }
            };
            if rc != 0 {
                pncclGroupEnd();
                return Err(format!("call returned {rc}"));
            }
        }
        let rc = pncclGroupEnd();
        if rc != 0 {
            return Err(format!("ncclGroupEnd returned {rc}"));
        }
    }
    let reduce = |idx: &dyn Fn(usize) -> f64| -> f64 {
        let mut acc = idx(0);
        for j in 1..nu {
            acc = combine(op, acc, idx(j));
        }
        if dt == U8 && op != 4 {
            acc.rem_euclid(256.0)
        } else if op == 4 {
            if dt == I32 || dt == U8 {
                (acc / n as f64).trunc()
            } else {
                acc / n as f64
            }
        } else {
            acc
        }
    };
    for r in 0..nu {
        if matches!(coll, Coll::Reduce | Coll::Gather) && r != root {
            continue;
        }
        let mut out = vec![0u8; out_elems * e];
        mem::dtoh(r as i32, &mut out, bufs[r].1).map_err(|x| x.to_string())?;
        for i in 0..out_elems {
            let want = match coll {
                Coll::AllReduce | Coll::Reduce => reduce(&|j| inputs[j][i]),
                Coll::ReduceScatter => reduce(&|j| inputs[j][r * count + i]),
                Coll::AllGather => inputs[i / count][i % count],
                Coll::Broadcast => inputs[root][i],
                Coll::AllToAll | Coll::AllToAllP2p => inputs[i / count][r * count + i % count],
                Coll::Gather => inputs[i / count][i % count],
                Coll::Scatter => inputs[root][r * count + i],
                Coll::SendRecv => inputs[(r + nu - 1) % nu][i],
            };
            let got = decode(dt, &out[i * e..(i + 1) * e]);
            let tol = match dt {
                F16 | BF16 => 1e-2 * want.abs().max(1.0),
                F32 => 1e-5 * want.abs().max(1.0),
                F64 => 1e-12 * want.abs().max(1.0),
                _ => 0.0,
            };
            if (got - want).abs() > tol || got.is_nan() {
                return Err(format!("rank {r} element {i}: got {got}, want {want}"));
            }
        }
    }
    Ok(())
}

/// ncclCommAbort makes a kernel that waits for a peer which never comes
/// return: the stream drains instead of hanging the process.
#[test]
#[ignore = "needs a CUDA GPU: on the GPU machine, cargo test -p weft-nccl --test cuda -- --ignored (bench/gpu/run.sh rtest)"]
fn abort_releases_a_kernel_waiting_for_a_peer() {
    if let Some(why) = skip_reason() {
        panic!("abort_releases_a_kernel_waiting_for_a_peer needs a CUDA GPU: {why}");
    }
    assert!(
        cuda::kernels::available(),
        "abort_releases_a_kernel_waiting_for_a_peer needs kernels (the kernel path)"
    );
    let devs = [0, (cuda::device_count() - 1).min(1)];
    let comms = init_all(&devs);
    let bytes = 1 << 20;
    let bufs: Vec<u64> = devs
        .iter()
        .map(|&d| mem::alloc(d, bytes).unwrap())
        .collect();
    // A stream per rank: on one GPU, one stream for both ranks would run
    // their kernels one after the other (refused: see
    // two_ranks_on_one_stream_are_refused_not_hung).
    let streams: Vec<u64> = devs.iter().map(|&d| mem::stream(d).unwrap()).collect();
    let st = |r: usize| streams[r] as *mut c_void;
    let count = bytes / 4;
    // Both ranks once (sets up the device side), then rank 0 alone.
    unsafe {
        assert_eq!(pncclGroupStart(), 0);
        for r in 0..2 {
            let b = bufs[r] as *mut c_void;
            assert_eq!(pncclAllReduce(b, b, count, F32, 0, comms[r], st(r)), 0);
        }
        assert_eq!(pncclGroupEnd(), 0);
        mem::sync(devs[0]).unwrap();
        mem::sync(devs[1]).unwrap();
        let b = bufs[0] as *mut c_void;
        assert_eq!(pncclAllReduce(b, b, count, F32, 0, comms[0], st(0)), 0);
    }
    // A watchdog: a hang here is the failure this test exists for.
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if rx.recv_timeout(std::time::Duration::from_secs(30)).is_err() {
            eprintln!(
                "FAILED abort_releases_a_kernel_waiting_for_a_peer: the stream did not drain within 30 s of the abort"
            );
            std::process::exit(101);
        }
    });
    std::thread::sleep(std::time::Duration::from_millis(300));
    let t = std::time::Instant::now();
    assert_eq!(unsafe { pncclCommAbort(comms[0]) }, 0);
    mem::sync(devs[0]).unwrap();
    let _ = tx.send(());
    eprintln!("stream drained {:?} after ncclCommAbort", t.elapsed());
    assert_eq!(unsafe { pncclCommAbort(comms[1]) }, 0);
    for (i, &d) in devs.iter().enumerate() {
        mem::free(d, bufs[i]).unwrap();
        mem::stream_destroy(d, streams[i]).unwrap();
    }
}

/// A collective on a stream being captured into a CUDA graph is refused
/// with ncclInvalidUsage and a message that says why, instead of becoming a
/// graph whose replays reuse the captured sequence numbers and flags and
/// read stale data; the same call after the capture ends works.
#[test]
#[ignore = "needs a CUDA GPU: on the GPU machine, cargo test -p weft-nccl --test cuda -- --ignored (bench/gpu/run.sh rtest)"]
fn graph_capture_is_refused_with_a_clear_error() {
    use cudarc::driver::sys;
    let Some(_) = devices_or_skip("graph_capture_is_refused_with_a_clear_error", 1) else {
        return;
    };
    let comms = init_all(&[0]);
    let count = 1024;
    let buf = mem::alloc(0, count * 4).unwrap();
    let input: Vec<f64> = (0..count).map(|i| i as f64 * 0.5 - 7.0).collect();
    mem::htod(0, buf, &f32_bytes(&input)).unwrap();
    cuda::use_device(0).unwrap();
    let b = buf as *mut c_void;
    unsafe {
        let mut stream: sys::CUstream = std::ptr::null_mut();
        assert_eq!(
            sys::cuStreamCreate(&mut stream, 0),
            sys::CUresult::CUDA_SUCCESS
        );
        assert_eq!(
            sys::cuStreamBeginCapture_v2(
                stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
            ),
            sys::CUresult::CUDA_SUCCESS
        );
        let rc = pncclAllReduce(b, b, count, F32, 0, comms[0], stream.cast());
        let msg = std::ffi::CStr::from_ptr(pncclGetLastError(comms[0]))
            .to_string_lossy()
            .into_owned();
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        let ended = sys::cuStreamEndCapture(stream, &mut graph);
        if !graph.is_null() {
            sys::cuGraphDestroy(graph);
        }
        assert_eq!(rc, 5, "ncclInvalidUsage expected, got {rc}: {msg}");
        assert!(msg.contains("CUDA graph"), "{msg}");
        assert_eq!(
            ended,
            sys::CUresult::CUDA_SUCCESS,
            "the refused call must not break the capture"
        );
        // Outside capture the same call runs (one rank: the sum is the input).
        assert_eq!(
            pncclAllReduce(b, b, count, F32, 0, comms[0], stream.cast()),
            0
        );
        assert_eq!(
            sys::cuStreamSynchronize(stream),
            sys::CUresult::CUDA_SUCCESS
        );
        sys::cuStreamDestroy_v2(stream);
    }
    let mut out = vec![0u8; count * 4];
    mem::dtoh(0, &mut out, buf).unwrap();
    assert_eq!(out, f32_bytes(&input));
    eprintln!(
        "graph_capture_is_refused_with_a_clear_error: refused during capture, correct after it"
    );
    unsafe { pncclCommDestroy(comms[0]) };
    mem::free(0, buf).unwrap();
}

/// Two communicators over the same GPUs, their operations interleaved on
/// one stream per GPU (ordered the same way on every GPU, as NCCL requires
/// of communicators sharing devices): each keeps its own flags, scratch and
/// sequence numbers, so neither waits on the other's flags nor reads its
/// data, and 150 operations end with correct results instead of a hang.
#[test]
#[ignore = "needs 2 CUDA GPUs: on the GPU machine, cargo test -p weft-nccl --test cuda -- --ignored (bench/gpu/run.sh rtest)"]
fn communicators_sharing_gpus_keep_their_own_flags() {
    const NAME: &str = "communicators_sharing_gpus_keep_their_own_flags";
    let Some(n) = devices_or_skip(NAME, 2) else {
        return;
    };
    let nu = n as usize;
    let devs: Vec<i32> = (0..n).collect();
    let a = init_all(&devs);
    let b = init_all(&devs);
    // A: all-reduce of 1M floats; B: broadcast from root 0, then reduce to
    // root n - 1, of 3M floats (odd sizes of each algorithm family).
    let (ca, cb) = (1usize << 20, 3 * (1usize << 20) + 5);
    let mut rng = Rng::new(0x5eed_cafe_f00d_d00d);
    let in_a: Vec<Vec<f64>> = (0..nu)
        .map(|_| (0..ca).map(|_| small_value(&mut rng, F32)).collect())
        .collect();
    let in_b: Vec<Vec<f64>> = (0..nu)
        .map(|_| (0..cb).map(|_| small_value(&mut rng, F32)).collect())
        .collect();
    let upload = |d: i32, v: &[f64]| {
        let bytes = f32_bytes(v);
        let p = mem::alloc(d, bytes.len()).unwrap();
        mem::htod(d, p, &bytes).unwrap();
        p
    };
    let sa: Vec<u64> = (0..nu).map(|r| upload(r as i32, &in_a[r])).collect();
    let sb: Vec<u64> = (0..nu).map(|r| upload(r as i32, &in_b[r])).collect();
    let ra: Vec<u64> = (0..n).map(|d| mem::alloc(d, ca * 4).unwrap()).collect();
    let rb: Vec<u64> = (0..n).map(|d| mem::alloc(d, cb * 4).unwrap()).collect();
    let rc: Vec<u64> = (0..n).map(|d| mem::alloc(d, cb * 4).unwrap()).collect();
    let streams: Vec<u64> = (0..n).map(|d| mem::stream(d).unwrap()).collect();
    // A hang is the failure this test exists for.
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if rx
            .recv_timeout(std::time::Duration::from_secs(120))
            .is_err()
        {
            eprintln!("FAILED {NAME}: not done within 120 s (communicators waiting on each other)");
            std::process::exit(101);
        }
    });
    // One group per operation: every rank's call with its stream.
    let group = |call: &dyn Fn(usize, *mut c_void) -> i32| unsafe {
        assert_eq!(pncclGroupStart(), 0);
        for (r, &s) in streams.iter().enumerate() {
            assert_eq!(call(r, s as *mut c_void), 0);
        }
        assert_eq!(pncclGroupEnd(), 0);
    };
    let ptr = |p: u64| p as *mut c_void;
    let iterations = 50;
    for _ in 0..iterations {
        group(&|r, s| unsafe { pncclAllReduce(ptr(sa[r]), ptr(ra[r]), ca, F32, 0, a[r], s) });
        group(&|r, s| unsafe { pncclBroadcast(ptr(sb[r]), ptr(rb[r]), cb, F32, 0, b[r], s) });
        group(&|r, s| unsafe { pncclReduce(ptr(sb[r]), ptr(rc[r]), cb, F32, 0, n - 1, b[r], s) });
    }
    for d in 0..n {
        mem::sync(d).unwrap();
    }
    let _ = tx.send(());
    let download = |d: usize, p: u64, count: usize| -> Vec<f64> {
        let mut bytes = vec![0u8; count * 4];
        mem::dtoh(d as i32, &mut bytes, p).unwrap();
        bytes.chunks(4).map(|c| decode(F32, c)).collect()
    };
    let close = |got: f64, want: f64| (got - want).abs() <= 1e-5 * want.abs().max(1.0);
    for r in 0..nu {
        let got = download(r, ra[r], ca);
        for (i, g) in got.iter().enumerate() {
            let want: f64 = (0..nu).map(|j| in_a[j][i]).sum();
            assert!(
                close(*g, want),
                "all-reduce rank {r} element {i}: got {g}, want {want}"
            );
        }
        let got = download(r, rb[r], cb);
        for (i, g) in got.iter().enumerate() {
            assert!(
                close(*g, in_b[0][i]),
                "broadcast rank {r} element {i}: got {g}"
            );
        }
    }
    let got = download(nu - 1, rc[nu - 1], cb);
    for (i, g) in got.iter().enumerate() {
        let want: f64 = (0..nu).map(|j| in_b[j][i]).sum();
        assert!(close(*g, want), "reduce element {i}: got {g}, want {want}");
    }
    eprintln!(
        "{iterations} rounds of 3 operations on 2 communicators over {n} GPUs: results correct"
    );
    for r in 0..nu {
        unsafe {
            pncclCommDestroy(a[r]);
            pncclCommDestroy(b[r]);
        }
        let d = r as i32;
        for p in [sa[r], sb[r], ra[r], rb[r], rc[r]] {
            mem::free(d, p).unwrap();
        }
        mem::stream_destroy(d, streams[r]).unwrap();
    }
}

/// `ncclRedOpCreatePreMulSum` with `ncclScalarDevice`: the scalar lives in
/// device memory and is read when the collective is called (after the work
/// already on its stream), not when the operator is created; each rank has
/// its own (a host read of the device pointer is the bug this guards).
#[test]
#[ignore = "needs a CUDA GPU: on the GPU machine, cargo test -p weft-nccl --test cuda -- --ignored (bench/gpu/run.sh rtest)"]
fn premulsum_reads_a_device_scalar_when_called() {
    const NAME: &str = "premulsum_reads_a_device_scalar_when_called";
    let Some(n) = devices_or_skip(NAME, 1) else {
        return;
    };
    let nu = n as usize;
    let comms = init_all(&(0..n).collect::<Vec<i32>>());
    let count = 1001usize;
    let mut rng = Rng::new(0xfeed_5ca1_ab1e_0001);
    let inputs: Vec<Vec<f64>> = (0..nu)
        .map(|_| (0..count).map(|_| small_value(&mut rng, F32)).collect())
        .collect();
    let send: Vec<u64> = (0..n).map(|d| mem::alloc(d, count * 4).unwrap()).collect();
    let recv: Vec<u64> = (0..n).map(|d| mem::alloc(d, count * 4).unwrap()).collect();
    let scalar: Vec<u64> = (0..n).map(|d| mem::alloc(d, 4).unwrap()).collect();
    let streams: Vec<u64> = (0..n).map(|d| mem::stream(d).unwrap()).collect();
    let mut ops = vec![0i32; nu];
    for r in 0..nu {
        let d = r as i32;
        mem::htod(d, send[r], &f32_bytes(&inputs[r])).unwrap();
        // Created with one value, used with another: read at call time.
        mem::htod(d, scalar[r], &f32_bytes(&[r as f64 + 2.0])).unwrap();
        let rc = unsafe {
            pncclRedOpCreatePreMulSum(&mut ops[r], scalar[r] as *mut c_void, F32, 0, comms[r])
        };
        assert_eq!(
            rc, 0,
            "ncclRedOpCreatePreMulSum(ncclScalarDevice) on rank {r}"
        );
        mem::htod(d, scalar[r], &f32_bytes(&[r as f64 + 3.0])).unwrap();
    }
    unsafe {
        assert_eq!(pncclGroupStart(), 0);
        for r in 0..nu {
            let rc = pncclAllReduce(
                send[r] as *const c_void,
                recv[r] as *mut c_void,
                count,
                F32,
                ops[r],
                comms[r],
                streams[r] as *mut c_void,
            );
            assert_eq!(rc, 0, "all-reduce with the PreMulSum op on rank {r}");
        }
        assert_eq!(pncclGroupEnd(), 0);
    }
    for d in 0..n {
        mem::sync(d).unwrap();
    }
    for (r, &out) in recv.iter().enumerate() {
        let mut bytes = vec![0u8; count * 4];
        mem::dtoh(r as i32, &mut bytes, out).unwrap();
        for (i, c) in bytes.chunks(4).enumerate() {
            let got = decode(F32, c);
            let want: f64 = (0..nu).map(|j| (j as f64 + 3.0) * inputs[j][i]).sum();
            assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                "rank {r} element {i}: got {got}, want {want} (sum of (rank + 3) x input)"
            );
        }
    }
    eprintln!("{NAME}: {n} GPUs, {count} floats, every rank's device scalar applied");
    for r in 0..nu {
        let d = r as i32;
        unsafe {
            assert_eq!(pncclRedOpDestroy(ops[r], comms[r]), 0);
            pncclCommDestroy(comms[r]);
        }
        for p in [send[r], recv[r], scalar[r]] {
            mem::free(d, p).unwrap();
        }
        mem::stream_destroy(d, streams[r]).unwrap();
    }
}

/// Raw handles moved into a rank's thread (the C API's handles are plain
/// pointers; each thread uses only its own rank's).
#[derive(Clone, Copy)]
struct RankHandles {
    comm: usize,
    stream: u64,
}
unsafe impl Send for RankHandles {}

/// What one rank's thread enqueues: (rank, its communicator, its stream,
/// its buffers).
type RankPhase<'a> = dyn Fn(usize, ncclComm_t, *mut c_void, &[u64]) + Sync + 'a;

/// Random, non-zero f32 values (exact bytes to compare): `count` of them for
/// `(rank, step)`.
fn ring_data(rank: usize, step: usize, count: usize) -> Vec<u8> {
    let mut rng =
        Rng::new(0x9e37_79b9_7f4a_7c15 ^ ((rank as u64) << 32) ^ ((step as u64 + 1) * 0x1234_5678));
    let mut b = vec![0u8; count * 4];
    for out in b.chunks_exact_mut(4) {
        out.copy_from_slice(&(((rng.next_u64() % 1_000_000) + 1) as f32).to_le_bytes());
    }
    b
}

/// Ranks as threads of one process, each with its own stream, on `devs[r]`:
/// the standard ring issued unbatched on one stream per rank, `ncclSend(next)`
/// then `ncclRecv(prev)`, which a send that waits for its receiver deadlocks
/// (every rank's send waits for a receive queued behind it). On fresh
/// communicators, so the ring is the first operation between the ranks; then,
/// without waiting in between, a grouped exchange and the ring again (an
/// eager send may still run while the grouped send to the same peer starts);
/// then two unbatched sends to next before two receives from prev. Every
/// received buffer equals prev's data.
fn unbatched_ring(name: &str, devs: &[i32], count: usize) {
    assert!(
        cuda::kernels::available(),
        "{name} needs kernels (the kernel path)"
    );
    let n = devs.len();
    let comms = init_all(devs);
    // Buffers 0..3: the three steps' sends; 3..6: their receives.
    let bytes = count * 4;
    let bufs: Vec<Vec<u64>> = (0..n)
        .map(|r| {
            (0..6)
                .map(|i| {
                    let p = mem::alloc(devs[r], bytes).unwrap();
                    let init = if i < 3 {
                        ring_data(r, i, count)
                    } else {
                        vec![0u8; bytes]
                    };
                    mem::htod(devs[r], p, &init).unwrap();
                    p
                })
                .collect()
        })
        .collect();
    let streams: Vec<u64> = devs.iter().map(|&d| mem::stream(d).unwrap()).collect();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let what = format!("{name}: {n} ranks on GPUs {devs:?}, {count} floats");
    let watch = what.clone();
    std::thread::spawn(move || {
        if rx
            .recv_timeout(std::time::Duration::from_secs(120))
            .is_err()
        {
            eprintln!(
                "FAILED {watch}: not done within 120 s (a send waiting for a receive queued behind it)"
            );
            std::process::exit(101);
        }
    });
    // Each rank's calls from its own thread; each thread waits for its own
    // stream only (a device-wide wait would wait for the other ranks' work).
    let run_phase = |phase: &RankPhase<'_>| {
        std::thread::scope(|s| {
            for r in 0..n {
                let h = RankHandles {
                    comm: comms[r] as usize,
                    stream: streams[r],
                };
                let (dev, b) = (devs[r], &bufs[r]);
                s.spawn(move || {
                    let h = h;
                    cuda::use_device(dev).unwrap();
                    let (c, st) = (h.comm as ncclComm_t, h.stream as *mut c_void);
                    phase(r, c, st, b);
                    let rc = unsafe {
                        cudarc::driver::sys::cuStreamSynchronize(
                            st as cudarc::driver::sys::CUstream,
                        )
                    };
                    assert_eq!(rc, cudarc::driver::sys::CUresult::CUDA_SUCCESS, "rank {r}");
                });
            }
        });
    };
    let p = |x: u64| x as *mut c_void;
    let (next, prev) = (
        |r: usize| ((r + 1) % n) as i32,
        |r: usize| ((r + n - 1) % n) as i32,
    );
    run_phase(&|r, c, st, b| unsafe {
        assert_eq!(pncclSend(p(b[0]), count, F32, next(r), c, st), 0);
        assert_eq!(pncclRecv(p(b[3]), count, F32, prev(r), c, st), 0);
        assert_eq!(pncclGroupStart(), 0);
        assert_eq!(pncclSend(p(b[1]), count, F32, next(r), c, st), 0);
        assert_eq!(pncclRecv(p(b[4]), count, F32, prev(r), c, st), 0);
        assert_eq!(pncclGroupEnd(), 0);
        assert_eq!(pncclSend(p(b[2]), count, F32, next(r), c, st), 0);
        assert_eq!(pncclRecv(p(b[5]), count, F32, prev(r), c, st), 0);
    });
    let check = |step: &str, recv: usize, from_step: usize| {
        for r in 0..n {
            let mut got = vec![0u8; bytes];
            mem::dtoh(devs[r], &mut got, bufs[r][recv]).unwrap();
            let want = ring_data((r + n - 1) % n, from_step, count);
            if let Some(i) = (0..count).find(|&i| got[4 * i..4 * i + 4] != want[4 * i..4 * i + 4]) {
                panic!(
                    "{what}, {step}: rank {r} element {i}: got {:?}, want {:?} (prev's data)",
                    &got[4 * i..4 * i + 4],
                    &want[4 * i..4 * i + 4]
                );
            }
        }
    };
    check("unbatched ring as the first operation", 3, 0);
    check("grouped exchange after it", 4, 1);
    check("unbatched ring after the grouped exchange", 5, 2);
    // Two unbatched sends in flight to one peer before its receives.
    for r in 0..n {
        for &b in &bufs[r][3..6] {
            mem::htod(devs[r], b, &vec![0u8; bytes]).unwrap();
        }
    }
    run_phase(&|r, c, st, b| unsafe {
        assert_eq!(pncclSend(p(b[0]), count, F32, next(r), c, st), 0);
        assert_eq!(pncclSend(p(b[1]), count, F32, next(r), c, st), 0);
        assert_eq!(pncclRecv(p(b[3]), count, F32, prev(r), c, st), 0);
        assert_eq!(pncclRecv(p(b[4]), count, F32, prev(r), c, st), 0);
    });
    check("first of two unbatched sends before the receives", 3, 0);
    check("second of two unbatched sends before the receives", 4, 1);
    let _ = tx.send(());
    eprintln!("{what}: correct");
    for r in 0..n {
        unsafe { pncclCommDestroy(comms[r]) };
        for &b in &bufs[r] {
            mem::free(devs[r], b).unwrap();
        }
        mem::stream_destroy(devs[r], streams[r]).unwrap();
    }
}

/// The unbatched ring (see [`unbatched_ring`]) with 2 and 3 ranks sharing
/// GPU 0, at 333 floats, 1 Mi floats and 16 Mi floats (64 MiB).
#[test]
#[ignore = "needs a CUDA GPU: on the GPU machine, cargo test -p weft-nccl --test cuda -- --ignored (bench/gpu/run.sh rtest)"]
fn unbatched_send_then_recv_ring_completes_on_one_gpu() {
    const NAME: &str = "unbatched_send_then_recv_ring_completes_on_one_gpu";
    let Some(_) = devices_or_skip(NAME, 1) else {
        return;
    };
    for n in [2, 3] {
        for count in [333, 1 << 20, 16 << 20] {
            unbatched_ring(NAME, &vec![0; n], count);
        }
    }
}

/// The unbatched ring over two GPUs (rank r on GPU r % 2): the receiver on
/// the other GPU reads the sender's staging buffer in place, which the
/// staging pool must grant it.
#[test]
#[ignore = "needs 2 CUDA GPUs: on the GPU machine, cargo test -p weft-nccl --test cuda -- --ignored (bench/gpu/run.sh rtest)"]
fn unbatched_send_then_recv_ring_completes_across_gpus() {
    const NAME: &str = "unbatched_send_then_recv_ring_completes_across_gpus";
    let Some(_) = devices_or_skip(NAME, 2) else {
        return;
    };
    for n in [2i32, 3] {
        let devs: Vec<i32> = (0..n).map(|r| r % 2).collect();
        for count in [333, 1 << 20, 16 << 20] {
            unbatched_ring(NAME, &devs, count);
        }
    }
}

/// A send buffer's element `i` on rank `r` (small integers: sums are exact).
fn colocated_value(r: usize, i: usize) -> f32 {
    (r + 1 + i % 7) as f32
}

/// Several ranks of one communicator on one GPU in one process: grouped
/// init (ncclGroupStart, ncclCommInitRank per rank, ncclGroupEnd) of 4 ranks
/// on GPU 0, then grouped collectives on one stream per rank, small and large
/// (the large ones fill a GPU's worth of blocks per rank: 4 ranks' kernels
/// must all be resident at once, which the block cap of `mapping.rs`
/// ensures; before it, this hung for ever), and a grouped all-to-all of
/// sends and receives. Every result checked (sampled for the large ones).
#[test]
#[ignore = "needs a CUDA GPU: on the GPU machine, cargo test -p weft-nccl --test cuda -- --ignored (bench/gpu/run.sh rtest)"]
#[allow(clippy::needless_range_loop)] // ranks index several arrays
fn four_ranks_on_one_gpu_in_one_process_run_grouped_collectives() {
    const NAME: &str = "four_ranks_on_one_gpu_in_one_process_run_grouped_collectives";
    let Some(_) = devices_or_skip(NAME, 1) else {
        return;
    };
    assert!(
        cuda::kernels::available(),
        "{NAME} needs kernels (the kernel path)"
    );
    const N: usize = 4;
    let dev = 0;
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if rx
            .recv_timeout(std::time::Duration::from_secs(180))
            .is_err()
        {
            eprintln!(
                "FAILED {NAME}: not done within 180 s (ranks sharing a GPU waiting on each other)"
            );
            std::process::exit(101);
        }
    });
    let mut id = std::mem::MaybeUninit::<ncclUniqueId>::zeroed();
    assert_eq!(unsafe { pncclGetUniqueId(id.as_mut_ptr()) }, 0);
    let id = unsafe { id.assume_init() };
    let mut comms: Vec<ncclComm_t> = vec![std::ptr::null_mut(); N];
    cuda::use_device(dev).unwrap();
    unsafe {
        assert_eq!(pncclGroupStart(), 0);
        for (r, c) in comms.iter_mut().enumerate() {
            assert_eq!(pncclCommInitRank(c, N as i32, id, r as i32), 0, "rank {r}");
        }
        assert_eq!(pncclGroupEnd(), 0, "grouped init of {N} ranks on GPU {dev}");
    }
    let streams: Vec<u64> = (0..N).map(|_| mem::stream(dev).unwrap()).collect();
    let p = |x: u64| x as *mut c_void;
    let st = |r: usize| streams[r] as *mut c_void;
    let sync_all = || {
        for &s in &streams {
            let rc = unsafe {
                cudarc::driver::sys::cuStreamSynchronize(s as cudarc::driver::sys::CUstream)
            };
            assert_eq!(rc, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
        }
    };
    // Elements to check: every one below 4096, else about 4096 spread out
    // plus the last.
    let sample = |count: usize| -> Vec<usize> {
        let step = (count / 4096).max(1);
        let mut v: Vec<usize> = (0..count).step_by(step).collect();
        v.push(count - 1);
        v
    };
    let read = |buf: u64, bytes: usize| -> Vec<f32> {
        let mut b = vec![0u8; bytes];
        mem::dtoh(dev, &mut b, buf).unwrap();
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    // 1 Ki floats (few blocks), 4 Mi (direct kernels, up to 128 blocks),
    // 80 Mi = 320 MiB (broadcast and reduce as chains, 128 blocks each).
    for count in [1usize << 10, 4 << 20, 80 << 20] {
        let bytes = count * 4;
        let input: Vec<u64> = (0..N)
            .map(|r| {
                let b = mem::alloc(dev, bytes).unwrap();
                let v: Vec<u8> = (0..count)
                    .flat_map(|i| colocated_value(r, i).to_le_bytes())
                    .collect();
                mem::htod(dev, b, &v).unwrap();
                b
            })
            .collect();
        let out: Vec<u64> = (0..N).map(|_| mem::alloc(dev, bytes).unwrap()).collect();
        let what = |c: &str| format!("{NAME}: {c} of {count} floats");
        // All-reduce (sum).
        unsafe {
            assert_eq!(pncclGroupStart(), 0);
            for r in 0..N {
                assert_eq!(
                    pncclAllReduce(p(input[r]), p(out[r]), count, F32, 0, comms[r], st(r)),
                    0
                );
            }
            assert_eq!(pncclGroupEnd(), 0);
        }
        sync_all();
        for r in 0..N {
            let got = read(out[r], bytes);
            for &i in &sample(count) {
                let want: f32 = (0..N).map(|q| colocated_value(q, i)).sum();
                assert_eq!(got[i], want, "{}: rank {r} element {i}", what("all-reduce"));
            }
        }
        // Broadcast from rank 1.
        unsafe {
            assert_eq!(pncclGroupStart(), 0);
            for r in 0..N {
                assert_eq!(
                    pncclBroadcast(p(input[r]), p(out[r]), count, F32, 1, comms[r], st(r)),
                    0
                );
            }
            assert_eq!(pncclGroupEnd(), 0);
        }
        sync_all();
        for r in 0..N {
            let got = read(out[r], bytes);
            for &i in &sample(count) {
                assert_eq!(
                    got[i],
                    colocated_value(1, i),
                    "{}: rank {r} element {i}",
                    what("broadcast")
                );
            }
        }
        // Reduce (max) to rank 2.
        unsafe {
            assert_eq!(pncclGroupStart(), 0);
            for r in 0..N {
                assert_eq!(
                    pncclReduce(p(input[r]), p(out[r]), count, F32, 2, 2, comms[r], st(r)),
                    0
                );
            }
            assert_eq!(pncclGroupEnd(), 0);
        }
        sync_all();
        let got = read(out[2], bytes);
        for &i in &sample(count) {
            assert_eq!(
                got[i],
                colocated_value(N - 1, i),
                "{}: element {i}",
                what("reduce")
            );
        }
        for r in 0..N {
            mem::free(dev, out[r]).unwrap();
        }
        // All-gather and the grouped all-to-all of sends and receives, up to
        // 4 Mi floats per rank.
        if count <= 4 << 20 {
            let gathered: Vec<u64> = (0..N)
                .map(|_| mem::alloc(dev, N * bytes).unwrap())
                .collect();
            unsafe {
                assert_eq!(pncclGroupStart(), 0);
                for r in 0..N {
                    assert_eq!(
                        pncclAllGather(p(input[r]), p(gathered[r]), count, F32, comms[r], st(r)),
                        0
                    );
                }
                assert_eq!(pncclGroupEnd(), 0);
            }
            sync_all();
            for r in 0..N {
                let got = read(gathered[r], N * bytes);
                for q in 0..N {
                    for &i in &sample(count) {
                        assert_eq!(
                            got[q * count + i],
                            colocated_value(q, i),
                            "{}: rank {r} part {q} element {i}",
                            what("all-gather")
                        );
                    }
                }
            }
            // All-to-all: rank r sends part d of its all-gathered buffer
            // (rank d's input) to rank d, so every rank receives its own
            // input from everyone.
            let recv: Vec<u64> = (0..N)
                .map(|_| mem::alloc(dev, N * bytes).unwrap())
                .collect();
            unsafe {
                assert_eq!(pncclGroupStart(), 0);
                for r in 0..N {
                    for d in 0..N {
                        let off = (d * bytes) as u64;
                        assert_eq!(
                            pncclSend(p(gathered[r] + off), count, F32, d as i32, comms[r], st(r)),
                            0
                        );
                        assert_eq!(
                            pncclRecv(p(recv[r] + off), count, F32, d as i32, comms[r], st(r)),
                            0
                        );
                    }
                }
                assert_eq!(pncclGroupEnd(), 0);
            }
            sync_all();
            for r in 0..N {
                let got = read(recv[r], N * bytes);
                for q in 0..N {
                    for &i in &sample(count) {
                        assert_eq!(
                            got[q * count + i],
                            colocated_value(r, i),
                            "{}: rank {r} from {q} element {i}",
                            what("all-to-all")
                        );
                    }
                }
                mem::free(dev, gathered[r]).unwrap();
                mem::free(dev, recv[r]).unwrap();
            }
        }
        for r in 0..N {
            mem::free(dev, input[r]).unwrap();
        }
        eprintln!("{NAME}: {count} floats correct");
    }
    let _ = tx.send(());
    for r in 0..N {
        assert_eq!(unsafe { pncclCommDestroy(comms[r]) }, 0);
        mem::stream_destroy(dev, streams[r]).unwrap();
    }
}

/// Two ranks of one communicator in one process given the same stream in a
/// group: their kernels would wait for each other on one stream (a
/// deadlock), so the group is refused with ncclInvalidUsage before anything
/// is enqueued; the same group on a stream per rank then works.
#[test]
#[ignore = "needs a CUDA GPU: on the GPU machine, cargo test -p weft-nccl --test cuda -- --ignored (bench/gpu/run.sh rtest)"]
#[allow(clippy::needless_range_loop)] // ranks index several arrays
fn two_ranks_on_one_stream_are_refused_not_hung() {
    const NAME: &str = "two_ranks_on_one_stream_are_refused_not_hung";
    let Some(_) = devices_or_skip(NAME, 1) else {
        return;
    };
    assert!(cuda::kernels::available(), "{NAME} needs kernels");
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if rx.recv_timeout(std::time::Duration::from_secs(60)).is_err() {
            eprintln!("FAILED {NAME}: hung");
            std::process::exit(101);
        }
    });
    let devs = [0, 0];
    let comms = init_all(&devs);
    let count = 1 << 16;
    let bufs: Vec<u64> = (0..2).map(|_| mem::alloc(0, count * 4).unwrap()).collect();
    let streams: Vec<u64> = (0..2).map(|_| mem::stream(0).unwrap()).collect();
    let p = |x: u64| x as *mut c_void;
    let group = |st: [u64; 2]| unsafe {
        assert_eq!(pncclGroupStart(), 0);
        for r in 0..2 {
            assert_eq!(
                pncclAllReduce(p(bufs[r]), p(bufs[r]), count, F32, 0, comms[r], p(st[r])),
                0
            );
        }
        pncclGroupEnd()
    };
    // First on a stream each (sets the device side up), then one stream.
    assert_eq!(group([streams[0], streams[1]]), 0);
    mem::sync(0).unwrap();
    assert_eq!(group([streams[0], streams[0]]), 5, "ncclInvalidUsage");
    let msg = unsafe { std::ffi::CStr::from_ptr(pncclGetLastError(comms[0])) }
        .to_string_lossy()
        .into_owned();
    assert!(msg.contains("same CUDA stream"), "{msg}");
    assert_eq!(
        group([streams[0], streams[1]]),
        0,
        "a stream each still works"
    );
    mem::sync(0).unwrap();
    let _ = tx.send(());
    for r in 0..2 {
        assert_eq!(unsafe { pncclCommDestroy(comms[r]) }, 0);
        mem::free(0, bufs[r]).unwrap();
        mem::stream_destroy(0, streams[r]).unwrap();
    }
}
