"""Regenerate src/vllm_vcr/serve/vllm_serve_args.json from the real `vllm serve` parsers.

    PYTHONPATH=src python scripts/update_vllm_serve_args.py            # the peers' 0.32 and 0.33
    PYTHONPATH=src python scripts/update_vllm_serve_args.py --check    # exit 1 if the file is stale

Each release's parser is dumped by scripts/dump_vllm_serve_args.py run with that release's python
(the venvs scripts/install-peers.sh installs); the dumps are merged oldest first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from vllm_vcr.serve.vllm_args import TABLE_PATH, merge_dumps  # noqa: E402

PEERS = Path(os.environ.get("VLLM_VCR_PEERS") or Path.home() / ".cache" / "vllm-vcr" / "peers")
VERSIONS = ("0.32", "0.33")


def dump(version: str) -> dict:
    python = PEERS / f"vllm-{version}" / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", PYTHONPATH="")
    out = subprocess.run([str(python), str(REPO / "scripts" / "dump_vllm_serve_args.py")], env=env,
                         capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout)


def render(table: dict) -> str:
    return json.dumps(table, indent=1, sort_keys=True) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    ap.add_argument("--versions", nargs="+", default=list(VERSIONS))
    args = ap.parse_args()
    text = render(merge_dumps([dump(v) for v in args.versions]))
    if args.check:
        same = TABLE_PATH.read_text(encoding="utf-8") == text
        print("up to date" if same else f"{TABLE_PATH} is stale: run {sys.argv[0]}")
        return 0 if same else 1
    TABLE_PATH.write_text(text, encoding="utf-8")
    print(f"wrote {TABLE_PATH} ({len(json.loads(text)['options'])} options)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
