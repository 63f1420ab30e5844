"""Build an engine and run the app with uvicorn: in the foreground (the CLI) or in a thread (tests, notebooks).

with ServerThread(build_app(model="tiny", num_blocks=64)) as server:   # a free 127.0.0.1 port (default: smollm2)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI

from kvcourse.models.registry import DEFAULT_MODEL
from kvcourse.serve.app import MAX_BODY_BYTES, create_app

LOOPBACK = "127.0.0.1"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
log = logging.getLogger("kvcourse.serve")


def exposure_warning(host: str) -> str | None:
    """What to tell someone who binds the server beyond this machine (None on loopback)."""
    if host in LOOPBACK_HOSTS or host.startswith("127."):
        return None
    return (
        f"kvcourse.serve: listening on {host}, beyond this machine: anyone who can reach the port can use the "
        "model (there is no authentication) and, with debug endpoints on, read every request's block table."
    )


def build_app(
    model: str | Any = DEFAULT_MODEL,
    *,
    num_blocks: int = 256,
    block_size: int = 16,
    token_budget: int = 512,
    max_batch_size: int = 16,
    enable_prefix_caching: bool = True,
    attention: str | None = None,
    tokenizer: Any = None,
    model_name: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    debug_endpoints: bool = True,
) -> FastAPI:
    """An app serving a model (a name of kvcourse.models.registry: "smollm2", "gpt2"..., "tiny"; or a loaded
    model, with its tokenizer, GPT-2's by default) through a fresh LLMEngine.

    enable_prefix_caching: on by default, as in vLLM v1: the n completions of one prompt share its blocks.
    attention: the engine's backend (None: the engine's default; "reference" runs your exercises 5.2-5.3).
    max_body_bytes: larger request bodies get a 413. debug_endpoints: serve /debug/blocks.
    """
    from kvcourse.engine.llm_engine import LLMEngine
    from kvcourse.models.registry import gpt2_tokenizer, load_model

    name = model_name or (model if isinstance(model, str) else "gpt2")
    if isinstance(model, str):
        model, own_tokenizer = load_model(model, verbose=True)
        tokenizer = tokenizer or own_tokenizer
    tokenizer = tokenizer or gpt2_tokenizer()
    options = {} if attention is None else {"attention": attention}
    engine = LLMEngine(
        model,
        num_blocks=num_blocks,
        block_size=block_size,
        token_budget=token_budget,
        max_batch_size=max_batch_size,
        enable_prefix_caching=enable_prefix_caching,
        tokenizer=tokenizer,
        **options,
    )
    return create_app(engine, tokenizer, name, max_body_bytes=max_body_bytes, debug_endpoints=debug_endpoints)


class ServerThread:
    """uvicorn serving an app from a background thread, on a port the OS picked; stop() ends it."""

    def __init__(self, app: FastAPI, host: str = LOOPBACK, port: int = 0) -> None:
        self.app = app
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))  # bound now, so the port is ours before uvicorn starts
        self.host, self.port = self._socket.getsockname()[:2]
        if (warning := exposure_warning(host)) is not None:
            log.warning(warning)
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="kvcourse-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        """http://host:port (append /v1 for OpenAI clients)."""
        return f"http://{self.host}:{self.port}"

    @property
    def engine_loop(self) -> Any:
        """The app's engine loop (its engine, state and metrics), for in-process inspection."""
        return self.app.state.engine_loop

    def _serve(self) -> None:
        self._server.run(sockets=[self._socket])

    def start(self, timeout: float = 30.0) -> ServerThread:
        """Start serving; returns once uvicorn accepts connections (or raises after `timeout` seconds)."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start within {timeout} s on {self.url}; see the log above.")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        """Ask uvicorn to exit (open streams end, the engine loop stops) and wait for the thread."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
