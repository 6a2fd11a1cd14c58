"""A mixture layer's experts in one C call: the router's top k of each token, every expert's run of tokens
through its SiLU-and-mul MLP, and the weighted sum, on the int8 kernels for quantized experts
(`csrc/quant_moe.h`: one parallel region for the whole layer) or on Flock's bf16 GEMM for packed ones
(`csrc/gemm_moe.h`). `SparseMoE` runs its experts so where their weights allow (`quantized`, `packed`), and the
step program records the same call; the routing and sum are `csrc/moe_route.h`'s, as transformers routes and sums.
"""

import ctypes
from dataclasses import dataclass

import torch

from flock.model import gemm, quant
from flock.model.quant import QuantWeight

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
ROUTER = [(name, _i64) for name in ("experts", "top_k", "renormalize", "float32_weights")]  # moe_route.h's MoeRouter


class QuantLayer(ctypes.Structure):  # quant_moe.h's MoeLayer
    _fields_ = [(name, _i64) for name in ("gate_up_type", "gate_up_x8", "gate_up_row_bytes", "down_type", "down_x8",
                                          "down_row_bytes")] + [("gate_up", _ptr), ("down", _ptr), ("hidden", _i64),
                                                                ("inter", _i64)] + ROUTER


class PackedLayer(ctypes.Structure):  # gemm_moe.h's GemmMoeLayer
    _fields_ = [("gate_up", _ptr), ("down", _ptr), ("hidden", _i64), ("inter", _i64)] + ROUTER


@dataclass
class Router:
    top_k: int
    renormalize: bool
    float32_weights: bool  # Mixtral's; Qwen's are rounded to the model's dtype


@dataclass
class Experts:
    """A layer's experts as one call takes them (made by `quantized` or `packed`)."""

    layer: ctypes.Structure
    addresses: torch.Tensor  # [2, experts] int64: each expert's gate_up and down weights (layer points into it)
    weights: list  # the weights, kept alive here
    kind: str  # "quantized" or "packed"

    def function(self, path: str | None = None, op: bool = False):
        """The C function that runs the layer (`op`: as a step-program op) on the kernels of `path`."""
        if self.kind == "quantized":
            lib = quant._lib(path)
            return lib.flock_qmoe_op if op else lib.flock_qmoe
        lib = gemm._lib(path)
        return lib.flock_gemm_moe_op if op else lib.flock_gemm_moe

    def __call__(self, x: torch.Tensor, logits: torch.Tensor, path: str | None = None) -> torch.Tensor:
        """The layer's output for tokens x [m, hidden] given their router logits [m, experts] (x's dtype: float32
        or bf16 for quantized experts, bf16 for packed ones)."""
        dtypes = (torch.float32, torch.bfloat16) if self.kind == "quantized" else (torch.bfloat16,)
        if x.dtype not in dtypes or logits.dtype != x.dtype:
            raise ValueError(f"{self.kind} experts take tokens of {', '.join(map(str, dtypes))} and logits of their "
                             f"dtype, not {x.dtype} and {logits.dtype}")
        x, logits = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, logits))
        out = torch.empty_like(x)
        if len(x):
            code = self.function(path)(ctypes.addressof(self.layer), x.data_ptr(), x.stride(0), logits.data_ptr(),
                                       logits.stride(0), int(x.dtype == torch.bfloat16), len(x), out.data_ptr(),
                                       out.stride(0), torch.get_num_threads())
            if code == -1:
                raise MemoryError(f"no memory for the experts' activations of {len(x)} tokens")
            if code:
                raise RuntimeError(f"the {self.kind} experts' GEMM failed ({code})")
        return out


def _addresses(gate_ups: list[torch.Tensor], downs: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([[t.data_ptr() for t in gate_ups], [t.data_ptr() for t in downs]], dtype=torch.int64)


def quantized(gate_ups: list[QuantWeight], downs: list[QuantWeight], router: Router) -> Experts | None:
    """Quantized experts ([gate | up] and down weights, in expert order), or None where one call cannot take them:
    a fused weight of two quant types, experts of different types or layouts, or inputs in act-order."""
    if not all(quant.fuses_glu(w) and len(d.parts) == 1 and w.order is None and d.order is None
               for w, d in zip(gate_ups, downs)):
        return None
    gu, dn = [w.parts[0] for w in gate_ups], [w.parts[0] for w in downs]
    if any(len({(p.qtype, p.interleaved, p.blocks.shape) for p in parts}) > 1 for parts in (gu, dn)):
        return None
    addresses = _addresses([p.blocks for p in gu], [p.blocks for p in dn])
    layer = QuantLayer(gu[0].qtype, gu[0].interleaved, gu[0].blocks.shape[1], dn[0].qtype, dn[0].interleaved,
                       dn[0].blocks.shape[1], addresses[0].data_ptr(), addresses[1].data_ptr(), gu[0].k, dn[0].k,
                       len(gu), router.top_k, router.renormalize, router.float32_weights)
    return Experts(layer, addresses, [*gate_ups, *downs], "quantized")


def packed(gate_ups: list[torch.Tensor], downs: list[torch.Tensor], hidden: int, inter: int,
           router: Router) -> Experts:
    """Experts whose [gate | up] weights are packed for the bf16 GEMM with glu and their down weights without
    (gemm.pack), in expert order."""
    addresses = _addresses(gate_ups, downs)
    layer = PackedLayer(addresses[0].data_ptr(), addresses[1].data_ptr(), hidden, inter, len(gate_ups),
                        router.top_k, router.renormalize, router.float32_weights)
    return Experts(layer, addresses, [*gate_ups, *downs], "packed")
