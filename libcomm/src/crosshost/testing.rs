//! Test support: ranks as threads of this process (loopback TCP between
//! hosts, a [`HostBoard`] within one), deterministic data, and a reference
//! computed independently of the plans (a fold over the ranks in rank order).

use super::layout::Layout;
use super::links::{Exchange, Links};
use super::local::{BoardMover, HostBoard};
use super::runner::CrossHost;
use crate::data::types::{DataType, F8E4M3, F8E5M2, ReduceOp};
use crate::error::Result;
use crate::net::tcp::{TcpConfig, TcpNet};
use half::{bf16, f16};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

pub const SECRET: [u8; 32] = [42; 32];

/// A one-shot all-gather among threads.
pub struct ThreadGather {
    slots: Mutex<Vec<Option<Vec<u8>>>>,
    all: Condvar,
}

impl ThreadGather {
    pub fn new(n: usize) -> Arc<ThreadGather> {
        Arc::new(ThreadGather {
            slots: Mutex::new(vec![None; n]),
            all: Condvar::new(),
        })
    }
}

/// One thread's side of a [`ThreadGather`].
pub struct GatherSide(pub Arc<ThreadGather>, pub usize);

impl Exchange for GatherSide {
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let mut g = self.0.slots.lock().unwrap();
        g[self.1] = Some(mine.to_vec());
        self.0.all.notify_all();
        let t = Instant::now();
        while g.iter().any(Option::is_none) {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "a thread never joined"
            );
            g = self
                .0
                .all
                .wait_timeout(g, Duration::from_millis(50))
                .unwrap()
                .0;
        }
        Ok(g.iter().map(|s| s.clone().unwrap()).collect())
    }
}

/// Ranks as threads, placed on `hosts`, every pair of hosts over loopback
/// TCP with `sockets` per connection.
pub fn world(hosts: Vec<Vec<usize>>, sockets: usize, timeout: Option<Duration>) -> Vec<CrossHost> {
    let layout = Layout::from_hosts(hosts).unwrap();
    let n = layout.n();
    let gather = ThreadGather::new(n);
    let boards: Vec<Arc<HostBoard>> = (0..layout.nhosts())
        .map(|h| HostBoard::new(layout.members(h).len(), Duration::from_secs(60)))
        .collect();
    let mut out: Vec<Option<CrossHost>> = (0..n).map(|_| None).collect();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|me| {
                let (layout, gather) = (layout.clone(), gather.clone());
                let board = boards[layout.host(me)].clone();
                s.spawn(move || {
                    let net = TcpNet::new(TcpConfig::loopback(SECRET, sockets)).unwrap();
                    let peers = layout.remote(me);
                    let deadline = Instant::now() + Duration::from_secs(30);
                    let links =
                        Links::connect(net, &GatherSide(gather, me), me, &peers, deadline).unwrap();
                    let mover = BoardMover {
                        board,
                        me: layout.local(me),
                    };
                    CrossHost::new(layout, links, Box::new(mover), "test", timeout).unwrap()
                })
            })
            .collect();
        for (me, h) in hs.into_iter().enumerate() {
            out[me] = Some(h.join().unwrap());
        }
    });
    out.into_iter().map(Option::unwrap).collect()
}

/// Runs `f` on every rank at once, one thread each.
pub fn on_all<R: Send>(ranks: &mut [CrossHost], f: impl Fn(&mut CrossHost) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let hs: Vec<_> = ranks.iter_mut().map(|r| s.spawn(|| f(r))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// splitmix64.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

pub fn encode(dt: DataType, vals: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(vals.len() * dt.size());
    for &v in vals {
        match dt {
            DataType::I8 => out.extend((v as i8).to_ne_bytes()),
            DataType::U8 => out.extend((v as u8).to_ne_bytes()),
            DataType::I32 => out.extend((v as i32).to_ne_bytes()),
            DataType::U32 => out.extend((v as u32).to_ne_bytes()),
            DataType::I64 => out.extend((v as i64).to_ne_bytes()),
            DataType::U64 => out.extend((v as u64).to_ne_bytes()),
            DataType::F16 => out.extend(f16::from_f64(v).to_ne_bytes()),
            DataType::Bf16 => out.extend(bf16::from_f64(v).to_ne_bytes()),
            DataType::F32 => out.extend((v as f32).to_ne_bytes()),
            DataType::F64 => out.extend(v.to_ne_bytes()),
            DataType::F8E4M3 => out.push(F8E4M3::from_f32(v as f32).0),
            DataType::F8E5M2 => out.push(F8E5M2::from_f32(v as f32).0),
        }
    }
    out
}

pub fn decode(dt: DataType, b: &[u8]) -> Vec<f64> {
    b.chunks(dt.size())
        .map(|c| match dt {
            DataType::I8 => c[0] as i8 as f64,
            DataType::U8 => c[0] as f64,
            DataType::I32 => i32::from_ne_bytes(c.try_into().unwrap()) as f64,
            DataType::U32 => u32::from_ne_bytes(c.try_into().unwrap()) as f64,
            DataType::I64 => i64::from_ne_bytes(c.try_into().unwrap()) as f64,
            DataType::U64 => u64::from_ne_bytes(c.try_into().unwrap()) as f64,
            DataType::F16 => f16::from_ne_bytes(c.try_into().unwrap()).to_f64(),
            DataType::Bf16 => bf16::from_ne_bytes(c.try_into().unwrap()).to_f64(),
            DataType::F32 => f32::from_ne_bytes(c.try_into().unwrap()) as f64,
            DataType::F64 => f64::from_ne_bytes(c.try_into().unwrap()),
            DataType::F8E4M3 => F8E4M3(c[0]).to_f32() as f64,
            DataType::F8E5M2 => F8E5M2(c[0]).to_f32() as f64,
        })
        .collect()
}

/// Rank `r`'s `count` elements for case `seed`: integers anywhere in range
/// (wrapping arithmetic is order-free), floats from a small set whose sums
/// and products are exact in their type whatever the order (halves up to 2,
/// powers of two for products; -1, 0, 1 in fp8, whose sums of at most 9
/// ranks stay exact), so every rank's result must equal the reference bit
/// for bit.
pub fn input(dt: DataType, op: ReduceOp, count: usize, seed: u64, r: usize) -> Vec<u8> {
    if !dt.is_float() {
        return (0..count * dt.size())
            .map(|i| mix(seed ^ mix(r as u64 * 1_000_003 + i as u64)) as u8)
            .collect();
    }
    let set: &[f64] = match (op, dt) {
        (ReduceOp::Prod, DataType::F8E4M3 | DataType::F8E5M2) => &[0.5, 1.0, -1.0],
        (ReduceOp::Prod, _) => &[0.5, 1.0, -1.0, 2.0],
        (_, DataType::F8E4M3 | DataType::F8E5M2) => &[-1.0, 0.0, 1.0],
        _ => &[-2.0, -1.5, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0],
    };
    let vals: Vec<f64> = (0..count)
        .map(|i| set[(mix(seed ^ mix(r as u64 * 7919 + i as u64)) % set.len() as u64) as usize])
        .collect();
    encode(dt, &vals)
}

/// The reduction of every rank's input (`ops[r]`: rank r's op, which may
/// carry its own PreMulSum scalar), folded in rank order.
pub fn reference(dt: DataType, ops: &[ReduceOp], inputs: &[Vec<u8>], count: usize) -> Vec<u8> {
    let scaled: Vec<Vec<u8>> = inputs
        .iter()
        .zip(ops)
        .map(|(x, op)| {
            let mut v = x.clone();
            if let ReduceOp::PreMulSum(s) = op {
                unsafe { crate::data::reduce::scale(dt, v.as_mut_ptr(), x.as_ptr(), count, *s) };
            }
            v
        })
        .collect();
    let mut acc = scaled[0].clone();
    for x in &scaled[1..] {
        let p = acc.as_mut_ptr();
        unsafe { crate::data::reduce::combine(dt, ops[0].combine(), p, p, x.as_ptr(), count) };
    }
    if ops[0] == ReduceOp::Avg {
        unsafe { crate::data::reduce::divide(dt, acc.as_mut_ptr(), count, inputs.len()) };
    }
    acc
}

/// Bit for bit equal (see [`input`]), else the first element that differs.
pub fn assert_matches(dt: DataType, got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if got == want {
        return;
    }
    let (g, w) = (decode(dt, got), decode(dt, want));
    let i = (0..g.len()).find(|&i| {
        got[i * dt.size()..(i + 1) * dt.size()] != want[i * dt.size()..(i + 1) * dt.size()]
    });
    let i = i.expect("some element differs");
    panic!(
        "{what}: element {i} is {}, expected {} (of {} elements)",
        g[i],
        w[i],
        g.len()
    );
}
