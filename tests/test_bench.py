"""The benchmark scripts on tiny settings: benchmarks/bench.py's table and sections (its floors in floors.py),
gpu_bench.py's CPU smoke mode, fast_vs_plain.py."""

import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import train
from benchmarks import bench, demo_phases, floors, gpu_bench
from infra import hardware
from infra.memory import CUDA_ALLOWANCE, GIB
from loop import run
from cuda_stand_in import DEVICE, CudaDeviceRules
from data.prepare import DOWNLOADS
from data.tasks import load_problems
from verifier import load_reward

ROOT = Path(__file__).resolve().parent.parent
# data/prepare.py's files, else the development checkout's shared folder
DATA_DIR = next((folder for folder in (DOWNLOADS, ROOT.parent / "shared" / "data")
                 if (folder / "math500_test.jsonl").exists()), None)


def test_bench_quick_prints_the_step_table(capsys, monkeypatch):
    """The first config runs in its own spawned process, as every config does outside tests; the rest run in
    this one (a spawn costs seconds of imports, nine of them most of this test's time)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the spawned per-config process: no thread oversubscription
    spawned, isolated = [], bench.run_isolated

    def isolated_once(fn, *args):
        spawned.append(fn.__name__)
        return isolated(fn, *args) if len(spawned) == 1 else fn(*args)

    monkeypatch.setattr(bench, "run_isolated", isolated_once)
    wrapped = run.sample, run.score_groups  # bench_ours wraps them to record each batch's shape
    assert bench.main(["--quick", "--skip-trl", "--skip-verifier", "--rounds", "2"]) == 0
    assert spawned == ["measure_config"] * 8 + ["lora_update_seconds"]  # 4 configs, 2 rounds; LoRA's update
    assert (run.sample, run.score_groups) == wrapped  # put back: a later test's run records nothing
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| impl |"))
    assert [c.strip() for c in lines[header].strip("|").split("|")] == bench.STEP_COLUMNS
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[header + 2 : header + 6]]
    assert [(r[0], r[1], r[2]) for r in rows] == [("ours", "grpo", "fp32"), ("ours", "avspo", "fp32"),
                                                  ("ours", "aapo", "fp32"),
                                                  ("ours", "grpo, LoRA r32", "fp32")]
    for row in rows:
        assert len(row) == len(bench.STEP_COLUMNS) and float(row[6]) > 0  # step s
        assert float(row[-1]) > 100  # peak MB: a Python process with torch loaded
    floor_header = next(i for i, line in enumerate(lines)
                        if line.startswith("| impl | precision | generate s"))
    assert [c.strip() for c in lines[floor_header].strip("|").split("|")] == bench.FLOOR_COLUMNS
    floor_row = [c.strip() for c in lines[floor_header + 2].strip("|").split("|")]
    assert floor_row[:2] == ["ours", "fp32"] and len(floor_row) == len(bench.FLOOR_COLUMNS)
    gen_ratios, update_ratios, rates = floor_row[4:7:2], floor_row[9:12:2], floor_row[-2:]
    assert all(float(c[:-1]) > 0 for c in gen_ratios) and all(float(c) > 0 for c in rates)  # measured here
    # "–": every group collapsed, nothing to train
    assert all(c == "–" or float(c[:-1]) > 0 for c in update_ratios)
    summary = "\n".join(lines)
    assert "AVSPO's is" in summary and "AAPO / GRPO step time" in summary and "ours / TRL" not in summary
    aapo = next(line for line in lines if "AAPO / GRPO step time" in line)
    # one ratio per round, then their median
    assert len(aapo.split("(rounds: ")[1].split(")")[0].split(", ")) == 2
    lora = next(line for line in lines if line.startswith("- LoRA r32 / full fine-tuning, fp32: update "))
    assert len(lora.split("(reps: ")[1].split(";")[0].split(", ")) == 3  # the update on one rollout, 3 times
    assert len(lora.split("step time ")[1].split("(rounds: ")[1].split(", ")) == 2  # interleaved, as AAPO's


def test_batch_shape_counts_what_a_minimal_update_trains():
    """Group 0 has differing rewards (its rows train), group 1 collapsed (advantage 0: nothing to train)."""
    shape = floors.batch_shape([3, 1, 2, 2], [5, 7], [1.0, 0.0, 1.0, 1.0], group_size=2)
    assert shape == {"lengths": [3, 1, 2, 2], "prompt_tokens": 12, "trained_prompt_tokens": 5,
                     "trained_completion_tokens": 4, "trained_rows": 2}


def test_step_floors_count_passes_live_rows_and_real_tokens():
    body, head, dtype = ((4, 2),), (3, 2), torch.float32  # 8 body and 6 output-layer parameters
    shape = floors.batch_shape([3, 1, 2, 2], [5, 7], [1.0, 0.0, 1.0, 1.0], group_size=2)
    step = floors.step_floors(shape, body, head, dtype, {dtype: 1.0, "read_bytes_s": 1.0},
                              update_rates=(2.0, 3.0))
    # prefill (12 prompt tokens, 1 output row) + passes 1 and 2 with the rows still decoding: 3, then 1
    assert step["gen_kernel"] == (floors.kernel_seconds(body, 12, dtype)
                                  + floors.kernel_seconds((head,), 1, dtype)
                                  + floors.kernel_seconds(body + (head,), 3, dtype)
                                  + floors.kernel_seconds(body + (head,), 1, dtype))
    # 3 passes read 14 float32 weights each; FLOPs: 2 x (8 x (12 + 8) + 6 x 8) = 416 > 168 bytes at rate 1
    assert step["gen_physical"] == max(3 * 14 * 4, 416)
    # update: body sees 5 prompt + 4 completion tokens, the output layer the 4 completion tokens
    assert step["update_physical"] == 6 * (8 * 9 + 6 * 4)
    assert step["update_kernel"] == 6 * (8 * 9 / 2.0 + 6 * 4 / 3.0)


@pytest.mark.parametrize("plain_s, packed_s", [(1.0, 0.5), (0.5, 1.0)])
def test_machine_peak_is_the_faster_of_the_two_gemm_kernels(monkeypatch, plain_s, packed_s):
    """The physical floor's peak must not be slower than a kernel the kernel floor may use (the packed
    one)."""
    timed = []

    def fake_best_seconds(fn, reps=3):
        timed.append(fn)
        return [plain_s, packed_s, 2.0][len(timed) - 1]  # a @ b, the packed product, the 512 MiB sum

    monkeypatch.setattr(floors, "best_seconds", fake_best_seconds)
    rates = floors.machine_rates([torch.float32])
    assert rates[torch.float32] == 2 * 2048**3 / 0.5
    assert rates["read_bytes_s"] == 2**27 * 4 / 2.0
    # the packed product is a @ b too
    torch.testing.assert_close(timed[1](), timed[0](), rtol=1e-4, atol=1e-3)


def test_phase_floors_skip_a_step_with_nothing_to_train():
    """Two timed steps: the update floor comes from the one with a mixed group, generation's from both."""
    shapes = [floors.batch_shape([3, 1, 2, 2], [5, 7], [1.0, 0.0, 1.0, 1.0], 2),
              floors.batch_shape([2, 2, 2, 2], [5, 7], [0.0, 0.0, 0.0, 0.0], 2)]
    r = {"per_step": [{"generate_s": 1.0, "train_s": 2.0, **shape} for shape in shapes]}
    phase = floors.phase_floors(r, bench.reference_args("tiny-qwen2", 1, "fp32"))
    assert phase["update_kernel_ratio"] == pytest.approx(2.0 / phase["update_kernel"])
    assert phase["update_physical_ratio"] == pytest.approx(2.0 / phase["update_physical"])
    assert phase["gen_kernel"] > 0 and phase["gen_kernel_ratio"] > 0 and phase["gen_physical_ratio"] > 0


def test_verifier_section_is_skipped_without_shared_data(tmp_path, capsys):
    assert bench.verifier_rows(tmp_path, limit=5) is None
    assert "verifier section skipped" in capsys.readouterr().out


@pytest.mark.skipif(DATA_DIR is None, reason="no math500_test.jsonl (python data/prepare.py math)")
def test_verifier_section_on_a_few_cases():
    rows = bench.verifier_rows(DATA_DIR, limit=5)
    assert {(r[0], r[1]) for r in rows} >= {("verifier.verify", "GSM8K"), ("verifier.verify", "MATH-500")}
    assert all(r[2] in ("4", "5") and float(r[4]) <= float(r[5]) for r in rows)  # median <= worst


def test_advantage_step_is_timed_per_call_on_the_slower_batch_for_each_algorithm(monkeypatch):
    """A call "takes" 1 s on mixed groups and 3 s on collapsed ones (a fake clock, so no machine is too slow
    for the test): 3 s a call, the warm-up call not counted."""
    now = [0.0]
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    compute_advantages = train.compute_advantages

    def timed(args, rewards, *rest):
        now[0] += 3.0 if bool((rewards == rewards[:, :1]).all()) else 1.0
        return compute_advantages(args, rewards, *rest)

    monkeypatch.setattr(train, "compute_advantages", timed)
    for algo in ("grpo", "avspo", "aapo"):
        assert bench.advantage_seconds(bench.reference_args("tiny-qwen2", 1, "fp32", algo), reps=20) == 3.0


def gpu_check_command() -> list[str]:
    """docs/performance.md's one command for the offline GPU node, as words."""
    text = (ROOT / "docs" / "performance.md").read_text()
    return shlex.split(next(line for line in text.splitlines()
                            if line.startswith("python benchmarks/gpu_bench.py --smoke")))


def smoke_checks_ran_or_were_listed(report: dict, stdout: str, markdown: str) -> list[dict]:
    """The smoke checks that ran, each passed; each check it had no time for is skipped (ok None, not
    False), by name, in the JSON, the markdown table and the summary line (how many run depends on the
    machine's speed, whether any fails does not)."""
    ran = [c for c in report["smoke"] if c["ok"] is not None]
    assert all(c["ok"] is True for c in ran), [c for c in ran if c["ok"] is not True]
    skipped = [c["check"] for c in report["smoke"] if c["ok"] is None]
    summary = next(line for line in stdout.splitlines() if line.startswith("smoke: "))
    assert summary.startswith(f"smoke: {len(ran)} ok, 0 FAILED, {len(skipped)} skipped"), summary
    assert all(f"  skip {name}: over the smoke time budget" in stdout and name in summary for name in skipped)
    assert all(f"| {name} | skipped |" in markdown for name in skipped)
    return ran


TINY_CONFIGS = ["tiny grad_checkpointing=True LoRA r2 64-token prompts", "tiny grad_checkpointing=False",
                "tiny grad_checkpointing=True"]  # the README recipe's row first, on the tiny model


def table_configs_ran_or_were_skipped_for_time(report: dict, configs: list[str] = TINY_CONFIGS) -> list[dict]:
    """The table's configs, in order, each measured or skipped over --budget-s (named): its results."""
    assert all(s["reason"] == "time budget" for s in report["skipped"]), report["skipped"]
    ran, skipped = [r["config"] for r in report["results"]], [s["config"] for s in report["skipped"]]
    assert sorted(ran + skipped) == sorted(configs)
    return report["results"]


def smoke_checks_all_ran(report: dict, stdout: str, markdown: str) -> None:
    """The smoke of --tiny (its time box the GPU's: every check runs, however slow the CPU): the fast paths
    against the plain ones, the attention kernels, each method in each setting, every flag opened."""
    ran = smoke_checks_ran_or_were_listed(report, stdout, markdown)
    checks = [c["check"] for c in report["smoke"]]
    assert sum("fast paths:" in c for c in checks) == 4 and len(checks) == 4 + 2 * 4 + 4 * 5 + 5 + 1
    for head_dim in (64, 128):  # the update's and generation's attention, each path: an SDPA kernel named
        assert sum(c.endswith(f"head dim {head_dim})") for c in checks) == 4
        assert all(c["detail"].startswith("SDPA kernel: ") for c in ran
                   if c["check"].endswith(f"head dim {head_dim})"))
    assert all(c["detail"].startswith("rows trained ") and int(c["detail"].split()[2].strip(",")) > 0
               for c in ran if c["check"].startswith("train_step"))  # every method trained
    for algo in ("grpo:", "avspo:", "aapo:", "dapo:", "grpo beta 0.04:"):
        assert sum(f"train_step {algo} tiny-qwen2" in c for c in checks) == 5  # fp32, bf16, +- ckpt, LoRA
        lora = next(c for c in ran if c["check"] == f"train_step {algo} tiny-qwen2 bf16 ckpt LoRA r2")
        assert "frozen weights unchanged: True" in lora["detail"]  # and the adapters moved
    assert "| check | ok |" in markdown


def table_rows_measured(report: dict, path: str, configs: list[str] = TINY_CONFIGS) -> None:
    """--tiny's table: each config measured (or skipped for time) as it ran, on `path`'s code (a forced
    one's on the fast paths), with each phase's memory beside its estimate."""
    for r in table_configs_ran_or_were_skipped_for_time(report, configs):
        assert r["completion_len"] == 8 and r["rows_trained"] == 4  # runs to max_new_tokens, every row trains
        assert 0 < r["prompt_tokens"] <= r["prompt_len"]  # the one prompt's real tokens
        # 2 micro-batches of 2 rows, each its prompt once
        assert r["train_tokens"] == 2 * r["prompt_tokens"] + 4 * 8
        assert r["generate_s"] > 0 and r["train_s"] > 0 and r["mfu_step"] > 0  # not < 1: a busy machine's
        # measured peak may be below a later step's speed; the step's MFU is its phases' work over its time
        work = r["mfu_generate"] * r["generate_s"] + r["mfu_train"] * r["train_s"]
        assert r["mfu_step"] * r["step_s"] == pytest.approx(work)
        assert r["path"] == ("fast" if "fast paths" in r["config"] else path) and r["estimate_gib"] > 0
        context = CUDA_ALLOWANCE / GIB if report["device"] == "CudaDeviceRules" else 0  # what tensors hold:
        assert max(r["est_update_gib"], r["est_sampling_gib"]) == pytest.approx(r["estimate_gib"] - context)
    recipe = report["results"][0]  # lengthened prompts, the adapters alone trained
    assert recipe["lora_rank"] == 2 and recipe["prompt_len"] >= 64 > report["results"][1]["prompt_len"]


def test_gpu_bench_tiny_runs_on_cpu(tmp_path):
    """docs/performance.md's GPU check in its CPU mode, HF generate and the plain forward, from the command
    line (the smoke: under CUDA's rules, test_device_program.py), within its time budget: a slow machine
    skips configs (listed)."""
    out = tmp_path / "gpu_bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # CPU even on a GPU machine
    command = [sys.executable, "benchmarks/gpu_bench.py", "--tiny", "--no-fast", "--out", str(out)]
    # a hang guard, not a speed limit: --budget-s (400 s) ends the run, slow or fast, a config after it
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert not report["smoke"] and "| check | ok |" not in out.with_suffix(".md").read_text()
    assert report["workload"]["fast"] is False
    table_rows_measured(report, "plain")
    assert "| size | grad ckpt |" in proc.stdout
    assert "| config | allocated after sampling GiB |" in proc.stdout  # the memory by phase


def test_gpu_bench_smoke_past_its_budget_skips_the_rest_and_lists_them(tmp_path, monkeypatch, capsys):
    """The tester's 2-core AVX2 machine: a check takes longer than the whole budget (bf16 emulated). The
    checks after it are skipped, not failed, and named; so are the table's configs; the exit status is 2, and
    the last line says that checks were skipped ("0 FAILED" alone read as a pass when little ran).
    The clock jumps rather than the machine being slow, so the test is the same on any machine."""
    offset = [0.0]  # seconds the clock has jumped
    clock = SimpleNamespace(perf_counter=lambda: time.perf_counter() + offset[0])
    monkeypatch.setattr(gpu_bench, "time", clock)
    first_checks = gpu_bench.fast_equals_plain

    def first_one_outlasts_the_budget(device):
        (name, check), *rest = first_checks(device)

        def slow():
            verdict = check()
            offset[0] += 10**6  # past --smoke-s and --budget-s
            return verdict
        return [(name, slow), *rest]

    monkeypatch.setattr(gpu_bench, "fast_equals_plain", first_one_outlasts_the_budget)
    out = tmp_path / "gpu_bench.json"
    budgets = ["--smoke-s", "1e5", "--budget-s", "1e5"]  # ample, but for the jump: no machine runs out
    assert gpu_bench.main(["--tiny", "--device", "cpu", "--smoke", *budgets, "--out", str(out)]) == 2
    report, markdown = json.loads(out.read_text()), out.with_suffix(".md").read_text()
    printed = capsys.readouterr().out
    assert printed.splitlines()[-1].endswith("; 37 of 38 smoke checks were skipped, not passed")
    ran = smoke_checks_ran_or_were_listed(report, printed, markdown)
    assert [c["check"] for c in ran] == ["fast paths: greedy decode vs generate (fp32)"]
    assert len(report["smoke"]) == 4 + 2 * 4 + 4 * 5 + 5 + 1  # the other 37 listed as skipped
    assert table_configs_ran_or_were_skipped_for_time(report) == []  # both configs skipped, named


def test_fast_vs_plain_prints_both_paths_for_decoding_and_the_update():
    proc = subprocess.run([sys.executable, "benchmarks/fast_vs_plain.py", "--model", "tiny-qwen2",
                           "--reps", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)  # a hang guard
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("fp32: "))
    ms = [float(x) for x in re.findall(r"(\d+\.\d+) ms", line)]
    ratios = [float(x) for x in re.findall(r"\((\d+\.\d+)x\)", line)]
    assert len(ms) == 4 and all(t > 0 for t in ms) and len(ratios) == 2
    for (fast, plain), ratio in zip((ms[:2], ms[2:]), ratios):  # each ratio is its two times', as printed
        assert abs(ratio - fast / plain) <= 0.01 + ratio * (0.06 / fast + 0.06 / plain), line


def test_gpu_bench_smoke_stops_at_the_first_cuda_error_and_measures_no_table(tmp_path, monkeypatch, capsys):
    """The checks share a model and an optimizer, and a CUDA error can leave the context unusable: before,
    each later check failed from it, one error reading as 37. Now the error is one FAILED check, the rest are
    named as not run after it, and the table is not measured (exit 1)."""
    first_checks = gpu_bench.fast_equals_plain

    def second_meets_a_cuda_error(device):
        first, (name, _), *rest = first_checks(device)

        def illegal_access():
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        return [first, (name, illegal_access), *rest]

    monkeypatch.setattr(gpu_bench, "fast_equals_plain", second_meets_a_cuda_error)
    out = tmp_path / "gpu_bench.json"
    assert gpu_bench.main(["--tiny", "--device", "cpu", "--smoke", "--out", str(out)]) == 1
    report, printed = json.loads(out.read_text()), capsys.readouterr().out
    assert [c["ok"] for c in report["smoke"][:2]] == [True, False] and report["results"] == []
    assert {s["reason"] for s in report["skipped"]} == {f"after the CUDA error of {report['smoke'][1]['check']}"}
    failed = report["smoke"][1]["check"]
    rest = report["smoke"][2:]  # the first part's other two checks, then each part named, none built
    assert [c["check"] for c in rest[2:]] == [
        "kernels: build (head dim 64)", "kernels: build (head dim 128)", "build tiny-qwen2 fp32",
        "build tiny-qwen2 fp32 ckpt", "build tiny-qwen2 bf16", "build tiny-qwen2 bf16 ckpt",
        "build tiny-qwen2 bf16 ckpt LoRA r2", "build tiny-qwen2 bf16 ckpt, every flag opened"]
    assert all(c["ok"] is None and c["detail"] == f"skipped: after the CUDA error of {failed}" for c in rest)
    summary = next(line for line in printed.splitlines() if line.startswith("smoke: "))
    assert summary.startswith(f"smoke: 1 ok, 1 FAILED, {len(rest)} skipped; FAILED: {failed}; skipped: after "
                              f"the CUDA error of {failed} (not run): {rest[0]['check']}, ")


def test_gpu_bench_times_device_work_only_once_it_is_done(monkeypatch):
    """CUDA runs asynchronously: a clock read with work queued on the device stops before the work does. Every
    clock that times device work, the matmul rate's (B1) and a step's phases (G1), is read after a
    synchronisation, on the stand-in, which knows when work is queued (`CudaDeviceRules.queued`)."""
    with CudaDeviceRules() as rules:
        reads = []

        def perf_counter() -> float:
            reads.append((sys._getframe(1).f_code.co_name, rules.queued))
            return time.perf_counter()

        monkeypatch.setattr(gpu_bench, "time", SimpleNamespace(perf_counter=perf_counter))
        gpu_bench.matmul_tflops(DEVICE, 64, iters=2)
        opts = SimpleNamespace(prompts=1, group_size=4, max_new_tokens=4, micro_batch=2, fast=False, warmup=0,
                               steps=1)
        gpu_bench.bench_config(gpu_bench.Config("tiny", False), DEVICE, opts,
                               load_problems("arith-mul1", "train"), 1.0, math.inf)
    timed = [(where, queued) for where, queued in reads if where in ("matmul_tflops", "run_step")]
    assert [where for where, _ in timed] == ["matmul_tflops"] * 2 + ["run_step"] * 4
    assert not any(queued for _, queued in timed), timed


def test_gpu_bench_step_check_fails_where_no_row_trained():
    """The verifier on tiny-qwen2's random completions: every group all wrong, no row trained. A step check
    that passed then (G2) would call a method's update checked that never ran."""
    reward = load_reward("verifier")
    checks = gpu_bench.one_step_each("tiny-qwen2", "fp32", False, torch.device("cpu"),
                                     load_problems("arith-mul1", "train"), reward)
    name, check = checks[0]
    ok, detail = check()
    assert name.startswith("train_step grpo:") and not ok and detail.startswith("rows trained 0,"), detail


def test_gpu_bench_kernel_check_fails_where_no_sdpa_ran(monkeypatch):
    """An attention that ran no SDPA kernel (eager attention, a kernel the profiler names otherwise) fails
    its check (G3): "none" is no kernel, not a good one."""
    def no_sdpa(fn) -> str:
        fn()
        return "none"

    monkeypatch.setattr(gpu_bench, "attention_kernels", no_sdpa)
    verdicts = [check() for _, check in gpu_bench.kernel_checks(64, torch.device("cpu"))]
    assert len(verdicts) == 4 and not any(ok for ok, _ in verdicts), verdicts


def test_the_peak_on_a_gpu_counts_what_the_estimate_counts(monkeypatch):
    """The allocator's peak reservation and the CUDA context, as infra/memory.py's total: max_memory_allocated
    counts neither, and made a right estimate read as 1-2 GiB too high."""
    gib = 2**30
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * gib, 80 * gib))  # 20 GiB used now
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 19 * gib)  # the context and workspaces: 1
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 23 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 21 * gib)
    assert hardware.peak_memory_bytes(cuda) == 24 * gib


def test_demo_phases_split_a_runs_time_by_its_own_logs(tmp_path):
    """benchmarks/demo_phases.py: each phase is the sum of the run's logged seconds; the rest of time_run is
    loading, checkpoints and the plot; the imports are the wall time before time_run; min and median by group."""
    def run(name: str, wall: float, generate: list[float]) -> Path:
        folder = tmp_path / name
        (folder / "grpo").mkdir(parents=True)
        steps = [{"time_generate": g, "time_score": 0.5, "time_train": 2.0} for g in generate]
        (folder / "grpo" / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
        (folder / "grpo" / "evals.jsonl").write_text('{"time_eval": 3.0}\n{"time_eval": 1.0}\n')
        (folder / "grpo" / "summary.json").write_text(json.dumps({"time_run": wall - 5}))
        (folder / "wall.txt").write_text(f"{wall} 2000000\n")
        return folder

    measured = demo_phases.phases(run("a", 40.0, [4.0, 6.0]))
    assert measured == {"wall": 40.0, "imports": 5.0, "loading, checkpoints, plot": 35 - 10 - 1 - 4 - 4,
                        "sampling": 10.0, "scoring": 1.0, "update": 4.0, "evaluations": 4.0,
                        "peak GB": 2000000 * 1024 / 1e9}
    rows = demo_phases.table({"x": [run("b", 30.0, [1.0]), run("c", 50.0, [1.0]), run("d", 100.0, [1.0])]})
    assert "| wall | 30.0 | 50.0 |" in rows and "| sampling | 1.0 | 1.0 |" in rows
