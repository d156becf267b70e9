"""examples/megatron_loop.py, the Megatron-LM-shaped loop with LoGRA swapped in by two lines, run
as a user runs it (torchrun): LoGRA's losses at TP=2, with sequence parallelism, at DP=2 with the
overlapped sketch reduction (also under the distributed optimizer), and under the interleaved pipeline (PP=3 and PP=2, with SP and
overlap too) equal TP=1's; dense Adam (Megatron's own ChainedOptimizer) likewise;
a checkpoint saved through ``dist_checkpointing`` at TP=2 x PP=2 with the interleaved pipeline
resumes at TP=1 and at PP=2 on the uninterrupted run's losses, and carries Megatron-LM's args, from
which the smoke job builds its model alone; bad flags are one line."""

import json
import os
import subprocess
import sys

import pytest
from dist_harness import REPO

from logra_megatron.models import get_preset

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
# 6 layers, so that PP=3 with one layer per virtual stage gives each rank two model chunks;
# 12 sequences a step: 6 microbatches of 2, a multiple of the pipeline size as interleaving needs.
COMMON = ["--num-layers", "6", "--global-batch-size", "12", "--train-iters", "4", "--lr-warmup-iters", "1"]
LAYOUTS = {"tp1": (1, []), "tp2": (2, ["--tensor-model-parallel-size", "2"]),
           "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
           "dp2": (2, []),
           # small buckets: several sketch all-reduces, each started by the backward
           "dp2-overlap": (2, ["--overlap-grad-reduce", "--ddp-bucket-size", "20000"]),
           # ZeRO-1: each rank owns half of every bucket, whose reduce-scatter the backward starts
           "dp2-zero1-overlap": (2, ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size",
                                     "20000"]),
           "pp3-vpp2": (3, ["--pipeline-model-parallel-size", "3", "--num-layers-per-virtual-pipeline-stage", "1"]),
           # Every feature at once, on 4 ranks: the interleaved pipeline at PP=2 (3 chunks a rank)
           # with sequence parallelism, and with DP=2 and the overlapped reduction.
           "tp2-pp2-sp-vpp3": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                   "--num-layers-per-virtual-pipeline-stage", "1", "--sequence-parallel"]),
           "pp2-dp2-vpp3-overlap": (4, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                                        "1", "--overlap-grad-reduce", "--ddp-bucket-size", "20000",
                                        "--micro-batch-size", "1"])}


def loop(args, nproc=1, timeout=600):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                           "examples/megatron_loop.py", *args], capture_output=True, text=True, timeout=timeout,
                          env=ENV, cwd=REPO)
    return proc


def direct(args, timeout=300):
    """One process without torchrun, as a user first tries a script (and as an error reads best:
    torchrun adds its own traceback of the failed child)."""
    return subprocess.run([sys.executable, "examples/megatron_loop.py", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV, cwd=REPO)


def summary(proc):
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs():
    found = {}
    for optimizer, layouts in (("logra", ("tp1", "tp2", "tp2-sp", "dp2", "dp2-overlap", "dp2-zero1-overlap", "pp3-vpp2",
                                              "tp2-pp2-sp-vpp3", "pp2-dp2-vpp3-overlap")), ("adam", ("tp1", "tp2-sp", "pp3-vpp2"))):
        for name in layouts:
            nproc, extra = LAYOUTS[name]
            found[optimizer, name] = summary(loop(["--optimizer", optimizer, *COMMON, *extra], nproc))
    return found


def test_the_loop_takes_logra_as_a_megatron_optimizer(runs):
    logra, adam = runs["logra", "tp1"], runs["adam", "tp1"]
    assert logra["optimizer"] == "LogRAOptimizer" and logra["megatron_optimizer"] is True
    assert adam["optimizer"] == "ChainedOptimizer" and adam["megatron_optimizer"] is True
    assert logra["iterations"] == adam["iterations"] == 4
    # the first loss is before any update: the same model, the same data
    assert logra["losses"][0] == adam["losses"][0]
    # the first update runs at lr 0 (one warm-up iteration from 0, Megatron's schedule), so the
    # runs part from the third loss on: LoGRA updates in sketch space
    assert logra["losses"][1] == adam["losses"][1]
    assert all(ours != theirs for ours, theirs in zip(logra["losses"][2:], adam["losses"][2:]))


@pytest.mark.parametrize("optimizer,layout", [("logra", "tp2"), ("logra", "pp3-vpp2"), ("adam", "pp3-vpp2"),
                                              ("logra", "tp2-pp2-sp-vpp3"), ("logra", "pp2-dp2-vpp3-overlap")])
def test_layouts_give_tp1s_losses(runs, optimizer, layout):
    reference = runs[optimizer, "tp1"]["losses"]
    assert runs[optimizer, layout]["losses"] == pytest.approx(reference, rel=1e-5, abs=0)


@pytest.mark.parametrize("optimizer", ["logra", "adam"])
def test_sequence_parallelism_gives_tp1s_losses(runs, optimizer):
    # Tighter than the layouts above: a norm whose sequence-parallel gradients are not summed
    # over TP (the tag models/sequence_parallel_norm.py sets) moves the losses by ~1e-6 only.
    reference = runs[optimizer, "tp1"]["losses"]
    assert runs[optimizer, "tp2-sp"]["losses"] == pytest.approx(reference, rel=5e-7, abs=0)


def test_overlapped_sketch_reduction_starts_in_the_backward_and_changes_nothing(runs):
    blocking, overlapped = runs["logra", "dp2"], runs["logra", "dp2-overlap"]
    assert blocking["sketch_buckets_started_in_backward"] is None
    started, buckets = overlapped["sketch_buckets_started_in_backward"]
    assert buckets > 1 and started == buckets  # every bucket's all-reduce began before optimizer.step()
    # each element reduced once by the same collective: the blocking run's losses, to the bit
    assert overlapped["losses"] == blocking["losses"]
    assert blocking["losses"] == pytest.approx(runs["logra", "tp1"]["losses"], rel=1e-5, abs=0)
    # under the distributed optimizer, per-bucket reduce-scatters, every one started by the backward
    # (bit-equality with the same buckets reduced after the backward: tests/test_logra_parallel.py)
    zero1 = runs["logra", "dp2-zero1-overlap"]
    assert zero1["sketch_buckets_started_in_backward"] == [buckets, buckets]
    assert zero1["losses"] == pytest.approx(runs["logra", "tp1"]["losses"], rel=1e-5, abs=0)


def test_a_tp2_pp2_vpp_checkpoint_resumes_at_tp1_and_at_pp2_on_the_uninterrupted_losses(runs, tmp_path):
    nproc, layout = LAYOUTS["tp2-pp2-sp-vpp3"]
    first = summary(loop(["--optimizer", "logra", *COMMON, *layout, "--save", str(tmp_path), "--exit-interval", "2"],
                         nproc))
    assert first["iterations"] == 2 and (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2"
    uninterrupted = runs["logra", "tp1"]["losses"]
    assert first["losses"] == pytest.approx(uninterrupted[:2], rel=1e-5, abs=0)
    for nproc, layout in ((1, []), (2, ["--pipeline-model-parallel-size", "2"])):
        resumed = summary(loop(["--optimizer", "logra", *COMMON, *layout, "--load", str(tmp_path)], nproc))
        assert resumed["iterations"] == 4
        assert resumed["losses"] == pytest.approx(uninterrupted[2:], rel=1e-5, abs=0), layout
    # Megatron-LM's args in its common state: the smoke job builds the model from them alone
    smoke = subprocess.run([sys.executable, "-m", "logra_megatron.smoke", "--load", str(tmp_path), "--train-iters", "1",
                            "--seq-length", "16", "--global-batch-size", "2", "--micro-batch-size", "2"],
                           capture_output=True, text=True, timeout=300, env=ENV, cwd=REPO)
    six_layers = get_preset("tiny").with_changes(layers=6)
    assert smoke.returncode == 0 and f"params={six_layers.num_parameters():,}" in smoke.stdout, smoke.stderr[-2000:]
    # the same checkpoint under the other optimizer: one line naming the checkpoint, exit 2
    other = direct(["--optimizer", "adam", *COMMON, "--load", str(tmp_path)])
    assert other.returncode == 2 and f"error: --load {tmp_path}/iter_0000002: " in other.stderr, other.stderr[-2000:]
    assert "Traceback" not in other.stderr


@pytest.mark.parametrize("args,message", [
    (["--pipeline-model-parallel-size", "1", "--num-layers-per-virtual-pipeline-stage", "1"],
     "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"),
    (["--lr-warmup-iters", "4"], "--lr-warmup-iters (4) must be < --train-iters (4)"),
    (["--num-layers", "0"], "--num-layers must be >= 1"),
    (["--load", "/nonexistent"], "--load: checkpoint directory not found: '/nonexistent'"),
    (["--load", "examples"], "no latest_checkpointed_iteration.txt"),
    # the schema's checks, with the trainer's messages
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1"),
    (["--preset", "no-such-preset"], "unknown model preset 'no-such-preset'"),
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
])
def test_bad_flags_are_one_line(args, message):
    proc = direct(["--train-iters", "4", *args])
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


# --- the smoke job (logra_megatron.smoke) takes the same Megatron flags -------------------------------

def smoke(args, nproc):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                           "-m", "logra_megatron.smoke", "--optimizer", "logra", "--train-iters", "3",
                           "--global-batch-size", "8", *args], capture_output=True, text=True, timeout=600, env=ENV,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [float(line.split()[3]) for line in proc.stdout.splitlines() if line.startswith("step ")]


def test_the_smoke_job_runs_sequence_parallel_overlapped_and_interleaved_on_tp1s_losses():
    reference = smoke([], 1)
    assert len(reference) == 3
    assert smoke(["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2) == pytest.approx(reference, rel=1e-5)
    assert smoke(["--overlap-grad-reduce"], 2) == pytest.approx(reference, rel=1e-5)
    # ZeRO-1 with both of Megatron's overlaps: the dense weights' all-gather ahead of the next forward
    assert smoke(["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"], 2) == \
        pytest.approx(reference, rel=1e-5)
    # all of Megatron's at once (issue 31's command): TP2 x PP2, two model chunks a rank, SP, overlap
    everything = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                  "--num-layers-per-virtual-pipeline-stage", "1", "--sequence-parallel", "--overlap-grad-reduce"]
    assert smoke(everything, 4) == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("args,message", [
    (["--num-layers-per-virtual-pipeline-stage", "1"], "needs --pipeline-model-parallel-size > 1"),
    (["--num-layers-per-virtual-pipeline-stage", "1", "--report-json", "r.json"], "runs without --load and --report-json"),
    (["--context-parallel-size", "2"], "--context-parallel-size > 1 is not supported"),
    (["--sequence-parallel"], "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (["--overlap-param-gather", "--overlap-grad-reduce"], "--overlap-param-gather needs --use-distributed-optimizer"),
])
def test_the_smoke_job_refuses_what_it_cannot_run_in_one_line(args, message):
    proc = subprocess.run([sys.executable, "-m", "logra_megatron.smoke", *args], capture_output=True, text=True,
                          timeout=300, env=ENV, cwd=REPO)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
