"""Where the demo's time goes: the phases of `python train.py` runs, each group of runs as min and median.

    python benchmarks/demo_phases.py before=benchmarks/demo/before-1,benchmarks/demo/before-2 \
        after=benchmarks/demo/after-1,benchmarks/demo/after-2

A run folder is train.py's `--out` (its grpo/ run) beside `wall.txt`, what `/usr/bin/time -f "%e %M"` printed
for the whole command (seconds, peak resident KB). The phases come from the run's own logs: sampling
(time_generate), scoring (time_score) and the update (time_train) of every step, the evaluations (time_eval),
and the rest of time_run (loading the model, the checkpoints, the summary and the plot); before time_run
starts, Python's imports (wall time minus time_run). docs/performance.md, "The demo", tables its output.
"""

import json
import statistics
import sys
from pathlib import Path

PHASES = ("wall", "imports", "loading, checkpoints, plot", "sampling", "scoring", "update", "evaluations")


def phases(folder: Path) -> dict[str, float]:
    """Seconds by phase of one run folder, and its peak resident memory in GB."""
    run = folder / "grpo"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()]
    total = json.loads((run / "summary.json").read_text())["time_run"]
    wall, peak_kb = map(float, (folder / "wall.txt").read_text().split())
    seconds = {"sampling": sum(s["time_generate"] for s in steps),
               "scoring": sum(s["time_score"] for s in steps), "update": sum(s["time_train"] for s in steps),
               "evaluations": sum(e["time_eval"] for e in evals)}
    rest = total - sum(seconds.values())
    return {"wall": wall, "imports": wall - total, "loading, checkpoints, plot": rest, **seconds,
            "peak GB": peak_kb * 1024 / 1e9}


def table(groups: dict[str, list[Path]]) -> str:
    """A markdown table: a row a phase, for each group its min and median over its runs."""
    measured = {name: [phases(folder) for folder in folders] for name, folders in groups.items()}
    head = "| phase | " + " | ".join(f"{name}: min | median" for name in groups) + " |"
    rows = [head, "|---|" + "---|---|" * len(groups)]
    for phase in (*PHASES, "peak GB"):
        cells = [f"{min(r[phase] for r in runs):.1f} | {statistics.median(r[phase] for r in runs):.1f}"
                 for runs in measured.values()]
        rows.append(f"| {phase} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    groups = dict(arg.split("=", 1) for arg in sys.argv[1:])
    print(table({name: [Path(f) for f in folders.split(",")] for name, folders in groups.items()}))
