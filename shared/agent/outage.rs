//! What a teammate does when its model call fails for good: the policy, as pure functions.
//!
//! A model API that stays down through a call's retries (DESIGN section 9) is an outage, not a
//! reason to exit: exiting would count toward the supervisor's restart limit, and an outage of
//! a minute would mark every teammate `failed`. So the teammate keeps its process and its
//! place, waits with a growing delay (capped at about 30 s), and tries again; messages that
//! arrive meanwhile wait in its inbox. A spend cap or an exhausted quota is different: trying
//! again will not help until a person acts, so the teammate pauses and makes no call until a new
//! message reaches it. Everything else (bad credentials, a request the API refuses) still ends
//! the process with its exit code.

use std::time::Duration;

use crate::llm::LlmError;

/// What to do after a model call failed through its retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnFailure {
    /// The API is down or overloaded: wait, then try again.
    Wait,
    /// A spend cap or exhausted quota: make no call until a new message arrives.
    Pause,
    /// Anything else: end the process with the error's exit code.
    Stop,
}

/// The policy for `e`.
pub fn on_failure(e: &LlmError) -> OnFailure {
    match e {
        LlmError::Unavailable { .. } => OnFailure::Wait,
        LlmError::Rejected { .. } if e.is_quota() => OnFailure::Pause,
        _ => OnFailure::Stop,
    }
}

/// The default longest wait between tries during an outage.
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(30);

/// The wait before the next try: `first` after the first failure, then twice the previous
/// wait, never more than `max`; `rand` in [0, 1) takes up to a quarter off, so teammates that
/// failed together do not all come back in the same instant.
pub fn next_wait(prev: Option<Duration>, first: Duration, max: Duration, rand: f64) -> Duration {
    let base = match prev {
        None => first,
        Some(p) => p.saturating_mul(2),
    }
    .min(max);
    base.mul_f64(1.0 - 0.25 * rand.clamp(0.0, 1.0))
}

/// The cap on waits from `TROUPE_API_WAIT_MAX_SECS` (seconds, fractions allowed), else
/// [`DEFAULT_MAX_WAIT`]. The worker takes the same setting as `--api-wait-max`.
pub fn max_wait_from_env() -> Duration {
    std::env::var("TROUPE_API_WAIT_MAX_SECS")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|s| (0.001..=86_400.0).contains(s))
        .map_or(DEFAULT_MAX_WAIT, Duration::from_secs_f64)
}

/// The first wait of an outage for a cap of `max`: a second, or the cap if it is shorter.
pub fn first_wait(max: Duration) -> Duration {
    max.min(Duration::from_secs(1))
}

/// `e` on one line, at most 300 characters: for `lead status`.
pub fn one_line(e: &LlmError) -> String {
    let text = e.to_string().replace(['\n', '\r'], " ");
    if text.chars().count() <= 300 {
        return text;
    }
    let mut cut: String = text.chars().take(299).collect();
    cut.push('…');
    cut
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rejected(status: u16, kind: &str) -> LlmError {
        LlmError::Rejected {
            status,
            kind: kind.into(),
            message: "m".into(),
        }
    }

    #[test]
    fn outages_wait_quotas_pause_the_rest_stop() {
        let down = LlmError::Unavailable {
            attempts: 3,
            last: "http 529".into(),
        };
        assert_eq!(on_failure(&down), OnFailure::Wait);
        assert_eq!(
            on_failure(&rejected(429, "enforced_spend_limit_reached")),
            OnFailure::Pause
        );
        assert_eq!(
            on_failure(&rejected(429, "insufficient_quota")),
            OnFailure::Pause
        );
        assert_eq!(
            on_failure(&rejected(402, "billing_error")),
            OnFailure::Pause
        );
        assert_eq!(
            on_failure(&rejected(400, "invalid_request_error")),
            OnFailure::Stop
        );
        let auth = LlmError::Auth {
            status: 401,
            message: "m".into(),
        };
        assert_eq!(on_failure(&auth), OnFailure::Stop);
        assert_eq!(on_failure(&LlmError::Config("x".into())), OnFailure::Stop);
    }

    #[test]
    fn waits_double_to_the_cap_with_jitter_below() {
        let max = DEFAULT_MAX_WAIT;
        let first = first_wait(max);
        let mut prev = None;
        let mut seen = Vec::new();
        for _ in 0..8 {
            let d = next_wait(prev, first, max, 0.0);
            seen.push(d.as_secs());
            prev = Some(d);
        }
        assert_eq!(seen, [1, 2, 4, 8, 16, 30, 30, 30]);
        // Jitter only shortens, by a quarter at most.
        let d = next_wait(Some(Duration::from_secs(8)), first, max, 0.999);
        assert!(
            d > Duration::from_secs(12) && d <= Duration::from_secs(16),
            "{d:?}"
        );
        // A cap below a second is the first wait too.
        let short = Duration::from_millis(200);
        assert_eq!(first_wait(short), short);
        assert_eq!(next_wait(None, first_wait(short), short, 0.0), short);
    }

    #[test]
    fn errors_fit_on_one_line() {
        let e = LlmError::Unavailable {
            attempts: 3,
            last: format!("http 503:\n{}", "x".repeat(1000)),
        };
        let line = one_line(&e);
        assert!(!line.contains('\n'));
        assert_eq!(line.chars().count(), 300);
    }
}
