import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_the_proto():
    result = subprocess.run([sys.executable, "-m", "protos.codegen", "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_proto_field_and_enum_value_is_commented():
    lines = (ROOT / "protos" / "specdec.proto").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        s = line.strip()
        is_field = s.endswith(";") and "=" in s and not s.startswith(("syntax", "package", "option", "//"))
        if is_field and not lines[i - 1].strip().startswith("//") and not lines[i - 1].strip().endswith(";"):
            undocumented.append(s)
        # consecutive fields sharing one comment are allowed only right after a comment line
        if is_field and lines[i - 1].strip().endswith(";") and not _comment_above(lines, i):
            undocumented.append(s)
    assert not undocumented, undocumented


def _comment_above(lines, i):
    j = i - 1
    while j >= 0 and lines[j].strip().endswith(";"):
        j -= 1
    return lines[j].strip().startswith("//")
