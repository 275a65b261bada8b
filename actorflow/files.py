"""The files a run writes (metrics, traces, parameters), written so that nothing is lost:
each goes to a temporary name in its folder and is renamed into place, so a kill at any
moment leaves the previous file whole; and every output path is checked before the
first step, so a typo costs nothing."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterator, Mapping
from typing import IO, Any

from .errors import ConfigError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()
"""Read once, at import: setting the umask to read it is process-wide, and a run's
threads may be creating files while another file is written."""


@contextlib.contextmanager
def replaced(path: str | os.PathLike[str], mode: str = "w") -> Iterator[IO[Any]]:
    """``with replaced(path) as f: ...``: ``f`` writes a temporary file beside ``path``,
    which takes ``path``'s place once the block ends without an exception."""
    folder, name = os.path.split(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".part")
    try:
        os.chmod(temporary, 0o666 & ~_UMASK)  # as open() would have made it
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def check_outputs(
    outputs: Mapping[str, str | None],
    inputs: Mapping[str, str | None],
    folders: Mapping[str, str | None] | None = None,
) -> None:
    """Refuse, before any work, output paths that can't be written: a missing or
    read-only folder, a folder in a file's place (or for ``folders``, outputs that are
    folders, a file in a folder's place), two outputs on one path, or an output on one of
    the run's ``inputs`` (its config, its data). Keys name the paths in errors."""
    seen: dict[str, str] = {}
    read = {os.path.realpath(p): what for what, p in inputs.items() if p}
    kinds = [(what, path, False) for what, path in outputs.items()]
    kinds += [(what, path, True) for what, path in (folders or {}).items()]
    for what, path, folder_wanted in kinds:
        if not path:
            continue
        real = os.path.realpath(path)
        if real in seen:
            raise ConfigError(f"{what}: {path} is also {seen[real]}'s path; give each output its own")
        if real in read:
            raise ConfigError(f"{what}: {path} is the run's {read[real]}; it would be overwritten")
        if folder_wanted and os.path.exists(real):  # an existing folder output is written into
            if not os.path.isdir(real):
                raise ConfigError(f"{what}: {path} is a file; give a folder's path")
            if not os.access(real, os.W_OK | os.X_OK):
                raise ConfigError(f"{what}: folder {path} is not writable")
        elif os.path.isdir(real):
            raise ConfigError(f"{what}: {path} is a folder; give a file's path")
        elif not os.path.isdir(os.path.dirname(real)):
            raise ConfigError(f"{what}: folder {os.path.dirname(path) or '.'} does not exist")
        elif not os.access(os.path.dirname(real), os.W_OK | os.X_OK):
            raise ConfigError(f"{what}: folder {os.path.dirname(path) or '.'} is not writable")
        seen[real] = what


def strict_json(value: Any) -> tuple[Any, int]:
    """``value`` with every NaN or infinity replaced by None (JSON's null: strict parsers
    refuse NaN), and how many were replaced."""
    replaced_count = 0

    def walk(v: Any) -> Any:
        nonlocal replaced_count
        if isinstance(v, float) and not math.isfinite(v):
            replaced_count += 1
            return None
        if isinstance(v, Mapping):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [walk(x) for x in v]
        return v

    return walk(value), replaced_count


def write_json(value: Any, path: str | os.PathLike[str], **dump: Any) -> int:
    """Write ``value`` as strict JSON (see ``strict_json``) in place of ``path``; returns
    how many non-finite numbers became null."""
    plain, nulls = strict_json(value)
    with replaced(path) as f:
        json.dump(plain, f, allow_nan=False, **dump)
    return nulls
