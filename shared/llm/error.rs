//! The one error type of the LLM clients, and how each failure maps to a process exit code.
//!
//! Every variant says what failed in lowercase words and carries what a user needs to act on it
//! (HTTP status, the API's error kind, the request id when the server sent one). None of them ever
//! contains an API key: keys live only in request headers marked sensitive, and error bodies are
//! the server's own words.

use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;

/// Exit status for a configuration error (sysexits `EX_CONFIG`): the supervisor does not restart.
pub const EXIT_CONFIG: u8 = 78;
/// Exit status for a transient failure (sysexits `EX_TEMPFAIL`): the supervisor restarts with
/// backoff.
pub const EXIT_TEMPFAIL: u8 = 75;
/// Exit status for any other failure.
pub const EXIT_FAILURE: u8 = 1;

/// Why a model call failed.
///
/// [`LlmError::exit_code`] maps each variant to the worker exit codes of DESIGN.md section 7:
///
/// | variant | exit |
/// | --- | --- |
/// | [`Config`](LlmError::Config) (no key, unknown provider, unreadable cassette) | 78 |
/// | [`Auth`](LlmError::Auth) (401/403) | 78 |
/// | [`Rejected`](LlmError::Rejected) for a quota: spend cap, `insufficient_quota`, 402 billing | 75 |
/// | [`Rejected`](LlmError::Rejected) otherwise (400, 404, 413, ...) | 1 |
/// | [`Unavailable`](LlmError::Unavailable) (transient errors outlasted the retries) | 75 |
/// | [`InvalidResponse`](LlmError::InvalidResponse) (only outside the retry loop) | 1 |
/// | [`CassetteExhausted`](LlmError::CassetteExhausted) (the run left its recording) | 78 |
/// | [`Record`](LlmError::Record) (could not append to the `--record` file) | 1 |
/// | [`ReplayOutOfOrder`](LlmError::ReplayOutOfOrder) (an earlier turn of an ordered replay never came) | 1 |
/// | [`ReplayProgress`](LlmError::ReplayProgress) (could not read or append to the progress file) | 1 |
#[derive(Debug, Error)]
pub enum LlmError {
    /// The provider cannot be set up: missing key, unknown provider, unreadable cassette, bad
    /// numeric setting. The message names the variable or file to fix.
    #[error("llm configuration error: {0}")]
    Config(String),

    /// The API refused the credentials (401) or their permissions (403). Never retried.
    #[error("llm api rejected the credentials (http {status}): {message}")]
    Auth { status: u16, message: String },

    /// The API refused this request for good: malformed (400), unknown model (404), too large
    /// (413), billing (402), a spend cap or exhausted quota (429). Never retried. `kind` is the
    /// API's error type or code (`invalid_request_error`, `enforced_spend_limit_reached`,
    /// `insufficient_quota`, ...).
    #[error("llm api rejected the request (http {status}, {kind}): {message}")]
    Rejected {
        status: u16,
        kind: String,
        message: String,
    },

    /// Transient failures (connect errors, timeouts, 408/409/429/5xx, broken bodies) lasted
    /// through every attempt, or the server said not to retry one. `last` describes the final one.
    #[error("llm api unavailable after {attempts} attempt(s): {last}")]
    Unavailable { attempts: u32, last: String },

    /// A response body that is not the documented JSON (truncated, missing fields). Inside the
    /// retry loop this counts as transient and, if it persists, ends as `Unavailable`.
    #[error("invalid response from llm api: {0}")]
    InvalidResponse(String),

    /// The replay cassette holds no response for this agent's call number `seq`.
    #[error("cassette has no response for agent {agent:?} call {seq}")]
    CassetteExhausted { agent: String, seq: u64 },

    /// A call succeeded but could not be appended to the recording file.
    #[error("failed to append to cassette {}", path.display())]
    Record {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// Ordered replay (`TROUPE_REPLAY_PROGRESS`): call `seq` of `agent`, recorded as `turn`,
    /// waited `waited` for the earlier `missing_turn` (call `missing_seq` of `missing_agent`)
    /// without it being served. The run left its recording (that agent never made that call) or
    /// the process that should have made it died.
    #[error(
        "replay out of order: {agent} call {seq} (turn {turn}) waited {} s for turn {missing_turn} ({missing_agent} call {missing_seq})",
        .waited.as_secs_f64()
    )]
    ReplayOutOfOrder {
        agent: String,
        seq: u64,
        turn: u64,
        waited: Duration,
        missing_turn: u64,
        missing_agent: String,
        missing_seq: u64,
    },

    /// The team's fence refused a write this process needed before its call (the governor's
    /// queue or slot, on a bus): a newer incarnation replaced it (`code` 79) or its fence key
    /// is gone (75). Never retried, and no call goes out ungoverned: the process ends with
    /// `code` (see `crate::store::fence`).
    #[error("{message}")]
    Fenced { code: u8, message: String },

    /// The progress file of an ordered replay could not be read or appended to.
    #[error("failed to read or append to replay progress file {}", path.display())]
    ReplayProgress {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl LlmError {
    /// The process exit code a worker should end with when this error stops it (see the table on
    /// [`LlmError`]).
    pub fn exit_code(&self) -> u8 {
        match self {
            LlmError::Config(_) | LlmError::Auth { .. } | LlmError::CassetteExhausted { .. } => {
                EXIT_CONFIG
            }
            LlmError::Rejected { .. } if self.is_quota() => EXIT_TEMPFAIL,
            LlmError::Unavailable { .. } => EXIT_TEMPFAIL,
            LlmError::Fenced { code, .. } => *code,
            LlmError::Rejected { .. }
            | LlmError::InvalidResponse(_)
            | LlmError::Record { .. }
            | LlmError::ReplayOutOfOrder { .. }
            | LlmError::ReplayProgress { .. } => EXIT_FAILURE,
        }
    }

    /// True for a rejection caused by money rather than by the request: a spend cap, an
    /// exhausted quota or a billing error. Retrying now does not help; later it may.
    pub fn is_quota(&self) -> bool {
        match self {
            LlmError::Rejected { status, kind, .. } => {
                *status == 402 || is_quota_kind(kind) || kind == "billing_error"
            }
            _ => false,
        }
    }
}

/// The error kinds that mark a 429 as a quota problem instead of a rate limit.
pub(crate) fn is_quota_kind(kind: &str) -> bool {
    kind == "enforced_spend_limit_reached" || kind == "insufficient_quota"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_the_documented_mapping() {
        let rejected = |status: u16, kind: &str| LlmError::Rejected {
            status,
            kind: kind.to_string(),
            message: "m".to_string(),
        };
        assert_eq!(LlmError::Config("x".into()).exit_code(), 78);
        let auth = LlmError::Auth {
            status: 401,
            message: "m".into(),
        };
        assert_eq!(auth.exit_code(), 78);
        assert_eq!(
            rejected(429, "enforced_spend_limit_reached").exit_code(),
            75
        );
        assert_eq!(rejected(429, "insufficient_quota").exit_code(), 75);
        assert_eq!(rejected(402, "billing_error").exit_code(), 75);
        assert_eq!(rejected(400, "invalid_request_error").exit_code(), 1);
        assert_eq!(rejected(404, "not_found_error").exit_code(), 1);
        let unavailable = LlmError::Unavailable {
            attempts: 3,
            last: "x".into(),
        };
        assert_eq!(unavailable.exit_code(), 75);
        let exhausted = LlmError::CassetteExhausted {
            agent: "a".into(),
            seq: 1,
        };
        assert_eq!(exhausted.exit_code(), 78);
        assert_eq!(LlmError::InvalidResponse("x".into()).exit_code(), 1);
        let fenced = |code| LlmError::Fenced {
            code,
            message: "m".into(),
        };
        assert_eq!((fenced(79).exit_code(), fenced(75).exit_code()), (79, 75));
        assert_eq!(out_of_order().exit_code(), 1);
        let progress = LlmError::ReplayProgress {
            path: "p".into(),
            source: std::io::Error::other("x"),
        };
        assert_eq!(progress.exit_code(), 1);
    }

    fn out_of_order() -> LlmError {
        LlmError::ReplayOutOfOrder {
            agent: "coder".into(),
            seq: 3,
            turn: 12,
            waited: Duration::from_secs(60),
            missing_turn: 11,
            missing_agent: "tester".into(),
            missing_seq: 2,
        }
    }

    #[test]
    fn messages_are_lowercase_and_say_what_failed() {
        let e = LlmError::Rejected {
            status: 400,
            kind: "invalid_request_error".into(),
            message: "max_tokens: field required".into(),
        };
        assert_eq!(
            e.to_string(),
            "llm api rejected the request (http 400, invalid_request_error): max_tokens: field required"
        );
        let e = LlmError::CassetteExhausted {
            agent: "alice".into(),
            seq: 7,
        };
        assert_eq!(
            e.to_string(),
            "cassette has no response for agent \"alice\" call 7"
        );
        assert_eq!(
            out_of_order().to_string(),
            "replay out of order: coder call 3 (turn 12) waited 60 s for turn 11 (tester call 2)"
        );
    }
}
