"""recipes.gpt under torchrun, with rank 1 killed by SIGKILL at a chosen point (for the fault tests).

    DIE_AT=save:20 torchrun ... -m tests.recipes.dying_rank <recipes.gpt flags>   # inside step 20's save
    DIE_AT=step:25 torchrun ... -m tests.recipes.dying_rank <recipes.gpt flags>   # inside step 25's optimizer step

`save:N`: after the checkpoint's files are written into `.global_stepN.partial`, before its manifest
and renames. `step:N`: after step N's backward, before its gradients are reduced and applied. Only
torchrun's first attempt dies: a restarted one (`--max-restarts`) runs through.
"""

import os
import signal

from optim import checkpoint
from optim.engine import Engine
from recipes import gpt


def _die_when(condition, function):
    def wrapped(*args, **kwargs):
        if condition(*args):
            os.kill(os.getpid(), signal.SIGKILL)
        return function(*args, **kwargs)

    return wrapped


def main() -> None:
    where, step = os.environ["DIE_AT"].split(":")
    step = int(step)
    if int(os.environ.get("RANK", "0")) == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        if where == "save":  # every rank records its RNG state once DCP has written its files
            engine_of = {}
            original_save = checkpoint.save

            def save(engine, *args, **kwargs):
                engine_of["engine"] = engine
                return original_save(engine, *args, **kwargs)

            checkpoint.save = save
            checkpoint._rng_state = _die_when(lambda: engine_of["engine"].global_steps == step, checkpoint._rng_state)
        elif where == "step":
            Engine._optimizer_step = _die_when(lambda engine: engine.global_steps + 1 == step, Engine._optimizer_step)
        else:
            raise SystemExit(f"DIE_AT={where}:{step}: expected save:N or step:N")
    gpt.main()


if __name__ == "__main__":
    main()
