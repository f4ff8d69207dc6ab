"""The update's fast log-probs: `completion_logprobs` here replaces `model.completion_logprobs`'s plain pass.

A micro-batch of rows (left-padded prompt + completion) runs as one packed token stream (`pack_rows`): each
distinct prompt once, each row's completion tokens, no padding, so every matrix product runs once over all of
them (`packed_states`) and attention runs per segment (`segment_attention`). Logits exist only for the real
completion tokens, and their float32 log-softmax is `TokenLogProbs`, a chunk of rows at a time.
tests/test_fast_paths.py checks log-probs and gradients against the plain pass; docs/performance.md says what
each piece bought.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from fast.decoding import SHAPE_MULTIPLE, rotate, writes_out_block
from model import last_positions


class TokenLogProbs(torch.autograd.Function):
    """log softmax(z / T)[target] [M] in float32 (float64 for float64 z), from logits z [M, V], CHUNK rows at
    a time; replaces `torch.log_softmax(z.float() / T, -1).gather(...)` of `model.completion_logprobs`.

    Autograd through log_softmax would keep a float32 copy of z / T for backward (as large as the logits in
    float32) and build several [M, V] temporaries there; this keeps z alone and writes its gradient once:
        d log p(target) / d z = (onehot(target) - softmax(z / T)) / T
    Each chunk is worked in place in one [CHUNK, V] buffer: the allocator maps a fresh buffer of this size
    from the OS every time, and every page of it faults on first touch.
    """

    CHUNK = 64

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16 -> float32; float64 stays (gradcheck)
        logsumexp = torch.empty(targets.shape, dtype=dtype, device=logits.device)  # [M]
        picked = torch.empty_like(logsumexp)  # [M]
        chunk = min(TokenLogProbs.CHUNK, len(logits))
        buffer = torch.empty(chunk, logits.shape[1], dtype=dtype, device=logits.device)
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
        chunk = min(TokenLogProbs.CHUNK, len(logits))
        buffer = None if logits.dtype == logsumexp.dtype else torch.empty(
            chunk, logits.shape[1], dtype=logsumexp.dtype, device=logits.device)
        for s in range(0, len(logits), TokenLogProbs.CHUNK):
            e = min(s + TokenLogProbs.CHUNK, len(logits))
            g = grad_logp[s:e, None] / ctx.temperature  # [c, 1]
            out = grad[s:e] if buffer is None else buffer[: e - s]  # softmax(z / T), then the gradient
            out.copy_(logits[s:e]).div_(ctx.temperature).sub_(logsumexp[s:e, None]).exp_()
            out.mul_(-g).scatter_add_(1, targets[s:e, None], g)
            if buffer is not None:
                grad[s:e] = out
        return grad, None, None


@dataclass
class PackedRows:
    """Rows [n, P + C] of left-padded prompt + completion as one stream of N tokens: each distinct prompt
    once, then each row's completion tokens but its last (which predicts nothing), no padding; N rounded up
    to a multiple of 16 with dummy tokens, so matmul shapes recur. Attention runs on S segments (a prompt's
    tokens, or a row's completion tokens), each padded to Lq queries and Lk keys (its prompt, then its own
    completion so far)."""

    tokens: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]: a row's positions count its real tokens, as when it was sampled
    query_slots: torch.Tensor  # [S, Lq]: stream index of each segment's queries (N: an empty slot)
    key_slots: torch.Tensor  # [S, Lk]: stream index of each segment's keys (N: an empty slot)
    attend: torch.Tensor  # [S, 1, Lq, Lk] bool: real key at or before the query
    output_slots: torch.Tensor  # [N]: where each token's attention output lies in the [S * Lq] (S * Lq: none)
    predictors: torch.Tensor  # [M]: stream index of the token whose output predicts each target
    targets: torch.Tensor  # [M]: completion tokens in row order, then dummies up to a multiple of 16
    num_targets: int  # the real ones among the M


def round_up(n: int) -> int:
    return n + -n % SHAPE_MULTIPLE


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int) -> PackedRows:
    """`PackedRows` of rows [n, P + C] whose last `completion_len` columns are completions; mask 0 on
    padding."""
    prompt_len = input_ids.shape[1] - completion_len
    tokens, positions, segments, predictors, targets, prompt_slots = [], [], [], [], [], {}
    for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
        prompt = tuple(t for t, m in zip(ids[:prompt_len], mask[:prompt_len]) if m)
        completion = [t for t, m in zip(ids[prompt_len:], mask[prompt_len:]) if m]  # up to and including EOS
        if prompt not in prompt_slots:  # a group's first row: its prompt joins the stream, causal on itself
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
    tokens += [0] * (round_up(n) - n)  # dummies: in no segment, they attend nowhere, nothing attends to them
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
    causal = position[key_slots][:, None, :] <= position[query_slots][:, :, None]  # [S, Lq, Lk]
    attend = (key_slots < n)[:, None, :] & causal
    attend[:, :, 0] |= query_slots >= n  # an empty query slot attends to one key, not none (no NaN; unused)
    device = input_ids.device
    return PackedRows(*(torch.tensor(x, device=device) for x in (tokens, positions)), query_slots.to(device),
                      key_slots.to(device), attend[:, None].to(device), output_slots.to(device),
                      *(torch.tensor(x, device=device) for x in (predictors, targets)), num_targets)


def sdpa_mask(attend: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """`attend` [S, 1, Lq, Lk] as `segment_attention`'s SDPA wants it: additive (0 or -inf) in `dtype`, each
    segment's rows repeated for the `groups` query heads folded into its query axis: [S, 1, groups * Lq, Lk].
    Built once per pass: SDPA would convert a boolean mask in every layer, and the memory-efficient kernel
    wants rows 16-aligned (torch pads a copy in every call otherwise), hence the wider buffer sliced to Lk."""
    segments, _, lq, lk = attend.shape
    mask = torch.full((segments, 1, groups * lq, round_up(lk)), float("-inf"), dtype=dtype,
                      device=attend.device)
    return mask[..., :lk].masked_fill_(attend.repeat(1, 1, groups, 1), 0.0)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: torch.Tensor, scale: float,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v per segment over the keys `attend` [S, 1, Lq, Lk] allows: q [S, Lq, heads, D],
    k and v [S, Lk, kv_heads, D], each kv head serving heads / kv_heads query heads (GQA).
    Out: [S * Lq, heads * D].

    GQA without copying k and v: the query heads that share a kv head are folded into its query axis, as
    `decoding.decode_step` does, so each kv head meets groups * Lq queries.

    mask (`sdpa_mask`, given on CUDA): torch's SDPA with that additive mask. Why this form: flash takes no
    mask, and is_causal cannot say where a padded segment's keys end nor that a completion sees its whole
    prompt; a call per segment would loop in Python in every layer; and a mask with `enable_gqa=True` reached
    no fused kernel before torch gave the memory-efficient one GQA (pytorch issue 139586, PR 191085): the
    math kernel then kept float32 scores and repeated k and v. Folded, q and k have as many heads and the
    mask q's dtype, which the memory-efficient kernel (and cuDNN's) take, keeping no [Lq, Lk] scores for
    backward. That kernel is expected, not verified: the GPU check (issue 46) decides;
    tests/test_fast_paths.py runs this branch on CPU against the written-out one.
    Otherwise written out, softmax in float32 as in transformers' eager attention: SDPA's CPU kernel keeps no
    scores and recomputes them block by block in backward, where these segments' scores (tens of queries and
    keys) are small enough to keep, so backward is two batched products (bench.py's update time measures
    it)."""
    segments, lq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    q = q.view(segments, lq, kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4)  # [S, kv, groups, Lq, D]
    q = q.reshape(segments, kv_heads, groups * lq, head_dim)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [S, kv_heads, Lk, D]
    if mask is not None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [S, kv, groups * Lq, D]
    else:
        # [S, kv_heads, groups, Lq, Lk]
        scores = (q @ k.transpose(2, 3)).view(segments, kv_heads, groups, lq, -1) * scale
        scores = scores.masked_fill(~attend[:, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).view(segments, kv_heads, groups * lq, -1)
        out = probs.to(v.dtype) @ v  # [S, kv_heads, groups * Lq, D]
    out = out.view(segments, kv_heads, groups, lq, head_dim).permute(0, 3, 1, 2, 4)  # [S, Lq, kv, g, D]
    return out.reshape(segments * lq, -1)


def attention_by_sdpa(device: torch.device) -> bool:
    """Whether `packed_states` runs its attention by SDPA (`segment_attention`'s mask): on CUDA, where the
    written-out scores would be kept for backward. A function so that a CPU test can choose that branch."""
    return device.type == "cuda"


def packed_states(model: PreTrainedModel, rows: PackedRows) -> torch.Tensor:
    """Final hidden states [N, d] of the token stream `rows` (`pack_rows`), the model's own block modules
    applied to it: every matrix product runs once over all N tokens (prompts once, no padding), attention per
    segment. Values and gradients are those of the plain forward of every row, up to the order of
    additions."""
    config, n = model.config, len(rows.tokens)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = model.model.layers[0].self_attn.head_dim
    segments, lq = rows.query_slots.shape
    # On CPU, with the embedding tied to the output layer (SmolLM2, Qwen2.5 up to 3B), its gradient comes as
    # the N looked-up rows (sparse) and is added into the output layer's dense one, where the module's
    # backward fills a [vocab, d] tensor of zeros per micro-batch and adds it whole (bench.py's update time
    # measures it). Dense when untied (a sparse gradient would reach the optimizer) and on CUDA (atomic adds
    # there would vary the order of the sum). padding_idx as the module's: no gradient for that token.
    embed = model.model.embed_tokens
    sparse = embed.weight is model.get_output_embeddings().weight and embed.weight.device.type == "cpu"
    h = F.embedding(rows.tokens, embed.weight, embed.padding_idx, sparse=sparse)  # [N, d]
    cos, sin = (c[0, :, None] for c in model.model.rotary_emb(h, rows.positions[None]))  # [N, 1, head_dim]
    query_slots, key_slots = rows.query_slots.flatten(), rows.key_slots.flatten()
    mask = sdpa_mask(rows.attend, heads // kv_heads, h.dtype) if attention_by_sdpa(h.device) else None

    def with_empty_slot(x: torch.Tensor) -> torch.Tensor:  # [N, ...] -> [N + 1, ...]: slot N is zeros
        return F.pad(x, (0, 0) * (x.dim() - 1) + (0, 1))

    def block(layer: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = rotate(attn.q_proj(x).view(n, heads, head_dim), cos, sin)
        k = rotate(attn.k_proj(x).view(n, kv_heads, head_dim), cos, sin)
        v = attn.v_proj(x).view(n, kv_heads, head_dim)
        q = with_empty_slot(q).index_select(0, query_slots).view(segments, lq, heads, head_dim)
        k, v = (with_empty_slot(t).index_select(0, key_slots).view(segments, -1, kv_heads, head_dim)
                for t in (k, v))
        out = segment_attention(q, k, v, rows.attend, attn.scaling, mask)  # [S * Lq, heads * head_dim]
        out = with_empty_slot(out).index_select(0, rows.output_slots)  # [N, heads * head_dim]
        h = h + attn.o_proj(out)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    # --grad-checkpointing (`model.checkpoint_activations`): the layers' flag, which 5.17 and 5.25 both set
    recompute = torch.is_grad_enabled() and model.model.layers[0].gradient_checkpointing
    for layer in model.model.layers:
        h = checkpoint(block, layer, h, use_reentrant=False) if recompute else block(layer, h)
    return model.model.norm(h)


def completion_logprobs(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        completion_len: int, temperature: float = 1.0) -> torch.Tensor:
    """Replaces `model.completion_logprobs`, the plain pass: the same log-probs [N, C], 0 after a row's EOS.

    Models whose block `packed_states` writes out (`writes_out_block`) run as one packed token stream; others
    run their own forward on the padded rows. Either way logits exist only for the M completion tokens up to
    each row's EOS (packed: a few dummies more, so that M is a multiple of 16 and the output layer's shapes
    recur), and their float32 log-softmax is `TokenLogProbs`, a chunk of rows at a time: a [rows, C, vocab]
    float32 tensor is the usual GRPO OOM."""
    real = attention_mask[:, -completion_len:].bool()  # [N, C]: completion tokens up to and including EOS
    if writes_out_block(model.config):
        rows = pack_rows(input_ids, attention_mask, completion_len)
        # index_select, not [rows.predictors]: the G rows of a group share their prompt's last token as
        # predictor, and the backward of indexing with repeated indices adds into it in a thread-dependent
        # order on CPU
        logits = model.lm_head(packed_states(model, rows).index_select(0, rows.predictors))  # [M, V]
        picked = TokenLogProbs.apply(logits, rows.targets, temperature)[: rows.num_targets]  # row by row
    else:
        positions = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # [N, T]
        inputs, mask = input_ids[:, :-1], attention_mask[:, :-1]
        logits = model(input_ids=inputs, attention_mask=mask, position_ids=positions[:, :-1], use_cache=False,
                       logits_to_keep=last_positions(inputs, completion_len)).logits[real]  # [M, V]
        picked = TokenLogProbs.apply(logits, input_ids[:, -completion_len:][real], temperature)
    return picked.new_zeros(real.shape).masked_scatter(real, picked)
