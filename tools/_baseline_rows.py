"""How ``tools/benchmark_optimizer.py`` builds each of the planner's rows
(``logra_megatron/planning/settings.py: ROWS``), and why a row cannot be built where it cannot.

- ``adam``: Megatron-Core's dense Adam as users run it (no KL controller).
- ``adam-kl``: the same optimizer under our predicted-KL controller.
- ``logra``: LoGRA.
- ``adam-8bit``: Megatron's optimizer (fp32 gradient buffer, fp32 masters of bf16 weights) whose
  inner torch optimizer is bitsandbytes' ``AdamW8bit`` over the same parameter groups: block-wise
  8-bit moments. bitsandbytes (0.50.2 checked) runs it on the CPU as well.
- ``adam-precision-aware``: Megatron-Core's ``use_precision_aware_optimizer`` with the distributed
  optimizer, bf16 ``main_grads_dtype`` (so DDP reduces in bf16), 16-bit master remainders and
  moments in ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``. megatron-core 0.16.1 needs Transformer
  Engine for it (see :data:`WHY_UNAVAILABLE`).
- ``adam-cpu-offload``: ``optimizer_cpu_offload`` with ``--optimizer-offload-fraction`` and the
  distributed optimizer (``HybridDeviceOptimizer``); it adds ``use_precision_aware_optimizer``
  (as slime's recipe runs it, the masters then kept by the offload alone) only where Transformer
  Engine imports, since megatron-core's config check needs TE for that flag even with offload.
"""

import importlib.util

WHY_UNAVAILABLE = {
    "adam-precision-aware": (
        "megatron-core 0.16.1 needs Transformer Engine for use_precision_aware_optimizer: "
        "OptimizerConfig.__post_init__ (optimizer/optimizer_config.py) calls is_te_min_version('2.1.0'), "
        "which fails when TE is not installed, then requires TE's FusedAdam (master_weight_dtype, "
        "exp_avg_dtype, exp_avg_sq_dtype, use_decoupled_grad); TE needs CUDA. Its bytes are the planner's "
        "arithmetic (logra_megatron/optim/dense_memory.py)"),
    "adam-cpu-offload": (
        "megatron-core 0.16.1's HybridDeviceOptimizer (optimizer/cpu_offloading/hybrid_optimizer.py) offloads "
        "only parameters on CUDA (param.is_cuda: offload_threshold is a fraction of the CUDA elements), and its "
        "step() fetches each host parameter's GPU twin from cpu_copys_map_gpu_param, which holds offloaded "
        "parameters only; with --overlap-cpu-optimizer-d2h-h2d it also creates torch.cuda.Stream() when built: "
        "without CUDA it cannot step. Its bytes are the planner's arithmetic "
        "(logra_megatron/optim/dense_memory.py)"),
    "adam-8bit": "bitsandbytes does not import; pip install bitsandbytes (the package's 'benchmark' extra)",
}
"""Why a row may not build here, read from the source named; the row's JSON carries it with the
error that was raised."""

MOMENT_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp8": "uint8"}
"""``--exp-avg-dtype`` -> the torch dtype megatron-core's config takes (its fp8 moments are
``torch.uint8`` with TE's scaling)."""


MAY_FAIL_HERE = ("adam-precision-aware", "adam-cpu-offload")
"""Rows whose build or first step may fail for want of CUDA or Transformer Engine: their failure
there is reported as the row's reason, not raised."""


class RowUnavailable(Exception):
    """The row cannot run on this machine; the message says why."""


def unavailable(row: str, error: Exception, where: str) -> RowUnavailable:
    message = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
    if isinstance(error, KeyError) and error.args and hasattr(error.args[0], "shape"):
        message = f"a tensor of shape {tuple(error.args[0].shape)} is not a key"  # not the tensor's values
    return RowUnavailable(f"{WHY_UNAVAILABLE[row]}; here: {where} raised {type(error).__name__}: {message}")


def transformer_engine_imports() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def optimizer_overrides(row: str, args) -> dict:
    """Megatron ``OptimizerConfig`` fields of ``row`` beyond what every row shares."""
    import torch

    if row == "adam-precision-aware":
        return dict(use_precision_aware_optimizer=True, main_grads_dtype=torch.bfloat16,
                    exp_avg_dtype=getattr(torch, MOMENT_DTYPE_NAMES[args.exp_avg_dtype]),
                    exp_avg_sq_dtype=getattr(torch, MOMENT_DTYPE_NAMES[args.exp_avg_sq_dtype]),
                    store_param_remainders=True)
    if row == "adam-cpu-offload":
        return dict(optimizer_cpu_offload=True, optimizer_offload_fraction=args.optimizer_offload_fraction,
                    overlap_cpu_optimizer_d2h_h2d=args.overlap_cpu_optimizer_d2h_h2d,
                    use_precision_aware_optimizer=transformer_engine_imports())
    return {}


def uses_distributed_optimizer(row: str, args) -> bool:
    """Megatron requires the distributed optimizer for precision-aware Adam; the planner assumes it
    for the offload, as slime's recipe runs it (planning/settings.py: settings_for_row)."""
    return args.use_distributed_optimizer or row in ("adam-precision-aware", "adam-cpu-offload")


def controller_mode(row: str, args) -> str:
    """The KL controller's mode of ``row``: the dense baselines run without one; ``adam-kl`` under
    ``--kl-control`` (``probe`` where that is off); LoGRA as ``--kl-control`` says."""
    if row == "logra":
        return args.kl_control
    if row == "adam-kl":
        return "probe" if args.kl_control == "off" else args.kl_control
    return "off"


def swap_in_8bit_adam(optimizer, args) -> None:
    """Replace the torch Adam inside each of Megatron's dense optimizers by bitsandbytes' AdamW8bit
    over the same parameter groups (the fp32 masters), before any step created state."""
    try:
        import bitsandbytes
    except Exception as error:  # ImportError, or its native library failing to load
        raise RowUnavailable(f"{WHY_UNAVAILABLE['adam-8bit']} ({type(error).__name__}: {error})") from None
    for part in optimizer.dense:
        inner = part.optimizer
        # Megatron's betas/eps/weight decay, as every row (training/setup.py: build_trainable).
        part.optimizer = bitsandbytes.optim.AdamW8bit(
            inner.param_groups, lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def build_row(row: str, args, model_config, logra_config, dtype):
    """``(model, ddp, optimizer)`` of ``row`` at TP = PP = 1, or :class:`RowUnavailable`."""
    from logra_megatron.training.config import OptimizerSettings
    from logra_megatron.training.setup import build_trainable

    settings = OptimizerSettings(kind="logra" if row == "logra" else "adam", lr=args.lr, clip_grad=1.0,
                                 distributed=uses_distributed_optimizer(row, args))
    if row == "adam-8bit":
        try:  # before the model is built: a missing package is reported at once
            import bitsandbytes  # noqa: F401
        except Exception as error:
            raise RowUnavailable(f"{WHY_UNAVAILABLE[row]} ({type(error).__name__}: {error})") from None
    try:
        built = build_trainable(model_config, settings, logra_config, dtype=dtype, seed=args.seed,
                                attention_backend=args.attention_backend,
                                optimizer_overrides=optimizer_overrides(row, args))
    except Exception as error:
        if row not in MAY_FAIL_HERE:
            raise
        raise unavailable(row, error, "building it") from None
    if row == "adam-8bit":
        swap_in_8bit_adam(built[2], args)
    return built
