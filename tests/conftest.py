import os
import sys
import warnings

# The Triton codec kernels are tested on the CPU by Triton's interpreter, which must be on
# before any @triton.jit kernel is defined: set here, before any test module imports one.
# Without CUDA nothing else runs Triton (inductor emits C++ on a CPU), so this is harmless.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
    from pretrain_helpers import DISTRIBUTED_ENV

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


def pytest_configure(config):
    config.addinivalue_line("markers",
                            "slow: takes more than a minute (deselect with -m 'not slow')")

