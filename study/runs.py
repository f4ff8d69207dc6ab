"""The study's train.py runs: where each run goes, whether a finished or stopped one may be reused (its flags,
its files as train.py wrote them), training it, and its final model's per-problem evaluation; and the
difficulty part's sampling with the untrained model, as train.py samples."""

import dataclasses
import json
import platform
from pathlib import Path

import torch
from tqdm import tqdm

import train
from advantage import advantage_collapse_rate
from data.tasks import by_level, changed_data, held_out_problems, load_problems
from eval import evaluate, score_groups
from infra.flags import dataclass_parser
from infra.hardware import cpu_features, pick_device, working_copy
from infra.records import plain_bytes
from infra.written import owned
from loop.processes import STOP_SIGNALS
from loop.run import fast_or_plain
from loop.run_folder import RunFolderError, find_checkpoint, read_jsonl, saved_config
from model import load_model, sample
from study.flags import METHODS
from study.workers import Stopped
from verifier import load_reward

Run = tuple[Path, int, str, list[str]]  # a training run: train.py's --out, --seed, --algo and its other flags


def run_training(run: Run) -> None:
    """train.py's run <out>/<algo> (`check_run` allowed it), unless it is finished: one that stopped part-way
    goes on from its checkpoint (--resume; steps depend on seed and step alone), one stopped before its first
    checkpoint (or with --save-every 0) starts again (--overwrite: --resume refuses it). Stopped by a signal,
    saved, it raises Stopped."""
    out, seed, algo, flags = run
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


def run_args(run: Run) -> train.Args:
    """The settings train.py would give a run (`Run`), its flags parsed but not checked (`check_flags`)."""
    return train.Args(**vars(dataclass_parser(train.Args, "").parse_args(train_argv(*run))))


SUMMARY_LIMIT = 2**20  # bytes: train.py's summary.json is a few hundred


def finished(run: Path) -> bool:
    """Whether train.py finished the run: its summary.json is whole (a run killed while writing it is not), a
    plain file read no further than SUMMARY_LIMIT (`plain_bytes`: a FIFO or a device there is not one)."""
    try:
        return isinstance(json.loads(plain_bytes(run / "summary.json", SUMMARY_LIMIT) or b""), dict)
    except ValueError:  # not JSON, not UTF-8, an over-long integer
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
    asked, default = (json.loads(json.dumps(config)) for config in  # as config.json holds them
                      (dataclasses.asdict(run_args((out, seed, algo, flags))),
                       {f.name: f.default for f in dataclasses.fields(train.Args)}))
    if changed := [f"--{key.replace('_', '-')} {saved.get(key, default[key])} (asked: {value})"
                   for key, value in asked.items()
                   if key not in HOW_RUN and saved.get(key, default[key]) != value]:  # newer flag: default
        raise RunFolderError(f"{run} was trained with {', '.join(changed)} (its config.json): ask for the "
                             "flags it was trained with, or choose another --out")
    if data := changed_data(saved.get("data_sha256", {}), asked["dataset"], asked["eval_dataset"]):
        raise RunFolderError(f"{run}: {data}: restore it, or move {run} away to train it again, or choose "
                             "another --out")


def as_written(folder: Path, kind: str, names: tuple[str, ...]) -> None:
    """NotWritten, one line naming the file, unless each of `names` in `folder` is absent or as the script
    that wrote it left it (the folder's record): the study uses no other."""
    with owned(folder, kind) as files:
        for name in names:
            files.now(name)


def check_flags(out: Path, seed: int, algo: str, flags: list[str]) -> None:
    """A RunFolderError naming the run (`Run`) when train.py would refuse its flags: train.py's own parser and
    checks (`train.parse_args`), whose error is then this one line, not train.py's exit."""
    parser = dataclass_parser(train.Args, "train.py")

    def refuse(message: str):
        raise RunFolderError(f"{out / algo}: train.py refuses this run's flags ({message}): no run started")

    parser.error = refuse
    train.parse_args(train_argv(out, seed, algo, flags), parser)


def machine() -> dict:
    """The CPU that trains a run (its model name and matmul flags), and torch's version and threads: bf16
    kernels round differently per CPU, so a run repeats token for token only on the same kind of CPU."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    return {"cpu": names[0] if names else platform.processor(), "cpu_features": sorted(cpu_features()),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


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


def train_and_score(run: Run, problems: list) -> list[dict]:
    """Train one run, then its final model's per-problem records on `problems`."""
    run_training(run)
    out, _, algo, _ = run
    return final_records(out / algo, problems)


def held_out(config: train.Args, seed: int, per_level: int | None) -> list:
    """The held-out problems train.py evaluates a run of `config` on, for this seed (its --eval-dataset, else
    the test split of its --dataset), or their first `per_level` problems of each level (`by_level`)."""
    problems = held_out_problems(config.dataset, config.eval_dataset, seed)
    if per_level is None:
        return problems
    return [p for problems_of_level in by_level(problems).values() for p in problems_of_level[:per_level]]


def run_config(run: Path) -> train.Args:
    """The settings a finished run was trained with (its config.json; a newer field, its default)."""
    saved = saved_config(run)
    return train.Args(**{f.name: tuple(saved[f.name]) if isinstance(f.default, tuple) else saved[f.name]
                         for f in dataclasses.fields(train.Args) if f.name in saved})


def final_records(run: Path, problems: list) -> list[dict]:
    """Per-problem correctness of the run's final model (greedy, deterministic): train.py's last evaluation
    when it covered these problems (--eval-size as large as the held-out split), else the final checkpoint
    evaluated once, as train.py evaluates (its device, precision, prompts, reward and sampling path), and
    cached beside the run, in <out>/final_eval.jsonl (train.py's --out, which holds this run alone)."""
    if [r["question"] for r in read_jsonl(run / "eval_records.jsonl")] == [p.question for p in problems]:
        return read_jsonl(run / "eval_records.jsonl")
    cache = run.parent / "final_eval.jsonl"
    # absent, or other problems
    if [r["question"] for r in read_jsonl(cache)] != [p.question for p in problems]:
        config = run_config(run)
        device = pick_device(config.device)
        model, tokenizer = load_model(str(run / "checkpoint"), device)
        net = working_copy(model, config.precision)  # the network train.py evaluates: the same greedy answers
        result = evaluate(net, tokenizer, problems, max_new_tokens=config.max_new_tokens,
                          reward_fn=load_reward(config.reward, config.reward_range, config.reward_timeout),
                          prompt_format=config.prompt_format, system=config.system,
                          sample_completions=fast_or_plain(config.fast, device).sample_completions)
        keep = ("question", "level", "gold", "extracted", "correct")
        with owned(run.parent, "runs") as runs:
            runs.remove_temporaries()
            runs.write(cache.name, "".join(json.dumps({k: r[k] for k in keep}) + "\n"
                                           for r in result["records"]))
    return read_jsonl(cache)


def seed_cpus(folder: Path, methods: list[str], seed: int) -> set[str]:
    """The CPUs that trained this seed's runs, from their machines.jsonl (none for runs made before it)."""
    return {line["cpu"] for method in methods
            for line in read_jsonl(run_dir(folder, method, seed).parent / "machines.jsonl")}


def acr_by_difficulty(config: train.Args, prompts: int, group_size: int, batch: int = 8) -> dict:
    """The untrained model's collapse at each level of the runs' training data: G completions for the first
    `prompts` problems of each level (`by_level`: a file without levels is one), sampled and scored as
    train.py does (`config`: its model, precision, prompts, temperature, reward); "mix": the levels pooled
    in equal shares, the batch ACR of training on all of them at once."""
    device = pick_device(config.device)
    model, tokenizer = load_model(config.model, device)
    net, (low, high) = working_copy(model, config.precision), config.reward_range
    reward = load_reward(config.reward, config.reward_range, config.reward_timeout)
    sample_completions = fast_or_plain(config.fast, device).sample_completions
    torch.manual_seed(0)
    result, pooled = {}, []
    levels = by_level(load_problems(config.dataset, "train"))
    for level, problems in levels.items():
        rewards = []
        for i in tqdm(range(0, len(problems[:prompts]), batch), desc=level):
            chunk = problems[i : min(i + batch, prompts)]
            rollout = sample(net, tokenizer, [p.question for p in chunk], group_size, config.max_new_tokens,
                             config.temperature, config.top_p, sample_completions, config.prompt_format,
                             config.system, [p.instruction for p in chunk])
            rewards.append(torch.tensor(score_groups([p.question for p in chunk], rollout.texts,
                                                     [p.answer for p in chunk], reward)))
        pooled.append(torch.cat(rewards))  # [prompts, G]
    names = [*levels, "mix"] if len(levels) > 1 else [*levels]
    for level, r in zip(names, [*pooled, torch.cat(pooled)]):
        result[level] = {"accuracy": r.mean().item(), "acr": advantage_collapse_rate(r),
                         "all_correct_frac": (r.amin(1) == high).float().mean().item(),
                         "all_wrong_frac": (r.amax(1) == low).float().mean().item(), "prompts": len(r)}
    return result
