"""Token-balanced data parallelism: a step's rows spread over the DP replicas so that each
replica's real tokens (prompt + response) are close to the others' (as verl's
``seqlen_balancing``); within a replica the packed passes then bin-pack the rows by token count
(:mod:`~logra_megatron.rl.packing`).

Why the exchange keeps the loss exact: each replica samples its own prompts and computes its
groups' advantages before anything moves (advantages need whole groups), so a row travels with
its advantage. Each optimizer step's minibatch is, over all replicas, the union of every
replica's k-th part (``split_minibatches``); the assignment only moves rows *within* a part and
keeps how many rows of each part every replica holds. So every optimizer step sees the same set
of rows as without balancing, each replica splits its batch into parts of the same sizes, the
global normalizer (tokens or sequences, all-reduced in ``policy_loss_backward``) is the same
count, and the loss and gradient are today's up to the order of float sums. The old, reference
and engine log-probs are per row and are computed (or carried, the engine's) after the exchange.

:func:`assign_rows` is pure (testable without processes); :func:`balance_batch` gathers the rows
over the DP group and keeps this replica's share.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from logra_megatron import parallel
from logra_megatron.rl.minibatches import split_minibatches
from logra_megatron.rollout.types import Rollouts


def assign_rows(lengths: Sequence[int], parts: Sequence[int], counts: Sequence[Sequence[int]]) -> List[List[int]]:
    """Rows (global indices into ``lengths``) for each rank: ``counts[r][k]`` rows of part ``k``
    (``parts[i]`` is row ``i``'s part) go to rank ``r``, so the parts' sizes per rank are kept.
    Within each part, rows longest first, each to the rank with the fewest tokens of that part
    that still has room (ties: fewest tokens over the parts so far, then the lower rank): each
    optimizer step's work is balanced, which also balances the step. Deterministic (every rank
    computes the same answer); each rank's rows come part by part, ascending within a part."""
    ranks = len(counts)
    num_parts = max((len(c) for c in counts), default=0)
    by_part: Dict[int, List[int]] = {}
    for row, part in enumerate(parts):
        by_part.setdefault(int(part), []).append(row)
    for part in range(num_parts):
        wanted = sum(c[part] if part < len(c) else 0 for c in counts)
        if wanted != len(by_part.get(part, [])):
            raise ValueError(f"part {part} has {len(by_part.get(part, []))} rows but the counts ask for {wanted}")
    if set(by_part) - set(range(num_parts)):
        raise ValueError(f"rows of parts {sorted(set(by_part) - set(range(num_parts)))} have no counts")
    total = [0] * ranks
    assigned: List[List[List[int]]] = [[[] for _ in range(num_parts)] for _ in range(ranks)]
    for part in range(num_parts):
        load = [0] * ranks
        room = [counts[r][part] if part < len(counts[r]) else 0 for r in range(ranks)]
        for row in sorted(by_part.get(part, []), key=lambda i: (-int(lengths[i]), i)):
            rank = min((r for r in range(ranks) if room[r] > 0), key=lambda r: (load[r], total[r], r))
            assigned[rank][part].append(row)
            room[rank] -= 1
            load[rank] += int(lengths[row])
            total[rank] += int(lengths[row])
    return [[row for part in per_rank for row in sorted(part)] for per_rank in assigned]


def plan_exchange(lengths: Sequence[Sequence[int]], num_minibatches: int) -> Optional[List[List[Tuple[int, int]]]]:
    """Each rank's rows after balancing, as ``(source rank, source row)``, from every rank's row
    lengths (``lengths[r][i]``: real tokens of rank r's row i); None when the balanced plan is no
    better than the ranks' own rows. Each rank's parts are where ``split_minibatches`` cuts them
    (they depend on its row count only) and it keeps their sizes (:func:`assign_rows`). The
    cost compared is the sum over minibatches of the largest rank's tokens in it: each optimizer
    step waits for its slowest replica (the DP gradient reduction)."""
    sources, parts, counts = [], [], []
    for rank, rows in enumerate(lengths):
        # (host indices: only where split_minibatches cuts this rank's rows is read from them)
        split = split_minibatches(torch.arange(len(rows), device="cpu"), num_minibatches)
        counts.append([len(part) for part in split])
        for part, local in enumerate(split):
            sources.extend((rank, int(i)) for i in local)
            parts.extend([part] * len(local))
    flat = [int(lengths[r][i]) for r, i in sources]
    plan = assign_rows(flat, parts, counts)
    own = [[index for index, (r, _) in enumerate(sources) if r == rank] for rank in range(len(lengths))]

    def cost(assignment):
        return sum(max(sum(flat[i] for i in mine if parts[i] == part) for mine in assignment)
                   for part in range(num_minibatches))

    if cost(plan) >= cost(own):
        return None
    return [[sources[i] for i in mine] for mine in plan]


def token_ratio(loads: Sequence[int]) -> float:
    """max / min of the ranks' token counts (1: balanced; a rank with none counts as 1 token)."""
    return max(loads) / max(1, min(loads))


def _gather(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Every DP rank's ``tensor`` (its first dimension padded to ``rows``), concatenated."""
    flag = tensor.dtype == torch.bool  # masks travel as bytes: not every backend gathers bool
    source = tensor.to(torch.uint8) if flag else tensor
    padded = torch.zeros((rows, *tensor.shape[1:]), dtype=source.dtype, device=tensor.device)
    padded[: tensor.shape[0]] = source
    out = [torch.empty_like(padded) for _ in range(parallel.dp_size())]
    dist.all_gather(out, padded, group=parallel.dp_group())
    joined = torch.cat(out)
    return joined.bool() if flag else joined


def _widen(tensor: torch.Tensor, left: int, right: int, value) -> torch.Tensor:
    """``tensor`` ``[B, S]`` with ``left`` columns before and ``right`` after, filled with ``value``."""
    return torch.nn.functional.pad(tensor, (left, right), value=value) if left or right else tensor


def balance_batch(batch: Rollouts, advantages: torch.Tensor, num_minibatches: int, pad_id: int,
                  enabled: bool = True) -> Tuple[Rollouts, torch.Tensor, Dict[str, float]]:
    """``(batch, advantages, metrics)``: this replica's share of the step's rows after the token
    balancing (unchanged when not ``enabled``, with one replica, when balancing gains nothing, or
    when a replica has fewer rows than ``num_minibatches``, where ``split_minibatches`` repeats a
    row and the parts would not be kept). The rows of every replica are brought to one layout: prompts left-padded to the
    widest prompt, completions right-padded to the widest completion (padding is masked). Metrics:
    ``dp_token_ratio_before`` and ``dp_token_ratio`` (max / min real tokens over the replicas)."""
    if parallel.dp_size() == 1:  # (the keys every step, whatever the layout)
        return batch, advantages, {"dp_token_ratio_before": 1.0, "dp_token_ratio": 1.0}
    device = batch.tokens.device
    rows = batch.num_sequences
    lengths = batch.attention_mask.sum(dim=1)
    # One small gather of the shape of every replica's batch: rows, prompt width, completion
    # columns, generated steps, prompts, whether the engine's log-probs come along.
    shape = torch.tensor([rows, batch.prompt_width, batch.tokens.shape[1] - batch.prompt_width, batch.steps,
                          int(batch.prompt_index.max()) + 1 if rows else 0, int(batch.logprobs is not None)],
                         dtype=torch.long, device=device)
    shapes = [torch.empty_like(shape) for _ in range(parallel.dp_size())]
    dist.all_gather(shapes, shape, group=parallel.dp_group())
    shapes = torch.stack(shapes).tolist()
    most = max(s[0] for s in shapes)
    row_lengths = _gather(lengths, most).tolist()
    loads_before = [sum(row_lengths[r * most: r * most + s[0]]) for r, s in enumerate(shapes)]
    metrics = {"dp_token_ratio_before": token_ratio(loads_before)}
    if not enabled or min(s[0] for s in shapes) < num_minibatches:
        return batch, advantages, {**metrics, "dp_token_ratio": metrics["dp_token_ratio_before"]}

    plan = plan_exchange([row_lengths[r * most: r * most + s[0]] for r, s in enumerate(shapes)], num_minibatches)
    if plan is None:  # nothing to gain: every replica keeps its rows, nothing more moves
        return batch, advantages, {**metrics, "dp_token_ratio": metrics["dp_token_ratio_before"]}
    metrics["dp_token_ratio"] = token_ratio([sum(row_lengths[r * most + i] for r, i in mine) for mine in plan])
    keep = torch.tensor([r * most + i for r, i in plan[parallel.dp_rank()]], dtype=torch.long, device=device)

    width = max(s[1] for s in shapes)
    completion = max(s[2] for s in shapes)
    left, right = width - batch.prompt_width, completion - (batch.tokens.shape[1] - batch.prompt_width)
    # Prompt indices made unique over the step (replica r's prompts after those of replicas < r).
    offset = sum(s[4] for s in shapes[: parallel.dp_rank()])
    fields = {
        "tokens": _widen(batch.tokens, left, right, pad_id),
        "attention_mask": _widen(batch.attention_mask, left, right, False),
        "response_mask": _widen(batch.response_mask, left, right, False),
        "position_ids": _widen(batch.position_ids, left, right, 0),
        "prompt_lengths": batch.prompt_lengths, "response_lengths": batch.response_lengths,
        "finished": batch.finished, "prompt_index": batch.prompt_index + offset,
    }
    gathered = {name: _gather(value, most)[keep] for name, value in fields.items()}
    logprobs = None
    if all(s[5] for s in shapes):
        logprobs = _gather(_widen(batch.logprobs, left, right, 0.0), most)[keep]
    mine = _gather(advantages, most)[keep]
    balanced = Rollouts(**gathered, prompt_width=width, steps=max(s[3] for s in shapes), logprobs=logprobs)
    return balanced, mine, metrics
