"""Which runs a study trains, part by part, from the flags parsed once (`flags.parse_args`): compare's and
readings' methods on --seeds (`runs.method_runs`), scatter's grid of levels x G x seeds, precision's pairs,
and lora's sweep and arms (`planned_runs`: all of those asked for). Each is a `runs.Run`; how long they take
is the plan's (plan.py).
"""

import argparse
from pathlib import Path

from study.flags import PRECISIONS, as_flags, lr_grid, part_flags
from study.runs import Run, method_runs


def scatter_runs(args: argparse.Namespace, out: Path) -> dict[tuple[str, int, int], Run]:
    """The scatter's short GRPO runs over levels x G x seeds, the largest G first: (level, G, seed) -> its
    run."""
    own = dict(steps=args.scatter_steps, prompts_per_step=args.scatter_prompts, eval_every=args.scatter_steps,
               eval_size=args.scatter_eval_size, save_every=0)
    seeds = [int(s) for s in args.scatter_seeds.split(",")]
    return {(level, g, seed): (out / f"{level}-g{g}-seed{seed}", seed, "grpo",
                               part_flags(args, **own, dataset=f"arith-{level}", group_size=g))
            for g in sorted([int(g) for g in args.scatter_g.split(",")], reverse=True)
            for level in args.scatter_levels.split(",") for seed in seeds}


def precision_runs(args: argparse.Namespace, out: Path) -> dict[tuple[str, int], Run]:
    """The default run (`python train.py`) in each precision on each seed: (precision, seed) -> its run; fp32,
    the slower, first: balances the jobs."""

    return {(name, seed): (out / f"seed{seed}-{name}", seed, "grpo",  # else the default run's own settings
                           part_flags(args, steps=args.precision_steps, save_every=0, precision=name))
            for name in reversed(PRECISIONS) for seed in [int(s) for s in args.precision_seeds.split(",")]}


def sweep_runs(args: argparse.Namespace, folder: Path) -> dict[tuple[str, str], Run]:
    """The lora part's sweep on --sweep-seed: (arm, lr) -> its run
    (<folder>/sweep/lr2e-05/seed100-full-ft/grpo, say)."""
    flags, seed = as_flags(args.train), args.sweep_seed
    sweep = {(arm, lr): method_runs(folder / "sweep" / f"lr{lr}", [arm], [seed], flags + ["--lr", lr])
             for arm, lrs in lr_grid(args).items() for lr in lrs}
    return {(arm, lr): runs[arm, seed] for (arm, lr), runs in sweep.items()}


def planned_runs(args: argparse.Namespace, parts: list[str], every_rate: bool = True) -> list[Run]:
    """Every training run of the parts asked for; the lora part's arms at every rate of their grids (its
    sweep picks one only later), or at the first alone (`every_rate` False: as many runs as will train)."""
    out, seeds, flags = Path(args.out), [int(s) for s in args.seeds.split(",")], as_flags(args.train)
    runs = []
    for part, methods in (("compare", args.methods), ("readings", args.readings)):
        if part in parts:
            runs += method_runs(out / part, methods.split(","), seeds, flags).values()
    if "scatter" in parts:
        runs += scatter_runs(args, out / "scatter").values()
    if "precision" in parts:
        runs += precision_runs(args, out / "precision").values()
    if "lora" in parts:
        runs += sweep_runs(args, out / "lora").values()
        runs += [run for arm, lrs in lr_grid(args).items() for lr in (lrs if every_rate else lrs[:1])
                 for run in method_runs(out / "lora", [arm], seeds, flags, {arm: ["--lr", lr]}).values()]
    return runs
