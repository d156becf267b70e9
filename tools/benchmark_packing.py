"""Padded vs packed GRPO training step: tokens per second and peak memory (issue 33).

One GRPO step on the same ragged batch, twice: the old log-probs (forward), the policy loss's
forward and backward, and the optimizer's step (LoGRA by default), first with every row padded to
the batch's longest row (``[B, 1, S, S]`` mask, ``--micro-batch-size`` rows per microbatch), then
packed (rows end to end with ``cu_seqlens``, bin-packed up to ``--max-tokens-per-microbatch``,
default ``--micro-batch-size x S``: the padded microbatch's token count). Same model weights, same
rows. Tokens per second counts real tokens (prompt + response) over the step's wall time (the
median of ``--repeats`` timed steps after a warm-up step); peak bytes is the most tensor
memory live at once during one more step (CUDA's counters, or the CPU profiler's allocation
events), above what was live before it.

The Megatron engine's prompt prefill, padded vs packed (``"engine"`` in the JSON, unless
``--engine-prompts 0``): ``--engine-prompts`` prompts (lengths as the step's prompts), ``G =
--engine-samples`` rows each. Padded, the ``[B, P]`` block of left-padded rows goes through the
model; packed, each distinct prompt once, end to end (``rollout/megatron_engine.py:
prefill_packed``). It counts the tokens the first attention layer computes, times the prefill
alone (median of ``--repeats`` after a warm-up) and the evaluation's two passes (greedy pass@1,
then ``G`` samples per prompt, ``--engine-new-tokens`` each, as ``rl/evaluation.py`` runs them),
and says whether both layouts gave the same completions.

Lengths: no real run's rollout lengths are recorded in this repository, so the responses are
log-normal with the median at a quarter of ``--response-cap`` (sigma ``--sigma``), clipped to
``[1, cap]``; prompts uniform in ``[--prompt-min, --prompt-max]``. The table says so and gives
the batch's padding fraction.

    python tools/benchmark_packing.py                       # tiny preset
    python tools/benchmark_packing.py --preset smollm2-135m --json
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def progress(message):
    """One line on stderr per stage of the run (stdout keeps the table or the one JSON line)."""
    print(f"[benchmark_packing {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def ragged_batch(rows, prompt_min, prompt_max, cap, sigma, vocab, seed):
    """Left-padded prompts, right-padded responses (the engines' layout), and advantages, on the
    host (both layouts read the same rows; the GRPO passes move each microbatch to the model)."""
    from logra_megatron.rollout.types import Rollouts

    host = torch.device("cpu")

    generator = torch.Generator(device=host).manual_seed(seed)
    prompts = torch.randint(prompt_min, prompt_max + 1, (rows,), generator=generator, device=host)
    normal = torch.randn(rows, generator=generator, dtype=torch.float64, device=host)
    responses = torch.exp(math.log(cap / 4) + sigma * normal).round().clamp(1, cap).long()
    width = int(prompts.max())
    columns = torch.arange(width + int(responses.max()), device=host)
    attention = (columns >= width - prompts[:, None]) & (columns < width + responses[:, None])
    response = (columns >= width) & attention
    tokens = torch.randint(1, vocab, (rows, columns.numel()), generator=generator, device=host)
    tokens = torch.where(attention, tokens, torch.zeros_like(tokens))
    positions = (columns - (width - prompts[:, None])).clamp(min=0)
    rollouts = Rollouts(tokens=tokens, attention_mask=attention, response_mask=response, position_ids=positions,
                        prompt_lengths=prompts, response_lengths=responses,
                        finished=torch.ones(rows, dtype=torch.bool, device=host),
                        prompt_index=torch.arange(rows, device=host),
                        prompt_width=width, steps=int(responses.max()))
    advantages = torch.randn(rows, generator=generator, device=host)
    return rollouts, advantages


def _attention_tokens(model):
    """A hook on the first attention layer and the list it appends each call's query tokens to
    (padded ``[s, b, heads, d]``: ``s x b``; packed ``[t, heads, d]``: ``t``)."""
    from logra_megatron.models.build import unwrap_model

    layer = next(m for name, m in unwrap_model(model).named_modules() if name.endswith("core_attention"))
    calls = []
    handle = layer.register_forward_pre_hook(
        lambda module, args: calls.append(args[0].numel() // (args[0].shape[-1] * args[0].shape[-2])))
    return handle, calls


def engine_prefill(args, model, vocab, device, sync):
    """The engine's prefill and the evaluation's passes, padded vs packed (see the docstring)."""
    from megatron.core.inference.contexts import StaticInferenceContext

    from logra_megatron.models.positions import rope_positions
    from logra_megatron.rollout.megatron_engine import generate, prefill_packed, prefill_padded
    from logra_megatron.rollout.types import PromptLayout, SamplingConfig

    generator = torch.Generator(device=torch.device("cpu")).manual_seed(args.seed + 1)  # host: prompts are lists
    lengths = torch.randint(args.prompt_min, args.prompt_max + 1, (args.engine_prompts,), generator=generator,
                            device=generator.device)
    prompts = [torch.randint(1, vocab, (int(n),), generator=generator, device=generator.device).tolist()
               for n in lengths]
    samples, new = args.engine_samples, args.engine_new_tokens
    layout = PromptLayout.of(prompts, samples, new, 0, device)
    served = int(layout.lengths.sum())  # prompt tokens of every row: what the prefill delivers
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=new, vocab_size=vocab)
    sampled = SamplingConfig(temperature=1.0, max_new_tokens=new, samples_per_prompt=samples, seed=args.seed,
                             vocab_size=vocab)

    @torch.no_grad()
    def prefill(pack):
        context = StaticInferenceContext(max_batch_size=layout.tokens.shape[0], max_sequence_length=layout.tokens.shape[1])
        if pack:
            return prefill_packed(model, layout, samples, context)
        with rope_positions(model, layout.positions):
            return prefill_padded(model, layout, context)

    def timed(work):
        work()  # warm-up
        times = []
        for _ in range(args.repeats):
            sync()
            start = time.perf_counter()
            work()
            sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    sides, completions = {}, {}
    was_training = model.training
    model.eval()
    try:
        for pack in (False, True):
            progress(f"engine prefill and evaluation, {'packed' if pack else 'padded'}")
            handle, calls = _attention_tokens(model)
            try:
                prefill(pack)
            finally:
                handle.remove()
            prefill_s = timed(lambda: prefill(pack))
            completions[pack] = [generate(model, prompts, config, pack=pack).completions() for config in (greedy, sampled)]
            evaluation_s = timed(lambda: [generate(model, prompts, config, pack=pack) for config in (greedy, sampled)])
            sides["packed" if pack else "padded"] = {
                "prefill_computed_tokens": calls[0], "prefill_s": prefill_s, "prefill_tokens_per_s": served / prefill_s,
                "evaluation_s": evaluation_s}
    finally:
        model.train(was_training)
    padded, packed = sides["padded"], sides["packed"]
    return {
        "prompts": len(prompts), "samples": samples, "rows": layout.tokens.shape[0], "new_tokens": new,
        "prompt_tokens": int(lengths.sum()), "served_prompt_tokens": served,
        "padded_cells": layout.tokens.shape[0] * layout.width, "padded": padded, "packed": packed,
        "ratio": {"prefill_computed_tokens": packed["prefill_computed_tokens"] / padded["prefill_computed_tokens"],
                  "prefill_tokens_per_s": packed["prefill_tokens_per_s"] / padded["prefill_tokens_per_s"],
                  "evaluation_speed": padded["evaluation_s"] / packed["evaluation_s"]},
        "identical": {"greedy": completions[True][0] == completions[False][0],
                      "sampled": completions[True][1] == completions[False][1]},
    }


def run(args):
    from logra_megatron import parallel
    from logra_megatron.logra import LogRAConfig
    from logra_megatron.models import varlen_attention
    from logra_megatron.models.config import get_preset
    from logra_megatron.platform.memory import AllocationTracker
    from logra_megatron.rl.grpo import policy_loss_backward, sequence_logprobs
    from logra_megatron.rl.losses import PolicyLossConfig
    from logra_megatron.rl.packing import default_token_budget, token_bins
    from logra_megatron.training.config import OptimizerSettings
    from logra_megatron.training.setup import build_trainable

    model_config = get_preset(args.preset)
    if args.prompt_max + args.response_cap > model_config.max_seq:
        raise SystemExit(f"prompt + response ({args.prompt_max + args.response_cap}) exceeds the preset's "
                         f"max_seq {model_config.max_seq}")
    parallel.initialize(1, 1, seed=args.seed)
    logra = LogRAConfig(rank=args.logra_rank) if args.optimizer == "logra" else None
    _, ddp, optimizer = build_trainable(model_config, OptimizerSettings(kind=args.optimizer, lr=1e-5), logra,
                                        attention_backend="sdpa", dtype=torch.bfloat16 if args.bf16 else torch.float32)
    rollouts, advantages = ragged_batch(args.rows, args.prompt_min, args.prompt_max, args.response_cap,
                                        args.sigma, model_config.vocab, args.seed)
    device = next(ddp.parameters()).device
    real = int(rollouts.attention_mask.sum())
    cells = rollouts.tokens.numel()
    progress(f"{args.preset}: {args.rows} rows, {real} real tokens in {cells} padded cells "
             f"(padding {100 * (1 - real / cells):.1f}%)")
    budget = args.max_tokens_per_microbatch or default_token_budget(args.micro_batch_size, rollouts.tokens.shape[1])
    loss_config = PolicyLossConfig()
    initial = {name: p.detach().clone() for name, p in ddp.named_parameters()}

    def step(pack):
        old, _ = sequence_logprobs(ddp, rollouts, args.micro_batch_size, pack=pack, max_tokens=budget)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        metrics = policy_loss_backward(ddp, rollouts, advantages, old, args.micro_batch_size, loss_config,
                                       pack=pack, max_tokens=budget)
        optimizer.step()
        return metrics["loss"]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def measure(pack):
        with torch.no_grad():  # every side starts from the same weights
            for name, p in ddp.named_parameters():
                p.copy_(initial[name])
        side = "packed" if pack else "padded"
        progress(f"{side}: warm-up step")
        loss = step(pack)  # warm-up (allocator, kernels, lazily built state)
        times = []
        for repeat in range(args.repeats):
            progress(f"{side}: timed step {repeat + 1} of {args.repeats}")
            sync()
            start = time.perf_counter()
            step(pack)
            sync()
            times.append(time.perf_counter() - start)
        progress(f"{side}: the step whose peak memory is tracked")
        with AllocationTracker(device) as track:
            step(pack)
        seconds = statistics.median(times)
        microbatches = (len(token_bins(rollouts.attention_mask.sum(1).tolist(), budget)) if pack
                        else -(-args.rows // args.micro_batch_size))
        return {"step_s": seconds, "tokens_per_s": real / seconds, "peak_bytes": int(track.peak_bytes),
                "microbatches": microbatches, "first_loss": loss,
                "computed_tokens": real if pack else cells}

    padded = measure(False)
    kernel_calls = varlen_attention.calls
    packed = measure(True)
    packed["flash_varlen_calls"] = varlen_attention.calls - kernel_calls
    engine = engine_prefill(args, ddp, model_config.vocab, device, sync) if args.engine_prompts else None
    return {
        "preset": args.preset, "device": str(device), "optimizer": args.optimizer, "bf16": args.bf16,
        "rows": args.rows, "real_tokens": real, "padded_cells": cells,
        "padding_fraction": 1 - real / cells, "micro_batch_size": args.micro_batch_size,
        "max_tokens_per_microbatch": budget,
        "lengths": {"source": "log-normal responses (no recorded run lengths): median response_cap/4, "
                              f"sigma {args.sigma}, clipped to [1, {args.response_cap}]; prompts uniform "
                              f"[{args.prompt_min}, {args.prompt_max}]",
                    "response_cap": args.response_cap,
                    "response_median": float(rollouts.response_lengths.float().median()),
                    "response_max": int(rollouts.response_lengths.max())},
        "padded": padded, "packed": packed,
        "ratio": {"tokens_per_s": packed["tokens_per_s"] / padded["tokens_per_s"],
                  "peak_bytes": packed["peak_bytes"] / max(1, padded["peak_bytes"])},
        **({"engine": engine} if engine else {}),
    }


def table(result):
    lines = [f"{result['preset']} on {result['device']}, {result['optimizer']}: {result['rows']} rows, "
             f"{result['real_tokens']} real tokens in {result['padded_cells']} padded cells "
             f"(padding {100 * result['padding_fraction']:.1f}%)",
             f"lengths: {result['lengths']['source']}",
             f"padded: {result['micro_batch_size']} rows per microbatch; packed: "
             f"{result['max_tokens_per_microbatch']} tokens per microbatch", "",
             f"| layout | microbatches | step s | tokens/s | peak MiB |", "| --- | --- | --- | --- | --- |"]
    for name in ("padded", "packed"):
        row = result[name]
        lines.append(f"| {name} | {row['microbatches']} | {row['step_s']:.3f} | {row['tokens_per_s']:.0f} | "
                     f"{row['peak_bytes'] / 2**20:.1f} |")
    ratio = result["ratio"]
    lines.append(f"| packed / padded | | | {ratio['tokens_per_s']:.2f}x | {ratio['peak_bytes']:.2f}x |")
    calls = result["packed"]["flash_varlen_calls"]
    lines.append(f"packed attention: {f'the varlen flash kernel ({calls} calls)' if calls else 'one SDPA call per sequence'}")
    engine = result.get("engine")
    if engine:
        lines += ["", f"engine prefill: {engine['prompts']} prompts x {engine['samples']} samples = {engine['rows']} rows, "
                      f"{engine['served_prompt_tokens']} prompt tokens in {engine['padded_cells']} padded cells; "
                      f"evaluation: greedy, then {engine['samples']} samples per prompt, {engine['new_tokens']} new tokens",
                  "", "| prefill | computed tokens | prefill s | prompt tokens/s | evaluation s |",
                  "| --- | --- | --- | --- | --- |"]
        for name in ("padded", "packed"):
            row = engine[name]
            lines.append(f"| {name} | {row['prefill_computed_tokens']} | {row['prefill_s']:.4f} | "
                         f"{row['prefill_tokens_per_s']:.0f} | {row['evaluation_s']:.3f} |")
        ratio = engine["ratio"]
        lines.append(f"| packed / padded | {ratio['prefill_computed_tokens']:.2f}x | | "
                     f"{ratio['prefill_tokens_per_s']:.2f}x | {1 / ratio['evaluation_speed']:.2f}x |")
        same = engine["identical"]
        lines.append(f"completions identical packed and padded: greedy {'yes' if same['greedy'] else 'NO'}, "
                     f"sampled {'yes' if same['sampled'] else 'NO'}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--rows", type=int, default=None,
                        help="rows of the batch (prompts x group size; default: 32 for tiny, 16 otherwise)")
    parser.add_argument("--response-cap", type=int, default=None,
                        help="longest response (default: 192 for tiny, 512 otherwise)")
    parser.add_argument("--prompt-min", type=int, default=16)
    parser.add_argument("--prompt-max", type=int, default=48)
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the response lengths")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--max-tokens-per-microbatch", type=int, default=0,
                        help="packed budget (0: --micro-batch-size x the padded length)")
    parser.add_argument("--optimizer", choices=("logra", "adam"), default="logra")
    parser.add_argument("--bf16", action="store_true",
                        help="bf16 weights (on CUDA the packed side's attention is then the varlen flash kernel)")
    parser.add_argument("--logra-rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed steps per layout, after a warm-up (default: 2 for tiny, 1 otherwise)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--engine-prompts", type=int, default=16,
                        help="prompts of the engine-prefill comparison (0: skip it)")
    parser.add_argument("--engine-samples", type=int, default=4, help="engine prefill: rows (samples) per prompt")
    parser.add_argument("--engine-new-tokens", type=int, default=16,
                        help="engine: tokens generated per row in the evaluation's passes")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    # Beyond tiny, a batch that one CPU steps through in minutes: at 32 rows and a 1024-token cap
    # (34k padded cells, [B, 1, S, S] attention) smollm2-135m's first padded step had not ended
    # after 10 minutes on the project's 2-core machine (12 GB resident); at 16 rows and 512 the
    # whole run takes ~17 minutes there, and the padding fraction, which sets the ratio, is alike.
    tiny = args.preset == "tiny"
    if args.rows is None:
        args.rows = 32 if tiny else 16
    if args.response_cap is None:
        args.response_cap = 192 if tiny else 512
    if args.repeats is None:
        args.repeats = 2 if tiny else 1
    for name in ("rows", "response_cap", "repeats", "micro_batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    os.environ.setdefault("LOGRA_CPU_WHEN_GPUS_SHORT", "1")
    result = run(args)
    print(json.dumps(result) if args.json else table(result))  # one line: the last JSON line is the result
    return 0


if __name__ == "__main__":
    sys.exit(main())
