"""Model builders for `netgain train`: random-initialised, built offline, seeded by the caller."""

from __future__ import annotations

import os

from torch import nn

BYTE_VOCAB = 256
HEAD_DIM = 32


def mlp_size(hidden_size: int) -> int:
    """byte_llama's MLP width: the SwiGLU 8/3 ratio, a multiple of 16 (the train job's memory check counts it too)."""
    return 16 * round(hidden_size * 8 / 3 / 16)


def byte_llama(hidden_size: int, num_layers: int, max_seq_len: int) -> nn.Module:
    """A small decoder-only Hugging Face Llama over bytes (no tokenizer download).

    The Llama family is used so the same models flow into the GAC compression half later.
    """
    check_byte_llama(hidden_size, num_layers)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = hidden_size // HEAD_DIM
    config = LlamaConfig(
        vocab_size=BYTE_VOCAB,
        hidden_size=hidden_size,
        intermediate_size=mlp_size(hidden_size),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=max_seq_len,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def check_byte_llama(hidden_size: int, num_layers: int) -> None:
    """The shapes byte_llama can build (heads of HEAD_DIM, at least two), named as `netgain train` flags."""
    if hidden_size % HEAD_DIM or hidden_size < 2 * HEAD_DIM:
        raise ValueError(f"--hidden-size must be a multiple of {HEAD_DIM} and at least "
                         f"{2 * HEAD_DIM}, got {hidden_size}")
    if num_layers < 1:
        raise ValueError(f"--layers must be at least 1, got {num_layers}")


def digits_mlp(hidden: int = 128) -> nn.Module:
    """The 64-128-10 MLP for the digits convergence check."""
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def parameter_count(model: nn.Module) -> int:
    """Distinct parameters (`parameters()` yields a tied embedding once)."""
    return sum(p.numel() for p in model.parameters())

