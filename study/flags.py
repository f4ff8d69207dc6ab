"""experiments.py's flags, the study's first room: the study's own (which parts, methods and seeds, each
part's scale, the plan), the methods they name (METHODS), and every train.py flag, given once and passed to
every run (`train.Args` is their one source of truth). `parse_args` parses them once, into the one Namespace
that the later rooms read. Bad values stop here in one line, before any model loads; what train.py checks
across flags (a data file, a seed's range) it checks for every run before any starts (`runs.check_flags`).
"""

import argparse
import dataclasses
import math
import sys

import train
from data.tasks import LEVELS
from infra.flags import FlagParser, add_fields, at_least, folder, in_range
from study.workers import default_jobs

# the methods as train.py runs them: what --methods and --readings choose from, and each part's arms
COMPARE = ("grpo", "avspo", "avspo-always", "aapo", "dapo")
READINGS = ("grpo", "avspo", "avspo-fixed", "avspo-k1", "avspo-wrong", "avspo-correct")
METHODS = {"grpo": ("grpo", []), "avspo": ("avspo", []),  # name: (train.py --algo, extra flags)
           # AVSPO's readings: each changes one choice that is ours or unverified (advantage.py's docstring)
           "avspo-always": ("avspo", ["--acr-threshold", "0", "--fixed-threshold"]),  # no trigger
           "avspo-fixed": ("avspo", ["--fixed-threshold"]),  # the paper's ablation: a fixed threshold, 0.5
           "avspo-k1": ("avspo", ["--num-virtual", "1"]),  # "a few" virtual rewards: K = 1, |A| = 1/3
           "avspo-wrong": ("avspo", ["--virtual-ends", "all-wrong"]),  # the paper's ablation of the two ends
           "avspo-correct": ("avspo", ["--virtual-ends", "all-correct"]),
           "aapo": ("aapo", []), "dapo": ("dapo", []),
           # the lora part's arms, each at the learning rate its sweep chose (infra/lora.py's alpha, layers)
           "full-ft": ("grpo", ["--lora-rank", "0"]),
           "lora-r1": ("grpo", ["--lora-rank", "1", "--lora-alpha", "32"]),
           "lora-r32": ("grpo", ["--lora-rank", "32", "--lora-alpha", "32"])}
BASELINE = "grpo"
LORA = ("full-ft", "lora-r1", "lora-r32")  # the first is the lora part's baseline
# also compared paired with these: does AVSPO's trigger help, and which end of collapse costs accuracy?
ABLATIONS = {"avspo": ("avspo-always", "avspo-fixed"), "avspo-wrong": ("avspo-correct",)}
PRECISIONS = ("bf16", "fp32")  # the precision part's arms
# "matches": Δ within 2.5 points, the smallest gain a claim in the README's table calls an effect (AAPO's)
MARGIN = 0.025
PER_RUN = ("algo", "seed", "out", "resume", "overwrite")  # the train.py flags the study sets run by run
# where the comparison runs (compare, readings, lora) differ from `python train.py`, unless a flag says
# otherwise; --save-every follows --eval-every
# The comparisons' scale (docs/results.md's runs), apart from the demo's defaults (`python train.py`)
STUDY_DEFAULTS = {"dataset": "arith-mix", "prompts_per_step": 8, "eval_size": 112, "steps": 40,
                  "max_new_tokens": 64}
DESCRIPTION = "The methods side by side, on your model and data, with error bars (experiments.py's docstring)"
COUNT, SECONDS = at_least(1), in_range(0, math.inf, low_open=True)
PARTS = ("difficulty", "compare", "readings", "scatter", "precision", "lora")
CHOICES = {"only": PARTS, "methods": METHODS, "readings": METHODS, "scatter_levels": LEVELS}  # comma lists
INTEGERS = {"seeds": 0, "scatter_seeds": 0, "precision_seeds": 0, "scatter_g": 2}  # comma lists: the least
RATES = ("full_lrs", "lora_lrs")  # comma lists of positive numbers
QUICK = ["--out", "runs/quick", "--model", "tiny-qwen2", "--seeds", "0,1", "--steps", "2",
         "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "8", "--eval-size", "4",
         "--eval-every", "1", "--per-level", "2", "--scatter-prompts", "2",
         "--scatter-levels", "add1,mul1", "--scatter-g", "2,4", "--scatter-seeds", "0", "--scatter-steps",
         "2", "--scatter-eval-size", "4", "--difficulty-prompts", "4", "--precision-seeds", "0,1",
         "--precision-steps", "2", "--full-lrs", "1e-5,2e-5", "--lora-lrs", "1e-4,2e-4", "--jobs", "1"]


def make_parser() -> FlagParser:
    """The study's flags, then train.py's."""
    p = FlagParser(description=DESCRIPTION, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                   allow_abbrev=False)  # --seed is not --seeds: the study sets each run's seed
    p.add_argument("--out", type=folder, default="runs/experiments",
                   help="the runs; git keeps their logs, not their checkpoints (.gitignore)")
    p.add_argument("--only", default="difficulty,compare,readings,scatter", help="parts to run, comma list")
    p.add_argument("--figures", type=folder, default=None,
                   help="where results.json and the PNGs go (default: <out>/figures); `--figures docs` "
                   "rewrites the committed ones")
    p.add_argument("--quick", action="store_true", help="tiny model, tiny sizes: checks the whole pipeline")
    p.add_argument("--methods", default=",".join(COMPARE),
                   help=f"compare: comma list of {', '.join(METHODS)}")
    p.add_argument("--readings", default=",".join(READINGS), help="readings: comma list, as --methods")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--per-level", type=at_least(0), default=0,
                   help="compare: final per-problem eval on the first N problems of each level (0: all)")
    p.add_argument("--scatter-levels", default="add1,mul1,add2,mul2,mul3")
    p.add_argument("--scatter-g", default="2,4,8", help="group sizes of the scatter grid")
    p.add_argument("--scatter-seeds", default="0,1,2")
    p.add_argument("--scatter-steps", type=COUNT, default=15,
                   help="scatter: steps per run (early ACR: the first 3)")
    p.add_argument("--scatter-prompts", type=COUNT, default=4,
                   help="scatter: B (3 steps of 4 groups: 13 ACR values)")
    p.add_argument("--scatter-eval-size", type=COUNT, default=32, help="scatter: held-out problems per run")
    p.add_argument("--difficulty-prompts", type=COUNT, default=32)
    p.add_argument("--precision-seeds", default="0,1,2,3", help="precision: seeds, each run in bf16 and fp32")
    p.add_argument("--precision-steps", type=COUNT, default=STUDY_DEFAULTS["steps"],
                   help="precision: steps per run")
    p.add_argument("--full-lrs", default="1e-5,2e-5,4e-5", help="lora: full fine-tuning's learning rates")
    p.add_argument("--lora-lrs", default="1e-4,2e-4,4e-4,8e-4,1.6e-3",
                   help="lora: LoRA's learning rates (each rank)")
    p.add_argument("--sweep-seed", type=at_least(0), default=100,
                   help="lora: the seed of the learning-rate sweep (not one of --seeds)")
    p.add_argument("--jobs", type=COUNT, default=None,
                   help="training runs at once (default: one a GPU with CUDA, else 2, each on cores/jobs "
                   "threads)")
    p.add_argument("--dry-run", action="store_true",
                   help="calibrate (one step and two evaluations), print the plan, train nothing else")
    p.add_argument("--print-commands", action="store_true",
                   help="print each run's train.py command, one a line (for a SLURM array, xargs -P), and "
                   "run nothing; the same study without it then gathers the finished runs")
    p.add_argument("--budget-minutes", type=SECONDS, default=None,
                   help="fit the comparison runs' seeds, steps and --eval-size, those not given, to it "
                   "(plan.fit_budget)")
    p.add_argument("--margin", type=in_range(0, 1, low_open=True), default=MARGIN,
                   help="the plan: the seeds that would decide a difference of this size (0.025: 2.5 points)")
    defaults = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in STUDY_DEFAULTS.items())
    add_fields(p.add_argument_group(
        "train.py's flags", f"Each one given passes to every run; the study sets {', '.join(PER_RUN)} run by "
        f"run, and a part's own settings win (scatter's levels and G, precision's --precision). The "
        f"comparison runs take {defaults}, --save-every = --eval-every, else train.py's defaults."),
        train.Args, skip=PER_RUN, given_only=True)
    return p


def list_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with a comma-list flag, in one line naming it; None when they are all right."""
    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    for name, choices in CHOICES.items():
        if unknown := [x for x in getattr(args, name).split(",") if x not in choices]:
            return f"{flag(name)}: unknown {', '.join(unknown)}; choose from {', '.join(choices)}"
    for name, least in INTEGERS.items():
        items = getattr(args, name).split(",")
        if not all(x.strip().lstrip("-").isdigit() and int(x) >= least for x in items):
            return f"{flag(name)} {getattr(args, name)}: need a comma list of integers >= {least}"
    for name in RATES:
        try:
            positive = all(0 < float(x) < math.inf for x in getattr(args, name).split(","))
        except ValueError:
            positive = False
        if not positive:
            return f"{flag(name)} {getattr(args, name)}: need a comma list of positive numbers"
    for name in [*CHOICES, *INTEGERS, *RATES]:  # a seed twice would count one run twice in the bootstrap
        items = [int(x) if name in INTEGERS else float(x) if name in RATES else x
                 for x in getattr(args, name).split(",")]
        if twice := sorted({str(x) for x in items if items.count(x) > 1}):
            return f"{flag(name)} {getattr(args, name)}: {', '.join(twice)} given twice"
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The study's flags; `given`, the train.py flags given; `train`, the comparison runs' train.py settings
    (train.py's defaults, then STUDY_DEFAULTS, then the flags given); `seeds_given`, whether --seeds was
    (--budget-minutes keeps them). With --quick, every part at a tiny scale unless a flag given says
    otherwise."""
    p = make_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.quick:  # every part, every figure, in about a minute: tiny random model, 2 steps, a few problems;
        # its own folder, or its tiny runs would stand in for the real ones (finished runs are skipped)
        args = p.parse_args([*QUICK, *argv])  # flags given still win
    if problem := list_problem(args):
        p.error(problem)
    if args.print_commands and args.budget_minutes is not None:  # a scheduler's machines are not this one
        p.error("--budget-minutes plans this machine's time, --print-commands hands the runs to a scheduler: "
                "choose one")
    if args.sweep_seed in [int(s) for s in args.seeds.split(",")]:  # the rate would be fitted to the test
        p.error(f"--sweep-seed {args.sweep_seed} is one of --seeds {args.seeds}: choose another")
    typed = [*QUICK, *argv] if args.quick else argv
    args.seeds_given = any(a == "--seeds" or a.startswith("--seeds=") for a in typed)
    args.given = {f.name: vars(args).pop(f.name) for f in dataclasses.fields(train.Args)
                  if f.name in vars(args) and f.name not in PER_RUN}
    save_every = args.given.get("eval_every", train.Args.eval_every)
    args.train = train.Args(**{**STUDY_DEFAULTS, "save_every": save_every, **args.given})
    args.jobs = args.jobs or default_jobs(args.train.device)
    return args


def as_flags(config: train.Args) -> list[str]:
    """train.py's flags that make `config`: each field but PER_RUN's that differs from train.py's default, as
    --name=value (a value may start with '-')."""
    flags = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in PER_RUN or value == f.default:
            continue
        name = f.name.replace("_", "-")
        if f.type is bool:
            flags.append(f"--{name}" if value else f"--no-{name}")
        else:
            flags.append(f"--{name}={','.join(map(str, value)) if isinstance(value, tuple) else value}")
    return flags


def part_flags(args: argparse.Namespace, **own) -> list[str]:
    """train.py's flags for a run of scatter or precision: train.py's defaults, then the flags given, then the
    part's `own` settings."""
    return as_flags(dataclasses.replace(train.Args(**args.given), **own))


def lr_grid(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each arm of the lora part: the learning rates its sweep tries."""
    return {arm: lr_list(args.full_lrs if arm == LORA[0] else args.lora_lrs) for arm in LORA}


def lr_list(text: str) -> list[str]:
    """A comma list of learning rates, each written as train.py's config.json records it (2e-05)."""
    return [f"{float(x):g}" for x in text.split(",")]


def study_title(config: train.Args) -> str:
    """The comparison runs in a few words, for figures and the report."""
    return f"{config.model} on {config.dataset}, B={config.prompts_per_step}, G={config.group_size}"
