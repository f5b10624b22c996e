"""The OpenAI Responses API (`/v1/responses`) as vLLM 0.32 serves it for a non-Harmony model."""
