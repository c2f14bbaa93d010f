"""Host-to-device staging (specdec/staging.py): the packed copy a step's index tensors take, and the
runner's batches built on it."""
from __future__ import annotations

import pytest
import torch

from specdec.staging import PACK_ALIGN, PackedBuffer, current_stream, pack_to_device
from tests.helpers.op_sets import STEPS, new_runner, tiny_config
from specdec.models.loader import build_model, init_random

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_pack_round_trips_values_dtypes_and_alignment(device):
    arrays = [([1, -2, 2**40], torch.int64), ([7], torch.int32), ([], torch.int64),
              ([3, 4, 5, 6, 7], torch.int32), ([-(2**31), 2**31 - 1], torch.int32), ([9], torch.int64)]
    out = pack_to_device(arrays, device)
    assert len(out) == len(arrays)
    base = out[0].data_ptr()
    for t, (values, dtype) in zip(out, arrays):
        assert t.device.type == device and t.dtype == dtype and t.dim() == 1
        assert t.tolist() == values
        assert (t.data_ptr() - base) % PACK_ALIGN == 0      # every view where an allocation would start
    if device == "cuda":
        assert all(t.data_ptr() % PACK_ALIGN == 0 for t in out)


def test_pack_rejects_other_dtypes_and_handles_nothing():
    with pytest.raises(ValueError, match="float16"):
        pack_to_device([([1.0], torch.float16)], "cpu")
    empty = pack_to_device([([], torch.int64), ([], torch.int32)], "cpu")
    # float32 and bool (the graphed sampler's parameters and flags) come back as given
    f, b, i = pack_to_device([([0.8, 1.0, 2.5e-3], torch.float32), ([True, False, True], torch.bool),
                              ([-7], torch.int64)], "cpu")
    assert f.tolist() == torch.tensor([0.8, 1.0, 2.5e-3]).tolist() and b.tolist() == [True, False, True]
    assert i.tolist() == [-7] and (f.dtype, b.dtype) == (torch.float32, torch.bool)
    assert [t.numel() for t in empty] == [0, 0] and [t.dtype for t in empty] == [torch.int64, torch.int32]


@pytest.mark.gpu
def test_pack_is_one_copy_without_a_host_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = pack_to_device([(list(range(100)), torch.int64), (list(range(33)), torch.int32)], "cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out[0].untyped_storage().data_ptr() == out[1].untyped_storage().data_ptr()
    assert out[1].tolist() == list(range(33))


def test_runner_batches_are_views_of_one_buffer_with_the_right_contents():
    runner = new_runner(init_random(build_model(tiny_config(), torch.float32, "cpu")), torch.float32)
    for s in ("a", "b"):
        runner.add_sequence(s)
    batch = runner.prepare(STEPS[0])        # "a": 5 prompt tokens, "b": 11 tokens, 3 logits
    tensors = [batch.input_ids, batch.positions, batch.slot_mapping, batch.query_start_loc,
               batch.context_lens, batch.block_tables, batch.logits_indices]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 5] + list(range(7, 18))
    assert batch.positions.tolist() == list(range(5)) + list(range(11))
    assert batch.query_start_loc.tolist() == [0, 5, 16] and batch.context_lens.tolist() == [5, 11]
    assert batch.logits_indices.tolist() == [4, 13, 14, 15]
    assert batch.block_tables.shape == (2, 3) and batch.block_tables[0, 2].item() == 0  # padded row
    assert batch.slot_mapping.tolist() == [
        runner.blocks.block_table(s)[i // 4] * 4 + i % 4 for s, n in (("a", 5), ("b", 11)) for i in range(n)]


@pytest.mark.parametrize("device", DEVICES)
def test_packed_buffer_keeps_its_views_and_refills_them_in_place(device):
    """A CUDA graph's static inputs: fixed views (the same pointers every step), laid out as
    pack_to_device lays out the same lengths, refilled by fill() with one copy."""
    layout = [(3, torch.int64), (2, torch.int32), (5, torch.int32), (1, torch.int64)]
    with torch.inference_mode():  # as graph capture makes it; filled outside inference mode
        buf = PackedBuffer(layout, device)
    ptrs = [v.data_ptr() for v in buf.views]
    first = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [2**40]]
    second = [[-1, 0, 1], [9, 9], [0, 0, 0, 0, -3], [7]]
    for arrays in (first, second):
        out = buf.fill(arrays)
        assert [v.data_ptr() for v in out] == ptrs
        assert [v.tolist() for v in out] == arrays and [v.dtype for v in out] == [d for _, d in layout]
    reference = pack_to_device([(a, d) for a, (_, d) in zip(first, layout)], device)
    assert [r.data_ptr() - reference[0].data_ptr() for r in reference] == [p - ptrs[0] for p in ptrs]
    with pytest.raises(ValueError, match="lengths"):
        buf.fill([[1, 2], [4, 5], [6, 7, 8, 9, 10], [1]])


@pytest.mark.parametrize("device", DEVICES)
def test_packed_buffer_pads_short_arrays_and_rows_with_each_slots_pad(device):
    """fill(pads=...): a shorter array is padded with its slot's pad; Rows are written row-major at
    their width, each row and the rows past the last padded; what an earlier fill left is gone."""
    from specdec.staging import Rows
    layout = [(4, torch.int64), (3, torch.int32), (2 * 3, torch.int32), (2, torch.float32)]
    buf = PackedBuffer(layout, device)
    buf.fill([[9] * 4, [9] * 3, [9] * 6, [9.0, 9.0]])
    out = buf.fill([[5], [1, 2], Rows([[7, 8]], 3), [0.5, 0.25]], pads=(-1, 4, 0, None))
    assert [v.tolist() for v in out] == [[5, -1, -1, -1], [1, 2, 4], [7, 8, 0, 0, 0, 0], [0.5, 0.25]]
    out = buf.fill([[], [3, 3, 3], Rows([[1], [2, 3, 4]], 3), [1.0, 2.0]], pads=(0, 0, -2, None))
    assert [v.tolist() for v in out] == [[0, 0, 0, 0], [3, 3, 3], [1, -2, -2, 2, 3, 4], [1.0, 2.0]]
    with pytest.raises(ValueError, match="lengths"):     # too long, pad or not
        buf.fill([[1] * 5, [1], [], [1.0, 1.0]], pads=(0, 0, 0, None))
    with pytest.raises(ValueError, match="lengths"):     # short where the slot has no pad
        buf.fill([[1] * 4, [1] * 3, [0] * 6, [1.0]], pads=(0, 0, 0, None))
    with pytest.raises(ValueError, match="lengths"):     # short without pads at all
        buf.fill([[1] * 4, [1] * 3, [0] * 5, [1.0, 1.0]])
    with pytest.raises(ValueError, match="width"):
        buf.fill([[1] * 4, [1] * 3, Rows([[1, 2, 3, 4]], 3), [1.0, 1.0]], pads=(0, 0, 0, None))


@pytest.mark.parametrize("device", DEVICES)
def test_packed_buffer_put_rewrites_one_slots_head_and_nothing_else(device):
    """put(slot, values): the slot's first len(values) entries change, the rest of the slot and
    every other slot keep what the last fill wrote, also when the ring's next host buffer holds an
    older fill's bytes; the views stay where they were."""
    layout = [(4, torch.int64), (3, torch.int32), (2, torch.int64)]
    buf = PackedBuffer(layout, device)
    ptrs = [v.data_ptr() for v in buf.views]
    buf.ring.limit = 2
    buf.fill([[1, 2, 3, 4], [5, 6, 7], [8, 9]])
    buf.fill([[10, 20, 30, 40], [50, 60, 70], [80, 90]])   # the last fill
    view = buf.put(0, [-7, 2**40])
    assert view.data_ptr() == ptrs[0]
    assert [v.tolist() for v in buf.views] == [[-7, 2**40, 30, 40], [50, 60, 70], [80, 90]]
    buf.put(1, [11, 12, 13])
    buf.put(2, [])
    assert [v.tolist() for v in buf.views] == [[-7, 2**40, 30, 40], [11, 12, 13], [80, 90]]
    assert [v.data_ptr() for v in buf.views] == ptrs
    with pytest.raises(ValueError, match="put"):
        buf.put(2, [1, 2, 3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `make test-gpu` on the device machine)")
def test_current_stream_follows_the_stream_context():
    """The cached lookup gives what torch.cuda.current_stream gives, for 'cuda' and 'cuda:0',
    inside a side stream's context and after it."""
    side = torch.cuda.Stream()
    for device in (torch.device("cuda"), torch.device("cuda", torch.cuda.current_device())):
        assert current_stream(device) == torch.cuda.current_stream()
        with torch.cuda.stream(side):
            assert current_stream(device) == side
        assert current_stream(device) == torch.cuda.current_stream() != side


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `make test-gpu` on the device machine)")
@pytest.mark.parametrize("side", [False, True], ids=["current-stream", "side-stream-after-current"])
def test_packed_buffer_fills_faster_than_the_gpu_copies_them_keep_every_fills_bytes(side):
    """Fills queued behind a long kernel: each copy must read its own fill's host bytes, whether the
    ring grows past the copies still queued or, full, waits for the oldest; also when the fills
    move to another stream than the one the buffer saw last (its event must follow the copy onto
    that stream)."""
    buf = PackedBuffer([(1024, torch.int64)], "cuda")
    buf.fill([[-1] * 1024])                          # seen on the current stream first
    torch.cuda.synchronize()
    buf.ring.limit = 3                               # 7 fills: the ring grows to 3, then waits
    stream = torch.cuda.Stream() if side else torch.cuda.current_stream()
    outs = []
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)                # ~tens of ms of GPU time ahead of the copies
        for i in range(7):
            (v,) = buf.fill([[i] * 1024])
            outs.append(v.clone())                   # queued after fill i's copy, before fill i + 1's
        assert current_stream(buf.buffer.device).cuda_stream == stream.cuda_stream
    torch.cuda.synchronize()
    assert [o.unique().tolist() for o in outs] == [[i] for i in range(len(outs))]
    assert len(buf.ring.hosts) == 3


class _FakeEvent:
    """A copy's completion event: query() is what the test says; synchronize() completes it."""

    def __init__(self):
        self.done, self.recorded, self.waited = False, 0, 0

    def record(self, stream):
        self.done = False
        self.recorded += 1

    def query(self):
        return self.done

    def synchronize(self):
        self.waited += 1
        self.done = True


def test_host_ring_passes_over_busy_buffers_grows_to_its_limit_then_waits_for_the_oldest():
    from specdec.staging import HostRing
    ring = HostRing(8, pinned=False, limit=3)
    assert ring.take() == 0 and ring.take() == 0           # never copied from: free, no growth
    ring.copied(0, _FakeEvent, None)                       # copy 0 queued, not run
    assert ring.take() == 1 and len(ring.hosts) == 2       # grows instead of waiting
    ring.copied(1, _FakeEvent, None)
    ring.events[0].done = True                             # copy 0 ran: buffer 0 is free again
    assert ring.take() == 0 and len(ring.hosts) == 2
    ring.copied(0, _FakeEvent, None)
    assert ring.take() == 2 and len(ring.hosts) == 3       # 0 and 1 busy: the third buffer
    ring.copied(2, _FakeEvent, None)
    waited = [e.waited for e in ring.events]
    j = ring.take()                                        # all busy at the limit: waits for one
    assert len(ring.hosts) == 3 and ring.events[j].waited == waited[j] + 1
    assert sum(e.waited for e in ring.events) == sum(waited) + 1
    assert j == 1                                          # the oldest copy queued (1, then 0, then 2)
    assert [bytes(b) for b in ring.bytes] == [bytes(8)] * 3 and all(not h.is_pinned() for h in ring.hosts)
