import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_the_proto():
    result = subprocess.run([sys.executable, "-m", "protos.codegen", "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _is_field(line: str) -> bool:
    s = line.strip()
    return s.endswith(";") and "=" in s and not s.startswith(("syntax", "package", "option", "//"))


def test_every_proto_field_and_enum_value_is_commented():
    # A field (or enum value) needs a comment above it; a run of consecutive fields may share one.
    lines = (ROOT / "protos" / "specdec.proto").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        if not _is_field(line):
            continue
        j = i - 1
        while j >= 0 and _is_field(lines[j]):
            j -= 1
        if not lines[j].strip().startswith("//"):
            undocumented.append(line.strip())
    assert not undocumented, undocumented


def test_step_timing_reaches_the_proto_field_by_field():
    """timing_to_pb copies StepTiming's fields one by one (no asdict): a field added to either side
    must be added there too, which this notices."""
    import dataclasses

    from protos import specdec_pb2 as pb
    from specdec.engine.types import StepTiming
    from specdec.serving.convert import timing_to_pb
    names = [f.name for f in dataclasses.fields(StepTiming)]
    assert sorted(names) == sorted(f.name for f in pb.StepTiming.DESCRIPTOR.fields)
    values = {n: (i + 1 if isinstance(getattr(StepTiming(), n), int) else 0.5 * (i + 1))
              for i, n in enumerate(names)}
    msg = timing_to_pb(StepTiming(**values))
    assert {n: getattr(msg, n) for n in names} == values


def test_token_ids_pack_as_little_endian_int32_at_every_size():
    """pack_ids / unpack_ids: the wire's int32 little-endian ids (struct for a step's few ids,
    numpy past 1024 on unpack), the same bytes as numpy's '<i4' for every size; an id outside
    int32 is an OverflowError, never wrapped; a length that is no multiple of 4 is a WireError."""
    import numpy as np
    import pytest
    from protos.wire import WireError, pack_ids, unpack_ids
    for n in (0, 1, 5, 1024, 1025, 3000):
        ids = [(-1) ** i * (i * 7919 % 2**31) for i in range(n)]
        data = pack_ids(ids)
        assert data == np.asarray(ids, dtype="<i4").tobytes()
        assert unpack_ids(data) == ids
    assert pack_ids(np.arange(3)) == pack_ids([0, 1, 2])
    for bad in (2**31, -2**31 - 1):
        with pytest.raises(OverflowError):
            pack_ids([1, bad])
    with pytest.raises(WireError, match="^new_tokens: 5 bytes"):
        unpack_ids(b"\0" * 5, "new_tokens")


def test_sampling_conversion_is_cached_only_for_valid_values():
    """convert.sampling_from_pb keeps validated SamplingParams by their wire values: equal messages
    give the same (frozen) object, any differing field another; invalid values raise every time
    and are never kept; the cache empties when full."""
    import pytest
    from protos import specdec_pb2 as pb
    from specdec.sampling.params import SamplingParams, SamplingParamsError
    from specdec.serving import convert

    convert._SAMPLING.clear()
    a = convert.sampling_from_pb(pb.SamplingParams(temperature=0.5, top_k=5, seed=3))
    assert a == SamplingParams(0.5, 5, 1.0, 0.0, 3) and not a.greedy
    assert convert.sampling_from_pb(pb.SamplingParams(temperature=0.5, top_k=5, seed=3)) is a
    others = [pb.SamplingParams(temperature=0.5, top_k=5, seed=4), pb.SamplingParams(temperature=0.5, top_k=5),
              pb.SamplingParams(temperature=0.5, top_k=6, seed=3), pb.SamplingParams(top_k=5, seed=3)]
    got = [convert.sampling_from_pb(m) for m in others]
    assert all(g is not a for g in got) and got[1].seed is None and got[3].greedy
    for bad in (pb.SamplingParams(temperature=-1.0), pb.SamplingParams(top_p=1.5),
                pb.SamplingParams(temperature=float("nan"))):
        for _ in range(2):
            with pytest.raises(SamplingParamsError):
                convert.sampling_from_pb(bad)
    assert all(p.temperature >= 0 and p.top_p <= 1 for p in convert._SAMPLING.values())
    assert len(convert._SAMPLING) == 5
    for seed in range(convert._SAMPLING_MAX + 10):
        convert.sampling_from_pb(pb.SamplingParams(seed=seed))
    assert len(convert._SAMPLING) <= convert._SAMPLING_MAX


def test_outside_vocab_names_the_first_id_out_of_range():
    """The one range check of token ids (coordinator validation and proposals, the engines)."""
    from protos.wire import outside_vocab
    assert outside_vocab([], 10) is None and outside_vocab([0, 9, 3], 10) is None
    assert outside_vocab([3, 10, -1], 10) == 10 and outside_vocab([3, -1, 10], 10) == -1
    assert outside_vocab(list(range(5000)) + [-7, 5000], 5000) == -7
