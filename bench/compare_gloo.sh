#!/usr/bin/env bash
# Weft vs torch.distributed (gloo backend) all-reduce on this machine, beside
# Open MPI, in one invocation: bench/compare_mpi.sh with GLOO=1, so weft, MPI
# and Gloo run alternately in every round with the same sizes, warm-up,
# iterations and timing method (bench/gloo/allreduce_bench.py prints the
# columns `weft bench` prints), then one table per comparison.
#
#   bench/compare_gloo.sh                                  # 4 ranks, 8 B .. 256 MiB
#   N=8 MAX=64M ROUNDS=3 WEFT_BIN=./weft bench/compare_gloo.sh
#   MPI=0 bench/compare_gloo.sh                            # weft vs Gloo only
#
# Needs torch (CPU is enough: `pip install torch`) for $PYTHON (python3).
# Every variable of bench/compare_mpi.sh applies; OUT defaults to
# $CARGO_TARGET_DIR/compare-gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-${CARGO_TARGET_DIR:-target}/compare-gloo}
GLOO=1 exec bench/compare_mpi.sh "$@"
