"""Each fast path (fast/decoding.py, fast/packing.py) changes nothing it should not against the plain
definition in model.py: same greedy tokens as HF `generate`, the same sampling distribution, the same
log-probs and gradients as the plain pass, close log-probs from the bf16 sampling copy, and precision chosen
from CPU flags."""

import types
from copy import deepcopy
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, inject_adapter_in_model
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2ForCausalLM

import model as model_module
from benchmarks.gpu_bench import with_adapters
from fast import decoding, packing
from fast.decoding import DecodeCache, decode, decode_step, decode_weights, packed_linear
from fast.packing import TokenLogProbs
from fast.packing import completion_logprobs as packed_logprobs
from infra import hardware
from infra.hardware import (accumulate_gradients, cast_weights, copy_weights, cpu_features,
                            resolve_precision, working_copy)
from infra.lora import adapters_off, add_adapters
from infra.model_files import byte_tokenizer, tiny_qwen2
from model import completion_logprobs as plain_logprobs
from model import load_model, next_tokens, sample, sample_with_generate
from test_lora import LINEAR

sample_fast = partial(sample, sample_completions=decode)  # what train.py samples with (--fast)
QUESTIONS = ["2+3?", "What is 17 * 4?", "hi", "a"]  # different lengths: left padding is exercised


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model("tiny-qwen2", torch.device("cpu"))
    return model.eval(), tokenizer


def favour_eos(model, eos_token_id: int, bias: float | None) -> None:
    """Give the output layer a bias of `bias` on the EOS logit (None removes it), so rows end at different
    steps (a random model rarely ends). A bias, not a forward hook: decode_step runs the output layer's
    weights itself."""
    if bias is None:
        model.lm_head.bias = None
        return
    logit_bias = torch.zeros(model.lm_head.out_features)
    logit_bias[eos_token_id] = bias
    model.lm_head.bias = torch.nn.Parameter(logit_bias, requires_grad=False)


@pytest.fixture
def eos_bias(tiny):
    """set_bias(b): `favour_eos` on the tiny model, removed after the test."""
    model, tokenizer = tiny
    yield lambda bias: favour_eos(model, tokenizer.eos_token_id, bias)
    favour_eos(model, tokenizer.eos_token_id, None)


@pytest.mark.parametrize("group_size", [1, 3])
def test_greedy_decode_equals_hf_generate(tiny, eos_bias, group_size):
    """Prefill once per prompt + repeated cache + dropping finished rows: token for token what generate
    gives."""
    model, tokenizer = tiny
    eos_bias(0.4)
    fast = sample_fast(model, tokenizer, QUESTIONS, group_size, 30, temperature=0)
    ref = sample(model, tokenizer, QUESTIONS, group_size, 30, temperature=0)
    lengths = fast.completion_mask.sum(1)
    assert lengths.min() < 30 and lengths.max() == 30  # some rows stopped early, some ran to the limit
    for field in ("input_ids", "attention_mask", "completion_mask", "truncated"):
        assert torch.equal(getattr(fast, field), getattr(ref, field)), field
    assert fast.texts == ref.texts


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")  # adapters on the output layer,
@pytest.mark.filterwarnings("ignore:`lora_bias=True` was passed")  # a bias in B: peft warns it cannot merge
@pytest.mark.parametrize("adapters", ["train.py's", "on q and v", "on the output layer, B with a bias"])
def test_greedy_decode_under_lora_equals_hf_generate(tiny, adapters):
    """With LoRA adapters (B nonzero, so that they change the tokens) decode_step adds each layer's adapters
    to its product (`decoding.plus_adapters`), and nothing with the adapters off (the reference policy, whose
    completions AAPO samples): token for token what generate gives, both ways. train.py's adapters, and those
    of a user's folder, which may sit elsewhere: on some layers, on the output layer, with a bias in B."""
    model, tokenizer = deepcopy(tiny[0]), tiny[1]
    configs = {"on q and v": LoraConfig(r=2, lora_alpha=32, target_modules=["q_proj", "v_proj"]),
               "on the output layer, B with a bias": LoraConfig(r=2, lora_alpha=32, lora_bias=True,
                                                               target_modules=[*LINEAR, "lm_head"])}
    if adapters in configs:
        inject_adapter_in_model(configs[adapters], model)
    else:
        add_adapters(model, 2, 32, "tiny-qwen2", 0)  # as train.py --lora-rank 2 does
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.3)  # large: the greedy tokens then change from step to step
    assert decode_weights(model, rows=4) is not None  # the written-out block, not transformers' forward
    on = [sampler(model, tokenizer, QUESTIONS, 3, 30, temperature=0) for sampler in (sample_fast, sample)]
    with adapters_off(model):
        off = [sampler(model, tokenizer, QUESTIONS, 3, 30, temperature=0)
               for sampler in (sample_fast, sample)]
    for fast, ref in (on, off):
        for field in ("input_ids", "attention_mask", "completion_mask", "truncated"):
            assert torch.equal(getattr(fast, field), getattr(ref, field)), field
    completions = on[0].input_ids[:, -on[0].completion_len:]
    assert on[0].completion_len == 30 and completions.unique().numel() > 1  # decode_step makes 29 of each row
    assert not torch.equal(on[0].input_ids, off[0].input_ids)  # the adapters change the tokens


def test_lora_variants_decode_with_the_transformers_forward(tiny):
    """A LoRA variant (DoRA here) is more than W x + (alpha / r) B A x, which decode_step adds: decode_weights
    says None, and decode runs peft's own forward (a path that
    test_other_architectures_decode_with_the_transformers_forward checks)."""
    model = deepcopy(tiny[0])
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=32, target_modules=list(LINEAR), use_dora=True), model)
    assert decode_weights(model, rows=4) is None


def test_decode_stops_when_every_row_has_ended(tiny, eos_bias):
    model, tokenizer = tiny
    eos_bias(1.0)  # every row ends at its first token
    rollout = sample_fast(model, tokenizer, QUESTIONS, 2, 30, temperature=0)
    assert rollout.completion_len == 1 and not rollout.truncated.any()


def test_decode_pads_after_eos_and_masks_by_position(tiny, eos_bias):
    """Tokens after a row's EOS are pad; the mask runs up to and including the first EOS."""
    model, tokenizer = tiny
    eos_bias(0.4)
    enc = tokenizer(["hi", "a"], return_tensors="pt", padding=True, add_special_tokens=False)
    ids = decode(model, enc["input_ids"], enc["attention_mask"], 2, 30, 0.0, 1.0, tokenizer.eos_token_id,
                 tokenizer.pad_token_id)
    for row in ids:
        eos_at = (row == tokenizer.eos_token_id).nonzero()
        if len(eos_at):
            assert (row[eos_at[0, 0] + 1:] == tokenizer.pad_token_id).all()


@pytest.fixture(scope="module", params=["qwen2-with-biases", "llama"])
def block_model(request):
    """The two block types decode_step writes out: Qwen2 (q/k/v biases, random here) and Llama (SmolLM2's)."""
    if request.param == "llama":
        tokenizer = byte_tokenizer()
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=True,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(1)
        model = LlamaForCausalLM(config)
    else:
        model, tokenizer = tiny_qwen2()
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    tokenizer.padding_side = "left"  # as load_model sets it: sampling appends to the right end of every row
    return model.eval(), tokenizer


@torch.no_grad()
@pytest.mark.parametrize("lora", [None, "fp32", "bf16"])
def test_decode_step_logits_equal_the_transformers_forward(block_model, lora):
    """Step by step, left padding and a row leaving included: decode_step's logits = HF's forward with its
    cache. Under LoRA (B nonzero) too, with the adapters added to each product (`decoding.plus_adapters`):
    in float32, and with the frozen weights in bf16 as a LoRA run on a bf16 CPU holds them, the adapters
    float32 (the same sums as peft's: only the kernels' order of additions differs)."""
    model, tokenizer = block_model
    if lora:
        model = deepcopy(model)
        with_adapters(model)
        if lora == "bf16":
            cast_weights(model, torch.bfloat16, frozen_only=True)  # as hardware.working_copy does under LoRA
    tolerance = {"atol": 1e-2, "rtol": 0} if lora == "bf16" else {"atol": 1e-5, "rtol": 1e-5}  # a bf16 step
    enc = tokenizer(QUESTIONS[:2], return_tensors="pt", padding=True, add_special_tokens=False)
    positions = (enc["attention_mask"].cumsum(1) - 1).clamp(min=0)
    reference, ours = DynamicCache(config=model.config), DynamicCache(config=model.config)
    for cache in (reference, ours):
        model(enc["input_ids"], enc["attention_mask"], positions, cache, use_cache=True)  # as decode does
    reference.batch_repeat_interleave(2)
    ours, weights = DecodeCache.from_prefill(ours, 2, 6), decode_weights(model, rows=4)
    assert weights is not None
    mask, position = enc["attention_mask"].repeat_interleave(2, 0), positions[:, -1].repeat_interleave(2) + 1
    tokens = torch.tensor([5, 6, 7, 8])
    for step in range(6):
        if step == 3:  # row 1 leaves the batch
            keep = torch.tensor([0, 2, 3])
            reference.batch_select_indices(keep)
            ours.batch_select_indices(keep)
            tokens, mask, position = tokens[keep], mask[keep], position[keep]
        mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1)
        expected = model(tokens[:, None], mask, position[:, None], reference, use_cache=True).logits[:, -1]
        got = decode_step(model, weights, tokens, position, ours, mask.shape[1] - 1, mask.bool())
        torch.testing.assert_close(got, expected, **tolerance)
        tokens, position = expected.argmax(-1), position + 1


# bf16: packed where oneDNN has bf16 kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_packed_linear_computes_what_f_linear_computes(dtype, rows):
    """Packed for 16 rows, right for any number of rows, with and without a bias."""
    torch.manual_seed(0)
    weight, bias, x = (torch.randn(96, 64).to(dtype), torch.randn(96).to(dtype),
                       torch.randn(rows, 64).to(dtype))
    for b in (None, bias):
        torch.testing.assert_close(packed_linear(weight, b, 16)(x), torch.nn.functional.linear(x, weight, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_under_autocast_computes_what_f_linear_computes(dtype):
    """Under bf16 autocast, which a user may sample in: a float32 model and a bf16 one, both given bf16
    inputs."""
    torch.manual_seed(0)
    weight, x = torch.randn(96, 64).to(dtype), torch.randn(3, 64).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(packed_linear(weight, None, 16)(x), torch.nn.functional.linear(x, weight))


def counting_onednn_ops(monkeypatch, names):
    """torch.ops.mkldnn replaced by a namespace with only the ops `names` (real ones, counted): [calls]."""
    calls, real = [], torch.ops.mkldnn

    def counted(name):
        def op(*args):
            calls.append(name)
            return getattr(real, name)(*args)
        return op

    monkeypatch.setattr(torch.ops, "mkldnn", types.SimpleNamespace(**{name: counted(name) for name in names}))
    return calls


ONEDNN_OPS = ("_reorder_linear_weight", "_linear_pointwise", "_is_mkldnn_bf16_supported")


def test_packed_linear_runs_the_onednn_ops_where_torch_has_them(monkeypatch):
    """fp32 on CPU: the weight is reordered once and every product takes the packed kernel (not F.linear)."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    calls = counting_onednn_ops(monkeypatch, ONEDNN_OPS)
    weight, x = torch.randn(96, 64), torch.randn(3, 64)
    linear = packed_linear(weight, None, 16)
    torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, weight))
    linear(x)
    assert calls.count("_reorder_linear_weight") == 1 and calls.count("_linear_pointwise") == 2


@pytest.mark.parametrize("present", [(), ONEDNN_OPS[:1], ONEDNN_OPS[1:]])  # none, or one or two of the three
def test_decoding_falls_back_to_f_linear_without_the_private_onednn_ops(tiny, eos_bias, monkeypatch, present):
    """torch.ops.mkldnn's private ops may leave a torch release: packed_linear is then F.linear itself, and
    decoding still gives generate's greedy tokens."""
    model, tokenizer = tiny
    calls = counting_onednn_ops(monkeypatch, present)
    assert decoding.onednn_ops() is None
    weight, x = torch.randn(96, 64), torch.randn(3, 64)
    assert torch.equal(packed_linear(weight, None, 16)(x), torch.nn.functional.linear(x, weight))
    eos_bias(0.4)
    fast = sample_fast(model, tokenizer, QUESTIONS, 3, 30, temperature=0)
    ref = sample(model, tokenizer, QUESTIONS, 3, 30, temperature=0)
    assert calls == [] and fast.completion_mask.sum(1).min() < 30
    assert torch.equal(fast.input_ids, ref.input_ids) and fast.texts == ref.texts


@torch.no_grad()
def test_every_decoding_step_samples_from_the_logits_of_a_full_forward(block_model, monkeypatch):
    """The logits each token is drawn from = transformers' forward over the whole finished rows (left-padded
    prompt + completion, positions counting real tokens), as completion_logprobs sees them: the loss's
    log-probs are those of the distribution sampled from, at every step, not only the first."""
    model, tokenizer = block_model
    drawn_from, draw = [], decoding.next_tokens

    def recording_next_tokens(logits, temperature, top_p):
        drawn_from.append(logits.clone())
        return draw(logits, temperature, top_p)

    monkeypatch.setattr(decoding, "next_tokens", recording_next_tokens)
    torch.manual_seed(0)
    rollout = sample_fast(model, tokenizer, QUESTIONS, 2, 6)  # a random model does not end within 6 tokens
    assert rollout.completion_len == 6 and len(drawn_from) == 6 and rollout.truncated.all()
    ids, attention = rollout.input_ids, rollout.attention_mask
    full = model(input_ids=ids, attention_mask=attention,
                 position_ids=(attention.cumsum(1) - 1).clamp(min=0)).logits
    prompt_len = ids.shape[1] - rollout.completion_len
    for t, logits in enumerate(drawn_from):  # token t was drawn from the output at the position before it
        torch.testing.assert_close(logits, full[:, prompt_len + t - 1], atol=1e-4, rtol=1e-4)


def test_decode_step_samples_what_the_transformers_forward_samples(block_model, monkeypatch):
    """Same seed, same tokens (float32), with and without decode_step; rows ending early included."""
    model, tokenizer = block_model
    eos = tokenizer.eos_token_id
    favour_eos(model, eos, 2.0)
    runs = []
    try:
        for weights in (decode_weights, lambda model, rows: None):
            monkeypatch.setattr(decoding, "decode_weights", weights)
            torch.manual_seed(7)
            runs.append(sample_fast(model, tokenizer, QUESTIONS, 3, 20).input_ids)
    finally:
        favour_eos(model, eos, None)
    assert torch.equal(*runs)
    lengths = (runs[0][:, -20:] != tokenizer.pad_token_id).sum(1)
    assert lengths.min() < lengths.max()


def test_other_architectures_decode_with_the_transformers_forward(monkeypatch):
    """decode_weights says None for a block decode_step does not implement; decode still matches generate."""
    model, tokenizer = tiny_qwen2()
    model.config.use_sliding_window = True
    assert decode_weights(model, rows=4) is None
    model.config.use_sliding_window = False
    monkeypatch.setattr(decoding, "decode_weights", lambda model, rows: None)
    fast = sample_fast(model.eval(), tokenizer, QUESTIONS, 2, 10, temperature=0)
    assert torch.equal(fast.input_ids,
                       sample(model, tokenizer, QUESTIONS, 2, 10, temperature=0).input_ids)


def test_next_tokens_draws_from_softmax_over_temperature():
    """Inverse-CDF draws have the frequencies softmax(logits / T) predicts (within 5 standard errors)."""
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -30.0, 0.5])
    for temperature in (1.0, 0.7):
        probs = torch.softmax(logits / temperature, 0)
        draws = next_tokens(logits.expand(200_000, -1), temperature, 1.0)
        freq = torch.bincount(draws, minlength=len(logits)).double() / len(draws)
        stderr = (probs * (1 - probs) / len(draws)).sqrt()
        assert ((freq - probs).abs() <= 5 * stderr + 1e-6).all(), (freq, probs)


def test_next_tokens_top_p_keeps_the_nucleus_renormalised():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([0.5, 0.05, 0.3, 0.15]))
    draws = next_tokens(logits.expand(100_000, -1), 1.0, 0.8)  # nucleus {0, 2}: 0.5 + 0.3 reaches 0.8
    freq = torch.bincount(draws, minlength=4).double() / len(draws)
    assert freq[1] == 0 and freq[3] == 0
    assert abs(freq[0] - 0.5 / 0.8) < 0.01
    assert torch.equal(next_tokens(logits[None], 1.0, 0.01), torch.tensor([0]))  # at least the top token


def test_next_tokens_greedy_and_never_a_zero_probability_token(monkeypatch):
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, -1.0, 2.0]])
    assert torch.equal(next_tokens(logits, 0.0, 1.0), torch.tensor([1, 0]))
    torch.manual_seed(0)
    masked = torch.tensor([-float("inf"), 0.0, -float("inf"), 0.0]).expand(10_000, -1)
    assert set(next_tokens(masked, 1.0, 1.0).tolist()) == {1, 3}
    monkeypatch.setattr(torch, "rand", lambda *shape, device=None: torch.zeros(*shape, device=device))
    # a uniform draw of exactly 0 (rare, possible): not token 0
    assert next_tokens(masked[:1], 1.0, 1.0).item() == 1


def test_decode_samples_first_tokens_from_the_models_distribution(tiny):
    """End to end: first completion tokens of many sampled rows follow exp(completion_logprobs)."""
    model, tokenizer = tiny
    torch.manual_seed(0)
    # a sharp distribution, so few tokens carry the mass and counts are informative
    temperature, n = 0.05, 4000
    rollout = sample_fast(model, tokenizer, ["hi"], n, 1, temperature=temperature)
    probs = torch.softmax(model(**tokenizer(model_module.format_prompts(tokenizer, ["hi"]),
                                            return_tensors="pt", add_special_tokens=False)).logits[0, -1]
                          / temperature, 0)
    freq = torch.bincount(rollout.input_ids[:, -1], minlength=len(probs)).double() / n
    assert (freq - probs.double()).abs().sum() < 0.06  # total variation (x2) of a 4000-draw sample
    logp = packed_logprobs(model, rollout.input_ids[:8], rollout.attention_mask[:8], 1, temperature)
    assert torch.allclose(logp.exp(), probs[rollout.input_ids[:8, -1]], atol=1e-5)


def test_sampled_decode_is_reproducible_for_a_seed(tiny):
    model, tokenizer = tiny
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(sample_fast(model, tokenizer, QUESTIONS[:2], 4, 12).input_ids)
    assert torch.equal(*runs)


def test_sample_with_generate_reference_path_still_runs(tiny):
    model, tokenizer = tiny
    enc = tokenizer(["hi"], return_tensors="pt", add_special_tokens=False)
    ids = sample_with_generate(model, enc["input_ids"], enc["attention_mask"], 3, 5, 1.0, 1.0,
                               tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert ids.shape[0] == 3 and ids.shape[1] <= 5


def test_working_copy_is_bf16_follows_steps_and_matches_autocast_logprobs(tiny):
    model, tokenizer = tiny
    model = deepcopy(model)
    assert working_copy(model, "fp32") is model
    copy = working_copy(model, "bf16")
    assert all(p.dtype == torch.bfloat16 and p.requires_grad for p in copy.parameters())  # it trains
    assert copy.lm_head.weight is copy.model.embed_tokens.weight  # tied as in the model
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # an optimizer step
    assert not torch.equal(copy.lm_head.weight, model.lm_head.weight.bfloat16())
    copy_weights(model, into=copy)
    for p, q in zip(copy.parameters(), model.parameters()):
        assert torch.equal(p, q.bfloat16())
    torch.manual_seed(0)
    rollout = sample_fast(model, tokenizer, QUESTIONS, 2, 8)
    args = (rollout.input_ids, rollout.attention_mask, rollout.completion_len)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast_logp = packed_logprobs(model, *args)
        copy_logp = packed_logprobs(copy, *args)
    # bf16 rounding of activations, not a different model
    assert (copy_logp - autocast_logp).abs().max() < 0.05


def test_accumulate_gradients_sums_micro_batches_in_float32_and_frees_the_bf16_ones(tiny):
    model, tokenizer = tiny
    model = deepcopy(model)
    copy = working_copy(model, "bf16")
    torch.manual_seed(0)
    rollout = sample_fast(copy, tokenizer, QUESTIONS, 2, 8)
    grads = []
    for rows in (slice(0, 3), slice(3, None)):  # two micro-batches
        logp = packed_logprobs(copy, rollout.input_ids[rows], rollout.attention_mask[rows],
                                   rollout.completion_len)
        (logp * rollout.completion_mask[rows]).sum().backward()
        grads.append([p.grad.clone() for p in copy.parameters()])
        accumulate_gradients(copy, into=model)
        assert all(p.grad is None for p in copy.parameters())
    for p, first, second in zip(model.parameters(), *grads):
        assert p.grad.dtype == torch.float32
        assert torch.equal(p.grad, first.float() + second.float())  # not rounded to bf16 in between
    accumulate_gradients(model, into=model)  # fp32: the model is its own working copy; nothing moves
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("flags,expected", [({"avx2"}, "fp32"), ({"avx2", "avx512f"}, "fp32"),
                                            ({"avx2", "avx512f", "avx512_bf16"}, "bf16"),
                                            ({"amx_bf16"}, "bf16"), (set(), "fp32")])
def test_resolve_precision_auto_uses_bf16_only_with_native_bf16(monkeypatch, flags, expected):
    monkeypatch.setattr(hardware, "cpu_features", lambda: flags)
    assert resolve_precision("auto", torch.device("cpu")) == expected
    assert resolve_precision("fp32", torch.device("cpu")) == "fp32"
    assert resolve_precision("bf16", torch.device("cpu")) == "bf16"


def test_cpu_features_reads_this_machines_flags():
    features = cpu_features()
    assert isinstance(features, set) and features <= {"avx2", "avx512f", "avx512_bf16", "amx_bf16",
                                                      "amx_tile"}


def packed_and_plain(model, ids, attn, completion_len, temperature=0.7):
    """(log-probs, gradients of the trained parameters: under LoRA the adapters') of the sum of the real
    tokens' log-probs, by the plain definition then the packed pass."""
    results = []
    for logprobs in (plain_logprobs, packed_logprobs):
        model.zero_grad(set_to_none=True)
        logp = logprobs(model, ids, attn, completion_len, temperature=temperature)
        (logp * attn[:, -completion_len:]).sum().backward()
        trained = [p for p in model.parameters() if p.requires_grad]
        assert trained and all(p.grad is not None for p in trained), "a trained parameter got no gradient"
        results.append((logp.detach(), [p.grad.clone() for p in trained]))
    return results


# attention by SDPA: the CUDA branch, chosen here on CPU
@pytest.mark.parametrize("sdpa", [False, True])
# whole groups, cut groups, mixed
@pytest.mark.parametrize("micro_rows", [slice(0, 8), slice(2, 7), [5, 0, 6, 1]])
def test_packed_logprobs_and_gradients_equal_the_plain_pass(block_model, micro_rows, sdpa, monkeypatch):
    """One packed stream (each distinct prompt once, no padding, attention per segment): the same log-probs
    and gradients as one plain pass over the padded rows, 0 after each row's EOS; rows of two prompts in any
    order, and a row whose first token is EOS (no completion token to feed in); Qwen2 with q/k/v biases, and
    Llama; attention written out (CPU) and by SDPA (CUDA)."""
    monkeypatch.setattr(packing, "attention_by_sdpa", lambda device: sdpa)
    model, tokenizer = block_model
    model = deepcopy(model).train()
    torch.manual_seed(0)
    rollout = sample_fast(model, tokenizer, QUESTIONS[:2], 4, 10)  # 2 prompts of different lengths x 4
    assert rollout.completion_len == 10  # random weights never emit EOS: every row has 10 columns to cut
    # completions cut as if EOS came there: rows end at 1..10
    lengths = torch.tensor([10, 2, 7, 4, 10, 1, 5, 8])
    completion_mask = (torch.arange(10)[None, :] < lengths[:, None]).long()[micro_rows]  # [n, 10]
    ids, attn = rollout.input_ids[micro_rows], rollout.attention_mask[micro_rows].clone()
    attn[:, -10:] = completion_mask
    (plain, plain_grads), (packed, packed_grads) = packed_and_plain(model, ids, attn, rollout.completion_len)
    mask = completion_mask.bool()
    assert torch.equal(plain[~mask], packed[~mask]) and not plain[~mask].any()  # 0 after EOS
    assert torch.allclose(plain[mask], packed[mask], atol=1e-5)
    for g_plain, g_packed in zip(plain_grads, packed_grads):
        assert torch.allclose(g_plain, g_packed, atol=1e-5, rtol=1e-4)


def test_packed_logprobs_and_adapter_gradients_under_lora_equal_the_plain_pass(tiny):
    """Under LoRA (B nonzero) the packed pass runs the block's modules, adapters included: the plain pass's
    log-probs and adapter gradients, and log-probs other than the base's."""
    model, tokenizer = deepcopy(tiny[0]).train(), tiny[1]
    with_adapters(model)
    torch.manual_seed(0)
    rollout = sample_fast(model, tokenizer, QUESTIONS, 2, 8)
    ids, attn, completion_len = rollout.input_ids, rollout.attention_mask, rollout.completion_len
    (plain, plain_grads), (packed, packed_grads) = packed_and_plain(model, ids, attn, completion_len)
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-4)
    assert len(packed_grads) == 2 * 7 * len(model.model.layers)  # A and B of 7 linear layers per block
    for g_plain, g_packed in zip(plain_grads, packed_grads):
        torch.testing.assert_close(g_packed, g_plain, atol=1e-5, rtol=1e-4)
    with torch.no_grad(), adapters_off(model):
        assert not torch.allclose(packed_logprobs(model, ids, attn, completion_len, 0.7), plain, atol=1e-3)


@pytest.mark.parametrize("tied", [True, False])
def test_packed_embedding_gradient_is_dense_and_skips_the_padding_token(tied):
    """SmolLM2's pad token is its EOS, <|im_end|>, which the chat template puts in every prompt: nn.Embedding
    gives that row no gradient from the input side (padding_idx), and the packed pass must not either. Tied to
    the output layer or not, the embedding's gradient reaches the optimizer dense (fused AdamW takes no sparse
    one)."""
    model, tokenizer = tiny_qwen2()
    model.config.tie_word_embeddings, model.config.pad_token_id = tied, tokenizer.eos_token_id
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(model.config).train()  # its embedding built with padding_idx = EOS
    tokenizer.padding_side = "left"
    rollout = sample_fast(model, tokenizer, QUESTIONS[:2], 4, 6)
    ids, attn, prompt_len = rollout.input_ids, rollout.attention_mask, -rollout.completion_len
    # a real input token
    assert (ids[:, :prompt_len][attn[:, :prompt_len].bool()] == tokenizer.eos_token_id).any()
    (plain, plain_grads), (packed, packed_grads) = packed_and_plain(model, ids, attn, rollout.completion_len)
    assert torch.allclose(plain, packed, atol=1e-5)
    for g_plain, g_packed in zip(plain_grads, packed_grads):
        assert g_packed.layout == torch.strided and torch.allclose(g_plain, g_packed, atol=1e-5, rtol=1e-4)
    embedding_grad = packed_grads[0]  # the first parameter: embed_tokens.weight
    assert embedding_grad.abs().sum(1).count_nonzero() > 10
    if not tied:  # the input side alone: nothing for the padding token
        assert not embedding_grad[tokenizer.eos_token_id].any()


@pytest.mark.parametrize("lora", [False, True])
def test_packed_logprobs_with_gradient_checkpointing_equal_the_plain_pass(tiny, monkeypatch, lora):
    """--grad-checkpointing wraps each packed block in torch's checkpoint (recomputed in backward): same
    log-probs and gradients as without it, and as the plain path, whose layers transformers checkpoints.
    Under LoRA (B nonzero) too: the frozen embedding's output needs no gradient, which a reentrant
    checkpoint takes for a layer with nothing to differentiate (no gradient for any adapter)."""
    model, tokenizer = tiny
    model = deepcopy(model).train()
    if lora:
        with_adapters(model)
    torch.manual_seed(3)
    rollout = sample_fast(model, tokenizer, QUESTIONS[:2], 3, 6)
    args = (model, rollout.input_ids, rollout.attention_mask, rollout.completion_len)
    expected = packed_and_plain(*args)
    assert all(g.any() for g in expected[0][1]) or not lora  # every adapter's gradient, A's and B's
    model_module.checkpoint_activations(model)
    checkpointed_blocks, checkpoint = [], packing.checkpoint

    def counting_checkpoint(*call_args, **call_kwargs):
        checkpointed_blocks.append(1)
        return checkpoint(*call_args, **call_kwargs)

    monkeypatch.setattr(packing, "checkpoint", counting_checkpoint)
    checkpointed = packed_and_plain(*args)
    assert len(checkpointed_blocks) == len(model.model.layers)  # the packed pass, once per layer
    for (logp, grads), (logp_ckpt, grads_ckpt) in zip(expected, checkpointed):
        torch.testing.assert_close(logp_ckpt, logp)
        for a, b in zip(grads, grads_ckpt):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("bf16", ["working copy", "autocast"])
def test_packed_logprobs_in_bf16_are_as_close_to_fp32_as_the_plain_pass(tiny, bf16):
    """bf16 rounds differently along the two paths; each stays as close to the float32 log-probs as the other.
    On train.py's bf16 working copy, and under autocast (a user's float32 model)."""
    model, tokenizer = tiny
    torch.manual_seed(4)
    rollout = sample_fast(model, tokenizer, QUESTIONS[:2], 4, 10)
    args = (rollout.input_ids, rollout.attention_mask, rollout.completion_len)
    mask = rollout.completion_mask.bool()
    net = working_copy(model, "bf16") if bf16 == "working copy" else model
    with torch.no_grad():
        exact = plain_logprobs(model, *args)[mask]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16 == "autocast"):
            errors = [(logprobs(net, *args)[mask] - exact).abs().max()
                      for logprobs in (plain_logprobs, packed_logprobs)]
    assert 0 < errors[1] < 2 * errors[0] + 1e-3, errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segment_attention_written_out_and_by_sdpa_equal_gqa_attention(dtype):
    """Both branches of segment_attention (written out: CPU; SDPA with `sdpa_mask`: CUDA) against torch's own
    GQA attention (a boolean mask, enable_gqa), 3 query heads per kv head, values and gradients; a query slot
    that may attend to only its first key as well."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, *shape, 8).to(dtype).requires_grad_() for shape in ((5, 6), (7, 2), (7, 2)))
    attend = torch.rand(2, 1, 5, 7) < 0.5
    attend[..., 0] = True

    def reference(q, k, v, attend, scale, mask):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=attend, scale=scale, enable_gqa=True)  # [S, 6, 5, 8]
        return out.transpose(1, 2).reshape(10, 48)

    results = []
    for attention, mask in ((reference, None), (packing.segment_attention, None),
                            (packing.segment_attention, packing.sdpa_mask(attend, 3, dtype))):
        out = attention(q, k, v, attend, 0.3, mask)
        grads = torch.autograd.grad((out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(),
                                    (q, k, v))
        results.append((out, grads))
    tolerance = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    (expected, expected_grads) = results[0]
    for out, grads in results[1:]:
        assert out.shape == (10, 48)
        torch.testing.assert_close(out, expected, **tolerance)
        for a, b in zip(grads, expected_grads):
            torch.testing.assert_close(a, b, **tolerance)


def test_packed_attention_by_sdpa_meets_the_fused_kernels_conditions(tiny, monkeypatch):
    """What torch's sdp_utils.cpp asks of the memory-efficient kernel that a CPU run can check: no
    enable_gqa (q and k with as many heads), a mask in q's dtype, its rows 8-aligned (else torch pads a copy in
    every call), a unit stride in the last dimension; and the mask built once per pass, not per layer."""
    model, tokenizer = tiny
    rollout = sample_fast(model, tokenizer, QUESTIONS[:2], 3, 6)
    calls, sdpa = [], F.scaled_dot_product_attention

    def recording_sdpa(q, k, v, **kwargs):
        calls.append((q, k, v, kwargs))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(packing, "attention_by_sdpa", lambda device: True)
    monkeypatch.setattr(packing.F, "scaled_dot_product_attention", recording_sdpa)
    with torch.no_grad():
        packed_logprobs(working_copy(model, "bf16"), rollout.input_ids, rollout.attention_mask,
                        rollout.completion_len)
    assert len(calls) == len(model.model.layers)
    masks = {kwargs["attn_mask"].data_ptr() for *_, kwargs in calls}
    assert len(masks) == 1
    for q, k, v, kwargs in calls:
        mask = kwargs["attn_mask"]
        assert not kwargs.get("enable_gqa") and q.shape[1] == k.shape[1] == v.shape[1] == 2  # kv heads
        assert mask.dtype == q.dtype == torch.bfloat16 and mask.shape[1] == 1
        assert all(stride % 8 == 0 for stride in mask.stride()[:-1]) and mask.stride(-1) == 1
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU check, issue 46)")
def test_packed_attention_on_cuda_runs_on_a_fused_kernel(tiny):
    """On CUDA, SDPA held to the memory-efficient and cuDNN kernels (it raises if neither takes the call): the
    packed pass runs forward and backward there, with the plain pass's log-probs. Not yet run on a GPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, tokenizer = tiny
    torch.manual_seed(0)
    rollout = sample_fast(model, tokenizer, QUESTIONS[:2], 4, 10)
    net = deepcopy(model).cuda()
    args = (rollout.input_ids.cuda(), rollout.attention_mask.cuda(), rollout.completion_len)
    plain = plain_logprobs(net, *args)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        packed = packed_logprobs(net, *args)
        packed.sum().backward()
    torch.testing.assert_close(packed.detach(), plain.detach(), atol=1e-4, rtol=1e-4)


def test_pack_rows_streams_each_prompt_once_and_each_completion_but_its_last_token():
    """Prompts [1 2 3] (left-padded) and [4 5]; completions of 3, 1 and 2 tokens: 3 + 2 prompt tokens and
    2 + 0 + 1 completion tokens, 8 in all, then 8 dummies; each target is predicted by the token before it in
    its own row."""
    ids = torch.tensor([[1, 2, 3, 7, 8, 9], [1, 2, 3, 6, 0, 0], [0, 4, 5, 7, 8, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0]])
    rows = packing.pack_rows(ids, attn, 3)
    assert rows.tokens.tolist() == [1, 2, 3, 7, 8, 4, 5, 7] + [0] * 8
    assert rows.positions[:8].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert rows.targets.tolist()[: rows.num_targets] == [7, 8, 9, 6, 7, 8] and len(rows.targets) == 16
    assert rows.predictors.tolist()[: rows.num_targets] == [2, 3, 4, 2, 6, 7]
    keys = [[k for k in segment if k < 16] for segment in rows.key_slots.tolist()]
    # a prompt; row 0; a prompt; row 2 (row 1: none)
    assert keys == [[0, 1, 2], [0, 1, 2, 3, 4], [5, 6], [5, 6, 7]]
    row_0 = rows.attend[1, 0, :, :5].tolist()  # its 2 queries, then an empty slot (the longest segment has 3)
    # causal; empty: one key
    assert row_0 == [[True, True, True, True, False], [True] * 5, [True] + [False] * 4]
    assert (rows.output_slots[8:] == rows.output_slots.max()).all()  # dummies take the empty output slot


def test_completion_logprobs_packs_written_out_blocks_only(tiny, monkeypatch):
    """The Llama/Qwen2 block runs packed (transformers' forward is never called); another block runs its own
    forward."""
    model, tokenizer = tiny
    rollout = sample_fast(model, tokenizer, QUESTIONS[:2], 2, 4)
    calls = []
    hook = model.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad():
            packed = packed_logprobs(model, rollout.input_ids, rollout.attention_mask,
                                         rollout.completion_len)
            assert calls == []
            monkeypatch.setattr(packing, "writes_out_block", lambda config: False)
            plain = packed_logprobs(model, rollout.input_ids, rollout.attention_mask,
                                        rollout.completion_len)
            assert calls == [1]
    finally:
        hook.remove()
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)


# tied: the embedding's sparse gradient is added into the dense one
@pytest.mark.parametrize("tied", [False, True])
def test_packed_gradients_are_the_same_every_time(tied):
    """Bitwise, over repeated backward passes: the G rows of a group share one predictor (their prompt's last
    token), and gathering it with tensor indexing made CPU backward add the G gradients into it in a
    thread-dependent order (fp32 runs of train.py parted after a few steps). One group, as in a micro-batch of
    train.py: its rows then lie in both halves of the stream that two threads split; sizes large enough for
    the backward to thread."""
    config = LlamaConfig(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    prompts = torch.randint(0, 320, (1, 12)).repeat_interleave(8, dim=0)  # one prompt x G=8 rows
    input_ids = torch.cat([prompts, torch.randint(0, 320, (8, 40))], dim=1)
    attention_mask = torch.ones_like(input_ids)
    grads = []
    for _ in range(12):
        model.zero_grad(set_to_none=True)
        packed_logprobs(model, input_ids, attention_mask, 40).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert all(torch.equal(grads[0], g) for g in grads[1:])


def test_packed_rows_tell_prompts_apart_by_mask_too(tiny):
    """Same ids but a different mask (pad == EOS can make this happen) are different prompts."""
    model, tokenizer = tiny
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 8, 9]])
    attn = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    with torch.no_grad():
        plain = plain_logprobs(model, ids, attn, 2)
        packed = packed_logprobs(model, ids, attn, 2)
    assert torch.allclose(plain, packed, atol=1e-5) and not torch.allclose(packed[0], packed[1])


@pytest.mark.parametrize("logprobs", [plain_logprobs, packed_logprobs])
def test_logprobs_equal_the_textbook_definition_over_a_full_forward(tiny, logprobs):
    """log_softmax(logits / T) at the targets, from the logits of every position of a full forward: the plain
    definition (logits of the completion positions only) and the packed pass (its stream rounded up to a
    multiple of 16 with dummy tokens, which must change no real token's log-prob)."""
    model, tokenizer = tiny
    torch.manual_seed(1)
    rollout = sample_fast(model, tokenizer, QUESTIONS[:2], 3, 7)
    ids, attn = model_module.trim_padding(rollout.input_ids, rollout.attention_mask,
                                          rollout.completion_mask)[:2]
    c = rollout.completion_len
    streamed = model_module.real_tokens(ids, attn, c) - len(ids)  # each row's last token predicts nothing
    assert streamed % 16 != 0 and len(packing.pack_rows(ids, attn, c).tokens) % 16 == 0  # dummies to add
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn,
                       position_ids=(attn.cumsum(1) - 1).clamp(min=0)).logits
        direct = (torch.log_softmax(logits[:, -c - 1:-1].float() / 0.8, -1)
                  .gather(2, ids[:, -c:, None]).squeeze(2))
        logp = logprobs(model, ids, attn, c, temperature=0.8)
    assert logp.shape == direct.shape
    mask = rollout.completion_mask.bool()
    assert torch.allclose(logp[mask], direct[mask], atol=1e-5)


def test_output_layer_sees_the_real_completion_tokens_rounded_up_to_a_multiple_of_16(tiny):
    """Logits only where a completion token is real (+ fewer than 16 more, so the layer's shapes recur)."""
    model, tokenizer = tiny
    torch.manual_seed(2)
    rollout = sample_fast(model, tokenizer, QUESTIONS[:2], 3, 7)
    assert rollout.completion_len == 7  # random weights never emit EOS: every row has 7 columns to cut
    attn = rollout.attention_mask.clone()
    # 25 real tokens
    attn[:, -7:] = (torch.arange(7)[None, :] < torch.tensor([7, 1, 3, 7, 2, 5])[:, None]).long()
    rows = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    try:
        with torch.no_grad():
            packed_logprobs(model, rollout.input_ids, attn, 7)
    finally:
        hook.remove()
    assert rows == [32]


def test_token_logprobs_gradient_is_onehot_minus_softmax_over_temperature(monkeypatch):
    """TokenLogProbs' hand-written backward against finite differences (float64), over chunks of 2 rows."""
    monkeypatch.setattr(TokenLogProbs, "CHUNK", 2)
    torch.manual_seed(0)
    logits = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (5,))
    for temperature in (1.0, 0.7):
        assert torch.autograd.gradcheck(lambda z: TokenLogProbs.apply(z, targets, temperature), (logits,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_equal_autograd_through_log_softmax(monkeypatch, dtype):
    """Same values and gradients as the plain float32 log-softmax they replace, for float32 and bf16 logits;
    12 rows in chunks of 5."""
    monkeypatch.setattr(TokenLogProbs, "CHUNK", 5)
    torch.manual_seed(0)
    logits = (4 * torch.randn(12, 1000)).to(dtype)
    targets, weights = torch.randint(0, 1000, (12,)), torch.randn(12)
    results = []
    for fn in (lambda z: TokenLogProbs.apply(z, targets, 0.7),
               lambda z: torch.log_softmax(z.float() / 0.7, -1).gather(1, targets[:, None]).squeeze(1)):
        z = logits.clone().requires_grad_()
        logp = fn(z)
        (logp * weights).sum().backward()
        results.append((logp, z.grad))
    (logp, grad), (expected_logp, expected_grad) = results
    assert logp.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(logp, expected_logp)
    torch.testing.assert_close(grad, expected_grad)


def test_token_logprobs_keep_every_buffer_on_the_logits_device():
    """bf16 logits on the meta device stand in for CUDA: a buffer made on the CPU would fail to take them."""
    logits = torch.randn(3, 11, dtype=torch.bfloat16, device="meta", requires_grad=True)
    logp = TokenLogProbs.apply(logits, torch.zeros(3, dtype=torch.long, device="meta"), 0.7)
    (grad,) = torch.autograd.grad(logp.sum(), logits)
    assert logp.device.type == grad.device.type == "meta" and grad.dtype == torch.bfloat16


def test_other_blocks_take_fast_logprobs_from_their_own_forward(tiny, monkeypatch):
    """A block packed_states does not write out: its own forward, logits at the real completion tokens only,
    the log-softmax by TokenLogProbs; the same log-probs and gradients as the plain definition, 0 after
    EOS."""
    model, tokenizer = tiny
    model = deepcopy(model)
    torch.manual_seed(0)
    rollout = sample_fast(model, tokenizer, QUESTIONS[:2], 3, 6)
    attn = rollout.attention_mask.clone()
    # rows end early
    attn[:, -6:] = (torch.arange(6)[None, :] < torch.tensor([6, 1, 3, 6, 2, 5])[:, None]).long()
    monkeypatch.setattr(packing, "writes_out_block", lambda config: False)
    token_logprobs_rows, apply = [], TokenLogProbs.apply
    monkeypatch.setattr(TokenLogProbs, "apply", lambda logits, *a: token_logprobs_rows.append(len(logits))
                        or apply(logits, *a))
    (plain, plain_grads), (fast, fast_grads) = packed_and_plain(model, rollout.input_ids, attn, 6)
    assert token_logprobs_rows == [23]  # the real completion tokens, no padding rounded in
    assert not fast[attn[:, -6:] == 0].any()
    torch.testing.assert_close(fast, plain)
    for a, b in zip(plain_grads, fast_grads):
        torch.testing.assert_close(b, a)


@pytest.mark.parametrize("path", ["plain log-probs", "fast log-probs, own forward", "decode's prefill"])
def test_the_output_layer_takes_a_contiguous_input_on_every_path(tiny, monkeypatch, path):
    """`model.last_positions`: with a frozen output layer (LoRA, the reference), a sliced [N, C, h] input
    makes torch's matmul copy the layer once per row on the CPU. Every path that asks the model for the
    logits of some positions gives it a contiguous input."""
    model, tokenizer = tiny
    rollout = sample_fast(model, tokenizer, QUESTIONS[:2], 2, 4)
    monkeypatch.setattr(packing, "writes_out_block", lambda config: False)
    inputs = []
    hook = model.lm_head.register_forward_pre_hook(lambda _, args: inputs.append(args[0]))
    try:
        with torch.no_grad():
            if path == "decode's prefill":
                prompts = tokenizer(model_module.format_prompts(tokenizer, QUESTIONS[:2]),
                                    return_tensors="pt", padding=True, padding_side="left")
                decode(model, prompts.input_ids, prompts.attention_mask, 2, 1, 1.0, 1.0,
                       tokenizer.eos_token_id, tokenizer.pad_token_id)
            else:
                logprobs = plain_logprobs if path == "plain log-probs" else packed_logprobs
                logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.completion_len)
    finally:
        hook.remove()
    assert inputs and all(x.is_contiguous() for x in inputs)
    assert inputs[0].shape[1] == (1 if path == "decode's prefill" else rollout.completion_len)  # the last


def test_decode_pads_prompts_to_a_multiple_of_16_for_its_prefill(tiny):
    """The prefill sees whole multiples of 16 columns (masked left padding), so its matmul shapes recur; the
    rollout keeps the tokenizer's own prompt columns, as sampling with generate does."""
    model, tokenizer = tiny
    widths = []
    hook = model.register_forward_pre_hook(lambda module, args: widths.append(args[0].shape[1]))  # input ids
    try:
        rollout = sample_fast(model, tokenizer, QUESTIONS, 2, 5)
    finally:
        hook.remove()
    prompt_len = rollout.input_ids.shape[1] - rollout.completion_len
    assert widths[0] % 16 == 0 and prompt_len % 16 != 0 and widths[0] == prompt_len + -prompt_len % 16
    assert rollout.attention_mask[:, 0].any()  # no all-pad column in front


def test_sample_pads_prompts_on_the_left_whatever_the_tokenizer_says():
    """A tokenizer that pads on the right (tiny_qwen2's own, before load_model sets it) still gets left-padded
    prompts: decoding and the log-probs read each prompt's last column as its last token."""
    model, tokenizer = tiny_qwen2()
    assert tokenizer.padding_side == "right"
    rollouts = []
    for side in ("right", "left"):
        tokenizer.padding_side = side
        torch.manual_seed(0)
        rollouts.append(sample_fast(model, tokenizer, QUESTIONS[:2], 2, 4))
    right, left = rollouts
    prompt_len = right.input_ids.shape[1] - right.completion_len
    assert right.attention_mask[:, prompt_len - 1].all() and not right.attention_mask[:, 0].all()
    assert torch.equal(right.input_ids, left.input_ids)


def test_dataclass_parser_gives_a_true_bool_field_a_no_flag():
    """A config field `fast: bool = arg(True, ...)` (train.py's way) is --fast/--no-fast; a False one
    stays --x."""
    import dataclasses

    from infra.flags import arg, dataclass_parser

    @dataclasses.dataclass
    class Config:
        fast: bool = arg(True, "fast paths")
        resume: bool = arg(False, "resume")

    parser = dataclass_parser(Config, "test")
    assert vars(parser.parse_args([])) == {"fast": True, "resume": False}
    assert vars(parser.parse_args(["--no-fast", "--resume"])) == {"fast": False, "resume": True}
    assert parser.parse_args(["--fast"]).fast is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--no-resume"])
