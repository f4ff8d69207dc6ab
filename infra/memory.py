"""What a run needs in device memory, estimated from the model's shapes and the run's before it runs
(train.py and eval.py print it first; docs/performance.md tables it for Qwen2.5-0.5B and -1.5B), and the
longest prompt it is estimated for, which must fit the model's context.

Bytes, P the parameter count, w the working precision's bytes (2 for bf16, 4 for fp32):
  weights 4P (float32 master), optimizer 8P (AdamW's two float32 moments), gradients 4P (float32),
  working copy 2P + 2P (bf16 only: the copy, its gradients of one micro-batch), reference wP (AAPO, --beta);
  under LoRA (--lora-rank), L the adapters' parameter count: the frozen weights wP (in the working precision,
  no float32 master of them), weights 4L, optimizer 8L and gradients 4L for the adapters alone, no working
  copy (the policy is the master), and the reference 0 (the policy with its adapters off);
  on CUDA, CUDA_ALLOWANCE for the CUDA context and the cuBLAS and attention workspaces; on the CPU, the
  runtime: what the process held before the model loaded (Python, torch, transformers: ~0.45 GiB), measured
  (`hardware.resident_bytes`), so that the total is the process's peak resident memory;
then the larger of the two phases, which never overlap:
  sampling, as HF generate (CUDA's path) runs it: it prefills every row, each prompt once per completion,
    then appends to the KV cache, layers x 2 x kv_dim x w per token; the larger of the prefill (the prompts'
    KV cache and one layer's transients, `prefill_bytes` per prompt token) and the KV cache of all rows at
    the end, rows x (prompt + completion) tokens;
  update, one micro-batch of m rows of T = prompt + completion tokens, what autograd saves for backward
  (tests/test_device.py counts it in bf16 with padding, at Qwen2.5-0.5B's and 1.5B's layer shapes):
    activations, per token: each layer's `layer_bytes` (`lora_layer_bytes` under LoRA), plus the final
    norm's (4 + 2w) h (under LoRA 4h: its weight and the output layer are frozen) and the rotary cos and
    sin, 2 head_dim w; under --grad-checkpointing each layer keeps only its input (h w) and one layer's
    worth is recomputed at a time in backward;
    logits at the m x C completion positions, V each: 2w per entry (the logits, then their gradient), plus
    16 bytes for each of LOGPROB_CHUNK x V entries, one chunk's float32 log-softmax and its gradient
    (model.completion_logprobs; measured on the CPU with torch's memory profiler, tests/test_device.py, at
    a narrow layer's, SmolLM2's and Qwen2.5-1.5B's widths).
eval.py samples and never updates (`training` False): no optimizer, gradients or update phase, and a working
copy of 2P without its gradients.
Left out: the attention mask (m T^2 w, shared by the layers), the reference's forward (no grad, one
micro-batch at a time), and the allocator's fragmentation (docs/performance.md's table leaves 10% of each
card for it).
"""

from typing import Callable

from transformers import PreTrainedTokenizerBase

from data.tasks import Problem
from infra.lora import has_adapters
from model import LOGPROB_CHUNK, format_prompts

GIB = 2**30
FITS = 0.9  # of a device's memory a run may plan to fill: the rest for the allocator's fragmentation
CUDA_ALLOWANCE = GIB  # the CUDA context (about 0.5 GiB with lazy module loading) and the kernels' workspaces
STATIC = ("frozen", "weights", "optimizer", "gradients", "working_copy", "reference", "cuda",
          "runtime")  # a run long


def layer_bytes(config, w: int) -> int:
    """Bytes one decoder layer saves for backward per token, as transformers' Llama/Qwen2 block does in w-byte
    precision with a padding mask: each RMSNorm its float32 input (4h), the normalised values and its output
    (w h each); q after rotary and the attention output (w q_dim each); k and v repeated to every query head
    (w q_dim each: with a mask, transformers repeats them before SDPA); SDPA's float32 logsumexp per head;
    the MLP's gate, up, activation and their product (w i each)."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    q_dim = heads * head_dim
    return 2 * (4 + 2 * w) * hidden + 4 * w * q_dim + 4 * heads + 4 * w * config.intermediate_size


def lora_layer_bytes(config, w: int, rank: int) -> int:
    """Bytes one decoder layer saves for backward per token under LoRA (peft's lora.Linear: frozen weights
    in w-byte precision, float32 adapters on its seven linear layers), measured as `layer_bytes` is: the
    frozen layers save no inputs for their weights' gradients, and the norms' weights are frozen, so of
    `layer_bytes` stay each RMSNorm's float32 input, the attention's q, k, v, output and logsumexp, and the
    MLP's gate, up and activation (their product feeds only down_proj); each adapter saves A's float32 input
    and A's output (4 rank). In bf16 each adapter casts its own float32 copy of its input (q, k, v, gate and
    up of h each, o of q_dim, down of i); in float32 the casts are no-ops, and the adapters share the two
    norms' outputs and the product, o reading the attention output already kept."""
    hidden, heads, inter = config.hidden_size, config.num_attention_heads, config.intermediate_size
    q_dim = heads * (getattr(config, "head_dim", None) or hidden // heads)
    inputs = 2 * hidden + inter if w == 4 else 5 * hidden + q_dim + inter
    return 2 * 4 * hidden + 4 * w * q_dim + 4 * heads + 3 * w * inter + 4 * inputs + 7 * 4 * rank


def prefill_bytes(config, w: int, lora: bool) -> int:
    """Bytes each prompt token of a prefill holds at once, beside its KV cache: one layer's transients, in
    w-byte precision, the MLP's three intermediates alive together (the activation, up's output, their
    product: w i each) and four hidden-width values; under LoRA, peft's float32 temporaries, 10 i + 4 h in
    bf16 and 4 i in float32. Fitted to torch's profiler at Qwen2.5-0.5B's and 1.5B's widths, within 3%
    (tests/test_device_program.py): 162 kB a token at 1.5B in bf16 under LoRA, against 28 kB of KV cache."""
    hidden, inter = config.hidden_size, config.intermediate_size
    peft = (10 * inter + 4 * hidden if w == 2 else 4 * inter) if lora else 0
    return w * (3 * inter + 4 * hidden) + peft


def adapter_count(config, rank: int) -> int:
    """The parameters of rank-`rank` adapters on every linear layer but the output layer (lora.add_adapters):
    r (d_in + d_out) for each of q, k, v, o, gate, up and down, in each layer."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    q_dim, kv_dim = heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = 7 * hidden + 2 * q_dim + 2 * kv_dim + 3 * config.intermediate_size
    return rank * per_layer * config.num_hidden_layers


def parameter_counts(model) -> tuple[int, int]:
    """The parameters of `model`'s own weights and of its LoRA adapters (0 without), as `estimate_memory`
    takes them."""
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad) if has_adapters(model) else 0
    return sum(p.numel() for p in model.parameters()) - adapters, adapters


def estimate_memory(config, num_params: int, *, rows: int, prompt_len: int, completion_len: int,
                    micro_batch: int, bf16: bool, reference: bool, checkpointing: bool,
                    cuda: bool = False, lora_params: int = 0, training: bool = True,
                    runtime: int = 0) -> dict[str, float]:
    """The terms of the module docstring in bytes, for a transformers config (hidden_size,
    intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, vocab_size), and
    "total": the static terms plus the larger phase. `num_params` counts the model's own weights;
    `lora_params` > 0, the LoRA adapters' (trained, the model's own frozen); `training` False, sampling
    alone (eval.py); `runtime`, the process's own bytes on the CPU (0 on CUDA: they are the host's)."""
    w = 2 if bf16 else 4
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv_token = layers * 2 * config.num_key_value_heads * head_dim * w  # the KV cache of one token
    tokens = micro_batch * (prompt_len + completion_len)  # one micro-batch's positions
    lora = lora_params > 0
    trained = lora_params if lora else num_params
    per_token = (4 if lora else 4 + 2 * w) * hidden + 2 * head_dim * w  # the final norm, rotary cos and sin
    rank = lora_params // adapter_count(config, 1)  # lora.add_adapters: one rank on every linear layer
    per_layer = lora_layer_bytes(config, w, rank) if lora else layer_bytes(config, w)
    kept = (layers * hidden * w + per_layer) if checkpointing else layers * per_layer
    if lora and not checkpointing:  # the first layer's input, from the frozen embeddings, needs no gradient:
        kept -= 4 * hidden  # its input norm keeps nothing
    terms = {
        "frozen": w * num_params if lora else 0,
        "weights": 4 * trained, "optimizer": 8 * trained if training else 0,
        "gradients": 4 * trained if training else 0,
        "working_copy": (4 if training else 2) * num_params if bf16 and not lora else 0,
        "reference": w * num_params if reference and not lora else 0,
        "cuda": CUDA_ALLOWANCE if cuda else 0,
        "runtime": 0 if cuda else runtime,
        "sampling": max(rows * prompt_len * (kv_token + prefill_bytes(config, w, lora)),
                        rows * (prompt_len + completion_len) * kv_token),
        "activations": tokens * (per_token + kept) if training else 0,
        "logits": (micro_batch * completion_len * 2 * w + 16 * LOGPROB_CHUNK) * config.vocab_size
                  if training else 0,
    }
    static = sum(terms[k] for k in STATIC)
    return {**terms, "total": static + max(terms["sampling"], terms["activations"] + terms["logits"])}


def size(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:.0f} MiB"


def describe_estimate(terms: dict[str, float]) -> str:
    """One line: the total and its parts (eval.py's: no optimizer, gradients or update)."""
    trained = size(terms["weights"] + terms["optimizer"] + terms["gradients"])
    updated = "+AdamW+grads" if terms["optimizer"] else ""
    parts = [f"weights{updated} {trained}"]
    if terms["frozen"]:  # LoRA
        parts = [f"frozen weights {size(terms['frozen'])}", f"adapters{updated} {trained}"]
    names = {"working_copy": "working copy", "reference": "reference", "cuda": "CUDA context",
             "runtime": "runtime (Python, torch)"}
    parts += [f"{names[n]} {size(terms[n])}" for n in names if terms[n]]
    phase = f"sampling (prefill, KV cache) {size(terms['sampling'])}"
    if update := terms["activations"] + terms["logits"]:
        phase = (f"the larger of update {size(update)} (activations {size(terms['activations'])}, "
                 f"logits {size(terms['logits'])}) and {phase}")
    return f"memory ~{size(terms['total'])} = {' + '.join(parts)} + {phase}"


def longest_prompt(config, tokenizer: PreTrainedTokenizerBase, problems: list[Problem],
                   prompt_format: str = "chat", system: str = "") -> int:
    """Tokens in the prompt of the longest problem (question and instruction, by characters: one prompt is
    tokenized, not every one), templated as `format_prompts` does. A prompt longer than the model's context
    (config.max_position_embeddings) is refused, a ValueError naming its file and line: no completion could
    read it, and its attention alone may not fit in memory (a 1 MB question asks for a 1 TB mask)."""
    longest = max(problems, key=lambda p: len(p.question) + len(p.instruction))
    prompt = format_prompts(tokenizer, [longest.question], prompt_format, system, [longest.instruction])
    tokens = len(tokenizer(prompt, add_special_tokens=False).input_ids[0])
    if (context := getattr(config, "max_position_embeddings", None)) and tokens > context:
        raise ValueError(f"{longest.where or repr(longest.question[:40])}: a prompt of {tokens} tokens, "
                         f"longer than the model's context of {context}: shorten or remove it")
    return tokens


def sampled_rows(estimate: Callable[[int], dict[str, float]], rows: int, group_size: int,
                 device_bytes: int) -> int:
    """The rows of a step to sample at once (`model.sample`'s rows_at_once): all `rows` where `estimate`
    (this module's terms with that many rows sampled at once) fits FITS of the device's memory; else fewer,
    whole groups of `group_size`, while sampling is the larger phase and the estimate does not fit, one group
    at least. Where the update is the larger phase fewer rows would not help: the draws stay as they were."""
    sampled = rows
    while sampled > group_size:
        terms = estimate(sampled)
        update = terms["activations"] + terms["logits"]
        if terms["total"] <= FITS * device_bytes or terms["sampling"] <= update:
            break
        sampled -= group_size
    return sampled


def fits_warning(terms: dict[str, float], device_bytes: int, prompt_len: int) -> str | None:
    """One line where the estimate at the longest prompt passes FITS of the device's memory, naming what to
    lower for its larger phase: sampling prefills every row of a step at once (the prompts' length, the
    prompts and completions per step), the update one micro-batch at a time. None where it fits."""
    if terms["total"] <= FITS * device_bytes:
        return None
    update = terms["activations"] + terms["logits"]
    change = ("--micro-batch, or add --grad-checkpointing" if update > terms["sampling"]
              else "--prompts-per-step or --group-size (the rows sampled at once)")
    return (f"warning: memory ~{size(terms['total'])} at the longest prompt ({prompt_len} tokens) is past "
            f"{FITS:.0%} of the device's {size(device_bytes)}: a step may run out of memory; lower "
            f"--max-prompt-tokens (longer prompts are skipped) or {change}")


def short_enough(tokenizer: PreTrainedTokenizerBase, problems: list[Problem], limit: int,
                 prompt_format: str = "chat", system: str = "") -> list[Problem]:
    """The problems whose prompt, templated as `format_prompts` writes it, has at most `limit` tokens (0:
    every problem): train.py --max-prompt-tokens skips the others whole, since a prompt cut short would
    be another question, and one long prompt sets the memory of its step (the prefill of every row)."""
    if not limit:
        return problems
    prompts = format_prompts(tokenizer, [p.question for p in problems], prompt_format, system,
                             [p.instruction for p in problems])
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False).input_ids]
    return [problem for problem, tokens in zip(problems, lengths) if tokens <= limit]


def context_warning(config, prompt_len: int, max_new_tokens: int) -> str | None:
    """One line when a prompt of `prompt_len` tokens plus `max_new_tokens` exceeds the model's context
    (config.max_position_embeddings): past it the model reads positions it never learnt, slowly."""
    context = getattr(config, "max_position_embeddings", None)
    if context is None or prompt_len + max_new_tokens <= context:
        return None
    return (f"warning: the longest prompt ({prompt_len} tokens) plus --max-new-tokens {max_new_tokens} "
            f"exceeds the model's context of {context} tokens: completions past it are unreliable, and slow")
