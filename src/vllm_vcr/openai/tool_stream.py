"""Streaming tool calls: chat chunks whose deltas carry tool-call pieces, as vLLM 0.32 sends them.

- A parser reading its own format (hermes, llama3_json, mistral, and every "auto"): content until
  a call starts, then per call a header entry `{id, type, index, function: {name}}` (no
  arguments) and argument fragments `{index, function: {arguments}}` as the text arrives (mistral's
  fragments also carry `"type": "function"`, and its ids are 9 letters and digits).
- The JSON vLLM forces for "required" / a named function (pythonic): the header entry carries the
  name and the arguments written so far together; later entries only new argument text.
- A delta with tool calls has no `content` key unless there is content (hermes: `null`, as its
  parser sets the field). The finish chunk's delta is empty once everything went out (llama3_json:
  an empty fragment of the last call, as its parser re-reads the finished JSON); the finish
  reason is "tool_calls" when calls went out (except for a named tool_choice).

Only requests with tools take this path: the chunk is begun and ended by the chat stream's own
`begin` and `end_chunk` (ChatStream); only the delta is this module's.
"""

from __future__ import annotations

from typing import Any

from ..engine.types import EngineCoreOutput
from ..frontend.chat_outputs import ChatOutputPlan
from ..frontend.tools.calls import extract_calls
from ..frontend.tools.formats import Llama3JsonFormat, PartialCall
from ..http.serving_base import encode


class ToolDeltas:
    """One choice's streamed tool calls: feed it the text as it grows, get what is new to send
    (content, then per call a header delta and argument fragments)."""

    __slots__ = ("plan", "text", "content_sent", "names", "args_sent", "streamed", "forced_json")

    def __init__(self, plan: ChatOutputPlan) -> None:
        self.plan = plan
        self.forced_json = plan.fmt.json_for_forced and (plan.named is not None or plan.tool_choice == "required")
        self.text = ""
        self.content_sent = 0
        self.names: list[str] = []  # names of the calls whose header went out
        self.args_sent: list[str] = []
        self.streamed = False

    def _partial(self) -> tuple[str, list[PartialCall]]:
        plan, text = self.plan, self.text
        if plan.fmt.json_for_forced and plan.named is not None:
            return "", [PartialCall(plan.named, text, False)]
        if plan.fmt.json_for_forced and plan.tool_choice == "required":
            return "", Llama3JsonFormat().partial(text.lstrip().lstrip("["))[1]
        return plan.fmt.partial(text)

    def advance(self, delta_text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """(new content, tool-call deltas) once `delta_text` is added."""
        self.text += delta_text
        content, partial = self._partial()
        if finished:
            done = extract_calls(self.plan.fmt, self.text, self.plan.tool_choice)
            if done is not None and done[1]:
                partial = [PartialCall(c.name, c.arguments, True) for c in done[1]]
            elif not self.names:
                content = self.text  # no call after all: everything is content
        new_content = content[self.content_sent:] if len(content) > self.content_sent else ""
        self.content_sent = max(self.content_sent, len(content))
        deltas: list[dict[str, Any]] = []
        fmt, forced_json = self.plan.fmt, self.forced_json
        for k, call in enumerate(partial):
            if k >= len(self.names):
                if call.name is None:
                    break
                self.names.append(call.name)
                header = {"id": fmt.call_id(), "type": "function", "index": k, "function": {"name": call.name}}
                if forced_json:  # vLLM's JSON path: name and the arguments so far in one entry
                    header["function"]["arguments"] = call.arguments
                self.args_sent.append(call.arguments if forced_json else "")
                deltas.append(header)
            sent = self.args_sent[k]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                piece: dict[str, Any] = {"type": "function"} if fmt.typed_argument_deltas else {}
                piece.update(index=k, function={"arguments": call.arguments[len(sent):]})
                deltas.append(piece)
                self.args_sent[k] = call.arguments
        if finished and not deltas and self.names and fmt.empty_fragment_at_finish and not forced_json:
            deltas.append({"index": len(self.names) - 1, "function": {"arguments": ""}})
        if self.plan.req.parallel_tool_calls is False:
            deltas = [d for d in deltas if d["index"] == 0]
        self.streamed = self.streamed or bool(deltas)
        return new_content, deltas


class ToolCallStreamMixin:
    """Mixed into chat.ChatStream (as ToolChatStream): its `feed` for tool requests."""

    def __init__(self, *args: Any) -> None:
        *base, plan = args
        super().__init__(*base)
        self.plan: ChatOutputPlan = plan
        self.calls = [ToolDeltas(plan) for _ in range(self.total)]
        self.plain = False

    def feed(self, out: EngineCoreOutput) -> bytes:
        pre, applied = self.begin(out)
        if applied is None:
            return pre
        i, st, _, text, _ = applied
        finished = st.finished
        cc = self.calls[i]
        content, deltas = cc.advance(text, finished)
        reasoning = st.reasoning_delta if self.think else ""
        if not content and not deltas and not reasoning and not finished and not self.want_lp and not self.rti:
            return pre
        delta: dict[str, Any] = {}
        if content or deltas and self.plan.fmt.null_content_in_call_deltas and not cc.forced_json:
            delta["content"] = content or None
        if reasoning:
            delta["reasoning"] = reasoning
        if deltas:
            delta["tool_calls"] = deltas
        reason = st.finish_reason
        if finished and cc.streamed and self.plan.named is None and reason == "stop":
            reason = "tool_calls"
        return self.end_chunk(out, applied, [pre, self.head_idx[i], encode(delta)], reason)
