"""Tool calls in chat: vLLM's request checks and gates, planned calls, and parsing them back."""
