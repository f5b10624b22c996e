"""bench/simulate_speed.py: the Mooncake-format file both sides replay holds the arrivals and
lengths it says, and our reader turns it into those requests (own blocks each); Dynamo is given the
deployment we simulate."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load():
    spec = importlib.util.spec_from_file_location("simulate_speed", BENCH / "simulate_speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_trace_is_what_both_sides_replay(tmp_path):
    ss = _load()
    path = tmp_path / "trace.jsonl"
    ss.write_trace(str(path), 300, "lognormal:1024:512", "lognormal:256:128", rate=25.0)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 300
    stamps = [r["timestamp"] for r in rows]
    assert stamps == sorted(stamps) and 6_000 < stamps[-1] < 18_000  # ~300 / 25 s of Poisson arrivals
    ids = [h for r in rows for h in r["hash_ids"]]
    assert len(ids) == len(set(ids))  # no block shared between requests
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 512) for r in rows)
    assert 700 < sum(r["input_length"] for r in rows) / 300 < 1400

    wl = ss.TraceWorkload.from_path(str(path))
    reqs = list(wl.open_arrivals())
    assert [len(r.prompt) for r in reqs] == [r["input_length"] for r in rows]
    assert [r.max_tokens for r in reqs] == [r["output_length"] for r in rows]
    assert [round(r.arrival * 1000) for r in reqs] == [s - stamps[0] for s in stamps]

    ss.write_trace(str(tmp_path / "again.jsonl"), 300, "lognormal:1024:512", "lognormal:256:128", rate=25.0)
    assert (tmp_path / "again.jsonl").read_text() == path.read_text()  # one seed, one trace



PEERS = Path(os.environ.get("VLLM_VCR_PEERS") or Path.home() / ".cache/vllm-vcr/peers")
DYNAMO = PEERS / "dynamo" / "bin" / "python"


def _deployment(engine_type: str = "vllm"):
    from vllm_vcr.engine.config import EngineArgs, EngineConfig

    return EngineArgs(config=EngineConfig(max_num_seqs=512, max_num_batched_tokens=4096), kv_cache_size=5000,
                      tokens_per_block=32, engine_type=engine_type).validate()


def test_dynamo_is_given_the_deployment_we_simulate():
    ss = _load()
    assert ss.dynamo_engine(_deployment()) == {"engine": {
        "block_size": 32, "num_gpu_blocks": 5000, "max_num_seqs": 512, "max_num_batched_tokens": 4096}}
    assert ss.dynamo_defaults(_deployment()) is None
    # --engine-type sglang: Dynamo's SGLang scheduler on both of its deployments
    assert ss.dynamo_engine(_deployment("sglang"))["engine"]["backend"] == "sglang"
    assert ss.dynamo_defaults(_deployment("sglang")) == {"engine": {"backend": "sglang"}}


@pytest.mark.skipif(not DYNAMO.exists(), reason="Dynamo's venv is a benchmark peer (bench/install-peers-bench.sh)")
def test_dynamo_replays_that_deployment():
    """The fields are the ones Dynamo's engine launch config takes (it refuses unknown ones): a
    short replay of our deployment runs, and one of Dynamo's defaults; each says what it simulated."""
    ss = _load()
    rows = [ss._dynamo(str(DYNAMO), 40, 8, e) for e in (ss.dynamo_engine(_deployment()), None)]
    rows += [ss._dynamo(str(DYNAMO), 40, 8, e) for e in (ss.dynamo_engine(_deployment("sglang")),
                                                         ss.dynamo_defaults(_deployment("sglang")))]
    assert [r["path"] for r in rows] == ["dynamo_offline_replay", "dynamo_defaults"] * 2
    assert all(r["requests"] == 40 and r["simulated_s"] > 0 and r["mean_tpot_ms"] > 0 for r in rows)
    assert rows[0]["simulated_s"] != rows[1]["simulated_s"]  # another KV shape: another load on its timing model
    assert rows[0]["simulated_s"] != rows[2]["simulated_s"]  # another scheduler


def test_disagg_runs_one_deployment_of_prefill_and_decode_workers_on_both_sides():
    """`--disagg 2:1`: ours is `simulate`'s disaggregated deployment (the same engine args on both
    sides), Dynamo's its disaggregated replay of those engine args and worker counts."""
    ss = _load()
    args, disagg = ss._disaggregation(_deployment(), "2:1")
    assert (args.worker_type, disagg.prefill_args.worker_type) == ("decode", "prefill")
    assert (disagg.prefill_workers, disagg.prefill_ranks, disagg.decode_workers) == (2, 1, 1)
    assert ss._disaggregation(_deployment(), None) == (_deployment(), None)
    engine = ss.dynamo_engine(_deployment())["engine"]
    replay = ss.dynamo_disagg(_deployment(), 2, 1)["disagg"]
    assert replay == {"prefill_engine_args": {"engine": {**engine, "worker_type": "prefill"}},
                      "decode_engine_args": {"engine": {**engine, "worker_type": "decode"}},
                      "num_prefill_workers": 2, "num_decode_workers": 1}
    row = ss._ours(args, "200", "8", 20, 4, 0, False, disagg)
    assert row["n"] == 20 and row["output_tokens"] == 20 * 8
    if DYNAMO.exists():  # (a benchmark peer: bench/install-peers-bench.sh)
        dyn = ss._dynamo(str(DYNAMO), 40, 8, ss.dynamo_disagg(_deployment(), 2, 1))
        assert dyn["path"] == "dynamo_offline_replay" and dyn["requests"] == 40 and dyn["simulated_s"] > 0
