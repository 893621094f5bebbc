"""ls-fairseq: a fairseq --user-dir plugin with fused CUDA kernels for Transformer NMT training.

`pip install .` (editable or not) ships the CUDA sources of `csrc/` inside the package
(`ls_fairseq/csrc/`), so the just-in-time build on first GPU use finds them anywhere. The
install stays pure Python and needs no torch at build time.

`LS_FAIRSEQ_BUILD_KERNELS=1 pip install --no-build-isolation .` (or `pip wheel`) also compiles
the kernels at install with torch's `CUDAExtension` into `ls_fairseq/_C*.so`, for the GPU
architectures in `TORCH_CUDA_ARCH_LIST` (else the visible GPUs'), and writes its build record
`ls_fairseq/_C_build.json` beside it (torch, CUDA, GPU code, flags, sources digest): the loader
(`ls_fairseq/ops/_extension.py`) uses the module only where the record matches. It needs the
CUDA build of torch importable (hence `--no-build-isolation`) and the CUDA toolkit (nvcc);
without either, the install stops with one line that says what is missing rather than quietly
giving a wheel without kernels. docs/RECIPES.md: one wheel for a cluster.
"""
import datetime
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
# the one place the version lives is the package (read as text: setup.py must not import torch)
VERSION = re.search(r'^__version__ = "([^"]+)"', open(os.path.join(HERE, "ls_fairseq", "__init__.py")).read(),
                    re.M).group(1)
SWITCH = "LS_FAIRSEQ_BUILD_KERNELS"
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


class BuildPyWithCSrc(build_py):
    """Copy the top-level csrc/ into the built package as ls_fairseq/csrc/."""

    def run(self):
        super().run()
        src = os.path.join(HERE, "csrc")
        dst = os.path.join(self.build_lib, "ls_fairseq", "csrc")
        if os.path.isdir(src):
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.o", "*.so"))


class KernelBuildError(SystemExit):
    """The install-time build cannot run: one line (``ls-fairseq: ...``), exit status 1."""

    def __init__(self, message):
        super().__init__(f"ls-fairseq: {message}")


def wants_kernels(environ=os.environ) -> bool:
    """Whether ``LS_FAIRSEQ_BUILD_KERNELS`` asks for the install-time build (read without torch)."""
    value = environ.get(SWITCH, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise KernelBuildError(f"{SWITCH}={environ[SWITCH]!r} is not one of 0, 1 (or false/true, "
                           f"no/yes, off/on): set it to 1 to build the CUDA kernels at install, "
                           f"or unset it for a pure-Python install")


def _extension_module():
    """ls_fairseq/ops/_extension.py loaded on its own (not the package, which imports fairseq):
    the flags, sources and record format of the JIT build and the loader, in one place."""
    path = os.path.join(HERE, "ls_fairseq", "ops", "_extension.py")
    spec = importlib.util.spec_from_file_location("_ls_fairseq_setup_extension", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def probe_toolchain(environ=os.environ) -> dict:
    """What the install-time build needs, as found here: torch (None when it cannot be
    imported), its CUDA version, the toolkit (CUDA_HOME, nvcc version), the visible GPUs, and
    the nvcc architecture flags for TORCH_CUDA_ARCH_LIST (or an error text)."""
    found = {"torch": None, "arch_list": environ.get("TORCH_CUDA_ARCH_LIST", "").strip()}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        found["import_error"] = str(exc)
        return found
    found.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
                 torch_git=getattr(torch.version, "git_version", None),
                 cuda_home=cpp_extension.CUDA_HOME,
                 gpus=[".".join(map(str, torch.cuda.get_device_capability(i)))
                       for i in range(torch.cuda.device_count())] if torch.version.cuda else [])
    if found["cuda_home"]:
        nvcc = os.path.join(found["cuda_home"], "bin", "nvcc")
        try:
            out = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout
            match = re.search(r"release [\d.]+, V([\d.]+)", out)
            found["nvcc"] = match.group(1) if match else None
        except OSError:
            found["nvcc"] = None
    if found["arch_list"] not in ("", "native") or found["gpus"]:
        try:  # torch's own reading of TORCH_CUDA_ARCH_LIST (named arches, +PTX), or the GPUs'
            found["arch_flags"] = cpp_extension._get_cuda_arch_flags()
        except Exception as exc:  # noqa: BLE001 - an unknown arch: reported by kernel_build_plan
            found["arch_error"] = f"{type(exc).__name__}: {exc}"
    return found


def kernel_build_plan(environ=os.environ, probe=None):
    """None for the pure-Python install (switch off); else what the install-time build compiles
    and records. :class:`KernelBuildError` (one line) when the switch is on and the build cannot
    run. ``probe`` stands for :func:`probe_toolchain` (tests)."""
    if not wants_kernels(environ):
        return None
    found = probe(environ) if probe else probe_toolchain(environ)
    if found.get("torch") is None:
        raise KernelBuildError(
            f"{SWITCH}=1 needs torch at build time ({found.get('import_error', 'not found')}): "
            "install the CUDA build of torch you train with, then run pip with "
            "--no-build-isolation")
    if not found.get("torch_cuda"):
        raise KernelBuildError(
            f"{SWITCH}=1 but torch {found['torch']} is a CPU build: install the CUDA build of "
            f"torch you train with, or unset {SWITCH} (kernels built just in time on the GPU)")
    if not found.get("cuda_home"):
        raise KernelBuildError(
            f"{SWITCH}=1 but no CUDA toolkit was found (nvcc not on PATH, CUDA_HOME unset): "
            f"install the toolkit for torch's CUDA {found['torch_cuda']} or set CUDA_HOME, or "
            f"unset {SWITCH} (kernels built just in time on the GPU)")
    if found.get("arch_error"):
        raise KernelBuildError(
            f"TORCH_CUDA_ARCH_LIST={found['arch_list']!r}: {found['arch_error']} "
            "(e.g. TORCH_CUDA_ARCH_LIST=\"8.0;9.0\")")
    flags = found.get("arch_flags")
    if not flags:
        raise KernelBuildError(
            f"{SWITCH}=1 but TORCH_CUDA_ARCH_LIST is not set (or 'native') and no GPU is visible: set it to the "
            "compute capabilities of the GPUs the build is for, e.g. TORCH_CUDA_ARCH_LIST=\"8.0;9.0\"")
    ext = _extension_module()
    code = ext.gpu_code_of_flags(flags)
    csrc = os.path.join(HERE, "csrc")
    return {
        "sources": [os.path.relpath(p, HERE) for p in ext.source_files(csrc)],
        "include_dirs": [csrc],
        # setuptools' C++ compiles also take Python's own CFLAGS, whose -g the JIT build has not
        # (debug info was 7 of a 10.7 MB module): -g0 last turns it off
        "cxx_flags": list(ext.CXX_FLAGS) + ["-g0"],
        "nvcc_flags": list(ext.CUDA_FLAGS) + list(flags),
        "module": ext.PREBUILT_MODULE,
        "record_name": ext.PREBUILT_RECORD,
        # a local version label names the torch the wheel is for (and makes pip replace a
        # pure-Python install of the same release)
        "version": f"{VERSION}+torch{re.sub(r'[^A-Za-z0-9.]', '.', found['torch'])}",
        "record": {
            "format": ext.PREBUILT_FORMAT,
            "torch": found["torch"],
            "torch_cuda": found["torch_cuda"],
            "torch_git": found.get("torch_git"),
            "nvcc": found.get("nvcc"),
            "gpu_code": code,
            "arch_flags": list(flags),
            "arch_list": found["arch_list"] or "visible GPUs: " + ";".join(found["gpus"]),
            "cxx_flags": list(ext.CXX_FLAGS),
            "cuda_flags": list(ext.CUDA_FLAGS),
            "sources": ext._sources_digest(csrc),
            "python": platform.python_version(),
            "ls_fairseq": VERSION,
        },
    }


def kernel_build_command(plan):
    """torch's BuildExtension, writing the build record beside each module it builds."""
    from torch.utils.cpp_extension import BuildExtension

    class BuildKernels(BuildExtension):
        def run(self):
            super().run()
            for ext in self.extensions:
                path = self._record_path(ext)
                record = dict(plan["record"], library=os.path.basename(self.get_ext_fullpath(ext.name)),
                              built=datetime.datetime.now(datetime.timezone.utc).isoformat(
                                  timespec="seconds"))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as f:
                    json.dump(record, f, indent=1, sort_keys=True)
                    f.write("\n")

        def _record_path(self, ext):
            return os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), plan["record_name"])

        def get_outputs(self):
            return super().get_outputs() + [self._record_path(e) for e in self.extensions]

    return BuildKernels


def main():
    plan = kernel_build_plan()
    extra = {}
    if plan:
        from torch.utils.cpp_extension import CUDAExtension

        extra["ext_modules"] = [CUDAExtension(
            name=plan["module"], sources=plan["sources"], include_dirs=plan["include_dirs"],
            extra_compile_args={"cxx": plan["cxx_flags"], "nvcc": plan["nvcc_flags"]})]
        print(f"ls-fairseq: building the CUDA kernels at install for {' '.join(plan['record']['gpu_code'])} "
              f"(torch {plan['record']['torch']}, CUDA {plan['record']['torch_cuda']})", file=sys.stderr)
    setup(
        name="ls-fairseq",
        version=plan["version"] if plan else VERSION,
        description="LightSeq2-style fused kernels for fairseq Transformer NMT training, as a --user-dir plugin",
        long_description=open(os.path.join(HERE, "README.md")).read(),
        long_description_content_type="text/markdown",
        packages=find_packages(include=["ls_fairseq", "ls_fairseq.*"]),
        python_requires=">=3.9",
        install_requires=[
            # torch is not pinned: the CUDA build must use the torch the user already has (a
            # prebuilt wheel checks its torch when it loads, and builds just in time otherwise)
            "torch>=2.1",
            "fairseq-fixed==0.12.3.1",
        ],
        extras_require={
            # ls-fairseq-compare's table needs only the standard library; its plots need matplotlib
            "compare": ["matplotlib"],
            "test": ["pytest", "pytest-xdist", "pandas", "matplotlib", "sacrebleu", "subword-nmt", "sacremoses"],
        },
        entry_points={
            "console_scripts": [
                "ls-fairseq-convert=ls_fairseq.cli.convert_checkpoint:main",
                "ls-fairseq-compare=ls_fairseq.cli.compare:main",
                "ls-fairseq-quickstart=ls_fairseq.cli.quickstart:main",
            ]
        },
        cmdclass=dict({"build_py": BuildPyWithCSrc},
                      **({"build_ext": kernel_build_command(plan)} if plan else {})),
        zip_safe=False,
        **extra,
    )


# pip runs this file as __main__ (setuptools' build backend too); tests import its functions
if __name__ == "__main__":
    main()
