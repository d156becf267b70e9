"""Token-budget microbatches for packed sequences: a batch's rows bin-packed by token count.

:func:`token_bins` is first-fit decreasing: rows by real token count, longest first, each into
the first microbatch with room under the budget (a row longer than the budget alone in one). Every
row lands in exactly one microbatch; the result depends only on the lengths and the budget (ties
by row index), so every rank of a model replica plans the same microbatches. Torch-free (the
planner shares it).
"""

from typing import List, Sequence


def token_bins(lengths: Sequence[int], budget: int) -> List[List[int]]:
    """Row indices grouped into microbatches of at most ``budget`` real tokens each (a longer row
    alone), each group in ascending row order, groups in the order they were opened."""
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    order = sorted(range(len(lengths)), key=lambda row: (-int(lengths[row]), row))
    bins, room = [], []
    for row in order:
        size = int(lengths[row])
        for index, left in enumerate(room):
            if size <= left:
                bins[index].append(row)
                room[index] -= size
                break
        else:
            bins.append([row])
            room.append(budget - size)
    return [sorted(rows) for rows in bins]


def default_token_budget(micro_batch_size: int, columns: int) -> int:
    """The budget when ``--max-tokens-per-microbatch`` is 0: as many tokens as a padded microbatch
    holds (``micro_batch_size`` rows of ``columns``), so a packed microbatch never needs more
    activation memory than the padded one it replaces."""
    return max(1, micro_batch_size * columns)
