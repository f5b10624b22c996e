"""`vllm-vcr serve`: the OpenAI-compatible frontend (vLLM's API, in front of the simulated engine).

Python API: `vllm_vcr.http.app.build_app(engine, tokenizer, settings)` returns the ASGI app for a
started `AsyncEngine`; `vllm_vcr.http.server.serve(args)` runs the whole command as a coroutine.
Modules: cli (flags), ignored_flags, settings (validated flags, tokenizer), server (start-up,
shut-down, signals), app (routing, auth, small endpoints),
serving_completion / serving_chat (the two generation endpoints), generation (engine requests,
output state, stop strings), protocol (request schemas), errors, sse, tokenizer, chat_template,
logprobs, metrics (Prometheus, written separately).
"""
