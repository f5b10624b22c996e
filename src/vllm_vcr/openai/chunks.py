"""The SSE chunks of the OpenAI streams (`chat.completion.chunk`, `text_completion`), from one
template per stream.

A stream's chunks all start with the same bytes (`data: {"id":..,"object":..,"created":..,
"model":..,"choices":[{"index":`) and its last one may carry the fingerprint. `ChunkTemplate`
JSON-escapes the variable parts (request id, model name, fingerprint) once, when the stream
starts; every chunk of the stream — the per-token fast case, the steady batch's columns, the
full path, the tool-call stream, the usage chunk — is made from its pieces, so no chunk head is
written anywhere else.
"""

from __future__ import annotations

from typing import Any

from ..http.serving_base import encode

CHAT_CHUNK = b"chat.completion.chunk"
COMPLETION_CHUNK = b"text_completion"

# a chunk's usage of the three counts only (vLLM drops the null token details): %d prompt, total
# and completion tokens
USAGE_COUNTS = b',"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}'


class ChunkTemplate:
    """The fixed parts of one stream's chunks, escaped once.

    `prefix`: the chunk up to and including the model (`data: {"id":..,"model":..`);
    `choice(i)`: the head of a chunk for choice i, up to its index;
    `fingerprint`: `,"system_fingerprint":..` or b"" (vLLM writes it on the last chunk).
    """

    __slots__ = ("prefix", "_choices", "fingerprint")

    def __init__(self, obj: bytes, request_id: str, created: int, model: str, fingerprint: str | None) -> None:
        self.prefix = (b'data: {"id":' + encode(request_id) + b',"object":"' + obj + b'","created":'
                       + b"%d" % created + b',"model":' + encode(model))
        self._choices = self.prefix + b',"choices":[{"index":'
        self.fingerprint = b"" if fingerprint is None else b',"system_fingerprint":' + encode(fingerprint)

    def choice(self, i: int) -> bytes:
        """A chunk's bytes up to choice i's index (its fields follow: `,"delta":..` or `,"text":..`)."""
        return self._choices + b"%d" % i

    def chunk(self, choice: dict[str, Any], last: bool = False) -> bytes:
        """A whole chunk with one choice given as a dict (`last`: the fingerprint rides on it)."""
        return (self.prefix + b',"choices":[' + encode(choice) + b"]" + (self.fingerprint if last else b"")
                + b"}\n\n")

    def usage_chunk(self, usage: dict[str, Any], metrics: dict[str, Any] | None = None) -> bytes:
        """The trailing usage chunk (`stream_options.include_usage`): no choices, the usage
        without its null fields, then the fingerprint and the per-request `metrics` (its null
        fields dropped too)."""
        tail = b"}\n\n" if metrics is None else b',"metrics":' + encode(_drop_none(metrics)) + b"}\n\n"
        return self.prefix + b',"choices":[],"usage":' + encode(_drop_none(usage)) + self.fingerprint + tail

    def usage_counts_format(self) -> bytes:
        """`usage_chunk`'s bytes for a usage of the three counts only, as a `%`-format of the
        prompt, total and completion tokens (the template's own `%` signs doubled)."""
        return (self.prefix.replace(b"%", b"%%") + b',"choices":[]' + USAGE_COUNTS
                + self.fingerprint.replace(b"%", b"%%") + b"}\n\n")


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (_drop_none(v) if isinstance(v, dict) else v) for k, v in d.items() if v is not None}
