"""kvcourse: build the memory side of an LLM serving engine, one exercise at a time.

In a notebook: `from kvcourse import check, hint, solution, progress, reset, answer`. Those helpers live in
`kvcourse.course` and load on first use, so importing a lesson module loads no grading code.
"""

from kvcourse.course import solutions_switch

solutions_switch.install()

_FEEDBACK = ("check", "hint", "progress", "solution")
__all__ = [*_FEEDBACK, "reset", "answer"]


def __getattr__(name: str):
    """Load the notebook helpers lazily (PEP 562)."""
    if name in _FEEDBACK:
        from kvcourse.course import feedback

        return getattr(feedback, name)
    if name == "reset":
        from kvcourse.course.reset import reset

        return reset
    if name == "answer":
        from kvcourse.course.questions import answer

        return answer
    raise AttributeError(f"module 'kvcourse' has no attribute {name!r}")
