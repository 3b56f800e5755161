"""The planning package's boundaries: one model that the frontier's vectorised charges agree
with policy by policy, PuLP loaded only for the MILP, and no caller outside the package
reaching for a private name."""
import re
import subprocess
import sys

import pytest

from megatron_adacc import planning
from megatron_adacc.planning import analytic

from helpers import ROOT as REPO


@pytest.mark.parametrize("lossy", [True, False])
def test_every_frontier_policy_costs_what_the_model_says(lossy):
    costs = analytic.analytic_costs(analytic.ModelShape(24, 1024, 16, 1024, 50257), 8,
                                    "v100-32gb")
    frontier = planning.layer_frontier(costs, lossy)
    for k in range(len(frontier)):
        policy = frontier.policy(k)
        evaluated = planning.evaluate_layer(costs, policy.decisions)
        assert evaluated.stored_bytes == policy.stored_bytes
        assert evaluated.transient_bytes == policy.transient_bytes
        assert evaluated.time_s == pytest.approx(policy.time_s, rel=1e-12)
        assert lossy or planning.is_exact(costs, policy.decisions)


def test_pulp_is_imported_only_for_the_milp():
    probe = ("import sys; import megatron_adacc.planning, megatron_adacc.planning.report, "
             "megatron_adacc.cli; assert 'pulp' not in sys.modules, 'pulp imported'")
    subprocess.run([sys.executable, "-c", probe], cwd=REPO, check=True)


def test_no_caller_outside_the_package_uses_a_private_planning_name():
    private = re.compile(r"\bplanning\.(_\w+)|from megatron_adacc\.planning\.\w+ import")
    package = REPO / "megatron_adacc"
    callers = [*(p for p in package.rglob("*.py") if package / "planning" not in p.parents),
               *REPO.glob("scripts/*.py"), *REPO.glob("tests/**/*.py")]
    offenders = [f"{path.name}: {match.group(0)}" for path in callers
                 for match in private.finditer(path.read_text())]
    assert offenders == []
