"""The phase timer: a phase's time includes the phases nested in it, or, opened ``exclusive``,
leaves them out (the KL controller's probe forward passes, inside which each part's divergence
is computed and timed as its logits come out), so sibling sub-phases stay disjoint."""

import time

from logra_megatron.platform.phases import PhaseTimer, phase


def test_an_exclusive_phase_leaves_out_what_is_nested_in_it():
    with PhaseTimer() as timer:
        with phase("outer"):
            with phase("forward", exclusive=True):
                time.sleep(0.05)
                with phase("divergence"):
                    time.sleep(0.2)
            with phase("plain"):
                time.sleep(0.05)
                with phase("inner"):
                    time.sleep(0.2)
    seconds = timer.seconds
    assert 0.05 <= seconds["forward"] < 0.15, seconds  # its own 0.05 s, not the nested 0.2 s
    assert seconds["divergence"] >= 0.2, seconds
    assert seconds["plain"] >= 0.25, seconds  # not exclusive: the nested time is in it
    # the enclosing phase sees every nested phase whole, exclusive or not
    assert seconds["outer"] >= seconds["forward"] + seconds["divergence"] + seconds["plain"] - 1e-6
    assert timer.calls == {"outer": 1, "forward": 1, "divergence": 1, "plain": 1, "inner": 1}
