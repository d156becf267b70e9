"""The memory planner against measurement at one layout (``--layout``): tiny, dense Adam and
LoGRA, fp32 and bf16, with the KL controller's probe; at TP > 1 also under ``--sequence-parallel``
(packed), and at PP > 1 under Megatron's interleaved pipeline (two chunks per rank). Each rank
records its predicted and measured components and step peak (logra_megatron/planning/validate.py: measure_settings);
tests/test_plan_validation.py asserts the bounds."""

import argparse

from common import Checks

from logra_megatron import parallel
from logra_megatron.logra.config import LogRAConfig
from logra_megatron.models.config import get_preset
from logra_megatron.planning.settings import PlanSettings
from logra_megatron.planning.validate import measure_settings

LAYOUTS = {  # name: (TP, PP, DP, distributed optimizer)
    "tp2pp2": (2, 2, 1, False),
    "dp2dist": (1, 1, 2, True),
}


def main():
    checks = Checks()
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=tuple(LAYOUTS), required=True)
    layout = parser.parse_args(checks.extra).layout
    tp, pp, dp, distributed = LAYOUTS[layout]
    parallel.initialize(tp, pp, seed=1234)
    for optimizer in ("adam", "logra"):
        for bf16 in (False, True):
            settings = PlanSettings(
                model=get_preset("tiny"), tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp,
                optimizer=optimizer, distributed_optimizer=distributed, bf16=bf16,
                logra=LogRAConfig(rank=0.25, zero1=distributed), kl_control="probe", kl_probe_sequences=2,
                micro_batch_size=2, global_batch_size=4 * dp, seq_length=32)
            name = f"{optimizer}_{'bf16' if bf16 else 'fp32'}"
            # three tracked steps: at TP > 1 a step's CPU replay may keep blocks a gloo thread
            # freed unseen (logra_megatron/platform/memory.py); the smallest is taken
            checks.run(name, measure_settings, settings, 1, tracked_steps=3)
    if tp > 1:
        # --sequence-parallel: packed microbatches (the trainer packs under SP; a 64-token
        # budget, a multiple of TP), one dtype per optimizer to keep the launch short
        for optimizer, bf16 in (("adam", False), ("logra", True)):
            settings = PlanSettings(
                model=get_preset("tiny"), tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp,
                optimizer=optimizer, distributed_optimizer=distributed, bf16=bf16,
                logra=LogRAConfig(rank=0.25, zero1=distributed), kl_control="probe", kl_probe_sequences=2,
                micro_batch_size=2, global_batch_size=4 * dp, seq_length=32, pack_sequences=True,
                max_tokens_per_microbatch=64, sequence_parallel=True)
            checks.run(f"{optimizer}_{'bf16' if bf16 else 'fp32'}_sp", measure_settings, settings, 1, tracked_steps=3)
    if pp > 1:
        # Megatron's interleaved pipeline: two 1-layer chunks per rank, 4 microbatches (the
        # interleaved warm-up, 2 (PP - r - 1) + (V - 1) x 2 chunk passes, differs from 1F1B's
        # there: planned without the chunks, the peak is 27-44% lower). LoGRA under the
        # distributed optimizer: each chunk's DDP buffer padded on its own (with the QKV bias,
        # 128 elements more on the first rank than one buffer would hold).
        parallel.initialize(tp, pp, seed=1234, virtual_pipeline=2)
        for optimizer, bf16, dist in (("adam", False, distributed), ("logra", True, True)):
            settings = PlanSettings(
                model=get_preset("tiny").with_changes(qkv_bias=True), tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp,
                virtual_pipeline=2, optimizer=optimizer, distributed_optimizer=dist, bf16=bf16,
                logra=LogRAConfig(rank=0.25, zero1=dist), kl_control="probe", kl_probe_sequences=2,
                micro_batch_size=2, global_batch_size=8 * dp, seq_length=32)
            checks.run(f"{optimizer}_{'bf16' if bf16 else 'fp32'}_vpp", measure_settings, settings, 1, tracked_steps=3)
    checks.save()
    parallel.destroy()


if __name__ == "__main__":
    main()
