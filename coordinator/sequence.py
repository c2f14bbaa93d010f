"""One request's life in the coordinator: what it asked for, what it produced, what each server holds.

Server bookkeeping (the step protocol of DESIGN section 2):
- target: `target_pending` are the tokens the target has not seen — the prompt (fed in chunks when
  long) and afterwards the one token it emitted last step, which it samples but does not feed.
- draft: the server holds confirmed tokens and, after them, its proposal (`draft_prop`: what it
  drafted and the target has not confirmed yet). Of the proposal, the first `draft_keep` tokens
  were confirmed since, and `draft_pending` are confirmed tokens after those that the draft has not
  seen. Each emitted token extends the kept prefix while it equals the next proposed token and
  goes to pending otherwise (draft_confirm). So after a step that drafted k and accepted a (next
  token t) keep = a and pending = [t]; when a == k the k-th draft was never fed to the draft's KV,
  and the draft server itself feeds it (it remembers its proposal: specdec/engine/draft.py
  truncates to `confirmed tokens + keep` and feeds whatever its KV lacks). A step without the
  draft appends the emitted tokens to pending, so the draft catches up on its next proposal in
  one forward. Pipelined speculation (`extend`) drafts after the proposal while the target still
  verifies it; when the target accepts all and its next token is the draft's first guess, the
  proposal's rest (`draft_ahead`) is the next step's drafts, with no Propose.
- lost state: a sequence's first message to a server carries `first`; any later one makes a server
  that does not hold the sequence (restarted, or lost it) answer NOT_FOUND instead of silently
  starting it afresh. The coordinator then resends it from the start — prompt + every emitted
  token, with `first` — so the continuation is exactly what it would have been (seeded sampling
  draws by position: specdec/sampling/rng.py).
"""
from __future__ import annotations

import asyncio
import collections
import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from coordinator.stops import StopStrings
from coordinator.tokenizer import IncrementalDetokenizer, TextTokenizer


_new_tuple = tuple.__new__


class Proposed(NamedTuple):
    """One token of the draft's proposal, as the coordinator mirrors it."""
    token: int
    row: tuple | None = None  # (pb.Probs, row index): a sampled draft's distribution
    guess: bool = False       # a sampled extension's guess of the target's token: never a draft


class Finish(enum.IntEnum):  # values of the proto's FinishReason
    LENGTH = 1
    STOP = 2
    EOS = 3


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0  # always set: the coordinator draws one when the request has none


@dataclass(frozen=True)
class GenParams:
    """A validated request."""
    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: Sampling
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    eos_token_ids: frozenset[int] = frozenset()  # empty when the request ignores EOS
    speculate: bool = True
    num_draft: int = 0  # 0: the coordinator's policy


class Chunk:
    """What goes to the client stream: text and ids since the last chunk; finish on the last one.

    A chunk of a sequence without stop strings gets its text when `text` is first read
    (Sequence._render_through): the detokenizer runs in the client's stream task, while the step
    loop waits for a server, instead of on the step's critical path. Reading any chunk's text
    renders the sequence's earlier chunks first, so the text is the same in whatever order the
    chunks are read."""
    __slots__ = ("_text", "token_ids", "finish", "_seq")

    def __init__(self, text: str | None, token_ids: list[int], finish: Finish | None = None,
                 seq: "Sequence | None" = None):
        self._text, self.token_ids, self.finish, self._seq = text, token_ids, finish, seq

    @property
    def text(self) -> str:
        if self._text is None:
            self._seq._render_through(self)
        return self._text

    def __repr__(self) -> str:  # no rendering as a side effect (a log line must not detokenize)
        text = "<not rendered>" if self._text is None else repr(self._text)
        return f"Chunk({text}, {self.token_ids!r}, {self.finish!r})"


@dataclass
class Abort:
    """The request ends with a gRPC status instead of a last chunk."""
    code: int  # grpc.StatusCode value's first element (google.rpc.Code)
    message: str


@dataclass
class Sequence:
    seq_id: int
    params: GenParams
    max_len: int                      # the model's limit on prompt + output
    tokenizer: TextTokenizer
    output: list[int] = field(default_factory=list)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    # target side
    target_pending: list[int] = field(default_factory=list)
    target_first: bool = True         # the next Verify message is the sequence's first (allocates)
    target_resends: int = 0           # resends from the start since the sequence last emitted
    # draft side
    use_draft: bool = False           # speculate with the draft (request asked, capacity allowed)
    draft_holds: bool = False         # the draft server holds this sequence's KV
    draft_resync: bool = False        # the draft lost track (server restarted): start it afresh
    draft_keep: int = 0
    draft_pending: list[int] = field(default_factory=list)
    draft_prop: list[Proposed] = field(default_factory=list)
    draft_resends: int = 0            # draft NOT_FOUND resends since its last good proposal
    pipeline_refused: bool = False    # the draft refused an extension: no more pipelining for it
    # accounting
    reserved_target: int = 0          # KV blocks promised by the scheduler
    reserved_draft: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0               # steps that ended at a rejected draft token
    steps: int = 0
    done: bool = False                # finished, aborted or cancelled: no more chunks
    cancelled: bool = False
    wire_sampling: object = None      # params.sampling as the step messages carry it (spec_loop.sampling_pb)

    def __post_init__(self) -> None:
        self.target_pending = list(self.params.prompt_ids)
        self.draft_pending = list(self.params.prompt_ids)
        self._detok = IncrementalDetokenizer(self.tokenizer, list(self.params.prompt_ids))
        self._stops = StopStrings(self.params.stop)
        self._unrendered: collections.deque[Chunk] = collections.deque()  # emitted, text not read yet
        self._finish_ids_of: GenParams | None = None  # (_finish_ids' cache)
        self._finish_ids_set: frozenset[int] = frozenset()

    @property
    def num_tokens(self) -> int:
        return len(self.params.prompt_ids) + len(self.output)

    @property
    def remaining(self) -> int:
        """Tokens this sequence may still emit (request budget and model length)."""
        return min(self.params.max_new_tokens - len(self.output), self.max_len - self.num_tokens)

    @property
    def prefilling(self) -> bool:
        # The prompt, or prompt + output being resent after the target lost the sequence.
        return len(self.target_pending) > 1

    def emit(self, tokens: list[int]) -> Chunk:
        """Appends a step's tokens up to the first stop condition (later ones are dropped)."""
        if not self._stops.active:
            return self._emit_ids(tokens)
        text, taken, finish, matched = [], [], None, False
        for tok in tokens:
            self.output.append(tok)
            taken.append(tok)
            piece, matched = self._stops.feed(self._detok.push(tok))
            text.append(piece)
            finish = Finish.STOP if matched else self._token_finish(tok, self.remaining)
            if finish is not None:
                break
        if finish is not None and not matched:
            piece, matched = self._stops.feed(self._detok.flush())
            text.append(piece)
            if matched:
                finish = Finish.STOP
            else:
                text.append(self._stops.flush())
        return Chunk("".join(text), taken, finish)

    def _token_finish(self, tok: int, remaining_after: int) -> Finish | None:
        """How an emitted token ends the sequence (its id, or the budget left after it), if it does."""
        p = self.params
        if tok in p.stop_token_ids:
            return Finish.STOP
        if tok in p.eos_token_ids:
            return Finish.EOS
        if remaining_after <= 0:
            return Finish.LENGTH
        return None

    def _finish_ids(self) -> frozenset[int]:
        """The ids that end this sequence when emitted (stop_token_ids and eos_token_ids: what
        _token_finish tests), cached for the sequence's params."""
        if self._finish_ids_of is not self.params:
            self._finish_ids_set = frozenset(self.params.stop_token_ids) | frozenset(self.params.eos_token_ids)
            self._finish_ids_of = self.params
        return self._finish_ids_set

    def _emit_ids(self, tokens: list[int]) -> Chunk:
        """emit() without stop strings: every stop condition is a token's, so the step's tokens
        are cut first; they are detokenized together (two tokenizer calls a step, not two a
        token) when the chunk's text is read."""
        budget = self.remaining
        finish = None
        n = len(tokens)
        if n < budget and self._finish_ids().isdisjoint(tokens):
            taken = list(tokens)  # no token ends it, and budget is left after the last: all of them
        else:
            for i, tok in enumerate(tokens):
                finish = self._token_finish(tok, budget - (i + 1))
                if finish is not None:
                    n = i + 1
                    break
            taken = list(tokens[:n])
        self.output.extend(taken)
        chunk = Chunk(None, taken, finish, self)
        self._unrendered.append(chunk)
        return chunk

    def _render_through(self, chunk: Chunk) -> None:
        """Detokenizes the unrendered chunks in emission order, up to and including `chunk`."""
        while True:
            c = self._unrendered.popleft()
            text = self._detok.push_many(c.token_ids)
            if c.finish is not None:
                text += self._detok.flush()
            c._text = text
            if c is chunk:
                return

    def draft_proposed(self, tokens: list[int], extend: bool = False, rows: list | None = None) -> None:
        """The draft took this step's keep and pending and drafted `tokens` after them (after the
        proposal's unconfirmed rest when `extend`d); rows: where the distribution of each is (a
        sampled sequence's (pb.Probs, row index), coordinator/proposals.probs_row). A sampled extension's
        first token was drawn as a guess of the target's token with the target's own uniform
        (specdec/sampling/draft.py): it may be confirmed, never verified as a draft, since the
        target's correction at its position draws with that uniform too. Until tokens are
        confirmed, keep is 0: a lost verify discards nothing that was not confirmed."""
        # (tuple.__new__: a NamedTuple's own __new__ is a Python call per token, on the step's path)
        if rows is None:
            new = [_new_tuple(Proposed, (tok, None, False)) for tok in tokens]
        else:
            new = [_new_tuple(Proposed, (tok, row, False)) for tok, row in zip(tokens, rows)]
        if new and extend and self.params.sampling.temperature > 0:
            new[0] = new[0]._replace(guess=True)
        self.draft_prop = self.draft_prop[self.draft_keep:] + new if extend else new
        self.draft_keep, self.draft_pending = 0, []

    def draft_confirm(self, tokens: list[int]) -> None:
        """Tokens the target emitted (see the module docstring)."""
        # Each token extends the kept prefix while it is the next proposed one and nothing is
        # pending; from the first that is not, the rest are pending.
        prop, keep, i = self.draft_prop, self.draft_keep, 0
        if not self.draft_pending:
            n = len(prop)
            for tok in tokens:
                if keep < n and prop[keep][0] == tok:
                    keep += 1
                    i += 1
                else:
                    break
            self.draft_keep = keep
        if i < len(tokens):
            self.draft_pending.extend(tokens[i:])

    @property
    def draft_ahead(self) -> list[int]:
        """Proposed tokens that follow the confirmed ones: drafts the next step can verify without
        asking the draft (empty unless the proposal is still on track)."""
        ahead = []
        if not self.draft_pending:
            for proposed in self.draft_prop[self.draft_keep:]:
                if proposed.guess:
                    break
                ahead.append(proposed.token)
        return ahead

    def draft_ahead_rows(self, n: int) -> list:
        """The distributions of the first n of draft_ahead (None for a token drafted greedily)."""
        return [proposed.row for proposed in self.draft_prop[self.draft_keep:self.draft_keep + n]]

    def restart_draft(self) -> None:
        """The draft server forgot this sequence: send it everything as a new sequence."""
        self.draft_keep, self.draft_prop = 0, []
        self.draft_pending = list(self.params.prompt_ids) + self.output

    def restart_target(self) -> None:
        """The target lost this sequence: send it everything again, as a new sequence."""
        self.target_first = True
        self.target_pending = list(self.params.prompt_ids) + self.output
        self.target_resends += 1
