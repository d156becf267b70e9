"""Integer ceilings: the counts that round up (microbatches of a batch, rows per rank) and the
widths padded to a multiple (a TP degree under sequence parallelism, a DP degree under ZeRO-1,
a bucket's alignment). One spelling, so ``-(-n // m)`` is read once, here."""


def ceil_div(value: int, divisor: int) -> int:
    """``ceil(value / divisor)`` for integers (``divisor`` > 0), exact at any size."""
    return -(-value // divisor)


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` (> 0) that is at least ``value``."""
    return ceil_div(value, multiple) * multiple
