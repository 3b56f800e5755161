"""Fresh processes for scripts, forked from a server that has imported torch and megatron once.

A script's process starts in about a second instead of the eight that importing takes on two
cores. Each is a new process: its own pid, environment, working directory, output files and
exit status, with none of this test process's state. It differs from ``python script.py`` in
two ways. Modules are imported before the environment is set, so a script that reads a
variable at import time needs ``subprocess``. And atexit handlers do not run.
"""
import io
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

# What the scripts under test import; the server imports them once, before any fork.
PRELOAD = ["torch", "megatron.training.training", "megatron.training.checkpointing",
           "megatron.core.datasets.gpt_dataset", "megatron_adacc.megatron_lm",
           "megatron_adacc.launch", "megatron_adacc.profiling.profiler", "pretrain_gpt"]

_context = None


def _server():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _child(argv: list[str], cwd: str, env: dict, out: str, err: str) -> None:
    """Runs in the forked process: ``python *argv`` as the interpreter would."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True)
    # The script's own processes (data loader workers) start as python's would, not from here.
    multiprocessing.set_start_method(None, force=True)
    if env.get("OMP_NUM_THREADS"):  # read by libgomp when the server loaded it
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = list(argv)
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.path[0] = str(Path(argv[0]).resolve().parent)
        runpy.run_path(argv[0], run_name="__main__")


def run(argv, *, cwd, env=None, timeout=300) -> subprocess.CompletedProcess:
    """``python *argv`` in a forked process; a CompletedProcess with its text output."""
    argv = [str(arg) for arg in argv]
    env = dict(os.environ if env is None else env)
    out, err = (tempfile.mkstemp(prefix="forked-", suffix=suffix) for suffix in (".out", ".err"))
    for fd, _ in (out, err):
        os.close(fd)
    out, err = out[1], err[1]
    process = _server().Process(target=_child, args=(argv, str(cwd), env, out, err))
    process.start()
    process.join(timeout)
    if process.exitcode is None:
        process.kill()
        process.join()
        raise subprocess.TimeoutExpired(argv, timeout)
    texts = []
    for path in (out, err):
        texts.append(Path(path).read_text(errors="replace"))
        os.unlink(path)
    return subprocess.CompletedProcess([sys.executable, *argv], process.exitcode, *texts)
