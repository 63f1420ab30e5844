"""Compile a Triton kernel ahead of time for real NVIDIA GPUs, on a machine without one.

Triton's CPU interpreter runs a kernel as Python and checks none of the GPU compiler's rules, so a
kernel can pass there and still be rejected by the compiler. The Triton wheel ships the whole
compiler (and NVIDIA's `ptxas` and `cuobjdump`): `triton.compile` turns the kernel into TTIR, TTGIR,
LLVM IR, PTX and a cubin for any target, no GPU needed. This module does that for the course's
decode kernel, says in plain words why a compile failed, and reads the cubin's resources
(registers, shared and local memory) as a GPU would allocate them.

    from kvcourse.course.kernel_compile import compile_decode_kernel, resource_usage
    compiled = compile_decode_kernel(attention._paged_decode_kernel, dtype="fp16", arch=90)
    print(resource_usage(compiled))
"""

from __future__ import annotations

import ast
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ARCHS = {80: "A100 (sm_80)", 90: "H100/H200 (sm_90)"}  # the targets the course checks
DTYPES = ("fp16", "bf16", "fp32")  # the cache and query dtypes a learner may run the kernel with
TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
# Tolerances (atol = rtol) for the kernel on a GPU against the fp32 reference on the same inputs. The
# interpreter computes in fp32 whatever the dtypes say; a GPU does not. The course's kernel loads K and V
# and upcasts them to fp32 and reduces with tl.sum (no tl.dot, so no TF32), and its exp is the GPU's
# ex2.approx (a few ulp): in fp32 the residue is summation order and that exp, well inside 1e-4. An fp16
# output is rounded to 11 significant bits (2**-11 = 4.9e-4 relative; 2e-3 leaves room for values near
# 2-4), bf16 to 8 bits (2**-8 = 3.9e-3; 1.6e-2 likewise). A kernel using tl.dot on fp32 gets TF32 (10-bit
# mantissa, ~1e-3) unless it passes input_precision="ieee": the fp32 tolerance would catch that.
GPU_TOLERANCES = {"fp32": 1e-4, "fp16": 2e-3, "bf16": 1.6e-2}

# Plain-words meanings of the GPU compiler's most common complaints: (pattern, what it usually means).
_MEANINGS: list[tuple[str, str]] = [
    (
        r"Loop-carried variable (\w+) has initial type (\w+) but is re-assigned to (\w+)",
        "a variable updated inside a loop must keep one type on the GPU: `{0}` starts as {1} and becomes "
        "{2} in the loop. Give it its final type before the loop (for a float, write `0.0`, not `0`).",
    ),
    (
        r"initial value for `(\w+)` is of type ([\w\[\]]+), but the (?:then|else) block redefines it as ([\w\[\]]+)",
        "both branches of an `if` must leave `{0}` with the same type ({1} vs {2}): write the same kind "
        "of number in both (`0.0`, not `0`).",
    ),
    (
        r"arange's arguments must be of type tl.constexpr",
        "tl.arange needs bounds known when the kernel compiles: use a `tl.constexpr` argument (such as "
        "BLOCK_T), not a value loaded from memory, and mask the extra lanes instead.",
    ),
    (
        r"(arange's range|Shape element \d+) must be a power of 2",
        "block shapes on a GPU are powers of two: use the rounded-up BLOCK_T / BLOCK_D and mask the "
        "lanes past BLOCK_SIZE / HEAD_DIM.",
    ),
    (
        r"incompatible dimensions at index (\d+): (\d+) and (\d+)",
        "two blocks of different shapes were combined (dimension {0}: {1} vs {2}): check which axis each "
        "`[:, None]` / `[None, :]` adds, and that masks have the shape of what they mask.",
    ),
    (
        r"unsupported AST node type: (\w+)",
        "a kernel is compiled, not run as Python, and `{0}` is a Python construct Triton does not compile "
        "(`break`, `continue`, `try`, `with`, list comprehensions...): express it with masks or tl.where.",
    ),
    (
        r"only tuple comprehensions are supported",
        "Python lists do not exist inside a kernel: build blocks with tl.arange / tl.zeros instead.",
    ),
    (
        r"Cannot access global variable (\w+)",
        "a kernel sees only its arguments and `tl.constexpr` globals: pass `{0}` as an argument, or write "
        "the value in the kernel.",
    ),
    (
        r"(\w+) is not defined",
        "`{0}` is used before it is assigned in the kernel (a typo, or a variable defined only inside a "
        "branch or loop).",
    ),
    (
        r"must be real number, not tensor|_semantic` argument must be provided",
        "a plain Python or math function, or Python indexing of a pointer, was applied to a Triton value: "
        "inside a kernel use tl.exp, tl.maximum, tl.load(ptr + offset) and friends.",
    ),
    (
        r"ptxas",
        "NVIDIA's assembler rejected the generated code: the kernel is probably too large for the target "
        "(shared memory or registers); try smaller blocks.",
    ),
]


@dataclass(frozen=True)
class CompiledKernel:
    """One kernel compiled for one GPU target: its code at each stage and what the launch reserves."""

    name: str
    arch: int
    dtype: str
    num_warps: int  # warps per program (32 threads each)
    shared: int  # bytes of dynamic shared memory per program, requested at launch (not in the cubin)
    ttir: str
    ttgir: str
    ptx: str
    cubin: bytes
    seconds: float  # wall time of the compile (0.0 when this process had compiled it before)


@dataclass(frozen=True)
class Resources:
    """What one program of the kernel occupies on the GPU, read from the cubin by NVIDIA's own tools."""

    registers: int  # per thread
    static_shared: int  # bytes per program declared in the cubin (sm_90 reserves 1 KiB for the system)
    local: int  # bytes per thread of local memory (off-chip): non-zero means spills or stack arrays
    stack: int
    spill_stores: int  # bytes per thread the register allocator had to spill
    spill_loads: int


class KernelCompileError(Exception):
    """The GPU compiler rejected the kernel; str() explains it in plain words."""

    def __init__(self, compiler_message: str, where: str, source_line: str, meaning: str, target: str):
        self.compiler_message, self.where, self.source_line = compiler_message, where, source_line
        self.meaning, self.target = meaning, target
        at = f"{where}: `{source_line.strip()}`" if source_line else "a line it could not name"
        super().__init__(
            f"the GPU compiler ({target}) rejects your kernel at {at} — it says: {compiler_message} "
            f"What this usually means: {meaning} Triton's CPU interpreter does not check this; a GPU would."
        )

    def __reduce__(self):
        """Picklable, so a compile done in another process can report its error here."""
        return type(self), (self.compiler_message, self.where, self.source_line, self.meaning, self.target)


def jit_function(kernel):
    """The kernel as Triton's compiler sees it, also when TRITON_INTERPRET=1 made it an interpreted function."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel
    fn = getattr(kernel, "fn", None)
    if not callable(fn):
        raise ValueError(
            f"expected a @triton.jit kernel; got {type(kernel).__name__}. Decorate the function with @triton.jit."
        )
    return JITFunction(fn)


def decode_kernel_signature(
    kernel,
    dtype: str = "fp16",
    block_size: int = 16,
    head_dim: int = 64,
    heads: int = 9,
    max_blocks: int = 64,
    kv_heads: int = 3,
) -> tuple[dict, dict, dict]:
    """Argument types, constants and alignment hints exactly as `triton_paged_decode_attention` would launch it.

    The default heads are SmolLM2's (9 query heads sharing 3 KV heads: grouped-query attention).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}; got {dtype!r}.")
    if min(block_size, head_dim, heads, max_blocks, kv_heads) < 1 or heads % kv_heads:
        raise ValueError(
            f"block_size, head_dim, heads, max_blocks and kv_heads must be positive, heads a multiple of kv_heads; "
            f"got {block_size}, {head_dim}, {heads}, {max_blocks}, {kv_heads}."
        )
    import triton

    data = f"*{dtype}"
    strides = {  # a contiguous query [B, H, D], caches [num_blocks, block_size, KVH, D], block_tables [B, max_blocks]
        "stride_qb": heads * head_dim,
        "stride_qh": head_dim,
        "stride_cb": block_size * kv_heads * head_dim,
        "stride_cs": kv_heads * head_dim,
        "stride_ch": head_dim,
        "stride_bt": max_blocks,
    }
    types = {
        "out_ptr": data,
        "query_ptr": data,
        "key_cache_ptr": data,
        "value_cache_ptr": data,
        "block_tables_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "scale": "fp32",
        **dict.fromkeys(strides, "i32"),
    }
    constexprs = {
        "BLOCK_SIZE": block_size,
        "HEAD_DIM": head_dim,
        "QUERIES_PER_KV": heads // kv_heads,
        "BLOCK_T": triton.next_power_of_2(block_size),
        "BLOCK_D": triton.next_power_of_2(head_dim),
    }
    names = jit_function(kernel).arg_names
    unknown = [n for n in names if n not in types and n not in constexprs]
    missing = [n for n in list(types) + list(constexprs) if n not in names]
    if unknown or missing:
        raise ValueError(
            f"the kernel's parameters differ from the launcher's: unexpected {unknown}, missing {missing}. "
            "Keep the signature of _paged_decode_kernel as given."
        )
    signature = {n: types.get(n, "constexpr") for n in names}
    # A real launch tells the compiler which pointers and integers are multiples of 16 (torch allocations
    # are 16-byte aligned); this decides whether loads are vectorised, so give the same hints.
    aligned = [i for i, n in enumerate(names) if n.endswith("_ptr") or (n in strides and strides[n] % 16 == 0)]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    return signature, constexprs, attrs


_COMPILED: dict[tuple, CompiledKernel] = {}


def compile_kernel(
    kernel, signature: dict, constexprs: dict, attrs: dict, arch: int, dtype: str = ""
) -> CompiledKernel:
    """Compile for sm_<arch> (cached per source hash, target and signature); raise KernelCompileError in words."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)} (compute capability x10); got {arch!r}.")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = jit_function(kernel)
    key = (fn.cache_key, arch, str(signature), str(constexprs), str(attrs))
    if key in _COMPILED:
        return _COMPILED[key]
    start = time.perf_counter()
    try:
        compiled = triton.compile(
            ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", arch, 32),
            options={"enable_fp_fusion": True},  # Triton 3.9's launch default, said out loud (no warning)
        )
    except Exception as error:
        raise explain(error, fn, f"sm_{arch}") from None
    result = CompiledKernel(
        name=fn.__name__,
        arch=arch,
        dtype=dtype,
        num_warps=compiled.metadata.num_warps,
        shared=compiled.metadata.shared,
        ttir=compiled.asm["ttir"],
        ttgir=compiled.asm["ttgir"],
        ptx=compiled.asm["ptx"],
        cubin=compiled.asm["cubin"],
        seconds=time.perf_counter() - start,
    )
    _COMPILED[key] = result
    return result


def compile_decode_kernel(
    kernel, dtype: str = "fp16", arch: int = 90, block_size: int = 16, head_dim: int = 64
) -> CompiledKernel:
    """The decode kernel compiled as the launcher would run it on this target and dtype."""
    return compile_decode_kernels(kernel, (arch,), (dtype,), block_size, head_dim)[0]


def compile_decode_kernels(
    kernel, archs=tuple(ARCHS), dtypes=DTYPES, block_size: int = 16, head_dim: int = 64
) -> list[CompiledKernel]:
    """Every (arch, dtype) pair, compiled here, or in one clean process when Triton's interpreter owns this one."""

    def job(arch, dtype):
        return (arch, dtype, *decode_kernel_signature(kernel, dtype, block_size, head_dim))

    jobs = [job(arch, dtype) for arch in archs for dtype in dtypes]
    if _interpreted(kernel):
        # one clean process costs seconds to start: compile every target and dtype there at once
        wanted = {(a, d) for a, d, *_ in jobs}
        extra = [job(a, d) for a in ARCHS for d in DTYPES if (a, d) not in wanted]
        return _compile_elsewhere(kernel, jobs, extra)
    return [compile_kernel(kernel, sig, consts, attrs, arch, dtype) for arch, dtype, sig, consts, attrs in jobs]


def assert_decode_kernel_compiles(
    kernel, archs=tuple(ARCHS), dtypes=DTYPES, block_size: int = 16, head_dim: int = 64
) -> list[CompiledKernel]:
    """For graders: every target and dtype compiles, or an AssertionError whose first line says why, in words."""
    try:
        return compile_decode_kernels(kernel, archs, dtypes, block_size, head_dim)
    except KernelCompileError as error:
        raise AssertionError(f"{error} (block_size={block_size}, head size {head_dim})") from None


def _interpreted(kernel) -> bool:
    """True when TRITON_INTERPRET=1 made this an interpreted function: its process cannot compile reliably."""
    from triton.runtime.jit import JITFunction

    return not isinstance(kernel, JITFunction)


_CHILD = """
import importlib.util, pickle, sys
from kvcourse.course import kernel_compile as kc
path, name, jobs, out = pickle.load(open(sys.argv[1], "rb"))
spec = importlib.util.spec_from_file_location("_kernel_source", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
results = []
for arch, dtype, signature, constexprs, attrs in jobs:
    try:
        results.append(kc.compile_kernel(getattr(module, name), signature, constexprs, attrs, arch, dtype))
    except kc.KernelCompileError as error:
        results.append(error)
pickle.dump(results, open(out, "wb"))
"""
_FAILED: dict[tuple, KernelCompileError] = {}  # compile errors met in a clean process, per key


def _compile_elsewhere(kernel, jobs: list, extra: list = ()) -> list[CompiledKernel]:
    """Compile in a fresh Python without TRITON_INTERPRET (the interpreter patches Triton's language in place)."""
    import inspect
    import os
    import pickle
    import sys

    fn = jit_function(kernel)

    def key(job):
        arch, _, sig, consts, attrs = job
        return (fn.cache_key, arch, str(sig), str(consts), str(attrs))

    todo = [j for j in [*jobs, *extra] if key(j) not in _COMPILED and key(j) not in _FAILED]
    if any(key(j) not in _COMPILED and key(j) not in _FAILED for j in jobs):
        with tempfile.TemporaryDirectory() as tmp:
            request, out = Path(tmp, "request.pkl"), Path(tmp, "result.pkl")
            request.write_bytes(pickle.dumps((inspect.getsourcefile(fn.fn), fn.__name__, todo, str(out))))
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            root = str(Path(__file__).resolve().parents[2])
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
            done = subprocess.run(
                [sys.executable, "-c", _CHILD, str(request)], env=env, capture_output=True, text=True, timeout=600
            )
            if done.returncode != 0 or not out.exists():
                raise RuntimeError(f"the compile process failed: {done.stderr.strip()[-2000:]}")
            for job, result in zip(todo, pickle.loads(out.read_bytes())):
                (_FAILED if isinstance(result, KernelCompileError) else _COMPILED)[key(job)] = result
    for job in jobs:
        if key(job) in _FAILED:
            raise _FAILED[key(job)]
    return [_COMPILED[key(job)] for job in jobs]


def explain(error: BaseException, fn, target: str) -> KernelCompileError:
    """The compiler's own sentence, the kernel line it points at, and what it usually means."""
    sentence = _compiler_sentence(error)
    where, source_line = _kernel_line(error, fn)
    meaning = "see the compiler's sentence; compare your kernel with the exercise's steps."
    for pattern, text in _MEANINGS:
        found = re.search(pattern, sentence)
        if found:
            meaning = text.format(*found.groups())
            break
    carried = re.search(r"Loop-carried variable (\w+)|initial value for `(\w+)`", sentence)
    if carried and where:
        meaning += _first_assignment(fn, carried[1] or carried[2])
    return KernelCompileError(sentence, where, source_line, meaning, target)


def _first_assignment(fn, name: str) -> str:
    """' (It is first set at line N: `name = ...`.)' for a variable of the kernel, or ''."""
    for number, text in enumerate(fn.src.splitlines()):
        if re.match(rf"\s*{re.escape(name)}\s*=[^=]", text):
            return f" (It is first set at line {_def_line(fn) + number}: `{text.strip()}`.)"
    return ""


def _compiler_sentence(error: BaseException) -> str:
    """The innermost message of a (possibly nested) compile error, without Python's repr wrapping."""
    message = ""
    while error is not None:
        own = getattr(error, "error_message", None)
        if own is None and not hasattr(error, "node"):
            own = str(error)
        if own:
            message = own
        error = error.__cause__ or (error.__context__ if hasattr(error, "node") else None)
    wrapped = re.fullmatch(r"\w+\((['\"])(.*)\1\)", message.strip(), re.S)
    text = wrapped[2] if wrapped else message.strip()
    text = text.split(" Note that this is different")[0]  # Triton's long NameError tail is about internals
    text = " ".join(text.split())
    if "ptxas" in text:
        text = next((ln for ln in message.splitlines() if "error" in ln.lower()), text.splitlines()[0])
    return text if text.endswith((".", "!", "?")) else text + "."


def _kernel_line(error: BaseException, fn) -> tuple[str, str]:
    """'kvcourse/attention.py, line 230' for the line the outermost compile error points at, and its text."""
    import inspect

    node = getattr(error, "node", None)
    if not isinstance(node, ast.AST) or getattr(node, "lineno", None) is None or getattr(error, "src", None) != fn.src:
        return "", ""
    path = Path(inspect.getsourcefile(fn.fn) or "kernel.py")
    line = _def_line(fn) + node.lineno - 1
    return f"{path.parent.name}/{path.name}, line {line}", fn.src.splitlines()[node.lineno - 1]


def _def_line(fn) -> int:
    """The file line of the kernel's `def` (newer Triton records it; 3.5 and 3.6 only where its decorators start)."""
    line = getattr(fn, "def_file_line_number", None)
    if line is not None:
        return line
    offset = next((i for i, text in enumerate(fn.raw_src) if text.strip().startswith("def ")), 0)
    return fn.starting_line_number + offset


def _nvidia_tool(name: str) -> str:
    """Path of a tool the Triton wheel ships (cuobjdump, ptxas)."""
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: this Triton wheel does not ship {name}.")
    return str(path)


def _ptxas(arch: int) -> str:
    """The ptxas Triton itself uses for this target (the wheel ships one per CUDA generation)."""
    import inspect

    from triton.backends.nvidia.compiler import get_ptxas

    return (get_ptxas(arch) if inspect.signature(get_ptxas).parameters else get_ptxas()).path  # Triton 3.5: no arch


def _sm_name(arch: int) -> str:
    """Triton's name for the target (sm_90a on Hopper: its PTX uses the arch-specific instructions)."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    return sm_arch_from_capability(arch)


def resource_usage(compiled: CompiledKernel) -> Resources:
    """Registers, static shared and local memory from the cubin (cuobjdump), spill bytes from ptxas's report."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin, ptx = Path(tmp, "kernel.cubin"), Path(tmp, "kernel.ptx")
        cubin.write_bytes(compiled.cubin)
        ptx.write_text(compiled.ptx)
        dump = _run([_nvidia_tool("cuobjdump"), "--dump-resource-usage", str(cubin)])
        # the same ptxas call Triton makes (minus the output it keeps), for its -v report of spills
        report = _run(
            [_ptxas(compiled.arch), "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={_sm_name(compiled.arch)}"]
            + [str(ptx), "-o", str(Path(tmp, "check.o"))]
        )
    usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", dump))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if not usage or not spills:
        raise RuntimeError(f"could not read the resource usage:\n{dump}\n{report}")
    return Resources(
        registers=int(usage["REG"]),
        static_shared=int(usage["SHARED"]),
        local=int(usage["LOCAL"]),
        stack=int(usage["STACK"]),
        spill_stores=int(spills[1]),
        spill_loads=int(spills[2]),
    )


def _run(command: list[str]) -> str:
    """Run one of NVIDIA's tools and return what it printed (both streams)."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(command[0]).name} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout + done.stderr


def inner_loop_ptx(ptx: str) -> list[str]:
    """The PTX instructions of the kernel's innermost loop (the walk over blocks), without debug lines."""
    lines = [ln.strip() for ln in ptx.splitlines()]
    header = next((i for i, ln in enumerate(lines) if "Inner Loop Header" in ln), None)
    if header is None:
        return []
    label = lines[header].split(":")[0]
    body = []
    for ln in lines[header + 1 :]:
        if not ln or ln.startswith((".loc", "//", "$L__tmp", ".pragma")):
            continue
        body.append(ln)
        if ln.endswith(f"bra \t{label};") or re.search(rf"bra\s+{re.escape(label)};", ln):
            break
    return body


def opcode_counts(instructions: list[str]) -> dict[str, int]:
    """How many of each PTX opcode (predicate guards dropped), most frequent first."""
    counts: dict[str, int] = {}
    for ln in instructions:
        words = [w for w in ln.split() if not w.startswith("@")]
        if words and not words[0].endswith(":") and words[0] not in {"{", "}"}:
            counts[words[0]] = counts.get(words[0], 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def stub_message(kernel) -> str | None:
    """The exercise's own NotImplementedError message, if the kernel body is still the stub."""
    found = re.search(r'NotImplementedError\(\s*"(Exercise [\d.]+ .*?)"\s*\)', jit_function(kernel).src, re.S)
    return found[1] if found else None
