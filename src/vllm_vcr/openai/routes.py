"""The OpenAI family's routes: completions, chat, Responses, models, tokenize, pooling."""

from __future__ import annotations

from typing import Any

from ..frontend.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from ..http.routes import GENERATE, POOLING, Family, Route, RouteConfig
from .chat import ChatServing
from .chat_batch import BatchChatServing
from .completion import CompletionServing
from .generative_scoring import GenerativeScoringRequest, GenerativeScoringServing
from .models import ModelsServing
from .responses.serving import ResponsesServing


def services(app: Any, config: RouteConfig) -> None:
    app.completions = CompletionServing(app.engine, app.tokenizer, app.settings, app.metrics)
    app.chat = ChatServing(app.engine, app.tokenizer, app.settings, app.metrics)
    app.chat_batch = BatchChatServing(app.chat)
    app.generative_scoring = GenerativeScoringServing(app.completions)
    app.models = ModelsServing(app)
    app.responses = ResponsesServing(app.chat)
    if POOLING(config):
        from .pooling import PoolingServing

        app.pooling = PoolingServing(app, app.extensions.pooling)


_POOLING_DOC = "pooling runner ([pooling](#pooling-models)); the generation routes are gone then"

FAMILY = Family("openai", services=services, about="OpenAI API", routes=(
    Route("/v1/completions", ("POST",), lambda a: a.completions.handle, GENERATE, generation=True, json_only=True,
          body=(CompletionRequest,), doc="text completions"),
    Route("/v1/chat/completions", ("POST",), lambda a: a.chat.handle, GENERATE, generation=True, json_only=True,
          body=(ChatCompletionRequest,), doc="chat completions"),
    Route("/v1/chat/completions/batch", ("POST",), lambda a: a.chat_batch.handle, GENERATE, generation=True,
          json_only=True, body=(BatchChatCompletionRequest,), doc="several conversations, one choice each"),
    Route("/generative_scoring", ("POST",), lambda a: a.generative_scoring.handle, GENERATE, generation=True,
          json_only=True, body=(GenerativeScoringRequest,),
          doc="the label tokens' probabilities after query + item, one score per item"),
    Route("/v1/responses", ("POST",), lambda a: a.responses.create, GENERATE, generation=True, json_only=True,
          doc="the Responses API ([serve-api.md](serve-api.md))"),
    Route("/v1/responses/{response_id}", ("GET",), lambda a: a.responses.retrieve,
          doc="a stored response (`?stream=true&starting_after=N` for a background stream)"),
    Route("/v1/responses/{response_id}/cancel", ("POST",), lambda a: a.responses.cancel,
          doc="cancel a background response"),
    Route("/v1/models", ("GET",), lambda a: a.models.models, doc="one card per served name and LoRA adapter"),
    Route("/tokenize", ("POST",), lambda a: a.models.tokenize, json_only=True,
          body=(TokenizeCompletionRequest, TokenizeChatRequest), doc="a prompt or a conversation to token ids"),
    Route("/detokenize", ("POST",), lambda a: a.models.detokenize, json_only=True, body=(DetokenizeRequest,),
          doc="token ids to text"),
    Route("/v1/embeddings", ("POST",), lambda a: a.pooling.embeddings, POOLING, generation=True, doc=_POOLING_DOC),
    Route("/pooling", ("POST",), lambda a: a.pooling.pooling, POOLING, generation=True, doc=_POOLING_DOC),
    Route("/score", ("POST",), lambda a: a.pooling.score, POOLING, generation=True, doc=_POOLING_DOC),
    Route("/v1/score", ("POST",), lambda a: a.pooling.score, POOLING, generation=True, doc=_POOLING_DOC),
    Route("/rerank", ("POST",), lambda a: a.pooling.rerank, POOLING, generation=True, doc=_POOLING_DOC),
    Route("/v1/rerank", ("POST",), lambda a: a.pooling.rerank, POOLING, generation=True, doc=_POOLING_DOC),
    Route("/v2/rerank", ("POST",), lambda a: a.pooling.rerank, POOLING, generation=True, doc=_POOLING_DOC),
))
