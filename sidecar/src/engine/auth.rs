//! Authentication of rank processes and peers with the job secret: the
//! Unix socket is owner-only already; the HMAC in Hello additionally ties an
//! attaching process to the job (a process of another job sharing the
//! volume is refused).

use crate::error::SidecarError;
/// The job secret and the attach HMAC, shared with the rank side.
pub use weft_agent::auth::{hello_mac, hello_mac_matches, job_secret_from_env};
use weft_agent::rpc::Hello;

pub struct Auth {
    pub job: String,
    pub secret: Option<String>,
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
        if hello_mac_matches(secret, &h.job, h.pid, &h.auth) {
            Ok(())
        } else {
            Err(SidecarError::Auth(
                "wrong job secret (HMAC mismatch)".into(),
            ))
        }
    }
}
