"""`vllm-vcr serve`: `vllm serve`'s command line, start-up and shutdown, and the ASGI app built
from the API families' route tables.

Python API: `vllm_vcr.serve.app.build_app(engine, tokenizer, settings)` returns the ASGI app for
a started `AsyncEngine`; `vllm_vcr.serve.server.serve(args)` runs the whole command as a coroutine.
"""
