//! `WEFT_TIMEOUT_MS` on the device path: a kernel that waits for a peer that
//! never comes (a frozen rank, here one that never calls) makes no progress;
//! after the timeout its wait reports the address it polls, the device watch
//! fails the communicator (the reason names the timeout and the rank waited
//! for) and fires the abort word, so the stream drains and every later call
//! and `ncclCommGetAsyncError` return `ncclRemoteError`, on both ranks.
//! Its own test binary: the variable must be set before any communicator
//! exists, and no other test of the process may see it.

use libcomm::cuda::{self, mem};
use nccl::api::*;
use std::ffi::{CStr, c_void};
use std::time::{Duration, Instant};

const F32: i32 = 7;
const REMOTE_ERROR: i32 = 6;

#[test]
#[ignore = "needs a CUDA GPU: on the GPU machine, cargo test -p weft-nccl --test cuda_timeout -- --ignored"]
#[allow(clippy::needless_range_loop)] // ranks index several arrays
fn a_kernel_waiting_for_a_peer_that_never_comes_times_out() {
    const NAME: &str = "a_kernel_waiting_for_a_peer_that_never_comes_times_out";
    if let Err(e) = cuda::driver() {
        panic!("{NAME} needs a CUDA GPU: {e}");
    }
    assert!(cuda::device_count() > 0, "{NAME} needs a CUDA GPU");
    assert!(cuda::kernels::available(), "{NAME} needs kernels");
    const TIMEOUT_MS: u64 = 1500;
    // SAFETY: before any other thread of this test binary reads the
    // environment (its only test, and no communicator yet).
    unsafe { std::env::set_var("WEFT_TIMEOUT_MS", TIMEOUT_MS.to_string()) };
    let devs = [0, (cuda::device_count() - 1).min(1)];
    let mut comms: Vec<ncclComm_t> = vec![std::ptr::null_mut(); 2];
    assert_eq!(
        unsafe { pncclCommInitAll(comms.as_mut_ptr(), 2, devs.as_ptr()) },
        0
    );
    let count = 1 << 18;
    let bufs: Vec<u64> = devs
        .iter()
        .map(|&d| mem::alloc(d, count * 4).unwrap())
        .collect();
    let streams: Vec<u64> = devs.iter().map(|&d| mem::stream(d).unwrap()).collect();
    let (b, s) = (
        |r: usize| bufs[r] as *mut c_void,
        |r: usize| streams[r] as *mut c_void,
    );
    let sync = |r: usize| unsafe {
        cudarc::driver::sys::cuStreamSynchronize(streams[r] as cudarc::driver::sys::CUstream)
    };
    // Both ranks once: sets up the device side (and the watch).
    unsafe {
        assert_eq!(pncclGroupStart(), 0);
        for r in 0..2 {
            assert_eq!(pncclAllReduce(b(r), b(r), count, F32, 0, comms[r], s(r)), 0);
        }
        assert_eq!(pncclGroupEnd(), 0);
    }
    for r in 0..2 {
        assert_eq!(sync(r), cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    }
    // A hang here is the failure this test exists for.
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if rx.recv_timeout(Duration::from_secs(30)).is_err() {
            eprintln!("FAILED {NAME}: the stream did not drain within 30 s");
            std::process::exit(101);
        }
    });
    // Rank 0 alone: its kernel waits for rank 1 at the entry barrier.
    let t = Instant::now();
    cuda::use_device(devs[0]).unwrap();
    assert_eq!(
        unsafe { pncclAllReduce(b(0), b(0), count, F32, 0, comms[0], s(0)) },
        0
    );
    let _ = sync(0);
    let drained = t.elapsed();
    let _ = tx.send(());
    eprintln!("{NAME}: the stream drained {drained:?} after the launch");
    assert!(
        drained >= Duration::from_millis(TIMEOUT_MS) - Duration::from_millis(50),
        "drained after {drained:?}, before the timeout: something else stopped the kernel"
    );
    assert!(
        drained < Duration::from_millis(TIMEOUT_MS + 2000),
        "drained after {drained:?}: the timeout is {TIMEOUT_MS} ms"
    );
    for r in 0..2 {
        let mut err = 0;
        assert_eq!(unsafe { pncclCommGetAsyncError(comms[r], &mut err) }, 0);
        assert_eq!(err, REMOTE_ERROR, "rank {r}: ncclCommGetAsyncError");
        let msg = unsafe { CStr::from_ptr(pncclGetLastError(comms[r])) }
            .to_string_lossy()
            .into_owned();
        eprintln!("rank {r}: {msg}");
        assert!(
            msg.contains("no progress for 1500 ms") && msg.contains("rank 1 (the barrier"),
            "rank {r}: the reason names the timeout and the rank waited for: {msg}"
        );
        // Later calls fail at once.
        let t = Instant::now();
        assert_eq!(
            unsafe { pncclAllReduce(b(r), b(r), count, F32, 0, comms[r], s(r)) },
            REMOTE_ERROR,
            "rank {r}: a call after the timeout"
        );
        assert!(t.elapsed() < Duration::from_millis(100));
    }
    for r in 0..2 {
        let t = Instant::now();
        assert_eq!(unsafe { pncclCommAbort(comms[r]) }, 0);
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "ncclCommAbort took {:?}",
            t.elapsed()
        );
    }
}
