//! The gate every model call of this process passes through, attempt by attempt: where a
//! team's governor (see `crate::governor`) waits out a cooldown the team learned, takes one
//! of the team's call slots, and hears what each answer said about the provider's limits.
//! The LLM layer knows no team: a process installs its gate once ([`install`]); without one
//! every attempt goes straight through.
//!
//! What an answer says ([`Seen`]) is read from its headers by pure functions here:
//! `retry-after` (seconds or an HTTP date) and `retry-after-ms`; Anthropic's
//! `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{remaining,reset}` (the
//! resets as RFC 3339 times); OpenAI's `x-ratelimit-{remaining,reset}-{requests,tokens}` (the
//! resets as durations such as `6m0s`, `1.5s` or `20ms`).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use reqwest::header::HeaderMap;

/// What one answer said about the endpoint's limits.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Seen {
    pub status: u16,
    /// A rate limit or overload answer (429, 529, 503 overloaded) that is not about quota.
    pub limited: bool,
    /// A 429 about quota or billing: not the team's cooldown (the member pauses).
    pub quota: bool,
    /// The wait the answer asked for: `retry-after`, else the reset of an exhausted limit.
    pub wait: Option<Duration>,
    /// Requests left in the provider's current window, and when it resets.
    pub remaining_requests: Option<u64>,
    pub requests_reset: Option<Duration>,
    /// Tokens left (the smallest of those given), and when that limit resets.
    pub remaining_tokens: Option<u64>,
    pub tokens_reset: Option<Duration>,
}

/// A process's gate (see the module doc).
pub trait Gate: Send + Sync {
    /// Before an attempt at `endpoint` (a fingerprint of URL and key), for `model`: waits as
    /// the team's limits say and returns what holds the attempt's slot until it is dropped.
    /// While it waits it calls [`still_waiting`] at least every [`BEAT_EVERY`]. `Err`: the
    /// attempt may not go at all ([`super::LlmError::Fenced`]).
    fn enter(&self, endpoint: &str, model: &str) -> Result<Box<dyn Send + '_>, super::LlmError>;
    /// What the attempt's answer said.
    fn observe(&self, endpoint: &str, seen: &Seen);
}

static GATE: OnceLock<Box<dyn Gate>> = OnceLock::new();

/// The longest a gate's wait goes without calling [`still_waiting`].
pub const BEAT_EVERY: Duration = Duration::from_secs(1);

/// What a wait at the gate calls as it goes on (a worker's heartbeat: a member waiting out a
/// cooldown or for a slot is not hung).
static WAITING: OnceLock<Box<dyn Fn() + Send + Sync>> = OnceLock::new();

/// Has `f` called at least every [`BEAT_EVERY`] while an attempt of this process waits at its
/// gate, on the waiting thread (a process stopped there calls it no more); the first one
/// given stays.
pub fn on_still_waiting(f: impl Fn() + Send + Sync + 'static) {
    let _ = WAITING.set(Box::new(f));
}

/// Called by a gate's wait, at least every [`BEAT_EVERY`] (see [`on_still_waiting`]).
pub fn still_waiting() {
    if let Some(f) = WAITING.get() {
        f();
    }
}

/// Microseconds this process's calls waited at its gate since [`take_waited`] last read them.
static WAITED_MICROS: AtomicU64 = AtomicU64::new(0);

/// Notes that an attempt waited `d` at the gate (for a slot or a cooldown).
pub fn note_waited(d: Duration) {
    WAITED_MICROS.fetch_add(d.as_micros() as u64, Ordering::Relaxed);
}

/// How long this process's calls waited at the gate since the last call of this, which
/// starts the count again (a member's journal records it per model call).
pub fn take_waited() -> Duration {
    Duration::from_micros(WAITED_MICROS.swap(0, Ordering::Relaxed))
}

/// Installs this process's gate; false if one was installed already.
pub fn install(gate: Box<dyn Gate>) -> bool {
    GATE.set(gate).is_ok()
}

pub(crate) fn current() -> Option<&'static dyn Gate> {
    GATE.get().map(|g| &**g)
}

/// The fingerprint of an endpoint and key: 16 hex digits of a one-way hash, never the key.
pub fn fingerprint(url: &str, key: &str) -> String {
    let id = crate::ids::derived(&format!("{url}\n{key}"))
        .simple()
        .to_string();
    id[..16].to_owned()
}

/// The longest wait an answer's headers may set (`retry-after`, or the reset of a limit with
/// nothing left): one beyond it is not taken, and the governor's learned state never holds a
/// wait longer than this from now (see [`crate::governor::Limits::bounded`]).
pub const MAX_SERVER_WAIT: Duration = Duration::from_secs(3600);

/// Reads what the answer `status` with `headers` says; `quota` is the error body's verdict.
pub fn seen(status: u16, headers: &HeaderMap, quota: bool, now: SystemTime) -> Seen {
    let h = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let overloaded = status == 529 || status == 503;
    let limited = (status == 429 && !quota) || overloaded;
    let mut s = Seen {
        status,
        limited,
        quota: status == 429 && quota,
        ..Seen::default()
    };
    let num = |name: &str| h(name).and_then(|v| v.trim().parse::<u64>().ok());
    // A reset further away than a server may make anyone wait (a proxy's placeholder, a clock
    // far off) is not taken: like a `retry-after` beyond it, it is as if not sent.
    let at = |name: &str| {
        h(name)
            .and_then(parse_rfc3339)
            .map(|t| t.duration_since(now).unwrap_or_default())
            .filter(|d| *d <= MAX_SERVER_WAIT)
    };
    let dur = |name: &str| {
        h(name)
            .and_then(parse_go_duration)
            .filter(|d| *d <= MAX_SERVER_WAIT)
    };
    // Requests.
    s.remaining_requests = num("anthropic-ratelimit-requests-remaining")
        .or_else(|| num("x-ratelimit-remaining-requests"));
    s.requests_reset =
        at("anthropic-ratelimit-requests-reset").or_else(|| dur("x-ratelimit-reset-requests"));
    // Tokens: the tightest of those given.
    let tokens = [
        (
            num("anthropic-ratelimit-tokens-remaining"),
            at("anthropic-ratelimit-tokens-reset"),
        ),
        (
            num("anthropic-ratelimit-input-tokens-remaining"),
            at("anthropic-ratelimit-input-tokens-reset"),
        ),
        (
            num("anthropic-ratelimit-output-tokens-remaining"),
            at("anthropic-ratelimit-output-tokens-reset"),
        ),
        (
            num("x-ratelimit-remaining-tokens"),
            dur("x-ratelimit-reset-tokens"),
        ),
    ];
    if let Some((r, reset)) = tokens
        .into_iter()
        .filter_map(|(r, reset)| Some((r?, reset)))
        .min_by_key(|(r, _)| *r)
    {
        s.remaining_tokens = Some(r);
        s.tokens_reset = reset;
    }
    if limited {
        let exhausted = [
            (s.remaining_requests, s.requests_reset),
            (s.remaining_tokens, s.tokens_reset),
        ]
        .into_iter()
        .filter(|(r, _)| *r == Some(0))
        .filter_map(|(_, reset)| reset)
        .max();
        s.wait =
            super::retry::server_delay(h("retry-after-ms"), h("retry-after"), now, MAX_SERVER_WAIT)
                .or(exhausted);
    }
    s
}

/// A Go-style duration as OpenAI's reset headers send it: `1s`, `6m0s`, `1h2m3.5s`, `20ms`.
pub fn parse_go_duration(v: &str) -> Option<Duration> {
    let mut rest = v.trim();
    if rest.is_empty() {
        return None;
    }
    let mut total = 0.0f64;
    while !rest.is_empty() {
        let n_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let n: f64 = rest[..n_end].parse().ok()?;
        rest = &rest[n_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_end] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        rest = &rest[unit_end..];
        total += n * scale;
    }
    Duration::try_from_secs_f64(total).ok()
}

/// An RFC 3339 time as Anthropic's reset headers send it: `2026-12-05T01:10:00Z`, with an
/// optional fraction and a `Z` or `±HH:MM` offset.
pub fn parse_rfc3339(v: &str) -> Option<SystemTime> {
    let v = v.trim();
    let (date, time) = v.split_once(['T', 't'])?;
    let mut d = date.split('-').map(|p| p.parse::<i64>().ok());
    let (Some(Some(y)), Some(Some(mo)), Some(Some(day)), None) =
        (d.next(), d.next(), d.next(), d.next())
    else {
        return None;
    };
    let (clock, offset) = if let Some(c) = time.strip_suffix(['Z', 'z']) {
        (c, 0i64)
    } else {
        let i = time.rfind(['+', '-'])?;
        let (c, off) = time.split_at(i);
        let sign = if off.starts_with('-') { -1 } else { 1 };
        let (oh, om) = off[1..].split_once(':')?;
        (
            c,
            sign * (oh.parse::<i64>().ok()? * 3600 + om.parse::<i64>().ok()? * 60),
        )
    };
    let mut t = clock.split(':');
    let (Some(h), Some(m), Some(s), None) = (t.next(), t.next(), t.next(), t.next()) else {
        return None;
    };
    let (h, m): (i64, i64) = (h.parse().ok()?, m.parse().ok()?);
    let s: f64 = s.parse().ok()?;
    if !(1..=12).contains(&mo) || !(1..=31).contains(&day) || !(0..24).contains(&h) {
        return None;
    }
    let secs = super::retry::days_since_epoch(y, mo, day) * 86_400 + h * 3600 + m * 60 - offset;
    let whole = u64::try_from(secs).ok()?;
    UNIX_EPOCH
        .checked_add(Duration::from_secs(whole))?
        .checked_add(Duration::try_from_secs_f64(s).ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::{HeaderName, HeaderValue};

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn go_durations_as_openai_sends_them() {
        assert_eq!(parse_go_duration("6m0s"), Some(Duration::from_secs(360)));
        assert_eq!(parse_go_duration("20ms"), Some(Duration::from_millis(20)));
        assert_eq!(parse_go_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_go_duration("1h2m3s"), Some(Duration::from_secs(3723)));
        assert_eq!(parse_go_duration(""), None);
        assert_eq!(parse_go_duration("5 parsecs"), None);
    }

    #[test]
    fn rfc3339_times_as_anthropic_sends_them() {
        let t = |s: &str| parse_rfc3339(s).map(|t| t.duration_since(UNIX_EPOCH).unwrap());
        assert_eq!(t("1970-01-01T00:01:00Z"), Some(Duration::from_secs(60)));
        assert_eq!(
            t("2026-12-05T01:10:00.5Z"),
            Some(Duration::from_millis(1_796_433_000_500))
        );
        assert_eq!(t("2026-12-05T02:10:00+01:00"), t("2026-12-05T01:10:00Z"));
        assert_eq!(t("yesterday"), None);
    }

    #[test]
    fn a_reset_further_than_an_hour_is_not_taken() {
        // Review 4, R4-8: one answer naming the year 2999 set the team's cooldown to it.
        let now = UNIX_EPOCH + Duration::from_secs(1_796_000_000);
        for (remaining, reset, value) in [
            (
                "anthropic-ratelimit-requests-remaining",
                "anthropic-ratelimit-requests-reset",
                "2999-01-01T00:00:00Z",
            ),
            (
                "x-ratelimit-remaining-requests",
                "x-ratelimit-reset-requests",
                "100000h",
            ),
            (
                "x-ratelimit-remaining-tokens",
                "x-ratelimit-reset-tokens",
                "3601s",
            ),
        ] {
            for status in [429, 200] {
                let s = seen(
                    status,
                    &headers(&[(remaining, "0"), (reset, value)]),
                    false,
                    now,
                );
                assert_eq!(s.requests_reset, None, "{reset}: {value}");
                assert_eq!(s.tokens_reset, None, "{reset}: {value}");
                assert!(s.wait.is_none_or(|w| w <= MAX_SERVER_WAIT), "{s:?}");
            }
        }
        // An hour exactly is still taken.
        let s = seen(
            429,
            &headers(&[
                ("x-ratelimit-remaining-requests", "0"),
                ("x-ratelimit-reset-requests", "1h"),
            ]),
            false,
            now,
        );
        assert_eq!(s.wait, Some(MAX_SERVER_WAIT));
    }

    #[test]
    fn a_429_waits_for_retry_after_else_for_the_exhausted_limits_reset() {
        let now = UNIX_EPOCH + Duration::from_secs(1_000);
        let s = seen(429, &headers(&[("retry-after", "3")]), false, now);
        assert!(s.limited && !s.quota);
        assert_eq!(s.wait, Some(Duration::from_secs(3)));
        let s = seen(
            429,
            &headers(&[
                ("x-ratelimit-remaining-requests", "0"),
                ("x-ratelimit-reset-requests", "1.5s"),
                ("x-ratelimit-remaining-tokens", "900"),
                ("x-ratelimit-reset-tokens", "6m0s"),
            ]),
            false,
            now,
        );
        assert_eq!(s.wait, Some(Duration::from_millis(1500)));
        assert_eq!(s.remaining_tokens, Some(900));
        // Anthropic's resets are times.
        let s = seen(
            429,
            &headers(&[
                ("anthropic-ratelimit-requests-remaining", "0"),
                ("anthropic-ratelimit-requests-reset", "1970-01-01T00:16:50Z"),
            ]),
            false,
            now,
        );
        assert_eq!(s.wait, Some(Duration::from_secs(10)));
        // Quota is not the team's cooldown; an overload is.
        let s = seen(429, &headers(&[("retry-after", "3")]), true, now);
        assert!(s.quota && !s.limited);
        assert!(seen(529, &HeaderMap::new(), false, now).limited);
        // A success still tells what is left.
        let s = seen(
            200,
            &headers(&[("anthropic-ratelimit-requests-remaining", "4")]),
            false,
            now,
        );
        assert_eq!(
            (s.limited, s.remaining_requests, s.wait),
            (false, Some(4), None)
        );
    }

    #[test]
    fn a_fingerprint_hides_the_key() {
        let f = fingerprint("https://api.example/v1/messages", "sk-secret-123");
        assert_eq!(f.len(), 16);
        assert!(!f.contains("secret"));
        assert_ne!(
            f,
            fingerprint("https://api.example/v1/messages", "sk-other")
        );
    }
}
