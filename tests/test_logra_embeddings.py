"""Sketched embeddings and output layer (--logra-embeddings) against the dense model from the same
weights: the sketch is the projected dense gradient (tied and untied), the range finder's sample
too, and LoGRA's clipping norm (sketch + probe estimate) is within 10% of the dense gradient norm.
TP=2 / PP=2 equality with TP=1 is checked in tests/test_logra_parallel.py."""

import pytest
import torch

from logra_megatron import parallel
from logra_megatron.logra.config import LogRAConfig
from logra_megatron.models import get_preset
from logra_megatron.training.config import OptimizerSettings
from logra_megatron.training.lm import lm_forward_backward
from logra_megatron.training.setup import build_trainable

TOKENS = torch.randint(0, 200, (8, 33), generator=torch.Generator().manual_seed(0))


def model_config(tied):
    return get_preset("tiny").with_changes(tie_embeddings=tied)


def backward(kind, tied, logra=None):
    parallel.initialize(1, 1, seed=1234)
    model, ddp, optimizer = build_trainable(model_config(tied), OptimizerSettings(kind=kind, lr=1e-3),
                                            logra or LogRAConfig(rank=0.5, embeddings=True))
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    lm_forward_backward(ddp, TOKENS, 4)
    return model, optimizer


@pytest.mark.parametrize("tied", [False, True])
def test_embedding_sketches_equal_the_projected_dense_gradients(tied):
    dense_model, _ = backward("adam", tied)
    dense = {name: param.main_grad.clone() for name, param in dense_model.named_parameters()
             if name in ("embedding.word_embeddings.weight", "output_layer.weight")}
    _, optimizer = backward("logra", tied)
    entries = {entry.name: entry for entry in optimizer.weights if entry.vocab_rows is not None}
    assert set(entries) == set(dense) and len(entries) == (1 if tied else 2)
    for name, entry in entries.items():
        gradient = dense[name].double()
        assert gradient.norm() > 0
        q = entry.sketch.projection.double()
        error = (entry.sketch.sketch.double() - gradient @ q).norm() / (gradient @ q).norm()
        assert error < 1e-5, (name, error)
        # The range finder's sample of step 0 (a refresh step): G^T Omega.
        expected = gradient.t() @ entry.sketch.test_matrix.double()
        error = (entry.sketch.range_sample.double() - expected).norm() / expected.norm()
        assert error < 1e-5, (name, error)


@pytest.mark.parametrize("embeddings", [False, True])
def test_clipping_norm_estimates_the_dense_gradient_norm(embeddings):
    _, dense = backward("adam", False)
    _, dense_norm, _ = dense.step()
    _, logra = backward("logra", False, LogRAConfig(rank=0.5, embeddings=embeddings))
    _, logra_norm, _ = logra.step()
    norms = logra.diagnostics()
    assert norms["grad_norm"] == logra_norm
    assert logra_norm == pytest.approx(dense_norm, rel=0.10), (logra_norm, dense_norm)
    # The sketch alone misses the gradient outside the projection (what clipping used before).
    assert norms["grad_norm_sketch"] < 0.95 * dense_norm, (norms, dense_norm)
    _, sketch_only = backward("logra", False, LogRAConfig(rank=0.5, embeddings=embeddings, norm_probes=0))
    _, sketch_norm, _ = sketch_only.step()
    assert sketch_norm == pytest.approx(norms["grad_norm_sketch"], rel=1e-6)
