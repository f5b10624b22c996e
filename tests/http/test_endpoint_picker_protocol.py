"""The model-server protocol of the Gateway API Inference Extension's endpoint picker.

The picker scrapes every pod's /metrics (every 50 ms by default), chooses the metric names by the
pod's engine-type label, and reads five things: queued requests, running requests, KV cache usage,
the KV cache's block size and block count (an info gauge's labels) and, for vLLM, the LoRA
adapters (`vllm:lora_requests_info`, the newest series by value). `PICKER` is its built-in table
for the two engine types `serve` simulates; `scrape` extracts as the picker does. A scraper runs
at the picker's period while requests are served and every snapshot must be complete and true.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from vllm_vcr.testing.waits import wait_until


# engine type -> (queued, running, kv usage, LoRA info, (cache info, block-size label, block-count label))
PICKER = {
    "vllm": ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
             "vllm:lora_requests_info", ("vllm:cache_config_info", "block_size", "num_gpu_blocks")),
    "sglang": ("sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage",
               None, ("sglang:cache_config_info", "page_size", "num_pages")),
}
SCRAPE_PERIOD = 0.05  # the picker's default refresh interval


def make_adapter(root, name: str) -> str:
    """A PEFT LoRA adapter directory (its config is what the server checks)."""
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                                       "target_modules": ["q_proj", "v_proj"]}))
    return str(d)


def scrape(client: httpx.Client, engine: str) -> dict:
    """One scrape, read as the picker reads it; a missing metric is an error, as in the picker."""
    queued, running, kv, lora, (info, bs_label, nb_label) = PICKER[engine]
    samples: dict[str, list] = {}
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append(s)

    def gauge(name: str) -> float:
        assert name in samples, f"{name} missing from /metrics"
        return sum(s.value for s in samples[name])

    assert info in samples, f"{info} missing from /metrics"
    labels = samples[info][0].labels
    snap = {"queued": gauge(queued), "running": gauge(running), "kv": gauge(kv),
            "block_size": int(labels[bs_label]), "num_blocks": int(labels[nb_label])}
    if lora is not None and lora in samples:
        newest = max(samples[lora], key=lambda s: s.value)
        snap["lora_running"] = [a for a in newest.labels["running_lora_adapters"].split(",") if a]
        snap["lora_waiting"] = [a for a in newest.labels["waiting_lora_adapters"].split(",") if a]
        snap["max_lora"] = int(newest.labels["max_lora"])
    return snap


class Scraper:
    """Scrapes one worker every SCRAPE_PERIOD seconds until stopped; keeps every snapshot."""

    def __init__(self, url: str, engine: str):
        self.snaps: list[dict] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._client = httpx.Client(base_url=url, timeout=10)
        self._engine = engine
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SCRAPE_PERIOD):
            try:
                self.snaps.append(scrape(self._client, self._engine))
            except BaseException as e:  # noqa: BLE001  reported by stop()
                self.errors.append(e)

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(30)
        self._client.close()
        if self.errors:
            raise self.errors[0]
        return self.snaps


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_picker_reads_true_values_while_serving(serve_process, tmp_path, engine):
    lora = engine == "vllm"
    extra = ["--enable-lora", "--lora-modules", f"sql={make_adapter(tmp_path, 'sql')}", "--max-loras", "2"] \
        if lora else []
    sp = serve_process("--engine-type", engine, "--time-to-first-token", "0", "--inter-token-latency", "25",
                       "--max-num-seqs", "2", "--kv-cache-size", "64", "--block-size", "16", *extra,
                       env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"})
    idle = scrape(httpx.Client(base_url=sp.url, timeout=10), engine)
    assert (idle["queued"], idle["running"], idle["kv"]) == (0, 0, 0)
    assert (idle["block_size"], idle["num_blocks"]) == (16, 64)

    scraper = Scraper(sp.url, engine)
    model = "sql" if lora else "vllm-vcr/sim"

    def one(i: int) -> httpx.Response:
        return httpx.post(sp.url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": f"request {i} " * 20, "max_tokens": 40, "ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    assert [r.status_code for r in results] == [200] * 4
    # the last scrape after the work is done shows an idle worker again
    n = len(scraper.snaps)
    wait_until(lambda: len(scraper.snaps) > n + 1, 10, "a scrape after the requests ended")
    snaps = scraper.stop()

    assert max(s["running"] for s in snaps) == 2, "never saw the two running requests"
    assert max(s["queued"] for s in snaps) >= 1, "never saw a queued request (max-num-seqs 2, 4 requests)"
    assert all(s["running"] <= 2 and s["queued"] <= 2 for s in snaps)
    assert all(0.0 <= s["kv"] <= 1.0 for s in snaps) and max(s["kv"] for s in snaps) > 0
    assert all((s["block_size"], s["num_blocks"]) == (16, 64) for s in snaps)
    last = snaps[-1]
    assert (last["queued"], last["running"], last["kv"]) == (0, 0, 0)
    if lora:
        assert any(s.get("lora_running") == ["sql"] for s in snaps), "the adapter never showed as running"
        assert all(s["max_lora"] == 2 for s in snaps if "max_lora" in s)
        assert last["lora_running"] == [] and last["lora_waiting"] == []
