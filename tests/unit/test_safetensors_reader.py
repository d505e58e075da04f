"""CheckpointReader keeps no file pages resident once a tensor it returned is dropped: safetensors hands out
views into a memory map of the file, and a handle kept open would keep every page read so far in the
process's resident set (a rank importing a checkpoint held its share twice; bench import measured it)."""

import re
import sys
from pathlib import Path

import pytest
import torch

from dynmoe_dist.models.hf.safetensors_reader import CheckpointReader

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
MIB = 2**20


def resident_bytes_of(path: Path) -> int:
    """Resident bytes of this process's mappings of ``path`` (every Rss line of its /proc/self/smaps entries)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        header = re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line)
        if header:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


@pytest.fixture
def checkpoint(tmp_path):
    from safetensors.torch import save_file

    save_file({"big": torch.randn(2048, 1024), "small": torch.zeros(4)}, str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.mark.parametrize("read", [lambda r: r.tensor("big"), lambda r: r.rows("big", 0, 1024)], ids=["tensor", "rows"])
def test_a_dropped_read_leaves_no_file_pages_resident(checkpoint, read):
    path = (checkpoint / "model.safetensors").resolve()
    with CheckpointReader(checkpoint) as reader:
        assert reader.shape("big") == (2048, 1024)  # a header read: the file stays open for headers
        t = read(reader)
        assert float(t.abs().sum()) > 0  # touches every page of the view
        assert resident_bytes_of(path) >= t.numel() * 4 - MIB // 4  # the view's pages are the file's, mapped
        copy = t.clone()
        del t
        assert resident_bytes_of(path) <= 64 * 1024, "the reader still maps the pages it read"
        assert torch.equal(copy, reader.tensor("big")[: copy.shape[0]])
