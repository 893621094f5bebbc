"""A plain (non-editable) `pip install .` gives a working plugin that ships its CUDA sources."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_non_editable_install_ships_csrc_and_registers(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), ROOT],
        check=True, capture_output=True, text=True,
    )
    installed = target / "ls_fairseq"
    cu = sorted(p.name for p in (installed / "csrc").glob("*.cu"))
    repo_cu = sorted(p for p in os.listdir(os.path.join(ROOT, "csrc")) if p.endswith(".cu"))
    assert cu == repo_cu
    code = (
        "import ls_fairseq, os; from ls_fairseq.ops import _extension as e;"
        "from fairseq.models import ARCH_MODEL_REGISTRY as A;"
        "from fairseq.criterions import CRITERION_REGISTRY as C;"
        "from fairseq.optim import OPTIMIZER_REGISTRY as O;"
        "print(ls_fairseq.__file__); print(e.csrc_dir());"
        "assert 'ls_transformer_wmt_en_de_big_t2t' in A and 'ls_label_smoothed_cross_entropy' in C"
        " and 'ls_adam' in O"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    module_file, csrc = out.stdout.split()[-2:]
    assert module_file.startswith(str(target)), module_file  # the installed copy, not the repo
    assert csrc == str(installed / "csrc")
