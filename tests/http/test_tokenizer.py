"""The embedded tokenizer, HF tokenizer directories, chat templates, incremental detokenization."""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_vcr.frontend.chat_template import ChatTemplate, ChatTemplateError
from vllm_vcr.frontend.tokenizer import TokenizerError, load_tokenizer

TOK = load_tokenizer()


def test_embedded_tokenizer_basics():
    assert 2000 < TOK.vocab_size < 10000
    assert TOK.eos_token == "<|eot_id|>" and TOK.eos_token_id is not None
    assert TOK.bos_token == "<|begin_of_text|>"
    ids = TOK.encode("hello world")
    assert ids[0] == TOK.bos_token_id  # completions prompts start with BOS, like Llama 3
    assert TOK.decode(ids) == "hello world"  # specials are skipped, as vLLM's default
    # common English is a few characters per token
    text = "The server generates a response for every request in the queue."
    assert len(TOK.encode(text, add_special_tokens=False)) < len(text) / 3


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_any_text(text):
    ids = TOK.encode(text, add_special_tokens=False)
    assert TOK.decode(ids) == text or "<|" in text  # literal special-token text becomes a special token


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",))), st.integers(1, 5))
def test_incremental_detokenizer_matches_full_decode(text, step):
    ids = TOK.encode(text, add_special_tokens=False)
    d = TOK.detokenizer()
    out = "".join(d.add(ids[i:i + step]) for i in range(0, len(ids), step)) + d.flush()
    assert out == TOK.decode(ids)


def test_split_multibyte_character_waits_for_its_last_byte():
    ids = TOK.encode("😀", add_special_tokens=False)
    d = TOK.detokenizer()
    pieces = [d.add([i]) for i in ids]
    assert "".join(pieces) == "😀"
    assert all(p in ("", "😀") for p in pieces)


def test_a_dangling_partial_character_flushes_as_replacement():
    """Where other text follows (a reasoning section's end): U+FFFD, as the whole text decodes."""
    ids = TOK.encode("😀", add_special_tokens=False)
    assert len(ids) > 1
    d = TOK.detokenizer()
    assert d.add(ids[:1]) == "" and d.pending
    assert d.flush() == "\ufffd"
    whole = TOK.detokenizer()
    assert whole.add(TOK.encode("ab", add_special_tokens=False)) == "ab" and whole.flush() == ""


def test_out_of_range_ids_decode_to_nothing():
    d = TOK.detokenizer()
    assert d.add([TOK.vocab_size + 5]) == ""
    assert TOK.decode([10 ** 9]) == ""


def test_default_chat_template():
    text = TOK.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": " U "}])
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    no_gen = TOK.apply_chat_template([{"role": "user", "content": "U"}], add_generation_prompt=False)
    assert no_gen.endswith("<|eot_id|>")


def test_chat_template_features():
    t = ChatTemplate("{% for m in messages %}{{ m | tojson }}{% if m.role == 'bad' %}"
                     "{{ raise_exception('no bad roles') }}{% endif %}{% endfor %}{{ bos_token }}|{{ eos_token }}")
    assert t.render([{"role": "user", "content": "<é>"}], bos_token="B", eos_token="E") == \
        '{"role": "user", "content": "<é>"}B|E'
    with pytest.raises(ChatTemplateError, match="no bad roles"):
        t.render([{"role": "bad", "content": ""}])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% for %}")
    # loop controls and trim_blocks as transformers sets them up
    t2 = ChatTemplate("{% for m in messages %}\n{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}\n"
                      "{% endfor %}")
    assert t2.render([{"content": "a"}, {"content": "b"}]) == "a\n"


def _hf_dir(tmp_path: Path, config: dict) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    data = resources.files("vllm_vcr") / "data"
    (d / "tokenizer.json").write_text((data / "tokenizer.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def test_hf_directory(tmp_path):
    d = _hf_dir(tmp_path, {"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|end_of_text|>",
                           "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
                                            "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"})
    tok = load_tokenizer(d)
    assert tok.source == str(d)
    assert tok.eos_token == "<|end_of_text|>" and tok.eos_token_id == tok.hf.token_to_id("<|end_of_text|>")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|begin_of_text|>[user]x[assistant]"


def test_hf_directory_template_file_and_special_tokens_map(tmp_path):
    d = _hf_dir(tmp_path, {})
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    tok = load_tokenizer(d)
    assert tok.eos_token == "<|eot_id|>"
    assert tok.apply_chat_template([{"role": "user", "content": "q"}]) == "q"


def test_missing_tokenizer_directory(tmp_path):
    with pytest.raises(TokenizerError):
        load_tokenizer(tmp_path)


def test_no_template_is_a_clear_error(tmp_path):
    d = _hf_dir(tmp_path, {"eos_token": "<|eot_id|>"})
    tok = load_tokenizer(d)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "q"}])


def test_generator_script_is_reproducible(tmp_path):
    """scripts/build_tokenizer.py regenerates exactly the shipped files."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "build_tokenizer.py"
    import subprocess
    import sys

    subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], check=True, capture_output=True, timeout=120)
    data = resources.files("vllm_vcr") / "data"
    assert json.loads((tmp_path / "tokenizer.json").read_text()) == json.loads((data / "tokenizer.json").read_text())
    assert (tmp_path / "tokenizer_config.json").read_text() == (data / "tokenizer_config.json").read_text()
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_random_range_is_clean_text():
    """Random mode draws ids below random_vocab_size: whole printable characters only."""
    n = TOK.random_vocab_size
    assert n and 3000 < n < TOK.vocab_size
    text = TOK.decode(list(range(n)))
    assert "\ufffd" not in text
    assert all(ch in "\n\t" or ord(ch) >= 0x20 for ch in text)


@pytest.mark.parametrize("stop,streaming,think", [([], False, False), ([], True, False), (["zz"], False, False),
                                                  (["zz"], True, False), ([], True, True)])
def test_a_sequence_that_ends_mid_character_never_shows_it(stop, streaming, think):
    """vLLM's incremental detokenizer holds back text that ends in an incomplete UTF-8 sequence and
    emits nothing for it at the end (the real 0.32 and 0.33 frontends answer '' where a full decode
    would give U+FFFD; tests/conformance compares them): with or without stop strings, streamed or
    not, in the content after a reasoning section too."""
    from vllm_vcr.engine.types import EngineCoreOutput, FinishReason
    from vllm_vcr.frontend.generation import SequenceState

    emoji = TOK.encode("😀", add_special_tokens=False)
    assert len(emoji) > 1 and TOK.decode(emoji[:-1]) == "\ufffd"
    cut = TOK.encode("ok", add_special_tokens=False) + emoji[:-1]  # the emoji's last piece never comes
    markers = (TOK.encode("a", add_special_tokens=False)[0], TOK.encode("b", add_special_tokens=False)[0])
    s = SequenceState(TOK, stop=stop, include_stop=False, min_tokens=0, streaming=streaming, want_logprobs=None,
                      think=markers if think else None)
    sent = ""
    tokens = ([markers[0], markers[1]] if think else []) + cut
    for k, tid in enumerate(tokens):
        last = k == len(tokens) - 1
        text, _ = s.process(EngineCoreOutput(request_id="r", new_token_ids=[tid],
                                             finish_reason=FinishReason.LENGTH if last else None))
        sent += text
    assert sent == "ok" and s.finish_reason == "length"
