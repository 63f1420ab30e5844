"""answer() takes an option as the notebook prints it; the allocator study's verdict follows the pointer reads."""

from __future__ import annotations

import pytest

from kvcourse.bench import allocator
from kvcourse.course.questions import get_question, normalize
from tests.reference import load_reference


@pytest.mark.parametrize("given", ["b", "B", "(b)", "b)", " (b) ", "[b]", "b.", "(b) only the stack's"])
def test_an_option_as_printed_is_accepted(given):
    assert normalize(get_question("3.b"), given) == "b", f"{given!r} names option b"


@pytest.mark.parametrize("given", ["(e)", "bb", "only b", ""])
def test_anything_else_is_refused_in_words(given):
    with pytest.raises(ValueError, match="takes one of"):
        normalize(get_question("3.b"), given)


def test_the_reference_queue_reads_a_handful_of_pointers():
    reads = allocator.pointer_reads(load_reference("kv_cache"))
    assert set(reads) == {"popleft", "append", "remove"}, "every queue operation is probed"
    assert max(reads.values()) <= allocator.MAX_POINTER_READS, f"the reference queue is O(1): {reads}"


def test_a_walking_queue_does_not_meet_the_goal():
    kv = load_reference("kv_cache")

    class WalkingQueue(kv.FreeKVCacheBlockQueue):
        def append(self, block):
            last = self.fake_head
            while last.next_free_block is not self.fake_tail:
                last = last.next_free_block
            last.next_free_block, block.prev_free_block = block, last
            block.next_free_block, self.fake_tail.prev_free_block = self.fake_tail, block
            self.num_free_blocks += 1

    module = type("Module", (), {"KVCacheBlock": kv.KVCacheBlock, "FreeKVCacheBlockQueue": WalkingQueue})
    reads = allocator.pointer_reads(module)
    assert reads["append"] > allocator.MAX_POINTER_READS, "a walking append reads about one pointer per block"
    result = {
        "device": "cpu", "allocator": "a walking queue", "quick": True, "pointer_reads": reads, "meets_goal": False,
        **{key: {"1000": 1.0} for key in ("per_block_us", "stack_per_block_us", "naive_per_block_us",
                                         "hit_linked_us", "hit_stack_us")},
        **dict.fromkeys(("ratio", "stack_ratio", "naive_ratio", "hit_linked_ratio", "hit_stack_ratio"), 1.0),
    }  # fmt: skip
    text = allocator.report(result)
    assert "does not meet the goal" in text and "append walks the list" in text, text
    assert "meets the goal:" not in text.replace("does not meet the goal", ""), "one verdict only"
