"""vllm-vcr: a GPU-free stand-in for a vLLM inference engine."""
__version__ = "0.1.0"

_TESTING = ("MockServer", "MockServerConfig", "MockServerError")


def __getattr__(name: str):
    # `from vllm_vcr import MockServer` without importing httpx & co. for every `vllm-vcr` command
    if name in _TESTING:
        from . import testing

        return getattr(testing, name)
    raise AttributeError(f"module 'vllm_vcr' has no attribute {name!r}")
