"""What the benchmark tools share: child processes that answer with one JSON line, the timed and
tracked steps, and training-state bytes by component measured from live tensors.

``tools/benchmark_optimizer.py`` (dense Adam vs LoGRA) and ``tools/benchmark_peers.py`` (LoGRA
beside torch AdamW, GaLore, APOLLO, ...) both run each optimizer in its own process, so one
optimizer's allocations and allocator caches never show up in another's figures.
"""

import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time

from logra_megatron.errors import UserError

from logra_megatron.training import measure as _measure

# Training-state components and their measurement from live tensors are the package's, shared
# with the smoke job's --report-json (the TP/PP scaling sweep).
COMPONENTS = _measure.COMPONENTS
measure_components = _measure.measure_components


def validate_benchmark_args(args):
    """``(model config, LoGRA config)`` of a benchmark's flags, checked in the parent before any
    child starts (a bad flag is one error line, not a child's traceback)."""
    from logra_megatron.logra.config import LogRAConfig, rank_settings
    from logra_megatron.models.config import get_preset

    model = get_preset(args.preset)
    logra = LogRAConfig(**rank_settings(args), refresh_interval=args.logra_refresh_interval,
                        master=args.logra_master, embeddings=args.logra_embeddings,
                        zero1=getattr(args, "use_distributed_optimizer", False), seed=args.seed)
    logra.check_model(model)
    if args.logra_master == "bf16-sr" and not args.bf16:
        raise UserError("--logra-master bf16-sr needs --bf16")
    if args.global_batch_size % args.micro_batch_size:
        raise UserError("--global-batch-size must be a multiple of --micro-batch-size")
    if args.seq_length + 1 > model.max_seq:
        raise UserError(f"--seq-length exceeds the model's max_seq {model.max_seq}")
    return model, logra


def child_env() -> dict:
    """The environment of a child run: one thread count for every row (2 unless set).

    ``PYTHONFAULTHANDLER`` makes a child that dies of a signal (SIGABRT, SIGSEGV) print the Python
    stack it died in, so a row that fails without output still says where.
    """
    return dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), PYTHONFAULTHANDLER="1")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_command(nproc: int, script: str, *args) -> list:
    """``python -m torch.distributed.run`` on ``nproc`` local ranks (gloo on CPU)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), script, *args]


def last_json_line(text: str):
    """The last line of ``text`` that is a JSON object (libraries may print before it)."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def run_json_child(command: list, what: str, timeout: float = None) -> dict:
    """Run ``command`` and return the JSON object it printed last; a failure is a
    :class:`UserError` carrying the tail of the child's stderr."""
    try:
        child = subprocess.run(command, capture_output=True, text=True, env=child_env(), timeout=timeout)
    except subprocess.TimeoutExpired:
        raise UserError(f"the {what} run took longer than {timeout:.0f} s") from None
    answer = last_json_line(child.stdout)
    if child.returncode != 0 or answer is None:
        raise UserError(f"the {what} run failed (exit code {child.returncode}):\n"
                        f"{(child.stdout[-1500:] + child.stderr[-3000:]).strip()}")
    return answer


def run_steps(step, steps: int):
    """``steps`` calls of ``step()``, the last one inside an
    :class:`~logra_megatron.platform.memory.AllocationTracker`. Returns ``(first, last,
    seconds, tracker, untracked_peak)``: what the first and the last call returned, the median
    wall time of the untracked calls after the first (the first allocates the optimizer's state:
    a warm-up; the tracked one runs under the profiler), or the tracked call's time when there
    are none, and :func:`peak_process_bytes` read before the tracked call: the process's peak
    over its start, the build and the untracked calls, never over a step the profiler ran (on
    the CPU the profiler's allocation records would count in the RSS)."""
    from logra_megatron.platform.memory import AllocationTracker

    times, first = [], None
    for index in range(steps - 1):
        start = time.perf_counter()
        result = step()
        if index == 0:
            first = result
        else:
            times.append(time.perf_counter() - start)
    untracked_peak = peak_process_bytes()
    with AllocationTracker() as tracked:
        last = step()
    if first is None:
        first = last
    return first, last, statistics.median(times) if times else tracked.seconds, tracked, untracked_peak


def peak_process_bytes() -> int:
    """The device's peak allocated bytes on a GPU, else the process's peak RSS so far (an extra,
    coarser figure: the runtime and allocator caches are in it)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _tensors_inside(value, depth: int = 0):
    """Tensors held by ``value``: itself, the items of a list/tuple/dict, or the attributes of
    a plain object (an optimizer's projector object keeps its basis as an attribute)."""
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif depth > 3:
        return
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_inside(item, depth + 1)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_inside(item, depth + 1)
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        for item in vars(value).values():
            yield from _tensors_inside(item, depth + 1)


def measure_torch_optimizer(model, optimizer) -> dict:
    """Components of a plain ``torch.optim.Optimizer`` on ``model`` (torch AdamW, GaLore,
    APOLLO): the weights, their ``.grad`` tensors, and ``optimizer.state`` walked per
    parameter: tensors stored directly in a parameter's state are optimizer state (moments,
    step counters, norms); tensors inside an object stored there (GaLore's and APOLLO's
    projector) are projections. These optimizers keep no master copy."""
    import torch

    from logra_megatron.platform.memory import tensor_bytes

    seen = set()
    weights = tensor_bytes(model.parameters(), seen)
    grads = tensor_bytes((p.grad for p in model.parameters()), seen)
    moments, projections = [], []
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                moments.append(value)
            else:
                projections.extend(_tensors_inside(value))
    return {
        "weight_bytes": weights,
        "master_bytes": 0,
        "grad_bytes": grads,
        "sketch_bytes": 0,
        "moment_bytes": tensor_bytes(moments, seen),
        "projection_bytes": tensor_bytes(projections, seen),
        "controller_extra_bytes": 0,
    }
