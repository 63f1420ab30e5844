"""Every Triton kernel of the course compiles for real GPUs (sm_80, sm_90), checked on a machine without one.

Triton's interpreter, which runs the kernels in the other tests, checks none of the GPU compiler's
rules; `triton.compile` does, and needs no GPU. A kernel change that only a GPU would reject fails here.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvcourse import attention
from kvcourse.course import grade
from kvcourse.course.kernel_compile import (
    ARCHS,
    DTYPES,
    GPU_TOLERANCES,
    KernelCompileError,
    assert_decode_kernel_compiles,
    compile_decode_kernel,
    compile_decode_kernels,
    inner_loop_ptx,
    jit_function,
    opcode_counts,
    resource_usage,
    stub_message,
)

ROOT = Path(__file__).resolve().parents[1]
# The kernels this file knows how to compile (their launch signature lives in kernel_compile).
KNOWN_KERNELS = {"_paged_decode_kernel"}
# Block sizes the course uses (tests, notebooks, the waste and kernel studies) and head sizes: GPT-2's 64,
# the tests' 8, and the other powers of two a learner's model may have.
BLOCK_SIZES = (1, 2, 3, 4, 8, 16, 32, 64, 128)
HEAD_DIMS = (8, 16, 32, 64, 128)


def _jit_kernels() -> list[tuple[str, str]]:
    """(file, function) for every function decorated with jit / triton.jit in the course's sources."""
    found = []
    for path in sorted([*ROOT.glob("solutions/*.py"), *ROOT.glob("kvcourse/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                ast.unparse(d).split("(")[0] in {"jit", "triton.jit"} for d in node.decorator_list
            ):
                found.append((str(path.relative_to(ROOT)), node.name))
    return found


def test_every_kernel_of_the_course_is_compiled_here():
    kernels = _jit_kernels()
    assert ("solutions/attention.py", "_paged_decode_kernel") in kernels
    unknown = sorted({name for _, name in kernels} - KNOWN_KERNELS)
    assert not unknown, f"kernels {unknown} are not compiled by this file: give them a signature and add them here"


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_kernel_compiles_for_each_target_and_dtype(arch, dtype):
    compiled = compile_decode_kernel(attention._paged_decode_kernel, dtype, arch)
    assert compiled.num_warps >= 1 and compiled.cubin
    assert ".target sm_" in compiled.ptx


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_kernel_compiles_for_each_block_size(block_size):
    compile_decode_kernels(attention._paged_decode_kernel, (90,), ("fp16",), block_size=block_size)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_decode_kernel_compiles_for_each_head_size(head_dim):
    compile_decode_kernels(attention._paged_decode_kernel, (90,), ("fp16",), head_dim=head_dim)


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_kernel_compiles_across_block_and_head_sizes(arch, dtype):
    """The full grid, for a release: every target and dtype with the extreme block and head sizes."""
    for block_size, head_dim in ((1, 8), (128, 128)):
        compile_decode_kernels(attention._paged_decode_kernel, (arch,), (dtype,), block_size, head_dim)


def test_resources_are_read_from_the_cubin():
    compiled = compile_decode_kernel(attention._paged_decode_kernel, "fp16", 90)
    usage = resource_usage(compiled)
    assert 1 <= usage.registers <= 255, "a thread has at most 255 registers"
    assert usage.spill_stores == usage.spill_loads == 0, f"the reference kernel spills: {usage}"
    assert usage.local == 0


def test_inner_loop_reads_keys_and_values_with_vector_loads():
    """The alignment hints reach the compiler: 16-byte loads of K and V in the loop over blocks."""
    body = inner_loop_ptx(compile_decode_kernel(attention._paged_decode_kernel, "fp16", 90).ptx)
    counts = opcode_counts(body)
    assert counts.get("ld.global.v4.b32", 0) >= 2, f"expected vectorised K and V loads in the loop; got {counts}"
    assert counts.get("ex2.approx.f32", 0) >= 1, "the online softmax's exp should be in the loop"


# ----------------------------------------------------------------------------- a kernel only the GPU rejects
def _mutant(tmp_path: Path) -> Path:
    """The reference module with one change: l_i starts as the int 0 instead of the float 0.0."""
    source = (ROOT / "solutions" / "attention.py").read_text()
    assert source.count("    l_i = 0.0\n") == 1
    path = tmp_path / "attention_mutant.py"
    path.write_text(source.replace("    l_i = 0.0\n", "    l_i = 0\n"))
    return path


_INTERPRET = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("attention_mutant", sys.argv[1])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
gen = torch.Generator().manual_seed(0)
key_cache, value_cache = torch.randn(6, 4, 2, 8, generator=gen), torch.randn(6, 4, 2, 8, generator=gen)
query, tables = torch.randn(2, 2, 8, generator=gen), torch.tensor([[3, 1, 5], [0, 2, 4]], dtype=torch.int32)
lens = torch.tensor([9, 5])
got = m.triton_paged_decode_attention(query, key_cache, value_cache, tables, lens)
ref = m.paged_decode_attention(query, key_cache, value_cache, tables, lens)
print((got - ref).abs().max().item())
"""


def _load(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mutant_passes_the_interpreter_but_fails_the_compile_check_in_words(tmp_path):
    path = _mutant(tmp_path)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _INTERPRET, str(path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split()[-1]) < 1e-5, "the interpreter should accept the mutant (that is the point)"

    kernel = _load(path)._paged_decode_kernel
    with pytest.raises(AssertionError) as caught:
        assert_decode_kernel_compiles(kernel, archs=(90,), dtypes=("fp16",))
    message, stub, _ = grade._plain_message(caught)  # what check("5.4") shows as "What failed:"
    assert stub is None and "\n" not in message and "Traceback" not in message
    assert "Loop-carried variable l_i has initial type int32 but is re-assigned to fp32" in message
    line = path.read_text().splitlines().index("    for i in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):") + 1
    assert f"attention_mutant.py, line {line}" in message, message
    assert "write `0.0`, not `0`" in message and "first set at line" in message and "`l_i = 0`" in message


def test_compile_errors_are_explained_with_the_line(tmp_path):
    source = (ROOT / "solutions" / "attention.py").read_text()
    path = tmp_path / "attention_pow2.py"
    path.write_text(source.replace("offs_t = tl.arange(0, BLOCK_T)", "offs_t = tl.arange(0, BLOCK_SIZE)"))
    kernel = _load(path)._paged_decode_kernel
    compile_decode_kernels(kernel, (90,), ("fp16",), block_size=16)  # a power of two: fine
    with pytest.raises(KernelCompileError) as caught:
        compile_decode_kernels(kernel, (90,), ("fp16",), block_size=3)
    assert "arange's range must be a power of 2" in str(caught.value)
    assert "`offs_t = tl.arange(0, BLOCK_SIZE)`" in str(caught.value)


MISTAKES = {  # a learner's likely slip -> (the edit to the reference, words the explanation must contain)
    "break": (("        m_i = m_new\n", "        m_i = m_new\n        if i > 100:\n            break\n"), "`break`"),
    "global": (('    m_i = float("-inf")\n', "    m_i = NEG_INF\n"), "pass `NEG_INF` as an argument"),
    "shapes": (("tl.sum(k * q[None, :], axis=1)", "tl.sum(k * q[:, None], axis=1)"), "dimension 0: 16 vs 64"),
    "typo": (("out = acc / l_i", "out = acc / l_total"), "`l_total` is used before it is assigned"),
    "python math": (("alpha = tl.exp(m_i - m_new)", "alpha = math.exp(m_i - m_new)"), "use tl.exp"),
    "list": (('    m_i = float("-inf")\n', "    m_i = [x for x in range(2)]\n"), "Python lists do not exist"),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_common_mistakes_are_explained_in_words(tmp_path, mistake):
    (old, new), words = MISTAKES[mistake]
    source = (ROOT / "solutions" / "attention.py").read_text()
    assert source.count(old) == 1
    path = tmp_path / "attention_mistake.py"
    # the module-level names a slip may reach for: Python's math, and a global constant
    header = "import math\n\nimport torch\n\nNEG_INF = float('-inf')\n"
    assert source.count("import torch\n") == 1
    path.write_text(source.replace(old, new).replace("import torch\n", header, 1))
    with pytest.raises(KernelCompileError) as caught:
        compile_decode_kernels(_load(path)._paged_decode_kernel, (90,), ("fp32",))
    message = str(caught.value)
    assert words in message, message
    assert "attention_mistake.py, line " in message and "see the compiler's sentence" not in message


def test_the_stub_is_reported_as_not_written():
    stub = _load(ROOT / "kvcourse" / "attention.py")  # the generated stub, loaded by path (no solutions switch)
    message = stub_message(stub._paged_decode_kernel)
    assert message and message.startswith("Exercise 5.4"), message


@pytest.mark.slow  # imports triton and compiles in a fresh process: `./course test -m slow` (CI runs it)
def test_interpreted_kernels_are_compiled_in_a_clean_process():
    """With TRITON_INTERPRET=1 (a notebook on a CPU) the kernel is an interpreted function; it still compiles."""
    script = (
        "from kvcourse import attention\n"
        "from kvcourse.course.kernel_compile import compile_decode_kernel, jit_function\n"
        "c = compile_decode_kernel(attention._paged_decode_kernel, 'bf16', 80)\n"
        "print(type(attention._paged_decode_kernel).__name__, c.num_warps, len(c.cubin) > 0)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "KVCOURSE_SOLUTIONS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["InterpretedFunction", "4", "True"]


def test_bad_arguments_are_refused_in_words():
    with pytest.raises(ValueError, match="dtype must be one of"):
        compile_decode_kernel(attention._paged_decode_kernel, "fp64", 90)
    with pytest.raises(ValueError, match="arch must be one of"):
        compile_decode_kernel(attention._paged_decode_kernel, "fp16", 75)
    with pytest.raises(ValueError, match=r"expected a @triton\.jit kernel"):
        jit_function(print)


# ----------------------------------------------------------------------------- on a GPU: results within stated tolerances
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the compiled kernel runs on a GPU only")
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_kernel_matches_fp32_reference_within_the_stated_tolerance(dtype):
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    gen = torch.Generator().manual_seed(3)
    lens = torch.tensor([1, 17, 300, 64])
    width = int((lens.max() + 15) // 16)
    key_cache = torch.randn(4 * width + 2, 16, 12, 64, generator=gen)
    value_cache = torch.randn(4 * width + 2, 16, 12, 64, generator=gen)
    tables = torch.randperm(key_cache.shape[0], generator=gen)[: 4 * width].view(4, width).int()
    query = torch.randn(4, 12, 64, generator=gen)
    inputs = [x.to(torch_dtype).cuda() for x in (query, key_cache, value_cache)]
    got = attention.triton_paged_decode_attention(*inputs, tables.cuda(), lens.cuda())
    ref = attention.paged_decode_attention(*(x.float() for x in inputs), tables.cuda(), lens.cuda())
    tol = GPU_TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)
