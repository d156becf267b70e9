"""The CPU adapter: lets megatron-core's own code paths run on a machine without CUDA.

megatron-core calls CUDA in a few hundred places (``torch.cuda.current_device()``,
``device="cuda"``, ``Tensor.cuda()``, stream and event objects, type-string checks, the CUDA
RNG). Patching them one call site at a time is hopeless, so this module installs a small set of
process-wide stand-ins, once, and only when no GPU is present (``setup_platform`` decides). Each
patch below names the megatron-core 0.16 sites it serves. This is the only module in the project
that patches Megatron or torch for the CPU (checkpoint.py sets one cache of Megatron's file writer).
"""

import contextlib
import time

import torch
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
from torch.overrides import TorchFunctionMode

_INSTALLED = False


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return False


_BF16_PRODUCTS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm,
                  torch.bmm, torch.Tensor.bmm, torch.addmm, torch.baddbmm, torch.nn.functional.linear}


def _to_fp32(value):
    return value.float() if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16 else value


class _WidenedBf16Product(torch.autograd.Function):
    """One bf16 matrix product computed in fp32 and rounded to bf16, saving only the bf16 inputs.

    Autograd of a plain ``func(a.float(), b.float())`` would save the fp32 copies for backward
    (a full fp32 copy of every weight and activation that enters a product), which would falsify
    every bf16 memory measurement on the CPU. Here backward widens the saved bf16 inputs again
    and differentiates the fp32 product: the gradients are those of the fp32 product, rounded to
    the inputs' dtypes, at the cost of recomputing one product.
    """

    @staticmethod
    def forward(ctx, func, arg_spec, kwargs, *tensors):
        ctx.func, ctx.arg_spec, ctx.kwargs = func, arg_spec, kwargs
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return func(*_fill_args(arg_spec, [_to_fp32(t) for t in tensors]), **kwargs).to(torch.bfloat16)

    @staticmethod
    def backward(ctx, grad_output):
        saved = ctx.saved_tensors
        wide = [t.detach().float().requires_grad_(need) for t, need in zip(saved, ctx.needs_input_grad[3:])]
        wanted = [w for w in wide if w.requires_grad]
        grads = iter(())
        if wanted:
            with torch.enable_grad():
                out = ctx.func(*_fill_args(ctx.arg_spec, wide), **ctx.kwargs)
            grads = iter(torch.autograd.grad(out, wanted, grad_output.float()))
        result = [next(grads).to(t.dtype) if w.requires_grad else None for t, w in zip(saved, wide)]
        return (None, None, None, *result)


def _fill_args(arg_spec, tensors):
    tensors = iter(tensors)
    return [next(tensors) if slot is _TENSOR_SLOT else slot for slot in arg_spec]


_TENSOR_SLOT = object()


def _widened_bf16_product(func, args, kwargs):
    arg_spec = [_TENSOR_SLOT if isinstance(a, torch.Tensor) else a for a in args]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        with torch.no_grad():
            return func(*_fill_args(arg_spec, [_to_fp32(t) for t in tensors]), **kwargs).to(torch.bfloat16)
    return _WidenedBf16Product.apply(func, arg_spec, kwargs, *tensors)


class _CudaDeviceToCpuMode(TorchFunctionMode):
    """Rewrites CUDA devices to the CPU in every torch call, and runs bf16 matrix products the
    way a GPU's tensor cores do.

    Devices: serves literal ``device="cuda"`` / ``device=torch.cuda.current_device()`` in factory
    calls (pipeline_parallel/schedules.py ``total_num_tokens``, distributed/param_and_grad_buffer.py,
    optimizer/grad_scaler.py, pipeline_parallel/p2p_communication.py shape tensors,
    transformer/module.py, models/gpt/gpt_model.py) and ``tensor.to("cuda")``.

    bf16 products: CPUs without AVX-512-BF16 have no fast bf16 GEMM (measured on this project's
    machines, AVX2: a 2048x576x1536 product 49x slower in bf16 than in fp32, a tiny-model step
    3.8x slower). A tensor core multiplies bf16 inputs exactly, accumulates in fp32 and rounds
    the output to bf16; here the inputs are widened to fp32 (exact), multiplied, and the result
    rounded to bf16: the same arithmetic, at fp32 speed, differentiable (the backward's products
    run in fp32 too; only the bf16 inputs are saved, see ``_WidenedBf16Product``). Calls with
    ``out=`` or tensor keyword arguments run unchanged. Everything else, weights and activations
    included, stays in bf16. Serves the linear layers (tensor_parallel/layers.py and LoGRA's sketching linears, both
    ``torch.matmul``) and attention (transformer/dot_product_attention.py, ``torch.baddbmm`` /
    ``torch.bmm``).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs:
            device = kwargs.get("device")
            if device is not None and _is_cuda_device(device):
                kwargs = dict(kwargs, device="cpu")
        if args and func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda_device(a) else a for a in args)
        if func in _BF16_PRODUCTS and any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args):
            if not kwargs or set(kwargs) <= {"bias"} and kwargs.get("bias") is None:
                return _widened_bf16_product(func, args, {})
            if set(kwargs) <= {"beta", "alpha"}:
                return _widened_bf16_product(func, args, dict(kwargs))
        return func(*args, **(kwargs or {}))


class _StandInStream:
    """A CUDA stream stand-in: CPU work is already ordered, so every wait is a no-op.

    Serves distributed/param_and_grad_buffer.py (``torch.cuda.current_stream()`` in the grad
    sync) and distributed/distributed_data_parallel.py (``torch.cuda.Stream``).
    """

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _StandInEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _StandInEvent:
    """A ``torch.cuda.Event`` stand-in timed with ``perf_counter``.

    Serves inference/engines (static engine timing) and ``elapsed_time`` users.
    """

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self._time = None

    def record(self, stream=None):
        self._time = time.perf_counter()

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def elapsed_time(self, end_event) -> float:
        return (end_event._time - self._time) * 1000.0


def _cpu_current_device():
    """``torch.cuda.current_device()`` -> ``"cpu"``, so that ``device=torch.cuda.current_device()``
    allocates on the CPU (utils.py GlobalMemoryBuffer, tensor_parallel mappings and layers,
    p2p_communication.py, rotary_pos_embedding.py, distrib_optimizer.py)."""
    return "cpu"


def _install_type_strings():
    """Make ``Tensor.type()`` report CUDA type names for CPU tensors.

    optimizer/optimizer.py, optimizer/distrib_optimizer.py and optimizer/clip_grads.py accept
    parameters only when ``param.type()`` is ``'torch.cuda.FloatTensor'`` (or the half/bf16
    names); the CPU tensors report ``'torch.FloatTensor'``. Conversions to a CUDA type name are
    mapped to the CPU type of the same dtype.
    """
    original_type = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original_type(self)
            if self.device.type == "cpu" and name.startswith("torch.") and ".cuda." not in name:
                return "torch.cuda." + name[len("torch.") :]
            return name
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = "torch." + dtype[len("torch.cuda.") :]
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_


class CpuRNGStatesTracker(CudaRNGStatesTracker):
    """Megatron's named RNG streams (data-parallel, model-parallel, expert) on CPU generators.

    Installed as megatron's ``_CUDA_RNG_STATE_TRACKER`` (tensor_parallel/random.py): weight
    init, dropout inside ``fork()`` and activation recompute all go through it. The states are
    CPU generator states; ``fork`` swaps the process's CPU generator state in and out, which is
    what the CUDA tracker does with the device generator. It subclasses megatron's tracker so
    that ``isinstance`` checks (``get_all_rng_states``) accept it.
    """

    def __init__(self, *args, **kwargs):
        self.reset()
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = False

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed)
        self.states_[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        outer_state = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer_state)


def _install_rng_tracker():
    """Route megatron's CUDA RNG plumbing (tensor_parallel/random.py) to the CPU generator.

    ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` are used by activation recompute
    (``CheckpointFunction``) and the tracker; ``torch.cuda.manual_seed`` is called by
    ``model_parallel_cuda_manual_seed`` for the default (data-parallel) stream.
    """

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mcore_random._get_cuda_rng_state = get_state
    mcore_random._set_cuda_rng_state = set_state
    mcore_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: that one must stay a no-op.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda seed: None
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)


def install_cpu_adapter() -> None:
    """Install every stand-in above, once per process. Only call this without CUDA."""
    global _INSTALLED
    if _INSTALLED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("the CPU adapter must not be installed on a CUDA machine")

    torch.cuda.current_device = _cpu_current_device
    # p2p_communication.py (batch_p2p_comm / variable_seq_lengths) and timers synchronize.
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_stream = lambda device=None: _StandInStream()
    torch.cuda.default_stream = lambda device=None: _StandInStream()
    torch.cuda.Stream = _StandInStream
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.Event = _StandInEvent
    # language_module.py (tied embeddings) and grad_scaler.py call .cuda() on tensors.
    torch.Tensor.cuda = lambda self, device=None, non_blocking=False, **kwargs: self
    torch.nn.Module.cuda = lambda self, device=None: self
    _install_type_strings()
    _install_rng_tracker()
    _CudaDeviceToCpuMode().__enter__()
    _INSTALLED = True
