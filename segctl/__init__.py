"""segctl: LoRA fine-tuning across a fleet of Macs with a segmented-backward MLX engine.

The code lives in four packages, imported as `segctl.schemas` (the vocabulary),
`segctl.engine` (one step, one training run; never imports Ray), `segctl.node`
(a machine's agent and its engine processes) and `segctl.orchestrator` (the head,
planner, stores and CLI); imports point one way: orchestrator -> node -> engine ->
schemas. A fifth, `segctl.lab` (hosts in network namespaces for trying a fleet on
one Linux box), sits beside them: it imports node and schemas, and only the CLI
imports it. Installed, they sit inside this package (pyproject's package-dir maps
them there). In a checkout they are the folders beside this one, and this folder
holds a link to each (segctl/engine -> ../engine): `import segctl.engine`
resolves through the file system alone, for Python and for static tools.
"""

from __future__ import annotations

import os

# MLX on CUDA keeps one cuDNN attention graph per shape in a small cache (256
# forward, 64 backward, read when MLX loads) and stops the process when it
# thrashes. Blocked attention calls one shape per block (rows [i, i + block) over
# keys [0, i + block)): 512 at 128K tokens in blocks of 256, the same in every
# layer. Room for them all, set here because every entry point (the CLI, the
# engine worker, the benchmarks) imports segctl before MLX; a user's own setting wins.
for _var in ("MLX_CUDA_SDPA_CACHE_SIZE", "MLX_CUDA_SDPA_BACKWARD_CACHE_SIZE"):
    os.environ.setdefault(_var, "2048")
