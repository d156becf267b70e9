"""The GRPO trainer end to end on `tiny`: the same metrics at TP=2, PP=2 and TP=1; a resumed run
reproduces the uninterrupted one; flags and config files are validated in one clear line.

The runs are not degenerate: 30 warm-up iterations on operands 0..4 leave the policy solving
some prompts of a group and not others, so rewards vary within groups, advantages are non-zero
and the weights move in RL (asserted on the compared steps, so that equal metrics mean
something)."""

import json
import os
import subprocess
import sys

import pytest
from dist_harness import REPO

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
SMALL = ["--warmup-iters", "30", "--max-operand", "4", "--train-iters", "3", "--eval-prompts", "8", "--prompts-per-step", "4",
         "--group-size", "4", "--micro-batch-size", "8", "--kl-probe-sequences", "4", "--no-progress",
         "--lr", "1e-3"]


def train(args, nproc=1, timeout=600):
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc)] if nproc > 1 else []
    proc = subprocess.run([sys.executable, *launcher, "-m", "logra_megatron.train", *args],
                          capture_output=True, text=True, timeout=timeout, env=ENV, cwd=REPO)
    return proc


def metrics(output_dir):
    rows = [json.loads(line) for line in open(os.path.join(output_dir, "metrics.jsonl"))]
    return [row for row in rows if row["phase"] == "rl"]


def assert_not_degenerate(rows):
    """Rewards vary inside groups and the policy gradient is non-zero on every compared step."""
    assert rows
    for row in rows:
        assert row["reward_std"] > 0 and row["grad_norm"] > 0, row


def assert_same_grpo_steps(rows, reference, keys, steps=(1,), summary=None, reference_summary=None):
    """Two runs' RL steps agree: the same steps, the same rewards (exactly: the same rollouts) and
    each of ``keys`` within 1e-5; with summaries, the same held-out accuracies (exactly)."""
    assert [row["step"] for row in rows] == [row["step"] for row in reference] == list(steps)
    assert_not_degenerate(reference)
    if summary is not None:
        for key in ("held_out_accuracy_initial", "held_out_accuracy_before", "held_out_accuracy_after"):
            assert summary[key] == reference_summary[key], key
    for ours, theirs in zip(rows, reference):
        assert ours["reward_mean"] == theirs["reward_mean"] and ours["reward_std"] == theirs["reward_std"]
        for key in keys:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-8), key


def saved_weights(save_dir, iteration=None):
    """The model's full (TP=1, all stages) tensors of the newest (or the given) iteration under ``save_dir``,
    read from the torch_dist checkpoint without a process group (optimizer state, under Megatron's
    ``chained_<i>.`` prefixes, left out); vocabulary rows beyond the
    tokenizer's vocabulary (padding, whose size depends on TP) are dropped."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    iteration = f"iter_{iteration:07d}" if iteration is not None else \
        sorted(p for p in os.listdir(save_dir) if p.startswith("iter_"))[-1]
    path = os.path.join(save_dir, iteration)
    vocab = json.load(open(os.path.join(path, "model_config.json")))["vocab"]
    dcp_to_torch_save(path, os.path.join(save_dir, f"{iteration}.pt"))
    state = torch.load(os.path.join(save_dir, f"{iteration}.pt"), weights_only=False)
    weights = {}
    for key, value in state.items():
        if torch.is_tensor(value) and not key.startswith(("optimizer.", "logra.", "chained_")) and "_extra_state" not in key:
            weights[key] = value[:vocab] if key in ("embedding.word_embeddings.weight", "output_layer.weight") else value
    assert weights
    return weights


def assert_same_weights(ours, theirs, rtol, atol):
    import torch

    assert sorted(ours) == sorted(theirs)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=rtol, atol=atol, msg=key)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The reference run at TP=1 (warm-up + 3 RL steps), saving every iteration."""
    root = tmp_path_factory.mktemp("train")
    out, checkpoint = root / "base", root / "base-ckpt"
    proc = train([*SMALL, "--output-dir", str(out), "--save", str(checkpoint), "--save-interval", "1"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return metrics(out), json.loads((out / "summary.json").read_text()), checkpoint


@pytest.fixture(scope="module")
def layouts(base, tmp_path_factory):
    """RL step 1 at TP=1, TP=2 and PP=2 from the base run's weights after step 0 (resharded on
    load), each with fresh optimizer state, saving the weights after the step.

    One step, because exactness across layouts holds to float rounding, and LoGRA's range-finder
    refresh (at a fresh optimizer's first step, then every --logra-refresh-interval) turns
    rounding-level differences of the gradient into visible ones in basis directions near the
    rank cutoff, where singular values are nearly tied (docs/ALGORITHM.md, "Refresh"); the
    update of the refresh step itself uses the layout-independent seeded basis."""
    root = tmp_path_factory.mktemp("layouts")
    runs = {}
    for name, nproc, extra in (("tp1", 1, []), ("tp2", 2, ["--tensor-model-parallel-size", "2"]),
                               ("pp2", 2, ["--pipeline-model-parallel-size", "2"])):
        out = root / name
        proc = train([*SMALL, *extra, "--train-iters", "2", "--load", str(base[2]), "--ckpt-step", "1",
                      "--no-load-optim", "--output-dir", str(out), "--save", str(root / f"{name}-ckpt")], nproc)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[name] = (metrics(out), json.loads((out / "summary.json").read_text()),
                      saved_weights(root / f"{name}-ckpt"))
    runs["start"] = saved_weights(base[2], iteration=1)
    return runs


def test_summary_has_the_documented_fields(base):
    rows, summary, _ = base
    for key in ("held_out_accuracy_initial", "held_out_accuracy_before", "held_out_accuracy_after",
                "steps", "optimizer", "wall_time_s", "state_bytes"):
        assert key in summary
    assert summary["optimizer"] == "logra" and summary["steps"] == 3
    assert summary["state_bytes"]["logra"] < summary["state_bytes"]["dense"]
    # The planner's figure per GPU for this run, printed at start-up (rl/memory_plan.py).
    assert 0 < summary["memory_plan_bytes"]["logra"] < summary["memory_plan_bytes"]["adam"]
    assert len(rows) == 3
    assert rows[0]["lr"] > rows[1]["lr"] > rows[2]["lr"]  # cosine decay to --min-lr (0)
    for row in rows:
        for key in ("reward_mean", "reward_std", "accuracy", "kl_pred", "step_scale", "entropy",
                    "clip_fraction", "grad_norm", "tokens_per_s"):
            assert key in row


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_grpo_step_matches_tp1(layouts, layout):
    reference, reference_summary, reference_weights = layouts["tp1"]
    rows, summary, weights = layouts[layout]
    assert summary[f"{'tensor' if layout == 'tp2' else 'pipeline'}_model_parallel_size"] == 2
    assert_same_grpo_steps(rows, reference, ("loss", "entropy", "kl_pred", "grad_norm", "step_scale"),
                           summary=summary, reference_summary=reference_summary)
    # The step moved the weights by ~1e-3 (lr); the layouts agree to 1e-5 of that scale (measured
    # 2.6e-6 at most, in a few fc1 entries: Adam's first step divides by |g|, so a rounding-level
    # difference of a tiny sketch gradient becomes a few-ppm share of the step).
    before = layouts["start"]
    moved = max(float((reference_weights[key] - before[key]).abs().max()) for key in before)
    assert moved > 1e-4, moved
    assert_same_weights(weights, reference_weights, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def sequence_parallel_runs(base, tmp_path_factory):
    """RL step 1 at TP=2 from the base run's weights after step 0, without and with
    --sequence-parallel (packed, and padded with --no-pack-sequences), at --max-new-tokens 5:
    rollouts 9 columns wide, so the padded passes (loss, log-probs, KL probe and realized KL)
    must widen them to split the sequence over TP, and the packed ones fill their parts to an
    even length (3 probe rows: their parts need filling here, 4 rows happen to hold an even
    count). Plus a supervised warm-up under SP (its rows' width, 13 inputs at the default
    --max-new-tokens, is odd too), and the evaluations' sampling (without SP) in every run."""
    root = tmp_path_factory.mktemp("sequence_parallel")
    tp2 = ["--tensor-model-parallel-size", "2"]
    runs = {}
    for name, extra in (("tp2", tp2), ("tp2-sp", [*tp2, "--sequence-parallel"]),
                        ("tp2-sp-padded", [*tp2, "--sequence-parallel", "--no-pack-sequences"])):
        out = root / name
        proc = train([*SMALL, *extra, "--max-new-tokens", "5", "--kl-probe-sequences", "3", "--train-iters", "2",
                      "--load", str(base[2]),
                      "--ckpt-step", "1", "--no-load-optim", "--output-dir", str(out),
                      "--save", str(root / f"{name}-ckpt")], 2)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[name] = (metrics(out), json.loads((out / "summary.json").read_text()),
                      saved_weights(root / f"{name}-ckpt"))
    out = root / "warmup-sp"
    proc = train([*SMALL, *tp2, "--sequence-parallel", "--warmup-iters", "2", "--train-iters", "0",
                  "--output-dir", str(out)], 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs["warmup-sp"] = ([json.loads(line) for line in open(out / "metrics.jsonl")],
                         json.loads((out / "summary.json").read_text()))
    return runs


@pytest.mark.parametrize("layout", ["tp2-sp", "tp2-sp-padded"])
def test_sequence_parallelism_gives_tp2s_grpo_step(sequence_parallel_runs, layout):
    reference, reference_summary, reference_weights = sequence_parallel_runs["tp2"]
    rows, summary, weights = sequence_parallel_runs[layout]
    # the flag reached the model (the summary reads the built model's Megatron config)
    assert summary["sequence_parallel"] is True and reference_summary["sequence_parallel"] is False
    assert_same_grpo_steps(rows, reference, ("loss", "entropy", "kl_pred", "kl_realized", "grad_norm", "step_scale"),
                           summary=summary, reference_summary=reference_summary)
    assert_same_weights(weights, reference_weights, rtol=1e-5, atol=1e-5)


def test_supervised_warmup_under_sequence_parallelism_gives_tp1s_losses(base, sequence_parallel_runs):
    """The base run (TP=1) warms up with the same constant lr, so its first two iterations are
    these: the losses, and the first gradient norm (the second one differs between TP=1 and TP=2,
    with or without SP, by ~1e-4: the range-finder refresh after the first step, see ``layouts``)."""
    rows, summary = sequence_parallel_runs["warmup-sp"]
    assert summary["sequence_parallel"] is True and summary["warmup_iters"] == 2
    warmup = [row for row in rows if row["phase"] == "warmup"]
    reference = [json.loads(line) for line in open(base[2].parent / "base" / "metrics.jsonl")][:2]
    assert [row["step"] for row in warmup] == [row["step"] for row in reference] == [0, 1]
    assert all(row["phase"] == "warmup" for row in reference)
    for ours, theirs in zip(warmup, reference):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    assert warmup[0]["grad_norm"] == pytest.approx(reference[0]["grad_norm"], rel=1e-5)
    assert summary["held_out_accuracy_initial"] == base[1]["held_out_accuracy_initial"]


def test_evaluation_cli_at_tp2_equals_tp1_and_the_trainers_final_evaluation(base, tmp_path):
    _, summary, checkpoint = base
    reports = {}
    for name, nproc, extra in (("tp1", 1, []), ("tp2", 2, ["--tensor-model-parallel-size", "2"])):
        out = tmp_path / name
        proc = subprocess.run(
            [sys.executable, *(["-m", "torch.distributed.run", "--nproc-per-node", "2"] if nproc > 1 else []),
             "-m", "logra_megatron.evaluate", *SMALL, *extra, "--load", str(checkpoint), "--samples", "4",
             "--temperature", "1.0", "--output-dir", str(out)],
            capture_output=True, text=True, timeout=600, env=ENV, cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "greedy pass@1" in proc.stdout and "pass@4" in proc.stdout
        reports[name] = json.loads((out / "evaluation.json").read_text())
    assert reports["tp1"] == reports["tp2"]
    report = reports["tp1"]
    assert report["problems"] == 8 and report["samples"] == 4
    # The same weights and held-out problems as the trainer's own final evaluation.
    assert 100 * report["greedy_pass_at_1"] == pytest.approx(summary["held_out_accuracy_after"])
    assert report["pass_at_k"]["4"] >= report["pass_at_k"]["1"]
    assert report["greedy_ci95"][0] <= report["greedy_pass_at_1"] <= report["greedy_ci95"][1]


def test_resumed_run_reproduces_the_uninterrupted_one(tmp_path):
    whole = tmp_path / "whole"
    assert train([*SMALL, "--train-iters", "4", "--output-dir", str(whole),
                  "--save", str(tmp_path / "whole-ckpt")]).returncode == 0
    first = tmp_path / "first"
    ckpt = tmp_path / "ckpt"
    # Interrupted: the same run (same --train-iters, so the same lr schedule) stopped after 2.
    proc = train([*SMALL, "--train-iters", "4", "--output-dir", str(first), "--save", str(ckpt),
                  "--exit-interval", "2"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    interrupted = json.loads((first / "summary.json").read_text())
    assert interrupted["steps"] == 2 and interrupted["finished"] is False
    assert "held_out_accuracy_after" not in interrupted
    resumed = tmp_path / "resumed"
    proc = train([*SMALL, "--train-iters", "4", "--output-dir", str(resumed), "--load", str(ckpt),
                  "--save", str(ckpt)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    expected = metrics(whole)[2:]
    got = metrics(resumed)
    assert [row["step"] for row in got] == [2, 3]
    assert_not_degenerate(got)
    for ours, theirs in zip(got, expected):
        for key in ("reward_mean", "reward_std", "loss", "kl_pred", "grad_norm", "entropy", "lr"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-9), key
    assert_same_weights(saved_weights(ckpt), saved_weights(tmp_path / "whole-ckpt"), rtol=1e-6, atol=1e-7)


def test_warmup_alone_gives_several_runs_one_start(tmp_path):
    """--train-iters 0 saves the warmed-up weights (launch/parity_runs.sh: one start per seed for
    every row); a run with another optimizer loads them with --no-load-optim and starts RL from
    them, without a warm-up of its own."""
    warm = tmp_path / "warm"
    proc = train([*SMALL, "--train-iters", "0", "--output-dir", str(warm), "--save", str(warm / "ckpt")])
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((warm / "summary.json").read_text())
    assert summary["finished"] is True and summary["steps"] == 0 and summary["warmup_iters"] == 30
    assert summary["held_out_accuracy_after"] == summary["held_out_accuracy_before"]
    assert (warm / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    dense = tmp_path / "dense"
    # (With a KL budget schedule of its own: the controller starts fresh with the optimizer.)
    proc = train([*SMALL, "--train-iters", "1", "--optimizer", "adam", "--kl-control", "probe",
                  "--kl-target-final", "0.001", "--kl-target-schedule", "cosine", "--output-dir",
                  str(dense), "--load", str(warm / "ckpt"), "--no-load-optim"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    started = json.loads((dense / "summary.json").read_text())
    assert started["held_out_accuracy_before"] == summary["held_out_accuracy_before"]
    phases = [json.loads(line)["phase"] for line in open(dense / "metrics.jsonl")]
    assert phases == ["rl"]  # no warm-up of its own: one RL step from the saved start


def test_minibatches_make_clipping_act_and_dynamic_sampling_drops_tied_groups(tmp_path):
    # Old log-probs once per batch, 4 optimizer steps on it: from the second step on the policy
    # has moved, the ratio departs from 1 and the clip acts (with one step it never does). The
    # clip range is narrowed to 0.05: at the default 0.2 whether a token beyond it has an
    # advantage of the sign that binds is a coin toss on 3 tiny steps (seen both ways).
    proc = train([*SMALL, "--num-minibatches", "4", "--dynamic-sampling", "--clip-low", "0.05",
                  "--clip-high", "0.05", "--output-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics(tmp_path)
    assert_not_degenerate(rows)
    assert all(row["optimizer_steps"] == 4 for row in rows)
    assert any(row["clip_fraction"] > 0 for row in rows), rows
    assert any(row["ratio_max"] > 1.0 + 0.05 for row in rows), rows
    for row in rows:  # 4 prompts x 4 samples, tied groups left out of the loss
        expected = 16 * (1 - row["tied_group_share"]) if row["tied_group_share"] < 1 else 4
        assert row["sequences_in_loss"] == pytest.approx(expected), row
    assert any(0 < row["tied_group_share"] < 1 for row in rows), rows


def test_kl_to_reference_penalty_runs_and_is_logged(tmp_path):
    proc = train([*SMALL, "--train-iters", "2", "--kl-coef", "0.1", "--kl-estimator", "k3",
                  "--output-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics(tmp_path)
    assert all("kl" in row and row["kl"] >= 0 for row in rows)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the first step starts at the reference


@pytest.mark.parametrize("args,message", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--lr", "fast"], "argument --lr: invalid float value"),
    (["--optimizer", "sgd"], "unknown optimizer 'sgd' (--optimizer)"),
    (["--train-iters", "-1"], "--train-iters must be >= 0"),
    (["--kl-target", "0"], "--kl-target must be > 0"),
    (["--logra-rank", "1000"], "larger than the matrix"),
    (["--tensor-model-parallel-size", "2"], "world size 1 is not divisible"),
    (["--preset", "nope"], "unknown model preset"),
    (["--load", "/nonexistent"], "checkpoint directory not found"),
    (["--reward", "vibes"], "vibes"),
    (["--config", "/nonexistent.yaml"], "config file not found"),
    (["--min-lr", "1.0"], "--min-lr must be between 0 and --lr"),
    (["--held-out-fraction", "1.5"], "--held-out-fraction must be strictly between 0 and 1"),
    (["--warmup-min-lr", "1.0"], "--warmup-min-lr must be between 0 and --warmup-lr"),
    (["--exit-interval", "-1"], "--exit-interval must be >= 0"),
    pytest.param(["--sequence-parallel"], "--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits "
                 "the sequence over the tensor-parallel ranks), got 1", id="sequence-parallel-at-tp1"),
    pytest.param(["--num-layers-per-virtual-pipeline-stage", "1"], "--num-layers-per-virtual-pipeline-stage needs "
                 "--pipeline-model-parallel-size > 1 (it splits each pipeline stage into chunks), got 1",
                 id="virtual-pipeline-at-pp1"),
    pytest.param(["--num-virtual-stages-per-pipeline-rank", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
                 "say the same thing two ways; give one of them", id="virtual-pipeline-both-flags"),
    pytest.param(["--tensor-model-parallel-size", "2", "--sequence-parallel", "--logra-embeddings"],
                 "--logra-embeddings does not run under --sequence-parallel", id="sequence-parallel-embeddings"),
    pytest.param(["--overlap-grad-reduce", "--overlap-param-gather"],
                 "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce",
                 id="overlap-param-gather-without-zero1"),
    # not a trainer flag (no context-parallel path: docs/SCALING.md): refused, not ignored
    pytest.param(["--context-parallel-size", "2"], "unrecognized arguments: --context-parallel-size",
                 id="context-parallel"),
])
def test_bad_flags_are_one_clear_line(args, message):
    proc = train(args, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_config_file_keys_mirror_flags_and_flags_override(tmp_path):
    from logra_megatron.config import parse_train_args
    from logra_megatron.errors import UserError

    config = tmp_path / "run.yaml"
    config.write_text("lr: 0.01\ntensor-model-parallel-size: 1\nkl_control: linear\ngroup-size: 4\n")
    parsed = parse_train_args(["--config", str(config), "--lr", "0.02"])
    assert parsed.optimizer.lr == 0.02 and parsed.kl.mode == "linear" and parsed.advantages.group_size == 4
    bad = tmp_path / "bad.yaml"
    for text, message in (("colour: red\n", "unknown key 'colour'"), ("kl_control: maybe\n", "must be one of"),
                          ("lr: [1, 2]\n", "invalid value"), ("- 1\n", "must be a mapping"),
                          ("lr: : :\n", "not valid YAML")):
        bad.write_text(text)
        with pytest.raises(UserError, match=message):
            parse_train_args(["--config", str(bad)])


def test_rl_lr_decays_to_min_lr_and_the_warmup_lr_schedule():
    """The RL lr follows a cosine from --lr to --min-lr over --train-iters; the warm-up lr is
    constant unless --warmup-min-lr asks for a cosine to it (both through Megatron's scheduler,
    training/lr_schedule.py, as the trainer builds them)."""
    import types

    from logra_megatron.config import parse_train_args
    from logra_megatron.training.lr_schedule import build_scheduler

    config = parse_train_args(["--lr", "1e-3", "--min-lr", "1e-4", "--train-iters", "10"])
    assert config.lr_schedule.min_lr == 1e-4

    def schedule(min_lr, style, steps=5, lr=1e-2):
        optimizer = types.SimpleNamespace(param_groups=[{"lr": 0.0, "weight_decay": 0.0}])
        scheduler = build_scheduler(optimizer, max_lr=lr, min_lr=min_lr, decay_steps=steps - 1,
                                    decay_style=style)
        values = []
        for _ in range(steps):
            values.append(optimizer.param_groups[0]["lr"])
            scheduler.step(1)
        return values

    assert schedule(1e-2, "constant") == [1e-2] * 5
    values = schedule(1e-3, "cosine")
    assert values[0] == pytest.approx(1e-2) and values[-1] == pytest.approx(1e-3)
    assert values[2] == pytest.approx(5.5e-3)
    assert all(a > b for a, b in zip(values, values[1:]))


@pytest.mark.parametrize("example, extra", [("tiny_arithmetic.yaml", []),
                                            ("grpo_smollm2_cpu.yaml", ["--preset", "smollm2-135m"]),
                                            ("grpo_smollm2_gpu.yaml", ["--preset", "smollm2-135m"])])
def test_example_configs_parse(example, extra):
    """Every shipped example is a valid config (the SmolLM2 ones take the architecture from
    --load in practice; the preset stands in for it here)."""
    from logra_megatron.config import parse_train_args

    config = parse_train_args(["--config", str(REPO / "examples" / example), *extra])
    assert config.run.train_iters >= 1 and config.optimizer.kind == "logra"
    if example == "tiny_arithmetic.yaml":
        assert config.logra.rank == 0.5  # a YAML float stays a fraction of the dimension


def test_overlapped_gradient_reduction_changes_no_number(tmp_path):
    # --overlap-grad-reduce at DP=2: the dense buckets and LoGRA's sketch buckets reduce during the
    # backward (logra/sketch_overlap.py); every element is still reduced once by the same
    # all-reduce, so each logged figure equals the blocking run's. Under the distributed optimizer
    # (reduce-scatter in buckets) with --overlap-param-gather too, the weights' all-gather is left
    # to the next forward's hooks and completed before the checkpoint and each sync: the two ZeRO-1
    # runs save after step 1, before step 2's rollouts run the forward that would gather.
    runs = {}
    zero1 = ["--use-distributed-optimizer", "--save-interval", "1"]
    for name, extra in (("blocking", []), ("overlapped", ["--overlap-grad-reduce"]),
                        ("zero1", [*zero1, "--save", str(tmp_path / "zero1-ckpt")]),
                        ("zero1-overlapped", [*zero1, "--overlap-grad-reduce", "--overlap-param-gather",
                                              "--save", str(tmp_path / "zero1-overlapped-ckpt")])):
        proc = train([*SMALL, "--train-iters", "2", "--micro-batch-size", "2",
                      "--num-minibatches", "2", *extra, "--output-dir", str(tmp_path / name)], nproc=2)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[name] = metrics(tmp_path / name)
    assert_not_degenerate(runs["blocking"])
    for overlapped, blocking in (("overlapped", "blocking"), ("zero1-overlapped", "zero1")):
        assert len(runs[overlapped]) == len(runs[blocking]) == 2
        for ours, theirs in zip(runs[overlapped], runs[blocking]):
            for key in ("loss", "grad_norm", "kl_pred", "step_scale", "reward_mean"):
                assert ours[key] == theirs[key], (overlapped, key)
    # the saved weights are the updated ones (training/setup.py: gather_updated_weights), not the
    # step-1 weights the deferred gather left in the overlapped run's model
    assert_same_weights(saved_weights(tmp_path / "zero1-overlapped-ckpt", iteration=1),
                        saved_weights(tmp_path / "zero1-ckpt", iteration=1), rtol=0, atol=0)


@pytest.mark.parametrize("args,message", [
    (["--num-layers-per-virtual-pipeline-stage", "3"], "--num-layers-per-virtual-pipeline-stage 3 must divide the 2 "
                                                        "layers of a pipeline stage (4 layers over "
                                                        "--pipeline-model-parallel-size 2)"),
    (["--num-virtual-stages-per-pipeline-rank", "3"], "--num-virtual-stages-per-pipeline-rank 3 must divide the 2 "
                                                       "layers of a pipeline stage"),
    (["--num-layers-per-virtual-pipeline-stage", "1", "--rollout-engine", "vllm"],
     "--rollout-engine vllm does not take the interleaved pipeline's model chunks"),
])
def test_virtual_pipeline_flags_that_do_not_fit_the_model_are_one_line(args, message):
    # checked with the model resolved (the tiny preset: 4 layers), at PP=2 on 2 ranks, before any process group
    from logra_megatron.config import parse_train_args
    from logra_megatron.errors import UserError

    with pytest.raises(UserError) as error:
        parse_train_args([*SMALL, "--pipeline-model-parallel-size", "2", *args], world_size=2)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_both_virtual_pipeline_flags_give_megatrons_chunk_count():
    from logra_megatron.config import parse_train_args

    for flag, value in (("--num-layers-per-virtual-pipeline-stage", "1"), ("--num-virtual-stages-per-pipeline-rank", "2")):
        config = parse_train_args(["--pipeline-model-parallel-size", "2", flag, value], world_size=2)
        assert config.parallel.virtual_pipeline(config.model_config.layers) == 2
    config = parse_train_args(["--pipeline-model-parallel-size", "2"], world_size=2)
    assert config.parallel.virtual_pipeline(config.model_config.layers) is None


@pytest.fixture(scope="module")
def virtual_pipeline_runs(base, tmp_path_factory):
    """RL step 1 at PP=2, without and with Megatron's interleaved pipeline (two 1-layer chunks per
    rank), from the base run's weights after step 0 (saved without chunks), with the KL-to-reference
    penalty on (a frozen reference of chunks, its log-probs through the interleaved schedule).
    Both sample through the embedded engine (the chunks in turn), and measure the realized KL.
    Two minibatches of 8 rows: each optimizer step's loss is one packed microbatch, as is each
    part of the 4 probe rows, fewer than the interleaved schedule takes, so those passes (the
    backward too) run filled up (training/lm.py: pipeline_pass)."""
    root = tmp_path_factory.mktemp("virtual_pipeline")
    pp2 = ["--pipeline-model-parallel-size", "2", "--kl-coef", "0.1", "--kl-estimator", "k3", "--num-minibatches", "2"]
    runs = {}
    for name, extra in (("pp2", pp2), ("pp2-vpp2", [*pp2, "--num-layers-per-virtual-pipeline-stage", "1"])):
        out = root / name
        proc = train([*SMALL, *extra, "--train-iters", "2", "--load", str(base[2]), "--ckpt-step", "1",
                      "--no-load-optim", "--output-dir", str(out), "--save", str(root / f"{name}-ckpt")], 2)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[name] = (metrics(out), json.loads((out / "summary.json").read_text()),
                      saved_weights(root / f"{name}-ckpt"))
    # Each checkpoint (weights and optimizer state) resumed at the other layout for one more step:
    # chunks saved, loaded without them, and the other way round.
    for name, source, extra in (("pp2-from-vpp2", "pp2-vpp2", pp2),
                                ("pp2-vpp2-from-pp2", "pp2", [*pp2, "--num-layers-per-virtual-pipeline-stage", "1"])):
        out = root / name
        proc = train([*SMALL, *extra, "--load", str(root / f"{source}-ckpt"), "--output-dir", str(out)], 2)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[name] = metrics(out)
    return runs


def test_a_checkpoint_resumes_with_or_without_the_interleaved_pipeline(virtual_pipeline_runs):
    ours, theirs = virtual_pipeline_runs["pp2-from-vpp2"], virtual_pipeline_runs["pp2-vpp2-from-pp2"]
    assert_same_grpo_steps(ours, theirs, ("loss", "kl", "entropy", "kl_pred", "grad_norm", "step_scale"), steps=(2,))


def test_interleaved_pipeline_gives_pp2s_grpo_step(virtual_pipeline_runs):
    reference, reference_summary, reference_weights = virtual_pipeline_runs["pp2"]
    rows, summary, weights = virtual_pipeline_runs["pp2-vpp2"]
    # the chunks were built (the summary counts the model chunks this rank holds)
    assert summary["virtual_pipeline_model_parallel_size"] == 2
    assert reference_summary["virtual_pipeline_model_parallel_size"] is None
    # the start-up plan models the interleaved schedule: more passes in flight, so more bytes than 1F1B's
    assert summary["memory_plan_bytes"]["logra"] > reference_summary["memory_plan_bytes"]["logra"] > 0
    assert all(row["kl_realized"] is not None and row["kl_pred"] > 0 for row in reference)
    # sampling through the chunks: the same held-out answers and the same rollouts
    assert_same_grpo_steps(rows, reference, ("loss", "pg_loss", "kl", "entropy", "ratio_mean", "kl_pred",
                                             "kl_realized", "grad_norm", "step_scale"),
                           summary=summary, reference_summary=reference_summary)
    assert_same_weights(weights, reference_weights, rtol=1e-5, atol=1e-5)
