"""What turns requests into engine requests and engine outputs into text, for every front door.

Tokenizer and detokenizer (`tokenizer`), chat templates in their sandbox (`chat_template`),
request schemas and vLLM's request checks (`protocol`, `request_checks`, `errors`), engine
requests and per-choice output state (`generation`), logprobs (`logprobs`), tool-call formats and
parsers (`tools/`), structured-output constraints and their generators (`structured/`).
Nothing here speaks HTTP or ZMQ: `serve`'s API families and `play` (`wire/`) both use it.
"""
