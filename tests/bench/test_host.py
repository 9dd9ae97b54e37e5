"""bench.host: this process tree's CPU ticks from /proc, ticks between two readings, interleaved medians."""

from __future__ import annotations

import os

from bench.host import cpu_ticks, medians, ticks_between, tree_ticks


def test_tree_ticks_holds_this_process_and_ticks_never_go_back() -> None:
    assert os.getpid() in tree_ticks()
    busy, total, steal = cpu_ticks()
    assert 0 <= busy <= total and steal >= 0
    # a process that ended counts nothing; one that appeared counts all its ticks
    assert ticks_between({1: 50, 2: 10}, {1: 70, 3: 5}) == 25
    assert ticks_between({1: 50}, {1: 40}) == 0


def test_medians_drop_the_warm_up_and_rotate_which_kind_goes_first() -> None:
    calls: list[tuple[str, int]] = []

    def once(kind: str, rep: int) -> float:
        calls.append((kind, rep))
        return {"a": 10.0, "b": 20.0}[kind] + rep  # the warm-up (rep 0) is the fastest: dropped all the same

    assert medians(["a", "b"], 3, once) == {"a": 12.0, "b": 22.0}  # medians of reps 1-3
    assert [kind for kind, _ in calls] == ["a", "b", "b", "a", "a", "b", "b", "a"]
