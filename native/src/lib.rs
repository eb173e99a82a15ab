//! `loopwarden_native`: the replay engine in Rust, for `loopwarden replay` at full speed.
//!
//! The Python core (`stream_app.core`) is the reference and stays the one the worker and the SDK run.
//! This engine folds telemetry lines into the same per-run states and reports the same findings; what
//! it does not handle itself goes back to the reference:
//! * a line it cannot decode on the fast path (bad, or merely unusual): `Replayer.feed` stops there and
//!   the caller decodes it with the reference (`observe` then folds the event it gives);
//! * the policy: thresholds are resolved by the reference `Policy` per (agent, tool), and object keys are
//!   judged by that policy's `FieldFilter` (each key once, then cached);
//! * the decision's text: a finding comes back as numbers for the reference's `explain`.

mod contract;
mod detector;
mod facts;
mod fields;
mod heap;
mod normalize;

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;

use hashlink::LinkedHashMap;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use serde_json::Value;

use contract::{Call, Hashed, OUTCOMES, TOOL_CLASSES};
use detector::{checksum, short, streak_tool, tool_digest, Admission, RunState, Step, Thresholds};
use fields::Object;
use normalize::{hex, semantic_hash as hash_value, HashError};

/// Cached key decisions per field filter (the reference caches as many).
const FIELD_CACHE_LIMIT: usize = 4096;
/// Cached (agent, tool) resolutions (the reference caches as many).
const POLICY_CACHE_LIMIT: usize = 10_000;

/// A finding as the reference's `Finding` fields: verdict, count, budget, period, first_event_id,
/// args_hash, args_verified, result_hash, result_fp, fuzzy, effective_outcome, (rule, advise, event_ids,
/// args_first, args_last): read by the reference's `Finding.of_native` (PyO3 converts tuples of at most 12).
type FindingTuple = (
    &'static str,
    i64,
    i64,
    i64,
    String,
    String,
    bool,
    String,
    String,
    bool,
    &'static str,
    (&'static str, bool, Vec<String>, String, String, i64),
);

/// The reference's hashes of a call it decoded: args, verified, result, fingerprint, canonical args.
type Given<'a> = (HashOf<'a>, bool, HashOf<'a>, Option<HashOf<'a>>, &'a str);

/// The largest canonical arguments kept for an args diff (the reference's `_ARGS_BYTES`).
const ARGS_BYTES: usize = 512;

/// Compiled masks, one per pattern text (a policy has few).
type Masks = HashMap<String, Rc<fancy_regex::Regex>>;

/// A map hashed by foldhash (its seed random per process), for the per-event lookups.
type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// The thresholds of one (agent, tool) pair and its field filter.
struct CallPolicy {
    thresholds: Thresholds,
    tool: [u8; 4],
    fields: FieldFilter,
    /// The volatile-token mask of failing results (None: masking off for this call).
    mask: Option<Rc<fancy_regex::Regex>>,
}

impl CallPolicy {
    fn from_reference(
        resolved: &Bound<'_, PyAny>,
        tool: &str,
        masks: &mut Masks,
    ) -> PyResult<Self> {
        let mask = resolved.getattr("mask")?;
        let mask = if mask.is_none() {
            None
        } else {
            let text: String = mask.getattr("pattern")?.extract()?;
            Some(match masks.get(&text) {
                Some(regex) => regex.clone(),
                None => {
                    let regex = Rc::new(compile_mask(&text)?);
                    masks.insert(text, regex.clone());
                    regex
                }
            })
        };
        let s = resolved.getattr("thresholds")?;
        let int = |name: &str| -> PyResult<i64> { s.getattr(name)?.extract() };
        let flag = |name: &str| -> PyResult<bool> { s.getattr(name)?.extract() };
        Ok(CallPolicy {
            thresholds: Thresholds {
                retry_budget: int("retry_budget")?,
                window_ms: int("window_ms")?,
                window_calls: int("window_calls")?,
                iteration_ceiling: int("iteration_ceiling")?,
                poll_alert_after: int("poll_alert_after")?,
                cycle_occurrences: int("cycle_occurrences")?,
                side_effect_window_ms: int("side_effect_window_ms")?,
                circuit_open_at: int("circuit_open_at")?,
                side_effect: flag("side_effect")?,
                collapse_whitespace: flag("collapse_whitespace")?,
                strict_args: flag("strict_args")?,
                dedupe_window: int("dedupe_window")?,
                shadow: flag("shadow")?,
                tool_class: {
                    let class: String = s.getattr("tool_class")?.extract()?;
                    TOOL_CLASSES
                        .iter()
                        .position(|c| *c == class)
                        .ok_or_else(|| {
                            pyo3::exceptions::PyValueError::new_err(format!(
                                "unknown tool class {class:?}"
                            ))
                        })? as u8
                },
                no_progress_at: int("no_progress_at")?,
                oscillation_revisits: int("oscillation_revisits")?,
                max_cost_micro: {
                    let usd: f64 = s.getattr("max_cost_usd")?.extract()?;
                    contract::micro_usd(&Value::from(usd))
                },
                max_tokens: int("max_tokens")?,
                max_calls: int("max_calls")?,
                max_model_calls_without_tool: int("max_model_calls_without_tool")?,
                handoff_round_trips: int("handoff_round_trips")?,
                advise: flag("advise")?,
            },
            tool: tool_digest(tool),
            fields: FieldFilter::new(resolved.getattr("fields")?.unbind()),
            mask,
        })
    }

    fn hash(
        &self,
        py: Python<'_>,
        value: &Value,
        scratch: &mut Vec<u8>,
    ) -> PyResult<Option<[u8; 32]>> {
        self.fields
            .hash(py, value, self.thresholds.collapse_whitespace, scratch)
    }
}

/// A reference ``FieldFilter``, asked once per key name (then cached here, as it caches itself).
struct FieldFilter {
    filter: Py<PyAny>,
    ignored: RefCell<HashMap<String, bool>>,
}

impl FieldFilter {
    fn new(filter: Py<PyAny>) -> Self {
        FieldFilter {
            filter,
            ignored: RefCell::new(HashMap::new()),
        }
    }

    fn is_ignored(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        if let Some(hit) = self.ignored.borrow().get(key) {
            return Ok(*hit);
        }
        let hit: bool = self
            .filter
            .bind(py)
            .call_method1("is_ignored", (key,))?
            .extract()?;
        let mut cache = self.ignored.borrow_mut();
        if cache.len() >= FIELD_CACHE_LIMIT {
            cache.clear();
        }
        cache.insert(key.to_owned(), hit);
        Ok(hit)
    }

    /// SHA-256 of the normalised value, None when it has no canonical form.
    fn hash(
        &self,
        py: Python<'_>,
        value: &Value,
        collapse: bool,
        scratch: &mut Vec<u8>,
    ) -> PyResult<Option<[u8; 32]>> {
        let mut ignored = |key: &str| self.is_ignored(py, key);
        match hash_value(value, &mut ignored, collapse, scratch) {
            Ok(digest) => Ok(Some(digest)),
            Err(HashError::NotNormalisable) => Ok(None),
            Err(HashError::Filter(err)) => Err(err),
        }
    }
}

/// An argument or result hash: computed here, given by the runtime, or impossible (fail closed).
#[derive(Clone)]
enum HashOf<'a> {
    Computed([u8; 32]),
    Given(&'a str),
    Missing,
}

impl HashOf<'_> {
    fn digest(&self, missing: &str) -> [u8; 8] {
        match self {
            HashOf::Computed(sha) => sha[..8].try_into().expect("32 bytes"),
            HashOf::Given(text) => short(text),
            HashOf::Missing => short(missing),
        }
    }

    fn text(&self, missing: &str) -> String {
        match self {
            HashOf::Computed(sha) => hex(sha),
            HashOf::Given(text) => (*text).to_owned(),
            HashOf::Missing => missing.to_owned(),
        }
    }
}

/// The policy side of folding a call, shared by both engines: (agent, tool) resolutions cached, and
/// the call's hashes computed (or taken as given).
struct Resolver {
    policy: Py<PyAny>,
    policies: FastMap<String, Rc<CallPolicy>>,
    policy_key: String,
    masks: Masks,
    scratch: Vec<u8>,
    /// The canonical form of the call's arguments, as hashed (or as the reference gave it).
    args_scratch: Vec<u8>,
}

impl Resolver {
    fn new(policy: Py<PyAny>) -> Self {
        Resolver {
            policy,
            policies: FastMap::default(),
            policy_key: String::new(),
            masks: HashMap::new(),
            scratch: Vec::with_capacity(1024),
            args_scratch: Vec::with_capacity(ARGS_BYTES),
        }
    }

    fn resolve(
        &mut self,
        py: Python<'_>,
        agent_id: Option<&str>,
        tool: &str,
    ) -> PyResult<Rc<CallPolicy>> {
        let key = &mut self.policy_key;
        key.clear();
        match agent_id {
            Some(agent) => {
                key.push('a');
                key.push_str(agent);
            }
            None => key.push('-'),
        }
        key.push('\u{1f}');
        key.push_str(tool);
        if let Some(hit) = self.policies.get(key.as_str()) {
            return Ok(hit.clone());
        }
        let resolved = self
            .policy
            .bind(py)
            .call_method1("resolve", (agent_id, tool))?;
        let policy = Rc::new(CallPolicy::from_reference(
            &resolved,
            tool,
            &mut self.masks,
        )?);
        if self.policies.len() >= POLICY_CACHE_LIMIT {
            self.policies.clear();
        }
        self.policies
            .insert(self.policy_key.clone(), policy.clone());
        Ok(policy)
    }

    /// Fold an admitted, counted call into `state`: its hashes (computed, or ``given`` by the
    /// reference), then the detector. The finding as the reference's tuple, if a rule fires.
    fn fold(
        &mut self,
        py: Python<'_>,
        state: &mut RunState,
        policy: &CallPolicy,
        call: &Call,
        given: Option<Given>,
    ) -> PyResult<Vec<FindingTuple>> {
        let thresholds = &policy.thresholds;
        self.args_scratch.clear();
        // Whether `args_scratch` holds the call's canonical arguments (raw, normalisable, short enough).
        let mut args_kept = false;
        if call.model_call {
            let step = Step {
                run_id: call.run_id,
                event_id: call.event_id,
                ts_ms: call.ts_ms,
                outcome: call.outcome,
                call: [0; 8],
                result: [0; 8],
                tool: policy.tool,
                streak_tool: policy.tool,
                retry_budget: None,
                side_effect: None,
                tool_class: 5,
                write: None,
                cost_micro: call.cost_micro,
                tokens: call.tokens,
                args: &[],
                transient: false,
                agent: [0; 8],
                child_agent: [0; 8],
            };
            return Ok(state
                .model_call(&step, thresholds)
                .into_iter()
                .map(|f| {
                    let outcome = OUTCOMES[f.outcome as usize];
                    (
                        f.verdict,
                        f.count,
                        0,
                        0,
                        f.first_event_id,
                        String::new(),
                        true,
                        String::new(),
                        String::new(),
                        false,
                        outcome,
                        (
                            f.rule,
                            f.advise,
                            f.event_ids,
                            f.args_first,
                            String::new(),
                            f.pause,
                        ),
                    )
                })
                .collect());
        }
        let (args, verified, result, given_fp) = match given {
            Some((args, verified, result, fp, text)) => {
                self.args_scratch.extend_from_slice(text.as_bytes());
                args_kept = true;
                (args, verified, result, Some(fp))
            }
            None => {
                let (args, verified) = match call.args {
                    Hashed::Raw(value) => match policy.hash(py, value, &mut self.args_scratch)? {
                        Some(sha) => {
                            args_kept = self.args_scratch.len() <= ARGS_BYTES;
                            (HashOf::Computed(sha), true)
                        }
                        None => (HashOf::Missing, false),
                    },
                    Hashed::Hash(text) => (HashOf::Given(text), !thresholds.strict_args),
                };
                let result = match call.result {
                    Hashed::Raw(value) => match policy.hash(py, value, &mut self.scratch)? {
                        Some(sha) => HashOf::Computed(sha),
                        None => HashOf::Missing,
                    },
                    Hashed::Hash(text) => HashOf::Given(text),
                };
                (args, verified, result, None)
            }
        };
        let step = Step {
            run_id: call.run_id,
            event_id: call.event_id,
            ts_ms: call.ts_ms,
            outcome: call.outcome,
            call: if verified { args.digest("") } else { short("") },
            result: result.digest("unhashable"),
            tool: policy.tool,
            streak_tool: streak_tool(policy.tool, call.upstream),
            retry_budget: call.retry_budget,
            side_effect: call.side_effect,
            tool_class: call.tool_class.unwrap_or(thresholds.tool_class),
            write: match (call.target, call.state_hash) {
                (Some(target), Some(after)) => Some((checksum(target), short(after))),
                _ => None,
            },
            cost_micro: call.cost_micro,
            tokens: call.tokens,
            args: if args_kept { &self.args_scratch } else { &[] },
            transient: call.outcome == contract::ERROR && is_transient(call.error_class),
            agent: checksum(call.agent_id.unwrap_or("")),
            child_agent: checksum(call.child_agent_id.unwrap_or("")),
        };
        // The fingerprint, computed only when the fold asks for it (as the reference does).
        let mut fp: Option<HashOf> = None;
        let mut fp_error: Option<PyErr> = None;
        let scratch = &mut self.scratch;
        let mut fingerprint = || -> Option<[u8; 8]> {
            if fp.is_none() {
                let computed = match &given_fp {
                    Some(given) => Ok(given.clone().unwrap_or_else(|| result.clone())),
                    None => result_fingerprint_of(py, policy, call, &result, scratch),
                };
                match computed {
                    Ok(hash) => fp = Some(hash),
                    Err(err) => {
                        fp_error = Some(err);
                        return None;
                    }
                }
            }
            fp.as_ref().map(|hash| hash.digest("unhashable"))
        };
        let findings = state.fold(&step, thresholds, &mut fingerprint);
        if findings.iter().any(|f| f.fuzzy && f.outcome != 0) {
            fingerprint(); // for the evidence
        }
        if let Some(err) = fp_error {
            return Err(err);
        }
        let fp_text = fp
            .as_ref()
            .map_or_else(String::new, |fp| fp.text("unhashable"));
        Ok(findings
            .into_iter()
            .map(|f| {
                let args_last = if f.event_ids.is_empty() || f.outcome == 0 || !args_kept {
                    String::new()
                } else {
                    String::from_utf8_lossy(&self.args_scratch).into_owned() // canonical JSON: UTF-8
                };
                (
                    f.verdict,
                    f.count,
                    f.budget,
                    f.period,
                    f.first_event_id,
                    args.text(""),
                    verified,
                    result.text("unhashable"),
                    fp_text.clone(),
                    f.fuzzy,
                    OUTCOMES[f.outcome as usize],
                    (
                        f.rule,
                        f.advise,
                        f.event_ids,
                        f.args_first,
                        args_last,
                        f.pause,
                    ),
                )
            })
            .collect())
    }
}

/// The engine behind `loopwarden replay`: run states with event-time eviction, as `RunTable`.
#[pyclass(unsendable)]
struct Replayer {
    resolver: Resolver,
    runs: LinkedHashMap<String, RunState>,
    runs_seen: HashSet<String>,
    /// The newest `ts_ms` folded so far.
    #[pyo3(get)]
    watermark_ms: i64,
    ttl_ms: i64,
    max_runs: usize,
    max_event_bytes: usize,
    /// Events folded or dropped as redeliveries (lines that decoded).
    #[pyo3(get)]
    events: u64,
    #[pyo3(get)]
    duplicates: u64,
    #[pyo3(get)]
    evicted: u64,
    /// Facts of the lines `feed` folded since `take_facts` (`FactsOf` as Python tuples: they outlive
    /// the lines they borrow from).
    facts: Vec<Py<PyAny>>,
}

/// The facts of one new event: ``(index, tree fact, thread fact, tool fact)``, each or None, at least
/// one set, borrowing the event's fields.
type FactsOf<'a> = (
    usize,
    Option<TreeFactTuple<'a>>,
    Option<ThreadFactTuple<'a>>,
    Option<ToolFactTuple<'a>>,
);

/// The facts of a new call, if any (`core.fleet`: `tree_fact`, `thread_fact`, `tool_fact`).
fn facts_of<'a>(
    index: usize,
    call: &Call<'a>,
    tool_class: u8,
    spent: Option<i64>,
) -> Option<FactsOf<'a>> {
    let tree = tree_fact(call, tool_class, spent);
    let thread = thread_fact(call);
    let tool = tool_fact(call);
    (tree.is_some() || thread.is_some() || tool.is_some()).then_some((index, tree, thread, tool))
}

/// Whether a new call has facts (`facts_of` is Some), by the conditions the builders start with, without
/// building them.
fn has_facts(call: &Call, tool_class: u8, spent: Option<i64>) -> bool {
    tree_root(call, tool_class, spent).is_some()
        || call.thread_key.is_some()
        || tool_upstream(call).is_some()
}

/// `core.fleet.ToolFact` of one event as a tuple: tenant ("" when none), tool, upstream, window start,
/// event id, run, ts_ms, calls (1), transient failures (0 or 1), success time (-1: none), retry after
/// (ms), the failing runs.
type ToolFactTuple<'a> = (
    &'a str,
    &'a str,
    &'a str,
    i64,
    &'a str,
    &'a str,
    i64,
    i64,
    i64,
    i64,
    i64,
    Vec<&'a str>,
);

/// A batch's summed tool fact: the fact, and the source offsets of its calls and of its transient
/// failures, ascending (`core.fleet.ToolFact`'s `offsets`, `transient_offsets`).
type ToolSum<'a> = (ToolFactTuple<'a>, Vec<i64>, Vec<i64>);

/// A batch's facts as `fact_items` encodes them: `FactsOf` with the tool facts summed.
type BatchFactsOf<'a> = (
    usize,
    Option<TreeFactTuple<'a>>,
    Option<ThreadFactTuple<'a>>,
    Option<ToolSum<'a>>,
);

/// A batch's facts, one new event's at a time (``(index, tool class, root_cost)`` in the order folded:
/// each event known to have facts), built from the events' calls with their tool facts summed per
/// (source partition, key, window) into one, at the index of the contribution with the highest source
/// offset (its event the trigger: the same whatever order the runs were folded in;
/// `worker.facts.summed` sums the reference's alike): a batch sends one tool fact per key and window,
/// not one per event. Tree and thread facts first, in the order given, then the sums in the order of
/// their first contribution.
fn batch_facts<'a>(
    marks: &[(usize, u8, Option<i64>)],
    calls: &[Option<Call<'a>>],
    inputs: &[Input<'_>],
) -> Vec<BatchFactsOf<'a>> {
    let mut out: Vec<BatchFactsOf<'a>> = Vec::with_capacity(marks.len());
    let mut sums: Vec<(usize, ToolSum<'a>)> = Vec::new();
    let mut at: FastMap<(i64, &'a str, &'a str, &'a str, i64), usize> = FastMap::default();
    for &(index, tool_class, spent) in marks {
        let call = calls[index].as_ref().expect("a folded event was decoded");
        let tree = tree_fact(call, tool_class, spent);
        let thread = thread_fact(call);
        if tree.is_some() || thread.is_some() {
            out.push((index, tree, thread, None));
        }
        let Some(fact) = tool_fact(call) else {
            continue;
        };
        let offset = inputs[index].offset;
        match at.entry((inputs[index].partition, fact.0, fact.1, fact.2, fact.3)) {
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(sums.len());
                let transient = if fact.8 != 0 {
                    vec![offset]
                } else {
                    Vec::new()
                };
                sums.push((index, (fact, vec![offset], transient)));
            }
            std::collections::hash_map::Entry::Occupied(slot) => {
                let (last, (sum, offsets, transient)) = &mut sums[*slot.get()];
                offsets.push(offset);
                if fact.8 != 0 {
                    transient.push(offset);
                }
                if inputs[index].offset > inputs[*last].offset {
                    *last = index;
                    sum.4 = fact.4;
                    sum.5 = fact.5;
                }
                sum.6 = sum.6.max(fact.6);
                sum.7 += fact.7;
                sum.8 += fact.8;
                sum.9 = sum.9.max(fact.9);
                sum.10 = sum.10.max(fact.10);
                for run in fact.11 {
                    if sum.11.len() < MAX_LISTED_RUNS && !sum.11.contains(&run) {
                        sum.11.push(run);
                    }
                }
            }
        }
    }
    out.extend(
        sums.into_iter()
            .map(|(index, (fact, mut offsets, mut transient))| {
                offsets.sort_unstable();
                transient.sort_unstable();
                (index, None, None, Some((fact, offsets, transient)))
            }),
    );
    out
}

/// Failing runs one summed tool fact lists at most (`core.fleet.tools.MAX_LISTED_RUNS`).
const MAX_LISTED_RUNS: usize = 64;

/// The storm's window (`core.fleet.tools.STORM_WINDOW_MS`).
const STORM_WINDOW_MS: i64 = 60_000;

/// `core.fleet.tools.is_transient`.
fn is_transient(error_class: Option<&str>) -> bool {
    match error_class {
        None => false,
        Some("http_429" | "http_5xx" | "timeout" | "connection") => true,
        Some(class) => {
            class.len() == 8
                && class.starts_with("http_5")
                && class[5..].bytes().all(|b| b.is_ascii_digit())
        }
    }
}

/// The tool fact of a tool call that names its upstream (`core.fleet.tools.tool_fact`).
fn tool_fact<'a>(call: &Call<'a>) -> Option<ToolFactTuple<'a>> {
    let upstream = tool_upstream(call)?;
    let transient = call.outcome == contract::ERROR && is_transient(call.error_class);
    let ts = call.ts_ms;
    Some((
        call.tenant.unwrap_or(""),
        call.tool,
        upstream,
        ts - ts.rem_euclid(STORM_WINDOW_MS),
        call.event_id,
        call.run_id,
        ts,
        1,
        i64::from(transient),
        if call.outcome == contract::SUCCESS {
            ts
        } else {
            -1
        },
        call.retry_after_ms,
        if transient {
            vec![call.run_id]
        } else {
            Vec::new()
        },
    ))
}

/// The upstream of a tool call that has a tool fact: a tool call (not a model call) naming its upstream.
fn tool_upstream<'a>(call: &Call<'a>) -> Option<&'a str> {
    call.upstream.filter(|_| !call.model_call)
}

/// The root of the tree a call's tree fact is about, or None when it tells the tree nothing: a run
/// outside any tree, or a root's call that starts no child and costs nothing or comes before its first
/// spawn (`spent`: `root_cost`, None until the root has spawned).
fn tree_root<'a>(call: &Call<'a>, tool_class: u8, spent: Option<i64>) -> Option<&'a str> {
    let root = call.root_run_id.unwrap_or(call.run_id);
    (root != call.run_id
        || tool_class == contract::SPAWN
        || (spent.is_some() && call.cost_micro != 0))
        .then_some(root)
}

/// `core.fleet.TreeFact` as a tuple: root, run, event id, ts_ms, parent, declared depth, cost
/// (micro-USD), spawn, child run, child agent, task hash, tenant.
type TreeFactTuple<'a> = (
    &'a str,
    &'a str,
    &'a str,
    i64,
    Option<&'a str>,
    Option<i64>,
    i64,
    bool,
    Option<&'a str>,
    Option<&'a str>,
    Option<&'a str>,
    Option<&'a str>,
);

/// What a root's tree fact adds to its tree's spend (`core.fleet.trees.root_cost`), from its run's
/// `RunState::root_spent` before and after the call: nothing before its first spawn, all it spent so far
/// at that spawn, what the call added after it.
fn root_cost(before: Option<i64>, after: Option<i64>) -> Option<i64> {
    match (before, after) {
        (_, None) => None,
        (None, Some(after)) => Some(after),
        (Some(before), Some(after)) => Some(after - before),
    }
}

/// The tree fact of a new call (`core.fleet.trees.tree_fact`), or None when it is in no tree: a root's
/// fact carries what it adds to the tree's spend (`spent`: `root_cost`, when known), a sub-agent's its
/// call's cost.
fn tree_fact<'a>(call: &Call<'a>, tool_class: u8, spent: Option<i64>) -> Option<TreeFactTuple<'a>> {
    let spawn = tool_class == contract::SPAWN;
    let root = tree_root(call, tool_class, spent)?;
    // a root not yet a spawner (a model call said to be a spawn) adds nothing: its first spawn brings it
    let cost = if root == call.run_id {
        spent.unwrap_or(0)
    } else {
        call.cost_micro
    };
    Some((
        root,
        call.run_id,
        call.event_id,
        call.ts_ms,
        call.parent_run_id,
        call.depth,
        cost,
        spawn,
        call.child_run_id.filter(|_| spawn),
        call.child_agent_id.filter(|_| spawn),
        call.task_hash.filter(|_| spawn),
        call.tenant,
    ))
}

/// `core.fleet.ThreadFact` as a tuple: tenant ("" when none), thread key, run, event id, ts_ms,
/// trigger, caused by, the error class of a failing call.
type ThreadFactTuple<'a> = (
    &'a str,
    &'a str,
    &'a str,
    &'a str,
    i64,
    Option<&'a str>,
    Option<&'a str>,
    Option<&'a str>,
);

/// The thread fact of a new call (`core.fleet.threads.thread_fact`), or None when its run names no
/// thread.
fn thread_fact<'a>(call: &Call<'a>) -> Option<ThreadFactTuple<'a>> {
    let thread_key = call.thread_key?;
    let failure = (call.outcome == contract::ERROR).then(|| call.error_class.unwrap_or("error"));
    Some((
        call.tenant.unwrap_or(""),
        thread_key,
        call.run_id,
        call.event_id,
        call.ts_ms,
        call.trigger,
        call.caused_by_run_id,
        failure,
    ))
}

#[pymethods]
impl Replayer {
    #[new]
    fn new(
        py: Python<'_>,
        policy: Py<PyAny>,
        max_runs: usize,
        max_event_bytes: usize,
    ) -> PyResult<Self> {
        let ttl_ms = policy
            .bind(py)
            .getattr("defaults")?
            .getattr("run_ttl_ms")?
            .extract()?;
        Ok(Replayer {
            resolver: Resolver::new(policy),
            runs: LinkedHashMap::new(),
            runs_seen: HashSet::new(),
            watermark_ms: 0,
            ttl_ms,
            max_runs,
            max_event_bytes,
            events: 0,
            duplicates: 0,
            evicted: 0,
            facts: Vec::new(),
        })
    }

    /// The facts of the lines `feed` folded (not redeliveries) since the last call, as ``(index, tree
    /// fact or None, thread fact or None, tool fact or None)`` in line order.
    fn take_facts(&mut self) -> Vec<Py<PyAny>> {
        std::mem::take(&mut self.facts)
    }

    /// Fold `lines[start:]` in order. Returns where it stopped (``len(lines)``, or the index of a line
    /// the reference decoder must handle before feeding resumes after it) and the findings, as
    /// ``(index, finding)``. Blank lines are skipped.
    fn feed(
        &mut self,
        py: Python<'_>,
        lines: &Bound<'_, PyList>,
        start: usize,
    ) -> PyResult<(usize, Vec<(usize, FindingTuple)>)> {
        let mut findings = Vec::new();
        let total = lines.len();
        for index in start..total {
            let item = lines.get_item(index)?;
            let line = item.cast::<PyBytes>()?.as_bytes();
            if line.iter().all(|b| matches!(b, b' ' | b'\t'..=b'\r')) {
                continue;
            }
            if line.len() > self.max_event_bytes {
                return Ok((index, findings));
            }
            let Ok(Value::Object(obj)) = serde_json::from_slice::<Value>(line) else {
                return Ok((index, findings));
            };
            let Some(call) = contract::decode(&obj) else {
                return Ok((index, findings));
            };
            let duplicates = self.duplicates;
            let before = self.runs.get(call.run_id).and_then(RunState::root_spent);
            for finding in self.fold_call(py, &call, None)? {
                findings.push((index, finding));
            }
            if self.duplicates == duplicates {
                let policy = self.resolver.resolve(py, call.agent_id, call.tool)?;
                let class = call.tool_class.unwrap_or(policy.thresholds.tool_class);
                let after = self.runs.get(call.run_id).and_then(RunState::root_spent);
                if let Some(facts) = facts_of(index, &call, class, root_cost(before, after)) {
                    self.facts
                        .push(facts.into_pyobject(py)?.into_any().unbind());
                }
            }
        }
        Ok((total, findings))
    }

    /// Fold one event the reference decoded, with the hashes it computed (``event_hashes``). Returns
    /// ``(duplicate, finding or None)``.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (run_id, event_id, tool, agent_id, ts_ms, outcome, args_hash, args_verified,
                        result_hash, result_fp, retry_budget, plan_step, side_effect, tool_class,
                        target, state_hash, model_call, tokens, cost_micro, args_text, error_class=None,
                        child_agent_id=None, upstream=None))]
    fn observe(
        &mut self,
        py: Python<'_>,
        run_id: &str,
        event_id: &str,
        tool: &str,
        agent_id: Option<&str>,
        ts_ms: i64,
        outcome: &str,
        args_hash: &str,
        args_verified: bool,
        result_hash: &str,
        result_fp: &str,
        retry_budget: Option<i64>,
        plan_step: Option<i64>,
        side_effect: Option<bool>,
        tool_class: Option<&str>,
        target: Option<&str>,
        state_hash: Option<&str>,
        model_call: bool,
        tokens: i64,
        cost_micro: i64,
        args_text: &str,
        error_class: Option<&str>,
        child_agent_id: Option<&str>,
        upstream: Option<&str>,
    ) -> PyResult<(bool, Vec<FindingTuple>)> {
        let tool_class =
            match tool_class {
                None => None,
                Some(class) => Some(TOOL_CLASSES.iter().position(|c| *c == class).ok_or_else(
                    || {
                        pyo3::exceptions::PyValueError::new_err(format!(
                            "unknown tool class {class:?}"
                        ))
                    },
                )? as u8),
            };
        let outcome = OUTCOMES.iter().position(|o| *o == outcome).ok_or_else(|| {
            pyo3::exceptions::PyValueError::new_err(format!("unknown outcome {outcome:?}"))
        })? as u8;
        // The reference's hashes stand in for the JSON, which this call never sees.
        let call = Call {
            run_id,
            event_id,
            tool,
            agent_id,
            ts_ms,
            outcome,
            args: Hashed::Hash(args_hash),
            result: Hashed::Hash(result_hash),
            raw_result: None,
            result_fp: None,
            tool_class,
            target,
            state_hash,
            model_call,
            tokens,
            cost_micro,
            retry_budget,
            plan_step,
            side_effect,
            policy_digest: None,
            parent_run_id: None,
            root_run_id: None,
            depth: None,
            child_run_id: None,
            child_agent_id,
            task_hash: None,
            tenant: None,
            thread_key: None,
            trigger: None,
            caused_by_run_id: None,
            error_class,
            upstream,
            retry_after_ms: 0,
        };
        let duplicates = self.duplicates;
        let given = (
            HashOf::Given(args_hash),
            args_verified,
            HashOf::Given(result_hash),
            Some(HashOf::Given(result_fp)),
            args_text,
        );
        let finding = self.fold_call(py, &call, Some(given))?;
        Ok((self.duplicates > duplicates, finding))
    }

    /// What a run spent so far (micro-USD) once it made a spawn-class call, else None (also for a run
    /// not tracked): `core.fleet.trees.root_spent`, read before and after a call for `root_cost`.
    fn root_spent(&self, run_id: &str) -> Option<i64> {
        self.runs.get(run_id).and_then(RunState::root_spent)
    }

    /// Distinct run ids seen so far (evicted ones included).
    #[getter]
    fn runs_seen(&self) -> usize {
        self.runs_seen.len()
    }

    /// Runs tracked now.
    fn __len__(&self) -> usize {
        self.runs.len()
    }
}

impl Replayer {
    /// Fold one call into its run (created on first sight), then evict as `RunTable` does. ``given``:
    /// the reference's hashes (args, verified, result) instead of hashing the call's JSON here.
    fn fold_call(
        &mut self,
        py: Python<'_>,
        call: &Call,
        given: Option<Given>,
    ) -> PyResult<Vec<FindingTuple>> {
        self.events += 1;
        if !self.runs_seen.contains(call.run_id) {
            self.runs_seen.insert(call.run_id.to_owned());
        }
        let policy = self.resolver.resolve(py, call.agent_id, call.tool)?;
        let state = match self.runs.get_mut(call.run_id) {
            Some(_) => {
                self.runs.to_back(call.run_id);
                self.runs.get_mut(call.run_id).expect("just moved")
            }
            None => self
                .runs
                .entry(call.run_id.to_owned())
                .or_insert_with(RunState::default),
        };
        let mut finding = Vec::new();
        match state.admit(call.event_id, call.ts_ms, &policy.thresholds) {
            Admission::Duplicate => self.duplicates += 1,
            Admission::Halted => {
                if !call.model_call {
                    state.halted_call(call.tool_class.unwrap_or(policy.thresholds.tool_class));
                }
            }
            Admission::Fold => {
                if !call.model_call {
                    state.count_call(call.plan_step);
                }
                finding = self.resolver.fold(py, state, &policy, call, given)?;
            }
        }
        if call.ts_ms > self.watermark_ms {
            self.watermark_ms = call.ts_ms;
        }
        self.evict();
        Ok(finding)
    }

    fn evict(&mut self) {
        let horizon = self.watermark_ms - self.ttl_ms;
        while let Some((_, oldest)) = self.runs.front() {
            if oldest.last_ts_ms >= horizon && self.runs.len() <= self.max_runs {
                return;
            }
            self.runs.pop_front();
            self.evicted += 1;
        }
    }
}

/// What `BatchFolder.fold` returns: new records ``(partition, key, record)``, findings ``(index,
/// finding)``, re-keys ``(index, run_id)``, deferred record indexes (for the reference), events folded
/// by outcome (``OUTCOMES`` order), duplicates, watermarks ``(partition, ts_ms)``, policy mismatches
/// ``(index, agent_id or "", digest)``, and the facts of the new events as the facts topic's items
/// (`FactItem`).
type BatchOut = (
    Vec<(i64, Py<PyBytes>, Py<PyBytes>)>,
    Vec<(usize, FindingTuple)>,
    Vec<(usize, String)>,
    Vec<usize>,
    [u64; 4],
    u64,
    Vec<(i64, i64)>,
    Vec<(usize, String, String)>,
    Vec<FactItem>,
);

/// One fact as the facts topic's item (`stream_app/worker/facts.py`: `FactItem`): source partition,
/// offset, kind (`KINDS`: 0 trees, 1 threads, 2 tools), scope key, and the item
/// ``[source partition, offset, *fields]`` as JSON.
type FactItem = (i64, i64, u8, String, Py<PyBytes>);

/// A scope key's part but the last (`core.fleet.scope.key_text`): `%` and `/` escaped.
fn key_part(part: &str) -> std::borrow::Cow<'_, str> {
    if part.contains(['%', '/']) {
        part.replace('%', "%25").replace('/', "%2F").into()
    } else {
        part.into()
    }
}

/// The items of a batch's facts (`batch_facts`), in the order given.
fn fact_items(
    py: Python<'_>,
    facts: Vec<BatchFactsOf<'_>>,
    inputs: &[Input<'_>],
) -> PyResult<Vec<FactItem>> {
    let json = |e: serde_json::Error| pyo3::exceptions::PyValueError::new_err(e.to_string());
    let mut out = Vec::with_capacity(facts.len());
    for (index, tree, thread, tool) in facts {
        let (sp, off) = (inputs[index].partition, inputs[index].offset);
        if let Some(f) = tree {
            let key = format!("tree/{}", f.0);
            // the last field: `TreeFact.root_total` (a root's cost is what to add, not its run's total)
            let item = serde_json::to_vec(&(
                sp, off, f.0, f.1, f.2, f.3, f.4, f.5, f.6, f.7, f.8, f.9, f.10, f.11, false,
            ))
            .map_err(json)?;
            out.push((sp, off, 0, key, PyBytes::new(py, &item).unbind()));
        }
        if let Some(f) = thread {
            let key = format!("thread/{}/{}", key_part(f.0), f.1);
            let item = serde_json::to_vec(&(sp, off, f.0, f.1, f.2, f.3, f.4, f.5, f.6, f.7))
                .map_err(json)?;
            out.push((sp, off, 1, key, PyBytes::new(py, &item).unbind()));
        }
        if let Some((f, offsets, transient)) = tool {
            let key = format!("tool/{}/{}/{}", key_part(f.0), key_part(f.1), f.2);
            let item = serde_json::to_vec(&(
                sp, off, f.0, f.1, f.2, f.3, f.4, f.5, f.6, f.7, f.8, f.9, f.10, f.11, offsets,
                transient,
            ))
            .map_err(json)?;
            out.push((sp, off, 2, key, PyBytes::new(py, &item).unbind()));
        }
    }
    Ok(out)
}

/// One input record as read from the consumer's record object.
struct Input<'py> {
    partition: i64,
    offset: i64,
    key: Option<Bound<'py, PyBytes>>,
    value: Option<Bound<'py, PyBytes>>,
}

/// The worker's batch fold (`stream_app/worker/batch.py:BatchFold.fold`) for telemetry: stored records
/// and raw messages in, new records and findings out, with the per-run offset guard. The state is in
/// the records: between calls it keeps only the policy cache and `Decoded`, the states of the records it
/// wrote last (a cache of their decoding, used only for a stored record byte for byte the one it
/// wrote). A run this engine does not fold wholly (a record it cannot decode, an operator command, a
/// stored record it cannot read, a policy it cannot store) is deferred, every record of it, to the
/// reference, which folds it, dead-letters what is bad and raises what must stop the worker.
#[pyclass(unsendable)]
struct BatchFolder {
    resolver: Resolver,
    policy_digest: String,
    write_version: i64,
    max_event_bytes: usize,
    record: Vec<u8>,
    /// Whether `fold` lists the facts of the rules across runs (`BatchFold.facts`).
    facts: bool,
    decoded: Decoded,
}

/// Runs' states as this engine last wrote their records, most recently written last, at most `capacity`.
///
/// A run in a batch is folded from its stored record: reading it (JSON, ~1.3 KB, into a `RunState`) was
/// a quarter of the native fold's time on the bench's corpus, most runs having an event in many
/// batches. A stored record equal, byte for byte, to the one this engine wrote last for the run is
/// the state it wrote it from, so that state is folded on instead: `RunState::from_record` of the
/// record gives the same state (`verify` checks it on every hit; the differential tests turn it on).
/// Any other record (the reference's, another worker's after a rebalance, the last one again when a
/// batch is folded twice) is read as before. Only records of the current format are kept: an older
/// `write_version` drops fields the state has.
struct Decoded {
    runs: LinkedHashMap<Vec<u8>, (Vec<u8>, RunState, i64)>,
    capacity: usize,
    /// The kept records' bytes: at most `max_bytes` (`DECODED_BYTES`: a policy with long windows makes
    /// records of tens of KB), each run's state about as large as its record (~3 KB a run on the bench's
    /// corpus).
    bytes: usize,
    max_bytes: usize,
    /// Decode every hit's record too and fail the batch if its state differs (tests).
    verify: bool,
    /// The look-up key: partition (8 bytes) and run key.
    at: Vec<u8>,
    hits: u64,
    misses: u64,
}

impl Decoded {
    fn key(&mut self, partition: i64, key: &[u8]) {
        self.at.clear();
        self.at.extend_from_slice(&partition.to_le_bytes());
        self.at.extend_from_slice(key);
    }

    /// The state and offset `raw` was written from, taken out of the cache, if this engine wrote it last.
    fn take(&mut self, partition: i64, key: &[u8], raw: &[u8]) -> Option<(RunState, i64)> {
        if self.capacity == 0 {
            return None;
        }
        self.key(partition, key);
        match self.runs.remove(self.at.as_slice()) {
            Some((record, state, offset)) if record == raw => {
                self.bytes -= record.len();
                self.hits += 1;
                Some((state, offset))
            }
            found => {
                if let Some((record, _, _)) = found {
                    self.bytes -= record.len();
                }
                self.misses += 1;
                None
            }
        }
    }

    /// `state` (at `offset`) is the one `record` was written from.
    fn put(&mut self, partition: i64, key: &[u8], record: Vec<u8>, state: RunState, offset: i64) {
        if self.capacity == 0 {
            return;
        }
        self.key(partition, key);
        self.bytes += record.len();
        if let Some((replaced, _, _)) = self.runs.insert(self.at.clone(), (record, state, offset)) {
            self.bytes -= replaced.len();
        }
        while self.runs.len() > self.capacity || self.bytes > self.max_bytes {
            match self.runs.pop_front() {
                Some((_, (evicted, _, _))) => self.bytes -= evicted.len(),
                None => break,
            }
        }
    }
}

/// Runs whose decoded state `BatchFolder` keeps by default (~3.2 KB each with its record on the bench's
/// corpus and the default policy, measured with `heap_bytes`: ~64 MB of the native heap when full).
const DECODED_RUNS: usize = 20_000;
/// Bytes of kept records at most (their states about as much again): ~64 MB of the native heap whatever
/// the policy's windows make a record weigh.
const DECODED_BYTES: usize = 32 << 20;

#[pymethods]
impl BatchFolder {
    #[new]
    #[pyo3(signature = (policy, policy_digest, write_version, max_event_bytes, facts=true,
                        decoded_runs=DECODED_RUNS, decoded_bytes=DECODED_BYTES, verify_decoded=false))]
    fn new(
        policy: Py<PyAny>,
        policy_digest: String,
        write_version: i64,
        max_event_bytes: usize,
        facts: bool,
        decoded_runs: usize,
        decoded_bytes: usize,
        verify_decoded: bool,
    ) -> PyResult<Self> {
        if !(0..=detector::FORMAT_VERSION).contains(&write_version) {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "write_version {write_version}: this engine writes versions 0 to {}",
                detector::FORMAT_VERSION
            )));
        }
        Ok(BatchFolder {
            resolver: Resolver::new(policy),
            policy_digest,
            write_version,
            max_event_bytes,
            record: Vec::with_capacity(1024),
            facts,
            decoded: Decoded {
                runs: LinkedHashMap::new(),
                // a record of an older format is not the state it was written from
                capacity: if write_version == detector::FORMAT_VERSION {
                    decoded_runs
                } else {
                    0
                },
                verify: verify_decoded,
                bytes: 0,
                max_bytes: decoded_bytes,
                at: Vec::new(),
                hits: 0,
                misses: 0,
            },
        })
    }

    /// (hits, misses, runs kept) of the decoded states' cache since this folder was made.
    fn decoded_stats(&self) -> (u64, u64, usize) {
        (
            self.decoded.hits,
            self.decoded.misses,
            self.decoded.runs.len(),
        )
    }

    /// Fold ``records`` (objects with ``partition``, ``offset``, ``key``, ``value``) into the stored runs
    /// (``stored``: ``(partition, key) -> bytes | None`` for every run key of the batch); the indexes in
    /// ``reference`` (operator commands) are deferred with their runs.
    fn fold(
        &mut self,
        py: Python<'_>,
        records: &Bound<'_, PyList>,
        reference: Vec<usize>,
        stored: &Bound<'_, PyDict>,
    ) -> PyResult<BatchOut> {
        let mut inputs = Vec::with_capacity(records.len());
        for record in records.iter() {
            inputs.push(Input {
                partition: record.getattr(intern!(py, "partition"))?.extract()?,
                offset: record.getattr(intern!(py, "offset"))?.extract()?,
                key: record
                    .getattr(intern!(py, "key"))?
                    .cast_into::<PyBytes>()
                    .ok(),
                value: record
                    .getattr(intern!(py, "value"))?
                    .cast_into::<PyBytes>()
                    .ok(),
            });
        }
        // Decode each record once to route it; runs in the order they first appear, as the reference.
        let mut values: Vec<Option<Object<'_>>> = Vec::with_capacity(inputs.len());
        let mut rekeys = Vec::new();
        // Runs: (partition, key, member indexes, deferred to the reference).
        let mut groups: Vec<(i64, &[u8], Vec<usize>, bool)> = Vec::new();
        let mut group_of: FastMap<(i64, &[u8]), usize> = FastMap::default();
        let reference: HashSet<usize> = reference.into_iter().collect();
        let mut watermarks: Vec<(i64, i64)> = Vec::new();
        let mut deferred_set: Vec<bool> = vec![false; inputs.len()];
        for (index, input) in inputs.iter().enumerate() {
            let decoded = if reference.contains(&index) {
                None
            } else {
                input.value.as_ref().and_then(|v| {
                    let bytes = v.as_bytes();
                    if bytes.len() > self.max_event_bytes {
                        return None;
                    }
                    Object::parse(bytes)
                })
            };
            values.push(decoded);
        }
        // Each decoded record's call, decoded once: the routing below and its run's fold both read it.
        let calls: Vec<Option<Call<'_>>> = values
            .iter()
            .map(|value| contract::decode(value.as_ref()?))
            .collect();
        for (index, input) in inputs.iter().enumerate() {
            let key = input.key.as_ref().map(|k| k.as_bytes());
            match (&calls[index], key) {
                (Some(call), Some(key)) if call.run_id.as_bytes() == key => {
                    note_watermark(&mut watermarks, input.partition, call.ts_ms);
                    let g = group_index(&mut groups, &mut group_of, input.partition, key);
                    groups[g].2.push(index);
                }
                (Some(call), _) => rekeys.push((index, call.run_id.to_owned())),
                (None, Some(key)) => {
                    // Not decodable here: the reference decodes it (or dead-letters it) with its run.
                    let g = group_index(&mut groups, &mut group_of, input.partition, key);
                    groups[g].2.push(index);
                    groups[g].3 = true;
                }
                (None, None) => deferred_set[index] = true,
            }
        }

        let mut out_records = Vec::new();
        let mut findings = Vec::new();
        let mut applied = [0u64; 4];
        let mut duplicates = 0u64;
        let mut mismatches = Vec::new();
        let mut facts = Vec::new();
        for (partition, key, members, deferred) in groups.iter_mut() {
            let folded = if *deferred {
                None
            } else {
                self.fold_run(py, *partition, key, members, &inputs, &calls, stored)?
            };
            match folded {
                Some(run) => {
                    for (o, n) in applied.iter_mut().zip(run.applied) {
                        *o += n;
                    }
                    duplicates += run.duplicates;
                    findings.extend(run.findings);
                    mismatches.extend(run.mismatches);
                    facts.extend(run.facts);
                    if let Some(record) = run.record {
                        out_records.push((*partition, PyBytes::new(py, key).unbind(), record));
                    }
                }
                None => {
                    for &member in members.iter() {
                        deferred_set[member] = true;
                    }
                }
            }
        }
        let facts = fact_items(py, batch_facts(&facts, &calls, &inputs), &inputs)?;
        let deferred = (0..inputs.len()).filter(|i| deferred_set[*i]).collect();
        Ok((
            out_records,
            findings,
            rekeys,
            deferred,
            applied,
            duplicates,
            watermarks,
            mismatches,
            facts,
        ))
    }
}

/// What folding one run gave.
struct FoldedRun {
    record: Option<Py<PyBytes>>,
    findings: Vec<(usize, FindingTuple)>,
    applied: [u64; 4],
    duplicates: u64,
    mismatches: Vec<(usize, String, String)>,
    /// The new events with facts: (index, tool class, `root_cost`), built once the batch is folded
    /// (`batch_facts`).
    facts: Vec<(usize, u8, Option<i64>)>,
}

impl BatchFolder {
    /// Fold one run's records (all decodable) into its stored record; None to defer the run to the
    /// reference (its stored record or a policy this engine cannot handle).
    #[allow(clippy::too_many_arguments)]
    fn fold_run(
        &mut self,
        py: Python<'_>,
        partition: i64,
        key: &[u8],
        members: &[usize],
        inputs: &[Input<'_>],
        calls: &[Option<Call<'_>>],
        stored: &Bound<'_, PyDict>,
    ) -> PyResult<Option<FoldedRun>> {
        let lookup = (partition, PyBytes::new(py, key));
        let stored_record = stored.get_item(lookup)?;
        let mut unchanged: Option<&[u8]> = None; // the stored record, while the fold changes nothing
        let (mut state, mut run_offset) = match &stored_record {
            None => (RunState::default(), -1),
            Some(raw) if raw.is_none() => (RunState::default(), -1),
            Some(raw) => {
                let Ok(raw) = raw.cast::<PyBytes>() else {
                    return Ok(None);
                };
                let raw = raw.as_bytes();
                unchanged = Some(raw);
                let read =
                    || Object::parse(raw).and_then(|record| RunState::from_record(&record, raw));
                match self.decoded.take(partition, key, raw) {
                    Some(kept) => {
                        if self.decoded.verify && read().as_ref() != Some(&kept) {
                            return Err(pyo3::exceptions::PyAssertionError::new_err(format!(
                                "the decoded state kept for run {:?} is not its record's: {:?} vs {:?}",
                                String::from_utf8_lossy(key),
                                kept,
                                read()
                            )));
                        }
                        kept
                    }
                    None => match read() {
                        Some(found) => found,
                        None => return Ok(None),
                    },
                }
            }
        };
        let mut run = FoldedRun {
            record: None,
            findings: Vec::new(),
            applied: [0; 4],
            duplicates: 0,
            mismatches: Vec::new(),
            facts: Vec::new(),
        };
        let mut changed = false;
        for &index in members {
            let offset = inputs[index].offset;
            if offset <= run_offset {
                run.duplicates += 1;
                continue;
            }
            let call = calls[index].as_ref().expect("routed to fold: decoded");
            let policy = self.resolver.resolve(py, call.agent_id, call.tool)?;
            if policy.thresholds.cycle_occurrences > detector::MAX_STORED_CYCLE_OCCURRENCES {
                return Ok(None);
            }
            let before = state.root_spent();
            let admission = state.admit(call.event_id, call.ts_ms, &policy.thresholds);
            match admission {
                Admission::Duplicate => run.duplicates += 1,
                Admission::Halted => {
                    run.applied[call.outcome as usize] += 1;
                    if !call.model_call {
                        state.halted_call(call.tool_class.unwrap_or(policy.thresholds.tool_class));
                    }
                }
                Admission::Fold => {
                    run.applied[call.outcome as usize] += 1;
                    if !call.model_call {
                        state.count_call(call.plan_step);
                    }
                    for finding in self.resolver.fold(py, &mut state, &policy, call, None)? {
                        run.findings.push((index, finding));
                    }
                }
            }
            if self.facts && !matches!(admission, Admission::Duplicate) {
                let class = call.tool_class.unwrap_or(policy.thresholds.tool_class);
                let spent = root_cost(before, state.root_spent());
                if has_facts(call, class, spent) {
                    run.facts.push((index, class, spent)); // built, borrowed, once the batch is folded
                }
            }
            if let Some(digest) = call.policy_digest {
                if digest != self.policy_digest {
                    run.mismatches.push((
                        index,
                        call.agent_id.unwrap_or("").to_owned(),
                        digest.to_owned(),
                    ));
                }
            }
            run_offset = offset;
            changed = true;
        }
        if changed {
            self.record.clear();
            state.write_record(run_offset, self.write_version, &mut self.record);
            run.record = Some(PyBytes::new(py, &self.record).unbind());
            self.decoded
                .put(partition, key, self.record.clone(), state, run_offset);
        } else if let Some(raw) = unchanged {
            // only redeliveries: kept again, as read (or as kept), for the next batch
            self.decoded
                .put(partition, key, raw.to_vec(), state, run_offset);
        }
        Ok(Some(run))
    }
}

/// The index of run (partition, key) in `groups`, added at the end when first seen.
fn group_index<'a>(
    groups: &mut Vec<(i64, &'a [u8], Vec<usize>, bool)>,
    group_of: &mut FastMap<(i64, &'a [u8]), usize>,
    partition: i64,
    key: &'a [u8],
) -> usize {
    *group_of.entry((partition, key)).or_insert_with(|| {
        groups.push((partition, key, Vec::new(), false));
        groups.len() - 1
    })
}

/// The newest event time per partition, above 0 (as the reference's ``ts_ms > watermarks.get(p, 0)``).
fn note_watermark(watermarks: &mut Vec<(i64, i64)>, partition: i64, ts_ms: i64) {
    match watermarks.iter_mut().find(|(p, _)| *p == partition) {
        Some(entry) => entry.1 = entry.1.max(ts_ms),
        None if ts_ms > 0 => watermarks.push((partition, ts_ms)),
        None => {}
    }
}

/// The semantic hash (hex) of a JSON document under a reference ``FieldFilter``, or None when it has
/// no canonical form; the differential tests compare it with ``stream_app.core.semantic_hash``.
#[pyfunction]
fn semantic_hash(
    py: Python<'_>,
    json: &[u8],
    fields: Py<PyAny>,
    collapse_whitespace: bool,
) -> PyResult<Option<String>> {
    let value: Value = serde_json::from_slice(json)
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("not JSON: {e}")))?;
    let fields = FieldFilter::new(fields);
    Ok(fields
        .hash(py, &value, collapse_whitespace, &mut Vec::new())?
        .map(|sha| hex(&sha)))
}

/// A failing call's result fingerprint (the reference's ``_result_fp``): the masked raw result, else the
/// one sent, else the result hash itself (also when masking is off).
fn result_fingerprint_of<'a>(
    py: Python<'_>,
    policy: &CallPolicy,
    call: &Call<'a>,
    result: &HashOf<'a>,
    scratch: &mut Vec<u8>,
) -> PyResult<HashOf<'a>> {
    Ok(match (&policy.mask, call.raw_result) {
        (None, _) => result.clone(),
        (Some(mask), Some(value)) => {
            let masked = mask_value(mask, value)?;
            match policy.hash(py, &masked, scratch)? {
                Some(sha) => HashOf::Computed(sha),
                None => HashOf::Missing,
            }
        }
        (Some(_), None) => call.result_fp.map_or_else(|| result.clone(), HashOf::Given),
    })
}

/// The volatile-token mask of a reference pattern text (`stream_app/core/volatile.py`).
fn compile_mask(text: &str) -> PyResult<fancy_regex::Regex> {
    // No backtrack limit, as Python's re has none: the rules never nest quantifiers, so the work is
    // linear in the text (bounded per position), but the counter runs over a whole scan, and the
    // default million would fail a long token-free error text (an event may be 1 MiB).
    fancy_regex::RegexBuilder::new(text)
        .backtrack_limit(usize::MAX)
        .build()
        .map_err(|e| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "volatile-token pattern does not compile: {e}"
            ))
        })
}

/// The marker of each group `g0`..`g9`, as the reference's `MARKERS`.
const MARKERS: [&str; 10] = [
    "<id>",
    "<n>",
    "<uuid>",
    "<datetime>",
    "<datetime>",
    "<hex>",
    "<hex>",
    "<num>",
    "<time>",
    "<duration>",
];

/// `text` with its volatile tokens replaced by their markers (the reference's `VolatileMask.text`).
fn mask_text(mask: &fancy_regex::Regex, text: &str) -> PyResult<String> {
    let mut out = String::with_capacity(text.len());
    let mut last = 0;
    for captures in mask.captures_iter(text) {
        let captures = captures.map_err(|e| {
            pyo3::exceptions::PyRuntimeError::new_err(format!("volatile-token mask failed: {e}"))
        })?;
        let whole = captures.get(0).expect("group 0 is the match");
        let (group, volatile) = (1..captures.len())
            .find_map(|i| captures.get(i).map(|m| (i - 1, m)))
            .expect("every alternative is one named group");
        out.push_str(&text[last..volatile.start()]);
        out.push_str(MARKERS[group]);
        last = whole.end();
    }
    out.push_str(&text[last..]);
    Ok(out)
}

/// A copy of `value` with every string masked (keys are left alone).
fn mask_value(mask: &fancy_regex::Regex, value: &Value) -> PyResult<Value> {
    Ok(match value {
        Value::String(text) => Value::String(mask_text(mask, text)?),
        Value::Array(items) => Value::Array(
            items
                .iter()
                .map(|v| mask_value(mask, v))
                .collect::<PyResult<_>>()?,
        ),
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| Ok((k.clone(), mask_value(mask, v)?)))
                .collect::<PyResult<_>>()?,
        ),
        other => other.clone(),
    })
}

/// The volatile-token mask of `text` under reference pattern `pattern`: the differential tests compare
/// it with ``VolatileMask.text``.
#[pyfunction]
#[pyo3(name = "mask_text")]
fn mask_text_py(pattern: &str, text: &str) -> PyResult<String> {
    mask_text(&compile_mask(pattern)?, text)
}

/// The result fingerprint of a JSON document (masked, then hashed under a reference ``FieldFilter``),
/// or None when it has no canonical form.
#[pyfunction]
fn result_fingerprint(
    py: Python<'_>,
    json: &[u8],
    fields: Py<PyAny>,
    collapse_whitespace: bool,
    pattern: &str,
) -> PyResult<Option<String>> {
    let value: Value = serde_json::from_slice(json)
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("not JSON: {e}")))?;
    let masked = mask_value(&compile_mask(pattern)?, &value)?;
    let fields = FieldFilter::new(fields);
    Ok(fields
        .hash(py, &masked, collapse_whitespace, &mut Vec::new())?
        .map(|sha| hex(&sha)))
}

/// Bytes this extension holds on the heap now (requested sizes, as tracemalloc counts Python's): the
/// benchmark's memory per tracked run.
#[pyfunction]
fn heap_bytes() -> usize {
    heap::allocated()
}

#[pymodule]
fn loopwarden_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Replayer>()?;
    m.add_class::<BatchFolder>()?;
    m.add_class::<facts::FactsReader>()?;
    m.add_function(wrap_pyfunction!(semantic_hash, m)?)?;
    m.add_function(wrap_pyfunction!(heap_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(mask_text_py, m)?)?;
    m.add_function(wrap_pyfunction!(result_fingerprint, m)?)?;
    Ok(())
}
