//! Embedded mode of the rank-side agent (crate `weft-agent`): without
//! `WEFT_SIDECAR_SOCKET` the sidecar's engine runs inside the rank process
//! (same registry, snapshots, metrics and spans, no socket), reading the
//! process's telemetry segment as the sidecar would. The agent crate stays
//! free of the engine; this module hands it one through
//! [`weft_agent::Embedded`].

use crate::engine::liveness::Liveness;
use crate::engine::{self, Engine, drain};
use std::sync::Arc;
use weft_agent::ring::Segment;
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
        // The last records, and the aggregates not yet due.
        self.engine.drain_conn(self.conn, true);
        if let Some(t) = self.engine.telemetry.get() {
            t.shutdown();
        }
    }
}

/// Starts the engine on the agent's runtime, registers this process and
/// reads its segment on a timer there.
fn start(
    hello: Hello,
    commands: Commands,
    seg: Option<Arc<Segment>>,
) -> Result<Arc<dyn Embedded>, String> {
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
    let conn = e.add_proc(hello, None, commands, seg, Liveness::Unknown);
    let w = Arc::downgrade(&e);
    tokio::spawn(async move {
        let mut period = drain::PERIOD_MAX;
        while let Some(e) = w.upgrade() {
            let n = e.drain_all();
            drop(e);
            period = drain::next_period(n, period);
            tokio::time::sleep(period).await;
        }
    });
    Ok(Arc::new(Local { engine: e, conn }))
}

/// Installs the agent: attached to the sidecar at `WEFT_SIDECAR_SOCKET` (an
/// error when it cannot be reached), else this crate's engine in-process.
/// Call once, before creating communicators; later calls return the same agent.
pub fn install_from_env() -> Result<Arc<Agent>, String> {
    weft_agent::install_from_env(Some(Box::new(start)))
}
