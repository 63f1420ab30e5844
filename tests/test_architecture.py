"""The shape of the code, measured: no import cycle, a short way down one step, small learner rooms.

Issue 26's numbers, each as a test that fails when the code drifts back:
  * no import cycle anywhere in kvcourse/ (static: every import statement, function-local ones too);
  * LLMEngine.step reaches the free-block queue's popleft in at most MAX_CALLS_TO_POP nested calls;
  * engine_step's reference body (Exercise 1.1) is at most MAX_STEP_LINES code lines;
  * every solutions/ module has at most MAX_GIVEN_LINES code lines outside its exercise regions.
A "code line" is a line that is not blank and not only a comment (a docstring's lines count: that is how
the issue measured the rooms, scheduler 302, kv_cache 288, attention 199, model_runner 195).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvcourse"
SOLUTIONS = ROOT / "solutions"
MAX_CALLS_TO_POP = 7  # vLLM v1: EngineCore.step -> ... -> FreeKVCacheBlockQueue.popleft_n
MAX_STEP_LINES = 12
MAX_GIVEN_LINES = 150
MARK = "SOL" + "UTION"
REGION = re.compile(rf"^\s*# BEGIN {MARK} \d+\.\d+\s*$(.*?)^\s*# END {MARK}\s*$", re.MULTILINE | re.DOTALL)


# ---------------------------------------------------------------------------------------- counting
def is_code(line: str) -> bool:
    """A line that counts: not blank and not only a comment (docstring lines count, as the issue counted them)."""
    text = line.strip()
    return bool(text) and not text.startswith("#")


def region_lines(source: str) -> set[int]:
    """Line numbers (from 1) of the exercise regions, their BEGIN/END markers included."""
    inside: set[int] = set()
    for match in REGION.finditer(source):
        first = source.count("\n", 0, match.start()) + 1
        inside.update(range(first, source.count("\n", 0, match.end()) + 2))
    return inside


def given_code_lines(source: str) -> int:
    """Code lines outside the exercise regions: the given machinery a learner's file carries."""
    inside = region_lines(source)
    return sum(1 for number, line in enumerate(source.splitlines(), 1) if number not in inside and is_code(line))


def region_code_lines(source: str, function: str) -> int:
    """Code lines inside the exercise regions of one function (its reference body)."""
    [node] = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == function]
    lines = source.splitlines()
    inside = region_lines(source)
    return sum(
        1
        for number in range(node.lineno, node.end_lineno + 1)
        if number in inside and is_code(lines[number - 1]) and MARK not in lines[number - 1]
    )


# ---------------------------------------------------------------------------------------- imports
def module_name(path: Path) -> str:
    """kvcourse/serve/app.py -> kvcourse.serve.app; a package's __init__ is the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every kvcourse module -> the kvcourse modules it imports (anywhere in the file, TYPE_CHECKING blocks aside)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        type_only = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for n in ast.walk(block)
        }
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in type_only:
                continue
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                    )
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return stack[stack.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_in_the_package() -> None:
    """Each module imports only modules below it: none needs a function-local import to dodge a cycle."""
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The check above can fail."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# ---------------------------------------------------------------------------------------- line counts
def test_code_line_counter() -> None:
    """Comments, blank lines and docstrings are not code; a region's lines are not given code."""
    source = (
        '"""Doc\nstring."""\n\nimport os  # a comment\n\n# only a comment\ndef f():\n    """Why."""\n'
        f"    # BEGIN {MARK} 1.1\n    return os\n    # END {MARK}\n"
    )
    assert given_code_lines(source) == 5  # the docstring's two lines, import, def, its docstring
    assert region_code_lines(source, "f") == 1


@pytest.mark.parametrize("path", sorted(SOLUTIONS.glob("*.py")), ids=lambda p: p.name)
def test_learner_rooms_hold_little_given_code(path: Path) -> None:
    """An exercise module holds its exercises and little else: given machinery lives in given modules."""
    count = given_code_lines(path.read_text())
    assert count <= MAX_GIVEN_LINES, f"{path.name} has {count} code lines outside its exercise regions"


def test_engine_step_is_the_loop_not_the_scaffolding() -> None:
    """Exercise 1.1's reference is a few lines: schedule, execute, update."""
    count = region_code_lines((SOLUTIONS / "step.py").read_text(), "engine_step")
    assert 0 < count <= MAX_STEP_LINES, f"engine_step's reference body has {count} code lines"


# ---------------------------------------------------------------------------------------- the way down
def calls_to_popleft(run) -> list[list[str]]:
    """Every chain of calls from LLMEngine.step down to FreeKVCacheBlockQueue.popleft while `run()` runs."""
    stack: list[str] = []
    chains: list[list[str]] = []

    def profile(frame, event, arg) -> None:
        if event == "call":
            code = frame.f_code
            stack.append(f"{code.co_qualname}")
            if code.co_qualname == "FreeKVCacheBlockQueue.popleft" and "LLMEngine.step" in stack:
                chains.append(stack[len(stack) - 1 - stack[::-1].index("LLMEngine.step") :])
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return chains


@pytest.mark.parametrize(("prefix_caching", "num_blocks"), [(False, 16), (True, 16), (False, 6)])
def test_the_step_reaches_the_free_queue_in_few_calls(prefix_caching: bool, num_blocks: int) -> None:
    """Admission, chunked prefill, decode and preemption each reach the pop through at most MAX_CALLS_TO_POP calls."""
    import torch
    from transformers import GPT2LMHeadModel

    from kvcourse.engine.llm_engine import LLMEngine
    from kvcourse.models.gpt2 import tiny_gpt2_config

    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config()).eval()
    engine = LLMEngine(model, num_blocks=num_blocks, block_size=4, token_budget=8, enable_prefix_caching=prefix_caching)
    for prompt in ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5]):
        engine.add_request(prompt, 6)

    def run() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    chains = calls_to_popleft(run)
    assert chains, "no step reached FreeKVCacheBlockQueue.popleft"
    assert (engine.stats.preemptions > 0) == (num_blocks == 6), "the tight cache (6 blocks) must preempt, 16 not"
    longest = max(chains, key=len)
    assert len(longest) - 1 <= MAX_CALLS_TO_POP, "the step's way down: " + " -> ".join(longest)
