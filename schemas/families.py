"""Which model families the engine runs a layer of a chunk of rows at a time.

The engine decides this itself, per layer class, when it loads a model
(engine/rows.py checks a layer cut against whole). The planner, which sees a
model's config.json and not its layers, reads it from here: a family listed
plans with the row-wise terms (the layer's light parts a chunk at a time); any
other plans as if every layer kept them whole, the larger figure. The test of
every mlx-lm family checks this list against the engine's own verdict.
"""

ROWWISE_FAMILIES = frozenset({
    "Klear", "afmoe", "apertus", "cohere", "cohere2", "deepseek", "dots1", "ernie4_5",
    "ernie4_5_moe", "exaone4", "exaone_moe", "gear", "gemma", "gemma2", "gemma3",
    "gemma3_text", "glm", "glm4", "glm4_moe", "gpt_oss", "granite", "granitemoe", "helium",
    "hunyuan_v1_dense", "internlm3", "laguna", "llama", "mellum", "mimo", "minicpm", "minimax",
    "mistral3", "mixtral", "nanbeige", "nemotron", "olmo2", "olmo3", "olmoe", "phi3", "phimoe",
    "pixtral", "qwen2", "qwen2_moe", "qwen2_vl", "qwen3", "qwen3_moe", "qwen3_vl", "seed_oss",
    "smollm3", "solar_open", "stablelm", "starcoder2", "telechat3",
})


# The families whose rows the engine packs into one sequence exactly (engine/step.py
# `pack_refusal`: rows packed and apart give the same log-probs). `data.pack: true`
# on any other family is refused at validate; `auto` trains it unpacked. The family
# walk checks this list against the engine's verdict.
PACKABLE_FAMILIES = frozenset({
    "Klear", "apertus", "cohere", "cohere2", "deepseek", "deepseek_v3", "deepseek_v32",
    "dots1", "ernie4_5", "ernie4_5_moe", "gear", "gemma", "gemma2", "gemma3", "gemma3_text",
    "gemma4", "gemma4_text", "glm", "glm4", "glm4_moe", "glm4_moe_lite", "gpt_oss", "granite",
    "granitemoe", "helium", "hunyuan_v1_dense", "internlm3", "kimi_vl", "laguna", "llama",
    "mellum", "mimo", "minicpm", "minimax", "mistral3", "mixtral", "nanbeige", "nemotron",
    "olmo2", "olmo3", "olmoe", "phi3", "phimoe", "pixtral", "qwen2", "qwen2_moe", "qwen2_vl",
    "qwen3", "qwen3_moe", "qwen3_vl", "seed_oss", "smollm3", "solar_open", "stablelm",
    "starcoder2", "telechat3", "youtu_llm",
})


# The families whose every decoder layer takes its attention backward tile by tile
# over the keys on long rows (engine/attention.py `tiled_vjp`: one tile of scores
# at a time, sinks, soft caps, windows, block masks and donor K/V included). Any
# other plans its long rows with MLX's backward per block of query rows: [heads,
# block, keys] scores. The family walk checks this list against what each
# family's step does.
TILED_FAMILIES = frozenset({
    "Klear", "afmoe", "apertus", "cohere", "cohere2", "deepseek", "dots1", "ernie4_5",
    "ernie4_5_moe", "exaone4", "exaone_moe", "gear", "gemma", "gemma2", "gemma3",
    "gemma3_text", "gemma4", "gemma4_text", "glm", "glm4", "glm4_moe", "gpt_oss", "granite",
    "granitemoe", "helium", "hunyuan_v1_dense", "internlm3", "laguna", "llama", "mellum",
    "mimo", "minicpm", "minimax", "mistral3", "mixtral", "nanbeige", "nemotron", "olmo2",
    "olmo3", "olmoe", "phi3", "phimoe", "pixtral", "qwen2", "qwen2_moe", "qwen2_vl", "qwen3",
    "qwen3_moe", "qwen3_vl", "seed_oss", "smollm3", "solar_open", "stablelm", "starcoder2",
    "telechat3", "youtu_llm",
})


# The families whose attention adds a learned sink per head (a logit every row sees
# besides its keys). The engine takes such a layer's blocked backward tile by tile
# at any length (engine/attention.py `tiles_keys`), so the planner plans it so too.
# The family walk checks this list against the parameters each family has.
SINKS_FAMILIES = frozenset({"gpt_oss"})
