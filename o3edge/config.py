"""The engine's frozen configuration (the article's O3Config) and its validation.

Its `policy` (o3edge.policy: priority classes, queue bounds, request limits) is the one the engine,
the daemon and O3Model serve by.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from o3edge.errors import ConfigError
from o3edge.policy import Policy

DTYPES = ("auto", "float32", "float16", "bfloat16")
BACKENDS = ("auto", "torch", "onnxruntime", "native")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # group sizes the INT4 packers and kernels take


@dataclass(frozen=True)
class O3Config:
    """What the engine needs to load a model and serve it; built once, never mutated.

    `model_path` may be a Hugging Face checkpoint directory or an o3edge engine directory;
    None selects the built-in default model.
    """

    model_path: str | None = None
    device: str = "auto"  # "cpu", "cuda", "cuda:N" or "auto"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    dynamic_kv_cache: bool = True  # paged KV cache with prefix reuse across requests
    int4_ffn: bool = False  # weight-only INT4 for the FFN projections
    int4_all: bool = False  # with int4_ffn: INT4 for every linear (attention projections, an untied LM head)
    int4_lm_head: bool = False  # with int4_ffn: the LM head INT4 too (tied: its own copy; quantized at load)
    # INT8 weights (per-row scales) for every linear not in INT4: with int4_ffn the attention projections and the
    # LM head (tied: its own copy), alone every linear; quantized at load (docs/engine-build.md)
    int8_weights: bool = False
    int4_group_size: int = 128
    kv_block_size: int = 32  # tokens per KV block
    num_kv_blocks: int | None = None  # None: max_num_seqs x max_model_len tokens, up to kv_cache_memory_mb
    kv_cache_memory_mb: int = 256  # the most the KV cache may take when num_kv_blocks is None
    cold_tier_mb: int = 0  # shared-memory cold tier for KV blocks; 0: off ([kv] cold_tier_mb in o3edged)
    cold_tier_dir: str = "/dev/shm"  # where its segment lives (a tmpfs)
    kv_router: str = "off"  # token router ([kv] router): off | int8 | int4 compressed pool (engine/router.py)
    router_threshold: float = 0.85  # share of attention saliency whose tokens keep full-precision KV
    sink_tokens: int = 4  # first tokens: always full precision
    recent_tokens: int = 128  # last tokens: always full precision
    router_refresh_steps: int = 32  # decode steps between routing passes (docs/kv-cache.md: why 32)
    router_select: str = "tokens"  # what covers router_threshold: salient tokens, or whole blocks (docs/kv-cache.md)
    router_cuda_graphs: bool = True  # router on, on CUDA: decode steps in CUDA graphs (router_graph.py)
    max_model_len: int | None = None  # None: the checkpoint's, capped at 4096
    max_num_seqs: int = 32  # sequences in the running batch
    max_num_batched_tokens: int = 2048  # prefill tokens per engine step (the chunk budget)
    cuda_graphs: bool = True  # capture decode steps in CUDA graphs (CUDA only)
    batch_window_ms: int = 0  # with an idle engine, wait up to this long for min_batch_size requests
    min_batch_size: int = 1
    num_threads: int | None = None  # CPU threads; None: physical cores, at most 8 (threads.py)
    cpu_compile: bool = False  # CPU quantized engines: decode through a torch.compile'd step (cpu_compiled.py)
    cpu_native_step: bool = True  # CPU VNNI engines: decode as one C++ call (cpu_step.py); before cpu_compile
    seed: int = 0
    # "native": a CPU engine directory without torch; "onnxruntime": an `o3edge export` directory; "auto":
    # native for a CPU preset's engine (not on CUDA, router off, no cpu_compile) where it can run, else torch
    backend: str = "auto"
    policy: Policy = field(default_factory=Policy)  # classes, queue bounds, request limits (o3edge.policy)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {self.device!r}")
        if self.int4_group_size not in INT4_GROUP_SIZES:
            raise ConfigError(f"int4_group_size must be one of {INT4_GROUP_SIZES}, got {self.int4_group_size}")
        for name in ("kv_block_size", "kv_cache_memory_mb", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_block_size % 8:
            raise ConfigError(f"kv_block_size must be a multiple of 8, got {self.kv_block_size}")
        if self.batch_window_ms < 0 or self.min_batch_size < 1:
            raise ConfigError("batch_window_ms must be >= 0 and min_batch_size >= 1")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads must be at least 1, got {self.num_threads}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.cold_tier_mb < 0:
            raise ConfigError(f"cold_tier_mb must be >= 0, got {self.cold_tier_mb}")
        if not self.cold_tier_dir.startswith("/"):
            raise ConfigError(f"cold_tier_dir must be an absolute path, got {self.cold_tier_dir!r}")
        if self.kv_router not in ("off", "int8", "int4"):
            raise ConfigError(f"kv router must be 'off', 'int8' or 'int4', got {self.kv_router!r}")
        if not 0 <= self.router_threshold <= 1:
            raise ConfigError(f"router_threshold must be in [0, 1], got {self.router_threshold}")
        if self.router_select not in ("tokens", "blocks"):
            raise ConfigError(f"router_select must be 'tokens' or 'blocks', got {self.router_select!r}")
        if min(self.sink_tokens, self.recent_tokens) < 0 or self.router_refresh_steps < 1:
            raise ConfigError("sink_tokens and recent_tokens must be >= 0, router_refresh_steps >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ConfigError(f"num_kv_blocks must be at least 2, got {self.num_kv_blocks}")

    @classmethod
    def from_dict(cls, values: dict) -> "O3Config":
        """Build from a mapping (a TOML table), rejecting unknown keys by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown engine setting(s): {', '.join(unknown)}")
        return cls(**values)
