"""vllm-vcr: a GPU-free stand-in for a vLLM inference engine."""
__version__ = "0.1.0"

_TESTING = ("MockServer", "MockServerConfig", "MockServerError")


def __getattr__(name: str):
    # `from vllm_vcr import MockServer`: a re-export resolved on first access, so that no
    # `vllm-vcr` command imports httpx & co., and importing the package runs no submodule
    # (every module imports __version__ from here; an import statement would read as a cycle)
    if name in _TESTING:
        import importlib

        return getattr(importlib.import_module("vllm_vcr.testing"), name)
    raise AttributeError(f"module 'vllm_vcr' has no attribute {name!r}")
