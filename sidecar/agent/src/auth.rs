//! The job secret as an attaching process proves it: the sidecar's Unix
//! socket is owner-only already; the HMAC in `Hello` additionally ties the
//! process to the job (a process of another job sharing the volume is
//! refused). The sidecar checks it with the same [`hello_mac`].

use libcomm::handshake;
use weft_contract::env::SecretSource;

/// The job secret, from `WEFT_JOB_SECRET` or the file `WEFT_JOB_SECRET_FILE`
/// names ([`SecretSource`]); an empty secret or a file that cannot be read
/// is none.
pub fn job_secret_from_env() -> Option<String> {
    SecretSource::from_env()?
        .read()
        .ok()
        .filter(|s| !s.is_empty())
}

/// HMAC-SHA256(secret, "weft-attach\0" job "\0" pid), hex.
pub fn hello_mac(secret: &str, job: &str, pid: u32) -> String {
    handshake::tag_hex(secret.as_bytes(), &[attach_label(job, pid).as_bytes()])
}

/// Whether `mac` (hex) is [`hello_mac`] of `job` and `pid`, compared in constant time.
pub fn hello_mac_matches(secret: &str, job: &str, pid: u32, mac: &str) -> bool {
    handshake::check_hex(secret.as_bytes(), &[attach_label(job, pid).as_bytes()], mac).is_ok()
}

fn attach_label(job: &str, pid: u32) -> String {
    format!("weft-attach\0{job}\0{pid}")
}

#[cfg(test)]
mod tests {
    use super::hello_mac;

    #[test]
    fn hello_mac_is_hmac_sha256_of_job_and_pid() {
        // python3 -c "import hmac,hashlib; print(hmac.new(b's3cret',
        //   b'weft-attach\0job-a\0' b'4242', hashlib.sha256).hexdigest())"
        assert_eq!(
            hello_mac("s3cret", "job-a", 4242),
            "55f7cc75171ebdfdd064a0a3f6bffba87994b5a97f5747b548ce93d7dedbf655"
        );
        assert_ne!(
            hello_mac("s3cret", "job-a", 4243),
            hello_mac("s3cret", "job-a", 4242)
        );
        assert_ne!(
            hello_mac("other", "job-a", 4242),
            hello_mac("s3cret", "job-a", 4242)
        );
    }
}
