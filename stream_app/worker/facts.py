"""The facts topic's format: what the per-run fold tells the folds across runs, one owner for both sides.

A fact is what a new telemetry event tells a fold keyed by something other than its run
(``core/fleet``): a ``TreeFact`` (keyed by the tree's root), a ``ThreadFact`` (tenant, thread key) or a
``ToolFact`` (tenant, tool, upstream; a batch's tool facts of one source partition, key and window
summed into one, at the offset of the last contribution, listing the offsets of all: its offset range). The batch function lists each as a
``FactItem``: its source telemetry partition and offset, its kind (an index into ``KINDS``), its scope
key (``tree/ROOT``, ``thread/TENANT/THREAD``, ``tool/TENANT/TOOL/UPSTREAM``: the facts topic's
partition key) and the fact encoded as a message item, ``[source partition, offset, *fields]``. The
native engine builds items itself (no Python object per field); the reference builds them from its
facts with ``fact_items``; tests/unit/test_worker_batch.py holds the two alike.

A facts message (``message``) is ``{"v": 1, "trees": [item, ...], "threads": [...], "tools": [...]}``
(kinds without an item left out), one per facts partition per batch, each kind's items in source
offset order: the keyed folds skip a fact at or below its key's high-water offset of its source
partition as folded before. ``decode_facts`` reads one back. Kafka stays out of this module (the batch
function imports it); the publisher and the keyed folds are ``worker/fleet.py``.
"""

from __future__ import annotations

import functools
import itertools
import operator
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from ..core import InvalidEvent
from ..core.fleet import (
    SCOPES,
    ScopeDecision,
    ThreadFact,
    ThreadState,
    ToolFact,
    ToolState,
    TreeFact,
    TreeState,
    threads,
    tools,
    trees,
)
from ..core.policy import FleetThresholds

FACTS_FORMAT = 1

Fact = TreeFact | ThreadFact | ToolFact
#: (source partition, source offset, kind: index into ``KINDS``, scope key, the encoded message item).
FactItem = tuple[int, int, int, str, bytes]


@dataclass(frozen=True, eq=False)
class Kind:
    """One kind of key the fleet folds: its scope, facts, state and fold. One instance per kind (``KINDS``):
    compared and hashed by identity (a batch's facts are grouped by kind; hashing every field per fact
    was a tenth of the fold's time)."""

    #: Its place in ``KINDS`` (``FactItem``'s kind; the native engine's numbering).
    index: int
    scope: str
    #: The facts message's field for this kind, and the table's name.
    name: str
    label: str
    fact: type[Any]
    state: type[Any]
    fold: Callable[[FleetThresholds, Any, Any], tuple[ScopeDecision, ...]]
    ttl_ms: Callable[[FleetThresholds], int]

    @functools.cached_property
    def annotated(self) -> tuple[tuple[str, tuple[Any, ...]], ...]:
        """A message item's fields (``[source partition, offset, *fields]``), each with the types its annotation
        allows (``X | None``: either)."""
        return (("source partition", (int,)), ("offset", (int,)),
                *((name, typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,))
                  for name, hint in typing.get_type_hints(self.fact).items()))

    @functools.cached_property
    def item_fields(self) -> tuple[tuple[str, tuple[type, ...]], ...]:
        """``annotated`` as the JSON types each field may have (a tuple: a list; a bool is no int)."""
        return tuple((name, tuple(list if typing.get_origin(option) is tuple else option for option in options))
                     for name, options in self.annotated)

    @functools.cached_property
    def codes(self) -> tuple[int, ...]:
        """``annotated`` as the native reader takes it (``native/src/facts.rs``): per field, a mask of the JSON
        it may hold (``CODE_OF``; a list: of the element type its annotation gives)."""
        return tuple(functools.reduce(operator.or_, map(_code, options)) for _, options in self.annotated)

    @functools.cached_property
    def shapes(self) -> frozenset[tuple[type, ...]]:
        """Every combination of ``item_fields``' types, so checking an item is one set lookup (a fact has at
        most 6 optional fields)."""
        return frozenset(itertools.product(*(options for _, options in self.item_fields)))

    @functools.cached_property
    def legacy_shapes(self) -> frozenset[tuple[type, ...]]:
        """A fact as an earlier release wrote it: a tool fact without its two offsets lists (it is folded as
        one whose offsets are unknown: at or below the high-water offset, skipped; past it, counted whole);
        a tree fact without ``root_total`` (a root's cost was its run's total: folded as one). Threads:
        none."""
        if self.fact is ThreadFact:
            return frozenset()
        return frozenset(itertools.product(*(options for _, options in self.item_fields[:-self.legacy_cut])))

    @property
    def legacy_cut(self) -> int:
        """The fields an earlier release's item lacks (at its end)."""
        return 2 if self.fact is ToolFact else 1 if self.fact is TreeFact else 0

    @functools.cached_property
    def from_fields(self) -> Callable[[list[Any]], Any]:
        """A fact from its fields as a message item lists them (their number and types checked before): a
        tool fact's failing runs become a tuple."""
        if self.fact is ToolFact:
            # as ``ToolFact.of`` (the three lists as tuples) without its Python frames: a tool fact's build
            # was half of its decode
            new, size = tuple.__new__, len(self.item_fields) - 2
            return lambda fields: (new(ToolFact, (*fields[:11], tuple(fields[11]), tuple(fields[12]), tuple(fields[13])))
                                   if len(fields) == size else ToolFact.of(*fields))
        # the NamedTuple's own ``_make`` without its Python frame and its length check (done by the caller)
        make = functools.partial(tuple.__new__, self.fact)
        if self.fact is TreeFact:
            size = len(self.item_fields) - 2
            return lambda fields: make(fields) if len(fields) == size else make((*fields, True))
        return make

    @functools.cached_property
    def key_of(self) -> Callable[[Any], Any]:
        """A hashable form of a key from a fact or from a scope command's ``key`` (a fact's key fields come
        first, in the scope's order): the root of a tree, else a tuple. Cheaper per fact than its
        ``key_text``."""
        return operator.itemgetter(*range(len(SCOPES[self.scope])))


#: The native reader's code of each type a fact's field may have (``Kind.codes``; a list by its elements').
CODE_OF: dict[Any, int] = {int: 1, str: 2, bool: 4, type(None): 8, (list, str): 16, (list, int): 32}


def _code(option: Any) -> int:
    """``CODE_OF`` of one annotated type (``tuple[X, ...]``: a list of X)."""
    return CODE_OF[(list, typing.get_args(option)[0]) if typing.get_origin(option) is tuple else option]


TREES = Kind(0, "tree", "trees", "sub-agent tree", TreeFact, TreeState, trees.fold, lambda fleet: fleet.tree_ttl_ms)
THREADS = Kind(1, "thread", "threads", "thread", ThreadFact, ThreadState, threads.fold, lambda fleet: fleet.thread_ttl_ms)
TOOLS = Kind(2, "tool", "tools", "tool", ToolFact, ToolState, tools.fold, lambda fleet: fleet.tool_ttl_ms)
KINDS: tuple[Kind, ...] = (TREES, THREADS, TOOLS)
KIND_OF: dict[type[Any], Kind] = {kind.fact: kind for kind in KINDS}
KIND_OF_SCOPE: dict[str, Kind] = {kind.scope: kind for kind in KINDS}
#: What a tool fact's failing runs may hold.
_STRINGS = {str}
_INTS = {int}
_FIELD_OF: tuple[bytes, ...] = tuple(f',"{kind.name}":['.encode() for kind in KINDS)


def _names(kind: Kind) -> str:
    """A message item's fields with their types, for a refusal."""
    return ", ".join(f"{name}: {' | '.join('null' if option is type(None) else option.__name__ for option in options)}"
                     for name, options in kind.item_fields)


def scope_key(fact: Fact) -> str:
    return f"{KIND_OF[type(fact)].scope}/{fact.key_text}"


def fact_items(facts: Sequence[tuple[int, int, Fact]]) -> list[FactItem]:
    """The reference's items of a batch's facts (``(source partition, offset, fact)``, each event's in
    order): tool facts summed per source partition, key and window (``summed``)."""
    out = []
    for source_partition, offset, fact in summed(facts):
        kind = KIND_OF[type(fact)]
        out.append((source_partition, offset, kind.index, f"{kind.scope}/{fact.key_text}",
                    orjson.dumps([source_partition, offset, *fact])))
    return out


def summed(facts: Sequence[tuple[int, int, Fact]]) -> list[tuple[int, int, Fact]]:
    """``facts`` with the tool facts of one source partition, key and window summed into one, at the
    offset of the contribution with the highest source offset (its event the trigger, whatever order
    the batch's runs were folded in: the native engine sums alike), after the others."""
    out: list[tuple[int, int, Fact]] = []
    tool_facts: dict[tuple[int, tuple[str, str, str], int], list[tuple[int, ToolFact]]] = {}
    for source_partition, offset, fact in facts:
        if type(fact) is ToolFact:
            if not fact.offsets:  # one event's: its own offset (a sum read back lists its own)
                fact = fact._replace(offsets=(offset,), transient_offsets=(offset,) if fact.transient else ())
            tool_facts.setdefault((source_partition, fact.key, fact.window_ms), []).append((offset, fact))
        else:
            out.append((source_partition, offset, fact))
    for (source_partition, _, _), items in tool_facts.items():
        if len(items) == 1:
            out.append((source_partition, items[0][0], items[0][1]))
            continue
        last = max(range(len(items)), key=lambda i: items[i][0])
        ordered = [fact for i, (_, fact) in enumerate(items) if i != last] + [items[last][1]]
        out.append((source_partition, items[last][0], tools.merge(ordered)[0]))
    return out


def message(items: Sequence[Sequence[bytes]]) -> bytes:
    """One facts message from its encoded items by kind (``KINDS`` order), each kind's in source offset
    order."""
    parts = [b'{"v":%d' % FACTS_FORMAT]
    for field_of, kind_items in zip(_FIELD_OF, items, strict=True):
        if kind_items:
            parts += (field_of, b",".join(kind_items), b"]")
    parts.append(b"}")
    return b"".join(parts)


def decode_facts(value: bytes | None) -> list[tuple[Kind, int, int, Any]]:
    """The facts of one facts-topic message as (kind, source partition, offset, fact); InvalidEvent
    naming what is wrong."""
    try:
        obj = orjson.loads(value or b"")
    except orjson.JSONDecodeError as exc:
        raise InvalidEvent("facts", f"not JSON: {exc.msg}") from exc
    if type(obj) is not dict or obj.get("v") != FACTS_FORMAT:
        raise InvalidEvent("facts", f"not a facts message of format {FACTS_FORMAT}")
    out = []
    for kind in KINDS:
        items = obj.get(kind.name, [])
        if type(items) is not list:
            raise InvalidEvent(kind.name, "must be a list of facts")
        shapes, make, size = kind.shapes, kind.from_fields, len(kind.item_fields)
        listed = kind is TOOLS  # a tool fact's last three fields list runs and offsets
        legacy_size = size - kind.legacy_cut
        for item in items:
            legacy = False
            if type(item) is not list or tuple(map(type, item)) not in shapes:
                legacy = type(item) is list and tuple(map(type, item)) in kind.legacy_shapes
                if not legacy and (type(item) is not list or len(item) not in (size, legacy_size)):
                    raise InvalidEvent(kind.name, f"a fact must be a list of {size} fields")
                if not legacy:
                    raise InvalidEvent(kind.name, f"a fact's fields must be of their types ({_names(kind)})")
            if listed:
                runs = item[-1] if legacy else item[-3]
                if runs and set(map(type, runs)) != _STRINGS:
                    raise InvalidEvent(kind.name, "a tool fact's failing runs must be strings")
                if not legacy and ((item[-2] and set(map(type, item[-2])) != _INTS)
                                   or (item[-1] and set(map(type, item[-1])) != _INTS)):
                    raise InvalidEvent(kind.name, "a tool fact's offsets must be integers")
            out.append((kind, item[0], item[1], make(item[2:])))  # its shape checked: the fact can be made
    return out


def decoder(native: bool) -> Callable[[bytes | None], list[tuple[Kind, int, int, Any]]]:
    """``decode_facts``, or with ``native`` the native engine's reader of the same (``native/src/facts.rs``:
    ~2.4x less time a fact on the bench's trees). What it declines, anything it does not read for certain
    (bad input, an item of an earlier release's shape), the reference reads, refusing what is bad with its
    reason."""
    if not native:
        return decode_facts
    read = native_reader()

    def decode(value: bytes | None) -> list[tuple[Kind, int, int, Any]]:
        facts: list[tuple[Kind, int, int, Any]] | None = read(value or b"")
        return decode_facts(value) if facts is None else facts

    return decode


def native_reader() -> Callable[[bytes], list[tuple[Kind, int, int, Any]] | None]:
    """The native engine's reader of facts messages alone: None where it declines (``decoder`` then reads
    with the reference). ImportError without the native engine."""
    from loopwarden_native import FactsReader

    read: Callable[[bytes], list[tuple[Kind, int, int, Any]] | None] = FactsReader(
        FACTS_FORMAT, [(kind, kind.name, kind.fact, list(kind.codes)) for kind in KINDS]).read
    return read
