//! `weft ras`: the job's health as this sidecar sees it, from its snapshot.

use crate::arg_values::parse_secs;
use crate::error::SidecarError;
use crate::ras_report::render;
use std::path::PathBuf;
use std::time::Duration;
use weft_agent::rpc::{self, Status};

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
    #[arg(long, value_name = "SECS", default_value = "5", value_parser = parse_secs)]
    pub timeout: Duration,
}

/// This sidecar's own snapshot.
pub async fn fetch(socket: PathBuf) -> Result<Status, SidecarError> {
    fetch_with(socket, false).await
}

/// The snapshot; `job_wide`: merged with the peer sidecars' (via this one).
pub async fn fetch_with(socket: PathBuf, job_wide: bool) -> Result<Status, SidecarError> {
    let mut c = weft_agent::client::sidecar(socket.clone())
        .await
        .map_err(|e| {
            SidecarError::Unreachable(format!(
                "cannot reach the sidecar at {}: {e}",
                socket.display()
            ))
        })?;
    c.get_status(rpc::StatusRequest { job_wide })
        .await
        .map(|r| r.into_inner())
        .map_err(|e| SidecarError::Unreachable(format!("status query failed: {}", e.message())))
}

/// `weft ras`: prints the report (or JSON), once or every second; returns
/// the exit code.
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
