"""Tests of recipes.bench: each benchmark runs at a tiny size, and what it prints is what it measured."""


def floats(*groups: str) -> list[float]:
    """Printed figures as numbers (thousands separators dropped)."""
    return [float(g.replace(",", "")) for g in groups]
