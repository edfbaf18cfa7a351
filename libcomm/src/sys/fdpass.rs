//! Descriptors over Unix sockets (SCM_RIGHTS): the one place that builds and
//! parses the control messages, for the shared-memory offers
//! (`transport/shm.rs`) and the rank <-> sidecar proxy link (`transport/sidecar_link.rs`).

use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// Descriptors one message may carry (the control buffer's size).
pub const MAX_FDS: usize = 8;

/// `sendmsg(2)` of `bufs` (in order) with `fds` attached, MSG_NOSIGNAL,
/// retried on EINTR. Returns the bytes sent (possibly fewer than given: the
/// descriptors went with the first byte).
pub fn send(sock: RawFd, bufs: &[&[u8]], fds: &[RawFd]) -> std::io::Result<usize> {
    assert!(
        fds.len() <= MAX_FDS,
        "at most {MAX_FDS} descriptors per message"
    );
    let iov: Vec<libc::iovec> = bufs
        .iter()
        .map(|b| libc::iovec {
            iov_base: b.as_ptr() as *mut _,
            iov_len: b.len(),
        })
        .collect();
    let mut cbuf = [0u64; 8]; // CMSG_SPACE(MAX_FDS fds), aligned
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut _;
    msg.msg_iovlen = iov.len() as _;
    if !fds.is_empty() {
        let bytes = std::mem::size_of_val(fds) as u32;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = unsafe { libc::CMSG_SPACE(bytes) } as _;
        // SAFETY: the buffer holds CMSG_SPACE(bytes) (<= 64 bytes for 8 fds).
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(bytes) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast(), fds.len());
        }
    }
    loop {
        let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// What one `recvmsg(2)` brought.
pub struct Received {
    /// Bytes read into the buffer (0: the other side closed).
    pub len: usize,
    /// Every descriptor that came, owned (none leaks on an error later).
    pub fds: Vec<OwnedFd>,
    /// The control data was cut short: descriptors were lost.
    pub truncated: bool,
}

/// `recvmsg(2)` into `buf` (blocking; bound it with SO_RCVTIMEO), close-on-
/// exec descriptors, retried on EINTR.
pub fn recv(sock: RawFd, buf: &mut [u8]) -> std::io::Result<Received> {
    let iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; 8];
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &iov as *const _ as *mut _;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
    let n = loop {
        let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `cbuf` and set msg_controllen; each
    // SCM_RIGHTS payload is an array of descriptors now ours.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const RawFd;
                let bytes = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok(Received {
        len: n,
        fds,
        truncated: msg.msg_flags & libc::MSG_CTRUNC != 0,
    })
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_descriptor_travels_with_its_bytes() {
        let (a, b) = UnixStream::pair().unwrap();
        let (mut p, q) = UnixStream::pair().unwrap();
        assert_eq!(
            super::send(a.as_raw_fd(), &[b"hi", b"!"], &[q.as_raw_fd()]).unwrap(),
            3
        );
        let mut buf = [0u8; 8];
        let r = super::recv(b.as_raw_fd(), &mut buf).unwrap();
        assert_eq!(
            (&buf[..r.len], r.fds.len(), r.truncated),
            (&b"hi!"[..], 1, false)
        );
        // The descriptor received is the other end of `p`.
        let mut got = UnixStream::from(r.fds.into_iter().next().unwrap());
        p.write_all(b"x").unwrap();
        let mut one = [0u8; 1];
        std::io::Read::read_exact(&mut got, &mut one).unwrap();
        assert_eq!(&one, b"x");
    }
}
