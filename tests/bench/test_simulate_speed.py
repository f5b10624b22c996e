"""bench/simulate_speed.py's trace workload: the Mooncake-format file both sides replay holds the
arrivals and lengths it says, and our reader turns it into those requests (own blocks each)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

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
