"""What an expert an adaptive event adds is under LoRA (lora.added_experts, moe/experts.py ``as_added``).

The tiny imported Qwen3-MoE converted to top-any (8 experts, adapters on attention and the routed experts, an event
after step 2 that removes and adds experts), one process, float64. Right after the event each added expert is
checked against the expert it was formed from (adaptive.expert_init 'most_activated': a copy of one base expert,
whose recipe names it) as it was at the event: its frozen weights equal the source's; its adapters are the source's
('copy'), fresh (A drawn within PEFT's bound, B zero: 'fresh_adapter'), or the source's with its own weights
trainable too ('trainable'); a seeded random expert (expert_init 'random') gets A drawn from the event's seed even
under 'copy' (zero A and B never got a gradient). In the two steps after it every parameter of it that trains gets
a nonzero gradient (Adam's first moment), a trainable expert's own weights included. A run saved after step 4
resumes with the uninterrupted run's losses exactly, its checkpoint holding a trainable added expert's weights, and a
float32 trainable run's merged export gives the run's logits (1e-6)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import moe_run_settings, save_moe_run_files, train_saving  # noqa: E402

from dynmoe_dist.moe.adapters import SIDES, drawn_a, is_adapter, seeded_generator  # noqa: E402
from dynmoe_dist.train.checkpoint_parts import expert_file  # noqa: E402
from dynmoe_dist.train.tensor_file import read_tensors  # noqa: E402

EVENT, SAVE_AT, STEPS = 2, 4, 6  # the event runs after step 2 (adaptive.period_steps 3, its window ends early)
LORA = ("lora.enabled=true", "lora.rank=2", "lora.targets=['attention', 'routed_experts']")
TOP_ANY = ("moe.router='top_any'", "moe.calibrate_k=1", "moe.calibrate_samples=16")
CASES = {  # name -> (lora.added_experts, adaptive.expert_init)
    "copy": ("copy", "most_activated"),
    "copy-random": ("copy", "random"),
    "fresh_adapter": ("fresh_adapter", "most_activated"),
    "trainable": ("trainable", "most_activated"),
}
ADAPTERS = [name for side in SIDES.values() for name in side]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return save_moe_run_files(tmp_path_factory.mktemp("lora_added"), "qwen3_moe", 8)


def settings(root, case):
    mode, init = CASES[case]
    extra = (f"lora.added_experts='{mode}'", f"adaptive.expert_init='{init}'")
    return moe_run_settings(root / "qwen3_moe", root / "corpus.txt", 1, *TOP_ANY, *LORA, *extra, steps=STEPS, batch=7)


def experts_by_id(trainer):
    """MoE layer -> logical id -> the expert module (one process holds every expert)."""
    return [dict(shard.local_modules()) for shard in trainer.parts.experts.shards]


def snapshot(trainer):
    return [
        {e: {n: p.detach().clone() for n, p in m.named_parameters()} for e, m in layer.items()}
        for layer in experts_by_id(trainer)
    ]


def run_through_event(root, case):
    """A run to STEPS: (trainer, the experts as they were when the event after step EVENT formed the added ones, the
    added experts right after it as (layer, id, recipe, parameters), their first Adam moments two steps later)."""
    from dynmoe_dist.config import load_config
    from dynmoe_dist.coordination import CollectiveCoordinator
    from dynmoe_dist.train.loop import Trainer
    from dynmoe_dist.train.run import adaptive_controller, calibrate_at_start

    trainer = Trainer(load_config(None, [*settings(root, case), f"output.out_dir='{root / case}'"]))
    adaptive = adaptive_controller(trainer, CollectiveCoordinator(trainer.groups))
    calibrate_at_start(trainer)
    before, added, moments = None, [], {}
    while trainer.step < STEPS:
        step = trainer.step
        adaptive.before_step(step)
        trainer.train_step([])
        if trainer.step == EVENT:
            before = snapshot(trainer)
        records = adaptive.after_step(step)
        if trainer.step == EVENT:
            added = added_experts(trainer, records)
        if trainer.step == EVENT + 2:
            moments = first_moments(trainer, added)
    return trainer, before, added, moments


def added_experts(trainer, records):
    layout = trainer.parts.experts.layout(trainable_only=True)
    modules = experts_by_id(trainer)
    found = []
    for record in records:
        for entry in record.get("added", []):
            layer, expert = record["layer"], entry["expert"]
            recipe = formed_from(layout, layer, layout["recipes"][layer][expert])
            found.append((layer, expert, recipe, dict(modules[layer][expert].named_parameters())))
    assert found, "the event must add an expert"
    # what they are now: the live parameters train on (their optimizer state is read two steps later)
    return [(*entry, {n: (p.detach().clone(), p.requires_grad) for n, p in entry[3].items()}) for entry in found]


def formed_from(layout, layer, recipe):
    """The combination of old experts an event formed an expert from ('formed/I' names it in the layer's table); a
    seeded random expert's recipe as it is."""
    [(term, _)] = recipe
    kind, _, number = term.partition("/")
    return layout["formed_recipes"][layer][int(number)] if kind == "formed" else recipe


def first_moments(trainer, added):
    """(layer, id) -> parameter name -> Adam's exp_avg (None for a parameter without optimizer state)."""
    state = trainer.parts.optimizer.state
    return {
        (layer, expert): {name: state.get(p, {}).get("exp_avg") for name, p in params.items()}
        for layer, expert, _, params, _ in added
    }


@pytest.fixture(scope="module", params=list(CASES))
def case_run(request, root):
    return request.param, run_through_event(root, request.param)


def source_of(recipe):
    """The base expert a single-term recipe copies (at the first event, its logical id before the event)."""
    [(term, coeff)] = recipe
    assert term.startswith("base/") and coeff == 1.0, recipe
    return int(term.split("/")[1])


def test_an_added_expert_is_what_added_experts_says(case_run):
    case, (_, before, added, _) = case_run
    mode, init = CASES[case]
    for layer, _, recipe, _, at_event in added:
        params = {name: value for name, (value, _) in at_event.items()}
        if init == "random":
            [(term, _)] = recipe
            assert term.startswith("random/"), recipe
            generator = seeded_generator(int(term.split("/")[1]), "added expert adapters")
            for a_name, b_name in SIDES.values():
                assert torch.equal(params[a_name], drawn_a(params[a_name].shape, generator)), a_name
                assert not params[b_name].any(), b_name
            continue
        source = before[layer][source_of(recipe)]
        for name, (value, trains) in at_event.items():
            if not is_adapter(name) or mode in ("copy", "trainable"):
                assert torch.equal(value, source[name]), (case, name)
            assert trains == (mode == "trainable" or is_adapter(name)), (case, name)
        if mode == "fresh_adapter":
            for a_name, b_name in SIDES.values():
                bound = params[a_name].shape[1] ** -0.5
                assert params[a_name].any() and params[a_name].abs().max() <= bound, a_name
                assert not torch.equal(params[a_name], source[a_name]) and not params[b_name].any(), a_name


def test_every_parameter_of_it_that_trains_gets_a_gradient(case_run):
    case, (_, _, added, moments) = case_run
    trains = ADAPTERS if CASES[case][0] != "trainable" else None
    for layer, expert, *_ in added:
        for name, exp_avg in moments[(layer, expert)].items():
            if trains is None or name in trains:
                # A fresh A gets its gradient once B has moved from zero, a step later (as in PEFT)
                assert exp_avg is not None and exp_avg.abs().sum() > 0, (case, layer, expert, name)
            else:
                assert exp_avg is None, (case, name)


@pytest.mark.parametrize("case", list(CASES))
def test_a_resume_after_the_event_is_exact(root, case, tmp_path):
    trainer, whole, events, checkpoint = train_saving(settings(root, case), tmp_path / "whole", STEPS, SAVE_AT)
    assert any(added for step, _, _, added, _ in events if step == EVENT), events
    saved = {name.split("/")[3] for name in read_tensors(expert_file(checkpoint, 0))}
    assert ("w_in" in saved) == (case == "trainable"), sorted(saved)  # a trainable added expert's own weights
    resumed_trainer, resumed, _, _ = train_saving(settings(root, case), tmp_path / "resumed", STEPS, resume=checkpoint)
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    assert all(resumed[step] == whole[step] for step in resumed), (resumed, whole)
    trains = [[(n, p.requires_grad) for n, p in t.model.named_parameters()] for t in (trainer, resumed_trainer)]
    assert trains[0] == trains[1]


def test_a_float32_export_of_a_trainable_run_gives_its_logits(root, tmp_path):
    """The export merges each expert from what the checkpoint saved: a trainable added expert's own trained weights
    (not its recipe's base), its adapters folded in."""
    from transformers import AutoModelForCausalLM

    from dynmoe_dist.export import export
    from dynmoe_dist.moe.aux_collector import collect_aux_losses

    run_settings = [*settings(root, "trainable"), "train.precision='float32'"]
    trainer, _, events, checkpoint = train_saving(run_settings, tmp_path / "run", SAVE_AT, SAVE_AT)
    assert any(added for *_, added, _ in events), events
    export(checkpoint, tmp_path / "out", progress=False)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True, dtype=torch.float32)
    ids = torch.randint(2, 8, (2, 7), generator=torch.Generator().manual_seed(3))
    logits = []
    for model in (merged, trainer.model):
        model.eval()
        with torch.no_grad(), collect_aux_losses():
            logits.append(model(input_ids=ids).logits)
    scale = float(logits[1].abs().max())  # merging rounds W + (alpha/r) B A once
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-6 * scale)


def test_a_bad_value_is_one_line():
    from dynmoe_dist.models.lora import LoraConfig

    with pytest.raises(ValueError, match=r"^lora.added_experts \('merged'\) must be one of \('copy', .*\)$"):
        LoraConfig(enabled=True, added_experts="merged")
    with pytest.raises(ValueError, match=r"^lora.added_experts \('fresh_adapter'\) needs 'routed_experts' in .*$"):
        LoraConfig(enabled=True, targets=("attention",), added_experts="fresh_adapter")
    with pytest.raises(
        ValueError, match=r"^lora.added_experts \('trainable'\) needs lora.base_dtype 'run', got 'bf.*$"
    ):
        LoraConfig(enabled=True, base_dtype="bfloat16", added_experts="trainable")
