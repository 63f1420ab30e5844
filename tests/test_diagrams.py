"""Every lesson diagram draws one figure with one call (no notebook state needed)."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest

from kvcourse.viz import diagrams

CALLS = {
    "iteration_batch": (),
    "engine_step_loop": (),
    "scheduler_cache_executor": (),
    "block_table": ([7, 1, 4], 10, 4, 10),
    "fragmentation": ({"A": 9, "C": 5, "D": 18}, 4),
    "free_queue_remove": (),
    "block_tables": ([("request A", [0, 1, 2]), ("request B", [0, 1, 3, 4])], 6, "title", "note"),
    "hash_chain": (),
    "eviction_order": (),
    "copy_on_write": (),
    "paged_cache_from_above": ({"A": [3, 8], "B": [0, 5, 10], "C": [6]}, {"A": 7, "B": 10, "C": 3}, 4, 12),
}


@pytest.fixture
def shown(monkeypatch):
    figures = []
    monkeypatch.setattr(plt, "show", lambda: figures.append(plt.gcf()))
    yield figures
    plt.close("all")


@pytest.mark.parametrize("name", CALLS)
def test_each_diagram_shows_one_figure(name, shown):
    assert getattr(diagrams, name)(*CALLS[name]) is None  # shown, not returned: no second copy in the cell
    assert len(shown) == 1 and shown[0].axes


def test_every_public_diagram_is_exercised():
    public = {
        n
        for n, f in vars(diagrams).items()
        if callable(f) and not n.startswith("_") and f.__module__ == diagrams.__name__
    }
    assert public == set(CALLS)


@pytest.mark.parametrize(("tokens", "words"), [(10, "half full"), (11, "partly full"), (12, "all of them full")])
def test_block_table_title_says_how_full_the_last_block_is(tokens, words, shown):
    diagrams.block_table([7, 1, 4], tokens, 4, 10)
    assert words in shown[0].axes[0].get_title()
