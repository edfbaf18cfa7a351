//! Starting one rank and controlling its process group.
//!
//! Each rank is the leader of its own process group (`setpgid(0, 0)`), so a
//! signal sent to `-pgid` reaches the whole tree a rank started (a shell and
//! its children, a Python process and its data-loader workers). Each rank also
//! gets `PR_SET_PDEATHSIG(SIGKILL)`: if the launcher dies without cleaning up
//! (even by SIGKILL), the kernel kills the ranks, so nothing is orphaned.

use std::ffi::OsString;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, ExitStatus, Stdio};

/// A started rank: its pid (= its process-group id) and its output pipes.
pub struct Spawned {
    pub pid: libc::pid_t,
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
}

/// Starts `program args` with `env` added to the inherited environment.
///
/// Note: the kernel delivers PDEATHSIG when the *thread* that forked exits, so
/// the caller's thread must outlive the rank (`launch` spawns and supervises
/// on the same thread).
pub fn spawn_rank(
    program: &OsString,
    args: &[OsString],
    env: &[(String, String)],
) -> io::Result<Spawned> {
    let parent = std::process::id() as libc::pid_t;
    let mut cmd = Command::new(program);
    cmd.args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        // Ranks are not in the terminal's foreground group: reading the tty
        // would stop them with SIGTTIN, so give them no stdin at all.
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    // SAFETY: only async-signal-safe calls (prctl, getppid, kill) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            // The launcher may have died before prctl took effect: then we were
            // already reparented and no death signal will ever come.
            if libc::getppid() != parent {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn()?;
    let pid = child.id() as libc::pid_t;
    let stdout = child.stdout.take().expect("piped stdout").into();
    let stderr = child.stderr.take().expect("piped stderr").into();
    // `child` is dropped without waiting: the supervisor reaps it by pid.
    Ok(Spawned {
        pid,
        stdout,
        stderr,
    })
}

/// Sends `sig` to the process group `pgid`; a group that is already gone is fine.
pub fn signal_group(pgid: libc::pid_t, sig: libc::c_int) {
    // SAFETY: kill(2) with a negative pid targets a process group.
    unsafe {
        libc::kill(-pgid, sig);
    }
}

/// Whether `pid` has exited, without reaping it.
///
/// WNOWAIT leaves the zombie in place, which keeps its pid -- and so its
/// process-group id -- from being reused until [`reap`]: the supervisor can
/// then SIGKILL the rank's group with no risk of hitting an unrelated process.
pub fn has_exited(pid: libc::pid_t) -> bool {
    // SAFETY: waitid on our own child with a zeroed siginfo out-parameter.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let rc = libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        );
        if rc != 0 {
            // ECHILD: already reaped by someone else (SIGCHLD ignored); treat as gone.
            return io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD);
        }
        info.si_pid() != 0
    }
}

/// Reaps `pid` (blocking, but only called once it has exited) and returns its status.
pub fn reap(pid: libc::pid_t) -> ExitStatus {
    let mut status = 0;
    loop {
        // SAFETY: waitpid on our own child.
        let rc = unsafe { libc::waitpid(pid, &mut status, 0) };
        if rc == pid {
            return ExitStatus::from_raw(status);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            // Status lost (reaped elsewhere): report a generic failure, never success.
            return ExitStatus::from_raw(255 << 8);
        }
    }
}

/// The shell convention: the exit code, or 128 + signal number.
pub fn exit_code_of(status: &ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(sig)) => 128 + sig,
        (None, None) => 255,
    }
}

/// `"exited with code 3"` / `"was killed by signal 9 (SIGKILL)"`.
pub fn describe(status: &ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(sig)) => format!(
            "was killed by signal {sig} ({})",
            super::signals::signal_name(sig)
        ),
        (None, None) => format!("ended with status {status}"),
    }
}

/// Makes this process the reaper of its orphaned descendants
/// (`PR_SET_CHILD_SUBREAPER`), returning the previous setting.
///
/// A rank's process that leaves its process group (`setsid`, daemonising)
/// escapes the group kill; as subreaper the launcher inherits it when its
/// parent dies, and [`kill_orphans`] can then find and end it.
/// Process-wide: for a launcher process, not for a library caller.
pub fn become_subreaper() -> io::Result<bool> {
    let mut old: libc::c_int = 0;
    // SAFETY: prctl with an out-pointer to a c_int, then a plain set.
    unsafe {
        if libc::prctl(
            libc::PR_GET_CHILD_SUBREAPER,
            &mut old as *mut libc::c_int,
            0,
            0,
            0,
        ) != 0
            || libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0) != 0
        {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(old != 0)
}

/// Restores the subreaper setting saved by [`become_subreaper`].
pub fn set_subreaper(on: bool) {
    // SAFETY: plain prctl set.
    unsafe {
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, on as libc::c_ulong, 0, 0, 0);
    }
}

/// Our current children, from `/proc/self/task/*/children` (orphans adopted
/// by a subreaper become children of one of its threads).
fn children() -> Vec<libc::pid_t> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|s| {
            s.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// SIGKILLs and reaps every remaining child (and, as they are adopted in
/// turn, their descendants). Only for a subreaper whose ranks are all reaped:
/// any child left then is a rank's escaped descendant. Returns how many live
/// processes it killed (zombies are just reaped).
pub fn kill_orphans() -> usize {
    let mut killed = 0;
    // Bounded: each round kills a generation; deeper trees are adopted next round.
    for _ in 0..100 {
        let kids = children();
        if kids.is_empty() {
            break;
        }
        for pid in kids {
            if !has_exited(pid) {
                // SAFETY: our own child (a zombie or live process keeps its pid reserved).
                unsafe { libc::kill(pid, libc::SIGKILL) };
                killed += 1;
            }
            reap(pid);
        }
    }
    killed
}
