"""Against an installed vLLM (scripts/install-peers.sh): its own code hashes and decodes.

Skipped unless a peer venv with vLLM exists under ${VLLM_VCR_PEERS:-~/.cache/vllm-vcr/peers}.
Each venv's python computes block hashes with vLLM's `hash_block_tokens` / `init_none_hash` and
decodes our encoded batch with vLLM's `KVEventBatch`; the results must match ours exactly.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

from vllm_vcr.engine.block_hash import make_block_hasher, request_block_hashes
from vllm_vcr.kv_events import KVEventBatch, KVEventCollector, encode_batch

pytestmark = pytest.mark.conformance

PEERS = pathlib.Path(os.environ.get("VLLM_VCR_PEERS", pathlib.Path.home() / ".cache" / "vllm-vcr" / "peers"))


def _peer_pythons() -> list[pathlib.Path]:
    if not PEERS.is_dir():
        return []
    found = sorted({*PEERS.glob("*/bin/python"), *PEERS.glob("*/*/bin/python")})
    return [p for p in found if list(p.parent.parent.glob("lib/python3*/site-packages/vllm/__init__.py"))]


SCRIPT = r"""
import json, os, sys
import msgspec
from vllm.utils.hashing import get_hash_fn_by_name
import vllm.v1.core.kv_cache_utils as kvu
from vllm.distributed.kv_events import KVEventBatch
args = json.loads(sys.argv[1])
out = {"version": __import__("vllm").__version__, "hashes": {}}
for algo in args["algos"]:
    os.environ["PYTHONHASHSEED"] = "0"
    fn = get_hash_fn_by_name(algo)
    try:
        kvu.init_none_hash(fn)
    except ModuleNotFoundError:  # xxhash is optional in vLLM too
        continue
    hs, parent = [], None
    toks = args["tokens"]
    bs = args["block_size"]
    for i in range(len(toks) // bs):
        keys = (("lora", "L", "/p"),) + ((("cache_salt", "s"),) if i == 0 else ())
        parent = kvu.hash_block_tokens(fn, parent, toks[i * bs:(i + 1) * bs], keys)
        hs.append(parent.hex())
    out["hashes"][algo] = hs
batch = msgspec.msgpack.Decoder(KVEventBatch).decode(bytes.fromhex(args["payload"]))
out["decoded"] = msgspec.to_builtins(batch)
print(json.dumps(out))
"""


@pytest.mark.skipif(not _peer_pythons(), reason="no peer vLLM venv installed")
@pytest.mark.parametrize("python", _peer_pythons() or [None], ids=lambda p: str(p))
def test_peer_vllm_agrees(python):
    toks = list(range(1000, 1040))
    algos = ["sha256", "sha256_cbor"]
    try:
        import xxhash  # noqa: F401
        algos += ["xxhash", "xxhash_cbor"]
    except ImportError:
        pass
    col = KVEventCollector(use_int_hashes=True)
    ours = {a: request_block_hashes(toks, 16, make_block_hasher(a, "0"), lora_name="L", lora_path="/p",
                                    cache_salt="s") for a in algos}
    col.stored(ours["sha256"], None, toks[:32], 16, "L", lora_id=1)
    col.removed(ours["sha256"][:1])
    col.cleared()
    payload = encode_batch(KVEventBatch(ts=5.0, events=col.drain(), data_parallel_rank=3))
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    res = subprocess.run([str(python), "-c", SCRIPT, json.dumps(
        {"algos": algos, "tokens": toks, "block_size": 16, "payload": payload.hex()})],
        capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert {"sha256", "sha256_cbor"} <= set(out["hashes"])
    for a in out["hashes"]:
        assert out["hashes"][a] == [h.hex() for h in ours[a]], (out["version"], a)
    ts, events, rank = out["decoded"]
    assert (ts, rank) == (5.0, 3)
    assert [e["type"] for e in events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert events[0]["block_hashes"] == [int.from_bytes(h[-8:], "big") for h in ours["sha256"]]
