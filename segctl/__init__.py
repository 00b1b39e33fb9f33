"""segctl: LoRA fine-tuning across a fleet of Macs with a segmented-backward MLX engine.

The code lives in four packages, imported as `segctl.schemas` (the vocabulary),
`segctl.engine` (one step, one training run; never imports Ray), `segctl.node`
(a machine's agent and its engine processes) and `segctl.orchestrator` (the head,
planner, stores and CLI); imports point one way: orchestrator -> node -> engine ->
schemas. Installed, they sit inside this package (pyproject's package-dir maps
them there). In a checkout they are the folders beside this one, so `python -m
segctl.orchestrator.cli` runs from the repository root without installing.
"""

from __future__ import annotations

import os

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_ROOT, "pyproject.toml")) and \
        os.path.isfile(os.path.join(_ROOT, "engine", "__init__.py")):
    __path__.append(os.path.join(_ROOT))   # noqa: F821 (a package's own __path__)
