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
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

pub fn online_cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}
