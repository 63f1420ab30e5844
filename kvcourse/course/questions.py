"""Prediction questions: the learner commits to a guess before the cell that reveals it, `answer("2.a", 3)`.

The expected value is stored only as a SHA-256 digest of the question id and the normalized answer, so
neither the notebook nor this file shows it. A learner's answers are kept in `.kvcourse_answers.json` at
the repository root, and `question_results()` turns them into scoreboard rows beside the exercises.

To add a question: write its row below with the digest printed by
`python -m kvcourse.course.questions digest 2.a 3`, and ask it in notebook 02 with `answer("2.a", None)`
BEFORE the cell that reveals the answer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ANSWERS_FILE = ROOT / ".kvcourse_answers.json"


@dataclass(frozen=True)
class Question:
    """One prediction: `kind` is "int", "float" (compared after rounding to `decimals`) or "choice"."""

    id: str
    notebook: str
    prompt: str
    kind: str
    digest: str
    choices: tuple[str, ...] = ()
    decimals: int = 0
    unit: str = ""  # what the number counts, when a learner may write it with a unit ("bytes": "72 KiB")

    @property
    def title(self) -> str:
        """The scoreboard's title column: the question, shortened."""
        return self.prompt if len(self.prompt) <= 40 else self.prompt[:39] + "…"


def _choice(text: str, choices: tuple[str, ...]) -> str | None:
    """The option meant, written as the notebook prints it ("b", "(b)", "b)", "(b) only the stack's"), or None."""
    text = re.sub(r"^(?:option|answer|choice)\s*:?\s*", "", text.strip().lower())
    bare = text.strip("()[]{}.,:;!'\" ")
    for spelling in (bare, re.sub(r"[- ]+", "_", bare)):  # "skip-ahead" and "skip ahead" mean skip_ahead
        if spelling in choices:
            return spelling
    lead = re.match(r"[(\[]?\s*([a-z_]+)\s*[)\].:]\s", text + " ")
    return lead[1] if lead and lead[1] in choices else None


# Units a learner may write after a number, where the question counts in them ("72 KiB" is 73,728 bytes).
BYTE_UNITS = {"b": 1, "byte": 1, "bytes": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
BYTE_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
NUMBER = re.compile(r"(?:r|request|#)?\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*([a-z%]*)")


def _number(question: Question, value: object) -> float:
    """The number meant, written as the notebook prints it: 73728, "73,728", "73 728", "72 KiB", "R3"."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"Question {question.id} takes a number; got {value!r}.")
    if not isinstance(value, str):
        return float(value)
    text = value.strip().lower().replace(",", "").replace("_", "").replace("\u202f", "")
    text = re.sub(r"(?<=\d) (?=\d{3}\b)", "", text)  # a thin-space or space thousands separator
    match = NUMBER.fullmatch(text)
    if match is None:
        raise ValueError(f"Question {question.id} takes a number, such as 73728 or 73,728; got {value!r}.")
    number, unit = float(match[1]), match[2]
    if not unit:
        return number
    if question.unit == "bytes" and unit in BYTE_UNITS:
        return number * BYTE_UNITS[unit]
    if unit == question.unit or unit == question.unit.rstrip("s"):
        return number
    wanted = f"in {question.unit}" if question.unit else "without a unit"
    raise ValueError(f"Question {question.id} takes a number {wanted}; got {value!r}.")


def normalize(question: Question, value: object) -> str:
    """One spelling per answer, so that 3, 3.0 and "3" are the same guess; a ValueError says what to give."""
    if question.kind == "choice":
        text = _choice(str(value), question.choices)
        if text is None:
            raise ValueError(f"Question {question.id} takes one of {', '.join(question.choices)}; got {value!r}.")
        return text
    number = _number(question, value)
    if question.kind == "int":
        if number != int(number):
            raise ValueError(f"Question {question.id} takes a whole number; got {value!r}.")
        return str(int(number))
    return f"{round(number, question.decimals):.{question.decimals}f}"


def digest(question: Question, value: object) -> str:
    """The stored fingerprint of an answer: it depends on the question id too, so equal answers differ."""
    return hashlib.sha256(f"kvcourse|{question.id}|{normalize(question, value)}".encode()).hexdigest()


# One block per question; the letters run per notebook (2.a, 2.b, ...). Keep the expected values out of here.
_QUESTIONS = [
    Question(
        id="1.a",
        notebook="01",
        prompt="Do the chunked, interleaved outputs equal generating each request alone",
        kind="choice",
        choices=("yes", "no"),
        digest="65515f77d1c6d74bc7cfabc1dd8b9083882694acb986f636de22e17f86b9cb43",
    ),
    Question(
        id="1.b",
        notebook="01",
        prompt="At its peak, the blind plan needs (a) less than the 768 tokens, (b) up to 10% more, "
        "(c) 10 to 50% more, (d) over 50% more",
        kind="choice",
        choices=("a", "b", "c", "d"),
        digest="b12c552e1161d605306257640b862723983d02244196d58f35645aee1bfffb66",
    ),
    Question(
        id="2.a",
        notebook="02",
        prompt="Blocks the lesson's mock holds after 20 decodes of a 15-token prompt (blocks of 16)",
        kind="int",
        digest="f6b6162bc0ed53013277f60bf2bd68c6b514b4de78eece6b305209a6de0ed8be",
    ),
    Question(
        id="2.b",
        notebook="02",
        prompt="With skip-ahead, the 40-token request finishes (a) within 20 steps, (b) within 100, "
        "(c) only after the small requests stop arriving",
        kind="choice",
        choices=("a", "b", "c"),
        digest="d3ce793df53854c75d715fbd46d8b3dee56e2a0c8ffe174137a13c5f937baddb",
    ),
    Question(
        id="2.c",
        notebook="02",
        prompt="Which request (0 to 3) is preempted first in the tight run",
        kind="int",
        digest="04516ff9e0fe0aa5043b67522a66fcd5651c7bbab250471eed302a1734c24e8d",
    ),
    Question(
        id="0.a",
        notebook="00",
        prompt="Bytes of KV cache per token for GPT-2 small in fp32",
        kind="int",
        unit="bytes",
        digest="bfb32766e39d7377c9a43f54ed607e6f72ddbfcdffb46277da088652992f1dde",
    ),
    Question(
        id="0.b",
        notebook="00",
        prompt="1,024-token GPT-2 XL sequences (fp16, full length reserved) that fit in 40 GiB",
        kind="int",
        digest="5dbd85efdbf9020a9fefb7c776977d645ae1d238d6d7f12273697f1187d3a617",
    ),
    Question(
        id="0.c",
        notebook="00",
        prompt="How many times less KV cache per token SmolLM2 (9 query heads, 3 KV heads) needs than full "
        "multi-head attention would",
        kind="int",
        digest="5eb5ebc26dc2012e8be655e5cae8502b651fad6149ecfe8375b5041ac3c4a7be",
    ),
    Question(
        id="3.a",
        notebook="03",
        prompt="Of 6 decode steps after 10 computed tokens (blocks of 4), how many take a new block",
        kind="int",
        digest="6773f9af04cb80ae8a56b85c21175660cc85958e598b1690eab71642a1dcee1f",
    ),
    Question(
        id="3.b",
        notebook="03",
        prompt="As the pool grows, whose cost of a prefix hit on a free block grows: (a) both, (b) only the stack's, (c) only the linked list's, (d) neither",
        kind="choice",
        choices=("a", "b", "c", "d"),
        digest="5910c7346dbd63e029364d0a174087ad9983ef1a71c60aa6610df32dc2ebed69",
    ),
    Question(
        id="4.a",
        notebook="04",
        prompt="Cached tokens found for a probe with exactly A's 18 tokens (blocks of 4)",
        kind="int",
        digest="659842d5bcfc5e15d5a249ac875113b3a85afcb58999ffba9d10a717e82d9778",
    ),
    Question(
        id="4.b",
        notebook="04",
        prompt="Hit rate with caching on, shared system prompt: (a) under 25%, (b) 25 to 50%, (c) 50 to 75%, (d) over 75%",
        kind="choice",
        choices=("a", "b", "c", "d"),
        digest="33af1159a89d148c31db7082453bb5e97b5c6ff166a13b29b43b4db6db10ff21",
    ),
    Question(
        id="4.c",
        notebook="04",
        prompt="Fork saving at 128 tokens per sample vs the paper's ShareGPT range: (a) below, (b) within, (c) above",
        kind="choice",
        choices=("a", "b", "c"),
        digest="b8da1652ffc60823ce6f9be50c3000f741369fc950a82c23aa2160754be77518",
    ),
    Question(
        id="4.d",
        notebook="04",
        prompt="Prefix hit rate on the chat trace with one 80 GB GPU's KV cache (8B model): (a) under 10%, (b) 10 to 25%, (c) 25 to 40%, (d) over 40%",
        kind="choice",
        choices=("a", "b", "c", "d"),
        digest="41e0a4446ec60a16d7bf2ac311f6f4724f387bfdcda4ca76e422e2b1eff6ec10",
    ),
    Question(
        id="4.e",
        notebook="04",
        prompt="Best eviction policy on the chat trace at 1 million tokens of cache: (a) LRU, (b) FIFO, (c) LFU",
        kind="choice",
        choices=("a", "b", "c"),
        digest="1b544f1019d39090167efd9b030142bf75937356e56f29ba7f564e8ab9331e38",
    ),
    Question(
        id="5.a",
        notebook="05",
        prompt="Slot of B's token at position 6 (table [0, 5, 10], blocks of 4)",
        kind="int",
        digest="e878db3033d5a2a60bff20ed4dd8572edec5c93055359f885ce5b805b53b94c5",
    ),
    Question(
        id="5.b",
        notebook="05",
        prompt="Keys that query 2 of a 4-token chunk after a 6-token cached prefix may see",
        kind="int",
        digest="5f647de929ffe71d90992ddbbca1e2509d7703e819c319be6d1bb2f8687a00c6",
    ),
    Question(
        id="6.a",
        notebook="06",
        prompt="Share of the pool holding token states when every request reserves the maximum length: "
        "(a) under 40%, (b) 40 to 70%, (c) 70 to 90%, (d) over 90%",
        kind="choice",
        choices=("a", "b", "c", "d"),
        digest="833ca363cb82c0fc909e87bb2e1845a74fb60404a070b54b0578f3bbc0d9e923",
    ),
    Question(
        id="6.b",
        notebook="06",
        prompt="Which block size (1, 8, 16, 32, 64 or 128) leaves the largest share of the pool holding token states",
        kind="int",
        digest="7f5d5d29a733ab5c7a0ad244c7faaf7e520322bd7068eb0b9749cc2081c66adf",
    ),
    Question(
        id="6.c",
        notebook="06",
        prompt="How many times more requests paged-16 runs side by side than max: (a) under 1.5, (b) 1.5 to 3, "
        "(c) 3 to 5, (d) over 5",
        kind="choice",
        choices=("a", "b", "c", "d"),
        digest="9c27410fca44ab9e9d582d4beb9c055a191d26ef5009f79724c0fd516e260de0",
    ),
    Question(
        id="8.a",
        notebook="08",
        prompt="Of the sixteen clients' completions, how many equal Hugging Face greedy for their prompt alone",
        kind="int",
        digest="14f7cee8c73bf4dac1be5813341b3b230fa338c69df0681fc580e2f74a2cf661",
    ),
    Question(
        id="8.b",
        notebook="08",
        prompt="Free blocks, of the 12, once all sixteen clients have finished",
        kind="int",
        digest="ae614f97b393bf6e6762c60e08bf61c0f2902de9e5048e5edcf692d6e7a095e2",
    ),
    Question(
        id="8.c",
        notebook="08",
        prompt="Requests that /metrics counts as finished by length after sections 2 and 3",
        kind="int",
        digest="e45f1a22b72f24180ca384aa04fb281bd00abc46b637a78824d9b326cf224b33",
    ),
    Question(
        id="8.d",
        notebook="08",
        prompt="A 200-token prompt with max_tokens 8 is (a) served, (b) refused: longer than the 256-token context, "
        "(c) refused: more blocks than the whole cache holds",
        kind="choice",
        choices=("a", "b", "c"),
        digest="123ba9f8667f2f75cc79c89cba9b4690eb204705be22ecc8a888208caad61eed",
    ),
    Question(
        id="8.e",
        notebook="08",
        prompt="Prompt tokens the prefix cache counts as hits for one n=4 request with a 40-token prompt "
        "(blocks of 16)",
        kind="int",
        digest="e464358d9e7961359c4441c560b21c1baaaf0cd65cd02636c18800ea8dfcccc9",
    ),
    Question(
        id="8.f",
        notebook="08",
        prompt="Physical blocks holding the 40 prompt tokens across the four children: (a) 3, as a fork "
        "(copy-on-write) would, (b) 6, (c) 12",
        kind="choice",
        choices=("a", "b", "c"),
        digest="671eb0e6b5c5ad1605af84ee66d13b76710928b020ce269a532bbc0cdf5c92e0",
    ),
    Question(
        id="7.a",
        notebook="07",
        prompt="As the token budget grows from 32 to 512, the p99 inter-token latency (a) falls, "
        "(b) stays about the same, (c) grows",
        kind="choice",
        choices=("a", "b", "c"),
        digest="27db499e684181c6b8617fb0f6bfa6edda328950e8c52139e7f5f5e2f77064f9",
    ),
    Question(
        id="7.b",
        notebook="07",
        prompt="Which admission gives the long prompts the lower p99 TTFT: fcfs or skip_ahead",
        kind="choice",
        choices=("fcfs", "skip_ahead"),
        digest="f43d0ebeeb8126c0b0ef6b30eefda1fd7693623f2a42adc94adbe3c88aaa281e",
    ),
    Question(
        id="7.c",
        notebook="07",
        prompt="GPT-2 small on an H200 over PCIe 5.0: is swapping ever cheaper than recomputing within 1,024 tokens",
        kind="choice",
        choices=("yes", "no"),
        digest="a9e5dc2c0e994836c2f6479473581d6145455a35668c3ef2241ce4326c2c720b",
    ),
    Question(
        id="7.d",
        notebook="07",
        prompt="Chat trace, one GPU's prefix cache serving about 8% of the prompt tokens: median TTFT falls by (a) under 10%, (b) 10 to 30%, (c) 30 to 60%, (d) over 60%",
        kind="choice",
        choices=("a", "b", "c", "d"),
        digest="ac41a2b4bb341b5a2625c502c7a6c2ef167fb84a4c240f2c2d2a36b8498cbbe0",
    ),
    Question(
        id="9.a",
        notebook="09",
        prompt="Budget 16, running A (decode), P (30 tokens to go), B and C (decodes): how many of the "
        "three decodes does vLLM's order schedule",
        kind="int",
        digest="0a92ccf91b15356d361b7c6e8b6fe3df34faa3ab13cd1d2fe9601c62d0d91e53",
    ),
    Question(
        id="9.b",
        notebook="09",
        prompt="Budget 32, prompts P1 and P2 prefilling (20 tokens each): how many tokens does the course's "
        "order give P2",
        kind="int",
        digest="771b6d93637b37db8e06683d426a5fd3ae72b77ac9974a9d3cfba35aa9275d90",
    ),
    Question(
        id="10.a",
        notebook="10",
        prompt="On the chat trace, a 10-million-token device cache hits 0.30 of prompt tokens. Add a 50-million-token "
        "CPU tier: the hit rate becomes (a) under 0.32, (b) 0.32 to 0.36, (c) over 0.36",
        kind="choice",
        choices=("a", "b", "c"),
        digest="4eb59fd8a5d6b98a39f216343e32c2612b22e8c720beafbd3451f3b58cbab674",
    ),
]

QUESTIONS: dict[str, Question] = {question.id: question for question in _QUESTIONS}


def get_question(question_id: str) -> Question:
    """Look a question up, with a clear error for a typo."""
    try:
        return QUESTIONS[str(question_id)]
    except KeyError:
        known = ", ".join(QUESTIONS)
        raise ValueError(f"No question {question_id!r}; the questions are: {known}.") from None


def _load_answers() -> dict[str, dict]:
    """The learner's recorded answers (none yet when the file does not exist or is unreadable)."""
    try:
        return json.loads(ANSWERS_FILE.read_text())
    except (OSError, ValueError):
        return {}


def answer(question_id: str, value: object) -> None:
    """Record a prediction and say whether it is right; `None` means not answered yet (nothing recorded)."""
    question = get_question(question_id)
    if value is None:
        options = f" (one of: {', '.join(question.choices)})" if question.choices else ""
        print(f"⏳ Question {question.id}: {question.prompt}?{options}")
        print("   Replace None with your prediction, run this cell, then run the next cell to see.")
        return
    try:
        correct = digest(question, value) == question.digest
    except ValueError as error:  # a format it cannot read: one sentence, nothing recorded
        print(f"⚠️ {error} Nothing was recorded: change the value and run the cell again.")
        return
    answers = _load_answers()
    answers[question.id] = {"value": normalize(question, value), "correct": correct}
    with contextlib.suppress(OSError):  # a read-only checkout still answers; only the scoreboard forgets
        ANSWERS_FILE.write_text(json.dumps(answers, indent=1, sort_keys=True))
    if correct:
        print(f"✅ Question {question.id}: {normalize(question, value)} is right. Run the next cell to see why.")
    else:
        print(f"❌ Question {question.id}: not {normalize(question, value)}. Run the next cell and see what happens.")


def question_results(*question_ids: str) -> list[dict]:
    """Scoreboard rows for the questions, in the grader's format (id, title, passed, total, status)."""
    answers = _load_answers()
    rows = []
    for question in [get_question(i) for i in question_ids] or list(QUESTIONS.values()):
        given = answers.get(question.id)
        status = "not attempted" if given is None else "correct" if given["correct"] else "incorrect"
        rows.append(
            {
                "id": question.id,
                "title": question.title,
                "passed": int(status == "correct"),
                "total": 1,
                "status": status,
            }
        )
    return rows


def main(argv: list[str]) -> int:
    """`digest ID KIND VALUE [DECIMALS]` prints the digest to store for a new question's expected answer."""
    if len(argv) not in (4, 5) or argv[0] != "digest" or argv[2] not in ("int", "float", "choice"):
        print("usage: python -m kvcourse.course.questions digest ID int|float|choice VALUE [DECIMALS]", file=sys.stderr)
        return 2
    _, question_id, kind, value, *decimals = argv
    choices = (value.strip().lower(),) if kind == "choice" else ()
    draft = Question(question_id, "", "", kind, "", choices=choices, decimals=int(decimals[0]) if decimals else 0)
    print(digest(draft, value))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
