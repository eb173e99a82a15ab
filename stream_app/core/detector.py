"""The detector: a fold of one run's tool calls into decisions.

``Detector.evaluate(state, event)`` updates a run's ``RunState`` in place and returns the decisions the
event triggers. It reads no clock and does no I/O: time is the events' ``ts_ms``, so replaying a
telemetry file, a Kafka partition or an in-process run gives the same decisions every time.

The rules, in the order they win when several fire on one event (at most one decision per event, beside
a warning):

1. ``iteration_ceiling`` halt: the run made more calls than its ceiling, whatever they were.
1b. ``budget_exceeded`` halt: the call's cost or tokens took the run strictly past its budget
   (``evidence.budget``: ``cost``, ``tokens``), or the tool was called more than its ``max_calls``
   (``calls``); the call ran.
2. ``circuit_open`` halt: a side-effecting call repeated ``circuit_open_at`` times within its window.
3. ``recursion`` / ``semantic_loop`` halt: the same tool failed with the identical outcome and result
   more times in a row than the retry budget allows; ``recursion`` when the (normalised) arguments
   were identical too, ``semantic_loop`` when they mutated. Two failing results are identical when their
   hashes are, or failing that their fingerprints (the hash with volatile tokens masked,
   ``core/volatile.py``): ``evidence.match`` says which.
4. ``cycle`` halt: a sequence of 2 or 3 calls with identical outcomes, one failing, repeated.
5. ``no_progress`` halt (``evidence.rule: reads``): a successful read-class call returned the same
   result to the same call for the ``no_progress_at``-th time with no successful write-class call and
   no ``plan_step`` advance since (not necessarily in a row; poll-class calls are exempt).
6. ``oscillation`` halt: a write-class call's after-state (``state_hash`` of its ``target``) revisited
   an earlier state of that target, other than the immediately previous one, for the
   ``oscillation_revisits``-th time (S1, S0, S1, S0, S1 halts at the 5th write).
7. ``duplicate_call`` suppress: a side-effecting call repeated within its window (hand back the
   earlier result instead of acting again).
8. ``polling`` alert: the same call succeeded with the same result many times in a row (advisory).

Model calls (``kind: model_call``, an inference; its ``tool`` is the model) never count toward the
ceiling, streaks, cycles or side effects: they spend (budgets), and ``max_model_calls_without_tool`` of
them in a row with no tool call between halt (``no_progress``, ``evidence.rule: model_calls``).

A warning (``advise``, on unless the policy's ``advise`` is false) comes one step before a halt: at a
streak's budget, one cycle short, one read and one revisit short, and at the first call reaching 80% of a
budget; at most one per rule per streak (``RunState.advised``). When the same call also decides, the
warning goes out first. Halt points never move.

Streak decisions tell their story in the evidence: ``event_ids`` (the first and the most recent 9 of the
streak) and, for failing streaks, ``args_diff`` (``core/argsdiff.py``: what changed in the normalised
arguments since the streak's first call).

A write whose ``state_hash`` equals its target's previous one changed nothing: the rules see its outcome
as ``noop`` (so repeating it halts by recursion); the evidence keeps the reported ``outcome`` beside the
``effective_outcome``. Tool classes (``read``, ``write``, ``poll``, ``spawn``, ``handoff``, ``other``)
come from the event, else the tool's policy; ``other`` is the behaviour of every release before them.

In shadow mode (a policy setting, per agent or tool) the halting and suppressing rules publish an
``alert`` instead, and the run carries on as if halted and resumed at once. ``Detector.operate`` applies
an operator's (verified) halt or resume, in order with the run's calls. A resume (or a shadow alert)
starts the call count, streaks and per-tool counts again but keeps what the run spent: a cost or token
budget fires when a call crosses it, once, so a run resumed past its budget is not stopped by it again.

Repetition of a call is not a loop; repetition of a call *with an identical failing outcome* is. Any
change of outcome or result hash breaks a streak, and an advancing ``plan_step`` resets every streak.

State is O(1) in the run's length: fixed-size digests, rings capped by policy, no history.
"""

from __future__ import annotations

import hashlib
import zlib
from array import array
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .argsdiff import args_diff
from .contract import (
    Action,
    Decision,
    OperatorCommand,
    TelemetryEvent,
    Verdict,
    is_transient,
    micro_usd,
    token_count,
)
from .errors import NormalisationError
from .normalize import canonical_json, normalise, semantic_hash
from .policy import CallPolicy, Policy, Thresholds

# Digests are 8 bytes: a collision needs ~2**32 distinct values within one run's small windows. They are
# cut from the SHA-256 hashes already computed (no second hash), or from two checksums for ids and names.
_DIGEST = 8
_KEY = _DIGEST + 5  # streak key: result digest + outcome code + tool checksum
_SIG = _DIGEST + _KEY  # step signature: call digest + streak key
_CYCLE_PERIODS = (2, 3)
_SIDE_EFFECT_SLOTS = 32  # distinct side-effecting calls remembered per run within their window
_UNVERIFIED = ""  # args hash of a call whose arguments could not be normalised: compared by tool only
_OUTCOME_CODE = {"success": b"s", "error": b"e", "empty": b"0", "noop": b"n"}
_READ_SLOTS = 16  # distinct (call, result) digests of successful reads remembered per run
_TARGET_SLOTS = 8  # written targets remembered per run...
_STATE_SLOTS = 8  # ...and after-states per target
_TOOL_COUNT_SLOTS = 32  # tools with a max_calls counted per run, least recently called evicted
_SPEND_CAP = 1 << 62
_STREAK_IDS = 10  # event ids of a streak its evidence lists: the first and the most recent 9
_ID_CHARS = 64  # ...each cut to this many characters
_ARGS_BYTES = 512  # the largest canonical arguments a failing streak keeps for its args diff


def _nears(before: int, after: int, limit: int) -> bool:
    """Whether a sum going from ``before`` to ``after`` first reaches 80% of ``limit`` (0: no limit)."""
    return limit > 0 and before * 5 < limit * 4 <= after * 5


def _checksum(text: str) -> bytes:
    """8 stable bytes for an id or name (crc32 + adler32: cheap, and stable across processes)."""
    return _checksum_bytes(text.encode())


def _checksum_bytes(raw: bytes) -> bytes:
    return ((zlib.crc32(raw) << 32) | zlib.adler32(raw)).to_bytes(8, "big")


def _tool_of(tool_digest: bytes, upstream: str) -> bytes:
    """The streak's 4 bytes for a tool called at a named upstream: crc32 of the tool's name, U+001F and
    the upstream (a streak counts per run, tool and upstream: the same failure from another host is
    another streak)."""
    return zlib.crc32(b"\x1f" + upstream.encode(), int.from_bytes(tool_digest, "big")).to_bytes(4, "big")


def _short(hash_text: str) -> bytes:
    """8 bytes of a hash string: its first 16 hex digits when it is hex (ours are), else a checksum."""
    try:
        raw = bytes.fromhex(hash_text[:16])
        if len(raw) == _DIGEST:  # fromhex skips spaces: "0a 0b ..." is not 16 hex digits
            return raw
    except ValueError:
        pass
    return _checksum(hash_text)


def _contains(ring: bytes, digest: bytes) -> bool:
    """Whether ``digest`` is one of the aligned 8-byte entries of ``ring``."""
    at = ring.find(digest)
    while at != -1:
        if at % _DIGEST == 0:
            return True
        at = ring.find(digest, at + 1)
    return False


@dataclass(slots=True)
class RunState:
    """Everything the detector remembers about one run. Mutated in place by ``Detector.evaluate``."""

    calls: int = 0
    last_ts_ms: int = 0
    halted_by: str | None = None
    plan_step: int | None = None
    #: Digests of the most recent event ids (duplicate delivery filter), oldest first.
    seen_ids: bytes = b""
    #: Current streak: consecutive calls with the same (tool, upstream, outcome, result hash).
    streak_key: bytes = b""
    streak_call: bytes = b""
    streak_varied: bool = False
    streak_ts: array[int] = field(default_factory=lambda: array("q"))
    streak_first_event_id: str = ""
    streak_alerted: bool = False
    #: Streak key of the last call's fingerprint (failing calls only; b"" otherwise), and whether a member
    #: joined the streak by fingerprint alone.
    streak_fp: bytes = b""
    streak_fuzzy: bool = False
    #: Step signatures and times of the last few calls (cycle detection), oldest first.
    recent_sigs: bytes = b""
    recent_ts: array[int] = field(default_factory=lambda: array("q"))
    #: Bit i set = the call i steps back failed.
    recent_failing: int = 0
    #: Side-effecting call digest -> [first_ts_ms, occurrences] within its window.
    side_effects: dict[bytes, list[int]] | None = None
    #: Successful reads since the last successful write: (call, result, tool) digest -> occurrences,
    #: least recently seen first.
    reads: dict[bytes, int] | None = None
    #: Written targets, least recently written first: target digest -> [after-state digests (oldest
    #: first, each once, the previous one last), revisits].
    targets: dict[bytes, list[Any]] | None = None
    #: Spent so far (micro-USD, tokens), and model calls since the last tool call.
    cost_micro: int = 0
    tokens: int = 0
    model_streak: int = 0
    #: Calls per tool with a ``max_calls`` (tool digest -> calls), least recently called first.
    tool_counts: dict[bytes, int] | None = None
    #: Advice given (bit 1: for the current streak, bit 2: for the current cycle): at most one each.
    advised: int = 0
    #: Ids of the streak's members after the first, the most recent ``_STREAK_IDS - 1``, each cut to
    #: ``_ID_CHARS``: one text, and each id's length in characters (a byte each; ``streak_id_list``
    #: splits them); the canonical arguments of its first call if it failed with raw arguments of at
    #: most ``_ARGS_BYTES`` (b"" otherwise): the evidence's story. One str and one bytes, not a list of
    #: strings: a run's state stays small.
    streak_ids: str = ""
    streak_id_lens: bytes = b""
    streak_args: bytes = b""
    #: Every failure of the current streak was transient (``core.fleet.is_transient``), and the pauses it
    #: has had instead of a halt (the third time it would pause, it halts).
    streak_transient: bool = False
    streak_pauses: int = 0
    #: Handoffs in a row going back and forth between two agents (since the last successful call of
    #: another class), and the (from, to) agent digests of the last.
    handoffs: int = 0
    handoff_from: bytes = b""
    handoff_to: bytes = b""
    #: The run made a spawn-class call: as a tree's root, what it spends from then on is the tree's
    #: (``core.fleet.trees.tree_fact``). Kept across resumes, as the spend is.
    spawned: bool = False

    def streak_id_list(self) -> list[str]:
        """The streak's member ids after the first, oldest first."""
        ids, at = [], 0
        for length in self.streak_id_lens:
            ids.append(self.streak_ids[at : at + length])
            at += length
        return ids

    def reset_streaks(self) -> None:
        """Forget repetition evidence (progress was made, or an operator resumed the run)."""
        self.streak_key = self.streak_call = self.streak_fp = b""
        self.streak_varied = self.streak_alerted = self.streak_fuzzy = False
        self.streak_ts = array("q")
        self.streak_first_event_id = ""
        self.streak_args = self.streak_id_lens = b""
        self.streak_ids = ""
        self.recent_sigs = b""
        self.recent_ts = array("q")
        self.recent_failing = 0
        self.reads = self.targets = None
        self.advised = 0
        self.streak_transient = False
        self.streak_pauses = 0
        self.handoffs = 0
        self.handoff_from = self.handoff_to = b""

    def copy(self) -> RunState:
        """An independent copy (a scratch state to ask "what would this event decide?")."""
        return RunState(
            self.calls, self.last_ts_ms, self.halted_by, self.plan_step, self.seen_ids, self.streak_key,
            self.streak_call, self.streak_varied, array("q", self.streak_ts), self.streak_first_event_id,
            self.streak_alerted, self.streak_fp, self.streak_fuzzy, self.recent_sigs, array("q", self.recent_ts),
            self.recent_failing,
            {k: list(v) for k, v in self.side_effects.items()} if self.side_effects is not None else None,
            dict(self.reads) if self.reads is not None else None,
            {k: list(v) for k, v in self.targets.items()} if self.targets is not None else None,
            self.cost_micro, self.tokens, self.model_streak,
            dict(self.tool_counts) if self.tool_counts is not None else None, self.advised,
            self.streak_ids, self.streak_id_lens, self.streak_args, self.streak_transient, self.streak_pauses,
            self.handoffs, self.handoff_from, self.handoff_to, self.spawned,
        )


class Evaluation(NamedTuple):
    """What one event did: ``duplicate`` if it was a redelivery (ignored), and its decisions."""

    duplicate: bool
    decisions: tuple[Decision, ...]


DUPLICATE = Evaluation(True, ())
_NOTHING = Evaluation(False, ())


def decision_id(run_id: str, trigger_event_id: str, action: str, verdict: str) -> str:
    """Stable id of a decision: the same trigger always yields the same id (idempotent halts)."""
    raw = "\x1f".join((run_id, trigger_event_id, action, verdict)).encode()
    return hashlib.sha256(raw).hexdigest()[:32]


class Detector:
    """Applies a ``Policy`` to runs. Stateless itself: all run memory is in the ``RunState`` passed in."""

    def __init__(self, policy: Policy | None = None) -> None:
        self.policy = policy or Policy()

    def evaluate(self, state: RunState, event: TelemetryEvent) -> Evaluation:
        """Fold one event into its run's state; return the decisions it triggers."""
        call_policy = self.policy.resolve(event.agent_id, event.tool)
        thresholds = call_policy.thresholds
        event_digest = _checksum(event.event_id)
        if _contains(state.seen_ids, event_digest):
            return DUPLICATE
        state.seen_ids = (state.seen_ids + event_digest)[-_DIGEST * thresholds.dedupe_window :]
        if event.ts_ms > state.last_ts_ms:
            state.last_ts_ms = event.ts_ms
        if state.halted_by is not None:
            if event.kind != "model_call" and (event.tool_class or thresholds.tool_class) == "spawn":
                state.spawned = True  # a halted root spawning anyway: its tree fact carries what it spent
            return _NOTHING
        if event.kind == "model_call":
            return self._model_call(state, event, thresholds)
        state.calls += 1
        state.model_streak = 0
        spent, nearing = self._spend(state, event, thresholds)
        if thresholds.max_calls:
            calls = self._count_tool(state, call_policy.tool_digest)
            if spent is None and calls > thresholds.max_calls:
                spent = ("calls", calls)
            elif nearing is None and _nears(calls - 1, calls, thresholds.max_calls):
                nearing = ("calls", calls)

        if event.plan_step is not None and (state.plan_step is None or event.plan_step > state.plan_step):
            if state.plan_step is not None:
                state.reset_streaks()
            state.plan_step = event.plan_step

        args_hash, args_verified, args_text = _args_hash(event, call_policy)
        result_hash = _result_hash(event, call_policy)
        call = _short(args_hash) if args_verified else _short(_UNVERIFIED)
        tool_sum = call_policy.tool_digest
        tool_class = event.tool_class or thresholds.tool_class
        if tool_class == "spawn":
            state.spawned = True
        outcome = event.outcome
        revisit = 0
        if tool_class == "write" and event.target is not None and event.state_hash is not None:
            revisit, unchanged = self._write(state, _checksum(event.target), _short(event.state_hash))
            if unchanged:
                outcome = "noop"  # the write changed nothing
        failing = outcome != "success"
        reads = 0
        if tool_class == "read" and not failing:
            reads = self._read(state, _checksum_bytes(call + _short(result_hash) + tool_sum))
        elif tool_class == "write" and not failing:
            state.reads = None  # a successful write is progress
        handoffs = 0
        if tool_class == "handoff":
            handoffs = self._handoff(state, event)
        elif not failing:
            state.handoffs = 0  # a successful call of another class: the agents got somewhere

        occurrences = self._side_effect_occurrence(state, event, call + tool_sum, thresholds)
        code = _OUTCOME_CODE[outcome]
        streak_tool = tool_sum if event.upstream is None else _tool_of(tool_sum, event.upstream)
        key = _short(result_hash) + code + streak_tool
        # The fingerprint only matters when the exact hash breaks the streak: computed then, not before.
        result_fp = _result_fp(event, call_policy, result_hash) if failing and key != state.streak_key else ""
        count, budget = self._streak(state, event, call, key,
                                     _short(result_fp) + code + streak_tool if result_fp else b"",
                                     args_text if failing else b"", thresholds,
                                     outcome == "error" and is_transient(event.error_class))
        period, near = self._cycle(state, call + key, failing, event.ts_ms, thresholds)

        stuck = 0 < thresholds.no_progress_at <= reads
        oscillating = 0 < thresholds.oscillation_revisits <= revisit
        advice = self._advice(state, thresholds, failing, count, budget, near, reads, revisit, nearing) \
            if thresholds.advise else None
        looping = thresholds.handoff_round_trips > 0 and 2 * thresholds.handoff_round_trips <= handoffs
        decide = (state.calls > thresholds.iteration_ceiling or occurrences >= 2 or (failing and count > budget)
                  or period or stuck or oscillating or spent is not None or looping
                  or (not failing and 0 < thresholds.poll_alert_after <= count))
        if advice is None and not decide:
            return _NOTHING  # the common case: nothing to decide, no evidence to build
        finding = self._judge(state, event, thresholds, failing, occurrences, count, budget, period,
                              reads if stuck else 0, revisit if oscillating else 0, spent,
                              handoffs if looping else 0) if decide else None
        if advice is not None and finding is not None and finding.verdict == advice.verdict:
            advice = None  # the rule halts on this very call: nothing left to warn about
        if finding is not None and finding.fuzzy and failing and not result_fp:
            result_fp = _result_fp(event, call_policy, result_hash)  # for the evidence
        decisions = tuple(explain(event, thresholds, f._replace(
            args_hash=args_hash, args_verified=args_verified, result_hash=result_hash, result_fp=result_fp,
            effective_outcome=outcome, args_last=args_text.decode() if f.event_ids and failing else "")) for f in (advice, finding)
            if f is not None)
        return Evaluation(False, decisions) if decisions else _NOTHING

    def _judge(self, state: RunState, event: TelemetryEvent, thresholds: Thresholds, failing: bool,
               occurrences: int, count: int, budget: int, period: int, reads: int, revisits: int,
               spent: tuple[str, int] | None, handoffs: int = 0) -> Finding | None:
        """Pick the rule that wins (module docstring order) and apply its effect on the run."""
        verdict: Verdict
        rule = ""
        if state.calls > thresholds.iteration_ceiling:
            verdict, count = "iteration_ceiling", state.calls
        elif spent is not None:
            verdict, (rule, count) = "budget_exceeded", spent
        elif occurrences >= thresholds.circuit_open_at:
            verdict, count = "circuit_open", occurrences
        elif failing and count > budget:
            verdict = "semantic_loop" if state.streak_varied else "recursion"
            if state.streak_transient:
                if state.streak_pauses < _STREAK_PAUSES:
                    # every failure transient: an upstream's trouble, not a loop of the run's own. Its calls
                    # to the tool pause instead, and the streak must fill its budget again to pause again.
                    state.streak_pauses += 1
                    del state.streak_ts[:]
                    return Finding(verdict, count, budget, period, state.streak_first_event_id,
                                   fuzzy=state.streak_fuzzy, pause=state.streak_pauses, **_story(state))
                verdict = "recursion"  # the third time: the run halts
        elif handoffs:
            verdict, count = "handoff_loop", handoffs
        elif period:
            verdict = "cycle"
        elif reads:
            verdict, count, rule = "no_progress", reads, "reads"
        elif revisits:
            verdict, count = "oscillation", revisits
        elif occurrences >= 2:
            return Finding("duplicate_call", occurrences)
        elif not failing and not state.streak_varied and not state.streak_alerted:
            state.streak_alerted = True
            return Finding("polling", count, first_event_id=state.streak_first_event_id, **_story(state))
        else:
            return None
        finding = Finding(verdict, count, budget, period, state.streak_first_event_id, fuzzy=state.streak_fuzzy,
                          rule=rule, **(_story(state) if verdict in _STREAK_VERDICTS else {}))
        self._halt(state, event, thresholds, verdict)
        return finding

    def _halt(self, state: RunState, event: TelemetryEvent, thresholds: Thresholds, verdict: str) -> None:
        """A halting finding's effect on the run."""
        if thresholds.shadow:
            self.resume(state)  # as if halted and resumed at once: a loop must fill a whole budget again
        else:
            state.halted_by = decision_id(event.run_id, event.event_id, "halt", verdict)

    def _model_call(self, state: RunState, event: TelemetryEvent, thresholds: Thresholds) -> Evaluation:
        """A model call spends and counts toward the model calls in a row; nothing else."""
        state.model_streak += 1
        spent, nearing = self._spend(state, event, thresholds)
        limit = thresholds.max_model_calls_without_tool
        findings = []
        if nearing is not None and spent is None and thresholds.advise:
            findings.append(Finding("budget_exceeded", nearing[1], rule=nearing[0], advise=True))
        if spent is not None:
            findings.append(Finding("budget_exceeded", spent[1], rule=spent[0]))
        elif 0 < limit <= state.model_streak:
            findings.append(Finding("no_progress", state.model_streak, rule="model_calls"))
        if not findings:
            return _NOTHING
        if not findings[-1].advise:
            self._halt(state, event, thresholds, findings[-1].verdict)
        return Evaluation(False, tuple(explain(event, thresholds, f._replace(effective_outcome=event.outcome))
                                       for f in findings))

    @staticmethod
    def _spend(state: RunState, event: TelemetryEvent,
               thresholds: Thresholds) -> tuple[tuple[str, int] | None, tuple[str, int] | None]:
        """Add the call's cost and tokens; the budget (and the new sum) it takes strictly past its limit,
        and the budget it is the first call to take to 80% or more of its limit."""
        cost, tokens = state.cost_micro, state.tokens
        state.cost_micro = min(cost + micro_usd(event.cost_usd), _SPEND_CAP)
        state.tokens = min(tokens + token_count(event.tokens), _SPEND_CAP)
        limit = micro_usd(thresholds.max_cost_usd)
        spent = nearing = None
        if limit and cost <= limit < state.cost_micro:
            spent = "cost", state.cost_micro
        elif thresholds.max_tokens and tokens <= thresholds.max_tokens < state.tokens:
            spent = "tokens", state.tokens
        if _nears(cost, state.cost_micro, limit):
            nearing = "cost", state.cost_micro
        elif _nears(tokens, state.tokens, thresholds.max_tokens):
            nearing = "tokens", state.tokens
        return spent, nearing

    @staticmethod
    def _advice(state: RunState, thresholds: Thresholds, failing: bool, count: int, budget: int, near: int,
                reads: int, revisit: int, nearing: tuple[str, int] | None) -> Finding | None:
        """The warning this call earns before a halt, if any: one per call, in rule order, at most one per
        rule per streak (bits of ``state.advised``)."""
        if failing and budget and count == budget and not state.advised & 1:
            state.advised |= 1
            return Finding("semantic_loop" if state.streak_varied else "recursion", count, budget,
                           first_event_id=state.streak_first_event_id, advise=True, **_story(state))
        if near and not state.advised & 2:
            state.advised |= 2
            return Finding("cycle", thresholds.cycle_occurrences - 1, period=near, advise=True)
        if reads and reads == thresholds.no_progress_at - 1:
            return Finding("no_progress", reads, rule="reads", advise=True)
        if revisit and revisit == thresholds.oscillation_revisits - 1:
            return Finding("oscillation", revisit, advise=True)
        if nearing is not None:
            return Finding("budget_exceeded", nearing[1], rule=nearing[0], advise=True)
        return None

    @staticmethod
    def _handoff(state: RunState, event: TelemetryEvent) -> int:
        """Count a handoff-class call (from the event's agent to its ``child_agent_id``): the handoffs in
        a row going back and forth between the same two agents, this one included."""
        source, target = _checksum(event.agent_id or ""), _checksum(event.child_agent_id or "")
        back = state.handoffs and source == state.handoff_to and target == state.handoff_from
        state.handoffs = min(state.handoffs + 1, _HANDOFF_CAP) if back else 1
        state.handoff_from, state.handoff_to = source, target
        return state.handoffs

    @staticmethod
    def _count_tool(state: RunState, tool: bytes) -> int:
        """Count a call of a tool that has a ``max_calls``; its calls so far."""
        table = state.tool_counts
        if table is None:
            table = state.tool_counts = {}
        calls = table.pop(tool, 0) + 1
        if len(table) >= _TOOL_COUNT_SLOTS:
            del table[next(iter(table))]
        table[tool] = calls
        return calls

    def resume(self, state: RunState) -> None:
        """An operator resumed the run: it starts again with fresh streaks and a fresh call count."""
        state.halted_by = None
        state.calls = 0
        state.side_effects = state.tool_counts = None
        state.model_streak = 0
        state.reset_streaks()

    def operate(self, state: RunState, command: OperatorCommand) -> Evaluation:
        """Apply an operator's halt or resume (its signature already verified by the adapter). The
        decision carries who, when and why; a command id seen before in the run is a duplicate."""
        digest = _checksum(command.command_id)
        if _contains(state.seen_ids, digest):
            return DUPLICATE
        state.seen_ids = (state.seen_ids + digest)[-_DIGEST * self.policy.defaults.dedupe_window :]
        if command.ts_ms > state.last_ts_ms:
            state.last_ts_ms = command.ts_ms
        evidence = {"operator": command.operator, "reason": command.reason, "command_id": command.command_id,
                    "key_id": command.key_id}
        if command.action == "resume":
            self.resume(state)
            action: Action = "resume"
            verdict: Verdict = "operator_resume"
        else:
            action, verdict = "halt", "operator_halt"
        decision = Decision(
            run_id=command.run_id,
            action=action,
            verdict=verdict,
            trigger_event_id=command.command_id,
            decision_id=decision_id(command.run_id, command.command_id, action, verdict),
            ts_ms=command.ts_ms,
            reason=f"{action} by operator {command.operator}: {command.reason}",
            evidence=evidence,
        )
        if action == "halt":
            state.halted_by = decision.decision_id
        return Evaluation(False, (decision,))

    @staticmethod
    def _side_effect_occurrence(state: RunState, event: TelemetryEvent, call: bytes,
                                thresholds: Thresholds) -> int:
        """Occurrence number of this side-effecting call within its window, 0 if not side-effecting."""
        side_effect = event.side_effect if event.side_effect is not None else thresholds.side_effect
        if not side_effect:
            return 0
        table = state.side_effects
        if table is None:
            table = state.side_effects = {}
        entry = table.get(call)
        if entry is not None and 0 <= event.ts_ms - entry[0] <= thresholds.side_effect_window_ms:
            entry[1] += 1
            return entry[1]
        horizon = event.ts_ms - thresholds.side_effect_window_ms
        for stale in [k for k, (first, _) in table.items() if first < horizon]:
            del table[stale]
        if len(table) >= _SIDE_EFFECT_SLOTS:
            del table[min(table, key=lambda k: table[k][0])]
        table[call] = [event.ts_ms, 1]
        return 1

    @staticmethod
    def _read(state: RunState, digest: bytes) -> int:
        """Count a successful read of this (call, result, tool); return its occurrences since the last
        successful write (the table keeps the most recently seen ``_READ_SLOTS``)."""
        table = state.reads
        if table is None:
            table = state.reads = {}
        seen = table.pop(digest, 0) + 1  # popped and put back: the most recently seen go last
        if len(table) >= _READ_SLOTS:
            del table[next(iter(table))]
        table[digest] = seen
        return seen

    @staticmethod
    def _write(state: RunState, target: bytes, after: bytes) -> tuple[int, bool]:
        """Record a write's after-state of ``target``: (the target's revisit count if this write revisited
        an earlier state, else 0; whether it left the target as it was)."""
        table = state.targets
        if table is None:
            table = state.targets = {}
        entry = table.pop(target, None)  # popped and put back: the most recently written go last
        if entry is None:
            if len(table) >= _TARGET_SLOTS:
                del table[next(iter(table))]
            entry = [b"", 0]
        states: bytes = entry[0]
        table[target] = entry
        if states[-_DIGEST:] == after:
            return 0, True
        revisited = _contains(states, after)
        if revisited:
            at = next(i for i in range(0, len(states), _DIGEST) if states[i : i + _DIGEST] == after)
            states = states[:at] + states[at + _DIGEST :]
            entry[1] += 1
        entry[0] = (states + after)[-_DIGEST * _STATE_SLOTS :]
        return (entry[1] if revisited else 0), False

    @staticmethod
    def _streak(state: RunState, event: TelemetryEvent, call: bytes, key: bytes, fp_key: bytes, args_text: bytes,
                thresholds: Thresholds, transient: bool) -> tuple[int, int]:
        """Extend or restart the streak of calls with this (tool, outcome, result) key, or failing that
        the streak's fingerprint key (``fp_key``: given only when the exact key differs); return the number
        of its calls within the window, and the budget that applies. ``args_text``: the call's canonical
        arguments if it failed with raw ones (kept if it starts a streak)."""
        if key == state.streak_key or (fp_key and fp_key == state.streak_fp):
            if key != state.streak_key:
                state.streak_key = key
                state.streak_fuzzy = True
            if call != state.streak_call:
                state.streak_varied = True
            if not transient:
                state.streak_transient = False
            member = event.event_id[:_ID_CHARS]
            ids, lens = state.streak_ids, state.streak_id_lens
            if len(lens) >= _STREAK_IDS - 1:
                ids, lens = ids[lens[0] :], lens[1:]
            state.streak_ids, state.streak_id_lens = ids + member, lens + bytes((len(member),))
        else:
            state.streak_key = key
            state.streak_call = call
            state.streak_varied = state.streak_alerted = state.streak_fuzzy = False
            state.advised &= ~1
            del state.streak_ts[:]
            state.streak_first_event_id = event.event_id
            state.streak_fp = fp_key
            state.streak_ids, state.streak_id_lens = "", b""
            state.streak_transient, state.streak_pauses = transient, 0
            # A copy of exactly its size: orjson's output keeps the buffer it was written into (~1 KiB).
            state.streak_args = bytes(memoryview(args_text)) if args_text else b""
        budget = event.retry_budget if event.retry_budget is not None else thresholds.retry_budget
        times = state.streak_ts
        ts_ms = event.ts_ms
        times.append(ts_ms)
        count = len(times)
        if count > 1:
            horizon = ts_ms - thresholds.window_ms
            stale = 0
            while times[stale] < horizon:
                stale += 1
            # Only budget + 1 (or the polling threshold) members can matter; keep no more than that.
            keep = min(thresholds.window_calls, max(budget, thresholds.poll_alert_after) + 1)
            if count - keep > stale:
                stale = count - keep
            if stale:
                del times[:stale]
                count -= stale
        return count, budget

    @staticmethod
    def _cycle(state: RunState, sig: bytes, failing: bool, ts_ms: int, thresholds: Thresholds) -> tuple[int, int]:
        """Record the step's signature; return the period (2 or 3) of a cycle it completes, or 0, and the
        period of a cycle one occurrence short of that (the advice's), or 0."""
        occurrences = thresholds.cycle_occurrences
        capacity = _CYCLE_PERIODS[-1] * occurrences
        previous = state.recent_sigs
        # A cycle of period p can only complete on a step equal to the step p back: checking that first
        # keeps the common case (no repetition) to two short comparisons.
        repeats = previous[-2 * _SIG : -_SIG] == sig or previous[-3 * _SIG : -2 * _SIG] == sig
        sigs = state.recent_sigs = (previous + sig)[-_SIG * capacity :]
        times = state.recent_ts
        times.append(ts_ms)
        if len(times) > capacity:
            del times[0]
        state.recent_failing = ((state.recent_failing << 1) | failing) & ((1 << capacity) - 1)
        if not repeats:
            state.advised &= ~2  # no cycle goes on through this step
            return 0, 0
        steps = len(times)
        found = [0, 0]
        for which, count in enumerate((occurrences, occurrences - 1)):
            if count < 2:
                continue
            for period in _CYCLE_PERIODS:
                span = period * count
                if span > steps or span > thresholds.window_calls:
                    continue
                unit = sigs[-_SIG * period :]
                if (sigs[-_SIG * span :] == unit * count
                        and unit != sig * period
                        and state.recent_failing & ((1 << period) - 1)
                        and ts_ms - times[-span] <= thresholds.window_ms):
                    found[which] = period
                    break
        return found[0], found[1]


class Finding(NamedTuple):
    """Which rule fired on an event, and the numbers its decision reports. Built by either engine (this
    module, or the native one for replay) and turned into the decision by ``explain``."""

    verdict: Verdict
    #: The count the decision reports (``evidence.count``): calls, occurrences or streak length.
    tally: int
    budget: int = 0
    period: int = 0
    first_event_id: str = ""
    args_hash: str = ""
    args_verified: bool = True
    result_hash: str = ""
    #: The triggering call's result fingerprint ("" for a successful call), and whether the streak
    #: matched on fingerprints (some member's exact hash differed).
    result_fp: str = ""
    fuzzy: bool = False
    #: The outcome the rules saw: the reported one, or ``noop`` for a write that changed nothing.
    effective_outcome: str = ""
    #: Which budget (``cost``, ``tokens``, ``calls``) or no-progress rule (``reads``, ``model_calls``).
    rule: str = ""
    #: A warning before the halt of ``verdict`` (action ``advise``), not the halt itself.
    advise: bool = False
    #: The streak's story (streak verdicts only): its event ids (the first and the most recent, each cut to
    #: 64 characters), the canonical arguments of its first and of the triggering call ("": not raw).
    event_ids: tuple[str, ...] = ()
    args_first: str = ""
    args_last: str = ""
    #: A transient streak's pause instead of a halt (action ``pause``): which one of the streak (1, 2), or 0.
    pause: int = 0

    @classmethod
    def of_native(cls, found: tuple[Any, ...]) -> Finding:
        """A finding as the native engine returns it: the fields in order, the rest (``rule``, ``advise``,
        ``event_ids``, ``args_first``, ``args_last``) as one last tuple (PyO3 converts at most 12)."""
        *fields, (rule, advise, event_ids, args_first, args_last, pause) = found
        return cls(*fields)._replace(rule=rule, advise=advise, event_ids=tuple(event_ids), args_first=args_first,
                                     args_last=args_last, pause=pause)


_ACTIONS: dict[str, Action] = {"duplicate_call": "suppress", "polling": "alert"}
#: Handoffs in a row counted at most (the rule fires long before).
_HANDOFF_CAP = 1 << 20
#: Pauses a transient streak gets instead of a halt; the next time it would pause, the run halts.
_STREAK_PAUSES = 2
#: A transient streak's pause when its failing call asked for no wait (``retry_after_ms``).
PAUSE_WAIT_MS = 60_000
_STREAK_VERDICTS = ("recursion", "semantic_loop")


def _story(state: RunState) -> dict[str, Any]:
    """The streak's event ids and its first call's arguments (kept for failing streaks only) for a finding."""
    return {"event_ids": (state.streak_first_event_id[:_ID_CHARS], *state.streak_id_list()),
            "args_first": state.streak_args.decode()}


def explain(event: TelemetryEvent, thresholds: Thresholds, finding: Finding) -> Decision:
    """The decision for ``finding`` on ``event``: action, reason and evidence (shadow mode: an alert)."""
    verdict = finding.verdict
    evidence: dict[str, Any] = {
        "tool": event.tool,
        "args_hash": finding.args_hash,
        "args_verified": finding.args_verified,
        "outcome": event.outcome,
        "result_hash": finding.result_hash,
    }
    if event.kind == "model_call":
        evidence["kind"] = "model_call"
    outcome = finding.effective_outcome or event.outcome
    if outcome != event.outcome:
        evidence["effective_outcome"] = outcome  # a write that changed nothing
    if event.seq is not None:
        evidence["seq"] = event.seq  # lets a runtime tell which of its calls triggered the decision
    count = finding.tally
    if finding.advise:
        reason = _advice_text(event, thresholds, finding, evidence)
    elif verdict == "iteration_ceiling":
        evidence.update(count=count, ceiling=thresholds.iteration_ceiling)
        reason = f"run reached its iteration ceiling: call {count} exceeds {thresholds.iteration_ceiling}"
    elif verdict == "circuit_open":
        evidence.update(count=count, window_ms=thresholds.side_effect_window_ms)
        reason = (f"side-effecting call {event.tool} repeated {count} times within "
                  f"{thresholds.side_effect_window_ms // 1000} s; circuit opened")
    elif verdict in ("recursion", "semantic_loop"):
        evidence.update(count=count, budget=finding.budget, window_ms=thresholds.window_ms,
                        window_calls=thresholds.window_calls, first_event_id=finding.first_event_id,
                        match="fingerprint" if finding.fuzzy else "exact")
        _streak_story(finding, evidence)
        same = "with mutating arguments" if verdict == "semantic_loop" else "with identical arguments"
        if finding.fuzzy:
            evidence["result_fp"] = finding.result_fp
            result = (f"the same {outcome} result up to volatile tokens (fingerprint "
                      f"{finding.result_fp[:12]})")
        else:
            result = f"the identical {outcome} result {finding.result_hash[:12]}"
        reason = (f"{event.tool} {same} returned {result} {count} times in a row within "
                  f"{thresholds.window_ms // 1000} s; retry budget is {finding.budget}")
        failure = _failure(event, evidence)
        if failure:
            reason = f"{reason}; it failed with {failure}"
    elif verdict == "cycle":
        evidence.update(count=thresholds.cycle_occurrences, period=finding.period, window_ms=thresholds.window_ms)
        reason = (f"a {finding.period}-call cycle ending in {event.tool} repeated "
                  f"{thresholds.cycle_occurrences} times with identical outcomes")
    elif verdict == "budget_exceeded":
        budget = finding.rule
        if budget == "cost":
            limit: float = thresholds.max_cost_usd
            evidence.update(budget=budget, count=count, spent=count / 1_000_000, limit=limit)  # count: micro-USD
            reason = f"the run spent {count / 1_000_000:.6f} USD, past its budget of {limit} USD"
        elif budget == "tokens":
            evidence.update(budget=budget, count=count, spent=count, limit=thresholds.max_tokens)
            reason = f"the run used {count} tokens, past its budget of {thresholds.max_tokens}"
        else:
            evidence.update(budget=budget, count=count, limit=thresholds.max_calls)
            reason = f"{event.tool} was called {count} times in this run; its limit is {thresholds.max_calls}"
    elif verdict == "no_progress" and finding.rule == "model_calls":
        evidence.update(rule="model_calls", count=count, limit=thresholds.max_model_calls_without_tool)
        reason = (f"{count} model calls in a row with no tool call between (a compaction or planning spiral?): "
                  "no progress")
    elif verdict == "no_progress":
        evidence.update(rule="reads", count=count, no_progress_at=thresholds.no_progress_at)
        if event.target is not None:
            evidence["target"] = event.target
        reason = (f"{event.tool} read the same result for the same call {count} times with no successful write "
                  "or plan step between: no progress")
    elif verdict == "oscillation":
        assert event.target is not None  # only a write with a target revisits
        evidence.update(count=count, oscillation_revisits=thresholds.oscillation_revisits, target=event.target,
                        state_hash=event.state_hash)
        reason = (f"{event.tool} put {event.target[:80]} back into an earlier state for the {count}th time "
                  "(edits undone and redone)")
    elif verdict == "handoff_loop":
        trips = count // 2
        evidence.update(count=count, round_trips=trips, handoff_round_trips=thresholds.handoff_round_trips,
                        agents=[event.agent_id, event.child_agent_id])
        reason = (f"agents {event.agent_id or '(unnamed)'} and {event.child_agent_id or '(unnamed)'} handed the run "
                  f"back and forth {count} times ({trips} round trips) with no successful call of another kind "
                  "between: a handoff loop")
    elif verdict == "duplicate_call":
        evidence.update(count=count, window_ms=thresholds.side_effect_window_ms)
        reason = (f"side-effecting call {event.tool} is a duplicate (occurrence {count} within "
                  f"{thresholds.side_effect_window_ms // 1000} s); hand back the earlier result instead of "
                  "acting again")
    else:
        evidence.update(count=count, first_event_id=finding.first_event_id, event_ids=list(finding.event_ids))
        reason = (f"{event.tool} returned the same successful result {count} times in a row "
                  "(polling?); advisory only")
    action = "advise" if finding.advise else "pause" if finding.pause else _ACTIONS.get(verdict, "halt")
    if finding.pause:
        wait_ms = event.retry_after_ms or PAUSE_WAIT_MS
        evidence.update(pause=finding.pause, pauses_before_halt=_STREAK_PAUSES, wait_ms=wait_ms)
        if event.upstream is not None:
            evidence["upstream"] = event.upstream
        reason = (f"{reason}; every failure was transient ({event.error_class}): the run's calls to {event.tool} "
                  f"pause for {wait_ms / 1000:g} s instead (pause {finding.pause} of {_STREAK_PAUSES}; the next "
                  "halts the run)")
    if thresholds.shadow and action != "alert":
        evidence.update(shadow=True, would=action)
        reason = f"shadow mode, would {action}: {reason}"
        action = "alert"
    return Decision(
        run_id=event.run_id,
        action=action,
        verdict=verdict,
        trigger_event_id=event.event_id,
        decision_id=decision_id(event.run_id, event.event_id, action, verdict),
        ts_ms=event.ts_ms,
        reason=reason,
        evidence=evidence,
        agent_id=event.agent_id,
        tenant=event.tenant,
        trace_id=event.trace_id,
        span_id=event.span_id,
    )


def _advice_text(event: TelemetryEvent, thresholds: Thresholds, finding: Finding, evidence: dict[str, Any]) -> str:
    """The warning before a halt, written for the model that makes the next call; its evidence."""
    verdict, count, tool = finding.verdict, finding.tally, event.tool
    evidence.update(advice_for=verdict, count=count)
    if verdict in ("recursion", "semantic_loop"):
        evidence.update(budget=finding.budget, first_event_id=finding.first_event_id)
        _streak_story(finding, evidence)
        _failure(event, evidence)
        how = "the same way" if verdict == "recursion" else "the same way, with different arguments,"
        return (f"{tool} failed {how} {_times(count)}; the next identical failure stops this run; change the "
                "approach or the arguments, or report the failure")
    if verdict == "cycle":
        evidence.update(period=finding.period)
        return (f"the same {finding.period} calls, ending in {tool}, repeated {_times(count)} with the same results; "
                "one more repetition stops this run; try something different")
    if verdict == "no_progress":
        evidence["rule"] = "reads"
        return (f"{tool} returned the same result {_times(count)} with nothing written since; reading it again "
                "stops this run; act on what you have read")
    if verdict == "oscillation":
        evidence["target"] = event.target
        return (f"{str(event.target)[:80]} went back to an earlier state {_times(count)}; undoing and redoing it "
                "again stops this run; settle on one version")
    budget = finding.rule
    evidence["budget"] = budget
    if budget == "cost":
        limit = micro_usd(thresholds.max_cost_usd)
        evidence.update(spent=count / 1_000_000, limit=thresholds.max_cost_usd)
    elif budget == "tokens":
        limit = thresholds.max_tokens
        evidence.update(spent=count, limit=limit)
    else:
        limit = thresholds.max_calls
        evidence.update(limit=limit)
        return (f"{tool} has been called {_times(count)} of the {limit} this run allows; use the remaining calls "
                "carefully")
    return (f"this run has used {count * 100 // limit}% of its {budget} budget; going past it stops the run; "
            "finish the task or report what is left")


def _times(count: int) -> str:
    return f"{count} time" if count == 1 else f"{count} times"


def _streak_story(finding: Finding, evidence: dict[str, Any]) -> None:
    """A failing streak's event ids and what changed in its arguments (``core/argsdiff.py``)."""
    evidence["event_ids"] = list(finding.event_ids)
    evidence["args_diff"] = args_diff(finding.args_first, finding.args_last)


def _failure(event: TelemetryEvent, evidence: dict[str, Any]) -> str:
    """The failure as the telemetry named it (error class, start of the message), added to the
    evidence; '' when the event names none."""
    if event.error_class is not None:
        evidence["error_class"] = event.error_class
    if event.error_head is not None:
        evidence["error_head"] = event.error_head
    return ": ".join(part for part in (event.error_class, event.error_head) if part)


def event_hashes(event: TelemetryEvent, call_policy: CallPolicy) -> tuple[str, bool, str, str, str]:
    """The call's argument hash, whether it was verified here, its result hash, its result fingerprint
    and its canonical arguments ("" unless raw and short): what the native engine is given for events
    only the reference decoder accepts."""
    if event.kind == "model_call":
        return "", True, "", "", ""  # a model call is folded without hashes
    args_hash, args_verified, args_text = _args_hash(event, call_policy)
    result_hash = _result_hash(event, call_policy)
    # Whatever the reported outcome: a write that changed nothing fails (noop) and may need it.
    return args_hash, args_verified, result_hash, _result_fp(event, call_policy, result_hash), args_text.decode()


def _args_hash(event: TelemetryEvent, call_policy: CallPolicy) -> tuple[str, bool, bytes]:
    """The call's argument hash, whether it was verified by normalising here, and the canonical JSON
    of its normalised arguments if they were raw and at most ``_ARGS_BYTES`` long (else b"").

    Fail closed: arguments that cannot be normalised, or a bare hash for a tool whose policy demands
    normalisation here, make the call comparable by tool name alone, which can only halt sooner.
    """
    thresholds = call_policy.thresholds
    if event.args is not None:
        try:
            canonical = canonical_json(normalise(event.args, call_policy.fields, thresholds.collapse_whitespace))
        except NormalisationError:
            return _UNVERIFIED, False, b""
        return hashlib.sha256(canonical).hexdigest(), True, canonical if len(canonical) <= _ARGS_BYTES else b""
    assert event.args_hash is not None  # the contract guarantees one of the two
    return event.args_hash, not thresholds.strict_args, b""


def _result_fp(event: TelemetryEvent, call_policy: CallPolicy, result_hash: str) -> str:
    """The failing call's result fingerprint: the semantic hash of its raw result with volatile tokens
    masked, else the fingerprint the runtime sent, else the result hash (also when masking is off)."""
    mask = call_policy.mask
    if mask is None:
        return result_hash
    if event.has_result:
        try:
            return mask.fingerprint(event.result, call_policy.fields, call_policy.thresholds.collapse_whitespace)
        except NormalisationError:
            return "unhashable"
    return event.result_fp if event.result_fp is not None else result_hash


def _result_hash(event: TelemetryEvent, call_policy: CallPolicy) -> str:
    if event.result_hash is not None:
        return event.result_hash
    try:
        return semantic_hash(event.result, call_policy.fields, call_policy.thresholds.collapse_whitespace)
    except NormalisationError:
        return "unhashable"  # every unhashable result compares equal: fail closed
