"""What a folder's record (infra/written.py's RECORD) may say, read as input from a stranger: run folders are
shared, committed and downloaded. Like git, which refuses a tree entry named `..` however the tree got to
it, a record whose names are not plain names inside its folder (`..`, absolute, a separator, NUL, a
newline), or whose shape is not the one infra/written.py writes, is damaged (`checked_record`), and nothing in
it is acted on.

Also here, what the record says of a file: its identity, [size, sha256, inode, mtime_ns, ctime_ns], the
content first (`same`) and the rest a shortcut, taken as git's index takes it (`file_state`).
"""

import hashlib
import os
import re
import stat
from pathlib import Path

RECORD = ".written.json"
KINDS = {  # what a folder holds: which scripts write it
    "runs": "train.py's runs (--out: a folder per algorithm and curves.png; experiments.py adds "
            "machines.jsonl and final_eval.jsonl)",
    "run": "a run of train.py (its logs, checkpoint/, summary.json)",
    "eval": "eval.py's results",
    "experiments": "experiments.py's runs, results.json and figures",
    "downloads": "data/prepare.py's downloads",
    "model-cache": "the converted models of infra/model_files.py (GROUP_RL_CACHE)",
    "merged": "merge.py's models, LoRA adapters merged into their base",
}
ANY_FILE, ANY_DIR = "any file", "any folder"  # a temporary's kind: known by its name and its inode
TEMPORARY = re.compile(r"\.[0-9a-f]{8}\.tmp\Z")  # the names `Folder.fresh` makes
RECORD_TMP = re.compile(re.escape(RECORD) + TEMPORARY.pattern)
HEX64 = re.compile(r"[0-9a-f]{64}\Z")


class Damaged(ValueError):
    """A record that infra/written.py did not write: what is wrong with it."""


def plain_name(name, separators: bool = False) -> bool:
    """A name that stays inside its folder: not empty, '.' or '..', no NUL or newline, not absolute, and no
    separator unless `separators` (a file's path inside a recorded folder), each part plain then too."""
    if not isinstance(name, str) or not name or "\0" in name or "\n" in name:
        return False
    parts = name.split("/") if separators else [name]
    return all(part and part not in (".", "..") and "/" not in part for part in parts)


def checked_file(entry) -> list:
    """[size, sha256, inode, mtime_ns, ctime_ns]; records before Dec 2026 have no ctime, and are hashed."""
    if (isinstance(entry, list) and len(entry) in (4, 5) and isinstance(entry[1], str)
            and HEX64.match(entry[1])
            and all(type(n) is int and n >= 0 for n in entry[:1] + entry[2:])):
        return entry
    raise Damaged(f"a file entry {str(entry)[:60]}")


def checked_state(then):
    """A recorded state as infra/written.py writes it, or Damaged. The plain strings of records before Dec
    2026 (a temporary known by name alone) become a temporary known to be empty."""
    if then in (ANY_FILE, ANY_DIR):
        return {"temporary": then, "inode": 0}
    if then is None:
        return None
    if isinstance(then, dict) and then.keys() == {"temporary", "inode"} and then["temporary"] in (
            ANY_FILE, ANY_DIR) and type(then["inode"]) is int and then["inode"] >= 0:
        return then
    if isinstance(then, dict) and set(then) in ({"file"}, {"file", "appended", "onto"}):
        checked_file(then["file"])
        if "appended" in then and not (isinstance(then["appended"], str) and checked_file(then["onto"])):
            raise Damaged("an append's entry")
        return then
    if isinstance(then, dict) and then.keys() == {"dir"} and isinstance(then["dir"], dict):
        for rel, entry in then["dir"].items():
            if not plain_name(rel, separators=True):
                raise Damaged(f"the name {rel!r} inside a folder")
            checked_file(entry)
        return then
    raise Damaged(f"a state {str(then)[:60]}")


def checked_record(saved) -> tuple[str, str, dict]:
    """(kind, tmp, files) of a record as infra/written.py writes it; Damaged names the first thing that is
    not."""
    fields = saved.keys() if isinstance(saved, dict) else set()
    if not {"kind", "files"} <= fields <= {"kind", "files", "tmp", "pid"}:  # pid: records before Dec 2026
        raise Damaged("not a record's fields")
    if not isinstance(saved["kind"], str) or saved["kind"] not in KINDS:  # a list or dict: unhashable
        raise Damaged("not a record's kind")
    if not isinstance(saved["files"], dict):
        raise Damaged("not a record's files")
    tmp = saved.get("tmp")
    if tmp is not None and not (isinstance(tmp, str) and RECORD_TMP.match(tmp)):
        raise Damaged(f"the temporary {str(tmp)[:60]!r}")
    files = {}
    for name, states in saved["files"].items():
        if not plain_name(name) or name == RECORD:
            raise Damaged(f"the name {name[:60]!r}, not a plain name inside the folder")
        if not isinstance(states, list) or not states:
            raise Damaged(f"the states of {name!r}")
        files[name] = [checked_state(then) for then in states]
    return saved["kind"], tmp, files


def temporary(then) -> bool:
    return isinstance(then, dict) and "temporary" in then


def file_state(f, st: os.stat_result, known: list) -> list:
    """[size, sha256, inode, mtime_ns, ctime_ns] of the open file `f`; the sha256 from `known` where size,
    inode, mtime and ctime are unchanged (git's index: an edit with its mtime put back changes the ctime)."""
    for then in known:
        if then[0] == st.st_size and then[2:] == [st.st_ino, st.st_mtime_ns, st.st_ctime_ns]:
            return then
    return [st.st_size, hashlib.file_digest(f, "sha256").hexdigest(), st.st_ino, st.st_mtime_ns,
            st.st_ctime_ns]


def kind_of(st: os.stat_result) -> str | None:
    """The kind of temporary a file or folder could be."""
    return ANY_FILE if stat.S_ISREG(st.st_mode) else ANY_DIR if stat.S_ISDIR(st.st_mode) else None


def sha256(path: Path) -> str:
    """The file's content hash, its identity here and the model cache's key."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def same(now, then) -> bool:
    """Whether state `now` is the recorded state `then` (the content: size and hash)."""
    if now is None or then is None or now == "other" or temporary(then):
        return now is then
    if "file" in then:
        return "file" in now and now["file"][:2] == then["file"][:2]
    return ("dir" in now and now["dir"].keys() == then["dir"].keys()
            and all(now["dir"][rel][:2] == then["dir"][rel][:2] for rel in then["dir"]))


def describe(st: os.stat_result, now) -> str:
    return ("a symlink" if stat.S_ISLNK(st.st_mode) else "not a plain file or folder" if now == "other"
            else "changed")


def plain_bytes(path: Path, limit: int) -> bytes | None:
    """The bytes of `path` where it is a plain file (not a symlink) of at most `limit` bytes, else None.
    Opened without blocking (a FIFO would wait for a writer) and without following a link, checked by its
    open descriptor, and read no further than `limit` (a device never ends)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = f.read(limit + 1)
        return data if len(data) <= limit else None
