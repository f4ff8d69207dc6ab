"""Device discipline without a GPU: the stand-in's doors and CUDA's rules on which tensors may meet
(tests/cuda_stand_in.py), enforced on CPU tensors around one train_step of each method, with its defaults and
with every flag that makes other tensors meet; the choice of device, precision and paths (--device,
--precision, --fast)."""

import copy
import functools
import json
import os
import mmap
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import eval as eval_module
import model
import train
from benchmarks.gpu_bench import PARITY, SIZES  # PARITY: a coin flip per completion, groups split
from data.tasks import Problem
from fast import packing
from fast.decoding import decode
from infra import hardware, lora, memory, model_files
from infra.memory import estimate_memory
from infra.written import owned
from loop import processes
from loop import run as run_module
from cuda_stand_in import CONTEXT, DEVICE, HOST, SEGMENT, CudaDeviceRules

ROOT = Path(__file__).resolve().parent.parent

def test_the_rules_raise_where_cuda_raises():
    host = torch.arange(4)
    with CudaDeviceRules():
        device = torch.arange(4, device=DEVICE)  # the run's device: CUDA on a GPU
        assert device[host].tolist() == [0, 1, 2, 3]  # a device tensor indexed by host indices: allowed
        assert (device + torch.tensor(1)).tolist() == [1, 2, 3, 4]  # a 0-dim host tensor is a scalar
        assert host[device.cpu()].tolist() == [0, 1, 2, 3]
        with pytest.raises(RuntimeError, match="indices should be"):
            host[device]
        with pytest.raises(RuntimeError, match="same device"):
            host + device
        with pytest.raises(RuntimeError, match="indices should be"):
            host[device] = 0
        with pytest.raises(RuntimeError, match="written with device values"):
            host[host < 2] = device[:2]
        with pytest.raises(RuntimeError, match="written with device values"):
            host[0] = device[0]
        with pytest.raises(TypeError, match="to numpy"):
            device.numpy()
        assert device.cpu().numpy().tolist() == host.numpy().tolist() == [0, 1, 2, 3]
        device[host[:2]] = host[:2]  # a device tensor written with host values: a copy to the device


def test_the_rules_know_an_explicit_cpu_generators_modules_gradients_and_cuda_by_name():
    with CudaDeviceRules():
        device = torch.ones(4, device=torch.device("cuda", 0))  # CUDA named: the stand-in, on the CPU
        assert device.device == DEVICE and (device + torch.ones(4, device=device.device)).sum().item() == 8
        for host in (torch.ones(4, device="cpu"), torch.ones(4, device=torch.device("cpu")),
                     device.to(torch.device("cpu")), device.to("cpu"), torch.ones_like(device, device=HOST)):
            assert host.device == HOST
            with pytest.raises(RuntimeError, match="same device"):
                host * device
        host_generator, device_generator = torch.Generator().manual_seed(0), torch.Generator(device=DEVICE)
        for draw in (lambda: torch.rand(4, device=DEVICE, generator=host_generator),
                     lambda: torch.rand(4, device=DEVICE, generator=torch.default_generator),
                     lambda: device.clone().uniform_(generator=host_generator),
                     lambda: torch.multinomial(device, 1, generator=host_generator)):
            with pytest.raises(RuntimeError, match="Expected a 'cuda' device type for generator"):
                draw()
        with pytest.raises(RuntimeError, match="Expected a 'cpu' device type for generator but found 'cuda'"):
            torch.rand(4, generator=device_generator)
        assert torch.rand(4, device=DEVICE, generator=device_generator).device == DEVICE
        layer = torch.nn.Linear(4, 1)  # made on the host
        with pytest.raises(RuntimeError, match="same device"):
            layer(device)
        layer.to(DEVICE)
        copied = copy.deepcopy(layer)  # bf16's working copy is one
        assert copied.weight.device == copied.bias.device == DEVICE == layer(device).device
        with pytest.raises(RuntimeError, match="assigned grad has data of a different device"):
            copied.weight.grad = torch.zeros(1, 4)
        copied.weight.grad = torch.zeros_like(copied.weight)
        assert layer.cpu().weight.device == HOST and copied.weight.grad.device == DEVICE



@pytest.mark.parametrize("optimizer", [dict(fused=True), dict(foreach=True), dict(foreach=False)])
def test_the_stand_in_answers_every_door_torch_asks_as_one_device(optimizer):
    """torch.cuda, torch.accelerator, streams, events and torch.backends.cuda name one device, cuda:1 of 2, on
    a CPU wheel as on a CUDA wheel with no driver (where an unanswered door raised "Found no NVIDIA driver":
    AdamW's step asks torch.accelerator for the stream to check for a graph capture); CUDA's runtime is never
    started; AdamW steps a device parameter on each of its kernels; the doors close with the block."""
    before = torch.accelerator.current_accelerator(), torch.cuda.is_available()
    with CudaDeviceRules(index=1, count=2) as rules:
        assert torch.cuda.is_available() and torch.accelerator.is_available()
        assert torch.backends.cuda.is_built()
        assert torch.accelerator.current_accelerator(check_available=True) == torch.device("cuda")
        assert torch.accelerator.device_count() == torch.cuda.device_count() == 2
        assert torch.accelerator.current_device_index() == torch.cuda.current_device() == 1
        stream = torch.accelerator.current_stream()
        assert stream is torch.cuda.current_stream() is torch.cuda.default_stream()
        assert not stream.is_capturing() and not torch.cuda.is_current_stream_capturing()
        assert stream.device == torch.device("cuda", 1) and stream.query()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            side.wait_stream(stream)
            assert side.device == torch.device("cuda", 1) and not side.is_capturing()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(), end.record()
        assert end.query() and start.elapsed_time(end) >= 0
        for wait in (torch.accelerator.synchronize, stream.synchronize, end.synchronize):
            device = torch.arange(3.0, device="cuda")
            host = device.to("cpu", non_blocking=True)  # lands at the next synchronisation
            wait()
            assert host.tolist() == [0.0, 1.0, 2.0]
        torch.accelerator.set_device_index(0)
        assert torch.cuda.current_device() == 0 and torch.ones(1, device="cuda").device == DEVICE
        with pytest.raises(RuntimeError, match="does not answer reached CUDA's runtime"):
            torch.cuda._lazy_init()
        weight = torch.nn.Parameter(torch.ones(4, device=DEVICE))
        step = torch.optim.AdamW([weight], lr=0.1, weight_decay=0.0, **optimizer)
        (weight * torch.arange(4.0, device=DEVICE)).sum().backward()
        step.step()
        assert rules.on_device(weight) and weight.tolist() == pytest.approx([1.0, 0.9, 0.9, 0.9])
    assert (torch.accelerator.current_accelerator(), torch.cuda.is_available()) == before

TINY = ["--model", "tiny-qwen2", "--max-new-tokens", "6", "--group-size", "4", "--micro-batch", "3",
        "--eval-size", "4", "--precision", "bf16", "--lr", "1e-2"]
# Every non-default flag that changes which tensors meet, at once: the reference's log-probs and the KL,
# PPO's old log-probs, the nucleus (decode's buffer, generate's warper), recomputation in backward.
OPENED = ["--beta", "0.04", "--updates-per-batch", "2", "--top-p", "0.9", "--grad-checkpointing"]
LORA = OPENED + ["--lora-rank", "2", "--lora-alpha", "4"]  # the adapters, and the reference with them off
# train.Args fields the step test drives beyond their default, each with the path it opens; every other field
# is driven off its default by test_device_program.py's programs, train.py from main under the rules
# (`test_every_flag_runs_off_its_default`). Of eval.py's flags, --samples 2 (G completions per prompt at a
# temperature) and --fast/--no-fast are driven; the others pick models, texts, files and shapes.
DRIVEN = {
    "algo": "each method: AVSPO's and AAPO's advantages, AAPO's reference sampling, DAPO's resampling",
    "beta": "> 0 with each method: the frozen reference's log-probs beside the policy's, every row trained",
    "updates_per_batch": "2: PPO's old log-probs, kept from before the first update",
    "top_p": "0.9: the nucleus, decoding.decode's buffer (fast) and generate's top-p warper (plain)",
    "grad_checkpointing": "each layer recomputed in backward",
    "precision": "bf16 (a working copy beside float32 master weights) and fp32 (one network)",
    "fast": "--no-fast, CUDA's paths, and --fast, which gpu_bench.py forces there to time it",
    "reward": "a reward that splits groups (every backward runs) and the verifier (DAPO's collapsed groups)",
    "lora_rank": "2: peft's adapters (float32) on the frozen bf16 weights, the reference with them off, "
                 "the gradients of the adapters alone summed over processes",
    "lora_alpha": "with --lora-rank: a Python float scaling the adapters' output on the device",
}


def favour_stops(nets, stop_ids: list[int], bias: float = 4.0) -> None:
    """An output-layer bias on the stop tokens, so that about a sixth of tiny-qwen2's sampled tokens stop
    (its random weights never do) and the stop branches run; greedy stops at once. A bias, as
    tests/test_fast_paths.py's favour_eos: decoding.decode_step runs the output layer's weights itself."""
    for net in nets:
        weight = net.lm_head.weight
        logit_bias = torch.zeros(net.lm_head.out_features, dtype=weight.dtype, device=weight.device)
        logit_bias[stop_ids] = bias
        net.lm_head.bias = torch.nn.Parameter(logit_bias, requires_grad=False)


def nccl_processes(monkeypatch, world: int = 2) -> None:
    """loop/processes.py as under torchrun with nccl, in this one process: `world` processes that sample
    alike, the GPU's index from torch.cuda, and collectives that raise as nccl does for a tensor off the
    device."""
    def on_device(*tensors):
        if not all(CudaDeviceRules.on_device(t) for t in tensors):
            raise RuntimeError("Tensors must be CUDA and dense (nccl; CudaDeviceRules)")

    def all_gather(parts, tensor):
        on_device(tensor, *parts)
        for part in parts:
            part.copy_(tensor)

    def all_reduce(tensor):
        on_device(tensor)
        tensor.mul_(world)

    monkeypatch.setattr(processes, "dist", types.SimpleNamespace(
        is_initialized=lambda: True, get_backend=lambda: "nccl", get_world_size=lambda: world,
        all_gather=all_gather, all_reduce=all_reduce))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.mark.parametrize("algo, flags, fast, torchrun", [
    ("grpo", [], False, False), ("aapo", ["--precision", "fp32"], False, False), ("dapo", [], False, False),
    ("grpo", OPENED, False, False), ("avspo", OPENED, False, False), ("aapo", OPENED, False, True),
    ("dapo", OPENED, False, True), ("grpo", OPENED, True, False), ("dapo", OPENED, True, True),
    ("aapo", LORA, False, True), ("aapo", LORA, True, False)],
    ids=lambda v: {id(OPENED): "opened", id(LORA): "lora"}.get(id(v), "fp32" if v == ["--precision", "fp32"]
                                                                  else None))
def test_a_train_step_keeps_cudas_device_rules(tmp_path, monkeypatch, capsys, algo, flags, fast, torchrun):
    """One step of each method and an evaluation, as a CUDA run would place their tensors (the models, the
    rollout and advantages on the device, rewards and bookkeeping on the host), from loading the models on:
    the plain paths, which CUDA runs, and the fast ones (gpu_bench.py forces them there to time them); each
    method with its defaults, then with every flag in `OPENED`, eval.py with --samples 2, and torchrun's
    collectives under nccl (`nccl_processes`). Completions reach stop tokens (`favour_stops`); rewards split
    the groups, so every method's backward runs, but DAPO's at --beta 0, which keeps the verifier's
    collapsed groups to resample them; AAPO under LoRA (`LORA`), its reference the policy with the adapters
    off. The first CUDA update crashed on `rows[...]` (issue 43)."""
    args = train.parse_args(TINY + ["--algo", algo, "--out", str(tmp_path), *flags, "--fast" if fast else
                                    "--no-fast", "--reward", "verifier" if algo == "dapo" else PARITY])
    if torchrun:
        nccl_processes(monkeypatch)
    if fast:  # the fast paths on the stand-in's CUDA too, as gpu_bench.py forces them there to time them
        monkeypatch.setattr(run_module, "FAST_ON", ("cuda",))
        monkeypatch.setattr(eval_module, "FAST_ON", ("cuda",))
    monkeypatch.setattr(eval_module, "pick_device", lambda name: DEVICE)
    with owned(tmp_path / "run", "run") as files, CudaDeviceRules() as rules:
        run = run_module.start_run(args, tmp_path, DEVICE, True, train.algo_state(args),
                                   with_reference=algo == "aapo" or args.beta > 0)
        named = {"master": run.master, "policy": run.policy}
        if run.reference is not None:
            with run.reference() as network:  # under LoRA, the policy itself
                named["reference"] = network
            assert network.dtype == run.policy.dtype  # a float32 reference: 2x the memory counted for it
        on_host = [name for name, net in named.items()
                   if not all(rules.on_device(t) for t in [*net.parameters(), *net.buffers()])]
        assert not on_host, f"on the host, not the run's device: {on_host}"
        favour_stops(named.values(), model.stop_token_ids(run.policy, run.tokenizer))
        mine = slice(0, args.prompts_per_step // 2 if torchrun else args.prompts_per_step)
        record, _ = train.train_step(args, run, 1, 0, mine, DEVICE)
        assert 0 <= run_module.run_eval(args, run, files, 1) <= 1
        if flags is OPENED and algo == "grpo":  # eval.py's --samples: once on each path
            eval_module.main(["--model", "tiny-qwen2", "--samples", "2", "--limit", "2", "--max-new-tokens",
                              "6", "--precision", "bf16", "--fast" if fast else "--no-fast"])
    assert record["skipped"] == 0 and record["truncated_frac"] < 1  # some rows stopped
    # the peak as a GPU's: the allocator's reservation, in whole segments, and the CUDA context beside it
    # (max_memory_allocated counts neither: a few MiB here)
    assert record["peak_memory_bytes"] > CONTEXT and (record["peak_memory_bytes"] - CONTEXT) % SEGMENT == 0
    bf16, lora = args.precision == "bf16", args.lora_rank > 0
    assert (run.policy.dtype == torch.bfloat16) == bf16 == (run.policy is not run.master or lora)
    if lora:  # the frozen weights in bf16, in place; the adapters float32, with gradients on the device
        assert run.policy is run.master and {p.dtype for p in run.policy.parameters() if not p.requires_grad
                                             } == {torch.bfloat16}
        trained = [p for p in run.master.parameters() if p.requires_grad]
        assert trained and all(p.dtype == torch.float32 and rules.on_device(p) for p in trained)
        assert {id(p) for p in run.optimizer.state} == {id(p) for p in trained}
    if algo == "dapo":  # tiny-qwen2's groups all collapse: replace_groups ran under the rules
        assert record["resampled_groups"] > 0
    if algo != "dapo" or args.beta > 0:  # a backward pass, and bf16's gradient accumulation, under the rules
        assert record["rows_trained"] > 0
    assert "mean@2" in capsys.readouterr().out or flags is not OPENED or algo != "grpo"


# ------------------------------------------------------------------------------ where the run is, its paths


def test_cuda_where_unusable_is_a_value_error_saying_why(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(hardware, "cuda_settings", lambda: None)  # test_cuda_settings has them
    assert hardware.pick_device("auto") == hardware.pick_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="--device cuda: this torch .* is a CPU-only build"):
        hardware.pick_device("cuda")
    assert "no CUDA: this torch" in hardware.describe_device(torch.device("cpu"))  # auto's fallback, said
    monkeypatch.setattr(torch.version, "cuda", "12.4")  # a CUDA wheel without a usable driver or device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="sees no CUDA device .* older than CUDA 12.4"):
        hardware.pick_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert hardware.pick_device("auto") == hardware.pick_device("cuda") == torch.device("cuda")


@pytest.mark.parametrize("users", [None, "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_cuda_settings_expandable_segments_unless_the_user_set_the_allocator_and_no_cudnn_attention(
        monkeypatch, users):
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    if users:
        monkeypatch.setenv(users, "max_split_size_mb:128")
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        assert hardware.pick_device("cuda") == torch.device("cuda")
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
    expected = "max_split_size_mb:128" if users == "PYTORCH_CUDA_ALLOC_CONF" else (
        None if users else "expandable_segments:True")
    assert os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == expected


def test_a_gpu_is_named_with_its_memory(monkeypatch):
    card = types.SimpleNamespace(name="NVIDIA H200", total_memory=140 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: card)
    assert hardware.describe_device(torch.device("cuda", 0)) == "cuda:0 (NVIDIA H200, 140 GiB)"


@pytest.mark.parametrize("script", ["train.py", "eval.py"])
def test_device_cuda_where_unusable_stops_with_one_line_before_any_model(script, tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # unusable here, and on a GPU machine too
    proc = subprocess.run([sys.executable, ROOT / script, "--device", "cuda", "--model", "tiny-qwen2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)  # its --out
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "error: --device cuda: " in last and ("CPU-only build" in last or "sees no CUDA device" in last)


@pytest.mark.parametrize("native, expected", [(True, "bf16"), (False, "fp32")])
def test_auto_precision_on_cuda_is_bf16_only_where_the_gpu_has_it(monkeypatch, native, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native
                        or including_emulation)  # a T4 or V100 emulates bf16
    assert hardware.resolve_precision("auto", torch.device("cuda")) == expected
    assert hardware.resolve_precision("bf16", torch.device("cuda")) == "bf16"


def test_fast_means_the_fast_paths_on_the_cpu_and_the_plain_ones_on_cuda():
    """No CUDA call is made: the choice reads the device's type."""
    assert run_module.fast_or_plain(True, torch.device("cpu")) == (decode, packing.completion_logprobs)
    plain = (model.sample_with_generate, model.completion_logprobs)
    assert run_module.fast_or_plain(True, torch.device("cuda")) == plain
    assert run_module.fast_or_plain(False, torch.device("cpu")) == plain
    assert run_module.fast_or_plain(True, torch.device("cuda", 1)) == plain


def test_the_first_line_names_device_precision_dtypes_and_memory(tmp_path):
    args = train.parse_args(TINY[:-2] + ["--precision", "bf16", "--beta", "0.1", "--out", str(tmp_path)])
    master, tokenizer = model.load_model("tiny-qwen2", torch.device("cpu"))
    line = run_module.where_it_runs(args, master, hardware.working_copy(master, "bf16"), master, tokenizer,
                                [Problem("What is 2 + 3?", "5")])
    assert line.startswith("cpu (") and "; bf16 (float32 master weights, a bfloat16 working copy); " in line
    assert "memory ~" in line and "working copy" in line and "reference" in line


def test_the_first_line_counts_the_process_runtime_measured_before_the_model_loads(tmp_path, monkeypatch,
                                                                                   capsys):
    """On the CPU the estimate is the process's resident memory: what Python, torch and transformers held
    before the model loaded (the runtime) beside the tensors; train.py's and eval.py's first lines count it,
    measured where the run starts (`hardware.resident_bytes`: RSS, which grows with the pages a tensor
    fills)."""
    pages = mmap.mmap(-1, 2**28)  # 256 MiB of new pages: a tensor may reuse pages freed by an earlier test
    before = hardware.resident_bytes()
    for page in range(0, len(pages), mmap.PAGESIZE):
        pages[page] = 1  # written, so resident
    assert hardware.resident_bytes() - before > 200 * 2**20
    pages.close()
    monkeypatch.setattr(run_module, "resident_bytes", lambda: 3 * 2**30)
    monkeypatch.setattr(eval_module, "resident_bytes", lambda: 5 * 2**30)
    args = train.parse_args(TINY + ["--out", str(tmp_path)])
    run_module.start_run(args, tmp_path, torch.device("cpu"), True, train.algo_state(args),
                         with_reference=False)
    eval_module.main(["--model", "tiny-qwen2", "--limit", "1", "--max-new-tokens", "2"])
    train_line, eval_line = [line for line in capsys.readouterr().out.splitlines() if "memory ~" in line]
    assert "memory ~3." in train_line and " + runtime (Python, torch) 3.0 GiB + " in train_line
    assert "memory ~5." in eval_line and " + runtime (Python, torch) 5.0 GiB + " in eval_line


def test_an_estimate_past_90_percent_of_the_device_says_what_to_change(tmp_path, monkeypatch, capsys):
    """The estimate at the data's longest prompt against the device's memory, before any step: past 90%, one
    line naming the flags that lower the larger phase (on a 24 GB card, one long prompt's prefill of every
    row ran it out of memory, and --resume met the same prompt again)."""
    args = train.parse_args(TINY + ["--out", str(tmp_path)])
    master, tokenizer = model.load_model("tiny-qwen2", torch.device("cpu"))
    for device_bytes, warned in [(2**40, False), (2**20, True)]:  # a terabyte; a megabyte
        monkeypatch.setattr(run_module, "device_memory_bytes", lambda device: device_bytes)
        run_module.where_it_runs(args, master, master, None, tokenizer, [Problem("What is 2 + 3?", "5")])
        printed = capsys.readouterr().out
        assert ("is past 90% of the device's 1 MiB: a step may run out of memory; lower --max-prompt-tokens"
                in printed) == warned, printed


def test_max_prompt_tokens_skips_and_counts_longer_prompts_never_cuts_them(tmp_path, capsys):
    """--max-prompt-tokens: a problem whose templated prompt is longer is left out whole, training and
    held-out alike, and counted in a line; the others are kept as they are, and the first line's estimate
    is at the longest kept. tiny-qwen2's tokenizer: a token a byte."""
    data = tmp_path / "data.jsonl"
    questions = [f"What is {i} + 1?" if i % 7 else "Add these: " + "7 " * 300 for i in range(40)]
    data.write_text("".join(json.dumps({"problem": q, "answer": "1"}) + "\n" for q in questions))
    args = train.parse_args(TINY + ["--dataset", str(data), "--max-prompt-tokens", "200", "--out",
                                    str(tmp_path / "run")])
    run = run_module.start_run(args, tmp_path / "run", torch.device("cpu"), True, train.algo_state(args),
                               with_reference=False)
    kept = run.train_problems + run.eval_problems
    skipped = re.search(r"--max-prompt-tokens 200: skipped (\d+) of (\d+) training problems and (\d+) of "
                        r"(\d+) held-out ones", capsys.readouterr().out)
    assert skipped and int(skipped[1]) + int(skipped[3]) == 6 and all("7 7" not in p.question for p in kept)
    assert int(skipped[2]) - int(skipped[1]) == len(run.train_problems)


def test_a_step_whose_sampling_would_not_fit_samples_fewer_rows_at_once(tmp_path, monkeypatch, capsys):
    """Where the estimate at the longest prompt, every row sampled at once, is past 90% of the device and
    sampling is the larger phase, a step samples fewer whole groups at once (HF generate prefills every row
    it is given), the first line's estimate and its words count that many, and every sampling call of the
    run asks for them; where it fits, all at once, as before."""
    data = tmp_path / "data.jsonl"
    questions = [f"What is {i} + 1? " + "Think it over. " * 40 for i in range(30)]
    data.write_text("".join(json.dumps({"problem": q, "answer": "1"}) + "\n" for q in questions))
    args = train.parse_args(TINY + ["--dataset", str(data), "--prompts-per-step", "4", "--micro-batch", "1",
                                    "--out", str(tmp_path / "run")])
    run = run_module.start_run(args, tmp_path / "run", torch.device("cpu"), True, train.algo_state(args),
                               with_reference=False)
    assert run.rows_at_once == 0 and "rows sampled at once" not in capsys.readouterr().out  # all at once
    prompt_len = memory.longest_prompt(run.master.config, run.tokenizer, run.train_problems)
    totals = {rows: run_module.run_estimate(args, run.master, run.policy, None, prompt_len, 0, rows)
              for rows in (8, 12, 16)}
    assert totals[16]["sampling"] > totals[16]["activations"] + totals[16]["logits"]
    device_bytes = (totals[8]["total"] + totals[12]["total"]) / 2 / memory.FITS  # 2 groups fit, 3 do not
    monkeypatch.setattr(run_module, "device_memory_bytes", lambda device: device_bytes)
    assert run_module.rows_at_once(args, run.master, run.policy, None, prompt_len, 0) == 8
    line = run_module.where_it_runs(args, run.master, run.policy, None, run.tokenizer, run.train_problems)
    assert line.endswith(f"sampling (prefill, KV cache) {memory.size(totals[8]['sampling'])} (8 of a step's "
                         "16 rows sampled at once)"), line
    calls, in_calls_of = [], run_module.in_calls_of
    monkeypatch.setattr(run_module, "in_calls_of", lambda n, fn: calls.append(n) or in_calls_of(n, fn))
    monkeypatch.setattr(run_module, "resident_bytes", lambda: 0)  # the runtime the totals above counted
    run = run_module.start_run(args, tmp_path / "run", torch.device("cpu"), True, train.algo_state(args),
                               with_reference=False)
    assert run.rows_at_once == 8  # the run keeps what it found, and samples that many at once
    run_module.sample_and_score(args, run, run.policy, run.train_problems[:4])
    assert calls == [8]


def test_sampling_in_calls_of_fewer_rows_keeps_every_group_in_place():
    """`run.in_calls_of`: a step's prompts in calls of whole groups, at most that many rows each, whose
    completions line up as one call's would (greedy: the same tokens, masks and texts)."""
    net, tokenizer = model.load_model("tiny-qwen2", torch.device("cpu"))
    questions, calls = ["2+3?", "What is 17 * 4?", "hi"], []

    def counted(net, ids, mask, group_size, *rest):
        calls.append(len(ids) * group_size)  # rows
        return model.sample_with_generate(net, ids, mask, group_size, *rest)

    whole, parts = (model.sample(net, tokenizer, questions, 4, 6, 0.0, sample_completions=fn)
                    for fn in (counted, run_module.in_calls_of(5, counted)))  # 5 rows: one group of 4 a call
    assert calls == [12, 4, 4, 4]
    for name in ("input_ids", "attention_mask", "completion_mask", "truncated"):
        assert torch.equal(getattr(whole, name), getattr(parts, name)), name
    assert whole.texts == parts.texts


def test_the_first_line_counts_aapos_reference_without_a_kl(tmp_path, capsys):
    """AAPO samples its reference's completions (r_ref) at --beta 0 too: its frozen copy is in memory, and
    the first line's estimate counts it (M7: one that asked --beta alone left it out)."""
    args = train.parse_args(TINY + ["--algo", "aapo", "--precision", "fp32", "--out", str(tmp_path)])
    run = run_module.start_run(args, tmp_path, torch.device("cpu"), True, train.algo_state(args),
                               with_reference=args.algo == "aapo" or args.beta > 0)  # as train.py asks
    line = next(line for line in capsys.readouterr().out.splitlines() if "memory ~" in line)
    own = sum(p.numel() for p in run.master.parameters())
    assert args.beta == 0 and f" + reference {memory.size(4 * own)} + " in line


def test_the_first_line_under_lora_counts_frozen_weights_and_adapters_and_no_copy(tmp_path, monkeypatch):
    """Under LoRA the policy is the master (its frozen weights cast in place) and the reference is the policy
    with its adapters off: the estimate gets the model's own weights apart from the adapters, and the line
    names them, with no working copy and no reference."""
    args = train.parse_args(TINY[:-2] + ["--precision", "bf16", "--beta", "0.1", "--lora-rank", "4",
                                         "--out", str(tmp_path)])
    master, tokenizer = model.load_model("tiny-qwen2", torch.device("cpu"))
    own = sum(p.numel() for p in master.parameters())
    lora.add_adapters(master, 4, 32, "tiny-qwen2", 0)
    policy = hardware.working_copy(master, "bf16")
    seen = {}

    def estimate(config, num_params, **kwargs):
        seen.update(num_params=num_params, **kwargs)
        return estimate_memory(config, num_params, **kwargs)

    monkeypatch.setattr(run_module, "estimate_memory", estimate)
    line = run_module.where_it_runs(args, master, policy, functools.partial(lora.adapters_off, policy),
                                    tokenizer, [Problem("What is 2 + 3?", "5")])
    adapters = memory.adapter_count(master.config, 4)
    assert policy is master and seen["num_params"] == own and seen["lora_params"] == adapters > 0
    assert seen["bf16"] and seen["reference"]
    assert "; bf16 (bfloat16 frozen weights, float32 LoRA adapters); " in line
    parts = f"frozen weights {memory.size(2 * own)} + adapters+AdamW+grads {memory.size(16 * adapters)}"
    assert parts in line
    assert "working copy" not in line and "reference" not in line and "weights+AdamW" not in line


# ------------------------------------------------------------------------------ infra/memory.py


# SmolLM2-135M's widths (its config.json; a Llama, taken here as a Qwen2 of the same widths: GQA 3 of 9)
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3)


def widths(size: str) -> dict:
    """A model's widths: Qwen2.5's (gpu_bench.SIZES: 0.5B, 1.5B, tiny) or SmolLM2's."""
    return SMOLLM2 if size == "smollm2" else SIZES[size]


def shapes(**overrides):
    return {"rows": 16, "prompt_len": 40, "completion_len": 60, "micro_batch": 4, "bf16": True,
            "reference": False, "checkpointing": False, **overrides}


def test_memory_static_terms_count_the_models_parameters():
    tiny, _ = model_files.tiny_qwen2()
    params = sum(p.numel() for p in tiny.parameters())
    terms = estimate_memory(tiny.config, params, **shapes(reference=True))
    assert (terms["weights"], terms["optimizer"], terms["gradients"]) == (4 * params, 8 * params, 4 * params)
    assert terms["working_copy"] == 4 * params and terms["reference"] == 2 * params
    fp32 = estimate_memory(tiny.config, params, **shapes(bf16=False, reference=True))
    assert fp32["working_copy"] == 0 and fp32["reference"] == 4 * params
    static = sum(terms[k] for k in ("weights", "optimizer", "gradients", "working_copy", "reference"))
    assert terms["total"] == static + max(terms["sampling"], terms["activations"] + terms["logits"])


@pytest.mark.parametrize("size, rank", [("tiny", 4), ("0.5B", 32), ("1.5B", 1), ("smollm2", 8)])
def test_memory_static_terms_under_lora_count_the_frozen_weights_once_and_the_adapters(size, rank):
    """peft's adapters on every linear layer but the output layer number `memory.adapter_count`; the model's
    own weights count once, in the working precision, and only the adapters have float32 weights, AdamW
    moments and gradients: no working copy, and the reference (the adapters off) costs nothing."""
    config = Qwen2Config(vocab_size=1000, tie_word_embeddings=True, **widths(size))
    with torch.device("meta"):  # the real widths, nothing allocated
        net = Qwen2ForCausalLM(config)
    own = sum(p.numel() for p in net.parameters())
    lora.add_adapters(net, rank, 32, size, 0)
    adapters = sum(p.numel() for p in net.parameters() if p.requires_grad)
    assert adapters == memory.adapter_count(config, rank) and adapters + own == sum(p.numel() for p in
                                                                                     net.parameters())
    for bf16, w in ((True, 2), (False, 4)):
        terms = estimate_memory(config, own, **shapes(bf16=bf16, reference=True), lora_params=adapters)
        assert (terms["frozen"], terms["weights"], terms["optimizer"], terms["gradients"]) == (
            w * own, 4 * adapters, 8 * adapters, 4 * adapters)
        assert terms["working_copy"] == terms["reference"] == 0
        static = sum(terms[k] for k in ("frozen", "weights", "optimizer", "gradients"))
        assert terms["total"] == static + max(terms["sampling"], terms["activations"] + terms["logits"])
    assert estimate_memory(config, own, **shapes())["frozen"] == 0  # full fine-tuning: no frozen weights


@pytest.mark.parametrize("key", ["rows", "prompt_len", "completion_len", "micro_batch"])
def test_memory_grows_with_the_runs_shapes_and_checkpointing_shrinks_it(key):
    config = model_files.tiny_qwen2()[0].config
    small, large = (estimate_memory(config, 10**6, **shapes(**{key: value}))
                    for value in (shapes()[key], 2 * shapes()[key]))
    assert large["total"] > small["total"] or key == "rows" and large["sampling"] > small["sampling"]
    checkpointed = estimate_memory(config, 10**6, **shapes(checkpointing=True))
    assert checkpointed["activations"] < small["activations"]


def saved_bytes(net, ids: torch.Tensor, mask: torch.Tensor, completion_len: int) -> int:
    """Bytes of the tensors autograd saves for backward in one forward of the plain log-probs (each storage
    once, the parameters left out)."""
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.completion_logprobs(net, ids, mask, completion_len)
    return sum(kept.values())


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("size, precision, rank", [  # rank: LoRA's
    ("0.5B", "bf16", 0), ("1.5B", "bf16", 0), ("0.5B", "fp32", 0), ("0.5B", "bf16", 32), ("1.5B", "bf16", 1),
    ("0.5B", "fp32", 32), ("smollm2", "bf16", 0), ("smollm2", "bf16", 8)])
def test_memory_activations_are_what_the_forward_keeps_for_backward(size, precision, rank, checkpointing):
    """Two layers at Qwen2.5's real widths, rows padded on the left and the right as in training: the bytes
    autograd saves (the logits' own among them) against infra/memory.py's activations and logits. Under
    checkpointing the forward keeps each layer's input only, and the estimate adds one layer's
    `layer_bytes`, recomputed in backward. `rank`: LoRA through peft, frozen weights in the working precision
    and float32 adapters (`lora_layer_bytes`)."""
    config = Qwen2Config(vocab_size=1000, tie_word_embeddings=True, **{**widths(size), "num_hidden_layers": 2})
    torch.manual_seed(0)
    net = Qwen2ForCausalLM(config)
    if rank:
        lora.add_adapters(net, rank, 32, size, 0)
    net = hardware.working_copy(net, precision).train()
    if checkpointing:
        model.checkpoint_activations(net)
    ids = torch.randint(0, 1000, (4, 101))
    mask = torch.ones_like(ids)
    mask[:2, :20] = mask[1:3, -15:] = 0  # left-padded prompts, completions that ended early
    kept = saved_bytes(net, ids, mask, 60)
    terms = estimate_memory(config, 0, **shapes(micro_batch=4, bf16=precision == "bf16",
                                                checkpointing=checkpointing),  # 4 rows of 100 positions
                            lora_params=memory.adapter_count(config, rank))
    w = 2 if precision == "bf16" else 4
    forward = terms["activations"] + 4 * 60 * 1000 * w  # and the logits
    if checkpointing:  # less the layer that backward recomputes
        layer = memory.lora_layer_bytes(config, w, rank) if rank else memory.layer_bytes(config, w)
        forward -= 4 * 100 * layer
    # 10% is the bar; without checkpointing the count is within 0.5%, so 3% shows a slip in any one term
    assert kept == pytest.approx(forward, rel=0.1 if checkpointing else 0.03)


def peak_bytes(fn) -> int:
    """The most bytes allocated on the CPU at once while fn runs, above what was there before (torch's memory
    profiler, which records every allocation and free)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        fn()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    totals = [sum(s) for s in sizes]
    return max(totals) - totals[0]  # the first: the tensors that existed before and fn used (weights, inputs)


# One narrow layer: the logits are nearly all of the memory, so a slip in their term shows at once
NARROW = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)


@pytest.mark.parametrize("size, precision, rank, chunk", [  # rank: LoRA's
    *[("narrow", precision, rank, chunk) for precision, rank in (("bf16", 0), ("fp32", 0), ("bf16", 4))
      for chunk in (64, 256)],
    ("smollm2", "bf16", 0, 256), ("smollm2", "bf16", 8, 256), ("1.5B", "bf16", 32, 256)])  # the recipe
def test_memory_logits_are_the_peak_of_the_log_probs_forward_and_backward(monkeypatch, size, precision, rank,
                                                                            chunk):
    """The logits term as measured: one layer at a model's widths and a 16,000-token vocabulary; the peak of
    the plain log-probs' forward and backward against activations + logits. Under LoRA (`rank`) the output
    layer is frozen but its input still gets a gradient: the same logits. The output layer is frozen in every
    case (its gradient is the static terms', not the update's), which on the CPU once cost one copy of it per
    row (`model.last_positions`): +67 MB at SmolLM2's width, nothing at 32."""
    monkeypatch.setattr(model, "LOGPROB_CHUNK", chunk)
    monkeypatch.setattr(memory, "LOGPROB_CHUNK", chunk)
    config = Qwen2Config(vocab_size=16_000, tie_word_embeddings=True,
                         **{**(NARROW if size == "narrow" else widths(size)), "num_hidden_layers": 1})
    torch.manual_seed(0)
    net = Qwen2ForCausalLM(config)
    if rank:
        lora.add_adapters(net, rank, 32, size, 0)
    net = hardware.working_copy(net, precision).train()
    net.model.embed_tokens.weight.requires_grad_(False)
    ids = torch.randint(0, 16_000, (8, 161))
    mask = torch.ones_like(ids)
    mask[:4, :30] = 0

    def update():
        model.completion_logprobs(net, ids, mask, 128, 0.7).sum().backward()

    update()  # once before: the first call allocates what later ones reuse
    net.zero_grad(set_to_none=True)
    terms = estimate_memory(config, 0, **shapes(micro_batch=8, prompt_len=32, completion_len=128,
                                                bf16=precision == "bf16"),
                            lora_params=memory.adapter_count(config, rank))
    assert peak_bytes(update) == pytest.approx(terms["activations"] + terms["logits"], rel=0.1)


def test_gpu_bench_can_force_the_fast_paths_on_cuda_to_time_them():
    from benchmarks.gpu_bench import fast_paths_on
    with fast_paths_on(torch.device("cuda")):
        assert train.fast_or_plain(True, torch.device("cuda")) == (decode, packing.completion_logprobs)
    assert train.fast_or_plain(True, torch.device("cuda")).sample_completions is model.sample_with_generate
