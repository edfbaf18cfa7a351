//! Fuzz-style tests of every decoder of bytes that come from outside: the
//! bootstrap frame reader (incremental and blocking), the hello, the table,
//! the peer endpoint's connect, the unique id (`ncclUniqueId` bytes and the
//! `NCCL_COMM_ID` address), the proxy open of the sidecar link. Random and
//! mutated inputs, seeded (`WEFT_TEST_SEED` reproduces a run), a fixed
//! number of cases under a time cap, on stable Rust. Each case must end in
//! a value or a typed error: no panic, and no allocation beyond a bound
//! proportional to the input (a claimed length allocates nothing by itself).

use crate::bootstrap::unique_id::UniqueId;
use crate::bootstrap::wire::{self, Dec, FrameBuf, Kind};
use crate::bootstrap::{Hello, PeerInfo, decode_table, encode_table, server};
use crate::transport::tcp::{ConnectMsg, FailMsg};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::{Duration, Instant};

/// Records the largest single allocation of the current thread while armed.
struct Tracking;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = ARMED.try_with(|a| {
        if a.get() {
            let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
        }
    });
}

unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        note(l.size());
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        note(l.size());
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        note(new);
        unsafe { System.realloc(p, l, new) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static ALLOC: Tracking = Tracking;

/// Runs `f` and returns the largest single allocation it made.
fn largest_alloc<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|l| l.set(0));
    ARMED.with(|a| a.set(true));
    let r = f();
    ARMED.with(|a| a.set(false));
    (r, LARGEST.with(|l| l.get()))
}

/// Allocation allowed for decoding `n` input bytes: proportional to the
/// input, plus a constant (error messages, small fixed reservations).
fn bound(n: usize) -> usize {
    8 * n + (128 << 10)
}

struct Rng(u64);

impl Rng {
    fn seeded(salt: u64) -> Rng {
        let seed = weft_contract::params::WEFT_TEST_SEED
            .raw()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0x00c0_ffee_u64);
        eprintln!("fuzz seed {seed} (rerun with WEFT_TEST_SEED={seed})");
        Rng((seed ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// A mutation of `v`: flipped bits, overwritten bytes and lengths,
    /// truncation, extension, splices.
    fn mutate(&mut self, v: &[u8]) -> Vec<u8> {
        let mut m = v.to_vec();
        for _ in 0..1 + self.below(4) {
            match self.below(7) {
                0 if !m.is_empty() => {
                    let i = self.below(m.len());
                    m[i] ^= 1 << self.below(8);
                }
                1 if !m.is_empty() => {
                    let i = self.below(m.len());
                    m[i] = self.next() as u8;
                }
                2 => m.truncate(self.below(m.len() + 1)),
                3 => {
                    let k = self.below(64);
                    let extra = self.bytes(k);
                    m.extend_from_slice(&extra);
                }
                4 if m.len() >= 4 => {
                    // A length-like field: all ones, or a large number.
                    let i = self.below(m.len() - 3);
                    let v = if self.below(2) == 0 {
                        u32::MAX
                    } else {
                        self.next() as u32
                    };
                    m[i..i + 4].copy_from_slice(&v.to_be_bytes());
                }
                5 if m.len() >= 2 => {
                    let i = self.below(m.len() - 1);
                    m[i..i + 2].copy_from_slice(&[0xff, 0xff]);
                }
                _ => {
                    let at = self.below(m.len() + 1);
                    let k = self.below(8);
                    let ins = self.bytes(k);
                    m.splice(at..at, ins);
                }
            }
        }
        m
    }
    /// Random bytes or a mutation of one of the seeds.
    fn input(&mut self, seeds: &[Vec<u8>]) -> Vec<u8> {
        if self.below(4) == 0 || seeds.is_empty() {
            let n = self.below(512);
            self.bytes(n)
        } else {
            let s = &seeds[self.below(seeds.len())];
            self.mutate(s)
        }
    }
}

/// Runs `cases` cases of `f` (or until the time cap): each must not panic
/// and must stay within [`bound`].
fn fuzz(name: &str, salt: u64, cases: usize, mut f: impl FnMut(&mut Rng) -> usize) {
    let mut rng = Rng::seeded(salt);
    let start = Instant::now();
    let cap = start + Duration::from_secs(20);
    let mut done = 0;
    while done < cases && Instant::now() < cap {
        f(&mut rng);
        done += 1;
    }
    eprintln!("{name}: {done} cases in {:?}", start.elapsed());
    assert!(
        done >= cases / 10,
        "{name}: only {done} cases in the time cap"
    );
}

fn check_alloc(what: &str, input: &[u8], largest: usize) {
    assert!(
        largest <= bound(input.len()),
        "{what}: {} input bytes made an allocation of {largest} bytes",
        input.len()
    );
}

fn peer(i: u32) -> PeerInfo {
    PeerInfo {
        host_id: 0x1234_5678 + i as u64,
        pid: 1000 + i,
        addr: ([10, 0, 0, i as u8], 7000 + i as u16).into(),
        hostname: format!("host-{i}"),
        proxied: i.is_multiple_of(2),
    }
}

fn frame_seeds() -> Vec<Vec<u8>> {
    let secret = [3u8; 32];
    let hello = Hello {
        nonce: [1; 16],
        client_nonce: [2; 16],
        rank: 3,
        nranks: 8,
        info: peer(3),
    };
    let connect = ConnectMsg {
        comm: [9; 16],
        src: 1,
        dst: 2,
        client_nonce: [4; 16],
    };
    vec![
        wire::encode(Kind::Challenge, &[5; 16], &[0; 32], b""),
        wire::encode(Kind::Hello, &hello.encode(), &secret, &[6; 16]),
        wire::encode(Kind::Connect, &connect.encode(), &secret, &[6; 16]),
        wire::encode(
            Kind::Table,
            &encode_table(&[7; 16], &[peer(0), peer(1)]),
            &secret,
            &[2; 16],
        ),
        wire::encode(Kind::Accept, &[], &secret, &[2; 16]),
        wire::encode(Kind::Error, b"no", &[0; 32], b""),
    ]
}

/// The incremental reader of the accept loop, fed in random pieces with
/// the pre-authentication bound: a frame, nothing yet, or an error; and
/// never more buffered than was fed.
#[test]
fn fuzz_bootstrap_frames_incremental() {
    let seeds = frame_seeds();
    fuzz("FrameBuf", 1, 200_000, |rng| {
        let input = rng.input(&seeds);
        let max = if rng.below(2) == 0 {
            server::MAX_PREAUTH_PAYLOAD
        } else {
            wire::MAX_PAYLOAD
        };
        let pieces: Vec<usize> = (0..4).map(|_| rng.below(input.len() + 1)).collect();
        let (_, largest) = largest_alloc(|| {
            let mut fb = FrameBuf::default();
            let mut at = 0;
            let mut cuts = pieces.clone();
            cuts.sort();
            cuts.push(input.len());
            for cut in cuts {
                if fb.need(max).is_err() {
                    break;
                }
                fb.extend(&input[at..cut.max(at)]);
                at = cut.max(at);
                match fb.take(max) {
                    Ok(Some(f)) => {
                        assert!(f.payload.len() <= max);
                        assert!(f.verify(&[0xaa; 32], b"challenge").is_err());
                    }
                    Ok(None) => {}
                    Err(e) => {
                        assert!(matches!(e, crate::Error::Bootstrap(_)), "{e:?}");
                        break;
                    }
                }
            }
        });
        check_alloc("FrameBuf", &input, largest);
        0
    });
}

/// The blocking reader (ranks reading a challenge, a table, an accept):
/// random and mutated bytes over a socket end in a frame or a typed error
/// before the deadline, allocating at most the reader's bound.
#[test]
fn fuzz_bootstrap_frames_blocking() {
    use std::io::Write;
    let seeds = frame_seeds();
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    fuzz("read_frame", 2, 2_000, |rng| {
        let input = rng.input(&seeds);
        let mut a = std::net::TcpStream::connect(addr).unwrap();
        let mut b = l.accept().unwrap().0;
        a.write_all(&input).unwrap();
        drop(a);
        let max = 1024;
        let t = Instant::now();
        let (r, largest) = largest_alloc(|| {
            wire::read_frame(&mut b, max, Instant::now() + Duration::from_secs(2))
        });
        assert!(t.elapsed() < Duration::from_secs(3));
        if let Err(e) = r {
            assert!(matches!(e, crate::Error::Bootstrap(_)), "{e:?}");
        }
        assert!(largest <= bound(max), "read_frame allocated {largest}");
        0
    });
}

/// Payload decoders: hello, table (with any expected size), connect, a
/// peer's info.
#[test]
fn fuzz_bootstrap_payloads() {
    let hello = Hello {
        nonce: [1; 16],
        client_nonce: [2; 16],
        rank: 0,
        nranks: 2,
        info: peer(0),
    }
    .encode();
    let table = encode_table(&[7; 16], &[peer(0), peer(1), peer(2)]);
    let connect = ConnectMsg {
        comm: [9; 16],
        src: 0,
        dst: 1,
        client_nonce: [4; 16],
    }
    .encode();
    let fail = FailMsg {
        comm: [9; 16],
        origin: 3,
        kind: 1,
        reason: "rank 2 (pid 7, this host) exited".into(),
    }
    .encode();
    let seeds = vec![hello, table, connect, fail];
    fuzz("payloads", 3, 200_000, |rng| {
        let input = rng.input(&seeds);
        let expect = match rng.below(3) {
            0 => rng.below(8),
            1 => 1 << 16,
            _ => rng.next() as u32 as usize,
        };
        let (_, largest) = largest_alloc(|| {
            let _ = Hello::decode(&input);
            let _ = decode_table(&input, expect);
            let _ = ConnectMsg::decode(&input);
            let _ = FailMsg::decode(&input);
            let _ = PeerInfo::decode(&mut Dec::new(&input, "fuzz"));
        });
        check_alloc("bootstrap payloads", &input, largest);
        0
    });
    // A table that claims a huge count reserves nothing for it.
    let mut claim = encode_table(&[7; 16], &[]);
    claim[16..20].copy_from_slice(&u32::MAX.to_be_bytes());
    let (r, largest) = largest_alloc(|| decode_table(&claim, u32::MAX as usize));
    assert!(r.is_err());
    check_alloc("huge table claim", &claim, largest);
}

/// `ncclUniqueId` bytes: random, mutated (every field), wrong lengths.
#[test]
fn fuzz_unique_id_bytes() {
    let id = UniqueId::from_parts("127.0.0.1:29500", "job", "0", Some("s"), Duration::ZERO)
        .unwrap()
        .to_bytes()
        .to_vec();
    let seeds = vec![id.clone()];
    fuzz("UniqueId::from_bytes", 4, 200_000, |rng| {
        let input = if rng.below(3) == 0 {
            // Same length, a few bytes changed: must be refused (checksum).
            let mut m = id.clone();
            let i = rng.below(m.len());
            m[i] ^= 1 + rng.below(255) as u8;
            m
        } else {
            rng.input(&seeds)
        };
        let (r, largest) = largest_alloc(|| UniqueId::from_bytes(&input));
        match r {
            Ok(back) => assert_eq!(back.to_bytes().to_vec(), input),
            Err(e) => assert!(matches!(e, crate::Error::InvalidArgument(_)), "{e:?}"),
        }
        check_alloc("UniqueId::from_bytes", &input, largest);
        0
    });
}

/// `NCCL_COMM_ID` / `WEFT_BOOTSTRAP` addresses: mutations of numeric
/// `host:port` forms (no name lookups: only digits and punctuation).
#[test]
fn fuzz_comm_id_address() {
    const CHARS: &[u8] = b"0123456789.:[]%/ -";
    let seeds: Vec<Vec<u8>> = [
        "127.0.0.1:29500",
        "[::1]:7000",
        "10.1.2.3:1",
        "0.0.0.0:65535",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    fuzz("comm id address", 5, 20_000, |rng| {
        let raw = rng.input(&seeds);
        let addr: String = raw
            .iter()
            .map(|b| CHARS[*b as usize % CHARS.len()] as char)
            .take(64)
            .collect();
        let ((r, took), largest) = largest_alloc(|| {
            let t = Instant::now();
            let r = UniqueId::from_parts(&addr, "job", "0", Some("s"), Duration::ZERO);
            (r, t.elapsed())
        });
        assert!(took < Duration::from_secs(2), "'{addr}' took {took:?}");
        if let Err(e) = r {
            assert!(matches!(e, crate::Error::InvalidArgument(_)), "{e:?}");
        }
        check_alloc("comm id address", addr.as_bytes(), largest);
        0
    });
}

/// The proxy open message and frame header of the sidecar link (decoded
/// by the sidecar from ranks).
#[test]
fn fuzz_sidecar_link_open() {
    use crate::transport::sidecar_link::{HEADER, OpenMsg, ProxyPeer, decode_header};
    let open = OpenMsg {
        job: "job".into(),
        comm: [1; 16],
        rank: 0,
        nranks: 3,
        pid: 42,
        ring_cap: 1 << 16,
        addr: ([10, 0, 0, 1], 7000).into(),
        peers: vec![
            ProxyPeer {
                rank: 1,
                addr: ([10, 0, 0, 2], 7000).into(),
                host: "b".into(),
            },
            ProxyPeer {
                rank: 2,
                addr: ([10, 0, 0, 3], 7000).into(),
                host: "c".into(),
            },
        ],
    }
    .encode();
    let seeds = vec![open];
    fuzz("proxy open", 6, 200_000, |rng| {
        let input = rng.input(&seeds);
        let (_, largest) = largest_alloc(|| {
            let _ = OpenMsg::decode(&input);
            if input.len() >= HEADER {
                let _ = decode_header(input[..HEADER].try_into().unwrap());
            }
        });
        check_alloc("proxy open", &input, largest);
        0
    });
}

/// A live accept loop fed random and mutated first frames by many clients
/// at once: every connection is settled (handled, refused or dropped),
/// none is handed over unless its frame is complete, and the loop keeps
/// answering.
#[test]
fn fuzz_accept_loop() {
    use std::io::{Read, Write};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    static COUNTERS: server::Counters = server::Counters::new();
    struct H {
        frames: Arc<AtomicU64>,
        stop: Arc<AtomicBool>,
    }
    impl server::Handler for H {
        fn on_frame(&mut self, a: server::Accepted) {
            assert!(a.frame.payload.len() <= server::MAX_PREAUTH_PAYLOAD);
            self.frames.fetch_add(1, Ordering::Relaxed);
            server::reject(a.stream, a.peer, "fuzz", "handled");
        }
        fn tick(&mut self) -> bool {
            self.stop.load(Ordering::Relaxed)
        }
    }
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let frames = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut h = H {
        frames: frames.clone(),
        stop: stop.clone(),
    };
    let limits = server::Limits {
        handshake_timeout: Duration::from_millis(500),
        ..server::Limits::new(Duration::ZERO)
    };
    let t = std::thread::spawn(move || server::serve(l, "fuzz", limits, &COUNTERS, &mut h));
    let seeds = frame_seeds();
    let mut rng = Rng::seeded(7);
    let start = Instant::now();
    let mut open = Vec::new();
    for i in 0..400 {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let input = rng.input(&seeds);
        let _ = s.write_all(&input);
        if i % 3 == 0 {
            open.push(s); // left open: complete, incomplete or silent
        }
    }
    // Every connection gets its answer (or is closed) within the deadline.
    for mut s in open {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let r = s.read_to_end(&mut Vec::new());
        assert!(
            !matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "a connection was neither answered nor closed"
        );
    }
    // And a well-formed client is still served.
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let ch = wire::read_frame(&mut s, 64, Instant::now() + Duration::from_secs(5)).unwrap();
    assert_eq!(ch.kind, Kind::Challenge);
    let before = frames.load(Ordering::Relaxed);
    s.write_all(&wire::encode(Kind::Hello, b"x", &[1; 32], &ch.payload))
        .unwrap();
    let t0 = Instant::now();
    while frames.load(Ordering::Relaxed) == before {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "loop stopped serving"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    stop.store(true, Ordering::Relaxed);
    t.join().unwrap();
    assert!(start.elapsed() < Duration::from_secs(30));
    assert!(COUNTERS.accepted.load(Ordering::Relaxed) >= 401);
}
