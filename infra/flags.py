"""Config flags: one dataclass field per flag with its help text beside it (`arg`), argparse types that check
a flag's range (`at_least`, `in_range`), text (`non_empty`, `names_from`) or place (`folder`), and every
script's parser (`FlagParser`): a bad value stops a script in one line, before any model loads.
"""

import argparse
import dataclasses
import math
from pathlib import Path


class FlagParser(argparse.ArgumentParser):
    """argparse's parser, whose error is one line naming the flag and where the flags are listed, not the
    usage block with the line at its bottom."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def arg(default, help: str, **argparse_options):
    """A config field whose help text becomes its --help line (other options go to argparse)."""
    return dataclasses.field(default=default, metadata={"help": help, **argparse_options})


def at_least(minimum: int, most: float = math.inf):
    """An argparse type: an integer >= minimum (and <= most), or a one-line error naming the bound."""
    def integer(text: str) -> int:  # argparse names it in its message: "invalid integer value: 'x'"
        if not minimum <= int(text) <= most:
            bound = f">= {minimum}" if most == math.inf else f"in [{minimum}, {most}]"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return int(text)
    return integer


def in_range(low: float, high: float, *, low_open: bool = False, high_open: bool = False):
    """An argparse type: a finite float in the interval, or a one-line error naming it."""
    name = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open or high == math.inf else ']'}"

    def number(text: str) -> float:  # argparse names it in its message: "invalid number value: 'x'"
        value = float(text)
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        if not (math.isfinite(value) and above and below):
            raise argparse.ArgumentTypeError(f"must be a finite number in {name}, got {text}")
        return value
    return number


def non_empty(text: str) -> str:
    """An argparse type: text that is not empty (an empty --model would name the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def names_from(choices: tuple[str, ...]):
    """An argparse type: a comma list of distinct names from `choices`, or a one-line error naming the
    unknown or repeated one (a name twice would run twice into one folder)."""
    def names(text: str) -> str:
        given = text.split(",")
        if unknown := set(given) - set(choices):
            raise argparse.ArgumentTypeError(f"unknown {', '.join(sorted(unknown))}; choose from "
                                             f"{', '.join(choices)}")
        if twice := sorted({name for name in given if given.count(name) > 1}):
            raise argparse.ArgumentTypeError(f"{', '.join(twice)} given twice")
        return text
    return names


def folder(text: str) -> str:
    """An argparse type: a path that is a folder, or can become one (no file in the way), else a one-line
    error naming the file. A blank name, or a blank part (`--out ' '`), is refused: a folder named by
    spaces is one no one asked for."""
    if not text.strip() or any(part and not part.strip() for part in text.split("/")):
        raise argparse.ArgumentTypeError(f"{text!r} is a blank name, not a folder")
    try:
        existing = next(p for p in [Path(text), *Path(text).parents] if p.exists())
    except OSError as e:  # a part longer than the filesystem allows (ENAMETOOLONG): Path.exists raises
        raise argparse.ArgumentTypeError(f"{e.strerror}: {text[:80]}...") from None
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{existing} is a file, not a folder")
    return text


def dataclass_parser(config_class, description: str) -> FlagParser:
    """One --flag per dataclass field (`add_fields`)."""
    parser = FlagParser(description=description)
    add_fields(parser, config_class)
    return parser


def add_fields(parser, config_class, skip: tuple[str, ...] = (), given_only: bool = False) -> None:
    """One --flag per dataclass field but `skip`, its help from the field's metadata (extra metadata: argparse
    options), on a parser or an argument group. A bool field is a switch: --x sets a False default; one whose
    default is True gets --x/--no-x. `given_only`: a flag not given leaves no attribute (experiments.py
    passes on the train.py flags given)."""
    for f in dataclasses.fields(config_class):
        if f.name in skip:
            continue
        flag, options = "--" + f.name.replace("_", "-"), {k: v for k, v in f.metadata.items() if k != "help"}
        help = f.metadata["help"].replace("%", "%%")  # argparse formats help strings with %
        default = argparse.SUPPRESS if given_only else f.default
        if f.type is bool and f.default is True:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help,
                                **options)
        elif f.type is bool:
            parser.add_argument(flag, action="store_true", default=default, help=help, **options)
        else:
            parser.add_argument(flag, **{"type": f.type, "default": default, **options},
                                help=f"{help} (default: {f.default})")
