"""The ASGI toolkit every API family uses: the request context and body parsing (`serving_base`),
raw JSON and SSE responses (`sse`), the one streaming driver (`streaming`), routes as data
(`routes`), vLLM's middleware (`middleware`), the connection acceptor (`acceptor`), faults applied
to HTTP requests (`faults_adapter`), and the one module that relies on uvicorn's internals
(`uvicorn_internals`)."""
