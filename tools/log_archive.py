"""One compressed tarball of a run's working files (logs, per-test records, JUnit files, benchmark JSON), kept under
a size limit: a GPU runner returns few files of at most 16 MiB each, so the logs travel as one archive that fits.

Text files only (by suffix; checkpoints and other binaries stay behind). A file larger than the per-file cap keeps
its head and its tail (where a failure's last words are) with a line saying what was cut; if the archive still
exceeds `max_bytes`, the cap is halved and the archive written again, down to MIN_CAP. Written beside its final path
and renamed over it, so a reader never sees half an archive.
"""
from __future__ import annotations

import io
import os
import tarfile
import time

TEXT_SUFFIXES = (".log", ".jsonl", ".json", ".xml", ".txt", ".csv", ".yaml", ".out")
DEFAULT_MAX_BYTES = 15 << 20  # under the runner's 16 MiB per file
DEFAULT_CAP = 8 << 20
MIN_CAP = 16 << 10
HEAD_FRACTION = 0.25


def truncated(data: bytes, cap: int) -> bytes:
    """`data` if it fits `cap` bytes, else its first quarter and last three quarters of `cap` around a note."""
    if len(data) <= cap:
        return data
    head = int(cap * HEAD_FRACTION)
    tail = cap - head
    note = (f"\n\n[... log_archive: {len(data) - cap} of {len(data)} bytes cut here to keep the archive under its "
            f"limit; the head and the tail are kept ...]\n\n").encode()
    return data[:head] + note + data[-tail:]


def collect(root: str, suffixes=TEXT_SUFFIXES, skip_dirs=("checkpoint",)) -> list[tuple[str, str]]:
    """(name in the archive, path) of every file under `root` with one of `suffixes`, sorted; folders whose name
    starts with one of `skip_dirs` are left out (a training run's checkpoint)."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(tuple(skip_dirs)))
        for name in files:
            if name.endswith(tuple(suffixes)) and not name.endswith(".tmp"):
                path = os.path.join(folder, name)
                found.append((os.path.relpath(path, root), path))
    return sorted(found)


def _write(files: list[tuple[str, str]], out_path: str, cap: int, prefix: str) -> list[str]:
    cut = []
    with tarfile.open(out_path, "w:gz", compresslevel=6) as tar:
        for name, path in files:
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue  # gone since it was listed (a step cleaning up)
            kept = truncated(data, cap)
            if len(kept) != len(data):
                cut.append(name)
            info = tarfile.TarInfo(f"{prefix}/{name}" if prefix else name)
            info.size, info.mtime, info.mode = len(kept), int(time.time()), 0o644
            tar.addfile(info, io.BytesIO(kept))
    return cut


def write_archive(root: str, out_path: str, max_bytes: int = DEFAULT_MAX_BYTES, cap: int = DEFAULT_CAP,
                  prefix: str = "logs", suffixes=TEXT_SUFFIXES) -> dict:
    """Archives the text files under `root` into `out_path` (gzip-compressed tar, names under `prefix`/), within
    `max_bytes`; returns {"files", "bytes", "per_file_cap", "truncated": [names]}. ValueError if even MIN_CAP per
    file does not fit (then nothing is written)."""
    files = collect(root, suffixes)
    tmp = out_path + ".partial"
    while True:
        cut = _write(files, tmp, cap, prefix)
        size = os.path.getsize(tmp)
        if size <= max_bytes:
            os.replace(tmp, out_path)
            return {"files": len(files), "bytes": size, "per_file_cap": cap, "truncated": cut}
        if cap <= MIN_CAP:
            os.remove(tmp)
            raise ValueError(f"{len(files)} files do not fit {max_bytes} bytes even at {cap} bytes each")
        cap = max(MIN_CAP, cap // 2)
