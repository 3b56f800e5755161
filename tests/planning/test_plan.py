"""Plan: YAML round trip, per-layer overrides, and errors that name the bad key."""
import pytest
import yaml

from megatron_adacc.common.plan import Decision, Plan, PlanError
from megatron_adacc.common.sites import SITE_NAMES


def test_yaml_round_trip_keeps_every_decision():
    text = """
sites: {ln1_out: recompute, gelu_in: compress, gelu_out: {action: compress, codec: sym_int4}}
layers:
  "0-1": {sites: {gelu_in: retain, qkv: recompute}}
  "3": {sites: {softmax_out: compress}}
"""
    plan = Plan.from_yaml(text)
    again = Plan.from_yaml(plan.to_yaml())
    assert again == plan and again.plan_id == plan.plan_id
    for layer in range(5):
        assert again.for_layer(layer) == plan.for_layer(layer)
    assert plan.decision(0, "gelu_in") == Decision("retain")
    assert plan.decision(2, "gelu_in") == Decision("compress")
    assert plan.decision(1, "qkv") == Decision("recompute")
    assert plan.decision(3, "softmax_out").codec_for("softmax_out") == "asym_int4"
    assert plan.decision(4, "gelu_out").codec_for("gelu_out") == "sym_int4"
    assert plan.decision(4, "context") == Decision("retain")


def test_an_outlier_capacity_round_trips_and_builds_the_runtimes_codec():
    # The planner writes each outlier site's capacity into the plan: the payload it counts.
    plan = Plan.from_yaml("\nsites: {gelu_in: {action: compress, capacity: 5}, "
                          "ln1_out: {action: compress, codec: outlier_int4, capacity: 0}}\n")
    again = Plan.from_yaml(plan.to_yaml())
    assert again == plan and again.plan_id == plan.plan_id
    assert plan.decision(0, "gelu_in") == Decision("compress", None, 5)
    assert plan.decision(0, "gelu_in").codec_options() == {"capacity": 5}
    assert plan.plan_id != Plan.from_yaml(
        "sites: {gelu_in: {action: compress, capacity: 6}}").plan_id


def test_for_layer_covers_every_site():
    assert set(Plan().for_layer(0)) == set(SITE_NAMES)


def test_from_layers_is_compact_and_exact():
    per_layer = [{"qkv": Decision("recompute")}] * 3 + [{"gelu_in": Decision("compress")}]
    plan = Plan.from_layers(per_layer)
    assert plan.sites == {"qkv": Decision("recompute")}
    assert list(plan.layers) == [(3, 3)]
    for layer, expected in enumerate(per_layer):
        got = {s: d for s, d in plan.for_layer(layer).items() if d.action != "retain"}
        assert got == expected
    assert Plan.from_yaml(plan.to_yaml()).for_layer(3) == plan.for_layer(3)


def test_plan_id_changes_with_the_plan():
    a = Plan.uniform({"qkv": "recompute"})
    assert a.plan_id == Plan.uniform({"qkv": "recompute"}).plan_id
    assert a.plan_id != Plan.uniform({"qkv": "compress"}).plan_id


def test_a_plan_is_hashed_once_however_often_its_id_is_asked(monkeypatch):
    plan = Plan.from_layers([{"qkv": Decision("recompute")}, {}])
    first = plan.plan_id
    monkeypatch.setattr(Plan, "to_dict", lambda self: pytest.fail("hashed again"))
    assert [plan.plan_id for _ in range(5)] == [first] * 5


@pytest.mark.parametrize("data, message", [
    ({"sites": {"qkvv": "retain"}}, r"sites: unknown site 'qkvv'; valid sites: layer_in, "),
    ({"sites": {"qkv": "drop"}},
     r"sites\.qkv: unknown action 'drop'; valid actions: retain, compress, recompute"),
    ({"sites": {"qkv": {"action": "compress", "codec": "zip"}}},
     r"unknown codec 'zip'; valid codecs: .*channel_int4"),
    ({"sites": {"layer_in": "recompute"}},
     r"sites\.layer_in: layer_in cannot be recomputed.*retain or compress"),
    ({"sites": {"qkv": {"action": "retain", "codec": "bitmask"}}},
     r"a codec only applies to action 'compress'"),
    ({"sites": {"qkv": {"acton": "retain"}}},
     r"unknown key\(s\) \['acton'\]; valid keys: action, codec, capacity"),
    ({"sites": {"qkv": {"action": "compress", "capacity": 2}}},
     r"sites\.qkv: a capacity only applies to compress with outlier_int4"),
    ({"sites": {"gelu_in": {"action": "compress", "codec": "sym_int4", "capacity": 2}}},
     r"a capacity only applies"),
    ({"sites": {"gelu_in": {"action": "compress", "capacity": -1}}},
     r"capacity must be a whole number >= 0, got -1"),
    ({"sites": {"gelu_in": {"action": "compress", "capacity": "4"}}},
     r"capacity must be a whole number"),
    ({"layers": {"0-1": {"sites": {"qkv": "retain"}}, "1": {"sites": {}}}},
     r"range '1' overlaps '0-1'"),
    ({"layers": {"a-b": {"sites": {}}}}, r"bad layer range 'a-b'"),
    ({"layers": {"0": {"sites": {"bogus": "retain"}}}}, r"layers\.0\.sites: unknown site 'bogus'"),
    ({"sitez": {}}, r"unknown plan key\(s\) \['sitez'\]; valid keys: sites, layers"),
])
def test_bad_plans_name_the_key_and_the_choices(data, message):
    with pytest.raises(PlanError, match=message):
        Plan.from_dict(data)


def test_load_names_the_file(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({"sites": {"nope": "retain"}}))
    with pytest.raises(PlanError, match=f"{path}: sites: unknown site 'nope'"):
        Plan.load(path)
    with pytest.raises(PlanError, match="does not exist"):
        Plan.load(tmp_path / "missing.yaml")
    good = Plan.uniform({"gelu_in": "compress"})
    good.save(path)
    assert Plan.load(path) == good


def test_validate_layers_rejects_ranges_beyond_the_model():
    plan = Plan.from_dict({"layers": {"2-5": {"sites": {"qkv": "recompute"}}}})
    plan.validate_layers(6)
    with pytest.raises(PlanError, match="'2-5' is outside the model's 4 layers"):
        plan.validate_layers(4)


def test_compact_form_does_not_depend_on_the_hash_seed():
    # Two layers, two policies, one each: the default must not be picked in set order, or
    # processes (ranks) with different hash seeds print different plans and plan_ids.
    import subprocess
    import sys

    code = ("from megatron_adacc.common.plan import Plan, Decision;"
            "print(Plan.from_layers([{'ln1_out': Decision('recompute')},"
            " {'gelu_in': Decision('compress')}]).plan_id)")
    ids = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**__import__("os").environ, "PYTHONHASHSEED": str(seed)},
                          check=True).stdout.strip() for seed in range(6)}
    assert len(ids) == 1
