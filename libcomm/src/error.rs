//! Typed errors for every public call.
//!
//! Each variant carries enough context (communicator, rank, state, peer) for a
//! user to act on the message without reading our source. The C ABI maps these
//! onto `ncclResult_t` codes through [`Error::kind`].

use crate::state::CommState;
use std::fmt;

/// Coarse classification, mirroring NCCL's result codes so the C ABI can map
/// errors one to one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// A bad argument from the caller (NCCL: ncclInvalidArgument).
    InvalidArgument,
    /// A call that is not allowed now (wrong state, double destroy; NCCL: ncclInvalidUsage).
    InvalidUsage,
    /// A peer failed, disappeared or aborted (NCCL: ncclRemoteError).
    RemoteError,
    /// A local system call failed (NCCL: ncclSystemError).
    SystemError,
    /// A bug in Weft (NCCL: ncclInternalError).
    Internal,
    /// Something this build or machine cannot do (NCCL: ncclInvalidUsage / ncclUnhandledCudaError).
    Unsupported,
    /// The operation is still running (non-blocking communicators; NCCL: ncclInProgress).
    InProgress,
    /// A CUDA driver call failed (NCCL: ncclUnhandledCudaError).
    Cuda,
}

/// Every error libcomm returns.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    #[error("communicator {comm} (rank {rank}) is {state}: {what} is not allowed in this state")]
    InvalidState {
        comm: String,
        rank: usize,
        state: CommState,
        what: &'static str,
    },

    #[error("communicator {comm} (rank {rank}) was already destroyed; this is a second destroy")]
    AlreadyDestroyed { comm: String, rank: usize },

    #[error("{0}")]
    InvalidUsage(String),

    #[error("communicator {comm} (rank {rank}) was aborted{}", by.map(|r| format!(" by rank {r}")).unwrap_or_default())]
    Aborted {
        comm: String,
        rank: usize,
        by: Option<usize>,
    },

    #[error("remote error on communicator {comm} (rank {rank}): {detail}")]
    Remote {
        comm: String,
        rank: usize,
        detail: String,
    },

    #[error("timed out after {after_ms} ms on communicator {comm} (rank {rank}) {waiting_for}")]
    Timeout {
        comm: String,
        rank: usize,
        after_ms: u64,
        waiting_for: String,
    },

    #[error("bootstrap failed: {0}")]
    Bootstrap(String),

    #[error("{context}: {source}")]
    System {
        context: String,
        #[source]
        source: std::sync::Arc<std::io::Error>,
    },

    #[error("unsupported: {0}")]
    Unsupported(String),

    #[error("operation in progress")]
    InProgress,

    #[error("CUDA error: {0}")]
    Cuda(String),

    #[error("internal error (a bug in Weft, please report it): {0}")]
    Internal(String),
}

impl Error {
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Error::InvalidState { .. }
            | Error::AlreadyDestroyed { .. }
            | Error::InvalidUsage(_) => ErrorKind::InvalidUsage,
            Error::Aborted { .. } | Error::Remote { .. } | Error::Timeout { .. } => {
                ErrorKind::RemoteError
            }
            Error::Bootstrap(_) => ErrorKind::RemoteError,
            Error::System { .. } => ErrorKind::SystemError,
            Error::Unsupported(_) => ErrorKind::Unsupported,
            Error::InProgress => ErrorKind::InProgress,
            Error::Cuda(_) => ErrorKind::Cuda,
            Error::Internal(_) => ErrorKind::Internal,
        }
    }

    pub(crate) fn sys(context: impl fmt::Display, source: std::io::Error) -> Error {
        Error::System {
            context: context.to_string(),
            source: std::sync::Arc::new(source),
        }
    }

    pub(crate) fn last_os(context: impl fmt::Display) -> Error {
        Error::sys(context, std::io::Error::last_os_error())
    }

    pub(crate) fn arg(msg: impl Into<String>) -> Error {
        Error::InvalidArgument(msg.into())
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
