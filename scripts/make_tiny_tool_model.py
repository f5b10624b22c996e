#!/usr/bin/env python3
"""Write a tiny local model directory whose tokenizer has the tool-call special tokens of the
Llama 3.1 and Mistral (v0.3, pre-v11) families, so a real vLLM frontend starts with
`--tool-call-parser llama3_json` or `mistral` (both refuse a tokenizer without their tokens).

usage: python scripts/make_tiny_tool_model.py OUT_DIR [--vocab-size 4096]

The default chat template renders tools as Llama 3.1's does (JSON definitions in the first user
turn, "Environment: ipython" in the system turn); `tool_chat_template_mistral.jinja` in the same
directory renders them as Mistral v0.3's does (`[AVAILABLE_TOOLS] [...][/AVAILABLE_TOOLS]` before
the last `[INST]`), `tool_chat_template_hermes.jinja` as Hermes models do (`<tools>...</tools>`):
pass one to the frontend with `--chat-template`. Same tokenizer training as
scripts/make_tiny_model.py (nothing is downloaded). Needs `tokenizers`.
"""

from __future__ import annotations

import argparse
import os

from make_tiny_model import build_tokenizer, write_model

LLAMA_TOKENS = ("<|python_tag|>", "<|eom_id|>")
# no [ARGS]: vLLM reads a tokenizer without it as pre-v11 ([TOOL_CALLS] [{"name", "arguments"}])
MISTRAL_TOKENS = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]")

_CONTENT = "{%- set content = message['content'] if message['content'] is string else '' %}"
_ARGS = ("{% set args = call['function']['arguments'] %}"
         "{{- args if args is string else args | tojson }}")

LLAMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython<|eot_id|>{%- endif %}"
    "{%- set ns = namespace(tools_shown=false) %}"
    "{%- for message in messages %}" + _CONTENT +
    "{%- if message['role'] == 'user' and tools and not ns.tools_shown %}{%- set ns.tools_shown = true %}"
    "<|start_header_id|>user<|end_header_id|>\n\n"
    "Given the following functions, please respond with a JSON for a function call with its proper arguments "
    "that best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": "
    "dictionary of argument name and its value}. Do not use variables.\n\n"
    "{% for tool in tools %}{{ tool | tojson }}\n\n{% endfor %}{{ content }}<|eot_id|>"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for call in message['tool_calls'] %}{\"name\": \"{{ call['function']['name'] }}\", \"parameters\": "
    + _ARGS + "}{%- endfor %}<|eom_id|>"
    "{%- elif message['role'] in ('tool', 'ipython') %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{{ content }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ content }}<|eot_id|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)

MISTRAL_TEMPLATE = (
    "{{- bos_token }}"
    "{%- set ns = namespace(last_user=-1, system='') %}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- elif message['role'] == 'system' %}{%- set ns.system = message['content'] %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}" + _CONTENT +
    "{%- if message['role'] == 'user' %}"
    "{%- if tools and loop.index0 == ns.last_user %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{%- endif %}[INST] {% if ns.system and loop.index0 == ns.last_user %}{{ ns.system }}\n\n{% endif %}"
    "{{ content }}[/INST]"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}[TOOL_CALLS] ["
    "{% for call in message['tool_calls'] %}{\"name\": \"{{ call['function']['name'] }}\", \"arguments\": "
    + _ARGS + "}{{ ', ' if not loop.last }}{%- endfor %}]{{ eos_token }}"
    "{%- elif message['role'] == 'assistant' %}{{ content }}{{ eos_token }}"
    "{%- elif message['role'] == 'tool' %}[TOOL_RESULTS] {\"content\": {{ content | tojson }}}[/TOOL_RESULTS]"
    "{%- endif %}{%- endfor %}"
)

# Hermes (Qwen/NousResearch) style: the tools in <tools></tools> in the system turn
HERMES_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nYou may call one or more functions. "
    "Function signatures are within <tools></tools> XML tags:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\nFor each function call, return a json "
    "object with function name and arguments within <tool_call></tool_call> XML tags.<|eot_id|>{%- endif %}"
    "{%- for message in messages %}" + _CONTENT +
    "{%- if message['role'] == 'assistant' and message['tool_calls'] %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for call in message['tool_calls'] %}<tool_call>\n{\"name\": \"{{ call['function']['name'] }}\", "
    "\"arguments\": " + _ARGS + "}\n</tool_call>{%- endfor %}<|eot_id|>"
    "{%- elif message['role'] == 'tool' %}<|start_header_id|>user<|end_header_id|>\n\n"
    "<tool_response>\n{{ content }}\n</tool_response><|eot_id|>"
    "{%- else %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ content }}<|eot_id|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)

TEMPLATE_FILES = {"tool_chat_template_mistral.jinja": MISTRAL_TEMPLATE,
                  "tool_chat_template_hermes.jinja": HERMES_TEMPLATE}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--vocab-size", type=int, default=4096)
    a = ap.parse_args()
    tok = build_tokenizer(a.vocab_size, LLAMA_TOKENS + MISTRAL_TOKENS)
    write_model(a.out, tok, LLAMA_TEMPLATE)
    for name, template in TEMPLATE_FILES.items():
        with open(os.path.join(a.out, name), "w") as f:
            f.write(template)


if __name__ == "__main__":
    main()
