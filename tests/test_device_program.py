"""What a GPU run meets around its steps, on the CPU (issue 62): a checkpoint a GPU saved, the settings that
change float32 numbers, the wait of the other processes while the first evaluates and saves, sampling's memory
as HF generate prefills every row, the hub kernels transformers would fetch, and train.py itself, from main,
under CUDA's rules (`test_device.CudaDeviceRules`)."""

import json
import re
import signal
import subprocess
import zipfile
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import eval as eval_module
import hardware
import lora
import merge
import memory
import model_files
import processes
import train
from benchmarks.gpu_bench import PARITY, SIZES  # PARITY: a coin flip per completion, groups split, rows train
from model import load_model, sample_with_generate
from test_device import LORA, OPENED, CudaDeviceRules, peak_bytes
from test_device import TINY as STAND_IN
from test_faults import TINY

ROOT = Path(__file__).resolve().parent.parent


def as_saved_on_cuda(path: Path) -> None:
    """Rewrite a torch.save file so that every storage names cuda:0, as a GPU run's state.pt does: the pickle
    names each storage's device once ("cpu", memoised for the rest)."""
    with zipfile.ZipFile(path) as archive:
        files = {name: archive.read(name) for name in archive.namelist()}
    pickled = next(name for name in files if name.endswith("/data.pkl"))
    assert files[pickled].count(b"X\x03\x00\x00\x00cpu") == 1, "torch.save's format changed"
    files[pickled] = files[pickled].replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)


def steps_of(run: Path, algo: str = "grpo") -> list[dict]:
    """metrics.jsonl's records without their timings."""
    return [{k: v for k, v in json.loads(line).items() if not ("time_" in k or k.endswith("_per_s"))}
            for line in (run / algo / "metrics.jsonl").read_text().splitlines()]


def test_a_gpu_runs_checkpoint_resumes_on_a_machine_without_cuda_exactly(tmp_path, monkeypatch):
    """A state.pt saved as on a GPU (each storage names cuda:0, rewritten before the run records the file).
    Before, torch.load put each storage back on the device that saved it: here "state.pt is damaged ... start
    again with --overwrite", advice that deletes a good run; under torchrun, every process's optimizer state
    on GPU 0."""
    common = TINY + ["--eval-every", "0", "--save-every", "1", "--lr-decay", "0", "--reward", PARITY]
    train.main(common + ["--steps", "2", "--out", str(tmp_path / "straight")])
    save = torch.save

    def save_as_on_cuda(state: dict, path) -> None:
        save(state, path)
        as_saved_on_cuda(Path(path))

    monkeypatch.setattr(torch, "save", save_as_on_cuda)
    train.main(common + ["--steps", "1", "--out", str(tmp_path / "resumed")])
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="on a CUDA device"):  # what the file holds, loaded as it says
        torch.load(tmp_path / "resumed" / "grpo" / "checkpoint" / "state.pt", weights_only=True)
    train.main(common + ["--steps", "2", "--out", str(tmp_path / "resumed"), "--resume"])
    resumed, straight = steps_of(tmp_path / "resumed"), steps_of(tmp_path / "straight")
    assert len(resumed) == 2 and all(r["rows_trained"] > 0 for r in straight)  # AdamW's moments in use
    assert all(r == pytest.approx(s) for r, s in zip(resumed, straight))


# A setting of torch's backends: an assignment to a flag, a kernel switched, float32's matmul precision
SETTING = re.compile(r"torch\.backends\.[\w.]+\s*=(?!=)|\.enable_\w+_sdp\(|set_float32_matmul_precision|"
                     r"allow_(tf32|bf16_reduced|fp16_reduced)")


def test_cuda_settings_keep_float32_products_float32_and_are_made_in_one_place(monkeypatch):
    """Whatever turned TF32 or cuDNN's autotuning on before (an import, a user's code), a CUDA run's float32
    products are float32, as the CPU's definition; no other file of the program sets a backend flag."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "mine")  # the allocator's option, tested in test_device
    before = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32,
              torch.backends.cudnn.benchmark, torch.backends.cuda.cudnn_sdp_enabled())
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.benchmark = True
    try:
        hardware.cuda_settings()
        assert torch.get_float32_matmul_precision() == "highest"
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert not torch.backends.cudnn.benchmark and not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = before[1:3]
        torch.backends.cuda.enable_cudnn_sdp(before[3])
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True).stdout
    setting = {name for name in files.split() if not name.startswith("tests/")
               and SETTING.search((ROOT / name).read_text())}
    assert setting == {"hardware.py"}


def test_under_torchrun_on_cuda_each_process_takes_its_gpu_and_waits_out_the_first_ones_evaluation(
        monkeypatch):
    """The second of two processes: nccl, on cuda:1 (LOCAL_RANK), and a collective that waits longer than an
    evaluation: nccl's default of 10 minutes aborted the others while the first evaluated MATH-500."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(processes, "pick_device", lambda name: torch.device("cuda"))
    chosen, started = [], {}
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(processes.dist, "is_initialized", lambda: bool(started))
    monkeypatch.setattr(processes.dist, "init_process_group",
                        lambda backend, **kw: started.update(kw, backend=backend))
    monkeypatch.setattr(processes.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(processes.dist, "get_world_size", lambda: 2)
    assert processes.init_processes("cuda") == (1, 2, torch.device("cuda", 1))
    assert chosen == [torch.device("cuda", 1)] and started["backend"] == "nccl"
    assert started["timeout"] >= timedelta(hours=1)


# SmolLM2-135M's widths (its config.json; a Llama, taken here as a Qwen2 of the same widths)
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3)


@pytest.mark.parametrize("size, precision, rank", [
    ("1.5B", "bf16", 0), ("1.5B", "bf16", 32), ("1.5B", "fp32", 0), ("0.5B", "fp32", 32),
    ("smollm2", "bf16", 0), ("smollm2", "bf16", 8)])
def test_memory_sampling_is_the_peak_of_hf_generates_prefill(size, precision, rank):
    """Two layers at real widths, GQA included (Qwen2.5-1.5B: 2 KV heads of 12): torch's profiler's peak
    while HF generate (CUDA's sampling path) prefills 2 prompts x 2 completions, against memory.py's
    sampling term. Before, the term counted the KV cache alone: at 1.5B under LoRA in bf16 a sixth of it."""
    widths = SMOLLM2 if size == "smollm2" else SIZES[size]
    config = Qwen2Config(vocab_size=1000, tie_word_embeddings=True, eos_token_id=999, pad_token_id=998,
                         **{**widths, "num_hidden_layers": 2})
    torch.manual_seed(0)
    net = Qwen2ForCausalLM(config)
    if rank:
        lora.add_adapters(net, rank, 32, "tiny", 0)
    net = hardware.working_copy(net, precision).eval()
    prompts = torch.randint(0, 990, (2, 48))
    with torch.no_grad():
        peak = peak_bytes(lambda: sample_with_generate(net, prompts, torch.ones_like(prompts), 2, 1, 1.0, 1.0,
                                                       [999], 998))
    terms = memory.estimate_memory(config, 0, rows=4, prompt_len=48, completion_len=1, micro_batch=4,
                                   bf16=precision == "bf16", reference=False, checkpointing=False,
                                   lora_params=memory.adapter_count(config, rank))
    weights = sum(t.numel() * t.element_size() for t in [*net.parameters(), *net.buffers()])
    assert peak - weights == pytest.approx(terms["sampling"], rel=0.03)  # the profiler counts the weights


# ------------------------------------------------------------------ the whole program under CUDA's rules


def under_cudas_rules(main, argv: list[str]):
    """main(argv) as a process of its own on the stand-in (`test_device.CudaDeviceRules`): a device that reads
    as cuda:0, with its own generator, seeded as a fresh process's is."""
    with CudaDeviceRules():
        return main(argv)


@pytest.mark.parametrize("algo, flags", [("aapo", LORA), ("avspo", OPENED)], ids=["aapo-lora", "avspo-full"])
def test_train_py_on_the_stand_in_saves_and_resumes_exactly(tmp_path, capsys, monkeypatch, algo, flags):
    """train.py --device cuda from main, in bf16 with every flag that makes tensors meet (`OPENED`): AAPO (the
    reference's completions too) under LoRA, and AVSPO fine-tuning every weight (its trigger's state in the
    checkpoint; the model loads through from_pretrained, which once read garbage rotary buffers under the
    rules: a meta tensor's device read as the host's). Two steps straight, and two stopped by a SIGTERM in
    step 1 (saved), then --resume: the same steps, exactly. The device draws from its own generator, so a
    step that reseeded the host's alone would sample the resumed step from the device's state of a fresh
    process. The device's branches run: the first line names cuda:0 and counts the CUDA context. Then
    eval.py on the checkpoint, and merge.py under LoRA."""
    flags = STAND_IN + ["--algo", algo, *flags, "--device", "cuda", "--reward", PARITY, "--save-every", "1",
                        "--eval-every", "0", "--steps", "2", "--log-samples", "every"]
    step = train.train_step

    def sigterm_in_step_1(args, run, number, *rest):  # as a scheduler sends it: the step ends, saved
        if number == 1:
            signal.raise_signal(signal.SIGTERM)
        return step(args, run, number, *rest)

    for more, out in [([], "straight"), (["--resume"], "resumed")]:
        if more == ["--resume"]:  # first stopped by a SIGTERM in step 1
            monkeypatch.setattr(train, "train_step", sigterm_in_step_1)
            with pytest.raises(SystemExit) as stopped:
                under_cudas_rules(train.main, flags + ["--out", str(tmp_path / out)])
            assert stopped.value.code == 128 + signal.SIGTERM
            assert capsys.readouterr().out.strip().endswith("continue with --resume")
            monkeypatch.undo()
        under_cudas_rules(train.main, flags + [*more, "--out", str(tmp_path / out)])
        first = capsys.readouterr().out.splitlines()[0]  # CUDA's branches: the GPU named, its context counted
        assert first.startswith(f"[{algo}] cuda:0 (CudaDeviceRules, 80 GiB); bf16")
        assert "CUDA context 1.0 GiB" in first
    straight, resumed = (steps_of(tmp_path / run, algo) for run in ("straight", "resumed"))
    assert len(resumed) == 2 and all(r["rows_trained"] > 0 for r in straight)
    assert resumed == straight
    samples = [(tmp_path / run / algo / "samples.jsonl").read_text() for run in ("straight", "resumed")]
    assert samples[0] == samples[1] and samples[0].count("\n") == 2 * 2  # the same completions
    checkpoint = str(tmp_path / "resumed" / algo / "checkpoint")  # eval.py on it, --samples, the plain path
    summary = under_cudas_rules(eval_module.main, ["--model", checkpoint, "--samples", "2", "--limit", "2",
                                                   "--max-new-tokens", "6", "--device", "cuda", "--no-fast",
                                                   "--out", str(tmp_path / "eval")])
    assert capsys.readouterr().out.startswith(f"[eval {checkpoint}] cuda:0 (CudaDeviceRules, 80 GiB)")
    assert summary[checkpoint]["samples"] == 2
    if "--lora-rank" in flags:  # merge.py: the adapters into their base, on the device
        under_cudas_rules(merge.main, [checkpoint, str(tmp_path / "merged")])
        assert (tmp_path / "merged" / "model" / "model.safetensors").exists()


def test_a_loaded_model_fetches_no_hub_kernels(tmp_path):
    """transformers 5.25 loads with hub kernels on by default; on CUDA, model.train() then fetched layers from
    the hub (kernels-community's rotary): without it, the first update failed; with it, another kernel may
    run than this program's definition (found by the whole program on the stand-in)."""
    tiny, tokenizer = model_files.tiny_qwen2()
    model_files.save_folder(tiny, tokenizer, tmp_path / "folder")
    loaded, _ = load_model(str(tmp_path / "folder"), torch.device("cpu"))
    assert not getattr(loaded, "use_kernels", False)  # 5.17 has it off, and may not name it
