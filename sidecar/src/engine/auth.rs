//! Authentication of rank processes and peers with the job secret: the
//! Unix socket is owner-only already; the HMAC in Hello additionally ties an
//! attaching process to the job (a process of another job sharing the
//! volume is refused).

use crate::rpc::Hello;
use hmac::{KeyInit, Mac};
use sha2::Sha256;

/// The job secret, from `WEFT_JOB_SECRET` or the file `WEFT_JOB_SECRET_FILE` names.
pub fn job_secret_from_env() -> Option<String> {
    if let Ok(s) = std::env::var("WEFT_JOB_SECRET")
        && !s.is_empty()
    {
        return Some(s);
    }
    let path = std::env::var("WEFT_JOB_SECRET_FILE").ok()?;
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

pub struct Auth {
    pub job: String,
    pub secret: Option<String>,
}

/// HMAC-SHA256(secret, "weft-attach\0" job "\0" pid), hex.
pub fn hello_mac(secret: &str, job: &str, pid: u32) -> String {
    let mut m =
        <hmac::Hmac<Sha256> as KeyInit>::new_from_slice(secret.as_bytes()).expect("any key length");
    m.update(format!("weft-attach\0{job}\0{pid}").as_bytes());
    m.finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Auth {
    pub fn check_hello(&self, h: &Hello) -> Result<(), String> {
        if h.job != self.job {
            return Err(format!(
                "job '{}' is not this sidecar's job '{}'",
                h.job.chars().take(64).collect::<String>(),
                self.job
            ));
        }
        let Some(secret) = &self.secret else {
            return Ok(());
        };
        let want = hello_mac(secret, &h.job, h.pid);
        if ct_eq(want.as_bytes(), h.auth.as_bytes()) {
            Ok(())
        } else {
            Err("wrong job secret (HMAC mismatch)".into())
        }
    }
}
