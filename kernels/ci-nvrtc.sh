#!/bin/sh
# CI without a GPU: installs NVRTC from PyPI (no CUDA toolkit, no driver),
# builds libcomm with it (libcomm/build.rs compiles every kernel ahead of
# time: cubins for sm_80, sm_90, sm_100 and PTX for newer GPUs) and runs the
# kernel tests: the library carries every kernel for every architecture,
# and the run-time fallback compiles single kernels. .ci/run does the same
# with NVRTC in .ci/nvrtc.
# Pin 13.0.x: newer PTX ISA versions are too new for driver 580 (CUDA 13.0).
set -eu
dir=${WEFT_NVRTC_DIR:-${TMPDIR:-/tmp}/weft-nvrtc}
if [ ! -e "$dir/nvidia/cu13/lib/libnvrtc.so.13" ]; then
    python3 -m pip install --quiet --target "$dir" nvidia-cuda-nvrtc==13.0.88
fi
export WEFT_NVRTC="$dir/nvidia/cu13/lib/libnvrtc.so.13"
export LD_LIBRARY_PATH="$dir/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export WEFT_REQUIRE_NVRTC=1
exec cargo test -p weft-libcomm --lib cuda:: -- --nocapture "$@"
