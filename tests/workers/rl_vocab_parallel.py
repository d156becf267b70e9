"""Vocab-parallel log-probs, entropy and KL at TP=2 against the full-vocabulary computation.

Every rank builds the same full logits ``[s, b, V]`` (same seed), keeps its vocabulary slice,
and runs the vocab-parallel functions; the reference is ``log_softmax`` of the full tensor,
computed on every rank. Gradients come from the same random upstream weights on every rank, and
the rank's slice of the reference gradient must equal its local gradient. Each check returns
the largest absolute difference it saw.
"""

import torch
import torch.nn.functional as F
from common import Checks

from logra_megatron import parallel
from logra_megatron.ops.vocab_parallel import (
    masked_half_variance_sum,
    masked_kl_sum,
    vocab_parallel_kl,
    vocab_parallel_logprobs,
    vocab_parallel_logprobs_and_entropy,
)

checks = Checks()
SEQ, BATCH, VOCAB = 5, 3, 12
parallel.initialize(tensor_parallel=2)
TP, RANK = parallel.tp_size(), parallel.tp_rank()
LOCAL = VOCAB // TP
SLICE = slice(RANK * LOCAL, (RANK + 1) * LOCAL)


def inputs(dtype=torch.float64, seed=0, scale=3.0):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(SEQ, BATCH, VOCAB, generator=generator, dtype=torch.float64) * scale).to(dtype)
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=generator)
    weight_logprob = torch.randn(SEQ, BATCH, generator=generator, dtype=torch.float64)
    weight_entropy = torch.randn(SEQ, BATCH, generator=generator, dtype=torch.float64)
    return logits, target, weight_logprob, weight_entropy


def reference(logits, target, temperature=1.0):
    log_probs = F.log_softmax(logits.double() / temperature, dim=-1)
    logprob = log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logprob, entropy


def max_diff(a, b):
    return float((a.double() - b.double()).abs().max())


def compare(dtype, temperature=1.0, seed=0):
    logits, target, w_lp, w_h = inputs(dtype, seed)
    full = logits.detach().clone().double().requires_grad_(True)
    ref_lp, ref_h = reference(full, target, temperature)
    ((ref_lp * w_lp).sum() + (ref_h * w_h).sum()).backward()

    local = logits[..., SLICE].detach().clone().requires_grad_(True)
    logprob, entropy = vocab_parallel_logprobs_and_entropy(local, target, temperature)
    ((logprob.double() * w_lp).sum() + (entropy.double() * w_h).sum()).backward()
    return {
        "logprob": max_diff(logprob, ref_lp),
        "entropy": max_diff(entropy, ref_h),
        "grad": max_diff(local.grad, full.grad[..., SLICE]),
        "grad_scale": float(full.grad.abs().max()),
        "grad_dtype": str(local.grad.dtype),
    }


def logprob_only_gradient():
    """The policy-loss path: only the log-prob is used, the entropy output gets no gradient."""
    logits, target, w_lp, _ = inputs(torch.float64, seed=3)
    full = logits.clone().requires_grad_(True)
    (reference(full, target)[0] * w_lp).sum().backward()
    local = logits[..., SLICE].clone().requires_grad_(True)
    (vocab_parallel_logprobs(local, target) * w_lp).sum().backward()
    return {"grad": max_diff(local.grad, full.grad[..., SLICE])}


def matches_megatron_cross_entropy():
    """-logprob equals Megatron's vocab_parallel_cross_entropy (given a clone: it works in place)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits, target, _, _ = inputs(torch.float32, seed=4)
    local = logits[..., SLICE].contiguous()
    megatron_loss = vocab_parallel_cross_entropy(local.clone(), target)
    return {"diff": max_diff(vocab_parallel_logprobs(local, target), -megatron_loss)}


def masked_vocabulary_entries():
    """-inf logits (a masked vocabulary tail, on rank 1's slice) give finite values and grads."""
    logits, target, w_lp, w_h = inputs(torch.float64, seed=5)
    logits[..., VOCAB - 2:] = float("-inf")
    target = target.clamp(max=VOCAB - 3)
    full = logits[..., : VOCAB - 2].clone().requires_grad_(True)
    ref_lp, ref_h = reference(full, target)
    ((ref_lp * w_lp).sum() + (ref_h * w_h).sum()).backward()
    reference_grad = torch.cat([full.grad, torch.zeros(SEQ, BATCH, 2, dtype=torch.float64)], -1)

    local = logits[..., SLICE].clone().requires_grad_(True)
    logprob, entropy = vocab_parallel_logprobs_and_entropy(local, target)
    ((logprob * w_lp).sum() + (entropy * w_h).sum()).backward()
    return {
        "logprob": max_diff(logprob, ref_lp),
        "entropy": max_diff(entropy, ref_h),
        "grad": max_diff(local.grad, reference_grad[..., SLICE]),
        "finite": bool(torch.isfinite(local.grad).all()),
    }


def kl_matches_full_vocabulary():
    logits_p, _, _, _ = inputs(torch.float64, seed=6)
    logits_q = logits_p + 0.3 * inputs(torch.float64, seed=7)[0]
    log_p, log_q = F.log_softmax(logits_p, -1), F.log_softmax(logits_q, -1)
    expected = (log_p.exp() * (log_p - log_q)).sum(-1)
    kl = vocab_parallel_kl(logits_p[..., SLICE], logits_q[..., SLICE])
    same = vocab_parallel_kl(logits_p[..., SLICE], logits_p[..., SLICE])
    return {"diff": max_diff(kl, expected), "self_kl": float(same.abs().max()),
            "min_expected": float(expected.min())}


def chunked_kl_sums():
    """The KL controller's masked sums on this rank's slice, in token chunks of 2 positions (15
    positions: the last chunk is short) and in one chunk, against the full-vocabulary fp64 sums."""
    logits_p, _, _, _ = inputs(torch.float64, seed=8)
    logits_q = logits_p + 0.3 * inputs(torch.float64, seed=9)[0]
    mask = (torch.arange(SEQ * BATCH).reshape(SEQ, BATCH) % 3 != 1).to(torch.float64)
    log_p, log_q = F.log_softmax(logits_p, -1), F.log_softmax(logits_q, -1)
    expected_kl = float(((log_p.exp() * (log_p - log_q)).sum(-1) * mask).sum())
    epsilon = 0.5
    delta = (logits_q - logits_p) / epsilon
    p = log_p.exp()
    mean = (p * delta).sum(-1)
    expected_var = float((0.5 * ((p * delta.square()).sum(-1) - mean.square()) * mask).sum())
    local_p, local_q = logits_p[..., SLICE], logits_q[..., SLICE]
    out = {}
    for name, chunk in (("chunked", 2 * LOCAL), ("whole", 10**9)):
        out[f"kl_{name}"] = abs(masked_kl_sum(local_p, local_q, mask, chunk_elements=chunk) - expected_kl)
        out[f"var_{name}"] = abs(masked_half_variance_sum(local_p, local_q, epsilon, mask, chunk_elements=chunk)
                                 - expected_var)
    out["scale"] = min(abs(expected_kl), abs(expected_var))
    return out


checks.run("layout", lambda: {"tp": TP, "local_vocab": LOCAL})
checks.run("float64", compare, torch.float64)
checks.run("float32", compare, torch.float32, seed=1)
checks.run("bfloat16", compare, torch.bfloat16, seed=1)
checks.run("temperature", compare, torch.float64, temperature=0.7, seed=2)
checks.run("logprob_only_gradient", logprob_only_gradient)
checks.run("megatron_cross_entropy", matches_megatron_cross_entropy)
checks.run("masked_vocabulary", masked_vocabulary_entries)
checks.run("kl", kl_matches_full_vocabulary)
checks.run("chunked_kl_sums", chunked_kl_sums)
checks.save()
parallel.destroy()
