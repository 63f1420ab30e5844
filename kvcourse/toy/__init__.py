"""The toy world: watch a scheduler work without loading a real model.

The toy "model" predicts the next token as a hash of the WHOLE context it has cached for a request,
so it behaves like a real model in the ways that matter here:
  * the same context always gives the same next token, so recomputing after a preemption loses
    nothing and a memory-constrained run must reproduce an unconstrained one token for token;
  * it reads its own simulated KV cache, filled at the positions the scheduler gives, so a wrong
    token (a placeholder) or a wrong position changes the outputs or stops the run with a clear error.

    trace = run(scheduler)                    # schedule -> execute -> update_from_output, until done
    print(trace.format())                     # one line per iteration

One file per job: `model` (the toy model and its unconstrained `toy_generate`), `executor` (its
simulated KV cache), `runner` (`run`: the engine's own loop, `kvcourse.engine.llm_engine.EngineCore`, with the toy executor), `blind_scheduler` (notebook 01's
memory-blind scheduler), `workload` (seeded requests), `arrivals` (`serve`: requests arriving while the
loop runs, on a simulated or the wall clock; notebook 07). Pictures live in `kvcourse.viz`.
"""

from kvcourse.toy.arrivals import RequestTimes, SimulatedClock, StepCost, WallClock, serve, serve_engine
from kvcourse.toy.blind_scheduler import BlindStallFreeScheduler
from kvcourse.toy.executor import ToyExecutor
from kvcourse.toy.model import TOY_VOCAB_SIZE, toy_generate, toy_next_token
from kvcourse.toy.runner import Deadlock, Livelock, StepRecord, Trace, format_step, run
from kvcourse.toy.workload import toy_requests

__all__ = [
    "TOY_VOCAB_SIZE",
    "BlindStallFreeScheduler",
    "Deadlock",
    "Livelock",
    "RequestTimes",
    "SimulatedClock",
    "StepCost",
    "StepRecord",
    "ToyExecutor",
    "Trace",
    "WallClock",
    "format_step",
    "run",
    "serve",
    "serve_engine",
    "toy_generate",
    "toy_next_token",
    "toy_requests",
]
