"""The benchmark scripts on tiny settings: benchmarks/bench.py's table and sections (its floors in floors.py),
gpu_bench.py's CPU smoke mode, fast_vs_plain.py."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import bench, floors
from data.prepare import DOWNLOADS

ROOT = Path(__file__).resolve().parent.parent
# data/prepare.py's files, else the development checkout's shared folder
DATA_DIR = next((folder for folder in (DOWNLOADS, ROOT.parent / "shared" / "data")
                 if (folder / "math500_test.jsonl").exists()), None)


def test_bench_quick_prints_the_step_table(capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the spawned per-config processes: no thread oversubscription
    assert bench.main(["--quick", "--skip-trl", "--skip-verifier", "--rounds", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| impl |"))
    assert [c.strip() for c in lines[header].strip("|").split("|")] == bench.STEP_COLUMNS
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[header + 2 : header + 5]]
    assert [(r[0], r[1], r[2]) for r in rows] == [("ours", "grpo", "fp32"), ("ours", "avspo", "fp32"),
                                                  ("ours", "aapo", "fp32")]
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


def test_advantage_step_is_timed_for_each_algorithm():
    for algo in ("grpo", "avspo", "aapo"):
        seconds = bench.advantage_seconds(bench.reference_args("tiny-qwen2", 1, "fp32", algo), reps=20)
        assert 0 < seconds < 0.01


def gpu_check_command() -> list[str]:
    """docs/performance.md's one command for the offline GPU node, as words."""
    text = (ROOT / "docs" / "performance.md").read_text()
    return shlex.split(next(line for line in text.splitlines()
                            if line.startswith("python benchmarks/gpu_bench.py --smoke")))


# docs/performance.md's GPU check in its CPU mode (smoke checks first), or HF generate and the plain forward
@pytest.mark.parametrize("fast", ["--fast", "--no-fast"])
def test_gpu_bench_tiny_runs_on_cpu(tmp_path, fast):
    out = tmp_path / "gpu_bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # CPU even on a GPU machine
    documented = gpu_check_command()
    assert documented[:3] == ["python", "benchmarks/gpu_bench.py", "--smoke"]
    # the smoke's time box is the GPU's: here every check runs, however slow the CPU
    smoke = [*documented[3:], "--smoke", "--device", "cpu", "--smoke-s", "3600"] if fast == "--fast" else []
    command = [sys.executable, "benchmarks/gpu_bench.py", "--tiny", fast, *smoke, "--out", str(out)]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    checks = [c["check"] for c in report["smoke"]]
    assert all(c["ok"] for c in report["smoke"]), report["smoke"]
    if smoke:  # the fast paths against the plain ones, the attention kernels, each method in each setting
        assert sum("fast paths:" in c for c in checks) == 3 and len(checks) == 3 + 2 * 4 + 4 * 5 + 1
        for head_dim in (64, 128):  # the update's and generation's attention, each path: an SDPA kernel named
            kernels = [c["detail"] for c in report["smoke"] if c["check"].endswith(f"head dim {head_dim})")]
            assert len(kernels) == 4 and all(k.startswith("SDPA kernel: ") for k in kernels)
        assert all(c["detail"].startswith("rows trained ") and int(c["detail"].split()[2].strip(",")) > 0
                   for c in report["smoke"] if c["check"].startswith("train_step"))  # every method trained
        for algo in ("grpo:", "avspo:", "aapo:", "dapo:", "grpo beta 0.04:"):
            assert sum(f"train_step {algo} tiny-qwen2" in c for c in checks) == 4  # fp32, bf16, +- ckpt
        assert "train_step aapo, every flag opened (gloo): tiny-qwen2 bf16 ckpt" in checks  # 4 on a GPU
    assert "| check | ok |" in out.with_suffix(".md").read_text() if smoke else not checks
    assert report["workload"]["fast"] is (fast == "--fast")
    assert ([(r["size"], r["grad_checkpointing"]) for r in report["results"]]
            == [("tiny", False), ("tiny", True)])
    for r in report["results"]:
        assert r["completion_len"] == 8 and r["rows_trained"] == 4  # runs to max_new_tokens, every row trains
        assert 0 < r["prompt_tokens"] <= r["prompt_len"]  # the one prompt's real tokens
        # 2 micro-batches of 2 rows, each its prompt once
        assert r["train_tokens"] == 2 * r["prompt_tokens"] + 4 * 8
        assert r["generate_s"] > 0 and r["train_s"] > 0 and 0 < r["mfu_step"] < 1
        assert r["path"] == ("fast" if fast == "--fast" else "plain") and r["estimate_gib"] > 0
    assert report["skipped"] == [] and "| size | grad ckpt |" in proc.stdout


def test_fast_vs_plain_prints_both_paths_for_decoding_and_the_update():
    proc = subprocess.run([sys.executable, "benchmarks/fast_vs_plain.py", "--model", "tiny-qwen2",
                           "--reps", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("fp32: "))
    ms = [float(x) for x in re.findall(r"(\d+\.\d+) ms", line)]
    ratios = [float(x) for x in re.findall(r"\((\d+\.\d+)x\)", line)]
    assert len(ms) == 4 and all(t > 0 for t in ms) and len(ratios) == 2
    for (fast, plain), ratio in zip((ms[:2], ms[2:]), ratios):  # each ratio is its two times', as printed
        assert abs(ratio - fast / plain) <= 0.01 + ratio * (0.06 / fast + 0.06 / plain), line
