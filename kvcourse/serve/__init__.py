"""Serve it: an OpenAI-compatible streaming server (FastAPI on uvicorn) on the learner's engine.

python -m kvcourse.serve --model tiny          # or ./course serve
from kvcourse.serve import ServerThread, build_app
"""

from kvcourse.serve.app import create_app
from kvcourse.serve.server import ServerThread, build_app

__all__ = ["ServerThread", "build_app", "create_app"]
