#!/usr/bin/env bash
# The images of docker/Dockerfile without a docker engine: a Debian bookworm
# root fs (the Dockerfile's debian:bookworm-slim with the same packages) plus
# what docker/build-release.sh built, written as docker-archive tarballs
# that `ctr images import`, `kind load image-archive` or `docker load` take.
# Each image is two layers: the root fs (one layer, shared by all three, so a
# node stores it once) and the image's own files, at the Dockerfile's paths.
#
#   docker/rootfs-images.sh rootfs DIR
#       make DIR a Debian bookworm minbase root fs with ca-certificates,
#       libibverbs1 and ibverbs-providers (debootstrap, root, ~1 min)
#   docker/rootfs-images.sh images ROOTFS BIN OUTDIR [TAG] [REPO]
#       write OUTDIR/{weft-operator,weft,weft-examples}.tar, tagged
#       REPO/<name>:TAG (default ghcr.io/weft-dev/<name>:0.1.0), from the root fs
#       ROOTFS and BIN, the output directory of docker/build-release.sh
set -euo pipefail

rootfs() {
  local d=$1
  command -v debootstrap >/dev/null || { echo "rootfs-images.sh: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
  debootstrap --variant=minbase --include=ca-certificates,libibverbs1,ibverbs-providers \
    bookworm "$d" http://deb.debian.org/debian >"$d.debootstrap.log" 2>&1 \
    || { tail -5 "$d.debootstrap.log" >&2; exit 1; }
  rm -rf "$d"/var/cache/apt/archives/*.deb "$d"/var/lib/apt/lists/*_Packages "$d"/var/log/*.log
  echo "Debian root fs in $d ($(du -sh "$d" | cut -f1))"
}

# layer DIR WORK -> the layer's diff id; WORK/<id>/layer.tar holds it.
layer() {
  local dir=$1 work=$2 id
  tar -C "$dir" --numeric-owner --owner=0 --group=0 --sort=name --mtime=@0 -cf "$work/layer.tmp" .
  id=$(sha256sum "$work/layer.tmp" | cut -d' ' -f1)
  mkdir -p "$work/$id"
  mv "$work/layer.tmp" "$work/$id/layer.tar"
  echo "$id"
}

# image REF ARCHIVE BASE_ID FILES_DIR CONFIG_JSON (the "config" object)
image() {
  local ref=$1 archive=$2 base=$3 files=$4 config=$5 work id cfg cid
  work=$(mktemp -d "${TMPDIR:-/tmp}/weft-image.XXXXXX")
  ln "$LAYERS/$base/layer.tar" "$work/base.tar" 2>/dev/null || cp "$LAYERS/$base/layer.tar" "$work/base.tar"
  mkdir -p "$work/$base"
  mv "$work/base.tar" "$work/$base/layer.tar"
  id=$(layer "$files" "$work")
  cfg=$(printf '{"architecture":"amd64","os":"linux","created":"1970-01-01T00:00:00Z","config":%s,"rootfs":{"type":"layers","diff_ids":["sha256:%s","sha256:%s"]},"history":[{"created":"1970-01-01T00:00:00Z","created_by":"debian bookworm minbase"},{"created":"1970-01-01T00:00:00Z","created_by":"docker/rootfs-images.sh"}]}' \
    "$config" "$base" "$id")
  cid=$(printf '%s' "$cfg" | sha256sum | cut -d' ' -f1)
  printf '%s' "$cfg" >"$work/$cid.json"
  printf '[{"Config":"%s.json","RepoTags":["%s"],"Layers":["%s/layer.tar","%s/layer.tar"]}]' \
    "$cid" "$ref" "$base" "$id" >"$work/manifest.json"
  tar -C "$work" -cf "$archive" manifest.json "$cid.json" "$base" "$id"
  rm -rf "$work"
  echo "wrote $archive ($ref, $(du -h "$archive" | cut -f1))"
}

# put DIR SRC DST MODE: SRC at DST inside DIR.
put() {
  mkdir -p "$1$(dirname "$3")"
  install -m "$4" "$2" "$1$3"
}

PATHS='["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]'

images() {
  local root=$1 bin=$2 out=$3 tag=${4:-0.1.0} repo=${5:-ghcr.io/weft-dev}
  for f in weft-operator weft libnccl.so.2 resilient-train nccl-dropin otlp-sink; do
    [ -f "$bin/$f" ] || { echo "rootfs-images.sh: $bin/$f missing (docker/build-release.sh $bin)" >&2; exit 1; }
  done
  mkdir -p "$out"
  local work; work=$(mktemp -d "${TMPDIR:-/tmp}/weft-images.XXXXXX")
  LAYERS=$work/layers; mkdir -p "$LAYERS"
  local base; base=$(layer "$root" "$LAYERS")
  # As the Dockerfile's stages: weft-operator, weft, weft-examples (FROM weft).
  local op=$work/operator dp=$work/weft ex=$work/examples
  put "$op" "$bin/weft-operator" /usr/local/bin/weft-operator 0755
  put "$dp" "$bin/weft" /usr/local/bin/weft 0755
  put "$dp" "$bin/libnccl.so.2" /usr/lib/weft/libnccl.so.2 0644
  mkdir -p "$ex"; cp -a "$dp/." "$ex/"
  put "$ex" "$bin/resilient-train" /usr/local/bin/resilient-train 0755
  put "$ex" "$bin/nccl-dropin" /usr/local/bin/nccl-dropin 0755
  put "$ex" "$bin/otlp-sink" /usr/local/bin/otlp-sink 0755
  image "$repo/weft-operator:$tag" "$out/weft-operator.tar" "$base" "$op" \
    "{\"Env\":$PATHS,\"Entrypoint\":[\"/usr/local/bin/weft-operator\"],\"Cmd\":[\"run\"],\"User\":\"65532:65532\",\"WorkingDir\":\"/\"}"
  for i in "weft $dp" "weft-examples $ex"; do
    set -- $i
    image "$repo/$1:$tag" "$out/$1.tar" "$base" "$2" \
      "{\"Env\":$PATHS,\"Cmd\":[\"weft\",\"sidecar\"],\"WorkingDir\":\"/\"}"
  done
  rm -rf "$work"
}

case "${1:-}" in
  rootfs) rootfs "${2:?usage: rootfs DIR}" ;;
  images) shift; images "${1:?ROOTFS}" "${2:?BIN}" "${3:?OUTDIR}" "${4:-}" "${5:-}" ;;
  *) sed -n '2,16p' "$0"; exit 2 ;;
esac
