#!/usr/bin/env bash
# Run `vllm-vcr play` against real vLLM frontends (0.32 CPU build and 0.33): installs the peers
# on first use (cached, see scripts/install-peers.sh), then runs the conformance suite.
#
# usage: scripts/run-conformance.sh [pytest args...]     e.g. -k 0.32   or   -x -v
# env:   VLLM_VCR_PEERS (cache dir), VLLM_VCR_CONFORMANCE_VERSIONS=0.32,0.33
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
"$ROOT/scripts/install-peers.sh"
# the suite runs `python -m vllm_vcr play` from this checkout whether or not it is pip-installed
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
exec python -m pytest -m conformance tests/conformance "$@"
