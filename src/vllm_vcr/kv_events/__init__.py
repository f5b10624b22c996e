"""KV cache events: vLLM's ZMQ publisher protocol (the only place ZMQ is used for events).

Engine side::

    collector = KVEventCollector()            # pass to BlockPool(events=collector)
    publisher = create_publisher(parse_kv_events_config(json_text), data_parallel_rank=rank)
    ...                                       # once per engine step:
    publisher.publish(collector.drain())      # cheap, never blocks; no-op for an empty list
    ...
    publisher.close()
"""

from .config import (KVEventsConfig, KVEventsConfigError, add_kv_events_args, kv_events_config_from_cli,
                     parse_kv_events_config)
from .events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVEventCollector,
                     decode_batch, encode_batch)
from .publisher import END_SEQ, KVEventPublisher, NullEventPublisher, create_publisher, offset_endpoint_port

__all__ = [
    "AllBlocksCleared", "BlockRemoved", "BlockStored", "END_SEQ", "KVEventBatch", "KVEventCollector",
    "KVEventPublisher", "KVEventsConfig", "KVEventsConfigError", "NullEventPublisher",
    "add_kv_events_args", "create_publisher", "decode_batch", "encode_batch",
    "kv_events_config_from_cli", "offset_endpoint_port", "parse_kv_events_config",
]
