"""Held-out evaluation: greedy pass@1, sampled pass@k with the unbiased estimator, and 95%
confidence intervals. The trainer's evaluations (initial, start of RL, after RL) and
``python -m logra_megatron.evaluate`` run this same code.

- **pass@k** (Chen et al. 2021): with ``n`` samples of a problem of which ``c`` are correct,
  ``1 - C(n - c, k) / C(n, k)`` is an unbiased estimate of the chance that at least one of ``k``
  samples is correct; it is averaged over problems. Computed as a product, never with factorials.
- **Interval**: Wilson's score interval at 95% for the mean over problems. Unlike the normal
  approximation it stays inside [0, 1] and is not empty at 0% or 100% on a small set.
- **Data parallelism**: each replica evaluates its share of the problems; the per-problem
  outcomes are gathered, so every rank reports the same figures for the whole set.
- **The model's passes** are the engine's ``generate`` calls, one greedy and (with samples) one
  sampled; the only pass over whole sequences is each call's prompt prefill. The Megatron engine
  packs it (``rollout/megatron_engine.py: prefill_packed``): every held-out prompt once, without
  padding, whatever the number of samples; ``--no-pack-sequences`` prefills the padded block.
  Completions, and so the figures, are the same either way (tests/rl/test_evaluation.py).
"""

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Sequence, Tuple

import torch.distributed as dist

from logra_megatron import parallel
from logra_megatron.rollout.types import SamplingConfig

Z_95 = 1.959963984540054


def pass_at_k(samples: int, correct: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``correct`` of ``samples`` right (``k <= samples``)."""
    if not 1 <= k <= samples:
        raise ValueError(f"pass@{k} needs 1 <= k <= samples ({samples})")
    if samples - correct < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i = n-c+1}^{n} (1 - k / i)
    miss = 1.0
    for i in range(samples - correct + 1, samples + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def wilson_interval(mean: float, count: int, z: float = Z_95) -> Tuple[float, float]:
    """Wilson's score interval for a proportion ``mean`` observed on ``count`` problems."""
    if count == 0:
        return 0.0, 1.0
    denominator = 1.0 + z * z / count
    centre = (mean + z * z / (2 * count)) / denominator
    half = z * math.sqrt(max(mean * (1.0 - mean), 0.0) / count + z * z / (4 * count * count)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def k_values(samples: int) -> List[int]:
    """The k reported for ``samples`` samples: 1, 2, 4, ... and ``samples`` itself."""
    values, k = [], 1
    while k < samples:
        values.append(k)
        k *= 2
    return values + [samples]


@dataclass
class EvalResult:
    """Figures over the held-out problems (fractions in [0, 1])."""

    problems: int
    greedy_pass_at_1: float
    greedy_ci95: Tuple[float, float]
    samples: int = 0
    temperature: float = 0.0
    pass_at_k: Dict[int, float] = field(default_factory=dict)
    pass_at_k_ci95: Dict[int, Tuple[float, float]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        values = asdict(self)
        values["pass_at_k"] = {str(k): v for k, v in self.pass_at_k.items()}
        values["pass_at_k_ci95"] = {str(k): list(v) for k, v in self.pass_at_k_ci95.items()}
        values["greedy_ci95"] = list(self.greedy_ci95)
        return values

    def summary_line(self) -> str:
        low, high = self.greedy_ci95
        text = (f"greedy pass@1 {100 * self.greedy_pass_at_1:.1f}% "
                f"(95% CI {100 * low:.1f}-{100 * high:.1f}) on {self.problems} held-out problems")
        for k, value in self.pass_at_k.items():
            low, high = self.pass_at_k_ci95[k]
            text += f"; pass@{k} {100 * value:.1f}% ({100 * low:.1f}-{100 * high:.1f})"
        if self.samples:
            text += f" [{self.samples} samples at temperature {self.temperature:g}]"
        return text


def summarize(greedy_correct: Sequence[bool], sampled_correct: Sequence[int] = (), samples: int = 0,
              temperature: float = 0.0) -> EvalResult:
    """:class:`EvalResult` from per-problem outcomes: greedy right/wrong, and (with ``samples``)
    how many of the samples were right."""
    count = len(greedy_correct)
    greedy = sum(map(bool, greedy_correct)) / max(1, count)
    result = EvalResult(problems=count, greedy_pass_at_1=greedy, greedy_ci95=wilson_interval(greedy, count),
                        samples=samples, temperature=temperature)
    if samples:
        for k in k_values(samples):
            value = sum(pass_at_k(samples, c, k) for c in sampled_correct) / max(1, len(sampled_correct))
            result.pass_at_k[k] = value
            result.pass_at_k_ci95[k] = wilson_interval(value, len(sampled_correct))
    return result


def replica_share(items: list) -> list:
    """This data-parallel replica's contiguous share (the remainder, if any, is left out)."""
    per = len(items) // parallel.dp_size()
    return items[parallel.dp_rank() * per:(parallel.dp_rank() + 1) * per]


def _gather_over_replicas(values: list) -> list:
    if parallel.dp_size() == 1:
        return values
    everyone = [None] * parallel.dp_size()
    dist.all_gather_object(everyone, values, group=parallel.dp_group())
    return [value for part in everyone for value in part]


def evaluate_records(engine, tokenizer, prompt_text, reward, records: list, base: SamplingConfig,
                     samples: int = 0, temperature: float = 1.0, seed: int = 0) -> EvalResult:
    """Greedy pass@1 on ``records`` (and with ``samples`` > 0, pass@k of that many samples per
    problem drawn at ``temperature`` with ``base``'s top-p / top-k), split over data-parallel
    replicas. ``prompt_text(record)`` formats a prompt (chat template or bare); ``reward`` is
    the run's :class:`~logra_megatron.rl.reward_runner.RewardRunner`: full credit (>= 1) is
    correct. Every rank of a replica must call this (generation runs on all of them)."""
    mine = replica_share(records)
    prompts = [tokenizer.encode(prompt_text(record)) for record in mine]
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=base.max_new_tokens, eos_id=tokenizer.eos_id,
                            pad_id=tokenizer.pad_id, vocab_size=base.vocab_size)
    rollouts = engine.generate(prompts, greedy)
    scores = reward.score_batch(mine, [tokenizer.decode(c) for c in rollouts.completions()])
    greedy_correct = _gather_over_replicas([score >= 1.0 for score in scores])
    sampled_correct: List[int] = []
    if samples:
        sampling = SamplingConfig(temperature=temperature, top_p=base.top_p, top_k=base.top_k,
                                  max_new_tokens=base.max_new_tokens, samples_per_prompt=samples,
                                  eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, vocab_size=base.vocab_size,
                                  seed=seed + parallel.dp_rank())
        rollouts = engine.generate(prompts, sampling)
        texts = [tokenizer.decode(c) for c in rollouts.completions()]
        scores = reward.score_batch([mine[i // samples] for i in range(len(texts))], texts)
        sampled_correct = _gather_over_replicas(
            [sum(score >= 1.0 for score in scores[i * samples:(i + 1) * samples]) for i in range(len(mine))])
    return summarize(greedy_correct, sampled_correct, samples, temperature if samples else 0.0)
