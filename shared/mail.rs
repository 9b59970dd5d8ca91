//! Sending a message to a named agent, with the roster checks of DESIGN.md section 3.
//!
//! A message to an unknown name, or to a teammate that is shut down or failed (whose inbox
//! nobody will read), is an error returned to the sender rather than a silent orphan inbox.

use serde_json::json;

use crate::config::Roster;
use crate::error::{Error, Result};
use crate::events;
use crate::inbox::{Durability, Inbox};
use crate::message::Message;
use crate::teamdir::{AgentName, TeamDir};

/// Whether a stopped recipient may receive (the CLI: yes, it reads when the team runs again; a
/// teammate's `send_message`: no, nobody is there to answer now).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    Accept,
    Refuse,
}

/// Validates `msg.to` against the roster and appends `msg` to its inbox.
pub fn send(team: &TeamDir, msg: &Message, stopped: Stopped, durability: Durability) -> Result<()> {
    let to = AgentName::any(&msg.to)?;
    if !to.is_lead() {
        let cfg = Roster::new(team).load_for(to.as_str())?;
        let member = cfg.require(to.as_str())?;
        let refuse = member.status.is_terminal()
            || (stopped == Stopped::Refuse
                && member.status == crate::config::MemberStatus::Stopped);
        if refuse {
            return Err(Error::MemberConflict {
                name: to.to_string(),
                status: member.status.to_string(),
                why: "nobody reads its inbox until it is spawned again",
            });
        }
    }
    Inbox::new(team, &to).append(msg, durability)?;
    let preview: String = msg.content.chars().take(200).collect();
    events::log(
        team,
        "message",
        json!({"from": msg.from, "to": msg.to, "type": msg.kind, "id": msg.id, "text": preview}),
    );
    Ok(())
}
