"""A whole training step captured once as a CUDA graph and replayed: no host work per step but a copy of
the batch and one launch.

    step = GraphedStep(engine, lambda x, y: train_step(engine, x, y))
    for x, y in batches:
        loss = step(x, y)        # the loss of this step, a device tensor (overwritten by the next step)

`train_step` is the user's own micro-batch: forward, loss, `engine.backward`, `engine.step()`. The
engine's step becomes capturable (`engine.set_capturable`, `optim.capturable`); the first `warmup`
calls run eagerly on a side stream (the optimizer's states and the CPU-side caches are made there),
the next one captures the step and every call replays it on the batch copied into the graph's own
input tensors. The host work of each step (counters, schedule, report) runs after each replay.

What a graph cannot hold is refused before any step, with the reason: a device that is not CUDA,
gradient accumulation (one micro-batch per optimizer step is captured), an engine setting that reads
on the host (`optim.capturable.capture_problems`), and MoE layers whose buffers follow the routing
(packed rows, any layout under expert parallelism but the padded one with dropping, padded without
dropping); such a run stays eager.
"""

import torch

__all__ = ["GraphedStep", "graph_problems"]


def graph_problems(engine) -> list[str]:
    """Why the engine's training step cannot be captured as a CUDA graph; empty when it can."""
    from optim.capturable import capture_problems

    problems = []
    if engine.device.type != "cuda":
        problems.append(f"CUDA graphs need a CUDA device; the model is on {engine.device.type}")
        if engine.device.type == "cpu":  # the layers resolve their layouts for the CPU there
            return problems
    if engine.accumulation != 1:
        problems.append(f"a graph captures one micro-batch per optimizer step; gradient_accumulation_steps is "
                        f"{engine.accumulation} (raise the micro-batch instead)")
    problems += capture_problems(engine)
    for name, module in engine.module.named_modules():
        read = module.host_read(engine.device, engine.compute_dtype) if hasattr(module, "host_read") else None
        if read:
            problems.append(f"MoE layer {name}: {read} (capturable: expert_layout padded with dropping, or "
                            "grouped without expert parallelism)")
    return problems


class GraphedStep:
    """One training step (`step_fn(*batch)`, which ends in `engine.step()`) as a replayed CUDA graph.

    Args:
        engine: the `optim.Engine` that `step_fn` trains.
        step_fn: runs one micro-batch and returns its loss (a tensor).
        warmup: eager steps before the capture (at least 1: the optimizer's state is made in the first).
        report_every: the engine reads its TensorBoard statistics every this many steps.

    Raises:
        ValueError: naming each reason the step cannot be captured (`graph_problems`).
    """

    def __init__(self, engine, step_fn, warmup: int = 3, report_every: int = 10):
        if warmup < 1:
            raise ValueError(f"warmup must be at least 1 eager step, got {warmup}")
        problems = graph_problems(engine)
        if problems:
            raise ValueError("the training step cannot be captured as a CUDA graph: " + "; ".join(problems))
        engine.set_capturable(report_every)
        self.engine, self.step_fn, self.warmup = engine, step_fn, warmup
        self.graph, self.inputs, self.loss = None, None, None
        self.stream = torch.cuda.Stream(device=engine.device)

    def __call__(self, *batch: torch.Tensor) -> torch.Tensor:
        """Run one step on `batch` (tensors of the same shapes every call); returns its loss on the device."""
        if self.warmup > 0:
            self.warmup -= 1
            return self._on_side_stream(lambda: self.step_fn(*batch))
        if self.graph is None:
            self._capture(batch)
        for static, value in zip(self.inputs, batch):
            static.copy_(value, non_blocking=True)
        self.engine.capturable.load_rates()  # the schedule's rates, set on the host after the last step
        self.graph.replay()
        self.engine.micro_steps += 1
        self.engine.capturable.finish()
        return self.loss

    def _on_side_stream(self, run):
        """Eager steps before a capture run on a side stream, as torch's graph documentation asks."""
        self.stream.wait_stream(torch.cuda.current_stream(self.engine.device))
        with torch.cuda.stream(self.stream):
            out = run()
        torch.cuda.current_stream(self.engine.device).wait_stream(self.stream)
        return out

    def _capture(self, batch) -> None:
        device = self.engine.device
        shapes = [(tuple(t.shape), t.dtype) for t in batch]
        self.inputs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes]
        self.graph = torch.cuda.CUDAGraph()
        capturable = self.engine.capturable
        capturable.holding = True  # the host work runs after each replay, not while capturing
        micro_steps = self.engine.micro_steps
        try:
            torch.cuda.synchronize(device)
            with torch.cuda.graph(self.graph, stream=self.stream):
                self.loss = self.step_fn(*self.inputs)
        finally:
            capturable.holding = False
            self.engine.micro_steps = micro_steps  # capturing ran no step: each replay counts its own
