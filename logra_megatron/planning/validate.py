"""The memory plan against a measured run: ``tools/plan_memory.py ... --validate``.

Builds the model and optimizer at the flags' layout (re-launching the tool under torchrun on
TP x PP x DP local ranks when that is more than one), runs ``--steps`` real steps (the
benchmark's step: the LM loss forward/backward through Megatron's schedule, then the KL
controller around the optimizer) and two more under
:class:`~logra_megatron.platform.memory.AllocationTracker` (on the CPU the smaller of their
peaks: the tracker's replay may keep a block a gloo thread freed unseen, see
``logra_megatron/platform/memory.py``), then compares per rank:

- every training-state component of :mod:`logra_megatron.planning.state`, measured from the live
  tensors (storages counted once, :func:`logra_megatron.training.measure.measure_components`,
  plus the norm probes' directions);
- the peak of tracked tensor allocations during the step (packed with ``pack_sequences``: each
  microbatch one ``[1, t]`` sequence of the token budget, whole rows of ``seq_length`` end to end
  through ``models/positions.py: pack_rows`` and SDPAttention's packed path, filler to the
  budget, as the trainer's pipeline fills its microbatches; the KL probe's parts packed as the
  trainer packs them, :func:`packed_probe_set`) against
  :func:`logra_megatron.planning.activations.peak_step_bytes` (``platform="cpu"`` on a machine
  without CUDA: what the CPU tracker records).

Bounds: 5% per component, 10% for the peak; a component that is 0 in both is exact. Prints a
table per rank, or with ``--json`` one object; exits with status 1 when a figure is out of
bounds.
"""

import json
import os
import socket
import subprocess
import sys
from typing import Dict, List

from logra_megatron.planning.arguments import optimizers_of, settings_from_args
from logra_megatron.planning.settings import PlanSettings

COMPONENT_BOUND = 0.05
PEAK_BOUND = 0.10
TRACKED_STEPS = 4
# The smallest of identical tracked steps is kept (``measure_settings``): a caller's tensor that
# a collective's Work outlives (a TP all-reduce's) is freed unseen by the CPU tracker when a gloo
# worker releases it, and stays counted unless its address is reused. A collective's own copy
# freed that way (gloo's reduce-scatter clone, dp2dist adam_bf16: +0.8 MB on a 1.0 MB plan in 2
# runs out of 3 on a loaded machine) is freed by the replay when the worker's run ends
# (platform/memory.py: collective_frees), whatever the timing.
MEASURED_COMPONENTS = ("weight_bytes", "master_bytes", "grad_bytes", "sketch_bytes", "norm_probe_bytes",
                       "moment_bytes", "projection_bytes", "controller_extra_bytes")
"""The state components a training run holds (a reference model and a rollout engine are not
built by the validation: those are plain weight and KV-cache sizes)."""


def relative_error(predicted: int, measured: int) -> float:
    """``(predicted - measured) / measured``; 0 when both are 0, inf when only the measurement is."""
    if measured == 0:
        return 0.0 if predicted == 0 else float("inf")
    return (predicted - measured) / measured


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _relaunch(nproc: int) -> None:
    """Run this script again under torchrun on ``nproc`` local ranks; exit with its status."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(port), os.path.abspath(sys.argv[0]),
               *sys.argv[1:]]
    sys.stdout.flush()
    sys.exit(subprocess.call(command, env=env))


def measure_settings(settings: PlanSettings, steps: int, seed: int = 1234, tracked_steps: int = TRACKED_STEPS) -> Dict:
    """Build ``settings``' model and optimizer at the current process groups (initialized for
    its TP x PP, and its virtual pipeline: ``parallel.initialize(..., virtual_pipeline=V)``), run
    ``steps`` steps and ``tracked_steps`` tracked ones; this rank's predicted and measured
    figures. Collective: every rank calls it with the same settings."""
    import gc

    import torch
    from megatron.core import parallel_state

    from logra_megatron import parallel
    from logra_megatron.models.build import model_device
    from logra_megatron.planning import activations, state
    from logra_megatron.platform import cuda_available
    from logra_megatron.platform.memory import AllocationTracker
    from logra_megatron.training.config import KLControlConfig, OptimizerSettings, RecomputeConfig
    from logra_megatron.training.kl_control import PredictedKLController, ProbeSet
    from logra_megatron.training.lm import lm_forward_backward, model_chunks
    from logra_megatron.training.measure import measure_components
    from logra_megatron.training.setup import build_trainable

    granularity = None if settings.recompute_granularity == "none" else settings.recompute_granularity
    recompute = RecomputeConfig(granularity, settings.recompute_method, settings.recompute_num_layers)
    dtype = torch.bfloat16 if settings.bf16 else torch.float32
    model, ddp, optimizer = build_trainable(
        settings.model, OptimizerSettings(kind=settings.optimizer, lr=1e-4, distributed=settings.distributed_optimizer),
        settings.logra, dtype=dtype, seed=seed, recompute=recompute, attention_backend=settings.attention_backend,
        sequence_parallel=settings.sequence_parallel, overlap_grad_reduce=settings.overlap_grad_reduce,
        ddp_bucket_size=settings.ddp_bucket_size)
    built = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if built != settings.virtual_pipeline:
        raise ValueError(f"the process groups hold {built} chunks per rank, the settings {settings.virtual_pipeline}")
    # Under a virtual pipeline the model and its DDP are lists of chunks: the bare chunks are
    # measured as one module, the DDP chunks run through the interleaved schedule.
    chunks = model_chunks(model)
    model = chunks[0] if len(chunks) == 1 and not isinstance(ddp, list) else torch.nn.ModuleList(chunks)
    # Token ids drawn on the CPU on purpose (the same batch on every device kind); this rank's
    # rows move to the model's device once.
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, settings.model.vocab, (settings.global_batch_size, settings.seq_length + 1),
                           generator=generator)
    per_replica = settings.global_batch_size // parallel.dp_size()
    device = model_device(chunks[0])
    mine = tokens[parallel.dp_rank() * per_replica:(parallel.dp_rank() + 1) * per_replica].to(device)
    rows_per_pass, _ = activations.probe_layout(settings)
    rows = mine[:min(settings.kl_probe_sequences, per_replica)]
    if settings.packed:  # the trainer's packed probe: parts of whole rows up to the token budget
        probe = packed_probe_set(rows[:, :activations.probe_row_tokens(settings)], rows_per_pass)
    else:
        probe = ProbeSet(rows, torch.ones_like(rows, dtype=torch.float), micro_batch_size=rows_per_pass)
    controller = PredictedKLController(KLControlConfig(mode=settings.kl_control, realized_interval=0,
                                                       probe_sequences=settings.kl_probe_sequences))

    if settings.packed:  # whole rows per microbatch, drawn like the padded batch's
        rows_per_microbatch = settings.tokens_per_microbatch // settings.seq_length
        sources = torch.randint(0, settings.model.vocab, (settings.num_microbatches * rows_per_microbatch,
                                                          settings.seq_length + 1),
                                generator=generator).to(device)

    def step():
        for chunk in model_chunks(ddp):
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        if settings.packed:
            loss = packed_lm_forward_backward(ddp, sources, rows_per_microbatch, settings.tokens_per_microbatch)
        else:
            loss = lm_forward_backward(ddp, mine, settings.micro_batch_size)
        return loss, controller.step(ddp, optimizer, probe)

    for _ in range(steps):
        step()
    # Several tracked steps: on the CPU a replay can only gain bytes it did not see freed (a
    # caller's tensor a gloo worker released, its address not reused, platform/memory.py), so
    # the smallest of identical steps is the closest.
    peaks = []
    for _ in range(tracked_steps):
        gc.collect()
        with AllocationTracker() as tracked:
            loss, control = step()
        peaks.append(tracked.peak_bytes)
    measured = measure_components(model, ddp, optimizer, control["controller_extra_bytes"])
    weights = getattr(optimizer, "weights", [])
    measured["norm_probe_bytes"] = sum(entry.sketch.norm_probe.numel() * entry.sketch.norm_probe.element_size()
                                       for entry in weights if entry.sketch.norm_probe is not None)
    stage, dp_rank = parallel.pp_rank(), parallel.dp_rank()
    predicted_state = state.stage_state(settings, stage, dp_rank)
    platform = "cuda" if cuda_available() else "cpu"
    step_plan = activations.activation_bytes(settings, stage, platform)
    components = {}
    for name in MEASURED_COMPONENTS:
        predicted, actual = predicted_state.get(name, 0), measured.get(name, 0)
        components[name] = {"predicted": predicted, "measured": actual, "error": relative_error(predicted, actual)}
    measured_peak = min(peaks)
    peak = {"predicted": step_plan["peak_step_bytes"], "measured": measured_peak,
            "error": relative_error(step_plan["peak_step_bytes"], measured_peak),
            "tracked_peaks": peaks}
    record = {"rank": torch.distributed.get_rank(), "tp": parallel.tp_rank(), "pp": stage, "dp": dp_rank,
              "optimizer": settings.optimizer, "bf16": settings.bf16, "platform": platform, "loss": loss,
              "packed": settings.packed, "tokens_per_microbatch": settings.tokens_per_microbatch,
              "model_chunks": len(chunks),  # as built, not as asked
              "sequence_parallel": chunks[0].config.sequence_parallel,  # as built, not as asked
              "components": components, "peak_step": peak,
              "plan_breakdown": {k: v for k, v in step_plan.items() if k != "peak_step_bytes"}}
    record["within_bounds"] = within_bounds(record)
    return record


def packed_probe_set(rows, rows_per_part: int):
    """The KL probe over ``rows`` ([n, s], every token real) as the trainer builds it packed
    (rl/grpo.py ``probe_set``): each part one packed sequence of whole rows (``pack_rows``, no
    filler) with its mask in the packed layout. The trainer bins its rows by token count
    (rl/packing.py ``token_bins``: first fit, longest first); rows of one length fill the parts
    ``rows_per_part`` at a time in row order, as here (activations.py ``probe_layout``)."""
    import torch

    from logra_megatron.models.positions import pack_rows
    from logra_megatron.training.kl_control import ProbeSet

    real = torch.ones_like(rows, dtype=torch.bool)
    parts = []
    for start in range(0, rows.shape[0], rows_per_part):
        packed = pack_rows(rows[start:start + rows_per_part], real[start:start + rows_per_part])
        mask = torch.zeros_like(packed.tokens, dtype=torch.float)
        mask[0, :packed.real_tokens] = packed.predicts.float()  # a row's last token predicts nothing
        parts.append((packed, mask))
    return ProbeSet(rows, torch.ones_like(rows, dtype=torch.float), micro_batch_size=rows_per_part, packed=parts)


def packed_lm_forward_backward(model, sources, rows_per_microbatch: int, tokens: int) -> float:
    """The LM loss's forward and backward on packed microbatches: each ``rows_per_microbatch``
    rows of ``sources`` ([rows, seq + 1]: inputs ``[:, :-1]``, labels ``[:, 1:]``) packed into one
    ``[1, tokens]`` sequence (``pack_rows``, filler to ``tokens`` as its own segment, out of the
    loss), through Megatron's schedule (the loss inside the model, as
    :func:`~logra_megatron.training.lm.lm_forward_backward` without ``vocab_size``). Returns the
    mean loss, agreed over the pipeline and DP."""
    import torch

    from logra_megatron import parallel
    from logra_megatron.models.positions import pack_rows
    from logra_megatron.training.lm import pipeline_pass

    inputs, labels = sources[:, :-1], sources[:, 1:]
    real = torch.ones_like(inputs, dtype=torch.bool)
    microbatches = []
    for start in range(0, sources.shape[0], rows_per_microbatch):
        part = slice(start, start + rows_per_microbatch)
        packed = pack_rows(inputs[part], real[part], pad_to=tokens)
        target = pack_rows(labels[part], real[part], pad_to=tokens).tokens
        loss_mask = torch.zeros(1, tokens, dtype=torch.float, device=sources.device)
        loss_mask[:, :packed.real_tokens] = 1.0
        microbatches.append((packed.tokens, packed.position_ids, packed.params, target, loss_mask))

    def forward_step(microbatch, chunk, _):
        ids, positions, params, target, loss_mask = microbatch
        output = chunk(ids, positions, None, labels=target, packed_seq_params=params)
        return output, lambda out: _packed_loss(loss_mask, out)

    # (one model chunk, or a virtual pipeline's list of them: the interleaved schedule)
    losses = pipeline_pass(model, forward_step, microbatches, seq_length=tokens, micro_batch_size=1,
                           forward_only=False)
    mean = 0.0
    if parallel.is_last_stage():
        mean = float(sum(item["lm loss"] for item in losses) / len(losses))
    return parallel.agree_on_scalar(mean)


def _packed_loss(loss_mask, per_token_loss):
    """Mean over the real tokens of one packed microbatch (Megatron's 2-tuple loss contract)."""
    loss = (per_token_loss.float() * loss_mask).sum() / loss_mask.sum().clamp(min=1)
    return loss, {"lm loss": loss.detach().clone()}


def within_bounds(record: Dict) -> bool:
    """Every component within 5%, the step's peak within 10%."""
    components_ok = all(abs(item["error"]) <= COMPONENT_BOUND for item in record["components"].values())
    return components_ok and abs(record["peak_step"]["error"]) <= PEAK_BOUND


def _gather(record) -> List:
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, record)
    return everyone


def _mib(value: int) -> str:
    return f"{value / 2**20:10.3f}"


def print_table(records: List[Dict]) -> None:
    for record in records:
        flag = "ok" if record["within_bounds"] else "OUT OF BOUNDS"
        print(f"rank {record['rank']} (tp {record['tp']} pp {record['pp']} dp {record['dp']}) "
              f"{record['optimizer']} {'bf16' if record['bf16'] else 'fp32'} [{record['platform']}]: {flag}")
        print(f"  {'component':<26}{'predicted MiB':>14}{'measured MiB':>14}{'error':>9}")
        rows = list(record["components"].items()) + [("peak_step_bytes", record["peak_step"])]
        for name, item in rows:
            error = item["error"]
            shown = "exact" if item["predicted"] == item["measured"] else f"{100 * error:+.2f}%"
            print(f"  {name:<26}{_mib(item['predicted']):>14}{_mib(item['measured']):>14}{shown:>9}")


def main_validate(args) -> int:
    """``tools/plan_memory.py --validate``: ``args`` are the planner's parsed flags (plus
    ``--steps`` and ``--json``). Returns the exit status (1: out of bounds)."""
    from logra_megatron.errors import UserError

    settings_list = [settings_from_args(args, optimizer) for optimizer in optimizers_of(args)]
    unbuilt = sorted({s.optimizer for s in settings_list} - {"adam", "logra"})
    if unbuilt:  # the trainer builds Megatron's plain Adam and LoGRA only
        raise UserError(f"--validate measures adam, adam-kl and logra; {', '.join(unbuilt)} is planned only")
    first = settings_list[0]
    if args.steps < 1:
        raise UserError(f"--steps must be >= 1, got {args.steps}")
    if first.rollout.sequences_in_flight or first.reference_model:
        raise UserError("--validate measures training only: drop --rollout-sequences and --reference-model")
    if first.sequence_parallel and not first.packed:
        # The padded probe's rows are seq_length + 1 tokens, which the sequence split over TP
        # does not take; the trainer packs under SP (rl/grpo.py pads packed microbatches to TP).
        raise UserError("--validate with --sequence-parallel measures packed microbatches: drop --no-pack-sequences")
    world = first.world_size
    if not _under_torchrun():
        if world > 1:
            _relaunch(world)
    elif int(os.environ["WORLD_SIZE"]) != world:
        raise UserError(f"--validate at TP x PP x DP = {world} ranks, but torchrun started {os.environ['WORLD_SIZE']}")
    from logra_megatron import parallel
    from logra_megatron.planning.state import check_settings

    for settings in settings_list:
        check_settings(settings)
    parallel.initialize(first.tensor_parallel, first.pipeline_parallel, seed=1234,
                        virtual_pipeline=first.virtual_pipeline)
    try:
        records = []
        for settings in settings_list:
            records.extend(_gather(measure_settings(settings, args.steps)))
        import torch.distributed as dist

        if dist.get_rank() == 0:
            if args.json:
                print(json.dumps({"bounds": {"component": COMPONENT_BOUND, "peak": PEAK_BOUND},
                                  "all_within_bounds": all(r["within_bounds"] for r in records),
                                  "ranks": records}))
            else:
                print_table(records)
        status = 0 if all(r["within_bounds"] for r in records) else 1
    finally:
        parallel.destroy()
    return status
