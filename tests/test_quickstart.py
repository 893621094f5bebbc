"""The quickstart from a source checkout (``bash scripts/quickstart.sh``), without training.

* its work folder is outside the source tree by default;
* the launcher runs the installed package, not the checkout's ``ls_fairseq``, and installs the
  torch the README names (the CPU build on a machine without an NVIDIA GPU);
* on CPU it says, in one line, why the ls_ run is no faster than the baseline, and its table's
  speed rows say that it is not a speed test (with the load seen), without tflops/mfu rows.

(A real CPU quickstart run: tests/test_recipes.py.)
"""
import os
import subprocess
import sys

import pytest
import torch

from ls_fairseq.cli import quickstart

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_default_workdir_is_outside_the_source_tree(tmp_path):
    for cwd in (ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "ls_fairseq", "cli")):
        assert quickstart.source_checkout(cwd) == ROOT
        work = quickstart.default_workdir(cwd)
        assert work == os.path.join(os.path.dirname(ROOT), "ls_fairseq_quickstart")
        assert not work.startswith(ROOT + os.sep)
    # anywhere else: ./ls_fairseq_quickstart, as before
    assert quickstart.source_checkout(str(tmp_path)) is None
    assert quickstart.default_workdir(str(tmp_path)) == str(tmp_path / "ls_fairseq_quickstart")


def test_the_work_folder_is_ignored_in_the_checkout():
    # belt and braces for an explicit --workdir ls_fairseq_quickstart inside the checkout
    proc = subprocess.run(["git", "check-ignore", "-q", "ls_fairseq_quickstart/runs/ls/x.pt"],
                          cwd=ROOT, capture_output=True)
    if proc.returncode == 128:
        pytest.skip("not a git checkout")
    assert proc.returncode == 0


STUB = '''import os, sys
def main(argv):
    print("stub quickstart from", os.path.dirname(os.path.dirname(os.path.abspath(__file__))), argv)
    return 0
'''

FAKE_PYTHON = '''#!/usr/bin/env bash
# pip installs are recorded, not done; with FAKE_NO_TORCH set, torch is missing; everything else
# runs the real interpreter
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "pip ${*:3}" >> "$PIP_LOG"; exit 0; fi
if [ -n "$FAKE_NO_TORCH" ] && [ "$1" = "-c" ] && [ "$2" = "import torch" ]; then exit 1; fi
exec "$REAL_PYTHON" "$@"
'''


def _stub_site(tmp_path):
    """A site-packages folder whose ls_fairseq holds only the quickstart stub (STUB)."""
    site = tmp_path / "site"
    (site / "ls_fairseq" / "cli").mkdir(parents=True)
    (site / "ls_fairseq" / "__init__.py").write_text("")
    (site / "ls_fairseq" / "cli" / "__init__.py").write_text("")
    (site / "ls_fairseq" / "cli" / "quickstart.py").write_text(STUB)
    return site


def test_quickstart_sh_runs_the_installed_package_not_the_checkout(tmp_path):
    """Started from the checkout, the launcher must import the installed ls_fairseq (here a stub
    standing in for site-packages), not the source tree's, which ``python -m`` would pick."""
    site = _stub_site(tmp_path)
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake), REAL_PYTHON=sys.executable, PYTHONPATH=str(site),
               PIP_LOG=str(tmp_path / "pip.log"))
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "quickstart.sh"), "--help"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == f"stub quickstart from {site / 'ls_fairseq'} ['--help']"
    assert f"pip install --disable-pip-version-check {ROOT}[compare]" in \
        (tmp_path / "pip.log").read_text()
    assert not os.path.exists(os.path.join(ROOT, "ls_fairseq_quickstart"))


@pytest.mark.parametrize("gpu,index,want", [
    (True, None, "pip install --disable-pip-version-check torch==2.13.0"),
    (False, None, "pip install --disable-pip-version-check torch==2.13.0 --index-url "
                  "https://download.pytorch.org/whl/cpu"),
    (False, "", "pip install --disable-pip-version-check torch==2.13.0"),
    (True, "https://example.org/whl", "pip install --disable-pip-version-check torch==2.13.0 "
                                      "--index-url https://example.org/whl"),
], ids=["nvidia", "no-nvidia", "no-nvidia-pypi", "nvidia-index"])
def test_quickstart_sh_installs_the_torch_the_readme_names(tmp_path, gpu, index, want):
    """Without torch, quickstart.sh installs torch 2.13.0: PyPI's build where nvidia-smi lists a
    GPU, the CPU build (no CUDA libraries) elsewhere; TORCH_INDEX_URL chooses (empty: PyPI)."""
    site = _stub_site(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\n" + (
        "echo 'GPU 0: NVIDIA H100'\n" if gpu else "echo 'NVIDIA-SMI has failed'; exit 9\n"))
    for tool in ("python", "nvidia-smi"):
        (bin_dir / tool).chmod(0o755)
    env = dict(os.environ, PYTHON=str(bin_dir / "python"), REAL_PYTHON=sys.executable,
               PYTHONPATH=str(site), PIP_LOG=str(tmp_path / "pip.log"), FAKE_NO_TORCH="1",
               PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env.pop("TORCH_INDEX_URL", None)
    if index is not None:
        env["TORCH_INDEX_URL"] = index
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "quickstart.sh"), "--help"],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    installs = (tmp_path / "pip.log").read_text().splitlines()
    assert installs[0] == want
    assert ("no NVIDIA GPU found" in proc.stdout) == (not gpu and index is None)


class _Stop(Exception):
    pass


def test_cpu_quickstart_says_why_ls_is_not_faster(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def stop(*args):
        raise _Stop

    monkeypatch.setattr(quickstart, "prepare_data", stop)  # everything before training only
    with pytest.raises(_Stop):
        quickstart.main(["--workdir", str(tmp_path / "qs")])
    out = capsys.readouterr().out
    assert out.count(quickstart.CPU_NOTE) == 1
    assert "[quickstart] " + quickstart.CPU_NOTE == (
        "[quickstart] on CPU the ls_ run takes the PyTorch reference path (the CUDA kernels' math, "
        "not their speed), so expect about the baseline's speed: the speed-ups need a CUDA GPU")
    assert f"[quickstart] plugin: {quickstart.user_dir()}" in out
    # a baseline-only run has nothing to explain
    with pytest.raises(_Stop):
        quickstart.main(["--workdir", str(tmp_path / "qs"), "--runs", "baseline"])
    assert quickstart.CPU_NOTE not in capsys.readouterr().out


def test_cpu_table_is_not_a_speed_test(tmp_path, monkeypatch, capsys):
    """On CPU the two runs train one after the other under whatever load the machine has: the
    table's speed rows say it is not a speed test, with the load average seen during each run,
    and the tflops/mfu rows (a GPU's measure) are left out. Training, decoding and the table are
    stood in for; what is checked is what the quickstart hands to ls-fairseq-compare."""
    from ls_fairseq.cli import compare

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(quickstart, "prepare_data", lambda work, *a: str(tmp_path / "data"))
    monkeypatch.setattr(quickstart, "run_logged", lambda cmd, log_path, echo=None: 0)
    monkeypatch.setattr(quickstart, "evaluate", lambda *a: (1.0, "sacreBLEU 1.00"))
    loads = iter([3.5, 4.5, 0.5, 1.5])  # two samples a run: the baseline's, then ls_'s
    monkeypatch.setattr(quickstart.os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    monkeypatch.setattr(quickstart.os, "cpu_count", lambda: 2)
    seen = {}

    def fake_compare(paths, labels, out_dir, **kwargs):
        seen.update(kwargs, labels=labels)
        return [], "| the table |", []

    monkeypatch.setattr(compare, "compare", fake_compare)
    assert quickstart.main(["--workdir", str(tmp_path / "qs")]) == 0
    assert seen == {"labels": ["baseline", "ls"], "omit": ("tflops_", "mfu_"),
                    "speed_note": "not a speed test (CPU; load baseline 4.0, ls 1.0)"}
    out = capsys.readouterr().out
    assert ("[quickstart] on CPU this is not a speed test: the runs trained one after the other, "
            "at a load average (1 min, 2 cores) of 4.0 during baseline, 1.0 during ls; the ls_ run "
            "takes the PyTorch reference path, at about the baseline's speed (the speed-ups need a "
            "CUDA GPU). The speed rows below say so instead of giving ratios.") in out
    assert out.index("not a speed test") < out.index("| the table |")
