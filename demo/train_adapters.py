"""Train the demo's LoRA adapters on the real model (peft + transformers, CPU, a few minutes), cached.

Each adapter learns one answer style from `demo.adapter_data` (French, pirate, JSON, SQL, and Hermes
tool calls for `tool_choice: "auto"`), with its own rank and target modules, so the demo and the
benchmarks serve adapters of different shapes:

  french   rank 16, all seven projections
  pirate   rank 8,  q_proj + v_proj (PEFT's default for Llama)
  json     rank 32, q/k/v/o_proj
  sql      rank 12, gate/up/down_proj
  tools    rank 24, all seven projections

The loss is on the answer tokens only. The prompt is what the worker itself renders for the same chat
request (its tokenizer and chat template, the request's `tools` passed as the template's variable), so
an adapter meets at serving time exactly the tokens it was trained on. The adapters go
to `$LORAFLEET_CACHE/adapters/smollm2-<digest of the model's files>-<hash of this file and the data
module>/<style>/`, so a machine trains them once, and again only when the model's weights, the recipe
or the data change (not when only the model's preparation check does).

    python -m demo.train_adapters          # train what is missing, print the directory
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet_worker.tokenizer import Tokenizer

from demo import adapter_data
from demo.real_model import READY, cache_root, log, prepare_model, ready_content_digest


@dataclass(frozen=True)
class Recipe:
    rank: int
    targets: tuple[str, ...]
    alpha: int
    steps: int = 40
    batch: int = 8
    lr: float = 2e-3


ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RECIPES: dict[str, Recipe] = {
    "french": Recipe(rank=16, alpha=32, targets=ALL_PROJECTIONS),
    "pirate": Recipe(rank=8, alpha=16, targets=("q_proj", "v_proj")),
    "json": Recipe(rank=32, alpha=32, targets=("q_proj", "k_proj", "v_proj", "o_proj")),
    "sql": Recipe(rank=12, alpha=24, targets=("gate_proj", "up_proj", "down_proj")),
    "tools": Recipe(rank=24, alpha=48, targets=ALL_PROJECTIONS, steps=60),
}


def recipe_key(recipes: Mapping[str, Recipe] = RECIPES) -> str:
    """Changes whenever this file, the data generator or the recipes change (so the cache is retrained)."""
    digest = hashlib.sha256(repr(sorted(recipes.items())).encode())
    for module in (__file__, adapter_data.__file__):
        digest.update(Path(module).read_bytes())
    return digest.hexdigest()[:12]


def adapters_dir(recipes: Mapping[str, Recipe] = RECIPES) -> Path:
    """Where the adapters for the prepared model and these recipes live (prepares the model if needed)."""
    model = ready_content_digest(prepare_model())[:12]
    return cache_root() / "adapters" / f"smollm2-{model}-{recipe_key(recipes)}"


def trained_adapters(recipes: Mapping[str, Recipe] = RECIPES) -> dict[str, Path]:
    """style -> adapter directory for every adapter (`adapter_data.ADAPTERS`), training the missing ones
    (minutes each on a CPU)."""
    base = prepare_model()
    root = adapters_dir(recipes)
    missing = [s for s in adapter_data.ADAPTERS if not (root / s / READY).is_file()]
    if missing:
        log(f"training LoRA adapters {', '.join(missing)} on {base.name} (once per machine) into {root}")
        for style in missing:
            out = root / style
            tmp = out.with_name(style + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            t0 = time.monotonic()
            losses = train_adapter(base, style, recipes[style], tmp)
            (tmp / READY).write_text(json.dumps({"losses": losses}) + "\n")
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
            log(f"{style}: loss {losses[0]:.2f} -> {losses[-1]:.2f} in {time.monotonic() - t0:.0f} s")
    return {s: root / s for s in adapter_data.ADAPTERS}


def encode(tokenizer: Tokenizer, example: adapter_data.Example) -> tuple[list[int], list[int]]:
    """Token ids of the chat prompt (as the worker renders the request) + answer + end of turn, and labels
    (-100 on the prompt)."""
    prompt_ids = tokenizer.encode_chat(example.messages(), tools=example.tools or None)
    answer_ids = tokenizer.encode(example.answer + (tokenizer.eos_token or ""), add_special_tokens=False)
    return prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids


def batches(tokenizer: Tokenizer, examples: list[adapter_data.Example], size: int, steps: int) -> list[dict[str, Any]]:
    """`steps` right-padded batches of `size`, cycling over the (already shuffled) examples."""
    import torch

    encoded = [encode(tokenizer, e) for e in examples]
    out = []
    for step in range(steps):
        rows = [encoded[(step * size + i) % len(encoded)] for i in range(size)]
        width = max(len(ids) for ids, _ in rows)
        pad = 0  # masked out of attention and loss
        out.append(
            {
                "input_ids": torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows]),
                "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows]),
                "labels": torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in rows]),
            }
        )
    return out


def answer_loss(causal_lm: Any, batch: dict[str, Any]) -> Any:
    """Cross-entropy on the answer tokens, projecting only their positions to the 49k-token vocabulary."""
    import torch.nn.functional as F

    hidden = causal_lm.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    targets = batch["labels"][:, 1:]
    keep = targets != -100
    logits = causal_lm.lm_head(hidden[:, :-1][keep])
    return F.cross_entropy(logits.float(), targets[keep])


def train_adapter(base: Path, style: str, recipe: Recipe, out: Path, seed: int = 0) -> list[float]:
    """Train one adapter on `base` and save it (PEFT format) to `out`; returns the loss of every step."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    tokenizer = Tokenizer.from_dir(base)
    auto: Any = AutoModelForCausalLM
    model = auto.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=recipe.rank, lora_alpha=recipe.alpha, target_modules=list(recipe.targets), lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )  # fmt: skip
    peft_model: Any = get_peft_model(model, config)
    peft_model.train()
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    warmup = max(1, recipe.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.1, 1 - s / recipe.steps)
    )
    causal_lm = peft_model.get_base_model()
    losses = []
    for batch in batches(tokenizer, adapter_data.examples(style, seed), recipe.batch, recipe.steps):
        loss = answer_loss(causal_lm, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))
        if len(losses) % 10 == 0:
            log(f"{style}: step {len(losses)}/{recipe.steps}, loss {losses[-1]:.3f}")
    peft_model.save_pretrained(out)
    return losses


def main() -> int:
    root = trained_adapters()
    print(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
