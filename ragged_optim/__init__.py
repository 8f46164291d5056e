"""ragged-optim: Muon, Shampoo and 8-bit AdamW on a RaggedShard FSDP layer."""

__version__ = "0.1.0"
