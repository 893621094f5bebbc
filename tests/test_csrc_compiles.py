"""Every CUDA/C++ source in csrc/ compiles with nvcc against torch's headers (CPU-only CI check).

The GPU build (``ls_fairseq/ops/_extension.py``) compiles all of csrc/ just in time into one
extension; a file that does not compile breaks every kernel at once, and without a GPU nothing
else would notice. This test compiles each file on its own (``nvcc -c``, no link) with the flags
of the JIT build, taken from torch's own build-file writer for ``_extension._build``'s arguments
(torch's nvcc flags: no implicit half/bfloat16 conversions, relaxed constexpr; the C++ standard
torch chooses; ``_extension.CUDA_FLAGS`` / ``CXX_FLAGS``; the extension defines and include
paths), for sm_90 (H100/H200; the JIT build targets the running GPU), then links the objects
into one shared library as the JIT build does (catching a non-inline definition in a shared
header, which compiles per file but breaks the link). The tests skip only when no nvcc is found.

When it runs: nvcc on all of csrc/ takes about 6 minutes of two cores, for a check whose answer
changes only when the build's inputs change. So the nvcc tests (marker ``csrc``) run when
``-m`` names the marker (``bash scripts/run_tests.sh -m csrc``) or when the build's inputs
(csrc/, and ``ls_fairseq/ops/_extension.py`` with the flags) differ from the merge base with the
main branch (``origin/main``, else ``main``), working-tree edits and untracked files included;
on the main branch itself (the merge base is the checkout), the base is the first parent, so
CI's run of a merge or commit that changes csrc/ compiles it. When that cannot be told (no git,
no main branch, a shallow clone without the parent) they run too: a check skipped on an
unknown would let a broken kernel file pass. Why git history and not a cache: a cache keyed by a
hash of csrc/ is empty on every clean checkout (CI, a fresh clone), so it would compile every
time; the history is in every clone and CI's checkout. Either way tests/conftest.py prints one
line that says whether it runs and why, before the compile starts, and at the end. All files
compile in parallel, one nvcc per core (each file is still its own test), so the whole check
takes half its serial time on the 2-core CI machine. The cheap source checks below
(``test_sources_found``, ``test_registers_with_fragment``) always run.

A CPU-only torch wheel ships the ATen/c10 CUDA headers but not ``c10/cuda/impl/cuda_cmake_macros.h``
(generated at torch's build) nor the CUDA math libraries' headers that ``ATen/cuda/CUDAContext.h``
and ``ATen/cuda/Exceptions.h`` include (cuBLAS, cuSPARSE, cuSOLVER). When, and only when, one of
those is missing, a stand-in is generated that declares only their opaque handle and status types:
enough for torch's headers, not for code that calls those libraries itself, which then fails here
(GEMMs go through torch; a kernel file should not call cuBLAS directly).
"""
import inspect
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.utils import cpp_extension

from ls_fairseq.ops import _extension

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(REPO, "csrc")
SOURCES = _extension.source_files(CSRC)
ARCH_FLAGS = ["-gencode=arch=compute_90,code=sm_90"]
PER_FILE_TIMEOUT_S = 600
#: what the extension's build depends on, relative to the repository root (see the module doc)
BUILD_INPUTS = ("csrc", "ls_fairseq/ops/_extension.py")
MAIN_REFS = ("origin/main", "main")


def _git(*args):
    try:
        proc = subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def csrc_check_decision(asked=False):
    """(run, why): whether the nvcc tests run in this checkout (the rule: module doc)."""
    if asked:
        return True, "asked for (-m names csrc)"
    if _git("rev-parse", "--is-inside-work-tree") != "true":
        return True, "not a git checkout, so whether csrc/ changed cannot be told"
    head = _git("rev-parse", "HEAD")
    main = next((ref for ref in MAIN_REFS if _git("rev-parse", "--verify", "-q", ref)), None)
    if main is None:
        return True, f"no {' or '.join(MAIN_REFS)} branch to compare csrc/ with"
    base = _git("merge-base", "HEAD", main)
    where = f"the merge base with {main}"
    if base == head:  # on the main branch: what its last commit or merge brought
        base, where = _git("rev-parse", "--verify", "-q", "HEAD^1"), "HEAD^1 (on the main branch)"
    if not base:
        return True, f"no commit to compare csrc/ with ({where} is missing: shallow clone?)"
    changed = (_git("diff", "--name-only", base, "--", *BUILD_INPUTS) or "").split()
    changed += (_git("ls-files", "--others", "--exclude-standard", "--", *BUILD_INPUTS)
                or "").split()
    short = base[:10]
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        return True, (f"{shown} changed since {short}, {where}; nvcc on {len(SOURCES)} files, "
                      f"{_jobs()} at a time (about 6 minutes of one core)")
    return False, f"csrc/ unchanged since {short}, {where}"

# Header -> stand-in text (opaque types only), generated only if the header is missing.
_STANDINS = {
    "c10/cuda/impl/cuda_cmake_macros.h": "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n",
    "cublas_v2.h": (
        "#pragma once\n"
        "typedef struct cublasContext* cublasHandle_t;\n"
        "typedef enum { CUBLAS_STATUS_SUCCESS = 0 } cublasStatus_t;\n"
    ),
    "cublasLt.h": (
        "#pragma once\n#include <cublas_v2.h>\n"
        "typedef struct cublasLtContext* cublasLtHandle_t;\n"
    ),
    "cusparse.h": (
        "#pragma once\n"
        "typedef struct cusparseContext* cusparseHandle_t;\n"
        "typedef enum { CUSPARSE_STATUS_SUCCESS = 0 } cusparseStatus_t;\n"
        "const char* cusparseGetErrorString(cusparseStatus_t status);\n"
    ),
    "cusolver_common.h": (
        "#pragma once\ntypedef enum { CUSOLVER_STATUS_SUCCESS = 0 } cusolverStatus_t;\n"
    ),
    "cusolverDn.h": (
        "#pragma once\n#include <cusolver_common.h>\n"
        "typedef struct cusolverDnContext* cusolverDnHandle_t;\n"
    ),
}


def _cuda_home():
    """The CUDA toolkit root (the folder with bin/nvcc and include/cuda_runtime.h)."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), cpp_extension.CUDA_HOME,
                  "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:  # may be a wrapper script: also try the folder above its real location
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for home in candidates:
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")) and os.path.exists(
            os.path.join(home, "include", "cuda_runtime.h")
        ):
            return home
    return None


CUDA_HOME = _cuda_home()
NVCC = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None


def _system_includes():
    torch_include = os.path.join(os.path.dirname(torch.__file__), "include")
    paths = [torch_include, os.path.join(torch_include, "torch", "csrc", "api", "include")]
    paths.append(os.path.join(CUDA_HOME, "include"))
    targets = os.path.join(CUDA_HOME, "targets", "x86_64-linux", "include")
    if os.path.isdir(targets):
        paths.append(targets)
    py_include = sysconfig.get_path("include", scheme="posix_prefix")
    if py_include:
        paths.append(py_include)
    return paths


@pytest.fixture(scope="module")
def standin_dir(tmp_path_factory):
    """A folder with stand-ins for the headers missing from this machine (see module doc)."""
    root = tmp_path_factory.mktemp("standin_headers")
    present = _system_includes()
    made = []
    for header, text in _STANDINS.items():
        if any(os.path.exists(os.path.join(d, header)) for d in present):
            continue
        path = root / header
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        made.append(header)
    if made:
        print(f"stand-in headers for this machine: {', '.join(made)}", file=sys.stderr)
    return str(root)


def _jit_flags():
    """(cxx flags, nvcc flags) exactly as torch's JIT build writes them into its build.ninja for
    ``_extension._build`` (same extra flags, includes, defines, language standard), captured from
    cpp_extension's own ninja writer; None if this torch's private writer has another shape."""
    captured = {}

    def capture(**kwargs):
        captured.update(kwargs)

    writer = getattr(cpp_extension, "_write_ninja_file_to_build_library", None)
    if writer is None or not hasattr(cpp_extension, "_write_ninja_file"):
        return None
    params = inspect.signature(writer).parameters
    kwargs = dict(
        path=os.devnull, name=_extension.EXTENSION_NAME, sources=SOURCES,
        extra_cflags=list(_extension.CXX_FLAGS),
        extra_cuda_cflags=list(_extension.CUDA_FLAGS) + ARCH_FLAGS,
        extra_sycl_cflags=[], extra_ldflags=[], extra_include_paths=[CSRC], with_cuda=True,
        with_sycl=False, is_standalone=False,
    )
    original, original_home = cpp_extension._write_ninja_file, cpp_extension.CUDA_HOME
    cpp_extension._write_ninja_file = capture
    cpp_extension.CUDA_HOME = CUDA_HOME  # a CPU-only torch does not look for the toolkit
    try:
        writer(**{k: v for k, v in kwargs.items() if k in params})
    except Exception:  # noqa: BLE001 - private API of another shape: use the manual flags
        return None
    finally:
        cpp_extension._write_ninja_file, cpp_extension.CUDA_HOME = original, original_home
    if not captured.get("cflags") or not captured.get("cuda_cflags"):
        return None
    return list(captured["cflags"]), list(captured["cuda_cflags"])


def _manual_flags():
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    common = [
        f"-DTORCH_EXTENSION_NAME={_extension.EXTENSION_NAME}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{shlex.quote(CSRC)}",
    ] + [f"-isystem {shlex.quote(p)}" for p in _system_includes()]
    std = [] if any(f.startswith("-std=") for f in _extension.CUDA_FLAGS) else ["-std=c++20"]
    cuda = (common + list(cpp_extension.COMMON_NVCC_FLAGS) + ["--compiler-options", "'-fPIC'"]
            + list(_extension.CUDA_FLAGS) + ARCH_FLAGS + std)
    cxx = common + ["-fPIC", "-std=c++20"] + list(_extension.CXX_FLAGS)
    return cxx, cuda


def _command(source, output, standin):
    """A shell command line (the flags are shell-quoted, as in build.ninja)."""
    flags = _jit_flags() or _manual_flags()
    cxx_flags, cuda_flags = flags
    extra = [f"-isystem {shlex.quote(standin)}"]  # stand-ins last: real headers win
    if source.endswith(".cu"):
        parts = [shlex.quote(NVCC)] + cuda_flags + extra
    else:  # .cpp: the JIT build hands it to the host compiler
        parts = [shlex.quote(os.environ.get("CXX", "c++"))] + cxx_flags + extra
    return " ".join(parts + ["-c", shlex.quote(source), "-o", shlex.quote(output)])


def test_sources_found():
    assert SOURCES, f"no *.cu / *.cpp in {CSRC}"
    assert _extension.source_files(_extension.csrc_dir()), "the loader finds no CUDA sources"


@pytest.mark.parametrize("source", SOURCES, ids=[os.path.basename(s) for s in SOURCES])
def test_registers_with_fragment(source):
    """All files share the ``ls_fairseq`` op namespace: only TORCH_LIBRARY_FRAGMENT may declare it
    (a second ``TORCH_LIBRARY(ls_fairseq, ...)`` makes loading the extension fail)."""
    text = open(source).read()
    assert not re.search(r"\bTORCH_LIBRARY\s*\(", text), (
        f"{os.path.basename(source)} uses TORCH_LIBRARY(...); use TORCH_LIBRARY_FRAGMENT(ls_fairseq, m)"
    )


@pytest.fixture(scope="module")
def object_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("objects")


def _compile(source, output, standin):
    """(command, exit status or None on a timeout, log, seconds) of one file's compile."""
    cmd = _command(source, output, standin)
    start = time.time()
    try:
        proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True,
                              timeout=PER_FILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return cmd, None, "", time.time() - start
    return cmd, proc.returncode, proc.stdout + proc.stderr, time.time() - start


def _jobs():
    return max(1, os.cpu_count() or 1)


@pytest.fixture(scope="module")
def compiled(standin_dir, object_dir):
    """Every source compiled once, one nvcc per core: source -> _compile's tuple."""
    outputs = {s: str(object_dir / (os.path.basename(s) + ".o")) for s in SOURCES}
    with ThreadPoolExecutor(max_workers=_jobs()) as pool:
        futures = {s: pool.submit(_compile, s, outputs[s], standin_dir) for s in SOURCES}
        return {s: f.result() for s, f in futures.items()}


@pytest.mark.csrc
@pytest.mark.skipif(NVCC is None, reason="nvcc not found (set CUDA_HOME or put nvcc on PATH)")
@pytest.mark.parametrize("source", SOURCES, ids=[os.path.basename(s) for s in SOURCES])
def test_compiles(source, compiled, object_dir):
    output = str(object_dir / (os.path.basename(source) + ".o"))
    cmd, status, log, elapsed = compiled[source]
    if status is None:
        pytest.fail(f"nvcc took more than {PER_FILE_TIMEOUT_S} s on {os.path.basename(source)}")
    if status != 0:
        log = log.strip().splitlines()
        pytest.fail(
            f"{os.path.basename(source)} does not compile (nvcc exit {status}, "
            f"{elapsed:.0f} s):\n" + "\n".join(log[-80:]) + "\ncommand: " + cmd
        )
    assert os.path.getsize(output) > 0
    print(f"{os.path.basename(source)}: compiled in {elapsed:.0f} s", file=sys.stderr)


@pytest.mark.csrc
@pytest.mark.skipif(NVCC is None, reason="nvcc not found (set CUDA_HOME or put nvcc on PATH)")
def test_objects_link_into_one_library(compiled, object_dir):
    """The objects of test_compiles link into one shared library (torch's libraries stay
    unresolved here, as a shared library allows): a symbol defined in two objects fails."""
    objects = sorted(str(object_dir / (os.path.basename(s) + ".o")) for s in SOURCES)
    missing = [o for o in objects if not os.path.exists(o)]
    if missing:
        pytest.fail(f"not compiled (see test_compiles): {', '.join(map(os.path.basename, missing))}")
    cmd = [os.environ.get("CXX", "c++"), "-shared", "-o", str(object_dir / "linked.so")] + objects
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PER_FILE_TIMEOUT_S)
    assert proc.returncode == 0, "csrc objects do not link:\n" + (proc.stdout + proc.stderr)[-4000:]



# Undefined symbols of the objects that torch's CPU libraries cannot show here: the CUDA
# runtime and torch's CUDA libraries (absent from the CPU wheel), the C and C++ runtimes
ELSEWHERE = re.compile(r"^(?:cuda|__cuda|__nv|c10::cuda::|at::cuda::|at::CUDAGeneratorImpl::|"
                       r"(?:vtable|VTT|typeinfo|typeinfo name) for (?:std|__cxxabiv1)::|std::|"
                       r"operator (?:new|"
                       r"delete)|TLS init function for |__cxa|__gxx|_Unwind|[A-Za-z_][A-Za-z0-9_]*$)")


@pytest.mark.csrc
@pytest.mark.skipif(NVCC is None or shutil.which("nm") is None or shutil.which("c++filt") is None,
                    reason="nvcc, nm or c++filt not found")
def test_objects_need_only_symbols_torch_defines(compiled, object_dir):
    """Every symbol the objects of test_compiles leave undefined is defined by another of them, by
    torch's CPU libraries, or lives where this machine cannot look (ELSEWHERE: CUDA, the C and C++
    runtimes). A template torch does not instantiate (``data_ptr<long long>``: int64 is ``long``
    here) compiles but leaves the extension unloadable on the GPU, every kernel with it."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    nm = lambda *a: subprocess.run(["nm", *a], capture_output=True, text=True).stdout.split("\n")
    defined = set()
    for name in ("libtorch_cpu.so", "libc10.so", "libtorch.so"):
        if os.path.exists(os.path.join(lib, name)):
            defined |= {l.split()[-1] for l in nm("-D", "--defined-only", os.path.join(lib, name))
                        if l.strip()}
    assert defined, f"no symbols read from torch's libraries in {lib}"
    objects = sorted(str(object_dir / (os.path.basename(s) + ".o")) for s in SOURCES)
    missing = [o for o in objects if not os.path.exists(o)]
    if missing:
        pytest.fail(f"not compiled (see test_compiles): {', '.join(map(os.path.basename, missing))}")
    for o in objects:
        defined |= {l.split()[-1] for l in nm("--defined-only", o) if l.strip()}
    bad = {}
    for o in objects:
        undefined = [l.split()[-1] for l in nm("--undefined-only", o) if l.strip()]
        unknown = [u for u in undefined if u not in defined]
        names = subprocess.run(["c++filt"], input="\n".join(unknown), capture_output=True,
                               text=True).stdout.split("\n") if unknown else []
        names = [n for n in names if n and not ELSEWHERE.match(n)]
        if names:
            bad[os.path.basename(o)] = names
    assert not bad, f"symbols no library defines (the extension would not load): {bad}"
