"""Plumbing for train.py, kept out of its way: processes under torchrun, checkpoints, and run logs.

Nothing here knows about GRPO, AVSPO or AAPO: a method's state reaches a checkpoint as a dict of
dataclasses, and is rebuilt with the same classes on resume.
"""

import argparse
import dataclasses
import json
import os
import shutil
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from advantage import advantage_collapse_rate, effective_collapse_rate
from model import Rollout, pick_device


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


def fraction(text: str) -> float:
    """An argparse type: a float in [0, 1], or a one-line error."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def dataclass_parser(config_class, description: str) -> argparse.ArgumentParser:
    """One --flag per dataclass field, its help from the field's metadata (extra metadata: argparse options).
    A bool field is a switch: --x sets a False default; one whose default is True gets --x/--no-x."""
    parser = argparse.ArgumentParser(description=description)
    for f in dataclasses.fields(config_class):
        flag, options = "--" + f.name.replace("_", "-"), {k: v for k, v in f.metadata.items() if k != "help"}
        help = f.metadata["help"].replace("%", "%%")  # argparse formats help strings with %
        if f.type is bool and f.default is True:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=True, help=help, **options)
        elif f.type is bool:
            parser.add_argument(flag, action="store_true", help=help, **options)
        else:
            parser.add_argument(flag, **{"type": f.type, "default": f.default, **options}, help=f"{help} (default: {f.default})")
    return parser


# ------------------------------------------------------------------------------ processes (torchrun)


def init_processes() -> tuple[int, int, torch.device]:
    """(rank, world size, device): one process unless launched by torchrun (nccl on CUDA, gloo on CPU)."""
    if "RANK" not in os.environ:
        return 0, 1, pick_device()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
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


def gather_groups(local: torch.Tensor) -> torch.Tensor:
    """[B/N, G] rows of each of N processes -> [B, G] in rank order (the order of the step's prompts)."""
    if not dist.is_initialized():
        return local
    nccl = dist.get_backend() == "nccl"  # nccl gathers CUDA tensors only
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    parts = [torch.empty_like(local, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.to(device))
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


@contextmanager
def ctrl_c_stops_after_the_step():
    """Inside the block, a first Ctrl-C only asks to stop (the yielded list becomes non-empty): the loop ends
    its step, so that a checkpoint holds whole steps. The loop checks the request itself, so an interrupt can
    never be lost inside a library that swallows exceptions. A second Ctrl-C stops at once, unsaved."""
    requested: list[bool] = []
    if threading.current_thread() is not threading.main_thread():  # only the main thread receives signals
        yield requested
        return

    def on_ctrl_c(signum, frame):
        if requested:
            raise KeyboardInterrupt
        requested.append(True)
        os.write(2, b"\nCtrl-C: stopping at the end of the step under way (press again to stop at once, unsaved)\n")

    previous = signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        yield requested
    finally:
        signal.signal(signal.SIGINT, previous)


def save_checkpoint(run_dir: Path, model, tokenizer, optimizer, step: int, algo_state: dict) -> None:
    """HF folder + optimizer + step + method state (a dict of dataclasses), written to a temp folder then
    renamed into place."""
    tmp, final, old = run_dir / "checkpoint.tmp", run_dir / "checkpoint", run_dir / "checkpoint.old"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    torch.save({"step": step, "optimizer": optimizer.state_dict(),
                "algo_state": {key: dataclasses.asdict(value) for key, value in algo_state.items()}}, tmp / "state.pt")
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
    """Load optimizer and method state saved by `save_checkpoint`; returns the last completed step."""
    saved = torch.load(folder / "state.pt", weights_only=False)
    optimizer.load_state_dict(saved["optimizer"])
    state.update({key: type(state[key])(**value) for key, value in saved["algo_state"].items()})
    return saved["step"]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def append_jsonl(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def start_logs(run_dir: Path, config: dict, last_step: int) -> dict:
    """A fresh run (last_step 0): config.json and empty logs, whatever an earlier run left in run_dir. A resumed
    one: drop what was logged after its checkpoint. Returns the last metrics record kept ({} for a fresh run)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if last_step == 0:
        (run_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("metrics.jsonl", "evals.jsonl"):
        kept = [r for r in read_jsonl(run_dir / name) if r["step"] <= last_step] if last_step else []
        write_jsonl(run_dir / name, kept)
    return (read_jsonl(run_dir / "metrics.jsonl") or [{}])[-1]


def summarise_run(run_dir: Path, algo: str) -> dict:
    """Means over a finished run's steps, written to summary.json."""
    rows, evals = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "evals.jsonl")
    mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    summary = {"algo": algo, "acc_before": evals[0]["eval_accuracy"], "acc_after": evals[-1]["eval_accuracy"],
               "acr_mean": mean("acr"), "acr_effective_mean": mean("acr_effective"), "reward_mean": mean("reward_mean"),
               "seconds_per_step": sum(r["time_generate"] + r["time_score"] + r["time_train"] for r in rows) / len(rows)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def step_metrics(rewards, advantages, rollout: Rollout, timer: dict, device) -> dict:
    """What a step logs about its whole batch (the names are documented in the README)."""
    completion_tokens, truncated, gen_tokens = all_sum(
        [rollout.completion_mask.sum().item(), rollout.truncated.sum().item(), timer["gen_tokens"]], device)
    return {"reward_mean": rewards.mean().item(), "accuracy": (rewards == 1).float().mean().item(),
            "acr": advantage_collapse_rate(rewards), "acr_effective": effective_collapse_rate(advantages),
            "all_correct_frac": (rewards.amin(1) == 1).float().mean().item(),
            "all_wrong_frac": (rewards.amax(1) == 0).float().mean().item(),
            "adv_abs_mean": advantages.abs().mean().item(), "adv_std": advantages.std().item(),
            "completion_len": completion_tokens / rewards.numel(), "truncated_frac": truncated / rewards.numel(),
            "gen_tokens": int(gen_tokens), "gen_tokens_per_s": gen_tokens / timer["generate"],
            "time_generate": timer["generate"], "time_score": timer["score"], "time_train": timer["train"]}
