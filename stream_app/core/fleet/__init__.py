"""Rules across runs: what only a fleet-wide stream sees (shared/notes/loop-classes.md, classes b, c, h).

The per-run fold (``core.detector``) judges one run at a time. These folds judge keys that span runs,
from compact facts the per-run side extracts from each new (not redelivered) event:

* ``trees``: sub-agent trees, keyed by root run id (``tree_depth``, ``tree_recursion``, ``tree_fanout``,
  ``tree_budget``).
* ``threads``: self-triggering chains, keyed by (tenant, thread key) (``self_trigger``,
  ``schedule_failing``, ``thread_rate``).
* ``tools``: tool storms, keyed by (tenant, tool, upstream) (``tool_storm``: a fleet-wide pause, then
  half-open, then ``resume``).

A decision here is a ``ScopeDecision``: it names its scope and key (control v1's ``scope`` and key
fields), never a ``run_id`` an older runtime would act on, and its id is derived from (scope, key,
action, verdict, what in the key fired), not from the event that crossed the threshold, so every order
of the same facts yields the same set of decisions (``trigger_event_id`` names the fact that crossed it
in the order this fold saw them). One exception: a storm's half-open steps (a pause again, the resume)
follow the facts as they arrive, and facts of several source partitions may interleave otherwise than in
replay (``tools``' docstring says what stays equal). Pure like the rest of the core: no I/O, time from
the events.
"""

from __future__ import annotations

from .scope import SCOPES, ScopeDecision, scope_decision_id
from .threads import ThreadFact, ThreadFold, ThreadState, thread_fact
from .tools import ToolFact, ToolFold, ToolState, is_transient, tool_fact
from .trees import TreeFact, TreeFold, TreeState, root_cost, root_spent, tree_fact

__all__ = ["SCOPES", "ScopeDecision", "ThreadFact", "ThreadFold", "ThreadState", "ToolFact", "ToolFold", "ToolState",
           "TreeFact", "TreeFold", "TreeState", "is_transient", "root_cost", "root_spent", "scope_decision_id", "thread_fact", "tool_fact",
           "tree_fact"]
