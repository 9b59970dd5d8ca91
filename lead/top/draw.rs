//! Drawing `lead top`: the header, the members' table, the panes and the bottom lines; and the
//! same frame as plain text for `lead top --once`.

use ratatui::Frame as Screen;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, Cell, Paragraph, Row as TableRow, Table, TableState, Wrap};
use troupe::TeamDir;
use troupe::llm::Block as Content;
use troupe::store::files::events::last_lines;
use troupe::teamdir::AgentName;
use troupe::term_text;
use troupe::transcript::Entry;

use super::frame::{Frame, Row};
use super::{Pane, View};

const HELP: &str = "↑/↓ select  Enter details  m message  a approve plan  r reject plan  \
                    s shutdown  t board  q quit";

pub fn draw(f: &mut Screen, team: &TeamDir, view: &View) {
    let [head, body, foot] = Layout::vertical([
        Constraint::Length(3),
        Constraint::Min(3),
        Constraint::Length(2),
    ])
    .areas(f.area());
    f.render_widget(
        Paragraph::new(header(&view.frame)).block(Block::default().borders(Borders::BOTTOM)),
        head,
    );
    match &view.pane {
        Pane::Table => table(f, body, view),
        Pane::Member(name) => member(f, body, team, view, name),
        Pane::Board => board(f, body, &view.frame.tasks),
    }
    let first = match &view.prompt {
        Some(p) => format!("{}{}_", p.label, p.text),
        None => view.note.clone(),
    };
    f.render_widget(
        Paragraph::new(vec![
            Line::from(first),
            Line::styled(HELP, Style::default().add_modifier(Modifier::DIM)),
        ]),
        foot,
    );
}

fn header(fr: &Frame) -> Vec<Line<'static>> {
    let h = &fr.header;
    let budget = h
        .budget_usd
        .map_or(String::new(), |b| format!(" of {}", troupe::cost::usd(b)));
    let tasks = if h.tasks.is_empty() {
        "none".to_owned()
    } else {
        h.tasks
            .iter()
            .map(|(s, n)| format!("{s} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    // The team's name and the rate governor's state are read from files: escaped, as is
    // every text of the frame ([`troupe::term_text`]).
    let esc = |s: String| Line::from(term_text::line(&s).into_owned());
    vec![
        esc(format!(
            "troupe top  team {}  supervisor {}  cost {}{budget}  calls {} ({} in flight)  rate {}",
            if fr.team_name.is_empty() {
                "-"
            } else {
                &fr.team_name
            },
            if fr.supervisor {
                "running"
            } else {
                "not running"
            },
            troupe::cost::usd(h.cost_usd),
            h.calls,
            h.calls_in_flight,
            h.rate
        )),
        esc(format!(
            "tasks: {tasks}   lints: {}   {} members",
            h.lints,
            fr.rows.len()
        )),
    ]
}

fn age(secs: Option<f64>) -> String {
    match secs {
        None => "-".into(),
        Some(s) if s < 90.0 => format!("{s:.0}s"),
        Some(s) if s < 5400.0 => format!("{:.0}m", s / 60.0),
        Some(s) => format!("{:.1}h", s / 3600.0),
    }
}

/// The cells of one member's row, as text: each escaped as a cell of tab-separated output
/// (a role, what a beat says it does and a lint quote a model's text).
fn cells(r: &Row, now: f64) -> Vec<String> {
    let mut place = match (&r.host, &r.branch) {
        (Some(h), Some(b)) => format!("{h} {b}"),
        (Some(h), None) => h.clone(),
        (None, Some(b)) => b.clone(),
        (None, None) => "-".into(),
    };
    if let Some(m) = &r.merge {
        place = format!("{place} ({m})");
    }
    vec![
        r.name.clone(),
        r.role.clone(),
        r.state.clone(),
        r.liveness.to_owned(),
        r.doing_now.clone(),
        age(r.doing_since.map(|t| now - t)),
        age(r.silent_for),
        r.tokens.to_string(),
        troupe::cost::usd(r.cost_usd),
        r.cache_share
            .map_or("-".into(), |s| format!("{:.0}%", s * 100.0)),
        r.inbox.to_string(),
        r.pending_requests.len().to_string(),
        place,
        r.lints.join("; "),
    ]
    .into_iter()
    .map(|c| term_text::cell(&c).into_owned())
    .collect()
}

const COLUMNS: [&str; 14] = [
    "NAME",
    "ROLE",
    "STATE",
    "LIVE",
    "DOING",
    "AGE",
    "SILENT",
    "TOKENS",
    "COST",
    "CACHE",
    "INBOX",
    "REQ",
    "HOST/BRANCH",
    "LINTS",
];

fn table(f: &mut Screen, area: Rect, view: &View) {
    let now = view.frame.at;
    let rows = view.frame.rows.iter().map(|r| {
        let style = if !r.lints.is_empty() {
            Style::default().fg(Color::Yellow)
        } else if matches!(r.liveness, "dead" | "hung") {
            Style::default().fg(Color::Red)
        } else {
            Style::default()
        };
        TableRow::new(cells(r, now).into_iter().map(Cell::from)).style(style)
    });
    let widths = [
        Constraint::Length(12),
        Constraint::Length(10),
        Constraint::Length(12),
        Constraint::Length(10),
        Constraint::Min(18),
        Constraint::Length(5),
        Constraint::Length(6),
        Constraint::Length(8),
        Constraint::Length(8),
        Constraint::Length(5),
        Constraint::Length(5),
        Constraint::Length(3),
        Constraint::Min(12),
        Constraint::Min(10),
    ];
    let t = Table::new(rows, widths)
        .header(
            TableRow::new(COLUMNS.iter().map(|c| Cell::from(*c)))
                .style(Style::default().add_modifier(Modifier::BOLD)),
        )
        .row_highlight_style(Style::default().add_modifier(Modifier::REVERSED));
    let mut state = TableState::default().with_selected(Some(view.selected));
    f.render_stateful_widget(t, area, &mut state);
}

fn member(f: &mut Screen, area: Rect, team: &TeamDir, view: &View, name: &str) {
    let [left, right] =
        Layout::horizontal([Constraint::Percentage(60), Constraint::Percentage(40)]).areas(area);
    let row = view.frame.rows.iter().find(|r| r.name == name);
    let here = team.store().this_host();
    let elsewhere = row
        .and_then(|r| r.host.as_deref())
        .is_some_and(|h| here.as_deref() != Some(h));
    let Ok(agent) = AgentName::teammate(name) else {
        return;
    };
    let transcript = team.transcript(&agent);
    let lines: Vec<Line> = if elsewhere && !transcript.exists() {
        let r = row.expect("a row");
        [
            format!(
                "{name} runs on host {}: its transcript and log are in that host's team dir \
                 (`lead logs {name}` there).",
                r.host.as_deref().unwrap_or("?")
            ),
            format!(
                "The bus holds: status {}, {} message(s) in its inbox, requests {:?}, lints {:?}.",
                r.status, r.inbox, r.pending_requests, r.lints
            ),
        ]
        .iter()
        .map(|l| Line::from(term_text::line(l).into_owned()))
        .collect()
    } else {
        // The latest entries that fit (an entry may wrap to more than one line).
        transcript_tail(&transcript, (area.height as usize).saturating_sub(2).max(1))
            .into_iter()
            .map(|l| Line::from(term_text::line(&l).into_owned()))
            .collect()
    };
    f.render_widget(
        Paragraph::new(lines).wrap(Wrap { trim: true }).block(
            Block::default()
                .borders(Borders::ALL)
                .title(format!(" {name}: transcript (Esc to go back) ")),
        ),
        left,
    );
    // Its last lines only, read back from the end: a worker's log is never trimmed.
    let tail: Vec<Line> = last_lines(&team.log(&agent), area.height as usize)
        .unwrap_or_default()
        .iter()
        .map(|l| Line::from(term_text::line(&String::from_utf8_lossy(l)).into_owned()))
        .collect();
    f.render_widget(
        Paragraph::new(tail)
            .wrap(Wrap { trim: true })
            .block(Block::default().borders(Borders::ALL).title(" log ")),
        right,
    );
}

/// The last `n` entries of a journal, one line each: read back from its end, not the whole
/// journal at every frame (a journal holds every model turn of the member's life). A line
/// that does not parse as an entry is left out.
fn transcript_tail(path: &std::path::Path, n: usize) -> Vec<String> {
    let Ok(lines) = last_lines(path, n) else {
        return vec!["(no transcript here)".into()];
    };
    let entries: Vec<Entry> = lines
        .iter()
        .filter_map(|l| serde_json::from_slice(l).ok())
        .collect();
    let short = |t: &str| {
        let one = t.split_whitespace().collect::<Vec<_>>().join(" ");
        if one.chars().count() > 160 {
            format!("{}…", one.chars().take(159).collect::<String>())
        } else {
            one
        }
    };
    let skip = entries.len().saturating_sub(n);
    entries[skip..]
        .iter()
        .map(|e| match e {
            Entry::Session {
                incarnation, pid, ..
            } => format!("-- incarnation {incarnation}, pid {pid}"),
            Entry::Inbox { message, .. } => {
                format!(
                    "<- {} ({}): {}",
                    message.from,
                    message.kind,
                    short(&message.content)
                )
            }
            Entry::Assistant { response, .. } => {
                let parts: Vec<String> = response
                    .content
                    .iter()
                    .map(|b| match b {
                        Content::Text { text } => short(text),
                        Content::ToolUse { name, input, .. } => {
                            format!("[{name} {}]", short(&input.to_string()))
                        }
                        _ => String::new(),
                    })
                    .filter(|s| !s.is_empty())
                    .collect();
                format!("model: {}", parts.join(" "))
            }
            Entry::ToolResults { results, .. } => format!("   {} tool result(s)", results.len()),
            Entry::Idle { .. } => "-- idle".into(),
            Entry::Compaction { .. } => "-- compacted".into(),
            Entry::User { text, .. } => format!("person: {}", short(text)),
            _ => String::new(),
        })
        .filter(|l| !l.is_empty())
        .collect()
}

/// The board as the frame read it.
fn board(f: &mut Screen, area: Rect, tasks: &[troupe::tasks::Task]) {
    let lines: Vec<Line> = if tasks.is_empty() {
        vec![Line::from("The board is empty.")]
    } else {
        tasks
            .iter()
            .map(|t| {
                Line::from(
                    term_text::line(&format!(
                        "{:<9} {:<12} {:<12} {}",
                        t.id,
                        t.status.as_str(),
                        t.owner.as_deref().unwrap_or("-"),
                        t.subject
                    ))
                    .into_owned(),
                )
            })
            .collect()
    };
    f.render_widget(
        Paragraph::new(lines).block(
            Block::default()
                .borders(Borders::ALL)
                .title(" the board (Esc to go back) "),
        ),
        area,
    );
}

/// The frame as plain text (`lead top --once`).
pub fn plain(fr: &Frame) -> String {
    let mut out = String::new();
    for l in header(fr) {
        out.push_str(&l.to_string());
        out.push('\n');
    }
    out.push_str(&COLUMNS.join("\t"));
    out.push('\n');
    for r in &fr.rows {
        out.push_str(&cells(r, fr.at).join("\t"));
        out.push('\n');
    }
    out
}
