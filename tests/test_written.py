"""infra/written.py: a script touches only what its record says it wrote, and the file is still what it
wrote."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from infra.written import RECORD, NotWritten, owned

ROOT = Path(__file__).resolve().parent.parent


def test_writes_appends_renames_and_removes_its_own_files(tmp_path):
    with owned(tmp_path / "f", "run") as folder:
        folder.write("a.json", "{}")
        folder.append("log.jsonl", "1\n")
        folder.append("log.jsonl", "2\n")
        folder.rename("a.json", "b.json")
        with folder.filling("checkpoint") as tmp:
            (tmp / "model").mkdir()
            (tmp / "model" / "w.bin").write_bytes(b"w" * 100)
        assert sorted(p.name for p in folder.path.iterdir()) == [RECORD, "b.json", "checkpoint", "log.jsonl"]
        assert (folder.path / "log.jsonl").read_text() == "1\n2\n"
        assert all(folder.ours(name) for name in ("b.json", "checkpoint", "log.jsonl"))
        folder.remove("checkpoint")
        folder.remove("b.json")
        assert sorted(p.name for p in folder.path.iterdir()) == [RECORD, "log.jsonl"]
        assert list(json.loads((folder.path / RECORD).read_text())["files"]) == ["log.jsonl"]


@pytest.mark.parametrize("how", ["replaced", "edited", "symlink", "appended"])
def test_a_file_changed_since_it_was_written_is_left_as_it_is(tmp_path, how):
    target = tmp_path / "user.txt"
    target.write_text("the user's")
    with owned(tmp_path / "f", "run") as folder:
        folder.write("summary.json", "{}")
        path = folder.path / "summary.json"
        if how == "replaced":
            path.unlink()
            path.write_text("{}!")
        elif how == "edited":
            path.write_text("[]")  # same size, other content
        elif how == "symlink":
            path.unlink()
            path.symlink_to(target)
        else:
            with path.open("a") as f:
                f.write("\n")
        before = path.read_bytes()
        for touch in (lambda: folder.write("summary.json", "x"), lambda: folder.append("summary.json", "x"),
                      lambda: folder.remove("summary.json"), lambda: folder.rename("summary.json", "s2"),
                      lambda: folder.clear()):
            with pytest.raises(NotWritten, match="summary.json is (changed|a symlink) since"):
                touch()
        assert path.read_bytes() == before and target.read_text() == "the user's"
        assert folder.foreign() == ["summary.json"]


def test_a_users_file_with_a_run_files_name_is_never_touched(tmp_path):
    with owned(tmp_path / "f", "run") as folder:
        (folder.path / "metrics.jsonl").write_text("the user's notes\n")
        with pytest.raises(NotWritten, match="metrics.jsonl is not written here"):
            folder.append("metrics.jsonl", "{}\n")
        with pytest.raises(NotWritten, match="not written here"):
            folder.write("metrics.jsonl", "{}\n")
        folder.remove("checkpoint")  # not there: nothing to do
        folder.clear()
        assert (folder.path / "metrics.jsonl").read_text() == "the user's notes\n"


def test_a_folder_with_files_and_no_record_is_refused_and_an_empty_one_taken(tmp_path):
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "notes.txt").write_text("mine")
    with pytest.raises(NotWritten, match="holds files and no record .*notes.txt"):
        with owned(tmp_path / "f", "run"):
            pass
    assert sorted(os.listdir(tmp_path / "f")) == ["notes.txt"]
    (tmp_path / "empty").mkdir()
    with owned(tmp_path / "empty", "run") as folder:
        folder.write("a", "1")


def test_a_folder_of_another_kind_and_a_damaged_or_linked_record_are_refused(tmp_path):
    with owned(tmp_path / "run", "run") as folder:
        folder.write("summary.json", "{}")
    with pytest.raises(NotWritten, match="holds a run of train.py.*not eval.py's results"):
        with owned(tmp_path / "run", "eval"):
            pass
    (tmp_path / "run" / RECORD).write_text("{")
    with pytest.raises(NotWritten, match="is damaged"):
        with owned(tmp_path / "run", "run"):
            pass
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / RECORD).symlink_to(tmp_path / "run" / RECORD)
    with pytest.raises(NotWritten, match="not a record this project wrote"):
        with owned(tmp_path / "other", "run"):
            pass


def test_a_subfolder_that_is_a_symlink_or_a_file_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with owned(tmp_path / "out", "runs") as out:
        (out.path / "grpo").symlink_to(elsewhere)
        (out.path / "aapo").write_text("x")
        for name in ("grpo", "aapo"):
            with pytest.raises(NotWritten, match=f"{name} is a (symlink|file)"):
                out.subfolder(name, "run")
        run = out.subfolder("avspo", "run")
        run.write("config.json", "{}")
        assert out.foreign() == ["aapo", "grpo"]  # avspo holds a record of its own
    assert os.listdir(elsewhere) == []


def test_a_copied_folder_is_still_known_by_content(tmp_path):
    with owned(tmp_path / "a", "run") as folder:
        folder.write("summary.json", "{}")
        with folder.filling("checkpoint") as tmp:
            (tmp / "w").write_bytes(b"w")
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # new inodes, new mtimes
    with owned(tmp_path / "b", "run") as folder:
        assert folder.foreign() == []
        folder.clear()
        assert os.listdir(tmp_path / "b") == [RECORD]


def test_one_owner_at_a_time_and_the_refusal_names_it(tmp_path):
    with owned(tmp_path / "f", "run") as folder:
        folder.write("a", "1")
        with pytest.raises(NotWritten, match=f"in use by process {os.getpid()}"):
            with owned(tmp_path / "f", "run"):
                pass
        waited = []
        waiter = threading.Thread(target=lambda: owned(tmp_path / "f", "run", wait=True).__enter__()
                                  and waited.append(True))
        waiter.start()
        waiter.join(0.5)
        assert not waited  # still waiting for the owner
    waiter.join(60)
    assert waited


def test_a_failed_fill_removes_what_it_filled_and_keeps_the_last_whole_one(tmp_path):
    with owned(tmp_path / "f", "run") as folder:
        with folder.filling("checkpoint") as tmp:
            (tmp / "w").write_bytes(b"old")
        with pytest.raises(OSError):
            with folder.filling("checkpoint.next") as tmp:
                (tmp / "w").write_bytes(b"half")
                raise OSError(28, "No space left on device")
        assert sorted(os.listdir(folder.path)) == [RECORD, "checkpoint"]
        assert (folder.path / "checkpoint" / "w").read_bytes() == b"old"


WRITER = """
import sys, itertools
sys.path.insert(0, {root!r})
from infra.written import owned
with owned({folder!r}, "run") as folder:
    for i in itertools.count():
        folder.append("metrics.jsonl", f"{{i}}\\n")
        folder.write("summary.json", str(i) * (i % 50))
        with folder.filling("checkpoint.tmp") as tmp:
            (tmp / "w").write_bytes(b"w" * (i % 1000))
        folder.remove("checkpoint.old")
        if folder.ours("checkpoint"):
            folder.rename("checkpoint", "checkpoint.old")
        folder.rename("checkpoint.tmp", "checkpoint")
        if i % 7 == 0:
            folder.clear(keep=("metrics.jsonl",))
"""


def test_killed_at_random_moments_the_record_still_knows_every_file_and_the_users_stay(tmp_path):
    """SIGKILL a writer 20 times at random moments: each time, the next owner finds every file there its own
    (a temporary made part-way included), removes them all, and the user's files are as they were."""
    folder = tmp_path / "f"
    rng = random.Random(0)
    for kill in range(20):
        folder.mkdir(exist_ok=True)
        writer = subprocess.Popen([sys.executable, "-c", WRITER.format(root=str(ROOT), folder=str(folder))])
        deadline = time.monotonic() + 60
        while not (folder / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.01)  # started writing: then a random moment
        time.sleep(rng.uniform(0, 0.2))
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        (folder / "user.txt").write_text("the user's")
        with owned(folder, "run") as again:
            assert again.foreign() == ["user.txt"], f"kill {kill}"
            again.clear()
        assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(RECORD)) == ["user.txt"]
        (folder / "user.txt").unlink()


def test_a_file_or_a_read_only_place_where_the_folder_should_be_is_one_line(tmp_path):
    (tmp_path / "file").write_text("the user's")
    with pytest.raises(NotWritten, match="file: not a folder this script can write"):
        with owned(tmp_path / "file", "run"):
            pass
    assert (tmp_path / "file").read_text() == "the user's"
    with pytest.raises(NotWritten, match="not a folder this script can write"):
        with owned(tmp_path / "file" / "below", "run"):
            pass


def test_a_write_that_fails_leaves_no_temporary_and_the_file_as_it_was(tmp_path, monkeypatch):
    with owned(tmp_path / "f", "eval") as folder:
        folder.write("summary.json", "old")

        real_replace = os.replace

        def disk_full(src, dst, **dir_fds):  # at the rename into place; the record is still written
            if Path(dst).name == "summary.json":
                raise OSError(28, "No space left on device")
            real_replace(src, dst, **dir_fds)

        monkeypatch.setattr(os, "replace", disk_full)
        with pytest.raises(OSError, match="No space left"):
            folder.write("summary.json", "new")
        assert sorted(os.listdir(folder.path)) == [RECORD, "summary.json"]
        assert (folder.path / "summary.json").read_text() == "old" and folder.foreign() == []


def test_a_recorded_file_removed_since_may_be_written_again(tmp_path):
    with owned(tmp_path / "f", "run") as folder:
        folder.write("curves.png", b"png")
        with folder.filling("checkpoint") as tmp:
            (tmp / "w").write_bytes(b"w")
        (folder.path / "curves.png").unlink()  # the user freed the space, or wanted a fresh plot
        shutil.rmtree(folder.path / "checkpoint")
        assert folder.foreign() == [] and not folder.ours("curves.png")
        folder.write("curves.png", b"png 2")
        with folder.filling("checkpoint") as tmp:
            (tmp / "w").write_bytes(b"w 2")
        assert (folder.path / "curves.png").read_bytes() == b"png 2"


def test_the_refusal_names_the_owner_not_the_last_process_that_wrote(tmp_path):
    with owned(tmp_path / "f", "run") as folder:
        folder.write("a", "1")
    record = json.loads((tmp_path / "f" / RECORD).read_text())
    (tmp_path / "f" / RECORD).write_text(json.dumps({**record, "pid": 999999999}))  # a run long gone
    with owned(tmp_path / "f", "run"):
        with pytest.raises(NotWritten, match=f"in use by process {os.getpid()} "):
            with owned(tmp_path / "f", "run"):
                pass


def test_a_fill_that_cannot_take_its_name_removes_what_it_filled(tmp_path):
    with owned(tmp_path / "f", "run") as folder:
        (folder.path / "checkpoint").write_text("the user's")
        with pytest.raises(NotWritten, match="checkpoint is not written here"):
            with folder.filling("checkpoint") as tmp:
                (tmp / "w").write_bytes(b"w")
        assert sorted(p.name for p in folder.path.iterdir()) == [RECORD, "checkpoint"]
        assert (folder.path / "checkpoint").read_text() == "the user's"
