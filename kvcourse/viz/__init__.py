"""Pictures: the block-table widget, plots of a run, and the lesson diagrams (one call per cell)."""

from kvcourse.viz.plots import memory_meter, plot_memory, plot_timeline

__all__ = ["memory_meter", "plot_memory", "plot_timeline"]
