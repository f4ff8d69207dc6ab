"""Config flags: one dataclass field per flag with its help text beside it (`arg`), and argparse types that
check a flag's range (`at_least`, `in_range`): a bad value stops a script in one line, before any model loads.
"""

import argparse
import dataclasses
import math


def arg(default, help: str, **argparse_options):
    """A config field whose help text becomes its --help line (other options go to argparse)."""
    return dataclasses.field(default=default, metadata={"help": help, **argparse_options})


def at_least(minimum: int):
    """An argparse type: an integer >= minimum, or a one-line error naming the bound."""
    def parse(text: str) -> int:
        if int(text) < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return int(text)
    return parse


def in_range(low: float, high: float, *, low_open: bool = False, high_open: bool = False):
    """An argparse type: a finite float in the interval, or a one-line error naming it."""
    name = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open or high == math.inf else ']'}"

    def parse(text: str) -> float:
        value = float(text)
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        if not (math.isfinite(value) and above and below):
            raise argparse.ArgumentTypeError(f"must be a finite number in {name}, got {text}")
        return value
    return parse


def dataclass_parser(config_class, description: str) -> argparse.ArgumentParser:
    """One --flag per dataclass field, its help from the field's metadata (extra metadata: argparse options).
    A bool field is a switch: --x sets a False default; one whose default is True gets --x/--no-x."""
    parser = argparse.ArgumentParser(description=description)
    for f in dataclasses.fields(config_class):
        flag, options = "--" + f.name.replace("_", "-"), {k: v for k, v in f.metadata.items() if k != "help"}
        help = f.metadata["help"].replace("%", "%%")  # argparse formats help strings with %
        if f.type is bool and f.default is True:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=True, help=help,
                                **options)
        elif f.type is bool:
            parser.add_argument(flag, action="store_true", help=help, **options)
        else:
            parser.add_argument(flag, **{"type": f.type, "default": f.default, **options},
                                help=f"{help} (default: {f.default})")
    return parser
