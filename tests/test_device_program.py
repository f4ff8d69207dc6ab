"""What a GPU run meets around its steps, on the CPU (issue 62): a checkpoint a GPU saved, the settings that
change float32 numbers, the wait of the other processes while the first evaluates and saves, sampling's memory
as HF generate prefills every row, the hub kernels transformers would fetch, and train.py itself, from main,
under CUDA's rules (`cuda_stand_in.CudaDeviceRules`)."""

import dataclasses
import json
import math
import os
import re
import signal
import socket
import subprocess
import zipfile
from concurrent.futures import ProcessPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_flatten
from transformers import Qwen2Config, Qwen2ForCausalLM

import eval as eval_module
import experiments
import merge
import train
from benchmarks import gpu_bench
from benchmarks.gpu_bench import PARITY  # PARITY: a coin flip per completion, groups split, rows train
from data.tasks import LEVELS
from infra import hardware, lora, memory, model_files
from loop import processes
from model import load_model, sample_with_generate
from study import workers
from test_bench import TINY_CONFIGS, gpu_check_command, smoke_checks_all_ran, table_rows_measured
import cuda_stand_in
from cuda_stand_in import CudaDeviceRules
from test_device import DRIVEN, LORA, OPENED, peak_bytes, widths
from test_device import TINY as STAND_IN
from test_faults import TINY, small_processes

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
    """metrics.jsonl's records without what measures the machine (timings, memory)."""
    volatile = ("time_", "_per_s", "peak_memory")
    return [{k: v for k, v in json.loads(line).items() if not any(t in k for t in volatile)}
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
    assert setting == {"infra/hardware.py"}


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


@pytest.mark.parametrize("size, precision, rank", [
    ("1.5B", "bf16", 0), ("1.5B", "bf16", 32), ("1.5B", "fp32", 0), ("0.5B", "fp32", 32),
    ("smollm2", "bf16", 0), ("smollm2", "bf16", 8)])
def test_memory_sampling_is_the_peak_of_hf_generates_prefill(size, precision, rank):
    """Two layers at real widths, GQA included (Qwen2.5-1.5B: 2 KV heads of 12): torch's profiler's peak
    while HF generate (CUDA's sampling path) prefills 2 prompts x 2 completions, against infra/memory.py's
    sampling term. Before, the term counted the KV cache alone: at 1.5B under LoRA in bf16 a sixth of it."""
    config = Qwen2Config(vocab_size=1000, tie_word_embeddings=True, eos_token_id=999, pad_token_id=998,
                         **{**widths(size), "num_hidden_layers": 2})
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
    assert peak == pytest.approx(terms["sampling"], rel=0.03)


# ------------------------------------------------------------------ the whole program under CUDA's rules


def under_cudas_rules(main, argv: list[str]):
    """main(argv) as a process of its own on the stand-in (`cuda_stand_in.CudaDeviceRules`): a device that reads
    as cuda:0, with its own generator, seeded as a fresh process's is."""
    with CudaDeviceRules():
        return main(argv)


# Every train.py flag off its default in one of the programs below (`test_every_flag_runs_off_its_default`):
# under full fine-tuning, raw prompts and every method's knobs; under LoRA, chat prompts with a system message
PROGRAMS = {
    "full": [*OPENED, "--prompt-format", "raw", "--dataset", "arith-add1", "--eval-dataset", "arith-mul1",
             "--temperature", "0.7", "--lr-decay", "0.5", "--epsilon", "0.1", "--epsilon-high", "0.3",
             "--max-grad-norm", "0.5", "--acr-threshold", "0.3", "--alpha", "1", "--num-virtual", "2",
             "--virtual-delta", "0.2", "--virtual-ends", "all-wrong", "--delta-low", "0.1", "--delta-high",
             "0.2", "--resample-rounds", "1", "--reward-range=-1,1", "--reward-timeout", "30", "--seed", "3",
             "--micro-batch", "2", "--eval-every", "1", "--eval-size", "2", "--no-show-group", "--no-fast",
             "--max-prompt-tokens", "1000"],
    "lora": [*LORA, "--system", "Answer briefly.", "--fixed-threshold", "--eval-every", "0",
             "--log-samples", "none", "--prompts-per-step", "1"],
}
ALGOS = "grpo,avspo,aapo,dapo"


def program_argv(case: str) -> list[str]:
    """train.py's flags for one program on the stand-in: every method, bf16, 2 steps of 2 prompts x 3 (LoRA:
    1 prompt)."""
    return [*STAND_IN, "--algo", ALGOS, "--device", "cuda", "--reward", PARITY, "--save-every", "1",
            "--steps", "2", "--prompts-per-step", "2", "--group-size", "3", "--max-new-tokens", "5",
            "--log-samples", "every", *PROGRAMS[case]]  # later flags win: lora's --log-samples none


@pytest.mark.parametrize("case", PROGRAMS)
def test_train_py_on_the_stand_in_saves_and_resumes_each_method_exactly(tmp_path, capsys, monkeypatch, case):
    """train.py --device cuda from main, each method in turn, in bf16 with every flag that makes tensors meet
    (`OPENED`), fine-tuning every weight and under LoRA (`PROGRAMS`). Straight, then stopped by a SIGTERM in
    step 1 of each method (saved, exit 143) and continued with --resume: the same steps and completions,
    exactly. AVSPO's trigger's state goes through the checkpoint; the resumed models load through
    from_pretrained, which once read garbage rotary buffers under the rules (a meta tensor's device read as
    the host's). The device draws from its own generator, so a step that reseeded the host's alone would
    sample the resumed step from the device's state of a fresh process. The device's branches run: the first
    line names cuda:0 and counts the CUDA context. Then eval.py on a checkpoint (--samples 2), and merge.py
    under LoRA."""
    argv = program_argv(case)
    step = train.train_step

    def sigterm_in_step_1(args, run, number, *rest):  # as a scheduler sends it: the step ends, saved
        if number == 1:
            signal.raise_signal(signal.SIGTERM)
        return step(args, run, number, *rest)

    under_cudas_rules(train.main, argv + ["--overwrite", "--out", str(tmp_path / "straight")])
    lines = capsys.readouterr().out.splitlines()
    firsts = [line for line in lines if " cuda:0 (" in line]  # CUDA's branches: the GPU named, its context
    assert len(firsts) == 4 and all("] cuda:0 (CudaDeviceRules, 80 GiB); bf16" in line
                                    and "CUDA context 1.0 GiB" in line for line in firsts)
    monkeypatch.setattr(train, "train_step", sigterm_in_step_1)
    for algo in ALGOS.split(","):  # the first call stops GRPO; each next one resumes it and stops the next
        with pytest.raises(SystemExit) as stopped:
            under_cudas_rules(train.main, argv + ["--resume", "--out", str(tmp_path / "resumed")])
        assert stopped.value.code == 128 + signal.SIGTERM
        saved = f"[{algo}] interrupted: step 1 saved in {tmp_path / 'resumed' / algo}; continue with --resume"
        assert capsys.readouterr().out.strip().endswith(saved)
    under_cudas_rules(train.main, argv + ["--resume", "--out", str(tmp_path / "resumed")])
    capsys.readouterr()
    for algo in ALGOS.split(","):
        straight, resumed = (steps_of(tmp_path / run, algo) for run in ("straight", "resumed"))
        assert len(resumed) == 2 and all(r["rows_trained"] > 0 for r in straight)
        assert resumed == straight, algo
        saved = [torch.load(tmp_path / run / algo / "checkpoint" / "state.pt", weights_only=True)
                 for run in ("straight", "resumed")]  # AVSPO's trigger state, AdamW's moments: as straight
        assert saved[0]["algo_state"] == saved[1]["algo_state"] and saved[1]["step"] == 2
        assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(
            *(tree_flatten(state["optimizer"])[0] for state in saved)))
        samples = [(tmp_path / run / algo / "samples.jsonl") for run in ("straight", "resumed")]
        if case == "full":  # the same completions
            text = samples[0].read_text()
            assert text == samples[1].read_text() and text.count("\n") == 4
    assert sum(r["resampled_groups"] for r in steps_of(tmp_path / "straight", "dapo")) > 0
    checkpoint = str(tmp_path / "resumed" / "aapo" / "checkpoint")  # eval.py on it, --samples, the plain path
    summary = under_cudas_rules(eval_module.main, ["--model", checkpoint, "--samples", "2", "--limit", "2",
                                                   "--max-new-tokens", "6", "--device", "cuda", "--no-fast",
                                                   "--out", str(tmp_path / "eval")])
    assert capsys.readouterr().out.startswith(f"[eval {checkpoint}] cuda:0 (CudaDeviceRules, 80 GiB)")
    assert summary[checkpoint]["samples"] == 2
    if case == "lora":  # merge.py: the adapters into their base, on the device
        under_cudas_rules(merge.main, [checkpoint, str(tmp_path / "merged")])
        assert (tmp_path / "merged" / "model" / "model.safetensors").exists()


def test_every_flag_runs_off_its_default(tmp_path):
    """Each train.py flag takes another value than its default in a program on the stand-in (its
    --resume and --overwrite in the calls), or in test_device's step test (`DRIVEN`): no flag's path goes
    untried under CUDA's rules."""
    default, fields = train.Args(), dataclasses.fields(train.Args)
    with CudaDeviceRules():  # --device cuda
        runs = [train.parse_args(program_argv(case) + extra) for case in PROGRAMS
                for extra in (["--resume"], ["--overwrite", "--out", str(tmp_path)])]
    off = {f.name for f in fields for args in runs if getattr(args, f.name) != getattr(default, f.name)}
    missing = {f.name for f in fields} - off - DRIVEN.keys()
    assert not missing, f"at its default in every program on the stand-in: {sorted(missing)}"


def test_experiments_quick_runs_its_runs_and_evaluations_on_the_stand_in(tmp_path, capsys):
    """experiments.py --quick under the rules: the calibration run and the plan's memory against the device's,
    the untrained model's ACR by level (sampled on the device), the compare runs of GRPO and DAPO and the final
    checkpoints' evaluations, and the precision part's bf16 and fp32 runs, each on cuda:0 (`--device auto`
    finds it), with every number of their tables."""
    results = under_cudas_rules(experiments.main, [
        "--quick", "--out", str(tmp_path), "--only", "difficulty,compare,precision", "--methods", "grpo,dapo",
        "--seeds", "0", "--precision-seeds", "0"])
    printed = capsys.readouterr().out
    firsts = [line for line in printed.splitlines() if re.match(r"\[\w+\] \S+ \(", line)]
    assert len(firsts) == 5 and all("] cuda:0 (CudaDeviceRules, 80 GiB); " in line for line in firsts)
    assert {"; fp32 (float32 master weights); " in line for line in firsts} == {True, False}
    assert " GiB a run, 1 on a device: " in printed and " of its 80.0 GiB\n" in printed  # the calibration's
    assert set(results["difficulty"]) == {*LEVELS, "mix"}
    assert list(results["compare"]) == ["grpo", "dapo"] and set(results["precision"]) == {"bf16", "fp32"}
    for row in results["compare"].values():
        assert math.isfinite(row["accuracy"]["mean"])  # one seed: no interval (study/stats.py), NaN
        assert all(math.isnan(v) for v in row["by_level"]["add1"]["ci"])


def test_a_study_of_two_jobs_runs_a_worker_on_each_gpu_and_nothing_on_the_parents(tmp_path, monkeypatch):
    """experiments.py --jobs 2 on a machine of 2 GPUs (the stand-in, in the parent and in each spawned
    worker: `cuda_stand_in.start_worker`): each worker's first CUDA call sees its own GPU (W1), the two
    compare runs side by side on GPUs 0 and 1, and the parent makes no tensor on any GPU (W4): the
    calibration and the difficulty part run in a worker too, so no cache of the parent's sits on GPU 0
    while a worker trains there."""
    log = tmp_path / "workers.jsonl"
    monkeypatch.setenv(cuda_stand_in.WORKER_LOG, str(log))
    monkeypatch.setattr(workers, "start_worker", cuda_stand_in.start_worker)
    monkeypatch.setattr(workers, "with_threads", cuda_stand_in.with_threads)
    with CudaDeviceRules(count=2) as parent:
        results = experiments.main(["--quick", "--out", str(tmp_path / "study"), "--jobs", "2", "--only",
                                    "difficulty,compare", "--methods", "grpo,dapo", "--seeds", "0"])
    assert set(results["compare"]) == {"grpo", "dapo"} and "mix" in results["difficulty"]
    assert not parent.seen, f"the parent made tensors on GPU {sorted(parent.seen)}"
    told = [json.loads(line) for line in log.read_text().splitlines()]  # calibration, difficulty, compare
    assert len(told) == 4 and all(worker["seen"] == [0] for worker in told), told  # each its one GPU
    assert sorted(str(worker["visible"]) for worker in told[-2:]) == ["0", "1"], told  # the compare runs


def test_gpu_bench_smoke_runs_every_check_on_the_stand_in(tmp_path, capsys):
    """docs/performance.md's one GPU command, its smoke on --tiny, under the rules: every check on cuda:0,
    the collectives through nccl (gloo beneath, `CudaDeviceRules.collective`), then the table's rows,
    HF generate's and the plain forward's (CUDA's paths) and the fast paths forced on."""
    documented = gpu_check_command()
    assert documented[:3] == ["python", "benchmarks/gpu_bench.py", "--smoke"]
    out = tmp_path / "gpu_bench.json"  # the smoke's time box is the GPU's: here every check runs
    argv = [*documented[2:], "--tiny", "--device", "cuda", "--smoke-s", "3600", "--out", str(out)]
    assert under_cudas_rules(gpu_bench.main, argv) == 0
    stdout, report = capsys.readouterr().out, json.loads(out.read_text())
    smoke_checks_all_ran(report, stdout, out.with_suffix(".md").read_text())
    assert report["device"] == "CudaDeviceRules"
    opened = "train_step aapo, every flag opened (nccl): tiny-qwen2 bf16 ckpt"  # through the nccl rules
    assert opened in [c["check"] for c in report["smoke"]]
    table_rows_measured(report, "plain", TINY_CONFIGS + ["tiny grad_checkpointing=False fast paths"])


# ------------------------------------------------------------------ torchrun's processes, a GPU each


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_torchrun_process(rank: int, port: int, body, *args) -> tuple[object, list[int]]:
    """body(*args) as process `rank` of 2 that torchrun started on a machine of 2 GPUs, under the rules:
    (its exit status, or what it raised in one line; the CUDA devices it made tensors on)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two processes on the cores
    rules = CudaDeviceRules(index=0, count=2)  # a fresh process: cuda:0 current until it sets its own
    try:
        with rules:
            body(*args)
        status = 0
    except SystemExit as e:
        status = e.code
    except Exception as e:  # noqa: BLE001 - said in the test's failure
        status = f"{type(e).__name__}: {e}"
    return status, sorted(rules.seen)


def two_processes(body, *args, wait: float = 300) -> list[tuple[object, list[int]]]:
    """body(*args) in two processes of one torchrun group (`as_torchrun_process`), forked from the small
    process (test_faults.py); `wait` seconds at most for both."""
    port = free_port()
    with ProcessPoolExecutor(max_workers=2, mp_context=small_processes()) as pool:
        futures = [pool.submit(as_torchrun_process, rank, port, body, *args) for rank in (0, 1)]
        return [f.result(timeout=wait) for f in futures]


def collectives(entered: dict) -> None:
    """torchrun's process group as loop/processes.py starts it (nccl on CUDA, waiting `COLLECTIVE_WAIT`), then
    each process's collective from `entered` (by rank): a sum, a gather, or none (it leaves the group)."""
    rank, world, device = processes.init_processes("cuda")
    torch.zeros(1, device=device)  # on its GPU
    if entered[rank] == "sum":
        processes.all_sum([1.0], device)
    elif entered[rank] == "gather":
        processes.gather_groups(torch.zeros(1, 3, device=device))
    processes.close_processes()


@pytest.mark.parametrize("entered", [{0: "sum", 1: "sum"}, {0: "sum", 1: "gather"}, {0: "gather", 1: None}],
                         ids=["alike", "unlike", "skipped"])
def test_a_collective_one_process_skips_fails_fast_on_the_stand_in(entered):
    """Two processes under nccl's rules (gloo beneath), each on its GPU: the same collective passes; another
    collective, or none (the process leaves), raises in every process that entered one, at once, though
    the group waits 2 hours (`processes.COLLECTIVE_WAIT`): a real nccl would hang there."""
    results = two_processes(collectives, entered, wait=60)
    assert [seen for _, seen in results] == [[0], [1]]  # each process on its own GPU (LOCAL_RANK)
    if entered == {0: "sum", 1: "sum"}:
        assert [status for status, _ in results] == [0, 0]
    else:
        assert re.search("entered different collectives|Connection (reset|closed) by peer", str(results[0][0]))


def test_train_py_under_torchrun_on_two_gpus_of_the_stand_in(tmp_path):
    """train.py --algo dapo,grpo in two processes, each on its GPU, their collectives through nccl's rules:
    DAPO resamples a round in which only one process has a collapsed group (the other must still enter the
    gather), and both finish. Before, a process on its GPU would have met the other's tensors nowhere: a
    slip that put every process on cuda:0 is "Duplicate GPU detected" here."""
    argv = [*STAND_IN, "--algo", "dapo,grpo", "--device", "cuda", "--reward", PARITY, "--steps", "2",
            "--prompts-per-step", "2", "--group-size", "3", "--max-new-tokens", "5", "--eval-every", "0",
            "--save-every", "0", "--seed", "2", "--out", str(tmp_path)]  # seed 2: step 1 redoes 1 group of 2
    results = two_processes(train.main, argv)
    assert results == [(0, [0]), (0, [1])]
    records = steps_of(tmp_path, "dapo") + steps_of(tmp_path, "grpo")
    assert all(0 <= r["reward_mean"] <= 1 for r in records)  # the gathered rewards, as their copies landed
    resampled = [r["resampled_groups"] for r in steps_of(tmp_path, "dapo")]
    assert any(n % 2 for n in resampled), resampled  # a round of 1 collapsed group of 2: one process redid it
    assert all(r["rows_trained"] > 0 and r["skipped"] == 0 for r in steps_of(tmp_path, "grpo"))


def test_a_loaded_model_fetches_no_hub_kernels(tmp_path):
    """transformers 5.25 loads with hub kernels on by default; on CUDA, model.train() then fetched layers from
    the hub (kernels-community's rotary): without it, the first update failed; with it, another kernel may
    run than this program's definition (found by the whole program on the stand-in)."""
    tiny, tokenizer = model_files.tiny_qwen2()
    model_files.save_folder(tiny, tokenizer, tmp_path / "folder")
    loaded, _ = load_model(str(tmp_path / "folder"), torch.device("cpu"))
    assert not getattr(loaded, "use_kernels", False)  # 5.17 has it off, and may not name it
