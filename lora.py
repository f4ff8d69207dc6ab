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

For use elsewhere (vLLM, transformers without peft), merge.py writes the adapters merged into the base as
one model (`merged`).

peft is imported only where it is used: importing it takes about 2 s, and full fine-tuning never needs it.
"""

import contextlib
import json
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

ADAPTERS = "adapter_model.safetensors"  # peft's names, so that peft's PeftModel.from_pretrained reads them
ADAPTER_CONFIG = "adapter_config.json"


def add_adapters(model, rank: int, alpha: float, base: str, seed: int) -> None:
    """Adapters of rank `rank` on every linear layer of `model` but the output layer, in place; the model's
    own weights are frozen (requires_grad False). `base` is the model's name as given (an alias, a hub id or
    a folder), which the checkpoints record. A is drawn from `seed`: the same on every process of torchrun,
    and in every run of that seed."""
    from peft import LoraConfig, inject_adapter_in_model
    source = str(Path(base).resolve()) if Path(base).exists() else base  # a folder: found from anywhere
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules="all-linear", lora_dropout=0.0,
                        base_model_name_or_path=source)
    torch.manual_seed(seed)
    inject_adapter_in_model(config, model)


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
    one), for code that runs the layer's weight itself (decoding.py's `decode_weights`); None where adapters
    add nothing (a plain layer, adapters off, adapters merged in). Apart from W, not merged into it: in a bf16
    model, W + (alpha / r) B A would be rounded to bf16 where peft rounds the sum of the two outputs, and the
    policy that samples would differ (by bf16 rounding) from the one whose log-probs the update follows."""
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
    """The adapters' float32 weights and their config into `folder`, as peft's save_pretrained writes them."""
    from peft import get_peft_model_state_dict
    folder.mkdir(parents=True, exist_ok=True)
    # save_embedding_layers False: "auto" looks the base up on the hub to see whether its vocabulary grew
    save_file(get_peft_model_state_dict(model, save_embedding_layers=False), str(folder / ADAPTERS))
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


def load_adapters(model, folder: Path):
    """`model` (the base) with the adapters saved in `folder`, trainable; returns it. A base with adapters of
    its own (a --lora-rank run started from another one's checkpoint) has them merged in first."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    inject_adapter_in_model(LoraConfig.from_pretrained(str(folder)), merged(model))
    weights = load_file(str(folder / ADAPTERS), device=str(next(model.parameters()).device))
    result = set_peft_model_state_dict(model, weights)
    if missing := [k for k in result.missing_keys if "lora_" in k]:
        raise ValueError(f"{folder / ADAPTERS} lacks adapter weights the config names ({missing[0]}, ...)")
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
