"""The step-level engine: add requests, step, abort. No I/O; the daemon and O3Model drive it.

torch is imported only by the backends that run on it: `backend = "native"` (native_runner.py) serves a
quantized CPU engine from a process that never loads it.
"""

from __future__ import annotations

import logging
import time
from array import array
from dataclasses import dataclass, field
from typing import Callable

from o3edge.config import O3Config
from o3edge.engine.block_manager import BlockManager
from o3edge.engine.checkpoint import ModelArgs, fingerprint, read_model_args, weight_files
from o3edge.engine.cold_tier import model_identity, open_cold_tier
from o3edge.engine.cpu_features import cpu_bf16
from o3edge.engine.faults import MAX_FAILED_STEPS, is_fatal, recover
from o3edge.engine.threads import default_num_threads
from o3edge.engine.scheduler import Scheduler
from o3edge.engine.sequence import Priority, SamplingParams, Sequence
from o3edge.engine.tokenizer import Detokenizer, Tokenizer
from o3edge.errors import ConfigError, EngineFailed, InvalidRequest, OutOfCapacity, PromptTooLong
from o3edge.policy import Policy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeInfo:
    """What was found at start-up (never written back into the config)."""

    model_dir: str
    device: str
    dtype: str
    args: ModelArgs
    fingerprint: str
    num_kv_blocks: int
    kv_block_size: int
    kv_cache_bytes: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    load_seconds: float
    cache_identity: str = ""  # the model identity that roots the prefix cache's and the cold tier's keys
    backend: str = "torch"  # the backend that serves the model (pick_backend)


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    token_ids: list[int]  # new this step
    text: str  # new this step
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    arrival_time: float
    first_token_time: float | None
    num_cold_tokens: int = 0  # of the cached tokens, those copied in from the cold tier
    error: str | None = None  # finish_reason "error": what failed (this request only; the others go on)


@dataclass
class StepReport:
    """What a step did, for energy accounting and stats: times and tokens per request."""

    t_start_ns: int
    t_end_ns: int
    tokens: dict[str, tuple[int, int]] = field(default_factory=dict)  # request -> (prompt, generated)


def resolve_device(name: str):
    """The torch device to run on ("auto": CUDA where there is one)."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device, built=None):
    """The dtype to run in; "auto" takes an engine directory's built dtype when there is one, except a
    bfloat16 build on a CPU without native bf16 (no AVX512-BF16 or AMX), which runs in float32: dense
    bf16 products are emulated there and many times slower."""
    import torch

    if name == "auto":
        if built == torch.bfloat16 and device.type == "cpu" and not cpu_bf16():
            return torch.float32
        return built or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return getattr(torch, name)


def kv_blocks_needed(config: O3Config, max_len: int, block_bytes: int) -> int:
    """KV blocks for a full batch of full-length sequences (max_num_seqs x max_model_len), at most
    kv_cache_memory_mb: more could never be used at once, only kept for prefix reuse."""
    full_batch = config.max_num_seqs * -(-max_len // config.kv_block_size)
    return max(2, min(full_batch, config.kv_cache_memory_mb * (1 << 20) // block_bytes))


def token_array(ids, vocab: int) -> array | None:
    """ids as int32 if they are all integers in [0, vocab), else None. C loops, not Python ones (this is on
    the TTFT path): a sum that stays an int (a float, a numpy integer or a string makes it something else
    or fails it; bools and int subclasses pass), then one int32 copy whose range torch checks. The copy is
    kept: the block hashes are taken from its bytes. 16K ids: about half the time of the set of types,
    min and max it replaces (and the hashes need no copy of their own)."""
    try:
        if type(sum(ids)) is not int:
            return None
        checked = array("i", ids)
    except (TypeError, OverflowError):  # OverflowError: beyond int32, so beyond any vocabulary
        return None
    import numpy as np  # here, not at the top: importing the engine needs no numpy (test_first_hour.py)

    values = np.frombuffer(checked, dtype=np.int32)
    return checked if len(values) and values.min() >= 0 and values.max() < vocab else None


def pick_backend(config: O3Config, model_dir: str) -> str:
    """The backend to run: the configured one, or for "auto" the native backend where it serves the engine as the
    torch one would (an engine built with a CPU preset, on the CPU, router off, no compiled step asked for, and
    the native step builds here), else torch."""
    if config.backend != "auto":
        return config.backend
    from o3edge.engine import native_lib
    from o3edge.engine.manifest import cpu_preset

    preset = cpu_preset(model_dir)
    if (preset is None or config.device.startswith("cuda") or config.kv_router != "off" or config.cpu_compile
            or not native_lib.available()):
        return "torch"
    log.info('backend "auto": native (an engine of the %s preset on the CPU; this process needs no torch)', preset)
    return "native"


class LLMEngine:
    """Continuous-batching engine over a paged, prefix-reusing KV cache."""

    def __init__(self, config: O3Config, model_dir: str):
        t0 = time.perf_counter()
        self.config = config
        backend = pick_backend(config, model_dir)
        onnx, native = backend == "onnxruntime", backend == "native"
        if native:
            manifest, fp = self._native_checks(config, model_dir)
            model, args, device, dtype = None, manifest.args, "cpu", "float32"
        else:
            device, dtype, model, args, fp = self._torch_model(config, model_dir, onnx)
        self.tokenizer = Tokenizer(model_dir)
        max_len = min(config.max_model_len or min(args.max_position_embeddings, 4096), args.max_position_embeddings)
        if native:
            from o3edge.engine.native_runner import kv_block_bytes

            block_bytes = kv_block_bytes(args, config.kv_block_size)
        else:
            from o3edge.engine.runner import ModelRunner

            block_bytes = ModelRunner.block_bytes(args, config.kv_block_size, dtype)
        num_blocks = config.num_kv_blocks or kv_blocks_needed(config, max_len, block_bytes)
        if config.kv_router != "off" and not onnx:  # the compressed pool's scales come out of the same budget
            from o3edge.engine.router import full_blocks_in_budget

            num_blocks = full_blocks_in_budget(num_blocks, block_bytes, config.kv_router, args.num_layers,
                                               args.num_kv_heads, args.head_dim, config.kv_block_size, dtype.itemsize)
        if native:
            from o3edge.engine.native_runner import NativeRunner

            self.runner = NativeRunner(manifest, num_blocks, config.kv_block_size, max_len,
                                       config.num_threads or default_num_threads(), config.seed)
        elif onnx:
            from o3edge.export.ort_runner import OrtRunner

            self.runner = OrtRunner(model_dir, device, config.num_threads or default_num_threads(), config.seed)
        else:
            self.runner = ModelRunner(model, args, device, dtype, num_blocks, config.kv_block_size, max_len,
                                      config.seed)
        if onnx and config.kv_router != "off":
            raise ConfigError("the token router needs the torch backend ([kv] router = off for onnxruntime)")
        if not (onnx or native):
            self._torch_steps(config, device)
        # ONNX Runtime keeps dense KV per sequence (the pool only budgets it): no prefix sharing, no cold tier
        prefix_reuse = config.dynamic_kv_cache and not onnx
        kv_shape = f"{args.num_layers}x2x{config.kv_block_size}x{args.num_kv_heads}x{args.head_dim}"
        layout = f"cpu:torch.float32:{kv_shape}" if native else f"{device.type}:{dtype}:{kv_shape}"  # a block's bytes
        identity = fp if onnx else model_identity(model_dir, fp, layout, weight_files(model_dir))
        if config.kv_router == "off" or onnx:
            self.blocks = BlockManager(num_blocks, config.kv_block_size, identity, prefix_reuse)
        else:  # demoted blocks give their full-precision space back (engine/router_blocks.py)
            from o3edge.engine.router import per_host
            from o3edge.engine.router_blocks import RouterBlocks

            self.blocks = RouterBlocks(num_blocks, config.kv_block_size, identity, prefix_reuse,
                                       per_host(config.kv_router, args.head_dim, dtype.itemsize))
        if not (onnx or native):  # the torch runner's steps launched ahead take their next block early
            self.runner.reserve_block = self.blocks.reserve_next
        self.offloader = self._cold_tier(config, identity, block_bytes) if prefix_reuse else None
        self.policy = config.policy  # replaced whole by set_policy (a reload)
        if config.kv_router != "off":
            self._router(config)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens, config.policy)
        self.scheduler.set_window(config.batch_window_ms, config.min_batch_size)
        eos = args.eos_token_ids or tuple(t for t in [self.tokenizer.token_id(self.tokenizer.eos_token)] if t is not None)
        self.info = RuntimeInfo(model_dir, str(device), str(dtype).removeprefix("torch."), args, fp, num_blocks,
                                config.kv_block_size, num_blocks * block_bytes, max_len, eos,
                                time.perf_counter() - t0, cache_identity=identity, backend=backend)
        self.seqs: dict[str, Sequence] = {}
        self.detok: dict[str, Detokenizer] = {}
        self.num_generated_tokens = 0
        self.num_failed_steps = 0  # in a row; MAX_FAILED_STEPS of them end the engine
        # Test-only: called with each sequence before its new token is taken in; what it raises fails
        # that request alone, as any error of a request's own work does. None outside tests.
        self.fault_hook: Callable[[Sequence], None] | None = None
        log.info("engine ready: %s on %s/%s, %d KV blocks of %d tokens (%.0f MiB), max_model_len %d",
                 model_dir, device, self.info.dtype, num_blocks, config.kv_block_size,
                 self.info.kv_cache_bytes / 2**20, max_len)

    @staticmethod
    def _torch_model(config: O3Config, model_dir: str, onnx: bool):
        """(device, dtype, model, args, fingerprint) of the torch and ONNX Runtime backends (torch imported here)."""
        import torch

        from o3edge.engine.cpu_quant import int8_tag
        from o3edge.engine.engine_dir import built_dtype
        from o3edge.engine.loader import load_model
        from o3edge.engine.quant import int4_tag

        device = resolve_device(config.device)
        if config.num_threads or device.type == "cpu":
            torch.set_num_threads(config.num_threads or default_num_threads())
        if device.type == "cpu":
            torch.set_flush_denormal(True)  # x86 runs denormal floats in microcode: up to 4x slower steps
        if onnx:  # an `o3edge export` directory, run by ONNX Runtime
            from o3edge.export.ort_runner import onnx_dtype, onnx_fingerprint

            return device, onnx_dtype(model_dir), None, read_model_args(model_dir), onnx_fingerprint(model_dir)
        dtype = resolve_dtype(config.dtype, device, built_dtype(model_dir))
        model, args = load_model(model_dir, device, dtype, config.int4_ffn, config.int4_group_size, config.int4_all,
                                 config.int4_lm_head, config.int8_weights)
        return device, dtype, model, args, fingerprint(model_dir) + int4_tag(model) + int8_tag(model)

    @staticmethod
    def _native_checks(config: O3Config, model_dir: str):
        """(manifest, fingerprint) for backend = "native", or a ConfigError naming what it cannot do."""
        from o3edge.engine import native_lib
        from o3edge.engine.manifest import is_engine_dir, read_manifest

        if config.device not in ("auto", "cpu"):
            raise ConfigError(f'backend = "native" runs on the CPU; device {config.device!r} needs backend = "torch"')
        if config.kv_router != "off":
            raise ConfigError('the token router needs the torch backend ([kv] router = off for backend = "native")')
        if not is_engine_dir(model_dir):
            raise ConfigError(f'backend = "native" serves an engine directory; {model_dir} is a checkpoint: build one '
                              "with `o3edge build SRC OUT --preset cpu-int4` (or cpu-int8, cpu-int4-all)")
        if not native_lib.available():
            raise ConfigError('backend = "native" needs an x86-64 CPU with AVX2 (or AVX-VNNI, AVX-512 VNNI) and g++ '
                              "to build its kernels; this machine lacks them (use backend = \"torch\")")
        return read_manifest(model_dir), fingerprint(model_dir) + ":native"

    def _torch_steps(self, config: O3Config, device) -> None:
        """CUDA graphs, or the CPU's native or compiled decode step, where they apply."""
        if device.type == "cuda" and config.cuda_graphs and config.kv_router == "off":
            self.runner.enable_static_decode(config.max_num_seqs, capture=True,
                                             max_prefill_tokens=config.max_num_batched_tokens)
        native = device.type == "cpu" and config.cpu_native_step and self.runner.enable_cpu_native()
        if device.type == "cpu" and config.cpu_compile and not native:
            self.runner.enable_cpu_compile(config.max_num_seqs)

    def _cold_tier(self, config: O3Config, identity: str, block_bytes: int):
        """The shared-memory cold tier and its copier, hooked into the block manager; None when off."""
        tier = open_cold_tier(config.cold_tier_dir, bytes.fromhex(identity), config.cold_tier_mb,
                              config.kv_block_size, block_bytes)
        if tier is None:
            return None
        from o3edge.engine.kv_offload import KVOffloader

        try:
            offloader = KVOffloader(tier, self.runner.kv_cache, config.kv_block_size)
        except Exception as exc:  # the tier is an optimization: never a reason not to serve
            log.warning("cold tier off: its copier could not start (%s); serving without it", exc)
            tier.close()
            return None
        self.blocks.cold = tier
        self.blocks.on_cached_free = offloader.offer_block
        self.blocks.on_reuse = offloader.before_overwrite
        return offloader

    def _router(self, config: O3Config) -> None:
        """Token router on (engine/router.py): its compressed pool lives in the KV pool's bytes, and the
        block books (RouterBlocks) carry out the demotions it plans."""
        from o3edge.engine.router import RouterConfig

        graphs = self.runner.device.type == "cuda" and config.cuda_graphs and config.router_cuda_graphs
        self.runner.enable_router(RouterConfig(config.kv_router, config.router_threshold, config.sink_tokens,
                                               config.recent_tokens, config.router_refresh_steps,
                                               select=config.router_select),
                                  config.max_num_seqs if graphs else 0)
        self.blocks.demoter = self.runner.router
        self.runner.carry_out = self.blocks.carry_out
        log.info("token router: %s pool, threshold %.2f, %d sink and %d recent tokens full precision",
                 config.kv_router, config.router_threshold, config.sink_tokens, config.recent_tokens)

    def _restore(self, seq: Sequence) -> int:
        """Copy seq's cold blocks in; how many arrived (a failure means they are all recomputed)."""
        try:
            return self.offloader.restore(seq.cold_pending)
        except Exception:
            log.exception("cold tier: restoring %d blocks failed; they are recomputed", len(seq.cold_pending))
            return 0

    def close(self) -> None:
        """Let the cold tier's copies finish and release it (its segment stays for the next start)."""
        if self.offloader is not None:
            self.blocks.cold = self.blocks.on_cached_free = self.blocks.on_reuse = None
            self.offloader.close()
            self.offloader = None

    def set_policy(self, policy: Policy) -> None:
        """Serve by new classes, queue bounds and request limits from now on (a reload)."""
        self.policy = policy
        self.scheduler.set_policy(policy)

    # ---- requests --------------------------------------------------------------------------
    def encode(self, prompt: str | None = None, messages: list | None = None) -> list[int]:
        """Token ids for a plain prompt or a chat."""
        return self.tokenizer.encode_request(prompt, messages)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: Priority = Priority.NORMAL, deadline: float | None = None) -> Sequence:
        """Queue a request; it runs in the next steps. Raises a coded error if it can never run."""
        if request_id in self.seqs:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        checked = self._check_prompt(prompt_token_ids)
        self.policy.requests.check(params.max_new_tokens, params.temperature, params.top_k, params.stop)
        seq = Sequence(request_id, list(prompt_token_ids), params, Priority(priority), deadline, prompt_array=checked)
        self.scheduler.add(seq)  # raises Busy when the queue is full or the class is shedding load
        self.seqs[request_id] = seq
        self.detok[request_id] = Detokenizer(self.tokenizer, params.stop)
        return seq

    def _check_prompt(self, ids: list[int]) -> array:
        """The prompt's ids as int32 (the block hashes are taken from its bytes), or a coded error."""
        if not ids:
            raise InvalidRequest("the prompt is empty")
        vocab = self.info.args.vocab_size
        checked = token_array(ids, vocab)
        if checked is None:
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= self.info.max_model_len:
            raise PromptTooLong(f"prompt has {len(ids)} tokens; the context window is {self.info.max_model_len}")
        if self.blocks.blocks_for(len(ids) + 1) > self.blocks.num_blocks:
            raise OutOfCapacity(f"prompt of {len(ids)} tokens does not fit the KV cache "
                                f"({self.blocks.num_blocks} blocks of {self.blocks.block_size})")
        return checked

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already done."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, reason)
        self.runner.release(seq)
        self.detok.pop(request_id, None)
        if self.offloader is not None:
            self.offloader.flush()  # its named blocks start on their way to the cold tier now, idle or not
        return True

    def score(self, token_ids: list[int]):
        """Float32 logits [len, V] for every position of a token sequence (perplexity, quality reports): a torch
        tensor, or a NumPy array on the native backend."""
        checked = self._check_prompt(token_ids)
        seq = Sequence("score", list(token_ids), SamplingParams(), prompt_array=checked)
        if self.scheduler.has_work() or not self.blocks.can_allocate(seq):
            raise OutOfCapacity("score() needs an idle engine with room for the whole sequence")
        self.blocks.allocate(seq, reuse=False)
        try:
            return self.runner.prompt_logits(seq)
        finally:
            self.blocks.free_seq(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> tuple[list[RequestOutput], StepReport | None]:
        """Run one batch; returns each touched request's new output and what the step did."""
        batch = self.scheduler.schedule()
        outputs = [self._expired(seq) for seq in self.scheduler.expired]
        self.scheduler.expired.clear()
        if self.offloader is not None:
            self.offloader.flush()  # this step's offers (finished and preempted sequences) start copying
        if not batch:
            return outputs, None
        t0 = time.monotonic_ns()
        kv_ready = None
        for seq, _ in batch:
            if seq.cold_pending:  # the copies start now; the runner waits for them right before its forward
                self.blocks.restored(seq, self._restore(seq))
                kv_ready = self.offloader.ready
        try:
            tokens = self.runner.run(batch, kv_ready) if kv_ready else self.runner.run(batch)
        except Exception as exc:
            return outputs + self._step_failed(batch, exc), None
        finally:
            if kv_ready is not None:
                kv_ready()  # a run that failed before its forward: the copies still land before any reuse
        self.num_failed_steps = 0
        report = StepReport(t0, time.monotonic_ns())
        now, mark_computed = time.monotonic(), self.blocks.step_marker()
        for (seq, n), token in zip(batch, tokens):
            is_decode = n == 1 and seq.num_output_tokens > 0 and seq.num_computed_tokens == len(seq) - 1
            # (prompt tokens processed, tokens generated): a chunk that ends the prompt yields one too
            report.tokens[seq.request_id] = (0 if is_decode else n, 0 if token is None else 1)
            mark_computed(seq, n)
            if token is not None:
                outputs.append(self._take_token(seq, token, now))
        return outputs, report

    def _step_failed(self, batch: list[tuple[Sequence, int]], exc: Exception) -> list[RequestOutput]:
        """The model run failed: end this step's requests (the waiting ones go on), or the engine when the
        device is lost or the failures keep coming (EngineFailed)."""
        self.num_failed_steps += 1
        if is_fatal(exc) or self.num_failed_steps >= MAX_FAILED_STEPS:
            raise EngineFailed(f"the engine cannot go on ({self.num_failed_steps} failing step(s) in a row): "
                               f"{type(exc).__name__}: {exc}") from exc
        log.error("engine step failed; ending its %d requests", len(batch), exc_info=exc)
        outputs = [self._failed(seq, exc) for seq, _ in batch]
        recover(exc)
        return outputs

    def _take_token(self, seq: Sequence, token: int, now: float) -> RequestOutput:
        """Append a sampled token; an error in this request's own work (detokenizing, stop checks) ends
        this request alone."""
        try:
            if self.fault_hook is not None:
                self.fault_hook(seq)
            return self._append(seq, token, now)
        except Exception as exc:
            log.error("request %s failed", seq.request_id, exc_info=exc)
            return self._failed(seq, exc)

    def _failed(self, seq: Sequence, exc: Exception) -> RequestOutput:
        self.abort(seq.request_id, "error")
        return RequestOutput(seq.request_id, [], "", True, "error", seq.num_prompt_tokens, seq.num_output_tokens,
                             seq.num_cached_tokens, seq.arrival_time, seq.first_token_time, seq.num_cold_tokens,
                             error=f"{type(exc).__name__}: {exc}"[:200])

    def _append(self, seq: Sequence, token: int, now: float) -> RequestOutput:
        seq.token_ids.append(token)
        self.num_generated_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        p = seq.params
        text, hit_stop = self.detok[seq.request_id].add(token)
        reason = None
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.info.eos_token_ids) or hit_stop:
            reason = "stop"
        elif seq.num_output_tokens >= p.max_new_tokens or len(seq) >= self.info.max_model_len:
            reason = "length"
        if reason is not None:
            text += self.detok[seq.request_id].flush()
            self.abort(seq.request_id, reason)
        return RequestOutput(seq.request_id, [token], text, reason is not None, reason, seq.num_prompt_tokens,
                             seq.num_output_tokens, seq.num_cached_tokens, seq.arrival_time, seq.first_token_time,
                             seq.num_cold_tokens)

    def _expired(self, seq: Sequence) -> RequestOutput:
        """The last output of a request the scheduler ended: its deadline passed (queued: never run;
        running: cut), or a more important request displaced it from a full queue ("busy")."""
        reason = seq.finish_reason
        text = self.detok[seq.request_id].flush()
        self.abort(seq.request_id, reason)
        return RequestOutput(seq.request_id, [], text, True, reason, seq.num_prompt_tokens,
                             seq.num_output_tokens, seq.num_cached_tokens, seq.arrival_time, seq.first_token_time,
                             seq.num_cold_tokens)

    def stats(self) -> dict:
        """Queue, batch and KV-cache figures for `stats` and metrics."""
        s = self.scheduler
        return {"waiting": len(s.waiting), "running": len(s.running), "preemptions": s.num_preemptions,
                "generated_tokens": self.num_generated_tokens, "classes": s.stats(), **self.blocks.stats(),
                **(self.offloader.stats() if self.offloader is not None else {"cold_tier": "off"}), **self._kv_stats()}

    def _kv_stats(self) -> dict:
        """KV bytes per token of the blocks holding K/V (in use or cached), and (router on) the share of
        their tokens in each pool."""
        router = getattr(self.runner, "router", None)
        if router is None:
            per_block = self.info.kv_cache_bytes // max(1, self.info.num_kv_blocks)
            return {"kv_router": "off", "kv_bytes_per_token": per_block // self.info.kv_block_size}
        return router.stats(self.blocks)
