import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A multi-rank check whose world exceeds the machine's GPUs (two ranks on a 1-GPU machine) runs
# its workers on the CPU with gloo instead of failing under NCCL; every process the suite starts
# inherits this (logra_megatron/platform/device.py).
os.environ.setdefault("LOGRA_CPU_WHEN_GPUS_SHORT", "1")


def pytest_collection_modifyitems(config, items):
    """``gpu``-marked tests need CUDA: skipped with the reason on a machine without it (each
    stands beside a CPU test of the same logic)."""
    import torch

    if torch.cuda.is_available() and os.environ.get("LOGRA_FORCE_CPU") != "1":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on one with `pytest -m gpu`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
