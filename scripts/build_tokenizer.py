#!/usr/bin/env python3
"""Build the embedded default tokenizer shipped in `src/vllm_vcr/data/`.

A byte-level BPE (any UTF-8 text round-trips exactly) trained on text this script generates
itself from a fixed seed, so the result is reproducible and owes nothing to any model's files.
Writes `tokenizer.json` and `tokenizer_config.json` (with a Llama-3-like chat template).

    python scripts/build_tokenizer.py [--vocab-size 4096] [--out src/vllm_vcr/data]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from vllm_vcr.frontend.tokenizer import _bytes_to_unicode

SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|pad|>",
]
BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"

# Written for this script: common English words plus programming vocabulary, enough for BPE to
# learn useful merges so that realistic prompts are ~4 characters per token.
WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have this from
or had by hot word but what some we can out other were all there when up use your how said an each
she which do their time if will way about many then them write would like so these her long make
thing see him two has look more day could go come did number sound no most people my over know
water than call first who may down side been now find any new work part take get place made live
where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move
right boy old too same tell does set three want air well also play small end put home read hand
port large spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth father
head stand own page should country found answer school grow study still learn plant cover food
sun four between state keep eye never last let thought city tree cross farm hard start might story
saw far sea draw left late run while press close night real life few north open seem together next
white children begin got walk example ease paper group always music those both mark often letter
until mile river car feet care second book carry took science eat room friend began idea fish
mountain stop once base hear horse cut sure watch color face wood main enough plain girl usual
young ready above ever red list though feel talk bird soon body dog family direct pose leave song
measure door product black short numeral class wind question happen complete ship area half rock
order fire south problem piece told knew pass since top whole king space heard best hour better
true during hundred five remember step early hold west ground interest reach fast verb sing listen
six table travel less morning ten simple several vowel toward war lay against pattern slow center
love person money serve appear road map rain rule govern pull cold notice voice unit power town
fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest correct
able pound done beauty drive stood contain front teach week final gave green oh quick develop ocean
warm free minute strong special mind behind clear tail produce fact street inch multiply nothing
course stay wheel full force blue object decide surface deep moon island foot system busy test
record boat common gold possible plane stead dry wonder laugh thousand ago ran check game shape
equate miss brought heat snow tire bring yes distant fill east paint language among grand ball yet
wave drop heart present heavy dance engine position arm wide sail material size vary settle speak
weight general ice matter circle pair include divide syllable felt perhaps pick sudden count square
reason length represent art subject region energy hunt probable bed brother egg ride cell believe
fraction forest sit race window store summer train sleep prove lone leg exercise wall catch mount
wish sky board joy winter sat written wild instrument kept glass grass cow job edge sign visit past
soft fun bright gas weather month million bear finish happy hope flower clothe strange gone jump
baby eight village meet root buy raise solve metal whether push seven paragraph third shall held
hair describe cook floor either result burn hill safe cat century consider type law bit coast copy
phrase silent tall sand soil roll temperature finger industry value fight lie beat excite natural
view sense ear else quite broke case middle kill son lake moment scale loud spring observe child
straight consonant nation dictionary milk speed method organ pay age section dress cloud surprise
quiet stone tiny climb cool design poor lot experiment bottom key iron single stick flat twenty
skin smile crease hole trade melody trip office receive row mouth exact symbol die least trouble
shout except wrote seed tone join suggest clean break lady yard rise bad blow oil blood touch grew
cent mix team wire cost lost brown wear garden equal sent choose fell fit flow fair bank collect
save control decimal gentle woman captain practice separate difficult doctor please protect noon
whose locate ring character insect caught period indicate radio spoke atom human history effect
electric expect crop modern element hit student corner party supply bone rail imagine provide agree
thus capital chair danger fruit rich thick soldier process operate guess necessary sharp wing
create neighbor wash bat rather crowd corn compare poem string bell depend meat rub tube famous
dollar stream fear sight thin triangle planet hurry chief colony clock mine tie enter major fresh
search send yellow gun allow print dead spot desert suit current lift rose continue block chart hat
sell success company subtract event particular deal swim term opposite wife shoe shoulder spread
arrange camp invent cotton born determine quart nine truck noise level chance gather shop stretch
throw shine property column molecule select wrong gray repeat require broad prepare salt nose
plural anger claim continent oxygen sugar death pretty skill women season solution magnet silver
thank branch match suffix especially fig afraid huge sister steel discuss forward similar guide
experience score apple bought led pitch coat mass card band rope slip win dream evening condition
feed tool total basic smell valley nor double seat arrive master track parent shore division sheet
substance favor connect post spend chord fat glad original share station dad bread charge proper
bar offer segment slave duck instant market degree populate chick dear enemy reply drink occur
support speech nature range steam motion path liquid log meant quotient teeth shell neck
model request response token server latency throughput benchmark cache prefix prompt engine
schedule batch queue stream generate completion assistant user system message content role
function return class import from def self none true false print value error result config
""".split()

CODE_SNIPPETS = [
    "def {a}({b}, {c}):\n    return {b} + {c}\n",
    "for {a} in range({n}):\n    print({a})\n",
    "if {a} is None:\n    raise ValueError(\"{b} {c}\")\n",
    "class {A}:\n    def __init__(self, {a}):\n        self.{a} = {a}\n",
    "{{\"{a}\": {n}, \"{b}\": \"{c}\", \"items\": [{n}, {m}]}}\n",
    "import {a}\nfrom {b} import {c}\n",
    "const {a} = await fetch(`/api/{b}/${{{c}}}`);\n",
    "SELECT {a}, {b} FROM {c} WHERE id = {n};\n",
    "    {a} = {b}.get(\"{c}\", {n})\n",
]

# A little non-English text so common multi-byte characters get merged tokens of their own.
UNICODE_LINES = [
    "Grüße aus München, schönes Wetter heute.",
    "Café, crème brûlée et déjà vu — très bien.",
    "¿Dónde está la biblioteca? Mañana.",
    "Привет, как дела? Всё хорошо.",
    "こんにちは世界。今日はいい天気ですね。",
    "你好，世界！今天天气很好。",
    "안녕하세요 세계",
    "Emoji: 😀 🚀 ✨ 👍 🎉",
    "Math: α + β = γ, ∑ x² ≤ ∞, π ≈ 3.14159",
]


def generate_corpus(seed: int, lines: int) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(lines):
        kind = rng.random()
        if kind < 0.70:
            n = rng.randint(6, 24)
            words = [rng.choice(WORDS) for _ in range(n)]
            words[0] = words[0].capitalize()
            sentence = " ".join(words)
            sentence += rng.choice([".", ".", ".", "?", "!", ",", ":"])
            if rng.random() < 0.2:
                sentence += f" {rng.randint(0, 10 ** rng.randint(1, 6))}"
            out.append(sentence)
        elif kind < 0.92:
            w = [rng.choice(WORDS) for _ in range(3)]
            out.append(rng.choice(CODE_SNIPPETS).format(
                a=w[0], b=w[1], c=w[2], A=w[0].capitalize(), n=rng.randint(0, 999), m=rng.randint(0, 99)))
        else:
            out.append(rng.choice(UNICODE_LINES))
    return out


CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- elif message['content'] is none %}{%- set content = '' %}"
    "{%- else %}{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + content | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def _byte_decoder() -> dict[str, int]:
    """Printable character -> byte, the inverse of the map the tokenizer module detokenizes with."""
    return {c: b for b, c in _bytes_to_unicode().items()}


def _is_clean(piece: str, dec: dict[str, int]) -> bool:
    """The token's bytes are whole UTF-8 characters (it decodes alone, no U+FFFD) and printable
    (no control characters but newline and tab)."""
    try:
        text = bytes(dec[c] for c in piece).decode("utf-8")
    except (KeyError, UnicodeDecodeError):
        return False
    return all(ch in "\n\t" or (ord(ch) >= 0x20 and ord(ch) != 0x7F) for ch in text)


def _clean_tokens_first(tok: Tokenizer) -> Tokenizer:
    """Renumber the vocabulary: tokens that are whole UTF-8 characters first, partial-byte tokens
    last. BPE merges name tokens by string, so ids are free to permute; the simulator then draws
    random output from the clean range only and random text never shows U+FFFD."""
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    dec = _byte_decoder()
    ordered = sorted(vocab, key=lambda t: (not _is_clean(t, dec), vocab[t]))
    spec["model"]["vocab"] = {t: i for i, t in enumerate(ordered)}
    return Tokenizer.from_str(json.dumps(spec))


def build(vocab_size: int, seed: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[],  # added last so ordinary ids stay dense from 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(generate_corpus(seed, 60000), trainer=trainer)
    tok = _clean_tokens_first(tok)
    tok.add_special_tokens(SPECIAL_TOKENS)
    bos_id = tok.token_to_id(BOS)
    # Like Llama 3: a plain encode (completions) starts with BOS; chat prompts carry it in the template.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=20240601)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "src/vllm_vcr/data"))
    ns = ap.parse_args()
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build(ns.vocab_size, ns.seed)
    tok.save(str(out / "tokenizer.json"), pretty=False)
    dec = _byte_decoder()
    clean = sum(1 for t, i in tok.get_vocab(with_added_tokens=False).items() if _is_clean(t, dec))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        # ids [0, this) are whole characters: what the simulator's random mode draws from
        "vllm_vcr_random_vocab_size": clean,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": "<|pad|>",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                      "normalized": False, "single_word": False}
            for t in SPECIAL_TOKENS
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    sample = "Hello, world! Grüße 😀"
    ids = tok.encode(sample, add_special_tokens=False).ids
    assert tok.decode(ids) == sample
    print(f"wrote {out}: vocab {tok.get_vocab_size()} ({len(SPECIAL_TOKENS)} special, {clean} whole-character), "
          f"{len(sample)} chars -> {len(ids)} tokens")


if __name__ == "__main__":
    main()
