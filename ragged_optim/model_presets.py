"""The GPT's configuration and its named presets, without torch: the command line's ``--help`` lists the presets
and the training job's options check them before torch is imported. ``ragged_optim.models`` builds the model."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    tie_embeddings: bool = True
    bias: bool = True  # biases of the attention and MLP linears
    ln_bias: bool = True  # biases of the LayerNorms
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")


PRESETS: dict[str, GPTConfig] = {
    # ~0.12M params: unit tests, a few steps in a second.
    "tiny": GPTConfig(seq_len=64, d_model=64, n_layers=2, n_heads=4),
    # ~1.2M params: the default of `ragged-optim train` on CPU.
    "small": GPTConfig(seq_len=128, d_model=128, n_layers=6, n_heads=4),
    # ~20M params: benchmarks.
    "bench20m": GPTConfig(seq_len=256, d_model=384, n_layers=11, n_heads=6),
    # ~54M params: the memory benchmark (the paper's claim is about models too big to keep whole).
    "bench50m": GPTConfig(seq_len=128, d_model=640, n_layers=11, n_heads=10),
}


def get_config(preset: str, **overrides) -> GPTConfig:
    """The named preset, with any field replaced by a keyword argument."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[preset], **overrides)
