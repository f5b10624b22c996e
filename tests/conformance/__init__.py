"""vllm-vcr play against real vLLM frontends (see docs/play.md, "Conformance tests")."""
