"""Decode steps replayed from CUDA graphs: one launch of a recorded step instead of hundreds
of kernel launches from Python (a small model's decode step on a GPU is launch-bound).

A graph is recorded per batch-size bucket (1, 2, 4, 8, 16, 24, 32, ... up to
`cuda_graph_max_bs`) and per LoRA mode, and replayed for any decode step of that many sequences
or fewer (padded up to the bucket). Everything a step varies is a *graph input*, a static
tensor rewritten before each replay: token ids, positions, the attention metadata (cache
slots, block tables) and the LoRA metadata (segments, slots, ranks, parts). So a new mix of
adapters, or a slot rewritten with another adapter, needs no recapture: the kernels were
recorded with the widest grids and skip what a step does not use.

LoRA mode is part of the key: a graph recorded for a base-only batch has no LoRA kernels in it
and is never replayed for a batch with an adapter token (SGLang #32703 did exactly that); a
batch with one replays the graph recorded with the LoRA hook, whose unused segments are empty.

A step's inputs are filled in host memory (pinned) and moved in two copies: every small
tensor in one, and of the block tables only the rows and columns this step uses (the kernel
never reads a table entry past a sequence's context, so older columns may stay).

Padding rows compute garbage that nothing reads: they attend to nothing and write their K/V
to a scratch cache slot that no block owns (the runner allocates one block more than the KV
manager hands out). A graph holds the addresses of the KV cache and the slot pool; if the pool
is reallocated (it grows only in unified CPU memory, where no graph runs) the graphs are
dropped and recorded again.

`ReplayEmulator` stands in for torch.cuda.CUDAGraph on a CPU, so the CPU suite tests all of
this: it records the step's ops at capture and checks that every replay runs the same ops on
the same shapes, and refuses what a real capture cannot contain (reading a value back to
the host, tensors made from host data).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from loraserve.model.attention import AttentionSeq

log = logging.getLogger(__name__)


def buckets(max_bs: int) -> tuple[int, ...]:
    """Batch sizes with a graph: powers of two to 16, then every 8 (vLLM's and SGLang's
    spacing), and max_bs itself."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 8)) + [max_bs]
    return tuple(sorted(set(sizes)))


class Graph(Protocol):
    def capture(self, step: Callable[[], None]) -> None: ...

    def replay(self) -> None: ...


class CudaGraph:
    """torch.cuda.CUDAGraph: warm-up runs on a side stream (Triton compiles, the allocator
    settles), then capture into `pool`, the memory pool every graph of one engine shares."""

    def __init__(self, pool) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self.replays = 0

    @staticmethod
    def maker() -> Callable[[], CudaGraph]:
        """Makes the graphs of one engine, on a memory pool of their own: with one pool for the
        whole process, a second engine's capture breaks the caching allocator's count of the
        pool's users."""
        pool = torch.cuda.graph_pool_handle()
        return lambda: CudaGraph(pool)

    def capture(self, step: Callable[[], None]) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        # thread_local: disk-load workers may pin host memory while a graph is recorded (a
        # moved slot pool is recorded again mid-serving); only this thread's calls must not
        # break the capture
        with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
            step()

    def replay(self) -> None:
        self.graph.replay()
        self.replays += 1


class _OpTrace(TorchDispatchMode):
    """Records (op, input shapes) of every aten op; refuses ops a CUDA graph cannot hold."""

    FORBIDDEN = {"aten::_local_scalar_dense": "reads a value back to the host (.item())",
                 "aten::nonzero": "has a shape that depends on the data",
                 "aten::masked_select": "has a shape that depends on the data",
                 "aten::lift_fresh": "makes a tensor from host data (a copy to the GPU)"}

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in self.FORBIDDEN:
            raise RuntimeError(f"{name} in a captured step: it {self.FORBIDDEN[name]}")
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        self.ops.append((name, shapes))
        return func(*args, **(kwargs or {}))


class ReplayEmulator:
    """A CUDA graph's contract, checked on a CPU: capture runs the step once and records its
    ops; replay runs it again and fails unless it ran the same ops on the same shapes. The step
    sees a new batch only through the static tensors it closed over, as a graph's kernels do."""

    def __init__(self) -> None:
        self.step: Callable[[], None] | None = None
        self.ops: list[tuple[str, tuple]] = []
        self.replays = 0

    def capture(self, step: Callable[[], None]) -> None:
        with _OpTrace() as trace:
            step()
        self.step, self.ops = step, trace.ops

    def replay(self) -> None:
        with _OpTrace() as trace:
            self.step()
        if trace.ops != self.ops:
            pairs = zip(trace.ops, self.ops, strict=False)  # lengths may differ
            diff = next((i for i, (a, b) in enumerate(pairs) if a != b),
                        min(len(trace.ops), len(self.ops)))
            raise RuntimeError(f"replay ran other ops than the capture, from op {diff}")
        self.replays += 1


class DecodeGraphs:
    """Records and replays decode steps; `runner.execute` asks `fits` and then `run`."""

    def __init__(self, model, kv_caches, attention, lora, max_bs: int, max_blocks: int,
                 scratch_slot: int, new_graph: Callable[[], Graph] | None = None) -> None:
        for what, obj, needs in (("attention", attention, "graph_metadata"),
                                 ("LoRA", lora, "graph_plan")):
            if not hasattr(obj, needs):
                raise ValueError(f"CUDA graphs need the triton {what} backend, not "
                                 f"{getattr(obj, 'name', type(obj).__name__)}")
        self.model, self.kv_caches, self.attention, self.lora = model, kv_caches, attention, lora
        self.sizes = buckets(max_bs)
        self.max_bs, self.scratch_slot = max_bs, scratch_slot
        self.new_graph = new_graph if new_graph is not None else CudaGraph.maker()
        dev = kv_caches[0][0].device
        self.rows = torch.arange(max_bs, device=dev)
        # Every graph input is carved out of one device buffer (the block tables, wide and
        # mostly unused, out of one of their own), each with its twin in one host buffer,
        # pinned on a GPU: a step fills the host side and moves it in two copies.
        self.device_inputs = _StaticInputs(self._inputs, max_blocks, dev, pin=False)
        self.host_inputs = _StaticInputs(self._inputs, max_blocks, torch.device("cpu"),
                                         pin=dev.type == "cuda")
        self._copied = torch.cuda.Event() if dev.type == "cuda" else None
        self.ids, self.pos, self.meta, self.plan = self.device_inputs.tensors
        self.logits: torch.Tensor | None = None  # [max_bs, V], made by the first capture
        self.graphs: dict[tuple[int, bool], Graph] = {}
        self.captures = 0
        self._addresses = self._weights_addresses()

    def _inputs(self, take, take_table, max_blocks: int):
        """ids, positions, attention metadata and LoRA plan, made by `take` (the block table
        by `take_table`)."""
        return (take(self.max_bs), take(self.max_bs),
                self.attention.graph_metadata(self.max_bs, max_blocks, take, take_table),
                self.lora.graph_plan(self.max_bs, take))

    def _weights_addresses(self) -> tuple[int, ...]:
        pool = self.lora.weights
        return (pool.A[0]["qkv"].data_ptr(), pool.B[0]["qkv"].data_ptr(),
                pool.A[-1]["down"].data_ptr(), self.kv_caches[0][0].data_ptr())

    def fits(self, seqs: Sequence[AttentionSeq], num_sampling: int) -> bool:
        """A pure decode step (one token per sequence, each sampling) of a size with a graph."""
        return (0 < len(seqs) <= self.max_bs and num_sampling == len(seqs)
                and all(s.num_new == 1 for s in seqs))

    def bucket(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def capture_all(self) -> None:
        """Record every bucket in both LoRA modes (at start-up, before serving)."""
        for b in reversed(self.sizes):  # largest first: smaller ones reuse its pool memory
            for with_lora in (False, True):
                self._capture(b, with_lora)

    def _capture(self, b: int, with_lora: bool) -> Graph:
        # padding everywhere while recording: no real cache slot or LoRA row is touched
        meta = self.attention.graph_metadata_view(self.meta, b)
        self.attention.fill_graph_metadata(meta, [], self.scratch_slot)
        plan = self.lora.graph_plan_view(self.plan, b) if with_lora else None
        if plan is not None:
            self.lora.fill_graph_plan(plan, [])
        hook = self.lora.step(plan)
        if self.logits is None:
            self.logits = torch.zeros(self.max_bs, self.model.lm_head.out_features,
                                      dtype=self.model.embed.dtype, device=self.ids.device)
        ids, pos, rows, out = self.ids[:b], self.pos[:b], self.rows[:b], self.logits[:b]

        def step() -> None:
            with torch.inference_mode():
                out.copy_(self.model.forward(ids, pos, self.kv_caches, self.attention, meta,
                                             rows, hook))

        graph = self.new_graph()
        graph.capture(step)
        self.graphs[(b, with_lora)] = graph
        self.captures += 1
        return graph

    def run(self, ids: list[int], pos: list[int], seqs: Sequence[AttentionSeq],
            seq_slots: Sequence[tuple[int, int]]) -> torch.Tensor:
        """Logits [n, V] of a decode step that `fits`, from the replay of its bucket's graph."""
        if self._weights_addresses() != self._addresses:  # the pool or cache was reallocated
            log.info("LoRA slot pool or KV cache moved: recording the decode graphs again")
            self.graphs.clear()
            self._addresses = self._weights_addresses()
        n = len(seqs)
        b = self.bucket(n)
        with_lora = any(slot >= 0 for slot, _ in seq_slots)
        graph = self.graphs.get((b, with_lora)) or self._capture(b, with_lora)
        if self._copied is not None:  # the last step's copies have read the host buffer
            self._copied.synchronize()
        h_ids, h_pos, h_meta, h_plan = self.host_inputs.tensors
        pad = b - n
        h_ids[:b] = torch.tensor(ids + [0] * pad)
        h_pos[:b] = torch.tensor(pos + [0] * pad)
        used = self.attention.fill_graph_metadata(
            self.attention.graph_metadata_view(h_meta, b), seqs, self.scratch_slot)
        if with_lora:
            self.lora.fill_graph_plan(self.lora.graph_plan_view(h_plan, b), seq_slots)
        self.device_inputs.copy_from(self.host_inputs, b, used)
        if self._copied is not None:
            self._copied.record()
        graph.replay()
        return self.logits[:n]


class _StaticInputs:
    """A decode graph's int64 inputs as views of two buffers on device `on`: `flat` for every
    small tensor, `tables` for the block tables [max_bs, max_blocks]."""

    def __init__(self, make, max_blocks: int, on: torch.device, pin: bool) -> None:
        shapes: dict[str, list[tuple[int, ...]]] = {"flat": [], "table": []}

        def counter(kind: str):  # a first pass with meta tensors: how much each buffer holds
            def count(*shape):
                shapes[kind].append(shape)
                return torch.empty(shape, dtype=torch.int64, device="meta")
            return count

        make(counter("flat"), counter("table"), max_blocks)
        kw = dict(dtype=torch.int64, device=on, pin_memory=pin)
        self.flat = torch.zeros(sum(math.prod(sh) for sh in shapes["flat"]), **kw)
        self.tables = torch.zeros(shapes["table"][0], **kw)
        used = [0]

        def take(*shape):
            view = self.flat[used[0] : used[0] + math.prod(shape)].view(shape)
            used[0] += math.prod(shape)
            return view

        self.tensors = make(take, lambda *shape: self.tables, max_blocks)

    def copy_from(self, src: _StaticInputs, rows: int, cols: int) -> None:
        """Everything but the block tables, then the tables' first rows and columns (the
        columns past them are never read: the module docstring)."""
        self.flat.copy_(src.flat, non_blocking=True)
        self.tables[:rows, :cols].copy_(src.tables[:rows, :cols], non_blocking=True)
