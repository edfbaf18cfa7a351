//! Which ranks share a host. Two ranks may use shared memory only if they see
//! the same kernel, the same /dev/shm and the same network namespace; the host
//! identity hashes exactly those facts (or `WEFT_HOSTNAME`, to simulate hosts).

use sha2::{Digest, Sha256};

pub fn system_hostname() -> String {
    let mut buf = [0u8; 256];
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown-host".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

pub fn gettid() -> i64 {
    unsafe { libc::syscall(libc::SYS_gettid) }
}

/// A 64-bit identity of "this host" as far as shared memory is concerned.
pub fn host_id(hostname_override: Option<&str>) -> u64 {
    let mut h = Sha256::new();
    match hostname_override {
        Some(name) => {
            h.update(b"override:");
            h.update(name.as_bytes());
        }
        None => {
            h.update(system_hostname().as_bytes());
            for f in ["/proc/sys/kernel/random/boot_id"] {
                if let Ok(s) = std::fs::read_to_string(f) {
                    h.update(s.trim().as_bytes());
                }
            }
            // Different network namespaces are different "hosts" to us: it is how
            // the multi-host tests (ip netns) get real TCP between them.
            if let Ok(ns) = std::fs::read_link("/proc/self/ns/net") {
                h.update(ns.to_string_lossy().as_bytes());
            }
        }
    }
    u64::from_le_bytes(h.finalize()[..8].try_into().unwrap())
}

/// Whether a process of this host is alive (EPERM means alive but not ours).
pub fn pid_alive(pid: u32) -> bool {
    if pid == 0 {
        return false;
    }
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    let exists = rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
    // A killed process stays a zombie until its parent reaps it (a launcher
    // may poll only every few seconds): it has exited all the same.
    exists && !is_zombie(pid)
}

/// Whether `/proc/<pid>/stat` says the process has exited (Z or X) and
/// only waits to be reaped.
fn is_zombie(pid: u32) -> bool {
    proc_state(pid).is_some_and(|c| c == 'Z' || c == 'X')
}

/// Whether the process is stopped: by a signal (SIGSTOP, SIGTSTP: state T)
/// or under a debugger (t). Such a peer is alive but makes no progress.
pub fn pid_stopped(pid: u32) -> bool {
    pid != 0 && proc_state(pid).is_some_and(|c| c == 'T' || c == 't')
}

/// The state letter of `/proc/<pid>/stat` (None: no such process, or not
/// readable).
fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) S ...": comm may hold spaces and parentheses.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next())
}

pub fn online_cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

#[cfg(test)]
mod identity_tests {
    use super::host_id;

    /// How hosts are simulated on one machine (two halves of a job, each
    /// with its own WEFT_HOSTNAME): different names are different hosts,
    /// the same name is one host, and a name is not the machine itself.
    #[test]
    fn weft_hostname_names_a_host() {
        let (a, b) = (host_id(Some("sim-a")), host_id(Some("sim-b")));
        assert_ne!(a, b);
        assert_eq!(a, host_id(Some("sim-a")));
        assert_ne!(a, host_id(None));
        assert_eq!(host_id(None), host_id(None));
    }
}

#[cfg(test)]
mod liveness_tests {
    use super::pid_alive;

    /// A child that exited but was not reaped yet counts as gone.
    #[test]
    fn a_zombie_is_not_alive() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let t = std::time::Instant::now();
        while pid_alive(pid) {
            assert!(
                t.elapsed().as_secs() < 10,
                "pid {pid} still alive after 10 s"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // Not reaped until now.
        child.wait().unwrap();
        assert!(!pid_alive(pid));
        assert!(pid_alive(std::process::id()));
    }
}
