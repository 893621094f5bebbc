"""tests/fork_cli.py runs a command as a fresh interpreter would: the same program, run both ways
(fork_cli and subprocess), reports the same process state, output and exit status."""
import os
import subprocess
import sys

import fork_cli
import pytest

PROBE = r"""
import logging, multiprocessing, os, sys
import torch
print("argv", sys.argv)
print("cwd", os.getcwd())
print("env", os.environ.get("FORK_CLI_PROBE"))
print("stdin", sys.stdin.read().strip().upper())
print("path", sys.path[:2])
print("main", __name__, sys.modules["__main__"].__dict__.get("__file__"))
print("plugin imported", "ls_fairseq" in sys.modules)
print("root logger", logging.root.level, len(logging.root.handlers))
print("start method", multiprocessing.get_start_method())
print("threads", torch.get_num_threads())
print("to stderr", file=sys.stderr)
"""


def _both(cmd, **kwargs):
    env = dict(os.environ, FORK_CLI_PROBE="yes", PYTHONPATH=os.pathsep.join(["/nowhere", "/x"]),
               OMP_NUM_THREADS=kwargs.pop("threads", "1"))
    fresh = subprocess.run(cmd, capture_output=True, text=True, env=env, **kwargs)
    forked = fork_cli.run(cmd, env=env, **kwargs)
    return fresh, forked


@pytest.fixture(autouse=True)
def _forking():
    if not fork_cli.enabled():
        pytest.skip("fork_cli runs commands in fresh interpreters here (CUDA or LS_TESTS_FORK_CLI=0)")


@pytest.mark.parametrize("threads", ["1", "2"])
def test_probe_sees_what_a_fresh_interpreter_sees(tmp_path, threads):
    fresh, forked = _both([sys.executable, "-c", PROBE, "a", "b c"], cwd=tmp_path,
                          input="some input\n", threads=threads)
    assert fresh.returncode == forked.returncode == 0, (fresh.stderr, forked.stderr)
    assert forked.stdout == fresh.stdout
    assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1] == "to stderr"
    assert f"threads {threads}" in forked.stdout and "plugin imported False" in forked.stdout


@pytest.mark.parametrize("code,status,stderr_end", [
    ("import sys; sys.exit(3)", 3, None),
    ("import sys; sys.exit('stopped: why')", 1, "stopped: why"),
    ("raise ValueError('bad value')", 1, "ValueError: bad value"),
    ("import sys; print('out'); sys.exit()", 0, None),
])
def test_exit_status_and_error_output(tmp_path, code, status, stderr_end):
    fresh, forked = _both([sys.executable, "-c", code], cwd=tmp_path)
    assert fresh.returncode == forked.returncode == status
    assert forked.stdout == fresh.stdout
    if stderr_end:
        assert forked.stderr.strip().splitlines()[-1] == fresh.stderr.strip().splitlines()[-1] \
            == stderr_end


def test_module_run_like_python_dash_m(tmp_path):
    (tmp_path / "probe_module.py").write_text(
        "import sys\nif __name__ == '__main__':\n    print(sys.argv[1:], sys.path[0])\n")
    fresh, forked = _both([sys.executable, "-m", "probe_module", "x"], cwd=tmp_path)
    assert fresh.returncode == forked.returncode == 0, forked.stderr
    assert forked.stdout == fresh.stdout == f"['x'] {tmp_path}\n"


def test_fairseq_cli_argument_error_is_the_same(tmp_path):
    from test_end_to_end import fairseq_cli

    fresh, forked = _both(fairseq_cli("train") + [str(tmp_path), "--arch", "no_such_arch"],
                          cwd=tmp_path)
    assert fresh.returncode == forked.returncode == 2
    assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1]
    assert "invalid choice: 'no_such_arch'" in forked.stderr
    assert "ls_transformer" not in forked.stderr  # no --user-dir: plain fairseq's architectures


def test_timeout_kills_the_command(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        fork_cli.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=1)
