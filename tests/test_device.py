"""Device discipline without a GPU: CUDA's rules on which tensors may meet, enforced on CPU tensors around
one train_step of each method, with its defaults and with every flag that makes other tensors meet; the
choice of device, precision and paths (--device, --precision, --fast)."""

import contextlib
import copy
import functools
import math
import os
import subprocess
import sys
import types
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from transformers import Qwen2Config, Qwen2ForCausalLM

import eval as eval_module
import hardware
import lora
import memory
import model
import model_files
import packing
import processes
import run as run_module
import train
from benchmarks.gpu_bench import PARITY, SIZES  # PARITY: a coin flip per completion, groups split
from data.tasks import Problem
from decoding import decode
from memory import estimate_memory
from written import owned

ROOT = Path(__file__).resolve().parent.parent

# Calls that move a tensor, read it out or compare types (`Module.to`), which CUDA allows across devices.
CROSSING = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.copy_, torch.Tensor.item, torch.Tensor.tolist,
            torch.Tensor.__setitem__, torch._has_compatible_shallow_copy_type}
INDEXING = {torch.Tensor.__getitem__, torch.Tensor.index_put_, torch.Tensor.__setitem__}
WRITES = {torch.Tensor.index_put_, torch.Tensor.__setitem__}  # self, indices, values
# Draws that take a generator: on the device without one, they draw from the device's own (CUDA's default)
RANDOM = {torch.multinomial, torch.rand, torch.randn, torch.randint, torch.randperm, torch.bernoulli,
          torch.normal, torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.bernoulli_,
          torch.Tensor.random_, torch.Tensor.exponential_, torch.Tensor.multinomial}
# The run's device under the rules reads as CUDA; its tensors are kept on the CPU with an index, which the
# host never has (`STORAGE`)
DEVICE, HOST, STORAGE = torch.device("cuda", 0), torch.device("cpu"), torch.device("cpu", 0)
CUDA_SEED = 67280421310721  # a CUDA device's default generator's seed before any seeding (torch's default)
PARAMETER_NEW, LOAD = torch.nn.Parameter.__dict__["__new__"], torch.load


def on_the_stand_in(func, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """CUDA named in a call (`device=torch.device("cuda", 0)`, `.to("cuda")`) runs on `STORAGE` instead; host
    memory pinned for copies to CUDA (`pin_memory=True`, which safetensors asks for where CUDA is) is plain
    host memory, all a CPU build has."""
    def stand_in(value):
        cuda = isinstance(value, (torch.device, str)) and torch.device(value).type == "cuda"
        return STORAGE if cuda else value
    if func is torch.Tensor.to:
        args = (args[0], *map(stand_in, args[1:]))
    return args, {k: stand_in(v) if k == "device" else False if k == "pin_memory" else v
                  for k, v in kwargs.items()}


INPUTS = object()  # `named_side`: the call names no side; its inputs decide
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier")  # processes.py's, more
REAL = {name: getattr(dist, name) for name in ("init_process_group", "get_backend", *COLLECTIVES)}


def leaves(x) -> list:
    """The leaves of nested lists, tuples (named ones too) and dicts: tensors, generators and the rest; what
    torch's tree_flatten gives for a call's arguments, in a quarter of its time (timeit; it runs every op)."""
    if isinstance(x, (list, tuple)):
        return [leaf for item in x for leaf in leaves(item)]
    if isinstance(x, dict):
        return [leaf for item in x.values() for leaf in leaves(item)]
    return [x]


def poison(t: torch.Tensor) -> torch.Tensor:
    """What a host tensor holds before a copy into it lands: NaN, the largest integer (an index past any
    end), or the opposite truth."""
    if t.dtype == torch.bool:
        return t.logical_not()
    return torch.full_like(t, math.nan if t.is_floating_point() else torch.iinfo(t.dtype).max)


class CudaDeviceRules(TorchFunctionMode):
    """Runs on CPU, but tells "device" tensors from host ones as a CUDA run would, and raises where CUDA does.

    The process's device is cuda:`index` (`torch.cuda.set_device` changes it, of `count` devices), its
    tensors kept on `STORAGE` (the CPU with an index). Device tensors: those made or moved with a device
    argument naming CUDA, a module's parameters and buffers moved there (`Module.to` sets `.data`) or copied
    from device ones, their gradients, and whatever an op computes from a device tensor; each has its CUDA
    index. A device tensor's `.device` reads cuda:<its index> (`.is_cuda` True), so `device=t.device` follows
    t; any other tensor's reads its own (the host, or meta). Host tensors: factories without a device,
    `.cpu()`, and an explicit CPU (`"cpu"`, `torch.device("cpu")`). `torch.cuda` answers as GPUs of 80 GiB
    (`is_available`, their name and memory, bf16, memory statistics of 0), so the code's CUDA branches run.
    Generators: `torch.Generator(device=d)` is on d's side; `torch.Generator()` and `torch.default_generator`
    on the host; a draw on the device without one uses the device's own, seeded only as CUDA's is
    (`torch.manual_seed`, `torch.cuda.manual_seed*`). CUDA's rules, as its errors state them:
      - an op may not mix tensors of two devices, a host tensor of one or more dimensions among them ("Expected
        all tensors to be on the same device"); a 0-dim host tensor is a scalar there;
      - a host tensor may not be indexed by device indices ("indices should be either on cpu or on the same
        device as the indexed tensor"); a device tensor may be indexed by host ones;
      - a host tensor may not be written with device values through an index (index_put_ raises "Expected
        all tensors to be on the same device"; a slice or a 0-dim value copies, a hidden sync per write);
      - a device tensor has no numpy view ("can't convert cuda:0 device type tensor to numpy");
      - a generator draws for tensors on its own side only ("Expected a 'cuda' device type for generator");
      - a parameter's gradient is on the parameter's side ("assigned grad has data of a different device");
      - a `non_blocking` copy to the host lands at the next synchronisation (`torch.cuda.synchronize`, or a
        blocking copy from the device, `.item()`, `.tolist()`, `.cpu()`): read before, it holds `poison`;
      - nccl, which torch.distributed's "nccl" becomes (gloo beneath, a process each): a collective takes
        device tensors only ("Tensors must be CUDA and dense"), every process enters the same collective
        with the same shapes, or all raise at once (nccl would wait for ever: a hang), and no two processes
        share a GPU ("Duplicate GPU detected").
    Within the block `torch.Generator` and `torch.nn.Parameter` are wrapped, to record their side, and
    `torch.load` onto CUDA gives device tensors."""

    def __init__(self, index: int = 0, count: int = 1):
        super().__init__()
        self.index, self.count, self.nccl = index, count, False
        self.seen: set[int] = set()  # the CUDA devices this process made tensors on
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # non_blocking copies: (host, bytes)

    def mark(self, t, index: int | None = 0):
        t._cuda_index = index  # a plain attribute: a tensor's side, not its storage
        if index is not None and isinstance(t, torch.Tensor):
            self.seen.add(index)
        return t

    @staticmethod
    def side(t) -> int | None:
        """The CUDA device a tensor (or generator) is on; None on the host."""
        return getattr(t, "_cuda_index", None)

    @classmethod
    def on_device(cls, t) -> bool:
        return cls.side(t) is not None

    def named_index(self, device: torch.device | str) -> int | None:
        """The side a device argument names: CUDA's (the current device without an index) or `STORAGE`'s
        (a numbered CPU); None for the CPU without an index (`"cpu"`, `torch.device("cpu")`), the host."""
        device = torch.device(device)
        return self.index if device.type == "cuda" and device.index is None else device.index

    def __enter__(self):
        rules = self

        class Generator(torch._C.Generator):
            def __new__(cls, device: torch.device | str = "cpu"):
                return rules.mark(super().__new__(cls, "cpu"), rules.named_index(device))

        def parameter(cls, data=None, requires_grad=True):  # a deepcopy's parameters: on the original's side
            return self.mark(PARAMETER_NEW(cls, data, requires_grad), self.side(data))

        self.generator = Generator("cuda").manual_seed(CUDA_SEED)  # the device's own, apart from the host's

        def seed(value: int, device=None) -> None:  # torch.manual_seed calls torch.cuda.manual_seed_all too
            self.generator.manual_seed(value)

        def load(f, map_location=None, **kwargs):  # onto the side named: the host, or a device's tensors
            if not isinstance(map_location, (torch.device, str)):
                return LOAD(f, map_location=map_location, **kwargs)
            loaded = LOAD(f, map_location=HOST, **kwargs)
            for t in leaves(loaded):
                if isinstance(t, torch.Tensor):
                    self.mark(t, self.named_index(map_location))
            return loaded

        def set_device(device) -> None:
            self.index = device if isinstance(device, int) else torch.device(device).index

        def synchronize(device=None) -> None:
            self.land()

        self.patches = contextlib.ExitStack()
        for owner, name, value in [
                (torch, "Generator", Generator), (torch.nn.Parameter, "__new__", staticmethod(parameter)),
                (torch, "load", load),
                (torch.version, "cuda", "12.4"), (torch.cuda, "is_available", lambda: True),
                (torch.cuda, "device_count", lambda: self.count),
                (torch.cuda, "current_device", lambda: self.index), (torch.cuda, "set_device", set_device),
                (torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(
                    name="CudaDeviceRules", total_memory=80 * 2**30, major=9, minor=0)),
                (torch.cuda, "get_device_name", lambda device=None: "CudaDeviceRules"),
                (torch.cuda, "is_bf16_supported", lambda including_emulation=True: True),
                (torch.cuda, "synchronize", synchronize),
                (torch.cuda, "manual_seed", seed), (torch.cuda, "manual_seed_all", seed),
                (torch.cuda, "get_rng_state", lambda device="cuda": self.generator.get_state()),
                (torch.cuda, "set_rng_state", lambda state, device="cuda": self.generator.set_state(state)),
                *[(torch.cuda, name, lambda device=None: 0) for name in (
                    "max_memory_allocated", "max_memory_reserved", "memory_reserved", "memory_allocated")],
                (torch.cuda, "reset_peak_memory_stats", lambda device=None: None),
                (torch.cuda, "empty_cache", lambda: None),
                (torch.cuda, "mem_get_info", lambda device=None: (80 * 2**30, 80 * 2**30)),
                (torch.cuda.nccl, "version", lambda: (2, 21, 5)),  # torch's error log names it
                (dist, "init_process_group", self.init_process_group),
                (dist, "get_backend", lambda group=None: "nccl" if self.nccl else REAL["get_backend"](group)),
                *[(dist, name, functools.partial(self.collective, name)) for name in COLLECTIVES]]:
            self.patches.enter_context(mock.patch.object(owner, name, value))
        return super().__enter__()

    def __exit__(self, *exc):
        self.patches.close()
        return super().__exit__(*exc)

    def init_process_group(self, backend: str | None = None, **kwargs) -> None:
        """nccl as gloo beneath, its rules kept by `collective`."""
        self.nccl = backend == "nccl"
        REAL["init_process_group"]("gloo" if self.nccl else backend, **kwargs)

    def collective(self, name: str, *args, **kwargs):
        """torch.distributed's `name` after nccl's checks: every process tells the others what it entered
        (gloo's own all_gather_object); a process whose collective, shapes or GPU differ makes all raise."""
        tensors = [t for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        strays = [self.side(t) for t in tensors if self.side(t) != self.index]
        if self.nccl and strays:  # nccl takes tensors on the process's own GPU alone
            where = "the host" if strays[0] is None else f"cuda:{strays[0]}"
            raise RuntimeError(f"{name}: Tensors must be CUDA and dense, on the process's GPU "
                               f"cuda:{self.index}; one is on {where} (nccl; CudaDeviceRules)")
        if self.nccl:  # a collective waits for the device's work before it
            self.land()
        if dist.get_world_size() > 1:
            entered = (name, [(tuple(t.shape), str(t.dtype)) for t in tensors if name != "all_gather_object"],
                       self.index)
            everyone = [None] * dist.get_world_size()
            REAL["all_gather_object"](everyone, entered)
            if any(other[:2] != entered[:2] for other in everyone):
                entries = "; ".join(f"rank {rank}: {e[0]} {e[1]}" for rank, e in enumerate(everyone))
                raise RuntimeError("the processes entered different collectives, which nccl would wait on for "
                                   f"ever: {entries} (CudaDeviceRules)")
            if self.nccl and len({e[2] for e in everyone}) < len(everyone):
                raise RuntimeError("Duplicate GPU detected: the processes are on CUDA devices "
                                   f"{[e[2] for e in everyone]} (nccl; CudaDeviceRules)")
        return REAL[name](*args, **kwargs)

    def land(self) -> None:
        """The non_blocking copies to the host land, as at a synchronisation."""
        for host, values in self.pending:
            host.copy_(values)
        self.pending.clear()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        attribute, name = getattr(func, "__self__", None), getattr(func, "__name__", str(func))
        if attribute is torch.Tensor.device:  # `t.device`; a meta tensor's stays meta (from_pretrained asks)
            side = self.side(args[0])
            return func(*args, **kwargs) if side is None else torch.device("cuda", side)
        if attribute is torch.Tensor.is_cuda:
            return self.on_device(args[0])
        if attribute in (torch.Tensor.data, torch.Tensor.grad) and name == "__set__":
            return self.assign(func, attribute, *args)
        named = self.named_side(func, args, kwargs)
        args, kwargs = on_the_stand_in(func, args, kwargs)
        flat = leaves((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if func is torch.Tensor.numpy and self.on_device(args[0]):
            raise TypeError(f"can't convert cuda:{self.side(args[0])} device type tensor to numpy. Use "
                            "Tensor.cpu() to copy the tensor to host memory first. (CudaDeviceRules)")
        if func in INDEXING and tensors and not self.on_device(tensors[0]):
            if any(self.on_device(t) for t in leaves(args[1]) if isinstance(t, torch.Tensor)):
                raise RuntimeError(f"{name}: indices should be either on cpu or on the same device as the "
                                   "indexed tensor (CudaDeviceRules)")
            if func in WRITES and self.on_device(args[2]):
                raise RuntimeError(f"{name}: a host tensor written with device values: Expected all "
                                   "tensors to be on the same device (CudaDeviceRules)")
        elif func not in CROSSING and func not in INDEXING:
            sides = {self.side(t) for t in tensors if t.dim() > 0 or self.on_device(t)}
            if len(sides) > 1:
                found = ", ".join("cpu" if side is None else f"cuda:{side}" for side in sorted(
                    sides, key=lambda side: -1 if side is None else side))
                raise RuntimeError(f"{name}: Expected all tensors to be on the same device, but found at "
                                   f"least two devices, {found} (CudaDeviceRules)")
        devices = [self.side(t) for t in tensors if self.on_device(t)]
        side = named if named is not INPUTS else (
            None if func is torch.Tensor.__setitem__ or not devices else devices[0])
        if func in RANDOM and side is not None and kwargs.get("generator") is None:
            kwargs = {**kwargs, "generator": self.generator}
            flat.append(self.generator)
        for generator in (g for g in flat if isinstance(g, torch._C.Generator)):
            if self.on_device(generator) != (side is not None):
                sides = ["cuda" if s else "cpu" for s in (side is not None, self.on_device(generator))]
                raise RuntimeError(f"{name}: Expected a '{sides[0]}' device type for generator but found "
                                   f"'{sides[1]}' (CudaDeviceRules)")
        if devices and (func in (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu)
                        or func is torch.Tensor.to and side is None and not kwargs.get("non_blocking")):
            self.land()  # a blocking copy from the device waits for the device's work, earlier copies too
        out = func(*args, **kwargs)
        if any(out is t for t in tensors) and self.side(out) != side:
            out = out.clone()  # `.cpu()` of a CPU tensor returns it: a copy, as a move across devices makes
        for t in leaves(out) if side is not None else []:
            if isinstance(t, torch.Tensor):
                self.mark(t, side)
        if kwargs.get("non_blocking") and devices and side is None:  # `.to(host)`, `host.copy_(device)`
            host = args[0] if func is torch.Tensor.copy_ else out
            self.pending.append((host, host.clone()))
            host.copy_(poison(host))
        return out

    def named_side(self, func, args: tuple, kwargs: dict):
        """The side a call names for its result (`device=`, `.to(device)`, `.to(tensor)`, `.cpu()`): a CUDA
        index, or None for the host; `INPUTS` where its inputs decide."""
        if func is torch.Tensor.cpu:
            return None
        if func is torch.Tensor.copy_:  # into its first argument, on its side
            return self.side(args[0])
        for target in [kwargs.get("device"), *(args[1:] if func is torch.Tensor.to else ())]:
            if isinstance(target, torch.Tensor):
                return self.side(target)
            if isinstance(target, (torch.device, str)):
                return self.named_index(target)
        return INPUTS

    def assign(self, setter, attribute, tensor: torch.Tensor, value) -> None:
        """`t.data = v` moves t to v's side (as `Module.to` does); `p.grad = g` needs g on p's side."""
        if attribute is torch.Tensor.grad and value is not None and self.side(value) != self.side(tensor):
            raise RuntimeError("assigned grad has data of a different device (CudaDeviceRules)")
        setter(tensor, value)
        if attribute is torch.Tensor.data:
            self.mark(tensor, self.side(value))


def test_the_rules_raise_where_cuda_raises():
    host = torch.arange(4)
    with CudaDeviceRules():
        device = torch.arange(4, device=DEVICE)  # the run's device: CUDA on a GPU
        assert device[host].tolist() == [0, 1, 2, 3]  # a device tensor indexed by host indices: allowed
        assert (device + torch.tensor(1)).tolist() == [1, 2, 3, 4]  # a 0-dim host tensor is a scalar
        assert host[device.cpu()].tolist() == [0, 1, 2, 3]
        with pytest.raises(RuntimeError, match="indices should be"):
            host[device]
        with pytest.raises(RuntimeError, match="same device"):
            host + device
        with pytest.raises(RuntimeError, match="indices should be"):
            host[device] = 0
        with pytest.raises(RuntimeError, match="written with device values"):
            host[host < 2] = device[:2]
        with pytest.raises(RuntimeError, match="written with device values"):
            host[0] = device[0]
        with pytest.raises(TypeError, match="to numpy"):
            device.numpy()
        assert device.cpu().numpy().tolist() == host.numpy().tolist() == [0, 1, 2, 3]
        device[host[:2]] = host[:2]  # a device tensor written with host values: a copy to the device


def test_the_rules_know_an_explicit_cpu_generators_modules_gradients_and_cuda_by_name():
    with CudaDeviceRules():
        device = torch.ones(4, device=torch.device("cuda", 0))  # CUDA named: the stand-in, on the CPU
        assert device.device == DEVICE and (device + torch.ones(4, device=device.device)).sum().item() == 8
        for host in (torch.ones(4, device="cpu"), torch.ones(4, device=torch.device("cpu")),
                     device.to(torch.device("cpu")), device.to("cpu"), torch.ones_like(device, device=HOST)):
            assert host.device == HOST
            with pytest.raises(RuntimeError, match="same device"):
                host * device
        host_generator, device_generator = torch.Generator().manual_seed(0), torch.Generator(device=DEVICE)
        for draw in (lambda: torch.rand(4, device=DEVICE, generator=host_generator),
                     lambda: torch.rand(4, device=DEVICE, generator=torch.default_generator),
                     lambda: device.clone().uniform_(generator=host_generator),
                     lambda: torch.multinomial(device, 1, generator=host_generator)):
            with pytest.raises(RuntimeError, match="Expected a 'cuda' device type for generator"):
                draw()
        with pytest.raises(RuntimeError, match="Expected a 'cpu' device type for generator but found 'cuda'"):
            torch.rand(4, generator=device_generator)
        assert torch.rand(4, device=DEVICE, generator=device_generator).device == DEVICE
        layer = torch.nn.Linear(4, 1)  # made on the host
        with pytest.raises(RuntimeError, match="same device"):
            layer(device)
        layer.to(DEVICE)
        copied = copy.deepcopy(layer)  # bf16's working copy is one
        assert copied.weight.device == copied.bias.device == DEVICE == layer(device).device
        with pytest.raises(RuntimeError, match="assigned grad has data of a different device"):
            copied.weight.grad = torch.zeros(1, 4)
        copied.weight.grad = torch.zeros_like(copied.weight)
        assert layer.cpu().weight.device == HOST and copied.weight.grad.device == DEVICE


TINY = ["--model", "tiny-qwen2", "--max-new-tokens", "6", "--group-size", "4", "--micro-batch", "3",
        "--eval-size", "4", "--precision", "bf16", "--lr", "1e-2"]
# Every non-default flag that changes which tensors meet, at once: the reference's log-probs and the KL,
# PPO's old log-probs, the nucleus (decode's buffer, generate's warper), recomputation in backward.
OPENED = ["--beta", "0.04", "--updates-per-batch", "2", "--top-p", "0.9", "--grad-checkpointing"]
LORA = OPENED + ["--lora-rank", "2", "--lora-alpha", "4"]  # the adapters, and the reference with them off
# train.Args fields the step test drives beyond their default, each with the path it opens; every other field
# is driven off its default by test_device_program.py's programs, train.py from main under the rules
# (`test_every_flag_runs_off_its_default`). Of eval.py's flags, --samples 2 (G completions per prompt at a
# temperature) and --fast/--no-fast are driven; the others pick models, texts, files and shapes.
DRIVEN = {
    "algo": "each method: AVSPO's and AAPO's advantages, AAPO's reference sampling, DAPO's resampling",
    "beta": "> 0 with each method: the frozen reference's log-probs beside the policy's, every row trained",
    "updates_per_batch": "2: PPO's old log-probs, kept from before the first update",
    "top_p": "0.9: the nucleus, decoding.decode's buffer (fast) and generate's top-p warper (plain)",
    "grad_checkpointing": "each layer recomputed in backward",
    "precision": "bf16 (a working copy beside float32 master weights) and fp32 (one network)",
    "fast": "--no-fast, CUDA's paths, and --fast, which gpu_bench.py forces there to time it",
    "reward": "a reward that splits groups (every backward runs) and the verifier (DAPO's collapsed groups)",
    "lora_rank": "2: peft's adapters (float32) on the frozen bf16 weights, the reference with them off, "
                 "the gradients of the adapters alone summed over processes",
    "lora_alpha": "with --lora-rank: a Python float scaling the adapters' output on the device",
}


def favour_stops(nets, stop_ids: list[int], bias: float = 4.0) -> None:
    """An output-layer bias on the stop tokens, so that about a sixth of tiny-qwen2's sampled tokens stop
    (its random weights never do) and the stop branches run; greedy stops at once. A bias, as
    tests/test_fast_paths.py's favour_eos: decoding.decode_step runs the output layer's weights itself."""
    for net in nets:
        weight = net.lm_head.weight
        logit_bias = torch.zeros(net.lm_head.out_features, dtype=weight.dtype, device=weight.device)
        logit_bias[stop_ids] = bias
        net.lm_head.bias = torch.nn.Parameter(logit_bias, requires_grad=False)


def nccl_processes(monkeypatch, world: int = 2) -> None:
    """processes.py as under torchrun with nccl, in this one process: `world` processes that sample alike,
    the GPU's index from torch.cuda, and collectives that raise as nccl does for a tensor off the device."""
    def on_device(*tensors):
        if not all(CudaDeviceRules.on_device(t) for t in tensors):
            raise RuntimeError("Tensors must be CUDA and dense (nccl; CudaDeviceRules)")

    def all_gather(parts, tensor):
        on_device(tensor, *parts)
        for part in parts:
            part.copy_(tensor)

    def all_reduce(tensor):
        on_device(tensor)
        tensor.mul_(world)

    monkeypatch.setattr(processes, "dist", types.SimpleNamespace(
        is_initialized=lambda: True, get_backend=lambda: "nccl", get_world_size=lambda: world,
        all_gather=all_gather, all_reduce=all_reduce))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.mark.parametrize("algo, flags, fast, torchrun", [
    ("grpo", [], False, False), ("aapo", ["--precision", "fp32"], False, False), ("dapo", [], False, False),
    ("grpo", OPENED, False, False), ("avspo", OPENED, False, False), ("aapo", OPENED, False, True),
    ("dapo", OPENED, False, True), ("grpo", OPENED, True, False), ("dapo", OPENED, True, True),
    ("aapo", LORA, False, True), ("aapo", LORA, True, False)],
    ids=lambda v: {id(OPENED): "opened", id(LORA): "lora"}.get(id(v), "fp32" if v == ["--precision", "fp32"]
                                                                  else None))
def test_a_train_step_keeps_cudas_device_rules(tmp_path, monkeypatch, capsys, algo, flags, fast, torchrun):
    """One step of each method and an evaluation, as a CUDA run would place their tensors (the models, the
    rollout and advantages on the device, rewards and bookkeeping on the host), from loading the models on:
    the plain paths, which CUDA runs, and the fast ones (gpu_bench.py forces them there to time them); each
    method with its defaults, then with every flag in `OPENED`, eval.py with --samples 2, and torchrun's
    collectives under nccl (`nccl_processes`). Completions reach stop tokens (`favour_stops`); rewards split
    the groups, so every method's backward runs, but DAPO's at --beta 0, which keeps the verifier's
    collapsed groups to resample them; AAPO under LoRA (`LORA`), its reference the policy with the adapters
    off. The first CUDA update crashed on `rows[...]` (issue 43)."""
    args = train.parse_args(TINY + ["--algo", algo, "--out", str(tmp_path), *flags, "--fast" if fast else
                                    "--no-fast", "--reward", "verifier" if algo == "dapo" else PARITY])
    if torchrun:
        nccl_processes(monkeypatch)
    if fast:  # the fast paths on the stand-in's CUDA too, as gpu_bench.py forces them there to time them
        monkeypatch.setattr(run_module, "FAST_ON", ("cuda",))
        monkeypatch.setattr(eval_module, "FAST_ON", ("cuda",))
    monkeypatch.setattr(eval_module, "pick_device", lambda name: DEVICE)
    with owned(tmp_path / "run", "run") as files, CudaDeviceRules() as rules:
        run = run_module.start_run(args, tmp_path, DEVICE, True, train.algo_state(args),
                                   with_reference=algo == "aapo" or args.beta > 0)
        named = {"master": run.master, "policy": run.policy}
        if run.reference is not None:
            with run.reference() as network:  # under LoRA, the policy itself
                named["reference"] = network
            assert network.dtype == run.policy.dtype  # a float32 reference: 2x the memory counted for it
        on_host = [name for name, net in named.items()
                   if not all(rules.on_device(t) for t in [*net.parameters(), *net.buffers()])]
        assert not on_host, f"on the host, not the run's device: {on_host}"
        favour_stops(named.values(), model.stop_token_ids(run.policy, run.tokenizer))
        mine = slice(0, args.prompts_per_step // 2 if torchrun else args.prompts_per_step)
        record, _ = train.train_step(args, run, 1, 0, mine, DEVICE)
        assert 0 <= run_module.run_eval(args, run, files, 1) <= 1
        if flags is OPENED and algo == "grpo":  # eval.py's --samples: once on each path
            eval_module.main(["--model", "tiny-qwen2", "--samples", "2", "--limit", "2", "--max-new-tokens",
                              "6", "--precision", "bf16", "--fast" if fast else "--no-fast"])
    assert record["skipped"] == 0 and record["truncated_frac"] < 1  # some rows stopped
    bf16, lora = args.precision == "bf16", args.lora_rank > 0
    assert (run.policy.dtype == torch.bfloat16) == bf16 == (run.policy is not run.master or lora)
    if lora:  # the frozen weights in bf16, in place; the adapters float32, with gradients on the device
        assert run.policy is run.master and {p.dtype for p in run.policy.parameters() if not p.requires_grad
                                             } == {torch.bfloat16}
        trained = [p for p in run.master.parameters() if p.requires_grad]
        assert trained and all(p.dtype == torch.float32 and rules.on_device(p) for p in trained)
        assert {id(p) for p in run.optimizer.state} == {id(p) for p in trained}
    if algo == "dapo":  # tiny-qwen2's groups all collapse: replace_groups ran under the rules
        assert record["resampled_groups"] > 0
    if algo != "dapo" or args.beta > 0:  # a backward pass, and bf16's gradient accumulation, under the rules
        assert record["rows_trained"] > 0
    assert "mean@2" in capsys.readouterr().out or flags is not OPENED or algo != "grpo"


# ------------------------------------------------------------------------------ where the run is, its paths


def test_cuda_where_unusable_is_a_value_error_saying_why(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(hardware, "cuda_settings", lambda: None)  # test_cuda_settings has them
    assert hardware.pick_device("auto") == hardware.pick_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="--device cuda: this torch .* is a CPU-only build"):
        hardware.pick_device("cuda")
    assert "no CUDA: this torch" in hardware.describe_device(torch.device("cpu"))  # auto's fallback, said
    monkeypatch.setattr(torch.version, "cuda", "12.4")  # a CUDA wheel without a usable driver or device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="sees no CUDA device .* older than CUDA 12.4"):
        hardware.pick_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert hardware.pick_device("auto") == hardware.pick_device("cuda") == torch.device("cuda")


@pytest.mark.parametrize("users", [None, "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_cuda_settings_expandable_segments_unless_the_user_set_the_allocator_and_no_cudnn_attention(
        monkeypatch, users):
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    if users:
        monkeypatch.setenv(users, "max_split_size_mb:128")
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        assert hardware.pick_device("cuda") == torch.device("cuda")
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
    expected = "max_split_size_mb:128" if users == "PYTORCH_CUDA_ALLOC_CONF" else (
        None if users else "expandable_segments:True")
    assert os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == expected


def test_a_gpu_is_named_with_its_memory(monkeypatch):
    card = types.SimpleNamespace(name="NVIDIA H200", total_memory=140 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: card)
    assert hardware.describe_device(torch.device("cuda", 0)) == "cuda:0 (NVIDIA H200, 140 GiB)"


@pytest.mark.parametrize("script", ["train.py", "eval.py"])
def test_device_cuda_where_unusable_stops_with_one_line_before_any_model(script, tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # unusable here, and on a GPU machine too
    proc = subprocess.run([sys.executable, ROOT / script, "--device", "cuda", "--model", "tiny-qwen2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)  # its --out
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "error: --device cuda: " in last and ("CPU-only build" in last or "sees no CUDA device" in last)


@pytest.mark.parametrize("native, expected", [(True, "bf16"), (False, "fp32")])
def test_auto_precision_on_cuda_is_bf16_only_where_the_gpu_has_it(monkeypatch, native, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native
                        or including_emulation)  # a T4 or V100 emulates bf16
    assert hardware.resolve_precision("auto", torch.device("cuda")) == expected
    assert hardware.resolve_precision("bf16", torch.device("cuda")) == "bf16"


def test_fast_means_the_fast_paths_on_the_cpu_and_the_plain_ones_on_cuda():
    """No CUDA call is made: the choice reads the device's type."""
    assert run_module.fast_or_plain(True, torch.device("cpu")) == (decode, packing.completion_logprobs)
    plain = (model.sample_with_generate, model.completion_logprobs)
    assert run_module.fast_or_plain(True, torch.device("cuda")) == plain
    assert run_module.fast_or_plain(False, torch.device("cpu")) == plain
    assert run_module.fast_or_plain(True, torch.device("cuda", 1)) == plain


def test_the_first_line_names_device_precision_dtypes_and_memory(tmp_path):
    args = train.parse_args(TINY[:-2] + ["--precision", "bf16", "--beta", "0.1", "--out", str(tmp_path)])
    master, tokenizer = model.load_model("tiny-qwen2", torch.device("cpu"))
    line = run_module.where_it_runs(args, master, hardware.working_copy(master, "bf16"), master, tokenizer,
                                [Problem("What is 2 + 3?", "5")])
    assert line.startswith("cpu (") and "; bf16 (float32 master weights, a bfloat16 working copy); " in line
    assert "memory ~" in line and "working copy" in line and "reference" in line


def test_the_first_line_under_lora_counts_frozen_weights_and_adapters_and_no_copy(tmp_path, monkeypatch):
    """Under LoRA the policy is the master (its frozen weights cast in place) and the reference is the policy
    with its adapters off: the estimate gets the model's own weights apart from the adapters, and the line
    names them, with no working copy and no reference."""
    args = train.parse_args(TINY[:-2] + ["--precision", "bf16", "--beta", "0.1", "--lora-rank", "4",
                                         "--out", str(tmp_path)])
    master, tokenizer = model.load_model("tiny-qwen2", torch.device("cpu"))
    own = sum(p.numel() for p in master.parameters())
    lora.add_adapters(master, 4, 32, "tiny-qwen2", 0)
    policy = hardware.working_copy(master, "bf16")
    seen = {}

    def estimate(config, num_params, **kwargs):
        seen.update(num_params=num_params, **kwargs)
        return estimate_memory(config, num_params, **kwargs)

    monkeypatch.setattr(run_module, "estimate_memory", estimate)
    line = run_module.where_it_runs(args, master, policy, functools.partial(lora.adapters_off, policy),
                                    tokenizer, [Problem("What is 2 + 3?", "5")])
    adapters = memory.adapter_count(master.config, 4)
    assert policy is master and seen["num_params"] == own and seen["lora_params"] == adapters > 0
    assert seen["bf16"] and seen["reference"]
    assert "; bf16 (bfloat16 frozen weights, float32 LoRA adapters); " in line
    parts = f"frozen weights {memory.size(2 * own)} + adapters+AdamW+grads {memory.size(16 * adapters)}"
    assert parts in line
    assert "working copy" not in line and "reference" not in line and "weights+AdamW" not in line


# ------------------------------------------------------------------------------ memory.py


# SmolLM2-135M's widths (its config.json; a Llama, taken here as a Qwen2 of the same widths: GQA 3 of 9)
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3)


def widths(size: str) -> dict:
    """A model's widths: Qwen2.5's (gpu_bench.SIZES: 0.5B, 1.5B, tiny) or SmolLM2's."""
    return SMOLLM2 if size == "smollm2" else SIZES[size]


def shapes(**overrides):
    return {"rows": 16, "prompt_len": 40, "completion_len": 60, "micro_batch": 4, "bf16": True,
            "reference": False, "checkpointing": False, **overrides}


def test_memory_static_terms_count_the_models_parameters():
    tiny, _ = model_files.tiny_qwen2()
    params = sum(p.numel() for p in tiny.parameters())
    terms = estimate_memory(tiny.config, params, **shapes(reference=True))
    assert (terms["weights"], terms["optimizer"], terms["gradients"]) == (4 * params, 8 * params, 4 * params)
    assert terms["working_copy"] == 4 * params and terms["reference"] == 2 * params
    fp32 = estimate_memory(tiny.config, params, **shapes(bf16=False, reference=True))
    assert fp32["working_copy"] == 0 and fp32["reference"] == 4 * params
    static = sum(terms[k] for k in ("weights", "optimizer", "gradients", "working_copy", "reference"))
    assert terms["total"] == static + max(terms["sampling"], terms["activations"] + terms["logits"])


@pytest.mark.parametrize("size, rank", [("tiny", 4), ("0.5B", 32), ("1.5B", 1), ("smollm2", 8)])
def test_memory_static_terms_under_lora_count_the_frozen_weights_once_and_the_adapters(size, rank):
    """peft's adapters on every linear layer but the output layer number `memory.adapter_count`; the model's
    own weights count once, in the working precision, and only the adapters have float32 weights, AdamW
    moments and gradients: no working copy, and the reference (the adapters off) costs nothing."""
    config = Qwen2Config(vocab_size=1000, tie_word_embeddings=True, **widths(size))
    with torch.device("meta"):  # the real widths, nothing allocated
        net = Qwen2ForCausalLM(config)
    own = sum(p.numel() for p in net.parameters())
    lora.add_adapters(net, rank, 32, size, 0)
    adapters = sum(p.numel() for p in net.parameters() if p.requires_grad)
    assert adapters == memory.adapter_count(config, rank) and adapters + own == sum(p.numel() for p in
                                                                                     net.parameters())
    for bf16, w in ((True, 2), (False, 4)):
        terms = estimate_memory(config, own, **shapes(bf16=bf16, reference=True), lora_params=adapters)
        assert (terms["frozen"], terms["weights"], terms["optimizer"], terms["gradients"]) == (
            w * own, 4 * adapters, 8 * adapters, 4 * adapters)
        assert terms["working_copy"] == terms["reference"] == 0
        static = sum(terms[k] for k in ("frozen", "weights", "optimizer", "gradients"))
        assert terms["total"] == static + max(terms["sampling"], terms["activations"] + terms["logits"])
    assert estimate_memory(config, own, **shapes())["frozen"] == 0  # full fine-tuning: no frozen weights


@pytest.mark.parametrize("key", ["rows", "prompt_len", "completion_len", "micro_batch"])
def test_memory_grows_with_the_runs_shapes_and_checkpointing_shrinks_it(key):
    config = model_files.tiny_qwen2()[0].config
    small, large = (estimate_memory(config, 10**6, **shapes(**{key: value}))
                    for value in (shapes()[key], 2 * shapes()[key]))
    assert large["total"] > small["total"] or key == "rows" and large["sampling"] > small["sampling"]
    checkpointed = estimate_memory(config, 10**6, **shapes(checkpointing=True))
    assert checkpointed["activations"] < small["activations"]


def saved_bytes(net, ids: torch.Tensor, mask: torch.Tensor, completion_len: int) -> int:
    """Bytes of the tensors autograd saves for backward in one forward of the plain log-probs (each storage
    once, the parameters left out)."""
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.completion_logprobs(net, ids, mask, completion_len)
    return sum(kept.values())


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("size, precision, rank", [  # rank: LoRA's
    ("0.5B", "bf16", 0), ("1.5B", "bf16", 0), ("0.5B", "fp32", 0), ("0.5B", "bf16", 32), ("1.5B", "bf16", 1),
    ("0.5B", "fp32", 32), ("smollm2", "bf16", 0), ("smollm2", "bf16", 8)])
def test_memory_activations_are_what_the_forward_keeps_for_backward(size, precision, rank, checkpointing):
    """Two layers at Qwen2.5's real widths, rows padded on the left and the right as in training: the bytes
    autograd saves (the logits' own among them) against memory.py's activations and logits. Under
    checkpointing the forward keeps each layer's input only, and the estimate adds one layer's
    `layer_bytes`, recomputed in backward. `rank`: LoRA through peft, frozen weights in the working precision
    and float32 adapters (`lora_layer_bytes`)."""
    config = Qwen2Config(vocab_size=1000, tie_word_embeddings=True, **{**widths(size), "num_hidden_layers": 2})
    torch.manual_seed(0)
    net = Qwen2ForCausalLM(config)
    if rank:
        lora.add_adapters(net, rank, 32, size, 0)
    net = hardware.working_copy(net, precision).train()
    if checkpointing:
        model.checkpoint_activations(net)
    ids = torch.randint(0, 1000, (4, 101))
    mask = torch.ones_like(ids)
    mask[:2, :20] = mask[1:3, -15:] = 0  # left-padded prompts, completions that ended early
    kept = saved_bytes(net, ids, mask, 60)
    terms = estimate_memory(config, 0, **shapes(micro_batch=4, bf16=precision == "bf16",
                                                checkpointing=checkpointing),  # 4 rows of 100 positions
                            lora_params=memory.adapter_count(config, rank))
    w = 2 if precision == "bf16" else 4
    forward = terms["activations"] + 4 * 60 * 1000 * w  # and the logits
    if checkpointing:  # less the layer that backward recomputes
        layer = memory.lora_layer_bytes(config, w, rank) if rank else memory.layer_bytes(config, w)
        forward -= 4 * 100 * layer
    # 10% is the bar; without checkpointing the count is within 0.5%, so 3% shows a slip in any one term
    assert kept == pytest.approx(forward, rel=0.1 if checkpointing else 0.03)


def peak_bytes(fn) -> int:
    """The most bytes allocated on the CPU at once while fn runs, above what was there before (torch's memory
    profiler, which records every allocation and free)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        fn()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    totals = [sum(s) for s in sizes]
    return max(totals) - totals[0]  # the first: the tensors that existed before and fn used (weights, inputs)


# One narrow layer: the logits are nearly all of the memory, so a slip in their term shows at once
NARROW = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)


@pytest.mark.parametrize("size, precision, rank, chunk", [  # rank: LoRA's
    *[("narrow", precision, rank, chunk) for precision, rank in (("bf16", 0), ("fp32", 0), ("bf16", 4))
      for chunk in (64, 256)],
    ("smollm2", "bf16", 0, 256), ("smollm2", "bf16", 8, 256), ("1.5B", "bf16", 32, 256)])  # the recipe
def test_memory_logits_are_the_peak_of_the_log_probs_forward_and_backward(monkeypatch, size, precision, rank,
                                                                            chunk):
    """The logits term as measured: one layer at a model's widths and a 16,000-token vocabulary; the peak of
    the plain log-probs' forward and backward against activations + logits. Under LoRA (`rank`) the output
    layer is frozen but its input still gets a gradient: the same logits. The output layer is frozen in every
    case (its gradient is the static terms', not the update's), which on the CPU once cost one copy of it per
    row (`model.last_positions`): +67 MB at SmolLM2's width, nothing at 32."""
    monkeypatch.setattr(model, "LOGPROB_CHUNK", chunk)
    monkeypatch.setattr(memory, "LOGPROB_CHUNK", chunk)
    config = Qwen2Config(vocab_size=16_000, tie_word_embeddings=True,
                         **{**(NARROW if size == "narrow" else widths(size)), "num_hidden_layers": 1})
    torch.manual_seed(0)
    net = Qwen2ForCausalLM(config)
    if rank:
        lora.add_adapters(net, rank, 32, size, 0)
    net = hardware.working_copy(net, precision).train()
    net.model.embed_tokens.weight.requires_grad_(False)
    ids = torch.randint(0, 16_000, (8, 161))
    mask = torch.ones_like(ids)
    mask[:4, :30] = 0

    def update():
        model.completion_logprobs(net, ids, mask, 128, 0.7).sum().backward()

    update()  # once before: the first call allocates what later ones reuse
    net.zero_grad(set_to_none=True)
    terms = estimate_memory(config, 0, **shapes(micro_batch=8, prompt_len=32, completion_len=128,
                                                bf16=precision == "bf16"),
                            lora_params=memory.adapter_count(config, rank))
    assert peak_bytes(update) == pytest.approx(terms["activations"] + terms["logits"], rel=0.1)


def test_gpu_bench_can_force_the_fast_paths_on_cuda_to_time_them():
    from benchmarks.gpu_bench import fast_paths_on
    with fast_paths_on(torch.device("cuda")):
        assert train.fast_or_plain(True, torch.device("cuda")) == (decode, packing.completion_logprobs)
    assert train.fast_or_plain(True, torch.device("cuda")).sample_completions is model.sample_with_generate
