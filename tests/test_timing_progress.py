"""Where a stage's time goes (io/timing.py) and its progress lines (io/progress.py), on a clock the test moves:
no wall-clock durations are asserted."""
from __future__ import annotations

import json
import re
import threading

import pytest

from opd_sao.io.progress import StageProgress, duration
from opd_sao.io.timing import PHASES, PhaseTimer, StageCost, peak_memory


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_phases_accumulate_per_step_and_per_stage_and_nest_exclusively():
    clock = Clock()
    timer = PhaseTimer(clock)
    with timer.phase("sft"):  # before the loop: in the stage's totals only
        clock.advance(5)
    timer.begin_steps()
    with timer.phase("generation"):
        clock.advance(2)
    with timer.phase("gate"):
        clock.advance(1)
        with timer.phase("sync"):  # inside the gate: counted as sync, not as both
            clock.advance(3)
        clock.advance(0.5)
    clock.advance(0.25)  # outside any phase (collating a batch, logging)
    step = timer.step_phases()
    assert step == {**{f"time/{p}": 0.0 for p in PHASES}, "time/generation": 2.0, "time/gate": 1.5,
                    "time/sync": 3.0, "time/step": 6.75}
    with timer.phase("generation"):
        clock.advance(1)
    second = timer.step_phases()
    assert second["time/generation"] == 1.0 and second["time/gate"] == 0.0 and second["time/step"] == 1.0
    assert timer.stage_totals() == {"sft": 5.0, "generation": 3.0, "sync": 3.0, "gate": 1.5}  # largest first


def test_a_phase_that_raises_is_still_counted():
    clock = Clock()
    timer = PhaseTimer(clock)
    try:
        with timer.phase("checkpoint"):
            clock.advance(2)
            raise OSError("disk full")
    except OSError:
        pass
    assert timer.stage_totals() == {"checkpoint": 2.0}


def test_a_stage_resumed_in_a_second_process_adds_the_first_ones_cost(tmp_path):
    """The first process's share is on disk once a checkpoint phase ends (not only at close: a killed process never
    closes); the second adds its phases and time to it and keeps the higher peak. every_s=1e9: no save is timed."""
    path, clock = tmp_path / "costs" / "rl.json", Clock()
    first_timer = PhaseTimer(clock)
    first = StageCost(path, first_timer, every_s=1e9)
    with first_timer.phase("generation"):
        clock.advance(2)
    assert not path.exists()
    with first_timer.phase("checkpoint"):
        clock.advance(0.5)
    saved = json.loads(path.read_text())
    assert saved["phases_s"] == {"generation": 2.0, "checkpoint": 0.5} and saved["processes"] == 1
    first.close()  # its thread (a killed process's share is what the checkpoint saved: the same phases)
    saved.update(wall_s=1000.0, cpu_s=900.0, peak_rss_mb=1e9)  # as if the first process had run long and large
    path.write_text(json.dumps(saved))
    second_timer = PhaseTimer(clock)
    second = StageCost(path, second_timer, every_s=1e9)
    with second_timer.phase("generation"):
        clock.advance(3)
        assert second.totals()["phases_s"]["generation"] == 5.0  # the phase under way counts up to now
    totals = second.close()
    assert totals["phases_s"] == {"generation": 5.0, "checkpoint": 0.5} and totals["processes"] == 2
    assert totals["wall_s"] >= 1000.0 and totals["cpu_s"] >= 900.0 and totals["peak_rss_mb"] == 1e9
    assert json.loads(path.read_text()) == totals


def test_a_checkpoint_phase_that_raises_saves_no_cost_and_keeps_its_error(tmp_path):
    timer = PhaseTimer(Clock())
    cost = StageCost(tmp_path / "c.json", timer, every_s=1e9)
    with pytest.raises(OSError, match="disk full"):
        with timer.phase("checkpoint"):
            raise OSError("disk full")
    assert not (tmp_path / "c.json").exists()
    assert cost.close()["processes"] == 1


def test_peak_memory_is_the_resident_set_in_megabytes():
    peak = peak_memory()
    assert peak["peak_rss_mb"] > 10  # a Python process with torch imported holds far more than 10 MB


def test_durations_read_as_seconds_minutes_or_hours():
    assert [duration(s) for s in (0, 42.4, 185, 7620, -3)] == ["0s", "42s", "3m05s", "2h07m", "0s"]


def test_a_line_every_n_steps_and_after_the_last_with_seconds_per_step_and_eta():
    clock, lines = Clock(), []
    progress = StageProgress("rl", every=2, interval_s=1e9, out=lines.append, clock=clock)
    with progress.task("sao", total=5) as task:
        for step in range(5):
            clock.advance(3)
            task.set_postfix(reward=f"{step / 10:.3f}")
            task.update(1)
    progress.close()
    assert lines == ["[rl] sao step 2/5, reward 0.100, 3.00 s/step, ETA 9s",
                     "[rl] sao step 4/5, reward 0.300, 3.00 s/step, ETA 3s",
                     "[rl] sao step 5/5, reward 0.400, 3.00 s/step, ETA 0s"]


def test_a_resumed_task_times_only_the_steps_it_runs():
    clock, lines = Clock(), []
    progress = StageProgress("rl", every=1, interval_s=1e9, out=lines.append, clock=clock)
    with progress.task("sao", total=100) as task:
        clock.advance(1000)  # loading, before the jump to the saved step
        task.update(40)
        clock.advance(2)
        task.update(1)
    progress.close()
    assert lines == ["[rl] sao step 40/100", "[rl] sao step 41/100, 2.00 s/step, ETA 1m58s"]


def test_disabled_progress_prints_nothing_and_starts_no_thread():
    lines = []
    progress = StageProgress("rl", enabled=False, every=1, out=lines.append)
    with progress.task("sao", total=2) as task, progress.activity("evaluation"):
        task.update(1)
    progress.close()
    assert lines == [] and progress._heartbeat is None


def test_the_heartbeat_names_the_work_under_way_when_no_line_came_for_the_interval():
    """Between steps (here: during an evaluation inside the loop) a line still comes once `interval_s` passes with
    none; the test waits for it as long as it takes, it asserts no duration."""
    beats, seen = [], threading.Event()

    def out(line):
        if "evaluation" in line:  # (a beat may come before the evaluation starts, or after it, on a loaded machine)
            beats.append(line)
            seen.set()

    progress = StageProgress("opd", every=100, interval_s=0.05, out=out)
    with progress.task("opd", total=10) as task:
        task.set_postfix(reward="0.250")
        task.update(1)
        with progress.activity("evaluation"):
            assert seen.wait(120)
    progress.close()
    beat = beats[0]
    assert re.fullmatch(r"\[opd\] opd step 1/10, reward 0\.250, [0-9.]+ s/step, ETA \S+; evaluation running for \S+",
                        beat), beat
