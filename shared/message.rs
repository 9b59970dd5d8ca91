//! The message envelope of DESIGN.md section 3, and its wire form (one JSON object per line).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::fsutil;

/// Largest serialized message (the JSON line, newline included) that may be sent.
pub const MAX_MESSAGE_BYTES: usize = 256 * 1024;

/// The message types of the protocol. Anything else is refused at send time and set aside when
/// found in an inbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MessageType {
    Message,
    Broadcast,
    ShutdownRequest,
    ShutdownResponse,
    PlanApproval,
    PlanApprovalResponse,
    TaskAssignment,
    TaskResult,
    StatusUpdate,
    IdleNotification,
}

impl MessageType {
    /// Every type, in the order of DESIGN.md.
    pub const ALL: [MessageType; 10] = [
        MessageType::Message,
        MessageType::Broadcast,
        MessageType::ShutdownRequest,
        MessageType::ShutdownResponse,
        MessageType::PlanApproval,
        MessageType::PlanApprovalResponse,
        MessageType::TaskAssignment,
        MessageType::TaskResult,
        MessageType::StatusUpdate,
        MessageType::IdleNotification,
    ];

    /// The names of [`MessageType::ALL`], comma-separated, for error messages.
    pub const ALL_NAMES: &'static str = "message, broadcast, shutdown_request, shutdown_response, \
        plan_approval, plan_approval_response, task_assignment, task_result, status_update, \
        idle_notification";

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            MessageType::Message => "message",
            MessageType::Broadcast => "broadcast",
            MessageType::ShutdownRequest => "shutdown_request",
            MessageType::ShutdownResponse => "shutdown_response",
            MessageType::PlanApproval => "plan_approval",
            MessageType::PlanApprovalResponse => "plan_approval_response",
            MessageType::TaskAssignment => "task_assignment",
            MessageType::TaskResult => "task_result",
            MessageType::StatusUpdate => "status_update",
            MessageType::IdleNotification => "idle_notification",
        }
    }

    /// Whether this type belongs to a request protocol (and so carries a `request_id`).
    pub fn is_protocol(self) -> bool {
        matches!(
            self,
            MessageType::ShutdownRequest
                | MessageType::ShutdownResponse
                | MessageType::PlanApproval
                | MessageType::PlanApprovalResponse
        )
    }
}

impl fmt::Display for MessageType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

impl FromStr for MessageType {
    type Err = Error;
    fn from_str(s: &str) -> Result<MessageType> {
        MessageType::ALL
            .into_iter()
            .find(|t| t.as_str() == s)
            .ok_or_else(|| Error::UnknownMessageType(s.to_owned()))
    }
}

/// One message. `from`/`to` are kept as plain strings so that a line written by hand (or by an
/// older version) still parses; senders validate names before building one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// Unique id (a v4 uuid); the consumer's dedup key.
    pub id: String,
    #[serde(rename = "type")]
    pub kind: MessageType,
    pub from: String,
    pub to: String,
    #[serde(default)]
    pub content: String,
    pub timestamp: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approve: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feedback: Option<String>,
    /// The W3C `traceparent` of the span that sent it, when its sender exports traces (the
    /// activation it wakes links to it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

impl Message {
    /// A new message with a fresh id and the current time.
    pub fn new(kind: MessageType, from: &str, to: &str, content: impl Into<String>) -> Message {
        Message {
            id: crate::ids::uuid_v4().to_string(),
            kind,
            from: from.to_owned(),
            to: to.to_owned(),
            content: content.into(),
            timestamp: fsutil::now(),
            request_id: None,
            approve: None,
            reason: None,
            plan: None,
            feedback: None,
            traceparent: crate::telemetry::current_traceparent(),
        }
    }

    /// Builder: sets the request id.
    pub fn with_request(mut self, request_id: &str) -> Message {
        self.request_id = Some(request_id.to_owned());
        self
    }

    /// The message as one JSON line, `\n` included, refused if over [`MAX_MESSAGE_BYTES`].
    pub fn to_line(&self) -> Result<Vec<u8>> {
        let mut line = Vec::new();
        self.write_line(&mut line)?;
        Ok(line)
    }

    /// Appends [`Message::to_line`] to `buf` (a buffer reused across messages); on an error
    /// `buf` is as it was.
    pub fn write_line(&self, buf: &mut Vec<u8>) -> Result<()> {
        let start = buf.len();
        let written = serde_json::to_writer(&mut *buf, self);
        buf.push(b'\n');
        let size = buf.len() - start;
        if let Err(e) = written {
            buf.truncate(start);
            return Err(Error::Protocol(e.to_string()));
        }
        if size > MAX_MESSAGE_BYTES {
            buf.truncate(start);
            return Err(Error::MessageTooLarge {
                size,
                limit: MAX_MESSAGE_BYTES,
            });
        }
        Ok(())
    }

    /// Parses one inbox line (without its `\n`). Fails on anything that is not a whole, valid
    /// message: bad JSON, missing fields, an unknown type, an empty id.
    pub fn parse_line(line: &[u8]) -> std::result::Result<Message, String> {
        let msg: Message = serde_json::from_slice(line).map_err(|e| e.to_string())?;
        if msg.id.is_empty() {
            return Err("empty id".to_owned());
        }
        if msg.kind.is_protocol() && msg.request_id.is_none() {
            return Err(format!("{} without request_id", msg.kind));
        }
        Ok(msg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_wire_names() {
        let m = Message::new(MessageType::ShutdownRequest, "lead", "alice", "please stop")
            .with_request("a1b2c3d4");
        let line = m.to_line().unwrap();
        let text = std::str::from_utf8(&line).unwrap();
        assert!(text.ends_with('\n'));
        assert!(text.contains("\"type\":\"shutdown_request\""));
        assert!(text.contains("\"request_id\":\"a1b2c3d4\""));
        let back = Message::parse_line(&line[..line.len() - 1]).unwrap();
        assert_eq!(back, m);
    }

    #[test]
    fn unknown_type_is_refused() {
        let e = "gossip".parse::<MessageType>().unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "unknown message type \"gossip\" (expected one of: {})",
                MessageType::ALL_NAMES
            )
        );
        let line = br#"{"id":"x","type":"gossip","from":"a","to":"b","content":"","timestamp":1}"#;
        assert!(
            Message::parse_line(line)
                .unwrap_err()
                .contains("unknown variant")
        );
    }

    #[test]
    fn oversized_message_is_refused() {
        let m = Message::new(
            MessageType::Message,
            "lead",
            "alice",
            "x".repeat(300 * 1024),
        );
        let e = m.to_line().unwrap_err();
        assert!(
            e.to_string()
                .ends_with("bytes is over the 262144-byte limit"),
            "{e}"
        );
    }

    #[test]
    fn reference_shape_parses() {
        let line = br#"{"id":"1","type":"message","from":"alice","to":"lead","content":"hi","timestamp":1764672000.123,"extra":1}"#;
        let m = Message::parse_line(line).unwrap();
        assert_eq!(m.content, "hi");
        assert!(Message::parse_line(br#"{"id":"1","type":"plan_approval","from":"a","to":"lead","content":"","timestamp":1}"#).is_err());
    }
}
