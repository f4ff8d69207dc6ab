"""A run of one algorithm: its setup (models, optimizer, method state, problems; new or resumed), the --fast
choice, its first line (where it runs), and what follows each step (logs, checkpoints, evaluations).

Nothing here knows about GRPO, AVSPO or AAPO: a method's state reaches a checkpoint as a dict of dataclasses,
and is rebuilt with the same classes on resume.
"""

import contextlib
import dataclasses
import math
import os
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Callable, ContextManager, NamedTuple

import torch
import torch.nn.functional as F
import transformers
from tqdm import tqdm

from data.tasks import Problem, held_out_problems, load_problems
from eval import evaluate, score_groups
from fast import packing
from fast.decoding import FAST_ON, decode
from infra.hardware import (SamplingOutOfMemory, cast_weights, device_memory_bytes, pick_device,
                            resident_bytes, where, working_copy)
from infra.lora import (adapter_folder, adapters_off, add_adapters, base_identity, base_of, check_rank,
                        checked_adapters, merged)
from infra.memory import (context_warning, describe_estimate, estimate_memory, fits_warning, longest_prompt,
                          parameter_counts, sampled_rows, short_enough)
from infra.model_files import tiny_qwen2
from infra.written import Folder
from loop.metrics import collapse_warning, early_steps, show_group
from loop.processes import StoppedWhileScoring, bad_input_is_one_line, gather_groups, stops_at_once
from loop.run_folder import (append_jsonl, checkpoint_damage, find_checkpoint, log_eval, log_step,
                             read_jsonl, restore_checkpoint, save_checkpoint, stopped_line)
from model import (Rollout, checkpoint_activations, completion_logprobs, format_prompts, from_source,
                   load_model, load_tokenizer, sample, sample_with_generate, stop_token_ids)
from verifier import RewardError, load_reward


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


def check_inputs(args) -> None:
    """What a run of train.Args `args` reads, read before any model loads, so that a bad line or flag fails in
    a second, naming file and line: the device (--device cuda where CUDA is unusable says why), the reward,
    the problems, the tokenizer alone (a missing chat template), a LoRA checkpoint's adapters (damaged, or
    of another base) and the model's shapes alone (a --lora-rank above a layer's width)."""
    pick_device(args.device)
    load_reward(args.reward)
    load_problems(args.dataset, "train", args.seed)
    held_out_problems(args.dataset, args.eval_dataset, args.seed)
    format_prompts(load_tokenizer(args.model), ["1 + 1?"], args.prompt_format, args.system)
    if adapters := adapter_folder(args.model):  # a LoRA checkpoint: its base and its adapters' file
        checked_adapters(adapters)
    if args.lora_rank:
        check_rank(args.lora_rank, model_shapes(args.model))


def model_shapes(name: str) -> torch.nn.Module:
    """Model `name` (a LoRA checkpoint: its base) on the meta device: its layers' shapes, no weights."""
    if adapters := adapter_folder(name):
        return model_shapes(base_of(adapters))
    with torch.device("meta"), torch.random.fork_rng(devices=[]):  # tiny_qwen2 seeds the generator
        if name == "tiny-qwen2":
            return tiny_qwen2()[0]
        return transformers.AutoModelForCausalLM.from_config(from_source(transformers.AutoConfig, name))


@dataclasses.dataclass
class Run:
    """What one algorithm's run holds from step to step (`start_run`)."""

    master: torch.nn.Module  # the float32 weights the optimizer steps (LoRA: the model, its adapters float32)
    policy: torch.nn.Module  # the network that samples and backpropagates: master, or its bf16 copy
    reference: Callable[[], ContextManager] | None  # the frozen initial policy (AAPO's r_ref, the KL)
    tokenizer: object
    optimizer: torch.optim.Optimizer
    state: dict  # the method's state across steps, checkpointed
    reward_fn: Callable
    train_problems: list[Problem]
    eval_problems: list[Problem]
    done: int  # the last completed step: 0, or the checkpoint's
    costs: Counter  # this step's sampling seconds and generated tokens
    stop_ids: list[int] | None = None  # the ids that end a completion (`model.stop_token_ids`), once
    started: float = 0.0  # perf_counter before loading the model: summary.json's time_run counts from it
    rows_at_once: int = 0  # the rows sampled at once where fewer than a step's (`rows_at_once`); 0: all


@bad_input_is_one_line()  # a model, data line or prompt the run cannot use: one line, not a traceback
def start_run(args, run_dir: Path, device: torch.device, is_main: bool, state: dict,
              with_reference: bool) -> Run:
    """The models, optimizer, method state and problems of a run (train.Args `args`): new, or as saved with
    --resume."""
    started, runtime = time.perf_counter(), resident_bytes()  # before the model: the estimate's runtime
    transformers.logging.disable_progress_bar()  # the run's own bar alone: none for loading or saving weights
    checkpoint = find_checkpoint(run_dir) if args.resume else None  # `folder_problem`: a run has one
    if args.resume and not checkpoint and is_main:
        print(f"[{args.algo}] --resume: no run in {run_dir} yet, starting one")
    if checkpoint and checkpoint.name == "checkpoint.old" and (run_dir / "checkpoint").exists() and is_main:
        print(f"[{args.algo}] warning: {checkpoint_damage(run_dir / 'checkpoint')}: resuming from the whole "
              f"checkpoint before it, {checkpoint}")
    master, tokenizer = load_model(str(checkpoint / "model") if checkpoint else args.model, device)
    if not checkpoint:  # --model may be a LoRA run's checkpoint: this run starts from its policy as one model
        merged(master)
    if args.lora_rank and not checkpoint:  # resumed, the checkpoint holds the adapters (model.load_model)
        identity = base_identity(args.model)  # the checkpoints record it: loaded onto another base, refused
        add_adapters(master, args.lora_rank, args.lora_alpha, args.model, args.seed, identity)
    policy = working_copy(master, args.precision)  # bf16: on CUDA and on CPUs with native bf16 (auto)
    reference = None  # `with run.reference() as network`: the frozen initial policy
    if with_reference and args.lora_rank:
        reference = partial(adapters_off, policy)  # the base: no second copy of the weights
    elif with_reference:
        frozen = cast_weights(merged(load_model(args.model, device)[0]).requires_grad_(False), policy.dtype)
        reference = partial(contextlib.nullcontext, frozen)
    if args.grad_checkpointing:
        checkpoint_activations(policy)
    trained = [p for p in master.parameters() if p.requires_grad]  # LoRA: the adapters alone
    optimizer = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.0, fused=True)
    done = restore_checkpoint(checkpoint, optimizer, state) if checkpoint else 0
    eval_problems = held_out_problems(args.dataset, args.eval_dataset, args.seed)[: args.eval_size]
    costs = Counter()  # this step's seconds, tokens and reward calls past --reward-timeout
    reward_fn = load_reward(args.reward, args.reward_range, args.reward_timeout, costs)
    train_problems = load_problems(args.dataset, "train", args.seed)
    if args.max_prompt_tokens:
        train_problems, eval_problems = prompts_within(args, tokenizer, train_problems, eval_problems,
                                                       is_main)
    problems = train_problems + eval_problems
    if is_main:
        print(f"[{args.algo}] {where_it_runs(args, master, policy, reference, tokenizer, problems, runtime)}")
    prompt_len = longest_prompt(master.config, tokenizer, problems, args.prompt_format, args.system)
    sampled = rows_at_once(args, master, policy, reference, prompt_len, runtime)
    return Run(master, policy, reference, tokenizer, optimizer, state, reward_fn, train_problems,
               eval_problems, done, costs, stop_token_ids(master, tokenizer), started,
               sampled if sampled < step_rows(args) else 0)


def sample_and_score(args, run: Run, network, problems: list[Problem]) -> tuple[Rollout, torch.Tensor]:
    """G completions from `network` for each of these prompts, and their rewards [b, G] (train.py's
    `SampleAndScore`); the seconds each took and the tokens generated go to `run.costs`."""
    questions, answers = [p.question for p in problems], [p.answer for p in problems]
    start = time.perf_counter()
    sample_completions = fast_or_plain(args.fast, network.device).sample_completions
    if run.rows_at_once:  # fewer than a step's rows (`rows_at_once`)
        sample_completions = in_calls_of(run.rows_at_once, sample_completions)
    try:
        rollout = sample(network, run.tokenizer, questions, args.group_size, args.max_new_tokens,
                         args.temperature, args.top_p, sample_completions, args.prompt_format, args.system,
                         [p.instruction for p in problems], run.stop_ids)
    except torch.OutOfMemoryError as error:
        raise SamplingOutOfMemory(str(error)) from error
    run.costs["generate"] += time.perf_counter() - start
    run.costs["gen_tokens"] += rollout.completion_mask.sum().item()
    start = time.perf_counter()
    try:
        with stops_at_once():  # Ctrl-C here ends at once: a reward may never return, and nothing is lost yet
            rewards = torch.tensor(score_groups(questions, rollout.texts, answers, run.reward_fn))  # [b, G]
    except RewardError as error:  # under torchrun the others wait in gather_groups, which tells them
        rows = args.prompts_per_step // int(os.environ.get("WORLD_SIZE", 1))  # [b, G], as every process sends
        gather_groups(torch.full((rows, args.group_size), math.nan), error)
        raise
    run.costs["score"] += time.perf_counter() - start
    return rollout, rewards


def prompts_within(args, tokenizer, train: list[Problem], held_out: list[Problem],
                   is_main: bool) -> tuple[list[Problem], list[Problem]]:
    """The training and held-out problems whose prompts fit --max-prompt-tokens (`memory.short_enough`),
    the skipped counted in a line; none left is a ValueError, one line."""
    kept = [short_enough(tokenizer, problems, args.max_prompt_tokens, args.prompt_format, args.system)
            for problems in (train, held_out)]
    counts = [f"{len(old) - len(new)} of {len(old)} {name}" for old, new, name in zip(
        (train, held_out), kept, ("training problems", "held-out ones"))]
    if not all(kept):
        raise ValueError(f"--max-prompt-tokens {args.max_prompt_tokens} skips {' and '.join(counts)}: none "
                         "would be left to train or evaluate on; raise it")
    if is_main:
        print(f"[{args.algo}] --max-prompt-tokens {args.max_prompt_tokens}: skipped {' and '.join(counts)}, "
              "whose prompts are longer")
    return kept[0], kept[1]


def in_calls_of(rows: int, sample_completions: Callable) -> Callable:
    """`sample_completions` (`model.sample_with_generate`'s arguments) in calls of `rows` rows at most, whole
    groups, one prompt at least, their completions padded to the longest call's (after each row's stop):
    HF generate prefills every row of a call at once, so this bounds sampling's peak memory."""
    def in_calls(model, ids: torch.Tensor, mask: torch.Tensor, group_size: int, *rest) -> torch.Tensor:
        prompts, pad = max(1, rows // group_size), rest[-1]  # rest ends with pad_token_id
        calls = [sample_completions(model, ids[i : i + prompts], mask[i : i + prompts], group_size, *rest)
                 for i in range(0, len(ids), prompts)]  # each [its rows, its own C]
        width = max(c.shape[1] for c in calls)
        return torch.cat([F.pad(c, (0, width - c.shape[1]), value=pad) for c in calls])  # [N, C]
    return in_calls


def step_rows(args) -> int:
    """The completions a step samples on this process (of torchrun's WORLD_SIZE)."""
    return args.prompts_per_step * args.group_size // int(os.environ.get("WORLD_SIZE", 1))


def run_estimate(args, master, policy, reference, prompt_len: int, runtime: int, sampled: int) -> dict:
    """infra/memory.py's terms for this run's shapes, prompts of `prompt_len` tokens, `sampled` rows sampled
    at once (under LoRA, the frozen weights apart from the adapters); `runtime`, the process's bytes before
    the model loaded."""
    rows, (own, adapters) = step_rows(args), parameter_counts(master)
    return estimate_memory(master.config, own, rows=sampled, prompt_len=prompt_len,
                           completion_len=args.max_new_tokens, micro_batch=min(args.micro_batch, rows),
                           bf16=policy.dtype == torch.bfloat16, reference=reference is not None,
                           checkpointing=args.grad_checkpointing, cuda=master.device.type == "cuda",
                           lora_params=adapters, runtime=runtime)


def rows_at_once(args, master, policy, reference, prompt_len: int, runtime: int) -> int:
    """The rows a step samples at once: all of them where the estimate fits the device, else fewer whole
    groups (`memory.sampled_rows`): HF generate prefills every row it is given at once, and one long prompt
    can take a 24 GB card past its memory."""
    return sampled_rows(partial(run_estimate, args, master, policy, reference, prompt_len, runtime),
                        step_rows(args), args.group_size, device_memory_bytes(master.device))


def where_it_runs(args, master, policy, reference, tokenizer, problems: list[Problem],
                  runtime: int = 0) -> str:
    """The run's first line: the device, the precision and dtypes, and the memory it should need
    (`run_estimate`), the rows sampled at once where they are fewer than a step's (`rows_at_once`); the
    prompt length is that of the longest question of `problems` (those it trains on and those it evaluates),
    templated. A prompt longer than the model's context is refused (`memory.longest_prompt`); an estimate
    past 90% of the device's memory is a warning line before it (`memory.fits_warning`)."""
    prompt_len = longest_prompt(master.config, tokenizer, problems, args.prompt_format, args.system)
    if warning := context_warning(master.config, prompt_len, args.max_new_tokens):
        print(f"[{args.algo}] {warning}")
    rows, sampled = step_rows(args), rows_at_once(args, master, policy, reference, prompt_len, runtime)
    terms = run_estimate(args, master, policy, reference, prompt_len, runtime, sampled)
    if warning := fits_warning(terms, device_memory_bytes(master.device), prompt_len):
        print(f"[{args.algo}] {warning}")
    at_once = f" ({sampled} of a step's {rows} rows sampled at once)" if sampled < rows else ""
    return f"{where(master, policy, args.precision)}; {describe_estimate(terms)}{at_once}"


def run_eval(args, run: Run, folder: Folder, step: int) -> float:
    """Greedy held-out accuracy, logged to evals.jsonl and eval_records.jsonl."""
    start = time.perf_counter()
    result = evaluate(run.policy, run.tokenizer, run.eval_problems, reward_fn=run.reward_fn,
                      max_new_tokens=args.max_new_tokens, prompt_format=args.prompt_format,
                      system=args.system, stop_ids=run.stop_ids,
                      sample_completions=fast_or_plain(args.fast, run.policy.device).sample_completions)
    return log_eval(folder, step, result, time.perf_counter() - start)


def eval_due(args, step: int) -> bool:
    """Every --eval-every steps, and after the last."""
    return bool(args.eval_every) and step % args.eval_every == 0 or step == args.steps


def first_eval(args, run: Run, folder: Folder) -> None:
    """Before training; or, resumed, the checkpoint's evaluation if the run stopped between saving and it
    (Ctrl-C on an evaluation step skips it)."""
    if not run.done:
        print(f"[{args.algo}] held-out accuracy before training: {run_eval(args, run, folder, 0):.3f} "
              f"({len(run.eval_problems)} problems)")
        return
    evaluated = [e["step"] for e in read_jsonl(folder.path / "evals.jsonl")]
    if eval_due(args, run.done) and run.done not in evaluated:
        run_eval(args, run, folder, run.done)


def before_failed_step(args, run: Run, folder: Folder, step: int, error: Exception) -> None:
    """Process 0, when step `step` fails before its update (a RewardError, or Ctrl-C while scoring, which
    `processes.stops_at_once` raises as StoppedWhileScoring) or runs out of device memory while sampling
    (SamplingOutOfMemory): the steps before it saved, and the line said."""
    if args.save_every and step - 1 > run.done:
        save_checkpoint(folder, run.master, run.tokenizer, run.optimizer, step - 1, run.state)
    if isinstance(error, StoppedWhileScoring):
        print("\n" + stopped_line(args, folder.path, step, while_scoring=True))


def after_step(args, run: Run, folder: Folder, record: dict, totals: dict, stop: bool,
               samples: list[dict]) -> dict:
    """Process 0, after each step: log it and (--log-samples) its groups, warn once if the early ACR says the
    setup wastes its samples, save, evaluate (a RewardError there: saved first) and show one group. Returns
    the run's totals so far (`log_step`)."""
    totals = log_step(folder, record, totals)
    step = record["step"]
    evaluating = eval_due(args, step) and (not stop or step == args.steps)  # Ctrl-C skips it (`first_eval`)
    if args.log_samples == "every" or args.log_samples == "evals" and eval_due(args, step):
        for sample in samples:
            append_jsonl(folder, "samples.jsonl", sample)
    if step == early_steps(args.steps) and (warning := collapse_warning(folder.path, args.group_size)):
        tqdm.write(f"[{args.algo}] {warning}")  # the paper's early-ACR diagnostic
    saving = args.save_every and (step % args.save_every == 0 or step == args.steps or stop)
    if saving:
        save_checkpoint(folder, run.master, run.tokenizer, run.optimizer, step, run.state)
    if evaluating:
        try:
            accuracy = run_eval(args, run, folder, step)
        except RewardError:  # the step is whole: saved, its evaluation redone by --resume (`first_eval`)
            if args.save_every and not saving:
                save_checkpoint(folder, run.master, run.tokenizer, run.optimizer, step, run.state)
            raise
        if args.show_group:
            show_group(args.algo, step, accuracy, samples)
    return totals
