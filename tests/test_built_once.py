"""Built once at start-up: what ``rl/config.py: resolve`` builds to check the flags (the tokenizer,
the task source, the prompt format) is what the trainer uses, and the start-up memory plan is
computed once per optimizer it names.

The start-up runs in a child process (the trainer starts process groups), with counters on the
constructors and on the planner, up to the first evaluation, where it stops."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from dist_harness import REPO

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))

CHILD = r'''
import collections, json, sys

from logra_megatron.rl import memory_plan
from logra_megatron.rl.prompt_format import PromptFormat
from logra_megatron.rl.tasks.arithmetic import TOKENIZER_CORPUS_TASK, ArithmeticTasks
from logra_megatron.tokenizer import SentencePieceTokenizer

counts = collections.Counter()


def count(owner, name, key, when=lambda *args, **kwargs: True):
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        counts[key] += bool(when(*args, **kwargs))
        return original(*args, **kwargs)

    setattr(owner, name, counted)


count(SentencePieceTokenizer, "__init__", "tokenizer")  # the embedded tokenizer's class
# The embedded tokenizer trains on arithmetic text of its own source (rl/tasks/arithmetic.py:
# tokenizer_corpus); the run's task source is the other one.
count(ArithmeticTasks, "__init__", "tasks", lambda self, config=None: config != TOKENIZER_CORPUS_TASK)
count(PromptFormat, "__init__", "prompt_format")
count(memory_plan, "plan_memory", "plans")  # the planner's entry, as rl/memory_plan.py calls it

import logra_megatron.rl.trainer as trainer


class Started(Exception):
    """Raised at the first evaluation: everything before it is the start-up."""


def stop(run, *args, **kwargs):
    inputs = getattr(run.config, "inputs", None)  # (None before resolve kept them)
    counts["same_objects"] = int(inputs is not None and run.tokenizer is inputs.tokenizer
                                 and run.tasks is inputs.tasks and run.prompt_format is inputs.prompt_format)
    counts["planned"] = len(run.state.summary["memory_plan_bytes"])
    raise Started


trainer.record_accuracy = stop
from logra_megatron import train

try:
    train.main(sys.argv[1:])
except Started:
    print("COUNTS " + json.dumps(counts))
'''


def start_up(tmp_path, *flags):
    proc = subprocess.run([sys.executable, "-c", CHILD, "--no-progress", "--output-dir", str(tmp_path / "run"),
                           "--eval-prompts", "4", *flags], capture_output=True, text=True, timeout=300, env=ENV,
                          cwd=REPO)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("COUNTS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("COUNTS "):])


@pytest.mark.parametrize("optimizer", ["logra", "adam"])
def test_the_trainer_builds_its_inputs_and_its_plan_once(tmp_path, optimizer):
    counts = start_up(tmp_path, "--optimizer", optimizer)
    # resolve built them (flag checks before any process group), the trainer took those.
    assert counts["tokenizer"] == 1 and counts["tasks"] == 1 and counts["prompt_format"] == 1, counts
    assert counts["same_objects"] == 1, counts
    # One plan per optimizer the start-up line names (the run's, and dense Adam beside LoGRA): the
    # line and summary.json read the same plans. (Counted at the planner's entry only: how it walks
    # state.py and activations.py inside one plan is planning/'s business.)
    assert counts["planned"] == (2 if optimizer == "logra" else 1), counts
    assert counts["plans"] == counts["planned"], counts


def test_a_config_changed_after_resolve_builds_its_own_inputs():
    """``dataclasses.replace`` of a resolved config may change the task: it carries no inputs, and
    ``run_inputs`` builds those of its own sections."""
    from logra_megatron.rl.config import TrainConfig, resolve, run_inputs

    resolved = resolve(TrainConfig(), world_size=1)
    assert run_inputs(resolved) is resolved.inputs is not None
    changed = dataclasses.replace(resolved, task=dataclasses.replace(resolved.task, max_operand=4))
    assert changed.inputs is None
    built = run_inputs(changed)
    assert built.tasks is not resolved.inputs.tasks and built.tasks.config.max_operand == 4
    assert built.prompt_format.source is built.tasks


def test_evaluation_keeps_the_inputs_its_flags_built():
    """``evaluate`` changes only its checkpoint and run sections: the inputs ``resolve`` built come
    along (``replace_settings``), where a change of the task would drop them."""
    from logra_megatron.evaluate import parse_args
    from logra_megatron.rl.config import replace_settings, resolve, TrainConfig

    config = parse_args([])
    assert config.inputs is not None and config.checkpoint.save is None
    resolved = resolve(TrainConfig(), world_size=1)
    assert replace_settings(resolved, run=resolved.run).inputs is resolved.inputs
    assert replace_settings(resolved, task=dataclasses.replace(resolved.task, max_operand=4)).inputs is None
