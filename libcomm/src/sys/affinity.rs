//! Which CPUs a thread runs on: the cores the kernel lists as local to a
//! PCI device (a GPU's NUMA node), and a guard that keeps the calling
//! thread on them while it starts threads (which inherit its mask) and
//! pins host memory (placed on its node), then puts the old mask back.
//!
//! Why: the cross-host path's progress thread, engine and socket threads
//! read and write pinned buffers the GPU copies over PCIe; on a machine of
//! several NUMA nodes, threads and pages on the far node pay the link
//! between the sockets on every byte, and where the scheduler puts them
//! changes from run to run. NCCL binds its proxy threads the same way
//! (the job's mask intersected with the GPU's cores).

use std::fmt;

/// A set of CPUs (Linux's `cpu_set_t`: CPUs 0 to 1023).
#[derive(Clone, Copy)]
pub(crate) struct CpuSet(libc::cpu_set_t);

impl PartialEq for CpuSet {
    fn eq(&self, other: &CpuSet) -> bool {
        self.cpus() == other.cpus()
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

/// While alive, the calling thread runs on the CPUs it was given (within
/// its own mask); dropped, it runs on the mask it had before.
#[must_use = "the old mask comes back when the guard is dropped"]
pub(crate) struct OnCpus {
    before: CpuSet,
    /// The mask the thread has while the guard lives.
    pub now: CpuSet,
}

/// Moves the calling thread onto `cpus` within its own mask, until the
/// guard is dropped. None, and nothing changed, where the two share no CPU
/// (the job pinned the process elsewhere: its choice wins), where the
/// thread already runs on those CPUs alone, or where the kernel refused.
pub(crate) fn run_on(cpus: &CpuSet) -> Option<OnCpus> {
    let before = CpuSet::of_this_thread()?;
    let now = before.and(cpus);
    if now.is_empty() || now == before || !now.apply_to_this_thread() {
        return None;
    }
    Some(OnCpus { before, now })
}

impl Drop for OnCpus {
    fn drop(&mut self) {
        self.before.apply_to_this_thread();
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

    /// The guard moves the thread and puts the old mask back, threads
    /// started under it inherit the new mask, and a set outside the
    /// thread's mask changes nothing.
    #[test]
    fn the_guard_moves_this_thread_and_threads_it_starts_then_restores() {
        // On a thread of its own: the test harness's threads keep theirs.
        std::thread::spawn(|| {
            let before = CpuSet::of_this_thread().expect("sched_getaffinity");
            let first = *before.cpus().first().expect("some CPU");
            let one = CpuSet::parse_list(&first.to_string()).unwrap();
            let moved = before.cpus().len() > 1;
            {
                let guard = run_on(&one);
                assert_eq!(guard.is_some(), moved);
                if moved {
                    assert_eq!(CpuSet::of_this_thread().unwrap(), one);
                    let child = std::thread::spawn(CpuSet::of_this_thread).join().unwrap();
                    assert_eq!(child.unwrap(), one, "a thread started under the guard");
                }
            }
            assert_eq!(CpuSet::of_this_thread().unwrap(), before);
            let outside = CpuSet::parse_list(&(MAX_CPUS - 1).to_string()).unwrap();
            if !before.contains(MAX_CPUS - 1) {
                assert!(run_on(&outside).is_none());
                assert_eq!(CpuSet::of_this_thread().unwrap(), before);
            }
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_device_sysfs_does_not_list_is_none() {
        assert!(near_pci([0xffff, 0xff, 0x1f]).is_none());
    }
}
