"""Device discipline without a GPU: CUDA's rules on which tensors may meet, enforced on CPU tensors around
one train_step of each method; the choice of device, precision and paths (--device, --precision, --fast)."""

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import common
import train

# Calls that move a tensor or read it out, which CUDA allows across devices.
CROSSING = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.copy_, torch.Tensor.item, torch.Tensor.tolist,
            torch.Tensor.numpy, torch.Tensor.__setitem__}
INDEXING = {torch.Tensor.__getitem__, torch.Tensor.index_put_, torch.Tensor.__setitem__}


class CudaDeviceRules(TorchFunctionMode):
    """Runs on CPU, but tells "device" tensors from host ones as a CUDA run would, and raises where CUDA does.

    Device tensors: the given models' parameters, buffers and gradients, any tensor made with an explicit
    `device=` or `.to(device)` (on a GPU that is the run's device), and whatever an op computes from a device
    tensor. `.cpu()` and factories without a device make host tensors. CUDA's rules, as its errors state them:
      - an op may not mix a device tensor with a host tensor of one or more dimensions ("Expected all tensors
        to be on the same device"); a 0-dim host tensor is a scalar there;
      - a host tensor may not be indexed by device indices ("indices should be either on cpu or on the same
        device as the indexed tensor"); a device tensor may be indexed by host ones.
    Approximate by design: it reads device placement from the calls, so a `device=` naming the CPU on purpose
    would count as the device (train.py names none)."""

    def __init__(self, *models: torch.nn.Module):
        super().__init__()
        for model in models:
            for t in [*model.parameters(), *model.buffers()]:
                self.mark(t)
            for p in model.parameters():
                if p.requires_grad:  # gradients live where their parameter does
                    p.register_post_accumulate_grad_hook(self.mark_grad)

    @staticmethod
    def mark(t):
        t._on_device = True  # a plain attribute: a tensor's side, not its storage
        return t

    def mark_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self.mark(p.grad)

    @staticmethod
    def on_device(t) -> bool:
        return getattr(t, "_on_device", False)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func in INDEXING and tensors and not self.on_device(tensors[0]):
            if any(self.on_device(t) for t in tree_flatten(args[1])[0] if isinstance(t, torch.Tensor)):
                raise RuntimeError(f"{func.__name__}: indices should be either on cpu or on the same device "
                                   "as the indexed tensor (CudaDeviceRules)")
        elif func not in CROSSING and func not in INDEXING:
            sides = {self.on_device(t) for t in tensors if t.dim() > 0 or self.on_device(t)}
            if len(sides) > 1:
                name = getattr(func, "__name__", func)
                raise RuntimeError(f"{name}: Expected all tensors to be on the same device, but found a "
                                   "device tensor and a host tensor (CudaDeviceRules)")
        out = func(*args, **kwargs)
        to_host = func is torch.Tensor.cpu or (func is torch.Tensor.to and self.names_cpu(args, kwargs))
        explicit = "device" in kwargs or func is torch.Tensor.to and any(
            isinstance(a, (torch.device, str)) for a in args[1:])
        on_device = not to_host and (explicit or func is not torch.Tensor.__setitem__
                                     and any(self.on_device(t) for t in tensors))
        if any(out is t for t in tensors) and self.on_device(out) != on_device:
            out = out.clone()  # `.cpu()` of a CPU tensor returns it: a copy, as a move across devices makes
        for t in tree_flatten(out)[0] if on_device else []:
            if isinstance(t, torch.Tensor):
                self.mark(t)
        return out

    @staticmethod
    def names_cpu(args, kwargs) -> bool:
        """`.to("cpu")` named as a string: the host, even here."""
        return kwargs.get("device") == "cpu" or "cpu" in args[1:]


def test_the_rules_raise_where_cuda_raises():
    host = torch.arange(4)
    with CudaDeviceRules():
        device = torch.arange(4, device="cpu")  # an explicit device: the run's device on a GPU
        assert device[host].tolist() == [0, 1, 2, 3]  # a device tensor indexed by host indices: allowed
        assert (device + torch.tensor(1)).tolist() == [1, 2, 3, 4]  # a 0-dim host tensor is a scalar
        assert host[device.cpu()].tolist() == [0, 1, 2, 3]
        with pytest.raises(RuntimeError, match="indices should be"):
            host[device]
        with pytest.raises(RuntimeError, match="same device"):
            host + device
        with pytest.raises(RuntimeError, match="indices should be"):
            host[device] = 0


TINY = ["--model", "tiny-qwen2", "--max-new-tokens", "6", "--group-size", "4", "--micro-batch", "3",
        "--precision", "fp32"]


@pytest.mark.parametrize("algo, beta, fast", [("grpo", 0.0, True), ("avspo", 0.0, True), ("aapo", 0.0, True),
                                              ("dapo", 0.0, True), ("grpo", 0.04, True),
                                              ("dapo", 0.04, False)])
def test_a_train_step_keeps_cudas_device_rules(tmp_path, algo, beta, fast):
    """One step of each method, as a CUDA run would place its tensors (the rollout and advantages on the
    device, rewards and bookkeeping on the host); the first CUDA update crashed on `rows[...]` (issue 43)."""
    args = train.parse_args(TINY + ["--algo", algo, "--beta", str(beta), "--out", str(tmp_path),
                                    "--lr", "1e-2", "--fast" if fast else "--no-fast"])
    device = torch.device("cpu")
    run = common.start_run(args, tmp_path, device, True, train.algo_state(args),
                           with_reference=algo == "aapo" or beta > 0)
    models = [m for m in (run.master, run.policy, run.reference) if m is not None]
    with CudaDeviceRules(*models):
        record = train.train_step(args, run, 1, 0, slice(0, args.prompts_per_step), device)
    assert record["skipped"] == 0
    if algo == "avspo" or beta > 0:  # virtual rewards, or the KL: every row trains, under the rules
        assert record["rows_trained"] == 8
    if algo == "dapo":  # tiny-qwen2's groups all collapse: replace_groups ran under the rules too
        assert record["resampled_groups"] > 0
