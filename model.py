"""Load a causal LM, sample groups of completions, and compute per-token log-probs of completions.

Models: a hub id (`Qwen/Qwen2.5-0.5B-Instruct`), a local folder, a `.gguf` file, or an alias
(infra/model_files.py): `smollm2-135m`, SmolLM2-135M-Instruct embedded in a PyPI package (no model hub
needed), or `tiny-qwen2`, a tiny random Qwen2 for tests and smoke runs.

This file holds the plain definitions: sampling with HF `generate` (`sample_with_generate`) and the log-probs
as log_softmax(logits / T) at the targets (`completion_logprobs`). train.py's --fast swaps in other functions
with the same arguments and the same numbers, each tested against the definition here.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from safetensors import SafetensorError
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel,
                          PreTrainedTokenizerBase)

from infra.hardware import pick_device
from infra.lora import ADAPTER_CONFIG, adapter_folder, base_of, load_adapters
from infra.model_files import (byte_tokenizer, gguf_folder, settled, smollm2_folder, tiny_qwen2,
                               tiny_qwen2_config)

# ----------------------------------------------------------------------------- loading


def model_source(name: str) -> str:
    """What from_pretrained reads for `name`: an alias's or a .gguf file's converted folder, a checkpoint's
    model folder, a folder, or a hub id."""
    path = settled(Path(name).expanduser())  # a checkpoint being saved: the new one, once in place
    if name == "smollm2-135m":
        path = smollm2_folder()
    elif path.suffix == ".gguf":
        path = gguf_folder(path)
    elif not name.strip() or not path.exists() and (name.startswith((".", "/", "~")) or name.count("/") != 1):
        raise FileNotFoundError(f"unknown model {name!r}: not an alias (smollm2-135m, tiny-qwen2), "
                                "a .gguf file, a folder or a hub id")
    if any((path / "model" / f).exists() for f in ("config.json", ADAPTER_CONFIG)):  # a train.py checkpoint
        path = path / "model"
    return str(path) if path.exists() else name


def from_source(auto_class, name: str, **kwargs):
    """auto_class.from_pretrained for `name` (`model_source`); a failure is one line."""
    source = model_source(name)
    try:
        return auto_class.from_pretrained(source, **kwargs)
    except OSError as e:  # no such hub id, no network, a folder without a model or with pickled weights only
        pickled = sorted(Path(source).glob("pytorch_model*.bin"))
        why = (f"{pickled[0]} is refused unread: a pickle, which could run code (safetensors are read)"
               if pickled and not any(Path(source).glob("*.safetensors")) else str(e).splitlines()[0])
        raise FileNotFoundError(f"could not load model {name!r}: {why}") from None
    except SafetensorError as e:  # a truncated or overwritten weights file (its message names none)
        damaged = ", ".join(str(f) for f in sorted(Path(source).glob("*.safetensors"))) or source
        raise FileNotFoundError(f"could not load model {name!r}: {damaged} is damaged ({e})") from None


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The tokenizer of model `name` (as `load_model` gives it); alone, it loads in a second, so train.py
    checks the prompt format with it before any model loads."""
    tokenizer = byte_tokenizer() if name == "tiny-qwen2" else from_source(AutoTokenizer, name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # generation appends to the right end of every row
    return tokenizer


def load_config(name: str) -> PretrainedConfig:
    """The config of model `name` (its shapes and context, as `load_model`'s model has it) without its
    weights: eval.py checks every model's prompts with it before any model loads."""
    if adapters := adapter_folder(name):
        return load_config(base_of(adapters))
    return tiny_qwen2_config() if name == "tiny-qwen2" else from_source(AutoConfig, name)


def load_model(name: str,
               device: torch.device | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer) from an alias, a .gguf file, a folder, a hub id or LoRA adapters, in float32."""
    device = device or pick_device()
    tokenizer = load_tokenizer(name)
    if adapters := adapter_folder(name):  # a --lora-rank checkpoint (infra/lora.py): its base, then adapters
        return load_adapters(load_model(base_of(adapters), device)[0], adapters), tokenizer
    # Safetensors only: unpickling weights could run code. No hub kernels: transformers 5.25 turns them on by
    # default, and on CUDA model.train() then fetches layers from the hub (kernels-community's rotary), which
    # fails at the first update on a machine without it and may swap in another kernel on one with it.
    model = (tiny_qwen2()[0] if name == "tiny-qwen2"
             else from_source(AutoModelForCausalLM, name, dtype=torch.float32, use_safetensors=True,
                              use_kernels=False))
    return model.to(device).eval(), tokenizer  # eval mode (no dropout); training switches train mode on


def checkpoint_activations(model: PreTrainedModel) -> None:
    """--grad-checkpointing: each decoder layer keeps only its input for backward and recomputes the rest
    there. transformers 5.25 names the call activation_checkpointing_enable and warns at the old name,
    gradient_checkpointing_enable, the only one 5.17 has; both set `gradient_checkpointing` on the layers."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


# ----------------------------------------------------------------------------- sampling


@dataclass
class Rollout:
    """B*G sampled completions; rows b*G .. b*G+G-1 belong to prompt b."""

    input_ids: torch.Tensor  # [N, P + C] left-padded prompt followed by the completion
    attention_mask: torch.Tensor  # [N, P + C] 1 on prompt tokens and on completion tokens up to EOS
    completion_mask: torch.Tensor  # [N, C] 1 on completion tokens up to and including the first stop token
    texts: list[str]  # [N] decoded completions up to the first stop token, without special tokens
    truncated: torch.Tensor  # [N] bool: hit max_new_tokens without a stop token

    @property
    def completion_len(self) -> int:
        return self.completion_mask.shape[1]


PROMPT_FORMATS = ("chat", "raw")
# --prompt-format raw, for base models: the question, then Qwen2.5-Math's chain-of-thought instruction, as the
# user turn of its evaluation template "qwen-boxed" has them (QwenLM/Qwen2.5-Math, evaluation/utils.py),
# without the chat markup; the newline after it is ours. The verifier reads the last \boxed{}.
RAW_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def format_prompts(tokenizer: PreTrainedTokenizerBase, questions: list[str], prompt_format: str = "chat",
                   system: str = "", instructions: list[str] | None = None) -> list[str]:
    """The prompt of each question; the format owns the instruction, so a prompt gives one. chat: the
    tokenizer's chat template, the `system` message (if any), one user turn (the question, then its dataset's
    instruction if any: `data.tasks.Problem.instruction`), then the assistant's turn opens. raw: plain text,
    the question then `RAW_INSTRUCTION` in place of the dataset's."""
    if prompt_format == "raw":
        if system:
            raise ValueError("--system needs --prompt-format chat: a raw prompt has no system turn")
        return [f"{q}\n{RAW_INSTRUCTION}\n" for q in questions]
    users = [f"{q}\n{i}" if i else q for q, i in zip(questions, instructions or [""] * len(questions))]
    if tokenizer.chat_template is None:
        raise ValueError("the model's tokenizer has no chat template (a base model?): "
                         "use --prompt-format raw")
    system_turn = [{"role": "system", "content": system}] if system else []
    return [tokenizer.apply_chat_template(system_turn + [{"role": "user", "content": user}], tokenize=False,
                                          add_generation_prompt=True) for user in users]


def end_of_turn_token(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The special token with which the chat template closes an assistant turn (ChatML's <|im_end|>, Llama 3's
    <|eot_id|>), None without a template. Found by rendering one turn and reading the special token right
    after it, which needs no list of known names."""
    if tokenizer.chat_template is None:
        return None
    answer = "The answer is 2."
    text = tokenizer.apply_chat_template([{"role": "user", "content": "1 + 1?"},
                                          {"role": "assistant", "content": answer}], tokenize=False)
    after = text[text.rfind(answer) + len(answer):].lstrip() if answer in text else ""
    special = [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]
    return next((token for token in special if after.startswith(token)), None)


def stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end a completion, at the first of them: the tokenizer's EOS, the generation config's EOS
    ids (Qwen2.5-Instruct's lists <|im_end|> and <|endoftext|>) and the chat template's end of turn. Qwen2.5's
    base and Math tokenizers end text with <|endoftext|> but turns with <|im_end|>: stopping at EOS alone, a
    row runs on into turns it invents, and the reward reads the last answer of the last one."""
    configured = model.generation_config.eos_token_id  # None, an int or a list
    end_of_turn = end_of_turn_token(tokenizer)
    ids = {tokenizer.eos_token_id, *(configured if isinstance(configured, list) else [configured]),
           tokenizer.convert_tokens_to_ids(end_of_turn) if end_of_turn else None}
    return sorted(ids - {None})


def completion_mask_from_eos(completion_ids: torch.Tensor, eos_token_id: int | list[int]) -> torch.Tensor:
    """Mask [N, C] up to and including the first EOS (any of the ids given), by position: pad == EOS must not
    hide the real EOS."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_id, device=completion_ids.device))  # [N, C]
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
                         eos_token_id: int | list[int], pad_token_id: int) -> torch.Tensor:
    """Completion ids [B*G, C] for left-padded prompts [B, P], G per prompt, from transformers' `generate`;
    a row ends at its first EOS (any of the ids given), positions after it hold pad, and C is where the last
    row ended (or max_new_tokens)."""
    # Explicit settings override a checkpoint's generation_config.json (Qwen2.5-Instruct ships do_sample=true,
    # temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05): temperature 0 is greedy whatever it
    # says, and samples come from softmax(logits / T), the distribution the loss uses.
    sampling = (dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0
                else dict(do_sample=False, temperature=1.0, top_p=1.0))  # greedy: no sampling warper at all
    prompt_ids, prompt_mask = (x.repeat_interleave(group_size, dim=0) for x in (prompt_ids, prompt_mask))
    out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **sampling, repetition_penalty=1.0,
                         max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    return out[:, prompt_ids.shape[1]:]  # generate stops as soon as every row has produced EOS


def sample(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, questions: list[str], group_size: int,
           max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
           sample_completions: Callable = sample_with_generate, prompt_format: str = "chat",
           system: str = "", instructions: list[str] | None = None,
           stop_ids: list[int] | None = None) -> Rollout:
    """B*G completions, G per question, as a `Rollout`; temperature 0 means greedy decoding. Prompts as
    `format_prompts` writes them; the completion ids come from `sample_completions`, `sample_with_generate`
    or any function with its arguments; each completion ends at the first of `stop_ids`, and so do its mask
    and the text the reward reads (None: `stop_token_ids`, which a run works out once and passes)."""
    enc = tokenizer(format_prompts(tokenizer, questions, prompt_format, system, instructions),
                    return_tensors="pt", padding=True, padding_side="left",  # completions go right
                    add_special_tokens=prompt_format == "raw").to(model.device)  # a template writes its own
    stop_ids = stop_ids or stop_token_ids(model, tokenizer)
    completion_ids = sample_completions(model, enc["input_ids"], enc["attention_mask"], group_size,
                                        max_new_tokens, temperature, top_p, stop_ids,
                                        tokenizer.pad_token_id)  # [N, C]
    completion_mask = completion_mask_from_eos(completion_ids, stop_ids)  # [N, C]
    prompt_ids = enc["input_ids"].repeat_interleave(group_size, dim=0)  # [N, P]
    prompt_mask = enc["attention_mask"].repeat_interleave(group_size, dim=0)  # [N, P]
    ended = torch.isin(completion_ids[:, -1], torch.tensor(stop_ids, device=completion_ids.device))  # [N]
    return Rollout(
        input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, completion_mask], dim=1),
        completion_mask=completion_mask,
        texts=tokenizer.batch_decode(completion_ids.masked_fill(completion_mask == 0, tokenizer.pad_token_id),
                                     skip_special_tokens=True),
        truncated=completion_mask.all(dim=1) & ~ended,
    )


# ----------------------------------------------------------------------------- log-probs


LOGPROB_CHUNK = 256  # tokens whose float32 log-softmax exists at once: 156 MB at Qwen's 151,936 entries


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) at the targets, in float32: [n] from logits [n, V] and targets [n]; the
    target's scaled logit minus the logsumexp of them all."""
    scaled = logits.float() / temperature  # [n, V]
    return scaled.gather(1, targets[:, None]).squeeze(1) - scaled.logsumexp(dim=1)


def last_positions(ids: torch.Tensor, count: int) -> torch.Tensor:
    """`logits_to_keep` for the last `count` positions of rows `ids` [N, T], as indices: the output layer gets
    a contiguous input. transformers' slice, with the layer frozen (LoRA, the reference), makes torch's matmul
    copy the weight once per row on the CPU (3.6 GB for 64 rows of SmolLM2; CUDA's batched GEMM does not)."""
    return torch.arange(ids.shape[1] - count, ids.shape[1], device=ids.device)


def completion_logprobs(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        completion_len: int, temperature: float = 1.0) -> torch.Tensor:
    """Per-token log pi(token | prefix) [N, C] of the last C = `completion_len` tokens of each row, 0 where
    the attention mask is 0 (after a row's EOS): log softmax(logits / T) at each token, T the sampling
    temperature, so they are the log-probs of the distribution sampled from. Logits only at the C completion
    positions.

    `token_logprobs` works LOGPROB_CHUNK of the N x C tokens at a time, each chunk recomputed in backward
    (torch's checkpoint): the float32 log-softmax of all N x C tokens at once, [N, C, V], would be the largest
    tensor of the update (7 GiB at micro-batch 8, 512 tokens and Qwen's vocabulary). What stays is the logits
    in the model's dtype (infra/memory.py counts the bytes)."""
    positions = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # [N, T]: count real tokens, as sampling did
    inputs, mask = input_ids[:, :-1], attention_mask[:, :-1]  # the last token predicts nothing: no input
    logits = model(input_ids=inputs, attention_mask=mask, position_ids=positions[:, :-1], use_cache=False,
                   logits_to_keep=last_positions(inputs, completion_len)).logits  # [N, C, V]: t predicts t+1
    targets = input_ids[:, -completion_len:]  # [N, C]
    chunks = zip(logits.flatten(0, 1).split(LOGPROB_CHUNK), targets.flatten().split(LOGPROB_CHUNK))
    picked = torch.cat([checkpoint(token_logprobs, chunk, chunk_targets, temperature, use_reentrant=False)
                        for chunk, chunk_targets in chunks]).view(targets.shape)  # [N, C]
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
