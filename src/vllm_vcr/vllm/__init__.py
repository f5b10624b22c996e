"""vLLM's own routes beyond the OpenAI API: management, LoRA, sleep, the scale-out
tokens-in/tokens-out, render and derender routes, and the `vllm:` Prometheus metrics."""
