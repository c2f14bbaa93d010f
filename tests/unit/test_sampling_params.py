"""SamplingParams validation (errors name the field), counters."""
from __future__ import annotations

import pytest
import torch

from specdec.sampling.counters import SpecCounters
from specdec.sampling.params import SamplingParams, SamplingParamsError
from specdec.sampling.rejection import HostSpecOutput, SpecOutput


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature="hot"), "temperature"), (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(top_k=True), "top_k"), (dict(top_p=1.5), "top_p"), (dict(top_p=-0.1), "top_p"),
    (dict(min_p=2.0), "min_p"), (dict(seed=-1), "seed"), (dict(seed=2**64), "seed"),
    (dict(seed=1.0), "seed"),
])
def test_invalid_field_is_named(kwargs, field):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert str(err.value).startswith(f"{field}: ")
    assert isinstance(err.value, ValueError)


def test_message_format():
    with pytest.raises(SamplingParamsError, match=r"^temperature: must be a finite number >= 0, got -1$"):
        SamplingParams(temperature=-1)


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert p.greedy and p.top_k == 0 and p.top_p == 1.0 and p.seed is None
    assert not SamplingParams(temperature=0.5).greedy
    assert SamplingParams(top_p=0).top_p == 1.0           # proto3 default 0 means off
    s = SamplingParams(top_k=3, temperature=1)
    assert isinstance(s.temperature, float)
    assert hash(s) == hash(SamplingParams(top_k=3, temperature=1.0))
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    for tiny in (1e-45, 1e-38, 9.9e-6):  # below GREEDY_BELOW_TEMPERATURE: greedy (logits / T overflows)
        assert SamplingParams(temperature=tiny).greedy and SamplingParams(temperature=tiny).temperature == 0.0
    assert not SamplingParams(temperature=1e-5).greedy


def test_counters_one_step():
    out = SpecOutput(accepted=torch.tensor([2, 0, 0]), tokens=torch.tensor([[5, 6, 7], [1, -1, -1], [4, -1, -1]]),
                     num_emitted=torch.tensor([3, 1, 1]))
    c = SpecCounters()
    host = c.update(out, [3, 2, 0])
    assert host.tokens == [[5, 6, 7], [1], [4]]
    assert (c.drafted, c.accepted, c.emitted, c.steps) == (5, 2, 5, 3)
    assert c.accepted_per_position == [1, 1, 0] and c.drafted_per_position == [2, 2, 1]
    assert c.acceptance_rate == pytest.approx(0.4) and c.mean_emitted == pytest.approx(5 / 3)
    c.update(HostSpecOutput([1, 0, 1], [2, 1, 2], [[1, 2], [3], [4, 5]]), [1, 1, 1])
    assert (c.drafted, c.accepted, c.emitted) == (8, 4, 10)
    assert c.accepted_per_position == [3, 1, 0] and c.drafted_per_position == [5, 2, 1]
    with pytest.raises(ValueError, match="num_draft"):
        c.update(out, [1])
