"""bench.host's CPU accounting: this process's tree from /proc, and ticks between two readings."""

from __future__ import annotations

import os

from bench.host import cpu_ticks, ticks_between, tree_ticks


def test_tree_ticks_holds_this_process_and_ticks_never_go_back() -> None:
    assert os.getpid() in tree_ticks()
    busy, total, steal = cpu_ticks()
    assert 0 <= busy <= total and steal >= 0
    # a process that ended counts nothing; one that appeared counts all its ticks
    assert ticks_between({1: 50, 2: 10}, {1: 70, 3: 5}) == 25
    assert ticks_between({1: 50}, {1: 40}) == 0
