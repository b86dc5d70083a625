"""The paths a user names, read and written safely: only regular files are read, their size checked
before the first byte; a write goes to a new file beside its target and replaces it only once complete,
so a full disk or an interrupted run keeps the earlier file."""

from __future__ import annotations

import json
import os
import secrets
import stat
import uuid
from pathlib import Path
from typing import BinaryIO, Callable

MANIFEST_MAX_BYTES = 1 << 20  # netgain's own JSON files (markers, manifests) are far smaller
RUN_MARKER = "netgain-run.json"  # in an output folder: the id of the run that writes there


class WriteError(OSError):
    """A write that did not happen, said in one line; what the path held before is unchanged."""


def machine_memory_bytes() -> int:
    """This machine's physical memory: more than this can never be read into it."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def require_regular_file(path: str | Path, flag: str, max_bytes: int | None) -> int:
    """The size of `path`, a regular file of at most `max_bytes` (None: read in chunks, any size); else a
    ValueError naming `flag`. Checked with stat, before any open: opening a FIFO blocks until a writer comes,
    and /dev/zero never ends."""
    try:
        info = os.stat(path)
    except OSError as error:
        raise ValueError(f"{flag} {path}: {error.strerror or error}") from error
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{flag} {path} is {_kind(info.st_mode)}, not a regular file")
    if max_bytes is not None and info.st_size > max_bytes:
        raise ValueError(f"{flag} {path} is {in_bytes(info.st_size)}, more than the {in_bytes(max_bytes)} "
                         f"netgain reads for {flag}")
    return info.st_size


def _kind(mode: int) -> str:
    kinds = {stat.S_ISDIR: "a folder", stat.S_ISFIFO: "a FIFO (named pipe)", stat.S_ISCHR: "a character device",
             stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket"}
    return next((name for test, name in kinds.items() if test(mode)), "not a file")


def in_bytes(count: float) -> str:
    """1234567 -> '1.23 MB'; 5e17 -> '500,000 TB'."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            value = count / size
            return f"{value:,.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"
    return f"{count:.0f} bytes"


def write_atomically(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """write(file) into a new file beside `path` (a random name, never a user's), fsync it, then rename it
    to `path`. Any OSError (a full disk, say) removes the new file and is raised as one WriteError line."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{secrets.token_hex(8)}.partial")
    try:
        with open(partial, "xb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    except BaseException as error:
        partial.unlink(missing_ok=True)
        cause = _os_error(error)
        if cause is None:
            raise
        kept = "the earlier file is unchanged" if path.exists() else "nothing was written"
        raise WriteError(f"cannot write {path}: {cause.strerror or cause} ({kept})") from error


def _os_error(error: BaseException) -> OSError | None:
    """The OSError behind `error`: torch.save reports a failed write as a RuntimeError caused by it."""
    while error is not None and not isinstance(error, OSError):
        error = error.__cause__ or error.__context__
    return error


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file, through links and bind mounts (the inode, not the string); paths
    that do not exist yet are one when their names are the same and their folders one."""
    a, b = Path(a), Path(b)
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.name == b.name and a != a.parent and same_file(a.parent, b.parent)


def claim_folder(folder: Path, flag: str, outputs: tuple[str, ...]) -> str:
    """Mark `folder` as this run's with a new id (RUN_MARKER, created exclusively: of two runs, one wins).
    A folder holding an earlier run's marker or any of `outputs` is refused: a run never writes over them."""
    earlier = [name for name in (RUN_MARKER, *outputs) if os.path.lexists(folder / name)]
    if earlier == [RUN_MARKER]:
        raise ValueError(f"{flag} {folder} holds the {RUN_MARKER} of a run that is still going or stopped before "
                         "its report: give a new folder, or remove that file")
    if earlier:
        raise ValueError(f"{flag} {folder} holds an earlier run's {', '.join(earlier)}; netgain does not write over "
                         "them: give a new folder")
    run_id = uuid.uuid4().hex
    try:
        with open(folder / RUN_MARKER, "x") as marker:
            json.dump({"run": run_id}, marker)
    except FileExistsError:
        raise ValueError(f"{flag} {folder}: another run has just claimed it ({RUN_MARKER}); give a new folder") from None
    except OSError as error:
        raise ValueError(f"{flag} {folder}: cannot write to it ({error.strerror or error})") from error
    return run_id


def require_claimed(folder: Path, run_id: str) -> None:
    """Before a run writes its outputs: `folder` still holds its marker (no other run has taken it over)."""
    marker = folder / RUN_MARKER
    try:
        require_regular_file(marker, "the marker", MANIFEST_MAX_BYTES)
        owner = json.loads(marker.read_text()).get("run")
    except (OSError, ValueError, AttributeError):
        owner = None
    if owner != run_id:
        raise WriteError(f"not writing into {folder}: its {RUN_MARKER} no longer names this run ({run_id}), so "
                         "its files may be another run's")
