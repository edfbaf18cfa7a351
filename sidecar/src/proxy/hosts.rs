//! Connections between sidecars: dial or accept, authenticate (HMAC
//! challenge-response over both sides' nonces, `wire`), then one receive
//! thread per connection that reads frames and writes data straight into
//! the destination ranks' rings.

use super::wire::{self, Challenge, FRAME_HEADER, Frame, Hello};
use super::{HostConn, LOST, Proxy, UP};
use crate::error::SidecarError;
use crate::seams::Handover;
use libcomm::handshake;
use libcomm::sockets::{self, DataOpts};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

const HANDSHAKE_LIMIT: Duration = Duration::from_secs(5);
/// How long a host's sidecar may take to become reachable at all.
const CONNECT_LIMIT: Duration = Duration::from_secs(60);

/// Reads one length-prefixed handshake message (bounded size, by `deadline`).
fn recv(s: &mut TcpStream, deadline: Instant) -> Result<Vec<u8>, SidecarError> {
    Ok(handshake::read_msg(
        s,
        wire::MAX_HANDSHAKE,
        deadline,
        wire::WHAT,
    )?)
}

/// Connects to the host's sidecar (retrying until it listens) and installs the connection.
pub fn dial(p: Arc<Proxy>, c: Arc<HostConn>, my_ip: std::net::IpAddr) {
    let _ = std::thread::Builder::new()
        .name("weft-proxy-dial".into())
        .spawn(move || {
            let addr = SocketAddr::new(c.ip, c.port);
            let deadline = Instant::now() + CONNECT_LIMIT;
            let mut last;
            while c.state.load(Ordering::Acquire) != LOST {
                match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                    Ok(s) => match handshake_dial(&p, s, my_ip) {
                        Ok((s, name)) => return install(&p, &c, s, &name),
                        Err(e) => {
                            if e.is_fatal() {
                                p.lose(&c, &format!("its sidecar at {addr}: {e}"));
                                return;
                            }
                            last = e.to_string();
                        }
                    },
                    Err(e) => last = e.to_string(),
                }
                if Instant::now() >= deadline {
                    p.lose(
                        &c,
                        &format!("cannot reach its sidecar's proxy at {addr}: {last}"),
                    );
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
}

/// The other side dials: lose the host if it never does.
pub fn await_accept(p: Arc<Proxy>, c: Arc<HostConn>) {
    let _ = std::thread::Builder::new()
        .name("weft-proxy-wait".into())
        .spawn(move || {
            let deadline = Instant::now() + CONNECT_LIMIT;
            while c.state.load(Ordering::Acquire) == super::CONNECTING {
                if Instant::now() >= deadline {
                    p.lose(&c, "its sidecar never connected to our proxy");
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
}

/// Dialer's side of the handshake. A fatal error (`is_fatal`): the peer
/// proved it does not hold our secret (retrying cannot help).
fn handshake_dial(
    p: &Proxy,
    mut s: TcpStream,
    my_ip: std::net::IpAddr,
) -> Result<(TcpStream, String), SidecarError> {
    s.set_read_timeout(Some(HANDSHAKE_LIMIT))?;
    s.set_write_timeout(Some(HANDSHAKE_LIMIT))?;
    let nonce = handshake::challenge()?;
    s.write_all(wire::PREFACE)?;
    let hello = Hello {
        nonce,
        job: p.cfg.job.clone(),
        host: p.cfg.host.clone(),
        addr: my_ip.to_string(),
    }
    .encode();
    handshake::write_msg(&mut s, &hello)?;
    let ch = Challenge::decode(&recv(&mut s, Instant::now() + HANDSHAKE_LIMIT)?)?;
    let (secret, job) = (&p.cfg.secret, &p.cfg.job);
    wire::check_mac(secret, "acceptor", job, &hello, &ch.nonce, &ch.mac).map_err(|_| {
        SidecarError::Auth("it does not hold this job's secret (HMAC mismatch)".into())
    })?;
    let proof = wire::mac(secret, "dialer", job, &hello, &ch.nonce);
    handshake::write_msg(&mut s, &proof)?;
    s.set_read_timeout(Some(HANDSHAKE_LIMIT))?;
    let mut ok = [0u8; 1];
    s.read_exact(&mut ok)
        .map_err(|e| SidecarError::Auth(format!("it refused our proof: {e}")))?;
    if ok[0] != 1 {
        return Err(SidecarError::Auth("it refused our proof".into()));
    }
    Ok((s, ch.host))
}

/// A connection on the peer port that opened with the proxy preface: it
/// must finish the handshake by its deadline (counted from accept, the
/// preface included); its admission (its place among the port's
/// unauthenticated connections) is held until then.
pub fn accept(p: Arc<Proxy>, conn: Handover) {
    let Handover {
        stream: s,
        from,
        deadline,
        admission,
    } = conn;
    let _ = std::thread::Builder::new()
        .name("weft-proxy-accept".into())
        .stack_size(128 << 10)
        .spawn(move || {
            let reject = |reason: &'static str, why: &str| {
                p.metrics.reject("proxy", reason);
                p.log.log("proxy", reason, Some(from.ip()), || {
                    format!("rejected a proxy connection from {from}: {why}")
                });
            };
            let _ = s.set_nonblocking(false);
            let r = handshake_accept(&p, s, deadline);
            let evicted = admission.evicted();
            drop(admission);
            match r {
                Err(_) if evicted => {} // counted and logged as such
                Err(e) => reject(e.reject_reason(), &e.to_string()),
                Ok((s, name, claimed)) => {
                    let ip = claimed.unwrap_or(from.ip());
                    let c = {
                        let mut reg = p.lock();
                        match reg.conns.get(&ip) {
                            Some(c) if c.state.load(Ordering::Acquire) != super::CONNECTING => {
                                drop(reg);
                                return reject(
                                    "duplicate",
                                    "a connection to that host exists already",
                                );
                            }
                            Some(c) => c.clone(),
                            None => {
                                let c = p.new_conn(ip, &name);
                                reg.conns.insert(ip, c.clone());
                                c
                            }
                        }
                    };
                    install(&p, &c, s, &name);
                }
            }
        });
}

/// An authenticated connection, the peer's host name and claimed address.
type Accepted = (TcpStream, String, Option<std::net::IpAddr>);

fn handshake_accept(
    p: &Proxy,
    mut s: TcpStream,
    deadline: Instant,
) -> Result<Accepted, SidecarError> {
    // Writes are small (the socket buffer takes them): bounded by what is left.
    let left = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    s.set_write_timeout(Some(left()))?;
    let raw = recv(&mut s, deadline)?;
    let hello = Hello::decode(&raw)?;
    let (secret, job) = (&p.cfg.secret, &p.cfg.job);
    if hello.job != *job {
        return Err(SidecarError::Auth(format!(
            "job '{}' is not ours",
            hello.job
        )));
    }
    let nonce = handshake::challenge()?;
    let ch = Challenge {
        nonce,
        host: p.cfg.host.clone(),
        mac: wire::mac(secret, "acceptor", job, &raw, &nonce),
    };
    s.set_write_timeout(Some(left()))?;
    handshake::write_msg(&mut s, &ch.encode())?;
    let proof = wire::decode_proof(&recv(&mut s, deadline)?)?;
    wire::check_mac(secret, "dialer", job, &raw, &nonce, &proof)
        .map_err(|_| SidecarError::Auth("wrong job secret (HMAC mismatch)".into()))?;
    s.write_all(&[1])?;
    Ok((s, hello.host, hello.addr.parse().ok()))
}

/// Tunes an authenticated connection and starts its receive thread.
fn install(p: &Arc<Proxy>, c: &Arc<HostConn>, s: TcpStream, name: &str) {
    let _ = s.set_read_timeout(None);
    let _ = s.set_write_timeout(None);
    let _ = sockets::tune_data(
        &s,
        &DataOpts {
            user_timeout: Some(p.cfg.timeout),
            buffers: Some(sockets::DATA_BUFFER),
            nonblocking: true,
            ..DataOpts::default()
        },
    );
    let rx = match s.try_clone() {
        Ok(r) => r,
        Err(e) => return p.lose(c, &format!("cannot clone the socket: {e}")),
    };
    if !name.is_empty() {
        *c.name.lock().unwrap_or_else(|e| e.into_inner()) = name.chars().take(256).collect();
    }
    if c.sock.set(s).is_err() {
        return p.lose(c, "a second connection to an existing host");
    }
    if c.state
        .compare_exchange(super::CONNECTING, UP, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return;
    }
    c.stats.connects.fetch_add(1, Ordering::Relaxed);
    c.last_tx_ms.store(p.now_ms(), Ordering::Relaxed);
    p.metrics.proxy_up.inc();
    p.metrics.proxy_connections.inc();
    crate::log::log(&format!("proxy: connected to host {}", c.label()));
    let (p2, c2) = (p.clone(), c.clone());
    let _ = std::thread::Builder::new()
        .name("weft-proxy-rx".into())
        .spawn(move || {
            let why = receive(&p2, &c2, rx);
            p2.lose(&c2, &why);
        });
    p.rebuild(&p.lock());
}

/// Reads exactly `n` bytes into `dst`; a silent peer for the timeout is lost.
fn read_full(s: &TcpStream, dst: *mut u8, n: usize, timeout: Duration) -> Result<(), SidecarError> {
    let mut got = 0;
    while got < n {
        let b = unsafe { std::slice::from_raw_parts_mut(dst.add(got), n - got) };
        match (&*s).read(b) {
            Ok(0) => {
                return Err(SidecarError::Lost(
                    "its sidecar closed the connection".into(),
                ));
            }
            Ok(k) => got += k,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if let Ok(false) = sockets::wait_readable(s.as_raw_fd(), timeout) {
                    return Err(SidecarError::Lost(format!(
                        "no traffic from its sidecar for {} ms (link down?)",
                        timeout.as_millis()
                    )));
                }
            }
            Err(e) => return Err(SidecarError::Lost(format!("connection error: {e}"))),
        }
    }
    Ok(())
}

/// The receive loop; returns why the connection ended.
fn receive(p: &Arc<Proxy>, c: &Arc<HostConn>, s: TcpStream) -> String {
    match receive_frames(p, c, s) {
        Ok(()) => "closed".into(),
        Err(e) => e.to_string(),
    }
}

fn receive_frames(p: &Arc<Proxy>, c: &Arc<HostConn>, s: TcpStream) -> Result<(), SidecarError> {
    let mut scratch: Vec<u8> = Vec::new();
    loop {
        if c.state.load(Ordering::Acquire) == LOST {
            return Ok(());
        }
        let mut h = [0u8; FRAME_HEADER];
        read_full(&s, h.as_mut_ptr(), FRAME_HEADER, p.cfg.timeout)?;
        let f = match Frame::decode(&h) {
            Ok(f) => f,
            Err(e) => {
                p.metrics.reject("proxy", "frame");
                return Err(SidecarError::Protocol(format!(
                    "protocol error from its sidecar: {e}"
                )));
            }
        };
        match f.kind {
            wire::KIND_DATA => {
                let n = f.len as usize;
                let chan = p.lock().recv.get(&f.key).cloned();
                match chan {
                    Some(ch) if Arc::ptr_eq(&ch.conn, c) => {
                        let mut ring = ch.ring.lock().unwrap_or_else(|e| e.into_inner());
                        let space = ring.space().unwrap_or(0);
                        if n > space || f.value != ring.pos() {
                            p.metrics.reject("proxy", "credit");
                            return Err(SidecarError::Protocol(format!(
                                "protocol error: {n} bytes at {} for a ring with {space} free at {}",
                                f.value,
                                ring.pos()
                            )));
                        }
                        // Straight from the socket into the rank's ring.
                        for (ptr, len) in ring.regions(n) {
                            if len > 0 {
                                read_full(&s, ptr, len, p.cfg.timeout)?;
                            }
                        }
                        ring.publish(n);
                        c.count_rx(n as u64);
                    }
                    _ => {
                        // A rank that closed with bytes in flight: discard them.
                        scratch.resize(n, 0);
                        read_full(&s, scratch.as_mut_ptr(), n, p.cfg.timeout)?;
                        c.count_rx(n as u64);
                    }
                }
            }
            wire::KIND_CREDIT => {
                let mut reg = p.lock();
                match reg.send.get(&f.key) {
                    Some(sc) if Arc::ptr_eq(&sc.conn, c) => {
                        sc.window.fetch_max(f.value, Ordering::AcqRel);
                    }
                    _ => p.park_credit(&mut reg, f.key, f.value),
                }
                drop(reg);
                p.doorbell.ring();
            }
            wire::KIND_FAIL => {
                let mut why = [0u8; wire::MAX_REASON];
                let n = f.len as usize;
                read_full(&s, why.as_mut_ptr(), n, p.cfg.timeout)?;
                let why = String::from_utf8_lossy(&why[..n]);
                p.on_fail(c, f.key.0, f.key.1, f.value, &why);
            }
            _ => {} // ping: liveness only
        }
    }
}
