//! The RAS report as text: a job's status (`weft.v1.Status`) as `weft ras`
//! prints it and the sidecar's HTTP port serves it at `/ras`.

use std::fmt::Write;
use weft_agent::rpc::Status;

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
