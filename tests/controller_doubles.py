"""Stand-ins for what the KL controller talks to, where a test gives the KL itself: an optimizer
whose proposed step is all the controller needs, and step logits with nothing cached."""


class Proposal:
    """An optimizer whose proposed step is all the controller needs (the KL is synthetic)."""

    def __init__(self):
        self.committed = []

    def propose(self):
        return True, 1.0, None

    def preview(self, scale):
        pass

    def commit(self, scale):
        self.committed.append(scale)

    def discard(self):
        pass

    def extra_bytes(self):
        return 0


class NoLogits:
    def base(self, probe):
        return []


class SizedProposal(Proposal):
    """A :class:`Proposal` that says its step's length (``proposed_step_norm``), one figure a step
    from ``norms``."""

    def __init__(self, norms):
        super().__init__()
        self.norms = list(norms)
        self.step = -1

    def propose(self):
        self.step += 1
        return super().propose()

    def proposed_step_norm(self):
        return self.norms[self.step]


def count_probe_passes(monkeypatch, calls: dict) -> None:
    """Count in ``calls`` the probe's forward passes (``"passes"``: ``ProbeSet.each_logits``
    calls, each taking all of a probe's parts through the schedule together) and the parts they
    computed (``"parts"``)."""
    from logra_megatron.training.kl_control import ProbeSet

    each_logits = ProbeSet.each_logits

    def counting_each_logits(self, model, consume):
        calls["passes"] += 1

        def counting_consume(index, logits):
            calls["parts"] += 1
            consume(index, logits)
        return each_logits(self, model, counting_consume)

    monkeypatch.setattr(ProbeSet, "each_logits", counting_each_logits)
