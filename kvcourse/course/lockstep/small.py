"""Workloads for the memory arithmetic (0.1, 0.2) and the engine's step (1.1), as plain-data ops."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Mapping
from types import ModuleType

import torch

from kvcourse.core.request import Request

from .core import error_record, module_files, plain
from .engine import sampled_token

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
          "int8": torch.int8}  # fmt: skip


def memory_ops(exercise_id: str, seed: int, size: str) -> list:
    """0.1: GPT-2 and Llama-style configs (grouped-query heads) in every dtype; 0.2: budgets past 2**53 bytes."""
    rng = random.Random(f"{exercise_id}/{seed}")
    ops: list = [["config", {}]]
    for _ in range(10 if size == "small" else 60):
        if exercise_id == "0.1":
            heads = rng.choice([1, 4, 12, 32, 40])
            config = {"hidden": heads * rng.choice([64, 80, 128]), "heads": heads, "layers": rng.choice([1, 12, 80])}
            config["kv_heads"] = rng.choice([None, heads, max(1, heads // 4), 1])
            config["style"] = rng.choice(["gpt2", "llama"])
            ops.append(["kv_bytes", config, rng.choice(list(DTYPES))])
        else:
            bpt = rng.choice([1, 3, 36_864, 131_072, 327_680])
            seq_len = rng.choice([1, 7, 1024, 4096, 131_072])
            memory = rng.choice([0, bpt * seq_len - 1, bpt * seq_len, 80 * 2**30, 2**53 + rng.randint(1, 2**40),
                                 2**62 + rng.randint(0, 2**50), 3 * bpt * seq_len * 2**35 - 1])  # fmt: skip
            ops.append(["max_sequences", memory, seq_len, bpt])
    return ops


def _model_config(config: dict) -> object:
    """A real transformers config, GPT-2's or Llama's (kv_cache_spec reads either)."""
    from transformers import GPT2Config, LlamaConfig

    if config["style"] == "gpt2":
        return GPT2Config(n_embd=config["hidden"], n_head=config["heads"], n_layer=config["layers"])
    return LlamaConfig(
        hidden_size=config["hidden"],
        num_attention_heads=config["heads"],
        num_hidden_layers=config["layers"],
        num_key_value_heads=config["kv_heads"] or config["heads"],
    )


def run_memory(ops: list, modules: Mapping[str, ModuleType]) -> list[dict]:
    """Call 0.1 / 0.2 and record the value and its type (an int, exact)."""
    memory = modules["memory"]
    files = module_files(modules)
    records: list[dict] = []
    for index, op in enumerate(ops[1:], start=1):
        try:
            if op[0] == "kv_bytes":
                value = memory.kv_bytes_per_token(_model_config(op[1]), DTYPES[op[2]])
            else:
                value = memory.max_sequences(op[1], op[2], op[3])
            obs = {"kv_bytes" if op[0] == "kv_bytes" else "sequences": plain(value), "type": type(value).__name__}
            records.append(
                {
                    "step": index,
                    "call": f"{'kv_bytes_per_token' if op[0] == 'kv_bytes' else 'max_sequences'}{op[1:]}",
                    "obs": obs,
                }
            )
        except Exception as error:
            records.append({"step": index, "call": f"{op[0]}{op[1:]}", **error_record(error, files)})
    return records


# ---------------------------------------------------------------------------------------------- 1.1
def step_ops(exercise_id: str, seed: int, size: str) -> list:
    """1.1: an idle engine, then requests (max_new_tokens=1 among them) stepped until idle, then idle again."""
    rng = random.Random(f"{exercise_id}/{seed}")
    ops: list = [["config", {"budget": rng.choice([1, 4, 16, 1000]), "blocks": rng.choice([4, 16]), "bs": 4}], ["step"]]
    for rid in range(rng.choice([1, 3, 5])):
        ops.append(["add", rid, [rng.randint(1, 40) for _ in range(rng.choice([1, 3, 9]))], rng.choice([1, 1, 2, 4])])
    ops += [["step"]] * (14 if size == "small" else 40)
    return ops


class _Log:
    """What happened, in order: phases entered and left, calls made, and inside which phase."""

    def __init__(self) -> None:
        self.events: list = []
        self.phase: str | None = None


class _Scheduler:
    """The reference scheduler, its calls logged with the phase they ran in."""

    def __init__(self, inner, log: _Log) -> None:
        self.inner, self.log = inner, log
        self.last_plan = None

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def schedule_next_batch(self):
        self.log.events.append(["schedule_next_batch", self.log.phase])
        self.last_plan = self.inner.schedule_next_batch()
        return self.last_plan

    def update_from_output(self, plan, sampled):
        same = plan is self.last_plan
        self.log.events.append(["update_from_output", self.log.phase, "the plan" if same else "another object",
                                sorted(sampled.items()) if isinstance(sampled, dict) else repr(sampled)])  # fmt: skip
        return self.inner.update_from_output(plan, sampled)


class _Executor:
    """A fake executor: samples a fixed token per sampling sequence, logs the phase it ran in."""

    def __init__(self, log: _Log, scheduler: _Scheduler) -> None:
        self.log, self.scheduler = log, scheduler

    def execute(self, plan):
        same = plan is self.scheduler.last_plan
        self.log.events.append(["execute", self.log.phase, "the plan" if same else "another object"])
        return {
            s.request_id: sampled_token(s.request_id, s.position_ids_start + len(s.tokens))
            for s in plan
            if s.samples_token
        }


class _Core:
    """The part of EngineCore that engine_step uses: scheduler, executor, iteration, phase()."""

    def __init__(self, scheduler, executor, log: _Log) -> None:
        self.scheduler, self.executor, self.log, self.iteration = scheduler, executor, log, 0

    @contextlib.contextmanager
    def phase(self, name: str, scheduler_output=None) -> Iterator[None]:
        given = (
            None
            if scheduler_output is None
            else ("the plan" if scheduler_output is self.scheduler.last_plan else "another object")
        )
        self.log.events.append(["enter", name, given])
        outer, self.log.phase = self.log.phase, name
        try:
            yield
        finally:
            self.log.phase = outer
            self.log.events.append(["leave", name])


def run_step(ops: list, modules: Mapping[str, ModuleType]) -> list[dict]:
    """Call engine_step on a fake core around the reference scheduler; record the events, the result, the state."""
    config = ops[0][1]
    files = module_files(modules)
    manager = modules["kv_cache"].KVCacheManager(config["blocks"], config["bs"])
    log = _Log()
    scheduler = _Scheduler(modules["scheduler"].StallFreeScheduler(config["budget"], 8, manager), log)
    core = _Core(scheduler, _Executor(log, scheduler), log)
    records: list[dict] = []
    requests: dict[int, Request] = {}
    for index, op in enumerate(ops[1:], start=1):
        if op[0] == "add":
            requests[op[1]] = Request(id=op[1], prompt_tokens=list(op[2]), max_new_tokens=op[3])
            scheduler.inner.add_request(requests[op[1]])
            continue
        log.events = []
        core.iteration += 1
        deadlock = None
        try:
            done = modules["step"].engine_step(core)
            record = {"step": index, "call": "engine_step", "obs": {"returned": [r.id for r in done]}}
        except Exception as error:
            record = {"step": index, "call": "engine_step", **error_record(error, files)}
            if type(error).__name__ == "Deadlock":  # the contract fixes its text: describe_stall(scheduler, iteration)
                deadlock = str(error)
        records.append(record)
        state = {
            "events": plain(log.events),
            "outputs": [[rid, list(r.output_tokens), r.status.name] for rid, r in sorted(requests.items())],
            "deadlock": deadlock,
        }
        records.append({"step": index, "call": "what engine_step did", "obs": state})
    return records
