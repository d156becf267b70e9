"""ops/multiples.py: the integer ceilings every planner, buffer and packer rounds with."""

import pytest

from logra_megatron.ops.multiples import ceil_div, round_up


@pytest.mark.parametrize("value, divisor, expected", [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (7, 1, 7)])
def test_ceil_div(value, divisor, expected):
    assert ceil_div(value, divisor) == expected


@pytest.mark.parametrize("value, multiple, expected", [(0, 2, 0), (1, 2, 2), (2, 2, 2), (127, 8, 128), (129, 128, 256)])
def test_round_up(value, multiple, expected):
    assert round_up(value, multiple) == expected


def test_exact_beyond_floats():
    big = 2**62 + 1  # float division would round this to 2**62
    assert ceil_div(big, 2) == 2**61 + 1
    assert round_up(big, 2) == 2**62 + 2
