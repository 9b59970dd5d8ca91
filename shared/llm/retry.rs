//! The retry policy of the official SDKs, as pure functions plus one small loop.
//!
//! The rules (REFERENCE.md, "Retry policy of the official SDKs"):
//!
//! - at most [`RetryPolicy::max_attempts`] attempts (default 3, i.e. 2 retries);
//! - retry connect errors, timeouts, broken or unparsable bodies, and the statuses 408, 409, 429
//!   and every 5xx (529 included);
//! - an `x-should-retry: true|false` header overrides the status, with one exception: 400, 401,
//!   403, 404, 413 and quota 429s (spend cap, `insufficient_quota`) are never retried, whatever
//!   the header says, because repeating them cannot succeed and may cost money;
//! - the delay is the server's `retry-after-ms`, else its `retry-after` (seconds or HTTP date),
//!   when that lies in (0, 60 s]; otherwise `min(base * 2^n, cap) * (1 - 0.25 * rand)` where `n`
//!   counts the retries already made, base 0.5 s and cap 8 s.
//!
//! Everything that decides is a pure function of its inputs (status, header values, the clock,
//! a random number), so unit tests check the arithmetic without sleeping. The loop in
//! `run` takes its sleep and its random source as parameters for the same reason.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tracing::warn;

use super::error::LlmError;

/// How often and how patiently to retry one model call.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Attempts in total, the first included. `TROUPE_LLM_MAX_ATTEMPTS`, default 3. A value of
    /// 0 is treated as 1.
    pub max_attempts: u32,
    /// Backoff before the first retry when the server gives no hint (0.5 s). Tests shrink it.
    pub backoff_base: Duration,
    /// Upper bound of the exponential backoff (8 s).
    pub backoff_cap: Duration,
    /// Longest server-requested delay honoured (60 s); longer or zero hints fall back to the
    /// backoff.
    pub max_retry_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 3,
            backoff_base: Duration::from_millis(500),
            backoff_cap: Duration::from_secs(8),
            max_retry_after: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// The client-side backoff before retry number `retries_so_far + 1`:
    /// `min(base * 2^retries_so_far, cap) * (1 - 0.25 * rand)`, `rand` in [0, 1].
    pub fn backoff(&self, retries_so_far: u32, rand: f64) -> Duration {
        let factor = 1u32.checked_shl(retries_so_far).unwrap_or(u32::MAX);
        let full = self
            .backoff_base
            .saturating_mul(factor)
            .min(self.backoff_cap);
        full.mul_f64(1.0 - 0.25 * rand.clamp(0.0, 1.0))
    }

    /// The delay before the next attempt: the server's hint when it gave a usable one (see
    /// [`server_delay`]), else [`RetryPolicy::backoff`].
    pub fn delay(&self, retries_so_far: u32, hint: Option<Duration>, rand: f64) -> Duration {
        hint.unwrap_or_else(|| self.backoff(retries_so_far, rand))
    }
}

/// Statuses that are transient by themselves: 408, 409, 429 and every 5xx.
pub fn status_is_transient(status: u16) -> bool {
    matches!(status, 408 | 409 | 429) || (500..=599).contains(&status)
}

/// Statuses that are never retried, whatever `x-should-retry` says.
pub fn status_never_retried(status: u16) -> bool {
    matches!(status, 400 | 401 | 403 | 404 | 413)
}

/// Whether a failed HTTP attempt should be retried, given its status, the raw
/// `x-should-retry` header and whether the error body names a quota (spend cap,
/// `insufficient_quota`).
pub fn should_retry_status(status: u16, x_should_retry: Option<&str>, quota: bool) -> bool {
    if quota || status_never_retried(status) {
        return false;
    }
    match x_should_retry.map(str::trim) {
        Some(v) if v.eq_ignore_ascii_case("true") => true,
        Some(v) if v.eq_ignore_ascii_case("false") => false,
        _ => status_is_transient(status),
    }
}

/// The delay the server asked for, if it is usable: `retry-after-ms` (milliseconds) first, else
/// `retry-after` (seconds, fractional allowed, or an HTTP date relative to `now`), and only when
/// the result lies in (0, `max`].
pub fn server_delay(
    retry_after_ms: Option<&str>,
    retry_after: Option<&str>,
    now: SystemTime,
    max: Duration,
) -> Option<Duration> {
    let hint = if let Some(ms) = retry_after_ms.and_then(|v| v.trim().parse::<f64>().ok()) {
        Duration::try_from_secs_f64(ms / 1000.0).ok()
    } else if let Some(value) = retry_after.map(str::trim) {
        match value.parse::<f64>() {
            Ok(secs) => Duration::try_from_secs_f64(secs).ok(),
            Err(_) => parse_http_date(value).and_then(|at| at.duration_since(now).ok()),
        }
    } else {
        None
    };
    hint.filter(|d| !d.is_zero() && *d <= max)
}

/// Parses an HTTP date in the IMF-fixdate form every current server sends
/// (`Sun, 06 Nov 1994 08:49:37 GMT`). The obsolete RFC 850 and asctime forms are not accepted;
/// a `retry-after` in those forms falls back to the backoff.
pub fn parse_http_date(value: &str) -> Option<SystemTime> {
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let (_weekday, rest) = value.trim().split_once(", ")?;
    let fields: Vec<&str> = rest.split_ascii_whitespace().collect();
    let [day, month, year, time, "GMT"] = fields.as_slice() else {
        return None;
    };
    let day: i64 = day.parse().ok()?;
    let month = MONTHS.iter().position(|m| m == month)? as i64 + 1;
    let year: i64 = year.parse().ok()?;
    let mut hms = time.split(':').map(|part| part.parse::<i64>().ok());
    let (Some(Some(h)), Some(Some(m)), Some(Some(s)), None) =
        (hms.next(), hms.next(), hms.next(), hms.next())
    else {
        return None;
    };
    if !(1..=31).contains(&day) || !(0..24).contains(&h) || !(0..60).contains(&m) {
        return None;
    }
    // 60 allows a leap second.
    if !(0..=60).contains(&s) {
        return None;
    }
    let secs = days_since_epoch(year, month, day) * 86_400 + h * 3_600 + m * 60 + s;
    let secs = u64::try_from(secs).ok()?;
    UNIX_EPOCH.checked_add(Duration::from_secs(secs))
}

/// Days from 1970-01-01 to the given proleptic Gregorian date. Counts in 400-year eras whose
/// years start in March, so the leap day falls at the end of each year.
pub(crate) fn days_since_epoch(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let month_from_march = (month + 9) % 12;
    let day_of_year = (153 * month_from_march + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    // 719_468 days separate 0000-03-01 from 1970-01-01.
    era * 146_097 + day_of_era - 719_468
}

/// A uniform random number in [0, 1) for the jitter, taken from a v4 UUID's random bits so the
/// crate needs no extra dependency.
pub(crate) fn random_unit() -> f64 {
    // The top 48 bits of a v4 UUID are all random (version and variant bits come later).
    let bits = (uuid::Uuid::new_v4().as_u128() >> 80) as u64;
    bits as f64 / (1u64 << 48) as f64
}

/// How one attempt failed, as seen by the retry loop.
#[derive(Debug)]
pub(crate) enum AttemptError {
    /// Stop now and return this error.
    Fatal(LlmError),
    /// Transient: retry when attempts remain, else end as [`LlmError::Unavailable`].
    Transient {
        /// What failed, for the log and for `Unavailable::last`.
        description: String,
        /// The server's usable delay hint, already checked by [`server_delay`].
        hint: Option<Duration>,
        request_id: Option<String>,
    },
}

/// Runs `attempt` (given the 1-based attempt number) until it succeeds, fails for good, or the
/// policy runs out of attempts. Logs a warning with the request id and attempt before each retry.
pub(crate) fn run<T>(
    policy: &RetryPolicy,
    provider: &str,
    sleep: &mut dyn FnMut(Duration),
    rand: &mut dyn FnMut() -> f64,
    mut attempt: impl FnMut(u32) -> Result<T, AttemptError>,
) -> Result<T, LlmError> {
    let max_attempts = policy.max_attempts.max(1);
    let mut number = 1;
    loop {
        match attempt(number) {
            Ok(value) => return Ok(value),
            Err(AttemptError::Fatal(error)) => return Err(error),
            Err(AttemptError::Transient {
                description,
                hint,
                request_id,
            }) => {
                if number >= max_attempts {
                    return Err(LlmError::Unavailable {
                        attempts: number,
                        last: description,
                    });
                }
                let delay = policy.delay(number - 1, hint, rand());
                warn!(
                    provider,
                    attempt = number,
                    max_attempts,
                    request_id = request_id.as_deref().unwrap_or("-"),
                    delay_ms = delay.as_millis() as u64,
                    error = %description,
                    "llm call failed, retrying"
                );
                sleep(delay);
                number += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Duration = Duration::from_secs(60);

    #[test]
    fn transient_statuses_are_retried() {
        for status in [408, 409, 429, 500, 502, 503, 504, 529] {
            assert!(should_retry_status(status, None, false), "{status}");
        }
        for status in [400, 401, 402, 403, 404, 413, 422] {
            assert!(!should_retry_status(status, None, false), "{status}");
        }
    }

    #[test]
    fn x_should_retry_overrides_the_status_but_not_the_never_list() {
        assert!(!should_retry_status(500, Some("false"), false));
        assert!(!should_retry_status(529, Some(" FALSE "), false));
        assert!(should_retry_status(422, Some("true"), false));
        assert!(should_retry_status(402, Some("true"), false));
        for status in [400, 401, 403, 404, 413] {
            assert!(
                !should_retry_status(status, Some("true"), false),
                "{status}"
            );
        }
        assert!(should_retry_status(500, Some("maybe"), false));
    }

    #[test]
    fn quota_429s_are_never_retried() {
        assert!(!should_retry_status(429, None, true));
        assert!(!should_retry_status(429, Some("true"), true));
    }

    #[test]
    fn backoff_doubles_from_half_a_second_up_to_eight() {
        let p = RetryPolicy::default();
        assert_eq!(p.backoff(0, 0.0), Duration::from_millis(500));
        assert_eq!(p.backoff(1, 0.0), Duration::from_secs(1));
        assert_eq!(p.backoff(2, 0.0), Duration::from_secs(2));
        assert_eq!(p.backoff(4, 0.0), Duration::from_secs(8));
        assert_eq!(p.backoff(5, 0.0), Duration::from_secs(8));
        assert_eq!(p.backoff(200, 0.0), Duration::from_secs(8));
    }

    #[test]
    fn jitter_takes_off_at_most_a_quarter() {
        let p = RetryPolicy::default();
        assert_eq!(p.backoff(0, 1.0), Duration::from_millis(375));
        assert_eq!(p.backoff(4, 0.5), Duration::from_secs(7));
        // Out-of-range random numbers are clamped.
        assert_eq!(p.backoff(0, 7.0), Duration::from_millis(375));
        for _ in 0..1000 {
            let r = random_unit();
            assert!((0.0..1.0).contains(&r));
            let d = p.backoff(1, r);
            assert!(d > Duration::from_millis(750) && d <= Duration::from_secs(1));
        }
    }

    #[test]
    fn retry_after_ms_wins_over_retry_after() {
        let now = SystemTime::now();
        assert_eq!(
            server_delay(Some("10"), Some("5"), now, MAX),
            Some(Duration::from_millis(10))
        );
        assert_eq!(
            server_delay(Some("1500.5"), None, now, MAX),
            Some(Duration::from_micros(1_500_500))
        );
    }

    #[test]
    fn retry_after_seconds_must_lie_in_the_window() {
        let now = SystemTime::now();
        assert_eq!(
            server_delay(None, Some("1"), now, MAX),
            Some(Duration::from_secs(1))
        );
        assert_eq!(
            server_delay(None, Some("60"), now, MAX),
            Some(Duration::from_secs(60))
        );
        assert_eq!(server_delay(None, Some("61"), now, MAX), None);
        assert_eq!(server_delay(None, Some("0"), now, MAX), None);
        assert_eq!(server_delay(None, Some("-3"), now, MAX), None);
        assert_eq!(server_delay(None, Some("soon"), now, MAX), None);
        assert_eq!(server_delay(Some("0"), Some("2"), now, MAX), None);
        assert_eq!(server_delay(None, None, now, MAX), None);
    }

    #[test]
    fn retry_after_http_date_is_relative_to_now() {
        let now = UNIX_EPOCH + Duration::from_secs(784_111_777 - 30);
        assert_eq!(
            server_delay(None, Some("Sun, 06 Nov 1994 08:49:37 GMT"), now, MAX),
            Some(Duration::from_secs(30))
        );
        // A date in the past or too far ahead falls back to the backoff.
        let later = now + Duration::from_secs(31);
        assert_eq!(
            server_delay(None, Some("Sun, 06 Nov 1994 08:49:37 GMT"), later, MAX),
            None
        );
        let early = now - Duration::from_secs(3600);
        assert_eq!(
            server_delay(None, Some("Sun, 06 Nov 1994 08:49:37 GMT"), early, MAX),
            None
        );
    }

    #[test]
    fn http_dates_parse() {
        let at = |s: &str| {
            parse_http_date(s).and_then(|t| t.duration_since(UNIX_EPOCH).ok().map(|d| d.as_secs()))
        };
        assert_eq!(at("Sun, 06 Nov 1994 08:49:37 GMT"), Some(784_111_777));
        assert_eq!(at("Thu, 01 Jan 1970 00:00:00 GMT"), Some(0));
        assert_eq!(at("Tue, 29 Feb 2028 23:59:59 GMT"), Some(1_835_481_599));
        assert_eq!(at("Sat, 01 Mar 2025 12:00:00 GMT"), Some(1_740_830_400));
        assert_eq!(at("Sunday, 06-Nov-94 08:49:37 GMT"), None);
        assert_eq!(at("Sun Nov  6 08:49:37 1994"), None);
        assert_eq!(at("Sun, 06 Nov 1994 08:49:37 PST"), None);
        assert_eq!(at("Sun, 06 Nov 1994 24:00:00 GMT"), None);
        assert_eq!(at("Sun, 06 Nov 1994 08:49 GMT"), None);
    }

    fn transient(hint: Option<Duration>) -> AttemptError {
        AttemptError::Transient {
            description: "http 529 overloaded_error: Overloaded".into(),
            hint,
            request_id: Some("req_1".into()),
        }
    }

    #[test]
    fn loop_retries_transient_errors_with_the_computed_delays() {
        let policy = RetryPolicy::default();
        let mut slept = Vec::new();
        let mut calls = 0;
        let result = run(&policy, "test", &mut |d| slept.push(d), &mut || 0.0, |n| {
            calls += 1;
            match n {
                1 => Err(transient(None)),
                2 => Err(transient(Some(Duration::from_millis(10)))),
                _ => Ok(n),
            }
        });
        assert_eq!(result.ok(), Some(3));
        assert_eq!(calls, 3);
        assert_eq!(
            slept,
            vec![Duration::from_millis(500), Duration::from_millis(10)]
        );
    }

    #[test]
    fn loop_gives_up_after_max_attempts() {
        let policy = RetryPolicy::default();
        let mut slept = Vec::new();
        let result: Result<(), _> =
            run(&policy, "test", &mut |d| slept.push(d), &mut || 1.0, |_| {
                Err(transient(None))
            });
        match result {
            Err(LlmError::Unavailable { attempts, last }) => {
                assert_eq!(attempts, 3);
                assert!(last.contains("529"), "{last}");
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(
            slept,
            vec![Duration::from_millis(375), Duration::from_millis(750)]
        );
    }

    #[test]
    fn loop_stops_at_once_on_fatal_errors() {
        let policy = RetryPolicy {
            max_attempts: 5,
            ..RetryPolicy::default()
        };
        let mut calls = 0;
        let result: Result<(), _> = run(&policy, "test", &mut |_| {}, &mut || 0.0, |_| {
            calls += 1;
            Err(AttemptError::Fatal(LlmError::Auth {
                status: 401,
                message: "invalid x-api-key".into(),
            }))
        });
        assert!(matches!(result, Err(LlmError::Auth { status: 401, .. })));
        assert_eq!(calls, 1);
    }

    #[test]
    fn zero_max_attempts_still_makes_one() {
        let policy = RetryPolicy {
            max_attempts: 0,
            ..RetryPolicy::default()
        };
        let mut calls = 0;
        let result: Result<(), _> = run(&policy, "test", &mut |_| {}, &mut || 0.0, |_| {
            calls += 1;
            Err(transient(None))
        });
        assert!(matches!(
            result,
            Err(LlmError::Unavailable { attempts: 1, .. })
        ));
        assert_eq!(calls, 1);
    }
}
