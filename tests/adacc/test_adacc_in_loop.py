"""Adacc's readings inside Megatron-LM's own loop: the JSON records, Megatron-LM's log line and
its TensorBoard scalars, the activation ruler's interval and the step watch's decisions."""
import json
import re

import pytest

from helpers.pretrain import pretrain

AUTO = ["--adacc-policy", "auto", "--adacc-memory-budget", "1GiB"]


@pytest.fixture
def one_profile(tmp_path):
    return ["--adacc-profile-repeats", "1", "--adacc-profile-db", str(tmp_path / "profiles.sqlite")]


def test_readings_join_megatron_lms_log_line_tensorboard_and_the_metrics_file(
        tmp_path, one_profile, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics, board = tmp_path / "run.jsonl", tmp_path / "tb"
    session = pretrain(*AUTO, *one_profile, "--adacc-tracking", "off", "--train-iters", "2",
                       "--log-interval", "1", "--tensorboard-dir", str(board),
                       "--metrics-file", str(metrics))
    records = session.records
    assert [json.loads(line) for line in metrics.read_text().splitlines()] == records
    assert [r["iteration"] for r in records] == [1, 2]
    out = capsys.readouterr().out
    for record in records:
        line = next(line for line in out.splitlines()
                    if f"iteration        {record['iteration']}/" in line)
        for name, key in (("adacc activation MiB", "activation_bytes"),
                          ("adacc predicted MiB", "predicted_activation_bytes")):
            shown = re.search(rf"{name}: (\S+) \|", line)
            assert shown, line
            assert float(shown.group(1)) == pytest.approx(record[key] / 2**20, rel=1e-6)
    events = EventAccumulator(str(board))
    events.Reload()
    for name, key in (("adacc activation MiB", "activation_bytes"),
                      ("adacc predicted MiB", "predicted_activation_bytes")):
        scalars = events.Scalars(name)
        assert [s.step for s in scalars] == [1, 2]
        assert [s.value for s in scalars] == pytest.approx(
            [r[key] / 2**20 for r in records], rel=1e-6)


def test_the_ruler_measures_every_interval_and_records_keep_its_last_reading(one_profile):
    records = pretrain(*AUTO, *one_profile, "--adacc-tracking", "off", "--train-iters", "5",
                       "--activation-measure-interval", "2").records
    # Megatron-LM's iterations count from 0 before a step: measured at 0, 2, 4.
    assert [r["activation_measured"] for r in records] == [True, False, True, False, True]
    assert all(r["activation_bytes"] == r["predicted_activation_bytes"] for r in records)
    # The predicted step: the profiled step plus the plan's added time, per micro-batch.
    assert len({r["predicted_step_time_s"] for r in records}) == 1
    assert records[0]["predicted_step_time_s"] > 0
    assert all(r["measured_step_time_s"] > 0 and r["plan_id"] == r["measured_plan_id"]
               for r in records)


def test_the_step_watch_decides_every_window_of_unmeasured_steps(one_profile):
    from megatron_adacc import step_watch

    records = pretrain(*AUTO, *one_profile, "--train-iters",
                       str(3 + step_watch.WARMUP + step_watch.WINDOW),
                       "--activation-measure-interval", "1000").records
    decisions = [(r["iteration"], r["step_watch"]) for r in records if "step_watch" in r]
    # Step 1 is ruled (left out of the watch); steps 2.. are timed; the first WARMUP of them
    # are left out too, then a window of them decides.
    assert decisions and decisions[0][0] == 1 + step_watch.WARMUP + step_watch.WINDOW
    for _, decision in decisions:
        assert {"plan_id", "median_step_time_s", "predicted_step_time_s",
                "retimed"} <= set(decision)
        assert decision["median_step_time_s"] > 0
