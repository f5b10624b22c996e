"""Reading and writing trace files (JSONL, optionally gzip).

* `.gz` files (or any file starting with the gzip magic) are read as multi-member gzip.
* An unfinished gzip (a recorder killed before writing the trailer) is tolerated: every complete
  line read so far is kept and a warning is logged. Writers sync-flush after each record so such
  a file always ends on a record boundary.
* Errors name the file, the 1-based line number and the offending field.
"""

from __future__ import annotations

import gzip
import io
import logging
import os
import re
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import msgspec

from .schema import FPM_KEY, META_FIELDS, RECORD_FIELDS, TraceMeta, TraceRecord, validate_record

log = logging.getLogger(__name__)

_GZIP_MAGIC = b"\x1f\x8b"
_CHUNK = 1 << 16
_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()
_EXTRA = "__vcr_extra__"


class TraceError(ValueError):
    """A trace file that cannot be read, with where and what."""

    def __init__(self, path: str, line: int | None, message: str, field: str | None = None):
        self.path, self.line, self.field = path, line, field
        where = f"{path}:{line}" if line is not None else path
        what = f"field `{field}`: {message}" if field else message
        super().__init__(f"{where}: {what}")


@dataclass
class Trace:
    meta: TraceMeta | None = None
    records: list[TraceRecord] = field(default_factory=list)
    fpm: list[dict[str, Any]] = field(default_factory=list)  # the optional per-step records
    truncated: bool = False  # an unfinished gzip stream was cut short


# -- raw line access ------------------------------------------------------------------------------


def _is_gzip(path: str, head: bytes) -> bool:
    return path.lower().endswith(".gz") or head.startswith(_GZIP_MAGIC)


def _gunzip_chunks(f: IO[bytes], state: ReadState) -> Iterator[bytes]:
    """Decompress concatenated gzip members; mark `state.truncated` at a stream cut short."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    data = f.read(_CHUNK)
    while data:
        try:
            out = d.decompress(data)
        except zlib.error as e:
            raise OSError(f"corrupt gzip stream: {e}") from e
        if out:
            yield out
        if d.eof:
            # another member may follow (multi-member gzip, e.g. concatenated captures)
            data = d.unused_data or f.read(_CHUNK)
            if not data.strip(b"\x00"):
                data = f.read(_CHUNK) if data else b""
                if data.strip(b"\x00"):
                    raise OSError("corrupt gzip stream: data after zero padding")
                if not data:
                    return
                continue
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        else:
            data = f.read(_CHUNK)
    tail = d.flush()
    if tail:
        yield tail
    if not d.eof:
        state.truncated = True


@dataclass
class ReadState:
    truncated: bool = False
    on_read: Callable[[int], None] | None = None  # called with each raw chunk's size (progress)


class _CountingReader:
    def __init__(self, f: IO[bytes], cb: Callable[[int], None]):
        self._f, self._cb = f, cb

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._cb(len(data))
        return data


def iter_lines(path: str | os.PathLike[str], state: ReadState | None = None
               ) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line bytes) for every line of a plain or gzip trace.

    A truncated gzip yields its complete lines, drops a partial last line, logs a warning and
    sets `state.truncated`.
    """
    state = state if state is not None else ReadState()
    spath = os.fspath(path)
    f: IO[bytes] = sys.stdin.buffer if spath == "-" else open(spath, "rb")
    try:
        if spath == "-":
            head = b""
        else:
            head = f.read(2)
            f.seek(0)
        src: Any = _CountingReader(f, state.on_read) if state.on_read else f
        chunks: Iterable[bytes] = _gunzip_chunks(src, state) if _is_gzip(spath, head) else iter(
            lambda: src.read(_CHUNK), b""
        )
        lineno = 0
        buf = b""
        for chunk in chunks:
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                lineno += 1
                yield lineno, line
        if state.truncated:
            log.warning(
                "%s: gzip stream ends without its trailer (an unfinished capture); "
                "keeping the %d complete lines read%s",
                spath, lineno, ", dropping a partial last line" if buf.strip() else "",
            )
        elif buf:
            yield lineno + 1, buf
    finally:
        if f is not sys.stdin.buffer:
            f.close()


# -- decoding -------------------------------------------------------------------------------------

_AT_RE = re.compile(r"at `\$\.?([^`]*)`")
_MISSING_RE = re.compile(r"missing required field `([^`]+)`")


def _field_of(err: msgspec.ValidationError) -> tuple[str | None, str]:
    msg = str(err)
    m = _MISSING_RE.search(msg)
    if m:
        prefix = _AT_RE.search(msg)
        name = f"{prefix.group(1)}.{m.group(1)}" if prefix and prefix.group(1) else m.group(1)
        return name, "required field is missing"
    m = _AT_RE.search(msg)
    if m:
        return m.group(1) or None, msg[: m.start()].rstrip(" -")
    return None, msg


def _split_extra(obj: dict[str, Any], known: frozenset[str]) -> dict[str, Any] | None:
    extra = {k: v for k, v in obj.items() if k not in known}
    return extra or None


def decode_meta(obj: Any, path: str = "<trace>", line: int | None = None) -> TraceMeta:
    if not isinstance(obj, dict):
        raise TraceError(path, line, "`meta` must be a JSON object", "meta")
    try:
        meta = msgspec.convert(obj, TraceMeta)
    except msgspec.ValidationError as e:
        fld, msg = _field_of(e)
        raise TraceError(path, line, msg, f"meta.{fld}" if fld else "meta") from None
    meta.extra = _split_extra(obj, META_FIELDS)
    return meta


def decode_record(obj: Any, path: str = "<trace>", line: int | None = None) -> TraceRecord:
    if not isinstance(obj, dict):
        raise TraceError(path, line, f"expected a JSON object, got {type(obj).__name__}")
    try:
        rec = msgspec.convert(obj, TraceRecord)
    except msgspec.ValidationError as e:
        fld, msg = _field_of(e)
        raise TraceError(path, line, msg, fld) from None
    problem = validate_record(rec)
    if problem is not None:
        raise TraceError(path, line, problem[1], problem[0])
    rec.extra = _split_extra(obj, RECORD_FIELDS)
    return rec


def iter_trace(path: str | os.PathLike[str], state: ReadState | None = None,
               fpm: Callable[[dict[str, Any]], None] | None = None) -> Iterator[TraceMeta | TraceRecord]:
    """Yield the meta (if any, first) and then each record, validating as it goes. Step records
    (`{"fpm": ...}`) go to `fpm` (skipped without it)."""
    spath = os.fspath(path)
    seen_content = False
    for lineno, raw in iter_lines(spath, state):
        if not raw.strip():
            continue
        try:
            obj = _decoder.decode(raw)
        except msgspec.DecodeError as e:
            raise TraceError(spath, lineno, f"invalid JSON: {e}") from None
        if isinstance(obj, dict) and "meta" in obj and len(obj) == 1:
            if seen_content:
                raise TraceError(spath, lineno, "the meta line must be the first non-blank line", "meta")
            seen_content = True
            yield decode_meta(obj["meta"], spath, lineno)
            continue
        seen_content = True
        if isinstance(obj, dict) and FPM_KEY in obj and len(obj) == 1:
            if not isinstance(obj[FPM_KEY], dict):
                raise TraceError(spath, lineno, "must be a JSON object", FPM_KEY)
            if fpm is not None:
                fpm(obj[FPM_KEY])
            continue
        yield decode_record(obj, spath, lineno)


def read_trace(path: str | os.PathLike[str],
               on_read: Callable[[int], None] | None = None) -> Trace:
    spath = os.fspath(path)
    if spath != "-" and not Path(spath).exists():
        raise TraceError(spath, None, "no such file")
    trace = Trace()
    state = ReadState(on_read=on_read)
    for item in iter_trace(spath, state, trace.fpm.append):
        if isinstance(item, TraceMeta):
            trace.meta = item
        else:
            trace.records.append(item)
    trace.truncated = state.truncated
    return trace


# -- encoding -------------------------------------------------------------------------------------


def _encode_with_extra(obj: TraceMeta | TraceRecord) -> Any:
    if obj.extra is None:
        return obj
    d = msgspec.to_builtins(obj)
    d.pop(_EXTRA, None)
    for k, v in obj.extra.items():
        d.setdefault(k, v)  # a known field always wins over a stale copy in extra
    return d


def encode_record(rec: TraceRecord) -> bytes:
    return _encoder.encode(_encode_with_extra(rec))


def encode_meta(meta: TraceMeta) -> bytes:
    return _encoder.encode({"meta": _encode_with_extra(meta)})


def encode_fpm_line(step: Any) -> bytes:
    """One engine step's `{"fpm": ...}` line, newline included."""
    return _encoder.encode({FPM_KEY: step}) + b"\n"


class TraceWriter:
    """Append-only trace writer; every record is flushed (gzip: sync-flushed) as it is written,
    so a capture killed mid-way is still readable up to its last complete record."""

    def __init__(self, path: str | os.PathLike[str], meta: TraceMeta | None = None, *,
                 gzip_level: int = 6, flush_each: bool = True):
        self.flush_each = flush_each  # off for bulk writes: one sync flush per record costs
        self.path = os.fspath(path)
        self._raw: IO[bytes]
        self._gz: gzip.GzipFile | None = None
        if self.path == "-":
            self._raw = sys.stdout.buffer
            self._out: IO[bytes] = self._raw
        else:
            parent = Path(self.path).parent
            parent.mkdir(parents=True, exist_ok=True)
            self._raw = open(self.path, "wb")
            self._out = self._raw
            if self.path.lower().endswith(".gz"):
                self._gz = gzip.GzipFile(fileobj=self._raw, mode="wb", compresslevel=gzip_level,
                                         mtime=0)
                self._out = self._gz
        self.count = 0
        self._meta_written = False
        if meta is not None:
            self.write_meta(meta)

    @property
    def meta_written(self) -> bool:
        return self._meta_written

    def write_meta(self, meta: TraceMeta) -> None:
        if self._meta_written or self.count:
            raise RuntimeError("the meta line must be written once, before any record")
        self._out.write(encode_meta(meta) + b"\n")
        self._meta_written = True
        self.flush()

    def write(self, rec: TraceRecord) -> None:
        self._out.write(encode_record(rec) + b"\n")
        self.count += 1
        if self.flush_each:
            self.flush()

    def write_fpm(self, step: Any) -> None:
        """One engine step's forward-pass metrics (the optional `{"fpm": ...}` record kind)."""
        self._out.write(encode_fpm_line(step))
        if self.flush_each:
            self.flush()

    def write_json(self, obj: Any) -> None:
        """Any JSON line (the step-stats sidecar uses the same flushing writer)."""
        self._out.write(_encoder.encode(obj) + b"\n")
        self.flush()

    def flush(self) -> None:
        if self._gz is not None:
            self._gz.flush(zlib.Z_SYNC_FLUSH)
        self._raw.flush()

    def close(self) -> None:
        if self._gz is not None:
            self._gz.close()  # writes the gzip trailer
            self._gz = None
        if self._raw is not sys.stdout.buffer:
            self._raw.close()
        else:
            self._raw.flush()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_trace(path: str | os.PathLike[str], meta: TraceMeta | None,
                records: Iterable[TraceRecord]) -> int:
    with TraceWriter(path, meta, flush_each=False) as w:
        for rec in records:
            w.write(rec)
        return w.count


def dumps_trace(meta: TraceMeta | None, records: Iterable[TraceRecord]) -> bytes:
    buf = io.BytesIO()
    if meta is not None:
        buf.write(encode_meta(meta) + b"\n")
    for rec in records:
        buf.write(encode_record(rec) + b"\n")
    return buf.getvalue()
