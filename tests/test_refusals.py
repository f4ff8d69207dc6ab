"""A refusal is a read (issue 61): each script that refuses says why in one line and leaves every byte and
every mtime as it was, its folder's record included. And what --resume needs of a run's own record of itself:
its config and logs, an evaluation's two logs that never disagree."""

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

import experiments
import merge
import train
from data import prepare
from infra.written import NotWritten, owned
from loop import run as run_module
from loop import run_folder
from tests.test_nothing_lost import FINISHED, copy_of, finished_run, no_model_in_a_run  # noqa: F401
from tests.test_record import snapshot


def refuses(script, folder: Path, says: str) -> None:
    """`script` exits with one line containing `says`, and nothing under `folder` (itself included) moved."""
    before = snapshot(folder), os.stat(folder).st_mtime_ns
    with pytest.raises(SystemExit) as exit_info:
        script()
    line = str(exit_info.value.code)
    assert says in line and "\n" not in line, line
    assert (snapshot(folder), os.stat(folder).st_mtime_ns) == before


@pytest.mark.parametrize("case", ["again", "other flags", "a log gone"])
def test_train_refusals_write_nothing(finished_run, tmp_path, monkeypatch, case):
    out = copy_of(finished_run, tmp_path)
    no_model_in_a_run(monkeypatch)
    flags = FINISHED + ["--out", str(out)]
    if case == "other flags":
        flags += ["--resume", "--lr", "1"]
    elif case == "a log gone":
        (out / "grpo" / "metrics.jsonl").unlink()
        flags += ["--resume"]
    says = {"again": "holds an earlier run", "other flags": "--lr 2e-05 -> 1.0, unlike its config.json",
            "a log gone": "has lost its metrics.jsonl, which --resume continues from"}[case]
    refuses(lambda: train.main(flags), tmp_path, says)


@pytest.mark.parametrize("gone", ["config.json", "evals.jsonl"])
def test_resume_without_the_runs_config_or_evaluations_is_one_line(finished_run, tmp_path, monkeypatch, gone):
    """Before, a run whose config.json was gone resumed under any flags (no config, no conflict), and one
    whose evals.jsonl was gone summarised part of the run."""
    out = copy_of(finished_run, tmp_path)
    (out / "grpo" / gone).unlink()
    no_model_in_a_run(monkeypatch)
    refuses(lambda: train.main(FINISHED + ["--out", str(out), "--resume", "--lr", "1"]), tmp_path,
            f"{out / 'grpo'} has lost its {gone}, which --resume continues from: restore it, or --overwrite")


def test_eval_experiments_merge_and_prepare_refusals_write_nothing(finished_run, tmp_path, monkeypatch):
    import eval as evaluation
    run = copy_of(finished_run, tmp_path)
    refuses(lambda: evaluation.main(["--model", "tiny-qwen2", "--out", str(run / "grpo")]), tmp_path,
            "holds a run of train.py")
    with owned(tmp_path / "ex", "experiments") as out:
        out.subfolder("figures", "experiments").write("results.json", "{}")
    (tmp_path / "ex" / "figures" / "results.json").write_text("[]")  # the user's edit
    refuses(lambda: experiments.main(["--quick", "--only", "compare", "--out", str(tmp_path / "ex")]),
            tmp_path,
            "results.json is changed since a script wrote it")
    monkeypatch.setattr(merge, "adapter_folder", lambda checkpoint: Path(checkpoint))
    monkeypatch.setattr(merge, "load_model", lambda *args: (None, None))  # the refusal comes at <out>
    refuses(lambda: merge.main([str(run), str(run / "grpo")]), tmp_path, "holds a run of train.py")
    with owned(tmp_path / "dl", "downloads") as downloads:
        downloads.write("notes.txt", "mine")
    (tmp_path / "dl" / "gsm8k_train.jsonl").write_text("the user's own")
    refuses(lambda: prepare.main(["gsm8k", "--out", str(tmp_path / "dl")]), tmp_path,
            "gsm8k_train.jsonl is not written here")


def test_a_folder_made_for_a_script_that_then_refuses_is_removed_again(tmp_path):
    with pytest.raises(NotWritten):
        with owned(tmp_path / "new" / "nested", "run"):
            raise NotWritten("refused")
    assert os.listdir(tmp_path) == []
    with owned(tmp_path / "new" / "nested", "run") as folder:
        folder.write("a", "1")  # a change: the folder stays, with its record
    assert sorted(os.listdir(tmp_path / "new" / "nested")) == [".written.json", "a"]


@pytest.mark.parametrize("out", [" ", "runs/ /x", "\t"])
def test_a_blank_out_is_refused_in_one_line(tmp_path, monkeypatch, capsys, out):
    no_model_in_a_run(monkeypatch)
    with pytest.raises(SystemExit):
        train.main(FINISHED + ["--out", out])
    assert "is a blank name, not a folder" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_a_run_stopped_between_an_evaluations_two_logs_resumes_with_them_agreeing(tmp_path, monkeypatch):
    """The run stops (a full disk) after the first of an evaluation's two writes, whichever comes first:
    after --resume, eval_records.jsonl holds the evaluation whose accuracy evals.jsonl logs last. Each
    evaluation is tagged by its call (the accuracy says which call it was, as do its records)."""
    calls = []
    real_evaluate = run_module.evaluate

    def tagged(*args, **kwargs):
        calls.append(len(calls) + 1)
        result = real_evaluate(*args, **kwargs)
        return result | {"accuracy": calls[-1] / 1000, "records": [r | {"call": calls[-1]}
                                                                    for r in result["records"]]}

    monkeypatch.setattr(run_module, "evaluate", tagged)
    writes = []
    real_write, real_append = run_folder.write_jsonl, run_folder.append_jsonl

    def second_write_of_the_last_evaluation_fails(real):
        def write(folder, name, *rest):
            if name in ("evals.jsonl", "eval_records.jsonl") and len(calls) == 2:
                writes.append(name)
                if len(writes) == 2:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(folder, name, *rest)
        return write

    monkeypatch.setattr(run_folder, "write_jsonl", second_write_of_the_last_evaluation_fails(real_write))
    monkeypatch.setattr(run_folder, "append_jsonl", second_write_of_the_last_evaluation_fails(real_append))
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="No space left"):
        train.main(FINISHED + ["--out", str(out)])
    monkeypatch.setattr(run_folder, "write_jsonl", real_write)
    monkeypatch.setattr(run_folder, "append_jsonl", real_append)
    train.main(FINISHED + ["--out", str(out), "--resume"])
    evals = [json.loads(line) for line in (out / "grpo" / "evals.jsonl").read_text().splitlines()]
    records = [json.loads(line) for line in (out / "grpo" / "eval_records.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2]
    assert {r["call"] for r in records} == {round(evals[-1]["eval_accuracy"] * 1000)}
    shutil.rmtree(out)


def test_a_checkpoint_read_between_its_saves_two_renames_is_the_new_one_or_one_line(finished_run, tmp_path,
                                                                                    monkeypatch):
    """Before, a reader that came between checkpoint/ -> checkpoint.old and the new one -> checkpoint/ was
    told "unknown model" (1 read in 18 during training). It now waits for the new one, or says it is being
    saved."""
    import threading

    from infra import model_files
    from model import model_source
    run = copy_of(finished_run, tmp_path) / "grpo"
    (run / "checkpoint").rename(run / "checkpoint.old")  # the save between its renames
    back = threading.Timer(0.3, lambda: shutil.copytree(run / "checkpoint.old", run / "checkpoint"))
    back.start()
    assert model_source(str(run / "checkpoint")) == str(run / "checkpoint" / "model")
    back.join()
    shutil.rmtree(run / "checkpoint")
    monkeypatch.setattr(model_files, "SAVE_WAIT", 0.2)
    with pytest.raises(FileNotFoundError, match="checkpoint is being saved by its run: try again"):
        model_source(str(run / "checkpoint"))


@pytest.mark.parametrize("script", ["train", "eval", "experiments", "prepare"])
def test_an_out_with_a_part_too_long_for_the_filesystem_is_one_line(tmp_path, capsys, script):
    """A 300-byte name: before, ENAMETOOLONG from Path.exists in `flags.folder`, a traceback but in train.py."""
    import eval as evaluation
    out = str(tmp_path / ("x" * 300))
    main = {"train": train.main, "eval": evaluation.main, "experiments": experiments.main,
            "prepare": lambda argv: prepare.main(["gsm8k", *argv])}[script]
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", out])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "argument --out: File name too long: " in err
    assert err.count("\n") == 1 and os.listdir(tmp_path) == []


def test_merge_of_a_checkpoint_caught_between_its_saves_renames_names_the_one_before(finished_run, tmp_path,
                                                                                      monkeypatch, capsys):
    """As eval.py: before, "holds no LoRA adapters ... nothing to merge" of a LoRA run mid-save."""
    from infra import model_files
    run = copy_of(finished_run, tmp_path) / "grpo"
    (run / "checkpoint").rename(run / "checkpoint.old")  # the save between its renames
    monkeypatch.setattr(model_files, "SAVE_WAIT", 0.2)
    refuses(lambda: merge.main([str(run / "checkpoint"), str(tmp_path / "merged")]), tmp_path,
            "checkpoint is being saved by its run: try again in a moment (or read checkpoint.old")


def test_a_run_is_known_by_its_datas_content_not_its_path(tmp_path, monkeypatch):
    """Before, a data file rewritten with other problems since a run was trained on it was continued
    (--resume) and reused by a study, exit 0: config.json recorded the path alone. It now records each file's
    sha256; a changed file is one line naming it and the run, and nothing is written."""
    from study import runs as study_runs
    data = tmp_path / "data.jsonl"
    problems = [{"problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(20)]
    data.write_text("".join(json.dumps(p) + "\n" for p in problems))
    out = tmp_path / "out"
    flags = FINISHED + ["--dataset", str(data), "--out", str(out)]
    train.main(flags)
    config = json.loads((out / "grpo" / "config.json").read_text())
    assert list(config["data_sha256"]) == [str(data)]
    study_runs.check_run(out, 0, "grpo", flags)  # as trained: reused
    data.write_text("".join(json.dumps(p | {"answer": "0"}) + "\n" for p in problems))  # other golds
    no_model_in_a_run(monkeypatch)
    refuses(lambda: train.main(flags + ["--resume", "--steps", "3"]), tmp_path,
            f"--resume {out / 'grpo'}: {data} is not the file the run was trained on (sha256 ")
    with pytest.raises(run_folder.RunFolderError, match=f"^{out / 'grpo'}: {data} is not the file the run was "
                                                        "trained on .*: restore it, or move"):
        study_runs.check_run(out, 0, "grpo", flags)
