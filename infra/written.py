"""What a script wrote, known by identity: the one rule for every file that train.py, eval.py, experiments.py,
merge.py, data/prepare.py, the plots and the model cache write.

A folder a script writes holds a record of what it wrote there (RECORD). Before a script creates, replaces,
appends to or removes a file, the record says which states the file may be in once that is done; the script
touches a file only where the record names it and the file is in one of those states. Anything else stops it
with `NotWritten`, one line naming the path, with or without --overwrite: a user's file that carries a run
file's name, a file changed since, a symlink, a folder that holds files and no record. Nothing is written
through a symlink (O_NOFOLLOW, O_EXCL), and no file but a script's own is opened for writing.

A file's identity is its content (infra/records.py): a run folder copied or checked out elsewhere is still
known (experiments.py's logs are committed), and a file whose inode, mtime and ctime held is not read again.

A change is recorded before it is made, as the states the file may be in after it, so a script killed at any
moment leaves a record that still knows its files. A temporary is recorded by its random name before it is
made, and by its inode once made: a leftover is removed only while it is still that inode (or still empty),
never because a record names it. An append records the text it adds, so that a line cut short (a full disk,
a kill) is known as the script's own and cut back (`remove_temporaries`).

The record is a stranger's input (infra/records.py): a damaged one is refused in one line before anything is
touched. Every change goes through the folder's open descriptor (`dir_fd`), so a folder moved, or swapped for
a symlink, while a script runs cannot redirect a write. A refusal writes nothing: a folder's record is first
written by its first change.

Each folder holds one kind of thing (KINDS) and is written by the scripts that kind names: a folder of another
kind is refused (eval.py's --out at a run folder, say).
"""

import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import secrets
import shutil
import stat
import weakref
from pathlib import Path

from infra.records import (ANY_DIR, ANY_FILE, KINDS, RECORD, TEMPORARY, Damaged, checked_record, describe,
                           file_state, kind_of, same, sha256, temporary)


class NotWritten(Exception):
    """A path this script may not touch (not its own, changed since, a symlink) or may not use now (in use):
    the message is the one line to print."""


class Folder:
    """A folder a script writes, and its record: open one with `owned` (or `Folder.subfolder` inside one).
    Every change goes through `fd`, the folder held open; `at` is that descriptor as a path, for what a
    library fills (`filling`); `path` is the folder's name, for messages and reading."""

    def __init__(self, path: Path, kind: str, fd: int):
        self.path, self.kind, self.fd = Path(path), kind, fd
        here = Path(f"/proc/{os.getpid()}/fd")  # not /proc/self: a child it starts (pip) reads it too (Linux)
        self.at = here / str(fd) if here.is_dir() else self.path
        st = self.lstat(RECORD)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise NotWritten(f"{self.path / RECORD} is not a record this project wrote: move it, or choose "
                             "another folder")
        if st is None:
            if names := sorted(os.listdir(fd)):
                raise NotWritten(f"{self.path} holds files and no record of what a script wrote there "
                                 f"({', '.join(names[:3])}{', ...' if names[3:] else ''}): move them, or "
                                 "choose another folder")
            self.files: dict[str, list] = {}
            self.record_tmp = self.fresh(RECORD)
            return
        try:
            if st.st_size > 2**30:
                raise Damaged("over 1 GiB")
            with self.open(RECORD, os.O_RDONLY) as f:
                written_kind, tmp, self.files = checked_record(json.load(f))
        except (ValueError, RecursionError, Damaged) as e:  # ValueError: bad JSON, UTF-8, an over-long int
            why = f" ({e})" if isinstance(e, Damaged) else ""
            raise NotWritten(f"{self.path / RECORD} is damaged{why}: restore it, or choose another "
                             "folder") from None
        self.record_tmp = tmp or self.fresh(RECORD)  # absent in records before Dec 2026
        if written_kind != kind:
            raise NotWritten(f"{self.path} holds {KINDS[written_kind]}, not {KINDS[kind]}: choose another "
                             "folder")
        self.files = {name: states for name, states in self.files.items()  # temporaries gone since
                      if not (TEMPORARY.search(name) and self.lstat(name) is None)}

    # ------------------------------------------------------------------ the folder, through its descriptor
    def lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def open(self, name: str, flags: int):
        """A file of this folder, never through a symlink, as a binary file object."""
        fd = os.open(name, flags | os.O_NOFOLLOW, 0o644, dir_fd=self.fd)
        return os.fdopen(fd, "rb" if flags == os.O_RDONLY else "ab" if flags & os.O_APPEND else "wb")

    def state(self, name: str, accepted: list = ()) -> dict | str | None:
        """What is at `name` now: None (nothing), {"file": [size, sha256, inode, mtime, ctime]}, {"dir":
        {relative path: the same}} or "other" (a symlink, a device, a folder holding one). `accepted` lends
        its hashes."""
        if (st := self.lstat(name)) is None:
            return None
        if stat.S_ISREG(st.st_mode):
            with self.open(name, os.O_RDONLY) as f:
                return {"file": file_state(f, st, [s["file"] for s in accepted if isinstance(s, dict)
                                                    and "file" in s])}
        if not stat.S_ISDIR(st.st_mode):
            return "other"
        known = [s["dir"] for s in accepted if isinstance(s, dict) and "dir" in s]
        tree = {}
        try:
            for root, dirs, files, root_fd in os.fwalk(name, dir_fd=self.fd):
                for entry in dirs + files:
                    entry_st = os.stat(entry, dir_fd=root_fd, follow_symlinks=False)
                    if stat.S_ISDIR(entry_st.st_mode):
                        continue
                    if not stat.S_ISREG(entry_st.st_mode):
                        return "other"
                    rel = os.path.relpath(os.path.join(root, entry), name)
                    with os.fdopen(os.open(entry, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=root_fd), "rb") as f:
                        tree[rel] = file_state(f, entry_st, [k[rel] for k in known if rel in k])
        except RecursionError:  # a tree deeper than Python's stack (os.fwalk recurses): no script made it
            return "other"
        return {"dir": tree}

    def save(self) -> None:
        """The record, whole: written to the temporary named in the record itself ("tmp"), then renamed into
        place, so that one part-written when its writer was killed is known by name. Names removed as planned
        are dropped."""
        self.files = {name: states for name, states in self.files.items()
                      if not (states[-1] is None and self.lstat(name) is None)}
        if (left := self.lstat(self.record_tmp)) and stat.S_ISREG(left.st_mode):  # its writer was killed
            os.unlink(self.record_tmp, dir_fd=self.fd)
        with self.open(self.record_tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL) as f:
            f.write(json.dumps({"kind": self.kind, "tmp": self.record_tmp, "files": self.files}).encode())
        os.replace(self.record_tmp, RECORD, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    # ------------------------------------------------------------------ whose a file is
    def now(self, name: str):
        """The state of `name` now, if it is this folder's (recorded, and in a recorded state); else
        NotWritten. Nothing there (never written, or removed since) is None: this folder's to create. A
        temporary is known by its inode (or, before it was made, by being empty), not read."""
        path, states = self.path / name, self.files.get(name, [None])
        if (st := self.lstat(name)) is None:
            return None
        for then in filter(temporary, states):
            if kind_of(st) == then["temporary"] and (st.st_ino == then["inode"]
                                                     or then["inode"] == 0 and self.empty(name, st)):
                return then
        now = self.state(name, [then for then in states if not temporary(then)])
        for i, then in enumerate(states):
            if isinstance(then, dict) and same(now, then):
                states[i] = now | {k: then[k] for k in ("appended", "onto") if k in then}  # not read again
        if any(same(now, then) for then in states):
            return now
        if (partial := self.partial_append(name, now, states)) is not None:
            return partial
        whose = describe(st, now) + " since a script wrote it" if name in self.files else "not written here"
        raise NotWritten(f"{path} is {whose}: it is left as it is; move it, or choose another folder")

    def empty(self, name: str, st: os.stat_result) -> bool:
        if stat.S_ISREG(st.st_mode):
            return st.st_size == 0
        with self.inside(name) as fd:
            return not os.listdir(fd)

    @contextlib.contextmanager
    def inside(self, name: str):
        """The folder `name` of this one, open (never through a symlink) while inside."""
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=self.fd)
        try:
            yield fd
        finally:
            os.close(fd)

    def partial_append(self, name: str, now, states: list) -> dict | None:
        """{"file": ..., "cut": size} when `name` is the file as it was before the last recorded append plus
        a part of the appended text (the script's own write, stopped by a full disk or a kill); else None."""
        for then in [then for then in states if isinstance(then, dict) and "appended" in then]:
            if not isinstance(now, dict) or "file" not in now:
                return None
            size, digest = then["onto"][:2]
            with self.open(name, os.O_RDONLY) as f:
                data = f.read(then["file"][0])
            head, tail = data[:size], data[size:]
            if (size < len(data) < then["file"][0] and hashlib.sha256(head).hexdigest() == digest
                    and then["appended"].encode().startswith(tail)):
                return now | {"cut": size}
        return None

    def ours(self, name: str) -> bool:
        try:
            return self.now(name) is not None
        except NotWritten:
            return False

    def foreign(self) -> list[str]:
        """The names here that are not this folder's (a subfolder with a record of its own is), sorted."""
        return sorted(name for name in os.listdir(self.fd)
                      if name not in (RECORD, self.record_tmp) and not self.ours(name)
                      and not self.holds_record(name))

    def holds_record(self, name: str) -> bool:
        with contextlib.suppress(OSError), self.inside(name) as fd:
            return stat.S_ISREG(os.stat(RECORD, dir_fd=fd, follow_symlinks=False).st_mode)
        return False

    # ------------------------------------------------------------------ changes, each recorded first
    def expect(self, name: str, now, after) -> None:
        """Record, before the change is made, the states `name` may then be in: `now` or `after`."""
        self.files[name] = [now, after]
        self.save()

    def fresh(self, name: str) -> str:
        """A random name beside `name` that nothing here has: `name`.<8 hex>.tmp."""
        return next(t for t in (f"{name}.{secrets.token_hex(4)}.tmp" for _ in itertools.count())
                    if self.lstat(t) is None)

    def reserve(self, name: str, kind: str = ANY_FILE) -> Path:
        """A fresh temporary beside `name`, empty, made here: recorded by its random name before it is made,
        then by its inode. Returns it as a path through the folder's descriptor."""
        tmp = self.fresh(name)
        self.expect(tmp, None, {"temporary": kind, "inode": 0})
        if kind == ANY_DIR:
            os.mkdir(tmp, dir_fd=self.fd)
        else:
            self.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL).close()
        self.expect(tmp, None, {"temporary": kind, "inode": self.lstat(tmp).st_ino})
        return self.at / tmp

    def remove_temporaries(self) -> None:
        """What a write stopped part-way left: the temporaries recorded here, whole or not (a kill just before
        the rename that puts one in place), and the part of a line that an append left (cut back)."""
        for name in [name for name in self.files if TEMPORARY.search(name)]:
            self.remove(name)
        for name in list(self.files):
            with contextlib.suppress(NotWritten):
                if (now := self.now(name)) is not None and "cut" in now:
                    self.rewrite(name, now["cut"])  # a part-written append undone

    def rewrite(self, name: str, size: int | None = None) -> dict:
        """`name`'s first `size` bytes (all: None) put in place by rename, never written in place: a hard link
        to it (a user's `cp -al` backup) keeps its bytes. Returns its state."""
        with self.open(name, os.O_RDONLY) as f:
            self.write(name, f.read(size))
        return self.now(name)

    def write(self, name: str, data: str | bytes) -> Path:
        """`name` whole, or left as it was: a reserved temporary, then renamed into place."""
        self.now(name)
        tmp = self.reserve(name).name
        try:
            with self.open(tmp, os.O_WRONLY) as f:
                f.write(data.encode() if isinstance(data, str) else data)
            return self.rename(tmp, name)
        except Exception as e:  # a full disk: the temporary goes, `name` stays as it was
            self.remove(tmp)
            if isinstance(e, OSError) and e.filename is None:  # the write's own (ENOSPC, EFBIG) names none
                e.filename = str(self.path / name)
            raise

    def append(self, name: str, text: str) -> None:
        """`text` at the end of `name` (made if absent), recorded first as the file it will then be, with the
        text itself: a part of it left by a failed write is known as this script's (`partial_append`)."""
        now, data = self.now(name), text.encode()
        if now is not None and ("cut" in now or self.lstat(name).st_nlink > 1):  # a hard link: a copy of ours
            now = self.rewrite(name, now.get("cut"))
        before = [now["file"][0], now["file"][1]] if now else [0, hashlib.sha256(b"").hexdigest()]
        digest = hashlib.sha256()
        if now:
            with self.open(name, os.O_RDONLY) as f:
                digest = hashlib.file_digest(f, "sha256")
        digest.update(data)
        after = {"file": [before[0] + len(data), digest.hexdigest(), 0, 0, 0],  # inode, times unknown: hashed
                 "appended": text, "onto": before + [0, 0, 0]}
        self.expect(name, now, after)
        flags = os.O_WRONLY | os.O_APPEND | (0 if now else os.O_CREAT | os.O_EXCL)
        with self.open(name, flags) as f:
            f.write(data)

    def remove(self, name: str) -> None:
        """`name`, a file or a folder, if it is this folder's; nothing if it is not there."""
        if (now := self.now(name)) is None:
            return
        st = self.lstat(name)
        if stat.S_ISDIR(st.st_mode):  # renamed away first: a folder removed part-way is a temporary
            gone = self.fresh(name)
            self.files[name] = [now, None]
            self.expect(gone, None, {"temporary": ANY_DIR, "inode": st.st_ino})
            os.rename(name, gone, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            shutil.rmtree(gone, dir_fd=self.fd)
            self.files[gone] = [None]
        else:
            self.expect(name, now, None)
            os.unlink(name, dir_fd=self.fd)
        self.save()

    def rename(self, src: str, dst: str) -> Path:
        """`src` to `dst` (which is absent, or a file of this folder's)."""
        moved, replaced = self.now(src), self.now(dst)
        if replaced is not None and stat.S_ISDIR(self.lstat(dst).st_mode):
            raise NotWritten(f"{self.path / dst} is a folder: remove it before renaming {src} to it")
        if temporary(moved):  # a filled temporary: known by its content from now on
            moved = self.state(src)
        self.files[src] = [moved, None]
        self.expect(dst, replaced, moved)
        os.replace(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        if "file" in moved:  # a rename moves a file's ctime: the shortcut keeps the hash it has
            st = self.lstat(dst)
            moved = {"file": moved["file"][:2] + [st.st_ino, st.st_mtime_ns, st.st_ctime_ns]}
        self.files[dst] = [moved]
        self.save()
        return self.path / dst

    @contextlib.contextmanager
    def filling(self, name: str):
        """A new folder to fill, reserved beside `name` (a path through the folder's descriptor); once
        filled, its tree is recorded and it is renamed to `name` (which must be absent). A failure part-way
        removes what was filled."""
        tmp = self.reserve(name, ANY_DIR)
        try:
            yield tmp
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
        """A folder inside this one, with its own record (made when absent), held open by its own
        descriptor; covered by this one's lock."""
        path = self.path / name
        st = self.lstat(name)
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise NotWritten(f"{path} is {'a symlink' if stat.S_ISLNK(st.st_mode) else 'a file'}, not a "
                             "folder a script wrote: it is left as it is; move it, or choose another folder")
        if st is None:
            self.save()  # a change here: this folder's record first, so that a folder of runs is known
            os.mkdir(name, dir_fd=self.fd)
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=self.fd)
        folder = Folder(path, kind, fd)
        weakref.finalize(folder, os.close, folder.fd)
        if st is None:
            folder.save()  # made here: known as a script's, whatever writes in it next (train.py's runs)
        return folder


@contextlib.contextmanager
def owned(path: Path, kind: str, wait: bool = False):
    """The folder at `path` (made if absent) with its record, owned by this process alone while inside: an
    exclusive lock on the folder itself (flock, released however the process ends). Another owner means
    NotWritten naming its process, or, with `wait`, waiting for it (the model cache's conversions). A
    folder made here and left without a record (a refusal) is removed again."""
    path = Path(path)
    made = [p for p in [path, *path.parents] if not os.path.lexists(p)]
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:  # a file where the folder should be, a read-only place
        raise NotWritten(f"{path}: not a folder this script can write ({e.strerror}): choose another "
                         "folder") from None
    folder = None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise NotWritten(f"{path} is in use by process {owner(fd)} (another run): wait for it to end, "
                             "or choose another folder") from None
        folder = Folder(path, kind, fd)
        yield folder
    finally:
        if folder is not None:
            folder.fd, folder.at = -1, None  # the descriptor closes here: a Folder kept past it writes none
        os.close(fd)
        if made and not (path / RECORD).exists():
            for p in made:
                with contextlib.suppress(OSError):  # one that now holds something is the user's, or another's
                    p.rmdir()


def owner(fd: int) -> str:
    """The process holding the lock on the folder open at `fd`, from /proc/locks (Linux), or '?'."""
    st = os.fstat(fd)
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with contextlib.suppress(OSError):
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()  # "1: FLOCK ADVISORY WRITE <pid> <major:minor:inode> 0 EOF"; "->": a waiter
            if fields[1:2] == ["FLOCK"] and fields[-3] == where:
                return fields[-4]
    return "?"
