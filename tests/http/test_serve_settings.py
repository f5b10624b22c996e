"""`vllm-vcr serve`'s flags validated before anything starts: the chat template rule, the
tokenizer found in the local Hugging Face cache (never downloaded), errors naming the flag."""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

import pytest
from huggingface_hub import constants

from vllm_vcr.serve.settings import CLIError, _chat_template_source, cached_model_dir, resolve_tokenizer

EMBEDDED = Path(str(resources.files("vllm_vcr") / "data"))


def _fake_hf_cache(root: Path, repo_id: str, revision: str = "0123abcd") -> Path:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<rev>/...}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED / name, snap / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snap


def test_model_found_in_the_local_hf_cache(tmp_path, monkeypatch):
    snap = _fake_hf_cache(tmp_path, "acme/tiny-chat")
    assert cached_model_dir("acme/tiny-chat", cache_dir=tmp_path) == snap
    assert cached_model_dir("acme/not-there", cache_dir=tmp_path) is None
    assert cached_model_dir("no-slash", cache_dir=tmp_path) is None
    assert cached_model_dir("acme/bad name!", cache_dir=tmp_path) is None  # not a repo id: no error
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    tok = resolve_tokenizer("acme/tiny-chat", None)
    assert str(snap) in tok.source


@pytest.mark.parametrize("inline", ["{{ messages[0].content }}", "plain\ntext", "{% raw %}"])
def test_chat_template_inline_values_like_vllm(inline):
    # vLLM's rule: a value holding `{`, `}` or a newline that is not a file is the template itself
    assert _chat_template_source(inline) == inline


def test_chat_template_file_and_missing_path(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ 1 }}")
    assert _chat_template_source(str(f)) == "{{ 1 }}"
    with pytest.raises(CLIError, match="--chat-template: .*no-such.jinja"):
        _chat_template_source(str(tmp_path / "no-such.jinja"))
    assert _chat_template_source(None) is None

