"""The model runner: owns every tensor (weights, KV pool, RoPE tables) and runs one step."""

from __future__ import annotations

import logging
from functools import partial
from typing import Callable

import torch

from o3edge.engine.checkpoint import ModelArgs
from o3edge.engine.cpu_decode import CpuDecode, decode_forward, lazy_zeros
from o3edge.engine.cpu_quant import int8_tag
from o3edge.engine.cuda_graph import DecodeGraphs
from o3edge.engine.model import StepBatch, Transformer
from o3edge.engine.prefill_graph import PrefillGraphs
from o3edge.engine.rope import rope_tables
from o3edge.engine.sampling import counter_sample, counter_settings, make_generator, pick_tokens, ways_needed
from o3edge.engine.sequence import SamplingParams, Sequence

log = logging.getLogger(__name__)


class ModelRunner:
    """Runs the model on a batch of (sequence, new token count) pairs and samples their next tokens."""

    def __init__(self, model: Transformer, args: ModelArgs, device: torch.device, dtype: torch.dtype,
                 num_blocks: int, block_size: int, max_model_len: int, seed: int = 0):
        self.model, self.args, self.device, self.dtype = model, args, device, dtype
        self.block_size, self.num_blocks, self.max_model_len = block_size, num_blocks, max_model_len
        self.cos, self.sin = rope_tables(args, max_model_len, device, dtype)
        # the whole KV pool, allocated once: [layers, K/V, slots, kv_heads, head_dim]; one extra
        # block at the end is scratch space that padded rows of static-shape steps write into
        shape = (args.num_layers, 2, (num_blocks + 1) * block_size, args.num_kv_heads, args.head_dim)
        self.kv_cache = lazy_zeros(shape, dtype) if device.type == "cpu" else torch.zeros(shape, device=device,
                                                                                           dtype=dtype)
        self.scratch_slot = num_blocks * block_size
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        # the block books' BlockManager.reserve_next (the engine sets it): a block for a step launched ahead
        self.reserve_block: Callable[[Sequence], bool] | None = None
        # with the token router, RouterBlocks.carry_out (the engine sets it): a sequence's due demotions now
        self.carry_out: Callable[[Sequence], None] | None = None
        # steps that do not fit the graphs attend through the block tables on CUDA (a Triton kernel);
        # the CPU keeps its gather + SDPA path, exact against transformers
        self.paged_prefill = device.type == "cuda"
        # INT8 engines decode through cpu_decode.decode_forward; float32 keeps the model's exact forward
        self.cpu_decode = CpuDecode(block_size, fast_forward=int8_tag(model) != "") if device.type == "cpu" else None
        self.generators: dict[int, torch.Generator | None] = {}
        self._seed = seed
        self.last_logits: torch.Tensor | None = None
        self.router = None  # engine/router.py's KVRouter when the token router is on (enable_router)

    @staticmethod
    def block_bytes(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one KV block takes across all layers."""
        elem = torch.tensor([], dtype=dtype).element_size()
        return args.num_layers * 2 * block_size * args.num_kv_heads * args.head_dim * elem

    def enable_static_decode(self, max_batch: int, capture: bool, max_prefill_tokens: int = 0) -> None:
        """Run decode steps (and, with max_prefill_tokens, fresh one-sequence prefills) on static
        buffers; with capture, replay them from CUDA graphs."""
        self.graphs = DecodeGraphs(self, max_batch, capture)
        if max_prefill_tokens:
            self.prefill_graphs = PrefillGraphs(self, max_prefill_tokens, capture)
        if capture:
            self.graphs.capture_all()
            if self.prefill_graphs is not None:
                self.prefill_graphs.capture_all()
            if self.graphs.sampling:
                self.warm_counter_draw()

    def enable_router(self, cfg, graph_batch: int = 0) -> None:
        """Token router on (engine/router.py): steps run the model's eager forward, attention over both
        KV pools; with graph_batch (CUDA), decode steps of up to that many sequences replay CUDA graphs
        (router_graph.py; refresh steps observe saliency inside their own graphs). The CPU span path and
        prefill graphs are not used."""
        from o3edge.engine.router import KVRouter

        full = self.block_bytes(self.args, self.block_size, self.dtype) // self.block_size
        self.router = KVRouter(cfg, self.kv_cache, self.num_blocks, self.block_size, full, self.max_model_len)
        self.graphs = self.prefill_graphs = self.cpu_decode = None
        self.paged_prefill = False  # the router attends over the gathered keys and its compressed pool
        if graph_batch:
            from o3edge.engine.router_graph import RouterDecodeGraphs

            self.graphs = RouterDecodeGraphs(self, graph_batch, capture=self.device.type == "cuda")
            if self.graphs.capture:
                self.graphs.capture_all()

    def enable_cpu_native(self) -> bool:
        """Decode steps of a quantized CPU engine as one C++ call (cpu_step.py) where it applies; whether it does."""
        from o3edge.engine.cpu_step import NativeDecode, build

        native = build(self.model, self.kv_cache) if self.cpu_decode is not None else None
        if native is not None:
            self.cpu_decode.native = NativeDecode(native)
        return native is not None

    def enable_cpu_compile(self, max_batch: int) -> None:
        """Decode steps of a quantized CPU engine through the compiled step (cpu_compiled.py), warmed up now."""
        from o3edge.engine.cpu_compiled import CompiledDecode, compilable

        if self.cpu_decode is None or not compilable(self.model):
            log.info("cpu_compile: not a quantized CPU engine; decode stays eager")
            return
        compiled = CompiledDecode(self.model, min(max_batch, self.cpu_decode.max_batch))
        compiled.warm_up(self.cos, self.sin, self.kv_cache, self.scratch_slot)
        self.cpu_decode.compiled = compiled

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]], kv_ready: Callable[[], None] | None = None) -> list[int | None]:
        """Compute the new tokens' K/V and sample a token for each sequence whose prompt is now done.
        kv_ready (blocks being restored from the cold tier) is called after the host has prepared the
        step and before its first kernel reads the cache."""
        ready = kv_ready or _nothing
        done, greedy_only = _finishing(batch)
        on_device = greedy_only or (self.graphs is not None and self.graphs.sampling)  # the graph picks them
        picked = None
        if self.router is not None and self.graphs is not None and self.graphs.fits(batch):
            ready()
            logits, picked = self.graphs.run(batch, greedy_only)  # router_graph.py: both pools in the graph
            self.router.end_step(batch, decoding=True)
        elif self.router is not None and (rows := self._router_split(batch)) is not None:
            return self._run_router_split(batch, *rows, ready)
        elif self.router is not None:
            if self.graphs is not None:
                self.graphs.drop_ahead()
            logits = self._router_eager(batch, ready)
        elif self.graphs is not None and self.graphs.fits(batch):
            ready()
            logits, picked = self.graphs.run(batch, on_device)  # decode: greedy (or sampled) picked on the GPU
        else:
            if self.graphs is not None:
                self.graphs.drop_ahead()
            if self.prefill_graphs is not None and self.prefill_graphs.fits(batch):
                logits, greedy = self.prefill_graphs.run(batch, ready)
                picked = greedy.tolist() if greedy_only else None
            else:
                prepared = self.cpu_decode.prepare(batch) if self.cpu_decode is not None else None
                input_ids, positions, step = prepared or self.prepare(batch)
                fast = prepared and self.cpu_decode.fast_forward
                forward = partial(decode_forward, self.model) if fast else self.model
                if prepared and self.cpu_decode.compiled is not None:
                    forward = self.cpu_decode.compiled
                if prepared and self.cpu_decode.native is not None:
                    forward = self.cpu_decode.native
                ready()
                logits = forward(input_ids, positions, self.cos, self.sin, step, self.kv_cache)  # [B, V]
        self.last_logits = logits  # kept for tests and quality reports; no copy (None: overwritten)
        return self._tokens(batch, logits, picked, greedy_only, done)

    def _tokens(self, batch, logits, picked, greedy_only: bool, done: list[int]) -> list[int | None]:
        """run's tokens: picked on the device (the rows `done` finish a prompt), or from the logits here."""
        if picked is None and not greedy_only and self.graphs is not None and self.graphs.sampling:
            return self._counter_pick(batch, logits)
        if picked is None:
            return pick_tokens(batch, logits, self._generator)
        tokens: list[int | None] = [None] * len(batch)
        for i in done:
            tokens[i] = picked[i]
        return tokens

    def _router_split(self, batch) -> tuple[list[int], list[int]] | None:
        """A router step's (prompt rows, decoding rows) where it has both and its decoding sequences fit the
        router's decode graphs; None otherwise."""
        if self.graphs is None:
            return None
        decoding = [i for i, row in enumerate(batch) if not self.router.needs_eager([row])]
        if not decoding or len(decoding) == len(batch) or not self.graphs.fits([batch[i] for i in decoding]):
            return None
        taken = set(decoding)
        return [i for i in range(len(batch)) if i not in taken], decoding

    def _run_router_split(self, batch, prompt_rows: list[int], decoding_rows: list[int], ready) -> list[int | None]:
        """A router step with prompt rows and decoding ones: the prompt rows run eager, as their own router
        step that the refresh count passes over (KVRouter.end_step's counted), then the decoding rows take
        the decode graph step (or the one queued for them), which counts. Before, the whole step ran eager:
        every decoding sequence attended over both pools by torch operations, layer by layer. On the H200, a
        3,840-token prompt's step beside 15 decoding sequences took 90-171 ms that way (7-13 with the router
        off), 17-21 ms with this and the prompt's flash attention (router.py; tools/bench_router.py --gpu's
        prompt_step_ms_p50, docs/benchmarks.md)."""
        tokens: list[int | None] = [None] * len(batch)
        for rows, graph in ((prompt_rows, False), (decoding_rows, True)):
            part = [batch[i] for i in rows]
            done, greedy_only = _finishing(part)
            picked = None
            if graph:
                logits, picked = self.graphs.run(part, greedy_only)
                self.router.end_step(part, decoding=True)
            else:
                logits = self._router_eager(part, ready, counted=False)
            for i, token in zip(rows, self._tokens(part, logits, picked, greedy_only, done)):
                tokens[i] = token
        self.last_logits = None
        return tokens

    def _router_eager(self, batch, ready, counted: bool = True) -> torch.Tensor:
        """A router step's eager forward over batch (attention over both pools, router.py), its logits; its end
        plans the routing of the prompts it ends (blocks.mark_computed carries their demotions out)."""
        input_ids, positions, step = self.prepare(batch, keys=False)
        step.router = self.router.begin_step(batch)
        ready()
        logits = self.model(input_ids, positions, self.cos, self.sin, step, self.kv_cache)
        self.router.end_step(batch, counted=counted)
        return logits

    @torch.inference_mode()
    def prompt_logits(self, seq: Sequence) -> torch.Tensor:
        """Float32 logits at every position of seq's uncomputed tokens: [n, V] (perplexity, reports)."""
        input_ids, positions, step = self.prepare([(seq, seq.num_uncomputed)])
        step.logits_index = torch.arange(len(input_ids), device=self.device)
        return self.model(input_ids, positions, self.cos, self.sin, step, self.kv_cache)

    def seed_of(self, seq: Sequence) -> int:
        """A sequence's seed: its request's, or one of its own (as its torch.Generator's: _generator)."""
        return seq.params.seed if seq.params.seed is not None else self._seed + seq.seq_id

    def _counter_pick(self, batch, logits: torch.Tensor) -> list[int | None]:
        """pick_tokens with the graph's draw (sampling.counter_sample, the counter the position of each row's
        last input token), so that with graph sampling a sampled token is the same on every path: a graph
        step, a step with a prompt in it, a batch past the largest bucket."""
        return pick_tokens(batch, logits, lambda seq: seq, self._counter_rows)  # a row's "generator": its sequence

    def _counter_rows(self, rows: torch.Tensor, params: list, seqs: list[Sequence]) -> list[int]:
        return self._counter_draw(rows, params, [[self.seed_of(s), len(s) - 1] for s in seqs])

    @staticmethod
    def _counter_draw(rows: torch.Tensor, params: list, seeds_counters: list[list[int]]) -> list[int]:
        """counter_sample's tokens for rows, running only the ways (kernels) these rows' settings take."""
        dev = rows.device
        settings = counter_settings(params, rows.shape[1])
        cfg = torch.tensor(settings, dtype=torch.float32)
        ints = torch.tensor(seeds_counters, dtype=torch.long).to(dev)
        return counter_sample(rows, rows.argmax(dim=-1), cfg.to(dev), ints[:, 0], ints[:, 1],
                              **ways_needed(settings)).tolist()

    def warm_counter_draw(self) -> None:
        """Compile the eager draw of a prompt's first sampled token now (_counter_rows: Triton compiles a kernel
        at its first launch, and these launches are not the captured graphs'): on the H200 the first sampled
        request after a start waited 2.5 s for it, and every stream with it (docs/benchmarks.md). One row of
        each way alone, as each runs its own kernels."""
        V = self.args.vocab_size
        for kind in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=1),
                     SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0, top_k=max(1, V - 1))):
            self._counter_draw(torch.zeros(1, V, device=self.device), [kind], [[0, 0]])

    def _generator(self, seq: Sequence):
        if seq.seq_id not in self.generators:
            self.generators[seq.seq_id] = make_generator(seq.params, self.device, self._seed + seq.seq_id)
        return self.generators[seq.seq_id]

    def release(self, seq: Sequence) -> None:
        """Forget a finished sequence's random stream (and its saliency)."""
        self.generators.pop(seq.seq_id, None)
        if self.router is not None:
            self.router.forget(seq.seq_id)

    def prepare(self, batch: list[tuple[Sequence, int]], keys: bool = True):
        """Flat input ids and positions, and the step's attention metadata, on the device. keys=False: the
        cache slots the new tokens are written to and the logits' rows only, no key slots or mask (the
        token router's step, whose attention reads each sequence's keys through router.begin_step's plan:
        a 3,840-token prompt's mask alone is 15 MB made on the host and copied)."""
        bs, B = self.block_size, len(batch)
        starts = [seq.num_computed_tokens for seq, _ in batch]
        counts = [n for _, n in batch]
        Q = max(counts)
        ids, pos, q_dest = [], [], []
        for b, ((seq, n), start) in enumerate(zip(batch, starts)):
            ids += seq.token_ids[start:start + n]
            pos += range(start, start + n)
            q_dest += range(b * Q, b * Q + n)
        max_blocks = max(-(-(s + n) // bs) for s, n in zip(starts, counts))
        tables = block_tables([seq for seq, _ in batch], B, max_blocks)
        positions = torch.tensor(pos, dtype=torch.long)
        flat_tables = tables.view(-1)
        slot_mapping = flat_tables[(positions // bs) + _row_offsets(counts, max_blocks)] * bs + positions % bs
        last = torch.tensor(counts).cumsum(0) - 1
        dev = self.device
        if not keys:
            return (torch.tensor(ids, dtype=torch.long).to(dev), positions.to(dev),
                    StepBatch(slot_mapping=slot_mapping.to(dev), q_dest=None, kv_slots=None, attn_mask=None, num_seqs=B,
                              max_q=Q, logits_index=last.to(dev)))
        if self.paged_prefill:  # attention reads the cache through the block tables: no gather, no mask
            seqs = torch.tensor([(int(e) - n + 1, n, s) for e, n, s in zip(last, counts, starts)], dtype=torch.int32)
            step = StepBatch(slot_mapping=slot_mapping.to(dev), q_dest=None, kv_slots=None, attn_mask=None,
                             num_seqs=B, max_q=Q, logits_index=last.to(dev), seqs=seqs.to(dev),
                             tables=tables.to(torch.int32).to(dev), block_size=bs)
            return torch.tensor(ids, dtype=torch.long).to(dev), positions.to(dev), step
        kv_slots = key_slots(tables, bs)
        key_pos = torch.arange(max_blocks * bs)
        q_pos = torch.tensor(starts)[:, None] + torch.arange(Q)  # [B, Q]
        ctx = torch.tensor([s + n for s, n in zip(starts, counts)])
        mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < ctx[:, None, None])
        step = StepBatch(
            slot_mapping=slot_mapping.to(dev), q_dest=torch.tensor(q_dest, dtype=torch.long).to(dev),
            kv_slots=kv_slots.to(dev), attn_mask=mask[:, None].to(dev), num_seqs=B, max_q=Q,
            logits_index=last.to(dev), dense=all(n == Q for n in counts))
        return torch.tensor(ids, dtype=torch.long).to(dev), positions.to(dev), step


def _finishing(batch) -> tuple[list[int], bool]:
    """(the rows of batch whose prompt this step finishes, whether all of those sample greedily)."""
    done = [i for i, (seq, n) in enumerate(batch) if seq.num_computed_tokens + n == len(seq)]
    return done, all(batch[i][0].params.greedy for i in done)


def _nothing() -> None:
    """No restored blocks to wait for."""


def block_tables(seqs, num_rows: int, num_blocks: int) -> torch.Tensor:
    """[num_rows, num_blocks] block ids of each sequence's first blocks (padding rows and tails: 0)."""
    tables = torch.zeros(num_rows, num_blocks, dtype=torch.long)
    for b, seq in enumerate(seqs):
        row = seq.block_table[:num_blocks]
        tables[b, :len(row)] = torch.tensor(row, dtype=torch.long)
    return tables


def key_slots(tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[rows, blocks] block ids -> [rows, blocks * block_size] cache slot of every key position."""
    rows, blocks = tables.shape
    return (tables[:, :, None] * block_size + torch.arange(block_size)).view(rows, blocks * block_size)


def _row_offsets(counts: list[int], row_len: int) -> torch.Tensor:
    """For each flat token, the offset of its sequence's row in the flattened block-table matrix."""
    return torch.repeat_interleave(torch.arange(len(counts)) * row_len, torch.tensor(counts))
