"""Conversations that several test modules send (the serve e2e tests and the differential suite)."""

# Message content in every shape a client sends: a system message starting with Claude Code's
# billing-header line, text parts (one with a key of its own), an assistant message with tool calls
# and no content, a tool message of parts, a developer message of parts, a plain string.
PARTS_CONVERSATION = [
    {"role": "system", "content": "x-anthropic-billing-header: cch=1f2e\nBe terse."},
    {"role": "user", "content": [{"type": "text", "text": "one"},
                                 {"type": "text", "text": "two", "cache_control": {"type": "ephemeral"}}]},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "r1"},
                                                           {"type": "text", "text": "r2"}]},
    {"role": "developer", "content": [{"type": "text", "text": "Be kind."}]},
    {"role": "user", "content": "three"},
]

# Parts of the other types a text-only model takes: thinking and refusal parts (their text), tool
# references (a tool's name; a part of its own for a template that loops over parts, in a tool
# message too).
OTHER_PARTS_CONVERSATION = [
    {"role": "user", "content": [{"type": "tool_reference", "name": "get_weather"}, {"type": "text", "text": "go"}]},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"},
                                      {"type": "refusal", "refusal": "no", "text": "not this"}],
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "tool_reference", "name": "get_weather"}]},
]
# A media part, typed or not: a model without a multimodal processor refuses it.
MEDIA_PARTS = {
    "image_url": {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}},
    "input_audio": {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    "untyped_image": {"image_url": "http://127.0.0.1:9/x.png"},
}

# A history of tool calls as clients send it: arguments as JSON text (compact, not JSON at all, a
# JSON array), an empty list of calls, the deprecated `reasoning_content`, a key vLLM drops.
TOOL_HISTORY = [
    {"role": "user", "content": "weather?", "foo": "bar"},
    {"role": "assistant", "content": None, "reasoning_content": "look it up", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris","n":1}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}},
        {"id": "call_3", "type": "function", "function": {"name": "get_weather", "arguments": "[1, 2]"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "assistant", "content": "Sunny.", "tool_calls": []},
    {"role": "user", "content": "thanks"},
]
