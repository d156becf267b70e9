"""Run logging on rank 0: a progress bar, ``metrics.jsonl``, TensorBoard scalars, summary.json."""

import json
import math
import os
import sys

import torch.distributed as dist
from tqdm import tqdm

from logra_megatron.checkpoint_layout import atomic_write_text


def _is_logging_rank() -> bool:
    # Every metric is agreed on all ranks before it is logged, so rank 0 can write them.
    return not dist.is_initialized() or dist.get_rank() == 0


def _read_rows(path: str) -> list:
    """The complete rows of an existing ``metrics.jsonl`` (a line cut by a kill is dropped)."""
    rows = []
    if os.path.isfile(path):
        with open(path) as handle:
            for line in handle:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    break
    return rows


class MetricsLogger:
    """Writes nothing on other ranks; every method is safe to call everywhere."""

    def __init__(self, output_dir: str, tensorboard_dir: str, total: int, progress: bool = True,
                 log_interval: int = 1, first_step: int = 0, warmup_done: bool = False,
                 wandb_settings: dict = None):
        """``first_step`` / ``warmup_done``: where a resumed run continues. ``metrics.jsonl`` is
        rewritten to the rows before it (the warm-up's only if it is done), so rows a killed run
        wrote after its last checkpoint do not repeat. ``wandb_settings``: ``wandb.init``'s
        project, name and dir (``--wandb-project`` ...): the same scalars go to a wandb run in
        offline mode (``wandb sync DIR`` uploads it), as TensorBoard's do."""
        self.active = _is_logging_rank()
        self.total = total
        self.log_interval = max(1, log_interval)
        self.output_dir = output_dir
        self.bar = None
        self.writer = None
        self.jsonl = None
        self.wandb = None
        if not self.active:
            return
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, "metrics.jsonl")
        kept = [row for row in _read_rows(path)
                if (row.get("phase") == "warmup" and warmup_done) or (row.get("phase") == "rl" and row.get("step", 0) < first_step)]
        atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in kept))
        self.jsonl = open(path, "a")
        try:
            from torch.utils.tensorboard import SummaryWriter  # loads tensorboard (slow): only when logging

            self.writer = SummaryWriter(tensorboard_dir)
        except ImportError:  # tensorboard is a declared dependency; degrade to jsonl only
            self.writer = None
        if wandb_settings:
            import wandb  # an optional extra: --wandb-project checked it imports before the run started

            os.makedirs(wandb_settings["dir"], exist_ok=True)
            # Offline: a training node often has no internet, and a login prompt would hang the job.
            self.wandb = wandb.init(mode="offline", resume="allow", **wandb_settings)
        if progress:
            self.bar = tqdm(total=total, initial=first_step, desc="GRPO", unit="step", file=sys.stderr,
                            dynamic_ncols=True)

    def info(self, message: str) -> None:
        if self.active:
            (self.bar.write if self.bar else print)(message)

    def warmup(self, step: int, total: int, loss: float, grad_norm: float = None) -> None:
        if self.active:
            self._record({"phase": "warmup", "step": step, "loss": loss, "grad_norm": grad_norm})
            if self.writer:
                self.writer.add_scalar("warmup/loss", loss, step)
                if grad_norm is not None:
                    self.writer.add_scalar("warmup/grad_norm", grad_norm, step)
            if self.wandb:
                self.wandb.log({"warmup/loss": loss, **({} if grad_norm is None else {"warmup/grad_norm": grad_norm})})
            if (step + 1) % max(1, total // 10) == 0 or step + 1 == total:
                self.info(f"warm-up {step + 1}/{total} (supervised) loss {loss:.4f}")

    def step(self, step: int, metrics: dict) -> None:
        if not self.active:
            return
        self._record({"phase": "rl", "step": step, **metrics})
        if self.writer:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(f"rl/{key}", value, step)
        if self.wandb:
            self.wandb.log({f"rl/{key}": value for key, value in metrics.items()
                            if isinstance(value, (int, float)) and math.isfinite(value)})
        shown = {"reward": metrics.get("reward_mean"), "acc": metrics.get("accuracy"),
                 "kl_pred": metrics.get("kl_pred"), "scale": metrics.get("step_scale"),
                 "tok/s": metrics.get("tokens_per_s")}
        shown = {key: f"{value:.3g}" for key, value in shown.items() if value is not None}
        if self.bar:
            self.bar.set_postfix(shown)
            self.bar.update(1)
        elif (step + 1) % self.log_interval == 0 or step + 1 == self.total:
            # Without a bar (logs, CI): one compact line per --log-interval steps.
            print(f"step {step + 1}/{self.total} " + " ".join(f"{k} {v}" for k, v in shown.items()), flush=True)

    def _record(self, row: dict) -> None:
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()

    def finish(self, summary: dict):
        if not self.active:
            return None
        if self.bar:
            self.bar.close()
        if self.writer:
            for key in ("held_out_accuracy_initial", "held_out_accuracy_before", "held_out_accuracy_after"):
                if key in summary:
                    self.writer.add_scalar(f"eval/{key}", summary[key], 0)
            for name, value in summary.get("state_bytes", {}).items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(f"memory/state_bytes_{name}", value, 0)
            self.writer.close()
        if self.wandb:
            self.wandb.summary.update({key: value for key, value in summary.items() if isinstance(value, (int, float))})
            self.wandb.finish()
        self.jsonl.close()
        path = os.path.join(self.output_dir, "summary.json")
        with open(path, "w") as handle:
            json.dump(summary, handle, indent=2)
        print(f"summary: {path}", flush=True)
        return path
