"""Timeline spans, Chrome trace export, NaN guard and the plot command."""

import json
import math
import threading
import time

import pytest

from relayrl.telemetry import (
    NonFiniteError,
    Timeline,
    TelemetryConfig,
    Tracker,
    check_finite,
    check_updates,
    export_chrome_trace,
    read_spans,
)

# ----------------------------------------------------------------------------- timeline


def test_span_records_and_durations_sum_per_name(tmp_path):
    with Timeline(tmp_path) as tl:
        with tl.span("generate", "rollout", step=1, tokens=64):
            pass
        t = time.time()
        tl.add_span("generate", "rollout", 1, t, t + 0.25, pid=4242)  # a remote worker's own timing
        tl.add_span("update", "actor", 1, t + 0.3, t + 0.8)
        tl.add_span("update", "actor", 2, t + 1.0, t + 1.5)
        d1 = tl.durations(1)
        assert set(d1) == {"generate", "update"}
        assert d1["generate"] == pytest.approx(0.25, abs=0.05)
        assert d1["update"] == pytest.approx(0.5)
        assert tl.timing_metrics(2) == {"timing/update_s": pytest.approx(0.5)}
        assert tl.durations(99) == {}
    spans = read_spans(tmp_path)
    assert [s.name for s in spans] == ["generate", "generate", "update", "update"]
    assert spans[0].attrs == {"tokens": 64} and spans[1].pid == 4242
    assert spans[2].wall_start == pytest.approx(t + 0.3, abs=1e-3)


def test_forget_drops_a_read_step_and_every_earlier_one(tmp_path):
    with Timeline(tmp_path) as tl:
        t = time.time()
        for step in (1, 2, 3):
            tl.add_span("update", "actor", step, t, t + 0.5)
        tl.forget(2)  # step 1's is a span recorded after its step was read (a checkpoint's)
        assert tl.durations(1) == {} and tl.durations(2) == {}
        assert tl.durations(3) == {"update": pytest.approx(0.5)}  # (an off-policy step's early rollout)
    assert [s.step for s in read_spans(tmp_path)] == [1, 2, 3]  # the file keeps them


def test_span_kept_when_body_raises_and_bad_spans_refused(tmp_path):
    with Timeline(tmp_path) as tl:
        with pytest.raises(RuntimeError):
            with tl.span("reward", "reward", 3):
                raise RuntimeError("verifier crashed")
        with pytest.raises(ValueError, match="end .* is before start"):
            tl.add_span("x", "g", 1, 2.0, 1.0)
        with pytest.raises(TypeError, match="JSON"):
            tl.add_span("x", "g", 1, 1.0, 2.0, obj=object())
    (span,) = read_spans(tmp_path)
    assert span.attrs == {"error": "RuntimeError"} and span.step == 3


def test_threads_get_their_own_tracks_in_chrome_trace(tmp_path):
    with Timeline(tmp_path) as tl:
        def work(i):
            with tl.span("generate", "rollout", 1, worker=i):
                time.sleep(0.01)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        with tl.span("update", "actor", 1):
            pass
    path = export_chrome_trace(tmp_path)
    assert path == tmp_path / "trace.json"
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 3
    for e in complete:
        assert {"name", "ts", "dur", "pid", "tid", "args"} <= set(e) and e["dur"] >= 0 and e["ts"] >= 0
    names = {e["args"]["name"]: e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert set(names) == {"rollout", "actor"}
    rollout_tids = {e["tid"] for e in complete if e["pid"] == names["rollout"]}
    assert len(rollout_tids) == 2  # one track per thread
    assert min(e["ts"] for e in complete) == 0


def test_timeline_resume_drops_spans_after_checkpoint(tmp_path):
    with Timeline(tmp_path) as tl:
        for step in range(1, 5):
            tl.add_span("update", "actor", step, 10.0 + step, 10.5 + step)
    with Timeline(tmp_path, start_step=2) as tl:
        tl.add_span("update", "actor", 3, 20.0, 20.5)
    assert [s.step for s in read_spans(tmp_path)] == [1, 2, 3]
    with Timeline(tmp_path):  # a fresh run starts an empty file
        pass
    assert read_spans(tmp_path) == []


def test_export_without_spans_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="spans.jsonl"):
        export_chrome_trace(tmp_path)


# ----------------------------------------------------------------------------- NaN guard


def test_check_finite_names_step_and_metric():
    check_finite(1, {"actor/loss": 0.5, "actor/grad_norm": 2.0})
    with pytest.raises(NonFiniteError, match=r"^step 12: actor/loss is nan") as info:
        check_finite(12, {"actor/loss": float("nan"), "actor/grad_norm": float("inf"), "reward/mean": 1.0})
    err = info.value
    assert (err.step, err.key) == (12, "actor/loss") and math.isnan(err.value)
    assert [k for k, _ in err.bad] == ["actor/loss", "actor/grad_norm"]
    assert "actor/grad_norm=inf" in str(err)


def test_check_finite_restricted_keys_and_tensors():
    import torch

    metrics = {"actor/loss": torch.tensor(1.0), "debug/x": float("nan"), "actor/grad_norm": torch.tensor(float("-inf"))}
    check_finite(3, metrics, keys=["actor/loss"])  # debug/x is not checked
    with pytest.raises(NonFiniteError, match="step 3: actor/grad_norm is -inf"):
        check_finite(3, metrics, keys=["actor/loss", "actor/grad_norm"])
    with pytest.raises(KeyError, match="sft/loss"):
        check_finite(3, metrics, keys=["sft/loss"])


def test_check_updates_covers_every_trained_role_and_names_it():
    """The critic's and a reward model's loss and gradient norm are checked too (only actor/* and sft/loss
    were: a NaN critic or reward-model update went on without a word), and the message names the role."""
    nan = float("nan")
    check_updates(1, {"actor/loss": 0.5, "critic/vf_loss": 1.0, "critic/grad_norm": 2.0, "eval/loss": nan})
    with pytest.raises(NonFiniteError, match=r"^step 4: critic/vf_loss is nan \(non-finite\) in the critic's "
                                             r"update; also non-finite: critic/grad_norm=inf$") as info:
        check_updates(4, {"actor/loss": 0.5, "critic/vf_loss": nan, "critic/grad_norm": float("inf")})
    assert info.value.roles == ("critic",)
    with pytest.raises(NonFiniteError, match=r"^step 2: rm/grad_norm is nan \(non-finite\) in the reward model's "
                                             r"update$"):
        check_updates(2, {"rm/loss": 0.7, "rm/grad_norm": nan})
    with pytest.raises(NonFiniteError, match="dpo/loss is -inf") as info:
        check_updates(2, {"dpo/loss": float("-inf"), "actor/grad_norm": 1.0})
    assert info.value.updates == "the actor's update"
    with pytest.raises(NonFiniteError) as info:
        check_updates(3, {"actor/loss": nan, "critic/vf_loss": nan})
    assert info.value.updates == "the actor's and the critic's updates"
    import pickle

    again = pickle.loads(pickle.dumps(info.value))
    assert str(again) == str(info.value) and again.roles == ("actor", "critic")


# ----------------------------------------------------------------------------- plots


def _fake_run(run_dir, steps=5):
    cfg = TelemetryConfig(sinks=["jsonl"])
    with Tracker(run_dir, cfg, total_steps=steps) as tracker, Timeline(run_dir) as tl:
        t = time.time()
        for s in range(1, steps + 1):
            tl.add_span("generate", "rollout", s, t, t + 1.0)
            tl.add_span("generate", "rollout", s, t + 0.1, t + 1.2, pid=7)  # overlapping worker
            tl.add_span("update", "actor", s, t + 1.2, t + 2.0)
            tl.add_span("weight_relay", "actor", s, t + 2.0, t + 2.1)
            t += 2.1
            tracker.log(s, {
                "reward/mean": 0.1 * s, "eval/accuracy": 0.05 * s, "response/length_mean": 100.0 + s,
                "response/clip_ratio": 0.0, "actor/kl": 0.01, "actor/entropy": 1.2, "actor/clip_frac_low": 0.01,
                "actor/clip_frac_high": 0.02, "actor/grad_norm": float("nan") if s == 2 else 1.0,
                "rollout/logprob_error": 1e-3, "perf/tokens_per_s_per_device": 900.0, "custom/thing": s,
                "async/staleness": float(min(s - 1, 1)), "offpolicy/kl_k3": 1e-4,
                **tl.timing_metrics(s),
            })


@pytest.mark.slow  # draws 12 figures: ~5 s on 2 shared cores
def test_plot_run_writes_every_family_timeline_and_trace(tmp_path):
    from relayrl.telemetry.plots import plot_run

    _fake_run(tmp_path)
    written = plot_run(tmp_path)
    names = {p.name for p in written}
    assert names == {
        "reward_accuracy.png", "response_length.png", "kl.png", "entropy.png", "clip_fractions.png",
        "logprob_error.png", "throughput.png", "timings.png", "actor.png", "custom.png", "timeline.png", "trace.json",
        "off_policy.png",
    }
    for p in written:
        assert p.exists() and p.stat().st_size > 0
        if p.suffix == ".png":
            assert p.parent == tmp_path / "plots"
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_run_skips_absent_families_and_needs_metrics(tmp_path):
    from relayrl.telemetry.plots import MetricsFileError, plot_run

    with pytest.raises(MetricsFileError, match="metrics.jsonl"):
        plot_run(tmp_path)
    with Tracker(tmp_path, TelemetryConfig(sinks=["jsonl"]), total_steps=2) as t:
        t.log(1, {"sft/loss": 2.0, "actor/kl": float("nan")})  # all-NaN series is skipped
        t.log(2, {"sft/loss": 1.5, "actor/kl": float("nan")})
    out = tmp_path / "figs"
    assert [p.name for p in plot_run(tmp_path, out)] == ["sft.png"]
    assert (out / "sft.png").exists()


def test_plot_refuses_damaged_metrics_naming_the_line(tmp_path):
    from relayrl.telemetry.plots import MetricsFileError, plot_run

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "x": 1.0}\n{"step": "a", "x": 2.0}\n{"step": 3, "x": 3.0}\n')
    with pytest.raises(MetricsFileError, match=r"metrics.jsonl:2: 'step' is 'a', not an integer"):
        plot_run(tmp_path)
    metrics.write_bytes(b'\xff\xfe{"step": 1}\n')
    with pytest.raises(MetricsFileError, match="not UTF-8 text"):
        plot_run(tmp_path)
    metrics.write_text('{"step": 1, "note": "a"}\n{"step": 2, "note": "b"}\n')
    with pytest.raises(MetricsFileError, match="hold no numeric metrics"):
        plot_run(tmp_path)
