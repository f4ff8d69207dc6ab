"""Evidence that can tell the methods apart, at small scale: figures and results.json (docs/ holds those the
README quotes).

    python experiments.py                  # difficulty, compare, scatter (--dry-run: the time estimate)
    python experiments.py --figures docs   # the same, rewriting docs/results.json and docs/*.png
    python experiments.py --only compare   # one or more parts: difficulty, compare, scatter, precision, lora
    python experiments.py --quick          # tiny model, 2 steps: the whole pipeline in ~1 min (a CI test)

1. difficulty: ACR of the untrained model at each arith-mix level (and all levels pooled), split into
   all-correct and all-wrong groups.
2. compare:    GRPO, AVSPO, AVSPO always on (avspo-always: no trigger), AAPO and DAPO's dynamic sampling on
   arith-mix, train.py's own schedule (lr decaying to 0), the same prompts per
   seed, several seeds. train.py evaluates a stratified prefix of the held-out split every --eval-every steps
   (the curves of accuracy against generated tokens); the final checkpoint of every run is then evaluated
   greedily on the whole split (336 problems), its per-problem records cached in final_eval.jsonl beside its
   run folder (in train.py's --out of that run). A bootstrap over seeds AND problems gives a 95% CI for each
   method's accuracy (overall, per level) and for its difference to GRPO paired by seed: the same resampled
   seeds and problems for both methods (a seed fixes the held-out split too, so methods of one seed are scored
   on the same 336 problems). Each accuracy sits next to the collapse the method left (raw and effective ACR,
   the all-correct and all-wrong groups of the last quarter of the steps) and its cost: generated tokens
   (policy + AAPO's reference + DAPO's resampled groups) and seconds. A collapse map shows seed 0's groups
   step by step, and what each method did with the collapsed ones.
3. readings:   AVSPO's readings side by side, each changing one choice of ours or an unverified one (a fixed
   threshold, K = 1, one end only: `METHODS`), with GRPO rerun beside them; as compare, in its own folder.
   bf16 kernels round differently per CPU (the untrained model's greedy accuracy on the same 112 problems was
   0.223 on an AMD EPYC, 0.188 on an Intel Xeon), so the arms of a seed are compared only on one machine: each
   run folder's machines.jsonl says which CPU trained it.
4. scatter:    the AVSPO paper's Figure 1: early raw ACR (train.py's summary: the mean over the first 20% of
   the steps) against final held-out accuracy (train.py's last eval, on that level's test split) over a grid
   of levels x group sizes x seeds of short GRPO runs; slope and R^2 with bootstrap CIs over runs.
5. precision:  the default run (`python train.py`: GRPO on arith-mul1, train.py's own settings) in bf16 and in
   fp32 on the same seeds: does bf16, what `--precision auto` picks where the CPU has native bf16, learn as
   well as fp32? Held-out accuracy, batch reward and seconds per step against steps. Only with
   --only precision: where bf16 is emulated (a CPU with AVX2 alone) its runs take many times longer.
6. lora:       does LoRA match full fine-tuning in RL, even at rank 1 ("LoRA Without Regret", Schulman et al.,
   2025)? GRPO with full fine-tuning, LoRA rank 1 and LoRA rank 32 (alpha 32, every linear layer: lora.py),
   as compare (its flags, seeds and paired bootstrap, Δ against full fine-tuning), each arm at its own
   learning rate. The rate is chosen per arm by a sweep on one seed that is not among --seeds (--sweep-seed):
   full fine-tuning over --full-lrs, LoRA over --lora-lrs (Schulman et al.: LoRA's best is ~10x full
   fine-tuning's; 8e-4, then 1.6e-3, added when a rank's best lay at the top of the grid); the rule: the rate
   whose final model is the most accurate (greedy, on that seed's whole held-out split), the smaller on
   a tie. Verdict on "matches" (`verdict`): confirmed when the Δ interval lies within +-MARGIN, refuted when
   it lies wholly outside, inconclusive otherwise. Only with --only lora.

Finished runs are reused and unfinished ones resume from their last checkpoint, so a rerun (after Ctrl-C, in
another session, or with more --seeds) only fills gaps; a run is reused or resumed only when its config.json
holds the flags asked for (else one line names the run and the flag: `check_run`). Before any run, every run's
flags pass train.py's own checks, and every folder it writes can be written (`check_before_any_run`). Ctrl-C
or SIGTERM stops it at once, in one line: the runs under way save their step, no other starts (`run_all`).
A failed write (a full disk) is one line, as in train.py. Everything goes through
written.py's records: the runs, results.json and the figures under --out (<out>/figures), or the figures and
results.json in --figures (`--figures docs` rewrites the committed ones: a folder experiments.py wrote, or a
new one).
Time: steps x step_seconds x (B*G / 64) + evaluations x eval_seconds, summed over runs
(`estimate`, printed first).
"""

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import platform
import re
import signal
import sys
from concurrent.futures import ALL_COMPLETED, FIRST_EXCEPTION, ProcessPoolExecutor, wait
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

import train
from advantage import advantage_collapse_rate
from data.tasks import LEVELS, load_problems
from decoding import decode
from eval import evaluate, score_groups
from flags import FlagParser, at_least, dataclass_parser, folder, in_range
from hardware import cpu_features, pick_device, resolve_precision, working_copy
from model import load_model, sample
from plots import (plot_accuracy_vs_compute, plot_accuracy_vs_tokens, plot_collapse_map, plot_compare_curves,
                   plot_difficulty, plot_early_acr_scatter, plot_precision_curves)
from processes import STOP_SIGNALS, on_stop_signals
from run_folder import RunFolderError, find_checkpoint, read_jsonl, saved_config
from stats import (bootstrap_accuracy, expected_half_width, interval, line_fit, seeds_to_decide,
                   variance_parts, verdict)
from verifier import load_reward
from written import Folder, NotWritten, owned

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
           # the lora part's arms, each at the learning rate its sweep chose (lora.py's alpha, layers)
           "full-ft": ("grpo", ["--lora-rank", "0"]),
           "lora-r1": ("grpo", ["--lora-rank", "1", "--lora-alpha", "32"]),
           "lora-r32": ("grpo", ["--lora-rank", "32", "--lora-alpha", "32"])}
BASELINE = "grpo"
LORA = ("full-ft", "lora-r1", "lora-r32")  # the first is the lora part's baseline
# "matches": Δ within 2.5 points, the smallest gain a claim in the README's table calls an effect (AAPO's)
MARGIN = 0.025
# also compared paired with these: does AVSPO's trigger help, and which end of collapse costs accuracy?
ABLATIONS = {"avspo": ("avspo-always", "avspo-fixed"), "avspo-wrong": ("avspo-correct",)}
PRECISIONS = ("bf16", "fp32")


def acr_by_difficulty(model_name: str, prompts: int, group_size: int, max_new_tokens: int,
                      batch: int = 8) -> dict:
    """Sample G completions for `prompts` training problems of each level with the untrained model (T=1)."""
    model, tokenizer = load_model(model_name)
    net, reward = working_copy(model), load_reward()  # bf16 where the CPU has it, as train.py samples
    torch.manual_seed(0)
    result, pooled = {}, []
    for level in LEVELS:
        problems = load_problems(f"arith-{level}", "train")[:prompts]
        rewards = []
        for i in tqdm(range(0, len(problems), batch), desc=level):
            chunk = problems[i : i + batch]
            rollout = sample(net, tokenizer, [p.question for p in chunk], group_size, max_new_tokens,
                             sample_completions=decode)  # as train.py samples by default (--fast)
            rewards.append(torch.tensor(score_groups([p.question for p in chunk], rollout.texts,
                                                     [p.answer for p in chunk], reward)))
        pooled.append(torch.cat(rewards))  # [prompts, G]
    for level, r in zip([*LEVELS, "mix"], [*pooled, torch.cat(pooled)]):  # mix: the batch ACR of arith-mix
        result[level] = {"accuracy": r.mean().item(), "acr": advantage_collapse_rate(r),
                         "all_correct_frac": (r.amin(1) == 1).float().mean().item(),
                         "all_wrong_frac": (r.amax(1) == 0).float().mean().item(), "prompts": len(r)}
    return result


Run = tuple[Path, int, str, list[str]]  # a training run: run_training's arguments (train.py's --out, ...)


class Stopped(KeyboardInterrupt):
    """Ctrl-C or SIGTERM (`stop_handler`): no run starts after it, and the runs under way save their step."""

    def __init__(self, signum: int):
        super().__init__(STOP_SIGNALS[signum])
        self.signum = signum

    def __reduce__(self):  # a worker's, sent to `run_all` (by default its name alone would be)
        return Stopped, (self.signum,)


def stop_handler() -> Callable:
    """A handler of Ctrl-C and SIGTERM (`main`, and a worker's task): the first raises Stopped at once
    (`run_all` passes it on to the workers, whose runs save their step); a later one raises nothing, and ends
    this process's workers at once (SIGKILL: each keeps its last checkpoint), so that nothing waits on a
    worker that cannot stop. Never twice: a second Stopped could escape the code that tells the workers (two
    signals sent together run their handlers one after the other). Inside train.main, train.py's own handler
    ends the step under way and saves it instead."""
    received: list[int] = []

    def on_signal(signum: int, frame) -> None:
        received.append(signum)
        if len(received) == 1:
            raise Stopped(signum)
        signal_all(multiprocessing.active_children(), signal.SIGKILL)

    return on_signal


def run_training(out: Path, seed: int, algo: str, flags: list[str]) -> None:
    """train.py's run <out>/<algo> (`check_run` allowed it), unless it is finished: one that stopped part-way
    goes on from its checkpoint (--resume; steps depend on seed and step alone), one stopped before its first
    checkpoint (or with --save-every 0) starts again (--overwrite: --resume refuses it). Stopped by a signal,
    saved, it raises Stopped."""
    if finished(out / algo):
        return
    with owned(out, "runs") as runs:  # released before train.py takes it
        runs.remove_temporaries()
        runs.append("machines.jsonl", json.dumps({"algos": [algo], **machine()}) + "\n")  # one per (re)start
    try:
        train.main(train_argv(out, seed, algo, flags)
                   + ["--resume" if find_checkpoint(out / algo) else "--overwrite"])
    except SystemExit as e:
        if e.code in [128 + signum for signum in STOP_SIGNALS]:  # train.py's exit once it saved its step
            raise Stopped(e.code - 128) from None
        raise


def train_argv(out: Path, seed: int, algo: str, flags: list[str]) -> list[str]:
    """train.py's flags for a run (`Run`), but --resume or --overwrite."""
    return flags + ["--algo", algo, "--seed", str(seed), "--out", str(out)]


def finished(run: Path) -> bool:
    """Whether train.py finished the run: its summary.json is whole (a run killed while writing it is not)."""
    try:
        return isinstance(json.loads((run / "summary.json").read_text()), dict)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False


# what the study reads of a train.py run (`check_run`: each as train.py wrote it, or the study stops)
STUDY_READS = ("config.json", "metrics.jsonl", "evals.jsonl", "eval_records.jsonl", "summary.json")
OWN_READS = ("final_eval.jsonl", "machines.jsonl")  # and what experiments.py wrote beside it
# where a run went and how it was started or logged: not what it computed
HOW_RUN = ("out", "resume", "overwrite", "save_every", "micro_batch", "grad_checkpointing", "log_samples",
           "show_group")


def check_run(out: Path, seed: int, algo: str, flags: list[str]) -> None:
    """A RunFolderError, in one line saying what to type, when the run <out>/<algo> may not be reused or
    continued for train.py `flags` on `seed`: its config.json records other flags (another level at a
    scatter point, fewer steps), or its summary.json is damaged; NotWritten when a file the study reads
    (`STUDY_READS`, its final evaluation's cache) is not as the script that wrote it left it."""
    run = out / algo
    summary = run / "summary.json"
    if summary.exists() and not finished(run):  # train.py writes it whole: damaged since, by someone else
        raise RunFolderError(f"{summary} is damaged (not a run's summary): restore it (git checkout, for a "
                             f"committed run), or move {run} away to train the run again")
    if not (finished(run) or find_checkpoint(run)):
        return  # absent, or stopped before its first checkpoint: trained afresh
    as_written(run, "run", STUDY_READS)
    as_written(out, "runs", OWN_READS)
    saved = saved_config(run)
    asked = vars(dataclass_parser(train.Args, "").parse_args(train_argv(out, seed, algo, flags)))  # unchecked
    asked, default = (json.loads(json.dumps(config)) for config in  # as config.json holds them
                      (asked, {f.name: f.default for f in dataclasses.fields(train.Args)}))
    if changed := [f"--{key.replace('_', '-')} {saved.get(key, default[key])} (asked: {value})"
                   for key, value in asked.items()
                   if key not in HOW_RUN and saved.get(key, default[key]) != value]:  # newer flag: default
        raise RunFolderError(f"{run} was trained with {', '.join(changed)} (its config.json): ask for the "
                             "flags it was trained with, or choose another --out")


def as_written(folder: Path, kind: str, names: tuple[str, ...]) -> None:
    """NotWritten, one line naming the file, unless each of `names` in `folder` is absent or as the script that
    wrote it left it (the folder's record): the study uses no other."""
    with owned(folder, kind) as files:
        for name in names:
            files.now(name)


def machine() -> dict:
    """The CPU that trains a run (its model name and matmul flags), and torch's version and threads: bf16
    kernels round differently per CPU, so a run repeats token for token only on the same kind of CPU."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    return {"cpu": names[0] if names else platform.processor(), "cpu_features": sorted(cpu_features()),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def run_all(tasks: list[tuple], jobs: int) -> list:
    """fn(*args) for each task (fn, *args), in order; with jobs > 1 in that many processes that split the
    cores.

    Runs are small (16-64 rows): on 2 cores two 1-thread runs side by side did ~15% more work per second than
    one 2-thread run (measured). Spawned, not forked: a forked child inherits torch's thread pool in a bad
    state. After a failure, Ctrl-C or SIGTERM no run starts: the pool hands tasks to its workers ahead of
    time, which cancelling cannot take back, so the workers are told through `stopping` (`with_threads`).

    A stop reaches the workers from here alone, one SIGTERM each, on which a run saves its step and ends. A
    second signal would end it unsaved (train.py's rule), so the workers never see the terminal's Ctrl-C: they
    are spawned with SIGINT blocked, and every thread they start inherits the block. A second signal here ends
    them at once (`stop_handler`). Every wait here is awake to a signal (`wait_awake`)."""
    if jobs == 1:
        return [fn(*a) for fn, *a in tasks]
    threads = max(1, (os.cpu_count() or 1) // jobs)
    spawn = multiprocessing.get_context("spawn")
    stopping = spawn.Event()
    with ProcessPoolExecutor(jobs, mp_context=spawn, initializer=start_worker, initargs=(stopping,)) as pool:
        futures = []  # none yet, for a stop during `submit`
        try:
            unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # workers spawn in submit
            try:
                futures = [pool.submit(with_threads, threads, *task) for task in tasks]
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
            wait_awake(futures, FIRST_EXCEPTION)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM (`stop_handler`), passed on
            stopping.set()
            signal_all(multiprocessing.active_children(), signal.SIGTERM)
            pool.shutdown(wait=False, cancel_futures=True)
            wait_awake(futures, ALL_COMPLETED)  # each run saves its step, or a second signal kills its worker
            raise
        if any(f.done() and f.exception() for f in futures):  # said now, not after every queued run
            stopping.set()
            pool.shutdown(cancel_futures=True)  # the runs under way end
        return [f.result() for f in futures]


SIGNAL_CHECK = 0.2  # seconds: how late a signal taken by another thread may be seen (`wait_awake`)


def wait_awake(futures: list, return_when: str) -> None:
    """wait(futures, return_when=...) in short waits, so that a signal's handler runs at most SIGNAL_CHECK s
    late: Python runs it in the main thread alone, and the kernel may hand a process's signal to any thread
    that does not block it (tqdm's monitor, left by an earlier run in this process; the pool's own), most of
    all the second of two sent together, which one long wait would hold until a run ended. A future that
    `shutdown(cancel_futures=True)` cancelled counts as done (`wait` would wait for it to the end)."""
    while not all(f.done() for f in futures):
        done, _ = wait(futures, SIGNAL_CHECK, return_when)
        if return_when == FIRST_EXCEPTION and any(f.exception() for f in done):
            return


def signal_all(processes: list, signum: int) -> None:
    """Send `signum` to each of these processes that is still there."""
    for process in processes:
        with suppress(ProcessLookupError):
            os.kill(process.pid, signum)


STOPPING = None  # in a worker of `run_all`: its event, set when no more runs may start (`start_worker`)


def start_worker(stopping) -> None:
    """A worker of `run_all`: it ignores SIGTERM between tasks (`with_threads` takes it during one), and keeps
    `stopping`."""
    global STOPPING
    STOPPING = stopping
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def with_threads(threads: int, fn: Callable, *args):
    """fn(*args) in a worker process limited to `threads` intra-op threads; nothing (None) once `run_all` has
    set the stop event. SIGTERM stops it at once (`stop_handler`), or, inside train.main, after its step,
    saved. The handler comes first: a SIGTERM sent after `stopping` was set then either finds the handler or
    finds `stopping` set."""
    with on_stop_signals(stop_handler()):
        if STOPPING.is_set():
            return None
        torch.set_num_threads(threads)
        return fn(*args)


def run_dir(folder: Path, method: str, seed: int) -> Path:
    """<folder>/seed0-grpo/grpo: one train.py folder per method and seed, so parallel runs share no file."""
    return folder / f"seed{seed}-{method}" / METHODS[method][0]


def method_runs(folder: Path, methods: list[str], seeds: list[int], flags: list[str],
                extra: dict[str, list[str]] | None = None) -> dict[tuple[str, int], Run]:
    """Each method on each seed, seed by seed (a partial sweep is whole for its seeds): (method, seed) -> its
    run in `folder` (`run_dir`), with the method's flags and its `extra` ones (the lora part's rates)."""
    extra = extra or {}
    return {(m, s): (run_dir(folder, m, s).parent, s, METHODS[m][0], flags + extra.get(m, []) + METHODS[m][1])
            for s in seeds for m in methods}


def train_and_score(run: Run, problems: list, max_new_tokens: int) -> list[dict]:
    """Train one run, then its final model's per-problem records on `problems`."""
    run_training(*run)
    out, _, algo, _ = run
    return final_records(out / algo, problems, max_new_tokens)


def held_out(seed: int, per_level: int | None) -> list:
    """The arith-mix test split train.py uses for this seed, or its first `per_level` problems of each
    level."""
    problems = load_problems("arith-mix", "test", seed)
    if per_level is None:
        return problems
    return [p for level in LEVELS for p in [q for q in problems if q.level == level][:per_level]]


def final_records(run: Path, problems: list, max_new_tokens: int) -> list[dict]:
    """Per-problem correctness of the run's final model (greedy, deterministic): train.py's last evaluation
    when it covered these problems (--eval-size 336), else the final checkpoint evaluated once and cached
    beside the run, in <out>/final_eval.jsonl (train.py's --out, which holds this run alone)."""
    if [r["question"] for r in read_jsonl(run / "eval_records.jsonl")] == [p.question for p in problems]:
        return read_jsonl(run / "eval_records.jsonl")
    cache = run.parent / "final_eval.jsonl"
    # absent, or other problems
    if [r["question"] for r in read_jsonl(cache)] != [p.question for p in problems]:
        model, tokenizer = load_model(str(run / "checkpoint"))
        net = working_copy(model)  # the network train.py evaluates: the same greedy answers
        result = evaluate(net, tokenizer, problems, max_new_tokens=max_new_tokens, sample_completions=decode)
        keep = ("question", "level", "gold", "extracted", "correct")
        with owned(run.parent, "runs") as runs:
            runs.remove_temporaries()
            runs.write(cache.name, "".join(json.dumps({k: r[k] for k in keep}) + "\n"
                                           for r in result["records"]))
    return read_jsonl(cache)


def accuracy_table(correct: np.ndarray, levels: np.ndarray, names: list[str], resamples: int,
                   baseline: str = BASELINE) -> dict:
    """For each method: accuracy and Δ to `baseline` (paired), overall and per level, each with its 95% CI;
    for a method with ablations in ABLATIONS, also its overall Δ to each (paired the same way)."""
    boot, base = bootstrap_accuracy(correct, levels, resamples), names.index(baseline)
    table = {}
    for i, name in enumerate(names):
        row = {"accuracy": None, "delta": None, "by_level": {}, "delta_by_level": {}}
        for key, mask in ([("all", np.ones(len(levels), bool))]
                          + [(lv, levels == lv) for lv in dict.fromkeys(levels)]):
            point = correct[:, :, mask].mean(axis=(1, 2))  # [M]
            acc, delta = interval(point[i], boot[key][:, i]), interval(point[i] - point[base],
                                                                         boot[key][:, i] - boot[key][:, base])
            if key == "all":
                row["accuracy"], row["delta"] = acc, delta
            else:
                row["by_level"][key], row["delta_by_level"][key] = acc, delta
        row["per_seed"] = correct[i].mean(axis=1).tolist()
        table[name] = row
    for name, ablations in ABLATIONS.items():
        for ablation in [a for a in ablations if name in names and a in names]:
            i, j = names.index(name), names.index(ablation)
            point = table[name]["accuracy"]["mean"] - table[ablation]["accuracy"]["mean"]
            table[name].setdefault("delta_vs_ablation", {})[ablation] = interval(
                point, boot["all"][:, i] - boot["all"][:, j])
    return table


def compute_cost(runs: list[Path]) -> dict:
    """What a method spent, mean (and std) over seeds: generated and trained tokens, seconds."""
    rows = [read_jsonl(d / "metrics.jsonl") for d in runs]
    values = {"gen_tokens": [r[-1]["gen_tokens_total"] for r in rows],
              "train_tokens": [r[-1]["train_tokens_total"] for r in rows],
              "seconds": [sum(x["time_generate"] + x["time_score"] + x["time_train"] for x in r)
                          for r in rows]}
    return {k: {"mean": float(np.mean(v)), "std": float(np.std(v)), "per_seed": v} for k, v in values.items()}


def collapse(runs: list[Path]) -> dict:
    """Mean over steps, then mean (and std) over seeds: the raw ACR (groups sampled all-equal) and the
    effective ACR (groups whose advantages are all zero after the method: what it left unused), over the whole
    run and over its first and last quarters of steps, and the last minus the first (late_rise: does collapse
    rise late in training, as AAPO says?); the all-correct and all-wrong fractions over its last quarter,
    where the papers place late collapse; for AVSPO, the share of steps its trigger fired. Also the share of
    steps whose gradient norm exceeded --max-grad-norm and was clipped: while the clip binds, signal given
    to collapsed groups shrinks the mixed groups' share of the step."""
    rows = [read_jsonl(d / "metrics.jsonl") for d in runs]
    max_norms = [json.loads((d / "config.json").read_text())["max_grad_norm"] for d in runs]
    quarter = -(-len(rows[0]) // 4)
    everything, first_quarter, last_quarter = slice(None), slice(None, quarter), slice(-quarter, None)
    spans = {"acr": ("acr", everything), "acr_effective": ("acr_effective", everything),
             "acr_effective_first_quarter": ("acr_effective", first_quarter),
             "acr_effective_last_quarter": ("acr_effective", last_quarter),
             "all_correct_frac": ("all_correct_frac", last_quarter),
             "all_wrong_frac": ("all_wrong_frac", last_quarter)}
    if "avspo_triggered" in rows[0][0]:  # AVSPO: the share of steps on which its trigger fired
        spans["avspo_triggered"] = ("avspo_triggered", everything)
    per_seed = {name: [float(np.mean([x[key] for x in r[span]])) for r in rows]
                for name, (key, span) in spans.items()}
    per_seed["late_rise"] = [last - first for first, last in zip(per_seed["acr_effective_first_quarter"],
                                                                 per_seed["acr_effective_last_quarter"])]
    per_seed["clipped"] = [float(np.mean([x["grad_norm"] > max_norm for x in r]))
                           for r, max_norm in zip(rows, max_norms)]
    return {k: {"mean": float(np.mean(v)), "std": float(np.std(v)), "per_seed": v}
            for k, v in per_seed.items()}


def seed_deltas(table: dict, resamples: int, seed: int = 0, baseline: str = BASELINE) -> None:
    """Add to each method's collapse and cost numbers a 95% bootstrap CI over the seeds ("ci"), and their
    difference to `baseline` paired by seed, with its CI ("delta"): for claims about collapse and cost, where
    each seed gives one number."""
    rng = np.random.default_rng(seed)
    seeds = len(table[baseline]["cost"]["seconds"]["per_seed"])
    picks = rng.integers(0, seeds, size=(resamples, seeds))  # [R, S]: the same draws for every number
    for row in table.values():
        for group in ("collapse", "cost"):
            for key, stat in row[group].items():
                values = np.array(stat["per_seed"])  # [S]
                stat["ci"] = interval(values.mean(), values[picks].mean(axis=1))["ci"]
                if key in table[baseline][group]:
                    diff = values - np.array(table[baseline][group][key]["per_seed"])  # [S]
                    stat["delta"] = interval(diff.mean(), diff[picks].mean(axis=1))


def accuracy_curves(runs: list[Path]) -> dict:
    """train.py's evaluations (the held-out prefix, greedy) against the steps and generated tokens spent by
    then: the mean over seeds, and the range of the seeds."""
    evals, rows = ([read_jsonl(d / "evals.jsonl") for d in runs],
                   [read_jsonl(d / "metrics.jsonl") for d in runs])
    steps = [e["step"] for e in evals[0]]
    for run, logged in zip(runs, evals):  # curves average the seeds step by step
        if (run_steps := [e["step"] for e in logged]) != steps:
            raise SystemExit(f"{run / 'evals.jsonl'}: evaluated at steps {run_steps}, "
                             f"not {steps} like {runs[0]}")
    tokens = [[0] + [r[s - 1]["gen_tokens_total"] for s in steps[1:]] for r in rows]  # [S][evals]
    accuracy = [[e["eval_accuracy"] for e in run] for run in evals]
    return {"steps": steps, "gen_tokens": np.mean(tokens, axis=0).tolist(),
            "accuracy": np.mean(accuracy, axis=0).tolist(), "accuracy_low": np.min(accuracy, axis=0).tolist(),
            "accuracy_high": np.max(accuracy, axis=0).tolist()}


def compare(folder: Path, methods: list[str], seeds: list[int], flags: list[str], per_level: int | None,
            max_new_tokens: int, resamples: int, jobs: int, baseline: str = BASELINE,
            extra: dict[str, list[str]] | None = None) -> dict:
    """Train every method on every seed into `folder` (with its `extra` flags: the lora part's learning
    rates), evaluate each final checkpoint per problem, bootstrap (Δ to `baseline`), account costs."""
    runs = method_runs(folder, methods, seeds, flags, extra)
    for run in runs.values():  # before any run starts
        check_run(*run)
    tasks = [(train_and_score, run, held_out(s, per_level), max_new_tokens) for (_, s), run in runs.items()]
    records = dict(zip(runs, run_all(tasks, jobs)))
    correct = [[[r["correct"] for r in records[m, s]] for s in seeds] for m in methods]  # [M][S][N]
    levels = {s: [r["level"] for r in records[methods[0], s]] for s in seeds}
    assert all(lv == levels[seeds[0]] for lv in levels.values()), "the bootstrap needs one level pattern"
    levels = np.array(levels[seeds[0]])
    table = accuracy_table(np.array(correct, dtype=float), levels, methods, resamples, baseline)
    for name in methods:
        runs = [run_dir(folder, name, s) for s in seeds]
        table[name]["cost"], table[name]["collapse"] = compute_cost(runs), collapse(runs)
        table[name]["curve"] = accuracy_curves(runs)
        logged = [read_jsonl(d / "evals.jsonl")[-1]["eval_accuracy"] for d in runs]  # train.py's last eval
        table[name]["train_py_final_accuracy"] = logged
        same_problems = (per_level is None
                         and json.loads((runs[0] / "config.json").read_text())["eval_size"] >= 336)
        if same_problems and not np.allclose(logged, table[name]["per_seed"]):  # greedy: should be identical
            print(f"warning: {name}: re-evaluated checkpoints {table[name]['per_seed']} "
                  f"!= train.py's {logged}")
    seed_deltas(table, resamples, baseline=baseline)
    for seed in seeds:  # bf16 rounds differently per CPU: a seed's methods are compared on one kind
        if len(cpus := seed_cpus(folder, methods, seed)) > 1:
            print(f"warning: {folder} seed {seed}: its runs were trained on {len(cpus)} kinds of CPU "
                  f"({', '.join(sorted(cpus))}), so its methods differ by more than the method")
    return table


def seed_cpus(folder: Path, methods: list[str], seed: int) -> set[str]:
    """The CPUs that trained this seed's runs, from their machines.jsonl (none for runs made before it)."""
    return {line["cpu"] for method in methods
            for line in read_jsonl(run_dir(folder, method, seed).parent / "machines.jsonl")}


def markdown_table(table: dict) -> str:
    """method | accuracy [95% CI] | Δ vs GRPO [95% CI] | per-level accuracy | collapse | AVSPO's trigger and
    the clipped steps (shares of steps) | costs."""
    levels = list(next(iter(table.values()))["by_level"])
    lines = [f"| method | accuracy [95% CI] | Δ vs {BASELINE.upper()} [95% CI] | {' / '.join(levels)} | "
             "raw / effective ACR | all-correct / all-wrong, last quarter | trigger | clipped "
             "| generated tokens | seconds |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in table.items():
        cost, acr = row["cost"], row["collapse"]
        by_level = " / ".join(f"{row['by_level'][lv]['mean']:.2f}" for lv in levels)
        trigger = f"{acr['avspo_triggered']['mean']:.2f}" if "avspo_triggered" in acr else "-"
        lines.append(f"| {name} | {with_ci(row['accuracy'])} | "
                     f"{'-' if name == BASELINE else with_ci(row['delta'], '+')} | "
                     f"{by_level} | {acr['acr']['mean']:.2f} / {acr['acr_effective']['mean']:.2f} | "
                     f"{acr['all_correct_frac']['mean']:.2f} / {acr['all_wrong_frac']['mean']:.2f} | "
                     f"{trigger} | {acr['clipped']['mean']:.2f} | "
                     f"{cost['gen_tokens']['mean']:,.0f} | {cost['seconds']['mean']:,.0f} |")
    return "\n".join(lines)


def with_ci(x: dict, sign: str = "") -> str:
    """An interval's mean [low, high], to 3 decimals (sign "+": signed, for a Δ)."""
    return f"{x['mean']:{sign}.3f} [{x['ci'][0]:{sign}.3f}, {x['ci'][1]:{sign}.3f}]"


def early_acr_scatter(runs: list[dict], resamples: int) -> dict:
    """Fit final accuracy = slope * early ACR + intercept over the runs; bootstrap CIs over runs."""
    x, y = np.array([r["early_acr"] for r in runs]), np.array([r["accuracy"] for r in runs])
    return {**line_fit(x, y, resamples), "distinct_early_acr": len(set(x.tolist())), "runs": runs}


def scatter_runs(args: argparse.Namespace, out: Path) -> dict[tuple[str, int, int], Run]:
    """The scatter's short GRPO runs over levels x G x seeds, the largest G first: (level, G, seed) -> its
    run."""
    flags = ["--model", args.model, "--max-new-tokens", str(args.max_new_tokens), "--steps",
             str(args.scatter_steps), "--prompts-per-step", str(args.scatter_prompts), "--eval-every",
             str(args.scatter_steps), "--eval-size", str(args.scatter_eval_size), "--save-every", "0"]
    seeds = [int(s) for s in args.scatter_seeds.split(",")]
    return {(level, g, seed): (out / f"{level}-g{g}-seed{seed}", seed, "grpo",
                               flags + ["--dataset", f"arith-{level}", "--group-size", str(g)])
            for g in sorted([int(g) for g in args.scatter_g.split(",")], reverse=True)
            for level in args.scatter_levels.split(",") for seed in seeds}


def scatter(runs: dict[tuple[str, int, int], Run], levels: list[str], resamples: int, jobs: int) -> dict:
    """The scatter's runs (`scatter_runs`); each run's early raw ACR (`metrics.early_steps`) and final
    held-out accuracy, from its summary.json, level by level (in the order of `levels`)."""
    for run in runs.values():  # before any run starts
        check_run(*run)
    run_all([(run_training, *run) for run in runs.values()], jobs)
    points = []
    for level, g, seed in sorted(runs, key=lambda cell: (levels.index(cell[0]), cell[1], cell[2])):
        out, _, algo, _ = runs[level, g, seed]
        summary = json.loads((out / algo / "summary.json").read_text())
        points.append({"level": level, "group_size": g, "seed": seed, "early_steps": summary["early_steps"],
                       "early_acr": summary["early_acr"], "accuracy": summary["acc_after"]})
    return early_acr_scatter(points, resamples)


def precision_runs(args: argparse.Namespace, out: Path) -> dict[tuple[str, int], Run]:
    """The default run (`python train.py`) in each precision on each seed: (precision, seed) -> its run; fp32,
    the slower, first: balances the jobs."""
    flags = ["--model", args.model, "--max-new-tokens", str(args.max_new_tokens), "--steps",
             str(args.precision_steps), "--save-every", "0"]  # otherwise the default run's own settings
    return {(name, seed): (out / f"seed{seed}-{name}", seed, "grpo", flags + ["--precision", name])
            for name in reversed(PRECISIONS) for seed in [int(s) for s in args.precision_seeds.split(",")]}


def precision(runs: dict[tuple[str, int], Run], jobs: int) -> dict:
    """The same GRPO run in bf16 and in fp32 on each seed (`precision_runs`): held-out accuracy before and
    after, and the costs."""
    if resolve_precision("auto", pick_device()) != "bf16":
        print("warning: this machine has no native bf16 (avx512_bf16, amx_bf16 or CUDA): "
              "the bf16 runs are emulated")
    for run in runs.values():  # before any run starts
        check_run(*run)
    run_all([(run_training, *run) for run in runs.values()], jobs)
    result = {}
    for name in PRECISIONS:
        folders = [out / algo for (of, _), (out, _, algo, _) in runs.items() if of == name]  # seed by seed
        evals = [read_jsonl(folder / "evals.jsonl") for folder in folders]
        result[name] = {"runs": [str(folder) for folder in folders],
                        "acc_before": [e[0]["eval_accuracy"] for e in evals],
                        "acc_after": [e[-1]["eval_accuracy"] for e in evals], "cost": compute_cost(folders)}
    return result


def estimate(args, parts: list[str]) -> tuple[int, int, float, float]:
    """(runs, training steps, step units, eval units), before skipping finished runs. Time in seconds is about
    step_units x step_seconds + eval_units x eval_seconds: a step of B prompts x G completions is B*G/64 step
    units (sampling 8 x 8 for the difficulty part: half a unit), an evaluation of n problems n/336 eval units;
    a compare run evaluates 3 times (train.py before and after, the per-problem one), a scatter run twice."""
    runs = steps = step_units = eval_units = 0
    sweep = len(args.full_lrs.split(",")) + (len(LORA) - 1) * len(args.lora_lrs.split(","))
    for part, n in (("compare", len(args.methods.split(",")) * len(args.seeds.split(","))),
                    ("readings", len(args.readings.split(",")) * len(args.seeds.split(","))),
                    ("lora", len(LORA) * len(args.seeds.split(",")) + sweep)):  # lora: its sweep's runs too
        if part in parts:
            runs, steps = runs + n, steps + n * args.steps
            step_units += n * args.steps * args.prompts_per_step * args.group_size / 64
            # train.py's, step 0 on
            evals = args.steps // args.eval_every + 1 + (args.steps % args.eval_every > 0)
            eval_units += n * (evals * min(args.eval_size, 336) + (args.per_level * len(LEVELS) or 336)) / 336
    if "scatter" in parts:
        gs = [int(g) for g in args.scatter_g.split(",")]
        n = len(args.scatter_levels.split(",")) * len(args.scatter_seeds.split(","))
        runs, steps = runs + n * len(gs), steps + n * len(gs) * args.scatter_steps
        step_units += n * args.scatter_steps * args.scatter_prompts * sum(gs) / 64
        eval_units += n * len(gs) * 2 * args.scatter_eval_size / 336
    if "difficulty" in parts:
        step_units += len(LEVELS) * args.difficulty_prompts * 8 / 64 / 2
    if "precision" in parts:  # train.py's own B, G and evaluation schedule
        n, default = len(PRECISIONS) * len(args.precision_seeds.split(",")), train.Args
        runs, steps = runs + n, steps + n * args.precision_steps
        step_units += n * args.precision_steps * default.prompts_per_step * default.group_size / 64
        every = default.eval_every  # before training, every `every` steps, and after the last
        evals = args.precision_steps // every + 1 + (args.precision_steps % every > 0)
        eval_units += n * evals * min(default.eval_size, 336) / 336
    return runs, steps, step_units, eval_units


def make_parser() -> argparse.ArgumentParser:
    """The flags: where the runs go, which parts run, and each part's scale."""
    p = FlagParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=folder, default="runs/experiments",
                   help="the runs; git keeps their logs, not their checkpoints (.gitignore)")
    p.add_argument("--only", default="difficulty,compare,readings,scatter", help="parts to run, comma list")
    p.add_argument("--figures", type=folder, default=None,
                   help="where results.json and the PNGs go (default: <out>/figures); `--figures docs` "
                   "rewrites the committed ones")
    p.add_argument("--quick", action="store_true", help="tiny model, tiny sizes: checks the whole pipeline")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default=",".join(COMPARE),
                   help=f"compare: comma list of {', '.join(METHODS)}")
    p.add_argument("--readings", default=",".join(READINGS), help="readings: comma list, as --methods")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--steps", type=COUNT, default=40, help="compare: steps per run (train.py's default run)")
    p.add_argument("--prompts-per-step", type=COUNT, default=8, help="compare: B")
    p.add_argument("--group-size", type=at_least(2), default=8, help="compare: G")
    p.add_argument("--max-new-tokens", type=COUNT, default=64)
    p.add_argument("--eval-size", type=COUNT, default=112,
                   help="compare: train.py's own evals, a stratified prefix "
                   "of the held-out split (336: all, which also checks the per-problem re-evaluation)")
    p.add_argument("--eval-every", type=COUNT, default=10, help="compare: train.py's evals every N steps")
    p.add_argument("--per-level", type=at_least(0), default=0,
                   help="compare: final per-problem eval on the first N problems of each level (0: all)")
    p.add_argument("--resamples", type=COUNT, default=2000, help="bootstrap resamples")
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
    p.add_argument("--precision-steps", type=COUNT, default=train.Args.steps, help="precision: steps per run")
    p.add_argument("--full-lrs", default="1e-5,2e-5,4e-5", help="lora: full fine-tuning's learning rates")
    p.add_argument("--lora-lrs", default="1e-4,2e-4,4e-4,8e-4,1.6e-3",
                   help="lora: LoRA's learning rates (each rank)")
    p.add_argument("--sweep-seed", type=at_least(0), default=100,
                   help="lora: the seed of the learning-rate sweep (not one of --seeds)")
    p.add_argument("--step-seconds", type=SECONDS, default=13.0,
                   help="estimate: wall seconds per B=8 x G=8 step, "
                   "with --jobs 2 on 2 cores (compare's wall time, docs/results.md)")
    p.add_argument("--eval-seconds", type=SECONDS, default=40.0,
                   help="estimate: wall seconds per 336-problem eval")
    p.add_argument("--jobs", type=COUNT, default=2, help="training runs at once, each on cores/jobs threads")
    p.add_argument("--dry-run", action="store_true",
                   help="print the run count and time estimate, run nothing")
    p.add_argument("--budget-minutes", type=SECONDS, default=360.0, help="warn when the estimate exceeds it")
    p.add_argument("--margin", type=in_range(0, 1, low_open=True), default=MARGIN,
                   help="the plan: the seeds that would decide a difference of this size (0.025: 2.5 points)")
    return p


COUNT, SECONDS = at_least(1), in_range(0, math.inf, low_open=True)
PARTS = ("difficulty", "compare", "readings", "scatter", "precision", "lora")
CHOICES = {"only": PARTS, "methods": METHODS, "readings": METHODS, "scatter_levels": LEVELS}  # comma lists
INTEGERS = {"seeds": 0, "scatter_seeds": 0, "precision_seeds": 0, "scatter_g": 2}  # comma lists: the least
RATES = ("full_lrs", "lora_lrs")  # comma lists of positive numbers


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
    """The flags given; with --quick, every part at a tiny scale unless a flag given says otherwise. Bad
    values stop here in one line, before any model loads."""
    p = make_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.quick:  # every part, every figure, in about a minute: tiny random model, 2 steps, a few problems;
        # its own folder, or its tiny runs would stand in for the real ones (finished runs are skipped)
        args = p.parse_args(["--out", "runs/quick", "--model", "tiny-qwen2", "--seeds", "0,1",
                             "--steps", "2", "--prompts-per-step", "2", "--group-size", "4",
                             "--max-new-tokens", "8",
                             "--eval-size", "4", "--eval-every", "1", "--per-level", "2",
                             "--resamples", "500", "--scatter-prompts", "2", "--scatter-levels",
                             "add1,mul1", "--scatter-g", "2,4", "--scatter-seeds", "0",
                             "--scatter-steps", "2", "--scatter-eval-size", "4",
                             "--difficulty-prompts", "4", "--precision-seeds", "0,1",
                             "--precision-steps", "2", "--full-lrs", "1e-5,2e-5", "--lora-lrs",
                             "1e-4,2e-4", "--jobs", "1", *argv])  # flags given still win
    if problem := list_problem(args):
        p.error(problem)
    if args.sweep_seed in [int(s) for s in args.seeds.split(",")]:  # the rate would be fitted to the test
        p.error(f"--sweep-seed {args.sweep_seed} is one of --seeds {args.seeds}: choose another")
    return args


def print_estimate(args: argparse.Namespace, parts: list[str]) -> None:
    """The runs and the time they would take, with a warning when that exceeds --budget-minutes."""
    runs, steps, step_units, eval_units = estimate(args, parts)
    minutes = (step_units * args.step_seconds + eval_units * args.eval_seconds) / 60
    print(f"{runs} training runs, {steps} steps ({step_units:.0f} B=8 x G=8 step equivalents, "
          f"{eval_units:.0f} 336-problem evals): about {minutes:.0f} min at {args.step_seconds:g} s/step, "
          f"{args.eval_seconds:g} s/eval")
    if minutes > args.budget_minutes:  # say what would fit rather than start a run that overruns
        fits = (args.budget_minutes * 60 - eval_units * args.eval_seconds) / step_units
        print(f"warning: over the {args.budget_minutes:g}-min budget; it fits at <= {fits:.1f} s/step, "
              "or with fewer --steps, --seeds, --scatter-steps or a smaller --scatter-g grid")


COMMITTED = Path(__file__).resolve().parent / "runs" / "experiments" / "compare"  # the README's comparison


def evaluated_seeds(folder: Path, method: str) -> set[int]:
    """The seeds of `method` in a compare folder whose final evaluation is there (`run_dir`'s names)."""
    named = (re.fullmatch(rf"seed(\d+)-{re.escape(method)}", p.name) for p in folder.glob(f"seed*-{method}"))
    return {int(m[1]) for m in named if m and (folder / m[0] / "final_eval.jsonl").exists()}


def compare_variances(folders: list[Path], methods: list[str]) -> tuple[float, float, Path] | None:
    """(problem_var, seed_var, folder) of the paired Δs against GRPO (`stats.variance_parts`, averaged over
    the methods) from the first folder holding finished compare runs of GRPO and another method on two seeds
    or more, each final evaluation on the same problems; None where none does."""
    answers = {}  # (folder, method, seed) -> the final evaluation's answers, each file read once

    def answers_of(folder: Path, method: str, seed: int) -> list[bool]:
        if (folder, method, seed) not in answers:
            run = run_dir(folder, method, seed).parent  # where the study caches final_eval.jsonl
            as_written(run, "runs", ("final_eval.jsonl",))
            answers[folder, method, seed] = [r["correct"] for r in read_jsonl(run / "final_eval.jsonl")]
        return answers[folder, method, seed]

    for folder in folders:
        parts = []
        for method in [m for m in methods if m != BASELINE]:
            seeds = sorted(evaluated_seeds(folder, method) & evaluated_seeds(folder, BASELINE))
            if len(seeds) < 2:
                continue
            pair = [np.array([answers_of(folder, name, s) for s in seeds], dtype=float)
                    for name in (BASELINE, method)]  # [S, N] each
            if pair[0].shape == pair[1].shape:
                parts.append(variance_parts(*pair))
        if parts:
            return (*np.mean(parts, axis=0).tolist(), folder)
    return None


def print_interval_plan(args: argparse.Namespace) -> None:
    """compare's expected 95% half width of each Δ vs GRPO, and the seeds that would decide ±--margin, from
    the variances of finished compare runs (this study's, else the checkout's committed ones; `stats`)."""
    methods, seeds = args.methods.split(","), len(args.seeds.split(","))
    try:
        found = compare_variances([Path(args.out) / "compare", COMMITTED], methods)
    except NotWritten as e:  # a final evaluation changed since it was written: nothing taken from it
        print(f"compare: no interval planned: {e}")
        return
    if found is None:
        print("compare: no finished runs of two seeds to take the variances from: no interval planned")
        return
    problem_var, seed_var, folder = found
    problems = len(held_out(0, args.per_level or None))
    width = expected_half_width(seeds, problems, problem_var, seed_var)
    needed = seeds_to_decide(args.margin, problems, problem_var, seed_var)
    print(f"compare: each Δ vs {BASELINE} over {seeds} seeds of {problems} held-out problems: expected 95% "
          f"interval ±{100 * width:.1f} points (variances from {folder}: {problem_var:.3f} a problem, "
          f"{seed_var:.5f} between seeds); deciding ±{100 * args.margin:g} points 4 times in 5 at a true Δ "
          f"of 0 takes {needed or 'more than 1000'} seeds")


FIGURES = {"difficulty": ("acr_vs_difficulty.png",),  # what each part draws, in the figures folder
           "compare": ("compare.png", "compare_accuracy.png", "compare_learning.png", "collapse_map.png"),
           "scatter": ("early_acr_vs_accuracy.png",), "precision": ("precision.png",)}
RESULTS = "results.json"  # every number the README quotes (docs/results.json)


def comparison_flags(args: argparse.Namespace) -> list[str]:
    """train.py's flags for every run of compare, readings and lora (train.py's lr schedule)."""
    return ["--model", args.model, "--max-new-tokens", str(args.max_new_tokens), "--dataset", "arith-mix",
            "--steps", str(args.steps), "--prompts-per-step", str(args.prompts_per_step), "--group-size",
            str(args.group_size), "--eval-every", str(args.eval_every), "--eval-size", str(args.eval_size),
            "--save-every", str(args.eval_every)]


def compare_part(args: argparse.Namespace, folder: Path, methods: list[str], figures: Folder | None) -> dict:
    """compare (and readings, in its own folder): the training runs and the table; with `figures`, the
    curves, accuracy against cost and tokens, and the collapse map of the first seed."""
    seeds = [int(s) for s in args.seeds.split(",")]
    table = compare(folder, methods, seeds, comparison_flags(args), args.per_level or None,
                    args.max_new_tokens, args.resamples, args.jobs)
    if figures:
        runs_by_method = {m: [run_dir(folder, m, s) for s in seeds] for m in methods}
        title = f"{args.model} on arith-mix, B={args.prompts_per_step}, G={args.group_size}, seeds {seeds}"
        plot_compare_curves(runs_by_method, figures, "compare.png", title)
        plot_accuracy_vs_compute(table, figures, "compare_accuracy.png", title)
        plot_accuracy_vs_tokens(table, figures, "compare_learning.png",
                                f"{title}: {args.eval_size} held-out problems, mean and range of the seeds")
        plot_collapse_map({m: runs[0] for m, runs in runs_by_method.items()}, figures, "collapse_map.png",
                          f"{args.model} on arith-mix, B={args.prompts_per_step}, G={args.group_size}, "
                          f"seed {seeds[0]}")
    return table


def lora_part(args: argparse.Namespace, folder: Path) -> dict:
    """The lora part: each arm's learning rate from its sweep on --sweep-seed (`pick_lr`), then the arms on
    --seeds at those rates, compared as compare does, with full fine-tuning as the baseline."""
    flags, per_level, seed = comparison_flags(args), args.per_level or None, args.sweep_seed
    sweep = sweep_runs(args, folder)
    for run in sweep.values():  # before any run starts
        check_run(*run)
    tasks = [(train_and_score, run, held_out(seed, per_level), args.max_new_tokens) for run in sweep.values()]
    accuracy = {arm: {} for arm in LORA}
    for (arm, lr), records in zip(sweep, run_all(tasks, args.jobs)):
        accuracy[arm][lr] = float(np.mean([r["correct"] for r in records]))
    chosen = {arm: pick_lr(accuracy[arm]) for arm in LORA}
    table = compare(folder, list(LORA), [int(s) for s in args.seeds.split(",")], flags, per_level,
                    args.max_new_tokens, args.resamples, args.jobs, baseline=LORA[0],
                    extra={arm: ["--lr", lr] for arm, lr in chosen.items()})
    for arm, row in table.items():
        seconds = row["cost"]["seconds"]
        row["lr"], row["seconds_per_step"] = chosen[arm], {"mean": seconds["mean"] / args.steps,
                                                          "ci": [x / args.steps for x in seconds["ci"]]}
        row["verdict"] = None if arm == LORA[0] else verdict(row["delta"], MARGIN)
    return {"sweep": {"seed": seed, "accuracy": accuracy, "chosen": chosen,
                      "rule": "per arm, the learning rate whose final model is the most accurate (greedy, on "
                              "the sweep seed's whole held-out split); the smaller on a tie"},
            "margin": MARGIN, "arms": table}


def lr_grid(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each arm of the lora part: the learning rates its sweep tries."""
    return {arm: lr_list(args.full_lrs if arm == LORA[0] else args.lora_lrs) for arm in LORA}


def sweep_runs(args: argparse.Namespace, folder: Path) -> dict[tuple[str, str], Run]:
    """The lora part's sweep on --sweep-seed: (arm, lr) -> its run
    (<folder>/sweep/lr2e-05/seed100-full-ft/grpo, say)."""
    flags, seed = comparison_flags(args), args.sweep_seed
    sweep = {(arm, lr): method_runs(folder / "sweep" / f"lr{lr}", [arm], [seed], flags + ["--lr", lr])
             for arm, lrs in lr_grid(args).items() for lr in lrs}
    return {(arm, lr): runs[arm, seed] for (arm, lr), runs in sweep.items()}


def lr_list(text: str) -> list[str]:
    """A comma list of learning rates, each written as train.py's config.json records it (2e-05)."""
    return [f"{float(x):g}" for x in text.split(",")]


def pick_lr(accuracy: dict[str, float]) -> str:
    """The learning rate with the most accurate final model; the smaller of those that tie."""
    return max(sorted(accuracy, key=float), key=accuracy.__getitem__)  # max keeps the first of a tie


def lora_table(result: dict) -> str:
    """arm | learning rate (the sweep's accuracies) | accuracy | Δ vs full fine-tuning | raw ACR | s/step |
    verdict on "matches"."""
    lines = [f"| arm | lr (sweep: lr accuracy) | accuracy [95% CI] | Δ vs {LORA[0]} [95% CI] | raw ACR | "
             f"s/step | matches (±{result['margin'] * 100:g} points) |", "|---|---|---|---|---|---|---|"]
    for arm, row in result["arms"].items():
        sweep = ", ".join(f"{lr} {a:.3f}" for lr, a in result["sweep"]["accuracy"][arm].items())
        lines.append(f"| {arm} | {row['lr']} ({sweep}) | {with_ci(row['accuracy'])} | "
                     f"{'-' if arm == LORA[0] else with_ci(row['delta'], '+')} | "
                     f"{row['collapse']['acr']['mean']:.2f} | {row['seconds_per_step']['mean']:.1f} | "
                     f"{row['verdict'] or '-'} |")
    return "\n".join(lines)


def scatter_part(args: argparse.Namespace, folder: Path, figures: Folder) -> dict:
    """The early-ACR scatter's GRPO runs, the fit and its figure."""
    result = scatter(scatter_runs(args, folder), args.scatter_levels.split(","), args.resamples, args.jobs)
    plot_early_acr_scatter(result, figures, "early_acr_vs_accuracy.png")
    return result


def precision_part(args: argparse.Namespace, folder: Path, figures: Folder) -> dict:
    """The default run in bf16 and fp32, and its figure."""
    result = precision(precision_runs(args, folder), args.jobs)
    seeds = [int(s) for s in args.precision_seeds.split(",")]
    plot_precision_curves({name: [Path(run) for run in result[name]["runs"]] for name in PRECISIONS}, figures,
                          "precision.png", f"{args.model}, the default run, seeds {seeds}")
    return result


def print_results(results: dict, parts: list[str]) -> None:
    """The tables and fits of the parts that ran."""
    for part in ("compare", "readings", "lora"):
        if part in parts:
            print(f"\n{part}:\n" + results[f"{part}_table"])
    if "precision" in parts:
        for name, row in results["precision"].items():
            print(f"\n{name}: held-out accuracy {np.mean(row['acc_before']):.3f} -> "
                  f"{np.mean(row['acc_after']):.3f} "
                  f"(per seed {row['acc_after']}), {row['cost']['seconds']['mean']:.0f} s of steps a run")
    if "scatter" in parts:
        s = results["scatter"]
        print(f"\nearly ACR vs accuracy over {len(s['runs'])} runs: slope {s['slope']:.2f} {s['slope_ci']}, "
              f"R² {s['r2']:.2f} {s['r2_ci']}")


def planned_runs(args: argparse.Namespace, parts: list[str]) -> list[Run]:
    """Every training run of the parts asked for; the lora part's arms at every rate of their grids (its
    sweep picks one only later)."""
    out, seeds, flags = Path(args.out), [int(s) for s in args.seeds.split(",")], comparison_flags(args)
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
        runs += [run for arm, lrs in lr_grid(args).items() for lr in lrs
                 for run in method_runs(out / "lora", [arm], seeds, flags, {arm: ["--lr", lr]}).values()]
    return runs


def check_before_any_run(args: argparse.Namespace, parts: list[str]) -> None:
    """A RunFolderError in one line, before any run starts and before anything is written, where a run would
    fail part-way through the experiment: train.py refuses a run's flags (its own parser and checks:
    `train.parse_args`, a seed past torch's range, say), or a folder experiments.py writes cannot be written
    (read-only, or another user's; one still to be made: the folder it would be made in)."""
    runs = planned_runs(args, parts)
    for run in runs:
        check_flags(*run)
    figures = Path(args.figures) if args.figures else Path(args.out) / "figures"
    written = [Path(args.out), figures, *(p for out, _, algo, _ in runs for p in (out, out / algo))]
    for folder in dict.fromkeys(written):
        where = next(p for p in [folder, *folder.parents] if p.exists())
        if not os.access(where, os.W_OK | os.X_OK):  # as root: only a read-only mount (EROFS) refuses
            raise RunFolderError(f"{where}: experiments.py cannot write there (read-only, or another "
                                 "user's), and would fail part-way: make it writable, or choose another "
                                 "--out or --figures; no run started")


def check_flags(out: Path, seed: int, algo: str, flags: list[str]) -> None:
    """A RunFolderError naming the run (`Run`) when train.py would refuse its flags: train.py's own parser and
    checks (`train.parse_args`), whose error is then this one line, not train.py's exit."""
    parser = dataclass_parser(train.Args, "train.py")

    def refuse(message: str):
        raise RunFolderError(f"{out / algo}: train.py refuses this run's flags ({message}): no run started")

    parser.error = refuse
    train.parse_args(train_argv(out, seed, algo, flags), parser)


def main(argv: list[str] | None = None) -> dict:
    """Ctrl-C or SIGTERM stops it at once, in one line: no run starts after it, the runs under way save their
    step (`run_all`), and the same command goes on from there. A filesystem failure at a write (a full disk)
    is one line too, as in train.py."""
    args = parse_args(argv)
    parts = args.only.split(",")
    print_estimate(args, parts)
    if "compare" in parts:
        print_interval_plan(args)
    if args.dry_run:
        return {}
    try:
        with on_stop_signals(stop_handler()):
            check_before_any_run(args, parts)
            with owned(Path(args.out), "experiments") as out, ExitStack() as stack:
                apart = args.figures and Path(args.figures).resolve() != out.path.resolve()
                figures = (stack.enter_context(owned(Path(args.figures), "experiments")) if apart
                           else out if args.figures else out.subfolder("figures", "experiments"))
                return run_parts(args, parts, out, figures)
    except (NotWritten, RunFolderError, OSError) as e:
        sys.exit(f"error: {e}")
    except Stopped as stop:
        print(f"experiments.py: stopped by {stop}: no run started after it, and each run under way kept its "
              "last saved step; the same command goes on from there", file=sys.stderr)
        sys.exit(128 + stop.signum)


def run_parts(args: argparse.Namespace, parts: list[str], out: Folder, figures: Folder) -> dict:
    """The parts asked for, each in its own folder of `out`; their numbers merged into the figures' folder's
    results.json. What would be refused there (a user's file, a damaged results.json) is, before any run."""
    for folder in (out, figures):
        folder.remove_temporaries()  # what a write killed part-way left
    for name in [RESULTS, *(f for part in parts for f in FIGURES.get(part, ()))]:
        figures.now(name)  # NotWritten: not ours
    results = {}
    if figures.ours(RESULTS):
        try:
            results = json.loads((figures.path / RESULTS).read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RunFolderError(f"{figures.path / RESULTS} is not JSON ({e}): restore it, or choose another "
                                 "--figures") from None
        if not isinstance(results, dict):
            raise RunFolderError(f"{figures.path / RESULTS} holds a {type(results).__name__}, not results: "
                                 "restore it, or choose another --figures")
    results["scale"] = {k: v for k, v in vars(args).items() if k not in ("out", "figures", "only")}
    if "difficulty" in parts:
        results["difficulty"] = acr_by_difficulty(args.model, args.difficulty_prompts, 8, args.max_new_tokens)
        plot_difficulty(results["difficulty"], figures, "acr_vs_difficulty.png", f"{args.model}, G=8, T=1")
    for part, methods, drawn in (("compare", args.methods, figures), ("readings", args.readings, None)):
        if part in parts:  # readings: GRPO rerun beside AVSPO's readings, on this machine (the docstring)
            folder = out.subfolder(part, "experiments").path
            results[part] = compare_part(args, folder, methods.split(","), drawn)
            results[f"{part}_table"] = markdown_table(results[part])
    if "scatter" in parts:
        results["scatter"] = scatter_part(args, out.subfolder("scatter", "experiments").path, figures)
    if "precision" in parts:
        results["precision"] = precision_part(args, out.subfolder("precision", "experiments").path, figures)
    if "lora" in parts:
        results["lora"] = lora_part(args, out.subfolder("lora", "experiments").path)
        results["lora_table"] = lora_table(results["lora"])
    figures.write(RESULTS, json.dumps(results, indent=2))
    print_results(results, parts)
    print(f"results: {figures.path / RESULTS}\nfigures: {figures.path}")
    return results


if __name__ == "__main__":
    main()
