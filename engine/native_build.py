"""Building the package's C kernels for this machine, once each: the LoRA deltas
(`lora/delta_kernel.c`) and decode attention (`model/decode_attention.c`).

Rules:
1. Built at first use by the C compiler (`$CC`, else `cc`), `-O3 -march=native
   -fopenmp`, into `$XDG_CACHE_HOME/wavecore/native/` (else `~/.cache/...`), under a
   name hashing everything the binary depends on: the source, the compiler's version,
   the flags, and the CPU's model and flags (`-march=native` builds for them). A
   second process on the same machine loads the file without compiling.
2. The library is written to a temporary file and renamed into place, so no process
   loads half a file; two building at once both write the same bytes, the last wins.
3. Optional: without a compiler, when the build or the load fails, or with the
   kernel's variable set to `torch` (`KernelSource.env`), there is no kernel and the
   reason says why; the caller then runs torch's ops, the same sums, slower.
4. OpenMP: built by GCC, the library links `libgomp.so.1`, which in a process that
   imported torch (Linux wheels bundle GCC's runtime under that name) is torch's own,
   so the kernel's threads are torch's pool, not a second one competing for the cores.
   (A Clang build links LLVM's `libomp`: a second pool; `CC=gcc` avoids it.)
5. Loaded as a `ctypes.PyDLL`: a call holds the GIL for its 5-100 us rather than
   handing it to the event loop's thread and waiting to take it back after every one
   of a step's calls (end to end with one LoRA adapter, 0.88-0.90 of the base model's
   throughput against 0.86-0.88 through `ctypes.CDLL`, runs alternated).
6. Built and loaded once per process and source (`build`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
_COMPILE_TIMEOUT_S = 120


@dataclass(frozen=True, slots=True)
class KernelSource:
    """One C kernel: its source, its library's name in the cache, and the environment
    variable that turns it off ("torch") or on ("native", the default)."""

    source: Path
    stem: str
    env: str


@dataclass(frozen=True, slots=True)
class KernelBuild:
    """The loaded library, or None with the reason it is not there."""

    library: ctypes.CDLL | None
    reason: str


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "wavecore" / "native"


@cache
def build(kernel: KernelSource) -> KernelBuild:
    """`kernel`'s library for this process (built, or loaded from the cache)."""
    setting = os.environ.get(kernel.env, "")
    if setting not in ("", "native", "torch"):
        raise ValueError(f"{kernel.env} must be 'native', 'torch' or unset, got {setting!r}")
    if setting == "torch":
        return KernelBuild(None, f"{kernel.env}=torch")
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        return KernelBuild(None, f"no C compiler ({compiler!r} is not on PATH)")
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as error:
        return KernelBuild(None, f"{compiler} --version failed: {error}")
    source = kernel.source.read_bytes()
    digest = hashlib.sha256(
        b"\0".join([source, version.encode(), " ".join(FLAGS).encode(), _cpu_identity()])
    ).hexdigest()[:20]
    target = cache_dir() / f"{kernel.stem}-{digest}.so"
    if not target.exists():
        failure = _compile(compiler, kernel.source, target)
        if failure is not None:
            return KernelBuild(None, failure)
    try:
        library = ctypes.PyDLL(str(target))
    except OSError as error:
        return KernelBuild(None, f"cannot load {target}: {error}")
    return KernelBuild(library, f"built by {version}")


def _compile(compiler: str, source: Path, target: Path) -> str | None:
    """Compile into `target` atomically; the failure's reason, or None."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            result = subprocess.run(
                [compiler, *FLAGS, "-o", str(built), str(source)],
                capture_output=True,
                text=True,
                timeout=_COMPILE_TIMEOUT_S,
            )
            if result.returncode != 0:
                detail = (result.stderr.strip().splitlines() or ["no output"])[-1]
                return f"{compiler} failed to build {source.name}: {detail}"
            os.replace(built, target)
    except (OSError, subprocess.SubprocessError) as error:
        return f"cannot build {source.name} into {target.parent}: {error}"
    return None


def _cpu_identity() -> bytes:
    """What `-march=native` builds for: the CPU's model name and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode() + platform.machine().encode()
    wanted = ("model name", "flags", "Features", "CPU part")
    seen = dict.fromkeys(wanted, "")
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip()
        if key in seen and not seen[key]:
            seen[key] = value.strip()
    return ("\n".join(f"{k}={v}" for k, v in seen.items()) + platform.machine()).encode()
