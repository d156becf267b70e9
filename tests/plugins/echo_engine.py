"""A second remote rollout engine, OUTSIDE the package, built on RemoteEngine: what adding an
engine takes (this file and its worker, tests/plugins/echo_worker.py). Chosen by flag only::

    --rollout-engine echo_engine:EchoEngine

Its worker runs in a process of its own (spawned, talked to through a pipe) and "generates"
tokens from the weights it was sent (echo_worker.py), so a test can tell whether a sync arrived
and whether every rank of the replica got the rows the engine's rank sampled. Where it runs,
the gather to Hugging Face names, the buckets, the shared-memory file, the low-rank sync and the
broadcast are all RemoteEngine's (logra_megatron/rollout/remote_engine.py). What it holds beside
the trainer it declares in ``memory`` (logra_megatron/engine_memory.py), which the planner reads by
flag (``tools/plan_memory.py --rollout-engine echo_engine:EchoEngine``).
"""

import multiprocessing
from dataclasses import dataclass

from echo_worker import serve

from logra_megatron.engine_memory import EngineMemory
from logra_megatron.rollout.remote_engine import RemoteEngine


@dataclass(frozen=True)
class PagedKVCache(EngineMemory):
    """A cache laid out in pages of ``page_tokens`` tokens: each sequence in flight takes whole
    pages (the layout a paged engine has; not the package's, so a plan of it shows the planner
    read this declaration)."""

    page_tokens: int = 64

    def cache_bytes(self, *, layers, kv_heads, kv_channels, sequences, max_tokens, model_max_tokens, dtype_bytes):
        pages = -(-max_tokens // self.page_tokens)
        return self.kv_cache_bytes(layers, kv_heads, kv_channels, sequences * pages * self.page_tokens, dtype_bytes)


class EchoEngine(RemoteEngine):
    name = "echo"
    in_process_allowed = False  # always its own process: the path a real engine's tensors take
    memory = PagedKVCache()

    def _start(self, model, dtype):
        context = multiprocessing.get_context("spawn")  # a forked child would hold the trainer's groups
        ours, theirs = context.Pipe()
        process = context.Process(target=serve, args=(theirs, model.vocab), daemon=True)
        process.start()
        return process, ours

    def _stop(self, handle):
        process, pipe = handle
        if process.is_alive():
            pipe.send(None)
            process.join(timeout=30)
        if process.is_alive():
            process.kill()
        pipe.close()

    def _rpc(self, method, *args, **kwargs):
        process, pipe = self.handle
        if not process.is_alive():
            raise RuntimeError(f"the echo worker died (exit code {process.exitcode})")
        pipe.send((method, args, kwargs))
        ok, value = pipe.recv()
        if not ok:
            raise RuntimeError(f"the echo worker's {method} failed: {value}")
        return value

    def _sample(self, prompts, sampling):
        return self._rpc("echo_generate", [list(p) for p in prompts], sampling.samples_per_prompt,
                         sampling.max_new_tokens)
