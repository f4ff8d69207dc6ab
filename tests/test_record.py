"""A folder's record (infra/written.py) is input from a stranger (issue 61): run folders are shared, committed
and downloaded. A record that names anything outside its folder, or is not of the shape infra/written.py
writes, is refused in one line before anything is touched, by every script that reads one; a folder moved or
swapped for a symlink while a script runs cannot redirect a write; an edit with its mtime put back is still an
edit; a line that a script's own append left cut short is the script's, and is cut back."""

import errno
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

import experiments
import merge
import train
from data import prepare
from infra import model_files
from infra.written import RECORD, Folder, NotWritten, owned
from tests.test_nothing_lost import FINISHED, copy_of, finished_run, no_model_in_a_run  # noqa: F401

SHA = "0" * 64


def snapshot(folder: Path) -> dict:
    """Every file and folder under `folder`: its bytes (files) and its mtime, to the nanosecond."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() and not p.is_symlink() else None,
                                         os.lstat(p).st_mtime_ns) for p in sorted(folder.rglob("*"))}


def planted(tmp_path: Path) -> Path:
    """A user's file and folder beside the folder under attack, and one two levels up, as the targets."""
    (tmp_path / "victim.txt").write_text("the user's")
    (tmp_path / "victim_dir").mkdir()
    (tmp_path / "victim_dir" / "thesis.tex").write_text("months of work")
    return tmp_path


CRAFTED = {  # what a stranger's record may say, each reaching outside its folder or of another shape
    "parent file": {"files": {"../victim.txt": ["any file"]}},
    "grandparent file": {"files": {"../../victim.txt": [{"file": [10, SHA, 1, 1]}]}},
    "absolute file": {"files": {"{victim}": ["any file"]}},
    "parent folder": {"files": {"../victim_dir": ["any folder"]}},
    "separator": {"files": {"sub/../../victim.txt": ["any file"]}},
    "dot": {"files": {".": ["any folder"]}},
    "empty name": {"files": {"": ["any file"]}},
    "NUL": {"files": {"a\0b": ["any file"]}},
    "newline": {"files": {"a\nb": ["any file"]}},
    "the record itself": {"files": {RECORD: ["any file"]}},
    "tmp parent": {"files": {}, "tmp": "../victim.txt"},
    "tmp absolute": {"files": {}, "tmp": "{victim}"},
    "tmp not a record's": {"files": {}, "tmp": "notes.txt"},
    "inside a folder": {"files": {"checkpoint": [{"dir": {"../../victim.txt": [10, SHA, 1, 1]}}]}},
    "files a list": {"files": ["../victim.txt"]},
    "a state 5": {"files": {"a": [5]}},
    "file null": {"files": {"a": [{"file": None}]}},
    "no states": {"files": {"a": []}},
    "a short entry": {"files": {"a": [{"file": [1, SHA]}]}},
    "not a hash": {"files": {"a": [{"file": [1, "../victim.txt", 1, 1]}]}},
    "a temporary's inode": {"files": {"a.0123abcd.tmp": [{"temporary": "any file", "inode": "x"}]}},
    "an unknown field": {"files": {}, "owner": "someone"},
    "an unknown kind": {"kind": "anything", "files": {}},
    "a kind list": {"kind": ["run"], "files": {}},  # before, a TypeError (unhashable) in `kind in KINDS`
    "a kind object": {"kind": {"run": 1}, "files": {}},
    "not an object": [],
}


def write_record(folder: Path, kind: str, crafted, victim: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    record = {"kind": kind, **crafted} if isinstance(crafted, dict) else crafted
    (folder / RECORD).write_text(json.dumps(record).replace("{victim}", str(victim)))


@pytest.mark.parametrize("case", CRAFTED)
def test_a_record_reaching_outside_its_folder_or_of_another_shape_is_damaged_and_nothing_moves(tmp_path,
                                                                                               case):
    planted(tmp_path)
    folder = tmp_path / "a" / "run"
    write_record(folder, "run", CRAFTED[case], tmp_path / "victim.txt")
    before = snapshot(tmp_path)
    with pytest.raises(NotWritten, match=f"{folder / RECORD} is damaged .*: restore it, or choose another"):
        with owned(folder, "run") as f:
            f.clear()  # --overwrite, had the record been taken
    assert snapshot(tmp_path) == before


def test_a_record_holding_a_5000_digit_integer_is_damaged(tmp_path):
    """json reads such an integer as a plain ValueError (Python's 4,300-digit limit), not a JSONDecodeError:
    before, a traceback."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / RECORD).write_text('{"kind": "run", "files": {"a": [{"file": [%s, "%s", 1, 1, 1]}]}}'
                                           % ("9" * 5000, SHA))
    before = snapshot(tmp_path)
    with pytest.raises(NotWritten, match=f"{tmp_path / 'run' / RECORD} is damaged: restore it"):
        with owned(tmp_path / "run", "run"):
            pass
    assert snapshot(tmp_path) == before


def test_a_folder_tree_deeper_than_pythons_stack_in_a_run_is_one_line_and_left(tmp_path):
    """A 1,200-deep tree where a run's checkpoint was: before, os.fwalk's RecursionError."""
    with owned(tmp_path / "run", "run") as folder:
        with folder.filling("checkpoint") as filled:
            (filled / "state.pt").write_text("x")
    fd = os.open(tmp_path / "run" / "checkpoint", os.O_RDONLY)
    limit = sys.getrecursionlimit()
    try:
        for _ in range(1200):  # through descriptors: the path itself would be too long to name
            os.mkdir("d", dir_fd=fd)
            fd, parent = os.open("d", os.O_RDONLY, dir_fd=fd), fd
            os.close(parent)
        os.close(fd)
        with owned(tmp_path / "run", "run") as folder:
            with pytest.raises(NotWritten, match="checkpoint is not a plain file or folder since a script"):
                folder.clear()
            assert folder.foreign() == ["checkpoint"]
        assert (tmp_path / "run" / "checkpoint" / "d").is_dir()
    finally:  # rmtree recurses too: pytest's clean-up of tmp_path would not remove it
        sys.setrecursionlimit(10_000)
        shutil.rmtree(tmp_path / "run" / "checkpoint")
        sys.setrecursionlimit(limit)


def test_a_record_that_is_a_symlink_to_a_device_is_one_line_and_never_read(tmp_path):
    """Before, a second run on the folder read the owner's pid through the record, with no size limit: a
    record linked to /dev/zero was a MemoryError. The owner now comes from the lock itself (/proc/locks)."""
    with owned(tmp_path / "run", "run") as folder:
        folder.write("a", "1")
        (tmp_path / "run" / RECORD).unlink()
        (tmp_path / "run" / RECORD).symlink_to("/dev/zero")
        with pytest.raises(NotWritten, match=f"in use by process {os.getpid()} "):
            with owned(tmp_path / "run", "run"):
                pass
    with pytest.raises(NotWritten, match="is not a record this project wrote"):
        with owned(tmp_path / "run", "run"):
            pass


# ------------------------------------------------------------ every script that reads a record refuses it
def refused(script, record_at: Path, kind: str, tmp_path: Path, capsys) -> None:
    """Plant the worst records at `record_at` (a file two levels up, an absolute path, the record's tmp),
    then run `script`: one line naming the record as damaged, and not a byte or an mtime moved."""
    for case in ("grandparent file", "absolute file", "parent folder", "tmp parent", "tmp absolute"):
        write_record(record_at, kind, CRAFTED[case], tmp_path / "victim.txt")
        before = snapshot(tmp_path)
        with pytest.raises(SystemExit) as exit_info:
            script()
        assert f"{record_at / RECORD} is damaged" in str(exit_info.value.code), case
        assert "\n" not in str(exit_info.value.code) and "Traceback" not in capsys.readouterr().err
        assert snapshot(tmp_path) == before, case


@pytest.mark.parametrize("flag", ["--resume", "--overwrite", None])
@pytest.mark.parametrize("where", ["out", "run"])
def test_train_refuses_a_crafted_record_at_out_or_a_run_folder(finished_run, tmp_path, monkeypatch, capsys,
                                                                flag, where):
    planted(tmp_path)
    out = copy_of(finished_run, tmp_path)
    no_model_in_a_run(monkeypatch)
    record_at = out if where == "out" else out / "grpo"
    kind = "runs" if where == "out" else "run"
    refused(lambda: train.main(FINISHED + ["--out", str(out)] + [flag] * bool(flag)), record_at, kind,
            tmp_path, capsys)


def test_eval_experiments_merge_prepare_and_the_cache_refuse_a_crafted_record(tmp_path, monkeypatch, capsys):
    import eval as evaluation
    planted(tmp_path)
    refused(lambda: evaluation.main(["--model", "tiny-qwen2", "--out", str(tmp_path / "ev")]),
            tmp_path / "ev", "eval", tmp_path, capsys)
    refused(lambda: experiments.main(["--quick", "--only", "compare", "--out", str(tmp_path / "ex")]),
            tmp_path / "ex", "experiments", tmp_path, capsys)
    refused(lambda: prepare.main(["gsm8k", "--out", str(tmp_path / "dl")]), tmp_path / "dl", "downloads",
            tmp_path, capsys)
    monkeypatch.setattr(merge, "adapter_folder", lambda checkpoint: Path(checkpoint))
    monkeypatch.setattr(merge, "load_model", lambda *args: (None, None))  # the refusal comes at <out>
    refused(lambda: merge.main([str(tmp_path), str(tmp_path / "merged")]), tmp_path / "merged", "merged",
            tmp_path, capsys)
    monkeypatch.setattr(model_files, "CACHE_DIR", tmp_path / "cache")

    def first_use():
        try:
            model_files.cached("a" * 64, lambda folder: None)
        except FileNotFoundError as e:  # as load_model says it: one line
            sys.exit(str(e))
    refused(first_use, tmp_path / "cache" / "models", "model-cache", tmp_path, capsys)


# ------------------------------------------------------------ the folder held open
@pytest.mark.parametrize("swap", ["moved", "a symlink to another run"])
def test_a_folder_swapped_while_a_script_writes_cannot_redirect_a_write(tmp_path, swap):
    """Every change goes through the descriptor taken when the folder was opened: a write, an append, a
    fill, a rename and a removal all land in the folder the script owns, wherever it now is."""
    other = tmp_path / "other"
    with owned(other, "run") as o:
        o.write("summary.json", "the other run's")
    other_before = snapshot(other)
    with owned(tmp_path / "run", "run") as folder:
        folder.write("a.json", "1")
        (tmp_path / "run").rename(tmp_path / "moved")
        if swap != "moved":
            (tmp_path / "run").symlink_to(other)
        folder.write("summary.json", "mine")
        folder.append("metrics.jsonl", "{}\n")
        with folder.filling("checkpoint") as tmp:
            (tmp / "w").write_bytes(b"w")
        folder.rename("a.json", "b.json")
        folder.remove("b.json")
        sub = folder.subfolder("grpo", "run")
        sub.write("config.json", "{}")
    assert snapshot(other) == other_before
    moved = tmp_path / "moved"
    assert sorted(os.listdir(moved)) == sorted([RECORD, "summary.json", "metrics.jsonl", "checkpoint",
                                                "grpo"])
    assert (moved / "summary.json").read_text() == "mine"
    assert (moved / "checkpoint" / "w").read_bytes() == b"w"
    assert (moved / "grpo" / "config.json").read_text() == "{}"


# ------------------------------------------------------------ identity
def test_an_edit_with_its_mtime_put_back_is_still_an_edit(tmp_path):
    """git's racy rule: same size, same inode, mtime restored (`cp -p`, `rsync -t`, `tar`) is caught by the
    ctime, which `utime` cannot set back."""
    with owned(tmp_path / "run", "run") as folder:
        folder.write("summary.json", '{"accuracy": 0.25}')
        folder.now("summary.json")  # recorded with its inode, mtime and ctime
    path = tmp_path / "run" / "summary.json"
    st = path.stat()
    with path.open("r+") as f:
        f.write('{"accuracy": 0.99}')  # same size, same inode
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_ino == st.st_ino
    with owned(tmp_path / "run", "run") as folder:
        with pytest.raises(NotWritten, match="summary.json is changed since a script wrote it"):
            folder.clear()
    assert path.read_text() == '{"accuracy": 0.99}'


@pytest.mark.parametrize("recorded", ["any file", {"temporary": "any file", "inode": 0}, "its inode"])
def test_a_users_file_named_like_a_temporary_is_never_taken_for_one(tmp_path, recorded):
    """'Any file' is only a temporary the script made itself: recorded by inode once made, or empty before.
    A stranger's record naming a user's file like a temporary does not make it the script's."""
    folder = tmp_path / "run"
    folder.mkdir()
    notes = folder / "notes.0123abcd.tmp"
    notes.write_text("the user's")
    state = ({"temporary": "any file", "inode": notes.stat().st_ino + 1} if recorded == "its inode"
             else recorded)
    write_record(folder, "run", {"files": {notes.name: [None, state]}}, notes)
    with owned(folder, "run") as f:
        with pytest.raises(NotWritten, match="notes.0123abcd.tmp is changed since"):
            f.remove_temporaries()
        assert f.foreign() == [notes.name]
    assert notes.read_text() == "the user's"


def test_recorded_temporaries_that_are_gone_leave_the_record(tmp_path):
    """A record listing 20,000 temporaries that are gone: dropped when it is read, so that each later save
    writes a small record (before, --overwrite rewrote all of them at every removal: 250 s at 200,000)."""
    folder = tmp_path / "run"
    gone = {f"metrics.jsonl.{i:08x}.tmp": ["any file"] for i in range(20_000)}
    write_record(folder, "run", {"files": gone}, folder)
    with owned(folder, "run") as f:
        assert f.files == {}
        f.write("config.json", "{}")
    assert list(json.loads((folder / RECORD).read_text())["files"]) == ["config.json"]


# ------------------------------------------------------------ a script's own partial write
def cut_short(folder: Folder, name: str, text: str, monkeypatch) -> None:
    """`folder.append(name, text)` failing half-way, as a full disk makes it: half the bytes land."""
    real_open = Folder.open

    class HalfFile:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def opened(self, n, flags):
        f = real_open(self, n, flags)
        return HalfFile(f) if flags & os.O_APPEND else f

    monkeypatch.setattr(Folder, "open", opened)
    with pytest.raises(OSError, match="No space left"):
        folder.append(name, text)
    monkeypatch.setattr(Folder, "open", real_open)


def test_a_line_a_full_disk_cut_short_is_the_scripts_own_and_is_cut_back(tmp_path, monkeypatch):
    with owned(tmp_path / "run", "run") as folder:
        folder.append("metrics.jsonl", '{"step": 1}\n')
        cut_short(folder, "metrics.jsonl", '{"step": 2, "loss": 0.5}\n', monkeypatch)
    path = tmp_path / "run" / "metrics.jsonl"
    assert path.read_text() == '{"step": 1}\n{"step": 2, '  # half of the line
    with owned(tmp_path / "run", "run") as folder:
        assert folder.foreign() == []
        folder.remove_temporaries()
        assert path.read_text() == '{"step": 1}\n'
        folder.append("metrics.jsonl", '{"step": 2}\n')
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    with owned(tmp_path / "run", "run") as folder:  # the record of the cut reads back as infra/written.py's
        assert folder.foreign() == []


@pytest.mark.parametrize("edit", ["other bytes", "the whole line and more"])
def test_a_users_edit_after_a_cut_short_line_is_still_refused(tmp_path, monkeypatch, edit):
    with owned(tmp_path / "run", "run") as folder:
        folder.append("metrics.jsonl", '{"step": 1}\n')
        cut_short(folder, "metrics.jsonl", '{"step": 2, "loss": 0.5}\n', monkeypatch)
    path = tmp_path / "run" / "metrics.jsonl"
    with path.open("a") as f:
        f.write("X" if edit == "other bytes" else 'oss": 0.5}\n{"step": 3}\n')
    before = path.read_bytes()
    with owned(tmp_path / "run", "run") as folder:
        with pytest.raises(NotWritten, match="metrics.jsonl is changed since"):
            folder.append("metrics.jsonl", '{"step": 2}\n')
        assert folder.foreign() == ["metrics.jsonl"]
    assert path.read_bytes() == before


def test_resume_after_a_full_disk_cut_a_metrics_line_continues(finished_run, tmp_path, monkeypatch):
    out = copy_of(finished_run, tmp_path)
    with owned(out, "runs") as runs:
        cut_short(runs.subfolder("grpo", "run"), "metrics.jsonl", json.dumps({"step": 3}) + "\n", monkeypatch)
    train.main(FINISHED + ["--steps", "3", "--out", str(out), "--resume"])
    steps = [json.loads(line)["step"] for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_a_copied_run_folder_is_known_by_content_not_by_its_times(tmp_path):
    """ctime in the shortcut costs a copy one hash of each file, nothing more: still the script's."""
    with owned(tmp_path / "a", "run") as folder:
        folder.write("summary.json", "{}")
        folder.append("metrics.jsonl", "{}\n")
    shutil.copytree(tmp_path / "a", tmp_path / "b", copy_function=shutil.copy2)  # mtimes kept, ctimes new
    with owned(tmp_path / "b", "run") as folder:
        assert folder.foreign() == []


@pytest.mark.parametrize("how", ["cut back", "appended to"])
def test_a_file_hard_linked_elsewhere_is_replaced_by_rename_never_written_through(tmp_path, monkeypatch, how):
    """A user's `cp -al` backup shares the run's inodes: before, --resume cut a part-written line in place
    (open and truncate) and appended in place, so the backup's metrics.jsonl changed too."""
    with owned(tmp_path / "run", "run") as folder:
        folder.append("metrics.jsonl", '{"step": 1}\n')
        if how == "cut back":
            cut_short(folder, "metrics.jsonl", '{"step": 2, "loss": 0.5}\n', monkeypatch)
    backup = tmp_path / "backup.jsonl"
    os.link(tmp_path / "run" / "metrics.jsonl", backup)
    kept = backup.read_bytes()
    with owned(tmp_path / "run", "run") as folder:
        folder.remove_temporaries()
        folder.append("metrics.jsonl", '{"step": 2}\n')
        assert folder.foreign() == []
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert backup.read_bytes() == kept and backup.stat().st_nlink == 1
