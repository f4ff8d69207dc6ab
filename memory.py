"""What a run needs in device memory, estimated from the model's shapes and the run's before it runs
(train.py prints it first; docs/performance.md tables it for Qwen2.5-0.5B and -1.5B).

Bytes, P the parameter count, w the working precision's bytes (2 for bf16, 4 for fp32):
  weights 4P (float32 master), optimizer 8P (AdamW's two float32 moments), gradients 4P (float32),
  working copy 2P + 2P (bf16 only: the copy, its gradients of one micro-batch), reference wP (AAPO, --beta);
then the larger of the two phases, which never overlap:
  sampling: the KV cache of all rows, rows x (prompt + completion) x layers x 2 x kv_dim x w;
  update, one micro-batch of m rows of T = prompt + completion tokens:
    activations kept for backward, per token and layer about 6 h + 4 i + 4 kv_dim values (the block's norm
    inputs and outputs, q/k/v before and after rotary, the attention output, the MLP's gate, up, act and
    product), w bytes each; under --grad-checkpointing only each layer's input (h values) plus one layer's
    worth, recomputed in backward;
    logits at the m x C completion positions, V each: w for the logits, 4 for their float32 copy, 4 for the
    log-softmax, 4 for its gradient (model.completion_logprobs, the plain path CUDA runs).
Left out: attention scores (fused SDPA kernels keep none), the reference's forward (no grad, one micro-batch
at a time), the allocator's fragmentation and the CUDA context (about 0.5-1 GiB).
"""

GIB = 2**30


def estimate_memory(config, num_params: int, *, rows: int, prompt_len: int, completion_len: int,
                    micro_batch: int, bf16: bool, reference: bool, checkpointing: bool) -> dict[str, float]:
    """The terms of the module docstring in bytes, for a transformers config (hidden_size,
    intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, vocab_size), and
    "total": the static terms plus the larger phase."""
    w = 2 if bf16 else 4
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv_dim = config.num_key_value_heads * head_dim
    tokens = micro_batch * (prompt_len + completion_len)  # one micro-batch's positions
    per_layer = 6 * hidden + 4 * config.intermediate_size + 4 * kv_dim  # values kept per token and layer
    kept = (layers * hidden + per_layer) if checkpointing else layers * per_layer
    terms = {
        "weights": 4 * num_params, "optimizer": 8 * num_params, "gradients": 4 * num_params,
        "working_copy": 4 * num_params if bf16 else 0, "reference": w * num_params if reference else 0,
        "sampling": rows * (prompt_len + completion_len) * layers * 2 * kv_dim * w,
        "activations": tokens * kept * w,
        "logits": micro_batch * completion_len * config.vocab_size * (w + 12 if bf16 else 12),
    }
    static = sum(terms[k] for k in ("weights", "optimizer", "gradients", "working_copy", "reference"))
    return {**terms, "total": static + max(terms["sampling"], terms["activations"] + terms["logits"])}


def size(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:.0f} MiB"


def describe_estimate(terms: dict[str, float]) -> str:
    """One line: the total and its parts."""
    static = terms["weights"] + terms["optimizer"] + terms["gradients"]
    extra = [name for name in ("working_copy", "reference") if terms[name]]
    parts = [f"weights+AdamW+grads {size(static)}", *(f"{n.replace('_', ' ')} {size(terms[n])}"
                                                      for n in extra)]
    return (f"memory ~{size(terms['total'])} = {' + '.join(parts)} + the larger of update "
            f"{size(terms['activations'] + terms['logits'])} (activations {size(terms['activations'])}, "
            f"logits {size(terms['logits'])}) and sampling's KV cache {size(terms['sampling'])}")
