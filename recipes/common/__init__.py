"""What the recipes share: imported by the scripts (and the tests), never run.

    cli         command-line flags from a recipe's config dataclass, resuming a run's config, the
                engine config
    runner      running a training recipe from the command line (gpt, cifar): parse, check, start the
                processes' group, claim the checkpoint folder, train, turn bad settings into one line
    training    the console progress line, sums over all processes, checkpoint-folder claims and
                pruning, the CPU's name
    simulated   a simulated world of GPUs on this CPU (the "fake" process group, the model on meta),
                for `recipes.estimate` and the simulated GPU tests (tests/simulated)
"""
