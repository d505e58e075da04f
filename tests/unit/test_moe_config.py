"""MoEConfig validation: every bound the layer config checks, each with its field and value in the message;
and the generic value-type check every config section uses (conforms, describe)."""

from typing import List, Optional, Tuple

import pytest

from dynmoe_dist.moe.config import DEFAULT_AUX, MoEConfig, _scalar_ok, conforms, describe


@pytest.mark.parametrize("min_experts", [0, -1])
def test_min_experts_below_one_is_rejected(min_experts):
    with pytest.raises(ValueError, match=rf"min_experts \({min_experts}\) must be >= 1"):
        MoEConfig(num_experts=4, min_experts=min_experts)


def test_experts_bounds_accept_their_edges():
    # min_experts = 1 and min_experts = num_experts = max_experts are all allowed.
    assert MoEConfig(num_experts=4, min_experts=1).min_experts == 1
    edge = MoEConfig(num_experts=4, min_experts=4, max_experts=4)
    assert (edge.min_experts, edge.num_experts, edge.max_experts) == (4, 4, 4)
    assert MoEConfig(num_experts=1, min_experts=1).max_experts == 2


def test_max_experts_defaults_to_twice_num_experts():
    assert MoEConfig(num_experts=3).max_experts == 6
    assert MoEConfig(num_experts=3, max_experts=5).max_experts == 5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dim=0), r"dim \(0\) must be >= 1"),
        (dict(ffn_dim=0), r"ffn_dim \(0\) must be >= 1"),
        (dict(num_experts=0, max_experts=4, min_experts=1), r"num_experts \(0\) must be >= 1"),
        (dict(num_experts=4, max_experts=3), r"max_experts \(3\) < num_experts \(4\)"),
        (dict(num_experts=4, min_experts=5), r"min_experts \(5\) > num_experts \(4\)"),
        (dict(router="top_2"), r"router \('top_2'\) must be one of"),
        (dict(router="top_k", num_experts=4, top_k=0), r"top_k \(0\) must be in \[1, num_experts \(4\)\]"),
        (dict(router="top_k", num_experts=4, top_k=5), r"top_k \(5\) must be in \[1, num_experts \(4\)\]"),
        (dict(top_p=0.0), r"top_p \(0\.0\) must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p \(1\.5\) must be in \(0, 1\]"),
        (dict(aux_loss_weight=-0.5), r"aux_loss_weight \(-0\.5\) must be >= 0"),
        (dict(aux_losses=("diverse", "bogus")), r"aux_losses entry \('bogus'\) must be one of"),
        (dict(aux_losses=("diverse", "entropy")), r"aux_losses entry \('entropy'\) needs a softmax router"),
        (dict(activation="tanh"), r"activation \('tanh'\) must be one of"),
        (dict(expert_kind="moe"), r"expert_kind \('moe'\) must be one of \('ffn', 'gated', 'gpt_oss'\)"),
        (dict(expert_kind="gpt_oss", expert_bias=False), r"expert_kind \('gpt_oss'\) needs expert_bias true"),
        (dict(preset="paper-v2"), r"preset \('paper-v2'\) must be one of \('paper', 'paper-v1', 'project'\)"),
        (dict(train_k0="skip"), r"train_k0 \('skip'\) must be one of"),
        (dict(eval_k0="zero"), r"eval_k0 \('zero'\) must be one of"),
        (dict(expert_compute="einsum"), r"expert_compute \('einsum'\) must be one of"),
    ],
)
def test_each_bad_field_is_rejected_with_its_name_and_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(dim=1, ffn_dim=1),
        dict(router="top_k", num_experts=4, top_k=1),
        dict(router="top_k", num_experts=4, top_k=4),
        dict(router="top_any", num_experts=4, top_k=99),  # top_k is only checked for the top_k router
        dict(top_p=1.0),
        dict(top_p=1e-6),
        dict(aux_loss_weight=0.0),
        dict(aux_losses=()),
        dict(activation="silu", train_k0="top1", eval_k0="skip", expert_compute="loop"),
    ],
)
def test_values_on_the_allowed_edges_are_accepted(kwargs):
    config = MoEConfig(**kwargs)
    for name, value in kwargs.items():
        assert getattr(config, name) == value


def test_aux_losses_default_per_router_and_become_a_tuple():
    # a bare top-any layer takes its preset's losses, as a run config does
    assert MoEConfig(router="top_any").aux_losses == ("diverse", "simple")
    assert MoEConfig(router="top_any", preset="paper").aux_losses == ("diverse", "simple", "load_balance", "efficiency")
    assert MoEConfig(router="top_k").aux_losses == ("switch",)
    assert MoEConfig(router="top_p", preset="paper").aux_losses == ("switch",)
    assert "top_any" not in DEFAULT_AUX
    assert MoEConfig(aux_losses=["simple"]).aux_losses == ("simple",)


def test_validate_rechecks_after_a_field_is_changed():
    config = MoEConfig(num_experts=4)
    config.min_experts = 0
    with pytest.raises(ValueError, match=r"min_experts \(0\)"):
        config.validate()


@pytest.mark.parametrize(
    "value, kind, ok",
    [
        (True, bool, True),
        (False, bool, True),
        (1, bool, False),  # 1 is no boolean
        (3, int, True),
        (True, int, False),  # nor is `true` an integer, though bool subclasses int
        (2.5, int, False),
        (3, float, True),  # a number may be written as an integer
        (2.5, float, True),
        (False, float, False),
        ("2.5", float, False),
        ("x", str, True),
        (1, str, False),
    ],
)
def test_scalar_kinds(value, kind, ok):
    assert _scalar_ok(value, kind) is ok


@pytest.mark.parametrize(
    "value, annotation, ok",
    [
        (3, int, True),
        ("3", int, False),
        (None, Optional[int], True),  # Optional: None, or a value of the inner type
        (3, Optional[int], True),
        ("x", Optional[int], False),
        (["a", "b"], List[str], True),  # a list of any length, every entry of the type
        ([], List[str], True),
        ("ab", List[str], False),  # a string is no list
        (["a", 1], List[str], False),
        (("a",), Tuple[str, ...], True),
        (["a", 2], Tuple[str, ...], False),
        (None, Optional[Tuple[str, ...]], True),
        (["a"], Optional[Tuple[str, ...]], True),
        ([1, "a"], Tuple[int, str], True),  # a fixed tuple: exactly that many, each of its own type
        (["a", 1], Tuple[int, str], False),
        ([1, 2], Tuple[int, int], True),
        ([1, 2, 3], Tuple[int, int], False),
        ([1], Tuple[int, int], False),
        ([0.9, 1], Tuple[float, float], True),
    ],
)
def test_conforms(value, annotation, ok):
    assert conforms(value, annotation) is ok


def test_conforms_refuses_an_unknown_field_type():
    with pytest.raises(TypeError, match=r"config fields of type <class 'dict'> are not supported by conforms\(\)"):
        conforms({}, dict)


@pytest.mark.parametrize(
    "annotation, text",
    [
        (int, "an integer"),
        (float, "a number"),
        (str, "a string"),
        (bool, "true or false"),
        (Optional[float], "a number"),
        (List[str], "a list of strings"),
        (Tuple[str, ...], "a list of strings"),
        (Optional[Tuple[str, ...]], "a list of strings"),
        (Tuple[float, float], "a list of 2 numbers"),
        (Tuple[int, int, int], "a list of 3 integers"),
    ],
)
def test_describe(annotation, text):
    assert describe(annotation) == text
