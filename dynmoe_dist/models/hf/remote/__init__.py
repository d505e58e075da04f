"""The remote-code files of an exported directory (format 3), kept here as real modules.

``models/hf/pretrained.py save_exported`` copies every file of REMOTE_FILES verbatim into the directory it
writes, so plain transformers loads it with ``trust_remote_code=True`` and no dynmoe_dist installed. They
import only torch and transformers, and each other by relative imports, which transformers follows
(tests/unit/test_hf_remote.py checks it): dynmoe_layers.py holds the MoE math, modeling_dynmoe.py /
configuration_dynmoe.py the upcycled dense bases, modeling_dynmoe_moe.py / configuration_dynmoe_moe.py the
imported MoE families (apart, so a dense export loads with a transformers that predates those families).
"""

REMOTE_FILES = (
    "configuration_dynmoe.py",
    "configuration_dynmoe_moe.py",
    "dynmoe_layers.py",
    "modeling_dynmoe.py",
    "modeling_dynmoe_moe.py",
)
