"""The fleet's keyed folds (stream_app/worker/fleet.py) without Kafka: facts in, decisions and tree and
thread records out, each fact counted once however often it comes, and a failed batch leaving nothing
folded."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytest.importorskip("faust")

from stream_app.bus.wire import encode_telemetry
from stream_app.core import Detector, InvalidEvent, Policy
from stream_app.core.fleet import ThreadFact, ThreadState, ToolFact, ToolState, TreeFact, TreeState
from stream_app.core.fleet.scope import ScopeCommand, key_text, scope_decision_id
from stream_app.core.policy import FleetThresholds
from stream_app.worker.batch import BatchFold, RawRecord
from stream_app.worker.facts import KIND_OF, KINDS, decoder, fact_items, native_reader
from stream_app.worker.fleet import FACTS_FORMAT, FactsPublisher, FleetEffects, decode_facts, partition_of
from stream_app.worker.metrics import WorkerMetrics
from stream_app.worker.store import RunStore


@dataclass
class _Record:
    partition: int
    offset: int
    value: bytes
    key: bytes | None = None
    topic: str = "facts"
    headers: tuple[Any, ...] = ()


class _Store(RunStore):
    """RunStore with what it stores in a dict (``data``) instead of RocksDB and the changelog; what it keeps
    for the next flush is RunStore's own (``keep``, ``get``, ``flush``, ``drop``)."""

    def __init__(self) -> None:
        self._kept, self._taken, self._sending = {}, [], None
        self.kept = 0
        self.data: dict[tuple[int, bytes], bytes] = {}
        self.scanned = 0
        self.starts: list[bytes] = []

    def count(self, partition: int) -> int:
        return sum(p == partition for p, _ in self.data)

    def scan(self, partition: int, start: bytes, limit: int) -> tuple[list[tuple[bytes, bytes]], bytes]:
        self.starts.append(start)
        keys = sorted(k for p, k in self.data if p == partition and k >= start)
        self.scanned += len(keys[:limit])
        return [(k, self.data[(partition, k)]) for k in keys[:limit]], keys[limit] if len(keys) > limit else b""

    def read(self, partition: int, key: bytes) -> bytes | None:
        return self.data.get((partition, key))

    def _write(self, changes: Mapping[int, Sequence[tuple[bytes, bytes | None]]],
               on_failure: Any = None) -> asyncio.Future[None]:
        for partition, items in changes.items():
            for key, value in items:
                if value is None:
                    self.data.pop((partition, key), None)
                else:
                    self.data[(partition, key)] = value
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


class _Topic:
    def __init__(self, name: str) -> None:
        self.name = name

    def get_topic_name(self) -> str:
        return self.name


class _Producer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, bytes]] = []
        self.fail = False

    async def send(self, topic: str, key: bytes, value: bytes, headers: Any) -> asyncio.Future[Any]:
        if self.fail:
            raise ConnectionError("broker gone")
        self.sent.append((topic, key, value))
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def send_to(self, topic: str, partition: int, value: bytes) -> asyncio.Future[Any]:
        self.sent.append((topic, str(partition).encode(), value))
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    def flush_now(self) -> None:
        """Sends here are done at once (the real one's flush: tests/integration/test_decision_producer.py)."""

    async def flush(self) -> None:
        """As ``flush_now``."""


class _DeadLetters:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, Any]] = []

    async def send(self, record: Any, error: Any, **_: Any) -> None:
        self.sent.append((record, error))


def _effects(reader: str = "python", **fleet: Any) -> tuple[FleetEffects, _Store, _Producer, _DeadLetters,
                                                             WorkerMetrics]:
    """The effects with the trees' store (returned) and the threads' (``effects.stores["threads"]``), reading
    facts messages with the reference or (``reader="native"``) the native engine's reader."""
    if reader == "native":
        pytest.importorskip("loopwarden_native")
    store, producer, dead, metrics = _Store(), _Producer(), _DeadLetters(), WorkerMetrics()
    topics: Any = type("T", (), {"control": _Topic("control"), "alerts": _Topic("alerts")})()
    effects = FleetEffects(topics, {"trees": store, "threads": _Store(), "tools": _Store()},  # type: ignore[dict-item]
                           FleetThresholds(**fleet),
                           metrics, dead, None, "/test", producer, 10, "scopes",  # type: ignore[arg-type]
                           decode=decoder(reader == "native"))
    return effects, store, producer, dead, metrics


def _spawns(root: str, first: int, count: int, source_partition: int = 0) -> bytes:
    facts = [[source_partition, first + n, root, root, f"{root}-{first + n}", 1000 + first + n, None, None, 0, True,
              f"{root}-kid{first + n}", "w", f"{first + n:016d}", "acme"] for n in range(count)]
    return orjson.dumps({"v": FACTS_FORMAT, "trees": facts})


def test_a_facts_key_as_the_agent_groups_it_is_its_scope_key_and_an_operator_commands_alike() -> None:
    """The agent groups a batch's facts and commands by ``Kind.key_of`` (a fact's leading fields), not by
    their key text: each kind's must name exactly the scope key, or one key's facts would be folded apart
    (or two keys' together) and a command out of order with them."""
    tree = TreeFact("root/1", "run-2", "e", 1, "root/1", 1, 0, False, None, None, None, "acme")
    thread = ThreadFact("acme", "pr/7", "run-2", "e", 1, "user", None, None)
    tool = ToolFact("acme", "search", "api.example.com", 0, "e", "run-2", 1, 1, 0, -1, 0, ())
    for fact, other in ((tree, tree._replace(root="root/2")), (thread, thread._replace(thread_key="pr/8")),
                        (tool, tool._replace(upstream="api2.example.com"))):
        kind = KIND_OF[type(fact)]
        grouped = kind.key_of(fact)
        assert key_text(grouped if type(grouped) is tuple else (grouped,)) == fact.key_text
        assert kind.key_of(other) != grouped and kind.key_of(fact._replace(run_id="run-3")) == grouped
        command = ScopeCommand(kind.scope, grouped if type(grouped) is tuple else (grouped,), "halt", "op-1",
                               "alice", "why", 5)
        assert kind.key_of(command.key) == grouped


async def test_a_redelivered_batch_of_facts_counts_once() -> None:
    effects, store, producer, _, metrics = _effects(max_tree_runs=10)
    await effects.process([_Record(0, 0, _spawns("root", 0, 6))])
    assert [orjson.loads(v)["verdict"] for t, _, v in producer.sent if t == "control"] == ["tree_fanout"]  # half
    await effects.process([_Record(0, 1, _spawns("root", 0, 6))])  # the same facts, published again
    await effects.process([_Record(0, 2, _spawns("root", 3, 6))])  # half of them again, then 3 new
    await effects.flush()
    state = TreeState.decode(store.data[(0, b"root")])
    assert len(state.depth) == 10 and state.sources == {"0": 8}
    assert metrics.fleet_facts.labels(fold="trees", state="redelivered")._value.get() == 9
    await effects.process([_Record(0, 3, _spawns("root", 9, 1))])  # the 11th run
    controls = [orjson.loads(v) for t, _, v in producer.sent if t == "control"]
    assert [(c["action"], c["verdict"]) for c in controls] == [("alert", "tree_fanout"), ("halt", "tree_fanout")]
    assert sum(t == "alerts" for t, _, _ in producer.sent) == 2  # on-call sees both


async def test_a_batch_whose_decisions_were_not_acknowledged_leaves_no_folded_state_behind() -> None:
    """The decisions' send fails: the batch is not kept (delivery fetches it again). Folding it again must
    start from the record the batch before it left (not written yet), not from the state the failed
    attempt had already folded."""
    effects, store, producer, _, _ = _effects(max_tree_runs=4)
    await effects.process([_Record(0, 0, _spawns("root", 0, 1))])
    producer.fail = True
    with pytest.raises(ConnectionError):
        await effects.process([_Record(0, 1, _spawns("root", 1, 2))])  # crosses half: a decision to send
    producer.fail = False
    await effects.process([_Record(0, 1, _spawns("root", 1, 2))])
    await effects.flush()
    state = TreeState.decode(store.data[(0, b"root")])
    assert len(state.depth) == 4 and state.sources == {"0": 2}
    assert [orjson.loads(v)["action"] for t, _, v in producer.sent if t == "control"] == ["alert"]


async def test_a_keys_record_is_written_with_the_next_commit_once_however_many_batches_changed_it() -> None:
    """Batches keep their keys' new records in memory (decisions still go out with each batch); the next
    batch folds on them, and ``flush`` (awaited by every commit) writes each key's latest once."""
    effects, store, producer, _, _ = _effects(max_tree_runs=10)
    writes: list[dict[int, list[tuple[bytes, bytes | None]]]] = []
    write = store._write

    def counted(changes: dict[int, list[tuple[bytes, bytes | None]]], on_failure: Any = None) -> Any:
        writes.append(changes)
        return write(changes, on_failure)

    store._write = counted  # type: ignore[method-assign]
    await effects.process([_Record(0, 0, _spawns("root", 0, 4))])
    await effects.process([_Record(0, 1, _spawns("root", 4, 2))])  # the root and 6 children: over half of 10
    assert store.data == {} and writes == []
    assert [orjson.loads(v)["verdict"] for t, _, v in producer.sent if t == "control"] == ["tree_fanout"]
    await effects.flush()
    assert [[(p, [k for k, _ in items]) for p, items in w.items()] for w in writes] == [[(0, [b"root"])]]
    state = TreeState.decode(store.data[(0, b"root")])
    assert len(state.depth) == 7 and state.sources == {"0": 5}
    await effects.flush()  # nothing left to write
    assert len(writes) == 1
    await effects.process([_Record(0, 2, _spawns("root", 0, 6))])  # all folded before: counted once
    await effects.flush()
    assert TreeState.decode(store.data[(0, b"root")]).sources == {"0": 5}
    await effects.process([_Record(0, 3, _spawns("root", 6, 1))])  # newer than the stored record...
    await effects.process([_Record(0, 4, _spawns("root", 7, 1))])  # ...which this batch must not fold on
    await effects.flush()
    state = TreeState.decode(store.data[(0, b"root")])
    assert len(state.depth) == 9 and state.sources == {"0": 7}


async def test_a_revoked_partitions_unwritten_records_are_dropped_not_written_later() -> None:
    effects, store, _, _, _ = _effects()
    await effects.process([_Record(0, 0, _spawns("a", 0, 1)), _Record(1, 0, _spawns("b", 0, 1))])
    await effects.forget({1})
    await effects.flush()
    assert {p for p, _ in store.data} == {0}


@pytest.mark.parametrize("reader", ["python", "native"])
async def test_bad_facts_go_to_the_dead_letters_and_the_rest_is_folded(reader: str) -> None:
    effects, store, _, dead, _ = _effects(reader)
    await effects.process([_Record(0, 0, b"{nope"), _Record(0, 1, orjson.dumps({"v": 9, "trees": []})),
                           _Record(0, 2, orjson.dumps({"v": FACTS_FORMAT, "threads": [[0, 1, "t", "k"]]})),
                           _Record(0, 3, orjson.dumps({"v": FACTS_FORMAT, "threads": [[0, 1, "t", 5, "r", "e", 1, None,
                                                                                       None, None]]})),
                           _Record(0, 4, _spawns("root", 0, 1))])
    assert [e.field for _, e in dead.sent] == ["facts", "facts", "threads", "threads"]
    await effects.flush()
    assert (0, b"root") in store.data


@pytest.mark.parametrize(("field", "item"), [
    ("trees", [0, 1, "root", "run", "e", 1, None, "5", 0, False, None, None, None, None]),  # depth: a string
    ("trees", [0, 1, "root", "run", "e", 1, None, None, 0, 1, None, None, None, None]),  # spawn: not a bool
    ("trees", [0, 1, "root", "run", "e", 1, 7, None, 0, False, None, None, None, None]),  # parent: a number
    ("threads", [0, 1, "t", "k", "r", "e", 1, None, None, True]),  # failure: a bool
    ("tools", [0, 1, "t", "x", "u", 0, "e", "r", 1, 1, 1, -1, 0, [["run"]]]),  # failing runs: not strings
    ("tools", [0, 1, "t", "x", "u", 0, "e", "r", 1, 1, 1, -1, 0, "run"]),  # failing runs: not a list
    ("tools", [0, 1, "t", "x", "u", 0, "e", "r", 1, 1, 1, -1, 0, ["r"], ["1"], []]),  # offsets: not numbers
    ("tools", [0, 1, "t", "x", "u", 0, "e", "r", 1, 1, 1, -1, 0, ["r"], [1]]),  # one offsets list of two
    ("tools", [0, 1, "t", "x", "u", 0, "e", "r", 1, 1, 1, -1, 0, ["r"], [1, True], []]),  # an offset: a bool
    ("threads", [0, 1.0, "t", "k", "r", "e", 1, None, None, None]),  # offset: a float
])
@pytest.mark.parametrize("reader", ["python", "native"])
async def test_a_fact_with_an_optional_field_of_another_type_is_dead_lettered(field: str, item: list[Any],
                                                                               reader: str) -> None:
    """Every field is checked against the fact's annotations, optional ones too: a fact the folds would
    trip over (comparing a string depth) is refused, not folded into a crash of every batch after it. The
    native reader declines each, and the reference refuses it."""
    effects, store, _, dead, _ = _effects(reader)
    await effects.process([_Record(0, 0, orjson.dumps({"v": FACTS_FORMAT, field: [item]})),
                           _Record(0, 1, _spawns("root", 0, 1))])
    assert [e.field for _, e in dead.sent] == [field]
    await effects.flush()
    assert (0, b"root") in store.data


def _valid_field(code: int) -> st.SearchStrategy[Any]:
    """A value of what a fact's field may hold (``Kind.codes``)."""
    options: list[st.SearchStrategy[Any]] = []
    if code & 1:
        options.append(st.integers(-(2**63), 2**63 - 1) | st.integers(-5, 5))
    if code & 2:
        options.append(st.text(max_size=6))
    if code & 4:
        options.append(st.booleans())
    if code & 8:
        options.append(st.none())
    if code & 16:
        options.append(st.lists(st.text(max_size=4), max_size=3))
    if code & 32:
        options.append(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3))
    return st.one_of(options)


#: Anything JSON holds: what a forged or broken fact may carry in any field.
_ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=4)
                         | st.floats(allow_nan=False, allow_infinity=False), lambda inner: st.lists(inner, max_size=3),
                         max_leaves=4)


#: Values of every type a field may be confused with.
_CONFUSED = (None, True, False, 0, 1, -1, 1.0, 2**63, -(2**63) - 1, "", "x", [], ["x"], [1], [True], [1.5], [None])


@st.composite
def _facts_text(draw: Any) -> bytes:
    """A facts message as the agent may meet it: mostly items of each kind's shape, some with a field of another
    type, one field more or fewer (an earlier release's shape among them), another format, repeated or escaped
    names, spaces."""
    import json

    message_: dict[str, Any] = {}
    for kind in KINDS:
        if not draw(st.booleans()):
            continue
        items = []
        for _ in range(draw(st.integers(0, 3))):
            item = [draw(_valid_field(code)) for code in kind.codes]
            change = draw(st.integers(0, 5))
            if change == 0:  # a field of another type (a value each type confuses: 1 and true, 1 and 1.0, ...)
                item[draw(st.integers(0, len(item) - 1))] = draw(st.sampled_from(_CONFUSED) | _ANY_JSON)
            elif change == 1:
                item = item[:-draw(st.integers(1, 2))]
            elif change == 2:
                item.append(draw(_ANY_JSON))
            items.append(item)
        message_[kind.name] = items if draw(st.integers(0, 9)) else draw(_ANY_JSON)
    message_["v"] = draw(st.sampled_from([FACTS_FORMAT] * 6 + [1.0, True, 2, "1", None]))
    if draw(st.integers(0, 9)) == 0:
        message_["other"] = draw(_ANY_JSON)
    text = json.dumps(message_, separators=(",", ":") if draw(st.booleans()) else None)
    trick = draw(st.integers(0, 9))
    if trick == 0:  # a repeated name: orjson keeps the last
        text = '{"trees":[],' + text[1:] if len(text) > 2 else text
    elif trick == 1:  # an escaped name
        text = text.replace('"v"', '"\\u0076"')
    elif trick == 2:
        text = draw(st.sampled_from(["[1]", "{", "", "null", text + " {}"]))
    return text.encode()


@given(_facts_text())
@settings(max_examples=400, deadline=None)
def test_the_native_reader_reads_a_message_as_the_reference_or_declines(value: bytes) -> None:
    """The native engine's reader of facts messages gives what ``decode_facts`` gives, facts of their named
    tuples and fields of their types (``repr``: a bool is no int), or declines (None) and the reference reads
    the message: every message it reads where the reference would refuse it, or reads otherwise, fails here."""
    native = _native_read()(value)
    try:
        reference = decode_facts(value)
    except InvalidEvent:
        assert native is None
        return
    assert native is None or repr(native) == repr(reference)


def _native_read() -> Any:
    """The native engine's reader of facts messages, as ``facts.decoder`` uses it (without the fallback)."""
    pytest.importorskip("loopwarden_native")
    return native_reader()


#: One item of each kind as the worker writes it.
_ITEMS = {"trees": [0, 1, "root", "run", "e", 1, "root", 1, 0, True, "kid", "coder", "t1", "acme", False],
          "threads": [0, 1, "acme", "issue-7", "run", "e", 1, "webhook", None, "http_503"],
          "tools": [0, 1, "acme", "search", "api", 0, "e", "run", 1, 3, 1, -1, 0, ["run"], [1, 2, 3], [3]]}


@pytest.mark.parametrize("field", sorted(_ITEMS))
def test_the_native_reader_reads_no_field_of_another_type(field: str) -> None:
    """Every field of every kind, given each value a type is confused with (1 and true, 1 and 1.0, a string
    and a list of one, past 64 bits): the native reader declines or reads what the reference reads."""
    read = _native_read()
    assert repr(read(orjson.dumps({"v": FACTS_FORMAT, field: [_ITEMS[field]]}))) == \
        repr(decode_facts(orjson.dumps({"v": FACTS_FORMAT, field: [_ITEMS[field]]})))
    import json

    for index in range(len(_ITEMS[field])):
        for confused in _CONFUSED:
            item = list(_ITEMS[field])
            item[index] = confused
            value = json.dumps({"v": FACTS_FORMAT, field: [item]}).encode()
            native = read(value)
            try:
                reference = decode_facts(value)
            except InvalidEvent:
                assert native is None, (index, confused)
                continue
            assert native is None or repr(native) == repr(reference), (index, confused)


def test_the_native_reader_declines_none_of_the_facts_either_engine_writes() -> None:
    """Every facts message the worker publishes, from a batch folded by either engine (the fleet simulator's
    trees, threads and storm, and healthy runs naming their upstream), is read by the native reader, alike."""
    read = _native_read()
    from stream_app.devtools.fleet_sim import simulate_storm, simulate_threads, simulate_trees
    from stream_app.worker.batch import NativeBatchFold

    _, trees = simulate_trees(6, redeliver_fraction=0.0)
    _, threads = simulate_threads(6, redeliver_fraction=0.0)
    stream = sorted([*trees, *threads, *simulate_storm(redeliver_fraction=0.0)], key=lambda e: e["ts_ms"])
    records = [RawRecord(n % 4, n // 4, *encode_telemetry(event)) for n, event in enumerate(stream)]
    stored = {(r.partition, r.key): None for r in records if r.key}
    for fold in (BatchFold(Detector(Policy())), NativeBatchFold(Detector(Policy()))):
        items = fold.fold(records, stored, 0).facts
        assert {kind for _, _, kind, _, _ in items} == {0, 1, 2}
        producer = _Producer()
        asyncio.run(FactsPublisher("facts", 3, producer).send(items))  # type: ignore[arg-type]
        assert len(producer.sent) == 3
        for _, _, value in producer.sent:
            native = read(value)
            assert native is not None and repr(native) == repr(decode_facts(value))


async def test_a_keys_facts_that_meet_a_bug_are_dead_lettered_and_the_other_keys_still_fold() -> None:
    """Folding one key's facts raises what no fact should (a bug): that key is left as it was (no record
    kept, no decision of it published), the records its facts came from are dead-lettered with reason
    ``internal``, and every other key of the batch folds; the batch is not failed, so the facts agent
    does not crash on it after every restart."""
    effects, store, producer, dead, _ = _effects(max_tree_runs=4)
    fold_key = effects._fold_key

    def buggy(kind: Any, state: Any, items: Any, decisions: Any, *args: Any) -> Any:
        out = fold_key(kind, state, items, decisions, *args)  # folded, decisions crossed: then the bug
        if items[0][3].key_text == "poisoned":
            raise RecursionError("maximum recursion depth exceeded")
        return out

    effects._fold_key = buggy  # type: ignore[method-assign]
    await effects.process([_Record(0, 0, _spawns("poisoned", 0, 3)), _Record(0, 1, _spawns("root", 0, 3))])
    assert [(r.offset, e.kind) for r, e in dead.sent] == [(0, "internal")]
    assert "RecursionError" in str(dead.sent[0][1])
    controls = [orjson.loads(v) for t, _, v in producer.sent if t == "control"]
    assert [(c["root_run_id"], c["verdict"]) for c in controls] == [("root", "tree_fanout")]  # the half alert
    await effects.flush()
    assert [k for _, k in store.data] == [b"root"]
    effects._fold_key = fold_key  # type: ignore[method-assign]
    await effects.process([_Record(0, 2, _spawns("poisoned", 0, 1))])  # the key folds from its stored state
    await effects.flush()
    assert TreeState.decode(store.data[(0, b"poisoned")]).sources == {"0": 0}


async def test_only_the_fact_that_meets_a_bug_is_dead_lettered_and_its_keys_other_facts_fold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Folding one fact raises (a bug in the tree fold, met by one run's fact): the key is folded again
    from its stored state without that fact, whose record alone is dead-lettered; the key's facts from
    other records of the batch, before and after it, count."""
    from stream_app.core.fleet import trees

    place = trees._place

    def buggy(state: Any, fact: Any, cap: int) -> Any:
        if fact.run_id == "poison":
            raise RecursionError("maximum recursion depth exceeded")
        return place(state, fact, cap)

    monkeypatch.setattr(trees, "_place", buggy)
    effects, store, _, dead, _ = _effects(max_tree_runs=100)
    poison = [0, 5, "root", "poison", "p", 1005, "root", 1, 0, False, None, None, None, None]
    await effects.process([_Record(0, 0, _spawns("root", 0, 2)),
                           _Record(0, 1, orjson.dumps({"v": FACTS_FORMAT, "trees": [poison]})),
                           _Record(0, 2, _spawns("root", 6, 2))])
    assert [(r.offset, e.kind) for r, e in dead.sent] == [(1, "internal")]
    await effects.flush()
    state = TreeState.decode(store.data[(0, b"root")])
    assert "poison" not in state.depth and len(state.depth) == 5  # the root and its 4 children
    assert state.sources == {"0": 7}


async def test_forged_facts_past_what_a_record_or_a_date_can_hold_are_dead_lettered_or_said_at_the_nearest() -> None:
    """Facts only workers write, forged: a tool fact's count past 64 bits cannot be stored (its key is left
    as it was, the record dead-lettered with reason ``internal``; it stopped the worker), and a tree halt
    at an event time in year 10000 is published with the last time a date can say (its CloudEvents time
    raised). The batch's other keys fold either way."""
    effects, store, producer, dead, _ = _effects(max_tree_depth=2)
    tools = [[0, n, "", "ovf", "u", 1_796_508_840_000, "e", "r", 1_796_508_850_443, 2**64 - 1, 0, -1, 0, [], [n], []]
             for n in (1, 2)]  # their sum is past 64 bits
    deep = [0, 2, "far", "far-3", "e", 253_402_300_800_000, "far-2", 3, 0, False, None, None, None, None]
    await effects.process([_Record(0, 0, orjson.dumps({"v": FACTS_FORMAT, "tools": tools})),
                           _Record(0, 1, orjson.dumps({"v": FACTS_FORMAT, "trees": [deep]})),
                           _Record(0, 2, _spawns("root", 0, 1))])
    assert [(r.offset, e.kind) for r, e in dead.sent] == [(0, "internal")]
    assert "64-bit" in str(dead.sent[0][1])
    halts = [orjson.loads(v) for t, _, v in producer.sent if t == "control"]
    assert [(h["root_run_id"], h["verdict"]) for h in halts] == [("far", "tree_depth")]
    await effects.flush()
    assert sorted(k for _, k in store.data) == [b"far", b"root"]
    assert not effects.stores["tools"].data  # type: ignore[attr-defined]


async def test_facts_are_published_to_the_partition_of_their_scope_key() -> None:
    producer = _Producer()
    publisher = FactsPublisher("facts", 8, producer)  # type: ignore[arg-type]
    facts: list[tuple[int, int, Any]] = [
        (3, n, TreeFact(f"root-{n % 3}", "r", f"e{n}", n, None, None, 0, True, None, None, None, None))
        for n in range(9)]
    facts += [(3, 9 + n, ThreadFact("acme", f"pr-{n % 3}", "r", f"t{n}", n, "webhook", None, None)) for n in range(6)]
    await asyncio.gather(*await publisher.send(fact_items(facts)))
    by_partition = {int(key): decode_facts(value) for _, key, value in producer.sent}
    keys = {f"tree/root-{n}" for n in range(3)} | {f"thread/acme/pr-{n}" for n in range(3)}
    assert len(producer.sent) == len({partition_of(key, 8) for key in keys})  # one message per partition
    for partition, items in by_partition.items():
        for kind, _, _, fact in items:
            assert partition_of(f"{kind.scope}/{fact.key_text}", 8) == partition
    assert sorted(offset for items in by_partition.values() for _, _, offset, _ in items) == list(range(15))


async def test_a_thread_halt_goes_to_control_alerts_and_the_scopes_topic_with_the_threads_expiry() -> None:
    effects, _, producer, _, metrics = _effects()
    facts = [[0, n, "acme", "pr-7", f"b{n}", f"e{n}", 1_000 + n, "webhook", f"b{n - 1}" if n else None, None]
             for n in range(5)]
    await effects.process([_Record(1, 0, orjson.dumps({"v": FACTS_FORMAT, "threads": facts}))])
    sent = {topic: (key, orjson.loads(value)) for topic, key, value in producer.sent}
    assert set(sent) == {"control", "alerts", "scopes"}
    key, halt = sent["scopes"]
    assert key == b"thread/acme/pr-7" and halt["verdict"] == "self_trigger" and halt["trigger_event_id"] == "e3"
    assert halt["expires_ms"] == 1_003 + FleetThresholds().thread_ttl_ms
    await effects.flush()
    state = ThreadState.decode(effects.stores["threads"].data[(1, b"acme/pr-7")])  # type: ignore[attr-defined]
    assert state.sources == {"0": 4} and len(state.runs) == 5
    assert metrics.fleet_facts.labels(fold="threads", state="folded")._value.get() == 5
    await effects.process([_Record(1, 1, orjson.dumps({"v": FACTS_FORMAT, "threads": facts}))])  # again
    assert len(producer.sent) == 3 and metrics.fleet_facts.labels(fold="threads", state="redelivered")._value.get() == 5


async def test_a_batchs_tool_facts_go_out_summed_per_source_partition_key_and_window() -> None:

    producer = _Producer()
    publisher = FactsPublisher("facts", 4, producer)  # type: ignore[arg-type]

    def call(n: int, source: int, window: int = 60_000, ok: bool = False) -> tuple[int, int, Any]:
        return (source, 100 + n, ToolFact("acme", "search", "api", window, f"e{n}", f"r{n}", window + n, 1,
                                          0 if ok else 1, window + n if ok else -1, 0, () if ok else (f"r{n}",)))

    facts = [call(0, 1), call(1, 1), call(2, 2), call(3, 1, ok=True), call(4, 1, window=120_000)]
    await asyncio.gather(*await publisher.send(fact_items(facts)))
    sent = [item for _, _, value in producer.sent for item in decode_facts(value)]
    summed = {(source, fact.window_ms): (offset, fact.calls, fact.transient, fact.failing_runs, fact.event_id)
              for kind, source, offset, fact in sent}
    assert summed == {(1, 60_000): (103, 3, 2, ("r0", "r1"), "e3"), (2, 60_000): (102, 1, 1, ("r2",), "e2"),
                      (1, 120_000): (104, 1, 1, ("r4",), "e4")}
    # each sum lists its offset range: the offsets of its calls, and of the transient failures among them
    assert {(source, fact.window_ms): (fact.offsets, fact.transient_offsets) for _, source, _, fact in sent} == {
        (1, 60_000): ((100, 101, 103), (100, 101)), (2, 60_000): ((102,), (102,)), (1, 120_000): ((104,), (104,))}
    effects, _, producer2, _, metrics = _effects(storm_min_runs=2)
    records = [_Record(0, i, value) for i, (_, _, value) in enumerate(producer.sent)]
    await effects.process(records)
    pauses = [orjson.loads(v) for t, _, v in producer2.sent if t == "control"]
    assert [(p["action"], p["verdict"], p["tool"]) for p in pauses] == [("pause", "tool_storm", "search")]
    assert [k for t, k, _ in producer2.sent if t == "scopes"] == [b"tool/acme/search/api"]
    assert metrics.fleet_facts.labels(fold="tools", state="folded")._value.get() == 3


async def test_a_tool_fact_of_the_release_before_offset_ranges_is_still_folded() -> None:
    """During a rolling upgrade the facts topic holds tool facts without offsets lists: folded as facts
    whose offsets are unknown (counted whole past the high-water offset, skipped at or below it)."""
    effects, _, _, dead, metrics = _effects()
    old = [[0, 100 + n, "acme", "search", "api", 60_000, f"e{n}", f"r{n}", 60_000 + n, 2, 1, -1, 0, [f"r{n}"]]
           for n in range(3)]
    await effects.process([_Record(0, 0, orjson.dumps({"v": FACTS_FORMAT, "tools": old})),
                           _Record(0, 1, orjson.dumps({"v": FACTS_FORMAT, "tools": old[:1]}))])  # again: skipped
    await effects.flush()
    assert dead.sent == []
    [state] = [ToolState.decode(v) for v in effects.stores["tools"].data.values()]  # type: ignore[attr-defined]
    assert state.windows["60000"][:2] == [6, 3] and state.sources == {"0": 102, "0@60000": 102}
    assert metrics.fleet_facts.labels(fold="tools", state="redelivered")._value.get() == 1


async def test_a_tree_fact_of_the_release_before_root_total_is_folded_as_then() -> None:
    """During a rolling upgrade the facts topic holds tree facts one field short: a root's then carried its
    run's total so far (the fold keeps the largest), a sub-agent's its call's cost; a newer root fact
    adds what its call spent. $0.40 then $0.70 (totals), a sub-agent's $0.20, then $0.15 added: $1.05,
    past a $1 budget at the last fact, not before (summing the totals would cross at $0.70)."""
    effects, store, producer, dead, _ = _effects(max_tree_cost_usd=1.0)

    def item(offset: int, run: str, cost: int, *newer: bool) -> list[Any]:
        parent = None if run == "root" else "root"
        return [0, offset, "root", run, f"{run}-{offset}", 1000 + offset, parent, None, cost, offset == 1,
                "kid" if offset == 1 else None, None, None, "acme", *newer]

    old = [item(1, "root", 400_000), item(2, "kid", 200_000), item(3, "root", 700_000)]
    await effects.process([_Record(0, 0, orjson.dumps({"v": FACTS_FORMAT, "trees": old}))])
    assert dead.sent == [] and [t for t, _, _ in producer.sent if t == "control"] == []
    await effects.process([_Record(0, 1, orjson.dumps({"v": FACTS_FORMAT, "trees": [item(4, "root", 150_000, False)]}))])
    await effects.flush()
    assert dead.sent == []
    halts = [orjson.loads(v) for t, _, v in producer.sent if t == "control"]
    assert [(h["verdict"], h["trigger_event_id"], h["evidence"]["cost_usd"]) for h in halts] == \
        [("tree_budget", "root-4", 1.05)]
    [state] = [TreeState.decode(v) for v in store.data.values()]
    assert (state.root_cost, state.cost_micro) == (700_000, 350_000)


async def test_a_batch_folded_again_with_its_edges_cut_elsewhere_counts_each_call_once() -> None:
    """A worker published the tool facts of telemetry offsets 100-109 as one sum (its offset range) and
    crashed before its run state was written; the next owner folds 100-104 and 105-114 (another poll,
    other edges). The first sum is at or below the key's high-water offset (skipped); the second straddles
    it, and only its calls past it (110-114) count: 15 calls, 10 transient. Then 115-120 (2 failures):
    21 calls, 12 transient from 12 runs, a storm (storm_min_runs 12); had 105-109's successes counted
    twice, 12 of 26 would be under half, and no storm."""
    producer = _Producer()
    publisher = FactsPublisher("facts", 1, producer)  # type: ignore[arg-type]

    def call(offset: int) -> tuple[int, int, Any]:
        failing = 100 <= offset <= 104 or 110 <= offset <= 116
        return (0, offset, ToolFact("acme", "search", "api", 60_000, f"e{offset}", f"r{offset}", 60_000 + offset,
                                    1, int(failing), -1 if failing else 60_000 + offset, 0,
                                    (f"r{offset}",) if failing else ()))

    for edges in (range(100, 110), range(100, 105), range(105, 115)):
        await asyncio.gather(*await publisher.send(fact_items([call(offset) for offset in edges])))
    effects, _, decided, _, metrics = _effects(storm_min_runs=12)
    await effects.process([_Record(0, i, value) for i, (_, _, value) in enumerate(producer.sent)])
    await effects.flush()
    [state] = [ToolState.decode(v) for v in effects.stores["tools"].data.values()]  # type: ignore[attr-defined]
    assert state.windows["60000"][:2] == [15, 10]  # 100-114, each once
    assert metrics.fleet_facts.labels(fold="tools", state="redelivered")._value.get() == 1
    await asyncio.gather(*await publisher.send(fact_items([call(offset) for offset in range(115, 121)])))
    await effects.process([_Record(0, 3, producer.sent[-1][2])])
    [pause] = [orjson.loads(v) for t, _, v in decided.sent if t == "control"]
    assert (pause["action"], pause["trigger_event_id"]) == ("pause", "e120")
    assert (pause["evidence"]["calls"], pause["evidence"]["transient"], pause["evidence"]["runs"]) == (21, 12, 12)


async def test_the_sweep_forgets_silent_keys_and_scans_nothing_before_one_can_be_silent() -> None:
    effects, store, _, _, _ = _effects(tree_ttl_ms=100)  # 10 keys scanned per sweep
    for n in range(12):  # 12 trees at 1000..1011
        await effects.process([_Record(0, n, _spawns(f"t{n:02d}", n, 1))])
    await effects.sweep({0})
    await effects.sweep({0})  # the pass over the 12 keys is complete
    assert store.scanned == 12 and len(store.data) == 12
    await effects.process([_Record(0, 12, _spawns("t12", 50, 1))])  # event time 1050
    await effects.sweep({0})
    assert store.scanned == 12  # 1050: nothing can be silent for 100 ms before 1100
    await effects.process([_Record(0, 13, _spawns("late", 13, 1))])  # a new key of event time 1013...
    await effects.process([_Record(0, 14, _spawns("t14", 105, 1))])  # ...and 1105: t00..t04 are silent
    await effects.sweep({0})
    await effects.sweep({0})
    assert sorted(k for _, k in store.data) == [b"late", *(f"t{n:02d}".encode() for n in (5, 6, 7, 8, 9, 10, 11, 12, 14))]
    scanned = store.scanned
    await effects.sweep({0})  # the oldest left is 1005: it can go after 1105, the watermark: nothing scanned
    assert store.scanned == scanned
    await effects.process([_Record(0, 15, _spawns("t15", 114, 1))])  # 1114: "late" (1013) is silent
    await effects.sweep({0})
    await effects.sweep({0})
    assert b"late" not in {k for _, k in store.data}


async def test_a_fact_dated_years_ahead_does_not_make_every_key_of_its_partition_silent() -> None:
    """The sweep's watermark goes at most a minute past the wall clock: one fact dated in year 9999 (a
    runtime's broken clock) would otherwise put every tree of its partition past its ttl at once."""
    effects, store, _, _, _ = _effects()  # tree_ttl_ms: 1 h
    now = 1_800_000_000_000
    effects.clock = lambda: now

    def spawn(root: str, offset: int, ts_ms: int) -> bytes:
        fact = [0, offset, root, root, f"{root}-{offset}", ts_ms, None, None, 0, True, f"{root}-kid", "w", "t", None]
        return orjson.dumps({"v": FACTS_FORMAT, "trees": [fact]})

    await effects.process([_Record(0, n, spawn(f"t{n}", n, now - 60_000 + n)) for n in range(3)])
    await effects.process([_Record(0, 3, spawn("broken-clock", 3, 253_402_300_799_000))])
    await effects.sweep({0})
    await effects.sweep({0})
    assert sorted(k for _, k in store.data) == [b"broken-clock", b"t0", b"t1", b"t2"]
    now += 3_600_000  # an hour on: the three are silent for the ttl now
    await effects.process([_Record(0, 4, spawn("t4", 4, now))])
    await effects.sweep({0})
    await effects.sweep({0})
    assert sorted(k for _, k in store.data) == [b"broken-clock", b"t4"]


async def test_a_sweep_pass_cut_short_by_a_recovery_starts_again_at_the_first_key() -> None:
    """A recovery may bring keys another worker wrote, older than any seen: the bound is dropped, and
    the next pass covers every key (one begun at the old cursor would bound only the keys after it)."""
    effects, store, _, _, _ = _effects(tree_ttl_ms=100)
    for n in range(12):
        await effects.process([_Record(0, n, _spawns(f"t{n:02d}", n, 1))])
    await effects.sweep({0})  # t00..t09, the pass not complete
    effects.recount("trees", {0})
    await effects.sweep({0})
    assert store.starts == [b"", b""]


async def test_facts_of_runs_interleaved_in_a_source_partition_all_count() -> None:
    """A batch folds run by run: runs A and B of one tree at offsets 5, 7 (A) and 6 (B) give facts in the
    order 5, 7, 6. Published so, B's fact would be at or below the tree's high-water offset of partition
    0 and skipped as folded before: B would never be counted in its tree."""
    def event(run: str, n: int) -> dict[str, Any]:
        return {"run_id": run, "event_id": f"{run}-{n}", "tool": "search", "ts_ms": 1_000 + n, "outcome": "success",
                "args": {"q": n}, "result": "x", "root_run_id": "root", "parent_run_id": "root", "depth": 1}

    records = [RawRecord(0, 5 + n, *encode_telemetry(e)) for n, e in enumerate([event("A", 0), event("B", 1),
                                                                               event("A", 2)])]
    result = BatchFold(Detector(Policy())).fold(records, {(0, r.key): None for r in records if r.key}, 0)
    assert [(offset, orjson.loads(item)[3]) for _, offset, _, _, item in result.facts] == [(5, "A"), (7, "A"), (6, "B")]
    effects, store, producer, _, metrics = _effects()
    await asyncio.gather(*await FactsPublisher("facts", 1, producer).send(result.facts))  # type: ignore[arg-type]
    await effects.process([_Record(0, n, value) for n, (_, _, value) in enumerate(producer.sent)])
    await effects.flush()
    state = TreeState.decode(store.data[(0, b"root")])
    assert sorted(state.depth) == ["A", "B", "root"] and state.sources == {"0": 7}
    assert metrics.fleet_facts.labels(fold="trees", state="redelivered")._value.get() == 0


@pytest.mark.parametrize("engine", ["python", "native"])
def test_with_the_rules_across_runs_off_a_batch_lists_no_facts_and_folds_alike(engine: str) -> None:
    """``LOOPWARDEN_FLEET_RULES=false``: nothing would fold the facts, so neither engine builds them (they
    cost the per-run fold Python objects for every event of a tree, a thread or an upstream); the runs'
    records and decisions are the same as with them."""
    if engine == "native":
        fold_class: Any = pytest.importorskip("stream_app.worker.batch").NativeBatchFold
        pytest.importorskip("loopwarden_native")
    else:
        fold_class = BatchFold

    def event(run: str, n: int, outcome: str) -> dict[str, Any]:
        return {"run_id": run, "event_id": f"{run}-{n}", "tool": "search", "ts_ms": 1_000 + n, "outcome": outcome,
                "error_class": "http_503" if outcome == "error" else None, "upstream": "api.example.com",
                "args": {"q": 1}, "result": "x", "root_run_id": "root", "parent_run_id": "root", "depth": 1,
                "thread_key": "issue-7", "trigger": "webhook", "tenant": "acme"}

    events = [event(run, n, "error") for n in range(5) for run in ("A", "B")]
    records = [RawRecord(0, n, *encode_telemetry({k: v for k, v in e.items() if v is not None}))
               for n, e in enumerate(events)]
    stored = {(0, r.key): None for r in records if r.key}
    with_facts = fold_class(Detector(Policy())).fold(records, stored, 0)
    without = fold_class(Detector(Policy()), facts=False).fold(records, stored, 0)
    assert {kind for _, _, kind, _, _ in with_facts.facts} == {0, 1, 2}  # trees, threads, tools
    assert without.facts == []
    assert without.records == with_facts.records
    assert [d.decision_id for d in without.decisions] == [d.decision_id for d in with_facts.decisions] != []


def test_both_engines_encode_a_batchs_facts_byte_for_byte_alike() -> None:
    """The native engine builds the facts topic's items itself (``worker/facts.py``): the same bytes and
    scope keys as the reference's ``fact_items``, escaping included (a tenant and a tool with ``/`` and
    ``%``, quotes, non-ASCII text), spawn fields, missing fields as null, and tool facts summed alike."""
    pytest.importorskip("loopwarden_native")
    from stream_app.worker.batch import NativeBatchFold

    def event(run: str, n: int, outcome: str, **extra: Any) -> dict[str, Any]:
        return {"run_id": run, "event_id": f"{run}-{n}", "tool": 'se"arch/%q', "ts_ms": 59_990 + n, "outcome": outcome,
                "error_class": "http_429" if outcome == "error" else None, "upstream": "api.exämple.com",
                "args": {"q": n}, "result": "x", "root_run_id": "root-ü", "parent_run_id": "root-ü", "depth": 1,
                "thread_key": "issue/7 \"ü\"", "trigger": "webhook", "tenant": "a/b%c", "cost_usd": 0.25,
                "retry_after_ms": 1500 if outcome == "error" else None, **extra}

    events = [event(run, n, "error" if n % 3 else "success") for n in range(12) for run in ("A", "B")]
    events += [event("A", 20, "success", tool_class="spawn", child_run_id="C", child_agent_id="coder",
                     task_hash="t" * 64, tenant=None, thread_key=None, upstream=None)]
    # a root spending before and after its spawn (its facts: at the spawn what it spent so far, then what
    # each call added; each item ends with ``root_total`` false)
    root = {"root_run_id": None, "parent_run_id": None, "depth": None, "thread_key": None, "upstream": None}
    events += [event("R", n, "success", **root, cost_usd=cost, tool_class="spawn" if n == 31 else None)
               for n, cost in ((30, 0.25), (31, 0.5), (32, 0.125), (33, None))]
    records = [RawRecord(0 if e["run_id"] == "R" else n % 2, n,
                         *encode_telemetry({k: v for k, v in e.items() if v is not None}))
               for n, e in enumerate(events)]
    stored = {(r.partition, r.key): None for r in records if r.key}
    reference = BatchFold(Detector(Policy())).fold(records, stored, 0)
    native = NativeBatchFold(Detector(Policy())).fold(records, stored, 0)
    assert {kind for _, _, kind, _, _ in reference.facts} == {0, 1, 2}
    assert [(orjson.loads(item)[4], orjson.loads(item)[8], orjson.loads(item)[-1]) for *_, key, item
            in reference.facts if key == "tree/R"] == [("R-31", 750_000, False), ("R-32", 125_000, False)]
    assert any(b"\\u00fc" not in item and "ü".encode() in item for *_, item in reference.facts)
    assert sorted(native.facts) == sorted(reference.facts)
    assert native.records == reference.records and b'"spawned":true' in dict(reference.records[0])[b"R"]
    assert {key for _, _, _, key, _ in reference.facts} == {
        "tree/root-ü", "tree/R", "thread/a%2Fb%25c/issue/7 \"ü\"", "tool/a%2Fb%25c/se\"arch%2F%25q/api.exämple.com"}


def test_a_root_that_spawned_in_an_earlier_batch_sends_what_its_call_added_with_either_engine_reading_the_record() -> None:
    """``spawned`` lives in the run's record: a root's costly call in the next batch is a tree fact carrying
    what the call added to the root's spend (its spawn's fact carried all it spent before), whichever
    engine wrote the record and whichever reads it."""
    pytest.importorskip("loopwarden_native")
    from stream_app.worker.batch import NativeBatchFold

    def record(n: int, **extra: Any) -> RawRecord:
        return RawRecord(0, n, *encode_telemetry({"run_id": "R", "event_id": f"R-{n}", "tool": "claude",
                                                  "kind": "model_call", "ts_ms": n, "outcome": "success",
                                                  "args": {}, "result": n, **extra}))

    first = [record(0, cost_usd=0.25), record(1, tool="Task", kind="tool_call", tool_class="spawn", cost_usd=0.5)]
    second = [record(2, cost_usd=0.125), record(3)]
    engines = (BatchFold, NativeBatchFold)
    for writer in engines:
        written = writer(Detector(Policy())).fold(first, {(0, b"R"): None}, 0)
        stored = {(0, b"R"): dict(written.records[0])[b"R"]}
        for reader in engines:
            facts = reader(Detector(Policy())).fold(second, stored, 0).facts
            assert [(orjson.loads(item)[4], orjson.loads(item)[8]) for *_, item in facts] == [("R-2", 125_000)], \
                (writer, reader)


_TOOL_KEYS = [("acme", "search", "api"), ("globex", "search", "api")]


@pytest.mark.parametrize("windows", [
    pytest.param((60_000,), id="one-window"),
    pytest.param((60_000, 120_000), id="two-windows")])  # sums of two windows interleave in offsets
@settings(max_examples=60, deadline=None)
@given(data=st.data(), calls=st.lists(st.tuples(st.sampled_from([0, 0, 0, 1]), st.integers(0, 1), st.integers(0, 11),
                                                st.sampled_from(["ok", "transient", "transient", "transient", "other"])),
                                      min_size=30, max_size=70))
@example(data=None, calls=[(0, 0, 0, "transient"), (0, 1, 1, "transient"), (0, 0, 2, "transient")])
def test_tool_facts_published_again_with_other_edges_count_each_call_once(windows: tuple[int, ...], data: Any,
                                                                          calls: list[Any]) -> None:
    """A telemetry partition's tool calls (at offsets 100, 101, ...; two keys, each call in one of
    ``windows``) published as the batches of a worker that crashes now and then and starts again from an
    earlier offset, its batches cut elsewhere; the keyed fold counts each call once: a key's window holds
    its calls, transient failures and (up to ``storm_min_runs``) distinct failing runs, each once. With one
    window a key is paused only if some prefix of its calls crosses the rule, and always when all of them
    do."""
    def call(n: int) -> tuple[int, int, ToolFact]:
        k, w, run, outcome = calls[n]
        (tenant, tool, upstream), window = _TOOL_KEYS[k], windows[w % len(windows)]
        return (0, 100 + n, ToolFact(tenant, tool, upstream, window, f"e{n}", f"r{run}", window + n, 1,
                                     int(outcome == "transient"), window + n if outcome == "ok" else -1, 0,
                                     (f"r{run}",) if outcome == "transient" else ()))

    batches, position, crashes = [], 0, 0
    while position < len(calls):  # each batch from the consumer's position; after a crash (3 at most) from earlier
        start = position
        if data and crashes < 3 and data.draw(st.integers(0, 3)) == 0:
            start, crashes = data.draw(st.integers(max(0, position - 20), position)), crashes + 1
        position = min(len(calls), start + (data.draw(st.integers(1, 8)) if data else len(calls)))
        batches.append([call(n) for n in range(start, position)])

    async def fold() -> tuple[dict[str, ToolState], list[dict[str, Any]]]:
        producer = _Producer()
        publisher = FactsPublisher("facts", 1, producer)  # type: ignore[arg-type]
        for batch in batches:
            await asyncio.gather(*await publisher.send(fact_items(batch)))
        effects, _, decided, _, _ = _effects()
        await effects.process([_Record(0, i, value) for i, (_, _, value) in enumerate(producer.sent)])
        await effects.flush()
        states = {k.decode(): ToolState.decode(v) for (_, k), v in effects.stores["tools"].data.items()}  # type: ignore[attr-defined]
        return states, [orjson.loads(v) for t, _, v in decided.sent if t == "control"]

    states, decided = asyncio.run(fold())
    for k, key in enumerate(_TOOL_KEYS):
        mine = [(n, windows[w % len(windows)], run, outcome) for n, (c, w, run, outcome) in enumerate(calls) if c == k]
        for window in {window for _, window, _, _ in mine}:
            counted = states[key_text(key)].windows[str(window)]
            failing = {f"r{run}" for _, w, run, outcome in mine if w == window and outcome == "transient"}
            assert counted[:2] == [sum(w == window for _, w, _, _ in mine),
                                   sum(w == window and outcome == "transient" for _, w, _, outcome in mine)]
            assert set(counted[2]) <= failing and len(counted[2]) == min(10, len(failing))
        if len(windows) == 1:
            runs: set[int] = set()
            crossed = []
            for i, (_, _, run, outcome) in enumerate(mine):
                runs |= {run} if outcome == "transient" else set()
                transient = sum(outcome == "transient" for _, _, _, outcome in mine[: i + 1])
                crossed.append(len(runs) >= 10 and 2 * transient >= i + 1)
            paused = [d["decision_id"] for d in decided if (d["tenant"], d["tool"], d["upstream"]) == key]
            assert paused in ([], [scope_decision_id("tool", key, "pause", "tool_storm", str(windows[0]))])
            assert (crossed[-1] if mine else False) <= bool(paused) <= any(crossed)
