"""Evaluate models on math problems with the same prompts and verifier as training.

    python eval.py --model smollm2-135m runs/default/grpo/checkpoint --dataset arith-mul1
    python eval.py --model smollm2-135m --dataset data/downloads/gsm8k_test.jsonl --limit 100 --samples 8
    (data/downloads/: `python data/prepare.py gsm8k` fetches GSM8K there, `math` MATH-500)

Greedy pass@1 by default; with --samples n, n completions per problem at --temperature give mean@n
and the unbiased pass@k estimator 1 - C(n - c, k) / C(n, k) (Chen et al. 2021, Eq. 1) for k <= n.
"""

import argparse
import json
import math
import os
import re
import sys
from math import comb
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import transformers
from tqdm import tqdm

from data.tasks import Problem, load_eval_problems
from fast.decoding import FAST_ON, decode
from infra.flags import FlagParser, at_least, folder, in_range
from infra.hardware import DEVICES, pick_device, resident_bytes, where, working_copy
from infra.memory import context_warning, describe_estimate, estimate_memory, longest_prompt, parameter_counts
from infra.written import NotWritten, owned
from model import (PROMPT_FORMATS, load_config, load_model, load_tokenizer, sample, sample_with_generate,
                   stop_token_ids)
from verifier import REWARD_TIMEOUT, Reward, extract_answer, load_reward, per_completion, reward_range, verify


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n - c, k) / C(n, k).

    >>> pass_at_k(4, 1, 1), pass_at_k(4, 1, 2), pass_at_k(4, 0, 4), pass_at_k(4, 1, 4)
    (0.25, 0.5, 0.0, 1.0)
    """
    if not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 < k <= n; got k={k}, n={n}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def score_groups(questions: list[str], texts: list[str], answers: list[str],
                 reward_fn: Reward) -> list[list[float]]:
    """Rewards [b][n] of b*n completions, n in a row per question: one reward call for the whole batch, the
    same scoring for training and evaluation (`verifier.load_reward`)."""
    n = len(texts) // len(answers)
    flat = reward_fn([q for q in questions for _ in range(n)], texts, [a for a in answers for _ in range(n)])
    return [flat[i * n : (i + 1) * n] for i in range(len(answers))]


@torch.no_grad()
def evaluate(model, tokenizer, problems: list[Problem], *, max_new_tokens: int, samples: int = 1,
             temperature: float = 0.0, batch_size: int = 32, progress: bool = False,
             reward_fn: Reward = per_completion(verify), sample_completions: Callable = sample_with_generate,
             prompt_format: str = "chat", system: str = "", stop_ids: list[int] | None = None) -> dict:
    """Accuracy of `model` on `problems` (reward 1 = correct): greedy when samples == 1 and temperature == 0.
    Prompts and completions as in training (`model.sample`): completion ids from `sample_completions` (HF
    generate, or the decoding loop), prompts in `prompt_format` with the `system` message, completions ending
    at `stop_ids` (`model.stop_token_ids`, worked out once by the caller; None: at each batch).

    Returns accuracy (mean over all completions: pass@1 greedy, mean@n sampled), the same per level for
    problems that have one (arith-mix), pass@k for k = 1, 2, 4, .. up to n, and one record per completion.
    """
    if samples > 1 and temperature == 0:
        raise ValueError("several samples per problem need a temperature > 0")
    records, correct_per_problem = [], []
    starts = range(0, len(problems), batch_size)
    for start in tqdm(starts, desc="eval", disable=not progress, leave=False):
        batch = problems[start : start + batch_size]
        rollout = sample(model, tokenizer, [p.question for p in batch], samples, max_new_tokens, temperature,
                         sample_completions=sample_completions, prompt_format=prompt_format, system=system,
                         instructions=[p.instruction for p in batch], stop_ids=stop_ids)
        batch_scores = score_groups([p.question for p in batch], rollout.texts, [p.answer for p in batch],
                                    reward_fn)  # [b][n]
        for i, (problem, scores) in enumerate(zip(batch, batch_scores)):
            texts = rollout.texts[i * samples : (i + 1) * samples]
            correct_per_problem.append(sum(score == 1 for score in scores))
            records += [{"question": problem.question, "level": problem.level, "completion": text,
                         "extracted": extract_answer(text), "gold": problem.answer, "reward": s,
                         "correct": s == 1} for text, s in zip(texts, scores)]
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k < samples] + [samples]
    levels = sorted({r["level"] for r in records if r["level"]}, key=[r["level"] for r in records].index)
    return {
        "accuracy": float(np.mean([r["correct"] for r in records])) if records else 0.0,
        "accuracy_by_level": {lv: float(np.mean([r["correct"] for r in records if r["level"] == lv]))
                              for lv in levels},
        "pass_at_k": {k: float(np.mean([pass_at_k(samples, c, k) for c in correct_per_problem])) for k in ks},
        "problems": len(problems), "samples": samples, "records": records,
    }


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name.strip("/")).strip("_")[-80:]


def print_table(results: dict, dataset: str, problems: int, temperature: float, samples: int) -> None:
    """One column per model: pass@1 or mean@n, per level, and pass@k."""
    ks = list(next(iter(results.values()))["pass_at_k"])
    label = "pass@1 (greedy)" if samples == 1 else f"mean@{samples}"
    width = max(len(label), *(len(k) for k in [f"pass@{k}" for k in ks]))
    print(f"\n{dataset}: {problems} problems, T={temperature}")
    print(f"{'':{width}}" + "".join(f"  {name[-28:]:>28}" for name in results))
    print(f"{label:{width}}" + "".join(f"  {r['accuracy']:28.3f}" for r in results.values()))
    for level in next(iter(results.values()))["accuracy_by_level"]:
        print(f"{'  ' + level:{width}}"
              + "".join(f"  {r['accuracy_by_level'][level]:28.3f}" for r in results.values()))
    if samples > 1:
        for k in ks:
            print(f"{'pass@' + str(k):{width}}"
                  + "".join(f"  {r['pass_at_k'][k]:28.3f}" for r in results.values()))


def result_files(models: list[str]) -> list[str]:
    """The files --out receives: each model's completions, one JSON line each, and summary.json, last."""
    return [f"samples-{slug(name)}.jsonl" for name in models] + ["summary.json"]


def check_out(args: argparse.Namespace) -> None:
    """--out, before any model loads: a folder eval.py may write (not a run folder, not a user's), where each
    of `result_files` is absent or eval.py's own; else NotWritten, naming it. A new folder is made at the end
    (`write_results`)."""
    if args.out and os.path.lexists(args.out):
        with owned(Path(args.out), "eval") as out:
            for name in result_files(args.model):
                out.now(name)


def write_results(out: Path, summary: dict, results: dict, dataset: str, temperature: float) -> None:
    """`result_files` in `out`, the new results whole beside no old summary.json. Each file is first written
    whole to a temporary (`written.Folder.write` to a `fresh` name), so that a full disk leaves the last
    results as they were; only then is the old summary.json removed, the samples renamed into place and the
    new summary.json last. A kill at any moment thus leaves either a summary.json with the samples it
    describes, or none (never an old one beside new samples), and temporaries the record names, which the
    next eval.py into `out` removes before it writes."""
    names = result_files(list(results))
    texts = ["".join(json.dumps(rec) + "\n" for rec in r["records"]) for r in results.values()]
    texts.append(json.dumps({"dataset": dataset, "temperature": temperature, "models": summary}, indent=2))
    try:
        with owned(out, "eval") as folder:
            folder.remove_temporaries()  # what an eval.py killed while writing left
            for name in names:  # each still eval.py's own (`check_out`), before any is replaced
                folder.now(name)
            try:
                staged = [folder.write(folder.fresh(name), text).name for name, text in zip(names, texts)]
                folder.remove("summary.json")
                for tmp, name in zip(staged, names):
                    folder.rename(tmp, name)
            except OSError:
                folder.remove_temporaries()
                raise
    except NotWritten as e:  # changed since `check_out`
        sys.exit(f"error: {e}")
    except OSError as e:  # a full disk, a read-only folder: the table above is the result
        sys.exit(f"error: the results could not be written to {out} ({e.strerror or e}); the table above "
                 "holds them")
    print(f"wrote {out / 'summary.json'} and {len(names) - 1} samples-*.jsonl beside it")


def where_it_runs(args: argparse.Namespace, model, net, prompt_len: int, problems: int,
                  runtime: int = 0) -> str:
    """The first line of a model's evaluation, as train.py's (`run.where_it_runs`): the device, the precision
    and dtypes, and the memory it should need (infra/memory.py, sampling alone: one generate call's rows;
    `runtime`, the process's bytes before the model loaded)."""
    own, adapters = parameter_counts(model)
    terms = estimate_memory(model.config, own, rows=min(args.batch_size, problems) * args.samples,
                            prompt_len=prompt_len, completion_len=args.max_new_tokens, micro_batch=0,
                            bf16=net.dtype == torch.bfloat16, reference=False, checkpointing=False,
                            cuda=model.device.type == "cuda", lora_params=adapters, training=False,
                            runtime=runtime)
    return f"{where(model, net, args.precision)}; {describe_estimate(terms)}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; bad values, and a bad combination, stop here in one line, before any model loads."""
    p = FlagParser(description="Evaluate one or more models with the training verifier.")
    p.add_argument("--model", nargs="+", default=["smollm2-135m"],
                   help="aliases, hub ids, folders or checkpoints")
    p.add_argument("--dataset", default="arith-mul1",
                   help="arith-<level> or arith-mix (test split), or a GSM8K/MATH .jsonl")
    p.add_argument("--reward", default="verifier",
                   help="verifier, math-verify, or module:function (as train.py)")
    p.add_argument("--reward-range", type=reward_range, default=(0.0, 1.0),
                   help="lo,hi: the rewards' range (else it stops); correct means a reward of 1")
    p.add_argument("--reward-timeout", type=in_range(0, math.inf), default=REWARD_TIMEOUT,
                   help="seconds a reward call may take (not the verifier's), else it scores 0 (0: no limit)")
    p.add_argument("--limit", type=at_least(0), default=0, help="evaluate only the first N problems (0: all)")
    p.add_argument("--samples", type=at_least(1), default=1,
                   help="completions per problem (n); >1 samples at --temperature")
    p.add_argument("--temperature", type=in_range(0, math.inf), default=None,
                   help="default: 0 (greedy) for 1 sample, else 1.0")
    p.add_argument("--max-new-tokens", type=at_least(1), default=256, help="completion length limit")
    p.add_argument("--batch-size", type=at_least(1), default=32, help="prompts per generate call")
    p.add_argument("--out", type=folder, default=None,
                   help="folder for summary.json and per-model samples JSONL")
    p.add_argument("--seed", type=at_least(-2**63, 2**64 - 1), default=0,  # torch.manual_seed's range
                   help="sampling seed")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                   help="auto: bf16 where the GPU or CPU has it natively (as train.py), else fp32")
    p.add_argument("--prompt-format", default="chat", choices=PROMPT_FORMATS,
                   help="chat (the tokenizer's chat template), raw (plain text: base models), as train.py")
    p.add_argument("--system", default="",
                   help="system message of every chat prompt; empty: the chat template's own")
    p.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True,
                   help="sample with the fast decoding loop (fast/decoding.py) where verified (CPU; on CUDA "
                        "not yet, as train.py); --no-fast: with HF generate")
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="auto (CUDA if usable, else CPU), cpu, cuda")
    args = p.parse_args(argv)
    if args.temperature is None:
        args.temperature = 0.0 if args.samples == 1 else 1.0
    if args.samples > 1 and args.temperature == 0:
        p.error(f"--samples {args.samples} needs --temperature > 0 (greedy gives one completion)")
    writers = {}  # result file, casefolded (one file on a case-insensitive disk), -> the model that writes it
    for name, file in zip(args.model, result_files(args.model)):
        if name in writers.values():  # the table and summary.json name each model once
            p.error(f"--model {name} is given twice")
        if args.out and (other := writers.get(file.casefold())):
            p.error(f"--model {other} and {name} would both write {file}: evaluate them into two --out "
                    "folders")
        writers[file.casefold()] = name
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    try:
        check_out(args)
        device = pick_device(args.device)  # --device cuda where CUDA is unusable: one line, before any model
        reward_fn = load_reward(args.reward, args.reward_range, args.reward_timeout)
        problems = load_eval_problems(args.dataset)
        problems = problems[: args.limit] if args.limit else problems
        prompt_lens = {}  # each model's tokenizer and config alone: a missing chat template, or a prompt past
        for name in args.model:  # the model's context, is refused before any model loads
            prompt_lens[name] = longest_prompt(load_config(name), load_tokenizer(name), problems,
                                               args.prompt_format, args.system)
        transformers.logging.disable_progress_bar()  # tqdm's bar of the evaluation alone, as in train.py
        results, runtime = {}, resident_bytes()  # before any model: the estimate's runtime
        for name in args.model:
            model, tokenizer = load_model(name, device)
            if warning := context_warning(model.config, prompt_lens[name], args.max_new_tokens):
                print(f"{name}: {warning}", file=sys.stderr)
            net = working_copy(model, args.precision)  # the network train.py samples from
            first_line = where_it_runs(args, model, net, prompt_lens[name], len(problems), runtime)
            print(f"[eval {name}] {first_line}")
            torch.manual_seed(args.seed)
            results[name] = evaluate(net, tokenizer, problems, max_new_tokens=args.max_new_tokens,
                                     samples=args.samples, temperature=args.temperature,
                                     batch_size=args.batch_size, progress=True, reward_fn=reward_fn,
                                     sample_completions=decode if args.fast and device.type in FAST_ON
                                     else sample_with_generate,  # as run.fast_or_plain chooses
                                     prompt_format=args.prompt_format, system=args.system,
                                     stop_ids=stop_token_ids(model, tokenizer))
    except (FileNotFoundError, ValueError, ImportError, NotWritten) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # nothing is written until every model is evaluated
        print("\neval.py: interrupted, nothing written", file=sys.stderr)
        sys.exit(130)

    print_table(results, args.dataset, len(problems), args.temperature, args.samples)
    keys = ("accuracy", "accuracy_by_level", "pass_at_k", "problems", "samples")
    summary = {name: {key: r[key] for key in keys} for name, r in results.items()}
    if args.out:
        write_results(Path(args.out), summary, results, args.dataset, args.temperature)
    return summary


if __name__ == "__main__":
    main()
