"""Just-in-time build and loading of the CUDA extension in ``csrc/``.

The extension is built once per machine (cached by torch in ``TORCH_EXTENSIONS_DIR``) the first
time a fused op sees a CUDA tensor. Its C++ side registers the ops under ``torch.ops.ls_fairseq``
with ``TORCH_LIBRARY``; each public ``ls_fairseq/ops/<op>.py`` holds the pure-PyTorch reference
and the dispatch of one op, its ``_<op>_cuda.py`` the binding (``ls_fairseq/ops/README.md``).

Policy, from the environment variable ``LS_FAIRSEQ_KERNELS``:

* ``auto`` (default): use the kernels when the build works; otherwise fall back to the PyTorch
  reference path with one warning that says why.
* ``require``: a missing GPU, nvcc or a failed build raises, so a benchmark can never silently
  measure the fallback.
* ``off``: always use the PyTorch reference path.

Every ``LS_FAIRSEQ_*`` variable the package reads is listed in :data:`ENV_VARS` with its values;
loading the plugin refuses a bad value (or an unknown ``LS_FAIRSEQ_`` name) with one line and
exit status 2, before fairseq starts a run that would fail at its first forward.

The build result is process-wide on purpose (a shared library is loaded once per process); no
layer keeps state here.
"""
import glob
import hashlib
import logging
import os
import sys
import threading
import warnings

import torch

logger = logging.getLogger(__name__)

ENV_VAR = "LS_FAIRSEQ_KERNELS"
EXTENSION_NAME = "ls_fairseq_C"
_MODES = ("auto", "require", "off")
_FLAG = ("0", "1", "false", "true", "no", "yes", "off", "on")
#: every LS_FAIRSEQ_* environment variable the package reads -> its values (the first is the
#: default); tests/test_bad_input.py checks that the package reads no other
ENV_VARS = {
    ENV_VAR: _MODES,
    "LS_FAIRSEQ_ATTENTION": ("auto", "short", "efficient", "softmax"),  # ops/_attention_cuda.py
    "LS_FAIRSEQ_DETERMINISTIC": _FLAG,  # ops/_embedding_cuda.py
    "LS_FAIRSEQ_VERBOSE_BUILD": _FLAG,  # the JIT build's compiler output
    "LS_FAIRSEQ_GENERATOR": ("graphs", "eager", "fairseq"),  # generation/generator.py
    "LS_FAIRSEQ_PEER_BARRIER": ("nccl", "flags"),  # graphs/peer_all_reduce.py
}
#: compiler flags of the JIT build (tests/test_csrc_compiles.py compiles csrc/ with the same ones)
#: No -std flag: torch's cpp_extension adds the standard torch itself was built with (C++20 for
#: torch >= 2.10); forcing another one mixes ABIs (seen: TORCH_CHECK messages crashing in ostream).
#: storage dtypes of the fused kernels (their math is float32)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def rows_fit(x, bias=None) -> bool:
    """Whether ``x`` [..., C] is rows of C > 0 values of a kernel dtype and ``bias`` is None or
    C values of ``x``'s dtype: what every row-wise kernel's ``supports`` checks first."""
    return (x.dtype in KERNEL_DTYPES and x.dim() > 0 and x.size(-1) > 0
            and (bias is None or (bias.dtype == x.dtype and bias.numel() == x.size(-1))))


CXX_FLAGS = ["-O3"]
CUDA_FLAGS = ["-O3", "-lineinfo"]

_lock = threading.Lock()
_loaded = None  # None: not tried yet; True/False: result of the one build attempt
_failure_reason = ""
_warned = False
_announced_cpu = False  # the once-per-process "PyTorch path on CPU" line (announce_device)
_pending = []  # when_loaded callbacks waiting for a successful load


def env_value(name: str) -> str:
    """The value of ``LS_FAIRSEQ_*`` variable ``name`` (lower case; its default when unset or
    empty); ValueError, in one line that says what to do, when it is not one of its values."""
    values = ENV_VARS[name]
    value = os.environ.get(name, values[0]).strip().lower() or values[0]
    if value not in values:
        raise ValueError(f"{name}={os.environ[name]!r} is not one of {', '.join(values)}: "
                         f"set one of them, or unset {name} (default {values[0]})")
    return value


def env_flag(name: str) -> bool:
    return env_value(name) in ("1", "true", "yes", "on")


def check_environment(environ=None) -> None:
    """ValueError (one line) for the first bad ``LS_FAIRSEQ_*`` variable: a value outside
    :data:`ENV_VARS` or a name the package does not read (a typo would silently do nothing)."""
    environ = os.environ if environ is None else environ
    for name in sorted(environ):
        if not name.startswith("LS_FAIRSEQ_"):
            continue
        if name not in ENV_VARS:
            raise ValueError(f"{name} is not a variable ls_fairseq reads (it reads "
                             f"{', '.join(sorted(ENV_VARS))}): fix its name or unset it")
        values = ENV_VARS[name]
        value = environ[name].strip().lower()
        if value and value not in values:
            raise ValueError(f"{name}={environ[name]!r} is not one of {', '.join(values)}: "
                             f"set one of them, or unset {name} (default {values[0]})")


def refuse_bad_environment() -> None:
    """Run when the plugin loads: a bad ``LS_FAIRSEQ_*`` variable ends the process with one line
    on stderr and exit status 2 (a usage error, as argparse reports one), not a traceback at
    the first forward."""
    try:
        check_environment()
    except ValueError as exc:
        sys.stderr.write(f"ls_fairseq: {exc}\n")
        sys.stderr.flush()
        raise SystemExit(2) from None


def mode() -> str:
    return env_value(ENV_VAR)


def csrc_dir() -> str:
    """The CUDA sources: shipped inside the package by setup.py, or the repository's csrc/."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for candidate in (os.path.join(here, "csrc"), os.path.join(os.path.dirname(here), "csrc")):
        if os.path.isdir(candidate) and source_files(candidate):
            return candidate
    raise FileNotFoundError(
        f"ls_fairseq: no CUDA sources found in {os.path.join(here, 'csrc')} or the repository's "
        "csrc/; reinstall the package (pip install .) so the sources are shipped with it"
    )


def source_files(directory: str):
    return sorted(
        glob.glob(os.path.join(directory, "*.cpp")) + glob.glob(os.path.join(directory, "*.cu"))
    )


def _sources_digest(directory: str) -> str:
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(directory, "*"))):
        if path.endswith((".cu", ".cpp", ".h", ".cuh")):
            digest.update(os.path.basename(path).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:12]


def _arch_flags():
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    return [f"-gencode=arch=compute_{arch},code=sm_{arch}"]


def _build():
    from torch.utils import cpp_extension

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible to torch")
    if cpp_extension.CUDA_HOME is None:
        raise RuntimeError("nvcc was not found (set CUDA_HOME)")
    directory = csrc_dir()
    cpp_extension.load(
        # torch rebuilds when a listed source changes, but not when a header does: name the build
        # after a digest of every file in csrc/ so any change gets its own build
        name=f"{EXTENSION_NAME}_{_sources_digest(directory)}",
        sources=source_files(directory),
        extra_include_paths=[directory],
        extra_cflags=list(CXX_FLAGS),
        extra_cuda_cflags=CUDA_FLAGS + _arch_flags(),
        is_python_module=False,
        verbose=env_flag("LS_FAIRSEQ_VERBOSE_BUILD"),
    )


def load() -> bool:
    """Build/load the extension once; True when the kernels are usable in this process."""
    global _loaded, _failure_reason
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is None:
            try:
                _build()
                _loaded = True
            except Exception as exc:  # noqa: BLE001 - any failure means "use the fallback"
                _loaded = False
                _failure_reason = f"{type(exc).__name__}: {exc}"
    if _loaded:
        _run_pending()
    return _loaded


def when_loaded(fn):
    """Call ``fn()`` once the extension is loaded: now if it is, else right after the first
    successful :func:`load`. Each binding (``ops/_<op>_cuda.py``) registers its ops' fake (meta)
    implementations and Python autograd this way, so it can be imported without the extension
    (a CPU machine, a test of its ``supports`` predicate) and still registers them, once, when
    the kernels arrive. An error in ``fn`` is raised (by the import, or by the load that ran
    it). Returns ``fn``."""
    with _lock:
        _pending.append(fn)
    if _loaded:
        _run_pending()
    return fn


def _run_pending():
    while True:
        with _lock:
            if not _pending:
                return
            fn = _pending.pop(0)
        fn()


def failure_reason() -> str:
    return _failure_reason


def wants_cuda(*tensors) -> bool:
    """``LS_FAIRSEQ_KERNELS`` applied to where the tensors are: False under ``off`` or when one
    is on the CPU (an error under ``require``). What a GPU path of any op decides first."""
    current = mode()
    if current == "off":
        return False
    if not all(t is None or t.is_cuda for t in tensors):
        if current == "require":
            raise RuntimeError(
                f"{ENV_VAR}=require but an ls_fairseq op got a CPU tensor; run on a CUDA device "
                f"or unset {ENV_VAR}"
            )
        return False
    return True


def use_kernels(*tensors) -> bool:
    """True when the CUDA kernels should run for these tensors; decides fallback and warns once."""
    global _warned
    if not wants_cuda(*tensors):
        return False
    if load():
        return True
    if mode() == "require":
        raise RuntimeError(
            f"{ENV_VAR}=require but the ls_fairseq CUDA extension is unavailable: {_failure_reason}"
        )
    if not _warned:
        _warned = True
        warnings.warn(
            "ls_fairseq: CUDA kernels unavailable, using the PyTorch reference path "
            f"(slower, same math). Reason: {_failure_reason}. Set {ENV_VAR}=require to make "
            "this an error.",
            RuntimeWarning,
            stacklevel=3,
        )
    return False


def announce_device(args) -> None:
    """Called when an ls_ model is built. On the CPU (``--cpu``, or no GPU visible to torch) say
    once per process that the PyTorch reference path runs and why it is no faster than fairseq
    (the README's promise); on a GPU, :func:`use_kernels` warns instead if the build fails.
    Nothing under ``LS_FAIRSEQ_KERNELS=off``: the user chose that path."""
    global _announced_cpu
    if _announced_cpu or mode() == "off":
        return
    if not (getattr(args, "cpu", False) or not torch.cuda.is_available()):
        return
    _announced_cpu = True
    logger.warning("ls_fairseq: on CPU the PyTorch reference path runs (the CUDA kernels' math, "
                   "not their speed): the speed-ups need a CUDA GPU")


def has_op(name: str) -> bool:
    """True when the loaded extension registered ``torch.ops.ls_fairseq.<name>``."""
    return bool(_loaded) and hasattr(torch.ops.ls_fairseq, name)


def _reset_for_tests():
    """Forget the build result (tests only)."""
    global _loaded, _failure_reason, _warned, _announced_cpu
    _loaded, _failure_reason, _warned, _announced_cpu = None, "", False, False


refuse_bad_environment()  # when the plugin loads
