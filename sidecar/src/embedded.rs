//! Embedded mode of the rank-side agent (crate `weft-agent`): without
//! `WEFT_SIDECAR_SOCKET` the sidecar's engine runs inside the rank process
//! (same registry, snapshots, metrics and spans, no socket). The agent crate
//! stays free of the engine; this module hands it one through
//! [`weft_agent::Embedded`].

use crate::engine::{self, Engine};
use std::sync::Arc;
use weft_agent::rpc::{Hello, rank_message::Msg};
use weft_agent::{Agent, Commands, Embedded};

/// The engine of this process, and the connection its messages arrive on.
struct Local {
    engine: Arc<Engine>,
    conn: u64,
}

impl Embedded for Local {
    fn on_message(&self, m: Msg) {
        self.engine.on_message(self.conn, m);
    }

    fn shutdown(&self) {
        if let Some(t) = self.engine.telemetry.get() {
            t.shutdown();
        }
    }
}

/// Starts the engine on the agent's runtime and registers this process.
fn start(hello: Hello, commands: Commands) -> Result<Arc<dyn Embedded>, String> {
    let e = Engine::new(hello.job.clone(), engine::host_name(), None);
    if engine::telemetry::enabled() {
        match engine::telemetry::Telemetry::start("weft-rank", e.metrics.spans_dropped.clone()) {
            Ok(t) => {
                let _ = e.telemetry.set(t);
            }
            Err(err) => eprintln!("weft: tracing disabled: {err}"),
        }
    }
    tokio::spawn(e.state.clone().publisher());
    let conn = e.add_proc(hello, None, commands);
    Ok(Arc::new(Local { engine: e, conn }))
}

/// Installs the agent: attached to the sidecar at `WEFT_SIDECAR_SOCKET` (an
/// error when it cannot be reached), else this crate's engine in-process.
/// Call once, before creating communicators; later calls return the same agent.
pub fn install_from_env() -> Result<Arc<Agent>, String> {
    weft_agent::install_from_env(Some(Box::new(start)))
}
