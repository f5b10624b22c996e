"""vllm-vcr for tests: MockServer (a real `vllm-vcr serve`, in-process or a child process) and
the pytest plugin with the `vllm_vcr_server` fixture (installed with the package, entry point
`pytest11`). See docs/testing.md."""

from .config import MockServerConfig
from .server import MockServer, MockServerError
from .waits import free_port, scaled, timeout_scale, wait_http_ok, wait_until

__all__ = ["MockServer", "MockServerConfig", "MockServerError", "free_port", "scaled", "timeout_scale",
           "wait_http_ok", "wait_until"]
