#!/usr/bin/env bash
# Install the benchmark peers into cached venvs, one venv per tool:
#   $ROOT/dynamo    ai-dynamo frontend + mocker (Rust frontend, mock engine)
#   $ROOT/guidellm  guidellm (its `mock-server` is a peer; CPU torch)
#   $ROOT/aiperf    aiperf + openai + aiohttp (independent client for cross-checks)
# ROOT = ${VLLM_VCR_PEERS:-$HOME/.cache/vllm-vcr/peers}. The real-vLLM venvs of
# scripts/install-peers.sh live in the same ROOT under other names.
#
# usage: bench/install-peers-bench.sh [dynamo] [guidellm] [aiperf]   (default: all three)
# env:   PYTHON (python3.11), DYNAMO_VERSION (1.6.1), GUIDELLM_VERSION (0.8.1),
#        AIPERF_VERSION (0.13.0)
# Idempotent: a venv whose versions and imports check out is left alone.
set -euo pipefail
ROOT=${VLLM_VCR_PEERS:-$HOME/.cache/vllm-vcr/peers}
PYTHON=${PYTHON:-python3.11}
DYNAMO_VERSION=${DYNAMO_VERSION:-1.6.1}
GUIDELLM_VERSION=${GUIDELLM_VERSION:-0.8.1}
AIPERF_VERSION=${AIPERF_VERSION:-0.13.0}
mkdir -p "$ROOT"

mkvenv() {  # mkvenv DIR: create DIR as a venv with a current pip unless it already has one
  [[ -x $1/bin/python ]] && return 0
  "$PYTHON" -m venv "$1"
  "$1/bin/pip" install -q -U pip
}

# venv_ok DIR PYCODE: true when PYCODE runs cleanly in DIR's python
venv_ok() { [[ -x $1/bin/python ]] && "$1/bin/python" -c "$2" >/dev/null 2>&1; }

install_dynamo() {
  local v=$ROOT/dynamo
  local check="import importlib.metadata as m; assert m.version('ai-dynamo')=='$DYNAMO_VERSION'; assert m.version('ai-dynamo-runtime')=='$DYNAMO_VERSION'; import dynamo.mocker, dynamo.frontend"
  if venv_ok "$v" "$check"; then echo "dynamo: ok ($v)"; return; fi
  mkvenv "$v"
  # ai-dynamo depends on `aisimulate`, a stub wheel that downloads from a non-PyPI index
  # at install time; the mocker runs without it, so install ai-dynamo itself without deps
  # and name the dependencies it does need.
  "$v/bin/pip" install -q --no-deps "ai-dynamo==$DYNAMO_VERSION"
  "$v/bin/pip" install -q "ai-dynamo-runtime==$DYNAMO_VERSION" 'aiohttp>=3.14.3,<4' 'certifi' \
    'kubernetes>=32.0.1,<33' 'msgspec>=0.19' 'prometheus-client>=0.23.1,<1' 'pyzmq>=26' \
    'redis>=6.2,<9' tqdm 'transformers>=4.56' 'typing-extensions>=4.10' 'zstandard>=0.23,<1'
  venv_ok "$v" "$check" || { echo "dynamo: install check failed" >&2; return 1; }
  echo "dynamo: installed ($v)"
}

install_guidellm() {
  local v=$ROOT/guidellm
  local check="import importlib.metadata as m; assert m.version('guidellm')=='$GUIDELLM_VERSION'"
  if venv_ok "$v" "$check"; then echo "guidellm: ok ($v)"; return; fi
  mkvenv "$v"
  # Install CPU torch first: otherwise pip resolves the CUDA build plus ~3 GB of nvidia wheels.
  "$v/bin/pip" install -q "${GUIDELLM_TORCH:-torch==2.13.0}"
  "$v/bin/pip" install -q "guidellm==$GUIDELLM_VERSION"
  venv_ok "$v" "$check" || { echo "guidellm: install check failed" >&2; return 1; }
  echo "guidellm: installed ($v)"
}

install_aiperf() {
  local v=$ROOT/aiperf
  local check="import importlib.metadata as m; assert m.version('aiperf')=='$AIPERF_VERSION'; import openai, aiohttp"
  if venv_ok "$v" "$check"; then echo "aiperf: ok ($v)"; return; fi
  mkvenv "$v"
  "$v/bin/pip" install -q "aiperf==$AIPERF_VERSION" openai aiohttp
  venv_ok "$v" "$check" || { echo "aiperf: install check failed" >&2; return 1; }
  echo "aiperf: installed ($v)"
}

targets=("$@")
[[ ${#targets[@]} -eq 0 ]] && targets=(dynamo guidellm aiperf)
rc=0
for t in "${targets[@]}"; do
  case $t in
    dynamo|guidellm|aiperf) "install_$t" || rc=1 ;;
    *) echo "unknown peer: $t (want dynamo, guidellm or aiperf)" >&2; rc=2 ;;
  esac
done
exit $rc
