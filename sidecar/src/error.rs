//! The sidecar's errors, one variant per cause. The messages are what the
//! logs, the rejected ranks and `weft ras` show; the cause decides the
//! `reason` label of `weft_rejected_connections_total` and whether a proxy
//! dialer retries.

use libcomm::handshake::HandshakeError;

#[derive(Debug, thiserror::Error)]
pub enum SidecarError {
    /// The job-secret handshake failed while reading or checking a message
    /// (cut short, timed out, oversized, a bad tag, replayed, stale).
    #[error(transparent)]
    Handshake(#[from] HandshakeError),
    /// The peer is not of this job or does not hold its secret.
    #[error("{0}")]
    Auth(String),
    /// Bytes that are not a valid handshake message.
    #[error("{0}")]
    Garbage(String),
    /// A frame or message that breaks the protocol after the handshake.
    #[error("{0}")]
    Protocol(String),
    /// A request that conflicts with what is open already (or names no
    /// other host).
    #[error("{0}")]
    Refused(String),
    /// The connection to a peer (or to a rank) is gone or went silent.
    #[error("{0}")]
    Lost(String),
    /// A local system call failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// From libcomm's side of a contract (a rank's open, its rings).
    #[error(transparent)]
    Libcomm(#[from] libcomm::Error),
    /// The sidecar could not be reached or did not answer (`weft ras`).
    #[error("{0}")]
    Unreachable(String),
}

pub type Result<T, E = SidecarError> = std::result::Result<T, E>;

impl SidecarError {
    /// The `reason` label under which a refused connection is counted.
    pub fn reject_reason(&self) -> &'static str {
        match self {
            SidecarError::Handshake(HandshakeError::Oversized { .. }) => "oversized",
            SidecarError::Handshake(HandshakeError::TimedOut { .. }) => "timeout",
            SidecarError::Handshake(HandshakeError::BadTag) | SidecarError::Auth(_) => "auth",
            SidecarError::Handshake(HandshakeError::Truncated { .. })
            | SidecarError::Garbage(_)
            | SidecarError::Protocol(_) => "garbage",
            _ => "short",
        }
    }

    /// Whether retrying the same peer cannot help (it proved it is not of
    /// this job, or it does not speak the protocol).
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            SidecarError::Auth(_)
                | SidecarError::Garbage(_)
                | SidecarError::Protocol(_)
                | SidecarError::Handshake(HandshakeError::Truncated { .. })
                | SidecarError::Handshake(HandshakeError::BadTag)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_and_reasons() {
        let e = SidecarError::from(HandshakeError::Oversized {
            what: "handshake",
            len: 2048,
            max: 1024,
        });
        assert_eq!(e.reject_reason(), "oversized");
        assert!(!e.is_fatal());
        assert_eq!(
            e.to_string(),
            "handshake message of 2048 bytes exceeds the limit of 1024"
        );
        let e = SidecarError::Auth("wrong job secret (HMAC mismatch)".into());
        assert_eq!(e.reject_reason(), "auth");
        assert!(e.is_fatal());
        assert_eq!(e.to_string(), "wrong job secret (HMAC mismatch)");
        let e = SidecarError::from(HandshakeError::Closed { what: "handshake" });
        assert_eq!(e.reject_reason(), "short");
        assert!(!e.is_fatal());
        assert_eq!(
            SidecarError::Garbage("invalid UTF-8".into()).reject_reason(),
            "garbage"
        );
    }
}
