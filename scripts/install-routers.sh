#!/usr/bin/env bash
# Install the real routers that `tests/routers` puts in front of `vllm-vcr serve` workers:
#
#   $CACHE/routers   a venv with vllm-router (vLLM's Rust router) and smg (the Shepherd/SGLang
#                    model gateway), both prebuilt binaries from PyPI, at pinned versions
#
# usage: scripts/install-routers.sh [CACHE_DIR]
# env:   VLLM_VCR_PEERS (default cache dir: $HOME/.cache/vllm-vcr/peers), PYTHON (default python3)
#
# Idempotent: the stamp file (written only after both binaries answer --help) makes a second run
# cost a second. First run: ~20 s and ~120 MB. Needs PyPI.
set -euo pipefail

CACHE=${VLLM_VCR_PEERS:-$HOME/.cache/vllm-vcr/peers}
case ${1:-} in
  -h|--help) sed -n 2,11p "$0"; exit 0 ;;
  "") ;;
  *) CACHE=$1 ;;
esac
PYTHON=${PYTHON:-python3}
VLLM_ROUTER=0.1.17
SMG=1.13.0
STAMP="vllm-router==$VLLM_ROUTER smg==$SMG"
VENV=$CACHE/routers
log() { echo "[install-routers] $*" >&2; }

mkdir -p "$CACHE"
exec 9>"$CACHE/.install.lock"  # one installer at a time per cache dir (shared with install-peers.sh)
flock 9

if [[ -f $VENV/.vllm-vcr-ready && $(cat "$VENV/.vllm-vcr-ready") == "$STAMP" ]]; then
  log "$STAMP already in $VENV"
  exit 0
fi
log "installing $STAMP into $VENV"
rm -f "$VENV/.vllm-vcr-ready"
[[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q -U pip 2> >(grep -v "is ignored: it is neither" >&2)
"$VENV/bin/pip" install -q "vllm-router==$VLLM_ROUTER" "smg==$SMG" 2> >(grep -v "is ignored: it is neither" >&2)
"$VENV/bin/vllm-router" --help >/dev/null
"$VENV/bin/smg" launch --help >/dev/null
echo "$STAMP" >"$VENV/.vllm-vcr-ready"
log "ready: $VENV/bin/vllm-router, $VENV/bin/smg"
