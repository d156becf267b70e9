"""The echo engine's worker (tests/plugins/echo_engine.py): a RemoteWorker whose "engine" is the
dictionary of weights it was last sent, by Hugging Face name. Its completions are a function of
the prompt and of the weights' sum, so rows sampled before and after a sync differ, and equal
rows on two ranks mean the engine's rank broadcast them."""

import traceback

import torch

from logra_megatron.rollout.remote_worker import RemoteWorker


class EchoWorker(RemoteWorker):
    def __init__(self, vocab: int):
        self.vocab = vocab
        self.weights = {}

    def reload_weights(self, weights_iterator):
        # Copies: a tensor read from the exchange file is a view of a file about to be removed.
        self.weights.update((name, tensor.detach().to(torch.float64, copy=True)) for name, tensor in weights_iterator)

    def echo_checksums(self):
        return {name: float(tensor.sum()) for name, tensor in self.weights.items()}

    def echo_generate(self, prompts, samples, max_new):
        total = sum(float(tensor.abs().sum()) for tensor in self.weights.values())
        salt = int(total * 1e4)  # any change of the weights changes every row
        rows = [[(prompt[-1] + salt + 7 * sample + step) % self.vocab
                 for step in range(1 + (sample + len(prompt)) % max_new)]  # rows of several lengths
                for prompt in prompts for sample in range(samples)]
        return rows, [[-1.0] * len(row) for row in rows]


def serve(pipe, vocab: int) -> None:
    """Answer ``(method, args, kwargs)`` with ``(True, result)`` or ``(False, traceback)`` until
    ``None`` arrives."""
    worker = EchoWorker(vocab)
    while (call := pipe.recv()) is not None:
        method, args, kwargs = call
        try:
            pipe.send((True, getattr(worker, method)(*args, **kwargs)))
        except Exception:
            pipe.send((False, traceback.format_exc()))
