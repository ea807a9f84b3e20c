"""The recipes' progress line: its ETA follows the recent steps' pace, and shows none during warm-up."""

import re

import pytest

from recipes.common import training


class _Clock:
    """A perf_counter that the test moves forward."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


def _etas(out: str) -> dict[int, str]:
    return {int(step): eta for step, eta in re.findall(r"^step (\d+)/\d+ .* ETA (\S+)$", out, re.MULTILINE)}


def _seconds(text: str) -> int:
    minutes, seconds = re.fullmatch(r"(\d+)m(\d+)s", text).groups()
    return int(minutes) * 60 + int(seconds)


def test_eta_follows_the_recent_steps_after_a_warm_up(monkeypatch, capsys):
    clock = _Clock()
    monkeypatch.setattr(training, "time", clock)
    progress = training.Progress(total_steps=200, first_step=0, tokens_per_step=100)
    for step in range(1, 201):
        clock.now += 3.0 if step <= 20 else 0.5  # slow first steps (compilation, measured products), then fast
        if step % 10 == 0:
            progress.line(step, progress.rate(step), loss=1.0)
    etas = _etas(capsys.readouterr().out)
    assert sorted(etas) == list(range(10, 201, 10))
    assert etas[10] == "--"  # the first report comes in the warm-up: no pace to go on yet
    assert all(eta != "--" for step, eta in etas.items() if step >= 20)
    for step in range(100, 201, 10):  # the slow start has left the window: 0.5 s for each step left
        assert _seconds(etas[step]) == pytest.approx(0.5 * (200 - step), abs=1), (step, etas[step])


def test_no_eta_in_the_warm_up_steps_after_a_resume(monkeypatch, capsys):
    clock = _Clock()
    monkeypatch.setattr(training, "time", clock)
    progress = training.Progress(total_steps=1000, first_step=900, tokens_per_step=1)
    for step in range(901, 1001):
        clock.now += 2.0
        progress.line(step, progress.rate(step))
    etas = _etas(capsys.readouterr().out)
    warm_up = range(901, 901 + training.Progress.WARMUP_STEPS)
    assert len(warm_up) >= 5 and all(etas[step] == "--" for step in warm_up)
    assert _seconds(etas[950]) == pytest.approx(2.0 * 50, abs=1) and etas[1000] == "0m00s"

