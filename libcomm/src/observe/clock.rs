//! Wall-clock stamps for operation events, cheap enough to take twice per
//! collective. `SystemTime::now` is a vDSO call with the clock source's
//! arithmetic: 20-40 ns in the VMs we measure on, a tenth of an 8-byte
//! all-reduce. Reading the TSC costs a few nanoseconds.
//!
//! On x86_64 with an invariant TSC (`constant_tsc` and `nonstop_tsc` in
//! /proc/cpuinfo), a stamp is this thread's last wall-clock sample plus the
//! TSC ticks since, scaled by the rate this thread measured between its
//! first sample and its latest. A thread samples the wall clock again every
//! [`RESAMPLE_NS`] or so, so a step of the wall clock (NTP, a manual
//! change) shows within that long, and the rate's baseline keeps growing;
//! a rate that moves by more than 0.1% (the wall clock stepped) is measured
//! afresh.
//! Before a thread knows the rate (its first [`RESAMPLE_NS`]), on other
//! machines, and whenever the TSC runs backwards, a stamp is
//! `SystemTime::now`. Per thread: no state is shared, so nothing tears.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How often a thread samples the wall clock (about).
const RESAMPLE_NS: u64 = 20_000_000;

/// A wall-clock stamp for an event.
pub(crate) fn now() -> SystemTime {
    at(now_ns())
}

/// The same stamp, in ns since the Unix epoch.
pub(crate) fn now_ns() -> u64 {
    #[cfg(target_arch = "x86_64")]
    if invariant_tsc() {
        return tsc::now_ns();
    }
    wall_ns()
}

/// A stamp from [`now_ns`] as a time.
pub(crate) fn at(ns: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_nanos(ns)
}

fn wall_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

#[cfg(target_arch = "x86_64")]
fn invariant_tsc() -> bool {
    use std::sync::OnceLock;
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|s| {
            s.lines().find(|l| l.starts_with("flags")).is_some_and(|l| {
                let has = |f: &str| l.split_whitespace().any(|w| w == f);
                has("constant_tsc") && has("nonstop_tsc")
            })
        })
    })
}

#[cfg(target_arch = "x86_64")]
mod tsc {
    use super::{RESAMPLE_NS, wall_ns};
    use std::cell::Cell;

    /// One thread's samples: (tsc, wall ns) of its first and latest, and
    /// the rate in ns per tick (0: not known yet).
    #[derive(Clone, Copy)]
    struct Samples {
        first: (u64, u64),
        last: (u64, u64),
        ns_per_tick: f64,
        /// Ticks between samples, once the rate is known.
        every: u64,
    }

    thread_local! {
        static SAMPLES: Cell<Option<Samples>> = const { Cell::new(None) };
    }

    fn ticks() -> u64 {
        // SAFETY: RDTSC has no preconditions on x86_64.
        unsafe { core::arch::x86_64::_rdtsc() }
    }

    pub(super) fn now_ns() -> u64 {
        let t = ticks();
        SAMPLES.with(|c| {
            let s = match c.get() {
                None => {
                    let w = wall_ns();
                    c.set(Some(Samples {
                        first: (t, w),
                        last: (t, w),
                        ns_per_tick: 0.0,
                        every: 0,
                    }));
                    return w;
                }
                Some(s) => s,
            };
            let since = t.wrapping_sub(s.last.0);
            if s.ns_per_tick > 0.0 && t >= s.last.0 && since < s.every {
                return s.last.1 + (since as f64 * s.ns_per_tick) as u64;
            }
            // Sample the wall clock: the rate is unknown, due again, or the
            // TSC went backwards (another socket's, after a migration).
            let w = wall_ns();
            let mut n = Samples { last: (t, w), ..s };
            let (dt, dw) = (t.wrapping_sub(s.first.0), w.saturating_sub(s.first.1));
            if t < s.first.0 || w < s.first.1 {
                n.first = (t, w); // start over
                n.ns_per_tick = 0.0;
            } else if dw >= RESAMPLE_NS && dt > 0 {
                let rate = dw as f64 / dt as f64;
                if s.ns_per_tick > 0.0 && (rate / s.ns_per_tick - 1.0).abs() > 0.001 {
                    // The wall clock stepped: measure the rate afresh from here.
                    n.first = (t, w);
                    n.ns_per_tick = 0.0;
                } else {
                    n.ns_per_tick = rate;
                    n.every = (RESAMPLE_NS as f64 / rate) as u64;
                }
            }
            c.set(Some(n));
            w
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stamps follow the wall clock within a few microseconds, over more than
    /// one resampling period, and time between two stamps is right.
    #[test]
    fn stamps_follow_the_wall_clock() {
        let start = SystemTime::now();
        let mut worst = 0i128;
        while start.elapsed().unwrap_or_default() < Duration::from_millis(120) {
            let a = now();
            let w = SystemTime::now();
            let b = now();
            let ns = |t: SystemTime| t.duration_since(UNIX_EPOCH).unwrap().as_nanos() as i128;
            // `w` lies between `a` and `b` up to the stamps' error.
            let off = (ns(w) - ns(a)).min(ns(b) - ns(w));
            worst = worst.min(off);
            std::thread::sleep(Duration::from_micros(300));
        }
        assert!(
            worst > -50_000,
            "a stamp was {} us off the wall clock",
            -worst / 1000
        );
        let a = now();
        std::thread::sleep(Duration::from_millis(30));
        let d = now().duration_since(a).unwrap();
        assert!(
            d >= Duration::from_millis(29) && d < Duration::from_millis(80),
            "{d:?} for a 30 ms sleep"
        );
    }
}
