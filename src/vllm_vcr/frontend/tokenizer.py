"""The frontend's tokenizer: HF `tokenizer.json` loaded with `tokenizers`, never the network.

Detokenization is table-driven: every token id maps to the exact bytes it stands for, and a
UTF-8 incremental decoder turns the byte stream into text. That makes the per-token cost of a
stream one list lookup plus one C-level decode, and keeps multi-byte characters split across
tokens intact (they are emitted once their last byte arrives).
"""

from __future__ import annotations

import asyncio
import codecs
import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # belt and braces: nothing here may download

from tokenizers import Tokenizer as _HFTokenizer  # noqa: E402

from .chat_template import ChatTemplate  # noqa: E402

DEFAULT_MODEL_NAME = "vllm-vcr/sim"
_UTF8_DECODER = codecs.getincrementaldecoder("utf-8")
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class TokenizerError(ValueError):
    """The tokenizer directory is missing or unreadable (a CLI error, exit 2)."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte <-> printable-character map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _decoder_kinds(node: Any) -> set[str]:
    """All decoder type names in a (possibly nested Sequence) decoder spec."""
    kinds: set[str] = set()
    if isinstance(node, dict):
        if "type" in node:
            kinds.add(node["type"])
        if node.get("type") == "Replace":
            pat = node.get("pattern", {})
            if isinstance(pat, dict) and pat.get("String") == "▁":
                kinds.add("Metaspace")
        for v in node.values():
            if isinstance(v, (dict, list)):
                kinds |= _decoder_kinds(v)
    elif isinstance(node, list):
        for v in node:
            kinds |= _decoder_kinds(v)
    return kinds


def _token_content(tok: Any) -> str | None:
    if tok is None:
        return None
    if isinstance(tok, dict):
        return tok.get("content")
    return str(tok)


class Tokenizer:
    """Encode/decode plus what the frontend needs: special ids, byte table, chat template."""

    def __init__(self, hf: _HFTokenizer, spec: dict[str, Any], config: dict[str, Any], source: str):
        self.hf = hf
        self.source = source
        self._cache: dict[tuple[str, bool], list[int]] = {}
        self._workers = 1
        self._executor: ThreadPoolExecutor | None = None
        self._queued: list[tuple[str, bool, asyncio.Future]] = []  # texts waiting for a worker
        self._queue_lock = threading.Lock()  # (the workers take from it; the loop adds)
        self._busy_workers = 0
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.bos_token_id = hf.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = hf.token_to_id(self.eos_token) if self.eos_token else None
        # the model's generation-config EOS ids other than eos_token_id (model_config.generation_eos_ids):
        # stop token ids of every request that does not ignore EOS, as vLLM adds them
        self.generation_eos_ids: tuple[int, ...] = ()
        self.model_max_length = config.get("model_max_length")
        # the embedded tokenizer numbers whole-character tokens first: random output stays clean text
        rv = config.get("vllm_vcr_random_vocab_size")
        self.random_vocab_size: int | None = int(rv) if isinstance(rv, int) and 0 < rv <= self.vocab_size else None
        special: set[int] = set()
        added: dict[int, str] = {}
        for t in spec.get("added_tokens", []) or []:
            added[int(t["id"])] = t["content"]
            if t.get("special"):
                special.add(int(t["id"]))
        for tid, t in (config.get("added_tokens_decoder") or {}).items():
            if isinstance(t, dict) and t.get("special"):
                special.add(int(tid))
        self.special_ids = frozenset(special)
        # vLLM bounds a prompt's characters by max_model_len x the longest token string
        self.max_chars_per_token = max((len(t) for t in hf.get_vocab(with_added_tokens=True)), default=1)
        self._table = self._build_byte_table(spec.get("decoder"), added)
        template = config.get("chat_template")
        if isinstance(template, list):  # HF allows a list of named templates
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        self.chat_template = ChatTemplate(template) if template else None

    # -- byte table -------------------------------------------------------------------------

    def _build_byte_table(self, decoder: Any, added: dict[int, str]) -> list[bytes]:
        kinds = _decoder_kinds(decoder)
        hf = self.hf
        n = self.vocab_size
        table: list[bytes] = [b""] * n
        if "ByteLevel" in kinds:
            inv = {c: b for b, c in _bytes_to_unicode().items()}

            def conv(piece: str) -> bytes:
                try:
                    return bytes(inv[c] for c in piece)
                except KeyError:  # not a byte-level piece (e.g. an added token)
                    return piece.encode()
        elif "Metaspace" in kinds or "ByteFallback" in kinds:

            def conv(piece: str) -> bytes:
                m = _BYTE_FALLBACK.match(piece)
                if m:
                    return bytes([int(m.group(1), 16)])
                return piece.replace("▁", " ").encode()
        elif "WordPiece" in kinds:

            def conv(piece: str) -> bytes:
                return piece[2:].encode() if piece.startswith("##") else (" " + piece).encode()
        else:
            conv = None  # type: ignore[assignment]
        for i in range(n):
            if i in self.special_ids:
                continue  # skip_special_tokens=True, as vLLM's default
            if i in added:
                table[i] = added[i].encode()
                continue
            piece = hf.id_to_token(i)
            if piece is None:
                continue
            table[i] = conv(piece) if conv else hf.decode([i], skip_special_tokens=False).encode()
        return table

    # -- encode / decode --------------------------------------------------------------------

    _CACHE_MAX = 4096  # prompts; benchmarks reuse a few hundred, so most encodes become a dict hit
    _CACHE_MAX_CHARS = 1 << 16

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > self._CACHE_MAX_CHARS:
            return self._encode_ids(text, add_special_tokens)
        key = (text, add_special_tokens)
        ids = self._cache.get(key)
        if ids is None:
            ids = self._remember(key, self._encode_ids(text, add_special_tokens))
        return list(ids)  # callers own their list

    def special_tokens_around(self, text: str, ids: list[int]) -> tuple[int, int]:
        """How many of `ids` (`text` encoded with special tokens) the tokenizer added before and
        after the text's own tokens: what its truncation keeps."""
        plain = self.encode(text, add_special_tokens=False)
        extra = len(ids) - len(plain)
        if extra <= 0:
            return 0, 0
        for lead in range(extra + 1):
            if ids[lead:lead + len(plain)] == plain:
                return lead, extra - lead
        return 0, 0

    # vLLM's frontend tokenizes in its renderer's worker threads (--renderer-num-workers, default 1):
    # the Rust encode releases the GIL, so a long new prompt (0.2-0.4 ms for 128 tokens of random
    # vocabulary) does not hold the event loop while a burst of requests waits to be read and the
    # streams' tokens to be written. A cached prompt, or a short one (cheaper than the hand-over to
    # the thread, ~30 us), is encoded in line.
    OFFLOAD_MIN_CHARS = 256
    # The prompts that queue up while a worker is busy (a burst of new requests) go to it as one
    # batch (as vLLM's AsyncMicrobatchTokenizer does): the Rust side spreads a batch over the cores
    # and skips the offsets nobody reads, about 3x less wall time per prompt than one encode each.
    # A batch is whatever queued during the previous one, so the first prompts of a burst go in a
    # small one; the bound only caps how long one batch holds its results back.
    ENCODE_BATCH_MAX = 256

    def use_worker_threads(self, workers: int) -> None:
        """How many threads encode_async may use (vLLM's --renderer-num-workers); 0: none."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
        self._workers = max(0, int(workers))

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """encode(), with a long uncached text encoded in a worker thread (the cache stays on the
        loop), batched with the others that are waiting for one."""
        if self._workers == 0 or len(text) < self.OFFLOAD_MIN_CHARS:
            return self.encode(text, add_special_tokens)
        key = (text, add_special_tokens)
        cacheable = len(text) <= self._CACHE_MAX_CHARS
        ids = self._cache.get(key) if cacheable else None
        if ids is None:
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            with self._queue_lock:
                self._queued.append((text, add_special_tokens, fut))
                start = self._busy_workers < self._workers
                if start:
                    self._busy_workers += 1
            if start:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(self._workers, thread_name_prefix="vllm-vcr-tokenize")
                self._executor.submit(self._encode_queued, loop)
            ids = await fut
            if cacheable:
                self._remember(key, ids)
        return list(ids)

    def _encode_queued(self, loop: asyncio.AbstractEventLoop) -> None:
        """A worker: encode what is queued, a batch at a time, until nothing is (it takes the next
        batch itself: a busy event loop does not hold the tokenizing up)."""
        while True:
            with self._queue_lock:
                batch = self._queued[:self.ENCODE_BATCH_MAX]
                del self._queued[:self.ENCODE_BATCH_MAX]
                if not batch:
                    self._busy_workers -= 1
                    return
            try:
                results: list | BaseException = self._encode_batch([(t, s) for t, s, _ in batch])
            except BaseException as e:  # (_encode_batch catches the library's errors: this is a bug)
                results = e
            try:
                loop.call_soon_threadsafe(self._deliver, batch, results)
            except RuntimeError:  # the loop has closed: nobody waits any more
                pass

    @staticmethod
    def _deliver(batch: list, results: list | BaseException) -> None:
        for i, (_, _, fut) in enumerate(batch):
            if fut.done():  # its request went away
                continue
            r = results if isinstance(results, BaseException) else results[i]
            if isinstance(r, BaseException):
                fut.set_exception(r)
            else:
                fut.set_result(r)

    def _encode_batch(self, items: list[tuple[str, bool]]) -> list[list[int] | BaseException | None]:
        """In a worker: the ids of each (text, add_special_tokens), or the error encoding it raised
        (a text the library rejects fails its own request, not the batch's)."""
        out: list[list[int] | BaseException | None] = [None] * len(items)
        for special in (True, False):
            idx = [i for i, (_, s) in enumerate(items) if bool(s) is special]
            if not idx:
                continue
            texts = [items[i][0] for i in idx]
            try:
                encodings = self._hf_encode_batch(texts, special)
            except Exception:  # find the culprit(s): one at a time
                for i in idx:
                    try:
                        out[i] = self._encode_ids(*items[i])
                    except Exception as e:
                        out[i] = e
                continue
            for i, enc in zip(idx, encodings):
                out[i] = enc.ids
        return out

    def _encode_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def _hf_encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[Any]:
        hf = self.hf  # (tokenizers >= 0.20: the batch encode that skips offsets; the same ids)
        batch = getattr(hf, "encode_batch_fast", None) or hf.encode_batch
        return batch(texts, add_special_tokens=add_special_tokens)

    def _remember(self, key: tuple[str, bool], ids: list[int]) -> list[int]:
        if len(self._cache) >= self._CACHE_MAX:
            self._cache.clear()
        self._cache[key] = ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if not skip_special_tokens:
            return self.hf.decode(list(ids), skip_special_tokens=False)
        return self.ids_to_bytes(ids).decode("utf-8", "replace")

    def ids_to_bytes(self, ids: list[int]) -> bytes:
        table = self._table
        try:
            return b"".join([table[i] for i in ids])
        except (IndexError, TypeError):
            n = len(table)
            return b"".join([table[i] if isinstance(i, int) and 0 <= i < n else b"" for i in ids])

    def textless_ids(self, below: int) -> frozenset[int]:
        """Ids under `below` with no whole-character text of their own: special tokens (skipped
        when detokenized) and byte-level pieces of a multi-byte character (held back until the
        character is whole): a stream sends them as events without text."""
        out = set()
        for i, piece in enumerate(self._table[:below]):
            try:
                if piece and piece.decode("utf-8"):
                    continue
            except UnicodeDecodeError:
                pass
            out.add(i)
        return frozenset(out)

    def random_text_avoid(self, vocab_size: int) -> frozenset[int]:
        """The textless ids random output under `vocab_size` should skip; none when they are half of
        it or more (a bytes-only vocabulary), where a draw would mostly retry."""
        textless = self.textless_ids(vocab_size)
        return textless if len(textless) * 2 < vocab_size else frozenset()

    def token_text(self, token_id: int) -> str:
        """One token as text (logprobs' `token`); specials keep their literal form."""
        if 0 <= token_id < len(self._table):
            if token_id in self.special_ids:
                return self.hf.id_to_token(token_id) or ""
            return self._table[token_id].decode("utf-8", "replace")
        return ""

    def token_bytes(self, token_id: int) -> bytes:
        return self._table[token_id] if 0 <= token_id < len(self._table) else b""

    def detokenizer(self) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self._table)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: "str | ChatTemplate | None" = None, **kwargs: Any) -> str:
        template = (chat_template if isinstance(chat_template, ChatTemplate)
                    else ChatTemplate(chat_template) if chat_template else self.chat_template)
        if template is None:
            raise ValueError(
                "As of transformers v4.44, default chat template is no longer allowed, so you must "
                "provide a chat template if the tokenizer does not define one.")
        return template.render(messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)


class IncrementalDetokenizer:
    """Token ids in, text out; holds back an incomplete UTF-8 sequence until it completes."""

    __slots__ = ("_table", "_n", "_dec", "pending")

    def __init__(self, table: list[bytes]):
        self._table = table
        self._n = len(table)
        self._dec: Any = None  # made on the first token that ends mid-character (most streams never do)
        self.pending = False  # the incremental decoder holds part of a character

    def add(self, ids: list[int]) -> str:
        table = self._table
        if len(ids) == 1:
            i = ids[0]
            data = table[i] if 0 <= i < self._n else b""
        else:
            try:
                data = b"".join([table[i] for i in ids])
            except IndexError:
                data = b"".join([table[i] if 0 <= i < self._n else b"" for i in ids])
        if not self.pending:
            try:
                return data.decode()  # the common case: whole characters, one C call
            except UnicodeDecodeError:
                pass
        dec = self._dec
        if dec is None:
            dec = self._dec = _UTF8_DECODER("replace")
        out = dec.decode(data)
        self.pending = bool(dec.getstate()[0])
        return out

    def flush(self) -> str:
        """Where other text follows (a reasoning section's end marker): a dangling partial character
        becomes U+FFFD, as decoding the whole text gives. At the end of a sequence nothing is
        flushed: vLLM's incremental detokenizer holds back text that ends mid-character, and a
        sequence that ends there never shows it."""
        self.pending = False
        return "" if self._dec is None else self._dec.decode(b"", True)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot read {path}: {e}") from None


def load_tokenizer(path: str | os.PathLike[str] | None = None) -> Tokenizer:
    """The embedded default tokenizer, or the HF tokenizer files in local directory `path`."""
    if path is None:
        data = resources.files("vllm_vcr") / "data"
        spec_text = (data / "tokenizer.json").read_text(encoding="utf-8")
        config = json.loads((data / "tokenizer_config.json").read_text(encoding="utf-8"))
        source = "embedded"
    else:
        d = Path(path)
        if d.is_file() and d.name == "tokenizer.json":
            d = d.parent
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerError(
                f"no tokenizer.json in {str(path)!r} (vllm-vcr loads local HF tokenizer directories only; "
                "it never downloads)")
        try:
            spec_text = tj.read_text(encoding="utf-8")
        except OSError as e:
            raise TokenizerError(f"cannot read {tj}: {e}") from None
        config = _read_json(d / "tokenizer_config.json")
        # Some repos keep the template in its own file (transformers >= 4.43 convention).
        if not config.get("chat_template"):
            jinja = d / "chat_template.jinja"
            if jinja.is_file():
                config["chat_template"] = jinja.read_text(encoding="utf-8")
            else:
                ct = _read_json(d / "chat_template.json")
                if ct.get("chat_template"):
                    config["chat_template"] = ct["chat_template"]
        # eos/bos may only be in special_tokens_map.json
        if not config.get("eos_token") or not config.get("bos_token"):
            stm = _read_json(d / "special_tokens_map.json")
            for key in ("eos_token", "bos_token"):
                if not config.get(key) and stm.get(key):
                    config[key] = stm[key]
        source = str(d)
    try:
        hf = _HFTokenizer.from_str(spec_text)
        spec = json.loads(spec_text)
    except Exception as e:  # the tokenizers library raises plain Exception subclasses
        raise TokenizerError(f"cannot load tokenizer from {source}: {e}") from None
    return Tokenizer(hf, spec, config, source)


def ordinary_vocab_size(tok: Tokenizer) -> int:
    """The range random output ids are drawn from, [0, this): below the first special token when
    the specials sit at the end of the vocabulary (the embedded tokenizer says exactly which ids
    are whole characters), else the whole vocabulary (its textless ids are skipped by the draw:
    Tokenizer.random_text_avoid)."""
    if tok.random_vocab_size:
        return tok.random_vocab_size
    specials = sorted(tok.special_ids)
    if specials and specials[0] > 0 and specials == list(range(specials[0], specials[0] + len(specials))) \
            and specials[-1] == tok.vocab_size - 1:
        return specials[0]
    return tok.vocab_size
