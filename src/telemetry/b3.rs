//! B3 trace context, as Envoy's Zipkin tracer sends it: the single `b3` header
//! (`{trace}-{span}[-{sampled}[-{parent}]]`) or the `x-b3-*` headers.

use opentelemetry::propagation::Extractor;
use opentelemetry::trace::SpanContext;

use super::remote_span_context;

/// The B3 context in `carrier`, if one is there and valid.
pub(super) fn extract(carrier: &dyn Extractor) -> Option<SpanContext> {
    if let Some(single) = carrier.get("b3") {
        let mut parts = single.trim().split('-');
        let trace_id = parts.next()?;
        let span_id = parts.next()?;
        // Absent sampling state: Envoy sampled it, or it would not have sent the context on.
        let sampled = parts.next().is_none_or(is_sampled);
        return remote_span_context(trace_id, span_id, sampled);
    }
    let trace_id = carrier.get("x-b3-traceid")?;
    let span_id = carrier.get("x-b3-spanid")?;
    let sampled = carrier.get("x-b3-flags").is_some_and(|flags| flags == "1")
        || carrier.get("x-b3-sampled").is_none_or(is_sampled);
    remote_span_context(trace_id.trim(), span_id.trim(), sampled)
}

/// B3's sampling state: `1`, `d` (debug) or the legacy `true` mean sampled.
fn is_sampled(state: &str) -> bool {
    matches!(state.trim(), "1" | "d" | "true")
}
