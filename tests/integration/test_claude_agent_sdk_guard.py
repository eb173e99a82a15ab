"""The Claude Agent SDK guard with the real ``claude-agent-sdk`` installed. Its CLI needs the network, so
the hook callbacks are invoked the way the CLI has the SDK invoke them, with the documented hook inputs;
one test runs them through the SDK's own client and control protocol, a scripted transport standing in
for the CLI."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from claude_agent_sdk import ClaudeAgentOptions, ClaudeSDKClient, HookMatcher, Transport
from claude_agent_sdk.types import HookCallback

from stream_app.client import Guard, KafkaClientConfig
from stream_app.core import Policy
from stream_app.integrations import claude_agent_sdk as integration
from stream_app.integrations.claude_agent_sdk import ClaudeAgentGuard, is_error
from tests.integration.workers import Fleet, consume
from tests.readme_examples import example

SESSION = "9ecf22fa-edf8-4332-ae85-b6d5456eda64"
NO_SIGNAL: Any = {"signal": None}


def base(event: str, session_id: str) -> dict[str, Any]:
    return {"session_id": session_id, "transcript_path": f"/home/dev/.claude/projects/app/{session_id}.jsonl",
            "cwd": "/home/dev/app", "permission_mode": "default", "hook_event_name": event}


class Agent:
    """Plays the CLI's side of tool calls against the registered hooks: PreToolUse, then (unless denied)
    the tool, then PostToolUse with its response or PostToolUseFailure with its error."""

    def __init__(self, hooks: dict[str, list[HookMatcher]], session_id: str = SESSION) -> None:
        self.hooks = hooks
        self.session_id = session_id
        self.agent: tuple[str, str] | None = None  # (agent_id, agent_type) of the sub-agent calling, if any
        self.ran = 0
        self.ids = (f"toolu_{n:024d}" for n in itertools.count())

    def callback(self, event: str) -> HookCallback:
        [matcher] = self.hooks[event]
        assert matcher.matcher is None  # every tool
        [callback] = matcher.hooks
        return callback

    async def call(self, tool: str, tool_input: dict[str, Any], response: Any = None, *,
                   error: str | None = None) -> tuple[Any, Any]:
        """(PreToolUse output, post hook output or None when the call was denied)."""
        tool_use_id = next(self.ids)
        call = {**base("PreToolUse", self.session_id), "tool_name": tool, "tool_input": tool_input,
                "tool_use_id": tool_use_id}
        if self.agent is not None:
            call["agent_id"], call["agent_type"] = self.agent
        before = await self.callback("PreToolUse")(call, tool_use_id, NO_SIGNAL)
        if before.get("hookSpecificOutput", {}).get("permissionDecision") == "deny":
            return before, None
        self.ran += 1
        if error is None:
            after = await self.callback("PostToolUse")(
                {**call, "hook_event_name": "PostToolUse", "tool_response": response, "duration_ms": 12},
                tool_use_id, NO_SIGNAL)
        else:
            after = await self.callback("PostToolUseFailure")(
                {**call, "hook_event_name": "PostToolUseFailure", "error": error, "is_interrupt": False,
                 "duration_ms": 12}, tool_use_id, NO_SIGNAL)
        return before, after


def guarded(policy: Policy | None = None) -> tuple[Guard, dict[str, list[HookMatcher]]]:
    guard = Guard.in_process(policy)
    hooks = ClaudeAgentGuard(guard, agent_id="coding-agent")
    return guard, {
        "PreToolUse": [HookMatcher(hooks=[hooks.pre_tool_use])],
        "PostToolUse": [HookMatcher(hooks=[hooks.post_tool_use])],
        "PostToolUseFailure": [HookMatcher(hooks=[hooks.post_tool_use_failure])],
    }


def readme() -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    exec(example("### Claude Agent SDK"), namespace)
    return namespace


def test_readme_registers_the_hooks_in_real_options() -> None:
    """The README's options are the SDK's ClaudeAgentOptions, with the guard's three tool callbacks on
    every tool and its sub-agent start callback."""
    namespace = readme()
    options, hooks = namespace["options"], namespace["hooks"]
    assert isinstance(options, ClaudeAgentOptions)
    assert {event: [(m.matcher, m.hooks) for m in matchers] for event, matchers in options.hooks.items()} == {
        "PreToolUse": [(None, [hooks.pre_tool_use])],
        "PostToolUse": [(None, [hooks.post_tool_use])],
        "PostToolUseFailure": [(None, [hooks.post_tool_use_failure])],
        "SubagentStart": [(None, [hooks.subagent_start])],
    }


async def test_fourth_identical_failure_stops_the_agent_and_the_next_call_is_denied() -> None:
    """Through the README's hooks: a command failing the same way four times halts the session's run
    (defaults); the 4th failure's post hook already stops the agent, and the next PreToolUse denies the
    call with the reason and stops the agent again, so the tool does not run a 5th time."""
    namespace = readme()
    decisions: list[dict[str, Any]] = []
    namespace["guard"].on_decision(decisions.append)
    agent = Agent(namespace["options"].hooks)
    command = {"command": "pytest tests/test_api.py", "description": "Run the API tests"}

    outputs = [await agent.call("Bash", command, error="Exit code 1\nE   ModuleNotFoundError: No module named 'api'")
               for _ in range(5)]

    assert agent.ran == 4
    advice, halt = decisions
    assert (halt["action"], halt["verdict"], halt["run_id"], halt["agent_id"]) == (
        "halt", "recursion", SESSION, "coding-agent")
    stop = f"run {SESSION} was halted by loopwarden (recursion): {halt['reason']} [decision {halt['decision_id']}]"
    # The 3rd failure's hook gives Claude the warning as additional context, with that call's result.
    warned = {"hookSpecificOutput": {"hookEventName": "PostToolUseFailure",
                                     "additionalContext": f"loopwarden: {advice['reason']}"}}
    assert advice["action"] == "advise"
    assert [after for _, after in outputs[:4]] == [{}, {}, warned, {"continue_": False, "stopReason": stop}]
    assert outputs[4] == ({
        "continue_": False,
        "stopReason": stop,
        "hookSpecificOutput": {"hookEventName": "PreToolUse", "permissionDecision": "deny",
                               "permissionDecisionReason": stop},
    }, None)


async def test_error_responses_of_post_tool_use_count_as_failures() -> None:
    """An MCP tool answering isError through PostToolUse fails like a failing tool: halted at the 4th."""
    guard, hooks = guarded()
    agent = Agent(hooks)
    response = {"content": [{"type": "text", "text": "rate limited"}], "isError": True}
    outputs = [await agent.call("mcp__search__query", {"q": "refund policy"}, response) for _ in range(5)]
    assert agent.ran == 4 and outputs[3][1]["continue_"] is False and outputs[4][1] is None
    assert guard.run(SESSION, agent_id="coding-agent").calls == 4


async def test_a_changing_outcome_is_a_retry() -> None:
    """Failures followed by a success, again and again, never stop the agent."""
    _, hooks = guarded()
    agent = Agent(hooks)
    for _ in range(3):
        for _ in range(2):
            await agent.call("Bash", {"command": "npm test"}, error="Exit code 1")
        before, after = await agent.call("Bash", {"command": "npm test"}, {"stdout": "ok", "stderr": "",
                                                                            "interrupted": False})
        assert before == {} and "continue_" not in after  # at most a warning (the cycle rule's, on round 3)
    assert agent.ran == 9


@pytest.mark.parametrize(
    ("response", "failed"),
    [
        ({"content": [{"type": "text", "text": "boom"}], "is_error": True}, True),  # an SDK @tool result
        ({"content": [{"type": "text", "text": "boom"}], "isError": True}, True),  # an MCP tool result
        ({"filePath": "/home/dev/app/a.py", "success": False}, True),
        ({"filePath": "/home/dev/app/a.py", "success": True}, False),
        ({"stdout": "", "stderr": "warning: deprecated", "interrupted": False}, False),  # Bash ran
        ([{"type": "text", "text": "42"}], False),
        (None, False),  # nothing: reported as empty, not as an error
    ],
)
def test_error_is_read_from_the_response_shape(response: Any, failed: bool) -> None:
    assert is_error(response) is failed


async def test_a_duplicate_side_effect_is_denied_with_the_earlier_result() -> None:
    """Sending the same message again within 60 s: denied with the first receipt in the reason, the agent
    goes on, the tool ran once."""
    _, hooks = guarded(Policy.from_mapping({"tools": {"mcp__slack__post": {"side_effect": True}}}))
    agent = Agent(hooks)
    message = {"channel": "#ops", "text": "deploy done"}
    receipt = {"content": [{"type": "text", "text": "posted ts=1718.22"}]}
    first = await agent.call("mcp__slack__post", message, receipt)
    again = await agent.call("mcp__slack__post", message, receipt)

    assert first == ({}, {}) and agent.ran == 1
    before, after = again
    assert after is None and "continue_" not in before
    denial = before["hookSpecificOutput"]
    assert denial["permissionDecision"] == "deny"
    assert denial["permissionDecisionReason"].endswith(f"Its result was: {orjson.dumps(receipt).decode()}")


async def test_a_duplicate_whose_earlier_result_json_cannot_say_is_denied_with_its_text() -> None:
    """An earlier response holding an integer past 64 bits (an amount in wei): the repeat is denied with
    the response's text (the hook raised orjson's TypeError instead of answering)."""
    _, hooks = guarded(Policy.from_mapping({"tools": {"mcp__chain__transfer": {"side_effect": True}}}))
    agent = Agent(hooks)
    transfer = {"to": "0xabc", "wei": "100000000000000000000000000000"}
    receipt = {"tx": "0x1", "wei": 10**29}
    await agent.call("mcp__chain__transfer", transfer, receipt)
    before, _ = await agent.call("mcp__chain__transfer", transfer, receipt)
    assert agent.ran == 1
    denial = before["hookSpecificOutput"]
    assert denial["permissionDecision"] == "deny" and str(10**29) in denial["permissionDecisionReason"]


async def test_sessions_are_separate_runs() -> None:
    """One session's halt does not deny another session's calls."""
    _, hooks = guarded()
    halted, other = Agent(hooks, "session-a"), Agent(hooks, "session-b")
    for _ in range(5):
        await halted.call("Read", {"file_path": "/missing"}, error="File does not exist.")
    assert await other.call("Read", {"file_path": "/missing"}, error="File does not exist.") == ({}, {})
    assert (halted.ran, other.ran) == (4, 1)


async def test_calls_that_never_finish_are_forgotten() -> None:
    """Calls another hook or the user denied get no post hook; the guard keeps only the newest pending
    ones, and a post hook for a forgotten call reports nothing."""
    guard, hooks = guarded()
    agent = Agent(hooks)
    pre = agent.callback("PreToolUse")
    for n in range(integration._MAX_PENDING + 1):
        call = {**base("PreToolUse", SESSION), "tool_name": "Read", "tool_input": {"file_path": f"/f{n}"},
                "tool_use_id": f"toolu_{n}"}
        assert await pre(call, call["tool_use_id"], NO_SIGNAL) == {}
    post = agent.callback("PostToolUse")
    for n in (0, integration._MAX_PENDING):
        done = {**base("PostToolUse", SESSION), "tool_name": "Read", "tool_input": {"file_path": f"/f{n}"},
                "tool_use_id": f"toolu_{n}", "tool_response": {"content": "x"}}
        assert await post(done, done["tool_use_id"], NO_SIGNAL) == {}
    assert guard.run(SESSION, agent_id="coding-agent").calls == 1


class ScriptedCLI(Transport):
    """The CLI's side of the SDK's control protocol: answers ``initialize`` (noting the hook callback
    ids it registers) and sends ``hook_callback`` requests, returning the SDK's wire answers."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.callback_ids: dict[str, list[str]] = {}
        self.answers: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.ready = False

    async def connect(self) -> None:
        self.ready = True

    async def write(self, data: str) -> None:
        for line in data.splitlines():
            message = json.loads(line)
            if message["type"] == "control_request" and message["request"]["subtype"] == "initialize":
                self.callback_ids = {event: [i for m in matchers for i in m["hookCallbackIds"]]
                                     for event, matchers in message["request"]["hooks"].items()}
                await self.inbox.put({"type": "control_response", "response": {
                    "subtype": "success", "request_id": message["request_id"], "response": {}}})
            elif message["type"] == "control_response":
                self.answers.pop(message["response"]["request_id"]).set_result(message["response"])

    async def read_messages(self) -> AsyncIterator[dict[str, Any]]:
        while (message := await self.inbox.get()) is not None:
            yield message

    async def close(self) -> None:
        self.ready = False
        await self.inbox.put(None)

    def is_ready(self) -> bool:
        return self.ready

    async def end_input(self) -> None:
        return None

    async def hook(self, event: str, input_data: dict[str, Any]) -> dict[str, Any]:
        """Run the hook registered for ``event`` in the SDK; the SDK's answer as the CLI receives it."""
        request_id = f"cli-{len(self.answers)}-{input_data['tool_use_id']}-{event}"
        self.answers[request_id] = asyncio.get_running_loop().create_future()
        [callback_id] = self.callback_ids[event]
        await self.inbox.put({"type": "control_request", "request_id": request_id, "request": {
            "subtype": "hook_callback", "callback_id": callback_id, "input": input_data,
            "tool_use_id": input_data["tool_use_id"]}})
        answer = await asyncio.wait_for(self.answers[request_id], 10)
        assert answer["subtype"] == "success", answer
        return answer["response"]


async def test_the_sdk_carries_the_stop_to_the_cli() -> None:
    """Through ClaudeSDKClient and its control protocol: the hooks are registered at initialize, and
    once the run is halted the CLI receives ``continue: false`` with the stop reason and the denial."""
    cli = ScriptedCLI()
    async with ClaudeSDKClient(readme()["options"], transport=cli):
        assert set(cli.callback_ids) == {"PreToolUse", "PostToolUse", "PostToolUseFailure", "SubagentStart"}
        answers = []
        for n in range(5):
            call = {**base("PreToolUse", SESSION), "tool_name": "Grep", "tool_input": {"pattern": "TODO"},
                    "tool_use_id": f"toolu_{n}"}
            answers.append(await cli.hook("PreToolUse", call))
            if n < 4:
                await cli.hook("PostToolUse", {**call, "hook_event_name": "PostToolUse", "tool_response": ""})

    assert answers[:4] == [{}] * 4
    assert answers[4]["continue"] is False and "continue_" not in answers[4]
    assert answers[4]["stopReason"].startswith(f"run {SESSION} was halted by loopwarden (recursion)")
    assert answers[4]["hookSpecificOutput"]["permissionDecision"] == "deny"


@pytest.mark.integration
async def test_fleet_halt_reaches_the_agent(kafka_bootstrap: str, tmp_path: Path) -> None:
    """With a real worker on the real broker: telemetry keyed by the session id carries each
    tool_use_id; the worker's signed halt makes the next PreToolUse deny and stop the agent."""
    fleet = Fleet(kafka_bootstrap, tmp_path, partitions=2)
    await asyncio.to_thread(fleet.start_worker)
    try:
        async with Guard.fleet(KafkaClientConfig(kafka_bootstrap), fleet.telemetry_topic, fleet.control_topic,
                               trusted_keys=fleet.trusted_keys()) as guard:
            hooks = ClaudeAgentGuard(guard, agent_id="coding-agent")
            agent = Agent({"PreToolUse": [HookMatcher(hooks=[hooks.pre_tool_use])],
                           "PostToolUseFailure": [HookMatcher(hooks=[hooks.post_tool_use_failure])]})
            for _ in range(4):
                await agent.call("Bash", {"command": "make deploy"}, error="Exit code 2")
            async with asyncio.timeout(30):
                while not guard.run(SESSION, agent_id="coding-agent").halted:
                    await asyncio.sleep(0.05)
            before, after = await agent.call("Bash", {"command": "make deploy"}, error="Exit code 2")
        records = await consume(kafka_bootstrap, fleet.telemetry_topic, 4, settle=0.5)
    finally:
        await asyncio.to_thread(fleet.stop)

    assert agent.ran == 4 and after is None
    assert before["continue_"] is False and before["hookSpecificOutput"]["permissionDecision"] == "deny"
    telemetry = [orjson.loads(r.value) for r in records]
    assert {r.key for r in records} == {SESSION.encode()}
    assert [(e["tool"], e["outcome"], e["agent_id"], e["attrs"]["tool_call_id"], e["latency_ms"])
            for e in telemetry] == [("Bash", "error", "coding-agent", f"toolu_{n:024d}", 12) for n in range(4)]


@pytest.mark.integration
async def test_fleet_a_runaway_chain_of_sub_agents_is_halted_by_the_workers_tree_fold(
        kafka_bootstrap: str, tmp_path: Path) -> None:
    """Sub-agents spawning sub-agents through the README's hooks, published to a real worker with the
    rules across runs: each sub-agent is its own run in the session's tree, so the worker's tree fold sees
    the spawn by the depth-5 sub-agent (a run at depth 6) and halts the tree by the same decision the
    runtime's own fold made (same id, same triggering spawn)."""
    fleet = Fleet(kafka_bootstrap, tmp_path, partitions=2, settings={"fleet_rules": True})
    await asyncio.to_thread(fleet.start_worker)
    try:
        async with Guard.fleet(KafkaClientConfig(kafka_bootstrap), fleet.telemetry_topic, fleet.control_topic,
                               trusted_keys=fleet.trusted_keys()) as guard:
            local: list[dict[str, Any]] = []
            guard.on_decision(local.append)
            hooks = ClaudeAgentGuard(guard, agent_id="coding-agent")
            options = {"PreToolUse": [HookMatcher(hooks=[hooks.pre_tool_use])],
                       "PostToolUse": [HookMatcher(hooks=[hooks.post_tool_use])],
                       "SubagentStart": [HookMatcher(hooks=[hooks.subagent_start])]}
            agent = Agent(options)
            start = agent.callback("SubagentStart")
            for level in range(6):
                await agent.call("Agent", {"prompt": f"Split the work, level {level}."}, "done")
                await start({**base("SubagentStart", SESSION), "agent_id": f"a-{level + 1}",
                             "agent_type": "general-purpose"}, None, NO_SIGNAL)
                agent.agent = (f"a-{level + 1}", "general-purpose")
        control = await consume(kafka_bootstrap, fleet.control_topic, 1, settle=1.0)
    finally:
        await asyncio.to_thread(fleet.stop)

    [fleet_halt] = [m for m in map(orjson.loads, (r.value for r in control)) if m.get("scope") == "tree"]
    [local_halt] = [d for d in local if d.get("scope") == "tree"]
    assert (fleet_halt["scope"], fleet_halt["verdict"], fleet_halt["root_run_id"]) == ("tree", "tree_depth", SESSION)
    assert fleet_halt["decision_id"] == local_halt["decision_id"]
    assert fleet_halt["trigger_event_id"] == local_halt["trigger_event_id"]
