"""Capturing traces from a real server: the engine-core ZMQ tap, the recording HTTP proxy, and
the `vllm-vcr record` CLI. Writes trace files through `trace/`."""
