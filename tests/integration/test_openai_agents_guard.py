"""The OpenAI Agents SDK guards in real SDK runs (``Runner``, ``function_tool``) driven by a scripted model
that implements the SDK's ``Model`` interface; no network (a dummy API key, no trace exporter).
In-process guards, and one fleet test on the real broker."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import agents
import orjson
import pytest
from agents import (
    Agent,
    AgentsException,
    FunctionTool,
    MaxTurnsExceeded,
    RunConfig,
    Runner,
    ToolInputGuardrailTripwireTriggered,
    UserError,
    default_tool_error_function,
    function_tool,
)
from agents.items import ModelResponse, TResponseOutputItem
from agents.models.interface import Model
from agents.usage import Usage
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

from stream_app.client import Guard, KafkaClientConfig, RunHalted
from stream_app.core import Policy
from stream_app.integrations.openai_agents import (
    AgentRunHalted,
    DuplicateSuppressed,
    LoopwardenRunHooks,
    LoopwardenToolGuardrails,
    tool_failed,
)
from tests.integration.workers import Fleet, consume
from tests.readme_examples import example

from .tools import telemetry_of

SEARCH_ARGS = {"query": "refund policy"}
EMAIL_ARGS = {"to": "a@example.com", "subject": "Your refund"}


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No network: a dummy key, no trace exporter, tracing off unless a test turns it on."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-used")
    agents.set_trace_processors([])
    agents.set_tracing_disabled(True)
    yield
    agents.set_tracing_disabled(True)


class ScriptedModel(Model):
    """Plays a script of model turns and records the input it was given each turn."""

    def __init__(self, *script: Iterator[TResponseOutputItem] | TResponseOutputItem) -> None:
        self.script = itertools.chain.from_iterable(
            part if isinstance(part, Iterator) else [part] for part in script)
        self.inputs: list[Any] = []

    async def get_response(self, system_instructions: str | None, input: Any, *args: Any,
                           **kwargs: Any) -> ModelResponse:
        self.inputs.append(input)
        return ModelResponse(output=[next(self.script)], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("these tests run agents unstreamed")


def calling(tool: str, args: dict[str, Any] | str, times: int | None = None) -> Iterator[TResponseOutputItem]:
    """The model calling ``tool`` with ``args`` (or raw argument text) again and again."""
    arguments = args if isinstance(args, str) else orjson.dumps(args).decode()
    for n in itertools.islice(itertools.count(1), times):
        yield ResponseFunctionToolCall(type="function_call", name=tool, arguments=arguments,
                                       call_id=f"call-{n}")


def answer(text: str) -> TResponseOutputItem:
    return ResponseOutputMessage(id="msg-1", type="message", role="assistant", status="completed",
                                 content=[ResponseOutputText(type="output_text", text=text, annotations=[])])


def timed_out(n: int) -> str:
    raise RuntimeError("search backend timed out")  # not a TimeoutError: that is transient (paused, not halted)


class Counted:
    """A tool's body: counts its executions; ``answer(n)`` is the n-th one's result."""

    def __init__(self, answer: Callable[[int], str] = timed_out) -> None:
        self.answer = answer
        self.runs = 0

    def __call__(self) -> str:
        self.runs += 1
        return self.answer(self.runs)


def search_tool(body: Counted, **options: Any) -> FunctionTool:
    def search_docs(query: str) -> str:
        """Search the docs."""
        return body()

    options.setdefault("failure_error_function", tool_failed)
    return function_tool(search_docs, **options)


def email_tool(body: Counted, **options: Any) -> FunctionTool:
    def send_email(to: str, subject: str) -> str:
        """Send an e-mail."""
        return body()

    options.setdefault("failure_error_function", tool_failed)
    return function_tool(send_email, **options)


def outputs_seen(model: ScriptedModel) -> list[tuple[str, str]]:
    """(call id, output) of every tool output the model was shown, on its last turn."""
    return [(item["call_id"], item["output"]) for item in model.inputs[-1]
            if isinstance(item, dict) and item.get("type") == "function_call_output"]


async def test_hooks_refuse_the_fifth_identical_failing_call_before_its_tool_runs() -> None:
    """An agent retrying a failing tool: the 4th identical failure halts the run (defaults), and the
    model's 5th call is refused in on_tool_start with AgentRunHalted, a RunHalted the SDK lets out
    unwrapped. The run is the group id; each call's telemetry carries the model's call id."""
    guard = Guard.in_process()
    telemetry = telemetry_of(guard)
    search = Counted()
    model = ScriptedModel(calling("search_docs", SEARCH_ARGS))
    agent = Agent(name="support", model=model, tools=[search_tool(search)])

    with pytest.raises(AgentRunHalted) as halted:
        await Runner.run(agent, "Refund policy?", hooks=LoopwardenRunHooks(guard),
                         run_config=RunConfig(group_id="conv-7"))

    assert isinstance(halted.value, RunHalted) and isinstance(halted.value, AgentsException)
    assert search.runs == 4
    assert len(model.inputs) == 5  # the model asked for a 5th call; it never ran
    assert (halted.value.run_id, halted.value.verdict) == ("conv-7", "recursion")
    assert [(e["run_id"], e["tool"], e["outcome"], e["error_class"], e["attrs"]) for e in telemetry] == [
        ("conv-7", "search_docs", "error", "RuntimeError", {"tool_call_id": f"call-{n}"})
        for n in range(1, 5)]


async def test_guardrails_trip_on_the_fifth_identical_failing_call_before_its_tool_runs() -> None:
    """The guardrail variant stops the run the SDK's way: the input guardrail's tripwire, whose
    output_info is the halt decision."""
    guard = Guard.in_process()
    guardrails = LoopwardenToolGuardrails(guard)
    search = Counted()
    tool = search_tool(search, tool_input_guardrails=[guardrails.input],
                       tool_output_guardrails=[guardrails.output])
    agent = Agent(name="support", model=ScriptedModel(calling("search_docs", SEARCH_ARGS)), tools=[tool])

    with pytest.raises(ToolInputGuardrailTripwireTriggered) as tripped:
        await Runner.run(agent, "Refund policy?", run_config=RunConfig(group_id="conv-8"))

    assert search.runs == 4
    decision = tripped.value.output.output_info
    assert (decision["run_id"], decision["action"], decision["verdict"]) == ("conv-8", "halt", "recursion")
    # The output guardrail gave the model the warning with the 3rd call's output, before its 4th call.
    model = agent.model
    assert isinstance(model, ScriptedModel)
    outputs = [output for _, output in outputs_seen(model)]
    assert "[loopwarden] search_docs failed the same way 3 times" in outputs[2]
    assert not any("[loopwarden]" in output for output in outputs[:2])


async def test_a_retry_that_recovers_finishes() -> None:
    """Error, error, success: a legitimate retry; the agent answers and nothing is halted."""
    guard = Guard.in_process()
    search = Counted(lambda n: "30 days" if n == 3 else timed_out(n))
    model = ScriptedModel(calling("search_docs", SEARCH_ARGS, 3), answer("Refunds within 30 days."))
    agent = Agent(name="support", model=model, tools=[search_tool(search)])

    result = await Runner.run(agent, "Refund policy?", hooks=LoopwardenRunHooks(guard),
                              run_config=RunConfig(group_id="conv-ok"))

    assert result.final_output == "Refunds within 30 days."
    assert search.runs == 3
    assert not guard.run("conv-ok").halted


async def test_with_tracing_on_the_run_is_the_trace() -> None:
    """No run id, no group id: the run is the SDK's trace (one per Runner.run), whose hex id is also the
    telemetry's W3C trace id."""
    agents.set_tracing_disabled(False)
    guard = Guard.in_process()
    telemetry = telemetry_of(guard)
    agent = Agent(name="support", model=ScriptedModel(calling("search_docs", SEARCH_ARGS)),
                  tools=[search_tool(Counted())])

    with pytest.raises(AgentRunHalted) as halted:
        await Runner.run(agent, "Refund policy?", hooks=LoopwardenRunHooks(guard))

    trace_id = halted.value.run_id
    assert trace_id.startswith("trace_") and len(trace_id) == 38
    assert {e["trace_id"] for e in telemetry} == {trace_id.removeprefix("trace_")}


@pytest.mark.parametrize("run_id", ["conv-9", lambda context: context.context["conversation"]])
async def test_the_caller_can_name_the_run(run_id: Any) -> None:
    """A run id given to the hooks, or a function of the run context, wins over the group id."""
    guard = Guard.in_process()
    agent = Agent(name="support", model=ScriptedModel(calling("search_docs", SEARCH_ARGS)),
                  tools=[search_tool(Counted())])

    with pytest.raises(AgentRunHalted) as halted:
        await Runner.run(agent, "Refund policy?", context={"conversation": "conv-9"},
                         hooks=LoopwardenRunHooks(guard, run_id), run_config=RunConfig(group_id="group"))

    assert halted.value.run_id == "conv-9"


async def test_a_call_of_no_known_run_fails_loudly() -> None:
    """Tracing off, no group id, no run id: the guard cannot tell the run, and says how to fix it."""
    agent = Agent(name="support", model=ScriptedModel(calling("search_docs", SEARCH_ARGS)),
                  tools=[search_tool(Counted())])

    with pytest.raises(UserError, match="pass run_id="):
        await Runner.run(agent, "Refund policy?", hooks=LoopwardenRunHooks(Guard.in_process()))


async def test_broken_arguments_in_a_loop_are_failures_too() -> None:
    """A model repeating arguments that are not JSON: the SDK fails each call before the tool runs;
    tool_failed reports the failures (arguments under ``input``), and the 5th call is refused."""
    guard = Guard.in_process()
    search = Counted()
    agent = Agent(name="support", model=ScriptedModel(calling("search_docs", '{"query": ')),
                  tools=[search_tool(search)])

    with pytest.raises(AgentRunHalted) as halted:
        await Runner.run(agent, "Refund policy?", hooks=LoopwardenRunHooks(guard),
                         run_config=RunConfig(group_id="conv-json"))

    assert search.runs == 0
    assert halted.value.verdict == "recursion"


async def test_without_tool_failed_failures_pass_for_successes() -> None:
    """Why tools need ``failure_error_function=tool_failed``: the SDK turns a tool's exception into a
    message before hooks see the call end, so the failures are reported as successes and never halt."""
    guard = Guard.in_process()
    telemetry = telemetry_of(guard)
    search = Counted()
    agent = Agent(name="support", model=ScriptedModel(calling("search_docs", SEARCH_ARGS)),
                  tools=[search_tool(search, failure_error_function=agents.default_tool_error_function)])

    with pytest.raises(MaxTurnsExceeded):
        await Runner.run(agent, "Refund policy?", hooks=LoopwardenRunHooks(guard), max_turns=6,
                         run_config=RunConfig(group_id="conv-blind"))

    assert search.runs == 6
    assert {e["outcome"] for e in telemetry} == {"success"}
    assert not guard.run("conv-blind").halted


async def test_guardrails_answer_a_suppressed_duplicate_with_the_earlier_result() -> None:
    """A side-effecting tool the model calls three times with the same arguments runs once; the 2nd
    and 3rd calls are answered with the first result, and the run goes on."""
    guard = Guard.in_process(Policy.from_mapping({"tools": {"send_email": {"side_effect": True}}}))
    guardrails = LoopwardenToolGuardrails(guard)
    send = Counted(lambda n: f"queued as #{n}")
    tool = email_tool(send, tool_input_guardrails=[guardrails.input],
                      tool_output_guardrails=[guardrails.output])
    model = ScriptedModel(calling("send_email", EMAIL_ARGS, 3), answer("Sent."))
    agent = Agent(name="support", model=model, tools=[tool])

    result = await Runner.run(agent, "Refund them", run_config=RunConfig(group_id="conv-mail"))

    assert result.final_output == "Sent."
    assert send.runs == 1
    assert outputs_seen(model) == [(f"call-{n}", "queued as #1") for n in range(1, 4)]


async def test_hooks_refuse_a_suppressed_duplicate_they_cannot_answer() -> None:
    """Hooks cannot skip a tool: the 2nd identical side-effecting call is refused with
    DuplicateSuppressed (an AgentsException), and the e-mail goes out once."""
    guard = Guard.in_process(Policy.from_mapping({"tools": {"send_email": {"side_effect": True}}}))
    send = Counted(lambda n: f"queued as #{n}")
    agent = Agent(name="support", model=ScriptedModel(calling("send_email", EMAIL_ARGS)),
                  tools=[email_tool(send)])

    with pytest.raises(DuplicateSuppressed, match="send_email"):
        await Runner.run(agent, "Refund them", hooks=LoopwardenRunHooks(guard),
                         run_config=RunConfig(group_id="conv-mail"))

    assert send.runs == 1


def test_readme_example_halts_the_runaway_agent(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's OpenAI Agents example, with a scripted model that keeps calling the failing tool."""
    namespace: dict[str, Any] = {"model": ScriptedModel(calling("search_docs", {"query": "refund policy"}))}

    exec(example("### OpenAI Agents SDK"), namespace)

    assert capsys.readouterr().out == "recursion 4\n"
    assert len(namespace["tried"]) == 4


@pytest.mark.integration
async def test_fleet_halt_stops_the_agent(kafka_bootstrap: str, tmp_path: Path) -> None:
    """With a real worker on the real broker: the run's telemetry carries the group id and the model's
    call ids; the worker's signed halt comes back while the model thinks, and the model's 5th call is
    refused without running the tool."""
    fleet = Fleet(kafka_bootstrap, tmp_path, partitions=2)
    await asyncio.to_thread(fleet.start_worker)
    try:
        async with Guard.fleet(KafkaClientConfig(kafka_bootstrap), fleet.telemetry_topic, fleet.control_topic,
                               trusted_keys=fleet.trusted_keys()) as guard:
            run = guard.run("conv-fleet")

            class Thinking(ScriptedModel):
                async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
                    if len(self.inputs) == 4:  # before its 5th call, until the worker's halt has arrived
                        async with asyncio.timeout(30):
                            while not run.halted:
                                await asyncio.sleep(0.05)
                    return await super().get_response(*args, **kwargs)

            search = Counted()
            agent = Agent(name="support", model=Thinking(calling("search_docs", SEARCH_ARGS)),
                          tools=[search_tool(search)])
            with pytest.raises(AgentRunHalted) as halted:
                await Runner.run(agent, "Refund policy?", hooks=LoopwardenRunHooks(guard),
                                 run_config=RunConfig(group_id="conv-fleet"))
        telemetry = [orjson.loads(r.value) for r in await consume(kafka_bootstrap, fleet.telemetry_topic, 4,
                                                                   settle=0.5)]
    finally:
        await asyncio.to_thread(fleet.stop)

    assert search.runs == 4
    assert halted.value.verdict == "recursion"
    assert [(e["run_id"], e["tool"], e["outcome"], e["attrs"]["tool_call_id"]) for e in telemetry] == [
        ("conv-fleet", "search_docs", "error", f"call-{n}") for n in range(1, 5)]


# --- footguns, detected and warned about once, with the fix --------------------------------------------

async def test_a_tool_without_tool_failed_under_run_hooks_is_warned_about_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """The SDK's default failure function turns the tool's exceptions into messages before the hooks
    see the call end: its failures look like successes and the loop is never halted. The hooks say so,
    once, naming the tool and the fix; a tool with tool_failed gets no warning."""
    guard = Guard.in_process()
    search = Counted()
    tool = search_tool(search, failure_error_function=default_tool_error_function)
    model = ScriptedModel(calling("search_docs", SEARCH_ARGS, 6), answer("I could not search."))
    agent = Agent(name="support", model=model, tools=[tool])
    with caplog.at_level(logging.WARNING, logger="stream_app"):
        await Runner.run(agent, "Refund policy?", hooks=LoopwardenRunHooks(guard),
                         run_config=RunConfig(group_id="conv-footgun"))
    assert search.runs == 6  # never halted: the failures passed for successes
    warnings = [r.getMessage() for r in caplog.records if "failure_error_function=tool_failed" in r.getMessage()]
    assert len(warnings) == 1 and "'search_docs'" in warnings[0]

    caplog.clear()
    fixed = Agent(name="support", model=ScriptedModel(calling("search_docs", SEARCH_ARGS, 2), answer("ok")),
                  tools=[search_tool(Counted())])
    with caplog.at_level(logging.WARNING, logger="stream_app"):
        await Runner.run(fixed, "Refund policy?", hooks=LoopwardenRunHooks(guard),
                         run_config=RunConfig(group_id="conv-fixed"))
    assert not [r for r in caplog.records if "failure_error_function" in r.getMessage()]


async def test_the_guardrails_tripwire_says_which_halt() -> None:
    """The tripwire's message names the verdict and the reason (not only "guardrail ... triggered
    tripwire"), and it is a RunHalted too."""
    guard = Guard.in_process()
    guardrails = LoopwardenToolGuardrails(guard)
    tool = search_tool(Counted(), tool_input_guardrails=[guardrails.input], tool_output_guardrails=[guardrails.output])
    agent = Agent(name="support", model=ScriptedModel(calling("search_docs", SEARCH_ARGS)), tools=[tool])
    with pytest.raises(ToolInputGuardrailTripwireTriggered) as tripped:
        await Runner.run(agent, "Refund policy?", run_config=RunConfig(group_id="conv-trip"))
    assert isinstance(tripped.value, RunHalted) and tripped.value.verdict == "recursion"
    assert str(tripped.value).startswith("tool input guardrail loopwarden tripped: run conv-trip was halted by "
                                         "loopwarden (recursion): search_docs with identical arguments")
