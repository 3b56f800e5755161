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


@pytest.fixture(scope="session")
def distributed():
    """A world of one with megatron-core's model-parallel state (gloo on CPU)."""
    from megatron_adacc.models import build as model

    warnings.filterwarnings("ignore", module="megatron")
    model.init_distributed(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a minute (deselect with -m 'not slow')")
