"""The quickstart from a source checkout (``bash scripts/quickstart.sh``), without training.

* its work folder is outside the source tree by default;
* the launcher runs the installed package, not the checkout's ``ls_fairseq``;
* on CPU it says, in one line, why the ls_ run is no faster than the baseline.

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
# pip installs are recorded, not done; everything else runs the real interpreter
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "pip ${*:3}" >> "$PIP_LOG"; exit 0; fi
exec "$REAL_PYTHON" "$@"
'''


def test_quickstart_sh_runs_the_installed_package_not_the_checkout(tmp_path):
    """Started from the checkout, the launcher must import the installed ls_fairseq (here a stub
    standing in for site-packages), not the source tree's, which ``python -m`` would pick."""
    site = tmp_path / "site"
    (site / "ls_fairseq" / "cli").mkdir(parents=True)
    (site / "ls_fairseq" / "__init__.py").write_text("")
    (site / "ls_fairseq" / "cli" / "__init__.py").write_text("")
    (site / "ls_fairseq" / "cli" / "quickstart.py").write_text(STUB)
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
