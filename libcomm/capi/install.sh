#!/bin/sh
# Installs Weft's NCCL-compatible library and header under PREFIX:
#   PREFIX/lib/libnccl.so.2          the library (SONAME libnccl.so.2)
#   PREFIX/lib/libnccl.so            -> libnccl.so.2 (for -lnccl at link time)
#   PREFIX/lib/libweft_nccl.so       -> libnccl.so.2 (its own name)
#   PREFIX/include/nccl.h            Weft's header, ABI-identical to NCCL 2.28's
#   PREFIX/bin/weft                  the launcher, when built beside the library
#                                    (`weft run` then preloads PREFIX/lib/libnccl.so.2)
# Usage: install.sh PREFIX [LIBRARY]   (LIBRARY: a built libnccl.so; default:
# the workspace's target/release, else target/debug build)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
prefix=${1:?usage: install.sh PREFIX [LIBRARY]}
lib=${2:-}
if [ -z "$lib" ]; then
  for p in "$here/../../target/release/libnccl.so" "$here/../../target/debug/libnccl.so"; do
    if [ -f "$p" ]; then lib=$p; break; fi
  done
fi
[ -n "$lib" ] && [ -f "$lib" ] || { echo "install.sh: no built libnccl.so (cargo build -p weft-nccl)" >&2; exit 1; }
mkdir -p "$prefix/lib" "$prefix/include"
cp "$lib" "$prefix/lib/libnccl.so.2.tmp"
mv -f "$prefix/lib/libnccl.so.2.tmp" "$prefix/lib/libnccl.so.2"
ln -sf libnccl.so.2 "$prefix/lib/libnccl.so"
ln -sf libnccl.so.2 "$prefix/lib/libweft_nccl.so"
cp "$here/../include/nccl.h" "$prefix/include/nccl.h"
echo "installed $prefix/lib/libnccl.so.2 (from $lib) and $prefix/include/nccl.h"
weft=$(dirname "$lib")/weft
if [ -x "$weft" ]; then
  mkdir -p "$prefix/bin"
  cp "$weft" "$prefix/bin/weft.tmp"
  mv -f "$prefix/bin/weft.tmp" "$prefix/bin/weft"
  echo "installed $prefix/bin/weft (from $weft)"
fi
