#!/usr/bin/env python3
"""Write a tiny local model directory that a real vLLM frontend (and `vllm-vcr serve`) accepts.

usage: python scripts/make_tiny_model.py OUT_DIR [--vocab-size 4096]

Nothing is downloaded: the byte-level BPE tokenizer is trained on this Python's own standard
library sources (sorted, so the result is the same on every run of the same Python), and the
config describes a tiny non-MoE Llama. With `--load-format dummy` a real vLLM CPU engine can even
run it (head_dim 32 is one the CPU attention backend supports; 16 is not). Needs `tokenizers`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sysconfig

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
HEADER_START, HEADER_END, EOT = "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
SPECIALS = [BOS, EOS, PAD, HEADER_START, HEADER_END, EOT]

# Llama-3 shaped: role headers as special tokens, each turn closed by <|eot_id|>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] if message['content'] is string else '' }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def corpus_files(limit: int = 200) -> list[str]:
    return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:limit]


def build_tokenizer(vocab_size: int, extra_specials: tuple[str, ...] = ()) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS + list(extra_specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(corpus_files(), trainer)
    # The chat template writes BOS itself, so only plain (completion) prompts get one added here.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def write_json(out: str, name: str, obj: dict) -> None:
    with open(os.path.join(out, name), "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def write_model(out: str, tok: Tokenizer, chat_template: str, special_tokens: dict[str, str] | None = None) -> None:
    """The model directory around a trained tokenizer: tokenizer files, config, generation config."""
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    vocab = tok.get_vocab_size()
    bos, eos, pad, eot = (tok.token_to_id(s) for s in (BOS, EOS, PAD, EOT))

    write_json(out, "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "model_max_length": 2048, "clean_up_tokenization_spaces": False,
        "chat_template": chat_template, **(special_tokens or {}),
    })
    write_json(out, "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD})
    write_json(out, "config.json", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
        "attention_bias": False, "mlp_bias": False,
    })
    # generation_config's eos list is what the frontend turns into stop_token_ids (EOS and EOT).
    write_json(out, "generation_config.json", {"bos_token_id": bos, "eos_token_id": [eos, eot], "pad_token_id": pad})
    print(f"tiny model: vocab {vocab}, eos {eos}, eot {eot} -> {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--vocab-size", type=int, default=4096)
    a = ap.parse_args()
    write_model(a.out, build_tokenizer(a.vocab_size), CHAT_TEMPLATE)


if __name__ == "__main__":
    main()
