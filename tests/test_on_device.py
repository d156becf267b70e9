"""Where the state lives. After building, and again after a rollout, a controlled LoGRA step (a
KL forecast on the rollouts, a commit, a projection refresh) and a dense Adam step, every
parameter, buffer, sketch, projection, moment, master and probe buffer is on the model's device,
and the model is on the process's device.

On the CPU (CI) the walk checks that nothing is left behind on another device by the same
code; the ``gpu``-marked twins run the same walk on CUDA, where a tensor created without
``device=`` shows up as a CPU tensor (tests/test_device_discipline.py finds those statically).
"""

import pytest
import torch

from logra_megatron import parallel
from logra_megatron.logra import LogRAConfig
from logra_megatron.models import get_preset
from logra_megatron.platform import default_device
from logra_megatron.rl.grpo import probe_and_held_out
from logra_megatron.rollout.megatron_engine import MegatronEngine
from logra_megatron.rollout.types import SamplingConfig
from logra_megatron.training.config import KLControlConfig, OptimizerSettings
from logra_megatron.training.kl_control import PredictedKLController
from logra_megatron.training.lm import lm_forward_backward
from logra_megatron.training.setup import build_trainable

MODEL = get_preset("tiny")
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]  # of different lengths: left padding on the device


def state_tensors(model, optimizer) -> dict:
    """Every tensor the model and its optimizer hold, by a descriptive name."""
    tensors = {f"param {name}": param for name, param in model.named_parameters()}
    tensors.update({f"buffer {name}": buffer for name, buffer in model.named_buffers()})
    for name, module in model.named_modules():
        inv_freq = getattr(module, "inv_freq", None)  # Megatron's rotary table: a plain attribute
        if isinstance(inv_freq, torch.Tensor):
            tensors[f"rotary {name}"] = inv_freq
    buffer = getattr(optimizer, "sketch_buffer", None)
    if buffer is None:
        return tensors
    tensors["sketch buffer"] = buffer.flat
    for entry in buffer.weights:
        sketch = entry.sketch
        tensors[f"projection {entry.name}"] = sketch.projection
        tensors[f"anchor {entry.name}"] = entry.module.logra_anchor
        for field in ("test_matrix", "range_sample", "norm_probe"):
            if getattr(sketch, field, None) is not None:
                tensors[f"{field} {entry.name}"] = getattr(sketch, field)
    tensors.update({f"moment {name}": tensor for name, tensor in optimizer.update_rule.state().items()})
    tensors.update({f"master {name}": tensor for name, tensor in optimizer.masters.masters.items()})
    if optimizer.norm_estimator is not None:
        tensors["norm probes"] = optimizer.norm_estimator.flat
    return tensors


def misplaced(tensors: dict, device: torch.device) -> list:
    return sorted(f"{name}: {tensor.device}" for name, tensor in tensors.items() if tensor.device != device)


def walk(kind: str, dtype=torch.float32, master: str = "fp32", update: str = "adam") -> dict:
    """Build, roll out, take two controlled steps; the misplaced tensors found at each stage."""
    parallel.initialize(1, 1, seed=1234)
    logra = LogRAConfig(rank=8, refresh_interval=1, master=master, embeddings=True, update=update)
    model, ddp, optimizer = build_trainable(MODEL, OptimizerSettings(kind=kind, lr=1e-3, clip_grad=1.0),
                                            logra, dtype=dtype)
    device = default_device()
    found = {"model device": [] if next(model.parameters()).device == device else [str(device)],
             "after build": misplaced(state_tensors(model, optimizer), device)}
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=4, samples_per_prompt=2, seed=3,
                              vocab_size=MODEL.vocab)
    rollouts = MegatronEngine(ddp).generate(PROMPTS, sampling)
    found["rollouts"] = misplaced({"tokens": rollouts.tokens, "attention_mask": rollouts.attention_mask,
                                   "position_ids": rollouts.position_ids,
                                   "response_mask": rollouts.response_mask}, device)
    probe, held_out = probe_and_held_out(rollouts, 2, 2, MODEL.vocab)
    found["probe"] = misplaced({"tokens": probe.tokens, "mask": probe.mask}, device)
    controller = PredictedKLController(KLControlConfig(mode="probe", realized_interval=1))
    # A CPU batch on purpose: the forward moves it (tokens come from host tokenizers).
    tokens = torch.randint(0, MODEL.vocab, (4, 9), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        lm_forward_backward(ddp, tokens, 2)
        control = controller.step(ddp, optimizer, probe, held_out)
        assert control["success"] and control["kl_pred"] is not None
    found["after steps"] = misplaced(state_tensors(model, optimizer), device)
    if kind == "logra":
        found["steps committed"] = [] if optimizer.step_count == 2 else [f"step_count {optimizer.step_count}"]
    return found


CASES = [("logra", torch.float32, "fp32", "adam"), ("logra", torch.bfloat16, "fp32", "adam"),
         ("logra", torch.bfloat16, "bf16-sr", "adam"), ("logra", torch.float32, "fp32", "rowadam"),
         ("adam", torch.bfloat16, "fp32", "adam")]


@pytest.mark.parametrize("kind,dtype,master,update", CASES)
def test_everything_lives_on_the_process_device(kind, dtype, master, update):
    found = walk(kind, dtype, master, update)
    assert all(not wrong for wrong in found.values()), found


@pytest.mark.gpu
@pytest.mark.parametrize("kind,dtype,master,update", CASES)
def test_everything_lives_on_cuda(kind, dtype, master, update):
    assert default_device().type == "cuda"
    found = walk(kind, dtype, master, update)
    assert all(not wrong for wrong in found.values()), found


def test_the_walk_finds_a_tensor_left_on_another_device():
    """The walk itself: a projection moved off the model's device is reported."""
    parallel.initialize(1, 1, seed=1234)
    model, _, optimizer = build_trainable(MODEL, OptimizerSettings(kind="logra"), LogRAConfig(rank=8))
    entry = optimizer.sketch_buffer.weights[0]
    entry.sketch.projection = entry.sketch.projection.to("meta")
    assert misplaced(state_tensors(model, optimizer), default_device()) == [f"projection {entry.name}: meta"]


def tp2_shards_equal_tp1(monkeypatch) -> dict:
    """Fresh weights at TP=2, emulated in one process: each TP rank's shard of every
    tensor-parallel parameter (drawn as that rank draws it) against the same slice of the TP=1
    model's fresh parameter. Returns the worst difference by name (all 0.0 when equal)."""
    from logra_megatron.models.weights import fresh_shard, global_indices

    parallel.initialize(1, 1, seed=1234)
    model, _, _ = build_trainable(MODEL, OptimizerSettings(kind="adam"), seed=17)
    worst = {}
    for name, param in model.named_parameters():
        if not getattr(param, "tensor_model_parallel", False):
            continue
        dim = param.partition_dim
        for rank in range(2):
            monkeypatch.setattr(parallel, "tp_size", lambda: 2)
            monkeypatch.setattr(parallel, "tp_rank", lambda rank=rank: rank)
            shape = list(param.shape)
            shape[dim] //= 2
            stand_in = torch.empty(shape, dtype=param.dtype, device=param.device)
            stand_in.tensor_model_parallel, stand_in.partition_dim = True, dim
            shard = fresh_shard(stand_in, name, name, MODEL.vocab, 17, 0.02, MODEL.layers)
            rows = global_indices(stand_in, name, dim)  # where this rank's slice sits in the full tensor
            monkeypatch.undo()
            expected = param.detach().index_select(dim, rows)
            worst[name] = max(worst.get(name, 0.0), float((shard - expected).abs().max()))
    return worst


def test_fresh_weights_of_an_emulated_tp2_rank_equal_tp1():
    with pytest.MonkeyPatch.context() as monkeypatch:
        worst = tp2_shards_equal_tp1(monkeypatch)
    assert worst and set(worst.values()) == {0.0}, worst


@pytest.mark.gpu
def test_fresh_weights_of_an_emulated_tp2_rank_equal_tp1_on_cuda():
    assert default_device().type == "cuda"
    with pytest.MonkeyPatch.context() as monkeypatch:
        worst = tp2_shards_equal_tp1(monkeypatch)
    assert worst and set(worst.values()) == {0.0}, worst
