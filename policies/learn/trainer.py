"""A LoRA adapter of the edge model trained on a template's examples: CPU, seeded, bounded in steps and seconds.

Needs the `learn` extra (torch, transformers, peft). The base weights stay frozen; the adapter is
rank-`rank` matrices on every projection of every block (q, k, v, o, gate, up, down). The loss is
the cross-entropy of the answer's tokens only (the prompt is context), and the vocabulary
projection is computed on those positions alone (it is a fifth of the model's work per token).

Why LoRA rather than the whole model, measured on the bundled 135M model (one thread, 16 examples
of 64 tokens a step): 8.0-8.6 s a step with LoRA (rank 16, 4.9 M parameters) against 9.6-10.3 s for
every weight, which also holds 1.6 GB more of gradients and AdamW state and makes a 538 MB model
(float32) per template instead of a 19.6 MB adapter over the one shared base.

Deterministic for a seed on one machine with the same thread count: the adapter's initial values,
the order of the examples and the dropout-free steps all follow from it.
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from policies.learn.examples import Example

if TYPE_CHECKING:
    import torch
    from transformers import LlamaForCausalLM

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_IGNORE = -100


@dataclass(frozen=True, slots=True, kw_only=True)
class Hyper:
    """What shapes a training run; recorded in the manifest."""

    rank: int = 16
    alpha: int = 32
    learning_rate: float = 1e-3
    batch_size: int = 16
    epochs: float = 2.0
    max_steps: int | None = None
    warmup_share: float = 0.05
    weight_decay: float = 0.0
    max_tokens: int = 512  # an example longer than this (prompt and answer) is left out
    # a step's examples go through in slices of at most this many padded tokens, gradients summed: the
    # activations kept for the backward pass take about 2.2 MB per token (16 x 64 tokens: 2.2 GB)
    max_batch_tokens: int = 1024
    seed: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Trained:
    """The adapter's matrices per module (Hugging Face name -> (lora_A [rank, in], lora_B [out, rank])) and how
    the run went."""

    weights: dict[str, tuple[np.ndarray, np.ndarray]]
    steps: int
    planned_steps: int
    stopped_by: str  # "steps" | "budget"
    seconds: float
    tokens: int  # prompt and answer tokens seen
    losses: list[float]  # per step


def planned_steps(examples: int, hyper: Hyper) -> int:
    per_epoch = math.ceil(examples / hyper.batch_size)
    steps = max(1, math.ceil(per_epoch * hyper.epochs))
    return min(steps, hyper.max_steps) if hyper.max_steps is not None else steps


def _batches(examples: Sequence[Example], hyper: Hyper, steps: int) -> list[list[Example]]:
    """`steps` batches: the examples shuffled by the seed, epoch after epoch."""
    rng = random.Random(hyper.seed)
    out: list[list[Example]] = []
    order: list[Example] = []
    while len(out) < steps:
        if len(order) < hyper.batch_size:
            epoch = list(examples)
            rng.shuffle(epoch)
            order.extend(epoch)
        out.append(order[: hyper.batch_size])
        del order[: hyper.batch_size]
    return out


def _slices(batch: list[Example], max_tokens: int) -> list[list[Example]]:
    """The batch in consecutive slices whose padded size (examples x the longest) stays within `max_tokens`."""
    out: list[list[Example]] = [[]]
    for e in batch:
        width = max([e.tokens, *(x.tokens for x in out[-1])])
        if out[-1] and width * (len(out[-1]) + 1) > max_tokens:
            out.append([])
        out[-1].append(e)
    return out


def _tensors(batch: list[Example], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input ids and attention mask padded on the right, and the target of each position (-100: no loss)."""
    import torch

    width = max(e.tokens for e in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    targets = torch.full((len(batch), width), _IGNORE, dtype=torch.long)
    for row, e in enumerate(batch):
        seq = (*e.prompt, *e.answer)
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
        # position t predicts token t + 1: the last prompt position predicts the first answer token
        targets[row, len(e.prompt) - 1 : len(seq) - 1] = torch.tensor(e.answer)
    return ids, mask, targets


def train(model: LlamaForCausalLM, examples: Sequence[Example], hyper: Hyper, *, budget_s: float | None = None,
          pad: int = 0, progress: bool = True) -> Trained:  # fmt: skip
    """Train an adapter on `model` (left as it was: the adapter is taken out again) and return its weights."""
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    from tqdm import tqdm

    if not examples:
        raise ValueError("no examples to train on")
    torch.manual_seed(hyper.seed)
    config = LoraConfig(r=hyper.rank, lora_alpha=hyper.alpha, lora_dropout=0.0, bias="none",
                        target_modules=list(TARGET_MODULES))  # fmt: skip
    peft_model = get_peft_model(model, config)
    try:
        params = [p for p in peft_model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=hyper.learning_rate, weight_decay=hyper.weight_decay)
        steps = planned_steps(len(examples), hyper)
        warmup = max(1, int(steps * hyper.warmup_share))

        def schedule(step: int) -> float:  # linear warm-up, then linear decay to a tenth
            if step < warmup:
                return (step + 1) / warmup
            return 1.0 - 0.9 * (step - warmup) / max(1, steps - warmup)

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        llama: Any = peft_model.base_model.model
        peft_model.train()
        losses: list[float] = []
        tokens = 0
        stopped_by = "steps"
        start = time.perf_counter()
        bar = tqdm(total=steps, desc="training", unit="step", file=sys.stderr, disable=not progress)
        for batch in _batches(examples, hyper, steps):
            if budget_s is not None and losses and time.perf_counter() - start >= budget_s:
                stopped_by = "budget"
                break
            optimizer.zero_grad(set_to_none=True)
            answer_tokens = sum(len(e.answer) for e in batch)
            total = 0.0
            for part in _slices(batch, hyper.max_batch_tokens):
                ids, mask, targets = _tensors(part, pad)
                hidden = llama.model(input_ids=ids, attention_mask=mask).last_hidden_state
                keep = targets != _IGNORE
                logits = llama.lm_head(hidden[keep])
                # summed over the slice, divided by the whole batch's answer tokens: the mean of the batch
                loss: Any = F.cross_entropy(logits.float(), targets[keep], reduction="sum") / answer_tokens
                loss.backward()
                total += float(loss.detach())
                tokens += int(mask.sum())
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            losses.append(total)
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        bar.close()
        seconds = time.perf_counter() - start
        weights = lora_weights(peft_model)
    finally:
        peft_model.eval()
        peft_model.unload()  # the base model without the adapter's layers, as it came
    return Trained(weights=weights, steps=len(losses), planned_steps=steps, stopped_by=stopped_by, seconds=seconds,
                   tokens=tokens, losses=losses)  # fmt: skip


def lora_weights(peft_model: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(lora_A, lora_B) per adapted module, by its name in the base model (`model.layers.3.self_attn.q_proj`)."""
    from peft.tuners.lora import LoraLayer

    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, module in peft_model.base_model.model.named_modules():
        layer: Any = module
        if isinstance(module, LoraLayer) and "default" in layer.lora_A:
            a = layer.lora_A["default"].weight.detach().float().numpy().copy()
            b = layer.lora_B["default"].weight.detach().float().numpy().copy()
            out[name] = (a, b)
    return out
