"""Full vs low-rank policy sync into the vLLM rollout engine, on the same trainer steps, measured.

    python tools/benchmark_policy_sync.py --preset tiny --num-attention-heads 2 --vocab 99 \\
        --logra-rank 8 --steps 6 --json
    python tools/benchmark_policy_sync.py --preset smollm2-135m --logra-rank 64 --logra-embeddings \\
        --steps 4 --json

One LoGRA trainer (random weights of the preset's shapes, a language-model step on random tokens
per step) and one vLLM engine with ``--policy-sync lowrank``. After every step the engine is
synced twice on the same weights: first the low-rank sync the trainer would send (the step's
factors and the dense remainder; a full one when the step redrew the projections), then a full
sync (every weight, gathered and converted). Both are measured by the engine
(logra_megatron/rollout/vllm_engine.py): ``bytes`` is what was handed to the engine, ``time_s``
covers building the message or gathering the weights, the hand-over and the engine's reload.
``logprob_gap`` is the largest difference of the engine's log-probs of fixed sequences after the
low-rank sync and after the full one (the full sync is the reference).

``--engine-process separate`` runs the engine in processes of its own, as multi-rank jobs do
(the weights cross through a file in shared memory), where the bytes cost time; in-process
(the default of a one-process job) tensors are handed over by reference and the engine's reload
dominates both kinds of sync.

Prints a table, or with ``--json`` one object: the settings, ``weight_bytes`` (the engine's
weights in the trainer's dtype), ``steps`` (one row per step) and ``full`` / ``low_rank``
(mean bytes, median time over the steps that synced in that form) with ``ratio`` (low-rank /
full). vLLM must be installed (``pip install -e .[rollout]``).
"""

import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from logra_megatron.cli import ArgumentParser  # noqa: E402
from logra_megatron.errors import UserError, exit_on_user_error  # noqa: E402
from logra_megatron.logra.config import LogRAConfig, rank_settings  # noqa: E402
from logra_megatron.rl.config import ModelSourceConfig  # noqa: E402
# The trainer's own reading of --num-attention-heads / --num-query-groups (one meaning everywhere).
from logra_megatron.rl.config import _preset_with_heads as preset_with_heads  # noqa: E402
from logra_megatron.schema import add_flags, validate_flags  # noqa: E402

SEQUENCES = [[1, 5, 9, 42, 7, 30, 12, 5], [40, 3, 3, 77, 14, 8, 2, 6]]


def build_parser():
    parser = ArgumentParser(prog="benchmark_policy_sync", description=__doc__.split("\n\n")[0])
    # The trainer's model flags: a preset's shapes (random weights), its heads changed as the trainer
    # changes them (vLLM's CPU attention needs a head dim of 32, 64, 80, ...).
    add_flags(parser, ModelSourceConfig, "preset", "num_attention_heads", "num_query_groups", "bf16")
    parser.add_argument("--vocab", type=int, default=None,
                        help="the tokenizer's vocabulary (default: the preset's); 99 is the embedded default's")
    # A short refresh interval: a refresh step syncs in full, so a run of a few steps shows both kinds.
    add_flags(parser, LogRAConfig, "rank", "max_rank", "embeddings", "refresh_interval",
              defaults={"refresh_interval": 4})
    parser.add_argument("--steps", type=int, default=6, help="trainer steps, each followed by both syncs")
    parser.add_argument("--engine-process", choices=("in", "separate"), default="in",
                        help="the engine in this process, or in processes of its own (multi-rank jobs)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    validate_flags(parser, args)
    if args.steps < 1:
        raise UserError(f"--steps must be >= 1, got {args.steps}")
    return args


def engine_logprobs(engine, sequences):
    return [value for row in engine.prompt_logprobs(sequences) for value in row]


def run(args) -> dict:
    import torch

    from logra_megatron import parallel
    from logra_megatron.logra.config import LogRAConfig
    from logra_megatron.rollout.vllm_engine import VLLMEngine, import_vllm
    from logra_megatron.training.config import OptimizerSettings
    from logra_megatron.training.lm import lm_forward_backward
    from logra_megatron.training.setup import build_trainable, train_step

    import_vllm()  # one line saying how to install it, before anything is built
    source = ModelSourceConfig(preset=args.preset, num_attention_heads=args.num_attention_heads,
                               num_query_groups=args.num_query_groups)
    model_config = preset_with_heads(source).with_changes(max_seq=64)
    vocab = args.vocab or model_config.vocab
    if not 1 < vocab <= model_config.vocab:
        raise UserError(f"--vocab must be in 2..{model_config.vocab}, got {vocab}")
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    parallel.initialize(1, 1, seed=1234)
    _model, ddp, optimizer = build_trainable(
        model_config, OptimizerSettings(kind="logra", lr=1e-3, weight_decay=0.01),
        LogRAConfig(**rank_settings(args), refresh_interval=args.logra_refresh_interval, embeddings=args.logra_embeddings),
        dtype=dtype, seed=3)
    engine = VLLMEngine(ddp, model_config=model_config, vocab_size=vocab, optimizer=optimizer,
                        policy_sync="lowrank", full_sync_interval=10**6, kv_cache_mb=16, max_num_seqs=8)
    engine.separate_process = args.engine_process == "separate"
    sequences = [[token % vocab for token in row] for row in SEQUENCES]
    rows = []
    try:
        engine.sync_weights(ddp)  # the engine is built and holds the starting weights
        for step in range(args.steps):
            tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(step))
            train_step(ddp, optimizer, lambda m: lm_forward_backward(m, tokens, 2, vocab_size=vocab))
            low = engine.sync_weights(ddp)
            after_low = engine_logprobs(engine, sequences)
            full = engine.sync_weights(ddp, force_full=True)
            after_full = engine_logprobs(engine, sequences)
            rows.append({"step": step, "low_rank": bool(low["sync_low_rank"]),
                         "sent_bytes": low["sync_bytes"], "sent_time_s": low["sync_time_s"],
                         "full_bytes": full["sync_bytes"], "full_time_s": full["sync_time_s"],
                         "logprob_gap": max(abs(a - b) for a, b in zip(after_low, after_full))})
            print(f"[bench] step {step + 1}/{args.steps}: "
                  f"{'low-rank' if rows[-1]['low_rank'] else 'full (refresh)'} {low['sync_bytes'] / 2**20:.2f} MiB "
                  f"in {low['sync_time_s']:.2f} s, full {full['sync_bytes'] / 2**20:.2f} MiB "
                  f"in {full['sync_time_s']:.2f} s", file=sys.stderr, flush=True)
    finally:
        engine.close()
        parallel.destroy()
    weight_bytes = dtype.itemsize * (model_config.with_changes(vocab=vocab).num_parameters()
                                     + (vocab * model_config.hidden if model_config.tie_embeddings else 0))
    low_rows = [row for row in rows if row["low_rank"]]
    summary = {
        "preset": args.preset, "heads": model_config.heads, "vocab": vocab, "rank": args.logra_rank,
        "max_rank": args.logra_max_rank,
        "embeddings_sketched": args.logra_embeddings, "dtype": str(dtype).removeprefix("torch."),
        "engine_process": args.engine_process, "refresh_interval": args.logra_refresh_interval,
        "weight_bytes": weight_bytes, "steps": rows,
        "full": {"bytes": statistics.mean(row["full_bytes"] for row in rows),
                 "time_s": statistics.median(row["full_time_s"] for row in rows)},
        "low_rank": None, "ratio": None,
        "max_logprob_gap": max(row["logprob_gap"] for row in rows),
    }
    if low_rows:
        summary["low_rank"] = {"bytes": statistics.mean(row["sent_bytes"] for row in low_rows),
                               "time_s": statistics.median(row["sent_time_s"] for row in low_rows),
                               "syncs": len(low_rows)}
        summary["ratio"] = {key: summary["low_rank"][key] / summary["full"][key] for key in ("bytes", "time_s")}
    return summary


def print_table(summary: dict) -> None:
    print(f"{summary['preset']} (heads {summary['heads']}, vocab {summary['vocab']}, {summary['dtype']}), "
          f"LoGRA rank {summary['rank']}{', sketched embeddings' if summary['embeddings_sketched'] else ''}, "
          f"engine {summary['engine_process']}-process; weights {summary['weight_bytes'] / 2**20:.2f} MiB")
    print(f"{'sync':<10} {'MiB/step':>10} {'s/step':>8}")
    print(f"{'full':<10} {summary['full']['bytes'] / 2**20:>10.3f} {summary['full']['time_s']:>8.3f}")
    if summary["low_rank"]:
        low, ratio = summary["low_rank"], summary["ratio"]
        print(f"{'low-rank':<10} {low['bytes'] / 2**20:>10.3f} {low['time_s']:>8.3f}")
        print(f"{'ratio':<10} {ratio['bytes']:>10.3f} {ratio['time_s']:>8.3f}")
    print(f"largest log-prob gap, low-rank vs full: {summary['max_logprob_gap']:.2e}")


@exit_on_user_error
def main(argv=None):
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    args = parse_args(argv)
    summary = run(args)
    if args.json:
        print(json.dumps(summary))
    else:
        print_table(summary)


if __name__ == "__main__":
    main()
