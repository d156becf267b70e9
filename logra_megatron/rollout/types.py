"""Plain data shared by every rollout engine: how to sample (:class:`SamplingConfig`) and what
comes back (:class:`Rollouts`). No process groups, no model."""

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from logra_megatron.errors import UserError
from logra_megatron.schema import option


@dataclass(frozen=True)
class SamplingConfig:
    """How completions are sampled. Validated on construction (:class:`UserError`). The fields
    without a flag are filled by the caller from the tokenizer and the step."""

    temperature: float = option(1.0, help="softmax temperature of sampling; 0 means greedy (argmax; "
                                "top-k, top-p and seed are then unused)")
    top_p: float = option(1.0, help="nucleus sampling: keep the most probable tokens up to this total "
                          "probability, in (0, 1]; 1 keeps all")
    top_k: int = option(0, help="keep only the k most probable tokens; 0 keeps all")
    max_new_tokens: int = option(6, help="most tokens generated per completion (EOS included); the "
                                 "default fits the embedded arithmetic task")
    samples_per_prompt: int = 1
    """G: sampled completions per prompt; ``generate`` returns len(prompts) * G rows."""
    eos_id: Optional[int] = None
    """End-of-sequence token: a row stops after emitting it (it is part of the completion).
    None: rows only stop at ``max_new_tokens``."""
    pad_id: int = 0
    """Token written into padding positions (left of short prompts, right of finished
    completions); it is masked out wherever it appears, so any valid id works."""
    seed: int = 0
    """Seed of the sampling generator: the same seed, prompts and weights give the same tokens."""
    vocab_size: Optional[int] = None
    """Real vocabulary size. Megatron pads the output layer to a multiple of 128 x TP; logits at
    or beyond this index are never sampled. None: every output logit is a candidate."""

    def __post_init__(self):
        def integer(name, minimum):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise UserError(f"sampling {name} must be an integer, got {value!r}")
            if value < minimum:
                raise UserError(f"sampling {name} must be >= {minimum}, got {value}")

        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise UserError(
                f"sampling temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not (0.0 < self.top_p <= 1.0):
            raise UserError(f"sampling top_p must be in (0, 1] (1 = no nucleus filter), got {self.top_p!r}")
        integer("top_k", 0)
        integer("max_new_tokens", 1)
        integer("samples_per_prompt", 1)
        integer("pad_id", 0)
        integer("seed", 0)
        if self.eos_id is not None:
            integer("eos_id", 0)
        if self.vocab_size is not None:
            integer("vocab_size", 1)
            for name in ("eos_id", "pad_id"):
                value = getattr(self, name)
                if value is not None and value >= self.vocab_size:
                    raise UserError(f"sampling {name} {value} is outside the vocabulary of size {self.vocab_size}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Rollouts:
    """``len(prompts) * G`` sequences, as one left-padded batch (see the module docstring).

    Row ``b`` is sample ``b % G`` of prompt ``prompt_index[b] = b // G``. Every tensor is on the
    model's device and identical on every rank of the model replica.
    """

    tokens: torch.Tensor
    """[B, P + max_new_tokens] int64: left-padded prompt in columns < P, completion from column P,
    right-padded with ``pad_id`` after EOS / the last generated token."""
    attention_mask: torch.Tensor
    """[B, P + max_new_tokens] bool: True at real tokens (prompt and completion, EOS included)."""
    response_mask: torch.Tensor
    """[B, P + max_new_tokens] bool: True at completion tokens (EOS included)."""
    position_ids: torch.Tensor
    """[B, P + max_new_tokens] int64: each token's position within its own sequence (0 at the
    first real prompt token), as used for sampling; 0 at left padding."""
    prompt_lengths: torch.Tensor
    """[B] int64: real prompt tokens per row."""
    response_lengths: torch.Tensor
    """[B] int64: completion tokens per row (EOS included)."""
    finished: torch.Tensor
    """[B] bool: the completion ended with EOS (False: cut at max_new_tokens)."""
    prompt_index: torch.Tensor
    """[B] int64: which prompt each row samples."""
    prompt_width: int
    """P: the longest prompt; completions start at this column."""
    steps: int
    """Tokens generated per row before the loop ended (<= max_new_tokens)."""
    logprobs: Optional[torch.Tensor] = None
    """[B, P + max_new_tokens] float32 or None: the engine's own log-prob of each sampled token
    at its column (0 elsewhere), for engines that compute them (the trainer compares them with
    its own); None when the engine does not."""

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    @property
    def completion_tokens(self) -> torch.Tensor:
        """[B, max_new_tokens]: the completion columns (EOS included, then ``pad_id``)."""
        return self.tokens[:, self.prompt_width:]

    @property
    def completion_mask(self) -> torch.Tensor:
        """[B, max_new_tokens] bool: ``response_mask`` over the completion columns."""
        return self.response_mask[:, self.prompt_width:]

    def prompt(self, row: int) -> List[int]:
        """Row ``row``'s prompt tokens, without padding."""
        return self.tokens[row, self.prompt_width - int(self.prompt_lengths[row]):self.prompt_width].tolist()

    def completion(self, row: int) -> List[int]:
        """Row ``row``'s completion tokens (EOS included), without padding."""
        return self.tokens[row, self.prompt_width:self.prompt_width + int(self.response_lengths[row])].tolist()

    def completions(self) -> List[List[int]]:
        """Every row's completion tokens. Decoding them is host work: one copy of the batch to the
        host, not two device syncs per row."""
        tokens, lengths = self.tokens.cpu(), self.response_lengths.tolist()
        start = self.prompt_width
        return [tokens[row, start:start + lengths[row]].tolist() for row in range(self.num_sequences)]

    def select(self, rows: torch.Tensor) -> "Rollouts":
        """The rows ``rows`` (an index tensor) as a batch of their own, same columns."""
        per_row = {name: getattr(self, name)[rows] for name in (
            "tokens", "attention_mask", "response_mask", "position_ids", "prompt_lengths",
            "response_lengths", "finished", "prompt_index")}
        logprobs = None if self.logprobs is None else self.logprobs[rows]
        return Rollouts(**per_row, prompt_width=self.prompt_width, steps=self.steps, logprobs=logprobs)


@dataclass(frozen=True)
class PromptLayout:
    """The left-padded layout every engine fills: ``G`` rows per prompt (row ``b`` samples prompt
    ``b // G``), each prompt ending at column ``width`` (the longest prompt), completions from
    there up to ``width + max_new_tokens``. Built by :meth:`of`; :meth:`rollouts` turns the
    filled ``tokens`` into the :class:`Rollouts` batch."""

    tokens: torch.Tensor
    """[B, width + max_new_tokens] int64: prompts placed, ``pad_id`` elsewhere (engines write
    the completions into it)."""
    lengths: torch.Tensor
    """[B] int64: real prompt tokens per row."""
    width: int
    prompt_index: torch.Tensor
    """[B] int64: which prompt each row samples."""

    @staticmethod
    def of(prompts: Sequence[Sequence[int]], samples_per_prompt: int, max_new_tokens: int, pad_id: int,
           device=None) -> "PromptLayout":
        rows = [list(prompt) for prompt in prompts for _ in range(samples_per_prompt)]
        lengths = torch.tensor([len(row) for row in rows], dtype=torch.int64, device=device)
        width = int(lengths.max())
        tokens = torch.full((len(rows), width + max_new_tokens), pad_id, dtype=torch.int64, device=device)
        for b, row in enumerate(rows):
            tokens[b, width - len(row):width] = torch.tensor(row, dtype=torch.int64, device=device)
        prompt_index = torch.arange(len(prompts), device=device).repeat_interleave(samples_per_prompt)
        return PromptLayout(tokens=tokens, lengths=lengths, width=width, prompt_index=prompt_index)

    @property
    def columns(self) -> torch.Tensor:
        return torch.arange(self.tokens.shape[1], device=self.tokens.device)

    @property
    def real(self) -> torch.Tensor:
        """[B, total] bool: columns from each row's first prompt token on (completion columns
        count as real)."""
        return self.columns[None, :] >= (self.width - self.lengths)[:, None]

    @property
    def positions(self) -> torch.Tensor:
        """[B, total] int64: each column's position within its row's sequence (0 at padding)."""
        return (self.columns[None, :] - (self.width - self.lengths)[:, None]).clamp(min=0)

    def rollouts(self, response_lengths: torch.Tensor, finished: torch.Tensor, steps: int,
                 logprobs: Optional[torch.Tensor] = None) -> Rollouts:
        """The batch once ``tokens`` holds the completions of ``response_lengths`` tokens."""
        columns = self.columns[None, :]
        response = (columns >= self.width) & (columns < self.width + response_lengths[:, None])
        return Rollouts(
            tokens=self.tokens,
            attention_mask=(self.real & (columns < self.width)) | response,
            response_mask=response,
            position_ids=self.positions,
            prompt_lengths=self.lengths,
            response_lengths=response_lengths,
            finished=finished,
            prompt_index=self.prompt_index,
            prompt_width=self.width,
            steps=steps,
            logprobs=logprobs,
        )
