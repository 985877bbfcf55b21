from __future__ import annotations

import random

import pytest

from waltz_api.backoff import Backoff
from waltz_api.errors import ConfigError


def test_delays_double_up_to_the_maximum_with_jitter_below_each_step() -> None:
    backoff = Backoff(0.1, 1.0, random.Random(1), jitter=0.5)
    delays = [backoff.next_delay() for _ in range(8)]
    steps = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0]
    for delay, step in zip(delays, steps, strict=True):
        assert step * 0.5 <= delay <= step
    backoff.reset()
    assert backoff.next_delay() <= 0.1


def test_same_seed_same_delays_and_no_jitter_is_exact() -> None:
    first = [Backoff(0.05, 2.0, random.Random(7)).next_delay() for _ in range(3)]
    second = [Backoff(0.05, 2.0, random.Random(7)).next_delay() for _ in range(3)]
    assert first == second
    exact = Backoff(0.5, 2.0, random.Random(0), jitter=0.0)
    assert [exact.next_delay() for _ in range(4)] == [0.5, 1.0, 2.0, 2.0]


@pytest.mark.parametrize(
    ("initial", "maximum", "factor", "jitter"),
    [(0.0, 1.0, 2.0, 0.5), (2.0, 1.0, 2.0, 0.5), (0.1, 1.0, 0.5, 0.5), (0.1, 1.0, 2.0, 1.0)],
)
def test_bad_settings_are_refused(
    initial: float, maximum: float, factor: float, jitter: float
) -> None:
    with pytest.raises(ConfigError, match="back-off"):
        Backoff(initial, maximum, factor=factor, jitter=jitter)
