"""Rollouts sampled by vLLM (``--rollout-engine vllm``), with the trainer's weights pushed in.

:class:`VLLMEngine` is a :class:`~logra_megatron.rollout.remote_engine.RemoteEngine`: where it
runs (the replica's first rank), the weight sync (gathered, converted to Hugging Face names,
streamed in buckets), the low-rank sync, the broadcast of the sampled rows to the replica's other
ranks and the restart of an engine that failed mid-sync are the base's
(logra_megatron/rollout/remote_engine.py). What is vLLM's is here and in its worker extension
(logra_megatron/rollout/vllm_worker.py):

**The process.** A one-process job keeps the engine in its process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor): it builds in 2-3 s instead of
15-27 s and the weights are handed over as tensors. A multi-rank job (TP, PP or DP > 1) cannot:
vLLM forms its torch.distributed groups over the existing world, which would need every rank to
take part. There the engine runs in processes of its own, spawned (a forked child would inherit
the trainer's process groups), and each call's tensors cross through a file in shared memory
(vLLM's RPC does not carry them). vLLM's tensor parallelism is 1. vLLM is imported only here, and
only when the engine first runs; the trainer reaches this module only through the registry's
dynamic import.

**What the engine is built from.** A ``config.json`` written from our :class:`ModelConfig` by the
converter's :func:`hf_config_from_model_config` in a temporary folder; the engine starts with
dummy weights and is sent the real ones right away. Our tokenizers stay ours: prompts go in as
token ids and the engine has no tokenizer (``skip_tokenizer_init``).

**Vocabulary.** Megatron pads the embedding and the output layer; the engine is built with the
real vocabulary (``SamplingConfig.vocab_size``, the tokenizer's) and the sync slices both to it,
so the engine's softmax runs over the same logits the trainer's log-probs use.

**Loading weights.** The worker's ``reload_weights`` (vLLM's) loads each layer and re-runs the
CPU backend's weight repacking as soon as the layer is complete, over one stream of all the
buckets. The prefix cache is reset after every change of the weights, or prompts sharing a
prefix would reuse keys and values computed with the old ones.

**Sampling.** :class:`SamplingConfig` maps onto vLLM's ``SamplingParams`` with the same meaning:
temperature 0 is greedy, top-k 0 keeps all, ``n`` = samples per prompt (greedy: the prompt repeated,
vLLM allows no n > 1 there), and a row stops after
``eos_id`` (the model's own EOS is ignored: only ``eos_id`` stops). Seeds: a per-request seed
crashes vLLM's CPU sampler when a batch needs chunked prefill, so requests carry none; instead
the engine draws from torch's global generator, which is re-seeded with ``SamplingConfig.seed``
for the call (inside ``torch.random.fork_rng``, so the trainer's own stream is untouched). The
same seed, prompts and weights give the same tokens; the stream differs from the Megatron
engine's. An engine in processes of its own batches requests as they arrive, so there each
request carries a seed derived from ``SamplingConfig.seed`` and its index (and chunked prefill,
which crashes the CPU sampler's per-request generators, is off). The engine returns the log-prob
of each sampled token under the distribution it sampled from after temperature (``logprobs_mode="processed_logprobs"``), as ``Rollouts.logprobs``;
with top-k or top-p on, that distribution is the filtered one (renormalized), which the trainer's
log-probs (temperature only) are not.

**Limits.** vLLM's CPU attention has kernels for head dims 32, 64, 80, ... only (not the tiny
preset's 16: the trainer widens such a preset's heads to 32 for this engine, see
``heads_for_the_engine`` in logra_megatron/rl/config.py); the engine says so when it is built.
:meth:`VLLMEngine.close` must run before the trainer destroys its process groups (vLLM's own
teardown of an in-process engine would destroy the trainer's default group).
"""

import json
import os
import shutil
import tempfile
from dataclasses import replace
from typing import List, Optional, Sequence

import torch

from logra_megatron import parallel
from logra_megatron.convert.hf import hf_config_from_model_config
from logra_megatron.engine_memory import RESERVES_ONE_KV_CACHE
from logra_megatron.errors import UserError
from logra_megatron.models.build import unwrap_model
from logra_megatron.models.config import ModelConfig
# The names this module had before the remote-engine base was split out of it stay importable
# from here (the vLLM tests import rollouts_from_completions from this module).
from logra_megatron.rollout.remote_engine import (  # noqa: F401
    COMMIT_LOG_LIMIT, MIB, POLICY_SYNCS, RemoteEngine,
    rollouts_from_completions, weight_buckets)
from logra_megatron.rollout.types import SamplingConfig

INSTALL = "pip install -e .[rollout]"
WORKER_EXTENSION = "logra_megatron.rollout.vllm_worker.LowRankWeights"


def import_vllm():
    """The ``vllm`` module; a one-line :class:`UserError` saying how
    to install it when it is missing or does not load."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # Errors only (set VLLM_LOGGING_LEVEL to see more): every reload logs a warning for the
    # rotary embedding (a buffer, nothing to send) and the engine's start a chat-template one
    # (there is no tokenizer), neither of which concerns this engine.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import vllm
    except ImportError as error:
        raise UserError(f"--rollout-engine vllm needs vLLM, which is not installed or does not load "
                        f"({error}); install it with: {INSTALL}") from None
    return vllm



def check_head_dim(head_dim: int) -> None:
    """A :class:`UserError` when vLLM's CPU attention has no kernel for ``head_dim`` (it has
    none below 32, e.g. for the tiny preset's 16); on CUDA every usual size is served."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in sizes:
        raise UserError(f"vLLM's CPU attention has no kernel for head dim {head_dim} (it supports "
                        f"{', '.join(map(str, sizes))}); use a model with one of those head dims, or "
                        f"--rollout-engine megatron")


def sampling_params(vllm, sampling: SamplingConfig):
    """vLLM's ``SamplingParams`` with the meaning ``sampling`` has for the Megatron engine."""
    return vllm.SamplingParams(
        # vLLM refuses n > 1 with greedy sampling: the engine then repeats the prompt instead.
        n=1 if sampling.greedy else sampling.samples_per_prompt,
        temperature=float(sampling.temperature),
        top_p=float(sampling.top_p),
        top_k=sampling.top_k if sampling.top_k > 0 else 0,  # 0: every token (vLLM's "disabled")
        max_tokens=sampling.max_new_tokens,
        min_tokens=0,
        # Only our EOS stops a row; the id vLLM would read from the model's config must not.
        ignore_eos=True,
        stop_token_ids=[sampling.eos_id] if sampling.eos_id is not None else None,
        logprobs=0,  # the sampled token's own log-prob only
        detokenize=False,
    )


def shutdown_in_process(llm) -> None:
    """Shut an in-process engine down while the trainer's torch.distributed lives on.

    vLLM's own teardown ends with ``torch.distributed.destroy_process_group()``, which would
    destroy the trainer's default group too; here its world group is destroyed and the default
    group kept. Shutting down explicitly also detaches vLLM's finalizer, which would otherwise
    run at interpreter exit, after the entry point destroyed the process groups, and fail."""
    from vllm.distributed import parallel_state as engine_groups

    def destroy_engine_world():
        if engine_groups._WORLD:
            engine_groups._WORLD.destroy()
        engine_groups._WORLD = None
        engine_groups._NODE_COUNT = None

    original = engine_groups.destroy_distributed_environment
    engine_groups.destroy_distributed_environment = destroy_engine_world
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        engine_groups.destroy_distributed_environment = original


class VLLMEngine(RemoteEngine):
    """``--rollout-engine vllm``: a vLLM engine on the replica's first rank, sent the
    trainer's weights by :meth:`sync_weights` (see the module docstring and
    :class:`RemoteEngine`).

    ``model_config`` is the policy's :class:`ModelConfig` (needed to build the engine);
    ``vocab_size`` the real vocabulary (default: the first ``generate`` call's
    ``SamplingConfig.vocab_size``, else the model's padded one). ``kv_cache_mb`` is the engine's
    KV-cache memory (default: its declaration's, :attr:`memory`; raised to what two of the model's
    longest sequences need), ``max_num_seqs`` the most sequences it decodes at once."""

    name = "vllm"
    memory = RESERVES_ONE_KV_CACHE
    """Its weights' copy and a KV cache of one size reserved at start, which :meth:`_start` sizes
    with this declaration (the planner and the trainer's start-up plan read the same)."""

    # The options are named one by one: build_rollout_engine hands an engine the options its
    # constructor's signature names.
    def __init__(self, model, model_config: Optional[ModelConfig] = None, vocab_size: Optional[int] = None,
                 sync_bucket_mb: int = 512, kv_cache_mb: Optional[int] = None, max_num_seqs: int = 256,
                 optimizer=None, policy_sync: str = "full", full_sync_interval: int = 10):
        super().__init__(model, model_config=model_config, vocab_size=vocab_size, sync_bucket_mb=sync_bucket_mb,
                         optimizer=optimizer, policy_sync=policy_sync, full_sync_interval=full_sync_interval)
        if kv_cache_mb is not None:
            if kv_cache_mb < 1:
                raise UserError(f"the vLLM engine's kv_cache_mb must be >= 1, got {kv_cache_mb}")
            self.memory = replace(self.memory, kv_cache_mb=kv_cache_mb)
        self.max_num_seqs = max_num_seqs
        self._folder: Optional[str] = None

    @property
    def llm(self):
        """The ``vllm.LLM`` (None while no engine runs, and on the replica's other ranks)."""
        return self.handle

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> List[List[float]]:
        """The engine's log-probs (temperature 1) of tokens ``1..`` of each sequence given the
        tokens before them: what the engine computes for fixed token sequences (tests compare
        them with the trainer's). The engine must hold weights (after a sync or a generate)."""
        result = None
        if parallel.is_replica_lead():
            vllm = import_vllm()
            params = vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
            outputs = self.llm.generate([{"prompt_token_ids": list(sequence)} for sequence in sequences],
                                        params, use_tqdm=False)
            result = [[float(step[token].logprob) for step, token in zip(output.prompt_logprobs[1:], sequence[1:])]
                      for output, sequence in zip(outputs, sequences)]
        return parallel.from_replica_lead(result)

    # --- the remote engine's hooks -----------------------------------------------------------

    def _engine_config(self, vocab: int) -> ModelConfig:
        """The model as the engine holds it: on CPU with an output layer of its own even when the
        policy ties it to the embedding. vLLM 0.32's CPU backend repacks the output layer's weight
        for its kernel, and ``reload_weights`` re-packs only layers that received tensors: a tied
        output layer receives none (it shares the embedding's parameter) and kept computing with
        the weights of the engine's start (measured: log-probs off by up to 5.8 tied, 5e-6
        untied). The sync then sends the embedding a second time, as ``lm_head.weight``."""
        from vllm.platforms import current_platform

        model = self._hf_config(vocab)
        return model.with_changes(tie_embeddings=False) if current_platform.is_cpu() else model

    def _start(self, model: ModelConfig, dtype: torch.dtype):
        """A ``vllm.LLM`` with dummy weights, built from a ``config.json`` in a folder of its own."""
        vllm = import_vllm()
        check_head_dim(model.kv_channels)
        dtype_name = str(dtype).removeprefix("torch.")
        self._folder = tempfile.mkdtemp(prefix="logra_vllm_")
        config = hf_config_from_model_config(model, None, dtype_name)
        config.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
        with open(os.path.join(self._folder, "config.json"), "w") as handle:
            json.dump(config, handle, indent=2, sort_keys=True)
        max_len = unwrap_model(self.model).max_sequence_length
        kv_bytes = self.memory.reserved_bytes(layers=model.layers, kv_heads=model.kv_heads,
                                              kv_channels=model.kv_channels, model_max_tokens=max_len,
                                              dtype_bytes=dtype.itemsize)
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process
        # (it guards its own thread binding); the trainer keeps the real one.
        set_num_threads = torch.set_num_threads
        # Read by vLLM when it builds an engine: the engine core and its worker in this process,
        # or (multi-rank jobs) in new processes, spawned: a forked child would inherit the
        # trainer's process groups.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if self.separate_process else "0"
        if self.separate_process:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        try:
            return self._new_llm(vllm, dtype_name, max_len, kv_bytes)
        except BaseException:
            self._remove_folder()  # no engine to stop: its folder would outlive it
            raise
        finally:
            torch.set_num_threads = set_num_threads

    def _new_llm(self, vllm, dtype_name: str, max_len: int, kv_bytes: int):
        return vllm.LLM(
            model=self._folder, skip_tokenizer_init=True, load_format="dummy", dtype=dtype_name,
            enforce_eager=True, max_model_len=max_len, max_num_seqs=self.max_num_seqs,
            # A whole batch prefills in one pass: no chunked prefill.
            max_num_batched_tokens=max(32768, max_len), kv_cache_memory_bytes=kv_bytes,
            distributed_executor_backend="uni", tensor_parallel_size=1, seed=0,
            logprobs_mode="processed_logprobs", generation_config="vllm",
            worker_extension_cls=WORKER_EXTENSION,
            # Per-request seeds (a separate engine process) need whole prefills.
            **({"enable_chunked_prefill": False} if self.separate_process else {}),
        )

    def _stop(self, llm) -> None:
        shutdown_in_process(llm)
        self._remove_folder()

    def _remove_folder(self) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
        self._folder = None

    def _rpc(self, method: str, *args, **kwargs):
        return self.llm.collective_rpc(method, args=args, kwargs=kwargs)

    def _weights_loaded(self) -> None:
        self.llm.reset_prefix_cache()

    def _sample(self, prompts, sampling: SamplingConfig):
        """(completions, their log-probs), rows prompt-major; engine rank only."""
        vllm = import_vllm()
        params = sampling_params(vllm, sampling)
        copies = sampling.samples_per_prompt // params.n  # requests per prompt, adjacent
        requests = [{"prompt_token_ids": list(prompt)} for prompt in prompts for _ in range(copies)]
        if self.separate_process:
            # The engine's process schedules requests as they arrive, so the batches (and the
            # global generator's draws per row) vary from call to call: each request carries a
            # seed of its own instead (its n samples take seed, seed + 1, ...). Safe there:
            # that engine never chunks a prefill (the CPU sampler's per-request generators
            # crash on a chunked one).
            seeded = []
            for index in range(len(requests)):
                one = params.clone()
                one.seed = (sampling.seed * 2**24 + index * params.n) % 2**62
                seeded.append(one)
            outputs = self.llm.generate(requests, seeded, use_tqdm=False)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(sampling.seed)
                outputs = self.llm.generate(requests, params, use_tqdm=False)
        completions, logprobs = [], []
        for output in outputs:
            samples = sorted(output.outputs, key=lambda sample: sample.index)
            if len(samples) != params.n:
                raise RuntimeError(f"the engine returned {len(samples)} samples of a request, expected {params.n}")
            for sample in samples:
                tokens = list(sample.token_ids)
                completions.append(tokens)
                logprobs.append([float(step[token].logprob) for step, token in zip(sample.logprobs, tokens)])
        return completions, logprobs

