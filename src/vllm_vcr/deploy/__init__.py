"""Running vllm-vcr in a container: the entrypoint's environment mapping and the health check."""
