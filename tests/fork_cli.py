"""The tests' ``python -c CODE ...`` / ``python -m MODULE ...`` commands (fairseq-train, -generate,
-interactive, -preprocess, ls-fairseq-convert), run in a process forked from a server that has
already imported torch and fairseq, instead of in a fresh interpreter.

Why: a tiny fairseq-train spends about 4 of its 6 seconds starting Python and importing torch
and fairseq; the end-to-end tests start about a hundred such processes. The server
(multiprocessing's forkserver, preloading :data:`PRELOAD`) imports them once; each command then
runs in a fork of it, so what it runs is a new process as before: its own argv, environment,
working folder, stdin/stdout/stderr (files), exit status, and its own imports of everything
else, ls_fairseq (``--user-dir``) included.

What a fork shares with the server, and a fresh interpreter would redo: the modules of
:data:`PRELOAD` and what their import did (log lines at import are not in the output; the
root logger is reset to a fresh interpreter's, so ``fairseq_cli.*``'s own ``basicConfig`` takes
effect as before), and environment variables read at import time by torch and fairseq (the
thread count is set again from ``OMP_NUM_THREADS``). ls_fairseq is never imported in the server:
a command without ``--user-dir`` sees plain fairseq.

Used only where no CUDA device is visible (forking after CUDA is set up is undefined); set
``LS_TESTS_FORK_CLI=0`` to run every command in a fresh interpreter. Anything that is not
``sys.executable -c ...`` or ``sys.executable -m ...`` runs with subprocess as before. The same
server starts the gloo workers of ``ls_fairseq.testing.fairseq_helpers.run_workers``.
"""
import atexit
import builtins
import multiprocessing
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import threading
import types
import warnings
from multiprocessing import forkserver, spawn

#: what the server imports once (never ls_fairseq: see the module doc)
PRELOAD = ["torch", "torch._dynamo", "fairseq", __name__]
_context = None
_base_path = None
_lock = threading.Lock()
_ENVIRON = dict(os.environ)  # at import: collection, before any test changes it
_get_preparation_data = spawn.get_preparation_data


def enabled():
    if os.environ.get("LS_TESTS_FORK_CLI", "1") == "0":
        return False
    import torch

    return not torch.cuda.is_available()


def _forkable(cmd):
    return (len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] in ("-c", "-m")
            and enabled())


def configure():
    """Makes multiprocessing's forkserver preload :data:`PRELOAD` (tests/conftest.py, where no
    CUDA device is visible; the server starts at its first use, here or in
    ``ls_fairseq.testing.fairseq_helpers.run_workers``)."""
    multiprocessing.set_forkserver_preload(PRELOAD)


def _server():
    global _context, _base_path
    if _context is None:
        # sys.path of a fresh interpreter (``-E``: without PYTHONPATH, added per command)
        _base_path = subprocess.run(
            [sys.executable, "-E", "-c", "import sys; print('\\n'.join(sys.path[1:]))"],
            capture_output=True, text=True, check=True).stdout.splitlines()
        configure()
        # started with the environment of the run's start, not that of the test at hand
        current = dict(os.environ)
        os.environ.clear()
        os.environ.update(_ENVIRON)
        try:
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(current)
        _context = multiprocessing.get_context("forkserver")
    return _context


def _without_main(name):
    """multiprocessing's preparation data for a child, less this process's main module, which
    the child would import again (a test module, ls_fairseq with it): the command is the fork's
    main program."""
    data = _get_preparation_data(name)
    data.pop("init_main_from_name", None)
    data.pop("init_main_from_path", None)
    return data


class Process:
    """One command, like ``subprocess.Popen`` with stdout/stderr captured: ``wait(timeout)``
    returns the exit status (``subprocess.TimeoutExpired`` after killing it on a timeout);
    then ``stdout`` and ``stderr`` hold the text."""

    def __init__(self, cmd, env=None, cwd=None, input=None):
        self.cmd = [str(c) for c in cmd]
        self.stdout = self.stderr = None
        self.returncode = None
        self._tmp = tempfile.mkdtemp(prefix="fork_cli_")
        paths = [os.path.join(self._tmp, n) for n in ("stdin", "stdout", "stderr")]
        for path, text in zip(paths, (input or "", "", "")):
            with open(path, "w") as f:
                f.write(text)
        self._paths = paths
        self._popen = None
        env = dict(os.environ if env is None else env)
        cwd = os.path.abspath(cwd or os.getcwd())
        if _forkable(self.cmd):
            context = _server()
            self._process = context.Process(target=_child, args=(
                self.cmd[1:], env, cwd, paths, _base_path), daemon=False)
            with _lock:
                get_preparation_data = spawn.get_preparation_data
                spawn.get_preparation_data = _without_main
                try:
                    self._process.start()
                finally:
                    spawn.get_preparation_data = get_preparation_data
        else:
            self._process = None
            self._files = [open(p, mode) for p, mode in zip(paths, ("r", "w", "w"))]
            self._popen = subprocess.Popen(self.cmd, env=env, cwd=cwd, stdin=self._files[0],
                                           stdout=self._files[1], stderr=self._files[2])

    def wait(self, timeout=None):
        if self.returncode is not None:
            return self.returncode
        if self._popen is not None:
            try:
                self.returncode = self._popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self._popen.kill()
                self._popen.wait()
                self._collect()
                raise
            for f in self._files:
                f.close()
        else:
            self._process.join(timeout)
            if self._process.exitcode is None:
                self._process.kill()
                self._process.join()
                self._collect()
                raise subprocess.TimeoutExpired(self.cmd, timeout)
            self.returncode = self._process.exitcode
        self._collect()
        return self.returncode

    def _collect(self):
        with open(self._paths[1], errors="replace") as f:
            self.stdout = f.read()
        with open(self._paths[2], errors="replace") as f:
            self.stderr = f.read()
        shutil.rmtree(self._tmp, ignore_errors=True)


def run(cmd, env=None, cwd=None, input=None, timeout=None):
    """``subprocess.run(cmd, capture_output=True, text=True, ...)`` for the commands above."""
    proc = Process(cmd, env=env, cwd=cwd, input=input)
    proc.wait(timeout)
    return subprocess.CompletedProcess(proc.cmd, proc.returncode, proc.stdout, proc.stderr)


def _child(args, env, cwd, paths, base_path):
    """In the fork: become ``python <args>`` run in ``cwd`` with ``env`` (see the module doc)."""
    import logging

    for fd, path, flags in zip((0, 1, 2), paths, (os.O_RDONLY, os.O_WRONLY, os.O_WRONLY)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False, errors="backslashreplace", buffering=1)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    # a fresh interpreter's start method ("fork" on Linux): the fork got the server's
    # "forkserver", which would start fairseq's data loader workers from the server
    multiprocessing.set_start_method(None, force=True)
    logging.root.handlers.clear()  # a fresh interpreter's root logger
    logging.root.setLevel(logging.WARNING)
    if env.get("PYTHONWARNINGS"):
        warnings._processoptions(env["PYTHONWARNINGS"].split(","))
    python_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    flag, target, rest = args[0], args[1], args[2:]
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    code = 0
    try:
        if flag == "-c":
            sys.argv = ["-c", *rest]
            sys.path[:] = ["", *python_path, *base_path]
            exec(compile(target, "<string>", "exec"), main.__dict__)
        else:
            sys.argv = [target, *rest]  # runpy sets argv[0] to the module's file
            sys.path[:] = [cwd, *python_path, *base_path]
            runpy._run_module_as_main(target, alter_argv=True)
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - as the interpreter does: print, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    # the interpreter's exit: wait for the threads, run atexit, flush
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    sys.stderr.flush()
    os._exit(code)
