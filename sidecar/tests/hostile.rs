//! The sidecar's ports against hostile clients on loopback: slow and
//! silent connections on HTTP, the ranks' socket and the peer port (gRPC
//! and the proxy handshake), garbage on HTTP, a silent client on the
//! ranks' proxy socket. Each test starts its own `weft sidecar` with short
//! timeouts and stops by itself.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const PROXY_PREFACE: &[u8] = b"WEFT-PROXY/1\r\n\r\n\0\0\0\0\0\0\0\0";

struct Sidecar {
    child: Child,
    dir: PathBuf,
    socket: PathBuf,
    http: String,
    peer: String,
    log: Arc<Mutex<String>>,
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Sidecar {
    fn start(name: &str, extra: &[&str]) -> Sidecar {
        let dir = std::env::temp_dir().join(format!("weft-hostile-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("s.sock");
        let mut child = Command::new(env!("CARGO_BIN_EXE_weft"))
            .args([
                "sidecar",
                "--http",
                "127.0.0.1:0",
                "--peer-listen",
                "127.0.0.1:0",
            ])
            .arg("--socket")
            .arg(&socket)
            .args(["--job", "hostile"])
            .args(extra)
            .env("WEFT_JOB_SECRET", "s3cret")
            .env_remove("WEFT_SIDECAR_SOCKET")
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start weft sidecar");
        let log = Arc::new(Mutex::new(String::new()));
        let mut err = child.stderr.take().unwrap();
        let l2 = log.clone();
        std::thread::spawn(move || {
            let mut b = [0u8; 4096];
            while let Ok(n) = err.read(&mut b) {
                if n == 0 {
                    break;
                }
                l2.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&b[..n]));
            }
        });
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
        let line = rx
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| {
                let _ = child.kill();
                panic!("the sidecar did not start: {}", log.lock().unwrap())
            });
        let field = |k: &str| {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(k))
                .unwrap_or("")
                .to_string()
        };
        Sidecar {
            http: field("http="),
            peer: field("peer="),
            child,
            dir,
            socket,
            log,
        }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Whether the sidecar process still runs.
    fn alive(&self) -> bool {
        // SAFETY: signal 0 only checks that the process exists.
        let exists = unsafe { libc::kill(self.child.id() as i32, 0) == 0 };
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id()));
        exists && !stat.unwrap_or_default().contains(") Z ")
    }

    /// The log once it holds `needle` (at most 5 s: its reader is a thread).
    fn log_with(&self, needle: &str) -> String {
        let t = Instant::now();
        while !self.log().contains(needle) && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        self.log()
    }

    /// GET `path` on a fresh connection: status code, body, time taken.
    fn get(&self, path: &str) -> (u16, String, Duration) {
        let t = Instant::now();
        let mut s = TcpStream::connect(&self.http).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut r = String::new();
        let _ = s.read_to_string(&mut r);
        let code = r
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        (code, r, t.elapsed())
    }

    /// The value of `weft_rejected_connections_total{port,reason}` (0 when absent).
    fn rejected(&self, port: &str, reason: &str) -> u64 {
        let (_, m, _) = self.get("/metrics");
        let key =
            format!("weft_rejected_connections_total{{port=\"{port}\",reason=\"{reason}\"}} ");
        m.lines()
            .find_map(|l| l.strip_prefix(&key))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .map_or(0, |v| v as u64)
    }

    /// `weft ras` against this sidecar's socket answers (within 3 s);
    /// `when` says under what, for the failure message.
    fn assert_ras_answers(&self, when: &str) {
        let ras = Command::new(env!("CARGO_BIN_EXE_weft"))
            .args(["ras", "--timeout", "3", "--socket"])
            .arg(&self.socket)
            .output()
            .unwrap();
        assert!(
            ras.status.success(),
            "weft ras {when}: {}",
            String::from_utf8_lossy(&ras.stderr)
        );
    }

    fn threads(&self) -> usize {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        s.lines()
            .find_map(|l| l.strip_prefix("Threads:"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }
}

/// A client that writes `first`, then one byte of `trickle` every `every`
/// (cycling), until the server closes the connection; returns how long
/// after connecting it was closed (`None`: still open at `limit`).
fn trickle<S: Read + Write>(
    mut s: S,
    first: &[u8],
    trickle: &[u8],
    every: Duration,
    limit: Duration,
) -> Option<Duration> {
    let t = Instant::now();
    if s.write_all(first).is_err() {
        return Some(t.elapsed());
    }
    let mut i = 0;
    while t.elapsed() < limit {
        std::thread::sleep(every);
        if !trickle.is_empty() {
            if s.write_all(&trickle[i % trickle.len()..][..1]).is_err() {
                return Some(t.elapsed());
            }
            i += 1;
        }
        // The server closing shows as EOF (or a reset) on a short read.
        let mut b = [0u8; 256];
        loop {
            match s.read(&mut b) {
                Ok(0) => return Some(t.elapsed()),
                Ok(_) => continue, // SETTINGS, a 408...: keep reading
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    break;
                }
                Err(_) => return Some(t.elapsed()),
            }
        }
    }
    None
}

/// N slowloris HTTP connections, N silent HTTP/2 prefaces on the socket and
/// on the peer port, N proxy handshakes at a byte every 300 ms: /healthz
/// answers within 1 s throughout, a rank-side client still gets its status,
/// every attack connection is closed by the handshake timeout (1 s here,
/// plus scheduling slack), the proxy handshakes hold a bounded number of
/// threads, and every kind is counted and logged once per source.
#[test]
fn a_flood_of_slow_and_silent_connections_is_closed_in_time_and_health_answers() {
    const N: usize = 40;
    let sc = Sidecar::start(
        "flood",
        &[
            "--handshake-timeout-ms",
            "1000",
            "--idle-timeout-ms",
            "3000",
            "--max-connections",
            "96",
            "--max-connections-per-source",
            "24",
        ],
    );
    let threads_before = sc.threads();
    let limit = Duration::from_secs(8);
    let every = Duration::from_millis(300);
    let mut attackers = Vec::new();
    for i in 0..N {
        let (http, peer, sock) = (sc.http.clone(), sc.peer.clone(), sc.socket.clone());
        attackers.push(std::thread::spawn(move || {
            let s = TcpStream::connect(&http).unwrap();
            s.set_read_timeout(Some(Duration::from_millis(1))).unwrap();
            (
                "http slowloris",
                trickle(
                    s,
                    b"GET /ras HTTP/1.1\r\n",
                    b"X-Slow: yes\r\n",
                    every,
                    limit,
                ),
            )
        }));
        attackers.push(std::thread::spawn(move || {
            let s = TcpStream::connect(&peer).unwrap();
            s.set_read_timeout(Some(Duration::from_millis(1))).unwrap();
            ("peer h2 preface", trickle(s, H2_PREFACE, b"", every, limit))
        }));
        attackers.push(std::thread::spawn(move || {
            let s = UnixStream::connect(&sock).unwrap();
            s.set_read_timeout(Some(Duration::from_millis(1))).unwrap();
            (
                "socket h2 preface",
                trickle(s, H2_PREFACE, b"", every, limit),
            )
        }));
        if i % 2 == 0 {
            let peer = sc.peer.clone();
            attackers.push(std::thread::spawn(move || {
                let s = TcpStream::connect(&peer).unwrap();
                s.set_read_timeout(Some(Duration::from_millis(1))).unwrap();
                // A length prefix, one byte at a time.
                (
                    "proxy handshake",
                    trickle(s, PROXY_PREFACE, &[0, 0, 0, 200, 1, 2, 3], every, limit),
                )
            }));
        }
    }
    // Meanwhile: health and status answer.
    let t0 = Instant::now();
    let mut max_health = Duration::ZERO;
    let mut max_threads = 0;
    while t0.elapsed() < Duration::from_millis(2500) {
        let (code, body, took) = sc.get("/healthz");
        assert_eq!(code, 200, "{body}");
        max_health = max_health.max(took);
        max_threads = max_threads.max(sc.threads());
        std::thread::sleep(Duration::from_millis(100));
    }
    sc.assert_ras_answers("under the flood");
    eprintln!(
        "slowest /healthz under the flood: {max_health:?}; sidecar threads {threads_before} -> {max_threads}"
    );
    assert!(
        max_health < Duration::from_secs(1),
        "/healthz took {max_health:?}"
    );
    // Proxy handshakes hold a thread each: at most 8 per source here; the
    // runtime may add a few blocking-pool threads on demand (seen: +13 on
    // a loaded 2-core machine). Never one per attacking connection (~140).
    assert!(
        max_threads <= threads_before + 16,
        "threads {threads_before} -> {max_threads}"
    );
    let mut worst = Duration::ZERO;
    for a in attackers {
        let (what, closed) = a.join().unwrap();
        let closed = closed.unwrap_or_else(|| panic!("a {what} connection stayed open {limit:?}"));
        worst = worst.max(closed);
    }
    eprintln!("every attack connection closed, the last after {worst:?}");
    // 1 s handshake timeout; slack for a loaded machine.
    assert!(worst < Duration::from_millis(4000), "{worst:?}");
    let log = sc.log_with("rejected a proxy connection from 127.0.0.1");
    for (port, reason) in [
        ("http", "timeout"),
        ("peer", "timeout"),
        ("socket", "timeout"),
        ("proxy", "timeout"),
    ] {
        assert!(
            sc.rejected(port, reason) > 0,
            "{port}/{reason} counted:\n{log}"
        );
    }
    // More per source than the cap: the oldest were displaced, and counted.
    assert!(
        sc.rejected("http", "evicted") + sc.rejected("proxy", "evicted") > 0,
        "{log}"
    );
    // Logged once per source and kind in 10 s, not once per connection.
    for line in [
        "no complete request header within 1 s",
        "sent the HTTP/2 preface but no SETTINGS within 1 s",
    ] {
        let n = log.matches(line).count();
        assert!((1..=3).contains(&n), "{n} lines with {line:?}:\n{log}");
    }
    assert!(
        log.contains("rejected a proxy connection from 127.0.0.1"),
        "{log}"
    );
    assert_eq!(sc.get("/healthz").0, 200);
}

/// 400 and 431 answers are counted and logged.
#[test]
fn http_garbage_and_oversized_headers_are_counted_and_logged() {
    let sc = Sidecar::start("http400", &[]);
    let mut s = TcpStream::connect(&sc.http).unwrap();
    s.write_all(b"\x16\x03\x01 not http at all\r\n\r\n")
        .unwrap();
    let mut r = String::new();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.read_to_string(&mut r);
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    let mut s = TcpStream::connect(&sc.http).unwrap();
    let _ = write!(
        s,
        "GET /ras HTTP/1.1\r\nX-Big: {}\r\n\r\n",
        "B".repeat(1 << 20)
    );
    let mut r = String::new();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.read_to_string(&mut r);
    assert!(r.starts_with("HTTP/1.1 431"), "{r:.80}");
    assert_eq!(sc.rejected("http", "garbage"), 1);
    assert_eq!(sc.rejected("http", "oversized"), 1);
    sc.log_with("not HTTP/1 (answered 400)");
    let log = sc.log_with("request header too large (answered 431)");
    assert!(
        log.contains(
            "rejected a connection on the HTTP port from 127.0.0.1: not HTTP/1 (answered 400)"
        ),
        "{log}"
    );
    assert!(
        log.contains("request header too large (answered 431)"),
        "{log}"
    );
}

/// A client of the ranks' proxy socket that sends nothing is named as such
/// (it was "Resource temporarily unavailable").
#[test]
fn a_silent_client_of_the_proxy_socket_is_logged_as_silent() {
    let sc = Sidecar::start("silent", &[]);
    let mut proxy = sc.socket.clone().into_os_string();
    proxy.push(".proxy");
    let mut s = UnixStream::connect(&proxy).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let t = Instant::now();
    let mut b = Vec::new();
    let _ = s.read_to_end(&mut b);
    assert!(t.elapsed() < Duration::from_secs(8), "{:?}", t.elapsed());
    let deadline = Instant::now() + Duration::from_secs(2);
    while !sc.log().contains("sent nothing within 5 s") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = sc.log();
    assert!(log.contains("the client sent nothing within 5 s"), "{log}");
    assert!(!log.contains("temporarily unavailable"), "{log}");
    assert_eq!(sc.rejected("proxy-socket", "timeout"), 1);
}

/// A peer request with a wrong secret is logged with its source address
/// (it was "from ?").
#[test]
fn a_wrong_secret_peer_request_is_logged_with_its_address() {
    use weft::rpc;
    let sc = Sidecar::start("peerfrom", &[]);
    let peer = sc.peer.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let code = rt.block_on(async move {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{peer}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut c = rpc::sidecar_client::SidecarClient::new(ch);
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let mut r = tonic::Request::new(rpc::HeartbeatRequest::default());
        let mac = weft::engine::peer_rpc::peer_mac("wrong", "hostile", ts, "0123");
        r.metadata_mut()
            .insert(weft::engine::peer_rpc::AUTH_HEADER, mac.parse().unwrap());
        r.metadata_mut().insert(
            weft::engine::peer_rpc::NONCE_HEADER,
            "0123".parse().unwrap(),
        );
        r.metadata_mut().insert(
            weft::engine::peer_rpc::TS_HEADER,
            ts.to_string().parse().unwrap(),
        );
        c.heartbeat(r).await.map(|_| ()).map_err(|e| e.code())
    });
    assert_eq!(code, Err(tonic::Code::Unauthenticated));
    let log = sc.log_with("rejected a peer request from 127.0.0.1:");
    assert!(
        log.contains("rejected a peer request from 127.0.0.1:"),
        "{log}"
    );
}

/// One HTTP/2 frame.
fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    f.extend_from_slice(&[kind, flags]);
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// An HPACK string literal, raw (lengths under 127).
fn hpack_str(b: &mut Vec<u8>, s: &[u8]) {
    assert!(s.len() < 127);
    b.push(s.len() as u8);
    b.extend_from_slice(s);
}

/// Reads frames until every stream in `streams` has ended: for each, the
/// DATA bytes received, or `Err` naming an RST_STREAM or GOAWAY.
fn h2_responses(s: &mut UnixStream, streams: &[u32]) -> Vec<Result<usize, String>> {
    let mut out: Vec<Option<Result<usize, String>>> = vec![None; streams.len()];
    let mut data = vec![0usize; streams.len()];
    let t = Instant::now();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    while out.iter().any(Option::is_none) {
        assert!(t.elapsed() < Duration::from_secs(10), "no answer: {out:?}");
        let mut h = [0u8; 9];
        s.read_exact(&mut h).expect("a frame");
        let len = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
        let (kind, flags) = (h[3], h[4]);
        let id = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
        let mut p = vec![0u8; len];
        s.read_exact(&mut p).unwrap();
        let i = streams.iter().position(|&x| x == id);
        match (kind, i) {
            (4, _) if flags & 1 == 0 => s.write_all(&h2_frame(4, 1, 0, &[])).unwrap(),
            (6, _) if flags & 1 == 0 => s.write_all(&h2_frame(6, 1, 0, &p)).unwrap(),
            (7, _) => panic!("GOAWAY: {p:?}"),
            (3, Some(i)) => out[i] = Some(Err(format!("RST_STREAM {p:?}"))),
            (0, Some(i)) => data[i] += len,
            (1, Some(i)) if flags & 1 != 0 => out[i] = Some(Ok(data[i])),
            _ => {}
        }
        if let Some(i) = i
            && flags & 1 != 0
            && kind == 0
        {
            out[i] = Some(Ok(data[i]));
        }
    }
    out.into_iter().map(Option::unwrap).collect()
}

/// A gRPC call over the ranks' Unix socket with the `:authority` grpc-core
/// (Python grpcio) sends there, the percent-encoded socket path, and a
/// second call naming it by HPACK index: both are answered. hyper refused
/// every such call with RST_STREAM PROTOCOL_ERROR.
#[test]
fn grpc_over_the_unix_socket_accepts_a_path_as_authority() {
    let sc = Sidecar::start("authority", &[]);
    let mut s = UnixStream::connect(&sc.socket).unwrap();
    let path = sc.socket.to_string_lossy().replace('/', "%2F");
    let mut b1 = vec![0x83, 0x86]; // :method POST, :scheme http
    b1.push(0x44); // :path, indexed
    hpack_str(&mut b1, b"/weft.v1.Sidecar/GetStatus");
    b1.push(0x41); // :authority, indexed
    hpack_str(&mut b1, path.as_bytes());
    b1.push(0x5f); // content-type, indexed
    hpack_str(&mut b1, b"application/grpc");
    b1.push(0x00); // te: trailers, not indexed
    hpack_str(&mut b1, b"te");
    hpack_str(&mut b1, b"trailers");
    // The second call: content-type 62, :authority 63, :path 64.
    let b2 = [
        0x83, 0x86, 0xc0, 0xbf, 0xbe, 0x00, 2, b't', b'e', 8, b't', b'r', b'a', b'i', b'l', b'e',
        b'r', b's',
    ];
    let empty = [0u8, 0, 0, 0, 0]; // an empty StatusRequest
    let req = [
        H2_PREFACE,
        &h2_frame(4, 0, 0, &[]),
        &h2_frame(1, 4, 1, &b1),
        &h2_frame(0, 1, 1, &empty),
        &h2_frame(1, 4, 3, &b2),
        &h2_frame(0, 1, 3, &empty),
    ]
    .concat();
    s.write_all(&req).unwrap();
    let r = h2_responses(&mut s, &[1, 3]);
    for (call, r) in r.iter().enumerate() {
        match r {
            Ok(n) => assert!(*n > 5, "call {call}: an empty answer"),
            Err(e) => panic!("call {call}: {e}\n{}", sc.log()),
        }
    }
}

/// Attaches as a rank would (an authenticated `Hello` on the Attach
/// stream); the stream stays open while the returned guard lives. `Err`:
/// the attach failed.
fn attach(
    rt: &tokio::runtime::Runtime,
    socket: &std::path::Path,
    secret: &str,
) -> Result<impl Send, String> {
    use weft::rpc::{self, rank_message::Msg};
    let (secret, pid) = (secret.to_string(), std::process::id());
    let socket = socket.to_path_buf();
    rt.block_on(async move {
        let fut = async {
            let mut c = weft::client::sidecar(socket)
                .await
                .map_err(|e| e.to_string())?;
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            let hello = rpc::Hello {
                pid,
                hostname: "h".into(),
                job: "hostile".into(),
                auth: weft_agent::auth::hello_mac(&secret, "hostile", pid),
                ..Default::default()
            };
            tx.send(rpc::RankMessage {
                msg: Some(Msg::Hello(hello)),
            })
            .await
            .unwrap();
            let r = c
                .attach(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>((tx, r.into_inner()))
        };
        tokio::time::timeout(Duration::from_secs(5), fut)
            .await
            .map_err(|_| "attach timed out".to_string())?
    })
}

/// The pids of the processes the sidecar holds attached, and whether each is alive.
fn attached(rt: &tokio::runtime::Runtime, socket: &std::path::Path) -> Vec<(u32, String)> {
    let s = rt
        .block_on(async {
            tokio::time::timeout(
                Duration::from_secs(5),
                weft::ras::fetch(socket.to_path_buf()),
            )
            .await
        })
        .expect("status in time")
        .expect("status");
    s.processes
        .iter()
        .map(|p| (p.pid, p.state.clone()))
        .collect()
}

/// Far more silent connections than the caps allow on every port (HTTP,
/// the ranks' socket, the peer port, proxy handshakes), with a handshake
/// timeout long enough that none ends by itself during the test: the
/// sidecar's descriptors stay bounded, /healthz answers within 1 s, `weft
/// ras` answers, an attached rank stays attached and a new one attaches.
/// Every displaced connection is counted and logged. Before the caps, the
/// connections piled up to the fd limit and all of these failed.
#[test]
fn connection_caps_keep_health_ras_and_attach_working_under_a_flood() {
    const FLOOD: usize = 150;
    let sc = Sidecar::start(
        "caps",
        &[
            "--handshake-timeout-ms",
            "30000",
            "--idle-timeout-ms",
            "60000",
            "--max-connections",
            "32",
            "--max-connections-per-source",
            "16",
        ],
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let fds = || {
        std::fs::read_dir(format!("/proc/{}/fd", sc.child.id()))
            .unwrap()
            .count()
    };
    let fds_before = fds();
    let rss0 = rss_kib(sc.child.id());
    // A rank attached before the flood (as this process).
    let first = attach(&rt, &sc.socket, "s3cret").expect("attach before the flood");
    let mut held = Vec::new();
    for _ in 0..FLOOD {
        held.push(Box::new(TcpStream::connect(&sc.http).unwrap()) as Box<dyn Send>);
        let mut u = UnixStream::connect(&sc.socket).unwrap();
        let _ = u.write_all(H2_PREFACE);
        held.push(Box::new(u));
        let mut p = TcpStream::connect(&sc.peer).unwrap();
        let _ = p.write_all(H2_PREFACE);
        held.push(Box::new(p));
        let mut q = TcpStream::connect(&sc.peer).unwrap();
        let _ = q.write_all(PROXY_PREFACE);
        held.push(Box::new(q));
    }
    std::thread::sleep(Duration::from_millis(500));
    let fds_flood = fds();
    let rss = rss_kib(sc.child.id());
    assert!(rss < rss0 + 64 * 1024, "RSS {rss0} KiB -> {rss} KiB");
    for _ in 0..5 {
        let (code, body, took) = sc.get("/healthz");
        assert_eq!(code, 200, "{body}");
        assert!(took < Duration::from_secs(1), "/healthz took {took:?}");
    }
    sc.assert_ras_answers("under the flood");
    // A new rank attaches; the first is still attached and alive.
    let second = attach(&rt, &sc.socket, "wrong").map(|_| ());
    assert!(
        second.as_ref().is_err_and(|e| e.contains("HMAC")),
        "a wrong MAC is still refused: {second:?}"
    );
    let late = attach(&rt, &sc.socket, "s3cret").expect("attach under the flood");
    let procs = attached(&rt, &sc.socket);
    let me = procs
        .iter()
        .filter(|(p, s)| *p == std::process::id() && s == "alive")
        .count();
    assert_eq!(me, 2, "both attaches alive: {procs:?}\n{}", sc.log());
    eprintln!(
        "sidecar descriptors: {fds_before} before, {fds_flood} under {} flood connections",
        held.len()
    );
    // 3 capped ports x 32 and 32 proxy handshakes, each a socket and the
    // duplicate its gate holds to shut it down; the attaches, slack.
    assert!(
        fds_flood <= fds_before + 2 * (3 * 32 + 32) + 16,
        "{fds_before} -> {fds_flood}"
    );
    for port in ["http", "socket", "peer"] {
        assert!(
            sc.rejected(port, "evicted") > 0,
            "{port}/evicted counted\n{}",
            sc.log()
        );
    }
    assert!(
        sc.rejected("proxy", "evicted") + sc.rejected("proxy", "cap") > 0,
        "{}",
        sc.log()
    );
    let log = sc.log_with("closed it for a newer one");
    assert!(
        log.contains("closed it for a newer one: too many connections (cap 16 per source)"),
        "{log}"
    );
    // Rate-limited: far fewer lines than displaced connections.
    let lines = log.matches("closed it for a newer one").count();
    assert!(lines <= 12, "{lines} lines:\n{log}");
    // The attach streams end inside the runtime.
    let _guard = rt.enter();
    drop((first, late, held));
}

/// An HTTP/2 client that completes the opening (preface and SETTINGS) and
/// then never answers: the gRPC server's keepalive ping goes unanswered and
/// the connection is closed (idle 1 s + at most 1 s for the answer), on the
/// socket and on the peer port. Such connections stayed open indefinitely.
#[test]
fn a_silent_http2_connection_is_closed_by_keepalive() {
    let sc = Sidecar::start("keepalive", &["--idle-timeout-ms", "1000"]);
    let opening = [H2_PREFACE, &h2_frame(4, 0, 0, &[])].concat();
    let limit = Duration::from_secs(10);
    let every = Duration::from_millis(100);
    let u = UnixStream::connect(&sc.socket).unwrap();
    u.set_read_timeout(Some(Duration::from_millis(1))).unwrap();
    let t = TcpStream::connect(&sc.peer).unwrap();
    t.set_read_timeout(Some(Duration::from_millis(1))).unwrap();
    let o2 = opening.clone();
    let peer = std::thread::spawn(move || trickle(t, &o2, b"", every, limit));
    let socket = trickle(u, &opening, b"", every, limit);
    let peer = peer.join().unwrap();
    for (what, closed) in [("socket", socket), ("peer port", peer)] {
        let closed = closed.unwrap_or_else(|| panic!("{what}: still open after {limit:?}"));
        assert!(
            closed < Duration::from_secs(5),
            "{what}: closed after {closed:?}"
        );
        assert!(
            closed >= Duration::from_millis(900),
            "{what}: closed after {closed:?}"
        );
    }
    assert_eq!(sc.get("/healthz").0, 200);
}

/// A small deterministic generator (xorshift64*), so a failure replays.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// `seed` with a few bytes flipped, cut or extended with random ones.
    fn mutate(&mut self, seed: &[u8]) -> Vec<u8> {
        let mut v = seed.to_vec();
        for _ in 0..1 + self.below(4) {
            match self.below(4) {
                0 if !v.is_empty() => {
                    let i = self.below(v.len());
                    v[i] ^= self.next() as u8 | 1;
                }
                1 => v.truncate(self.below(v.len() + 1)),
                _ => v.extend((0..self.below(64)).map(|_| self.next() as u8)),
            }
        }
        v
    }
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// Random and mutated openings (HTTP/1 requests, HTTP/2 openings and
/// header frames, proxy handshakes, plain noise) on every port of a live
/// sidecar, a fixed number of each with a fixed seed: the sidecar neither
/// panics nor grows (RSS within 64 MiB of where it started), answers
/// /healthz and `weft ras` after, and counts what it refused.
#[test]
fn mutated_openings_on_every_port_leave_the_sidecar_serving() {
    const CASES: usize = 300;
    let sc = Sidecar::start("fuzz", &["--handshake-timeout-ms", "300"]);
    let rss0 = rss_kib(sc.child.id());
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let settings = h2_frame(4, 0, 0, &[0, 3, 0, 0, 0, 100]);
    let mut headers = vec![0x83, 0x86, 0x44, 26];
    headers.extend_from_slice(b"/weft.v1.Sidecar/GetStatus");
    headers.extend_from_slice(&[0x41, 9]);
    headers.extend_from_slice(b"localhost");
    let h2_call = [
        H2_PREFACE,
        &settings,
        &h2_frame(1, 4, 1, &headers),
        &h2_frame(0, 1, 1, &[0, 0, 0, 0, 0]),
    ]
    .concat();
    let http = b"GET /ras HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_vec();
    let proxy = [PROXY_PREFACE, &[0, 0, 0, 12], b"hello-proxy!"].concat();
    let seeds: [&[u8]; 4] = [&h2_call, &http, &proxy, b""];
    let t = Instant::now();
    let mut conns = 0;
    for i in 0..CASES {
        let seed = seeds[i % seeds.len()];
        let data = if seed.is_empty() {
            (0..rng.below(512)).map(|_| rng.next() as u8).collect()
        } else {
            rng.mutate(seed)
        };
        // The HTTP/2 and proxy openings go to the socket and the peer
        // port, HTTP/1 to the HTTP port; noise everywhere.
        let targets: &[u8] = match i % seeds.len() {
            0 | 2 => &[1, 2],
            1 => &[0],
            _ => &[0, 1, 2],
        };
        for &to in targets {
            let r = match to {
                0 => TcpStream::connect(&sc.http).map(|s| Box::new(s) as Box<dyn RW>),
                1 => UnixStream::connect(&sc.socket).map(|s| Box::new(s) as Box<dyn RW>),
                _ => TcpStream::connect(&sc.peer).map(|s| Box::new(s) as Box<dyn RW>),
            };
            let mut s = r.expect("connect");
            conns += 1;
            let _ = s.write_all(&data);
            // Read whatever comes back, briefly; the server may also close.
            let _ = s.set_timeout(Duration::from_millis(20));
            let mut b = [0u8; 4096];
            let _ = s.read(&mut b);
        }
    }
    eprintln!("{conns} mutated connections in {:?}", t.elapsed());
    // Let the handshake timeout end the rest.
    std::thread::sleep(Duration::from_millis(600));
    assert!(sc.alive(), "the sidecar died:\n{}", sc.log());
    let (code, body, took) = sc.get("/healthz");
    assert_eq!(code, 200, "{body}");
    assert!(took < Duration::from_secs(1), "{took:?}");
    sc.assert_ras_answers("after the mutated openings");
    let rss = rss_kib(sc.child.id());
    eprintln!("sidecar RSS {rss0} KiB -> {rss} KiB");
    assert!(rss < rss0 + 64 * 1024, "RSS {rss0} KiB -> {rss} KiB");
    let log = sc.log();
    assert!(!log.contains("panicked"), "{log}");
    let refused: u64 = ["http", "socket", "peer", "proxy"]
        .iter()
        .flat_map(|p| {
            ["garbage", "short", "timeout", "oversized", "auth"].map(|r| sc.rejected(p, r))
        })
        .sum();
    assert!(
        refused > CASES as u64 / 4,
        "{refused} refusals counted\n{log}"
    );
}

/// Either kind of stream, for the fuzz test.
trait RW: Read + Write {
    fn set_timeout(&self, d: Duration) -> std::io::Result<()>;
}

impl RW for TcpStream {
    fn set_timeout(&self, d: Duration) -> std::io::Result<()> {
        self.set_read_timeout(Some(d))
    }
}

impl RW for UnixStream {
    fn set_timeout(&self, d: Duration) -> std::io::Result<()> {
        self.set_read_timeout(Some(d))
    }
}

/// A proxy handshake that sends a byte every 300 ms (each read well within
/// any per-read limit) is ended by one deadline from accept (1 s here),
/// counted and logged with its source. The limit was 5 s per read, so 200
/// such clients held 200 threads for a minute.
#[test]
fn a_trickled_proxy_handshake_ends_at_one_deadline() {
    let sc = Sidecar::start("trickle", &["--handshake-timeout-ms", "1000"]);
    let s = TcpStream::connect(&sc.peer).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(1))).unwrap();
    // A Hello's length prefix (200 bytes), then its bytes one at a time.
    let mut trickled = vec![0, 0, 0, 200];
    trickled.extend(std::iter::repeat_n(7u8, 200));
    let closed = trickle(
        s,
        PROXY_PREFACE,
        &trickled,
        Duration::from_millis(300),
        Duration::from_secs(8),
    )
    .expect("still open after 8 s");
    assert!(
        closed >= Duration::from_millis(900) && closed < Duration::from_secs(3),
        "closed after {closed:?}"
    );
    let log = sc.log_with("rejected a proxy connection from 127.0.0.1");
    assert!(log.contains("timed out"), "{log}");
    assert_eq!(sc.rejected("proxy", "timeout"), 1, "{log}");
}
