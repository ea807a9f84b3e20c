"""Benchmarks: scripts that print what they measured (time, tokens/s, bytes), each a command.

    python -m recipes.bench.<name> --help

    moe              one MoE layer: forward+backward ms, tokens/s, peak memory, and the experts' matrix
                     products alone; DeepSpeed's layer side by side where it is importable
    engine           a full training step at each ZeRO stage, ours beside DeepSpeed's engine, and the
                     memory it takes against the ZeRO accounting (torchrun for several ranks)
    gpt              the GPT recipe's MoE model against its dense twin: training tokens/s side by side in
                     one process; --breakdown times each block, --profile runs torch.profiler
    kernels          the dispatch ops (permute, unpermute_combine): Triton kernel, torch path and
                     reference, in ms and bandwidth against a plain copy
    routing          all-to-all traffic of group-limited routing: the rows and bytes a token sends off its
                     expert-parallel rank, per topk_group
    checkpoint       memory to save and load a checkpoint, the sharded layout beside full entries (torchrun)
    step_breakdown   not a command: the per-block timers `gpt --breakdown` prints

Each takes `--record-dir DIR` to also write its figures as a JSON record (`recipes.common.records`),
which `python -m recipes.report` renders into docs/results.md.

They are scripts, not timed tests: tests run each at a tiny size and check that what it prints is what
it measured.
"""
