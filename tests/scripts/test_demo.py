"""``make demo`` (scripts/demo.py) picks its budget from the model's own plan frontier, so
its plan retains, compresses and recomputes whatever the machine's costs are."""
import importlib.util
from dataclasses import replace

import pytest

from megatron_adacc import cli, planning
from megatron_adacc.planning import analytic
from megatron_adacc.common.sites import ACTIONS

from helpers import ROOT


def _demo():
    spec = importlib.util.spec_from_file_location("demo", ROOT / "scripts" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _demo_costs(accelerator):
    # the demo's model as pretrain_gpt.py reads configs/demo.yaml
    argv = ["--config", str(ROOT / "configs" / "demo.yaml")]
    return analytic.analytic_costs(cli.model_shape(argv),
                                   cli.training_flags(argv).micro_batch_size, accelerator)


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


def test_make_demo_plans_a_mix_then_trains_with_it(tmp_path, capsys, monkeypatch):
    # scripts/demo.py end to end on a tiny shape: the budget from the trainer's own costs,
    # one line per action, then pretrain_gpt.py trains auto at that budget with that plan.
    # Tracking is off, so the plan trained is the one planned.
    from megatron_adacc import megatron_lm
    from helpers.pretrain import TINY

    monkeypatch.chdir(tmp_path)
    demo = _demo()
    assert demo.main([*TINY, "--train-iters", "2", "--hidden-dropout", "0.1",
                      "--adacc-tracking", "off",
                      "--adacc-profile-db", str(tmp_path / "p.sqlite")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("demo budget ")
    for action in ACTIONS:
        assert f"\n{action:<9}: " in out
    assert "rebuilt from" in out and "no optimisation" in out   # the plan table
    # Megatron-LM's argument dump would bury the lines above: one line stands for it.
    assert "-- arguments --" not in out and "are not listed here" in out
    session = megatron_lm.session()
    assert session.args.adacc_policy == "auto"
    # The trainer read the demo's profile back from the ProfileDB, so it planned the same
    # plan at the same budget.
    budget, chosen, _, _ = demo.choose_budget(session.adacc.costs)
    assert "reused the profile in the ProfileDB" in out
    assert (session.adacc.budget_bytes, session.adacc.plan_id) == (budget, chosen.plan.plan_id)
    # A mix wherever the frontier has one, and the demo says so where it has none: on this
    # tiny model a timing spike in the profile can leave none (one run in six here, and CI);
    # on the demo's own model every cost model has one (the test above).
    mixed = demo.actions_of(session.adacc.result) == set(ACTIONS)
    assert mixed == ("nowhere (no budget on the frontier needs all three)" not in out)
    assert [r["iteration"] for r in session.records] == [1, 2]
