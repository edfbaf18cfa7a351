//! The engine alone: its pipeline meeting a producer and a consumer through
//! flag words, and its failures (a peer gone, a silent peer, abort).

use super::engine::{Engine, EngineConfig};
use super::flags::{FlagWords, Flags, TERMINAL, Waited, wait_geq};
use super::links::Links;
use super::plan::{Buf, NetColl, Region};
use super::program::{Call, CallBuf};
use super::schedule::{Cut, schedule};
use super::testing::{GatherSide, SECRET, ThreadGather};
use crate::error::Error;
use crate::net::tcp::{TcpConfig, TcpNet};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `n` engines as threads, all connected, each with `words` flag words.
fn engines(n: usize, words: usize, timeout: Option<Duration>) -> Vec<(Engine, Arc<FlagWords>)> {
    let g = ThreadGather::new(n);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|me| {
                let g = g.clone();
                s.spawn(move || {
                    let net = TcpNet::new(TcpConfig::loopback(SECRET, 2)).unwrap();
                    let peers: Vec<usize> = (0..n).filter(|&p| p != me).collect();
                    let deadline = Instant::now() + Duration::from_secs(20);
                    let links =
                        Links::connect(net, &GatherSide(g, me), me, &peers, deadline).unwrap();
                    let flags = Arc::new(FlagWords::new(words));
                    let cfg = EngineConfig {
                        label: "engine-test".into(),
                        rank: me,
                        names: (0..n).map(|r| format!("rank {r} (host {r})")).collect(),
                        timeout,
                    };
                    (Engine::start(links, flags.clone(), cfg).unwrap(), flags)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The call of a chain broadcast of `buf` from `chain[0]`, for `me`, with
/// the ready word 0 (producer) and landed word 0 (consumer), done word 1.
fn chain_call(chain: &[usize], me: usize, buf: &mut [u8], chunk: usize) -> Call {
    let region = Region::new(Buf::Send(0), 0, buf.len());
    let locate = |r: &Region| (0usize, r.off);
    let src = me == chain[0];
    let cut = Cut {
        me,
        chunk,
        esize: 1,
        locate: &locate,
        ready: src.then_some((0, 0)),
        landed: (!src).then_some((0, 0)),
    };
    let s = schedule(
        &NetColl::Broadcast {
            chain: chain.to_vec(),
            region,
            input: None,
        },
        &cut,
    );
    Call {
        steps: s.steps,
        bufs: vec![CallBuf {
            ptr: buf.as_mut_ptr() as usize,
            len: buf.len(),
        }],
        reduce: None,
        tag: 77,
        window: 4,
        done: Some((1, 1)),
    }
}

#[test]
fn chunks_flow_as_the_producer_makes_them_and_land_one_by_one() {
    const CHUNKS: usize = 48;
    const CHUNK: usize = 4096;
    let mut es = engines(2, 2, Some(Duration::from_secs(20)));
    let (e1, f1) = es.pop().unwrap();
    let (e0, f0) = es.pop().unwrap();
    let mut src = vec![0u8; CHUNKS * CHUNK];
    let mut dst = vec![0u8; CHUNKS * CHUNK];
    e0.submit(chain_call(&[0, 1], 0, &mut src, CHUNK)).unwrap();
    e1.submit(chain_call(&[0, 1], 1, &mut dst, CHUNK)).unwrap();
    let src_at = src.as_mut_ptr() as usize;
    let dst_at = dst.as_ptr() as usize;
    let t0 = Instant::now();
    let (produced_last, first_landed) = std::thread::scope(|s| {
        let producer = s.spawn(|| {
            for j in 0..CHUNKS {
                // SAFETY: the engine reads chunk j only once word 0 says so.
                let c = unsafe {
                    std::slice::from_raw_parts_mut((src_at + j * CHUNK) as *mut u8, CHUNK)
                };
                c.fill(j as u8 + 1);
                f0.store(0, j as u64 + 1);
                std::thread::sleep(Duration::from_millis(3));
            }
            t0.elapsed()
        });
        let consumer = s.spawn(|| {
            let mut first = None;
            for j in 0..CHUNKS {
                assert_eq!(
                    wait_geq(f1.as_ref(), 0, j as u64 + 1, || false),
                    Waited::Reached
                );
                first.get_or_insert(t0.elapsed());
                // SAFETY: landed words cover chunks 0..=j.
                let c =
                    unsafe { std::slice::from_raw_parts((dst_at + j * CHUNK) as *const u8, CHUNK) };
                assert!(c.iter().all(|&b| b == j as u8 + 1), "chunk {j}");
            }
            first.unwrap()
        });
        (producer.join().unwrap(), consumer.join().unwrap())
    });
    e0.wait(1, 1).unwrap();
    e1.wait(1, 1).unwrap();
    // Pipelined: the first chunk landed long before the last was made.
    assert!(
        first_landed + Duration::from_millis(50) < produced_last,
        "first chunk landed at {first_landed:?}, the last produced at {produced_last:?}"
    );
    assert!(
        dst.chunks(CHUNK)
            .enumerate()
            .all(|(j, c)| c[0] == j as u8 + 1)
    );
}

#[test]
fn abort_releases_every_waiter_at_once_and_the_peer_learns_who() {
    let mut es = engines(2, 2, None);
    let (e1, f1) = es.pop().unwrap();
    let (e0, _f0) = es.pop().unwrap();
    let mut a = vec![0u8; 1 << 16];
    let mut b = vec![0u8; 1 << 16];
    // Rank 1 waits for a broadcast rank 0 never sends; rank 0 waits to
    // receive from rank 1, which never sends either.
    e1.submit(chain_call(&[0, 1], 1, &mut b, 4096)).unwrap();
    e0.submit(chain_call(&[1, 0], 0, &mut a, 4096)).unwrap();
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            let r = wait_geq(f1.as_ref(), 0, 1, || false);
            (r, Instant::now())
        });
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        e1.abort();
        let took = t.elapsed();
        assert!(took < Duration::from_millis(50), "abort took {took:?}");
        let (r, at) = waiter.join().unwrap();
        assert_eq!(r, Waited::Released, "released by the terminal value");
        assert!(at.duration_since(t) < Duration::from_millis(200));
    });
    assert_eq!(f1.load(1), TERMINAL);
    assert!(matches!(e1.wait(1, 1), Err(Error::Aborted { .. })));
    let e = e0.wait(1, 1).unwrap_err();
    assert!(e.to_string().contains("rank 1"), "{e}");
}

#[test]
fn a_peer_that_goes_away_mid_call_fails_the_survivor_naming_it() {
    let mut es = engines(2, 2, None);
    let (e1, _f1) = es.pop().unwrap();
    let (e0, _f0) = es.pop().unwrap();
    let mut b = vec![0u8; 1 << 20];
    e1.submit(chain_call(&[0, 1], 1, &mut b, 4096)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let t = Instant::now();
    drop(e0); // no notice: its connections just close
    let e = e1.wait(1, 1).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let text = e.to_string();
    assert!(text.contains("rank 0") && text.contains("closed"), "{text}");
}

#[test]
fn a_silent_peer_fails_the_call_after_the_timeout_naming_it() {
    let timeout = Duration::from_millis(300);
    let mut es = engines(2, 2, Some(timeout));
    let (e1, _f1) = es.pop().unwrap();
    let (_e0, _f0) = es.pop().unwrap();
    let mut b = vec![0u8; 1 << 16];
    let t = Instant::now();
    e1.submit(chain_call(&[0, 1], 1, &mut b, 4096)).unwrap();
    let e = e1.wait(1, 1).unwrap_err();
    let took = t.elapsed();
    assert!(took >= timeout && took < Duration::from_secs(3), "{took:?}");
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("for rank 0 (host 0) to send"), "{e}");
}

#[test]
fn a_failure_reaches_ranks_that_never_talked_to_the_failed_one_with_its_name() {
    let mut es = engines(3, 2, None);
    let (e2, _) = es.pop().unwrap();
    let (e1, _) = es.pop().unwrap();
    let (e0, _) = es.pop().unwrap();
    // Rank 2 waits on rank 1, rank 1 on rank 0; rank 0 aborts.
    let (mut b1, mut b2) = (vec![0u8; 4096], vec![0u8; 4096]);
    e1.submit(chain_call(&[0, 1], 1, &mut b1, 4096)).unwrap();
    e2.submit(chain_call(&[1, 2], 2, &mut b2, 4096)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    e0.abort();
    for e in [&e1, &e2] {
        let err = e.wait(1, 1).unwrap_err();
        assert!(err.to_string().contains("rank 0 (host 0) failed"), "{err}");
    }
}

/// Four engines timing out after `timeout`: rank 0 waits for rank 2 and,
/// `gap` later, rank 1 for rank 3 (chain broadcasts ranks 2 and 3 never
/// send; their engines stay up, idle). Returns the engines by rank and
/// the receive buffers (alive until the calls end).
fn waiting_on_silent_peers(timeout: Duration, gap: Duration) -> (Vec<Engine>, Vec<Vec<u8>>) {
    let es: Vec<Engine> = engines(4, 2, Some(timeout))
        .into_iter()
        .map(|(e, _)| e)
        .collect();
    let mut bufs = vec![vec![0u8; 4096]; 2];
    es[0]
        .submit(chain_call(&[2, 0], 0, &mut bufs[0], 4096))
        .unwrap();
    std::thread::sleep(gap);
    es[1]
        .submit(chain_call(&[3, 1], 1, &mut bufs[1], 4096))
        .unwrap();
    (es, bufs)
}

/// Ranks 0 and 1 wait for ranks 2 and 3, which never send. Rank 0 times
/// out first, names rank 2 and tells everyone; rank 1, timing out within
/// the grace, names the rank it waits for (rank 3), not rank 0's view:
/// a failure that started off its chain of waits (rank 0's, relayed by
/// ranks 2 and 3 too) does not explain its own wait (it is noted as
/// having failed meanwhile).
#[test]
fn a_rank_timing_out_names_its_own_stuck_peer_not_another_ranks_failure() {
    let timeout = Duration::from_millis(300);
    let (es, _bufs) = waiting_on_silent_peers(timeout, Duration::from_millis(150));
    let err0 = es[0].wait(1, 1).unwrap_err().to_string();
    let err1 = es[1].wait(1, 1).unwrap_err().to_string();
    assert!(err0.contains("rank 2 (host 2) is stuck"), "{err0}");
    assert!(err1.contains("for rank 3 (host 3) to send"), "{err1}");
    assert!(err1.contains("rank 3 (host 3) is stuck"), "{err1}");
    assert!(err1.contains("meanwhile rank 0 (host 0) failed"), "{err1}");
}

/// Rank 1 waits for rank 3 (silent) but has not timed out when rank 0's
/// failure (its own wait for rank 2 timing out) reaches it: it fails with
/// rank 0's error, and says what it had itself been waiting for.
#[test]
fn a_failure_heard_from_another_rank_carries_this_ranks_own_long_wait() {
    let timeout = Duration::from_millis(2000);
    let (es, _bufs) = waiting_on_silent_peers(timeout, Duration::from_millis(1200));
    let err1 = es[1].wait(1, 1).unwrap_err().to_string();
    assert!(
        !err1.contains("engine-test (rank 1) waiting"),
        "rank 1 timed out itself: {err1}"
    );
    assert!(err1.contains("rank 0 (host 0) failed"), "{err1}");
    assert!(err1.contains("this rank had waited"), "{err1}");
    assert!(err1.contains("for rank 3 (host 3) to send"), "{err1}");
    let _ = es[0].wait(1, 1);
}
