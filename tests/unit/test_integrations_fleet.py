"""The framework integrations fill the fields of the rules across runs and agents: OpenAI Agents handoffs
(handoff-class, to the agent handed to) and agents used as tools (spawn-class), the Claude Agent SDK's
``Agent``/``Task`` tool (spawn-class), LangChain/LangGraph sub-agents run by a tool (child runs in the
caller's tree, rooted at the outermost run) and MCP servers (the ``upstream`` of every call). A paused
tool is answered, not halted, where the framework lets the integration answer. In-process guards, the
frameworks' own libraries driven by scripted models; no network."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterator
from typing import Any

import agents
import orjson
import pytest
from agents import Agent, RunConfig, Runner, function_tool, handoff
from agents.items import ModelResponse, TResponseOutputItem
from agents.models.interface import Model
from agents.usage import Usage
from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.func import entrypoint, task
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode
from mcp import Client
from mcp.server.context import ServerRequestContext
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, TextContent
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

from stream_app.client import Guard, GuardedRun, RunHalted, ToolPaused, TreeHalted
from stream_app.core import Policy
from stream_app.integrations import claude_agent_sdk, langchain, mcp, openai_agents

SESSION = "5b0c9a52-1f7e-4c47-9f0e-2d1d8a7f3c11"
T0 = 1_764_000_000_000


def frozen() -> Guard:
    """An in-process guard whose clock stands still: a pause's wait is exactly its 60 s."""
    return Guard.in_process(clock=lambda: T0)


def telemetry_of(guard: Guard) -> list[dict[str, Any]]:
    """Every telemetry event the guard builds from now on (in-process, they go to its detector)."""
    events: list[dict[str, Any]] = []
    build = guard.builder.build

    def recording(*args: Any, **kwargs: Any) -> dict[str, Any]:
        events.append(build(*args, **kwargs))
        return events[-1]

    guard.builder.build = recording  # type: ignore[method-assign]
    return events


def fields(events: list[dict[str, Any]], *names: str) -> list[tuple[Any, ...]]:
    return [tuple(e.get(name) for name in names) for e in events]


def timed_out(**_: Any) -> str:
    raise TimeoutError("search backend timed out")


async def pause_the_run(run: GuardedRun, tool: str) -> None:
    """Have the run's calls of ``tool`` paused: its own transient streak (4 identical timeouts), as any
    integration of the run reports it; the 5th call is refused with ``ToolPaused``."""
    for _ in range(4):
        with pytest.raises(TimeoutError):
            await run.call(tool, timed_out, {"query": "refund policy"})
    with pytest.raises(ToolPaused):
        await run.call(tool, timed_out, {"query": "refund policy"})


# --- OpenAI Agents SDK ------------------------------------------------------------------------------------

@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No network: a dummy key, no trace exporter, tracing off unless a test turns it on."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-used")
    agents.set_trace_processors([])
    agents.set_tracing_disabled(True)
    yield
    agents.set_tracing_disabled(True)


class ScriptedModel(Model):
    """Plays a script of model turns and records the input it was given each turn."""

    def __init__(self, *script: TResponseOutputItem) -> None:
        self.script = iter(script)
        self.inputs: list[Any] = []

    async def get_response(self, system_instructions: str | None, input: Any, *args: Any,
                           **kwargs: Any) -> ModelResponse:
        self.inputs.append(input)
        return ModelResponse(output=[next(self.script)], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("these tests run agents unstreamed")


def calling(tool: str, args: dict[str, Any], call_id: str) -> TResponseOutputItem:
    return ResponseFunctionToolCall(type="function_call", name=tool, arguments=orjson.dumps(args).decode(),
                                    call_id=call_id)


def answer(text: str) -> TResponseOutputItem:
    return ResponseOutputMessage(id="msg-1", type="message", role="assistant", status="completed",
                                 content=[ResponseOutputText(type="output_text", text=text, annotations=[])])


def ping_pong() -> Agent[Any]:
    """triage -> billing -> triage -> billing, then billing answers; billing's handoff back to triage is
    named by its ``tool_name_override``."""
    triage: Agent[Any] = Agent(name="triage", model=ScriptedModel(
        calling("transfer_to_billing", {}, "call-1"), calling("transfer_to_billing", {}, "call-3")))
    billing: Agent[Any] = Agent(name="billing", model=ScriptedModel(
        calling("back_to_triage", {}, "call-2"), answer("Refunded.")),
        handoffs=[handoff(triage, tool_name_override="back_to_triage")])
    triage.handoffs = [billing]
    return triage


@pytest.mark.usefixtures("offline")
async def test_openai_handoffs_are_handoff_class_calls_to_the_agent_handed_to() -> None:
    """Each handoff, once done, is one handoff-class call of the tool the model called, from the agent
    handing off to the agent handed to (so ``handoff_loop`` sees A->B->A); the run is the one the hooks
    name."""
    guard = Guard.in_process()
    telemetry = telemetry_of(guard)

    result = await Runner.run(ping_pong(), "Refund me", hooks=openai_agents.LoopwardenRunHooks(
        guard, "conv-h", agent_id="support-desk"))

    assert result.final_output == "Refunded."
    assert fields(telemetry, "run_id", "tool", "tool_class", "agent_id", "child_agent_id", "outcome",
                  "root_run_id") == [
        ("conv-h", "transfer_to_billing", "handoff", "triage", "billing", "success", "conv-h"),
        ("conv-h", "back_to_triage", "handoff", "billing", "triage", "success", "conv-h"),
        ("conv-h", "transfer_to_billing", "handoff", "triage", "billing", "success", "conv-h"),
    ]
    assert all("task_hash" not in e and "child_run_id" not in e for e in telemetry)


@pytest.mark.usefixtures("offline")
async def test_openai_agents_handing_a_run_back_and_forth_are_halted_at_the_6th_handoff() -> None:
    """triage and billing hand the customer to each other and never answer: the 6th handoff (3 round
    trips) halts the run, and the SDK lets the halt out of Runner.run."""
    triage: Agent[Any] = Agent(name="triage", model=ScriptedModel(
        *[calling("transfer_to_billing", {}, f"call-t{n}") for n in range(10)]))
    billing: Agent[Any] = Agent(name="billing", model=ScriptedModel(
        *[calling("transfer_to_triage", {}, f"call-b{n}") for n in range(10)]), handoffs=[triage])
    triage.handoffs = [billing]
    guard = Guard.in_process()
    telemetry = telemetry_of(guard)

    with pytest.raises(openai_agents.AgentRunHalted) as halted:
        await Runner.run(triage, "Refund me", hooks=openai_agents.LoopwardenRunHooks(guard, "conv-loop"),
                         max_turns=40)

    assert halted.value.verdict == "handoff_loop"
    assert [e["tool_class"] for e in telemetry] == ["handoff"] * 6


@pytest.mark.usefixtures("offline")
async def test_openai_a_handoff_of_a_group_runs_under_the_group_id_while_tracing_is_on() -> None:
    """The handoff hook sees no RunConfig: it takes the group id from the trace, as the tool calls
    take it from theirs; the W3C trace id is the trace's."""
    agents.set_tracing_disabled(False)
    guard = Guard.in_process()
    telemetry = telemetry_of(guard)

    await Runner.run(ping_pong(), "Refund me", hooks=openai_agents.LoopwardenRunHooks(guard),
                     run_config=RunConfig(group_id="conv-traced"))

    assert {e["run_id"] for e in telemetry} == {"conv-traced"}
    assert len(telemetry) == 3 and len({e["trace_id"] for e in telemetry}) == 1
    assert len(telemetry[0]["trace_id"]) == 32


@pytest.mark.usefixtures("offline")
async def test_openai_a_handoff_of_a_run_it_cannot_tell_is_warned_about_once(caplog: pytest.LogCaptureFixture) -> None:
    """Group id only, tracing off: the handoff's run cannot be told; it goes unreported, said once with
    the fix, and the agents run on."""
    guard = Guard.in_process()
    telemetry = telemetry_of(guard)
    with caplog.at_level(logging.WARNING, logger="stream_app"):
        result = await Runner.run(ping_pong(), "Refund me", hooks=openai_agents.LoopwardenRunHooks(guard),
                                  run_config=RunConfig(group_id="conv-dark"))
    assert result.final_output == "Refunded."
    assert telemetry == []
    warnings = [r.getMessage() for r in caplog.records if "went unreported" in r.getMessage()]
    assert len(warnings) == 1 and "'triage' to 'billing'" in warnings[0] and "run_id=" in warnings[0]


@pytest.mark.usefixtures("offline")
@pytest.mark.parametrize("guarded_by", ["hooks", "guardrails"])
async def test_openai_an_agent_used_as_a_tool_is_a_spawn_of_the_sub_agent(guarded_by: str) -> None:
    """``agent.as_tool``: a spawn-class call whose child agent is the sub-agent and whose task is the
    input the model gave it (hashed as the task of that tool); other tools are not spawns."""
    guard = Guard.in_process()
    telemetry = telemetry_of(guard)
    researcher: Agent[Any] = Agent(name="researcher", model=ScriptedModel(answer("30 days")))
    research = researcher.as_tool("research", "Research a question.", failure_error_function=openai_agents.tool_failed)

    @function_tool(failure_error_function=openai_agents.tool_failed)
    def lookup_order(order: str) -> str:
        """Look an order up."""
        return "shipped"

    hooks = None
    if guarded_by == "guardrails":
        guardrails = openai_agents.LoopwardenToolGuardrails(guard, "conv-t", agent_id="lead")
        for tool in (research, lookup_order):
            tool.tool_input_guardrails, tool.tool_output_guardrails = [guardrails.input], [guardrails.output]
    else:
        hooks = openai_agents.LoopwardenRunHooks(guard, "conv-t", agent_id="lead")
    lead: Agent[Any] = Agent(name="lead", tools=[research, lookup_order], model=ScriptedModel(
        calling("research", {"input": "refund window?"}, "call-1"), calling("lookup_order", {"order": "7"}, "call-2"),
        answer("Within 30 days.")))

    result = await Runner.run(lead, "Refund window?", hooks=hooks)

    assert result.final_output == "Within 30 days."
    task_hash = guard.builder.args_hash("lead", "research", {"task": "refund window?"})
    assert fields(telemetry, "tool", "tool_class", "agent_id", "child_agent_id", "task_hash", "outcome") == [
        ("research", "spawn", "lead", "researcher", task_hash, "success"),
        ("lookup_order", None, "lead", None, None, "success"),
    ]
    assert telemetry[0]["attrs"] == {"tool_call_id": "call-1"}
    assert telemetry[0]["child_run_id"] == "conv-t/call-1"


@pytest.mark.usefixtures("offline")
@pytest.mark.parametrize("guarded_by", ["hooks", "guardrails"])
async def test_openai_a_sub_agents_calls_are_the_child_run_its_agent_tool_named(guarded_by: str) -> None:
    """The sub-agent an agent tool runs is the run ``<run>/<call id>`` its spawn named, a child of the
    calling run: its calls (seen by the hooks passed to ``as_tool`` or the guardrails on its tools) go
    there, its own agent tool nests one level deeper, and the caller's next call is its own again."""
    guard = Guard.in_process()
    telemetry = telemetry_of(guard)

    @function_tool(failure_error_function=openai_agents.tool_failed)
    def lookup_order(order: str) -> str:
        """Look an order up."""
        return "shipped"

    hooks = guardrails = None
    if guarded_by == "guardrails":
        guardrails = openai_agents.LoopwardenToolGuardrails(guard, "conv-s", agent_id="lead")
        lookup_order.tool_input_guardrails = [guardrails.input]
        lookup_order.tool_output_guardrails = [guardrails.output]
    else:
        hooks = openai_agents.LoopwardenRunHooks(guard, "conv-s", agent_id="lead")

    def agent_tool(agent: Agent[Any], name: str) -> Any:
        tool = agent.as_tool(name, f"Ask {agent.name}.", hooks=hooks, failure_error_function=openai_agents.tool_failed)
        if guardrails is not None:
            tool.tool_input_guardrails, tool.tool_output_guardrails = [guardrails.input], [guardrails.output]
        return tool

    clerk: Agent[Any] = Agent(name="clerk", tools=[lookup_order], model=ScriptedModel(
        calling("lookup_order", {"order": "8"}, "call-c1"), answer("shipped")))
    researcher: Agent[Any] = Agent(name="researcher", tools=[agent_tool(clerk, "clerk"), lookup_order],
                                   model=ScriptedModel(calling("lookup_order", {"order": "7"}, "call-r1"),
                                                       calling("clerk", {"input": "order 8?"}, "call-r2"),
                                                       answer("7 and 8 shipped")))
    lead: Agent[Any] = Agent(name="lead", tools=[agent_tool(researcher, "research"), lookup_order], model=ScriptedModel(
        calling("research", {"input": "orders 7 and 8?"}, "call-1"), calling("lookup_order", {"order": "9"}, "call-2"),
        answer("All shipped.")))

    result = await Runner.run(lead, "Where are my orders?", hooks=hooks)

    assert result.final_output == "All shipped."
    researcher_run, clerk_run = "conv-s/call-1", "conv-s/call-1/call-r2"
    assert fields(telemetry, "tool", "run_id", "parent_run_id", "root_run_id", "depth", "child_run_id",
                  "child_agent_id") == [
        # reported as they end: an agent-tool call after its sub-agent's calls
        ("lookup_order", researcher_run, "conv-s", "conv-s", 1, None, None),
        ("lookup_order", clerk_run, researcher_run, "conv-s", 2, None, None),
        ("clerk", researcher_run, "conv-s", "conv-s", 1, clerk_run, "clerk"),
        ("research", "conv-s", None, "conv-s", None, researcher_run, "researcher"),
        ("lookup_order", "conv-s", None, "conv-s", None, None, None),
    ]
    assert [e["outcome"] for e in telemetry] == ["success"] * 5


def _delegating(depth: int, runs: list[str], hooks: Any) -> Agent[Any]:
    """Agent ``level-0`` hands the work to ``level-1`` as a tool, which hands it to ``level-2``, ... down
    to ``level-<depth>``, which looks an order up (recorded in ``runs``)."""

    @function_tool(failure_error_function=openai_agents.tool_failed)
    def lookup_order(order: str) -> str:
        """Look an order up."""
        runs.append(order)
        return "shipped"

    agent: Agent[Any] = Agent(name=f"level-{depth}", tools=[lookup_order], model=ScriptedModel(
        calling("lookup_order", {"order": "7"}, f"call-{depth}-1"), answer("shipped")))
    for level in range(depth - 1, -1, -1):
        sub = agent.as_tool(f"ask_level_{level + 1}", "Delegate.", hooks=hooks,
                            failure_error_function=openai_agents.tool_failed)
        agent = Agent(name=f"level-{level}", tools=[sub], model=ScriptedModel(
            calling(f"ask_level_{level + 1}", {"input": f"split level {level}"}, f"call-{level}-1"), answer("done")))
    return agent


@pytest.mark.usefixtures("offline")
async def test_openai_agents_calling_agents_past_max_tree_depth_halt_the_tree() -> None:
    """Agents as tools nested 6 deep: the agent-tool call of the depth-5 sub-agent would start a run at
    depth 6 (``max_tree_depth`` 5): ``tree_depth`` at that call; the depth-6 sub-agent's call is refused
    (the tool never runs) and the halt ends the whole ``Runner.run``."""
    guard = Guard.in_process()
    decisions: list[dict[str, Any]] = []
    guard.on_decision(decisions.append)
    telemetry = telemetry_of(guard)
    runs: list[str] = []
    hooks = openai_agents.LoopwardenRunHooks(guard, "conv-d", agent_id="lead")

    with pytest.raises(openai_agents.AgentRunHalted, match="tree_depth") as halted:
        await Runner.run(_delegating(6, runs, hooks), "Ship it.", hooks=hooks)

    [tree] = decisions
    assert (tree["scope"], tree["verdict"], tree["root_run_id"], tree["evidence"]["depth"]) == (
        "tree", "tree_depth", "conv-d", 6)
    # The halt unwinds the agent-tool calls, each reported failed as it ends, the deepest first.
    assert [(e["tool"], e.get("depth"), e["outcome"]) for e in telemetry] == [
        (f"ask_level_{level}", level - 1 or None, "error") for level in range(6, 0, -1)]
    assert tree["trigger_event_id"] == telemetry[0]["event_id"] and runs == []
    assert halted.value.run_id == "conv-d/call-0-1/call-1-1/call-2-1/call-3-1/call-4-1/call-5-1"


@pytest.mark.usefixtures("offline")
async def test_openai_a_fan_out_of_sub_agents_alerts_at_half_and_halts_the_tree_past_100_runs() -> None:
    """A lead asks 10 area leads (agents as tools), each of which asks its reviewer 10 distinct questions:
    the 50th agent-tool call takes the tree past half of ``max_tree_runs`` (an alert), the 100th past
    100 runs (``tree_fanout``), and the next one is refused, ending the run."""
    guard = Guard.in_process()
    decisions: list[dict[str, Any]] = []
    guard.on_decision(decisions.append)
    telemetry = telemetry_of(guard)
    hooks = openai_agents.LoopwardenRunHooks(guard, "conv-f", agent_id="lead")
    areas = []
    for area in range(1, 11):
        reviewer: Agent[Any] = Agent(name=f"reviewer-{area}", model=ScriptedModel(*(answer("ok") for _ in range(10))))
        ask = reviewer.as_tool("review", "Review an issue.", hooks=hooks, failure_error_function=openai_agents.tool_failed)
        areas.append(Agent(name=f"area-{area}", tools=[ask], model=ScriptedModel(
            *(calling("review", {"input": f"issue {area}-{n}"}, f"call-{area}-{n}") for n in range(1, 11)),
            answer("reviewed"))).as_tool(f"area_{area}", "Review an area.", hooks=hooks,
                                         failure_error_function=openai_agents.tool_failed))
    lead: Agent[Any] = Agent(name="lead", tools=areas, model=ScriptedModel(
        *(calling(f"area_{area}", {"input": f"area {area}"}, f"call-{area}") for area in range(1, 11)),
        answer("done")))

    with pytest.raises(openai_agents.AgentRunHalted, match="tree_fanout"):
        await Runner.run(lead, "Review everything.", hooks=hooks)

    # Reported as they end; decided as they begin: area 1, its 10 reviews, area 2, ...
    event_of = {e["attrs"]["tool_call_id"]: e for e in telemetry if e["tool_class"] == "spawn"}
    begun = [call for area in range(1, 11) for call in (f"call-{area}", *(f"call-{area}-{n}" for n in range(1, 11)))]
    assert set(event_of) == set(begun[:100])  # the area-10 agent was refused its first call, the 101st spawn
    spawns = [event_of[call]["event_id"] for call in begun[:100]]
    assert event_of["call-10"]["outcome"] == "error"  # ended by the halt
    assert [(d["verdict"], d["action"], d["scope"], d["root_run_id"], d["trigger_event_id"], d["evidence"]["runs"])
            for d in decisions] == [
        ("tree_fanout", "alert", "tree", "conv-f", spawns[49], 51),
        ("tree_fanout", "halt", "tree", "conv-f", spawns[99], 101),
    ]


def _search_tool(runs: list[int], **options: Any) -> Any:
    def search_docs(query: str) -> str:
        """Search the docs."""
        runs.append(1)
        raise TimeoutError("search backend timed out")

    return function_tool(search_docs, failure_error_function=openai_agents.tool_failed, **options)


@pytest.mark.usefixtures("offline")
async def test_openai_guardrails_answer_a_paused_tool_and_the_run_goes_on() -> None:
    """The 5th identical timeout is paused (the run's transient streak), not halted: the guardrail tells
    the model the call was not made and when to retry, the tool does not run, and the agent answers."""
    guard = frozen()
    guardrails = openai_agents.LoopwardenToolGuardrails(guard, "conv-p")
    runs: list[int] = []
    tool = _search_tool(runs, tool_input_guardrails=[guardrails.input], tool_output_guardrails=[guardrails.output])
    model = ScriptedModel(*(calling("search_docs", {"query": "refunds"}, f"call-{n}") for n in range(1, 6)),
                          answer("The search is down; try later."))
    agent: Agent[Any] = Agent(name="support", model=model, tools=[tool])

    result = await Runner.run(agent, "Refund policy?")

    assert result.final_output == "The search is down; try later."
    assert len(runs) == 4
    [paused] = [item["output"] for item in model.inputs[-1]
                if isinstance(item, dict) and item.get("type") == "function_call_output" and item["call_id"] == "call-5"]
    assert paused.startswith("run conv-p: tool search_docs is paused by loopwarden (recursion): retry in 60.0 s")
    assert paused.endswith(". The call was not made.")
    assert not guard.run("conv-p").halted


@pytest.mark.usefixtures("offline")
async def test_openai_run_hooks_end_the_run_on_a_paused_tool() -> None:
    """Hooks cannot skip a call: a paused tool ends the run with AgentToolPaused, a ToolPaused the SDK
    lets out unwrapped, with the wait."""
    guard = frozen()
    runs: list[int] = []
    model = ScriptedModel(*(calling("search_docs", {"query": "refunds"}, f"call-{n}") for n in range(1, 6)))
    agent: Agent[Any] = Agent(name="support", model=model, tools=[_search_tool(runs)])

    with pytest.raises(openai_agents.AgentToolPaused,
                       match=r"search_docs is paused by loopwarden \(recursion\): retry in 60.0 s") as error:
        await Runner.run(agent, "Refund policy?", hooks=openai_agents.LoopwardenRunHooks(guard, "conv-hp"))

    paused = error.value
    assert isinstance(paused, ToolPaused)
    assert (paused.run_id, paused.tool, paused.retry_after_s) == ("conv-hp", "search_docs", 60.0)
    assert len(runs) == 4


# --- Claude Agent SDK -------------------------------------------------------------------------------------

def pre(tool: str, tool_input: dict[str, Any], n: int = 1, agent: tuple[str, str] | None = None) -> dict[str, Any]:
    """A ``PreToolUse`` input; ``agent``: (agent_id, agent_type) of the sub-agent making the call."""
    call = {"session_id": SESSION, "transcript_path": f"/home/dev/.claude/projects/app/{SESSION}.jsonl",
            "cwd": "/home/dev/app", "hook_event_name": "PreToolUse", "tool_name": tool, "tool_input": tool_input,
            "tool_use_id": f"toolu_{n:024d}"}
    if agent is not None:
        call["agent_id"], call["agent_type"] = agent
    return call


def use_id(n: int) -> str:
    return f"toolu_{n:024d}"


async def subagent_starts(hooks: claude_agent_sdk.ClaudeAgentGuard, agent_id: str, agent_type: str) -> None:
    start: Any = {"session_id": SESSION, "transcript_path": f"/home/dev/.claude/projects/app/{SESSION}.jsonl",
                  "cwd": "/home/dev/app", "hook_event_name": "SubagentStart", "agent_id": agent_id,
                  "agent_type": agent_type}
    assert await hooks.subagent_start(start, None, {"signal": None}) == {}


async def claude_call(hooks: claude_agent_sdk.ClaudeAgentGuard, tool: str, tool_input: dict[str, Any],
                      n: int = 1, agent: tuple[str, str] | None = None) -> tuple[Any, Any]:
    """(PreToolUse output, PostToolUse output or None when denied) of one call answering "done"."""
    call: Any = pre(tool, tool_input, n, agent)
    no_signal: Any = {"signal": None}
    before: Any = await hooks.pre_tool_use(call, call["tool_use_id"], no_signal)
    if before.get("hookSpecificOutput", {}).get("permissionDecision") == "deny":
        return before, None
    done: Any = {**call, "hook_event_name": "PostToolUse", "tool_response": "done"}
    return before, await hooks.post_tool_use(done, call["tool_use_id"], no_signal)


@pytest.mark.parametrize("tool", ["Agent", "Task"])
async def test_claude_the_agent_tool_is_a_spawn_of_its_subagent_type_with_its_prompt_as_task(tool: str) -> None:
    guard = Guard.in_process()
    telemetry = telemetry_of(guard)
    hooks = claude_agent_sdk.ClaudeAgentGuard(guard, agent_id="coding-agent")
    prompt = "List the flaky tests under tests/ and why they flake."

    await claude_call(hooks, tool, {"description": "Find flaky tests", "prompt": prompt, "subagent_type": "Explore"})
    await claude_call(hooks, tool, {"description": "Plan the fix"}, 2)  # no prompt, no type: the description
    await claude_call(hooks, "Read", {"file_path": "/home/dev/app/README.md"}, 3)

    assert fields(telemetry, "run_id", "tool", "tool_class", "agent_id", "child_agent_id", "task_hash",
                  "root_run_id", "child_run_id") == [
        (SESSION, tool, "spawn", "coding-agent", "Explore",
         guard.builder.args_hash("coding-agent", tool, {"task": prompt}), SESSION, f"{SESSION}/{use_id(1)}"),
        (SESSION, tool, "spawn", "coding-agent", None,
         guard.builder.args_hash("coding-agent", tool, {"task": "Plan the fix"}), SESSION, f"{SESSION}/{use_id(2)}"),
        (SESSION, "Read", None, "coding-agent", None, None, SESSION, None),
    ]


async def test_claude_a_sub_agents_calls_are_its_own_run_a_child_of_the_run_that_spawned_it() -> None:
    """Each sub-agent is the run its spawn named, paired by ``SubagentStart`` (or, unregistered, by its
    first call) with the oldest unpaired spawn of its type: parallel spawns of two types, then a
    sub-agent spawning its own; a sub-agent no spawn was seen for is a child of the session."""
    guard = Guard.in_process()
    telemetry = telemetry_of(guard)
    hooks = claude_agent_sdk.ClaudeAgentGuard(guard, agent_id="coding-agent")
    explore, plan = ("a-explore", "Explore"), ("a-plan", "Plan")

    await claude_call(hooks, "Agent", {"prompt": "Map the repo.", "subagent_type": "Plan"}, 1)
    await claude_call(hooks, "Agent", {"prompt": "Find flaky tests.", "subagent_type": "Explore"}, 2)
    await subagent_starts(hooks, *explore)  # starts first, but pairs with the Explore spawn
    await claude_call(hooks, "Grep", {"pattern": "flaky"}, 3, agent=explore)
    await claude_call(hooks, "Read", {"file_path": "/home/dev/app/setup.cfg"}, 4, agent=plan)  # no SubagentStart
    await claude_call(hooks, "Agent", {"prompt": "Rerun test_io 20 times."}, 5, agent=explore)
    await claude_call(hooks, "Bash", {"command": "pytest -k io --count 20"}, 6, agent=("a-rerun", "general-purpose"))
    await claude_call(hooks, "Read", {"file_path": "/etc/hosts"}, 7, agent=("a-stray", "general-purpose"))

    plan_run, explore_run, rerun = (f"{SESSION}/{use_id(n)}" for n in (1, 2, 5))
    assert fields(telemetry, "tool", "run_id", "parent_run_id", "root_run_id", "depth", "child_run_id") == [
        ("Agent", SESSION, None, SESSION, None, plan_run),
        ("Agent", SESSION, None, SESSION, None, explore_run),
        ("Grep", explore_run, SESSION, SESSION, 1, None),
        ("Read", plan_run, SESSION, SESSION, 1, None),
        ("Agent", explore_run, SESSION, SESSION, 1, rerun),
        ("Bash", rerun, explore_run, SESSION, 2, None),
        ("Read", f"{SESSION}/a-stray", SESSION, SESSION, 1, None),
    ]


async def test_claude_a_fan_out_of_sub_agents_alerts_at_half_and_halts_the_tree_past_100_runs() -> None:
    """The session spawns 10 leads and each lead 10 workers, all distinct tasks (no tree_recursion, and
    no run near its own iteration ceiling): the 50th spawn takes the tree past half of ``max_tree_runs``
    (an alert), the 100th past 100 runs (``tree_fanout``); the post hook of that spawn stops the lead,
    the next spawn is denied and stops its lead, and any sub-agent's next call is denied."""
    guard = Guard.in_process()
    decisions: list[dict[str, Any]] = []
    guard.on_decision(decisions.append)
    telemetry = telemetry_of(guard)
    hooks = claude_agent_sdk.ClaudeAgentGuard(guard, agent_id="coding-agent")

    outputs = []
    for lead in range(1, 11):
        outputs.append(await claude_call(hooks, "Agent", {"prompt": f"Triage area {lead}."}, lead))
        await subagent_starts(hooks, f"lead-{lead}", "general-purpose")
    for lead in range(1, 11):
        for worker in range(1, 11):
            n = 100 + 10 * lead + worker
            outputs.append(await claude_call(hooks, "Agent", {"prompt": f"Review issue #{lead}-{worker}."}, n,
                                             agent=(f"lead-{lead}", "general-purpose")))
            await subagent_starts(hooks, f"worker-{lead}-{worker}", "general-purpose")
    denied, _ = await claude_call(hooks, "Read", {"file_path": "/home/dev/app/x.py"}, 999,
                                  agent=("worker-2-7", "general-purpose"))

    spawns = [e["event_id"] for e in telemetry if e["tool"] == "Agent"]
    assert len(spawns) == 100
    assert [(d["verdict"], d["action"], d["scope"], d["root_run_id"], d["trigger_event_id"], d["evidence"]["runs"])
            for d in decisions] == [
        ("tree_fanout", "alert", "tree", SESSION, spawns[49], 51),
        ("tree_fanout", "halt", "tree", SESSION, spawns[99], 101),
    ]
    assert all(before == {} for before, _ in outputs[:100])
    assert outputs[99][1]["continue_"] is False and "tree_fanout" in outputs[99][1]["stopReason"]
    assert outputs[100][0]["continue_"] is False and outputs[100][1] is None
    assert denied["continue_"] is False and "tree_fanout" in denied["stopReason"]


async def test_claude_sub_agents_nesting_past_max_tree_depth_halt_the_tree_at_the_spawn() -> None:
    """Each sub-agent spawns the next: the spawn by the depth-5 sub-agent would create a run at depth 6
    (``max_tree_depth`` 5): ``tree_depth`` at that call, and the sub-agents' next calls are denied."""
    guard = Guard.in_process()
    decisions: list[dict[str, Any]] = []
    guard.on_decision(decisions.append)
    hooks = claude_agent_sdk.ClaudeAgentGuard(guard, agent_id="coding-agent")

    agent = None
    for level in range(6):  # spawned by the session (depth 0), then by sub-agents at depths 1-5
        await claude_call(hooks, "Agent", {"prompt": f"Split the work, level {level}."}, level + 1, agent=agent)
        agent = (f"a-{level + 1}", "general-purpose")
        await subagent_starts(hooks, *agent)
    denied, _ = await claude_call(hooks, "Read", {"file_path": "/home/dev/app/x.py"}, 99, agent=("a-3", "general-purpose"))

    [tree] = [d for d in decisions if d.get("scope") == "tree"]
    assert (tree["verdict"], tree["action"], tree["root_run_id"]) == ("tree_depth", "halt", SESSION)
    assert tree["evidence"]["depth"] == 6
    assert denied["continue_"] is False and "tree_depth" in denied["stopReason"]


async def test_claude_the_same_task_delegated_again_and_again_halts_the_tree() -> None:
    """The 3rd spawn of the same task to the same sub-agent type is a tree_recursion (defaults): the
    session's tree is halted, and its next call is denied and stops the agent."""
    guard = Guard.in_process()
    decisions: list[dict[str, Any]] = []
    guard.on_decision(decisions.append)
    hooks = claude_agent_sdk.ClaudeAgentGuard(guard, agent_id="coding-agent")
    task = {"description": "Fix the build", "prompt": "Make the build pass.", "subagent_type": "general-purpose"}

    for n in range(3):
        await claude_call(hooks, "Agent", task, n)
    denied, _ = await claude_call(hooks, "Agent", task, 3)

    [tree] = [d for d in decisions if d["verdict"] == "tree_recursion"]
    assert (tree["scope"], tree["action"], tree["root_run_id"]) == ("tree", "halt", SESSION)
    assert tree["evidence"]["child_agent_id"] == "general-purpose" and tree["evidence"]["spawns"] == 3
    assert denied["continue_"] is False and denied["hookSpecificOutput"]["permissionDecision"] == "deny"
    assert f"sub-agent tree {SESSION} was halted by loopwarden (tree_recursion)" in denied["stopReason"]


async def test_claude_a_paused_tool_is_denied_with_the_wait_and_the_agent_goes_on() -> None:
    guard = frozen()
    hooks = claude_agent_sdk.ClaudeAgentGuard(guard, agent_id="coding-agent")
    await pause_the_run(guard.run(SESSION, agent_id="coding-agent"), "WebFetch")

    denied, after = await claude_call(hooks, "WebFetch", {"url": "https://example.com/status"})

    assert after is None and "continue_" not in denied
    reason = denied["hookSpecificOutput"]["permissionDecisionReason"]
    assert reason.startswith(f"run {SESSION}: tool WebFetch is paused by loopwarden (recursion): retry in 60.0 s")
    assert reason.endswith("The call was not made; retry it later or do something else.")
    allowed, ran = await claude_call(hooks, "Read", {"file_path": "/home/dev/app/a.py"}, 2)
    assert allowed == {} and ran is not None  # another tool goes on


# --- LangChain and LangGraph ------------------------------------------------------------------------------

class ScriptedChatModel(GenericFakeChatModel):
    """Plays a script of replies; ``create_agent`` binds the tools to it, the script already names its calls."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedChatModel:
        return self


def chat(*replies: AIMessage) -> ScriptedChatModel:
    return ScriptedChatModel(messages=iter(replies))


def asking(tool: str, args: dict[str, Any], call_id: str) -> AIMessage:
    return AIMessage(content="", tool_calls=[{"name": tool, "args": args, "id": call_id}])


def lookup_order(order: str) -> str:
    return f"order {order}: shipped"


def nested_agents(guard: Guard, *, middleware: bool, levels: int = 2) -> Any:
    """``levels`` agents, each one's ``delegate`` tool invoking the next with a question of its own (sync
    or async alike); the innermost looks an order up. Guarded by ``LoopwardenMiddleware`` each, or by the caller's handler."""
    guarded = [langchain.LoopwardenMiddleware(guard)] if middleware else []
    agent = create_agent(chat(asking("lookup_order", {"order": "7"}, "inner-1"), AIMessage(content="shipped")),
                         [StructuredTool.from_function(lookup_order, description="Look an order up.")],
                         middleware=guarded)
    for level in range(1, levels):
        inner = agent

        def delegate(question: str, inner: Any = inner) -> str:
            return str(inner.invoke({"messages": [("user", question)]})["messages"][-1].content)

        async def adelegate(question: str, inner: Any = inner) -> str:
            return str((await inner.ainvoke({"messages": [("user", question)]}))["messages"][-1].content)

        tool = StructuredTool.from_function(delegate, coroutine=adelegate, name="delegate", description="Delegate.")
        agent = create_agent(chat(asking("delegate", {"question": f"where is 7? ({level})"}, f"call-{level}"),
                                  AIMessage(content="done")), [tool], middleware=guarded)
    return agent


def invoke(agent: Any, config: dict[str, Any], mode: str) -> Any:
    inputs = {"messages": [("user", "Where is order 7?")]}
    if mode == "sync":
        return agent.invoke(inputs, config)
    return asyncio.run(agent.ainvoke(inputs, config))


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("guarded_by", ["middleware", "handler"])
def test_langchain_an_agent_run_by_a_tool_is_a_child_run_rooted_at_the_outermost(guarded_by: str, mode: str) -> None:
    """Three agents deep: each sub-agent's calls go to a child run of its caller's, every run of the tree
    rooted at the thread's run; the outermost agent's calls stay in the thread's run, as in flat use."""
    guard = Guard.in_process()
    telemetry = telemetry_of(guard)
    agent = nested_agents(guard, middleware=guarded_by == "middleware", levels=3)
    config: dict[str, Any] = {"configurable": {"thread_id": "thread-7"}}
    if guarded_by == "handler":
        config["callbacks"] = [langchain.LoopwardenCallbackHandler(guard)]

    assert invoke(agent, config, mode)["messages"][-1].content == "done"

    # Each call is reported when it ends: the innermost first. A delegate is a spawn of the run its
    # sub-agent's calls went to, the task its arguments.
    lookup, inner_delegate, outer_delegate = telemetry
    assert fields(telemetry, "tool", "root_run_id", "depth", "tool_class") == [
        ("lookup_order", "thread-7", 2, None), ("delegate", "thread-7", 1, "spawn"),
        ("delegate", "thread-7", None, "spawn")]
    assert (outer_delegate["run_id"], outer_delegate.get("parent_run_id")) == ("thread-7", None)
    assert inner_delegate["parent_run_id"] == "thread-7"
    assert lookup["parent_run_id"] == inner_delegate["run_id"] not in ("thread-7", lookup["run_id"])
    assert (outer_delegate["child_run_id"], inner_delegate["child_run_id"]) == (inner_delegate["run_id"],
                                                                                 lookup["run_id"])
    assert outer_delegate["task_hash"] == guard.builder.args_hash(None, "delegate",
                                                                  {"task": {"question": "where is 7? (2)"}})
    assert guard.run(lookup["run_id"]).root_run_id == "thread-7"
    if guarded_by == "handler":  # one trace: the outermost LangChain run's
        assert len({e["trace_id"] for e in telemetry}) == 1


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("guarded_by", ["middleware", "handler"])
def test_langchain_agents_delegating_past_max_tree_depth_halt_the_tree_before_the_deepest_call(
        guarded_by: str, mode: str) -> None:
    """Seven agents deep: the delegate of the depth-5 agent starts a sub-agent at depth 6 (``max_tree_depth``
    5): ``tree_depth`` as that sub-agent starts, so its lookup never runs; the halt leaves ``invoke`` and
    the unwound delegates are reported failed, the one that triggered it first."""
    guard = Guard.in_process()
    decisions: list[dict[str, Any]] = []
    guard.on_decision(decisions.append)
    telemetry = telemetry_of(guard)
    agent = nested_agents(guard, middleware=guarded_by == "middleware", levels=7)
    config: dict[str, Any] = {"configurable": {"thread_id": "thread-deep"}}
    if guarded_by == "handler":
        config["callbacks"] = [langchain.LoopwardenCallbackHandler(guard)]

    with pytest.raises(TreeHalted, match="tree_depth"):
        invoke(agent, config, mode)

    [tree] = decisions
    assert (tree["verdict"], tree["root_run_id"], tree["evidence"]["depth"]) == ("tree_depth", "thread-deep", 6)
    assert fields(telemetry, "tool", "depth", "outcome") == [
        ("delegate", depth or None, "error") for depth in range(5, -1, -1)]  # no lookup_order ran
    assert tree["trigger_event_id"] == telemetry[0]["event_id"]


@pytest.mark.parametrize("guarded_by", ["middleware", "handler"])
def test_langchain_the_same_task_delegated_a_third_time_halts_the_tree(guarded_by: str) -> None:
    """A supervisor delegating the same question three times (``tree_task_repeats``): ``tree_recursion``
    as the third sub-agent starts; its call is refused and the halt leaves ``invoke``."""
    guard = Guard.in_process()
    decisions: list[dict[str, Any]] = []
    guard.on_decision(decisions.append)
    guarded = [langchain.LoopwardenMiddleware(guard)] if guarded_by == "middleware" else []
    looked_up: list[str] = []

    def lookup(order: str) -> str:
        looked_up.append(order)
        return "shipped"

    def worker() -> Any:
        return create_agent(chat(asking("lookup_order", {"order": "7"}, "w-1"), AIMessage(content="shipped")),
                            [StructuredTool.from_function(lookup, name="lookup_order", description="Look up.")],
                            middleware=guarded)

    def delegate(question: str) -> str:
        return str(worker().invoke({"messages": [("user", question)]})["messages"][-1].content)

    supervisor = create_agent(chat(*(asking("delegate", {"question": "where is 7?"}, f"s-{n}") for n in range(1, 5)),
                                   AIMessage(content="done")),
                              [StructuredTool.from_function(delegate, name="delegate", description="Delegate.")],
                              middleware=guarded)
    config: dict[str, Any] = {"configurable": {"thread_id": "thread-sup"}}
    if guarded_by == "handler":
        config["callbacks"] = [langchain.LoopwardenCallbackHandler(guard)]

    with pytest.raises(TreeHalted, match="tree_recursion"):
        supervisor.invoke({"messages": [("user", "Where is order 7?")]}, config)

    [tree] = decisions
    assert (tree["verdict"], tree["root_run_id"], tree["evidence"]["spawns"]) == ("tree_recursion", "thread-sup", 3)
    assert looked_up == ["7", "7"]


def test_langchain_flat_use_is_one_run_without_lineage() -> None:
    guard = Guard.in_process()
    telemetry = telemetry_of(guard)
    agent = nested_agents(guard, middleware=True, levels=1)

    invoke(agent, {"configurable": {"thread_id": "thread-flat"}}, "sync")

    assert fields(telemetry, "run_id", "tool", "root_run_id", "parent_run_id", "depth") == [
        ("thread-flat", "lookup_order", "thread-flat", None, None)]


def looking_up(guard: Guard, middleware: bool, replies: int = 1) -> Any:
    """An agent that looks order 7 up and answers, ``replies`` times over (a node invoked again)."""
    script = [asking("lookup_order", {"order": "7"}, f"lk-{n}") if i == 0 else AIMessage(content="shipped")
              for n in range(replies) for i in range(2)]
    return create_agent(chat(*script), [StructuredTool.from_function(lookup_order, description="Look an order up.")],
                        middleware=[langchain.LoopwardenMiddleware(guard)] if middleware else [])


def _subgraph_config(guard: Guard, guarded_by: str, thread: str) -> dict[str, Any]:
    config: dict[str, Any] = {"configurable": {"thread_id": thread}}
    if guarded_by == "handler":
        config["callbacks"] = [langchain.LoopwardenCallbackHandler(guard)]
    return config


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("guarded_by", ["middleware", "handler"])
def test_langchain_an_agent_that_is_a_node_of_a_graph_is_a_child_run_of_the_graphs(guarded_by: str, mode: str) -> None:
    """A graph whose nodes are agents (a researcher; a team, itself a graph with a worker agent): each
    node's calls go to a child run of the run outside it, named by its checkpoint namespace, rooted at
    the thread's run; the team's worker one level deeper, its parent the team's run."""
    guard = Guard.in_process()
    telemetry = telemetry_of(guard)
    middleware = guarded_by == "middleware"
    team = StateGraph(MessagesState)
    team.add_node("worker", looking_up(guard, middleware))
    team.add_edge(START, "worker")
    graph = StateGraph(MessagesState)
    graph.add_node("researcher", looking_up(guard, middleware))
    graph.add_node("team", team.compile())
    graph.add_edge(START, "researcher")
    graph.add_edge("researcher", "team")
    app = graph.compile(checkpointer=InMemorySaver())

    invoke(app, _subgraph_config(guard, guarded_by, "thread-sg"), mode)

    researcher, worker = telemetry
    assert fields(telemetry, "tool", "root_run_id", "depth") == [("lookup_order", "thread-sg", 1),
                                                                   ("lookup_order", "thread-sg", 2)]
    assert re.fullmatch(r"thread-sg/researcher:[0-9a-f-]{36}", researcher["run_id"])
    assert researcher["parent_run_id"] == "thread-sg"
    team_run = worker["parent_run_id"]
    assert re.fullmatch(r"thread-sg/team:[0-9a-f-]{36}", team_run) and worker["run_id"].startswith(team_run + "|worker:")
    assert guard.run(worker["run_id"]).root_run_id == "thread-sg"


def test_langchain_a_subgraph_calling_tools_itself_and_holding_an_agent_is_one_run_of_the_handlers_agent() -> None:
    """A team graph whose own ToolNode calls a tool, then runs a worker agent: the team's run is both the
    run of the team's calls and the worker's parent, guarded as the handler's agent both times."""
    guard = Guard.in_process()
    telemetry = telemetry_of(guard)
    team = StateGraph(MessagesState)
    team.add_node("ask", lambda state: {"messages": [asking("lookup_order", {"order": "8"}, "team-1")]})
    team.add_node("tools", ToolNode([StructuredTool.from_function(lookup_order, description="Look an order up.")]))
    team.add_node("worker", looking_up(guard, middleware=False))
    team.add_edge(START, "ask")
    team.add_edge("ask", "tools")
    team.add_edge("tools", "worker")
    graph = StateGraph(MessagesState)
    graph.add_node("team", team.compile())
    graph.add_edge(START, "team")
    config = {"configurable": {"thread_id": "thread-ops"},
              "callbacks": [langchain.LoopwardenCallbackHandler(guard, agent_id="ops")]}

    graph.compile(checkpointer=InMemorySaver()).invoke({"messages": [("user", "Where are 7 and 8?")]}, config)

    own, worker = telemetry
    assert own["run_id"] == worker["parent_run_id"] and (own["depth"], worker["depth"]) == (1, 2)
    assert {own["agent_id"], worker["agent_id"]} == {"ops"}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_langchain_a_functional_workflows_tasks_are_steps_of_its_run_and_a_graph_inside_a_task_a_sub_agent(
        mode: str) -> None:
    """An ``@entrypoint`` mapping a ``@task`` that calls a tool over 30 orders, a task calling that task,
    and a task running a graph whose node calls the tool: the tasks' calls are the thread's run, as a
    graph's own nodes' are (a task runs in its caller's graph: no child run, no tree); the graph's is a
    child run of it, named by the task holding the graph, at depth 1."""
    guard = Guard.in_process()
    telemetry = telemetry_of(guard)
    tool = StructuredTool.from_function(lookup_order, description="Look an order up.")
    team = StateGraph(MessagesState)
    team.add_node("ask", lambda state: {"messages": [asking("lookup_order", {"order": "team"}, "team-1")]})
    team.add_node("tools", ToolNode([tool]))
    team.add_edge(START, "ask")
    team.add_edge("ask", "tools")
    subgraph = team.compile()

    config = {"configurable": {"thread_id": "thread-fn"}, "callbacks": [langchain.LoopwardenCallbackHandler(guard)]}
    orders = [str(n) for n in range(30)]
    if mode == "sync":
        @task
        def look(order: str) -> str:
            return str(tool.invoke({"order": order}))

        @task
        def review(order: str) -> str:
            look(order).result()
            subgraph.invoke({"messages": [("user", order)]})
            return order

        @entrypoint(checkpointer=InMemorySaver())
        def workflow(orders: list[str]) -> list[str]:
            found = [look(order).result() for order in orders]
            review("again").result()
            return found

        assert len(workflow.invoke(orders, config)) == 30
    else:
        @task
        async def alook(order: str) -> str:
            return str(await tool.ainvoke({"order": order}))

        @task
        async def areview(order: str) -> str:
            await alook(order)
            await subgraph.ainvoke({"messages": [("user", order)]})
            return order

        @entrypoint(checkpointer=InMemorySaver())
        async def aworkflow(orders: list[str]) -> list[str]:
            found = [await alook(order) for order in orders]
            await areview("again")
            return found

        assert len(asyncio.run(aworkflow.ainvoke(orders, config))) == 30

    flat = [e for e in telemetry if e["run_id"] == "thread-fn"]
    assert len(flat) == 31 and {(e.get("parent_run_id"), e.get("depth")) for e in flat} == {(None, None)}
    (nested,) = [e for e in telemetry if e["run_id"] != "thread-fn"]
    assert re.fullmatch(r"thread-fn/a?workflow:[0-9a-f-]{36}\|a?review:[0-9a-f-]{36}", nested["run_id"])
    assert (nested["parent_run_id"], nested["root_run_id"], nested["depth"]) == ("thread-fn", "thread-fn", 1)


@pytest.mark.parametrize("guarded_by", ["middleware", "handler"])
def test_langchain_a_graph_running_its_agent_node_past_max_tree_runs_halts_the_tree(guarded_by: str) -> None:
    """A supervisor loop sending the same agent node back to work: each time a run of the thread's tree;
    the run that takes the tree past ``max_tree_runs`` (3: the thread's and three agents' runs) halts
    it at its first call, and the halt leaves ``invoke``."""
    guard = Guard.in_process(Policy.from_mapping({"fleet": {"max_tree_runs": 3}}))
    decisions: list[dict[str, Any]] = []
    guard.on_decision(decisions.append)
    telemetry = telemetry_of(guard)
    graph = StateGraph(MessagesState)
    graph.add_node("worker", looking_up(guard, guarded_by == "middleware", replies=10))
    graph.add_edge(START, "worker")
    graph.add_conditional_edges("worker", lambda state: "worker" if len(state["messages"]) < 40 else END)
    app = graph.compile(checkpointer=InMemorySaver())

    with pytest.raises(TreeHalted, match="tree_fanout"):
        invoke(app, _subgraph_config(guard, guarded_by, "thread-loop"), "sync")

    halts = [d for d in decisions if d["action"] == "halt"]
    assert [(d["verdict"], d["root_run_id"], d["trigger_event_id"]) for d in halts] == [
        ("tree_fanout", "thread-loop", telemetry[2]["event_id"])]
    assert len({e["run_id"] for e in telemetry}) == 3  # the third agent run's call ran, then the tree halted


def swarm(guard: Guard, guarded_by: str, script: dict[str, list[AIMessage]]) -> Any:
    """A langgraph-swarm of alice and bob, each with a handoff tool to the other (``transfer_to_<agent>``)
    and ``lookup_order``, playing ``script``; each agent with a middleware of its own, or none (the handler's)."""
    from langgraph_swarm import create_handoff_tool, create_swarm

    def agent(name: str, other: str) -> Any:
        tools = [create_handoff_tool(agent_name=other), StructuredTool.from_function(lookup_order,
                                                                                      description="Look an order up.")]
        guarded = [langchain.LoopwardenMiddleware(guard)] if guarded_by == "middleware" else []
        return create_agent(chat(*script[name]), tools, middleware=guarded, name=name)

    return create_swarm([agent("alice", "bob"), agent("bob", "alice")], default_active_agent="alice").compile(
        checkpointer=InMemorySaver())


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("guarded_by", ["middleware", "handler"])
def test_langchain_swarm_agents_handing_the_conversation_back_and_forth_are_halted_at_the_6th_handoff(
        guarded_by: str, mode: str) -> None:
    """langgraph-swarm's agents hand one conversation back and forth (langgraph-swarm-py#6: until the graph's
    recursion limit): each handoff is a handoff-class call from the agent handing over to the one handed to,
    and an agent handed the conversation joins the run of the agent that handed it (peers, not sub-agents),
    so ``handoff_loop`` halts the run at the 6th handoff (3 round trips) and refuses the 7th before it runs."""
    guard = Guard.in_process()
    decisions: list[dict[str, Any]] = []
    guard.on_decision(decisions.append)
    telemetry = telemetry_of(guard)
    app = swarm(guard, guarded_by, {"alice": [asking("transfer_to_bob", {}, f"a{n}") for n in range(5)],
                                    "bob": [asking("transfer_to_alice", {}, f"b{n}") for n in range(5)]})
    config = _subgraph_config(guard, guarded_by, "thread-sw") | {"recursion_limit": 100}

    with pytest.raises(RunHalted, match="handoff_loop"):
        invoke(app, config, mode)

    assert fields(telemetry, "tool", "tool_class", "agent_id", "child_agent_id") == [
        ("transfer_to_bob", "handoff", "alice", "bob"), ("transfer_to_alice", "handoff", "bob", "alice")] * 3
    (run,) = {e["run_id"] for e in telemetry}
    assert re.fullmatch(r"thread-sw/alice:[0-9a-f-]{36}", run)
    assert {(e["parent_run_id"], e["root_run_id"]) for e in telemetry} == {("thread-sw", "thread-sw")}
    assert [(d["action"], d["verdict"], d["run_id"], d["trigger_event_id"]) for d in decisions] == [
        ("halt", "handoff_loop", run, telemetry[5]["event_id"])]


@pytest.mark.parametrize("guarded_by", ["middleware", "handler"])
def test_langchain_swarm_agents_doing_work_between_handoffs_are_not_halted(guarded_by: str) -> None:
    """The same swarm, each agent looking an order up before it hands over: a successful call of another
    kind between handoffs, so ten handoffs (5 round trips) halt nothing and the conversation ends; all of
    it one run."""
    guard = Guard.in_process()
    decisions: list[dict[str, Any]] = []
    guard.on_decision(decisions.append)
    telemetry = telemetry_of(guard)

    def working(name: str, other: str) -> list[AIMessage]:
        turns = [[asking("lookup_order", {"order": f"{name}{n}"}, f"{name}-l{n}"),
                  asking(f"transfer_to_{other}", {}, f"{name}-h{n}")] for n in range(5)]
        return [message for turn in turns for message in turn] + [AIMessage(content="all shipped")]

    app = swarm(guard, guarded_by, {"alice": working("alice", "bob"), "bob": working("bob", "alice")})
    config = _subgraph_config(guard, guarded_by, "thread-work") | {"recursion_limit": 200}

    assert invoke(app, config, "sync")["messages"][-1].content == "all shipped"

    assert [e.get("tool_class") for e in telemetry].count("handoff") == 10 and len(telemetry) == 20
    assert len({e["run_id"] for e in telemetry}) == 1 and decisions == []


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_langchain_middleware_answers_a_paused_tool_and_the_agent_goes_on(mode: str) -> None:
    """The thread's run is paused on the tool: the middleware answers the call with an error message
    saying when to retry, the tool does not run, and the agent answers."""
    guard = frozen()
    asyncio.run(pause_the_run(guard.run("thread-p"), "lookup_order"))
    runs: list[str] = []

    def lookup(order: str) -> str:
        runs.append(order)
        return "shipped"

    agent = create_agent(chat(asking("lookup_order", {"order": "7"}, "call-1"), AIMessage(content="later")),
                         [StructuredTool.from_function(lookup, name="lookup_order", description="Look up.")],
                         middleware=[langchain.LoopwardenMiddleware(guard)])

    messages = invoke(agent, {"configurable": {"thread_id": "thread-p"}}, mode)["messages"]

    assert runs == [] and messages[-1].content == "later"
    [answered] = [m for m in messages if isinstance(m, ToolMessage)]
    assert (answered.status, answered.tool_call_id) == ("error", "call-1")
    assert str(answered.content).startswith(
        "run thread-p: tool lookup_order is paused by loopwarden (recursion): retry in 60.0 s")
    assert not guard.run("thread-p").halted


# --- MCP --------------------------------------------------------------------------------------------------

def indexer(guard: Guard, **options: Any) -> tuple[MCPServer, list[str]]:
    runs: list[str] = []
    server = MCPServer("indexer", middleware=[mcp.LoopGuardMiddleware(guard, **options)])

    @server.tool()
    def reindex(collection: str) -> str:
        runs.append(collection)
        return "reindexed"

    return server, runs


def meta(run_id: str) -> dict[str, Any]:
    return {mcp.RUN_ID_META_KEY: run_id}


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
async def test_mcp_calls_name_the_server_as_their_upstream(mode: str) -> None:
    """The server's name from its answers: the handshake's serverInfo, or (2026) the stamp on each
    result, which the first call precedes: that call is reported with the name its answer gave, so a
    streak (run, tool, upstream) counts it with the calls after it."""
    upstreams = ["indexer"] * 2
    guard = Guard.in_process()
    telemetry = telemetry_of(guard)
    server, _ = indexer(guard)
    async with Client(server, mode=mode) as client:
        for _ in range(2):
            await client.call_tool("reindex", {"collection": "docs"}, meta=meta("run-u"))
    assert [e.get("upstream") for e in telemetry] == upstreams


async def test_mcp_a_named_upstream_wins_from_the_first_call() -> None:
    guard = Guard.in_process()
    telemetry = telemetry_of(guard)
    server, _ = indexer(guard, upstream="https://mcp.example.com/indexer")
    async with Client(server, mode="2026-07-28") as client:
        await client.call_tool("reindex", {"collection": "docs"}, meta=meta("run-n"))
    assert [e["upstream"] for e in telemetry] == ["https://mcp.example.com/indexer"]


def test_mcp_the_server_name_is_read_from_either_answer() -> None:
    assert mcp.server_name({"protocolVersion": "2025-11-25", "serverInfo": {"name": "indexer"}}) == "indexer"
    assert mcp.server_name({"content": [], "_meta": {"io.modelcontextprotocol/serverInfo": {"name": "idx"}}}) == "idx"
    assert mcp.server_name({"content": []}) is None
    assert mcp.server_name({"serverInfo": {"name": ""}}) is None
    assert mcp.server_name(None) is None


async def test_mcp_a_storm_on_the_server_pauses_its_tool_and_the_call_is_answered_with_the_wait() -> None:
    """Ten runs' calls time out (an inner middleware standing in for the tool's backend): the tool of
    this upstream is paused (tool_storm); the 11th run's call is answered isError with the wait, and the
    tool does not run."""
    guard = Guard.in_process()
    decisions: list[dict[str, Any]] = []
    guard.on_decision(decisions.append)
    server, runs = indexer(guard, upstream="indexer")
    backend_down = True

    async def backend(ctx: ServerRequestContext[Any, Any], call_next: Any) -> Any:
        if ctx.method == "tools/call" and backend_down:
            raise TimeoutError("index store timed out")
        return await call_next(ctx)

    server.middleware.append(backend)
    async with Client(server) as client:
        for n in range(10):
            with pytest.raises(MCPError):
                await client.call_tool("reindex", {"collection": "docs"}, meta=meta(f"run-{n}"))
        backend_down = False
        paused = await client.call_tool("reindex", {"collection": "docs"}, meta=meta("run-10"))

    [storm] = [d for d in decisions if d["verdict"] == "tool_storm"]
    assert (storm["scope"], storm["action"], storm["tool"], storm["upstream"]) == ("tool", "pause", "reindex", "indexer")
    assert isinstance(paused, CallToolResult) and paused.is_error and runs == []
    [text] = [block.text for block in paused.content if isinstance(block, TextContent)]
    assert text.startswith("run run-10: tool reindex of indexer is paused by loopwarden (tool_storm): retry in ")

