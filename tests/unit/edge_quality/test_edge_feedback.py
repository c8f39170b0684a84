"""The edge gate learns from the cascade's verdicts: neighbours that escalated, and a negative net saving."""

from __future__ import annotations

import numpy as np

from policies.edge_feedback import EdgeFeedback, FeedbackSettings

KEY = ("t", "a")
SETTINGS = FeedbackSettings(explore_every=0)


def vec(i: int, noise: float = 0.0, seed: int = 0) -> np.ndarray:
    """A unit vector near basis direction i (cosine with it about 1 - noise^2/2)."""
    rng = np.random.default_rng(seed)
    v = np.zeros(384, dtype=np.float32)
    v[i] = 1.0
    v += noise * rng.standard_normal(384).astype(np.float32) / np.sqrt(384)
    return v / np.linalg.norm(v)


def test_prompts_like_ones_that_escalated_stop_trying_the_edge() -> None:
    fb = EdgeFeedback()
    assert fb.gate(KEY, vec(0), 0.9, 0.5, SETTINGS).try_edge  # nothing learnt yet
    for seed in range(3):
        fb.record(KEY, vec(0, 0.1, seed), escalated=True, saving=1.0, settings=SETTINGS)  # savings kept positive
    gate = fb.gate(KEY, vec(0, 0.1, 99), 0.9, 0.5, SETTINGS)
    assert (gate.try_edge, gate.reason, gate.neighbours, gate.escalated_share) == (False, "calibration_history", 3, 1.0)
    assert fb.gate(KEY, vec(7), 0.9, 0.5, SETTINGS).try_edge  # an unlike prompt still tries
    assert fb.gate(("other", "a"), vec(0), 0.9, 0.5, SETTINGS).try_edge  # per tenant/app


def test_kept_neighbours_keep_a_prompt_on_the_edge() -> None:
    fb = EdgeFeedback()
    for seed in range(4):
        fb.record(KEY, vec(1, 0.1, seed), escalated=seed == 0, saving=1.0, settings=SETTINGS)
    gate = fb.gate(KEY, vec(1, 0.1, 50), 0.9, 0.5, SETTINGS)
    assert gate.try_edge and gate.escalated_share == 0.25


def test_a_negative_net_saving_tightens_the_gate_until_it_is_not() -> None:
    fb = EdgeFeedback()
    for i in range(4):  # four escalations of unrelated prompts: the window's net saving is negative
        fb.record(KEY, vec(10 + i), escalated=True, saving=-0.01, settings=SETTINGS)
    state = fb.state(KEY)
    assert state is not None and abs(state["margin"] - 0.2) < 1e-9
    held = fb.gate(KEY, vec(3), 0.65, 0.5, SETTINGS)  # 0.65 < 0.5 + 0.2
    assert (held.try_edge, held.reason) == (False, "calibration_net_saving")
    assert fb.gate(KEY, vec(3), 0.75, 0.5, SETTINGS).try_edge
    fb.record(KEY, vec(20), escalated=False, saving=0.1, settings=SETTINGS)  # one kept answer pays for them
    state = fb.state(KEY)
    assert state is not None and abs(state["margin"] - (0.2 - 0.0125)) < 1e-9
    for i in range(20):
        fb.record(KEY, vec(30 + i), escalated=False, saving=0.01, settings=SETTINGS)
    state = fb.state(KEY)
    assert state is not None and state["margin"] == 0.0
    assert fb.gate(KEY, vec(3), 0.65, 0.5, SETTINGS).try_edge


def test_held_off_requests_age_the_losses_out_and_the_gate_loosens_again() -> None:
    """The window counts requests, not attempts: a tight gate stops spending and recovers on its own."""
    fb = EdgeFeedback()
    settings = FeedbackSettings(window=5, step=0.1, explore_every=0)
    for i in range(2):
        fb.record(KEY, vec(10 + i), escalated=True, saving=-0.01, settings=settings)
    for _ in range(3):  # the losses are still in the window: held off, and the margin holds
        assert fb.gate(KEY, vec(3), 0.6, 0.5, settings).reason == "calibration_net_saving"
    state = fb.state(KEY)
    assert state is not None and abs(state["margin"] - 0.2) < 1e-9 and state["net_saving"] < 0
    decisions = [fb.gate(KEY, vec(3), 0.58, 0.5, settings) for _ in range(8)]
    state = fb.state(KEY)
    assert state is not None and state["net_saving"] == 0.0 and state["window"] == 5.0
    # both losses aged out on the 2nd request; each held-off request since lowered the margin by step/4
    # until 0.58 >= 0.5 + margin (a try leaves it: its verdict moves it)
    assert [d.try_edge for d in decisions] == [False] * 6 + [True] * 2
    assert abs(decisions[-1].margin - (0.2 - 5 * 0.025)) < 1e-9


def test_a_tight_gate_explores_only_while_the_window_is_not_losing() -> None:
    fb = EdgeFeedback()
    settings = FeedbackSettings(window=4, step=0.5, explore_every=3)
    fb.record(KEY, vec(5), escalated=True, saving=-1.0, settings=settings)  # margin 0.5: prior 0.52 is held off
    tries = [fb.gate(KEY, vec(6), 0.52, 0.5, settings).try_edge for _ in range(9)]
    # the loss leaves the window on the 3rd request (not an exploration: still losing then); the 6th and
    # 9th explore (their verdicts would take their place in the window)
    assert tries == [False, False, False, False, False, True, False, False, True]


def test_memory_and_keys_are_bounded() -> None:
    fb = EdgeFeedback()
    small = FeedbackSettings(memory=4, window=3, explore_every=0)
    for i in range(10):
        fb.record(KEY, vec(i), escalated=False, saving=1.0, settings=small)
    state = fb.state(KEY)
    assert state is not None and (state["remembered"], state["window"]) == (4.0, 3.0)
    for i in range(300):
        fb.record((f"t{i}", "a"), vec(0), escalated=False, saving=1.0, settings=small)
    assert fb.state(KEY) is None  # the least recently used tenant/app was forgotten


def test_an_escalation_while_losing_holds_off_prompts_no_likelier_than_it_at_once() -> None:
    fb = EdgeFeedback()
    fb.record(KEY, vec(10), escalated=True, saving=-0.01, settings=SETTINGS, prior=0.7, threshold=0.5)
    state = fb.state(KEY)
    assert state is not None and abs(state["margin"] - 0.25) < 1e-9  # 0.7 - 0.5 + step, not one step
    assert fb.gate(KEY, vec(3), 0.74, 0.5, SETTINGS).reason == "calibration_net_saving"
    assert fb.gate(KEY, vec(3), 0.76, 0.5, SETTINGS).try_edge
    fb.record(KEY, vec(11), escalated=True, saving=-0.01, settings=SETTINGS, prior=0.55, threshold=0.5)
    state = fb.state(KEY)
    assert state is not None and abs(state["margin"] - 0.3) < 1e-9  # a less likely one: one step more
    kept = EdgeFeedback()
    kept.record(KEY, vec(10), escalated=False, saving=0.01, settings=SETTINGS, prior=0.7, threshold=0.5)
    assert kept.gate(KEY, vec(3), 0.51, 0.5, SETTINGS).try_edge  # a kept answer does not tighten
