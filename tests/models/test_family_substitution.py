"""A model family is added by substitution: a new family declares its parts (deriving from an
existing family's) and the analytic accelerator model prices its layer without being edited."""
from dataclasses import replace

import pytest

from megatron_adacc import models
from megatron_adacc.models.gpt import GELU_MLP
from megatron_adacc.models.llama import LLAMA, RMSNORM
from megatron_adacc.planning import analytic
from megatron_adacc.launch import read_config

from helpers import ROOT

LLAMA3_8B_FLAGS = {dest.replace("_", "-"): value for dest, value in read_config(
    str(ROOT / "configs" / "llama3-8b.yaml")).items()}


@pytest.fixture
def register():
    """models.register, with the registries restored after the test."""
    registries = (models.FAMILIES, models.NORMS, models.MLPS, models.POSITIONS)
    saved = [dict(registry) for registry in registries]
    yield models.register
    for registry, entries in zip(registries, saved):
        registry.clear()
        registry.update(entries)


def test_a_family_derived_from_llama_is_priced_by_its_own_term(register):
    # A fused RMSNorm kernel (Transformer Engine's, Apex's) saves its input as it comes, where
    # torch's RMSNorm saves an fp32 copy of a bf16 input: one term of Llama's declaration.
    fused = register(models.ModelFamily(
        name="llama-fused-norm", description="Llama with a fused RMSNorm kernel",
        variant=replace(LLAMA.variant, norm=replace(RMSNORM, name="FusedRMSNorm",
                                                    input_dtype=None)),
        flags={**LLAMA.flags, "normalization": "FusedRMSNorm"}))
    # a CPU's kernels: torch's RMSNorm, whose fp32 input copy the derived part drops
    llama = replace(analytic.ModelShape.from_flags(LLAMA3_8B_FLAGS), cuda_kernels=False)
    shape = replace(analytic.ModelShape.from_flags({**LLAMA3_8B_FLAGS, **fused.flags}),
                    cuda_kernels=False)
    assert (llama.precision, shape.normalization) == ("bf16", "FusedRMSNorm")

    s, b, h = 8192, 2, 4096
    sizes, llama_sizes = analytic.site_bytes(shape, b), analytic.site_bytes(llama, b)
    norm_inputs = {"layer_in", "ln2_in"}
    assert {name: sizes[name] for name in norm_inputs} == {name: s * b * h * 2
                                                           for name in norm_inputs}
    assert {name: llama_sizes[name] for name in norm_inputs} == {name: s * b * h * 4
                                                                 for name in norm_inputs}
    assert {k: v for k, v in sizes.items() if k not in norm_inputs} \
        == {k: v for k, v in llama_sizes.items() if k not in norm_inputs}
    # the final norm's input too, and nothing else of the model
    assert analytic.output_activation_bytes(llama, b) \
        - analytic.output_activation_bytes(shape, b) == s * b * h * 2
    assert (shape.num_parameters, shape.ffn) == (llama.num_parameters, llama.ffn)

    costs = analytic.analytic_costs(shape, b, "h100-80gb")
    llama_costs = analytic.analytic_costs(llama, b, "h100-80gb")
    assert costs.site("layer_in").dtype == "bfloat16"
    assert llama_costs.site("layer_in").dtype == "float32"
    assert costs.site("layer_in").codecs[0].payload_bytes \
        < llama_costs.site("layer_in").codecs[0].payload_bytes
    assert [site for site in costs.sites if site.name not in norm_inputs] \
        == [site for site in llama_costs.sites if site.name not in norm_inputs]
    assert costs.operators == llama_costs.operators
    assert fused.sites == LLAMA.sites


def test_a_changed_part_under_a_taken_name_is_refused(register):
    # it would be silently priced as the part the name already selects
    with pytest.raises(ValueError, match="^family llama-fused-norm: --normalization RMSNorm "
                                         r"already selects another part \(RMSNorm\)"):
        register(models.ModelFamily(
            name="llama-fused-norm", description="", flags=LLAMA.flags,
            variant=replace(LLAMA.variant, norm=replace(RMSNORM, input_dtype=None))))
    assert "llama-fused-norm" not in models.FAMILIES
    # Llama's own parts again are the same parts
    assert register(replace(LLAMA, name="llama-again")).variant == LLAMA.variant


def test_an_unknown_part_is_refused_naming_its_flag():
    with pytest.raises(ValueError, match="^--normalization ScaleNorm: expected one of "
                                         "LayerNorm, RMSNorm$"):
        analytic.ModelShape(2, 64, 4, 32, 100, normalization="ScaleNorm")
    with pytest.raises(ValueError, match="^--position-embedding-type alibi: expected one of "
                                         "learned_absolute, none, rope, yarn$"):
        analytic.ModelShape(2, 64, 4, 32, 100, position_embedding_type="alibi")


def test_an_mlp_declares_terms_for_exactly_its_sites():
    gelu_in, gelu_out = GELU_MLP.site_terms.values()
    for terms in ({"gelu_out": gelu_out, "gelu_in": gelu_in},                   # order
                  {"gelu_in": gelu_in, "swiglu_up": gelu_in, "gelu_out": gelu_out}):  # a site
        with pytest.raises(ValueError, match="MLP gelu: its terms must be those of its sites"):
            replace(GELU_MLP, site_terms=terms)


def test_each_unmodelled_layer_flag_is_megatron_lms_and_off_by_default():
    # The table names Megatron-LM's flags by hand: a renamed flag or a new default would let a
    # layer no family describes through unrefused.
    from megatron_adacc.launch import build_parser
    from megatron_adacc.models import family

    actions = {action.dest: action for action in build_parser()._actions}
    for name, off, _ in family.UNMODELLED_LAYER_FLAGS:
        assert "--" + name.replace("_", "-") in actions[name].option_strings, name
        assert actions[name].default == off, name
