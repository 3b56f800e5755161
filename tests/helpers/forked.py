"""Fresh processes for scripts, forked from a server that has imported torch and megatron once.

A script's process starts in about a second instead of the eight that importing takes on two
cores. Each is a new process: its own pid, environment, working directory, output files and
exit status, with none of this test process's state. It differs from ``python script.py`` in
two ways. Modules are imported before the environment is set, so a script that reads a
variable at import time needs ``subprocess``. And atexit handlers do not run.
"""
import gc
import io
import multiprocessing
import multiprocessing.connection
import os
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# What the scripts under test import; the server imports them once, before any fork.
# Megatron-LM's tokenizer libraries import transformers: 1.5 s of a tiny run's 2.3 s.
PRELOAD = ["torch", "megatron.training.training", "megatron.training.checkpointing",
           "megatron.core.datasets.gpt_dataset",
           "megatron.core.tokenizers.text.libraries.huggingface_tokenizer",
           "megatron_adacc.megatron_lm", "megatron_adacc.launch",
           "megatron_adacc.profiling.profiler", "pretrain_gpt"]

_context = None


def _server():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _child(argv: list[str], cwd: str, env: dict, out: str, err: str) -> None:
    """Runs in the forked process: ``python *argv`` as the interpreter would."""
    # The preloaded modules' objects outlive the script: frozen, its collections skip them.
    gc.freeze()
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
    return torchrun(1, argv, cwd=cwd, env=env, timeout=timeout, world=False)


class Started:
    """A forked ``python *argv`` still running: its pid, and its output as it is written."""

    def __init__(self, argv: list[str], cwd, env: dict):
        self.files = []
        for suffix in (".out", ".err"):
            fd, path = tempfile.mkstemp(prefix="forked-", suffix=suffix)
            os.close(fd)
            self.files.append(path)
        self.process = _server().Process(target=_child, args=(argv, str(cwd), env, *self.files))
        self.process.start()
        self.pid = self.process.pid

    def wait_for_line(self, text: str, timeout: float = 300) -> None:
        """Return once stdout has a line holding ``text``; exiting before that fails."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in Path(self.files[0]).read_text().splitlines()):
            assert self.process.exitcode is None, f"exited before printing {text!r}"
            assert time.monotonic() < deadline, f"no {text!r} in {timeout} s"
            time.sleep(0.2)

    def wait(self, timeout: float = 300) -> subprocess.CompletedProcess:
        """Its exit status and output, once it exits (killed past ``timeout``)."""
        self.process.join(timeout)
        self.kill()
        return subprocess.CompletedProcess([sys.executable], self.process.exitcode,
                                           *self.output())

    def kill(self) -> None:
        if self.process.exitcode is None:
            self.process.kill()
        self.process.join()

    def output(self) -> list[str]:
        """Its stdout and stderr; the files are removed."""
        texts = [Path(path).read_text(errors="replace") for path in self.files]
        for path in self.files:
            os.unlink(path)
        return texts


def start(argv, *, cwd, env=None) -> Started:
    """``python *argv`` forked, not waited for."""
    return Started([str(arg) for arg in argv], cwd, dict(os.environ if env is None else env))


def torchrun(nproc: int, argv, *, cwd, env=None, timeout=600,
             world=True) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node nproc *argv``, its ranks forked; rank 0's output last.

    Each rank gets the environment torchrun gives its workers (``world``). As torchrun does,
    the first rank to fail stops the others. The exit status is the first failure's, else 0.
    """
    argv = [str(arg) for arg in argv]
    env = dict(os.environ if env is None else env)
    if world:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0",
                   GROUP_WORLD_SIZE="1", ROLE_NAME="default", ROLE_WORLD_SIZE=str(nproc),
                   TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                   TORCHELASTIC_RUN_ID="none", TORCHELASTIC_USE_AGENT_STORE="False")
        env.setdefault("OMP_NUM_THREADS", "1")
    ranks = [Started(argv, cwd, dict(env, RANK=str(rank), LOCAL_RANK=str(rank),
                                     ROLE_RANK=str(rank)) if world else env)
             for rank in range(nproc)]
    deadline, status = time.monotonic() + timeout, None
    try:
        while status is None and time.monotonic() < deadline:
            running = [r.process.sentinel for r in ranks if r.process.exitcode is None]
            failed = [r.process.exitcode for r in ranks if r.process.exitcode not in (None, 0)]
            if failed or not running:
                status = failed[0] if failed else 0
            else:
                multiprocessing.connection.wait(running, timeout=1)
    finally:
        for rank in ranks:
            rank.kill()
    texts = ["", ""]
    for rank in reversed(ranks):
        for index, text in enumerate(rank.output()):
            texts[index] += text
    if status is None:
        raise subprocess.TimeoutExpired(argv, timeout, output=texts[0], stderr=texts[1])
    return subprocess.CompletedProcess([sys.executable, *argv], status, *texts)


def free_port() -> int:
    """A port free now, for a world's rendezvous."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
