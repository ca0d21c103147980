"""Checkpoint integrity: a restored step holds exactly what was saved.

Orbax 0.12.8 has no check of its own on array data: its zarr chunks are
zstd frames without a content checksum (tensorstore checksums only its
OCDBT manifests), and a byte flipped in an incompressible chunk restores
as silently wrong values (seen here). So every step carries two records,
plain JSON that any tool can read:

- `checksums`, an Orbax JSON item committed with the step (atomically): the
  crc32 of every array's bytes (a sharded step: `sum32`, which the hosts
  add up from their own shards), taken in memory before the write and
  checked after every restore. It catches a change anywhere between the
  writer's memory and the restored arrays.
- `files.json`, written right after the commit: every file of the step with
  its size and a digest (locally the crc32 of the bytes read back, from the
  page cache; on GCS the md5 the server computed on upload, read from the
  listing, so nothing is downloaded). It checks a step without Orbax or a
  template, and names the damaged file. A step committed without it
  (written before it existed, or its writer died between the commit and
  this file) is "unverified": restored on Orbax's word, arrays still checked.

crc32 (zlib, 3.4 GB/s here) rather than a cryptographic hash: this guards
against damage, not against an adversary.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import time
import zlib
from typing import Any, Optional

from ray_elastic.errors import CheckpointDamaged, StorageError

__all__ = [
    "ITEM", "MANIFEST", "MARKER", "array_checksums", "leaf_name", "sum32", "check_arrays", "write_manifest",
    "check_files", "mark_damaged", "read_marker", "is_damaged_name", "is_outage", "looks_corrupt",
    "file_in_error", "describe", "as_record", "recorded_arrays", "diagnose",
]

ITEM = "checksums"  # the Orbax item holding per-array checksums
MANIFEST = "files.json"  # per-file sizes and digests, beside the Orbax items
MARKER = "DAMAGED.json"  # why a step was moved aside
# A damaged step folder is renamed `<step>.damaged` (`.damaged.2`, ... when
# taken). Renaming rather than a marker file inside: Orbax (0.12.8) takes
# only all-digit folder names as steps, so plain Orbax, our listing and
# every later run skip it with no code of ours, and nothing is deleted: the
# evidence stays for a person to look at. Locally the rename is atomic;
# on GCS it is a server-side copy then a delete, and a crash between them
# leaves the original, which is found damaged and moved again.
DAMAGED_TAG = ".damaged"
# Files up to this size are digested by the quick check too (metadata:
# Orbax's JSON, OCDBT manifests, commit markers), big data files only by
# the full one.
SMALL_FILE = 1 << 20
_CHUNK = 8 << 20


def is_damaged_name(name: str) -> bool:
    return DAMAGED_TAG in name


# -- arrays -------------------------------------------------------------------


def leaf_name(path) -> str:
    """A leaf's path as `opt_state/1/0/mu/w`: the same whether the tree is
    the program's own (named tuples) or Orbax's restore without a template
    (dicts and lists), so the CLI can check arrays without the program."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _crc(a) -> str:
    import numpy as np

    a = np.ascontiguousarray(np.asarray(a)).reshape(-1)  # 1-d: 0-d arrays cannot be viewed as bytes
    return f"{zlib.crc32(a.view(np.uint8)):08x}"


def sum32(block: np.ndarray, index: tuple = (), shape: Optional[tuple] = None) -> int:
    """Checksum of a block of an array: sum over its elements of (the
    element's words, each times an odd constant) times (2 * the element's
    flat position in the whole array + 1), modulo 2**32. Odd factors make
    any single-bit change change the sum. `index`: the block's slices in
    the whole array of `shape` (default: the block is the whole array).
    Sharded steps record it (host_writes.py): it adds up over blocks, so
    each host sums its own shards and no process needs a whole array."""
    import numpy as np

    a = np.ascontiguousarray(block)
    shape = tuple(a.shape) if shape is None else tuple(shape)
    size = a.dtype.itemsize
    flat = a.reshape(-1)  # 0-d arrays cannot be viewed as other types
    if size >= 4:
        words = flat.view(np.uint32).reshape(a.shape + (size // 4,))
    else:
        words = flat.view({1: np.uint8, 2: np.uint16}[size]).astype(np.uint32).reshape(a.shape + (1,))
    odd = (2 * np.arange(words.shape[-1], dtype=np.uint32) + 1)
    value = np.sum(words * odd, axis=-1, dtype=np.uint32)
    # Flat positions in the whole array, modulo 2**32, for this block.
    pos = np.zeros((), dtype=np.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        s = index[d] if d < len(index) else slice(None)
        start = s.start or 0
        stop = shape[d] if s.stop is None else s.stop
        axis = np.arange(start, stop, dtype=np.uint64) * np.uint64(stride) % np.uint64(1 << 32)
        pos = pos + axis.astype(np.uint32).reshape((-1,) + (1,) * (len(shape) - 1 - d))
        stride *= shape[d]
    weight = pos * np.uint32(2) + np.uint32(1)
    return int(np.sum(value * weight, dtype=np.uint32))


def array_checksums(tree, kind: str = "crc32") -> dict:
    """{leaf name: checksum, shape, dtype} of whole arrays. `kind` "sum32"
    is what sharded steps record (host_writes.py: it adds up over shards)."""
    import jax
    import numpy as np

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        a = np.asarray(leaf)
        if kind == "sum32":
            value = f"{sum32(a):08x}"
        else:
            value = _crc(a)
        out[leaf_name(path)] = {kind: value, "shape": list(a.shape), "dtype": str(a.dtype)}
    return out


def check_arrays(step: int, tree, recorded: dict) -> int:
    """Raise CheckpointDamaged if a restored array differs from what was
    saved; returns how many arrays were compared. Names present on one side
    only (a template with another structure) are not damage: the caller's
    restore fails on those by itself."""
    got = array_checksums(tree, "sum32" if any("sum32" in v for v in recorded.values()) else "crc32")
    compared = 0
    for name, want in sorted(recorded.items()):
        have = got.get(name)
        if have is None:
            continue
        compared += 1
        if have != want:
            diff = ", ".join(f"{k} {have.get(k)} read, {want.get(k)} written" for k in want if have.get(k) != want.get(k))
            raise CheckpointDamaged(step, "state", f"array {name}: {diff}")
    return compared


# -- files ----------------------------------------------------------------------


class _Storage:
    """The few file operations integrity needs, on a folder or gs://. A
    missing file raises FileNotFoundError; any other failure (an outage)
    StorageError, so it is never taken for damage."""

    def __init__(self, root: str):
        self.gcs = root.startswith("gs://")
        if self.gcs:
            import gcsfs

            self.fs = gcsfs.GCSFileSystem()
            self.base = root[len("gs://"):].rstrip("/")
        else:
            self.base = root

    def _abs(self, rel: str) -> str:
        return f"{self.base}/{rel}" if self.gcs else os.path.join(self.base, rel)

    def _guard(self, what: str, fn):
        try:
            return fn()
        except (FileNotFoundError, StorageError):
            raise
        except Exception as e:
            raise StorageError(f"{what}: {type(e).__name__}: {e}") from None

    def files(self, folder: str) -> dict[str, tuple[int, Optional[str]]]:
        """Every file under `folder`: relative path -> (bytes, server md5)."""
        if self.gcs:
            prefix = self._abs(folder) + "/"

            def find():
                self.fs.invalidate_cache()
                return self.fs.find(prefix, detail=True)

            found = self._guard(f"listing gs://{prefix}", find)
            return {k[len(prefix):]: (int(v["size"]), v.get("md5Hash")) for k, v in found.items() if v.get("type") != "directory"}
        top = self._abs(folder)
        out = {}
        for d, _, names in os.walk(top):
            for n in names:
                p = os.path.join(d, n)
                out[os.path.relpath(p, top)] = (os.path.getsize(p), None)
        return out

    def digest(self, rel: str, algo: str) -> tuple[int, str]:
        """(bytes read, digest) of one file, streamed."""

        def run():
            h = hashlib.md5() if algo == "md5" else None
            crc, n = 0, 0
            opener = self.fs.open if self.gcs else open
            with opener(self._abs(rel), "rb") as f:
                while chunk := f.read(_CHUNK):
                    n += len(chunk)
                    if h is not None:
                        h.update(chunk)
                    else:
                        crc = zlib.crc32(chunk, crc)
            return n, base64.b64encode(h.digest()).decode() if h is not None else f"{crc:08x}"

        return self._guard(f"reading {self._abs(rel)}", run)

    def read_text(self, rel: str) -> bytes:
        if self.gcs:
            return self._guard(f"reading {self._abs(rel)}", lambda: self.fs.cat_file(self._abs(rel)))
        with open(self._abs(rel), "rb") as f:
            return f.read()

    def write_text(self, rel: str, text: str) -> None:
        if self.gcs:  # one object upload: all or nothing
            self._guard(f"writing {self._abs(rel)}", lambda: self.fs.pipe_file(self._abs(rel), text.encode()))
            return
        tmp = self._abs(rel) + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, self._abs(rel))  # never a half-written manifest

    def rename_dir(self, src: str, dst: str) -> None:
        if self.gcs:
            # Copy everything, then delete: a crash between leaves the
            # original whole (and found damaged again), never half of it.
            def move():
                self.fs.copy(self._abs(src), self._abs(dst), recursive=True)
                self.fs.rm(self._abs(src), recursive=True)
                self.fs.invalidate_cache()

            self._guard(f"moving {self._abs(src)}", move)
        else:
            os.rename(self._abs(src), self._abs(dst))


def write_manifest(root: str, folder: str) -> int:
    """Record every file of a committed step; returns how many."""
    st = _Storage(root)
    files = {}
    for rel, (size, md5) in sorted(st.files(folder).items()):
        if rel in (MANIFEST, MARKER) or rel.endswith(".tmp"):
            continue
        if md5:
            files[rel] = {"bytes": size, "md5": md5}
        else:
            n, crc = st.digest(f"{folder}/{rel}", "crc32")
            files[rel] = {"bytes": n, "crc32": crc}
    st.write_text(f"{folder}/{MANIFEST}", json.dumps({"version": 1, "files": files}, indent=1))
    return len(files)


def _size_problem(have: int, want: int) -> str:
    if have < want:
        return f"truncated: {have} of {want} bytes"
    return f"{have} bytes, {want} written"


def check_files(root: str, folder: str, step: int, full: bool) -> bool:
    """Check a step's files against its manifest. Raises CheckpointDamaged
    naming the first bad file; returns False when there is no manifest
    (unverified), True when every file checked is as written. `full` reads
    every byte; otherwise only presence, sizes and the small files."""
    st = _Storage(root)
    try:
        raw = st.read_text(f"{folder}/{MANIFEST}")
    except FileNotFoundError:
        return False
    try:
        files = json.loads(raw)["files"]
        assert isinstance(files, dict) and all(isinstance(v.get("bytes"), int) for v in files.values())
    except Exception as e:
        raise CheckpointDamaged(step, MANIFEST, f"unreadable ({type(e).__name__}: {e})") from None
    present = st.files(folder)
    for rel, want in sorted(files.items()):
        if rel not in present:
            raise CheckpointDamaged(step, rel, "missing")
        if present[rel][0] != want["bytes"]:
            raise CheckpointDamaged(step, rel, _size_problem(present[rel][0], want["bytes"]))
    for rel, want in sorted(files.items(), key=lambda kv: kv[1]["bytes"]):  # metadata first
        if not full and want["bytes"] > SMALL_FILE:
            continue
        algo = "md5" if "md5" in want else "crc32"
        try:
            n, got = st.digest(f"{folder}/{rel}", algo)
        except FileNotFoundError:
            raise CheckpointDamaged(step, rel, "missing") from None
        if n != want["bytes"]:
            raise CheckpointDamaged(step, rel, _size_problem(n, want["bytes"]))
        if got != want[algo]:
            raise CheckpointDamaged(step, rel, f"checksum mismatch: {algo} {got} read, {want[algo]} written")
    return True


def mark_damaged(root: str, damage: CheckpointDamaged, taken: list[str]) -> Optional[str]:
    """Move a damaged step aside (see DAMAGED_TAG), with a note of why.
    Returns its new folder name, or None if it is gone already (another
    process moved it)."""
    st = _Storage(root)
    folder = str(damage.step)
    if not st.files(folder):
        return None
    note = {"step": damage.step, "file": damage.file, "reason": damage.reason, "time": time.time()}
    st.write_text(f"{folder}/{MARKER}", json.dumps(note))  # travels with the folder
    name, n = f"{damage.step}{DAMAGED_TAG}", 2
    while name in taken:
        name, n = f"{damage.step}{DAMAGED_TAG}.{n}", n + 1
    st.rename_dir(folder, name)
    return name


def read_marker(root: str, name: str) -> dict:
    try:
        return json.loads(_Storage(root).read_text(f"{name}/{MARKER}"))
    except Exception:
        return {}


def recorded_arrays(step_root, step: int) -> Optional[dict]:
    """The array checksums saved with a step (None: written before they
    existed). `step_root` is the run's epath folder."""
    path = step_root / str(step) / ITEM / "metadata"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except Exception as e:
        if is_outage(e):
            raise StorageError(f"reading {path}: {e}") from None
        raise CheckpointDamaged(step, f"{ITEM}/metadata", f"unreadable ({type(e).__name__})") from None
    try:
        return json.loads(raw)["arrays"]
    except Exception as e:
        raise CheckpointDamaged(step, f"{ITEM}/metadata", f"unreadable ({type(e).__name__}: {e})") from None


# -- what an Orbax error means ---------------------------------------------------


def diagnose(root: str, step: int, e: BaseException, verified: bool) -> None:
    """Turn a failed Orbax restore into CheckpointDamaged where the bytes
    prove damage, or StorageError for an outage; otherwise (a template that
    does not fit the step, say) return, so the original error stands and
    a good step is never moved aside."""
    if isinstance(e, StorageError):
        return
    if is_outage(e):
        raise StorageError(f"restoring step {step} from {root}: {type(e).__name__}: {e}") from None
    if verified:
        check_files(root, str(step), step, full=True)  # raises naming the file
    if looks_corrupt(e):
        raise CheckpointDamaged(step, file_in_error(e), str(e).splitlines()[0][:300]) from None


_OUTAGE = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "Connection refused", "Cannot connect", "ServerDisconnected", "timed out")
_CORRUPT = ("DATA_LOSS", "orrupt", "ZSTD", "Zstd", "checksum", "Truncated", "Error reading", "Error decoding", "Error opening")


def is_outage(e: BaseException) -> bool:
    """The storage did not answer: retry later, never mark the step."""
    text = f"{type(e).__name__}: {e}"
    return isinstance(e, (ConnectionError, TimeoutError)) or any(s in text for s in _OUTAGE)


def looks_corrupt(e: BaseException) -> bool:
    """An Orbax/tensorstore error that only damaged bytes explain (for steps
    without a manifest to prove it)."""
    return isinstance(e, (UnicodeDecodeError, json.JSONDecodeError)) or any(s in str(e) for s in _CORRUPT)


def file_in_error(e: BaseException) -> str:
    m = re.search(r'Error reading "([^"]+)"', str(e))
    return f"state (array {m.group(1)})" if m else "state"


def describe(d: dict) -> str:
    return f"step {d['step']}: {d['file']}: {d['reason']}"


def as_record(d: CheckpointDamaged, moved_to: Optional[str]) -> dict[str, Any]:
    return {"step": d.step, "file": d.file, "reason": d.reason, "moved_to": moved_to}
