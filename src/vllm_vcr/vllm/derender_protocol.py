"""Request bodies of the derender routes (vLLM 0.32's DerenderChatRequest, DerenderCompletionRequest
and their streaming forms, read leniently), and their errors."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..frontend.errors import HTTPError
from ..frontend.protocol import ChatCompletionRequest, CompletionRequest

PARSER_NEEDS_REQUEST = ("chat_request is required when a tool or reasoning parser is configured because plain "
                        "detokenization would leak raw parser markup into content.")


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TokensChoice(_Lenient):
    index: int
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class TokensResponse(_Lenient):
    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    choices: list[TokensChoice]
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    output_mode: Literal["tokens"] = "tokens"


class StreamState(_Lenient):
    """DerenderStreamState: what the client carries between streamed calls (this server decodes
    the whole output each call, so only the replay fields are read; the others go back as sent)."""

    prev_tokens: list[str] = Field(default_factory=list, max_length=1024)
    prefix_offset: int = Field(default=0, ge=0)
    read_offset: int = Field(default=0, ge=0)
    role_sent: bool = False
    logprob_context_token_ids: list[int] = Field(default_factory=list, max_length=4)
    logprob_text_offset: int = Field(default=0, ge=0)
    output_token_ids: list[int] = Field(default_factory=list)
    output_chunk_lens: list[int] = Field(default_factory=list)
    tools_streamed: bool = False
    last_tool_call_ids: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _lens_add_up(self) -> StreamState:
        if sum(self.output_chunk_lens) != len(self.output_token_ids):
            raise ValueError(f"output_chunk_lens must sum to len(output_token_ids) (got sum="
                             f"{sum(self.output_chunk_lens)}, len(output_token_ids)={len(self.output_token_ids)})")
        return self


class DerenderChat(_Lenient):
    stream: bool = False
    model: str | None = None
    generate_response: TokensResponse | None = None
    generate_chunk: TokensResponse | None = None
    stream_state: StreamState | None = None
    prompt_tokens: int | None = None
    prompt_token_ids: list[int] | None = None
    chat_request: ChatCompletionRequest | None = None


class DerenderCompletion(_Lenient):
    stream: bool = False
    model: str | None = None
    generate_responses: list[TokensResponse] | None = None
    generate_chunk: TokensResponse | None = None
    stream_state: StreamState | None = None
    prompt_tokens: list[int] | int | None = None
    prompt_token_ids: list[list[int] | None] | list[int] | None = None
    completion_request: CompletionRequest | None = None


def bad_request(message: str) -> HTTPError:
    return HTTPError(400, message, "BadRequestError")
