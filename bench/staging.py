"""Host time of writing one CUDA graph's static inputs (PackedBuffer.fill), by how the bytes reach
the GPU, on the layouts a step stages.

    python3 bench/staging.py [--rounds 20] [--fills 100] [--max-blocks 256]

Side by side in one process, in alternating rounds (medians of the rounds' per-fill means, us):
- per_fill_pin: the path before session 20: the padded arrays packed into a new bytearray, wrapped
  in a tensor, pinned (torch's caching host allocator, a host copy) and copied;
- persistent: specdec.staging.PackedBuffer.fill: the values written into host buffers of the
  layout that live with it (pinned, a ring of them, an event after each copy), short arrays padded
  by slot and block tables written row by row;
and the pieces under both: a `torch.cuda.current_stream` lookup, an event record, one pinned
copy. Layouts: a target verify bucket (b 1 and 8 sequences x 5 tokens), a draft decode bucket
(b 8 x 1), block tables --max-blocks wide (a server's max_model_len / block size). Writes
bench/results/staging.json.
"""
from __future__ import annotations

import argparse
import statistics
import time

from common import environment, table, write_result

import torch  # noqa: E402

from specdec.runner import padded_table  # noqa: E402
from specdec.staging import PackedBuffer, Rows, _pack_host  # noqa: E402

I64, I32 = torch.int64, torch.int32


def step_arrays(b: int, q: int, context: int, block_size: int = 16):
    """One step's host arrays as runner.prepare builds them for b sequences of q new tokens each
    at `context` tokens: ids, positions, slots, starts, context lengths, tables, logit rows."""
    t = b * q
    ids = [1000 + i for i in range(t)]
    positions = [context - q + j for _ in range(b) for j in range(q)]
    blocks = (context + block_size - 1) // block_size
    tables = [list(range(s * blocks, (s + 1) * blocks)) for s in range(b)]
    slots = [tables[s][p // block_size] * block_size + p % block_size
             for s in range(b) for p in range(context - q, context)]
    starts = list(range(0, t + 1, q))
    return ids, positions, slots, starts, [context] * b, tables, list(range(t))


def layout(b: int, q: int, max_blocks: int):
    t = b * q
    return [(t, I64), (t, I64), (t, I64), (b + 1, I32), (b, I32), (b * max_blocks, I32), (t, I64)]


def per_fill_pin(buffer: torch.Tensor, spec, arrays, b: int, q: int, max_blocks: int) -> None:
    """The old PackedBuffer.fill with the old graphs._fill's padding (a bucket the arrays fill)."""
    ids, positions, slots, starts, ctx, tables, rows = arrays
    padded = [ids, positions, slots, starts, ctx, padded_table(tables, max_blocks, b), rows]
    buf, _ = _pack_host([(a, d) for a, (_, d) in zip(padded, spec)])
    host = torch.frombuffer(buf, dtype=torch.uint8)
    buffer[:len(buf)].copy_(host.pin_memory(), non_blocking=True)


def persistent(packed: PackedBuffer, arrays, b: int, q: int, max_blocks: int) -> None:
    ids, positions, slots, starts, ctx, tables, rows = arrays
    packed.fill([ids, positions, slots, starts, ctx, Rows(tables, max_blocks), rows],
                pads=(0, 0, -1, len(ids), q, 0, 0))


def timed(fn, fills: int) -> float:
    t0 = time.perf_counter()
    for _ in range(fills):
        fn()
    return (time.perf_counter() - t0) / fills * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--fills", type=int, default=100)
    p.add_argument("--max-blocks", type=int, default=256)
    p.add_argument("--context", type=int, default=600)
    a = p.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name, b, q in (("verify b1 q5", 1, 5), ("verify b8 q5", 8, 5), ("decode b8 q1", 8, 1)):
        spec = layout(b, q, a.max_blocks)
        arrays = step_arrays(b, q, a.context)
        packed = PackedBuffer(spec, dev)
        old_buffer = torch.zeros_like(packed.buffer)
        # both paths write the same bytes
        persistent(packed, arrays, b, q, a.max_blocks)
        per_fill_pin(old_buffer, spec, arrays, b, q, a.max_blocks)
        torch.cuda.synchronize()
        assert torch.equal(packed.buffer, old_buffer), name
        variants = {
            "per_fill_pin": lambda: per_fill_pin(old_buffer, spec, arrays, b, q, a.max_blocks),
            "persistent": lambda: persistent(packed, arrays, b, q, a.max_blocks),
            "current_stream": lambda: torch.cuda.current_stream(dev),
            "raw_stream": lambda: torch._C._cuda_getCurrentRawStream(dev.index or 0),
            "event_record": lambda: torch.cuda.Event().record(),
            "pinned_copy": lambda: packed.buffer.copy_(packed.ring.hosts[0], non_blocking=True),
        }
        runs: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(a.rounds):
            for k, fn in variants.items():
                runs[k].append(timed(fn, a.fills))
                torch.cuda.synchronize()
        med = {k: statistics.median(v) for k, v in runs.items()}
        rows.append({"layout": name, "bytes": packed.buffer.numel(), **med,
                     "persistent_over_per_fill_pin": med["persistent"] / med["per_fill_pin"]})
    path = write_result("staging", {"benchmark": "staging", "environment": environment(),
                                    "max_blocks": a.max_blocks, "context": a.context, "rounds": a.rounds,
                                    "fills": a.fills, "rows": rows})
    print("host us per fill of a graph's static inputs (median of rounds), and the pieces under them")
    print(table(rows, [("layout", "layout", "s"), ("bytes", "bytes", "d"), ("per_fill_pin", "per-fill pin", ".1f"),
                       ("persistent", "persistent", ".1f"), ("persistent_over_per_fill_pin", "ratio", ".2f"),
                       ("current_stream", "current_stream", ".1f"), ("raw_stream", "raw stream", ".2f"),
                       ("event_record", "event record", ".1f"),
                       ("pinned_copy", "pinned copy", ".1f")]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
