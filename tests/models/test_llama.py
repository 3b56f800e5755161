"""The Llama family under Adacc (issue 24): RMSNorm, SwiGLU, RoPE, grouped-query attention,
untied embeddings. Every saved tensor is attributed by what it is (strict mode), retain and
recompute plans train bit for bit like the stock layer, no floating-point value reaches the
bitmask codec, and SDPA's grouped-query attention equals repeating K and V."""
import pytest
import torch
import torch.nn.functional as F

from megatron_adacc import models
from megatron_adacc.common.plan import Decision, Plan, PlanError
from megatron_adacc.policies import full_recompute_plan
from megatron_adacc.runtime import adacc_layers, apply_plan, measure_step
from megatron_adacc.common.sites import COMPRESS, MASK_CODEC, SHARED_SITES, SITES

from helpers.llama import FFN, GROUPS, HEADS, HIDDEN, build_llama, train_steps
from helpers.runtime import BATCH, VOCAB, SEQ, assert_same_training, loss_of

LLAMA = models.get("llama")
RECOMPUTABLE = [s for s in LLAMA.sites if SITES[s].recomputable
                and s not in ("attn_lse", "attn_rng_state")]
BACKENDS = ["unfused", "flash"]
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _expected_sites(dtype, backend, dropout):
    # unfused: the shared causal mask; the fp32 softmax output, which the matmul with V
    # saves again unless a 16-bit model casts it (attn_probs)
    attention = ({"qkv", "attn_lse", "context"} if backend == "flash"
                 else {"qkv", "attn_mask", "softmax_out", "context"}
                 | ({"attn_probs"} if dtype == torch.bfloat16 else set()))
    masks = {"bda1_mask", "bda2_mask"} if dropout else set()
    return ({"layer_in", "ln1_stats", "ln1_normed", "ln1_out", "rope_cos_sin", "ln2_in",
             "ln2_stats", "ln2_normed", "ln2_out", "swiglu_in", "swiglu_up", "swiglu_act",
             "swiglu_out"} | attention | masks)


@DTYPES
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_every_llama_save_is_attributed_by_what_it_is(distributed, dtype, backend, dropout):
    model = build_llama(True, dtype, backend, dropout=dropout)
    _, report = measure_step(model, lambda: loss_of(model), strict=True)
    layer_sites = {site for (layer, site) in report.by_site if layer >= 0}
    assert layer_sites == _expected_sites(dtype, backend, dropout)
    assert set(LLAMA.sites) >= layer_sites - SHARED_SITES  # shared: not per layer


def _site_bytes(report, site):
    return sum(n for (layer, name), n in report.by_site.items() if layer == 0 and name == site)


@DTYPES
def test_llama_site_bytes(distributed, dtype):
    """What each site holds, byte for byte: fp32 norm internals, the per-rank GQA sizes, V's
    own copy beside RoPE's Q and K (the fused QKV output is not pinned), the SwiGLU halves,
    RoPE's one cos and one sin (under the first layer: shared)."""
    s, b, act = SEQ, 2, torch.tensor([], dtype=dtype).element_size()
    head_dim = HIDDEN // HEADS
    for backend in BACKENDS:
        model = build_llama(True, dtype, backend)
        _, report = measure_step(model, lambda: loss_of(model), strict=True)
        expected = {
            "layer_in": s * b * HIDDEN * 4,       # fp32: the input itself, or RMSNorm's copy
            "ln1_stats": s * b * 4,
            "ln1_normed": s * b * HIDDEN * 4,
            "ln1_out": s * b * HIDDEN * act,
            "rope_cos_sin": 2 * s * head_dim * act,
            "swiglu_in": s * b * 2 * FFN * act,
            "swiglu_up": s * b * FFN * act,
            "swiglu_act": s * b * FFN * act,
            "swiglu_out": s * b * FFN * act,
            # flash: Q at the heads, K and V at the groups; unfused repeats K and V
            "qkv": s * b * head_dim * act * ((HEADS + 2 * GROUPS) if backend == "flash"
                                             else 3 * HEADS),
        }
        got = {site: _site_bytes(report, site) for site in expected}
        assert got == expected, backend


@DTYPES
@pytest.mark.parametrize("codec", ["sym_int4", "naive_int4"])
def test_a_compressed_gate_half_is_encoded_alone(distributed, dtype, codec):
    """swiglu_in saves the gate half of fc1's output: compressed, its payload is the half's
    (the up half is swiglu_up's own copy), unless the plan rebuilds the SwiGLU from it, which
    reads both halves: then the whole output is encoded. The forward is untouched and the
    gradients stay close either way."""
    from megatron_adacc import codecs
    from helpers.runtime import assert_gradients_close

    reference = build_llama(True, dtype)
    loss_of(reference).backward()
    compressed = {"swiglu_in": {"action": "compress", "codec": codec}}
    rebuilt = {name: "recompute" for name in ("swiglu_act", "swiglu_up", "swiglu_out")}
    half, whole = (codecs.get(codec).payload_bytes((SEQ, BATCH, width), dtype)
                   for width in (FFN, 2 * FFN))
    for sites, payload in ((compressed, half), ({**compressed, **rebuilt}, whole)):
        model = build_llama(True, dtype)
        apply_plan(model, Plan.uniform(sites), strict=True)
        loss, report = measure_step(model, lambda: loss_of(model), strict=True)
        assert _site_bytes(report, "swiglu_in") == payload, sites
        assert torch.equal(loss, loss_of(reference))
        assert_gradients_close(model, reference, 0.2)


@DTYPES
@pytest.mark.parametrize("backend", BACKENDS)
def test_retain_and_recompute_match_the_stock_llama_layer_bitwise(distributed, dtype, backend):
    reference = train_steps(build_llama(False, dtype, backend))
    plans = {
        "retain": Plan(),
        "recompute_all": Plan.uniform({s: "recompute" for s in RECOMPUTABLE}),
        # every site, the flash layer's own too: its later steps run under the checkpoint
        "full_recompute": full_recompute_plan(),
        "mlp_only": Plan.uniform({s: "recompute" for s in
                                  ("ln2_normed", "ln2_out", "swiglu_in", "swiglu_up",
                                   "swiglu_act", "swiglu_out")}),
        "mixed": Plan.from_dict({"sites": {"qkv": "recompute", "swiglu_act": "recompute"},
                                 "layers": {"1": {"sites": {"ln2_in": "recompute",
                                                            "ln1_normed": "recompute"}}}}),
    }
    for name, plan in plans.items():
        model = build_llama(True, dtype, backend)
        assert_same_training(reference, train_steps(model, plan=plan)), name


def test_recompute_from_a_16bit_models_fp32_norm_input_is_exact(distributed):
    # In bf16 RMSNorm saves an fp32 copy of the residual stream (layer_in, ln2_in): the
    # segments re-run from it cast back to bf16, so recompute stays bitwise.
    reference = train_steps(build_llama(False, torch.bfloat16), steps=2)
    model = build_llama(True, torch.bfloat16)
    plan = Plan.uniform({"ln2_in": "recompute", "swiglu_out": "recompute"})
    assert_same_training(reference, train_steps(model, steps=2, plan=plan))


# --- the bitmask codec only ever sees masks ----------------------------------------------------
def test_a_plan_cannot_send_a_floating_point_site_to_the_bitmask_codec():
    for site in ("swiglu_act", "qkv", "ln1_normed"):
        with pytest.raises(PlanError, match=f"sites.{site}: codec 'bitmask' cannot hold {site} "):
            Plan.from_dict({"sites": {site: {"action": "compress", "codec": "bitmask"}}})


def test_the_runtime_refuses_the_bitmask_codec_for_a_value(distributed):
    model = build_llama(True)
    layer = adacc_layers(model)[0]
    with pytest.raises(PlanError, match="layer 0.qkv: codec 'bitmask' cannot hold qkv "):
        layer.set_decisions({"qkv": Decision(COMPRESS, MASK_CODEC)})
    # The one rule, as a plan file's: an int4 codec cannot hold a dropout mask either.
    with pytest.raises(PlanError, match="layer 0.bda1_mask: codec 'naive_int4' cannot hold "):
        layer.set_decisions({"bda1_mask": Decision(COMPRESS, "naive_int4")})


def test_a_computed_tensor_attributed_to_a_mask_site_never_reaches_the_codec(distributed):
    # Were attribution ever to name a computed value a mask site, the pack hook refuses it.
    model = build_llama(True, dropout=0.1)
    layer = adacc_layers(model)[0]
    layer.set_decisions({"bda1_mask": Decision(COMPRESS)})
    layer.attributor.site_of = lambda tensor: "bda1_mask"
    with pytest.raises(RuntimeError, match="bda1_mask is a computed torch.float32 tensor"):
        loss_of(model)


# --- SDPA's grouped-query attention -----------------------------------------------------------
@DTYPES
def test_enable_gqa_equals_repeating_k_and_v(dtype):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, HEADS, SEQ, 16, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(2, GROUPS, SEQ, 16, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(2, GROUPS, SEQ, 16, generator=gen).to(dtype).requires_grad_()
    grouped = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    repeat = HEADS // GROUPS
    repeated = F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, 1),
                                              v.repeat_interleave(repeat, 1), is_causal=True)
    assert torch.equal(grouped, repeated)
    grad = torch.randn(grouped.shape, generator=gen).to(dtype)
    ours = torch.autograd.grad(grouped, (q, k, v), grad)
    theirs = torch.autograd.grad(repeated, (q, k, v), grad)
    assert torch.equal(ours[0], theirs[0])
    if dtype == torch.float32:  # bf16: K and V's gradients are sums rounded differently
        assert torch.equal(ours[1], theirs[1]) and torch.equal(ours[2], theirs[2])


def test_flash_llama_matches_unfused_megatron(distributed):
    # The same weights through megatron's unfused GQA (repeat_interleave) and SDPA's.
    unfused, flash = build_llama(False), build_llama(False, attention_backend="flash")
    torch.testing.assert_close(loss_of(flash), loss_of(unfused), rtol=1e-5, atol=1e-6)


# --- Megatron-LM's flags ------------------------------------------------------------------------
from megatron_adacc.megatron_lm import ConfigError  # noqa: E402
from helpers.pretrain import LLAMA_FLAGS, TINY, main, parse  # noqa: E402


def model_config(*flags):
    """(args, Megatron-LM's GPTModelConfig) of ``flags`` as pretrain_gpt.py builds them."""
    from megatron.training.argument_utils import gpt_config_from_args

    args = parse(*flags)
    return args, gpt_config_from_args(args)


def test_llama_flags_reach_megatron_core():
    args, config = model_config(*LLAMA_FLAGS, "--hidden-size", "64", "--num-attention-heads",
                                "4", "--norm-epsilon", "1e-6", "--rotary-base", "500000")
    # Megatron-LM's SwiGLU width: 4h x 2/3, rounded down to a multiple of 64
    assert args.ffn_hidden_size == config.transformer.ffn_hidden_size == 128
    layer = config.transformer
    assert (layer.normalization, layer.layernorm_epsilon, layer.gated_linear_unit,
            layer.activation_func, layer.num_query_groups) == ("RMSNorm", 1e-6, True, F.silu, 2)
    assert (config.position_embedding_type, config.rotary_base, config.rotary_percent,
            config.share_embeddings_and_output_weights) == ("rope", 500000, 1.0, False)
    assert parse("--swiglu", "--hidden-size", "4096", "--num-attention-heads", "32"
                 ).ffn_hidden_size == 10880
    assert parse("--swiglu", "--ffn-hidden-size", "96").ffn_hidden_size == 96


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_family_config_matches_the_trainers_flags(family):
    # A benchmark builds a family's model without the flag parser
    # (ModelFamily.transformer_config_options); its MLP must be the one Megatron-LM builds
    # from the family's flags: Megatron-LM's ffn width, not megatron-core's 4h default.
    shape = ["--hidden-size", "256", "--num-attention-heads", "8"]
    args, config = model_config(*models.get(family).argv(num_query_groups=4), *shape)
    options = models.get(family).transformer_config_options(256, num_query_groups=4)
    assert options["ffn_hidden_size"] == config.transformer.ffn_hidden_size \
        == args.ffn_hidden_size
    assert options["ffn_hidden_size"] == {"gpt": 1024, "llama": 640}[family]


@pytest.mark.parametrize("flags, message", [
    (["--group-query-attention", "--num-query-groups", "3"],
     "--num-query-groups 3 does not divide --num-attention-heads 4"),
    (["--normalization", "L2Norm"], "argument --normalization: invalid choice: 'L2Norm' "
     "(choose from 'LayerNorm', 'RMSNorm')"),
])
def test_bad_llama_flags_are_one_line_naming_the_flag(flags, message):
    with pytest.raises(ConfigError) as error:
        parse("--num-attention-heads", "4", *flags)
    assert str(error.value) == message


def test_llama_flags_megatron_lm_accepts_behave_as_there():
    # Megatron-LM turns --sequence-parallel off at one tensor-parallel rank (with a warning)
    # and takes --rotary-percent as given; the old trainer refused both.
    assert parse("--sequence-parallel").sequence_parallel is False
    assert parse("--rotary-percent", "0.5").rotary_percent == 0.5


def test_bad_llama_flags_exit_2_before_training(capsys):
    assert main(TINY + ["--group-query-attention", "--num-query-groups", "3",
                                     "--train-iters", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("--num-query-groups 3 does not divide --num-attention-heads 4")


# --- the analytic accelerator model -------------------------------------------------------------
from megatron_adacc.planning import analytic  # noqa: E402
from helpers.llama import LLAMA3_8B_TP2  # noqa: E402


@DTYPES
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_analytic_model_sizes_every_llama_site_as_measured(distributed, dtype, backend):
    model = build_llama(True, dtype, backend)
    _, report = measure_step(model, lambda: loss_of(model), strict=True)
    measured = {site: n for (layer, site), n in report.by_site.items()
                if layer == 0 and site not in SHARED_SITES}  # non-layer memory
    shape = analytic.ModelShape(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ,
        vocab_size=VOCAB, ffn_hidden_size=FFN,
        precision="bf16" if dtype == torch.bfloat16 else "fp32", attention_dropout=0.0,
        hidden_dropout=0.0, softmax_in_fp32=model.config.attention_softmax_in_fp32,
        attention_backend=backend, normalization="RMSNorm", swiglu=True,
        position_embedding_type="rope", num_query_groups=GROUPS, add_bias_linear=False)
    assert analytic.site_bytes(shape, 2) == measured
    assert analytic.shared_activation_bytes(shape, 2) == report.by_site[(0, "rope_cos_sin")]


def test_the_llama3_8b_config_plans_on_an_h100_at_tp2_with_sequence_parallelism(capsys):
    from helpers import ROOT
    from megatron_adacc.cli import main

    config = ROOT / "configs" / "llama3-8b.yaml"
    assert main(["plan", "--config", str(config), "--hardware", "h100-80gb",
                 "--micro-batch-size", "1", "--precision", "bf16",
                 "--tensor-model-parallel-size", "2", "--sequence-parallel",
                 "--use-distributed-optimizer", "--data-parallel-size", "4"]) == 0
    table = capsys.readouterr().out
    for site in ("ln1_stats", "qkv", "attn_lse", "swiglu_in", "swiglu_out"):
        assert site in table
    # CUDA's kernels: the fused RMSNorm and SwiGLU keep no intermediates
    assert "ln1_normed" not in table and "swiglu_act" not in table
    # One rank's bf16 sites (s 8192, h 4096, sequence over 2 ranks): RMSNorm's input as it
    # comes is 4096 x 4096 x 2 B per layer; Q at 16 heads, K and V at 4 groups each, x 128.
    shape = LLAMA3_8B_TP2
    sizes = analytic.site_bytes(shape, 1)
    assert sizes["layer_in"] == 4096 * 4096 * 2
    assert sizes["qkv"] == (16 + 2 * 4) * 128 * 8192 * 2
    assert sizes["swiglu_in"] == 2 * 7168 * 8192 * 2
    # parameters per tensor-parallel rank: half of Llama-3-8B's 8.03e9, norms whole
    assert shape.num_parameters == pytest.approx(8.03e9 / 2, rel=0.01)
