"""``make demo`` (scripts/demo.py) picks its budget from the model's own plan frontier, so
its plan retains, compresses and recomputes whatever the machine's costs are."""
import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_adacc import planning
from megatron_adacc.profiling import hardware
from megatron_adacc.training.arguments import read_config
from megatron_adacc.common.sites import ACTIONS

ROOT = Path(__file__).resolve().parents[1]


def _demo():
    spec = importlib.util.spec_from_file_location("demo", ROOT / "scripts" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _demo_costs(accelerator):
    flags = {key.replace("_", "-"): value
             for key, value in read_config(str(ROOT / "configs" / "demo.yaml")).items()}
    return hardware.analytic_costs(hardware.ModelShape.from_flags(flags),
                                   flags["micro-batch-size"], accelerator)


def _with_codec_time(costs, factor):
    """The same model where every codec runs ``factor`` times as fast (e.g. an AVX-512 CPU)."""
    return replace(costs, sites=[
        replace(site, codecs=tuple(replace(codec, encode_s=codec.encode_s / factor,
                                           decode_s=codec.decode_s / factor)
                                   for codec in site.codecs))
        for site in costs.sites])


@pytest.mark.parametrize("accelerator", ["v100-32gb", "a100-80gb"])
@pytest.mark.parametrize("codec_speedup", [1, 100])
def test_the_demo_budget_mixes_every_action_whatever_the_costs(accelerator, codec_speedup):
    demo = _demo()
    costs = _with_codec_time(_demo_costs(accelerator), codec_speedup)
    budget, result, low, high = demo.choose_budget(costs)
    assert low == planning.minimum_feasible_budget(costs, allow_lossy_sources=False)
    assert low <= budget < high and result.peak_bytes <= budget
    assert demo.actions_of(result) == set(ACTIONS)
    lines = demo.reasons(costs, result, budget, low, high)
    assert len(lines) == 1 + len(ACTIONS)
    assert [line.split(":")[0].strip() for line in lines[1:]] == list(ACTIONS)
