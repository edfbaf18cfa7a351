//! Whether an attached rank process still lives, independent of its control
//! stream (which can break while the process runs on): a pidfd of the pid
//! `SO_PEERCRED` named when it connected (readable once the process has
//! exited, a zombie included, and immune to pid reuse), or, when the pid is
//! not visible from this sidecar's pid namespace, the process's lifeline
//! (a pipe whose write end only the process holds: it hangs up when the
//! process ends). With neither, nothing is known: the stream's end is
//! taken for the process's end, as before.

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

pub enum Liveness {
    /// A pidfd: readable once the process has exited.
    Pid(u32, OwnedFd),
    /// The read end of the process's lifeline: hangs up when it has ended.
    Lifeline(OwnedFd),
    Unknown,
}

/// A pidfd of `pid`, if the kernel has them.
fn pidfd(pid: u32) -> Option<OwnedFd> {
    // SAFETY: the pidfd_open system call; a non-negative result is a new
    // descriptor we own.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_int, 0) };
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Whether `fd` is a pipe (a lifeline must be one).
fn is_pipe(fd: &OwnedFd) -> bool {
    // SAFETY: fstat into a zeroed struct we own.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    unsafe {
        libc::fstat(fd.as_raw_fd(), &mut st) == 0 && st.st_mode & libc::S_IFMT == libc::S_IFIFO
    }
}

impl Liveness {
    /// From what the connection told us: its pid (`SO_PEERCRED`, when
    /// visible) and the lifeline it passed. A lifeline that is not a pipe
    /// is an error.
    pub fn new(pid: Option<u32>, lifeline: Option<OwnedFd>) -> Result<Liveness, String> {
        if let Some(l) = &lifeline
            && !is_pipe(l)
        {
            return Err("the lifeline passed is not a pipe".into());
        }
        if let Some(fd) = pid.and_then(pidfd) {
            return Ok(Liveness::Pid(pid.unwrap_or_default(), fd));
        }
        Ok(lifeline.map_or(Liveness::Unknown, Liveness::Lifeline))
    }

    /// Whether anything is known at all.
    pub fn known(&self) -> bool {
        !matches!(self, Liveness::Unknown)
    }

    fn fd(&self) -> Option<&OwnedFd> {
        match self {
            Liveness::Pid(_, fd) | Liveness::Lifeline(fd) => Some(fd),
            Liveness::Unknown => None,
        }
    }

    /// The process has ended (checked now, without waiting).
    pub fn ended(&self) -> bool {
        let Some(fd) = self.fd() else {
            return false;
        };
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll of one descriptor we own, no wait.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n > 0 && p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
    }

    /// Resolves when the process has ended (never when nothing is known).
    pub async fn wait_ended(&self) {
        let Some(fd) = self.fd() else {
            return std::future::pending().await;
        };
        let Ok(dup) = fd.as_fd().try_clone_to_owned() else {
            return std::future::pending().await;
        };
        // SAFETY: `dup` is a descriptor the AsyncFd owns from here on.
        let Ok(a) = (unsafe { AsyncFd::register_with_interest(dup, Interest::READABLE) }) else {
            return std::future::pending().await;
        };
        loop {
            match a.readable().await {
                Ok(mut g) => {
                    if self.ended() {
                        return;
                    }
                    g.clear_ready();
                }
                Err(_) => return std::future::pending().await,
            }
        }
    }

    /// How it is watched, for messages.
    pub fn describe(&self) -> String {
        match self {
            Liveness::Pid(p, _) => format!("pid {p}"),
            Liveness::Lifeline(_) => "its lifeline".into(),
            Liveness::Unknown => "nothing".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A child's pidfd and lifeline both say it ended once it exits
    /// (a zombie counts: it is not reaped until after the checks).
    #[test]
    fn a_childs_end_is_seen_through_its_pid_and_its_lifeline() {
        let mut child = std::process::Command::new("sleep")
            .arg("0.3")
            .spawn()
            .unwrap();
        // After the spawn: a vforked child holds our descriptors until its
        // exec has closed them, which can be after spawn returns.
        let l = weft_agent::lifeline::Lifeline::new().unwrap();
        let read = l.read_end().try_clone_to_owned().unwrap();
        let by_pid = Liveness::new(Some(child.id()), None).unwrap();
        assert!(matches!(by_pid, Liveness::Pid(..)));
        let by_pipe = Liveness::new(None, Some(read)).unwrap();
        assert!(!by_pid.ended() && !by_pipe.ended());
        drop(l); // our process holds the only write end: "ends" now
        assert!(by_pipe.ended());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(10), by_pid.wait_ended())
                .await
                .expect("the child's exit is seen");
        });
        assert!(by_pid.ended(), "a zombie has ended");
        child.wait().unwrap();
        assert!(!Liveness::Unknown.ended());
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        assert!(Liveness::new(None, Some(OwnedFd::from(a))).is_err());
    }
}
