"""Load a causal LM, sample groups of completions, and compute per-token log-probs of completions.

Models: a hub id (`Qwen/Qwen2.5-0.5B-Instruct`), a local folder, a `.gguf` file, or an alias (model_files.py):
`smollm2-135m`, SmolLM2-135M-Instruct embedded in a PyPI package (no model hub needed), or `tiny-qwen2`, a
tiny random Qwen2 for tests and smoke runs.

This file holds the plain definitions: sampling with HF `generate` (`sample_with_generate`) and the log-probs
as log_softmax(logits / T) at the targets (`completion_logprobs`). train.py's --fast swaps in other functions
with the same arguments and the same numbers, each tested against the definition here.
"""

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from model_files import gguf_folder, smollm2_folder, tiny_qwen2

# ----------------------------------------------------------------------------- loading


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


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
    """"fp32" or "bf16" for --precision auto|fp32|bf16. auto picks bf16 on CUDA and on CPUs with native bf16
    matmuls (avx512_bf16 or amx_bf16), where it halves the weight bytes that decoding streams; on other CPUs
    (AVX2 only) bf16 is emulated, each product converted in software, so auto stays in fp32 there."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16"
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
    return copy.deepcopy(model).to(torch.bfloat16)


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


def load_model(name: str,
               device: torch.device | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (model, tokenizer) from an alias, a .gguf file, a local folder or a hub id, in float32."""
    device = device or pick_device()
    if name == "tiny-qwen2":
        model, tokenizer = tiny_qwen2()
    else:
        path = Path(name).expanduser()
        if name == "smollm2-135m":
            path = smollm2_folder()
        elif path.suffix == ".gguf":
            path = gguf_folder(path)
        elif not path.exists() and (name.startswith((".", "/", "~")) or name.count("/") != 1):
            raise FileNotFoundError(f"unknown model {name!r}: not an alias (smollm2-135m, tiny-qwen2), "
                                    "a .gguf file, a folder or a hub id")
        if (path / "model" / "config.json").exists():  # a train.py checkpoint folder
            path = path / "model"
        source = str(path) if path.exists() else name
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        except OSError as e:  # no such hub id, no network, or a folder without a model
            raise FileNotFoundError(f"could not load model {name!r}: {str(e).splitlines()[0]}") from None
        except SafetensorError as e:  # a truncated or overwritten weights file (its message names none)
            damaged = ", ".join(str(f) for f in sorted(path.glob("*.safetensors"))) or str(path)
            raise FileNotFoundError(f"could not load model {name!r}: {damaged} is damaged ({e})") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # generation appends to the right end of every row
    return model.to(device).eval(), tokenizer  # eval mode (no dropout); training switches train mode on


# ----------------------------------------------------------------------------- sampling


@dataclass
class Rollout:
    """B*G sampled completions; rows b*G .. b*G+G-1 belong to prompt b."""

    input_ids: torch.Tensor  # [N, P + C] left-padded prompt followed by the completion
    attention_mask: torch.Tensor  # [N, P + C] 1 on prompt tokens and on completion tokens up to EOS
    completion_mask: torch.Tensor  # [N, C] 1 on completion tokens up to and including the first EOS
    texts: list[str]  # [N] decoded completions, without special tokens
    truncated: torch.Tensor  # [N] bool: hit max_new_tokens without an EOS

    @property
    def completion_len(self) -> int:
        return self.completion_mask.shape[1]


def format_prompts(tokenizer: PreTrainedTokenizerBase, questions: list[str]) -> list[str]:
    """Apply the chat template: each question becomes one user turn, then the assistant's turn opens."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                          add_generation_prompt=True) for q in questions]


def completion_mask_from_eos(completion_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Mask [N, C] up to and including the first EOS, by position: pad == EOS must not hide the real EOS."""
    is_eos = completion_ids == eos_token_id  # [N, C]
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion_ids.shape[1])  # [N]
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)  # [C]
    return (positions[None, :] <= first_eos[:, None]).long()  # [N, C]


def next_tokens(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """One token per row [n] from logits [n, V]: argmax if temperature is 0, else a draw from
    softmax(logits / T) restricted to the top_p nucleus (top_k=0, no repetition penalty), the distribution the
    log-probs use.

    The draw is by inverse CDF, one uniform number per row: `torch.multinomial` draws one exponential per
    vocabulary entry (rows x vocabulary random numbers per token) for the same distribution.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [n, V]
    if top_p < 1.0:  # keep the most likely tokens until their mass reaches top_p (at least one)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs * (mass_before < top_p))
    cdf = probs.cumsum(dim=-1)  # [n, V], unnormalised after top_p: scale the uniform by the total instead
    u = torch.rand(len(cdf), 1, device=cdf.device) * cdf[:, -1:]  # [n, 1] in [0, total)
    # first index whose cdf exceeds u; side="right" never lands on a zero-probability token
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=cdf.shape[1] - 1)


def sample_with_generate(model: PreTrainedModel, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                         group_size: int, max_new_tokens: int, temperature: float, top_p: float,
                         eos_token_id: int, pad_token_id: int) -> torch.Tensor:
    """Completion ids [B*G, C] for left-padded prompts [B, P], G per prompt, from transformers' `generate`;
    positions after a row's EOS hold pad, and C is where the last row ended (or max_new_tokens)."""
    # Explicit settings override a checkpoint's generation_config.json (Qwen ships top_k=20 and
    # repetition_penalty=1.05), so samples come from softmax(logits / T), the distribution the loss uses.
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else {}
    prompt_ids, prompt_mask = (x.repeat_interleave(group_size, dim=0) for x in (prompt_ids, prompt_mask))
    out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **sampling, repetition_penalty=1.0,
                         max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    return out[:, prompt_ids.shape[1]:]  # generate stops as soon as every row has produced EOS


def sample(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, questions: list[str], group_size: int,
           max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
           sample_completions: Callable = sample_with_generate) -> Rollout:
    """B*G completions, G per question, as a `Rollout`; temperature 0 means greedy decoding. The completion
    ids come from `sample_completions`, `sample_with_generate` or any function with its arguments."""
    enc = tokenizer(format_prompts(tokenizer, questions), return_tensors="pt", padding=True,
                    add_special_tokens=False, padding_side="left").to(model.device)  # completions go right
    completion_ids = sample_completions(model, enc["input_ids"], enc["attention_mask"], group_size,
                                        max_new_tokens, temperature, top_p, tokenizer.eos_token_id,
                                        tokenizer.pad_token_id)  # [N, C]
    completion_mask = completion_mask_from_eos(completion_ids, tokenizer.eos_token_id)  # [N, C]
    prompt_ids = enc["input_ids"].repeat_interleave(group_size, dim=0)  # [N, P]
    prompt_mask = enc["attention_mask"].repeat_interleave(group_size, dim=0)  # [N, P]
    return Rollout(
        input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, completion_mask], dim=1),
        completion_mask=completion_mask,
        texts=tokenizer.batch_decode(completion_ids.masked_fill(completion_mask == 0, tokenizer.pad_token_id),
                                     skip_special_tokens=True),
        truncated=completion_mask.all(dim=1) & (completion_ids[:, -1] != tokenizer.eos_token_id),
    )


# ----------------------------------------------------------------------------- log-probs


def completion_logprobs(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        completion_len: int, temperature: float = 1.0) -> torch.Tensor:
    """Per-token log pi(token | prefix) [N, C] of the last C = `completion_len` tokens of each row, 0 where
    the attention mask is 0 (after a row's EOS): log softmax(logits / T) at each token, T the sampling
    temperature, so they are the log-probs of the distribution sampled from. Logits only at the C completion
    positions."""
    positions = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # [N, T]: count real tokens, as sampling did
    logits = model(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1],  # the last token is
                   position_ids=positions[:, :-1], use_cache=False,  # no input: it predicts nothing
                   logits_to_keep=completion_len).logits  # [N, C, V]: position t predicts token t + 1
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [N, C, V]
    picked = logp.gather(-1, input_ids[:, -completion_len:, None]).squeeze(-1)  # [N, C]
    return picked.masked_fill(attention_mask[:, -completion_len:] == 0, 0.0)


# ----------------------------------------------------------------------------- micro-batches of a rollout


def trim_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor):
    """Drop leading all-pad columns and trailing all-finished columns of a micro-batch (padding waste)."""
    start = int(attention_mask.any(0).int().argmax())  # first column with a real token in some row
    completion_len = int(completion_mask.sum(1).max())
    end = input_ids.shape[1] - completion_mask.shape[1] + completion_len
    return input_ids[:, start:end], attention_mask[:, start:end], completion_mask[:, :completion_len]


def real_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int) -> int:
    """Tokens rows [n, P + C] hold without padding, each distinct prompt counted once: what a forward pass
    over them must process (the plain pass runs the padded rectangle), the update's logged work."""
    prompt_len = input_ids.shape[1] - completion_len
    prompts = {tuple(ids[mask.bool()].tolist())
               for ids, mask in zip(input_ids[:, :prompt_len], attention_mask[:, :prompt_len])}
    return sum(map(len, prompts)) + int(attention_mask[:, prompt_len:].sum())


def replace_groups(rollout: Rollout, groups: list[int], new: Rollout, group_size: int,
                   pad_token_id: int) -> Rollout:
    """`rollout` with its groups `groups` (G rows each) replaced, in order, by the groups of `new`; both are
    first padded to the wider prompt (on the left, as sampled) and the longer completion (on the right)."""
    prompt_len = max(r.input_ids.shape[1] - r.completion_len for r in (rollout, new))
    completion_len = max(rollout.completion_len, new.completion_len)

    def widen(r: Rollout) -> Rollout:
        left = prompt_len - (r.input_ids.shape[1] - r.completion_len)
        right = completion_len - r.completion_len
        return Rollout(F.pad(r.input_ids, (left, right), value=pad_token_id),
                       F.pad(r.attention_mask, (left, right)), F.pad(r.completion_mask, (0, right)),
                       list(r.texts), r.truncated.clone())

    out, new = widen(rollout), widen(new)
    rows = torch.tensor([g * group_size + i for g in groups for i in range(group_size)], dtype=torch.long)
    for name in ("input_ids", "attention_mask", "completion_mask", "truncated"):
        getattr(out, name)[rows] = getattr(new, name).to(getattr(out, name).device)
    for row, text in zip(rows.tolist(), new.texts):
        out.texts[row] = text
    return out
