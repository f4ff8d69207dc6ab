"""A stand-in for one CUDA machine, on the CPU: `CudaDeviceRules`, a device that reads as CUDA through every
door torch asks (`torch.cuda`, `torch.accelerator`, streams, events, `torch.backends.cuda`), with CUDA's rules
on which tensors may meet. It is the same device whatever torch is installed: a CPU wheel, or a CUDA wheel on a
machine with no driver or with a real GPU, which it never touches (CUDA's runtime, reached through a door it
does not answer, raises instead of starting)."""

import contextlib
import functools
import math
import os
import time
import types
import weakref
from typing import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

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
TOTAL, CONTEXT = 80 * 2**30, 2**29  # a GPU's memory, and what its CUDA context and workspaces hold of it
SEGMENT = 20 * 2**20  # the caching allocator reserves large allocations in segments of this size
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
# loop/processes.py's collectives, and more
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier")
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


class Stream:
    """A CUDA stream of the stand-in: work is in order and done at once, so it never waits nor captures."""

    def __init__(self, device=None, priority: int = 0):
        self.device = torch.device("cuda", torch.cuda.current_device())

    def is_capturing(self) -> bool:
        return False

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass


class Event:
    """A CUDA event of the stand-in: recorded at the host's clock, which is when the stand-in's work is done."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.at = None

    def record(self, stream=None) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def wait(self, stream=None) -> None:
        pass

    def elapsed_time(self, end: "Event") -> float:
        return (end.at - self.at) * 1000  # milliseconds, as CUDA's


class CudaDeviceRules(TorchFunctionMode):
    """Runs on CPU, but tells "device" tensors from host ones as a CUDA run would, and raises where CUDA does.

    The process's device is cuda:`index` (`torch.cuda.set_device` changes it, of `count` devices), its
    tensors kept on `STORAGE` (the CPU with an index). Device tensors: those made or moved with a device
    argument naming CUDA, a module's parameters and buffers moved there (`Module.to` sets `.data`) or copied
    from device ones, their gradients, and whatever an op computes from a device tensor; each has its CUDA
    index. A device tensor's `.device` reads cuda:<its index> (`.is_cuda` True), so `device=t.device` follows
    t; any other tensor's reads its own (the host, or meta). Host tensors: factories without a device,
    `.cpu()`, and an explicit CPU (`"cpu"`, `torch.device("cpu")`). `torch.cuda` answers as GPUs of 80 GiB
    (`is_available`, their name and memory, bf16, memory statistics as a GPU's: `memory`), so the code's CUDA
    branches run; so do `torch.accelerator`, streams and events (`doors`), on a CPU wheel as on a CUDA one.
    CUDA_VISIBLE_DEVICES is read once, at the first door asked (`visible`), as CUDA reads it when it starts:
    set later, it changes nothing. Work on the device is `queued` until a synchronisation, as CUDA's is.
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
        self.queued = False  # device work since the last synchronisation: a clock read now stops too early
        self.seen_visible: str | None = None  # CUDA_VISIBLE_DEVICES as the first door found it (`visible`)
        self.started = False  # whether a door was asked: CUDA has started in this process (`visible`)
        self.live = weakref.WeakValueDictionary()  # the device tensors alive, by id (`memory`)
        self.peaks = {"allocated": 0, "reserved": 0}  # since the last reset of the peak statistics

    def mark(self, t, index: int | None = 0):
        t._cuda_index = index  # a plain attribute: a tensor's side, not its storage
        if index is not None and isinstance(t, torch.Tensor):
            self.seen.add(index)
            self.live[id(t)] = t
        return t

    def visible(self) -> int:
        """The devices this process sees: CUDA_VISIBLE_DEVICES as it was at the first door asked (CUDA reads
        it once, when it starts), the ids in it among `count`; all `count` where it is unset."""
        if not self.started:
            self.started, self.seen_visible = True, os.environ.get("CUDA_VISIBLE_DEVICES")
        if self.seen_visible is None:
            return self.count
        return len([i for i in self.seen_visible.split(",") if i.strip().isdigit() and int(i) < self.count])

    def memory(self, statistic: str, device=None) -> int:
        """A GPU's memory statistic, from the device tensors alive when asked: "allocated" their storages'
        bytes, "reserved" those rounded up to the caching allocator's segments; each peak the largest read
        since `reset_peak_memory_stats`. Beside them the CUDA context holds `CONTEXT` (`mem_get_info`)."""
        with torch._C.DisableTorchFunction():
            storages = {s.data_ptr(): s.nbytes() for s in (t.untyped_storage() for t in self.live.values())}
        now = {"allocated": sum(storages.values())}
        now["reserved"] = -(-now["allocated"] // SEGMENT) * SEGMENT
        for name, value in now.items():
            self.peaks[name] = max(self.peaks[name], value)
        return self.peaks[statistic[4:]] if statistic.startswith("max_") else now[statistic]

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
        if torch.cuda.is_initialized():  # another test took a real GPU here: an unanswered door would reach it
            pytest.skip("the CUDA stand-in needs a process in which no real CUDA has started; this one has")
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
        for owner, name, value in [*self.doors(set_device, synchronize),
                (torch, "Generator", Generator), (torch.nn.Parameter, "__new__", staticmethod(parameter)),
                (torch, "load", load),
                (torch.version, "cuda", "12.4"), (torch.cuda, "is_available", lambda: self.visible() > 0),
                (torch.cuda, "device_count", self.visible),
                (torch.cuda, "current_device", lambda: self.index), (torch.cuda, "set_device", set_device),
                (torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(
                    name="CudaDeviceRules", total_memory=TOTAL, major=9, minor=0)),
                (torch.cuda, "get_device_name", lambda device=None: "CudaDeviceRules"),
                (torch.cuda, "is_bf16_supported", lambda including_emulation=True: True),
                (torch.cuda, "synchronize", synchronize),
                (torch.cuda, "manual_seed", seed), (torch.cuda, "manual_seed_all", seed),
                (torch.cuda, "get_rng_state", lambda device="cuda": self.generator.get_state()),
                (torch.cuda, "set_rng_state", lambda state, device="cuda": self.generator.set_state(state)),
                *[(torch.cuda, name, functools.partial(self.memory, name.replace("memory_", "")))
                  for name in ("max_memory_allocated", "max_memory_reserved", "memory_reserved",
                               "memory_allocated")],
                (torch.cuda, "reset_peak_memory_stats", lambda device=None: self.peaks.update(
                    allocated=0, reserved=0)),
                (torch.cuda, "empty_cache", lambda: None),
                (torch.cuda, "mem_get_info", lambda device=None: (
                    TOTAL - CONTEXT - self.memory("reserved"), TOTAL)),
                (torch.cuda.nccl, "version", lambda: (2, 21, 5)),  # torch's error log names it
                (dist, "init_process_group", self.init_process_group),
                (dist, "get_backend", lambda group=None: "nccl" if self.nccl else REAL["get_backend"](group)),
                *[(dist, name, functools.partial(self.collective, name)) for name in COLLECTIVES]]:
            self.patches.enter_context(mock.patch.object(owner, name, value))
        self.stream = Stream()  # the device's one stream, its work done at once
        return super().__enter__()

    def doors(self, set_device: Callable, synchronize: Callable) -> list[tuple[object, str, object]]:
        """The doors besides `torch.cuda`'s through which torch asks for the accelerator, each answering as
        this device: `torch.accelerator` (AdamW's step asks it for the current stream, to check for a graph
        capture), streams and events, `torch.backends.cuda` (torch.accelerator's `is_available` and
        `device_count` ask `torch.cuda`'s, patched in `__enter__`). On a CUDA wheel an unanswered door starts
        CUDA's runtime, which on a machine with no driver raises and on a GPU machine would take the card:
        `torch.cuda._lazy_init`, where every such door leads, raises instead, naming the stand-in."""
        def runtime() -> None:
            raise RuntimeError("a door CudaDeviceRules does not answer reached CUDA's runtime "
                               "(tests/cuda_stand_in.py: answer it in `doors`)")

        def current(device=None) -> Stream:
            return self.stream

        cuda = torch.device("cuda")
        return [(torch.cuda, "_lazy_init", runtime), (torch.backends.cuda, "is_built", lambda: True),
                (torch.accelerator, "current_accelerator", lambda check_available=False: cuda),
                (torch.accelerator, "current_device_index", lambda: self.index),
                (torch.accelerator, "set_device_index", set_device),
                (torch.accelerator, "current_stream", current), (torch.accelerator, "synchronize", synchronize),
                (torch.cuda, "current_stream", current), (torch.cuda, "default_stream", current),
                (torch.cuda, "is_current_stream_capturing", lambda: False),
                (torch.cuda, "Stream", Stream), (torch.cuda, "Event", Event),
                (torch.cuda, "stream", lambda stream: contextlib.nullcontext(stream))]

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
        """The device's queued work is done and the non_blocking copies to the host land, as at a
        synchronisation."""
        for host, values in self.pending:
            host.copy_(values)
        self.pending.clear()
        self.queued = False

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
        self.queued = self.queued or side is not None  # CUDA runs it later: the host goes on at once
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


WORKER_LOG = "CUDA_STAND_IN_WORKERS"  # the file a study's workers on the stand-in tell what they saw
WORKER: CudaDeviceRules | None = None  # in a worker of `run_all` on the stand-in: its rules


def start_worker(stopping, started, devices: int) -> None:
    """`workers.start_worker` in a spawned worker of a machine of `devices` stand-in GPUs, where CUDA has not
    started: the stand-in is entered for the worker's life, before any of its code runs."""
    from study import workers  # here: the stand-in itself needs nothing of the project's
    global WORKER
    WORKER = CudaDeviceRules(count=devices)
    WORKER.__enter__()
    workers.start_worker(stopping, started, devices)


def with_threads(threads: int, fn: Callable, *args):
    """`workers.with_threads` in a worker started by `start_worker`, then one line in the file WORKER_LOG
    names: CUDA_VISIBLE_DEVICES as the worker's first CUDA call found it, and the devices it made tensors
    on."""
    import json
    from study import workers
    result = workers.with_threads(threads, fn, *args)
    with open(os.environ[WORKER_LOG], "a") as log:
        told = {"pid": os.getpid(), "visible": WORKER.seen_visible, "seen": sorted(WORKER.seen)}
        log.write(json.dumps(told) + "\n")
    return result
