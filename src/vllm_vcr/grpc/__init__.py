"""`serve --grpc`: the `VllmEngine` gRPC service of `smg-grpc-proto`, as `vllm serve --grpc` serves
it (vLLM 0.32 runs smg-grpc-servicer's servicer on --port instead of the HTTP server).

servicer.py answers the RPCs over the serve process's engine with the frontend's request checks;
kv_relay.py turns the engine's ZMQ KV-event batches into the proto's KvEventBatch stream;
server.py binds, starts and stops the grpc.aio server on serve's event loop.
"""
