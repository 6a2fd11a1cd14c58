from dataclasses import dataclass, fields

# the model's speed paths: both (where the CPU and dtype allow), none (plain PyTorch, the reference), or one
OPS = ("auto", "torch", "fused", "packed")


@dataclass
class EngineConfig:
    """Engine settings; names follow vLLM's where vLLM has one."""

    model: str = "flock/tiny"
    tokenizer: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float64 (float16 runs as bfloat16 on CPU)
    load_format: str = "auto"  # auto | safetensors | dummy
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    num_kv_blocks: int | None = None  # KV budget in blocks ...
    kv_cache_memory_bytes: int | None = None  # ... or in bytes (default: up to 2 GiB)
    scheduler: str = "fcfs"  # fcfs | batchllm | lpm | dfs-weight | feather
    feather_policy: str = "static"  # static | ucb | qlearning
    attention: str = "auto"
    ops: str = "auto"  # auto | torch | fused | packed: fused C elementwise kernels, prepacked GEMM weights

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        config = cls(model=model, **kwargs)
        config.validate()
        return config

    def validate(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.ops not in OPS:
            raise ValueError(f"ops must be one of {', '.join(OPS)}, got {self.ops!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
