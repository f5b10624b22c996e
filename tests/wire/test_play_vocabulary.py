"""`play MODEL`: the vocabulary random output ids come from (wire/cli.py model_vocabulary)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_vcr.wire.cli import SAFE_TOKEN_RANGE, ModelError, model_vocabulary

TINY = Path.home() / ".cache" / "vllm-vcr" / "peers" / "tinymodel"


def test_without_a_model_ids_come_from_the_range_every_vocabulary_has():
    v = model_vocabulary(None, None, None)
    low, high = SAFE_TOKEN_RANGE
    assert (v.vocab_size, v.eos_token_id, v.source) == (high, None, "")
    assert v.textless_ids == frozenset(range(low))


def test_vocab_size_alone_keeps_the_whole_range():
    v = model_vocabulary(None, None, 4096)
    assert (v.vocab_size, v.textless_ids, v.source) == (4096, frozenset(), "--vocab-size")


def test_config_json_gives_size_eos_and_special_ids(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 777, "bos_token_id": 5, "eos_token_id": [6, 7],
                                                      "pad_token_id": None}))
    v = model_vocabulary(str(tmp_path), None, None)
    assert (v.vocab_size, v.eos_token_id, v.textless_ids) == (777, 6, frozenset({5, 6, 7}))
    assert model_vocabulary(str(tmp_path), None, 100).vocab_size == 100


def test_a_bad_model_is_an_error_naming_it(tmp_path):
    with pytest.raises(ModelError, match="MODEL: .* does not exist"):
        model_vocabulary(str(tmp_path / "nope"), None, None)
    with pytest.raises(ModelError, match="neither tokenizer.json nor config.json"):
        model_vocabulary(str(tmp_path), None, None)


@pytest.mark.skipif(not (TINY / "tokenizer.json").is_file(), reason="the peers' tiny model is not installed")
def test_the_tokenizer_gives_eos_and_the_textless_ids():
    v = model_vocabulary(str(TINY), None, None)
    assert v.vocab_size == 4096 and v.eos_token_id == 1 and {0, 1, 2} <= v.textless_ids
    assert all(v.tokenizer.token_text(i) for i in range(4096) if i not in v.textless_ids)


def test_help_lists_each_flag_once():
    out = subprocess.run([sys.executable, "-m", "vllm_vcr", "play", "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    assert out.startswith("usage: vllm-vcr play [MODEL] [options]\n")
    listed = [line.split()[0].rstrip(",") for line in out.splitlines() if line.startswith("  -")]
    assert len(listed) == len(set(listed)) and "--vocab-size" in listed
