"""How a unit's collectives move data: full precision, or block-quantized on the wire."""

from __future__ import annotations

from dataclasses import dataclass

_GATHER = ("full", "int8", "fp8_e4m3")
_REDUCE = ("full", "bf16", "int8")


@dataclass(frozen=True)
class CommPolicy:
    """``param_all_gather``: ``"full"`` (the param dtype) or ``"int8"`` / ``"fp8_e4m3"``, block-wise with one fp32
    scale per ``block_size`` elements (master params stay in full precision; only the forward/backward copies are
    quantized). ``grad_reduce``: ``"full"`` (the reduce dtype), ``"bf16"`` (bf16 on the wire, fp32 in the sharded
    grad), or ``"int8"`` (block-quantized all-to-all plus a local fp32 sum, ZeRO++'s qgZ). ``block_size`` must be
    a power of two; the unit's layout keeps every rank's span a whole number of blocks, so quantizing per rank is
    bit-identical to quantizing the gathered buffer."""

    param_all_gather: str = "full"
    grad_reduce: str = "full"
    block_size: int = 128

    def __post_init__(self):
        if self.param_all_gather not in _GATHER:
            raise ValueError(f"CommPolicy.param_all_gather must be one of {_GATHER}, got {self.param_all_gather!r}")
        if self.grad_reduce not in _REDUCE:
            raise ValueError(f"CommPolicy.grad_reduce must be one of {_REDUCE}, got {self.grad_reduce!r}")
        b = self.block_size
        if not isinstance(b, int) or b < 1 or b & (b - 1):
            raise ValueError(f"CommPolicy.block_size must be a power of two, got {b!r}")

    @property
    def quantized(self) -> bool:
        return self.param_all_gather != "full" or self.grad_reduce == "int8"


def QuantizedAllGather(fmt: str = "int8", block_size: int = 128, grad_reduce: str = "full") -> CommPolicy:  # noqa: N802
    """``fully_shard(m, comm_policy=QuantizedAllGather("int8"))``: int8 (or ``"fp8_e4m3"``) params on the wire."""
    return CommPolicy(param_all_gather=fmt, grad_reduce=grad_reduce, block_size=block_size)
