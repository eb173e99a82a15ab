//! The detector fold of `stream_app/core/detector.py` (the reference), state for state: the same
//! digests, the same rule order, the same windows. Only the decision's text is left to the reference
//! (`explain`): a fold that fires returns a `Finding`.

use std::collections::VecDeque;

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
}

/// Outcome codes inside streak keys, in `contract::OUTCOMES` order.
const OUTCOME_CODE: [u8; 4] = [b's', b'e', b'0', b'n'];
const SUCCESS: u8 = 0;
const SIDE_EFFECT_SLOTS: usize = 32;
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
    let bytes = text.as_bytes();
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

/// Everything the detector remembers about one run.
#[derive(Default)]
pub struct RunState {
    calls: i64,
    pub last_ts_ms: i64,
    halted: bool,
    plan_step: Option<i64>,
    seen_ids: VecDeque<Digest>,
    streak_key: Option<StreakKey>,
    streak_call: Digest,
    streak_varied: bool,
    streak_ts: VecDeque<i64>,
    streak_first_event_id: String,
    streak_alerted: bool,
    recent_sigs: VecDeque<StepSig>,
    recent_ts: VecDeque<i64>,
    /// Bit i set = the call i steps back failed (only the last three bits are ever read).
    recent_failing: u8,
    /// (call, first ts, occurrences) in insertion order, as the reference's dict.
    side_effects: Vec<(SideEffectKey, i64, i64)>,
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
    pub event_id: &'a str,
    pub ts_ms: i64,
    pub outcome: u8,
    pub call: Digest,
    pub result: Digest,
    pub tool: [u8; 4],
    pub retry_budget: Option<i64>,
    pub side_effect: Option<bool>,
}

/// The rule that fired and the numbers its decision reports (the reference's `Finding`).
pub struct Finding {
    pub verdict: &'static str,
    pub count: i64,
    pub budget: i64,
    pub period: i64,
    pub first_event_id: String,
}

impl RunState {
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
        if self.halted {
            return Admission::Halted;
        }
        Admission::Fold
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
    pub fn fold(&mut self, step: &Step, thresholds: &Thresholds) -> Option<Finding> {
        let failing = step.outcome != SUCCESS;
        let mut side_key = [0u8; 12];
        side_key[..8].copy_from_slice(&step.call);
        side_key[8..].copy_from_slice(&step.tool);
        let occurrences = self.side_effect_occurrence(step, side_key, thresholds);
        let mut key = [0u8; 13];
        key[..8].copy_from_slice(&step.result);
        key[8] = OUTCOME_CODE[step.outcome as usize];
        key[9..].copy_from_slice(&step.tool);
        let (count, budget) = self.streak(step, key, thresholds);
        let mut sig = [0u8; 21];
        sig[..8].copy_from_slice(&step.call);
        sig[8..].copy_from_slice(&key);
        let period = self.cycle(sig, failing, step.ts_ms, thresholds);

        if !(self.calls > thresholds.iteration_ceiling
            || occurrences >= 2
            || (failing && count > budget)
            || period > 0
            || (!failing && 0 < thresholds.poll_alert_after && thresholds.poll_alert_after <= count))
        {
            return None;
        }
        let (verdict, count) = if self.calls > thresholds.iteration_ceiling {
            ("iteration_ceiling", self.calls)
        } else if occurrences >= thresholds.circuit_open_at {
            ("circuit_open", occurrences)
        } else if failing && count > budget {
            (
                if self.streak_varied {
                    "semantic_loop"
                } else {
                    "recursion"
                },
                count,
            )
        } else if period > 0 {
            ("cycle", count)
        } else if occurrences >= 2 {
            return Some(Finding {
                verdict: "duplicate_call",
                count: occurrences,
                budget: 0,
                period: 0,
                first_event_id: String::new(),
            });
        } else if !failing && !self.streak_varied && !self.streak_alerted {
            self.streak_alerted = true;
            return Some(Finding {
                verdict: "polling",
                count,
                budget: 0,
                period: 0,
                first_event_id: self.streak_first_event_id.clone(),
            });
        } else {
            return None;
        };
        let finding = Finding {
            verdict,
            count,
            budget,
            period,
            first_event_id: self.streak_first_event_id.clone(),
        };
        if thresholds.shadow {
            self.resume(); // as if halted and resumed at once
        } else {
            self.halted = true;
        }
        Some(finding)
    }

    fn resume(&mut self) {
        self.halted = false;
        self.calls = 0;
        self.side_effects.clear();
        self.reset_streaks();
    }

    fn reset_streaks(&mut self) {
        self.streak_key = None;
        self.streak_call = [0; 8];
        self.streak_varied = false;
        self.streak_alerted = false;
        self.streak_ts.clear();
        self.streak_first_event_id.clear();
        self.recent_sigs.clear();
        self.recent_ts.clear();
        self.recent_failing = 0;
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

    fn streak(&mut self, step: &Step, key: StreakKey, thresholds: &Thresholds) -> (i64, i64) {
        if self.streak_key == Some(key) {
            if step.call != self.streak_call {
                self.streak_varied = true;
            }
        } else {
            self.streak_key = Some(key);
            self.streak_call = step.call;
            self.streak_varied = false;
            self.streak_alerted = false;
            self.streak_ts.clear();
            self.streak_first_event_id.clear();
            self.streak_first_event_id.push_str(step.event_id);
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

    fn cycle(&mut self, sig: StepSig, failing: bool, ts_ms: i64, thresholds: &Thresholds) -> i64 {
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
        self.recent_failing = ((self.recent_failing << 1) | failing as u8) & 0b111;
        if !repeats {
            return 0;
        }
        let steps = times.len();
        let n = sigs.len();
        for period in CYCLE_PERIODS {
            let span = period * occurrences;
            if span > steps || span as i64 > thresholds.window_calls || span > n {
                continue;
            }
            let unit_start = n - period;
            let repeated = (0..span).all(|i| sigs[n - span + i] == sigs[unit_start + i % period]);
            let all_this_step = (unit_start..n).all(|i| sigs[i] == sig);
            if repeated
                && !all_this_step
                && self.recent_failing & ((1u8 << period) - 1) != 0
                && ts_ms - times[steps - span] <= thresholds.window_ms
            {
                return period as i64;
            }
        }
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
