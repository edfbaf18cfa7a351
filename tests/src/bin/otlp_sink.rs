//! `otlp-sink [ADDR]`: an OpenTelemetry trace receiver (OTLP over gRPC) that
//! prints every span it receives as one JSON line on stdout, `{"name":
//! "weft.all_reduce", "attrs": {"weft.rank": "3", ...}}`. The e2e test runs it
//! in the cluster as the jobs' `spec.telemetry.otlpEndpoint` and reads its
//! log. ADDR defaults to 0.0.0.0:4317 (the OTLP/gRPC port).

use std::io::Write;
use std::time::Duration;
use weft_tests::otlp::{Got, Receiver, serve};

/// How often the spans received since the last look are printed.
const PRINT_EVERY: Duration = Duration::from_millis(200);

fn main() {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "0.0.0.0:4317".into());
    let l = match std::net::TcpListener::bind(&addr) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("otlp-sink: cannot listen on {addr}: {e}");
            std::process::exit(1);
        }
    };
    eprintln!("otlp-sink: receiving OTLP/gRPC traces on {addr}");
    let r = Receiver::default();
    let printed = r.clone();
    std::thread::spawn(move || print_new_spans(&printed));
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("otlp-sink: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = rt.block_on(serve(r, l)) {
        eprintln!("otlp-sink: {e}");
        std::process::exit(1);
    }
}

/// Prints each span the receiver keeps, once, as it arrives.
fn print_new_spans(r: &Receiver) {
    let mut done = 0;
    loop {
        std::thread::sleep(PRINT_EVERY);
        let new: Vec<Got> = {
            let spans = r.0.lock().unwrap_or_else(|e| e.into_inner());
            spans[done..].to_vec()
        };
        done += new.len();
        let mut out = std::io::stdout().lock();
        for g in &new {
            let line = serde_json::json!({"name": g.name, "attrs": g.attrs});
            let _ = writeln!(out, "{line}");
        }
        let _ = out.flush();
    }
}
