"""Kernels built at install (``LS_FAIRSEQ_BUILD_KERNELS=1``), on the CPU: no CUDA code is built.

* setup.py's decision (``kernel_build_plan``): without the switch the install is pure Python (no
  extension module, torch not even imported); with it and no toolkit, a CPU torch, no torch, or
  no architecture to build for, one line that says what is missing; with a toolchain (faked
  here), the CUDAExtension's sources and flags are the JIT build's and its record says what it
  was built for. A real ``pip wheel .`` without the switch gives a pure-Python wheel (slow).
* the loader's choice (``_extension.prebuilt_choice``) and ``_extension._build`` with the
  library loading and the JIT build mocked: no prebuilt module, another torch, another CUDA, an
  architecture the module has no code for, changed sources or flags, a module that does not
  load, each falls back to the just-in-time build with ONE log line saying why; a match loads
  the module and builds nothing. ``LS_FAIRSEQ_KERNELS=require`` raises when the fallback fails
  too, naming both reasons.
* ``python -m ls_fairseq.kernels`` works without a GPU and says what is prebuilt.
"""
import json
import logging
import os
import runpy
import subprocess
import sys
import types
import zipfile

import pytest
import torch

import ls_fairseq

from ls_fairseq import kernels
from ls_fairseq.ops import _extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP = runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="ls_fairseq_setup")
FAKE_CUDA = types.SimpleNamespace(is_cuda=True)
LOGGER = "ls_fairseq.ops._extension"
ARCH_FLAGS = ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
              "-gencode=arch=compute_90,code=compute_90"]


def toolchain(**changes):
    """A probe_toolchain result for a CUDA machine (torch 2.13.0+cu130, TORCH_CUDA_ARCH_LIST
    "8.0;9.0+PTX"), with ``changes``."""
    found = dict(torch="2.13.0+cu130", torch_cuda="13.0", torch_git="abc", cuda_home="/opt/cuda",
                 nvcc="13.0.48", gpus=[], arch_list="8.0;9.0+PTX", arch_flags=list(ARCH_FLAGS))
    found.update(changes)
    return lambda environ: found


ON = {"LS_FAIRSEQ_BUILD_KERNELS": "1"}


def written_record(plan, library="_C.cpython-311-x86_64-linux-gnu.so"):
    """The record setup.py's build command writes for ``plan`` (library name and time added)."""
    return dict(plan["record"], library=library, built="2026-01-01T00:00:00+00:00")


# ------------------------------------------------------------------ setup.py's decision
@pytest.mark.parametrize("value", [None, "", "0", "off", "False", " no "])
def test_switch_off_is_pure_python(value):
    environ = {} if value is None else {"LS_FAIRSEQ_BUILD_KERNELS": value}
    probed = []
    assert SETUP["kernel_build_plan"](environ, probe=lambda e: probed.append(e)) is None
    assert probed == []  # the toolchain is not even looked at


def test_pure_install_does_not_import_torch():
    """The decision without the switch runs before, and without, any torch import (an isolated
    build environment has no torch)."""
    code = ("import runpy, sys; g = runpy.run_path(sys.argv[1], run_name='x');"
            "assert g['kernel_build_plan']({}) is None;"
            "assert 'torch' not in sys.modules, 'setup.py imported torch';"
            "print('pure')")
    env = {k: v for k, v in os.environ.items() if k != "LS_FAIRSEQ_BUILD_KERNELS"}
    out = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "setup.py")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "pure", out.stderr[-2000:]


def _one_line_exit(environ, probe=None):
    with pytest.raises(SystemExit) as info:
        SETUP["kernel_build_plan"](environ, probe=probe)
    message = str(info.value.code)
    assert "\n" not in message and message.startswith("ls-fairseq: "), message
    return message


def test_bad_switch_value_is_one_line():
    message = _one_line_exit({"LS_FAIRSEQ_BUILD_KERNELS": "maybe"}, toolchain())
    assert "LS_FAIRSEQ_BUILD_KERNELS='maybe' is not one of 0, 1" in message


def test_switch_on_without_a_toolkit_is_one_line():
    message = _one_line_exit(ON, toolchain(cuda_home=None))
    assert "no CUDA toolkit was found (nvcc not on PATH, CUDA_HOME unset)" in message
    assert "CUDA 13.0" in message and "unset LS_FAIRSEQ_BUILD_KERNELS" in message


def test_switch_on_without_torch_or_with_a_cpu_torch_is_one_line():
    message = _one_line_exit(ON, lambda e: {"torch": None, "import_error": "No module named 'torch'"})
    assert "needs torch at build time" in message and "--no-build-isolation" in message
    message = _one_line_exit(ON, toolchain(torch="2.13.0+cpu", torch_cuda=None))
    assert "torch 2.13.0+cpu is a CPU build" in message


def test_switch_on_without_an_architecture_is_one_line():
    message = _one_line_exit(ON, toolchain(arch_list="", arch_flags=None))
    assert "TORCH_CUDA_ARCH_LIST is not set" in message and "no GPU is visible" in message
    message = _one_line_exit(ON, toolchain(arch_list="9.1", arch_flags=None,
                                           arch_error="ValueError: Unknown CUDA arch (9.1)"))
    assert "TORCH_CUDA_ARCH_LIST='9.1': ValueError: Unknown CUDA arch (9.1)" in message


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch is a CUDA build: the "
                    "real probe finds no CPU build to refuse")
def test_switch_on_with_this_cpu_torch_is_refused():
    """The real probe on a CPU torch (as in CI): the build stops at once, before any compiler."""
    message = _one_line_exit(ON)
    assert f"torch {torch.__version__} is a CPU build" in message


def test_plan_compiles_what_the_jit_build_compiles():
    plan = SETUP["kernel_build_plan"](ON, probe=toolchain())
    csrc = os.path.join(ROOT, "csrc")
    assert [os.path.join(ROOT, s) for s in plan["sources"]] == _extension.source_files(csrc)
    assert plan["sources"] and all(not os.path.isabs(s) for s in plan["sources"])
    assert plan["include_dirs"] == [csrc]
    assert plan["cxx_flags"] == _extension.CXX_FLAGS + ["-g0"]  # no debug info from Python's CFLAGS
    assert plan["nvcc_flags"] == _extension.CUDA_FLAGS + ARCH_FLAGS
    assert plan["module"] == "ls_fairseq._C" and plan["record_name"] == "_C_build.json"
    assert plan["version"] == f"{ls_fairseq.__version__}+torch2.13.0.cu130"
    record = plan["record"]
    assert record["gpu_code"] == ["sm_80", "sm_90", "compute_90"]
    assert (record["torch"], record["torch_cuda"], record["nvcc"]) == ("2.13.0+cu130", "13.0", "13.0.48")
    assert record["sources"] == _extension._sources_digest(csrc)
    assert (record["cxx_flags"], record["cuda_flags"]) == (_extension.CXX_FLAGS, _extension.CUDA_FLAGS)
    assert record["arch_list"] == "8.0;9.0+PTX"
    # without TORCH_CUDA_ARCH_LIST the visible GPUs decide (torch's flags for them)
    plan = SETUP["kernel_build_plan"](ON, probe=toolchain(arch_list="", gpus=["9.0"], arch_flags=[
        "-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_90,code=compute_90"]))
    assert plan["record"]["arch_list"] == "visible GPUs: 9.0"
    assert plan["record"]["gpu_code"] == ["sm_90", "compute_90"]


def test_the_record_setup_writes_is_one_the_loader_accepts():
    """Round trip: a module built by setup.py's plan, in a process with the same torch and an
    H100/H200 (9.0), is loaded; the record's fields are the ones the loader reads."""
    record = written_record(SETUP["kernel_build_plan"](ON, probe=toolchain()))
    current = {"torch": "2.13.0+cu130", "torch_cuda": "13.0", "capabilities": [(9, 0)]}
    digest = _extension._sources_digest(_extension.csrc_dir())
    use, line = _extension.prebuilt_choice(record, current, digest,
                                           (_extension.CXX_FLAGS, _extension.CUDA_FLAGS))
    assert use, line
    assert line == ("CUDA kernels prebuilt at install loaded (torch 2.13.0+cu130, CUDA 13.0 (nvcc "
                    "13.0.48), GPU code sm_80 sm_90 compute_90; GPU sm_90): no build")


@pytest.mark.slow
def test_plain_pip_wheel_is_pure_python(tmp_path):
    """``pip wheel .`` without the switch: a py3-none-any wheel with the CUDA sources and no
    compiled module, built without torch's build machinery."""
    env = {k: v for k, v in os.environ.items() if k != "LS_FAIRSEQ_BUILD_KERNELS"}
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                          "--no-build-isolation", "-w", str(tmp_path), ROOT],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    wheels = list(tmp_path.glob("*.whl"))
    assert [w.name for w in wheels] == [f"ls_fairseq-{ls_fairseq.__version__}-py3-none-any.whl"], wheels
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert not [n for n in names if n.endswith(".so") or n.endswith("_C_build.json")], names
    assert "ls_fairseq/csrc/layer_norm.cu" in names and "ls_fairseq/kernels.py" in names


@pytest.mark.slow
@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch is a CUDA build")
def test_pip_wheel_with_the_switch_and_a_cpu_torch_stops_with_one_line(tmp_path):
    env = dict(os.environ, LS_FAIRSEQ_BUILD_KERNELS="1")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                          "--no-build-isolation", "-w", str(tmp_path), ROOT],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode != 0 and not list(tmp_path.glob("*.whl"))
    assert "ls-fairseq: LS_FAIRSEQ_BUILD_KERNELS=1 but torch" in out.stdout + out.stderr


# ------------------------------------------------------------------ the loader's choice
def record(**changes):
    """A record as setup.py writes it, matching this package's sources and flags."""
    r = {"format": 1, "library": "_C.so", "torch": "2.13.0+cu130", "torch_cuda": "13.0",
         "nvcc": "13.0.48", "gpu_code": ["sm_80", "sm_90"],
         "sources": _extension._sources_digest(_extension.csrc_dir()),
         "cxx_flags": list(_extension.CXX_FLAGS), "cuda_flags": list(_extension.CUDA_FLAGS)}
    r.update(changes)
    return r


def running(capabilities=((9, 0),), torch_version="2.13.0+cu130", cuda="13.0"):
    return {"torch": torch_version, "torch_cuda": cuda, "capabilities": list(capabilities)}


def choice(rec, current=None):
    return _extension.prebuilt_choice(rec, current or running(),
                                      _extension._sources_digest(_extension.csrc_dir()),
                                      (_extension.CXX_FLAGS, _extension.CUDA_FLAGS))


def test_choice_no_prebuilt_module():
    assert choice(None) == (False, "no prebuilt CUDA kernels in this install (it was installed "
                                   "without LS_FAIRSEQ_BUILD_KERNELS=1)")


def test_choice_other_torch_or_cuda():
    use, why = choice(record(), running(torch_version="2.14.0+cu130"))
    assert not use
    assert why == ("the prebuilt CUDA kernels were built for torch 2.13.0+cu130, this is torch "
                   "2.14.0+cu130 (rebuild the wheel with this torch)")
    use, why = choice(record(torch_cuda="12.8"))
    assert not use and why == ("the prebuilt CUDA kernels were built for CUDA 12.8, this torch "
                               "uses CUDA 13.0")


def test_choice_missing_architecture():
    use, why = choice(record(gpu_code=["sm_80", "sm_86"]), running([(9, 0)]))
    assert not use
    assert why == ("the prebuilt CUDA kernels have no code this GPU runs (sm_90, compute "
                   "capability 9.0; built for sm_80 sm_86): add 9.0 to TORCH_CUDA_ARCH_LIST when "
                   "building the wheel")
    # one GPU of several without code is enough to fall back
    use, why = choice(record(gpu_code=["sm_90"]), running([(8, 0), (9, 0)]))
    assert not use and "(sm_80, compute capability 8.0; built for sm_90)" in why
    # arch-specific code runs on its own architecture only; SASS never on another major
    assert not choice(record(gpu_code=["sm_90a"]), running([(10, 0)]))[0]
    assert not choice(record(gpu_code=["sm_80"]), running([(9, 0)]))[0]
    assert not choice(record(gpu_code=["compute_90"]), running([(8, 9)]))[0]  # PTX: not older


def test_choice_match():
    use, line = choice(record(gpu_code=["sm_80", "sm_90"]), running([(9, 0)]))
    assert use and line == ("CUDA kernels prebuilt at install loaded (torch 2.13.0+cu130, CUDA "
                            "13.0 (nvcc 13.0.48), GPU code sm_80 sm_90; GPU sm_90): no build")
    # SASS of an older minor version of the same major runs (CUDA's binary compatibility)
    use, line = choice(record(gpu_code=["sm_80"]), running([(8, 6)]))
    assert use and line.endswith("GPU sm_86 runs the sm_80 code): no build")
    # PTX of an older architecture: the driver compiles it
    use, line = choice(record(gpu_code=["sm_80", "compute_90"]), running([(10, 0)]))
    assert use and "GPU sm_100 runs the compute_90 PTX, compiled by the driver on first use" in line
    use, line = choice(record(gpu_code=["sm_90a"]), running([(9, 0)]))
    assert use and "GPU sm_90)" in line
    use, line = choice(record(gpu_code=["sm_80", "sm_90"]), running([(8, 0), (9, 0)]))
    assert use and "GPU sm_80, sm_90)" in line


def test_choice_changed_sources_flags_or_format():
    use, why = choice(record(sources="0123456789ab"))
    assert not use and why.startswith("the prebuilt CUDA kernels were built from other sources")
    use, why = choice(record(cuda_flags=["-O2"]))
    assert not use and why.startswith("the prebuilt CUDA kernels were built with other compiler flags")
    use, why = choice(record(format=2))
    assert not use and "format 2" in why and "reinstall" in why


def test_gpu_code_of_flags():
    assert _extension.gpu_code_of_flags(ARCH_FLAGS) == ["sm_80", "sm_90", "compute_90"]
    assert _extension.gpu_code_of_flags(
        ["-gencode=arch=compute_100a,code=[sm_100a,compute_100a]", "-O3", "--generate-code=x"]
    ) == ["sm_100a", "compute_100a"]


# ------------------------------------------------------------------ the loader, mocked
@pytest.fixture
def loader(monkeypatch, tmp_path, caplog):
    """``_extension._build`` on a faked GPU (9.0, torch 2.13.0+cu130) with the package folder in
    tmp_path; ``torch.ops.load_library`` and the JIT build record their calls. ``install(rec)``
    writes a prebuilt record (and an empty module file) into the package folder."""
    monkeypatch.delenv(_extension.ENV_VAR, raising=False)
    monkeypatch.setattr(_extension, "_pending", [])  # the bindings' own callbacks stay pending
    _extension._reset_for_tests()
    calls = types.SimpleNamespace(loaded=[], jit=[], load_error=None, jit_error=None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_extension, "runtime", lambda: running())
    monkeypatch.setattr(_extension, "package_dir", lambda: str(tmp_path))

    def load_library(path):
        calls.loaded.append(path)
        if calls.load_error:
            raise calls.load_error

    def jit_build():
        calls.jit.append(1)
        if calls.jit_error:
            raise calls.jit_error

    monkeypatch.setattr(torch.ops, "load_library", load_library)
    monkeypatch.setattr(_extension, "_jit_build", jit_build)

    def install(rec):
        (tmp_path / rec["library"]).write_bytes(b"")
        (tmp_path / _extension.PREBUILT_RECORD).write_text(json.dumps(rec))

    calls.install = install
    caplog.set_level(logging.INFO, logger=LOGGER)
    calls.lines = lambda: [(r.levelname, r.getMessage()) for r in caplog.records if r.name == LOGGER]
    yield calls
    _extension._reset_for_tests()


def test_loader_without_prebuilt_module_builds_just_in_time(loader):
    assert _extension.load() is True
    assert loader.jit == [1] and loader.loaded == []
    assert loader.lines() == [("INFO", "ls_fairseq: no prebuilt CUDA kernels in this install (it was "
                                       "installed without LS_FAIRSEQ_BUILD_KERNELS=1): using the "
                                       "just-in-time build")]
    assert _extension.load() is True and loader.jit == [1]  # once per process


def test_loader_other_torch_builds_just_in_time(loader):
    loader.install(record(torch="2.12.0+cu128", torch_cuda="12.8"))
    assert _extension.load() is True
    assert loader.jit == [1] and loader.loaded == []
    assert loader.lines() == [("WARNING", "ls_fairseq: the prebuilt CUDA kernels were built for torch "
                                          "2.12.0+cu128, this is torch 2.13.0+cu130 (rebuild the "
                                          "wheel with this torch): using the just-in-time build")]


def test_loader_missing_architecture_builds_just_in_time(loader):
    loader.install(record(gpu_code=["sm_80"]))
    assert _extension.load() is True
    assert loader.jit == [1] and loader.loaded == []
    [(level, line)] = loader.lines()
    assert level == "WARNING" and "\n" not in line
    assert line.startswith("ls_fairseq: the prebuilt CUDA kernels have no code this GPU runs (sm_90")
    assert line.endswith("add 9.0 to TORCH_CUDA_ARCH_LIST when building the wheel: using the "
                         "just-in-time build")


def test_loader_match_loads_the_prebuilt_module(loader, tmp_path):
    loader.install(record())
    assert _extension.load() is True
    assert loader.loaded == [str(tmp_path / "_C.so")] and loader.jit == []
    assert loader.lines() == [("INFO", "ls_fairseq: CUDA kernels prebuilt at install loaded (torch "
                                       "2.13.0+cu130, CUDA 13.0 (nvcc 13.0.48), GPU code sm_80 "
                                       "sm_90; GPU sm_90): no build")]
    assert _extension.origin() == {"kind": "prebuilt", "path": str(tmp_path / "_C.so"),
                                   "torch": "2.13.0+cu130", "torch_cuda": "13.0",
                                   "gpu_code": ["sm_80", "sm_90"]}


def test_loader_module_that_does_not_load_builds_just_in_time(loader):
    loader.install(record())
    loader.load_error = OSError("_C.so: undefined symbol: _ZN3c10foo\nsecond line")
    assert _extension.load() is True
    assert loader.jit == [1] and len(loader.loaded) == 1
    assert loader.lines() == [("WARNING", "ls_fairseq: the prebuilt CUDA kernels did not load "
                                          "(OSError: _C.so: undefined symbol: _ZN3c10foo): using "
                                          "the just-in-time build")]


def test_loader_unreadable_record_builds_just_in_time(loader, tmp_path):
    (tmp_path / _extension.PREBUILT_RECORD).write_text("{not json")
    assert _extension.load() is True and loader.jit == [1]
    [(level, line)] = loader.lines()
    assert level == "WARNING" and "build record is unreadable" in line


def test_require_names_both_reasons_when_the_fallback_fails(loader, monkeypatch):
    """A node without nvcc and a wheel for another torch: require raises, naming the JIT
    failure and why the prebuilt module was passed over; auto warns once with the same."""
    loader.install(record(torch="2.12.0+cu128"))
    loader.jit_error = RuntimeError("nvcc was not found (set CUDA_HOME)")
    monkeypatch.setenv(_extension.ENV_VAR, "require")
    with pytest.raises(RuntimeError) as info:
        _extension.use_kernels(FAKE_CUDA)
    message = str(info.value)
    assert "\n" not in message
    assert message == ("LS_FAIRSEQ_KERNELS=require but the ls_fairseq CUDA extension is "
                       "unavailable: RuntimeError: nvcc was not found (set CUDA_HOME) (prebuilt "
                       "kernels not used: the prebuilt CUDA kernels were built for torch "
                       "2.12.0+cu128, this is torch 2.13.0+cu130 (rebuild the wheel with this "
                       "torch))")
    monkeypatch.setenv(_extension.ENV_VAR, "auto")
    with pytest.warns(RuntimeWarning, match="nvcc was not found.*prebuilt kernels not used"):
        assert _extension.use_kernels(FAKE_CUDA) is False


def test_require_with_a_matching_module_needs_no_nvcc(loader, monkeypatch):
    loader.install(record())
    loader.jit_error = RuntimeError("nvcc was not found (set CUDA_HOME)")
    monkeypatch.setenv(_extension.ENV_VAR, "require")
    assert _extension.use_kernels(FAKE_CUDA) is True
    assert loader.jit == [] and len(loader.loaded) == 1


# ------------------------------------------------------------------ python -m ls_fairseq.kernels
def test_kernels_report_without_a_gpu(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(_extension, "package_dir", lambda: str(tmp_path))
    assert kernels.main([]) == 0
    text = capsys.readouterr().out
    assert "GPUs: no CUDA device" in text
    assert "prebuilt: none in this install" in text
    assert "this process: the PyTorch reference path: no CUDA device." in text
    ops = kernels.defined_ops(_extension.csrc_dir())
    assert {"layer_norm_fwd", "multi_tensor_adam", "ls_cross_entropy_fwd"} <= set(ops)
    assert f"kernels ({len(ops)} ops in csrc/)" in text
    # a prebuilt module: what it was built for, and what a GPU would do with it
    rec = record(arch_list="8.0;9.0", built="2026-01-01T00:00:00+00:00", torch=torch.__version__,
                 torch_cuda=torch.version.cuda)
    (tmp_path / _extension.PREBUILT_RECORD).write_text(json.dumps(rec))
    assert kernels.main([]) == 0
    text = capsys.readouterr().out
    assert f"prebuilt: {tmp_path / '_C.so'} (MISSING)" in text
    assert f"built 2026-01-01T00:00:00+00:00 for torch {torch.__version__}" in text
    assert "GPU code sm_80 sm_90 (TORCH_CUDA_ARCH_LIST: 8.0;9.0)" in text
    assert "(same as the shipped csrc/)" in text
    assert ("On a GPU: the prebuilt module where its GPU code runs (sm_80 sm_90), else the "
            "just-in-time build") in text
    monkeypatch.setenv(_extension.ENV_VAR, "off")
    assert kernels.main([]) == 0
    assert "this process: the PyTorch reference path (LS_FAIRSEQ_KERNELS=off); without it: " in \
        capsys.readouterr().out
    monkeypatch.delenv(_extension.ENV_VAR)
    assert kernels.main(["--load"]) == 1  # nothing to load without a GPU
    capsys.readouterr()
    assert kernels.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["gpus"] == [] and report["choice"]["build"] == "none"
    assert report["prebuilt"]["gpu_code"] == ["sm_80", "sm_90"]


def test_kernels_module_runs_as_a_script():
    env = {k: v for k, v in os.environ.items() if not k.startswith("LS_FAIRSEQ_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-m", "ls_fairseq.kernels"], capture_output=True,
                         text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith(f"ls_fairseq {ls_fairseq.__version__} (")
    if not torch.cuda.is_available():
        assert "GPUs: no CUDA device" in out.stdout
