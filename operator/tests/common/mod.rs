//! The operator binary against a minimal fake API server: a plain HTTP/1.1
//! server whose answers a test decides, a kubeconfig pointing at it, and the
//! operator process with its log in a file.

// Each test binary that includes this module uses only part of it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One request to the fake API server.
pub struct Request {
    pub method: String,
    /// Path and query.
    pub target: String,
    pub body: Vec<u8>,
}

impl Request {
    pub fn path(&self) -> &str {
        self.target.split_once('?').map_or(&self.target, |(p, _)| p)
    }
    pub fn is_watch(&self) -> bool {
        self.target.contains("watch=true")
    }
}

pub enum Reply {
    /// Status code and JSON body.
    Json(u16, String),
    /// Never answered (a watch, or a frozen connection).
    Hold,
}

/// An empty list, as any list of a kind the tests do not care about.
pub fn empty_list() -> Reply {
    Reply::Json(
        200,
        r#"{"apiVersion":"v1","kind":"List","metadata":{"resourceVersion":"7"},"items":[]}"#.into(),
    )
}

/// A Kubernetes `Status` error.
pub fn status(code: u16, reason: &str, message: &str) -> Reply {
    Reply::Json(
        code,
        format!(
            r#"{{"kind":"Status","apiVersion":"v1","metadata":{{}},"status":"Failure","message":"{message}","reason":"{reason}","code":{code}}}"#
        ),
    )
}

type Handler = Arc<dyn Fn(&Request) -> Reply + Send + Sync>;

/// Starts the server; returns its port.
pub fn start_api(handler: impl Fn(&Request) -> Reply + Send + Sync + 'static) -> u16 {
    let api = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = api.local_addr().unwrap().port();
    let handler: Handler = Arc::new(handler);
    std::thread::spawn(move || {
        for s in api.incoming().flatten() {
            let h = handler.clone();
            std::thread::spawn(move || serve(s, h));
        }
    });
    port
}

/// Answers one connection's requests until it closes.
fn serve(stream: TcpStream, handler: Handler) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut out = stream;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut words = line.split_whitespace();
        let method = words.next().unwrap_or("").to_string();
        let target = words.next().unwrap_or("").to_string();
        let mut len = 0usize;
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            if h == "\r\n" {
                break;
            }
            if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0; len];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        let request = Request {
            method,
            target,
            body,
        };
        let (code, reply) = match handler(&request) {
            Reply::Json(code, body) => (code, body),
            Reply::Hold => {
                std::thread::sleep(Duration::from_secs(120));
                return;
            }
        };
        let resp = format!(
            "HTTP/1.1 {code} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{reply}",
            reply.len()
        );
        if out.write_all(resp.as_bytes()).is_err() {
            return;
        }
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

/// The operator process; killed when dropped.
pub struct Operator {
    child: Child,
    pub http_port: u16,
    dir: PathBuf,
}

impl Operator {
    /// Starts `weft-operator run ARGS` against the API server on `api_port`,
    /// in namespace `ml`, logging to a file.
    pub fn start(test: &str, api_port: u16, args: &[&str]) -> Operator {
        let dir = std::env::temp_dir().join(format!("weft-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let kubeconfig = dir.join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters: [{{name: c, cluster: {{server: \"http://127.0.0.1:{api_port}\"}}}}]\n\
                 users: [{{name: u, user: {{token: t}}}}]\n\
                 contexts: [{{name: c, context: {{cluster: c, user: u, namespace: ml}}}}]\ncurrent-context: c\n"
            ),
        )
        .unwrap();
        let http_port = free_port();
        // The operator logs to stdout; both streams go to one file.
        let log = std::fs::File::create(dir.join("operator.log")).unwrap();
        let http_addr = format!("127.0.0.1:{http_port}");
        let child = Command::new(env!("CARGO_BIN_EXE_weft-operator"))
            .arg("run")
            .args(args)
            .args(["--log-json", "false", "--http-addr", &http_addr])
            .env("KUBECONFIG", &kubeconfig)
            .env("WEFT_LOG", "info")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        Operator {
            child,
            http_port,
            dir,
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("operator.log")).unwrap_or_default()
    }

    /// Waits until `/readyz` answers 200.
    pub fn wait_ready(&mut self, limit: Duration) {
        let start = Instant::now();
        let mut last = String::new();
        loop {
            if let Some(r) = http_get(self.http_port, "/readyz") {
                if r.starts_with("HTTP/1.1 200") {
                    return;
                }
                last = r;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("operator exited early ({status}):\n{}", self.log());
            }
            assert!(
                start.elapsed() < limit,
                "operator never became ready: {last}\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn sigterm(&self) {
        let pid = self.child.id().to_string();
        assert!(
            Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .unwrap()
                .success()
        );
    }

    /// Waits for the process to exit; panics after `limit`.
    pub fn wait_exit(&mut self, limit: Duration, what: &str) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                start.elapsed() < limit,
                "operator still running {limit:?} after {what}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
