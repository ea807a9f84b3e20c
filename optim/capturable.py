"""A training step that reads nothing on the host, so that a CUDA graph can capture and replay it.

The engine's usual step reads one device value (the overflow flag, `optim.nonfinite`) and, with
TensorBoard, the step's statistics. `engine.set_capturable()` switches it to a step split in two:

1. device work (`CapturableStep.run`), which a graph captures: reduce the gradients, unscale them by
   the loss scale kept on the device, take their norm and clip, flag inf and nan on the device
   (agreed over the ranks), step the optimizer, which skips its update where the flag is set (torch's
   fused optimizers take it as `found_inf`), write the weights back, update the loss scale and the
   routers' expert bias from the flag, and sum the step's statistics over the ranks;
2. host work (`CapturableStep.finish`), run after each replay: the step counter, the learning-rate
   schedule (its rates reach the optimizer through device tensors that `load_rates` fills before the
   next step), and the report, which reads the queued statistics every `report_every` steps.

What differs from the usual step: a skipped step (an fp16 overflow, `nonfinite: skip`) still
advances the schedule, as a plain torch loop with GradScaler does; skipped steps and the loss scale are
known on the host when the report reads them; with `nonfinite: stop`, inf or nan stops the run at that
read, naming the steps since the last one, instead of at the step itself.
"""

import torch

__all__ = ["CapturableStep", "capture_problems"]


def capture_problems(engine) -> list[str]:
    """What keeps the engine's step from running without host reads; empty when nothing does."""
    problems = []
    if engine.stage == 3 and engine.world_size > 1:
        problems.append("ZeRO stage 3 gathers and frees parameters through fully_shard, which a CUDA graph does "
                        "not capture: use stage 0, 1 or 2")
    if engine.offload:
        problems.append("offload steps the optimizer on the CPU: turn offload_optimizer off")
    if engine.optimizer.views is not None:
        problems.append(f"{type(engine.optimizer.optimizer).__name__} steps on per-parameter views")
    optimizer = engine.optimizer.optimizer
    fused = all(group.get("fused") for group in optimizer.param_groups)
    if not (getattr(optimizer, "_step_supports_amp_scaling", False) and fused):
        problems.append(f"the optimizer ({type(optimizer).__name__}, fused={fused}) must skip its update on a device "
                        "flag: torch's Adam, AdamW or SGD with fused=True")
    return problems


class CapturableStep:
    """The device work and the host work of an engine's optimizer step, apart (see the module docstring).

    Args:
        engine: an `optim.Engine` whose `capture_problems` are none.
        report_every: read and write the step statistics every this many steps.
    """

    def __init__(self, engine, report_every: int):
        self.engine = engine
        device = engine.device
        # the rates the optimizer reads: device tensors filled from the groups' own (Python) rates, in the
        # type each device's fused step reads a rate in (CUDA's kernels take fp32; the CPU's a double,
        # as it takes a Python rate)
        dtype = torch.float64 if device.type == "cpu" else torch.float32
        self.rates = [torch.zeros((), dtype=dtype, device=device) for _ in engine.optimizer.param_groups]
        engine._report.defer(report_every)
        self.report_every = report_every
        self.holding = False  # set while a graph captures the step: `finish` then runs after each replay
        self._checked_at = engine.global_steps  # the step up to which skipped steps were read
        self._skips_read = self._writes_seen = 0  # the device counters as last read
        self.found = None  # the last step's overflow flag (a device tensor; a graph's is rewritten by each replay)

    def load_rates(self) -> None:
        """Copy each group's learning rate (set by the schedule on the host) into its device tensor."""
        for rate, group in zip(self.rates, self.engine.optimizer.param_groups):
            rate.fill_(float(group["lr"]))

    def run(self) -> None:
        """The optimizer step's device work: no host read, no allocation whose size depends on the data."""
        engine = self.engine
        precision, clipping = engine.precision, engine.config.gradient_clipping > 0
        if not self.holding:  # a graph's replay is preceded by this instead (a fill is not captured as the rate)
            self.load_rates()
        grads = engine.zero.reduce(engine.module)
        proxies = precision.prepare_proxies(engine.units, grads)
        found = self.found = precision.found_nonfinite(grads) if precision.watch else None
        engine._grad_norm = None
        if clipping:
            engine._grad_norm = precision.global_norm(engine.units)
            precision.clip(proxies, engine._grad_norm, engine.config.gradient_clipping)
        self._step_optimizer(found)
        engine.zero.write_back()
        if precision.watch:
            precision.record_writes(engine.units, engine.optimizer, engine.global_steps + 1)
        precision.release_proxies(engine.units)
        engine.zero_grad()
        engine._update_routers(skipped=found if found is not None else False)
        precision.after_step(found)
        engine._report.sum_step()

    def _step_optimizer(self, found: torch.Tensor | None) -> None:
        optimizer = self.engine.optimizer
        groups = optimizer.param_groups
        rates = [group["lr"] for group in groups]
        for group, rate in zip(groups, self.rates):
            group["lr"] = rate
        if found is not None:
            optimizer.optimizer.found_inf = found
        optimizer._stepping = True
        try:
            optimizer.step()
        finally:
            optimizer._stepping = False
            for group, rate in zip(groups, rates):
                group["lr"] = rate
            if found is not None:
                del optimizer.optimizer.found_inf

    def finish(self) -> None:
        """The step's host work: count it, advance the schedule, queue the report."""
        engine = self.engine
        engine.global_steps += 1
        if engine.lr_scheduler is not None:
            engine.lr_scheduler.step()
        scaler = engine.precision.scaler
        engine._report.step_queued(engine.global_steps, engine.get_lr(),
                                   scaler.scale_tensor if scaler is not None else None)
        if engine.global_steps % self.report_every == 0:
            self.check_skips()
        if engine.rank == 0 and engine.global_steps % engine.config.steps_per_print == 0:  # reads the scale
            print(f"step={engine.global_steps} skipped={engine.skipped_steps} (as of step {self._checked_at}) "
                  f"lr={engine.get_lr()} loss_scale={engine.loss_scale}", flush=True)

    def check_skips(self) -> None:
        """Read the skip counters (a host read): count the skipped steps, and stop the run where the usual
        step would have (inf or nan with `nonfinite: stop`, or a step that wrote inf or nan).

        Raises:
            FloatingPointError: naming the steps since the last read and the last checkpoint.
        """
        engine, precision = self.engine, self.engine.precision
        if not precision.watch:
            return
        skipped, for_writes = precision.read_skips()
        new, since = skipped - self._skips_read, self._checked_at
        engine.skipped_steps += new  # (a loaded checkpoint sets the count the device's adds to)
        self._skips_read, self._checked_at = skipped, engine.global_steps
        if for_writes > self._writes_seen:
            self._writes_seen = for_writes
            what = "a step wrote inf or nan into the weights or optimizer states (is the learning rate far too large?)"
        elif new and precision.stops_on_nonfinite:
            what = f"{new} step(s) met inf or nan in the loss or gradients and were skipped (diverged? lower the learning rate)"
        else:
            return
        raise FloatingPointError(f"steps {since + 1}-{engine.global_steps}: {what}; last checkpoint: "
                                 f"{engine.last_checkpoint or 'none'}")
