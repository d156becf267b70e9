"""Check a Megatron checkpoint against the Hugging Face model it came from.

    python tools/compare_logits.py --hf-dir HF --load CKPT \\
        [--tensor-model-parallel-size T] [--pipeline-model-parallel-size P] [--json]

Runs the same prompts through both models in fp32 and reports the largest absolute logit
difference (on each prompt followed by the HF model's greedy continuation) and whether the
greedy continuations agree token for token. Greedy decoding re-runs the full sequence for every
token (no KV cache), so it checks exactly the forward pass a trainer uses. Prompts are text
encoded with the HF folder's tokenizer, or seeded random token ids when it has none; they run
as one right-padded batch (under a causal mask padding cannot reach the real positions).

With ``--json`` stdout carries exactly one JSON object:
``{"max_abs_logit_diff": ..., "greedy_match": true|false, "tokens_compared": ...}``.
When T x P > 1 the script re-runs itself under torchrun, as the converter does.
"""

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from logra_megatron.cli import ArgumentParser  # noqa: E402
from logra_megatron.convert import launch  # noqa: E402
from logra_megatron.errors import UserError, exit_on_user_error  # noqa: E402


def parse_args(argv=None):
    parser = ArgumentParser(prog="compare_logits.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True, help="Hugging Face model folder")
    parser.add_argument("--load", required=True, help="Megatron checkpoint directory")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--prompt", action="append", default=None,
                        help="a prompt (repeatable; default: four built-in prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=8,
                        help="greedy tokens per prompt (default: 8)")
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    if args.prompt and not all(text.strip() for text in args.prompt):
        parser.error("--prompt must not be empty")
    return args


def validate(args):
    """Input checks that need no process group; returns the checkpoint's ModelConfig."""
    from logra_megatron.checkpoint import load_model_config
    from logra_megatron.convert.hf import model_config_from_hf
    from logra_megatron.convert.hf_io import check_hf_dir, read_hf_config
    from logra_megatron.convert.runtime import check_layout

    check_hf_dir(args.hf_dir)
    hf_model = model_config_from_hf(read_hf_config(args.hf_dir))
    model = load_model_config(args.load)
    if model.vocab != hf_model.vocab or model.layers != hf_model.layers or model.hidden != hf_model.hidden:
        raise UserError(f"{args.load} ({model.layers} layers, hidden {model.hidden}, vocab "
                        f"{model.vocab}) is not a conversion of {args.hf_dir} ({hf_model.layers} "
                        f"layers, hidden {hf_model.hidden}, vocab {hf_model.vocab})")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    check_layout(model, tp, pp, launch.world_size() if launch.under_torchrun() else tp * pp,
                 os.path.basename(os.path.normpath(args.load)))
    return model


def hf_side(args, model):
    """Rank 0: prompts as token ids, HF greedy continuations and HF logits of prompt + them."""
    from logra_megatron.convert.reference import (DEFAULT_PROMPTS, encode_prompts, hf_logits_fn,
                                                  load_hf_model)
    from logra_megatron.convert.runtime import greedy_tokens, sequence_logits

    prompts = encode_prompts(args.hf_dir, args.prompt or DEFAULT_PROMPTS, model.vocab)
    logits_fn = hf_logits_fn(load_hf_model(args.hf_dir))
    greedy = greedy_tokens(logits_fn, prompts, args.max_new_tokens)
    logits = sequence_logits(logits_fn, [p + g for p, g in zip(prompts, greedy)])
    return prompts, greedy, logits


def megatron_side(args, model, prompts, hf_greedy_tokens):
    """Every rank: Megatron's greedy continuations and its logits on the HF sequences (the
    logits are returned on the ranks of the last pipeline stage, ``None`` elsewhere)."""
    from logra_megatron import parallel
    from logra_megatron.checkpoint import load_checkpoint
    from logra_megatron.convert.runtime import build_model, greedy_tokens, megatron_logits_fn, sequence_logits

    parallel.initialize(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    megatron = build_model(model)
    load_checkpoint(args.load, megatron)
    logits_fn = megatron_logits_fn(megatron, model.vocab)
    greedy = greedy_tokens(logits_fn, prompts, args.max_new_tokens, share=parallel.broadcast_object_from_last_stage)
    logits = sequence_logits(logits_fn, [p + g for p, g in zip(prompts, hf_greedy_tokens)])
    return greedy, logits


def report(args, prompts, hf_greedy_tokens, hf_logits, greedy, logits) -> dict:
    """The summary dict (rank 0), and the human-readable lines unless ``--json``."""
    diff = max(float((a - b).abs().max()) for a, b in zip(logits, hf_logits))
    matches = [a == b for a, b in zip(greedy, hf_greedy_tokens)]
    summary = {"max_abs_logit_diff": diff, "greedy_match": all(matches),
               "tokens_compared": sum(len(tokens) for tokens in hf_greedy_tokens)}
    if not args.json:
        for prompt, hf_tokens, mc_tokens, same in zip(prompts, hf_greedy_tokens, greedy, matches):
            print(f"prompt {prompt[:8]}{'...' if len(prompt) > 8 else ''}: hf {hf_tokens} "
                  f"megatron {mc_tokens} {'match' if same else 'DIFFER'}")
        print(f"max |logit diff| {diff:.3e}; greedy {'matches' if all(matches) else 'differs'} "
              f"on {summary['tokens_compared']} tokens")
    return summary


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    model = validate(args)
    launch.relaunch_if_needed(args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    from logra_megatron import parallel
    from logra_megatron.convert.runtime import from_rank0

    try:
        hf_result = hf_side(args, model) if launch.is_rank0() else None
        parallel.init_distributed()
        # Every rank needs the prompts and HF's continuations; only rank 0 the HF logits.
        prompts, hf_greedy_tokens = from_rank0(hf_result[:2] if hf_result else None)
        hf_logits = hf_result[2] if hf_result else None
        greedy, logits = megatron_side(args, model, prompts, hf_greedy_tokens)
        logits = parallel.broadcast_object_from_last_stage(logits)  # to rank 0, which is on the first stage
        if launch.is_rank0():
            summary = report(args, prompts, hf_greedy_tokens, hf_logits, greedy, logits)
            if args.json:
                print(json.dumps(summary), flush=True)
    finally:
        parallel.destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
