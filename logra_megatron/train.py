"""The main job: GRPO post-training with LoGRA and predicted-KL control.

    python -m logra_megatron.train                       # embedded default, CPU, no download
    torchrun --nproc-per-node 2 -m logra_megatron.train --tensor-model-parallel-size 2
    python -m logra_megatron.train --config examples/tiny_arithmetic.yaml --optimizer adam

Flags are validated before any process group starts; bad input is one ``error:`` line.
"""

import sys

from logra_megatron.config import parse_train_args
from logra_megatron.errors import exit_on_user_error


@exit_on_user_error
def main(argv=None):
    config = parse_train_args(sys.argv[1:] if argv is None else argv)
    # megatron-core (~5 s to import) loads only after the flags were checked.
    from logra_megatron import parallel
    from logra_megatron.rl.trainer import train

    try:
        train(config)
    finally:
        parallel.destroy()


if __name__ == "__main__":
    main()
