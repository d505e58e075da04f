"""Checkpoint files: atomic commit, crash while writing, missing/corrupt files, architecture mismatch."""

import io
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file as safetensors_load
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from dynmoe_dist.config import load_config
from dynmoe_dist.parallel.reshard import dense_named_parameters
from dynmoe_dist.train import checkpoint as ckpt
from dynmoe_dist.train import checkpoint_parts
from dynmoe_dist.train.checkpoint import CheckpointError, complete_checkpoints
from dynmoe_dist.train.checkpoint_parts import read_expert_file
from dynmoe_dist.train.dense_state import read_metadata
from dynmoe_dist.train.loop import Trainer

ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")


def _trainer(out_dir, *extra):
    cfg = load_config(
        None,
        [
            "task.num_samples=120",
            "task.max_len=8",
            "model.dim=16",
            "model.num_heads=2",
            "model.ffn_dim=16",
            "train.global_batch_size=8",
            "moe.num_experts=3",
            f"output.out_dir='{out_dir}'",
            *extra,
        ],
    )
    return Trainer(cfg)


def test_save_then_resume_restores_weights_and_step(tmp_path):
    t = _trainer(tmp_path)
    for _ in range(2):
        t.train_step()
    path = t.checkpoint_manager().save(t.step)
    assert path.name == "step_000002" and (path / "meta.pt").is_file()
    fresh = _trainer(tmp_path)
    assert fresh.checkpoint_manager().resume("auto") == path
    assert fresh.step == 2
    for (n, a), (_, b) in zip(t.model.named_parameters(), fresh.model.named_parameters()):
        assert torch.equal(a, b), n
    p = t.moe_layers[0].experts.experts[0].w_in
    q = fresh.moe_layers[0].experts.experts[0].w_in
    assert torch.equal(t.parts.optimizer.state[p]["exp_avg"], fresh.parts.optimizer.state[q]["exp_avg"])


def test_crash_while_writing_leaves_previous_checkpoint(tmp_path, monkeypatch):
    t = _trainer(tmp_path)
    t.train_step()
    first = t.checkpoint_manager().save(t.step)
    t.train_step()
    real_save = ckpt.atomic_save

    def dying_save(obj, path):
        if path.name == "meta.pt":
            raise KeyboardInterrupt("machine lost while writing")
        real_save(obj, path)

    monkeypatch.setattr(ckpt, "atomic_save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        t.checkpoint_manager().save(t.step)
    monkeypatch.setattr(ckpt, "atomic_save", real_save)
    assert complete_checkpoints(str(tmp_path)) == [first]
    assert (tmp_path / "checkpoints" / "step_000002.tmp").is_dir()  # the torn one is never picked
    # the export's CHECKPOINT: a run's OUT or OUT/checkpoints is its newest complete checkpoint
    for where in (tmp_path, tmp_path / "checkpoints", first):
        assert ckpt.checkpoint_or_last(where) == first
    fresh = _trainer(tmp_path)
    assert fresh.checkpoint_manager().resume("auto") == first and fresh.step == 1


def test_a_run_directory_without_a_complete_checkpoint_is_named(tmp_path):
    (tmp_path / "checkpoints" / "step_000004.tmp").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"^CHECKPOINT \('.*'\) holds no complete checkpoint"):
        ckpt.checkpoint_or_last(tmp_path)
    assert ckpt.checkpoint_or_last(tmp_path / "nothing") == tmp_path / "nothing"  # read_checkpoint_meta names it


def test_old_checkpoints_pruned_after_new_one_is_complete(tmp_path):
    t = _trainer(tmp_path, "output.keep_checkpoints=2")
    for _ in range(3):
        t.train_step()
        t.checkpoint_manager().save(t.step)
    assert [p.name for p in complete_checkpoints(str(tmp_path))] == ["step_000002", "step_000003"]


def test_missing_and_corrupt_checkpoints_name_the_file(tmp_path):
    t = _trainer(tmp_path)
    with pytest.raises(CheckpointError, match=str(tmp_path / "nowhere")):
        t.checkpoint_manager().resume(str(tmp_path / "nowhere"))
    assert t.checkpoint_manager().resume("auto") is None  # nothing yet: fresh start
    t.train_step()
    path = t.checkpoint_manager().save(t.step)
    data = next((path / "dense").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])  # a data file cut short
    with pytest.raises(CheckpointError, match=f"{path / 'dense'} is corrupt or unreadable"):
        _trainer(tmp_path).checkpoint_manager().resume(str(path))
    (path / "dense" / ".metadata").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"dense/\.metadata is corrupt or unsafe"):
        _trainer(tmp_path).checkpoint_manager().resume(str(path))
    experts = path / "experts_ep0.safetensors"  # the experts load first
    experts.write_bytes(experts.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"{experts} is corrupt or unreadable"):
        _trainer(tmp_path).checkpoint_manager().resume(str(path))
    experts.unlink()
    with pytest.raises(CheckpointError, match=f"{experts} does not exist"):
        _trainer(tmp_path).checkpoint_manager().resume(str(path))


def _saved_after_a_step(tmp_path):
    t = _trainer(tmp_path)
    t.train_step()
    return t, t.checkpoint_manager().save(t.step)


def test_expert_files_stream_the_live_tensors_not_copies(tmp_path, monkeypatch):
    """What the expert file is written from is the model's and the optimizer's own tensors (made host tensors
    one at a time by the writer), never a copy of them all."""
    t = _trainer(tmp_path)
    t.train_step()
    handed = []
    monkeypatch.setattr(checkpoint_parts, "write_streamed", lambda path, tensors, to_host: handed.extend(tensors))
    t.checkpoint_manager().save(t.step)
    held = {p.data_ptr() for layer in t.moe_layers for p in layer.experts.parameters()}
    held |= {v.data_ptr() for p in t.parts.optimizer.state for v in t.parts.optimizer.state[p].values()}
    assert len(handed) == 3 * 4 * (1 + len(ADAM_KEYS)) and all(v.data_ptr() in held for _, v in handed)


def test_expert_files_of_the_torch_save_layout_still_resume(tmp_path):
    """Checkpoints written before experts were streamed hold experts_ep{r}.pt: read as before."""
    t, path = _saved_after_a_step(tmp_path)
    torch.save(read_expert_file(path, 0), path / "experts_ep0.pt")
    (path / "experts_ep0.safetensors").unlink()
    fresh = _trainer(tmp_path)
    fresh.checkpoint_manager().resume(str(path))
    for (n, a), (_, b) in zip(t.model.named_parameters(), fresh.model.named_parameters()):
        assert torch.equal(a, b), n
    assert sorted(ckpt.read_checkpoint_experts(path)) == ["0/0", "0/1", "0/2"]


def test_checkpoint_of_the_old_one_file_layout_is_refused_by_name(tmp_path):
    _, path = _saved_after_a_step(tmp_path)
    shutil.rmtree(path / "dense")
    torch.save({"params": {}, "state": {}}, path / "dense.pt")
    with pytest.raises(CheckpointError, match=f"{path / 'dense.pt'} is in the old format"):
        _trainer(tmp_path).checkpoint_manager().resume(str(path))


def test_architecture_mismatch_is_refused(tmp_path):
    t = _trainer(tmp_path)
    t.train_step()
    path = t.checkpoint_manager().save(t.step)
    other = _trainer(tmp_path, "model.ffn_dim=32")
    with pytest.raises(CheckpointError, match=r"different \[model\]: ffn_dim 16 != 32"):
        other.checkpoint_manager().resume(str(path))


def test_a_checkpoint_from_before_an_option_existed_resumes_at_its_default(tmp_path):
    """meta.pt written before moe.target_k, moe.balance and moe.balance_rate existed: a run that leaves them at
    their defaults resumes it; one that sets a budget is told the checkpoint ran without one."""
    import json

    t = _trainer(tmp_path)
    t.train_step()
    path = t.checkpoint_manager().save(t.step)
    meta = torch.load(path / "meta.pt", weights_only=True)
    config = json.loads(meta["config"])
    for key in ("target_k", "balance", "balance_rate"):
        del config["moe"][key]
    meta["config"] = json.dumps(config)
    torch.save(meta, path / "meta.pt")
    resumed = _trainer(tmp_path)
    resumed.checkpoint_manager().resume(str(path))
    assert resumed.step == 1
    with pytest.raises(CheckpointError, match=r"different \[moe\]: target_k None != 1.5"):
        _trainer(tmp_path, "moe.target_k=1.5").checkpoint_manager().resume(str(path))


class _NotATensor:
    """A custom class: torch.load(weights_only=True) must refuse to unpickle it."""

    def __init__(self):
        self.payload = [1, 2, 3]


def test_checkpoint_files_load_with_weights_only(tmp_path):
    # One process, ep size 1, one MoE layer (block 1) with 3 experts: rank 0 writes every file.
    t = _trainer(tmp_path)
    t.train_step()
    path = t.checkpoint_manager().save(t.step)
    assert sorted(f.name for f in path.iterdir()) == ["dense", "experts_ep0.safetensors", "meta.pt"]
    meta = torch.load(path / "meta.pt", weights_only=True)  # raises on any non-tensor pickle
    experts = read_expert_file(path, 0)
    assert sorted(meta) == ["config", "format", "states", "step"]
    states = meta["states"]
    assert sorted(states) == ["dense", "experts", "model", "recorders", "trainer"]  # no adaptive controller here
    assert states["model"] == {"base": None, "definition": None}  # a built-in model: defined by the config alone
    assert meta["step"] == 1 and states["experts"]["num_experts"] == [3] and torch.is_tensor(states["trainer"]["rng"])
    assert states["trainer"]["data"]["step"] == 1 and states["recorders"] == {"window": None}
    # dense/ (DCP): every non-expert parameter by name (routers included), each with its Adam state after 1 step.
    dense_names = sorted(n for n, _ in dense_named_parameters(t.model, t.parts.experts.shards))
    keys = sorted(read_metadata(path / "dense").state_dict_metadata)
    assert keys == sorted(
        [f"param/{n}" for n in dense_names] + [f"adam/{n}/{k}" for n in dense_names for k in ADAM_KEYS]
    )
    assert "stack.blocks.1.ffn.router.weight" in dense_names and "stack.blocks.1.ffn.router.threshold" in dense_names
    assert not any(".experts." in n for n in dense_names)
    params = ckpt.read_checkpoint_dense(path)
    for name, p in t.model.named_parameters():
        if name in dense_names:
            assert torch.equal(params[name], p.detach()), name
    # experts_ep0.safetensors: keyed "layer/logical expert": 0/0, 0/1, 0/2, each with its weights and their
    # state, equal to what the model and the optimizer hold; safetensors' own loader reads the same file.
    assert sorted(experts) == ["0/0", "0/1", "0/2"]
    held = t.parts.experts.owned_tensors()
    for key, entry in experts.items():
        assert sorted(entry) == ["params", "state"]
        assert sorted(entry["params"]) == sorted(entry["state"]) == ["b_in", "b_out", "w_in", "w_out"]
        for name, p in entry["params"].items():
            assert torch.equal(p, held[key]["params"][name]), (key, name)
        for name, state in entry["state"].items():
            assert sorted(state) == sorted(ADAM_KEYS)
            assert all(torch.equal(v, held[key]["state"][name][k]) for k, v in state.items()), (key, name)
    assert len(safetensors_load(path / "experts_ep0.safetensors")) == 3 * 4 * (1 + len(ADAM_KEYS))
    # The project's loader reads the same files, and refuses one that holds an arbitrary pickled object.
    assert ckpt.load_file(path / "meta.pt")["step"] == 1
    evil = path / "experts_ep0.pt"
    torch.save({"0/0": {"params": {}, "state": {}, "hook": _NotATensor()}}, evil)
    with pytest.raises(CheckpointError, match=r"experts_ep0\.pt is corrupt or unreadable"):
        ckpt.load_file(evil)


class _Exploit:
    """Unpickling this runs a function of the attacker's choice (here a harmless marker write)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


REFUSED = r"dense/\.metadata is corrupt or unsafe: io\.open is not a checkpoint metadata class"


def test_malicious_dcp_metadata_is_refused_before_anything_runs(tmp_path):
    t = _trainer(tmp_path)
    t.train_step()
    path = t.checkpoint_manager().save(t.step)
    marker = tmp_path / "pwned"
    metadata = path / "dense" / ".metadata"
    original = metadata.read_bytes()
    real = read_metadata(path / "dense")
    real.planner_data = _Exploit(marker)  # a real metadata object carrying a payload
    metadata.write_bytes(pickle.dumps(real))
    for read in (
        lambda: _trainer(tmp_path).checkpoint_manager().resume(str(path)),
        lambda: ckpt.read_checkpoint_dense(path),
    ):
        with pytest.raises(CheckpointError, match=REFUSED):
            read()
    assert not marker.exists()
    pickle.loads(metadata.read_bytes())  # what DCP's own reader does: the payload is live
    assert marker.exists()
    marker.unlink()
    # Byte entries (pickled objects, which DCP would load with weights_only=False) are refused too.
    metadata.write_bytes(original)
    real = read_metadata(path / "dense")
    real.state_dict_metadata["evil"] = BytesStorageMetadata()
    metadata.write_bytes(pickle.dumps(real))
    with pytest.raises(CheckpointError, match=r"dense/\.metadata is corrupt or unsafe"):
        ckpt.read_checkpoint_dense(path)


class _AsOldPython:
    """Pickles like Python before 3.11.5 (Debian 12's 3.11.2) pickles an Enum member: getattr(class, name)."""

    def __init__(self, cls, name):
        self.cls, self.name = cls, name

    def __reduce__(self):
        return getattr, (self.cls, self.name)


def test_metadata_pickled_by_an_older_python_reads_and_getattr_gives_only_enum_members(tmp_path, monkeypatch):
    """DCP's metadata holds _MEM_FORMAT_ENCODING members; an older 3.11 pickles them through builtins.getattr,
    which the safe reader must take for an allowed enum's member and nothing else."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, TensorProperties

    from dynmoe_dist.train.dense_state import _MetadataUnpickler

    def load(obj):
        return _MetadataUnpickler(io.BytesIO(pickle.dumps(obj))).load()

    member = next(iter(_MEM_FORMAT_ENCODING))
    assert load(_AsOldPython(_MEM_FORMAT_ENCODING, member.name)) is member
    for cls, name in ((TensorProperties, "__init__"), (_MEM_FORMAT_ENCODING, "__class__"), (Path, "home")):
        with pytest.raises(pickle.UnpicklingError, match="not a member of a checkpoint metadata enum"):
            load(_AsOldPython(cls, name))
    t = _trainer(tmp_path)
    t.train_step()
    path = t.checkpoint_manager().save(t.step)
    metadata = path / "dense" / ".metadata"
    real = read_metadata(path / "dense")
    with monkeypatch.context() as old_python:
        old_python.setattr(
            _MEM_FORMAT_ENCODING, "__reduce_ex__", lambda self, protocol: (getattr, (type(self), self.name))
        )
        metadata.write_bytes(pickle.dumps(real))
    assert b"getattr" in metadata.read_bytes()
    ckpt.read_checkpoint_dense(path)  # reads, as it does on that Python
