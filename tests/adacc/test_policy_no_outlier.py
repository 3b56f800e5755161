"""--adacc-policy auto-no-outlier: the paper's "Adacc w/o outlier" ablation."""
import pytest

from megatron_adacc import policies
from megatron_adacc.common.sites import COMPRESS
from megatron_adacc.megatron_lm import ConfigError

from helpers.pretrain import parse, pretrain


def test_no_outlier_plans_plain_int4_where_auto_separates_outliers(tmp_path):
    db = str(tmp_path / "profiles.sqlite")
    # A budget that forces compression: a little above the smallest feasible one.
    probe = pretrain("--train-iters", "1", "--adacc-profile-db", db, "--adacc-policy", "auto",
                     "--adacc-memory-budget", "1GiB", "--adacc-profile-repeats", "1")
    result = probe.adacc.result
    budget = result.minimum_feasible_budget + (
        result.references["no optimisation"].peak_bytes - result.minimum_feasible_budget) // 3
    codecs = {}
    for policy in policies.AUTO_POLICIES:
        session = pretrain("--train-iters", "1", "--adacc-profile-db", db, "--adacc-policy",
                           policy, "--adacc-memory-budget", str(budget),
                           "--adacc-tracking", "off")
        codecs[policy] = {d.codec for layer in session.adacc.result.layer_decisions
                          for d in layer.values() if d.action == COMPRESS}
    assert "outlier_int4" not in codecs["auto-no-outlier"]
    assert "sym_int4" not in codecs["auto"]


def test_no_outlier_needs_a_budget_on_cpu():
    with pytest.raises(ConfigError, match="auto-no-outlier"):
        parse("--adacc-policy", "auto-no-outlier")
