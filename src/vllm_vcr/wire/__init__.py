"""`vllm-vcr play`: serve a real vLLM frontend's requests from simulated EngineCores over vLLM's
engine-core ZMQ + msgpack protocol (see docs/play.md)."""
