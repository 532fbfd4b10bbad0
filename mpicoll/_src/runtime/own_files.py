"""Files where other users of the node can reach them: nothing another user prepared is trusted.

The rule (csrc/watch/own_files.h applies it where the extension writes; this
module where Python writes, reads or checks early; docs/security.md states the
threat model; tests/test_shared_node.py holds both to one verdict):

* The shared temporary directory holds one folder per user, <tmp>/mpicoll-<uid>
  (`private_root`), made 0700; everything mpicoll puts there goes inside it.  One
  that exists is used only if it is a real folder (not a link) of this user that
  nobody else can write to (a readable one is closed to 0700), else refused with
  the reason.  Every folder below it is held to the same rule.
* A folder the user names is made 0700 where missing; one that exists, or a link
  at its name, must be this user's or root's.
* A file is written to a fresh temporary name (O_CREAT | O_EXCL | O_NOFOLLOW, mode
  0600) in the opened folder and renamed over its name.
* A file read back (records, the stacks report) is opened without following a link
  and without blocking (a planted FIFO), must be a regular file of the expected
  owner, and is read up to a bound.

This module imports nothing of MPI or JAX: the offline commands
(`python -m mpicoll flight|trace|stacks`) use it on a login node.
"""

import errno
import itertools
import os
import stat
import time


class Refused(OSError):
    """mpicoll will not write or read there; the message says why."""


class UnsafeFolderWarning(UserWarning):
    """This user's folder in the shared temporary directory is not safe: it is not used."""


def private_root(temporary_directory, uid=None):
    """This user's (or `uid`'s) folder in a shared temporary directory."""
    return os.path.join(temporary_directory, f"mpicoll-{os.geteuid() if uid is None else uid}")


def _mode(mode):
    return f"{stat.S_IMODE(mode):04o}"


def _folder_problem(fd, path, private):
    info = os.fstat(fd)
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a folder"
    me = os.geteuid()
    if info.st_uid != me and not (not private and info.st_uid == 0):
        return f"{path} belongs to uid {info.st_uid}, not to this user (uid {me})"
    if private:
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{path} is writable by other users (mode {_mode(info.st_mode)})"
        if info.st_mode & 0o077:
            try:
                os.fchmod(fd, 0o700)
            except OSError as error:
                return (f"{path} is open to other users (mode {_mode(info.st_mode)}) and "
                        f"cannot be closed: {error.strerror}")
    return None


def _open_folder_at(parent, name, path, private, create):
    """The folder `name` in the folder open at `parent` (None: `name` is a path), as a
    descriptor the caller closes; Refused saying why not."""
    try:
        link = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        link = None
    if link is not None and stat.S_ISLNK(link.st_mode):
        if private:
            raise Refused(f"{path} is a link, not a folder")
        if link.st_uid not in (os.geteuid(), 0):
            raise Refused(f"{path} is a link made by uid {link.st_uid}, not by this user")
    if link is None:
        if not create:
            raise Refused(f"{path} does not exist")
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except FileExistsError:
            pass
        except OSError as error:
            raise Refused(f"cannot make {path}: {error.strerror}") from None
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (os.O_NOFOLLOW if private else 0)
    try:
        fd = os.open(name, flags, dir_fd=parent)
    except OSError as error:
        raise Refused(f"{path} is a link, not a folder" if error.errno == errno.ELOOP
                      else f"{path}: {error.strerror}") from None
    try:
        problem = _folder_problem(fd, path, private)
    except OSError as error:
        problem = f"{path}: {error.strerror}"
    if problem:
        os.close(fd)
        raise Refused(problem)
    return fd


def open_folder(path, root=None, create=True):
    """A descriptor of folder `path` to write in, held to the rule: private where `path` is
    `root` (a private_root) or below it, else a folder the user named.  Refused saying why."""
    path = os.path.abspath(path)
    root = None if root is None else os.path.abspath(root)
    inside = root is not None and (path == root or path.startswith(root + os.sep))
    if not inside:
        return _open_folder_at(None, path, path, False, create)
    fd = _open_folder_at(None, root, root, True, create)
    so_far = root
    for part in [p for p in path[len(root):].split(os.sep) if p]:
        so_far = os.path.join(so_far, part)
        try:
            inner = _open_folder_at(fd, part, so_far, True, create)
        finally:
            os.close(fd)
        fd = inner
    return fd


def folder_problem(path, root=None, create=False):
    """Why mpicoll would not write in `path` (None: it would)."""
    try:
        os.close(open_folder(path, root, create))
    except Refused as error:
        return str(error)
    return None


_serial = itertools.count()


def write_file(folder, name, data, root=None):
    """Write `data` (str or bytes) to folder/name: a fresh temporary file, renamed over the
    name; returns the path.  Refused saying why not."""
    fd = open_folder(folder, root, create=True)
    try:
        for _ in range(16):  # a taken name (a shared folder) only costs another try
            partial = f".{name}.{os.getpid()}.{time.time_ns() ^ next(_serial)}.partial"
            try:
                out = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                              | os.O_CLOEXEC, 0o600, dir_fd=fd)
                break
            except FileExistsError:
                continue
        else:
            raise Refused(f"cannot write in {folder}: every temporary name was taken")
        try:
            with os.fdopen(out, "wb") as handle:
                handle.write(data.encode() if isinstance(data, str) else data)
            os.rename(partial, name, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError as error:
            try:
                os.unlink(partial, dir_fd=fd)
            except OSError:
                pass
            raise Refused(f"cannot write {os.path.join(folder, name)}: {error.strerror}") \
                from None
    finally:
        os.close(fd)
    return os.path.join(folder, name)


def read_file(path, limit, owner=None):
    """The bytes of the regular file at `path`, of at most `limit` bytes, whose owner is
    `owner` where given; not through a link, never blocking.  FileNotFoundError where it
    is missing, Refused for anything else wrong."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise  # missing is the caller's to judge (the stacks report not written yet)
    except OSError as error:
        raise Refused(f"{path} is a link, not a file" if error.errno == errno.ELOOP
                      else f"{path}: {error.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Refused(f"{path} is not a regular file")
        if owner is not None and info.st_uid != owner:
            raise Refused(f"{path} belongs to uid {info.st_uid}, not to uid {owner}")
        if info.st_size > limit:
            raise Refused(f"{path} is {info.st_size} bytes, more than the {limit} read")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            raise Refused(f"{path} grew past the {limit} bytes read")
        return b"".join(chunks)
    finally:
        os.close(fd)
