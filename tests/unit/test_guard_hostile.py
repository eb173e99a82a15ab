"""The in-process guard given what real tools give it: values without a JSON form, calls racing each
other, exceptions that fail when read, bad spend figures, one guard on many threads. Wiring the guard in
never breaks an agent that works without it, and never drops or repeats a side effect."""

from __future__ import annotations

import asyncio
import threading
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from stream_app.client import Guard, InvalidCall, RunHalted


def test_side_effecting_calls_with_decimal_path_or_set_arguments_are_told_apart() -> None:
    """Arguments orjson cannot write all hashed alike: bob's charge was handed alice's result and never
    made. A ``Decimal`` is its exact text, a path its text, a set its sorted members; identical ones are
    still one call's duplicates."""
    charged: list[str] = []

    def charge(customer: str, amount: Decimal, receipt: Path, tags: set[str]) -> str:
        charged.append(f"{customer} {amount}")
        return f"charged {customer}"

    async def main() -> list[str]:
        run = Guard.in_process().run("checkout")
        out = []
        for customer, amount in (("alice", "10.50"), ("bob", "99"), ("bob", "99.00"), ("alice", "10.50")):
            out.append(await run.call("charge", charge, {"customer": customer, "amount": Decimal(amount),
                                                         "receipt": Path(f"/r/{customer}"), "tags": {"b", "a"}},
                                      side_effect=True))
        return out

    assert asyncio.run(main()) == ["charged alice", "charged bob", "charged bob", "charged alice"]
    assert charged == ["alice 10.50", "bob 99", "bob 99.00"]  # the 4th: alice's first charge again


def test_arguments_without_a_json_form_are_never_another_calls_duplicate() -> None:
    class Opaque:
        pass

    sent: list[int] = []

    async def main() -> None:
        run = Guard.in_process().run("mailer")
        for n in range(3):
            await run.call("send", lambda n, handle: sent.append(n), {"n": n, "handle": Opaque()}, side_effect=True)

    asyncio.run(main())
    assert sent == [0, 1, 2]


def test_identical_side_effecting_calls_made_at_once_run_once() -> None:
    """Begun while the first runs, an identical call is its duplicate: it waits for the first and is
    handed its result (5 e-mails went out when 5 were awaited together; one after another, 1 did). A
    first call that is cancelled lets the one waiting for it run."""
    sent: list[str] = []

    async def send(to: str) -> str:
        await asyncio.sleep(0.05)
        sent.append(to)
        return f"sent to {to}"

    async def main() -> tuple[list[Any], list[str]]:
        guard = Guard.in_process()
        together = await asyncio.gather(*[guard.run("r1").call("send_email", send, {"to": "a@x"}, side_effect=True)
                                          for _ in range(3)])
        run = guard.run("r2")
        first = asyncio.create_task(run.call("send_email", send, {"to": "b@x"}, side_effect=True))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(run.call("send_email", send, {"to": "b@x"}, side_effect=True))
        await asyncio.sleep(0.01)
        first.cancel()
        return list(together), [await second]

    together, after_cancel = asyncio.run(main())
    assert together == ["sent to a@x"] * 3 and after_cancel == ["sent to b@x"]
    assert sent == ["a@x", "b@x"]


def test_a_tool_exception_that_fails_when_read_is_re_raised_and_counted() -> None:
    """A message whose ``__str__`` raises, a ``response`` property that raises, a ``retry_after`` past any
    float, a class name of 600 characters: the tool's own exception is re-raised (loopwarden's error
    replaced it) and the call is recorded, so a loop of them is still halted."""

    class Unreadable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text")

        @property
        def response(self) -> Any:
            raise KeyError("no response")

    class Huge(Exception):
        retry_after = 10**400

    long_name = type("E" * 600, (Exception,), {})
    raised: list[Any] = []

    async def main() -> None:
        guard = Guard.in_process()
        for error in (Unreadable(), Huge("slow down"), long_name("x")):
            run = guard.run(f"run-{type(error).__name__[:8]}")
            for _ in range(6):
                try:
                    await run.call("t", lambda error=error: (_ for _ in ()).throw(error), {})
                except RunHalted:
                    raised.append("halted")
                    break
                except Exception as exc:  # noqa: BLE001 - what the tool raised, compared below
                    raised.append(exc is error)

    asyncio.run(main())
    assert raised == [True, True, True, True, "halted"] * 3  # the tool's own, then each loop halted


def test_a_bad_spend_figure_is_refused_before_the_tool_runs() -> None:
    ran: list[int] = []

    async def main() -> None:
        run = Guard.in_process().run("spender")
        with pytest.raises(InvalidCall, match="tokens"):
            await run.call("send", lambda: ran.append(1), {}, side_effect=True, tokens=float("nan"))

    asyncio.run(main())
    assert ran == []  # refused after it ran, a retry would have run the side effect again


def test_one_guard_serves_runs_on_many_threads() -> None:
    """Each thread its own event loop and runs, one guard: its shared folds are locked (their tables
    were mutated during iteration, failing calls after their tools had run)."""
    guard = Guard.in_process()
    errors: list[str] = []

    def worker(thread: int) -> None:
        async def main() -> None:
            for n in range(1500):
                try:
                    await guard.run(f"t{thread}-r{n % 40}").call("search", lambda q: "ok", {"q": n})
                except Exception as exc:  # noqa: BLE001 - every unexpected error is the failure
                    errors.append(repr(exc))

        asyncio.run(main())

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


def test_a_call_refused_at_its_finish_lets_the_identical_call_waiting_for_it_run() -> None:
    """Two hooks (``begin``, ``finish``): a finish refused for a bad figure leaves no call waiting for it
    for ever; the waiting one runs."""
    async def main() -> list[str]:
        run = Guard.in_process().run("hooks")
        first = await run.begin("send", {"to": "a@x"}, side_effect=True)
        waiting = asyncio.create_task(run.begin("send", {"to": "a@x"}, side_effect=True))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        with pytest.raises(InvalidCall):
            await run.finish(first, "sent", tokens=-1)
        second = await asyncio.wait_for(waiting, 1)
        return ["replayed" if second.earlier is not None else "runs"]

    assert asyncio.run(main()) == ["runs"]
