"""Injected faults: HTTP failures, mid-stream faults, fault scripts and scripted gauges.

No network code here: `http/faults_adapter.py` applies the decisions to requests and
`control/server.py` exposes them (see docs/faults.md).
"""

from .catalogue import ERROR_KINDS, HTTPFailure, failure_for_kind, failure_for_status, parse_return_error
from .controller import RETURN_ERROR_HEADER, FaultController
from .gauges import GAUGES, GaugeFunction
from .rates import RATE_FIELDS, FaultRates
from .rules import ACTIONS, FaultAction, FaultSchemaError, FaultSpecError, RequestInfo, Rule

__all__ = ["ACTIONS", "ERROR_KINDS", "GAUGES", "RATE_FIELDS", "RETURN_ERROR_HEADER", "FaultAction", "FaultController",
           "FaultRates", "FaultSchemaError", "FaultSpecError", "GaugeFunction", "HTTPFailure", "RequestInfo", "Rule", "failure_for_kind",
           "failure_for_status", "parse_return_error"]
