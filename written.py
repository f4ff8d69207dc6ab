"""What a script wrote, known by identity: the one rule for every file that train.py, eval.py, experiments.py,
merge.py, data/prepare.py, the plots and the model cache write.

A folder a script writes holds a record of what it wrote there (RECORD). Before a script creates, replaces,
appends to or removes a file, the record says which states the file may be in once that is done; the script
touches a file only where the record names it and the file is in one of those states. Anything else stops it
with `NotWritten`, one line naming the path, with or without --overwrite: a user's file that carries a run
file's name, a file changed since, a symlink, a folder that holds files and no record. Nothing is written
through a symlink (O_NOFOLLOW, O_EXCL), and no file but a script's own is opened for writing.

A file's identity is its size and its sha256, a folder's those of every file in it: content, not a name or
an inode, so that a run folder copied or checked out elsewhere is still known (experiments.py's logs are
committed). Like git's index, the record also keeps each file's inode and mtime, so a file that kept both is
not read again (a checkpoint's weights are hashed once, when written).

A change is recorded before it is made, as the states the file may be in after it, so a script killed at any
moment leaves a record that still knows its files; a temporary file is recorded by its random name before it
is made, and is known by that name alone until it is whole.

Each folder holds one kind of thing (KINDS) and is written by the scripts that kind names: a folder of another
kind is refused (eval.py's --out at a run folder, say).
"""

import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import re
import secrets
import shutil
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
    "model-cache": "the converted models of model_files.py (GROUP_RL_CACHE)",
    "merged": "merge.py's models, LoRA adapters merged into their base",
}
ANY_FILE, ANY_DIR = "any file", "any folder"  # a temporary being written: known by its reserved name alone
TEMPORARY = re.compile(r"\.[0-9a-f]{8}\.tmp\Z")  # the names `Folder.fresh` makes


class NotWritten(Exception):
    """A path this script may not touch (not its own, changed since, a symlink) or may not use now (in use):
    the message is the one line to print."""


def _file_state(path: Path, st: os.stat_result, known: list) -> list:
    """[size, sha256, inode, mtime_ns]; the sha256 from `known` where size, inode and mtime are unchanged."""
    for then in known:
        if then[0] == st.st_size and then[2:] == [st.st_ino, st.st_mtime_ns]:
            return then
    return [st.st_size, sha256(path), st.st_ino, st.st_mtime_ns]


def sha256(path: Path) -> str:
    """The file's content hash, its identity here and the model cache's key."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def state(path: Path, accepted: list = ()) -> dict | str | None:
    """What is at `path` now: None (nothing), {"file": [size, sha256, inode, mtime]}, {"dir": {relative path:
    the same}} or "other" (a symlink, a device, a folder holding one). `accepted` lends its hashes."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISREG(st.st_mode):
        return {"file": _file_state(path, st, [s["file"] for s in accepted if isinstance(s, dict)
                                                and "file" in s])}
    if not stat.S_ISDIR(st.st_mode):
        return "other"
    known = [s["dir"] for s in accepted if isinstance(s, dict) and "dir" in s]
    tree = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            entry = Path(root, name)
            entry_st = os.lstat(entry)
            if stat.S_ISDIR(entry_st.st_mode):
                continue
            if not stat.S_ISREG(entry_st.st_mode):
                return "other"
            rel = str(entry.relative_to(path))
            tree[rel] = _file_state(entry, entry_st, [k[rel] for k in known if rel in k])
    return {"dir": tree}


def same(now, then) -> bool:
    """Whether state `now` is the recorded state `then` (the content: size and hash)."""
    if then == ANY_FILE or then == ANY_DIR:
        return isinstance(now, dict) and ("file" if then == ANY_FILE else "dir") in now
    if now is None or then is None or now == "other":
        return now is then
    if "file" in then:
        return "file" in now and now["file"][:2] == then["file"][:2]
    return ("dir" in now and now["dir"].keys() == then["dir"].keys()
            and all(now["dir"][rel][:2] == then["dir"][rel][:2] for rel in then["dir"]))


def describe(path: Path, now) -> str:
    return "a symlink" if path.is_symlink() else "not a plain file or folder" if now == "other" else "changed"


class Folder:
    """A folder a script writes, and its record: open one with `owned` (or `Folder.subfolder` inside one)."""

    def __init__(self, path: Path, kind: str):
        self.path, self.kind = Path(path), kind
        record = self.path / RECORD
        if record.is_symlink() or record.exists() and not record.is_file():
            raise NotWritten(f"{record} is not a record this project wrote: move it, or choose another "
                             "folder")
        if not record.exists():
            if names := sorted(p.name for p in self.path.iterdir()):
                raise NotWritten(f"{self.path} holds files and no record of what a script wrote there "
                                 f"({', '.join(names[:3])}{', ...' if names[3:] else ''}): move them, or "
                                 "choose another folder")
            self.files: dict[str, list] = {}
            self.record_tmp = self.fresh(RECORD)
            self.save()
            return
        try:
            saved = json.loads(record.read_text())
            self.files = saved["files"]
            written_kind = saved["kind"]
            self.record_tmp = saved.get("tmp") or self.fresh(RECORD)  # absent in records before Dec 2026
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise NotWritten(f"{record} is damaged: restore it, or choose another folder") from None
        if written_kind != kind:
            raise NotWritten(f"{self.path} holds {KINDS.get(written_kind, written_kind)}, not "
                             f"{KINDS[kind]}: choose another folder")
        left = self.path / self.record_tmp  # a record part-written when its writer was killed
        if left.is_file() and not left.is_symlink():
            left.unlink()

    def save(self) -> None:
        """The record, whole: written to the temporary named in the record itself ("tmp"), then renamed into
        place, so that one part-written when its writer was killed is known by name. Names removed as planned
        are dropped."""
        self.files = {name: states for name, states in self.files.items()
                      if not (states[-1] is None and not os.path.lexists(self.path / name))}
        tmp = self.path / self.record_tmp
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump({"kind": self.kind, "pid": os.getpid(), "tmp": self.record_tmp, "files": self.files}, f)
        os.replace(tmp, self.path / RECORD)

    def now(self, name: str):
        """The state of `name` now, if it is this folder's (recorded, and in a recorded state); else
        NotWritten. Nothing there (never written, or removed since) is None: this folder's to create."""
        path, states = self.path / name, self.files.get(name, [None])
        if (now := state(path, states)) is None:
            return None
        for i, then in enumerate(states):
            if isinstance(then, dict) and same(now, then):
                states[i] = now  # the same content, maybe under a new inode or mtime (a copy): not read again
        if not any(same(now, then) for then in states):
            whose = (describe(path, now) + " since a script wrote it" if name in self.files
                     else "not written here")
            raise NotWritten(f"{path} is {whose}: it is left as it is; move it, or choose another folder")
        return now

    def ours(self, name: str) -> bool:
        try:
            return self.now(name) is not None
        except NotWritten:
            return False

    def foreign(self) -> list[str]:
        """The names here that are not this folder's (a subfolder with a record of its own is), sorted."""
        return sorted(p.name for p in self.path.iterdir()
                      if p.name not in (RECORD, self.record_tmp) and not self.ours(p.name)
                      and not (p.is_dir() and not p.is_symlink() and (p / RECORD).is_file()))

    def expect(self, name: str, now, after) -> None:
        """Record, before the change is made, the states `name` may then be in: `now` or `after`."""
        self.files[name] = [now, after]
        self.save()

    def fresh(self, name: str) -> str:
        """A random name beside `name` that nothing here has: `name`.<8 hex>.tmp."""
        return next(t for t in (f"{name}.{secrets.token_hex(4)}.tmp" for _ in itertools.count())
                    if not os.path.lexists(self.path / t))

    def reserve(self, name: str, kind: str = ANY_FILE) -> Path:
        """A fresh temporary beside `name`, recorded by its random name before it is made."""
        tmp = self.fresh(name)
        self.expect(tmp, None, kind)
        return self.path / tmp

    def remove_temporaries(self) -> None:
        """What a write stopped part-way left: the temporaries recorded by name, whole or not (a kill just
        before the rename that puts one in place)."""
        for name in [name for name in self.files if TEMPORARY.search(name)]:
            self.remove(name)

    def write(self, name: str, data: str | bytes) -> Path:
        """`name` whole, or left as it was: a reserved temporary, then renamed into place."""
        self.now(name)
        tmp = self.reserve(name)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(data.encode() if isinstance(data, str) else data)
            return self.rename(tmp.name, name)
        except Exception:  # a full disk: the temporary goes, `name` stays as it was
            self.remove(tmp.name)
            raise

    def append(self, name: str, text: str) -> None:
        """`text` at the end of `name` (made if absent), recorded first as the file it will then be."""
        now, data = self.now(name), text.encode()
        digest = hashlib.sha256((self.path / name).read_bytes() if now else b"")
        digest.update(data)
        size = (now["file"][0] if now else 0) + len(data)
        self.expect(name, now, {"file": [size, digest.hexdigest(), 0, 0]})  # inode, mtime unknown: hashed
        flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | (0 if now else os.O_CREAT | os.O_EXCL)
        with os.fdopen(os.open(self.path / name, flags, 0o644), "wb") as f:
            f.write(data)

    def remove(self, name: str) -> None:
        """`name`, a file or a folder, if it is this folder's; nothing if it is not there."""
        if (now := self.now(name)) is None:
            return
        if "dir" in now:  # renamed away first: a folder removed part-way is a temporary, not a changed one
            self.files[name] = [now, None]
            gone = self.reserve(name, ANY_DIR)
            os.rename(self.path / name, gone)
            shutil.rmtree(gone)
            self.files[gone.name] = [None]
        else:
            self.expect(name, now, None)
            (self.path / name).unlink()
        self.save()

    def rename(self, src: str, dst: str) -> Path:
        """`src` to `dst` (which is absent, or a file of this folder's)."""
        moved, replaced = self.now(src), self.now(dst)
        if replaced is not None and "dir" in replaced:
            raise NotWritten(f"{self.path / dst} is a folder: remove it before renaming {src} to it")
        self.files[src] = [moved, None]
        self.expect(dst, replaced, moved)
        os.replace(self.path / src, self.path / dst)
        self.files[dst] = [moved]
        self.save()
        return self.path / dst

    @contextlib.contextmanager
    def filling(self, name: str):
        """A new folder to fill, reserved beside `name`; once filled, its tree is recorded and it is renamed
        to `name` (which must be absent). A failure part-way removes what was filled."""
        tmp = self.reserve(name, ANY_DIR)
        tmp.mkdir()
        try:
            yield tmp
            self.files[tmp.name] = [ANY_DIR, self.now(tmp.name)]  # the tree as filled: hashed once, here
            self.rename(tmp.name, name)
        except BaseException:
            self.remove(tmp.name)
            raise

    def clear(self, keep: tuple = ()) -> None:
        """Remove everything recorded here but `keep`, after checking that all of it is still this folder's:
        one changed file and nothing is removed."""
        names = [name for name in self.files if name not in keep]
        for name in names:
            self.now(name)
        for name in names:
            self.remove(name)

    def subfolder(self, name: str, kind: str) -> "Folder":
        """A folder inside this one, with its own record (made when absent); covered by this one's lock."""
        path = self.path / name
        if path.is_symlink() or path.exists() and not path.is_dir():
            raise NotWritten(f"{path} is {'a symlink' if path.is_symlink() else 'a file'}, not a folder a "
                             "script wrote: it is left as it is; move it, or choose another folder")
        path.mkdir(exist_ok=True)
        return Folder(path, kind)


@contextlib.contextmanager
def owned(path: Path, kind: str, wait: bool = False):
    """The folder at `path` (made if absent) with its record, owned by this process alone while inside: an
    exclusive lock on the folder itself (flock, released however the process ends). Another owner means
    NotWritten naming its process, or, with `wait`, waiting for it (the model cache's conversions)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:  # a file where the folder should be, a read-only place
        raise NotWritten(f"{path}: not a folder this script can write ({e.strerror}): choose another "
                         "folder") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise NotWritten(f"{path} is in use by process {recorded_pid(path)} (another run): wait for it "
                             "to end, or choose another folder") from None
        folder = Folder(path, kind)
        with contextlib.suppress(OSError):  # a read-only folder may still be read, its owner then unnamed
            folder.save()  # its process id, for the line another owner prints
        yield folder
    finally:
        os.close(fd)


def recorded_pid(path: Path) -> str:
    """The process that owns the folder at `path` (the last to write its record), or '?'."""
    try:
        return str(json.loads((path / RECORD).read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return "?"
