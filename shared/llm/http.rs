//! HTTP plumbing shared by the `anthropic` and `openai` providers: settings, the reqwest client,
//! and one POST turned into either a parsed body or an [`LlmError`], retried per [`retry`].
//!
//! The providers only build the JSON body and parse the replies; how a status, a header or a
//! transport failure is classified lives here, once.
//!
//! [`retry`]: super::retry

use std::sync::Once;
use std::time::{Duration, SystemTime};

use reqwest::blocking::Client;
use reqwest::header::HeaderMap;
use tracing::debug;

use super::error::{LlmError, is_quota_kind};
use super::retry::{self, AttemptError, RetryPolicy};

/// Default whole-request timeout, as the official SDKs (10 minutes: long generations are slow).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);
/// Default connect timeout.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Transport settings of an HTTP provider.
#[derive(Debug, Clone, PartialEq)]
pub struct HttpConfig {
    /// Whole-request timeout, body included. `TROUPE_LLM_TIMEOUT_SECS`, default 600 s.
    pub timeout: Duration,
    /// TCP connect timeout, 5 s.
    pub connect_timeout: Duration,
    /// Attempts and delays. `TROUPE_LLM_MAX_ATTEMPTS` sets `max_attempts`.
    pub retry: RetryPolicy,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            timeout: DEFAULT_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            retry: RetryPolicy::default(),
        }
    }
}

impl HttpConfig {
    /// The longest a call may take: every attempt to its timeout (which counts the connect
    /// too), and the longest wait the retry rules allow between two (a server's hint, up to
    /// 60 s).
    pub fn longest_call(&self) -> Duration {
        let attempts = self.retry.max_attempts.max(1);
        self.timeout.saturating_mul(attempts) + Duration::from_secs(60).saturating_mul(attempts - 1)
    }

    /// Reads `TROUPE_LLM_TIMEOUT_SECS` and `TROUPE_LLM_MAX_ATTEMPTS` through `vars` (unset or
    /// empty means the default); a value that is not a positive number is a config error.
    pub fn from_vars(vars: &dyn Fn(&str) -> Option<String>) -> Result<Self, LlmError> {
        let mut config = HttpConfig::default();
        if let Some(secs) = positive_number(vars, "TROUPE_LLM_TIMEOUT_SECS")? {
            config.timeout = Duration::from_secs(secs);
        }
        if let Some(attempts) = positive_number(vars, "TROUPE_LLM_MAX_ATTEMPTS")? {
            config.retry.max_attempts = u32::try_from(attempts).unwrap_or(u32::MAX);
        }
        Ok(config)
    }
}

fn positive_number(
    vars: &dyn Fn(&str) -> Option<String>,
    name: &str,
) -> Result<Option<u64>, LlmError> {
    let Some(raw) = vars(name).filter(|v| !v.trim().is_empty()) else {
        return Ok(None);
    };
    match raw.trim().parse::<u64>() {
        Ok(n) if n > 0 => Ok(Some(n)),
        _ => Err(LlmError::Config(format!(
            "{name} must be a positive whole number, got {raw:?}"
        ))),
    }
}

/// Installs rustls' ring crypto provider as the process default, once. reqwest is built with
/// `rustls-no-provider` and panics without one; another part of the program may have installed
/// a provider first, which is fine.
pub(crate) fn install_crypto_provider() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // An Err only means a provider is already installed.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// Builds the blocking client with the configured timeouts. Redirects are not followed: a
/// redirect to another host would carry custom key headers such as `x-api-key` along.
pub(crate) fn build_client(config: &HttpConfig) -> Result<Client, LlmError> {
    install_crypto_provider();
    Client::builder()
        .timeout(config.timeout)
        .connect_timeout(config.connect_timeout)
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!("troupe/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| LlmError::Config(format!("failed to build the http client: {}", chain(&e))))
}

/// An error body as a provider parsed it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ApiError {
    /// The API's error type or code, when the body named one.
    pub kind: Option<String>,
    pub message: String,
}

/// One JSON endpoint of a provider.
pub(crate) struct Endpoint<'a> {
    pub provider: &'static str,
    pub client: &'a Client,
    pub url: &'a str,
    /// Auth and version headers, values marked sensitive.
    pub headers: &'a HeaderMap,
    pub retry: &'a RetryPolicy,
    /// The model asked for (a team may cap calls per model).
    pub model: &'a str,
}

impl Endpoint<'_> {
    /// POSTs `body` and returns `parse_ok` of a 2xx body, retrying per the policy. Error bodies
    /// go through `parse_error`; a success body that `parse_ok` rejects counts as transient.
    pub(crate) fn post_json<T>(
        &self,
        body: Vec<u8>,
        parse_error: fn(&str) -> Option<ApiError>,
        parse_ok: impl Fn(&str) -> Result<T, String>,
    ) -> Result<T, LlmError> {
        // The key the calls are made with, for the fingerprint of what a provider limits.
        let key = ["x-api-key", "authorization"]
            .iter()
            .find_map(|h| self.headers.get(*h))
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .unwrap_or_default();
        let fp = super::gate::fingerprint(self.url, &key);
        retry::run(
            self.retry,
            self.provider,
            &mut std::thread::sleep,
            &mut retry::random_unit,
            |attempt| {
                // Each attempt waits as the team's governor says, holding a call slot.
                let _slot = match super::gate::current().map(|g| g.enter(&fp, self.model)) {
                    Some(Err(e)) => return Err(AttemptError::Fatal(e)),
                    slot => slot,
                };
                self.attempt(attempt, &fp, &body, parse_error, &parse_ok)
            },
        )
    }

    fn attempt<T>(
        &self,
        attempt: u32,
        fp: &str,
        body: &[u8],
        parse_error: fn(&str) -> Option<ApiError>,
        parse_ok: &impl Fn(&str) -> Result<T, String>,
    ) -> Result<T, AttemptError> {
        debug!(
            provider = self.provider,
            url = self.url,
            attempt,
            "llm request"
        );
        let response = self
            .client
            .post(self.url)
            .headers(self.headers.clone())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_vec())
            .send();
        let response = match response {
            Ok(r) => r,
            Err(e) if e.is_builder() => {
                return Err(AttemptError::Fatal(LlmError::Config(format!(
                    "failed to build the request to {}: {}",
                    self.provider,
                    chain(&e)
                ))));
            }
            Err(e) => {
                let what = if e.is_timeout() {
                    "timed out"
                } else if e.is_connect() {
                    "failed to connect"
                } else {
                    "failed"
                };
                return Err(AttemptError::Transient {
                    description: format!("request to {} {what}: {}", self.provider, chain(&e)),
                    hint: None,
                    request_id: None,
                });
            }
        };
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let request_id = header(&headers, "request-id")
            .or_else(|| header(&headers, "x-request-id"))
            .map(str::to_owned);
        let text = match response.text() {
            Ok(t) => t,
            Err(e) => {
                let what = if e.is_timeout() {
                    "timed out reading"
                } else {
                    "failed to read"
                };
                return Err(AttemptError::Transient {
                    description: format!(
                        "{what} the http {status} response body from {}{}: {}",
                        self.provider,
                        id_suffix(&request_id),
                        chain(&e)
                    ),
                    hint: None,
                    request_id,
                });
            }
        };
        debug!(provider = self.provider, status, request_id = ?request_id, "llm response");
        if let Some(g) = super::gate::current() {
            let quota = !(200..300).contains(&status)
                && parse_error(&text)
                    .and_then(|e| e.kind)
                    .is_some_and(|k| is_quota_kind(&k));
            g.observe(
                fp,
                &super::gate::seen(status, &headers, quota, SystemTime::now()),
            );
        }

        if (200..300).contains(&status) {
            return parse_ok(&text).map_err(|why| AttemptError::Transient {
                description: format!(
                    "{}{}",
                    LlmError::InvalidResponse(format!("{} http {status}: {why}", self.provider)),
                    id_suffix(&request_id)
                ),
                hint: None,
                request_id: request_id.clone(),
            });
        }

        let api = parse_error(&text).unwrap_or_else(|| ApiError {
            kind: None,
            message: snippet(&text),
        });
        let kind = api.kind.unwrap_or_else(|| format!("http_{status}"));
        let message = format!("{}{}", api.message, id_suffix(&request_id));
        let quota = is_quota_kind(&kind);
        if retry::should_retry_status(status, header(&headers, "x-should-retry"), quota) {
            let hint = retry::server_delay(
                header(&headers, "retry-after-ms"),
                header(&headers, "retry-after"),
                SystemTime::now(),
                self.retry.max_retry_after,
            );
            return Err(AttemptError::Transient {
                description: format!("{} returned http {status} {kind}: {message}", self.provider),
                hint,
                request_id,
            });
        }
        let error = match status {
            401 | 403 => LlmError::Auth { status, message },
            _ if !quota && retry::status_is_transient(status) => LlmError::Unavailable {
                // A transient status the server told us not to retry.
                attempts: attempt,
                last: format!(
                    "{} returned http {status} {kind}: {message} (the server said not to retry)",
                    self.provider
                ),
            },
            _ => LlmError::Rejected {
                status,
                kind,
                message,
            },
        };
        Err(AttemptError::Fatal(error))
    }
}

fn header<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

fn id_suffix(request_id: &Option<String>) -> String {
    match request_id {
        Some(id) => format!(" (request id {id})"),
        None => String::new(),
    }
}

/// The start of a non-JSON error body (an HTML page from a proxy, say), on one line.
fn snippet(text: &str) -> String {
    const MAX: usize = 300;
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.is_empty() {
        return "empty response body".to_string();
    }
    match flat.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}...", &flat[..cut]),
        None => flat,
    }
}

/// An error and its sources on one line: reqwest's own message rarely says why.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn config_defaults() {
        let c = HttpConfig::from_vars(&vars(&[])).expect("defaults");
        assert_eq!(c.timeout, Duration::from_secs(600));
        assert_eq!(c.connect_timeout, Duration::from_secs(5));
        assert_eq!(c.retry.max_attempts, 3);
    }

    #[test]
    fn config_reads_the_knobs() {
        let c = HttpConfig::from_vars(&vars(&[
            ("TROUPE_LLM_TIMEOUT_SECS", "30"),
            ("TROUPE_LLM_MAX_ATTEMPTS", " 5 "),
        ]))
        .expect("valid");
        assert_eq!(c.timeout, Duration::from_secs(30));
        assert_eq!(c.retry.max_attempts, 5);
    }

    #[test]
    fn config_rejects_nonsense() {
        for bad in ["0", "-1", "ten", "1.5"] {
            let e = HttpConfig::from_vars(&vars(&[("TROUPE_LLM_TIMEOUT_SECS", bad)]))
                .expect_err("invalid");
            assert!(e.to_string().contains("TROUPE_LLM_TIMEOUT_SECS"), "{e}");
            assert_eq!(e.exit_code(), 78);
        }
    }

    #[test]
    fn snippets_are_short_and_flat() {
        assert_eq!(snippet(""), "empty response body");
        assert_eq!(
            snippet("<html>\n  <b>bad gateway</b>\n</html>"),
            "<html> <b>bad gateway</b> </html>"
        );
        let long = "é".repeat(1000);
        assert_eq!(snippet(&long).chars().count(), 303);
    }
}
