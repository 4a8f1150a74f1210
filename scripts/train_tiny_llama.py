"""Train the builtin ``kvharbor/tiny-llama`` weights (``kvharbor/data/tiny-llama.safetensors``).

A random-weight model has near-tied logits everywhere, so any perturbation of its KV cache
(int8/fp8 quantization, a different kernel's rounding) flips greedy tokens the way no trained
model would. tiny-llama is therefore trained briefly, on CPU, on text that every CPython
install carries (the language reference topics in ``pydoc_data``), so its predictions have
the confident margins of a real model and its output reads like English-ish Python docs.

    python scripts/train_tiny_llama.py            # about 15 minutes on 2 CPU cores

The run is seeded; the corpus depends on the Python version that runs it, so the checked-in
file, not this script, is what the tests pin. EOS, BOS and PAD never occur in the corpus,
so the model never learns to stop early and ``max_tokens`` decides the length as before.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import pydoc_data.topics
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from kvharbor.engine.models import BUILTIN_MODELS, TRAINED_WEIGHTS

MODEL = "kvharbor/tiny-llama"


def corpus_ids() -> torch.Tensor:
    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", type=Path, default=TRAINED_WEIGHTS[MODEL])
    args = parser.parse_args()

    torch.manual_seed(0)
    data = corpus_ids()
    model = AutoModelForCausalLM.from_config(BUILTIN_MODELS[MODEL], dtype=torch.float32,
                                             attn_implementation="sdpa")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01,
                            betas=(0.9, 0.95))
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    start = time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch,))
        batch = torch.stack([data[s:s + args.seq_len] for s in starts])
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}  "
                  f"{time.perf_counter() - start:6.0f} s", flush=True)

    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(args.out), metadata={"corpus": "pydoc_data.topics",
                                              "steps": str(args.steps),
                                              "final_loss": f"{loss.item():.4f}"})
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
