"""Prefill/decode disaggregation, network side: KV release side channel (vLLM NixlConnector flow),
Dynamo-style bootstrap handoff, start-up wiring, and the `pd-proxy` two-step router.

The engine side (holds, pulls, shared bandwidth) lives in engine/; see docs/disaggregation.md.
"""

from .services import PDServices, start_pd_services

__all__ = ["PDServices", "start_pd_services"]
