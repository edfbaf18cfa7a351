//! A process on a machine that never ran Weft: with an empty kernel cache,
//! its first all-reduces load the machine code the build compiled and
//! compile nothing (no NVRTC), and how long init and the first bf16 and f32
//! all-reduce take. Its own test binary (so its own process, and the
//! variables below are set before any communicator exists).
//!
//! `WEFT_KERNEL_SOURCE` picks the path to measure: unset (`auto`, the
//! machine code), `ptx` (the driver JIT-compiles the build's PTX: set
//! `CUDA_CACHE_DISABLE=1` too, or the driver's cache makes it warm) or
//! `nvrtc` (compiled in the process, as every kernel was before the build
//! compiled them). docs/PERFORMANCE-GPU.md has the commands.

use libcomm::cuda::{self, kernels, mem};
use nccl::api::*;
use std::ffi::c_void;
use std::time::{Duration, Instant};

const F32: i32 = 7;
const BF16: i32 = 9;
const SUM: i32 = 0;

/// Elements per all-reduce: 1 Mi (2 MiB of bf16, 4 MiB of f32).
const COUNT: usize = 1 << 20;

#[test]
#[ignore = "needs a CUDA GPU: on the GPU machine, cargo test --release -p weft-nccl --test cuda_cold_start -- --ignored --nocapture"]
#[allow(clippy::needless_range_loop)] // ranks index several arrays
fn first_all_reduce_of_a_fresh_process_compiles_nothing() {
    const NAME: &str = "first_all_reduce_of_a_fresh_process_compiles_nothing";
    let cache = std::env::temp_dir().join(format!("weft-cold-start-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    // SAFETY: the only test of this binary, before anything reads the
    // environment.
    unsafe { std::env::set_var("WEFT_KERNEL_CACHE", &cache) };
    let source = std::env::var("WEFT_KERNEL_SOURCE").unwrap_or_else(|_| "auto".into());
    if let Err(e) = cuda::driver() {
        panic!("{NAME} needs a CUDA GPU: {e}");
    }
    let gpus = cuda::device_count().min(4);
    assert!(gpus > 0, "{NAME} needs a CUDA GPU");
    // Two ranks on one GPU where there is one (a single rank copies, with
    // no kernel).
    let devs: Vec<i32> = if gpus == 1 {
        vec![0, 0]
    } else {
        (0..gpus).collect()
    };
    let n = devs.len() as i32;
    let cc = cuda::compute_capability(0).unwrap();

    let t = Instant::now();
    let mut comms: Vec<ncclComm_t> = vec![std::ptr::null_mut(); n as usize];
    assert_eq!(
        unsafe { pncclCommInitAll(comms.as_mut_ptr(), n, devs.as_ptr()) },
        0
    );
    let init = t.elapsed();
    let bufs: Vec<u64> = devs
        .iter()
        .map(|&d| mem::alloc(d, COUNT * 4).unwrap())
        .collect();
    let streams: Vec<u64> = devs.iter().map(|&d| mem::stream(d).unwrap()).collect();

    // Every element of every rank is 1 (bf16 0x3f80, f32 0x3f800000): the
    // sum is n, exact in both types.
    let all_reduce = |dt: i32| -> Duration {
        let (one, size): (&[u8], usize) = match dt {
            BF16 => (&[0x80, 0x3f], 2),
            _ => (&[0, 0, 0x80, 0x3f], 4),
        };
        let ones: Vec<u8> = one.iter().copied().cycle().take(COUNT * size).collect();
        for (r, &d) in devs.iter().enumerate() {
            mem::htod(d, bufs[r], &ones).unwrap();
        }
        let t = Instant::now();
        unsafe {
            assert_eq!(pncclGroupStart(), 0);
            for r in 0..n as usize {
                let b = bufs[r] as *mut c_void;
                let s = streams[r] as *mut c_void;
                assert_eq!(pncclAllReduce(b, b, COUNT, dt, SUM, comms[r], s), 0);
            }
            assert_eq!(pncclGroupEnd(), 0);
        }
        for &d in &devs {
            mem::sync(d).unwrap();
        }
        let took = t.elapsed();
        for (r, &d) in devs.iter().enumerate() {
            let mut got = vec![0u8; COUNT * size];
            mem::dtoh(d, &mut got, bufs[r]).unwrap();
            let want = match dt {
                BF16 => half::bf16::from_f32(n as f32).to_le_bytes().to_vec(),
                _ => (n as f32).to_le_bytes().to_vec(),
            };
            for (i, e) in got.chunks_exact(size).enumerate().step_by(4099) {
                assert_eq!(e, want.as_slice(), "rank {r} element {i} (type {dt})");
            }
        }
        took
    };
    let first_bf16 = all_reduce(BF16);
    let first_f32 = all_reduce(F32);
    let warm_bf16 = all_reduce(BF16);

    let [cubin, ptx, nvrtc] = kernels::loads();
    let compiles = kernels::nvrtc_compiles();
    println!(
        "cold start, WEFT_KERNEL_SOURCE={source}, {gpus} GPU(s) of compute capability {}.{}, \
         {n} ranks: init {:.1} ms, first bf16 all_reduce {:.1} ms, first f32 all_reduce {:.1} ms, \
         warm bf16 all_reduce {:.2} ms; kernels loaded: {cubin} cubin, {ptx} PTX, {nvrtc} NVRTC \
         ({compiles} NVRTC compilations)",
        cc.0,
        cc.1,
        ms(init),
        ms(first_bf16),
        ms(first_f32),
        ms(warm_bf16),
    );
    match source.as_str() {
        "nvrtc" => assert!(nvrtc > 0 && compiles > 0, "NVRTC was asked for"),
        // The build's PTX is for PTX_ARCH (newer GPUs than the cubins'): an
        // older GPU cannot JIT it, so there NVRTC is the fallback (measured
        // on an H200, 9.0: ~2 s for the first bf16 all-reduce).
        "ptx" if cc.0 * 10 + cc.1 < cuda::PTX_ARCH as i32 => {
            assert!(
                ptx == 0 && nvrtc > 0,
                "PTX for a newer GPU cannot load here"
            );
        }
        "ptx" => {
            assert!(ptx > 0, "the build's PTX was asked for");
            assert_eq!(compiles, 0, "NVRTC compiled kernels");
        }
        _ => {
            assert_eq!(
                compiles, 0,
                "NVRTC compiled kernels: this build carries no machine code for compute capability {}.{} (or was built without NVRTC)",
                cc.0, cc.1
            );
            assert!(
                cubin > 0 && ptx == 0 && nvrtc == 0,
                "every kernel from a cubin"
            );
        }
    }
    for r in 0..n as usize {
        assert_eq!(unsafe { pncclCommDestroy(comms[r]) }, 0);
        mem::free(devs[r], bufs[r]).unwrap();
        mem::stream_destroy(devs[r], streams[r]).unwrap();
    }
    let _ = std::fs::remove_dir_all(&cache);
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
