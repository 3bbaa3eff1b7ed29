"""A step's environment errors in the run's log: the first five and a count of the rest, written by the driver
(``log_episode_errors``), whatever the step mode; each episode keeps its own error (``Episode.error``)."""

from __future__ import annotations

from relayrl.environments.base import Episode, EpisodeEnd
from relayrl.workflows.episodes import log_episode_errors


def test_the_driver_logs_the_first_five_errors_of_a_step_and_how_many_more():
    eps = [Episode(i, 0, [1]) for i in range(8)]
    for e in eps:
        e.end, e.error = EpisodeEnd.ERROR, "env.step raised KeyError: 'x'"
    lines = []
    log_episode_errors(type("S", (), {"log": staticmethod(lines.append)})(), eps, step=3)
    assert lines[:5] == [f"step 3: episode of problem {i} ended with an environment error: env.step raised "
                         f"KeyError: 'x'" for i in range(5)]
    assert lines[5:] == ["step 3: 3 more episodes ended with environment errors"]
