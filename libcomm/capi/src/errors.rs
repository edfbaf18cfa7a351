//! Result codes, error strings, the thread's last error, and NCCL_DEBUG logging.
//!
//! Every failing call stores a message naming the function, the communicator
//! and what went wrong; `ncclGetLastError` returns it (per thread, like NCCL's
//! own last-error buffer). With `NCCL_DEBUG=WARN` (or `WEFT_DEBUG`) each
//! failure is also logged to stderr as `host:pid:tid HH:MM:SS.uuuuuu weft WARN ...`.

use libcomm::{Error, ErrorKind};
use std::cell::RefCell;
use std::ffi::{CString, c_char};

/// `ncclResult_t`.
pub type NcclResult = i32;

pub const SUCCESS: NcclResult = 0;
pub const UNHANDLED_CUDA_ERROR: NcclResult = 1;
pub const SYSTEM_ERROR: NcclResult = 2;
pub const INTERNAL_ERROR: NcclResult = 3;
pub const INVALID_ARGUMENT: NcclResult = 4;
pub const INVALID_USAGE: NcclResult = 5;
pub const REMOTE_ERROR: NcclResult = 6;
pub const IN_PROGRESS: NcclResult = 7;
/// NCCL 2.29+; never returned (see nccl.h), but it has a string.
pub const TIMEOUT: NcclResult = 8;
pub const NUM_RESULTS: NcclResult = 9;

/// A failed call: the code to return and the message for `ncclGetLastError`.
#[derive(Debug, Clone)]
pub struct Fail {
    pub code: NcclResult,
    pub msg: String,
}

impl Fail {
    pub fn new(code: NcclResult, msg: impl Into<String>) -> Fail {
        Fail {
            code,
            msg: msg.into(),
        }
    }
    pub fn arg(msg: impl Into<String>) -> Fail {
        Fail::new(INVALID_ARGUMENT, msg)
    }
    pub fn usage(msg: impl Into<String>) -> Fail {
        Fail::new(INVALID_USAGE, msg)
    }
    /// Adds context in front of the message.
    pub fn context(mut self, ctx: impl std::fmt::Display) -> Fail {
        self.msg = format!("{ctx}: {}", self.msg);
        self
    }
}

/// libcomm's error classification onto NCCL's codes.
pub fn code_of(kind: ErrorKind) -> NcclResult {
    match kind {
        ErrorKind::InvalidArgument => INVALID_ARGUMENT,
        ErrorKind::InvalidUsage => INVALID_USAGE,
        ErrorKind::RemoteError => REMOTE_ERROR,
        ErrorKind::SystemError => SYSTEM_ERROR,
        ErrorKind::Internal => INTERNAL_ERROR,
        // Something this build or machine cannot do: a usage error for the caller.
        ErrorKind::Unsupported => INVALID_USAGE,
        ErrorKind::InProgress => IN_PROGRESS,
        ErrorKind::Cuda => UNHANDLED_CUDA_ERROR,
    }
}

impl From<Error> for Fail {
    fn from(e: Error) -> Fail {
        Fail::new(code_of(e.kind()), e.to_string())
    }
}

pub type CResult<T> = std::result::Result<T, Fail>;

/// `ncclGetErrorString`: static strings, one per code.
pub fn error_string(code: NcclResult) -> *const c_char {
    let s: &'static [u8] = match code {
        SUCCESS => b"no error\0",
        UNHANDLED_CUDA_ERROR => b"unhandled cuda error (run with NCCL_DEBUG=INFO for details)\0",
        SYSTEM_ERROR => b"unhandled system error (run with NCCL_DEBUG=INFO for details)\0",
        INTERNAL_ERROR => b"internal error - please report this issue to the Weft developers\0",
        INVALID_ARGUMENT => b"invalid argument (run with NCCL_DEBUG=WARN for details)\0",
        INVALID_USAGE => b"invalid usage (run with NCCL_DEBUG=WARN for details)\0",
        REMOTE_ERROR => b"remote process exited or there was a network error\0",
        IN_PROGRESS => b"NCCL operation in progress\0",
        TIMEOUT => b"operation timed out\0",
        _ => b"unknown result code\0",
    };
    s.as_ptr().cast()
}

thread_local! {
    static LAST: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `msg` as this thread's last error.
pub fn set_last(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST.with(|l| *l.borrow_mut() = c);
}

/// This thread's last error message (valid until its next failing call).
pub fn last_ptr() -> *const c_char {
    LAST.with(|l| l.borrow().as_ptr())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Off,
    Warn,
    Info,
}

/// `WEFT_DEBUG` or `NCCL_DEBUG`, as libcomm reads them: WARN, INFO (TRACE
/// counts as INFO here).
pub fn level() -> Level {
    match libcomm::log_level() {
        libcomm::LogLevel::Off => Level::Off,
        libcomm::LogLevel::Warn => Level::Warn,
        libcomm::LogLevel::Info | libcomm::LogLevel::Trace => Level::Info,
    }
}

/// One log line in libcomm's format (`libcomm::log_line`: host, pid, tid,
/// time of day, `weft LEVEL message`).
pub fn log(lvl: Level, msg: &str) {
    if level() < lvl || lvl == Level::Off {
        return;
    }
    use std::io::Write;
    let tag = if lvl == Level::Warn { "WARN" } else { "INFO" };
    let line = libcomm::log_line(tag, format_args!("{msg}"));
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// Finishes a call: records and logs a failure, returns its code.
pub fn finish(func: &str, r: CResult<NcclResult>) -> NcclResult {
    match r {
        Ok(code) => code,
        Err(f) => {
            let msg = format!("{func}: {}", f.msg);
            log(Level::Warn, &msg);
            set_last(&msg);
            f.code
        }
    }
}
