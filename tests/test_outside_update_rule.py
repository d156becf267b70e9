"""An update rule from outside the package (tests/plugins/muon_like.py: Muon's orthogonalised
momentum on each sketch, one fp32 momentum per sketch element) plans, measures and trains by
flag only: the planner counts the state the rule declares (logra/update_rules.py), the live
tensors of a built optimizer hold exactly that under the same component (``moment_bytes``,
training/measure.py), and the trainer takes its steps."""

import json
import os
import subprocess
import sys

import pytest
from dist_harness import REPO

PLUGINS = REPO / "tests" / "plugins"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(PLUGINS)]))
RULE = "muon_like:MuonLike"
FP32 = 4


def _plan(update: str) -> dict:
    """Stage 0's planned components of tiny under LoGRA with ``update``, from the command line,
    and its step's optimizer-phase peak. No norm probes, so ``sketch_bytes`` is the flat sketch
    buffer alone (the rule's slice)."""
    proc = subprocess.run([sys.executable, "tools/plan_memory.py", "--preset", "tiny", "--optimizer", "logra",
                           "--logra-update", update, "--logra-norm-probes", "0", "--logra-rank", "16", "--json"],
                          capture_output=True, text=True, timeout=300, env=ENV, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stage = json.loads(proc.stdout)["plans"]["logra"]["stages"][0]
    return dict(stage["components"], optimizer_peak_bytes=stage["step"]["optimizer_peak_bytes"])


def test_the_planner_counts_the_state_an_outside_rule_declares(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))
    import muon_like

    adam, muon = _plan("adam"), _plan(RULE)
    slice_numel = muon["sketch_bytes"] // FP32
    assert slice_numel > 0 and muon["sketch_bytes"] == adam["sketch_bytes"]
    # Sketch-space Adam holds two fp32 moments per sketch element and Muon one: beside the dense
    # remainder's Adam moments (the same in both plans), the plan holds what each rule declares.
    dense = adam["moment_bytes"] - 2 * slice_numel * FP32
    assert muon["moment_bytes"] - dense == muon_like.MuonLike.state_bytes(slice_numel, 0) == slice_numel * FP32
    assert muon["moment_bytes"] < adam["moment_bytes"]
    # The step's optimizer phase peaks at the rule's own temporaries (planning/activations.py):
    # Adam's declared peak (two slices) equals its held denominator plus U, Muon's (five slices)
    # is everything at its peak, so the two phase peaks differ by the two declared peaks.
    from logra_megatron.logra.update_memory import SketchAdamWMemory

    assert (muon["optimizer_peak_bytes"] - adam["optimizer_peak_bytes"]
            == muon_like.MuonLike.update_temporaries(slice_numel, 0)[0]
            - SketchAdamWMemory.update_temporaries(slice_numel, 0)[0] > 0)


def test_the_live_state_of_an_outside_rule_is_what_the_plan_counts(monkeypatch):
    import torch

    monkeypatch.syspath_prepend(str(PLUGINS))
    import muon_like

    from logra_megatron import parallel
    from logra_megatron.logra.config import LogRAConfig
    from logra_megatron.models.config import get_preset
    from logra_megatron.planning.settings import PlanSettings
    from logra_megatron.planning.state import stage_state
    from logra_megatron.platform.memory import tensor_bytes
    from logra_megatron.training.config import KLControlConfig, OptimizerSettings
    from logra_megatron.training.kl_control import PredictedKLController, ProbeSet
    from logra_megatron.training.lm import lm_forward_backward
    from logra_megatron.training.measure import measure_components
    from logra_megatron.training.setup import build_trainable

    model_config = get_preset("tiny")
    logra = LogRAConfig(rank=16, update=RULE)
    parallel.initialize(1, 1)
    model, ddp, optimizer = build_trainable(model_config, OptimizerSettings(kind="logra"), logra, dtype=torch.float32)
    tokens = torch.randint(0, model_config.vocab, (2, 17), generator=torch.Generator().manual_seed(0))
    probe = ProbeSet(tokens[:1], torch.ones(1, 17), micro_batch_size=1)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    lm_forward_backward(ddp, tokens, 2)
    control = PredictedKLController(KLControlConfig(mode="probe", realized_interval=0)).step(ddp, optimizer, probe)

    rule = optimizer.update_rule
    assert type(rule).__name__ == "MuonLike" and type(rule).__module__ == "muon_like"
    held = tensor_bytes(rule.state().values())
    assert held == muon_like.MuonLike.state_bytes(optimizer.sketch_buffer.slice_numel, 0) > 0

    measured = measure_components(model, ddp, optimizer, control["controller_extra_bytes"])
    settings = PlanSettings(model=model_config, optimizer="logra", bf16=False, logra=logra, kl_control="probe",
                            micro_batch_size=2, global_batch_size=2)
    planned = stage_state(settings, 0)
    assert {key: planned[key] for key in measured} == measured
    # the rule's share of moment_bytes, planned: what it holds (the rest is the dense remainder's Adam)
    as_adam = stage_state(settings.with_changes(logra=LogRAConfig(rank=16, update="adam")), 0)
    assert as_adam["moment_bytes"] - planned["moment_bytes"] == held
    # and logra/accounting.py, the trainer's summary of a built model, counts the same declaration
    from logra_megatron.logra.accounting import state_bytes

    accounted = state_bytes(model, logra)["logra"].optimizer_state_bytes
    assert state_bytes(model, LogRAConfig(rank=16, update="adam"))["logra"].optimizer_state_bytes - accounted == held


def test_an_outside_rule_trains_by_flag_only(tmp_path):
    log = tmp_path / "muon.jsonl"
    # three_terms' task and reward (tests/plugins/three_terms.py) score an untrained policy's
    # completions unequally, so the policy gradient is not zero: the rule has something to orthogonalise.
    args = ["--logra-update", RULE, "--task", "three_terms:ThreeTerms", "--task-options", '{"terms": 3}',
            "--reward", "three_terms:offset_reward", "--warmup-iters", "0", "--train-iters", "2", "--eval-prompts", "4",
            "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "4", "--micro-batch-size", "8",
            "--kl-probe-sequences", "2", "--no-progress", "--output-dir", str(tmp_path / "out")]
    proc = subprocess.run([sys.executable, "-m", "logra_megatron.train", *args], capture_output=True, text=True,
                          timeout=300, env=dict(ENV, MUON_LIKE_LOG=str(log)), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    updates = [json.loads(line) for line in log.read_text().splitlines()]
    assert [row["step"] for row in updates] == [1, 2]
    assert any(row["grad_norm"] > 0 and row["update_norm"] > 0 for row in updates), updates
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["finished"] and summary["steps"] == 2
    # the start-up plan was made for this rule (a rule the planner could not count would say "unavailable")
    assert summary["memory_plan_bytes"].get("logra", 0) > 0, summary["memory_plan_bytes"]


@pytest.mark.parametrize("update", ["adam", "rowadam", RULE])
def test_the_planner_reads_each_rules_own_declarations(update, monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))
    from logra_megatron.logra import update_memory
    from logra_megatron.logra.config import UPDATE_RULES

    declared = update_memory.declared_memory(update)
    rule = UPDATE_RULES.get(update)
    # The package's rules are read from torch-free classes their rule classes inherit (one
    # declaration each); an outside rule from its own class.
    assert issubclass(rule, declared)
    assert (declared is rule) == (update == RULE)
    # Norm probes and range-finder refreshes exactly for range-finder rules; RowAdam redraws.
    range_finder = update != "rowadam"
    assert update_memory.uses_norm_probes(declared) == update_memory.uses_range_finder(declared) == range_finder
    assert update_memory.state_bytes(declared, 1000, 10) == {"adam": 8000, "rowadam": 40, RULE: 4000}[update]
    peak, held = update_memory.update_temporaries(declared, 1000, 10)
    assert (peak, held) == {"adam": (8000, 4000), "rowadam": (4000, 0), RULE: (20000, 0)}[update]


def test_planning_imports_no_rule_module():
    """The package's rules are planned from their torch-free declarations: a LoGRA plan loads
    neither torch nor a rule's module (the planner's command line answers in well under a second)."""
    script = "\n".join([
        "import sys",
        "from logra_megatron.models.config import get_preset",
        "from logra_megatron.logra.config import LogRAConfig",
        "from logra_megatron.planning.plan import plan_memory",
        "from logra_megatron.planning.settings import PlanSettings",
        "for update in ('adam', 'rowadam'):",
        "    logra = LogRAConfig(update=update)",
        "    plan_memory(PlanSettings(model=get_preset('tiny'), optimizer='logra', logra=logra))",
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('logra_megatron.logra.update_')))"])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=ENV,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["['logra_megatron.logra.update_memory']"]


def test_layouts_a_rule_excludes_follow_from_its_declarations(monkeypatch):
    """ZeRO-1 and the identity projection are refused by what a rule declares (state per line,
    projections redrawn), not by its name: the same outside class is accepted, then refused once
    its declarations say so."""
    from logra_megatron.errors import UserError
    from logra_megatron.logra.config import LogRAConfig
    from logra_megatron.logra.update_memory import LINE, REDRAW

    monkeypatch.syspath_prepend(str(PLUGINS))
    import muon_like

    LogRAConfig(update=RULE, zero1=True)
    LogRAConfig(update=RULE, identity_projection=True)
    monkeypatch.setattr(muon_like.MuonLike, "state_layout", LINE)
    with pytest.raises(UserError, match="per line .*--use-distributed-optimizer") as error:
        LogRAConfig(update=RULE, zero1=True)
    assert "momentum" in str(error.value) and "\n" not in str(error.value)
    monkeypatch.setattr(muon_like.MuonLike, "projections", REDRAW)
    with pytest.raises(UserError, match="identity projection"):
        LogRAConfig(update=RULE, identity_projection=True)
