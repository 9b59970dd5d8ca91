//! Protocol requests: `requests/ID.json`, one record per request, moving
//! `pending -> approved | rejected | expired` and never back.
//!
//! Every change happens under the request's sidecar lock (`requests/ID.lock`) held across the
//! read, the check and the durable replace (temp, fsync, rename, fsync dir), so of two processes
//! racing to decide the same request exactly one wins and the other is told the state it lost to.
//! Authority is checked here, not left to prompts: only the lead asks for a shutdown, only a
//! teammate submits a plan, and only a request's addressee may answer it.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::fsutil;
use crate::records::Records;
use crate::teamdir::{LEAD, TeamDir};

/// What a request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestKind {
    /// lead -> teammate: please exit. Payload `{"reason": ...}`.
    Shutdown,
    /// teammate -> lead: may I carry out this plan? Payload `{"plan": ...}`.
    PlanApproval,
}

impl fmt::Display for RequestKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            RequestKind::Shutdown => "shutdown",
            RequestKind::PlanApproval => "plan_approval",
        })
    }
}

/// Where a request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestStatus {
    Pending,
    Approved,
    Rejected,
    Expired,
}

impl RequestStatus {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            RequestStatus::Pending => "pending",
            RequestStatus::Approved => "approved",
            RequestStatus::Rejected => "rejected",
            RequestStatus::Expired => "expired",
        }
    }
}

impl fmt::Display for RequestStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

impl std::str::FromStr for RequestStatus {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<RequestStatus, String> {
        match s {
            "pending" => Ok(RequestStatus::Pending),
            "approved" => Ok(RequestStatus::Approved),
            "rejected" => Ok(RequestStatus::Rejected),
            "expired" => Ok(RequestStatus::Expired),
            _ => Err(format!(
                "unknown status {s:?} (expected pending, approved, rejected or expired)"
            )),
        }
    }
}

/// One request record, as stored in `requests/ID.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    pub request_id: String,
    pub kind: RequestKind,
    pub from: String,
    pub to: String,
    pub status: RequestStatus,
    #[serde(default)]
    pub payload: Value,
    /// The answer: `{"approve": bool, "by": NAME, "at": TS, ...}` plus `reason` / `feedback`.
    #[serde(default)]
    pub response: Option<Value>,
    /// For shutdowns: the incarnation of the teammate the lead meant to stop.
    #[serde(default)]
    pub target_incarnation: Option<u64>,
    pub created_at: f64,
    pub updated_at: f64,
    #[serde(default)]
    pub expires_at: Option<f64>,
    /// When the `request_pending` hooks ran for it (see `lead run --escalate-after`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paged_at: Option<f64>,
}

impl Request {
    /// Whether the request is pending and past its expiry at `now`.
    pub fn is_due(&self, now: f64) -> bool {
        self.status == RequestStatus::Pending && self.expires_at.is_some_and(|t| now >= t)
    }

    /// The `reason`/`feedback` of the answer, if any.
    pub fn response_text(&self) -> Option<&str> {
        let r = self.response.as_ref()?;
        r.get("feedback")
            .or_else(|| r.get("reason"))
            .and_then(Value::as_str)
    }
}

/// What a new request needs.
#[derive(Debug, Clone)]
pub struct NewRequest {
    pub kind: RequestKind,
    pub from: String,
    pub to: String,
    pub payload: Value,
    pub target_incarnation: Option<u64>,
    /// Time to live; `None` never expires.
    pub ttl: Option<Duration>,
}

/// The request store of a team dir.
#[derive(Debug, Clone)]
pub struct RequestStore {
    team: TeamDir,
}

impl RequestStore {
    /// The store in `team`.
    pub fn new(team: &TeamDir) -> RequestStore {
        RequestStore { team: team.clone() }
    }

    /// Creates a pending request with a fresh, unique 8-hex id.
    pub fn create(&self, new: NewRequest) -> Result<Request> {
        self.create_as(new, None)
    }

    /// Records a request decided by code rather than by its addressee's model (a budget stop):
    /// created `approved` in one write, the answer `{"approve": true, "by": TO, "at"}` plus
    /// `extra`. It never expires.
    pub fn create_approved(&self, mut new: NewRequest, extra: Value) -> Result<Request> {
        new.ttl = None;
        self.create_as(new, Some(extra))
    }

    fn create_as(&self, new: NewRequest, approved: Option<Value>) -> Result<Request> {
        match new.kind {
            RequestKind::Shutdown if new.from != LEAD => {
                return Err(Error::Protocol(
                    "only the lead may request a shutdown".to_owned(),
                ));
            }
            RequestKind::Shutdown if new.to == LEAD => {
                return Err(Error::Protocol(
                    "the lead cannot be asked to shut down".to_owned(),
                ));
            }
            RequestKind::PlanApproval if new.from == LEAD || new.to != LEAD => {
                return Err(Error::Protocol(
                    "a plan is submitted by a teammate to the lead".to_owned(),
                ));
            }
            _ => {}
        }
        let id = self.records().reserve_id()?;
        let now = fsutil::now();
        let req = Request {
            request_id: id.clone(),
            kind: new.kind,
            from: new.from,
            to: new.to,
            status: RequestStatus::Pending,
            payload: new.payload,
            response: None,
            target_incarnation: new.target_incarnation,
            created_at: now,
            updated_at: now,
            expires_at: new.ttl.map(|t| now + t.as_secs_f64()),
            paged_at: None,
        };
        let mut req = req;
        if let Some(extra) = approved {
            let mut resp = json!({"approve": true, "by": req.to, "at": now});
            if let (Value::Object(r), Value::Object(e)) = (&mut resp, extra) {
                r.extend(e);
            }
            req.status = RequestStatus::Approved;
            req.response = Some(resp);
        }
        self.locked(&id, |_| Ok(Some(req.clone())))?;
        Ok(req)
    }

    /// Reads one request.
    pub fn get(&self, id: &str) -> Result<Request> {
        self.records().get(id)
    }

    /// Every request (optionally only those in `status`), oldest first. Unreadable files are
    /// reported on stderr and skipped.
    pub fn list(&self, status: Option<RequestStatus>) -> Result<Vec<Request>> {
        let mut out: Vec<Request> = self.records().list()?;
        out.retain(|r| status.is_none_or(|s| r.status == s));
        out.sort_by(|a, b| a.created_at.total_cmp(&b.created_at));
        Ok(out)
    }

    /// As [`RequestStore::list`], reading only the requests that changed since the listing
    /// `cache` was last given to (for a poller such as `lead top`; see
    /// [`crate::store::Listing`]).
    pub fn list_cached(
        &self,
        status: Option<RequestStatus>,
        cache: &mut crate::store::Listing<Request>,
    ) -> Result<Vec<Request>> {
        let mut out: Vec<Request> = self.records().list_cached(cache)?;
        out.retain(|r| status.is_none_or(|s| r.status == s));
        out.sort_by(|a, b| a.created_at.total_cmp(&b.created_at));
        Ok(out)
    }

    /// Answers a pending request as `who` (who must be its addressee). `extra` holds the answer's
    /// `reason` or `feedback`.
    ///
    /// An answer that comes after `expires_at`, while the request is still pending (nobody has
    /// expired it yet), is judged by what it says. An approval is accepted: both sides want
    /// what it grants. A rejection is refused with the `expired` error, and the request is left
    /// `pending`: expiring it is the job of whoever acts on the expiry (the supervisor's
    /// [`RequestStore::expire_if_due`], which then stops the teammate). Marking it expired here
    /// would leave a shutdown that nobody enforces.
    pub fn resolve(&self, id: &str, who: &str, approve: bool, extra: Value) -> Result<Request> {
        self.locked(id, |cur| {
            let mut req = cur.ok_or_else(|| Error::UnknownRequest(id.to_owned()))?;
            if req.to != who {
                return Err(Error::NotAddressee {
                    id: id.to_owned(),
                    to: req.to.clone(),
                    who: who.to_owned(),
                });
            }
            if req.status != RequestStatus::Pending {
                return Err(Error::AlreadyResolved {
                    id: id.to_owned(),
                    status: req.status.to_string(),
                });
            }
            let now = fsutil::now();
            if req.is_due(now) && !approve {
                return Err(Error::AlreadyResolved {
                    id: id.to_owned(),
                    status: RequestStatus::Expired.to_string(),
                });
            }
            req.updated_at = now;
            req.status = if approve {
                RequestStatus::Approved
            } else {
                RequestStatus::Rejected
            };
            let mut resp = json!({"approve": approve, "by": who, "at": now});
            if let (Value::Object(r), Value::Object(e)) = (&mut resp, extra) {
                r.extend(e);
            }
            req.response = Some(resp);
            Ok(Some(req))
        })
    }

    /// Notes that the `request_pending` hooks ran for request `id`.
    pub fn mark_paged(&self, id: &str) -> Result<Request> {
        self.locked(id, |cur| {
            let mut req = cur.ok_or_else(|| Error::UnknownRequest(id.to_owned()))?;
            req.paged_at = Some(fsutil::now());
            Ok(Some(req))
        })
    }

    /// Marks a pending request `expired` if its time is up. Returns the updated request if this
    /// call expired it.
    pub fn expire_if_due(&self, id: &str) -> Result<Option<Request>> {
        let mut changed = false;
        let req = self.locked(id, |cur| {
            let mut req = cur.ok_or_else(|| Error::UnknownRequest(id.to_owned()))?;
            let now = fsutil::now();
            if req.is_due(now) {
                req.status = RequestStatus::Expired;
                req.updated_at = now;
                changed = true;
            }
            Ok(Some(req))
        })?;
        Ok(changed.then_some(req))
    }

    /// Marks a pending request `expired` now, whatever its expiry (a request made moot, for
    /// example a shutdown aimed at a teammate that has since exited). Returns it if it moved.
    pub fn expire_now(&self, id: &str, why: &str) -> Result<Option<Request>> {
        let mut changed = false;
        let req = self.locked(id, |cur| {
            let mut req = cur.ok_or_else(|| Error::UnknownRequest(id.to_owned()))?;
            if req.status == RequestStatus::Pending {
                let now = fsutil::now();
                req.status = RequestStatus::Expired;
                req.updated_at = now;
                req.response = Some(json!({"expired": why, "at": now}));
                changed = true;
            }
            Ok(Some(req))
        })?;
        Ok(changed.then_some(req))
    }

    /// Reads, decides and writes request `id` under its lock (see [`crate::records`]).
    fn locked(
        &self,
        id: &str,
        f: impl FnOnce(Option<Request>) -> Result<Option<Request>>,
    ) -> Result<Request> {
        self.records().locked(id, f)
    }

    fn records(&self) -> Records<'_> {
        Records {
            team: &self.team,
            dir: TeamDir::requests_dir,
            file: TeamDir::request,
            lock: TeamDir::request_lock,
            unknown: Error::UnknownRequest,
            noun: "request",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> (tempfile::TempDir, RequestStore) {
        let tmp = tempfile::tempdir().unwrap();
        let team = TeamDir::create(tmp.path().join(".team")).unwrap();
        (tmp, RequestStore::new(&team))
    }

    fn shutdown(ttl: Option<Duration>) -> NewRequest {
        NewRequest {
            kind: RequestKind::Shutdown,
            from: "lead".into(),
            to: "alice".into(),
            payload: json!({"reason": "done"}),
            target_incarnation: Some(1),
            ttl,
        }
    }

    #[test]
    fn lifecycle_and_errors() {
        let (_t, s) = store();
        let r = s.create(shutdown(None)).unwrap();
        assert_eq!(r.request_id.len(), 8);
        assert_eq!(s.get(&r.request_id).unwrap().status, RequestStatus::Pending);
        let e = s
            .resolve(&r.request_id, "bob", true, json!({}))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "request {} is addressed to alice; bob may not answer it",
                r.request_id
            )
        );
        let ok = s
            .resolve(&r.request_id, "alice", true, json!({"reason": "bye"}))
            .unwrap();
        assert_eq!(ok.status, RequestStatus::Approved);
        assert_eq!(ok.response_text(), Some("bye"));
        let e = s
            .resolve(&r.request_id, "alice", false, json!({}))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("request {} is already approved", r.request_id)
        );
        assert_eq!(
            s.get("deadbeef").unwrap_err().to_string(),
            "no such request: deadbeef"
        );
        assert_eq!(s.list(Some(RequestStatus::Approved)).unwrap().len(), 1);
        assert_eq!(s.list(Some(RequestStatus::Pending)).unwrap().len(), 0);
    }

    #[test]
    fn a_late_approval_is_accepted() {
        let (_t, s) = store();
        let r = s.create(shutdown(Some(Duration::ZERO))).unwrap();
        // Nobody expired it yet, and both sides want the stop: the answer stands.
        let ok = s
            .resolve(&r.request_id, "alice", true, json!({"reason": "bye"}))
            .unwrap();
        assert_eq!(ok.status, RequestStatus::Approved);
        assert_eq!(
            s.get(&r.request_id).unwrap().status,
            RequestStatus::Approved
        );
        assert!(s.expire_if_due(&r.request_id).unwrap().is_none());
    }

    #[test]
    fn a_late_rejection_is_refused_and_left_for_the_expiry() {
        let (_t, s) = store();
        let r = s.create(shutdown(Some(Duration::ZERO))).unwrap();
        let e = s
            .resolve(&r.request_id, "alice", false, json!({"reason": "busy"}))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("request {} is already expired", r.request_id)
        );
        // Still pending: the supervisor's own expiry marks it, and so knows to escalate.
        let cur = s.get(&r.request_id).unwrap();
        assert_eq!(cur.status, RequestStatus::Pending);
        assert_eq!(cur.response, None);
        let expired = s.expire_if_due(&r.request_id).unwrap().unwrap();
        assert_eq!(expired.status, RequestStatus::Expired);
    }

    #[test]
    fn authority() {
        let (_t, s) = store();
        let mut n = shutdown(None);
        n.from = "bob".into();
        assert_eq!(
            s.create(n).unwrap_err().to_string(),
            "only the lead may request a shutdown"
        );
        let n = NewRequest {
            kind: RequestKind::PlanApproval,
            from: "lead".into(),
            to: "alice".into(),
            payload: json!({}),
            target_incarnation: None,
            ttl: None,
        };
        assert!(s.create(n).is_err());
    }
}
