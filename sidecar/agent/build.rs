//! Generates the gRPC code from proto/weft/v1/sidecar.proto with protox (pure
//! Rust: the build needs no system protoc). Messages and the client always;
//! the server stubs with the `server` feature and serde on every message with
//! `serde` (both for the sidecar, crate `weft`).

fn main() {
    let proto = "../../proto/weft/v1/sidecar.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["../../proto"]).expect("parsing sidecar.proto");
    let mut config = tonic_prost_build::configure()
        .build_client(true)
        .build_server(std::env::var_os("CARGO_FEATURE_SERVER").is_some());
    if std::env::var_os("CARGO_FEATURE_SERDE").is_some() {
        // `weft ras --json` and the HTTP JSON page print the same messages.
        config = config.type_attribute(
            ".weft.v1",
            "#[derive(serde::Serialize, serde::Deserialize)]",
        );
    }
    config.compile_fds(fds).expect("generating gRPC code");
}
