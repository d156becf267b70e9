"""Convert a Hugging Face Llama / Qwen2 / Mistral model into a Megatron distributed checkpoint.

    python tools/convert_hf_to_mcore.py --hf-dir HF --save CKPT \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 [--dtype fp32|bf16]

Reads ``config.json`` and the weights (safetensors, sharded or not, or ``pytorch_model.bin``)
offline, builds the Megatron model at the requested layout, loads the mapped weights and
writes a ``dist_checkpointing`` checkpoint (``logra_megatron.checkpoint``) that loads at any
TP/PP. The tokenizer files go to ``CKPT/tokenizer/`` and the source ``config.json`` to
``CKPT/hf_source/`` (the reverse conversion restores token ids and dtype from it).

Launching: when TP x PP > 1 the script re-runs itself under
``python -m torch.distributed.run --nproc-per-node TP*PP`` and exits with its status; it can
also be started under torchrun directly (any multiple of TP*PP ranks). All input checks run
before that, so bad input ends in one ``error: ...`` line and exit status 2.
"""

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from logra_megatron.cli import ArgumentParser  # noqa: E402
from logra_megatron.convert import launch  # noqa: E402
from logra_megatron.errors import exit_on_user_error  # noqa: E402


def parse_args(argv=None):
    parser = ArgumentParser(prog="convert_hf_to_mcore.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True, help="Hugging Face model folder")
    parser.add_argument("--save", required=True, help="new (or empty) checkpoint directory")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="precision of the saved weights (default: fp32)")
    return parser.parse_args(argv)


def validate(args):
    """Everything checkable without a process group: the folder, its architecture and tensor
    names, the output directory, the layout. Returns (hf_config, ModelConfig, HFWeights)."""
    from logra_megatron.convert.hf import check_hf_names, model_config_from_hf
    from logra_megatron.convert.hf_io import HFWeights, check_hf_dir, check_output_dir, read_hf_config
    from logra_megatron.convert.runtime import check_layout

    if not os.path.isdir(args.hf_dir):
        check_hf_dir(args.hf_dir)  # raises: the folder does not exist
    hf_config = read_hf_config(args.hf_dir)
    model = model_config_from_hf(hf_config)  # the architecture, before looking for weights
    weights = HFWeights(args.hf_dir)
    check_hf_names(weights, model)
    check_output_dir(args.save, "--save")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    check_layout(model, tp, pp, launch.world_size() if launch.under_torchrun() else tp * pp,
                 os.path.basename(os.path.normpath(args.hf_dir)))
    return hf_config, model, weights


def convert(args, hf_config, model, weights) -> None:
    """On every rank: build this rank's shard, fill it from the HF tensors, save collectively."""
    from tqdm import tqdm

    from logra_megatron import parallel
    from logra_megatron.checkpoint import save_checkpoint
    from logra_megatron.convert.hf import MegatronView, sliding_window_note
    from logra_megatron.convert.hf_io import TOKENIZER_DIR, copy_tokenizer, save_hf_source
    from logra_megatron.convert.runtime import build_model, parse_dtype
    from logra_megatron.models.weights import load_full_state

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    rank0 = launch.is_rank0()
    note = sliding_window_note(hf_config)
    if note and rank0:
        print(note, file=sys.stderr, flush=True)
    parallel.initialize(tp, pp)
    megatron = build_model(model, parse_dtype(args.dtype))
    count = sum(1 for _ in megatron.named_parameters())
    with tqdm(total=count, desc=f"converting (rank 0 of {launch.world_size()})", unit="tensor",
              disable=not rank0) as bar:
        view = MegatronView(weights, model, model.padded_vocab(tp), on_access=lambda _: bar.update())
        load_full_state(megatron, view)
    if rank0:
        print(f"saving {model.family} ({model.num_parameters():,} parameters) at tp={tp} pp={pp} "
              f"to {args.save}", file=sys.stderr, flush=True)
    save_checkpoint(args.save, megatron, model)
    if rank0:
        save_hf_source(args.hf_dir, args.save)
        copied = copy_tokenizer(args.hf_dir, os.path.join(args.save, TOKENIZER_DIR))
        if not copied:
            print(f"note: {args.hf_dir} has no tokenizer files; none copied", file=sys.stderr)
        print(f"converted {args.hf_dir} -> {args.save}", flush=True)


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    hf_config, model, weights = validate(args)
    launch.relaunch_if_needed(args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    from logra_megatron import parallel

    try:
        convert(args, hf_config, model, weights)
    finally:
        parallel.destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
