"""Runnable training scripts and benchmarks; nothing imports this package."""
