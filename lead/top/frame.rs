//! One frame of `lead top`: what the team looks like now, read through the store, with the
//! lints found in it. `lead top --once --json` prints it; the live view draws it.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;
use troupe::TeamDir;
use troupe::config::{Member, Roster};
use troupe::inbox::Inbox;
use troupe::liveness;
use troupe::requests::{RequestKind, RequestStatus, RequestStore};
use troupe::store::{Listing, beat};
use troupe::tasks::TaskStore;
use troupe::teamdir::AgentName;

/// How long a worker may show no progress before the view calls it hung (the supervisor's
/// watchdog default).
const HUNG_AFTER: f64 = 120.0;

#[derive(Debug, Clone, Serialize)]
pub struct Frame {
    pub at: f64,
    pub team_name: String,
    pub supervisor: bool,
    pub header: Header,
    pub rows: Vec<Row>,
    /// The board, for its pane (not in `--json`: the header counts it).
    #[serde(skip)]
    pub tasks: Vec<troupe::tasks::Task>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Header {
    pub cost_usd: f64,
    pub budget_usd: Option<f64>,
    pub calls: u64,
    /// Members in a model call now.
    pub calls_in_flight: usize,
    /// `ok`, or the rate governor's cooldown and its end.
    pub rate: String,
    pub tasks: BTreeMap<String, usize>,
    pub lints: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub name: String,
    pub role: String,
    pub status: String,
    /// What `lead status` calls `doing.state`.
    pub state: String,
    /// Whether the process lives: `alive`, `restarting`, `hung`, `dead`, or `down` (no process
    /// wanted).
    pub liveness: &'static str,
    /// The tool or model call under way, or what the state says.
    pub doing_now: String,
    /// Since when that is so.
    pub doing_since: Option<f64>,
    /// Seconds since the member's process last wrote anything (its record or its journal).
    pub silent_for: Option<f64>,
    pub tokens: u64,
    pub cost_usd: f64,
    pub cache_share: Option<f64>,
    pub inbox: usize,
    pub pending_requests: Vec<String>,
    pub host: Option<String>,
    pub branch: Option<String>,
    /// A worktree member's place in the merge queue (`queued`, `checking`, `landed at
    /// 1a2b3c4`, `sent back`, `waiting for a clean tree`).
    pub merge: Option<String>,
    pub pid: Option<u32>,
    pub lints: Vec<String>,
}

/// What the lints look at for one member, apart from its row.
#[derive(Debug, Default, Clone)]
pub struct Signs {
    /// The member's tool calls, most recent last, as `tool detail`.
    pub recent_tools: Vec<String>,
    /// When its oldest pending plan approval was asked.
    pub plan_waiting_since: Option<f64>,
}

/// The lints of one row at `now` (see the issue: silent while working, waiting for the API,
/// an inbox backlog, the same tool call again and again, a plan waiting for approval).
pub fn lints(row: &Row, signs: &Signs, now: f64) -> Vec<String> {
    let mut out = Vec::new();
    let mins = |secs: f64| (secs / 60.0).floor() as u64;
    if row.state == "working"
        && let Some(s) = row.silent_for
        && s >= 300.0
    {
        out.push(format!("silent {} min while working", mins(s)));
    }
    if row.state == "waiting_api"
        && let Some(since) = row.doing_since
        && now - since >= 120.0
    {
        out.push(format!("waiting for the API {} min", mins(now - since)));
    }
    if row.inbox >= 100 {
        out.push(format!("inbox backlog {}", row.inbox));
    }
    if let Some(last) = signs.recent_tools.last() {
        let same = signs
            .recent_tools
            .iter()
            .rev()
            .take_while(|t| *t == last)
            .count();
        if same >= 5 {
            out.push(format!("same tool call {same} times in a row"));
        }
    }
    if let Some(since) = signs.plan_waiting_since
        && now - since >= 180.0
    {
        out.push(format!(
            "plan waiting {} min for approval",
            mins(now - since)
        ));
    }
    if row.liveness == "hung" {
        out.push("no progress past the watchdog".into());
    }
    out
}

/// The listings of requests, tasks and merge entries a view keeps from one frame to the next,
/// so that each frame reads only the ones that changed (a team's history of each only grows;
/// see [`Listing`]).
#[derive(Default)]
pub struct Lists {
    requests: Listing<troupe::requests::Request>,
    tasks: Listing<troupe::tasks::Task>,
    merges: Listing<troupe::merge::MergeEntry>,
}

/// Reads the team now; `events` are the last events of the log (see [`Tail`]), `lists` what
/// the last frame listed.
pub fn gather(team: &TeamDir, events: &[Value], lists: &mut Lists) -> anyhow::Result<Frame> {
    let now = troupe::fsutil::now();
    let cfg = Roster::new(team).load()?;
    let requests =
        RequestStore::new(team).list_cached(Some(RequestStatus::Pending), &mut lists.requests)?;
    let tasks = TaskStore::new(team).list_cached(&mut lists.tasks)?;
    let here = team.store().this_host();
    let merges = troupe::merge::latest_by_member(
        &troupe::merge::MergeStore::new(team)
            .list_cached(&mut lists.merges)
            .unwrap_or_default(),
    );
    let mut rows = Vec::new();
    let mut in_flight = 0;
    for m in &cfg.members {
        let d = crate::commands::doing(team, m, here.as_deref());
        let last_beat = beat::last(team.store(), &m.name).ok().flatten();
        let (row, signs) = row_of(team, m, &d, last_beat.as_ref(), &requests, events, now);
        if row.doing_now.starts_with("model call") || row.doing_now == "compaction" {
            in_flight += 1;
        }
        let mut row = row;
        row.merge = merges.get(&m.name).map(troupe::merge::describe);
        row.lints = lints(&row, &signs, now);
        rows.push(row);
    }
    let mut by_status = BTreeMap::new();
    for t in &tasks {
        *by_status.entry(t.status.as_str().to_owned()).or_insert(0) += 1;
    }
    let spend = troupe::cost::team_spend(&cfg);
    let rate = rate_state(events, now);
    Ok(Frame {
        at: now,
        team_name: cfg.team_name.clone(),
        supervisor: liveness::supervisor_running(team).unwrap_or(false),
        header: Header {
            cost_usd: spend.cost_usd,
            budget_usd: cfg.team_budget_usd,
            calls: spend.calls,
            calls_in_flight: in_flight,
            rate,
            tasks: by_status,
            lints: rows.iter().map(|r| r.lints.len()).sum(),
        },
        rows,
        tasks,
    })
}

fn row_of(
    team: &TeamDir,
    m: &Member,
    d: &liveness::Doing,
    last_beat: Option<&beat::Beat>,
    requests: &[troupe::requests::Request],
    events: &[Value],
    now: f64,
) -> (Row, Signs) {
    let clocks = troupe::clock::Now {
        wall: now,
        boot: troupe::clock::boot() - (troupe::fsutil::now() - now),
    };
    let hung =
        last_beat.is_some_and(|b| b.epoch == m.incarnation && b.overdue(&clocks, HUNG_AFTER));
    let liveness = match d.state {
        "restarting" => "restarting",
        "dead" => "dead",
        "shutdown" | "failed" | "stopped" => "down",
        "spawning" => "restarting",
        _ if hung => "hung",
        _ => "alive",
    };
    let working_beat = last_beat
        .filter(|b| b.epoch == m.incarnation && d.state == "working")
        .and_then(|b| b.doing.clone().map(|what| (what, b.at)));
    let (doing_now, doing_since) = match working_beat {
        Some((what, at)) => (what, Some(at)),
        None => (liveness::describe(d, now), d.since),
    };
    let pending: Vec<&troupe::requests::Request> = requests
        .iter()
        .filter(|r| r.to == m.name || r.from == m.name)
        .collect();
    let plan_waiting_since = pending
        .iter()
        .filter(|r| r.kind == RequestKind::PlanApproval && r.from == m.name)
        .map(|r| r.created_at)
        .fold(None, |a: Option<f64>, t| Some(a.map_or(t, |a| a.min(t))));
    let inbox = AgentName::teammate(&m.name)
        .ok()
        .and_then(|n| Inbox::new(team, &n).depth().ok())
        .map_or(0, |n| n as usize);
    let recent_tools = events
        .iter()
        .filter(|e| e["event"] == "tool" && e["name"] == m.name.as_str())
        .map(|e| {
            format!(
                "{} {}",
                e["tool"].as_str().unwrap_or(""),
                e["detail"].as_str().unwrap_or("")
            )
        })
        .collect();
    let row = Row {
        name: m.name.clone(),
        role: m.role.clone(),
        status: m.status.to_string(),
        state: d.state.to_owned(),
        liveness,
        doing_now,
        doing_since,
        silent_for: d.last_seen.map(|t| (now - t).max(0.0)),
        tokens: troupe::cost::total_tokens(&m.usage),
        cost_usd: m.cost_usd,
        cache_share: troupe::cost::cache_read_share(&m.usage),
        inbox,
        pending_requests: pending.iter().map(|r| r.request_id.clone()).collect(),
        host: m.host.clone(),
        branch: m.worktree.as_ref().map(|w| w.branch.clone()),
        merge: None,
        pid: m.pid,
        lints: Vec::new(),
    };
    (
        row,
        Signs {
            recent_tools,
            plan_waiting_since,
        },
    )
}

/// The last [`TAIL`] events of the log: all the view derives from events (a member's recent
/// tool calls, for the lint "same tool call N times in a row", and the last `rate_limited`
/// cooldown) is read from them, and everything else from the records (the roster, requests,
/// tasks, merge entries, heartbeats). The first look reads them back from the log's end
/// ([`troupe::events::tail`]); each later one reads on from where the last ended, a page at a
/// time. So neither the time to the first frame nor what the view holds grows with the log
/// (which is never trimmed), and a frame shows what it would on a log of only those events.
#[derive(Default)]
pub struct Tail {
    /// Where the next look reads on from (`None`: nothing read yet).
    pos: Option<u64>,
    pub events: std::collections::VecDeque<Value>,
}

/// How many of the last events a [`Tail`] keeps.
pub const TAIL: usize = 2000;

impl Tail {
    pub fn refresh(&mut self, team: &TeamDir) {
        let Some(mut pos) = self.pos else {
            if let Ok((last, next)) = troupe::events::tail(team, TAIL) {
                self.events = last.into();
                self.pos = Some(next);
            }
            return;
        };
        while let Ok((new, next)) = troupe::events::read_page(team, pos, None, TAIL) {
            if next == pos {
                break;
            }
            pos = next;
            self.events.extend(new);
            while self.events.len() > TAIL {
                self.events.pop_front();
            }
        }
        self.pos = Some(pos);
    }

    pub fn as_slice(&mut self) -> &[Value] {
        self.events.make_contiguous()
    }
}

/// The rate governor's state as the events show it: the last `rate_limited` cooldown, while
/// it lasts.
fn rate_state(events: &[Value], now: f64) -> String {
    let last = events.iter().rev().find(|e| e["event"] == "rate_limited");
    match last {
        Some(e) => {
            let at = e["ts"].as_f64().unwrap_or(0.0);
            let wait = e["wait_secs"].as_f64().unwrap_or(1.0);
            if at + wait > now {
                format!(
                    "cooling down {:.0}s (HTTP {})",
                    at + wait - now,
                    e["status"]
                )
            } else if now - at < 300.0 {
                format!("rate limited {:.0}s ago", now - at)
            } else {
                "ok".into()
            }
        }
        None => "ok".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(state: &str) -> Row {
        Row {
            name: "ann".into(),
            role: "r".into(),
            status: "working".into(),
            state: state.into(),
            liveness: "alive",
            doing_now: String::new(),
            doing_since: None,
            silent_for: None,
            tokens: 0,
            cost_usd: 0.0,
            cache_share: None,
            inbox: 0,
            pending_requests: vec![],
            host: None,
            branch: None,
            merge: None,
            pid: Some(1),
            lints: vec![],
        }
    }

    #[test]
    fn each_lint_fires_past_its_threshold_only() {
        let now = 10_000.0;
        let none = Signs::default();
        let mut r = row("working");
        r.silent_for = Some(299.0);
        assert!(lints(&r, &none, now).is_empty());
        r.silent_for = Some(301.0);
        assert_eq!(lints(&r, &none, now), ["silent 5 min while working"]);
        let mut r = row("waiting_api");
        r.doing_since = Some(now - 125.0);
        assert_eq!(lints(&r, &none, now), ["waiting for the API 2 min"]);
        let mut r = row("idle");
        r.inbox = 120;
        assert_eq!(lints(&r, &none, now), ["inbox backlog 120"]);
        let r = row("working");
        let mut signs = Signs {
            recent_tools: vec!["bash ls".into(); 4],
            plan_waiting_since: Some(now - 170.0),
        };
        assert!(lints(&r, &signs, now).is_empty());
        signs.recent_tools.insert(0, "read_file a".into());
        signs.recent_tools.push("bash ls".into());
        signs.plan_waiting_since = Some(now - 200.0);
        assert_eq!(
            lints(&r, &signs, now),
            [
                "same tool call 5 times in a row",
                "plan waiting 3 min for approval"
            ]
        );
    }

    #[test]
    fn the_rate_state_shows_a_cooldown_while_it_lasts() {
        let ev = |ts: f64| serde_json::json!({"ts": ts, "event": "rate_limited", "status": 429, "wait_secs": 10.0});
        assert_eq!(rate_state(&[], 100.0), "ok");
        assert_eq!(rate_state(&[ev(95.0)], 100.0), "cooling down 5s (HTTP 429)");
        assert_eq!(rate_state(&[ev(50.0)], 100.0), "rate limited 50s ago");
        assert_eq!(rate_state(&[ev(-500.0)], 100.0), "ok");
    }
}
