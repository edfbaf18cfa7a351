//! `weft ras`: the job's health as this sidecar sees it, from its snapshot.

use crate::error::SidecarError;
use crate::rpc::Status;
use std::fmt::Write;
use std::path::PathBuf;
use std::time::Duration;

/// `weft ras` options.
#[derive(Debug, Clone, clap::Args)]
pub struct RasArgs {
    /// The sidecar's socket.
    #[arg(long, env = weft_contract::params::WEFT_SIDECAR_SOCKET.name(), value_name = "PATH")]
    pub socket: PathBuf,
    /// Print the snapshot as JSON.
    #[arg(long)]
    pub json: bool,
    /// Print again every second until interrupted.
    #[arg(long)]
    pub watch: bool,
    /// The whole job: merge the peer sidecars' snapshots (via this sidecar).
    #[arg(long)]
    pub job: bool,
    /// Give up on a query after this long (a sidecar that accepts and never
    /// answers must not hang the caller).
    #[arg(long, value_name = "SECS", default_value = "5", value_parser = crate::cli::parse_secs)]
    pub timeout: Duration,
}

/// The plain-text report (also served at http://.../ras).
pub fn render(s: &Status) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "job {} on host {} (snapshot {}){}",
        s.job,
        s.host,
        s.snapshot_seq,
        if s.terminating { " TERMINATING" } else { "" }
    );
    if !s.hosts.is_empty() {
        let _ = writeln!(o, "peer hosts: {}", s.hosts.len());
        for h in &s.hosts {
            let _ = write!(
                o,
                "  {} at {}: {}",
                if h.host.is_empty() { "?" } else { &h.host },
                h.addr,
                h.state
            );
            if h.proxy.is_empty() {
                let _ = writeln!(o);
            } else {
                let _ = writeln!(
                    o,
                    "; proxy {} (sent {} B, received {} B, connected {}x)",
                    h.proxy, h.proxy_tx_bytes, h.proxy_rx_bytes, h.proxy_connects
                );
            }
        }
    }
    let _ = writeln!(o, "processes: {}", s.processes.len());
    for p in &s.processes {
        let gpus = if p.gpus.is_empty() {
            "no GPUs".to_string()
        } else {
            p.gpus.join(",")
        };
        let _ = writeln!(o, "  pid {:>7} host {} {} ({gpus})", p.pid, p.host, p.state);
    }
    let _ = writeln!(o, "communicators: {}", s.comms.len());
    for c in &s.comms {
        let top = c
            .ranks
            .iter()
            .map(|r| r.last_started_seq)
            .max()
            .unwrap_or(0);
        let _ = writeln!(
            o,
            "  comm {} size {} present {} state {}{}",
            c.comm_id,
            c.nranks,
            c.ranks.len(),
            c.state,
            if c.missing.is_empty() {
                String::new()
            } else {
                format!(" missing (not on this host) {:?}", c.missing)
            }
        );
        for r in &c.ranks {
            let behind = if r.last_started_seq < top {
                format!("  BEHIND by {}", top - r.last_started_seq)
            } else if r.last_completed_seq < r.last_started_seq {
                "  IN FLIGHT".to_string()
            } else {
                String::new()
            };
            let _ = writeln!(
                o,
                "    rank {:>4} pid {:>7} host {} {}: started #{} {}, completed #{} {} ({}){behind}",
                r.rank,
                r.pid,
                r.host,
                r.state,
                r.last_started_seq,
                r.last_started_op,
                r.last_completed_seq,
                r.last_completed_op,
                r.last_outcome
            );
        }
    }
    if !s.async_errors.is_empty() {
        let _ = writeln!(o, "async errors: {}", s.async_errors.len());
        for e in &s.async_errors {
            let _ = writeln!(o, "  {e}");
        }
    }
    if s.dropped_events > 0 {
        let _ = writeln!(o, "events dropped by ranks: {}", s.dropped_events);
    }
    o
}

pub async fn fetch(socket: PathBuf) -> Result<Status, SidecarError> {
    fetch_with(socket, false).await
}

pub async fn fetch_with(socket: PathBuf, job_wide: bool) -> Result<Status, SidecarError> {
    let mut c = crate::client::sidecar(socket.clone()).await.map_err(|e| {
        SidecarError::Unreachable(format!(
            "cannot reach the sidecar at {}: {e}",
            socket.display()
        ))
    })?;
    c.get_status(crate::rpc::StatusRequest { job_wide })
        .await
        .map(|r| r.into_inner())
        .map_err(|e| SidecarError::Unreachable(format!("status query failed: {}", e.message())))
}

pub fn run(args: RasArgs) -> i32 {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("weft ras: {e}");
            return 1;
        }
    };
    rt.block_on(async {
        loop {
            let query = fetch_with(args.socket.clone(), args.job);
            let answer = tokio::time::timeout(args.timeout, query)
                .await
                .unwrap_or_else(|_| {
                    Err(SidecarError::Unreachable(format!(
                        "no answer from the sidecar at {} within {:?}",
                        args.socket.display(),
                        args.timeout
                    )))
                });
            match answer {
                Ok(s) if args.json => {
                    println!("{}", serde_json::to_string_pretty(&s).unwrap_or_default())
                }
                Ok(s) => print!("{}", render(&s)),
                Err(e) => {
                    eprintln!("weft ras: {e}");
                    if !args.watch {
                        return 1;
                    }
                }
            }
            if !args.watch {
                return 0;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            println!();
        }
    })
}
