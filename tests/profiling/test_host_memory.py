"""On a CPU, Adacc.setup makes glibc keep freed memory for reuse, so the blocks a training
step allocates and frees fault no pages in afresh at every step (as the CUDA caching
allocator reuses device memory). Each case runs in its own process, forked from the warm
server (its heap, like a fresh interpreter's, returns large blocks to the system): the policy
lasts for the rest of a process."""
import pytest

from helpers import TESTS, forked
from helpers.pretrain import child_env

# One stand-in step's activations, in MiB: allocated and filled together, then all freed.
STEP_MIB = (4, 16, 8, 32, 16, 4, 64)
PAGES = sum(STEP_MIB) << 8

# Prints the median minor page faults of the last three of a few such steps, after Adacc.setup
# (policy none) on a CPU model when asked to. The median: in one fresh-clone run, under the
# parallel suite's load, the last step alone faulted 16,384 pages (64 MiB), cause not found; a
# heap that gave its memory back would fault them in at every step.
FAULTS = f"""
import resource, sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, {str(TESTS)!r})
import torch
from megatron_adacc import Adacc, AdaccConfig
from megatron_adacc.profiling import allocator
from helpers.runtime import adacc_batch, adacc_model

if sys.argv[1] == "setup":
    adacc = Adacc(AdaccConfig())
    adacc.setup(adacc_model(adacc), adacc_batch(), verbose=False)
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    kept = [torch.ones(mib << 18) for mib in {STEP_MIB!r}]
    del kept
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sorted(faults[-3:])[1], allocator.host_memory_recycled())
"""


def _faults(mode: str) -> tuple[int, bool]:
    done = forked.run(["-c", FAULTS, mode], cwd=TESTS, env=child_env())
    assert done.returncode == 0, done.stderr[-2000:]
    faults, recycled = done.stdout.split()[-2:]
    return int(faults), recycled == "True"


def test_after_setup_on_a_cpu_steps_reuse_freed_host_memory_without_faulting_it_in():
    fresh, recycled_before = _faults("bare")
    if fresh < PAGES // 2:
        pytest.skip(f"with its allocator's defaults this machine faulted {fresh} of a step's "
                    f"{PAGES} pages (huge pages, or not glibc): nothing to compare")
    reused, recycled = _faults("setup")
    assert not recycled_before and recycled
    assert reused < PAGES // 16, (fresh, reused)
