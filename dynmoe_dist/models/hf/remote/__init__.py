"""The remote-code files of an exported directory (format 2), kept here as real modules.

``python -m dynmoe_dist.export`` copies ``configuration_dynmoe.py`` and ``modeling_dynmoe.py`` verbatim
into the directory it writes, so plain transformers loads it with ``trust_remote_code=True`` and no
dynmoe_dist installed. They import only torch and transformers (tests/unit/test_hf_remote.py checks it).
"""

REMOTE_FILES = ("configuration_dynmoe.py", "modeling_dynmoe.py")
