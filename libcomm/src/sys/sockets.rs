//! Socket options, set in one place: every TCP data connection (libcomm's
//! direct transport, the sidecar's proxy connections between hosts), every
//! listen backlog and every owner-only Unix socket goes through here, so a
//! change of policy (buffer sizes, keepalive, user timeout) is one edit.

use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::time::Duration;

/// Socket buffer size of data connections (each direction).
pub const DATA_BUFFER: i32 = 4 << 20;

/// `setsockopt` of an `int` option.
pub fn set_int(fd: RawFd, level: i32, opt: i32, v: i32) -> io::Result<()> {
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            opt,
            (&v as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Bounds blocking reads on a raw socket (`SO_RCVTIMEO`; zero: no bound).
pub fn set_read_timeout(fd: RawFd, t: Duration) {
    let tv = libc::timeval {
        tv_sec: t.as_secs() as libc::time_t,
        tv_usec: t.subsec_micros() as libc::suseconds_t,
    };
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        );
    }
}

fn millis(t: Duration) -> i32 {
    t.as_millis().min(i32::MAX as u128) as i32
}

/// How an established data connection is tuned.
#[derive(Debug, Clone, Copy, Default)]
pub struct DataOpts {
    /// TCP keepalive so that a vanished host is noticed within this
    /// (idle and interval a third of it, at least 1 s; two probes).
    pub keepalive: Option<Duration>,
    /// `TCP_USER_TIMEOUT`: unacknowledged data fails the connection after this.
    pub user_timeout: Option<Duration>,
    /// Send and receive buffer sizes.
    pub buffers: Option<i32>,
    /// Leave the socket non-blocking.
    pub nonblocking: bool,
}

impl DataOpts {
    /// A connection between hosts whose loss must be noticed within `peer_timeout`.
    pub fn between_hosts(peer_timeout: Duration) -> DataOpts {
        DataOpts {
            keepalive: Some(peer_timeout),
            user_timeout: Some(peer_timeout),
            buffers: Some(DATA_BUFFER),
            nonblocking: true,
        }
    }
}

/// Tunes an established data connection: no Nagle, then the options of `o`.
/// Only switching to non-blocking can fail the call (the others are best
/// effort: a kernel without one of them still carries the data).
pub fn tune_data(s: &TcpStream, o: &DataOpts) -> io::Result<()> {
    let _ = s.set_nodelay(true);
    let fd = s.as_raw_fd();
    if let Some(t) = o.keepalive {
        let secs = (t.as_secs() as i32 / 3).max(1);
        let _ = set_int(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1);
        let _ = set_int(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, secs);
        let _ = set_int(fd, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, secs);
        let _ = set_int(fd, libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 2);
    }
    if let Some(t) = o.user_timeout {
        let _ = set_int(fd, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, millis(t));
    }
    if let Some(b) = o.buffers {
        for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
            let _ = set_int(fd, libc::SOL_SOCKET, opt, b);
        }
    }
    if o.nonblocking {
        s.set_nonblocking(true)?;
    }
    Ok(())
}

/// Sets the listen backlog (std's default is 128, clamped to 128..=65535): a
/// job-sized backlog lets every rank of a large job connect at once without
/// ECONNREFUSED/EAGAIN.
pub fn set_backlog(l: &impl AsRawFd, backlog: usize) {
    let b = backlog.clamp(128, 65535) as i32;
    unsafe { libc::listen(l.as_raw_fd(), b) };
}

/// Waits until `fd` is readable (or closed) for at most `t`: `Ok(false)` when
/// the time ran out.
pub fn wait_readable(fd: RawFd, t: Duration) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    match unsafe { libc::poll(&mut p, 1, millis(t)) } {
        0 => Ok(false),
        n if n > 0 => Ok(true),
        _ => Err(io::Error::last_os_error()),
    }
}

/// Binds a Unix socket at `path` with mode 0600, replacing a stale one (umask
/// while binding, so there is no window in which the socket is more open).
pub fn bind_unix_owner_only(path: &Path) -> io::Result<UnixListener> {
    if path.exists() {
        std::fs::remove_file(path)?;
    }
    let old = unsafe { libc::umask(0o177) };
    let l = UnixListener::bind(path);
    unsafe { libc::umask(old) };
    let l = l?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn get_int(fd: RawFd, level: i32, opt: i32) -> i32 {
        let mut v = 0i32;
        let mut n = std::mem::size_of::<i32>() as libc::socklen_t;
        let rc = unsafe { libc::getsockopt(fd, level, opt, (&mut v as *mut i32).cast(), &mut n) };
        assert_eq!(rc, 0);
        v
    }

    #[test]
    fn data_connection_options_are_set() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        set_backlog(&l, 4096);
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        tune_data(&c, &DataOpts::between_hosts(Duration::from_secs(9))).unwrap();
        let fd = c.as_raw_fd();
        assert!(c.nodelay().unwrap());
        assert_eq!(get_int(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 1);
        assert_eq!(get_int(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), 3);
        assert_eq!(get_int(fd, libc::IPPROTO_TCP, libc::TCP_KEEPCNT), 2);
        assert_eq!(get_int(fd, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT), 9000);
        let mut b = [0u8; 1];
        use std::io::Read;
        let e = (&c).read(&mut b).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock, "non-blocking");
        assert!(!wait_readable(fd, Duration::from_millis(10)).unwrap());
    }

    #[test]
    fn unix_socket_is_owner_only_and_replaces_a_stale_one() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("weft-sockets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("s");
        std::fs::write(&p, b"stale").unwrap();
        let l = bind_unix_owner_only(&p).unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        drop(l);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
