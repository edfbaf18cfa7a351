#!/bin/sh
# Builds what the images hold, from the repository root, into OUT (default
# /out): the operator, `weft`, the NCCL-compatible library (as libnccl.so.2)
# and the example workloads of the weft-examples image: resilient-train and
# otlp-sink (package weft-tests) and nccl-dropin, an unmodified NCCL program
# (libcomm/capi/tests/c/dropin.c) compiled against Weft's nccl.h and linked
# with plain -lnccl. The Dockerfile's builder stage runs it; so does
# docker/rootfs-images.sh's caller when there is no docker engine.
#
# The library is built on its own: in one cargo build with `weft`, cargo
# would unify dependency features and build the library's dependencies with
# the sidecar's (tonic's axum router, the protocol's server stubs and serde).
#   docker/build-release.sh [OUT]      (CARGO_TARGET_DIR is honoured)
set -eu
out=${1:-/out}
target=${CARGO_TARGET_DIR:-target}
cargo build --release -p weft-operator -p weft
cargo build --release -p weft-tests --bin resilient-train --bin otlp-sink
cargo build --release -p weft-nccl
mkdir -p "$out"
cp "$target/release/weft-operator" "$target/release/weft" "$out/"
cp "$target/release/resilient-train" "$target/release/otlp-sink" "$out/"
cp "$target/release/libnccl.so" "$out/libnccl.so.2"
cc -O2 -Wall -Werror -I libcomm/include -o "$out/nccl-dropin" libcomm/capi/tests/c/dropin.c \
   -L "$target/release" -lnccl
echo "built into $out: $(cd "$out" && ls | tr '\n' ' ')"
