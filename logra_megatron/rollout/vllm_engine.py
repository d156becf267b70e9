"""Rollouts sampled by vLLM (``--rollout-engine vllm``), with the trainer's weights pushed in.

:class:`VLLMEngine` keeps its own copy of the policy in a vLLM engine and is sent the trainer's
weights after every optimizer step (:meth:`VLLMEngine.sync_weights`). The choices:

**Where it runs.** One engine per model replica, hosted by the replica's first rank (tensor
rank 0 of the first pipeline stage), with vLLM's own tensor parallelism at 1. A one-process job
keeps the engine in its process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor):
it builds in 2-3 s instead of 15-27 s and the weights are handed over as tensors. A multi-rank
job (TP, PP or DP > 1) cannot: vLLM forms its torch.distributed groups over the existing world,
which would need every rank to take part. There the engine runs in processes of its own,
spawned (a forked child would inherit the trainer's process groups), and the weights and
low-rank messages cross through one file in shared memory per call (``_call``: vLLM's RPC does
not carry tensors). The sampled rows are broadcast over the replica's model-parallel group, so
every rank of the replica holds the same :class:`Rollouts`, laid out exactly as the Megatron
engine lays them out (left padding, prompt-major rows, ``pad_id`` after EOS). vLLM is imported
only here, and only when the engine first runs. The module sits above the conversion library it
uses (a layer of its own in docs/ARCHITECTURE.md); the trainer reaches it only through the
registry's dynamic import.

**What the engine is built from.** A ``config.json`` written from our :class:`ModelConfig` by the
converter's :func:`hf_config_from_model_config` in a temporary folder; the engine starts with
dummy weights and is sent the real ones right away. Our tokenizers stay ours: prompts go in as
token ids and the engine has no tokenizer (``skip_tokenizer_init``).

**Vocabulary.** Megatron pads the embedding and the output layer; the engine is built with the
real vocabulary (``SamplingConfig.vocab_size``, the tokenizer's) and the sync slices both to it,
so the engine's softmax runs over the same logits the trainer's log-probs use.

**Weight sync.** Every rank gathers its shards into full tensors
(:func:`logra_megatron.models.weights.full_state`, collective over TP and PP); the engine's rank
maps them to Hugging Face names and layouts with the converter's :func:`megatron_to_hf` and
streams them in buckets of ``sync_bucket_mb`` (each bucket cast to the engine's dtype only when
the previous one has been consumed) through one call of the worker's ``reload_weights``, which
loads each layer and re-runs the CPU backend's weight repacking as soon as the layer is
complete (a reload per bucket would process a layer split between two buckets half-loaded: vLLM
fuses q/k/v and gate/up). The prefix cache is reset afterwards, or prompts sharing a prefix
would reuse keys and values computed with the old weights. ``sync_bytes`` is the sum of the bytes
of the tensors actually handed over; ``sync_time_s`` covers gather, conversion and reload.

**Low-rank sync** (``policy_sync="lowrank"``, LoGRA only). A full sync also hands the worker the
projections and each factor's route (Hugging Face name, row mapping), and the worker keeps an
fp32 copy of the weights (logra_megatron/rollout/vllm_worker.py). From then on the optimizer
logs its committed steps (logra_megatron/logra/commit_log.py); a sync gathers each step's
sketch-space update ``U`` over TP and PP with the decay scalar and step size
(logra_megatron/rollout/policy_update.py), adds the weights LoGRA does not sketch as dense
tensors, and the worker replays the steps onto its copy with the trainer's own operations and
reloads. Between projection refreshes the engine already holds P or Q, so only ``U`` travels.
A full sync is sent instead when the projections were redrawn, the log overflowed
(``COMMIT_LOG_LIMIT``), ``full_sync_interval`` syncs passed, or the engine failed mid-sync (it is
rebuilt: ``sync_restarts``).

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

import gc
import json
import os
import shutil
import tempfile
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from logra_megatron.convert.hf import hf_config_from_model_config, megatron_to_hf
from logra_megatron.errors import UserError
from logra_megatron.models.build import model_device, unwrap_model
from logra_megatron.models.config import ModelConfig
from logra_megatron.models.weights import full_state
from logra_megatron.rollout.megatron_engine import _check_prompts
from logra_megatron.rollout.policy_update import low_rank_message, projections, replayable, routes
from logra_megatron.rollout.types import PromptLayout, Rollouts, SamplingConfig

INSTALL = "pip install -e .[rollout]"
MIB = 2**20
POLICY_SYNCS = ("full", "lowrank")
WORKER_EXTENSION = "logra_megatron.rollout.vllm_worker.LowRankWeights"
COMMIT_LOG_LIMIT = 64
"""Most optimizer steps a low-rank sync replays (more, e.g. a supervised warm-up between two
syncs: a full sync instead); an RL step commits ``--num-minibatches x --ppo-epochs``."""


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


def _replica_group():
    """The replica's model-parallel (TP x PP) group, or None in a one-rank replica."""
    if not dist.is_initialized() or not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_model_parallel_group()
    return group if dist.get_world_size(group) > 1 else None


def _is_engine_rank() -> bool:
    """The replica's first rank (its lowest global rank: tensor rank 0 of the first stage)."""
    group = _replica_group()
    return group is None or dist.get_rank(group) == 0


def _from_engine_rank(value):
    """``value`` as the engine's rank holds it, on every rank of the replica."""
    group = _replica_group()
    if group is None:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0), group=group)
    return holder[0]


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


def rollouts_from_completions(prompts: Sequence[Sequence[int]], completions: List[List[int]],
                              logprobs: List[List[float]], sampling: SamplingConfig,
                              device=None) -> Rollouts:
    """The :class:`Rollouts` batch of ``completions`` (row ``b`` is sample ``b % G`` of prompt
    ``b // G``), with the Megatron engine's layout: left-padded prompts in the first ``P``
    columns, completions from column ``P`` right-padded with ``pad_id``, width
    ``P + max_new_tokens``."""
    layout = PromptLayout.of(prompts, sampling.samples_per_prompt, sampling.max_new_tokens, sampling.pad_id, device)
    tokens, width, new = layout.tokens, layout.width, sampling.max_new_tokens
    batch = tokens.shape[0]
    sampled_logprobs = torch.zeros(tokens.shape, dtype=torch.float32, device=device)
    response_lengths = torch.zeros(batch, dtype=torch.int64, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    for b, (completion, row_logprobs) in enumerate(zip(completions, logprobs)):
        if len(completion) > new:
            raise RuntimeError(f"the engine returned {len(completion)} tokens for a limit of {new}")
        # vLLM hands back Python lists: each row crosses to the trainer's device once.
        tokens[b, width:width + len(completion)] = torch.tensor(completion, dtype=torch.int64, device=device)
        sampled_logprobs[b, width:width + len(completion)] = torch.tensor(row_logprobs, dtype=torch.float32,
                                                                          device=device)
        response_lengths[b] = len(completion)
        finished[b] = sampling.eos_id is not None and len(completion) > 0 and completion[-1] == sampling.eos_id
    return layout.rollouts(response_lengths, finished, int(response_lengths.max()), logprobs=sampled_logprobs)


def weight_buckets(tensors: Dict[str, torch.Tensor], bucket_bytes: int,
                   dtype: torch.dtype) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """``tensors`` in order, cast to ``dtype`` and contiguous, grouped into lists of at most
    ``bucket_bytes`` (a single larger tensor is a bucket of its own). Each bucket is made only
    when the previous one has been consumed, so at most one bucket of copies exists at a time."""
    bucket, size = [], 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * dtype.itemsize
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach().to(dtype).contiguous()))
        size += nbytes
    if bucket:
        yield bucket


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


class VLLMEngine:
    """``--rollout-engine vllm``: a vLLM engine on the replica's first rank, sent the
    trainer's weights by :meth:`sync_weights` (see the module docstring).

    ``model_config`` is the policy's :class:`ModelConfig` (needed to build the engine);
    ``vocab_size`` the real vocabulary (default: the first ``generate`` call's
    ``SamplingConfig.vocab_size``, else the model's padded one). ``kv_cache_mb`` is the engine's
    KV-cache memory (raised to what one longest sequence needs), ``max_num_seqs`` the most
    sequences it decodes at once."""

    name = "vllm"

    def __init__(self, model, model_config: Optional[ModelConfig] = None, vocab_size: Optional[int] = None,
                 sync_bucket_mb: int = 512, kv_cache_mb: int = 256, max_num_seqs: int = 256,
                 optimizer=None, policy_sync: str = "full", full_sync_interval: int = 10):
        if sync_bucket_mb < 1:
            raise UserError(f"--sync-bucket-mb must be >= 1, got {sync_bucket_mb}")
        if policy_sync not in POLICY_SYNCS:
            raise UserError(f"--policy-sync must be one of {', '.join(POLICY_SYNCS)}, got {policy_sync!r}")
        if policy_sync == "lowrank" and not hasattr(optimizer, "log_commits"):
            raise UserError("--policy-sync lowrank sends LoGRA's low-rank steps: it needs --optimizer logra")
        if full_sync_interval < 1:
            raise UserError(f"--full-sync-interval must be >= 1, got {full_sync_interval}")
        self.optimizer = optimizer
        self.policy_sync = policy_sync
        self.full_sync_interval = full_sync_interval
        self.low_rank_since_full = 0
        self.full_sync_bytes = 0.0
        """Bytes of the last full sync (what a low-rank sync is compared with)."""
        self.restarts = 0
        """Engines rebuilt after a sync failed in them."""
        self.model = model
        self.model_config = model_config
        self.vocab_size = vocab_size
        self.sync_bucket_mb = sync_bucket_mb
        self.kv_cache_mb = kv_cache_mb
        self.max_num_seqs = max_num_seqs
        self.llm = None
        self.engine_vocab: Optional[int] = None
        """The vocabulary the engine holds weights for (the same on every rank of the replica:
        every decision to build or rebuild is taken from values all ranks share)."""
        self.last_sync: Dict[str, float] = {}
        self._folder: Optional[str] = None
        self.separate_process = dist.is_initialized() and dist.get_world_size() > 1
        """The engine runs in processes of its own (a multi-rank job: an in-process engine would
        form its torch.distributed groups over the trainer's whole world)."""
        self._exchange: Optional[str] = None

    # --- the interface ---------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> Rollouts:
        gpt = unwrap_model(self.model)
        device = model_device(gpt)
        _check_prompts(prompts, sampling, gpt.vocab_size, gpt.max_sequence_length)
        vocab = sampling.vocab_size or self.vocab_size or gpt.vocab_size
        if self.engine_vocab != vocab:
            self._full_sync(vocab)  # builds (or rebuilds) the engine first
        result = None
        if _is_engine_rank():
            result = self._sample(prompts, sampling)
        completions, logprobs = _from_engine_rank(result)
        return rollouts_from_completions(prompts, completions, logprobs, sampling, device)

    def sync_weights(self, model, force_full: bool = False) -> Dict[str, float]:
        """A full sync, or with ``policy_sync="lowrank"`` the optimizer's steps since the last
        sync in low-rank form, unless a full one is due: the engine holds no weights yet, the
        projections changed, the commit log is incomplete, or ``full_sync_interval`` syncs
        passed since the last full one. A sync that fails in the engine rebuilds the engine
        and sends everything (``sync_restarts`` counts it)."""
        self.model = model
        vocab = self.engine_vocab or self.vocab_size or unwrap_model(model).vocab_size
        if self.policy_sync == "lowrank" and self.engine_vocab is not None and not force_full:
            log = self.optimizer.commit_log
            commits = log.take() if log is not None else None
            can, _why = replayable(commits, self.optimizer)
            if can and self.low_rank_since_full + 1 < self.full_sync_interval:
                return self._low_rank_sync(commits)
        return self._full_sync(vocab)

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> List[List[float]]:
        """The engine's log-probs (temperature 1) of tokens ``1..`` of each sequence given the
        tokens before them: what the engine computes for fixed token sequences (tests compare
        them with the trainer's). The engine must hold weights (after a sync or a generate)."""
        result = None
        if _is_engine_rank():
            vllm = import_vllm()
            params = vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
            outputs = self.llm.generate([{"prompt_token_ids": list(sequence)} for sequence in sequences],
                                        params, use_tqdm=False)
            result = [[float(step[token].logprob) for step, token in zip(output.prompt_logprobs[1:], sequence[1:])]
                      for output, sequence in zip(outputs, sequences)]
        return _from_engine_rank(result)

    def close(self) -> None:
        """Shut the engine down and remove its config folder; call it before the process groups
        are destroyed (the trainer does, at the end of the run)."""
        self._drop_engine()

    # --- engine ----------------------------------------------------------------------------

    def _hf_config(self, vocab: int) -> ModelConfig:
        if self.model_config is None:
            raise UserError("the vllm rollout engine needs the model's config (model_config=...)")
        return self.model_config.with_changes(vocab=vocab)

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

    def _dtype(self) -> torch.dtype:
        return unwrap_model(self.model).config.params_dtype

    def _build(self, vocab: int) -> None:
        """A fresh engine (dummy weights) for ``vocab`` tokens; engine rank only."""
        vllm = import_vllm()
        self._drop_engine()
        model = self._engine_config(vocab)
        check_head_dim(model.kv_channels)
        dtype_name = str(self._dtype()).removeprefix("torch.")
        self._folder = tempfile.mkdtemp(prefix="logra_vllm_")
        config = hf_config_from_model_config(model, None, dtype_name)
        config.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
        with open(os.path.join(self._folder, "config.json"), "w") as handle:
            json.dump(config, handle, indent=2, sort_keys=True)
        max_len = unwrap_model(self.model).max_sequence_length
        per_token = 2 * model.layers * model.kv_heads * model.kv_channels * self._dtype().itemsize
        kv_bytes = max(self.kv_cache_mb * MIB, 2 * per_token * max_len)
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process
        # (it guards its own thread binding); the trainer keeps the real one.
        set_num_threads = torch.set_num_threads
        # Read by vLLM when it builds an engine: the engine core and its worker in this process,
        # or (multi-rank jobs) in new processes, spawned: a forked child would inherit the
        # trainer's process groups.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if self.separate_process else "0"
        if self.separate_process:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
            self._exchange = tempfile.mkdtemp(prefix="logra_vllm_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            self.llm = self._new_llm(vllm, dtype_name, max_len, kv_bytes)
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

    def _drop_engine(self) -> None:
        if self.llm is not None:
            shutdown_in_process(self.llm)
            self.llm = None
            gc.collect()
        for folder in (self._folder, self._exchange):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        self._folder = self._exchange = None
        self.engine_vocab = None

    def _full_sync(self, vocab: int, rebuild: bool = False) -> Dict[str, float]:
        """Every parameter, gathered and converted, into the engine (built first if it holds
        another vocabulary or none, or ``rebuild``). With ``policy_sync="lowrank"`` the worker
        keeps a copy and the projections, and the optimizer starts logging its steps.
        Collective over the replica."""
        start = time.perf_counter()
        state = full_state(unwrap_model(self.model))
        lowrank = self.policy_sync == "lowrank"
        dtype = self._dtype()
        extras = {}
        if lowrank:  # (collective over PP)
            extras = {"projections": projections(self.optimizer, dtype),
                      "routes": routes(self.optimizer, self._hf_config(vocab),
                                       untied_output=not self._engine_config(vocab).tie_embeddings)}
        sent, restarted = 0, 0
        if _is_engine_rank():
            if rebuild or self.llm is None or self.engine_vocab != vocab:
                self._build(vocab)
            tensors = megatron_to_hf(state, self._hf_config(vocab))
            del state
            if "lm_head.weight" not in tensors and not self._engine_config(vocab).tie_embeddings:
                tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
            try:
                sent = self._load(tensors, extras, dtype)
            except Exception:  # the engine may hold half the new weights: start a fresh one
                self._build(vocab)
                sent = self._load(tensors, extras, dtype)
                restarted = 1
        if lowrank:
            self.optimizer.log_commits(COMMIT_LOG_LIMIT)
        self.engine_vocab = vocab
        self.low_rank_since_full = 0
        restarted = _from_engine_rank(restarted)
        self.restarts += restarted
        return self._measured(sent, start, low_rank=False)

    def _load(self, tensors: Dict[str, torch.Tensor], extras: dict, dtype: torch.dtype) -> int:
        """Stream ``tensors`` (HF names) into the engine; the bytes handed over (the tensors in
        ``dtype``, and with ``extras`` the projections). Engine rank only."""
        handed = [0]

        def stream():
            for bucket in weight_buckets(tensors, self.sync_bucket_mb * MIB, dtype):
                for name, tensor in bucket:
                    handed[0] += tensor.numel() * tensor.element_size()
                    yield name, tensor

        # One reload over the whole stream: vLLM processes (repacks) a layer once all of its
        # tensors arrived, which a reload per bucket would break for a layer split between
        # two buckets (q/k/v and gate/up are fused in the engine).
        if self.separate_process:  # tensors do not cross vLLM's RPC: one file in shared memory
            self._call("logra_load", weights=dict(stream()), **extras)
        else:
            self._call("logra_load", weights_iterator=stream(), **extras)
        if extras:
            handed[0] += sum(t.numel() * t.element_size() for _side, t in extras["projections"].values())
        self.llm.reset_prefix_cache()
        return handed[0]

    def _call(self, method: str, **arguments):
        """``method`` of the engine's worker (logra_megatron/rollout/vllm_worker.py) with
        ``arguments``: handed over directly in-process, through a file in shared memory to an
        engine in processes of its own (the file is removed after the call)."""
        if not self.separate_process:
            return self.llm.collective_rpc(method, kwargs=arguments)
        path = os.path.join(self._exchange, f"{method}.pt")
        try:
            torch.save(arguments, path)
            return self.llm.collective_rpc("logra_call_from_file", args=(method, path))
        finally:
            if os.path.exists(path):
                os.remove(path)

    def _low_rank_sync(self, commits) -> Dict[str, float]:
        """The committed steps' factors and the dense remainder into the engine, applied by its
        worker (logra_megatron/rollout/vllm_worker.py). Collective over the replica; a failure
        in the engine falls back to a full sync into a fresh engine."""
        start = time.perf_counter()
        vocab = self.engine_vocab
        message = low_rank_message(self.model, self.optimizer, commits, self._hf_config(vocab), self._dtype())
        sent, failed = 0, False
        if _is_engine_rank():
            try:
                self._call("logra_apply", message=message, dtype=self._dtype())
                self.llm.reset_prefix_cache()
                sent = message.nbytes()
            except Exception:
                failed = True
        del message
        if _from_engine_rank(failed):
            self.restarts += 1
            return self._full_sync(vocab, rebuild=True)
        self.low_rank_since_full += 1
        return self._measured(sent, start, low_rank=True)

    def _measured(self, sent: int, start: float, low_rank: bool) -> Dict[str, float]:
        if not low_rank:
            self.full_sync_bytes = float(sent)
        measured = {"sync_bytes": float(sent), "sync_time_s": time.perf_counter() - start,
                    "sync_low_rank": float(low_rank), "sync_full_bytes": float(self.full_sync_bytes),
                    "sync_restarts": float(self.restarts)}
        self.last_sync = _from_engine_rank(measured)
        self.full_sync_bytes = self.last_sync["sync_full_bytes"]
        return self.last_sync

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

