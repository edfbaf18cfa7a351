//! Authentication of rank processes and peers with the job secret: the
//! Unix socket is owner-only already; the HMAC in Hello additionally ties an
//! attaching process to the job (a process of another job sharing the
//! volume is refused).

use crate::error::SidecarError;
use crate::rpc::Hello;
use libcomm::handshake;

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
    handshake::tag_hex(secret.as_bytes(), &[attach_label(job, pid).as_bytes()])
}

fn attach_label(job: &str, pid: u32) -> String {
    format!("weft-attach\0{job}\0{pid}")
}

impl Auth {
    pub fn check_hello(&self, h: &Hello) -> Result<(), SidecarError> {
        if h.job != self.job {
            return Err(SidecarError::Auth(format!(
                "job '{}' is not this sidecar's job '{}'",
                h.job.chars().take(64).collect::<String>(),
                self.job
            )));
        }
        let Some(secret) = &self.secret else {
            return Ok(());
        };
        handshake::check_hex(
            secret.as_bytes(),
            &[attach_label(&h.job, h.pid).as_bytes()],
            &h.auth,
        )
        .map_err(|_| SidecarError::Auth("wrong job secret (HMAC mismatch)".into()))
    }
}
