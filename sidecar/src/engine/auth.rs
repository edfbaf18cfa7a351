//! Authentication of rank processes and peers with the job secret: the
//! Unix socket is owner-only already; the HMAC in Hello additionally ties an
//! attaching process to the job (a process of another job sharing the
//! volume is refused).

use crate::rpc::Hello;
/// The job secret and the attach HMAC, shared with the rank side.
pub use weft_agent::auth::{hello_mac, job_secret_from_env};

pub struct Auth {
    pub job: String,
    pub secret: Option<String>,
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
