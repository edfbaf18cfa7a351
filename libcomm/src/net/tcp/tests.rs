//! The TCP byte mover on loopback: striping, ordering, bounds, failures and
//! hostile clients.

use super::*;
use crate::net::{MemKind, Mr, RecvBuf, RecvComm, Request};
use std::io::{Read, Write};

const SECRET: [u8; 32] = [7; 32];
const SOON: Duration = Duration::from_secs(10);

fn pair(sockets: usize) -> (Box<dyn SendComm>, Box<dyn RecvComm>) {
    let net = TcpNet::new(TcpConfig::loopback(SECRET, sockets)).unwrap();
    let (h, mut l) = net.listen(0).unwrap();
    let me = Peer { rank: 3, stream: 1 };
    let s = net
        .connect(0, &h, me, Instant::now() + SOON, &|| false)
        .unwrap();
    let (r, who) = l.accept(Instant::now() + SOON).unwrap().unwrap();
    assert_eq!(who, me);
    (s, r)
}

fn wait_send(s: &mut dyn SendComm, req: Request) -> Result<usize, NetError> {
    let t = Instant::now();
    loop {
        if let Some(n) = s.test(req)? {
            return Ok(n);
        }
        assert!(t.elapsed() < SOON, "send never completed");
        std::thread::yield_now();
    }
}

fn wait_recv(r: &mut dyn RecvComm, req: Request) -> Result<usize, NetError> {
    let t = Instant::now();
    loop {
        if let Some(n) = r.test(req)? {
            return Ok(n[0]);
        }
        assert!(t.elapsed() < SOON, "receive never completed");
        std::thread::yield_now();
    }
}

fn reg_s(s: &mut dyn SendComm, b: &[u8]) -> Mr {
    s.reg_mr(b.as_ptr(), b.len(), MemKind::Host).unwrap()
}

fn reg_r(r: &mut dyn RecvComm, b: &[u8]) -> Mr {
    r.reg_mr(b.as_ptr(), b.len(), MemKind::Host).unwrap()
}

/// Registers `o` and posts a receive into all of it.
fn post_recv(r: &mut dyn RecvComm, o: &mut [u8], tag: u32) -> Request {
    let mr = reg_r(r, o);
    let b = RecvBuf {
        mr: &mr,
        ptr: o.as_mut_ptr(),
        len: o.len(),
        tag,
    };
    unsafe { r.irecv(&[b]) }.unwrap().unwrap()
}

/// Registers `m` and posts a send of all of it.
fn post_send(s: &mut dyn SendComm, m: &[u8], tag: u32) -> Request {
    let mr = reg_s(s, m);
    unsafe { s.isend(&mr, m.as_ptr(), m.len(), tag) }
        .unwrap()
        .unwrap()
}

#[test]
fn messages_arrive_whole_in_order_over_every_socket_count() {
    for sockets in [1, 2, 3, 8] {
        let (mut s, mut r) = pair(sockets);
        // Sizes around the piece boundaries, several in flight at once.
        let sizes = [0usize, 1, 4095, MIN_TASK, MIN_TASK + 1, 3 << 20, 1 << 20];
        let msgs: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(k, &n)| (0..n).map(|i| (i * 31 + k * 7) as u8).collect())
            .collect();
        let mut outs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0xAA; n + 5]).collect();
        let smrs: Vec<Mr> = msgs.iter().map(|m| reg_s(s.as_mut(), m)).collect();
        let rmrs: Vec<Mr> = outs.iter().map(|o| reg_r(r.as_mut(), o)).collect();
        let mut rreqs = Vec::new();
        for (o, mr) in outs.iter_mut().zip(&rmrs) {
            let b = RecvBuf {
                mr,
                ptr: o.as_mut_ptr(),
                len: o.len(),
                tag: 9,
            };
            rreqs.push(unsafe { r.irecv(&[b]) }.unwrap().unwrap());
        }
        let sreqs: Vec<Request> = msgs
            .iter()
            .zip(&smrs)
            .map(|(m, mr)| {
                unsafe { s.isend(mr, m.as_ptr(), m.len(), 9) }
                    .unwrap()
                    .unwrap()
            })
            .collect();
        for (k, req) in sreqs.into_iter().enumerate() {
            assert_eq!(wait_send(s.as_mut(), req).unwrap(), sizes[k]);
        }
        for (k, req) in rreqs.into_iter().enumerate() {
            assert_eq!(
                wait_recv(r.as_mut(), req).unwrap(),
                sizes[k],
                "size reported"
            );
            assert!(
                outs[k][..sizes[k]] == msgs[k][..],
                "{sockets} sockets, message {k}"
            );
            assert!(
                outs[k][sizes[k]..].iter().all(|&b| b == 0xAA),
                "nothing past it"
            );
        }
    }
}

#[test]
fn a_receive_posted_after_the_data_arrived_still_gets_it() {
    let (mut s, mut r) = pair(2);
    let m = vec![5u8; 200_000];
    let req = post_send(s.as_mut(), &m, 1);
    wait_send(s.as_mut(), req).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let mut o = vec![0u8; m.len()];
    let req = post_recv(r.as_mut(), &mut o, 1);
    assert_eq!(wait_recv(r.as_mut(), req).unwrap(), m.len());
    assert_eq!(o, m);
}

#[test]
fn a_message_sent_just_before_the_peer_closes_still_arrives_whole() {
    let (mut s, mut r) = pair(4);
    let m: Vec<u8> = (0..400_000).map(|i| (i % 251) as u8).collect();
    let req = post_send(s.as_mut(), &m, 5);
    wait_send(s.as_mut(), req).unwrap();
    drop(s); // some sockets reach their end while others still carry data
    std::thread::sleep(Duration::from_millis(50));
    let mut o = vec![0u8; m.len()];
    let req = post_recv(r.as_mut(), &mut o, 5);
    assert_eq!(wait_recv(r.as_mut(), req).unwrap(), m.len());
    assert_eq!(o, m);
    // Every socket has ended: a receive for a message that never comes fails.
    let mut more = vec![0u8; 8];
    let mr = reg_r(r.as_mut(), &more);
    let b = RecvBuf {
        mr: &mr,
        ptr: more.as_mut_ptr(),
        len: 8,
        tag: 5,
    };
    let e = unsafe { r.irecv(&[b]) }.unwrap_err();
    assert!(e.to_string().contains("closed by the peer"), "{e}");
}

#[test]
fn device_memory_outside_bytes_and_foreign_regions_are_refused() {
    let (mut s, mut r) = pair(1);
    let e = s
        .reg_mr(std::ptr::null(), 64, MemKind::Device(0))
        .unwrap_err();
    assert!(matches!(e, NetError::Unsupported { .. }), "{e}");
    assert!(e.to_string().contains("pinned host memory"), "{e}");
    assert!(r.reg_mr(std::ptr::null(), 64, MemKind::Device(1)).is_err());
    let m = vec![0u8; 100];
    let mr = reg_s(s.as_mut(), &m);
    let e = unsafe { s.isend(&mr, m.as_ptr(), 101, 0) }.unwrap_err();
    assert!(e.to_string().contains("outside"), "{e}");
    s.dereg_mr(&mr).unwrap();
    let e = unsafe { s.isend(&mr, m.as_ptr(), 10, 0) }.unwrap_err();
    assert!(e.to_string().contains("not registered"), "{e}");
    let mut o = vec![0u8; 8];
    let omr = reg_r(r.as_mut(), &o);
    let b = RecvBuf {
        mr: &omr,
        ptr: o.as_mut_ptr(),
        len: 8,
        tag: 0,
    };
    assert!(
        unsafe { r.irecv(&[b, b]) }.is_err(),
        "one buffer per receive on TCP"
    );
}

#[test]
fn a_message_larger_than_its_receive_or_of_another_tag_fails_naming_the_peer() {
    for (len, tag, want) in [(64usize, 2u32, "only 32"), (16, 3, "tag")] {
        let (mut s, mut r) = pair(1);
        let m = vec![1u8; len];
        let mut o = vec![0u8; 32];
        let rq = post_recv(r.as_mut(), &mut o, 2);
        let sq = post_send(s.as_mut(), &m, tag);
        wait_send(s.as_mut(), sq).unwrap();
        let e = wait_recv(r.as_mut(), rq).unwrap_err();
        let text = e.to_string();
        assert!(text.contains(want) && text.contains("127.0.0.1"), "{text}");
        assert!(o.iter().all(|&b| b == 0), "nothing written");
    }
}

#[test]
fn a_peer_that_goes_away_mid_message_fails_the_receive() {
    let (s, mut r) = pair(2);
    let mut o = vec![0u8; 8 << 20];
    let rq = post_recv(r.as_mut(), &mut o, 0);
    drop(s);
    let t = Instant::now();
    let e = wait_recv(r.as_mut(), rq).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(2));
    assert!(e.to_string().contains("closed by the peer"), "{e}");
}

#[test]
fn too_many_requests_in_flight_means_not_now() {
    // Declared first, so dropped after the comm that reads it.
    let m = vec![0u8; 4 << 20];
    let (mut s, _r) = pair(1);
    let mr = reg_s(s.as_mut(), &m);
    let mut posted = 0;
    // Nobody receives: the socket buffers fill and requests stay in flight.
    while let Some(_req) = unsafe { s.isend(&mr, m.as_ptr(), m.len(), 0) }.unwrap() {
        posted += 1;
        assert!(posted <= MAX_REQUESTS);
    }
    assert_eq!(posted, MAX_REQUESTS);
}

/// A connection attempt that the listener must refuse.
fn refused_connect(net: &TcpNet, h: &ConnectHandle) -> NetError {
    let anyone = Peer { rank: 0, stream: 0 };
    net.connect(0, h, anyone, Instant::now() + SOON, &|| false)
        .err()
        .expect("refused")
}

/// Reads what a listener answers (its challenge) and sends `bytes`; the
/// listener must close the connection.
fn refused(addr: SocketAddr, bytes: &[u8]) {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(SOON)).unwrap();
    let _ = c.write_all(bytes);
    let mut sink = Vec::new();
    let t = Instant::now();
    let _ = c.read_to_end(&mut sink);
    assert!(t.elapsed() < SOON, "the listener kept a hostile connection");
}

#[test]
fn hostile_clients_are_refused_and_real_peers_still_connect() {
    let net = TcpNet::new(TcpConfig::loopback(SECRET, 2)).unwrap();
    let (h, mut l) = net.listen(0).unwrap();
    let addr = wire::Handle::decode(&h).unwrap().addr;
    let before = listen::COUNTERS
        .unauthenticated
        .load(std::sync::atomic::Ordering::Relaxed);
    // Garbage, and a header claiming a huge frame.
    refused(addr, b"GET / HTTP/1.1\r\n\r\n");
    let mut huge = bwire::encode(Kind::Connect, b"", &SECRET, b"");
    huge[8..12].copy_from_slice(&u32::MAX.to_be_bytes());
    refused(addr, &huge);
    // A well-formed hello without the secret.
    let other = TcpNet::new(TcpConfig::loopback([9; 32], 1)).unwrap();
    let e = refused_connect(&other, &h);
    assert!(e.to_string().contains("refused"), "{e}");
    assert!(
        listen::COUNTERS
            .unauthenticated
            .load(std::sync::atomic::Ordering::Relaxed)
            > before
    );
    // Nothing reached the listen comm; a real peer still gets through.
    assert!(l.accept(Instant::now()).unwrap().is_none());
    let me = Peer { rank: 1, stream: 0 };
    let mut s = net
        .connect(0, &h, me, Instant::now() + SOON, &|| false)
        .unwrap();
    let (mut r, who) = l.accept(Instant::now() + SOON).unwrap().unwrap();
    assert_eq!(who, me);
    let m = vec![3u8; 1000];
    let mut o = vec![0u8; 1000];
    let rq = post_recv(r.as_mut(), &mut o, 0);
    let sq = post_send(s.as_mut(), &m, 0);
    wait_send(s.as_mut(), sq).unwrap();
    wait_recv(r.as_mut(), rq).unwrap();
    assert_eq!(o, m);
}

#[test]
fn a_stale_handle_is_refused_clearly() {
    let net = TcpNet::new(TcpConfig::loopback(SECRET, 1)).unwrap();
    let (h, l) = net.listen(0).unwrap();
    drop(l);
    let e = refused_connect(&net, &h);
    assert!(e.to_string().contains("no such listener"), "{e}");
}

/// A listener bound to every interface advertises the communicator's own
/// address, in its family; an explicit bind address stays.
#[test]
fn advertising_a_communicators_address_keeps_the_bind_family_or_an_explicit_bind() {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let pod = IpAddr::V4(Ipv4Addr::new(10, 88, 1, 79));
    let mut c = TcpConfig::loopback([7; 32], 2);
    c.bind = IpAddr::V6(Ipv6Addr::UNSPECIFIED);
    let c = c.advertising(pod);
    assert_eq!(c.advertise, pod);
    assert_eq!(c.bind, IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    let fixed = TcpConfig::loopback([7; 32], 2).advertising(pod);
    assert_eq!(fixed.bind, IpAddr::V4(Ipv4Addr::LOCALHOST));
    let v6 = IpAddr::V6("fd00::5".parse().unwrap());
    let mut c = TcpConfig::loopback([7; 32], 2);
    c.bind = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
    assert_eq!(c.advertising(v6).bind, IpAddr::V6(Ipv6Addr::UNSPECIFIED));
}
