//! `weft run --sidecar`: one local `weft sidecar` for the launched ranks,
//! sharing the job name and secret; SIGTERMed (pod-termination style) when
//! the ranks are done.

use crate::launch::LaunchSpec;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use weft_contract::params;

/// The running sidecar: SIGTERMed and its directory removed when dropped.
pub struct LocalSidecar {
    child: Child,
    dir: std::path::PathBuf,
}

/// Starts the sidecar (waiting, at most 20 s, for its ready line) and adds
/// its socket, the job name and the secret to the ranks' environment.
pub fn start(spec: &mut LaunchSpec) -> Result<LocalSidecar, String> {
    let job = spec
        .job
        .clone()
        .unwrap_or_else(|| format!("local-{}", std::process::id()));
    spec.job = Some(job.clone());
    let secret = params::WEFT_JOB_SECRET
        .raw()
        .filter(|s| !s.is_empty())
        .map(Ok)
        .unwrap_or_else(crate::launch::env::fresh_secret)
        .map_err(|e| format!("job secret: {e}"))?;
    let dir = std::env::temp_dir().join(format!("weft-sidecar-{job}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let socket = dir.join("sidecar.sock");
    let exe = std::env::current_exe().map_err(|e| format!("finding weft: {e}"))?;
    let mut child = Command::new(exe)
        .args([
            "sidecar",
            "--http",
            "127.0.0.1:0",
            "--job",
            &job,
            "--socket",
        ])
        .arg(&socket)
        .env(params::WEFT_JOB_SECRET.name(), &secret)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting the sidecar: {e}"))?;
    let out = child.stdout.take().expect("piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            eprintln!("{line}");
            let _ = tx.send(());
        }
    });
    if rx.recv_timeout(Duration::from_secs(20)).is_err() {
        let _ = child.kill();
        let _ = child.wait();
        return Err("the sidecar did not start within 20 s".into());
    }
    spec.env_extra.extend([
        (
            "WEFT_SIDECAR_SOCKET".to_string(),
            socket.display().to_string(),
        ),
        ("WEFT_JOB".to_string(), job),
        ("WEFT_JOB_SECRET".to_string(), secret),
    ]);
    Ok(LocalSidecar { child, dir })
}

impl Drop for LocalSidecar {
    fn drop(&mut self) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        for _ in 0..500 {
            if let Ok(Some(_)) = self.child.try_wait() {
                let _ = std::fs::remove_dir_all(&self.dir);
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
