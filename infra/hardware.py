"""Where a run runs: the device (CUDA or the CPU, and why not CUDA), the precision (bf16 where the device has
it natively), and the bf16 working copy trained beside float32 master weights.

train.py and eval.py print `where` first, so a silent fallback to the CPU, or to emulated bf16, shows.
"""

import copy
import os
import resource
from pathlib import Path

import torch
from transformers import PreTrainedModel

from infra.lora import has_adapters

DEVICES = ("auto", "cpu", "cuda")


def cuda_problem() -> str | None:
    """Why this process cannot use CUDA, in words (None when it can): a CPU build of torch, or no device the
    driver lets it see (no GPU, CUDA_VISIBLE_DEVICES empty, or a driver older than the wheel's CUDA)."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU-only build"
    if not torch.cuda.is_available():
        return (f"torch {torch.__version__} sees no CUDA device (no GPU or driver, CUDA_VISIBLE_DEVICES "
                f"empty, or a driver older than CUDA {torch.version.cuda})")
    return None


def pick_device(name: str = "auto") -> torch.device:
    """--device auto|cpu|cuda: auto takes CUDA where this process can use it, else the CPU (the run's first
    line says which, and why not CUDA); cuda where it cannot is a ValueError naming the reason."""
    if name == "cpu" or name == "auto" and cuda_problem():
        return torch.device("cpu")
    if problem := cuda_problem():
        raise ValueError(f"--device cuda: {problem}")
    cuda_settings()
    return torch.device("cuda")


def cuda_settings() -> None:
    """Every setting a CUDA run makes, here and nowhere else, before CUDA's first allocation (a run picks its
    device before any model). The caching allocator maps growable segments, so the update's and sampling's
    ever-changing tensor sizes do not strand memory in fixed blocks, unless the user set the allocator's
    options (PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF). float32 products stay float32, as the CPU's
    definition computes them: torch's defaults, stated so that nothing imported turns TF32 (a 10-bit
    mantissa: silently other numbers) or cuDNN's autotuning (kernels chosen by timing) on. SDPA does not try
    cuDNN's attention."""
    if not (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    # cuDNN's kernel, first in line for masked bf16 SDPA on sm90, builds a graph for each new shape, and HF
    # generate's key length changes at every token; the memory-efficient kernel takes the same masks (not
    # measured here: benchmarks/gpu_bench.py --smoke names the kernel each attention gets)
    torch.backends.cuda.enable_cudnn_sdp(False)


def describe_device(device: torch.device) -> str:
    """The device in words, for a run's first line: a GPU's name and memory; the CPU's name, and why not CUDA
    where it was not usable (a silent fallback hides a CPU wheel or an old driver)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{device} ({props.name}, {props.total_memory / 2**30:.0f} GiB)"
    try:
        name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        name = "CPU"
    return f"cpu ({name}" + (f"; no CUDA: {problem})" if (problem := cuda_problem()) else ")")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process so far on `device`, counted as infra/memory.py's estimate counts it. On a
    GPU (since the last reset of the peak statistics): what the caching allocator reserved at its peak, not
    only what tensors held (max_memory_allocated leaves out its reserve), plus the CUDA context and kernel
    workspaces, the device's used memory beyond the allocator's now (mem_get_info: another process on the GPU
    counts in it). On the CPU: the resident set size, the whole process's."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return torch.cuda.max_memory_reserved(device) + (total - free - torch.cuda.memory_reserved(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class SamplingOutOfMemory(torch.OutOfMemoryError):
    """Out of device memory while sampling a step: before its advantages (AVSPO's trigger state) and its
    update, so the steps before it can be saved as they were (`run.before_failed_step`). In the update the
    weights may have moved part-way (a second PPO epoch, inside the optimizer's step): only the checkpoints
    already saved stand."""


def out_of_memory(error: torch.OutOfMemoryError) -> str:
    """One line for an out-of-memory error mid-run, saying what to change: a step's prompts follow from
    --seed and the step, so --resume as it was would meet the same wall."""
    what = str(error).splitlines()[0] if str(error) else type(error).__name__
    kept = ("the steps before it are saved (unless --save-every 0)" if isinstance(error, SamplingOutOfMemory)
            else "past sampling, so only the checkpoints saved before it stand (--save-every)")
    return (f"out of device memory ({what}); {kept}: before --resume, lower --max-prompt-tokens, "
            "--micro-batch, --prompts-per-step or --group-size, or add --grad-checkpointing (the first line's "
            "estimate says which phase is the larger)")


def resident_bytes() -> int:
    """This process's resident memory now (Linux's /proc/self/statm; elsewhere its peak so far): before a
    model loads, what Python, torch and transformers hold beside any tensor, which infra/memory.py's estimate
    counts on the CPU as the runtime."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return peak_memory_bytes(torch.device("cpu"))


def device_memory_bytes(device: torch.device) -> int:
    """The memory a run on `device` may fill: the GPU's, or the machine's RAM."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_features() -> set[str]:
    """The CPU's instruction-set flags that matter for matmul speed, from /proc/cpuinfo (empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
    except OSError:
        pass
    return set()


def resolve_precision(precision: str, device: torch.device) -> str:
    """"fp32" or "bf16" for --precision auto|fp32|bf16. auto picks bf16 where the device computes it natively:
    CUDA GPUs with bf16 tensor cores (Ampere and later; not a T4 or V100) and CPUs with avx512_bf16 or
    amx_bf16, where it halves the weight bytes that decoding streams; elsewhere bf16 is emulated, each product
    converted in software, so auto stays in fp32 there."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp32"
    return "bf16" if cpu_features() & {"avx512_bf16", "amx_bf16"} else "fp32"


def working_copy(model: PreTrainedModel, precision: str = "auto") -> PreTrainedModel:
    """The network that samples, computes log-probs and backpropagates: where `precision` resolves to bf16
    (`resolve_precision`), a bf16 copy of the float32 `model`, else `model` itself.

    bf16 mixed precision with float32 master weights, as Megatron-LM and DeepSpeed do it: forward and backward
    run on the bf16 copy, `accumulate_gradients` adds each micro-batch's gradients to the float32 ones the
    optimizer steps, and `copy_weights` rounds the new weights back into the copy. Autocast instead re-casts
    every float32 weight at every forward (decoding streams all weights once per token, so it would cast them
    all once per token) and casts every weight gradient back per micro-batch; the copy casts once per
    optimizer step (benchmarks/bench.py --precision bf16 times both phases). Sampling and training use the
    same bf16 network, so the log-probs a gradient follows are the sampled policy's own.
    """
    if resolve_precision(precision, model.device) == "fp32":
        return model
    if has_adapters(model):  # LoRA: its frozen weights in bf16, in place (no float32 copy); adapters float32
        return cast_weights(model, torch.bfloat16, frozen_only=True)
    return cast_weights(copy.deepcopy(model), torch.bfloat16)


def cast_weights(model: PreTrainedModel, dtype: torch.dtype, frozen_only: bool = False) -> PreTrainedModel:
    """`model` with its parameters (`frozen_only`: those without requires_grad) cast to `dtype` and its
    buffers as they are, as from_pretrained(dtype=...) loads it: the rotary inv_freq stays float32.
    `model.to(dtype)` would cast it too: a rotary phase error that grows with the position, and log-probs
    unlike those of the same weights loaded in bf16."""
    for param in model.parameters():
        if not (frozen_only and param.requires_grad):
            param.data = param.data.to(dtype)
    return model


def copy_weights(model: PreTrainedModel, into: PreTrainedModel) -> None:
    """After an optimizer step: the working copy (`working_copy`) takes the float32 weights, in its dtype."""
    if into is not model:
        with torch.no_grad():
            for dst, src in zip(into.parameters(), model.parameters()):
                dst.copy_(src)


def accumulate_gradients(net: PreTrainedModel, into: PreTrainedModel) -> None:
    """After a backward pass on the working copy `net`: add its gradients to the float32 ones of `into`
    (summing micro-batches in float32, not in bf16) and free them."""
    if net is into:
        return
    for master, param in zip(into.parameters(), net.parameters()):
        if param.grad is not None:
            master.grad = param.grad.float() if master.grad is None else master.grad.add_(param.grad)
            param.grad = None


def where(master: PreTrainedModel, policy: PreTrainedModel, precision: str) -> str:
    """The device and the precision in words, for a run's first line: "cpu (<its name>; no CUDA: <why>); bf16
    (float32 master weights, a bfloat16 working copy)", or under LoRA "...; bf16 (bfloat16 frozen weights,
    float32 LoRA adapters)"."""
    dtypes = f"{master.dtype} master weights" + (f", a {policy.dtype} working copy" if policy is not master
                                                 else "")
    if has_adapters(master):
        dtypes = f"{policy.dtype} frozen weights, float32 LoRA adapters"
    return (f"{describe_device(master.device)}; {resolve_precision(precision, master.device)} "
            f"({dtypes.replace('torch.', '')})")
