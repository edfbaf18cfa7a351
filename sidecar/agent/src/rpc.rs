//! The generated protobuf/gRPC types of `proto/weft/v1/sidecar.proto`.

#![allow(clippy::all, missing_docs)]
tonic::include_proto!("weft.v1");
