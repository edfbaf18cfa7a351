//! Issue 19 (1): the operator binary against a minimal fake API server
//! that holds one CollectiveJob the operator cannot decode and never answers
//! watches. The operator must still become ready (its watch works: the bad
//! job is skipped, not fatal) and must exit promptly on SIGTERM, within its
//! shutdown timeout, whatever is still pending.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

const BAD_JOB: &str = r#"{"apiVersion":"weft.dev/v1alpha1","kind":"CollectiveJob",
 "metadata":{"name":"bad","namespace":"ml","uid":"u1","resourceVersion":"5","generation":1},
 "spec":{"template":{"spec":{"containers":[{"name":"main","image":"busybox","command":"sleep 1"}]}}}}"#;

/// Answers one connection's requests until it closes. Watches are held open.
fn serve(stream: TcpStream) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut out = stream;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let target = line.split_whitespace().nth(1).unwrap_or("").to_string();
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
        if target.contains("watch=true") {
            // A watch: never answered, as a frozen connection.
            std::thread::sleep(Duration::from_secs(120));
            return;
        }
        let (path, _) = target.split_once('?').unwrap_or((&target, ""));
        let reply = if path.ends_with("/collectivejobs") {
            format!(
                r#"{{"apiVersion":"weft.dev/v1alpha1","kind":"CollectiveJobList","metadata":{{"resourceVersion":"7"}},"items":[{BAD_JOB}]}}"#
            )
        } else if path.ends_with('s') && !path.contains("/events") {
            r#"{"apiVersion":"v1","kind":"List","metadata":{"resourceVersion":"7"},"items":[]}"#
                .to_string()
        } else {
            "{}".to_string()
        };
        let resp = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{reply}",
            reply.len()
        );
        if out.write_all(resp.as_bytes()).is_err() {
            return;
        }
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn http_get(port: u16, path: &str) -> Option<String> {
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

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn ready_despite_an_undecodable_job_and_exits_on_sigterm() {
    let api = TcpListener::bind("127.0.0.1:0").unwrap();
    let api_port = api.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for s in api.incoming().flatten() {
            std::thread::spawn(move || serve(s));
        }
    });
    let dir = std::env::temp_dir().join(format!("weft-sigterm-{}", std::process::id()));
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
    let log_path = dir.join("operator.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_weft-operator"))
        .args([
            "run",
            "--leader-elect",
            "false",
            "--log-json",
            "false",
            "--shutdown-timeout-secs",
            "3",
            "--http-addr",
            &format!("127.0.0.1:{http_port}"),
        ])
        .env("KUBECONFIG", &kubeconfig)
        .env("WEFT_LOG", "info")
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let mut child = Kill(child);

    let start = Instant::now();
    let mut last = String::new();
    loop {
        if let Some(r) = http_get(http_port, "/readyz") {
            if r.starts_with("HTTP/1.1 200") {
                break;
            }
            last = r;
        }
        if let Ok(Some(status)) = child.0.try_wait() {
            let err = std::fs::read_to_string(&log_path).unwrap();
            panic!("operator exited early ({status}):\n{err}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "operator never became ready: {last}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    let pid = child.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let term = Instant::now();
    loop {
        if child.0.try_wait().unwrap().is_some() {
            break;
        }
        assert!(
            term.elapsed() < Duration::from_secs(10),
            "operator still running 10 s after SIGTERM (shutdown timeout 3 s)"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let err = std::fs::read_to_string(&log_path).unwrap();
    assert!(err.contains("SIGTERM received"), "{err}");
    assert!(
        err.contains("cannot decode a CollectiveJob"),
        "the bad job is reported, not fatal:\n{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
