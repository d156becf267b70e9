"""Megatron's flags with Megatron's meanings (issue 34): a Megatron-LM GRPO command line parses
and means what it means there; every refused value is one ``error:`` line and exit 2; the lr
schedule flags drive Megatron's ``OptimizerParamScheduler``; a --load start needs no warm-up."""

import importlib.machinery
import json
import math
import os
import subprocess
import sys
import types

import pytest
from dist_harness import REPO
from local_tokenizers import hf_tokenizer_folder

from logra_megatron.checkpoint import save_model_config
from logra_megatron.config import build_parser, parse_train_args
from logra_megatron.errors import UserError
from logra_megatron.models import PRESETS
from logra_megatron.rl.config import DEFAULT_WARMUP_ITERS, lr_phases_line

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))

# What verl's and slime's Megatron examples pass (the subset a GRPO trainer has a use for).
MEGATRON_GRPO_LINE = [
    "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
    "--global-batch-size", "64", "--micro-batch-size", "8", "--seq-length", "128",
    "--lr", "1e-6", "--min-lr", "1e-7", "--lr-decay-style", "WSD", "--lr-wsd-decay-style", "linear",
    "--lr-wsd-decay-iters", "5", "--lr-decay-iters", "15", "--lr-warmup-iters", "2", "--train-iters", "20",
    "--weight-decay", "0.01", "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--clip-grad", "1.0",
    "--bf16", "--transformer-impl", "local", "--untie-embeddings-and-output-weights", "--use-checkpoint-args",
    "--ckpt-format", "torch_dist", "--exit-signal-handler", "--seed", "42", "--no-progress",
]


def test_a_megatron_grpo_command_line_means_what_it_means_there():
    config = parse_train_args(MEGATRON_GRPO_LINE, world_size=1)
    # Rollout rows per step: 64 rows of --group-size 8 are 8 prompts.
    assert config.global_batch_size == 64 and config.rollout.prompts_per_step == 8
    assert config.rollout.seq_length == 128
    schedule = config.lr_schedule
    assert (schedule.lr_decay_style, schedule.lr_wsd_decay_style, schedule.lr_wsd_decay_iters) == ("WSD", "linear", 5)
    assert schedule.decay_iters(config.run.train_iters) == 15
    assert config.optimizer.weight_decay == 0.01 and config.optimizer.adam_beta2 == 0.98
    assert config.run.exit_signal_handler is True and config.checkpoint.ckpt_format == "torch_dist"
    assert config.model.transformer_impl == "local" and config.model.bf16
    # The tiny preset is untied already; the flag is accepted and the model stays untied.
    assert config.model_config.tie_embeddings is False


def test_global_batch_size_and_prompts_per_step_decide_each_other():
    assert parse_train_args(["--global-batch-size", "32", "--group-size", "4"], world_size=1).rollout.prompts_per_step == 8
    agreed = parse_train_args(["--global-batch-size", "32", "--prompts-per-step", "4"], world_size=1)
    assert agreed.rollout.prompts_per_step == 4 and agreed.global_batch_size == 32
    default = parse_train_args([], world_size=1)
    assert default.rollout.prompts_per_step == 16 and default.global_batch_size == 16 * 8
    with pytest.raises(UserError, match="disagree"):
        parse_train_args(["--global-batch-size", "32", "--prompts-per-step", "8"], world_size=1)


def test_exit_signal_handler_is_accepted_and_on_by_default():
    assert parse_train_args(["--exit-signal-handler"], world_size=1).run.exit_signal_handler is True
    assert parse_train_args([], world_size=1).run.exit_signal_handler is True
    assert parse_train_args(["--no-exit-signal-handler"], world_size=1).run.exit_signal_handler is False


def test_untie_embeddings_unties_a_tied_preset():
    assert PRESETS["smollm2-135m"].tie_embeddings
    parser_args = ["--preset", "smollm2-135m", "--untie-embeddings-and-output-weights"]
    args = build_parser().parse_args(parser_args)
    assert vars(args)["model.untie_embeddings_and_output_weights"] is True
    from logra_megatron.rl.config import _untied, ModelSourceConfig

    untied = _untied(ModelSourceConfig(preset="smollm2-135m", untie_embeddings_and_output_weights=True),
                     PRESETS["smollm2-135m"], load_dir=None)
    assert untied.tie_embeddings is False
    with pytest.raises(UserError, match="ties its embeddings"):
        _untied(ModelSourceConfig(untie_embeddings_and_output_weights=True), PRESETS["smollm2-135m"], load_dir="ckpt")


def test_seq_length_caps_prompt_plus_response():
    with pytest.raises(UserError, match="exceeds --seq-length 10"):
        parse_train_args(["--seq-length", "10", "--max-new-tokens", "6"], world_size=1)
    assert parse_train_args(["--seq-length", "64"], world_size=1).rollout.seq_length == 64


REFUSED = [
    (["--ckpt-format", "torch"], "only torch_dist"),
    (["--transformer-impl", "transformer_engine"], "transformer_engine is not supported"),
    (["--fp16"], "--fp16 is not supported"),
    (["--global-batch-size", "64", "--prompts-per-step", "4"], "disagree"),
    (["--global-batch-size", "60"], "multiple of --group-size"),
    (["--lr-decay-style", "WSD"], "needs --lr-wsd-decay-iters"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "30", "--train-iters", "20"], "exceeds"),
    (["--lr-wsd-decay-iters", "3"], "needs --lr-decay-style WSD"),
    (["--lr-wsd-decay-style", "square"], "invalid choice"),
    (["--lr-decay-iters", "0"], "--lr-decay-iters must be >= 1"),
    (["--seq-length", "100000"], "exceeds the max sequence length 256"),
    (["--wandb-exp-name", "run"], "need --wandb-project"),
]


@pytest.mark.parametrize("argv, message", REFUSED)
def test_every_refused_value_is_one_error_line_and_exit_2(argv, message, capsys):
    from logra_megatron.train import main

    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err


def test_wandb_project_without_wandb_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed (find_spec then raises)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    from logra_megatron.train import main

    with pytest.raises(SystemExit) as stopped:
        main(["--wandb-project", "grpo"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1 and "needs wandb" in err[0]


def test_wandb_logs_offline_the_scalars_tensorboard_gets(monkeypatch, tmp_path):
    calls = []
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)

    class FakeRun:
        summary = {}

        def log(self, values):
            calls.append(("log", values))

        def finish(self):
            calls.append(("finish", None))

    fake.init = lambda **kwargs: calls.append(("init", kwargs)) or FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = parse_train_args(["--wandb-project", "grpo", "--output-dir", str(tmp_path / "run")], world_size=1)
    settings = config.run.wandb_settings(str(tmp_path / "run"))
    assert settings == {"project": "grpo", "name": "run", "dir": str(tmp_path / "run" / "wandb")}
    from logra_megatron.rl.metrics import MetricsLogger

    logger = MetricsLogger(str(tmp_path / "run"), str(tmp_path / "tb"), total=1, progress=False,
                           wandb_settings=settings)
    logger.step(0, {"reward_mean": 0.5, "kl_pred": float("nan")})
    logger.finish({"steps": 1})
    assert calls[0] == ("init", dict(mode="offline", resume="allow", **settings))
    assert ("log", {"rl/reward_mean": 0.5}) in calls and calls[-1] == ("finish", None)


def _schedule(config, steps):
    """The RL lrs the trainer's scheduler sets over ``steps`` iterations."""
    from logra_megatron.rl.trainer import rl_scheduler

    optimizer = types.SimpleNamespace(param_groups=[{"lr": 0.0, "weight_decay": 0.0}])
    run = types.SimpleNamespace(config=config, optimizer=optimizer,
                                state=types.SimpleNamespace(step=0, skipped_steps=0))
    scheduler = rl_scheduler(run)
    values = []
    for _ in range(steps):
        values.append(optimizer.param_groups[0]["lr"])
        scheduler.step(1)
    return values


def test_wsd_holds_the_lr_then_decays_over_its_last_iters_with_megatrons_scheduler():
    config = parse_train_args(["--lr", "1e-3", "--min-lr", "1e-4", "--train-iters", "20", "--lr-decay-style", "WSD",
                               "--lr-wsd-decay-iters", "10", "--lr-wsd-decay-style", "linear"], world_size=1)
    values = _schedule(config, 21)
    assert values[:11] == [pytest.approx(1e-3)] * 11  # stable until 20 - 10
    assert values[15] == pytest.approx(1e-4 + 0.5 * 9e-4)  # linear: half-way at 15
    assert values[20] == pytest.approx(1e-4)
    assert all(a > b for a, b in zip(values[10:], values[11:]))


def test_lr_decay_iters_ends_the_decay_before_train_iters():
    config = parse_train_args(["--lr", "1e-3", "--min-lr", "1e-4", "--train-iters", "10", "--lr-decay-iters", "4",
                               "--lr-decay-style", "linear"], world_size=1)
    values = _schedule(config, 10)
    assert values[2] == pytest.approx(1e-4 + 0.5 * 9e-4)
    assert values[4:] == [pytest.approx(1e-4)] * 6


def _pretrained_checkpoint(directory):
    """A single checkpoint as tools/convert_hf_to_mcore.py leaves it, as far as the config
    resolution reads it (the architecture)."""
    save_model_config(PRESETS["tiny"], str(directory))
    return str(directory)


def test_a_load_start_has_no_warmup_by_default_and_the_summary_says_which_lr_governs(tmp_path):
    fresh = parse_train_args([], world_size=1)
    assert fresh.warmup.iters == DEFAULT_WARMUP_ITERS == 150
    line = lr_phases_line(fresh)
    assert "supervised warm-up 150 steps at --warmup-lr 0.003" in line and "RL 500 iters at --lr 0.0003" in line
    loaded = parse_train_args(["--load", _pretrained_checkpoint(tmp_path / "pretrained")], world_size=1)
    assert loaded.warmup.iters == 0
    assert lr_phases_line(loaded).startswith("lr: no supervised warm-up (a checkpoint is loaded); RL 500 iters at --lr")
    # Asked for, the warm-up runs on a checkpoint too.
    asked = parse_train_args(["--load", str(tmp_path / "pretrained"), "--warmup-iters", "5"], world_size=1)
    assert asked.warmup.iters == 5


def test_weight_decay_default_is_stated():
    help_text = " ".join(build_parser().format_help().split())
    assert "0.0 here, not Megatron's 0.01" in help_text
    assert parse_train_args([], world_size=1).optimizer.weight_decay == 0.0


def test_the_issue_command_line_runs(tmp_path):
    """The issue's command line end to end (about 10 s on the tiny default): WSD holds --lr for
    10 of the 20 iterations, then decays; 64 rollout rows a step."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "logra_megatron.train", "--global-batch-size", "64", "--seq-length", "128",
         "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "10", "--train-iters", "20", "--warmup-iters", "0",
         "--exit-signal-handler", "--ckpt-format", "torch_dist", "--output-dir", str(out), "--no-progress",
         "--eval-prompts", "8"],
        capture_output=True, text=True, timeout=300, env=ENV, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "lr: no supervised warm-up (--warmup-iters 0); RL 20 iters at --lr 0.0003 (WSD" in proc.stdout
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [row["phase"] for row in rows] == ["rl"] * 20
    lrs = [row["lr"] for row in rows]
    assert lrs[:11] == [pytest.approx(3e-4)] * 11 and all(a > b for a, b in zip(lrs[10:], lrs[11:]))
    assert all(row["sequences_in_loss"] == 64 for row in rows if not row["skipped"])
    assert json.loads((out / "summary.json").read_text())["finished"] is True
    assert not math.isnan(lrs[-1])


# --- launch scripts (issue 34, item 7): the project's .venv when it exists, and they say which Python.

FAKE_PYTHON = """#!/bin/sh
echo "$0 $*" >> "$FAKE_LOG"
case "$1" in -c) echo "Python 3.fake" ;; esac
exit 0
"""


def _launch_copy(tmp_path, venv=True):
    """The launch scripts in a repository of their own whose .venv (when ``venv``) holds a fake
    Python that records how it was called."""
    import hashlib
    import shutil

    root = tmp_path / "repo"
    shutil.copytree(REPO / "launch", root / "launch")
    shutil.copy(REPO / "setup.py", root / "setup.py")
    log = tmp_path / "calls.log"
    bin_dir = root / ".venv" / "bin" if venv else tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "python3"):
        (bin_dir / name).write_text(FAKE_PYTHON)
        (bin_dir / name).chmod(0o755)
    if venv:
        (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
        # setup_env.sh's stamp: installed already, nothing to do.
        digest = hashlib.sha256((root / "setup.py").read_bytes()).hexdigest()[:16]
        (root / ".venv" / ".logra_installed").write_text(f"{digest} extras=[]\n")
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHON", "LOGRA_VENV", "VIRTUAL_ENV")}
    env.update(FAKE_LOG=str(log), PATH=f"{bin_dir if not venv else '/usr/bin'}{os.pathsep}/usr/bin{os.pathsep}/bin")
    return root, env, log, bin_dir / "python"


@pytest.mark.parametrize("script, args, skip_setup, called", [
    ("gpu_check.sh", ["--cpu", "out"], False, "tools/gpu_check.py --cpu out"),
    ("quickstart.sh", ["--train-iters", "1"], False, "-m logra_megatron.train --train-iters 1"),
    ("torchrun_single_node.sh", ["2", "logra_megatron.smoke"], True,
     "-m torch.distributed.run --standalone --nproc-per-node 2 -m logra_megatron.smoke"),
    ("torchrun_single_node.sh", ["2", "logra_megatron.smoke"], False,
     "-m torch.distributed.run --standalone --nproc-per-node 2 -m logra_megatron.smoke"),
    ("scaling_sweep.sh", ["--layouts", "1x1", "--optimizers", "adam", "--out", "sweep"], True,
     "-m torch.distributed.run --standalone --nproc-per-node 4 -m logra_megatron.smoke"),
])
def test_launch_scripts_run_the_projects_venv_and_say_so(tmp_path, script, args, skip_setup, called):
    root, env, log, python = _launch_copy(tmp_path)
    if skip_setup:
        env["LOGRA_SKIP_SETUP"] = "1"
    proc = subprocess.run(["bash", str(root / "launch" / script), *args], capture_output=True, text=True,
                          timeout=60, env=env, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"[launch] python: {python} (Python 3.fake)" in proc.stdout
    calls = log.read_text().splitlines()
    assert any(line.startswith(str(python)) and called in line for line in calls), calls


def test_without_a_venv_the_scripts_run_python3_and_say_so(tmp_path):
    root, env, log, python3 = _launch_copy(tmp_path, venv=False)
    python3 = python3.with_name("python3")
    proc = subprocess.run(["bash", str(root / "launch" / "gpu_check.sh"), "--cpu", "out"], capture_output=True,
                          text=True, timeout=60, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert f"[launch] python: {python3} (Python 3.fake)" in proc.stdout
    assert any(line.startswith(str(python3)) and "tools/gpu_check.py" in line for line in log.read_text().splitlines())


def test_every_launch_script_picks_its_python_in_one_place():
    """No script runs a bare ``python`` or ``torchrun`` (whichever is first on PATH): each takes
    ``$PYTHON`` from launch/python_env.sh (directly or through setup_env.sh)."""
    import re

    scripts = sorted((REPO / "launch").glob("*.sh"))
    assert len(scripts) >= 9
    for path in scripts:
        text = path.read_text()
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        if path.name != "python_env.sh":
            assert "python_env.sh" in code or "setup_env.sh" in code, path.name
        assert not re.search(r"(^|[\s(;&|])(python|torchrun)\s", code, flags=re.M), path.name


# --- tokenizers (issue 34, item 8): Megatron-LM's HuggingFaceTokenizer with a local folder.

def test_huggingface_tokenizer_from_a_local_folder_as_megatron_names_it(tmp_path):
    folder = hf_tokenizer_folder(tmp_path / "tokenizer")
    config = parse_train_args(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(folder)],
                              world_size=1)
    from logra_megatron.rl.tokenizers import build_run_tokenizer

    tokenizer = build_run_tokenizer(config.model, config.load_dir)
    assert str(tokenizer.tokenizer_file) == str(folder / "tokenizer.json") and tokenizer.eos_id == 0
    assert tokenizer.decode(tokenizer.encode("12+7=")) == "12+7="
    # A fresh tiny model gets as many embedding rows as the tokenizer has ids (Megatron sizes a
    # fresh model's vocabulary from its tokenizer), also beyond the preset's 256.
    assert config.model_config.vocab == tokenizer.vocab_size
    wide = hf_tokenizer_folder(tmp_path / "wide", vocab_size=400)
    config = parse_train_args(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(wide)],
                              world_size=1)
    assert config.model_config.vocab > 256


def test_a_folder_without_tokenizer_json_says_how_to_make_one(tmp_path, capsys):
    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "merges.txt").write_text("")
    from logra_megatron.train import main

    with pytest.raises(SystemExit) as stopped:
        main(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1
    assert "no tokenizer.json" in err[0] and "merges.txt, vocab.json" in err[0] and "save_pretrained" in err[0]


# --- restarts (issue 34, item 5): a torchrun restart without --load resumes from --save.

def test_a_torchrun_restart_without_load_resumes_from_the_newest_checkpoint_under_save(tmp_path, monkeypatch,
                                                                                       capsys):
    from logra_megatron.checkpoint_layout import iteration_dir, write_manifest

    save = tmp_path / "ckpt"
    for number in (2, 4):
        save_model_config(PRESETS["tiny"], iteration_dir(str(save), number))
        write_manifest(iteration_dir(str(save), number))
    os.makedirs(iteration_dir(str(save), 6))  # a save cut short: no manifest, skipped
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert parse_train_args(["--save", str(save)], world_size=1).load_dir is None  # the first attempt
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    config = parse_train_args(["--save", str(save)], world_size=1)
    assert config.load_dir == iteration_dir(str(save), 4)
    assert f"torchrun restart 1: no --load given, so the newest complete checkpoint under --save {save}: " \
           f"resuming from {iteration_dir(str(save), 4)}" in capsys.readouterr().out
    # Nothing saved yet: the restart starts over, and says so.
    config = parse_train_args(["--save", str(tmp_path / "empty")], world_size=1)
    assert config.load_dir is None and "starts over" in capsys.readouterr().out
    # An explicit --load wins.
    config = parse_train_args(["--save", str(save), "--load", str(save), "--ckpt-step", "2"], world_size=1)
    assert config.load_dir == iteration_dir(str(save), 2)


def test_a_restarted_run_continues_where_it_saved(tmp_path):
    """Two attempts of one job, as torchrun runs them after a rank died: the first stops after
    iteration 2 (saved), the second (TORCHELASTIC_RESTART_COUNT=1, the same flags, no --load)
    goes on from iteration 2 instead of starting again with the warm-up."""
    out, save = tmp_path / "out", tmp_path / "ckpt"
    common = ["--warmup-iters", "2", "--max-operand", "4", "--train-iters", "3", "--eval-prompts", "4",
              "--prompts-per-step", "2", "--group-size", "2", "--micro-batch-size", "4", "--kl-probe-sequences", "2",
              "--no-progress", "--save", str(save), "--save-interval", "1", "--output-dir", str(out)]

    def attempt(extra, restart):
        env = dict(ENV, TORCHELASTIC_RESTART_COUNT=str(restart))
        return subprocess.run([sys.executable, "-m", "logra_megatron.train", *common, *extra], capture_output=True,
                              text=True, timeout=300, env=env, cwd=REPO)

    first = attempt(["--exit-interval", "2"], 0)
    assert first.returncode == 0, first.stderr[-3000:]
    second = attempt([], 1)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from" in second.stdout and "warm-up 1/2" not in second.stdout
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [(row["phase"], row["step"]) for row in rows] == [("warmup", 0), ("warmup", 1), ("rl", 0), ("rl", 1),
                                                             ("rl", 2)]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_the_smoke_job_takes_the_same_megatron_flags_with_the_same_refusals(capsys):
    from logra_megatron.smoke import main, parse_args

    args = parse_args(["--global-batch-size", "8", "--seq-length", "32", "--transformer-impl", "local",
                       "--ckpt-format", "torch_dist"])
    assert (args.global_batch_size, args.seq_length, args.transformer_impl, args.ckpt_format) == \
        (8, 32, "local", "torch_dist")
    for argv, message in ((["--transformer-impl", "transformer_engine"], "not supported yet"),
                          (["--ckpt-format", "zarr"], "only torch_dist"), (["--fp16"], "--fp16 is not supported")):
        with pytest.raises(SystemExit) as stopped:
            main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert stopped.value.code == 2 and len(err) == 1 and err[0].startswith("error:") and message in err[0], err


def test_exit_signal_handler_as_a_yaml_key_says_the_value_itself(tmp_path):
    for text, expected in (("exit-signal-handler: true\n", True), ("exit_signal_handler: false\n", False),
                           ("no-exit-signal-handler: true\n", False)):
        (tmp_path / "run.yaml").write_text(text)
        assert parse_train_args(["--config", str(tmp_path / "run.yaml")], world_size=1).run.exit_signal_handler \
            is expected, text
    (tmp_path / "run.yaml").write_text("exit-signal-handler: true\nno-exit-signal-handler: true\n")
    with pytest.raises(UserError, match="set the same option"):
        parse_train_args(["--config", str(tmp_path / "run.yaml")], world_size=1)
