"""Worker-side helpers: run named checks, record JSON-able results per rank.

A worker script must keep its work under ``if __name__ == "__main__":``: dist_checkpointing's
save spawns helper processes that re-import the main module.
"""

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class Checks:
    """Collects results of named checks; a check that raises records its traceback instead of
    ending the worker, so every other check still reports."""

    def __init__(self):
        parser = argparse.ArgumentParser()
        parser.add_argument("--out", required=True)
        self.args, self.extra = parser.parse_known_args()
        self.rank = int(os.environ.get("RANK", "0"))
        self.results = {}
        # Wall seconds of each check on this rank, saved under "_seconds": where a module's one
        # launch spends its time (the suite's budget is kept by trimming the slowest checks).
        self.seconds = {}

    def run(self, name, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            self.results[name] = fn(*args, **kwargs)
        except Exception:
            self.results[name] = {"error": traceback.format_exc()}
            if os.environ.get("LOGRA_TEST_FAIL_FAST"):
                raise
        finally:
            self.seconds[name] = round(time.perf_counter() - start, 2)
        return self.results[name]

    def save(self):
        path = Path(self.args.out) / f"rank{self.rank}.json"
        path.write_text(json.dumps({**self.results, "_seconds": self.seconds}, default=float))


def max_rel(a: dict, b: dict):
    """The largest relative error ``|a - b| / |b|`` over the tensors of ``b`` (by name), and whose."""
    errors = {k: float((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-30)) for k in b}
    worst = max(errors, key=errors.get)
    return errors[worst], worst


def save_then_step(path, model, ddp, optimizer, tokens, model_config, **sharded_options) -> dict:
    """Save ``model`` and ``optimizer`` to ``path`` as the trainer does (dist_checkpointing, the
    optimizer's sharded state beside the model's; ``sharded_options`` go to the optimizer's
    ``sharded_state_dict``), then take one more step on ``tokens``: the full weights after it are
    what a run resumed from ``path`` (at any layout) must reproduce."""
    from logra_megatron.checkpoint import save_checkpoint
    from logra_megatron.models.weights import full_state
    from logra_megatron.training.lm import lm_forward_backward

    extra = {"optimizer": optimizer.sharded_state_dict(model.sharded_state_dict(), **sharded_options)}
    save_checkpoint(path, model, model_config, extra_sharded=extra)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    lm_forward_backward(ddp, tokens, micro_batch_size=2)
    optimizer.step()
    return full_state(model)
