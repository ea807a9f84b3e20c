"""The recipes' progress line: its ETA follows the recent steps' pace, and shows none during warm-up."""

import re

import pytest

from recipes import training


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


AVX512_EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 avx512f avx512dq avx512_bf16 avx512_vnni

processor\t: 1
model name\t: another name the first processor's block must win over
"""


@pytest.mark.parametrize("flags, features", [
    ("avx avx2 avx512f avx512_bf16", "AVX2, AVX-512, AVX512-BF16, no AMX"),
    ("avx avx2", "AVX2, no AVX-512, no AMX"),
    ("avx2 avx512f avx512_bf16 amx_tile amx_bf16 amx_int8", "AVX2, AVX-512, AVX512-BF16, AMX"),
    ("sse2", "no AVX-512, no AMX"),
])
def test_the_cpu_name_says_family_model_and_vector_extensions(tmp_path, flags, features):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(re.sub(r"flags\t\t: .*", f"flags\\t\\t: {flags}", AVX512_EPYC))
    assert training.cpu_name(str(cpuinfo)) == f"AMD EPYC (family 25 model 17; {features})"


def test_without_cpu_flags_the_cpu_name_is_the_model_name_alone(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Some CPU\n")
    assert training.cpu_name(str(cpuinfo)) == "Some CPU"
    assert training.cpu_name(str(tmp_path / "missing")) == training.gemm.cpu_model()
