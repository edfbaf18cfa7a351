//! The ranks' side: a Unix socket (`<control socket>.proxy`, mode 0600)
//! where each communicator-rank with peers on other hosts opens its
//! channels (`libcomm::sidecar_link`). One thread per open connection, which
//! sleeps in `read` until the rank closes it (or dies).

use super::{Proxy, RecvChan, SendChan};
use crate::error::SidecarError;
use libcomm::sidecar_link::{self as lp, Attached, OpenMsg};
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// A rank must send its open within this long after connecting.
const OPEN_LIMIT: Duration = Duration::from_secs(5);
/// Connections that have not sent their open yet, at most (each holds a
/// thread); more are refused at once.
const MAX_OPENING: usize = 64;

pub fn serve(p: Arc<Proxy>, l: UnixListener) {
    let opening = Arc::new(AtomicUsize::new(0));
    for s in l.incoming() {
        match s {
            Ok(s) => {
                if opening.load(Ordering::Relaxed) >= MAX_OPENING {
                    p.metrics.reject("proxy-socket", "cap");
                    p.log.log("proxy-socket", "cap", None, || {
                        format!(
                            "proxy: refused a connection on the rank socket: {MAX_OPENING} have not sent their open yet"
                        )
                    });
                    continue;
                }
                opening.fetch_add(1, Ordering::Relaxed);
                let (p, o) = (p.clone(), opening.clone());
                let r = std::thread::Builder::new()
                    .name("weft-proxy-rank".into())
                    .stack_size(128 << 10)
                    .spawn(move || serve_rank(p, s, o));
                if r.is_err() {
                    opening.fetch_sub(1, Ordering::Relaxed);
                }
            }
            Err(e) => {
                crate::log::log(&format!("proxy: accept on the rank socket failed: {e}"));
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

fn serve_rank(p: Arc<Proxy>, mut s: UnixStream, opening: Arc<AtomicUsize>) {
    let fd = s.as_raw_fd();
    let r = read_open(&p, fd);
    opening.fetch_sub(1, Ordering::Relaxed);
    let (open, keys) = match r {
        Ok(x) => x,
        Err(why) => {
            let reason = if matches!(why, SidecarError::Lost(_)) {
                "timeout"
            } else {
                "open"
            };
            p.metrics.reject("proxy-socket", reason);
            p.log.log("proxy-socket", reason, None, || {
                format!("proxy: refused a rank's open: {why}")
            });
            let _ = lp::send_msg(fd, lp::KIND_ERR, why.to_string().as_bytes(), &[]);
            return;
        }
    };
    if lp::send_msg(fd, lp::KIND_OK, &[], &[p.doorbell.fd()]).is_err() {
        close(&p, &open, &keys);
        return;
    }
    // The rank holds the connection for the communicator's life.
    lp::set_read_timeout(fd, Duration::ZERO);
    let mut b = [0u8; 64];
    while let Ok(n) = s.read(&mut b) {
        if n == 0 {
            break;
        }
    }
    close(&p, &open, &keys);
}

type Keys = Vec<(super::wire::Key, super::wire::Key)>;

/// Waits (bounded) for the open, then reads it: a client that sends
/// nothing is named as such, not by the read's EAGAIN.
fn read_open(p: &Arc<Proxy>, fd: i32) -> Result<(OpenMsg, Keys), SidecarError> {
    let deadline = Instant::now() + OPEN_LIMIT;
    if !libcomm::sockets::wait_readable(fd, OPEN_LIMIT)? {
        return Err(SidecarError::Lost(format!(
            "the client sent nothing within {} s",
            OPEN_LIMIT.as_secs()
        )));
    }
    // The rest of the message is bounded by what is left of the limit.
    let left = deadline.saturating_duration_since(Instant::now());
    lp::set_read_timeout(fd, left.max(Duration::from_millis(1)));
    open(p, fd).map_err(|e| match e {
        SidecarError::Libcomm(l) if is_timeout(&l) => SidecarError::Lost(format!(
            "the client sent no complete open within {} s",
            OPEN_LIMIT.as_secs()
        )),
        e => e,
    })
}

/// Whether libcomm's error is a read that timed out (EAGAIN under SO_RCVTIMEO).
fn is_timeout(e: &libcomm::Error) -> bool {
    let s = e.to_string();
    s.contains("temporarily unavailable") || s.contains("timed out")
}

/// Reads, checks and registers one Open: the channels' keys.
fn open(p: &Arc<Proxy>, fd: i32) -> Result<(OpenMsg, Keys), SidecarError> {
    let (kind, payload, fds) = lp::recv_msg(fd)?;
    if kind != lp::KIND_OPEN {
        return Err(SidecarError::Protocol(format!(
            "expected an open, got kind {kind}"
        )));
    }
    let m = OpenMsg::decode(&payload)?;
    if m.job != p.cfg.job {
        return Err(SidecarError::Auth(format!(
            "job '{}' is not this sidecar's job '{}'",
            m.job, p.cfg.job
        )));
    }
    let att = Arc::new(Attached::map(&m, &fds)?);
    let my_ip = m.addr.ip();
    let mut reg = p.lock();
    let mut keys: Keys = Vec::new();
    let mut conns: Vec<Arc<super::HostConn>> = Vec::new();
    let mut err = None;
    for (i, peer) in m.peers.iter().enumerate() {
        let ip = peer.addr.ip();
        if ip == my_ip || ip.is_unspecified() {
            err = Some(SidecarError::Refused(format!(
                "rank {} on host {} has address {ip}, not another host's",
                peer.rank, peer.host
            )));
            break;
        }
        let conn = p.conn(&mut reg, ip, my_ip, &peer.host);
        if conn.state.load(std::sync::atomic::Ordering::Acquire) == super::LOST {
            err = Some(SidecarError::Lost(
                conn.lost_reason
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone(),
            ));
            break;
        }
        let skey = (m.comm, m.rank, peer.rank);
        let rkey = (m.comm, peer.rank, m.rank);
        if reg.send.contains_key(&skey) || reg.recv.contains_key(&rkey) {
            err = Some(SidecarError::Refused(format!(
                "rank {} of this communicator has opened its channels already",
                m.rank
            )));
            break;
        }
        if !conns.iter().any(|c| Arc::ptr_eq(c, &conn)) {
            conns.push(conn.clone());
        }
        let window = reg.pending.remove(&skey).map(|x| x.0).unwrap_or(0);
        reg.send.insert(
            skey,
            Arc::new(SendChan {
                key: skey,
                conn: conn.clone(),
                ring: Mutex::new(att.out_ring(i)),
                window: AtomicU64::new(window),
                att: att.clone(),
                closed_at: OnceLock::new(),
            }),
        );
        reg.recv.insert(
            rkey,
            Arc::new(RecvChan {
                key: rkey,
                conn,
                ring: Mutex::new(att.in_ring(i)),
                granted: AtomicU64::new(0),
                att: att.clone(),
            }),
        );
        keys.push((skey, rkey));
    }
    if let Some(e) = err {
        for (s, r) in &keys {
            reg.send.remove(s);
            reg.recv.remove(r);
        }
        return Err(e);
    }
    if reg.links.contains_key(&(m.comm, m.rank)) {
        for (s, r) in &keys {
            reg.send.remove(s);
            reg.recv.remove(r);
        }
        return Err(SidecarError::Refused(format!(
            "rank {} of this communicator is open already",
            m.rank
        )));
    }
    reg.links.insert(
        (m.comm, m.rank),
        Arc::new(super::RankLink {
            comm: m.comm,
            rank: m.rank,
            att,
            conns,
            told: Default::default(),
        }),
    );
    p.rebuild(&reg);
    Ok((m, keys))
}

/// The rank has gone: stop delivering to it, drain what it sent; if it did
/// not destroy its communicator (crash, SIGKILL), its peers elsewhere fail.
fn close(p: &Proxy, m: &OpenMsg, keys: &Keys) {
    let link = p.lock().links.remove(&(m.comm, m.rank));
    if let Some(l) = link {
        match l.att.raised() {
            Some((_, aborted, why)) => p.tell_failed(&l, aborted as u64, &why),
            None if !l.att.destroyed() => p.lock().dying.push(l),
            None => {}
        }
    }
    let mut reg = p.lock();
    for (s, r) in keys {
        reg.recv.remove(r);
        if let Some(c) = reg.send.get(s) {
            let _ = c.closed_at.set(Instant::now());
        }
    }
    p.rebuild(&reg);
}
