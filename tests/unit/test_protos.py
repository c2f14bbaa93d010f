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
