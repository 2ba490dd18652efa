"""EventBuffer: bounded per-request event queue between the engine thread and a reader; stalled readers dropped."""
from __future__ import annotations

import asyncio

import pytest

from imp_jax.errors import EngineError, InvalidRequestError
from imp_jax.runtime.core.event_buffer import EventBuffer
from imp_jax.runtime.request import EngineEvent, StreamLimits, TokenLogprob, Usage


def _token(i: int, index: int = 0) -> EngineEvent:
    """Token i: a reasoning token below 300 (as a thinking model's), an answer token from there."""
    text = f"t{i} "
    return EngineEvent("r", index, [i], "" if i < 300 else text, reasoning_text=text if i < 300 else "",
                       logprobs=[TokenLogprob(i, -0.1, [(i, -0.1)])])


def test_a_reader_that_never_reads_holds_at_most_max_events_and_loses_nothing() -> None:
    async def run() -> tuple[EventBuffer, list[EngineEvent]]:
        buf = EventBuffer(StreamLimits(max_events=8, stall_timeout_s=60), on_stall=lambda: None)
        for i in range(1000):
            buf.put(_token(i, index=i % 2))
            assert len(buf) <= 8
        buf.put(EngineEvent("r", 1, finish_reason="length"))
        buf.put(EngineEvent("r", 0, [7], "end", finish_reason="stop", usage=Usage(3, 1001, 0), done=True))
        assert len(buf) <= 9  # the last event stays last: it folds only into the newest, else is one more
        out = [await buf.get() for _ in range(len(buf))]
        buf.close()
        return buf, out

    _, out = asyncio.run(run())
    for index in (0, 1):
        events = [e for e in out if e.index == index]
        ids = [t for e in events for t in e.token_ids]
        expected = list(range(index, 1000, 2)) + ([7] if index == 0 else [])
        assert ids == expected
        assert "".join(e.reasoning_text for e in events) == "".join(f"t{i} " for i in range(index, 300, 2))
        assert "".join(e.text for e in events) == "".join(f"t{i} " for i in range(300 + index, 1000, 2)) + (
            "end" if index == 0 else "")
        assert [lp.token_id for e in events for lp in e.logprobs or []] == list(range(index, 1000, 2))
        assert events[-1].finish_reason == ("stop" if index == 0 else "length")
    assert out[-1].done and out[-1].usage == Usage(3, 1001, 0)


def test_events_left_unread_past_the_timeout_drop_the_reader_once() -> None:
    stalls: list[int] = []

    async def run() -> EventBuffer:
        buf = EventBuffer(StreamLimits(max_events=4, stall_timeout_s=0.1), on_stall=lambda: stalls.append(1))
        await asyncio.sleep(0.15)
        assert not stalls                      # nothing waiting: a reader may wait as long as it likes
        buf.put(_token(0))
        await asyncio.sleep(0.05)
        buf.put(_token(1))                      # a new event does not restart the clock: only a read does
        assert (await buf.get()).token_ids == [0]
        await asyncio.sleep(0.05)
        assert not stalls
        await asyncio.sleep(0.1)
        assert stalls == [1] and len(buf) == 0
        buf.put(_token(2))                      # after the drop, nothing is kept
        assert len(buf) == 0
        with pytest.raises(EngineError) as info:
            await buf.get()
        assert info.value.code == "client_stalled"
        return buf

    buf = asyncio.run(run())
    assert stalls == [1] and buf.stalled


def test_a_slow_reader_that_keeps_reading_is_not_dropped() -> None:
    stalled: list[int] = []

    async def run() -> list[int]:
        buf = EventBuffer(StreamLimits(max_events=2, stall_timeout_s=0.1), on_stall=lambda: stalled.append(1))

        async def produce() -> None:
            for i in range(40):
                buf.put(_token(i))
                await asyncio.sleep(0.005)
            buf.put(EngineEvent("r", 0, finish_reason="stop", done=True))

        producer = asyncio.ensure_future(produce())
        ids: list[int] = []
        while True:
            ev = await buf.get()
            ids += ev.token_ids
            if ev.done:
                break
            await asyncio.sleep(0.03)           # six times slower than the producer
        await producer
        await asyncio.sleep(0.15)
        buf.close()
        return ids

    assert asyncio.run(run()) == list(range(40)) and not stalled


def test_a_rejection_is_delivered_as_the_exception() -> None:
    async def run() -> object:
        buf = EventBuffer(StreamLimits(), on_stall=lambda: None)
        asyncio.get_running_loop().call_soon(buf.put, InvalidRequestError("bad", param="x"))
        return await buf.get()

    item = asyncio.run(run())
    assert isinstance(item, InvalidRequestError) and item.param == "x"


def test_events_after_close_are_dropped_and_never_stall() -> None:
    """A reader that left (client gone, request cancelled) closes its buffer; the events the engine made
    before it saw the cancellation must not arm the stall timer (a false 'client read nothing' drop)."""
    stalls: list[int] = []

    async def run() -> EventBuffer:
        buf = EventBuffer(StreamLimits(max_events=8, stall_timeout_s=0.05), on_stall=lambda: stalls.append(1))
        buf.put(_token(0))
        await buf.get()
        buf.close()
        for i in range(1, 5):
            buf.put(_token(i))
        await asyncio.sleep(0.2)
        return buf

    buf = asyncio.run(run())
    assert stalls == [] and len(buf) == 0 and not buf.stalled


def test_folded_events_keep_a_harmony_replys_calls_in_order() -> None:
    """The answer's values (EngineEvent.answer: text and calls, as the engine read a harmony reply's calls) fold
    as its text does: all of them, in order, neighbouring deltas joined as the parser joins them."""
    from imp_jax.runtime.replies.calls import ArgsDelta, CallEnd, CallStart, TextDelta, merge_parts

    parts = [[TextDelta("I will")], [], [CallStart(0, "c1", "f")], [ArgsDelta(0, '{"a": ')], [ArgsDelta(0, "1}")],
             [CallEnd(0, '{"a": 1}', True, "")], [TextDelta(" ok")]]

    async def run() -> list[EngineEvent]:
        buf = EventBuffer(StreamLimits(max_events=2, stall_timeout_s=60), on_stall=lambda: None)
        for i, answer in enumerate(parts):
            buf.put(EngineEvent("r", 0, [i], "".join(p.text for p in answer if isinstance(p, TextDelta)),
                                answer=answer))
        out = [await buf.get() for _ in range(len(buf))]
        buf.close()
        return out

    out = asyncio.run(run())
    assert len(out) < len(parts)
    assert merge_parts([p for e in out for p in e.answer]) == merge_parts([p for answer in parts for p in answer])
    assert ArgsDelta(0, '{"a": 1}') in [p for e in out for p in e.answer]   # one delta where two folded
    assert "".join(e.text for e in out) == "I will ok"
