"""One plug-in mechanism (schema.py: ``Registry``): tasks, rewards and sketch-space update rules
by registered name, or outside code by ``package.module:attr``.

The main test trains with a task, a reward and an update rule from tests/plugins/three_terms.py, a
module outside the package, chosen by flag only, and checks each was used: the update rule logs
its steps, the task's records (with ``--task-options``) reach the reward, and the reward's values
(offset by 1/8) are the ones in the metrics. A bad path is one ``error:`` line and exit code 2.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
from dist_harness import REPO

from logra_megatron.errors import UserError
from logra_megatron.registry import Registry

PLUGINS = REPO / "tests" / "plugins"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(PLUGINS)]))
TINY = ["--warmup-iters", "0", "--train-iters", "2", "--eval-prompts", "4", "--prompts-per-step", "2",
        "--group-size", "4", "--max-new-tokens", "4", "--micro-batch-size", "8", "--kl-probe-sequences", "2",
        "--no-progress"]
OUTSIDE = ["--task", "three_terms:ThreeTerms", "--task-options", '{"terms": 3}',
           "--reward", "three_terms:offset_reward", "--logra-update", "three_terms:SignMomentum",
           "--logra-update-options", '{"scale": 0.5}']


def train(args, env=ENV, timeout=300):
    return subprocess.run([sys.executable, "-m", "logra_megatron.train", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def test_an_outside_task_reward_and_update_rule_train_by_flag_only(tmp_path):
    log = tmp_path / "plugin.jsonl"
    proc = train([*OUTSIDE, *TINY, "--output-dir", str(tmp_path / "out")], env=dict(ENV, THREE_TERMS_LOG=str(log)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    # The task was built with its options from --task-options (its default is 2 terms).
    assert {event["terms"] for event in events if event["event"] == "task"} == {3}
    # The outside reward scored the outside task's records: each of the 8 completions a step is
    # worth 1/8 + k/4 (k = 0..3), and -1 on any other task's record or with another term count;
    # an in-package reward gives 0 to the wrong answers of an untrained policy.
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    rewards = [row["reward_mean"] for row in rows if row["phase"] == "rl"]
    assert len(rewards) == 2
    for mean in rewards:
        quarters = (mean - 0.125) * 8 / 0.25  # the sum of the eight k's
        assert mean >= 0.125 and quarters == pytest.approx(round(quarters)), rewards
    # The update rule made every optimizer step, on a non-zero sketch gradient.
    updates = [event for event in events if event["event"] == "update"]
    assert [event["step"] for event in updates] == [1, 2] and [event["sign_steps"] for event in updates] == [1, 2]
    assert any(event["grad_norm"] > 0 for event in updates)
    assert {event["scale"] for event in updates} == {0.5}  # its options, from --logra-update-options
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["finished"] and summary["steps"] == 2


@pytest.mark.parametrize("flag,value,needle", [
    ("--task", "no_such_module:Task", "no module named 'no_such_module' (is its directory on PYTHONPATH?)"),
    ("--reward", "three_terms:no_such_reward", "three_terms has no attribute 'no_such_reward'"),
    ("--logra-update", "three_terms:NOT_A_RULE", "NOT_A_RULE is not an update rule"),
    ("--logra-update", "three_terms:offset_reward", "offset_reward is not an update rule"),
    ("--reward", "three_terms:ThreeTerms", "ThreeTerms is not a reward"),
    ("--task", "three_terms:offset_reward", "it is called as attr(config)"),
    ("--task", "three_terms:NOT_A_RULE", "NOT_A_RULE is not a task"),
    ("--task-options", '{"terms": 3, "bogus": 1}', "has no option bogus"),
    ("--task-options", '{"terms": 1}', "terms must be >= 2"),
    ("--logra-update", "adamm", "unknown update rule 'adamm' (--logra-update); did you mean adam"),
    ("--logra-update-options", '{"scale": 1, "nope": 2}', "has no option nope (its options: scale)"),
    ("--logra-update-options", "[1]", "must be a JSON object"),
    ("--optimizer", "adamw", "unknown optimizer 'adamw' (--optimizer); did you mean adam"),
    ("--optimizer", "sgd_optimizer:MOMENTUM", "MOMENTUM is not an optimizer"),
])
def test_a_bad_plugin_is_one_error_line(flag, value, needle, monkeypatch, capsys):
    from logra_megatron.config import parse_train_args
    from logra_megatron.errors import one_line

    monkeypatch.syspath_prepend(str(PLUGINS))
    args = {"--task-options": ["--task", "three_terms:ThreeTerms"],
            "--logra-update-options": ["--logra-update", "three_terms:SignMomentum"]}.get(flag, [])
    try:
        parse_train_args([*args, flag, value, *TINY], world_size=1)
    except UserError as error:
        message = f"error: {one_line(error)}"
    except SystemExit as exit:  # argparse (a flag's parse=): already one line on stderr
        assert exit.code == 2
        message = capsys.readouterr().err.strip()
    else:
        raise AssertionError(f"{flag} {value} was accepted")
    assert "\n" not in message and message.startswith("error:") and needle in message, message


def test_an_outside_optimizer_trains_by_flag_only(tmp_path):
    """Megatron's SGD from tests/plugins/sgd_optimizer.py, named by --optimizer alone: built once,
    stepped every iteration, and the run's summary names it."""
    log = tmp_path / "sgd.jsonl"
    proc = train(["--optimizer", "sgd_optimizer:build_sgd", *TINY, "--output-dir", str(tmp_path / "out")],
                 env=dict(ENV, SGD_OPTIMIZER_LOG=str(log)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [event for event in events if event["event"] == "build"] == [{"event": "build", "inner": ["SGD"]}]
    assert sum(event["event"] == "step" for event in events) == 2
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["finished"] and summary["optimizer"] == "sgd_optimizer:build_sgd"


def test_an_outside_optimizer_that_builds_the_wrong_thing_is_one_line():
    proc = train(["--optimizer", "sgd_optimizer:not_an_optimizer", *TINY])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and lines, proc.stderr[-3000:]
    assert lines[-1].startswith("error:") and "not a ControlledOptimizer" in lines[-1], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_a_bad_plugin_ends_the_trainer_with_one_line_and_exit_2():
    proc = train(["--reward", "three_terms:no_such_reward", *TINY])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error:") and "no_such_reward" in lines[0], proc.stderr[-3000:]


def test_the_help_is_generated_from_the_registries():
    proc = subprocess.run([sys.executable, "-m", "logra_megatron.train", "--help"], capture_output=True, text=True,
                          env=dict(ENV, COLUMNS="10000"), cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    blocks = re.split(r"\n  (?=-)", proc.stdout)  # one block per flag: its line(s) and its help
    help_of = {block.split()[0]: " ".join(block.split()) for block in blocks if block.startswith("--")}
    # The registries as a fresh process fills them (other tests in this process register more).
    listed = subprocess.run([sys.executable, "-c", (
        "import json\n"
        "from logra_megatron.logra.config import UPDATE_RULES\n"
        "from logra_megatron.rl.rewards import REWARDS\n"
        "from logra_megatron.rl.tasks import TASKS\n"
        "from logra_megatron.training.config import OPTIMIZERS\n"
        "print(json.dumps({flag: list(registry.names(listed_only=True)) for flag, registry in "
        "(('--task', TASKS), ('--reward', REWARDS), ('--logra-update', UPDATE_RULES), ('--optimizer', OPTIMIZERS))}))")],
        capture_output=True, text=True, env=ENV, cwd=REPO, timeout=120)
    assert listed.returncode == 0, listed.stderr
    for flag, names in json.loads(listed.stdout).items():
        assert len(names) >= 2
        for name in names:
            assert f"{name} (" in help_of[flag], (flag, name)
        assert "package.module:attr" in help_of[flag]


def test_registry_names_paths_prefixes_and_errors():
    registry = Registry("widget", "--widget", accepts=lambda obj: None if callable(obj) else "not callable",
                        summary="a gadget's name")

    @registry.register("plain", help="the plain one")
    def plain():
        return "plain"

    registry.register("lazy", "json:dumps", help="imported on first use")
    registry.register("file:", len, prefix=True, shown="file:PATH", help="a file")
    registry.register("hidden", print, listed=False)
    assert registry.names() == ("plain", "lazy", "hidden", "file:PATH")
    assert registry.names(listed_only=True) == ("plain", "lazy", "file:PATH")
    assert "plain (the plain one)" in registry.help("the widget") and "hidden" not in registry.help("the widget")
    assert registry.get("plain") is plain and registry.get("file:/x") is len and registry.get("hidden") is print
    assert registry.get("lazy") is json.dumps and registry.get("os.path:join") is os.path.join
    assert registry.entry("os.path:join").outside and not registry.entry("plain").outside
    with pytest.raises(ValueError, match="already registered"):
        registry.register("plain", plain)

    @dataclasses.dataclass
    class Options:
        size: int = 1

    class WithOptions:
        options = Options

    registry.register("sized", WithOptions)
    assert registry.options_for("sized", {"size": 2}, "--widget-options") == Options(2)
    assert registry.options_for("plain", {}, "--widget-options") is None
    with pytest.raises(UserError, match="--widget-options: --widget sized has no option colour"):
        registry.options_for("sized", {"colour": 1}, "--widget-options")
    with pytest.raises(UserError, match="--widget-options: --widget plain takes no options"):
        registry.options_for("plain", {"size": 1}, "--widget-options")
    for value, needle in (("plian", "unknown widget 'plian' (--widget); did you mean plain?"),
                          ("", "--widget needs a widget"),
                          ("os.path:sep", "sep is not a widget: not callable"),
                          ("os.path:no_such", "os.path has no attribute 'no_such'")):
        with pytest.raises(UserError) as error:
            registry.get(value)
        assert needle in str(error.value) and "\n" not in str(error.value), str(error.value)
