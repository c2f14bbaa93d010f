"""Random weights that agree (models/synthetic.py): the greedy next token of a model is its map
sigma, the maps of two shapes agree exactly where chosen, speculation between such models accepts
at that rate, and the servers' flags reach the engine."""
from __future__ import annotations

import pytest
import torch

from specdec.config import CacheConfig, ConfigError, EngineConfig
from specdec.models.loader import build_model
from specdec.models.synthetic import init_agreeing, next_token_map
from specdec.runner import ModelRunner, SeqInput
from specdec.serving.server import config_from_args
from tests.helpers.op_sets import tiny_config

V = 256


def _model(hidden: int, agreement: float, seed: int):
    cfg = tiny_config(vocab_size=V, hidden_size=hidden, num_heads=4, num_kv_heads=2, head_dim=hidden // 4,
                      intermediate_size=2 * hidden, tie_word_embeddings=False)
    return init_agreeing(build_model(cfg, torch.float32, "cpu"), agreement, seed=seed)


def _runner(model) -> ModelRunner:
    return ModelRunner(model, CacheConfig(num_blocks=V + 8, block_size=16, dtype=torch.float32))


@pytest.mark.parametrize("agreement", [0.0, 0.3, 0.75, 1.0])
def test_maps_are_permutations_that_agree_where_chosen(agreement):
    pi = next_token_map(V, 1.0)
    sigma = next_token_map(V, agreement, seed=5)
    assert torch.equal(sigma.sort().values, torch.arange(V))       # a permutation: the head is well defined
    assert (sigma == pi).sum().item() == round(agreement * V)        # a derangement of the rest
    assert torch.equal(next_token_map(V, agreement, seed=5), sigma)   # reproducible
    assert not torch.equal(next_token_map(V, 0.5, seed=6), next_token_map(V, 0.5, seed=7))


def test_a_single_leftover_token_agrees_and_bad_fractions_are_refused():
    assert torch.equal(next_token_map(V, (V - 1) / V, seed=2), next_token_map(V, 1.0))
    with pytest.raises(ValueError, match="agreement"):
        next_token_map(V, -0.1)


def test_greedy_next_token_is_the_map_after_a_prompt_and_along_a_continuation():
    model = _model(64, 0.6, seed=1)
    sigma = next_token_map(V, 0.6, seed=1)
    runner = _runner(model)
    for v in range(V):
        runner.add_sequence(v)
    top = torch.cat(runner.step([SeqInput(v, [v]) for v in range(V)])).argmax(-1)
    assert torch.equal(top, sigma)
    runner.add_sequence("g")
    tokens = [3, 1, 4, 1, 5]
    logits = runner.step([SeqInput("g", tokens)])[0]
    for _ in range(30):                                   # context grows: attention must not take over
        nxt = int(logits[-1].argmax())
        assert nxt == int(sigma[tokens[-1]])
        tokens.append(nxt)
        logits = runner.step([SeqInput("g", [nxt])])[0]


def test_two_shapes_agree_on_the_chosen_fraction():
    """A target (agreement 1) and a smaller draft (0.7): their greedy choices for every token agree
    on 70% of the vocabulary, and greedy speculation with their maps (draft k = 4 from its own
    choices, accept the prefix the target's choices confirm, then the target's token) accepts
    what per-token agreement a predicts, (a + a^2 + a^3 + a^4) / 4, averaged over many walks."""
    target, draft = _runner(_model(96, 1.0, seed=0)), _runner(_model(32, 0.7, seed=3))
    for r in (target, draft):
        for v in range(V):
            r.add_sequence(v)
    t_top = torch.cat(target.step([SeqInput(v, [v]) for v in range(V)])).argmax(-1).tolist()
    d_top = torch.cat(draft.step([SeqInput(v, [v]) for v in range(V)])).argmax(-1).tolist()
    assert abs(sum(t == d for t, d in zip(t_top, d_top)) / V - 0.7) < 0.01

    k, drafted, accepted = 4, 0, 0
    for start in range(V):                      # a walk from every token: all of pi's cycles
        v = start
        for _ in range(5):                      # 5 speculative steps per walk
            d, t, n = v, v, 0
            while n < k:
                d, t = d_top[d], t_top[t]
                if d != t:
                    break
                n += 1
            drafted, accepted = drafted + k, accepted + n
            for _ in range(n + 1):
                v = t_top[v]
    a = 0.7
    assert abs(accepted / drafted - sum(a ** i for i in range(1, k + 1)) / k) < 0.05


def test_tied_heads_are_refused():
    cfg = tiny_config(vocab_size=V, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="tie"):
        init_agreeing(build_model(cfg, torch.float32, "cpu"), 0.5)


def test_flags_reach_the_engine_and_are_validated(capsys):
    e = config_from_args("draft", ["--model", "m", "--random-weights", "--random-agreement", "0.8"])[0].engine
    assert e.random_weights and e.random_agreement == 0.8
    assert config_from_args("target", ["--model", "m", "--random-weights"])[0].engine.random_agreement is None
    with pytest.raises(SystemExit):
        config_from_args("draft", ["--model", "m", "--random-agreement", "0.8"])  # without --random-weights
    assert "random_agreement needs random_weights" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        EngineConfig(model="m", random_weights=True, random_agreement=1.5)
