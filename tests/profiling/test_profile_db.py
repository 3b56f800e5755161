"""The ProfileDB: profiles survive runs, keyed by what they depend on; a bad file never stops
training."""
import sqlite3

import pytest

from megatron_adacc.profiling import profile_db
from megatron_adacc.common.costs import CodecCost, ModelCosts, SiteCost
from megatron_adacc.profiling.profile_db import ProfileDB


def costs(non_layer=1000) -> ModelCosts:
    sites = [SiteCost("layer_in", 4096, "float32",
                      codecs=(CodecCost("outlier_int4", 600, 1e-4, 2e-4),)),
             SiteCost("gelu_in", 16384, "float32", 3e-4, "mlp")]
    return ModelCosts(sites, num_layers=2, static_bytes=10_000, non_layer_bytes=non_layer,
                      backward_workspace_bytes=500, micro_batch_size=2, meta={"source": "test"})


KEY = {"num_layers": 2, "hidden_size": 64, "micro_batch_size": 2, "device": "cpu",
       "code_version": "x"}


def test_a_profile_is_found_again_under_its_key_only(tmp_path):
    path = tmp_path / "p.sqlite"
    ProfileDB(path).put(KEY, costs())
    again = ProfileDB(path)  # another run
    assert again.get(KEY).to_dict() == costs().to_dict()
    for field, value in (("micro_batch_size", 4), ("device", "gpu"), ("code_version", "y")):
        assert again.get({**KEY, field: value}) is None
    again.put(KEY, costs(non_layer=7))
    assert again.get(KEY).non_layer_bytes == 7


@pytest.mark.parametrize("content", [b"garbage, not sqlite" * 100,
                                     b"SQLite format 3\x00" + b"\xff" * 4000])
def test_a_corrupt_file_is_reported_and_rebuilt(tmp_path, capsys, content):
    path = tmp_path / "p.sqlite"
    path.write_bytes(content)
    db = ProfileDB(path)
    assert db.get(KEY) is None
    db.put(KEY, costs())
    assert db.get(KEY) is not None
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(err) == 1 and str(path) in err[0] and "moved it to" in err[0]
    assert len(list(tmp_path.glob("p.sqlite.bad-*"))) == 1


def test_a_foreign_sqlite_database_is_refused_and_left_as_it_is(tmp_path):
    from megatron_adacc.common.errors import InputError

    path = tmp_path / "p.sqlite"
    with sqlite3.connect(path) as other:
        other.execute("CREATE TABLE accounts (id INTEGER)")
        other.execute("INSERT INTO accounts VALUES (42)")
    other.close()
    before = path.read_bytes()
    for use in (lambda db: db.put(KEY, costs()), lambda db: db.get(KEY)):
        with pytest.raises(InputError, match=f"^profile database {path} is another "
                           f"application's SQLite database"):
            use(ProfileDB(path))
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["p.sqlite"]


def _put_when_all_are_ready(path, barrier, index):
    barrier.wait()
    ProfileDB(path).put({**KEY, "micro_batch_size": index}, costs())


def test_processes_creating_the_database_together_all_cache(tmp_path, capfd):
    import multiprocessing

    context = multiprocessing.get_context("fork")
    for attempt in range(5):  # the race is in creating the schema: several fresh files
        path = tmp_path / f"p{attempt}.sqlite"
        barrier = context.Barrier(4)
        workers = [context.Process(target=_put_when_all_are_ready, args=(path, barrier, i))
                   for i in range(4)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
        assert [w.exitcode for w in workers] == [0] * 4
        db = ProfileDB(path)
        assert all(db.get({**KEY, "micro_batch_size": i}) is not None for i in range(4))
    assert capfd.readouterr().err == ""  # no "not caching", nothing moved aside


def test_an_unwritable_location_only_warns(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    db = ProfileDB(blocker / "sub" / "p.sqlite")  # its parent cannot be a directory
    db.put(KEY, costs())
    assert db.get(KEY) is None
    assert "not caching" in capsys.readouterr().err


def test_default_path_follows_the_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("ADACC_DATA_DIR", str(tmp_path))
    assert profile_db.default_path() == tmp_path / "profiles.sqlite"
    assert profile_db.code_version().startswith("0.")


def test_adacc_plan_without_hardware_profiles_once_then_reads_the_database(
        tmp_path, monkeypatch, capsys):
    import json

    from megatron_adacc.profiling import profiler
    from megatron_adacc.cli import main

    calls = []
    real = profiler.profile
    monkeypatch.setattr(profiler, "profile",
                        lambda *a, **k: calls.append(1) or real(*a, **{**k, "repeats": 1}))
    config = tmp_path / "tiny.yaml"
    config.write_text("num-layers: 2\nhidden-size: 64\nnum-attention-heads: 4\n"
                      "seq-length: 32\nmax-position-embeddings: 32\n"
                      "tokenizer-type: NullTokenizer\nvocab-size: 257\ntransformer-impl: local\n")
    argv = ["plan", "--config", str(config), "--micro-batch-size", "2", "--memory-budget",
            "3MiB", "--profile-db", str(tmp_path / "p.sqlite"), "--json"]
    plans = []
    for _ in range(2):
        assert main(argv) == 0
        plans.append(json.loads(capsys.readouterr().out))
    assert len(calls) == 1
    assert plans[0] == {**plans[1], "solve_time_s": plans[0]["solve_time_s"]}
    assert plans[0]["feasible"] and plans[0]["budget_bytes"] == 3 << 20
    assert main([*argv[:5], "--profile-db", str(tmp_path / "p.sqlite")]) == 2  # no budget
    assert "--memory-budget" in capsys.readouterr().err


def test_the_device_a_profile_is_keyed_by_names_the_kernels_that_timed_it(monkeypatch):
    """profiler.device_name, the profile key's device: PyTorch's vector path and the codec
    kernels (ADACC_CODEC_BACKEND; the native build's vector path, which ADACC_NATIVE_CFLAGS
    lowers), so a profile timed with other kernels is not reused."""
    from megatron_adacc.codecs import BACKEND_ENV_VAR, native
    from megatron_adacc.profiling import profiler

    if not native.available():
        pytest.skip("no C compiler: the native codecs cannot be built")
    monkeypatch.setenv(BACKEND_ENV_VAR, "torch")
    reference = profiler.device_name()
    assert reference.endswith(", codecs torch)")
    monkeypatch.setenv(BACKEND_ENV_VAR, "native")
    assert profiler.device_name() == reference.replace(
        "codecs torch", f"codecs native {native.vector_isa()}")


def test_the_device_a_profile_is_keyed_by_tells_cpus_of_one_model_name_apart(monkeypatch):
    """A VM's model name can be the make alone ("AMD EPYC": a Zen 4 and a Zen 5 here, whose
    codecs run at other speeds against a copy): the profile's device names the family and
    model too, so a ProfileDB carried to the other machine measures again."""
    from megatron_adacc.codecs.native import host
    from megatron_adacc.profiling import profiler

    names = []
    for family, model in ((25, 17), (26, 2)):
        monkeypatch.setattr(host, "host_cpu",
                            lambda f=family, m=model: host.HostCpu("AMD EPYC", f, m))
        names.append(profiler.device_name())
    assert names[0].startswith("AMD EPYC (family 25, model 17) (")
    assert names[1].startswith("AMD EPYC (family 26, model 2) (")


def test_a_profile_is_keyed_by_every_setting_of_the_model(distributed):
    # A hand-picked key (shape, dropout, dtype) let a model with RMSNorm, RoPE, grouped-query
    # attention or untied embeddings reuse a GPT's profile: its predicted bytes were the GPT's.
    import json

    from megatron_adacc.models import build
    from megatron_adacc.models.family import EmbeddingOptions

    def key(embedding=EmbeddingOptions(), **settings):
        config = build.build_transformer_config(num_layers=2, hidden_size=32,
                                                num_attention_heads=4, **settings)
        model = build.build_gpt_model(config, 64, 16, embedding=embedding)
        return profile_db.profile_key(model, 16, 2, "cpu")

    gpt = key()
    assert key() == gpt
    for other in (key(normalization="RMSNorm"), key(num_query_groups=2),
                  key(recompute_granularity="selective"),
                  key(embedding=EmbeddingOptions(position_embedding_type="rope")),
                  key(embedding=EmbeddingOptions(untie_embeddings_and_output_weights=True))):
        assert other != gpt
    # the same in every process: no object's address in it
    assert "0x" not in json.dumps(gpt)
