"""What every rollout engine with its own copy of the weights needs, whatever runs it: the base
:class:`RemoteEngine` of ``--rollout-engine vllm`` (logra_megatron/rollout/vllm_engine.py) and
of any other engine of that kind (a test builds one in tests/plugins/echo_engine.py).

A subclass says how to start and stop its engine, how to hand its worker one call, and how to
sample; the rest is here:

**Where it runs.** One engine per model replica, on the replica's first rank (tensor rank 0 of
the first pipeline stage: :func:`logra_megatron.parallel.is_replica_lead`). Every rank of the replica calls
``generate`` and ``sync_weights``; only the engine's rank talks to the engine, and what it
learns (the sampled rows, the sync's measurements, whether the engine failed) is broadcast over
the replica's model-parallel group (:func:`logra_megatron.parallel.from_replica_lead`), so every rank holds the same
:class:`Rollouts`, laid out as the Megatron engine lays them out (left padding, prompt-major
rows, ``pad_id`` after EOS: :func:`rollouts_from_completions`). Every decision to start, restart
or fall back is taken from values all ranks share.

**Weight sync.** Every rank gathers its shards into full tensors
(:func:`logra_megatron.models.weights.full_state`, collective over TP and PP); the engine's rank
maps them to Hugging Face names and layouts with the converter's :func:`megatron_to_hf` (the
padded vocabulary sliced to the engine's; an output layer of its own sent the embedding when the
engine unties a tied one, :meth:`RemoteEngine._engine_config`) and streams them in buckets of
``sync_bucket_mb`` (:func:`weight_buckets`: each bucket cast to the engine's dtype only when the
previous one has been consumed) through one call of the worker's ``logra_load``
(logra_megatron/rollout/remote_worker.py). ``sync_bytes`` is the sum of the bytes of the tensors
handed over; ``sync_time_s`` covers gather, conversion and load.

**Low-rank sync** (``policy_sync="lowrank"``, LoGRA only). A full sync also hands the worker the
projections and each factor's route, and the worker keeps an fp32 copy of the weights. From
then on the optimizer logs its committed steps (logra_megatron/logra/commit_log.py); a sync
gathers each step's ``U`` with its scalars and the dense remainder
(logra_megatron/rollout/policy_update.py) and the worker's ``logra_apply`` replays them. A full
sync is sent instead when the projections were redrawn, the log overflowed
(``COMMIT_LOG_LIMIT``), ``full_sync_interval`` syncs passed, or the engine failed mid-sync.

**Health.** An engine that raises while loading weights or applying a step may hold half of
them: it is stopped, started afresh and sent everything (``sync_restarts`` counts it).
:meth:`RemoteEngine.close` stops it; the next call starts a new one.

**Crossing into the engine's processes.** An engine in the trainer's process is handed tensors
directly. One in processes of its own (``separate_process``; a multi-rank job by default) gets
each call's arguments through one file in shared memory, written with ``torch.save`` and read
memory-mapped by the worker's ``logra_call_from_file``: RPC layers (vLLM's among them) do not
carry tensors. The file is removed after the call.
"""

import gc
import os
import shutil
import tempfile
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from logra_megatron import parallel
from logra_megatron.convert.hf import megatron_to_hf
from logra_megatron.engine_memory import KEEPS_ITS_OWN_WEIGHTS
from logra_megatron.errors import UserError
from logra_megatron.models.build import model_device, unwrap_model
from logra_megatron.models.config import ModelConfig
from logra_megatron.models.weights import full_state
from logra_megatron.rollout.megatron_engine import _check_prompts
from logra_megatron.rollout.policy_update import low_rank_message, projections, replayable, routes
from logra_megatron.rollout.types import PromptLayout, Rollouts, SamplingConfig

MIB = 2**20
POLICY_SYNCS = ("full", "lowrank")
COMMIT_LOG_LIMIT = 64
"""Most optimizer steps a low-rank sync replays (more, e.g. a supervised warm-up between two
syncs: a full sync instead); an RL step commits ``--num-minibatches x --ppo-epochs``."""


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
        # An engine hands back Python lists: each row crosses to the trainer's device once.
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



class RemoteEngine:
    """A rollout engine with its own copy of the weights, on the replica's first rank, sent the
    trainer's weights by :meth:`sync_weights` (see the module docstring). A subclass supplies
    :meth:`_start`, :meth:`_stop`, :meth:`_rpc` and :meth:`_sample` (and may override
    :meth:`_engine_config` and :meth:`_weights_loaded`); its worker extends
    logra_megatron/rollout/remote_worker.py: ``RemoteWorker``.

    ``model_config`` is the policy's :class:`ModelConfig` (the engine is built from it);
    ``vocab_size`` the real vocabulary (default: the first ``generate`` call's
    ``SamplingConfig.vocab_size``, else the model's padded one)."""

    policy_syncs = POLICY_SYNCS
    """The ``--policy-sync`` kinds this engine takes (rollout/engine.py: ``engine_syncs_low_rank``)."""
    memory = KEEPS_ITS_OWN_WEIGHTS
    """What it holds beside the trainer (engine_memory.py): its weights' copy and its KV cache."""

    name = "remote"
    in_process_allowed = True
    """Whether the engine may run in the trainer's process when the job has one rank (a
    multi-rank job always puts it in processes of its own: an engine that forms torch.distributed
    groups of its own would form them over the trainer's whole world)."""

    def __init__(self, model, model_config: Optional[ModelConfig] = None, vocab_size: Optional[int] = None,
                 sync_bucket_mb: int = 512, optimizer=None, policy_sync: str = "full",
                 full_sync_interval: int = 10):
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
        self.handle = None
        """What :meth:`_start` returned (the engine, or its process); None while none runs, and
        always on the replica's other ranks."""
        self.engine_vocab: Optional[int] = None
        """The vocabulary the engine holds weights for (the same on every rank of the replica:
        every decision to build or rebuild is taken from values all ranks share)."""
        self.last_sync: Dict[str, float] = {}
        self.separate_process = not self.in_process_allowed or (dist.is_initialized() and dist.get_world_size() > 1)
        """The engine runs in processes of its own, its calls' tensors crossing through a file."""
        self._exchange: Optional[str] = None

    # --- what a subclass supplies ------------------------------------------------------------

    def _start(self, model: ModelConfig, dtype: torch.dtype):
        """Start an engine for ``model`` (Hugging Face layout, the engine's vocabulary) holding
        placeholder weights of ``dtype`` (the real ones follow at once); the handle kept as
        :attr:`handle`. Engine rank only."""
        raise NotImplementedError

    def _stop(self, handle) -> None:
        """Stop the engine ``handle`` names and free what it held. Engine rank only."""
        raise NotImplementedError

    def _rpc(self, method: str, *args, **kwargs):
        """Run ``method(*args, **kwargs)`` of the engine's worker (in its process or this one);
        an exception when it fails. Engine rank only."""
        raise NotImplementedError

    def _sample(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig):
        """(completions, the log-probs of their tokens): ``sampling.samples_per_prompt`` rows per
        prompt, prompt-major, lists of ints and floats. Engine rank only."""
        raise NotImplementedError

    def _weights_loaded(self) -> None:
        """Called after every change of the engine's weights (vLLM drops its prefix cache, whose
        keys and values were computed with the old ones). Engine rank only."""

    def _engine_config(self, vocab: int) -> ModelConfig:
        """The model as the engine holds it (by default the policy's, with the real vocabulary).
        An engine that unties a tied output layer is sent the embedding a second time, as
        ``lm_head.weight``."""
        return self._hf_config(vocab)

    # --- the interface ---------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> Rollouts:
        gpt = unwrap_model(self.model)
        device = model_device(gpt)
        _check_prompts(prompts, sampling, gpt.vocab_size, gpt.max_sequence_length)
        vocab = sampling.vocab_size or self.vocab_size or gpt.vocab_size
        if self.engine_vocab != vocab:
            self._full_sync(vocab)  # builds (or rebuilds) the engine first
        result = None
        if parallel.is_replica_lead():
            result = self._sample(prompts, sampling)
        completions, logprobs = parallel.from_replica_lead(result)
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

    def close(self) -> None:
        """Stop the engine; call it before the process groups are destroyed (the trainer does,
        at the end of the run). The next ``generate`` or sync starts a new one."""
        self._stop_engine()

    # --- the engine's life -----------------------------------------------------------------

    def _hf_config(self, vocab: int) -> ModelConfig:
        if self.model_config is None:
            raise UserError(f"the {self.name} rollout engine needs the model's config (model_config=...)")
        return self.model_config.with_changes(vocab=vocab)

    def _dtype(self) -> torch.dtype:
        return unwrap_model(self.model).config.params_dtype

    def _start_engine(self, vocab: int) -> None:
        """A fresh engine (placeholder weights) for ``vocab`` tokens; engine rank only."""
        self._stop_engine()
        if self.separate_process:
            shared = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._exchange = tempfile.mkdtemp(prefix=f"logra_{self.name}_", dir=shared)
        self.handle = self._start(self._engine_config(vocab), self._dtype())

    def _stop_engine(self) -> None:
        if self.handle is not None:
            self._stop(self.handle)
            self.handle = None
            gc.collect()  # an engine's objects hold reference cycles: free its memory now
        if self._exchange is not None:
            shutil.rmtree(self._exchange, ignore_errors=True)
        self._exchange = None
        self.engine_vocab = None

    def _call(self, method: str, **arguments):
        """``method`` of the engine's worker with ``arguments``: handed over directly
        in-process, through a file in shared memory to an engine in processes of its own (the
        file is removed after the call)."""
        if not self.separate_process:
            return self._rpc(method, **arguments)
        path = os.path.join(self._exchange, f"{method}.pt")
        try:
            torch.save(arguments, path)
            return self._rpc("logra_call_from_file", method, path)
        finally:
            if os.path.exists(path):
                os.remove(path)

    # --- syncs -----------------------------------------------------------------------------

    def _full_sync(self, vocab: int, rebuild: bool = False) -> Dict[str, float]:
        """Every parameter, gathered and converted, into the engine (started first if it holds
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
        if parallel.is_replica_lead():
            if rebuild or self.handle is None or self.engine_vocab != vocab:
                self._start_engine(vocab)
            tensors = megatron_to_hf(state, self._hf_config(vocab))
            del state
            if "lm_head.weight" not in tensors and not self._engine_config(vocab).tie_embeddings:
                tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
            try:
                sent = self._load(tensors, extras, dtype)
            except Exception:  # the engine may hold half the new weights: start a fresh one
                self._start_engine(vocab)
                sent = self._load(tensors, extras, dtype)
                restarted = 1
        if lowrank:
            self.optimizer.log_commits(COMMIT_LOG_LIMIT)
        self.engine_vocab = vocab
        self.low_rank_since_full = 0
        restarted = parallel.from_replica_lead(restarted)
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

        # One load over the whole stream: an engine may process (vLLM: repack) a layer once all
        # of its tensors arrived, which a load per bucket would break for a layer split between
        # two buckets (q/k/v and gate/up are fused in vLLM).
        if self.separate_process:  # the tensors cross in one file, as the stream produces them
            self._call("logra_load", weights=dict(stream()), **extras)
        else:
            self._call("logra_load", weights_iterator=stream(), **extras)
        if extras:
            handed[0] += sum(t.numel() * t.element_size() for _side, t in extras["projections"].values())
        self._weights_loaded()
        return handed[0]

    def _low_rank_sync(self, commits) -> Dict[str, float]:
        """The committed steps' factors and the dense remainder into the engine, applied by its
        worker (``RemoteWorker.logra_apply``). Collective over the replica; a failure in the
        engine falls back to a full sync into a fresh engine."""
        start = time.perf_counter()
        vocab = self.engine_vocab
        message = low_rank_message(self.model, self.optimizer, commits, self._hf_config(vocab), self._dtype())
        sent, failed = 0, False
        if parallel.is_replica_lead():
            try:
                self._call("logra_apply", message=message, dtype=self._dtype())
                self._weights_loaded()
                sent = message.nbytes()
            except Exception:
                failed = True
        del message
        if parallel.from_replica_lead(failed):
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
        self.last_sync = parallel.from_replica_lead(measured)
        self.full_sync_bytes = self.last_sync["sync_full_bytes"]
        return self.last_sync
