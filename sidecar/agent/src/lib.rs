//! The rank side of Weft's sidecar, small enough to link into every rank
//! process (the drop-in `libnccl.so.2` among them): the [`agent`] that
//! attaches a process to its pod's sidecar, the telemetry [`ring`] it
//! reports every operation into (shared memory the sidecar drains), the
//! client [`mod@client`] to the sidecar's Unix socket, the job-secret
//! [`auth`] of an attach, and the `weft.v1` protocol ([`rpc`], generated
//! from `proto/weft/v1/sidecar.proto`).
//!
//! The [`export`] policy (what becomes a span at high rates) is here too,
//! so the sidecar and the in-process exporter apply the same one. With
//! feature `otlp`, also the OpenTelemetry [`spans`] of collectives (one
//! exporter for the sidecar and the ranks) and [`spans_only`], the embedded
//! mode of a rank without the sidecar's crate: its own spans, exported by
//! the process.
//!
//! The sidecar itself (crate `weft`, `weft sidecar`) builds on the same
//! generated code with the `server` feature (gRPC server stubs) and `serde`
//! (JSON output), so the protocol is generated once, here.

pub mod agent;
mod attached;
pub mod auth;
pub mod client;
pub mod export;
pub mod lifeline;
pub mod report;
pub mod ring;
pub mod rpc;
#[cfg(feature = "otlp")]
pub mod spans;
#[cfg(feature = "otlp")]
pub mod spans_only;

pub use agent::{Agent, Commands, Embedded, StartEmbedded, install_from_env, installed};

/// This machine's host name.
pub fn host_name() -> String {
    let mut b = [0u8; 256];
    let r = unsafe { libc::gethostname(b.as_mut_ptr().cast(), b.len()) };
    if r != 0 {
        return "localhost".into();
    }
    let n = b.iter().position(|c| *c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..n]).into_owned()
}

#[cfg(test)]
mod tests {
    #[test]
    fn host_name_is_a_name() {
        let h = super::host_name();
        assert!(!h.is_empty());
        assert!(!h.contains('\0'));
    }
}
