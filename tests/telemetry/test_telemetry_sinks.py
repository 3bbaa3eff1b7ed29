"""Tracker and its sinks: config validation, JSONL, console, TensorBoard, W&B."""

import importlib.util
import io
import json
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from relayrl.telemetry import TelemetryConfig, Tracker, read_jsonl_records
from relayrl.telemetry.sinks import MetricsFileError

HAS_WANDB = importlib.util.find_spec("wandb") is not None


def _metrics(step: int) -> dict[str, float]:
    return {"reward/mean": 0.1 * step, "actor/loss": 1.0 / step, "actor/kl": 0.01 * step, "perf/step_time_s": 0.5}


# ----------------------------------------------------------------------------- config


def test_unknown_sink_lists_the_valid_ones():
    with pytest.raises(ValidationError) as info:
        TelemetryConfig(sinks=["console", "csv"])
    msg = str(info.value)
    assert "sinks" in msg and "'csv'" in msg
    for name in ("console", "jsonl", "tensorboard", "wandb"):
        assert name in msg


def test_config_dedupes_and_forbids_unknown_keys():
    assert TelemetryConfig(sinks=["jsonl", "jsonl", "console"]).sinks == ["jsonl", "console"]
    with pytest.raises(ValidationError, match="console_table_evry"):
        TelemetryConfig(console_table_evry=5)
    with pytest.raises(ValidationError, match="console_table_every"):
        TelemetryConfig(console_table_every=-1)


@pytest.mark.skipif(HAS_WANDB, reason="wandb is installed; the missing-package error cannot happen")
def test_wandb_sink_without_wandb_fails_at_config_time():
    with pytest.raises(ValidationError, match=r"pip install wandb.*remove 'wandb' from telemetry.sinks"):
        TelemetryConfig(sinks=["console", "wandb"])
    # disabled mode needs no package and creates no sink
    cfg = TelemetryConfig(sinks=["wandb"], wandb_mode="disabled")
    assert cfg.sinks == ["wandb"]


# ----------------------------------------------------------------------------- jsonl


def test_jsonl_one_object_per_step_step_first_flushed(tmp_path):
    cfg = TelemetryConfig(sinks=["jsonl"])
    with Tracker(tmp_path, cfg, total_steps=3) as tracker:
        tracker.log(1, _metrics(1))
        # flushed per line: readable before close
        first = (tmp_path / "metrics.jsonl").read_text().splitlines()
        assert len(first) == 1
        tracker.log(2, {**_metrics(2), "actor/grad_norm": float("nan"), "dapo/dropped_groups": 3})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    assert list(json.loads(lines[0]))[0] == "step"
    rec = json.loads(lines[1])
    assert rec["step"] == 2 and rec["actor/grad_norm"] is None and rec["dapo/dropped_groups"] == 3
    assert rec["reward/mean"] == pytest.approx(0.2)


def test_tracker_rejects_bad_metrics_and_backward_steps(tmp_path):
    import numpy as np
    import torch

    with Tracker(tmp_path, TelemetryConfig(sinks=["jsonl"]), total_steps=5) as tracker:
        tracker.log(2, {"a/np": np.float32(1.5), "a/t": torch.tensor(2.0), "a/flag": True})
        with pytest.raises(TypeError, match="metric 'a/s'"):
            tracker.log(3, {"a/s": "x"})
        with pytest.raises(TypeError, match="metric 'a/vec' is not a scalar"):
            tracker.log(3, {"a/vec": torch.ones(2)})
        with pytest.raises(ValueError, match="step 1 is before the last logged step 2"):
            tracker.log(1, {"a/b": 1.0})
        with pytest.raises(ValueError, match="'step'"):
            tracker.log(3, {"step": 1})
    rec = read_jsonl_records(tmp_path / "metrics.jsonl")
    assert rec == [{"step": 2, "a/np": 1.5, "a/t": 2.0, "a/flag": 1}]


def test_resumed_jsonl_equals_uninterrupted(tmp_path):
    cfg = TelemetryConfig(sinks=["jsonl"])
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    with Tracker(straight, cfg, total_steps=6) as t:
        for s in range(1, 7):
            t.log(s, _metrics(s))
    # run dies after step 5, but its last checkpoint is step 3; the last line is torn
    with Tracker(crashed, cfg, total_steps=6) as t:
        for s in range(1, 6):
            t.log(s, _metrics(s))
    with open(crashed / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "reward/me')
    with Tracker(crashed, cfg, total_steps=6, start_step=3) as t:
        for s in range(4, 7):
            t.log(s, _metrics(s))
    assert (crashed / "metrics.jsonl").read_text() == (straight / "metrics.jsonl").read_text()


def test_fresh_run_truncates_old_metrics(tmp_path):
    cfg = TelemetryConfig(sinks=["jsonl"])
    with Tracker(tmp_path, cfg, total_steps=2) as t:
        t.log(1, {"x/y": 1.0})
    with Tracker(tmp_path, cfg, total_steps=2) as t:
        t.log(1, {"x/y": 2.0})
    assert read_jsonl_records(tmp_path / "metrics.jsonl") == [{"step": 1, "x/y": 2.0}]


# ----------------------------------------------------------------------------- console


def test_console_bar_shows_key_metrics_and_prints_table(tmp_path):
    stream = io.StringIO()
    cfg = TelemetryConfig(sinks=["console"], console_table_every=2)
    with Tracker(tmp_path, cfg, total_steps=4, console_stream=stream, key_metrics=("reward/mean",)) as t:
        t.log(1, _metrics(1))
        assert "reward/mean=0.1" in stream.getvalue()
        assert "── step" not in stream.getvalue()  # no table at step 1
        t.log(2, _metrics(2))
        t.write_text("a message between bars")
    out = stream.getvalue()
    assert "── step 2/4" in out
    table = out.split("── step 2/4")[1]
    assert "actor" in table and "kl=0.02" in table and "loss=0.5" in table and "reward" in table
    assert "a message between bars" in out
    assert "2/4" in out  # the bar advanced
    assert not (tmp_path / "metrics.jsonl").exists()  # console only


def test_console_writes_plain_lines_where_the_stream_is_no_terminal_and_a_bar_where_it_is(monkeypatch):
    """A log file gets whole lines: the first step, the last, and at most one every line_every_s between (a
    bar's carriage returns would pile up in it); a terminal gets the bar."""
    from relayrl.telemetry import sinks

    clock = iter(range(0, 1000, 4))  # every step 4 s later
    monkeypatch.setattr(sinks.time, "monotonic", lambda: float(next(clock)))
    stream = io.StringIO()
    sink = sinks.ConsoleSink(6, key_metrics=("reward/mean",), table_every=0, stream=stream, line_every_s=10)
    for step in range(1, 7):
        sink.log(step, {"reward/mean": step / 10})
    sink.close()
    lines = stream.getvalue().splitlines()
    assert [l.split()[1] for l in lines] == ["1/6", "4/6", "6/6"]  # t=4 s, 16 s (12 after), 24 s (the last)
    assert lines[0] == "step 1/6  reward/mean=0.1  (4 s/step)" and "\r" not in stream.getvalue()
    tty = io.StringIO()
    tty.isatty = lambda: True
    sink = sinks.ConsoleSink(2, key_metrics=("reward/mean",), table_every=0, stream=tty)
    sink.log(1, {"reward/mean": 0.5})
    sink.close()
    assert "\r" in tty.getvalue() and "1/2" in tty.getvalue() and "step 1/2  reward" not in tty.getvalue()


# ----------------------------------------------------------------------------- tensorboard


@pytest.mark.slow  # (imports tensorboard: about 1.2 s; the fast set keeps the rest of this file, `make test` runs it)
def test_tensorboard_events_readable_and_purged_on_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = TelemetryConfig(sinks=["tensorboard"])
    with Tracker(tmp_path, cfg, total_steps=5, run_config={"lr": 1e-3}) as t:
        for s in range(1, 6):
            t.log(s, {"reward/mean": 1.0, "actor/loss": float(s)})
    with Tracker(tmp_path, cfg, total_steps=5, start_step=3) as t:
        for s in range(4, 6):
            t.log(s, {"reward/mean": 2.0, "actor/loss": float(s)})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"reward/mean", "actor/loss"} <= set(acc.Tags()["scalars"])
    rewards = [(e.step, e.value) for e in acc.Scalars("reward/mean")]
    assert rewards == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 2.0)]


# ----------------------------------------------------------------------------- wandb


def _wandb_records(run_file: Path) -> list:
    """The protobuf records of an offline run's ``run-<id>.wandb`` file: a 7-byte W&B header, then LevelDB's
    log format (32 KiB blocks of records with a 7-byte header: crc32, length, type FULL=1 / FIRST=2 /
    MIDDLE=3 / LAST=4), each record a serialised ``wandb_internal_pb2.Record``."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    raw, block, pos, buf, out = run_file.read_bytes(), 32768, 7, b"", []
    assert raw[:4] == b":W&B", raw[:8]
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if n == 0 and kind == 0:
            pos += left
            continue
        buf, pos = buf + raw[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def _finished_runs(wandb_dir: Path, run_id: str, count: int) -> list[list]:
    """The records of ``count`` offline runs of ``run_id``, oldest first, once each ends in its exit record.

    ``run.finish()`` returns before the wandb-core service has always written the log out, so this polls (10 s at
    most). A resume in the same second as the run before it gets the same folder name with "-1" added.
    """
    deadline = time.monotonic() + 10.0
    while True:
        files = sorted(wandb_dir.glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"))
        try:
            runs = [_wandb_records(f) for f in files]
        except Exception:  # a record the service is still writing  # noqa: BLE001
            runs = []
        done = len(runs) == count and all(r and r[-1].WhichOneof("record_type") == "exit" for r in runs)
        if done or time.monotonic() > deadline:
            last = [r and r[-1].WhichOneof("record_type") for r in runs]
            assert done, f"{len(files)} run files of {count}, their last records: {last}"
            return runs
        time.sleep(0.1)


def _history(rec) -> dict:
    """A history record's metrics (wandb writes a key as ``key`` or, split at slashes, ``nested_key``)."""
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}


@pytest.mark.slow  # starts the wandb-core service
@pytest.mark.skipif(not HAS_WANDB, reason="wandb not installed (pip install -e '.[test]' installs it)")
def test_wandb_offline_writes_a_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = TelemetryConfig(sinks=["wandb"], wandb_mode="offline", wandb_project="relayrl-test", samples_per_step=2)
    run_config = {"workflow": "grpo", "algorithm": {"kl_coef": 0.05, "kl_target": 0.02}}
    with Tracker(tmp_path, cfg, total_steps=2, run_config=run_config) as t:
        t.log_samples(1, [{"prompt": "1+1=", "response": "2", "score": 1.0}, {"prompt": "2+2=", "response": "5",
                                                                             "score": 0.0}])
        t.log(1, {"reward/mean": 0.5, "actor/kl_coef": 0.05})
        t.log(2, {"reward/mean": 0.75, "actor/kl_coef": 0.04})
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    (recs,) = _finished_runs(tmp_path / "wandb", run_id, 1)
    (run,) = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
    assert run.run_id == run_id and run.project == "relayrl-test"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["workflow"] == "grpo" and config["algorithm"] == {"kl_coef": 0.05, "kl_target": 0.02}
    history = [_history(r) for r in recs if r.WhichOneof("record_type") == "history"]
    assert [(h.get("_step"), h.get("reward/mean"), h.get("actor/kl_coef")) for h in history] == [(1, 0.5, 0.05), (2, 0.75, 0.04)], history
    h = history[0]  # the step's samples as a W&B table, in step 1's record (its fields split at the slash)
    assert (h["samples/_type"], h["samples/nrows"], h["samples/ncols"]) == ("table-file", 2, 4), h
    assert [json.loads(x)["step"] for x in (tmp_path / "samples.jsonl").read_text().splitlines()] == [1, 1]
    with Tracker(tmp_path, cfg, total_steps=3, start_step=2) as t:  # a resume continues the same run id
        t.log(3, {"reward/mean": 0.7})
    assert (tmp_path / "wandb_run_id").read_text().strip() == run_id
    runs = _finished_runs(tmp_path / "wandb", run_id, 2)
    resumed = [_history(r) for recs in runs for r in recs if r.WhichOneof("record_type") == "history"]
    assert {h.get("_step"): h.get("reward/mean") for h in resumed}[3] == 0.7, resumed


def test_sample_sink_writes_records_and_a_resume_drops_the_crashed_runs_tail(tmp_path):
    import json

    from relayrl.telemetry.sinks import SampleSink

    path = tmp_path / "samples.jsonl"
    sink = SampleSink(path)
    for step in (1, 2, 3):
        sink.write(step, [{"prompt": "1+1=", "response": "2", "score": 1.0, "reward": float("nan")}])
    sink.close()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["reward"] is None and rows[0]["response"] == "2"
    resumed = SampleSink(path, start_step=2)  # the checkpoint was step 2: step 3's lines go
    resumed.write(3, [{"prompt": "p", "response": "r"}])
    resumed.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]
    assert json.loads(path.read_text().splitlines()[-1])["prompt"] == "p"


def test_a_resume_drops_a_last_line_cut_inside_a_character(tmp_path):
    """samples.jsonl keeps responses as UTF-8 (ensure_ascii=False): a run killed (or out of disk) between two
    chunks of a step's write can leave its last line cut inside a character, which refused the resume ('not
    UTF-8 text ... the file is damaged')."""
    from relayrl.telemetry.sinks import SampleSink

    path = tmp_path / "samples.jsonl"
    sink = SampleSink(path)
    for step in (1, 2):
        sink.write(step, [{"prompt": "1+1=", "response": "二"}])
    sink.close()
    line = '{"step": 3, "prompt": "1+1=", "response": "二"}\n'.encode()
    path.write_bytes(path.read_bytes() + line[: line.index("二".encode()) + 1])
    skipped: list[str] = []
    assert [r["step"] for r in read_jsonl_records(path, skipped)] == [1, 2]
    assert skipped == [f"{path}:3: skipped the last line, which is cut inside a character; the run was probably "
                       f"killed while writing it"]
    SampleSink(path, start_step=2).close()
    assert [json.loads(x) for x in path.read_text().splitlines()] == [
        {"step": 1, "prompt": "1+1=", "response": "二"}, {"step": 2, "prompt": "1+1=", "response": "二"}]
    path.write_bytes(b'{"step": 1}\n\xff{"step": 2}\n{"step": 3}\n')  # not at the end: damage, named
    with pytest.raises(MetricsFileError, match=r"samples.jsonl: not UTF-8 text \(byte 12: invalid start byte\); "
                                               r"the file is damaged or is not a samples.jsonl"):
        read_jsonl_records(path)


@pytest.mark.slow  # starts the wandb-core service
@pytest.mark.skipif(not HAS_WANDB, reason="wandb not installed (pip install -e '.[test]' installs it)")
def test_wandb_offline_history_is_the_jsonl_file(tmp_path, monkeypatch):
    """The W&B run's history, read back from its ``.wandb`` file, holds the values and the step axis of
    ``metrics.jsonl``, step 0 (the evaluation before training) included; NaN (``critic/explained_variance`` of
    equal returns) is NaN there and ``null`` in the file."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = TelemetryConfig(sinks=["jsonl", "wandb"], wandb_mode="offline", wandb_project="relayrl-test")
    logged = {0: {"eval/accuracy": 0.25, "eval/pass@4": 0.5},
              1: {"reward/mean": 1 / 3, "advantage/zero_frac": 0.125, "actor/forward_tokens": 1234.0,
                  "critic/explained_variance": float("nan"), "timing/update_s": 1e-7},
              2: {"reward/mean": 0.7, "actor/lr": 3e-6, "eval/accuracy": 0.5}}
    with Tracker(tmp_path, cfg, total_steps=2) as t:
        for step, m in logged.items():
            t.log(step, m)
    jsonl = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    (recs,) = _finished_runs(tmp_path / "wandb", run_id, 1)
    history = [_history(r) for r in recs if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == [r["step"] for r in jsonl] == [0, 1, 2]
    for h, r in zip(history, jsonl):
        want = {k: v for k, v in r.items() if k != "step"}
        got = {k: None if v != v else v for k, v in h.items() if not k.startswith("_")}  # (NaN: JSON's null)
        assert got == want, (r["step"], got, want)
