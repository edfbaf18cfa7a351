//! Which CPUs a thread runs on: the cores the kernel lists as local to a
//! PCI device (a GPU's NUMA node); a placement that threads started under
//! it take up first thing ([`placing`], [`placed`]); and a guard that
//! keeps the calling thread on a set while it pins host memory (pages come
//! from its node), then puts its old mask back ([`run_on`]).
//!
//! Why: the cross-host path's progress thread, engine and socket threads
//! read and write pinned buffers the GPU copies over PCIe; on a machine of
//! several NUMA nodes, threads and pages on the far node pay the link
//! between the sockets on every byte, and where the scheduler puts them
//! changes from run to run. NCCL binds its proxy threads the same way
//! (the job's mask intersected with the GPU's cores). Only the threads
//! that start through [`placed`] move: the caller's own thread keeps its
//! mask, and so do threads something else starts meanwhile (the
//! process-wide listener, say).

use std::cell::Cell;
use std::fmt;

/// A set of CPUs (Linux's `cpu_set_t`: CPUs 0 to 1023).
#[derive(Clone, Copy)]
pub(crate) struct CpuSet(libc::cpu_set_t);

impl PartialEq for CpuSet {
    fn eq(&self, other: &CpuSet) -> bool {
        // SAFETY: compares the two sets' own bits.
        unsafe { libc::CPU_EQUAL(&self.0, &other.0) }
    }
}

impl fmt::Debug for CpuSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.list())
    }
}

/// The largest CPU number a set holds, plus one.
const MAX_CPUS: usize = libc::CPU_SETSIZE as usize;

impl CpuSet {
    fn empty() -> CpuSet {
        // SAFETY: cpu_set_t is a plain bit array; all zeroes is the empty set.
        CpuSet(unsafe { std::mem::zeroed() })
    }

    /// Callers keep `cpu` under [`MAX_CPUS`].
    fn insert(&mut self, cpu: usize) {
        debug_assert!(cpu < MAX_CPUS);
        // SAFETY: a write of the set's own bits; libc checks `cpu` against
        // the set's size.
        unsafe { libc::CPU_SET(cpu, &mut self.0) }
    }

    fn contains(&self, cpu: usize) -> bool {
        // SAFETY: a read of the set's own bits; libc checks `cpu` against
        // the set's size.
        unsafe { libc::CPU_ISSET(cpu, &self.0) }
    }

    /// The CPUs in the set, in order.
    pub fn cpus(&self) -> Vec<usize> {
        (0..MAX_CPUS).filter(|&c| self.contains(c)).collect()
    }

    /// The kernel's list format (`0-15,32-47`), as `local_cpulist` and
    /// `taskset -c` spell it; None for anything else (a CPU beyond the
    /// set's size, a reversed range, stray text).
    pub fn parse_list(s: &str) -> Option<CpuSet> {
        let mut set = CpuSet::empty();
        for part in s.trim().split(',').filter(|p| !p.is_empty()) {
            let (lo, hi) = match part.split_once('-') {
                Some((a, b)) => (a.trim().parse().ok()?, b.trim().parse().ok()?),
                None => {
                    let c: usize = part.trim().parse().ok()?;
                    (c, c)
                }
            };
            if lo > hi || hi >= MAX_CPUS {
                return None;
            }
            (lo..=hi).for_each(|c| set.insert(c));
        }
        Some(set)
    }

    /// The list format again (for logs).
    pub fn list(&self) -> String {
        let mut out: Vec<String> = Vec::new();
        let cpus = self.cpus();
        let mut i = 0;
        while i < cpus.len() {
            let mut j = i;
            while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
                j += 1;
            }
            out.push(match i == j {
                true => cpus[i].to_string(),
                false => format!("{}-{}", cpus[i], cpus[j]),
            });
            i = j + 1;
        }
        out.join(",")
    }

    /// The CPUs of both.
    pub fn and(&self, other: &CpuSet) -> CpuSet {
        let mut set = CpuSet::empty();
        (0..MAX_CPUS)
            .filter(|&c| self.contains(c) && other.contains(c))
            .for_each(|c| set.insert(c));
        set
    }

    pub fn is_empty(&self) -> bool {
        // SAFETY: counts the set's own bits.
        unsafe { libc::CPU_COUNT(&self.0) == 0 }
    }

    /// The calling thread's mask; None where the kernel does not say.
    pub fn of_this_thread() -> Option<CpuSet> {
        let mut set = CpuSet::empty();
        // SAFETY: the size is the set's own; the kernel writes within it.
        let rc = unsafe {
            libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set.0)
        };
        (rc == 0).then_some(set)
    }

    /// Moves the calling thread onto this set; false where the kernel
    /// refused (an empty set, CPUs outside the container's cgroup).
    fn apply_to_this_thread(&self) -> bool {
        // SAFETY: as above; the kernel only reads the set.
        unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &self.0) == 0 }
    }
}

/// The CPUs the kernel lists as local to the PCI function at `(domain,
/// bus, device)`, function 0 (`/sys/bus/pci/devices/*/local_cpulist`); None
/// where sysfs does not say (no such device, a container without `/sys`).
pub(crate) fn near_pci([domain, bus, device]: [i32; 3]) -> Option<CpuSet> {
    let path = format!("/sys/bus/pci/devices/{domain:04x}:{bus:02x}:{device:02x}.0/local_cpulist");
    CpuSet::parse_list(&std::fs::read_to_string(path).ok()?)
}

/// `cpus` within the calling thread's mask, where that narrows it: None
/// where the two share no CPU (the job pinned the process elsewhere: its
/// choice wins), where the thread already runs on those CPUs alone, or
/// where the kernel does not say.
pub(crate) fn narrowing(cpus: &CpuSet) -> Option<CpuSet> {
    narrowed(&CpuSet::of_this_thread()?, cpus)
}

/// `cpus` within `mask`, where that is a smaller, non-empty set.
fn narrowed(mask: &CpuSet, cpus: &CpuSet) -> Option<CpuSet> {
    let now = mask.and(cpus);
    (!now.is_empty() && now != *mask).then_some(now)
}

thread_local! {
    /// Where threads started from this thread through [`placed`] go
    /// (see [`placing`]); None: where their mask lets them.
    static PLACE: Cell<Option<CpuSet>> = const { Cell::new(None) };
}

/// Runs `f` with `cpus` as this thread's placement: threads started inside
/// through [`placed`] move onto them (within their own mask) before they do
/// anything else; this thread stays where it is. Placements nest; the
/// old one comes back when `f` returns or unwinds.
pub(crate) fn placing<R>(cpus: Option<CpuSet>, f: impl FnOnce() -> R) -> R {
    struct Back(Option<CpuSet>);
    impl Drop for Back {
        fn drop(&mut self) {
            PLACE.set(self.0);
        }
    }
    let _back = Back(PLACE.replace(cpus));
    f()
}

/// The body `f` of a new thread, moved first onto the placement of the
/// thread that calls this (if any): `spawn(placed(move || ...))`.
pub(crate) fn placed<R>(f: impl FnOnce() -> R) -> impl FnOnce() -> R {
    let cpus = PLACE.get();
    move || {
        if let Some(now) = cpus.as_ref().and_then(narrowing) {
            now.apply_to_this_thread();
        }
        f()
    }
}

/// While alive, the calling thread runs on the CPUs it was given (within
/// its own mask); dropped, it runs on the mask it had before.
#[must_use = "the old mask comes back when the guard is dropped"]
pub(crate) struct OnCpus {
    before: CpuSet,
    /// Told when the old mask could not be put back (the caller's layer
    /// logs; this one stays below the logger).
    unrestored: fn(&CpuSet, std::io::Error),
}

/// Moves the calling thread onto `cpus` within its own mask, until the
/// guard is dropped; None, and nothing changed, where that would not
/// narrow its mask (see [`narrowing`]) or the kernel refused. Should the
/// old mask not come back at the drop, `unrestored` hears it and why.
pub(crate) fn run_on(cpus: &CpuSet, unrestored: fn(&CpuSet, std::io::Error)) -> Option<OnCpus> {
    let before = CpuSet::of_this_thread()?;
    let now = narrowed(&before, cpus)?;
    now.apply_to_this_thread()
        .then_some(OnCpus { before, unrestored })
}

impl Drop for OnCpus {
    fn drop(&mut self) {
        if !self.before.apply_to_this_thread() {
            (self.unrestored)(&self.before, std::io::Error::last_os_error());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_list_format_round_trips_and_bad_lists_are_refused() {
        let s = CpuSet::parse_list("0-3,8,10-11\n").unwrap();
        assert_eq!(s.cpus(), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(s.list(), "0-3,8,10-11");
        assert!(CpuSet::parse_list("").unwrap().is_empty());
        for bad in ["3-1", "x", "0-", "5000", "1,,a"] {
            assert!(CpuSet::parse_list(bad).is_none(), "{bad:?} was accepted");
        }
        let other = CpuSet::parse_list("2-9").unwrap();
        assert_eq!(s.and(&other).list(), "2-3,8");
    }

    /// This thread's mask, and its first CPU alone.
    fn mask_and_its_first_cpu() -> (CpuSet, CpuSet) {
        let before = CpuSet::of_this_thread().expect("sched_getaffinity");
        let first = *before.cpus().first().expect("some CPU");
        (before, CpuSet::parse_list(&first.to_string()).unwrap())
    }

    /// The guard moves the thread and puts the old mask back, and a set
    /// outside the thread's mask changes nothing.
    #[test]
    fn the_guard_moves_this_thread_then_restores() {
        // On a thread of its own: the test harness's threads keep theirs.
        std::thread::spawn(|| {
            let (before, one) = mask_and_its_first_cpu();
            let moved = before.cpus().len() > 1;
            {
                let guard = run_on(&one, |before, why| {
                    panic!("the mask {before:?} did not come back: {why}")
                });
                assert_eq!(guard.is_some(), moved);
                if moved {
                    assert_eq!(CpuSet::of_this_thread().unwrap(), one);
                }
            }
            assert_eq!(CpuSet::of_this_thread().unwrap(), before);
            let outside = CpuSet::parse_list(&(MAX_CPUS - 1).to_string()).unwrap();
            if !before.contains(MAX_CPUS - 1) {
                assert!(run_on(&outside, |_, _| unreachable!("nothing was moved")).is_none());
                assert!(narrowing(&outside).is_none());
                assert_eq!(CpuSet::of_this_thread().unwrap(), before);
            }
        })
        .join()
        .unwrap();
    }

    /// Under a placement, a thread started through `placed` moves onto it
    /// and one started plainly does not; the placing thread itself never
    /// moves, and the placement ends with its scope.
    #[test]
    fn threads_started_through_placed_take_the_placement_up_and_others_do_not() {
        std::thread::spawn(|| {
            let (before, one) = mask_and_its_first_cpu();
            let start = |f: fn() -> Option<CpuSet>, through_placed: bool| match through_placed {
                true => std::thread::spawn(placed(f)).join().unwrap().unwrap(),
                false => std::thread::spawn(f).join().unwrap().unwrap(),
            };
            let (inside, plain) = placing(Some(one), || {
                assert_eq!(
                    CpuSet::of_this_thread().unwrap(),
                    before,
                    "the placing thread moved"
                );
                (
                    start(CpuSet::of_this_thread, true),
                    start(CpuSet::of_this_thread, false),
                )
            });
            let want = if before.cpus().len() > 1 { one } else { before };
            assert_eq!(inside, want, "a thread started through placed");
            assert_eq!(plain, before, "a thread started plainly");
            assert_eq!(
                start(CpuSet::of_this_thread, true),
                before,
                "after the placement"
            );
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_device_sysfs_does_not_list_is_none() {
        assert!(near_pci([0xffff, 0xff, 0x1f]).is_none());
    }
}
