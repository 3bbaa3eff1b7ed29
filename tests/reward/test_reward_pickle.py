"""A reward engine sent to another process (a scorer on a pool of its own on Ray, ``placement.reward``): it
scores there as here, its user functions loaded again from their files, its lock and threads made anew."""

from __future__ import annotations

import pickle
import threading

import pytest

from relayrl.engines.reward import RewardConfig, RewardEngine, RewardError


def test_a_reward_engine_with_a_file_user_function_pickles_and_scores_the_same(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def score(prompts, responses, answers):\n"
                 "    return [float(r.strip() == a) + 0.5 * len(r) for r, a in zip(responses, answers)]\n")
    eng = RewardEngine(RewardConfig(verifier="user", user_fn=f"{f}:score", workers=2))
    rows = (["1+1=", "2+2="], ["2", "5 "], ["2", "4"])
    want, _ = eng.score(*rows)
    copy = pickle.loads(pickle.dumps(eng))
    got, _ = copy.score(*rows)
    assert got == want and copy is not eng
    assert isinstance(copy._lock, type(threading.Lock())) and copy._lock is not eng._lock
    assert copy._pool is not None and copy._pool is not eng._pool
    eng.close()
    copy.close()
    with pytest.raises(RewardError, match="closed reward engine"):
        pickle.dumps(eng)
