//! Whole reads and writes on a non-blocking socket that give up when their
//! comm is stopped: poll(2) in slices of [`SLICE_MS`], checking the stop flag
//! between them (closing a comm also shuts its sockets down, which wakes a
//! poll at once). Writes never raise SIGPIPE (`MSG_NOSIGNAL`): a peer that
//! went away is an error.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};

/// Longest poll(2) between checks of the stop flag.
const SLICE_MS: i32 = 100;

/// Why a read or write ended early.
#[derive(Debug, PartialEq, Eq)]
pub enum IoEnd {
    /// The comm was stopped.
    Stopped,
    /// The peer closed the connection (EOF), after `got` bytes of this read.
    Eof { got: usize },
    /// A socket error (reset, `TCP_USER_TIMEOUT`, keepalive...).
    Failed(String),
}

fn wait(fd: RawFd, events: i16, stop: &AtomicBool) -> Result<(), IoEnd> {
    loop {
        if stop.load(Ordering::Acquire) {
            return Err(IoEnd::Stopped);
        }
        let mut p = libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        let rc = unsafe { libc::poll(&mut p, 1, SLICE_MS) };
        if rc > 0 {
            return Ok(());
        }
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(IoEnd::Failed(format!("poll: {e}")));
            }
        }
    }
}

/// Writes every byte of `parts`, in order, as one stream (a header and its
/// payload leave in one system call when they fit).
pub fn write_all(fd: RawFd, parts: [&[u8]; 2], stop: &AtomicBool) -> Result<(), IoEnd> {
    let mut skip = 0usize;
    let total = parts[0].len() + parts[1].len();
    while skip < total {
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; 2];
        let mut n = 0;
        let mut at = skip;
        for p in parts {
            if at >= p.len() {
                at -= p.len();
                continue;
            }
            iov[n] = libc::iovec {
                iov_base: p[at..].as_ptr() as *mut libc::c_void,
                iov_len: p.len() - at,
            };
            at = 0;
            n += 1;
        }
        // SAFETY: all-zero is a valid msghdr (no name, no control data).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = n as _;
        let rc = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL) };
        if rc >= 0 {
            skip += rc as usize;
            continue;
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::WouldBlock => wait(fd, libc::POLLOUT, stop)?,
            std::io::ErrorKind::Interrupted => {}
            _ => return Err(IoEnd::Failed(e.to_string())),
        }
    }
    Ok(())
}

/// Reads exactly `len` bytes into `buf`.
///
/// # Safety
/// `buf..buf + len` must be valid for writes.
pub unsafe fn read_exact(
    fd: RawFd,
    buf: *mut u8,
    len: usize,
    stop: &AtomicBool,
) -> Result<(), IoEnd> {
    let mut got = 0;
    while got < len {
        let rc = unsafe { libc::recv(fd, buf.add(got).cast(), len - got, 0) };
        if rc > 0 {
            got += rc as usize;
            continue;
        }
        if rc == 0 {
            return Err(IoEnd::Eof { got });
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::WouldBlock => wait(fd, libc::POLLIN, stop)?,
            std::io::ErrorKind::Interrupted => {}
            _ => return Err(IoEnd::Failed(e.to_string())),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let b = l.accept().unwrap().0;
        a.set_nonblocking(true).unwrap();
        b.set_nonblocking(true).unwrap();
        (a, b)
    }

    #[test]
    fn parts_arrive_whole_and_in_order_and_eof_and_stop_end_a_read() {
        let (a, b) = pair();
        let stop = AtomicBool::new(false);
        let big: Vec<u8> = (0..3 << 20).map(|i| (i * 7) as u8).collect();
        let (fa, fb) = (a.as_raw_fd(), b.as_raw_fd());
        std::thread::scope(|s| {
            s.spawn(|| write_all(fa, [b"head", &big], &stop).unwrap());
            let mut got = vec![0u8; 4 + big.len()];
            unsafe { read_exact(fb, got.as_mut_ptr(), got.len(), &stop).unwrap() };
            assert_eq!(&got[..4], b"head");
            assert!(got[4..] == big[..]);
        });
        drop(a);
        let mut one = [0u8; 8];
        let e = unsafe { read_exact(fb, one.as_mut_ptr(), 8, &stop) }.unwrap_err();
        assert_eq!(e, IoEnd::Eof { got: 0 });
        // A stopped comm's read returns within a slice.
        let (_a, b) = pair();
        stop.store(true, Ordering::Release);
        let t = std::time::Instant::now();
        let e = unsafe { read_exact(b.as_raw_fd(), one.as_mut_ptr(), 8, &stop) }.unwrap_err();
        assert_eq!(e, IoEnd::Stopped);
        assert!(t.elapsed() < std::time::Duration::from_secs(1));
    }
}
