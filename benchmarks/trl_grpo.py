"""TRL's GRPOTrainer on benchmarks/bench.py's config, timed per phase as bench.py times ours (TRL has no
per-phase timer): a callback times each optimizer step, the reward function times itself, and
_generate_and_score_completions is wrapped to time generation. Optional: pip install trl==1.16.0."""

import tempfile
import time

from benchmarks.floors import batch_shape
from benchmarks.timing import median_of, sync
from data.tasks import load_problems
from infra.hardware import peak_memory_bytes, pick_device
from model import load_model
from verifier import verify


def bench_trl(args, warmup: int) -> dict:
    """TRL's GRPOTrainer on the config `args` (a train.Args); per-step times from a callback, medians after
    the warm-up."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    device = pick_device()
    model, tokenizer = load_model(args.model, device)
    problems = load_problems(args.dataset, "train", args.seed)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p.question}], "answer": p.answer}
                                 for p in problems])
    steps: list[dict] = []  # one record per optimizer step, filled in by the three timers below

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            sync(device)
            steps.append({"reward_s": 0.0, "gen_tokens": 0, "start": time.perf_counter()})

        def on_step_end(self, *_, **__):
            sync(device)
            steps[-1]["step_s"] = time.perf_counter() - steps[-1]["start"]

    def correctness(prompts, completions, answer, completion_ids, **_) -> list[float]:
        start = time.perf_counter()
        rewards = [float(verify(c[0]["content"], a)) for c, a in zip(completions, answer)]
        steps[-1]["reward_s"] += time.perf_counter() - start
        steps[-1]["gen_tokens"] += sum(len(ids) for ids in completion_ids)
        texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                 for p in prompts[:: args.group_size]]
        prompt_lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        steps[-1]["shape"] = batch_shape([len(ids) for ids in completion_ids], prompt_lengths, rewards,
                                         args.group_size)
        return rewards

    completions = args.prompts_per_step * args.group_size
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp, max_steps=warmup + args.steps, seed=args.seed,
            # 2 prompts x 8 completions per optimizer step, forward/backward in micro-batches like ours
            num_generations=args.group_size, per_device_train_batch_size=min(args.micro_batch, completions),
            gradient_accumulation_steps=max(1, completions // args.micro_batch),
            max_completion_length=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=0, learning_rate=args.lr, lr_scheduler_type="constant", weight_decay=0.0,
            max_grad_norm=args.max_grad_norm,
            beta=args.beta, num_iterations=args.updates_per_batch, epsilon=args.epsilon,
            epsilon_high=args.epsilon_high, loss_type="dapo", scale_rewards="group", disable_dropout=True,
            bf16=args.precision == "bf16", use_cpu=device.type == "cpu",
            eval_strategy="no", save_strategy="no", report_to="none", logging_steps=10**9,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=correctness, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[StepTimer()])
        generate_and_score = trainer._generate_and_score_completions  # private, but the one place it samples

        def timed_generate_and_score(*a, **kw):
            start = time.perf_counter()
            out = generate_and_score(*a, **kw)
            sync(device)
            steps[-1]["gen_score_s"] = steps[-1].get("gen_score_s", 0.0) + time.perf_counter() - start
            return out

        trainer._generate_and_score_completions = timed_generate_and_score
        trainer.train()
    rows = steps[warmup:]
    for r in rows:
        r["generate_s"] = r["gen_score_s"] - r["reward_s"]
        r["train_s"] = r["step_s"] - r["gen_score_s"]
        r["gen_tok_s"] = r["gen_tokens"] / r["generate_s"]
    return {"generate_s": median_of(rows, "generate_s"), "reward_s": median_of(rows, "reward_s"),
            "train_s": median_of(rows, "train_s"), "step_s": median_of(rows, "step_s"),
            "gen_tok_s": median_of(rows, "gen_tok_s"), "train_tok_s": None,
            "completion_len": median_of(rows, "gen_tokens") / completions,
            "peak_mb": peak_memory_bytes(device) / 2**20,
            "rows_trained": completions,  # TRL runs forward/backward on every row, zero advantage or not
            "per_step": [{"generate_s": r["generate_s"], "train_s": r["train_s"], **r["shape"]}
                         for r in rows]}
