"""LoRA (Hu et al., 2021, arXiv 2106.09685) through peft: train.py --lora-rank r trains low-rank adapters on
every linear layer and freezes the model's own weights, which stay in the working precision (bf16 on a
GPU, with no float32 master copy of them); the adapters and their AdamW moments are float32.

    W x  ->  W x + (alpha / r) B A x,   A [r, d_in] random, B [d_out, r] zeros: a run starts at the base

Why every linear layer and alpha 32: "LoRA Without Regret" (Schulman et al., Thinking Machines, 2025) finds
that in policy-gradient RL LoRA matches full fine-tuning, even at rank 1, when it sits on every linear layer
(the MLP's included: attention alone trails), at about 10x full fine-tuning's learning rate; with alpha fixed
at 32 and the alpha / r scaling above, the best learning rate hardly depends on the rank. Their runs use alpha
32, as do Tinker's (rank 32 by default). The output layer is left alone (peft's "all-linear"), and there is no
dropout: the policy that samples must be the one whose log-probs are trained.

What LoRA gives for free: the reference policy (AAPO's r_ref, the KL of --beta) is the base, that is the
policy with its adapters off (`adapters_off`), not a second copy of the weights. A checkpoint holds the
adapters alone, a few MB, in peft's format (adapter_model.safetensors and adapter_config.json, which names
the base model as train.py was given it); `model.load_model` loads base plus adapters from it.

A name is not an identity: a file replaced in place by another model of the same shapes would take the
adapters without a word. So the adapters' file also records the base's identity, the content hash of its
weights (`base_identity`, as the model cache keys a model), and every load checks it: a different base
is one line naming both. Adapters saved before they recorded it load unchecked, with a warning, and record
the base they are loaded onto at their next save (a resumed run).

For use elsewhere (vLLM, transformers without peft), merge.py writes the adapters merged into the base as
one model (`merged`).

peft is imported only where it is used: importing it takes about 2 s, and full fine-tuning never needs it.
"""

import contextlib
import hashlib
import json
import sys
from pathlib import Path
from typing import Callable

import torch
from huggingface_hub import snapshot_download
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from transformers.pytorch_utils import Conv1D

from infra.model_files import SMOLLM2_SHA256, file_sha256, tiny_qwen2

ADAPTERS = "adapter_model.safetensors"  # peft's names, so that peft's PeftModel.from_pretrained reads them
ADAPTER_CONFIG = "adapter_config.json"
BASE_SHA256 = "base_sha256"  # the key, in the adapters' file's metadata, of their base's identity


def adapted_layers(model) -> dict[str, torch.nn.Module]:
    """The layers `add_adapters` adapts, by name: every linear layer but the output layer (peft's
    "all-linear", which counts transformers' Conv1D as linear)."""
    output = model.get_output_embeddings()
    return {name: module for name, module in model.named_modules()
            if isinstance(module, (torch.nn.Linear, Conv1D)) and module is not output}


def check_rank(rank: int, model) -> None:
    """A ValueError, in one line, if `rank` is above what any layer of `model` that adapters would adapt can
    use: B A of a [d_out, d_in] layer has rank min(d_in, d_out) at most, so a rank above every layer's only
    adds parameters no layer uses (and at 2**66, an allocator's traceback). Our reading of issue 61's "the
    smallest adapted layer's width": that one would refuse a rank that the other layers use in full (rank 32
    on tiny-qwen2, whose k_proj alone is 16 wide; the lora part's arms are ranks 1 and 32). Shapes alone:
    `model` may be on the meta device, as train.py checks --lora-rank before any model loads."""
    widths = {name: min(layer.weight.shape) for name, layer in adapted_layers(model).items()}
    widest = max(widths, key=widths.get)
    if rank > widths[widest]:
        raise ValueError(f"--lora-rank {rank} is above {widths[widest]}, the most rank any adapted layer can "
                         f"use (the smaller of its widths, at most; {widest}): choose at most "
                         f"{widths[widest]}")


def add_adapters(model, rank: int, alpha: float, base: str, seed: int, identity: str | None = None) -> None:
    """Adapters of rank `rank` on every linear layer of `model` but the output layer, in place; the model's
    own weights are frozen (requires_grad False). `base` is the model's name as given (an alias, a hub id or
    a folder) and `identity` its content hash (`base_identity`), which the checkpoints record (None:
    adapters never saved, as the benchmarks'). A is drawn from `seed`: the same on every process of torchrun,
    and in every run of that seed."""
    from peft import LoraConfig, inject_adapter_in_model
    source = str(Path(base).resolve()) if Path(base).exists() else base  # a folder: found from anywhere
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules="all-linear", lora_dropout=0.0,
                        base_model_name_or_path=source)
    torch.manual_seed(seed)
    inject_adapter_in_model(config, model)
    model.lora_base = identity


def has_adapters(model) -> bool:
    """Whether `model` carries LoRA adapters (peft records its config on the model it changes)."""
    return hasattr(model, "peft_config")


@contextlib.contextmanager
def adapters_off(model):
    """`with adapters_off(policy) as reference`: the base model, the policy with every adapter off."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def adapter_output(linear: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """x -> what the adapters of `linear` add to its output, (alpha / r) B A x over its active adapters,
    computed as peft's lora.Linear.forward computes it (x cast to the adapters' float32, B's bias if it has
    one), for code that runs the layer's weight itself (fast/decoding.py's `decode_weights`); None where
    adapters add nothing (a plain layer, adapters off, adapters merged in). Apart from W, not merged into it:
    in a bf16 model, W + (alpha / r) B A would be rounded to bf16 where peft rounds the sum of the two
    outputs, and the policy that samples would differ (by bf16 rounding) from the one whose log-probs the
    update follows."""
    if not hasattr(linear, "lora_A") or linear.disable_adapters or linear.merged:  # peft's layers have lora_A
        return None
    names = [name for name in linear.active_adapters if name in linear.lora_A]
    if not names:
        return None

    def output(x: torch.Tensor) -> torch.Tensor:
        return sum(linear.lora_B[name](linear.lora_A[name](x.to(linear.lora_A[name].weight.dtype)))
                   * linear.scaling[name] for name in names)
    return output


def has_variants(model) -> bool:
    """Whether an adapter of `model` is a LoRA variant (DoRA and others, peft's lora_variant) whose forward is
    more than W x + (alpha / r) B A x: `adapter_output` does not compute those."""
    return any(getattr(module, "lora_variant", None) for module in model.modules())


def save_adapters(model, folder: Path) -> None:
    """The adapters' float32 weights and their config into `folder`, as peft's save_pretrained writes them,
    with their base's identity in the weights' metadata."""
    from peft import get_peft_model_state_dict
    folder.mkdir(parents=True, exist_ok=True)
    identity = {BASE_SHA256: model.lora_base} if getattr(model, "lora_base", None) else {}
    # save_embedding_layers False: "auto" looks the base up on the hub to see whether its vocabulary grew
    save_file(get_peft_model_state_dict(model, save_embedding_layers=False), str(folder / ADAPTERS),
              metadata={"format": "pt", **identity})  # "format": what peft's own save writes
    model.peft_config["default"].save_pretrained(str(folder))


def adapter_folder(name: str) -> Path | None:
    """The folder of LoRA adapters that model name `name` is (a folder holding adapter_config.json, or a
    checkpoint whose model/ does), or None."""
    path = Path(name).expanduser()
    return next((p for p in (path, path / "model") if (p / ADAPTER_CONFIG).is_file()), None)


def base_of(folder: Path) -> str:
    """The base model that the adapters in `folder` were trained on, as train.py was given it."""
    try:
        return json.loads((folder / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{folder / ADAPTER_CONFIG} is damaged: it names no base model") from None


def digest(parts: list[str]) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def base_identity(name: str) -> str:
    """The content hash of the weights model `name` loads (model.load_model), as the model cache keys a model:
    a GGUF file's sha256 (smollm2-135m's, pinned), a folder's *.safetensors' (the sha256 of their names and
    sha256s; a train.py checkpoint's in its model/, a hub id's in the hub's cache), a LoRA checkpoint's
    adapters and config with its base's, and tiny-qwen2's generated weights. What a LoRA checkpoint records
    of its base, and what every load of it checks. Each file is read once in a process while it is unchanged
    (`file_sha256`)."""
    path = Path(name).expanduser()
    if adapters := adapter_folder(name):  # first, as in load_model
        return digest([file_sha256(adapters / f) for f in (ADAPTERS, ADAPTER_CONFIG)]
                      + [base_identity(base_of(adapters))])
    if name == "smollm2-135m":
        return SMOLLM2_SHA256
    if name == "tiny-qwen2":
        with torch.random.fork_rng(devices=[]):  # tiny_qwen2 seeds the generator a run goes on drawing from
            weights = tiny_qwen2()[0].state_dict()
        return digest([f"{k} {hashlib.sha256(w.numpy().tobytes()).hexdigest()}" for k, w in weights.items()])
    if path.suffix == ".gguf":
        return file_sha256(path)
    folder = path / "model" if (path / "model" / "config.json").is_file() else path  # as model.model_source
    if not folder.exists():  # a hub id (loaded before this is asked): the files from_pretrained fetched
        folder = Path(snapshot_download(name, allow_patterns=["*.safetensors"], local_files_only=True))
    return digest([f"{f.name} {file_sha256(f)}" for f in sorted(folder.glob("*.safetensors"))])


def checked_adapters(folder: Path, device: str = "cpu") -> tuple:
    """(config, weights on `device`, the base's identity now, the identity the adapters record or None) of
    the adapters saved in `folder`. Adapters that record another base than the one `base_of(folder)` names
    now (`base_identity`), a damaged weights' file and a config whose rank is not the weights' are a
    ValueError in one line. train.py asks before any model loads (`run.check_inputs`), so a refused
    checkpoint leaves no run folder behind."""
    from peft import LoraConfig
    path, config, base = folder / ADAPTERS, LoraConfig.from_pretrained(str(folder)), base_of(folder)
    try:
        with safe_open(str(path), "pt") as f:
            recorded = (f.metadata() or {}).get(BASE_SHA256)
        weights = load_file(str(path), device=device)
    except SafetensorError as e:  # cut short, or not safetensors: its message names no file
        raise ValueError(f"{path} is damaged ({e})") from None
    identity = base_identity(base)
    if recorded is not None and recorded != identity:
        raise ValueError(f"{folder} holds adapters trained on {base} of sha256 {recorded[:16]}, but {base} "
                         f"is now sha256 {identity[:16]}, another model: load them onto the one they were "
                         "trained on")
    if not config.rank_pattern and (odd := next((k for k, w in weights.items() if ".lora_" in k and
                                                 w.shape[0 if ".lora_A." in k else 1] != config.r), None)):
        raise ValueError(f"{folder} is damaged: its {ADAPTER_CONFIG} says rank {config.r}, its {ADAPTERS} "
                         f"holds {odd} of shape {list(weights[odd].shape)}")
    return config, weights, identity, recorded


def load_adapters(model, folder: Path):
    """`model` (the base: the model `base_of(folder)` names, as loaded) with the adapters saved in `folder`,
    trainable, once `checked_adapters` takes them; returns it. A base with adapters of its own (a --lora-rank
    run started from another one's checkpoint) has them merged in first."""
    from peft import inject_adapter_in_model, set_peft_model_state_dict
    config, weights, identity, recorded = checked_adapters(folder, str(next(model.parameters()).device))
    path, base = folder / ADAPTERS, base_of(folder)
    if recorded is None:
        print(f"warning: {path} records no identity of its base (saved before adapters did): loaded onto "
              f"{base} unchecked", file=sys.stderr)
    inject_adapter_in_model(config, merged(model))
    try:
        result = set_peft_model_state_dict(model, weights)
    except RuntimeError as e:  # weights of other shapes: adapters of another model
        raise ValueError(f"{path} does not fit {base}: {str(e).strip().splitlines()[-1].strip()}") from None
    if missing := [k for k in result.missing_keys if "lora_" in k]:
        raise ValueError(f"{path} lacks adapter weights the config names ({missing[0]}, ...)")
    model.lora_base = identity  # recorded at the next save: a resumed run's checkpoints
    return model


def merged(model):
    """`model` with any adapters it carries added into their layers' weights (W + alpha / r B A), peft's
    layers replaced by the plain ones and every weight trainable again: a model transformers alone can load,
    and one a run can start from."""
    if not has_adapters(model):
        return model
    from peft.tuners.lora import LoraLayer
    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.get_base_layer())
    del model.peft_config
    return model.requires_grad_(True)
