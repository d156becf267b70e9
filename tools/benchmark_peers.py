"""LoGRA beside its peers on one model: the same initial weights, the same batches, one process per
optimizer, memory measured from live tensors.

    python tools/benchmark_peers.py --preset tiny --ranks 8,16 --steps 3
    python tools/benchmark_peers.py --preset smollm2-135m --bf16 --ranks 64,128 --steps 10 \\
        --seq-length 256 --micro-batch-size 2 --global-batch-size 4 \\
        --out peers.json --markdown peers.md

Rows (each in its own child process; the model is our Megatron ``GPTModel`` at TP=1 built from
the same seed in every row):

- ``torch-adamw``: ``torch.optim.AdamW`` on the model's parameters, in a plain loop (forward,
  the LM loss of ``training/lm.py``, backward, clip, step).
- ``megatron-adam``: our ``--optimizer adam`` (Megatron's Adam behind DDP, distributed optimizer
  off); ``megatron-adam-distopt-dp2``: the same with Megatron's distributed optimizer over 2
  data-parallel ranks (torchrun; the global batch split over the ranks; figures of rank 0).
- ``galore-rR``: ``galore_torch.GaLoreAdamW`` (rank R, its own projection gap and scale) on the
  decoder linears LoGRA sketches (qkv, proj, fc1, fc2), AdamW on the rest; plain loop.
- ``apollo-rR``: ``apollo_torch.APOLLOAdamW`` with the package's recommended APOLLO settings
  (random projection, channel-wise scaling, scale 1, gap 200) on the same weights;
  ``apollo-mini``: APOLLO-Mini (rank 1, tensor-wise scaling, scale 128, ``scale_front``).
- ``logra-rowadam-rR``: our optimizer with the reference update rule (``--logra-update
  rowadam``), when the package has it.
- ``logra-rR-MASTER``: our optimizer (``--optimizer logra``) at rank R, per ``--logra-masters``
  (with ``--bf16``; fp32 weights are their own master, so fp32 runs have one row per rank).

A row whose package does not import says ``not available: <reason>`` instead of figures.

Figures per row, measured after the last step (storages counted once): ``weight_bytes``,
``master_bytes``, ``grad_bytes`` (dense gradients: Megatron's buffers or ``.grad``),
``sketch_bytes``, ``moment_bytes`` (optimizer state), ``projection_bytes`` (LoGRA's bases,
GaLore's and APOLLO's projectors), their sum ``training_state_bytes``; ``peak_step_bytes`` (the
peak of tracked allocations during the last step beyond what was live before it; the plain loops
keep their ``.grad`` tensors between steps, as Megatron keeps its grad buffers, so gradients are
state, not step peak, in every row); ``state_plus_peak_bytes``; ``peak_rss_untracked_bytes``
(process, coarse; read before the tracked step, whose profiler adds its own records); ``step_time_s`` (median of the untracked steps after the first); ``first_loss`` (the
first step's batch), ``final_loss`` (the last step's batch), ``initial_eval_loss`` and
``eval_loss`` (a held-out batch before and after training). The batches are 2-digit arithmetic
text (``rl/tasks/arithmetic.py``) in the embedded character-level tokenizer, a new batch every step.
The parent checks that every row started from the same weights (equal first and initial held-out
losses) and exits non-zero, after writing its outputs, when one did not or a row failed.
"""

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from logra_megatron.cli import ArgumentParser  # noqa: E402
from logra_megatron.errors import UserError, exit_on_user_error  # noqa: E402
from logra_megatron.logra.config import MASTER_MODES, LogRAConfig  # noqa: E402
from logra_megatron.models.config import get_preset  # noqa: E402
from logra_megatron.rl.config import ModelSourceConfig, RolloutConfig, RunConfig  # noqa: E402
from logra_megatron.schema import add_flags, validate_flags  # noqa: E402
from logra_megatron.training.config import OptimizerSettings  # noqa: E402
from _bench_common import (COMPONENTS, measure_components, measure_torch_optimizer,  # noqa: E402
                           run_json_child, run_steps, torchrun_command)

METRICS = COMPONENTS + ("training_state_bytes", "peak_step_bytes", "state_plus_peak_bytes",
                        "peak_rss_untracked_bytes", "step_time_s", "first_loss", "final_loss", "initial_eval_loss", "eval_loss")
LOSS_TOLERANCE = 1e-5
"""Relative spread allowed between rows' first losses (same weights and batch; the DP=2 row
averages two microbatch losses over ranks instead of in one process)."""
DP_ROW_RANKS = 2
GALORE_PACKAGE = "galore-torch==1.0"
APOLLO_PACKAGE = "apollo-torch==1.0.3"


@dataclasses.dataclass(frozen=True)
class Row:
    key: str
    method: str  # torch-adamw | megatron-adam | galore | apollo | apollo-mini | logra
    rank: Optional[int] = None
    master: Optional[str] = None
    update: str = "adam"
    ranks: int = 1  # processes (data-parallel ranks)

    @property
    def label(self) -> str:
        if self.method == "torch-adamw":
            return "torch AdamW"
        if self.method == "megatron-adam":
            return "Megatron Adam" + (f", distributed optimizer, DP={self.ranks}" if self.ranks > 1 else "")
        if self.method == "galore":
            return f"GaLore AdamW r{self.rank}"
        if self.method == "apollo":
            return f"APOLLO r{self.rank}"
        if self.method == "apollo-mini":
            return "APOLLO-Mini r1"
        rule = "RowAdam (reference)" if self.update == "rowadam" else "LoGRA"
        return f"{rule} r{self.rank}" + (f", master {self.master}" if self.master else "")


def rows_for(args) -> list:
    ranks = args.ranks
    masters = args.logra_masters if args.bf16 else [None]
    # Run (and table) order: the reference the ratios divide by, ours, then the peers; the
    # two-process row last (the most expensive one).
    reference_master = "fp32" if args.bf16 else None
    rows = [Row("megatron-adam", "megatron-adam")]
    rows += [Row(f"logra-r{rank}" + (f"-{master}" if master else ""), "logra", rank, master)
             for rank in ranks for master in masters]
    rows += [Row(f"logra-rowadam-r{rank}", "logra", rank, reference_master, update="rowadam") for rank in ranks]
    rows += [Row("torch-adamw", "torch-adamw")]
    rows += [Row(f"galore-r{rank}", "galore", rank) for rank in ranks]
    rows += [Row(f"apollo-r{rank}", "apollo", rank) for rank in ranks] + [Row("apollo-mini", "apollo-mini", 1)]
    rows += [Row(f"megatron-adam-distopt-dp{DP_ROW_RANKS}", "megatron-adam", ranks=DP_ROW_RANKS)]
    return rows


def _int_list(text):
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"--ranks takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UserError(f"--ranks takes positive integers, got {text!r}")
    return values


def _master_list(text):
    values = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [value for value in values if value not in MASTER_MODES]
    if not values or unknown:
        raise UserError(f"--logra-masters takes a comma-separated subset of {', '.join(MASTER_MODES)}, got {text!r}")
    return values


def build_parser():
    import argparse

    parser = ArgumentParser(prog="benchmark_peers", description=__doc__.split("\n\n")[0])
    add_flags(parser, ModelSourceConfig, "preset", "bf16")
    parser.add_argument("--ranks", help="low ranks of GaLore, APOLLO and LoGRA, comma-separated (default: 64,128, "
                                         "or a quarter and a half of the hidden size when that is below 256)")
    parser.add_argument("--logra-masters", default="fp32,none",
                        help="with --bf16: LoGRA's --logra-master modes, one row each (comma-separated)")
    add_flags(parser, LogRAConfig, "refresh_interval")
    parser.add_argument("--galore-proj-gap", type=int, default=200, help="GaLore's update_proj_gap (its default)")
    parser.add_argument("--galore-scale", type=float, default=0.25, help="GaLore's scale (its recommended value)")
    parser.add_argument("--apollo-proj-gap", type=int, default=200, help="APOLLO's update_proj_gap (its default)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per row (the last one tracked)")
    # A short language-model run that every row (each in its own process, ten of them) finishes in
    # seconds on a CPU: a small batch of short sequences, not the trainer's RL batch.
    add_flags(parser, RunConfig, "micro_batch_size", "seed", defaults={"micro_batch_size": 2})
    add_flags(parser, RolloutConfig, "global_batch_size", "seq_length",
              defaults={"global_batch_size": 4, "seq_length": 64},
              notes={"global_batch_size": "4 sequences of arithmetic text per step",
                     "seq_length": "64 tokens per sequence"})
    # One learning rate for every row; large enough that the held-out loss moves in the few steps of
    # a default run (the trainer's 3e-4 is an RL fine-tuning rate).
    add_flags(parser, OptimizerSettings, "lr", "clip_grad", defaults={"lr": 1e-3},
              notes={"lr": "1e-3, the same for every row"})
    parser.add_argument("--rows", default="", help="only these row keys (comma-separated; default: all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--out", help="also write the JSON report to this file")
    parser.add_argument("--markdown", help="also write the markdown table to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def parse_args(argv):
    parser = build_parser()
    args = parser.parse_args(argv)
    validate_flags(parser, args)
    if args.ranks is None:
        hidden = get_preset(args.preset).hidden
        args.ranks = "64,128" if hidden >= 256 else f"{hidden // 4},{hidden // 2}"
    args.ranks = _int_list(args.ranks)
    args.logra_masters = _master_list(args.logra_masters)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the last step is the tracked one)")
    return args


def validate(args):
    """Fail fast, in the parent, on bad input."""
    model = get_preset(args.preset)
    for rank in args.ranks:
        try:
            LogRAConfig(rank=rank, refresh_interval=args.logra_refresh_interval).check_model(model)
        except UserError as error:
            raise UserError(str(error).replace("--logra-rank", "--ranks")) from None
    if "bf16-sr" in args.logra_masters and not args.bf16:
        raise UserError("--logra-masters bf16-sr needs --bf16")
    if args.global_batch_size % (args.micro_batch_size * DP_ROW_RANKS):
        raise UserError(f"--global-batch-size must be a multiple of --micro-batch-size x {DP_ROW_RANKS} "
                        f"(the distributed-optimizer row splits it over {DP_ROW_RANKS} ranks)")
    if args.seq_length + 1 > model.max_seq:
        raise UserError(f"--seq-length exceeds the model's max_seq {model.max_seq}")
    if args.galore_proj_gap < 1 or args.apollo_proj_gap < 1:
        raise UserError("--galore-proj-gap and --apollo-proj-gap must be >= 1")
    known = {row.key for row in rows_for(args)}
    chosen = [key.strip() for key in args.rows.split(",") if key.strip()]
    unknown = [key for key in chosen if key not in known]
    if unknown:
        raise UserError(f"unknown row(s) {', '.join(unknown)}; rows: {', '.join(sorted(known))}")
    return model


# --- the child: one row ---------------------------------------------------------------------------


class NotAvailable(Exception):
    """This row cannot run here (its package is missing or does not import)."""


def batches(args, vocab: int):
    """``(train, held_out)``: ``steps`` batches ``[global_batch, seq + 1]`` of 2-digit
    arithmetic text (a new one each step) and one held-out batch, the same in every row."""
    import torch

    from logra_megatron.rl.tasks import TOKENIZER_CORPUS_TASK, ArithmeticTasks
    from logra_megatron.rl.tokenizers import build_run_tokenizer

    tokenizer = build_run_tokenizer(ModelSourceConfig(), None)
    if tokenizer.vocab_size > vocab:
        raise UserError(f"the task tokenizer's {tokenizer.vocab_size} ids do not fit the model's vocabulary {vocab}")
    tasks = ArithmeticTasks(dataclasses.replace(TOKENIZER_CORPUS_TASK, seed=args.seed))
    need = args.global_batch_size * (args.seq_length + 1)

    def batch(problems):
        ids = []
        for problem in problems:
            ids += tokenizer.encode(problem["prompt"] + problem["answer"]) + [tokenizer.eos_id]
        if len(ids) < need:
            raise UserError("not enough arithmetic text for one batch")
        return torch.tensor(ids[:need]).view(args.global_batch_size, args.seq_length + 1)

    per_batch = need // 4 + 8  # a problem is at least 4 tokens ("1+2=3" plus the separator)
    train = [batch(tasks.train_prompts(per_batch, step=step)) for step in range(args.steps)]
    return train, batch(tasks.held_out(per_batch))


def lowrank_weights(model):
    """The weights GaLore/APOLLO project: the decoder linears LoGRA sketches."""
    from logra_megatron.logra.accounting import SKETCHED_SLOTS

    chosen = []
    for name, param in model.named_parameters():
        parts = name.split(".")
        if len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in SKETCHED_SLOTS and ".layers." in f".{name}":
            chosen.append(param)
    return chosen


def peer_class(row: Row):
    """The optimizer class of a plain-loop row (imported first thing in the child, so a missing
    package is reported before any model is built), or :class:`NotAvailable`."""
    import torch

    if row.method == "torch-adamw":
        return torch.optim.AdamW
    package, install = ("galore_torch", GALORE_PACKAGE) if row.method == "galore" else ("apollo_torch", APOLLO_PACKAGE)
    try:
        module = __import__(package)
    except Exception as error:  # ImportError, or a dependency (bitsandbytes, transformers) failing at import
        message = str(error).splitlines()[0] if str(error) else ""
        raise NotAvailable(f"{install.split('==')[0]} does not import ({type(error).__name__}: {message}); "
                           f"pip install {install}") from None
    return module.GaLoreAdamW if row.method == "galore" else module.APOLLOAdamW


def peer_optimizer(row: Row, args, model, optimizer_class):
    """The plain ``torch.optim.Optimizer`` of a plain-loop row and its low-rank settings."""
    params = list(model.parameters())
    common = dict(lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)  # Megatron's defaults
    if row.method == "torch-adamw":
        return optimizer_class(params, **common), {}
    lowrank = lowrank_weights(model)
    chosen = {id(p) for p in lowrank}
    rest = [p for p in params if id(p) not in chosen]
    if row.method == "galore":
        settings = {"rank": row.rank, "update_proj_gap": args.galore_proj_gap, "scale": args.galore_scale,
                    "proj_type": "std"}
        return optimizer_class([{"params": rest}, {"params": lowrank, **settings}], no_deprecation_warning=True,
                               **common), settings
    if row.method == "apollo":  # the package's APOLLO defaults: scale 1 with a rank ~ a quarter of the width
        settings = {"rank": row.rank, "proj": "random", "scale_type": "channel", "scale": 1,
                    "update_proj_gap": args.apollo_proj_gap, "proj_type": "std"}
        front = False
    else:  # APOLLO-Mini as the package recommends for small models: scale 128, limiter after scaling
        settings = {"rank": 1, "proj": "random", "scale_type": "tensor", "scale": 128,
                    "update_proj_gap": args.apollo_proj_gap, "proj_type": "std"}
        front = True
    optimizer = optimizer_class([{"params": rest}, {"params": lowrank, **settings}], scale_front=front, **common)
    return optimizer, dict(settings, scale_front=front)


def rowadam_available() -> Optional[str]:
    """None when ``--logra-update rowadam`` exists, else why not."""
    from logra_megatron.logra.update_rules import UPDATE_RULES

    if "update" not in {field.name for field in dataclasses.fields(LogRAConfig)}:
        return "LogRAConfig has no 'update' field (--logra-update) yet"
    if "rowadam" not in UPDATE_RULES:
        return "'rowadam' is not in logra/update_rules.py: UPDATE_RULES yet"
    return None


def build_plain(model_config, dtype, seed):
    """The bare model as ``build_trainable`` builds it (same spec, same seeded weights)."""
    from logra_megatron.models import build_gpt_model, gpt_layer_spec, transformer_config
    from logra_megatron.models.weights import initialize_layout_independent

    config = transformer_config(model_config, 1, 1, dtype=dtype)
    model = build_gpt_model(model_config, config, gpt_layer_spec(use_transformer_engine=False))
    initialize_layout_independent(model, model_config.vocab, seed)
    return model


def run_child(args) -> dict:
    import torch

    from logra_megatron import parallel
    from logra_megatron.training.lm import lm_forward_backward
    from logra_megatron.training.setup import build_trainable, train_step

    model_config = validate(args)
    row = {candidate.key: candidate for candidate in rows_for(args)}[args.child]
    settings, optimizer_class = {}, None
    if row.method == "logra" and row.update != "adam":
        reason = rowadam_available()
        if reason:
            raise NotAvailable(reason)
    elif row.method not in ("megatron-adam", "logra"):
        optimizer_class = peer_class(row)
    parallel.initialize(1, 1, seed=args.seed)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    train, held_out = batches(args, model_config.vocab)
    per = args.global_batch_size // parallel.dp_size()
    start = parallel.dp_rank() * per
    train = [tokens[start:start + per] for tokens in train]
    held_out = held_out[start:start + per]

    if row.method in ("megatron-adam", "logra"):
        logra_config = None
        if row.method == "logra":
            extra = {"update": row.update} if row.update != "adam" else {}
            logra_config = LogRAConfig(rank=row.rank, refresh_interval=args.logra_refresh_interval,
                                       master=row.master or "fp32", zero1=row.ranks > 1, seed=args.seed, **extra)
        model, runner, optimizer = build_trainable(
            model_config, OptimizerSettings(kind="logra" if row.method == "logra" else "adam", lr=args.lr,
                                            clip_grad=args.clip_grad, distributed=row.ranks > 1),
            logra_config, dtype=dtype, seed=args.seed)
        if row.update != "adam":
            from logra_megatron.logra.update_rules import UPDATE_RULES

            if not isinstance(optimizer.update_rule, UPDATE_RULES[row.update]):
                raise NotAvailable(f"--logra-update {row.update} is registered but the optimizer builder "
                                   f"did not use it (got {type(optimizer.update_rule).__name__})")
        settings = {"update": row.update, "master": row.master or "weights (fp32)",
                    "refresh_interval": args.logra_refresh_interval} if row.method == "logra" else {}

        def step_on(tokens):
            loss, _ = train_step(runner, optimizer, lambda m: lm_forward_backward(m, tokens, args.micro_batch_size))
            return loss

        def measure():
            return measure_components(model, runner, optimizer)
    else:
        model = runner = build_plain(model_config, dtype, args.seed)
        optimizer, settings = peer_optimizer(row, args, model, optimizer_class)
        params = list(model.parameters())

        def step_on(tokens):
            optimizer.zero_grad(set_to_none=False)  # .grad stays allocated, like Megatron's buffers
            loss = lm_forward_backward(model, tokens, args.micro_batch_size)
            if args.clip_grad:
                torch.nn.utils.clip_grad_norm_(params, args.clip_grad)
            optimizer.step()
            return loss

        def measure():
            return measure_torch_optimizer(model, optimizer)

    device = next(model.parameters()).device
    train = [tokens.to(device) for tokens in train]
    held_out = held_out.to(device)
    initial_eval = lm_forward_backward(runner, held_out, args.micro_batch_size, forward_only=True)
    batch_index = iter(range(args.steps))

    def step():
        return step_on(train[next(batch_index)])

    first, last, seconds, tracked, untracked_peak = run_steps(step, args.steps)
    components = measure()  # after the last step, before the next one clears anything
    final_eval = lm_forward_backward(runner, held_out, args.micro_batch_size, forward_only=True)
    state = sum(components.values())
    figures = {
        **components,
        "training_state_bytes": state,
        "peak_step_bytes": tracked.peak_bytes,
        "state_plus_peak_bytes": state + tracked.peak_bytes,
        "peak_rss_untracked_bytes": untracked_peak,
        "step_time_s": seconds,
        "first_loss": first,
        "final_loss": last,
        "initial_eval_loss": initial_eval,
        "eval_loss": final_eval,
    }
    result = {"available": True, "settings": settings, **figures}
    if parallel.dp_size() > 1:
        import torch.distributed as dist

        every = [None] * parallel.dp_size()
        dist.all_gather_object(every, figures)
        result["per_rank"] = every
    return result


def child_main(args):
    """One row; prints one JSON line (rank 0 only when data-parallel)."""
    try:
        result = run_child(args)
    except NotAvailable as reason:
        result = {"available": False, "reason": f"not available: {reason}"}
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(json.dumps(result), flush=True)


# --- the parent -----------------------------------------------------------------------------------


def _child_argv(argv) -> list:
    """The parent's flags minus its output options (a child answers on stdout)."""
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        if item in ("--out", "--markdown"):
            skip = True
            continue
        if item.startswith(("--out=", "--markdown=")) or item == "--json":
            continue
        kept.append(item)
    return kept


def run_row(row: Row, argv) -> dict:
    script = os.path.abspath(__file__)
    child_args = [*_child_argv(argv), "--child", row.key]
    if row.ranks > 1:
        command = torchrun_command(row.ranks, script, *child_args)
    else:
        command = [sys.executable, script, *child_args]
    return run_json_child(command, row.key)


def check_same_start(rows: dict) -> dict:
    """The spread of the first-step and initial held-out losses over the rows that ran."""
    out = {}
    for key in ("first_loss", "initial_eval_loss"):
        values = [row[key] for row in rows.values() if row.get("available")]
        if values:
            spread = max(values) - min(values)
            out[key] = {"min": min(values), "max": max(values), "relative_spread": spread / abs(values[0] or 1.0)}
    return out


def run_parent(args, argv) -> dict:
    validate(args)
    chosen = {key.strip() for key in args.rows.split(",") if key.strip()}
    rows = [row for row in rows_for(args) if not chosen or row.key in chosen]
    results, failures = {}, []
    for index, row in enumerate(rows, 1):
        if args.out and results:  # a long run interrupted still leaves the rows it finished
            Path(args.out).write_text(json.dumps(summarize(args, argv, results, failures, partial=True), indent=1) + "\n")
        print(f"[peers] ({index}/{len(rows)}) {row.key}: {args.steps} steps ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            result = run_row(row, argv)
        except UserError as error:
            result = {"available": False, "reason": f"failed: {error}"}
            failures.append(row.key)
        result = {"key": row.key, "label": row.label, "rank": row.rank, "processes": row.ranks, **result}
        results[row.key] = result
        took = time.perf_counter() - start
        if result.get("available"):
            print(f"[peers]   done in {took:.0f} s: state {result['training_state_bytes'] / 1e6:.2f} MB, "
                  f"step {result['step_time_s']:.2f} s, held-out loss {result['initial_eval_loss']:.4f} -> "
                  f"{result['eval_loss']:.4f}", file=sys.stderr, flush=True)
        else:
            print(f"[peers]   {result['reason'].splitlines()[0]}", file=sys.stderr, flush=True)
    return summarize(args, argv, results, failures)


def summarize(args, argv, results: dict, failures: list, partial: bool = False) -> dict:
    """The report: settings, the rows (with their state relative to Megatron Adam's) and the
    same-start check."""
    reference = results.get("megatron-adam")
    for result in results.values():
        if result.get("available") and reference and reference.get("available"):
            result["state_vs_megatron_adam"] = result["training_state_bytes"] / reference["training_state_bytes"]
    start_check = check_same_start(results)
    same_start = all(item["relative_spread"] <= LOSS_TOLERANCE for item in start_check.values())
    settings = {key: getattr(args, key) for key in (
        "preset", "ranks", "bf16", "logra_masters", "steps", "micro_batch_size", "global_batch_size",
        "seq_length", "lr", "clip_grad", "seed", "logra_refresh_interval", "galore_proj_gap", "galore_scale",
        "apollo_proj_gap")}
    return {**settings, "command": "python tools/benchmark_peers.py " + " ".join(argv),
            "rows": list(results.values()), "same_start": same_start, "start_check": start_check,
            "failed_rows": failures, **({"partial": True} if partial else {})}


def _mb(value) -> str:
    return f"{value / 1e6:.2f}"


def markdown(report) -> str:
    precision = "bf16" if report["bf16"] else "fp32"
    lines = [
        f"`{report['preset']}`, {precision} weights, {report['steps']} steps of {report['global_batch_size']} x "
        f"{report['seq_length']} tokens (micro-batch {report['micro_batch_size']}), lr {report['lr']}, "
        f"clip {report['clip_grad']}; MB = 10^6 bytes, measured from live tensors after the last step:",
        "",
        f"`{report['command']}`",
        "",
        "| optimizer | weights | grads | masters | optimizer state | sketches + projections | training state "
        "| vs Megatron Adam | peak of a step | step time (s) | loss, first step | held-out loss before -> after |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in report["rows"]:
        if not row.get("available"):
            lines.append(f"| {row['label']} | {row['reason'].splitlines()[0]} |" + " |" * 10)
            continue
        ratio = row.get("state_vs_megatron_adam")
        lines.append(
            f"| {row['label']} | {_mb(row['weight_bytes'])} | {_mb(row['grad_bytes'])} | {_mb(row['master_bytes'])} "
            f"| {_mb(row['moment_bytes'])} | {_mb(row['sketch_bytes'] + row['projection_bytes'])} "
            f"| {_mb(row['training_state_bytes'])} | {'-' if ratio is None else f'x{ratio:.3f}'} "
            f"| {_mb(row['peak_step_bytes'])} | {row['step_time_s']:.3f} | {row['first_loss']:.4f} "
            f"| {row['initial_eval_loss']:.4f} -> {row['eval_loss']:.4f} |")
    return "\n".join(lines) + "\n"


def print_table(report):
    precision = "bf16" if report["bf16"] else "fp32"
    print(f"preset {report['preset']}  {precision}  steps {report['steps']}  batch {report['global_batch_size']}x"
          f"{report['seq_length']}  lr {report['lr']}  (MB = 1e6 bytes)")
    header = ("optimizer", "weights", "grads", "masters", "opt state", "sk+proj", "state", "peak step", "s/step",
              "loss 1")
    print(f"{header[0]:<44}" + "".join(f"{name:>11}" for name in header[1:]) + "  held-out after")
    for row in report["rows"]:
        if not row.get("available"):
            print(f"{row['label']:<44}{row['reason'].splitlines()[0]}")
            continue
        cells = [_mb(row[key]) for key in ("weight_bytes", "grad_bytes", "master_bytes", "moment_bytes")]
        cells += [_mb(row["sketch_bytes"] + row["projection_bytes"]), _mb(row["training_state_bytes"]),
                  _mb(row["peak_step_bytes"]), f"{row['step_time_s']:.3f}", f"{row['first_loss']:.4f}"]
        print(f"{row['label']:<44}" + "".join(f"{cell:>11}" for cell in cells) + f"  {row['eval_loss']:.4f}")
    if not report["same_start"]:
        print("WARNING: the rows did not start from the same weights:", json.dumps(report["start_check"]))


@exit_on_user_error
def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.child:
        child_main(args)
        return
    report = run_parent(args, argv)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown(report))
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    if report["failed_rows"] or not report["same_start"]:
        problems = [f"rows failed: {', '.join(report['failed_rows'])}"] if report["failed_rows"] else []
        if not report["same_start"]:
            problems.append(f"rows did not start from the same weights: {json.dumps(report['start_check'])}")
        print("error: " + "; ".join(problems), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
