//! Collectives across hosts over the byte mover seam (`net/`).
//! (Module map and design: docs/ARCHITECTURE.md, "Across hosts".)

pub mod device_plan;
pub mod engine;
#[cfg(test)]
mod engine_tests;
pub mod flags;
pub mod layout;
pub mod links;
pub mod local;
#[cfg(test)]
mod pipe_tests;
pub mod plan;
pub mod program;
pub mod runner;
pub mod schedule;
pub mod stream_words;
#[cfg(test)]
mod testing;
#[cfg(test)]
mod tests;
pub mod tuner;

pub use engine::{Engine, EngineConfig};
pub use flags::{FlagWords, Flags, TERMINAL};
pub use layout::Layout;
pub use links::{DATA_STREAM, Exchange, Links};
pub use local::{BoardMover, HostBoard, LocalMover};
pub use plan::{Coll, Shape};
pub use program::{Call, CallBuf, Step, StepOp};
pub use runner::CrossHost;
