"""A step's decoder layers as one C call: the step program.

Between its kernels a decode step runs Python for every layer, and slowly: the weights the step streams
through the caches evict the interpreter's code and data. `StepProgram` records the kernel calls of every
layer's forward once (the quantized or bf16 GEMMs, the fused norms (of q and k too; Gemma's four a layer), rope
(each layer's own), the bias adds, GeGLU, the KV write, the CPU attention kernel with each layer's window, a
mixture's router, one-call experts and shared expert, Granite's scales), as records of int64 words over buffers
that stay put, and a step runs them all in one call of `flock_run_program` (csrc/fused_ops.c). The kernels,
their order and their inputs are those of the modules' forward, so the results are the same bits.

`unavailable(model)` says why a model cannot run so; a step runs so when the backend planned it for the CPU
kernel and every row of it goes on to the last layer (decode steps), up to MAX_ROWS rows.
"""

import ctypes
import weakref

import numpy as np
import torch

from flock.attention.cpu import CpuCascadeBackend, CpuMetadata, _Args, kernel_library
from flock.model import fused_ops, gemm, quant

WIDTH = 16  # int64 words of a record: the op's address and up to 15 arguments
MAX_ROWS = 256  # above this many rows the Python between the kernels is a small share of a step
ROWS = object()  # an argument filled with the step's rows at each run


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _f32_word(value: float) -> int:
    return int(np.array(value, dtype=np.float32).view(np.int32))


def unavailable(model) -> str | None:
    """Why the model's layers cannot run as a step program (None: they can)."""
    if not all(isinstance(b := layer.self_attn.backend, CpuCascadeBackend) and b.uses_kernel(torch.device("cpu"))
               for layer in model.layers):
        return "attention is not on the CPU kernel"
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if _mixture(mlp) and mlp.grouped is None:
            return "a mixture's experts are not in one C call (flock.model.moe)"
        if any(p.qweight is None and p.pairs is None for p in (attn.qkv_proj, attn.o_proj, *_mlp_projections(mlp))):
            return "a projection is neither quantized nor packed for Flock's bf16 GEMM"
        if any(p.bias is not None for p in _mlp_projections(mlp)):
            return "an MLP has a bias"
        if not all(m.fused for m in layer.modules() if hasattr(m, "fused")):
            return "the fused ops are off"
    return None


def _mixture(mlp) -> bool:
    return hasattr(mlp, "experts")  # a SparseMoE (flock.model.llama imports this module)


def _dense_mlps(layers) -> list:
    """The layers' MLPs that run as a gate_up and a down GEMM: dense ones and the mixtures' shared experts."""
    return [m for layer in layers for m in ([layer.mlp.shared_expert] if _mixture(layer.mlp) else [layer.mlp])
            if m is not None]


def _mlp_projections(mlp) -> tuple:
    if not _mixture(mlp):
        return mlp.gate_up_proj, mlp.down_proj
    if mlp.shared_expert is None:
        return (mlp.gate,)
    return mlp.gate, mlp.shared_expert_gate, mlp.shared_expert.gate_up_proj, mlp.shared_expert.down_proj


class StepProgram:
    def __init__(self, model):
        self.model = weakref.proxy(model)  # the model holds the program: no cycle keeps its caches alive
        self.rows = 0  # rows the buffers hold
        self.key = None  # what the records were built for
        self.steps: dict[int | None, _Args] = {}  # the attention kernel's arguments of each window, set each run
        self.op_seconds: dict[str, float] | None = None  # set to {} to sum each kind of op's time over runs

    def takes(self, x: torch.Tensor, meta) -> bool:
        windows = {layer.self_attn.window for layer in self.model.layers}
        return all(isinstance(meta.for_window(w), CpuMetadata) for w in windows) and 0 < len(x) <= MAX_ROWS

    def run(self, x: torch.Tensor, positions: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's (output, residual) for the embeddings x, as the layers' forward gives them: views of
        buffers that the next step overwrites."""
        m = len(x)
        self._build(m, x.dtype)
        self.residual[:m].copy_(x)  # the first layer's norm reads the embeddings there
        self.positions[:m].copy_(positions)
        self.slots[:m].copy_(meta.slot_mapping)
        self._set_step(m, meta)
        self.records[self.row_words] = m
        failed = self.run_program(self.records.ctypes.data, len(self.records), WIDTH) if self.op_seconds is None \
            else self._run_timed()
        if failed:
            raise RuntimeError(f"step program: the {self.names[failed - 1]} of {m} rows failed")
        return self.x[:m], self.residual[:m]

    def _run_timed(self) -> int:
        ns = np.zeros(len(self.records), dtype=np.int64)
        failed = self.run_timed(self.records.ctypes.data, len(self.records), WIDTH, ns.ctypes.data)
        for name, t in zip(self.names, ns.tolist()):
            kind = name.split(" ", 2)[2]  # "layer 3 qkv GEMM" -> "qkv GEMM"
            self.op_seconds[kind] = self.op_seconds.get(kind, 0.0) + t / 1e9
        return failed

    def _set_step(self, m: int, meta) -> None:
        """The attention kernel's arguments of each window for this step (each layer's op takes its own caches)."""
        for window, step in self.steps.items():
            attn = next(layer.self_attn for layer in self.model.layers if layer.self_attn.window == window)
            q = self.qkv[:m, : attn.q_size].view(m, attn.num_heads, attn.head_dim)
            out = self.attention[:m].view(m, attn.num_heads, attn.head_dim)
            args = attn.backend.kernel_args(q, attn.k_cache, attn.v_cache, out, meta.for_window(window))
            ctypes.memmove(ctypes.addressof(step), ctypes.addressof(args), ctypes.sizeof(_Args))

    def _build(self, m: int, dtype: torch.dtype) -> None:
        """Buffers of at least m rows and the records over them, unless those built last still serve."""
        attn = self.model.layers[0].self_attn
        key = (dtype, torch.get_num_threads(), attn.k_cache.data_ptr(), len(self.model.layers))
        if key == self.key and m <= self.rows:
            return
        self.rows = max(m, min(2 * self.rows, MAX_ROWS), 16)
        config = self.model.config
        q, kv = attn.q_size, attn.kv_size
        mlps = _dense_mlps(self.model.layers)
        mid = max((m.down_proj.in_features for m in mlps), default=0)
        shared = any(_mixture(layer.mlp) and layer.mlp.shared_expert is not None for layer in self.model.layers)
        widths = dict(x=config.hidden_size, residual=config.hidden_size, qkv=q + 2 * kv, attention=q, mid=mid,
                      logits=config.num_experts, shared=config.hidden_size * shared, shared_gate=int(shared),
                      gate_up=2 * mid * any(not m.gate_up_proj.silu_and_mul for m in mlps))  # GeGLU an op of its own
        for name, width in widths.items():
            setattr(self, name, torch.empty((self.rows, width), dtype=dtype))
        self.positions = torch.zeros(self.rows, dtype=torch.int64)
        self.slots = torch.zeros(self.rows, dtype=torch.int64)
        self._records(dtype, key[1])
        self.key = key

    def _records(self, dtype: torch.dtype, threads: int) -> None:
        ops = fused_ops.KERNEL.load(fused_ops.isa())
        self.run_program, self.run_timed = ops.flock_run_program, ops.flock_run_program_timed
        suffix, bf16, size = fused_ops.SUFFIX[dtype], int(dtype == torch.bfloat16), dtype.itemsize
        attention = kernel_library(self.model.layers[0].self_attn.backend.isa)
        records, self.names = [], []

        def op(name: str, fn, *args) -> None:
            records.append([_address(fn), *(a if isinstance(a, int) or a is ROWS else a.data_ptr() for a in args)])
            self.names.append(name)

        def linear(name: str, layer, x: torch.Tensor, out: torch.Tensor, glu: bool = False) -> None:
            if layer.pairs is not None:
                mode = gemm.OUT_GLU if glu else gemm.OUT_BF16
                op(f"{name} GEMM", gemm._lib(None).flock_gemm_op, x, x.stride(0), layer.pairs, out, out.stride(0),
                   ROWS, out.shape[1], x.shape[1], mode, threads)
            else:
                w = layer.qweight
                for qtype, x8, blocks, row_bytes, cols, col in w.calls[glu]:
                    op(f"{name} GEMM", quant._lib(None).flock_qgemm_op, qtype, int(x8), blocks, row_bytes, cols, w.k,
                       x, x.stride(0), bf16, ROWS, out.data_ptr() + col * size, out.stride(0), bf16, int(glu), threads)
            if layer.bias is not None:
                op(f"{name} bias", getattr(ops, f"flock_add_bias_op_{suffix}"), out, out.stride(0), layer.bias, ROWS,
                   out.shape[1])

        def norm(name: str, module, first: bool) -> None:
            """The residual add and norm before a block (the first layer's: the norm of the embeddings)."""
            fn = getattr(ops, f"flock_{'rms_norm' if first else 'add_rms_norm'}_op_{suffix}")
            x, r, eps = self.x, self.residual, _f32_word(module.eps)
            args = (r, r.stride(0), x, x.stride(0)) if first else (x, x.stride(0), r, r.stride(0))
            op(name, fn, *args, module.kernel_weight(), ROWS, x.shape[1], eps, threads)

        def output_norm(name: str, module) -> None:
            """A block's output normalized in place (Gemma 2's and 3's sandwich norms)."""
            x = self.x
            op(name, getattr(ops, f"flock_rms_norm_op_{suffix}"), x, x.stride(0), x, x.stride(0),
               module.kernel_weight(), ROWS, x.shape[1], _f32_word(module.eps), threads)

        def mlp_records(name: str, mlp, out: torch.Tensor) -> None:
            if _mixture(mlp):
                if mlp.shared_expert is not None:  # from the input the experts' call then overwrites
                    mlp_records(f"{name} shared expert", mlp.shared_expert, self.shared)
                    linear(f"{name} shared expert gate", mlp.shared_expert_gate, self.x, self.shared_gate)
                linear(f"{name} router", mlp.gate, self.x, self.logits)
                op(f"{name} experts", mlp.grouped.function(op=True), ctypes.addressof(mlp.grouped.layer), self.x,
                   self.x.stride(0), self.logits, self.logits.stride(0), bf16, ROWS, out, out.stride(0), threads)
                if mlp.shared_expert is not None:
                    op(f"{name} shared expert add", getattr(ops, f"flock_add_gated_op_{suffix}"), out, out.stride(0),
                       self.shared, self.shared.stride(0), self.shared_gate, self.shared_gate.stride(0), ROWS,
                       out.shape[1], threads)
                return
            mid = self.mid[:, : mlp.down_proj.in_features]
            if mlp.gate_up_proj.silu_and_mul:
                linear(f"{name} gate_up", mlp.gate_up_proj, self.x, mid, glu=True)
            else:  # GeGLU (Gemma's), or gate and up of two quant types
                act = "silu_and_mul" if mlp.silu else "gelu_and_mul"
                gate_up = self.gate_up[:, : 2 * mid.shape[1]]
                linear(f"{name} gate_up", mlp.gate_up_proj, self.x, gate_up)
                op(f"{name} {act.replace('_', ' ')}", getattr(ops, f"flock_{act}_op_{suffix}"), gate_up,
                   gate_up.stride(0), mid, mid.stride(0), ROWS, mid.shape[1], threads)
            linear(f"{name} down", mlp.down_proj, mid, out)

        def scaled(i: int, layer, what: str) -> None:
            """Granite's residual_multiplier on a block's output."""
            if layer.residual_multiplier != 1.0:
                op(f"layer {i} {what} scale", getattr(ops, f"flock_scale_op_{suffix}"), self.x, self.x.stride(0),
                   ROWS, self.x.shape[1], _f32_word(layer.residual_multiplier), threads)

        qkv, out = self.qkv, self.attention
        self.steps = {layer.self_attn.window: _Args() for layer in self.model.layers}
        for i, layer in enumerate(self.model.layers):
            attn, rope = layer.self_attn, self.model.rope_of(layer)
            norm(f"layer {i} input norm", layer.input_layernorm, first=i == 0)
            linear(f"layer {i} qkv", attn.qkv_proj, self.x, qkv)
            if attn.qk_norm:
                k_at = qkv.data_ptr() + attn.q_size * size
                for name, at, module, heads in (("q", qkv, attn.q_norm, attn.num_heads),
                                                ("k", k_at, attn.k_norm, attn.num_kv_heads)):
                    op(f"layer {i} {name} norm", getattr(ops, f"flock_head_rms_norm_op_{suffix}"), at, qkv.stride(0),
                       module.kernel_weight(), ROWS, heads, attn.head_dim, _f32_word(module.eps), threads)
            if attn.rotates:  # SmolLM3's NoPE layers do not
                op(f"layer {i} rope", getattr(ops, f"flock_rope_op_{suffix}"), qkv, qkv.stride(0), self.positions,
                   rope.cos, rope.sin, rope.cos.stride(0), ROWS, attn.num_heads + attn.num_kv_heads, attn.head_dim,
                   rope.cos.shape[1], threads)
            self._attention(i, attn, attention, op)
            linear(f"layer {i} o", attn.o_proj, out, self.x)
            scaled(i, layer, "attention")
            if layer.sandwich:
                output_norm(f"layer {i} post-attention norm", layer.post_attention_layernorm)
                norm(f"layer {i} pre-feedforward norm", layer.pre_feedforward_layernorm, first=False)
            else:
                norm(f"layer {i} post-attention norm", layer.post_attention_layernorm, first=False)
            mlp_records(f"layer {i}", layer.mlp, self.x)
            scaled(i, layer, "MLP")
            if layer.sandwich:
                output_norm(f"layer {i} post-feedforward norm", layer.post_feedforward_layernorm)
        self.records = np.array([r + [0] * (WIDTH - len(r)) for r in records], dtype=object)
        self.row_words = np.nonzero(self.records == ROWS)
        self.records[self.row_words] = 0
        self.records = self.records.astype(np.int64)

    def _attention(self, i: int, attn, lib, op) -> None:
        """The layer's K and V into its caches, then its attention into self.attention."""
        k_cache, v_cache, qkv, size = attn.k_cache, attn.v_cache, self.qkv, self.qkv.element_size()
        if not (k_cache.is_contiguous() and k_cache.stride() == v_cache.stride() and k_cache.dtype == qkv.dtype
                and k_cache.shape[2:] == (attn.num_kv_heads, attn.head_dim)):
            raise ValueError(f"layer {i}: the step program needs contiguous K and V caches of [blocks, block size, "
                             f"KV heads, head dim], got {tuple(k_cache.shape)}")
        row = attn.kv_size * size
        k_at, v_at = qkv.data_ptr() + attn.q_size * size, qkv.data_ptr() + (attn.q_size + attn.kv_size) * size
        op(f"layer {i} KV write", lib.flock_cpu_write_kv_op, k_at, qkv.stride(0) * size, v_at, qkv.stride(0) * size,
           k_cache, v_cache, row, self.slots, ROWS, row)
        op(f"layer {i} attention", lib.flock_cpu_cascade_op, ctypes.addressof(self.steps[attn.window]), k_cache,
           v_cache)
