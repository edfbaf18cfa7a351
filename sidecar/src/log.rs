//! The sidecar's log: one line per event on stderr, prefixed so it reads
//! apart from the ranks' output. Shared by the engine and the proxy.

pub fn log(msg: &str) {
    eprintln!("weft sidecar: {msg}");
}
