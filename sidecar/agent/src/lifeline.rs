//! The process's lifeline: a pipe whose write end this process keeps open
//! for its whole life (close-on-exec) and whose read end goes to the
//! sidecar with the telemetry segment. However the process ends, the
//! kernel closes the write end and the sidecar's copy of the read end hangs
//! up: how a sidecar that cannot see the process's pid (another pid
//! namespace: no `SO_PEERCRED` pid to watch) still learns that it is gone,
//! and how it tells a broken control stream from a dead process.
//!
//! A child forked without exec inherits the write end: until such children
//! exit too, the process counts as alive (the pid, where the sidecar sees
//! it, has no such blind spot and is preferred).

use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};

pub struct Lifeline {
    read: OwnedFd,
    _write: OwnedFd,
}

impl Lifeline {
    pub fn new() -> std::io::Result<Lifeline> {
        let mut fds = [0; 2];
        // SAFETY: pipe2 fills two descriptors we then own.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        Ok(Lifeline {
            read,
            _write: write,
        })
    }

    /// The end to pass to the sidecar.
    pub fn read_end(&self) -> BorrowedFd<'_> {
        self.read.as_fd()
    }
}
