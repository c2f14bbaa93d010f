"""Which messages create a sequence on an engine: only one with `first`. An unknown seq_id without
it is NOT_FOUND (a restarted server must not silently start the sequence afresh from one token),
alone in its batch; `first` on an id already held drops the old state and starts afresh
(an idempotent resend), and an invalid resend changes nothing. No KV is leaked either way."""
from __future__ import annotations

import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine import Code, DraftEngine, DraftSeqInput, TargetEngine, VerifySeqInput
from tests.helpers.tiny_models import make_pair

PROMPT = [5, 17, 42, 99, 7, 3]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    target_path, draft_path = make_pair(tmp_path_factory.mktemp("pair"))
    cfg = dict(block_size=4, num_blocks=8, warmup_batch_sizes=(1,))
    return (DraftEngine(EngineConfig(model=draft_path, **cfg)),
            TargetEngine(EngineConfig(model=target_path, **cfg)))


def all_free(engine) -> bool:
    return engine.num_free_blocks == engine.runner.blocks.num_blocks and engine.num_sequences() == 0


def test_target_unknown_seq_is_not_found_alone(engines):
    _, target = engines
    solo = target.verify([VerifySeqInput(1, PROMPT, first=True)]).outputs[0]
    target.release([1])
    held = target.verify([VerifySeqInput(2, PROMPT[:-1], first=True)]).outputs[0]
    res = target.verify([VerifySeqInput(2, PROMPT[-1:]),            # held: goes on
                         VerifySeqInput(3, [9]),                     # unknown, no first
                         VerifySeqInput(4, PROMPT, first=True)]).outputs
    assert held.error is None and res[0].error is None and res[2].error is None
    assert res[0].next_token == res[2].next_token == solo.next_token
    assert res[1].error.code == Code.NOT_FOUND and res[1].next_token == -1
    assert "seq_id 3" in res[1].error.message and "first=true" in res[1].error.message
    assert set(target.runner.blocks.seq_ids()) == {2, 4}  # the unknown one holds nothing
    assert target.release([2, 3, 4]) == 2 and all_free(target)


def test_target_first_on_a_held_seq_starts_afresh(engines):
    _, target = engines
    fresh = target.verify([VerifySeqInput(1, PROMPT, first=True)]).outputs[0]
    target.release([1])
    # 7 blocks of 8 held (26 tokens); the resend needs 2: the old blocks count as free.
    target.verify([VerifySeqInput(5, [1] * 26, first=True)])
    assert target.num_free_blocks == 1
    again = target.verify([VerifySeqInput(5, PROMPT, first=True)]).outputs[0]
    assert again.error is None and again.next_token == fresh.next_token
    assert target.runner.num_tokens(5) == len(PROMPT) and target.num_free_blocks == 6
    # An invalid resend fails alone and leaves the held state as it was.
    bad = target.verify([VerifySeqInput(5, [1, target.vocab_size], first=True)]).outputs[0]
    assert bad.error.code == Code.INVALID_ARGUMENT and target.runner.num_tokens(5) == len(PROMPT)
    # Chunked resend: the first chunk carries `first`, the rest find the sequence held.
    target.verify([VerifySeqInput(5, PROMPT[:4], partial_prefill=True, first=True)])
    last = target.verify([VerifySeqInput(5, PROMPT[4:])]).outputs[0]
    assert last.next_token == fresh.next_token and target.runner.num_tokens(5) == len(PROMPT)
    assert target.release([5]) == 1 and all_free(target)


def test_draft_unknown_seq_is_not_found_alone(engines):
    draft, _ = engines
    solo = draft.propose([DraftSeqInput(1, 0, PROMPT, 3, first=True)]).outputs[0]
    draft.release([1])
    held = draft.propose([DraftSeqInput(2, 0, PROMPT, 2, first=True)]).outputs[0]
    res = draft.propose([DraftSeqInput(2, 2, [7], 2),              # held: goes on
                         DraftSeqInput(3, 0, [9], 2),              # unknown, no first
                         DraftSeqInput(4, 0, PROMPT, 3, first=True)]).outputs
    assert held.error is None and res[0].error is None and len(res[0].tokens) == 2
    assert res[2].tokens == solo.tokens
    assert res[1].error.code == Code.NOT_FOUND and "seq_id 3" in res[1].error.message
    assert res[1].tokens == []
    assert set(draft.runner.blocks.seq_ids()) == {2, 4} and set(draft.states) == {2, 4}
    assert draft.release([2, 3, 4]) == 2 and all_free(draft)


def test_draft_first_on_a_held_seq_starts_afresh(engines):
    draft, _ = engines
    fresh = draft.propose([DraftSeqInput(1, 0, PROMPT, 3, first=True)]).outputs[0]
    draft.release([1])
    draft.propose([DraftSeqInput(6, 0, [1] * 24, 3, first=True)])   # 7 blocks of 8
    again = draft.propose([DraftSeqInput(6, 2, PROMPT, 3, first=True)]).outputs[0]  # keep ignored
    assert again.error is None and again.tokens == fresh.tokens
    assert draft.states[6].tokens == PROMPT + fresh.tokens and draft.states[6].base == len(PROMPT)
    bad = draft.propose([DraftSeqInput(6, 0, [], 3, first=True)]).outputs[0]
    assert bad.error.code == Code.INVALID_ARGUMENT and draft.states[6].tokens == PROMPT + fresh.tokens
    assert draft.release([6]) == 1 and all_free(draft)
