"""tests.same_output's rule for alternatives: near-ties may swap places, nothing else may."""

from __future__ import annotations

import pytest

from tests.same_output import assert_same_alternatives

EXPECTED = ((460, -0.17473), (2, -3.51099), (382, -3.51104))


@pytest.mark.parametrize(
    "actual",
    [
        EXPECTED,
        ((460, -0.17473), (382, -3.51096), (2, -3.51104)),  # a tie swapped (seen on an AVX-512 CPU)
        ((460, -0.17473), (2, -3.51099), (17, -3.51100)),  # a tie at the cut: 17 was just outside
    ],
)
def test_ties_may_swap(actual):
    assert_same_alternatives(actual, EXPECTED)


@pytest.mark.parametrize(
    ("actual", "error"),
    [
        (((2, -0.17473), (460, -3.51099), (382, -3.51104)), "token 2 not tied"),
        (((460, -0.17473), (2, -3.51099), (17, -3.2)), "rank 2"),
        (((460, -0.17473), (17, -3.2), (2, -3.51104)), "rank 1"),  # far more likely than listed
        (((460, -0.17473), (2, -3.51099)), "2 alternatives, expected 3"),
    ],
)
def test_anything_else_fails(actual, error):
    with pytest.raises(AssertionError, match=error):
        assert_same_alternatives(actual, EXPECTED)
