//! The pipeline of a device job's collective on host memory: its input put
//! in place piece by piece by another thread (as the copy kernel does), its
//! output's final prefix reported as chunks land (`stream_words.rs`,
//! `CrossHost::collective_progressive`), ranks as threads over loopback.

use super::plan::Coll;
use super::testing::{mix, on_all, world};
use crate::data::types::{DataType, ReduceOp};
use crate::op::backend::JobProgress;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A job's stream as the test plays it.
struct Played {
    ready: AtomicUsize,
    total: usize,
    waits: AtomicUsize,
    finals: Mutex<Vec<usize>>,
}

impl Played {
    fn new(total: usize, ready: usize) -> Arc<Played> {
        Arc::new(Played {
            ready: AtomicUsize::new(ready),
            total,
            waits: AtomicUsize::new(0),
            finals: Mutex::new(Vec::new()),
        })
    }

    fn finals(&self) -> Vec<usize> {
        self.finals.lock().unwrap().clone()
    }
}

impl JobProgress for Played {
    fn input_ready(&self) -> usize {
        self.ready.load(Ordering::Acquire)
    }
    fn wait_input(&self) -> bool {
        self.waits.fetch_add(1, Ordering::Relaxed);
        let t = Instant::now();
        while self.input_ready() < self.total {
            if t.elapsed() > Duration::from_secs(20) {
                return false;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        true
    }
    fn output_final(&self, bytes: usize) {
        self.finals.lock().unwrap().push(bytes);
    }
}

fn bytes_of(seed: u64, rank: usize, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| mix(seed ^ ((rank as u64) << 40) ^ i as u64) as u8)
        .collect()
}

/// Puts `data` into `at` in `piece`-byte pieces, raising `p`'s ready count
/// after each; before the last piece it waits (at most 10 s) until `gate`
/// says so. Whether the gate opened by itself.
fn produce(p: &Played, at: usize, data: &[u8], piece: usize, gate: &dyn Fn() -> bool) -> bool {
    let mut opened = true;
    let mut off = 0;
    while off < data.len() {
        let end = (off + piece).min(data.len());
        if end == data.len() {
            let t = Instant::now();
            while !gate() {
                if t.elapsed() > Duration::from_secs(10) {
                    opened = false;
                    break;
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        // SAFETY: `at` holds `data.len()` bytes; the reader reads a byte
        // only once the count below covers it.
        unsafe {
            std::ptr::copy_nonoverlapping(data[off..end].as_ptr(), (at + off) as *mut u8, end - off)
        };
        p.ready.store(end, Ordering::Release);
        off = end;
    }
    opened
}

/// The final prefixes reported never shrink and end at all `n` bytes.
fn assert_growing_to(finals: &[usize], n: usize, what: &str) {
    assert!(
        finals.windows(2).all(|w| w[0] <= w[1]),
        "{what}: {finals:?} shrinks"
    );
    assert_eq!(
        finals.last(),
        Some(&n),
        "{what}: {finals:?} never covers all {n} bytes"
    );
}

#[test]
fn a_broadcast_sends_its_first_chunks_before_its_input_is_all_in_place() {
    for hosts in [vec![vec![0], vec![1]], vec![vec![0], vec![1], vec![2]]] {
        let nr = hosts.len();
        let mut ranks = world(hosts, 2, Some(Duration::from_secs(30)));
        // 1 MiB and an odd tail of f32: chunks of 64 KiB-128 KiB, the last short.
        let count = (1 << 18) + 9;
        let n = count * 4;
        let root = nr - 1;
        let data = bytes_of(7, root, n);
        let played: Vec<Arc<Played>> = (0..nr)
            .map(|r| Played::new(n, if r == root { 0 } else { n }))
            .collect();
        // The root's last piece waits until every other rank has some of
        // the output final: only a pipeline gets there.
        let others_started = || {
            (0..nr)
                .filter(|&r| r != root)
                .all(|r| played[r].finals().iter().any(|&b| b > 0))
        };
        let outs = on_all(&mut ranks, |x| {
            let me = x.rank();
            let mut buf = vec![0xEEu8; n];
            let at = buf.as_mut_ptr() as usize;
            let p = played[me].clone();
            std::thread::scope(|s| {
                let producer = (me == root).then(|| {
                    s.spawn(|| produce(&played[me], at, &data, 256 << 10, &others_started))
                });
                let r = unsafe {
                    x.collective_progressive(
                        Coll::Broadcast { root },
                        at as *const u8,
                        at as *mut u8,
                        count,
                        DataType::F32,
                        ReduceOp::Sum,
                        Some(p),
                    )
                };
                let opened = producer.map(|h| h.join().unwrap());
                (r, opened, buf)
            })
        });
        for (me, (r, opened, out)) in outs.into_iter().enumerate() {
            let what = format!("broadcast on {nr} hosts, rank {me}");
            r.unwrap_or_else(|e| panic!("{what}: {e}"));
            assert!(out == data, "{what}: wrong bytes");
            if me == root {
                assert_eq!(
                    opened,
                    Some(true),
                    "{what}: no rank got a chunk before the last piece was in place"
                );
                assert_eq!(
                    played[me].waits.load(Ordering::Relaxed),
                    0,
                    "{what}: waited for the whole input"
                );
            } else {
                let finals = played[me].finals();
                assert_growing_to(&finals, n, &what);
                assert!(
                    finals.iter().any(|&b| b > 0 && b < n),
                    "{what}: {finals:?}: no part of the output was final before the whole"
                );
            }
        }
    }
}

#[test]
fn a_pipelined_all_reduce_reads_each_chunk_once_in_place_and_matches_the_reference() {
    let mut ranks = world(
        vec![vec![0], vec![1], vec![2]],
        1,
        Some(Duration::from_secs(30)),
    );
    let count = 3 * 50_000 + 7; // i32, blocks of uneven chunks
    let n = count * 4;
    let inputs: Vec<Vec<i32>> = (0..3)
        .map(|r| {
            (0..count)
                .map(|i| (mix(((r as u64) << 32) ^ i as u64) % 1000) as i32 - 500)
                .collect()
        })
        .collect();
    let want: Vec<i32> = (0..count)
        .map(|i| inputs.iter().map(|v| v[i]).sum())
        .collect();
    let played: Vec<Arc<Played>> = (0..3).map(|_| Played::new(n, 0)).collect();
    let outs = on_all(&mut ranks, |x| {
        x.chunk = Some(16 << 10);
        let me = x.rank();
        let mut buf = vec![0x77u8; n];
        let at = buf.as_mut_ptr() as usize;
        let mine: Vec<u8> = inputs[me].iter().flat_map(|v| v.to_ne_bytes()).collect();
        std::thread::scope(|s| {
            let producer = s.spawn(|| produce(&played[me], at, &mine, 64 << 10, &|| true));
            let r = unsafe {
                x.collective_progressive(
                    Coll::AllReduce,
                    at as *const u8,
                    at as *mut u8,
                    count,
                    DataType::I32,
                    ReduceOp::Sum,
                    Some(played[me].clone()),
                )
            };
            producer.join().unwrap();
            (r, buf)
        })
    });
    for (me, (r, out)) in outs.into_iter().enumerate() {
        let what = format!("all-reduce, rank {me}");
        r.unwrap_or_else(|e| panic!("{what}: {e}"));
        let got: Vec<i32> = out
            .chunks(4)
            .map(|c| i32::from_ne_bytes(c.try_into().unwrap()))
            .collect();
        assert!(got == want, "{what}: wrong sums");
        assert_growing_to(&played[me].finals(), n, &what);
    }
}

#[test]
fn with_local_phases_the_whole_input_comes_first() {
    // Two ranks on host 0: its local phases read the input on the
    // calling thread, so the job waits for all of it; the result is right.
    let mut ranks = world(vec![vec![0, 1], vec![2]], 1, Some(Duration::from_secs(30)));
    let count = 40_001;
    let n = count * 4;
    let data = bytes_of(3, 0, n);
    let played: Vec<Arc<Played>> = (0..3)
        .map(|r| Played::new(n, if r == 0 { 0 } else { n }))
        .collect();
    let outs = on_all(&mut ranks, |x| {
        let me = x.rank();
        let mut buf = vec![0u8; n];
        let at = buf.as_mut_ptr() as usize;
        std::thread::scope(|s| {
            let producer =
                (me == 0).then(|| s.spawn(|| produce(&played[0], at, &data, 32 << 10, &|| true)));
            let r = unsafe {
                x.collective_progressive(
                    Coll::Broadcast { root: 0 },
                    at as *const u8,
                    at as *mut u8,
                    count,
                    DataType::F32,
                    ReduceOp::Sum,
                    Some(played[me].clone()),
                )
            };
            if let Some(h) = producer {
                h.join().unwrap();
            }
            (r, buf)
        })
    });
    for (me, (r, out)) in outs.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {me}: {e}"));
        assert!(out == data, "rank {me}: wrong bytes");
    }
    assert!(
        played[0].waits.load(Ordering::Relaxed) >= 1,
        "the root did not wait for its input"
    );
}
