"""A checkpoint written the way Megatron-LM writes one, loaded by our code at three layouts.

On 2 gloo ranks: a GPT model is built at TP=2 from megatron-core alone (Megatron-LM's
``model_provider``: the local layer spec with RMSNorm, SwiGLU, rotary positions, grouped-query
attention with a QKV bias, untied output layer, the vocabulary padded to 128 x TP) and saved with
``dist_checkpointing`` under ``iter_0000007/`` beside Megatron-LM's common state (its ``args``
namespace with Megatron-LM's names, ``iteration``, ``checkpoint_version``) and the tracker file;
then ``logra_megatron`` reads the architecture from those args alone and loads the weights at
TP=2, TP=1 (DP=2) and PP=2; each layout's logits are compared with the source model's.

Arguments: ``--tokenizer DIR`` (the Hugging Face tokenizer folder the args name).
Everything runs under ``main()``: dist_checkpointing's save re-imports this script.
"""

import argparse
import os

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import Checks  # noqa: E402

from logra_megatron import parallel  # noqa: E402

ITERATION = 7
SHAPE = dict(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
             kv_channels=16, max_position_embeddings=256, norm_epsilon=1e-6, rotary_base=1000000)
TOKENIZER_VOCAB = 120


class TrainingOnlySetting:
    """Stands for an object of a class Megatron-LM's args hold that does not import where the
    checkpoint is read (pickled as ``__main__.TrainingOnlySetting``)."""


def megatron_lm_args(tokenizer_dir: str, tensor_parallel: int) -> argparse.Namespace:
    """The args as Megatron-LM's arguments.py names them (a subset; Megatron-LM saves them all)."""
    from megatron.core.transformer.enums import AttnBackend

    step = 128 * tensor_parallel  # --make-vocab-size-divisible-by 128, times TP
    return argparse.Namespace(
        **SHAPE, group_query_attention=True, seq_length=128, position_embedding_type="rope",
        use_rotary_position_embeddings=True, rotary_percent=1.0, normalization="RMSNorm", swiglu=True,
        add_bias_linear=False, add_qkv_bias=True, untie_embeddings_and_output_weights=True,
        apply_layernorm_1p=False, qk_layernorm=False, num_experts=None, multi_latent_attention=False,
        padded_vocab_size=(TOKENIZER_VOCAB + step - 1) // step * step, make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model=tokenizer_dir, bf16=False, fp16=False, params_dtype=torch.float32,
        attention_backend=AttnBackend.auto, ckpt_format="torch_dist", transformer_impl="local",
        lr=1e-5, micro_batch_size=1, global_batch_size=64, iteration=ITERATION,
        data_args=TrainingOnlySetting())


def megatron_lm_model(args: argparse.Namespace):
    """What Megatron-LM's pretrain_gpt.py model_provider builds for ``args`` (local spec)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu, activation_func=F.silu, add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias, attention_dropout=0.0, hidden_dropout=0.0,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, use_cpu_initialization=True,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        init_method_std=0.05)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                     pre_process=True, post_process=True, parallel_output=True,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                     rotary_base=args.rotary_base)
    with torch.no_grad():  # trained-looking biases and norms, not the init's zeros and ones
        generator = torch.Generator().manual_seed(11)
        for name, param in model.named_parameters():
            if name.endswith("bias") or "layernorm" in name or "final_layernorm" in name:
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return model.eval()


def main():
    from megatron.core import dist_checkpointing

    from logra_megatron.checkpoint import load_checkpoint, load_model_config
    from logra_megatron.checkpoint_layout import TRACKER_FILE, select_checkpoint
    from logra_megatron.convert.runtime import build_model, full_vocab_logits

    checks = Checks()
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    tokenizer_dir = parser.parse_args(checks.extra).tokenizer
    root = os.path.join(checks.args.out, "megatron_lm_run")
    tokens = torch.randint(0, TOKENIZER_VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))

    # --- Megatron-LM's side: build at TP=2, save iteration 7 as its save_checkpoint does --------
    parallel.initialize(2, 1, seed=1)
    args = megatron_lm_args(tokenizer_dir, 2)
    source = megatron_lm_model(args)
    with torch.no_grad():
        reference = full_vocab_logits(source, tokens, TOKENIZER_VOCAB)
    state = {"model": source.sharded_state_dict(), "args": args, "checkpoint_version": 3.0,
             "iteration": ITERATION, "num_floating_point_operations_so_far": 0}
    directory = os.path.join(root, f"iter_{ITERATION:07d}")
    if checks.rank == 0:
        os.makedirs(directory)
    torch.distributed.barrier()
    dist_checkpointing.save(state, directory)
    if checks.rank == 0:
        with open(os.path.join(root, TRACKER_FILE), "w") as handle:
            handle.write(str(ITERATION))
    torch.distributed.barrier()

    # --- ours: the architecture from the args, the weights at three layouts ---------------------
    def chosen():
        iteration, directory = select_checkpoint(root)
        return {"iteration": iteration, "directory": os.path.basename(directory),
                "model": load_model_config(directory).to_dict()}

    picked = checks.run("selected", chosen)

    def load_at(tp, pp):
        model_config = load_model_config(os.path.join(root, picked["directory"]))
        model = build_model(model_config)  # fresh random weights: the load must replace every one
        load_checkpoint(os.path.join(root, picked["directory"]), model)
        with torch.no_grad():
            logits = full_vocab_logits(model, tokens, TOKENIZER_VOCAB)
        if logits is None:
            return {"last_stage": False}
        return {"last_stage": True, "max_abs_diff": float((logits - reference).abs().max()),
                "scale": float(reference.abs().max())}

    for tp, pp in ((2, 1), (1, 1), (1, 2)):
        parallel.initialize(tp, pp, seed=50 + tp * 10 + pp)
        checks.run(f"logits_tp{tp}_pp{pp}", load_at, tp, pp)

    checks.save()
    parallel.destroy()


if __name__ == "__main__":
    main()
