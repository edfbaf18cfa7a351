#!/bin/sh
# CI without a GPU: installs NVRTC from PyPI (no CUDA toolkit, no driver) and
# runs the test that compiles every kernel in this folder for sm_90 and sm_80.
# For .ci/run (before `cargo nextest run --workspace`), the same in two lines:
#   python3 -m pip install --quiet --target .ci/nvrtc nvidia-cuda-nvrtc==13.0.88
#   export LD_LIBRARY_PATH=$PWD/.ci/nvrtc/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} WEFT_REQUIRE_NVRTC=1
# Pin 13.0.x: newer PTX ISA versions are too new for driver 580 (CUDA 13.0).
set -eu
dir=${WEFT_NVRTC_DIR:-${TMPDIR:-/tmp}/weft-nvrtc}
if [ ! -e "$dir/nvidia/cu13/lib/libnvrtc.so.13" ]; then
    python3 -m pip install --quiet --target "$dir" nvidia-cuda-nvrtc==13.0.88
fi
export LD_LIBRARY_PATH="$dir/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export WEFT_REQUIRE_NVRTC=1
exec cargo test -p weft-libcomm --lib cuda:: -- --nocapture "$@"
