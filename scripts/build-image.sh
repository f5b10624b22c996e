#!/usr/bin/env bash
# Build the vllm-vcr container image with podman, on a machine that reaches package registries
# but no image registry (CI here): the base image is made from Debian packages with debootstrap,
# the wheels are built on the host, and the build itself needs no network.
#
# usage: scripts/build-image.sh [--tag TAG] [--base IMAGE] [--prepare] [--check]
#   --tag TAG     image name (default localhost/vllm-vcr:dev)
#   --base IMAGE  build FROM this image instead of the debootstrap base (pip may then use the index);
#                 without root for debootstrap the script takes docker.io/library/python:3.12-slim
#   --prepare     only install the tools and make the base image (the slow, cached part)
#   --check       only report whether podman can run a container here (exit 0 yes, 1 no + reason)
#   --context     only stage the build context (no podman needed) and print its directory, for
#                 `docker build -f Containerfile "$(scripts/build-image.sh --context)"`
# env:   VLLM_VCR_IMAGE_CACHE (default $HOME/.cache/vllm-vcr/image): rootfs tarball and wheelhouse
#
# Cached: the base rootfs (tarball + podman image, ~75 s the first time), the dependency
# wheelhouse (keyed on the requirements and the Python version) and podman's layer for the
# dependencies, so a second run only redoes vllm-vcr's wheel and the final root file system (~1 min).
# Needs root for apt-get/debootstrap the first time; installs podman, debootstrap and runc if absent.
set -euo pipefail
shopt -s inherit_errexit

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${VLLM_VCR_IMAGE_CACHE:-$HOME/.cache/vllm-vcr/image}
TAG=localhost/vllm-vcr:dev
BASE_TAG=localhost/vllm-vcr-base:bookworm-build
BASE=""
CHECK=0
PREPARE=0
CONTEXT=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --tag) TAG=$2; shift 2 ;;
    --base) BASE=$2; shift 2 ;;
    --check) CHECK=1; shift ;;
    --prepare) PREPARE=1; shift ;;
    --context) CONTEXT=1; shift ;;
    -h|--help) sed -n 2,19p "$0"; exit 0 ;;
    *) echo "build-image.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
# Inside an unprivileged CI container without systemd (this project's CI) podman needs
# deploy/containers.conf (no ulimits, cgroupfs, runc); a desktop or CI runner with systemd keeps its
# own configuration. An explicit CONTAINERS_CONF wins.
SANDBOX_CONF=0
if [[ -z ${CONTAINERS_CONF:-} && ! -d /run/systemd/system ]]; then
  export CONTAINERS_CONF=$HERE/deploy/containers.conf
  SANDBOX_CONF=1
fi
REGISTRY_BASE=docker.io/library/python:3.12-slim
log() { echo "[build-image] $*" >&2; }
mkdir -p "$CACHE"
exec 9>"$CACHE/.build.lock"
flock 9

install_tools() {
  local missing=()
  local can_apt=0
  [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null && can_apt=1
  command -v podman >/dev/null || missing+=(podman)
  [[ $SANDBOX_CONF -eq 0 ]] || command -v runc >/dev/null || missing+=(runc)
  if [[ -z $BASE ]] && ! podman image exists "$BASE_TAG" 2>/dev/null && ! command -v debootstrap >/dev/null; then
    if [[ $can_apt -eq 1 ]]; then
      missing+=(debootstrap)
    else  # a desktop: no root for debootstrap, but a registry
      log "no debootstrap (needs root + apt): building FROM $REGISTRY_BASE, dependencies from PyPI"
      BASE=$REGISTRY_BASE
    fi
  fi
  [[ ${#missing[@]} -eq 0 ]] && return 0
  if [[ $can_apt -eq 0 ]]; then
    echo "podman unavailable: ${missing[*]} missing and cannot apt-get install them (needs root + apt)" >&2
    return 1
  fi
  log "installing ${missing[*]}"
  [[ -f $CACHE/.apt-updated ]] || { apt-get update -q >/dev/null && touch "$CACHE/.apt-updated"; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null
}

# podman must be able to start a container here (user namespaces, mounts, a runtime)
podman_works() {
  local out
  if ! out=$(podman run --rm --network host "${BASE:-$BASE_TAG}" true 2>&1); then
    echo "podman cannot run containers here: ${out##*$'\n'}" >&2
    return 1
  fi
}

build_base() {
  podman image exists "$BASE_TAG" && return 0
  local tarball=$CACHE/base-bookworm-build.tar
  if [[ ! -s $tarball ]]; then
    local rootfs=$CACHE/rootfs.tmp
    rm -rf "$rootfs"
    # the build stage's base; binutils: strip. The image itself is a FROM scratch copy of what runs.
    log "debootstrap bookworm (minbase + python3, binutils) into $rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,binutils bookworm "$rootfs" \
      >"$CACHE/debootstrap.log" 2>&1 || { tail -20 "$CACHE/debootstrap.log" >&2; return 1; }
    # what a container never needs: downloaded .debs, package lists, docs, man pages, locales
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
           "$rootfs"/usr/share/doc "$rootfs"/usr/share/man "$rootfs"/usr/share/info "$rootfs"/usr/share/locale
    tar -C "$rootfs" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
    rm -rf "$rootfs"
  fi
  log "importing the base image $BASE_TAG"
  podman import --quiet "$tarball" "$BASE_TAG" >/dev/null
}

# context/dist: the vllm-vcr wheel + requirements.txt; context/wheels: the dependencies' wheels
stage_context() {
  local ctx=$CACHE/context py
  rm -rf "$ctx/dist" "$ctx/image" && mkdir -p "$ctx/dist" "$ctx/wheels" "$ctx/image"
  cp "$HERE/deploy/image/slim.py" "$ctx/image/"
  py=${PYTHON:-python3}
  "$py" - "$HERE/pyproject.toml" >"$ctx/dist/requirements.txt" <<'EOF'
import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))
EOF
  # a cached build venv: an isolated pip build would reinstall setuptools every time (~15 s)
  if [[ ! -x $CACHE/buildenv/bin/python ]]; then
    "$py" -m venv "$CACHE/buildenv.tmp" && "$CACHE/buildenv.tmp/bin/pip" install -q "setuptools>=68" wheel \
      2> >(grep -v "is ignored: it is neither" >&2) && mv "$CACHE/buildenv.tmp" "$CACHE/buildenv"
  fi
  # from a copy: setuptools writes build/ and *.egg-info next to the sources it builds
  rm -rf "$CACHE/src" && mkdir -p "$CACHE/src"
  cp -r "$HERE/pyproject.toml" "$HERE/README.md" "$HERE/src" "$CACHE/src/"
  find "$CACHE/src" \( -name __pycache__ -o -name '*.egg-info' \) -prune -exec rm -rf {} +
  "$CACHE/buildenv/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$ctx/dist" "$CACHE/src" \
    2> >(grep -v "is ignored: it is neither" >&2)
  if [[ -z $BASE ]]; then  # the debootstrap base: bookworm's python3.11, wheels built here must match
    local key
    key=$( (cat "$ctx/dist/requirements.txt"; "$py" -c 'import sys; print(sys.version_info[:2])') | sha256sum | cut -c1-16)
    if [[ ! -f $ctx/wheels/.key-$key ]]; then
      "$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || {
        echo "build-image.sh: the Debian base has Python 3.11; run with PYTHON=python3.11" >&2; return 1; }
      log "building the dependency wheelhouse"
      rm -rf "$ctx/wheels" && mkdir -p "$ctx/wheels"
      "$py" -m pip wheel -q -w "$ctx/wheels" -r "$ctx/dist/requirements.txt" 2> >(grep -v "is ignored: it is neither" >&2)
      touch "$ctx/wheels/.key-$key"
    fi
  fi
  echo "$ctx"
}

main() {
  if [[ $CONTEXT -eq 1 ]]; then  # for docker build: FROM the registry's Python, dependencies from PyPI
    BASE=${BASE:-$REGISTRY_BASE}
    stage_context
    return
  fi
  install_tools || return 1
  [[ -n $BASE ]] || build_base
  if [[ $CHECK -eq 1 ]]; then podman_works; return; fi
  [[ $PREPARE -eq 1 ]] && return 0
  local ctx
  ctx=$(stage_context)
  local base=${BASE:-$BASE_TAG} index_args="--no-index"
  [[ -n $BASE ]] && index_args=""
  log "podman build $TAG (FROM $base)"
  local previous
  previous=$(podman image inspect --format '{{.Id}}' "$TAG" 2>/dev/null || true)
  podman build --quiet --format docker --network host --layers \
    --build-arg BASE="$base" --build-arg PIP_INDEX_ARGS="$index_args" \
    -f "$HERE/Containerfile" -t "$TAG" "$ctx" >/dev/null
  # the image this tag named before: untagged now, it would pile up run after run (the layer cache stays)
  if [[ -n $previous && $previous != $(podman image inspect --format '{{.Id}}' "$TAG") ]]; then
    podman rmi "$previous" >/dev/null 2>&1 || true
  fi
  # the build stage's last image is no one's parent once the final stage copied from it: without
  # this every build would leave one (~300 MB) behind; the cached dependency layer has children
  podman image prune -f --filter label=io.github.vllm-vcr.stage=build >/dev/null 2>&1 || true
  log "built $TAG: $(podman image inspect --format '{{.Size}}' "$TAG" | numfmt --to=iec) "\
"(base $(podman image inspect --format '{{.Size}}' "$base" | numfmt --to=iec))"
}

main
