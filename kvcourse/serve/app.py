"""The HTTP front end: an OpenAI-compatible completions server on the learner's own engine.

    POST /v1/completions   prompt(s) -> completion(s), sampled per request, streamed as server-sent events
    POST /v1/chat/completions  messages -> the assistant's message(s), the same way (kvcourse/serve/chat.py)
    GET  /v1/models        the one model served
    GET  /health           200 while the engine loop runs, with its counters
    GET  /metrics          Prometheus text under vLLM's metric names (kvcourse/serve/metrics.py)
    GET  /debug/blocks     the block-table snapshot (kvcourse.viz.widgets) between two steps (loopback only by default)

vLLM's `vllm serve` is the model (FastAPI on uvicorn, `data: {...}` chunks, `data: [DONE]`).
Handlers validate and wait; only the engine loop's thread touches the engine. Nothing a client sends
can stall the event loop: the body is read up to a size limit (413 beyond it, before reading more),
only application/json is accepted, and parsing, checking and tokenizing run in a worker thread with
the prompt's length bounded before the tokenizer sees it. Every refusal is OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvcourse.core.contract import blocks_needed
from kvcourse.serve.blocks import snapshot_to_json, take_snapshot
from kvcourse.serve.chat import (
    CHAT_SUPPORTED,
    ChatCompletionRequest,
    ChatReply,
    apply_template,
    as_completion,
    messages_of,
    requested_max_tokens,
)
from kvcourse.serve.detokenize import decode
from kvcourse.serve.loop import EngineLoop, RequestStream
from kvcourse.serve.metrics import ServerMetrics
from kvcourse.serve.protocol import (
    MAX_CHOICES,
    SUPPORTED,
    CompletionRequest,
    Plan,
    ServeError,
    check_parameters,
    excerpt,
    prompts_of,
)
from kvcourse.serve.reply import Reply

MAX_BODY_BYTES = 1 << 20  # 1 MiB: a full context of token ids is ~10 KB of JSON
CHARS_PER_TOKEN_BOUND = 32  # a string prompt longer than context x this cannot fit: refused before tokenizing
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
RequestModel = TypeVar("RequestModel", CompletionRequest, ChatCompletionRequest)


def create_app(
    engine: Any,
    tokenizer: Any,
    model_name: str,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    debug_endpoints: bool = True,
) -> FastAPI:
    """A FastAPI app serving `engine` (an LLMEngine); the engine loop starts and stops with the app.

    debug_endpoints: serve /debug/blocks (turn it off on a server others can reach).
    """
    engine_loop = EngineLoop(engine, ServerMetrics(model_name))

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
        # A body refused unread leaves the connection unusable: close it, so the rest is never read.
        headers = {"connection": "close"} if exc.status == 413 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(raw: Request, exc: StarletteHTTPException) -> JSONResponse:
        """404, 405... in OpenAI's error shape too."""
        message = f"{raw.method} {excerpt(raw.url.path)}: {exc.detail}."
        if exc.status_code == 404:
            message += (
                " This server answers POST /v1/completions and /v1/chat/completions, GET /v1/models, /health "
                "and /metrics."
            )
        error = ServeError(message, code=HTTP_CODES.get(exc.status_code, "http_error"), status=exc.status_code)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    async def answer(raw: Request, prepared: tuple, reply_class: type[Reply], prefix: str) -> Response:
        """Run a checked request's completions on the engine; reply whole or streamed (completions and chat alike)."""
        req, plan, prompts, echo = prepared
        children = [(tokens, params) for tokens in prompts for params in plan.params]
        stream = RequestStream(asyncio.get_running_loop(), len(children))
        eos = None if req.ignore_eos else getattr(tokenizer, "eos_token_id", None)
        requests = await submit(engine_loop, children, req.max_tokens, stream, eos)
        ids = [r.id for r in requests]
        reply = reply_class(
            f"{prefix}-{ids[0]}",
            model_name,
            prompts,
            plan.n,
            tokenizer,
            plan.stop,
            plan.logprobs,
            echo,
            req.return_token_ids,
        )

        def abort_all() -> None:
            for rid in ids:
                engine_loop.abort(rid)  # a no-op for a request that finished

        if req.stream:
            options = req.stream_options
            usage = "never" if options is None or not options.include_usage else "last"
            usage = "every" if usage == "last" and options.continuous_usage_stats else usage  # as vLLM: both asked
            events = stream_events(reply, stream, engine_loop, ids, usage)
            return AbortOnDisconnect(events, on_disconnect=abort_all)
        return JSONResponse(await collect(reply, stream, engine_loop, ids, raw, abort_all))

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        check_content_type(raw)
        body = await read_body(raw, max_body_bytes)
        prepared = await asyncio.to_thread(prepare, body, engine, tokenizer, model_name)
        return await answer(raw, prepared, Reply, "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        check_content_type(raw)
        body = await read_body(raw, max_body_bytes)
        prepared = await asyncio.to_thread(prepare_chat, body, engine, tokenizer, model_name)
        return await answer(raw, prepared, ChatReply, "chatcmpl")

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
        if not debug_endpoints:
            raise ServeError(
                "/debug/blocks is off on this server (it is bound beyond 127.0.0.1, and the block tables show "
                "other clients' requests): restart it with --enable-debug-blocks to turn it on.",
                code="forbidden",
                status=403,
            )
        state = engine_loop.state
        label = f"step {state.steps}: running {list(state.running_ids)}, {state.num_waiting} waiting"
        snap = await asyncio.wrap_future(engine_loop.call(lambda: take_snapshot(engine, label)))
        return snapshot_to_json(snap)

    return app


# ---------------------------------------------------------------------- request in
def check_content_type(raw: Request) -> None:
    """Only JSON bodies: a web page can POST text/plain to localhost without asking, but not application/json."""
    media_type = raw.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise ServeError(
            f"the request's Content-Type is {excerpt(media_type or 'missing')}; send the JSON body with "
            "'Content-Type: application/json' (curl: -H 'Content-Type: application/json').",
            code="invalid_content_type",
        )


async def read_body(raw: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to be longer than `limit` (by its header, or while reading)."""
    too_large = ServeError(
        f"the request body is larger than this server's limit of {limit} bytes: send a shorter prompt "
        "(a whole context of token ids is only a few kilobytes).",
        code="request_too_large",
        status=413,
    )
    declared = raw.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in raw.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def prepare(
    body: bytes, engine: Any, tokenizer: Any, model_name: str
) -> tuple[CompletionRequest, Plan, list[list[int]], list[str] | None]:
    """In a worker thread: the checked request, its plan, each prompt's token ids, and the echo texts (if asked)."""
    return checked(parse_request(body, CompletionRequest, SUPPORTED), engine, tokenizer, model_name)


def prepare_chat(
    body: bytes, engine: Any, tokenizer: Any, model_name: str
) -> tuple[CompletionRequest, Plan, list[list[int]], None]:
    """In a worker thread: a chat request as the completion request it amounts to, checked, with its prompt's ids."""
    chat = parse_request(body, ChatCompletionRequest, CHAT_SUPPORTED)
    check_model(chat.model, model_name)
    context = int(engine.max_positions)
    prompt = apply_template(tokenizer, messages_of(chat.messages, context * CHARS_PER_TOKEN_BOUND))
    max_tokens = requested_max_tokens(chat)
    if max_tokens is None:
        max_tokens = max(1, room_for(len(prompt), engine))
    return checked(as_completion(chat, prompt, max_tokens), engine, tokenizer, model_name)


def room_for(num_prompt: int, engine: Any) -> int:
    """How many tokens a prompt leaves room for, in the context and in the whole KV cache (vLLM's default max_tokens)."""
    manager = engine.kv_cache_manager
    return min(int(engine.max_positions), manager.num_blocks * manager.block_size) - num_prompt


def check_model(asked: str | None, model_name: str) -> None:
    """The request may name the served model, or none."""
    if asked is not None and asked != model_name:
        raise ServeError(
            f"model {excerpt(asked)} is not served here; this server serves {model_name!r} (see GET /v1/models).",
            "model",
            "model_not_found",
        )


def checked(
    req: CompletionRequest, engine: Any, tokenizer: Any, model_name: str
) -> tuple[CompletionRequest, Plan, list[list[int]], list[str] | None]:
    """The request's plan, each prompt's token ids and the echo texts, once every check has passed."""
    check_model(req.model, model_name)
    plan = check_parameters(req)
    context = int(engine.max_positions)
    prompts = prompts_of(req.prompt, context * CHARS_PER_TOKEN_BOUND, context)
    if len(prompts) * plan.n > MAX_CHOICES:
        raise ServeError(
            f"{len(prompts)} prompts x n={plan.n} is {len(prompts) * plan.n} completions; ask for at most "
            f"{MAX_CHOICES} in one request.",
            "n",
        )
    token_lists = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    vocab = int(engine.model.config.vocab_size)
    for tokens in token_lists:
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise ServeError(f"prompt has token ids outside the vocabulary [0, {vocab}): {excerpt(bad[:5])}.", "prompt")
        check_fits(len(tokens), req.max_tokens, engine)
    echo = None
    if req.echo:
        echo = [p if isinstance(p, str) else decode(tokenizer, t) for p, t in zip(prompts, token_lists)]
    return req, plan, token_lists, echo


def parse_completion_request(body: bytes) -> CompletionRequest:
    """The JSON body as a CompletionRequest, or a 400 that names the field and the fix (quoting little of it)."""
    return parse_request(body, CompletionRequest, SUPPORTED)


def parse_request(body: bytes, model: type[RequestModel], supported: str) -> RequestModel:
    """The JSON body as `model` (a completion or chat request), or a 400 that names the field and the fix."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise ServeError("the request body nests JSON too deeply: a request is a shallow object.") from None
    except ValueError as exc:
        reason = str(exc).splitlines()[0][:120]
        raise ServeError(f"the request body is not valid JSON ({reason}).", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ServeError('the request body must be a JSON object, e.g. {"prompt": "Hello", "max_tokens": 8}.')
    try:
        return model.model_validate(data)
    except RecursionError:
        raise ServeError("the request nests JSON too deeply: a request is a shallow object.") from None
    except ValidationError as exc:
        error = exc.errors()[0]
        field = excerpt(".".join(str(part) for part in error["loc"][:2])).strip("'") or None
        if error["type"] == "extra_forbidden":
            raise ServeError(
                f"{field} is not a parameter this server knows. {supported}", field, "unknown_parameter"
            ) from None
        if error["type"] == "missing":
            raise ServeError(f"{field} is required.", field, "missing_parameter") from None
        raise ServeError(f"{field}: {error['msg']} (got {excerpt(error.get('input'))}).", field) from None


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
    engine_loop: EngineLoop, children: list, max_tokens: int, stream: RequestStream, eos: int | None
) -> list[Any]:
    """Hand the completions to the engine thread together; its ValueError (the engine's own checks) becomes a 400."""
    try:
        return await asyncio.wrap_future(engine_loop.add_group(children, max_tokens, stream, eos))
    except ValueError as exc:
        raise ServeError(str(exc)) from None
    except RuntimeError as exc:
        raise ServeError(str(exc), code="unavailable", status=503) from None


# ---------------------------------------------------------------------- replies out
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
            self.on_disconnect()  # a no-op for requests that finished


def sse(data: Any) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


async def stream_events(
    reply: Reply, stream: RequestStream, engine_loop: EngineLoop, ids: list[int], usage: str = "never"
) -> AsyncIterator[str]:
    """Chunks as tokens are sampled (each names its choice's index), then [DONE]; a client that leaves aborts.

    usage: "never", "last" (a final chunk with the counts: include_usage) or "every" (also in each chunk).
    """
    started: set[int] = set()
    try:
        while not stream.finished:
            output = await stream.get()
            if output.error is not None:
                yield sse(ServeError(output.error, code="engine_error", status=500).body())
                break
            choice = reply.choices[output.index]
            if choice.done:
                continue  # a choice a stop string ended: the engine's last word for it changes nothing
            update = choice.add(output)
            if update.done and choice.finish_reason == "stop" and not output.finished:
                engine_loop.finish(ids[output.index], "stop")  # a stop string: the request ends here
            if update.text or update.token_ids or update.done or output.index not in started:
                chunk = reply.chunk(choice, update, first=output.index not in started)
                yield sse({**chunk, "usage": reply.usage} if usage == "every" else chunk)
                started.add(output.index)
        else:
            if usage != "never":
                yield sse(reply.usage_chunk())
            yield sse("[DONE]")
    finally:
        if not stream.finished:
            for rid in ids:
                engine_loop.abort(rid)  # the client disconnected (this generator was cancelled), or an error


async def collect(
    reply: Reply,
    stream: RequestStream,
    engine_loop: EngineLoop,
    ids: list[int],
    raw: Request,
    abort_all: Callable[[], None],
) -> dict:
    """Wait for every choice; abort them all the moment the client disconnects meanwhile."""
    watcher = asyncio.create_task(until_disconnected(raw.receive, abort_all))
    try:
        while not stream.finished:
            output = await stream.get()
            if output.error is not None:
                raise ServeError(output.error, code="engine_error", status=500)
            choice = reply.choices[output.index]
            if choice.done:
                continue
            update = choice.add(output)
            if update.done and choice.finish_reason == "stop" and not output.finished:
                engine_loop.finish(ids[output.index], "stop")
        return reply.whole()
    finally:
        watcher.cancel()
        if not stream.finished:
            abort_all()


async def until_disconnected(receive: Any, on_disconnect: Callable[[], None]) -> None:
    """Read the connection's ASGI messages (the body is already in) until the client goes away."""
    while (await receive())["type"] != "http.disconnect":
        pass
    on_disconnect()
