"""One train.update_policy on a fixed rollout, its rows split over the processes of a torchrun job.

  torchrun --standalone --nproc_per_node 2 tests/distributed_update.py OUT.pt  # N processes
  python tests/distributed_update.py OUT.pt                                      # the same batch, one process

Every process samples the same global rollout (same seed), keeps its share of the rows and runs one
SGD step with lr 1 and no clipping, so the weight change is minus the gradient; process 0 saves it,
for two advantage vectors, and under LoRA (rank 2, every lora_B drawn small and nonzero so that A has a
gradient too; SGD over the adapters alone), with which frozen parameters got a .grad.
tests/test_train.py checks that N processes and one give the same changes.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train  # noqa: E402
from benchmarks.gpu_bench import with_adapters  # noqa: E402
from loop.processes import close_processes, init_processes  # noqa: E402
from model import Rollout, load_model, sample  # noqa: E402

QUESTIONS = ["What is 2 + 3?", "What is 12 * 7? Think step by step.", "What is 9 - 4?", "Name a prime."]
ADVANTAGES = {  # per completion, 4 prompts x G=2
    "every process trains": torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 0.0, 0.7, -0.7]),
    "the second half trains no row": torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0]),
}
ADVANTAGES["LoRA, the second half trains no row"] = ADVANTAGES["the second half trains no row"]



def rows_of(rollout: Rollout, rows: slice) -> Rollout:
    return Rollout(rollout.input_ids[rows], rollout.attention_mask[rows], rollout.completion_mask[rows],
                   rollout.texts[rows], rollout.truncated[rows])


def main(out: str) -> None:
    rank, world, device = init_processes()
    results = {}
    for case, advantages in ADVANTAGES.items():
        model, tokenizer = load_model("tiny-qwen2", device)
        if case.startswith("LoRA"):
            with_adapters(model)
        torch.manual_seed(0)
        rollout = sample(model.eval(), tokenizer, QUESTIONS, 2, 8)
        share = len(advantages) // world
        mine = slice(rank * share, (rank + 1) * share)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
        args = train.Args(micro_batch=3, max_grad_norm=1e9)
        stats = train.update_policy(model, model, sgd, rows_of(rollout, mine), advantages[mine], None, args)
        results[case] = {"delta": {n: before[n] - p.detach() for n, p in model.named_parameters()},
                         "frozen": {n: p.grad is not None for n, p in model.named_parameters()
                                    if not p.requires_grad},  # whether each frozen one got a .grad
                         "stats": stats}
    if rank == 0:
        torch.save(results, out)
    close_processes()


if __name__ == "__main__":
    main(sys.argv[1])
