"""Forward-pass metrics (FPM): one record per engine step per DP rank, in the schema Dynamo's
planner and aiconfigurator-core consume, published on a ZMQ PUB socket per rank."""

from .record import (FPM_VERSION, ForwardPassMetrics, QueuedRequestMetrics, ScheduledRequestMetrics, decode,
                     encode)

__all__ = ["FPM_VERSION", "ForwardPassMetrics", "QueuedRequestMetrics", "ScheduledRequestMetrics", "decode",
           "encode"]
