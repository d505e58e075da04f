"""Importing the project, then transformers (which imports torchao wherever it is installed, as `make setup`
installs it for QLoRA), prints none of torchao's CPU-build noise, and the filters keep every other record."""

import logging
import subprocess
import sys

import pytest

from dynmoe_dist import _DropMessages


def test_transformers_with_torchao_imports_quietly():
    pytest.importorskip("torchao")
    code = "import dynmoe_dist, transformers, torchao; from transformers import AutoModelForCausalLM"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Failed to load" not in done.stderr and "Enum subclass" not in done.stderr, done.stderr[-2000:]


def test_the_filter_drops_only_the_named_messages():
    quiet = _DropMessages("Failed to load")

    def record(message):
        return logging.LogRecord("torchao", logging.WARNING, __file__, 1, message, None, None)

    assert not quiet.filter(record("Failed to load /x/_C_mxfp8.so: no CUDA"))
    assert quiet.filter(record("something else went wrong"))
