"""A small Llama-architecture model with random weights, made locally (no model hub needed).

Grouped-query attention, several layers; a fixed seed makes the weights, and so every greedy output,
reproducible.
"""

from __future__ import annotations

import sys
from pathlib import Path


def make_tiny_llama(
    path: Path,
    seed: int = 0,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 1024,
    head_dim: int | None = None,
) -> Path:
    """`head_dim` defaults to hidden // heads; a larger one gives more KV bytes per token for the compute."""
    if (path / "config.json").exists():
        return path
    import torch  # noqa: PLC0415 (only when a model is made)
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim or hidden // heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # wider than the default init, so outputs depend visibly on the KV
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.08)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{seed}")
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(path)
    return path


if __name__ == "__main__":
    print(make_tiny_llama(Path(sys.argv[1]), seed=int(sys.argv[2]) if len(sys.argv) > 2 else 0))
