"""specdec/serving/owners.py: a coordinator's sequences are freed once none of its step
connections has been open for the timeout, and only then; released sequences, other owners'
sequences and sequences of no owner never are."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from protos import specdec_pb2 as pb
from specdec.serving.owners import Connection, Owners

T = 0.05   # the orphan timeout here, seconds


def verify(owner: int, first=(), later=(), release=()) -> pb.VerifyRequest:
    request = pb.VerifyRequest(owner=owner, release=list(release))
    for seq_id in first:
        request.seqs.add(seq_id=seq_id, first=True)
    for seq_id in later:
        request.seqs.add(seq_id=seq_id)
    return request


def run(scenario):
    """scenario(owners) on a loop; returns the ids freed, in order of the free calls."""
    freed: list[list[int]] = []

    async def free(seq_ids):
        freed.append(seq_ids)

    async def main():
        owners = Owners(free, T)
        await scenario(owners)
        await asyncio.sleep(3 * T)
        owners.close()
    asyncio.run(main())
    return freed


def test_a_dead_coordinators_sequences_are_freed_after_the_timeout_and_not_before():
    seen = {}

    async def scenario(owners):
        c = Connection(owners)
        c.step(verify(7, first=[1, 2]))
        c.step(verify(7, later=[1, 2], first=[3]))
        c.close()
        await asyncio.sleep(T / 2)
        seen["half"] = owners.held(7)
    freed = run(scenario)
    assert seen["half"] == {1, 2, 3}
    assert freed == [[1, 2, 3]]


def test_a_coordinator_back_within_the_timeout_keeps_its_sequences():
    async def scenario(owners):
        c = Connection(owners)
        c.step(verify(7, first=[1]))
        c.close()
        await asyncio.sleep(T / 2)
        again = Connection(owners)      # it reopened its stream (a step timeout, a dropped stream)
        again.step(verify(7, later=[1]))
        await asyncio.sleep(2 * T)
        assert owners.held(7) == {1}
        again.close()                   # and now it is gone for good
    assert run(scenario) == [[1]]


def test_one_of_two_connections_closing_frees_nothing():
    async def scenario(owners):
        a, b = Connection(owners), Connection(owners)
        a.step(verify(7, first=[1]))
        b.step(verify(7, first=[2]))
        a.close()
        a.close()   # twice: counted once
        await asyncio.sleep(2 * T)
        assert owners.held(7) == {1, 2}
        b.close()
    assert run(scenario) == [[1, 2]]


def test_released_sequences_are_not_freed_again():
    async def scenario(owners):
        c = Connection(owners)
        c.step(verify(7, first=[1, 2, 3, 4]))
        c.step(verify(7, later=[2], release=[1, 4]))
        owners.released([1])            # the engine freed the step's releases (4: the step never ran)
        owners.released([3])            # a Release RPC
        c.close()
    assert run(scenario) == [[2, 4]]


def test_only_the_dead_owners_sequences_go_and_no_owner_is_never_freed():
    async def scenario(owners):
        dead, alive, anonymous = Connection(owners), Connection(owners), Connection(owners)
        dead.step(verify(7, first=[1]))
        alive.step(verify(8, first=[2]))
        anonymous.step(verify(0, first=[3]))   # a client that names no owner
        dead.close()
        anonymous.close()
        await asyncio.sleep(2 * T)
        assert owners.held(8) == {2}
        alive.step(verify(8, later=[2]))
    assert run(scenario) == [[1]]


def test_a_sequence_restarted_by_another_owner_is_that_owners():
    # Sequence ids are unique per coordinator (random bases); one resent with `first` by another
    # owner belongs to it from then on.
    async def scenario(owners):
        a, b = Connection(owners), Connection(owners)
        a.step(verify(7, first=[1, 2]))
        b.step(verify(8, first=[2]))
        a.close()
    assert run(scenario) == [[1]]


def test_a_failed_free_is_logged_and_the_loop_goes_on(caplog):
    async def free(seq_ids):
        raise RuntimeError("engine gone")

    async def main():
        owners = Owners(free, T)
        c = Connection(owners)
        c.step(verify(7, first=[1]))
        c.close()
        await asyncio.sleep(3 * T)
        return owners.held(7)
    assert asyncio.run(main()) == set()
    assert "freeing coordinator 0000000000000007's sequences failed" in caplog.text


def test_a_negative_timeout_is_refused():
    with pytest.raises(ValueError, match="timeout_s"):
        Owners(lambda ids: None, -1)


# --- the coordinator's side ---------------------------------------------------------------------
def test_model_servers_name_one_nonzero_owner_in_every_step():
    from coordinator.servers import ModelServer

    async def main():
        a, b = ModelServer("target", "127.0.0.1:1"), ModelServer("draft", "127.0.0.1:1")
        sent = []

        async def step(request, timeout, on_sent):
            sent.append(request.owner)
            return request
        a._step = step
        for n in range(2):
            await a.step(pb.VerifyRequest(step=n))
        await a.close()
        await b.close()
        return sent, a.owner, b.owner
    sent, owner_a, owner_b = asyncio.run(main())
    assert sent == [owner_a, owner_a] and owner_a and owner_b != owner_a


def test_needs_info_from_a_closed_connection_or_a_failure_until_an_info_is_answered():
    from coordinator.servers import ModelServer

    class Call:
        def __init__(self, ended=False):
            self.ended = ended

        def done(self):
            return self.ended

    async def main():
        server = ModelServer("target", "127.0.0.1:1")
        answers = []

        async def info(request, timeout):
            if not answers:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata())
            return answers.pop()
        server.stub.Info = info
        seen = [server.needs_info()]            # no connection yet
        server._call = Call()
        seen.append(server.needs_info())        # open
        server._call.ended = True               # the server closed it between steps
        seen += [server.needs_info(), server.needs_info()]
        with pytest.raises(grpc.aio.AioRpcError):
            await server.info()                 # still down: still needed
        seen.append(server.needs_info())
        answers.append(pb.ModelInfo())
        await server.info()                     # answered: not needed, the same ended call no more
        seen.append(server.needs_info())
        server._call = None
        server._failed(RuntimeError("step failed"))   # a failed step (its call reset)
        seen.append(server.needs_info())
        await server.close()
        return seen
    assert asyncio.run(main()) == [False, False, True, True, True, False, True]


def test_the_servers_orphan_timeout_flag():
    from specdec.serving.server import config_from_args
    config, _, _ = config_from_args("target", ["--model", "m", "--orphan-timeout", "2.5"])
    assert config.orphan_timeout_s == 2.5
    assert config_from_args("draft", ["--model", "m"])[0].orphan_timeout_s == 5.0
    for bad in ("-1", "inf", "nan"):
        with pytest.raises(SystemExit):
            config_from_args("target", ["--model", "m", "--orphan-timeout", bad])
