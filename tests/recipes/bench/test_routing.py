"""recipes.bench.routing: flags that cannot work stop in one line."""

import pytest

from recipes.bench import routing as bench_routing


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["--k", "99"], "--k (99) must be between 1 and --experts (64)"),
    (["--ep", "3"], "--experts (64) must be divisible by --ep (3)"),
])
def test_flags_that_cannot_work_stop_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        bench_routing.main(argv)
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("recipes.bench.routing: error: "), err
    assert message in err, err
