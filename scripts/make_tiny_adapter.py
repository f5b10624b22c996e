#!/usr/bin/env python3
"""Write a tiny PEFT LoRA adapter directory for the tiny model of scripts/make_tiny_model.py.

usage: python scripts/make_tiny_adapter.py OUT_DIR [--model MODEL_DIR] [--rank 8]

`adapter_config.json` as `peft` writes it, and `adapter_model.safetensors` with zero-valued
lora_A/lora_B matrices for q_proj and v_proj of every layer (so the adapter changes nothing and a
real vLLM engine can load it). The safetensors file is written by hand (8-byte header length,
JSON header, raw little-endian data): no torch or safetensors package needed. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

DEFAULT_MODEL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                 "head_dim": 32}


def _tensors(model: dict, rank: int) -> dict[str, tuple[list[int], bytes]]:
    hidden = model["hidden_size"]
    head_dim = model.get("head_dim") or hidden // model["num_attention_heads"]
    outs = {"q_proj": model["num_attention_heads"] * head_dim,
            "v_proj": model.get("num_key_value_heads", model["num_attention_heads"]) * head_dim}
    tensors = {}
    for layer in range(model["num_hidden_layers"]):
        for proj, out in outs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = ([rank, hidden], bytes(4 * rank * hidden))
            tensors[f"{prefix}.lora_B.weight"] = ([out, rank], bytes(4 * out * rank))
    return tensors


def write_safetensors(path: Path, tensors: dict[str, tuple[list[int], bytes]]) -> None:
    header: dict = {}
    offset = 0
    for name, (shape, data) in tensors.items():
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, data in tensors.values():
            f.write(data)


def make_adapter(out: Path, model_dir: Path | None = None, rank: int = 8) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    model = dict(DEFAULT_MODEL)
    if model_dir is not None and (model_dir / "config.json").is_file():
        model.update(json.loads((model_dir / "config.json").read_text()))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "bias": "none",
              "base_model_name_or_path": str(model_dir) if model_dir else None, "fan_in_fan_out": False,
              "inference_mode": True, "use_dora": False, "modules_to_save": None}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    write_safetensors(out / "adapter_model.safetensors", _tensors(model, rank))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--model", default=None, help="the model directory (its config.json gives the shapes)")
    ap.add_argument("--rank", type=int, default=8)
    a = ap.parse_args()
    print(make_adapter(Path(a.out), Path(a.model) if a.model else None, a.rank))


if __name__ == "__main__":
    main()
