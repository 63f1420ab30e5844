"""What the grader reads from a child: bounded, depth-checked, schema-checked (no root, no child needed)."""

from __future__ import annotations

import json
import os
import time

from kvcourse.course import boundary

LIMITS = boundary.Limits()
SEEDS = {"0.1": [0, 1]}


def test_deep_long_huge_or_odd_lines_are_dropped_not_raised():
    assert boundary.parse_record(b"[" * 100_000 + b"]" * 100_000, LIMITS) is None
    assert boundary.parse_record(b'{"a": ' + b"[" * 70 + b"]" * 70 + b"}", LIMITS) is None
    assert boundary.parse_record(b'{"a": "' + b"[" * 100 + b'"}', LIMITS) == {"a": "[" * 100}, "brackets in a string"
    assert boundary.parse_record(b'{"v": ' + b"9" * 10_000 + b"}", LIMITS) is None, "a huge integer"
    assert boundary.parse_record(b"x" * (LIMITS.line_bytes + 1), LIMITS) is None
    assert boundary.parse_record(b"[1, 2]", LIMITS) is None and boundary.parse_record(b"\xff\xfe", LIMITS) is None
    assert boundary.parse_record(b'{"v": NaN}', LIMITS) == {"v": "NaN"}, "no float trick survives"


def test_only_records_of_the_asked_exercises_and_seeds_with_plain_observations_count():
    good = {"exercise": "0.1", "seed": 1, "observations": [{"value": 3}]}
    assert boundary.valid(good, SEEDS) and boundary.valid({"exercise": "0.1", "seed": 0, "error": "E"}, SEEDS)
    for bad in [
        {**good, "exercise": "0.2"},
        {**good, "seed": 7},
        {**good, "seed": True},
        {**good, "observations": {"value": 3}},
        {**good, "observations": [3]},
        {**good, "error": "both"},
        {"exercise": "0.1", "seed": 0, "passed": True},
    ]:
        assert not boundary.valid(bad, SEEDS), bad


def test_a_flood_a_lie_and_an_early_end_cost_only_what_was_not_reported():
    read, write = os.pipe()
    lines = [
        {"start": "0.1"},
        {"exercise": "0.1", "seed": 0, "observations": [{"value": 1}]},
        {"exercise": "0.1", "seed": 0, "observations": [{"value": 2}]},  # a second record: the first counts
        {"exercise": "9.9", "seed": 0, "observations": []},
        {"score": 33.0},
    ]
    os.write(write, b"".join(json.dumps(x).encode() + b"\n" for x in lines) + b"[" * 1000 + b"\n")
    os.close(write)
    report = boundary.read_child(read, SEEDS, LIMITS, deadline=time.monotonic() + 60)
    os.close(read)
    assert list(report.records) == [("0.1", 0)] and report.records[("0.1", 0)]["observations"] == [{"value": 1}]
    assert report.started == ["0.1"] and "stopped before reporting" in report.ending
    read, write = os.pipe()
    os.write(write, b"x" * 65536)
    os.close(write)
    small = boundary.Limits(report_bytes=1 << 10)
    assert "more than" in boundary.read_child(read, SEEDS, small, deadline=time.monotonic() + 60).ending
    os.close(read)
