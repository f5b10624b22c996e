"""`vllm-vcr fleet`: many mock workers in a few processes."""
