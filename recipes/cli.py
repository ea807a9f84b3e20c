"""Command-line flags from a recipe's config dataclass: one `--flag-name` per field, typed by its default."""

import argparse
import dataclasses


def flag_parser(config_class, description: str) -> argparse.ArgumentParser:
    """An argparse parser with one flag per field of `config_class` (bool fields take true/false)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field in dataclasses.fields(config_class):
        default = field.default
        kind = _bool if isinstance(default, bool) else type(default)
        parser.add_argument("--" + field.name.replace("_", "-"), type=kind, default=default)
    return parser


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
