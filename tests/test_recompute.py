"""Activation recomputation (--recompute-granularity / --recompute-method /
--recompute-num-layers, Megatron's flags and meanings): bad combinations are one clean error
before anything is built, and recomputation changes no number, only memory: a tiny smoke run's
losses are the same with and without it."""

import pytest

from logra_megatron import smoke
from logra_megatron.config import parse_train_args
from logra_megatron.errors import UserError
from logra_megatron.training.config import RecomputeConfig


@pytest.mark.parametrize("argv, needle", [
    (["--recompute-granularity", "full"], "needs --recompute-method"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"], "needs --recompute-method"),
    (["--recompute-method", "block"], "need --recompute-granularity full"),
    (["--recompute-num-layers", "2"], "need --recompute-granularity full"),
    (["--recompute-granularity", "selective", "--recompute-method", "uniform"], "selective"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"], "selective"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "0"], ">= 1"),
    # tiny has 4 layers: 5 exceed a stage, 3 do not divide it
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "5"], "exceeds"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "3"], "divide"),
])
def test_bad_recompute_flags_are_one_error(argv, needle):
    with pytest.raises(UserError, match=needle):
        parse_train_args(argv, world_size=1)


def test_recompute_flags_reach_the_config():
    config = parse_train_args(["--recompute-granularity", "full", "--recompute-method", "block",
                               "--recompute-num-layers", "2"], world_size=1)
    assert config.recompute == RecomputeConfig("full", "block", 2)
    assert config.recompute.transformer_kwargs() == {
        "recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2}
    assert parse_train_args([], world_size=1).recompute == RecomputeConfig()


def test_the_smoke_job_rejects_a_bad_combination_in_one_line(capsys):
    with pytest.raises(SystemExit):
        smoke.main(["--recompute-method", "uniform"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--recompute-granularity full" in err[0]


def _losses(*flags):
    return smoke.run(smoke.parse_args(["--train-iters", "2", "--global-batch-size", "4", "--seq-length", "16",
                                       *flags]))


@pytest.mark.parametrize("optimizer", ["adam", "logra"])
def test_recomputation_gives_the_same_losses(optimizer):
    from logra_megatron import parallel

    try:
        plain = _losses("--optimizer", optimizer)
        full = _losses("--optimizer", optimizer, "--recompute-granularity", "full", "--recompute-method", "uniform",
                       "--recompute-num-layers", "2")
        selective = _losses("--optimizer", optimizer, "--recompute-granularity", "selective")
    finally:
        parallel.destroy()
    assert plain[0] > 0 and plain[0] != plain[-1]  # the steps moved the weights
    assert full == plain
    assert selective == plain
