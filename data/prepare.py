"""Fetch public GSM8K and MATH files once, as JSONL that `--dataset` reads, into data/downloads/.

They are written in the forms data/tasks.py lists; git ignores the folder. Training then runs offline:

    python data/prepare.py               # everything, about 20 MB
    python data/prepare.py math          # MATH: 12,000 training problems and MATH-500, the held-out 500

Sources, both MIT-licensed: GSM8K (Cobbe et al., arXiv 2110.14168) from openai/grade-school-math; MATH
(Hendrycks et al., arXiv 2103.03874) as split in openai/prm800k (Lightman et al., arXiv 2305.20050), whose
test split is MATH-500 and whose training split holds the other 12,000 problems, so the two never share one.
A file already there is kept (delete it to fetch it again). Every file is written through infra/written.py: a
file in --out that prepare.py did not write (a user's, a symlink) is left as it is, and stops it in one line.
"""

import json
import sys
import urllib.request
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `python data/prepare.py` puts data/, not the repository, on the path

from data.tasks import read_jsonl  # noqa: E402
from infra.flags import FlagParser, folder  # noqa: E402
from infra.written import Folder, NotWritten, owned  # noqa: E402

DOWNLOADS = ROOT / "data" / "downloads"
GSM8K = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/"
PRM800K = "https://media.githubusercontent.com/media/openai/prm800k/main/prm800k/math_splits/"  # git LFS


def json_objects(path: Path) -> list[dict]:
    """Every line a JSON object (a file that is no dataset, for benchmarks/verifier_bench.py)."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows or not all(isinstance(row, dict) for row in rows):
        raise ValueError(f"{path}: expected JSON objects, one a line")
    return rows


# name: {file written: (its URL, the check that it is what we asked for)}
SOURCES: dict[str, dict[str, tuple[str, Callable[[Path], list]]]] = {
    "gsm8k": {"gsm8k_train.jsonl": (GSM8K + "train.jsonl", read_jsonl),
              "gsm8k_test.jsonl": (GSM8K + "test.jsonl", read_jsonl)},
    "math": {"math_train.jsonl": (PRM800K + "train.jsonl", read_jsonl),
             "math500_test.jsonl": (PRM800K + "test.jsonl", read_jsonl)},
    # four models' solutions to GSM8K's test problems, each labelled right or wrong: verifier_bench.py's check
    "gsm8k-solutions": {"gsm8k_model_solutions.jsonl": (GSM8K + "example_model_solutions.jsonl",
                                                        json_objects)},
}


def fetch(url: str, out: Folder, file: str, check: Callable[[Path], list]) -> int:
    """`url` into `out`/`file`; the number of rows. Through <file>.part, which must pass `check` (a problem
    file must load as `--dataset` loads it; an HTML page or a git LFS pointer does not): a failed or
    interrupted download leaves nothing behind that looks fetched."""
    part = f"{file}.part"
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            out.write(part, response.read())
        rows = len(check(out.path / part))
    except (OSError, ValueError) as e:  # urllib's errors are OSErrors
        out.remove(part)
        raise SystemExit(f"prepare: {url} gave no {file}: {e}") from None
    out.rename(part, file)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"what to fetch: {', '.join(SOURCES)} (default: all)")
    parser.add_argument("--out", type=folder, default=str(DOWNLOADS), help="folder to write to")
    args = parser.parse_args(argv)
    if unknown := [name for name in args.names if name not in SOURCES]:  # argparse's choices refuse nargs="*"
        parser.error(f"unknown {', '.join(unknown)}; choose from {', '.join(SOURCES)}")
    try:
        with owned(Path(args.out), "downloads") as out:
            out.remove_temporaries()  # what a write stopped part-way left
            for name in args.names or SOURCES:
                for file, (url, check) in SOURCES[name].items():
                    out.now(f"{file}.part")  # a file that prepare.py did not write, here or at its .part:
                    if out.now(file):  # NotWritten, and left as it is
                        print(f"{out.path / file}: already there, kept")
                        continue
                    print(f"{out.path / file}: {fetch(url, out, file, check):,} rows from {url}")
    except NotWritten as e:  # a read-only place, a file of someone else's
        sys.exit(f"prepare: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
