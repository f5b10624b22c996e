"""One driver for every SSE response: engine outputs in, rendered chunks out.

An endpoint supplies a renderer (sync: `feed(out)` turns one engine output into the bytes to send,
`closing()` gives the last bytes: final chunk, usage, `[DONE]`). The driver feeds it:

- pushed (one engine request, uvicorn's httptools server): the engine hands each output to the
  renderer from a loop callback and the chunk goes straight to the socket (`DirectBody`); the
  handler task sleeps until the stream ends, so a token costs no task wake-up and no ASGI
  message. Outputs of back-to-back engine steps arrive merged, as vLLM's collector merges them
  for a reader that lags. When the socket pushes back (the client reads slowly), chunks queue and
  the task sends them through ASGI, which waits for the socket to drain.
- pulled (n > 1, or another ASGI server): the task iterates the outputs and sends each chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from itertools import compress, count, repeat
from operator import add
from operator import is_ as _is
from operator import is_not as _is_not
from typing import Any

import msgspec

from ..engine.request import DECLINED, TAKEN, TAKEN_WAKE
from ..engine.types import EngineCoreOutput, EngineCoreRequest
from ..frontend.errors import STREAM_ENGINE_DEAD, STREAM_INTERNAL_ERROR
from ..frontend.generation import OutputStream
from .serving_base import ENGINE_GONE, RequestContext, encode
from .sse import DONE, SSEWriter
from .uvicorn_internals import CHUNK_FRAME, DirectBody, WriteSide

_TOKEN_JSON: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_last_token_json: list[Any] = [lambda: None, None]  # a weak ref to the last tokenizer asked for, its cache


def token_json_cache(tokenizer: Any) -> dict[int, bytes]:
    """Per tokenizer: token id -> its text as a JSON string, for a token detokenized on its own
    (no partial character held before or after it). Then its text depends on its bytes only, so
    the fast case can send it without decoding and encoding it again."""
    last = _last_token_json
    if last[0]() is tokenizer:  # the usual case: the server's one tokenizer
        return last[1]
    cache = _TOKEN_JSON.get(tokenizer)
    if cache is None:
        cache = _TOKEN_JSON[tokenizer] = {}
    last[0], last[1] = weakref.ref(tokenizer), cache
    return cache


class ChoiceStream:
    """A renderer's common part (ChatStream, CompletionStream add `feed_full` and `usage_chunk`):
    applying outputs to their choice, counting ended choices, the stream's end, and the per-token
    fast case.

    The fast case is the one W2 measures: one choice, a plain token (no finish, error, stats,
    stop strings, reasoning, logprobs or token ids), after the first chunk. Its chunk is the
    stream's fixed head, the token's JSON text and a tail made once per stream (with continuous
    usage, a short `%`-format of the two counts), the same bytes the full path renders;
    everything else takes `feed_full`.
    """

    continuous = False  # usage on every chunk (the renderer sets it before this __init__)

    def __init__(self, states: list[Any], engine_reqs: list[EngineCoreRequest], fp_part: bytes) -> None:
        self.states = states  # one SequenceState per choice, in engine_reqs' order
        self.engine_reqs = engine_reqs
        self.total = len(states)
        self.single = self.total == 1
        # choice index by engine request id (one choice needs none)
        self._index = None if self.single else {r.request_id: i for i, r in enumerate(engine_reqs)}
        self.fp_part = fp_part  # the fingerprint rides on the last chunk (unless a usage chunk follows)
        self.ended = 0
        self.done = False  # every choice has ended, or an error ended the stream
        self.error = False
        self.tail = b""
        self.cancel: Callable[[int], None] | None = None
        self.fast: Any = None  # the choice's SequenceState while the fast case applies
        self.fast_head = b""  # a content chunk: this, the JSON text, then fast_tail
        self.fast_tail = b""  # (with continuous usage: a template of %d total and %d completion tokens)
        self.fast_prompt_len = -1  # >= 0: fast_tail takes the usage numbers
        self.fast_ok = False  # set by a renderer whose requests qualify (see enable_fast)
        self.token_json: dict[int, bytes] = {}
        self.first_pre = b""  # what goes before the first token's chunk (chat: the role chunk), made up front

    def enable_fast(self, head: bytes, tail: bytes, mid: bytes, usage: bytes, prompt_len: int) -> None:
        """Use the fast case for this single-choice stream once its first chunk is out. A plain
        token's chunk is `head + JSON text + tail`, or with continuous usage (`self.continuous`)
        `head + JSON text + mid + usage % (prompt_len, total, completion) + b"}\n\n"`."""
        self.fast_ok = True
        self.token_json = token_json_cache(self.states[0].tokenizer)
        # (the head is joined, not formatted: a `%`-format scans its whole template, and the head
        # is most of the chunk)
        self.fast_head = head
        if self.continuous:
            self.fast_tail = mid + usage.replace(b"%d", b"%d" % prompt_len, 1) + b"}\n\n"
            self.fast_prompt_len = prompt_len
        else:
            self.fast_tail = tail

    def feed(self, out: EngineCoreOutput) -> bytes:
        """The bytes to send for one engine output (b"" for none)."""
        st = self.fast
        ids = out.new_token_ids
        if (st is None or not ids or out.finish_reason is not None or out.error is not None
                or out.prefill_stats is not None or out.kv_transfer_params is not None):
            data = self.feed_full(out)
            if self.fast_ok:
                st = self.states[0]
                self.fast = None if (st.finished or self.done or not st.num_tokens) else st
            return data
        if len(ids) == 1:
            return self.feed_token(ids[0])
        # what SequenceState.process and feed_full do for plain tokens, without the branches
        n = st.num_tokens = st.num_tokens + len(ids)
        text = encode(st.detok.add(ids))
        pl = self.fast_prompt_len
        if pl < 0:
            return self.fast_head + text + self.fast_tail
        return self.fast_head + text + self.fast_tail % (pl + n, n)

    def feed_token(self, token: int) -> bytes:
        """`feed` of a plain one-token output in the fast case (`self.fast` is set)."""
        st = self.fast
        n = st.num_tokens = st.num_tokens + 1
        detok = st.detok
        if not detok.pending:
            text = self.token_json.get(token)
            if text is None:
                text = encode(detok.add([token]))
                if not detok.pending:
                    self.token_json[token] = text
        else:
            text = encode(detok.add([token]))
        pl = self.fast_prompt_len
        if pl < 0:
            return self.fast_head + text + self.fast_tail
        return self.fast_head + text + self.fast_tail % (pl + n, n)

    def feed_first(self, out: EngineCoreOutput) -> bytes | None:
        """The first output of a stream in the fast case, when it is a plain token (the prefill
        stats it carries only go to the choice's state): `first_pre`, made when the stream
        started, and the token's chunk from the template, the bytes `feed_full` would make. None
        leaves the output to `feed_full`. Under a burst every stream's first token is due at
        about the same time, so this is the part of the first event that is left for then."""
        if (not self.fast_ok or not out.new_token_ids or out.finish_reason is not None or out.error is not None
                or out.kv_transfer_params is not None):
            return None
        st = self.states[0]
        ps = out.prefill_stats
        if ps is not None:
            if st.cached_tokens is None:
                st.cached_tokens = ps.num_cached_tokens
                st.cache_created = ps.num_cache_creation_tokens
            out = msgspec.structs.replace(out, prefill_stats=None)
        self.fast = st
        return self.first_pre + self.feed(out)

    def apply(self, out: EngineCoreOutput) -> tuple[int, Any, int, str, list[int]] | None:
        """Apply an output to its choice: (index, state, tokens before, delta text, delta ids);
        None for a choice that has already ended."""
        i = 0 if self.single else self._index[out.request_id]
        st = self.states[i]
        if st.finished:
            return None
        before = st.num_tokens
        text, ids = st.process(out)
        return i, st, before, text, ids

    def close_chunk(self, i: int, out: EngineCoreOutput, chunk: list[bytes], finished: bool) -> bytes:
        """Close choice i's chunk; the stream's last chunk is held back for closing()."""
        if not finished:
            chunk.append(b"}\n\n")
            return b"".join(chunk)
        chunk.append(self.fp_part)
        chunk.append(b"}\n\n")
        if out.finish_reason is None:
            self.cancel(i)  # a stop string ended it: stop reading (and abort) its engine request
        self.ended += 1
        data = b"".join(chunk)
        if self.ended == self.total:
            self.tail = data  # it leaves with the usage chunk and [DONE]: one write
            self.done = True
            return b""
        return data

    def closing(self) -> bytes:
        if self.error:
            return self.tail + (STREAM_ENGINE_DEAD if self.error == "engine dead" else STREAM_INTERNAL_ERROR) + DONE
        return self.tail + self.usage_chunk() + DONE

    def feed_full(self, out: EngineCoreOutput) -> bytes:
        """feed, every case."""
        raise NotImplementedError

    def usage_chunk(self) -> bytes:
        """The trailing usage chunk (b"" unless stream_options.include_usage)."""
        raise NotImplementedError


class IntervalGate:
    """`--stream-interval N` (or a request's larger `stream_interval`), as vLLM's output processor:
    a choice's output is sent when it is the first, the last, or N tokens have piled up since the
    last one sent; the held outputs leave merged as one. N = 1 never uses this."""

    __slots__ = ("feed_renderer", "interval", "held", "sent_any")

    def __init__(self, renderer: ChoiceStream, interval: int, choices: int) -> None:
        self.feed_renderer = renderer.feed
        self.interval = interval
        self.held: list[EngineCoreOutput | None] = [None] * choices
        self.sent_any = [False] * choices

    def feed(self, out: EngineCoreOutput, i: int = 0) -> bytes:
        held = self.held[i]
        if held is not None:
            out = merge_outputs(held, out)
        if out.finish_reason is None and self.sent_any[i] and len(out.new_token_ids) < self.interval:
            self.held[i] = out
            return b""
        self.held[i] = None
        if out.new_token_ids:
            self.sent_any[i] = True
        return self.feed_renderer(out)


def merge_outputs(first: EngineCoreOutput, then: EngineCoreOutput) -> EngineCoreOutput:
    """One output standing for two consecutive ones of the same request (as the collector merges)."""
    merged = msgspec.structs.replace(first, new_token_ids=first.new_token_ids + then.new_token_ids,
                                     finish_reason=then.finish_reason, stop_reason=then.stop_reason)
    if then.events:
        merged.events = (first.events or []) + then.events
    if merged.prefill_stats is None:
        merged.prefill_stats = then.prefill_stats
    merged.kv_transfer_params = then.kv_transfer_params or first.kv_transfer_params
    merged.error = then.error or first.error
    return merged


KEEP_ALIVE = b": keep-alive\n\n"  # vLLM's SSE comment for an idle stream (--sse-keep-alive-interval)


async def stream_response(ctx: RequestContext, engine: Any, engine_reqs: list[EngineCoreRequest],
                          renderer: ChoiceStream, interval: int = 1, keep_alive: float = 0.0) -> None:
    """`keep_alive` > 0: an SSE comment after every `keep_alive` seconds without a chunk (the
    outputs are then read by this task, not pushed into the socket by the engine's step)."""
    w = SSEWriter(ctx.send)
    # the server's own send (below any header-adding wrapper) writes to the transport directly
    raw_send = ctx.scope.get("vllm_vcr.send", ctx.send)
    pushed = len(engine_reqs) == 1 and hasattr(engine, "push") and not keep_alive > 0
    # headers go out at once, as vLLM's StreamingResponse does (straight to the transport when
    # only an observer of the head wraps the server's send; then the end goes the same way)
    direct = direct_ends = w.start_direct(raw_send) if pushed else None
    if direct is None:
        await w.start()
    feed = renderer.feed if interval <= 1 else _gated_feed(renderer, interval)
    try:
        if direct is None and pushed:
            direct = DirectBody.attach(raw_send)
        if direct is not None:
            await _pushed(engine, engine_reqs[0], renderer, feed, direct, w)
        else:
            await _pulled(engine, engine_reqs, renderer, feed, w, keep_alive)
    except Exception as e:
        if type(e).__name__ not in ENGINE_GONE:
            raise
        renderer.error = "engine dead" if type(e).__name__ == "EngineDeadError" else True
    ctx.finishing = True
    data = renderer.closing()
    if direct_ends is None or not w.close_direct(direct_ends, data):
        await w.close(data)


def _gated_feed(renderer: ChoiceStream, interval: int) -> Callable[[EngineCoreOutput], bytes]:
    gate = IntervalGate(renderer, interval, renderer.total)
    if renderer.single:
        return gate.feed
    index = renderer._index
    return lambda out: gate.feed(out, index[out.request_id])


async def _pushed(engine: Any, request: EngineCoreRequest, renderer: ChoiceStream,
                  feed: Callable[[EngineCoreOutput], bytes], direct: DirectBody, w: SSEWriter) -> None:
    backlog: list[bytes] = []  # chunks the socket would not take yet, in order

    def deliver(out: EngineCoreOutput) -> bool:
        data = feed(out)
        if data and (backlog or not direct.write(data)):
            backlog.append(data)
            return True
        return renderer.done

    def take(token: int) -> int:
        """A steady decode's token, straight from the engine's step (AsyncEngine.push)."""
        if renderer.fast is None:
            return DECLINED  # not in the fast case (yet): as an output
        data = renderer.feed_token(token)
        if backlog or not direct.write(data):
            backlog.append(data)
            return TAKEN_WAKE
        return TAKEN

    renderer.cancel = _no_cancel
    direct_take = feed == renderer.feed  # (an interval gate holds tokens back: none taken directly)
    async for _ in engine.push(request, deliver, take if direct_take else None,
                               SteadyReader(renderer, direct, backlog) if direct_take else None):
        if backlog:
            data = b"".join(backlog)
            backlog.clear()
            await w.write(data)
        if renderer.done:
            return


async def _pulled(engine: Any, engine_reqs: list[EngineCoreRequest], renderer: ChoiceStream,
                  feed: Callable[[EngineCoreOutput], bytes], w: SSEWriter, keep_alive: float = 0.0) -> None:
    async with OutputStream(engine, engine_reqs) as stream:
        renderer.cancel = stream.cancel
        outputs = _kept_alive(stream, keep_alive, w) if keep_alive > 0 else stream
        try:
            async for out in outputs:
                data = feed(out)
                if data:
                    await w.write(data)
                if renderer.done:
                    return
        finally:
            if outputs is not stream:
                await outputs.aclose()  # (its pending read cancelled now, not when collected)


async def _kept_alive(stream: Any, interval: float, w: SSEWriter) -> Any:
    """The stream's outputs; meanwhile an SSE comment whenever `interval` seconds pass without a
    chunk written (one pending read of the stream, never cancelled by a timeout)."""
    outputs = aiter(stream)
    reading = asyncio.ensure_future(anext(outputs))
    try:
        while True:
            done, _ = await asyncio.wait((reading,), timeout=interval)
            if not done:
                await w.write(KEEP_ALIVE)
                continue
            try:
                out = reading.result()
            except StopAsyncIteration:
                return
            yield out
            reading = asyncio.ensure_future(anext(outputs))
    finally:
        reading.cancel()
        with contextlib.suppress(BaseException):
            await reading


class SteadyReader:
    """A pushed stream as a member of the engine's steady batches (engine/steady_batch.py): from
    the step after it joins, its tokens come with its batch's, and `SteadyChunks` renders, frames
    and writes them for the whole batch. Only the fast case joins: one choice, plain tokens whose
    JSON text is cached, nothing queued for the socket."""

    __slots__ = ("renderer", "direct", "backlog", "kind")

    def __init__(self, renderer: ChoiceStream, direct: DirectBody, backlog: list[bytes]) -> None:
        self.renderer = renderer
        self.direct = direct
        self.backlog = backlog
        # streams batch with streams of the same chunk shape, token texts and transport type (a
        # batch calls that type's `write` on each), on a protocol that reports when a socket stops
        # taking writes (a batch looks at its sockets only then)
        self.kind = (("sse", renderer.fast_prompt_len >= 0, id(renderer.token_json), type(direct.transport))
                     if renderer.fast_ok and direct.reports_write_side() else None)

    def ready(self) -> bool:
        r = self.renderer
        st = r.fast
        if self.kind is None:
            return False
        return (st is not None and not self.backlog and not r.done and not st.detok.pending
                and not self.direct.closed())

    def new_columns(self) -> SteadyChunks:
        r = self.renderer
        return SteadyChunks(r.token_json, r.fast_prompt_len >= 0, type(self.direct.transport).write)


class _Formatted(dict):
    """n -> `fmt % n`, made once per n: a column of numbers becomes bytes by one map in C."""

    def __init__(self, fmt: bytes) -> None:
        super().__init__()
        self.fmt = fmt

    def __missing__(self, n: int) -> bytes:
        b = self[n] = self.fmt % n
        return b


_CHUNK_SIZE = _Formatted(b"%x\r\n")  # a chunk's size line


class _UsageTails(dict):
    """One continuous-usage tail template (its prompt count filled in): completion tokens n -> the
    tail's bytes, made once per n (a `%` per chunk parses the template every time)."""

    __slots__ = ("template", "prompt_len")
    made = 0  # entries made since the shared index was last dropped
    MAX_MADE = 200_000  # (then it is: batches keep the tables they use, later ones start afresh)
    tables: dict[bytes, _UsageTails] = {}  # by template (its prompt count is in it)

    def __init__(self, template: bytes, prompt_len: int) -> None:
        super().__init__()
        self.template = template
        self.prompt_len = prompt_len

    @classmethod
    def of(cls, template: bytes, prompt_len: int) -> _UsageTails:
        table = cls.tables.get(template)
        if table is None:
            table = cls.tables[template] = cls(template, prompt_len)
        return table

    def __missing__(self, n: int) -> bytes:
        cls = _UsageTails
        cls.made += 1
        if cls.made > cls.MAX_MADE:
            cls.made = 0
            cls.tables.clear()
        b = self[n] = self.template % (self.prompt_len + n, n)
        return b


class SteadyChunks:
    """The chunks of one steady batch's streams, made and written as columns (the batch's
    BatchColumns): for one token per member, `feed_token` and `DirectBody.write` of each, the
    per-stream loops in C. A member's token count is `base + steps` (written back when it leaves).
    A token whose text is not cached yet (or a stream whose detokenizer holds part of a character)
    takes `feed_token` itself; a member whose socket cannot take a chunk now declines its token,
    which then reaches it as an output."""

    def __init__(self, token_json: dict[int, bytes], continuous: bool, write: Callable[[Any, bytes], Any]) -> None:
        self.text_of = token_json.get
        self.continuous = continuous  # usage on every chunk: the tail depends on the token count
        self.steps = 0
        self.readers: list[SteadyReader | None] = []  # None: written back already (it declined)
        self.heads: list[bytes] = []
        self.tails: list[Any] = []  # the tail's bytes, or (continuous) its table by token count
        self.base = array("q")  # (machine ints side by side: no int object per member to fetch)
        self.directs: list[DirectBody] = []
        # the members' transports, and their type's `write` (not a bound method per member: one
        # object less to fetch per token)
        self.transports: list[Any] = []
        self.write = write
        self.partial: set[SteadyReader] = set()  # members whose detokenizer holds part of a character
        # WriteSide.changes when every member's socket was last seen writable (a member joins
        # writable: SteadyReader.ready)
        self.writable_at = WriteSide.changes

    def add(self, reader: SteadyReader) -> None:
        r = reader.renderer
        direct = reader.direct
        self.readers.append(reader)
        self.heads.append(r.fast_head)
        self.tails.append(_UsageTails.of(r.fast_tail, r.fast_prompt_len) if self.continuous else r.fast_tail)
        self.base.append(r.fast.num_tokens - self.steps)
        self.directs.append(direct)
        self.transports.append(direct.transport)

    def _settle(self, i: int) -> None:
        reader = self.readers[i]
        if reader is not None:
            self.readers[i] = None
            self.partial.discard(reader)
            reader.renderer.fast.num_tokens = self.base[i] + self.steps

    def drop(self, index: int) -> None:
        self._settle(index)
        for col in (self.readers, self.heads, self.tails, self.base, self.directs, self.transports):
            del col[index]

    def take(self, tokens: list[int], ts: float) -> list[int] | None:
        texts = list(map(self.text_of, tokens))
        # (the counter compared inline: this runs every step, the method only after a change)
        if None in texts or self.partial or (self.writable_at != WriteSide.changes and self._some_blocked()):
            return self._take_some(tokens, texts)
        self.steps = k = self.steps + 1
        self._write(texts, self.heads, self.tails, self.base, self.transports, k)
        return None

    def _some_blocked(self) -> bool:
        """Whether a member's socket is paused or gone; looked at only when some socket's write side
        changed since every member's was last seen writable."""
        if self.writable_at == WriteSide.changes:
            return False
        if any(d.blocked() for d in self.directs):
            return True
        self.writable_at = WriteSide.changes
        return False

    def _write(self, texts: list[bytes], heads: list[bytes], tails: list[Any], base: Sequence[int],
               transports: list[Any], k: int) -> None:
        join = b"".join
        if self.continuous:  # each tail from its table, by the member's token count
            tails = map(dict.__getitem__, tails, map(add, base, repeat(k)))
        bodies = list(map(join, zip(heads, texts, tails)))
        # (DirectBody.write's framing)
        deque(map(self.write, transports, map(join, zip(map(_CHUNK_SIZE.__getitem__, map(len, bodies)), bodies,
                                              repeat(b"\r\n")))), 0)

    def _take_some(self, tokens: list[int], texts: list[bytes | None]) -> list[int]:
        """`take` when some members need more: those whose socket is paused or gone decline; those
        whose text needs the detokenizer are rendered one by one; the rest as columns."""
        declined = []
        if self._some_blocked():
            declined = [i for i, d in enumerate(self.directs) if d.closed()]
            for i in declined:
                self._settle(i)  # as of before this step
        keep = list(map(_is_not, self.readers, repeat(None)))
        self.steps = k = self.steps + 1
        # (the members to render one by one, found in C: most steps have few or none)
        alone = list(compress(count(), map(_is, texts, repeat(None))))
        if self.partial:
            alone = sorted(set(alone).union(compress(count(), map(self.partial.__contains__, self.readers))))
        for i in alone:
            reader = self.readers[i]
            if reader is not None:
                keep[i] = False
                st = reader.renderer.fast
                st.num_tokens = self.base[i] + k - 1
                data = reader.renderer.feed_token(tokens[i])  # (caches the text when it can)
                self.write(self.transports[i], CHUNK_FRAME % (len(data), data))
                if st.detok.pending:
                    self.partial.add(reader)
                else:
                    self.partial.discard(reader)
        if any(keep):
            self._write(*(list(compress(col, keep)) for col in (texts, self.heads, self.tails, self.base,
                                                                   self.transports)), k)
        return declined


def _no_cancel(i: int) -> None:
    """One request: leaving the stream aborts it in the engine."""
