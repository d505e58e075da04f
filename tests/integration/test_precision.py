"""bf16 mode: autocast for experts and attention, routed rows on the wire in bf16, gate math and master
weights in fp32; its losses stay within 1e-2 relative of the fp32 run over 20 steps of the demo config."""

from dynmoe_dist.config import load_config
from dynmoe_dist.parallel.simulate import run_simulated

STEPS = 20


def losses_and_wire(precision):
    from dynmoe_dist.train.loop import Trainer

    cfg = load_config(
        "launcher/configs/demo.toml",
        [f"train.precision='{precision}'", f"train.max_steps={STEPS}", "adaptive.enabled=false"],
    )
    trainer = Trainer(cfg)
    losses = [trainer.train_step()["loss"] for _ in range(STEPS)]
    layer = trainer.moe_layers[0]
    comm = getattr(layer.dispatcher, "comm", None)
    bytes_per_row = comm.bytes_sent / max(comm.rows_sent, 1) if comm else None
    dtypes = {str(p.dtype) for p in trainer.model.parameters()}
    return losses, bytes_per_row, dtypes, str(layer.router.weight.dtype)


def both_precisions():
    return {p: losses_and_wire(p) for p in ("float32", "bf16")}


def _check(results):
    fp32, bf16 = results["float32"][0], results["bf16"][0]
    worst = max(abs(a - b) / abs(a) for a, b in zip(fp32, bf16))
    assert worst <= 1e-2, f"bf16 drifted {worst:.4f} relative from fp32"
    assert fp32 != bf16, "bf16 mode changed nothing: autocast is not in effect"
    assert results["bf16"][2] == {"torch.float32"}, "master weights must stay fp32"


def test_bf16_single_process():
    _check(both_precisions())


def test_bf16_two_ranks_rows_travel_in_bf16():
    results = run_simulated(both_precisions, 2, timeout_s=300)[0]
    _check(results)
    dim = load_config("launcher/configs/demo.toml").model.dim
    assert results["float32"][1] == dim * 4 and results["bf16"][1] == dim * 2
