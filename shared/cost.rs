//! What model calls cost, and the budgets that bound it.
//!
//! A [`PriceTable`] maps model ids to [`Price`]s in US dollars per million tokens: input, output,
//! cache write and cache read. The defaults cover the common Anthropic and OpenAI models; a JSON
//! file (`--prices FILE`, or `TROUPE_PRICES`) adds entries or replaces them:
//!
//! ```json
//! {"claude-sonnet-4": {"input": 3, "output": 15, "cache_write": 3.75, "cache_read": 0.3},
//!  "my-local-model": {"input": 0, "output": 0}}
//! ```
//!
//! A key is a model-id prefix; the longest matching prefix wins (`gpt-4o-mini-2024-07-18`
//! takes `gpt-4o-mini`, not `gpt-4o`). `cache_write` and `cache_read` default to `input`. A model
//! no entry matches costs 0, and the process says so once per model.
//!
//! Tokens are counted as the API bills them ([`Usage`]): Anthropic's `input_tokens` leave out the
//! cache writes and reads; the OpenAI client subtracts `cached_tokens` from `prompt_tokens` the
//! same way. So a call costs `input * p.input + output * p.output + cache_write * p.cache_write +
//! cache_read * p.cache_read`, over a million.
//!
//! Budgets ([`over_budget`]) are pure functions of the roster: a member's own `budget_usd` and
//! `budget_tokens`, counted across its incarnations (and across earlier members of its name
//! taken off the roster), and the team's `team_budget_usd`, counted over every member, present
//! or removed ([`TeamConfig::retired_spend`]), plus the LLM lead.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::config::{Member, TeamConfig};
use crate::error::{Error, Result};
use crate::llm::Usage;

/// The environment variable naming a price file.
pub const PRICES_ENV: &str = "TROUPE_PRICES";

/// US dollars per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Price {
    pub input: f64,
    pub output: f64,
    pub cache_write: f64,
    pub cache_read: f64,
}

impl Price {
    /// An Anthropic model: a cache write costs 1.25 times input, a cache read 0.1 times.
    pub const fn anthropic(input: f64, output: f64) -> Price {
        Price {
            input,
            output,
            cache_write: input * 1.25,
            cache_read: input * 0.1,
        }
    }

    /// An OpenAI model: cached input at its discounted price, no cache-write fee.
    pub const fn openai(input: f64, cached: f64, output: f64) -> Price {
        Price {
            input,
            output,
            cache_write: input,
            cache_read: cached,
        }
    }

    /// What `usage` costs at this price, in US dollars.
    pub fn cost(&self, usage: &Usage) -> f64 {
        (usage.input_tokens as f64 * self.input
            + usage.output_tokens as f64 * self.output
            + usage.cache_creation_input_tokens as f64 * self.cache_write
            + usage.cache_read_input_tokens as f64 * self.cache_read)
            / 1_000_000.0
    }
}

/// The defaults: (model-id prefix, price). Longest prefix wins.
const DEFAULTS: &[(&str, Price)] = &[
    // Anthropic.
    ("claude-opus-4-5", Price::anthropic(5.0, 25.0)),
    ("claude-opus-4-6", Price::anthropic(5.0, 25.0)),
    ("claude-opus-4", Price::anthropic(15.0, 75.0)),
    ("claude-3-opus", Price::anthropic(15.0, 75.0)),
    ("claude-sonnet-4", Price::anthropic(3.0, 15.0)),
    ("claude-3-7-sonnet", Price::anthropic(3.0, 15.0)),
    ("claude-3-5-sonnet", Price::anthropic(3.0, 15.0)),
    ("claude-haiku-4", Price::anthropic(1.0, 5.0)),
    ("claude-3-5-haiku", Price::anthropic(0.8, 4.0)),
    ("claude-3-haiku", Price::anthropic(0.25, 1.25)),
    // OpenAI.
    ("gpt-4o", Price::openai(2.5, 1.25, 10.0)),
    ("gpt-4o-mini", Price::openai(0.15, 0.075, 0.6)),
    ("gpt-4.1", Price::openai(2.0, 0.5, 8.0)),
    ("gpt-4.1-mini", Price::openai(0.4, 0.1, 1.6)),
    ("gpt-4.1-nano", Price::openai(0.1, 0.025, 0.4)),
    ("gpt-5", Price::openai(1.25, 0.125, 10.0)),
    ("gpt-5-mini", Price::openai(0.25, 0.025, 2.0)),
    ("gpt-5-nano", Price::openai(0.05, 0.005, 0.4)),
    ("o1", Price::openai(15.0, 7.5, 60.0)),
    ("o1-mini", Price::openai(1.1, 0.55, 4.4)),
    ("o3", Price::openai(2.0, 0.5, 8.0)),
    ("o3-mini", Price::openai(1.1, 0.55, 4.4)),
    ("o4-mini", Price::openai(1.1, 0.275, 4.4)),
];

/// One entry of a price file: `cache_write` and `cache_read` default to `input`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FilePrice {
    input: f64,
    output: f64,
    #[serde(default)]
    cache_write: Option<f64>,
    #[serde(default)]
    cache_read: Option<f64>,
}

/// Prices by model-id prefix.
#[derive(Debug, Clone, PartialEq)]
pub struct PriceTable {
    prices: BTreeMap<String, Price>,
}

impl Default for PriceTable {
    fn default() -> PriceTable {
        PriceTable {
            prices: DEFAULTS
                .iter()
                .map(|(k, p)| ((*k).to_owned(), *p))
                .collect(),
        }
    }
}

impl PriceTable {
    /// The defaults with the entries of a price file's text added or replaced.
    pub fn with_overrides(text: &str) -> std::result::Result<PriceTable, String> {
        let file: BTreeMap<String, FilePrice> =
            serde_json::from_str(text).map_err(|e| e.to_string())?;
        let mut t = PriceTable::default();
        for (k, p) in file {
            let price = Price {
                input: p.input,
                output: p.output,
                cache_write: p.cache_write.unwrap_or(p.input),
                cache_read: p.cache_read.unwrap_or(p.input),
            };
            let all = [
                price.input,
                price.output,
                price.cache_write,
                price.cache_read,
            ];
            if all.iter().any(|x| !x.is_finite() || *x < 0.0) {
                return Err(format!("{k:?}: prices must be non-negative numbers"));
            }
            t.prices.insert(k, price);
        }
        Ok(t)
    }

    /// The table for a process: the defaults, overridden by the price file `path` if given,
    /// else by the file `TROUPE_PRICES` names.
    pub fn load(path: Option<&Path>) -> Result<PriceTable> {
        let from_env = std::env::var_os(PRICES_ENV)
            .filter(|v| !v.is_empty())
            .map(std::path::PathBuf::from);
        let Some(path) = path.map(Path::to_path_buf).or(from_env) else {
            return Ok(PriceTable::default());
        };
        let text = std::fs::read_to_string(&path).map_err(Error::io("read", &path))?;
        PriceTable::with_overrides(&text).map_err(|why| Error::Corrupt {
            path: path.clone(),
            why: format!("not a price file ({why}); see docs/budgets.md"),
        })
    }

    /// The price of `model`: the entry with the longest prefix of it.
    pub fn price(&self, model: &str) -> Option<Price> {
        self.prices
            .iter()
            .filter(|(k, _)| model.starts_with(k.as_str()))
            .max_by_key(|(k, _)| k.len())
            .map(|(_, p)| *p)
    }

    /// What `usage` of `model` cost; 0 for a model with no price, said once per process.
    pub fn cost(&self, model: &str, usage: &Usage) -> f64 {
        match self.price(model) {
            Some(p) => p.cost(usage),
            None => {
                static SAID: Mutex<Option<HashSet<String>>> = Mutex::new(None);
                let mut said = SAID.lock().unwrap_or_else(|e| e.into_inner());
                if said
                    .get_or_insert_with(HashSet::new)
                    .insert(model.to_owned())
                {
                    tracing::warn!(
                        "no price known for model {model:?}: its calls count as costing $0 \
                         (add it to a price file: --prices FILE or {PRICES_ENV})"
                    );
                }
                0.0
            }
        }
    }
}

/// All the tokens a usage counts: input, output, cache writes and cache reads.
pub fn total_tokens(u: &Usage) -> u64 {
    u.input_tokens
        .saturating_add(u.output_tokens)
        .saturating_add(u.cache_creation_input_tokens)
        .saturating_add(u.cache_read_input_tokens)
}

/// The share of the input tokens read from cache (0..=1), or `None` with no input at all.
pub fn cache_read_share(u: &Usage) -> Option<f64> {
    let input = u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens;
    (input > 0).then(|| u.cache_read_input_tokens as f64 / input as f64)
}

/// What an agent spent: model calls, the tokens the API billed and their cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Spend {
    #[serde(default)]
    pub calls: u64,
    #[serde(flatten)]
    pub usage: Usage,
    #[serde(default)]
    pub cost_usd: f64,
}

impl Spend {
    /// Adds one call.
    pub fn add_call(&mut self, usage: &Usage, cost: f64) {
        self.calls += 1;
        self.usage.add(usage);
        self.cost_usd += cost;
    }

    /// Adds another spend.
    pub fn add(&mut self, other: &Spend) {
        self.calls += other.calls;
        self.usage.add(&other.usage);
        self.cost_usd += other.cost_usd;
    }
}

/// One incarnation's line of a member's ledger.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LedgerLine {
    pub incarnation: u64,
    #[serde(flatten)]
    pub spend: Spend,
}

/// Adds one call of `incarnation` to member `m`'s ledger and its life totals.
pub fn record_call(m: &mut Member, incarnation: u64, usage: &Usage, cost: f64) {
    m.usage.add(usage);
    m.calls += 1;
    m.cost_usd += cost;
    match m.ledger.iter_mut().find(|l| l.incarnation == incarnation) {
        Some(l) => l.spend.add_call(usage, cost),
        None => {
            let mut spend = Spend::default();
            spend.add_call(usage, cost);
            m.ledger.push(LedgerLine { incarnation, spend });
        }
    }
}

/// A member's spend over its life.
pub fn member_spend(m: &Member) -> Spend {
    Spend {
        calls: m.calls,
        usage: m.usage,
        cost_usd: m.cost_usd,
    }
}

/// What the name of member `m` spent over its whole life: its record's spend plus what earlier
/// members of that name spent before they were taken off the roster
/// ([`TeamConfig::retired_spend`]). Its budgets are checked against this.
pub fn life_spend(cfg: &TeamConfig, m: &Member) -> Spend {
    let mut s = member_spend(m);
    if let Some(r) = cfg.retired_spend.get(&m.name) {
        s.add(r);
    }
    s
}

/// The team's spend: every member, every member taken off the roster, and the LLM lead.
pub fn team_spend(cfg: &TeamConfig) -> Spend {
    let mut s = cfg.lead_spend.unwrap_or_default();
    for m in &cfg.members {
        s.add(&member_spend(m));
    }
    for r in cfg.retired_spend.values() {
        s.add(r);
    }
    s
}

/// Why a budget stops member `m` (or refuses to start it), if one does: its own dollar or token
/// budget, counted over its name's whole life ([`life_spend`]), or the team's. A budget is
/// crossed once the spend reaches it.
pub fn over_budget(cfg: &TeamConfig, m: &Member) -> Option<String> {
    let life = life_spend(cfg, m);
    if let Some(b) = m.budget_usd
        && life.cost_usd >= b
    {
        return Some(format!(
            "budget: {} spent ${:.4} of its ${b:.4} budget",
            m.name, life.cost_usd
        ));
    }
    let tokens = total_tokens(&life.usage);
    if let Some(b) = m.budget_tokens
        && tokens >= b
    {
        return Some(format!(
            "budget: {} used {tokens} tokens of its {b}-token budget",
            m.name
        ));
    }
    team_over_budget(cfg)
}

/// Why the team budget is crossed, if it is.
pub fn team_over_budget(cfg: &TeamConfig) -> Option<String> {
    let b = cfg.team_budget_usd?;
    let spent = team_spend(cfg).cost_usd;
    (spent >= b).then(|| format!("budget: the team spent ${spent:.4} of its ${b:.4} budget"))
}

/// Wakes every teammate that has (or should have) a process, but `except`, with a
/// `status_update` saying the team budget is spent: each then finds itself over budget before
/// its next model call and shuts down by code (an idle one would otherwise sleep on).
pub fn wake_team(team: &crate::TeamDir, cfg: &TeamConfig, except: Option<&str>) {
    let Some(why) = team_over_budget(cfg) else {
        return;
    };
    for m in &cfg.members {
        if !m.status.wants_process() || Some(m.name.as_str()) == except {
            continue;
        }
        let Ok(name) = crate::AgentName::teammate(&m.name) else {
            continue;
        };
        let inbox = crate::inbox::Inbox::new(team, &name);
        // One wake-up per member and incarnation is enough.
        let mut msg = crate::message::Message::new(
            crate::message::MessageType::StatusUpdate,
            crate::teamdir::LEAD,
            &m.name,
            format!("{why}: you are shut down"),
        );
        msg.id =
            crate::ids::derived(&format!("team-budget:{}:{}", m.name, m.incarnation)).to_string();
        if let Err(e) = inbox.append(&msg, crate::inbox::Durability::Sync) {
            tracing::warn!("could not wake {} for the team budget: {e}", m.name);
        }
    }
}

/// Dollars for a table: `$0.0123`.
pub fn usd(x: f64) -> String {
    if x >= 100.0 {
        format!("${x:.2}")
    } else {
        format!("${x:.4}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(i: u64, o: u64, w: u64, r: u64) -> Usage {
        Usage {
            input_tokens: i,
            output_tokens: o,
            cache_creation_input_tokens: w,
            cache_read_input_tokens: r,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn longest_prefix_wins() {
        let t = PriceTable::default();
        assert_eq!(t.price("gpt-4o-mini-2024-07-18").unwrap().input, 0.15);
        assert_eq!(t.price("gpt-4o-2024-08-06").unwrap().input, 2.5);
        assert_eq!(t.price("gpt-4.1-nano").unwrap().output, 0.4);
        assert_eq!(t.price("o3-mini").unwrap().input, 1.1);
        assert_eq!(t.price("o3").unwrap().input, 2.0);
        assert_eq!(t.price("claude-sonnet-4-5-20250929").unwrap().input, 3.0);
        assert_eq!(t.price("claude-opus-4-1").unwrap().output, 75.0);
        assert_eq!(t.price("claude-opus-4-5").unwrap().output, 25.0);
        assert_eq!(t.price("claude-3-5-haiku-latest").unwrap().input, 0.8);
        assert!(t.price("llama-3-8b").is_none());
        assert!(t.price("").is_none());
    }

    #[test]
    fn anthropic_cache_prices_follow_input() {
        let p = PriceTable::default().price("claude-sonnet-4-5").unwrap();
        assert!(close(p.cache_write, 3.75));
        assert!(close(p.cache_read, 0.3));
        let o = PriceTable::default().price("gpt-4o").unwrap();
        assert_eq!((o.cache_write, o.cache_read), (2.5, 1.25));
    }

    #[test]
    fn cost_math() {
        let p = Price::anthropic(3.0, 15.0);
        // 1M of each: 3 + 15 + 3.75 + 0.3.
        let u = usage(1_000_000, 1_000_000, 1_000_000, 1_000_000);
        assert!(close(p.cost(&u), 22.05));
        assert!(close(p.cost(&usage(1000, 200, 0, 0)), 0.006));
        assert_eq!(p.cost(&Usage::default()), 0.0);
        let t = PriceTable::default();
        assert_eq!(t.cost("no-such-model", &u), 0.0);
        assert_eq!(t.cost("no-such-model", &u), 0.0);
        assert!(close(
            t.cost("gpt-4o-mini", &usage(1_000_000, 0, 0, 1_000_000)),
            0.225
        ));
    }

    #[test]
    fn a_price_file_adds_and_replaces() {
        let t = PriceTable::with_overrides(
            r#"{"claude-fake": {"input": 10, "output": 20},
                "gpt-4o": {"input": 1, "output": 2, "cache_read": 0.5}}"#,
        )
        .unwrap();
        let f = t.price("claude-fake-1").unwrap();
        assert_eq!((f.cache_write, f.cache_read), (10.0, 10.0));
        assert_eq!(t.price("gpt-4o").unwrap().cache_read, 0.5);
        // Other defaults stay.
        assert_eq!(t.price("gpt-4o-mini").unwrap().input, 0.15);
        assert!(PriceTable::with_overrides(r#"{"x": {"input": -1, "output": 0}}"#).is_err());
        assert!(PriceTable::with_overrides(r#"{"x": {"input": 1}}"#).is_err());
        assert!(
            PriceTable::with_overrides(r#"{"x": {"input": 1, "output": 1, "cache": 1}}"#).is_err()
        );
        assert!(PriceTable::with_overrides("[]").is_err());
    }

    #[test]
    fn shares_and_totals() {
        assert_eq!(cache_read_share(&Usage::default()), None);
        assert_eq!(cache_read_share(&usage(10, 99, 10, 80)), Some(0.8));
        assert_eq!(total_tokens(&usage(1, 2, 3, 4)), 10);
    }

    #[test]
    fn a_removed_members_spend_stays_with_the_team_and_its_name() {
        let mut cfg = TeamConfig {
            team_budget_usd: Some(1.0),
            ..TeamConfig::default()
        };
        let mut a = Member::new("a", "r");
        record_call(&mut a, 1, &usage(100, 10, 0, 0), 0.25);
        let mut b = Member::new("b", "r");
        record_call(&mut b, 1, &usage(1000, 0, 0, 0), 0.5);
        record_call(&mut b, 2, &usage(1000, 0, 0, 0), 0.5);
        cfg.members = vec![a.clone(), b];
        assert!(close(team_spend(&cfg).cost_usd, 1.25));
        assert!(team_over_budget(&cfg).is_some());
        // `lead up --prune` takes b off the roster: the team's spend is what it was.
        let gone = cfg.remove_member("b").unwrap();
        assert_eq!(gone.calls, 2);
        assert!(cfg.member("b").is_none());
        assert!(close(team_spend(&cfg).cost_usd, 1.25));
        assert_eq!(team_spend(&cfg).calls, 3);
        assert!(
            team_over_budget(&cfg)
                .unwrap()
                .contains("the team spent $1.2500")
        );
        // b comes back under the same name: its budgets count its earlier life too.
        cfg.team_budget_usd = None;
        let mut b = Member::new("b", "r");
        b.budget_usd = Some(0.75);
        assert_eq!(
            over_budget(&cfg, &b).as_deref(),
            Some("budget: b spent $1.0000 of its $0.7500 budget")
        );
        b.budget_usd = Some(2.0);
        b.budget_tokens = Some(2000);
        assert!(over_budget(&cfg, &b).unwrap().contains("used 2000 tokens"));
        b.budget_tokens = None;
        assert_eq!(over_budget(&cfg, &b), None);
        record_call(&mut b, 1, &usage(1000, 0, 0, 0), 0.5);
        cfg.members.push(b);
        assert!(close(team_spend(&cfg).cost_usd, 1.75));
        assert!(close(
            life_spend(&cfg, cfg.member("b").unwrap()).cost_usd,
            1.5
        ));
        // Removed again: the two lives add up; other members are untouched.
        cfg.remove_member("b").unwrap();
        assert!(close(team_spend(&cfg).cost_usd, 1.75));
        assert_eq!(cfg.remove_member("zed"), None);
        assert_eq!(cfg.member("a"), Some(&a));
    }

    #[test]
    fn ledger_and_budgets() {
        let mut cfg = TeamConfig::default();
        let mut m = Member::new("a", "r");
        record_call(&mut m, 1, &usage(100, 10, 0, 0), 0.25);
        record_call(&mut m, 1, &usage(100, 10, 0, 0), 0.25);
        record_call(&mut m, 2, &usage(50, 5, 5, 40), 0.5);
        assert_eq!(m.calls, 3);
        assert!(close(m.cost_usd, 1.0));
        assert_eq!(m.ledger.len(), 2);
        assert_eq!(m.ledger[0].spend.calls, 2);
        assert_eq!(m.ledger[1].spend.usage.cache_read_input_tokens, 40);
        assert_eq!(over_budget(&cfg, &m), None);
        m.budget_usd = Some(1.5);
        assert_eq!(over_budget(&cfg, &m), None);
        m.budget_usd = Some(1.0);
        assert!(
            over_budget(&cfg, &m)
                .unwrap()
                .contains("of its $1.0000 budget")
        );
        m.budget_usd = Some(2.0);
        m.budget_tokens = Some(320);
        assert!(over_budget(&cfg, &m).unwrap().contains("320-token"));
        m.budget_tokens = None;
        cfg.members.push(m.clone());
        cfg.lead_spend = Some(Spend {
            calls: 1,
            usage: Usage::default(),
            cost_usd: 0.5,
        });
        cfg.team_budget_usd = Some(2.0);
        assert!(close(team_spend(&cfg).cost_usd, 1.5));
        assert_eq!(over_budget(&cfg, &m), None);
        cfg.team_budget_usd = Some(1.5);
        assert!(
            over_budget(&cfg, &m)
                .unwrap()
                .contains("the team spent $1.5000")
        );
        // The ledger's JSON is flat.
        let v = serde_json::to_value(m.ledger[1]).unwrap();
        assert_eq!(v["incarnation"], 2);
        assert_eq!(v["cache_read_input_tokens"], 40);
        assert_eq!(v["cost_usd"], 0.5);
    }
}
