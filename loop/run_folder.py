"""A run folder, <out>/<algo>: whether a new run may start there or an old one resume, checkpoints, and the
logs (JSON lines).

Every file of a run is written through infra/written.py: the run folder's record knows what a run wrote there,
so --overwrite removes that and nothing else (`written.Folder.clear`), and a folder holding a file no run
wrote (a user's, or one changed since) is refused in one line, with or without --overwrite.
"""

import contextlib
import dataclasses
import itertools
import json
import os
import pickle
import struct
import sys
import zipfile
from pathlib import Path

import torch

from data.tasks import changed_data, data_hashes
from infra.lora import has_adapters, save_adapters
from infra.written import Folder, NotWritten, owned


class RunFolderError(Exception):
    """A file of a run folder that cannot be used (damaged, or a pickle that would run code): one line naming
    it, and nothing is written."""


RESUMABLE = ("resume", "overwrite", "out", "save_every", "eval_every", "micro_batch", "grad_checkpointing",
             "log_samples", "show_group")
CHECKPOINTS = ("checkpoint", "checkpoint.old")  # the newest whole one, and the one before while a save ends
LOGS = ("config.json", "metrics.jsonl", "evals.jsonl")  # the run's record of itself, which --resume needs
PLOT = "curves.png"  # in <out>, beside the run folders


def owned_out(out: str):
    """<out>, owned by process 0 alone (`written.owned`, kind "runs": its run folders and curves.png); the
    other processes of torchrun write nothing, and get None."""
    return owned(Path(out), "runs") if os.environ.get("RANK", "0") == "0" else contextlib.nullcontext()


def holds_a_run(folder: Folder) -> bool:
    """Whether the run folder holds (part of) a run: its record names a config, metrics or a checkpoint."""
    return any(name in folder.files for name in ("config.json", "metrics.jsonl", *CHECKPOINTS))


def free_out(out: str) -> str:
    """An --out beside `out` that does not exist yet: out-2, out-3, ..."""
    return next(f"{Path(out)}-{n}" for n in itertools.count(2) if not Path(f"{Path(out)}-{n}").exists())


def logged_steps(run_dir: Path) -> int:
    """Lines of its metrics.jsonl (whether or not each is a whole record: this only counts them)."""
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text(errors="replace").splitlines()) if metrics.exists() else 0


def earlier_run(folder: Folder, out: str) -> str | None:
    """Why a fresh run may not start in a run folder (<out>/<algo>): one line saying what to type when it
    holds an earlier run, which the fresh run's logs would replace; None when it holds none."""
    if not holds_a_run(folder):
        return None
    run_dir = folder.path
    return (f"{run_dir} holds an earlier run (steps logged: {logged_steps(run_dir)}): add --resume to "
            f"continue it, --out {free_out(out)} to keep it and start another, or --overwrite to replace it")


def no_whole_checkpoint(folder: Folder) -> str | None:
    """Why --resume may not continue the run in a run folder, in one line saying what is there and what to
    type: it holds logs or a config but no whole checkpoint; None when it may (or when it holds no run)."""
    run_dir = folder.path
    if not holds_a_run(folder) or find_checkpoint(run_dir):
        return None
    checkpoints = [run_dir / name for name in CHECKPOINTS if (run_dir / name).exists()]
    why = (checkpoint_damage(checkpoints[0]) if checkpoints
           else "it was run with --save-every 0" if saved_config(run_dir).get("save_every") == 0
           else "no checkpoint/ was saved")
    move = f"move {checkpoints[0]} away (changed since the run saved it), then " if checkpoints else ""
    return (f"--resume: {run_dir} holds a run (steps logged: {logged_steps(run_dir)}) but no whole "
            f"checkpoint to continue from: {why}; {move}--overwrite starts it again, removing its logs and "
            f"weights, or --out {free_out(str(run_dir.parent))} starts another beside it")


def logs_gone(folder: Folder) -> str | None:
    """Why --resume may not continue the run in a run folder: a log it continues from (LOGS, all written at
    the run's start) is gone, so that it would resume under other flags, or summarise part of the run; None
    when all are there (a changed one is `not_the_runs`'s)."""
    if gone := [name for name in LOGS if not os.path.lexists(folder.path / name)]:
        return (f"--resume: {folder.path} has lost its {', '.join(gone)}, which --resume continues from: "
                f"restore {'it' if len(gone) == 1 else 'them'}, or --overwrite starts the run again")
    return None


def not_the_runs(folder: Folder) -> str | None:
    """Why no run may use this run folder, with or without --overwrite: one line naming a file in it that no
    run wrote (`Folder.foreign`: a user's, or a run's file changed since, a symlink in its place), which is
    left as it is; None when every file is the run's."""
    others = folder.foreign()
    try:
        for name in others[:1]:
            folder.now(name)
    except NotWritten as e:  # it says what the file is: not written here, changed since, a symlink
        also = f" (also: {', '.join(others[1:3])}{', ...' * bool(others[3:])})" if others[1:] else ""
        return f"{e}{also}"
    return None


def folder_problem(args, out: Folder) -> str | None:
    """Why the run folders of train.Args `args` in `out` (<out>, owned by this process: no other run changes
    them in between) may not be used, in one line saying what to type; None when they may. --resume takes no
    run it cannot continue (`no_whole_checkpoint`) or that ran with other flags (`resume_conflicts`); a fresh
    run no folder that holds an earlier run (without --overwrite); no run a folder holding a file that no run
    wrote there (`not_the_runs`), even with --overwrite; and no run replaces a plot at <out> that no run
    wrote."""
    for algo in args.algo.split(","):
        if not os.path.lexists(out.path / algo):
            continue
        try:
            folder = out.subfolder(algo, "run")
        except NotWritten as e:  # a file or a symlink in its place, a folder of someone else's
            return str(e)
        if args.resume and holds_a_run(folder):
            problem = (no_whole_checkpoint(folder) or logs_gone(folder)
                       or resume_conflicts(folder.path, dataclasses.replace(args, algo=algo)))
        else:
            problem = None if args.overwrite else earlier_run(folder, args.out)
        if problem := problem or not_the_runs(folder):
            return problem
    try:
        out.now(PLOT)
    except NotWritten as e:
        return str(e)
    return None


def saved_config(run_dir: Path) -> dict:
    """The run's config.json ({} where there is none); a damaged one is a RunFolderError naming it."""
    path = run_dir / "config.json"
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text(errors="replace"))
    except json.JSONDecodeError as e:
        raise RunFolderError(f"{path} is damaged ({e.msg}, line {e.lineno}): restore it, or --overwrite to "
                             "start the run again") from None
    if not isinstance(config, dict):
        raise RunFolderError(f"{path} holds a {type(config).__name__}, not a run's config: restore it, or "
                             "--overwrite to start the run again")
    return config


def resume_conflicts(run_dir: Path, args) -> str | None:
    """Why `args` (a train.Args) may not continue the run in run_dir, in one line naming each flag that
    differs from its config.json; None when it may. Only the flags in RESUMABLE may change: they leave the
    steps taken as they were and the steps to come as they would have been (--micro-batch and
    --grad-checkpointing change memory and speed, and the order of a sum). --steps sets the lr schedule of
    every step (`train.scheduled_lr`), so it may change only where the lr does not depend on it
    (--lr-decay 0): a longer run would otherwise follow another schedule than its first steps did."""
    if not (saved := saved_config(run_dir)):
        return None
    now = json.loads(json.dumps(dataclasses.asdict(args)))  # as saved: tuples become lists
    defaults = json.loads(json.dumps({f.name: f.default for f in dataclasses.fields(args)}))
    fixed = [key for key in now if key not in RESUMABLE and not (key == "steps" and now["lr_decay"] == 0)]
    changed = [f"--{key.replace('_', '-')} {saved.get(key, defaults[key])} -> {now[key]}" for key in fixed
               if saved.get(key, defaults[key]) != now[key]]  # a flag newer than the run: as its default
    if not changed:  # the same flags: the same data too (a file's content, config.json's "data_sha256")
        data = changed_data(saved.get("data_sha256", {}), now["dataset"], now["eval_dataset"])
        return data and f"--resume {run_dir}: {data}: restore it, or --overwrite to train the run again on it"
    return (f"--resume {run_dir}: {'; '.join(changed)}, unlike its config.json; only "
            f"{', '.join('--' + k.replace('_', '-') for k in RESUMABLE[2:])} may change on resume "
            "(and --steps with --lr-decay 0)")


def stopped_line(args, run_dir: Path, step: int, while_scoring: bool = False) -> str:
    """The one line a run stopped by Ctrl-C or SIGTERM prints, whenever the signal came: what is saved, how
    to go on. `while_scoring`: it came while step `step`'s rewards were computed, so that step is dropped."""
    last, dropped = (step - 1, f" while scoring step {step} (dropped)") if while_scoring else (step, "")
    if not args.save_every:
        return f"[{args.algo}] interrupted{dropped} after step {last}: --save-every 0, no checkpoint"
    if last == 0:
        return f"[{args.algo}] interrupted{dropped}: no step ended, nothing to resume"
    return f"[{args.algo}] interrupted{dropped}: step {last} saved in {run_dir}; continue with --resume"


def save_checkpoint(folder: Folder, model, tokenizer, optimizer, step: int, algo_state: dict) -> None:
    """HF folder + optimizer + step + method state (a dict of dataclasses) into checkpoint/, through a folder
    filled beside it (`Folder.filling`); the one it replaces is kept as checkpoint.old until the new one is
    in place. A failed write (a full disk, a read-only folder) is a RunFolderError in one line, and the last
    whole checkpoint stays as it was."""
    try:
        with folder.filling("checkpoint") as tmp:
            if has_adapters(model):  # LoRA: the adapters alone, not the base (model.load_model adds it)
                save_adapters(model, tmp / "model")
            else:
                model.save_pretrained(tmp / "model")
            tokenizer.save_pretrained(tmp / "model")
            torch.save({"step": step, "optimizer": optimizer.state_dict(),
                        "algo_state": {key: dataclasses.asdict(value) for key, value in algo_state.items()}},
                       tmp / "state.pt")
            # What is there, not what the record names: a kill just after a rename leaves the record naming
            # a name that has gone.
            if all(folder.now(name) for name in CHECKPOINTS):  # a kill between the renames, or damage:
                keep = find_checkpoint(folder.path)  # keep the whole one of the two
                folder.remove("checkpoint.old" if keep == folder.path / "checkpoint" else "checkpoint")
            if folder.now("checkpoint"):
                folder.rename("checkpoint", "checkpoint.old")
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        kept = find_checkpoint(folder.path)
        raise RunFolderError(f"the checkpoint of step {step} could not be saved in {folder.path} "
                             f"({getattr(e, 'strerror', None) or str(e).splitlines()[0]}); "
                             + (f"{kept} stays whole: --resume goes on from it" if kept else
                                "there is no earlier one") + " once there is room") from None
    folder.remove("checkpoint.old")


def whole_safetensors(path: Path) -> bool:
    """A .safetensors file as long as its header says: 8 bytes of header length, the JSON header, the data."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return False
        try:
            header = json.loads(f.read(struct.unpack("<Q", head)[0]))
        except (json.JSONDecodeError, UnicodeDecodeError, OverflowError):
            return False
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    return path.stat().st_size == 8 + struct.unpack("<Q", head)[0] + end


def checkpoint_damage(folder: Path) -> str | None:
    """Why `folder` is not a whole checkpoint, in words; None when it is: state.pt a complete zip
    (torch.save's format), model/ with weights in safetensors as long as their headers say. Pickled weights
    (pytorch_model.bin) are refused unread: loading one could run code, and train.py never saves one."""
    state, model = folder / "state.pt", folder / "model"
    weights = sorted(model.glob("*.safetensors"))
    if not state.exists():
        return f"{state} is missing"
    if not zipfile.is_zipfile(state):
        return f"{state} is damaged (truncated, or not torch.save's)"
    if (model / "pytorch_model.bin").exists():
        return (f"{model / 'pytorch_model.bin'} is refused unread: a pickle, which could run code (train.py "
                "saves safetensors)")
    if not weights:
        return f"{model} holds no *.safetensors weights"
    if broken := [w for w in weights if not whole_safetensors(w)]:
        return f"{broken[0]} is damaged (shorter than its header says)"
    return None


def find_checkpoint(run_dir: Path) -> Path | None:
    """The newest whole checkpoint: checkpoint/, else checkpoint.old/ (a save stopped between its renames,
    or checkpoint/ damaged: the whole one before it is taken, and train.py says so); None where there is
    none."""
    return next((folder for folder in (run_dir / "checkpoint", run_dir / "checkpoint.old")
                 if folder.exists() and not checkpoint_damage(folder)), None)


def restore_checkpoint(folder: Path, optimizer, state: dict) -> int:
    """Load optimizer and method state saved by `save_checkpoint`; returns the last completed step. Only
    tensors and plain data load (weights_only): a state.pt from someone else cannot run code here.

    Its storages load onto the device of the parameters the optimizer holds: without `map_location`, each
    goes back to the device that saved it (a GPU run's cuda:0), so under torchrun every process would put
    the whole optimizer state on GPU 0, and a run continued on a machine without CUDA would not load."""
    path = folder / "state.pt"
    device = optimizer.param_groups[0]["params"][0].device
    try:
        saved = torch.load(path, weights_only=True, map_location=device)
    except pickle.UnpicklingError:  # torch's message is a page long
        raise RunFolderError(f"{path}: refused, it holds objects other than tensors and plain data, which "
                             "could run code (train.py never saves such a file)") from None
    except (RuntimeError, EOFError, OSError) as e:  # a truncated or overwritten file
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


def append_jsonl(folder: Folder, name: str, record: dict) -> None:
    folder.append(name, json.dumps(record) + "\n")


def write_jsonl(folder: Folder, name: str, records: list[dict]) -> None:
    """Written whole or not at all (`Folder.write`): a run killed while a resume rewrites its metrics.jsonl
    keeps every logged step."""
    folder.write(name, "".join(json.dumps(r) + "\n" for r in records))


TOTALS = ("gen_tokens", "train_tokens")  # summed over a run's steps in metrics.jsonl, as <name>_total


def start_logs(folder: Folder, config: dict, last_step: int) -> dict:
    """A fresh run (last_step 0): nothing an earlier run wrote in the run folder (`Folder.clear`;
    `folder_problem` lets one be replaced only with --overwrite), then config.json and empty logs. The
    checkpoints go first and config.json is replaced last: a run killed anywhere in between leaves a config
    and either all of the earlier run or no checkpoint, which --resume continues or refuses in one
    line. A resumed run: drop what was logged after its checkpoint. Both: what a write stopped part-way left
    (`Folder.remove_temporaries`). Returns the TOTALS of the last record kept."""
    if last_step == 0:
        folder.clear(keep=[name for name in folder.files if name not in CHECKPOINTS])
        folder.clear(keep=("config.json",))
    folder.remove_temporaries()
    if last_step == 0:
        hashes = data_hashes(config["dataset"], config["eval_dataset"])  # the data's identity: its content
        folder.write("config.json", json.dumps(config | {"data_sha256": hashes}, indent=2))
    for name in ("metrics.jsonl", "evals.jsonl", "samples.jsonl"):
        kept = [r for r in read_jsonl(folder.path / name) if r["step"] <= last_step] if last_step else []
        write_jsonl(folder, name, kept)
    last = (read_jsonl(folder.path / "metrics.jsonl") or [{}])[-1]
    return {key: last.get(f"{key}_total", 0) for key in TOTALS}


def log_step(folder: Folder, record: dict, totals: dict) -> dict:
    """Append a step's record to metrics.jsonl with the run's TOTALS so far (compute spent); returns them."""
    totals = {key: total + record[key] for key, total in totals.items()}
    append_jsonl(folder, "metrics.jsonl", record | {f"{key}_total": value for key, value in totals.items()})
    return totals


def log_eval(folder: Folder, step: int, result: dict, seconds: float) -> float:
    """An evaluation's records problem by problem into eval_records.jsonl (the latest evaluation only), then
    its accuracies and the `seconds` it took into evals.jsonl. In that order: a run killed between the two
    has not logged the evaluation, so --resume does it again (`run.first_eval`) and eval_records.jsonl never
    lags evals.jsonl."""
    write_jsonl(folder, "eval_records.jsonl", result["records"])
    append_jsonl(folder, "evals.jsonl", {"step": step, "eval_accuracy": result["accuracy"],
                                         "eval_accuracy_by_level": result["accuracy_by_level"],
                                         "time_eval": seconds})
    return result["accuracy"]
