# Building the images from the workspace and getting them onto the nodes
# (sourced by e2e/run.sh). Three images, as docker/Dockerfile's stages:
# $REPO/weft-operator, $REPO/weft (sidecar, `weft run`, `weft bench`,
# libnccl.so.2) and $REPO/weft-examples (weft + resilient-train, nccl-dropin,
# otlp-sink), all tagged $TAG.
#
# IMAGES, how they are built:
#   rootfs  cargo on this machine (docker/build-release.sh into $WORK/bin) and
#           docker/rootfs-images.sh (a Debian root fs made once in
#           $WORK/rootfs, needs root and debootstrap): no docker engine
#   docker  docker build -f docker/Dockerfile --target ...
#   none    they are there already (a registry: set REPO and TAG)
# LOADER, how they reach the nodes:
#   k8s-cluster  ctr import into this machine's containerd (the local cluster
#                of k8s-cluster/, whose only node is this machine)
#   kind         kind load into $KIND_CLUSTER
#   none         nodes pull them from $REPO
IMAGE_NAMES=(weft-operator weft weft-examples)

build_images() {
  case "$IMAGES" in
    rootfs)
      log "building release binaries (docker/build-release.sh $WORK/bin)"
      (cd "$ROOT" && docker/build-release.sh "$WORK/bin") | tail -1
      if [[ ! -x "$WORK/rootfs/bin/sh" ]]; then
        log "making the Debian root fs $WORK/rootfs (once)"
        rm -rf "$WORK/rootfs"
        "$ROOT/docker/rootfs-images.sh" rootfs "$WORK/rootfs"
      fi
      "$ROOT/docker/rootfs-images.sh" images "$WORK/rootfs" "$WORK/bin" "$WORK/images" "$TAG" "$REPO"
      ;;
    docker)
      local n
      for n in "${IMAGE_NAMES[@]}"; do
        docker build -f "$ROOT/docker/Dockerfile" --target "$n" -t "$REPO/$n:$TAG" "$ROOT"
      done
      ;;
    none) log "images: using $REPO/{${IMAGE_NAMES[*]}}:$TAG as they are" ;;
    *) fail "IMAGES=$IMAGES: rootfs, docker or none" ;;
  esac
}

# The archive of image N: written by rootfs-images.sh, or saved from docker.
image_archive() {
  if [[ "$IMAGES" == docker ]]; then
    docker save -o "$WORK/images/$1.tar" "$REPO/$1:$TAG"
  fi
  echo "$WORK/images/$1.tar"
}

load_images() {
  local n
  mkdir -p "$WORK/images"
  case "$LOADER" in
    k8s-cluster)
      for n in "${IMAGE_NAMES[@]}"; do
        ctr -n k8s.io images import --snapshotter overlayfs "$(image_archive "$n")" >/dev/null
        log "imported $REPO/$n:$TAG into containerd (k8s.io)"
      done
      ;;
    kind)
      for n in "${IMAGE_NAMES[@]}"; do
        if [[ "$IMAGES" == docker ]]; then
          kind load docker-image --name "$KIND_CLUSTER" "$REPO/$n:$TAG"
        else
          kind load image-archive --name "$KIND_CLUSTER" "$(image_archive "$n")"
        fi
      done
      ;;
    none) ;;
    *) fail "LOADER=$LOADER: k8s-cluster, kind or none" ;;
  esac
}

# node_kill NODE CONTAINER_ID: SIGKILL a container's process on its node, as
# a crash would (kubectl cannot: inside the container PID 1 ignores it).
node_kill() {
  local node=$1 id=${2#containerd://}
  case "$LOADER" in
    k8s-cluster) ctr -n k8s.io task kill -s SIGKILL "$id" ;;
    kind) docker exec "$node" ctr -n k8s.io task kill -s SIGKILL "$id" ;;  # kind's nodes are containers
    *) return 1 ;;
  esac
}
