"""Conversion checks on 2 gloo ranks, for every tiny HF model given as ``name=dir``:

* HF weights mapped into Megatron at TP=1 (DP=2), TP=2 and PP=2 give the HF model's logits;
* gathering the sharded model back (``full_state``) and mapping to HF reproduces every HF
  tensor bitwise at TP=2 and PP=2;
* a dist checkpoint saved at TP=2 loads at PP=2 and TP=1 with the same logits.

Everything runs under ``main()``: dist_checkpointing's save starts a multiprocessing manager
with the spawn method, which re-imports this script; unguarded top-level code would run again
in that process and deadlock the save.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from common import Checks  # noqa: E402

from logra_megatron import parallel  # noqa: E402
from logra_megatron.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from logra_megatron.convert.hf import MegatronView, megatron_to_hf, model_config_from_hf  # noqa: E402
from logra_megatron.convert.hf_io import HFWeights, read_hf_config  # noqa: E402
from logra_megatron.convert.reference import load_hf_model  # noqa: E402
from logra_megatron.convert.runtime import build_model, full_vocab_logits  # noqa: E402
from logra_megatron.models.weights import full_state, load_full_state  # noqa: E402

LAYOUTS = ((1, 1), (2, 1), (1, 2))
CKPT_MODELS = ("qwen2_tied", "llama_untied_hd32")


class Fixture:
    """The tiny models' configs, lazily read weights and HF reference logits."""

    def __init__(self, models: dict):
        self.paths = models
        self.configs = {name: model_config_from_hf(read_hf_config(path)) for name, path in models.items()}
        self.weights = {name: HFWeights(path) for name, path in models.items()}
        self.tokens = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            self.reference = {name: load_hf_model(path)(input_ids=self.tokens).logits.float()
                              for name, path in models.items()}

    def logits_error(self, model, name) -> dict:
        logits = full_vocab_logits(model, self.tokens, self.configs[name].vocab)
        if logits is None:
            return {"last_stage": False}
        return {"last_stage": True,
                "max_abs_diff": float((logits - self.reference[name]).abs().max()),
                "scale": float(self.reference[name].abs().max())}

    def converted(self, name, tp):
        config = self.configs[name]
        model = build_model(config)
        load_full_state(model, MegatronView(self.weights[name], config, config.padded_vocab(tp)))
        return model

    def gathered_roundtrip(self, model, name) -> dict:
        back = megatron_to_hf(full_state(model), self.configs[name])
        original = {key: self.weights[name][key] for key in self.weights[name]}
        return {"names_differ": sorted(set(back) ^ set(original)),
                "tensors_differ": sorted(k for k in original
                                         if k in back and not torch.equal(back[k], original[k]))}


def main():
    checks = Checks()
    fx = Fixture(dict(item.split("=", 1) for item in checks.extra))
    ckpt = {name: os.path.join(checks.args.out, f"ckpt_{name}") for name in CKPT_MODELS}

    for tp, pp in LAYOUTS:
        parallel.initialize(tp, pp, seed=100 + tp * 10 + pp)
        for name in fx.paths:
            model = checks.run(f"build_{name}_tp{tp}_pp{pp}", fx.converted, name, tp)
            if isinstance(model, dict):  # the build raised; its traceback stays recorded
                continue
            checks.results.pop(f"build_{name}_tp{tp}_pp{pp}")
            checks.run(f"logits_{name}_tp{tp}_pp{pp}", fx.logits_error, model, name)
            if (tp, pp) != (1, 1):
                checks.run(f"gather_{name}_tp{tp}_pp{pp}", fx.gathered_roundtrip, model, name)
            if (tp, pp) == (2, 1) and name in ckpt:
                checks.run(f"ckpt_save_{name}",
                           lambda: save_checkpoint(ckpt[name], model, fx.configs[name]) or True)

    def load_saved(name):
        model = build_model(fx.configs[name])  # random weights: the load must replace them all
        load_checkpoint(ckpt[name], model)
        return fx.logits_error(model, name)

    for tp, pp in ((1, 2), (1, 1)):
        parallel.initialize(tp, pp, seed=7)
        for name in ckpt:
            checks.run(f"ckpt_load_{name}_tp{tp}_pp{pp}", load_saved, name)

    checks.save()
    parallel.destroy()


if __name__ == "__main__":
    main()
