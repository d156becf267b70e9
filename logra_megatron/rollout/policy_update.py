"""The policy update in low-rank form, as a rollout engine with its own weights receives it
(``--policy-sync lowrank``; the engine side is logra_megatron/rollout/vllm_worker.py).

Between two projection refreshes every committed LoGRA step changed each sketched weight by
``W <- (1 - step wd) W - step dW``, ``dW = U Q^T`` (right sketch: column-parallel linears and
the embedding) or ``P U`` (left sketch: row-parallel linears), with the projection ``Q`` or
``P`` fixed. An engine that holds the weights of the last full sync and the projections
therefore follows the trainer from the steps' ``U`` alone (``m x r`` or ``r x n`` per weight)
and two scalars; the parameters outside the sketch (norms, biases, an unsketched embedding)
travel as tensors. This module turns the optimizer's commit log
(logra_megatron/logra/commit_log.py) into that message, in the names and row order of the
Hugging Face checkpoint the engine was built from:

- each ``U`` is gathered over tensor parallelism like its weight (rows of a column-parallel
  weight, columns of a row-parallel one; SwiGLU halves per rank) and over pipeline stages;
- a right sketch's ``U`` has the weight's rows, so the converter's row mapping
  (:func:`~logra_megatron.convert.hf.hf_tensors`) splits it exactly as the weight: the rows of
  ``linear_qkv`` into q/k/v, ``linear_fc1`` into gate/up, the vocabulary padding dropped. The
  projection ``Q`` acts on the input dimension, which no mapping permutes, so every piece keeps
  the weight's ``Q``. A left sketch's ``P`` acts on the output rows of ``linear_proj`` and
  ``linear_fc2``, which the mapping only renames.

Collective over the replica's TP and PP groups; the assembled message exists on the replica's
first rank only (the engine's).
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from logra_megatron import parallel
from logra_megatron.convert.hf import hf_tensors
from logra_megatron.logra.sketch import RIGHT
from logra_megatron.models.build import unwrap_model
from logra_megatron.models.config import ModelConfig
from logra_megatron.models.weights import full_state, gather_full, merge_stages

EMBEDDING_HF = "model.embed_tokens.weight"
OUTPUT_HF = "lm_head.weight"


@dataclass
class Routes:
    """How the engine applies a factor: which projection it multiplies and which of the engine's
    tensors it updates (the embedding's ``U`` also updates an untied output layer that
    stands for a tied one)."""

    projection_of: Dict[str, str] = field(default_factory=dict)
    """HF factor name -> Megatron name of its projection."""
    targets: Dict[str, List[str]] = field(default_factory=dict)
    """HF factor name -> the engine tensors it updates."""


@dataclass
class LowRankStep:
    step: float
    weight_decay: float
    factors: Dict[str, torch.Tensor]
    """HF name -> the piece of ``U`` for that tensor."""


@dataclass
class LowRankMessage:
    """What one low-rank sync sends: the steps since the last sync and the dense remainder."""

    steps: List[LowRankStep]
    dense: Dict[str, torch.Tensor]

    def nbytes(self) -> int:
        """Bytes of the tensors, plus 16 per step for its two scalars."""
        tensors = [t for s in self.steps for t in s.factors.values()] + list(self.dense.values())
        return sum(t.numel() * t.element_size() for t in tensors) + 16 * len(self.steps)


def _entries(optimizer) -> list:
    """The sketched weights that carry their own update (not a tied embedding's pipeline copy)."""
    return [entry for entry in optimizer.weights if not entry.pipeline_copy]


def projections(optimizer, engine_dtype: torch.dtype) -> Dict[str, Tuple[str, torch.Tensor]]:
    """Megatron name -> (side, projection) of every sketched weight, in the engine's dtype
    (collective over PP; TP ranks hold the same projections)."""
    return merge_stages({entry.name: (entry.sketch.side, entry.sketch.projection.to(engine_dtype))
                          for entry in _entries(optimizer)})


def routes(optimizer, model: ModelConfig, untied_output: bool) -> Routes:
    """The :class:`Routes` of every sketched weight of ``model`` (collective over PP).
    ``untied_output``: the engine has an output layer of its own for a tied embedding."""
    rows = merge_stages({entry.name: entry.weight.shape[0] * (parallel.tp_size() if entry.sketch.side == RIGHT else 1)
                          for entry in _entries(optimizer)})
    found = Routes()
    for name, count in rows.items():
        # Only the names are used: a meta tensor of the right shape holds no memory anywhere.
        for hf_name in hf_tensors(name, torch.zeros(count, 1, device="meta"), model):
            found.projection_of[hf_name] = name
            found.targets[hf_name] = [hf_name]
            if hf_name == EMBEDDING_HF and model.tie_embeddings and untied_output:
                found.targets[hf_name].append(OUTPUT_HF)
    return found


def low_rank_message(ddp_model, optimizer, commits, model: ModelConfig,
                     engine_dtype: torch.dtype) -> Optional[LowRankMessage]:
    """The :class:`LowRankMessage` replaying ``commits`` (the optimizer's commit log since the
    last sync), on the engine's rank (None elsewhere). Collective over TP and PP."""
    entries = _entries(optimizer)
    steps = []
    for commit in commits:
        mine = {}
        for entry in entries:
            mine[entry.name] = gather_full(entry.view(commit.update), entry.weight, entry.name)
        merged = merge_stages(mine)
        factors = {}
        if parallel.is_replica_lead():
            for name, factor in merged.items():
                for hf_name, piece in hf_tensors(name, factor, model).items():
                    factors[hf_name] = piece.to(engine_dtype).contiguous()
        steps.append(LowRankStep(commit.step, commit.weight_decay, factors))
    sketched = {id(entry.weight) for entry in optimizer.weights}
    dense_state = full_state(unwrap_model(ddp_model), include=lambda param: id(param) not in sketched)
    if not parallel.is_replica_lead():
        return None
    dense = {}
    for name, tensor in dense_state.items():
        for hf_name, piece in hf_tensors(name, tensor, model).items():
            dense[hf_name] = piece.to(engine_dtype).contiguous()
    return LowRankMessage(steps, dense)


@torch.no_grad()
def replay(weights: Dict[str, torch.Tensor], projections_by_name: Dict[str, tuple], found: Routes,
           message: LowRankMessage) -> None:
    """Apply ``message`` to ``weights`` (fp32, HF names, updated in place): per step and factor,
    ``W <- (1 - step wd) W - step (U Q^T)`` (right) or ``- step (P U)`` (left), the operations
    and order of the trainer's optimizer (logra_megatron/logra/masters.py); then the dense
    tensors are copied in. What the engine's worker runs (logra_megatron/rollout/vllm_worker.py)."""
    for step in message.steps:
        for name, factor in step.factors.items():
            side, projection = projections_by_name[found.projection_of[name]]
            factor, projection = factor.float(), projection.float()
            for target in found.targets[name]:
                weight = weights[target]
                if step.weight_decay:
                    weight.mul_(1.0 - step.step * step.weight_decay)
                if side == RIGHT:
                    weight.addmm_(factor, projection.t(), alpha=-step.step)
                else:
                    weight.addmm_(projection, factor, alpha=-step.step)
    for name, tensor in message.dense.items():
        weights[name].copy_(tensor)


def replayable(commits, optimizer) -> Tuple[bool, str]:
    """(whether ``commits`` can be replayed onto the engine's weights, why not). Agreed on every
    rank: the log and the optimizer are the same everywhere."""
    if commits is None:
        return False, "the commit log is incomplete"
    if optimizer.redraws_projections:
        return False, "the projections are redrawn every step"
    if any(commit.refresh for commit in commits):
        return False, "the projections were refreshed"
    return True, ""

