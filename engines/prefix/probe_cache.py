"""The reuse probe's answer, kept on disk so a node's next start skips the probe (5-12 s).

The answer (engines/prefix/reuse_probe.py) is a property of the kernels that
run the model, so it is kept under a key of everything that can change it:
the checkpoint (its ``config.json`` and each weights file's name, size, time
and safetensors header: the shapes and dtypes, without reading gigabytes of
tensors), the model's cache fingerprint, the chunk size, the probe's own
parameters, MLX and mlx-lm's versions and device, the BLAS under MLX (path,
version, core type, threads, ``OPENBLAS_L2_SIZE``) and the CPU (model and
flags). Anything not recognised is a miss: the node probes again.

Where: ``MLXCEL_PROBE_CACHE_DIR``, else ``$MLXCEL_CACHE_DIR/reuse-probe``, else
``$XDG_CACHE_HOME/mlxcel/reuse-probe`` (``~/.cache`` when unset).
``MLXCEL_NO_PROBE_CACHE=1`` probes at every start.
One JSON file per key; written to a temporary file and renamed, so a reader
never sees half of one. A node that finds no answer probes holding a lock
(``flock`` on the key's ``.lock`` file): nodes started together on one
machine probe once, the others read the answer. A file that cannot be read or
parsed is ignored with one log line and replaced after probing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from mlxcel_plugin import openblas
from mlxcel_plugin.engine_api import EngineConfig, ModelInfo

log = logging.getLogger(__name__)

CACHE_DIR_VAR = "MLXCEL_PROBE_CACHE_DIR"
DISABLE_VAR = "MLXCEL_NO_PROBE_CACHE"
MLXCEL_CACHE_VAR = "MLXCEL_CACHE_DIR"  # converted models live there too (model_cache.py)
FORMAT = 1  # bump when the file or the key changes meaning
WEIGHTS_SUFFIXES = (".safetensors", ".npz", ".gguf")
HEADER_LIMIT = 1 << 24  # a safetensors header past 16 MiB is not read: its size stands in

Probe = Callable[[], "int | None"]


def cache_dir(env: Mapping[str, str] = os.environ) -> Path | None:
    """Where answers are kept; None when the cache is off."""
    if env.get(DISABLE_VAR) == "1":
        return None
    if env.get(CACHE_DIR_VAR):
        return Path(env[CACHE_DIR_VAR])
    if env.get(MLXCEL_CACHE_VAR):  # where everything mlxcel caches was moved to
        return Path(env[MLXCEL_CACHE_VAR]) / "reuse-probe"
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlxcel" / "reuse-probe"


def remembered(key: dict[str, Any] | None, probe: Probe,
               directory: Path | None = None) -> int | None:
    """The cached answer for ``key``, else ``probe()``'s, kept for next time."""
    directory = cache_dir() if directory is None else directory
    if key is None or directory is None:
        return probe()
    path = directory / f"{_digest(key)[:32]}.json"
    found, rows = _load(path, key)
    if not found:
        with _probing(path):  # nodes started together on one machine probe once
            found, rows = _load(path, key, warn=False)  # the lock's last holder may have written it
            if not found:
                rows = probe()
                _store(path, key, rows)
                return rows
    log.info("prefix cache: %s (the probe's answer kept in %s)",
             f"any prompt token reusable (forwards of >= {rows} rows are exact)" if rows
             else "whole chunks reusable", path)
    return rows


@contextlib.contextmanager
def _probing(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on the key's lock file while one process probes: the others
    wait for its answer instead of each running the same forwards. Without a writable
    directory there is nothing to share: no lock (``_store`` says why once)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if the holder dies
        yield
    finally:
        os.close(fd)


def probe_key(config: EngineConfig, info: ModelInfo,
              probe: dict[str, Any]) -> dict[str, Any] | None:
    """What the answer depends on, as JSON would give it back; None: no checkpoint to name."""
    checkpoint = checkpoint_digest(info.tokenizer_dir) if info.tokenizer_dir else None
    if checkpoint is None:
        return None
    blas = openblas.blas_in_process()
    log.info("BLAS under MLX: %s", ", ".join(
        f"{b['path']} {b['version']} core {b['core']}" for b in blas) or "MLX's own")
    key = {"format": FORMAT, "checkpoint": checkpoint, "fingerprint": info.fingerprint,
           "chunk_size_tokens": config.chunk_size_tokens, "probe": probe,
           "mlx": _mlx_identity(), "blas": blas, "cpu": cpu_identity()}
    return json.loads(json.dumps(key, sort_keys=True))  # tuples as lists, as a file holds them


def _mlx_identity() -> dict[str, str]:
    import mlx.core as mx
    import mlx_lm

    return {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
            "device": str(mx.default_device())}


def _load(path: Path, key: dict[str, Any], warn: bool = True) -> tuple[bool, int | None]:
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):  # nothing kept yet
        return False, None
    except OSError as exc:
        if warn:
            log.warning("prefix cache: ignoring unreadable probe cache %s (%s)", path, exc)
        return False, None
    try:
        stored = json.loads(text)
        rows = stored["min_rows"]
        if stored["key"] == key and (rows is None or (type(rows) is int and rows > 0)):
            return True, rows
        reason = "another key" if stored["key"] != key else f"min_rows {rows!r}"
    except (ValueError, KeyError, TypeError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
    if warn:
        log.warning("prefix cache: ignoring corrupt probe cache %s (%s); probing again", path,
                    reason)
    return False, None


def _store(path: Path, key: dict[str, Any], rows: int | None) -> None:
    body = json.dumps({"key": key, "min_rows": rows}, indent=1, sort_keys=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(body)
            os.replace(tmp, path)  # atomic: readers see the old file or the new one
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        log.warning("prefix cache: could not keep the probe's answer in %s (%s)", path, exc)


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def checkpoint_digest(model_dir: str | Path) -> str | None:
    """The checkpoint's identity without reading its tensors; None: no checkpoint there."""
    root = Path(model_dir)
    config = root / "config.json"
    if not config.is_file():
        return None
    hasher = hashlib.sha256(config.read_bytes())
    for weights in sorted(p for p in root.iterdir() if p.name.endswith(WEIGHTS_SUFFIXES)):
        stat = weights.stat()
        hasher.update(f"\0{weights.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        hasher.update(_safetensors_header(weights))
    return hasher.hexdigest()


def _safetensors_header(path: Path) -> bytes:
    """Tensor names, dtypes, shapes and offsets: the first 8 + n bytes of a safetensors file."""
    if path.suffix != ".safetensors":
        return b""
    with open(path, "rb") as weights:
        size = int.from_bytes(weights.read(8), "little")
        return weights.read(size) if size <= HEADER_LIMIT else b""


def cpu_identity(cpuinfo: str = "/proc/cpuinfo") -> dict[str, str]:
    """The CPU's model name and a digest of its flags (Linux), else what ``platform`` says."""
    found = {"machine": platform.machine(), "processor": platform.processor()}
    try:
        with open(cpuinfo, encoding="utf-8") as lines:
            for line in lines:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in ("model name", "flags") and name not in found:
                    found[name] = value.strip()
                if "model name" in found and "flags" in found:
                    break
    except OSError:
        pass
    if "flags" in found:
        found["flags"] = hashlib.sha256(found["flags"].encode()).hexdigest()[:16]
    return found
