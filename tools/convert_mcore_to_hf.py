"""Convert a Megatron distributed checkpoint back into a Hugging Face model folder.

    python tools/convert_mcore_to_hf.py --load CKPT --hf-dir OUT [--dtype auto|fp32|bf16|fp16]

Writes ``config.json``, ``model.safetensors`` (numbered shards plus an index above 5 GB) and
the tokenizer files saved with the checkpoint, so a trained policy can be evaluated with HF
tooling (``AutoModelForCausalLM.from_pretrained(OUT)``). The checkpoint may have been saved at
any TP/PP: it is loaded as one TP=1, PP=1 model in a single process (dist_checkpointing
reshards), so this tool never needs torchrun; the host needs memory for the full model.

``--dtype auto`` writes the precision of the model the checkpoint was converted from (kept in
``CKPT/hf_source/config.json``), or fp32 when that is unknown; other fields of the source
config (token ids, generation config) are carried over too.
"""

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from logra_megatron.cli import ArgumentParser  # noqa: E402
from logra_megatron.convert import launch  # noqa: E402
from logra_megatron.errors import UserError, exit_on_user_error  # noqa: E402


def parse_args(argv=None):
    parser = ArgumentParser(prog="convert_mcore_to_hf.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", required=True, help="Megatron checkpoint directory")
    parser.add_argument("--hf-dir", required=True, help="new (or empty) output folder")
    parser.add_argument("--dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                        help="precision of the written weights (default: auto, the source model's)")
    return parser.parse_args(argv)


def output_dtype(choice: str, source_config):
    """The torch dtype to write: the flag, or for ``auto`` the source model's."""
    import torch

    from logra_megatron.convert.runtime import DTYPES, HF_DTYPE_NAMES

    if choice != "auto":
        return DTYPES[choice]
    name = (source_config or {}).get("dtype") or (source_config or {}).get("torch_dtype")
    by_name = {value: key for key, value in HF_DTYPE_NAMES.items()}
    return by_name.get(name, torch.float32)


def validate(args):
    """Input checks before anything heavy is imported; returns (ModelConfig, source config)."""
    from logra_megatron.checkpoint import load_model_config
    from logra_megatron.convert.hf_io import check_output_dir, load_hf_source

    model = load_model_config(args.load)
    check_output_dir(args.hf_dir, "--hf-dir")
    if launch.world_size() > 1:
        raise UserError("convert_mcore_to_hf.py runs as a single process; start it with python, "
                        "not torchrun")
    return model, load_hf_source(args.load)


def convert(args, model, source) -> None:
    """Load the checkpoint as one TP=1 model, map to HF names, write the folder."""
    import json
    import shutil

    from tqdm import tqdm

    from logra_megatron import parallel
    from logra_megatron.checkpoint import load_checkpoint
    from logra_megatron.convert.hf import hf_config_from_model_config, megatron_to_hf
    from logra_megatron.convert.hf_io import (CONFIG_FILE, GENERATION_CONFIG_FILE, HF_SOURCE_DIR,
                                              TOKENIZER_DIR, copy_tokenizer, write_hf_weights)
    from logra_megatron.convert.runtime import HF_DTYPE_NAMES, build_model
    from logra_megatron.models.weights import full_state

    dtype = output_dtype(args.dtype, source)
    parallel.initialize(1, 1)
    megatron = build_model(model)
    print(f"loading {args.load} ({model.family}, {model.num_parameters():,} parameters)",
          file=sys.stderr, flush=True)
    load_checkpoint(args.load, megatron)
    hf_state = megatron_to_hf(full_state(megatron), model)
    del megatron
    tensors = {}
    for name, tensor in tqdm(hf_state.items(), desc="converting", unit="tensor"):
        tensors[name] = tensor.to(dtype).contiguous()
    write_hf_weights(tensors, args.hf_dir)
    config = hf_config_from_model_config(model, source, HF_DTYPE_NAMES[dtype])
    with open(os.path.join(args.hf_dir, CONFIG_FILE), "w") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)
    generation = os.path.join(args.load, HF_SOURCE_DIR, GENERATION_CONFIG_FILE)
    if os.path.isfile(generation):
        shutil.copy2(generation, os.path.join(args.hf_dir, GENERATION_CONFIG_FILE))
    if not copy_tokenizer(os.path.join(args.load, TOKENIZER_DIR), args.hf_dir):
        print(f"note: {args.load} has no tokenizer/ folder; none written", file=sys.stderr)
    print(f"converted {args.load} -> {args.hf_dir} ({HF_DTYPE_NAMES[dtype]})", flush=True)


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    model, source = validate(args)
    from logra_megatron import parallel

    try:
        convert(args, model, source)
    finally:
        parallel.destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
