"""Loading of the CUDA extension in ``csrc/``: prebuilt at install, or built just in time.

The extension is loaded the first time a fused op sees a CUDA tensor. Its C++ side registers the
ops under ``torch.ops.ls_fairseq`` with ``TORCH_LIBRARY``; each public ``ls_fairseq/ops/<op>.py``
holds the pure-PyTorch reference and the dispatch of one op, its ``_<op>_cuda.py`` the binding
(``ls_fairseq/ops/README.md``).

Where it comes from:

* **prebuilt**: ``LS_FAIRSEQ_BUILD_KERNELS=1 pip install .`` (or ``pip wheel .``) compiles it
  at install with torch's ``CUDAExtension`` (setup.py) into ``ls_fairseq/_C*.so``, next to its
  build record ``ls_fairseq/_C_build.json`` (:data:`PREBUILT_RECORD`: torch and CUDA versions,
  GPU code, flags, a digest of the sources). It is loaded when :func:`prebuilt_choice` finds that
  it matches the running torch, its CUDA, every visible GPU, the shipped sources and the flags;
* **just in time** otherwise: ``torch.utils.cpp_extension.load`` with nvcc and ninja, once per
  machine (cached by torch in ``TORCH_EXTENSIONS_DIR``), for the running GPU. One log line says
  why the prebuilt module was not used (none installed: INFO; a mismatch: WARNING).

``python -m ls_fairseq.kernels`` reports which of the two a process would use, and why.

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
import json
import logging
import os
import re
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
    "LS_FAIRSEQ_PEER_BARRIER": ("nccl", "flags"),  # distributed/peer_all_reduce.py
    "LS_FAIRSEQ_ANY_FAIRSEQ": _FLAG,  # fairseq_patches/_fairseq_version.py
    # read by setup.py (the install-time build); listed so that it may stay set at run time
    "LS_FAIRSEQ_BUILD_KERNELS": _FLAG,
}
#: storage dtypes of the fused kernels (their math is float32)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def rows_fit(x, bias=None) -> bool:
    """Whether ``x`` [..., C] is rows of C > 0 values of a kernel dtype and ``bias`` is None or
    C values of ``x``'s dtype: what every row-wise kernel's ``supports`` checks first."""
    return (x.dtype in KERNEL_DTYPES and x.dim() > 0 and x.size(-1) > 0
            and (bias is None or (bias.dtype == x.dtype and bias.numel() == x.size(-1))))


#: compiler flags of both builds, JIT and install-time (tests/test_csrc_compiles.py compiles
#: csrc/ with the same ones). No -std flag: torch's cpp_extension adds the standard torch itself
#: was built with (C++20 for torch >= 2.10); forcing another one mixes ABIs (seen: TORCH_CHECK
#: messages crashing in ostream).
CXX_FLAGS = ["-O3"]
CUDA_FLAGS = ["-O3", "-lineinfo"]

#: the install-time build (setup.py): the module ``ls_fairseq._C`` and its build record, a JSON
#: file beside it in the package folder (format :data:`PREBUILT_FORMAT`)
PREBUILT_MODULE = "ls_fairseq._C"
PREBUILT_RECORD = "_C_build.json"
PREBUILT_FORMAT = 1

_lock = threading.Lock()
_loaded = None  # None: not tried yet; True/False: result of the one build attempt
_failure_reason = ""
_origin = {}  # how the loaded extension was obtained (origin()); empty until a load succeeds
_prebuilt_not_used = ""  # why the prebuilt module was passed over, for the failure reason
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


# ---------------------------------------------------------------- the prebuilt module
def package_dir() -> str:
    """The installed ``ls_fairseq`` folder (where setup.py puts the prebuilt module)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpu_code_of_flags(flags):
    """The GPU code named by nvcc ``-gencode=arch=compute_XY,code=...`` flags: ``sm_XY`` (SASS
    for one architecture), ``compute_XY`` (PTX, compiled by the driver for newer GPUs), sorted."""
    code = set()
    for flag in flags:
        for match in re.finditer(r",code=\[?([\w,]+)\]?", flag):
            code.update(c for c in match.group(1).split(",") if _parse_code(c))
    return sorted(code, key=_code_sort_key)


def _parse_code(name):
    """'sm_90a' -> ('sm', 9, 0, 'a'); None when not a GPU code name."""
    match = re.fullmatch(r"(sm|compute)_(\d+)(\d)([af]?)", name)
    if not match:
        return None
    kind, major, minor, suffix = match.groups()
    return kind, int(major), int(minor), suffix


def _code_sort_key(name):
    parsed = _parse_code(name)
    return (parsed[1], parsed[2], parsed[0] == "compute", parsed[3]) if parsed else (999, 0, True, name)


def code_for_capability(code, capability):
    """The entry of ``code`` (names as in :func:`gpu_code_of_flags`) a GPU of compute capability
    ``(major, minor)`` runs, and how: ``(name, "exact")``, ``(name, "compatible")`` (SASS of an
    older minor version of the same major, which CUDA guarantees to run), ``(name, "ptx")`` (PTX
    the driver compiles on first use), or ``(None, None)``. Arch-specific code (``sm_90a``) runs
    on exactly its architecture only."""
    major, minor = capability
    best, rank = (None, None), 0
    for name in code:
        parsed = _parse_code(name)
        if parsed is None:
            continue
        kind, c_major, c_minor, suffix = parsed
        if suffix == "a":
            fits = (c_major, c_minor) == (major, minor)
        elif kind == "sm":
            fits = c_major == major and c_minor <= minor
        else:
            fits = (c_major, c_minor) <= (major, minor)
        if not fits:
            continue
        how = "ptx" if kind == "compute" else ("exact" if c_minor == minor else "compatible")
        score = {"exact": 3, "compatible": 2, "ptx": 1}[how] * 1000 + c_major * 10 + c_minor
        if score > rank:
            best, rank = (name, how), score
    return best


def runtime():
    """What the prebuilt module must match in this process: torch, its CUDA, the visible GPUs."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "capabilities": sorted({tuple(torch.cuda.get_device_capability(i)) for i in range(count)}),
    }


def prebuilt_record(directory=None):
    """The build record of the prebuilt module in ``directory`` (the package folder), or None
    when the package was installed without it. A record that cannot be read raises."""
    path = os.path.join(directory or package_dir(), PREBUILT_RECORD)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        record = json.load(f)
    record["_path"] = os.path.join(os.path.dirname(path), record.get("library", ""))
    return record


def describe_record(record) -> str:
    """One line: what the prebuilt module was built for."""
    code = " ".join(record.get("gpu_code", [])) or "no GPU code"
    return (f"torch {record.get('torch')}, CUDA {record.get('torch_cuda')} "
            f"(nvcc {record.get('nvcc', '?')}), GPU code {code}")


def prebuilt_choice(record, current, sources_digest=None, flags=None):
    """Whether to load the prebuilt module described by ``record`` (None: none installed) in the
    process described by ``current`` (:func:`runtime`), and the one line that says why:
    ``(True, line)`` or ``(False, reason)``. ``sources_digest`` (of the shipped csrc/) and
    ``flags`` (``(CXX_FLAGS, CUDA_FLAGS)``) are compared when given: an editable install whose
    sources or flags changed after the build must not run the old module."""
    if record is None:
        return False, ("no prebuilt CUDA kernels in this install (it was installed without "
                       "LS_FAIRSEQ_BUILD_KERNELS=1)")
    if record.get("format") != PREBUILT_FORMAT:
        return False, (f"the prebuilt CUDA kernels' build record has format "
                       f"{record.get('format')!r}, this ls_fairseq reads {PREBUILT_FORMAT}: "
                       "reinstall the package")
    built = describe_record(record)
    if record.get("torch") != current["torch"]:
        return False, (f"the prebuilt CUDA kernels were built for torch {record.get('torch')}, "
                       f"this is torch {current['torch']} (rebuild the wheel with this torch)")
    if record.get("torch_cuda") != current["torch_cuda"]:
        return False, (f"the prebuilt CUDA kernels were built for CUDA {record.get('torch_cuda')}, "
                       f"this torch uses CUDA {current['torch_cuda'] or 'none (a CPU build)'}")
    if sources_digest is not None and record.get("sources") != sources_digest:
        return False, ("the prebuilt CUDA kernels were built from other sources than this "
                       "package's csrc/ (changed since the install)")
    if flags is not None and [record.get("cxx_flags"), record.get("cuda_flags")] != [
            list(flags[0]), list(flags[1])]:
        return False, ("the prebuilt CUDA kernels were built with other compiler flags than this "
                       f"package's ({record.get('cxx_flags')} / {record.get('cuda_flags')})")
    if not current["capabilities"]:
        return False, "no CUDA device is visible to torch"
    runs = []
    for capability in current["capabilities"]:
        name, how = code_for_capability(record.get("gpu_code", []), capability)
        gpu = "sm_%d%d" % tuple(capability)
        if name is None:
            return False, (f"the prebuilt CUDA kernels have no code this GPU runs ({gpu}, compute "
                           f"capability {capability[0]}.{capability[1]}; built for "
                           f"{' '.join(record.get('gpu_code', [])) or 'no GPU'}): add "
                           f"{capability[0]}.{capability[1]} to TORCH_CUDA_ARCH_LIST when "
                           "building the wheel")
        runs.append(gpu if how == "exact" else
                    f"{gpu} runs the {name} code" if how == "compatible" else
                    f"{gpu} runs the {name} PTX, compiled by the driver on first use")
    return True, (f"CUDA kernels prebuilt at install loaded ({built}; GPU "
                  f"{', '.join(runs)}): no build")


def _prebuilt_decision():
    """(record or None, line) for this process; a record that cannot be read is passed over."""
    try:
        record = prebuilt_record()
    except (OSError, ValueError) as exc:
        return None, f"the prebuilt CUDA kernels' build record is unreadable ({exc})"
    if record is None:
        return None, prebuilt_choice(None, {})[1]
    try:
        digest = _sources_digest(csrc_dir())
    except FileNotFoundError:
        digest = None  # the JIT build cannot run either; the record alone decides
    use, line = prebuilt_choice(record, runtime(), digest, (CXX_FLAGS, CUDA_FLAGS))
    return (record if use else None), line


def jit_name(directory) -> str:
    """The just-in-time build's name (its folder in torch's extensions cache). torch rebuilds when
    a listed source changes, but not when a header does: the name carries a digest of every file
    in csrc/, so any change gets its own build."""
    return f"{EXTENSION_NAME}_{_sources_digest(directory)}"


def _jit_build():
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        raise RuntimeError("nvcc was not found (set CUDA_HOME)")
    directory = csrc_dir()
    name = jit_name(directory)
    cpp_extension.load(
        name=name,
        sources=source_files(directory),
        extra_include_paths=[directory],
        extra_cflags=list(CXX_FLAGS),
        extra_cuda_cflags=CUDA_FLAGS + _arch_flags(),
        is_python_module=False,
        verbose=env_flag("LS_FAIRSEQ_VERBOSE_BUILD"),
    )
    _origin.update(kind="just in time", name=name, gpu_code=gpu_code_of_flags(_arch_flags()),
                   cache=os.environ.get("TORCH_EXTENSIONS_DIR") or "torch's default")


def _build():
    """Load the prebuilt module when it matches this process, else build just in time, with one
    log line that says which and why. Raises when neither works."""
    global _prebuilt_not_used
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible to torch")
    record, line = _prebuilt_decision()
    if record is not None:
        try:
            torch.ops.load_library(record["_path"])
        except Exception as exc:  # noqa: BLE001 - a broken module: the JIT build may still work
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            line = f"the prebuilt CUDA kernels did not load ({type(exc).__name__}: {first})"
        else:
            _origin.update(kind="prebuilt", path=record["_path"], torch=record.get("torch"),
                           torch_cuda=record.get("torch_cuda"), gpu_code=record.get("gpu_code", []))
            logger.info(f"ls_fairseq: {line}")
            return
    _prebuilt_not_used = line
    level = logging.INFO if line.startswith("no prebuilt") else logging.WARNING
    logger.log(level, f"ls_fairseq: {line}: using the just-in-time build")
    _jit_build()


def origin() -> dict:
    """How the loaded extension was obtained: ``kind`` "prebuilt" (with ``path``, ``torch``,
    ``torch_cuda``, ``gpu_code``) or "just in time" (``name``, ``gpu_code``, ``cache``); empty
    before a successful load."""
    return dict(_origin)


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
                if _prebuilt_not_used:
                    _failure_reason += f" (prebuilt kernels not used: {_prebuilt_not_used})"
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
    global _loaded, _failure_reason, _warned, _announced_cpu, _prebuilt_not_used
    _loaded, _failure_reason, _warned, _announced_cpu = None, "", False, False
    _prebuilt_not_used = ""
    _origin.clear()


refuse_bad_environment()  # when the plugin loads
