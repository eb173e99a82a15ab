//! Telemetry v1 decoding for the fast path: accepts exactly what `stream_app/core/contract.py` accepts
//! in the ordinary case and hands everything else back (`None`), so that the reference decoder either
//! reports the precise error or decodes an unusual but valid event. The fast path must never accept a
//! line the reference refuses; the differential tests check that.

use serde_json::Value;

use crate::fields::Fields;

const MAX_ID_LENGTH: usize = 512;
const MAX_RETRY_BUDGET: i64 = 10_000;
const MAX_ERROR_HEAD_BYTES: usize = 256;
const MAX_DEPTH: i64 = 10_000;
/// The latest event time (`MAX_TS_MS` of the reference): 9999-12-31T23:59:59.999Z.
const MAX_TS_MS: i64 = 253_402_300_799_999;
const TRIGGERS: [&str; 4] = ["user", "schedule", "webhook", "agent"];

pub const OUTCOMES: [&str; 4] = ["success", "error", "empty", "noop"];
/// The index of `error` in `OUTCOMES`.
pub const ERROR: u8 = 1;
/// The index of `success` in `OUTCOMES`.
pub const SUCCESS: u8 = 0;
/// Tool classes, in the reference's `TOOL_CLASSES` order.
pub const TOOL_CLASSES: [&str; 6] = ["read", "write", "poll", "spawn", "handoff", "other"];
pub const READ: u8 = 0;
pub const WRITE: u8 = 1;
pub const SPAWN: u8 = 3;
pub const HANDOFF: u8 = 4;

/// Where a call's arguments or result come from: the raw JSON, or a hash the runtime computed.
pub enum Hashed<'a> {
    Raw(&'a Value),
    Hash(&'a str),
}

/// Sums saturate here (the reference's `SPEND_CAP`): both engines agree past any real budget.
pub const SPEND_CAP: i64 = 1 << 62;

/// A cost in USD (a JSON number >= 0) as integer micro-USD, as the reference's `micro_usd`.
pub fn micro_usd(value: &Value) -> i64 {
    match value.as_u64() {
        Some(whole) => whole.saturating_mul(1_000_000).min(SPEND_CAP as u64) as i64,
        None => clamp_float((value.as_f64().unwrap_or(0.0) * 1_000_000.0 + 0.5).floor()),
    }
}

/// A token count (a JSON number >= 0) as an integer, as the reference's `token_count`.
pub fn token_count(value: &Value) -> i64 {
    match value.as_u64() {
        Some(whole) => whole.min(SPEND_CAP as u64) as i64,
        None => clamp_float(value.as_f64().unwrap_or(0.0).floor()),
    }
}

fn clamp_float(f: f64) -> i64 {
    if f >= SPEND_CAP as f64 {
        SPEND_CAP
    } else {
        f.max(0.0) as i64
    }
}
/// The fields of one telemetry event the detector reads.
pub struct Call<'a> {
    pub run_id: &'a str,
    pub event_id: &'a str,
    pub tool: &'a str,
    pub agent_id: Option<&'a str>,
    pub ts_ms: i64,
    /// Index into `OUTCOMES`.
    pub outcome: u8,
    pub args: Hashed<'a>,
    pub result: Hashed<'a>,
    /// The raw result when the event has one (it may also carry a `result_hash`): the fingerprint
    /// masks it.
    pub raw_result: Option<&'a Value>,
    /// The fingerprint the runtime sent (`result_fp`).
    pub result_fp: Option<&'a str>,
    /// Index into `TOOL_CLASSES`, when the event says.
    pub tool_class: Option<u8>,
    pub target: Option<&'a str>,
    pub state_hash: Option<&'a str>,
    pub retry_budget: Option<i64>,
    pub plan_step: Option<i64>,
    pub side_effect: Option<bool>,
    /// The runtime's policy digest, when it folded the call locally.
    pub policy_digest: Option<&'a str>,
    /// `kind: model_call`: an inference, not a tool call.
    pub model_call: bool,
    /// `tokens` and `cost_usd` (numbers >= 0) as integers: tokens and micro-USD.
    pub tokens: i64,
    pub cost_micro: i64,
    /// Trees (fleet-wide rules): the run's parent and root, its declared depth, and the child a
    /// spawn-class call names.
    pub parent_run_id: Option<&'a str>,
    pub root_run_id: Option<&'a str>,
    pub depth: Option<i64>,
    pub child_run_id: Option<&'a str>,
    pub child_agent_id: Option<&'a str>,
    pub task_hash: Option<&'a str>,
    pub tenant: Option<&'a str>,
    /// Chains (fleet-wide rules): the run's thread, what started it and the run that caused it; and
    /// a failing call's error class.
    pub thread_key: Option<&'a str>,
    pub trigger: Option<&'a str>,
    pub caused_by_run_id: Option<&'a str>,
    pub error_class: Option<&'a str>,
    /// Storms: the host or MCP server the tool calls, and the wait it asked for.
    pub upstream: Option<&'a str>,
    pub retry_after_ms: i64,
}

/// The call in `obj`, or None when the reference decoder must look at it.
pub fn decode<R: Fields + ?Sized>(obj: &R) -> Option<Call<'_>> {
    let run_id = identifier(obj.field("run_id"), true)?;
    let event_id = identifier(obj.field("event_id"), true)?;
    let tool = identifier(obj.field("tool"), true)?;
    let ts_ms = integer(obj.field("ts_ms")?).filter(|t| (0..=MAX_TS_MS).contains(t))?;
    let outcome = match obj.field("outcome")? {
        Value::String(s) => OUTCOMES.iter().position(|o| o == s)? as u8,
        _ => return None,
    };
    let model_call = match present(obj.field("kind")) {
        None => false,
        Some(Value::String(kind)) if kind == "tool_call" => false,
        Some(Value::String(kind)) if kind == "model_call" => true,
        Some(_) => return None,
    };
    // A model call needs neither arguments nor a result; a tool call needs both.
    let args = match (present(obj.field("args")), present(obj.field("args_hash"))) {
        (_, Some(hash)) if !is_hash(hash) => return None,
        (Some(args @ Value::Object(_)), _) => Hashed::Raw(args),
        (Some(_), _) => return None,
        (None, Some(Value::String(hash))) => Hashed::Hash(hash),
        (None, _) if model_call => Hashed::Hash(""),
        (None, _) => return None,
    };
    let result = match (present(obj.field("result_hash")), obj.field("result")) {
        (Some(Value::String(hash)), _) if is_hash_text(hash) => Hashed::Hash(hash),
        (Some(_), _) => return None,
        (None, Some(result)) => Hashed::Raw(result), // a JSON null result is a result; an absent one is not
        (None, None) if model_call => Hashed::Hash(""),
        (None, None) => return None,
    };
    let mut call = Call {
        run_id,
        event_id,
        tool,
        agent_id: None,
        ts_ms,
        outcome,
        args,
        result,
        raw_result: obj.field("result"),
        result_fp: None,
        tool_class: None,
        target: None,
        state_hash: None,
        model_call,
        tokens: 0,
        cost_micro: 0,
        retry_budget: None,
        plan_step: None,
        side_effect: None,
        policy_digest: None,
        parent_run_id: None,
        root_run_id: None,
        depth: None,
        child_run_id: None,
        child_agent_id: None,
        task_hash: None,
        tenant: None,
        thread_key: None,
        trigger: None,
        caused_by_run_id: None,
        error_class: None,
        upstream: None,
        retry_after_ms: 0,
    };
    obj.try_each(|name, value| {
        if value.is_null() {
            return Some(()); // an optional field set to null is absent
        }
        match name {
            "run_id" | "event_id" | "tool" | "ts_ms" | "outcome" | "args" | "args_hash"
            | "result" | "result_hash" => {}
            "agent_id" => call.agent_id = Some(identifier(Some(value), false)?),
            "tenant" => call.tenant = Some(identifier(Some(value), false)?),
            "trace_id" | "span_id" | "parent_span_id" => {
                identifier(Some(value), false)?;
            }
            "upstream" => call.upstream = Some(identifier(Some(value), false)?),
            "error_class" => call.error_class = Some(identifier(Some(value), false)?),
            "caused_by_run_id" => call.caused_by_run_id = Some(identifier(Some(value), false)?),
            "thread_key" => call.thread_key = Some(identifier(Some(value), false)?),
            "parent_run_id" => call.parent_run_id = Some(identifier(Some(value), false)?),
            "root_run_id" => call.root_run_id = Some(identifier(Some(value), false)?),
            "child_run_id" => call.child_run_id = Some(identifier(Some(value), false)?),
            "child_agent_id" => call.child_agent_id = Some(identifier(Some(value), false)?),
            "task_hash" if is_hash(value) => call.task_hash = value.as_str(),
            "task_hash" => return None,
            "depth" => call.depth = Some(integer(value).filter(|d| (0..=MAX_DEPTH).contains(d))?),
            "retry_after_ms" => call.retry_after_ms = integer(value).filter(|ms| *ms >= 0)?,
            "trigger" if TRIGGERS.contains(&value.as_str()?) => call.trigger = value.as_str(),
            "trigger" => return None,
            "policy_digest" => call.policy_digest = Some(identifier(Some(value), false)?),
            "result_fp" if is_hash(value) => call.result_fp = value.as_str(),
            "result_fp" => return None,
            "tool_class" => {
                let class = value.as_str()?;
                call.tool_class = Some(TOOL_CLASSES.iter().position(|c| *c == class)? as u8)
            }
            "target" => call.target = Some(identifier(Some(value), false)?),
            "state_hash" if is_hash(value) => call.state_hash = value.as_str(),
            "state_hash" => return None,
            "error_head" if value.as_str()?.len() > MAX_ERROR_HEAD_BYTES => return None,
            "error_head" => {}
            "seq" => {
                integer(value)?;
            }
            "plan_step" => call.plan_step = Some(integer(value)?),
            "retry_budget" => {
                call.retry_budget =
                    Some(integer(value).filter(|b| (0..=MAX_RETRY_BUDGET).contains(b))?)
            }
            "side_effect" => call.side_effect = Some(value.as_bool()?),
            "latency_ms" | "tokens" | "cost_usd" if value.as_f64()? < 0.0 => return None,
            "tokens" => call.tokens = token_count(value),
            "cost_usd" => call.cost_micro = micro_usd(value),
            "latency_ms" | "kind" => {}
            "attrs" => {
                value.as_object()?;
            }
            "schema_version" if value.as_str()? != "1" => return None,
            _ => {} // unknown fields are ignored: forward compatible
        }
        Some(())
    })?;
    if call.parent_run_id.is_some() && call.root_run_id.is_none() {
        return None; // a child names its tree's root
    }
    Some(call)
}

fn present(value: Option<&Value>) -> Option<&Value> {
    value.filter(|v| !v.is_null())
}

/// A string of 1 to 512 characters (required), or of at most 512 (optional).
fn identifier(value: Option<&Value>, required: bool) -> Option<&str> {
    let text = value?.as_str()?;
    if (required && text.is_empty()) || !within_limit(text) {
        return None;
    }
    Some(text)
}

fn within_limit(text: &str) -> bool {
    text.len() <= MAX_ID_LENGTH || text.chars().count() <= MAX_ID_LENGTH
}

fn is_hash(value: &Value) -> bool {
    value.as_str().is_some_and(is_hash_text)
}

fn is_hash_text(text: &str) -> bool {
    !text.is_empty() && within_limit(text)
}

/// A JSON integer in the signed 64-bit range (floats, and integers beyond it, are for the reference).
fn integer(value: &Value) -> Option<i64> {
    match value {
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}
