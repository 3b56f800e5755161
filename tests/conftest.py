import os
import sys
import warnings

import pytest

# The Triton codec kernels are tested on the CPU by Triton's interpreter, which must be on
# before any @triton.jit kernel is defined: set here, before any test module imports one.
# Without CUDA nothing else runs Triton (inductor emits C++ on a CPU), so this is harmless.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Each xdist worker takes its share of the cores, as do the subprocesses it starts. torch's
# default, a thread per core in every worker, oversubscribes them: on two cores OpenMP's
# waiting threads then took 30% of the suite's time (16 min 26 s, 11 min 36 s without).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

# The repository (this checkout's package, pretrain_gpt.py) and tests/ (the helpers package)
# first on the path, whichever folder a test module sits in.
TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(TESTS), TESTS]

# megatron-core warns at import about every optional fused kernel it cannot find.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")


@pytest.fixture(scope="session", autouse=True)
def hermetic_data_dir(tmp_path_factory):
    """Datasets built by tests (the demo corpus included) go to a fresh directory, never the
    user's cache, and subprocesses inherit it."""
    path = tmp_path_factory.mktemp("adacc-data")
    previous = os.environ.get("ADACC_DATA_DIR")
    os.environ["ADACC_DATA_DIR"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("ADACC_DATA_DIR", None)
    else:
        os.environ["ADACC_DATA_DIR"] = previous


@pytest.fixture(autouse=True)
def own_process_env():
    """What a test's in-process run leaves in os.environ (its world; the attention backend
    megatron-core records and asserts the next model agrees with) reaches no later test or
    subprocess."""
    from megatron_adacc.launch import TE_ATTENTION_ENV
    from helpers.pretrain import DISTRIBUTED_ENV

    before = {name: os.environ.get(name) for name in (*TE_ATTENTION_ENV, *DISTRIBUTED_ENV)}
    for name in TE_ATTENTION_ENV:
        os.environ.pop(name, None)
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        elif name not in TE_ATTENTION_ENV:
            os.environ[name] = value


@pytest.fixture(scope="session")
def distributed():
    """A world of one with megatron-core's model-parallel state (gloo on CPU)."""
    from megatron_adacc.models import build as model

    warnings.filterwarnings("ignore", module="megatron")
    model.init_distributed(1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small ByteLevel dataset prefix (a few hundred samples of 32 tokens)."""
    import random

    from megatron_adacc.corpus import ByteTokenizer, write_indexed_dataset

    rng = random.Random(0)
    words = "the of and to in that is was he for it with as his on be at by".split()
    docs = [" ".join(rng.choice(words) for _ in range(30)) for _ in range(100)]
    prefix = tmp_path_factory.mktemp("corpus") / "c_text_document"
    write_indexed_dataset(docs, ByteTokenizer(), prefix)
    return str(prefix)


def pytest_configure(config):
    config.addinivalue_line("markers",
                            "slow: takes more than a minute (deselect with -m 'not slow')")


def pytest_collection_finish(session):
    """Freeze what the test modules imported (torch, megatron: half a million objects, alive
    until the end): each full collection during the tests then walks the tests' objects only."""
    import gc

    gc.collect()
    gc.freeze()
