"""mlx-lm's LoRA config keys (mlx_lm.lora's CONFIG_DEFAULTS and flags) that mean
something in segctl, each with what to write instead. A job that carries one
(a user bringing an mlx-lm config, at the top level or inside a section, or a
sweep axis naming one) gets "unknown key: mlx-lm's KEY <says>" rather than a
did-you-mean that guesses from spelling (`batch_size` is not a typo of
anything). Keys that mean nothing here (steps_per_report, test, test_batches,
config, clear_cache_threshold, trust_remote_code) are left out and keep the
plain "unknown key". Keys segctl shares with mlx-lm at the same place (model,
report_to; seed, max_seq_length, ... inside their sections) are never unknown.
"""

# mlx-lm key -> the rest of the sentence "mlx-lm's <key> ..."
MLX_LM_KEYS = {
    "batch_size": "is segctl's train.batch_size",
    "grad_accumulation_steps": "is segctl's train.grad_accumulation",
    "iters": "is segctl's train.iters",
    "learning_rate": "is segctl's train.learning_rate",
    "lr_schedule": "is segctl's train.schedule + train.warmup",
    "steps_per_eval": "is segctl's train.eval_every",
    "save_every": "is segctl's train.checkpoint_every",
    "val_batches": "is segctl's train.val_batches",
    "seed": "is segctl's train.seed",
    "max_seq_length": "is segctl's data.max_seq_length",
    "mask_prompt": "is segctl's data.mask_prompt",
    "num_layers": "is segctl's lora.num_layers",
    "lora_parameters": "is segctl's lora (rank, scale, dropout, keys)",
    "grad_checkpoint": "is segctl's memory.grad_checkpoint (with segment_size 0)",
    "adapter_path": "is segctl's output",
    "project_name": "is segctl's report_to: [{type: wandb, project: ...}]",
    "fine_tune_type": "has no segctl key (segctl trains LoRA only: the lora section)",
    "optimizer": "has no segctl key (segctl trains with AdamW: train.learning_rate, "
                 "train.weight_decay, train.grad_clip)",
    "optimizer_config": "has no segctl key (segctl trains with AdamW: train.weight_decay)",
    "resume_adapter_file": "has no segctl key (segctl train --resume continues a run from "
                           "its output folder's last checkpoint)",
}
