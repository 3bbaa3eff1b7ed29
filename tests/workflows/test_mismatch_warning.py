"""The once-per-run warning when an on-policy step's generator and trainer disagree (rollout/logprob_error)."""

from relayrl.workflows.step_metrics import MISMATCH_WARN, mismatch_warning


def test_an_on_policy_step_past_the_bound_is_reported_with_the_causes():
    line = mismatch_warning({"rollout/logprob_error": 1.25, "rollout/logprob_error_max": 40.0}, step=3)
    assert line.startswith("relayrl: warning: step 3: rollout/logprob_error=1.25 (worst token 40)")
    assert "rollout.dtype" in line and "docs/errors.md" in line


def test_matching_log_probs_and_stale_tokens_are_not():
    assert mismatch_warning({"rollout/logprob_error": 1.0004}, step=1) is None
    assert mismatch_warning({"rollout/logprob_error": MISMATCH_WARN}, step=1) is None  # (the bound itself passes)
    assert mismatch_warning({}, step=1) is None  # (a step with no rollout metric: DAPO's skipped step)
    # off-policy tokens were sampled by older weights: they differ by design
    assert mismatch_warning({"rollout/logprob_error": 1.8, "async/staleness_max": 2.0}, step=5) is None
    assert mismatch_warning({"rollout/logprob_error": 1.8, "async/staleness_max": 0.0}, step=5) is not None


def test_a_nan_log_prob_error_is_left_to_the_non_finite_check():
    """Weights gone non-finite (a huge learning rate) give rollout/logprob_error=nan: the warning blamed dtypes
    and engines, just before the run stopped on the NaN loss it comes from."""
    assert mismatch_warning({"rollout/logprob_error": float("nan"), "rollout/logprob_error_max": float("nan")},
                            step=2) is None
    assert mismatch_warning({"rollout/logprob_error": float("inf")}, step=2) is not None  # (a mismatch still)
