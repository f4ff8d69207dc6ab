"""How close can an update come to bench.py's kernel floor? Times, on this machine, the parts every update of
SmolLM2-135M must run, with the same product shapes and the same kernels train.py uses:

    python benchmarks/update_parts.py [--rows 464] [--model smollm2-135m]

  1. the matrix products of forward and backward for `rows` tokens per micro-batch (`F.linear`, as the update's
     forward runs them), the input gradient and the weight gradient, each weight a distinct tensor (read from
     memory), against bench.py's kernel floor for those rows (`bench.kernel_seconds`, counted 3 times: 6 x params
     x tokens);
  2. the per-step work outside the products: gradient clipping, torch's fused AdamW step on float32 weights,
     and, in bf16, rounding the new weights into the working copy (`model.copy_weights`).
Printed as seconds and as multiples of the kernel floor for two micro-batches: part 1 shows how far the products
alone are from the floor, part 2 what the rest of the step adds even if every other operation were free.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench import best_seconds, kernel_seconds, linear_shapes  # noqa: E402
from model import copy_weights, load_model, working_copy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, default=464, help="tokens per micro-batch (bench.py's median: ~460)")
    parser.add_argument("--micro-batches", type=int, default=2)
    args = parser.parse_args()
    model = load_model(args.model, torch.device("cpu"))[0]
    body, head = linear_shapes(args.model)
    shapes = body + (head,)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        weights = [torch.randn(o, i).to(dtype) for o, i in shapes]
        x = {i: torch.randn(args.rows, i).to(dtype) for _, i in shapes}
        dy = {o: torch.randn(args.rows, o).to(dtype) for o, _ in shapes}
        forward = best_seconds(lambda: [torch.nn.functional.linear(x[w.shape[1]], w) for w in weights], reps=5)
        input_grad = best_seconds(lambda: [dy[w.shape[0]] @ w for w in weights], reps=5)
        weight_grad = best_seconds(lambda: [dy[w.shape[0]].t() @ x[w.shape[1]] for w in weights], reps=5)
        floor = 3 * kernel_seconds(shapes, args.rows, dtype) * args.micro_batches
        products = (forward + input_grad + weight_grad) * args.micro_batches

        net = working_copy(model, name)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-9, weight_decay=0.0, fused=True)
        clip = best_seconds(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), reps=5)
        adamw = best_seconds(optimizer.step, reps=5)
        copy = best_seconds(lambda: copy_weights(model, into=net), reps=5)
        rest = clip + adamw + copy
        print(f"{name}: kernel floor (3 x forward products, {args.micro_batches} x {args.rows} rows) {floor:.3f} s")
        print(f"  products of forward + input grad + weight grad {products:.3f} s = {products / floor:.2f}x the floor "
              f"(forward {forward * 1e3:.0f}, input grad {input_grad * 1e3:.0f}, weight grad {weight_grad * 1e3:.0f} ms"
              f" per micro-batch)")
        print(f"  clip {clip * 1e3:.0f} ms + fused AdamW {adamw * 1e3:.0f} ms + copy to bf16 {copy * 1e3:.0f} ms = "
              f"{rest:.3f} s = {rest / floor:.2f}x the floor")
        print(f"  an update with nothing else: {(products + rest) / floor:.2f}x the kernel floor")
        del optimizer, net
        for p in model.parameters():
            p.grad = None


if __name__ == "__main__":
    main()
