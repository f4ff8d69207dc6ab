"""Qwen2.5 offline: the tiny Qwen2 laid out as Qwen2.5's published files have their special tokens, chat
template and generation config (`qwen25`); where a completion stops, greedy under Qwen's generation config,
float32 buffers in the bf16 copies, and the prompt formats."""

import json
import types
from collections import Counter
from contextlib import contextmanager

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

import eval as evaluation
import model as model_module
import train
from data.tasks import Problem, load_problems
from fast.decoding import decode
from infra.hardware import working_copy
from infra.model_files import save_folder, tiny_qwen2
from loop import run as run_module
from model import (RAW_INSTRUCTION, completion_logprobs, format_prompts, load_model, sample,
                   sample_with_generate, stop_token_ids)
from verifier import load_reward

CPU = torch.device("cpu")
PATHS = {"generate": sample_with_generate, "decode": decode}

# Qwen2.5's published files, as we remember them: no model hub is reachable here (third-party copies of
# Qwen2.5-Instruct's generation_config.json found in a code search agree). Qwen/Qwen2.5-*-Instruct:
# tokenizer_config.json has eos_token <|im_end|> and pad_token <|endoftext|>; generation_config.json has
# eos_token_id [151645, 151643] (<|im_end|>, <|endoftext|>), do_sample true, temperature 0.7, top_p 0.8,
# top_k 20, repetition_penalty 1.05; the chat template (ChatML) opens with a default system turn.
# Qwen/Qwen2.5-Math-1.5B (base): eos_token and pad_token <|endoftext|>; generation_config.json has
# eos_token_id 151643 (<|endoftext|>) and do_sample false; its chat template is ChatML too (default system:
# Qwen2.5-Math's CoT instruction), so its turns end with <|im_end|>, which is not its EOS. The template below
# keeps the published ones' ChatML turns and default system turn, not their tool-calling branches.
QWEN_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '" + "DEFAULT_SYSTEM" + "' %}{% endif %}"
    "<|im_start|>system\n{{ system }}<|im_end|>\n"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LAYOUTS = {
    "instruct": dict(eos="<|im_end|>",
                     system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
                     generation=dict(eos_token_id=["<|im_end|>", "<|endoftext|>"], do_sample=True,
                                     temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)),
    "math-base": dict(eos="<|endoftext|>", system=RAW_INSTRUCTION.replace("\\", "\\\\"),
                      generation=dict(eos_token_id="<|endoftext|>", do_sample=False)),
}


def qwen25(layout: str) -> tuple:
    """(model, tokenizer): the tiny random Qwen2 with Qwen2.5's `layout` of special tokens, chat template and
    generation config (`LAYOUTS`)."""
    model, tokenizer = load_model("tiny-qwen2", CPU)
    spec = LAYOUTS[layout]
    tokenizer.eos_token = spec["eos"]
    tokenizer.chat_template = QWEN_TEMPLATE.replace("DEFAULT_SYSTEM", spec["system"])
    ids = tokenizer.convert_tokens_to_ids
    eos = spec["generation"]["eos_token_id"]
    eos_ids = [ids(token) for token in eos] if isinstance(eos, list) else ids(eos)
    model.config.eos_token_id = tokenizer.eos_token_id
    endoftext = ids("<|endoftext|>")
    model.generation_config = GenerationConfig(**{**spec["generation"], "eos_token_id": eos_ids},
                                               bos_token_id=endoftext, pad_token_id=endoftext)
    return model, tokenizer


@contextmanager
def scripted(model, tokens: list[int]):
    """Within the block, the k-th forward pass of `model` makes tokens[k] (the last one after the script) the
    only likely next token, through an output-layer bias: HF generate's forward and decode's prefill and
    decode_step alike embed their new tokens first, and decode_step applies the same bias."""
    bias = torch.nn.Parameter(torch.zeros(model.lm_head.out_features), requires_grad=False)
    model.lm_head.bias = bias
    calls = []

    def before_embedding(module, inputs):
        bias.zero_()[tokens[min(len(calls), len(tokens) - 1)]] = 100.0
        calls.append(1)

    hook = model.model.embed_tokens.register_forward_pre_hook(before_embedding)
    try:
        yield
    finally:
        hook.remove()
        model.lm_head.bias = None


def script(tokenizer, first: str, second: str) -> list[int]:
    """An answer, the stop token `first`, an invented turn with another answer, the stop token `second`."""
    ids = tokenizer.convert_tokens_to_ids
    return (tokenizer.encode("So \\boxed{2}") + [ids(first)] + tokenizer.encode("user\nNo: \\boxed{3}")
            + [ids(second)])


# ---------------------------------------------------------------------------- where a completion stops


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("first, second", [("<|im_end|>", "<|endoftext|>"), ("<|endoftext|>", "<|im_end|>")])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sampling_stops_at_the_first_stop_token_on_both_paths(layout, first, second, path):
    """Whichever of Qwen's two stop tokens comes first ends the row, its mask and its text, though only one of
    them is the tokenizer's EOS."""
    model, tokenizer = qwen25(layout)
    tokens = script(tokenizer, first, second)
    answer_len = len(tokenizer.encode("So \\boxed{2}"))
    torch.manual_seed(0)
    with scripted(model, tokens):
        rollout = sample(model, tokenizer, ["What is 1 + 1?"], 2, 40, temperature=1.0,
                         sample_completions=PATHS[path])
    assert rollout.completion_len == answer_len + 1  # sampling stopped there, on both rows
    assert rollout.input_ids[:, -1].tolist() == [tokenizer.convert_tokens_to_ids(first)] * 2
    assert rollout.completion_mask.sum(1).tolist() == [answer_len + 1] * 2
    assert rollout.texts == ["So \\boxed{2}"] * 2
    assert not rollout.truncated.any()


def test_stop_tokens_are_the_eos_the_generation_config_and_the_end_of_turn():
    model, tokenizer = qwen25("math-base")
    ids = tokenizer.convert_tokens_to_ids
    both = sorted([ids("<|im_end|>"), ids("<|endoftext|>")])
    assert tokenizer.eos_token == "<|endoftext|>"
    assert model.generation_config.eos_token_id == ids("<|endoftext|>")
    assert stop_token_ids(model, tokenizer) == both  # <|im_end|>: the end of a turn in the chat template
    model, tokenizer = qwen25("instruct")
    assert stop_token_ids(model, tokenizer) == both  # <|endoftext|>: in the generation config
    tokenizer.chat_template = None
    model.generation_config.eos_token_id = None
    assert stop_token_ids(model, tokenizer) == [ids("<|im_end|>")]  # the tokenizer's EOS alone


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_layout_survives_saving_and_loading(layout, tmp_path):
    """The fixture as files, loaded as a user's Qwen2.5 folder would be: the same stop tokens."""
    model, tokenizer = qwen25(layout)
    folder = save_folder(model, tokenizer, tmp_path / layout)
    saved = json.loads((folder / "generation_config.json").read_text())
    assert saved["do_sample"] is LAYOUTS[layout]["generation"]["do_sample"]
    assert json.loads((folder / "tokenizer_config.json").read_text())["eos_token"] == LAYOUTS[layout]["eos"]
    loaded, loaded_tokenizer = load_model(str(folder), CPU)
    assert stop_token_ids(loaded, loaded_tokenizer) == stop_token_ids(model, tokenizer)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mask_text_and_truncation_end_at_the_first_stop_id_by_position(layout):
    """Rows that end at different steps, padded with <|endoftext|>, itself a stop id, and text after a stop
    token (as a path that stops at one id only leaves it): each row's mask, text and truncation follow its
    first stop token, found by position."""
    model, tokenizer = qwen25(layout)
    im_end, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    a, b, c = tokenizer.encode("abc")
    completions = torch.tensor([[a, b, im_end, pad, pad], [a, im_end, b, c, pad], [pad, pad, pad, pad, pad],
                                [a, b, c, a, im_end], [a, b, c, a, b]])  # [N, C]
    rollout = sample(model, tokenizer, ["q"], 5, 5, sample_completions=lambda *args: completions)
    assert rollout.completion_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1] * 5,
                                                [1] * 5]
    assert rollout.texts == ["ab", "a", "", "abca", "abcab"]
    assert rollout.truncated.tolist() == [False, False, False, False, True]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_text_after_the_first_stop_token_never_reaches_the_reward(layout, path):
    """The invented turn after <|im_end|> answers 3: the reward, in training and in evaluation, reads 2."""
    model, tokenizer = qwen25(layout)
    tokens = script(tokenizer, "<|im_end|>", "<|endoftext|>")
    args = train.Args(model="tiny-qwen2", group_size=2, max_new_tokens=40, fast=path == "decode")
    run = types.SimpleNamespace(tokenizer=tokenizer, reward_fn=load_reward(), costs=Counter(), stop_ids=None,
                                rows_at_once=0)
    problems = [Problem("What is 1 + 1?", "2", ""), Problem("What is 1 + 2?", "3", "")]
    with scripted(model, tokens):
        _, rewards = train.sample_and_score(args, run, model, problems)  # [b, G]
    assert rewards.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    with scripted(model, tokens):
        result = evaluation.evaluate(model, tokenizer, problems, max_new_tokens=40,
                                     sample_completions=PATHS[path])
    assert [r["completion"] for r in result["records"]] == ["So \\boxed{2}"] * 2
    assert [r["correct"] for r in result["records"]] == [True, False]


# ---------------------------------------------------------------------------- greedy is greedy


def test_greedy_is_greedy_under_qwens_generation_config():
    """Qwen2.5-Instruct's generation config says do_sample true, temperature 0.7, top_k 20: temperature 0
    still gives the argmax path, the same for every seed and equal to decode's."""
    model, tokenizer = qwen25("instruct")
    questions = ["What is 17 * 4?", "hi", "2+3?", "a"]
    texts = []
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        texts.append(sample(model, tokenizer, questions, 1, 64, temperature=0).texts)
    assert texts[0] == texts[1] == texts[2] == sample(model, tokenizer, questions, 1, 64, temperature=0,
                                                      sample_completions=decode).texts
    enc = tokenizer(format_prompts(tokenizer, questions), return_tensors="pt", padding=True)
    sampled = set()
    for seed in (0, 1, 2):  # what the generation config does left to itself: it samples
        torch.manual_seed(seed)
        sampled.add(tuple(model.generate(**enc, max_new_tokens=24)[0].tolist()))
    assert len(sampled) > 1


def test_greedy_ignores_qwens_repetition_penalty():
    """Two near-tied tokens, "7" just above "8": the argmax repeats "7"; Qwen's repetition_penalty 1.05, left
    on, would push the repeated "7" below "8"."""
    model, tokenizer = qwen25("instruct")
    seven, eight = tokenizer.encode("78")
    bias = torch.zeros(model.lm_head.out_features)
    bias[seven], bias[eight] = 100.0, 98.0  # apart by more than the random model adds
    model.lm_head.bias = torch.nn.Parameter(bias, requires_grad=False)
    for path in (sample_with_generate, decode):
        assert sample(model, tokenizer, ["hi"], 1, 6, temperature=0, sample_completions=path).texts == ["777777"]


# ---------------------------------------------------------------------------- float32 buffers in bf16 copies


def assert_bf16_with_float32_buffers(net) -> None:
    assert {p.dtype for p in net.parameters()} == {torch.bfloat16}
    buffers = dict(net.named_buffers())
    assert "model.rotary_emb.inv_freq" in buffers
    assert {name: b.dtype for name, b in buffers.items()} == {name: torch.float32 for name in buffers}


def test_the_bf16_working_copy_and_reference_keep_float32_buffers(tmp_path):
    model, _ = load_model("tiny-qwen2", CPU)
    assert_bf16_with_float32_buffers(working_copy(model, "bf16"))
    assert {b.dtype for b in model.buffers()} == {torch.float32}  # the master is untouched
    args = train.Args(model="tiny-qwen2", algo="aapo", precision="bf16")
    run = run_module.start_run(args, tmp_path, CPU, True, train.algo_state(args), with_reference=True)
    assert_bf16_with_float32_buffers(run.policy)
    with run.reference() as reference:
        assert_bf16_with_float32_buffers(reference)


def test_bf16_copy_logprobs_at_long_positions_equal_a_bf16_load(tmp_path):
    """Positions 512-1023 with Qwen2.5's rope_theta: the working copy gives the log-probs of the same weights
    loaded with from_pretrained(dtype=bf16), bit for bit. (A bf16 inv_freq shifts the rotary phase by up to
    0.94 rad at position 1,000 for Qwen2.5's 64-dim heads.)"""
    model, tokenizer = tiny_qwen2()
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": 1e6}
    model = type(model)(model.config).eval()  # the rotary buffer of that theta
    folder = save_folder(model, tokenizer, tmp_path / "tiny")
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    assert loaded.config.rope_parameters["rope_theta"] == 1e6
    copy = working_copy(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), "bf16")
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 1024))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = completion_logprobs(loaded, ids, mask, 512)  # [2, 512]
        assert completion_logprobs(copy, ids, mask, 512).equal(expected)
        all_cast = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(torch.bfloat16)
        assert not completion_logprobs(all_cast.eval(), ids, mask, 512).equal(expected)  # inv_freq in bf16


# ---------------------------------------------------------------------------- prompt formats


def test_raw_prompts_are_plain_text_with_qwen_math_instruction():
    model, tokenizer = qwen25("math-base")
    assert format_prompts(tokenizer, ["What is 2 + 3?"], "raw") == [
        "What is 2 + 3?\nPlease reason step by step, and put your final answer within \\boxed{}.\n"]
    rollout = sample(model, tokenizer, ["What is 2 + 3?"], 1, 2, 0.0, prompt_format="raw")
    prompt = tokenizer.decode(rollout.input_ids[0, : -rollout.completion_len])
    assert prompt == format_prompts(tokenizer, ["What is 2 + 3?"], "raw")[0]  # no chat markup, nothing added


def test_a_jsonl_question_gets_one_instruction_in_either_format(tmp_path):
    """The data holds the question; the prompt format gives the instruction, once: chat the dataset's
    (\\boxed{} asked for in the user turn), raw Qwen2.5-Math's in its place."""
    (tmp_path / "one.jsonl").write_text(json.dumps({"problem": "What is 2 + 3?", "answer": "5"}) + "\n")
    problem, = load_problems(str(tmp_path / "one.jsonl"), "all")
    _, tokenizer = qwen25("instruct")
    chat, = format_prompts(tokenizer, [problem.question], "chat", "", [problem.instruction])
    assert chat == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                    "<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?\nPut the final answer in \\boxed{}."
                    "<|im_end|>\n<|im_start|>assistant\n")
    raw, = format_prompts(tokenizer, [problem.question], "raw", "", [problem.instruction])
    assert raw == "What is 2 + 3?\nPlease reason step by step, and put your final answer within \\boxed{}.\n"


def test_system_message_replaces_the_templates_default():
    _, tokenizer = qwen25("instruct")
    default, = format_prompts(tokenizer, ["hi"])
    assert default.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    custom, = format_prompts(tokenizer, ["hi"], system="Answer with a number.")
    assert custom == ("<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                      "<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="--system needs --prompt-format chat"):
        format_prompts(tokenizer, ["hi"], "raw", system="Answer with a number.")


def test_training_and_evaluation_sample_in_the_chosen_format(monkeypatch):
    """--prompt-format and --system reach every prompt that train.py samples and evaluates."""
    seen = []
    real = model_module.format_prompts
    monkeypatch.setattr(model_module, "format_prompts", lambda *a: seen.append(a[2:4]) or real(*a))
    model, tokenizer = qwen25("instruct")
    for prompt_format, system in (("raw", ""), ("chat", "Be brief.")):
        args = train.Args(model="tiny-qwen2", group_size=2, max_new_tokens=2, prompt_format=prompt_format,
                          system=system)
        run = types.SimpleNamespace(policy=model, tokenizer=tokenizer, reward_fn=load_reward(), stop_ids=None,
                                    costs=Counter(), eval_problems=[Problem("1 + 1?", "2", "")], rows_at_once=0)
        train.sample_and_score(args, run, model, run.eval_problems)
        monkeypatch.setattr(run_module, "log_eval", lambda *a: 0.0)
        run_module.run_eval(args, run, None, 0)
        assert seen[-2:] == [(prompt_format, system)] * 2


def without_chat_template(tmp_path):
    model, tokenizer = tiny_qwen2()
    tokenizer.chat_template = None
    return str(save_folder(model, tokenizer, tmp_path / "base"))


def test_a_tokenizer_without_chat_template_is_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch):
    base = without_chat_template(tmp_path)
    monkeypatch.setattr(run_module, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    monkeypatch.setattr(evaluation, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit):
        train.main(["--model", base, "--steps", "1", "--out", str(tmp_path / "run")])
    assert ("the model's tokenizer has no chat template (a base model?): use --prompt-format raw"
            in capsys.readouterr().err.strip().splitlines()[-1])
    assert not (tmp_path / "run").exists()
    with pytest.raises(SystemExit, match="^error: the model's tokenizer has no chat template .* raw$"):
        evaluation.main(["--model", base, "--dataset", "arith-add1", "--limit", "1"])


def test_a_base_model_trains_and_evaluates_with_raw_prompts(tmp_path):
    base = without_chat_template(tmp_path)
    summary = evaluation.main(["--model", base, "--dataset", "arith-add1", "--limit", "2",
                               "--max-new-tokens", "4", "--prompt-format", "raw"])
    assert summary[base]["problems"] == 2
    train.main(["--model", base, "--prompt-format", "raw", "--max-new-tokens", "4", "--group-size", "2",
                "--eval-size", "2", "--steps", "1", "--out", str(tmp_path / "run")])
    assert json.loads((tmp_path / "run" / "grpo" / "config.json").read_text())["prompt_format"] == "raw"
