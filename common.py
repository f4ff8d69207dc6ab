"""Plumbing for train.py, kept out of its way: config flags, processes under torchrun, a run's setup and what
follows each step (logs, checkpoints, evaluations), and the --fast choice.

Nothing here knows about GRPO, AVSPO or AAPO: a method's state reaches a checkpoint as a dict of
dataclasses, and is rebuilt with the same classes on resume.
"""

import argparse
import dataclasses
import fcntl
import itertools
import json
import math
import os
import pickle
import shutil
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from collections import Counter
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import transformers
from tqdm import tqdm

import packing
from advantage import advantage_collapse_rate, effective_collapse_rate, grpo_advantages
from data.tasks import Problem, load_eval_problems, load_problems
from decoding import FAST_ON, decode
from eval import evaluate
from memory import describe_estimate, estimate_memory
from model import (Rollout, cast_weights, completion_logprobs, describe_device, format_prompts, load_model,
                   pick_device, resolve_precision, sample_with_generate, working_copy)
from verifier import RewardError, load_reward


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


# ------------------------------------------------------------------------------ processes (torchrun)


def init_processes(device_name: str = "auto") -> tuple[int, int, torch.device]:
    """(rank, world size, device) for --device auto|cpu|cuda (`model.pick_device`): one process unless
    launched by torchrun (nccl on CUDA, gloo on CPU)."""
    device = pick_device(device_name)
    if "RANK" not in os.environ:
        return 0, 1, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def close_processes() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_sum(values: list[float], device: torch.device) -> list[float]:
    """Elementwise sum of `values` over all processes (unchanged in a single process)."""
    if not dist.is_initialized():
        return values
    total = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.tolist()


def gather_groups(local: torch.Tensor, error: RewardError | None = None) -> torch.Tensor:
    """[B/N, G] rows of each of N processes -> [B, G] in rank order (the order of the step's prompts). A
    process whose reward failed sends NaN rows and its `error`: every process then raises that error, rather
    than wait for the failed one (a checked reward is never NaN)."""
    if not dist.is_initialized():
        return local
    nccl = dist.get_backend() == "nccl"  # nccl gathers CUDA tensors only
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    parts = [torch.empty_like(local, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.to(device))
    if any(part.isnan().any() for part in parts):
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        raise next(e for e in errors if e is not None)
    return torch.cat(parts).cpu()

def sum_gradients(model) -> None:
    """Sum each parameter's gradient over processes; a parameter without one gets zeros, so that every
    process (even one that had no row to train) joins the same all-reduces and takes the same step."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if dist.is_initialized():
            dist.all_reduce(p.grad)


# ------------------------------------------------------------------------------ checkpoints and logs


class RunFolderError(Exception):
    """A file of a run folder that cannot be used (damaged, or a pickle that would run code): one line naming
    it, and nothing is written."""


STOP_SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}  # SIGTERM: schedulers, `timeout`


@contextmanager
def ctrl_c_stops_after_the_step():
    """Inside the block, a first Ctrl-C or SIGTERM only asks to stop (the yielded list gets its signal
    number): the loop ends its step, so that a checkpoint holds whole steps. The loop checks the request
    itself, so an interrupt can never be lost inside a library that swallows exceptions. A second one stops
    at once, unsaved."""
    requested: list[int] = []
    if threading.current_thread() is not threading.main_thread():  # only the main thread receives signals
        yield requested
        return

    def on_signal(signum, frame):
        if requested:
            raise KeyboardInterrupt
        requested.append(signum)
        os.write(2, f"\n{STOP_SIGNALS[signum]}: stopping at the end of the step under way "
                    "(a second one stops at once, unsaved)\n".encode())

    previous = {signum: signal.signal(signum, on_signal) for signum in STOP_SIGNALS}
    try:
        yield requested
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def exits_cleanly():
    """train.py's way out: Ctrl-C or SIGTERM ends the step under way, then exits with code 128 + the signal
    (130, 143) once it is saved (`ctrl_c_stops_after_the_step` yields the stop requests); an unknown model, a
    missing file, a damaged run folder or a bad reward exits with one line, not a traceback; the processes of
    torchrun are closed whichever way it ends."""
    requested: list[int] = []
    try:
        with ctrl_c_stops_after_the_step() as requested:
            yield requested
    except (FileNotFoundError, RunFolderError, RewardError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # the checkpoint is saved and said so (or a second signal); no traceback
        sys.exit(128 + (requested[0] if requested else signal.SIGINT))
    finally:
        close_processes()


@contextmanager
def one_owner(folder: Path):
    """The run folder has one owner: an exclusive lock on <folder>/.lock, with the owner's process id in it,
    released when the process ends however it ends (fcntl.flock). A second run into the folder stops at once
    with one line naming the folder and the owner, before it writes anything."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            sys.exit(f"error: {folder} is in use by process {lock.read().strip() or '?'} (another run): wait "
                     "for it to end, or choose another --out")
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        yield


RESUMABLE = ("resume", "overwrite", "out", "save_every", "eval_every", "micro_batch", "grad_checkpointing",
             "log_samples", "show_group")


def earlier_run(run_dir: Path, out: str) -> str | None:
    """Why a fresh run may not start in run_dir (<out>/<algo>): one line saying what to type when it holds an
    earlier run, which the fresh run's logs would replace; None when it holds none."""
    if not any((run_dir / name).exists() for name in ("config.json", "checkpoint", "checkpoint.old")):
        return None
    logged = len(read_jsonl(run_dir / "metrics.jsonl"))
    free = next(f"{Path(out)}-{n}" for n in itertools.count(2) if not Path(f"{Path(out)}-{n}").exists())
    return (f"{run_dir} holds an earlier run (steps logged: {logged}): add --resume to continue it, "
            f"--out {free} to keep it and start another, or --overwrite to replace it")


def resume_conflicts(run_dir: Path, args) -> str | None:
    """Why `args` (a train.Args) may not continue the run in run_dir, in one line naming each flag that
    differs from its config.json; None when it may. Only the flags in RESUMABLE may change: they leave the
    steps taken as they were and the steps to come as they would have been (--micro-batch and
    --grad-checkpointing change memory and speed, and the order of a sum). --steps sets the lr schedule of
    every step (`train.scheduled_lr`), so it may change only where the lr does not depend on it
    (--lr-decay 0): a longer run would otherwise follow another schedule than its first steps did."""
    if not (run_dir / "config.json").exists():
        return None
    saved = json.loads((run_dir / "config.json").read_text())
    now = json.loads(json.dumps(dataclasses.asdict(args)))  # as saved: tuples become lists
    defaults = json.loads(json.dumps({f.name: f.default for f in dataclasses.fields(args)}))
    fixed = [key for key in now if key not in RESUMABLE and not (key == "steps" and now["lr_decay"] == 0)]
    changed = [f"--{key.replace('_', '-')} {saved.get(key, defaults[key])} -> {now[key]}" for key in fixed
               if saved.get(key, defaults[key]) != now[key]]  # a flag newer than the run: as its default
    if not changed:
        return None
    return (f"--resume {run_dir}: {'; '.join(changed)}, unlike its config.json; only "
            f"{', '.join('--' + k.replace('_', '-') for k in RESUMABLE[2:])} may change on resume "
            "(and --steps with --lr-decay 0)")


def save_checkpoint(run_dir: Path, model, tokenizer, optimizer, step: int, algo_state: dict) -> None:
    """HF folder + optimizer + step + method state (a dict of dataclasses), written to a temp folder then
    renamed into place."""
    tmp, final, old = run_dir / "checkpoint.tmp", run_dir / "checkpoint", run_dir / "checkpoint.old"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    torch.save({"step": step, "optimizer": optimizer.state_dict(),
                "algo_state": {key: dataclasses.asdict(value) for key, value in algo_state.items()}},
               tmp / "state.pt")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(run_dir: Path) -> Path | None:
    for folder in (run_dir / "checkpoint", run_dir / "checkpoint.old"):  # .old: crashed between renames
        if (folder / "state.pt").exists():
            return folder
    return None


def restore_checkpoint(folder: Path, optimizer, state: dict) -> int:
    """Load optimizer and method state saved by `save_checkpoint`; returns the last completed step. Only
    tensors and plain data load (weights_only): a state.pt from someone else cannot run code here."""
    path = folder / "state.pt"
    try:
        saved = torch.load(path, weights_only=True)
    except pickle.UnpicklingError:  # torch's message is a page long
        raise RunFolderError(f"{path}: refused, it holds objects other than tensors and plain data, which "
                             "could run code (train.py never saves such a file)") from None
    except (RuntimeError, EOFError) as e:  # a truncated or overwritten file
        raise RunFolderError(f"{path} is damaged ({str(e).splitlines()[0]}): restore it, or start again "
                             "with --overwrite") from None
    optimizer.load_state_dict(saved["optimizer"])
    state.update({key: type(state[key])(**value) for key, value in saved["algo_state"].items()})
    return saved["step"]


def read_jsonl(path: Path) -> list[dict]:
    """A log's records. A torn last line (the run killed while appending it) is dropped with a warning: on
    --resume its step is redone, as the checkpoint is saved after the log. A bad line before the last
    is a RunFolderError naming file and line."""
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number < len(lines):
                raise RunFolderError(f"{path}:{number}: not a JSON record ({e.msg})") from None
            print(f"warning: {path}:{number}: a torn last line, dropped (the run stopped while writing it)",
                  file=sys.stderr)
    return records


def append_jsonl(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def write_jsonl(path: Path, records: list[dict]) -> None:
    """Written whole or not at all (a temporary file renamed into place): a run killed while a resume rewrites
    its metrics.jsonl keeps every logged step."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(path)


TOTALS = ("gen_tokens", "train_tokens")  # summed over a run's steps in metrics.jsonl, as <name>_total


def start_logs(run_dir: Path, config: dict, last_step: int) -> dict:
    """A fresh run (last_step 0): config.json and empty logs, nothing an earlier run left in run_dir
    (parse_args lets one be replaced only with --overwrite). A resumed one: drop what was logged after its
    checkpoint. Returns the TOTALS of the last record kept."""
    if last_step == 0:
        shutil.rmtree(run_dir, ignore_errors=True)  # an old checkpoint must not outlive its logs
    run_dir.mkdir(parents=True, exist_ok=True)
    if last_step == 0:
        (run_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("metrics.jsonl", "evals.jsonl", "samples.jsonl"):
        kept = [r for r in read_jsonl(run_dir / name) if r["step"] <= last_step] if last_step else []
        write_jsonl(run_dir / name, kept)
    last = (read_jsonl(run_dir / "metrics.jsonl") or [{}])[-1]
    return {key: last.get(f"{key}_total", 0) for key in TOTALS}


def log_step(run_dir: Path, record: dict, totals: dict) -> dict:
    """Append a step's record to metrics.jsonl with the run's TOTALS so far (compute spent); returns them."""
    totals = {key: total + record[key] for key, total in totals.items()}
    append_jsonl(run_dir / "metrics.jsonl", record | {f"{key}_total": value for key, value in totals.items()})
    return totals


def log_eval(run_dir: Path, step: int, result: dict) -> float:
    """An evaluation's accuracies into evals.jsonl, its records problem by problem into eval_records.jsonl."""
    append_jsonl(run_dir / "evals.jsonl", {"step": step, "eval_accuracy": result["accuracy"],
                                           "eval_accuracy_by_level": result["accuracy_by_level"]})
    write_jsonl(run_dir / "eval_records.jsonl", result["records"])  # the latest evaluation only
    return result["accuracy"]


def summarise_run(run_dir: Path, algo: str) -> dict:
    """Means over a finished run's steps, the steps that trained no row, and its early collapse
    (`early_collapse`), into summary.json."""
    rows, evals = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "evals.jsonl")
    mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    seconds = sum(r["time_generate"] + r["time_score"] + r["time_train"] for r in rows)
    summary = {"algo": algo, "acc_before": evals[0]["eval_accuracy"], "acc_after": evals[-1]["eval_accuracy"],
               "acr_mean": mean("acr"), "acr_effective_mean": mean("acr_effective"),
               "reward_mean": mean("reward_mean"), "seconds_per_step": seconds / len(rows),
               "steps_without_signal": sum(r["rows_trained"] == 0 for r in rows),
               **early_collapse(rows[: early_steps(len(rows))])}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


# ------------------------------------------------------------------------------ collapse as a diagnostic

EARLY_FRACTION, EARLY_MAX_STEPS = 0.2, 100  # ours: the first 20% of the steps; the paper reads its first 100
COLLAPSED_SETUP = 0.75  # ours: an early ACR this high means three groups in four teach nothing


def early_steps(steps: int) -> int:
    """The steps whose ACR is the run's early ACR: the first 20% (at least 1, at most 100)."""
    return max(1, min(EARLY_MAX_STEPS, math.ceil(EARLY_FRACTION * steps)))


def early_collapse(records: list[dict]) -> dict:
    """Mean raw ACR of these steps' metrics records, and its two ends (all-wrong, all-correct groups)."""
    mean = lambda key: sum(r[key] for r in records) / len(records)  # noqa: E731
    return {"early_steps": len(records), "early_acr": mean("acr"),
            "early_all_wrong_frac": mean("all_wrong_frac"),
            "early_all_correct_frac": mean("all_correct_frac")}


def collapse_warning(run_dir: Path, group_size: int) -> str | None:
    """One line when the early ACR (He et al.: it predicts the final accuracy) says the setup wastes its
    samples, naming the end that collapses and what to try; None otherwise."""
    early = early_collapse(read_jsonl(run_dir / "metrics.jsonl"))
    if early["early_acr"] < COLLAPSED_SETUP:
        return None
    wrong, right = early["early_all_wrong_frac"], early["early_all_correct_frac"]
    cause = (f"the task is too hard for this model, or G = {group_size} is too small to find a right answer: "
             "try an easier --dataset or level, a larger --group-size" if wrong >= right else
             "the task is too easy for this model: try a harder --dataset or level")
    return (f"warning: early ACR {early['early_acr']:.2f} over the first {early['early_steps']} steps "
            f"({wrong:.0%} of groups all-wrong, {right:.0%} all-correct), so most groups teach nothing; "
            f"{cause}, "
            "or --algo avspo or dapo")


def group_kinds(rewards: torch.Tensor) -> list[str]:
    """Each of the B groups of rewards [B, G] as one character: C all-correct, W all-wrong, = all equal
    otherwise, M mixed."""
    return ["C" if lo == 1 else "W" if hi == 0 else "=" if lo == hi else "M"
            for lo, hi in zip(rewards.amin(1).tolist(), rewards.amax(1).tolist())]


def group_map(first_rewards: torch.Tensor, advantages: torch.Tensor, replaced: torch.Tensor) -> dict:
    """The batch's B groups as strings, for a collapse map: how each group came out as first sampled
    (`group_kinds`), whether the method gave it a non-zero advantage (1/0), and whether dynamic sampling
    replaced its prompt (1/0)."""
    kinds = group_kinds(first_rewards)
    signal = (advantages.abs().amax(dim=1) >= 1e-6).tolist()  # as effective_collapse_rate's tau
    return {"groups_sampled": "".join(kinds), "groups_signal": "".join("01"[s] for s in signal),
            "groups_replaced": "".join("01"[r] for r in replaced.tolist())}


def step_metrics(rewards, advantages, rollout: Rollout, costs: dict, device) -> dict:
    """What a step logs about its whole batch (the names are documented in docs/metrics.md)."""
    completion_tokens, truncated, gen_tokens = all_sum(
        [rollout.completion_mask.sum().item(), rollout.truncated.sum().item(), costs["gen_tokens"]], device)
    return {"reward_mean": rewards.mean().item(), "accuracy": (rewards == 1).float().mean().item(),
            "acr": advantage_collapse_rate(rewards), "acr_effective": effective_collapse_rate(advantages),
            "all_correct_frac": (rewards.amin(1) == 1).float().mean().item(),
            "all_wrong_frac": (rewards.amax(1) == 0).float().mean().item(),
            "adv_abs_mean": advantages.abs().mean().item(), "adv_std": advantages.std().item(),
            "completion_len": completion_tokens / rewards.numel(),
            "truncated_frac": truncated / rewards.numel(),
            "gen_tokens": int(gen_tokens), "gen_tokens_per_s": gen_tokens / costs["generate"],
            "time_generate": costs["generate"], "time_score": costs["score"]}


# ------------------------------------------------------------------------------ the training groups, in words

SAMPLE_CHARS, SAMPLE_GROUPS = 500, 8  # samples.jsonl's bounds: characters of a text, groups of a step
COLLAPSED = {"C": "all-correct", "W": "all-wrong", "=": "all-equal"}  # the collapsed `group_kinds`


def cut(text: str, limit: int) -> str:
    """At most `limit` characters; a cut text ends in an ellipsis."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def group_samples(step: int, problems: list[Problem], texts: list[str], first: int, rewards: torch.Tensor,
                  advantages: torch.Tensor, ref_rewards: torch.Tensor | None,
                  replaced: torch.Tensor) -> list[dict]:
    """samples.jsonl's records of a step: this process's groups as trained (at most SAMPLE_GROUPS), the
    `problems` and their G `texts` each, problems[0] being the batch's group `first`; rewards, advantages and
    AAPO's r_ref [B, G] are the batch's. Beside the method's advantages, GRPO's for the same rewards: the two
    differ where AVSPO's virtual rewards or AAPO's margin act. Texts are cut to SAMPLE_CHARS characters."""
    grpo, kinds, group_size = grpo_advantages(rewards), group_kinds(rewards), rewards.shape[1]  # [B, G]
    records = []
    for i, problem in enumerate(problems[:SAMPLE_GROUPS]):
        b = first + i
        records.append({
            "step": step, "group": b, "prompt": cut(problem.question, SAMPLE_CHARS),
            "gold": cut(problem.answer, SAMPLE_CHARS), "collapsed": COLLAPSED.get(kinds[b]),
            "rewards": rewards[b].tolist(), "advantages": [round(a, 4) for a in advantages[b].tolist()],
            "grpo_advantages": [round(a, 4) for a in grpo[b].tolist()],
            **({"ref_rewards": ref_rewards[b].tolist()} if ref_rewards is not None else {}),  # AAPO
            **({"resampled": True} if replaced[b] else {}),  # DAPO: a new prompt, in place of a collapsed one
            "completions": [cut(t, SAMPLE_CHARS) for t in texts[i * group_size : (i + 1) * group_size]]})
    return records


def show_group(algo: str, step: int, accuracy: float, samples: list[dict]) -> None:
    """At an evaluation, one of the step's training groups in words, a collapsed one where there is one: each
    completion on one line, its reward and advantage beside GRPO's for the same rewards."""
    group = next((s for s in samples if s["collapsed"]), samples[0])
    one_line = lambda text, limit: cut(" ".join(text.split()), limit)  # noqa: E731
    lines = [f"[{algo}] step {step}: held-out accuracy {accuracy:.3f}; a training group of this step, "
             f"{group['collapsed'] or 'mixed'}: {one_line(group['prompt'], 40)} "
             f"(gold {one_line(group['gold'], 20)})", "  reward  advantage  GRPO's  completion"]
    lines += [f"  {r:6.2f}  {a:+9.3f}  {g:+6.3f}  {one_line(text, 80)}" for r, a, g, text in
              zip(group["rewards"], group["advantages"], group["grpo_advantages"], group["completions"])]
    tqdm.write("\n".join(lines))


# ------------------------------------------------------------------------------ a run: setup, each step's end


class Paths(NamedTuple):
    """The two functions --fast chooses between, with the same arguments and the same numbers."""

    sample_completions: Callable  # completion ids of a group of prompts, as model.sample_with_generate
    completion_logprobs: Callable  # per-token log-probs of rows, as model.completion_logprobs


def fast_or_plain(fast: bool, device: torch.device) -> Paths:
    """--fast: the fast paths, decoding.decode and packing.completion_logprobs (tests/test_fast_paths.py
    holds them to the plain definitions), on the device types where a run has shown them equal and faster
    (`decoding.FAST_ON`: the CPU, for which they were built); elsewhere, and with --no-fast, the plain
    definitions in model.py, HF generate and one forward pass. On CUDA --fast thus runs the plain path until
    `benchmarks/gpu_bench.py --smoke` has checked the fast ones there."""
    if fast and device.type in FAST_ON:
        return Paths(decode, packing.completion_logprobs)
    return Paths(sample_with_generate, completion_logprobs)


@dataclasses.dataclass
class Run:
    """What one algorithm's run holds from step to step (`start_run`)."""

    master: torch.nn.Module  # the float32 weights the optimizer steps
    policy: torch.nn.Module  # the network that samples and backpropagates: master, or its bf16 copy
    reference: torch.nn.Module | None  # the frozen initial policy, for AAPO's r_ref and the KL
    tokenizer: object
    optimizer: torch.optim.Optimizer
    state: dict  # the method's state across steps, checkpointed
    reward_fn: Callable
    train_problems: list[Problem]
    eval_problems: list[Problem]
    done: int  # the last completed step: 0, or the checkpoint's
    costs: Counter  # this step's sampling seconds and generated tokens


def start_run(args, run_dir: Path, device: torch.device, is_main: bool, state: dict,
              with_reference: bool) -> Run:
    """The models, optimizer, method state and problems of a run (train.Args `args`): new, or as saved with
    --resume."""
    transformers.logging.disable_progress_bar()  # the run's own bar alone: none for loading or saving weights
    checkpoint = find_checkpoint(run_dir) if args.resume else None
    if args.resume and not checkpoint and is_main:
        print(f"[{args.algo}] --resume: no checkpoint in {run_dir}, starting from scratch")
    master, tokenizer = load_model(str(checkpoint / "model") if checkpoint else args.model, device)
    policy = working_copy(master, args.precision)  # bf16: on CUDA and on CPUs with native bf16 (auto)
    reference = (cast_weights(load_model(args.model, device)[0].requires_grad_(False), policy.dtype)
                 if with_reference else None)
    if args.grad_checkpointing:
        policy.activation_checkpointing_enable()
    optimizer = torch.optim.AdamW(master.parameters(), lr=args.lr, weight_decay=0.0, fused=True)
    done = restore_checkpoint(checkpoint, optimizer, state) if checkpoint else 0
    eval_problems = (load_eval_problems(args.eval_dataset, args.seed) if args.eval_dataset
                     else load_problems(args.dataset, "test", args.seed))[: args.eval_size]
    reward_fn = load_reward(args.reward, args.reward_range)
    train_problems = load_problems(args.dataset, "train", args.seed)
    if is_main:
        print(f"[{args.algo}] {where_it_runs(args, master, policy, reference, tokenizer, train_problems)}")
    return Run(master, policy, reference, tokenizer, optimizer, state, reward_fn, train_problems,
               eval_problems, done, Counter())


def where_it_runs(args, master, policy, reference, tokenizer, problems: list[Problem]) -> str:
    """The run's first line: the device, the precision and dtypes, and the memory it should need
    (memory.py), for the run's shapes; the prompt length is that of the longest question, templated."""
    longest = max((p.question for p in problems), key=len)
    prompt = format_prompts(tokenizer, [longest], args.prompt_format, args.system)
    prompt_len = len(tokenizer(prompt, add_special_tokens=False).input_ids[0])
    rows = args.prompts_per_step * args.group_size // int(os.environ.get("WORLD_SIZE", 1))
    terms = estimate_memory(master.config, sum(p.numel() for p in master.parameters()), rows=rows,
                            prompt_len=prompt_len, completion_len=args.max_new_tokens,
                            micro_batch=min(args.micro_batch, rows), bf16=policy.dtype == torch.bfloat16,
                            reference=reference is not None, checkpointing=args.grad_checkpointing)
    dtypes = f"{master.dtype} master weights" + (f", a {policy.dtype} working copy" if policy is not master
                                                 else "")
    return (f"{describe_device(master.device)}; {resolve_precision(args.precision, master.device)} "
            f"({dtypes.replace('torch.', '')}); {describe_estimate(terms)}")


def run_eval(args, run: Run, run_dir: Path, step: int) -> float:
    """Greedy held-out accuracy, logged to evals.jsonl and eval_records.jsonl."""
    result = evaluate(run.policy, run.tokenizer, run.eval_problems, reward_fn=run.reward_fn,
                      max_new_tokens=args.max_new_tokens, prompt_format=args.prompt_format, system=args.system,
                      sample_completions=fast_or_plain(args.fast, run.policy.device).sample_completions)
    return log_eval(run_dir, step, result)


def eval_due(args, step: int) -> bool:
    """Every --eval-every steps, and after the last."""
    return bool(args.eval_every) and step % args.eval_every == 0 or step == args.steps


def first_eval(args, run: Run, run_dir: Path) -> None:
    """Before training; or, resumed, the checkpoint's evaluation if the run stopped between saving and it
    (Ctrl-C on an evaluation step skips it)."""
    if not run.done:
        print(f"[{args.algo}] held-out accuracy before training: {run_eval(args, run, run_dir, 0):.3f} "
              f"({len(run.eval_problems)} problems)")
        return
    evaluated = [e["step"] for e in read_jsonl(run_dir / "evals.jsonl")]
    if eval_due(args, run.done) and run.done not in evaluated:
        run_eval(args, run, run_dir, run.done)


def after_step(args, run: Run, run_dir: Path, record: dict, totals: dict, stop: bool,
               samples: list[dict]) -> dict:
    """Process 0, after each step: log it and (--log-samples) its groups, warn once if the early ACR says the
    setup wastes its samples, save, evaluate and show one group. Returns the run's totals so far
    (`log_step`)."""
    totals = log_step(run_dir, record, totals)
    step = record["step"]
    evaluating = eval_due(args, step) and (not stop or step == args.steps)
    if args.log_samples == "every" or args.log_samples == "evals" and evaluating:
        for sample in samples:
            append_jsonl(run_dir / "samples.jsonl", sample)
    if step == early_steps(args.steps) and (warning := collapse_warning(run_dir, args.group_size)):
        tqdm.write(f"[{args.algo}] {warning}")  # the paper's early-ACR diagnostic
    if args.save_every and (step % args.save_every == 0 or step == args.steps or stop):
        save_checkpoint(run_dir, run.master, run.tokenizer, run.optimizer, step, run.state)
    if evaluating:
        accuracy = run_eval(args, run, run_dir, step)
        if args.show_group:
            show_group(args.algo, step, accuracy, samples)
    return totals
