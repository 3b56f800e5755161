"""--adacc-policy auto and the paper's baselines, end to end through Megatron-LM's loop."""
import math

import pytest

from megatron_adacc import planning, policies
from megatron_adacc.profiling import profiler
from megatron_adacc.common import sites
from megatron_adacc.megatron_lm import ConfigError
from megatron_adacc.common.sites import COMPRESS, RECOMPUTE, RETAIN
from helpers.pretrain import TINY, main, parse, pretrain

METRICS = {"static_bytes", "budget_bytes", "plan_id", "activation_bytes", "measured_step_time_s",
           "measured_plan_id"}


@pytest.fixture
def counted_profiles(monkeypatch):
    calls = []
    real = profiler.profile

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **{**kwargs, "repeats": 1})

    monkeypatch.setattr(profiler, "profile", counting)
    return calls


def run(tmp_path, *flags):
    """(the run's Adacc session, its records) of 2 iterations of pretrain_gpt.py."""
    session = pretrain("--train-iters", "2", "--adacc-profile-db",
                       str(tmp_path / "profiles.sqlite"), *flags)
    return session, session.records


def micro_batches(session) -> int:
    args = session.args
    return args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)


def actions(session) -> set[str]:
    return {d.action for layer in session.adacc.result.layer_decisions for d in layer.values()}


def test_auto_across_budgets_profiles_once_and_keeps_what_it_predicts(tmp_path, counted_profiles,
                                                                    capsys):
    # Tracking off throughout: it may swap a plan once payloads move (and refreshes the
    # costs), and this compares each plan with its own prediction.
    session, records = run(tmp_path, "--adacc-policy", "auto", "--adacc-tracking", "off",
                           "--adacc-memory-budget", "1GiB")
    assert actions(session) == {RETAIN}          # everything fits: nothing to pay for
    costs, result = session.adacc.costs, session.adacc.result
    assert "site" in capsys.readouterr().out     # the plan table, on rank 0
    minimum = result.minimum_feasible_budget
    no_optimisation = result.references["no optimisation"].peak_bytes
    for budget in (minimum + (no_optimisation - minimum) // 3, minimum + 4096):
        session, records = run(tmp_path, "--adacc-policy", "auto", "--adacc-tracking", "off",
                               "--adacc-memory-budget", str(budget))
        # Which of compress and recompute wins a site depends on measured times (on this
        # model the fused codecs usually beat a rebuild); that a tight budget cannot retain
        # everything does not.
        assert actions(session) & {COMPRESS, RECOMPUTE}
        for record in records:
            assert METRICS <= set(record) and record["budget_bytes"] == budget
            assert record["plan_id"] == session.adacc.plan.plan_id == record["measured_plan_id"]
            # The plan's step as predicted: per micro-batch the profiled step plus its added
            # time.
            assert micro_batches(session) == 2
            assert record["predicted_step_time_s"] == pytest.approx(
                micro_batches(session)
                * (costs.meta["step_s"] + session.adacc.result.added_time_s))
            # Exactly: the profile ran forward_step's own loss on the loop's micro-batch.
            assert record["activation_bytes"] == record["predicted_activation_bytes"]
            # The peak the plan table printed, what the budget bounds.
            assert record["predicted_peak_bytes"] == session.adacc.result.peak_bytes <= budget
    assert len(counted_profiles) == 1            # later runs reuse the ProfileDB
    assert costs.to_dict() == session.adacc.costs.to_dict()

    run(tmp_path, "--adacc-policy", "auto", "--adacc-memory-budget", "1GiB", "--adacc-reprofile")
    assert len(counted_profiles) == 2


def test_a_plans_predictions_are_evaluated_once_not_at_every_step(tmp_path, monkeypatch):
    # Every record and log line carries them; evaluating the plan costs milliseconds of host
    # time a step on a 24-layer model.
    calls = []
    names = ("predicted_activation_bytes", "predicted_activation_peak_bytes",
             "predicted_peak_bytes")
    for name in names:
        real = getattr(policies, name)
        monkeypatch.setattr(policies, name, lambda *args, real=real, name=name: (
            calls.append(name), real(*args))[1])
    counts = []
    for iters in ("2", "5"):
        calls.clear()
        _, records = run(tmp_path, "--adacc-policy", "auto", "--adacc-tracking", "off",
                         "--adacc-memory-budget", "1GiB", "--train-iters", iters)
        assert len(records) == int(iters)
        assert all(r["predicted_activation_bytes"] == records[0]["predicted_activation_bytes"]
                   for r in records)
        counts.append(sorted(calls))
    assert counts[0] == counts[1] == sorted(names)


def test_auto_with_an_infeasible_budget_names_the_smallest_feasible_one(tmp_path, capsys):
    code = main([*TINY, "--train-iters", "1", "--adacc-policy", "auto",
                              "--adacc-memory-budget", "100KiB",
                              "--adacc-profile-db", str(tmp_path / "p.sqlite")])
    assert code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "smallest feasible budget is" in lines[0], lines


def test_auto_on_a_cpu_needs_a_budget():
    with pytest.raises(ConfigError, match="needs --adacc-memory-budget"):
        parse("--adacc-policy", "auto")
    with pytest.raises(ConfigError, match="--adacc-memory-budget"):
        parse("--adacc-policy", "auto", "--adacc-memory-budget", "12 parsecs")
    with pytest.raises(ConfigError, match="not one of"):
        parse("--adacc-policy", "fastest")
    with pytest.raises(ConfigError, match=r"^--adacc-lossy-sources chooses what auto's plans "
                                          r"rebuild from, so it needs --adacc-policy auto or "
                                          r"auto-no-outlier \(got full-recompute\)$"):
        parse("--adacc-policy", "full-recompute", "--adacc-lossy-sources")


@pytest.mark.parametrize("policy, action", [("full-recompute", RECOMPUTE),
                                            ("quantize", COMPRESS), ("none", None)])
def test_baselines_run_through_the_same_runtime_and_log(tmp_path, policy, action):
    # A budget means nothing to megatron's stock layer (and is refused with policy none).
    budget = [] if action is None else ["--adacc-memory-budget", "8MiB"]
    session, records = run(tmp_path, "--adacc-policy", policy, *budget)
    plan = session.adacc.plan
    if action is None:
        assert plan is None and records[0]["plan_id"] == "none"
    else:
        assert {d.action for d in plan.for_layer(0).values()} == {action, RETAIN}
        assert records[0]["plan_id"] == plan.plan_id
    for record in records:
        assert METRICS <= set(record)
        assert record["budget_bytes"] == (None if action is None else 8 << 20)
        assert record["static_bytes"] == session.adacc.static_bytes > 0
    if policy == "quantize":
        codecs = {d.codec_for(s) for s, d in plan.for_layer(0).items() if d.action == COMPRESS}
        assert codecs == {sites.QUANTIZE_CODEC, "bitmask"}


def test_below_what_the_designated_codecs_fit_auto_warns_and_uses_naive_int4(tmp_path, capsys):
    session, _ = run(tmp_path, "--adacc-policy", "auto", "--adacc-tracking", "off",
                     "--adacc-memory-budget", "1GiB")
    costs = session.adacc.costs
    quantize = policies.quantize_plan()
    budget = planning.peak_bytes(costs, [planning.evaluate_layer(costs, quantize.for_layer(layer))
                                         for layer in range(costs.num_layers)])
    designated = planning.codec_tiers(costs)[0]
    # Below the designated codecs' minimum (training plans exact rebuild sources).
    assert budget < planning.minimum_budget(designated, allow_lossy_sources=False)
    capsys.readouterr()
    session, records = run(tmp_path, "--adacc-policy", "auto", "--adacc-tracking", "off",
                           "--adacc-memory-budget", str(budget))
    used = planning.last_resort_sites(session.adacc.result)
    warnings = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert used and warnings == [policies.last_resort_warning("auto", session.adacc.result)]
    # Exactly: sym_int4 and outlier_int4 payloads hold their planned sizes whatever the data.
    first = records[0]
    assert first["activation_bytes"] == first["predicted_activation_bytes"]
    assert first["static_bytes"] + first["activation_peak_bytes"] <= budget


def test_below_every_exact_plan_auto_rebuilds_from_compressed_values_once_asked(tmp_path,
                                                                               capsys):
    """A budget that only lossy rebuild sources fit is refused in one line naming the flag
    that allows them and their smallest budget; with the flag, auto trains within it on a
    plan that rebuilds from a compressed value."""
    from megatron_adacc.common.units import format_size

    session, _ = run(tmp_path, "--adacc-policy", "auto", "--adacc-tracking", "off",
                     "--adacc-memory-budget", "1GiB")
    costs = session.adacc.costs
    exact = planning.minimum_feasible_budget(costs, allow_lossy_sources=False)
    lossy = planning.minimum_feasible_budget(costs, allow_lossy_sources=True)
    assert lossy < exact
    capsys.readouterr()
    flags = ["--adacc-policy", "auto", "--adacc-tracking", "off",
             "--adacc-memory-budget", str(lossy)]
    assert main([*TINY, "--train-iters", "1", "--adacc-profile-db",
                 str(tmp_path / "profiles.sqlite"), *flags]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].endswith(
        f"feasible budget is {format_size(exact)} ({exact} B; static memory alone is "
        f"{format_size(costs.static_bytes)}); with --adacc-lossy-sources "
        f"(AdaccConfig.lossy_sources), which rebuilds recomputed values from compressed ones, "
        f"it is {format_size(lossy)} ({lossy} B)"), lines

    session, records = run(tmp_path, *flags, "--adacc-lossy-sources")
    result = session.adacc.result
    assert result.allow_lossy_sources and result.peak_bytes <= lossy
    assert not all(planning.is_exact(costs, layer) for layer in result.layer_decisions)
    first = records[0]
    assert first["activation_bytes"] == first["predicted_activation_bytes"]
    assert first["static_bytes"] + first["activation_peak_bytes"] <= lossy
    assert all(math.isfinite(record["loss"]) for record in records)


# Big enough for the unfused attention's s^2 gradients to set the backward's peak.
S2_BOUND = ["--num-layers", "4", "--hidden-size", "128", "--seq-length", "128",
            "--max-position-embeddings", "128", "--micro-batch-size", "4",
            "--global-batch-size", "4"]


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_a_step_at_the_smallest_feasible_budget_stays_within_the_predicted_peak(
        tmp_path, monkeypatch, precision):
    """Every byte the step's ops make counts from the op that makes it until it is freed
    (LiveBytes), the unfused attention's backward included. Their peak stays within the
    planner's prediction over static."""
    from megatron.training import training

    from helpers.storages import LiveBytes

    original, peaks = training.train_step, []

    def counted(*args, **kwargs):
        with LiveBytes() as live:
            result = original(*args, **kwargs)
        peaks.append(live.peak)
        return result

    monkeypatch.setattr(training, "train_step", counted)
    flags = [*S2_BOUND, *precision, "--attention-backend", "unfused", "--adacc-policy", "auto",
             "--adacc-profile-repeats", "1"]  # what it checks is bytes, not times
    session, _ = run(tmp_path, *flags, "--adacc-memory-budget", "1GiB")
    smallest = session.adacc.result.minimum_feasible_budget
    session, records = run(tmp_path, *flags, "--adacc-memory-budget", str(smallest))
    assert RECOMPUTE in actions(session) and COMPRESS in actions(session)
    predicted = records[-1]["predicted_peak_bytes"] - records[-1]["static_bytes"]
    assert peaks[-1] <= predicted
