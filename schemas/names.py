"""Names the CLI spells before it loads anything heavy (stdlib only): training
methods, the architectures `segctl init-demo` writes, and `segctl train`'s exit
codes. schemas/job.py and schemas/events.py re-export them."""

from __future__ import annotations

from typing import Literal, get_args

Method = Literal["sft", "orpo", "dpo"]
METHODS: tuple[str, ...] = get_args(Method)

# Architectures `segctl init-demo` can write (engine/demo.py builds each).
DEMO_ARCHS = ("llama", "qwen3", "minicpm", "gemma", "gemma2", "gemma3_text", "gemma4_text",
              "gpt_oss", "olmo3", "granite", "cohere")

# Exit codes of `segctl train`, so a supervisor can tell outcomes apart without parsing.
EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT, EXIT_OOM = 0, 1, 2, 3
EXIT_RANK_LOST = 4   # a rank of a job on several nodes: a collective stalled past its timeout
