#!/usr/bin/env bash
# Build the container image from ./Dockerfile, then print its size and how long the build took.
#
#   BASE        cuda: the Dockerfile's own base, nvidia/cuda from a registry: the image for GPU nodes
#               debian: a Debian bookworm base made on this machine (mmdebstrap), for machines
#               that reach no container registry (CI's image test, tests/deploy/test_image.py);
#               needs root, podman and mmdebstrap (or debootstrap)                          [cuda]
#   IMAGE       the tag to build                                                 [logprob-service]
#   TORCH_SPEC  the torch requirement [cuda: the Dockerfile's default, from PyTorch's index of its
#               TORCH_CUDA line (--build-arg TORCH_CUDA=cu126|cu128|cu130, with the matching
#               CUDA_IMAGE: Dockerfile); debian: torch==2.13.0+cpu, the CPU build pip finds through
#               this machine's find-links (TORCH_INDEX empty)]
#   ENGINE      docker or podman (debian: podman)       [docker if its daemon answers, else podman]
#   DEBIAN_BASE the Debian base image, made once and kept         [localhost/debian-base:bookworm]
#   DEBIAN_MIRROR  where the Debian base's packages come from         [http://deb.debian.org/debian]
#
# Further arguments go to `ENGINE build` (e.g. --no-cache, --build-arg CUDA_IMAGE=...).
#
# Everything else is the Dockerfile unchanged: BASE=debian sets only its base-image argument
# (CUDA_IMAGE) and TORCH_SPEC; its EXTRAS stays the default, server,gpu, as in the GPU image (the
# gpu extra's wheels install on CPU machines too; the server loads them only on CUDA). With
# podman, pip in the build gets this machine's pip settings (`pip config list`): its CA bundle and
# http(s) indexes, and with BASE=debian its find-links folders, where the CPU build of torch lies.
# `docker build` cannot mount them: docker builds use the public indexes as they are.
set -euo pipefail
cd "$(dirname "$0")/.."

BASE=${BASE:-cuda}
IMAGE=${IMAGE:-logprob-service}
DEBIAN_BASE=${DEBIAN_BASE:-localhost/debian-base:bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

say() { echo "build-image: $*" >&2; }
SCRATCH=() # temporary folders, removed on exit
trap 'rm -rf "${SCRATCH[@]}"' EXIT
die() {
  say "$*"
  exit 1
}

case "$BASE" in
  cuda) TORCH_SPEC=${TORCH_SPEC:-} ;;
  debian)
    TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}
    [ "${ENGINE:-podman}" = podman ] ||
      die "BASE=debian builds with podman (docker build cannot mount the find-links folder)"
    ENGINE=podman
    ;;
  *) die "BASE must be cuda or debian, not '$BASE'" ;;
esac
if [ -z "${ENGINE:-}" ]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then ENGINE=docker; else ENGINE=podman; fi
fi
command -v "$ENGINE" >/dev/null || die "no $ENGINE here (Debian: apt-get install podman mmdebstrap)"

# The Debian base: a minimal bookworm root filesystem as a one-layer image, made once, with
# mmdebstrap where it is installed (apt downloads in parallel: ~25 s here, against ~1 min for
# debootstrap), else debootstrap. Without apt's package lists and caches, as Debian's own images
# are (the Dockerfile runs apt-get update).
TRIM='var/lib/apt/lists/* var/cache/apt/*.bin var/cache/apt/archives/*.deb' # globs, in the root
make_debian_base() {
  podman image exists "$DEBIAN_BASE" && return
  [ "$(id -u)" = 0 ] || die "making the Debian base needs root"
  local start=$SECONDS tmp tool
  tool=$(command -v mmdebstrap debootstrap | head -n 1 || true)
  [ -n "$tool" ] || die "no mmdebstrap or debootstrap here (apt-get install mmdebstrap)"
  tool=$(basename "$tool")
  tmp=$(mktemp -d)
  SCRATCH+=("$tmp")
  say "making $DEBIAN_BASE with $tool from $DEBIAN_MIRROR"
  if [ "$tool" = mmdebstrap ]; then
    # The merged-usr hook, as debootstrap does it: without it mmdebstrap installs usrmerge, and perl
    # with it (+50 MB).
    mmdebstrap --variant=minbase --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
      --customize-hook="cd \"\$1\" && rm -rf $TRIM" \
      bookworm "$tmp/rootfs.tar" "$DEBIAN_MIRROR" >"$tmp/log" 2>&1 || die "$tool failed: $(tail -n 5 "$tmp/log")"
  else
    debootstrap --variant=minbase bookworm "$tmp/rootfs" "$DEBIAN_MIRROR" >"$tmp/log" 2>&1 ||
      die "$tool failed: $(tail -n 5 "$tmp/log")"
    # shellcheck disable=SC2086 # TRIM's globs expand in the root filesystem
    (cd "$tmp/rootfs" && rm -rf $TRIM && tar -cf "$tmp/rootfs.tar" .)
  fi
  podman import --quiet "$tmp/rootfs.tar" "$DEBIAN_BASE" >/dev/null
  rm -rf "$tmp"
  say "made $DEBIAN_BASE in $((SECONDS - start)) s"
}

# This machine's pip settings, for pip in the build: written to a pip.conf in a scratch folder
# that is mounted, read-only, at /root, root's home in the build (so pip reads
# .config/pip/pip.conf), beside the CA bundle and find-links folders. /root exists in every base
# image, so the mounts leave no mount points behind in the image (buildah would create missing
# ones, empty, in its layers).
PIP=(python3 -m pip)
pip_values() { # every value of pip setting $1, from config files and PIP_* variables alike
  { "${PIP[@]}" config list 2>/dev/null || true; } | sed -n "s/^[^.]*\.$1='\(.*\)'\$/\1/p" |
    tr ' ' '\n' | awk 'NF && !seen[$0]++'
}
pip_mounts() {
  local home=$1 conf=() n=0 cert value
  mkdir -p "$home/.config/pip"
  cert=$(pip_values cert | tail -n 1 || true)
  if [ -n "$cert" ] && [ -f "$cert" ]; then
    cp "$cert" "$home/ca-bundle.crt"
    conf+=("cert = /root/ca-bundle.crt")
  fi
  # A local index's pages may name their files by absolute path, which a mount elsewhere would
  # not keep: only http(s) indexes are carried; pip's default index (PyPI) has what they hold.
  value=$(pip_values index-url | grep -E '^https?://' | tail -n 1 || true)
  [ -z "$value" ] || conf+=("index-url = $value")
  value=$(pip_values extra-index-url | grep -E '^https?://' | paste -sd ' ' || true)
  [ -z "$value" ] || conf+=("extra-index-url = $value")
  value=$(pip_values trusted-host | paste -sd ' ' || true)
  [ -z "$value" ] || conf+=("trusted-host = $value")
  # find-links only for the CPU build: the default base's `torch==2.13.0` would otherwise take a
  # local CPU wheel (a local version, +cpu, sorts above PyPI's CUDA build).
  if [ "$BASE" = debian ]; then
    local links=()
    while read -r value; do
      if [ -d "$value" ]; then
        mkdir -p "$home/find-links/$n"
        MOUNTS+=(--volume "$value:/root/find-links/$n:ro")
        links+=("/root/find-links/$n")
        n=$((n + 1))
      elif [[ "$value" =~ ^https?:// ]]; then
        links+=("$value")
      fi
    done < <(pip_values find-links)
    [ ${#links[@]} = 0 ] || conf+=("find-links = ${links[*]}")
  fi
  printf '%s\n' "[global]" "${conf[@]}" >"$home/.config/pip/pip.conf"
  MOUNTS=(--volume "$home:/root:ro" "${MOUNTS[@]}")
}

args=(--tag "$IMAGE")
[ -z "$TORCH_SPEC" ] || args+=(--build-arg "TORCH_SPEC=$TORCH_SPEC")
# The Debian base's CPU torch comes from pip's own indexes and find-links, not PyTorch's CUDA index.
[ "$BASE" != debian ] || args+=(--build-arg "TORCH_INDEX=")
if [ "$ENGINE" = podman ]; then
  # chroot isolation: RUN steps need no OCI runtime, which cannot start containers on machines
  # like CI's (crun: setrlimit refused). Docker's image format: OCI's has no HEALTHCHECK.
  args+=(--isolation=chroot --format=docker)
  MOUNTS=()
  home=$(mktemp -d)
  SCRATCH+=("$home")
  pip_mounts "$home"
  args+=("${MOUNTS[@]}")
fi
if [ "$BASE" = debian ]; then
  make_debian_base
  args+=(--build-arg "CUDA_IMAGE=$DEBIAN_BASE")
fi

start=$SECONDS
say "$ENGINE build ${args[*]} $* ."
"$ENGINE" build "${args[@]}" "$@" .
elapsed=$((SECONDS - start))
size=$("$ENGINE" image inspect --format '{{.Size}}' "$IMAGE")
say "built $IMAGE in $elapsed s: $((size / 1000000)) MB"
