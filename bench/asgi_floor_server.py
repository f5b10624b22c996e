#!/usr/bin/env python3
"""uvicorn's own floor: a streaming ASGI app that does nothing but send pre-built chunks.

Served as `serve` serves (uvicorn, httptools, uvloop), each POST gets `max_tokens` chat chunks at
once, then `[DONE]`; no engine, validation, template or metrics. Next to the null server (no HTTP
framework at all) and `serve`, it splits a request's cost into the kernel's, uvicorn's and ours.

usage: python bench/asgi_floor_server.py --port 18400
"""

from __future__ import annotations

import argparse
import json

import uvicorn

CHUNK = (b'data: {"id":"chatcmpl-floor","object":"chat.completion.chunk","created":0,"model":"tiny",'
         b'"choices":[{"index":0,"delta":{"content":" tok"},"logprobs":null,"finish_reason":null,'
         b'"token_ids":null}],"usage":{"prompt_tokens":128,"total_tokens":%d,"completion_tokens":%d}}\n\n')
MODELS = b'{"object":"list","data":[{"id":"tiny","object":"model"}]}'


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    if scope["method"] == "GET":  # /v1/models: the harness's readiness probe
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": MODELS})
        return
    body = b""
    more = True
    while more:
        msg = await receive()
        body += msg.get("body", b"")
        more = msg.get("more_body", False)
    n = int(json.loads(body).get("max_tokens") or 16)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for i in range(1, n + 1):
        await send({"type": "http.response.body", "body": CHUNK % (128 + i, i), "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=18400)
    a = ap.parse_args()
    uvicorn.run(app, host=a.host, port=a.port, loop="uvloop", http="httptools", log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
