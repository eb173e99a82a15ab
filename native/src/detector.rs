//! The detector fold of `stream_app/core/detector.py` (the reference), state for state: the same
//! digests, the same rule order, the same windows. Only the decision's text is left to the reference
//! (`explain`): a fold that fires returns a `Finding`.

use std::collections::VecDeque;

use serde_json::Value;
use sha2::{Digest as _, Sha256};

/// The thresholds of one call (the reference's `Thresholds`).
#[derive(Clone, Debug)]
pub struct Thresholds {
    pub retry_budget: i64,
    pub window_ms: i64,
    pub window_calls: i64,
    pub iteration_ceiling: i64,
    pub poll_alert_after: i64,
    pub cycle_occurrences: i64,
    pub side_effect_window_ms: i64,
    pub circuit_open_at: i64,
    pub side_effect: bool,
    pub collapse_whitespace: bool,
    pub strict_args: bool,
    pub dedupe_window: i64,
    pub shadow: bool,
    /// Index into `contract::TOOL_CLASSES`.
    pub tool_class: u8,
    pub no_progress_at: i64,
    pub oscillation_revisits: i64,
    /// Run budgets (0: none): cost in micro-USD, tokens; calls per tool; model calls in a row.
    pub max_cost_micro: i64,
    pub max_tokens: i64,
    pub max_calls: i64,
    pub max_model_calls_without_tool: i64,
    /// Round trips of handoffs between two agents that halt the run (`handoff_loop`; 0: off).
    pub handoff_round_trips: i64,
    /// Warn before a halt (action `advise`).
    pub advise: bool,
}

use crate::contract::SPEND_CAP;
use crate::fields::Fields;

/// Outcome codes inside streak keys, in `contract::OUTCOMES` order.
const OUTCOME_CODE: [u8; 4] = [b's', b'e', b'0', b'n'];
const SUCCESS: u8 = 0;
const SIDE_EFFECT_SLOTS: usize = 32;
const READ_SLOTS: usize = 16;
const TARGET_SLOTS: usize = 8;
const STATE_SLOTS: usize = 8;
const NOOP: u8 = 3;
const TOOL_COUNT_SLOTS: usize = 32;
const CYCLE_PERIODS: [usize; 2] = [2, 3];

type Digest = [u8; 8];
/// Result digest + outcome code + tool checksum.
type StreakKey = [u8; 13];
/// Call digest + streak key.
type StepSig = [u8; 21];
/// Call digest + tool checksum.
type SideEffectKey = [u8; 12];

/// 8 stable bytes for an id or name: crc32 and adler32 of its UTF-8, as the reference's `_checksum`.
pub fn checksum(text: &str) -> Digest {
    checksum_bytes(text.as_bytes())
}

/// `checksum` of raw bytes (the reference's `_checksum_bytes`).
pub fn checksum_bytes(bytes: &[u8]) -> Digest {
    let (mut a, mut b) = (1u32, 0u32);
    for chunk in bytes.chunks(5552) {
        for &byte in chunk {
            a += byte as u32;
            b += a;
        }
        a %= 65521;
        b %= 65521;
    }
    (((crc32fast::hash(bytes) as u64) << 32) | ((b << 16) | a) as u64).to_be_bytes()
}

/// 8 bytes of a hash string: its first 16 hex digits when it starts with them, else a checksum.
pub fn short(hash_text: &str) -> Digest {
    let head = hash_text.as_bytes().get(..16);
    if let Some(head) = head.filter(|h| h.iter().all(u8::is_ascii_hexdigit)) {
        let mut digest = [0u8; 8];
        for (i, pair) in head.chunks(2).enumerate() {
            let text = std::str::from_utf8(pair).expect("ASCII hex digits");
            digest[i] = u8::from_str_radix(text, 16).expect("ASCII hex digits");
        }
        return digest;
    }
    checksum(hash_text)
}

pub fn tool_digest(tool: &str) -> [u8; 4] {
    crc32fast::hash(tool.as_bytes()).to_be_bytes()
}

/// The streak's 4 bytes for a tool called at a named upstream (the reference's `_tool_of`): the crc32 of
/// the tool's name, U+001F and the upstream; the tool's own digest when the call names none.
pub fn streak_tool(tool: [u8; 4], upstream: Option<&str>) -> [u8; 4] {
    match upstream {
        None => tool,
        Some(upstream) => {
            let mut hasher = crc32fast::Hasher::new_with_initial(u32::from_be_bytes(tool));
            hasher.update(b"\x1f");
            hasher.update(upstream.as_bytes());
            hasher.finalize().to_be_bytes()
        }
    }
}

/// Stable id of a decision, as the reference's `decision_id`: the first 32 hex digits of the SHA-256 of
/// run, trigger, action and verdict joined by U+001F.
pub fn decision_id(run_id: &str, trigger_event_id: &str, action: &str, verdict: &str) -> String {
    let mut hasher = Sha256::new();
    for (i, part) in [run_id, trigger_event_id, action, verdict]
        .iter()
        .enumerate()
    {
        if i > 0 {
            hasher.update([0x1f]);
        }
        hasher.update(part.as_bytes());
    }
    crate::normalize::hex(&hasher.finalize()[..16])
}

/// Everything the detector remembers about one run. Compared (`PartialEq`) where the batch fold's cache of
/// decoded states is checked against a fresh decode of the record (`BatchFolder`'s `verify`).
#[derive(Default, Debug, PartialEq)]
pub struct RunState {
    calls: i64,
    pub last_ts_ms: i64,
    /// The id of the decision that halted the run (the reference's `halted_by`).
    halted_by: Option<String>,
    plan_step: Option<i64>,
    seen_ids: VecDeque<Digest>,
    streak_key: Option<StreakKey>,
    streak_call: Digest,
    streak_varied: bool,
    streak_ts: VecDeque<i64>,
    streak_first_event_id: String,
    streak_alerted: bool,
    /// Streak key of the last call's fingerprint (failing calls only), and whether a member joined the
    /// streak by fingerprint alone.
    streak_fp: Option<StreakKey>,
    streak_fuzzy: bool,
    recent_sigs: VecDeque<StepSig>,
    recent_ts: VecDeque<i64>,
    /// Bit i set = the call i steps back failed, for as many calls as `recent_sigs` can hold (only the
    /// last three bits are ever read; the rest is kept because the stored record has it).
    recent_failing: u64,
    /// (call, first ts, occurrences) in insertion order, as the reference's dict.
    side_effects: Vec<(SideEffectKey, i64, i64)>,
    /// Successful reads since the last successful write: (digest, occurrences), least recently seen first.
    reads: Vec<(Digest, i64)>,
    /// Written targets, least recently written first: (target, after-states oldest first, revisits).
    targets: Vec<(Digest, VecDeque<Digest>, i64)>,
    /// Spent so far: micro-USD and tokens; model calls since the last tool call.
    cost_micro: i64,
    tokens: i64,
    model_streak: i64,
    /// Calls per tool with a `max_calls`, least recently called first.
    tool_counts: Vec<([u8; 4], i64)>,
    /// Advice given (bit 1: for the current streak, bit 2: for the current cycle).
    advised: i64,
    /// The streak's member ids after the first (the most recent `STREAK_IDS - 1`, each cut to `ID_CHARS`
    /// characters), and its first call's canonical arguments if it failed with raw ones (else empty).
    streak_ids: StreakIds,
    streak_args: String,
    /// Every failure of the current streak was transient, and the pauses it had instead of a halt.
    streak_transient: bool,
    streak_pauses: i64,
    /// Handoffs in a row back and forth between two agents, and the (from, to) agent digests of the last.
    handoffs: i64,
    handoff_from: Digest,
    handoff_to: Digest,
    /// The run made a spawn-class call (as a tree's root, its spending from then on is the tree's).
    spawned: bool,
}

/// Handoffs in a row counted at most (the reference's `_HANDOFF_CAP`).
const HANDOFF_CAP: i64 = 1 << 20;

/// Pauses a transient streak gets instead of a halt (the reference's `_STREAK_PAUSES`).
const STREAK_PAUSES: i64 = 2;

/// A streak's member ids after the first, oldest first: one text and each id's length in bytes (a
/// continuing streak appends to buffers it keeps, not an allocation per call).
#[derive(Default, Clone, Debug, PartialEq)]
pub struct StreakIds {
    text: String,
    lens: VecDeque<u16>,
}

impl StreakIds {
    fn push(&mut self, id: &str) {
        if self.lens.len() >= STREAK_IDS - 1 {
            let first = self.lens.pop_front().expect("not empty") as usize;
            self.text.drain(..first);
        }
        self.text.push_str(id);
        self.lens.push_back(id.len() as u16); // at most 64 characters: at most 256 bytes
    }

    fn clear(&mut self) {
        self.text.clear();
        self.lens.clear();
    }

    fn is_empty(&self) -> bool {
        self.lens.is_empty()
    }

    fn iter(&self) -> impl Iterator<Item = &str> {
        let mut at = 0;
        self.lens.iter().map(move |len| {
            let id = &self.text[at..at + *len as usize];
            at += *len as usize;
            id
        })
    }
}

/// Event ids a streak's evidence lists (the first and the most recent), each cut to `ID_CHARS`.
const STREAK_IDS: usize = 10;
const ID_CHARS: usize = 64;

/// `text` cut to its first `ID_CHARS` characters (as Python's `text[:64]`).
fn cut_id(text: &str) -> &str {
    match text.char_indices().nth(ID_CHARS) {
        Some((at, _)) => &text[..at],
        None => text,
    }
}

/// What to do with an event before any hashing.
pub enum Admission {
    /// A redelivery: ignore it.
    Duplicate,
    /// The run is halted: counted as seen, nothing to decide.
    Halted,
    Fold,
}

/// The call of an admitted event, its hashes cut to digests.
pub struct Step<'a> {
    pub run_id: &'a str,
    pub event_id: &'a str,
    pub ts_ms: i64,
    pub outcome: u8,
    pub call: Digest,
    pub result: Digest,
    pub tool: [u8; 4],
    /// The tool's bytes in the streak key: `tool`, or with the upstream the call names (`streak_tool`).
    pub streak_tool: [u8; 4],
    pub retry_budget: Option<i64>,
    pub side_effect: Option<bool>,
    /// Index into `contract::TOOL_CLASSES` (the event's, else the policy's).
    pub tool_class: u8,
    /// A write's (target, after-state) digests, when it has both.
    pub write: Option<(Digest, Digest)>,
    pub cost_micro: i64,
    pub tokens: i64,
    /// The call's canonical arguments (JSON text) if they were raw and at most 512 bytes, else empty.
    pub args: &'a [u8],
    /// The call failed (outcome `error`) with a transient class (`contract::is_transient`).
    pub transient: bool,
    /// The digests of the call's agent and of the agent it hands off to (handoff-class calls).
    pub agent: Digest,
    pub child_agent: Digest,
}

/// The rule that fired and the numbers its decision reports (the reference's `Finding`).
pub struct Finding {
    pub verdict: &'static str,
    pub count: i64,
    pub budget: i64,
    pub period: i64,
    pub first_event_id: String,
    /// The streak matched on fingerprints (some member's exact hash differed).
    pub fuzzy: bool,
    /// The outcome the rules saw (index into `OUTCOMES`): a write that changed nothing is a noop.
    pub outcome: u8,
    /// Which budget (`cost`, `tokens`, `calls`) or which no-progress rule (`reads`, `model_calls`).
    pub rule: &'static str,
    /// A warning before the halt of `verdict` (action `advise`), not the halt itself.
    pub advise: bool,
    /// The streak's story (streak verdicts only): its event ids, its first call's canonical arguments.
    pub event_ids: Vec<String>,
    pub args_first: String,
    /// A transient streak's pause instead of a halt (action `pause`): which one (1, 2), or 0.
    pub pause: i64,
}

/// Whether a sum going from `before` to `after` first reaches 80% of `limit` (0: no limit).
fn nears(before: i64, after: i64, limit: i64) -> bool {
    limit > 0
        && (before as i128) * 5 < (limit as i128) * 4
        && (limit as i128) * 4 <= (after as i128) * 5
}

impl Finding {
    /// A finding of `verdict` with only its count and outcome; the rest as the rule sets it.
    fn new(verdict: &'static str, count: i64, outcome: u8) -> Finding {
        Finding {
            verdict,
            count,
            budget: 0,
            period: 0,
            first_event_id: String::new(),
            fuzzy: false,
            outcome,
            rule: "",
            advise: false,
            event_ids: Vec::new(),
            args_first: String::new(),
            pause: 0,
        }
    }

    fn advice(verdict: &'static str, count: i64, outcome: u8) -> Finding {
        Finding {
            advise: true,
            ..Finding::new(verdict, count, outcome)
        }
    }
}

impl RunState {
    /// What the run spent so far (micro-USD), once it made a spawn-class call, else None (the reference's
    /// `core.fleet.trees.root_spent`): read before and after a call, it gives what a root's tree fact
    /// adds (`root_cost`).
    pub fn root_spent(&self) -> Option<i64> {
        self.spawned.then_some(self.cost_micro)
    }

    /// Drop a redelivered event id; note the event's time; stop at a halted run.
    pub fn admit(&mut self, event_id: &str, ts_ms: i64, thresholds: &Thresholds) -> Admission {
        let digest = checksum(event_id);
        if self.seen_ids.contains(&digest) {
            return Admission::Duplicate;
        }
        self.seen_ids.push_back(digest);
        while self.seen_ids.len() as i64 > thresholds.dedupe_window {
            self.seen_ids.pop_front();
        }
        if ts_ms > self.last_ts_ms {
            self.last_ts_ms = ts_ms;
        }
        if self.halted_by.is_some() {
            return Admission::Halted;
        }
        Admission::Fold
    }

    /// A call of a halted run (admitted as `Halted`): a spawn-class one still marks the run as a tree's
    /// spawning root, so its tree fact carries what it spent (as the reference's `evaluate`).
    pub fn halted_call(&mut self, tool_class: u8) {
        if tool_class == crate::contract::SPAWN {
            self.spawned = true;
        }
    }

    /// Count the call and apply progress (an advancing plan step resets every streak).
    pub fn count_call(&mut self, plan_step: Option<i64>) {
        self.calls += 1;
        if let Some(step) = plan_step {
            match self.plan_step {
                Some(previous) if step > previous => {
                    self.reset_streaks();
                    self.plan_step = Some(step);
                }
                None => self.plan_step = Some(step),
                _ => {}
            }
        }
    }

    /// Fold an admitted, counted call; the finding of the rule that fires, if one does.
    /// `fingerprint` gives the call's result fingerprint digest when the fold needs it (a failing call
    /// whose exact hash breaks the streak): the reference computes it only then too.
    /// Its findings: the advice first (if any), then the rule that fires.
    pub fn fold(
        &mut self,
        step: &Step,
        thresholds: &Thresholds,
        fingerprint: &mut dyn FnMut() -> Option<Digest>,
    ) -> Vec<Finding> {
        let mut advice = None;
        let finding = self.fold_call(step, thresholds, fingerprint, &mut advice);
        if let (Some(a), Some(f)) = (&advice, &finding) {
            if a.verdict == f.verdict {
                advice = None; // the rule halts on this very call: nothing left to warn about
            }
        }
        advice.into_iter().chain(finding).collect()
    }

    fn fold_call(
        &mut self,
        step: &Step,
        thresholds: &Thresholds,
        fingerprint: &mut dyn FnMut() -> Option<Digest>,
        advice: &mut Option<Finding>,
    ) -> Option<Finding> {
        self.model_streak = 0;
        let (mut spent, mut nearing) = self.spend(step, thresholds);
        if thresholds.max_calls > 0 {
            let calls = self.count_tool(step.tool);
            if spent.is_none() && calls > thresholds.max_calls {
                spent = Some(("calls", calls));
            } else if nearing.is_none() && nears(calls - 1, calls, thresholds.max_calls) {
                nearing = Some(("calls", calls));
            }
        }
        let mut outcome = step.outcome;
        let mut revisit = 0;
        if step.tool_class == crate::contract::WRITE {
            if let Some((target, after)) = step.write {
                let (revisits, unchanged) = self.write(target, after);
                revisit = revisits;
                if unchanged {
                    outcome = NOOP;
                }
            }
        }
        let failing = outcome != SUCCESS;
        let mut reads = 0;
        if step.tool_class == crate::contract::READ && !failing {
            let mut raw = [0u8; 20];
            raw[..8].copy_from_slice(&step.call);
            raw[8..16].copy_from_slice(&step.result);
            raw[16..].copy_from_slice(&step.tool);
            reads = self.read(checksum_bytes(&raw));
        } else if step.tool_class == crate::contract::WRITE && !failing {
            self.reads.clear();
        }
        if step.tool_class == crate::contract::SPAWN {
            self.spawned = true;
        }
        let mut handoffs = 0;
        if step.tool_class == crate::contract::HANDOFF {
            let back = self.handoffs > 0
                && step.agent == self.handoff_to
                && step.child_agent == self.handoff_from;
            self.handoffs = if back {
                (self.handoffs + 1).min(HANDOFF_CAP)
            } else {
                1
            };
            self.handoff_from = step.agent;
            self.handoff_to = step.child_agent;
            handoffs = self.handoffs;
        } else if !failing {
            // the agents too: the record keeps none without a ping-pong in progress, so a state kept
            // decoded (`BatchFolder`'s cache) stays the one its record reads back as
            self.handoffs = 0;
            self.handoff_from = [0; 8];
            self.handoff_to = [0; 8];
        }
        let mut side_key = [0u8; 12];
        side_key[..8].copy_from_slice(&step.call);
        side_key[8..].copy_from_slice(&step.tool);
        let occurrences = self.side_effect_occurrence(step, side_key, thresholds);
        let mut key = [0u8; 13];
        key[..8].copy_from_slice(&step.result);
        key[8] = OUTCOME_CODE[outcome as usize];
        key[9..].copy_from_slice(&step.streak_tool);
        let (count, budget) = self.streak(step, key, failing, fingerprint, thresholds);
        let mut sig = [0u8; 21];
        sig[..8].copy_from_slice(&step.call);
        sig[8..].copy_from_slice(&key);
        let (period, near) = self.cycle(sig, failing, step.ts_ms, thresholds);
        let stuck = 0 < thresholds.no_progress_at && thresholds.no_progress_at <= reads;
        let oscillating =
            0 < thresholds.oscillation_revisits && thresholds.oscillation_revisits <= revisit;
        if thresholds.advise {
            *advice = self.advice(
                thresholds, failing, count, budget, near, reads, revisit, nearing, outcome,
            );
        }

        let looping =
            0 < thresholds.handoff_round_trips && 2 * thresholds.handoff_round_trips <= handoffs;
        if !(self.calls > thresholds.iteration_ceiling
            || looping
            || occurrences >= 2
            || (failing && count > budget)
            || period > 0
            || stuck
            || oscillating
            || spent.is_some()
            || (!failing
                && 0 < thresholds.poll_alert_after
                && thresholds.poll_alert_after <= count))
        {
            return None;
        }
        let mut rule = "";
        let mut pause = 0;
        let (verdict, count) = if self.calls > thresholds.iteration_ceiling {
            ("iteration_ceiling", self.calls)
        } else if let Some((budget, amount)) = spent {
            rule = budget;
            ("budget_exceeded", amount)
        } else if occurrences >= thresholds.circuit_open_at {
            ("circuit_open", occurrences)
        } else if failing && count > budget {
            let verdict = if self.streak_varied {
                "semantic_loop"
            } else {
                "recursion"
            };
            if self.streak_transient && self.streak_pauses < STREAK_PAUSES {
                // every failure transient: the run's calls to the tool pause instead of a halt
                self.streak_pauses += 1;
                self.streak_ts.clear();
                pause = self.streak_pauses;
                (verdict, count)
            } else if self.streak_transient {
                ("recursion", count) // the third time: the run halts
            } else {
                (verdict, count)
            }
        } else if looping {
            ("handoff_loop", handoffs)
        } else if period > 0 {
            ("cycle", count)
        } else if stuck {
            rule = "reads";
            ("no_progress", reads)
        } else if oscillating {
            ("oscillation", revisit)
        } else if occurrences >= 2 {
            return Some(Finding::new("duplicate_call", occurrences, outcome));
        } else if !failing && !self.streak_varied && !self.streak_alerted {
            self.streak_alerted = true;
            return Some(Finding {
                first_event_id: self.streak_first_event_id.clone(),
                event_ids: self.streak_event_ids(),
                ..Finding::new("polling", count, outcome)
            });
        } else {
            return None;
        };
        let streak = verdict == "recursion" || verdict == "semantic_loop";
        let finding = Finding {
            verdict,
            count,
            budget,
            period,
            first_event_id: self.streak_first_event_id.clone(),
            fuzzy: self.streak_fuzzy,
            outcome,
            rule,
            advise: false,
            event_ids: if streak {
                self.streak_event_ids()
            } else {
                Vec::new()
            },
            args_first: if streak {
                self.streak_args.clone()
            } else {
                String::new()
            },
            pause,
        };
        if pause == 0 {
            self.halt(step, verdict, thresholds);
        }
        Some(finding)
    }

    /// The streak's event ids for its evidence: the first, then the most recent others.
    fn streak_event_ids(&self) -> Vec<String> {
        std::iter::once(cut_id(&self.streak_first_event_id).to_owned())
            .chain(self.streak_ids.iter().map(str::to_owned))
            .collect()
    }

    /// A halting finding's effect: halted, or in shadow mode as if halted and resumed at once.
    fn halt(&mut self, step: &Step, verdict: &str, thresholds: &Thresholds) {
        if thresholds.shadow {
            self.resume();
        } else {
            self.halted_by = Some(decision_id(step.run_id, step.event_id, "halt", verdict));
        }
    }

    /// Fold an admitted model call (an inference, not a tool call): it spends, and counts toward the
    /// model calls in a row, nothing else (the reference's `Detector._model_call`).
    pub fn model_call(&mut self, step: &Step, thresholds: &Thresholds) -> Vec<Finding> {
        self.model_streak += 1;
        let (spent, nearing) = self.spend(step, thresholds);
        let mut findings = Vec::new();
        if let (Some((budget, amount)), None, true) = (nearing, spent, thresholds.advise) {
            let mut advice = Finding::advice("budget_exceeded", amount, step.outcome);
            advice.rule = budget;
            findings.push(advice);
        }
        let halting = match spent {
            Some((budget, amount)) => Some(("budget_exceeded", budget, amount)),
            None if 0 < thresholds.max_model_calls_without_tool
                && thresholds.max_model_calls_without_tool <= self.model_streak =>
            {
                Some(("no_progress", "model_calls", self.model_streak))
            }
            None => None,
        };
        if let Some((verdict, rule, count)) = halting {
            self.halt(step, verdict, thresholds);
            findings.push(Finding {
                rule,
                ..Finding::new(verdict, count, step.outcome)
            });
        }
        findings
    }

    /// The warning this call earns before a halt, if any (the reference's `Detector._advice`).
    #[allow(clippy::too_many_arguments)]
    fn advice(
        &mut self,
        thresholds: &Thresholds,
        failing: bool,
        count: i64,
        budget: i64,
        near: i64,
        reads: i64,
        revisit: i64,
        nearing: Option<(&'static str, i64)>,
        outcome: u8,
    ) -> Option<Finding> {
        if failing && budget != 0 && count == budget && self.advised & 1 == 0 {
            self.advised |= 1;
            let verdict = if self.streak_varied {
                "semantic_loop"
            } else {
                "recursion"
            };
            let mut advice = Finding::advice(verdict, count, outcome);
            advice.budget = budget;
            advice.first_event_id = self.streak_first_event_id.clone();
            advice.event_ids = self.streak_event_ids();
            advice.args_first = self.streak_args.clone();
            return Some(advice);
        }
        if near > 0 && self.advised & 2 == 0 {
            self.advised |= 2;
            let mut advice = Finding::advice("cycle", thresholds.cycle_occurrences - 1, outcome);
            advice.period = near;
            return Some(advice);
        }
        if reads > 0 && reads == thresholds.no_progress_at - 1 {
            let mut advice = Finding::advice("no_progress", reads, outcome);
            advice.rule = "reads";
            return Some(advice);
        }
        if revisit > 0 && revisit == thresholds.oscillation_revisits - 1 {
            return Some(Finding::advice("oscillation", revisit, outcome));
        }
        let (budget, amount) = nearing?;
        let mut advice = Finding::advice("budget_exceeded", amount, outcome);
        advice.rule = budget;
        Some(advice)
    }

    /// Add the call's cost and tokens; the budget this call takes strictly past its limit, and the
    /// budget it is the first call to take to 80% or more of its limit.
    #[allow(clippy::type_complexity)]
    fn spend(
        &mut self,
        step: &Step,
        thresholds: &Thresholds,
    ) -> (Option<(&'static str, i64)>, Option<(&'static str, i64)>) {
        let (cost, tokens) = (self.cost_micro, self.tokens);
        self.cost_micro = cost.saturating_add(step.cost_micro).min(SPEND_CAP);
        self.tokens = tokens.saturating_add(step.tokens).min(SPEND_CAP);
        let crossed =
            |limit: i64, before: i64, after: i64| limit > 0 && before <= limit && limit < after;
        let spent = if crossed(thresholds.max_cost_micro, cost, self.cost_micro) {
            Some(("cost", self.cost_micro))
        } else if crossed(thresholds.max_tokens, tokens, self.tokens) {
            Some(("tokens", self.tokens))
        } else {
            None
        };
        let nearing = if nears(cost, self.cost_micro, thresholds.max_cost_micro) {
            Some(("cost", self.cost_micro))
        } else if nears(tokens, self.tokens, thresholds.max_tokens) {
            Some(("tokens", self.tokens))
        } else {
            None
        };
        (spent, nearing)
    }

    /// Count a call of a tool that has a `max_calls`; its calls so far.
    fn count_tool(&mut self, tool: [u8; 4]) -> i64 {
        let calls = match self.tool_counts.iter().position(|e| e.0 == tool) {
            Some(at) => self.tool_counts.remove(at).1 + 1,
            None => 1,
        };
        if self.tool_counts.len() >= TOOL_COUNT_SLOTS {
            self.tool_counts.remove(0);
        }
        self.tool_counts.push((tool, calls));
        calls
    }

    fn resume(&mut self) {
        self.halted_by = None;
        self.calls = 0;
        self.side_effects.clear();
        self.tool_counts.clear();
        self.model_streak = 0;
        self.reset_streaks();
    }

    fn reset_streaks(&mut self) {
        self.streak_key = None;
        self.streak_call = [0; 8];
        self.streak_varied = false;
        self.streak_alerted = false;
        self.streak_fp = None;
        self.streak_fuzzy = false;
        self.streak_ts.clear();
        self.streak_first_event_id.clear();
        self.streak_ids.clear();
        self.streak_args.clear();
        self.recent_sigs.clear();
        self.recent_ts.clear();
        self.recent_failing = 0;
        self.reads.clear();
        self.targets.clear();
        self.advised = 0;
        self.streak_transient = false;
        self.streak_pauses = 0;
        self.handoffs = 0;
        self.handoff_from = [0; 8];
        self.handoff_to = [0; 8];
    }

    /// Count a successful read of this digest; its occurrences since the last successful write.
    fn read(&mut self, digest: Digest) -> i64 {
        let seen = match self.reads.iter().position(|e| e.0 == digest) {
            Some(at) => self.reads.remove(at).1 + 1,
            None => 1,
        };
        if self.reads.len() >= READ_SLOTS {
            self.reads.remove(0);
        }
        self.reads.push((digest, seen));
        seen
    }

    /// Record a write's after-state of `target`: (the revisit count if it revisited an earlier state,
    /// else 0; whether it left the target as it was).
    fn write(&mut self, target: Digest, after: Digest) -> (i64, bool) {
        let mut entry = match self.targets.iter().position(|e| e.0 == target) {
            Some(at) => self.targets.remove(at),
            None => {
                if self.targets.len() >= TARGET_SLOTS {
                    self.targets.remove(0);
                }
                (target, VecDeque::new(), 0)
            }
        };
        let unchanged = entry.1.back() == Some(&after);
        let mut revisited = false;
        if !unchanged {
            if let Some(at) = entry.1.iter().position(|s| *s == after) {
                entry.1.remove(at);
                entry.2 += 1;
                revisited = true;
            }
            entry.1.push_back(after);
            while entry.1.len() > STATE_SLOTS {
                entry.1.pop_front();
            }
        }
        let revisits = if revisited { entry.2 } else { 0 };
        self.targets.push(entry);
        (revisits, unchanged)
    }

    fn side_effect_occurrence(
        &mut self,
        step: &Step,
        call: SideEffectKey,
        thresholds: &Thresholds,
    ) -> i64 {
        if !step.side_effect.unwrap_or(thresholds.side_effect) {
            return 0;
        }
        let window = thresholds.side_effect_window_ms;
        let table = &mut self.side_effects;
        if let Some(entry) = table.iter_mut().find(|e| e.0 == call) {
            if (0..=window).contains(&(step.ts_ms - entry.1)) {
                entry.2 += 1;
                return entry.2;
            }
        }
        let horizon = step.ts_ms - window;
        table.retain(|e| e.1 >= horizon);
        if table.len() >= SIDE_EFFECT_SLOTS {
            let oldest =
                (0..table.len()).fold(
                    0,
                    |best, i| if table[i].1 < table[best].1 { i } else { best },
                );
            table.remove(oldest);
        }
        match table.iter_mut().find(|e| e.0 == call) {
            Some(entry) => *entry = (call, step.ts_ms, 1), // a dict keeps an overwritten key's place
            None => table.push((call, step.ts_ms, 1)),
        }
        1
    }

    fn streak(
        &mut self,
        step: &Step,
        key: StreakKey,
        failing: bool,
        fingerprint: &mut dyn FnMut() -> Option<Digest>,
        thresholds: &Thresholds,
    ) -> (i64, i64) {
        let fp_key = if failing && self.streak_key != Some(key) {
            fingerprint().map(|fp| {
                let mut fp_key = key;
                fp_key[..8].copy_from_slice(&fp);
                fp_key
            })
        } else {
            None
        };
        if self.streak_key == Some(key) || (fp_key.is_some() && fp_key == self.streak_fp) {
            if self.streak_key != Some(key) {
                self.streak_key = Some(key);
                self.streak_fuzzy = true;
            }
            if step.call != self.streak_call {
                self.streak_varied = true;
            }
            if !step.transient {
                self.streak_transient = false;
            }
            self.streak_ids.push(cut_id(step.event_id));
        } else {
            self.streak_key = Some(key);
            self.streak_call = step.call;
            self.streak_varied = false;
            self.streak_alerted = false;
            self.streak_fuzzy = false;
            self.advised &= !1;
            self.streak_ts.clear();
            self.streak_first_event_id.clear();
            self.streak_first_event_id.push_str(step.event_id);
            self.streak_fp = fp_key;
            self.streak_ids.clear();
            self.streak_args.clear();
            self.streak_transient = step.transient;
            self.streak_pauses = 0;
            if failing {
                self.streak_args
                    .push_str(std::str::from_utf8(step.args).unwrap_or_default());
            }
        }
        let budget = step.retry_budget.unwrap_or(thresholds.retry_budget);
        let times = &mut self.streak_ts;
        times.push_back(step.ts_ms);
        let count = times.len();
        if count > 1 {
            let horizon = step.ts_ms - thresholds.window_ms;
            let mut stale = times.iter().take_while(|t| **t < horizon).count();
            // Only budget + 1 (or the polling threshold) members can matter; keep no more than that.
            let keep = thresholds
                .window_calls
                .min(budget.max(thresholds.poll_alert_after) + 1)
                .max(0) as usize;
            if count.saturating_sub(keep) > stale {
                stale = count - keep;
            }
            times.drain(..stale);
        }
        (times.len() as i64, budget)
    }

    /// The period of a cycle this step completes, and of one a single occurrence short (the advice's).
    fn cycle(
        &mut self,
        sig: StepSig,
        failing: bool,
        ts_ms: i64,
        thresholds: &Thresholds,
    ) -> (i64, i64) {
        let occurrences = thresholds.cycle_occurrences as usize;
        let capacity = CYCLE_PERIODS[1] * occurrences;
        let sigs = &mut self.recent_sigs;
        let n = sigs.len();
        // A cycle of period p can only complete on a step equal to the step p back.
        let repeats = (n >= 2 && sigs[n - 2] == sig) || (n >= 3 && sigs[n - 3] == sig);
        sigs.push_back(sig);
        while sigs.len() > capacity {
            sigs.pop_front();
        }
        let times = &mut self.recent_ts;
        times.push_back(ts_ms);
        if times.len() > capacity {
            times.pop_front(); // one only, as the reference does
        }
        let mask = if capacity >= 64 {
            u64::MAX
        } else {
            (1u64 << capacity) - 1
        };
        self.recent_failing = ((self.recent_failing << 1) | failing as u64) & mask;
        if !repeats {
            self.advised &= !2; // no cycle goes on through this step
            return (0, 0);
        }
        let steps = times.len();
        let n = sigs.len();
        let mut found = [0i64; 2];
        for (which, count) in [occurrences, occurrences - 1].into_iter().enumerate() {
            if count < 2 {
                continue;
            }
            for period in CYCLE_PERIODS {
                let span = period * count;
                if span > steps || span as i64 > thresholds.window_calls || span > n {
                    continue;
                }
                let unit_start = n - period;
                let repeated =
                    (0..span).all(|i| sigs[n - span + i] == sigs[unit_start + i % period]);
                let all_this_step = (unit_start..n).all(|i| sigs[i] == sig);
                if repeated
                    && !all_this_step
                    && self.recent_failing & ((1u64 << period) - 1) != 0
                    && ts_ms - times[steps - span] <= thresholds.window_ms
                {
                    found[which] = period as i64;
                    break;
                }
            }
        }
        (found[0], found[1])
    }
}

/// Cycle settings whose `recent_failing` bits fit the stored record's integer here (64 bits): with more
/// occurrences a run is folded by the reference.
pub const MAX_STORED_CYCLE_OCCURRENCES: i64 = 21;

/// The stored record's format versions this engine reads (the reference's `core/stored.py`).
pub const FORMAT_VERSION: i64 = 2;

impl RunState {
    /// The state and offset of a stored record (`core/stored.py`, versions 0 to 2), or None for
    /// anything else (another version, a damaged record): the reference then reads it and says what is
    /// wrong.
    pub fn from_record<R: Fields + ?Sized>(record: &R, raw: &[u8]) -> Option<(RunState, i64)> {
        match record.field("v") {
            None => {}
            Some(Value::Number(n)) if (0..=FORMAT_VERSION).contains(&n.as_i64()?) => {}
            Some(_) => return None,
        }
        let int = |name: &str| record.field(name)?.as_i64();
        let flag = |name: &str| record.field(name)?.as_bool();
        let text = |name: &str| record.field(name)?.as_str();
        let times = |name: &str| -> Option<VecDeque<i64>> {
            record
                .field(name)?
                .as_array()?
                .iter()
                .map(Value::as_i64)
                .collect()
        };
        let halted_by = match record.field("halted_by")? {
            Value::Null => None,
            Value::String(id) => Some(id.clone()),
            _ => return None,
        };
        let plan_step = match record.field("plan_step")? {
            Value::Null => None,
            value => Some(value.as_i64()?),
        };
        let streak_key: Option<StreakKey> = match unhex(text("streak_key")?)?.as_slice() {
            [] => None,
            key => Some(key.try_into().ok()?),
        };
        let streak_call: Digest = match (streak_key, unhex(text("streak_call")?)?.as_slice()) {
            (None, []) => [0; 8],
            (Some(_), call) => call.try_into().ok()?,
            (None, _) => return None,
        };
        // Version 2's fingerprint streak; absent before (the streak goes on by exact hashes).
        let streak_fp: Option<StreakKey> = match record.field("streak_fp") {
            None => None,
            Some(value) => match unhex(value.as_str()?)?.as_slice() {
                [] => None,
                key => Some(key.try_into().ok()?),
            },
        };
        // The handoff ping-pong in progress (absent: none).
        let (handoffs, handoff_from, handoff_to): (i64, Digest, Digest) =
            match record.field("handoffs") {
                None | Some(Value::Null) => (0, [0; 8], [0; 8]),
                Some(value) => match value.as_array()?.as_slice() {
                    [n, from, to] => (
                        n.as_i64()?,
                        unhex(from.as_str()?)?.as_slice().try_into().ok()?,
                        unhex(to.as_str()?)?.as_slice().try_into().ok()?,
                    ),
                    _ => return None,
                },
            };
        let streak_fuzzy = match record.field("streak_fuzzy") {
            None => false,
            Some(value) => value.as_bool()?,
        };
        let reads = match record.field("reads") {
            None | Some(Value::Null) => Vec::new(),
            Some(value) => value
                .as_array()?
                .iter()
                .map(|entry| match entry.as_array()?.as_slice() {
                    [key, n] => Some((
                        unhex(key.as_str()?)?.as_slice().try_into().ok()?,
                        n.as_i64()?,
                    )),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()?,
        };
        let spend = |name: &str| -> Option<i64> {
            match record.field(name) {
                None => Some(0),
                Some(value) => value.as_i64(),
            }
        };
        let tool_counts = match record.field("tool_counts") {
            None | Some(Value::Null) => Vec::new(),
            Some(value) => value
                .as_array()?
                .iter()
                .map(|entry| match entry.as_array()?.as_slice() {
                    [key, n] => Some((
                        unhex(key.as_str()?)?.as_slice().try_into().ok()?,
                        n.as_i64()?,
                    )),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()?,
        };
        let targets = match record.field("targets") {
            None | Some(Value::Null) => Vec::new(),
            Some(value) => value
                .as_array()?
                .iter()
                .map(|entry| match entry.as_array()?.as_slice() {
                    [key, states, revisits] => Some((
                        unhex(key.as_str()?)?.as_slice().try_into().ok()?,
                        chunks(&unhex(states.as_str()?)?)?,
                        revisits.as_i64()?,
                    )),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()?,
        };
        let side_effects = match record.field("side_effects")? {
            Value::Null => Vec::new(),
            // The table's order is its insertion order (which entry an eviction picks among equals):
            // read it from the record's text, which serde_json's sorted map does not keep.
            Value::Object(table) if !table.is_empty() => ordered_side_effects(raw)?
                .into_iter()
                .map(|(key, entry)| {
                    let key: SideEffectKey = unhex(&key)?.as_slice().try_into().ok()?;
                    match entry.as_array()?.as_slice() {
                        [first, n] => Some((key, first.as_i64()?, n.as_i64()?)),
                        _ => None,
                    }
                })
                .collect::<Option<Vec<_>>>()?,
            _ => return None,
        };
        let state = RunState {
            calls: int("calls")?,
            last_ts_ms: int("last_ts_ms")?,
            halted_by,
            plan_step,
            seen_ids: chunks(&unhex(text("seen_ids")?)?)?,
            streak_key,
            streak_call,
            streak_varied: flag("streak_varied")?,
            streak_ts: times("streak_ts")?,
            streak_first_event_id: text("streak_first_event_id")?.to_owned(),
            streak_alerted: flag("streak_alerted")?,
            streak_fp,
            streak_fuzzy,
            reads,
            targets,
            advised: spend("advised")?,
            cost_micro: spend("cost_micro")?,
            tokens: spend("tokens")?,
            model_streak: spend("model_streak")?,
            tool_counts,
            streak_ids: match record.field("streak_ids") {
                None | Some(Value::Null) => StreakIds::default(),
                Some(value) => {
                    let mut ids = StreakIds::default();
                    for id in value.as_array()? {
                        ids.push(cut_id(id.as_str()?));
                    }
                    ids
                }
            },
            streak_args: match record.field("streak_args") {
                None => String::new(),
                Some(value) => value.as_str()?.to_owned(),
            },
            streak_transient: match record.field("streak_transient") {
                None => false,
                Some(value) => value.as_bool()?,
            },
            streak_pauses: spend("streak_pauses")?,
            handoffs,
            handoff_from,
            handoff_to,
            spawned: matches!(record.field("spawned"), Some(Value::Bool(true))),
            recent_sigs: chunks(&unhex(text("recent_sigs")?)?)?,
            recent_ts: times("recent_ts")?,
            recent_failing: record.field("recent_failing")?.as_u64()?,
            side_effects,
        };
        let offset = match record.field("offset") {
            None => -1,
            Some(value) => value.as_i64()?,
        };
        Some((state, offset))
    }

    /// The stored record of this state and `offset` in format `version` (0 to 2): the reference's
    /// `encode_run`, key for key.
    pub fn write_record(&self, offset: i64, version: i64, out: &mut Vec<u8>) {
        use std::io::Write;
        let string = |out: &mut Vec<u8>, text: &str| {
            serde_json::to_writer(&mut *out, text).expect("writing to a Vec cannot fail")
        };
        let list = |out: &mut Vec<u8>, items: &VecDeque<i64>| {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write!(out, "{item}").expect("writing to a Vec cannot fail");
            }
            out.push(b']');
        };
        let hex_of = |out: &mut Vec<u8>, parts: &mut dyn Iterator<Item = &[u8]>| {
            out.push(b'"');
            for part in parts {
                crate::normalize::hex_into(out, part);
            }
            out.push(b'"');
        };
        write!(
            out,
            "{{\"calls\":{},\"last_ts_ms\":{},\"halted_by\":",
            self.calls, self.last_ts_ms
        )
        .expect("writing to a Vec cannot fail");
        match &self.halted_by {
            Some(id) => string(out, id),
            None => out.extend_from_slice(b"null"),
        }
        out.extend_from_slice(b",\"plan_step\":");
        match self.plan_step {
            Some(step) => write!(out, "{step}").expect("writing to a Vec cannot fail"),
            None => out.extend_from_slice(b"null"),
        }
        out.extend_from_slice(b",\"seen_ids\":");
        hex_of(out, &mut self.seen_ids.iter().map(|d| d.as_slice()));
        out.extend_from_slice(b",\"streak_key\":");
        hex_of(out, &mut self.streak_key.iter().map(|k| k.as_slice()));
        out.extend_from_slice(b",\"streak_call\":");
        let call: &[u8] = if self.streak_key.is_some() {
            &self.streak_call
        } else {
            &[]
        };
        hex_of(out, &mut std::iter::once(call));
        write!(
            out,
            ",\"streak_varied\":{},\"streak_ts\":",
            self.streak_varied
        )
        .expect("writing to a Vec cannot fail");
        list(out, &self.streak_ts);
        out.extend_from_slice(b",\"streak_first_event_id\":");
        string(out, &self.streak_first_event_id);
        write!(
            out,
            ",\"streak_alerted\":{},\"recent_sigs\":",
            self.streak_alerted
        )
        .expect("writing to a Vec cannot fail");
        hex_of(out, &mut self.recent_sigs.iter().map(|s| s.as_slice()));
        out.extend_from_slice(b",\"recent_ts\":");
        list(out, &self.recent_ts);
        write!(
            out,
            ",\"recent_failing\":{},\"side_effects\":",
            self.recent_failing
        )
        .expect("writing to a Vec cannot fail");
        if self.side_effects.is_empty() {
            out.extend_from_slice(b"null");
        } else {
            out.push(b'{');
            for (i, (key, first, n)) in self.side_effects.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                hex_of(out, &mut std::iter::once(key.as_slice()));
                write!(out, ":[{first},{n}]").expect("writing to a Vec cannot fail");
            }
            out.push(b'}');
        }
        if version >= 2 {
            // Only what differs from the defaults (the reference's `encode_run`): records stay small.
            if let Some(key) = &self.streak_fp {
                out.extend_from_slice(b",\"streak_fp\":");
                hex_of(out, &mut std::iter::once(key.as_slice()));
            }
            if self.streak_fuzzy {
                out.extend_from_slice(b",\"streak_fuzzy\":true");
            }
            if !self.reads.is_empty() {
                out.extend_from_slice(b",\"reads\":[");
                for (i, (key, n)) in self.reads.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    out.push(b'[');
                    hex_of(out, &mut std::iter::once(key.as_slice()));
                    write!(out, ",{n}]").expect("writing to a Vec cannot fail");
                }
                out.push(b']');
            }
            if !self.targets.is_empty() {
                out.extend_from_slice(b",\"targets\":[");
                for (i, (key, states, revisits)) in self.targets.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    out.push(b'[');
                    hex_of(out, &mut std::iter::once(key.as_slice()));
                    out.push(b',');
                    hex_of(out, &mut states.iter().map(|s| s.as_slice()));
                    write!(out, ",{revisits}]").expect("writing to a Vec cannot fail");
                }
                out.push(b']');
            }
            for (name, value) in [
                ("cost_micro", self.cost_micro),
                ("tokens", self.tokens),
                ("model_streak", self.model_streak),
            ] {
                if value != 0 {
                    write!(out, ",\"{name}\":{value}").expect("writing to a Vec cannot fail");
                }
            }
            if !self.tool_counts.is_empty() {
                out.extend_from_slice(b",\"tool_counts\":[");
                for (i, (key, n)) in self.tool_counts.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    out.push(b'[');
                    hex_of(out, &mut std::iter::once(key.as_slice()));
                    write!(out, ",{n}]").expect("writing to a Vec cannot fail");
                }
                out.push(b']');
            }
            if self.advised != 0 {
                write!(out, ",\"advised\":{}", self.advised).expect("writing to a Vec cannot fail");
            }
            if !self.streak_ids.is_empty() {
                out.extend_from_slice(b",\"streak_ids\":[");
                for (i, id) in self.streak_ids.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    string(out, id);
                }
                out.push(b']');
            }
            if !self.streak_args.is_empty() {
                out.extend_from_slice(b",\"streak_args\":");
                string(out, &self.streak_args);
            }
            if self.streak_transient {
                out.extend_from_slice(b",\"streak_transient\":true");
            }
            if self.streak_pauses != 0 {
                write!(out, ",\"streak_pauses\":{}", self.streak_pauses)
                    .expect("writing to a Vec cannot fail");
            }
            if self.handoffs != 0 {
                write!(out, ",\"handoffs\":[{},", self.handoffs)
                    .expect("writing to a Vec cannot fail");
                hex_of(out, &mut std::iter::once(self.handoff_from.as_slice()));
                out.push(b',');
                hex_of(out, &mut std::iter::once(self.handoff_to.as_slice()));
                out.push(b']');
            }
            if self.spawned {
                out.extend_from_slice(b",\"spawned\":true");
            }
        }
        write!(out, ",\"offset\":{offset}").expect("writing to a Vec cannot fail");
        if version >= 1 {
            write!(out, ",\"v\":{version}").expect("writing to a Vec cannot fail");
        }
        out.push(b'}');
    }
}

/// The entries of the record's ``side_effects`` object in the order the record has them.
fn ordered_side_effects(raw: &[u8]) -> Option<Vec<(String, Value)>> {
    use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};

    struct Entries;
    impl<'de> Visitor<'de> for Entries {
        type Value = Vec<(String, Value)>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut entries = Vec::new();
            while let Some(entry) = map.next_entry::<String, Value>()? {
                entries.push(entry);
            }
            Ok(entries)
        }
    }
    struct Record;
    impl<'de> Visitor<'de> for Record {
        type Value = Option<Vec<(String, Value)>>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a stored run record")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut found = None;
            while let Some(key) = map.next_key::<String>()? {
                if key == "side_effects" {
                    found = Some(map.next_value_seed(EntriesSeed)?);
                } else {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            Ok(found)
        }
    }
    struct EntriesSeed;
    impl<'de> serde::de::DeserializeSeed<'de> for EntriesSeed {
        type Value = Vec<(String, Value)>;
        fn deserialize<D: Deserializer<'de>>(
            self,
            deserializer: D,
        ) -> Result<Self::Value, D::Error> {
            deserializer.deserialize_map(Entries)
        }
    }
    let mut deserializer = serde_json::Deserializer::from_slice(raw);
    deserializer.deserialize_map(Record).ok()?
}

/// Bytes of a lowercase or uppercase hex string (as Python's `bytes.fromhex`, without its spaces).
fn unhex(text: &str) -> Option<Vec<u8>> {
    let digits = text.as_bytes();
    if !digits.len().is_multiple_of(2) {
        return None;
    }
    let mut out = Vec::with_capacity(digits.len() / 2);
    for pair in digits.chunks_exact(2) {
        let (high, low) = (NIBBLE[pair[0] as usize], NIBBLE[pair[1] as usize]);
        if (high | low) & 0x10 != 0 {
            return None;
        }
        out.push((high << 4) | low);
    }
    Some(out)
}

/// Each byte's value as a hex digit (`0-9`, `a-f`, `A-F`), else 0x10: `unhex`'s table (a stored
/// record's digests are most of its text, and `char::to_digit` per digit was a tenth of a run's fold).
const NIBBLE: [u8; 256] = {
    let mut table = [0x10u8; 256];
    let mut i = 0;
    while i < 10 {
        table[b'0' as usize + i] = i as u8;
        i += 1;
    }
    let mut i = 0;
    while i < 6 {
        table[b'a' as usize + i] = 10 + i as u8;
        table[b'A' as usize + i] = 10 + i as u8;
        i += 1;
    }
    table
};

/// `bytes` cut into `N`-byte entries, None if it does not divide evenly.
fn chunks<const N: usize>(bytes: &[u8]) -> Option<VecDeque<[u8; N]>> {
    if !bytes.len().is_multiple_of(N) {
        return None;
    }
    Some(
        bytes
            .chunks(N)
            .map(|c| c.try_into().expect("N bytes"))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stored record of the bench's corpus (a halted run with a side effect, written by this engine).
    const RECORD: &str = r#"{"calls":4,"last_ts_ms":1764000024737,"halted_by":"6f7fd5e553c9c06890bd12fd31e2e0ad","plan_step":null,"seen_ids":"9f18b0f017530313e81f8066175403147116d1dc175503150611e14a17560316987574e917570317ef72447f17580318","streak_key":"5440d2febcd90e18658ef07932","streak_call":"0286009d141cb295","streak_varied":false,"streak_ts":[1764000018391,1764000019744,1764000021064,1764000022388],"streak_first_event_id":"run-001495-0","streak_alerted":false,"recent_sigs":"0286009d141cb2955440d2febcd90e18658ef079320286009d141cb2955440d2febcd90e18658ef079320286009d141cb2955440d2febcd90e18658ef079320286009d141cb2955440d2febcd90e18658ef07932","recent_ts":[1764000018391,1764000019744,1764000021064,1764000022388],"recent_failing":15,"side_effects":{"0286009d141cb2958ef07932":[1764000018391,4]},"streak_fp":"5440d2febcd90e18658ef07932","advised":1,"streak_ids":["run-001495-1","run-001495-2","run-001495-3"],"streak_args":"{\"body\":\"Approved.\",\"subject\":\"Your refund\",\"to\":\"customer916@example.com\"}","offset":1063,"v":2}"#;

    /// A reader's result: the record written back from the state it read, and the offset.
    type ReadBack = Option<(Vec<u8>, i64)>;

    /// What each reader (flat, map) makes of `raw`.
    fn read_back(raw: &str) -> (ReadBack, ReadBack) {
        let write = |(state, offset): (RunState, i64)| {
            let mut out = Vec::new();
            state.write_record(offset, FORMAT_VERSION, &mut out);
            (out, offset)
        };
        let flat = crate::fields::FlatObject::parse(raw.as_bytes())
            .and_then(|record| RunState::from_record(&record, raw.as_bytes()))
            .map(write);
        let map = match serde_json::from_str::<Value>(raw) {
            Ok(Value::Object(record)) => RunState::from_record(&record, raw.as_bytes()).map(write),
            _ => None,
        };
        (flat, map)
    }

    #[test]
    fn a_flat_record_reads_as_the_map_does() {
        let (flat, map) = read_back(RECORD);
        assert!(flat.is_some());
        assert_eq!(flat, map);
        assert_eq!(flat.unwrap(), (RECORD.as_bytes().to_vec(), 1063)); // written by this engine: the same bytes
                                                                       // a repeated name: the flat reading declines, the map keeps the last, and so does `Object`
        let repeated = RECORD.replacen("{\"calls\":4,", "{\"calls\":4,\"calls\":9,", 1);
        let (flat, map) = read_back(&repeated);
        assert_eq!(flat, None);
        assert!(String::from_utf8(map.unwrap().0)
            .unwrap()
            .starts_with("{\"calls\":9,"));
        let object = crate::fields::Object::parse(repeated.as_bytes()).unwrap();
        assert!(matches!(object, crate::fields::Object::Map(_)));
        assert_eq!(
            RunState::from_record(&object, repeated.as_bytes())
                .unwrap()
                .0
                .calls,
            9
        );
        // refused alike: a field of the wrong type, a missing one, another version
        for refused in [
            RECORD.replacen("\"calls\":4", "\"calls\":4.0", 1),
            RECORD.replacen("\"plan_step\":null,", "", 1),
            RECORD.replacen("\"v\":2", "\"v\":3", 1),
        ] {
            assert_eq!(read_back(&refused), (None, None), "{refused}");
        }
    }

    #[test]
    fn the_flat_reading_declines_what_the_map_may_read_otherwise() {
        for declined in [
            RECORD.replacen("\"calls\"", "\"ca\\u006cls\"", 1), // a name with an escape
            RECORD.replacen("\"v\":2", "\"v\":2,\"calls\":4", 1), // a repeated name
            format!("{RECORD} x"),                              // text after the object
            format!("[{RECORD}]"),                              // not an object
            RECORD[..RECORD.len() - 1].to_owned(),              // cut short
        ] {
            assert!(
                crate::fields::FlatObject::parse(declined.as_bytes()).is_none(),
                "{declined}"
            );
        }
        let escaped = RECORD.replacen("\"calls\"", "\"ca\\u006cls\"", 1);
        assert!(read_back(&escaped).1.is_some()); // the map reads it: the caller falls back to it
    }

    #[test]
    fn unhex_reads_what_to_digit_reads() {
        let by_char = |text: &str| -> Option<Vec<u8>> {
            let digits = text.as_bytes();
            if !digits.len().is_multiple_of(2) {
                return None;
            }
            digits
                .chunks(2)
                .map(|pair| {
                    Some(
                        ((pair[0] as char).to_digit(16)? * 16 + (pair[1] as char).to_digit(16)?)
                            as u8,
                    )
                })
                .collect()
        };
        for high in 0u8..128 {
            for low in 0u8..128 {
                let text = String::from_utf8(vec![high, low, b'a', b'F']).unwrap();
                assert_eq!(unhex(&text), by_char(&text), "{text:?}");
            }
        }
        for text in ["", "0", "é0", "0é", "00ff", "FFff", "0g", " 0", "abc"] {
            assert_eq!(unhex(text), by_char(text), "{text:?}");
        }
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(unhex(&crate::normalize::hex(&all)), Some(all));
    }

    #[test]
    fn checksum_matches_zlib() {
        // zlib.crc32(b"ev-1") << 32 | zlib.adler32(b"ev-1"), from CPython.
        let expected: u64 = (0x0c34_961au64 << 32) | 0x0385_013a;
        assert_eq!(u64::from_be_bytes(checksum("ev-1")), expected);
    }

    #[test]
    fn short_takes_hex_heads_and_checksums_the_rest() {
        assert_eq!(
            short("0123456789abcdefff"),
            [0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef]
        );
        assert_eq!(
            short("0a 0b 0c 0d 0e 0f 10"),
            checksum("0a 0b 0c 0d 0e 0f 10")
        );
        assert_eq!(short("abc"), checksum("abc"));
    }
}
