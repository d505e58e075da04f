"""train/checkpoint_base.py's recipes: what an event formed, kept as a table of combinations per layer that each
expert's one-term recipe names (so a copy of a copy is rebuilt by storing twice, as the run did), pruned to what
the experts and the discarded one still reach; a checkpoint's flat combination (written before the table) is
rebuilt as before, from the base's experts as the run held them."""

import pytest
import torch

from dynmoe_dist.moe import MoEConfig
from dynmoe_dist.moe.experts import expert_param_specs
from dynmoe_dist.moe.frozen_base import stored
from dynmoe_dist.planning.placement import Placement
from dynmoe_dist.planning.planner import AddSpec, LayerPlan
from dynmoe_dist.train.checkpoint_base import FrozenBase, LayerBase, LayerRecipes, recipes_entry, recipes_from

CONFIG = MoEConfig(dim=16, ffn_dim=64, num_experts=3)


def plan(kept, added, remember=None):
    """A layer plan keeping ``kept`` (old ids) and adding ``added`` (AddSpecs); placement and loads do not matter."""
    count = len(kept) + len(added)
    return LayerPlan(0, (), tuple(kept), tuple(added), Placement.default(count, 1), remember, 0, 1.0, 1.0)


def copy_of(expert):
    return AddSpec("most_activated", (), "experts", ((expert, 1.0),))


def test_a_copy_of_a_formed_expert_names_it_and_the_table_keeps_only_what_is_reached():
    recipes = LayerRecipes.of_base(3)
    for _ in range(20):  # each event: drop expert 0 (remembered), add a copy of the last expert
        recipes = recipes.planned(plan([1, 2], [copy_of(2)], remember=0))
    assert len(recipes.experts) == 3 and recipes.discarded is not None
    assert len(recipes.formed) == 21  # a chain of 20 copies and the discarded expert: the 19 others dropped
    for index, combo in enumerate(recipes.formed):  # a combination names earlier ones only
        assert all(not t.startswith("formed/") or int(t.split("/")[1]) < index for t, _ in combo)
    assert recipes.experts[2] == ((f"formed/{len(recipes.formed) - 1}", 1.0),)
    assert recipes_from(recipes_entry([recipes])) == [recipes]


def test_a_reused_discarded_expert_is_stored_again():
    recipes = LayerRecipes.of_base(3).planned(plan([1, 2], [], remember=0))
    recipes = recipes.planned(plan([0, 1], [AddSpec("reuse_discarded", (), "discarded")]))
    assert recipes.formed == ((("base/0", 1.0),), (("formed/0", 1.0),))
    assert recipes.experts[2] == (("formed/1", 1.0),) and recipes.discarded == (("formed/0", 1.0),)


@pytest.fixture
def base():
    generator = torch.Generator().manual_seed(0)
    experts = [
        {
            name: torch.randn(shape, generator=generator, dtype=torch.float64)
            for name, shape in expert_param_specs(CONFIG)
        }
        for _ in range(3)
    ]
    return lambda layer, expert: experts[expert]


@pytest.mark.parametrize("base_dtype", ["bfloat16", "nf4"])
def test_a_formed_expert_is_rebuilt_from_its_sources_as_the_run_held_them(base, base_dtype):
    pytest.importorskip("torchao")
    like = torch.zeros((), dtype=torch.float64)
    recipes = LayerRecipes.of_base(3).planned(plan([0, 1], [copy_of(2)]))
    rebuild = LayerBase(0, CONFIG, like, FrozenBase(base, base_dtype), recipes.formed)
    got = rebuild.frozen_weights(recipes.experts[2])["w_in"]
    w_in = base(0, 2)["w_in"]
    held = stored(w_in, base_dtype).to(torch.float64)  # what the event read: the stored source, widened
    assert torch.equal(got, held)
    assert torch.equal(rebuild.frozen_weights(recipes.experts[0])["w_in"], base(0, 0)["w_in"])  # the base's own
    if base_dtype == "nf4":  # why: quantising the float base once gives other bits than the run's re-quantising
        assert not torch.equal(stored(held, "nf4").to(torch.float64), held)


def test_an_older_checkpoints_flat_combination_is_summed_from_the_held_base(base):
    like = torch.zeros((), dtype=torch.float64)
    rebuild = LayerBase(0, CONFIG, like, FrozenBase(base, "bfloat16"), ())
    got = rebuild.frozen_weights((("base/0", 0.5), ("base/1", 0.5)))["w_out"]
    rounded = [base(0, e)["w_out"].to(torch.bfloat16).to(torch.float64) for e in (0, 1)]
    assert torch.equal(got, torch.zeros_like(got) + 0.5 * rounded[0] + 0.5 * rounded[1])


def test_an_older_checkpoints_entry_reads_without_a_table_and_its_combination_joins_one():
    flat = [[["base/0", 0.5], ["base/1", 0.5]], [["base/2", 1.0]]]
    [recipes] = recipes_from({"recipes": [flat], "discarded_recipes": [None]})
    assert recipes.formed == () and recipes.experts[0] == (("base/0", 0.5), ("base/1", 0.5))
    later = recipes.planned(plan([0, 1], [copy_of(0)]))  # a copy of the averaged expert names its combination
    assert later.formed == ((("base/0", 0.5), ("base/1", 0.5)), (("formed/0", 1.0),))
    assert later.experts == (recipes.experts[0], (("base/2", 1.0),), (("formed/1", 1.0),))
