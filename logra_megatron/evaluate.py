"""Evaluate a checkpoint on a task's held-out problems: greedy pass@1 and, with ``--samples K``,
pass@k of K samples per problem (unbiased estimator), each with a 95% confidence interval.

    python -m logra_megatron.evaluate --load CKPT --task gsm_symbolic --samples 8 --temperature 0.7
    torchrun --nproc-per-node 2 -m logra_megatron.evaluate --load CKPT --tensor-model-parallel-size 2

It takes the trainer's flags (model, layout, task, reward, sampling, prompt format: the same
held-out split and scoring as the run that trained the checkpoint; ``--samples`` is short for
``--eval-samples``), runs the same evaluation code as the trainer's start and end, prints one
summary line and writes ``evaluation.json`` into ``--output-dir``. The optimizer state in the
checkpoint is not loaded.
"""

import dataclasses
import json
import os
import sys

from logra_megatron import schema
from logra_megatron.config import build_parser as build_train_parser, parse_train_args
from logra_megatron.errors import exit_on_user_error
from logra_megatron.rl.config import RunConfig, replace_settings


def build_parser():
    """The trainer's parser (every flag from the schema's sections, with the trainer's defaults) and
    ``--samples``, this entry point's short spelling of ``--eval-samples``."""
    parser = build_train_parser("logra_megatron.evaluate", __doc__.split("\n\n")[0])
    schema.add_alias(parser, "run", RunConfig, "eval_samples", "--samples")
    return parser


def parse_args(argv):
    config = parse_train_args(argv, parser=build_parser())
    # Evaluation reads the weights only, and writes no checkpoint.
    checkpoint = dataclasses.replace(config.checkpoint, load_optim=False, save=None)
    run = dataclasses.replace(config.run, output_dir=config.run.output_dir or os.path.join("runs", "evaluation"),
                              progress=False)
    return replace_settings(config, checkpoint=checkpoint, run=run)  # the run's inputs built once


@exit_on_user_error
def main(argv=None):
    config = parse_args(sys.argv[1:] if argv is None else argv)
    # megatron-core (~5 s to import) loads only after the flags were checked.
    import torch.distributed as dist

    from logra_megatron import parallel
    from logra_megatron.rl.trainer import build, evaluate

    try:
        run = build(config)
        result = evaluate(run, config.run.eval_samples)
        if dist.get_rank() == 0:
            report = {"load": config.checkpoint.load, "task": config.task.name, **result.to_dict()}
            os.makedirs(config.run.output_dir, exist_ok=True)
            path = os.path.join(config.run.output_dir, "evaluation.json")
            with open(path, "w") as handle:
                json.dump(report, handle, indent=2)
            print(result.summary_line(), flush=True)
            print(f"evaluation: {path}", flush=True)
    finally:
        parallel.destroy()


if __name__ == "__main__":
    main()
