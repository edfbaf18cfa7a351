//! `rank-worker train STEPS SCENARIO VICTIM STEP [--step-ms=N]` (also the
//! `resilient-train` program): data-parallel least
//! squares under libcomm's `Resilient`, for `weft run --replace-failed`.
//!
//! Each logical rank owns a fixed shard of samples; a step sums the shards'
//! gradients (quantised to integers, so the sum is exact in any order and on
//! any number of processes), all-reduces them and updates the weights. So
//! the final weights equal those of a run without failure exactly when no
//! step is skipped or done twice, whoever computed which shard.
//!
//! Scenarios (the failure hits incarnation 0 of logical rank VICTIM in step
//! STEP, after its gradient, before the all-reduce):
//! - `none`: no failure;
//! - `kill`: SIGKILL;
//! - `twice`: SIGKILL, then VICTIM+1 is SIGKILLed in step STEP+1;
//! - `inshrink`: SIGKILL, and VICTIM+1 SIGKILLs itself while the survivors
//!   recover (95-125 ms, by STEP, after the launcher recorded the first
//!   death: about when the survivors have noticed it and shrink);
//! - `grow`: SIGKILL, and its first replacement SIGKILLs itself as soon as
//!   the survivors publish its grow id (it dies during the grow);
//! - `stop`: SIGSTOP (a frozen rank; found by the survivors' timeout).
//!
//! A fifth argument `device` all-reduces the gradients in CUDA device memory
//! (device 0, the legacy stream; ranks may share the GPU), checking the
//! communicator's async error after the copy back, as a program must: a
//! peer's death during device work surfaces there.
//!
//! Prints `@ kill t=MS`, `@ shrunk t=MS size=N`, `@ grown t=MS size=N`,
//! `@ growfail t=MS`, and at the end `@ final w=HEX` and `@ steps=N`.

use libcomm::resilient::{RecoveryEvent, Resilient, State};
use libcomm::{Communicator, DataType, Error, Memory, Op, ReduceOp};
use std::io::Write;
use std::time::{Duration, SystemTime};

const D: usize = 8;
const M: usize = 16;
const SCALE: f64 = (1u64 << 24) as f64;

struct Model {
    w: Vec<f64>,
}

impl State for Model {
    fn save(&self) -> Vec<u8> {
        self.w.iter().flat_map(|x| x.to_le_bytes()).collect()
    }
    fn load(&mut self, b: &[u8]) -> libcomm::Result<()> {
        if b.len() != 8 * D {
            return Err(Error::InvalidArgument(format!(
                "state of {} bytes",
                b.len()
            )));
        }
        self.w = b
            .chunks(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        Ok(())
    }
}

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn unit(seed: u64) -> f64 {
    (mix(seed) >> 11) as f64 / (1u64 << 53) as f64 - 0.5
}

/// Shard `r`'s gradient of 0.5 |Xw - y|^2, quantised.
fn grad(r: usize, w: &[f64], g: &mut [i64]) {
    for i in 0..M {
        let s = (r * M + i) as u64 * 1000;
        let x: Vec<f64> = (0..D).map(|j| unit(s + j as u64)).collect();
        let y = (0..D).map(|j| x[j] * (j as f64 + 1.0)).sum::<f64>() + 0.01 * unit(s + 999);
        let e = (0..D).map(|j| x[j] * w[j]).sum::<f64>() - y;
        for j in 0..D {
            g[j] += (e * x[j] * SCALE).round() as i64;
        }
    }
}

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis()
}

fn ms(t: SystemTime) -> u128 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis()
}

fn say(s: String) {
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{s}");
    let _ = o.flush();
}

fn events(r: &mut Resilient) {
    for e in r.take_events() {
        match e {
            RecoveryEvent::Shrunk {
                size,
                at,
                redo_from,
                ..
            } => say(format!(
                "@ shrunk t={} size={size} redo={redo_from}",
                ms(at)
            )),
            RecoveryEvent::Grown { size, at, .. } => {
                say(format!("@ grown t={} size={size}", ms(at)))
            }
            RecoveryEvent::GrowFailed { at, .. } => say(format!("@ growfail t={}", ms(at))),
        }
    }
}

/// The gradient all-reduce on device memory.
fn all_reduce_device(comm: &Communicator, g: &mut [i64]) -> libcomm::Result<()> {
    use libcomm::cuda::mem;
    let cuda = |e: libcomm::cuda::CudaError| Error::Cuda(e.to_string());
    let bytes = std::mem::size_of_val(g);
    let p = mem::alloc(0, bytes).map_err(cuda)?;
    let host: Vec<u8> = g.iter().flat_map(|x| x.to_le_bytes()).collect();
    let r = (|| {
        mem::htod(0, p, &host).map_err(cuda)?;
        let op = Op::all_reduce(
            p as *const u8,
            p as *mut u8,
            g.len(),
            DataType::I64,
            ReduceOp::Sum,
        )
        .on(Memory::Device(0), std::ptr::null_mut());
        // SAFETY: p holds g.len() i64 on device 0 until freed below, after a sync.
        unsafe { comm.submit(op) }?;
        let mut back = vec![0u8; bytes];
        mem::dtoh(0, &mut back, p).map_err(cuda)?;
        // A peer lost during the kernel: the kernel returned (abort word),
        // the data is undefined and the error is here.
        comm.async_error()?;
        for (x, c) in g.iter_mut().zip(back.chunks(8)) {
            *x = i64::from_le_bytes(c.try_into().unwrap());
        }
        Ok(())
    })();
    let _ = mem::free(0, p);
    r
}

fn env_u32(name: &str) -> u32 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// `--step-ms=N`: sleep N ms after each step and report progress every 10
/// steps (`@ step N size=S t=MS`), for jobs that must run long enough to
/// lose a pod on purpose (the e2e ReplaceRank scenarios).
fn step_pause(flags: &[&String]) -> Result<Duration, String> {
    let mut pause = Duration::ZERO;
    for f in flags {
        let ms = f
            .strip_prefix("--step-ms=")
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("unknown option {f} (--step-ms=N)"))?;
        pause = Duration::from_millis(ms);
    }
    Ok(pause)
}

pub fn run(args: &[String]) -> Result<(), String> {
    let (flags, args): (Vec<&String>, Vec<&String>) =
        args.iter().partition(|a| a.starts_with("--"));
    let pause = step_pause(&flags)?;
    let steps: u64 = args.first().and_then(|s| s.parse().ok()).ok_or("STEPS")?;
    let scenario = args
        .get(1)
        .map(|s| s.to_string())
        .unwrap_or_else(|| "none".into());
    let victim: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(0);
    let at: u64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(0);
    let device = args.get(4).is_some_and(|a| *a == "device");
    let inc = env_u32("WEFT_INCARNATION");
    let logical = env_u32("WEFT_RANK") as usize;
    if scenario == "grow" && inc == 1 && logical == victim {
        // Die during the grow: as soon as the survivors publish our grow id.
        let dir = std::env::var("WEFT_RECOVERY_DIR").map_err(|e| e.to_string())?;
        let f = std::path::Path::new(&dir).join(format!("grow-{logical}-1"));
        std::thread::spawn(move || {
            loop {
                if f.exists() {
                    say(format!("@ kill t={} (during grow)", now_ms()));
                    unsafe { libc::raise(libc::SIGKILL) };
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        });
    }
    let world_env = env_u32("WEFT_WORLD_SIZE") as usize;
    if scenario == "inshrink" && inc == 0 && logical == (victim + 1) % world_env.max(1) {
        // A second failure during the recovery of the first.
        let dir = std::env::var("WEFT_RECOVERY_DIR").map_err(|e| e.to_string())?;
        let f = std::path::Path::new(&dir).join("dead");
        let delay = Duration::from_millis(95 + at % 31);
        std::thread::spawn(move || {
            loop {
                if f.exists() {
                    std::thread::sleep(delay);
                    say(format!("@ kill t={} (during the shrink)", now_ms()));
                    unsafe { libc::raise(libc::SIGKILL) };
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        });
    }
    // In a pod (WEFT_SIDECAR_SOCKET set) the process attaches to its
    // sidecar, as C ABI programs do by themselves: the sidecar learns of
    // its death (and relays it) when its attach stream closes.
    if std::env::var_os("WEFT_SIDECAR_SOCKET").is_some() {
        weft::agent::install_from_env().map_err(|e| format!("attaching to the sidecar: {e}"))?;
    }
    let mut r = Resilient::from_env().map_err(|e| format!("start: {e}"))?;
    let world = r.world();
    let mut model = Model { w: vec![0.0; D] };
    if r.restore(&mut model).map_err(|e| e.to_string())? {
        say(format!(
            "@ joined t={} at_step={}",
            now_ms(),
            r.steps_done()
        ));
    }
    let lr = 0.5 / (world * M) as f64;
    while r.steps_done() < steps {
        r.step(&mut model, |s, m| {
            let mut g = vec![0i64; D];
            for &sh in &s.shards {
                grad(sh, &m.w, &mut g);
            }
            if inc == 0 {
                let second =
                    scenario == "twice" && logical == (victim + 1) % world && s.index == at + 1;
                if (logical == victim && s.index == at && scenario != "none") || second {
                    say(format!("@ kill t={} step={}", now_ms(), s.index));
                    let sig = if scenario == "stop" {
                        libc::SIGSTOP
                    } else {
                        libc::SIGKILL
                    };
                    unsafe { libc::raise(sig) };
                }
            }
            if device {
                all_reduce_device(s.comm, &mut g)?;
            } else {
                s.comm.all_reduce_in_place(&mut g, ReduceOp::Sum)?;
            }
            for (w, g) in m.w.iter_mut().zip(&g) {
                *w -= lr * *g as f64 / SCALE;
            }
            Ok(())
        })
        .map_err(|e| format!("step {}: {e}", r.steps_done()))?;
        events(&mut r);
        if !pause.is_zero() {
            if r.steps_done() % 10 == 0 {
                say(format!(
                    "@ step {} size={} t={}",
                    r.steps_done(),
                    r.size(),
                    now_ms()
                ));
            }
            std::thread::sleep(pause);
        }
    }
    r.finish(&mut model).map_err(|e| format!("finish: {e}"))?;
    events(&mut r);
    let hex: String = model
        .w
        .iter()
        .map(|x| format!("{:016x}", x.to_bits()))
        .collect();
    say(format!("@ final w={hex}"));
    say(format!("@ steps={} size={}", r.steps_done(), r.size()));
    r.comm().destroy().map_err(|e| e.to_string())?;
    Ok(())
}
