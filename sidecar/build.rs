//! Generates the gRPC code from proto/weft/v1/sidecar.proto with protox (pure
//! Rust: the build needs no system protoc).

fn main() {
    let proto = "../proto/weft/v1/sidecar.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["../proto"]).expect("parsing sidecar.proto");
    tonic_prost_build::configure()
        // `weft ras --json` and the HTTP JSON page print the same messages.
        .type_attribute(
            ".weft.v1",
            "#[derive(serde::Serialize, serde::Deserialize)]",
        )
        .compile_fds(fds)
        .expect("generating gRPC code");
}
