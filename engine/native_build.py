"""Building the package's C kernels for this machine, once each: the LoRA deltas
(`lora/delta_kernel.c`), and, each a torch operator through a C++ file beside it,
decode attention (`model/decode_attention.c`), the weight-only products with int8
activations (`model/vnni_product.c`) and RMS norm (`model/rms_norm.c`).

Rules:
1. Built at first use by the C compiler (`$CC`, else `cc`), `-O3 -march=native
   -fopenmp`, into `$XDG_CACHE_HOME/wavecore/native/` (else `~/.cache/...`), under a
   name hashing everything the binary depends on: the sources, the compilers' versions,
   the flags, torch's version where it links torch, and the CPU's model and flags
   (`-march=native` builds for them). A second process on the same machine loads the
   file without compiling.
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
7. A kernel with a `torch_ops` file: that C++ file (`$CXX`, else `c++`, C++17) registers
   the C functions as torch operators through torch's stable C ABI
   (`torch/csrc/stable`: a few headers, a second's compile, not the whole of ATen's),
   and is linked with the C object against the torch this process imported; loading the
   library registers the operators, which torch's dispatcher then calls without Python.
   Such a library is loaded once per process whatever happens to the cache: a second
   copy would register its operators again, which aborts the process.
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
CXX_FLAGS = ("-O2", "-std=c++17", "-fopenmp", "-shared", "-fPIC")
_COMPILE_TIMEOUT_S = 120
# The libraries loaded that registered torch operators, by stem (rule 7).
_OPERATOR_LIBRARIES: dict[str, KernelBuild] = {}


@dataclass(frozen=True, slots=True)
class KernelSource:
    """One C kernel: its source, its library's name in the cache, and the environment
    variable that turns it off ("torch") or on ("native", the default)."""

    source: Path
    stem: str
    env: str
    torch_ops: Path | None = None  # rule 7


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
    if kernel.stem in _OPERATOR_LIBRARIES:  # rule 7
        return _OPERATOR_LIBRARIES[kernel.stem]
    compilers = {"C": os.environ.get("CC") or "cc"}
    if kernel.torch_ops is not None:
        compilers["C++"] = os.environ.get("CXX") or "c++"
    versions = []
    for language, compiler in compilers.items():
        if shutil.which(compiler) is None:
            return KernelBuild(None, f"no {language} compiler ({compiler!r} is not on PATH)")
        try:
            versions.append(
                subprocess.run(
                    [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
                ).stdout.splitlines()[0]
            )
        except (OSError, subprocess.SubprocessError, IndexError) as error:
            return KernelBuild(None, f"{compiler} --version failed: {error}")
    steps = _steps(kernel, list(compilers.values()))
    inputs = [kernel.source.read_bytes(), *(" ".join(step).encode() for step in steps)]
    if kernel.torch_ops is not None:
        import torch  # the operators link this torch

        inputs += [kernel.torch_ops.read_bytes(), torch.__version__.encode()]
    digest = hashlib.sha256(
        b"\0".join([*inputs, *(v.encode() for v in versions), _cpu_identity()])
    ).hexdigest()[:20]
    target = cache_dir() / f"{kernel.stem}-{digest}.so"
    if not target.exists():
        failure = _compile(steps, kernel.source, target)
        if failure is not None:
            return KernelBuild(None, failure)
    try:
        library = ctypes.PyDLL(str(target))
    except OSError as error:
        return KernelBuild(None, f"cannot load {target}: {error}")
    built = KernelBuild(library, f"built by {' and '.join(dict.fromkeys(versions))}")
    if kernel.torch_ops is not None:
        _OPERATOR_LIBRARIES[kernel.stem] = built
    return built


# In a build's commands, where the scratch directory and the output go.
_SCRATCH, _OUTPUT = "{scratch}", "{output}"


def _steps(kernel: KernelSource, compilers: list[str]) -> list[list[str]]:
    """The commands that build `kernel` (rule 1, and rule 7 with `torch_ops`)."""
    if kernel.torch_ops is None:
        return [[compilers[0], *FLAGS, "-o", _OUTPUT, str(kernel.source)]]
    import torch  # only kernels that are torch operators need it

    torch_dir = Path(torch.__file__).parent
    obj = f"{_SCRATCH}/{kernel.stem}.o"
    c_flags = [flag for flag in FLAGS if flag != "-shared"]
    return [
        [compilers[0], *c_flags, "-c", "-o", obj, str(kernel.source)],
        [
            compilers[1],
            *CXX_FLAGS,
            f"-I{torch_dir / 'include'}",
            "-o",
            _OUTPUT,
            str(kernel.torch_ops),
            obj,
            f"-L{torch_dir / 'lib'}",
            "-ltorch_cpu",
            "-lc10",
            f"-Wl,-rpath,{torch_dir / 'lib'}",
        ],
    ]


def _compile(steps: list[list[str]], source: Path, target: Path) -> str | None:
    """Run `steps` into `target` atomically; the failure's reason, or None."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            for step in steps:
                command = [
                    part.replace(_SCRATCH, scratch).replace(_OUTPUT, str(built)) for part in step
                ]
                result = subprocess.run(
                    command, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S
                )
                if result.returncode != 0:
                    detail = (result.stderr.strip().splitlines() or ["no output"])[-1]
                    return f"{command[0]} failed to build {source.name}: {detail}"
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
