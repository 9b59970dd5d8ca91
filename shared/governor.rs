//! The team's rate governor: one view of each model endpoint's limits, shared by every member
//! (the LLM lead included), so that N teammates do not meet a provider's limit N times.
//!
//! Installed as this process's [`crate::llm::gate::Gate`]; per endpoint (a fingerprint of URL
//! and key, never the key):
//!
//! - **a shared cooldown**: a 429, 529 or overloaded 503 (not a quota 429) stores the wait it
//!   asked for (`retry-after`, the reset of the exhausted limit, else the backoff) and every
//!   member waits it out, with jitter, before its next attempt there;
//! - **a concurrency cap**: at most `max_concurrent_calls` attempts in flight across the team
//!   (and per model-id prefix, `[model_caps]`, counting that prefix's calls only), each
//!   holding a slot a crash releases (and a stop, within its lease), taken first come, first
//!   served (the LLM lead first; waits show as `doing: waiting_slot`); without a cap,
//!   an adaptive one (AIMD, as TCP): halved at a rate limit (not below 1, once per cooldown),
//!   one more after each quiet window;
//! - **pacing**: where answers say how many requests or tokens are left in the provider's
//!   window, the team spends them (a call taking the tokens the answers' drops show one
//!   takes) and then waits for the reset, before any 429.
//!
//! The lead is told, in a status update, when a cooldown begins (at most once a minute).
//! `rate_governor = "off"` (`lead run --rate-governor off`) leaves only an explicit cap. The
//! state and the slots are shared through the store ([`crate::store::govern`]: files in the
//! team dir, or the bus of a team spread over hosts); the policy is pure ([`Limits`]).

use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::config::TeamConfig;
use crate::fsutil;
use crate::inbox::{Durability, Inbox};
use crate::llm::LlmError;
use crate::llm::gate::{Gate, Seen};
use crate::message::{Message, MessageType};
use crate::store::govern::{Cap, Pool, Slot};
use crate::teamdir::{AgentName, LEAD, TeamDir};

/// The adaptive cap a team starts from: a new team's first calls are staggered, and each
/// answer without a rate limit adds one until the first limit is met (TCP's slow start).
pub const START_LIMIT: f64 = 2.0;
/// The most the adaptive cap grows to.
pub const MAX_LIMIT: f64 = 64.0;
/// A rate limit's answer-free time after which the adaptive cap grows by one.
pub const QUIET_WINDOW: f64 = 5.0;
/// The wait after a rate limit whose answer named none.
pub const DEFAULT_WAIT: f64 = 1.0;

/// Whether the team's rate governor is on (the default) or off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    On,
    Off,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Mode, String> {
        match s {
            "on" => Ok(Mode::On),
            "off" => Ok(Mode::Off),
            _ => Err(format!("expected on or off, not {s:?}")),
        }
    }
}

/// One endpoint's limits as the team has learned them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Limits {
    /// No attempt before this (Unix seconds).
    pub cooldown_until: f64,
    /// The adaptive cap.
    pub limit: f64,
    /// No halving again before this (the cooldown it began).
    pub halve_after: f64,
    /// When the cap last changed.
    pub changed_at: f64,
    /// Requests left in the provider's window, as its answers and our attempts since say.
    pub remaining: Option<u64>,
    /// When that window resets.
    pub reset_at: f64,
    /// Rate limits met, in all.
    pub limited: u64,
    /// No rate limit met yet: the cap grows with every answer.
    #[serde(default)]
    pub slow_start: bool,
    /// The attempts now in flight: when each began, and the slot it holds. An attempt's entry
    /// goes when it ends, or once its slot's holder is gone (a killed process's: see
    /// [`Limits::drop_gone`]); one of no slot that a crash left goes after [`IN_FLIGHT_MAX`].
    #[serde(default, deserialize_with = "in_flight_entries")]
    pub in_flight: Vec<InFlight>,
    /// When the lead was last told the team is rate limited here.
    #[serde(default)]
    pub told_at: f64,
    /// Tokens left in the provider's window (the tightest limit its answers name), less what
    /// the attempts since are expected to take.
    #[serde(default)]
    pub tokens_left: Option<f64>,
    /// When that window resets.
    #[serde(default)]
    pub tokens_reset_at: f64,
    /// What one call takes of the tokens left, as the answers' drops show it (a moving
    /// average; 0 until one is seen).
    #[serde(default)]
    pub tokens_per_call: f64,
}

/// The longest an attempt counts as in flight without ending.
pub const IN_FLIGHT_MAX: f64 = 900.0;

/// An attempt in flight.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InFlight {
    /// When it began (Unix seconds).
    pub at: f64,
    /// The id of the slot it holds ([`crate::store::govern::Slot::id`]); none without a cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
}

/// `in_flight` as written: entries of this version, and the bare start times of older ones
/// (of no slot).
fn in_flight_entries<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<InFlight>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Entry {
        Now(InFlight),
        Then(f64),
    }
    Ok(Vec::<Entry>::deserialize(d)?
        .into_iter()
        .map(|e| match e {
            Entry::Now(e) => e,
            Entry::Then(at) => InFlight { at, by: None },
        })
        .collect())
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            cooldown_until: 0.0,
            limit: START_LIMIT,
            halve_after: 0.0,
            changed_at: 0.0,
            remaining: None,
            reset_at: 0.0,
            limited: 0,
            slow_start: true,
            in_flight: Vec::new(),
            told_at: 0.0,
            tokens_left: None,
            tokens_reset_at: 0.0,
            tokens_per_call: 0.0,
        }
    }
}

impl Limits {
    /// These limits with no wait ending later than [`crate::llm::gate::MAX_SERVER_WAIT`] from
    /// `now`: a state learned from an answer that named a far reset (before such resets were
    /// refused), or written by a host whose clock runs far ahead, holds no member for longer,
    /// whichever run reads it. An attempt "in flight" since a time after `now` is dropped.
    pub fn bounded(mut self, now: f64) -> Limits {
        let latest = now + crate::llm::gate::MAX_SERVER_WAIT.as_secs_f64();
        for t in [
            &mut self.cooldown_until,
            &mut self.reset_at,
            &mut self.tokens_reset_at,
            &mut self.halve_after,
        ] {
            *t = if t.is_nan() { 0.0 } else { t.min(latest) };
        }
        self.in_flight
            .retain(|e| e.at.is_finite() && e.at <= now + 1.0);
        self
    }

    /// How long an attempt at `now` must wait first; `None`: it may go.
    pub fn wait(&self, now: f64) -> Option<f64> {
        if self.cooldown_until > now {
            return Some(self.cooldown_until - now);
        }
        if self.remaining == Some(0) && self.reset_at > now {
            return Some(self.reset_at - now);
        }
        if let Some(left) = self.tokens_left
            && self.tokens_reset_at > now
            && left < self.tokens_per_call.max(1.0)
        {
            return Some(self.tokens_reset_at - now);
        }
        None
    }

    /// An attempt goes at `now`, holding slot `by`: one request of the window spent, and one
    /// more in flight.
    pub fn spend(&mut self, now: f64, by: Option<&str>) {
        if self.reset_at > now
            && let Some(r) = self.remaining.as_mut()
        {
            *r = r.saturating_sub(1);
        }
        if self.tokens_reset_at > now
            && let Some(t) = self.tokens_left.as_mut()
        {
            *t = (*t - self.tokens_per_call).max(0.0);
        }
        self.in_flight.retain(|e| now - e.at < IN_FLIGHT_MAX);
        self.in_flight.push(InFlight {
            at: now,
            by: by.map(str::to_owned),
        });
    }

    /// The attempt that holds slot `by` ended (`None`: one of no slot, the oldest).
    pub fn ended(&mut self, by: Option<&str>) {
        if let Some(i) = self.in_flight.iter().position(|e| e.by.as_deref() == by) {
            self.in_flight.remove(i);
        }
    }

    /// Drops the attempts whose slot's holder is gone (killed: its call went with it), as
    /// `alive` says of the slots named (in order; `None`: it cannot tell, and all are kept).
    pub fn drop_gone(&mut self, alive: impl FnOnce(&[String]) -> Option<Vec<bool>>) {
        let by: Vec<String> = self.in_flight.iter().filter_map(|e| e.by.clone()).collect();
        if by.is_empty() {
            return;
        }
        let Some(alive) = alive(&by) else { return };
        let gone: std::collections::HashSet<&str> = by
            .iter()
            .zip(alive)
            .filter(|(_, alive)| !alive)
            .map(|(id, _)| id.as_str())
            .collect();
        self.in_flight
            .retain(|e| e.by.as_deref().is_none_or(|id| !gone.contains(id)));
    }

    /// What an answer said, with `in_flight` attempts out (this one included).
    pub fn observe(&mut self, seen: &Seen, now: f64, in_flight: usize) {
        if let Some(r) = seen.remaining_requests {
            // The others in flight may not be counted in what the provider says is left.
            let r = r.saturating_sub(self.in_flight.len().saturating_sub(1) as u64);
            let reset = now + seen.requests_reset.map_or(1.0, |d| d.as_secs_f64());
            if reset > self.reset_at + 0.5 || self.reset_at <= now {
                // A new window.
                self.remaining = Some(r);
            } else {
                self.remaining = Some(self.remaining.map_or(r, |have| have.min(r)));
            }
            self.reset_at = self.reset_at.max(reset);
        }
        if let Some(t) = seen.remaining_tokens {
            let t = t as f64;
            let reset = now + seen.tokens_reset.map_or(1.0, |d| d.as_secs_f64());
            let same_window = reset <= self.tokens_reset_at + 0.5 && self.tokens_reset_at > now;
            match (self.tokens_left, same_window) {
                (Some(left), true) => {
                    // What the provider says is left, against what was expected after the
                    // attempts since: a drop beyond it is what calls take.
                    let seen_drop = left + self.tokens_per_call - t;
                    if seen_drop > 0.0 {
                        self.tokens_per_call = if self.tokens_per_call == 0.0 {
                            seen_drop
                        } else {
                            0.7 * self.tokens_per_call + 0.3 * seen_drop
                        };
                    }
                    self.tokens_left = Some(left.min(t));
                }
                _ => self.tokens_left = Some(t),
            }
            self.tokens_reset_at = self.tokens_reset_at.max(reset);
        }
        if seen.limited {
            self.limited += 1;
            self.slow_start = false;
            let wait = seen.wait.map_or(DEFAULT_WAIT, |d| d.as_secs_f64());
            self.cooldown_until = self.cooldown_until.max(now + wait);
            if now >= self.halve_after {
                let base = self.limit.min(in_flight.max(1) as f64);
                self.limit = (base / 2.0).floor().max(1.0);
                self.halve_after = self.cooldown_until;
                self.changed_at = now;
            }
        } else if (200..300).contains(&seen.status) && self.slow_start {
            self.limit = (self.limit + 1.0).min(MAX_LIMIT);
            self.changed_at = now;
        } else if (200..300).contains(&seen.status)
            && now >= self.halve_after
            && now - self.changed_at >= QUIET_WINDOW
            && self.limit < MAX_LIMIT
        {
            self.limit += 1.0;
            self.changed_at = now;
        }
    }
}

/// The caps on attempts in flight at an endpoint for `model`: its `[model_caps]` one (the
/// longest prefix that matches), which counts that prefix's calls only, and the team's
/// explicit one, which counts every call; without either, the adaptive one while the governor
/// is on (a model with a cap of its own is not under it). `None`: no cap.
pub fn cap(cfg: &TeamConfig, model: &str, limits: &Limits) -> Option<Cap> {
    let group = cfg
        .model_caps
        .iter()
        .filter(|(prefix, _)| model.starts_with(prefix.as_str()))
        .max_by_key(|(prefix, _)| prefix.len())
        .map(|(prefix, n)| (prefix.clone(), *n as usize));
    let team = match (cfg.max_concurrent_calls, &group) {
        (Some(n), _) => Some(n as usize),
        (None, None) if cfg.rate_governor.unwrap_or_default() == Mode::On => {
            Some(limits.limit as usize)
        }
        (None, _) => None,
    };
    (group.is_some() || team.is_some()).then_some(Cap { group, team })
}

/// A cooldown the team is waiting out at an endpoint, as `lead status` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Cooldown {
    /// The endpoint's fingerprint (`govern/FP/`).
    pub endpoint: String,
    /// When it ends (Unix seconds), at most an hour from now ([`Limits::bounded`]).
    pub until: f64,
    /// How to end it by hand.
    pub clear: String,
}

/// The cooldowns the team is waiting out now, endpoint by endpoint (a store that cannot be
/// read shows none).
pub fn cooldowns(team: &TeamDir) -> Vec<Cooldown> {
    let now = fsutil::now();
    let store = team.store();
    let Ok(endpoints) = crate::store::govern::endpoints(store) else {
        return Vec::new();
    };
    endpoints
        .into_iter()
        .filter_map(|fp| {
            let bytes = Pool::new(store, &fp)
                .update(|b| (None, b.map(<[u8]>::to_vec)))
                .ok()??;
            let limits: Limits = serde_json::from_slice(&bytes).ok()?;
            let wait = limits.bounded(now).wait(now)?;
            Some(Cooldown {
                until: now + wait,
                clear: crate::store::govern::clear_hint(store, &fp),
                endpoint: fp,
            })
        })
        .collect()
}

/// The governor of one process (see the module doc).
pub struct Governor {
    team: TeamDir,
    /// Who this process is (a member's name, or `lead`), for the queue and its messages.
    who: String,
    /// The LLM lead's process: it goes first in the slots' queue.
    lead: bool,
    cfg: Mutex<(Option<Instant>, TeamConfig)>,
}

/// How long the team's settings are kept before they are read again.
const SETTINGS_TTL: Duration = Duration::from_secs(2);
/// A wait for a slot longer than this shows in the member's record (`doing: waiting_slot`).
const SHOW_WAIT: Duration = Duration::from_millis(200);
/// The lead is told the team is rate limited at most this often per endpoint (seconds).
const TELL_EVERY: f64 = 60.0;

/// What is told of this process's waits for a slot (true: waiting; false: no longer).
static WAITING: OnceLock<Box<dyn Fn(bool) + Send + Sync>> = OnceLock::new();

/// Has `f` told whenever this process begins (true) and ends (false) a wait for a call slot
/// longer than a moment; the first one given stays.
pub fn on_wait(f: impl Fn(bool) + Send + Sync + 'static) {
    let _ = WAITING.set(Box::new(f));
}

fn tell_waiting(waiting: bool) {
    if let Some(f) = WAITING.get() {
        f(waiting);
    }
}

impl Governor {
    /// The governor of process `who` (a member's name, or `lead` for the LLM lead).
    pub fn new(team: &TeamDir, who: &str) -> Governor {
        Governor {
            team: team.clone(),
            who: who.to_owned(),
            lead: who == crate::teamdir::LEAD,
            cfg: Mutex::new((None, TeamConfig::default())),
        }
    }

    /// Installs a governor for `team` as this process's gate, for `who` (see
    /// [`Governor::new`]); on either backend, so a team spread over hosts shares one.
    pub fn install(team: &TeamDir, who: &str) {
        crate::llm::gate::install(Box::new(Governor::new(team, who)));
    }

    fn settings(&self) -> TeamConfig {
        let mut kept = self.cfg.lock().unwrap_or_else(|p| p.into_inner());
        if kept.0.is_none_or(|t| t.elapsed() >= SETTINGS_TTL)
            && let Ok(cfg) = crate::config::Roster::new(&self.team).load_team()
        {
            *kept = (Some(Instant::now()), cfg);
        }
        kept.1.clone()
    }

    fn pool(&self, endpoint: &str) -> Pool {
        Pool::new(self.team.store(), endpoint)
    }

    /// Reads, changes and writes the endpoint's limits under their lock (`None`: the store
    /// failed; the governor is soft, and a call goes on without it).
    fn with_limits<R>(&self, pool: &Pool, f: impl FnOnce(&mut Limits) -> R) -> Option<R> {
        match self.try_limits(pool, f) {
            Ok(out) => Some(out),
            Err(e) => {
                tracing::debug!("rate limits not shared: {e}");
                None
            }
        }
    }

    /// [`Governor::with_limits`], with the store's error.
    fn try_limits<R>(&self, pool: &Pool, f: impl FnOnce(&mut Limits) -> R) -> crate::Result<R> {
        pool.update(|bytes| {
            // A torn or missing state reads as a fresh start.
            let before: Limits = bytes
                .and_then(|b| serde_json::from_slice(b).ok())
                .unwrap_or_default();
            // Bounded as read, and written back so (whatever `f` does).
            let mut limits = before.clone().bounded(fsutil::now());
            limits.drop_gone(|ids| pool.alive(ids).ok());
            let out = f(&mut limits);
            let next = (limits != before)
                .then(|| serde_json::to_vec(&limits).ok())
                .flatten();
            (next, out)
        })
    }

    /// Tells the lead, in a status update, that the team is being rate limited.
    fn tell_lead(&self, endpoint: &str, seen: &Seen, limits: &Limits) {
        let wait = (limits.cooldown_until - fsutil::now()).max(0.0);
        let text = format!(
            "The team is being rate limited by the model API (HTTP {}, endpoint {endpoint}): \
             every member waits {wait:.0} s before its next call there, and the team allows \
             {} calls at once for now ({} rate limits so far). Fewer teammates working at \
             once, or a higher limit with the provider, would help.",
            seen.status, limits.limit as u64, limits.limited
        );
        let msg = Message::new(MessageType::StatusUpdate, &self.who, LEAD, text);
        if let Err(e) = Inbox::new(&self.team, &AgentName::lead()).append(&msg, Durability::Sync) {
            tracing::warn!("could not tell the lead the team is rate limited: {e}");
        }
    }
}

/// `Err` when the store's error `e` is the fence's refusal ([`crate::store::fence`]): this
/// process was replaced, or its fence key is gone, and may make no call, governed or not.
fn refused(e: &crate::Error) -> Result<(), LlmError> {
    let code = match e {
        crate::Error::Fenced { .. } => crate::store::fence::EXIT_SUPERSEDED,
        crate::Error::Unfenced { .. } => crate::store::fence::EXIT_UNFENCED,
        _ => return Ok(()),
    };
    Err(LlmError::Fenced {
        code,
        message: format!("no model call: {e}"),
    })
}

/// A wait at the gate: its sleeps, cut so that [`crate::llm::gate::still_waiting`] (the
/// worker's heartbeat) is called at least every [`crate::llm::gate::BEAT_EVERY`].
struct Waiting {
    last: Instant,
    slept: bool,
}

impl Waiting {
    fn new(began: Instant) -> Waiting {
        Waiting {
            last: began,
            slept: false,
        }
    }

    fn sleep(&mut self, d: Duration) {
        self.slept = true;
        let until = Instant::now() + d;
        loop {
            if self.last.elapsed() >= crate::llm::gate::BEAT_EVERY {
                crate::llm::gate::still_waiting();
                self.last = Instant::now();
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            std::thread::sleep(left.min(crate::llm::gate::BEAT_EVERY));
        }
    }
}

/// A held call slot (or none, with no cap); its end is noted in the endpoint's limits.
struct Held<'a> {
    governor: &'a Governor,
    pool: Pool,
    counted: bool,
    /// Given back after its attempt's end is noted.
    slot: Option<Slot>,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if self.counted {
            let by = self.slot.as_ref().map(Slot::id);
            self.governor.with_limits(&self.pool, |l| l.ended(by));
        }
    }
}

impl Gate for Governor {
    fn enter(&self, endpoint: &str, model: &str) -> Result<Box<dyn Send + '_>, LlmError> {
        let pool = self.pool(endpoint);
        let poll = pool.poll();
        let began = Instant::now();
        let mut waiting = Waiting::new(began);
        let mut shown = false;
        let mut waiter = None;
        let (slot, on) = loop {
            let cfg = self.settings();
            let on = cfg.rate_governor.unwrap_or_default() == Mode::On;
            let limits = if on {
                match self.try_limits(&pool, |l| l.clone()) {
                    Ok(l) => l,
                    Err(e) => {
                        refused(&e)?;
                        tracing::debug!("rate limits not shared: {e}");
                        Limits::default()
                    }
                }
            } else {
                Limits::default()
            };
            let now = fsutil::now();
            if on && let Some(wait) = limits.wait(now) {
                // Jitter: the members released together do not all go at once.
                let jitter = crate::llm::retry::random_unit() * (wait * 0.25).min(0.5);
                waiting.sleep(Duration::from_secs_f64((wait + jitter).min(5.0)));
                continue;
            }
            let slot = match cap(&cfg, model, &limits) {
                None => None,
                Some(n) => {
                    if waiter.is_none() {
                        match pool.queue(&self.who, self.lead) {
                            Ok(w) => waiter = Some(w),
                            Err(e) => {
                                refused(&e)?;
                                tracing::debug!("no place in the slots' queue: {e}");
                            }
                        }
                    }
                    match waiter.as_mut().map(|w| w.try_take(n)) {
                        Some(Ok(Some(s))) => Some(s),
                        Some(Ok(None)) => {
                            if !shown && began.elapsed() >= SHOW_WAIT {
                                shown = true;
                                tell_waiting(true);
                            }
                            waiting.sleep(poll);
                            continue;
                        }
                        Some(Err(e)) => {
                            // Refused by the fence: this process may make no call at all.
                            if let Err(fenced) = refused(&e) {
                                if shown {
                                    tell_waiting(false);
                                }
                                return Err(fenced);
                            }
                            // The store failed: the call goes on ungoverned rather than wait
                            // for it.
                            tracing::debug!("no call slot: {e}");
                            None
                        }
                        None => None,
                    }
                }
            };
            if on {
                // Spend one request of the window, unless it ran out meanwhile (the slot is
                // given back; the place in the queue is kept).
                let went = self
                    .with_limits(&pool, |l| {
                        let now = fsutil::now();
                        if l.wait(now).is_some() {
                            return false;
                        }
                        l.spend(now, slot.as_ref().map(Slot::id));
                        true
                    })
                    .unwrap_or(true);
                if !went {
                    continue;
                }
            }
            break (slot, on);
        };
        drop(waiter);
        if shown {
            tell_waiting(false);
        }
        if waiting.slept {
            crate::llm::gate::note_waited(began.elapsed());
        }
        Ok(Box::new(Held {
            governor: self,
            pool,
            counted: on,
            slot,
        }))
    }

    fn observe(&self, endpoint: &str, seen: &Seen) {
        let cfg = self.settings();
        if cfg.rate_governor.unwrap_or_default() == Mode::Off {
            return;
        }
        let now = fsutil::now();
        let pool = self.pool(endpoint);
        let newly = self.with_limits(&pool, |l| {
            let was = l.cooldown_until;
            let in_flight = l.in_flight.len();
            l.observe(seen, now, in_flight);
            let began = l.cooldown_until > was && was <= now;
            // A rate limit, not an overloaded server (529, 503): the team's use is the cause.
            let tell = began && seen.status == 429 && now - l.told_at >= TELL_EVERY;
            if tell {
                l.told_at = now;
            }
            (began, tell.then(|| l.clone()))
        });
        if let Some((true, told)) = newly
            && seen.limited
        {
            crate::events::log(
                &self.team,
                "rate_limited",
                serde_json::json!({"endpoint": endpoint, "status": seen.status,
                    "wait_secs": seen.wait.map(|d| d.as_secs_f64()), "by": self.who}),
            );
            if let Some(limits) = told {
                self.tell_lead(endpoint, seen, &limits);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limited(wait: Option<f64>) -> Seen {
        Seen {
            status: 429,
            limited: true,
            wait: wait.map(Duration::from_secs_f64),
            ..Seen::default()
        }
    }

    fn ok(remaining: Option<u64>, reset: f64) -> Seen {
        Seen {
            status: 200,
            remaining_requests: remaining,
            requests_reset: Some(Duration::from_secs_f64(reset)),
            ..Seen::default()
        }
    }

    #[test]
    fn learned_waits_are_bounded_by_an_hour_from_now_whoever_wrote_them() {
        // A state written before far resets were refused (review 4, R4-8), or by a host whose
        // clock is years ahead, holds nobody beyond the hour.
        let far = 32_472_144_000.0;
        let l = Limits {
            cooldown_until: far,
            reset_at: f64::INFINITY,
            remaining: Some(0),
            tokens_reset_at: f64::NAN,
            halve_after: far,
            in_flight: [99.0, far].map(|at| InFlight { at, by: None }).to_vec(),
            ..Limits::default()
        }
        .bounded(100.0);
        assert_eq!(l.cooldown_until, 3700.0);
        assert_eq!(l.reset_at, 3700.0);
        assert_eq!(l.tokens_reset_at, 0.0);
        assert_eq!(l.halve_after, 3700.0);
        assert_eq!(l.in_flight, vec![InFlight { at: 99.0, by: None }]);
        assert_eq!(l.wait(100.0), Some(3600.0));
        // What is within the hour is kept as it is.
        let near = Limits {
            cooldown_until: 160.0,
            ..Limits::default()
        };
        assert_eq!(near.clone().bounded(100.0), near);
    }

    #[test]
    fn a_rate_limit_cools_everyone_down_and_halves_the_cap_once() {
        let mut l = Limits {
            limit: MAX_LIMIT,
            ..Limits::default()
        };
        l.observe(&limited(Some(2.0)), 100.0, 8);
        assert_eq!(l.wait(100.5), Some(1.5));
        assert_eq!(l.limit, 4.0);
        // More 429s of the same burst: the cooldown may grow, the cap is not halved again.
        l.observe(&limited(Some(3.0)), 100.1, 8);
        assert_eq!(l.limit, 4.0);
        assert!((l.cooldown_until - 103.1).abs() < 1e-9);
        assert_eq!(l.wait(104.0), None);
        // The next episode halves again, never below 1.
        for t in [110.0, 120.0, 130.0, 140.0] {
            l.observe(&limited(None), t, 8);
        }
        assert_eq!(l.limit, 1.0);
        assert_eq!(l.limited, 6);
    }

    #[test]
    fn a_new_team_starts_slow_and_grows_with_each_answer_until_a_limit() {
        let mut l = Limits::default();
        assert_eq!(l.limit, START_LIMIT);
        for t in 0..4 {
            l.observe(&ok(None, 1.0), f64::from(t), 0);
        }
        assert_eq!(l.limit, START_LIMIT + 4.0);
        l.observe(&limited(Some(1.0)), 5.0, 5);
        assert_eq!(l.limit, 2.0);
        assert!(!l.slow_start);
        l.observe(&ok(None, 1.0), 6.5, 0);
        assert_eq!(l.limit, 2.0, "from here on, one more per quiet window");
    }

    #[test]
    fn quiet_windows_grow_the_cap_by_one() {
        let mut l = Limits {
            limit: MAX_LIMIT,
            slow_start: false,
            ..Limits::default()
        };
        l.observe(&limited(Some(1.0)), 0.0, 4);
        assert_eq!(l.limit, 2.0);
        l.observe(&ok(None, 1.0), 2.0, 0);
        assert_eq!(l.limit, 2.0, "not quiet long enough");
        l.observe(&ok(None, 1.0), 6.0, 0);
        assert_eq!(l.limit, 3.0);
        l.observe(&ok(None, 1.0), 7.0, 0);
        assert_eq!(l.limit, 3.0);
        l.observe(&ok(None, 1.0), 11.5, 0);
        assert_eq!(l.limit, 4.0);
    }

    #[test]
    fn pacing_spends_the_window_and_waits_for_its_reset() {
        let mut l = Limits::default();
        l.observe(&ok(Some(2), 1.0), 10.0, 0);
        assert_eq!(l.wait(10.1), None);
        l.spend(10.1, None);
        l.spend(10.2, None);
        assert_eq!(l.remaining, Some(0));
        assert!((l.wait(10.5).unwrap() - 0.5).abs() < 1e-9);
        // A late answer of the same window does not give back what was spent.
        l.observe(&ok(Some(1), 0.9), 10.1, 0);
        assert_eq!(l.remaining, Some(0));
        // The next window starts afresh, less what the others still in flight may take.
        assert_eq!(l.wait(11.0), None);
        l.observe(&ok(Some(5), 1.0), 11.0, 0);
        assert_eq!(l.remaining, Some(4), "one other attempt is in flight");
        l.ended(None);
        l.ended(None);
        assert!(l.in_flight.is_empty());
        l.observe(&ok(Some(5), 1.0), 12.5, 0);
        assert_eq!(l.remaining, Some(5));
    }

    #[test]
    fn pacing_by_tokens_waits_for_the_reset_before_a_call_would_not_fit() {
        let tokens = |left: u64, reset: f64| Seen {
            status: 200,
            remaining_tokens: Some(left),
            tokens_reset: Some(Duration::from_secs_f64(reset)),
            ..Seen::default()
        };
        let mut l = Limits::default();
        l.observe(&tokens(10_000, 10.0), 0.0, 0);
        assert_eq!(l.wait(0.1), None);
        l.spend(0.1, None);
        // The first drop seen is what a call takes.
        l.observe(&tokens(7_000, 9.8), 0.2, 1);
        assert_eq!(l.tokens_per_call, 3_000.0);
        l.ended(None);
        l.spend(0.3, None);
        l.spend(0.4, None);
        assert_eq!(l.tokens_left, Some(1_000.0));
        // Another call would not fit: wait for the window's reset.
        assert!((l.wait(0.5).unwrap() - 9.5).abs() < 1e-9);
        assert_eq!(l.wait(10.1), None);
        // A new window starts from what the provider says.
        l.observe(&tokens(10_000, 10.0), 10.2, 0);
        assert_eq!(l.tokens_left, Some(10_000.0));
        assert_eq!(l.wait(10.3), None);
    }

    #[test]
    fn an_attempts_entry_goes_with_its_end_or_its_holder() {
        // m1: a killed call's entry goes once its slot's holder is gone, not after 900 s.
        let mut l = Limits::default();
        l.spend(1.0, Some("a"));
        l.spend(2.0, Some("b"));
        l.spend(3.0, None);
        l.spend(4.0, Some("c"));
        l.ended(Some("b"));
        let by = |l: &Limits| -> Vec<Option<String>> {
            l.in_flight.iter().map(|e| e.by.clone()).collect()
        };
        assert_eq!(by(&l), [Some("a".into()), None, Some("c".into())]);
        let mut asked = Vec::new();
        l.drop_gone(|ids| {
            asked = ids.to_vec();
            Some(vec![false, true])
        });
        assert_eq!(asked, ["a", "c"]);
        assert_eq!(by(&l), [None, Some("c".to_owned())]);
        // A store that cannot tell drops nothing.
        l.drop_gone(|_| None);
        assert_eq!(l.in_flight.len(), 2);
        l.ended(None);
        l.ended(Some("c"));
        assert!(l.in_flight.is_empty());
        // A state an older version wrote (bare start times) still reads.
        let old: Limits = serde_json::from_str(
            r#"{"cooldown_until":0,"limit":2,"halve_after":0,"changed_at":0,
                "remaining":null,"reset_at":0,"limited":0,"in_flight":[5.5]}"#,
        )
        .unwrap();
        assert_eq!(old.in_flight, [InFlight { at: 5.5, by: None }]);
    }

    #[test]
    fn the_cap_is_the_models_and_the_teams_else_the_learned_one() {
        let mut cfg = TeamConfig::default();
        let l = Limits {
            limit: 3.0,
            ..Limits::default()
        };
        let of = |n: usize| Some(Cap::from(n));
        assert_eq!(cap(&cfg, "m", &l), of(3));
        cfg.rate_governor = Some(Mode::Off);
        assert_eq!(cap(&cfg, "m", &l), None);
        cfg.max_concurrent_calls = Some(5);
        assert_eq!(cap(&cfg, "m", &l), of(5));
        cfg.model_caps.insert("claude-opus".into(), 1);
        cfg.model_caps.insert("claude".into(), 2);
        // A model's cap counts its prefix's calls; the team's, still every call (R4-9).
        let both = |prefix: &str, n: usize| {
            Some(Cap {
                group: Some((prefix.to_owned(), n)),
                team: Some(5),
            })
        };
        assert_eq!(cap(&cfg, "claude-opus-4", &l), both("claude-opus", 1));
        assert_eq!(cap(&cfg, "claude-haiku", &l), both("claude", 2));
        assert_eq!(cap(&cfg, "gpt", &l), of(5));
        // Without the team's cap, a model of its own cap is under no other.
        cfg.max_concurrent_calls = None;
        cfg.rate_governor = None;
        let own = Cap {
            group: Some(("claude-opus".to_owned(), 1)),
            team: None,
        };
        assert_eq!(cap(&cfg, "claude-opus-4", &l), Some(own));
        assert_eq!(cap(&cfg, "gpt", &l), of(3));
    }
}
