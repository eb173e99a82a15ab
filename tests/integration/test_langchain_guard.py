"""The LangChain guards in real LangChain v1 agents (``create_agent``, a LangGraph graph) driven by a
scripted chat model that keeps calling a tool; in-process guards, and fleet tests on the real broker."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import ToolErrorMiddleware
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatResult
from langchain_core.tools import BaseTool, StructuredTool, ToolException
from langgraph.errors import GraphRecursionError
from pydantic import Field

from stream_app.client import Guard, KafkaClientConfig, RunHalted
from stream_app.core import Policy
from stream_app.integrations.langchain import (
    DuplicateSuppressed,
    LoopwardenCallbackHandler,
    LoopwardenMiddleware,
)
from tests.integration.workers import Fleet, consume
from tests.readme_examples import example

from .tools import telemetry_of

SEARCH_ARGS = {"query": "refund policy"}
EMAIL_ARGS = {"to": "a@example.com", "subject": "Your refund"}


class ScriptedChatModel(GenericFakeChatModel):
    """Plays a script of replies and records the messages it was shown each turn. ``create_agent`` binds
    the tools to it; the script already names its calls."""

    seen: list[list[BaseMessage]] = Field(default_factory=list)

    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedChatModel:
        return self

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        self.seen.append(list(messages))
        return super()._generate(messages, stop, run_manager, **kwargs)


def calling(tool: str, args: dict[str, Any], times: int | None = None) -> Iterator[AIMessage]:
    """The model calling ``tool`` with ``args`` again and again (``times`` times, or forever)."""
    for n in itertools.islice(itertools.count(1), times):
        yield AIMessage(content="", tool_calls=[{"name": tool, "args": args, "id": f"call-{n}"}])


def model(*script: Iterator[AIMessage] | AIMessage) -> ScriptedChatModel:
    return ScriptedChatModel(messages=itertools.chain.from_iterable(
        [part] if isinstance(part, AIMessage) else part for part in script))


def timed_out(n: int) -> str:
    raise ToolException("search backend timed out")


class Counted:
    """A tool's body: counts its executions; ``answer(n)`` is the n-th one's result (a ToolException is
    a failure the tool reports to the model, as ``handle_tool_error`` tools do)."""

    def __init__(self, answer: Callable[[int], str] = timed_out) -> None:
        self.answer = answer
        self.runs = 0

    def __call__(self) -> str:
        self.runs += 1
        return self.answer(self.runs)


def search_tool(body: Counted) -> BaseTool:
    def search_docs(query: str) -> str:
        return body()

    return StructuredTool.from_function(search_docs, description="Search the docs.", handle_tool_error=True)


def email_tool(body: Counted) -> BaseTool:
    def send_email(to: str, subject: str) -> str:
        return body()

    return StructuredTool.from_function(send_email, description="Send an e-mail.", handle_tool_error=True)


def invoke(agent: Any, config: dict[str, Any], mode: str) -> Any:
    inputs = {"messages": [("user", "What is the refund policy?")]}
    if mode == "sync":
        return agent.invoke(inputs, config)
    return asyncio.run(agent.ainvoke(inputs, config))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_middleware_refuses_the_fifth_identical_failing_call_before_its_tool_runs(mode: str) -> None:
    """An agent retrying a failing tool: the 4th identical failure halts the thread's run (defaults),
    and the model's 5th call is refused with RunHalted before the tool runs, under invoke and ainvoke.
    Each call's telemetry carries the thread as run id and the model's tool call id."""
    guard = Guard.in_process()
    telemetry = telemetry_of(guard)
    decisions: list[dict[str, Any]] = []
    guard.on_decision(decisions.append)
    search = Counted()
    chat = model(calling("search_docs", SEARCH_ARGS))
    agent = create_agent(chat, [search_tool(search)], middleware=[LoopwardenMiddleware(guard)])

    with pytest.raises(RunHalted) as halted:
        invoke(agent, {"configurable": {"thread_id": "thread-7"}}, mode)

    assert search.runs == 4
    assert len(chat.seen) == 5  # the model asked for a 5th call; it never ran
    assert (halted.value.run_id, halted.value.verdict) == ("thread-7", "recursion")
    assert [(e["run_id"], e["tool"], e["outcome"], e["attrs"]) for e in telemetry] == [
        ("thread-7", "search_docs", "error", {"tool_call_id": f"call-{n}"}) for n in range(1, 5)]
    advice, halt = decisions
    assert halt["trigger_event_id"] == telemetry[3]["event_id"]
    assert (advice["action"], advice["trigger_event_id"]) == ("advise", telemetry[2]["event_id"])
    # The warning reached the model with the 3rd call's result, before its 4th call; not before.
    shown = [[m.content for m in turn if isinstance(m, ToolMessage)] for turn in chat.seen]
    assert advice["reason"] in shown[3][-1] and not any(advice["reason"] in c for c in shown[2])


def test_middleware_lets_a_retry_that_recovers_finish() -> None:
    """Error, error, success: a legitimate retry; the agent answers and nothing is halted."""
    guard = Guard.in_process()
    search = Counted(lambda n: "30 days" if n == 3 else timed_out(n))
    chat = model(calling("search_docs", SEARCH_ARGS, 3), AIMessage(content="Refunds within 30 days."))
    agent = create_agent(chat, [search_tool(search)], middleware=[LoopwardenMiddleware(guard)])

    result = invoke(agent, {"configurable": {"thread_id": "thread-ok"}}, "sync")

    assert result["messages"][-1].content == "Refunds within 30 days."
    assert search.runs == 3
    assert not guard.run("thread-ok").halted


def test_a_halted_thread_stays_halted_and_other_threads_go_on() -> None:
    """The thread is the run: invoking a halted thread again is refused at its first tool call, and a
    different thread of the same agent is judged on its own."""
    guard = Guard.in_process()
    search = Counted()
    agent = create_agent(model(calling("search_docs", SEARCH_ARGS)), [search_tool(search)],
                         middleware=[LoopwardenMiddleware(guard)])
    with pytest.raises(RunHalted):
        invoke(agent, {"configurable": {"thread_id": "thread-a"}}, "sync")

    with pytest.raises(RunHalted):
        invoke(agent, {"configurable": {"thread_id": "thread-a"}}, "sync")
    assert search.runs == 4
    with pytest.raises(RunHalted) as other:
        invoke(agent, {"configurable": {"thread_id": "thread-b"}}, "sync")
    assert (other.value.run_id, search.runs) == ("thread-b", 8)


def test_without_a_thread_each_invocation_is_a_run() -> None:
    """No thread id: the middleware's run is the invocation, ``config["run_id"]`` when the caller set it."""
    guard = Guard.in_process()
    run_id = uuid.uuid4()
    agent = create_agent(model(calling("search_docs", SEARCH_ARGS)), [search_tool(Counted())],
                         middleware=[LoopwardenMiddleware(guard)])

    with pytest.raises(RunHalted) as named:
        invoke(agent, {"run_id": run_id}, "sync")
    with pytest.raises(RunHalted) as anonymous:
        invoke(agent, {}, "sync")

    assert named.value.run_id == str(run_id)
    assert anonymous.value.run_id not in ("", str(run_id))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_middleware_answers_a_suppressed_duplicate_with_the_earlier_result(mode: str) -> None:
    """A side-effecting tool the model calls three times with the same arguments runs once; the 2nd
    and 3rd calls are answered with the first result under their own tool call ids, and the run goes on."""
    guard = Guard.in_process(Policy.from_mapping({"tools": {"send_email": {"side_effect": True}}}))
    send = Counted(lambda n: f"queued as #{n}")
    chat = model(calling("send_email", EMAIL_ARGS, 3), AIMessage(content="Sent."))
    agent = create_agent(chat, [email_tool(send)], middleware=[LoopwardenMiddleware(guard)])

    result = invoke(agent, {"configurable": {"thread_id": "thread-mail"}}, mode)

    assert send.runs == 1
    answers = [m for m in result["messages"] if isinstance(m, ToolMessage)]
    assert [(m.tool_call_id, m.content, m.status) for m in answers] == [
        (f"call-{n}", "queued as #1", "success") for n in range(1, 4)]
    assert result["messages"][-1].content == "Sent."


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_callback_handler_refuses_the_fifth_identical_failing_call_before_its_tool_runs(mode: str) -> None:
    """The callback handler in a LangGraph agent, under invoke and ainvoke: the 5th call is refused at
    on_tool_start, before the tool runs. Without a thread, the run is the root run, whose UUID is the
    trace id; span ids are the tool runs' and their parents', distinct although LangChain makes them
    within the same millisecond."""
    guard = Guard.in_process()
    telemetry = telemetry_of(guard)
    search = Counted()
    chat = model(calling("search_docs", SEARCH_ARGS))
    agent = create_agent(chat, [search_tool(search)])
    root = uuid.uuid4()

    with pytest.raises(RunHalted) as halted:
        invoke(agent, {"callbacks": [LoopwardenCallbackHandler(guard)], "run_id": root}, mode)

    assert search.runs == 4
    assert len(chat.seen) == 5
    assert (halted.value.run_id, halted.value.verdict) == (str(root), "recursion")
    assert [(e["run_id"], e["outcome"], e["trace_id"], e["attrs"]) for e in telemetry] == [
        (str(root), "error", root.hex, {"tool_call_id": f"call-{n}"}) for n in range(1, 5)]
    spans = {e["span_id"] for e in telemetry} | {e["parent_span_id"] for e in telemetry}
    assert len(spans) == 8 and all(len(s) == 16 for s in spans)
    assert halted.value.decision["span_id"] == telemetry[3]["span_id"]


def test_callback_handler_runs_under_the_thread_id_when_there_is_one() -> None:
    """With a thread id in the config (LangGraph copies it into the run metadata), the run is the thread."""
    guard = Guard.in_process()
    agent = create_agent(model(calling("search_docs", SEARCH_ARGS)), [search_tool(Counted())])
    config = {"callbacks": [LoopwardenCallbackHandler(guard)], "configurable": {"thread_id": "thread-cb"}}

    with pytest.raises(RunHalted) as halted:
        invoke(agent, config, "sync")

    assert halted.value.run_id == "thread-cb"


def test_callback_handler_refuses_a_suppressed_duplicate_it_cannot_answer() -> None:
    """A callback cannot skip a tool: the 2nd identical side-effecting call is refused with
    DuplicateSuppressed, and the e-mail goes out once."""
    guard = Guard.in_process(Policy.from_mapping({"tools": {"send_email": {"side_effect": True}}}))
    send = Counted(lambda n: f"queued as #{n}")
    agent = create_agent(model(calling("send_email", EMAIL_ARGS)), [email_tool(send)])

    with pytest.raises(DuplicateSuppressed, match="send_email"):
        invoke(agent, {"callbacks": [LoopwardenCallbackHandler(guard)]}, "sync")

    assert send.runs == 1


def test_callback_handler_reports_a_tool_exception_as_a_failure() -> None:
    """A tool that raises (not handled by the tool) is reported as an error with its class, through
    on_tool_error, and the exception leaves the agent as LangGraph raises it."""
    guard = Guard.in_process()
    telemetry = telemetry_of(guard)

    def broken(query: str) -> str:
        raise TimeoutError("search backend timed out")

    agent = create_agent(model(calling("search_docs", SEARCH_ARGS)),
                         [StructuredTool.from_function(broken, name="search_docs", description="search")])

    with pytest.raises(TimeoutError):
        invoke(agent, {"callbacks": [LoopwardenCallbackHandler(guard)]}, "sync")

    assert [(e["outcome"], e["error_class"]) for e in telemetry] == [("error", "timeout")]  # a transient class


async def test_a_sync_call_on_the_guards_own_loop_is_refused_rather_than_blocking_it() -> None:
    """Given the loop the guard runs on, the handler refuses to be called on that loop's thread (it
    would block the loop it waits for) and says what to do instead."""
    guard = Guard.in_process()
    handler = LoopwardenCallbackHandler(guard, loop=asyncio.get_running_loop())
    tool = search_tool(Counted(lambda n: "found"))

    with pytest.raises(RuntimeError, match="ainvoke"):
        tool.invoke(SEARCH_ARGS, {"callbacks": [handler]})


async def test_a_sync_call_where_a_loop_runs_is_guarded_with_an_in_process_guard() -> None:
    """A sync tool invoked inside ``async def`` (a notebook's cell, an async app calling a sync agent): the
    handler's private loop cannot nest in the running one, so its steps run on a thread of their own (it
    raised "asyncio.run() cannot be called from a running event loop", leaking a coroutine)."""
    guard = Guard.in_process()
    telemetry = telemetry_of(guard)
    tool = search_tool(Counted(lambda n: f"found {n}"))

    assert tool.invoke(SEARCH_ARGS, {"callbacks": [LoopwardenCallbackHandler(guard)]}) == "found 1"
    assert [e["outcome"] for e in telemetry] == ["success"]


def test_readme_example_halts_the_runaway_agent(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's LangChain example, with a scripted model that keeps calling the failing tool."""
    namespace: dict[str, Any] = {"model": model(calling("search_docs", {"query": "refund policy"}))}

    exec(example("### LangChain / LangGraph"), namespace)

    assert capsys.readouterr().out == "recursion 4\n"
    assert len(namespace["tried"]) == 4


@pytest.mark.integration
@pytest.mark.parametrize("guarded_by", ["middleware", "callback"])
async def test_fleet_halt_stops_the_agent(guarded_by: str, kafka_bootstrap: str, tmp_path: Path) -> None:
    """With a real worker on the real broker, under ainvoke: the agent's telemetry carries the thread and
    the tool call ids; the worker's signed halt comes back while the model thinks, and the model's 5th
    call is refused without running the tool. The callback handler is given the guard's loop (LangChain
    calls it on worker threads)."""
    fleet = Fleet(kafka_bootstrap, tmp_path, partitions=2)
    await asyncio.to_thread(fleet.start_worker)
    try:
        async with Guard.fleet(KafkaClientConfig(kafka_bootstrap), fleet.telemetry_topic, fleet.control_topic,
                               trusted_keys=fleet.trusted_keys()) as guard:

            run = guard.run("thread-fleet")

            def calls_until_halted() -> Iterator[AIMessage]:
                # Before its 5th call the model "thinks" until the worker's halt has arrived (LangChain
                # runs this sync model on a worker thread).
                for n, message in enumerate(calling("search_docs", SEARCH_ARGS), start=1):
                    deadline = time.monotonic() + 30
                    while n == 5 and not run.halted and time.monotonic() < deadline:
                        time.sleep(0.05)
                    yield message

            search = Counted()
            middleware = [LoopwardenMiddleware(guard)] if guarded_by == "middleware" else []
            callbacks = [LoopwardenCallbackHandler(guard, loop=asyncio.get_running_loop())] \
                if guarded_by == "callback" else []
            agent = create_agent(model(calls_until_halted()), [search_tool(search)], middleware=middleware)
            with pytest.raises(RunHalted) as halted:
                await agent.ainvoke({"messages": [("user", "What is the refund policy?")]},
                                    {"configurable": {"thread_id": "thread-fleet"}, "callbacks": callbacks})
        telemetry = [orjson.loads(r.value) for r in await consume(kafka_bootstrap, fleet.telemetry_topic, 4,
                                                                   settle=0.5)]
    finally:
        await asyncio.to_thread(fleet.stop)

    assert search.runs == 4
    assert halted.value.verdict == "recursion"
    assert [(e["run_id"], e["tool"], e["outcome"], e["attrs"]["tool_call_id"]) for e in telemetry] == [
        ("thread-fleet", "search_docs", "error", f"call-{n}") for n in range(1, 5)]


# --- footguns, detected and warned about once, with the fix --------------------------------------------

def _answer_every_error() -> ToolErrorMiddleware:
    """The catch-all: every exception a tool call raises becomes an error ToolMessage for the model."""
    return ToolErrorMiddleware(on_error=lambda exc, request: f"{request.tool_call['name']} failed: {exc}")


def test_middleware_listed_after_a_tool_error_middleware_is_warned_about_once(caplog: pytest.LogCaptureFixture) -> None:
    """ToolErrorMiddleware listed first (outside LoopwardenMiddleware) answers its RunHalted to the model,
    so the agent loops on to the recursion limit; the middleware notices the second refusal within one
    invocation and says, once, to list it first."""
    guard = Guard.in_process()
    search = Counted()
    chat = model(calling("search_docs", SEARCH_ARGS))
    agent = create_agent(chat, [search_tool(search)],
                         middleware=[_answer_every_error(), LoopwardenMiddleware(guard)])
    with caplog.at_level(logging.WARNING, logger="stream_app"), pytest.raises(GraphRecursionError):
        agent.invoke({"messages": [("user", "Refund policy?")]},
                     {"configurable": {"thread_id": "thread-order"}, "recursion_limit": 25})
    assert search.runs == 4  # refused ever after, but the agent went on
    warnings = [r.getMessage() for r in caplog.records if "went back to the model" in r.getMessage()]
    assert len(warnings) == 1 and "list LoopwardenMiddleware first" in warnings[0]


def test_callback_handler_under_a_catch_all_error_handler_is_warned_about_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """A tool error handler that hands every exception to the model (ToolErrorMiddleware answering all):
    the handler's RunHalted is logged once (LangChain would log it every superstep), and a warning names
    the fix."""
    guard = Guard.in_process()
    search = Counted()
    chat = model(calling("search_docs", SEARCH_ARGS))
    agent = create_agent(chat, [search_tool(search)], middleware=[_answer_every_error()])
    with caplog.at_level(logging.WARNING), pytest.raises(GraphRecursionError):
        agent.invoke({"messages": [("user", "Refund policy?")]},
                     {"callbacks": [LoopwardenCallbackHandler(guard)], "recursion_limit": 25})
    assert search.runs == 4
    halted = [r for r in caplog.records if "Error in LoopwardenCallbackHandler.on_tool_start" in r.getMessage()]
    assert len(halted) == 1
    warnings = [r.getMessage() for r in caplog.records if "went back to the model" in r.getMessage()]
    assert len(warnings) == 1 and "handle_tool_errors=(ToolException,)" in warnings[0]
