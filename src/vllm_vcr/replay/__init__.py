"""Replaying traces: the planner that turns a trace into engine plans (`--replay-*`), and the
open-loop load generator behind `vllm-vcr replay-arrivals` (sessions, synthetic prompts)."""
