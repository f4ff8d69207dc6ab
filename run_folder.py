"""A run folder, <out>/<algo>: its one owner (a lock), whether a new run may start there or an old one resume,
checkpoints, and the logs (JSON lines).
"""

import dataclasses
import fcntl
import itertools
import json
import os
import pickle
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import torch


class RunFolderError(Exception):
    """A file of a run folder that cannot be used (damaged, or a pickle that would run code): one line naming
    it, and nothing is written."""



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


def out_problem(args) -> str | None:
    """Why the run folders of train.Args `args` may not be used, in one line: --out names a file, --resume
    meets --overwrite, or a run to resume has other flags (`resume_conflicts`); None when they may."""
    if not (existing := next(p for p in [Path(args.out), *Path(args.out).parents] if p.exists())).is_dir():
        return f"--out {args.out}: {existing} is a file, not a folder"
    if args.resume and args.overwrite:
        return "--resume continues the runs in --out, --overwrite replaces them: choose one"
    for algo in args.algo.split(",") if args.resume else []:  # one run folder, one configuration
        if conflicts := resume_conflicts(Path(args.out) / algo, dataclasses.replace(args, algo=algo)):
            return conflicts
    return None


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
    if final.exists():  # whole (it came by a rename): a checkpoint.old beside it is a leftover of a kill
        shutil.rmtree(old, ignore_errors=True)  # while it was being removed
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
