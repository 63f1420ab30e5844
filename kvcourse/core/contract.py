"""The scheduler-cache contract: the handle, the protocols, and a mock manager that only counts blocks.

The scheduler decides *which* requests run (policy); a KV-cache manager decides *where* their keys
and values live (mechanism). They talk through the few methods of `KVCacheManagerProtocol` (the one
statement of the contract: the scheduler checks a manager against it with isinstance), so the
scheduler runs unchanged over `MockKVCacheManager` (notebook 02) and the paged `KVCacheManager`
(notebook 03). The engine loop (`kvcourse.engine.llm_engine.EngineCore`) drives any `SchedulerProtocol` with
any `ExecutorProtocol`: the toy model of notebooks 01-04 or GPT-2's `ModelRunner`.

(vLLM's file `vllm/v1/kv_cache_interface.py` is something else: the per-layer KV cache specs, KVCacheSpec.)
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from kvcourse.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvcourse.core.sched_output import SchedulerOutput

T = TypeVar("T")


def _block_id(block: Any) -> int:
    """A block is either a plain int id or an object with a `.block_id` (the real `KVCacheBlock`)."""
    return block if isinstance(block, int) else block.block_id


class KVCacheBlocks:
    """An opaque handle to some blocks, handed from the manager to the scheduler and the executor."""

    __slots__ = ("blocks",)

    def __init__(self, blocks: Iterable[Any] = ()) -> None:
        """Wrap the blocks (ints or KVCacheBlock objects) in a fixed tuple, so holders cannot edit them."""
        self.blocks: tuple[Any, ...] = tuple(blocks)

    @classmethod
    def empty(cls) -> KVCacheBlocks:
        """The handle for 'no blocks' (for example, no prefix-cache hit)."""
        return cls(())

    def get_block_ids(self) -> list[int]:
        """Physical block ids, in logical order: all the executor needs to find the memory."""
        return [_block_id(block) for block in self.blocks]

    def __len__(self) -> int:
        """Number of blocks (an empty handle is falsy)."""
        return len(self.blocks)

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        """Concatenate two handles (cached prefix blocks + newly allocated ones)."""
        if not isinstance(other, KVCacheBlocks):
            return NotImplemented
        return KVCacheBlocks(self.blocks + other.blocks)

    def __eq__(self, other: object) -> bool:
        """Two handles are equal when they name the same blocks in the same order."""
        return isinstance(other, KVCacheBlocks) and self.get_block_ids() == other.get_block_ids()

    def __repr__(self) -> str:
        """Show the ids only: what a reader of a trace needs."""
        return f"KVCacheBlocks({self.get_block_ids()})"


@runtime_checkable
class KVCacheManagerProtocol(Protocol):
    """What any KV-cache manager offers the scheduler (the mock and the paged manager both do)."""

    num_blocks: int
    block_size: int

    def get_num_free_blocks(self) -> int:
        """How many blocks could be handed out right now."""
        ...

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Whether `allocate_slots(request, num_new_tokens)` would succeed now, changing nothing.

        The source lesson's optional question. The scheduler does not ask it: it calls allocate_slots,
        which answers the same question and takes the blocks in one go (None: too few), as vLLM v1's does.
        """
        ...

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
    ) -> KVCacheBlocks | None:
        """Make room for num_computed + num_new_computed + num_new tokens, all or nothing."""
        ...

    def free(self, request: Request) -> None:
        """Give all of a request's blocks back (a no-op for an unknown request)."""
        ...

    def get_block_ids(self, request: Request) -> list[int]:
        """The request's block table ([] for an unknown request)."""
        ...

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Prefix-cache hits for a waiting request: the blocks and how many tokens they hold."""
        ...

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write (src, dst) block pairs planned since the last call (the step's blocks_to_copy)."""
        ...

    def forget_unwritten_blocks(self) -> None:
        """After a failed step: no prefix hit may read a block whose K/V that step never wrote."""
        ...

    @property
    def usage(self) -> float:
        """Fraction of all blocks in use."""
        ...


class ScheduledSequenceProtocol(Protocol):
    """One request's share of a step, as the scheduler hands it to the executor."""

    request_id: int
    tokens: list[int]
    is_decode: bool
    position_ids_start: int
    samples_token: bool  # the executor samples one token for this sequence (every decode; a prompt's last chunk)


class SchedulerProtocol(Protocol):
    """What the engine loop needs from a scheduler (the memory-aware one, and notebook 01's blind one).

    Contract of `schedule_next_batch`: every sequence it returns belongs to a RUNNING request (never
    one it preempted while planning the same step), and its tokens have memory.
    """

    kv_cache_manager: KVCacheManagerProtocol | None  # None: a scheduler that knows nothing about memory
    waiting_queue: Iterable[Request]
    active_pool: dict[int, Request]  # the running requests, in admission order
    finished: list[Request]  # every settled request (finished, aborted, failed), in order
    rejected: list[Request]
    num_preemptions: int

    def add_request(self, request: Request) -> None:
        """Queue a request (or settle it at once: rejected, or nothing to generate)."""
        ...

    def schedule_next_batch(self) -> SchedulerOutput:
        """Plan one step: the sequences to run, each with memory secured."""
        ...

    def update_from_output(self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[int, int]) -> list[Request]:
        """Append the sampled tokens; return the requests this update finished."""
        ...

    def has_unfinished_requests(self) -> bool:
        """Whether anything is waiting or running."""
        ...

    def finish_requests(
        self, request_ids: int | Iterable[int], status: RequestStatus, reason: str | None = None
    ) -> list[Request]:
        """End requests now (abort, failure): their blocks go back at once; settled ones are left alone."""
        ...


class ExecutorProtocol(Protocol):
    """Runs a batch: writes its tokens' K/V and samples one token where a sequence asks for it."""

    def execute(self, scheduler_output: SchedulerOutput) -> dict[int, int]:
        """Apply the plan's block copies, run its sequences; {request id: sampled token} where samples_token."""
        ...


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """ceil(num_tokens / block_size): the blocks that hold num_tokens tokens (a partial block counts).

    The course's one ceiling division (vLLM's `cdiv`): every block count goes through it.
    """
    return -(-num_tokens // block_size)


def protocol_members(protocol: type) -> list[str]:
    """The names a Protocol asks for, in the order it states them (attributes, then methods)."""
    return list(dict.fromkeys(n for n in [*protocol.__annotations__, *vars(protocol)] if not n.startswith("_")))


def describe_protocol(protocol: type) -> str:
    """The contract in words, straight from the Protocol: each member, its signature and its one-line docstring."""
    lines = [f"{protocol.__name__}: {inspect.getdoc(protocol).splitlines()[0]}"]
    for name in protocol_members(protocol):
        member = vars(protocol).get(name)
        if member is None:  # an attribute
            lines.append(f"  {name}: {protocol.__annotations__[name]}".replace("'", ""))
            continue
        function = member.fget if isinstance(member, property) else member
        signature = str(inspect.signature(function)).replace("(self, ", "(").replace("(self)", "()").replace("'", "")
        lines.append(f"  {name}{'' if isinstance(member, property) else signature}")
        lines.append(f"      {inspect.getdoc(function).splitlines()[0]}")
    return "\n".join(lines)


def check_implements(obj: T, protocol: type, name: str) -> T:
    """`obj` if isinstance(obj, protocol) (a runtime-checkable Protocol), else a TypeError naming what it lacks."""
    if isinstance(obj, protocol):
        return obj
    missing = [n for n in protocol_members(protocol) if not hasattr(obj, n)]
    raise TypeError(
        f"{name} {obj!r} lacks {', '.join(missing)} of {protocol.__name__}: pass a MockKVCacheManager or a "
        "KVCacheManager."
    )


def _is_whole_number(value: object) -> bool:
    """An int (numpy and torch integers too), not a bool, a float or anything else."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_token_count(name: str, value: int) -> None:
    """Token counts come from the scheduler's arithmetic; a negative or fractional one is a bug to report early."""
    if not _is_whole_number(value) or value < 0:
        raise ValueError(f"{name} is {value!r}; a token count must be a whole number, 0 or more.")


def check_cache_shape(num_blocks: int, block_size: int) -> None:
    """A cache needs at least one block of at least one token; say which number is wrong."""
    if not _is_whole_number(num_blocks) or num_blocks <= 0:
        raise ValueError(f"num_blocks is {num_blocks!r}; the cache needs a whole number of blocks, at least one.")
    if not _is_whole_number(block_size) or block_size <= 0:
        raise ValueError(f"block_size is {block_size!r}; a block holds a whole number of tokens, at least one.")


class MockKVCacheManager:
    """A KV-cache manager that hands out fake consecutive block ids and counts them exactly."""

    def __init__(self, num_blocks: int, block_size: int, verbose: bool = False) -> None:
        """An empty cache of num_blocks blocks; verbose prints each allocation and free."""
        check_cache_shape(num_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.verbose = verbose
        self.req_to_blocks: dict[int, list[int]] = {}
        self._num_free = num_blocks
        self._next_id = 0

    def get_num_free_blocks(self) -> int:
        """Blocks not held by any request."""
        return self._num_free

    @property
    def usage(self) -> float:
        """Fraction of all blocks in use (0.0 empty, 1.0 full)."""
        return 1.0 - self._num_free / self.num_blocks

    def get_block_ids(self, request: Request) -> list[int]:
        """The request's block table (a copy, so the caller cannot corrupt it)."""
        return list(self.req_to_blocks.get(request.id, []))

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The mock caches no prefixes: never a hit."""
        return KVCacheBlocks.empty(), 0

    def num_blocks_to_allocate(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0) -> int:
        """Exact count: ceil(tokens after this step / block_size) minus the blocks already held."""
        check_token_count("num_new_tokens", num_new_tokens)
        check_token_count("num_new_computed_tokens", num_new_computed_tokens)
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        held = len(self.req_to_blocks.get(request.id, []))
        return max(0, blocks_needed(total, self.block_size) - held)

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Whether enough blocks are free for the request's next num_new_tokens tokens."""
        return self.num_blocks_to_allocate(request, num_new_tokens) <= self._num_free

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
    ) -> KVCacheBlocks | None:
        """Take the blocks the step needs, all or nothing; None (and no change) when too few are free."""
        if new_computed_blocks:
            raise ValueError(
                "MockKVCacheManager caches no prefixes, so it never hands out computed blocks; "
                "pass the (empty) blocks from its own get_computed_blocks()."
            )
        needed = self.num_blocks_to_allocate(request, num_new_tokens, num_new_computed_tokens)
        if needed > self._num_free:
            self._log(f"Cannot allocate {needed} blocks for Req {request.id}. Free blocks: {self._num_free}")
            return None
        table = self.req_to_blocks.setdefault(request.id, [])
        new_ids = list(range(self._next_id, self._next_id + needed))
        self._next_id += needed
        table.extend(new_ids)
        self._num_free -= needed
        if needed:
            self._log(f"Allocated {needed} blocks for Req {request.id}. Free blocks: {self._num_free}")
        return KVCacheBlocks(new_ids)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The mock never shares a block, so there is nothing to copy."""
        return []

    def forget_unwritten_blocks(self) -> None:
        """The mock caches no prefixes: nothing to forget."""

    def forget_unwritten_tail(self, request: Request, num_valid_tokens: int) -> None:
        """The mock publishes nothing, so a short load from a second tier leaves nothing to unpublish."""

    def free(self, request: Request) -> None:
        """Give the request's blocks back; freeing an unknown (or already freed) request does nothing."""
        table = self.req_to_blocks.pop(request.id, None)
        if table is None:
            return
        self._num_free += len(table)
        self._log(f"Freed {len(table)} blocks from Req {request.id}. Free blocks: {self._num_free}")

    def _log(self, message: str) -> None:
        """The source lesson's trace lines, printed only when asked for."""
        if self.verbose:
            print(f"    [Cache] {message}")

    def __repr__(self) -> str:
        """Sizes and free count, no addresses (stable in notebooks)."""
        return f"MockKVCacheManager(num_blocks={self.num_blocks}, block_size={self.block_size}, free={self._num_free})"


__all__ = [
    "ExecutorProtocol",
    "KVCacheBlocks",
    "KVCacheManagerProtocol",
    "MockKVCacheManager",
    "ScheduledSequenceProtocol",
    "SchedulerProtocol",
    "blocks_needed",
]
