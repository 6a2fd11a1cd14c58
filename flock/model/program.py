"""A step's decoder layers as one C call: the step program.

Between its kernels a decode step runs Python for every layer, and slowly: the weights the step streams
through the caches evict the interpreter's code and data. `StepProgram` records the embedding lookup and the kernel
calls of every layer's forward once (the quantized or bf16 GEMMs, the fused norms (of q and k too; Gemma's four a
layer), rope (each layer's own), the bias adds, GeGLU, the KV write, the CPU attention kernel with each layer's
window, a mixture's router, one-call experts and shared expert, Granite's scales), as records of int64 words over
buffers that stay put, and a step runs them all in one call of `flock_run_program` (csrc/fused_ops.c), the step's
row count filled into the words that take it. The kernels, their order and their inputs are those of the modules'
forward, so the results are the same bits.

`unavailable(model)` says why a model cannot run so; a step runs so when the backend planned it for the CPU
kernel, up to MAX_ROWS rows. A step that finishes only some of its rows (a prefill's, whose last layer runs on
the rows it samples) runs every layer but the last so (`run_but_last`), the model the last.
"""

import ctypes
import weakref

import numpy as np
import torch

from flock.attention.cpu import KV_FORMATS, CpuCascadeBackend, CpuMetadata, _Args, kernel_library
from flock.kv import fp8
from flock.model import fused_ops, gemm, quant

WIDTH = 16  # int64 words of a record: the op's address and up to 15 arguments (fused_ops.c's PROGRAM_WIDTH)
MAX_ROWS = 4096  # steps of more rows run the layers' Python (the buffers grow to the largest step's rows)
MAX_PROGRAMS = 8  # records kept for this many sets of LoRA adapters
ROWS = -(2**63)  # an argument word that flock_run_program replaces with the step's rows


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
        projections = (attn.qkv_proj, attn.o_proj, *_mlp_projections(mlp))
        if any(p.qweight is None and p.pairs is None for p in projections):
            return "a projection is neither quantized nor packed for Flock's bf16 GEMM"
        if any(p.qweight is not None and p.qweight.order is not None for p in projections):
            return "a projection gathers its inputs in act-order"
        if any(p.bias is not None for p in _mlp_projections(mlp)):
            return "an MLP has a bias"
        if not all(m.fused for m in layer.modules() if hasattr(m, "fused")):
            return "the fused ops are off"
    if not model.norm.fused:
        return "the fused ops are off"
    return None


def _mixture(mlp) -> bool:
    return hasattr(mlp, "experts")  # a SparseMoE (flock.model.llama imports this module)


def _dense_mlps(layers) -> list:
    """The layers' MLPs that run as a gate_up and a down GEMM: dense ones and the mixtures' shared experts."""
    return [m for layer in layers for m in ([layer.mlp.shared_expert] if _mixture(layer.mlp) else [layer.mlp])
            if m is not None]


def _projections(layer) -> tuple:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, *_mlp_projections(layer.mlp)


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
        self.key = None  # what the buffers were made for
        self.programs: dict[tuple[int, ...], tuple] = {}  # the step's LoRA adapters -> _records()
        self.steps: dict[int | None, _Args] = {}  # the attention kernel's arguments of each window, its plan's each run
        self.outputs: dict[int, torch.Tensor] = {}  # the final hidden states' view of each row count
        self.op_seconds: dict[str, float] | None = None  # set to {} to sum each kind of op's time over runs
        self.windows: dict[int | None, object] = {}  # the layers' sliding windows -> the first such attention module
        for layer in model.layers:
            self.windows.setdefault(layer.self_attn.window, layer.self_attn)
        self.first_attention = model.layers[0].self_attn  # whose cache's address says the caches were kept
        self.embeds = False  # whether an op of the program looks the embeddings up (see _buffers)

    def takes(self, input_ids: torch.Tensor, meta) -> bool:
        return (all(isinstance(meta.for_window(w), CpuMetadata) for w in self.windows)
                and 0 < len(input_ids) <= MAX_ROWS
                and (not self._lora_ids() or self._lora_in_c()))

    def _lora_ids(self) -> tuple[int, ...]:
        """The LoRA adapters of the step (flock.lora), whose updates the records then add."""
        step = self.model.lora_step
        return step.ids if step is not None else ()

    def _lora_in_c(self) -> bool:
        return all(p.lora is None or p.lora.packed for layer in self.model.layers for p in _projections(layer))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The final hidden states of the tokens input_ids (the last layer's output and residual added, and the
        model's norm), as the model's forward gives them: a view of a buffer that the next step overwrites."""
        m = self._run(input_ids, positions, meta, whole=True)
        out = self.outputs.get(m)
        if out is None:
            out = self.outputs[m] = self.x[:m]
        return out

    def run_but_last(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     meta) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer but the last on the tokens input_ids: (its MLP output, the residual stream before it), as
        the layers give them, views of buffers that the next step overwrites."""
        m = self._run(input_ids, positions, meta, whole=False)
        return self.x[:m], self.residual[:m]

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, whole: bool) -> int:
        """The program, or its records before the last layer's; the step's row count."""
        m = len(input_ids)
        self._build(m, self.model.embed_tokens.weight.dtype)
        # the step's int64 inputs copied by numpy: PyTorch's first call after the weights' stream costs ~60 us
        self.inputs[0, :m], self.inputs[1, :m], self.inputs[2, :m] = (
            input_ids.numpy(), positions.numpy(), meta.slot_mapping.numpy())
        if not self.embeds:  # the first layer's norm reads the embeddings in residual
            self.residual[:m].copy_(self.model.embed(input_ids))
        if self._lora_ids():
            rows = self.model.lora_step.all_rows
            self.row_ids[:m].fill_(rows) if isinstance(rows, int) else self.row_ids[:m].copy_(rows)
        self._set_step(meta)
        n = len(self.records) if whole else self.last_layer
        failed = self.run_program(self.records.ctypes.data, n, m) if self.op_seconds is None \
            else self._run_timed(n, m)
        if failed:
            raise RuntimeError(f"step program: the {self.names[failed - 1]} of {m} rows failed")
        return m

    def _run_timed(self, n: int, m: int) -> int:
        ns = np.zeros(n, dtype=np.int64)
        failed = self.run_timed(self.records.ctypes.data, n, m, ns.ctypes.data)
        for name, t in zip(self.names, ns.tolist()):
            kind = name.split(" ", 2)[2] if name.startswith("layer ") else name  # "layer 3 qkv GEMM" -> "qkv GEMM"
            self.op_seconds[kind] = self.op_seconds.get(kind, 0.0) + t / 1e9
        return failed

    def _set_step(self, meta) -> None:
        """The attention kernel's arguments of each window that the step's plan gives."""
        for window, step in self.steps.items():
            self.windows[window].backend.plan_args(step, meta.for_window(window))

    def _attention_args(self, attn) -> _Args:
        """The attention kernel's arguments of attn's window but for the plan's: q in the qkv rows, out the
        attention rows (each layer's op then takes its own caches)."""
        q = self.qkv[:, : attn.q_size].view(self.rows, attn.num_heads, attn.head_dim)
        out = self.attention.view(self.rows, attn.num_heads, attn.head_dim)
        return attn.backend.kernel_args(q, attn.k_cache, attn.v_cache, out)

    def _build(self, m: int, dtype: torch.dtype) -> None:
        """Buffers of at least m rows and the records over them for the step's LoRA adapters, unless those built
        before still serve."""
        key = (dtype, torch.get_num_threads(), self.first_attention.k_cache.data_ptr(), len(self.model.layers))
        if key != self.key or m > self.rows:
            self._buffers(m, dtype)
            self.programs = {}
            self.key = key
        lora = self._lora_ids()
        if lora not in self.programs:
            if len(self.programs) >= MAX_PROGRAMS:
                self.programs.pop(next(iter(self.programs)))
            self.programs[lora] = self._records(dtype, key[1])
        self.records, self.names, _, self.last_layer = self.programs[lora]

    def _buffers(self, m: int, dtype: torch.dtype) -> None:
        attn = self.model.layers[0].self_attn
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
        inputs = torch.zeros((3, self.rows), dtype=torch.int64)
        self.ids, self.positions, self.slots = inputs  # views
        self.inputs = inputs.numpy()
        self.row_ids = torch.zeros(self.rows, dtype=torch.int64)  # each row's LoRA adapter
        ops = fused_ops.KERNEL.load(fused_ops.isa())
        self.run_program, self.run_timed = ops.flock_run_program, ops.flock_run_program_timed
        self.steps = {window: self._attention_args(attn) for window, attn in self.windows.items()}
        # the embeddings looked up by the program's first op where the table is plain rows (else in PyTorch, copied)
        table = self.model.embed_tokens
        self.embeds = table.qweight is None and self.model.embedding_scale == 1.0 and table.weight.stride(1) == 1
        self.outputs = {}

    def _records(self, dtype: torch.dtype, threads: int) -> tuple:
        """(records, op names, what they point to beyond the buffers (LoRA stacks, scratch), the last layer's first
        record)."""
        recorder = _Recorder(self, fused_ops.KERNEL.load(fused_ops.isa()), dtype, threads)
        if self.embeds:
            recorder.embedding(self.model.embed_tokens.weight)
        for i, layer in enumerate(self.model.layers):
            last_layer = len(recorder.records)
            recorder.layer(i, layer)
        recorder.norm(f"layer {len(self.model.layers) - 1} final norm", self.model.norm, first=False)
        records = np.array([r + [0] * (WIDTH - len(r)) for r in recorder.records], dtype=np.int64)
        return records, recorder.names, recorder.kept, last_layer


class _Recorder:
    """A program's records, layer by layer, over the buffers of `program` (its x, residual, qkv, attention, mid,
    ... rows): each record an op's address and its arguments (ROWS: the step's row count, set at each run)."""

    def __init__(self, program: StepProgram, ops: ctypes.CDLL, dtype: torch.dtype, threads: int):
        self.p, self.ops, self.threads = program, ops, threads
        self.suffix, self.bf16, self.size = fused_ops.SUFFIX[dtype], int(dtype == torch.bfloat16), dtype.itemsize
        self.attention = kernel_library(program.model.layers[0].self_attn.backend.isa)
        self.records: list[list] = []
        self.names: list[str] = []
        self.kept: list[torch.Tensor] = []  # LoRA stacks and scratch the records point to

    def op(self, name: str, fn, *args) -> None:
        self.records.append([_address(fn), *(a if isinstance(a, int) else a.data_ptr() for a in args)])
        self.names.append(name)

    def fused(self, name: str, kind: str, *args) -> None:
        """An op of csrc/fused_ops.c for the model's dtype; its last argument the thread count."""
        self.op(name, getattr(self.ops, f"flock_{kind}_op_{self.suffix}"), *args, self.threads)

    def embedding(self, table: torch.Tensor) -> None:
        """The step's token ids' rows of the table into the residual rows, which the first layer's norm reads."""
        r = self.p.residual
        self.op("embedding", self.ops.flock_embed_op, table, table.stride(0) * self.size, table.shape[0], self.p.ids,
                ROWS, r, r.stride(0) * self.size, table.shape[1] * self.size)

    def layer(self, i: int, layer) -> None:
        p, attn, name = self.p, layer.self_attn, f"layer {i}"
        self.norm(f"{name} input norm", layer.input_layernorm, first=i == 0)
        self.linear(f"{name} qkv", attn.qkv_proj, p.x, p.qkv)
        self.rotated_qk(name, attn, p.model.rope_of(layer))
        self.attention_records(name, attn)
        self.linear(f"{name} o", attn.o_proj, p.attention, p.x)
        self.scaled(f"{name} attention", layer)
        if layer.sandwich:  # Gemma 2's and 3's: the attention output normalized, then the norm before the MLP
            self.output_norm(f"{name} post-attention norm", layer.post_attention_layernorm)
            self.norm(f"{name} pre-feedforward norm", layer.pre_feedforward_layernorm, first=False)
        else:
            self.norm(f"{name} post-attention norm", layer.post_attention_layernorm, first=False)
        self.mlp(name, layer.mlp, p.x)
        self.scaled(f"{name} MLP", layer)
        if layer.sandwich:
            self.output_norm(f"{name} post-feedforward norm", layer.post_feedforward_layernorm)

    def linear(self, name: str, layer, x: torch.Tensor, out: torch.Tensor, glu: bool = False) -> None:
        if layer.pairs is not None:
            mode = gemm.OUT_GLU if glu else gemm.OUT_BF16
            self.op(f"{name} GEMM", gemm._lib(None).flock_gemm_op, x, x.stride(0), layer.pairs, out, out.stride(0),
                    ROWS, out.shape[1], x.shape[1], mode, self.threads)
        else:
            w, bf16 = layer.qweight, self.bf16
            for qtype, x8, blocks, row_bytes, cols, col in w.calls[glu]:
                self.op(f"{name} GEMM", quant._lib(None).flock_qgemm_op, qtype, int(x8), blocks, row_bytes, cols,
                        w.k, x, x.stride(0), bf16, ROWS, out.data_ptr() + col * self.size, out.stride(0), bf16,
                        int(glu), self.threads)
        if layer.bias is not None:
            self.op(f"{name} bias", getattr(self.ops, f"flock_add_bias_op_{self.suffix}"), out, out.stride(0),
                    layer.bias, ROWS, out.shape[1])
        stack = layer.lora.stack(out.shape[1]) if layer.lora is not None else None
        if stack is not None:  # the step's LoRA updates (flock.lora.layers), each row masked to its adapter's
            shrunk = x.new_empty((self.p.rows, stack.ranks))
            self.kept += [stack.shrink, stack.expand, stack.owners, shrunk]
            self.op(f"{name} LoRA", gemm._lib(None).flock_lora_op, x, x.stride(0), stack.shrink, stack.ranks,
                    stack.expand, out, out.stride(0), ROWS, out.shape[1], x.shape[1], self.p.row_ids, stack.owners,
                    shrunk, self.threads)

    def norm(self, name: str, module, first: bool) -> None:
        """The residual add and norm before a block (the first layer's: the norm of the embeddings)."""
        x, r = self.p.x, self.p.residual
        args = (r, r.stride(0), x, x.stride(0)) if first else (x, x.stride(0), r, r.stride(0))
        self.fused(name, "rms_norm" if first else "add_rms_norm", *args, module.kernel_weight(), ROWS, x.shape[1],
                   _f32_word(module.eps))

    def output_norm(self, name: str, module) -> None:
        """A block's output normalized in place (Gemma 2's and 3's sandwich norms)."""
        x = self.p.x
        self.fused(name, "rms_norm", x, x.stride(0), x, x.stride(0), module.kernel_weight(), ROWS, x.shape[1],
                   _f32_word(module.eps))

    def rotated_qk(self, name: str, attn, rope) -> None:
        """q and k normalized (Qwen3's, Gemma 3's) and turned by the layer's rotary tables."""
        qkv = self.p.qkv
        if attn.qk_norm:
            k_at = qkv.data_ptr() + attn.q_size * self.size
            for which, at, module, heads in (("q", qkv, attn.q_norm, attn.num_heads),
                                             ("k", k_at, attn.k_norm, attn.num_kv_heads)):
                self.fused(f"{name} {which} norm", "head_rms_norm", at, qkv.stride(0), module.kernel_weight(), ROWS,
                           heads, attn.head_dim, _f32_word(module.eps))
        if attn.rotates:  # SmolLM3's NoPE layers do not
            self.fused(f"{name} rope", "rope", qkv, qkv.stride(0), self.p.positions, rope.cos, rope.sin,
                       rope.cos.stride(0), ROWS, attn.num_heads + attn.num_kv_heads, attn.head_dim, rope.cos.shape[1])

    def attention_records(self, name: str, attn) -> None:
        """The layer's K and V into its caches, then its attention (its window's plan) into the attention rows."""
        k_cache, v_cache, qkv, size = attn.k_cache, attn.v_cache, self.p.qkv, self.size
        kv_format = KV_FORMATS.get(k_cache.dtype, 0)
        if not (k_cache.is_contiguous() and k_cache.stride() == v_cache.stride()
                and (kv_format or k_cache.dtype == qkv.dtype)
                and k_cache.shape[2:] == (attn.num_kv_heads, fp8.row_width(attn.head_dim, k_cache.dtype))):
            raise ValueError(f"{name}: the step program needs contiguous K and V caches of [blocks, block size, "
                             f"KV heads, head dim], got {tuple(k_cache.shape)}")
        row = attn.kv_size * size
        k_at, v_at = qkv.data_ptr() + attn.q_size * size, qkv.data_ptr() + (attn.q_size + attn.kv_size) * size
        slot_bytes = k_cache.stride(1) * k_cache.element_size()
        if kv_format:
            self.op(f"{name} KV write", self.attention.flock_cpu_write_kv_fp8_op, k_at, qkv.stride(0) * size, v_at,
                    qkv.stride(0) * size, k_cache, v_cache, slot_bytes, self.p.slots, ROWS, attn.num_kv_heads,
                    attn.head_dim, int(qkv.dtype == torch.bfloat16), kv_format)
        else:
            self.op(f"{name} KV write", self.attention.flock_cpu_write_kv_op, k_at, qkv.stride(0) * size, v_at,
                    qkv.stride(0) * size, k_cache, v_cache, slot_bytes, self.p.slots, ROWS, row)
        self.op(f"{name} attention", self.attention.flock_cpu_cascade_op,
                ctypes.addressof(self.p.steps[attn.window]), k_cache, v_cache)

    def mlp(self, name: str, mlp, out: torch.Tensor) -> None:
        p = self.p
        if _mixture(mlp):
            self.mixture(name, mlp, out)
            return
        mid = p.mid[:, : mlp.down_proj.in_features]
        if mlp.gate_up_proj.silu_and_mul:
            self.linear(f"{name} gate_up", mlp.gate_up_proj, p.x, mid, glu=True)
        else:  # GeGLU (Gemma's), or gate and up of two quant types
            act = "silu_and_mul" if mlp.silu else "gelu_and_mul"
            gate_up = p.gate_up[:, : 2 * mid.shape[1]]
            self.linear(f"{name} gate_up", mlp.gate_up_proj, p.x, gate_up)
            self.fused(f"{name} {act.replace('_', ' ')}", act, gate_up, gate_up.stride(0), mid, mid.stride(0), ROWS,
                       mid.shape[1])
        self.linear(f"{name} down", mlp.down_proj, mid, out)

    def mixture(self, name: str, mlp, out: torch.Tensor) -> None:
        """The router's GEMM and the experts' one call (flock.model.moe); a shared expert first, from the input
        the experts' call then overwrites, added under its gate after."""
        p = self.p
        if mlp.shared_expert is not None:
            self.mlp(f"{name} shared expert", mlp.shared_expert, p.shared)
            self.linear(f"{name} shared expert gate", mlp.shared_expert_gate, p.x, p.shared_gate)
        self.linear(f"{name} router", mlp.gate, p.x, p.logits)
        self.op(f"{name} experts", mlp.grouped.function(op=True), ctypes.addressof(mlp.grouped.layer), p.x,
                p.x.stride(0), p.logits, p.logits.stride(0), self.bf16, ROWS, out, out.stride(0), self.threads)
        if mlp.shared_expert is not None:
            self.fused(f"{name} shared expert add", "add_gated", out, out.stride(0), p.shared, p.shared.stride(0),
                       p.shared_gate, p.shared_gate.stride(0), ROWS, out.shape[1])

    def scaled(self, name: str, layer) -> None:
        """Granite's residual_multiplier on a block's output."""
        if layer.residual_multiplier != 1.0:
            self.fused(f"{name} scale", "scale", self.p.x, self.p.x.stride(0), ROWS, self.p.x.shape[1],
                       _f32_word(layer.residual_multiplier))
