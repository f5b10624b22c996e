"""msgpack encoding and decoding for vLLM's engine-core frames (vllm-protocol.md §3-§5).

Outputs are encoded with one reusable encoder (the hot path). Requests are decoded typed first
(fast); a body the typed decoder rejects is decoded untyped and read positionally, so a frontend
whose EngineCoreRequest grew, shrank or changed a field we do not use still gets served.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..engine.types import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    RequestError,
    RequestFieldError,
    UtilityOutput,
    check_lora_request,
    request_from_fields,
)

# Raw byte values of EngineCoreRequestType (not msgpack).
ADD = b"\x00"
ABORT = b"\x01"
START_DP_WAVE = b"\x02"
UTILITY = b"\x03"
REQUEST_TYPE_NAMES = {ADD: "ADD", ABORT: "ABORT", START_DP_WAVE: "START_DP_WAVE", UTILITY: "UTILITY",
                      b"\x04": "EXECUTOR_FAILED", b"\x05": "WAKEUP"}

ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
COORDINATOR_READY = b"READY"

EXT_RAW_VIEW = 3  # vLLM's CUSTOM_TYPE_RAW_VIEW: raw bytes of an ndarray/tensor
EXT_PICKLE, EXT_CLOUDPICKLE = 1, 2

N_REQUEST_FIELDS = len(EngineCoreRequest.__struct_fields__)


class FrameError(ValueError):
    """A frame we cannot use; the message says why (it is logged, never fatal)."""

    def __init__(self, reason: str, request_id: str | None = None, client_index: int = 0):
        super().__init__(reason)
        self.request_id = request_id
        self.client_index = client_index


class RawView(bytes):
    """Bytes of an Ext 3 payload, kept as-is (we never need the array's values)."""


class UnusableExt:
    """An extension value in a field we read: kept only to name the field in the error."""

    def __init__(self, code: int) -> None:
        self.code = code

    def __repr__(self) -> str:
        return f"<msgpack extension {self.code}>"


class _LenientExtHook:
    """Reads past extensions to find out *which* request is bad; pickles are never unpickled."""

    def __init__(self) -> None:
        self.refused: list[int] = []

    def __call__(self, code: int, data: memoryview) -> Any:
        if code == EXT_RAW_VIEW:
            return RawView(data)
        self.refused.append(code)
        return UnusableExt(code)


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == EXT_RAW_VIEW:
        return RawView(data)
    if code in (EXT_PICKLE, EXT_CLOUDPICKLE):
        # Sent only with VLLM_ALLOW_INSECURE_SERIALIZATION; never unpickle a peer's bytes.
        raise FrameError(f"pickled msgpack extension {code} refused")
    raise FrameError(f"unknown msgpack extension type {code}")


def _enc_hook(obj: Any) -> Any:
    # numpy arrays (logprobs) go inline as vLLM's [dtype.str, shape, Ext 3]; the frontend accepts
    # inline data whatever the size, so we never need aux frames.
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        np = None
    if np is not None:
        if isinstance(obj, np.ndarray):
            arr = np.ascontiguousarray(obj)
            return [arr.dtype.str, list(arr.shape), msgspec.msgpack.Ext(EXT_RAW_VIEW, arr.tobytes())]
        if isinstance(obj, np.generic):
            return obj.item()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__} for the wire")


class Codec:
    """One per process: encoders/decoders are reusable and not thread-bound (single loop)."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._req_decoder = msgspec.msgpack.Decoder(EngineCoreRequest, ext_hook=_ext_hook)
        self._any_decoder = msgspec.msgpack.Decoder(ext_hook=_ext_hook)
        self._lenient_ext = _LenientExtHook()
        self._lenient_decoder = msgspec.msgpack.Decoder(ext_hook=self._lenient_ext)

    # ---- generic -------------------------------------------------------------------------
    def encode(self, obj: Any) -> bytes:
        return self.encoder.encode(obj)

    def decode_any(self, buf: bytes | memoryview) -> Any:
        try:
            return self._any_decoder.decode(buf)
        except FrameError:
            raise
        except Exception as e:  # noqa: BLE001 - msgspec.DecodeError and friends
            raise FrameError(f"undecodable msgpack: {e}") from None

    # ---- inputs --------------------------------------------------------------------------
    def decode_add(self, frames: list) -> EngineCoreRequest:
        """frames = [body, aux...]; aux buffers only back ndarray fields we never read.

        Every field the engine reads is checked here: a bad one is a FrameError naming the
        request (when its id can be read), which the request fails with; the engine never sees it."""
        body = frames[0]
        try:
            req = self._req_decoder.decode(body)
        except Exception as typed_error:  # noqa: BLE001 - msgspec errors and FrameError from extensions
            req = self._decode_add_tolerant(body, typed_error)
        else:
            try:
                check_lora_request(req.lora_request)
            except RequestFieldError as e:
                raise FrameError(f"ADD {e}", req.request_id, _client_index(req.client_index)) from None
        if not req.request_id:
            raise FrameError("ADD without a request_id")
        if req.prompt_token_ids is None:
            raise FrameError("ADD without prompt_token_ids (prompt embeddings are not simulated)",
                             req.request_id, _client_index(req.client_index))
        return req

    def _decode_add_tolerant(self, body, typed_error: Exception) -> EngineCoreRequest:
        self._lenient_ext.refused.clear()
        try:
            raw = self._lenient_decoder.decode(body)
        except Exception as e:  # noqa: BLE001
            raise FrameError(f"undecodable msgpack: {e}") from None
        if not isinstance(raw, (list, tuple)) or not raw:
            raise FrameError(f"ADD body is {type(raw).__name__}, not an EngineCoreRequest array")
        rid = raw[0] if isinstance(raw[0], str) and raw[0] else None
        client = _client_index(raw[11] if len(raw) > 11 else 0)
        for code in self._lenient_ext.refused:
            what = "pickled msgpack extension" if code in (EXT_PICKLE, EXT_CLOUDPICKLE) else "unknown msgpack extension type"
            raise FrameError(f"ADD refused: {what} {code}", rid, client)
        fields = dict(zip(EngineCoreRequest.__struct_fields__, raw[:N_REQUEST_FIELDS]))
        try:
            return request_from_fields(fields)
        except RequestFieldError as e:
            raise FrameError(f"ADD not an EngineCoreRequest ({typed_error}; field {e})", rid, client) from None
        except Exception as e:  # noqa: BLE001 - anything else about the fields
            raise FrameError(f"ADD not an EngineCoreRequest ({typed_error}; positional read: {e})",
                             rid, client) from None

    def decode_abort(self, frames: list) -> list[str]:
        ids = self.decode_any(frames[0])
        if isinstance(ids, str):  # be lenient: a bare id
            return [ids]
        if not isinstance(ids, (list, tuple)):
            raise FrameError(f"ABORT body is {type(ids).__name__}, not a list of request ids")
        return [i for i in ids if isinstance(i, str)]

    def decode_utility(self, frames: list) -> tuple[int, int, str, list]:
        body = self.decode_any(frames[0])
        if not isinstance(body, (list, tuple)) or len(body) < 3:
            raise FrameError("UTILITY body is not [client_index, call_id, method, args]")
        client, call_id, method = body[0], body[1], body[2]
        args = body[3] if len(body) > 3 else []
        if not isinstance(call_id, int) or not isinstance(method, str):
            raise FrameError(f"UTILITY with call_id={call_id!r} method={method!r}")
        if args is None:
            args = []
        elif not isinstance(args, (list, tuple)):
            args = [args]
        return _client_index(client), call_id, method, list(args)

    def decode_start_wave(self, frames: list) -> tuple[int, int | None]:
        body = self.decode_any(frames[0])
        if not isinstance(body, (list, tuple)) or not body:
            raise FrameError("START_DP_WAVE body is not [wave, exclude_engine_index]")
        return int(body[0]), (body[1] if len(body) > 1 else None)


def _client_index(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


# ---- output builders (small helpers, used off the hot path) ---------------------------------

def error_output(request_id: str, message: str, *, code: str = "internal_error",
                 retryable: bool = False, reason: FinishReason = FinishReason.ERROR) -> EngineCoreOutput:
    """A request the wire layer answers itself (undecodable, rejected while paused)."""
    return EngineCoreOutput(request_id=request_id, new_token_ids=[], finish_reason=reason,
                            error=RequestError(code=code, message=message, retryable=retryable))


def utility_success(engine_index: int, call_id: int, value: Any, timestamp: float) -> EngineCoreOutputs:
    # The frontend asserts the result is present and reads result[1]: always [None, value].
    return EngineCoreOutputs(engine_index=engine_index, timestamp=timestamp,
                             utility_output=UtilityOutput(call_id=call_id, failure_message=None,
                                                          result=[None, value]))


def utility_failure(engine_index: int, call_id: int, message: str, timestamp: float) -> EngineCoreOutputs:
    return EngineCoreOutputs(engine_index=engine_index, timestamp=timestamp,
                             utility_output=UtilityOutput(call_id=call_id, failure_message=message,
                                                          result=None))
