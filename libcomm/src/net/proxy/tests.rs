//! The sidecar proxy's message format and request handling on one ring
//! whose two ends this thread holds (the sidecar's part, moving ring bytes
//! to a socket and back, is tested with real sidecars in
//! `tests/tests/crosshost.rs`).

use super::*;
use crate::net::{MemKind, RecvBuf, RecvComm, Request, SendComm};
use crate::transport::shm::FAIL_ERROR;

/// A send and a receive comm on the two ends of one ring.
struct Loopback {
    send: ProxySend,
    recv: ProxyRecv,
    // Declared last: dropped after the ring ends pointing into them.
    _rings: Mapping,
    _bell: Mapping,
}

fn loopback(cap: usize) -> Loopback {
    let (rings, _) = Mapping::create_memfd("proxy-test-ring", 1, cap).unwrap();
    let (bell, _) = Mapping::create_memfd("proxy-test-bell", 0, 0).unwrap();
    let att = Arc::new(Attachment {
        own: Mapping::create_control_memfd("proxy-test-own").unwrap(),
        link: None,
        path: PathBuf::from("test"),
        rank: 0,
        last_check: AtomicU64::new(0),
        t0: Instant::now(),
    });
    Loopback {
        send: ProxySend::new(
            att.clone(),
            RingEnd::new(&rings, 0, &bell, true),
            "rank 1 (test)".into(),
        ),
        recv: ProxyRecv::new(
            att,
            RingEnd::new(&rings, 0, &bell, false),
            "rank 1 (test)".into(),
        ),
        _rings: rings,
        _bell: bell,
    }
}

fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn post_recv(l: &mut Loopback, buf: &mut [u8], tag: u32) -> Request {
    let mr = l
        .recv
        .reg_mr(buf.as_ptr(), buf.len(), MemKind::Host)
        .unwrap();
    let b = RecvBuf {
        mr: &mr,
        ptr: buf.as_mut_ptr(),
        len: buf.len(),
        tag,
    };
    // SAFETY: every test waits for its requests before `buf` goes.
    unsafe { l.recv.irecv(&[b]) }.unwrap().unwrap()
}

fn post_send(l: &mut Loopback, data: &[u8], tag: u32) -> Request {
    let mr = l
        .send
        .reg_mr(data.as_ptr(), data.len(), MemKind::Host)
        .unwrap();
    // SAFETY: as in `post_recv`.
    unsafe { l.send.isend(&mr, data.as_ptr(), data.len(), tag) }
        .unwrap()
        .unwrap()
}

#[test]
fn messages_of_every_size_cross_a_small_ring_in_order_and_intact() {
    let cap = 4096;
    let mut l = loopback(cap);
    let sizes = [
        0,
        1,
        7,
        8,
        9,
        1000,
        cap - 8,
        cap,
        cap + 13,
        3 * cap + 5,
        65_537,
    ];
    let data: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| random_bytes(n, i as u64 + 1))
        .collect();
    // Receives one byte larger than each message: the size is reported.
    let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0xAB; n + 1]).collect();
    let mut recvs: Vec<Request> = Vec::new();
    for (i, b) in bufs.iter_mut().enumerate() {
        recvs.push(post_recv(&mut l, b, 100 + i as u32));
    }
    let sends: Vec<Request> = data
        .iter()
        .enumerate()
        .map(|(i, d)| post_send(&mut l, d, 100 + i as u32))
        .collect();
    let mut sent = vec![None; sizes.len()];
    let mut got = vec![None; sizes.len()];
    for _ in 0..100_000 {
        for (i, r) in sends.iter().enumerate() {
            if sent[i].is_none() {
                sent[i] = l.send.test(*r).unwrap();
            }
        }
        for (i, r) in recvs.iter().enumerate() {
            if got[i].is_none() {
                got[i] = l.recv.test(*r).unwrap();
            }
        }
        if got.iter().all(Option::is_some) && sent.iter().all(Option::is_some) {
            break;
        }
    }
    for (i, &n) in sizes.iter().enumerate() {
        assert_eq!(sent[i], Some(n), "send {i}");
        assert_eq!(got[i], Some(vec![n]), "receive {i}");
        assert_eq!(&bufs[i][..n], &data[i][..], "message {i} of {n} bytes");
        assert_eq!(bufs[i][n], 0xAB, "message {i} wrote past its end");
    }
}

#[test]
fn a_tag_or_size_that_does_not_match_the_receive_is_an_error_naming_the_peer() {
    let mut l = loopback(4096);
    let data = random_bytes(100, 7);
    let mut buf = vec![0u8; 100];
    let r = post_recv(&mut l, &mut buf, 1);
    let s = post_send(&mut l, &data, 2);
    let _ = l.send.test(s).unwrap();
    let e = l.recv.test(r).unwrap_err().to_string();
    assert!(
        e.contains("rank 1 (test)") && e.contains("tagged 0x2"),
        "{e}"
    );

    let mut l = loopback(4096);
    let mut small = vec![0u8; 99];
    let r = post_recv(&mut l, &mut small, 5);
    let s = post_send(&mut l, &data, 5);
    let _ = l.send.test(s).unwrap();
    let e = l.recv.test(r).unwrap_err().to_string();
    assert!(e.contains("100 bytes arrived for a receive of 99"), "{e}");
}

#[test]
fn a_failure_the_sidecar_raises_fails_every_call() {
    let mut l = loopback(4096);
    let data = random_bytes(64, 3);
    let mut buf = vec![0u8; 64];
    let r = post_recv(&mut l, &mut buf, 9);
    let c = l.send.0.att.own.control();
    c.set_reason("rank 3 on host b exited without destroying the communicator");
    c.raise(0, FAIL_ERROR);
    let e = l.recv.test(r).unwrap_err().to_string();
    assert!(
        e.contains("the sidecar proxy") && e.contains("rank 3 on host b exited"),
        "{e}"
    );
    let mr = l
        .send
        .reg_mr(data.as_ptr(), data.len(), MemKind::Host)
        .unwrap();
    // SAFETY: refused before anything is queued.
    let e = unsafe { l.send.isend(&mr, data.as_ptr(), data.len(), 9) }
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 3 on host b exited"), "{e}");
}

#[test]
fn bad_requests_are_refused_before_anything_moves() {
    let mut l = loopback(4096);
    let data = random_bytes(64, 5);
    assert!(matches!(
        l.send.reg_mr(data.as_ptr(), 64, MemKind::Device(0)),
        Err(NetError::Unsupported { .. })
    ));
    let mr = l.send.reg_mr(data.as_ptr(), 32, MemKind::Host).unwrap();
    // SAFETY: refused (outside the region) before anything is queued.
    let e = unsafe { l.send.isend(&mr, data.as_ptr(), 64, 1) }.unwrap_err();
    assert!(matches!(e, NetError::InvalidArgument(_)), "{e}");
    let mut a = vec![0u8; 8];
    let mut b = vec![0u8; 8];
    let mra = l.recv.reg_mr(a.as_ptr(), 8, MemKind::Host).unwrap();
    let mrb = l.recv.reg_mr(b.as_ptr(), 8, MemKind::Host).unwrap();
    let two = [
        RecvBuf {
            mr: &mra,
            ptr: a.as_mut_ptr(),
            len: 8,
            tag: 1,
        },
        RecvBuf {
            mr: &mrb,
            ptr: b.as_mut_ptr(),
            len: 8,
            tag: 1,
        },
    ];
    // SAFETY: refused (two buffers) before anything is queued.
    let e = unsafe { l.recv.irecv(&two) }.unwrap_err();
    assert!(matches!(e, NetError::InvalidArgument(_)), "{e}");
    // Too many in flight: `Ok(None)`, post again later.
    let mut n = 0;
    // SAFETY: `l` is dropped below, while `data` is still alive.
    while unsafe { l.send.isend(&mr, data.as_ptr(), 32, 1) }
        .unwrap()
        .is_some()
    {
        n += 1;
        assert!(n <= MAX_REQUESTS, "never refused");
    }
    assert_eq!(n, MAX_REQUESTS);
    drop(l);
}

/// What a broken or hostile peer could put on a ring (its sidecar forwards
/// bytes as they come): random bytes, sometimes with a plausible header,
/// must end in data or a typed error for every receive, never a panic, a
/// hang, or a byte written past a receive's buffer.
#[test]
fn arbitrary_bytes_on_the_ring_end_in_data_or_an_error_never_past_a_receive() {
    let cap = 4096;
    for case in 0..300u64 {
        let mut l = loopback(cap);
        let noise = random_bytes(((case as usize * 37) % (2 * cap)) & !7, case + 11);
        let mut pos = 0;
        // A plausible header now and then: a small length and tag 7.
        let mut bytes = noise.clone();
        if case % 3 == 0 && bytes.len() >= 8 {
            let len = (case as u32 * 13) % 300;
            bytes[..4].copy_from_slice(&len.to_le_bytes());
            bytes[4..8].copy_from_slice(&7u32.to_le_bytes());
        }
        let mut bufs: Vec<Vec<u8>> = (0..4)
            .map(|i| vec![0xCD; 8 + ((case as usize + i) * 29) % 400 + 16])
            .collect();
        let caps: Vec<usize> = bufs.iter().map(|b| b.len() - 16).collect();
        let mut reqs = Vec::new();
        for (i, b) in bufs.iter_mut().enumerate() {
            let n = caps[i];
            let mr = l.recv.reg_mr(b.as_ptr(), n, MemKind::Host).unwrap();
            let rb = RecvBuf {
                mr: &mr,
                ptr: b.as_mut_ptr(),
                len: n,
                tag: if i % 2 == 0 { 7 } else { case as u32 },
            };
            // SAFETY: the buffers outlive `l`'s use of them (checked below,
            // then `l` is dropped first).
            reqs.push(unsafe { l.recv.irecv(&[rb]) }.unwrap().unwrap());
        }
        let mut failed = false;
        for _ in 0..64 {
            let space = l.send.0.ring.space().unwrap();
            let n = space.min(bytes.len() - pos) & !7;
            if n > 0 {
                l.send.0.ring.write_at(0, bytes[pos..].as_ptr(), n);
                l.send.0.ring.publish(n);
                pos += n;
            }
            match l.recv.test(reqs[0]) {
                Ok(_) => {}
                Err(NetError::Peer { .. }) => {
                    failed = true;
                    break;
                }
                Err(e) => panic!("case {case}: not a peer error: {e}"),
            }
        }
        for (i, b) in bufs.iter().enumerate() {
            assert!(
                b[caps[i]..].iter().all(|&x| x == 0xCD),
                "case {case} (failed {failed}): receive {i} was written past its end"
            );
        }
        drop(l);
    }
}
