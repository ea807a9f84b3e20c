"""Runnable training scripts (gpt, cifar), the dense-vs-MoE comparison and benchmarks; no other package imports these."""
