"""mlx-lm-lora's ORPO training step, the reference side of our ORPO benchmark.

Calls mlx-lm-lora 5.10.2 (`pip install mlx-lm-lora==5.10.2`, or `.[bench]`):
`mlx_lm_lora.trainer.orpo_trainer.iterate_orpo_batches` builds the batch,
`orpo_loss_from_model` (two forwards through `get_logps`, then `orpo_loss`) is
the loss, and the step is the one `train_orpo` compiles: `nn.value_and_grad`
over the loss, `optimizer.update`, `mx.compile(inputs=state, outputs=state)`,
then `mx.eval` of the state. `grad_checkpoint=True` uses its
`trainer.sft_trainer.grad_checkpoint(model.layers[0])`, which patches the layer
CLASS for the whole process (run one configuration per process).

Its batch for one pair: chosen = prompt + chosen, rejected = prompt + rejected,
both zero-padded to the same length (the longer of the two rounded up to a
multiple of 8); each mask is 1 on that sequence's response tokens only. Two
separate full-length forwards, one per sequence.

Its loss in our notation (ENGINE.md "ORPO"), batch of one, preference_score 1:
  lw, lr = mean over the response tokens of log p (per-token log p clipped to
           [-1000, 0]; log-softmax in the model dtype via nn.losses.cross_entropy)
  log_odds = (lw - lr) - (log1mexp(lw) - log1mexp(lr)),
           log1mexp(x) = log(1 - e^min(x, -1e-7)) (expm1 / log1p branches)
  loss = -lw + beta * softplus(-log_odds)      (written -lw - beta*log_sigmoid)
So its NLL is the mean over the chosen RESPONSE tokens (our nll scope
"response"), its beta is our lambda, and the loss VALUES are comparable to ours
with nll scope "response" and lambda = beta. They differ only where our
log1mexp clamp (1 - e^x >= 1e-7) and its x <= -1e-7 clamp disagree (lw or lr
within ~1e-7 of 0) and by rounding. Its graph also carries an unused
logits.sum() metric per forward, which is part of its cost.

Not copied from `train_orpo`: `mx.set_wired_limit` (Metal only), the tqdm /
reporting loop, gradient accumulation (it is 1 here), and `seq_step_size`
chunking (off by default).

Rows come from `python -m bench.engine --method orpo --impl mlx-lm-lora ...`.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import mlx.core as mx
import mlx.nn as nn


def mlx_lm_lora_orpo_step(model, optimizer, prompt: list[int], chosen: list[int],
                          rejected: list[int], *, beta: float = 0.1,
                          grad_checkpoint: bool = False) -> Callable[[], mx.array]:
    """One preference pair as mlx-lm-lora's ORPO trainer batches it; returns
    do_step() that runs one of its training steps and returns the loss."""
    from mlx.nn.utils import average_gradients
    from mlx.utils import tree_map
    from mlx_lm_lora.trainer.orpo_trainer import iterate_orpo_batches, orpo_loss, orpo_loss_from_model
    from mlx_lm_lora.trainer.sft_trainer import grad_checkpoint as lora_grad_checkpoint

    # The record ORPODataset would hold: full token lists plus the prompt length.
    record = {"chosen": list(prompt) + list(chosen), "rejected": list(prompt) + list(rejected),
              "chosen_prompt_length": len(prompt), "rejected_prompt_length": len(prompt),
              "preference_score": 1.0}
    # max_seq_length = the longer sequence, so nothing is truncated.
    longest = max(len(record["chosen"]), len(record["rejected"]))
    batch = next(iterate_orpo_batches([record], batch_size=1, max_seq_length=longest))

    if grad_checkpoint:
        lora_grad_checkpoint(model.layers[0])

    def loss_wrapper(model, chosen, rejected, chosen_masks, rejected_masks, preference_scores):
        return orpo_loss_from_model(model, chosen, rejected, chosen_masks, rejected_masks,
                                    preference_scores, loss=orpo_loss, beta=beta)

    loss_value_and_grad = nn.value_and_grad(model, loss_wrapper)
    state = [model.state, optimizer.state, mx.random.state]

    # train_orpo's `step` with grad_accum_steps = 1 (prev_grad None, do_update True).
    @partial(mx.compile, inputs=state, outputs=state)
    def step(batch, prev_grad, do_update):
        chosen, rejected, chosen_masks, rejected_masks, preference_scores = batch
        (lvalue, reward, toks, metrics), grad = loss_value_and_grad(
            model, chosen, rejected, chosen_masks, rejected_masks,
            preference_scores=preference_scores)
        if prev_grad is not None:
            grad = tree_map(lambda x, y: x + y, grad, prev_grad)
        if do_update:
            grad = average_gradients(grad)
            optimizer.update(model, grad)
            grad = None
        return lvalue, reward, toks, metrics, grad

    model.train()

    def do_step():
        lvalue, reward, toks, metrics, _ = step(batch, None, True)
        mx.eval(state, lvalue, reward, toks, *metrics.values())
        return lvalue
    return do_step
