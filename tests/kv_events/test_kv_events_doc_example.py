"""The subscriber example in docs/kv-events.md runs and recovers missed history through replay."""

from __future__ import annotations

import pathlib
import re
import threading
import time

import zmq

from vllm_vcr.kv_events import BlockRemoved, KVEventsConfig, create_publisher
from tests.conftest import scaled

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "kv-events.md"


def _example_source() -> str:
    text = DOC.read_text()
    marker = text.index("<!-- subscriber-example")
    m = re.compile(r"```python\n(.*?)```", re.S).search(text, marker)
    assert m, "example block not found"
    return m.group(1)


def test_doc_subscriber_example(tmp_path):
    ns: dict = {"__name__": "kv_sub_example"}
    exec(compile(_example_source(), str(DOC), "exec"), ns)

    ctx = zmq.Context()
    pub = create_publisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/pub",
                                          replay_endpoint=f"ipc://{tmp_path}/replay"), context=ctx)
    try:
        for i in range(3):  # history from before the subscriber existed
            pub.publish([BlockRemoved(block_hashes=[i], medium="GPU")])
        seen: list[tuple[int, list]] = []

        def handle(seq, payload):
            import msgspec
            seen.append((seq, msgspec.msgpack.decode(payload)[1][0]["block_hashes"]))

        t = threading.Thread(target=ns["run"], args=(pub.endpoint, pub.replay_endpoint),
                             kwargs={"max_batches": 8, "handle": handle}, daemon=True)
        t.start()
        deadline = time.monotonic() + scaled(10)
        i = 3
        while t.is_alive():  # keep the stream going until the example has read enough
            assert time.monotonic() < deadline, f"example stalled; saw {seen}"
            pub.publish([BlockRemoved(block_hashes=[i], medium="GPU")])
            i += 1
            t.join(0.02)
        seqs = [s for s, _ in seen]
        assert len(seqs) >= 8 and seqs == list(range(len(seqs)))  # no gap, no duplicate
        assert [h for _, h in seen] == [[s] for s in seqs]
    finally:
        pub.close(timeout=0.5)
        ctx.destroy(linger=0)
