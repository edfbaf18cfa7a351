//! A `weft sidecar` process for tests: started with a job name and secret,
//! its socket in a private temp dir, killed (with its process group) on drop.

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub struct Sidecar {
    pub child: Child,
    pub socket: PathBuf,
    pub http: String,
    /// The peer port's address (empty without --peer-listen).
    pub peer: String,
    pub job: String,
    pub secret: String,
    pub dir: PathBuf,
    log: Arc<Mutex<String>>,
}

static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl Sidecar {
    /// Starts `weft-cli sidecar` and waits (bounded) for its ready line.
    pub fn start(cli: &Path, env: &[(&str, &str)]) -> Sidecar {
        Self::start_with(cli, None, &[], env, None)
    }

    /// Starts one inside network namespace `netns` (with `ip netns exec`,
    /// which execs: the child is the sidecar itself), with extra arguments.
    pub fn start_with(
        cli: &Path,
        netns: Option<&str>,
        extra: &[String],
        env: &[(&str, &str)],
        same_job_as: Option<&Sidecar>,
    ) -> Sidecar {
        let (job, secret) = match same_job_as {
            Some(o) => (o.job.clone(), o.secret.clone()),
            None => (
                format!(
                    "sc{}x{}",
                    std::process::id(),
                    N.load(std::sync::atomic::Ordering::Relaxed)
                ),
                weft::launch::env::fresh_secret().expect("randomness"),
            ),
        };
        Self::start_in_job(cli, netns, extra, env, &job, &secret)
    }

    /// Starts one of job `job` with secret `secret` (as [`start_with`](Self::start_with)).
    pub fn start_in_job(
        cli: &Path,
        netns: Option<&str>,
        extra: &[String],
        env: &[(&str, &str)],
        job: &str,
        secret: &str,
    ) -> Sidecar {
        let (job, secret) = (job.to_string(), secret.to_string());
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let host = match netns {
            Some(ns) => ns.to_string(),
            None => format!("host-{job}"),
        };
        let dir = std::env::temp_dir().join(format!("weft-test-{job}-{n}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("sidecar.sock");
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(cli);
                c
            }
            None => Command::new(cli),
        };
        cmd.args(["sidecar", "--http", "127.0.0.1:0", "--socket"])
            .arg(&socket)
            .args(["--job", &job, "--host", &host])
            .args(extra)
            .env("WEFT_JOB_SECRET", &secret)
            .env_remove("WEFT_SIDECAR_SOCKET")
            .envs(env.iter().map(|(k, v)| (k.to_string(), v.to_string())))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        unsafe {
            cmd.pre_exec(|| {
                libc::setpgid(0, 0);
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd.spawn().expect("spawning weft sidecar");
        let log = Arc::new(Mutex::new(String::new()));
        let mut err = child.stderr.take().unwrap();
        let l2 = log.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    break;
                }
                l2.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let line = rx
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("sidecar did not start: {}", log.lock().unwrap()));
        let http = line
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix("http="))
            .expect("http= in the ready line")
            .to_string();
        let peer = line
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix("peer="))
            .unwrap_or("")
            .to_string();
        Sidecar {
            child,
            socket,
            http,
            peer,
            job,
            secret,
            dir,
            log,
        }
    }

    /// The environment a rank needs to attach to this sidecar.
    pub fn rank_env(&self) -> Vec<(String, String)> {
        vec![
            (
                "WEFT_SIDECAR_SOCKET".into(),
                self.socket.display().to_string(),
            ),
            ("WEFT_JOB".into(), self.job.clone()),
            ("WEFT_JOB_SECRET".into(), self.secret.clone()),
        ]
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    pub fn signal(&self, sig: i32) {
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }

    /// Waits (bounded) for the exit; `None` on timeout.
    pub fn wait(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let t = Instant::now();
        while t.elapsed() < limit {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    /// A plain HTTP/1.0 GET on the sidecar's HTTP port: (status code, body).
    pub fn http_get(&self, path: &str) -> std::io::Result<(u16, String)> {
        use std::io::Write;
        let mut s = std::net::TcpStream::connect(&self.http)?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n")?;
        let mut r = String::new();
        s.read_to_string(&mut r)?;
        let code = r
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = r
            .split_once("\r\n\r\n")
            .map(|x| x.1)
            .unwrap_or("")
            .to_string();
        Ok((code, body))
    }
}

impl Sidecar {
    /// The RAS snapshot (`GetStatus` over the socket).
    pub fn status(&self) -> weft::rpc::Status {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
            .block_on(weft::ras::fetch(self.socket.clone()))
            .unwrap_or_else(|e| panic!("status: {e}"))
    }

    /// The sum of every sample of metric `name` on `/metrics` (all its
    /// label sets; 0 when it has none yet).
    pub fn metric(&self, name: &str) -> f64 {
        let (code, text) = self.http_get("/metrics").expect("GET /metrics");
        assert_eq!(code, 200, "{text}");
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (key, value) = l.rsplit_once(' ')?;
                let metric = key.split('{').next()?;
                (metric == name).then(|| value.parse::<f64>().ok())?
            })
            .sum()
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGKILL) };
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
