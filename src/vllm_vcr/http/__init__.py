"""The ASGI toolkit every API family uses: the request context and body parsing (`serving_base`),
raw JSON and SSE responses (`sse`), the one streaming driver (`streaming`), vLLM's middleware
(`middleware`), the connection acceptor (`acceptor`) and faults applied to HTTP requests."""
