"""kvcourse: build the memory side of an LLM serving engine, one exercise at a time.

In a notebook: `from kvcourse import check, hint, solution, progress`.
"""

from kvcourse import _solutions

_solutions.install()

from kvcourse.feedback import check, hint, progress, solution  # noqa: E402

__all__ = ["check", "hint", "progress", "solution"]
