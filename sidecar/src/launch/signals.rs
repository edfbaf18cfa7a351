//! Catching SIGINT/SIGTERM/SIGHUP so the launcher can forward them to its ranks.
//!
//! The handler only bumps an atomic counter (async-signal-safe); the supervision
//! loop polls the counters every tick and does the actual forwarding. Ranks live
//! in their own process groups, so a terminal's Ctrl-C reaches only the launcher
//! and forwarding is what makes it reach them.
//!
//! The dispositions are process-wide: only one launch at a time should forward
//! signals. The previous handlers are restored when the guard is dropped.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The signals forwarded to ranks, in the order they are checked.
pub const FORWARDED: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

static COUNTS: [AtomicUsize; 3] = [
    AtomicUsize::new(0),
    AtomicUsize::new(0),
    AtomicUsize::new(0),
];

fn slot(sig: libc::c_int) -> Option<usize> {
    FORWARDED.iter().position(|&s| s == sig)
}

extern "C" fn on_signal(sig: libc::c_int) {
    if let Some(i) = slot(sig) {
        COUNTS[i].fetch_add(1, Ordering::SeqCst);
    }
}

/// Installed handlers; dropping it restores the previous ones.
pub struct SignalGuard {
    old: Vec<(libc::c_int, libc::sigaction)>,
}

impl SignalGuard {
    /// Installs the counting handler for every signal in [`FORWARDED`].
    pub fn install() -> io::Result<Self> {
        for c in &COUNTS {
            c.store(0, Ordering::SeqCst);
        }
        let mut guard = SignalGuard { old: Vec::new() };
        for sig in FORWARDED {
            // SAFETY: plain sigaction calls with zero-initialised structs; the
            // handler only touches atomics.
            unsafe {
                let mut new: libc::sigaction = std::mem::zeroed();
                new.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
                new.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut new.sa_mask);
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, &new, &mut old) != 0 {
                    return Err(io::Error::last_os_error());
                }
                guard.old.push((sig, old));
            }
        }
        Ok(guard)
    }

    /// Signals received since the last call, as `(signal, how many times)`.
    pub fn take(&self) -> Vec<(libc::c_int, usize)> {
        FORWARDED
            .iter()
            .zip(&COUNTS)
            .filter_map(|(&sig, c)| match c.swap(0, Ordering::SeqCst) {
                0 => None,
                n => Some((sig, n)),
            })
            .collect()
    }
}

impl Drop for SignalGuard {
    fn drop(&mut self) {
        for (sig, old) in &self.old {
            // SAFETY: restoring the action saved by `install`.
            unsafe {
                libc::sigaction(*sig, old, std::ptr::null_mut());
            }
        }
    }
}

/// `SIGTERM` -> `"SIGTERM"`, for messages.
pub fn signal_name(sig: libc::c_int) -> String {
    let name = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGUSR2 => "SIGUSR2",
        _ => return format!("signal {sig}"),
    };
    name.to_string()
}
