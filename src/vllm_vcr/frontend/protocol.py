"""OpenAI-compatible request schemas (pydantic v2, field names and defaults as vLLM's).

Unknown fields are accepted and ignored, as vLLM does. The checks vLLM's request models make
while parsing are model validators here; they raise RequestValueError, which parse_request
(serving_base.py) hands on as vLLM's 400 BadRequestError. Value checks that vLLM performs
while building SamplingParams live in request_checks.py (`check_sampling`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal, Optional

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from typing_extensions import Required, TypedDict

from .errors import rebuilt_exception

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
MAX_N = 16384  # vLLM's VLLM_MAX_N_SEQUENCES
MAX_PROMPTS = 1024  # vLLM's VLLM_MAX_COMPLETION_PROMPTS
# n x prompts: ours (vLLM checks n alone, as `n must be at most 16384`, and takes 1,024 prompts), so one
# request cannot hold millions of sequences; far above what vLLM's own limits let a client ask in practice
MAX_CHOICES = 1 << 18


class RequestValueError(ValueError):
    """A well-typed request with a bad value: 400 BadRequestError.

    Worded like vLLM's VLLMValidationError: when the parameter (and value) are known they are
    appended as " (parameter=..., value=...)" and `param` names the field.
    """

    def __init__(self, message: str, param: str | None = None, value: Any = None):
        extras = []
        if param is not None:
            extras.append(f"parameter={param}")
        if value is not None:
            extras.append(f"value={value}")
        super().__init__(f"{message} ({', '.join(extras)})" if extras else message)
        self.param = param

    def __reduce__(self) -> tuple[Any, ...]:
        # the worded message and param as they are (a check run in a worker process: isolated.py)
        return rebuilt_exception, (type(self), self.args, self.__dict__)


class RequestSchemaError(ValueError):
    """A part of the request vLLM validates after the request model (lazily, e.g. an assistant
    message's tool_calls): pydantic's errors, reported as the request's 400 validation error."""

    def __init__(self, errors: list[dict[str, Any]]):
        super().__init__(f"{len(errors)} validation errors")
        self.errors = errors


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="wrap")
    @classmethod
    def _wrapped(cls, data: Any, handler: Any) -> Any:
        # vLLM's request models carry a wrap validator (it logs unknown fields); pydantic then names
        # a union member by the validator rather than by the class in an error's `loc`, which the
        # error handler drops: "body.response_format.type", not "body.response_format.ResponseFormat.type"
        return handler(data)


def _as_dicts(value: Any) -> Any:
    """A validated sub-model (or list of them) back to the plain JSON object it was sent as: the
    schema is vLLM's, the rest of the frontend reads dicts."""
    if isinstance(value, list):
        return [_as_dicts(v) for v in value]
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_unset=True, by_alias=True)
    return value


# -- tools and response formats, as vLLM's protocol types them ----------------------------------

class FunctionDefinition(_Base):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class ChatCompletionToolsParam(_Base):
    type: Literal["function"] = "function"
    function: FunctionDefinition
    defer_loading: bool | None = None


class JsonSchemaResponseFormat(_Base):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class LegacyStructuralTag(_Base):
    begin: str
    structural_tag_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    end: str


class LegacyStructuralTagResponseFormat(_Base):
    type: Literal["structural_tag"]
    structures: list[LegacyStructuralTag]
    triggers: list[str]


class StructuralTagResponseFormat(_Base):
    type: Literal["structural_tag"]
    format: Any


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


# an assistant message's tool_calls (the OpenAI SDK's TypedDicts; vLLM validates them lazily)
class _ToolCallFunction(TypedDict, total=False):
    arguments: Required[str]
    name: Required[str]


class ChatCompletionMessageFunctionToolCallParam(TypedDict, total=False):
    id: Required[str]
    function: Required[_ToolCallFunction]
    type: Required[Literal["function"]]


class _ToolCallCustom(TypedDict, total=False):
    input: Required[str]
    name: Required[str]


class ChatCompletionMessageCustomToolCallParam(TypedDict, total=False):
    id: Required[str]
    custom: Required[_ToolCallCustom]
    type: Required[Literal["custom"]]


# -- chat messages: the union vLLM validates each message against (the OpenAI SDK's message
# TypedDicts, vLLM's custom-role message, Harmony's Message). Content parts and tool calls are
# iterables there, checked when read, not here.
_Parts = str | Iterable[Any]


class ChatCompletionDeveloperMessageParam(TypedDict, total=False):
    content: Required[_Parts]
    role: Required[Literal["developer"]]
    name: str


class ChatCompletionSystemMessageParam(TypedDict, total=False):
    content: Required[_Parts]
    role: Required[Literal["system"]]
    name: str


class ChatCompletionUserMessageParam(TypedDict, total=False):
    content: Required[_Parts]
    role: Required[Literal["user"]]
    name: str


class ChatCompletionAssistantMessageParam(TypedDict, total=False):
    role: Required[Literal["assistant"]]
    audio: Optional[dict[str, Any]]
    content: Optional[_Parts]
    function_call: Optional[dict[str, Any]]
    name: str
    refusal: Optional[str]
    tool_calls: Iterable[Any]


class ChatCompletionToolMessageParam(TypedDict, total=False):
    content: Required[_Parts]
    role: Required[Literal["tool"]]
    tool_call_id: Required[str]


class ChatCompletionFunctionMessageParam(TypedDict, total=False):
    content: Required[Optional[str]]
    name: Required[str]
    role: Required[Literal["function"]]


class CustomChatCompletionMessageParam(TypedDict, total=False):
    role: Required[str]
    content: _Parts
    name: str
    tool_call_id: Optional[str]
    tool_calls: Optional[list[Any]]
    reasoning: Optional[str]
    tools: Optional[list[Any]]
    task: Optional[str]


class _HarmonyAuthor(BaseModel):
    role: Literal["user", "assistant", "system", "developer", "tool"]
    name: Optional[str] = None


class Message(BaseModel):  # (openai_harmony's)
    author: _HarmonyAuthor
    content: list[dict[str, Any]] = Field(default_factory=list)
    channel: Optional[str] = None
    recipient: Optional[str] = None
    content_type: Optional[str] = None


ChatCompletionMessageParam = (
    ChatCompletionDeveloperMessageParam | ChatCompletionSystemMessageParam | ChatCompletionUserMessageParam
    | ChatCompletionAssistantMessageParam | ChatCompletionToolMessageParam | ChatCompletionFunctionMessageParam
    | CustomChatCompletionMessageParam | Message)


_PLAIN_KEYS = frozenset(("role", "content", "name"))


def plain_messages(value: Any) -> bool:
    """Messages the union surely accepts (its custom-role member takes any string role, string
    content and name): a list of such dicts skips the union's validation, which costs ~20 us a
    message. tests/http/test_request_validation.py checks the claim with hostile input."""
    if type(value) is not list:
        return False
    for m in value:
        if type(m) is not dict or not m.keys() <= _PLAIN_KEYS or type(m.get("role")) is not str \
                or type(m.get("content", "")) is not str or type(m.get("name", "")) is not str:
            return False
    return True


def messages_as_sent(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """Validate the messages against vLLM's union, keep them as the JSON objects they were sent as."""
    if plain_messages(value):
        return value
    if value is not None and not isinstance(value, (list, str, dict)):
        # vLLM iterates the messages in a before-validator: a non-iterable is a TypeError there
        raise RequestValueError(f"'{type(value).__name__}' object is not iterable")
    if value is None:
        raise RequestValueError("'NoneType' object is not iterable")
    handler(value)
    return value


_TOOL_CALLS = TypeAdapter(list[ChatCompletionMessageFunctionToolCallParam | ChatCompletionMessageCustomToolCallParam])


def check_message_tool_calls(messages: list[dict[str, Any]]) -> None:
    """The tool calls of assistant messages, in vLLM's schema and error words."""
    for m in messages:
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if isinstance(calls, list) and calls:
            try:
                _TOOL_CALLS.validate_python(calls)
            except ValidationError as e:
                raise RequestSchemaError(e.errors(include_url=False)) from None


AnyResponseFormat = ResponseFormat | StructuralTagResponseFormat | LegacyStructuralTagResponseFormat
# vLLM's vllm_xargs: (lists of) strings and numbers only
XArgs = dict[str, str | int | float | list[str | int | float]]


class StreamOptions(_Base):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


StopParam = str | Annotated[list[str], Field(max_length=4)] | None  # VLLM_MAX_STOP_STRINGS
TokenId = Annotated[int, Field(ge=0)]


class _SamplingFields(_Base):
    """Fields common to completions and chat."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int = 1
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: StopParam = Field(default_factory=list)  # (a factory: a mutable default is deep-copied per request)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=_INT64_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None  # None: the tokenizer's side (vLLM: left)
    priority: int = Field(0, ge=_INT64_MIN, le=_INT64_MAX)
    request_id: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: XArgs | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens `token_id:N` (None: the server's flag)
    allowed_token_ids: list[int] | None = None
    use_beam_search: bool = False
    structured_outputs: dict[str, Any] | None = None  # json / regex / choice / grammar / json_object
    prompt_logprobs: int | None = None
    stream_interval: Annotated[int, Field(ge=1)] | None = None  # raises --stream-interval for this request

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise RequestValueError("Stream options can only be defined when `stream=True`.", "stream_options")
        return self

    @model_validator(mode="after")
    def _check_prompt_logprobs(self) -> _SamplingFields:
        plp = self.prompt_logprobs
        if plp is not None and self.stream and (plp > 0 or plp == -1):
            raise RequestValueError("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        if plp is not None and plp < 0 and plp != -1:
            raise RequestValueError("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs", plp)
        return self


class CompletionRequest(_SamplingFields):
    prompt: list[TokenId] | list[list[TokenId]] | str | list[str] | None = None
    prompt_embeds: Any = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16  # vLLM's (and OpenAI's) completions default
    suffix: str | None = None
    add_special_tokens: bool = True
    response_format: AnyResponseFormat | None = None

    _format_as_dict = field_validator("response_format", mode="after")(_as_dicts)

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _null_max_tokens(cls, v: Any) -> Any:
        return 16 if v is None else v  # vLLM's normalize_null_max_tokens: null is the default, not "no limit"

    @model_validator(mode="after")
    def _check_prompt_and_logprobs(self) -> CompletionRequest:
        check_prompt_logprobs_field(self.prompt_logprobs, self.stream)
        p = self.prompt
        if (p is None or p == "") and (self.prompt_embeds is None or self.prompt_embeds == []):
            raise RequestValueError("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        if isinstance(p, list) and p and not isinstance(p[0], int) and len(p) > MAX_PROMPTS:
            raise RequestValueError(f"prompt list length {len(p)} exceeds the maximum allowed count of "
                                    f"{MAX_PROMPTS}. To increase this limit, set the VLLM_MAX_COMPLETION_PROMPTS "
                                    "environment variable.", "prompt")
        if self.logprobs is not None and self.logprobs < 0 and self.logprobs != -1:
            raise RequestValueError("`logprobs` must be a positive value or -1.", "logprobs", self.logprobs)
        return self  # prompt_embeds are refused where vLLM refuses them: after the model check


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatCompletionMessageParam]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Any = "none"
    parallel_tool_calls: bool | None = True
    response_format: AnyResponseFormat | None = None
    # vLLM extras
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    prompt_logprobs: int | None = None

    _tools_as_dicts = field_validator("tools", "response_format", mode="after")(_as_dicts)
    _messages_as_sent = field_validator("messages", mode="wrap")(messages_as_sent)

    @model_validator(mode="after")
    def _check_tool_calls(self) -> ChatCompletionRequest:
        check_message_tool_calls(self.messages)
        return self

    @model_validator(mode="after")
    def _check_logprobs_and_prompt_flags(self) -> ChatCompletionRequest:
        check_prompt_logprobs_field(self.prompt_logprobs, self.stream)
        top = self.top_logprobs
        if top is not None:
            if top < 0 and top != -1:
                raise RequestValueError("`top_logprobs` must be a positive value or -1.", "top_logprobs", top)
            if (top == -1 or top > 0) and not self.logprobs:
                raise RequestValueError("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        if self.add_generation_prompt and self.continue_final_message:
            raise RequestValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return self


# the fields of vLLM's BatchChatCompletionRequest: one conversation's chat request is made of these
BATCH_CHAT_FIELDS = (
    "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "logprob_token_ids", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "temperature", "top_p",
    "user", "tool_choice", "include_reasoning", "best_of", "use_beam_search", "top_k", "min_p",
    "repetition_penalty", "watermarking", "length_penalty", "early_stopping", "structured_outputs", "request_id",
    "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs", "media_io_kwargs",
    "mm_processor_kwargs", "priority", "cache_salt", "include_stop_str_in_output", "guided_decoding_backend", "echo",
    "return_tokens_as_token_ids", "return_token_ids")


def batch_conversations_as_sent(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    handler(value)
    return value


class BatchChatCompletionRequest(_Base):
    """POST /v1/chat/completions/batch: chat's fields, `messages` a list of conversations; no
    streaming, tools, beam search or n > 1 (each conversation is one choice)."""

    messages: Annotated[list[Annotated[list[ChatCompletionMessageParam], Field(min_length=1)]], Field(min_length=1)]
    model: str | None = None
    n: int | None = 1
    tool_choice: Literal["none"] | None = "none"
    use_beam_search: bool = False

    _conversations_as_sent = field_validator("messages", mode="wrap")(batch_conversations_as_sent)

    @model_validator(mode="before")
    @classmethod
    def _check_batch_mode(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("use_beam_search"):
            raise RequestValueError("Batch chat completions do not support beam search. Please set "
                                    "`use_beam_search` to False.", "use_beam_search")
        if data.get("logprob_token_ids") and not data.get("logprobs"):
            raise RequestValueError("when using `logprob_token_ids`, `logprobs` must be set to true.",
                                    "logprob_token_ids")
        kv = data.get("kv_transfer_params")
        if isinstance(kv, dict) and kv.get("prompt_token_ids") is not None:
            raise RequestValueError("Batch chat completions do not support `kv_transfer_params['prompt_token_ids']`: "
                                    "one pre-tokenized prompt cannot serve several conversations.",
                                    "kv_transfer_params.prompt_token_ids")
        n = data.get("n", 1)
        if n is not None and n != 1:
            raise RequestValueError("Batch chat completions do not support `n > 1`. Please set `n` to 1.", "n", n)
        return data


class TokenizeCompletionRequest(_Base):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Base):
    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[TokenId]



def token_choice_params(req: Any, vocab_size: int) -> tuple[dict[int, float] | None, list[int] | None]:
    """`logit_bias` (int ids, biases clamped to [-100, 100]) and `allowed_token_ids`, checked in
    vLLM's order and words (SamplingParams.from_optional, then its vocabulary checks, which also
    refuse `stop_token_ids` outside the vocabulary)."""
    bias = getattr(req, "logit_bias", None)
    allowed = getattr(req, "allowed_token_ids", None)
    if bias is not None:
        converted, invalid = {}, []
        for key, value in bias.items():
            try:
                converted[int(key)] = min(100.0, max(-100.0, value))
            except (TypeError, ValueError):
                invalid.append(key)
        if invalid:
            listed = _listed(invalid)
            raise RequestValueError(f"logit_bias contains key(s) that cannot be converted to integer token IDs: "
                                    f"{listed}", "logit_bias", listed)
        out_of_vocab = [t for t in converted if not 0 <= t < vocab_size]
        if out_of_vocab:
            listed = _listed(out_of_vocab)
            raise RequestValueError(f"token_id(s) {listed} in logit_bias contain out-of-vocab token ids. "
                                    f"Vocabulary size: {vocab_size}", "logit_bias", listed)
        bias = converted or None
    stop_ids = getattr(req, "stop_token_ids", None)
    if stop_ids:
        out_of_vocab = [t for t in stop_ids if not 0 <= t < vocab_size]
        if out_of_vocab:
            listed = _listed(out_of_vocab)
            raise RequestValueError(f"token_id(s) {listed} in stop_token_ids contain out-of-vocab token ids. "
                                    f"Vocabulary size: {vocab_size}", "stop_token_ids", listed)
    if allowed is not None:
        if not allowed:
            raise RequestValueError("allowed_token_ids is not None and empty!", "allowed_token_ids", allowed)
        out_of_vocab = [t for t in allowed if not 0 <= t < vocab_size]
        if out_of_vocab:
            raise RequestValueError("allowed_token_ids contains out-of-vocab token id!", "allowed_token_ids",
                                    out_of_vocab)
    return bias, allowed



MAX_LISTED = 100  # offending values an error message lists (vLLM lists them all)


def _listed(values: list[Any]) -> Any:
    """The values as vLLM's message lists them; past MAX_LISTED, the first ones and the count
    (a 4.5M-key logit_bias would otherwise answer with an error of 80 MB)."""
    if len(values) <= MAX_LISTED:
        return values
    return _Listed(f"{repr(values[:MAX_LISTED])[:-1]}, ... ({len(values)} in all)]")


class _Listed(str):
    def __repr__(self) -> str:  # formatted bare, like the list it stands for
        return str(self)


def stop_list(stop: StopParam) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    return list(stop)



def check_prompt_logprobs_field(value: int | None, stream: bool | None) -> None:
    """The request model's own check of prompt_logprobs (vLLM runs it while parsing)."""
    if value is None:
        return
    if stream and (value > 0 or value == -1):
        raise RequestValueError("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    if value < 0 and value != -1:
        raise RequestValueError("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs", value)


