"""An early, helpful note: read a submitted exercise module with `ast` and name what no exercise needs.

The classroom grader's security does not depend on it (the boundary, kvcourse/course/boundary.py, does): it
only tells a student, before the grades, what their file uses that no exercise needs. The allow-list is
derived from what the reference modules (solutions/*.py) and their stubs use: the modules they import (plus
a few pure-computation ones of the standard library, EXTRA_MODULES), the special methods they define and
the dunder attributes they read. It names, with a message a student can act on: importing the grader,
pytest, os, sys, atexit, inspect, ctypes, signal, builtins...; calling exec/eval/compile/open/__import__/
globals/vars/setattr; frame and code attributes; special methods that fake a value (`__eq__` on an int
subclass); changing another module's or class's attributes.

    python -m kvcourse.course.static_check FILE.py [...]   # what the grader would say about these files
"""

from __future__ import annotations

import ast
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvcourse.course.exercises import EXERCISE_MODULES

ROOT = Path(__file__).resolve().parents[2]
POLICY_FILE = Path(__file__).with_name("grader_policy.json")  # written into the autograder by `build`

# Standard-library modules for plain computation that an exercise may reasonably reach for, beyond those the
# reference imports (a learner's heap or bisect is fine). Nothing here reads files, starts processes or inspects.
EXTRA_MODULES = {
    "__future__",
    "abc",
    "bisect",
    "collections",
    "collections.abc",
    "copy",
    "dataclasses",
    "enum",
    "functools",
    "heapq",
    "itertools",
    "math",
    "numbers",
    "random",
    "statistics",
    "typing",
}
# Members of allowed modules that read or write files, load code, reach the interpreter or evaluate strings.
DANGEROUS_MEMBERS = {
    "triton": {"compiler", "tools", "backends", "build", "driver", "compile"},
    "torch": {
        "load", "save", "ops", "utils", "hub", "library", "classes", "jit", "compile", "package", "multiprocessing",
        "distributed", "from_file", "fx", "export", "onnx", "overrides", "serialization", "set_printoptions",
    },
    "typing": {"get_type_hints", "ForwardRef"},
    "dataclasses": {"make_dataclass"},
    "contextlib": {"redirect_stdout", "redirect_stderr", "chdir"},
    "functools": {"singledispatch"},
}  # fmt: skip
# Builtins no exercise calls: dynamic code, files, the interpreter's namespaces, attribute writes, the exits.
FORBIDDEN_NAMES = {
    "eval", "exec", "compile", "open", "__import__", "globals", "locals", "vars", "setattr", "delattr",
    "breakpoint", "input", "help", "exit", "quit", "memoryview", "dir", "SystemExit", "KeyboardInterrupt",
    "GeneratorExit", "__builtins__", "__loader__", "__spec__", "__file__", "__dict__", "__class__",
}  # fmt: skip
# Attributes that lead to frames, code objects and the modules behind them (no exercise needs any), or to files.
FORBIDDEN_ATTRIBUTES = {
    "gi_frame", "gi_code", "gi_yieldfrom", "cr_frame", "cr_code", "cr_await", "ag_frame", "ag_code", "f_back",
    "f_globals", "f_locals", "f_builtins", "f_code", "f_trace", "tb_frame", "tb_next", "co_code", "co_consts",
    "tofile", "dump", "from_file", "fromfile", "write_text", "write_bytes", "read_text", "read_bytes", "unlink",
    "system",
}  # fmt: skip
VALUE_TYPES = {"int", "float", "bool", "complex", "str", "bytes", "tuple", "list", "dict", "set", "frozenset", "type"}
ALWAYS_DUNDER_ATTRIBUTES = {"__name__"}
MUTATORS = {"update", "clear", "pop", "popitem", "setdefault", "append", "extend", "insert", "remove", "add", "discard",
            "sort", "reverse", "appendleft", "popleft", "extendleft", "rotate"}  # fmt: skip
SAFE_BASES = {"object", "Protocol", "Generic", "NamedTuple", "Enum", "IntEnum", "ABC", "TypedDict"}


def _exception_name(name: str | None) -> bool:
    """A builtin exception class (a learner's own error type may derive from ValueError and the like)."""
    import builtins

    value = getattr(builtins, name, None) if name else None
    return isinstance(value, type) and issubclass(value, Exception)


@dataclass(frozen=True)
class Refusal:
    """One reason the grader will not run a submitted module, with where."""

    path: str
    line: int
    why: str

    def __str__(self) -> str:
        return f"{self.path}, line {self.line}: {self.why}"


@dataclass
class Policy:
    """What submitted modules may use: derived from the reference modules and their stubs."""

    modules: set[str]
    dunder_defs: set[str]
    dunder_attributes: set[str]
    module_members: dict[str, set[str]]  # trusted kvcourse module -> names it binds to a module (refused)
    bases: set[str] = field(default_factory=set)  # base classes the reference subclasses (BlockPool, ...)

    def to_json(self) -> dict:
        return {
            k: sorted(v) if isinstance(v, set) else {m: sorted(n) for m, n in v.items()} for k, v in vars(self).items()
        }

    @classmethod
    def from_json(cls, data: dict) -> Policy:
        return cls(
            set(data["modules"]),
            set(data["dunder_defs"]),
            set(data["dunder_attributes"]),
            {m: set(n) for m, n in data["module_members"].items()},
            set(data.get("bases", [])),
        )


def _dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def _imported(tree: ast.AST, package: str | None = None) -> set[str]:
    """Every module a source imports, with its parents (`a.b.c` gives a, a.b and a.b.c)."""
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [_absolute(node, package)]
        for name in names:
            parts = name.split(".")
            found |= {".".join(parts[: i + 1]) for i in range(len(parts))}
    return found


def _absolute(node: ast.ImportFrom, package: str | None) -> str:
    """The absolute module of `from X import ...` (relative imports resolved against `package`)."""
    if not node.level:
        return node.module or ""
    base = (package or "kvcourse").split(".")
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _module_bindings(path: Path) -> set[str]:
    """Names a trusted module binds to other modules (`import os` in kvcourse/engine/llm_engine.py): not importable from it."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return set()
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def derive_policy(root: Path = ROOT) -> Policy:
    """The allow-list: what solutions/*.py and the stubs in kvcourse/ import, define and read."""
    from kvcourse.course.stubs import stub_for

    sources = []
    for module in sorted(EXERCISE_MODULES):
        solution = root / "solutions" / f"{module}.py"
        if not solution.is_file():
            raise FileNotFoundError(f"{solution} is missing: the grader's allow-list is derived from solutions/.")
        sources += [solution.read_text(), stub_for(solution)[0]]
    modules = set(EXTRA_MODULES) | {f"kvcourse.{m}" for m in EXERCISE_MODULES} | {"kvcourse"}
    dunder_defs, dunder_attributes, bases = set(), set(ALWAYS_DUNDER_ATTRIBUTES), set()
    for text in sources:
        tree = ast.parse(text)
        modules |= _imported(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _dunder(node.name):
                dunder_defs.add(node.name)
            elif isinstance(node, ast.Attribute) and _dunder(node.attr):
                dunder_attributes.add(node.attr)
            elif isinstance(node, ast.Name) and _dunder(node.id) and node.id not in FORBIDDEN_NAMES:
                dunder_attributes.add(node.id)  # `__all__ = [...]`
            elif isinstance(node, ast.ClassDef):
                bases |= {ast.unparse(base) for base in node.bases}
    members = {}
    for name in modules:
        if name.startswith("kvcourse."):
            path = root / Path(*name.split(".")).with_suffix(".py")
            if not path.is_file():
                path = root / Path(*name.split(".")) / "__init__.py"
            members[name] = _module_bindings(path)
    return Policy(modules, dunder_defs, dunder_attributes, members, bases)


def load_policy(root: Path = ROOT) -> Policy:
    """The policy shipped with the autograder (grader_policy.json), else derived from solutions/ here."""
    shipped = root / "kvcourse" / "course" / POLICY_FILE.name
    if shipped.is_file():
        return Policy.from_json(json.loads(shipped.read_text()))
    return derive_policy(root)


class _Checker(ast.NodeVisitor):
    """Walk one module and collect every refusal (all of them, so a student fixes them in one go)."""

    def __init__(self, path: str, policy: Policy, package: str) -> None:
        self.path, self.policy, self.package = path, policy, package
        self.refusals: list[Refusal] = []
        self.module_names: dict[str, str] = {}  # local name -> module it is bound to
        self.imported_names: set[str] = set()  # names bound by `from X import name`
        self.docstrings: set[int] = set()
        self.classes: set[str] = set()  # classes this module defined so far (a base may be one of them)

    def refuse(self, node: ast.AST, why: str) -> None:
        self.refusals.append(Refusal(self.path, getattr(node, "lineno", 0), why))

    # imports -----------------------------------------------------------------------------------------------
    def _allowed_module(self, node: ast.AST, name: str) -> bool:
        if name in self.policy.modules:
            return True
        top = name.split(".")[0]
        what = "the grader and the course machinery" if name.startswith("kvcourse.course") else f"`{top}`"
        self.refuse(
            node,
            f"imports {name}: no exercise needs {what}. The grader allows only the modules the exercises use "
            f"(torch, math, collections, dataclasses, the course's own kvcourse modules...); remove this import.",
        )
        return False

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if self._allowed_module(node, alias.name):
                if alias.asname:
                    self.module_names[alias.asname] = alias.name
                else:
                    self.module_names[alias.name.split(".")[0]] = alias.name.split(".")[0]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = _absolute(node, self.package)
        if not self._allowed_module(node, module):
            return
        for alias in node.names:
            if alias.name == "*":
                self.refuse(node, f"`from {module} import *`: import the names you use, one by one.")
                continue
            full = f"{module}.{alias.name}"
            if full not in self.policy.modules and (self._bad_member(module, alias.name) or _looks_module(full)):
                self.refuse(node, f"imports {alias.name} from {module}: no exercise needs it; remove this import.")
                continue
            local = alias.asname or alias.name
            if full in self.policy.modules:
                self.module_names[local] = full
            else:
                self.imported_names.add(local)

    # names and attributes ----------------------------------------------------------------------------------
    def visit_Name(self, node: ast.Name) -> None:
        if node.id in FORBIDDEN_NAMES or (_dunder(node.id) and node.id not in self.policy.dunder_attributes):
            self.refuse(node, f"uses `{node.id}`, which no exercise needs (it reaches past your own code); remove it.")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        name = node.attr
        if _dunder(name) and name not in self.policy.dunder_attributes:
            self.refuse(node, f"reads `.{name}`: special attributes are not needed by any exercise; remove it.")
        elif name in FORBIDDEN_ATTRIBUTES:
            self.refuse(node, f"uses `.{name}`, which reaches files, frames or code; no exercise needs it.")
        root, chain = _chain(node)
        if root in self.module_names and chain and chain[-1] == name:
            self._module_member(node, self.module_names[root], chain)
        if isinstance(node.ctx, (ast.Store, ast.Del)) and (root in self.module_names or root in self.imported_names):
            self.refuse(
                node, f"changes `{ast.unparse(node)}`, which belongs to another module: change only your own code."
            )
        self.generic_visit(node)

    def _bad_member(self, module: str, name: str) -> bool:
        """A member of an allowed module that no exercise needs: private, dangerous, or a module it imported."""
        top = module.split(".")[0]
        return (
            name.startswith("_")
            or name in DANGEROUS_MEMBERS.get(top, set())
            or name in self.policy.module_members.get(module, set())
            or (name in sys.stdlib_module_names and name not in self.policy.modules)  # torch.os, torch.sys
            or module == "kvcourse"  # the package itself holds only the course machinery
        )

    def _module_member(self, node: ast.AST, module: str, chain: list[str]) -> None:
        """`torch.nn.functional.softmax` is fine; `torch.load`, `torch.os`, `kvcourse.engine.llm_engine.sys` are not."""
        inside = True  # still walking through modules the policy lists
        for part in chain:
            if inside and f"{module}.{part}" in self.policy.modules:
                module = f"{module}.{part}"
                continue
            if (inside and self._bad_member(module, part)) or (
                not inside and (part.startswith("_") or part in sys.stdlib_module_names - self.policy.modules)
            ):
                self.refuse(node, f"uses {module}.{part}, which no exercise needs; use the module's public API.")
                return
            inside = False

    def visit_Subscript(self, node: ast.Subscript) -> None:
        root = node.value
        while isinstance(root, (ast.Attribute, ast.Subscript)):
            root = root.value
        owned = isinstance(root, ast.Name) and (root.id in self.module_names or root.id in self.imported_names)
        if isinstance(node.ctx, (ast.Store, ast.Del)) and owned:
            self.refuse(
                node, f"changes `{ast.unparse(node)}`, which belongs to another module: change only your own code."
            )
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        target = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else None
        if target and func.attr in MUTATORS and (target in self.imported_names or target in self.module_names):
            self.refuse(node, f"calls `{ast.unparse(func)}`, which changes another module's data: copy it first.")
        if isinstance(func, ast.Name):
            if func.id == "getattr":
                name = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else None
                if not _plain_constant(node.args[1] if len(node.args) > 1 else None) or (
                    name in sys.stdlib_module_names and name not in self.policy.modules
                ):
                    self.refuse(node, "getattr with a computed name: write the attribute (obj.name) instead.")
            elif func.id == "type" and len(node.args) != 1:
                self.refuse(node, "type() with three arguments builds a class on the fly; write a `class` instead.")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and "__" in node.value and id(node) not in self.docstrings:
            self.refuse(node, "a string holding '__' (a special name): no exercise needs one; remove it.")

    # definitions -------------------------------------------------------------------------------------------
    def _docstring(self, body: list[ast.stmt]) -> None:
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            self.docstrings.add(id(body[0].value))

    def visit_Module(self, node: ast.Module) -> None:
        self._docstring(node.body)
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._docstring(node.body)
        if _dunder(node.name) and node.name not in self.policy.dunder_defs:
            self.refuse(
                node,
                f"defines {node.name}: special methods that change how a value compares, converts or is looked up "
                f"are not allowed (allowed: {', '.join(sorted(self.policy.dunder_defs))}).",
            )
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._docstring(node.body)
        for base in node.bases:
            root = base.value if isinstance(base, ast.Subscript) else base  # Generic[T], Protocol[T]
            name = root.id if isinstance(root, ast.Name) else None
            if name in VALUE_TYPES:
                self.refuse(node, f"class {node.name} subclasses {name}: return plain values, not a subclass.")
            elif not (
                name in self.classes
                or name in SAFE_BASES
                or _exception_name(name)
                or ast.unparse(base) in self.policy.bases
            ):
                self.refuse(
                    node,
                    f"class {node.name} subclasses {ast.unparse(base)}: a subclass of a library's or the course's class "
                    "could change what the tests see; return their own objects (your own classes are fine).",
                )
        self.classes.add(node.name)
        for keyword in node.keywords:
            self.refuse(node, f"class {node.name} passes {keyword.arg}=...: no exercise needs a metaclass.")
        self.generic_visit(node)


def _looks_module(full: str) -> bool:
    """`from torch import nn`: a name that is itself a module (allowed only when listed in the policy)."""
    return full.split(".")[0] == "kvcourse" and full.rsplit(".", 1)[-1] in EXERCISE_MODULES | {"course"}


def _chain(node: ast.Attribute) -> tuple[str | None, list[str]]:
    """`a.b.c` -> ("a", ["b", "c"]); None as the root when the chain does not start at a name."""
    parts = []
    current: ast.AST = node
    while isinstance(current, ast.Attribute):
        parts.append(current.attr)
        current = current.value
    return (current.id if isinstance(current, ast.Name) else None), list(reversed(parts))


def _plain_constant(node: ast.AST) -> bool:
    """A string constant naming an ordinary attribute."""
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and "__" not in node.value
        and node.value not in FORBIDDEN_ATTRIBUTES
    )


def _module_aliases(tree: ast.AST, checker: _Checker) -> None:
    """A module may be used only as `module.name`: passing the module object around would hide what it reaches."""
    parents = {id(child): parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in checker.module_names and isinstance(node.ctx, ast.Load):
            parent = parents.get(id(node))
            tested = isinstance(parent, (ast.Compare, ast.BoolOp, ast.UnaryOp)) or (
                isinstance(parent, (ast.If, ast.IfExp)) and parent.test is node
            )  # `if triton is None:` only tests whether the module imported
            if not (isinstance(parent, ast.Attribute) and parent.value is node) and not tested:
                checker.refuse(node, f"uses the module `{node.id}` itself as a value: use `{node.id}.name` directly.")


def check_source(text: str, path: str, policy: Policy, module: str = "kvcourse.module") -> list[Refusal]:
    """Every refusal for one submitted module's source ([] when the grader may run it)."""
    try:
        tree = ast.parse(text, filename=path)
    except SyntaxError as error:
        return [Refusal(path, error.lineno or 0, f"Python cannot read this file: {error.msg}. Fix the syntax first.")]
    except ValueError as error:  # a NUL byte
        return [Refusal(path, 0, f"Python cannot read this file: {error}.")]
    checker = _Checker(path, policy, module.rsplit(".", 1)[0])
    checker.visit(tree)
    _module_aliases(tree, checker)
    return sorted(set(checker.refusals), key=lambda r: (r.line, r.why))


def explain(refusals: list[Refusal], limit: int = 5) -> str:
    """The refusals as one message for a student's feedback."""
    shown = "; ".join(str(r) for r in refusals[:limit])
    more = f" (and {len(refusals) - limit} more)" if len(refusals) > limit else ""
    return (
        f"this file uses what no exercise needs: {shown}{more}. Exercises need only plain Python, torch and the "
        "course's modules; it was graded anyway (as an unprivileged user, where it cannot help), so remove it."
    )


def main(argv: list[str] | None = None) -> int:
    """Print what the grader would refuse in the given files (the policy itself ships only inside the autograder)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m kvcourse.course.static_check FILE.py [...]", file=sys.stderr)
        return 2
    policy, bad = load_policy(), 0
    for name in argv:
        path = Path(name)
        refusals = check_source(path.read_text(), name, policy, f"kvcourse.{path.stem}")
        bad += bool(refusals)
        print(f"{name}: " + ("accepted" if not refusals else "\n  " + "\n  ".join(str(r) for r in refusals)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
