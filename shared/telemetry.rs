//! OpenTelemetry export: with `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) set, a worker and `lead chat` export spans over
//! OTLP/HTTP with protobuf (the SDK's batch processor on its own thread, the blocking reqwest
//! client: no async runtime troupe starts or enters). Unset, or with `OTEL_SDK_DISABLED=true`,
//! nothing is built: no thread, no socket, and every call here returns at once.
//!
//! What is exported, with `troupe.team` and `troupe.member` on every span:
//!
//! - a trace per activation (span `activation`), linked to the span that sent the message that
//!   woke it (a message sent while a span is current carries its `traceparent`);
//! - a span per model call, a child of its activation, after the GenAI semantic conventions
//!   (semconv 1.37: `gen_ai.operation.name` `chat`, `gen_ai.provider.name`,
//!   `gen_ai.request.model`, `gen_ai.response.model`, `gen_ai.usage.input_tokens`,
//!   `gen_ai.usage.output_tokens`, and the cache's `gen_ai.usage.cache_read.input_tokens` and
//!   `gen_ai.usage.cache_creation.input_tokens`), from the times the journal records, the wait
//!   for the rate governor as `troupe.governor.wait_s`;
//! - a span per tool call (`execute_tool NAME`, `gen_ai.tool.name`, `gen_ai.tool.call.id`),
//!   current while the tool runs: a `bash` command gets it as `TRACEPARENT`.
//!
//! Every other `OTEL_*` variable (`OTEL_EXPORTER_OTLP_HEADERS` often holds a key) is kept from
//! commands and hooks. The flush at exit is bounded ([`FLUSH`]), so a collector that is down
//! never delays a stop.

use std::sync::{Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry::trace::{
    Link, Span as _, SpanContext, SpanId, SpanKind, TraceContextExt, TraceFlags, TraceId,
    TraceState, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::trace::{SdkTracerProvider, Span, Tracer};

use crate::llm::Usage;

/// The longest the export at exit may take.
pub const FLUSH: Duration = Duration::from_secs(1);

struct Exporter {
    provider: SdkTracerProvider,
    tracer: Tracer,
    /// The attributes every span carries.
    common: Vec<KeyValue>,
    /// `gen_ai.provider.name` of this process's model calls.
    provider_name: &'static str,
}

static ON: OnceLock<Exporter> = OnceLock::new();
/// The span current now (a tool call's): what a command gets as `TRACEPARENT` and a message
/// sent now carries.
static CURRENT: Mutex<Option<SpanContext>> = Mutex::new(None);

/// Whether the environment asks for the export.
pub fn wanted() -> bool {
    let set = |k: &str| std::env::var_os(k).is_some_and(|v| !v.is_empty());
    let disabled = std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
    !disabled && (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
}

/// Starts the export for process `service` (`troupe-worker`, `troupe-lead`) acting as
/// `member` of `team`, with model calls to `provider_name`, if the environment asks for it
/// (see [`wanted`]). Call it after the TLS provider is installed. A failure is logged and
/// leaves the export off.
pub fn init(service: &str, team: &str, member: &str, provider_name: &'static str) {
    if !wanted() || ON.get().is_some() {
        return;
    }
    // The exporter's HTTP client is built now, and needs the process's TLS provider.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .build();
    let exporter = match exporter {
        Ok(e) => e,
        Err(e) => {
            tracing::warn!("OpenTelemetry export off: {e}");
            return;
        }
    };
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service.to_owned())
        .build();
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build();
    let tracer = provider.tracer("troupe");
    let common = vec![
        KeyValue::new("troupe.team", team.to_owned()),
        KeyValue::new("troupe.member", member.to_owned()),
    ];
    let _ = ON.set(Exporter {
        provider,
        tracer,
        common,
        provider_name,
    });
}

/// Sends what is left, for at most [`FLUSH`], and stops the export.
pub fn shutdown() {
    if let Some(on) = ON.get() {
        // The batch thread's own timeout bounds the export; a collector that does not answer
        // costs at most FLUSH.
        if let Err(e) = on.provider.shutdown_with_timeout(FLUSH) {
            tracing::debug!("OpenTelemetry flush at exit: {e}");
        }
    }
}

fn time(t: f64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs_f64(t.max(0.0))
}

/// `00-TRACE-SPAN-FLAGS` (W3C Trace Context) of `sc`.
pub fn traceparent_of(sc: &SpanContext) -> String {
    format!(
        "00-{}-{}-{:02x}",
        sc.trace_id(),
        sc.span_id(),
        sc.trace_flags().to_u8()
    )
}

/// The span context a `traceparent` names (`None` for anything malformed).
pub fn parse_traceparent(s: &str) -> Option<SpanContext> {
    let mut parts = s.trim().split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version != "00" || trace.len() != 32 || span.len() != 16 || flags.len() != 2 {
        return None;
    }
    let trace = TraceId::from_hex(trace).ok()?;
    let span = SpanId::from_hex(span).ok()?;
    let flags = u8::from_str_radix(flags, 16).ok()?;
    if trace == TraceId::INVALID || span == SpanId::INVALID {
        return None;
    }
    Some(SpanContext::new(
        trace,
        span,
        TraceFlags::new(flags),
        true,
        TraceState::default(),
    ))
}

/// The `traceparent` of the span current now, if the export is on and one is.
pub fn current_traceparent() -> Option<String> {
    ON.get()?;
    CURRENT.lock().ok()?.as_ref().map(traceparent_of)
}

/// An activation's span (a no-op with the export off); ended when dropped.
pub struct Activation(Option<Span>);

impl Activation {
    /// No activation (nothing to export into).
    pub fn none() -> Activation {
        Activation(None)
    }

    /// Begins an activation at `at`, woken by a message that carried `woken_by` (its
    /// `traceparent`), if any.
    pub fn begin(at: f64, woken_by: Option<&str>) -> Activation {
        let Some(on) = ON.get() else {
            return Activation(None);
        };
        let links = woken_by
            .and_then(parse_traceparent)
            .map(|sc| vec![Link::with_context(sc)])
            .unwrap_or_default();
        let span = on
            .tracer
            .span_builder("activation")
            .with_kind(SpanKind::Internal)
            .with_start_time(time(at))
            .with_attributes(on.common.clone())
            .with_links(links)
            .start_with_context(&on.tracer, &Context::new());
        Activation(Some(span))
    }

    /// [`Activation::begin`] now, woken by the first of `unseen` (the messages not yet shown
    /// to the model) that carries a `traceparent`.
    pub fn woken_by(unseen: &[crate::message::Message]) -> Activation {
        let link = unseen.iter().find_map(|m| m.traceparent.as_deref());
        Activation::begin(crate::fsutil::now(), link)
    }

    /// Whether this is a live span (the export is on).
    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }

    fn context(&self) -> Context {
        match &self.0 {
            Some(s) => Context::new().with_remote_span_context(s.span_context().clone()),
            None => Context::new(),
        }
    }

    /// A model call of this activation, from `start` to `end`.
    pub fn model_call(
        &self,
        start: f64,
        end: f64,
        request_model: &str,
        response_model: &str,
        usage: &Usage,
        waited: Option<f64>,
    ) {
        let Some(on) = ON.get().filter(|_| self.is_on()) else {
            return;
        };
        let mut attrs = on.common.clone();
        attrs.extend([
            KeyValue::new("gen_ai.operation.name", "chat"),
            KeyValue::new("gen_ai.provider.name", on.provider_name),
            KeyValue::new("gen_ai.request.model", request_model.to_owned()),
            KeyValue::new("gen_ai.response.model", response_model.to_owned()),
            KeyValue::new("gen_ai.usage.input_tokens", usage.input_tokens as i64),
            KeyValue::new("gen_ai.usage.output_tokens", usage.output_tokens as i64),
            KeyValue::new(
                "gen_ai.usage.cache_read.input_tokens",
                usage.cache_read_input_tokens as i64,
            ),
            KeyValue::new(
                "gen_ai.usage.cache_creation.input_tokens",
                usage.cache_creation_input_tokens as i64,
            ),
        ]);
        if let Some(w) = waited {
            attrs.push(KeyValue::new("troupe.governor.wait_s", w));
        }
        let mut span = on
            .tracer
            .span_builder(format!("chat {request_model}"))
            .with_kind(SpanKind::Client)
            .with_start_time(time(start))
            .with_attributes(attrs)
            .start_with_context(&on.tracer, &self.context());
        span.end_with_timestamp(time(end));
    }

    /// A tool call of this activation, begun now: current (for `TRACEPARENT` and the
    /// messages it sends) until the returned guard is dropped.
    pub fn tool(&self, name: &str, call_id: &str) -> ToolSpan {
        let Some(on) = ON.get().filter(|_| self.is_on()) else {
            return ToolSpan(None);
        };
        let mut attrs = on.common.clone();
        attrs.extend([
            KeyValue::new("gen_ai.operation.name", "execute_tool"),
            KeyValue::new("gen_ai.tool.name", name.to_owned()),
            KeyValue::new("gen_ai.tool.call.id", call_id.to_owned()),
        ]);
        let span = on
            .tracer
            .span_builder(format!("execute_tool {name}"))
            .with_kind(SpanKind::Internal)
            .with_attributes(attrs)
            .start_with_context(&on.tracer, &self.context());
        if let Ok(mut c) = CURRENT.lock() {
            *c = Some(span.span_context().clone());
        }
        ToolSpan(Some(span))
    }

    /// Ends the activation at `at`.
    pub fn end(mut self, at: f64) {
        if let Some(mut s) = self.0.take() {
            s.end_with_timestamp(time(at));
        }
    }
}

impl Drop for Activation {
    fn drop(&mut self) {
        if let Some(mut s) = self.0.take() {
            s.end();
        }
    }
}

/// A tool call's span; ends (and stops being current) when dropped.
pub struct ToolSpan(Option<Span>);

impl Drop for ToolSpan {
    fn drop(&mut self) {
        if let Some(mut s) = self.0.take() {
            if let Ok(mut c) = CURRENT.lock() {
                *c = None;
            }
            s.end();
        }
    }
}

/// Whether `name` is a variable of the export that commands and hooks must not see.
pub fn hidden_var(name: &std::ffi::OsStr) -> bool {
    let b = name.as_encoded_bytes();
    b.starts_with(b"OTEL_") || b == b"TRACEPARENT" || b == b"TRACESTATE"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_read_back_and_malformed_ones_are_refused() {
        let s = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let sc = parse_traceparent(s).unwrap();
        assert_eq!(traceparent_of(&sc), s);
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-zz-00f067aa0ba902b7-01",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{bad}");
        }
        assert!(hidden_var("OTEL_EXPORTER_OTLP_HEADERS".as_ref()));
        assert!(hidden_var("TRACEPARENT".as_ref()));
        assert!(!hidden_var("PATH".as_ref()));
    }
}
