"""train/tensor_file.py: a safetensors file written one tensor at a time, read by safetensors itself."""

import gc
import weakref

import pytest
import torch
from safetensors.torch import load_file

from dynmoe_dist.train.dense_state import CheckpointError
from dynmoe_dist.train.tensor_file import read_tensors, write_streamed

TENSORS = [
    ("0/1/params/w_in", torch.randn(3, 5, dtype=torch.float64)),
    ("0/1/state/w_in/step", torch.tensor(7.0)),  # Adam's step: a 0-d tensor
    ("1/0/params/w_out", torch.randn(4, 2).to(torch.bfloat16)),
    ("1/0/params/mask", torch.tensor([True, False, True])),
    ("1/0/params/empty", torch.zeros(0, 3)),
    ("1/0/params/ids", torch.arange(5, dtype=torch.int32)),
    ("1/0/params/strided", torch.randn(4, 6).t()),  # not contiguous
]


def test_safetensors_reads_back_every_dtype_and_shape(tmp_path):
    path = tmp_path / "experts.safetensors"
    write_streamed(path, TENSORS, lambda t: t)
    for loaded in (load_file(str(path)), read_tensors(path)):
        assert sorted(loaded) == sorted(name for name, _ in TENSORS)
        for name, t in TENSORS:
            assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    assert sorted(read_tensors(path, lambda name: name.startswith("0/"))) == ["0/1/params/w_in", "0/1/state/w_in/step"]
    assert not path.with_name(path.name + ".partial").exists()


def test_one_tensor_on_the_host_at_a_time(tmp_path):
    """Each host tensor is dropped before the next is made: the file never needs a copy of them all."""
    made = []

    def to_host(t):
        gc.collect()
        assert all(ref() is None for ref in made), "an earlier host tensor is still held"
        host = t.clone()  # what a gather or a device-to-host copy makes
        made.append(weakref.ref(host))
        return host

    write_streamed(tmp_path / "f.safetensors", TENSORS, to_host)
    assert len(made) == len(TENSORS)


def test_a_rank_that_does_not_write_takes_part_in_every_gather_in_order(tmp_path):
    seen = []
    write_streamed(None, TENSORS, lambda t: seen.append(t.shape) or t)
    assert seen == [t.shape for _, t in TENSORS] and not list(tmp_path.iterdir())


def test_a_host_tensor_of_another_shape_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"tensor '0/1/params/w_in': \(5, 3\)"):
        write_streamed(tmp_path / "f.safetensors", TENSORS[:1], lambda t: t.t())


def test_a_cut_or_missing_file_is_named(tmp_path):
    path = tmp_path / "f.safetensors"
    write_streamed(path, TENSORS, lambda t: t)
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match=f"{path} is corrupt or unreadable"):
        read_tensors(path)
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'nothing'} does not exist"):
        read_tensors(tmp_path / "nothing")
