"""The fast decoding loop: `decode` replaces `model.sample_with_generate` (HF `generate`) in `model.sample`.

Same completions, less work: each prompt is run once for its G completions, a row leaves the batch at its EOS,
and for the Llama/Qwen2 block (SmolLM2, Qwen2.5) each new token goes through `decode_step`, the block written
out for one position, with a preallocated `DecodeCache` and oneDNN-packed weights (`packed_linear`).
tests/test_fast_paths.py checks it token for token against `generate`; docs/performance.md says what each
piece bought.
"""

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from infra.lora import adapter_output, has_variants
from model import last_positions, next_tokens

FAST_ON = ("cpu",)  # device types where this file's and fast/packing.py's paths were shown equal and faster
SHAPE_MULTIPLE = 16  # token counts are padded to a multiple of this, so matmul shapes recur (see `decode`)


@dataclass
class DecodeCache:
    """Keys and values of every layer in tensors [n, kv_heads, P + C, head_dim] allocated once: a decoding
    step writes one column, where transformers' DynamicCache concatenates (copies the whole cache, every
    layer, every token)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def from_prefill(cls, cache: DynamicCache, group_size: int, max_new_tokens: int) -> "DecodeCache":
        def grow(t: torch.Tensor) -> torch.Tensor:  # [B, H, P, D] -> [B*G, H, P + max_new_tokens, D]
            out = t.new_zeros(t.shape[0] * group_size, t.shape[1], t.shape[2] + max_new_tokens, t.shape[3])
            out[:, :, : t.shape[2]] = t.repeat_interleave(group_size, dim=0)  # each prompt G times
            return out
        return cls([grow(layer.keys) for layer in cache.layers],
                   [grow(layer.values) for layer in cache.layers])

    def batch_select_indices(self, rows: torch.Tensor) -> None:  # the DynamicCache method of the same name
        self.keys, self.values = [k[rows] for k in self.keys], [v[rows] for v in self.values]


def onednn_ops() -> tuple[Callable, Callable, Callable] | None:
    """torch's private oneDNN ops that `packed_linear` uses (the ones torch.compile uses to "freeze" a model):
    (reorder a weight, product with a reordered weight, whether oneDNN has bf16 kernels), or None where this
    build of torch lacks them (they are private: a release may rename or drop them)."""
    names = ("_reorder_linear_weight", "_linear_pointwise", "_is_mkldnn_bf16_supported")
    try:
        return tuple(getattr(torch.ops.mkldnn, name) for name in names)
    except (AttributeError, RuntimeError):
        return None


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None,
                  rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> F.linear(x, weight, bias); a CPU weight is reordered once into oneDNN's blocked layout for x of
    about `rows` rows (what inference compilers do when they "freeze" a model). Decoding's few-row products
    read the whole weight for a handful of rows, and the blocked layout streams it in the order the kernel
    uses it, where F.linear's kernel reorders parts of it at every call (bench.py's kernel floor times both).
    Only the order of additions differs. Not packed, F.linear instead: a float32 weight under autocast
    (F.linear casts x and the weight there; oneDNN would not), bf16 where oneDNN has no bf16 kernels (it needs
    AVX-512 bw/vl/dq), and any weight where torch lacks the private ops (`onednn_ops`)."""
    ops = onednn_ops() if weight.device.type == "cpu" and torch.backends.mkldnn.is_available() else None
    if ops is None:
        return lambda x: F.linear(x, weight, bias)
    reorder, linear, has_bf16 = ops
    packable = {torch.float32: not torch.is_autocast_enabled("cpu"), torch.bfloat16: has_bf16()}
    if not packable.get(weight.dtype):
        return lambda x: F.linear(x, weight, bias)
    packed = reorder(weight, rows)
    return lambda x: linear(x, packed, bias, "none", [], "")


def writes_out_block(config) -> bool:
    """Whether `decode_step` and `packing.packed_states`, which write the transformer block out, implement
    this model's: the Llama/Qwen2 block (SmolLM2, Qwen2.5), without sliding-window attention or attention
    dropout."""
    return (config.model_type in ("llama", "qwen2") and not getattr(config, "use_sliding_window", False)
            and not getattr(config, "attention_dropout", 0.0))


def plus_adapters(product: Callable, linears: list[torch.nn.Module]) -> Callable:
    """`product` of the weights of `linears` side by side, plus what their LoRA adapters add to each one's
    columns (`lora.adapter_output`, zeros for a layer without), in the product's dtype, as peft's forward
    adds them; `product` itself where no adapter is on."""
    outputs = [adapter_output(linear) for linear in linears]
    if not any(outputs):
        return product

    def run(x: torch.Tensor) -> torch.Tensor:
        base = product(x)
        added = [output(x) if output else x.new_zeros(*x.shape[:-1], linear.weight.shape[0])
                 for output, linear in zip(outputs, linears)]
        return (base + torch.cat(added, dim=-1)).to(base.dtype)
    return run


def decode_weights(model: PreTrainedModel, rows: int) -> tuple[list[tuple[Callable, ...]], Callable] | None:
    """The products of `decode_step` for batches of about `rows` rows: per layer (qkv, o, gate_up, down), and
    the output layer. q/k/v and gate/up are each one matrix (4 products per layer instead of 7: fewer, larger
    calls), every product packed by `packed_linear`, the output layer too (the largest weight: for SmolLM2's
    49k vocabulary, 113 MB in fp32). Under LoRA each product adds its layers' adapters (`plus_adapters`),
    which `adapters_off` turns off. None for blocks `decode_step` does not implement (other than the
    Llama/Qwen2 block) and for LoRA variants (DoRA, ...); those decode with transformers' forward."""
    config = model.config
    if not writes_out_block(config) or config.hidden_act != "silu" or getattr(config, "mlp_bias", False):
        return None
    if has_variants(model):
        return None

    def product(linears: list[torch.nn.Module], bias: torch.Tensor | None = None) -> Callable:
        """One product for the weights of `linears` side by side."""
        weight = linears[0].weight if len(linears) == 1 else torch.cat([linear.weight for linear in linears])
        return plus_adapters(packed_linear(weight, bias, rows), linears)

    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        qkv_bias = None if biases[0] is None else torch.cat(biases)
        layers.append((product([attn.q_proj, attn.k_proj, attn.v_proj], qkv_bias),
                       product([attn.o_proj], attn.o_proj.bias), product([mlp.gate_proj, mlp.up_proj]),
                       product([mlp.down_proj])))
    return layers, product([model.lm_head], model.lm_head.bias)


def rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """transformers' Llama/Qwen2 RMSNorm, the same casts: normalise in float32, scale in the input dtype."""
    x32 = x.float()
    normalised = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * normalised.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x [n, heads, D] with cos, sin [n, 1, D] (transformers' rotate_half
    layout)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def decode_step(model: PreTrainedModel, weights: tuple, tokens: torch.Tensor, positions: torch.Tensor,
                cache: DecodeCache, column: int, mask: torch.Tensor) -> torch.Tensor:
    """Logits [n, V] of one new token per row: the Llama/Qwen2 block written out for a single position;
    replaces one call of the model's forward with its cache (the `model(...)` call in `decode`).

    tokens, positions [n]; the token's keys and values go to `column` of the cache; mask [n, column + 1] says
    which cached positions each row attends to (its prompt without left padding, and its completion so far).
    Same arithmetic as transformers' forward, without its per-layer Python (module calls, mask building, cache
    concatenation), a fixed cost per layer and token that is a large share of a step when each product
    covers only a few rows (benchmarks/bench.py's generation floor counts the products alone)."""
    config, n = model.config, len(tokens)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = model.model.layers[0].self_attn.head_dim
    h = model.model.embed_tokens(tokens)  # [n, d]
    cos, sin = model.model.rotary_emb(h, positions[:, None])  # [n, 1, head_dim]
    # [n, 1, 1, T], additive, built once: SDPA would convert a boolean mask in every layer
    attend = torch.zeros(mask.shape, dtype=h.dtype, device=h.device).masked_fill_(~mask, float("-inf"))
    attend = attend[:, None, None]
    layer_weights, lm_head = weights  # from `decode_weights`
    for layer, (qkv_proj, o_proj, gate_up_proj, down_proj) in zip(model.model.layers, layer_weights):
        x = rms_norm(h, layer.input_layernorm)
        qk, v = qkv_proj(x).split([(heads + kv_heads) * head_dim, kv_heads * head_dim], dim=-1)
        qk = rotate(qk.view(n, heads + kv_heads, head_dim), cos, sin)  # q and k in one rotation
        q, k = qk.split([heads, kv_heads], dim=1)
        keys, values = cache.keys[layer.self_attn.layer_idx], cache.values[layer.self_attn.layer_idx]
        keys[:, :, column] = k
        values[:, :, column] = v.view(n, kv_heads, head_dim)
        # GQA: the heads / kv_heads query heads that share a kv head attend as that many query positions of it
        # (one new token: same keys, same mask), so SDPA's CPU kernel works a kv head's cached keys and values
        # once for all its query heads, not once per query head as through enable_gqa (a block of queries
        # against a block of keys instead of one query at a time; bench.py's generate time measures it)
        q = q.reshape(n, kv_heads, heads // kv_heads, head_dim)
        out = F.scaled_dot_product_attention(q, keys[:, :, : column + 1], values[:, :, : column + 1],
                                             attn_mask=attend, scale=layer.self_attn.scaling)  # [n, kv, g, D]
        h = h + o_proj(out.reshape(n, heads * head_dim))
        gate, up = gate_up_proj(rms_norm(h, layer.post_attention_layernorm)).chunk(2, dim=-1)
        h = h + down_proj(F.silu(gate) * up)
    return lm_head(rms_norm(h, model.model.norm))


@torch.no_grad()
def decode(model: PreTrainedModel, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int,
           max_new_tokens: int, temperature: float, top_p: float, eos_token_id: int | list[int],
           pad_token_id: int) -> torch.Tensor:
    """Completion ids [B*G, C] for left-padded prompts [B, P]; replaces `model.sample_with_generate` (the same
    arguments, the same distribution, other random numbers): a short decoding loop doing `generate`'s job
    with less work.

      1. Each prompt is run once, then its KV cache is repeated G times: the prefill costs B rows, not B*G.
      2. A row leaves the batch (and the cache) at its first EOS (any of the ids given): later steps compute
         only unfinished rows.
      3. Tokens are drawn by `model.next_tokens` (inverse CDF). C is the step at which the last row ended (or
         max_new_tokens); positions after a row's EOS hold pad, as with `generate`.
      4. For Llama/Qwen2 blocks, each new token goes through `decode_step` with a preallocated `DecodeCache`;
         other architectures through transformers' forward.
    """
    # Prompts left-padded (masked) to a multiple of 16 columns: oneDNN builds a kernel for each new matmul
    # shape, so the prefill's shapes must recur from step to step (benchmarks/bench.py times whole steps).
    pad = -prompt_ids.shape[1] % SHAPE_MULTIPLE
    prompt_ids, prompt_mask = F.pad(prompt_ids, (pad, 0), value=pad_token_id), F.pad(prompt_mask, (pad, 0))
    n = len(prompt_ids) * group_size
    weights = decode_weights(model, rows=n)
    cache = DynamicCache(config=model.config)
    positions = (prompt_mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, P]: left padding must not shift positions
    # The cache goes fourth, by position: transformers 5.17 names that argument past_key_values, 5.25 cache
    # (and warns at the old name); a keyword either end lacks is dropped silently, and the cache stays empty.
    logits = model(prompt_ids, prompt_mask, positions, cache, use_cache=True,
                   logits_to_keep=last_positions(prompt_ids, 1)).logits[:, -1]
    logits = logits.repeat_interleave(group_size, dim=0)  # [N, V]: rows b*G .. b*G+G-1 share prompt b
    if weights:
        cache = DecodeCache.from_prefill(cache, group_size, max_new_tokens)
    else:
        cache.batch_repeat_interleave(group_size)
    mask = prompt_mask.repeat_interleave(group_size, dim=0)  # [n, P + t] for the n live rows
    next_position = positions[:, -1].repeat_interleave(group_size) + 1  # [n]
    live = torch.arange(n, device=prompt_ids.device)  # which of the N rows are still decoding
    stop_ids = torch.tensor(eos_token_id, device=prompt_ids.device)
    completion = torch.full((n, max_new_tokens), pad_token_id, dtype=torch.long, device=prompt_ids.device)
    for t in range(max_new_tokens):
        tokens = next_tokens(logits, temperature, top_p)  # [n]
        completion[live, t] = tokens
        if t == max_new_tokens - 1:
            break
        finished = torch.isin(tokens, stop_ids)
        if finished.any():
            keep = (~finished).nonzero().flatten()
            if len(keep) == 0:
                break
            live, tokens, mask, next_position = live[keep], tokens[keep], mask[keep], next_position[keep]
            cache.batch_select_indices(keep)
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
        if weights:
            logits = decode_step(model, weights, tokens, next_position, cache, mask.shape[1] - 1, mask.bool())
        else:
            logits = model(tokens[:, None], mask, next_position[:, None], cache, use_cache=True).logits[:, -1]
        next_position = next_position + 1
    return completion[:, : t + 1]
