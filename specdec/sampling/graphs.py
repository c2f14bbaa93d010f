"""The draft's sampling (draft_sample) on CUDA graphs.

In torch, a sampled draft position is one forward and then ~60 small tensor ops: temperature, top-k / top-p
(a sort of the vocabulary), softmax, min-p, rounding to the transport dtype, the counter-based
uniforms (about thirty integer ops) and the inverse-CDF draw. Launched one by one they cost far
more host time than the GPU spends on them: on the H200 host the 7B / 68m pair's draft spent 7.3 ms
of host time per 4-token sampled step against 1.3 ms of forwards
(bench/results/e2e_sampled_before_sampler_graphs.json).
A replay launches them all at once.

One graph per batch bucket b and filter set: the rows' parameters and uniforms are static inputs
written by one host-to-device copy (a PackedBuffer), the logits are copied into a static [b, V]
buffer, and the graph writes the drawn tokens and the rounded weights q (in the transport dtype,
in which they are exact) into row `step` of output buffers shared by all buckets. So a step's
positions stay on the device until the step ends, when they are read in one copy.

The graph runs draft_sample itself, with every filter of its set switched on for every row
(probs.filter_flags: a filter a row does not use leaves its bits unchanged). The uniforms are
computed on the host (rng.uniform_host: the counter-based hash in numpy, the same float64 bits as
the device's ~30 integer kernels per call; a guess row's is its RESAMPLE number, as draft_sample
picks): the same bits as the eager call. On CUDA the body is the fused sampling kernel
(kernels/sampling.py: one program per row picks its own filters and writes row `step` itself), so
one graph per bucket serves every filter mix. Elsewhere (the CPU stand-in graphs of the tests, or
CUDA with the kernel switched off) it is torch's draft_sample, and two filter sets are captured:
with the vocabulary sort (some row uses top-k or top-p) and without it.

Sampled chains (opt-in, EngineConfig.sampled_chains; cuda_graphs.GraphedForward.capture_sampled_chains):
chain_pick(b) gives a chain graph of bucket (b, 1) its sampling step, which draws row `at` of the
same output buffers with the same kernel, from parameters and a table of uniforms (one row per
output row) that stage_chain writes in one copy for a whole chain. So the positions after a
sampled step's first cost one staged copy and one replay each, with no host work in between, and
draw what sample() would have drawn position by position.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.cuda_graphs import GraphCaptures
from specdec.kernels import sampling as fused
from specdec.sampling.draft import draft_sample
from specdec.sampling.params import SamplingParams
from specdec.sampling.probs import SamplingTensors, filter_flags, host_rows, logits_to_probs
from specdec.sampling.rejection import HostSpecOutput, accept_from, check_counts, layout_rows, layout_width
from specdec.sampling.rng import ACCEPT, DRAFT, RESAMPLE, uniform_host
from specdec.staging import PackedBuffer

F32, F64, I64, BOOL = torch.float32, torch.float64, torch.int64, torch.bool


def _param_tensors(v: list[torch.Tensor], sort: bool) -> SamplingTensors:
    """The rows' parameters from a packed buffer's first five views; every filter of the set on
    (seeds are not read: the uniforms come staged, rng.uniform_host)."""
    return SamplingTensors(temperature=v[0], top_p=v[1], min_p=v[2], top_k=v[3], greedy=v[4], seeds=v[3],
                           all_greedy=False, any_top_k=sort, any_top_p=sort, any_min_p=True)


def _padded_params(rows, pad: int) -> list[list]:
    """The rows' temperature, top_p, min_p, top_k and greedy flags (the packed layouts' first five
    segments), each followed by `pad` greedy padding rows of harmless values."""
    return [rows.temperature + [1.0] * pad, rows.top_p + [1.0] * pad, rows.min_p + [0.0] * pad,
            rows.top_k + [0] * pad, rows.greedy + [True] * pad]


@dataclass
class _SamplerGraph:
    graph: object              # torch.cuda.CUDAGraph (tests replay a CPU stand-in); None: statics only
    packed: PackedBuffer       # parameters, uniforms, output row
    logits: torch.Tensor       # [b, V] float32 static input


class _Buckets(GraphCaptures):
    """One graph per batch bucket and filter set: with the sort (some sampled row uses top-k or
    top-p) or without it."""
    batch_sizes: tuple[int, ...]
    graphs: dict   # (batch bucket, with the sort) -> graph

    def _capture_all(self) -> None:
        """Both filter sets of every bucket, largest first (smaller captures reuse the pool); the
        two graphs of a bucket share its static buffers (one graph replays at a time)."""
        pool = self._new_pool()
        self.graphs = {}
        # The fused kernel (CUDA) picks each row's filters itself: one graph per bucket serves all.
        self.filter_sets = (True,) if fused.applies(self.device) else (True, False)
        for b in reversed(self.batch_sizes):
            statics = self._statics(b)
            for sort in self.filter_sets:
                self.graphs[(b, sort)] = self._capture(b, sort, pool, statics)

    def _graph_for(self, n: int, params: Sequence[SamplingParams]):
        b = next(b for b in self.batch_sizes if b >= n)
        flags = filter_flags(params)
        sort = flags["any_top_k"] or flags["any_top_p"] or len(self.filter_sets) == 1
        return self.graphs[(b, sort)], b


class GraphedSampler(_Buckets):
    """draft_sample for up to max(batch_sizes) rows and max_steps positions per step."""

    def __init__(self, vocab_size: int, batch_sizes: Sequence[int], max_steps: int,
                 transport_dtype: torch.dtype, device: torch.device):
        self._check_device(device)
        self.vocab_size, self.max_steps, self.dtype, self.device = vocab_size, max_steps, transport_dtype, device
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        bmax = self.batch_sizes[-1]
        self.tokens = torch.zeros(max_steps, bmax, dtype=I64, device=device)
        self.q = torch.zeros(max_steps, bmax, vocab_size, dtype=transport_dtype, device=device)
        self.replays = 0
        self.chain_buffers: dict[int, PackedBuffer] = {}   # bucket -> a sampled chain's staged inputs
        self._capture_all()

    def _layout(self, b: int) -> list[tuple[int, torch.dtype]]:
        # temperature, top_p, min_p; top_k; greedy; uniforms; the output row
        return [(b, F32)] * 3 + [(b, I64), (b, BOOL), (b, F64), (1, I64)]

    @staticmethod
    def _arrays(rows, u, step: int, pad: int) -> list[list]:
        return _padded_params(rows, pad) + [list(u) + [0.0] * pad, [step]]

    @torch.inference_mode()
    def _statics(self, b: int) -> _SamplerGraph:
        packed = PackedBuffer(self._layout(b), self.device)
        # Capture-time contents: greedy rows of harmless values (the warm-up runs draw from them).
        packed.fill(self._arrays(host_rows([SamplingParams()] * b, [0] * b), [0.0] * b, 0, 0))
        return _SamplerGraph(None, packed, torch.zeros(b, self.vocab_size, dtype=F32, device=self.device))

    @torch.inference_mode()
    def _capture(self, b: int, sort: bool, pool, statics: _SamplerGraph) -> _SamplerGraph:
        packed, logits, v = statics.packed, statics.logits, statics.packed.views
        tensors = _param_tensors(v, sort)
        u, at = v[5], v[6]
        tokens, q = self.tokens[:, :b], self.q[:, :b]
        return _SamplerGraph(self._record(lambda: self._draw(logits, tensors, u, at, q, tokens), pool)[0],
                             packed, logits)

    def _draw(self, logits, tensors: SamplingTensors, u, at, q, tokens) -> None:
        """draft_sample of logits [b, V] with uniforms u [b] into row `at` of q and tokens."""
        if fused.applies(logits.device):   # draft_sample's CUDA kernel, writing row `at` itself
            fused.fused_sample(logits, *tensors.filters(), u, q, tokens, step=at)
            return
        tok, weights = draft_sample(logits, tensors, None, self.dtype, u=u)
        tokens.index_copy_(0, at, tok[None])
        q.index_copy_(0, at, weights.to(self.dtype)[None])

    # --- sampled chains (cuda_graphs.GraphedForward.capture_sampled_chains) ----------------------
    def chain_pick(self, b: int):
        """(pick, tokens) for a sampled chain graph on bucket b: pick(logits [b, V], at) draws row
        `at` of the output buffers with the chain's staged parameters and row `at` of its staged
        uniforms, and returns the drawn tokens [b]; None if b is not a bucket here."""
        if b not in self.batch_sizes:
            return None
        with torch.inference_mode():
            packed = PackedBuffer(self._chain_layout(b), self.device)
            rows = host_rows([SamplingParams()] * b, [0] * b)
            packed.fill(self._chain_arrays(rows, [0.0] * (self.max_steps * b), 0))
        self.chain_buffers[b] = packed
        tensors, u_all = _param_tensors(packed.views, True), packed.views[5].view(self.max_steps, b)
        tokens, q = self.tokens[:, :b], self.q[:, :b]

        def pick(logits, at):
            self._draw(logits, tensors, u_all.index_select(0, at).view(b), at, q, tokens)
            return tokens.index_select(0, at).view(b)
        return pick, tokens

    def _chain_layout(self, b: int) -> list[tuple[int, torch.dtype]]:
        # temperature, top_p, min_p; top_k; greedy; the uniforms of every output row
        return [(b, F32)] * 3 + [(b, I64), (b, BOOL), (self.max_steps * b, F64)]

    @staticmethod
    def _chain_arrays(rows, u: list[float], pad: int) -> list[list]:
        return _padded_params(rows, pad) + [u]

    def chain_bucket(self, rows: int) -> int | None:
        return next((b for b in self.batch_sizes if b >= rows and b in self.chain_buffers), None)

    def stage_chain(self, params: Sequence[SamplingParams], seeds: Sequence[int], positions: Sequence[int],
                    start: int, steps: int) -> None:
        """Stages a sampled chain of `steps` positions for these rows, in one copy: their parameters
        and, for output rows start .. start + steps - 1, the uniforms of positions positions[j] + i
        (i = 0 .. steps - 1; DRAFT draws: a chain never holds an extension's first token, the
        guess). What sample() would stage position by position, so the draws are the same."""
        n = len(params)
        b = self.chain_bucket(n)
        if b is None or not 0 <= start <= self.max_steps - steps or steps < 1 or len(positions) != n:
            raise ValueError(f"sampled chain: {n} rows, {steps} steps from row {start}")
        rows = host_rows(params, seeds)
        u = uniform_host([s for _ in range(steps) for s in rows.seeds],
                         [p + i for i in range(steps) for p in positions], [DRAFT] * (steps * n))
        table = [0.0] * (self.max_steps * b)
        for i in range(steps):
            table[(start + i) * b:(start + i) * b + n] = u[i * n:(i + 1) * n].tolist()
        self.chain_buffers[b].fill(self._chain_arrays(rows, table, b - n))

    def fits(self, rows: int, step: int, vocab_size: int) -> bool:
        return 1 <= rows <= self.batch_sizes[-1] and 0 <= step < self.max_steps and vocab_size == self.vocab_size

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
               positions: Sequence[int], guess: Sequence[bool] | None, step: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """draft_sample(logits [n, V], rows of params/seeds, positions, guess) as (tokens [n] int64,
        q [n, V] in the transport dtype): views of output row `step`, valid until the next
        sample() at that step. The caller checks fits() first."""
        n = logits.shape[0]
        if not self.fits(n, step, logits.shape[1]) or len(params) != n or len(positions) != n:
            raise ValueError(f"sampler: {n} rows of {logits.shape[1]} ids at step {step}, "
                             f"{len(params)} params, {len(positions)} positions")
        g, b = self._graph_for(n, params)
        rows = host_rows(params, seeds)
        purposes = [RESAMPLE if x else DRAFT for x in guess] if guess else [DRAFT] * n
        g.packed.fill(self._arrays(rows, uniform_host(rows.seeds, positions, purposes).tolist(), step, b - n))
        g.logits[:n].copy_(logits)  # padding rows keep stale logits: greedy rows, their draws unused
        g.graph.replay()
        self.replays += 1
        return self.tokens[step, :n], self.q[step, :n]


@dataclass
class _VerifierGraph:
    graph: object
    packed: PackedBuffer       # per-row parameters, draft tokens, layout, uniforms
    logits: torch.Tensor       # [b * (kmax + 1), V] float32 static input: the verify's target rows
    draft_probs: torch.Tensor  # [b * kmax, V] float32 static input
    out: torch.Tensor          # [b, kmax + 3] int64: accepted, emitted, then the tokens


class GraphedVerifier(_Buckets):
    """The target's sampled rejection step (logits_to_probs, then rejection.accept_from) on CUDA
    graphs, for up to max(batch_sizes) sequences of at most kmax drafts each.

    Every step is padded to the bucket's shape: b sequences (padding ones have no drafts and
    greedy rows), kmax + 1 target rows and kmax draft rows per sequence, so one graph per batch
    bucket and filter set serves every mix of draft counts. The host stages, in one copy, the rows'
    sampling parameters, the draft tokens, the row layout (rejection.layout_rows at the bucket's
    kmax) and the ACCEPT / RESAMPLE uniforms of every position a sequence may decide
    (rng.uniform_host); the target logits and the draft weights are copied into static buffers.
    The same arithmetic as the eager rejection_sample, bit for bit: padding is never read into a
    real sequence's result, deterministic drafts become one-hot rows (which the rule treats exactly
    as it treats no rows), and every filter on gives the bits of the filters the rows use."""

    def __init__(self, vocab_size: int, batch_sizes: Sequence[int], kmax: int, device: torch.device):
        if kmax < 1:
            raise ValueError(f"GraphedVerifier: kmax {kmax}; a verify without drafts has nothing to reject")
        self._check_device(device)
        self.vocab_size, self.kmax, self.device = vocab_size, kmax, device
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.replays = 0
        self._capture_all()

    def _layout(self, b: int) -> list[tuple[int, torch.dtype]]:
        r, m, kq = b * (self.kmax + 1), b * self.kmax, self.kmax + 1
        # per target row: temperature, top_p, min_p; top_k; greedy. Draft tokens; layout; uniforms.
        return [(r, F32)] * 3 + [(r, I64), (r, BOOL), (m, I64), (b * layout_width(self.kmax), I64),
                                 (b * kq, F64), (b * kq, F64)]

    def _arrays(self, b: int, rows, drafts: list[int], counts: list[int], u_acc, u_res) -> list[list]:
        r_pad = b * (self.kmax + 1) - len(rows.greedy)
        m_pad = b * self.kmax - len(drafts)
        layout = layout_rows(counts + [0] * (b - len(counts)), self.kmax, b * self.kmax)
        return _padded_params(rows, r_pad) + [drafts + [0] * m_pad, [c for row in layout for c in row],
                                              list(u_acc), list(u_res)]

    @torch.inference_mode()
    def _statics(self, b: int) -> _VerifierGraph:
        kq, v = self.kmax + 1, self.vocab_size
        packed = PackedBuffer(self._layout(b), self.device)
        rows = host_rows([SamplingParams()] * (b * kq), [0] * (b * kq))
        zeros = [0.0] * (b * kq)
        packed.fill(self._arrays(b, rows, [0] * (b * self.kmax), [self.kmax] * b, zeros, zeros))
        draft_probs = torch.zeros(b * self.kmax, v, dtype=F32, device=self.device)
        draft_probs[:, 0] = 1.0   # capture-time rows: one-hot
        return _VerifierGraph(None, packed, torch.zeros(b * kq, v, dtype=F32, device=self.device), draft_probs,
                              torch.zeros(b, self.kmax + 3, dtype=I64, device=self.device))

    @torch.inference_mode()
    def _capture(self, b: int, sort: bool, pool, statics: _VerifierGraph) -> _VerifierGraph:
        kq = self.kmax + 1
        packed, logits, draft_probs, out = statics.packed, statics.logits, statics.draft_probs, statics.out
        t = packed.views
        tensors = _param_tensors(t, sort)
        drafts, layout = t[5], t[6].view(b, layout_width(self.kmax))
        u_acc, u_res = t[7].view(b, kq), t[8].view(b, kq)

        def body():
            p = logits_to_probs(logits, tensors)
            res = accept_from(p, drafts, draft_probs, layout, self.kmax, u_acc, u_res)
            out.copy_(res.packed())

        return _VerifierGraph(self._record(body, pool)[0], packed, logits, draft_probs, out)

    def fits(self, num_seqs: int, kmax: int, vocab_size: int) -> bool:
        return 1 <= num_seqs <= self.batch_sizes[-1] and kmax <= self.kmax and vocab_size == self.vocab_size

    @torch.inference_mode()
    def verify(self, target_logits: torch.Tensor, drafts: Sequence[int], draft_probs: torch.Tensor | None,
               counts: Sequence[int], params: Sequence[SamplingParams], seeds: Sequence[int],
               positions: Sequence[int]) -> HostSpecOutput:
        """rejection_sample(target_logits [sum(k+1), V], drafts, draft_probs [sum k, V] on the
        device or None, counts, per-sequence params / seeds, positions of the first drafts) with
        one staged copy, two device copies, one replay and one copy back. Check fits() first."""
        counts = list(counts)
        n, nseq, m = target_logits.shape[0], len(counts), len(drafts)
        check_counts(counts, n, m)
        if not self.fits(nseq, max(counts), target_logits.shape[1]) or len(params) != nseq:
            raise ValueError(f"verifier: {nseq} sequences with up to {max(counts)} drafts of "
                             f"{target_logits.shape[1]} ids, {len(params)} params")
        g, b = self._graph_for(nseq, params)
        seq_rows = host_rows(params, seeds)
        rows = seq_rows.take([i for i, c in enumerate(counts) for _ in range(c + 1)])   # per target row
        kq = self.kmax + 1
        s = [seq_rows.seeds[i] for i in range(nseq) for _ in range(kq)]
        at = [positions[i] + j for i in range(nseq) for j in range(kq)]
        pad = [0.0] * ((b - nseq) * kq)
        u_acc = uniform_host(s, at, [ACCEPT] * len(s)).tolist() + pad
        u_res = uniform_host(s, at, [RESAMPLE] * len(s)).tolist() + pad
        g.packed.fill(self._arrays(b, rows, list(drafts), counts, u_acc, u_res))
        g.logits[:n].copy_(target_logits)
        if m:
            if draft_probs is None:  # deterministic drafts: one-hot rows, the same outcome as none
                g.draft_probs[:m].zero_()
                g.draft_probs[:m].scatter_(1, g.packed.views[5][:m, None], 1.0)
            else:
                g.draft_probs[:m].copy_(draft_probs)
        g.graph.replay()
        self.replays += 1
        return HostSpecOutput.from_rows(g.out[:nseq].cpu().tolist())
