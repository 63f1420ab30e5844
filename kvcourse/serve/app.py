"""The HTTP front end: an OpenAI-compatible completions server on the learner's own engine.

    POST /v1/completions   prompt (text or token ids) -> greedy completion, streamed as server-sent events
    GET  /v1/models        the one model served
    GET  /health           200 while the engine loop runs, with its counters
    GET  /metrics          Prometheus text: running, waiting, KV usage, preemptions, prefix hits, TTFT, TPOT
    GET  /debug/blocks     the block-table snapshot (kvcourse.viz.widgets) between two steps

vLLM's `vllm serve` is the model (FastAPI on uvicorn, `data: {...}` chunks, `data: [DONE]`).
Handlers validate, tokenize and wait; only the engine loop's thread touches the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from kvcourse.kv_cache_interface import blocks_needed
from kvcourse.serve.blocks import snapshot_to_json, take_snapshot
from kvcourse.serve.detokenize import IncrementalDetokenizer
from kvcourse.serve.loop import EngineLoop, RequestOutput, RequestStream
from kvcourse.serve.metrics import ServerMetrics
from kvcourse.serve.protocol import (
    SUPPORTED,
    CompletionRequest,
    ServeError,
    check_sampling,
    completion_body,
    one_prompt,
    usage_body,
)


def create_app(engine: Any, tokenizer: Any, model_name: str) -> FastAPI:
    """A FastAPI app serving `engine` (an LLMEngine); the engine loop starts and stops with the app."""
    engine_loop = EngineLoop(engine, ServerMetrics())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_loop.start()
        yield
        engine_loop.stop()

    app = FastAPI(title="kvcourse serve", lifespan=lifespan)
    app.state.engine_loop = engine_loop
    created = int(time.time())

    @app.exception_handler(ServeError)
    async def serve_error(_: Request, exc: ServeError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        req = parse_completion_request(await raw.body())
        prompt_tokens = check_request(req, engine, tokenizer, model_name)
        stream = RequestStream(asyncio.get_running_loop())
        eos = None if req.ignore_eos else getattr(tokenizer, "eos_token_id", None)
        request = await submit(engine_loop, prompt_tokens, req.max_tokens, stream, eos)
        reply = Reply(req, model_name, f"cmpl-{request.id}", prompt_tokens, tokenizer)
        if req.stream:
            events = stream_events(reply, stream, engine_loop, request.id)
            return AbortOnDisconnect(events, on_disconnect=lambda: engine_loop.abort(request.id))
        return JSONResponse(await collect(reply, stream, engine_loop, request.id, raw))

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "kvcourse"}
        return {"object": "list", "data": [{**card, "max_model_len": int(engine.max_positions)}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        state = dataclasses.asdict(engine_loop.state)
        alive = engine_loop.alive
        return JSONResponse({"status": "ok" if alive else "engine loop stopped", **state}, 200 if alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine_loop.metrics.render(), media_type=engine_loop.metrics.content_type)

    @app.get("/debug/blocks")
    async def debug_blocks() -> dict:
        state = engine_loop.state
        label = f"step {state.steps}: running {list(state.running_ids)}, {state.num_waiting} waiting"
        snap = await asyncio.wrap_future(engine_loop.call(lambda: take_snapshot(engine, label)))
        return snapshot_to_json(snap)

    return app


# ---------------------------------------------------------------------- request in
def parse_completion_request(body: bytes) -> CompletionRequest:
    """The JSON body as a CompletionRequest, or a 400 that names the field and the fix."""
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise ServeError(f"the request body is not valid JSON ({exc}).", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ServeError('the request body must be a JSON object, e.g. {"prompt": "Hello", "max_tokens": 8}.')
    try:
        return CompletionRequest.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"]) or None
        if error["type"] == "extra_forbidden":
            raise ServeError(
                f"{field} is not a parameter this server knows. {SUPPORTED}", field, "unknown_parameter"
            ) from None
        if error["type"] == "missing":
            raise ServeError(f"{field} is required.", field, "missing_parameter") from None
        raise ServeError(f"{field}: {error['msg']} (got {error.get('input')!r}).", field) from None


def check_request(req: CompletionRequest, engine: Any, tokenizer: Any, model_name: str) -> list[int]:
    """Refuse what can never be served (saying what to change); return the prompt's token ids."""
    if req.model is not None and req.model != model_name:
        raise ServeError(
            f"model {req.model!r} is not served here; this server serves {model_name!r} (see GET /v1/models).",
            "model",
            "model_not_found",
        )
    check_sampling(req)
    if req.max_tokens < 1:
        raise ServeError(f"max_tokens is {req.max_tokens}; ask for 1 token or more.", "max_tokens")
    prompt = one_prompt(req)
    tokens = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    vocab = int(engine.model.config.vocab_size)
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise ServeError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}.", "prompt")
    check_fits(len(tokens), req.max_tokens, engine)
    return tokens


def check_fits(num_prompt: int, max_tokens: int, engine: Any) -> None:
    """The context window and the whole KV cache must hold the request at its longest."""
    total, context = num_prompt + max_tokens, int(engine.max_positions)
    if total > context:
        raise ServeError(
            f"this model's context holds {context} tokens, but the request needs {total} ({num_prompt} in the "
            f"prompt, {max_tokens} to generate): shorten the prompt or lower max_tokens.",
            "prompt" if num_prompt >= context else "max_tokens",
            "context_length_exceeded",
        )
    manager = engine.kv_cache_manager
    need = blocks_needed(total, manager.block_size)
    if need > manager.num_blocks:
        raise ServeError(
            f"the request needs {need} KV-cache blocks of {manager.block_size} tokens at its longest, but the whole "
            f"cache has {manager.num_blocks}: lower max_tokens, shorten the prompt, or restart the server with "
            f"--num-blocks {need} or more.",
            "max_tokens",
            "exceeds_kv_cache",
        )


async def submit(
    engine_loop: EngineLoop, tokens: list[int], max_tokens: int, stream: RequestStream, eos: int | None
) -> Any:
    """Hand the request to the engine thread; its ValueError (the engine's own checks) becomes a 400."""
    try:
        return await asyncio.wrap_future(engine_loop.add(tokens, max_tokens, stream, eos))
    except ValueError as exc:
        raise ServeError(str(exc)) from None
    except RuntimeError as exc:
        raise ServeError(str(exc), code="unavailable", status=503) from None


# ---------------------------------------------------------------------- replies out
class Reply:
    """Builds the response objects of one request, turning token ids into text as they come."""

    def __init__(
        self, req: CompletionRequest, model: str, request_id: str, prompt_tokens: list[int], tokenizer: Any
    ) -> None:
        self.req, self.model, self.id, self.prompt_tokens = req, model, request_id, prompt_tokens
        self.detokenizer = IncrementalDetokenizer(tokenizer)

    @property
    def usage(self) -> dict[str, int]:
        return usage_body(len(self.prompt_tokens), len(self.detokenizer.token_ids))

    def chunk(self, output: RequestOutput, first: bool) -> dict[str, Any]:
        """One streamed `text_completion` chunk for one update."""
        text = self.detokenizer.add(output.new_token_ids, final=output.finished)
        ids = self.req.return_token_ids
        return completion_body(
            self.id,
            self.model,
            text,
            output.finish_reason if output.finished else None,
            token_ids=output.new_token_ids if ids else None,
            prompt_token_ids=self.prompt_tokens if ids and first else None,
        )

    def whole(self, finish_reason: str | None) -> dict[str, Any]:
        """The non-streaming answer, once every token is in."""
        ids = self.req.return_token_ids
        return completion_body(
            self.id,
            self.model,
            self.detokenizer.text,
            finish_reason,
            token_ids=list(self.detokenizer.token_ids) if ids else None,
            prompt_token_ids=self.prompt_tokens if ids else None,
            usage=self.usage,
        )


class AbortOnDisconnect(StreamingResponse):
    """A server-sent-event stream that aborts its request the moment the client goes away.

    Waiting for the next send to fail is not enough: a request still queued sends nothing. So a
    watcher reads the connection's ASGI messages and calls `on_disconnect` at `http.disconnect`.
    """

    def __init__(self, content: AsyncIterator[str], on_disconnect: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        watcher = asyncio.create_task(until_disconnected(receive, self.on_disconnect))
        try:
            await super().__call__(scope, receive, send)
        finally:
            watcher.cancel()
            self.on_disconnect()  # a no-op for a request that finished


def sse(data: Any) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


async def stream_events(reply: Reply, stream: RequestStream, engine_loop: EngineLoop, rid: int) -> AsyncIterator[str]:
    """Chunks as tokens are sampled, then [DONE]; a client that goes away aborts its request."""
    try:
        first = True
        while True:
            output = await stream.get()
            if output.error is not None:
                yield sse(ServeError(output.error, code="engine_error", status=500).body())
                break
            yield sse(reply.chunk(output, first))
            first = False
            if output.finished:
                break
        options = reply.req.stream_options
        if options is not None and options.include_usage:
            yield sse({**completion_body(reply.id, reply.model, "", None), "choices": [], "usage": reply.usage})
        yield sse("[DONE]")
    finally:
        if not stream.finished:
            engine_loop.abort(rid)  # the client disconnected (this generator was cancelled)


async def collect(reply: Reply, stream: RequestStream, engine_loop: EngineLoop, rid: int, raw: Request) -> dict:
    """Wait for the whole completion; abort it the moment the client disconnects meanwhile."""
    watcher = asyncio.create_task(until_disconnected(raw.receive, lambda: engine_loop.abort(rid)))
    try:
        while True:
            output = await stream.get()
            if output.error is not None:
                raise ServeError(output.error, code="engine_error", status=500)
            reply.detokenizer.add(output.new_token_ids, final=output.finished)
            if output.finished:
                return reply.whole(output.finish_reason)
    finally:
        watcher.cancel()


async def until_disconnected(receive: Any, on_disconnect: Callable[[], None]) -> None:
    """Read the connection's ASGI messages (the body is already in) until the client goes away."""
    while (await receive())["type"] != "http.disconnect":
        pass
    on_disconnect()
