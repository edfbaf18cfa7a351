//! `otlp-sink [ADDR]`: an OpenTelemetry trace receiver (OTLP over gRPC) that
//! prints every span it receives as one JSON line on stdout, `{"name":
//! "weft.all_reduce", "attrs": {"weft.rank": "3", ...}}`. The e2e test runs it
//! in the cluster as the jobs' `spec.telemetry.otlpEndpoint` and reads its
//! log. ADDR defaults to 0.0.0.0:4317 (the OTLP/gRPC port).

use weft_tests::otlp::{Receiver, serve};

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
    let r = Receiver {
        print: true,
        ..Receiver::default()
    };
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
