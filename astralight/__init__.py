"""astralight: dataflow-oriented RL for agentic LLMs (the package map is in ARCHITECTURE.md).

Importing the package only installs :mod:`astralight.moved_modules`' finder, so the flat
import paths of modules that moved into :mod:`astralight.trainer` and :mod:`astralight.launch`
(``astralight.fsdp2_strategy``, ``astralight.lora``, ...) keep working in configs and code.
"""

from astralight.moved_modules import install as _install_moved_modules

_install_moved_modules()
