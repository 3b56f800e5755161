"""Running pretrain_gpt.py from tests: in this process (fast) or in a fresh one."""
import json
import os
import subprocess
import sys

from helpers import ROOT, TESTS, forked
from megatron_adacc.corpus import ByteTokenizer

PRETRAIN = str(ROOT / "pretrain_gpt.py")
# A GPT small enough for a test: Megatron-LM's flags over configs/tiny-cpu.yaml.
TINY = ["--config", str(ROOT / "configs" / "tiny-cpu.yaml"), "--log-interval", "1000",
        "--eval-interval", "1000", "--eval-iters", "0", "--num-layers", "2",
        "--hidden-size", "64", "--seq-length", "32", "--max-position-embeddings", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr-warmup-iters", "0"]
# Megatron-LM's Llama architecture flags (no dropout, as Llama trains).
LLAMA_FLAGS = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
               "--group-query-attention", "--num-query-groups", "2",
               "--untie-embeddings-and-output-weights", "--disable-bias-linear",
               "--hidden-dropout", "0", "--attention-dropout", "0"]
# TINY for runs on a corpus given by --data-path (``data_flags``): a byte-level vocabulary.
CORPUS_TINY = ["--config", str(ROOT / "configs" / "tiny-cpu.yaml"), "--log-interval", "1000",
               "--eval-iters", "0", "--num-layers", "2", "--hidden-size", "64",
               "--seq-length", "32", "--max-position-embeddings", "32",
               "--micro-batch-size", "2", "--global-batch-size", "4", "--lr-warmup-iters", "1",
               "--tokenizer-type", "NullTokenizer", "--vocab-size", str(ByteTokenizer.vocab_size)]


DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                   "MASTER_PORT")


def main(argv: list[str]) -> int:
    """pretrain_gpt.main(argv) in this process."""
    import pretrain_gpt

    return pretrain_gpt.main(argv)


def pretrain(*flags: str):
    """The Adacc session of a TINY run with ``flags`` in this process (records, adacc)."""
    from megatron_adacc import megatron_lm

    status = main(TINY + [str(flag) for flag in flags])
    assert status == 0, f"pretrain_gpt.py exited {status}"
    return megatron_lm.session()


def parse(*flags: str, tiny: bool = True):
    """Megatron-LM's args for (TINY +) ``flags`` as pretrain_gpt.py takes them, Adacc's
    checks included; nothing is built. Raises megatron_lm.ConfigError on a refusal."""
    from megatron_adacc import launch, megatron_lm

    try:
        args = launch.parse((TINY if tiny else []) + [str(flag) for flag in flags])
        megatron_lm.check_args(args)
    finally:
        launch.teardown(owns_process_group=False)
    return args


def train(*flags: str) -> list[dict]:
    """The metrics records of a TINY run with ``flags``, in this process."""
    return pretrain(*flags).records


def losses(records):
    return [r["loss"] for r in records]


def data_flags(corpus: str) -> list[str]:
    """The flags that train on ``corpus`` (the conftest fixture's dataset prefix)."""
    return ["--data-path", corpus, "--split", "98,2,0"]


def run(script, *flags, cwd, timeout=300, nproc=None):
    """(exit code, last stderr line, whole stderr) of a script run in a fresh process
    (forked; ``nproc`` ranks as torchrun starts them)."""
    env = child_env()
    if nproc:
        done = forked.torchrun(nproc, [script, *flags], cwd=cwd, env=env, timeout=timeout)
    else:
        done = forked.run([script, *flags], cwd=cwd, env=env, timeout=timeout)
    # Megatron-LM logs to stdout: a traceback it logs is no better than one on stderr
    for output in (done.stderr, done.stdout):
        assert "Traceback" not in output, output[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return done.returncode, (lines[-1] if lines else ""), done.stderr


def child_env(**extra: str) -> dict:
    """This process's environment for a fresh one: one thread, no world, this checkout first.

    PYTHONPATH starts with the repository (scripts/ would otherwise import the installed
    package) and tests/ (``helpers``, for the scripts under tests/); ``extra`` adds or
    replaces variables.
    """
    path = os.pathsep.join(filter(None, [str(ROOT), str(TESTS), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    for name in DISTRIBUTED_ENV:  # this process's world (in-process runs set one), not theirs
        env.pop(name, None)
    return env | extra


def torchrun(nproc: int, runs: dict, *flags, timeout=600, tiny=True,
             real_torchrun=False) -> dict:
    """Several TINY pretrain_gpt.py runs in one launch of ``nproc`` ranks.

    The ranks run tests/multirank/multirank.py, forked (``forked.torchrun``) or, with
    ``real_torchrun``, under torchrun itself. ``runs`` maps a name to its flags (after TINY,
    unless not ``tiny``, and ``flags``) or to {"flags": [...], "stretch": [...]}.

    Returns:
        {name: [each rank's report]}.
    """
    spec = json.dumps([{"name": name, **(run if isinstance(run, dict) else {"flags": run})}
                       for name, run in runs.items()])
    # Megatron-LM asks tensor parallelism for this as on a GPU before Blackwell (its scripts
    # export it).
    env = child_env(CUDA_DEVICE_MAX_CONNECTIONS="1")
    argv = [str(TESTS / "multirank" / "multirank.py"), spec, *(TINY if tiny else []),
            *map(str, flags)]
    if real_torchrun:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                               str(nproc), "--master_port", str(forked.free_port()), *argv],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    else:
        done = forked.torchrun(nproc, argv, cwd=ROOT, env=env, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("MULTIRANK ")]
    return json.loads(line.removeprefix("MULTIRANK "))
